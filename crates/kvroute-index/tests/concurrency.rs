//! Concurrency: writers apply different workers' events while readers predict. A prediction
//! never observes half of an event, and the final state equals the reference model.

mod common;
use common::{chain, group_blocks, remove, store, tokens};
use kvroute_index::reference::Reference;
use kvroute_index::{Detail, Index, Query};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

const PROMPTS: u32 = 40;
const LEN: usize = 320;

#[test]
fn predictions_never_see_a_torn_event_and_the_final_state_equals_the_reference() {
    let index = Arc::new(Index::new());
    let workers = ["w0", "w1", "w2", "w3"];
    // Each event stores a whole prompt's full-attention blocks and its window checkpoint, in
    // two groups: every event is "all or nothing" for its prompt.
    let prompts: Vec<Vec<u32>> = (0..PROMPTS).map(|s| tokens(s + 1000, LEN)).collect();
    let chains: Vec<Vec<u64>> = prompts.iter().map(|p| chain(p, 16)).collect();
    let mut streams = Vec::new();
    for (wi, w) in workers.iter().enumerate() {
        let mut evs = Vec::new();
        // Rounds of store-everything then evict-the-full-attention-blocks, then a last store.
        for round in 0..=20 {
            for (pi, c) in chains.iter().enumerate() {
                if (pi + wi) % 2 == 0 {
                    evs.push(store(w, 0, "full_attention", None, 16, c));
                    let window = group_blocks(c, 1, c.len() - 2..c.len());
                    evs.push(store(w, 1, "sliding_window", Some(32), 16, &window));
                    if round < 20 {
                        evs.push(remove(w, 0, c));
                        evs.push(remove(w, 1, &window));
                    }
                }
            }
        }
        streams.push(evs);
    }
    let done = Arc::new(AtomicBool::new(false));
    // Every thread starts together, so writers cannot finish before a reader has begun; a
    // reader also goes on until it has seen a prediction.
    let start = Arc::new(Barrier::new(3 + streams.len()));
    let readers: Vec<_> = (0..3)
        .map(|r| {
            let index = index.clone();
            let done = done.clone();
            let start = start.clone();
            let prompts = prompts.clone();
            thread::spawn(move || {
                let mut seen = 0u64;
                let mut i = r;
                start.wait();
                while !done.load(Ordering::Relaxed) || seen == 0 {
                    let q = Query {
                        tokens: prompts[i % prompts.len()].clone(),
                        ..Query::default()
                    };
                    // One reader asks for evidence, one for every rank without it, one for the
                    // routing path (only the ranks that hit, through the shared store's walk).
                    let predictions = match r {
                        0 => index.predict_all_detail(&q, Detail::Evidence),
                        1 => index.predict_all_detail(&q, Detail::Cached),
                        _ => index.predict_hits(&q),
                    };
                    for p in predictions {
                        // 0 before the prompt's events, full length after: never in between.
                        assert!(
                            p.cached == 0 || p.cached == 304,
                            "torn state: {} for {}",
                            p.cached,
                            p.worker
                        );
                        assert!(
                            p.group_blind == 0 || p.group_blind == 304,
                            "torn store: {}",
                            p.group_blind
                        );
                        seen += 1;
                    }
                    i += 1;
                }
                seen
            })
        })
        .collect();
    let writers: Vec<_> = streams
        .clone()
        .into_iter()
        .enumerate()
        .map(|(wi, evs)| {
            let index = index.clone();
            let start = start.clone();
            thread::spawn(move || {
                start.wait();
                // Half the writers apply one event at a time, half in batches (one hold of
                // the locks per run of a rank's events).
                if wi % 2 == 0 {
                    for ev in &evs {
                        index.apply(ev);
                    }
                } else {
                    for batch in evs.chunks(7) {
                        index.apply_all(batch);
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    done.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().expect("reader") > 0);
    }
    let mut reference = Reference::default();
    for evs in &streams {
        for ev in evs {
            reference.apply(ev);
        }
    }
    assert_eq!(index.contents(), reference.contents());
    for p in &prompts {
        let q = Query {
            tokens: p.clone(),
            ..Query::default()
        };
        for got in index.predict_all(&q) {
            assert_eq!(
                (got.cached, got.group_blind),
                reference.predict(&got.worker, got.dp_rank, &q)
            );
        }
    }
}
