//! Starting and stopping the gateway: the two routers (front and admin) and the server.
//!
//! Owns: `Gateway::start` (the configuration validated, the TLS files read, the shared [`AppState`] built, a
//! snapshot loaded before the workers are added, both listeners bound, the background tasks
//! started: health checks, load polls, discovery, periodic snapshots; the trace exporter when
//! configured), which handler serves
//! which route ([`front_router`], [`admin_router`]), and `GatewayHandle::shutdown` (graceful,
//! the snapshot written after the last request, the last spans exported).
//! Invariants: the admin API listens on its own address; the front never exposes admin routes.
//! Must not: block the runtime (all upstream I/O is async), or be imported by a handler or a
//! state module (it is the top of the gateway's layers: it imports them, never the reverse).

use super::config::file::GatewayConfig;
use super::registry::Registry;
use super::state::{AppState, Reloader};
use super::{
    admin, discovery, engine_poll, fleet, health, listen, metrics, otel, peers, probes, proxy,
    snapshot, tenants, tls, tokenize,
};
use axum::routing::{delete, get, post, put};
use axum::Router;
use kvroute_index::Index;
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct GatewayHandle {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: watch::Sender<bool>,
    /// The two listeners' servers.
    servers: Vec<JoinHandle<()>>,
    /// Health checks, load polls, periodic snapshots.
    tasks: Vec<JoinHandle<()>>,
}

impl GatewayHandle {
    /// A graceful shutdown: stops accepting connections, lets in-flight requests finish (at most
    /// `shutdown_timeout_secs`; streams still open then are cut), writes the snapshot, then
    /// stops every subscription.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let grace = Duration::from_secs_f64(self.state.config().shutdown_timeout_secs.max(0.0));
        let deadline = tokio::time::Instant::now() + grace;
        for mut t in self.servers {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                tracing::warn!(
                    timeout_secs = grace.as_secs_f64(),
                    "in-flight requests outlived the shutdown timeout: cut"
                );
                t.abort();
            }
        }
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
        if let Some(Ok(w)) = self.state.write_snapshot().await {
            tracing::info!(
                bytes = w.bytes,
                ranks = w.ranks,
                "snapshot written at shutdown"
            );
        }
        for w in self.state.registry.all() {
            let _ = self.state.registry.remove(&w.spec.name).await;
        }
        // The last requests' spans go out before the exporter stops.
        self.state.otel.shutdown().await;
    }
}

pub fn front_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat))
        .route("/v1/models", get(proxy::models))
        .route("/health", get(proxy::health))
        .route("/health/live", get(probes::live))
        .route("/health/ready", get(probes::ready))
        .route("/metrics", get(proxy::metrics))
        .with_state(state)
}

pub fn admin_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/admin/workers", get(admin::list).post(admin::add))
        .route("/admin/workers/{name}", delete(admin::remove))
        .route("/admin/workers/{name}/drain", post(admin::drain))
        .route("/admin/policy", put(admin::set_policy))
        .route("/admin/tenants", get(admin::tenants))
        .route("/admin/reload", post(admin::reload))
        .route("/admin/explain", post(admin::explain))
        .route("/admin/peers", get(admin::peers))
        .route("/admin/peers/bookings", post(admin::peer_bookings))
        .route(
            "/admin/snapshot",
            get(admin::snapshot_status).post(admin::snapshot_now),
        )
        .route("/metrics", get(proxy::metrics))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admin::auth,
        ))
        .with_state(state)
}

pub struct Gateway;

