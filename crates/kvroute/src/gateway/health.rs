//! Health checks: `/health` of every worker, with backoff, and each vLLM worker's `/version`
//! once.
//!
//! Owns: the background loop that probes each worker when due (healthy: every interval;
//! failing: exponential backoff up to 30 s), asks a healthy worker's `GET /version` until it
//! answers (the registry then records the engine generation), and reads the LoRA adapters its
//! `GET /v1/models` lists (entries with a `parent`; `root` is the adapter's path). The
//! engines' load figures are polled by [`super::engine_poll`].
//! The gateway's own probes (`/health/live`, `/health/ready`) are the front door's,
//! [`super::probes`].
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

/// The LoRA adapters a worker's `GET /v1/models` lists, as vLLM lists them (`id` the name,
/// `parent` the base model, `root` the path); `None` when it gave no usable list.
async fn ask_adapters(
    client: &reqwest::Client,
    base: &str,
) -> Option<std::collections::BTreeMap<String, String>> {
    let r = client
        .get(format!("{base}/v1/models"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    let body: serde_json::Value = r.json().await.ok()?;
    let listed = body.get("data")?.as_array()?;
    Some(
        listed
            .iter()
            .filter(|m| m.get("parent").is_some_and(|p| p.is_string()))
            .filter_map(|m| {
                let name = m.get("id")?.as_str()?;
                let path = m.get("root")?.as_str()?;
                Some((name.to_string(), path.to_string()))
            })
            .collect(),
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
                if let Some(adapters) = ask_adapters(&client, &base).await {
                    w.adapters_listed(adapters);
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
