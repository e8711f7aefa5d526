//! Property tests: on random event streams the fast index equals the literal reference model,
//! in content and in every prediction, under vLLM 0.32's rules and under 0.33's (workers with
//! 1 and 3 lookahead tokens beside 0.32 workers); and an index loaded from the fast index's
//! exported rank images (a warm start) agrees with the reference too.

mod common;
use common::lookahead_chain;
use kvroute_index::event::{CacheKind, Cleared, EngineHash, Event, Removed, Stored};
use kvroute_index::reference::Reference;
use kvroute_index::tier::OffloadConnector;
use kvroute_index::{Detail, Engine, Index, LookupConfig, Query, WorkerConfig};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const H: u32 = 4;

#[derive(Clone, Debug)]
struct Group {
    kind: &'static str,
    block: u32,
    window: Option<u32>,
}

fn random_layout(rng: &mut StdRng) -> Vec<Group> {
    let n = rng.gen_range(1..=4);
    let mut groups: Vec<Group> = (0..n)
        .map(|_| {
            let kind = [
                "full_attention",
                "sliding_window",
                "mamba",
                "chunked_local_attention",
                "mla_attention",
            ][rng.gen_range(0..5)];
            let window = (kind == "sliding_window").then(|| rng.gen_range(2..=24));
            Group {
                kind,
                block: [H, 2 * H, 2 * H][rng.gen_range(0..3)],
                window,
            }
        })
        .collect();
    if groups.iter().any(|g| g.kind == "chunked_local_attention") {
        let b = groups[0].block;
        for g in &mut groups {
            g.block = b;
        }
    }
    one_mamba_block(&mut groups);
    groups
}

/// Gives every Mamba group the first one's block size: vLLM gives every Mamba group of a model
/// one block size (its offloading connector asserts that they agree,
/// `resolve_mamba_align_size`), so a layout with two would be no engine's.
fn one_mamba_block(groups: &mut [Group]) {
    if let Some(b) = groups.iter().find(|g| g.kind == "mamba").map(|g| g.block) {
        for g in groups.iter_mut().filter(|g| g.kind == "mamba") {
            g.block = b;
        }
    }
}

/// A universe of prompts sharing prefixes at many lengths.
fn universe(rng: &mut StdRng) -> Vec<Vec<u32>> {
    let stems: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..72).map(|i| s * 1000 + i).collect())
        .collect();
    (0..10)
        .map(|_| {
            let stem = &stems[rng.gen_range(0..stems.len())];
            let cut = rng.gen_range(0..=stem.len());
            let mut p = stem[..cut].to_vec();
            let extra = rng.gen_range(0..40);
            p.extend((0..extra).map(|_| rng.gen_range(5000..5010)));
            p
        })
        .collect()
}

fn stored(worker: &str, rank: u32, group: u32, g: &Group, block: u32, hashes: Vec<u64>) -> Event {
    Event::Stored(Stored {
        worker: worker.into(),
        dp_rank: rank,
        medium: if block == 0 {
            Some("CPU".into())
        } else {
            Some("GPU".into())
        },
        group: Some(group),
        kind: Some(CacheKind::parse(g.kind)),
        sliding_window: g.window,
        block_size: block.max(g.block),
        parent: None,
        hashes: hashes.into_iter().map(EngineHash::int).collect(),
        token_ids: Vec::new(),
        extra_keys: None,
        lora_id: None,
        lora_name: None,
        lookahead_token_ids: None,
    })
}

/// Returns (predictions compared, non-zero ones, ones where group-blind differs).
/// The sparse routing prediction is the dense one without its zeros, in the same order.
fn assert_hits_are_the_nonzero_predictions(fast: &Index, q: &Query, at: &str) {
    let dense: Vec<_> = fast
        .predict_all_detail(q, Detail::Cached)
        .into_iter()
        .filter(|p| p.cached > 0 || p.group_blind > 0)
        .collect();
    assert_eq!(fast.predict_hits(q), dense, "{at}: predict_hits");
}

