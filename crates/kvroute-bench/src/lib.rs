//! kvroute-bench: the shared workload of the index benchmarks.
//!
//! Owns: a synthetic fleet (128 workers, each holding one 8k-token sequence that shares a system
//! prompt with 15 other workers and a document with 3 others), its per-worker 64-bit chains
//! (kvroute's own SHA-256 engine hashes, computed once, never timed), the layouts with 1, 2 and 4
//! KV cache groups, the kvroute events that store and remove it, and the request that is
//! predicted. The benches adapt the same blocks to SMG's `ChainIndex`.
//! Must not: time anything or assert on time.

use kvroute_index::event::{CacheKind, EngineHash, Event, Removed, Stored, WorkerId};
use kvroute_index::hash::DEFAULT_SEED;
use kvroute_index::index::block_hashes;
use kvroute_index::{BlockExtras, HashAlgo};

/// Workers in the fleet.
pub const WORKERS: usize = 128;
/// Tokens each worker holds (one sequence).
pub const SEQ_TOKENS: usize = 8192;
/// Segments of a worker's sequence: a system prompt shared by `WORKERS / SYSTEM_PROMPTS`
/// workers, a document shared by `WORKERS / DOCUMENTS` workers, then a tail of its own.
pub const SYSTEM_PROMPTS: usize = 8;
pub const DOCUMENTS: usize = 32;
pub const SYSTEM_TOKENS: usize = 2048;
pub const DOCUMENT_TOKENS: usize = 2048;
/// Blocks per stored or removed event (one engine step's worth).
pub const EVENT_BLOCKS: usize = 32;
/// The worker whose conversation the request continues.
pub const REQUEST_WORKER: usize = 5;
/// Tokens of the request that match `REQUEST_WORKER`'s sequence; the rest is new.
pub const REQUEST_MATCHED: usize = 7168;
/// Sliding window of the window groups (Gemma 3's).
pub const WINDOW: u32 = 1024;

/// The KV cache layout of every worker in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One full-attention group.
    Full,
    /// Full attention + one sliding-window group.
    FullWindow,
    /// Full attention + Mamba + two sliding-window groups of one spec.
    FullMambaTwoWindows,
}

impl Layout {
    pub const ALL: [Layout; 3] = [
        Layout::Full,
        Layout::FullWindow,
        Layout::FullMambaTwoWindows,
    ];

    pub fn groups(self) -> usize {
        self.specs().len()
    }

    /// (group id, kind, window) of each group.
    pub fn specs(self) -> &'static [(u32, CacheKind, Option<u32>)] {
        const FULL: &[(u32, CacheKind, Option<u32>)] = &[(0, CacheKind::FullAttention, None)];
        const TWO: &[(u32, CacheKind, Option<u32>)] = &[
            (0, CacheKind::FullAttention, None),
            (1, CacheKind::SlidingWindow, Some(WINDOW)),
        ];
        const FOUR: &[(u32, CacheKind, Option<u32>)] = &[
            (0, CacheKind::FullAttention, None),
            (1, CacheKind::Mamba, None),
            (2, CacheKind::SlidingWindow, Some(WINDOW)),
            (3, CacheKind::SlidingWindow, Some(WINDOW)),
        ];
        match self {
            Layout::Full => FULL,
            Layout::FullWindow => TWO,
            Layout::FullMambaTwoWindows => FOUR,
        }
    }
}

/// A deterministic token stream per segment id (splitmix64), in a 150k vocabulary.
pub fn segment_tokens(segment: u64, n: usize) -> Vec<u32> {
    let mut state = segment.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % 150_000) as u32
        })
        .collect()
}

/// Worker `w`'s sequence: its system prompt, its document, its own tail.
pub fn worker_tokens(w: usize) -> Vec<u32> {
    let mut t = segment_tokens(1_000 + (w % SYSTEM_PROMPTS) as u64, SYSTEM_TOKENS);
    t.extend(segment_tokens(
        2_000 + (w % DOCUMENTS) as u64,
        DOCUMENT_TOKENS,
    ));
    t.extend(segment_tokens(
        3_000 + w as u64,
        SEQ_TOKENS - SYSTEM_TOKENS - DOCUMENT_TOKENS,
    ));
    t
}

/// The request: `REQUEST_WORKER`'s first `REQUEST_MATCHED` tokens, new tokens up to 8k, plus
/// one more (the engine never serves the last token from cache, so 8k tokens are in blocks).
pub fn request_tokens() -> Vec<u32> {
    let mut t = worker_tokens(REQUEST_WORKER);
    t.truncate(REQUEST_MATCHED);
    t.extend(segment_tokens(9_999, SEQ_TOKENS + 1 - REQUEST_MATCHED));
    t
}

