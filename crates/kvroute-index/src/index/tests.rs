//! The index's tests: the eviction statistics (which group counts, a second copy, an offload
//! tier, a reset rank, a worker removed on its way) and predictions from a given hash chain.

use super::*;
use crate::event::{CacheKind, Stored};
use crate::hash::DEFAULT_SEED;

fn store(worker: &str, group: u32, kind: CacheKind, window: Option<u32>, hashes: &[u64]) -> Event {
    Event::Stored(Stored::device(worker, group, kind, window, 16, hashes))
}

#[test]
fn a_full_attention_block_stored_again_after_its_removal_counts_as_restored() {
    let index = tracking();
    let w: WorkerId = "w".into();
    index.apply(&store("w", 0, CacheKind::FullAttention, None, &[1, 2, 3]));
    index.apply(&store("w", 1, CacheKind::SlidingWindow, Some(64), &[1, 2]));
    index.apply(&Event::Removed(crate::event::Removed::device(
        "w",
        0,
        &[1, 2],
    )));
    index.apply(&Event::Removed(crate::event::Removed::device("w", 1, &[1])));
    // Block 2 again, and block 4 new; the window group's re-store is not counted.
    index.apply(&store("w", 0, CacheKind::FullAttention, None, &[2, 4]));
    index.apply(&store("w", 1, CacheKind::SlidingWindow, Some(64), &[1]));
    assert_eq!(index.eviction_stats(&w), stats(80, 16));
    // Restored once: storing it again after that is an ordinary store.
    index.apply(&store("w", 0, CacheKind::FullAttention, None, &[2]));
    assert_eq!(index.eviction_stats(&w), stats(96, 16));
    // A clear is no eviction: what follows it is not a re-prefill of evicted blocks.
    index.apply(&Event::Removed(crate::event::Removed::device("w", 0, &[3])));
    index.clear_rank(&w, 0);
    index.apply(&store("w", 0, CacheKind::FullAttention, None, &[3]));
    assert_eq!(index.eviction_stats(&w).tokens_restored, 16);
    assert_eq!(index.eviction_stats(&"other".into()), stats(0, 0));
}

/// An index that keeps the eviction figures.
fn tracking() -> Index {
    let index = Index::new();
    index.set_eviction_tracking(true);
    index
}

#[test]
fn an_index_not_tracking_evictions_counts_nothing_and_forgets_removals_when_stopped() {
    let removed_then_stored = [
        w_store(0, CacheKind::FullAttention, &[1, 2]),
        removal(0, &[1]),
        w_store(0, CacheKind::FullAttention, &[1]),
    ];
    assert_eq!(eviction_after(&removed_then_stored), stats(48, 16));
    let index = Index::new();
    assert!(!index.tracks_evictions());
    index.apply_all(&removed_then_stored);
    assert_eq!(index.eviction_stats(&"w".into()), stats(0, 0));
    // Started: the rank that already exists counts from now on.
    index.set_eviction_tracking(true);
    index.apply(&removal(0, &[2]));
    index.apply(&w_store(0, CacheKind::FullAttention, &[2]));
    assert_eq!(index.eviction_stats(&"w".into()), stats(16, 16));
    // Stopped: the removal seen while on is forgotten, the totals stay.
    index.apply(&removal(0, &[1]));
    index.set_eviction_tracking(false);
    assert_eq!(index.eviction_stats(&"w".into()), stats(16, 16));
    index.set_eviction_tracking(true);
    index.apply(&w_store(0, CacheKind::FullAttention, &[1]));
    assert_eq!(index.eviction_stats(&"w".into()), stats(32, 16));
}

fn stats(tokens_stored: u64, tokens_restored: u64) -> EvictionStats {
    EvictionStats {
        tokens_stored,
        tokens_restored,
    }
}

/// Worker "w"'s eviction figures after `events` on a fresh index.
fn eviction_after(events: &[Event]) -> EvictionStats {
    let index = tracking();
    for ev in events {
        index.apply(ev);
    }
    index.eviction_stats(&"w".into())
}

/// Worker "w" stores `hashes` in `group`, of `kind`, with 16-token blocks.
fn w_store(group: u32, kind: CacheKind, hashes: &[u64]) -> Event {
    store("w", group, kind, None, hashes)
}

fn removal(group: u32, hashes: &[u64]) -> Event {
    Event::Removed(crate::event::Removed::device("w", group, hashes))
}

#[test]
fn only_the_lowest_full_attention_group_counts_so_a_prefill_counts_once() {
    let fa = || CacheKind::FullAttention;
    let mut events = Vec::new();
    for group in [2, 5] {
        events.push(w_store(group, fa(), &[1, 2]));
        events.push(removal(group, &[1]));
        events.push(w_store(group, fa(), &[1]));
    }
    assert_eq!(eviction_after(&events), stats(48, 16));
}