/// vLLM 0.32 on every worker.
const V032: [(Engine, u32); 3] = [(Engine::Vllm032, 0); 3];
/// A 0.32 worker and 0.33 workers with 1 and 3 lookahead tokens.
const V033: [(Engine, u32); 3] = [
    (Engine::Vllm032, 0),
    (Engine::Vllm033, 1),
    (Engine::Vllm033, 3),
];

/// What a run compared.
#[derive(Default)]
struct Tally {
    compared: usize,
    /// Predictions above 0.
    hits: usize,
    /// Predictions that differ from the group-blind one.
    blind_wrong: usize,
    /// Predictions above 0 on workers with lookahead hashes.
    lookahead_hits: usize,
    /// Final predictions an offload tier added to.
    tier_hits: usize,
}

impl Tally {
    fn count(
        &mut self,
        (cached, blind): (u64, u64),
        worker: &str,
        workers: &[&str],
        lookahead_of: impl Fn(usize) -> usize,
    ) {
        self.compared += 1;
        self.hits += usize::from(cached > 0);
        self.blind_wrong += usize::from(cached != blind);
        let at = workers.iter().position(|w| *w == worker);
        if at.is_some_and(|at| lookahead_of(at) > 0) {
            self.lookahead_hits += usize::from(cached > 0);
        }
    }
}

/// `engines[w]`: worker `w`'s engine and lookahead count; its stores hold the prompts' chains
/// hashed as that engine hashes them.
fn run_case(seed: u64, steps: usize, eagle: bool, engines: [(Engine, u32); 3]) -> Tally {
    run_case_with(
        seed,
        steps,
        eagle,
        engines,
        OffloadConnector::Offloading,
        false,
    )
}

