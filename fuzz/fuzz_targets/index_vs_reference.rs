//! Fuzzes the index with arbitrary event sequences, checked against the literal reference
//! model: after every sequence the two hold the same contents and predict the same for every
//! prompt of a small universe, on every rank; and an index loaded from the fast one's exported
//! images predicts the same too. Any disagreement is a crash.
#![no_main]

use kvroute_index::event::{CacheKind, Cleared, EngineHash, Event, Removed, Stored};
use kvroute_index::reference::Reference;
use kvroute_index::{BlockExtras, HashAlgo, Index, LookupConfig, Query, WorkerConfig};
use libfuzzer_sys::fuzz_target;

const H: usize = 4;
const KINDS: [&str; 5] = [
    "full_attention",
    "sliding_window",
    "mamba",
    "chunked_local_attention",
    "mla_attention",
];

/// Prompts sharing prefixes; their block hashes are the index's own chain of them.
fn universe() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|p| (0..(16 + 8 * p)).map(|i| (p % 3) * 100 + i).collect())
        .collect()
}

fn chain(tokens: &[u32]) -> Vec<u64> {
    kvroute_index::index::block_hashes(
        HashAlgo::Sha256,
        kvroute_index::hash::DEFAULT_SEED,
        H,
        tokens,
        &BlockExtras::default(),
    )
    .into_iter()
    .map(|(_, h, _)| h)
    .collect()
}

fuzz_target!(|data: &[u8]| {
    let config = WorkerConfig {
        lookup: LookupConfig {
            hash_block_size: Some(H as u32),
            chunk_size: Some(4 * H as u32),
            eagle: data.first().is_some_and(|b| b & 1 == 1),
            offload_chunk_blocks: None,
            // Either connector's tier rule (bit 2 of the first byte).
            offload_connector: if data.first().is_some_and(|b| b & 4 == 4) {
                kvroute_index::tier::OffloadConnector::SimpleCpu
            } else {
                kvroute_index::tier::OffloadConnector::Offloading
            },
            // Under EAGLE, no drafter group flagged (bit 3): the tier is predicted then too.
            drafter_groups_unflagged: data.first().is_some_and(|b| b & 8 == 8),
        },
        verify_hashes: false,
        ..WorkerConfig::default()
    };
    let fast = Index::with_default(config.clone());
    let mut reference = Reference::with_default(config.clone());
    let prompts = universe();
    let chains: Vec<Vec<u64>> = prompts.iter().map(|p| chain(p)).collect();
    for op in data.chunks(4).skip(1) {
        let [a, b, c, d] = [
            op[0],
            *op.get(1).unwrap_or(&0),
            *op.get(2).unwrap_or(&0),
            *op.get(3).unwrap_or(&0),
        ];
        let worker = ["w0", "w1"][(a & 1) as usize];
        let rank = ((a >> 1) & 1) as u32;
        let group = ((a >> 2) & 3) as u32;
        let kind = KINDS[(b % 5) as usize];
        let window = (kind == "sliding_window").then_some(4 + (b as u32 >> 3) % 12);
        // One block size for the whole sequence (the engine gives chunked local attention
        // the block size of every other group).
        let block = H as u32 * (1 + ((data[0] >> 1) & 1) as u32);
        let ch = &chains[(c % 6) as usize];
        let k = (block as usize) / H;
        let picked: Vec<u64> = (0..ch.len() / k)
            .filter(|i| d & (1 << (i % 8)) != 0)
            .map(|i| ch[(i + 1) * k - 1])
            .collect();
        let ev = match a >> 4 {
            0..=8 => Event::Stored(Stored {
                worker: worker.into(),
                dp_rank: rank,
                medium: if a >> 4 == 8 {
                    Some("CPU".into())
                } else {
                    None
                },
                group: Some(group),
                kind: Some(CacheKind::parse(kind)),
                sliding_window: window,
                block_size: block,
                parent: None,
                hashes: picked.into_iter().map(EngineHash::int).collect(),
                token_ids: Vec::new(),
                extra_keys: None,
                lora_id: None,
                lora_name: None,
                lookahead_token_ids: None,
            }),
            9..=13 => Event::Removed(Removed {
                worker: worker.into(),
                dp_rank: rank,
                medium: None,
                group: Some(group),
                hashes: picked.into_iter().map(EngineHash::int).collect(),
            }),
            _ => Event::Cleared(Cleared {
                worker: worker.into(),
                dp_rank: rank,
            }),
        };
        fast.apply(&ev);
        reference.apply(&ev);
    }
    assert_eq!(fast.contents(), reference.contents());
    let loaded = Index::with_default(config);
    for (w, r) in fast.ranks() {
        let image = fast.export_rank(&w, r).expect("a known rank");
        loaded.import_rank(&w, r, &image).expect("its own image");
    }
    assert_eq!(loaded.contents(), reference.contents());
    for p in &prompts {
        let q = Query {
            tokens: p.clone(),
            ..Query::default()
        };
        for (w, r) in fast.ranks() {
            let want = reference.predict(&w, r, &q);
            let got = fast.predict(&w, r, &q);
            assert_eq!((got.cached, got.group_blind), want);
            let got = loaded.predict(&w, r, &q);
            assert_eq!((got.cached, got.group_blind), want);
        }
    }
});
