//! The concurrent hybrid cache index: every (worker, rank)'s state, and predictions.
//!
//! Owns: the map (worker, rank) → `RankState` (and the same ranks sorted, the order predictions
//! return), per-worker configuration, index-wide counters, whether ranks keep eviction figures
//! (off by default), and the prediction entry points (one request against every worker, or
//! one worker; with each group's evidence or without).
//! Invariants: one event is applied holding the shared run store's write lock and its rank's
//! write lock, so a prediction (holding the store's read lock throughout) never sees half of an
//! event; lock order is `configs`, `ranks`, `runs`, one rank, and the digest cache (a leaf:
//! nothing is locked under it); the outer map is write-locked only to add or drop a rank; a
//! request is hashed once per distinct hash setting and walked through the shared store once
//! per setting and stride; a rank is dropped only after giving its shared holder ids back.
//! Must not: decode wire bytes or talk to sockets.

use crate::chains::Chains;
use crate::counters::{Counter, Counters};
use crate::event::Rule;
use crate::event::{Event, WorkerId};
use crate::hash::{self, BlockExtras, BlockHasher, HashAlgo};
use crate::holder::{MixBuild, Multiset};
use crate::image::{ImageError, RankImage};
use crate::layout::{GroupSpec, Params, Plan};
use crate::rank::{RankState, RankStats, WorkerConfig};
use crate::rules::{self, GroupEvidence, HolderRef, Lookup, STACK_LOOKUPS};
use crate::runs::Runs;
use crate::tier::OffloadConnector;
use crate::tier_lookup;
use parking_lot::RwLock;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A request as the router sees it.
#[derive(Clone, Debug, Default)]
pub struct Query {
    pub tokens: Vec<u32>,
    pub extras: BlockExtras,
    /// Requests that skip reading the prefix cache (prompt logprobs) always hit 0.
    pub skip_prefix_cache: bool,
}

/// How much a prediction computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Detail {
    /// `cached` and `group_blind` only; `Prediction::groups` is left empty. The routing path.
    Cached,
    /// Also each group's own servable length (`explain`, the gateway's decision header).
    #[default]
    Evidence,
}

/// One (worker, rank)'s predicted reuse for a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Prediction {
    pub worker: WorkerId,
    pub dp_rank: u32,
    /// Predicted `num_cached_tokens`: the device hit plus `tier`.
    pub cached: u64,
    /// The part of `cached` an offload tier serves (vLLM's `OffloadingConnector` loads it
    /// before the prefill; `tier.rs`).
    pub tier: u64,
    /// The medium of `tier` (`"CPU"`); `None` when `tier` is 0 or on the routing path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier_medium: Option<String>,
    /// What a router looking only at full-attention groups would predict.
    pub group_blind: u64,
    /// Each group alone; empty when predicted with `Detail::Cached`.
    pub groups: Vec<GroupEvidence>,
    pub params: Option<Params>,
    pub degraded: bool,
}

/// A worker's eviction figures ([`Index::eviction_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EvictionStats {
    /// Tokens its ranks stored in their eviction groups (lowest full-attention group).
    pub tokens_stored: u64,
    /// Of those, tokens of blocks stored again after the rank removed them (re-prefilled).
    pub tokens_restored: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    pub ranks: usize,
    pub holders: usize,
    pub block_copies: u64,
    /// The index's blocks (ranks, their tables and the shared store).
    pub heap_bytes: usize,
    /// The cache of request block digests, kept apart (bounded; not the fleet's blocks).
    pub digest_cache_bytes: usize,
}

pub(crate) type RankKey = (WorkerId, u32);
pub(crate) type RankRef = Arc<RwLock<RankState>>;

/// Every rank, by key and in key order (the same `Arc`s in both).
#[derive(Default)]
pub(crate) struct Ranks {
    pub(crate) by_key: HashMap<RankKey, RankRef, MixBuild>,
    pub(crate) sorted: Vec<(RankKey, RankRef)>,
    /// Every live rank by its id; ids are never reused.
    pub(crate) by_id: HashMap<u64, RankKey, MixBuild>,
    next_id: u64,
}

