//! The OpenAI-compatible front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//! `/health`, `/metrics`.
//!
//! Owns: request validation and OpenAI-style errors (400 malformed, 404 unknown model, 413 too
//! large, 503 + `Retry-After` when no worker is healthy, 502 when the chosen worker fails and no
//! retry is possible), the front door's checks ([`super::tenants`]: 401 before anything else,
//! 429 for concurrency and rate before the body is read, for tokens once the prompt is
//! tokenized; the admission held until the response body is dropped), tokenization, the
//! decision, forwarding (SSE passed through chunk by chunk, never buffered whole), one retry on
//! the next-best worker when the upstream failed before any byte reached the client, load
//! accounting, and recording the engine-reported cached tokens against the prediction; a
//! model with prefill and decode workers is handed to [`super::disagg`] after the decision.
//! Must not: rewrite the request body or the response (besides the decision header).

use super::answer::{
    completion_tokens, last_completion_tokens_in_sse, last_usage_in_sse, reported_cached,
    DecodeTiming,
};
use super::decide::{
    candidates_for, decide_with, prepare, record_least_loaded, record_placement, Decision, Ranked,
    RouteRequest,
};
use super::disagg;
use super::pending::Prompt;
use super::registry::{LoadGuard, Registry, Worker};
use super::request;
use super::tenants::{completion_budget, Admission};
use super::tokenize::{PromptInput, TokenizeError};
use super::ttft::Work;
use super::AppState;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use kvroute_index::BlockExtras;
use kvroute_route::PolicyKind;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    error_on(status, message, None)
}

/// A refused request's OpenAI error, naming its field.
pub fn invalid(e: request::Invalid) -> Response {
    error_on(e.status, e.message, e.param)
}

