//! A table of malformed inputs: each asserts the exact reason it is refused with, what it
//! costs (batch, event or field), and that the next good batch still decodes.

use crate::common;

use common::*;
use kvroute_index::WorkerId;
use kvroute_wire::{
    decode_batch_with, decode_message, BatchErrorReason as B, Cost, Dialect, DropReason as D,
    FrameError, Limits,
};

enum Expect {
    /// The whole batch is refused.
    Batch(B),
    /// The bad event is dropped; the good one after it survives.
    Event(D),
    /// Both events survive; the drop is recorded.
    Field(D),
}

struct Case {
    name: &'static str,
    payload: Vec<u8>,
    limits: Limits,
    dialect: Dialect,
    expect: Expect,
}

fn case(name: &'static str, payload: Vec<u8>, expect: Expect) -> Case {
    Case {
        name,
        payload,
        limits: Limits::default(),
        dialect: Dialect::Vllm,
        expect,
    }
}

/// A batch holding `bad`, then one good event.
fn with_bad(bad: M) -> Vec<u8> {
    batch(vec![bad, good_stored(&[77])], 0)
}

fn stored_with(edits: &[(&'static str, Option<M>)]) -> Vec<u8> {
    with_bad(map_event(stored_fields(&[5, 6], 1), edits))
}

fn ev(name: &'static str, edits: &[(&'static str, Option<M>)], reason: D) -> Case {
    case(name, stored_with(edits), Expect::Event(reason))
}

fn field(name: &'static str, edits: &[(&'static str, Option<M>)], reason: D) -> Case {
    case(name, stored_with(edits), Expect::Field(reason))
}

fn nested(depth: usize) -> M {
    (0..depth).fold(M::Nil, |m, _| M::A(vec![m]))
}

/// Deep nesting as raw bytes (a recursive `M` that deep would overflow the test's own stack).
fn deep_raw(depth: usize) -> M {
    let mut b = vec![0x91u8; depth];
    b.push(0xc0);
    M::Raw(b)
}

