//! The concurrent hybrid cache index: every (worker, rank)'s state, and predictions.
//!
//! Owns: the map (worker, rank) → `RankState`, per-worker configuration, index-wide counters,
//! and the prediction entry points (one request against every worker, or one worker).
//! Invariants: one event is applied under its rank's write lock, so a prediction never sees
//! half of an event; events of different workers never wait on each other (the outer map is
//! write-locked only to add or drop a rank); a request is hashed once per distinct hash setting.
//! Must not: decode wire bytes or talk to sockets.

use crate::counters::{Counter, Counters};
use crate::event::{Event, WorkerId};
use crate::hash::{self, BlockExtras, BlockHasher, HashAlgo};
use crate::layout::Params;
use crate::rank::{HashMode, RankState, RankStats, WorkerConfig};
use crate::rules::{self, GroupEvidence, Lookup};
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

/// One (worker, rank)'s predicted reuse for a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Prediction {
    pub worker: WorkerId,
    pub dp_rank: u32,
    /// Predicted `num_cached_tokens`.
    pub cached: u64,
    /// What a router looking only at full-attention groups would predict.
    pub group_blind: u64,
    pub groups: Vec<GroupEvidence>,
    pub params: Option<Params>,
    pub degraded: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    pub ranks: usize,
    pub holders: usize,
    pub block_copies: u64,
    pub heap_bytes: usize,
}

type RankKey = (WorkerId, u32);

/// The hybrid cache index.
#[derive(Default)]
pub struct Index {
    ranks: RwLock<HashMap<RankKey, Arc<RwLock<RankState>>>>,
    configs: RwLock<HashMap<WorkerId, WorkerConfig>>,
    default_config: WorkerConfig,
    counters: Counters,
}

/// Hash chains of one request: computed lazily once per distinct setting, or given by the
/// caller (one chain for every rank).
struct Chains<'q> {
    /// The request's length and whether it skips the prefix cache.
    n_tokens: usize,
    skip: bool,
    source: Source<'q>,
    cache: HashMap<(HashMode, u32), Vec<u64>>,
}

