//! The gateway: an OpenAI-compatible router in front of a fleet of engines.
//!
//! Owns: the shared state (`AppState`, with the live configuration behind `config()`, swapped
//! whole by a reload), the two listeners (front and admin), and starting and stopping
//! everything (`Gateway::start`, `GatewayHandle::shutdown`).
//! Invariants: the admin API listens on its own address; the front never exposes admin routes;
//! a request reads the configuration once per use through `config()` (an `Arc` snapshot), never
//! holding the lock across an await.
//! Must not: block the runtime (all upstream I/O is async).

pub mod admin;
pub mod config;
pub mod decide;
pub mod discovery;
pub mod engine_load;
pub mod fleet;
pub mod health;
pub mod metrics;
pub mod pending;
pub mod policy;
pub mod proxy;
pub mod registry;
pub mod reload;
pub mod sessions;
pub mod tokenize;
pub mod ttft;

use axum::routing::{delete, get, post, put};
use axum::Router;
use config::GatewayConfig;
use kvroute_index::Index;
use parking_lot::RwLock;
use policy::PolicyKind;
use registry::Registry;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct AppState {
    /// The live configuration: read it through [`AppState::config`].
    config: RwLock<Arc<GatewayConfig>>,
    pub registry: Arc<Registry>,
    pub metrics: metrics::Metrics,
    pub tokenizers: tokenize::Tokenizers,
    pub client: reqwest::Client,
    pub policy: RwLock<PolicyKind>,
    pub rr: AtomicU64,
    /// The configured and discovered workers, reconciled into the registry.
    pub fleet: fleet::Fleet,
    /// Where the configuration came from, for reloads.
    pub reloader: reload::Reloader,
}

impl AppState {
    pub fn policy(&self) -> PolicyKind {
        *self.policy.read()
    }

    /// The live configuration (a snapshot: a reload swaps in a new one).
    pub fn config(&self) -> Arc<GatewayConfig> {
        self.config.read().clone()
    }

    /// Swaps in a validated configuration ([`reload::apply_reload`] is the one caller).
    pub(crate) fn set_config(&self, config: GatewayConfig) {
        *self.config.write() = Arc::new(config);
    }
}

pub struct GatewayHandle {
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl GatewayHandle {
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
        for w in self.state.registry.all() {
            let _ = self.state.registry.remove(&w.spec.name).await;
        }
    }
}

pub fn front_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat))
        .route("/v1/models", get(proxy::models))
        .route("/health", get(proxy::health))
        .route("/metrics", get(proxy::metrics))
        .with_state(state)
}

pub fn admin_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/admin/workers", get(admin::list).post(admin::add))
        .route("/admin/workers/{name}", delete(admin::remove))
        .route("/admin/workers/{name}/drain", post(admin::drain))
        .route("/admin/policy", put(admin::set_policy))
        .route("/admin/reload", post(admin::reload))
        .route("/admin/explain", post(admin::explain))
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
        let registry = Arc::new(Registry::new(index));
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(
                config.request_timeout_secs.max(0.1),
            ))
            .connect_timeout(Duration::from_secs(3))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()?;
        let state = Arc::new(AppState {
            registry: registry.clone(),
            metrics: metrics::Metrics::new(),
            tokenizers: tokenize::Tokenizers::default(),
            client: client.clone(),
            policy: RwLock::new(config.policy),
            rr: AtomicU64::new(0),
            config: RwLock::new(Arc::new(config.clone())),
            fleet: fleet::Fleet::default(),
            reloader: reload::Reloader::default(),
        });
        for w in &config.workers {
            registry
                .add(w.clone())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        state.fleet.adopt_static(&state, &config.workers);
        let front = tokio::net::TcpListener::bind(config.listen).await?;
        let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
        let addr = front.local_addr()?;
        let admin_addr = admin.local_addr()?;
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for (listener, router) in [
            (front, front_router(state.clone())),
            (admin, admin_router(state.clone())),
        ] {
            let mut rx = stop_rx.clone();
            tasks.push(tokio::spawn(async move {
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(async move {
                        let _ = rx.changed().await;
                    })
                    .await;
            }));
        }
        let interval = Duration::from_secs_f64(config.health_interval_secs.max(0.05));
        tasks.push(tokio::spawn(health::run(
            registry.clone(),
            client.clone(),
            interval,
            stop_rx.clone(),
        )));
        tasks.push(tokio::spawn(discovery::run(state.clone(), stop_rx.clone())));
        let poll = Duration::from_secs_f64(config.load_poll_interval_secs.clamp(0.01, 60.0));
        let poll_timeout = Duration::from_secs_f64(config.load_poll_timeout_secs.clamp(0.01, 60.0));
        tasks.push(tokio::spawn(engine_load::run(
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
            tasks,
        })
    }
}
