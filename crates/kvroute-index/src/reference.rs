//! The literal reference model the fast index is tested against.
//!
//! Owns: per (worker, rank, group) a plain `Vec` of hashes used as a multiset, and vLLM's hit
//! procedure written as the engine writes it, from vLLM 0.32's and 0.33's sources, with plain
//! loops: each manager's scan (`find_longest_cache_hit`), the hybrid coordinator's passes over
//! lookups with identical specs merged, full-attention kinds first, full attention computed
//! once then trimmed; the lookup parameters (`RefParams`: the hash block, the scheduler block,
//! the alignment, fine-grained hits, as `resolve_kv_cache_block_sizes` and the coordinators
//! derive them) and each engine's rules (vLLM 0.33 with `L` lookahead tokens: the request
//! hashed with them, the hit bounded by `n − max(1, L)`, no EAGLE drop; the drop in every
//! group, or with the drafter's groups flagged only in the full-attention ones); and the
//! offload tiers as plain multisets per (medium, group), looked up by the worker's connector:
//! the `OffloadingConnector`'s `_lookup_complete_chunks` and the `SimpleCPUOffloadConnector`'s
//! `get_num_new_matched_tokens` (the coordinator over the tier's blocks), each as loops here.
//! Invariant: obviously correct before fast — no early exits beyond the engine's own; no shared
//! code with `rules`, `holder`, `tier`, `tier_lookup`, `layout`, `engine::Rules` or
//! `CacheKind::rule`: it learns each group's kind, window and block sizes from the stores and maps
//! a kind to its manager itself (`params.rs`). What it shares with the index: the event types,
//! the configuration types and the block hasher (checked against vLLM's own hasher). The oracle
//! fixtures (`conformance/oracle/`) check it against vLLM's own code.
//! Code map: this file applies events and predicts; `params.rs` learns the groups and derives
//! the lookup parameters; `lookup.rs` is the coordinator and the managers' scans; `tiers.rs` the
//! offload connectors' lookups.
//! Must not: be used on a hot path (every operation is linear).

use crate::event::{is_device_medium, CacheKind, Event, WorkerId};
use crate::hash::{self, BlockHasher};
use crate::index::Query;
use crate::rank::{HashMode, WorkerConfig};
use crate::tier::OffloadConnector;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Default, Clone)]
struct RefRank {
    layout: RefLayout,
    blocks: BTreeMap<u32, Vec<u64>>,
    /// Offload tiers: (medium, group) → hashes, a multiset.
    tiers: BTreeMap<(String, u32), Vec<u64>>,
}

#[derive(Default)]
pub struct Reference {
    ranks: BTreeMap<(WorkerId, u32), RefRank>,
    configs: BTreeMap<WorkerId, WorkerConfig>,
    default_config: WorkerConfig,
}

impl Reference {
    pub fn with_default(config: WorkerConfig) -> Reference {
        Reference {
            default_config: config,
            ..Reference::default()
        }
    }

    pub fn configure_worker(&mut self, worker: &WorkerId, config: WorkerConfig) {
        self.configs.insert(worker.clone(), config);
    }

    fn config(&self, worker: &WorkerId) -> WorkerConfig {
        self.configs
            .get(worker)
            .cloned()
            .unwrap_or_else(|| self.default_config.clone())
    }

    pub fn remove_worker(&mut self, worker: &WorkerId) {
        let keys: Vec<_> = self
            .ranks
            .keys()
            .filter(|(w, _)| w == worker)
            .cloned()
            .collect();
        for k in keys {
            self.ranks.remove(&k);
        }
        self.configs.remove(worker);
    }

    /// Engine-mode events only (content-key mode is tested separately).
    pub fn apply(&mut self, ev: &Event) {
        let key = (ev.worker().clone(), ev.dp_rank());
        let rank = self.ranks.entry(key).or_default();
        match ev {
            Event::Stored(s) => {
                if !is_device_medium(s.medium.as_deref()) {
                    let key = (s.medium.clone().unwrap_or_default(), s.group.unwrap_or(0));
                    let held = rank.tiers.entry(key).or_default();
                    held.extend(s.hashes.iter().map(|h| h.value.0));
                    let mut distinct = held.clone();
                    distinct.sort_unstable();
                    distinct.dedup();
                    if distinct.len() > crate::rank::MAX_TIER_KEYS {
                        held.clear();
                    }
                    return;
                }
                if s.block_size == 0 {
                    return;
                }
                let group = s.group.unwrap_or(0);
                let kind = s.kind.clone().unwrap_or(CacheKind::FullAttention);
                if !rank
                    .layout
                    .learn(group, &kind, s.sliding_window, s.block_size)
                {
                    *rank = RefRank {
                        tiers: std::mem::take(&mut rank.tiers),
                        ..RefRank::default()
                    };
                    rank.layout
                        .learn(group, &kind, s.sliding_window, s.block_size);
                }
                let held = rank.blocks.entry(group).or_default();
                for h in &s.hashes {
                    held.push(h.value.0);
                }
            }
            Event::Removed(r) => {
                if !is_device_medium(r.medium.as_deref()) {
                    let key = (r.medium.clone().unwrap_or_default(), r.group.unwrap_or(0));
                    if let Some(held) = rank.tiers.get_mut(&key) {
                        for h in &r.hashes {
                            if let Some(pos) = held.iter().position(|x| *x == h.value.0) {
                                held.remove(pos);
                            }
                        }
                    }
                    return;
                }
                let group = r.group.unwrap_or(0);
                if !rank.layout.groups.contains_key(&group) {
                    return;
                }
                let held = rank.blocks.entry(group).or_default();
                for h in &r.hashes {
                    if let Some(pos) = held.iter().position(|x| *x == h.value.0) {
                        held.remove(pos);
                    }
                }
            }
            Event::Cleared(_) => {
                for held in rank.blocks.values_mut() {
                    held.clear();
                }
            }
        }
    }

