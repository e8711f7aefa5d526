//! LoRA adapters end to end over real sockets: the gateway in front of two simulated workers
//! (real HTTP, real ZMQ event streams), one of them serving adapter `sql` beside the base
//! model. The gateway learns the adapter from the worker's `/v1/models`, sends adapter
//! requests only to the worker serving it, and predicts them (hashed with the adapter's
//! `("lora", name, path)` key) exactly as the engine reports them; base-model and adapter
//! requests with the same prompt share no cache; an unknown model is refused.

use crate::common;

use kvroute::gateway::config::WorkerSpec;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{PublisherConfig, SimHandle, WorkerConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const BASE: &str = "base";

async fn sim(name: &str, adapters: &[&str]) -> SimHandle {
    let mut cfg = WorkerConfig::for_preset("llama").unwrap();
    cfg.model = BASE.into();
    cfg.speedup = 1000.0;
    cfg.lora_modules = adapters.iter().map(|a| a.parse().unwrap()).collect();
    cfg.zmq = Some(PublisherConfig::new("tcp://127.0.0.1:0"));
    kvroute_sim::start_worker(name, cfg, ([127, 0, 0, 1], 0).into())
        .await
        .unwrap()
}

fn spec(h: &SimHandle) -> WorkerSpec {
    common::sim_spec(h, BASE, false)
}

async fn gateway(workers: Vec<WorkerSpec>) -> GatewayHandle {
    Gateway::start(common::gateway_config(workers))
        .await
        .unwrap()
}

/// Waits until the gateway lists `model` (learned from a worker's `/v1/models`).
async fn wait_listed(gw: &GatewayHandle, model: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed: Value = reqwest::get(format!("http://{}/v1/models", gw.addr))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ids: Vec<&str> = listed["data"]
            .as_array()
            .map(|d| d.iter().filter_map(|m| m["id"].as_str()).collect())
            .unwrap_or_default();
        if ids.contains(&model) {
            return;
        }
        assert!(Instant::now() < deadline, "{model} never listed: {listed}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Reply {
    status: u16,
    body: Value,
    decision: Value,
}

impl Reply {
    fn cached(&self) -> u64 {
        self.body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens: {}", self.body))
    }
    fn predicted(&self) -> u64 {
        self.decision["predicted_cached"].as_u64().unwrap()
    }
    fn worker(&self) -> &str {
        self.decision["worker"].as_str().unwrap()
    }
}

async fn complete(gw: &GatewayHandle, model: &str, prompt: &[u32]) -> Reply {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let (status, decision, text) = common::post_completion(gw, &body).await;
    Reply {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        decision,
    }
}

fn prompt(first: u32, len: u32) -> Vec<u32> {
    (first..first + len).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_go_only_to_the_worker_serving_the_adapter_and_are_predicted_exactly() {
    let plain = sim("w0", &[]).await;
    let lora = sim("w1", &["sql=/adapters/sql"]).await;
    let gw = gateway(vec![spec(&plain), spec(&lora)]).await;
    wait_listed(&gw, "sql").await;

    // A shared system prompt, then per-request tails: every adapter request lands on w1, and
    // what the gateway predicted is what the engine reports.
    let system = prompt(1000, 64);
    let mut hits = 0;
    for k in 0..6u32 {
        let mut p = system.clone();
        p.extend(prompt(5000 + 100 * k, 20 + k));
        let r = complete(&gw, "sql", &p).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.worker(), "w1", "only w1 serves sql");
        assert_eq!(r.body["model"], "sql");
        assert_eq!(r.predicted(), r.cached(), "request {k}: {}", r.decision);
        hits += u64::from(r.cached() > 0);
        common::settle(&gw).await;
    }
    assert!(hits >= 5, "the shared prefix is reused under the adapter");
    let view = common::admin_workers(&gw).await;
    let w1 = view["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["name"] == "w1"))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(w1["adapters"]["sql"], "/adapters/sql", "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn base_and_adapter_requests_with_one_prompt_share_no_cache() {
    let lora = sim("w1", &["sql=/adapters/sql"]).await;
    let gw = gateway(vec![spec(&lora)]).await;
    wait_listed(&gw, "sql").await;
    let p = prompt(300, 81);

    let first = complete(&gw, "sql", &p).await;
    assert_eq!((first.cached(), first.predicted()), (0, 0));
    common::settle(&gw).await;
    // The base model misses what the adapter cached, and the gateway knows it.
    let base = complete(&gw, BASE, &p).await;
    assert_eq!(
        (base.cached(), base.predicted()),
        (0, 0),
        "{}",
        base.decision
    );
    common::settle(&gw).await;
    for model in ["sql", BASE] {
        let again = complete(&gw, model, &p).await;
        assert_eq!(again.cached(), 80, "{model} hits its own blocks");
        assert_eq!(again.predicted(), 80, "{model}: {}", again.decision);
    }

    let unknown = complete(&gw, "no-such-adapter", &p).await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("does not exist")));
}

#[test]
fn a_worker_flag_names_an_adapter_as_name_and_path() {
    let mut w = WorkerSpec::new("w", "http://127.0.0.1:1", BASE);
    w.set_flag("lora_module", "sql:/adapters/sql").unwrap();
    assert_eq!(w.lora_modules["sql"], "/adapters/sql");
    assert!(w.set_flag("lora_module", "no-path").is_err());
}
