//! Store, remove and predict: kvroute's index (1, 2 and 4 KV cache groups) against SMG's
//! `ChainIndex` (full attention only), on the fleet of `kvroute_bench`, hashes precomputed.
//!
//! Ids are `{op}/{block size}/{index}-{groups}g`; one iteration is the whole fleet for `store`,
//! `store-warm` (into tables grown by an earlier fill), `remove` (128 workers × 8k tokens) and
//! `remove-tracked` (the same, keeping the eviction charge's figures), and one 8k-token
//! request against 128 workers for
//! `predict`. `predict` asks kvroute for `cached` and `group_blind` (`Detail::Cached`, what routing
//! uses; ChainIndex answers one prefix length per worker); `predict-evidence` adds each group's
//! own length (`explain`); `predict-hashing` is `predict_all_detail` with its SHA-256 of the
//! request (digest cache off); `predict-miss` (1 group) asks for a request no worker holds, the fixed cost per
//! (worker, rank). All for context beside `predict`. Per-block figures are derived in docs/benchmarks.md.

mod common;

use common::{check_agreement, kvroute_full, ChainFleet};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kvroute_bench::{Fleet, Layout};
use kvroute_index::{Detail, Index, Query};
use std::hint::black_box;
use std::time::Duration;

const BLOCKS: [usize; 2] = [16, 64];

fn id(op: &str, f: &Fleet, who: &str, layout: Layout) -> String {
    format!("{op}/{}/{who}-{}g", f.block, layout.groups())
}

fn benches(c: &mut Criterion) {
    for block in BLOCKS {
        let f = Fleet::new(block);
        let cf = ChainFleet::new(&f);
        check_agreement(&f, &cf);

        // Store the whole fleet into an empty index.
        for layout in Layout::ALL {
            let events = f.store_events(layout);
            c.bench_function(&id("store", &f, "kvroute", layout), |b| {
                b.iter_batched(
                    Index::new,
                    |index| {
                        index.apply_all(&events);
                        index
                    },
                    BatchSize::PerIteration,
                )
            });
        }
        c.bench_function(&id("store", &f, "chain", Layout::Full), |b| {
            b.iter_batched(
                || cf.empty(),
                |mut chain| {
                    cf.store(&mut chain);
                    chain
                },
                BatchSize::PerIteration,
            )
        });

        // Store the whole fleet again into an index that held it and evicted it all: the
        // steady state of a long-running router, whose tables and arenas are already grown.
        for layout in Layout::ALL {
            let events = f.store_events(layout);
            let removed = f.remove_events(layout);
            c.bench_function(&id("store-warm", &f, "kvroute", layout), |b| {
                b.iter_batched(
                    || {
                        let index = kvroute_full(&f, layout);
                        index.apply_all(&removed);
                        index
                    },
                    |index| {
                        index.apply_all(&events);
                        index
                    },
                    BatchSize::PerIteration,
                )
            });
        }
        let removals = cf.removals();
        c.bench_function(&id("store-warm", &f, "chain", Layout::Full), |b| {
            b.iter_batched(
                || {
                    let mut chain = cf.full();
                    cf.remove(&mut chain, &removals);
                    chain
                },
                |mut chain| {
                    cf.store(&mut chain);
                    chain
                },
                BatchSize::PerIteration,
            )
        });

        // Remove the whole fleet, tail first, from a full index; `remove-tracked` keeps the
        // eviction figures (the gateway's `weights.eviction = true`): each removed block's
        // fingerprint remembered.
        for (op, tracked) in [("remove", false), ("remove-tracked", true)] {
            for layout in Layout::ALL {
                let events = f.remove_events(layout);
                c.bench_function(&id(op, &f, "kvroute", layout), |b| {
                    b.iter_batched(
                        || {
                            let index = kvroute_full(&f, layout);
                            index.set_eviction_tracking(tracked);
                            index
                        },
                        |index| {
                            index.apply_all(&events);
                            index
                        },
                        BatchSize::PerIteration,
                    )
                });
            }
        }
        c.bench_function(&id("remove", &f, "chain", Layout::Full), |b| {
            b.iter_batched(
                || cf.full(),
                |mut chain| {
                    cf.remove(&mut chain, &removals);
                    chain
                },
                BatchSize::PerIteration,
            )
        });

        // One 8k-token request against the 128 workers.
        for layout in Layout::ALL {
            let index = kvroute_full(&f, layout);
            c.bench_function(&id("predict", &f, "kvroute", layout), |b| {
                b.iter(|| index.hits_with_chain(f.request.len(), black_box(&f.request_chain)))
            });
            c.bench_function(&id("predict-dense", &f, "kvroute", layout), |b| {
                b.iter(|| {
                    index.predict_all_with_chain(
                        f.request.len(),
                        black_box(&f.request_chain),
                        Detail::Cached,
                    )
                })
            });
            c.bench_function(&id("predict-evidence", &f, "kvroute", layout), |b| {
                b.iter(|| {
                    index.predict_all_with_chain(
                        f.request.len(),
                        black_box(&f.request_chain),
                        Detail::Evidence,
                    )
                })
            });
            if layout == Layout::Full {
                // A request no worker holds any block of: the fixed cost per (worker, rank).
                let miss: Vec<u64> = f.request_chain.iter().map(|h| h ^ 0x5555).collect();
                c.bench_function(&id("predict-miss", &f, "kvroute", layout), |b| {
                    b.iter(|| index.hits_with_chain(f.request.len(), black_box(&miss)))
                });
                let q = Query {
                    tokens: f.request.clone(),
                    ..Query::default()
                };
                // The digest cache off: the same request every iteration would never be hashed.
                let cold = Index::with_digest_cache(0);
                cold.apply_all(&f.store_events(layout));
                c.bench_function(&id("predict-hashing", &f, "kvroute", layout), |b| {
                    b.iter(|| cold.predict_all_detail(black_box(&q), Detail::Cached))
                });
            }
        }
        let chain = cf.full();
        c.bench_function(&id("predict", &f, "chain", Layout::Full), |b| {
            b.iter(|| chain.index.find_matches(black_box(&cf.request), false))
        });
    }
}

criterion_group! {
    name = index;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = benches
}
criterion_main!(index);
