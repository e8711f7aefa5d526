//! What the gateway's integration tests share: a gateway configuration on loopback, a worker
//! spec for a simulated worker (its real ZMQ endpoints), reading a gateway's metrics, and a
//! DNS server for discovery (`dns`). Each test file uses some of it.
#![allow(dead_code)]

pub mod dns;

use kvroute::gateway::config::{file::GatewayConfig, KvEventsSpec, WorkerSpec};
use kvroute::gateway::GatewayHandle;
use kvroute_sim::SimHandle;

/// A gateway on ephemeral loopback ports with fast health checks, explaining every decision.
pub fn gateway_config(workers: Vec<WorkerSpec>) -> GatewayConfig {
    GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        health_interval_secs: 0.1,
        explain_always: true,
        workers,
        ..GatewayConfig::default()
    }
}

/// The spec of a simulated worker serving `model`: its event port, and its replay port when
/// `replay` is set.
pub fn sim_spec(h: &SimHandle, model: &str, replay: bool) -> WorkerSpec {
    let mut s = WorkerSpec::new(&h.name, &h.base_url, model);
    let port = h.zmq[0].rsplit(':').next().unwrap();
    let replay_endpoint = replay.then(|| {
        let rport = h.replay[0].rsplit(':').next().unwrap();
        format!("tcp://*:{rport}")
    });
    s.kv_events = Some(KvEventsSpec {
        endpoint: format!("tcp://*:{port}"),
        replay_endpoint,
        topic: String::new(),
        host: Some("127.0.0.1".into()),
        ..KvEventsSpec::new("")
    });
    s
}

/// Posts `body` to the gateway's `/v1/completions`: the status, the decision header (`Null`
/// when absent) and the body's text.
pub async fn post_completion(
    gw: &GatewayHandle,
    body: &serde_json::Value,
) -> (u16, serde_json::Value, String) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let decision = r
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| serde_json::from_str(v.to_str().ok()?).ok())
        .unwrap_or(serde_json::Value::Null);
    (status, decision, r.text().await.unwrap_or_default())
}

/// The admin listener's Prometheus text.
pub async fn admin_metrics(gw: &GatewayHandle) -> String {
    reqwest::get(format!("http://{}/metrics", gw.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The admin view of the workers (`GET /admin/workers`).
pub async fn admin_workers(gw: &GatewayHandle) -> serde_json::Value {
    reqwest::get(format!("http://{}/admin/workers", gw.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Every worker's predicted cached tokens for `tokens` (admin explain at `admin`, an address),
/// sorted by worker.
pub async fn predictions(admin: &str, model: &str, tokens: &[u32]) -> Vec<(String, u64)> {
    let v: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{admin}/admin/explain"))
        .json(&serde_json::json!({"tokens": tokens, "model": model}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut out: Vec<(String, u64)> = v["predictions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["worker"].as_str().unwrap().to_string(),
                p["cached"].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The cached tokens an engine (its base URL) reports for `tokens`, sent to it directly.
pub async fn engine_cached(base_url: &str, model: &str, tokens: &[u32]) -> u64 {
    let r: serde_json::Value = reqwest::Client::new()
        .post(format!("{base_url}/v1/completions"))
        .json(&serde_json::json!({"model": model, "prompt": tokens, "max_tokens": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// Ranks the gateway's event intake reports degraded.
pub fn degraded_ranks(gw: &GatewayHandle) -> usize {
    gw.state
        .registry
        .wire_stats
        .snapshot()
        .ranks
        .iter()
        .filter(|r| r.degraded)
        .count()
}

/// Waits until the gateway's index has taken in the engines' events: its store and removal
/// counts (every tier's included) and device blocks stop changing for 100 ms (bounded at
/// 5 s), so a prediction does not race the events of the request before it.
pub async fn settle(gw: &GatewayHandle) {
    use kvroute_index::counters::Counter;
    use std::time::{Duration, Instant};
    let index = &gw.state.registry.index;
    let snapshot = || {
        let c = index.counters();
        (
            c.get(Counter::StoreEvents),
            c.get(Counter::RemoveEvents),
            index.stats().block_copies,
        )
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = snapshot();
    let mut stable_since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = snapshot();
        if now != last {
            last = now;
            stable_since = Instant::now();
        } else if stable_since.elapsed() >= Duration::from_millis(100) {
            return;
        }
    }
}

/// The worker names of a `GET /admin/workers` view, sorted.
pub fn worker_names(v: &serde_json::Value) -> Vec<String> {
    let mut n: Vec<String> = v["workers"]
        .as_array()
        .map(|ws| {
            ws.iter()
                .filter_map(|w| w["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    n.sort();
    n
}
