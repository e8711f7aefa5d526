//! The `[discovery]` section: where workers are found at run time (a DNS name or a directory
//! of worker files), how a discovered address becomes a worker spec, and its validation.
//!
//! Owns: `DiscoveryConfig` (with `DiscoveryKind` and `RecordKind`), checking it as a whole, the
//! spec and name of the worker discovered at an address (the `[discovery.template]` plus a name
//! derived from the address and port, the URL, and the address as the event host) and the
//! nameserver setting's syntax.
//! Invariants: worker names depend only on the address and port.
//! Must not: resolve, read directories or start anything (the discovery loop in
//! `gateway::discovery` does), or import the gateway's other modules (configuration is plain
//! data).

use super::WorkerSpec;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// Where discovered workers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryKind {
    /// A DNS name, re-resolved every interval.
    Dns,
    /// A directory of `*.toml` worker files, scanned every interval.
    Dir,
}

/// Which DNS records name the workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    /// Every A and AAAA record is a worker on `port`.
    #[default]
    A,
    /// Every SRV record's target is a worker on the record's port.
    Srv,
}

/// The `[discovery]` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    pub kind: DiscoveryKind,
    /// DNS: the name to resolve, e.g. `vllm.inference.svc.cluster.local`.
    #[serde(default)]
    pub name: Option<String>,
    /// DNS: `a` (A and AAAA records, on `port`) or `srv` (targets and ports from SRV records).
    #[serde(default)]
    pub record: RecordKind,
    /// DNS `a`: the engines' HTTP port.
    #[serde(default)]
    pub port: Option<u16>,
    /// DNS: the server to ask, `ip:port` (or `ip`, port 53); the system resolver when absent.
    #[serde(default)]
    pub nameserver: Option<String>,
    /// DNS: the URL scheme of discovered workers (`http` or `https`).
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// DNS: discovered workers are named `{name_prefix}-{address}-{port}` (IPv6 colons as
    /// `-`); the name's first label when absent.
    #[serde(default)]
    pub name_prefix: Option<String>,
    /// Dir: the directory of worker files (`*.toml`, each one worker spec or `[[workers]]`).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Seconds between refreshes.
    #[serde(default = "default_interval")]
    pub interval_secs: f64,
    /// DNS: seconds one resolution may take before it counts as failed.
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    /// DNS: every worker spec field but `name` and `url` (`model`, `kv_events` with a wildcard
    /// endpoint, `dp_size`, hash settings…). `kv_events.host` defaults to the discovered
    /// address.
    #[serde(default)]
    pub template: Option<toml::Table>,
}

fn default_scheme() -> String {
    "http".into()
}
fn default_interval() -> f64 {
    5.0
}
fn default_timeout() -> f64 {
    2.0
}

impl DiscoveryConfig {
    /// Checks the section as a whole, naming the offending field; for DNS also that the
    /// template makes a valid worker.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.interval_secs.is_finite() && (0.01..=3600.0).contains(&self.interval_secs)) {
            return Err("interval_secs must be between 0.01 and 3600".into());
        }
        match self.kind {
            DiscoveryKind::Dir => {
                if self.path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                    return Err("kind = \"dir\" needs path".into());
                }
                for (field, set) in [
                    ("name", self.name.is_some()),
                    ("port", self.port.is_some()),
                    ("nameserver", self.nameserver.is_some()),
                    ("template", self.template.is_some()),
                ] {
                    if set {
                        return Err(format!("{field} is a DNS setting (kind = \"dir\")"));
                    }
                }
                Ok(())
            }
            DiscoveryKind::Dns => {
                let name = self.name.as_deref().unwrap_or("");
                if name.is_empty() {
                    return Err("kind = \"dns\" needs name".into());
                }
                if self.path.is_some() {
                    return Err("path is a directory setting (kind = \"dir\")".into());
                }
                match (self.record, self.port) {
                    (RecordKind::A, None | Some(0)) => {
                        return Err("record = \"a\" needs port (the engines' HTTP port)".into())
                    }
                    (RecordKind::Srv, Some(_)) => {
                        return Err("port comes from the SRV records (record = \"srv\")".into())
                    }
                    _ => {}
                }
                if !matches!(self.scheme.as_str(), "http" | "https") {
                    return Err("scheme must be http or https".into());
                }
                if !(self.timeout_secs.is_finite() && (0.01..=60.0).contains(&self.timeout_secs)) {
                    return Err("timeout_secs must be between 0.01 and 60".into());
                }
                if let Some(ns) = &self.nameserver {
                    parse_nameserver(ns)?;
                }
                if let Some(p) = &self.name_prefix {
                    if p.is_empty() || p.len() > 64 || p.contains(char::is_whitespace) {
                        return Err("name_prefix: 1-64 characters, no spaces".into());
                    }
                }
                let probe: SocketAddr = ([127, 0, 0, 1], self.port.unwrap_or(8000)).into();
                self.spec_for(probe)
                    .and_then(|s| s.validate())
                    .map_err(|e| format!("template: {e}"))
            }
        }
    }

    /// The worker spec of the engine discovered at `addr`: the template, named by the address
    /// and port, its URL, and the address as its event host unless the template names one.
    pub fn spec_for(&self, addr: SocketAddr) -> Result<WorkerSpec, String> {
        let mut t = self
            .template
            .clone()
            .ok_or("kind = \"dns\" needs [discovery.template]")?;
        for own in ["name", "url"] {
            if t.contains_key(own) {
                return Err(format!("{own} is derived from the discovered address"));
            }
        }
        let ip = addr.ip().to_canonical();
        let host = match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        t.insert("name".into(), self.worker_name(ip, addr.port()).into());
        t.insert(
            "url".into(),
            format!("{}://{host}:{}", self.scheme, addr.port()).into(),
        );
        if let Some(toml::Value::Table(kv)) = t.get_mut("kv_events") {
            kv.entry("host").or_insert_with(|| ip.to_string().into());
        }
        toml::Value::Table(t)
            .try_into::<WorkerSpec>()
            .map_err(|e| e.message().to_string())
    }

    /// `{prefix}-{address}-{port}`: IPv6 colons written as `-`, so the name fits a URL path.
    pub fn worker_name(&self, ip: IpAddr, port: u16) -> String {
        let prefix = match &self.name_prefix {
            Some(p) => p.clone(),
            None => self
                .name
                .as_deref()
                .and_then(|n| n.split('.').find(|l| !l.is_empty()))
                .unwrap_or("dns")
                .to_string(),
        };
        let addr = ip.to_string().replace(':', "-");
        format!("{prefix}-{addr}-{port}")
    }

    /// Between refreshes.
    pub(crate) fn interval(&self) -> Duration {
        Duration::from_secs_f64(self.interval_secs.clamp(0.01, 3600.0))
    }
}

/// `ip:port`, `[v6]:port` or a bare `ip` (port 53).
pub fn parse_nameserver(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    s.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| format!("nameserver {s:?}: expected ip:port or ip"))
}