enum Source<'q> {
    /// Hash the request's tokens.
    Tokens(&'q Query),
    /// The caller's chain, for every rank.
    Given(&'q [u64]),
}

impl<'q> Chains<'q> {
    fn new(query: &'q Query) -> Self {
        Chains {
            n_tokens: query.tokens.len(),
            skip: query.skip_prefix_cache,
            source: Source::Tokens(query),
            cache: HashMap::new(),
        }
    }

    fn given(n_tokens: usize, chain: &'q [u64]) -> Self {
        Chains {
            n_tokens,
            skip: false,
            source: Source::Given(chain),
            cache: HashMap::new(),
        }
    }

    fn get(&mut self, mode: &HashMode, h: u32) -> &[u64] {
        let query = match self.source {
            Source::Given(chain) => return chain,
            Source::Tokens(query) => query,
        };
        self.cache.entry((mode.clone(), h)).or_insert_with(|| {
            let toks = &query.tokens[..query.tokens.len().saturating_sub(1)];
            match mode {
                HashMode::Engine { algo, seed } => BlockHasher::new(*algo, seed)
                    .chain(toks, h as usize, &query.extras)
                    .iter()
                    .map(|d| hash::external(d).0)
                    .collect(),
                HashMode::ContentKey => hash::content_chain(toks, h as usize, &query.extras),
            }
        })
    }
}

impl Index {
    pub fn new() -> Index {
        Index::default()
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
        for ((w, _), rank) in self.ranks.read().iter() {
            if w == worker {
                let mut r = rank.write();
                if r.config.hash != config.hash {
                    *r = RankState::new(config.clone());
                } else {
                    r.config = config.clone();
                }
            }
        }
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
        self.ranks.write().retain(|(w, _), _| w != worker);
        self.configs.write().remove(worker);
    }

    fn rank(&self, worker: &WorkerId, dp_rank: u32) -> Arc<RwLock<RankState>> {
        let key = (worker.clone(), dp_rank);
        if let Some(r) = self.ranks.read().get(&key) {
            return r.clone();
        }
        let config = self.worker_config(worker);
        self.ranks
            .write()
            .entry(key)
            .or_insert_with(|| Arc::new(RwLock::new(RankState::new(config))))
            .clone()
    }

    /// Applies one event.
    pub fn apply(&self, ev: &Event) {
        let rank = self.rank(ev.worker(), ev.dp_rank());
        let mut r = rank.write();
        match ev {
            Event::Stored(s) => r.store(s, &self.counters),
            Event::Removed(rm) => r.remove(rm, &self.counters),
            Event::Cleared(_) => {
                self.counters.add(Counter::ClearEvents, 1);
                r.stats.clears += 1;
                r.clear();
            }
        }
    }

    /// Applies events in order.
    pub fn apply_all<'a>(&self, events: impl IntoIterator<Item = &'a Event>) {
        for ev in events {
            self.apply(ev);
        }
    }

    /// Empties one rank (the intake calls this when its stream cannot be recovered) and sets
    /// or clears its degraded mark.
    pub fn clear_rank(&self, worker: &WorkerId, dp_rank: u32) {
        self.rank(worker, dp_rank).write().clear();
    }

    pub fn set_degraded(&self, worker: &WorkerId, dp_rank: u32, degraded: bool) {
        self.rank(worker, dp_rank).write().degraded = degraded;
    }

    /// Workers and ranks known, sorted.
    pub fn ranks(&self) -> Vec<(WorkerId, u32)> {
        let mut v: Vec<_> = self.ranks.read().keys().cloned().collect();
        v.sort();
        v
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Runs `f` on one rank's state under its read lock.
    pub fn inspect<T>(
        &self,
        worker: &WorkerId,
        dp_rank: u32,
        f: impl FnOnce(&RankState) -> T,
    ) -> Option<T> {
        let rank = self.ranks.read().get(&(worker.clone(), dp_rank)).cloned()?;
        let r = rank.read();
        Some(f(&r))
    }

    pub fn rank_stats(&self) -> Vec<(WorkerId, u32, RankStats)> {
        let mut out: Vec<_> = self
            .ranks
            .read()
            .iter()
            .map(|((w, d), r)| (w.clone(), *d, r.read().stats.clone()))
            .collect();
        out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        out
    }

    /// Device contents per (worker, rank) → group → hash → copies (empty groups left out).
    pub fn contents(&self) -> BTreeMap<(WorkerId, u32), BTreeMap<u32, BTreeMap<u64, u32>>> {
        self.ranks
            .read()
            .iter()
            .map(|(k, r)| (k.clone(), r.read().contents()))
            .filter(|(_, c)| !c.is_empty())
            .collect()
    }

    pub fn stats(&self) -> IndexStats {
        let ranks = self.ranks.read();
        let mut s = IndexStats {
            ranks: ranks.len(),
            ..IndexStats::default()
        };
        for r in ranks.values() {
            let r = r.read();
            s.holders += r.groups.len();
            s.block_copies += r.block_copies();
            s.heap_bytes += r.heap_bytes();
        }
        s
    }

    /// Predicts the request on every known (worker, rank), sorted by worker and rank.
    pub fn predict_all(&self, q: &Query) -> Vec<Prediction> {
        self.predict_each(&mut Chains::new(q))
    }

    /// Predicts a request of `n_tokens` tokens whose 64-bit block-hash chain is `chain`, on
    /// every known (worker, rank), without hashing anything: `chain[i]` must be the hash
    /// `predict_all` would compute for block `i` of the request's first `n_tokens − 1` tokens at
    /// each rank's hash block size (the caller vouches that every rank shares one hash block
    /// size and one hash mode). The request carries no extras and reads the prefix cache.
    /// Equal to `predict_all` for such a chain; meant for callers that hashed the request
    /// already, and for benchmarks.
    pub fn predict_all_with_chain(&self, n_tokens: usize, chain: &[u64]) -> Vec<Prediction> {
        self.predict_each(&mut Chains::given(n_tokens, chain))
    }

    fn predict_each(&self, chains: &mut Chains<'_>) -> Vec<Prediction> {
        let ranks: Vec<(RankKey, Arc<RwLock<RankState>>)> = self
            .ranks
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut out: Vec<Prediction> = ranks
            .iter()
            .map(|((w, d), r)| predict_rank(w, *d, &r.read(), chains))
            .collect();
        self.counters.add(Counter::Predictions, 1);
        out.sort_by(|a, b| (&a.worker, a.dp_rank).cmp(&(&b.worker, b.dp_rank)));
        out
    }

    /// Predicts the request on one (worker, rank); a rank never seen predicts 0.
    pub fn predict(&self, worker: &WorkerId, dp_rank: u32, q: &Query) -> Prediction {
        self.counters.add(Counter::Predictions, 1);
        let rank = self.ranks.read().get(&(worker.clone(), dp_rank)).cloned();
        let mut chains = Chains::new(q);
        match rank {
            Some(r) => predict_rank(worker, dp_rank, &r.read(), &mut chains),
            None => Prediction {
                worker: worker.clone(),
                dp_rank,
                cached: 0,
                group_blind: 0,
                groups: Vec::new(),
                params: None,
                degraded: false,
            },
        }
    }
}

fn predict_rank(
    worker: &WorkerId,
    dp_rank: u32,
    r: &RankState,
    chains: &mut Chains<'_>,
) -> Prediction {
    let params = r.params();
    let mut pred = Prediction {
        worker: worker.clone(),
        dp_rank,
        cached: 0,
        group_blind: 0,
        groups: Vec::new(),
        params: params.clone(),
        degraded: r.degraded,
    };
    let Some(p) = params else { return pred };
    let (n_tokens, skip) = (chains.n_tokens, chains.skip);
    let chain = chains.get(&r.config.hash, p.hash_block);
    let empty = crate::holder::Multiset::default();
    let specs = r.layout.lookups();
    let lookups: Vec<Lookup<'_>> = specs
        .iter()
        .map(|(spec, ids)| Lookup {
            spec,
            groups: ids.clone(),
            holders: ids
                .iter()
                .map(|g| r.groups.get(g).map_or(&empty, |s| &s.holder))
                .collect(),
        })
        .collect();
    let j = rules::joint(&lookups, chain, n_tokens, &p, r.config.lookup.chunk_size);
    pred.cached = if skip { 0 } else { j.cached };
    pred.group_blind = j.group_blind;
    pred.groups = j.groups;
    pred
}

/// The hashes `kvroute hash` prints: (index, 64-bit value, digest) of every full block.
pub fn block_hashes(
    algo: HashAlgo,
    seed: &str,
    block: usize,
    tokens: &[u32],
    extras: &BlockExtras,
) -> Vec<(usize, u64, hash::Digest)> {
    BlockHasher::new(algo, seed)
        .chain(tokens, block, extras)
        .into_iter()
        .enumerate()
        .map(|(i, d)| (i, hash::external(&d).0, d))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{CacheKind, EngineHash, Stored};
    use crate::hash::DEFAULT_SEED;

    fn store(
        worker: &str,
        group: u32,
        kind: CacheKind,
        window: Option<u32>,
        hashes: &[u64],
    ) -> Event {
        Event::Stored(Stored {
            worker: worker.into(),
            dp_rank: 0,
            medium: None,
            group: Some(group),
            kind: Some(kind),
            sliding_window: window,
            block_size: 16,
            parent: None,
            hashes: hashes.iter().map(|h| EngineHash::int(*h)).collect(),
            token_ids: Vec::new(),
            extra_keys: None,
            lora_id: None,
            lora_name: None,
        })
    }

    #[test]
    fn a_given_chain_predicts_what_hashing_the_tokens_predicts() {
        let tokens: Vec<u32> = (0..16 * 9 + 5).map(|i| i * 7 % 1000).collect();
        let chain: Vec<u64> = block_hashes(
            HashAlgo::Sha256,
            DEFAULT_SEED,
            16,
            &tokens[..tokens.len() - 1],
            &BlockExtras::default(),
        )
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
        assert_eq!(chain.len(), 9);
        let index = Index::new();
        // One full-attention worker holding a prefix, one hybrid worker with a hole in its
        // window group, one worker holding nothing of the request.
        index.apply(&store("a", 0, CacheKind::FullAttention, None, &chain[..6]));
        index.apply(&store("b", 0, CacheKind::FullAttention, None, &chain));
        let window: Vec<u64> = chain
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 7)
            .map(|(_, h)| *h)
            .collect();
        index.apply(&store("b", 1, CacheKind::SlidingWindow, Some(32), &window));
        index.apply(&store("c", 0, CacheKind::FullAttention, None, &[1, 2, 3]));
        let q = Query {
            tokens: tokens.clone(),
            ..Query::default()
        };
        let hashed = index.predict_all(&q);
        let given = index.predict_all_with_chain(tokens.len(), &chain);
        assert_eq!(given, hashed);
        let cached: Vec<u64> = given.iter().map(|p| p.cached).collect();
        assert_eq!(cached, vec![96, 112, 0]);
    }
}