#[test]
fn an_mla_group_is_the_eviction_group_of_a_model_without_plain_full_attention() {
    let mla = || CacheKind::MlaAttention;
    let events = [
        w_store(0, mla(), &[1]),
        removal(0, &[1]),
        w_store(0, mla(), &[1]),
    ];
    assert_eq!(eviction_after(&events), stats(32, 16));
}

#[test]
fn removing_one_of_two_copies_evicts_nothing() {
    let fa = || CacheKind::FullAttention;
    let events = [
        w_store(0, fa(), &[1]),
        w_store(0, fa(), &[1]),
        removal(0, &[1]),
        w_store(0, fa(), &[1]),
    ];
    assert_eq!(eviction_after(&events), stats(48, 0));
}

#[test]
fn a_block_an_offload_tier_holds_is_loaded_again_not_re_prefilled() {
    let fa = || CacheKind::FullAttention;
    let mut tier = Stored::device("w", 0, fa(), None, 16, &[1]);
    tier.medium = Some("CPU".into());
    let events = [
        w_store(0, fa(), &[1, 2]),
        Event::Stored(tier),
        removal(0, &[1, 2]),
        w_store(0, fa(), &[1, 2]),
    ];
    assert_eq!(eviction_after(&events), stats(64, 16));
}

#[test]
fn a_reset_rank_forgets_what_it_removed() {
    let fa = || CacheKind::FullAttention;
    // A layout change resets the rank (twice here, there and back): block 1 stored after it
    // is new content, not a re-prefill.
    let events = [
        w_store(0, fa(), &[1]),
        removal(0, &[1]),
        store("w", 0, CacheKind::SlidingWindow, Some(64), &[9]),
        w_store(0, fa(), &[1]),
    ];
    assert_eq!(eviction_after(&events), stats(32, 0));
}

#[test]
fn an_event_for_a_worker_removed_on_its_way_files_nothing_in_the_shared_store() {
    let index = Index::new();
    let worker: WorkerId = "gone".into();
    let ev = store("gone", 0, CacheKind::FullAttention, None, &[1, 2, 3]);
    // A batch took the rank's handle, then the worker was removed.
    let rank = index.rank(&worker, 0);
    index.apply_to(&rank, &ev);
    assert_eq!(index.runs.read().distinct_blocks(), 3);
    index.remove_worker(&worker);
    assert_eq!(index.runs.read().distinct_blocks(), 0);
    index.apply_to(&rank, &ev);
    assert_eq!(index.runs.read().distinct_blocks(), 0);
    assert_eq!(
        index.runs.read().holder_slots(),
        1,
        "no new holder was given out"
    );
}

#[test]
fn a_given_chain_predicts_what_hashing_the_tokens_predicts() {
    let tokens: Vec<u32> = (0..16 * 9 + 5).map(|i| i * 7 % 1000).collect();
    let chain: Vec<u64> = block_hashes(
        HashAlgo::Sha256,
        DEFAULT_SEED,
        16,
        &tokens[..tokens.len() - 1],
        &BlockExtras::default(),
    )
    .into_iter()
    .map(|(_, v, _)| v)
    .collect();
    assert_eq!(chain.len(), 9);
    let index = Index::new();
    // One full-attention worker holding a prefix, one hybrid worker with a hole in its
    // window group, one worker holding nothing of the request.
    index.apply(&store("a", 0, CacheKind::FullAttention, None, &chain[..6]));
    index.apply(&store("b", 0, CacheKind::FullAttention, None, &chain));
    let window: Vec<u64> = chain
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 7)
        .map(|(_, h)| *h)
        .collect();
    index.apply(&store("b", 1, CacheKind::SlidingWindow, Some(32), &window));
    index.apply(&store("c", 0, CacheKind::FullAttention, None, &[1, 2, 3]));
    let q = Query {
        tokens: tokens.clone(),
        ..Query::default()
    };
    let hashed = index.predict_all(&q);
    let given = index.predict_all_with_chain(tokens.len(), &chain, Detail::Evidence);
    assert_eq!(given, hashed);
    let lean = index.predict_all_with_chain(tokens.len(), &chain, Detail::Cached);
    let strip = |v: &[Prediction]| -> Vec<Prediction> {
        v.iter()
            .map(|p| Prediction {
                groups: Vec::new(),
                ..p.clone()
            })
            .collect()
    };
    assert_eq!(lean, strip(&hashed));
    assert_eq!(index.predict_all_detail(&q, Detail::Cached), lean);
    let cached: Vec<u64> = given.iter().map(|p| p.cached).collect();
    assert_eq!(cached, vec![96, 112, 0]);
}
