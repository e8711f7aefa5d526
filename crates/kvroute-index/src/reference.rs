//! The literal reference model the fast index is tested against.
//!
//! Owns: per (worker, rank, group) a plain `Vec` of hashes used as a multiset, and vLLM's hit
//! procedure written as the engine writes it: each manager's scan as a plain loop
//! (`find_longest_cache_hit`), and the hybrid coordinator's passes over lookups with identical
//! specs merged, full-attention kinds first, full attention computed once then trimmed; under
//! each worker's engine rules (vLLM 0.33 with `L` lookahead tokens: the request hashed with
//! them, the hit bounded by `n − max(1, L)`, no EAGLE drop).
//! The offload tiers are plain multisets per (medium, group), and a tier's hit is
//! `tier::offload_hit` over them (the connector's rule, a pure function unit-tested on its own).
//! Invariant: obviously correct before fast — no early exits beyond the engine's own, no shared
//! code with `rules` or `holder`.
//! Must not: be used on a hot path (every operation is linear).

use crate::event::{is_device_medium, CacheKind, Event, Rule, WorkerId};
use crate::hash::{self, BlockHasher};
use crate::index::Query;
use crate::layout::{GroupSpec, Layout, Learned, Params};
use crate::rank::{HashMode, WorkerConfig};
use crate::tier::{self, OffloadConnector, TierGroup};
use std::collections::BTreeMap;

