//! Several gateway replicas in front of one simulated fleet, over real sockets: each subscribes
//! to every engine's events itself, so they hold the same index and predict the same for every
//! request, a replica started late catches up through the engines' replay sockets, and the
//! engines' own load figures (`/metrics`, polled) make each replica count what the others sent.

use crate::common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const PRESET: &str = "tiny-gemma3";

async fn fleet(n: usize, speedup: f64) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = speedup;
    Fleet::start(FleetOptions::new(cfg, n)).await.unwrap()
}

async fn replica(f: &Fleet) -> GatewayHandle {
    let workers = f.workers.iter().map(|h| common::sim_spec(h, PRESET, true));
    let cfg = GatewayConfig {
        load_poll_interval_secs: 0.02,
        load_poll_timeout_secs: 0.5,
        ..common::gateway_config(workers.collect())
    };
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    gw
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

async fn complete(gw: &GatewayHandle, prompt: &[u32], max_tokens: u32) -> Value {
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.headers()
        .get("x-kvroute-decision")
        .and_then(|v| serde_json::from_str(v.to_str().ok()?).ok())
        .unwrap_or(Value::Null)
}

/// Every worker's predicted cached tokens for `tokens`, by the replica's admin explain.
async fn predictions(gw: &GatewayHandle, tokens: &[u32]) -> Vec<(String, u64)> {
    common::predictions(&gw.admin_addr.to_string(), PRESET, tokens).await
}

/// Waits until every replica's index applied every event batch the engines queued (so all
/// hold the same copies); fails the test when one does not within the wait's deadline.
async fn agree(replicas: &[&GatewayHandle]) {
    for g in replicas {
        common::settle(g).await;
    }
}

/// Requests running on every worker as `gw` counts them (its own, and the engine's figures
/// that include the other replicas').
fn running(gw: &GatewayHandle) -> u64 {
    gw.state.registry.all().iter().map(|w| w.running()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_predict_the_same_and_one_started_late_catches_up_through_replay() {
    let f = fleet(2, 1000.0).await;
    let a = replica(&f).await;
    let b = replica(&f).await;
    // Conversations and shared prefixes, sent through both replicas in turn.
    let mut sent = Vec::new();
    for k in 0..12u32 {
        let mut p = prompt(k % 4, 96);
        p.extend(prompt(100 + k, 40 + 8 * k as usize));
        let via = if k % 2 == 0 { &a } else { &b };
        complete(via, &p, 2).await;
        sent.push(p);
    }
    // A third replica starts after all of that: its subscriptions replay from seq 0.
    let c = replica(&f).await;
    agree(&[&a, &b, &c]).await;
    let mut probes: Vec<Vec<u32>> = sent
        .iter()
        .map(|p| [p.as_slice(), &[9, 9]].concat())
        .collect();
    probes.push(prompt(3, 200));
    probes.push(prompt(77, 50));
    let mut hits = 0;
    for p in &probes {
        let pa = predictions(&a, p).await;
        assert_eq!(pa.len(), 2);
        assert_eq!(pa, predictions(&b, p).await, "replicas a and b differ");
        assert_eq!(pa, predictions(&c, p).await, "the late replica differs");
        hits += pa.iter().filter(|(_, c)| *c > 0).count();
    }
    assert!(hits >= sent.len(), "the probes hit what was sent ({hits})");
    for g in [a, b, c] {
        g.shutdown().await;
    }
}

/// The share of requests the busiest worker got.
fn busiest_share(workers: &[String]) -> f64 {
    let mut counts = std::collections::BTreeMap::new();
    for w in workers {
        *counts.entry(w.as_str()).or_insert(0usize) += 1;
    }
    *counts.values().max().unwrap_or(&0) as f64 / workers.len().max(1) as f64
}

/// `n` requests sharing one warm prefix, streamed through `replicas` in turn; returns the
/// worker each went to. Each is sent once the one before is running at its engine and every
/// replica counts it (its own count, or the engine's figures it polls), not after a fixed
/// spacing: every decision then sees all the load before it, on a fast machine or a slow one.
async fn burst(replicas: &[&GatewayHandle], n: usize, seed: u32) -> Vec<String> {
    let hot = prompt(seed, 160);
    complete(replicas[0], &hot, 1).await;
    agree(replicas).await;
    let finished = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for k in 0..n {
        let mut p = hot.clone();
        p.extend(prompt(seed * 1000 + k as u32, 48));
        let gw = replicas[k % replicas.len()];
        let (addr, body) = (
            gw.addr,
            json!({"model": PRESET, "prompt": p, "max_tokens": 24, "stream": true}),
        );
        let (routed_tx, routed) = tokio::sync::oneshot::channel();
        let done = finished.clone();
        tasks.push(tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(format!("http://{addr}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let d: Value =
                serde_json::from_str(r.headers()["x-kvroute-decision"].to_str().unwrap()).unwrap();
            let _ = routed_tx.send(());
            let _ = r.bytes().await;
            done.fetch_add(1, Ordering::SeqCst);
            d["worker"].as_str().unwrap().to_string()
        }));
        routed.await.unwrap();
        let what = format!("every replica counting the {} requests in flight", k + 1);
        common::wait_until(common::WAIT, &what, || async {
            let in_flight = k as u64 + 1 - finished.load(Ordering::SeqCst);
            replicas.iter().all(|g| running(g) >= in_flight)
        })
        .await;
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_under_load_spread_no_worse_than_one_because_each_counts_the_others() {
    // Engines at a fifth of real time: every request stays in flight for a while.
    let f = fleet(2, 0.2).await;
    let a = replica(&f).await;
    let b = replica(&f).await;
    let one = busiest_share(&burst(&[&a], 24, 11).await);
    // The second burst starts on idle engines, as the first did.
    common::wait_until(
        common::WAIT,
        "both replicas counting nothing running",
        || async { running(&a) == 0 && running(&b) == 0 },
    )
    .await;
    let two = busiest_share(&burst(&[&a, &b], 24, 12).await);
    // Stated bound: the busiest worker's share with two replicas is at most one replica's plus
    // an eighth (three requests of 24).
    assert!(
        two <= one + 0.125,
        "one replica: busiest {one:.2}; two replicas: busiest {two:.2}"
    );
    // Each replica's view of a worker counts the other's requests (the engine's figures).
    let views = common::admin_workers(&a).await;
    for w in views["workers"].as_array().unwrap() {
        assert!(w["engine_load"]["polls"].as_u64().unwrap() > 0, "{w}");
    }
    for g in [a, b] {
        g.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_counts_requests_another_replica_has_in_flight() {
    let f = fleet(1, 0.05).await;
    let a = replica(&f).await;
    let b = replica(&f).await;
    // Three long requests through b only.
    let mut tasks = Vec::new();
    for k in 0..3u32 {
        let addr = b.addr;
        let p = prompt(500 + k, 64);
        tasks.push(tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("http://{addr}/v1/completions"))
                .json(&json!({"model": PRESET, "prompt": p, "max_tokens": 64}))
                .send()
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
        }));
    }
    // a, which sent nothing, sees them through the engine's figures.
    let w = &a.state.registry.all()[0];
    common::wait_until(
        common::WAIT,
        "replica a counting b's three requests",
        || async { w.running() >= 3 },
    )
    .await;
    assert_eq!(w.running(), 3);
    assert_eq!(w.in_flight.load(std::sync::atomic::Ordering::Relaxed), 0);
    for t in tasks {
        t.await.unwrap();
    }
    for g in [a, b] {
        g.shutdown().await;
    }
}
