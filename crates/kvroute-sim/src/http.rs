//! The OpenAI-compatible HTTP API of a simulated worker, plus vLLM's utility endpoints and the
//! admin (fault) endpoints.
//!
//! Owns: `/v1/completions` (token-id and text prompts, `cache_salt`,
//! `forced_output_token_ids`, `return_token_ids`, SSE streaming), `/v1/chat/completions`
//! (streaming and not), `/v1/models`, `/health`, `/version`, `/tokenize`, `/detokenize`, `/metrics`,
//! `/v1/completions/render` and `/v1/chat/completions/render`, `/kv_event_sources`,
//! `/reset_prefix_cache`, `/admin/{cache,requests,trace_context,faults,restart,pause,resume}`, and, with a
//! KV transfer role, `kv_transfer_params` on both completion endpoints and `/admin/kv_pull`
//! (the side channel decode workers pull a prefill worker's KV through, [`crate::disagg`]); the
//! admin endpoints' handlers are in `admin`.
//! Invariants: every response carries `usage.prompt_tokens_details.cached_tokens` (the
//! request's `num_cached_tokens`; in streams, on the final chunk); every error — malformed
//! bodies, unknown routes, bodies over the worker's bound — is answered in vLLM's error shape,
//! and nothing a client sends panics; a client that goes away aborts its request.
//! Must not: hold engine locks across awaits (it only submits and reads channels).

use crate::disagg::{self, Ask};
use crate::engine::{NewRequest, RemoteKv, TokenOut};
use crate::tokens::{self, Message};
use crate::worker::{Submission, Worker};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod admin;
use admin::{
    admin_cache, admin_faults, admin_kv_pull, admin_pause, admin_requests, admin_restart,
    admin_resume, admin_trace_context,
};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// An error reply in vLLM's shape: `{"error": {"message", "type", "param", "code"}}`, with
/// the HTTP status equal to `code` (vLLM's `ErrorResponse`, 0.32 and 0.33 alike).
struct ApiError(StatusCode, String);

/// vLLM's error `type` for a status.
fn error_type(code: StatusCode) -> &'static str {
    match code.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        413 => "PayloadTooLargeError",
        500 => "InternalServerError",
        503 => "ServiceUnavailableError",
        _ if code.is_client_error() => "BadRequestError",
        _ => "InternalServerError",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let ApiError(code, message) = self;
        let body = json!({
            "error": {
                "message": message,
                "type": error_type(code),
                "param": Value::Null,
                "code": code.as_u16(),
            }
        });
        (code, Json(body)).into_response()
    }
}

fn error(code: StatusCode, message: impl Into<String>) -> ApiError {
    ApiError(code, message.into())
}

fn bad(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, message)
}

/// A request body as axum hands it over: over the worker's `max_body_bytes` it is a rejection, which
/// becomes a 413 in vLLM's error shape instead of axum's plain-text one.
type Body = Result<Bytes, BytesRejection>;

/// The default largest request body (`WorkerConfig::max_body_bytes`). vLLM's Python server
/// sets no limit of its own; this bound only
/// keeps one client from exhausting the simulator's memory (a 1M-token prompt sent as token
/// ids is about 8 MB of JSON).
pub const MAX_BODY_BYTES: usize = 256 << 20;

fn parse_body(body: &Body) -> Result<Value, ApiError> {
    let body = body.as_ref().map_err(|r| {
        error(
            r.status(),
            format!("the request body cannot be read: {}", r.body_text()),
        )
    })?;
    let v: Value = serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    if v.is_object() {
        Ok(v)
    } else {
        Err(bad("the body must be a JSON object"))
    }
}

/// The router for one worker.
pub fn router(worker: Arc<Worker>) -> Router {
    let max_body = worker.config().max_body_bytes;
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/version", get(version))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/admin/cache", get(admin_cache))
        .route("/admin/requests", get(admin_requests))
        .route("/admin/trace_context", get(admin_trace_context))
        .route("/admin/faults", post(admin_faults))
        .route("/admin/restart", post(admin_restart))
        .route("/admin/pause", post(admin_pause))
        .route("/admin/resume", post(admin_resume))
        .route("/admin/kv_pull", post(admin_kv_pull))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "Not Found") })
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(worker)
}

type W = State<Arc<Worker>>;

fn vocab(w: &Worker) -> u32 {
    w.config().engine.spec.vocab_size
}

