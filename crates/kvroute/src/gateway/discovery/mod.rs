//! Discovery: workers found at run time beside the configured list, from a DNS name (every
//! A/AAAA record, or every SRV target and port, is a worker: a Kubernetes headless Service
//! answers this way) or from a directory of worker files.
//!
//! Owns: the background loop that refreshes the discovered set every interval and hands it to
//! the reconciler ([`super::fleet`]), and the DNS and directory lookups it makes. The
//! `[discovery]` section itself, its validation and turning a discovered address into a worker
//! spec are configuration (`config::discovery`, re-exported here).
//! Invariants: a failed or empty refresh keeps the last good set (DNS trouble never empties
//! the fleet) and is logged once per streak and counted every time; the configuration is read
//! at the start of every round, so a reloaded `[discovery]` applies from the next one; worker
//! names depend only on the address and port.
//! Must not: add or remove workers itself (the reconciler does), or block the runtime.

pub mod dir;
pub mod dns;
pub mod outcome;

pub use super::config::discovery::{parse_nameserver, DiscoveryConfig, DiscoveryKind, RecordKind};
use super::config::WorkerSpec;
use super::fleet::{FleetHost, Source};
pub use outcome::Outcome;
use std::sync::Arc;
use std::time::Duration;

/// Refreshes the discovered set every interval until `stop`, handing each new set to the
/// reconciler. Without a `[discovery]` section it waits (a reload may add one); a section
/// removed by a reload empties the discovered set.
pub async fn run<H: FleetHost>(state: Arc<H>, mut stop: tokio::sync::watch::Receiver<bool>) {
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
                    .metrics()
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
                    .fleet()
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
