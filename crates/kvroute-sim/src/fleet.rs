//! The in-process API: start simulated workers (HTTP + ZMQ) for tests, the demo and the
//! gateway.
//!
//! Owns: `serve` (one worker's HTTP server on an address), `SimHandle` (a started worker with
//! its URLs and endpoints), `Fleet::start` (N workers on loopback with OS-chosen ports).
//! Invariants: every endpoint a handle reports is one a client can use as is
//! (`http://127.0.0.1:PORT`, `tcp://127.0.0.1:PORT`), one per DP rank; dropping a handle stops
//! its server, engine loops and publishers.
//! Must not: pick fixed ports for loopback fleets (parallel tests would collide).

use crate::error::SimError;
use crate::publisher::{PublisherConfig, ReplayLayout};
use crate::wire::WireFormat;
use crate::worker::{Worker, WorkerConfig};
use axum::serve::ListenerExt;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// A started worker.
pub struct SimHandle {
    pub name: String,
    pub worker: Arc<Worker>,
    pub http: SocketAddr,
    /// `http://host:port` (no trailing slash).
    pub base_url: String,
    /// Per DP rank: the live PUB endpoint to subscribe to, if publishing.
    pub zmq: Vec<String>,
    /// Per DP rank: the replay ROUTER endpoint, if any.
    pub replay: Vec<String>,
    server: JoinHandle<()>,
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Serves `worker`'s HTTP API on `addr` (port 0: any); returns the bound address.
pub async fn serve(
    worker: Arc<Worker>,
    addr: SocketAddr,
) -> Result<(SocketAddr, JoinHandle<()>), SimError> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = crate::http::router(worker);
    let listener = without_nagle(listener);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("sim HTTP server stopped: {e}");
        }
    });
    Ok((bound, task))
}

/// `listener` with TCP_NODELAY on every connection it accepts, as vLLM's server has (asyncio
/// and uvloop set it on every TCP transport): with Nagle's algorithm a streamed answer's first
/// token waits, behind its unacknowledged headers, for the client's delayed ACK (up to 40 ms on
/// Linux).
pub fn without_nagle(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = SocketAddr> {
    listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    })
}

/// Starts one worker: its ranks and publishers, then its HTTP server on `http`.
pub async fn start_worker(
    name: &str,
    mut cfg: WorkerConfig,
    http: SocketAddr,
) -> Result<SimHandle, SimError> {
    cfg.engine.worker = name.into();
    let worker = Arc::new(Worker::start(cfg).await?);
    let (bound, server) = serve(worker.clone(), http).await?;
    let host = if bound.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        bound.ip().to_string()
    };
    let ports = worker.zmq_ports();
    let zmq = ports
        .iter()
        .filter_map(|(p, _)| p.map(|p| format!("tcp://{host}:{p}")))
        .collect();
    let replay = ports
        .iter()
        .filter_map(|(_, r)| r.map(|r| format!("tcp://{host}:{r}")))
        .collect();
    Ok(SimHandle {
        name: name.to_string(),
        worker,
        http: bound,
        base_url: format!("http://{host}:{}", bound.port()),
        zmq,
        replay,
        server,
    })
}

/// Options for a loopback fleet.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    /// Every worker's configuration (the ZMQ endpoints are replaced by loopback ones).
    pub worker: WorkerConfig,
    pub workers: usize,
    /// Worker names are `{prefix}{i}`.
    pub name_prefix: String,
    pub topic: String,
    pub format: WireFormat,
    pub replay_layout: ReplayLayout,
    /// Batches each worker's replay endpoint keeps.
    pub replay_buffer_steps: usize,
}

impl FleetOptions {
    pub fn new(worker: WorkerConfig, workers: usize) -> FleetOptions {
        FleetOptions {
            worker,
            workers,
            name_prefix: "w".into(),
            topic: String::new(),
            format: WireFormat::V032,
            replay_layout: ReplayLayout::WithTopic,
            replay_buffer_steps: 10_000,
        }
    }
}

/// N simulated workers on loopback, each publishing (with replay) on OS-chosen ports.
pub struct Fleet {
    pub workers: Vec<SimHandle>,
}

impl Fleet {
    pub async fn start(opts: FleetOptions) -> Result<Fleet, SimError> {
        let mut workers = Vec::with_capacity(opts.workers);
        for i in 0..opts.workers {
            let mut cfg = opts.worker.clone();
            cfg.zmq = Some(PublisherConfig {
                endpoint: "tcp://127.0.0.1:0".into(),
                replay_endpoint: Some("tcp://127.0.0.1:0".into()),
                topic: opts.topic.clone(),
                buffer_steps: opts.replay_buffer_steps,
                format: opts.format,
                replay_layout: opts.replay_layout,
                dp_rank: 0,
                hwm: crate::publisher::DEFAULT_HWM,
            });
            let name = format!("{}{i}", opts.name_prefix);
            let addr: SocketAddr = ([127, 0, 0, 1], 0).into();
            workers.push(start_worker(&name, cfg, addr).await?);
        }
        Ok(Fleet { workers })
    }

    /// Convenience: `n` workers of a preset at a speed-up.
    pub async fn preset(preset: &str, n: usize, speedup: f64) -> Result<Fleet, SimError> {
        let mut cfg = WorkerConfig::for_preset(preset)?;
        cfg.speedup = speedup;
        Fleet::start(FleetOptions::new(cfg, n)).await
    }
}
