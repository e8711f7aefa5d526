//! Hand-checked cases of each kind's reuse rule and the joint prediction.

mod common;
use common::*;
use kvroute_index::{Index, Query};

fn predict(idx: &Index, worker: &str, toks: &[u32]) -> u64 {
    idx.predict(
        &worker.into(),
        0,
        &Query {
            tokens: toks.to_vec(),
            ..Query::default()
        },
    )
    .cached
}

#[test]
fn full_attention_hit_stops_at_the_first_missing_block() {
    let idx = Index::new();
    let t = tokens(1, 100);
    let c = chain(&t, 16);
    idx.apply(&store(
        "w",
        0,
        "full_attention",
        None,
        16,
        &[c[0], c[1], c[3]],
    ));
    assert_eq!(predict(&idx, "w", &t), 32);
}

#[test]
fn the_last_prompt_token_is_always_recomputed() {
    let idx = Index::new();
    let t = tokens(1, 64);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    assert_eq!(predict(&idx, "w", &t), 48);
    assert_eq!(predict(&idx, "w", &t[..49]), 48);
}

#[test]
fn window_group_hit_needs_only_the_last_window() {
    // full attention + window 48 at block 16: c = ceil(47/16) = 3 blocks below the hit.
    let idx = Index::new();
    let t = tokens(2, 210);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 9..12),
    ));
    assert_eq!(predict(&idx, "w", &t), 192);
    assert_eq!(
        predict(&idx, "w", &t[..150]),
        0,
        "the window before 144 is not cached"
    );
}

#[test]
fn a_junction_checkpoint_makes_the_shared_prefix_reusable() {
    // The spec's 0.32 observation: a second prompt sharing 150 tokens hits 0 and stores a
    // junction at 144 (blocks 6..9 of the window group); a third such prompt then hits 144.
    let idx = Index::new();
    let first = tokens(3, 210);
    let c = chain(&first, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 10..13),
    ));
    let mut second = first[..150].to_vec();
    second.extend(tokens(99, 60));
    assert_eq!(predict(&idx, "w", &second), 0);
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 6..9),
    ));
    let mut third = first[..150].to_vec();
    third.extend(tokens(77, 60));
    assert_eq!(predict(&idx, "w", &third), 144);
}

#[test]
fn a_mamba_group_counts_only_its_right_most_state() {
    let idx = Index::new();
    let t = tokens(4, 300);
    let c = chain(&t, 64);
    idx.apply(&store("w", 0, "mamba", None, 64, &[c[1]]));
    idx.apply(&store("w", 1, "full_attention", None, 64, &c));
    assert_eq!(
        predict(&idx, "w", &t),
        128,
        "state at 128 only; full attention alone says 256"
    );
    let p = idx.predict(
        &"w".into(),
        0,
        &Query {
            tokens: t.clone(),
            ..Query::default()
        },
    );
    assert_eq!(p.group_blind, 256);
}

#[test]
fn a_worker_that_lost_its_mamba_state_is_cold() {
    let idx = Index::new();
    let t = tokens(5, 300);
    let c = chain(&t, 64);
    idx.apply(&store("w", 0, "mamba", None, 64, &[c[3]]));
    idx.apply(&store("w", 1, "full_attention", None, 64, &c));
    assert_eq!(predict(&idx, "w", &t), 256);
    idx.apply(&remove("w", 0, &[c[3]]));
    assert_eq!(predict(&idx, "w", &t), 0);
}

#[test]
fn groups_of_the_same_kind_must_all_hold_a_block() {
    let idx = Index::new();
    let t = tokens(6, 200);
    let c = chain(&t, 32);
    idx.apply(&store("w", 3, "full_attention", None, 32, &c));
    idx.apply(&store("w", 0, "sliding_window", Some(64), 32, &c[2..5]));
    idx.apply(&store("w", 1, "sliding_window", Some(64), 32, &c[2..5]));
    idx.apply(&store("w", 2, "sliding_window", Some(64), 32, &c[2..4]));
    // c = ceil(63/32) = 2 blocks: at 160 block 3 and 4 needed, group 2 lacks block 4.
    assert_eq!(predict(&idx, "w", &t), 128);
}