/// The vLLM release a simulated engine of the default generation (vLLM 0.32) reports.
pub const ENGINE_VERSION: &str = "0.32.0";

/// The vLLM release a simulated engine of generation `engine` behaves as (what `GET /version`
/// reports; gateways read it to recognise a vLLM backend and its hashing rules).
pub fn engine_version(engine: kvroute_index::Engine) -> &'static str {
    match engine {
        kvroute_index::Engine::Vllm032 => ENGINE_VERSION,
        kvroute_index::Engine::Vllm033 => "0.33.0",
    }
}

async fn version(State(w): W) -> Response {
    Json(json!({ "version": engine_version(w.config().engine.engine) })).into_response()
}

/// The base model, then each adapter as vLLM lists it: `root` its path, `parent` the base.
async fn models(State(w): W) -> Response {
    let cfg = w.config();
    let created = crate::worker::unix_now() as u64;
    let mut data = vec![json!({
        "id": cfg.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": cfg.model,
        "parent": Value::Null,
        "max_model_len": cfg.engine.max_model_len,
    })];
    data.extend(cfg.lora_modules.iter().map(|m| {
        json!({
            "id": m.name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": m.path,
            "parent": cfg.model,
            "max_model_len": Value::Null,
        })
    }));
    Json(json!({ "object": "list", "data": data })).into_response()
}

fn messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let arr = v
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| bad("`messages` must be a non-empty array"))?;
    arr.iter()
        .map(|m| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("every message needs a string `role`"))?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(""),
                Some(Value::Null) | None => String::new(),
                Some(_) => return Err(bad("`content` must be a string or a list of parts")),
            };
            Ok(Message {
                role: role.to_string(),
                content,
            })
        })
        .collect()
}

fn token_list(v: &Value, vocab: u32) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .filter(|t| *t < vocab)
        })
        .collect()
}

/// A completion prompt: a string, a list of token ids, or a one-element list of either.
fn completion_prompt(body: &Value, vocab: u32) -> Result<Vec<u32>, ApiError> {
    let p = body
        .get("prompt")
        .ok_or_else(|| bad("`prompt` is required"))?;
    let add_special = body
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let one = match p {
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => &items[0],
        Value::Array(items) if items.len() > 1 && !items[0].is_number() => {
            return Err(bad(
                "batched prompts are not supported; send one prompt per request",
            ))
        }
        other => other,
    };
    let ids = match one {
        Value::String(s) => {
            let mut ids = Vec::new();
            if add_special {
                ids.push(tokens::BOS);
            }
            ids.extend(tokens::tokenize(s, vocab));
            ids
        }
        Value::Array(_) => token_list(one, vocab).ok_or_else(|| {
            bad(format!(
                "`prompt` token ids must be integers below the vocabulary size {vocab}"
            ))
        })?,
        _ => return Err(bad("`prompt` must be a string or a list of token ids")),
    };
    if ids.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    Ok(ids)
}

async fn tokenize(State(w): W, body: Body) -> Response {
    let body = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let v = vocab(&w);
    let ids = if let Some(m) = body.get("messages") {
        let msgs = match messages(m) {
            Ok(m) => m,
            Err(r) => return r.into_response(),
        };
        let gen = body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        tokens::render_chat(&msgs, gen, v)
    } else {
        match completion_prompt(&body, v) {
            Ok(ids) => ids,
            Err(r) => return r.into_response(),
        }
    };
    Json(json!({
        "count": ids.len(),
        "max_model_len": w.config().engine.max_model_len,
        "tokens": ids,
    }))
    .into_response()
}

/// vLLM's `GenerateRequest`: what a render endpoint returns for one prompt.
fn generate_request(body: &Value, ids: Vec<u32>, w: &Worker) -> Value {
    json!({
        "token_ids": ids,
        "model": model_name(body, w),
        "stream": body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        "sampling_params": { "max_tokens": body.get("max_tokens").cloned().unwrap_or(Value::Null) },
    })
}

/// `POST /v1/completions/render`: the prompt's token ids, as a list of one `GenerateRequest`
/// (gateways such as vllm-router tokenize through it).
async fn render_completion(State(w): W, body: Body) -> Response {
    let body = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    match completion_prompt(&body, vocab(&w)) {
        Ok(ids) => Json(json!([generate_request(&body, ids, &w)])).into_response(),
        Err(r) => r.into_response(),
    }
}

