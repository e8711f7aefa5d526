//! The OpenAI-compatible front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//! `/health`, `/metrics`.
//!
//! Owns: request validation and which OpenAI-style error each refusal gets (400 malformed, 404
//! unknown model, 413 too large, 503 + `Retry-After` when no worker is healthy, 502 when the
//! chosen worker fails and no retry is possible; the bodies are [`super::reply`]'s), the front
//! door's checks ([`super::tenants`]: 401 before anything else, 429 for concurrency and rate
//! before the body is read, for tokens once the prompt is tokenized; the admission held until
//! the response body is dropped), tokenization, the decision, and one retry on the next-best
//! worker when the upstream failed before any byte reached the client. Forwarding itself (SSE
//! passed through, load accounting, recording the engine-reported cached tokens against the
//! prediction) is [`super::forward`]'s; a model with prefill and decode workers is handed to
//! [`super::disagg`] after the decision. Each request's trace ([`super::otel`]) is started
//! here: the root span, then one span per stage (`parse`, `tokenize`, `decide` with the
//! decision's attributes), ended with the answer's body.
//! Must not: rewrite the request body or the response (besides the decision header).

use super::decide::{candidates_for, decide_with, prepare, Ranked, RouteRequest};
use super::disagg;
use super::forward::{attach_decision, forward, Booking, Endpoint, Outgoing};
use super::observe;
use super::otel::RequestTrace;
use super::peer_wire::Learned;
use super::registry::{Registry, Worker};
use super::reply::{error, invalid};
use super::request;
use super::sessions::Mark;
use super::state::AppState;
use super::tenants::{completion_budget, Admission};
use super::tokenize::{PromptInput, TokenizeError};
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use kvroute_index::BlockExtras;
use kvroute_route::PolicyKind;
use opentelemetry::KeyValue;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, headers, body, Endpoint::Completions).await
}

pub async fn chat(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(st, headers, body, Endpoint::Chat).await
}

async fn handle(st: Arc<AppState>, headers: HeaderMap, body: Body, ep: Endpoint) -> Response {
    let trace = st.otel.request(&headers, ep.span_name(), ep.path());
    let r = match st.tenants.admit(&headers) {
        Err(rejected) => rejected.into_response(),
        Ok(admission) => {
            let r = route(&st, &headers, body, ep, admission.as_ref(), &trace).await;
            held_until_body_ends(r, admission)
        }
    };
    let class = format!("{}xx", r.status().as_u16() / 100);
    st.metrics
        .requests
        .with_label_values(&[ep.label(), &class])
        .inc();
    trace.finish(r)
}

/// Keeps the tenant's admission (its concurrency slot) alive as long as a streamed body; a
/// buffered body is complete already, so the slot is released now.
fn held_until_body_ends(r: Response, admission: Option<Admission>) -> Response {
    let Some(admission) = admission else {
        return r;
    };
    if r.body().size_hint().exact().is_some() {
        return r;
    }
    let (parts, body) = r.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held: &Admission = &admission;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// The body, bounded in size (413) and in the time the client takes to send it (408); a body
/// that ends early (the client went away) is 400.
async fn read_body(st: &AppState, body: Body) -> Result<Bytes, Response> {
    let cfg = st.config();
    let limit = cfg.max_body_bytes;
    let wait = Duration::from_secs_f64(cfg.body_timeout_secs);
    match tokio::time::timeout(wait, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            Err(if too_large {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("request body larger than {limit} bytes"),
                )
            } else {
                error(
                    StatusCode::BAD_REQUEST,
                    format!("the request body could not be read: {e}"),
                )
            })
        }
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                wait.as_secs_f64()
            ),
        )),
    }
}

/// A request's way through the gateway, in stages: [`admit`] (body, parse → validate,
/// candidates, tokens, the tenant's token charge), [`decide`] (the placement's readings, the
/// routing core's decision, its records and metrics), then [`disagg::serve`] for a model split
/// into prefill and decode pools, or [`serve`] (forwarding with one retry).
async fn route(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
    ep: Endpoint,
    admission: Option<&Admission>,
    trace: &RequestTrace,
) -> Response {
    let admitted = match admit(st, body, ep, admission, trace).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let explain = st.config().explain_always
        || headers
            .get("x-kvroute-explain")
            .is_some_and(|v| v.as_bytes() == b"1" || v.as_bytes() == b"true");
    let mut stage = trace.stage("decide");
    let decided = decide(st, &admitted, explain);
    stage.record(|| decision_attributes(&decided));
    drop(stage);
    if let Some(decode) = &decided.decode {
        let legs = disagg::Legs {
            ep,
            req: &admitted.req,
            stream: admitted.stream,
            prefill: &decided.ranked,
            decode,
            policy: decided.policy.name(),
            explain,
            trace,
        };
        return disagg::serve(st, legs).await;
    }
    serve(st, ep, &admitted, &decided, explain, trace).await
}

