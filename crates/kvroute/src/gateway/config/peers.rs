//! The `[peers]` section: the other replicas of this gateway in front of the same fleet, and
//! how this one tells them what it has in flight.
//!
//! Owns: [`PeersConfig`] (the peers' admin URLs, or a DNS name whose records are the
//! replicas ([`PeersDns`]), this replica's name, the heartbeat, the silence after which a
//! peer's bookings are dropped, the outgoing queue's bound, the client certificate it shows
//! peers whose admin listener requires one ([`PeersTls`])) and its validation as plain data
//! (each error names its field).
//! Invariants: plain data; no peer URL: the channel is off (no task, no message).
//! Must not: open a connection or start anything (that is `gateway::peers`).

use super::discovery::{parse_nameserver, RecordKind};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The replicas this gateway shares its bookings with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersConfig {
    /// The other replicas' admin listeners (`http://host:port` or `https://…`). A list that
    /// names this replica too is fine (the same ConfigMap on every pod): a replica ignores its
    /// own messages.
    #[serde(default)]
    pub urls: Vec<String>,
    /// This replica's name in its messages (default: `$HOSTNAME`, else a random one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Seconds between heartbeats (each carries the bookings still open here).
    #[serde(default = "default_heartbeat")]
    pub heartbeat_secs: f64,
    /// A peer not heard from for this long has its bookings dropped (it died, restarted or is
    /// cut off; the engines' own figures cover what it sent).
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    /// Messages queued per peer at most; past it a message is dropped and counted (a slow peer
    /// costs the others precision, never a request's time).
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// Whether each replica also tells the others what its requests taught it (placements,
    /// first-byte timings, answers' lengths and decoding), so every replica's learners see
    /// the whole fleet's traffic, not its own share.
    #[serde(default = "default_learning")]
    pub learning: bool,
    /// Peers found in DNS beside `urls`: a name whose records are the replicas (a headless
    /// Service of the gateway's pods), resolved every `interval_secs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<PeersDns>,
    /// The client certificate this replica presents to its peers' admin listeners (needed
    /// when they require one: `[admin_tls] client_ca_file`), and the CA their certificates
    /// are signed by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<PeersTls>,
}

/// The `[peers.tls]` section: how this replica proves itself to its peers' admin listeners.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersTls {
    /// PEM: this replica's client certificate, then its intermediates.
    pub client_cert_file: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    pub client_key_file: PathBuf,
    /// PEM: CAs trusted for the peers' admin certificates, beside the system's roots and
    /// `engine_ca_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

/// The `[peers.dns]` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersDns {
    /// The name, e.g. `kvroute-peers.inference.svc.cluster.local`.
    pub name: String,
    /// `a` (A and AAAA records, on `port`) or `srv` (targets and ports from SRV records).
    #[serde(default)]
    pub record: RecordKind,
    /// The replicas' admin port (records `a`).
    #[serde(default = "default_admin_port")]
    pub port: u16,
    /// `http` or `https` (the admin listener's).
    #[serde(default = "default_scheme")]
    pub scheme: String,
    /// The DNS server, `ip:port` or `ip`; the system resolver when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nameserver: Option<String>,
    #[serde(default = "default_dns_interval")]
    pub interval_secs: f64,
    #[serde(default = "default_dns_timeout")]
    pub timeout_secs: f64,
}

fn default_learning() -> bool {
    true
}
fn default_admin_port() -> u16 {
    8081
}
fn default_scheme() -> String {
    "http".into()
}
fn default_dns_interval() -> f64 {
    10.0
}
fn default_dns_timeout() -> f64 {
    2.0
}

impl PeersDns {
    /// The peer URL of a resolved address.
    pub fn url_for(&self, addr: std::net::SocketAddr) -> String {
        format!("{}://{addr}", self.scheme)
    }

    fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("peers.dns.name is empty".into());
        }
        if !matches!(self.scheme.as_str(), "http" | "https") {
            return Err("peers.dns.scheme must be http or https".into());
        }
        if self.record == RecordKind::A && self.port == 0 {
            return Err("peers.dns.port must be set for A records".into());
        }
        if let Some(ns) = &self.nameserver {
            parse_nameserver(ns).map_err(|e| format!("peers.dns.{e}"))?;
        }
        let i = self.interval_secs;
        if !(i.is_finite() && (0.05..=3_600.0).contains(&i)) {
            return Err("peers.dns.interval_secs must be between 0.05 and 3600".into());
        }
        let t = self.timeout_secs;
        if !(t.is_finite() && (0.01..=60.0).contains(&t)) {
            return Err("peers.dns.timeout_secs must be between 0.01 and 60".into());
        }
        Ok(())
    }
}

fn default_heartbeat() -> f64 {
    0.5
}
fn default_timeout() -> f64 {
    3.0
}
fn default_queue() -> usize {
    4096
}

impl Default for PeersConfig {
    fn default() -> Self {
        PeersConfig {
            urls: Vec::new(),
            name: None,
            heartbeat_secs: default_heartbeat(),
            timeout_secs: default_timeout(),
            queue: default_queue(),
            learning: default_learning(),
            dns: None,
            tls: None,
        }
    }
}

impl PeersConfig {
    pub fn is_default(&self) -> bool {
        *self == PeersConfig::default()
    }

    /// Whether any peer is configured (listed, or to be found in DNS).
    pub fn enabled(&self) -> bool {
        !self.urls.is_empty() || self.dns.is_some()
    }

    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.tls {
            if t.client_cert_file.as_os_str().is_empty() || t.client_key_file.as_os_str().is_empty()
            {
                return Err("peers.tls needs client_cert_file and client_key_file".into());
            }
        }
        for u in &self.urls {
            let ok = reqwest::Url::parse(u)
                .is_ok_and(|p| matches!(p.scheme(), "http" | "https") && p.host().is_some());
            if !ok {
                return Err(format!("peers.urls: {u:?} is not an http(s) URL"));
            }
        }
        if let Some(n) = &self.name {
            if n.is_empty() || n.len() > 128 || n.contains(char::is_whitespace) {
                return Err("peers.name must be 1-128 characters without spaces".into());
            }
        }
        let hb = self.heartbeat_secs;
        if !(hb.is_finite() && (0.01..=60.0).contains(&hb)) {
            return Err("peers.heartbeat_secs must be between 0.01 and 60".into());
        }
        let t = self.timeout_secs;
        if !(t.is_finite() && t >= 2.0 * hb && t <= 600.0) {
            return Err(
                "peers.timeout_secs must be at least twice heartbeat_secs and ≤ 600".into(),
            );
        }
        if !(16..=1_000_000).contains(&self.queue) {
            return Err("peers.queue must be between 16 and 1000000".into());
        }
        if let Some(d) = &self.dns {
            d.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_url_that_is_not_http_is_refused_naming_the_field() {
        let mut c = PeersConfig {
            urls: vec!["tcp://10.0.0.1:8081".into()],
            ..PeersConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("peers.urls"));
        c.urls = vec!["http://10.0.0.1:8081".into()];
        assert!(c.validate().is_ok());
        assert!(c.enabled());
    }

    #[test]
    fn a_timeout_shorter_than_two_heartbeats_is_refused() {
        let c = PeersConfig {
            heartbeat_secs: 1.0,
            timeout_secs: 1.5,
            ..PeersConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("timeout_secs"));
    }
}
