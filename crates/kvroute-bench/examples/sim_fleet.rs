//! kvroute's index on event streams from the simulated engine: a 16-worker fleet of one preset
//! (vLLM 0.32's KV cache manager: window groups free the blocks behind their window, pools
//! small enough that the LRU evicts), 64 multi-turn conversations over four shared system
//! prompts. Prints the time to apply every event the fleet emitted to a fresh index, and the
//! time to predict every conversation's next turn against the fleet (chains precomputed). Meant
//! for comparing index revisions on realistic eviction patterns; uses only APIs that session 2
//! had, so the same file runs on older commits (docs/benchmarks.md, "Simulated fleets").
//!
//! `cargo run --release -p kvroute-bench --example sim_fleet -- [preset ...]`
//! (default: llama gpt-oss gemma3).

use kvroute_bench::{chain, segment_tokens};
use kvroute_index::{Detail, Event, Index, WorkerConfig};
use kvroute_sim::engine::{Engine, EngineConfig, NewRequest};
use std::time::Instant;

const WORKERS: usize = 16;
const CONVERSATIONS: usize = 64;
const TURNS: usize = 6;
const SYSTEM: usize = 1024;
const USER: usize = 300;
const OUTPUT: usize = 64;

/// Deterministic tokens below `vocab` (the bench workload's stream, folded into the vocabulary).
fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    segment_tokens(seed, n)
        .into_iter()
        .map(|t| t % vocab)
        .collect()
}

/// An index without the live hash check (it recomputes SHA-256 per stored block, which would
/// dominate and is the same in every revision).
fn index() -> Index {
    Index::with_default(WorkerConfig {
        verify_hashes: false,
        ..WorkerConfig::default()
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let presets = if args.is_empty() {
        vec!["llama".to_string(), "gpt-oss".into(), "gemma3".into()]
    } else {
        args
    };
    println!("| preset | events | blocks stored | apply all (ms) | ns per stored block | dense predict (µs per request) | hits (µs per request) | cached tokens predicted |");
    println!("|---|---|---|---|---|---|---|---|");
    for p in presets {
        run(&p);
    }
}

fn run(preset: &str) {
    let mut engines: Vec<Engine> = (0..WORKERS)
        .map(|w| {
            let mut cfg = EngineConfig::for_preset(preset).expect("a preset");
            cfg.worker = format!("w{w:02}").into();
            // About four live conversations' worth of blocks: the LRU evicts.
            cfg.num_blocks = (cfg.spec.default_blocks / 8).max(256);
            Engine::new(cfg).expect("an engine")
        })
        .collect();
    let vocab = 32_000;
    let mut history: Vec<Vec<u32>> = (0..CONVERSATIONS)
        .map(|c| tokens(1 + (c % 4) as u64, SYSTEM, vocab))
        .collect();
    let mut events: Vec<Event> = Vec::new();
    for turn in 0..TURNS {
        for (c, h) in history.iter_mut().enumerate() {
            h.extend(tokens(
                1_000 + (turn * CONVERSATIONS + c) as u64,
                USER,
                vocab,
            ));
            let e = &mut engines[c % WORKERS];
            let output = tokens(9_000 + (turn * CONVERSATIONS + c) as u64, OUTPUT, vocab);
            if e.add_request(NewRequest {
                id: format!("c{c}t{turn}"),
                prompt: h.clone(),
                max_tokens: OUTPUT,
                forced_output: Some(output.clone()),
                cache_salt: None,
                skip_prefix_cache: false,
                lora: None,
                remote_kv: None,
            })
            .is_err()
            {
                continue;
            }
            h.extend(output);
        }
        for e in engines.iter_mut() {
            while e.has_work() {
                events.extend(e.step().events);
            }
        }
    }
    let stored: usize = events
        .iter()
        .map(|ev| match ev {
            Event::Stored(s) => s.hashes.len(),
            _ => 0,
        })
        .sum();
    let apply: Vec<f64> = (0..5)
        .map(|_| {
            let index = index();
            let t = Instant::now();
            index.apply_all(&events);
            t.elapsed().as_secs_f64()
        })
        .collect();
    let apply = median(apply);
    let index = index();
    index.apply_all(&events);
    let requests: Vec<(usize, Vec<u64>)> = history
        .iter()
        .enumerate()
        .flat_map(|(c, h)| {
            // The next turn, and the same turn on a conversation's neighbour's worker.
            let mut next = h.clone();
            next.extend(tokens(50_000 + c as u64, USER, vocab));
            let chain = chain(&next[..next.len() - 1], 16);
            [(next.len(), chain.clone()), (next.len(), chain)]
        })
        .collect();
    let mut cached = 0u64;
    for (n, chain) in &requests {
        cached += index
            .predict_all_with_chain(*n, chain, Detail::Cached)
            .iter()
            .map(|p| p.cached)
            .sum::<u64>();
    }
    let predict: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for (n, chain) in &requests {
                std::hint::black_box(index.predict_all_with_chain(*n, chain, Detail::Cached));
            }
            t.elapsed().as_secs_f64() / requests.len() as f64
        })
        .collect();
    // (session 3 on) The routing prediction: only ranks that hit, by id. Remove this block to
    // run the file on a revision without `hits_with_chain`.
    let hits = {
        let mut hit_cached = 0u64;
        for (n, chain) in &requests {
            hit_cached += index
                .hits_with_chain(*n, chain)
                .iter()
                .map(|h| h.cached)
                .sum::<u64>();
        }
        assert_eq!(hit_cached, cached, "hits and the dense prediction agree");
        let times: Vec<f64> = (0..7)
            .map(|_| {
                let t = Instant::now();
                for (n, chain) in &requests {
                    std::hint::black_box(index.hits_with_chain(*n, chain));
                }
                t.elapsed().as_secs_f64() / requests.len() as f64
            })
            .collect();
        format!("{:.2}", median(times) * 1e6)
    };
    println!(
        "| {preset} | {} | {stored} | {:.2} | {:.1} | {:.2} | {hits} | {cached} |",
        events.len(),
        apply * 1e3,
        apply * 1e9 / stored.max(1) as f64,
        median(predict) * 1e6,
    );
}