/// kvroute's 64-bit engine hash chain (vLLM sha256, default seed) of `tokens` at `block`.
pub fn chain(tokens: &[u32], block: usize) -> Vec<u64> {
    block_hashes(
        HashAlgo::Sha256,
        DEFAULT_SEED,
        block,
        tokens,
        &BlockExtras::default(),
    )
    .into_iter()
    .map(|(_, v, _)| v)
    .collect()
}

/// The fleet at one block size: every worker's tokens and chain, and the request's.
pub struct Fleet {
    pub block: usize,
    pub names: Vec<WorkerId>,
    pub tokens: Vec<Vec<u32>>,
    pub chains: Vec<Vec<u64>>,
    pub request: Vec<u32>,
    /// The request's chain over its first `n − 1` tokens (what kvroute looks up).
    pub request_chain: Vec<u64>,
}

impl Fleet {
    pub fn new(block: usize) -> Fleet {
        let tokens: Vec<Vec<u32>> = (0..WORKERS).map(worker_tokens).collect();
        let chains = tokens.iter().map(|t| chain(t, block)).collect();
        let request = request_tokens();
        let request_chain = chain(&request[..request.len() - 1], block);
        Fleet {
            block,
            names: (0..WORKERS).map(|w| format!("w{w:03}").into()).collect(),
            tokens,
            chains,
            request,
            request_chain,
        }
    }

    /// Blocks each worker holds.
    pub fn blocks_per_worker(&self) -> usize {
        SEQ_TOKENS / self.block
    }

    /// Distinct blocks over the fleet (what an index that shares blocks between workers keeps).
    pub fn distinct_blocks(&self) -> usize {
        let b = self.block;
        SYSTEM_PROMPTS * SYSTEM_TOKENS / b
            + DOCUMENTS * DOCUMENT_TOKENS / b
            + WORKERS * (SEQ_TOKENS - SYSTEM_TOKENS - DOCUMENT_TOKENS) / b
    }

    /// Whether group `g` of `layout` holds block `i`: every block, except that the Mamba group
    /// keeps its state only at the end of each segment (2k, 4k, 8k tokens).
    pub fn holds(&self, kind: &CacheKind, i: usize) -> bool {
        if *kind != CacheKind::Mamba {
            return true;
        }
        let end = (i + 1) * self.block;
        end == SYSTEM_TOKENS || end == SYSTEM_TOKENS + DOCUMENT_TOKENS || end == SEQ_TOKENS
    }

    /// The events that store the whole fleet, round-robin over workers one engine step
    /// (`EVENT_BLOCKS` blocks, one event per group) at a time.
    pub fn store_events(&self, layout: Layout) -> Vec<Event> {
        self.events(layout, false)
    }

    /// The events that remove the whole fleet again, tail first (the order an LRU free queue
    /// evicts a finished request's blocks in).
    pub fn remove_events(&self, layout: Layout) -> Vec<Event> {
        self.events(layout, true)
    }

    fn events(&self, layout: Layout, remove: bool) -> Vec<Event> {
        let steps = self.blocks_per_worker().div_ceil(EVENT_BLOCKS);
        let mut out = Vec::new();
        for step in 0..steps {
            let step = if remove { steps - 1 - step } else { step };
            let range =
                step * EVENT_BLOCKS..((step + 1) * EVENT_BLOCKS).min(self.blocks_per_worker());
            for w in 0..WORKERS {
                for (group, kind, window) in layout.specs() {
                    let mut hashes: Vec<EngineHash> = range
                        .clone()
                        .filter(|i| self.holds(kind, *i))
                        .map(|i| EngineHash::int(self.chains[w][i]))
                        .collect();
                    if hashes.is_empty() {
                        continue;
                    }
                    out.push(if remove {
                        hashes.reverse();
                        Event::Removed(Removed {
                            worker: self.names[w].clone(),
                            dp_rank: 0,
                            medium: None,
                            group: Some(*group),
                            hashes,
                        })
                    } else {
                        Event::Stored(Stored {
                            worker: self.names[w].clone(),
                            dp_rank: 0,
                            medium: None,
                            group: Some(*group),
                            kind: Some(kind.clone()),
                            sliding_window: *window,
                            block_size: self.block as u32,
                            parent: range
                                .start
                                .checked_sub(1)
                                .map(|p| EngineHash::int(self.chains[w][p])),
                            hashes,
                            token_ids: Vec::new(),
                            extra_keys: None,
                            lora_id: None,
                            lora_name: None,
                            lookahead_token_ids: None,
                        })
                    });
                }
            }
        }
        out
    }

    /// (holder, block) pairs the fleet stores under `layout`: what `block_copies` counts.
    pub fn holder_blocks(&self, layout: Layout) -> usize {
        layout
            .specs()
            .iter()
            .map(|(_, kind, _)| {
                WORKERS
                    * (0..self.blocks_per_worker())
                        .filter(|i| self.holds(kind, *i))
                        .count()
            })
            .sum()
    }
}
