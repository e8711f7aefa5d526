//! Disaggregated prefill and decode: one request served in two legs, by vLLM's
//! NixlConnector protocol (pull mode, what vLLM's own proxy speaks).
//!
//! Owns: the pools of a model ([`pools`]: its `prefill` and `decode` workers, or none when it
//! lacks either role), the two legs' bodies and the prefill answer's parameters, and
//! [`serve`], which runs the legs. The prefill leg is the request with `kv_transfer_params =
//! {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`, `stream = false` and
//! one output token (`max_tokens`, and `max_completion_tokens` when given, set to 1;
//! `stream_options`, `min_tokens`, `min_completion_tokens` removed), sent to the prefill
//! worker the policy ranks first by exact predicted reuse and predicted TTFT. Its answer's
//! `kv_transfer_params` go, verbatim, into the client's original request for the decode
//! worker the policy ranks first among the decode pool — by its load and by its own cached
//! prefix, which shortens the pull; the decode worker's answer is streamed (or returned)
//! to the client as usual. Each leg is retried once on the next-ranked worker of its pool when
//! it failed before any byte reached the client.
//! Invariants: the client sees only the decode worker's answer (or an error); the prefill
//! leg's answer must carry `kv_transfer_params` (an object), else the leg failed; the decode
//! worker's reported cached tokens are the prefill worker's (vLLM's decode worker reports
//! `remote_prefill_cached_tokens`), so both legs are checked against the prefill prediction.
//! Each leg's attempts are `forward` spans of the request's trace (`kvroute.leg` `prefill` or
//! `decode`), and each engine receives a `traceparent` naming its own leg's span.
//! Must not: choose workers itself (the policy ranks each pool) or rewrite answers.

use super::config::Role;
use super::decide::{Decision, Ranked};
use super::forward::{attach_decision, forward, Booking, Endpoint, Outgoing};
use super::otel::RequestTrace;
use super::registry::Worker;
use super::reply::error;
use super::state::AppState;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};
use std::sync::Arc;

/// A model's workers by role, when it has both a prefill and a decode worker.
pub struct Pools {
    pub prefill: Vec<Arc<Worker>>,
    pub decode: Vec<Arc<Worker>>,
}

/// The prefill and decode pools among `workers` (one model's routable workers); `None`
/// unless both are non-empty (the model is then served whole by every worker).
pub fn pools(workers: &[Arc<Worker>]) -> Option<Pools> {
    let of = |r: Role| -> Vec<Arc<Worker>> {
        workers
            .iter()
            .filter(|w| w.spec.role == r)
            .cloned()
            .collect()
    };
    let (prefill, decode) = (of(Role::Prefill), of(Role::Decode));
    (!prefill.is_empty() && !decode.is_empty()).then_some(Pools { prefill, decode })
}

/// The prefill leg's body: the request computing its prompt for a remote decode.
pub fn prefill_body(req: &Value) -> Value {
    let mut b = req.clone();
    if let Some(o) = b.as_object_mut() {
        o.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }),
        );
        o.insert("stream".into(), json!(false));
        o.insert("max_tokens".into(), json!(1));
        if o.contains_key("max_completion_tokens") {
            o.insert("max_completion_tokens".into(), json!(1));
        }
        for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
            o.remove(k);
        }
    }
    b
}

/// The decode leg's body: the client's request with the prefill answer's parameters.
pub fn decode_body(req: &Value, params: Value) -> Value {
    let mut b = req.clone();
    if let Some(o) = b.as_object_mut() {
        o.insert("kv_transfer_params".into(), params);
    }
    b
}

/// The `kv_transfer_params` of a prefill worker's answer.
pub fn transfer_params(answer: &[u8]) -> Result<Value, String> {
    let v: Value = serde_json::from_slice(answer)
        .map_err(|e| format!("the prefill answer is not JSON: {e}"))?;
    match v.get("kv_transfer_params") {
        Some(p) if p.is_object() => Ok(p.clone()),
        Some(_) => Err("the prefill answer's `kv_transfer_params` is not an object".into()),
        None => Err(
            "the prefill answer has no `kv_transfer_params` (is the engine a KV producer?)".into(),
        ),
    }
}

