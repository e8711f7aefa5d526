//! kvroute's index against Dynamo's `RadixTree` indexer, full attention only, on the fleet of
//! `kvroute_bench`: store, remove and predict, hashes precomputed, ids as in `kvroute-bench`.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash,
    RouterEvent,
};
use dynamo_kv_router::RadixTree;
use kvroute_bench::{Fleet, Layout, EVENT_BLOCKS, WORKERS};
use kvroute_index::Index;
use std::hint::black_box;
use std::time::Duration;

/// The fleet as Dynamo's router sees it: per worker, (engine hash, local content hash) per
/// block; the request's local hashes.
struct DynamoFleet {
    blocks: Vec<Vec<(u64, LocalBlockHash)>>,
    request: Vec<LocalBlockHash>,
}

impl DynamoFleet {
    fn new(f: &Fleet) -> DynamoFleet {
        let b = f.block as u32;
        let blocks = (0..WORKERS)
            .map(|w| {
                let local =
                    compute_block_hash_for_seq(&f.tokens[w], b, BlockHashOptions::default());
                f.chains[w].iter().copied().zip(local).collect()
            })
            .collect();
        let request = compute_block_hash_for_seq(&f.request, b, BlockHashOptions::default());
        DynamoFleet { blocks, request }
    }

    fn steps(&self) -> usize {
        self.blocks[0].len().div_ceil(EVENT_BLOCKS)
    }

    fn range(&self, step: usize) -> std::ops::Range<usize> {
        step * EVENT_BLOCKS..((step + 1) * EVENT_BLOCKS).min(self.blocks[0].len())
    }

    /// Store events in `Fleet::store_events`' order.
    fn store_events(&self) -> Vec<RouterEvent> {
        let mut out = Vec::new();
        let mut id = 0;
        for step in 0..self.steps() {
            let range = self.range(step);
            for w in 0..WORKERS {
                id += 1;
                let data = KvCacheStoreData {
                    parent_hash: range
                        .start
                        .checked_sub(1)
                        .map(|p| ExternalSequenceBlockHash(self.blocks[w][p].0)),
                    start_position: None,
                    blocks: self.blocks[w][range.clone()]
                        .iter()
                        .map(|(h, l)| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(*h),
                            tokens_hash: *l,
                            mm_extra_info: None,
                        })
                        .collect(),
                };
                out.push(event(w, id, KvCacheEventData::Stored(data)));
            }
        }
        out
    }

    /// Remove events in `Fleet::remove_events`' order (tail first).
    fn remove_events(&self) -> Vec<RouterEvent> {
        let mut out = Vec::new();
        let mut id = 1_000_000;
        for step in (0..self.steps()).rev() {
            let range = self.range(step);
            for w in 0..WORKERS {
                id += 1;
                let data = KvCacheRemoveData {
                    block_hashes: self.blocks[w][range.clone()]
                        .iter()
                        .rev()
                        .map(|(h, _)| ExternalSequenceBlockHash(*h))
                        .collect(),
                };
                out.push(event(w, id, KvCacheEventData::Removed(data)));
            }
        }
        out
    }

    fn full(&self, stores: &[RouterEvent]) -> RadixTree {
        let mut tree = RadixTree::new();
        for ev in stores {
            tree.apply_event(ev.clone()).expect("a consistent store");
        }
        tree
    }
}

fn event(w: usize, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent::new(
        w as u64,
        KvCacheEvent {
            event_id: id,
            data,
            dp_rank: 0,
        },
    )
}

fn benches(c: &mut Criterion) {
    for block in [16, 64] {
        let f = Fleet::new(block);
        let df = DynamoFleet::new(&f);
        let stores = df.store_events();
        let removes = df.remove_events();

        // Both indexes must see the same cache before anything is timed.
        let tree = df.full(&stores);
        let kv = Index::new();
        kv.apply_all(&f.store_events(Layout::Full));
        let scores = tree.find_matches(df.request.clone(), false).scores;
        for (w, p) in kv
            .predict_all_with_chain(f.request.len(), &f.request_chain)
            .iter()
            .enumerate()
        {
            let blocks = scores
                .iter()
                .find(|(k, _)| k.worker_id == w as u64)
                .map_or(0, |(_, s)| *s as u64);
            assert_eq!(p.cached, blocks * block as u64, "worker {w}");
        }

        c.bench_function(&format!("store/{block}/dynamo-1g"), |b| {
            b.iter_batched(
                || (RadixTree::new(), stores.clone()),
                |(mut tree, events)| {
                    for ev in events {
                        tree.apply_event(ev).expect("a consistent store");
                    }
                    tree
                },
                BatchSize::PerIteration,
            )
        });
        c.bench_function(&format!("remove/{block}/dynamo-1g"), |b| {
            b.iter_batched(
                || (df.full(&stores), removes.clone()),
                |(mut tree, events)| {
                    for ev in events {
                        let _ = tree.apply_event(ev);
                    }
                    tree
                },
                BatchSize::PerIteration,
            )
        });
        c.bench_function(&format!("predict/{block}/dynamo-1g"), |b| {
            b.iter_batched(
                || df.request.clone(),
                |request| tree.find_matches(black_box(request), false),
                BatchSize::SmallInput,
            )
        });
    }
}

criterion_group! {
    name = radix;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = benches
}
criterion_main!(radix);
