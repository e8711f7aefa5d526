//! The simulator's hit equals kvroute-index's prediction from the simulator's own events.
//!
//! Random workloads (conversations, shared prefixes, branches, repeats, salts, LoRA adapters,
//! concurrency, pools small enough to evict and preempt) run on every preset. Each step's events are
//! applied to an `Index` in order; at each prefix-cache lookup the index has seen exactly the
//! events emitted before it, and its prediction must equal the hit the simulator used. The
//! index's live hash check must never find a store whose hash it computes differently.
//!
//! The same holds for every engine generation and speculative setting the simulator runs:
//! vLLM 0.32 with and without EAGLE (the drop), vLLM 0.33 without speculation, with EAGLE
//! (lookahead hashes, `L = 1`), with multi-layer MTP (`L = 3`) and with lookahead hashes
//! disabled (0.33's fallback to the drop); the index is configured as a gateway would
//! configure that worker. With a CPU tier beside the pool (vLLM's `OffloadingConnector`), the
//! index, fed the tier's events too, predicts the device hit and the tier's part of every
//! lookup.

use kvroute_index::hash::{BlockExtras, HashAlgo, DEFAULT_SEED};
use kvroute_index::tier::OffloadConnector;
use kvroute_index::WorkerConfig;
use kvroute_index::{Engine as Generation, HashMode, Index, LookupConfig, Query, Speculative};
use kvroute_sim::{Engine, EngineConfig, GroupKind, Lora, NewRequest, PRESETS};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

struct Live {
    tokens: Vec<u32>,
    salt: Option<String>,
    lora: Option<Lora>,
}

fn fresh(rng: &mut StdRng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n.max(1)).map(|_| rng.gen_range(0..vocab)).collect()
}

/// An engine generation with its speculative setting.
#[derive(Clone, Debug)]
struct Mode {
    engine: Generation,
    speculative: Option<Speculative>,
    /// A CPU tier beside the device pool, kept by this connector.
    cpu_tier: Option<OffloadConnector>,
}

fn spec(method: &str, k: u32, layers: Option<u32>, no_lookahead: bool) -> Option<Speculative> {
    Some(Speculative {
        method: method.into(),
        num_speculative_tokens: k,
        num_nextn_predict_layers: layers,
        disable_lookahead_block_hashes: no_lookahead,
        disable_eagle_block_drop: false,
    })
}

/// Every mode checked: 0.32 and 0.33, without speculation, with EAGLE, with multi-layer MTP,
/// and 0.33 with its lookahead hashes disabled.
fn modes() -> Vec<Mode> {
    let m = |engine, speculative| Mode {
        engine,
        speculative,
        cpu_tier: None,
    };
    let tiered = |engine, connector| Mode {
        engine,
        speculative: None,
        cpu_tier: Some(connector),
    };
    vec![
        m(Generation::Vllm032, None),
        tiered(Generation::Vllm032, OffloadConnector::Offloading),
        tiered(Generation::Vllm033, OffloadConnector::Offloading),
        m(Generation::Vllm032, spec("eagle", 3, None, false)),
        m(Generation::Vllm033, None),
        m(Generation::Vllm033, spec("eagle3", 3, None, false)),
        m(Generation::Vllm033, spec("mtp", 3, Some(3), false)),
        m(Generation::Vllm033, spec("eagle", 2, None, true)),
        tiered(Generation::Vllm032, OffloadConnector::SimpleCpu),
        tiered(Generation::Vllm033, OffloadConnector::SimpleCpu),
        Mode {
            engine: Generation::Vllm032,
            speculative: spec("eagle", 3, None, false),
            cpu_tier: Some(OffloadConnector::SimpleCpu),
        },
        // 0.32's EAGLE3 flags no drafter group: the connector pops nothing.
        Mode {
            engine: Generation::Vllm032,
            speculative: spec("eagle3", 3, None, false),
            cpu_tier: Some(OffloadConnector::Offloading),
        },
    ]
}

fn plain() -> Mode {
    modes().remove(0)
}

/// Runs one random workload; returns the number of lookups checked, or `None` when the
/// engine refuses the configuration (EAGLE's drop with a chunked local group, as vLLM does).
fn run(preset: &str, seed: u64) -> usize {
    run_mode(preset, seed, &plain())
        .expect("every preset runs without speculation")
        .0
}