fn cases() -> Vec<Case> {
    let good = good_batch();
    let big = 1u64 << 32;
    let mut v = vec![
        // Whole batches.
        case(
            "an empty payload",
            vec![],
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "a truncated batch",
            good[..good.len() / 2].to_vec(),
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "trailing bytes",
            [good.clone(), vec![0xc0]].concat(),
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "the reserved marker",
            vec![0x92, 0xc1, 0x90],
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "a hostile array length",
            vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "a hostile string length",
            vec![0x93, 0xdb, 0xff, 0xff, 0xff, 0xff],
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "a hostile map length in an event",
            M::A(vec![
                M::F(1.0),
                M::A(vec![M::Raw(vec![0xdf, 0xff, 0xff, 0xff, 0xff])]),
            ])
            .encode(),
            Expect::Batch(B::MalformedMsgpack),
        ),
        case(
            "deep nesting",
            M::A(vec![M::F(1.0), M::A(vec![deep_raw(100_000)])]).encode(),
            Expect::Batch(B::TooDeep),
        ),
        case(
            "a payload over the size limit",
            vec![0u8; (16 << 20) + 1],
            Expect::Batch(B::PayloadTooLarge),
        ),
        case(
            "a top-level map",
            M::Map(vec![]).encode(),
            Expect::Batch(B::BatchNotAnArray),
        ),
        case(
            "a top-level integer",
            M::U(3).encode(),
            Expect::Batch(B::BatchNotAnArray),
        ),
        case(
            "a batch of one element",
            M::A(vec![M::F(1.0)]).encode(),
            Expect::Batch(B::BatchTooShort),
        ),
        case(
            "nil where the event list is due",
            M::A(vec![M::F(1.0), M::Nil, M::U(0)]).encode(),
            Expect::Batch(B::EventsNotAList),
        ),
        case(
            "a map where the event list is due",
            M::A(vec![M::F(1.0), M::Map(vec![])]).encode(),
            Expect::Batch(B::EventsNotAList),
        ),
        case(
            "a negative dp_rank",
            M::A(vec![M::F(1.0), M::A(vec![]), M::I(-1)]).encode(),
            Expect::Batch(B::InvalidDpRank),
        ),
        case(
            "a string dp_rank",
            M::A(vec![M::F(1.0), M::A(vec![]), s("0")]).encode(),
            Expect::Batch(B::InvalidDpRank),
        ),
        case(
            "a dp_rank of 2^32",
            M::A(vec![M::F(1.0), M::A(vec![]), M::U(big)]).encode(),
            Expect::Batch(B::InvalidDpRank),
        ),
        case(
            "a bool dp_rank",
            M::A(vec![M::F(1.0), M::A(vec![]), M::B(false)]).encode(),
            Expect::Batch(B::InvalidDpRank),
        ),
        Case {
            limits: Limits {
                max_events: 1,
                ..Limits::default()
            },
            ..case(
                "more events than the limit",
                good.clone(),
                Expect::Batch(B::TooManyEvents),
            )
        },
        // Whole events.
        case(
            "an integer event",
            with_bad(M::U(1)),
            Expect::Event(D::NotAnEvent),
        ),
        case(
            "a string event",
            with_bad(s("BlockStored")),
            Expect::Event(D::NotAnEvent),
        ),
        case(
            "a map without type",
            with_bad(M::Map(vec![(s("block_hashes"), M::A(vec![]))])),
            Expect::Event(D::MissingEventType),
        ),
        case(
            "an empty array event",
            with_bad(M::A(vec![])),
            Expect::Event(D::MissingEventType),
        ),
        case(
            "an integer type",
            with_bad(M::Map(vec![(s("type"), M::U(1))])),
            Expect::Event(D::InvalidEventType),
        ),
        case(
            "a non-UTF-8 type",
            with_bad(M::A(vec![M::RawStr(vec![0xff, 0xfe])])),
            Expect::Event(D::InvalidEventType),
        ),
        case(
            "an unknown type",
            with_bad(M::A(vec![s("BlockMoved"), M::A(vec![])])),
            Expect::Event(D::UnknownEventType),
        ),
        ev(
            "missing block_hashes",
            &[("block_hashes", None)],
            D::InvalidBlockHashes,
        ),
        ev(
            "nil block_hashes",
            &[("block_hashes", Some(M::Nil))],
            D::InvalidBlockHashes,
        ),
        ev(
            "a string block_hashes",
            &[("block_hashes", Some(s("12")))],
            D::InvalidBlockHashes,
        ),
        ev(
            "a float hash",
            &[("block_hashes", Some(M::A(vec![M::F(1.5)])))],
            D::InvalidBlockHashes,
        ),
        ev(
            "a bool hash",
            &[("block_hashes", Some(M::A(vec![M::B(true)])))],
            D::InvalidBlockHashes,
        ),
        ev(
            "a nil hash",
            &[("block_hashes", Some(M::A(vec![M::Nil])))],
            D::InvalidBlockHashes,
        ),
        ev(
            "an empty bytes hash",
            &[("block_hashes", Some(M::A(vec![M::Bin(vec![])])))],
            D::InvalidBlockHashes,
        ),
        ev(
            "a 65-byte hash",
            &[("block_hashes", Some(M::A(vec![M::Bin(vec![1; 65])])))],
            D::InvalidBlockHashes,
        ),
        ev(
            "a string parent",
            &[("parent_block_hash", Some(s("abc")))],
            D::InvalidParentBlockHash,
        ),
        ev(
            "a bool parent",
            &[("parent_block_hash", Some(M::B(false)))],
            D::InvalidParentBlockHash,
        ),
        ev(
            "nil token_ids",
            &[("token_ids", Some(M::Nil))],
            D::InvalidTokenIds,
        ),
        ev(
            "missing token_ids",
            &[("token_ids", None)],
            D::InvalidTokenIds,
        ),
        ev(
            "a negative token id",
            &[("token_ids", Some(M::A(vec![M::I(-1)])))],
            D::InvalidTokenIds,
        ),
        ev(
            "a token id of 2^32",
            &[("token_ids", Some(M::A(vec![M::U(big)])))],
            D::InvalidTokenIds,
        ),
        ev(
            "a zero block_size",
            &[("block_size", Some(M::U(0)))],
            D::InvalidBlockSize,
        ),
        ev(
            "a bool block_size",
            &[("block_size", Some(M::B(true)))],
            D::InvalidBlockSize,
        ),
        ev(
            "a block_size of 2^32",
            &[("block_size", Some(M::U(big)))],
            D::InvalidBlockSize,
        ),
        ev(
            "missing block_size",
            &[("block_size", None)],
            D::InvalidBlockSize,
        ),
        ev(
            "an integer medium",
            &[("medium", Some(M::U(5)))],
            D::InvalidMedium,
        ),
        ev(
            "a non-UTF-8 medium",
            &[("medium", Some(M::RawStr(vec![b'G', 0xff])))],
            D::InvalidMedium,
        ),
        ev(
            "a bool group_idx",
            &[("group_idx", Some(M::B(true)))],
            D::InvalidGroupIdx,
        ),
        ev(
            "a negative group_idx",
            &[("group_idx", Some(M::I(-1)))],
            D::InvalidGroupIdx,
        ),
        ev(
            "a group_idx of 2^32",
            &[("group_idx", Some(M::U(big)))],
            D::InvalidGroupIdx,
        ),
        ev(
            "a float group_idx",
            &[("group_idx", Some(M::F(1.0)))],
            D::InvalidGroupIdx,
        ),
        ev(
            "a string group_idx",
            &[("group_idx", Some(s("0")))],
            D::InvalidGroupIdx,
        ),
        ev(
            "an empty kind",
            &[("kv_cache_spec_kind", Some(s("")))],
            D::InvalidKvCacheSpecKind,
        ),
        ev(
            "an integer kind",
            &[("kv_cache_spec_kind", Some(M::U(3)))],
            D::InvalidKvCacheSpecKind,
        ),
        ev(
            "a non-UTF-8 kind",
            &[("kv_cache_spec_kind", Some(M::RawStr(vec![0xc3, 0x28])))],
            D::InvalidKvCacheSpecKind,
        ),
        ev(
            "a zero window",
            &[("kv_cache_spec_sliding_window", Some(M::U(0)))],
            D::InvalidKvCacheSpecSlidingWindow,
        ),
        ev(
            "a bool window",
            &[("kv_cache_spec_sliding_window", Some(M::B(true)))],
            D::InvalidKvCacheSpecSlidingWindow,
        ),
        ev(
            "a negative window",
            &[("kv_cache_spec_sliding_window", Some(M::I(-64)))],
            D::InvalidKvCacheSpecSlidingWindow,
        ),
        ev(
            "a window of 2^32",
            &[("kv_cache_spec_sliding_window", Some(M::U(big)))],
            D::InvalidKvCacheSpecSlidingWindow,
        ),
        ev(
            "a sliding kind with a nil window",
            &[("kv_cache_spec_sliding_window", Some(M::Nil))],
            D::MissingKvCacheSpecSlidingWindow,
        ),
        ev(
            "a bad window even without a group",
            &[
                ("group_idx", None),
                ("kv_cache_spec_sliding_window", Some(M::S("64".into()))),
            ],
            D::InvalidKvCacheSpecSlidingWindow,
        ),
        case(
            "a removal with a bool group_idx",
            with_bad(map_event(
                vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", M::A(vec![M::U(1)])),
                ],
                &[("group_idx", Some(M::B(false)))],
            )),
            Expect::Event(D::InvalidGroupIdx),
        ),
        case(
            "a removal with nil block_hashes",
            with_bad(map_event(
                vec![("type", s("BlockRemoved")), ("block_hashes", M::Nil)],
                &[],
            )),
            Expect::Event(D::InvalidBlockHashes),
        ),
        case(
            "an array store with a bad group at position 9",
            with_bad(M::A(vec![
                s("BlockStored"),
                M::A(vec![M::U(1)]),
                M::Nil,
                M::A(vec![M::U(1)]),
                M::U(1),
                M::Nil,
                s("GPU"),
                M::Nil,
                M::Nil,
                M::I(-2),
            ])),
            Expect::Event(D::InvalidGroupIdx),
        ),
        case(
            "an array store cut before token_ids",
            with_bad(M::A(vec![s("BlockStored"), M::A(vec![M::U(1)]), M::Nil])),
            Expect::Event(D::InvalidTokenIds),
        ),
        Case {
            limits: Limits {
                max_hashes_per_event: 1,
                ..Limits::default()
            },
            ..ev("more hashes than the limit", &[], D::TooManyBlockHashes)
        },
        Case {
            limits: Limits {
                max_tokens_per_event: 5,
                ..Limits::default()
            },
            ..case(
                "more token ids than the limit",
                with_bad(map_event(stored_fields(&[5, 6], 1), &[])),
                Expect::Event(D::TooManyTokenIds),
            )
        },
        Case {
            limits: Limits {
                max_hashes_per_batch: 2,
                ..Limits::default()
            },
            ..case(
                "a batch past its hash budget",
                batch(
                    vec![good_stored(&[1, 2]), good_stored(&[3]), good_stored(&[])],
                    0,
                ),
                Expect::Event(D::BatchHashBudgetExceeded),
            )
        },
        // Single fields.
        field(
            "a string lora_id",
            &[("lora_id", Some(s("x")))],
            D::InvalidLoraId,
        ),
        field(
            "a lora_id past i64",
            &[("lora_id", Some(M::U(u64::MAX)))],
            D::InvalidLoraId,
        ),
        field(
            "an integer lora_name",
            &[("lora_name", Some(M::U(7)))],
            D::InvalidLoraName,
        ),
        field(
            "a non-UTF-8 lora_name",
            &[("lora_name", Some(M::RawStr(vec![0x80])))],
            D::InvalidLoraName,
        ),
        field(
            "extra_keys of the wrong length",
            &[("extra_keys", Some(M::A(vec![M::Nil])))],
            D::InvalidExtraKeys,
        ),
        field(
            "a map inside extra_keys",
            &[("extra_keys", Some(M::A(vec![M::Nil, M::Map(vec![])])))],
            D::InvalidExtraKeys,
        ),
        field(
            "a string extra_keys",
            &[("extra_keys", Some(s("salt")))],
            D::InvalidExtraKeys,
        ),
        field(
            "extra_keys nested too deep",
            &[("extra_keys", Some(M::A(vec![M::Nil, nested(12)])))],
            D::InvalidExtraKeys,
        ),
        field(
            "an integer locality",
            &[("locality", Some(M::U(5)))],
            D::InvalidLocality,
        ),
        field(
            "a list ownership",
            &[("ownership", Some(M::A(vec![M::U(1)])))],
            D::InvalidOwnership,
        ),
        field(
            "a float session_id",
            &[("session_id", Some(M::F(1.5)))],
            D::InvalidSessionId,
        ),
        field(
            "lookahead_token_ids of the wrong length",
            &[("lookahead_token_ids", Some(M::A(vec![M::A(vec![M::U(1)])])))],
            D::InvalidLookaheadTokenIds,
        ),
        field(
            "a string lookahead_token_ids",
            &[("lookahead_token_ids", Some(s("7")))],
            D::InvalidLookaheadTokenIds,
        ),
        field(
            "a bare token as a lookahead_token_ids entry",
            &[(
                "lookahead_token_ids",
                Some(M::A(vec![M::A(vec![M::U(1)]), M::U(2)])),
            )],
            D::InvalidLookaheadTokenIds,
        ),
        field(
            "an empty lookahead_token_ids entry",
            &[(
                "lookahead_token_ids",
                Some(M::A(vec![M::A(vec![]), M::A(vec![])])),
            )],
            D::InvalidLookaheadTokenIds,
        ),
        field(
            "lookahead_token_ids entries of different lengths",
            &[(
                "lookahead_token_ids",
                Some(M::A(vec![
                    M::A(vec![M::U(1)]),
                    M::A(vec![M::U(2), M::U(3)]),
                ])),
            )],
            D::InvalidLookaheadTokenIds,
        ),
        field(
            "a lookahead token past 2^32",
            &[(
                "lookahead_token_ids",
                Some(M::A(vec![M::A(vec![M::U(1)]), M::A(vec![M::U(big)])])),
            )],
            D::InvalidLookaheadTokenIds,
        ),
        field(
            "a negative lookahead token",
            &[(
                "lookahead_token_ids",
                Some(M::A(vec![M::A(vec![M::U(1)]), M::A(vec![M::I(-1)])])),
            )],
            D::InvalidLookaheadTokenIds,
        ),
        Case {
            limits: Limits {
                max_tokens_per_event: 9,
                ..Limits::default()
            },
            ..field(
                "more lookahead tokens than the token limit",
                &[(
                    "lookahead_token_ids",
                    Some(M::A(vec![
                        M::A((0..5).map(M::U).collect()),
                        M::A((0..5).map(M::U).collect()),
                    ])),
                )],
                D::InvalidLookaheadTokenIds,
            )
        },
        case(
            "a string ts",
            M::A(vec![
                s("now"),
                M::A(vec![good_stored(&[1]), good_stored(&[2])]),
                M::U(0),
            ])
            .encode(),
            Expect::Field(D::InvalidTs),
        ),
        Case {
            dialect: Dialect::Sglang,
            ..field(
                "an integer SGLang cache_salt",
                &[("cache_salt", Some(M::U(5)))],
                D::InvalidCacheSalt,
            )
        },
    ];
    // Keep the table honest about its size.
    v.shrink_to_fit();
    v
}

