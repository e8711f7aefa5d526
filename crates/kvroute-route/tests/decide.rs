//! The routing core's rankings on hand-built snapshots: where a request goes for the figures
//! the gateway's state would hand over, and that the same inputs always give the same bytes.

use kvroute_route::{
    decide, Fit, FleetFacts, LiveFacts, Outlook, PolicyKind, PolicyWeights, RequestFacts, Snapshot,
    WorkerFacts,
};

/// A worker with the prior's TTFT model (20 ms fixed, 66.7 ms per 1,000 tokens), idle.
fn worker(name: &str, cached: u64) -> WorkerFacts {
    WorkerFacts {
        name: name.into(),
        cached,
        blind: cached,
        ttft: Fit([20.0, 1000.0 / 15.0, 0.0, 0.0]),
        ..WorkerFacts::default()
    }
}

fn request(tokens: u64) -> RequestFacts {
    RequestFacts {
        tokens,
        ..RequestFacts::default()
    }
}

/// The hybrid-aware decision under the default weights for a new `tokens`-token prompt.
fn hybrid(s: &Snapshot, tokens: u64) -> kvroute_route::Decision {
    decide(
        PolicyKind::HybridAware,
        &PolicyWeights::default(),
        &request(tokens),
        s,
    )
}

fn snapshot(workers: Vec<WorkerFacts>) -> Snapshot {
    Snapshot {
        fleet: FleetFacts {
            least_loaded_share: 1.0,
            ..FleetFacts::default()
        },
        workers,
    }
}

#[test]
fn the_worker_serving_the_most_of_an_idle_fleet_wins() {
    let s = snapshot(vec![worker("a", 0), worker("b", 3000), worker("c", 1000)]);
    let d = hybrid(&s, 4000);
    assert_eq!(d.worker, "b");
    assert_eq!(d.predicted_cached, 3000);
    assert_eq!(d.best_cached, 3000);
    let order: Vec<&str> = d.candidates.iter().map(|c| &*c.worker).collect();
    assert_eq!(order, ["b", "c", "a"]);
    // 20 ms + 1,000 uncached tokens at 1/15 ms each.
    assert!((d.predicted_ttft_ms - (20.0 + 1000.0 / 15.0)).abs() < 1e-9);
}

#[test]
fn a_queue_long_enough_outweighs_the_cache() {
    let mut busy = worker("warm", 3000);
    busy.queued_tokens = 6000;
    let s = snapshot(vec![busy, worker("cold", 0)]);
    let d = hybrid(&s, 4000);
    // warm: 6,000 queued + 1,000 own tokens; cold: 4,000 own.
    assert_eq!(d.worker, "cold");
    assert_eq!(d.best_cached, 3000);
    assert_eq!(d.candidates[1].load_delay_ms, 400.0);
}

#[test]
fn group_blind_ranks_by_the_full_attention_prefix_the_snapshot_gives_it() {
    // The gateway hands group-blind its view: the full-attention prefix as `cached`.
    let mut lost = worker("lost-state", 0);
    lost.blind = 3000;
    let s_exact = snapshot(vec![lost.clone(), worker("b", 1000)]);
    let exact = hybrid(&s_exact, 4000);
    assert_eq!(exact.worker, "b");
    assert_eq!(exact.candidates[0].blind_cached, 1000);
    lost.cached = 3000;
    let s_blind = snapshot(vec![lost, worker("b", 1000)]);
    let blind = decide(
        PolicyKind::GroupBlind,
        &PolicyWeights::default(),
        &request(4000),
        &s_blind,
    );
    assert_eq!(blind.worker, "lost-state");
    assert_eq!(
        blind.candidates[0].blind_cached, 0,
        "reported by hybrid-aware only"
    );
}