impl Gateway {
    /// Binds both listeners, registers the configured workers (starting their subscriptions)
    /// and serves until `shutdown`.
    pub async fn start(config: GatewayConfig) -> anyhow::Result<GatewayHandle> {
        config.validate().map_err(anyhow::Error::msg)?;
        let index = Arc::new(Index::with_digest_cache(config.digest_cache_tokens));
        // The eviction figures cost every removal a little: kept only for the charge.
        index.set_eviction_tracking(config.weights.eviction);
        let registry = Arc::new(Registry::new(index));
        let listeners_tls = tls::Listeners::load(&config).map_err(anyhow::Error::msg)?;
        let mut client = reqwest::Client::builder()
            .use_rustls_tls()
            .timeout(Duration::from_secs_f64(
                config.request_timeout_secs.max(0.1),
            ))
            .connect_timeout(Duration::from_secs(3))
            .pool_idle_timeout(Duration::from_secs(30));
        if let Some(ca) = &config.engine_ca_file {
            for cert in tls::engine_roots(ca).map_err(anyhow::Error::msg)? {
                client = client.add_root_certificate(cert);
            }
        }
        let client = client.build()?;
        let metrics = metrics::Metrics::new();
        let export = otel::export::resolve(config.tracing.as_ref(), |k| std::env::var(k).ok())?;
        let otel = otel::Tracing::new(export.as_ref(), metrics.trace_context_invalid.clone())?;
        let tenants = tenants::Tenants::new(&config.tenants, metrics.tenants.clone())?;
        let peers = Arc::new(peers::Peers::new(&config.peers, metrics.peers.clone()));
        let state = Arc::new(AppState {
            peers: peers.clone(),
            registry: registry.clone(),
            metrics,
            tenants,
            tokenizers: tokenize::Tokenizers::default(),
            client: client.clone(),
            tls: listeners_tls,
            policy: RwLock::new(config.policy),
            rr: AtomicU64::new(0),
            snapshot: parking_lot::Mutex::new(snapshot::Status {
                path: config.snapshot_path.clone(),
                ..snapshot::Status::default()
            }),
            config: RwLock::new(Arc::new(config.clone())),
            fleet: fleet::Fleet::default(),
            reloader: Reloader::default(),
            unclaimed: snapshot::Unclaimed::default(),
            started: std::time::Instant::now(),
            otel,
        });
        let mut resume = BTreeMap::new();
        if let Some(path) = &config.snapshot_path {
            let discovery = config.discovery.is_some();
            let (plan, report) =
                snapshot::load_for(path.clone(), config.workers.clone(), discovery).await;
            state
                .metrics
                .snapshot_loads
                .with_label_values(&[report.result])
                .inc();
            state.snapshot.lock().load = Some(report);
            resume = plan.resume;
            state.unclaimed.set(plan.unclaimed);
        }
        for w in &config.workers {
            let ranks = resume.remove(&w.name).unwrap_or_default();
            registry
                .add_resumed(w.clone(), ranks)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        state.fleet.adopt_static(&state.registry, &config.workers);
        let front = tokio::net::TcpListener::bind(config.listen).await?;
        let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
        let addr = front.local_addr()?;
        let admin_addr = admin.local_addr()?;
        let (stop, stop_rx) = watch::channel(false);
        let mut servers = Vec::new();
        let mut tasks = Vec::new();
        let limits = listen::Limits {
            header_timeout: Duration::from_secs_f64(config.header_timeout_secs),
            max_connections: config.max_connections,
            max_header_bytes: config.max_header_bytes,
        };
        for (name, listener, tls, router) in [
            (
                "front",
                front,
                state.tls.front.clone(),
                front_router(state.clone()),
            ),
            (
                "admin",
                admin,
                state.tls.admin.clone(),
                admin_router(state.clone()),
            ),
        ] {
            let counts = state.metrics.listener(name);
            servers.push(tokio::spawn(listen::serve(
                listener,
                tls,
                router,
                limits.clone(),
                counts,
                stop_rx.clone(),
            )));
        }
        let interval = Duration::from_secs_f64(config.health_interval_secs.max(0.05));
        tasks.push(tokio::spawn(health::run(
            registry.clone(),
            client.clone(),
            interval,
            stop_rx.clone(),
        )));
        if config.snapshot_path.is_some() && config.snapshot_interval_secs > 0.0 {
            tasks.push(tokio::spawn(periodic_snapshots(
                state.clone(),
                Duration::from_secs_f64(config.snapshot_interval_secs),
                stop_rx.clone(),
            )));
        }
        tasks.push(tokio::spawn(discovery::run(state.clone(), stop_rx.clone())));
        let peer_client = tls::peer_client(&config, &state.client).map_err(anyhow::Error::msg)?;
        peers.configure(
            &config.peers,
            peers::SendContext::new(&peer_client, &config),
        );
        tasks.push(tokio::spawn(peers.clone().run_heartbeat(stop_rx.clone())));
        tasks.push(tokio::spawn(peers.run_dns(stop_rx.clone())));
        let poll = Duration::from_secs_f64(config.load_poll_interval_secs.clamp(0.01, 60.0));
        let poll_timeout = Duration::from_secs_f64(config.load_poll_timeout_secs.clamp(0.01, 60.0));
        tasks.push(tokio::spawn(engine_poll::run(
            registry,
            client,
            poll,
            poll_timeout,
            stop_rx,
        )));
        tracing::info!(%addr, %admin_addr, policy = config.policy.name(), "gateway listening");
        Ok(GatewayHandle {
            addr,
            admin_addr,
            state,
            stop,
            servers,
            tasks,
        })
    }
}

/// Writes a snapshot every `every` until stopped (the shutdown writes the last one).
async fn periodic_snapshots(
    state: Arc<AppState>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                state.write_snapshot().await;
            }
            _ = stop.changed() => return,
        }
    }
}
