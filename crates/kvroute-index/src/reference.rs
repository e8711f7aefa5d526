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
//! code with `rules`, `holder`, `tier`, `tier_lookup`, `engine::Rules` or `Layout::params_with`
//! (what it shares with the index: the event types, the block hasher and `Layout::learn`, which
//! records each group's kind, window and block sizes from the stores). The oracle fixtures
//! (`conformance/oracle/`) check it against vLLM's own code.
//! Must not: be used on a hot path (every operation is linear).

use crate::engine::Engine;
use crate::event::{is_device_medium, CacheKind, Event, Rule, WorkerId};
use crate::hash::{self, BlockHasher};
use crate::index::Query;
use crate::layout::{GroupSpec, Layout, Learned};
use crate::rank::{HashMode, WorkerConfig};
use crate::tier::OffloadConnector;
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

/// The lookup parameters of one (worker, rank), derived here as vLLM derives them, sharing no
/// code with `Layout::params_with` or `engine::Rules`: `resolve_kv_cache_block_sizes` (the
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

impl RefParams {
    /// `None` when no group is prefix-cacheable.
    fn derive(layout: &Layout, cfg: &WorkerConfig) -> Option<RefParams> {
        let mut cacheable: Vec<&GroupSpec> = Vec::new();
        for spec in layout.groups.values() {
            if spec.rule() != Rule::NotCacheable && spec.block_size > 0 {
                cacheable.push(spec);
            }
        }
        let first = *cacheable.first()?;
        // The scheduler block: the LCM of every group's block size.
        let mut sched = 1u64;
        for spec in layout.groups.values() {
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
        let unitary = layout.groups.len() == 1;
        // The hash block: the configured prefix-match unit, else the smallest (partial) block
        // size the events showed, else the GCD of the cacheable groups' block sizes (one
        // group's block size when there is one). vLLM refuses to start with a unit other than
        // the block size on one group, so on a running engine the configured unit there is
        // the block size; kvroute's configuration is taken as given (as the index does).
        let mut h = 0u64;
        let mut smallest_partial: Option<u64> = None;
        for spec in &cacheable {
            let b = u64::from(spec.block_size);
            let (mut x, mut y) = (h, b);
            while y != 0 {
                (x, y) = (y, x % y);
            }
            h = x;
            if let Some(p) = spec.partial_size {
                let p = u64::from(p);
                smallest_partial = Some(smallest_partial.map_or(p, |s| s.min(p)));
            }
        }
        if let Some(p) = smallest_partial {
            h = p;
        }
        if let Some(unit) = cfg.lookup.hash_block_size {
            h = u64::from(unit);
        }
        let h = h.max(1);
        let (hash_block, align, fine_grained) = if unitary {
            // One group (`UnitaryKVCacheCoordinator`): hits at its block size.
            (h, u64::from(first.block_size), false)
        } else {
            // Partial hash hits: an align-mode Mamba group coarser than the hash block, and
            // every other cacheable group either one whose manager looks up fine-grained
            // (full attention, Mamba) or one at the hash block.
            let mut mamba_coarser = false;
            let mut all_support = true;
            for spec in &cacheable {
                let b = u64::from(spec.block_size);
                match spec.rule() {
                    Rule::Mamba => mamba_coarser |= b > h,
                    Rule::FullAttention => {}
                    _ => all_support &= b == h,
                }
            }
            let fine = mamba_coarser && all_support;
            (h, if fine { h } else { sched }, fine)
        };
        // The engine's rules: lookahead hashes only on 0.33, and then no drop.
        let lookahead = if cfg.engine == Engine::Vllm033 {
            cfg.hash_lookahead_tokens
        } else {
            0
        };
        let eagle = cfg.lookup.eagle && lookahead == 0;
        Some(RefParams {
            hash_block: u32::try_from(hash_block).ok()?,
            sched,
            align: u32::try_from(align).ok()?,
            fine_grained,
            unitary,
            eagle,
            eagle_full_only: eagle && !cfg.lookup.drafter_groups_unflagged,
            lookahead,
        })
    }
}

struct Ctx<'a> {
    rank: &'a RefRank,
    hashes: &'a [u64],
    p: &'a RefParams,
    chunk: Option<u32>,
}

