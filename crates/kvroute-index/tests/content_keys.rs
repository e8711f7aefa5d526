//! Content-key mode (engines whose hash the router cannot reproduce) and the live hash check.

mod common;
use common::{chain, tokens};
use kvroute_index::counters::Counter;
use kvroute_index::event::{CacheKind, EngineHash, Event, KeyValue, Removed, Stored};
use kvroute_index::{HashMode, Index, Query, WorkerConfig};

fn dense_store(
    worker: &str,
    block: u32,
    parent: Option<u64>,
    hashes: &[u64],
    toks: &[u32],
) -> Event {
    Event::Stored(Stored {
        worker: worker.into(),
        dp_rank: 0,
        medium: None,
        group: None,
        kind: None,
        sliding_window: None,
        block_size: block,
        parent: parent.map(EngineHash::int),
        hashes: hashes.iter().map(|h| EngineHash::int(*h)).collect(),
        token_ids: toks.to_vec(),
        extra_keys: None,
        lora_id: None,
        lora_name: None,
        lookahead_token_ids: None,
    })
}

fn content_index() -> Index {
    Index::with_default(WorkerConfig {
        hash: HashMode::ContentKey,
        ..WorkerConfig::default()
    })
}

#[test]
fn content_keys_are_learned_from_dense_stores_with_opaque_engine_hashes() {
    let idx = content_index();
    let t = tokens(1, 100);
    // Opaque engine hashes (think SGLang's signed ints): 11, 12, then a continuation 13, 14.
    idx.apply(&dense_store("w", 16, None, &[11, 12], &t[..32]));
    idx.apply(&dense_store("w", 16, Some(12), &[13, 14], &t[32..64]));
    let q = Query {
        tokens: t.clone(),
        ..Query::default()
    };
    assert_eq!(idx.predict(&"w".into(), 0, &q).cached, 64);
    let mut other = t[..40].to_vec();
    other.extend(tokens(5, 30));
    assert_eq!(
        idx.predict(
            &"w".into(),
            0,
            &Query {
                tokens: other,
                ..Query::default()
            }
        )
        .cached,
        32
    );
}

#[test]
fn a_store_whose_parent_is_unknown_is_counted_and_dropped_never_guessed() {
    let idx = content_index();
    let t = tokens(2, 100);
    idx.apply(&dense_store("w", 16, Some(999), &[13, 14], &t[32..64]));
    assert_eq!(idx.counters().get(Counter::ContentUnplaceable), 2);
    assert_eq!(
        idx.predict(
            &"w".into(),
            0,
            &Query {
                tokens: t,
                ..Query::default()
            }
        )
        .cached,
        0
    );
}

#[test]
fn removals_in_content_mode_follow_the_engine_hash_to_its_key() {
    let idx = content_index();
    let t = tokens(3, 100);
    idx.apply(&dense_store("w", 16, None, &[21, 22, 23], &t[..48]));
    let mut removed = Removed::device("w", 0, &[22]);
    removed.group = None;
    idx.apply(&Event::Removed(removed));
    assert_eq!(
        idx.predict(
            &"w".into(),
            0,
            &Query {
                tokens: t,
                ..Query::default()
            }
        )
        .cached,
        16
    );
}

#[test]
fn the_live_hash_check_counts_matches_and_mismatches() {
    let idx = Index::new();
    let t = tokens(4, 64);
    let c = chain(&t, 16);
    idx.apply(&dense_store("w", 16, None, &c[..2], &t[..32]));
    // Continuation chained on a parent the router recomputed: checkable too.
    idx.apply(&dense_store("w", 16, Some(c[1]), &c[2..4], &t[32..64]));
    assert_eq!(idx.counters().get(Counter::HashCheckMatched), 2);
    // An engine with other hash settings: its values do not match.
    idx.apply(&dense_store("x", 16, None, &[1, 2], &t[..32]));
    assert_eq!(idx.counters().get(Counter::HashCheckMismatched), 1);
    let stats = idx.rank_stats();
    assert_eq!(
        stats
            .iter()
            .find(|s| &*s.0 == "x")
            .map(|s| s.2.hash_mismatched),
        Some(1)
    );
}