#[test]
fn chunked_local_attention_skips_blocks_before_the_current_chunk() {
    let idx = Index::new();
    idx.configure_worker(
        &"w".into(),
        kvroute_index::WorkerConfig {
            lookup: kvroute_index::LookupConfig {
                hash_block_size: None,
                chunk_size: Some(64),
                eagle: false,
                offload_chunk_blocks: None,
                offload_connector: Default::default(),
                drafter_groups_unflagged: false,
            },
            ..Default::default()
        },
    );
    let t = tokens(7, 200);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    idx.apply(&store(
        "w",
        1,
        "chunked_local_attention",
        None,
        16,
        &c[8..10],
    ));
    // n − 1 = 199 → L = 192, the start of a chunk: nothing of the chunk is needed yet, and
    // every block before the chunk start counts without lookup.
    assert_eq!(predict(&idx, "w", &t), 192);
    assert_eq!(
        predict(&idx, "w", &t[..170]),
        160,
        "chunk 128..: blocks 8, 9 present, 10 not"
    );
}

#[test]
fn a_cleared_worker_predicts_nothing_but_keeps_its_layout() {
    let idx = Index::new();
    let t = tokens(8, 100);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    idx.apply(&kvroute_index::event::Event::Cleared(
        kvroute_index::event::Cleared {
            worker: "w".into(),
            dp_rank: 0,
        },
    ));
    assert_eq!(predict(&idx, "w", &t), 0);
    assert!(
        idx.inspect(&"w".into(), 0, |r| r.layout.groups.len())
            .unwrap()
            == 1
    );
}

#[test]
fn a_request_that_skips_the_prefix_cache_hits_nothing() {
    let idx = Index::new();
    let t = tokens(9, 100);
    idx.apply(&store("w", 0, "full_attention", None, 16, &chain(&t, 16)));
    let q = Query {
        tokens: t,
        skip_prefix_cache: true,
        ..Query::default()
    };
    assert_eq!(idx.predict(&"w".into(), 0, &q).cached, 0);
}

#[test]
fn a_removal_for_a_group_never_stored_is_counted_and_ignored() {
    let idx = Index::new();
    let t = tokens(10, 100);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    idx.apply(&remove("w", 5, &c));
    assert_eq!(
        idx.counters()
            .get(kvroute_index::counters::Counter::RemovedUnknownGroup),
        1
    );
    assert_eq!(predict(&idx, "w", &t), 96);
}

#[test]
fn a_cpu_tier_extends_the_device_hit_from_its_first_chunk_to_its_first_gap() {
    let idx = Index::new();
    let t = tokens(11, 100);
    let c = chain(&t, 16);
    let on_cpu = |hashes: &[u64]| {
        let mut ev = store("w", 0, "full_attention", None, 16, hashes);
        if let kvroute_index::event::Event::Stored(s) = &mut ev {
            s.medium = Some("CPU".into());
            s.block_size = 0;
            s.token_ids.clear();
        }
        ev
    };
    // No device layout yet: nothing can be predicted from a tier alone.
    idx.apply(&on_cpu(&c));
    assert_eq!(predict(&idx, "w", &t), 0);
    let tiers = idx.inspect(&"w".into(), 0, |r| r.offload_blocks()).unwrap();
    assert_eq!(tiers.get("CPU"), Some(&(c.len() as u64)));
    // The device holds 3 blocks; the tier all 6 full ones: the engine reports 96 (the
    // connector has no last-token rule for full attention: 96 of 100 are whole chunks).
    idx.apply(&store("w", 0, "full_attention", None, 16, &c[..3]));
    let p = idx.predict(
        &"w".into(),
        0,
        &Query {
            tokens: t.clone(),
            ..Query::default()
        },
    );
    assert_eq!(
        (p.cached, p.tier, p.tier_medium.as_deref()),
        (96, 48, Some("CPU"))
    );
    // A gap at the device hit's next chunk ends the tier's hit there.
    let mut rm = remove("w", 0, &c[3..4]);
    if let kvroute_index::event::Event::Removed(r) = &mut rm {
        r.medium = Some("CPU".into());
    }
    idx.apply(&rm);
    assert_eq!(predict(&idx, "w", &t), 48);
}

