//! Routing decision time: p50/p99 per decision (request hashing included: the gateway's
//! snapshot of the fleet, then the routing core's ranking) for 64 workers and 8k-token prompts
//! (or `KVROUTE_BENCH_WORKERS` workers and `KVROUTE_BENCH_TOKENS`-token prompts), under each
//! cache policy, with the index's digest cache off and on (a fresh fleet per policy); 400
//! requests or three per worker, whichever is more. Not a pass/fail test; figures go to docs/benchmarks.md with these commands:
//!
//! ```sh
//! cargo bench -p kvroute --bench decision
//! KVROUTE_BENCH_WORKERS=1024 KVROUTE_BENCH_TOKENS=32768 cargo bench -p kvroute --bench decision
//! ```

use kvroute::gateway::config::{PolicyWeights, WorkerSpec};
use kvroute::gateway::decide::{decide_with, prepare, RouteRequest};
use kvroute::gateway::registry::Registry;
use kvroute_index::event::{CacheKind, Event, Stored};
use kvroute_index::hash::cache::DEFAULT_MAX_TOKENS;
use kvroute_index::hash::{external, BlockHasher, HashAlgo, DEFAULT_SEED};
use kvroute_index::{BlockExtras, Index};
use kvroute_route::PolicyKind;
use std::sync::Arc;
use std::time::Instant;

const BLOCK: usize = 16;

/// The fleet's size and the prompts' length: `KVROUTE_BENCH_WORKERS` (default 64) and
/// `KVROUTE_BENCH_TOKENS` (default 8,192, a multiple of 1,024).
fn size() -> (usize, usize) {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let tokens = env("KVROUTE_BENCH_TOKENS", 8192).max(4096) / 1024 * 1024;
    (env("KVROUTE_BENCH_WORKERS", 64).max(8), tokens)
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        })
        .collect()
}

fn store(worker: &str, group: u32, kind: CacheKind, window: Option<u32>, hashes: &[u64]) -> Event {
    Event::Stored(Stored::device(
        worker,
        group,
        kind,
        window,
        BLOCK as u32,
        hashes,
    ))
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = rt.enter();
    let hasher = BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED);
    let (workers, tokens_per_prompt) = size();
    println!("decision time, {workers} workers, {tokens_per_prompt}-token prompts, block {BLOCK} (full + sliding window 128):");
    // Without the digest cache every decision hashes its whole request; with it (the default),
    // a request repeating a prefix seen before hashes only its new blocks (here after the
    // first round of 64 requests: each continues one worker's prompt with 64 new tokens).
    // The default cache holds about a million tokens; a fleet whose prompts outgrow it is also
    // timed with a cache that holds them all (`digest_cache_tokens`).
    // `KVROUTE_BENCH_POLICIES` (names joined by commas: hybrid-aware, group-blind, least-load,
    // unseen) times only those, and `KVROUTE_BENCH_CACHE` (off, default, every) only that
    // digest cache: for profiling one.
    let only: Option<Vec<String>> = std::env::var("KVROUTE_BENCH_POLICIES")
        .ok()
        .map(|v| v.split(',').map(|p| p.trim().to_string()).collect());
    let chosen = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|p| p == name));
    let cache = std::env::var("KVROUTE_BENCH_CACHE").ok();
    let every_prompt = workers * (tokens_per_prompt + 256);
    let mut modes = vec![
        ("digest cache off", 0),
        ("digest cache on (default)", DEFAULT_MAX_TOKENS),
    ];
    if every_prompt > DEFAULT_MAX_TOKENS {
        modes.push(("digest cache holding every prompt", every_prompt));
    }
    let keys = ["off", "default", "every"];
    for (key, (label, cache_tokens)) in keys.into_iter().zip(modes) {
        if cache.as_ref().is_some_and(|c| c != key) {
            continue;
        }
        println!(" {label}:");
        for policy in [
            PolicyKind::HybridAware,
            PolicyKind::GroupBlind,
            PolicyKind::LeastLoad,
        ]
        .into_iter()
        .filter(|p| chosen(p.name()))
        {
            // A fresh fleet and index per policy: each starts from a cold cache.
            let (registry, prompts) = fleet(&hasher, cache_tokens, workers, tokens_per_prompt);
            // Every prompt is continued at least three times, so the digest cache's repeats
            // are measured at any fleet size (the first of each is cold: the p99 at 64 workers).
            let requests = (0..400.max(3 * workers)).map(|i| {
                let mut req = prompts[i % workers].clone();
                req.extend(tokens(i as u64 + 77, 64));
                req
            });
            let times = time_decisions(&registry, policy, policy.name(), requests);
            if cache_tokens > 0 && policy != PolicyKind::LeastLoad {
                // Past the first round every request repeats a prefix the cache was given.
                report("  repeats", times[workers..].to_vec());
            }
        }
        if !chosen("unseen") {
            continue;
        }
        // Prompts never seen (no reuse at all; hybrid-aware): what keeping their blocks costs
        // (the cache starts a new generation about every 127 of them).
        let (registry, _) = fleet(&hasher, cache_tokens, workers, tokens_per_prompt);
        let requests = (0..200).map(|i| tokens(1_000_000 + i as u64, tokens_per_prompt + 64));
        time_decisions(&registry, PolicyKind::HybridAware, "unseen", requests);
    }
    // Hashing alone, for context.
    let prompts: Vec<Vec<u32>> = (0..8).map(|w| prompt(w, tokens_per_prompt)).collect();
    let mut times = Vec::new();
    for i in 0..100 {
        let t = Instant::now();
        let c = hasher.chain(&prompts[i % 8], BLOCK, &BlockExtras::default());
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(c.len(), tokens_per_prompt / BLOCK);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "  sha256 chain of one {tokens_per_prompt}-token prompt alone: p50 {:.1} µs",
        times[times.len() / 2]
    );
}