/// `POST /v1/chat/completions/render`: the rendered conversation's token ids.
async fn render_chat(State(w): W, body: Body) -> Response {
    let body = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    match body.get("messages").map(messages) {
        Some(Ok(m)) => {
            let ids = tokens::render_chat(&m, true, vocab(&w));
            Json(generate_request(&body, ids, &w)).into_response()
        }
        Some(Err(r)) => r.into_response(),
        None => bad("`messages` is required").into_response(),
    }
}

/// `GET /kv_event_sources`: each DP rank's `KVEventsConfig` (empty without a publisher).
async fn kv_event_sources(State(w): W) -> Response {
    let cfg = w.config();
    let mut out = serde_json::Map::new();
    if let Some(p) = &cfg.zmq {
        for r in 0..cfg.data_parallel_size.max(1) {
            out.insert(
                r.to_string(),
                json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": crate::publisher::offset_endpoint(&p.endpoint, r),
                    "replay_endpoint": p.replay_endpoint.as_deref().map(|e| crate::publisher::offset_endpoint(e, r)),
                    "buffer_steps": p.buffer_steps,
                    "hwm": p.hwm,
                    "max_queue_size": 100_000,
                    "topic": p.topic,
                }),
            );
        }
    }
    Json(Value::Object(out)).into_response()
}

async fn detokenize(State(w): W, body: Body) -> Response {
    let body = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    match body.get("tokens").and_then(|t| token_list(t, vocab(&w))) {
        Some(ids) => Json(json!({ "prompt": tokens::detokenize(&ids) })).into_response(),
        None => bad("`tokens` must be a list of token ids").into_response(),
    }
}

struct Common {
    max_tokens: usize,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    req: NewRequest,
}

fn common(body: &Value, prompt: Vec<u32>, w: &Worker, chat: bool) -> Result<Common, ApiError> {
    if body
        .get("n")
        .and_then(Value::as_u64)
        .is_some_and(|n| n != 1)
    {
        return Err(bad("only n = 1 is supported"));
    }
    let max_len = w.config().engine.max_model_len as usize;
    let key = if chat && body.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match body.get(key) {
        None | Some(Value::Null) => {
            if chat {
                max_len.saturating_sub(prompt.len()).max(1)
            } else {
                16
            }
        }
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| bad(format!("`{key}` must be a positive integer")))?
            as usize,
    };
    if prompt.len() + max_tokens > max_len {
        return Err(bad(format!(
            "This model's maximum context length is {max_len} tokens. However, you requested \
             {} tokens ({} in the messages, {max_tokens} in the completion).",
            prompt.len() + max_tokens,
            prompt.len()
        )));
    }
    let forced = match body.get("forced_output_token_ids") {
        None | Some(Value::Null) => None,
        Some(v) => Some(token_list(v, vocab(w)).ok_or_else(|| {
            bad("`forced_output_token_ids` must be a list of token ids in the vocabulary")
        })?),
    };
    let cache_salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(bad("`cache_salt` must be a non-empty string")),
    };
    let skip = body.get("prompt_logprobs").is_some_and(|v| !v.is_null());
    Ok(Common {
        max_tokens,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: true,
        return_token_ids: body
            .get("return_token_ids")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        req: NewRequest {
            id: String::new(),
            prompt,
            max_tokens,
            forced_output: forced,
            cache_salt,
            skip_prefix_cache: skip,
            lora: body
                .get("model")
                .and_then(Value::as_str)
                .and_then(|m| w.config().lora(m)),
            remote_kv: None,
        },
    })
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

fn model_name(body: &Value, w: &Worker) -> String {
    body.get("model")
        .and_then(Value::as_str)
        .map_or_else(|| w.config().model.clone(), str::to_string)
}

async fn completions(State(w): W, headers: axum::http::HeaderMap, body: Body) -> Response {
    serve(w, &headers, body, false).await
}

async fn chat(State(w): W, headers: axum::http::HeaderMap, body: Body) -> Response {
    serve(w, &headers, body, true).await
}

