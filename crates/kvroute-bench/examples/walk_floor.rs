//! The floor under a walk-based answer for hybrid ranks: the bench fleet (128 workers, 8k
//! tokens each) in the shared run store with one holder per worker (full attention, as the
//! one-group `predict` walks it), with three (full attention and the two sliding windows of the
//! bench's four-group layout, holding every block) and with four (plus Mamba, holding a state
//! at the end of each segment). Times `Runs::walk` of the bench's request over each, nothing
//! else: a design that answers four-group ranks from one walk pays at least the three- or
//! four-holder figure, before its per-rank rules, its lock and its result. docs/benchmarks.md
//! ("Session 4") compares it with the one-group `predict`.
//!
//! `cargo run --release -p kvroute-bench --example walk_floor`

use kvroute_bench::Fleet;
use kvroute_index::runs::Runs;
use std::hint::black_box;
use std::time::Instant;

/// Nanoseconds per walk: the least of five rounds of `iters` walks.
fn time_walk(runs: &Runs, chain: &[u64], iters: u32) -> (f64, usize) {
    let mut out = Vec::with_capacity(1024);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            out.clear();
            runs.walk(black_box(chain), &mut out);
        }
        best = best.min(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    (best, out.len())
}

fn main() {
    println!("| block | holders per worker | holders walked | walk (ns) |");
    println!("|---|---|---|---|");
    for block in [16usize, 64] {
        let f = Fleet::new(block);
        let n = f.blocks_per_worker();
        // Segment ends (2k, 4k, 8k tokens): where the bench's Mamba group keeps a state.
        let states: Vec<usize> = [2048usize, 4096, 8192]
            .iter()
            .map(|t| t / block - 1)
            .collect();
        for groups in [1usize, 3, 4] {
            let mut runs = Runs::new();
            for chain in &f.chains {
                let ids: Vec<u32> = (0..groups).map(|_| runs.add_holder()).collect();
                for (g, id) in ids.iter().enumerate() {
                    if g == 3 {
                        for &s in &states {
                            runs.insert(*id, s.checked_sub(1).map(|p| chain[p]), &chain[s..=s]);
                        }
                    } else {
                        runs.insert(*id, None, &chain[..n]);
                    }
                }
            }
            let (ns, walked) = time_walk(&runs, &f.request_chain, 20_000);
            println!("| {block} | {groups} | {walked} | {ns:.0} |");
        }
    }
}
