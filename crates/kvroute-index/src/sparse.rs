//! The routing prediction that visits only the ranks that can hit: one walk of the request
//! through the shared run store names every full-attention holder that holds its first block;
//! a rank whose only lookup is one shared full-attention group is answered from the walk alone,
//! others of those ranks (and every rank without a shared full-attention group, or with blocks in
//! an offload tier) are predicted as `predict_all` would.
//!
//! Owns: the roster (per shared holder id: its rank, the walk it belongs to, and whether the
//! walk is its answer), rebuilt when the index's layout generation moves.
//! Invariants: `predict_hits` equals `predict_all_detail(.., Detail::Cached)` without the
//! predictions whose `cached` and `group_blind` are both 0 (a rank with a full-attention lookup
//! that serves nothing predicts 0 and 0; property-tested in `tests/reference_props.rs`); the
//! roster is used only at the generation it was built for, under the same `ranks` and `runs`
//! read locks.
//! Must not: change any state but the roster cache.

use crate::chains::{walk_strided, Chains};
use crate::event::WorkerId;
use crate::index::{predict_rank, shared_stride, Detail, Index, Prediction, Query, RankId, Ranks};
use crate::layout::Params;
use crate::rank::HashMode;
use crate::rules::start_length;
use crate::runs::Runs;
use serde::Serialize;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One rank's predicted hit, by the rank's id (`Index::rank_key` names it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Hit {
    pub rank: RankId,
    /// Predicted `num_cached_tokens`.
    pub cached: u64,
    /// The part of `cached` an offload tier serves.
    pub tier: u64,
    /// What a router looking only at full-attention groups would predict.
    pub group_blind: u64,
    pub params: Option<Params>,
    pub degraded: bool,
}

/// What a shared holder's walk means for its rank.
#[derive(Clone, Debug)]
struct HolderInfo {
    /// Index of the rank in `Ranks::sorted` (valid at the roster's generation).
    rank: usize,
    id: RankId,
    /// Index of the walk (setting) in `Roster::walks`.
    walk: usize,
    /// The rank's only lookup is this group: its answer is the walk's, aligned.
    simple: Option<Params>,
    degraded: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Roster {
    gen: u64,
    /// (hash mode, hash block, lookahead count, stride) of every walk a prediction needs.
    walks: Vec<(HashMode, u32, u32, u32)>,
    by_holder: Vec<Option<HolderInfo>>,
    /// Ranks (sorted indexes) without a shared full-attention group: always predicted.
    always: Vec<usize>,
    /// Each worker whose layout is known, ascending, with its first such rank's lookup
    /// parameters: [`Index::params_of`] of every worker, read without a rank's lock.
    params: Vec<(WorkerId, u32, Params)>,
}

impl Roster {
    fn build(gen: u64, ranks: &Ranks, runs: &Runs) -> Roster {
        let mut roster = Roster {
            gen,
            by_holder: vec![None; runs.holder_slots()],
            ..Roster::default()
        };
        for (at, ((worker, dp_rank), rank)) in ranks.sorted.iter().enumerate() {
            let r = rank.read();
            let plan = r.plan();
            let Some(p) = plan.params else { continue };
            if roster.params.last().is_none_or(|(w, _, _)| w != worker) {
                roster.params.push((worker.clone(), *dp_rank, p));
            }
            if !r.offload.is_empty() {
                // A tier can serve a request the device holds nothing of.
                roster.always.push(at);
                continue;
            }
            // A full-attention lookup that the walk can answer (no partial entries inside a
            // block) and that serves nothing makes the rank predict 0 and 0.
            let mut skippable = false;
            for (spec, ids) in &plan.lookups {
                let Some(k) = shared_stride(spec, p.hash_block) else {
                    continue;
                };
                skippable |= k == 1 || !p.fine_grained;
                let setting = (r.config.hash.clone(), p.hash_block, p.lookahead, k);
                let walk = match roster.walks.iter().position(|w| *w == setting) {
                    Some(w) => w,
                    None => {
                        roster.walks.push(setting);
                        roster.walks.len() - 1
                    }
                };
                let simple = plan.lookups.len() == 1
                    && ids.len() == 1
                    && !p.eagle
                    && (k == 1 || !p.fine_grained);
                for g in ids {
                    let Some(id) = r.groups.get(g).and_then(|s| s.shared) else {
                        continue;
                    };
                    if let Some(slot) = roster.by_holder.get_mut(id as usize) {
                        *slot = Some(HolderInfo {
                            rank: at,
                            id: RankId(r.id),
                            walk,
                            simple: simple.then_some(p),
                            degraded: r.degraded,
                        });
                    }
                }
            }
            if !skippable {
                roster.always.push(at);
            }
        }
        roster
    }
}

impl Index {
    /// The routing prediction: every rank that predicts a hit (`cached` or `group_blind`
    /// above 0) with its id, ids ascending; ranks not listed predict 0 and 0. Only
    /// the ranks holding the request's first block (and ranks without a full-attention group)
    /// are visited.
    pub fn hits(&self, q: &Query) -> Vec<Hit> {
        self.hits_in(&mut Chains::new(q, &self.digests, self.counters()))
    }

    /// `hits` for a request whose chain the caller computed (as `predict_all_with_chain`).
    pub fn hits_with_chain(&self, n_tokens: usize, chain: &[u64]) -> Vec<Hit> {
        self.hits_in(&mut Chains::given(n_tokens, chain))
    }

    /// `hits` as predictions with their workers' names: `predict_all_detail(q,
    /// Detail::Cached)` without its zeros.
    pub fn predict_hits(&self, q: &Query) -> Vec<Prediction> {
        let hits = self.hits(q);
        let ranks = self.ranks.read();
        let mut out: Vec<Prediction> = hits
            .into_iter()
            .filter_map(|h| {
                let (worker, dp_rank) = ranks.by_id.get(&h.rank.0)?.clone();
                Some(Prediction {
                    worker,
                    dp_rank,
                    cached: h.cached,
                    tier: h.tier,
                    tier_medium: None,
                    group_blind: h.group_blind,
                    groups: Vec::new(),
                    params: h.params,
                    degraded: h.degraded,
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.worker, a.dp_rank).cmp(&(&b.worker, b.dp_rank)));
        out
    }

    /// [`Index::params_of`] of each worker of `workers`, in their order, from the roster of
    /// the current layouts (rebuilt, as for a prediction, when a layout changed): what a
    /// router asks for every candidate that hits nothing. Workers listed in ascending order
    /// (as a registry lists them) are found by walking the roster forward from the last one
    /// found (the next entry first, then a galloping search), others by a search of the whole
    /// roster; both answer exactly as `params_of` (property-tested).
    pub fn params_of_each(&self, workers: &[&WorkerId]) -> Vec<Option<(u32, Params)>> {
        let roster = {
            let ranks = self.ranks.read();
            self.current_roster(&ranks, || self.runs.read())
        };
        let known = &roster.params;
        // Where the last worker was looked for, and that worker.
        let mut from = 0;
        let mut last: Option<&str> = None;
        workers
            .iter()
            .map(|worker| {
                let w: &str = worker;
                // The worker after the last one found is the usual answer: one comparison of
                // equality (the same allocation where the registry's names are the index's).
                let same = |at: usize| {
                    known
                        .get(at)
                        .is_some_and(|(x, _, _)| Arc::ptr_eq(x, worker) || **x == *w)
                };
                // Where it is or would be, and whether that entry is known to be it.
                let (at, matched) = match last {
                    // Not ascending: search the whole roster.
                    Some(l) if w < l => (known.partition_point(|(x, _, _)| &**x < w), false),
                    Some(_) if same(from + 1) => (from + 1, true),
                    _ if same(from) => (from, true),
                    _ => (from + gallop(&known[from..], |(x, _, _)| &**x < w), false),
                };
                (from, last) = (at, Some(w));
                let (_, d, p) = known.get(at)?;
                (matched || same(at)).then_some((*d, *p))
            })
            .collect()
    }

    /// The roster of the current layouts: the cached one while no layout changed, else one
    /// built anew from `ranks` and the store `runs` gives (taken only then, and before the
    /// cache's lock, the order every caller takes them in).
    fn current_roster<R: std::ops::Deref<Target = Runs>>(
        &self,
        ranks: &Ranks,
        runs: impl FnOnce() -> R,
    ) -> Arc<Roster> {
        let gen = self.layout_gen.load(Ordering::Acquire);
        if let Some(r) = self.roster.lock().as_ref().filter(|r| r.gen == gen) {
            return r.clone();
        }
        let runs = runs();
        let mut cache = self.roster.lock();
        match &*cache {
            Some(r) if r.gen == gen => r.clone(),
            _ => {
                let r = Arc::new(Roster::build(gen, ranks, &runs));
                *cache = Some(r.clone());
                r
            }
        }
    }

    /// Hashes the request for the settings the last roster walked, before any index lock is
    /// taken: a request's hashing (tens of µs when its blocks are new) then never holds up
    /// events waiting for the store's write lock. A setting the current roster adds later is
    /// hashed under the locks as before.
    pub(crate) fn prehash(&self, chains: &mut Chains<'_>) {
        let last = self.roster.lock().clone();
        for (mode, h, lookahead, _) in last.iter().flat_map(|r| r.walks.iter()) {
            chains.slot(mode, *h, *lookahead);
        }
    }

    fn hits_in(&self, chains: &mut Chains<'_>) -> Vec<Hit> {
        self.prehash(chains);
        let ranks = self.ranks.read();
        let runs = self.runs.read();
        let roster = self.current_roster(&ranks, || &*runs);
        let (n_tokens, skip) = (chains.n_tokens, chains.skip);
        let mut visit: Vec<usize> = roster.always.clone();
        let mut touched: Vec<(u32, u32)> = Vec::with_capacity(64);
        let mut rows: Vec<Hit> = Vec::new();
        for (w, (mode, h, lookahead, k)) in roster.walks.iter().enumerate() {
            let slot = chains.slot(mode, *h, *lookahead);
            touched.clear();
            walk_strided(&runs, chains.chain_at(slot), *k, &mut touched);
            rows.reserve(touched.len());
            let visited = visit.len();
            let b = (*k as u64) * (*h as u64);
            // (alignment and lookahead, most blocks a hit may use, whether a whole block is
            // always aligned): the divisions are done once per alignment, not once per holder.
            let mut cap: Option<((u32, u32), u64, bool)> = None;
            for &(id, blocks) in &touched {
                let Some(Some(info)) = roster.by_holder.get(id as usize) else {
                    continue;
                };
                if info.walk != w || blocks == 0 {
                    continue;
                }
                match info.simple {
                    Some(p) => {
                        let a = p.align.max(1) as u64;
                        let (most, whole) = match cap {
                            Some((key, most, whole)) if key == (p.align, p.lookahead) => {
                                (most, whole)
                            }
                            _ => {
                                let most = start_length(n_tokens, &p) / b;
                                let whole = b.is_multiple_of(a);
                                cap = Some(((p.align, p.lookahead), most, whole));
                                (most, whole)
                            }
                        };
                        let raw = (blocks as u64).min(most) * b;
                        let hit = if whole { raw } else { raw / a * a };
                        if hit > 0 {
                            let cached = if skip { 0 } else { hit };
                            rows.push(Hit {
                                rank: info.id,
                                cached,
                                tier: 0,
                                group_blind: hit,
                                params: Some(p),
                                degraded: info.degraded,
                            });
                        }
                    }
                    None => visit.push(info.rank),
                }
            }
            if visit.len() > visited {
                // The ranks predicted below read this walk instead of walking again.
                let mut prefix = vec![0u32; runs.holder_slots()];
                for &(id, blocks) in &touched {
                    prefix[id as usize] = blocks;
                }
                chains.seed_walk(slot, *k, prefix);
            }
        }
        visit.sort_unstable();
        visit.dedup();
        for at in visit {
            let ((worker, dp_rank), rank) = &ranks.sorted[at];
            let r = rank.read();
            let pred = predict_rank(worker, *dp_rank, &r, &runs, chains, Detail::Cached);
            if pred.cached > 0 || pred.group_blind > 0 {
                rows.push(Hit {
                    rank: RankId(r.id),
                    cached: pred.cached,
                    tier: pred.tier,
                    group_blind: pred.group_blind,
                    params: pred.params,
                    degraded: pred.degraded,
                });
            }
        }
        rows.sort_unstable_by_key(|h| h.rank);
        drop(runs);
        drop(ranks);
        self.counters()
            .add(crate::counters::Counter::Predictions, 1);
        rows
    }
}

/// The first position of `xs` where `before` no longer holds (`before` must hold for a prefix
/// of `xs` only, as for `partition_point`), found by doubling steps from the start, then a
/// binary search within the last step: O(log d) for an answer `d` positions in.
fn gallop<T>(xs: &[T], before: impl Fn(&T) -> bool) -> usize {
    let mut step = 1;
    let mut lo = 0;
    while lo + step <= xs.len() && before(&xs[lo + step - 1]) {
        lo += step;
        step *= 2;
    }
    let hi = (lo + step).min(xs.len());
    lo + xs[lo..hi].partition_point(before)
}

#[cfg(test)]
mod tests {
    use crate::event::{CacheKind, Event, Stored};
    use crate::{Index, Query};

    fn store(worker: &str, group: u32, kind: CacheKind, hashes: &[u64]) -> Event {
        Event::Stored(Stored::device(worker, group, kind, None, 16, hashes))
    }

    #[test]
    fn hits_name_only_the_ranks_that_hold_the_first_block_and_ids_outlive_nothing() {
        let index = Index::new();
        let chain = [11u64, 12, 13, 14];
        index.apply(&store("a", 0, CacheKind::FullAttention, &chain[..3]));
        index.apply(&store("b", 0, CacheKind::FullAttention, &chain[1..]));
        index.apply(&store("c", 0, CacheKind::FullAttention, &chain[..1]));
        // 4 blocks of 16 tokens plus one: at most 64 tokens can be served.
        let hits = index.hits_with_chain(65, &chain);
        let named: Vec<(String, u64)> = hits
            .iter()
            .map(|h| {
                let (w, _) = index.rank_key(h.rank).unwrap();
                (w.to_string(), h.cached)
            })
            .collect();
        assert_eq!(named, vec![("a".into(), 48), ("c".into(), 16)]);
        let a = index.rank_id(&"a".into(), 0).unwrap();
        assert_eq!(hits[0].rank, a);
        // A worker that hits nothing still has its lookup parameters; an unknown one has none.
        let (rank, params) = index.params_of(&"b".into()).unwrap();
        assert_eq!((rank, params.align, params.hash_block), (0, 16, 16));
        assert_eq!(index.params_of(&"zzz".into()), None);
        index.remove_worker(&"a".into());
        assert_eq!(index.rank_key(a), None);
        index.apply(&store("a", 0, CacheKind::FullAttention, &chain[..3]));
        assert_ne!(
            index.rank_id(&"a".into(), 0),
            Some(a),
            "ids are never reused"
        );
        assert_eq!(index.hits_with_chain(65, &chain).len(), 2);
    }

    #[test]
    fn a_gallop_finds_the_partition_point() {
        let xs: Vec<u32> = (0..100).map(|x| x * 2).collect();
        for v in 0..205 {
            assert_eq!(
                super::gallop(&xs, |x| *x < v),
                xs.partition_point(|x| *x < v)
            );
        }
        assert_eq!(super::gallop(&[] as &[u32], |x| *x < 3), 0);
    }

    #[test]
    fn params_of_each_sees_a_worker_added_after_it_was_last_asked() {
        let index = Index::new();
        index.apply(&store("a", 0, CacheKind::FullAttention, &[1]));
        let (a, b): (crate::WorkerId, crate::WorkerId) = ("a".into(), "b".into());
        assert_eq!(
            index
                .params_of_each(&[&a, &b])
                .iter()
                .map(Option::is_some)
                .collect::<Vec<_>>(),
            [true, false]
        );
        index.apply(&store("b", 0, CacheKind::FullAttention, &[2]));
        assert_eq!(
            index.params_of_each(&[&a, &b]),
            vec![index.params_of(&a), index.params_of(&b)]
        );
        assert!(index.params_of(&b).is_some());
    }

    #[test]
    fn params_of_each_answers_a_reconfigured_worker_s_new_parameters() {
        let index = Index::new();
        index.apply(&store("a", 0, CacheKind::FullAttention, &[1]));
        let a: crate::WorkerId = "a".into();
        let before = index.params_of_each(&[&a]);
        let mut config = index.worker_config(&a);
        config.lookup.eagle = !config.lookup.eagle;
        index.configure_worker(&a, config);
        let after = index.params_of_each(&[&a]);
        assert_eq!(after, vec![index.params_of(&a)]);
        assert_ne!(after, before, "the drop under EAGLE is a lookup parameter");
    }

    proptest::proptest! {
        /// Against the literal model: `params_of` asked for each worker alone.
        #[test]
        fn params_of_each_answers_as_params_of_each_worker_alone(
            known in proptest::collection::btree_set(0u32..40, 0..20),
            asked in proptest::collection::vec(0u32..45, 0..30),
            ascending in proptest::bool::ANY,
            shared in proptest::bool::ANY,
        ) {
            let index = Index::new();
            for w in &known {
                index.apply(&store(&format!("w{w:02}"), 0, CacheKind::FullAttention, &[u64::from(*w) + 1]));
            }
            // Asked by the index's own names (one allocation, as a registry's usually are) or
            // by equal names allocated apart.
            let own = index.ranks();
            let mut names: Vec<crate::WorkerId> = asked
                .iter()
                .map(|w| {
                    let name = format!("w{w:02}");
                    match own.iter().find(|(x, _)| shared && **x == *name) {
                        Some((x, _)) => x.clone(),
                        None => name.as_str().into(),
                    }
                })
                .collect();
            if ascending {
                names.sort();
            }
            let refs: Vec<&crate::WorkerId> = names.iter().collect();
            let want: Vec<_> = names.iter().map(|w| index.params_of(w)).collect();
            proptest::prop_assert_eq!(index.params_of_each(&refs), want);
        }
    }

    /// `predict_hits` is the dense prediction without its zeros, whatever the settings.
    fn assert_hits_match(index: &Index, q: &Query) {
        let dense: Vec<_> = index
            .predict_all_detail(q, crate::Detail::Cached)
            .into_iter()
            .filter(|p| p.cached > 0 || p.group_blind > 0)
            .collect();
        assert_eq!(index.predict_hits(q), dense);
    }

    #[test]
    fn hits_follow_configuration_degraded_marks_clears_and_mixed_hash_settings() {
        use crate::index::block_hashes;
        use crate::{BlockExtras, HashAlgo, HashMode, LookupConfig, WorkerConfig};
        let tokens: Vec<u32> = (0..16 * 8 + 1).map(|i| i * 13 % 997).collect();
        let chain = |algo, block: usize| -> Vec<u64> {
            block_hashes(
                algo,
                crate::hash::DEFAULT_SEED,
                block,
                &tokens[..tokens.len() - 1],
                &BlockExtras::default(),
            )
            .into_iter()
            .map(|(_, v, _)| v)
            .collect()
        };
        let index = Index::new();
        let q = Query {
            tokens: tokens.clone(),
            ..Query::default()
        };
        // a: sha256 at 16; b: sha256_cbor at 16; c: sha256 hashed at 16 with 32-token blocks.
        index.configure_worker(
            &"b".into(),
            WorkerConfig {
                hash: HashMode::Engine {
                    algo: HashAlgo::Sha256Cbor,
                    seed: crate::hash::DEFAULT_SEED.into(),
                },
                ..WorkerConfig::default()
            },
        );
        index.configure_worker(
            &"c".into(),
            WorkerConfig {
                lookup: LookupConfig {
                    hash_block_size: Some(16),
                    ..LookupConfig::default()
                },
                ..WorkerConfig::default()
            },
        );
        let sha16 = chain(HashAlgo::Sha256, 16);
        let cbor16 = chain(HashAlgo::Sha256Cbor, 16);
        index.apply(&store("a", 0, CacheKind::FullAttention, &sha16[..5]));
        index.apply(&store("b", 0, CacheKind::FullAttention, &cbor16[..3]));
        let every_other: Vec<u64> = sha16.iter().skip(1).step_by(2).copied().collect();
        index.apply(&Event::Stored(Stored::device(
            "c",
            0,
            CacheKind::FullAttention,
            None,
            32,
            &every_other[..2],
        )));
        assert_hits_match(&index, &q);
        let cached: Vec<u64> = index.predict_hits(&q).iter().map(|p| p.cached).collect();
        assert_eq!(cached, vec![80, 48, 64]);
        index.set_degraded(&"a".into(), 0, true);
        assert_hits_match(&index, &q);
        assert!(index.predict_hits(&q)[0].degraded);
        index.clear_rank(&"b".into(), 0);
        assert_hits_match(&index, &q);
        // A hash-mode change restarts the worker's ranks empty.
        index.configure_worker(
            &"a".into(),
            WorkerConfig {
                hash: HashMode::ContentKey,
                ..WorkerConfig::default()
            },
        );
        assert_hits_match(&index, &q);
        let workers: Vec<String> = index
            .predict_hits(&q)
            .iter()
            .map(|p| p.worker.to_string())
            .collect();
        assert_eq!(workers, vec!["c".to_string()]);
    }

    #[test]
    fn an_empty_request_hits_nothing_and_a_hit_is_bounded_by_the_blocks_held() {
        let index = Index::new();
        let chain = [21u64, 22, 23];
        index.apply(&store("a", 0, CacheKind::FullAttention, &chain));
        let q = Query {
            tokens: Vec::new(),
            skip_prefix_cache: true,
            ..Query::default()
        };
        // An empty request has no chain: nobody hits.
        assert!(index.predict_hits(&q).is_empty());
        let given = index.hits_with_chain(100, &chain);
        assert_eq!((given[0].cached, given[0].group_blind), (48, 48));
    }

    /// A request repeating a prefix hashes only its new blocks and predicts what hashing all
    /// of them would, for workers of different seeds, with and without a salt; an index without
    /// the cache hashes everything every time.
    #[test]
    fn a_repeated_prefix_is_hashed_once_and_predicts_the_same() {
        use crate::counters::Counter;
        use crate::hash::{external, BlockExtras, BlockHasher, HashAlgo, DEFAULT_SEED};
        use crate::rank::HashMode;
        use crate::WorkerConfig;
        let tokens: Vec<u32> = (0..192).collect();
        let chain = |seed: &str, salt: Option<&str>| -> Vec<u64> {
            let extras = BlockExtras {
                cache_salt: salt.map(str::to_string),
                lora: None,
            };
            BlockHasher::new(HashAlgo::Sha256, seed)
                .chain(&tokens, 16, &extras)
                .iter()
                .map(|d| external(d).0)
                .collect()
        };
        for (cache, warm) in [(crate::hash::cache::DEFAULT_MAX_TOKENS, true), (0, false)] {
            let index = Index::with_digest_cache(cache);
            index.configure_worker(
                &"b".into(),
                WorkerConfig {
                    hash: HashMode::Engine {
                        algo: HashAlgo::Sha256,
                        seed: "42".into(),
                    },
                    ..WorkerConfig::default()
                },
            );
            // Both hold all twelve blocks of the longer request, each under its own seed.
            index.apply(&store(
                "a",
                0,
                CacheKind::FullAttention,
                &chain(DEFAULT_SEED, None),
            ));
            index.apply(&store("b", 0, CacheKind::FullAttention, &chain("42", None)));
            index.apply(&store(
                "c",
                0,
                CacheKind::FullAttention,
                &chain(DEFAULT_SEED, Some("t")),
            ));
            let short = |salt: Option<&str>| Query {
                tokens: tokens[..160].to_vec(),
                extras: BlockExtras {
                    cache_salt: salt.map(str::to_string),
                    lora: None,
                },
                ..Query::default()
            };
            let cached = |q: &Query| -> Vec<(String, u64)> {
                index
                    .predict_hits(q)
                    .iter()
                    .map(|p| (p.worker.to_string(), p.cached))
                    .collect()
            };
            let (a, b) = ("a".to_string(), "b".to_string());
            // At most n − 1 = 159 tokens: nine blocks; then eleven of the 192-token request.
            assert_eq!(
                cached(&short(None)),
                vec![(a.clone(), 144), (b.clone(), 144)]
            );
            let mut long = short(None);
            long.tokens = tokens.clone();
            assert_eq!(cached(&long), vec![(a, 176), (b, 176)]);
            assert_eq!(cached(&short(Some("t"))), vec![("c".to_string(), 144)]);
            let mut salted = short(Some("t"));
            salted.tokens = tokens.clone();
            assert_eq!(cached(&salted), vec![("c".to_string(), 176)]);
            // Each request is hashed under both seeds: 10 + 12 blocks unsalted, 10 + 12 salted.
            let c = index.counters();
            let (hits, hashed) = (
                c.get(Counter::DigestCacheHits),
                c.get(Counter::BlocksHashed),
            );
            assert_eq!(hits + hashed, 2 * 44, "cache of {cache} tokens");
            if warm {
                // The longer requests found their first ten blocks (salted: all but the first,
                // which carries the salt).
                assert_eq!((hits, hashed), (2 * 10 + 2 * 9, 88 - 38));
            } else {
                assert_eq!(hits, 0);
            }
        }
    }
}
