//! The gateway's own probes: `/health/live` (the process serves) and `/health/ready` (at
//! least one routable worker, and every healthy worker's event subscriptions past their first
//! catch-up, so a restarted router predicts from a caught-up index before it takes traffic; a
//! subscription still not caught up after a grace period no longer holds readiness back).
//!
//! Owns: the two handlers and the grace period ([`CATCH_UP_GRACE`]).
//! Must not: probe the workers (the health check, [`super::health`], does) or change anything.

use super::state::AppState;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

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
