//! Engine generations over real HTTP: a worker without a configured `engine` is detected from
//! its `GET /version` (a simulated vLLM 0.32 worker; stand-in servers answering 0.33, an
//! unsupported release, or no `/version` at all), re-configured in the index by what it names,
//! and shown in the admin view; a configured engine is kept whatever the worker says.

use crate::common;
use axum::routing::get;
use axum::Router;
use kvroute::gateway::config::{file::GatewayConfig, SpeculativeSpec, WorkerSpec};
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_index::hash::{external, BlockHasher, HashAlgo, DEFAULT_SEED};
use kvroute_index::{BlockExtras, CacheKind, Engine, Event, Query, Stored};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

async fn gateway(workers: Vec<WorkerSpec>) -> GatewayHandle {
    let cfg = GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        health_interval_secs: 0.05,
        workers,
        ..GatewayConfig::default()
    };
    Gateway::start(cfg).await.unwrap()
}

/// The admin view of worker `name` once `ready` holds for it; fails the test when it does not
/// within the wait's deadline.
async fn view_when(gw: &GatewayHandle, name: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let url = format!("http://{}/admin/workers", gw.admin_addr);
    let what = format!("worker {name} to get there");
    common::wait_for(common::WAIT, &what, || async {
        let body: Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
        let w = body["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == name))
            .cloned()
            .unwrap_or(Value::Null);
        if !w.is_null() && ready(&w) {
            Ok(w)
        } else {
            Err(w.to_string())
        }
    })
    .await
}

/// A stand-in engine: `/health`, `/metrics`, and `/version` answering `version` (404 when
/// `None`); counts the `/version` requests and the health checks.
async fn stand_in(version: Option<&'static str>) -> (String, Arc<AtomicU64>, Arc<AtomicU64>) {
    let asked = Arc::new(AtomicU64::new(0));
    let counter = asked.clone();
    let checked = Arc::new(AtomicU64::new(0));
    let checks = checked.clone();
    let app = Router::new()
        .route(
            "/health",
            get(move || {
                checks.fetch_add(1, Ordering::Relaxed);
                async { "" }
            }),
        )
        .route("/metrics", get(|| async { "" }))
        .route(
            "/version",
            get(move || {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::Relaxed);
                    match version {
                        Some(v) => (
                            axum::http::StatusCode::OK,
                            json!({ "version": v }).to_string(),
                        ),
                        None => (axum::http::StatusCode::NOT_FOUND, String::new()),
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), asked, checked)
}

fn detected(w: &Value) -> bool {
    w["engine_source"] != "assumed" || !w["engine_version"].is_null()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_0_32_worker_is_detected_from_its_version() {
    let mut cfg = WorkerConfig::for_preset("tiny-gemma3").unwrap();
    cfg.speedup = 1000.0;
    let fleet = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    let h = &fleet.workers[0];
    let gw = gateway(vec![WorkerSpec::new(&h.name, &h.base_url, "tiny-gemma3")]).await;
    let w = view_when(&gw, &h.name, detected).await;
    assert_eq!(w["engine"], "vllm-0.32", "{w}");
    assert_eq!(w["engine_source"], "detected", "{w}");
    assert_eq!(
        w["engine_version"],
        kvroute_sim::http::ENGINE_VERSION,
        "{w}"
    );
    assert_eq!(
        (
            w["hash_lookahead_tokens"].as_u64(),
            w["eagle_drop"].as_bool()
        ),
        (Some(0), Some(false))
    );
    let index_cfg = gw
        .state
        .registry
        .index
        .worker_config(&h.name.as_str().into());
    assert_eq!(index_cfg.engine, Engine::Vllm032);
    gw.shutdown().await;
    drop(fleet);
}

/// The chain of `tokens` at block 16 with `lookahead` lookahead tokens.
fn chain(tokens: &[u32], lookahead: usize) -> Vec<u64> {
    BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED)
        .chain_lookahead(tokens, 16, &BlockExtras::default(), lookahead)
        .iter()
        .map(|d| external(d).0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_reporting_0_33_is_predicted_by_0_33_s_rules() {
    let (url, _, _) = stand_in(Some("0.33.0")).await;
    let mut spec = WorkerSpec::new("eagle", &url, "m");
    spec.speculative = SpeculativeSpec::Flag(true);
    let gw = gateway(vec![spec]).await;
    let w = view_when(&gw, "eagle", |w| w["engine_source"] == "detected").await;
    assert_eq!(w["engine"], "vllm-0.33", "{w}");
    assert_eq!(w["engine_version"], "0.33.0", "{w}");
    // EAGLE on 0.33: one lookahead token, no drop.
    assert_eq!(
        (
            w["hash_lookahead_tokens"].as_u64(),
            w["eagle_drop"].as_bool()
        ),
        (Some(1), Some(false)),
        "{w}"
    );
    // The index predicts it so: a block-aligned store of the engine's lookahead hashes of
    // 100 tokens serves all six blocks (0.32 with EAGLE would drop one: 80).
    let index = &gw.state.registry.index;
    let tokens: Vec<u32> = (0..100).map(|i| i * 37 % 1000).collect();
    index.apply(&Event::Stored(Stored::device(
        "eagle",
        0,
        CacheKind::FullAttention,
        None,
        16,
        &chain(&tokens, 1),
    )));
    let q = Query {
        tokens,
        ..Query::default()
    };
    assert_eq!(index.predict(&"eagle".into(), 0, &q).cached, 96);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_engine_is_kept_whatever_the_worker_reports() {
    let (url, _, _) = stand_in(Some("0.32.0")).await;
    let mut spec = WorkerSpec::new("pinned", &url, "m");
    spec.engine = Some(Engine::Vllm033);
    let gw = gateway(vec![spec]).await;
    let w = view_when(&gw, "pinned", |w| !w["engine_version"].is_null()).await;
    assert_eq!(
        (&w["engine"], &w["engine_source"], &w["engine_version"]),
        (&json!("vllm-0.33"), &json!("configured"), &json!("0.32.0")),
        "{w}"
    );
    let cfg = gw.state.registry.index.worker_config(&"pinned".into());
    assert_eq!(cfg.engine, Engine::Vllm033);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsupported_or_missing_version_keeps_0_32_s_rules_and_is_asked_once() {
    let (newer, _, _) = stand_in(Some("0.34.1")).await;
    let (silent, asked, checked) = stand_in(None).await;
    let gw = gateway(vec![
        WorkerSpec::new("newer", &newer, "m"),
        WorkerSpec::new("silent", &silent, "m"),
    ])
    .await;
    let w = view_when(&gw, "newer", |w| !w["engine_version"].is_null()).await;
    assert_eq!(
        (&w["engine"], &w["engine_source"], &w["engine_version"]),
        (&json!("vllm-0.32"), &json!("assumed"), &json!("0.34.1")),
        "{w}"
    );
    // A 404 is an answer: after many health rounds /version was asked once.
    common::wait_until(common::WAIT, "/version asked", || async {
        asked.load(Ordering::Relaxed) > 0
    })
    .await;
    let from = checked.load(Ordering::Relaxed);
    common::wait_until(common::WAIT, "five more health rounds", || async {
        checked.load(Ordering::Relaxed) >= from + 5
    })
    .await;
    assert_eq!(asked.load(Ordering::Relaxed), 1);
    let w = view_when(&gw, "silent", |_| true).await;
    assert_eq!(
        (&w["engine"], &w["engine_source"], &w["engine_version"]),
        (&json!("vllm-0.32"), &json!("assumed"), &Value::Null),
        "{w}"
    );
    gw.shutdown().await;
}