fn simple_cpu_worker(idx: &Index, worker: &str) {
    let cfg = kvroute_index::WorkerConfig {
        lookup: kvroute_index::LookupConfig {
            offload_connector: kvroute_index::tier::OffloadConnector::SimpleCpu,
            ..Default::default()
        },
        ..Default::default()
    };
    idx.configure_worker(&worker.into(), cfg);
}

fn on_cpu(
    group: u32,
    kind: &str,
    window: Option<u32>,
    hashes: &[u64],
) -> kvroute_index::event::Event {
    let mut ev = store("w", group, kind, window, 16, hashes);
    if let kvroute_index::event::Event::Stored(s) = &mut ev {
        s.medium = Some("CPU".into());
    }
    ev
}

#[test]
fn a_simple_cpu_tier_keeps_the_last_token_rule_and_never_serves_a_whole_prompt() {
    let idx = Index::new();
    simple_cpu_worker(&idx, "w");
    let t = tokens(12, 96);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c[..2]));
    idx.apply(&on_cpu(0, "full_attention", None, &c));
    // The connector looks up at most n − 1 − 32 = 63 tokens: three blocks, not four (the
    // `OffloadingConnector` would serve all 96).
    let p = idx.predict(
        &"w".into(),
        0,
        &Query {
            tokens: t.clone(),
            ..Query::default()
        },
    );
    assert_eq!((p.cached, p.tier), (80, 48));
    // One token more, and the last block is served too.
    let mut longer = t.clone();
    longer.push(7);
    assert_eq!(predict(&idx, "w", &longer), 96);
}

#[test]
fn a_simple_cpu_tier_applies_the_window_rule_to_the_blocks_after_the_device_hit() {
    // Full attention + a 32-token window at block 16: a window hit needs ⌈31/16⌉ = 2 blocks.
    let idx = Index::new();
    simple_cpu_worker(&idx, "w");
    let t = tokens(13, 161);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c[..2]));
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(32),
        16,
        &group_blocks(&c, 1, 0..2),
    ));
    // The tier holds every full-attention block, and window blocks 5 and 7..9 only.
    idx.apply(&on_cpu(0, "full_attention", None, &c));
    idx.apply(&on_cpu(
        1,
        "sliding_window",
        Some(32),
        &group_blocks(&c, 1, [5, 7, 8, 9]),
    ));
    // From the device hit (32) the window's rightmost two-block run ends at block 9: 160.
    assert_eq!(predict(&idx, "w", &t), 160);
    // Without block 8, no two-block run is left on the tier, and none reaches back to the
    // device hit (blocks 2 to 4 are missing): the tier serves nothing.
    let mut rm = remove("w", 1, &group_blocks(&c, 1, [8]));
    if let kvroute_index::event::Event::Removed(r) = &mut rm {
        r.medium = Some("CPU".into());
    }
    idx.apply(&rm);
    assert_eq!(predict(&idx, "w", &t), 32);
}

