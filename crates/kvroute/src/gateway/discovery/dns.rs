//! DNS discovery: one name resolved every interval into the engines behind it.
//!
//! Owns: the resolver (the configured nameserver, or the system's), rebuilt when the
//! nameserver or timeout changes, and one resolution: A and AAAA records on the configured
//! port, or SRV records, each target's addresses (from the answer's additional records, else
//! resolved) on the record's port.
//! Invariants: every resolution asks the server again (the resolver's cache is cleared first);
//! the answer is sorted and deduplicated, so the same records give the same set; anything but
//! a clean answer (a timeout, SERVFAIL, a target that does not resolve) is an error, and an
//! answer without records is empty: either way the caller keeps its last good set.
//! Must not: hold state about workers.

use super::outcome::Outcome;
use crate::gateway::config::discovery::{parse_nameserver, DiscoveryConfig, RecordKind};
use crate::gateway::config::WorkerSpec;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig, ResolverOpts};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::NetError;
use hickory_resolver::proto::rr::{Name, RData, RecordType};
use hickory_resolver::TokioResolver;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("building the resolver: {0}")]
    Resolver(String),
    #[error("resolving {name}: {reason}")]
    Lookup { name: String, reason: String },
}

/// The resolver, kept across rounds, and what it was built for.
#[derive(Default)]
pub struct DnsState {
    resolver: Option<(Option<String>, u64, TokioResolver)>,
}

impl DnsState {
    /// One round: the discovered workers when the answer named some (`None` keeps the last
    /// good set).
    pub async fn refresh(&mut self, c: &DiscoveryConfig) -> (Outcome, Option<Vec<WorkerSpec>>) {
        let name = c.name.clone().unwrap_or_default();
        let addrs = match self.resolver(c) {
            Ok(r) => resolve(r, &name, c.record, c.port.unwrap_or(0)).await,
            Err(e) => Err(e),
        };
        let addrs = match addrs {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!("{e}");
                return (Outcome::Error, None);
            }
        };
        if addrs.is_empty() {
            return (Outcome::Empty, None);
        }
        let mut specs = Vec::with_capacity(addrs.len());
        for a in addrs {
            match c.spec_for(a) {
                Ok(s) => specs.push(s),
                // The template was validated with the section; a failure here is per address.
                Err(e) => tracing::warn!(address = %a, "discovered worker refused: {e}"),
            }
        }
        (Outcome::Ok, Some(specs))
    }

    fn resolver(&mut self, c: &DiscoveryConfig) -> Result<&TokioResolver, DnsError> {
        let key = (c.nameserver.clone(), c.timeout_secs.to_bits());
        let stale = self
            .resolver
            .as_ref()
            .is_none_or(|(ns, t, _)| (ns, *t) != (&key.0, key.1));
        if stale {
            let r = build(c)?;
            self.resolver = Some((key.0, key.1, r));
        }
        match &self.resolver {
            Some((_, _, r)) => {
                r.clear_cache();
                Ok(r)
            }
            None => Err(DnsError::Resolver("no resolver".into())),
        }
    }
}

fn build(c: &DiscoveryConfig) -> Result<TokioResolver, DnsError> {
    build_resolver(c.nameserver.as_deref(), c.timeout_secs)
}

/// A resolver asking `nameserver` (`ip:port` or `ip`; the system's when `None`), one attempt
/// of `timeout_secs` per query.
pub fn build_resolver(
    nameserver: Option<&str>,
    timeout_secs: f64,
) -> Result<TokioResolver, DnsError> {
    let timeout = Duration::from_secs_f64(timeout_secs.clamp(0.01, 60.0));
    let mut builder = match nameserver {
        Some(ns) => {
            let addr = parse_nameserver(ns).map_err(DnsError::Resolver)?;
            let mut udp = ConnectionConfig::udp();
            udp.port = addr.port();
            let mut tcp = ConnectionConfig::tcp();
            tcp.port = addr.port();
            let server = NameServerConfig::new(addr.ip(), true, vec![udp, tcp]);
            TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![server]),
                TokioRuntimeProvider::default(),
            )
        }
        None => TokioResolver::builder_tokio().map_err(|e| DnsError::Resolver(e.to_string()))?,
    };
    let opts: &mut ResolverOpts = builder.options_mut();
    opts.timeout = timeout;
    opts.attempts = 1;
    builder
        .build()
        .map_err(|e| DnsError::Resolver(e.to_string()))
}

/// The engines' addresses behind `name`, sorted and deduplicated.
pub async fn resolve(
    r: &TokioResolver,
    name: &str,
    record: RecordKind,
    port: u16,
) -> Result<Vec<SocketAddr>, DnsError> {
    let mut out = match record {
        RecordKind::A => addresses(r, name)
            .await?
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect(),
        RecordKind::Srv => srv(r, name).await?,
    };
    out.sort();
    out.dedup();
    Ok(out)
}

fn lookup_error(name: &str, e: &NetError) -> DnsError {
    DnsError::Lookup {
        name: name.to_string(),
        reason: e.to_string(),
    }
}

/// A and AAAA of `name`: a name with neither is empty, any other failure an error.
async fn addresses(r: &TokioResolver, name: &str) -> Result<Vec<IpAddr>, DnsError> {
    let (v4, v6) = tokio::join!(
        r.lookup(name, RecordType::A),
        r.lookup(name, RecordType::AAAA)
    );
    let mut out = Vec::new();
    for answer in [v4, v6] {
        match answer {
            Ok(l) => out.extend(l.answers().iter().filter_map(|rec| match &rec.data {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                _ => None,
            })),
            Err(e) if e.is_no_records_found() => {}
            Err(e) => return Err(lookup_error(name, &e)),
        }
    }
    Ok(out)
}

/// Every SRV target's addresses on the record's port.
async fn srv(r: &TokioResolver, name: &str) -> Result<Vec<SocketAddr>, DnsError> {
    let l = match r.lookup(name, RecordType::SRV).await {
        Ok(l) => l,
        Err(e) if e.is_no_records_found() => return Ok(Vec::new()),
        Err(e) => return Err(lookup_error(name, &e)),
    };
    let targets: Vec<(Name, u16)> = l
        .answers()
        .iter()
        .filter_map(|rec| match &rec.data {
            RData::SRV(s) if !s.target.is_root() => Some((s.target.clone(), s.port)),
            _ => None,
        })
        .collect();
    let mut out = Vec::new();
    for (target, port) in targets {
        // The server's additional records first: no second round trip when it sent them.
        let glue: Vec<IpAddr> = l
            .additionals()
            .iter()
            .filter(|rec| rec.name == target)
            .filter_map(|rec| match &rec.data {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                _ => None,
            })
            .collect();
        let ips = if glue.is_empty() {
            let ips = addresses(r, &target.to_string()).await?;
            if ips.is_empty() {
                return Err(DnsError::Lookup {
                    name: target.to_string(),
                    reason: "SRV target has no A or AAAA record".into(),
                });
            }
            ips
        } else {
            glue
        };
        out.extend(ips.into_iter().map(|ip| SocketAddr::new(ip, port)));
    }
    Ok(out)
}