/// A rank's compact id in this index (what `Index::hits` answers with): never reused, so an
/// id of a removed rank resolves to nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RankId(pub u64);

/// The hybrid cache index.
#[derive(Default)]
pub struct Index {
    pub(crate) ranks: RwLock<Ranks>,
    /// Every full-attention group's device blocks (see `runs`). Lock order: `configs`, then
    /// `ranks`, then `runs`, then a rank; an event holds `runs` written and its rank written,
    /// so events are applied one at a time and a prediction (holding `runs` read) never sees
    /// half of one.
    pub(crate) runs: RwLock<Runs>,
    /// Bumped (under `runs` written) whenever a rank appears or goes, a rank's plan changes or
    /// its degraded mark is set: the sparse prediction's roster is rebuilt then.
    pub(crate) layout_gen: std::sync::atomic::AtomicU64,
    pub(crate) roster: parking_lot::Mutex<Option<Arc<crate::sparse::Roster>>>,
    configs: RwLock<HashMap<WorkerId, WorkerConfig>>,
    default_config: WorkerConfig,
    /// Whether ranks keep the eviction figures ([`Index::set_eviction_tracking`]; off by
    /// default: a removal then costs no fingerprint push and no `runs` lookup per block).
    track_evictions: std::sync::atomic::AtomicBool,
    counters: Counters,
    /// Digests of request blocks seen before (hashing is most of a routing decision).
    pub(crate) digests: crate::hash::cache::DigestCache,
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// An index whose cache of request block digests keeps at most `max_tokens` tokens (0: no
    /// cache; `Index::new` keeps `hash::cache::DEFAULT_MAX_TOKENS`).
    pub fn with_digest_cache(max_tokens: usize) -> Index {
        Index {
            digests: crate::hash::cache::DigestCache::new(max_tokens),
            ..Index::default()
        }
    }

    /// An index whose workers default to `config` unless configured one by one.
    pub fn with_default(config: WorkerConfig) -> Index {
        Index {
            default_config: config,
            ..Index::default()
        }
    }

    /// Sets a worker's configuration. Ranks already known restart empty under it when the hash
    /// mode changes (their keys would mean something else).
    pub fn configure_worker(&self, worker: &WorkerId, config: WorkerConfig) {
        self.configs.write().insert(worker.clone(), config.clone());
        let ranks = self.ranks.read();
        let mut runs = self.runs.write();
        for ((w, _), rank) in ranks.by_key.iter() {
            if w == worker {
                let mut r = rank.write();
                if r.config.hash != config.hash {
                    r.reset(&mut runs);
                    let (id, track) = (r.id, r.track_evictions);
                    *r = RankState::new(config.clone());
                    r.id = id;
                    r.track_evictions = track;
                } else {
                    r.set_config(config.clone());
                }
            }
        }
        self.bump();
    }

    /// Starts or stops keeping every rank's eviction figures ([`Index::eviction_stats`]): the
    /// blocks each rank's eviction group removed lately (up to
    /// [`crate::ghosts::GHOST_KEYS`] fingerprints a rank) and the tokens it stored and
    /// re-stored. Stopping frees the removed blocks; the totals so far stay. A rank created
    /// later takes the current setting.
    pub fn set_eviction_tracking(&self, on: bool) {
        // Under the ranks' write lock: a rank is created under it too (reading the setting),
        // and two calls cannot interleave their walks.
        let ranks = self.ranks.write();
        if self
            .track_evictions
            .swap(on, std::sync::atomic::Ordering::AcqRel)
            == on
        {
            return;
        }
        for (_, rank) in &ranks.sorted {
            rank.write().set_eviction_tracking(on);
        }
    }

