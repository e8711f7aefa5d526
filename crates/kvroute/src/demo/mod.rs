//! `kvroute demo`: a simulated hybrid fleet, the gateway in front, and a public trace replayed
//! through real HTTP once per policy — the product's case on one screen.
//!
//! Owns: the demo's options, the per-policy run (fresh fleet and gateway each time, so no
//! policy inherits another's cache), the open-loop replay client (streaming requests at the
//! trace's scaled arrival times, TTFT from the first streamed chunk), the progress bar, and the
//! outputs (table, JSON, SVG and PNG plot).
//! Invariants: every policy sees the same requests at the same times on identical fresh
//! fleets; engine-time figures are wall-clock times multiplied by the fleet's speed-up.
//! Must not: tune itself to make one policy win.

pub mod plot;
pub mod report;
pub mod trace;

use crate::gateway::policy::PolicyKind;
use anyhow::{Context, Result};
use futures_util::StreamExt;
use report::{PolicyResult, Sample};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub preset: String,
    pub workers: usize,
    /// KV cache blocks per worker (vLLM's num_gpu_blocks_override).
    pub blocks: usize,
    pub trace: Option<PathBuf>,
    /// Engine time runs this many times faster than wall time; trace arrivals are compressed
    /// by the same factor.
    pub speedup: f64,
    pub tokens_per_block: usize,
    pub sample: u64,
    pub max_requests: usize,
    pub max_output: u32,
    pub policies: Vec<PolicyKind>,
    pub json: Option<PathBuf>,
    /// One JSON line per request and policy: worker, predicted and engine-reported cached
    /// tokens, TTFT and the gateway's decision evidence.
    pub requests_log: Option<PathBuf>,
    pub plot: PathBuf,
    pub progress: bool,
    pub lambda: f64,
    pub junction_weight: f64,
    /// Arrivals this many times denser than the trace's (load in engine time).
    pub rate: f64,
    /// Runs per policy (fresh fleet each time, policies interleaved); the table shows means
    /// and the range.
    pub repeat: usize,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            preset: "qwen3-next".into(),
            workers: 4,
            blocks: 300,
            trace: None,
            speedup: 80.0,
            tokens_per_block: 136,
            sample: 4,
            max_requests: 1000,
            max_output: 32,
            policies: vec![
                PolicyKind::HybridAware,
                PolicyKind::GroupBlind,
                PolicyKind::RoundRobin,
                PolicyKind::LeastLoad,
            ],
            json: None,
            requests_log: None,
            plot: PathBuf::from("kvroute-demo"),
            progress: true,
            lambda: 0.25,
            junction_weight: 1.0,
            rate: 1.0,
            repeat: 1,
        }
    }
}

async fn one_request(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    req: &trace::TraceRequest,
    speedup: f64,
) -> Sample {
    let body = serde_json::json!({
        "model": model,
        "prompt": req.tokens,
        "max_tokens": req.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    let mut sample = Sample {
        prompt_tokens: req.tokens.len() as u64,
        ..Sample::default()
    };
    let start = Instant::now();
    let resp = match client
        .post(format!("{url}/v1/completions"))
        .header("x-kvroute-explain", "1")
        .json(&body)
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r,
        _ => return sample,
    };
    let decision = resp
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| serde_json::from_str::<serde_json::Value>(v).ok());
    sample.cached_predicted = decision
        .as_ref()
        .and_then(|v| v.get("predicted_cached").and_then(|p| p.as_u64()));
    sample.worker = decision
        .as_ref()
        .and_then(|v| v.get("worker").and_then(|w| w.as_str()).map(str::to_string));
    sample.decision = decision;
    let mut stream = resp.bytes_stream();
    let mut first = true;
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { return sample };
        if first {
            first = false;
            sample.ttft_ms = start.elapsed().as_secs_f64() * 1000.0 * speedup;
        }
        buf.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&buf);
    sample.cached_reported = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| crate::gateway::proxy::reported_cached(d.as_bytes()))
        .next_back();
    // The simulated engine reports its own TTFT (engine time, queueing included) on the last
    // chunk; prefer it to the wall clock, which multiplies the gateway's and the simulator's
    // CPU time by the speed-up.
    if let Some(t) = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v.get("sim")
                .and_then(|s| s.get("ttft_s"))
                .and_then(|t| t.as_f64())
        })
        .next_back()
    {
        sample.ttft_ms = t * 1000.0;
    }
    sample.ok = text.contains("[DONE]");
    sample
}

/// Replays `requests` through a gateway at `url`; returns samples and the engine-time span.
async fn replay(
    url: &str,
    model: &str,
    requests: &[trace::TraceRequest],
    speedup: f64,
    rate: f64,
    bar: &indicatif::ProgressBar,
) -> (Vec<Sample>, f64) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap_or_default();
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (index, req) in requests.iter().cloned().enumerate() {
        let at = Duration::from_secs_f64(req.at_ms / 1000.0 / speedup / rate.max(1e-6));
        let client = client.clone();
        let url = url.to_string();
        let model = model.to_string();
        let bar = bar.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
            let mut s = one_request(&client, &url, &model, &req, speedup).await;
            s.index = index;
            bar.inc(1);
            s
        }));
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        samples.push(t.await.unwrap_or_default());
    }
    (samples, start.elapsed().as_secs_f64() * speedup)
}