fn bytes_of(v: &Value) -> Bytes {
    Bytes::from(serde_json::to_vec(v).unwrap_or_default())
}

/// The largest prefill answer read (one token's completion; a bound, not an expectation).
const MAX_PREFILL_ANSWER: usize = 16 << 20;

/// A disaggregated request: where it came, its body, whether it streams, both pools' rankings
/// and how the decision is reported.
pub struct Legs<'a> {
    pub ep: Endpoint,
    pub req: &'a Value,
    pub stream: bool,
    pub prefill: &'a Ranked<'a>,
    pub decode: &'a Ranked<'a>,
    pub policy: &'static str,
    pub explain: bool,
    /// The request's trace: each leg's attempts are `forward` spans of it.
    pub trace: &'a RequestTrace,
}

/// Runs both legs: `legs.prefill` and `legs.decode` are the policy's rankings of the two pools.
pub async fn serve(st: &Arc<AppState>, legs: Legs<'_>) -> Response {
    let (p_worker, params) = match prefill_leg(st, &legs).await {
        Ok(done) => done,
        Err(r) => return r,
    };
    let prefill = legs.prefill;
    note_retry(st, prefill, &p_worker);
    let mut p_decision = prefill.decision.clone();
    p_decision.worker = p_worker.spec.name.clone();
    if let Some(c) = candidate(prefill, &p_worker) {
        p_decision.predicted_cached = c.predicted_cached;
        p_decision.predicted_ttft_ms = c.predicted_ttft_ms;
    }
    decode_leg(st, &legs, params, p_decision).await
}

/// The prefill leg on the best prefill worker (once more on the next when it fails before
/// answering): its worker and the transfer parameters it answered, or the response to give the
/// client (its own 4xx, or a 502).
async fn prefill_leg(
    st: &Arc<AppState>,
    legs: &Legs<'_>,
) -> Result<(Arc<Worker>, Value), Response> {
    let p_body = bytes_of(&prefill_body(legs.req));
    let mut last_err = String::new();
    for (attempt, worker) in legs.prefill.order.iter().take(2).enumerate() {
        let booking = Booking::for_candidate(legs.prefill, worker, true);
        let out = Outgoing {
            ep: legs.ep,
            body: p_body.clone(),
            stream: false,
            trace: legs.trace,
            leg: "prefill",
            attempt,
        };
        match forward(st, worker, out, booking).await {
            Ok(resp) => {
                let status = resp.status();
                let body = axum::body::to_bytes(resp.into_body(), MAX_PREFILL_ANSWER).await;
                let body = match body {
                    Ok(b) => b,
                    Err(e) => {
                        last_err = format!("{}: reading the answer: {e}", worker.spec.name);
                        continue;
                    }
                };
                if !status.is_success() {
                    // The client's own mistake (a 4xx): it would fail anywhere.
                    let mut r = Response::new(axum::body::Body::from(body));
                    *r.status_mut() = status;
                    r.headers_mut().insert(
                        "content-type",
                        axum::http::HeaderValue::from_static("application/json"),
                    );
                    return Err(r);
                }
                match transfer_params(&body) {
                    Ok(p) => return Ok((worker.clone(), p)),
                    Err(m) => last_err = format!("{}: {m}", worker.spec.name),
                }
            }
            Err(e) => {
                tracing::warn!(worker = %worker.spec.name, error = %e.message, "prefill leg failed");
                last_err = e.message;
                if !e.retryable {
                    break;
                }
            }
        }
    }
    Err(error(
        StatusCode::BAD_GATEWAY,
        format!("the prefill leg failed: {last_err}"),
    ))
}

