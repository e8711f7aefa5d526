//! The OpenAI-compatible API of a simulated worker, over real sockets.

use crate::common;

use common::{get, post, request, wait_for, WAIT};
use kvroute_sim::{Fleet, WorkerConfig};
use serde_json::{json, Value};

async fn one(preset: &str) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(preset).unwrap();
    cfg.speedup = 1000.0;
    Fleet::start(kvroute_sim::FleetOptions::new(cfg, 1))
        .await
        .unwrap()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

#[tokio::test]
async fn health_models_and_tokenize_answer_like_vllm() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    assert_eq!(get(a, "/health").await.status, 200);
    let m = get(a, "/v1/models").await.json();
    assert_eq!(m["data"][0]["id"], "tiny-gemma3");
    let t = post(
        a,
        "/tokenize",
        &json!({"prompt": "Hello world", "add_special_tokens": true}),
    )
    .await
    .json();
    assert_eq!(t["count"], 3);
    assert_eq!(t["tokens"][0], 1);
    let c = post(
        a,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": true}),
    )
    .await
    .json();
    assert!(c["count"].as_u64().unwrap() > 4);
}

#[tokio::test]
async fn a_repeated_token_prompt_reports_the_engines_cached_tokens() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    let prompt: Vec<u32> = (0..200).map(|i| (i * 7 + 11) % 1000).collect();
    let body = json!({"model": "tiny-gemma3", "prompt": prompt, "max_tokens": 4});
    let first = post(a, "/v1/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.json();
    assert_eq!(cached(&first), 0);
    assert_eq!(first["usage"]["prompt_tokens"], 200);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    let second = post(a, "/v1/completions", &body).await.json();
    // 199 tokens may be reused: 6 blocks of 32, as vLLM computes it.
    assert_eq!(cached(&second), 192);
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);
}

#[tokio::test]
async fn forced_output_tokens_are_emitted_exactly_and_returned_as_ids() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    let body = json!({
        "prompt": [5, 6, 7, 8],
        "max_tokens": 3,
        "forced_output_token_ids": [300, 301, 302],
        "return_token_ids": true,
    });
    let r = post(a, "/v1/completions", &body).await.json();
    assert_eq!(r["choices"][0]["token_ids"], json!([300, 301, 302]));
    assert_eq!(r["prompt_token_ids"], json!([5, 6, 7, 8]));
}

#[tokio::test]
async fn a_cache_salt_separates_the_cache() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    let prompt: Vec<u32> = (0..100).collect();
    let plain = json!({"prompt": prompt, "max_tokens": 1});
    post(a, "/v1/completions", &plain).await;
    let salted = json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"});
    assert_eq!(cached(&post(a, "/v1/completions", &salted).await.json()), 0);
    assert_eq!(
        cached(&post(a, "/v1/completions", &salted).await.json()),
        96
    );
    assert_eq!(cached(&post(a, "/v1/completions", &plain).await.json()), 96);
}

#[tokio::test]
async fn text_completions_stream_sse_chunks_with_usage_on_the_last() {
    let f = one("llama").await;
    let a = f.workers[0].http;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 5, "stream": true});
    let r = post(a, "/v1/completions", &body).await;
    assert_eq!(r.status, 200);
    assert!(r.headers.to_ascii_lowercase().contains("text/event-stream"));
    let data = r.sse();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks.len(), 5);
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(cached(&chunks[4]), 0);
}

#[tokio::test]
async fn a_chat_conversation_reuses_its_previous_turn() {
    let f = one("tiny-qwen3-next").await;
    let a = f.workers[0].http;
    let system = "You are a terse assistant. ".repeat(30);
    let mut msgs = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Name three colours."}),
    ];
    let r1 = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 8}),
    )
    .await
    .json();
    let reply = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(r1["object"], "chat.completion");
    msgs.push(json!({"role": "assistant", "content": reply}));
    msgs.push(json!({"role": "user", "content": "And three more?"}));
    let body = json!({"messages": msgs, "max_tokens": 8, "stream": true});
    let r2 = post(a, "/v1/chat/completions", &body).await;
    let data = r2.sse();
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["object"], "chat.completion.chunk");
    // The first turn's prompt was stored at its replay boundary (a multiple of 64).
    let hit = cached(&last);
    assert!(hit >= 64 && hit % 64 == 0, "hit {hit}");
}

#[tokio::test]
async fn malformed_requests_get_a_400_in_vllms_error_shape() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    for body in [
        "not json",
        "[1,2]",
        r#"{"prompt": [1, -2]}"#,
        r#"{"prompt": [99999]}"#,
        r#"{"prompt": "x", "max_tokens": 0}"#,
        r#"{"prompt": "x", "max_tokens": 5000}"#,
        r#"{"prompt": "x", "n": 2}"#,
        r#"{"prompt": "x", "cache_salt": 3}"#,
        r#"{"prompt": [1], "forced_output_token_ids": "no"}"#,
        r#"{"max_tokens": 3}"#,
    ] {
        let r = request(a, "POST", "/v1/completions", Some(body)).await;
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["type"], "BadRequestError");
    }
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        Some(r#"{"messages": []}"#),
    )
    .await;
    assert_eq!(r.status, 400);
}

