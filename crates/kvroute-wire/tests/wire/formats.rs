//! Every accepted generation of the format decodes to the same normalized events.

use crate::common;

use common::*;
use kvroute_index::{CacheKind, Cleared, EngineHash, Event, KeyValue, Removed, Stored, WorkerId};
use kvroute_wire::{decode_batch, DecodedBatch, Dialect};

fn w() -> WorkerId {
    "w".into()
}

fn decode(payload: &[u8]) -> DecodedBatch {
    let b = decode_batch(&w(), payload, Dialect::Vllm).expect("decodes");
    assert!(b.drops.is_empty(), "{:?}", b.drops);
    b
}

fn only_store(b: &DecodedBatch) -> &Stored {
    match b.events.as_slice() {
        [Event::Stored(s)] => s,
        other => panic!("expected one store, got {other:?}"),
    }
}

#[test]
fn signed_and_unsigned_encodings_of_a_hash_normalize_to_the_same_64_bits() {
    let signed = decode(&batch(
        vec![map_event(
            stored_fields(&[], 0),
            &[
                ("block_hashes", Some(M::A(vec![M::I(-1), M::I(5)]))),
                ("extra_keys", None),
            ],
        )],
        0,
    ));
    let unsigned = decode(&batch(
        vec![map_event(
            stored_fields(&[], 0),
            &[
                ("block_hashes", Some(M::A(vec![M::U(u64::MAX), M::U(5)]))),
                ("extra_keys", None),
            ],
        )],
        0,
    ));
    assert_eq!(
        only_store(&signed).hashes,
        vec![EngineHash::int(u64::MAX), EngineHash::int(5)]
    );
    assert_eq!(only_store(&signed).hashes, only_store(&unsigned).hashes);
    let fixint = decode(&[
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x93, 0xac, b'B', b'l', b'o', b'c', b'k', b'R',
        b'e', b'm', b'o', b'v', b'e', b'd', 0x91, 0xff, 0xc0, 0x00,
    ]);
    match fixint.events.as_slice() {
        [Event::Removed(r)] => assert_eq!(r.hashes, vec![EngineHash::int(u64::MAX)]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn byte_hashes_keep_their_raw_digest_and_read_the_last_eight_bytes_big_endian() {
    let mut digest = vec![0xaau8; 24];
    digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let b = decode(&batch(
        vec![map_event(
            stored_fields(&[], 0),
            &[
                (
                    "block_hashes",
                    Some(M::A(vec![M::Bin(digest.clone()), M::Bin(vec![7; 16])])),
                ),
                ("parent_block_hash", Some(M::Bin(digest.clone()))),
                ("extra_keys", None),
            ],
        )],
        0,
    ));
    let s = only_store(&b);
    assert_eq!(s.hashes[0].value.0, 0x0102_0304_0506_0708);
    assert_eq!(s.hashes[0].raw.as_deref(), Some(digest.as_slice()));
    assert_eq!(s.hashes[1].value.0, 0x0707_0707_0707_0707);
    assert_eq!(s.parent, Some(EngineHash::bytes(&digest)));
}

#[test]
fn the_oldest_two_element_batch_files_events_under_rank_zero() {
    let b = decode(&M::A(vec![M::F(2.5), M::A(vec![good_stored(&[1])])]).encode());
    assert_eq!((b.ts, b.dp_rank), (Some(2.5), None));
    assert_eq!(b.events[0].dp_rank(), 0);
}

#[test]
fn the_batch_rank_is_stamped_on_every_event_and_can_be_overridden() {
    let mut b = decode(&batch(
        vec![
            good_stored(&[1]),
            removed(&[1], None),
            M::A(vec![s("AllBlocksCleared")]),
        ],
        3,
    ));
    assert_eq!(b.dp_rank, Some(3));
    assert!(b.events.iter().all(|e| e.dp_rank() == 3));
    b.set_dp_rank(5);
    assert!(b.events.iter().all(|e| e.dp_rank() == 5));
    let nil_rank = decode(&M::A(vec![M::F(1.0), M::A(vec![]), M::Nil]).encode());
    assert_eq!(nil_rank.dp_rank, None);
}

#[test]
fn positional_events_of_every_length_decode_by_position() {
    // vLLM <= 0.23: [tag, hashes, parent, tokens, block_size, lora_id].
    let old = decode(&batch(
        vec![M::A(vec![
            s("BlockStored"),
            M::A(vec![M::I(-7)]),
            M::I(-8),
            M::A(vec![M::U(1), M::U(2)]),
            M::U(2),
            M::Nil,
        ])],
        0,
    ));
    let s0 = only_store(&old);
    assert_eq!(s0.hashes, vec![EngineHash::int(-7i64 as u64)]);
    assert_eq!(s0.parent, Some(EngineHash::int(-8i64 as u64)));
    assert_eq!(
        (s0.group, s0.medium.as_deref(), s0.block_size),
        (None, None, 2)
    );
    // The full 0.33 order (0.32's, then lookahead_token_ids), plus two positions from a
    // future engine.
    let full = decode(&batch(
        vec![M::A(vec![
            s("BlockStored"),
            M::A(vec![M::U(9)]),
            M::Nil,
            M::A(vec![M::U(1)]),
            M::U(1),
            M::U(3),
            s("CPU"),
            s("adapter"),
            M::A(vec![M::Nil]),
            M::U(2),
            s("sliding_window"),
            M::U(128),
            s("LOCAL"),
            s("OWNED"),
            s("sess-1"),
            M::A(vec![M::A(vec![M::U(5)])]),
            M::Map(vec![]),
            M::B(true),
        ])],
        0,
    ));
    let s1 = only_store(&full);
    assert_eq!(s1.group, Some(2));
    assert_eq!(s1.kind, Some(CacheKind::SlidingWindow));
    assert_eq!(s1.sliding_window, Some(128));
    assert_eq!(
        (s1.lora_id, s1.lora_name.as_deref(), s1.medium.as_deref()),
        (Some(3), Some("adapter"), Some("CPU"))
    );
    assert_eq!(s1.extra_keys, Some(vec![None]));
    assert_eq!(s1.lookahead_token_ids, Some(vec![vec![5]]));
    let rem = decode(&batch(
        vec![
            M::A(vec![
                s("BlockRemoved"),
                M::A(vec![M::U(9)]),
                s("GPU"),
                M::U(2),
                s("LOCAL"),
                M::Nil,
                M::U(99),
            ]),
            M::A(vec![s("AllBlocksCleared"), M::Nil]),
        ],
        1,
    ));
    assert_eq!(
        rem.events,
        vec![
            Event::Removed(Removed {
                worker: w(),
                dp_rank: 1,
                medium: Some("GPU".into()),
                group: Some(2),
                hashes: vec![EngineHash::int(9)]
            }),
            Event::Cleared(Cleared {
                worker: w(),
                dp_rank: 1
            }),
        ]
    );
}

#[test]
fn maps_with_omitted_defaults_unknown_keys_and_no_group_fields_decode_silently() {
    let b = decode(&batch(
        vec![M::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), M::A(vec![M::U(1)])),
            (s("token_ids"), M::A(vec![M::U(1)])),
            (s("block_size"), M::U(1)),
            (s("a_future_field"), M::Map(vec![(s("x"), M::A(vec![]))])),
            (M::U(42), s("a non-string key")),
        ])],
        0,
    ));
    let s0 = only_store(&b);
    assert_eq!(
        (
            s0.group,
            &s0.kind,
            s0.sliding_window,
            &s0.parent,
            &s0.medium
        ),
        (None, &None, None, &None, &None)
    );
}

