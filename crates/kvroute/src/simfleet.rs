//! A simulated fleet with a kvroute gateway in front, in process on loopback: what `kvroute
//! demo` and `kvroute bench --fleet` run each policy on.
//!
//! Owns: [`SimGateway`] (fresh simulated workers publishing real ZMQ events, one or more
//! gateway replicas each subscribed to every one, as separate kvroute processes would be, and
//! their URLs), the fleet's layout (every worker serving requests whole,
//! or [`PdLayout`]: prefill workers that are NixlConnector KV producers and decode workers that
//! are KV consumers, with the gateway's worker roles to match) and the choice of cost model for
//! simulated time.
//! Invariants: every start is a fresh fleet (no policy inherits another's cache); every
//! gateway replica connects to the workers' bound event sockets (a PUB socket serves any number
//! of subscribers, the replay socket any number of clients) and shares nothing else with the
//! others; a disaggregated layout has at least one worker
//! of each role and as many workers in all as an aggregated one; a fleet simulated faster than
//! real time ranks by the token cost unless told otherwise (the gateway learns TTFT from its own
//! clock, which cannot see a compressed engine's prefill).
//! Must not: send requests (callers do).

use crate::gateway::config::{
    file::GatewayConfig, CostModel, KvEventsSpec, PolicyWeights, Role, WorkerSpec,
};
use crate::gateway::peers::SendContext;
use crate::gateway::{Gateway, GatewayHandle};
use anyhow::Result;
use kvroute_route::PolicyKind;
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
    /// Prefill and decode pools (`None`: every worker serves requests whole).
    pub pd: Option<PdLayout>,
}

/// A disaggregated fleet: `prefill` KV producers and `decode` KV consumers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdLayout {
    pub prefill: usize,
    pub decode: usize,
}

impl PdLayout {
    /// `PpDd` (e.g. `2p2d`, `1p3d`), each count at least 1.
    pub fn parse(s: &str) -> Result<PdLayout> {
        let bad = || anyhow::anyhow!("layout {s:?}: expected PpDd with P, D ≥ 1 (e.g. 2p2d)");
        let (p, d) = s.split_once('p').ok_or_else(bad)?;
        let d = d.strip_suffix('d').ok_or_else(bad)?;
        let (prefill, decode) = (
            p.parse::<usize>().map_err(|_| bad())?,
            d.parse::<usize>().map_err(|_| bad())?,
        );
        if prefill == 0 || decode == 0 {
            return Err(bad());
        }
        Ok(PdLayout { prefill, decode })
    }

    pub fn label(self) -> String {
        format!("{}p{}d", self.prefill, self.decode)
    }

    pub fn workers(self) -> usize {
        self.prefill + self.decode
    }
}

pub struct SimGateway {
    /// The first replica's URL.
    pub url: String,
    /// Every replica's URL, in start order.
    pub urls: Vec<String>,
    pub gateways: Vec<GatewayHandle>,
    pub fleet: kvroute_sim::Fleet,
}