#[tokio::test]
async fn metrics_use_vllms_names_and_count_prefix_cache_hits() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    let prompt: Vec<u32> = (0..65).collect();
    for _ in 0..2 {
        post(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    }
    let m = get(a, "/metrics").await.body;
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:time_to_first_token_seconds_bucket{",
    ] {
        assert!(m.contains(name), "{name} missing");
    }
    let hits = m
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_hits_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(hits, Some(64.0));
    assert!(m.contains(
        "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"tiny-gemma3\"} 2"
    ));
}

#[tokio::test]
async fn pause_holds_requests_and_resume_releases_them() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    post(a, "/admin/pause", &json!({})).await;
    let pending = tokio::spawn(async move {
        post(
            a,
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
        )
        .await
    });
    let state = wait_for(WAIT, "the request waiting in the paused engine", || async {
        let state = get(a, "/admin/cache").await.json();
        match state["ranks"][0]["waiting"].as_u64() {
            Some(1) => Ok(state),
            _ => Err(state.to_string()),
        }
    })
    .await;
    assert_eq!(state["paused"], true);
    assert!(!pending.is_finished());
    post(a, "/admin/resume", &json!({})).await;
    assert_eq!(pending.await.unwrap().status, 200);
}

#[tokio::test]
async fn the_admin_cache_view_shows_the_true_cache_and_reset_clears_it() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    let prompt: Vec<u32> = (0..100).collect();
    post(
        a,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    let state = get(a, "/admin/cache").await.json();
    // Full attention (group 3) holds all three blocks; each window group the last two.
    assert_eq!(
        state["ranks"][0]["groups"]["3"].as_object().unwrap().len(),
        3
    );
    assert_eq!(
        state["ranks"][0]["groups"]["0"].as_object().unwrap().len(),
        2
    );
    assert_eq!(
        request(a, "POST", "/reset_prefix_cache", None).await.status,
        200
    );
    let state = get(a, "/admin/cache").await.json();
    assert!(state["ranks"][0]["groups"].as_object().unwrap().is_empty());
}

#[tokio::test]
async fn bodies_past_two_megabytes_are_served_and_errors_keep_vllms_shape() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    // A valid prompt inside 3 MB of JSON whitespace: vLLM's server has no body limit.
    let body = format!(
        "{{\"prompt\": [5, 6, 7, 8], \"max_tokens\": 2{}}}",
        " ".repeat(3 << 20)
    );
    let r = request(a, "POST", "/v1/completions", Some(&body)).await;
    assert_eq!(r.status, 200, "{}", &r.body[..r.body.len().min(300)]);
    assert_eq!(r.json()["usage"]["prompt_tokens"], 4);
    // A 400k-token prompt as ids (about 2.4 MB): the context-length error, as JSON.
    let ids: Vec<u32> = (0..400_000).map(|i| 5 + i % 900).collect();
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["code"], 400);
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    // Past the worker's own bound: a 413, in vLLM's shape.
    let mut cfg = WorkerConfig::for_preset("tiny-gemma3").unwrap();
    cfg.max_body_bytes = 1 << 20;
    let small = Fleet::start(kvroute_sim::FleetOptions::new(cfg, 1))
        .await
        .unwrap();
    let body = format!("{{\"prompt\": \"x\"{}}}", " ".repeat(2 << 20));
    let r = request(
        small.workers[0].http,
        "POST",
        "/v1/completions",
        Some(&body),
    )
    .await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], 413);
}

#[tokio::test]
async fn the_version_probe_and_unknown_routes_answer_like_vllm() {
    let f = one("tiny-gemma3").await;
    let a = f.workers[0].http;
    let v = get(a, "/version").await;
    assert_eq!(v.status, 200);
    assert_eq!(v.json()["version"], kvroute_sim::http::ENGINE_VERSION);
    let m = get(a, "/v1/models").await.json();
    assert_eq!(m["data"][0]["owned_by"], "vllm");
    assert!(m["data"][0]["parent"].is_null());
    let r = post(a, "/v1/completions/render", &json!({"prompt": [5, 6, 7]}))
        .await
        .json();
    assert_eq!(r[0]["token_ids"], json!([5, 6, 7]));
    let t = post(a, "/tokenize", &json!({"prompt": "Hello world"}))
        .await
        .json();
    let r = post(
        a,
        "/v1/completions/render",
        &json!({"prompt": "Hello world"}),
    )
    .await
    .json();
    assert_eq!(r[0]["token_ids"], t["tokens"], "render and tokenize agree");
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let t = post(a, "/tokenize", &json!({"messages": msgs}))
        .await
        .json();
    let r = post(a, "/v1/chat/completions/render", &json!({"messages": msgs}))
        .await
        .json();
    assert_eq!(r["token_ids"], t["tokens"]);
    let k = get(a, "/kv_event_sources").await.json();
    assert_eq!(k["0"]["publisher"], "zmq");
    assert_eq!(k["0"]["endpoint"], "tcp://127.0.0.1:0");
    let r = get(a, "/no/such/route").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "NotFoundError");
}

#[tokio::test]
async fn the_workers_http_listener_turns_off_nagle_on_every_connection_as_vllms_server_does() {
    use axum::serve::Listener;
    let raw = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = raw.local_addr().unwrap();
    let mut listener = kvroute_sim::fleet::without_nagle(raw);
    for _ in 0..2 {
        let client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server_side, _) = listener.accept().await;
        assert!(server_side.nodelay().unwrap());
        drop(client);
    }
}