#[test]
fn unknown_kind_strings_and_offload_mediums_are_kept_verbatim() {
    let b = decode(&batch(
        vec![map_event(
            stored_fields(&[1], 4),
            &[
                ("kv_cache_spec_kind", Some(s("circular_buffer"))),
                ("kv_cache_spec_sliding_window", None),
                ("medium", Some(s("cpu"))),
            ],
        )],
        0,
    ));
    let s0 = only_store(&b);
    assert_eq!(s0.kind, Some(CacheKind::Unknown("circular_buffer".into())));
    assert_eq!(s0.medium.as_deref(), Some("cpu"));
    assert_eq!(s0.group, Some(4));
}

#[test]
fn an_offloading_connectors_cpu_chunk_with_no_tokens_and_block_size_0_is_kept_for_its_tier() {
    // What vLLM 0.32's OffloadingConnector publishes for a CPU chunk by default: the chunk's
    // last block hash, no parent, no tokens, block size 0, its group.
    let b = decode(&batch(
        vec![map_event(
            stored_fields(&[77], 3),
            &[
                ("token_ids", Some(M::A(vec![]))),
                ("block_size", Some(M::U(0))),
                ("medium", Some(s("CPU"))),
                ("kv_cache_spec_kind", None),
                ("kv_cache_spec_sliding_window", None),
                ("extra_keys", Some(M::Nil)),
            ],
        )],
        0,
    ));
    let s0 = only_store(&b);
    assert_eq!(s0.medium.as_deref(), Some("CPU"));
    assert_eq!((s0.block_size, s0.group), (0, Some(3)));
    assert_eq!(s0.hashes, vec![EngineHash::int(77)]);
    // The same event on the device tier has no usable block size.
    let device = decode_batch(
        &w(),
        &batch(
            vec![map_event(
                stored_fields(&[77], 3),
                &[("block_size", Some(M::U(0))), ("medium", Some(s("GPU")))],
            )],
            0,
        ),
        Dialect::Vllm,
    )
    .expect("decodes");
    assert!(device.events.is_empty());
    assert_eq!(device.drops.len(), 1);
}