/// Runs one random workload; returns the lookups checked and how many of them the CPU tier
/// served, or `None` when the engine refuses the configuration (EAGLE's drop with a chunked
/// local group, as vLLM does).
fn run_mode(preset: &str, seed: u64, mode: &Mode) -> Option<(usize, usize)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cfg = EngineConfig::for_preset(preset).unwrap();
    cfg.engine = mode.engine;
    cfg.speculative = mode.speculative.clone();
    let rules = cfg.rules();
    let b = cfg
        .spec
        .groups
        .iter()
        .map(|g| g.block_size)
        .max()
        .unwrap_or(16) as usize;
    let vocab = cfg.spec.vocab_size.min(50_000);
    // Prompts span a few blocks (or a window / chunk, whichever is larger).
    let reach = cfg
        .spec
        .groups
        .iter()
        .map(|g| match g.kind {
            GroupKind::SlidingWindow { window } => window as usize + 2 * b,
            GroupKind::ChunkedLocal { chunk } => chunk as usize + 2 * b,
            _ => 6 * b,
        })
        .max()
        .unwrap_or(6 * b);
    let max_prompt = reach.min(9000);
    let max_out = 2 * b.min(64);
    cfg.max_model_len = (max_prompt + max_out + 2) as u32;
    cfg.max_num_batched_tokens = [b as u32 * 2, 512, 2048, 8192][rng.gen_range(0..4)];
    cfg.max_num_seqs = rng.gen_range(1..6);
    // Pools from "one long request and a bit" to roomy: eviction and preemption both happen.
    let per_req: usize = cfg
        .spec
        .groups
        .iter()
        .map(|g| match g.kind {
            GroupKind::Mamba => 3,
            _ => (cfg.max_model_len as usize).div_ceil(g.block_size as usize) + 1,
        })
        .sum();
    let roomy = rng.gen_bool(0.5);
    cfg.num_blocks = if roomy {
        per_req * 8
    } else {
        per_req + 1 + rng.gen_range(0..per_req)
    } as u32;
    cfg.retention = if rng.gen_bool(0.8) { Some(0) } else { None };
    if let Some(connector) = mode.cpu_tier {
        // Room for a few requests' chunks (or blocks): the device evicts, the tier keeps more
        // (and evicts too).
        cfg.cpu_tier_slots = per_req * 4;
        cfg.cpu_tier_connector = connector;
    }
    cfg.worker = "w".into();
    let chunk = cfg.spec.groups.iter().find_map(|g| match g.kind {
        GroupKind::ChunkedLocal { chunk } => Some(chunk),
        _ => None,
    });
    // The worker as a gateway configures it from its engine and `--speculative-config`.
    let (eagle, lookahead) = match &mode.speculative {
        Some(s) => (
            s.drops_eagle_block(mode.engine),
            s.hash_lookahead_tokens(mode.engine),
        ),
        None => (false, 0),
    };
    let index = Index::with_default(WorkerConfig {
        hash: HashMode::Engine {
            algo: HashAlgo::Sha256,
            seed: DEFAULT_SEED.into(),
        },
        lookup: LookupConfig {
            hash_block_size: None,
            chunk_size: chunk,
            eagle,
            offload_chunk_blocks: None,
            offload_connector: mode.cpu_tier.unwrap_or_default(),
            drafter_groups_unflagged: !mode
                .speculative
                .as_ref()
                .is_some_and(|s| s.flags_drafter_groups(mode.engine)),
        },
        verify_hashes: true,
        engine: mode.engine,
        hash_lookahead_tokens: lookahead,
    });
    let chunked = chunk.is_some();
    let cfg_full = cfg.spec.groups.iter().any(|g| g.kind.is_full());
    let mut engine = match Engine::new(cfg) {
        Ok(e) => e,
        Err(e) => {
            let no_full = !cfg_full;
            assert!(
                (rules.eagle_drop && chunked)
                    || (mode.cpu_tier == Some(OffloadConnector::SimpleCpu) && no_full),
                "{preset} {mode:?}: refused: {e}"
            );
            return None;
        }
    };
    let mut history: Vec<Vec<u32>> = Vec::new();
    let mut live: HashMap<u64, Live> = HashMap::new();
    let total = rng.gen_range(10..30);
    let mut submitted = 0;
    let mut checked = 0;
    let mut hits = 0;
    let mut tier_hits = 0;
    let mut lookahead_stores = 0;
    for _step in 0..20_000 {
        if submitted < total && (live.is_empty() || rng.gen_bool(0.3)) {
            let salt = rng
                .gen_bool(0.15)
                .then(|| ["a", "b"][rng.gen_range(0..2)].to_string());
            let prompt = match (rng.gen_range(0..10) / 3, history.is_empty()) {
                (0, false) => {
                    // A follow-up turn: a previous prompt and output, plus more.
                    let prev = history[rng.gen_range(0..history.len())].clone();
                    let mut p = prev;
                    let n = rng.gen_range(1..2 * b);
                    p.extend(fresh(&mut rng, n, vocab));
                    p
                }
                (1, false) => {
                    // A branch at a random point.
                    let prev = &history[rng.gen_range(0..history.len())];
                    let cut = rng.gen_range(1..=prev.len());
                    let mut p = prev[..cut].to_vec();
                    let n = rng.gen_range(1..3 * b);
                    p.extend(fresh(&mut rng, n, vocab));
                    p
                }
                (2, false) => history[rng.gen_range(0..history.len())].clone(),
                _ => {
                    let n = rng.gen_range(1..max_prompt);
                    fresh(&mut rng, n, vocab)
                }
            };
            let mut prompt = prompt;
            prompt.truncate(max_prompt);
            let max_tokens = rng.gen_range(1..=max_out);
            // Some requests run with one of two LoRA adapters (hashed with their key).
            let lora = rng.gen_bool(0.2).then(|| {
                let id = rng.gen_range(1..3);
                Lora {
                    name: format!("adapter-{id}"),
                    path: format!("/adapters/{id}"),
                    id,
                }
            });
            let h = engine
                .add_request(NewRequest {
                    id: format!("r{submitted}"),
                    prompt: prompt.clone(),
                    max_tokens,
                    forced_output: None,
                    cache_salt: salt.clone(),
                    skip_prefix_cache: false,
                    lora: lora.clone(),
                    remote_kv: None,
                })
                .unwrap();
            live.insert(
                h,
                Live {
                    tokens: prompt,
                    salt,
                    lora,
                },
            );
            submitted += 1;
        }
        if !engine.has_work() {
            if submitted >= total {
                break;
            }
            continue;
        }
        let out = engine.step();
        if out.scheduled_tokens == 0 {
            // Only requests loading KV (from the CPU tier) remain: time runs on to the first.
            if let Some(t) = engine.next_ready_at() {
                engine.advance_to(t);
            }
        }
        for e in &out.events {
            if let kvroute_index::Event::Stored(st) = e {
                // 0.33 with lookahead publishes, per stored hash, the L tokens it covers.
                match &st.lookahead_token_ids {
                    None => assert_eq!(rules.lookahead, 0, "{preset} {mode:?}: no lookahead ids"),
                    Some(ids) => {
                        assert_eq!(ids.len(), st.hashes.len());
                        assert!(ids.iter().all(|l| l.len() == rules.lookahead as usize));
                        lookahead_stores += usize::from(!ids.is_empty());
                    }
                }
            }
        }
        let mut applied = 0;
        for l in &out.lookups {
            index.apply_all(&out.events[applied..l.event_pos]);
            applied = l.event_pos;
            let r = &live[&l.handle];
            assert_eq!(l.num_tokens, r.tokens.len());
            let q = Query {
                tokens: r.tokens.clone(),
                extras: BlockExtras {
                    cache_salt: r.salt.clone(),
                    lora: r.lora.as_ref().map(|l| (l.name.clone(), l.path.clone())),
                },
                skip_prefix_cache: false,
            };
            let p = index.predict(&"w".into(), 0, &q);
            assert_eq!(
                (p.cached as usize, p.tier as usize),
                (l.hit + l.tier, l.tier),
                "{preset} {mode:?} seed {seed}: lookup of {} tokens: index {} ({} tier) vs sim \
                 {} + {} tier ({:?})",
                l.num_tokens,
                p.cached,
                p.tier,
                l.hit,
                l.tier,
                p.groups
            );
            checked += 1;
            hits += usize::from(l.hit > 0);
            tier_hits += usize::from(l.tier > 0);
        }
        index.apply_all(&out.events[applied..]);
        for t in &out.tokens {
            if let Some(r) = live.get_mut(&t.handle) {
                r.tokens.push(t.token);
                if t.finished.is_some() {
                    history.push(r.tokens.clone());
                    live.remove(&t.handle);
                }
            }
        }
    }
    assert!(
        live.is_empty(),
        "{preset} seed {seed}: requests never finished"
    );
    if std::env::var("SIM_VERBOSE").is_ok() {
        eprintln!(
            "{preset} seed {seed}: {checked} lookups ({hits} hit, {tier_hits} from the tier), \
             stats {:?}, index {:?}",
            engine.stats,
            index.stats()
        );
    }
    for (_, _, s) in index.rank_stats() {
        assert_eq!(
            s.hash_mismatched, 0,
            "{preset} {mode:?} seed {seed}: hash mismatch"
        );
        if rules.lookahead > 0 && hits > 0 {
            assert!(
                s.hash_matched > 0,
                "{preset} {mode:?}: lookahead stores verified"
            );
        }
    }
    assert_eq!(
        lookahead_stores > 0,
        rules.lookahead > 0,
        "{preset} {mode:?}: stores with lookahead tokens"
    );
    for (name, v) in index.counters().snapshot() {
        if name.contains("lookahead") {
            assert_eq!(v, 0, "{preset} {mode:?} seed {seed}: {name}");
        }
    }
    Some((checked, tier_hits))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_sim_hit_equals_the_index_prediction_from_its_own_events_on_every_preset(seed in any::<u64>()) {
        for preset in PRESETS {
            run(preset, seed);
        }
    }
}