#[test]
fn a_salted_first_block_is_checked_with_the_tagged_salt() {
    let idx = Index::new();
    let t = tokens(5, 40);
    let salted =
        kvroute_index::hash::BlockHasher::new(kvroute_index::HashAlgo::Sha256, "vllm-none-hash")
            .chain(
                &t,
                16,
                &kvroute_index::BlockExtras {
                    cache_salt: Some("tenant-a".into()),
                    lora: None,
                },
            );
    let hashes: Vec<u64> = salted
        .iter()
        .map(|d| kvroute_index::hash::external(d).0)
        .collect();
    let mut ev = dense_store("w", 16, None, &hashes, &t[..32]);
    if let Event::Stored(s) = &mut ev {
        s.kind = Some(CacheKind::FullAttention);
        s.extra_keys = Some(vec![
            Some(KeyValue::List(vec![KeyValue::Str("tenant-a".into())])),
            None,
        ]);
    }
    idx.apply(&ev);
    assert_eq!(idx.counters().get(Counter::HashCheckMatched), 1);
    let q = |salt: Option<&str>| Query {
        tokens: t.clone(),
        extras: kvroute_index::BlockExtras {
            cache_salt: salt.map(Into::into),
            lora: None,
        },
        ..Query::default()
    };
    assert_eq!(idx.predict(&"w".into(), 0, &q(Some("tenant-a"))).cached, 32);
    assert_eq!(
        idx.predict(&"w".into(), 0, &q(None)).cached,
        0,
        "another tenant reuses nothing"
    );
}

#[test]
fn a_content_key_rank_loaded_from_its_image_keeps_its_keys_and_their_engine_hashes() {
    let idx = content_index();
    let t = tokens(4, 100);
    idx.apply(&dense_store("w", 16, None, &[31, 32], &t[..32]));
    idx.apply(&dense_store("w", 16, Some(32), &[33, 34], &t[32..64]));
    let image = idx.export_rank(&"w".into(), 0).expect("a known rank");
    let loaded = content_index();
    loaded
        .import_rank(&"w".into(), 0, &image)
        .expect("its own image loads");
    let q = Query {
        tokens: t.clone(),
        ..Query::default()
    };
    assert_eq!(loaded.predict(&"w".into(), 0, &q).cached, 64);
    assert_eq!(loaded.contents(), idx.contents());
    // A continuation chained on a loaded block is placed, and a removal by engine hash finds
    // its key: the engine-hash → key map came along.
    loaded.apply(&dense_store("w", 16, Some(34), &[35], &t[64..80]));
    assert_eq!(loaded.predict(&"w".into(), 0, &q).cached, 80);
    let mut removed = Removed::device("w", 0, &[33]);
    removed.group = None;
    loaded.apply(&Event::Removed(removed));
    assert_eq!(loaded.predict(&"w".into(), 0, &q).cached, 32);
}

#[test]
fn content_evicted_and_prefilled_again_counts_as_restored_whatever_its_engine_hash() {
    let idx = content_index();
    idx.set_eviction_tracking(true);
    let t = tokens(6, 64);
    idx.apply(&dense_store("w", 16, None, &[11, 12], &t[..32]));
    idx.apply(&Event::Removed(Removed::device("w", 0, &[12])));
    // The same tokens on the same parent, under a new opaque hash (SGLang's are per store).
    idx.apply(&dense_store("w", 16, Some(11), &[21], &t[16..32]));
    // New content after it is not a re-prefill.
    idx.apply(&dense_store("w", 16, Some(21), &[22], &t[32..48]));
    let s = idx.eviction_stats(&"w".into());
    assert_eq!((s.tokens_stored, s.tokens_restored), (64, 16));
}