/// Runs one policy on a fresh fleet and gateway.
async fn run_policy(
    opts: &DemoOptions,
    policy: PolicyKind,
    requests: &[trace::TraceRequest],
    bar: &indicatif::ProgressBar,
) -> Result<(PolicyResult, Vec<Sample>)> {
    let weights = crate::gateway::config::PolicyWeights {
        lambda: opts.lambda,
        junction: opts.junction_weight,
        cost: crate::simfleet::cost_for(opts.speedup, None),
        ..Default::default()
    };
    let shape = crate::simfleet::FleetShape {
        preset: opts.preset.clone(),
        workers: opts.workers,
        blocks: opts.blocks,
        speedup: opts.speedup,
        pd: None,
    };
    let gw = crate::simfleet::start(&shape, policy, weights).await?;
    let model = opts.preset.clone();
    let url = gw.url.clone();
    bar.set_message(policy.name());
    let (samples, engine_seconds) =
        replay(&url, &model, requests, opts.speedup, opts.rate, bar).await;
    gw.stop().await;
    Ok((
        report::summarize(policy.name(), &samples, engine_seconds),
        samples,
    ))
}

pub async fn run(opts: DemoOptions) -> Result<Vec<PolicyResult>> {
    let (text, origin) = match &opts.trace {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (
            trace::BUNDLED.to_string(),
            "bundled Mooncake trace".to_string(),
        ),
    };
    let lines = trace::parse(&text, &origin)?;
    let shape = trace::Shape {
        tokens_per_block: opts.tokens_per_block,
        sample: opts.sample,
        max_requests: opts.max_requests,
        max_output: opts.max_output,
        vocab: fleet::vocab(&opts),
        max_prompt: fleet::max_prompt(&opts),
    };
    let requests = trace::requests(&lines, &shape);
    anyhow::ensure!(!requests.is_empty(), "{origin}: no request selected");
    let total = requests.len() as u64 * opts.policies.len() as u64 * opts.repeat.max(1) as u64;
    let bar = if opts.progress {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {msg:<13} [{bar:40}] {pos}/{len} requests ({elapsed})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    eprintln!(
        "kvroute demo: {} × {} (blocks {}), {} requests from {} per policy, engine time ×{}",
        opts.workers,
        opts.preset,
        if opts.blocks == 0 {
            "preset default".to_string()
        } else {
            opts.blocks.to_string()
        },
        requests.len(),
        origin,
        opts.speedup
    );
    let requests = Arc::new(requests);
    let rounds = opts.repeat.max(1);
    let mut runs: Vec<Vec<PolicyResult>> = vec![Vec::new(); opts.policies.len()];
    let mut log = Vec::new();
    for round in 0..rounds {
        for (p, out) in opts.policies.iter().zip(runs.iter_mut()) {
            let (result, samples) = run_policy(&opts, *p, &requests, &bar).await?;
            if opts.requests_log.is_some() {
                for s in &samples {
                    log.extend_from_slice(&report::log_line(p.name(), round, s)?);
                }
            }
            out.push(result);
        }
    }
    let results: Vec<PolicyResult> = runs.iter().filter_map(|r| report::combine(r)).collect();
    bar.finish_and_clear();
    println!("{}", report::table(&results));
    let title = format!(
        "kvroute demo: {} x {}, {} requests per policy",
        opts.workers,
        opts.preset,
        requests.len()
    );
    let svg_path = opts.plot.with_extension("svg");
    let png_path = opts.plot.with_extension("png");
    std::fs::write(&svg_path, plot::svg(&results, &title))
        .with_context(|| format!("writing {}", svg_path.display()))?;
    plot::png(&results, &title, &png_path)
        .with_context(|| format!("writing {}", png_path.display()))?;
    println!("plot: {} and {}", svg_path.display(), png_path.display());
    if let Some(j) = &opts.json {
        std::fs::write(j, serde_json::to_vec_pretty(&results)?)
            .with_context(|| format!("writing {}", j.display()))?;
        println!("json: {}", j.display());
    }
    if let Some(path) = &opts.requests_log {
        std::fs::write(path, &log).with_context(|| format!("writing {}", path.display()))?;
        println!("requests log: {}", path.display());
    }
    Ok(results)
}

mod fleet {
    //! The preset facts the demo shapes its requests by.
    use super::DemoOptions;

    pub fn max_prompt(opts: &DemoOptions) -> usize {
        kvroute_sim::preset(&opts.preset)
            .map_or(8192, |m| m.max_model_len as usize)
            .saturating_sub(opts.max_output as usize + 1)
    }

    pub fn vocab(opts: &DemoOptions) -> u32 {
        kvroute_sim::preset(&opts.preset).map_or(32_000, |m| m.vocab_size)
    }
}