/// The decode leg on the best decode worker (once more on the next when it fails before any
/// byte), pulling the prefill's KV by `params`; the decision header carries both legs.
async fn decode_leg(
    st: &Arc<AppState>,
    legs: &Legs<'_>,
    params: Value,
    p_decision: Decision,
) -> Response {
    let decode = legs.decode;
    // The decode worker reports the prefill worker's cached tokens.
    let reported_as = p_decision.predicted_cached;
    let d_body = bytes_of(&decode_body(legs.req, params));
    let mut last_err = String::new();
    for (attempt, worker) in decode.order.iter().take(2).enumerate() {
        let mut booking = Booking::for_candidate(decode, worker, false);
        booking.predicted = reported_as;
        let out = Outgoing {
            ep: legs.ep,
            body: d_body.clone(),
            stream: legs.stream,
            trace: legs.trace,
            leg: "decode",
            attempt,
        };
        match forward(st, worker, out, booking).await {
            Ok(mut resp) => {
                st.metrics
                    .decisions
                    .with_label_values(&[legs.policy, &worker.spec.name])
                    .inc();
                note_retry(st, decode, worker);
                if legs.explain {
                    let mut d = decode.decision.clone();
                    d.worker = worker.spec.name.clone();
                    if let Some(c) = candidate(decode, worker) {
                        d.predicted_cached = c.predicted_cached;
                        d.predicted_ttft_ms = c.predicted_ttft_ms;
                    }
                    d.prefill = Some(Box::new(p_decision));
                    attach_decision(&mut resp, &d);
                }
                return resp;
            }
            Err(e) => {
                tracing::warn!(worker = %worker.spec.name, error = %e.message, "decode leg failed");
                last_err = e.message;
                if !e.retryable {
                    break;
                }
            }
        }
    }
    error(
        StatusCode::BAD_GATEWAY,
        format!("the decode leg failed: {last_err}"),
    )
}

fn candidate<'r>(r: &'r Ranked<'_>, w: &Worker) -> Option<&'r kvroute_route::Candidate> {
    r.decision
        .candidates
        .iter()
        .find(|c| *c.worker == *w.spec.name)
}

/// Counts a leg served by other than its first-ranked worker.
fn note_retry(st: &AppState, r: &Ranked<'_>, served: &Worker) {
    if let Some(first) = r.order.first() {
        if first.spec.name != served.spec.name {
            st.metrics
                .retries
                .with_label_values(&[&first.spec.name])
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_leg_asks_for_one_token_for_a_remote_decode_and_no_stream() {
        let req = json!({
            "model": "m", "prompt": [1, 2, 3], "stream": true, "max_tokens": 50,
            "max_completion_tokens": 50, "stream_options": {"include_usage": true},
            "min_tokens": 5, "temperature": 0.5,
        });
        let p = prefill_body(&req);
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(p["kv_transfer_params"]["do_remote_prefill"], false);
        assert!(p["kv_transfer_params"]["remote_engine_id"].is_null());
        assert_eq!(
            (p["stream"].clone(), p["max_tokens"].clone()),
            (json!(false), json!(1))
        );
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(
            (p["temperature"].clone(), p["prompt"].clone()),
            (json!(0.5), json!([1, 2, 3]))
        );
        // Without max_completion_tokens none is added.
        assert!(prefill_body(&json!({"prompt": "x"}))
            .get("max_completion_tokens")
            .is_none());
    }

    #[test]
    fn the_decode_leg_is_the_clients_request_with_the_prefill_answers_parameters() {
        let req = json!({"model": "m", "prompt": "hi", "stream": true, "max_tokens": 50});
        let answer = br#"{"choices": [], "kv_transfer_params": {"do_remote_prefill": true, "remote_port": 9}}"#;
        let params = transfer_params(answer).unwrap();
        let d = decode_body(&req, params.clone());
        assert_eq!(d["kv_transfer_params"], params);
        assert_eq!(
            (d["stream"].clone(), d["max_tokens"].clone()),
            (json!(true), json!(50))
        );
        assert!(transfer_params(br#"{"choices": []}"#).is_err());
        assert!(transfer_params(br#"{"kv_transfer_params": 3}"#).is_err());
        assert!(transfer_params(b"not json").is_err());
    }
}
