//! Agreement with the real engine: every committed conformance corpus (each directory of
//! `conformance/corpus/`, recorded from vLLM 0.32) is replayed on the simulator's engine core
//! configured as the corpus's model. Each request's
//! `num_cached_tokens` must equal the engine's, and the events of each engine step must equal
//! the recorded batch (timestamps aside), batch by batch.

use crate::common;

use common::corpus::{self, Recorded};
use kvroute_index::Event;
use kvroute_sim::{Engine, NewRequest, WireFormat};

/// Replays one corpus; returns (requests, hit mismatches, batch mismatches) and prints each.
fn replay(name: &str) -> (usize, Vec<String>, Vec<String>) {
    let c = corpus::load(name).unwrap_or_else(|| panic!("{name} is not committed"));
    let (meta, frames, requests) = (&c.meta, &c.frames, &c.requests);
    let workers = c.workers();
    let (mut hit_errors, mut event_errors) = (Vec::new(), Vec::new());
    for w in &workers {
        let mut engine = Engine::new(corpus::config_for(meta, w)).unwrap();
        let reqs: Vec<&corpus::RequestLine> = requests.iter().filter(|r| &r.worker == w).collect();
        for (k, r) in reqs.iter().enumerate() {
            let end = reqs.get(k + 1).map_or(frames.len(), |n| n.after_frame);
            let raw: Vec<Recorded> = frames[r.after_frame..end]
                .iter()
                .filter(|f| &f.worker == w)
                .map(|f| corpus::decode_frame(w, &f.frames))
                .collect();
            let recorded: Vec<Vec<Event>> = raw.iter().map(|b| b.events.clone()).collect();
            let handle = engine
                .add_request(NewRequest {
                    id: r.id.clone(),
                    prompt: r.prompt_token_ids.clone(),
                    max_tokens: r.output_token_ids.len(),
                    forced_output: Some(r.output_token_ids.clone()),
                    cache_salt: r.cache_salt.clone(),
                    skip_prefix_cache: false,
                    lora: r.lora(),
                    remote_kv: None,
                })
                .unwrap();
            let mut batches: Vec<Vec<Event>> = Vec::new();
            let mut cached = None;
            for _ in 0..10_000 {
                let out = engine.step();
                if !out.events.is_empty() {
                    batches.push(out.events);
                }
                if let Some(t) = out.tokens.iter().find(|t| t.handle == handle) {
                    cached = Some(t.num_cached_tokens);
                    if t.finished.is_some() {
                        break;
                    }
                }
            }
            if cached != Some(r.num_cached_tokens) {
                hit_errors.push(format!(
                    "{name} {}: sim hit {:?}, engine {} (prompt {})",
                    r.id,
                    cached,
                    r.num_cached_tokens,
                    r.prompt_token_ids.len()
                ));
            }
            if batches == recorded {
                // Same events: the bytes must be the engine's too (its timestamp aside).
                for (b, rec) in batches.iter().zip(&raw) {
                    let ours = kvroute_sim::wire::encode_batch(rec.ts, b, 0, WireFormat::V032);
                    if ours != rec.payload {
                        event_errors.push(format!("{name} {}: payload bytes differ", r.id));
                    }
                }
            } else {
                event_errors.push(format!(
                    "{name} {}: {} sim batches {:?}\n   vs {} recorded {:?}",
                    r.id,
                    batches.len(),
                    summarize(&batches),
                    recorded.len(),
                    summarize(&recorded)
                ));
            }
        }
    }
    for e in hit_errors.iter().chain(&event_errors) {
        eprintln!("{e}");
    }
    (requests.len(), hit_errors, event_errors)
}

fn summarize(batches: &[Vec<Event>]) -> Vec<Vec<String>> {
    batches
        .iter()
        .map(|b| {
            b.iter()
                .map(|e| match e {
                    Event::Stored(s) => format!(
                        "S g{} p{:?} n{} t{} {:?}",
                        s.group.unwrap_or(0),
                        s.parent.as_ref().map(|p| p.value.0 % 1000),
                        s.hashes.len(),
                        s.token_ids.len(),
                        s.hashes
                            .iter()
                            .map(|h| h.value.0 % 1000)
                            .collect::<Vec<_>>()
                    ),
                    Event::Removed(r) => format!(
                        "R g{} {:?}",
                        r.group.unwrap_or(0),
                        r.hashes
                            .iter()
                            .map(|h| h.value.0 % 1000)
                            .collect::<Vec<_>>()
                    ),
                    Event::Cleared(_) => "C".into(),
                })
                .collect()
        })
        .collect()
}

fn check(name: &str) {
    let (n, hits, events) = replay(name);
    assert!(n > 0, "{name} has no requests");
    assert!(hits.is_empty(), "{name}: {} hit mismatches", hits.len());
    assert!(
        events.is_empty(),
        "{name}: {} event mismatches",
        events.len()
    );
}

#[test]
fn every_committed_corpus_replays_with_identical_hits_and_events() {
    let names = corpus::all_corpora();
    assert!(names.len() >= 8, "corpora found: {names:?}");
    for name in names {
        check(&name);
    }
}
