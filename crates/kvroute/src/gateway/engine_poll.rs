//! The poll loop of the engines' own load figures: every worker's `/metrics`, read into its
//! [`EngineLoad`](super::engine_load::EngineLoad).
//!
//! Owns: the loop (every worker at once, each with its own timeout, every
//! `load_poll_interval_secs`) and what one poll records: the figures with this gateway's own
//! in-flight and prefilling counts at the time, or a failed poll.
//! Invariants: a poll never blocks another worker's (concurrent, bounded by the timeout); a
//! failed or unparsable poll leaves the last figures in place (they go stale,
//! [`super::engine_load::STALE_AFTER_POLLS`]).
//! Must not: mark workers unhealthy (the health check does) or touch the index.

use super::engine_load::apply_metrics;
use super::registry::{Registry, Worker};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn poll_one(client: &reqwest::Client, w: &Worker, interval: Duration, timeout: Duration) {
    let base = w.spec.url.trim_end_matches('/');
    let own = w.in_flight.load(Ordering::Relaxed);
    let own_prefilling = w.prefilling.load(Ordering::Relaxed);
    let text = async {
        let r = client
            .get(format!("{base}/metrics"))
            .timeout(timeout)
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.text().await.ok()
    }
    .await;
    let mut load = w.engine_load.lock();
    let ok = text.is_some_and(|t| apply_metrics(&mut load, &t, own, Instant::now(), interval));
    if ok {
        load.own_prefilling_at_poll = own_prefilling;
    }
    if !ok {
        load.failed_polls += 1;
    }
}

/// Polls every worker's `/metrics` each `interval`, concurrently, each bounded by `timeout`.
pub async fn run(
    registry: Arc<Registry>,
    client: reqwest::Client,
    interval: Duration,
    timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let workers = registry.all();
        let polls = workers
            .iter()
            .map(|w| poll_one(&client, w, interval, timeout));
        futures_util::future::join_all(polls).await;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.changed() => return,
        }
    }
}
