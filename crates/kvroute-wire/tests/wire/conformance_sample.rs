//! The real bytes of a vLLM 0.32 engine (tiny-gemma3: three sliding-window groups, window 64,
//! and one full-attention group; block 32), copied from the shared conformance sample into
//! `tests/data/gemma3-basic`. The expected numbers were counted independently with Python's
//! `msgpack` and are asserted literally.

use base64::Engine as _;
use kvroute_index::{CacheKind, Event, Stored, WorkerId};
use kvroute_wire::{decode_message, DecodedBatch};
use std::collections::{BTreeMap, HashSet};

fn messages() -> Vec<(Vec<u8>, u64, DecodedBatch)> {
    let text = include_str!("../data/gemma3-basic/frames.jsonl");
    let worker: WorkerId = "w0".into();
    let b64 = base64::engine::general_purpose::STANDARD;
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("sample line is JSON");
            assert_eq!(v["worker"], "w0");
            let frames: Vec<Vec<u8>> = v["frames"]
                .as_array()
                .expect("frames array")
                .iter()
                .map(|f| {
                    b64.decode(f.as_str().expect("base64 string"))
                        .expect("base64")
                })
                .collect();
            let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
            decode_message(&worker, &refs).expect("every sample message decodes")
        })
        .collect()
}

fn stores(msgs: &[(Vec<u8>, u64, DecodedBatch)]) -> Vec<Stored> {
    msgs.iter()
        .flat_map(|(_, _, b)| b.events.iter())
        .map(|e| match e {
            Event::Stored(s) => s.clone(),
            other => panic!("the sample holds only stores, got {other:?}"),
        })
        .collect()
}

#[test]
fn the_sample_decodes_without_a_single_drop_in_sequence_order() {
    let msgs = messages();
    assert_eq!(msgs.len(), 30);
    for (i, (topic, seq, batch)) in msgs.iter().enumerate() {
        assert_eq!(topic.as_slice(), b"kv");
        assert_eq!(*seq, i as u64);
        assert_eq!(batch.dp_rank, Some(0));
        assert!(
            batch.drops.is_empty(),
            "drops in batch {i}: {:?}",
            batch.drops
        );
        assert_eq!(batch.events.len(), 4, "one store per group per batch");
    }
    assert_eq!(msgs[0].2.ts, Some(1796057113.4719517));
    assert_eq!(msgs[29].2.ts, Some(1796057125.863983));
}

#[test]
fn the_sample_reports_three_window_groups_and_one_full_attention_group() {
    let all = stores(&messages());
    assert_eq!(all.len(), 120);
    let mut per_group: BTreeMap<u32, (usize, usize, usize)> = BTreeMap::new();
    for s in &all {
        let g = s.group.expect("every 0.32 store carries group_idx");
        let want_kind = if g == 3 {
            CacheKind::FullAttention
        } else {
            CacheKind::SlidingWindow
        };
        assert_eq!(s.kind.as_ref(), Some(&want_kind), "group {g}");
        assert_eq!(
            s.sliding_window,
            if g == 3 { None } else { Some(64) },
            "group {g}"
        );
        assert_eq!(s.block_size, 32);
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert_eq!(s.dp_rank, 0);
        assert_eq!(&*s.worker, "w0");
        assert_eq!(s.lora_id, None);
        assert_eq!(s.lora_name, None);
        let row = per_group.entry(g).or_default();
        row.0 += 1;
        row.1 += s.hashes.len();
        row.2 += s.token_ids.len();
    }
    let expect: BTreeMap<u32, (usize, usize, usize)> = [
        (0, (30, 42, 3424)),
        (1, (30, 42, 3424)),
        (2, (30, 42, 3424)),
        (3, (30, 107, 3424)),
    ]
    .into_iter()
    .collect();
    assert_eq!(per_group, expect);
}

#[test]
fn the_sample_hashes_are_unsigned_64_bit_values_with_sparse_window_stores() {
    let all = stores(&messages());
    let hashes: Vec<u64> = all
        .iter()
        .flat_map(|s| s.hashes.iter().map(|h| h.value.0))
        .collect();
    assert_eq!(hashes.len(), 233);
    assert_eq!(hashes.iter().collect::<HashSet<_>>().len(), 85);
    assert_eq!(hashes.iter().filter(|h| **h >= 1 << 63).count(), 133);
    assert!(all.iter().all(|s| s.hashes.iter().all(|h| h.raw.is_none())));
    assert_eq!(all.iter().filter(|s| s.hashes.is_empty()).count(), 24);
    assert_eq!(all.iter().filter(|s| s.parent.is_none()).count(), 52);
    for s in &all {
        match &s.extra_keys {
            None => assert!(
                s.hashes.is_empty(),
                "extra_keys omitted only when there is no hash"
            ),
            Some(k) => {
                assert_eq!(k.len(), s.hashes.len());
                assert!(k.iter().all(Option::is_none), "plain blocks only");
            }
        }
    }
    let first = &all[0];
    assert_eq!(first.group, Some(0));
    let v: Vec<u64> = first.hashes.iter().map(|h| h.value.0).collect();
    assert_eq!(v, [10001730879546885763, 13417801050463323530]);
    assert_eq!(first.token_ids.len(), 192);
    assert_eq!(&first.token_ids[..3], &[724, 331, 960]);
    let full = &all[3];
    assert_eq!(full.group, Some(3));
    let v: Vec<u64> = full.hashes.iter().map(|h| h.value.0).collect();
    assert_eq!(
        v,
        [
            3554194443464946567,
            5899080456665315670,
            9555490106599447804,
            3298204004446048448,
            10001730879546885763,
            13417801050463323530
        ]
    );
    let last = &all[119];
    assert_eq!(last.group, Some(3));
    assert_eq!(
        last.parent.as_ref().map(|p| p.value.0),
        Some(5066351181760651189)
    );
    assert_eq!(last.hashes.len(), 19);
    assert_eq!(last.token_ids.len(), 608);
}
