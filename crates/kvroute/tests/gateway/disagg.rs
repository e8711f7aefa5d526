//! Disaggregated prefill and decode through the gateway, over real sockets: simulated prefill
//! workers (KV producers) and decode workers (KV consumers) speaking vLLM's NixlConnector
//! protocol, the gateway running both legs, streaming and not, a broken prefill worker retried,
//! a prefill worker dying with the request (or hanging) retried on the next, the decode choice
//! following load, and both legs' cached tokens against the predictions.

use crate::common;

use kvroute::gateway::config::{CostModel, Role, WorkerSpec};
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, KvTransfer, SimHandle, WorkerConfig};
use serde_json::{json, Value};

const PRESET: &str = "qwen3-next";

async fn pool(prefix: &str, n: usize, role: Option<&str>) -> Fleet {
    pool_at(prefix, n, role, 200.0).await
}

async fn pool_at(prefix: &str, n: usize, role: Option<&str>, speedup: f64) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = speedup;
    cfg.kv_transfer = role.map(|r| {
        format!(r#"{{"kv_connector": "NixlConnector", "kv_role": "{r}"}}"#)
            .parse::<KvTransfer>()
            .unwrap()
    });
    let mut opts = FleetOptions::new(cfg, n);
    opts.name_prefix = prefix.into();
    Fleet::start(opts).await.unwrap()
}

fn spec(h: &SimHandle, role: Role) -> WorkerSpec {
    let mut s = common::sim_spec(h, PRESET, true);
    s.role = role;
    s
}

