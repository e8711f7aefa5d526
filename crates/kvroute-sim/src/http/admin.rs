//! The simulated worker's admin endpoints: the test and benchmark hooks vLLM does not have,
//! and the side channel of disaggregated serving.
//!
//! Owns: `GET /admin/requests` (finished requests by prompt digest, for `kvroute bench
//! --engine-urls`), `GET /admin/trace_context` (the W3C trace context the last completion
//! requests arrived with), `GET /admin/cache` (the true cache state), `POST /admin/faults` (wire
//! faults), `/admin/restart`, `/admin/pause`, `/admin/resume`, and `POST /admin/kv_pull` (a
//! decode worker's pull of a prefill worker's KV, [`crate::disagg`]).
//! Invariants: a body is optional where every field is (an empty body reads as `{}`); an
//! unknown fault field is a 400; a pull succeeds once per request, within its lease.
//! Must not: hold engine locks across awaits.

use super::{bad, error, parse_body, ApiError, Body, W};
use crate::publisher::WireFaults;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;

/// `GET /admin/requests?since=N`: the finished requests from `seq` N on (engine times and
/// cached tokens by prompt digest), and `total`, how many finished in all.
pub(super) async fn admin_requests(
    State(w): W,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
) -> Response {
    let since = q.get("since").and_then(|s| s.parse().ok()).unwrap_or(0);
    let (requests, total) = w.finished_since(since);
    Json(json!({ "total": total, "requests": requests })).into_response()
}

/// `GET /admin/trace_context`: the `traceparent` and `tracestate` the last
/// [`crate::trace_context::KEPT`] completion requests arrived with (`null` when absent), by
/// response id, oldest first, and `total`, how many were recorded in all.
pub(super) async fn admin_trace_context(State(w): W) -> Response {
    let (received, total) = w.trace_contexts().snapshot();
    Json(json!({ "total": total, "received": received })).into_response()
}

pub(super) async fn admin_cache(State(w): W) -> Response {
    Json(w.cache_state()).into_response()
}

fn opt_body(body: &Body) -> Result<Value, ApiError> {
    if body.as_ref().is_ok_and(|b| b.is_empty()) {
        Ok(json!({}))
    } else {
        parse_body(body)
    }
}

pub(super) async fn admin_faults(State(w): W, body: Body) -> Response {
    let b = match opt_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let f: WireFaults = match serde_json::from_value(b) {
        Ok(f) => f,
        Err(e) => return bad(format!("faults: {e}")).into_response(),
    };
    w.set_wire_faults(&f);
    Json(json!({
        "drop_batches": f.drop_batches,
        "delay_ms": f.delay_ms,
        "duplicate_batches": f.duplicate_batches,
        "reorder_batches": f.reorder_batches,
        "clock_offset_ms": f.clock_offset_ms,
        "garbage_replay": f.garbage_replay,
    }))
    .into_response()
}

pub(super) async fn admin_restart(State(w): W, body: Body) -> Response {
    let b = match opt_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let clear = b
        .get("clear_cache")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    match w.restart(clear) {
        Ok(()) => Json(json!({ "restarted": true, "clear_cache": clear })).into_response(),
        Err(e) => bad(e.to_string()).into_response(),
    }
}

/// `POST /admin/kv_pull` `{remote_engine_id, remote_request_id}`: a decode worker takes the
/// KV this prefill worker holds for the request (`{"num_tokens": N}`), once, within the lease.
pub(super) async fn admin_kv_pull(State(w): W, body: Body) -> Response {
    let b = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let Some(cfg) = w
        .config()
        .kv_transfer
        .as_ref()
        .filter(|c| c.role.produces())
    else {
        return error(StatusCode::NOT_FOUND, "this worker prefills for nobody").into_response();
    };
    let engine = b.get("remote_engine_id").and_then(Value::as_str);
    if engine != Some(cfg.engine_id.as_str()) {
        return error(
            StatusCode::NOT_FOUND,
            format!("engine {engine:?} is not this worker ({})", cfg.engine_id),
        )
        .into_response();
    }
    let Some(id) = b.get("remote_request_id").and_then(Value::as_str) else {
        return bad("`remote_request_id` must be a string").into_response();
    };
    match w.leases().take(id, std::time::Instant::now()) {
        Some(n) => Json(json!({ "num_tokens": n })).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            format!("no KV held for request {id}: never prefilled here, pulled, or expired"),
        )
        .into_response(),
    }
}

pub(super) async fn admin_pause(State(w): W) -> Response {
    w.pause();
    Json(json!({ "paused": true })).into_response()
}

pub(super) async fn admin_resume(State(w): W) -> Response {
    w.resume();
    Json(json!({ "paused": false })).into_response()
}