/// `run_case` with the offload tiers kept by `connector`; `unflagged`: under EAGLE, the engine
/// flags no drafter group (the `OffloadingConnector` pops nothing).
fn run_case_with(
    seed: u64,
    steps: usize,
    eagle: bool,
    engines: [(Engine, u32); 3],
    connector: OffloadConnector,
    unflagged: bool,
) -> Tally {
    let mut tally = Tally::default();
    let mut rng = StdRng::seed_from_u64(seed);
    let config = WorkerConfig {
        lookup: LookupConfig {
            hash_block_size: Some(H),
            chunk_size: Some(4 * H),
            eagle,
            offload_chunk_blocks: None,
            offload_connector: connector,
            drafter_groups_unflagged: unflagged,
        },
        verify_hashes: false,
        ..WorkerConfig::default()
    };
    let fast = Index::with_default(config.clone());
    let mut reference = Reference::with_default(config.clone());
    let configure = |fast: &Index, reference: &mut Reference, w: &str, at: usize| {
        let (engine, lookahead) = engines[at];
        let cfg = WorkerConfig {
            engine,
            hash_lookahead_tokens: lookahead,
            ..config.clone()
        };
        fast.configure_worker(&w.into(), cfg.clone());
        reference.configure_worker(&w.into(), cfg);
    };
    let prompts = universe(&mut rng);
    let lookahead_of = |at: usize| match engines[at] {
        (Engine::Vllm033, l) => l as usize,
        _ => 0,
    };
    // Per worker: every prompt's chain as the worker's engine hashes it.
    let chains_of: Vec<Vec<Vec<u64>>> = (0..engines.len())
        .map(|at| {
            prompts
                .iter()
                .map(|p| lookahead_chain(p, H as usize, lookahead_of(at)))
                .collect()
        })
        .collect();
    let workers = ["w0", "w1", "w2"];
    for (at, w) in workers.iter().enumerate() {
        configure(&fast, &mut reference, w, at);
    }
    let mut layouts: std::collections::HashMap<(usize, u32), Vec<Group>> = Default::default();
    for step in 0..steps {
        let w = rng.gen_range(0..workers.len());
        let rank = rng.gen_range(0..2u32);
        let layout = layouts
            .entry((w, rank))
            .or_insert_with(|| random_layout(&mut rng))
            .clone();
        let op = rng.gen_range(0..100);
        let chains = &chains_of[w];
        let ev = if op < 55 {
            let gi = rng.gen_range(0..layout.len());
            let g = &layout[gi];
            let c = &chains[rng.gen_range(0..chains.len())];
            let k = (g.block / H) as usize;
            let nblocks = c.len() / k;
            let mut hashes = Vec::new();
            let mut block = g.block;
            match rng.gen_range(0..4) {
                0 if nblocks > 0 => {
                    let a = rng.gen_range(0..nblocks);
                    let b = rng.gen_range(a..=nblocks);
                    hashes.extend((a..b).map(|i| c[(i + 1) * k - 1]));
                }
                1 => hashes.extend(
                    (0..nblocks)
                        .filter(|_| rng.gen_bool(0.4))
                        .map(|i| c[(i + 1) * k - 1]),
                ),
                2 if !c.is_empty() => {
                    // A partial entry (or an off-boundary state) at the hash block size.
                    block = H;
                    hashes.push(c[rng.gen_range(0..c.len())]);
                }
                _ => {
                    // An offload tier (the connector's chunk keys, one block a chunk), most
                    // often from the chain's start, sometimes with a gap.
                    block = 0;
                    let a = rng.gen_range(0..=nblocks.min(2));
                    let b = rng.gen_range(a..=nblocks);
                    hashes.extend(
                        (a..b)
                            .filter(|_| rng.gen_bool(0.9))
                            .map(|i| c[(i + 1) * k - 1]),
                    );
                }
            }
            stored(workers[w], rank, gi as u32, g, block, hashes)
        } else if op < 80 {
            let gi = rng.gen_range(0..layout.len() + 1) as u32;
            let held: Vec<u64> = reference
                .contents()
                .get(&(workers[w].into(), rank))
                .and_then(|m| m.get(&gi))
                .map(|m| m.keys().copied().collect())
                .unwrap_or_default();
            let mut hashes: Vec<u64> = held.iter().filter(|_| rng.gen_bool(0.5)).copied().collect();
            if rng.gen_bool(0.2) {
                hashes.push(rng.gen());
            }
            // A fifth of the removals leave the offload tier (what it holds is its own).
            let medium = rng.gen_bool(0.2).then(|| "CPU".to_string());
            if medium.is_some() {
                hashes = chains[rng.gen_range(0..chains.len())]
                    .iter()
                    .filter(|_| rng.gen_bool(0.3))
                    .copied()
                    .collect();
            }
            Event::Removed(Removed {
                worker: workers[w].into(),
                dp_rank: rank,
                medium,
                group: Some(gi),
                hashes: hashes.into_iter().map(EngineHash::int).collect(),
            })
        } else if op < 86 {
            Event::Cleared(Cleared {
                worker: workers[w].into(),
                dp_rank: rank,
            })
        } else if op < 89 {
            fast.remove_worker(&workers[w].into());
            reference.remove_worker(&workers[w].into());
            layouts.retain(|(lw, _), _| *lw != w);
            // Removing a worker drops its configuration too: it comes back configured.
            configure(&fast, &mut reference, workers[w], w);
            continue;
        } else if op < 91 {
            // A layout change: group 0 comes back as another kind.
            let mut g = layout[0].clone();
            g.kind = if g.kind == "mamba" {
                "full_attention"
            } else {
                "mamba"
            };
            g.window = None;
            let mut new_layout = random_layout(&mut rng);
            new_layout[0] = g.clone();
            one_mamba_block(&mut new_layout);
            layouts.insert((w, rank), new_layout);
            let c = &chains[rng.gen_range(0..chains.len())];
            stored(
                workers[w],
                rank,
                0,
                &g,
                g.block,
                c.iter().take(2).copied().collect(),
            )
        } else {
            let p = &prompts[rng.gen_range(0..prompts.len())];
            let q = Query {
                tokens: p.clone(),
                skip_prefix_cache: rng.gen_bool(0.05),
                ..Query::default()
            };
            for (wk, rk) in fast.ranks() {
                let got = fast.predict(&wk, rk, &q);
                let want = reference.predict(&wk, rk, &q);
                let lean = fast.predict_detail(&wk, rk, &q, Detail::Cached);
                assert_eq!(
                    (lean.cached, lean.group_blind),
                    want,
                    "seed {seed} step {step}: {wk}/{rk} without evidence"
                );
                assert_eq!(
                    (got.cached, got.group_blind),
                    want,
                    "seed {seed} step {step}: {wk}/{rk} layout {:?} prompt len {}",
                    fast.inspect(&wk, rk, |r| r.layout.clone()),
                    p.len()
                );
                tally.count(want, &wk, &workers, lookahead_of);
            }
            assert_hits_are_the_nonzero_predictions(&fast, &q, &format!("seed {seed} step {step}"));
            continue;
        };
        fast.apply(&ev);
        reference.apply(&ev);
    }
    assert_eq!(
        fast.contents(),
        reference.contents(),
        "seed {seed}: contents differ"
    );
    // A warm start: every rank exported and loaded into a fresh index predicts the same.
    let loaded = Index::with_default(config.clone());
    for (at, w) in workers.iter().enumerate() {
        let (engine, lookahead) = engines[at];
        let cfg = WorkerConfig {
            engine,
            hash_lookahead_tokens: lookahead,
            ..config.clone()
        };
        loaded.configure_worker(&(*w).into(), cfg);
    }
    for (wk, rk) in fast.ranks() {
        let image = fast.export_rank(&wk, rk).expect("a known rank exports");
        loaded
            .import_rank(&wk, rk, &image)
            .expect("an exported image loads");
        assert_eq!(
            loaded.inspect(&wk, rk, |r| (r.layout.clone(), r.offload_blocks())),
            fast.inspect(&wk, rk, |r| (r.layout.clone(), r.offload_blocks())),
            "seed {seed}: {wk}/{rk} layout and tiers after loading"
        );
    }
    assert_eq!(
        loaded.contents(),
        reference.contents(),
        "seed {seed}: loaded contents differ"
    );
    for p in &prompts {
        let q = Query {
            tokens: p.clone(),
            ..Query::default()
        };
        for got in loaded.predict_all_detail(&q, Detail::Cached) {
            let want = reference.predict(&got.worker, got.dp_rank, &q);
            assert_eq!(
                (got.cached, got.group_blind),
                want,
                "seed {seed}: loaded {}/{}",
                got.worker,
                got.dp_rank
            );
        }
        assert_hits_are_the_nonzero_predictions(&loaded, &q, &format!("seed {seed}: loaded"));
    }
    for p in &prompts {
        let q = Query {
            tokens: p.clone(),
            ..Query::default()
        };
        assert_hits_are_the_nonzero_predictions(&fast, &q, &format!("seed {seed}: final"));
        let lean = fast.predict_all_detail(&q, Detail::Cached);
        let full = fast.predict_all(&q);
        assert_eq!(lean.len(), full.len());
        for (l, f) in lean.iter().zip(&full) {
            assert_eq!(
                (&l.worker, l.dp_rank, l.cached, l.group_blind),
                (&f.worker, f.dp_rank, f.cached, f.group_blind),
                "seed {seed}: final, without evidence"
            );
        }
        for got in full {
            let want = reference.predict(&got.worker, got.dp_rank, &q);
            assert_eq!(
                (got.cached, got.group_blind),
                want,
                "seed {seed}: final {}/{}",
                got.worker,
                got.dp_rank
            );
            tally.count(want, &got.worker, &workers, lookahead_of);
            tally.tier_hits += usize::from(got.tier > 0);
        }
    }
    tally
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn the_fast_index_agrees_with_the_reference_on_random_event_streams(seed in any::<u64>()) {
        let _ = run_case(seed, 300, false, V032);
    }
}

