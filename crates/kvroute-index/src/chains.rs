//! One request's hash chains and its walks through the shared run store, for one prediction.
//!
//! Owns: the request's 64-bit chain per distinct (hash mode, hash block, lookahead count) —
//! computed lazily, or given by the caller for every rank — and, per (chain, stride), each
//! shared holder's leading blocks of it (`Runs::walk`), computed once however many ranks read
//! them.
//! Invariants: a chain covers every hash block of the request's tokens that has a hash (every
//! full one; with `L` lookahead tokens, those ending at most `L` before the end); a walk's
//! leading blocks are counted in the stride's blocks, from the request's first.
//! Must not: lock anything but the digest cache (a leaf lock), or read rank state (the index
//! passes the store it holds).

use crate::counters::{Counter, Counters};
use crate::hash::cache::DigestCache;
use crate::hash::{self, BlockHasher};
use crate::index::Query;
use crate::rank::HashMode;
use crate::runs::Runs;

/// Hash chains of one request: computed lazily once per distinct setting, or given by the
/// caller (one chain for every rank).
pub(crate) struct Chains<'q> {
    /// The request's length and whether it skips the prefix cache.
    pub(crate) n_tokens: usize,
    pub(crate) skip: bool,
    source: Source<'q>,
    /// (mode, hash block, lookahead count, chain) per distinct setting seen (usually one).
    cache: Vec<(HashMode, u32, u32, Vec<u64>)>,
    /// (chain slot, stride, leading blocks per shared holder id): the request walked through
    /// the shared run store once per setting and group block size.
    walks: Vec<(usize, u32, Vec<u32>)>,
}

enum Source<'q> {
    /// Hash the request's tokens (blocks seen before come from the index's digest cache).
    Tokens(&'q Query, &'q DigestCache, &'q Counters),
    /// The caller's chain, for every rank.
    Given(&'q [u64]),
}

impl<'q> Chains<'q> {
    pub(crate) fn new(query: &'q Query, digests: &'q DigestCache, counters: &'q Counters) -> Self {
        Chains {
            n_tokens: query.tokens.len(),
            skip: query.skip_prefix_cache,
            source: Source::Tokens(query, digests, counters),
            cache: Vec::new(),
            walks: Vec::new(),
        }
    }

    pub(crate) fn given(n_tokens: usize, chain: &'q [u64]) -> Self {
        Chains {
            n_tokens,
            skip: false,
            source: Source::Given(chain),
            cache: Vec::new(),
            walks: Vec::new(),
        }
    }

    /// The slot of the chain at (mode, h) with `lookahead` lookahead tokens (vLLM 0.33),
    /// hashing the request the first time (a given chain is every setting's: slot `GIVEN`).
    pub(crate) fn slot(&mut self, mode: &HashMode, h: u32, lookahead: u32) -> usize {
        let (query, digests, counters) = match self.source {
            Source::Given(_) => return GIVEN,
            Source::Tokens(query, digests, counters) => (query, digests, counters),
        };
        if let Some(at) = self
            .cache
            .iter()
            .position(|(m, hb, la, _)| *hb == h && *la == lookahead && m == mode)
        {
            return at;
        }
        // Every hash block of the request that has a hash, as vLLM's `request.block_hashes`;
        // the rules never look past `n − 1` except EAGLE's one-unit margin.
        let toks = &query.tokens[..];
        let chain = match mode {
            HashMode::Engine { algo, seed } => {
                let hasher = BlockHasher::new(*algo, seed);
                let (digests, used) =
                    digests.chain(&hasher, toks, h as usize, &query.extras, lookahead as usize);
                counters.add(Counter::DigestCacheHits, used.hits);
                counters.add(Counter::BlocksHashed, used.hashed);
                digests.iter().map(|d| hash::external(d).0).collect()
            }
            HashMode::ContentKey => hash::content_chain(toks, h as usize, &query.extras),
        };
        self.cache.push((mode.clone(), h, lookahead, chain));
        self.cache.len() - 1
    }

    /// The chain in `slot`.
    pub(crate) fn chain_at(&self, slot: usize) -> &[u64] {
        match self.source {
            Source::Given(chain) => chain,
            Source::Tokens(..) => self.cache.get(slot).map_or(&[][..], |(_, _, _, c)| c),
        }
    }

    /// Walks the chain in `slot`, every `k`-th hash, through the shared store, once.
    pub(crate) fn ensure_walk(&mut self, slot: usize, k: u32, runs: &Runs) {
        if self.walk(slot, k).is_some() {
            return;
        }
        let mut touched = Vec::new();
        walk_strided(runs, self.chain_at(slot), k, &mut touched);
        let mut prefix = vec![0u32; runs.holder_slots()];
        for (id, blocks) in touched {
            prefix[id as usize] = blocks;
        }
        self.walks.push((slot, k, prefix));
    }

    /// Seeds the walk cache with a walk done by the caller.
    pub(crate) fn seed_walk(&mut self, slot: usize, k: u32, prefix: Vec<u32>) {
        if self.walk(slot, k).is_none() {
            self.walks.push((slot, k, prefix));
        }
    }

    /// Leading blocks per shared holder id of a walk done before.
    pub(crate) fn walk(&self, slot: usize, k: u32) -> Option<&[u32]> {
        self.walks
            .iter()
            .find(|(sl, kk, _)| *sl == slot && *kk == k)
            .map(|(_, _, p)| &p[..])
    }
}

/// The slot of a caller's chain.
const GIVEN: usize = usize::MAX;

/// Walks `chain`, every `k`-th hash (from the `k`-th), through the shared store: (holder,
/// leading blocks) of every holder of its first block.
pub(crate) fn walk_strided(runs: &Runs, chain: &[u64], k: u32, out: &mut Vec<(u32, u32)>) {
    if k <= 1 {
        runs.walk(chain, out);
    } else {
        let strided: Vec<u64> = chain
            .get(k as usize - 1..)
            .unwrap_or_default()
            .iter()
            .step_by(k as usize)
            .copied()
            .collect();
        runs.walk(&strided, out);
    }
}