/// The `decide` span's attributes: the policy, the worker ranked first and what was predicted
/// for it, the prompt's length and how many candidates were ranked (the decode worker of a
/// split model too).
fn decision_attributes(d: &Decided<'_>) -> Vec<KeyValue> {
    let dec = &d.ranked.decision;
    let hit = if dec.prompt_tokens > 0 {
        dec.predicted_cached as f64 / dec.prompt_tokens as f64
    } else {
        0.0
    };
    let mut a = vec![
        KeyValue::new("kvroute.policy", d.policy.name()),
        KeyValue::new("kvroute.worker", dec.worker.clone()),
        KeyValue::new("kvroute.prompt_tokens", dec.prompt_tokens as i64),
        KeyValue::new("kvroute.candidates", dec.candidates.len() as i64),
        KeyValue::new(
            "kvroute.predicted_cached_tokens",
            dec.predicted_cached as i64,
        ),
        KeyValue::new("kvroute.predicted_hit_ratio", hit),
        KeyValue::new("kvroute.predicted_ttft_ms", dec.predicted_ttft_ms),
        KeyValue::new("kvroute.decision_us", dec.decision_us as i64),
    ];
    if let Some(decode) = &d.decode {
        a.push(KeyValue::new(
            "kvroute.decode_worker",
            decode.decision.worker.clone(),
        ));
    }
    a
}

/// A request the front door let in: its body, how it is hashed, its candidates and its tokens.
struct Admitted {
    raw: Bytes,
    req: Value,
    stream: bool,
    skip_prefix_cache: bool,
    extras: BlockExtras,
    workers: Vec<Arc<Worker>>,
    tokens: Vec<u32>,
}

/// Reads and validates the body (the `parse` stage), finds the workers serving its model (an
/// adapter request is hashed with the adapter's key, on the workers serving it), tokenizes the
/// prompt (the `tokenize` stage), and charges the tenant its tokens.
async fn admit(
    st: &Arc<AppState>,
    body: Body,
    ep: Endpoint,
    admission: Option<&Admission>,
    trace: &RequestTrace,
) -> Result<Admitted, Response> {
    let mut stage = trace.stage("parse");
    let raw = read_body(st, body)
        .await
        .inspect_err(|_| stage.fail(|| "the body could not be read".into()))?;
    let parsed =
        request::parse(&raw, ep == Endpoint::Chat, &st.registry.models()).map_err(|e| {
            stage.fail(|| e.message.clone());
            invalid(e)
        })?;
    drop(stage);
    let request::Parsed {
        body: req,
        model,
        input,
        salt,
        stream,
        skip_prefix_cache,
    } = parsed;
    let mut workers = candidates_for(&st.registry, &model);
    let lora = Registry::adapter_key(&model, &mut workers);
    if workers.is_empty() {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no healthy worker serves `{model}`"),
        ));
    }
    trace.record(|| vec![KeyValue::new("gen_ai.request.model", model.clone())]);
    let mut stage = trace.stage("tokenize");
    let tokens = tokenize(st, &input, &model, &workers).await;
    if let Err(e) = &tokens {
        stage.fail(|| e.to_string());
    }
    stage.record(|| {
        let n = tokens.as_ref().map_or(0, Vec::len);
        vec![KeyValue::new("kvroute.prompt_tokens", n as i64)]
    });
    drop(stage);
    let tokens = match tokens {
        Ok(t) => t,
        Err(TokenizeError::Invalid(m)) => return Err(error(StatusCode::BAD_REQUEST, m)),
        Err(e) => return Err(error(StatusCode::BAD_GATEWAY, e.to_string())),
    };
    if tokens.is_empty() {
        return Err(error(StatusCode::BAD_REQUEST, "the prompt is empty"));
    }
    if let Some(a) = admission {
        st.tenants
            .charge(a, tokens.len() as u64, completion_budget(&req))
            .map_err(|rejected| rejected.into_response())?;
    }
    Ok(Admitted {
        raw,
        req,
        stream,
        skip_prefix_cache,
        extras: BlockExtras {
            cache_salt: salt,
            lora,
        },
        workers,
        tokens,
    })
}

