//! Health checks: `/health` of every worker, with backoff, and each vLLM worker's `/version`
//! once.
//!
//! Owns: the background loop that probes each worker when due (healthy: every interval;
//! failing: exponential backoff up to 30 s) and asks a healthy worker's `GET /version` until
//! it answers (the registry then records the engine generation). The engines' load figures
//! are polled by [`super::engine_load`].
//! Must not: remove workers (only mark them).

use super::registry::Registry;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker's `GET /version`: `Some(Some(version))` when it names one, `Some(None)` when it
/// answers without one (not a vLLM server: not asked again), `None` when it did not answer (asked
/// again next time).
async fn ask_version(client: &reqwest::Client, base: &str) -> Option<Option<String>> {
    let r = client
        .get(format!("{base}/version"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    if r.status().is_server_error() {
        return None;
    }
    if !r.status().is_success() {
        return Some(None);
    }
    let body: serde_json::Value = match r.json().await {
        Ok(v) => v,
        Err(_) => return Some(None),
    };
    Some(
        body.get("version")
            .and_then(|v| v.as_str())
            .map(str::to_string),
    )
}

pub async fn run(
    registry: Arc<Registry>,
    client: reqwest::Client,
    interval: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let now = Instant::now();
        for w in registry.all() {
            if *w.next_check.lock() > now {
                continue;
            }
            let base = w.spec.url.trim_end_matches('/').to_string();
            let ok = matches!(
                client.get(format!("{base}/health")).timeout(Duration::from_secs(2)).send().await,
                Ok(r) if r.status().is_success()
            );
            if ok {
                w.mark_success();
                *w.next_check.lock() = Instant::now() + interval;
                if w.wants_version() {
                    let version = ask_version(&client, &base).await;
                    if let Some(v) = version {
                        registry.engine_reported(&w, v.as_deref());
                    }
                }
            } else {
                w.mark_failure();
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval.min(Duration::from_millis(250))) => {}
            _ = stop.changed() => return,
        }
    }
}
