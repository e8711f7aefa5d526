//! vLLM 0.33's `BlockStored.lookahead_token_ids`, from bytes encoded the way a 0.33 engine
//! encodes them (msgspec; `tests/py/vllm033_events.py` wrote `tests/data/vllm033-lookahead`)
//! with hashes computed as a 0.33 engine with lookahead hashes computes them: the field is
//! decoded, kept in the normalized event, and lets the index's live hash check verify the store.

use crate::common;

use base64::Engine as _;
use common::*;
use kvroute_index::counters::Counter;
use kvroute_index::{Event, Index, LookupConfig, WorkerConfig, WorkerId};
use kvroute_wire::{decode_batch, DecodedBatch, Dialect, DropReason};

struct Fixture {
    name: String,
    lookahead: usize,
    tokens: Vec<u32>,
    batch: DecodedBatch,
}

fn fixtures() -> Vec<Fixture> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/vllm033-lookahead/batches.jsonl"
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("json line");
            let payload = base64::engine::general_purpose::STANDARD
                .decode(v["payload"].as_str().expect("payload"))
                .expect("base64");
            let name = v["name"].as_str().expect("name").to_string();
            let batch = decode_batch(&"w".into(), &payload, Dialect::Vllm).expect("decodes");
            assert!(batch.drops.is_empty(), "{name}: {:?}", batch.drops);
            Fixture {
                name,
                lookahead: v["lookahead"].as_u64().expect("lookahead") as usize,
                tokens: serde_json::from_value(v["tokens"].clone()).expect("tokens"),
                batch,
            }
        })
        .collect()
}

/// An index checking every store at hash block 4.
fn index() -> Index {
    Index::with_default(WorkerConfig {
        lookup: LookupConfig {
            hash_block_size: Some(4),
            ..LookupConfig::default()
        },
        ..WorkerConfig::default()
    })
}

fn checked(index: &Index) -> (u64, u64, u64) {
    let c = index.counters();
    (
        c.get(Counter::HashCheckMatched),
        c.get(Counter::HashCheckMismatched),
        c.get(Counter::HashCheckUnverifiable),
    )
}

#[test]
fn lookahead_token_ids_are_the_tokens_after_each_block() {
    let all = fixtures();
    assert_eq!(all.len(), 7);
    for f in &all {
        let mut at = 0usize;
        for ev in &f.batch.events {
            let Event::Stored(s) = ev else { continue };
            let blocks = s.hashes.len();
            match &s.lookahead_token_ids {
                None => assert_eq!(f.lookahead, 0, "{}", f.name),
                Some(l) => {
                    assert_eq!(l.len(), blocks, "{}", f.name);
                    for (i, after) in l.iter().enumerate() {
                        let end = (at + i + 1) * 4;
                        assert_eq!(
                            after[..],
                            f.tokens[end..end + f.lookahead],
                            "{} block {}",
                            f.name,
                            at + i
                        );
                    }
                }
            }
            at += blocks;
        }
        // 23 tokens: five blocks with 0, 1 or 3 lookahead tokens.
        assert_eq!(at, 5, "{}", f.name);
    }
}

#[test]
fn a_vllm_0_33_store_with_lookahead_hashes_passes_the_live_hash_check() {
    for f in fixtures() {
        let index = index();
        index.apply_all(&f.batch.events);
        let stores = f
            .batch
            .events
            .iter()
            .filter(|e| matches!(e, Event::Stored(_)))
            .count() as u64;
        assert_eq!(checked(&index), (stores, 0, 0), "{}", f.name);
        // The blocks are held under the engine's hashes, one removed in the int fixtures.
        let held: usize = index
            .contents()
            .values()
            .flat_map(|g| g.values())
            .map(|m| m.len())
            .sum();
        let removed = usize::from(f.name.starts_with("int"));
        assert_eq!(held, 5 - removed, "{}", f.name);
    }
}

#[test]
fn without_its_lookahead_tokens_a_lookahead_store_does_not_verify() {
    for f in fixtures().into_iter().filter(|f| f.lookahead > 0) {
        let index = index();
        let stripped: Vec<Event> = f
            .batch
            .events
            .iter()
            .cloned()
            .map(|e| match e {
                Event::Stored(mut s) => {
                    s.lookahead_token_ids = None;
                    Event::Stored(s)
                }
                other => other,
            })
            .collect();
        index.apply_all(&stripped);
        let (matched, mismatched, _) = checked(&index);
        assert_eq!(matched, 0, "{}", f.name);
        assert!(mismatched > 0, "{}", f.name);
    }
}

#[test]
fn lookahead_token_ids_appear_in_the_normalized_event_json() {
    let f = fixtures()
        .into_iter()
        .find(|f| f.name == "bytes-l1")
        .expect("bytes-l1");
    let line = serde_json::to_string(&f.batch.events[0]).expect("json");
    let want = format!(
        "\"lookahead_token_ids\":[[{}],[{}],[{}]]",
        f.tokens[4], f.tokens[8], f.tokens[12]
    );
    assert!(line.contains(&want), "{line}");
    let back: Event = serde_json::from_str(&line).expect("parses back");
    assert_eq!(back, f.batch.events[0]);
    // Without lookahead the field is left out, as before.
    let plain = fixtures()
        .into_iter()
        .find(|f| f.name == "bytes-l0")
        .expect("bytes-l0");
    let line = serde_json::to_string(&plain.batch.events[0]).expect("json");
    assert!(!line.contains("lookahead"), "{line}");
}

#[test]
fn a_positional_store_reads_lookahead_token_ids_at_its_fifteenth_field() {
    let hashes = M::A(vec![M::U(5), M::U(6)]);
    let mut fields = vec![
        s("BlockStored"),
        hashes,
        M::Nil,
        M::A((0..8).map(M::U).collect()),
        M::U(4),
        M::Nil,
        s("GPU"),
        M::Nil,
        M::Nil,
        M::U(0),
        s("full_attention"),
        M::Nil,
        M::Nil,
        M::Nil,
        M::Nil,
    ];
    fields.push(M::A(vec![M::A(vec![M::U(4)]), M::A(vec![M::U(8)])]));
    let b =
        decode_batch(&"w".into(), &batch(vec![M::A(fields)], 0), Dialect::Vllm).expect("decodes");
    assert!(b.drops.is_empty(), "{:?}", b.drops);
    match b.events.as_slice() {
        [Event::Stored(st)] => {
            assert_eq!(st.lookahead_token_ids, Some(vec![vec![4], vec![8]]))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_malformed_lookahead_field_costs_only_that_field() {
    let worker: WorkerId = "w".into();
    let ev = map_event(
        stored_fields(&[5, 6], 0),
        &[("lookahead_token_ids", Some(M::A(vec![M::A(vec![M::U(1)])])))],
    );
    let b = decode_batch(&worker, &batch(vec![ev], 0), Dialect::Vllm).expect("decodes");
    assert_eq!(b.drops.len(), 1);
    assert_eq!(b.drops[0].reason, DropReason::InvalidLookaheadTokenIds);
    assert_eq!(b.drops[0].reason.name(), "invalid_lookahead_token_ids");
    match b.events.as_slice() {
        [Event::Stored(st)] => {
            assert_eq!(st.lookahead_token_ids, None);
            assert_eq!(st.hashes.len(), 2);
        }
        other => panic!("{other:?}"),
    }
}
