//! Configuration reload (SIGHUP, `POST /admin/reload`): the file the gateway was started with,
//! read again and applied without dropping connections or index state (but for the eviction
//! charge's figures, which start afresh when `weights.eviction` changes).
//!
//! Owns: reading the file again (and the listeners' certificate files, swapped in for their
//! next connections) (where it came from, [`ConfigSource`]: the file and the
//! command-line flags laid over it, and the [`Reloader`] that keeps one reload at a time are
//! the shared state's, [`super::state`], re-exported here), the check of the new configuration
//! as a whole, and [`apply_reload`], the one place where every live section is applied.
//! Invariants: a configuration that does not read or validate is rejected whole with the
//! reason, and nothing of it is applied; settings that need a restart (the listen addresses,
//! the digest cache, the health and load-poll intervals, the listeners' connection limits, the
//! snapshot path and interval, the engines' CA bundle, the `[tracing]` section, TLS turned on or
//! off on a listener) keep their running values and are
//! reported; after a reload the policy is the file's (flags still override it), also when the
//! admin API had switched it; workers keep their index state unless their spec changed.
//! Must not: restart listeners or touch connections.

use super::config::file::GatewayConfig;
use super::fleet::FleetChanges;
use super::peers::SendContext;
use super::state::AppState;
pub use super::state::{ConfigSource, Overlay, Reloader};
use super::tls;
use serde::Serialize;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("the gateway was started without --config: there is no file to reload")]
    NoFile,
    #[error("reading {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}: {reason} (the running configuration is kept)")]
    Invalid { path: String, reason: String },
}

/// What a reload changed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReloadReport {
    /// The file read, when the reload read one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// The live policy before and after, when it changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyChange>,
    /// Top-level settings applied with new values (`weights`, `max_body_bytes`, …).
    pub changed: Vec<&'static str>,
    /// Settings that differ in the file but keep their running value until a restart.
    pub restart_required: Vec<&'static str>,
    /// The configured workers' changes.
    pub workers: FleetChanges,
    /// Listeners whose TLS certificate, key and client CA were read again (`tls`,
    /// `admin_tls`): their next connections use them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tls_reloaded: Vec<&'static str>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PolicyChange {
    pub from: &'static str,
    pub to: &'static str,
}

/// Reads the file the gateway was started with (flags laid over it, as at start) and applies
/// it.
pub async fn reload(state: &Arc<AppState>) -> Result<ReloadReport, ReloadError> {
    let source = state.reloader.source().ok_or(ReloadError::NoFile)?;
    let shown = source.path.display().to_string();
    let read: Result<GatewayConfig, ReloadError> = async {
        let text =
            tokio::fs::read_to_string(&source.path)
                .await
                .map_err(|e| ReloadError::Read {
                    path: shown.clone(),
                    reason: e.to_string(),
                })?;
        let invalid = |reason: String| ReloadError::Invalid {
            path: shown.clone(),
            reason,
        };
        let mut new: GatewayConfig = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        if let Some(overlay) = &source.overlay {
            overlay(&mut new).map_err(invalid)?;
        }
        Ok(new)
    }
    .await;
    let new = read.inspect_err(|e| rejected(state, e))?;
    let mut report = reload_with(state, new).await.map_err(|e| match e {
        ReloadError::Invalid { reason, .. } => ReloadError::Invalid {
            path: shown.clone(),
            reason,
        },
        other => other,
    })?;
    report.file = Some(shown);
    Ok(report)
}

fn rejected(state: &AppState, e: &ReloadError) {
    state
        .metrics
        .config_reloads
        .with_label_values(&["rejected"])
        .inc();
    tracing::error!("configuration reload rejected: {e}");
}

