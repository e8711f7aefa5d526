//! Per-worker circuit breaking over real HTTP: a worker that fails requests (5xx) is ejected
//! after a few in a row, its requests are retried on another worker, and the health check
//! probes it back; a worker answering client errors (4xx) is never ejected.

use crate::common;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};

use kvroute::gateway::config::WorkerSpec;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";

/// A fake engine that answers every completion with `status`. Its `/health` answers 200
/// until `down_after` completions were answered (0: always), then 503 until the test sets
/// the returned flag again, so a worker the breaker ejected stays out until the test lets it
/// back in, however slowly the machine runs.
async fn failing_engine(status: u16, down_after: u64) -> (String, Arc<AtomicU64>, Arc<AtomicBool>) {
    let hits = Arc::new(AtomicU64::new(0));
    let up = Arc::new(AtomicBool::new(true));
    let state = (hits.clone(), up.clone());
    let app = Router::new()
        .route(
            "/health",
            get(|State((_, up)): State<Shared>| async move {
                if up.load(Ordering::SeqCst) {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .route(
            "/v1/completions",
            post(
                move |State((hits, up)): State<Shared>, Json(_b): Json<Value>| async move {
                    let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == down_after {
                        up.store(false, Ordering::SeqCst);
                    }
                    let s = StatusCode::from_u16(status).unwrap();
                    let body = json!({"error": {"message": "no", "type": "Error", "param": null, "code": status}});
                    (s, Json(body))
                },
            ),
        )
        .with_state(state);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (url, hits, up)
}

type Shared = (Arc<AtomicU64>, Arc<AtomicBool>);

async fn gateway(workers: Vec<WorkerSpec>) -> GatewayHandle {
    Gateway::start(common::gateway_config(workers))
        .await
        .unwrap()
}

async fn complete(gw: &GatewayHandle, seed: u32) -> u16 {
    let prompt: Vec<u32> = (0..40).map(|i| (seed * 31 + i * 7) % 900 + 5).collect();
    reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn healthy(gw: &GatewayHandle, name: &str) -> bool {
    gw.state.registry.get(name).unwrap().routable()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_failing_requests_is_ejected_after_three_and_probed_back() {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    let fleet = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    // The breaker ejects it at its third failure (the ejection counter says so); its health
    // check also fails from then on, so a slow machine cannot probe it back before the test
    // lets it.
    let (bad_url, bad_hits, bad_up) = failing_engine(500, 3).await;
    // "a-bad" and "b-good" cost the same to a cold prompt, so they take turns at being tried
    // first: a-bad takes every other request until it is ejected.
    let gw = gateway(vec![
        WorkerSpec::new("a-bad", &bad_url, PRESET),
        WorkerSpec::new("b-good", &fleet.workers[0].base_url, PRESET),
    ])
    .await;
    common::ready(&gw).await;
    for k in 0..6 {
        // Every request is served: a 500 before any byte is retried on the next worker.
        assert_eq!(complete(&gw, k).await, 200);
    }
    assert_eq!(
        bad_hits.load(Ordering::SeqCst),
        3,
        "ejected after three failures"
    );
    let metrics = common::admin_metrics(&gw).await;
    assert!(
        metrics.contains("kvroute_worker_ejections_total{worker=\"a-bad\"} 1"),
        "{metrics}"
    );
    // Its /health answers again: after the backoff the health check lets it back in.
    bad_up.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !healthy(&gw, "a-bad") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(healthy(&gw, "a-bad"), "probed back");
    // The two take turns at being tried first: within two requests it is tried again.
    for k in [99, 100] {
        assert_eq!(complete(&gw, k).await, 200);
    }
    assert_eq!(bad_hits.load(Ordering::SeqCst), 4, "tried again once back");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_never_eject_a_worker() {
    let (url, hits, _) = failing_engine(400, 0).await;
    let gw = gateway(vec![WorkerSpec::new("w", &url, PRESET)]).await;
    common::ready(&gw).await;
    for k in 0..8 {
        assert_eq!(
            complete(&gw, k).await,
            400,
            "the engine's 400 reaches the client"
        );
    }
    assert_eq!(hits.load(Ordering::SeqCst), 8);
    assert!(healthy(&gw, "w"));
    gw.shutdown().await;
}