    pub fn contents(&self) -> BTreeMap<(WorkerId, u32), BTreeMap<u32, BTreeMap<u64, u32>>> {
        let mut out = BTreeMap::new();
        for (k, r) in &self.ranks {
            let mut groups = BTreeMap::new();
            for (g, held) in &r.blocks {
                let mut m: BTreeMap<u64, u32> = BTreeMap::new();
                for h in held {
                    *m.entry(*h).or_insert(0) += 1;
                }
                if !m.is_empty() {
                    groups.insert(*g, m);
                }
            }
            if !groups.is_empty() {
                out.insert(k.clone(), groups);
            }
        }
        out
    }

    /// (cached, group_blind) for a request on one (worker, rank).
    pub fn predict(&self, worker: &WorkerId, dp_rank: u32, q: &Query) -> (u64, u64) {
        let Some(rank) = self.ranks.get(&(worker.clone(), dp_rank)) else {
            return (0, 0);
        };
        let cfg = self.config(worker);
        let Some(p) = RefParams::derive(&rank.layout, &cfg) else {
            return (0, 0);
        };
        let HashMode::Engine { algo, seed } = &cfg.hash else {
            return (0, 0);
        };
        if q.tokens.is_empty() {
            return (0, 0);
        }
        // vLLM bounds a hit by n − 1; with L lookahead tokens no block past n − L has a hash.
        let max_len = (q.tokens.len() as u64).saturating_sub(u64::from(p.lookahead.max(1)));
        let hashes: Vec<u64> = BlockHasher::new(*algo, seed)
            .chain_lookahead(
                &q.tokens,
                p.hash_block as usize,
                &q.extras,
                p.lookahead as usize,
            )
            .iter()
            .map(|d| hash::external(d).0)
            .collect();
        let ctx = Ctx {
            rank,
            hashes: &hashes,
            p: &p,
            chunk: cfg.lookup.chunk_size,
        };
        let lookups = ctx.lookups(false);
        let full_only = ctx.lookups(true);
        if p.eagle {
            let cached = if q.skip_prefix_cache {
                0
            } else if cfg.lookup.offload_connector == OffloadConnector::SimpleCpu
                || cfg.lookup.drafter_groups_unflagged
            {
                // The SimpleCPU connector's coordinator drops the EAGLE block as the device's
                // does; with no drafter group flagged the other connector pops nothing.
                ctx.with_tier(
                    &lookups,
                    q.tokens.len(),
                    ctx.coordinate_eagle(&lookups, max_len),
                    &cfg,
                )
            } else {
                ctx.coordinate_eagle(&lookups, max_len)
            };
            let blind = if full_only.is_empty() {
                0
            } else {
                ctx.coordinate_eagle(&full_only, max_len)
            };
            return (cached, blind);
        }
        let cached = if q.skip_prefix_cache {
            0
        } else {
            ctx.with_tier(
                &lookups,
                q.tokens.len(),
                ctx.coordinate(&lookups, max_len),
                &cfg,
            )
        };
        let blind = if full_only.is_empty() {
            match ctx.lookups(false).first() {
                Some((spec, ids)) => {
                    let as_full = RefGroup {
                        kind: CacheKind::FullAttention,
                        ..spec.clone()
                    };
                    ctx.full(&as_full, &ids[..1], max_len)
                }
                None => 0,
            }
        } else {
            ctx.coordinate(&full_only, max_len)
        };
        (cached, blind)
    }
}

/// The lookup parameters of one (worker, rank), derived here as vLLM derives them, sharing no
/// code with the index's `Layout::params_with` or `engine::Rules`: `resolve_kv_cache_block_sizes` (the
/// scheduler block, the hash block), the hybrid coordinator's `enable_partial_hash_hits` and
/// `_cache_hit_alignment_tokens`, the unitary coordinator's alignment, and the engine's rules.
#[derive(Clone, Copy, Debug)]
struct RefParams {
    /// Tokens per block hash.
    hash_block: u32,
    /// The scheduler block: the least common multiple of every group's block size (`u32::MAX`
    /// when it does not fit).
    sched: u64,
    /// Hits are multiples of it.
    align: u32,
    /// Fine-grained (hash-block) hits in full-attention and Mamba groups.
    fine_grained: bool,
    /// One KV cache group (`UnitaryKVCacheCoordinator`).
    unitary: bool,
    /// Matches drop the EAGLE block.
    eagle: bool,
    /// Under the drop, only full-attention lookups drop (the engine flags the drafter's groups,
    /// full attention for every drafter kvroute knows; vLLM drops in a spec group holding a
    /// flagged group, and in every group when none is flagged).
    eagle_full_only: bool,
    /// vLLM 0.33's lookahead tokens per block hash.
    lookahead: u32,
}

/// A KV cache group as the reference model knows it from the stores: its kind, its window, its
/// block size (the largest seen) and a smaller size seen on partial entries.
#[derive(Clone, Debug, PartialEq)]
struct RefGroup {
    kind: CacheKind,
    window: Option<u32>,
    block_size: u32,
    partial_size: Option<u32>,
}

/// The groups of one (worker, rank), learned from their stores (`RefLayout::learn`).
#[derive(Clone, Debug, Default)]
struct RefLayout {
    groups: BTreeMap<u32, RefGroup>,
    /// Every block size a group's stores showed.
    sizes: BTreeMap<u32, BTreeSet<u32>>,
}

struct Ctx<'a> {
    rank: &'a RefRank,
    hashes: &'a [u64],
    p: &'a RefParams,
    chunk: Option<u32>,
}

mod lookup;
mod params;
mod tiers;