#[test]
fn extra_keys_become_one_key_value_per_hash() {
    let entry = M::A(vec![
        s("lora-a"),
        M::A(vec![s("mm-hash"), M::I(-3)]),
        s("salt"),
        M::Bin(vec![1, 2]),
        M::U(u64::MAX),
        M::F(0.5),
        M::B(true),
    ]);
    let b = decode(&batch(
        vec![map_event(
            stored_fields(&[1, 2], 0),
            &[("extra_keys", Some(M::A(vec![M::Nil, entry])))],
        )],
        0,
    ));
    let keys = only_store(&b).extra_keys.clone().expect("extra keys");
    assert_eq!(keys[0], None);
    assert_eq!(
        keys[1],
        Some(KeyValue::List(vec![
            KeyValue::Str("lora-a".into()),
            KeyValue::List(vec![KeyValue::Str("mm-hash".into()), KeyValue::Int(-3)]),
            KeyValue::Str("salt".into()),
            KeyValue::Bytes { bytes: vec![1, 2] },
            KeyValue::UInt(u64::MAX),
            KeyValue::Float(0.5),
            KeyValue::Bool(true),
        ]))
    );
}

#[test]
fn a_repeated_map_key_takes_its_last_value() {
    let b = decode(&batch(
        vec![M::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), M::A(vec![M::U(1)])),
            (s("block_hashes"), M::A(vec![M::U(2)])),
        ])],
        0,
    ));
    match b.events.as_slice() {
        [Event::Removed(r)] => assert_eq!(r.hashes, vec![EngineHash::int(2)]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn sglang_salts_travel_in_extra_keys_and_its_arrays_stop_after_medium() {
    let map = M::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), M::A(vec![M::I(-1), M::I(2)])),
        (s("parent_block_hash"), M::Nil),
        (s("token_ids"), M::A(vec![M::U(1), M::U(2)])),
        (s("block_size"), M::U(1)),
        (s("medium"), s("CPU_PINNED")),
        (s("cache_salt"), s("tenant-a")),
        (s("session_id"), s("s1")),
    ]);
    // Positions past `medium` are not interpreted for SGLang (here: a bogus "group").
    let arr = M::A(vec![
        s("BlockStored"),
        M::A(vec![M::I(-5)]),
        M::Nil,
        M::A(vec![M::U(1)]),
        M::U(1),
        M::Nil,
        s("GPU"),
        M::B(true),
        M::B(true),
        M::B(true),
    ]);
    let payload = M::A(vec![M::F(1.0), M::A(vec![map, arr]), M::U(2)]).encode();
    let b = decode_batch(&w(), &payload, Dialect::Sglang).expect("decodes");
    assert!(b.drops.is_empty(), "{:?}", b.drops);
    let [Event::Stored(a), Event::Stored(c)] = b.events.as_slice() else {
        panic!("{:?}", b.events)
    };
    let salt = Some(KeyValue::Str("tenant-a".into()));
    assert_eq!(a.extra_keys, Some(vec![salt.clone(), salt]));
    assert_eq!(a.hashes[0].value.0, u64::MAX);
    assert_eq!((a.dp_rank, c.dp_rank, c.group), (2, 2, None));
    // The vLLM dialect ignores `cache_salt` (vLLM puts the salt in extra_keys itself).
    let v = decode_batch(&w(), &payload, Dialect::Vllm).expect("decodes");
    let Event::Stored(a) = &v.events[0] else {
        panic!()
    };
    assert_eq!(a.extra_keys, None);
}