/// Validates `new` and applies it (what [`reload`] does after reading the file).
pub async fn reload_with(
    state: &Arc<AppState>,
    mut new: GatewayConfig,
) -> Result<ReloadReport, ReloadError> {
    let _one = state.reloader.lock.lock().await;
    let old = state.config();
    let mut report = ReloadReport::default();
    // What needs a restart keeps its running value.
    macro_rules! keep {
        ($($field:ident),*) => {$(
            if new.$field != old.$field {
                report.restart_required.push(stringify!($field));
                new.$field = old.$field.clone();
            }
        )*};
    }
    keep!(
        listen,
        admin_listen,
        digest_cache_tokens,
        health_interval_secs,
        load_poll_interval_secs,
        load_poll_timeout_secs,
        header_timeout_secs,
        max_connections,
        max_header_bytes,
        snapshot_path,
        snapshot_interval_secs,
        engine_ca_file,
        tracing
    );
    // Turning TLS on or off changes the listener: a restart. Its files are read again below.
    for (name, kept) in [
        ("tls", new.tls.is_some() != old.tls.is_some()),
        (
            "admin_tls",
            new.admin_tls.is_some() != old.admin_tls.is_some(),
        ),
    ] {
        if kept {
            report.restart_required.push(name);
        }
    }
    if new.tls.is_some() != old.tls.is_some() {
        new.tls = old.tls.clone();
    }
    if new.admin_tls.is_some() != old.admin_tls.is_some() {
        new.admin_tls = old.admin_tls.clone();
    }
    // A part of the new configuration that does not validate or read rejects the whole of it.
    let refuse = |reason: String| {
        let e = ReloadError::Invalid {
            path: "the new configuration".into(),
            reason,
        };
        rejected(state, &e);
        e
    };
    new.validate().map_err(refuse)?;
    // The certificates and keys, read again (rotated on disk, say), not yet in use.
    let tls = state.tls.prepare(&new).map_err(refuse)?;
    // The peers' client certificate, read again: before anything changes.
    let peer_client = tls::peer_client(&new, &state.client).map_err(refuse)?;
    // The one part that can still fail (key files are read again): before anything changes.
    state
        .tenants
        .replace(&new.tenants)
        .map_err(|e| refuse(e.to_string()))?;
    apply_reload(state, &old, new, peer_client, &mut report).await;
    report.tls_reloaded = tls.commit();
    state
        .metrics
        .config_reloads
        .with_label_values(&["ok"])
        .inc();
    if !report.restart_required.is_empty() {
        tracing::warn!(settings = ?report.restart_required, "changed settings need a restart: running values kept");
    }
    tracing::info!(
        changed = ?report.changed,
        workers = ?report.workers,
        policy = ?report.policy,
        "configuration reloaded"
    );
    Ok(report)
}

/// Applies a validated configuration (its tenants already swapped in by [`reload_with`], the
/// one step that can fail): every other reloadable section is applied here, and only here.
/// The index's eviction tracking follows `weights.eviction` first; then the new configuration
/// is swapped in (the policy weights, limits, timeouts, the admin token and the discovery
/// settings read it live), the live policy is set and the configured worker list reconciled.
pub async fn apply_reload(
    state: &Arc<AppState>,
    old: &GatewayConfig,
    new: GatewayConfig,
    peer_client: reqwest::Client,
    report: &mut ReloadReport,
) {
    macro_rules! changed {
        ($($field:ident),*) => {$(
            if new.$field != old.$field {
                report.changed.push(stringify!($field));
            }
        )*};
    }
    changed!(
        policy,
        weights,
        max_body_bytes,
        explain_always,
        request_timeout_secs,
        admin_token,
        worker_drain_timeout_secs,
        discovery,
        workers,
        body_timeout_secs,
        shutdown_timeout_secs,
        tenants,
        tls,
        admin_tls,
        peers
    );
    if new.peers != old.peers || new.admin_token != old.admin_token {
        state
            .peers
            .configure(&new.peers, SendContext::new(&peer_client, &new));
    }
    let policy = new.policy;
    let workers = new.workers.clone();
    // Before the weights that read them: the eviction figures start from this point, and
    // each worker's rate is learned afresh.
    if new.weights.eviction != old.weights.eviction {
        state
            .registry
            .index
            .set_eviction_tracking(new.weights.eviction);
        for w in state.registry.all() {
            w.learners.lock().eviction.reset();
        }
    }
    state.set_config(new);
    let from = state.policy();
    if from != policy {
        *state.policy.write() = policy;
        report.policy = Some(PolicyChange {
            from: from.name(),
            to: policy.name(),
        });
    }
    report.workers = state.fleet.set_static(state, workers).await;
}
