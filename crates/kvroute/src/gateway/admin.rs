//! The admin API: list, add, remove and drain workers; switch the policy; reload the
//! configuration file; explain a request; list the tenants (names, limits and requests in
//! flight; never their keys); the snapshot's state, and writing one now; the replicas'
//! booking channel (`/admin/peers`, and the batches peers post to `/admin/peers/bookings`).
//!
//! Owns: `/admin/*` on the admin listener (loopback unless configured), behind a bearer token
//! when one is configured. Adding a worker starts its event subscriptions; removing it drops
//! its index state. The worker list names each worker's source (`static`, `dns`, `dir`, or
//! `admin` for workers added here, which the reconciler never removes).
//! Must not: be reachable without the token when a token is set.

use super::config::WorkerSpec;
use super::decide::{candidates_for, decide_with, RouteRequest};
use super::registry::{Registry, RegistryError};
use super::reload::ReloadError;
use super::reply::error;
use super::state::AppState;
use super::tenants::same_secret;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvroute_route::terms::conversation_life_ms;
use kvroute_route::PolicyKind;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

pub async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(token) = &st.config().admin_token {
        let ok = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| same_secret(t.as_bytes(), token.expose().as_bytes()));
        if !ok {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        }
    }
    next.run(req).await
}

fn registry_error(e: RegistryError) -> Response {
    match e {
        RegistryError::Exists(_) => error(StatusCode::CONFLICT, e.to_string()),
        RegistryError::Unknown(_) => error(StatusCode::NOT_FOUND, e.to_string()),
        RegistryError::Invalid(_) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

pub async fn list(State(st): State<Arc<AppState>>) -> Response {
    let now = std::time::Instant::now();
    let k = st.registry.follow_ups.expected();
    let cycle = st.registry.turns.cycle();
    let life_ms = conversation_life_ms(k, cycle).unwrap_or(0.0);
    let workers: Vec<_> = st
        .registry
        .all()
        .iter()
        .map(|w| {
            let mut v = serde_json::to_value(w.view()).unwrap_or_default();
            let source = st
                .fleet
                .source_of(&w.spec.name)
                .map_or("admin", |s| s.name());
            let (live, per_ms) = {
                let l = w.learners.lock();
                (l.live.count(now, life_ms), l.arrivals.per_ms(now))
            };
            if let Some(o) = v.as_object_mut() {
                o.insert("source".into(), source.into());
                o.insert("live_conversations".into(), live.into());
                o.insert("requests_per_s".into(), (per_ms * 1e3).into());
            }
            v
        })
        .collect();
    Json(json!({
        "policy": st.policy().name(),
        "workers": workers,
        "fleet_ttft_model": st.registry.fleet_ttft.view(),
        "fleet_decode_model": st.registry.fleet_decode.view(),
        "mean_output_tokens": st.registry.output_tokens.mean(),
        "conversations": {
            "expected_follow_ups": k,
            "turn_cycle_ms": cycle.map(|(gap, _)| gap),
            "follow_up_prefill_ms": cycle.map(|(_, s)| s),
        },
        "index": st.registry.index.stats(),
    }))
    .into_response()
}

pub async fn add(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let spec: WorkerSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid worker spec: {e}")),
    };
    match st.registry.add(spec) {
        Ok(w) => (StatusCode::CREATED, Json(w.view())).into_response(),
        Err(e) => registry_error(e),
    }
}

pub async fn remove(State(st): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    match st.registry.remove(&name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => registry_error(e),
    }
}

#[derive(Deserialize)]
pub struct DrainBody {
    #[serde(default = "yes")]
    drain: bool,
}
fn yes() -> bool {
    true
}

pub async fn drain(
    State(st): State<Arc<AppState>>,
    Path(name): Path<String>,
    body: Option<Json<DrainBody>>,
) -> Response {
    let drain = body.is_none_or(|b| b.drain);
    match st.registry.drain(&name, drain) {
        Ok(()) => Json(json!({"worker": name, "draining": drain})).into_response(),
        Err(e) => registry_error(e),
    }
}

/// The front door's tenants: names, limits, key counts, requests in flight.
pub async fn tenants(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"tenants": st.tenants.view()})).into_response()
}