async fn serve(
    w: Arc<Worker>,
    headers: &axum::http::HeaderMap,
    body: Body,
    chat: bool,
) -> Response {
    let body = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    let ask = match disagg::ask(&body, w.config().kv_transfer.as_ref()) {
        Ok(a) => a,
        Err(m) => return bad(m).into_response(),
    };
    let v = vocab(&w);
    let prompt = if chat {
        match body.get("messages").map(messages) {
            Some(Ok(m)) => tokens::render_chat(&m, true, v),
            Some(Err(r)) => return r.into_response(),
            None => return bad("`messages` is required").into_response(),
        }
    } else {
        match completion_prompt(&body, v) {
            Ok(p) => p,
            Err(r) => return r.into_response(),
        }
    };
    let mut c = match common(&body, prompt, &w, chat) {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let id = if chat {
        format!("chatcmpl-sim-{n}")
    } else {
        format!("cmpl-sim-{n}")
    };
    c.req.id = id.clone();
    let header = |name: &str| headers.get(name).map(|v| v.as_bytes());
    w.trace_contexts()
        .record(&id, header("traceparent"), header("tracestate"));
    let prompt_len = c.req.prompt.len();
    let prompt_ids = c.req.prompt.clone();
    // A prefill worker answers a non-streaming request with the parameters to pull it by
    // (vLLM sends them on the final non-streaming response only); its side channel is its
    // address as the proxy named it.
    let producer = match (&ask, &w.config().kv_transfer) {
        (Ask::PrefillForRemote, Some(cfg)) if !c.stream => Some(Producer {
            cfg: cfg.clone(),
            side_channel: headers
                .get(axum::http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("127.0.0.1")
                .to_string(),
            worker: w.clone(),
        }),
        _ => None,
    };
    if let Ask::DecodeFromRemote(remote) = &ask {
        if let Some(n) = remote.num_tokens.filter(|n| *n != prompt_len) {
            return bad(format!(
                "the prompt ({prompt_len} tokens) is not the one prefilled remotely ({n} tokens)"
            ))
            .into_response();
        }
        match disagg::pull(w.client(), remote).await {
            Ok(n) if n == prompt_len => {
                c.req.remote_kv = Some(RemoteKv {
                    cached_tokens: remote.cached_tokens,
                })
            }
            Ok(n) => {
                return bad(format!(
                    "the prompt ({prompt_len} tokens) is not the one prefilled remotely ({n} \
                     tokens)"
                ))
                .into_response()
            }
            Err(m) => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("KV transfer failed: {m}"),
                )
                .into_response()
            }
        }
    }
    let span = w.span_export().and_then(|e| {
        e.open(
            &id,
            header("traceparent"),
            header("tracestate"),
            c.max_tokens,
        )
    });
    let sub = match w.submit_traced(c.req, span) {
        Ok(s) => s,
        Err(e) => return bad(e.to_string()).into_response(),
    };
    let meta = Meta {
        id,
        model: model_name(&body, &w),
        created: crate::worker::unix_now() as u64,
        chat,
        prompt_len,
        include_usage: c.include_usage,
        return_token_ids: c.return_token_ids.then_some(prompt_ids),
        producer,
        prefill_leg_s: match &ask {
            Ask::DecodeFromRemote(r) => r.prefill_leg_us.map(|us| us as f64 / 1e6),
            _ => None,
        },
    };
    if c.stream {
        Sse::new(sse_stream(sub, meta)).into_response()
    } else {
        whole(sub, meta).await
    }
}

struct Meta {
    id: String,
    model: String,
    created: u64,
    chat: bool,
    prompt_len: usize,
    include_usage: bool,
    return_token_ids: Option<Vec<u32>>,
    /// A prefill worker's request for a decode worker: its KV is leased when it finishes.
    producer: Option<Producer>,
    /// A decode worker's request from a simulated prefill worker: that leg's engine seconds.
    prefill_leg_s: Option<f64>,
}

struct Producer {
    cfg: disagg::KvTransfer,
    side_channel: String,
    worker: Arc<Worker>,
}

/// The simulator's own fields on a final answer: engine seconds to the first and last token
/// (this worker's: a decode worker's start when the request reached it), and on a decode
/// worker's answer the prefill leg's engine seconds, so that the two legs add up to a
/// disaggregated request's time to first token on the engines' clock.
fn sim_extension(sub: &Submission, t: &TokenOut, prefill_leg_s: Option<f64>) -> Value {
    match &t.finished {
        Some(f) => {
            let mut v = json!({
                "dp_rank": sub.rank,
                "ttft_s": f.ttft_s,
                "e2e_s": f.e2e_s,
                "preemptions": f.preemptions,
            });
            if let Some(p) = prefill_leg_s {
                v["prefill_leg_s"] = json!(p);
            }
            v
        }
        None => json!({ "dp_rank": sub.rank }),
    }
}

