//! A rank's offload-tier hit: the rule of the connector that keeps the rank's tiers, over the
//! rank's tier holders (one multiset per (medium, group)).
//!
//! Owns: [`tier_part`], the most any one medium adds to a device hit — the
//! `OffloadingConnector`'s chunk rule (`tier::offload_hit`) or the
//! `SimpleCPUOffloadConnector`'s (the coordinator's own `rules::joint` over the tier's blocks,
//! on the hashes after the device hit).
//! Invariants: the device hit is handed over rounded down to the alignment, as the scheduler
//! hands the connector its hit; a tier adds nothing or something positive; every medium is
//! looked up alone (a connector keeps one).
//! Must not: mutate the rank, or hash anything (the chain is the prediction's).

use crate::event::Rule;
use crate::holder::Multiset;
use crate::index::with_lookups;
use crate::layout::{Params, Plan};
use crate::rank::RankState;
use crate::rules::{self, HolderRef};
use crate::tier::{self, OffloadConnector, TierGroup};
use std::collections::{BTreeMap, BTreeSet};

/// The longest hit an offload tier of the rank adds to the device hit `device` (and its
/// medium), by the rank's connector's rule over the plan's groups.
pub(crate) fn tier_part(
    r: &RankState,
    plan: &Plan,
    p: &Params,
    chain: &[u64],
    n_tokens: usize,
    device: u64,
) -> Option<(u64, String)> {
    // The scheduler hands the connector its device hit rounded down to its block (the
    // groups' least common multiple, coarser than the alignment under fine-grained hits).
    let sched = tier::scheduler_block(r.layout.groups.values().map(|g| g.block_size));
    let local = device as usize - device as usize % sched.max(1) as usize;
    let media: BTreeSet<&String> = r.offload.keys().map(|(m, _)| m).collect();
    let mut best: Option<(u64, String)> = None;
    for medium in media {
        // The medium's set per group.
        let sets: BTreeMap<u32, &Multiset> = r
            .offload
            .iter()
            .filter(|((m, _), _)| m == medium)
            .map(|((_, g), set)| (*g, set))
            .collect();
        let hit = match r.config.lookup.offload_connector {
            OffloadConnector::Offloading => offloading(r, plan, p, chain, n_tokens, local, &sets),
            OffloadConnector::SimpleCpu => {
                simple_cpu(r, plan, p, chain, n_tokens, (local, sched), &sets)
            }
        };
        let extra = (local + hit) as u64;
        let extra = extra.saturating_sub(device);
        if extra > 0 && best.as_ref().is_none_or(|(b, _)| extra > *b) {
            best = Some((extra, medium.clone()));
        }
    }
    best
}

/// The `OffloadingConnector`'s hit from `local` in one medium (its `sets` per group).
fn offloading(
    r: &RankState,
    plan: &Plan,
    p: &Params,
    chain: &[u64],
    n_tokens: usize,
    local: usize,
    sets: &BTreeMap<u32, &Multiset>,
) -> usize {
    let per_chunk = r.config.lookup.offload_chunk_blocks.unwrap_or(1);
    let groups: Vec<TierGroup> = plan
        .lookups
        .iter()
        .flat_map(|(spec, ids)| ids.iter().map(move |g| (spec, *g)))
        .filter_map(|(spec, g)| {
            let window = match spec.rule() {
                Rule::ChunkedLocal => r.config.lookup.chunk_size.or(spec.window),
                _ => spec.window,
            };
            TierGroup::new(
                g,
                spec.rule(),
                window,
                spec.block_size,
                per_chunk,
                p.hash_block,
            )
        })
        .collect();
    let holds = |g: u32, key: u64| sets.get(&g).is_some_and(|set| set.contains(key));
    tier::offload_hit(n_tokens, local, chain, &groups, holds)
}

/// The `SimpleCPUOffloadConnector`'s hit from `local` in one medium (its `sets` per group):
/// the coordinator over the medium's blocks, on the chain after the device hit.
fn simple_cpu(
    r: &RankState,
    plan: &Plan,
    p: &Params,
    chain: &[u64],
    n_tokens: usize,
    (local, sched): (usize, u32),
    sets: &BTreeMap<u32, &Multiset>,
) -> usize {
    let chunk = plan
        .lookups
        .iter()
        .find(|(spec, _)| spec.rule() == Rule::ChunkedLocal)
        .and_then(|(spec, _)| r.config.lookup.chunk_size.or(spec.window));
    let Some((skip, m)) = tier::simple_cpu_suffix(
        n_tokens,
        local,
        p.hash_block,
        sched,
        chunk,
        r.config.engine,
        chain.len(),
    ) else {
        return 0;
    };
    let empty = Multiset::default();
    let holder = |_: &_, g: &u32| HolderRef::Own(sets.get(g).copied().unwrap_or(&empty));
    let suffix = &chain[skip..];
    let chunk_cfg = r.config.lookup.chunk_size;
    // The connector bounds its hit by `n − 1 − local` (`max_hit_len`), not by the lookahead
    // reserve: on vLLM 0.33 any connector keeps `L = 0`, and a configuration that says
    // otherwise is bounded as the connector's code bounds it.
    let cpu_params = Params { lookahead: 0, ..*p };
    with_lookups(plan, &empty, holder, |lookups| {
        rules::joint(lookups, suffix, m, &cpu_params, chunk_cfg, false).cached as usize
    })
}