#[test]
fn a_long_stream_keeps_the_fast_index_and_the_reference_equal() {
    let Tally {
        compared,
        hits,
        blind_wrong,
        ..
    } = run_case(0x5eed, 5_000, false, V032);
    // The stream must exercise the rules, not just agree on zeros.
    assert!(compared > 1_000, "{compared}");
    assert!(
        hits * 10 > compared,
        "only {hits} of {compared} predictions hit"
    );
    assert!(
        blind_wrong * 20 > compared,
        "only {blind_wrong} of {compared} differ from group-blind"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn with_eagle_the_fast_index_agrees_with_the_reference_on_random_event_streams(seed in any::<u64>()) {
        let _ = run_case(seed, 300, true, V032);
    }
}

#[test]
fn a_long_eagle_stream_keeps_the_fast_index_and_the_reference_equal() {
    let Tally { compared, hits, .. } = run_case(0xea61e, 5_000, true, V032);
    assert!(compared > 1_000, "{compared}");
    assert!(
        hits * 20 > compared,
        "only {hits} of {compared} predictions hit"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn with_vllm_0_33_rules_the_fast_index_agrees_with_the_reference_on_random_event_streams(
        seed in any::<u64>(),
        eagle in any::<bool>(),
    ) {
        let _ = run_case(seed, 300, eagle, V033);
    }
}

#[test]
fn a_long_vllm_0_33_stream_keeps_the_fast_index_and_the_reference_equal() {
    for eagle in [false, true] {
        let t = run_case(0x0033, 5_000, eagle, V033);
        assert!(t.compared > 1_000, "{}", t.compared);
        assert!(
            t.hits * 20 > t.compared,
            "eagle {eagle}: only {} of {} predictions hit",
            t.hits,
            t.compared
        );
        // The lookahead workers hit too (their stores hold lookahead chains).
        assert!(
            t.lookahead_hits * 40 > t.compared,
            "eagle {eagle}: only {} of {} predictions hit on lookahead workers",
            t.lookahead_hits,
            t.compared
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn with_a_simple_cpu_tier_the_fast_index_agrees_with_the_reference_on_random_event_streams(
        seed in any::<u64>(),
        v033 in any::<bool>(),
        eagle in any::<bool>(),
    ) {
        let engines = if v033 { V033 } else { V032 };
        let _ = run_case_with(seed, 300, eagle, engines, OffloadConnector::SimpleCpu, false);
    }
}

#[test]
fn a_long_simple_cpu_stream_keeps_the_fast_index_and_the_reference_equal_and_hits_the_tier() {
    for (engines, eagle) in [(V032, false), (V033, false), (V032, true)] {
        let t = run_case_with(
            0x51c9,
            5_000,
            eagle,
            engines,
            OffloadConnector::SimpleCpu,
            false,
        );
        assert!(t.compared > 1_000, "{}", t.compared);
        assert!(
            t.hits * 20 > t.compared,
            "only {} of {} hit",
            t.hits,
            t.compared
        );
        assert!(t.tier_hits > 0, "no prediction was served from the tier");
    }
}

#[test]
fn with_eagle_and_no_drafter_group_flagged_a_cpu_tier_is_predicted_and_agrees() {
    let t = run_case_with(
        0xea63,
        5_000,
        true,
        V032,
        OffloadConnector::Offloading,
        true,
    );
    assert!(t.compared > 1_000, "{}", t.compared);
    assert!(t.tier_hits > 0, "no prediction was served from the tier");
}