#[test]
fn a_fixed_workload_checks_many_lookups_on_every_preset() {
    for preset in PRESETS {
        let n = run(preset, 42);
        assert!(n >= 8, "{preset}: only {n} lookups");
    }
}

#[test]
fn the_sim_hit_equals_the_index_prediction_on_every_preset_for_every_engine_and_speculation() {
    for mode in modes() {
        for preset in PRESETS {
            for seed in [7, 42] {
                let Some((n, _)) = run_mode(preset, seed, &mode) else {
                    continue;
                };
                assert!(n >= 8, "{preset} {mode:?}: only {n} lookups");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_agree_under_vllm_0_33_lookahead_and_0_32_eagle(seed in any::<u64>()) {
        for mode in &modes()[3..7] {
            for preset in PRESETS {
                run_mode(preset, seed, mode);
            }
        }
    }
}

#[test]
fn a_cpu_tier_serves_lookups_the_device_evicted_and_the_index_predicts_each_exactly() {
    // Without speculation, and under 0.32's EAGLE3 (no drafter group flagged: no pop).
    for at in [1, 11] {
        let mode = modes().remove(at);
        assert_eq!(mode.cpu_tier, Some(OffloadConnector::Offloading));
        let mut served = 0;
        for preset in PRESETS {
            for seed in [1, 2, 3] {
                served += run_mode(preset, seed, &mode).map_or(0, |(_, t)| t);
            }
        }
        assert!(served > 0, "{mode:?}: the tier never served a lookup");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_with_a_cpu_tier_agree_on_every_preset(seed in any::<u64>()) {
        for mode in &modes()[1..3] {
            for preset in PRESETS {
                run_mode(preset, seed, mode);
            }
        }
    }
}

#[test]
fn a_simple_cpu_tier_serves_lookups_by_the_device_rules_and_the_index_predicts_each_exactly() {
    for mode in &modes()[8..11] {
        assert_eq!(mode.cpu_tier, Some(OffloadConnector::SimpleCpu));
        let mut served = 0;
        for preset in PRESETS {
            for seed in [1, 2, 3] {
                served += run_mode(preset, seed, mode).map_or(0, |(_, t)| t);
            }
        }
        assert!(served > 0, "{mode:?}: the tier never served a lookup");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_with_a_simple_cpu_tier_agree_on_every_preset(seed in any::<u64>()) {
        for mode in &modes()[8..11] {
            for preset in PRESETS {
                run_mode(preset, seed, mode);
            }
        }
    }
}