/// Times one decision per request, prints p50, p99 and max, and returns the times in the
/// requests' order (µs).
fn time_decisions(
    registry: &Registry,
    policy: PolicyKind,
    label: &str,
    requests: impl Iterator<Item = Vec<u32>>,
) -> Vec<f64> {
    let workers = registry.all();
    let weights = PolicyWeights::default();
    let mut times = Vec::new();
    for (i, req) in requests.enumerate() {
        let t = Instant::now();
        prepare(registry, &workers, policy, &weights);
        let route = RouteRequest {
            rr: i as u64,
            ..RouteRequest::base(registry, &req)
        };
        let r = decide_with(registry, &workers, route, policy, &weights);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(!r.order.is_empty());
    }
    report(label, times.clone());
    times
}

/// Prints p50, p99 and max of `times` (µs).
fn report(label: &str, mut times: Vec<f64>) {
    times.sort_by(f64::total_cmp);
    let p = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    println!(
        "  {label:<13} p50 {:>8.1} µs   p99 {:>8.1} µs   max {:>8.1} µs",
        p(0.5),
        p(0.99),
        p(1.0)
    );
}

/// Worker `w`'s prompt of `n` tokens: a 2k system prompt shared by 8 workers, then its own.
fn prompt(w: usize, n: usize) -> Vec<u32> {
    let mut p = tokens(1000 + (w / 8) as u64, 2048);
    p.extend(tokens(w as u64, n - 2048));
    p
}

/// A registry of `workers` workers, each holding its prompt of `n` tokens, over an index whose
/// digest cache keeps `cache_tokens`; with the prompts.
fn fleet(
    hasher: &BlockHasher,
    cache_tokens: usize,
    workers: usize,
    n: usize,
) -> (Registry, Vec<Vec<u32>>) {
    let index = Arc::new(Index::with_digest_cache(cache_tokens));
    let registry = Registry::new(index.clone());
    let mut prompts = Vec::new();
    for w in 0..workers {
        let name = format!("w{w:04}");
        registry
            .add(WorkerSpec::new(&name, "http://127.0.0.1:9", "m"))
            .expect("add");
        let p = prompt(w, n);
        let chain: Vec<u64> = hasher
            .chain(&p, BLOCK, &BlockExtras::default())
            .iter()
            .map(|d| external(d).0)
            .collect();
        index.apply(&store(&name, 1, CacheKind::FullAttention, None, &chain));
        let tail = chain.len() - 8..chain.len();
        index.apply(&store(
            &name,
            0,
            CacheKind::SlidingWindow,
            Some(128),
            &chain[tail],
        ));
        prompts.push(p);
    }
    (registry, prompts)
}
