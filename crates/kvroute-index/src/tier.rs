//! The hit an offload tier serves beyond the device hit, by the rule of the vLLM connector
//! that keeps it ([`OffloadConnector`]).
//!
//! Owns: [`offload_hit`], the `OffloadingConnector`'s scheduler-side lookup
//! (`_lookup_complete_chunks` in `distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`,
//! the same in vLLM 0.32 and 0.33) as a pure function of the request's hash chain, its device
//! hit and what the tier holds per group; [`TierGroup`], one offloaded group's chunking and
//! lookup kind; [`simple_cpu_suffix`], where the `SimpleCPUOffloadConnector`'s lookup
//! (`v1/simple_kv_offload/manager.py`: the device coordinator's own rules over the CPU pool,
//! on the hashes after the device hit) starts and what it may serve.
//! Invariants: the hit starts at the block-aligned device hit; its end is a chunk boundary of
//! every group, or `n − 1` when a window or Mamba group exists; it adds at least one whole chunk
//! of every group or is 0; every group agrees on the end (a group can only lower it, and the
//! window groups are looked up again after a later group lowered it).
//! Must not: hold state, or model what makes the connector wait a step (a store still being
//! written, a chunk another request is loading, a backend asking to retry), EAGLE drafter
//! groups, or the partial tail some Mamba models extend a hit with (a hash block smaller than
//! the Mamba block): a router cannot see the first and the presets kvroute knows have neither.

use crate::engine::Engine;
use crate::event::Rule;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The vLLM connector that keeps a worker's offload tiers, which decides how a tier is looked
/// up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffloadConnector {
    /// `OffloadingConnector` (`--kv-offloading-size` with its default backend): whole chunks
    /// per group from the device hit ([`offload_hit`]).
    #[default]
    Offloading,
    /// `SimpleCPUOffloadConnector` (`VLLM_USE_SIMPLE_KV_OFFLOAD=1`, or named in
    /// `--kv-transfer-config`): the device coordinator's rules over the tier's blocks, from the
    /// device hit, at most `n − 1` ([`simple_cpu_suffix`]).
    SimpleCpu,
}

impl OffloadConnector {
    /// Every connector, by its configuration spelling.
    pub const ALL: [(&'static str, OffloadConnector); 2] = [
        ("offloading", OffloadConnector::Offloading),
        ("simple-cpu", OffloadConnector::SimpleCpu),
    ];
}

impl fmt::Display for OffloadConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = OffloadConnector::ALL
            .iter()
            .find(|(_, c)| c == self)
            .map_or("offloading", |(n, _)| n);
        f.write_str(name)
    }
}

/// An offload connector name that is not one of [`OffloadConnector::ALL`].
#[derive(Debug, thiserror::Error)]
#[error("unknown offload connector {0:?} (expected \"offloading\" or \"simple-cpu\")")]
pub struct UnknownConnector(pub String);

impl FromStr for OffloadConnector {
    type Err = UnknownConnector;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OffloadConnector::ALL
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, c)| *c)
            .ok_or_else(|| UnknownConnector(s.to_string()))
    }
}

/// vLLM's scheduler block for groups of these block sizes: their least common multiple
/// (`u32::MAX` when it does not fit). The scheduler hands a connector its device hit rounded
/// down to it, and counts the connector's hit only when it exceeds what the rounding dropped.
pub fn scheduler_block(block_sizes: impl IntoIterator<Item = u32>) -> u32 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    let mut lcm = 1u64;
    for b in block_sizes.into_iter().filter(|b| *b > 0).map(u64::from) {
        match (lcm / gcd(lcm, b)).checked_mul(b) {
            Some(l) if l <= u64::from(u32::MAX) => lcm = l,
            _ => return u32::MAX,
        }
    }
    lcm as u32
}

