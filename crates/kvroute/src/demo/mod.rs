//! `kvroute demo`: a simulated hybrid fleet, the gateway in front, and a public trace replayed
//! through real HTTP once per policy — the product's case on one screen.
//!
//! Owns: the demo's options, the per-policy run (fresh fleet and gateway each time, so no
//! policy inherits another's cache; `--pd` layouts split the same number of workers into
//! prefill and decode pools for one more row each), the open-loop replay client (streaming
//! requests at the trace's scaled arrival times, TTFT from the engine's own report, both legs'
//! for a disaggregated request), the progress bar, and the outputs (table, JSON, SVG and PNG
//! plot).
//! Invariants: every policy sees the same requests at the same times on identical fresh
//! fleets; engine-time figures are the simulated engines' own (wall-clock times multiplied by
//! the fleet's speed-up where an engine reports none).
//! Must not: tune itself to make one policy win.

pub mod plot;
pub mod report;
pub mod trace;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use kvroute_route::PolicyKind;
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
    /// Disaggregated layouts to run beside the aggregated fleet, each with the first policy:
    /// the same number of workers split into prefill and decode pools.
    pub pd: Vec<crate::simfleet::PdLayout>,
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
            junction_weight: 0.0,
            rate: 1.0,
            repeat: 1,
            pd: Vec::new(),
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
    // A disaggregated request's cached tokens are the prefill leg's (the decode worker reports
    // the prefill worker's), so its prediction is the prefill decision's.
    sample.cached_predicted = decision.as_ref().and_then(|v| {
        v.get("prefill")
            .unwrap_or(v)
            .get("predicted_cached")
            .and_then(|p| p.as_u64())
    });
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
        .filter_map(|d| crate::gateway::answer::reported_cached(d.as_bytes()))
        .next_back();
    // The simulated engine reports its own TTFT (engine time, queueing included) on the last
    // chunk; prefer it to the wall clock, which multiplies the gateway's and the simulator's
    // CPU time by the speed-up.
    if let Some(t) = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v.get("sim").and_then(engine_ttft_s))
        .next_back()
    {
        sample.ttft_ms = t * 1000.0;
    }
    sample.ok = text.contains("[DONE]");
    sample
}

/// A simulated engine's TTFT in seconds of engine time from its answer's `sim` fields: its own
/// `ttft_s`, plus, for a disaggregated request, the prefill leg's `prefill_leg_s` (the decode
/// worker's `ttft_s` starts when the request reached it). The gateway's hops between the legs
/// are left out, as its hop is for a request served whole.
fn engine_ttft_s(sim: &serde_json::Value) -> Option<f64> {
    let own = sim.get("ttft_s")?.as_f64()?;
    let prefill = sim
        .get("prefill_leg_s")
        .and_then(|p| p.as_f64())
        .unwrap_or(0.0);
    Some(own + prefill)
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

/// Runs one policy on a fresh fleet (aggregated, or split into `pd`'s pools) and gateway.
async fn run_policy(
    opts: &DemoOptions,
    policy: PolicyKind,
    pd: Option<crate::simfleet::PdLayout>,
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
        pd,
    };
    let gw = crate::simfleet::start(&shape, policy, weights).await?;
    let model = opts.preset.clone();
    let url = gw.url.clone();
    let name = row_name(policy, pd);
    bar.set_message(name.clone());
    let (samples, engine_seconds) =
        replay(&url, &model, requests, opts.speedup, opts.rate, bar).await;
    gw.stop().await;
    Ok((report::summarize(&name, &samples, engine_seconds), samples))
}

/// A row's name: the policy, and the layout when disaggregated (`hybrid-aware 2p2d`).
fn row_name(policy: PolicyKind, pd: Option<crate::simfleet::PdLayout>) -> String {
    match pd {
        Some(l) => format!("{} {}", policy.name(), l.label()),
        None => policy.name().to_string(),
    }
}

/// The runs of one round, in table order: every policy on the aggregated fleet, then the first
/// policy on each disaggregated layout.
fn runs_of(opts: &DemoOptions) -> Vec<(PolicyKind, Option<crate::simfleet::PdLayout>)> {
    let mut runs: Vec<_> = opts.policies.iter().map(|p| (*p, None)).collect();
    if let Some(first) = opts.policies.first() {
        runs.extend(opts.pd.iter().map(|l| (*first, Some(*l))));
    }
    runs
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
    anyhow::ensure!(
        opts.pd.is_empty() || !opts.policies.is_empty(),
        "--pd runs the first of --policies on each layout: give at least one policy"
    );
    for l in &opts.pd {
        anyhow::ensure!(
            l.workers() == opts.workers,
            "--pd {}: a layout splits the fleet's {} workers, so P + D must be {}",
            l.label(),
            opts.workers,
            opts.workers
        );
    }
    let plan = runs_of(&opts);
    let total = requests.len() as u64 * plan.len() as u64 * opts.repeat.max(1) as u64;
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
    let mut runs: Vec<Vec<PolicyResult>> = vec![Vec::new(); plan.len()];
    let mut log = Vec::new();
    for round in 0..rounds {
        for ((p, pd), out) in plan.iter().zip(runs.iter_mut()) {
            let (result, samples) = run_policy(&opts, *p, *pd, &requests, &bar).await?;
            if opts.requests_log.is_some() {
                let name = row_name(*p, *pd);
                for s in &samples {
                    log.extend_from_slice(&report::log_line(&name, round, s)?);
                }
            }
            out.push(result);
        }
    }
    let results: Vec<PolicyResult> = runs.iter().filter_map(|r| report::combine(r)).collect();
    bar.finish_and_clear();
    println!("{}", report::table(&results));
    let title = format!(
        "kvroute demo: {} × {}, {} requests per policy",
        opts.workers,
        opts.preset,
        requests.len()
    );
    let svg_path = opts.plot.with_extension("svg");
    let png_path = opts.plot.with_extension("png");
    std::fs::write(&svg_path, plot::svg(&results, &title, "policy")?)
        .with_context(|| format!("writing {}", svg_path.display()))?;
    plot::png(&results, &title, "policy", &png_path)
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_disaggregated_requests_engine_ttft_adds_the_prefill_leg() {
        assert_eq!(engine_ttft_s(&json!({"ttft_s": 0.5})), Some(0.5));
        assert_eq!(
            engine_ttft_s(&json!({"ttft_s": 0.25, "prefill_leg_s": 0.5})),
            Some(0.75)
        );
        assert_eq!(engine_ttft_s(&json!({"dp_rank": 0})), None);
    }

    #[test]
    fn each_layout_runs_the_first_policy_after_every_aggregated_row() {
        let opts = DemoOptions {
            policies: vec![PolicyKind::HybridAware, PolicyKind::RoundRobin],
            pd: vec![crate::simfleet::PdLayout {
                prefill: 1,
                decode: 3,
            }],
            ..DemoOptions::default()
        };
        let names: Vec<String> = runs_of(&opts)
            .into_iter()
            .map(|(p, l)| row_name(p, l))
            .collect();
        assert_eq!(names, ["hybrid-aware", "round-robin", "hybrid-aware 1p3d"]);
    }
}
