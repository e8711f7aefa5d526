//! Clients behaving badly at the front, over raw TCP: every case in the table gets the right
//! status (with OpenAI's error body where there is a body), a good request right after it is
//! served normally, and nothing is disturbed behind (the worker stays healthy, no request
//! counts against it). Then the connection-level cases: slow heads and bodies, truncated
//! bodies, heads too large, a thousand idle connections.

mod common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, LoraModule, WorkerConfig};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";
const BODY_LIMIT: usize = 16 * 1024 * 1024;

/// One worker serving the base model and an adapter (two model names: `model` is required).
async fn setup() -> (Fleet, GatewayHandle) {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    cfg.lora_modules = vec![LoraModule {
        name: "sql".into(),
        path: "/adapters/sql".into(),
    }];
    let f = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    let mut spec = common::sim_spec(&f.workers[0], PRESET, true);
    spec.lora_modules
        .insert("sql".into(), "/adapters/sql".into());
    let gw = Gateway::start(GatewayConfig {
        header_timeout_secs: 0.5,
        body_timeout_secs: 0.5,
        max_body_bytes: BODY_LIMIT,
        ..common::gateway_config(vec![spec])
    })
    .await
    .unwrap();
    common::ready(&gw).await;
    (f, gw)
}

/// Sends `bytes` on a fresh connection (then closes the write half when `close`), and returns
/// the status and the body of the answer (status 0: the connection closed without one).
fn exchange(addr: &str, bytes: &[u8], close: bool, wait: Duration) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    // A peer that stops reading mid-upload (limits) may reset the rest: that is its answer.
    let _ = s.write_all(bytes);
    if close {
        let _ = s.shutdown(Shutdown::Write);
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if complete(&got) {
                    break;
                }
            }
        }
    }
    let text = String::from_utf8_lossy(&got).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    (status, body)
}

/// Whether a response with a `content-length` is all there.
fn complete(got: &[u8]) -> bool {
    let text = String::from_utf8_lossy(got);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .is_some_and(|n| body.len() >= n)
}

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// An OpenAI error body: `error.message`, `type`, `param`, `code`.
fn assert_openai_error(what: &str, status: u16, body: &str) {
    let v: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e["message"].is_string(), "{what}: {v}");
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(e.get("param").is_some(), "{what}: {v}");
    assert_eq!(e["code"].as_u64(), Some(status as u64), "{what}: {v}");
}

fn good() -> Vec<u8> {
    post(
        "/v1/completions",
        json!({"model": PRESET, "prompt": [5, 6, 7, 8], "max_tokens": 1})
            .to_string()
            .as_bytes(),
    )
}

fn completion(extra: Value) -> Vec<u8> {
    let mut body = json!({"model": PRESET, "prompt": [1, 2, 3], "max_tokens": 2});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    post("/v1/completions", body.to_string().as_bytes())
}