#[test]
fn a_tier_that_never_removes_is_emptied_at_its_bound_and_counted() {
    let idx = Index::new();
    let limit = kvroute_index::rank::MAX_TIER_KEYS as u64;
    // A connector publishing stores only (LMCache's in-process one): keys of its own, no group.
    let batch = |from: u64, n: u64| {
        let mut ev = store("w", 0, "full_attention", None, 256, &[]);
        if let kvroute_index::event::Event::Stored(s) = &mut ev {
            s.medium = Some("cpu".into());
            s.group = None;
            s.kind = None;
            s.hashes = (from..from + n)
                .map(kvroute_index::event::EngineHash::int)
                .collect();
        }
        ev
    };
    idx.apply(&batch(0, limit));
    let held = |idx: &Index| {
        idx.inspect(&"w".into(), 0, |r| r.offload_blocks())
            .and_then(|t| t.get("cpu").copied())
    };
    assert_eq!(held(&idx), Some(limit));
    idx.apply(&batch(limit, 1));
    assert_eq!(held(&idx).unwrap_or(0), 0);
    let overflow = idx
        .counters()
        .snapshot()
        .into_iter()
        .find(|(name, _)| *name == "offload_overflow")
        .map(|(_, v)| v);
    assert_eq!(overflow, Some(1));
}

#[test]
fn a_kind_change_clears_the_rank_and_is_counted() {
    let idx = Index::new();
    let t = tokens(12, 100);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    idx.apply(&store("w", 0, "mamba", None, 16, &[c[1]]));
    assert_eq!(
        idx.counters()
            .get(kvroute_index::counters::Counter::LayoutChanges),
        1
    );
    assert_eq!(predict(&idx, "w", &t), 32);
}

fn eagle_worker(idx: &Index, worker: &str) {
    idx.configure_worker(
        &worker.into(),
        kvroute_index::WorkerConfig {
            lookup: kvroute_index::LookupConfig {
                hash_block_size: None,
                chunk_size: None,
                eagle: true,
                offload_chunk_blocks: None,
                offload_connector: Default::default(),
                drafter_groups_unflagged: false,
            },
            ..Default::default()
        },
    );
}

#[test]
fn with_eagle_full_attention_drops_its_last_matched_block() {
    let idx = Index::new();
    eagle_worker(&idx, "w");
    let t = tokens(20, 100);
    idx.apply(&store("w", 0, "full_attention", None, 16, &chain(&t, 16)));
    // n − 1 = 99: six blocks (96 tokens) match, one is dropped for the draft head.
    assert_eq!(predict(&idx, "w", &t), 80);
}

#[test]
fn with_eagle_a_window_group_needs_one_more_block_and_drops_it() {
    let idx = Index::new();
    eagle_worker(&idx, "w");
    let t = tokens(21, 210);
    let c = chain(&t, 16);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    // Window 48 at block 16: c = 3, and 4 with EAGLE. Blocks 10..12 alone are not enough.
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 10..13),
    ));
    assert_eq!(predict(&idx, "w", &t), 0);
    // With block 9 too, the run 9..12 matches one block past 192 and drops back to 192.
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 9..10),
    ));
    assert_eq!(predict(&idx, "w", &t), 192);
    // Without EAGLE the same cache serves 208.
    let plain = Index::new();
    plain.apply(&store("w", 0, "full_attention", None, 16, &c));
    plain.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 9..13),
    ));
    assert_eq!(predict(&plain, "w", &t), 208);
}

/// A vLLM 0.33 worker with EAGLE-style speculation and `lookahead` lookahead tokens.
fn v033_worker(idx: &Index, worker: &str, lookahead: u32) {
    idx.configure_worker(
        &worker.into(),
        kvroute_index::WorkerConfig {
            lookup: kvroute_index::LookupConfig {
                eagle: true,
                ..Default::default()
            },
            engine: kvroute_index::Engine::Vllm033,
            hash_lookahead_tokens: lookahead,
            ..Default::default()
        },
    );
}

#[test]
fn with_lookahead_hashes_a_0_33_eagle_worker_drops_nothing() {
    let idx = Index::new();
    v033_worker(&idx, "w", 1);
    let t = tokens(20, 100);
    // The engine stores the blocks whose next token exists: all six of 96 < 100.
    let c = lookahead_chain(&t, 16, 1);
    assert_eq!(c.len(), 6);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    // n − 1 = 99: six blocks match and none is dropped (0.32 with EAGLE: 80).
    assert_eq!(predict(&idx, "w", &t), 96);
    // A block-aligned prompt: block 5 has no hash until token 97 exists.
    assert_eq!(predict(&idx, "w", &t[..96]), 80);
    // Another token after block 5 is another block 5.
    let mut other = t.clone();
    other[96] += 1;
    assert_eq!(predict(&idx, "w", &other), 80);
}