impl SimGateway {
    pub async fn stop(self) {
        for g in self.gateways {
            g.shutdown().await;
        }
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

/// Starts the simulated workers of `shape`, with each one's gateway role: `w0…` serving
/// whole, or `p0…` KV producers then `d0…` KV consumers.
async fn start_fleet(shape: &FleetShape) -> Result<(kvroute_sim::Fleet, Vec<Role>)> {
    let mut cfg = kvroute_sim::WorkerConfig::for_preset(&shape.preset)?;
    cfg.speedup = shape.speedup;
    if shape.blocks > 0 {
        cfg.engine.num_blocks = shape.blocks as u32;
    }
    let Some(pd) = shape.pd else {
        let fleet =
            kvroute_sim::Fleet::start(kvroute_sim::FleetOptions::new(cfg, shape.workers)).await?;
        return Ok((fleet, vec![Role::Both; shape.workers]));
    };
    if pd.workers() != shape.workers {
        anyhow::bail!(
            "layout {} has {} workers, the fleet {}",
            pd.label(),
            pd.workers(),
            shape.workers
        );
    }
    let mut workers = Vec::with_capacity(pd.workers());
    let mut roles = Vec::with_capacity(pd.workers());
    for (prefix, n, kv_role, role) in [
        ("p", pd.prefill, "kv_producer", Role::Prefill),
        ("d", pd.decode, "kv_consumer", Role::Decode),
    ] {
        let mut c = cfg.clone();
        c.kv_transfer = Some(
            format!(r#"{{"kv_connector": "NixlConnector", "kv_role": "{kv_role}"}}"#)
                .parse()
                .map_err(|e| anyhow::anyhow!("kv_transfer_config: {e}"))?,
        );
        let mut opts = kvroute_sim::FleetOptions::new(c, n);
        opts.name_prefix = prefix.into();
        workers.extend(kvroute_sim::Fleet::start(opts).await?.workers);
        roles.extend(std::iter::repeat_n(role, n));
    }
    Ok((kvroute_sim::Fleet { workers }, roles))
}

/// Starts a fresh fleet and a gateway with `policy` and `weights` in front of it.
pub async fn start(
    shape: &FleetShape,
    policy: PolicyKind,
    weights: PolicyWeights,
) -> Result<SimGateway> {
    start_replicas(shape, policy, weights, 1, Sharing::Isolated).await
}

/// What in-process replicas tell each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Nothing: each counts only its own requests between engine polls.
    Isolated,
    /// Their bookings (`[peers]` with `learning = false`).
    Bookings,
    /// Their bookings and what their requests teach them (`[peers]`, the default).
    Learning,
}

/// Starts a fresh fleet and `replicas` (at least one) gateways with `policy` and `weights` in
/// front of it, every one subscribed to every worker's events, and unless `sharing` is
/// isolated each told the others' admin URLs (`[peers]`).
pub async fn start_replicas(
    shape: &FleetShape,
    policy: PolicyKind,
    weights: PolicyWeights,
    replicas: usize,
    sharing: Sharing,
) -> Result<SimGateway> {
    let (fleet, roles) = start_fleet(shape).await?;
    let mut g = GatewayConfig {
        listen: "127.0.0.1:0".parse()?,
        admin_listen: "127.0.0.1:0".parse()?,
        policy,
        health_interval_secs: 0.5,
        weights,
        ..GatewayConfig::default()
    };
    for (w, role) in fleet.workers.iter().zip(roles) {
        let mut spec = WorkerSpec::new(&w.name, &w.base_url, &shape.preset);
        spec.role = role;
        spec.kv_events = Some(KvEventsSpec {
            endpoint: w.zmq.first().map(|e| as_wildcard(e)).unwrap_or_default(),
            replay_endpoint: w.replay.first().map(|e| as_wildcard(e)),
            topic: String::new(),
            host: Some("127.0.0.1".into()),
            ..KvEventsSpec::new("")
        });
        g.workers.push(spec);
    }
    let mut gateways = Vec::with_capacity(replicas.max(1));
    for _ in 0..replicas.max(1) {
        match Gateway::start(g.clone()).await {
            Ok(gw) => gateways.push(gw),
            Err(e) => {
                for gw in gateways {
                    gw.shutdown().await;
                }
                return Err(e);
            }
        }
    }
    if sharing != Sharing::Isolated && gateways.len() > 1 {
        join_peers(&gateways, sharing == Sharing::Learning);
    }
    for gw in &gateways {
        wait_ready(gw).await;
    }
    let urls: Vec<String> = gateways
        .iter()
        .map(|gw| format!("http://{}", gw.addr))
        .collect();
    Ok(SimGateway {
        url: urls.first().cloned().unwrap_or_default(),
        urls,
        gateways,
        fleet,
    })
}

/// Tells every gateway the others' admin URLs (what `[peers] urls` would, once their ports are
/// known), and whether they share what they learn.
fn join_peers(gateways: &[GatewayHandle], learning: bool) {
    let urls: Vec<String> = gateways
        .iter()
        .map(|gw| format!("http://{}", gw.admin_addr))
        .collect();
    for gw in gateways {
        let mut cfg = (*gw.state.config()).clone();
        cfg.peers.urls = urls
            .iter()
            .filter(|u| **u != format!("http://{}", gw.admin_addr))
            .cloned()
            .collect();
        cfg.peers.learning = learning;
        gw.state
            .peers
            .configure(&cfg.peers, SendContext::new(&gw.state.client, &cfg));
    }
}

/// Waits (10 s at most) until the gateway answers `/health/ready` with 200: its event
/// subscriptions caught up, so the first request is predicted from the engines' state.
async fn wait_ready(gw: &GatewayHandle) {
    let url = format!("http://{}/health/ready", gw.addr);
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if let Ok(r) = client.get(&url).send().await {
            if r.status().is_success() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::warn!(gateway = %gw.addr, "not ready after 10 s: benchmarking anyway");
}