#[derive(Deserialize)]
pub struct PolicyBody {
    policy: String,
}

pub async fn set_policy(State(st): State<Arc<AppState>>, Json(b): Json<PolicyBody>) -> Response {
    match b.policy.parse::<PolicyKind>() {
        Ok(p) => {
            *st.policy.write() = p;
            Json(json!({"policy": p.name()})).into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, e),
    }
}

/// Reads the configuration file again and applies it: 200 with what changed, 400 with the
/// reason when it is invalid (nothing applied), 409 when the gateway has no file.
pub async fn reload(State(st): State<Arc<AppState>>) -> Response {
    match super::reload::reload(&st).await {
        Ok(report) => Json(report).into_response(),
        Err(e @ ReloadError::NoFile) => error(StatusCode::CONFLICT, e.to_string()),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

#[derive(Deserialize)]
pub struct ExplainBody {
    tokens: Vec<u32>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// Every worker's prediction and the decision the gateway would take now.
pub async fn explain(State(st): State<Arc<AppState>>, Json(b): Json<ExplainBody>) -> Response {
    let model = b
        .model
        .or_else(|| st.registry.models().into_iter().next())
        .unwrap_or_default();
    let mut workers = candidates_for(&st.registry, &model);
    let lora = Registry::adapter_key(&model, &mut workers);
    let extras = kvroute_index::BlockExtras {
        cache_salt: b.cache_salt.clone(),
        lora,
    };
    let q = kvroute_index::Query {
        tokens: b.tokens.clone(),
        extras: extras.clone(),
        skip_prefix_cache: false,
    };
    let predictions = st.registry.index.predict_all(&q);
    // A pure read: no placement's readings are brought up to date and nothing is recorded,
    // so asking changes nothing the next request gets.
    let req = RouteRequest {
        tokens: &b.tokens,
        extras,
        skip_prefix_cache: false,
        follow_up: st.registry.follow_ups.extends_earlier(&b.tokens),
        max_tokens: None,
        rr: 0,
        evidence: true,
    };
    let ranked = decide_with(
        &st.registry,
        &workers,
        req,
        st.policy(),
        &st.config().weights,
    );
    Json(json!({"predictions": predictions, "decision": ranked.decision})).into_response()
}

/// `GET /admin/snapshot`: what the start loaded, the last write, counts.
pub async fn snapshot_status(State(st): State<Arc<AppState>>) -> Response {
    let status = st.snapshot.lock().clone();
    Json(status).into_response()
}

/// `POST /admin/snapshot`: writes a snapshot now (409 without `snapshot_path`).
pub async fn snapshot_now(State(st): State<Arc<AppState>>) -> Response {
    match st.write_snapshot().await {
        None => error(
            StatusCode::CONFLICT,
            "no snapshot_path is configured (--snapshot-path FILE)",
        ),
        Some(Ok(w)) => Json(w).into_response(),
        Some(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

/// `GET /admin/peers`: this replica's name, its peers, its open bookings and the other
/// replicas heard from.
pub async fn peers(State(st): State<Arc<AppState>>) -> Response {
    Json(st.peers.view(std::time::Instant::now())).into_response()
}

/// `POST /admin/peers/bookings`: a batch another replica announces ([`super::peers`]). A body
/// that does not parse is refused whole (400) and counted; a message that cannot apply is
/// dropped alone and counted.
pub async fn peer_bookings(State(st): State<Arc<AppState>>, body: axum::body::Bytes) -> Response {
    let pm = &st.metrics.peers;
    pm.bytes
        .with_label_values(&["received"])
        .inc_by(body.len() as u64);
    let batch: super::peer_wire::Batch = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            pm.dropped.with_label_values(&["malformed"]).inc();
            return error(StatusCode::BAD_REQUEST, format!("not a booking batch: {e}"));
        }
    };
    let got = st
        .peers
        .receive(batch, &st.registry, std::time::Instant::now());
    Json(got).into_response()
}