#[test]
fn a_junction_is_credited_only_where_no_worker_serves_the_prefix_yet() {
    let with_outlook = |name: &str, forecast: u64, prefix: u64| WorkerFacts {
        outlook: Some(Outlook {
            forecast,
            prefix,
            align: 64,
        }),
        ..worker(name, forecast)
    };
    // The credit is priced at μ, 0 by default: switched on here.
    let credited = PolicyWeights {
        junction: 1.0,
        ..PolicyWeights::default()
    };
    let hybrid =
        |s: &Snapshot, tokens| decide(PolicyKind::HybridAware, &credited, &request(tokens), s);
    let s = snapshot(vec![with_outlook("a", 0, 2048), with_outlook("b", 0, 0)]);
    let d = hybrid(&s, 4000);
    assert_eq!(d.worker, "a");
    assert_eq!(d.candidates[0].junction, 2048);
    assert_eq!(d.candidates[0].checkpoints, [3968, 2048]);
    // Once "b" serves the prefix, "a"'s junction is worth nothing and "b" wins.
    let s = snapshot(vec![
        with_outlook("a", 0, 2048),
        with_outlook("b", 2048, 2048),
    ]);
    let d = hybrid(&s, 4000);
    assert_eq!(d.worker, "b");
    assert!(d.candidates.iter().all(|c| c.junction == 0));
}

#[test]
fn a_new_conversation_is_charged_its_later_turns_and_a_follow_up_is_not() {
    let mut crowded = worker("crowded", 1000);
    crowded.live = Some(LiveFacts {
        weight: 8.0,
        age_ms: 0.0,
    });
    crowded.load_wait_ms = 50.0;
    let mut s = snapshot(vec![crowded, worker("quiet", 0)]);
    s.fleet.follow_ups = 3.0;
    s.fleet.cycle = Some((1000.0, 100.0));
    let weights = PolicyWeights::default();
    let new = decide(PolicyKind::HybridAware, &weights, &request(1200), &s);
    let c = &new
        .candidates
        .iter()
        .find(|c| &*c.worker == "crowded")
        .unwrap();
    assert!(
        c.live_conversations > 7.9 && c.later_turns_ms > 150.0,
        "{c:?}"
    );
    assert_eq!(new.worker, "quiet");
    assert_eq!(new.follow_ups, 3.0);
    let follow_up = RequestFacts {
        follow_up: true,
        ..request(1200)
    };
    let d = decide(PolicyKind::HybridAware, &weights, &follow_up, &s);
    assert_eq!(d.worker, "crowded");
    assert_eq!(d.follow_ups, 0.0);
    assert!(d.candidates.iter().all(|c| c.later_turns_ms == 0.0));
}

#[test]
fn the_same_inputs_give_the_same_decision_byte_for_byte() {
    let mut a = worker("a", 512);
    a.queued_tokens = 700;
    a.running = 3;
    a.arrivals_per_ms = 0.02;
    a.decode_delta_ms = 0.4;
    a.mean_running = 2.5;
    let mut s = snapshot(vec![a, worker("b", 0), worker("c", 128)]);
    s.fleet.output_mean = Some(120.0);
    s.fleet.follow_ups = 1.5;
    s.fleet.cycle = Some((2000.0, 40.0));
    let weights = PolicyWeights {
        next_arrivals: true,
        ..PolicyWeights::default()
    };
    let first = serde_json::to_string(&decide(
        PolicyKind::HybridAware,
        &weights,
        &request(2048),
        &s,
    ))
    .unwrap();
    for rr in 0..50 {
        let again = decide(PolicyKind::HybridAware, &weights, &request(2048), &s);
        assert_eq!(
            serde_json::to_string(&again).unwrap(),
            first,
            "request {rr}"
        );
    }
}

#[test]
fn cache_blind_policies_ignore_the_cache_and_take_turns() {
    let s = snapshot(vec![worker("a", 3000), worker("b", 0), worker("c", 0)]);
    let weights = PolicyWeights::default();
    let picks: Vec<String> = (0..3)
        .map(|rr| {
            let req = RequestFacts {
                rr,
                ..request(4000)
            };
            decide(PolicyKind::RoundRobin, &weights, &req, &s).worker
        })
        .collect();
    assert_eq!(picks, ["a", "b", "c"]);
    let d = decide(PolicyKind::LeastLoad, &weights, &request(4000), &s);
    assert_eq!(d.follow_ups, 0.0);
    assert!(d.candidates.iter().all(|c| c.delay_to_others_ms == 0.0));
}