/// What a `SimpleCPUOffloadConnector` looks up for a request of `n` tokens (a chain of
/// `chain_len` hashes of `hash_block` tokens) whose device hit is `local`: `Some((skip, m))`
/// when it looks at all — the chain from hash `skip` on, as a request of `m = n − local`
/// tokens, with the device's own rules (their bound `m − 1` is the connector's
/// `n − 1 − local`); the engine then reports `local` plus that hit. `None` when the connector
/// serves nothing: a device hit off the scheduler block `sched_block` (its copies are whole
/// blocks), on vLLM 0.33 a device hit off a chunked local group's `chunk` (the suffix's chunk
/// boundaries must be the request's), no hash left, or no token left to load.
pub fn simple_cpu_suffix(
    n: usize,
    local: usize,
    hash_block: u32,
    sched_block: u32,
    chunk: Option<u32>,
    engine: Engine,
    chain_len: usize,
) -> Option<(usize, usize)> {
    let (h, b) = (hash_block.max(1) as usize, sched_block.max(1) as usize);
    if !local.is_multiple_of(b) {
        return None;
    }
    if engine == Engine::Vllm033 {
        if let Some(c) = chunk.filter(|c| *c > 0) {
            if !local.is_multiple_of(c as usize) {
                return None;
            }
        }
    }
    let skip = local / h;
    if skip >= chain_len || n <= local + 1 {
        return None;
    }
    Some((skip, n - local))
}

/// How an offloaded group is looked up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierKind {
    /// Full attention: every chunk from the device hit on (`sliding_window_size_in_chunks`
    /// is `None`).
    Prefix,
    /// Sliding window of `window` tokens: the last window's chunks.
    Window { window: u32 },
    /// A fixed number of trailing chunks: chunked local attention (`⌈chunk / C⌉`) and Mamba
    /// (1: only the last state).
    Trailing { chunks: usize },
}

/// One offloaded group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierGroup {
    /// The engine's group index (the tier's blocks are keyed by it).
    pub group: u32,
    pub kind: TierKind,
    /// Tokens per offloaded chunk: the group's block size × `blocks_per_chunk`.
    pub tokens_per_chunk: usize,
    /// Hash blocks per chunk: a chunk is keyed by the hash of its last hash block.
    pub hashes_per_chunk: usize,
    /// A Mamba group (the connector then rounds the hit's bound down to its chunk).
    pub mamba: bool,
}

impl TierGroup {
    /// The group of `rule` (with its `window`, tokens) of `block_size` tokens, offloaded
    /// `blocks_per_chunk` blocks a chunk, over a chain of `hash_block`-token hashes; `None`
    /// for a group the connector does not offload or cannot key.
    pub fn new(
        group: u32,
        rule: Rule,
        window: Option<u32>,
        block_size: u32,
        blocks_per_chunk: u32,
        hash_block: u32,
    ) -> Option<TierGroup> {
        let tpc = block_size as usize * blocks_per_chunk.max(1) as usize;
        let h = hash_block as usize;
        if tpc == 0 || h == 0 || !tpc.is_multiple_of(h) {
            return None;
        }
        let kind = match rule {
            Rule::FullAttention => TierKind::Prefix,
            Rule::SlidingWindow => TierKind::Window {
                window: window.filter(|w| *w > 0)?,
            },
            Rule::ChunkedLocal => TierKind::Trailing {
                chunks: (window.filter(|w| *w > 0)? as usize).div_ceil(tpc),
            },
            Rule::Mamba => TierKind::Trailing { chunks: 1 },
            Rule::NotCacheable => return None,
        };
        Some(TierGroup {
            group,
            kind,
            tokens_per_chunk: tpc,
            hashes_per_chunk: tpc / h,
            mamba: rule == Rule::Mamba,
        })
    }

