//! Block digests remembered across requests: most requests repeat a prefix an earlier one had
//! (a system prompt, the turns before in a conversation), and hashing the request is most of a
//! routing decision. A block's digest depends only on the algorithm, its parent's digest (which
//! carries the seed and everything before), its tokens, its lookahead tokens (vLLM 0.33's
//! `num_hash_lookahead_tokens`) and its extra keys, so a block without extra keys seen before
//! is looked up instead of serialized and hashed again.
//!
//! Owns: (algorithm, lookahead count, parent digest, tokens and lookahead tokens) → digest for
//! blocks without extra keys, kept in *runs*: a request's new blocks are appended in order, so
//! a kept block's child usually sits right after it and a lookup walks a prefix sequentially
//! (no table probe per block). A block kept anywhere else — the first of a request's new
//! blocks, the first after a prefix other requests share — starts a run and is found through a
//! slot keyed by a fast hash of its whole prefix (the lookahead count in the first key); every
//! entry keeps its own slot key so the next one is computed without rehashing the prefix. All
//! under one lock, with the count of tokens kept (a block's lookahead tokens are kept and
//! counted with it).
//! When a request's new blocks would pass the bound, everything is dropped and filling starts
//! over with that request's blocks (a new generation: simple, and hot prefixes come back with
//! the next request that uses them). The lock is a leaf: taken under the index's locks,
//! nothing taken under it; a request keeps its blocks only if it gets the write lock at once.
//! Invariants: an entry's digest is exactly what `BlockHasher` computes for its algorithm,
//! parent, tokens and lookahead tokens with no extra keys (entries are only made from that); a
//! lookup answers only on equal algorithm, lookahead count, parent and tokens with lookahead
//! tokens (neither a slot key nor a neighbour's position picks the answer, only the check), so
//! a lookahead block is never answered by a block hashed without lookahead or with another
//! count; a position found under the read lock is used under the write lock only within the
//! same generation; the tokens kept never pass the bound, itself at most `MAX_TOKENS_LIMIT`
//! (arena offsets are 32-bit); `chain` returns exactly `BlockHasher::chain_lookahead`.
//! Must not: keep a block with extra keys (a salted request's first block, any LoRA block),
//! answer from a slot key or a position alone, or hold its lock while hashing a block it will
//! keep.

use super::{hashable_blocks, BlockExtras, BlockHasher, Digest, HashAlgo};
use crate::holder::MixBuild;
use parking_lot::RwLock;
use std::collections::HashMap;

/// Tokens the index's cache keeps by default: 4 MiB of token ids, about 11 MB in all at
/// 16-token hash blocks (65,536 blocks).
pub const DEFAULT_MAX_TOKENS: usize = 1 << 20;

/// The largest bound a cache takes (2^31 tokens, 8 GiB of token ids).
pub const MAX_TOKENS_LIMIT: usize = 1 << 31;

/// A kept block; its tokens, then its `lookahead` lookahead tokens, are `arena[at..at + len]`
/// (no allocation of its own, so dropping a generation frees nothing per entry).
struct Entry {
    algo: HashAlgo,
    lookahead: u16,
    parent: Digest,
    digest: Digest,
    /// The block's slot key (its whole prefix's), whether or not a slot points here.
    key: u64,
    at: u32,
    len: u32,
}

#[derive(Default)]
struct Inner {
    /// Slot key → index in `entries`, for the blocks that start a run (a small slot, so a
    /// miss probes a small table).
    map: HashMap<u64, u32, MixBuild>,
    /// Kept blocks in the order kept: a block that does not start a run follows the entry of
    /// its parent.
    entries: Vec<Entry>,
    /// Every kept block's tokens, appended; its length is what the bound counts.
    arena: Vec<u32>,
    /// Counts the tables' clearings, so a position found before a clearing is not used after.
    generation: u64,
}