    /// Whether the ranks keep eviction figures ([`Index::set_eviction_tracking`]).
    pub fn tracks_evictions(&self) -> bool {
        self.track_evictions
            .load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn worker_config(&self, worker: &WorkerId) -> WorkerConfig {
        self.configs
            .read()
            .get(worker)
            .cloned()
            .unwrap_or_else(|| self.default_config.clone())
    }

    /// Drops every rank of a worker (and its configuration).
    pub fn remove_worker(&self, worker: &WorkerId) {
        {
            let mut ranks = self.ranks.write();
            let mut runs = self.runs.write();
            for ((w, _), r) in &ranks.sorted {
                if w == worker {
                    let mut r = r.write();
                    r.reset(&mut runs);
                    r.dropped = true;
                }
            }
            ranks.by_key.retain(|(w, _), _| w != worker);
            ranks.sorted.retain(|((w, _), _)| w != worker);
            ranks.by_id.retain(|_, (w, _)| w != worker);
            self.bump();
        }
        self.configs.write().remove(worker);
    }

    fn rank(&self, worker: &WorkerId, dp_rank: u32) -> RankRef {
        let key = (worker.clone(), dp_rank);
        if let Some(r) = self.ranks.read().by_key.get(&key) {
            return r.clone();
        }
        let config = self.worker_config(worker);
        let mut ranks = self.ranks.write();
        if let Some(r) = ranks.by_key.get(&key) {
            return r.clone();
        }
        let mut state = RankState::new(config);
        state.track_evictions = self.tracks_evictions();
        state.id = ranks.next_id;
        ranks.next_id += 1;
        ranks.by_id.insert(state.id, key.clone());
        let r: RankRef = Arc::new(RwLock::new(state));
        let at = ranks
            .sorted
            .binary_search_by(|(k, _)| k.cmp(&key))
            .unwrap_or_else(|at| at);
        ranks.sorted.insert(at, (key.clone(), r.clone()));
        ranks.by_key.insert(key, r.clone());
        self.bump();
        r
    }

    /// Applies one event.
    pub fn apply(&self, ev: &Event) {
        let rank = self.rank(ev.worker(), ev.dp_rank());
        self.apply_to(&rank, ev);
    }

    /// Marks the roster of shared holders stale.
    fn bump(&self) {
        self.layout_gen
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    fn apply_to(&self, rank: &RankRef, ev: &Event) {
        let mut runs = self.runs.write();
        let mut r = rank.write();
        self.apply_locked(&mut runs, &mut r, ev);
    }

    /// Applies one event to a rank whose lock, and the store's, the caller holds.
    fn apply_locked(&self, runs: &mut Runs, r: &mut RankState, ev: &Event) {
        if r.dropped {
            // The worker was removed while this event was on its way.
            return;
        }
        let gen = r.plan_gen;
        match ev {
            Event::Stored(s) => r.store(s, &self.counters, runs),
            Event::Removed(rm) => r.remove(rm, &self.counters, runs),
            Event::Cleared(_) => {
                self.counters.add(Counter::ClearEvents, 1);
                r.stats.clears += 1;
                r.clear(runs);
            }
        }
        if r.plan_gen != gen {
            self.bump();
        }
    }

    /// Applies events in order. Consecutive events of one (worker, rank) (a subscription's
    /// batch) are applied under one hold of the locks, at most `LOCKED_RUN` at a time so that
    /// predictions wait for a few events, not a whole batch; each event is still whole to every
    /// prediction.
    pub fn apply_all<'a>(&self, events: impl IntoIterator<Item = &'a Event>) {
        const LOCKED_RUN: usize = 64;
        let same = |a: &Event, b: &Event| {
            a.dp_rank() == b.dp_rank()
                && (Arc::ptr_eq(a.worker(), b.worker()) || a.worker() == b.worker())
        };
        let mut events = events.into_iter().peekable();
        let mut last: Option<(&Event, RankRef)> = None;
        while let Some(ev) = events.next() {
            let rank = match &last {
                Some((prev, rank)) if same(prev, ev) => rank.clone(),
                _ => self.rank(ev.worker(), ev.dp_rank()),
            };
            {
                let mut runs = self.runs.write();
                let mut r = rank.write();
                self.apply_locked(&mut runs, &mut r, ev);
                let mut held = 1;
                while held < LOCKED_RUN {
                    match events.peek() {
                        Some(next) if same(ev, next) => {
                            self.apply_locked(&mut runs, &mut r, next);
                            events.next();
                            held += 1;
                        }
                        _ => break,
                    }
                }
            }
            last = Some((ev, rank));
        }
    }

    /// Empties one rank (the intake calls this when its stream cannot be recovered) and sets
    /// or clears its degraded mark.
    pub fn clear_rank(&self, worker: &WorkerId, dp_rank: u32) {
        let rank = self.rank(worker, dp_rank);
        let mut runs = self.runs.write();
        let mut r = rank.write();
        if !r.dropped {
            r.clear(&mut runs);
        }
    }

    pub fn set_degraded(&self, worker: &WorkerId, dp_rank: u32, degraded: bool) {
        let rank = self.rank(worker, dp_rank);
        let _runs = self.runs.write();
        let mut r = rank.write();
        if r.degraded != degraded {
            r.degraded = degraded;
            self.bump();
        }
    }

    /// The (worker, rank) behind an id from `hits`; `None` once the rank is gone.
    pub fn rank_key(&self, id: RankId) -> Option<(WorkerId, u32)> {
        self.ranks.read().by_id.get(&id.0).cloned()
    }

    /// A known rank's id.
    pub fn rank_id(&self, worker: &WorkerId, dp_rank: u32) -> Option<RankId> {
        self.inspect(worker, dp_rank, |r| RankId(r.id))
    }

    /// The lookup parameters of a worker's first rank that has any (its layout is known), with
    /// that rank: what a caller of `hits` needs for a worker that hits nothing.
    pub fn params_of(&self, worker: &WorkerId) -> Option<(u32, Params)> {
        let ranks = self.ranks.read();
        let from = ranks.sorted.partition_point(|((w, _), _)| w < worker);
        ranks.sorted[from..]
            .iter()
            .take_while(|((w, _), _)| w == worker)
            .find_map(|((_, d), r)| r.read().params().map(|p| (*d, p)))
    }

    /// Workers and ranks known, sorted.
    pub fn ranks(&self) -> Vec<(WorkerId, u32)> {
        self.ranks
            .read()
            .sorted
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A rank the index knows (never creates one).
    fn known(&self, worker: &WorkerId, dp_rank: u32) -> Option<RankRef> {
        self.ranks
            .read()
            .by_key
            .get(&(worker.clone(), dp_rank))
            .cloned()
    }

    /// Runs `f` on one rank's state under its read lock.
    pub fn inspect<T>(
        &self,
        worker: &WorkerId,
        dp_rank: u32,
        f: impl FnOnce(&RankState) -> T,
    ) -> Option<T> {
        let rank = self.known(worker, dp_rank)?;
        let r = rank.read();
        Some(f(&r))
    }

    /// One rank's cache state as an image (`None`: the index does not know the rank).
    pub fn export_rank(&self, worker: &WorkerId, dp_rank: u32) -> Option<RankImage> {
        let rank = self.known(worker, dp_rank)?;
        let runs = self.runs.read();
        let r = rank.read();
        Some(r.export(&runs))
    }

    /// Replaces one rank's cache state with an image's, checked first (the rank keeps its
    /// worker's configuration and its degraded mark).
    pub fn import_rank(
        &self,
        worker: &WorkerId,
        dp_rank: u32,
        image: &RankImage,
    ) -> Result<(), ImageError> {
        image.check()?;
        let rank = self.rank(worker, dp_rank);
        {
            let mut runs = self.runs.write();
            let mut r = rank.write();
            if r.dropped {
                return Ok(());
            }
            r.import(image, &mut runs);
        }
        self.bump();
        Ok(())
    }

    pub fn rank_stats(&self) -> Vec<(WorkerId, u32, RankStats)> {
        self.ranks
            .read()
            .sorted
            .iter()
            .map(|((w, d), r)| (w.clone(), *d, r.read().stats.clone()))
            .collect()
    }

    /// A worker's eviction figures summed over its ranks (`RankStats`' eviction-group
    /// tokens); zeros for a worker never seen, and nothing counted while the index does not
    /// track evictions ([`Index::set_eviction_tracking`]). Running totals: a rank dropped or
    /// reset takes its share with it, so they can go backwards.
    pub fn eviction_stats(&self, worker: &WorkerId) -> EvictionStats {
        let ranks = self.ranks.read();
        let from = ranks.sorted.partition_point(|((w, _), _)| w < worker);
        ranks.sorted[from..]
            .iter()
            .take_while(|((w, _), _)| w == worker)
            .fold(EvictionStats::default(), |sum, (_, rank)| {
                let st = &rank.read().stats;
                EvictionStats {
                    tokens_stored: sum.tokens_stored + st.eviction_group_tokens_stored,
                    tokens_restored: sum.tokens_restored + st.eviction_group_tokens_restored,
                }
            })
    }

    /// Device contents per (worker, rank) → group → hash → copies (empty groups left out).
    pub fn contents(&self) -> BTreeMap<(WorkerId, u32), BTreeMap<u32, BTreeMap<u64, u32>>> {
        let ranks = self.ranks.read();
        let runs = self.runs.read();
        ranks
            .sorted
            .iter()
            .map(|(k, r)| (k.clone(), r.read().contents(&runs)))
            .filter(|(_, c)| !c.is_empty())
            .collect()
    }

    pub fn stats(&self) -> IndexStats {
        let ranks = self.ranks.read();
        let runs = self.runs.read();
        let mut s = IndexStats {
            ranks: ranks.sorted.len(),
            heap_bytes: runs.heap_bytes(),
            digest_cache_bytes: self.digests.heap_bytes(),
            ..IndexStats::default()
        };
        for (_, r) in &ranks.sorted {
            let r = r.read();
            s.holders += r.groups.len();
            s.block_copies += r.block_copies(&runs);
            s.heap_bytes += r.heap_bytes();
        }
        s
    }

    /// Predicts the request on every known (worker, rank), sorted by worker and rank, with
    /// each group's evidence.
    pub fn predict_all(&self, q: &Query) -> Vec<Prediction> {
        self.predict_all_detail(q, Detail::Evidence)
    }

    /// `predict_all` computing only what `detail` asks for (`Detail::Cached` for routing).
    pub fn predict_all_detail(&self, q: &Query, detail: Detail) -> Vec<Prediction> {
        self.predict_each(&mut Chains::new(q, &self.digests, &self.counters), detail)
    }

    /// Predicts a request of `n_tokens` tokens whose 64-bit block-hash chain is `chain`, on
    /// every known (worker, rank), without hashing anything: `chain[i]` must be the hash
    /// `predict_all` would compute for block `i` of the request's first `n_tokens − 1` tokens at
    /// each rank's hash block size (the caller vouches that every rank shares one hash block
    /// size, one hash mode and one lookahead count, the chain hashed with it). The request carries no extras and reads the prefix cache.
    /// Equal to `predict_all_detail` for such a chain; meant for callers that hashed the
    /// request already, and for benchmarks.
    pub fn predict_all_with_chain(
        &self,
        n_tokens: usize,
        chain: &[u64],
        detail: Detail,
    ) -> Vec<Prediction> {
        self.predict_each(&mut Chains::given(n_tokens, chain), detail)
    }

    fn predict_each(&self, chains: &mut Chains<'_>, detail: Detail) -> Vec<Prediction> {
        self.prehash(chains);
        let ranks = self.ranks.read();
        let runs = self.runs.read();
        let mut out = Vec::with_capacity(ranks.sorted.len());
        for ((w, d), r) in &ranks.sorted {
            out.push(predict_rank(w, *d, &r.read(), &runs, chains, detail));
        }
        drop(runs);
        drop(ranks);
        self.counters.add(Counter::Predictions, 1);
        out
    }

    /// Predicts the request on one (worker, rank), with each group's evidence; a rank never
    /// seen predicts 0.
    pub fn predict(&self, worker: &WorkerId, dp_rank: u32, q: &Query) -> Prediction {
        self.predict_detail(worker, dp_rank, q, Detail::Evidence)
    }

    /// `predict` computing only what `detail` asks for.
    pub fn predict_detail(
        &self,
        worker: &WorkerId,
        dp_rank: u32,
        q: &Query,
        detail: Detail,
    ) -> Prediction {
        self.counters.add(Counter::Predictions, 1);
        let mut chains = Chains::new(q, &self.digests, &self.counters);
        self.prehash(&mut chains);
        let ranks = self.ranks.read();
        let rank = ranks.by_key.get(&(worker.clone(), dp_rank));
        let runs = self.runs.read();
        match rank {
            Some(r) => predict_rank(worker, dp_rank, &r.read(), &runs, &mut chains, detail),
            None => Prediction {
                worker: worker.clone(),
                dp_rank,
                cached: 0,
                tier: 0,
                tier_medium: None,
                group_blind: 0,
                groups: Vec::new(),
                params: None,
                degraded: false,
            },
        }
    }
}

/// Holders a prediction resolves on the stack; a layout with more groups takes a `Vec`.
pub const STACK_HOLDERS: usize = 8;

pub(crate) fn predict_rank(
    worker: &WorkerId,
    dp_rank: u32,
    r: &RankState,
    runs: &Runs,
    chains: &mut Chains<'_>,
    detail: Detail,
) -> Prediction {
    let plan = r.plan();
    let mut pred = Prediction {
        worker: worker.clone(),
        dp_rank,
        cached: 0,
        tier: 0,
        tier_medium: None,
        group_blind: 0,
        groups: Vec::new(),
        params: plan.params,
        degraded: r.degraded,
    };
    let Some(p) = plan.params else { return pred };
    let (n_tokens, skip) = (chains.n_tokens, chains.skip);
    let mode = &r.config.hash;
    let h = p.hash_block;
    // Full-attention groups live in the shared store: walk the request through it once per
    // setting and stride (every rank of a fleet usually shares one), then read each holder's
    // leading blocks from the walk.
    let slot = chains.slot(mode, h, p.lookahead);
    for (spec, ids) in &plan.lookups {
        if let Some(k) = shared_stride(spec, h) {
            if ids
                .iter()
                .any(|g| r.groups.get(g).is_some_and(|s| s.shared.is_some()))
            {
                chains.ensure_walk(slot, k, runs);
            }
        }
    }
    let chains = &*chains;
    let chain = chains.chain_at(slot);
    let empty = Multiset::default();
    let holder = |spec: &GroupSpec, g: &u32| match r.groups.get(g) {
        Some(s) => match s.shared {
            Some(id) => HolderRef::Shared {
                runs,
                id,
                prefix: shared_stride(spec, h)
                    .and_then(|k| chains.walk(slot, k))
                    .and_then(|w| w.get(id as usize))
                    .map(|p| *p as u64),
            },
            None => match s.own.and_then(|(t, slot)| Some((r.specs.get(t)?, slot))) {
                // A table with one group is that group's multiset.
                Some((set, 0)) if set.single().is_some() => {
                    HolderRef::Own(set.single().unwrap_or(&empty))
                }
                Some((set, slot)) => HolderRef::Spec { set, slot },
                None => HolderRef::Own(&empty),
            },
        },
        None => HolderRef::Own(&empty),
    };
    let chunk = r.config.lookup.chunk_size;
    let evidence = detail == Detail::Evidence;
    let j = with_lookups(plan, &empty, holder, |lookups| {
        rules::joint(lookups, chain, n_tokens, &p, chunk, evidence)
    });
    pred.cached = if skip { 0 } else { j.cached };
    pred.group_blind = j.group_blind;
    pred.groups = j.groups;
    // The `OffloadingConnector`'s EAGLE rule (one more chunk queried, then dropped, in the
    // groups flagged as the drafter's) is not modeled: with no group flagged it pops nothing.
    // The `SimpleCPUOffloadConnector`'s is the coordinator's own.
    let lk = &r.config.lookup;
    let tier_rule_known = !p.eagle
        || lk.offload_connector == OffloadConnector::SimpleCpu
        || lk.drafter_groups_unflagged;
    if !skip && tier_rule_known && !r.offload.is_empty() {
        if let Some((tier, medium)) =
            tier_lookup::tier_part(r, plan, &p, chain, n_tokens, pred.cached)
        {
            pred.cached += tier;
            pred.tier = tier;
            pred.tier_medium = evidence.then_some(medium);
        }
    }
    pred
}

/// The stride (hash blocks per block) of a full-attention group kept in the shared store, when
/// its block is a whole number of hash blocks.
pub(crate) fn shared_stride(spec: &GroupSpec, h: u32) -> Option<u32> {
    (spec.rule() == Rule::FullAttention
        && h > 0
        && spec.block_size > 0
        && spec.block_size.is_multiple_of(h))
    .then(|| spec.block_size / h)
}

/// Runs `f` on the plan's lookups with their holders resolved, on the stack when they fit.
pub(crate) fn with_lookups<'a, T>(
    plan: &'a Plan,
    empty: &'a Multiset,
    holder: impl Fn(&'a GroupSpec, &u32) -> HolderRef<'a>,
    f: impl FnOnce(&[Lookup<'_>]) -> T,
) -> T {
    let Some((first, _)) = plan.lookups.first() else {
        return f(&[]);
    };
    let n = plan.lookups.len();
    let total: usize = plan.lookups.iter().map(|(_, ids)| ids.len()).sum();
    let dummy = Lookup {
        spec: first,
        groups: &[],
        holders: &[],
    };
    if n <= STACK_LOOKUPS && total <= STACK_HOLDERS {
        let mut hs = [HolderRef::Own(empty); STACK_HOLDERS];
        for (slot, (spec, g)) in hs.iter_mut().zip(
            plan.lookups
                .iter()
                .flat_map(|(spec, ids)| ids.iter().map(move |g| (spec, g))),
        ) {
            *slot = holder(spec, g);
        }
        let mut lks = [dummy; STACK_LOOKUPS];
        let mut at = 0;
        for (lk, (spec, ids)) in lks.iter_mut().zip(&plan.lookups) {
            *lk = Lookup {
                spec,
                groups: ids,
                holders: &hs[at..at + ids.len()],
            };
            at += ids.len();
        }
        f(&lks[..n])
    } else {
        let hs: Vec<HolderRef<'a>> = plan
            .lookups
            .iter()
            .flat_map(|(spec, ids)| ids.iter().map(|g| holder(spec, g)))
            .collect();
        let mut lks = Vec::with_capacity(n);
        let mut at = 0;
        for (spec, ids) in &plan.lookups {
            lks.push(Lookup {
                spec,
                groups: ids,
                holders: &hs[at..at + ids.len()],
            });
            at += ids.len();
        }
        f(&lks)
    }
}

/// The hashes `kvroute hash` prints: (index, 64-bit value, digest) of every full block.
pub fn block_hashes(
    algo: HashAlgo,
    seed: &str,
    block: usize,
    tokens: &[u32],
    extras: &BlockExtras,
) -> Vec<(usize, u64, hash::Digest)> {
    block_hashes_lookahead(algo, seed, block, tokens, extras, 0)
}

/// `block_hashes` under vLLM 0.33's lookahead hashes: (index, 64-bit value, digest) of every
/// block that has a hash with `lookahead` lookahead tokens (`e + lookahead ≤ n`).
pub fn block_hashes_lookahead(
    algo: HashAlgo,
    seed: &str,
    block: usize,
    tokens: &[u32],
    extras: &BlockExtras,
    lookahead: usize,
) -> Vec<(usize, u64, hash::Digest)> {
    BlockHasher::new(algo, seed)
        .chain_lookahead(tokens, block, extras, lookahead)
        .into_iter()
        .enumerate()
        .map(|(i, d)| (i, hash::external(&d).0, d))
        .collect()
}

#[cfg(test)]
mod tests;
