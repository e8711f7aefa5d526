//! Discovery: workers found at run time beside the configured list, from a DNS name (every
//! A/AAAA record, or every SRV target and port, is a worker: a Kubernetes headless Service
//! answers this way) or from a directory of worker files.
//!
//! Owns: the `[discovery]` configuration and its validation, turning a discovered address into
//! a worker spec (the `[discovery.template]` plus a name derived from the address and port, the
//! URL, and the address as the event host), and the background loop that refreshes the
//! discovered set every interval and hands it to the reconciler ([`super::fleet`]).
//! Invariants: a failed or empty refresh keeps the last good set (DNS trouble never empties
//! the fleet) and is logged once per streak and counted every time; the configuration is read
//! at the start of every round, so a reloaded `[discovery]` applies from the next one; worker
//! names depend only on the address and port.
//! Must not: add or remove workers itself (the reconciler does), or block the runtime.

pub mod dir;
pub mod dns;

use super::config::WorkerSpec;
use super::fleet::Source;
use super::AppState;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
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

    fn interval(&self) -> Duration {
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

/// How a refresh went, as the `result` label of `kvroute_discovery_resolutions_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// An empty answer (no records, no files): the last good set is kept.
    Empty,
    Error,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Empty => "empty",
            Outcome::Error => "error",
        }
    }
}

/// Refreshes the discovered set every interval until `stop`, handing each new set to the
/// reconciler. Without a `[discovery]` section it waits (a reload may add one); a section
/// removed by a reload empties the discovered set.
pub async fn run(state: Arc<AppState>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut dns = dns::DnsState::default();
    let mut dir = dir::DirState::default();
    let mut last: Option<(Source, Vec<WorkerSpec>)> = None;
    let mut streak: Option<Outcome> = None;
    loop {
        let cfg = state.config().discovery.clone();
        let wait = cfg
            .as_ref()
            .map_or(Duration::from_secs(1), |c| c.interval());
        let found = match &cfg {
            None => Some((Source::Dns, Vec::new())),
            Some(c) => {
                let (outcome, specs) = match c.kind {
                    DiscoveryKind::Dns => dns.refresh(c).await,
                    DiscoveryKind::Dir => dir.refresh(c).await,
                };
                let kind = match c.kind {
                    DiscoveryKind::Dns => "dns",
                    DiscoveryKind::Dir => "dir",
                };
                state
                    .metrics
                    .discovery_resolutions
                    .with_label_values(&[kind, outcome.label()])
                    .inc();
                log_outcome(&mut streak, kind, outcome);
                let source = match c.kind {
                    DiscoveryKind::Dns => Source::Dns,
                    DiscoveryKind::Dir => Source::Dir,
                };
                specs.map(|s| (source, s))
            }
        };
        if let Some(found) = found {
            if last.as_ref() != Some(&found) {
                let changes = state
                    .fleet
                    .set_discovered(&state, found.0, found.1.clone())
                    .await;
                if !changes.is_empty() {
                    tracing::info!(?changes, "discovered workers changed");
                }
                last = Some(found);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Logs the first refresh of a streak that is not `Ok`, and the recovery.
fn log_outcome(streak: &mut Option<Outcome>, kind: &str, outcome: Outcome) {
    if *streak == Some(outcome) {
        return;
    }
    match outcome {
        Outcome::Ok if streak.is_some() => {
            tracing::info!(kind, "discovery answers again")
        }
        Outcome::Ok => {}
        Outcome::Empty => tracing::warn!(
            kind,
            "discovery found no workers: keeping the last good set (logged once until it changes)"
        ),
        Outcome::Error => tracing::warn!(
            kind,
            "discovery failed: keeping the last good set (logged once until it changes)"
        ),
    }
    *streak = Some(outcome);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dns(extra: &str) -> Result<DiscoveryConfig, String> {
        let text = format!(
            "kind = 'dns'\nname = 'vllm.ns.svc.cluster.local'\n{extra}\n\
             [template]\nmodel = 'm'\n[template.kv_events]\nendpoint = 'tcp://*:5557'\n"
        );
        let c: DiscoveryConfig = toml::from_str(&text).map_err(|e| e.to_string())?;
        c.validate().map(|_| c)
    }

    #[test]
    fn a_discovered_address_becomes_the_template_named_by_address_and_port() {
        let c = dns("port = 8000").unwrap();
        let s = c.spec_for("10.1.2.3:8000".parse().unwrap()).unwrap();
        assert_eq!(s.name, "vllm-10.1.2.3-8000");
        assert_eq!(s.url, "http://10.1.2.3:8000");
        assert_eq!(s.model, "m");
        assert_eq!(s.event_host(), "10.1.2.3");
        let v6 = c.spec_for("[fd00::7]:8000".parse().unwrap()).unwrap();
        assert_eq!(v6.name, "vllm-fd00--7-8000");
        assert_eq!(v6.url, "http://[fd00::7]:8000");
        assert_eq!(v6.kv_events.unwrap().host.as_deref(), Some("fd00::7"));
    }

    #[test]
    fn dns_discovery_settings_name_what_is_wrong() {
        for (extra, field) in [
            ("", "port"),
            ("record = 'srv'\nport = 1", "SRV"),
            ("port = 1\nnameserver = 'x'", "nameserver"),
            ("port = 1\ninterval_secs = 0", "interval_secs"),
            ("port = 1\nscheme = 'ftp'", "scheme"),
            ("port = 1\npath = '/x'", "path"),
        ] {
            let e = dns(extra).unwrap_err();
            assert!(e.contains(field), "{extra}: {e}");
        }
        let bad: DiscoveryConfig = toml::from_str(
            "kind = 'dns'\nname = 'x'\nport = 1\n[template]\nmodel = 'm'\nurl = 'http://y'\n",
        )
        .unwrap();
        assert!(bad.validate().unwrap_err().contains("url"));
        let bad: DiscoveryConfig =
            toml::from_str("kind = 'dns'\nname = 'x'\nport = 1\n[template]\nmodel = 'm'\ndp = 2\n")
                .unwrap();
        assert!(bad.validate().unwrap_err().contains("dp"));
        assert_eq!(
            parse_nameserver("127.0.0.1").unwrap(),
            "127.0.0.1:53".parse().unwrap()
        );
    }
}
