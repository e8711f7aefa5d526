//! A simulated fleet with a kvroute gateway in front, in process on loopback: what `kvroute
//! demo` and `kvroute bench --fleet` run each policy on.
//!
//! Owns: [`SimGateway`] (fresh simulated workers publishing real ZMQ events, the gateway
//! subscribed to every one, its URL) and the choice of cost model for simulated time.
//! Invariants: every start is a fresh fleet (no policy inherits another's cache); the gateway
//! connects to the workers' bound event sockets; a fleet simulated faster than real time ranks
//! by the token cost unless told otherwise (the gateway learns TTFT from its own clock, which
//! cannot see a compressed engine's prefill).
//! Must not: send requests (callers do).

use crate::gateway::config::{CostModel, GatewayConfig, KvEventsSpec, PolicyWeights, WorkerSpec};
use crate::gateway::policy::PolicyKind;
use crate::gateway::{Gateway, GatewayHandle};
use anyhow::Result;
use std::time::Duration;

/// What to start.
#[derive(Clone, Debug)]
pub struct FleetShape {
    pub preset: String,
    pub workers: usize,
    /// KV cache blocks per worker (0: the preset's default).
    pub blocks: usize,
    /// Simulated seconds per wall second.
    pub speedup: f64,
}

pub struct SimGateway {
    pub url: String,
    pub gateway: GatewayHandle,
    pub fleet: kvroute_sim::Fleet,
}

impl SimGateway {
    pub async fn stop(self) {
        self.gateway.shutdown().await;
        drop(self.fleet);
    }
}

/// `tcp://127.0.0.1:P` → `tcp://*:P` (the simulated engine binds, so the gateway connects).
fn as_wildcard(endpoint: &str) -> String {
    match endpoint
        .strip_prefix("tcp://")
        .and_then(|r| r.rsplit_once(':'))
    {
        Some((_, port)) => format!("tcp://*:{port}"),
        None => endpoint.to_string(),
    }
}

/// The cost model: `asked`, else `ttft` in real time and `tokens` for a compressed fleet.
pub fn cost_for(speedup: f64, asked: Option<CostModel>) -> CostModel {
    match asked {
        Some(c) => c,
        None if speedup != 1.0 => CostModel::Tokens,
        None => CostModel::Ttft,
    }
}

/// Starts a fresh fleet and a gateway with `policy` and `weights` in front of it.
pub async fn start(
    shape: &FleetShape,
    policy: PolicyKind,
    weights: PolicyWeights,
) -> Result<SimGateway> {
    let mut cfg = kvroute_sim::WorkerConfig::for_preset(&shape.preset)?;
    cfg.speedup = shape.speedup;
    if shape.blocks > 0 {
        cfg.engine.num_blocks = shape.blocks as u32;
    }
    let fleet =
        kvroute_sim::Fleet::start(kvroute_sim::FleetOptions::new(cfg, shape.workers)).await?;
    let mut g = GatewayConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: "127.0.0.1:0".parse()?,
        policy,
        health_interval_secs: 0.5,
        weights,
        ..GatewayConfig::default()
    };
    for w in &fleet.workers {
        let mut spec = WorkerSpec::new(&w.name, &w.base_url, &shape.preset);
        spec.kv_events = Some(KvEventsSpec {
            endpoint: w.zmq.first().map(|e| as_wildcard(e)).unwrap_or_default(),
            replay_endpoint: w.replay.first().map(|e| as_wildcard(e)),
            topic: String::new(),
            host: Some("127.0.0.1".into()),
            ..KvEventsSpec::new("")
        });
        g.workers.push(spec);
    }
    let gateway = Gateway::start(g).await?;
    // Let the subscriptions connect before the first request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(SimGateway {
        url: format!("http://{}", gateway.addr),
        gateway,
        fleet,
    })
}