/// Where an admitted request goes: the ranked (prefill, for a split model) pool, the decode
/// pool's ranking for a split model, and the policy that ranked them.
struct Decided<'a> {
    ranked: Ranked<'a>,
    decode: Option<Ranked<'a>>,
    policy: PolicyKind,
}

/// Applies a placement's records to the learners and announces them to the peers when
/// learning is shared.
fn record_placement(
    st: &AppState,
    ranked: &Ranked<'_>,
    follow_up: (Option<Duration>, Option<Mark>),
    next_arrivals: bool,
) {
    let Some(w) = ranked.order.first() else {
        return;
    };
    let moved = ranked.decision.best_cached > ranked.decision.predicted_cached;
    let cands = &ranked.decision.candidates;
    if let Some(p) = observe::placement(w, cands, follow_up, moved, next_arrivals) {
        observe::placed(&st.registry, w, &p, Instant::now());
        st.peers.outbox.learned(Learned::Placed(p));
    }
}

/// The request's turn among equal candidates: this gateway's decisions plus the placements
/// its peers announced, so replicas sharing what they learn take turns across the fleet as one
/// gateway does (each counting its own alone, the first request each replica sees after a
/// quiet spell would take the same worker). A gateway alone counts its own decisions.
fn tie_break_turn(st: &AppState) -> u64 {
    st.rr
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_add(st.registry.peer_placements())
}

/// Decides where an admitted request goes: its follow-up status (recorded once here), the
/// readings the placement brings up to date ([`prepare`]), the routing core's ranking of the
/// first pool (the prefill pool of a split model, then its decode pool), the decision's
/// metrics and the placement's records.
fn decide<'a>(st: &Arc<AppState>, a: &'a Admitted, explain: bool) -> Decided<'a> {
    let policy = st.policy();
    let follow_up = if policy.uses_cache() {
        st.registry
            .follow_ups
            .observe_marked(&a.tokens, Instant::now())
    } else {
        (None, None)
    };
    let turn_gap = follow_up.0;
    if turn_gap.is_some() {
        st.metrics.follow_ups.inc();
    }
    let rr = tie_break_turn(st);
    let pd = disagg::pools(&a.workers);
    let weights = st.config().weights.clone();
    let max_tokens = a
        .req
        .get("max_tokens")
        .and_then(Value::as_u64)
        .or_else(|| a.req.get("max_completion_tokens").and_then(Value::as_u64));
    let rank_pool = |pool: &[Arc<Worker>]| {
        prepare(&st.registry, pool, policy, &weights);
        let req = RouteRequest {
            tokens: &a.tokens,
            extras: a.extras.clone(),
            skip_prefix_cache: a.skip_prefix_cache,
            follow_up: turn_gap.is_some(),
            max_tokens,
            rr,
            evidence: explain,
        };
        decide_with(&st.registry, pool, req, policy, &weights)
    };
    let ranked = rank_pool(pd.as_ref().map_or(&a.workers, |p| &p.prefill));
    record_decision(st, &ranked, policy);
    if policy.uses_cache() {
        record_placement(st, &ranked, follow_up, weights.next_arrivals);
    }
    // The decode pool is ranked by the same policy: its load, and its own hit (the part of
    // the prompt it need not pull).
    let decode = pd.as_ref().map(|p| {
        let d = rank_pool(&p.decode);
        sample_load_waits(st, &d);
        d
    });
    Decided {
        ranked,
        decode,
        policy,
    }
}