impl Entry {
    /// Whether this is the block (algorithm, lookahead count, parent, tokens followed by the
    /// lookahead tokens): the only test an answer passes.
    fn is(&self, arena: &[u32], block: &Block<'_>) -> bool {
        let at = self.at as usize;
        self.algo == block.algo
            && self.lookahead == block.lookahead
            && self.parent == *block.parent
            && arena.get(at..at + self.len as usize) == Some(block.span)
    }
}

/// One block as a lookup or a keep looks for it.
struct Block<'a> {
    algo: HashAlgo,
    lookahead: u16,
    parent: &'a Digest,
    /// Its tokens followed by its lookahead tokens.
    span: &'a [u32],
}

impl Inner {
    /// Where `block` is kept, given where its parent is (`None` for a request's first kept
    /// block, whose slot key is computed from `seed`): right after the parent, else in the
    /// slot of its key.
    fn find(&self, parent_at: Option<usize>, seed: &Seed, block: &Block<'_>, mask: u64) -> Found {
        if let Some(next) = parent_at.map(|p| p + 1) {
            if self
                .entries
                .get(next)
                .is_some_and(|e| e.is(&self.arena, block))
            {
                return Found::At(next);
            }
        }
        let key = match parent_at.and_then(|p| self.entries.get(p)) {
            Some(parent) => slot_key(parent.key, None, block.span),
            None => slot_key(seed.key, Some(&seed.anchor), block.span),
        };
        match self.map.get(&(key & mask)) {
            Some(&at)
                if self
                    .entries
                    .get(at as usize)
                    .is_some_and(|e| e.is(&self.arena, block)) =>
            {
                Found::At(at as usize)
            }
            _ => Found::Missing(key),
        }
    }
}

/// Where a block is kept, or the slot key it would be kept under.
enum Found {
    At(usize),
    Missing(u64),
}

/// What a request's first kept block's slot key starts from: the algorithm and lookahead count,
/// and the digest it chains on.
struct Seed {
    key: u64,
    anchor: Digest,
}

/// How far a lookup got: its generation, the position of the last block it found (`None`: no
/// block found) and the first block it did not find.
struct Reached {
    generation: u64,
    last: Option<usize>,
    first_new: usize,
}

/// What one `chain` call did, for the index's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheUse {
    /// Blocks answered from the cache.
    pub hits: u64,
    /// Blocks hashed (kept or not).
    pub hashed: u64,
}

/// The cache (see the module doc). `max_tokens == 0` turns it off.
pub struct DigestCache {
    inner: RwLock<Inner>,
    max_tokens: usize,
    /// Bits of a slot key kept: all but in tests, which narrow it to force slot collisions.
    key_mask: u64,
}

impl Default for DigestCache {
    fn default() -> Self {
        DigestCache::new(DEFAULT_MAX_TOKENS)
    }
}

/// A request's blocks as `chain` sees them: each with its lookahead tokens, from its first
/// keepable block on.
struct Request<'a> {
    spans: Vec<&'a [u32]>,
    /// The first block that may be kept (1 after a salted first block, else 0).
    first: usize,
    seed: Seed,
    algo: HashAlgo,
    lookahead: u16,
}

impl Request<'_> {
    /// Block `i` whose parent's digest is `parent`.
    fn block<'b>(&'b self, i: usize, parent: &'b Digest) -> Block<'b> {
        Block {
            algo: self.algo,
            lookahead: self.lookahead,
            parent,
            span: self.spans[i],
        }
    }
}

impl DigestCache {
    /// A cache keeping at most `max_tokens` tokens (0: off). Bounds past `MAX_TOKENS_LIMIT`
    /// are taken as that limit (entries address the token arena with 32-bit offsets).
    pub fn new(max_tokens: usize) -> DigestCache {
        DigestCache {
            inner: RwLock::new(Inner::default()),
            max_tokens: max_tokens.min(MAX_TOKENS_LIMIT),
            key_mask: u64::MAX,
        }
    }

    /// A cache whose slot keys keep only `mask`'s bits, so unrelated blocks share slots.
    #[cfg(test)]
    fn colliding(max_tokens: usize, mask: u64) -> DigestCache {
        DigestCache {
            key_mask: mask,
            ..DigestCache::new(max_tokens)
        }
    }

