//! What every end-to-end test builds on: a fleet of fast simulated workers, the gateway in
//! front of it, a completion through the gateway with its decision header, and a process run
//! off the async runtime (the CLI and Python clients).

use super::common;
use kvroute::gateway::config::WorkerSpec;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, SimHandle, WorkerConfig};
use serde_json::Value;

pub const PRESET: &str = "tiny-gemma3";

pub async fn fleet(n: usize) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    Fleet::start(FleetOptions::new(cfg, n)).await.unwrap()
}

pub fn spec(h: &SimHandle) -> WorkerSpec {
    common::sim_spec(h, PRESET, true)
}

pub async fn gateway(workers: Vec<WorkerSpec>) -> GatewayHandle {
    let cfg = common::gateway_config(workers);
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    gw
}

pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub decision: Value,
}

pub async fn complete(gw: &GatewayHandle, body: Value) -> Reply {
    let (status, decision, text) = common::post_completion(gw, &body).await;
    Reply {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        decision,
    }
}

/// A decision candidate's group-blind prediction (absent when 0).
pub fn blind_of(candidate: &Value) -> u64 {
    candidate["blind_cached"].as_u64().unwrap_or(0)
}

pub fn cached(r: &Reply) -> u64 {
    r.body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// Runs a process to completion off the async runtime.
pub async fn run(program: &'static str, args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(program)
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

pub fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

/// Two free consecutive ports (vLLM's DP ranks publish on `port + rank`).
pub fn consecutive_ports() -> u16 {
    for _ in 0..200 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports");
}
