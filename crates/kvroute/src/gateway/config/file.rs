//! The configuration file as a whole: `GatewayConfig`, the TOML's top level.
//!
//! Owns: `GatewayConfig` (listen addresses, policy and weights — the `[weights]` section is
//! [`PolicyWeights`] —, limits, admin token, snapshot and shutdown settings, the front door's
//! tenants ([`super::tenants::TenantSpec`]), the drain timeout, the `[discovery]` section
//! ([`super::discovery::DiscoveryConfig`]), the `[peers]` section ([`PeersConfig`]), the TLS
//! sections ([`ListenerTls`]), the `[tracing]` section ([`TracingConfig`]) and the `workers`
//! ([`WorkerSpec`])), its defaults,
//! and its validation as a whole, naming the offending field.
//! Invariants: it is plain data; its one import beyond the configuration is the routing core's
//! [`PolicyKind`]. That is why it is a module of its own, and one `config` does not re-export:
//! the routing core imports `config` for its weights, so `config` itself must not import the
//! routing core.
//! Must not: start anything, or import the front door or the fleet state.

use super::discovery::DiscoveryConfig;
use super::otel::TracingConfig;
use super::peers::PeersConfig;
use super::tenants::{self, TenantSpec};
use super::tls::ListenerTls;
use super::{PolicyWeights, Secret, WorkerSpec};
use kvroute_route::PolicyKind;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The admin API; loopback unless configured otherwise.
    #[serde(default = "default_admin")]
    pub admin_listen: SocketAddr,
    /// Bearer token for the admin API (required when it listens beyond loopback).
    #[serde(default)]
    pub admin_token: Option<Secret>,
    #[serde(default)]
    pub policy: PolicyKind,
    #[serde(default)]
    pub weights: PolicyWeights,
    /// Request bodies larger than this are refused with 413.
    #[serde(default = "default_body")]
    pub max_body_bytes: usize,
    /// Attach `x-kvroute-decision` to every response, not only when asked.
    #[serde(default)]
    pub explain_always: bool,
    /// Seconds between health checks of a healthy worker.
    #[serde(default = "default_health")]
    pub health_interval_secs: f64,
    /// Seconds between polls of every worker's `/metrics` (the engines' own running, waiting
    /// and KV-usage figures, which correct what this gateway booked: other replicas and
    /// clients send there too).
    #[serde(default = "default_load_poll")]
    pub load_poll_interval_secs: f64,
    /// Timeout of one worker's `/metrics` poll, seconds.
    #[serde(default = "default_load_poll")]
    pub load_poll_timeout_secs: f64,
    /// Upstream request timeout, seconds.
    #[serde(default = "default_timeout")]
    pub request_timeout_secs: f64,
    /// Tokens of request blocks whose digests the index remembers, so a prefix seen before is
    /// not hashed again (0, or less than one hash block, turns it off; at most 2^31). Memory:
    /// ≈ 4 bytes per token plus ≈ 110 bytes per hash block, reserved on first use.
    #[serde(default = "default_digest_cache")]
    pub digest_cache_tokens: usize,
    /// Seconds a client may take to send a request's head (slow or silent connections, and
    /// idle kept-alive ones, are closed after it).
    #[serde(default = "default_client_timeout")]
    pub header_timeout_secs: f64,
    /// Seconds a client may take to send a request's body (then 408).
    #[serde(default = "default_client_timeout")]
    pub body_timeout_secs: f64,
    /// Connections open at once per listener (beyond it new ones are closed at accept).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Bytes of a request's head (request line and headers; beyond it: 431).
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// Where the index is written on shutdown and every `snapshot_interval_secs`, and loaded
    /// from at start (a warm restart; see docs/operations.md). None: no snapshots.
    #[serde(default)]
    pub snapshot_path: Option<PathBuf>,
    /// Seconds between periodic snapshots (0: only at shutdown).
    #[serde(default = "default_snapshot_interval")]
    pub snapshot_interval_secs: f64,
    /// On shutdown: how long in-flight requests may take to finish, seconds.
    #[serde(default = "default_shutdown_timeout")]
    pub shutdown_timeout_secs: f64,
    #[serde(default)]
    pub workers: Vec<WorkerSpec>,
    /// Client API keys and per-tenant limits; none: the front door is open.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantSpec>,
    /// Seconds a worker leaving the fleet (gone from discovery, or from `workers` on reload)
    /// drains: no new requests, in-flight ones finish; then it is removed with its index state.
    #[serde(default = "default_drain")]
    pub worker_drain_timeout_secs: f64,
    /// Workers found beside `workers`: a DNS name's records or a directory of worker files
    /// ([`super::discovery`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<DiscoveryConfig>,
    /// TLS on the front listener (`[tls]`); none: plain HTTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTls>,
    /// TLS on the admin listener (`[admin_tls]`), with client certificates when
    /// `client_ca_file` is set; none: plain HTTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_tls: Option<ListenerTls>,
    /// PEM CA bundle trusted for `https://` engine URLs, beside the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_ca_file: Option<PathBuf>,
    /// The other replicas this one shares its bookings with (`[peers]`; none: off).
    #[serde(default, skip_serializing_if = "PeersConfig::is_default")]
    pub peers: PeersConfig,
    /// OpenTelemetry traces (`[tracing]`: on, to the protocol's default endpoint unless one is
    /// set here or in the environment); none: the `OTEL_*` environment alone decides, and with
    /// no endpoint there tracing is off. A change needs a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingConfig>,
}