    /// Digests of every `block`-token hash block of `tokens` with `lookahead` lookahead
    /// tokens: `hasher.chain_lookahead(tokens, block, extras, lookahead)`, with the blocks seen
    /// before looked up.
    ///
    /// The lookup walks the request's blocks in order: each is checked first against the entry
    /// right after its parent's (sequential memory, no hashing of the prefix), then in the
    /// slot of its prefix's key. From the first miss on, blocks are hashed without a lock,
    /// then kept (`keep`).
    pub fn chain(
        &self,
        hasher: &BlockHasher,
        tokens: &[u32],
        block: usize,
        extras: &BlockExtras,
        lookahead: usize,
    ) -> (Vec<Digest>, CacheUse) {
        let Some(look) = u16::try_from(lookahead)
            .ok()
            .filter(|_| block > 0 && self.max_tokens >= block + lookahead && extras.lora.is_none())
        else {
            let chain = hasher.chain_lookahead(tokens, block, extras, lookahead);
            let hashed = chain.len() as u64;
            return (chain, CacheUse { hits: 0, hashed });
        };
        let algo = hasher.algo();
        // Each block with its lookahead tokens (all of them exist: only hashable blocks).
        let spans: Vec<&[u32]> = (0..hashable_blocks(tokens.len(), block, lookahead))
            .map(|i| &tokens[i * block..(i + 1) * block + lookahead])
            .collect();
        let hash = |parent: Option<&Digest>, span: &[u32], i: usize| {
            let (own, after) = span.split_at(block);
            hasher.hash_block_lookahead(parent, own, extras, i, after)
        };
        let mut out: Vec<Digest> = Vec::with_capacity(spans.len());
        let mut used = CacheUse::default();
        // A salted first block carries its salt: hashed every time, never kept; the blocks
        // after it chain on its digest.
        let first = usize::from(extras.cache_salt.is_some());
        if first == 1 {
            if let Some(span) = spans.first() {
                out.push(hash(None, span, 0));
                used.hashed += 1;
            }
        }
        let anchor = *out.last().unwrap_or(hasher.none_hash());
        let req = Request {
            spans,
            first,
            seed: Seed {
                key: algo as u64 | (u64::from(look) << 8),
                anchor,
            },
            algo,
            lookahead: look,
        };
        let reached = self.look_up(&req, hasher, &mut out);
        used.hits = out.len().saturating_sub(first) as u64;
        for (i, span) in req.spans.iter().enumerate().skip(reached.first_new) {
            let d = hash(out.last(), span, i);
            out.push(d);
            used.hashed += 1;
        }
        if reached.first_new < req.spans.len() {
            self.keep(&req, &out, reached);
        }
        (out, used)
    }

    /// Appends to `out` the digests of the request's blocks found, in order from its first
    /// keepable block, up to the first one not kept.
    fn look_up(&self, req: &Request<'_>, hasher: &BlockHasher, out: &mut Vec<Digest>) -> Reached {
        let inner = self.inner.read();
        let mut last = None;
        for i in req.first..req.spans.len() {
            let parent = *out.last().unwrap_or(hasher.none_hash());
            match inner.find(last, &req.seed, &req.block(i, &parent), self.key_mask) {
                Found::At(at) => {
                    out.push(inner.entries[at].digest);
                    last = Some(at);
                }
                Found::Missing(_) => break,
            }
        }
        Reached {
            generation: inner.generation,
            last,
            first_new: out.len(),
        }
    }

