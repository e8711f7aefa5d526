//! The simulator's hit equals kvroute-index's prediction from the simulator's own events.
//!
//! Random workloads (conversations, shared prefixes, branches, repeats, salts, concurrency,
//! pools small enough to evict and preempt) run on every preset. Each step's events are
//! applied to an `Index` in order; at each prefix-cache lookup the index has seen exactly the
//! events emitted before it, and its prediction must equal the hit the simulator used. The
//! index's live hash check must never find a store whose hash it computes differently.

use kvroute_index::hash::{BlockExtras, HashAlgo, DEFAULT_SEED};
use kvroute_index::{HashMode, Index, LookupConfig, Query, WorkerConfig};
use kvroute_sim::{Engine, EngineConfig, GroupKind, NewRequest, PRESETS};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

struct Live {
    tokens: Vec<u32>,
    salt: Option<String>,
}

fn fresh(rng: &mut StdRng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n.max(1)).map(|_| rng.gen_range(0..vocab)).collect()
}

/// Runs one random workload; returns the number of lookups checked.
fn run(preset: &str, seed: u64) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cfg = EngineConfig::for_preset(preset).unwrap();
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
    cfg.worker = "w".into();
    let chunk = cfg.spec.groups.iter().find_map(|g| match g.kind {
        GroupKind::ChunkedLocal { chunk } => Some(chunk),
        _ => None,
    });
    let index = Index::with_default(WorkerConfig {
        hash: HashMode::Engine {
            algo: HashAlgo::Sha256,
            seed: DEFAULT_SEED.into(),
        },
        lookup: LookupConfig {
            hash_block_size: None,
            chunk_size: chunk,
            eagle: false,
        },
        verify_hashes: true,
        ..WorkerConfig::default()
    });
    let mut engine = Engine::new(cfg).unwrap();
    let mut history: Vec<Vec<u32>> = Vec::new();
    let mut live: HashMap<u64, Live> = HashMap::new();
    let total = rng.gen_range(10..30);
    let mut submitted = 0;
    let mut checked = 0;
    let mut hits = 0;
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
            let h = engine
                .add_request(NewRequest {
                    id: format!("r{submitted}"),
                    prompt: prompt.clone(),
                    max_tokens,
                    forced_output: None,
                    cache_salt: salt.clone(),
                    skip_prefix_cache: false,
                })
                .unwrap();
            live.insert(
                h,
                Live {
                    tokens: prompt,
                    salt,
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
                    lora: None,
                },
                skip_prefix_cache: false,
            };
            let p = index.predict(&"w".into(), 0, &q);
            assert_eq!(
                p.cached as usize, l.hit,
                "{preset} seed {seed}: lookup of {} tokens: index {} vs sim {} ({:?})",
                l.num_tokens, p.cached, l.hit, p.groups
            );
            checked += 1;
            hits += usize::from(l.hit > 0);
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
            "{preset} seed {seed}: {checked} lookups ({hits} hit), stats {:?}, index {:?}",
            engine.stats,
            index.stats()
        );
    }
    for (_, _, s) in index.rank_stats() {
        assert_eq!(s.hash_mismatched, 0, "{preset} seed {seed}: hash mismatch");
    }
    checked
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