fn default_client_timeout() -> f64 {
    30.0
}
fn default_max_connections() -> usize {
    10_000
}
fn default_max_header_bytes() -> usize {
    64 * 1024
}
fn default_snapshot_interval() -> f64 {
    60.0
}
fn default_shutdown_timeout() -> f64 {
    30.0
}

fn default_drain() -> f64 {
    30.0
}
fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}
fn default_admin() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8081))
}
fn default_body() -> usize {
    16 * 1024 * 1024
}
fn default_health() -> f64 {
    2.0
}
fn default_load_poll() -> f64 {
    0.5
}
fn default_timeout() -> f64 {
    600.0
}
fn default_digest_cache() -> usize {
    kvroute_index::hash::cache::DEFAULT_MAX_TOKENS
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: default_listen(),
            admin_listen: default_admin(),
            admin_token: None,
            policy: PolicyKind::default(),
            weights: PolicyWeights::default(),
            max_body_bytes: default_body(),
            explain_always: false,
            health_interval_secs: default_health(),
            load_poll_interval_secs: default_load_poll(),
            load_poll_timeout_secs: default_load_poll(),
            request_timeout_secs: default_timeout(),
            digest_cache_tokens: default_digest_cache(),
            header_timeout_secs: default_client_timeout(),
            body_timeout_secs: default_client_timeout(),
            max_connections: default_max_connections(),
            max_header_bytes: default_max_header_bytes(),
            snapshot_path: None,
            snapshot_interval_secs: default_snapshot_interval(),
            shutdown_timeout_secs: default_shutdown_timeout(),
            workers: Vec::new(),
            tenants: Vec::new(),
            worker_drain_timeout_secs: default_drain(),
            discovery: None,
            tls: None,
            admin_tls: None,
            engine_ca_file: None,
            peers: PeersConfig::default(),
            tracing: None,
        }
    }
}

impl GatewayConfig {
    pub fn from_toml(text: &str) -> Result<GatewayConfig, String> {
        let c: GatewayConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !self.admin_listen.ip().is_loopback()
            && self
                .admin_token
                .as_ref()
                .is_none_or(|t| t.expose().is_empty())
        {
            return Err("admin_listen is not loopback: set admin_token".into());
        }
        for (name, v) in [
            ("load_poll_interval_secs", self.load_poll_interval_secs),
            ("load_poll_timeout_secs", self.load_poll_timeout_secs),
        ] {
            if !(v.is_finite() && (0.01..=60.0).contains(&v)) {
                return Err(format!("{name} must be between 0.01 and 60 seconds"));
            }
        }
        for (name, v) in [
            ("header_timeout_secs", self.header_timeout_secs),
            ("body_timeout_secs", self.body_timeout_secs),
        ] {
            if !(v.is_finite() && (0.01..=3_600.0).contains(&v)) {
                return Err(format!("{name} must be between 0.01 and 3600 seconds"));
            }
        }
        if self.max_connections == 0 {
            return Err("max_connections must be at least 1".into());
        }
        if !(8192..=16 * 1024 * 1024).contains(&self.max_header_bytes) {
            return Err("max_header_bytes must be between 8192 and 16777216".into());
        }
        if !(self.snapshot_interval_secs.is_finite()
            && (self.snapshot_interval_secs == 0.0
                || (0.05..=86_400.0).contains(&self.snapshot_interval_secs)))
        {
            return Err(
                "snapshot_interval_secs must be 0 (at shutdown only) or 0.05..=86400".into(),
            );
        }
        if !(self.shutdown_timeout_secs.is_finite()
            && (0.0..=3_600.0).contains(&self.shutdown_timeout_secs))
        {
            return Err("shutdown_timeout_secs must be between 0 and 3600".into());
        }
        let w = &self.weights;
        for (name, v) in [
            ("lambda", w.lambda),
            ("tokens_per_request", w.tokens_per_request),
            ("junction", w.junction),
            ("cpu_load_us_per_token", w.cpu_load_us_per_token),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("weights.{name} must be a finite number ≥ 0"));
            }
        }
        if !(self.request_timeout_secs.is_finite() && self.request_timeout_secs > 0.0) {
            return Err("request_timeout_secs must be a positive number of seconds".into());
        }
        let drain = self.worker_drain_timeout_secs;
        if !(drain.is_finite() && (0.0..=86_400.0).contains(&drain)) {
            return Err("worker_drain_timeout_secs must be between 0 and 86400 seconds".into());
        }
        self.peers.validate()?;
        if let Some(t) = &self.tls {
            t.validate("tls")?;
        }
        if let Some(t) = &self.admin_tls {
            t.validate("admin_tls")?;
        }
        if self
            .engine_ca_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err("engine_ca_file is empty".into());
        }
        if let Some(t) = &self.tracing {
            t.validate()?;
        }
        if let Some(d) = &self.discovery {
            d.validate().map_err(|e| format!("discovery: {e}"))?;
        }
        let mut names = std::collections::BTreeSet::new();
        for w in &self.workers {
            w.validate()?;
            if !names.insert(&w.name) {
                return Err(format!("worker {} is listed twice", w.name));
            }
        }
        tenants::validate(&self.tenants).map_err(|e| e.to_string())?;
        Ok(())
    }
}
