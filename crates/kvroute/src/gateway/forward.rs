//! Forwarding one request to one worker: what both the proxy and disaggregated serving's two
//! legs use.
//!
//! Owns: the endpoints ([`Endpoint`]), what a forwarded request books on its worker and what
//! was predicted for it ([`Booking`]), [`forward`] (SSE passed through chunk by chunk, never
//! buffered whole; a failure before any byte reached the client is retryable, one after it ends
//! the stream with vLLM's error event and `[DONE]`), the load accounting while it runs, the
//! TTFT, decode and cached-token observations an answer teaches, the upstream failure counts
//! and ejections, the decision header ([`attach_decision`]), and each attempt's `forward` span
//! and the trace context headers the engine receives ([`super::otel::Forwarding`]: the span
//! starts before the request is sent, has its `first_byte` event with the first chunk of a
//! stream or the head of a whole answer, and ends with the answer's last byte).
//! Must not: choose workers (the caller ranked them) or rewrite the request body or the
//! response (besides the decision header).

use super::answer::{
    completion_tokens, last_completion_tokens_in_sse, last_usage_in_sse, reported_cached,
    DecodeTiming,
};
use super::decide::{Decision, Ranked};
use super::observe;
use super::otel::{EngineHeaders, Forwarding, RequestTrace};
use super::peer_wire::{Booked, Learned};
use super::pending::{checkpoint_tails, Prompt};
use super::registry::load::LoadGuard;
use super::registry::Worker;
use super::state::AppState;
use super::ttft::Work;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::json;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The OpenAI endpoint a request came to (and is forwarded to).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub(super) fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
    /// The name of a request's root span.
    pub(super) fn span_name(self) -> &'static str {
        match self {
            Endpoint::Completions => "POST /v1/completions",
            Endpoint::Chat => "POST /v1/chat/completions",
        }
    }
    pub(super) fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

/// Puts the decision (as ASCII JSON) in the `x-kvroute-decision` header.
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

/// The prompt and its checkpoints, recorded as in flight on the worker while it runs.
type InFlight<'a> = (&'a Prompt<'a>, [u64; 2]);

/// A forward that failed: why, and whether another worker may still serve the request.
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
            .find(|c| *c.worker == *worker.spec.name);
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
    observe::ttft(&st.registry, worker, w, observed_ms);
    if st.peers.outbox.shares_learning() {
        st.peers.outbox.learned(Learned::Ttft {
            worker: worker.spec.name.clone(),
            work: *w,
            ms: observed_ms,
        });
    }
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

/// One request as it is sent to an engine: the endpoint, the body, whether the answer streams,
/// and the trace it belongs to (which leg, which attempt).
pub(super) struct Outgoing<'a> {
    pub(super) ep: Endpoint,
    pub(super) body: Bytes,
    pub(super) stream: bool,
    pub(super) trace: &'a RequestTrace,
    /// `whole`, or the `prefill` or `decode` leg of a disaggregated request.
    pub(super) leg: &'static str,
    /// 0 for the first worker tried, 1 for the retry.
    pub(super) attempt: usize,
}

/// Sends the request to `worker` and passes its answer through (a stream chunk by chunk),
/// booking the load while it runs and learning from the answer's timings and reported cache
/// hits.
pub(super) async fn forward(
    st: &Arc<AppState>,
    worker: &Arc<Worker>,
    out: Outgoing<'_>,
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
    if let Some((prompt, checkpoints)) = &in_flight {
        guard = guard.with_prompt(prompt, *checkpoints);
    }
    let guard = announce(st, worker, guard, in_flight);
    let url = format!("{}{}", worker.spec.url.trim_end_matches('/'), out.ep.path());
    let mut span = out
        .trace
        .forward(&worker.spec.name, &url, out.leg, out.attempt);
    let started = Instant::now();
    let resp = match send(st, worker, &url, out.body, &span.headers).await {
        Ok(r) => r,
        Err(e) => {
            span.fail(|| e.message.clone());
            return Err(e);
        }
    };
    let status = resp.status();
    span.answered(status.as_u16());
    if !status.is_success() {
        span.fail(|| format!("the engine answered {status}"));
    }
    let seen = Answered {
        started,
        predicted,
        work,
        span,
    };
    if !out.stream || !status.is_success() {
        return whole_answer(st, worker, resp, guard, seen, first_token_is_whole).await;
    }
    Ok(streamed_answer(st, worker, resp, guard, seen))
}

