//! `/admin/explain` is a pure read, over real sockets: asked many times between requests, it
//! leaves the decision the next request would get byte for byte what it would have been,
//! while one real request through the front door does change it (so the comparison can see a
//! change).

use crate::common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::decide::{candidates_for, snapshot, RouteRequest};
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_route::{decide, RequestFacts};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::json;
use std::time::Instant;

const PRESET: &str = "tiny-gemma3";

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

/// The decision the gateway's state gives `tokens` at `at` (a new conversation, request 0),
/// as the JSON the gateway reports.
fn decision_at(gw: &GatewayHandle, tokens: &[u32], at: Instant) -> String {
    let st = &gw.state;
    let workers = candidates_for(&st.registry, PRESET);
    let policy = st.policy();
    let weights = st.config().weights.clone();
    let req = RouteRequest::base(&st.registry, tokens);
    let taken = snapshot(&st.registry, &workers, &req, policy, &weights, at);
    let facts = RequestFacts {
        tokens: tokens.len() as u64,
        follow_up: req.follow_up,
        max_tokens: None,
        rr: 0,
    };
    serde_json::to_string(&decide(policy, &weights, &facts, &taken.snapshot)).expect("json")
}

async fn explain(gw: &GatewayHandle, tokens: &[u32]) -> serde_json::Value {
    let r = reqwest::Client::new()
        .post(format!("http://{}/admin/explain", gw.admin_addr))
        .json(&json!({"model": PRESET, "tokens": tokens}))
        .send()
        .await
        .expect("explain answered");
    assert_eq!(r.status(), 200);
    r.json().await.expect("explain's body is JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_for_explanations_leaves_the_next_decision_as_it_would_have_been() {
    let mut cfg = WorkerConfig::for_preset(PRESET).expect("preset");
    cfg.speedup = 100.0;
    let f = Fleet::start(FleetOptions::new(cfg, 3))
        .await
        .expect("fleet");
    let workers = f.workers.iter().map(|h| common::sim_spec(h, PRESET, true));
    let gw = Gateway::start(GatewayConfig {
        ..common::gateway_config(workers.collect())
    })
    .await
    .expect("gateway");
    // Traffic that teaches every learner something: shared prefixes, follow-ups, answers.
    let mut last = Vec::new();
    for k in 0..9u32 {
        let mut p = prompt(k % 3, 128);
        p.extend(prompt(50 + k, 30 + 4 * k as usize));
        let (status, _, _) =
            common::post_completion(&gw, &json!({"model": PRESET, "prompt": p, "max_tokens": 3}))
                .await;
        assert_eq!(status, 200);
        last = p;
    }
    common::settle(&gw).await;
    let next = [last.as_slice(), &prompt(99, 40)].concat();
    let at = Instant::now();
    let before = decision_at(&gw, &next, at);
    for _ in 0..40 {
        let e = explain(&gw, &next).await;
        assert_eq!(
            e["decision"]["candidates"].as_array().map(Vec::len),
            Some(3)
        );
    }
    assert_eq!(
        decision_at(&gw, &next, at),
        before,
        "explanations changed the next decision"
    );
    // A real request does change what the next one gets (its rate, its bookings, its cache),
    // so the comparison above would have seen a change.
    let (status, _, _) = common::post_completion(
        &gw,
        &json!({"model": PRESET, "prompt": next, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200);
    common::settle(&gw).await;
    assert_ne!(decision_at(&gw, &next, at), before);
    gw.shutdown().await;
}
