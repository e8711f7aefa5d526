//! Waiting on a condition instead of sleeping before a check: poll it until it holds, and fail
//! the test with what was awaited and what was last seen when the deadline passes. Shared by
//! the integration tests of kvroute, kvroute-sim and kvroute-wire (the latter two include this
//! file by path).
//!
//! The deadlines are generous on purpose: they only decide a test when the awaited thing never
//! happens, so a slow or loaded machine takes longer but does not fail.
#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, Instant};

/// The usual bound on a wait: far above what a loaded 2-core machine needs for anything these
/// tests wait on (a subscription joining, events applied, a worker marked down).
pub const WAIT: Duration = Duration::from_secs(20);

/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(10);

/// Polls `probe` until it returns `Ok`, and returns that value; panics after `within` with
/// `what` and the last `Err` (the state seen instead).
pub async fn wait_for<T, F, Fut>(within: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + within;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(seen) if Instant::now() >= deadline => {
                panic!("timed out after {within:?} waiting for {what}; last seen: {seen}")
            }
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}

/// Polls `condition` until it holds; panics after `within` naming `what`.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(within, what, || {
        let c = condition();
        async move {
            if c.await {
                Ok(())
            } else {
                Err("not yet".into())
            }
        }
    })
    .await
}

/// `Ok` when nothing is left in `pending` (what a wait still sees wrong), else `Err` listing it:
/// the probe result of a [`wait_for`] over several things at once.
pub fn none_pending(pending: Vec<String>) -> Result<(), String> {
    if pending.is_empty() {
        Ok(())
    } else {
        Err(pending.join("; "))
    }
}