    /// The window in chunks (`get_sliding_window_size_in_chunks`); `None` for full attention.
    fn window_chunks(&self) -> Option<usize> {
        let c = self.tokens_per_chunk;
        match self.kind {
            TierKind::Prefix => None,
            TierKind::Window { window } => {
                let w = window as usize;
                Some(w.div_ceil(c).max((w - 1).div_ceil(c)))
            }
            TierKind::Trailing { chunks } => Some(chunks),
        }
    }

    /// The window the rightmost run needs when the hit would end at `end`
    /// (`load_window_size_in_chunks`): a sliding window also covers the chunk the end rounds
    /// up into.
    fn first_window(&self, end: usize) -> usize {
        let base = self.window_chunks().unwrap_or(0);
        match self.kind {
            TierKind::Window { window } => {
                let c = self.tokens_per_chunk;
                let pad = (c - end % c) % c;
                base.max((window as usize - 1 + pad).div_ceil(c))
            }
            _ => base,
        }
    }

    /// The key of chunk `i`: the hash of its last hash block.
    fn key(&self, hashes: &[u64], i: usize) -> u64 {
        hashes[(i + 1) * self.hashes_per_chunk - 1]
    }

    /// Chunks of the request that have a key (only whole chunks do).
    fn keys(&self, hashes: &[u64]) -> usize {
        hashes.len() / self.hashes_per_chunk
    }
}

/// The tokens beyond the device hit `local` that the tier serves a request of `n` tokens whose
/// chain of hash-block hashes is `hashes`, when `holds(group, key)` says what the tier holds.
/// The engine reports `local + offload_hit(..)` as `num_cached_tokens`.
pub fn offload_hit(
    n: usize,
    local: usize,
    hashes: &[u64],
    groups: &[TierGroup],
    holds: impl Fn(u32, u64) -> bool,
) -> usize {
    if groups.is_empty() {
        return 0;
    }
    // Full-attention groups first, then the windowed ones, largest window first.
    let mut order: Vec<usize> = (0..groups.len())
        .filter(|i| groups[*i].window_chunks().is_none())
        .collect();
    let mut windowed: Vec<usize> = (0..groups.len())
        .filter(|i| groups[*i].window_chunks().is_some())
        .collect();
    windowed.sort_by_key(|i| std::cmp::Reverse(groups[*i].window_chunks()));
    order.extend(&windowed);
    let mut bound = n;
    if !windowed.is_empty() {
        // The last prompt token is computed again for its logits.
        bound = bound.saturating_sub(1);
        if let Some(g) = groups.iter().find(|g| g.mamba) {
            bound -= bound % g.tokens_per_chunk;
        }
    }
    let mut hit = 0usize;
    let mut pass = order;
    while !pass.is_empty() {
        let mut next = Vec::new();
        let mut windows_seen = false;
        for &gi in &pass {
            let g = &groups[gi];
            let c = g.tokens_per_chunk;
            let keyed = g.keys(hashes);
            bound = bound.min(keyed * c);
            if bound < local + c {
                return 0;
            }
            let end_chunk = bound.div_ceil(c).min(keyed);
            let start = local / c;
            let present = |i: usize| holds(g.group, g.key(hashes, i));
            let chunks = match g.window_chunks() {
                None => (start..end_chunk).take_while(|i| present(*i)).count(),
                Some(w) => {
                    let first = g.first_window(bound.min(end_chunk * c));
                    rightmost_run(start, end_chunk, w, first, present)
                }
            };
            if chunks == 0 {
                return 0;
            }
            bound = bound.min(c * (start + chunks));
            if bound < local + c {
                return 0;
            }
            let now = bound - local;
            if now < hit && windows_seen && next.is_empty() {
                // A window group looked up at a longer end may not hold the shorter one.
                next = windowed.clone();
            }
            windows_seen |= g.window_chunks().is_some();
            hit = now;
        }
        pass = next;
    }
    hit
}

