//! The engine's own account of a run: simulated workers list every finished request
//! (`GET /admin/requests`: prompt digest, cached tokens, engine TTFT and end-to-end time), and
//! the bench matches its requests to those records, so gateways that rewrite or strip the
//! response are measured by the same engine clock as those that pass it through.
//!
//! Owns: [`marks`] (each worker's finished count before a run) and [`attach`] (the run's
//! records, matched to outcomes by prompt digest, first come first served).
//! Invariants: a record is used once; an outcome keeps its own figures when no record matches;
//! the engine's cached tokens replace a missing or different client-side figure (the engine is
//! the truth); an outcome the gateway did not name a worker for is filed under the engine that
//! served it.
//! Must not: match by anything but the prompt's exact token ids.

use super::client::Outcome;
use anyhow::{Context, Result};
use serde::Deserialize;
use std::collections::{HashMap, VecDeque};

#[derive(Deserialize)]
struct Record {
    /// Which of the given engine URLs finished it (filled in here).
    #[serde(skip)]
    engine: usize,
    prompt_digest: String,
    cached_tokens: u64,
    ttft_s: f64,
    e2e_s: f64,
}

#[derive(Deserialize)]
struct Page {
    total: u64,
    #[serde(default)]
    requests: Vec<Record>,
}

async fn page(url: &str, since: u64) -> Result<Page> {
    let u = format!("{}/admin/requests?since={since}", url.trim_end_matches('/'));
    reqwest::get(&u)
        .await
        .with_context(|| format!("GET {u}"))?
        .json()
        .await
        .with_context(|| format!("{u}: not a simulated worker's request list"))
}

/// How many requests each worker has finished so far.
pub async fn marks(urls: &[String]) -> Result<Vec<u64>> {
    let mut out = Vec::with_capacity(urls.len());
    for u in urls {
        out.push(page(u, u64::MAX).await?.total);
    }
    Ok(out)
}

/// Fills engine times and cached tokens into the outcomes that match a record finished since
/// `marks`; returns how many matched.
pub async fn attach(urls: &[String], marks: &[u64], outcomes: &mut [Outcome]) -> Result<usize> {
    let mut by_digest: HashMap<String, VecDeque<Record>> = HashMap::new();
    for (k, (u, since)) in urls.iter().zip(marks).enumerate() {
        for mut r in page(u, *since).await?.requests {
            r.engine = k;
            by_digest
                .entry(r.prompt_digest.clone())
                .or_default()
                .push_back(r);
        }
    }
    let mut order: Vec<usize> = (0..outcomes.len()).collect();
    order.sort_by(|a, b| outcomes[*a].sent_at_s.total_cmp(&outcomes[*b].sent_at_s));
    let mut matched = 0;
    for i in order {
        let o = &mut outcomes[i];
        if o.failure.is_some() {
            continue;
        }
        let key = format!("{:016x}", kvroute_sim::worker::prompt_digest(&o.tokens));
        if let Some(r) = by_digest.get_mut(&key).and_then(VecDeque::pop_front) {
            o.engine_ttft_s = Some(r.ttft_s);
            o.engine_e2e_s = Some(r.e2e_s);
            o.cached_tokens = Some(r.cached_tokens);
            if o.worker.is_none() {
                o.worker = urls.get(r.engine).cloned();
            }
            matched += 1;
        }
    }
    Ok(matched)
}