    /// Keeps the request's blocks from the first its lookup did not find (from its first
    /// keepable block when the tables were cleared since), skipping any another request kept
    /// meanwhile. Skipped when another request is keeping its own (the cache only saves work;
    /// a request must not queue for it). When the new blocks do not fit, a new generation
    /// starts and the request's leading blocks are kept again, as many as fit, so its kept
    /// prefix stays reachable from its first block.
    fn keep(&self, req: &Request<'_>, out: &[Digest], reached: Reached) {
        let Some(mut inner) = self.inner.try_write() else {
            return;
        };
        let (mut from, mut last) = if inner.generation == reached.generation {
            (reached.first_new, reached.last)
        } else {
            (req.first, None)
        };
        let new: usize = req.spans[from..].iter().map(|c| c.len()).sum();
        if inner.arena.len() + new > self.max_tokens {
            // A new generation; the tables keep their room.
            inner.map.clear();
            inner.entries.clear();
            inner.arena.clear();
            inner.generation += 1;
            (from, last) = (req.first, None);
        }
        if inner.map.capacity() == 0 {
            // Room for a whole generation at once (up to 131,072 blocks): no growth and no
            // rehash on the way, whose pause would land on one unlucky request.
            let room = (self.max_tokens / req.spans[0].len().max(1)).min(1 << 17);
            inner.map.reserve(room);
            inner.entries.reserve(room);
            inner.arena.reserve(self.max_tokens.min(DEFAULT_MAX_TOKENS));
        }
        for i in from..req.spans.len() {
            let span = req.spans[i];
            if inner.arena.len() + span.len() > self.max_tokens {
                // Only a leading part of this request fits in one generation.
                break;
            }
            let parent = if i == req.first {
                req.seed.anchor
            } else {
                out[i - 1]
            };
            let block = req.block(i, &parent);
            let key = match inner.find(last, &req.seed, &block, self.key_mask) {
                Found::At(at) => {
                    // Kept already (another request with this prefix got here first).
                    last = Some(at);
                    continue;
                }
                Found::Missing(key) => key,
            };
            let Inner {
                map,
                entries,
                arena,
                ..
            } = &mut *inner;
            let at = entries.len();
            if last.map(|p| p + 1) != Some(at) {
                // Not right after its parent: a run starts here (a slot another prefix shares
                // goes to the newer block).
                map.insert(key & self.key_mask, at as u32);
            }
            entries.push(Entry {
                algo: req.algo,
                lookahead: req.lookahead,
                parent,
                digest: out[i],
                key,
                at: arena.len() as u32,
                len: span.len() as u32,
            });
            arena.extend_from_slice(span);
            last = Some(at);
        }
    }

    /// Tokens kept now.
    pub fn tokens(&self) -> usize {
        self.inner.read().arena.len()
    }

    /// Approximate heap bytes, as reserved: the slot table (16-byte buckets and a control byte
    /// each, about 8/7 of its capacity rounded up to a power of two), the entries and the token
    /// arena.
    pub fn heap_bytes(&self) -> usize {
        let inner = self.inner.read();
        let cap = inner.map.capacity();
        let buckets = if cap == 0 {
            0
        } else {
            (cap * 8 / 7).next_power_of_two()
        };
        buckets * (16 + 1)
            + inner.entries.capacity() * std::mem::size_of::<Entry>()
            + inner.arena.capacity() * 4
    }
}

