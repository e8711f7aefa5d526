//! Helpers shared by the index's integration tests: events built from real token chains.
#![allow(dead_code)]

use kvroute_index::event::{CacheKind, Event, Removed, Stored};
use kvroute_index::hash::{external, BlockHasher, HashAlgo, DEFAULT_SEED};
use kvroute_index::BlockExtras;

/// The 64-bit chain of `tokens` at hash block `h` (default sha256 settings).
pub fn chain(tokens: &[u32], h: usize) -> Vec<u64> {
    BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED)
        .chain(tokens, h, &BlockExtras::default())
        .iter()
        .map(|d| external(d).0)
        .collect()
}

/// The 64-bit chain of `tokens` at hash block `h` with vLLM 0.33's `lookahead` lookahead
/// tokens (default sha256 settings): only blocks with `e + lookahead ≤ n`.
pub fn lookahead_chain(tokens: &[u32], h: usize, lookahead: usize) -> Vec<u64> {
    BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED)
        .chain_lookahead(tokens, h, &BlockExtras::default(), lookahead)
        .iter()
        .map(|d| external(d).0)
        .collect()
}

pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 50_000)
        .collect()
}

pub fn store(
    worker: &str,
    group: u32,
    kind: &str,
    window: Option<u32>,
    block: u32,
    hashes: &[u64],
) -> Event {
    Event::Stored(Stored::device(
        worker,
        group,
        CacheKind::parse(kind),
        window,
        block,
        hashes,
    ))
}

pub fn remove(worker: &str, group: u32, hashes: &[u64]) -> Event {
    Event::Removed(Removed::device(worker, group, hashes))
}

/// Block hashes of a group whose block is `k` hash blocks, for block indices `blocks`.
pub fn group_blocks(chain: &[u64], k: usize, blocks: impl IntoIterator<Item = usize>) -> Vec<u64> {
    blocks.into_iter().map(|i| chain[(i + 1) * k - 1]).collect()
}
