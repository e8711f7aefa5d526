//! The snapshot's tests: capture and load round trips, the checksum and fingerprints, every
//! refusal reason, and matching a snapshot to the configured workers.

use super::*;
use kvroute_index::image::BlockRun;

fn image() -> RankImage {
    RankImage {
        groups: vec![
            GroupImage {
                group: 0,
                kind: "full_attention".into(),
                sliding_window: None,
                block_size: 16,
                partial_size: None,
                runs: vec![BlockRun {
                    copies: 2,
                    hashes: vec![u64::MAX, 7, 1 << 63],
                }],
                content: vec![],
            },
            GroupImage {
                group: 1,
                kind: "sliding_window".into(),
                sliding_window: Some(64),
                block_size: 16,
                partial_size: Some(8),
                runs: vec![BlockRun {
                    copies: 1,
                    hashes: vec![3],
                }],
                content: vec![(9, 10, 1)],
            },
        ],
        offload: vec![TierImage {
            medium: "CPU".into(),
            group: 1,
            blocks: vec![(5, 3)],
        }],
    }
}

fn spec(name: &str) -> WorkerSpec {
    WorkerSpec::new(name, "http://127.0.0.1:9", "m")
}

/// A snapshot of worker `w0` with one rank, as its file text.
fn text() -> String {
    let body = Body {
        workers: vec![WorkerEntry {
            name: "w0".into(),
            fingerprint: fingerprint(&spec("w0")),
            ranks: vec![rank_entry(
                0,
                StreamPosition {
                    seq: 41,
                    digest: 0xfeed,
                },
                &image(),
            )],
        }],
    };
    sealed(body)
}

/// A body as a file with its header and checksum.
fn sealed(body: Body) -> String {
    let file = File {
        format: FORMAT.into(),
        version: VERSION,
        written_unix_ms: 1,
        checksum: checksum(&body).expect("encodes"),
        body,
    };
    toml::to_string(&file).expect("encodes")
}

#[test]
fn a_written_snapshot_reads_back_as_the_same_images_and_positions() {
    let loaded = parse(&text()).expect("a good snapshot loads");
    let (fp, ranks) = &loaded.workers["w0"];
    assert_eq!(fp, &fingerprint(&spec("w0")));
    let (at, img) = &ranks[&0];
    assert_eq!(
        *at,
        StreamPosition {
            seq: 41,
            digest: 0xfeed
        }
    );
    assert_eq!(img, &image());
}

#[test]
fn a_file_is_written_atomically_and_loads_back() {
    let dir = std::env::temp_dir().join(format!("kvroute-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("index.toml");
    let registry = Registry::new(std::sync::Arc::new(kvroute_index::Index::new()));
    let w = write(&path, capture(&registry)).expect("writes");
    assert_eq!((w.ranks, w.ranks_skipped), (0, 0));
    assert!(load(&path).expect("loads").is_some());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp."))
        .collect();
    assert!(leftovers.is_empty(), "no temporary file is left behind");
    assert!(load(&dir.join("absent.toml")).expect("absent").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_corrupt_snapshot_is_refused_with_its_reason() {
    let good = text();
    let truncated = &good[..good.len() / 2];
    let flipped = good.replacen("ffffffffffffffff", "fffffffffffffffe", 1);
    let bad_hex = good.replacen("ffffffffffffffff", "fffffffffffffffz", 1);
    let cases: Vec<(&str, String, &str)> = vec![
        ("empty", String::new(), "not a kvroute snapshot"),
        ("truncated", truncated.to_string(), ""),
        (
            "not toml",
            "\u{0}\u{1}garbage[[".into(),
            "truncated or not TOML",
        ),
        (
            "foreign format",
            good.replacen(FORMAT, "other-tool", 1),
            "not a kvroute snapshot",
        ),
        (
            "foreign version",
            good.replacen("version = 1", "version = 99", 1),
            "version 99",
        ),
        ("a flipped hash", flipped, "checksum mismatch"),
        ("a non-hex hash", bad_hex, "checksum mismatch"),
    ];
    for (what, text, says) in cases {
        let err = match parse(&text) {
            Ok(_) => panic!("{what}: loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(says), "{what}: {err}");
    }
}

#[test]
fn malformed_fields_are_refused_even_with_a_matching_checksum() {
    let mut body = Body {
        workers: vec![WorkerEntry {
            name: "w0".into(),
            fingerprint: "x".into(),
            ranks: vec![rank_entry(
                0,
                StreamPosition { seq: 1, digest: 2 },
                &image(),
            )],
        }],
    };
    body.workers[0].ranks[0].groups[0].runs[0].hashes.push('a');
    let err = parse(&sealed(body))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("not records of 16 hex digits"), "{err}");
    let mut big = image();
    big.groups[0].runs[0].copies = u32::MAX;
    let body = Body {
        workers: vec![WorkerEntry {
            name: "w0".into(),
            fingerprint: "x".into(),
            ranks: vec![rank_entry(0, StreamPosition { seq: 1, digest: 2 }, &big)],
        }],
    };
    let err = parse(&sealed(body))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("copies"), "{err}");
}

#[test]
fn another_fleet_s_snapshot_is_refused_a_changed_worker_starts_empty_and_discovered_ones_claim_theirs(
) {
    let loaded = parse(&text()).expect("loads");
    let err = match_workers(loaded, &[spec("other")], false).err();
    assert!(matches!(err, Some(SnapshotError::OtherFleet(_))), "{err:?}");
    let loaded = parse(&text()).expect("loads");
    let mut moved = spec("w0");
    moved.url = "http://127.0.0.1:10".into();
    let plan = match_workers(loaded, &[moved], false).expect("same fleet");
    assert!(plan.resume.is_empty());
    assert_eq!(plan.matched.changed, vec!["w0".to_string()]);
    let loaded = parse(&text()).expect("loads");
    let plan = match_workers(loaded, &[spec("w0"), spec("w1")], false).expect("matches");
    let m = &plan.matched;
    assert_eq!((plan.resume.len(), m.ranks, m.resumed.len()), (1, 1, 1));
    // With discovery, an unclaimed entry waits for the discovered worker of its name.
    let loaded = parse(&text()).expect("loads");
    let plan = match_workers(loaded, &[], true).expect("discovered fleets may match later");
    let unclaimed = Unclaimed::new(plan.unclaimed);
    let mut moved = spec("w0");
    moved.url = "http://127.0.0.1:10".into();
    assert!(unclaimed.take(&spec("w9")).is_empty());
    assert_eq!(unclaimed.take(&spec("w0")).len(), 1);
    assert!(unclaimed.take(&spec("w0")).is_empty(), "taken once");
    let loaded = parse(&text()).expect("loads");
    let unclaimed = Unclaimed::new(match_workers(loaded, &[], true).expect("ok").unclaimed);
    assert!(
        unclaimed.take(&moved).is_empty(),
        "another fingerprint starts empty"
    );
}