impl Ctx<'_> {
    /// The device hit `device` extended by the offload tier that serves most, by the worker's
    /// connector. vLLM's scheduler hands the connector its device hit rounded down to the
    /// scheduler block (`block_aligned_local`) and keeps the connector's hit only when it goes
    /// past the unrounded one.
    fn with_tier(
        &self,
        lookups: &[(GroupSpec, Vec<u32>)],
        n: usize,
        device: u64,
        cfg: &WorkerConfig,
    ) -> u64 {
        let local = device - device % self.p.sched;
        let mut best = device;
        let media: Vec<&String> = self.rank.tiers.keys().map(|(m, _)| m).collect();
        for medium in media {
            let ext = match cfg.lookup.offload_connector {
                OffloadConnector::Offloading => self.offloading_hit(n, local, medium, cfg),
                OffloadConnector::SimpleCpu => self.simple_cpu_hit(lookups, n, local, medium, cfg),
            };
            best = best.max(local + ext);
        }
        best
    }

    /// Does the tier `medium` hold `key` in group `group`?
    fn tier_holds(&self, medium: &str, group: u32, key: u64) -> bool {
        self.rank
            .tiers
            .get(&(medium.to_string(), group))
            .is_some_and(|held| held.contains(&key))
    }

    /// The `OffloadingConnector`'s scheduler-side lookup (`_lookup_complete_chunks` in
    /// `offloading/scheduler.py`, vLLM 0.32 and 0.33) as plain loops: the tokens after `local`
    /// it can load from `medium`. No group is a flagged drafter group here (`predict` asks only
    /// then), no lookup is deferred, no chunk is being loaded, no `max_load_tokens`.
    fn offloading_hit(&self, n: usize, local: u64, medium: &str, cfg: &WorkerConfig) -> u64 {
        /// One offloaded group (`GroupOffloadConfig`).
        struct Offloaded {
            group: u32,
            tokens_per_chunk: i64,
            hashes_per_chunk: usize,
            /// `sliding_window_size_in_chunks` (`None`: full attention).
            window_chunks: Option<i64>,
            /// A sliding window's tokens (`load_window_size_in_chunks` widens by it).
            sliding_window: Option<i64>,
        }
        let blocks_per_chunk = i64::from(cfg.lookup.offload_chunk_blocks.unwrap_or(1).max(1));
        let hash_block = i64::from(self.p.hash_block);
        let mut configs: Vec<Offloaded> = Vec::new();
        let mut mamba_align: Option<i64> = None;
        for (id, spec) in &self.rank.layout.groups {
            let rule = spec.rule();
            if rule == Rule::NotCacheable || spec.block_size == 0 {
                continue;
            }
            let c = i64::from(spec.block_size) * blocks_per_chunk;
            let hashes_per_chunk = (c / hash_block) as usize;
            if hashes_per_chunk == 0 {
                continue;
            }
            let (window_chunks, sliding_window) = match rule {
                Rule::FullAttention => (None, None),
                Rule::SlidingWindow => {
                    let Some(w) = spec.window.filter(|w| *w > 0).map(i64::from) else {
                        continue;
                    };
                    // max(⌈w / c⌉, ⌈(w − 1 + extra_retained_tokens) / c⌉), no extra tokens.
                    let a = (w + c - 1) / c;
                    let b = (w - 1 + c - 1) / c;
                    (Some(a.max(b)), Some(w))
                }
                Rule::ChunkedLocal => {
                    let Some(chunk) = self.chunk.or(spec.window).filter(|c| *c > 0) else {
                        continue;
                    };
                    (Some((i64::from(chunk) + c - 1) / c), None)
                }
                Rule::Mamba => {
                    mamba_align = Some(c);
                    (Some(1), None)
                }
                Rule::NotCacheable => continue,
            };
            configs.push(Offloaded {
                group: *id,
                tokens_per_chunk: c,
                hashes_per_chunk,
                window_chunks,
                sliding_window,
            });
        }
        // Full attention first, then the windowed groups by window, largest first (a stable
        // sort, as Python's).
        let mut full_groups: Vec<usize> = Vec::new();
        let mut window_groups: Vec<usize> = Vec::new();
        for (i, g) in configs.iter().enumerate() {
            if g.window_chunks.is_none() {
                full_groups.push(i);
            } else {
                window_groups.push(i);
            }
        }
        window_groups.sort_by_key(|i| std::cmp::Reverse(configs[*i].window_chunks));
        let mut all_groups = full_groups.clone();
        all_groups.extend(window_groups.iter().copied());

        let local = local as i64;
        let mut max_hit = n as i64;
        if !window_groups.is_empty() {
            // The last prompt token is computed again.
            max_hit -= 1;
            if let Some(m) = mamba_align {
                max_hit -= max_hit.rem_euclid(m);
            }
        }
        let mut num_hit: i64 = 0;
        let mut lookup_groups = all_groups.clone();
        while !lookup_groups.is_empty() {
            let mut looked_up_window = false;
            let this_pass = std::mem::take(&mut lookup_groups);
            for gi in this_pass {
                let g = &configs[gi];
                let c = g.tokens_per_chunk;
                // The group's keys: the hash ending each whole chunk.
                let mut keys: Vec<u64> = Vec::new();
                let mut idx = g.hashes_per_chunk - 1;
                while idx < self.hashes.len() {
                    keys.push(self.hashes[idx]);
                    idx += g.hashes_per_chunk;
                }
                let num_keys = keys.len() as i64;
                max_hit = max_hit.min(num_keys * c);
                if max_hit - local < c {
                    return 0;
                }
                let num_chunks = ((max_hit + c - 1) / c).min(num_keys);
                let start = local / c;
                let window: Vec<u64> = if start < num_chunks {
                    keys[start as usize..num_chunks as usize].to_vec()
                } else {
                    Vec::new()
                };
                let holds = |key: u64| self.tier_holds(medium, g.group, key);
                let num_hit_chunks: i64 = match g.window_chunks {
                    None => {
                        // The longest run of held keys from the start.
                        let mut count = 0;
                        for key in &window {
                            if !holds(*key) {
                                break;
                            }
                            count += 1;
                        }
                        count
                    }
                    Some(required) => {
                        let candidate_end = max_hit.min(num_chunks * c);
                        // `load_window_size_in_chunks`: a sliding window also covers the
                        // chunk the end rounds up into.
                        let mut initial = required;
                        if let Some(w) = g.sliding_window {
                            let pad = (-candidate_end).rem_euclid(c);
                            initial = initial.max((w - 1 + pad + c - 1) / c);
                        }
                        // Scanning from the right: the end of the first run of `need` held
                        // keys (`initial` for the run touching the right edge), else the
                        // length of the run reaching the start.
                        let mut consecutive = 0i64;
                        let mut need = if initial != 0 { initial } else { required };
                        let mut found = None;
                        for i in (0..window.len()).rev() {
                            if holds(window[i]) {
                                consecutive += 1;
                            } else {
                                consecutive = 0;
                                need = required;
                            }
                            if consecutive == need {
                                found = Some(i as i64 + need);
                                break;
                            }
                        }
                        found.unwrap_or(consecutive)
                    }
                };
                if num_hit_chunks == 0 {
                    return 0;
                }
                max_hit = max_hit.min(c * (start + num_hit_chunks));
                let new_num_hit = max_hit - local;
                if new_num_hit < c {
                    return 0;
                }
                if new_num_hit < num_hit && looked_up_window && lookup_groups.is_empty() {
                    // A window group looked up at a longer end is looked up again.
                    lookup_groups = window_groups.clone();
                }
                looked_up_window |= g.window_chunks.is_some();
                num_hit = new_num_hit;
            }
        }
        num_hit.max(0) as u64
    }

    /// The `SimpleCPUOffloadConnector`'s `get_num_new_matched_tokens` (`simple_kv_offload/
    /// manager.py`): the coordinator's own rules over the tier's blocks, on the hashes after
    /// `local`, at most `n − 1 − local`.
    fn simple_cpu_hit(
        &self,
        lookups: &[(GroupSpec, Vec<u32>)],
        n: usize,
        local: u64,
        medium: &str,
        cfg: &WorkerConfig,
    ) -> u64 {
        // Copies are whole scheduler blocks.
        if !local.is_multiple_of(self.p.sched) {
            return 0;
        }
        // 0.33: the suffix's chunk boundaries must be the request's.
        if cfg.engine == Engine::Vllm033 {
            for (spec, _) in lookups {
                if spec.rule() != Rule::ChunkedLocal {
                    continue;
                }
                if let Some(chunk) = self.chunk.or(spec.window).filter(|c| *c > 0) {
                    if !local.is_multiple_of(u64::from(chunk)) {
                        return 0;
                    }
                }
            }
        }
        let skipped = (local / u64::from(self.p.hash_block.max(1))) as usize;
        if skipped >= self.hashes.len() {
            return 0;
        }
        let max_hit_len = n as i64 - 1 - local as i64;
        if max_hit_len <= 0 {
            return 0;
        }
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
            hashes: &self.hashes[skipped..],
            p: self.p,
            chunk: self.chunk,
        };
        if self.p.eagle {
            ctx.coordinate_eagle(lookups, max_hit_len as u64)
        } else {
            ctx.coordinate(lookups, max_hit_len as u64)
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
    /// only the full-attention ones (`RefParams::eagle_full_only`) (UnitaryKVCacheCoordinator for
    /// one group).
    fn coordinate_eagle(&self, lookups: &[(GroupSpec, Vec<u32>)], max_len: u64) -> u64 {
        for (spec, _) in lookups {
            if spec.block_size % self.p.hash_block != 0 {
                return 0;
            }
        }
        // vLLM groups layers of one spec into one lookup and drops in it when any of its
        // groups is flagged as the drafter's; kvroute takes the drafter's layers to be full
        // attention when the engine flags them (`RefParams::eagle_full_only`).
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