#[test]
fn every_malformed_case_is_refused_with_its_exact_reason_and_cost() {
    let worker: WorkerId = "w".into();
    let table = cases();
    assert!(table.len() >= 40, "{} cases", table.len());
    for c in &table {
        let got = decode_batch_with(&worker, &c.payload, c.dialect, &c.limits);
        match (&c.expect, got) {
            (Expect::Batch(reason), Err(e)) => assert_eq!(e.reason, *reason, "{}: {e}", c.name),
            (Expect::Event(reason), Ok(b)) => {
                assert_eq!(b.drops.len(), 1, "{}: {:?}", c.name, b.drops);
                assert_eq!(b.drops[0].reason, *reason, "{}: {:?}", c.name, b.drops);
                assert_eq!(reason.cost(), Cost::Event, "{}", c.name);
                let total = if *reason == D::BatchHashBudgetExceeded {
                    2
                } else {
                    1
                };
                assert_eq!(b.events.len(), total, "{}: the good event survives", c.name);
            }
            (Expect::Field(reason), Ok(b)) => {
                assert_eq!(b.drops.len(), 1, "{}: {:?}", c.name, b.drops);
                assert_eq!(b.drops[0].reason, *reason, "{}: {:?}", c.name, b.drops);
                assert_eq!(reason.cost(), Cost::Field, "{}", c.name);
                assert_eq!(
                    b.events.len(),
                    2,
                    "{}: a field drop keeps the event",
                    c.name
                );
            }
            (_, other) => panic!("{}: unexpected {other:?}", c.name),
        }
        let next = decode_batch_with(&worker, &good_batch(), c.dialect, &Limits::default())
            .unwrap_or_else(|e| panic!("after {}: {e}", c.name));
        assert_eq!(next.events.len(), 2, "after {}", c.name);
        assert!(next.drops.is_empty(), "after {}", c.name);
    }
}

