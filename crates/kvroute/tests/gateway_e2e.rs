//! End to end over real sockets: the gateway in front of a simulated hybrid fleet (real ZMQ
//! event streams, real HTTP). Routing follows the cache and predicts the engine's hit exactly;
//! streams pass through; tokens equal the worker's; a dead worker, a worker whose event stream
//! is garbage, and workers added and removed under load do not break anyone else's requests;
//! the official `openai` Python client works against the gateway; a client leaving mid-stream
//! aborts the engine's request and releases its load; conversations are recognised.

mod common;
#[path = "gateway_e2e/support.rs"]
mod support;

use kvroute::gateway::config::{KvEventsSpec, WorkerSpec};
use kvroute::gateway::Gateway;
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_follows_the_cache_and_predicts_the_engine_hit_exactly() {
    let f = fleet(3).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    let mut total_cached = 0;
    let mut replies = Vec::new();
    let mut branches_blind_misjudges = 0;
    for seed in 0..6u32 {
        let p = prompt(seed, 300);
        let first = complete(&gw, json!({"model": PRESET, "prompt": p, "max_tokens": 4})).await;
        assert_eq!(first.status, 200, "{}", first.body);
        assert_eq!(first.decision["predicted_cached"], 0);
        common::settle(&gw).await;
        // A continuation: same worker, and the prediction equals what the engine reports.
        let mut next = p.clone();
        next.extend(prompt(seed + 100, 40));
        let second = complete(
            &gw,
            json!({"model": PRESET, "prompt": next, "max_tokens": 4}),
        )
        .await;
        assert_eq!(second.status, 200);
        assert_eq!(
            second.decision["worker"], first.decision["worker"],
            "{}",
            second.decision
        );
        assert_eq!(
            second.decision["predicted_cached"].as_u64().unwrap(),
            cached(&second),
            "{}",
            second.decision
        );
        assert!(cached(&second) > 0);
        total_cached += cached(&second);
        common::settle(&gw).await;
        // A branch that shares only the first 150 tokens: the window groups cannot serve it,
        // and the gateway knows (a group-blind router would promise 128).
        let mut branch = p[..150].to_vec();
        branch.extend(prompt(seed + 200, 60));
        let third = complete(
            &gw,
            json!({"model": PRESET, "prompt": branch, "max_tokens": 2}),
        )
        .await;
        assert_eq!(
            third.decision["predicted_cached"].as_u64().unwrap(),
            cached(&third),
            "{}",
            third.decision
        );
        // On the worker holding the prompt, group-blind's view promises more than it serves.
        let holder = third.decision["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["worker"] == first.decision["worker"])
            .unwrap();
        if blind_of(holder) > holder["predicted_cached"].as_u64().unwrap() {
            branches_blind_misjudges += 1;
        }
        replies.extend([first, second, third]);
        common::settle(&gw).await;
    }
    assert!(total_cached > 1000);
    assert!(branches_blind_misjudges > 0, "the branches' window groups");
    // The group-blind counters equal what the decisions' chosen candidates say.
    let (mut differs, mut over) = (0u64, 0u64);
    for r in &replies {
        let chosen = &r.decision["candidates"][0];
        let (blind, exact) = (
            blind_of(chosen),
            chosen["predicted_cached"].as_u64().unwrap(),
        );
        differs += u64::from(blind != exact);
        over += blind.saturating_sub(exact);
    }
    let admin = common::admin_metrics(&gw).await;
    let counter = |name: &str| {
        admin
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(
        counter("kvroute_group_blind_disagreements_total{kind=\"prediction\"}"),
        differs,
        "{admin}"
    );
    assert_eq!(
        counter("kvroute_group_blind_overpromised_tokens_total"),
        over,
        "{admin}"
    );
    let metrics = reqwest::get(format!("http://{}/metrics", gw.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_prediction_error_tokens_bucket"),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_and_text_prompts_tokenize_like_the_worker() {
    let f = fleet(2).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    let client = reqwest::Client::new();
    // Text completion: the gateway's tokens are the worker's (same count, and the repeat is
    // predicted exactly, which needs identical token ids to hash).
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let body = json!({"model": PRESET, "prompt": text, "max_tokens": 3});
    let a = complete(&gw, body.clone()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let worker_url = &f
        .workers
        .iter()
        .find(|w| w.name == a.decision["worker"])
        .unwrap()
        .base_url;
    let tok: Value = client
        .post(format!("{worker_url}/tokenize"))
        .json(&json!({"prompt": text}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        a.decision["prompt_tokens"],
        json!(tok["tokens"].as_array().unwrap().len())
    );
    assert_eq!(
        a.body["usage"]["prompt_tokens"],
        a.decision["prompt_tokens"]
    );
    common::settle(&gw).await;
    let b = complete(&gw, body).await;
    assert!(cached(&b) > 0);
    assert_eq!(b.decision["predicted_cached"].as_u64().unwrap(), cached(&b));

    // Chat: the gateway's tokens are the worker's rendering of the same messages.
    let msgs = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]);
    let r = client
        .post(format!("http://{}/v1/chat/completions", gw.addr))
        .json(&json!({"model": PRESET, "messages": msgs, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let decision: Value = serde_json::from_str(
        r.headers()
            .get("x-kvroute-decision")
            .unwrap()
            .to_str()
            .unwrap(),
    )
    .unwrap();
    let chat: Value = r.json().await.unwrap();
    let tok: Value = client
        .post(format!("{worker_url}/tokenize"))
        .json(&json!({"messages": msgs, "add_generation_prompt": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        decision["prompt_tokens"],
        json!(tok["tokens"].as_array().unwrap().len())
    );
    assert_eq!(chat["usage"]["prompt_tokens"], decision["prompt_tokens"]);

    // Streaming chat: chunks arrive one by one (SSE), the last carries usage.
    let msgs = json!([{"role": "system", "content": "Be brief. ".repeat(40)}, {"role": "user", "content": "Hello"}]);
    let r = client
        .post(format!("http://{}/v1/chat/completions", gw.addr))
        .json(&json!({"model": PRESET, "messages": msgs, "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut stream = r.bytes_stream();
    let mut chunks = 0;
    let mut all = String::new();
    use futures_util::StreamExt;
    while let Some(c) = stream.next().await {
        chunks += 1;
        all.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    assert!(chunks > 1, "the stream arrived in one piece");
    assert!(
        all.contains("[DONE]") && all.contains("cached_tokens"),
        "{all}"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_costs_no_request_once_requests_move_to_the_others() {
    let mut f = fleet(3).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    for i in 0..6u32 {
        let r = complete(
            &gw,
            json!({"model": PRESET, "prompt": prompt(i, 100), "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // Kill one worker mid-run (its HTTP server and publisher stop).
    let dead = f.workers.remove(1);
    let dead_name = dead.name.clone();
    drop(dead);
    let mut ok = 0;
    for i in 0..30u32 {
        let r = complete(
            &gw,
            json!({"model": PRESET, "prompt": prompt(i % 6, 100), "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, 200, "request {i} failed: {}", r.body);
        assert_ne!(r.decision["worker"], json!(dead_name));
        ok += 1;
    }
    assert_eq!(ok, 30);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_streaming_garbage_events_does_not_spoil_the_others() {
    use zeromq::{Socket, SocketSend};
    let f = fleet(2).await;
    // A third "worker": a real HTTP sim, but its event endpoint is a publisher we feed garbage.
    let mut garbage = zeromq::PubSocket::new();
    let ep = garbage.bind("tcp://127.0.0.1:0").await.unwrap();
    let gport = ep.to_string().rsplit(':').next().unwrap().to_string();
    let extra = fleet(1).await;
    let mut bad = spec(&extra.workers[0]);
    bad.name = "zz-garbage".into();
    bad.kv_events = Some(KvEventsSpec {
        endpoint: format!("tcp://*:{gport}"),
        replay_endpoint: None,
        topic: String::new(),
        host: Some("127.0.0.1".into()),
        ..KvEventsSpec::new("")
    });
    let mut specs: Vec<WorkerSpec> = f.workers.iter().map(spec).collect();
    specs.push(bad);
    // Without the delay-to-others charge cold prompts take turns over the workers; with it
    // they would all go to the worker that has had the least traffic, the garbage one.
    let mut cfg = common::gateway_config(specs);
    cfg.weights.delay_to_others = false;
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    let feeder = tokio::spawn(async move {
        for i in 0..200u64 {
            let frames: Vec<bytes::Bytes> = vec![
                bytes::Bytes::from_static(b""),
                bytes::Bytes::from(i.to_be_bytes().to_vec()),
                bytes::Bytes::from(vec![0xc1, 0x93, 0xff, (i % 256) as u8]),
            ];
            let _ = garbage
                .send(zeromq::ZmqMessage::try_from(frames).unwrap())
                .await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    // Cold prompts take turns over the three workers; the garbage worker's cache is unknown to
    // the gateway, so only prompts first served by a good worker are checked.
    let mut checked = 0;
    for seed in 0..8u32 {
        let p = prompt(seed + 50, 250);
        let a = complete(&gw, json!({"model": PRESET, "prompt": p, "max_tokens": 2})).await;
        assert_eq!(a.status, 200);
        common::settle_except(&gw, &["zz-garbage"]).await;
        if a.decision["worker"] == "zz-garbage" {
            continue;
        }
        checked += 1;
        let b = complete(&gw, json!({"model": PRESET, "prompt": p, "max_tokens": 2})).await;
        assert_eq!(b.status, 200);
        assert_ne!(b.decision["worker"], "zz-garbage", "{}", b.decision);
        assert!(cached(&b) > 0);
        assert_eq!(
            b.decision["predicted_cached"].as_u64().unwrap(),
            cached(&b),
            "{}",
            b.decision
        );
        common::settle_except(&gw, &["zz-garbage"]).await;
    }
    assert!(
        checked >= 4,
        "{checked} prompts first served by a good worker"
    );
    feeder.await.unwrap();
    let snap = gw.state.registry.wire_stats.snapshot();
    assert!(
        snap.batch_errors.values().sum::<u64>() > 0,
        "the garbage was counted"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_added_and_removed_under_load_keep_every_request_served() {
    let f = fleet(3).await;
    let gw = gateway(vec![spec(&f.workers[0])]).await;
    let admin = format!("http://{}", gw.admin_addr);
    let base = format!("http://{}", gw.addr);
    // Requests go one after another until the worker changes are over; before each change and
    // after the last, the test waits for more answers, so the load provably overlaps every one.
    let answered = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (answered, stop) = (answered.clone(), stop.clone());
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut statuses = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let r = client
                    .post(format!("{base}/v1/completions"))
                    .json(&json!({"model": PRESET, "prompt": prompt(i % 10, 120), "max_tokens": 2}))
                    .send()
                    .await
                    .unwrap();
                statuses.push(r.status().as_u16());
                answered.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
            statuses
        })
    };
    let more_answers = |what: &'static str| {
        let answered = answered.clone();
        async move {
            let from = answered.load(Ordering::SeqCst);
            common::wait_until(common::WAIT, what, || async {
                answered.load(Ordering::SeqCst) >= from + 3
            })
            .await;
        }
    };
    let client = reqwest::Client::new();
    more_answers("requests answered before the first change").await;
    for w in &f.workers[1..] {
        let r = client
            .post(format!("{admin}/admin/workers"))
            .json(&spec(w))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
        more_answers("requests answered after a worker was added").await;
    }
    let r = client
        .delete(format!("{admin}/admin/workers/w0"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    more_answers("requests answered after w0 was removed").await;
    stop.store(true, Ordering::SeqCst);
    let statuses = load.await.unwrap();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let list: Value = client
        .get(format!("{admin}/admin/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["w1", "w2"]);
    assert!(
        gw.state
            .registry
            .index
            .ranks()
            .iter()
            .all(|(w, _)| &**w != "w0"),
        "w0's index state is gone"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_through_the_gateway() {
    if !common::python::python_has(&["openai"], "openai") {
        return;
    }
    let f = fleet(2).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    let url = format!("http://{}", gw.addr);
    // Two scripts: between them the gateway's index takes in the first request's events
    // (settle), where one script slept 0.2 s and hoped.
    let first = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = c.models.list().data[0].id
c.completions.create(model=model, prompt=list(range(3, 303)), max_tokens=4)
print("ok")
"#;
    let then = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = c.models.list().data[0].id
r2 = c.completions.create(model=model, prompt=list(range(3, 303)), max_tokens=4)
assert r2.usage.prompt_tokens_details.cached_tokens == 288, r2.usage
msgs = [{"role": "system", "content": "Be brief. " * 60}, {"role": "user", "content": "Hello!"}]
chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                        stream_options={"include_usage": True}))
assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
print("ok")
"#;
    for (k, script) in [first, then].into_iter().enumerate() {
        if k > 0 {
            common::settle(&gw).await;
        }
        let out = run("python3", vec!["-c".into(), script.into(), url.clone()]).await;
        assert!(
            out.status.success(),
            "script {k}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_asks_a_running_gateway_for_every_workers_prediction() {
    let f = fleet(2).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    let p = prompt(7, 200);
    let r = complete(&gw, json!({"model": PRESET, "prompt": p, "max_tokens": 2})).await;
    assert_eq!(r.status, 200);
    common::settle(&gw).await;
    let toks: Vec<String> = p.iter().map(u32::to_string).collect();
    let admin = format!("http://{}", gw.admin_addr);
    let args = vec![
        "explain".into(),
        "--gateway".into(),
        admin,
        "--tokens".into(),
        toks.join(","),
    ];
    let out = run(env!("CARGO_BIN_EXE_kvroute"), args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let preds = v["predictions"].as_array().unwrap();
    assert_eq!(preds.len(), 2);
    let warm = preds
        .iter()
        .find(|p| p["worker"] == r.decision["worker"])
        .unwrap();
    assert_eq!(warm["cached"], 192);
    assert!(
        !warm["groups"].as_array().unwrap().is_empty(),
        "per-group evidence"
    );
    assert_eq!(v["decision"]["worker"], r.decision["worker"]);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_capture_records_a_live_stream_that_decodes_back() {
    let f = fleet(1).await;
    let h = &f.workers[0];
    let out = std::env::temp_dir().join(format!("kvroute-capture-{}.jsonl", std::process::id()));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "events",
            "capture",
            "--endpoint",
            &h.zmq[0],
            "--replay",
            &h.replay[0],
            "--worker",
            "w0",
            "--seconds",
            "3",
        ])
        .arg("--out")
        .arg(&out)
        .spawn()
        .unwrap();
    // No pause for the capture to subscribe: its first catch-up replays from seq 0 whatever
    // was published before it joined.
    let client = reqwest::Client::new();
    for i in 0..4u32 {
        let r = client
            .post(format!("{}/v1/completions", h.base_url))
            .json(&json!({"model": PRESET, "prompt": prompt(i, 100), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success());
    let decoded = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["events", "decode"])
        .arg(&out)
        .output()
        .unwrap();
    let events = String::from_utf8_lossy(&decoded.stdout);
    let stored = events.lines().filter(|l| l.contains("\"Stored\"")).count();
    assert!(
        stored >= 4 * 4,
        "4 requests × 4 groups: {stored} stores\n{}",
        String::from_utf8_lossy(&decoded.stderr)
    );
    let _ = std::fs::remove_file(out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_worker_is_followed_on_every_rank() {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    cfg.data_parallel_size = 2;
    let (live, replay) = (consecutive_ports(), consecutive_ports());
    let mut publisher = kvroute_sim::PublisherConfig::new(&format!("tcp://*:{live}"));
    publisher.replay_endpoint = Some(format!("tcp://*:{replay}"));
    cfg.zmq = Some(publisher);
    let h = kvroute_sim::start_worker("w0", cfg, ([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    assert_eq!(h.zmq.len(), 2, "one publisher per rank, on port + rank");
    let mut s = WorkerSpec::new("w0", &h.base_url, PRESET);
    s.dp_size = 2;
    s.kv_events = Some(KvEventsSpec {
        endpoint: format!("tcp://*:{live}"),
        replay_endpoint: Some(format!("tcp://*:{replay}")),
        topic: String::new(),
        host: Some("127.0.0.1".into()),
        ..KvEventsSpec::new("")
    });
    let gw = gateway(vec![s]).await;
    for i in 0..6u32 {
        let r = complete(
            &gw,
            json!({"model": PRESET, "prompt": prompt(i + 300, 120), "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, 200);
        common::settle(&gw).await;
    }
    // Each rank's events landed under its own rank: both hold blocks, and different ones.
    let contents = gw.state.registry.index.contents();
    let r0 = contents.get(&("w0".into(), 0)).cloned().unwrap_or_default();
    let r1 = contents.get(&("w0".into(), 1)).cloned().unwrap_or_default();
    assert!(!r0.is_empty() && !r1.is_empty(), "{contents:?}");
    assert_ne!(r0, r1);
    gw.shutdown().await;
}

#[tokio::test]
async fn streamed_answers_teach_the_ttft_and_decode_models_and_each_decision_shows_its_estimate() {
    let f = fleet(2).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    let client = reqwest::Client::new();
    let mut estimates = Vec::new();
    for k in 0..24u32 {
        let prompt: Vec<u32> = (0..100 + 20 * k)
            .map(|i| (i * 7 + k * 131) % 1000)
            .collect();
        let r = client
            .post(format!("http://{}/v1/completions", gw.addr))
            .json(
                &json!({"prompt": prompt, "max_tokens": 3 + k % 2, "stream": true,
                "stream_options": {"include_usage": k % 2 == 0}}),
            )
            .send()
            .await
            .unwrap();
        let d: Value =
            serde_json::from_str(r.headers()["x-kvroute-decision"].to_str().unwrap()).unwrap();
        let est = d["predicted_ttft_ms"].as_f64().unwrap();
        assert!(est > 0.0, "every decision carries its TTFT estimate");
        let chosen = d["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["worker"] == d["worker"])
            .unwrap()
            .clone();
        assert_eq!(chosen["predicted_ttft_ms"].as_f64(), Some(est));
        assert!(d["best_cached"].as_u64().unwrap() >= d["predicted_cached"].as_u64().unwrap());
        estimates.push(est);
        let _ = r.text().await.unwrap();
    }
    // Each streamed answer's first byte was observed: the models moved off their prior.
    let metrics = common::admin_metrics(&gw).await;
    let observed: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_ttft_prediction_error_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(observed, 24.0, "{metrics}");
    assert!(metrics.contains("kvroute_ttft_prediction_relative_error_bucket"));
    let admin = common::admin_workers(&gw).await;
    let per_worker: u64 = admin["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["ttft_model"]["samples"].as_u64().unwrap())
        .sum();
    assert_eq!(per_worker, 24);
    assert_eq!(admin["fleet_ttft_model"]["samples"], 24);
    assert_eq!(estimates.len(), 24);
    // Each answer's tokens and inter-token latency were read from its stream, with the
    // engine's usage or without: answers of 3 and 4 tokens.
    assert_eq!(admin["fleet_decode_model"]["samples"], 24, "{admin}");
    let mean = admin["mean_output_tokens"].as_f64().unwrap();
    assert!((3.0..=4.0).contains(&mean), "{mean}");
    let per_worker: u64 = admin["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["decode_model"]["samples"].as_u64().unwrap())
        .sum();
    assert_eq!(per_worker, 24);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_are_recognised_and_only_a_new_one_is_priced_with_its_later_turns() {
    let f = fleet(2).await;
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    // Ten conversations of three turns: each turn's prompt is the previous prompt, the reply
    // and a new question, as a chat client sends it.
    let mut follow_ups_seen = Vec::new();
    for c in 0..10u32 {
        let mut p = prompt(1000 + c, 64);
        for turn in 0..3u32 {
            let r = complete(&gw, json!({"prompt": p, "max_tokens": 4})).await;
            assert_eq!(r.status, 200);
            let k = r.decision["follow_ups"].as_f64().unwrap();
            if turn == 0 {
                follow_ups_seen.push(k);
            } else {
                assert_eq!(k, 0.0, "a follow-up is ranked by its own TTFT");
                for cand in r.decision["candidates"].as_array().unwrap() {
                    assert!(cand.get("later_turns_ms").is_none(), "{cand}");
                }
            }
            let reply: Vec<u32> = r.body["choices"][0]["token_ids"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|t| t.as_u64())
                        .map(|t| t as u32)
                        .collect()
                })
                .unwrap_or_else(|| vec![7, 7, 7, 7]);
            p.extend(reply);
            p.extend(prompt(5000 + 10 * c + turn, 20));
        }
    }
    // Two of every three requests were follow-ups: a new conversation expects about two more.
    assert_eq!(
        follow_ups_seen[0], 0.0,
        "nothing is expected before any follow-up"
    );
    let last = *follow_ups_seen.last().unwrap();
    assert!((1.5..=2.5).contains(&last), "expected follow-ups {last}");
    let metrics = common::admin_metrics(&gw).await;
    assert!(
        metrics.contains("kvroute_follow_up_requests_total 20"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_expected_follow_ups"));
    let admin = common::admin_workers(&gw).await;
    let mut live = 0.0;
    for w in admin["workers"].as_array().unwrap() {
        assert!(w["ttft_model"]["load_wait_ms"].as_f64().unwrap() >= 0.0);
        assert!(w["requests_per_s"].as_f64().unwrap() > 0.0, "{w}");
        live += w["live_conversations"].as_f64().unwrap();
    }
    // The turn cycle and the follow-ups' prefill were learned from the twenty follow-ups, and
    // the conversations started since then live on the workers that took them.
    let conv = &admin["conversations"];
    assert!(conv["turn_cycle_ms"].as_f64().unwrap() > 0.0, "{conv}");
    assert!(
        conv["follow_up_prefill_ms"].as_f64().unwrap() >= 0.0,
        "{conv}"
    );
    assert!(live > 0.0, "{admin}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_aborts_the_engines_request_and_releases_its_load() {
    // Engines in real time: a 900-token answer streams for seconds.
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1.0;
    let f = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    let gw = gateway(f.workers.iter().map(spec).collect()).await;
    let engine = f.workers[0].base_url.clone();
    let running = || {
        let engine = engine.clone();
        async move {
            let v: Value = reqwest::get(format!("{engine}/admin/cache"))
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["ranks"][0]["running"].as_u64().unwrap() + v["ranks"][0]["waiting"].as_u64().unwrap()
        }
    };
    let mut r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"prompt": prompt(3, 64), "max_tokens": 900, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The first chunk arrives: the request runs on the engine and is booked on the worker.
    assert!(r.chunk().await.unwrap().is_some());
    assert_eq!(running().await, 1);
    let w = gw.state.registry.all()[0].clone();
    assert_eq!(w.in_flight.load(std::sync::atomic::Ordering::Relaxed), 1);
    // The client goes away.
    drop(r);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while (running().await > 0 || w.in_flight.load(std::sync::atomic::Ordering::Relaxed) > 0)
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(running().await, 0, "the engine aborted the request");
    assert_eq!(
        w.in_flight.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "load released"
    );
    assert_eq!(
        w.queued_prefill.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    gw.shutdown().await;
}