async fn gateway(specs: Vec<WorkerSpec>, cost: CostModel) -> GatewayHandle {
    let mut cfg = common::gateway_config(specs);
    cfg.weights.cost = cost;
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    gw
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

struct Reply {
    status: u16,
    decision: Value,
    cached: Option<u64>,
    completion_tokens: Option<u64>,
    /// The simulated engine's own fields on the final answer (`sim`).
    sim: Value,
}

async fn complete(gw: &GatewayHandle, body: Value) -> Reply {
    let (status, decision, text) = common::post_completion(gw, &body).await;
    let stream = body["stream"].as_bool().unwrap_or(false);
    let last: Value = if stream {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| d.contains("usage"))
            .filter_map(|d| serde_json::from_str(d).ok())
            .next_back()
            .unwrap_or(Value::Null)
    } else {
        serde_json::from_str(&text).unwrap_or(Value::Null)
    };
    Reply {
        status,
        decision,
        cached: last["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        completion_tokens: last["usage"]["completion_tokens"].as_u64(),
        sim: last["sim"].clone(),
    }
}

/// The requests an engine finished: (prompt tokens, cached tokens, completion tokens).
async fn finished(h: &SimHandle) -> Vec<(u64, u64, u64)> {
    let v: Value = reqwest::get(format!("{}/admin/requests", h.base_url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["prompt_tokens"].as_u64().unwrap(),
                r["cached_tokens"].as_u64().unwrap(),
                r["completion_tokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_prefilled_on_one_worker_and_decoded_on_another_streaming_and_not() {
    let p = pool("p", 2, Some("kv_producer")).await;
    let d = pool("d", 2, Some("kv_consumer")).await;
    let mut specs: Vec<WorkerSpec> = p.workers.iter().map(|h| spec(h, Role::Prefill)).collect();
    specs.extend(d.workers.iter().map(|h| spec(h, Role::Decode)));
    // Without the delay-to-others charge: it weighs the arrival rate the gateway measures, so
    // how fast this test sends its requests would decide where the history goes.
    let mut cfg = common::gateway_config(specs);
    cfg.weights.cost = CostModel::Ttft;
    cfg.weights.delay_to_others = false;
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    // A conversation: each prompt extends the previous one, so the prefill worker holding the
    // history serves it from cache (the Mamba state at the previous prompt's last boundary).
    let mut body = prompt(7, 2000);
    for (i, stream) in [false, true, false, true].into_iter().enumerate() {
        body.extend(prompt(100 + i as u32, 300));
        let r = complete(
            &gw,
            json!({"model": PRESET, "prompt": body, "max_tokens": 12, "stream": stream,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.decision);
        assert_eq!(r.completion_tokens, Some(12), "the decode worker answers");
        let d_name = r.decision["worker"].as_str().unwrap();
        let p_name = r.decision["prefill"]["worker"].as_str().unwrap();
        assert!(
            d_name.starts_with('d') && p_name.starts_with('p'),
            "{}",
            r.decision
        );
        // The decode worker reports the prefill worker's hit, which the gateway predicted.
        let predicted = r.decision["prefill"]["predicted_cached"].as_u64().unwrap();
        assert_eq!(r.cached, Some(predicted), "{}", r.decision);
        if i > 0 {
            assert!(
                predicted >= 1600,
                "the history is reused: {predicted} {}",
                r.decision
            );
        }
        // The decode worker reports the prefill leg's engine time beside its own TTFT, so both
        // legs add up on the engines' clock (what `kvroute demo --pd` times).
        let leg = r.sim["prefill_leg_s"].as_f64().unwrap_or(0.0);
        assert!(leg > 0.0, "{}", r.sim);
        assert!(r.sim["ttft_s"].as_f64().is_some(), "{}", r.sim);
        common::settle(&gw).await;
        common::idle(&gw).await;
    }
    // Every prefill leg computed one token; every decode leg decoded the answer.
    let mut legs_p = Vec::new();
    for h in &p.workers {
        legs_p.extend(finished(h).await);
    }
    let mut legs_d = Vec::new();
    for h in &d.workers {
        legs_d.extend(finished(h).await);
    }
    assert_eq!(legs_p.len(), 4);
    assert_eq!(legs_d.len(), 4);
    assert!(legs_p.iter().all(|(_, _, out)| *out == 1), "{legs_p:?}");
    assert!(legs_d.iter().all(|(_, _, out)| *out == 12), "{legs_d:?}");
    // Each request is counted once, on the decode worker that answered it.
    let metrics = common::admin_metrics(&gw).await;
    let counted: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_decisions_total{"))
        .inspect(|l| assert!(l.contains("worker=\"d"), "{l}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 4.0, "{metrics}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_is_no_kv_producer_is_passed_over_for_the_next() {
    // "p0" runs without a KV connector: its answers carry no transfer parameters, so the leg
    // fails there before any byte reaches the client, and "p1" serves it.
    let broken = pool("p", 1, None).await;
    let good = pool("q", 1, Some("kv_producer")).await;
    let d = pool("d", 1, Some("kv_consumer")).await;
    let specs = vec![
        spec(&broken.workers[0], Role::Prefill),
        spec(&good.workers[0], Role::Prefill),
        spec(&d.workers[0], Role::Decode),
    ];
    let gw = gateway(specs, CostModel::Tokens).await;
    let mut via_good = 0;
    for i in 0..6u32 {
        let r = complete(
            &gw,
            json!({"model": PRESET, "prompt": prompt(300 + i, 600), "max_tokens": 4}),
        )
        .await;
        assert_eq!(r.status, 200, "request {i}: {}", r.decision);
        assert_eq!(r.decision["prefill"]["worker"], "q0");
        via_good += 1;
        common::settle(&gw).await;
        common::idle(&gw).await;
    }
    assert_eq!(via_good, 6);
    let metrics = common::admin_metrics(&gw).await;
    assert!(
        metrics.contains("kvroute_retries_total{worker=\"p0\"}"),
        "the broken worker's legs were retried: {metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_dies_with_the_request_or_hangs_is_retried_on_the_next() {
    use crate::worker_faults::{faulty_engine, Fault};
    for fault in [Fault::Reset, Fault::Hang] {
        // "a-dead" takes the prefill leg and closes the connection without an answer (a
        // process that died with the request) or never answers; with equal costs it and "q0"
        // take turns at being tried first. The leg fails before any byte reached the client,
        // so it is retried on "q0", and the decode leg then pulls from "q0".
        let (dead_url, hits) = faulty_engine(fault).await;
        let good = pool("q", 1, Some("kv_producer")).await;
        let d = pool("d", 1, Some("kv_consumer")).await;
        let mut dead = WorkerSpec::new("a-dead", &dead_url, PRESET);
        dead.role = Role::Prefill;
        let mut cfg = common::gateway_config(vec![
            dead,
            spec(&good.workers[0], Role::Prefill),
            spec(&d.workers[0], Role::Decode),
        ]);
        cfg.weights.cost = CostModel::Tokens;
        cfg.request_timeout_secs = 1.0;
        let gw = Gateway::start(cfg).await.unwrap();
        common::ready(&gw).await;
        for i in 0..4u32 {
            let r = complete(
                &gw,
                json!({"model": PRESET, "prompt": prompt(700 + i, 300), "max_tokens": 3,
                       "stream": i % 2 == 1}),
            )
            .await;
            assert_eq!(r.status, 200, "{fault:?}, request {i}: {}", r.decision);
            assert_eq!(r.decision["prefill"]["worker"], "q0", "{fault:?}");
            assert_eq!(r.decision["worker"], "d0", "{fault:?}");
            common::settle(&gw).await;
            common::idle(&gw).await;
        }
        assert!(
            hits.load(std::sync::atomic::Ordering::SeqCst) >= 1,
            "{fault:?}: the dead worker took a leg"
        );
        let metrics = common::admin_metrics(&gw).await;
        assert!(
            metrics.contains("kvroute_retries_total{worker=\"a-dead\"}"),
            "{fault:?}: the dead worker's legs were retried: {metrics}"
        );
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_worker_is_the_less_loaded_one_and_a_pull_of_unknown_kv_fails_cleanly() {
    let p = pool("p", 1, Some("kv_producer")).await;
    // Slower engines, so a long answer is still decoding when the next request is routed.
    let d = pool_at("d", 2, Some("kv_consumer"), 5.0).await;
    let mut specs = vec![spec(&p.workers[0], Role::Prefill)];
    specs.extend(d.workers.iter().map(|h| spec(h, Role::Decode)));
    let gw = gateway(specs, CostModel::Tokens).await;
    // A long answer keeps one decode worker busy while the next request is routed.
    let gw_addr = gw.addr;
    let long = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("http://{gw_addr}/v1/completions"))
            .json(&json!({"model": PRESET, "prompt": prompt(900, 400), "max_tokens": 3000, "stream": true}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    let admin = common::wait_for(common::WAIT, "the long answer in flight", || async {
        let admin = common::admin_workers(&gw).await;
        let busy = admin["workers"].as_array().unwrap().iter();
        match busy.filter(|w| w["in_flight"].as_u64() == Some(1)).count() {
            0 => Err(admin.to_string()),
            _ => Ok(admin),
        }
    })
    .await;
    let busy: Vec<String> = admin["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["in_flight"].as_u64() == Some(1))
        .map(|w| w["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(busy.len(), 1, "{admin}");
    let r = complete(
        &gw,
        json!({"model": PRESET, "prompt": prompt(901, 400), "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_ne!(r.decision["worker"].as_str().unwrap(), busy[0]);
    long.abort();
    // A decode worker asked to pull KV nobody holds answers an error, not a hang.
    let bad = reqwest::Client::new()
        .post(format!("{}/v1/completions", d.workers[0].base_url))
        .json(
            &json!({"model": PRESET, "prompt": prompt(5, 50), "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "nobody",
                "remote_request_id": "x", "remote_host": "127.0.0.1",
                "remote_port": p.workers[0].http.port()}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 500);
    let v: Value = bad.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("KV transfer failed"));
    gw.shutdown().await;
}
