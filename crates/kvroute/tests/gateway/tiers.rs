//! A CPU tier end to end over real sockets: the gateway in front of a simulated worker whose
//! engine keeps a CPU tier beside a small device pool, by each connector the gateway knows
//! (`OffloadingConnector`, `SimpleCPUOffloadConnector`; real HTTP, real ZMQ events, the tier's
//! stores published with `medium = "CPU"`). Once a prompt's blocks left the device but not the
//! tier, the engine serves them from the tier, and the gateway predicts the engine's
//! `cached_tokens` exactly, with the tier's part and its load time in the decision.

use crate::common;

use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_index::tier::OffloadConnector;
use kvroute_sim::{PublisherConfig, SimHandle, WorkerConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn sim(connector: OffloadConnector) -> SimHandle {
    let mut cfg = WorkerConfig::for_preset("llama").unwrap();
    cfg.speedup = 1000.0;
    // 40 blocks of 16 tokens: two 300-token prompts evict a third.
    cfg.engine.num_blocks = 40;
    cfg.engine.max_model_len = 600;
    cfg.engine.cpu_tier_slots = 200;
    cfg.engine.cpu_tier_connector = connector;
    cfg.zmq = Some(PublisherConfig::new("tcp://127.0.0.1:0"));
    kvroute_sim::start_worker("w0", cfg, ([127, 0, 0, 1], 0).into())
        .await
        .unwrap()
}

async fn complete(gw: &GatewayHandle, prompt: &[u32]) -> (u64, Value) {
    let body = json!({"model": "llama", "prompt": prompt, "max_tokens": 2});
    let (status, decision, text) = common::post_completion(gw, &body).await;
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {body}"));
    (cached, decision)
}

fn prompt(first: u32, len: u32) -> Vec<u32> {
    (first..first + len).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_the_device_evicted_are_served_from_the_cpu_tier_and_predicted_exactly() {
    served_from_the_tier(OffloadConnector::Offloading).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simple_cpu_tier_is_predicted_by_the_device_rules_from_the_device_hit() {
    served_from_the_tier(OffloadConnector::SimpleCpu).await;
}

async fn served_from_the_tier(connector: OffloadConnector) {
    let w = sim(connector).await;
    let mut spec = common::sim_spec(&w, "llama", false);
    spec.offload_connector = connector;
    let gw = Gateway::start(common::gateway_config(vec![spec]))
        .await
        .unwrap();
    // Events flow before the measured requests: a subscription that joins late misses the
    // batches published before it (as with any PUB socket).
    // Each warm-up prompt is new: a repeat would hit the device and publish nothing.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut first = 40_000;
    while gw.state.registry.index.stats().block_copies == 0 {
        assert!(Instant::now() < deadline, "no event reached the gateway");
        complete(&gw, &prompt(first, 40)).await;
        first += 100;
        common::settle(&gw).await;
    }
    let a = prompt(1000, 300);
    let (cached, d) = complete(&gw, &a).await;
    assert_eq!((cached, d["predicted_cached"].as_u64()), (0, Some(0)));
    // Two other prompts push a's blocks off the device; the tier keeps them all.
    for first in [5000, 9000, 13000] {
        common::settle(&gw).await;
        complete(&gw, &prompt(first, 300)).await;
    }
    common::settle(&gw).await;
    let (cached, d) = complete(&gw, &a).await;
    let tier = d["predicted_tier"].as_u64().unwrap_or(0);
    let index = &gw.state.registry.index;
    let tiers: Vec<_> = index
        .ranks()
        .iter()
        .filter_map(|(w, r)| index.inspect(w, *r, |s| s.offload_blocks()))
        .collect();
    assert_eq!(
        d["predicted_cached"].as_u64(),
        Some(cached),
        "{d} tiers {tiers:?} counters {:?}",
        index.counters().snapshot()
    );
    // 18 whole blocks of 300 tokens (the `OffloadingConnector` has no last-token rule, the
    // other keeps the device's: 299 tokens hold 18 blocks too).
    assert_eq!(cached, 288, "{d}");
    assert!(tier > 0, "the tier served nothing: {d}");
    let c = &d["candidates"][0];
    assert_eq!(c["predicted_tier"].as_u64(), Some(tier), "{d}");
    let load = c["tier_load_ms"].as_f64().unwrap_or(0.0);
    assert!((load - tier as f64 * 5.0 / 1000.0).abs() < 1e-9, "{d}");
    // A repeat now hits the device for what the load brought back.
    common::settle(&gw).await;
    let (again, d) = complete(&gw, &a).await;
    assert_eq!(d["predicted_cached"].as_u64(), Some(again), "{d}");
    assert!(again >= 288 - 16, "{d}");
    drop(w);
}