#[derive(Default, Clone)]
struct RefRank {
    layout: Layout,
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
                if rank
                    .layout
                    .learn(group, &kind, s.sliding_window, s.block_size)
                    == Learned::Changed
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
                if !rank.layout.contains(group) {
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
        let Some(p) = rank.layout.params_with(&cfg.lookup, cfg.rules()) else {
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
                    let as_full = GroupSpec {
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

struct Ctx<'a> {
    rank: &'a RefRank,
    hashes: &'a [u64],
    p: &'a Params,
    chunk: Option<u32>,
}

impl Ctx<'_> {
    /// The device hit `device` extended by the offload tier that serves most, by the worker's
    /// connector: `tier::offload_hit` from the device hit rounded down to the alignment, or
    /// (`SimpleCPUOffloadConnector`) the coordinator over the tier's blocks on the hashes after
    /// the device hit.
    fn with_tier(
        &self,
        lookups: &[(GroupSpec, Vec<u32>)],
        n: usize,
        device: u64,
        cfg: &WorkerConfig,
    ) -> u64 {
        // The scheduler block: the least common multiple of the groups' block sizes, the
        // largest u32 when it does not fit.
        let mut sched = 1u64;
        for spec in self.rank.layout.groups.values() {
            let b = u64::from(spec.block_size);
            if b == 0 {
                continue;
            }
            let (mut x, mut y) = (sched, b);
            while y != 0 {
                (x, y) = (y, x % y);
            }
            match (sched / x).checked_mul(b) {
                Some(l) if l <= u64::from(u32::MAX) => sched = l,
                _ => {
                    sched = u64::from(u32::MAX);
                    break;
                }
            }
        }
        let local = device - device % sched;
        let mut best = device;
        let media: Vec<&String> = self.rank.tiers.keys().map(|(m, _)| m).collect();
        for medium in media {
            let ext = match cfg.lookup.offload_connector {
                OffloadConnector::Offloading => self.offloading_hit(lookups, n, local, medium, cfg),
                OffloadConnector::SimpleCpu => {
                    self.simple_cpu_hit(lookups, n, (local, sched), medium, cfg)
                }
            };
            best = best.max(local + ext);
        }
        best
    }

    fn offloading_hit(
        &self,
        lookups: &[(GroupSpec, Vec<u32>)],
        n: usize,
        local: u64,
        medium: &str,
        cfg: &WorkerConfig,
    ) -> u64 {
        let per_chunk = cfg.lookup.offload_chunk_blocks.unwrap_or(1);
        let mut groups = Vec::new();
        for (spec, ids) in lookups {
            let window = match spec.rule() {
                Rule::ChunkedLocal => self.chunk.or(spec.window),
                _ => spec.window,
            };
            for g in ids {
                if let Some(t) = TierGroup::new(
                    *g,
                    spec.rule(),
                    window,
                    spec.block_size,
                    per_chunk,
                    self.p.hash_block,
                ) {
                    groups.push(t);
                }
            }
        }
        let holds = |g: u32, key: u64| {
            self.rank
                .tiers
                .get(&(medium.to_string(), g))
                .is_some_and(|held| held.contains(&key))
        };
        tier::offload_hit(n, local as usize, self.hashes, &groups, holds) as u64
    }

    /// The `SimpleCPUOffloadConnector`: a rank whose device blocks are the medium's, asked for
    /// the request's tokens after `local`.
    fn simple_cpu_hit(
        &self,
        lookups: &[(GroupSpec, Vec<u32>)],
        n: usize,
        (local, sched): (u64, u64),
        medium: &str,
        cfg: &WorkerConfig,
    ) -> u64 {
        let chunk = lookups
            .iter()
            .find(|(spec, _)| spec.rule() == Rule::ChunkedLocal)
            .and_then(|(spec, _)| self.chunk.or(spec.window));
        let Some((skip, m)) = tier::simple_cpu_suffix(
            n,
            local as usize,
            self.p.hash_block,
            sched as u32,
            chunk,
            cfg.engine,
            self.hashes.len(),
        ) else {
            return 0;
        };
        let mut cpu = RefRank {
            layout: self.rank.layout.clone(),
            ..RefRank::default()
        };
        for ((med, g), held) in &self.rank.tiers {
            if med == medium {
                cpu.blocks.insert(*g, held.clone());
            }
        }
        let ctx = Ctx {
            rank: &cpu,
            hashes: &self.hashes[skip..],
            p: self.p,
            chunk: self.chunk,
        };
        let max_len = (m as u64).saturating_sub(u64::from(self.p.lookahead.max(1)));
        if self.p.eagle {
            ctx.coordinate_eagle(lookups, max_len)
        } else {
            ctx.coordinate(lookups, max_len)
        }
    }

    /// Lookups in coordinator order: identical specs merged, full-attention kinds first.
    fn lookups(&self, full_only: bool) -> Vec<(GroupSpec, Vec<u32>)> {
        let mut out: Vec<(GroupSpec, Vec<u32>)> = Vec::new();
        for pass_full in [true, false] {
            for (id, spec) in &self.rank.layout.groups {
                let rule = spec.rule();
                if rule == Rule::NotCacheable || (rule == Rule::FullAttention) != pass_full {
                    continue;
                }
                if full_only && rule != Rule::FullAttention {
                    continue;
                }
                let mut merged = false;
                for (s, ids) in out.iter_mut() {
                    if s.kind == spec.kind
                        && s.window == spec.window
                        && s.block_size == spec.block_size
                    {
                        ids.push(*id);
                        merged = true;
                    }
                }
                if !merged {
                    out.push((spec.clone(), vec![*id]));
                }
            }
        }
        out
    }

    fn k(&self, spec: &GroupSpec) -> usize {
        (spec.block_size / self.p.hash_block) as usize
    }

    /// Is hash index `idx` of the request cached in every group of the lookup?
    fn cached(&self, groups: &[u32], idx: usize) -> bool {
        if idx >= self.hashes.len() {
            return false;
        }
        let h = self.hashes[idx];
        groups.iter().all(|g| {
            self.rank
                .blocks
                .get(g)
                .is_some_and(|held| held.contains(&h))
        })
    }

    fn block_cached(&self, spec: &GroupSpec, groups: &[u32], i: usize) -> bool {
        let k = self.k(spec);
        self.cached(groups, (i + 1) * k - 1)
    }

    fn coordinate(&self, lookups: &[(GroupSpec, Vec<u32>)], max_len: u64) -> u64 {
        for (spec, _) in lookups {
            if spec.block_size % self.p.hash_block != 0 {
                return 0;
            }
        }
        let mut full_hit: BTreeMap<usize, u64> = BTreeMap::new();
        let mut hit_length = max_len;
        loop {
            let before = hit_length;
            for (i, (spec, groups)) in lookups.iter().enumerate() {
                let hit = match spec.rule() {
                    Rule::FullAttention => match full_hit.get(&i) {
                        Some(first) => (*first).min(hit_length),
                        None => {
                            let h = self.full(spec, groups, hit_length);
                            full_hit.insert(i, h);
                            h
                        }
                    },
                    Rule::SlidingWindow => self.sliding_window(spec, groups, hit_length),
                    Rule::ChunkedLocal => self.chunked_local(spec, groups, hit_length),
                    Rule::Mamba => self.mamba(spec, groups, hit_length),
                    Rule::NotCacheable => hit_length,
                };
                hit_length = hit;
            }
            if hit_length == before {
                return hit_length;
            }
        }
    }

    /// HybridKVCacheCoordinator.find_longest_cache_hit with every group an EAGLE group, or
    /// only the full-attention ones (`Params::eagle_full_only`) (UnitaryKVCacheCoordinator for
    /// one group).
    fn coordinate_eagle(&self, lookups: &[(GroupSpec, Vec<u32>)], max_len: u64) -> u64 {
        for (spec, _) in lookups {
            if spec.block_size % self.p.hash_block != 0 {
                return 0;
            }
        }
        // vLLM groups layers of one spec into one lookup and drops in it when any of its
        // groups is flagged as the drafter's; kvroute takes the drafter's layers to be full
        // attention when the engine flags them (`Params::eagle_full_only`).
        let is_eagle =
            |spec: &GroupSpec| !self.p.eagle_full_only || spec.rule() == Rule::FullAttention;
        if self.p.unitary {
            return match lookups.first() {
                Some((spec, groups)) => self.find_eagle(spec, groups, max_len, is_eagle(spec)),
                None => 0,
            };
        }
        let hash_block = self.p.hash_block as u64;
        let mut hit_length = max_len;
        let mut hit_length_by_lookup: BTreeMap<usize, u64> = BTreeMap::new();
        let mut eagle_verified: Vec<usize> = Vec::new();
        let is_simple_hybrid = lookups.len() == 2 && lookups[0].0.rule() == Rule::FullAttention;
        loop {
            let mut curr_hit_length = hit_length;
            for (idx, (spec, groups)) in lookups.iter().enumerate() {
                if spec.rule() == Rule::FullAttention {
                    if let Some(h) = hit_length_by_lookup.get(&idx) {
                        curr_hit_length = curr_hit_length.min(*h);
                        continue;
                    }
                }
                let drop_eagle_block = is_eagle(spec) && !eagle_verified.contains(&idx);
                let mut max_length = curr_hit_length;
                if drop_eagle_block
                    && spec.rule() != Rule::Mamba
                    && spec.rule() != Rule::ChunkedLocal
                {
                    let block_size = spec.block_size as u64;
                    let fine_lookup = self.p.fine_grained && spec.rule() == Rule::FullAttention;
                    let margin = if fine_lookup && block_size > hash_block {
                        hash_block
                    } else {
                        block_size
                    };
                    max_length =
                        (curr_hit_length + margin).min(self.hashes.len() as u64 * hash_block);
                }
                let drop = drop_eagle_block && spec.rule() != Rule::ChunkedLocal;
                let new_hit_length = self.find_eagle(spec, groups, max_length, drop);
                if drop_eagle_block {
                    eagle_verified.push(idx);
                } else if new_hit_length < curr_hit_length {
                    eagle_verified.clear();
                }
                curr_hit_length = new_hit_length;
                hit_length_by_lookup.insert(idx, new_hit_length);
            }
            if curr_hit_length >= hit_length {
                break;
            }
            hit_length = curr_hit_length;
            if is_simple_hybrid {
                break;
            }
        }
        hit_length
    }

    fn find_eagle(&self, spec: &GroupSpec, groups: &[u32], max_length: u64, drop: bool) -> u64 {
        match spec.rule() {
            Rule::FullAttention => self.full_eagle(spec, groups, max_length, drop),
            Rule::SlidingWindow => self.sliding_window_eagle(spec, groups, max_length, drop),
            Rule::ChunkedLocal => self.chunked_local(spec, groups, max_length),
            Rule::Mamba => self.mamba(spec, groups, max_length),
            Rule::NotCacheable => max_length,
        }
    }

    /// FullAttentionManager.find_longest_cache_hit (phase 1, phase 2, the EAGLE drop).
    fn full_eagle(&self, spec: &GroupSpec, groups: &[u32], max_length: u64, drop: bool) -> u64 {
        let block_size = spec.block_size as u64;
        let alignment_tokens = self.align();
        let mut num_blocks = 0u64;
        for i in 0..(max_length / block_size) as usize {
            if !self.block_cached(spec, groups, i) {
                break;
            }
            num_blocks += 1;
        }
        let mut hit_length = num_blocks * block_size;
        let fine_grained =
            alignment_tokens < block_size && block_size.is_multiple_of(alignment_tokens);
        if fine_grained {
            let scale_factor = block_size / alignment_tokens;
            let first_partial_idx = num_blocks * scale_factor;
            let max_partial_idx = (first_partial_idx + scale_factor - 1)
                .min(max_length / alignment_tokens)
                .min(self.hashes.len() as u64);
            let mut fine_idx = max_partial_idx;
            while fine_idx > first_partial_idx {
                fine_idx -= 1;
                if self.cached(groups, fine_idx as usize) {
                    hit_length = (fine_idx + 1) * alignment_tokens;
                    break;
                }
            }
        }
        if drop && hit_length > 0 {
            hit_length -= alignment_tokens.min(block_size);
        }
        hit_length - hit_length % alignment_tokens
    }

    /// SlidingWindowManager.find_longest_cache_hit with the EAGLE variant.
    fn sliding_window_eagle(
        &self,
        spec: &GroupSpec,
        groups: &[u32],
        max_length: u64,
        drop: bool,
    ) -> u64 {
        let block_size = spec.block_size as u64;
        let alignment_tokens = self.align();
        let window = spec.window.unwrap_or(2).max(2) as u64;
        let mut contiguous_needed = (window - 1).div_ceil(block_size).max(1);
        if drop {
            contiguous_needed += 1;
        }
        let max_num_blocks = (max_length / block_size) as i64;
        let mut computed: Vec<bool> = vec![false; max_num_blocks.max(0) as usize];
        let mut num_contiguous = 0u64;
        let mut match_found = false;
        let mut i = max_num_blocks - 1;
        while i >= 0 {
            if self.block_cached(spec, groups, i as usize) {
                if num_contiguous == 0 && block_size != alignment_tokens {
                    let post_pop_blocks = if drop { i as u64 } else { i as u64 + 1 };
                    if !(post_pop_blocks * block_size).is_multiple_of(alignment_tokens) {
                        i -= 1;
                        continue;
                    }
                }
                computed[i as usize] = true;
                num_contiguous += 1;
                if num_contiguous >= contiguous_needed {
                    computed.truncate(i as usize + num_contiguous as usize);
                    match_found = true;
                    break;
                }
            } else {
                num_contiguous = 0;
            }
            i -= 1;
        }
        if !match_found {
            computed.truncate(num_contiguous as usize);
            while block_size != alignment_tokens
                && !(computed.len() as u64 * block_size).is_multiple_of(alignment_tokens)
            {
                computed.pop();
            }
        }
        if drop && !computed.is_empty() {
            computed.pop();
            while block_size != alignment_tokens
                && !(computed.len() as u64 * block_size).is_multiple_of(alignment_tokens)
            {
                computed.pop();
            }
        }
        computed.len() as u64 * block_size
    }

    fn align(&self) -> u64 {
        self.p.align as u64
    }

    fn full(&self, spec: &GroupSpec, groups: &[u32], max_length: u64) -> u64 {
        let b = spec.block_size as u64;
        let max_num_blocks = (max_length / b) as usize;
        let mut computed = 0usize;
        for i in 0..max_num_blocks {
            if self.block_cached(spec, groups, i) {
                computed += 1;
            } else {
                break;
            }
        }
        if !self.p.fine_grained {
            while computed > 0 && !(computed as u64 * b).is_multiple_of(self.align()) {
                computed -= 1;
            }
            return computed as u64 * b;
        }
        let mut hit = computed as u64 * b;
        let k = self.k(spec);
        let h = self.p.hash_block as u64;
        let mut j = k - 1;
        while j >= 1 {
            let pos = hit + j as u64 * h;
            if pos <= max_length && self.cached(groups, computed * k + j - 1) {
                hit = pos;
                break;
            }
            j -= 1;
        }
        hit
    }

    fn sliding_window(&self, spec: &GroupSpec, groups: &[u32], max_length: u64) -> u64 {
        let b = spec.block_size as u64;
        let a = self.align();
        let window = spec.window.unwrap_or(2).max(2) as u64;
        let contiguous_needed = (window - 1).div_ceil(b).max(1);
        let max_num_blocks = (max_length / b) as i64;
        let mut num_contiguous = 0u64;
        let mut i = max_num_blocks - 1;
        while i >= 0 {
            if self.block_cached(spec, groups, i as usize) {
                if num_contiguous == 0 && b != a && !((i as u64 + 1) * b).is_multiple_of(a) {
                    i -= 1;
                    continue;
                }
                num_contiguous += 1;
                if num_contiguous >= contiguous_needed {
                    return (i as u64 + num_contiguous) * b;
                }
            } else {
                num_contiguous = 0;
            }
            i -= 1;
        }
        let mut blocks = num_contiguous;
        while b != a && !(blocks * b).is_multiple_of(a) {
            blocks -= 1;
        }
        blocks * b
    }

    fn chunked_local(&self, spec: &GroupSpec, groups: &[u32], max_length: u64) -> u64 {
        let b = spec.block_size as u64;
        let start = match self.chunk {
            Some(c) if c > 0 => max_length / c as u64 * c as u64,
            _ => 0,
        };
        let start_block = (start / b) as usize;
        let max_num_blocks = (max_length / b) as usize;
        let mut computed = start_block;
        for i in start_block..max_num_blocks {
            if self.block_cached(spec, groups, i) {
                computed += 1;
            } else {
                break;
            }
        }
        let hit = computed as u64 * b;
        hit - hit % self.align()
    }

    fn mamba(&self, spec: &GroupSpec, groups: &[u32], max_length: u64) -> u64 {
        let a = self.align();
        let (unit, k) = if self.p.fine_grained {
            (self.p.hash_block as u64, 1usize)
        } else {
            (spec.block_size as u64, self.k(spec))
        };
        let max_num = (max_length / unit) as i64;
        let mut i = max_num - 1;
        while i >= 0 {
            if self.cached(groups, (i as usize + 1) * k - 1) {
                if unit != a && !((i as u64 + 1) * unit).is_multiple_of(a) {
                    i -= 1;
                    continue;
                }
                return (i as u64 + 1) * unit;
            }
            i -= 1;
        }
        0
    }
}
