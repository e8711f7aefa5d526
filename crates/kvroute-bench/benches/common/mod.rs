//! The fleet of `kvroute_bench` as SMG's `ChainIndex` is fed it, and a check that both indexes
//! see the same cache (outside any timing).
#![allow(dead_code)]

use kv_index::{
    compute_content_hash, ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock,
};
use kvroute_bench::{Fleet, Layout, EVENT_BLOCKS, WORKERS};
use kvroute_index::{Detail, Index};

/// The fleet's blocks with both hashes ChainIndex wants: the engine's chain hash (kvroute's
/// SHA-256 value, the same the kvroute events carry) and the XXH3 content hash of the tokens.
pub struct ChainFleet {
    pub blocks: Vec<Vec<StoredBlock>>,
    pub request: Vec<ContentHash>,
}

impl ChainFleet {
    pub fn new(f: &Fleet) -> ChainFleet {
        let blocks = (0..WORKERS)
            .map(|w| {
                f.tokens[w]
                    .chunks_exact(f.block)
                    .zip(&f.chains[w])
                    .map(|(toks, h)| StoredBlock {
                        seq_hash: SequenceHash(*h),
                        content_hash: compute_content_hash(toks),
                    })
                    .collect()
            })
            .collect();
        let request = f
            .request
            .chunks_exact(f.block)
            .map(compute_content_hash)
            .collect();
        ChainFleet { blocks, request }
    }

    fn steps(&self) -> usize {
        self.blocks[0].len().div_ceil(EVENT_BLOCKS)
    }

    fn range(&self, step: usize) -> std::ops::Range<usize> {
        step * EVENT_BLOCKS..((step + 1) * EVENT_BLOCKS).min(self.blocks[0].len())
    }

    /// An empty index with the fleet's workers interned, and one lane map per worker.
    pub fn empty(&self) -> Chain {
        let index = ChainIndex::new();
        let ids = (0..WORKERS)
            .map(|w| {
                index
                    .intern_worker(&format!("w{w:03}"))
                    .expect("a free worker slot")
            })
            .collect();
        Chain {
            index,
            ids,
            maps: (0..WORKERS).map(|_| ChainBlockMap::new()).collect(),
        }
    }

    /// Stores the fleet in the same order as `Fleet::store_events` (round-robin, one engine
    /// step per worker, each event chained to the previous step's last block).
    pub fn store(&self, c: &mut Chain) {
        for step in 0..self.steps() {
            let range = self.range(step);
            for w in 0..WORKERS {
                let parent = range
                    .start
                    .checked_sub(1)
                    .map(|p| self.blocks[w][p].seq_hash);
                c.index
                    .apply_stored(
                        c.ids[w],
                        &self.blocks[w][range.clone()],
                        parent,
                        &mut c.maps[w],
                    )
                    .expect("the parent is held");
            }
        }
    }

    /// The removal batches in the order of `Fleet::remove_events`: (worker, hashes tail first).
    pub fn removals(&self) -> Vec<(usize, Vec<SequenceHash>)> {
        let mut out = Vec::new();
        for step in (0..self.steps()).rev() {
            let range = self.range(step);
            for w in 0..WORKERS {
                out.push((
                    w,
                    self.blocks[w][range.clone()]
                        .iter()
                        .rev()
                        .map(|b| b.seq_hash)
                        .collect(),
                ));
            }
        }
        out
    }

    pub fn remove(&self, c: &mut Chain, removals: &[(usize, Vec<SequenceHash>)]) {
        for (w, hashes) in removals {
            c.index.apply_removed(c.ids[*w], hashes, &mut c.maps[*w]);
        }
    }

    pub fn full(&self) -> Chain {
        let mut c = self.empty();
        self.store(&mut c);
        c
    }
}

/// A ChainIndex with its workers' ids and lane maps (the gateway's event lanes own the maps).
pub struct Chain {
    pub index: ChainIndex,
    pub ids: Vec<u32>,
    pub maps: Vec<ChainBlockMap>,
}

/// A kvroute index holding the fleet under `layout`.
pub fn kvroute_full(f: &Fleet, layout: Layout) -> Index {
    let index = Index::new();
    index.apply_all(&f.store_events(layout));
    index
}

/// Panics unless kvroute (given the chain, and hashing the tokens itself) and ChainIndex predict
/// the same cached tokens for every worker on the full-attention fleet, and kvroute's two
/// prediction paths agree under every layout.
pub fn check_agreement(f: &Fleet, cf: &ChainFleet) {
    let chain = cf.full();
    let scores = chain.index.find_matches(&cf.request, false).scores;
    for layout in Layout::ALL {
        let kv = kvroute_full(f, layout);
        let given = kv.predict_all_with_chain(f.request.len(), &f.request_chain, Detail::Evidence);
        let hashed = kv.predict_all(&kvroute_index::Query {
            tokens: f.request.clone(),
            ..Default::default()
        });
        assert_eq!(given, hashed, "{layout:?}: given chain vs hashing");
        let lean = kv.predict_all_with_chain(f.request.len(), &f.request_chain, Detail::Cached);
        for (l, g) in lean.iter().zip(&given) {
            assert_eq!(
                (l.cached, l.group_blind),
                (g.cached, g.group_blind),
                "{layout:?}: cached-only vs evidence"
            );
        }
        let mut hits: Vec<_> = kv
            .hits_with_chain(f.request.len(), &f.request_chain)
            .into_iter()
            .map(|h| {
                let (worker, dp_rank) = kv.rank_key(h.rank).expect("a live rank");
                (worker, dp_rank, h.cached, h.group_blind)
            })
            .collect();
        hits.sort();
        let nonzero: Vec<_> = lean
            .iter()
            .filter(|p| p.cached > 0 || p.group_blind > 0)
            .map(|p| (p.worker.clone(), p.dp_rank, p.cached, p.group_blind))
            .collect();
        assert_eq!(hits, nonzero, "{layout:?}: hits vs every rank");
        assert_eq!(given.len(), WORKERS);
        if layout == Layout::Full {
            for (w, p) in given.iter().enumerate() {
                let blocks = scores.get(&chain.ids[w]).copied().unwrap_or(0) as u64;
                assert_eq!(p.cached, blocks * f.block as u64, "worker {w}");
            }
        }
    }
}
