//! Health checks: `/health` of every worker, with backoff, and each vLLM worker's `/version`
//! once.
//!
//! Owns: the background loop that probes each worker when due (healthy: every interval;
//! failing: exponential backoff up to 30 s), asks a healthy worker's `GET /version` until it
//! answers (the registry then records the engine generation), and reads the LoRA adapters its
//! `GET /v1/models` lists (entries with a `parent`; `root` is the adapter's path). The
//! engines' load figures are polled by [`super::engine_poll`].
//! Also the gateway's own probes: `/health/live` (the process serves) and `/health/ready` (at
//! least one routable worker, and every healthy worker's event subscriptions past their first
//! catch-up, so a restarted router predicts from a caught-up index before it takes traffic; a
//! subscription still not caught up after a grace period no longer holds readiness back).
//! Must not: remove workers (only mark them).

use super::registry::Registry;
use super::AppState;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker's `GET /version`: `Some(Some(version))` when it names one, `Some(None)` when it
/// answers without one (not a vLLM server: not asked again), `None` when it did not answer (asked
/// again next time).
async fn ask_version(client: &reqwest::Client, base: &str) -> Option<Option<String>> {
    let r = client
        .get(format!("{base}/version"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    if r.status().is_server_error() {
        return None;
    }
    if !r.status().is_success() {
        return Some(None);
    }
    let body: serde_json::Value = match r.json().await {
        Ok(v) => v,
        Err(_) => return Some(None),
    };
    Some(
        body.get("version")
            .and_then(|v| v.as_str())
            .map(str::to_string),
    )
}

/// The LoRA adapters a worker's `GET /v1/models` lists, as vLLM lists them (`id` the name,
/// `parent` the base model, `root` the path); `None` when it gave no usable list.
async fn ask_adapters(
    client: &reqwest::Client,
    base: &str,
) -> Option<std::collections::BTreeMap<String, String>> {
    let r = client
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    let body: serde_json::Value = r.json().await.ok()?;
    let listed = body.get("data")?.as_array()?;
    Some(
        listed
            .iter()
            .filter(|m| m.get("parent").is_some_and(|p| p.is_string()))
            .filter_map(|m| {
                let name = m.get("id")?.as_str()?;
                let path = m.get("root")?.as_str()?;
                Some((name.to_string(), path.to_string()))
            })
            .collect(),
    )
}

pub async fn run(
    registry: Arc<Registry>,
    client: reqwest::Client,
    interval: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let now = Instant::now();
        for w in registry.all() {
            if *w.next_check.lock() > now {
                continue;
            }
            let base = w.spec.url.trim_end_matches('/').to_string();
            let ok = matches!(
                client.get(format!("{base}/health")).timeout(Duration::from_secs(2)).send().await,
                Ok(r) if r.status().is_success()
            );
            if ok {
                w.mark_success();
                *w.next_check.lock() = Instant::now() + interval;
                if w.wants_version() {
                    let version = ask_version(&client, &base).await;
                    if let Some(v) = version {
                        registry.engine_reported(&w, v.as_deref());
                    }
                }
                if let Some(adapters) = ask_adapters(&client, &base).await {
                    w.adapters_listed(adapters);
                }
            } else {
                w.mark_failure();
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval.min(Duration::from_millis(250))) => {}
            _ = stop.changed() => return,
        }
    }
}

/// `GET /health/live`: the process is serving.
pub async fn live() -> Response {
    Json(json!({"status": "live"})).into_response()
}

/// How long after the start readiness waits for every subscription's first catch-up; after it a
/// subscription that cannot reach its engine's event port no longer holds the gateway out of
/// service (it is listed in the answer instead).
pub const CATCH_UP_GRACE: Duration = Duration::from_secs(10);

/// `GET /health/ready`: 200 once a worker is routable and every healthy worker's subscriptions
/// finished their first catch-up (replay after a start or a warm restart), or
/// [`CATCH_UP_GRACE`] passed; 503 with the reason before.
pub async fn ready(State(st): State<Arc<AppState>>) -> Response {
    let all = st.registry.all();
    let routable = all.iter().filter(|w| w.routable()).count();
    let catching_up: Vec<String> = all
        .iter()
        .filter(|w| w.healthy.load(std::sync::atomic::Ordering::Relaxed))
        .filter(|w| w.sinks.lock().iter().any(|s| !s.synced()))
        .map(|w| w.spec.name.clone())
        .collect();
    let grace_over = st.started.elapsed() >= CATCH_UP_GRACE;
    let ready = routable > 0 && (catching_up.is_empty() || grace_over);
    let reason = if routable == 0 {
        "no routable worker"
    } else if !catching_up.is_empty() && !grace_over {
        "event subscriptions still catching up"
    } else if !catching_up.is_empty() {
        "ready; some event subscriptions have not caught up (their workers are predicted from what arrived)"
    } else {
        "ready"
    };
    let body = Json(json!({
        "status": if ready { "ready" } else { "not_ready" },
        "reason": reason,
        "routable_workers": routable,
        "catching_up": catching_up,
    }));
    if ready {
        body.into_response()
    } else {
        let mut r = (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
        r
    }
}