#[test]
fn with_three_lookahead_tokens_the_hit_ends_three_tokens_early() {
    let idx = Index::new();
    v033_worker(&idx, "w", 3);
    let t = tokens(22, 100);
    let c = lookahead_chain(&t, 16, 3);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    // floor((n − 3) / 16) · 16.
    assert_eq!(predict(&idx, "w", &t), 96);
    assert_eq!(predict(&idx, "w", &t[..99]), 96);
    assert_eq!(predict(&idx, "w", &t[..98]), 80);
    // The request is hashed with lookahead: plain hashes of the same tokens never match.
    let plain = Index::new();
    v033_worker(&plain, "w", 3);
    plain.apply(&store("w", 0, "full_attention", None, 16, &chain(&t, 16)));
    assert_eq!(predict(&plain, "w", &t), 0);
}

#[test]
fn a_0_33_worker_without_lookahead_and_a_0_32_worker_follow_0_32_s_drop() {
    let t = tokens(23, 100);
    let c = chain(&t, 16);
    for (engine, lookahead) in [
        (kvroute_index::Engine::Vllm033, 0),
        // On 0.32 a lookahead count is ignored.
        (kvroute_index::Engine::Vllm032, 1),
    ] {
        let idx = Index::new();
        idx.configure_worker(
            &"w".into(),
            kvroute_index::WorkerConfig {
                lookup: kvroute_index::LookupConfig {
                    eagle: true,
                    ..Default::default()
                },
                engine,
                hash_lookahead_tokens: lookahead,
                ..Default::default()
            },
        );
        idx.apply(&store("w", 0, "full_attention", None, 16, &c));
        assert_eq!(predict(&idx, "w", &t), 80, "{engine}");
    }
}

#[test]
fn a_0_33_hybrid_with_lookahead_applies_the_window_rule_without_the_extra_block() {
    let idx = Index::new();
    v033_worker(&idx, "w", 1);
    let t = tokens(21, 210);
    let c = lookahead_chain(&t, 16, 1);
    idx.apply(&store("w", 0, "full_attention", None, 16, &c));
    // Window 48 at block 16: c = 3 blocks below the hit, no fourth for EAGLE (0.32: 192).
    idx.apply(&store(
        "w",
        1,
        "sliding_window",
        Some(48),
        16,
        &group_blocks(&c, 1, 10..13),
    ));
    assert_eq!(predict(&idx, "w", &t), 208);
}

#[test]
fn a_store_whose_lookahead_differs_from_the_configuration_is_counted() {
    use kvroute_index::counters::Counter;
    use kvroute_index::{Event, Stored};
    let idx = Index::new();
    v033_worker(&idx, "w", 1);
    let t = tokens(24, 40);
    let c = lookahead_chain(&t, 16, 1);
    let mut s = Stored::device(
        "w",
        0,
        kvroute_index::CacheKind::FullAttention,
        None,
        16,
        &c,
    );
    s.token_ids = t[..32].to_vec();
    s.lookahead_token_ids = Some(vec![vec![t[16]], vec![t[32]]]);
    idx.apply(&Event::Stored(s.clone()));
    let counts = idx.counters();
    assert_eq!(counts.get(Counter::LookaheadMismatch), 0);
    assert_eq!(counts.get(Counter::HashCheckMatched), 1);
    // The same engine seen by a router configured without lookahead.
    let plain = Index::new();
    plain.apply(&Event::Stored(s));
    assert_eq!(plain.counters().get(Counter::LookaheadMismatch), 1);
    assert_eq!(
        plain.counters().get(Counter::HashCheckMatched),
        1,
        "the hashes still verify"
    );
}