/// Scanning chunks `[start, end)` from the right, the end (counted from `start`) of the
/// rightmost run of `window` present chunks — `first` for a run that reaches `end` — or of a
/// shorter run that reaches `start` (the device hit covers what lies before it).
fn rightmost_run(
    start: usize,
    end: usize,
    window: usize,
    first: usize,
    present: impl Fn(usize) -> bool,
) -> usize {
    let mut run = 0;
    let mut need = first.max(1);
    for i in (start..end).rev() {
        if present(i) {
            run += 1;
        } else {
            run = 0;
            need = window.max(1);
        }
        if run == need {
            return i - start + need;
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn chain(n_blocks: usize) -> Vec<u64> {
        (0..n_blocks as u64).map(|i| 1000 + i).collect()
    }

    fn full(group: u32) -> TierGroup {
        TierGroup::new(group, Rule::FullAttention, None, 16, 1, 16).unwrap()
    }

    fn holding(group: u32, blocks: impl IntoIterator<Item = u64>) -> BTreeSet<(u32, u64)> {
        blocks.into_iter().map(|i| (group, 1000 + i)).collect()
    }

    #[test]
    fn a_full_attention_tier_hit_runs_from_the_device_hit_to_the_first_missing_chunk() {
        // 200 tokens, device 48, the tier holds tokens 0..160: the engine reports 160.
        let set = holding(0, 0..10);
        let hit = offload_hit(200, 48, &chain(12), &[full(0)], |g, k| {
            set.contains(&(g, k))
        });
        assert_eq!(48 + hit, 160);
    }

    #[test]
    fn a_gap_right_after_the_device_hit_ends_the_tier_hit_however_much_follows() {
        let set = holding(0, (0..10).filter(|i| *i != 3));
        let hit = offload_hit(200, 48, &chain(12), &[full(0)], |g, k| {
            set.contains(&(g, k))
        });
        assert_eq!(hit, 0);
    }

    #[test]
    fn a_full_attention_tier_can_serve_the_whole_prompt() {
        let set = holding(0, 0..10);
        let hit = offload_hit(160, 48, &chain(10), &[full(0)], |g, k| {
            set.contains(&(g, k))
        });
        assert_eq!(48 + hit, 160);
    }

    #[test]
    fn a_tier_hit_must_add_a_whole_chunk() {
        // Chunks of 4 blocks (64 tokens): device 80 starts in chunk 1, which ends at 128.
        let g = TierGroup::new(0, Rule::FullAttention, None, 16, 4, 16).unwrap();
        let set = holding(0, [3, 7]);
        let holds = |g: u32, k: u64| set.contains(&(g, k));
        assert_eq!(48 + offload_hit(200, 48, &chain(12), &[g], holds), 128);
        assert_eq!(offload_hit(200, 80, &chain(12), &[g], holds), 0);
    }

    #[test]
    fn a_window_group_needs_only_the_chunks_of_its_last_window() {
        // Full attention + a 128-token window, chunk 16: both hold 0..160.
        let w = TierGroup::new(1, Rule::SlidingWindow, Some(128), 16, 1, 16).unwrap();
        let mut set = holding(0, 0..10);
        set.extend(holding(1, 0..10));
        let holds = |g: u32, k: u64| set.contains(&(g, k));
        assert_eq!(
            48 + offload_hit(200, 48, &chain(12), &[full(0), w], holds),
            160
        );
        // A window hole at chunk 5: the run reaching the device hit (chunks 3–4) ends at 80.
        set.remove(&(1, 1005));
        let holds = |g: u32, k: u64| set.contains(&(g, k));
        assert_eq!(
            48 + offload_hit(200, 48, &chain(12), &[full(0), w], holds),
            80
        );
        // Window chunks only from 2 on: the last window (8 chunks, 3..11) is all there.
        let mut set = holding(0, 0..12);
        set.extend(holding(1, 2..12));
        let holds = |g: u32, k: u64| set.contains(&(g, k));
        assert_eq!(
            48 + offload_hit(192, 48, &chain(12), &[full(0), w], holds),
            191
        );
    }

    #[test]
    fn a_mamba_group_needs_one_state_at_a_chunk_boundary_below_n_minus_one() {
        let m = TierGroup::new(0, Rule::Mamba, None, 64, 1, 64).unwrap();
        let f = TierGroup::new(1, Rule::FullAttention, None, 64, 1, 64).unwrap();
        // 300 tokens: the bound is ⌊299 / 64⌋·64 = 256; attention holds 0..256, the state at 192.
        let mut set = holding(1, 0..4);
        set.extend(holding(0, [2]));
        let holds = |g: u32, k: u64| set.contains(&(g, k));
        assert_eq!(offload_hit(300, 64, &chain(4), &[m, f], holds) + 64, 192);
        // No state at or after the device hit's chunk: nothing.
        let set = holding(1, 0..4);
        let holds = |g: u32, k: u64| set.contains(&(g, k));
        assert_eq!(offload_hit(300, 64, &chain(4), &[m, f], holds), 0);
    }

    #[test]
    fn an_empty_tier_serves_nothing() {
        assert_eq!(offload_hit(200, 0, &chain(12), &[full(0)], |_, _| false), 0);
        assert_eq!(offload_hit(200, 0, &chain(12), &[], |_, _| true), 0);
    }

    #[test]
    fn a_simple_cpu_lookup_starts_at_the_device_hit_and_is_bounded_by_the_last_token() {
        // 100 tokens, 6 hashes of 16: the suffix after 32 tokens is 68 tokens from hash 2.
        assert_eq!(
            simple_cpu_suffix(100, 32, 16, 16, None, Engine::Vllm032, 6),
            Some((2, 68))
        );
        // Nothing is left to hash, or to load.
        assert_eq!(
            simple_cpu_suffix(100, 96, 16, 16, None, Engine::Vllm032, 6),
            None
        );
        assert_eq!(
            simple_cpu_suffix(33, 32, 16, 16, None, Engine::Vllm032, 2),
            None
        );
    }

    #[test]
    fn a_simple_cpu_lookup_needs_a_hit_on_the_scheduler_block_and_on_0_33_on_the_chunk() {
        // A hit off the 64-token scheduler block (the scheduler rounds it down first:
        // `scheduler_block`).
        assert_eq!(
            simple_cpu_suffix(300, 48, 16, 64, None, Engine::Vllm032, 18),
            None
        );
        assert_eq!(
            simple_cpu_suffix(300, 64, 16, 64, None, Engine::Vllm032, 18),
            Some((4, 236))
        );
        // A chunked local group of 128: 0.32 looks up from 64 anyway, 0.33 does not.
        assert_eq!(
            simple_cpu_suffix(300, 64, 16, 64, Some(128), Engine::Vllm032, 18),
            Some((4, 236))
        );
        assert_eq!(
            simple_cpu_suffix(300, 64, 16, 64, Some(128), Engine::Vllm033, 18),
            None
        );
        assert_eq!(
            simple_cpu_suffix(300, 128, 16, 64, Some(128), Engine::Vllm033, 18),
            Some((8, 172))
        );
    }

    #[test]
    fn connectors_parse_from_their_configuration_spelling() {
        for (name, c) in OffloadConnector::ALL {
            assert_eq!(name.parse::<OffloadConnector>().ok(), Some(c));
            assert_eq!(c.to_string(), name);
        }
        assert!("lmcache".parse::<OffloadConnector>().is_err());
    }

    #[test]
    fn the_scheduler_block_is_the_least_common_multiple_and_saturates() {
        assert_eq!(scheduler_block([16, 64, 0]), 64);
        assert_eq!(scheduler_block([48, 64]), 192);
        assert_eq!(scheduler_block([]), 1);
        assert_eq!(scheduler_block([65_521, 65_519, 65_497]), u32::MAX);
    }
}