fn chat(extra: Value) -> Vec<u8> {
    let mut body = json!({"model": PRESET, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    post("/v1/chat/completions", body.to_string().as_bytes())
}

/// (what, request bytes, expected status). Statuses with a body carry OpenAI's error shape.
fn table() -> Vec<(&'static str, Vec<u8>, u16)> {
    let big = u64::from(u32::MAX) + 1;
    let million: Vec<u32> = (0..1_000_000u32).map(|i| i % 1000 + 1).collect();
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let mut oversize = br#"{"model": "tiny-gemma3", "prompt": ""#.to_vec();
    oversize.extend(std::iter::repeat_n(b'a', BODY_LIMIT + 16));
    oversize.extend(br#""}"#);
    vec![
        ("not JSON", post("/v1/completions", b"{not json"), 400),
        ("a JSON array", post("/v1/completions", b"[1, 2]"), 400),
        ("a JSON string", post("/v1/completions", b"\"hi\""), 400),
        ("an empty body", post("/v1/completions", b""), 400),
        (
            "invalid UTF-8",
            post("/v1/completions", b"{\"prompt\": \"\xff\xfe\"}"),
            400,
        ),
        (
            "JSON nested 10,000 deep",
            post("/v1/completions", deep.as_bytes()),
            400,
        ),
        (
            "missing model with two served",
            post("/v1/completions", br#"{"prompt": "hi"}"#),
            400,
        ),
        ("model a number", completion(json!({"model": 7})), 400),
        (
            "an unknown model",
            completion(json!({"model": "gpt-9"})),
            404,
        ),
        (
            "missing prompt",
            post("/v1/completions", br#"{"model": "tiny-gemma3"}"#),
            400,
        ),
        ("prompt a number", completion(json!({"prompt": 42})), 400),
        (
            "a negative token id",
            completion(json!({"prompt": [1, -2]})),
            400,
        ),
        (
            "a token id beyond u32",
            completion(json!({"prompt": [1, big]})),
            400,
        ),
        (
            "a token id beyond the vocabulary",
            completion(json!({"prompt": [1, 900_000_000]})),
            400,
        ),
        (
            "a batch of prompts",
            completion(json!({"prompt": ["a", "b"]})),
            400,
        ),
        (
            "an empty text prompt (served: the tokenizer adds its BOS)",
            completion(json!({"prompt": ""})),
            200,
        ),
        (
            "an empty token list",
            completion(json!({"prompt": []})),
            400,
        ),
        (
            "a prompt of a million tokens",
            completion(json!({"prompt": million})),
            400,
        ),
        (
            "negative max_tokens",
            completion(json!({"max_tokens": -1})),
            400,
        ),
        ("zero max_tokens", completion(json!({"max_tokens": 0})), 400),
        (
            "huge max_tokens",
            completion(json!({"max_tokens": 1_000_000_000_000u64})),
            400,
        ),
        (
            "max_tokens beyond the context",
            completion(json!({"max_tokens": 10_000_000})),
            400,
        ),
        (
            "max_tokens a string",
            completion(json!({"max_tokens": "8"})),
            400,
        ),
        (
            "n = 2 (this engine serves n = 1)",
            completion(json!({"n": 2})),
            400,
        ),
        ("n = 0", completion(json!({"n": 0})), 400),
        ("n a string", completion(json!({"n": "one"})), 400),
        ("stream a string", completion(json!({"stream": "yes"})), 400),
        (
            "stream_options a string",
            completion(json!({"stream_options": "x"})),
            400,
        ),
        (
            "temperature a string",
            completion(json!({"temperature": "hot"})),
            400,
        ),
        (
            "negative temperature",
            completion(json!({"temperature": -1.0})),
            400,
        ),
        ("top_p above 1", completion(json!({"top_p": 2.0})), 400),
        ("top_k a float", completion(json!({"top_k": 1.5})), 400),
        ("stop a number", completion(json!({"stop": 5})), 400),
        (
            "stop with a number",
            completion(json!({"stop": ["a", 1]})),
            400,
        ),
        ("seed a string", completion(json!({"seed": "s"})), 400),
        (
            "completions logprobs a bool",
            completion(json!({"logprobs": true})),
            400,
        ),
        (
            "logit_bias a list",
            completion(json!({"logit_bias": [1]})),
            400,
        ),
        (
            "cache_salt a number",
            completion(json!({"cache_salt": 5})),
            400,
        ),
        (
            "cache_salt empty",
            completion(json!({"cache_salt": ""})),
            400,
        ),
        ("echo a string", completion(json!({"echo": "no"})), 400),
        ("user a number", completion(json!({"user": 1})), 400),
        (
            "unknown fields pass (the engine ignores them)",
            completion(json!({"frobnicate": {"x": [1, 2]}})),
            200,
        ),
        (
            "nulls stand for absent",
            completion(json!({"temperature": null, "stop": null, "n": null})),
            200,
        ),
        (
            "chat without messages",
            post("/v1/chat/completions", br#"{"model": "tiny-gemma3"}"#),
            400,
        ),
        ("chat with no message", chat(json!({"messages": []})), 400),
        (
            "messages an object",
            chat(json!({"messages": {"role": "user"}})),
            400,
        ),
        (
            "a message without a role",
            chat(json!({"messages": [{"content": "x"}]})),
            400,
        ),
        (
            "a message whose content is a number",
            chat(json!({"messages": [{"role": "user", "content": 5}]})),
            400,
        ),
        (
            "a message that is a string",
            chat(json!({"messages": ["hello"]})),
            400,
        ),
        (
            "chat logprobs an integer",
            chat(json!({"logprobs": 3})),
            400,
        ),
        ("tools an object", chat(json!({"tools": {"a": 1}})), 400),
        ("tool_choice a number", chat(json!({"tool_choice": 1})), 400),
        (
            "max_completion_tokens negative",
            chat(json!({"max_completion_tokens": -4})),
            400,
        ),
        (
            "a body over the limit",
            post("/v1/completions", &oversize),
            413,
        ),
        (
            "GET on a POST route",
            b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(),
            405,
        ),
        (
            "an unknown path",
            b"GET /v2/engines HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(),
            404,
        ),
        (
            "a head over the limit",
            format!(
                "GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
                "a".repeat(100 * 1024)
            )
            .into_bytes(),
            431,
        ),
        (
            "not HTTP at all",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n".to_vec(),
            400,
        ),
    ]
}

async fn in_blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_gets_its_status_and_the_next_good_one_is_served() {
    let (_f, gw) = setup().await;
    let addr = gw.addr.to_string();
    let cases = table();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    for (what, bytes, want) in cases {
        let a = addr.clone();
        let (status, body) =
            in_blocking(move || exchange(&a, &bytes, false, Duration::from_secs(20))).await;
        assert_eq!(status, want, "{what}: {body}");
        if (400..600).contains(&status) && !body.is_empty() && status != 431 && status != 405 {
            assert_openai_error(what, status, &body);
        }
        let a = addr.clone();
        let (status, body) =
            in_blocking(move || exchange(&a, &good(), false, Duration::from_secs(20))).await;
        assert_eq!(status, 200, "a good request after {what}: {body}");
    }
    let w = &gw.state.registry.all()[0];
    assert!(w.routable(), "the worker stays healthy");
    let metrics = common::admin_metrics(&gw).await;
    assert!(
        !metrics.contains("kvroute_worker_ejections_total{"),
        "no client error counts against the worker"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_truncated_and_idle_clients_are_bounded_and_disturb_nobody() {
    let (_f, gw) = setup().await;
    let addr = gw.addr.to_string();
    // A body that stops short of its content-length and never comes: 408 after the body timeout.
    // The 408 itself says the gateway's timeout ended it (the client waits 10 s and sends none).
    let a = addr.clone();
    let (status, body) = in_blocking(move || {
        let mut head =
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 400\r\n\r\n".to_vec();
        head.extend_from_slice(br#"{"model": "tiny-gemma3", "#);
        exchange(&a, &head, false, Duration::from_secs(10))
    })
    .await;
    assert_eq!(status, 408, "{body}");
    assert_openai_error("a stalled body", status, &body);
    // A body cut short by the client closing its side: 400.
    let a = addr.clone();
    let (status, body) = in_blocking(move || {
        let mut head =
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 400\r\n\r\n".to_vec();
        head.extend_from_slice(br#"{"model": "#);
        exchange(&a, &head, true, Duration::from_secs(10))
    })
    .await;
    assert!(
        status == 400 || status == 0,
        "a truncated body is refused or the connection closed: {status} {body}"
    );
    // A head that trickles in and never ends: the connection is closed after the head timeout.
    let a = addr.clone();
    let started = Instant::now();
    let (status, _) = in_blocking(move || {
        exchange(
            &a,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ",
            false,
            Duration::from_secs(10),
        )
    })
    .await;
    assert!(
        status == 0 || status == 408,
        "a slow head gets no request through: {status}"
    );
    // Not a wall-clock verdict on speed: the head timeout is 0.5 s and the client gives up
    // after 10 s, so 5 s only tells "the gateway closed it" from "the client stopped waiting"
    // (ten times the timeout, half the client's patience).
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed after the head timeout, not left open"
    );
    // A thousand idle connections, then a good request.
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let a = addr.clone();
    let (status, body) =
        in_blocking(move || exchange(&a, &good(), false, Duration::from_secs(20))).await;
    assert_eq!(status, 200, "{body}");
    let metrics = common::admin_metrics(&gw).await;
    assert!(
        metrics.contains("kvroute_connections_open{listener=\"front\"}"),
        "{metrics}"
    );
    drop(idle);
    // The idle ones are closed after the head timeout; the gauge comes back down.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = common::admin_metrics(&gw).await;
        let open = m
            .lines()
            .find(|l| l.starts_with("kvroute_connections_open{listener=\"front\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::MAX);
        if open <= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "idle connections stay open: {open}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_connections_new_connections_are_closed_and_counted() {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    let f = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    let gw = Gateway::start(GatewayConfig {
        max_connections: 8,
        ..common::gateway_config(vec![common::sim_spec(&f.workers[0], PRESET, true)])
    })
    .await
    .unwrap();
    let addr = gw.addr.to_string();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    open_connections_reach(&gw, 8.0).await;
    let a = addr.clone();
    let (status, _) =
        in_blocking(move || exchange(&a, &good(), false, Duration::from_secs(5))).await;
    assert_eq!(status, 0, "the ninth connection is closed at accept");
    let metrics = common::admin_metrics(&gw).await;
    assert!(
        metrics.contains("kvroute_connections_refused_total{listener=\"front\"} 1"),
        "{metrics}"
    );
    drop(held);
    open_connections_reach(&gw, 0.0).await;
    let (status, body) =
        in_blocking(move || exchange(&addr, &good(), false, Duration::from_secs(20))).await;
    assert_eq!(status, 200, "served again once connections closed: {body}");
    gw.shutdown().await;
}

/// Waits until the gateway counts `n` connections open on its front listener.
async fn open_connections_reach(gw: &GatewayHandle, n: f64) {
    let open = "kvroute_connections_open{listener=\"front\"}";
    common::wait_until(
        common::WAIT,
        &format!("{n} front connections open"),
        || async { common::metric(&common::admin_metrics(gw).await, open) == n },
    )
    .await
}