/// The slot key of a block: xxh3-64 over the key before it (or, for the first block kept, the
/// algorithm and the digest it chains on) and its tokens, in one pass over a buffer (on the
/// stack for blocks of up to 64 tokens).
/// Only picks the slot: an entry is always checked against the digests before it is used.
fn slot_key(before: u64, anchor: Option<&Digest>, tokens: &[u32]) -> u64 {
    const ROOM: usize = 64;
    let head = 8 + anchor.map_or(0, |a| a.len());
    let mut stack = [0u8; 40 + 4 * ROOM];
    let mut heap = Vec::new();
    let buf: &mut [u8] = if tokens.len() <= ROOM {
        &mut stack[..head + 4 * tokens.len()]
    } else {
        heap.resize(head + 4 * tokens.len(), 0);
        &mut heap
    };
    buf[..8].copy_from_slice(&before.to_le_bytes());
    if let Some(a) = anchor {
        buf[8..head].copy_from_slice(a);
    }
    for (at, t) in buf[head..].chunks_exact_mut(4).zip(tokens) {
        at.copy_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn extras(salt: Option<&str>, lora: bool) -> BlockExtras {
        BlockExtras {
            cache_salt: salt.map(str::to_string),
            lora: lora.then(|| ("adapter".to_string(), "/adapters/a".to_string())),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Requests that share prefixes (each continues an earlier one, or not), with and
        /// without salts and LoRA, without lookahead and with 1 or 3 lookahead tokens, under
        /// both algorithms, two seeds and a bound small enough to drop the cache many times:
        /// every chain equals the plain chain.
        #[test]
        fn cached_chains_equal_plain_chains(
            requests in prop::collection::vec(
                (0usize..4, 0usize..24, any::<bool>(), 0u8..4, any::<u8>(), 0usize..6, 0usize..3),
                1..20,
            ),
            blocks in prop::sample::select(vec![
                vec![1usize], vec![3], vec![5], vec![2, 4], vec![1, 3, 5], vec![65], vec![4, 64],
            ]),
            max_tokens in prop::sample::select(vec![0usize, 7, 40, 200, 100_000]),
            // All bits, or three: unrelated blocks then share slots all the time.
            mask in prop::sample::select(vec![u64::MAX, 0b111]),
        ) {
            let cache = DigestCache::colliding(max_tokens, mask);
            let hashers = [
                BlockHasher::new(HashAlgo::Sha256, "vllm-none-hash"),
                BlockHasher::new(HashAlgo::Sha256Cbor, "vllm-none-hash"),
                BlockHasher::new(HashAlgo::Sha256, "42"),
            ];
            let mut earlier: Vec<Vec<u32>> = vec![Vec::new()];
            for (base, extra, big, mode, seed, pick, look) in requests {
                // Continue an earlier request, with tokens of every pickle width now and then;
                // blocks of 64 tokens or more need long requests to have any.
                let block = blocks[pick % blocks.len()];
                let mut tokens = earlier[base % earlier.len()].clone();
                let n = if block >= 64 { extra * 8 } else { extra };
                tokens.extend((0..n).map(|j| {
                    let t = (seed as u32).wrapping_mul(31).wrapping_add(j as u32) % 7;
                    if big { t.wrapping_mul(0x0101_0101) } else { t }
                }));
                let ex = match mode {
                    0 | 1 => extras(None, false),
                    2 => extras(Some(if seed % 2 == 0 { "s" } else { "t" }), false),
                    _ => extras(None, true),
                };
                let hasher = &hashers[seed as usize % hashers.len()];
                let lookahead = [0, 1, 3][look];
                let (got, used) = cache.chain(hasher, &tokens, block, &ex, lookahead);
                let want = hasher.chain_lookahead(&tokens, block, &ex, lookahead);
                prop_assert_eq!(&got, &want);
                prop_assert_eq!(used.hits + used.hashed, want.len() as u64);
                prop_assert!(cache.tokens() <= max_tokens);
                earlier.push(tokens);
            }
        }
    }

    /// Threads hashing overlapping prefixes against a bound small enough to start new
    /// generations all the time, some skipping their keeping (the lock busy): every chain is
    /// the plain chain.
    #[test]
    fn concurrent_chains_equal_plain_chains() {
        let cache = DigestCache::colliding(300, 0xff);
        let hasher = BlockHasher::new(HashAlgo::Sha256, "vllm-none-hash");
        let plain = BlockExtras::default();
        std::thread::scope(|scope| {
            for t in 0..4u32 {
                let (cache, hasher, plain) = (&cache, &hasher, &plain);
                scope.spawn(move || {
                    for i in 0..60u32 {
                        let shared: Vec<u32> = (0..64).collect();
                        let mut tokens = shared;
                        tokens.extend((0..(i % 9) * 8).map(|j| j + 1000 * ((i + t) % 5)));
                        let (got, _) = cache.chain(hasher, &tokens, 8, plain, 0);
                        assert_eq!(got, hasher.chain(&tokens, 8, plain));
                        assert!(cache.tokens() <= 300);
                    }
                });
            }
        });
    }

    #[test]
    fn a_repeated_prefix_is_looked_up_not_hashed() {
        let cache = DigestCache::default();
        let hasher = BlockHasher::new(HashAlgo::Sha256, "vllm-none-hash");
        let system: Vec<u32> = (0..64).collect();
        let mut first = system.clone();
        first.extend([900, 901, 902, 903]);
        let (_, used) = cache.chain(&hasher, &first, 4, &BlockExtras::default(), 0);
        assert_eq!(
            used,
            CacheUse {
                hits: 0,
                hashed: 17
            }
        );
        let mut second = system;
        second.extend([700, 701, 702, 703, 704]);
        let (chain, used) = cache.chain(&hasher, &second, 4, &BlockExtras::default(), 0);
        assert_eq!(
            used,
            CacheUse {
                hits: 16,
                hashed: 1
            }
        );
        assert_eq!(chain, hasher.chain(&second, 4, &BlockExtras::default()));
        // A salt changes the first block, so nothing after it is the unsalted prefix's.
        let salted = extras(Some("tenant"), false);
        let (_, used) = cache.chain(&hasher, &second, 4, &salted, 0);
        assert_eq!(
            used,
            CacheUse {
                hits: 0,
                hashed: 17
            }
        );
        let (_, used) = cache.chain(&hasher, &second, 4, &salted, 0);
        assert_eq!(
            used,
            CacheUse {
                hits: 16,
                hashed: 1
            },
            "all but the salted block"
        );
    }

    /// Requests branching off one another's kept blocks: each branch starts a run found
    /// through its slot, and every request's whole kept prefix is found again, whichever
    /// request kept each part.
    #[test]
    fn branches_of_a_kept_prefix_are_all_found_again() {
        let cache = DigestCache::default();
        let hasher = BlockHasher::new(HashAlgo::Sha256, "vllm-none-hash");
        let plain = BlockExtras::default();
        let stem: Vec<u32> = (0..32).collect();
        let with = |tail: &[u32]| {
            let mut t = stem.clone();
            t.extend_from_slice(tail);
            t
        };
        let (a, b) = (with(&[1, 1, 1, 1, 2, 2, 2, 2]), with(&[3, 3, 3, 3]));
        assert_eq!(cache.chain(&hasher, &a, 4, &plain, 0).1.hashed, 10);
        // B shares A's eight stem blocks, then starts a run of its own.
        let (_, used) = cache.chain(&hasher, &b, 4, &plain, 0);
        assert_eq!(used, CacheUse { hits: 8, hashed: 1 });
        // B's continuation walks A's run, then B's, then hashes its new block.
        let b2 = [&b[..], &[4, 4, 4, 4]].concat();
        let (chain, used) = cache.chain(&hasher, &b2, 4, &plain, 0);
        assert_eq!(used, CacheUse { hits: 9, hashed: 1 });
        assert_eq!(chain, hasher.chain(&b2, 4, &plain));
        // A again, and A's first branch block followed by B's tail: found up to where it
        // leaves every kept run.
        assert_eq!(
            cache.chain(&hasher, &a, 4, &plain, 0).1,
            CacheUse {
                hits: 10,
                hashed: 0
            }
        );
        let mixed = with(&[1, 1, 1, 1, 3, 3, 3, 3]);
        let (chain, used) = cache.chain(&hasher, &mixed, 4, &plain, 0);
        assert_eq!(used, CacheUse { hits: 9, hashed: 1 });
        assert_eq!(chain, hasher.chain(&mixed, 4, &plain));
    }

    #[test]
    fn a_lookahead_block_is_never_answered_by_a_block_hashed_without_lookahead() {
        let cache = DigestCache::default();
        let hasher = BlockHasher::new(HashAlgo::Sha256, "vllm-none-hash");
        let plain = BlockExtras::default();
        let tokens: Vec<u32> = (0..33).collect();
        let (_, used) = cache.chain(&hasher, &tokens, 4, &plain, 0);
        assert_eq!(used, CacheUse { hits: 0, hashed: 8 });
        // The same tokens with one lookahead token: other digests, none from the cache.
        let (chain, used) = cache.chain(&hasher, &tokens, 4, &plain, 1);
        assert_eq!(used, CacheUse { hits: 0, hashed: 8 });
        assert_eq!(chain, hasher.chain_lookahead(&tokens, 4, &plain, 1));
        assert_ne!(chain, hasher.chain(&tokens, 4, &plain));
        // Repeated with one lookahead token it hits; with three, block 7 has no hash yet.
        let (_, used) = cache.chain(&hasher, &tokens, 4, &plain, 1);
        assert_eq!(used, CacheUse { hits: 8, hashed: 0 });
        let (chain, used) = cache.chain(&hasher, &tokens, 4, &plain, 3);
        assert_eq!(used, CacheUse { hits: 0, hashed: 7 });
        assert_eq!(chain, hasher.chain_lookahead(&tokens, 4, &plain, 3));
        // A block followed by other tokens is another block under lookahead.
        let mut other = tokens.clone();
        other[8] = 999;
        let (chain, used) = cache.chain(&hasher, &other, 4, &plain, 1);
        assert_eq!(used, CacheUse { hits: 1, hashed: 7 });
        assert_eq!(chain, hasher.chain_lookahead(&other, 4, &plain, 1));
    }

    #[test]
    fn a_huge_bound_is_clamped_and_reserves_only_a_generation_s_start() {
        let cache = DigestCache::new(usize::MAX);
        let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, "vllm-none-hash");
        let tokens: Vec<u32> = (0..64).collect();
        let (chain, _) = cache.chain(&hasher, &tokens, 16, &BlockExtras::default(), 0);
        assert_eq!(chain, hasher.chain(&tokens, 16, &BlockExtras::default()));
        assert!(cache.heap_bytes() < 64 << 20, "{}", cache.heap_bytes());
        // A block longer than the bound is hashed, never kept.
        let small = DigestCache::new(8);
        let (chain, used) = small.chain(&hasher, &tokens, 16, &BlockExtras::default(), 0);
        assert_eq!((chain.len(), used.hits, small.tokens()), (4, 0, 0));
    }

    #[test]
    fn the_bound_drops_everything_and_keeps_the_request_that_crossed_it() {
        let cache = DigestCache::new(12);
        let hasher = BlockHasher::new(HashAlgo::Sha256, "vllm-none-hash");
        let plain = BlockExtras::default();
        let x: Vec<u32> = (0..12).collect();
        let y: Vec<u32> = (100..104).collect();
        assert_eq!(cache.chain(&hasher, &x, 4, &plain, 0).1.hashed, 3);
        assert_eq!(cache.tokens(), 12);
        // Y does not fit beside X: a new generation holding Y alone.
        cache.chain(&hasher, &y, 4, &plain, 0);
        assert_eq!(cache.tokens(), 4);
        // X crosses the bound again and is kept whole, so its next turn hits.
        let (_, used) = cache.chain(&hasher, &x, 4, &plain, 0);
        assert_eq!((used.hits, cache.tokens()), (0, 12));
        let (chain, used) = cache.chain(&hasher, &x, 4, &plain, 0);
        assert_eq!(used, CacheUse { hits: 3, hashed: 0 });
        assert_eq!(chain, hasher.chain(&x, 4, &plain));
        // A request longer than the bound keeps its leading blocks, which its repeat reaches.
        let long: Vec<u32> = (200..220).collect();
        cache.chain(&hasher, &long, 4, &plain, 0);
        assert_eq!(cache.tokens(), 12);
        let (chain, used) = cache.chain(&hasher, &long, 4, &plain, 0);
        assert_eq!(used, CacheUse { hits: 3, hashed: 2 });
        assert_eq!(chain, hasher.chain(&long, 4, &plain));
    }
}
