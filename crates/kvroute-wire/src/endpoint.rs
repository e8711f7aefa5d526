//! Where a subscriber must connect or bind, given the endpoint an engine was configured with.
//!
//! Owns: [`live_endpoint`] and [`replay_endpoint`].
//! Invariants: the subscriber always does the opposite of the engine. vLLM's publisher *binds*
//! endpoints containing `*` or `::`, and `ipc://`/`inproc://` ones, and *connects* to every
//! other tcp endpoint; the replay ROUTER is always bound. DP rank `r` uses `port + r` (port 0
//! stays 0, which no subscriber can follow). Wildcard hosts are replaced by the configured
//! host of the engine.
//! Must not: open sockets or resolve names.

use serde::Serialize;

/// Whether the subscriber connects to the address or binds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SocketMode {
    Connect,
    Bind,
}

/// A concrete ZMQ address for the subscriber's socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ResolvedEndpoint {
    pub mode: SocketMode,
    /// `tcp://host:port` or `ipc://path`.
    pub address: String,
}

/// An engine endpoint a subscriber cannot follow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("unsupported endpoint {0:?}: only tcp:// and ipc:// reach another process")]
    Unsupported(String),
    #[error("endpoint {0:?} has no valid port")]
    BadPort(String),
    #[error("endpoint {0:?} uses port 0 (a random port per rank); configure a fixed port")]
    PortZero(String),
    #[error("endpoint {endpoint:?}: port + dp rank {rank} exceeds 65535")]
    PortOverflow { endpoint: String, rank: u32 },
    #[error("ipc endpoint {0:?} cannot be offset per dp rank (vLLM refuses it too)")]
    IpcWithRank(String),
}

const WILDCARDS: [&str; 4] = ["*", "0.0.0.0", "::", "[::]"];

/// The subscriber's side of an engine's live PUB endpoint for `dp_rank`. `host` is where the
/// engine runs, used when the engine binds a wildcard.
pub fn live_endpoint(
    engine: &str,
    dp_rank: u32,
    host: &str,
) -> Result<ResolvedEndpoint, EndpointError> {
    let engine_binds = engine.contains('*') || engine.contains("::");
    resolve(engine, dp_rank, host, engine_binds)
}

/// The subscriber's side of an engine's replay ROUTER for `dp_rank` (always connected to).
pub fn replay_endpoint(
    engine: &str,
    dp_rank: u32,
    host: &str,
) -> Result<ResolvedEndpoint, EndpointError> {
    resolve(engine, dp_rank, host, true)
}

/// ipc endpoints are connected to as given (rank 0 only); tcp endpoints get `port + rank`, and
/// are connected to (wildcards replaced by `host`) when the engine binds, else bound.
fn resolve(
    engine: &str,
    dp_rank: u32,
    host: &str,
    engine_binds: bool,
) -> Result<ResolvedEndpoint, EndpointError> {
    if let Some(path) = engine.strip_prefix("ipc://") {
        if dp_rank != 0 {
            return Err(EndpointError::IpcWithRank(engine.to_string()));
        }
        return Ok(ResolvedEndpoint {
            mode: SocketMode::Connect,
            address: format!("ipc://{path}"),
        });
    }
    let (ep_host, port) = tcp_parts(engine, dp_rank)?;
    Ok(if engine_binds {
        ResolvedEndpoint {
            mode: SocketMode::Connect,
            address: tcp(pick_host(ep_host, host), port),
        }
    } else {
        ResolvedEndpoint {
            mode: SocketMode::Bind,
            address: tcp(ep_host, port),
        }
    })
}

fn pick_host<'a>(ep_host: &'a str, configured: &'a str) -> &'a str {
    if WILDCARDS.contains(&ep_host) {
        configured
    } else {
        ep_host
    }
}

fn tcp(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

fn tcp_parts(engine: &str, dp_rank: u32) -> Result<(&str, u16), EndpointError> {
    let Some(rest) = engine.strip_prefix("tcp://") else {
        return Err(EndpointError::Unsupported(engine.to_string()));
    };
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| EndpointError::BadPort(engine.to_string()))?;
    let port: u16 = port
        .parse()
        .map_err(|_| EndpointError::BadPort(engine.to_string()))?;
    if port == 0 {
        return Err(EndpointError::PortZero(engine.to_string()));
    }
    let shifted = u32::from(port)
        .checked_add(dp_rank)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| EndpointError::PortOverflow {
            endpoint: engine.to_string(),
            rank: dp_rank,
        })?;
    if host.is_empty() {
        return Err(EndpointError::BadPort(engine.to_string()));
    }
    Ok((host, shifted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(e: &str, r: u32) -> (SocketMode, String) {
        let x = live_endpoint(e, r, "10.0.0.7").expect(e);
        (x.mode, x.address)
    }

    #[test]
    fn a_wildcard_engine_endpoint_is_connected_to_on_the_configured_host_per_rank() {
        assert_eq!(
            live("tcp://*:5557", 0),
            (SocketMode::Connect, "tcp://10.0.0.7:5557".into())
        );
        assert_eq!(
            live("tcp://*:5557", 3),
            (SocketMode::Connect, "tcp://10.0.0.7:5560".into())
        );
        assert_eq!(
            live("tcp://[::]:5557", 1),
            (SocketMode::Connect, "tcp://10.0.0.7:5558".into())
        );
        assert_eq!(
            live("tcp://[::1]:5557", 0),
            (SocketMode::Connect, "tcp://[::1]:5557".into())
        );
    }

    #[test]
    fn an_engine_that_connects_is_bound_for_on_its_own_address() {
        assert_eq!(
            live("tcp://127.0.0.1:5608", 0),
            (SocketMode::Bind, "tcp://127.0.0.1:5608".into())
        );
        assert_eq!(
            live("tcp://0.0.0.0:5608", 2),
            (SocketMode::Bind, "tcp://0.0.0.0:5610".into())
        );
        assert_eq!(
            live("ipc:///tmp/kv", 0),
            (SocketMode::Connect, "ipc:///tmp/kv".into())
        );
    }

    #[test]
    fn replay_routers_are_always_connected_to() {
        let r = replay_endpoint("tcp://*:5558", 1, "h").expect("replay");
        assert_eq!(
            (r.mode, r.address.as_str()),
            (SocketMode::Connect, "tcp://h:5559")
        );
        let r = replay_endpoint("tcp://127.0.0.1:5558", 0, "h").expect("replay");
        assert_eq!(r.address, "tcp://127.0.0.1:5558");
    }

    #[test]
    fn endpoints_no_subscriber_can_follow_are_refused() {
        assert!(matches!(
            live_endpoint("inproc://kv", 0, "h"),
            Err(EndpointError::Unsupported(_))
        ));
        assert!(matches!(
            live_endpoint("tcp://*:0", 0, "h"),
            Err(EndpointError::PortZero(_))
        ));
        assert!(matches!(
            live_endpoint("tcp://*:x", 0, "h"),
            Err(EndpointError::BadPort(_))
        ));
        assert!(matches!(
            live_endpoint("tcp://*:65535", 1, "h"),
            Err(EndpointError::PortOverflow { .. })
        ));
        assert!(matches!(
            live_endpoint("ipc:///tmp/kv", 1, "h"),
            Err(EndpointError::IpcWithRank(_))
        ));
    }
}
