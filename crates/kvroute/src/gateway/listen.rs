//! The listeners: accepting TCP connections and serving HTTP/1.1 on them with the bounds a
//! front door needs.
//!
//! Owns: the accept loop, the TLS handshake on a listener configured with it (the settings
//! its [`Slot`] holds when the connection is accepted; the handshake must finish within the
//! head timeout, and a failed one is counted and closes only that connection), and each
//! connection's limits: the time a client may take to send a
//! request's head (slow or silent clients, idle keep-alive connections, are closed after it),
//! the head's size (beyond it: 431), and the number of connections open at once (beyond it a
//! new connection is closed at accept, counted); and the graceful drain (stop accepting, let
//! every connection finish the request it is serving, close idle ones).
//! Invariants: an accept error (out of file descriptors, say) never ends the loop: it is
//! counted, logged once, and the loop backs off briefly; a connection's permit is held exactly
//! as long as the connection task runs.
//! Must not: look inside requests (the router does).

pub use super::metrics::ListenerCounts as Counts;
use super::tls::Slot;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// One listener's bounds.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Time to receive a request's head (from the connection's start, or after the previous
    /// response on a kept-alive connection).
    pub header_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Bytes of a request's head (hyper's read buffer; at least 8192).
    pub max_header_bytes: usize,
}

/// Serves `router` on `listener` (over TLS when `tls` is given) until `stop`, then drains.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<Slot>>,
    router: Router,
    limits: Limits,
    counts: Counts,
    mut stop: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let logged_accept = AtomicBool::new(false);
    let logged_full = AtomicBool::new(false);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .max_header_size(limits.max_header_bytes.max(8192))
        .keep_alive(true);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => break,
        };
        let (io, _) = match accepted {
            Ok(x) => x,
            Err(e) => {
                counts.accept_errors.inc();
                if !logged_accept.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "accept failed (counted in kvroute_connections_accept_errors_total; logged once)");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            counts.refused.inc();
            if !logged_full.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    max_connections = limits.max_connections,
                    "connection limit reached: new connections are closed (counted in kvroute_connections_refused_total; logged once)"
                );
            }
            drop(io);
            continue;
        };
        let _ = io.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let open = counts.open.clone();
        open.inc();
        match &tls {
            None => {
                let conn = watcher.watch(builder.serve_connection(TokioIo::new(io), service));
                tokio::spawn(async move {
                    // A client's broken connection ends only its own task.
                    let _ = conn.await;
                    open.dec();
                    drop(permit);
                });
            }
            Some(slot) => {
                let acceptor = slot.acceptor();
                let failures = counts.tls_handshake_failures.clone();
                let handshake_timeout = limits.header_timeout;
                tokio::spawn(async move {
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(io)).await {
                        Ok(Ok(io)) => {
                            let conn = builder.serve_connection(TokioIo::new(io), service);
                            let _ = watcher.watch(conn).await;
                        }
                        Ok(Err(e)) => {
                            failures.inc();
                            tracing::debug!(error = %e, "TLS handshake failed");
                        }
                        Err(_) => {
                            failures.inc();
                            tracing::debug!("TLS handshake timed out");
                        }
                    }
                    open.dec();
                    drop(permit);
                });
            }
        }
    }
    drop(listener);
    graceful.shutdown().await;
}
