//! What the gateway's integration tests share: a gateway configuration on loopback, a worker
//! spec for a simulated worker (its real ZMQ endpoints), reading a gateway's metrics, waiting
//! on a condition with a deadline (`wait`: a gateway ready, its index level with the engines),
//! whether python3 has the modules a test drives (`python`), and a DNS server for discovery
//! (`dns`). Each test file uses some of it.
#![allow(dead_code)]

pub mod dns;
pub mod python;
pub mod wait;

use std::collections::BTreeMap;

#[allow(unused_imports)]
pub use wait::{none_pending, wait_for, wait_until, WAIT};

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
    metrics_at(&format!("http://{}/metrics", gw.admin_addr)).await
}

/// The Prometheus text a plain-HTTP `/metrics` URL serves.
pub async fn metrics_at(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// The value of the first sample in Prometheus `text` whose line starts with `line_start` (a
/// name, or a name and its labels); fails the test when there is none: a missing metric is a
/// finding, never a 0.
pub fn metric(text: &str, line_start: &str) -> f64 {
    metric_if_present(text, line_start)
        .unwrap_or_else(|| panic!("no metric {line_start} in:\n{text}"))
}

/// [`metric`], `None` when absent: for a wait on a counter that appears at its first count.
pub fn metric_if_present(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Waits until the sample `line_start` of the Prometheus text at `url` is at least `at_least`
/// (a counter a connection's or sender's task increments after the client saw the outcome; one
/// that appears at its first count is waited for too). Fails the test after [`WAIT`].
pub async fn wait_for_metric(url: &str, line_start: &str, at_least: f64) {
    let what = format!("{line_start} to reach {at_least}");
    wait_for(WAIT, &what, || async {
        let text = reqwest::get(url)
            .await
            .map_err(|e| e.to_string())?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        match metric_if_present(&text, line_start) {
            Some(v) if v >= at_least => Ok(()),
            seen => Err(format!("{line_start}: {seen:?}")),
        }
    })
    .await
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

/// `/admin/explain`'s answer for `tokens` on `model` (admin listener `admin`): the decision
/// the next request would get, and every worker's prediction.
pub async fn explain(admin: &str, model: &str, tokens: &[u32]) -> serde_json::Value {
    reqwest::Client::new()
        .post(format!("http://{admin}/admin/explain"))
        .json(&serde_json::json!({"tokens": tokens, "model": model}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Every worker's predicted cached tokens for `tokens` (admin explain at `admin`, an address),
/// sorted by worker.
pub async fn predictions(admin: &str, model: &str, tokens: &[u32]) -> Vec<(String, u64)> {
    let v = explain(admin, model, tokens).await;
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

/// Waits until the gateway's index has applied every event batch its workers' engines queued
/// so far, so a prediction does not race the events of the request before it.
pub async fn settle(gw: &GatewayHandle) {
    settle_at(&gw.admin_addr.to_string(), &[]).await
}

/// [`settle`] leaving out the workers named in `skip` (whose events do not come from their
/// simulator's publisher).
pub async fn settle_except(gw: &GatewayHandle, skip: &[&str]) {
    settle_at(&gw.admin_addr.to_string(), skip).await
}

/// [`settle`] for the gateway whose admin listener is `admin` (an address; a `kvroute serve`
/// process too): for each subscribed rank of each worker, the index's `events_next_seq`
/// (`GET /admin/workers`) equals the seq of the engine's next batch (the simulator's
/// `/admin/cache`), leaving out the workers named in `skip`. Fails the test when they do not
/// meet within [`WAIT`].
pub async fn settle_at(admin: &str, skip: &[&str]) {
    let client = reqwest::Client::new();
    wait_for(
        WAIT,
        "the index to apply every batch the engines queued",
        || async {
            let workers = admin_workers_at(&client, admin, None).await?;
            let mut behind = Vec::new();
            for w in &workers {
                let applied = w["events_next_seq"].as_array().cloned().unwrap_or_default();
                if applied.is_empty() || skip.iter().any(|n| w["name"] == *n) {
                    continue;
                }
                let url = format!("{}/admin/cache", w["url"].as_str().unwrap_or(""));
                let cache = json_at(&client, url, None).await?;
                for (rank, at) in applied.iter().enumerate() {
                    let engine = &cache["ranks"][rank]["publisher"]["next_seq"];
                    if engine.is_u64() && engine != at {
                        behind.push(format!(
                            "{} rank {rank}: index at {at}, engine at {engine}",
                            w["name"]
                        ));
                    }
                }
            }
            none_pending(behind)
        },
    )
    .await
}

/// Waits until the event stream of every worker of the gateway at `admin` (each a simulated engine
/// with events; one whose subscription has not started yet is waited for) has joined: a batch the
/// engine published after the subscription took hold reached the index live. A PUB socket drops
/// what it publishes before a subscription reaches it, and a subscriber cannot tell when that is; a
/// batch lost that way is only noticed at the next one (a gap, then a replay). So this asks each
/// engine for batches (`POST /reset_prefix_cache`, which publishes a clear, about every 100 ms
/// while needed) until its index is level with it, twice: the first time the subscription's opening
/// replay may have brought the index level while its subscription had not reached the publisher
/// yet; the second time only a batch that arrived live can. Use it before the first request on a
/// fresh gateway whose check needs that request's events; it clears the engines' caches. `token`:
/// the admin API's bearer token, where it wants one. Fails the test after [`WAIT`].
pub async fn joined_at(admin: &str, token: Option<&str>) {
    let first = level_past(admin, token, &BTreeMap::new()).await;
    level_past(admin, token, &first).await;
}

/// The JSON a `GET` of `url` answers (with `token` as its bearer token when given); any status
/// but success is an error carrying the body, so a refused call never reads as an empty answer.
pub async fn json_at(
    client: &reqwest::Client,
    url: String,
    token: Option<&str>,
) -> Result<serde_json::Value, String> {
    let mut req = client.get(&url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.map_err(|e| format!("{url}: {e}"))?;
    let status = r.status();
    let body = r.text().await.map_err(|e| format!("{url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("{url}: {status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{url}: {e}: {body}"))
}

/// The workers of the admin API at `admin` (`GET /admin/workers`); an answer without its
/// `workers` list is an error.
pub async fn admin_workers_at(
    client: &reqwest::Client,
    admin: &str,
    token: Option<&str>,
) -> Result<Vec<serde_json::Value>, String> {
    let view = json_at(client, format!("http://{admin}/admin/workers"), token).await?;
    match view["workers"].as_array() {
        Some(ws) => Ok(ws.clone()),
        None => Err(format!(
            "/admin/workers answered no list of workers: {view}"
        )),
    }
}

/// Nudges each subscribed simulated worker until its index is level with its engine at a seq
/// beyond `past` (per worker name and rank); returns the engines' seqs it ended level with.
async fn level_past(
    admin: &str,
    token: Option<&str>,
    past: &BTreeMap<(String, usize), u64>,
) -> BTreeMap<(String, usize), u64> {
    let client = reqwest::Client::new();
    let mut probes = 0u32;
    wait_for(WAIT, "every worker's event stream to join", || {
        probes += 1;
        let nudge = probes % 10 == 1;
        let client = client.clone();
        async move {
            let workers = admin_workers_at(&client, admin, token).await?;
            if workers.is_empty() {
                return Err("the gateway has no workers yet".to_string());
            }
            let mut pending = Vec::new();
            let mut level = BTreeMap::new();
            for w in &workers {
                let applied = w["events_next_seq"].as_array().cloned().unwrap_or_default();
                let url = w["url"].as_str().unwrap_or("").to_string();
                let name = w["name"].as_str().unwrap_or("").to_string();
                if applied.is_empty() {
                    // Its subscriptions have not started yet (every worker here has events).
                    pending.push(format!("{name}: not subscribed yet"));
                    continue;
                }
                let cache = json_at(&client, format!("{url}/admin/cache"), None).await?;
                let mut behind = false;
                for (rank, at) in applied.iter().enumerate() {
                    let engine = cache["ranks"][rank]["publisher"]["next_seq"]
                        .as_u64()
                        .unwrap_or(0);
                    let before = past.get(&(name.clone(), rank)).copied().unwrap_or(0);
                    behind |= engine <= before || at.as_u64() != Some(engine);
                    level.insert((name.clone(), rank), engine);
                }
                if behind {
                    pending.push(format!(
                        "{name}: index {applied:?}, engine {}",
                        cache["ranks"]
                    ));
                    if nudge {
                        client
                            .post(format!("{url}/reset_prefix_cache"))
                            .send()
                            .await
                            .map_err(|e| format!("{url}/reset_prefix_cache: {e}"))?;
                    }
                }
            }
            none_pending(pending).map(|()| level)
        }
    })
    .await
}

/// Waits until the gateway counts no request running or waiting on any worker (its own and the
/// engines' figures), so a decision that weighs load sees idle workers; fails the test when
/// that does not come within [`WAIT`].
pub async fn idle(gw: &GatewayHandle) {
    wait_for(WAIT, "every worker counted idle", || async {
        let workers = gw.state.registry.all();
        let busy = workers.iter().filter(|w| w.running() > 0);
        none_pending(
            busy.map(|w| format!("{}: {} running", w.spec.name, w.running()))
                .collect(),
        )
    })
    .await
}

/// Waits until the gateway is ready: `/health/ready` answers 200 and every healthy worker's
/// event subscriptions finished their first catch-up (connected, replay applied; not the grace
/// period's "ready anyway"). Fails the test when that does not come within [`WAIT`].
pub async fn ready(gw: &GatewayHandle) {
    ready_at(&gw.addr.to_string()).await
}

/// [`ready`] for the gateway whose front listener is `front` (an address).
pub async fn ready_at(front: &str) {
    ready_with(&reqwest::Client::new(), &format!("http://{front}")).await
}

/// [`ready`] asked at `base` (`scheme://host:port`) with `client` (a TLS listener's client).
pub async fn ready_with(client: &reqwest::Client, base: &str) {
    let url = format!("{base}/health/ready");
    wait_for(
        WAIT,
        "the gateway to be ready, every subscription caught up",
        || async {
            let r = client.get(&url).send().await.map_err(|e| e.to_string())?;
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().await.map_err(|e| e.to_string())?;
            let caught_up = body["catching_up"].as_array().is_some_and(Vec::is_empty);
            if status == 200 && caught_up {
                Ok(())
            } else {
                Err(format!("{status} {body}"))
            }
        },
    )
    .await
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
