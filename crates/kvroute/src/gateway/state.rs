//! The gateway's shared state: what every handler reads, behind one `Arc`.
//!
//! Owns: `AppState` (the live configuration behind `config()`, swapped whole by a reload; the
//! registry, metrics, tokenizers, HTTP client, the listeners' TLS, live policy, round-robin counter, tenants, the
//! fleet reconciler, snapshot status and unclaimed snapshot entries, the start time, the
//! request tracing), writing a
//! snapshot of it, and where the configuration came from for reloads ([`Reloader`],
//! [`ConfigSource`]). It gives the fleet state what it needs through
//! [`FleetHost`](super::fleet::FleetHost).
//! Invariants: a request reads the configuration once per use through `config()` (an `Arc`
//! snapshot), never holding the lock across an await.
//! Must not: import a handler or the server (the front door's handlers import it), or be
//! imported by the fleet state (which takes a `FleetHost`, the registry or the metrics).

use super::config::file::GatewayConfig;
use super::fleet::{Fleet, FleetHost};
use super::registry::Registry;
use super::{metrics, otel, peers, snapshot, tenants, tls, tokenize};
use kvroute_route::PolicyKind;
use parking_lot::RwLock;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub struct AppState {
    /// The live configuration: read it through [`AppState::config`] (set at the start by
    /// [`super::server`], swapped by a reload through [`AppState::set_config`]).
    pub(super) config: RwLock<Arc<GatewayConfig>>,
    pub registry: Arc<Registry>,
    pub metrics: metrics::Metrics,
    pub tokenizers: tokenize::Tokenizers,
    pub client: reqwest::Client,
    /// The listeners' TLS settings (re-read by a reload).
    pub tls: tls::Listeners,
    pub policy: RwLock<PolicyKind>,
    pub rr: AtomicU64,
    /// What the start loaded and the last snapshot written.
    pub snapshot: parking_lot::Mutex<snapshot::Status>,
    /// The front door: API keys → tenants and their limits (replaceable at runtime).
    pub tenants: tenants::Tenants,
    /// The configured and discovered workers, reconciled into the registry.
    pub fleet: Fleet,
    /// Where the configuration came from, for reloads.
    pub reloader: Reloader,
    /// Snapshot entries for workers discovery may add.
    pub unclaimed: snapshot::Unclaimed,
    /// The other replicas: this one's announcements and the bookings they announced.
    pub peers: Arc<peers::Peers>,
    /// When the gateway started (readiness waits a grace period for the first catch-up).
    pub started: std::time::Instant,
    /// OpenTelemetry traces: off unless an OTLP endpoint is configured (set at the start).
    pub otel: otel::Tracing,
}

impl AppState {
    pub fn policy(&self) -> PolicyKind {
        *self.policy.read()
    }

    /// Writes a snapshot now (when a path is configured), recording the outcome.
    pub async fn write_snapshot(&self) -> Option<Result<snapshot::Written, String>> {
        let path = self.config().snapshot_path.clone()?;
        let res = snapshot::write_registry(self.registry.clone(), path.clone()).await;
        let mut st = self.snapshot.lock();
        Some(match res {
            Ok(w) => {
                st.writes += 1;
                st.last_write = Some(w.clone());
                self.metrics
                    .snapshot_writes
                    .with_label_values(&["ok"])
                    .inc();
                self.metrics.snapshot_seconds.set(w.seconds);
                self.metrics.snapshot_bytes.set(w.bytes as f64);
                tracing::debug!(path = %path.display(), bytes = w.bytes, ranks = w.ranks, skipped = w.ranks_skipped, seconds = w.seconds, "snapshot written");
                Ok(w)
            }
            Err(e) => {
                st.failures += 1;
                st.last_error = Some(e.to_string());
                self.metrics
                    .snapshot_writes
                    .with_label_values(&["failed"])
                    .inc();
                tracing::warn!(path = %path.display(), error = %e, "snapshot not written");
                Err(e.to_string())
            }
        })
    }

    /// The live configuration (a snapshot: a reload swaps in a new one).
    pub fn config(&self) -> Arc<GatewayConfig> {
        self.config.read().clone()
    }

    /// Swaps in a validated configuration ([`super::reload::apply_reload`] is the one caller).
    pub(crate) fn set_config(&self, config: GatewayConfig) {
        *self.config.write() = Arc::new(config);
    }
}

/// Lays the command-line flags over a configuration read from the file.
pub type Overlay = Arc<dyn Fn(&mut GatewayConfig) -> Result<(), String> + Send + Sync>;

/// Where the running configuration came from.
#[derive(Clone)]
pub struct ConfigSource {
    pub path: PathBuf,
    pub overlay: Option<Overlay>,
}

/// One reload at a time, and the source to reload from ([`super::reload`] reads and applies).
#[derive(Default)]
pub struct Reloader {
    source: parking_lot::Mutex<Option<ConfigSource>>,
    /// Held for a whole reload.
    pub(super) lock: tokio::sync::Mutex<()>,
}

impl Reloader {
    pub fn set_source(&self, source: ConfigSource) {
        *self.source.lock() = Some(source);
    }

    pub fn source(&self) -> Option<ConfigSource> {
        self.source.lock().clone()
    }
}

/// What the reconciler and the discovery loop read and change, from the shared state.
impl FleetHost for AppState {
    fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    fn unclaimed(&self) -> &snapshot::Unclaimed {
        &self.unclaimed
    }

    fn metrics(&self) -> &metrics::Metrics {
        &self.metrics
    }

    fn config(&self) -> Arc<GatewayConfig> {
        AppState::config(self)
    }
}