async fn whole(mut sub: Submission, meta: Meta) -> Response {
    let mut ids = Vec::new();
    let mut last = None;
    while let Some(t) = sub.tokens.recv().await {
        ids.push(t.token);
        let done = t.finished.is_some();
        last = Some(t);
        if done {
            break;
        }
    }
    let Some(last) = last.filter(|t| t.finished.is_some()) else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the worker stopped the request",
        )
        .into_response();
    };
    let text = tokens::detokenize(&ids);
    let request_id = meta.id.clone();
    let choice = if meta.chat {
        json!({
            "index": 0,
            "message": { "role": "assistant", "content": text },
            "logprobs": Value::Null,
            "finish_reason": "length",
        })
    } else {
        let mut c = json!({
            "index": 0,
            "text": text,
            "logprobs": Value::Null,
            "finish_reason": "length",
        });
        if meta.return_token_ids.is_some() {
            c["token_ids"] = json!(ids);
        }
        c
    };
    let mut body = json!({
        "id": meta.id,
        "object": if meta.chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage(meta.prompt_len, ids.len(), last.num_cached_tokens),
        "sim": sim_extension(&sub, &last, meta.prefill_leg_s),
    });
    if let Some(p) = meta.return_token_ids {
        body["prompt_token_ids"] = json!(p);
    }
    if let Some(p) = meta.producer {
        p.worker
            .leases()
            .grant(&request_id, meta.prompt_len, std::time::Instant::now());
        let block = p
            .worker
            .config()
            .engine
            .spec
            .params()
            .map_or(16, |x| x.hash_block as usize);
        body["kv_transfer_params"] = disagg::producer_params(
            &p.cfg,
            &request_id,
            &p.side_channel,
            meta.prompt_len,
            last.num_cached_tokens,
            block,
            last.finished.as_ref().map_or(0.0, |f| f.e2e_s),
        );
    }
    Json(body).into_response()
}

fn chunk(meta: &Meta, delta_text: &str, first: bool, finish: Option<&str>) -> Value {
    let choice = if meta.chat {
        let mut delta = json!({ "content": delta_text });
        if first {
            delta["role"] = json!("assistant");
        }
        json!({ "index": 0, "delta": delta, "logprobs": Value::Null, "finish_reason": finish })
    } else {
        json!({ "index": 0, "text": delta_text, "logprobs": Value::Null, "finish_reason": finish })
    };
    json!({
        "id": meta.id,
        "object": if meta.chat { "chat.completion.chunk" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

fn sse_stream(sub: Submission, meta: Meta) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct St {
        sub: Submission,
        meta: Meta,
        first: bool,
        generated: usize,
        done: bool,
    }
    let st = St {
        sub,
        meta,
        first: true,
        generated: 0,
        done: false,
    };
    stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let Some(t) = st.sub.tokens.recv().await else {
            st.done = true;
            return Some((Ok(SseEvent::default().data("[DONE]")), st));
        };
        st.generated += 1;
        let text = tokens::detokenize(&[t.token]);
        let finish = t.finished.as_ref().map(|_| "length");
        let mut c = chunk(&st.meta, &text, st.first, finish);
        st.first = false;
        if st.meta.return_token_ids.is_some() && !st.meta.chat {
            c["choices"][0]["token_ids"] = json!([t.token]);
        }
        if t.finished.is_some() {
            if st.meta.include_usage {
                c["usage"] = usage(st.meta.prompt_len, st.generated, t.num_cached_tokens);
            }
            c["sim"] = sim_extension(&st.sub, &t, st.meta.prefill_leg_s);
            // The receiver ends after the last token; `[DONE]` follows.
        }
        Some((Ok(SseEvent::default().data(c.to_string())), st))
    })
}

async fn metrics(State(w): W) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        w.metrics_text(),
    )
        .into_response()
}

async fn reset_prefix_cache(State(w): W) -> Response {
    if w.reset_prefix_cache() {
        StatusCode::OK.into_response()
    } else {
        error(
            StatusCode::BAD_REQUEST,
            "the prefix cache cannot be reset while requests hold blocks",
        )
        .into_response()
    }
}