/// Tells the other replicas (when any is configured) about the booking `guard` holds: the
/// worker, its prefill and the prompt it is about to cache.
fn announce(
    st: &AppState,
    worker: &Worker,
    guard: LoadGuard,
    in_flight: Option<InFlight<'_>>,
) -> LoadGuard {
    let outbox = &st.peers.outbox;
    let id = outbox.book(|id| Booked {
        id,
        worker: worker.spec.name.clone(),
        prefill: guard.prefill(),
        keys: in_flight
            .as_ref()
            .map(|(p, _)| p.keys.to_vec())
            .unwrap_or_default(),
        checkpoints: in_flight
            .as_ref()
            .map(|(p, c)| checkpoint_tails(p, *c))
            .unwrap_or_default(),
    });
    match id {
        Some(id) => guard.announced(outbox.clone(), id),
        None => guard,
    }
}

/// What an answer is checked against and teaches: when it was sent, the cached tokens
/// predicted, and the TTFT model's inputs and prediction; and the attempt's span, which ends
/// with the answer.
struct Answered {
    started: Instant,
    predicted: u64,
    work: Option<(Work, f64)>,
    span: Forwarding,
}

/// Sends the request to the worker; a refused connection, a timeout, a reset or a 5xx is a
/// retryable failure of the worker's (nothing reached the client yet).
async fn send(
    st: &Arc<AppState>,
    worker: &Arc<Worker>,
    url: &str,
    body: Bytes,
    trace_context: &EngineHeaders,
) -> Result<reqwest::Response, UpstreamError> {
    let timeout = Duration::from_secs_f64(st.config().request_timeout_secs.max(0.1));
    let mut req = st
        .client
        .post(url)
        .timeout(timeout)
        .header("content-type", "application/json");
    for (name, value) in trace_context.iter() {
        req = req.header(name, value.clone());
    }
    let resp = req.body(body).send().await.map_err(|e| {
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
    Ok(resp)
}

/// A whole (unstreamed, or unsuccessful) answer: read, passed on, and its cached tokens,
/// answer length and — for a one-token prefill leg — TTFT learned from.
async fn whole_answer(
    st: &Arc<AppState>,
    worker: &Arc<Worker>,
    resp: reqwest::Response,
    mut guard: LoadGuard,
    mut seen: Answered,
    first_token_is_whole: bool,
) -> Result<Response, UpstreamError> {
    let status = resp.status();
    let ctype = resp.headers().get("content-type").cloned();
    let name = worker.spec.name.as_str();
    seen.span.first_byte();
    let bytes = resp.bytes().await.map_err(|e| {
        worker_failed(st, worker, Failure::Body);
        let message = format!("{name}: reading the response: {e}");
        seen.span.fail(|| message.clone());
        UpstreamError {
            message,
            retryable: true,
        }
    })?;
    // A whole answer (any status below 500) ends the failure streak.
    worker.request_answered();
    guard.prefill_done();
    st.metrics
        .proxy_seconds
        .with_label_values(&[name])
        .observe(seen.started.elapsed().as_secs_f64());
    if let (true, true, Some(w)) = (first_token_is_whole, status.is_success(), &seen.work) {
        observe_ttft(st, worker, w, seen.started.elapsed());
    }
    if status.is_success() {
        if let Some(reported) = reported_cached(&bytes) {
            record_error(st, name, seen.predicted, reported);
        }
        if let Some(n) = completion_tokens(&bytes) {
            observe::answered(&st.registry, worker, n, None);
            if st.peers.outbox.shares_learning() {
                st.peers.outbox.learned(Learned::Answered {
                    worker: worker.spec.name.clone(),
                    tokens: n,
                    decode: None,
                });
            }
        }
    }
    let mut r = Response::new(Body::from(bytes));
    *r.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if let Some(ct) = ctype {
        r.headers_mut().insert("content-type", ct);
    }
    Ok(r)
}

/// A streamed answer: chunks passed through as they arrive, the guard living as long as the
/// stream; the first chunk ends the prefill and teaches the TTFT, `[DONE]` the cached tokens and
/// the decode timing; a stream cut on the way ends with vLLM's error event.
fn streamed_answer(
    st: &Arc<AppState>,
    worker: &Arc<Worker>,
    resp: reqwest::Response,
    mut guard: LoadGuard,
    mut seen: Answered,
) -> Response {
    let ctype = resp.headers().get("content-type").cloned();
    let name = worker.spec.name.clone();
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
            seen.span.first_byte();
            guard.prefill_done();
            // What this one decodes beside: the prefill still queued and the others running
            // (it counts itself).
            decode.start(
                worker2.queued_tokens(),
                worker2.booked_total.load(Ordering::Relaxed),
                worker2.running().saturating_sub(1),
            );
            if let (Some(w), Ok(_)) = (&seen.work, &chunk) {
                observe_ttft(&st2, &worker2, w, seen.started.elapsed());
            }
            st2.metrics
                .proxy_seconds
                .with_label_values(&[&name])
                .observe(seen.started.elapsed().as_secs_f64());
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
                    record_error(&st2, &name, seen.predicted, rep);
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
                seen.span.fail(|| format!("the answer stopped: {e}"));
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
    r
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

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