/// A decision's metrics (its time, the cache it gave up for load or a junction, group-blind's
/// gap) and each candidate's load-wait sample.
fn record_decision(st: &AppState, ranked: &Ranked<'_>, policy: PolicyKind) {
    st.metrics
        .expected_follow_ups
        .set(ranked.decision.follow_ups);
    sample_load_waits(st, ranked);
    st.metrics
        .decision_seconds
        .with_label_values(&[policy.name()])
        .observe(ranked.decision.decision_us as f64 / 1e6);
    let forgone = ranked
        .decision
        .best_cached
        .saturating_sub(ranked.decision.predicted_cached);
    if forgone > 0 {
        st.metrics
            .cache_overridden
            .with_label_values(&[policy.name()])
            .inc();
        st.metrics
            .cached_forgone
            .with_label_values(&[policy.name()])
            .inc_by(forgone);
    }
    if policy == PolicyKind::HybridAware {
        st.metrics.record_blind_gap(&ranked.decision.candidates);
    }
}

/// Forwards the request to its best worker, and once to the next when the first failed before
/// any byte reached the client; the decision header goes on the answer when explained.
async fn serve(
    st: &Arc<AppState>,
    ep: Endpoint,
    a: &Admitted,
    d: &Decided<'_>,
    explain: bool,
    trace: &RequestTrace,
) -> Response {
    let ranked = &d.ranked;
    let mut last_err = String::new();
    for (attempt, worker) in ranked.order.iter().take(2).enumerate() {
        let booking = Booking::for_candidate(ranked, worker, false);
        let mut decision = ranked.decision.clone();
        decision.worker = worker.spec.name.clone();
        decision.predicted_cached = booking.predicted;
        decision.predicted_ttft_ms = booking.work.map_or(0.0, |(_, ms)| ms);
        let out = Outgoing {
            ep,
            body: a.raw.clone(),
            stream: a.stream,
            trace,
            leg: "whole",
            attempt,
        };
        match forward(st, worker, out, booking).await {
            Ok(mut resp) => {
                st.metrics
                    .decisions
                    .with_label_values(&[d.policy.name(), &worker.spec.name])
                    .inc();
                if attempt > 0 {
                    st.metrics
                        .retries
                        .with_label_values(&[&ranked.order[0].spec.name])
                        .inc();
                }
                if explain {
                    attach_decision(&mut resp, &decision);
                }
                return resp;
            }
            Err(e) => {
                tracing::warn!(worker = %worker.spec.name, error = %e.message, "upstream failed");
                last_err = e.message;
                if !e.retryable {
                    break;
                }
            }
        }
    }
    error(
        StatusCode::BAD_GATEWAY,
        format!("upstream failed: {last_err}"),
    )
}

/// Each ranked worker's load wait and running requests, sampled once per decision (every
/// candidate alike), weighed by the fleet's placements since each worker's last sample (at
/// most one per replica sharing the traffic).
fn sample_load_waits(st: &AppState, r: &Ranked<'_>) {
    let placements = st.registry.placements();
    let replicas = 1 + st.peers.heard() as u64;
    for (c, w) in r.decision.candidates.iter().zip(&r.order) {
        w.learners
            .lock()
            .sample(c.load_delay_ms, c.work.running as f64, placements, replicas);
    }
}

async fn tokenize(
    st: &AppState,
    input: &PromptInput,
    model: &str,
    workers: &[Arc<Worker>],
) -> Result<Vec<u32>, TokenizeError> {
    let mut last = TokenizeError::Upstream("no worker".into());
    for w in workers.iter().take(3) {
        match st
            .tokenizers
            .tokens(
                input,
                model,
                w.spec.model_dir.as_deref(),
                &w.spec.url,
                &st.client,
            )
            .await
        {
            Ok(t) => return Ok(t),
            Err(e @ TokenizeError::Invalid(_)) | Err(e @ TokenizeError::Tokenizer(_)) => {
                return Err(e)
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The served models; with tenants configured, only for a valid key.
pub async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(rejected) = st.tenants.authenticate(&headers) {
        return rejected.into_response();
    }
    let data: Vec<Value> = st
        .registry
        .models()
        .into_iter()
        .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "kvroute"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn health(State(st): State<Arc<AppState>>) -> Response {
    let all = st.registry.all();
    let healthy = all.iter().filter(|w| w.routable()).count();
    let body = Json(
        json!({"status": if healthy > 0 { "ok" } else { "unavailable" }, "healthy_workers": healthy, "workers": all.len()}),
    );
    if healthy > 0 {
        body.into_response()
    } else {
        let mut r = (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
        r
    }
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = st
        .metrics
        .render(&st.registry.index, &st.registry.wire_stats);
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}