/// An OpenAI error body (`message`, `type`, `param`, `code`) with `status`.
pub fn error_on(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        404 => "NotFoundError",
        408 => "RequestTimeoutError",
        413 => "RequestTooLargeError",
        429 => "RateLimitError",
        502 => "BadGatewayError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    let mut r = (status, Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": status.as_u16()}}))).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    r
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
    fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

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
    let r = match st.tenants.admit(&headers) {
        Err(rejected) => rejected.into_response(),
        Ok(admission) => {
            let r = route(&st, &headers, body, ep, admission.as_ref()).await;
            held_until_body_ends(r, admission)
        }
    };
    let class = format!("{}xx", r.status().as_u16() / 100);
    st.metrics
        .requests
        .with_label_values(&[ep.label(), &class])
        .inc();
    r
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
) -> Response {
    let admitted = match admit(st, body, ep, admission).await {
        Ok(a) => a,
        Err(r) => return r,
    };
    let explain = st.config().explain_always
        || headers
            .get("x-kvroute-explain")
            .is_some_and(|v| v.as_bytes() == b"1" || v.as_bytes() == b"true");
    let decided = decide(st, &admitted, explain);
    if let Some(decode) = &decided.decode {
        return disagg::serve(
            st,
            ep,
            &admitted.req,
            admitted.stream,
            &decided.ranked,
            decode,
            decided.policy.name(),
            explain,
        )
        .await;
    }
    serve(st, ep, &admitted, &decided, explain).await
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

/// Reads and validates the body, finds the workers serving its model (an adapter request is
/// hashed with the adapter's key, on the workers serving it), tokenizes the prompt, and charges
/// the tenant its tokens.
async fn admit(
    st: &Arc<AppState>,
    body: Body,
    ep: Endpoint,
    admission: Option<&Admission>,
) -> Result<Admitted, Response> {
    let raw = read_body(st, body).await?;
    let parsed =
        request::parse(&raw, ep == Endpoint::Chat, &st.registry.models()).map_err(invalid)?;
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
    let tokens = match tokenize(st, &input, &model, &workers).await {
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

/// Decides where an admitted request goes: its follow-up status (recorded once here), the
/// readings the placement brings up to date ([`prepare`]), the routing core's ranking of the
/// first pool (the prefill pool of a split model, then its decode pool), the decision's
/// metrics and the placement's records.
fn decide<'a>(st: &Arc<AppState>, a: &'a Admitted, explain: bool) -> Decided<'a> {
    let policy = st.policy();
    let turn_gap = if policy.uses_cache() {
        st.registry.follow_ups.observe(&a.tokens, Instant::now())
    } else {
        None
    };
    if turn_gap.is_some() {
        st.metrics.follow_ups.inc();
    }
    let rr = st.rr.fetch_add(1, Ordering::Relaxed);
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
        if let (Some(w), Some(c)) = (ranked.order.first(), ranked.decision.candidates.first()) {
            let forgone = ranked.decision.best_cached > ranked.decision.predicted_cached;
            record_placement(&st.registry, w, c, turn_gap, forgone);
        }
        if weights.next_arrivals {
            record_least_loaded(&st.registry, &ranked.decision.candidates);
        }
    }
    // The decode pool is ranked by the same policy: its load, and its own hit (the part of
    // the prompt it need not pull).
    let decode = pd.as_ref().map(|p| {
        let d = rank_pool(&p.decode);
        sample_load_waits(&d);
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
    sample_load_waits(ranked);
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
) -> Response {
    let ranked = &d.ranked;
    let mut last_err = String::new();
    for (attempt, worker) in ranked.order.iter().take(2).enumerate() {
        let booking = Booking::for_candidate(ranked, worker, false);
        let mut decision = ranked.decision.clone();
        decision.worker = worker.spec.name.clone();
        decision.predicted_cached = booking.predicted;
        decision.predicted_ttft_ms = booking.work.map_or(0.0, |(_, ms)| ms);
        match forward(st, worker, ep, a.raw.clone(), a.stream, booking).await {
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
/// candidate alike).
fn sample_load_waits(r: &Ranked<'_>) {
    for c in &r.decision.candidates {
        if let Some(w) = r.order.iter().find(|w| w.spec.name == c.worker) {
            w.ttft.sample_load_wait(c.load_delay_ms);
            w.decode.sample_running(c.work.running as f64);
        }
    }
}

pub(super) fn attach_decision(resp: &mut Response, d: &Decision) {
    if let Ok(s) = serde_json::to_string(d) {
        let ascii: String = s
            .chars()
            .map(|c| {
                if c.is_ascii() && !c.is_ascii_control() {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&ascii) {
            resp.headers_mut().insert("x-kvroute-decision", v);
        }
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

/// The prompt and its checkpoints, recorded as in flight on the worker while it runs.
type InFlight<'a> = (&'a Prompt<'a>, [u64; 2]);

pub(super) struct UpstreamError {
    pub(super) message: String,
    /// Nothing reached the client yet.
    pub(super) retryable: bool,
}

/// What a forwarded request books on its worker, and what was predicted for it.
pub(super) struct Booking<'a> {
    /// Prefill tokens charged to the worker until the first byte.
    uncached: u64,
    in_flight: Option<InFlight<'a>>,
    /// The cached tokens the worker's answer is checked against.
    pub(super) predicted: u64,
    /// The TTFT model's inputs and prediction: a streamed answer's first byte teaches the
    /// worker's model (and the fleet's) what it took.
    pub(super) work: Option<(Work, f64)>,
    /// The whole answer is one token (a prefill leg): its arrival is the first token's.
    first_token_is_whole: bool,
}

impl<'a> Booking<'a> {
    /// The booking of `worker`'s candidate in `r` (an unranked worker books the whole prompt).
    pub(super) fn for_candidate(
        r: &'a Ranked<'a>,
        worker: &Worker,
        first_token_is_whole: bool,
    ) -> Booking<'a> {
        let cand = r
            .decision
            .candidates
            .iter()
            .find(|c| c.worker == worker.spec.name);
        Booking {
            uncached: cand.map_or(r.decision.prompt_tokens as u64, |c| c.expected_uncached()),
            in_flight: match (cand, &r.prompt) {
                (Some(c), Some(prompt)) => Some((prompt, c.checkpoints)),
                _ => None,
            },
            predicted: cand.map_or(0, |c| c.predicted_cached),
            work: cand.map(|c| (c.work, c.predicted_ttft_ms)),
            first_token_is_whole,
        }
    }
}

/// Feeds an observed TTFT to the worker's and the fleet's models and the error histograms.
fn observe_ttft(st: &AppState, worker: &Worker, work: &(Work, f64), elapsed: Duration) {
    let (w, predicted_ms) = work;
    let observed_ms = elapsed.as_secs_f64() * 1000.0;
    worker.ttft.observe(w, observed_ms);
    st.registry.fleet_ttft.observe(w, observed_ms);
    let name = worker.spec.name.as_str();
    st.metrics
        .ttft_error
        .with_label_values(&[name])
        .observe((predicted_ms - observed_ms) / 1000.0);
    if observed_ms > 0.0 {
        st.metrics
            .ttft_relative_error
            .with_label_values(&[name])
            .observe((predicted_ms - observed_ms).abs() / observed_ms);
    }
}

pub(super) async fn forward(
    st: &Arc<AppState>,
    worker: &Arc<Worker>,
    ep: Endpoint,
    body: Bytes,
    stream: bool,
    booking: Booking<'_>,
) -> Result<Response, UpstreamError> {
    let Booking {
        uncached,
        in_flight,
        predicted,
        work,
        first_token_is_whole,
    } = booking;
    let mut guard = LoadGuard::new(worker.clone(), uncached);
    if let Some((prompt, checkpoints)) = in_flight {
        guard = guard.with_prompt(prompt, checkpoints);
    }
    let started = Instant::now();
    let url = format!("{}{}", worker.spec.url.trim_end_matches('/'), ep.path());
    let timeout = Duration::from_secs_f64(st.config().request_timeout_secs.max(0.1));
    let resp = st
        .client
        .post(&url)
        .timeout(timeout)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| {
            // Refused connections eject at once; timeouts and resets count towards the streak.
            if e.is_connect() {
                count_failure(st, worker, Failure::Refused);
                worker.mark_failure();
            } else if e.is_timeout() {
                worker_failed(st, worker, Failure::Timeout);
            } else {
                worker_failed(st, worker, Failure::Transport);
            }
            UpstreamError {
                message: format!("{}: {e}", worker.spec.name),
                retryable: true,
            }
        })?;
    let status = resp.status();
    if status.is_server_error() {
        // Nothing reached the client yet, streamed or not: another worker may serve it.
        worker_failed(st, worker, Failure::Status5xx);
        return Err(UpstreamError {
            message: format!("{} answered {status}", worker.spec.name),
            retryable: true,
        });
    }
    let ctype = resp.headers().get("content-type").cloned();
    let name = worker.spec.name.clone();
    if !stream || !status.is_success() {
        let bytes = resp.bytes().await.map_err(|e| {
            worker_failed(st, worker, Failure::Body);
            UpstreamError {
                message: format!("{name}: reading the response: {e}"),
                retryable: true,
            }
        })?;
        // A whole answer (any status below 500) ends the failure streak.
        worker.request_answered();
        guard.prefill_done();
        st.metrics
            .proxy_seconds
            .with_label_values(&[&name])
            .observe(started.elapsed().as_secs_f64());
        if let (true, true, Some(w)) = (first_token_is_whole, status.is_success(), &work) {
            observe_ttft(st, worker, w, started.elapsed());
        }
        if status.is_success() {
            if let Some(reported) = reported_cached(&bytes) {
                record_error(st, &name, predicted, reported);
            }
            if let Some(n) = completion_tokens(&bytes) {
                st.registry.output_tokens.observe(n);
            }
        }
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        if let Some(ct) = ctype {
            r.headers_mut().insert("content-type", ct);
        }
        return Ok(r);
    }
    // Streaming: pass chunks through as they arrive; the guard lives as long as the stream.
    let st2 = st.clone();
    let worker2 = worker.clone();
    let mut first = true;
    let mut tail = Vec::<u8>::new();
    let mut cut = false;
    let mut decode = DecodeTiming::default();
    let upstream = resp.bytes_stream();
    let body_stream = upstream.map(move |chunk| {
        if cut {
            return Ok::<Bytes, std::io::Error>(Bytes::new());
        }
        if first {
            first = false;
            guard.prefill_done();
            // What this one decodes beside: the prefill still queued and the others running
            // (it counts itself).
            decode.start(
                worker2.queued_tokens(),
                worker2.booked_total.load(Ordering::Relaxed),
                worker2.running().saturating_sub(1),
            );
            if let (Some(w), Ok(_)) = (&work, &chunk) {
                observe_ttft(&st2, &worker2, w, started.elapsed());
            }
            st2.metrics
                .proxy_seconds
                .with_label_values(&[&name])
                .observe(started.elapsed().as_secs_f64());
        }
        if let Ok(c) = &chunk {
            // Keep the last few KiB to read a final usage chunk, if the client asked for one.
            tail.extend_from_slice(c);
            if tail.len() > 16 * 1024 {
                tail.drain(..tail.len() - 8 * 1024);
            }
            decode.chunk(c);
            // `[DONE]` may straddle two chunks: look at this one and the bytes before it.
            let recent = &tail[tail.len().saturating_sub(c.len() + 6)..];
            if recent.windows(6).any(|w| w == b"[DONE]") {
                // A stream that reached its end ends the failure streak; one that dies on
                // the way does not (however many chunks it sent).
                worker2.request_answered();
                if let Some(rep) = last_usage_in_sse(&tail) {
                    record_error(&st2, &name, predicted, rep);
                }
                decode.finish(&st2, &worker2, last_completion_tokens_in_sse(&tail));
            }
        }
        match chunk {
            Ok(c) => Ok(c),
            Err(e) => {
                // Bytes went out: no retry. The client gets vLLM's mid-stream error event and
                // a clean end instead of a connection cut in the middle of an event.
                worker_failed(&st2, &worker2, Failure::StreamCut);
                cut = true;
                Ok(stream_error_event(
                    &tail,
                    &format!("{name}: the answer stopped: {e}"),
                ))
            }
        }
    });
    let mut r = Response::new(Body::from_stream(body_stream));
    if let Some(ct) = ctype {
        r.headers_mut().insert("content-type", ct);
    }
    Ok(r)
}

/// What ends a stream whose upstream failed: the end of any event cut in half, vLLM's
/// streaming error (`data: {"error": ...}`, which OpenAI's clients raise) and `[DONE]`.
fn stream_error_event(sent: &[u8], message: &str) -> Bytes {
    let mut out = Vec::new();
    if !sent.is_empty() && !sent.ends_with(b"\n\n") {
        out.extend_from_slice(b"\n\n");
    }
    let err = json!({"error": {"message": message, "type": "BadGatewayError", "param": null, "code": 502}});
    out.extend_from_slice(format!("data: {err}\n\ndata: [DONE]\n\n").as_bytes());
    Bytes::from(out)
}

/// Why a worker failed a request (the `reason` label of `kvroute_upstream_failures_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// The connection was refused.
    Refused,
    /// No whole answer within `request_timeout_secs`.
    Timeout,
    /// The connection reset or closed before an answer's head.
    Transport,
    Status5xx,
    /// The head came, reading the rest of a whole (non-streamed) answer failed.
    Body,
    /// A stream stopped after bytes reached the client.
    StreamCut,
}

impl Failure {
    fn label(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::Timeout => "timeout",
            Failure::Transport => "transport",
            Failure::Status5xx => "status_5xx",
            Failure::Body => "body",
            Failure::StreamCut => "stream_cut",
        }
    }
}

fn count_failure(st: &AppState, worker: &Worker, why: Failure) {
    st.metrics
        .upstream_failures
        .with_label_values(&[&worker.spec.name, why.label()])
        .inc();
}

/// Counts a worker-side failure; logs and counts the ejection it may cause.
fn worker_failed(st: &AppState, worker: &Worker, why: Failure) {
    count_failure(st, worker, why);
    if worker.request_failed() {
        tracing::warn!(
            worker = %worker.spec.name,
            after = super::registry::EJECT_AFTER,
            "worker ejected after failed requests in a row; the health check probes it back"
        );
        st.metrics
            .ejections
            .with_label_values(&[&worker.spec.name])
            .inc();
    }
}

fn record_error(st: &AppState, worker: &str, predicted: u64, reported: u64) {
    st.metrics
        .predicted_cached
        .with_label_values(&[worker])
        .inc_by(predicted);
    st.metrics
        .reported_cached
        .with_label_values(&[worker])
        .inc_by(reported);
    st.metrics
        .prediction_error
        .with_label_values(&[worker])
        .observe(predicted as f64 - reported as f64);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_cut_mid_event_is_closed_with_an_error_event_and_done() {
        let b = stream_error_event(b"data: {\"choices\": [", "w0: gone");
        let text = std::str::from_utf8(&b).unwrap();
        assert!(text.starts_with("\n\ndata: {\"error\":"));
        assert!(text.ends_with("data: [DONE]\n\n"));
        let ev: Value = serde_json::from_str(
            text.trim()
                .lines()
                .next()
                .unwrap()
                .trim_start_matches("data: "),
        )
        .unwrap();
        assert_eq!(ev["error"]["message"], "w0: gone");
        assert_eq!(ev["error"]["code"], 502);
        // After a whole event nothing needs closing.
        assert!(stream_error_event(b"data: x\n\n", "m").starts_with(b"data: {"));
    }
}