#[test]
fn messages_with_the_wrong_frames_cost_only_that_message() {
    let worker: WorkerId = "w".into();
    let good = good_batch();
    let seq = 3u64.to_be_bytes();
    let bad: Vec<(Vec<&[u8]>, &str)> = vec![
        (vec![], "wrong_frame_count"),
        (vec![b"kv"], "wrong_frame_count"),
        (vec![b"kv", &seq], "wrong_frame_count"),
        (vec![b"kv", &seq, &good, b""], "wrong_frame_count"),
        (vec![b"kv", &seq[..7], &good], "invalid_seq"),
        (vec![b"kv", b"", &good], "invalid_seq"),
        (vec![b"kv", &seq, b"\x91"], "undecodable_batch"),
    ];
    for (frames, name) in bad {
        let err = decode_message(&worker, &frames).expect_err(name);
        assert_eq!(err.name(), name, "{err}");
        if let FrameError::Batch { seq, topic, .. } = &err {
            assert_eq!(
                (*seq, topic.as_slice()),
                (3, &b"kv"[..]),
                "the lost batch is still located"
            );
        }
        let (topic, s, b) = decode_message(&worker, &[b"kv", &seq, &good]).expect("next message");
        assert_eq!((topic.as_slice(), s, b.events.len()), (&b"kv"[..], 3, 2));
    }
}
