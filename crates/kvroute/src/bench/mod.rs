//! `kvroute bench`: a load generator for any OpenAI-compatible endpoint — kvroute, SMG,
//! vllm-router, a bare vLLM or a simulated engine — that replays a workload open-loop and
//! reports reuse against the arrival-time oracle, TTFT, inter-token and end-to-end latency and
//! throughput, one target beside the other.
//!
//! Owns: [`BenchOptions`], [`Target`] (a URL, several URLs joined by `+` — the replicas of one
//! router behind a balancer — or `kvroute:POLICY[/PpDd]`: `--replicas` in-process gateways on
//! a fresh simulated fleet that `--fleet PRESET,N,BLOCKS` describes, every worker serving
//! whole or, with `/PpDd`, P prefill and D decode workers), the per-target runs
//! (targets interleaved across `--repeat` rounds, every `kvroute:` run on a fresh fleet), and
//! the outputs (table, JSON, requests log, plot).
//! Invariants: every target sees the same workload with the same schedule, balanced over its
//! replicas per request (`--balance`; a conversation's turns are not pinned to one replica);
//! a URL target is used as it is (the caller starts what is behind it fresh, as `bench/peers.sh` does);
//! simulated fleets run engine time × `speedup`, so the schedule, the engine and the reported
//! times share one clock; when any target is disaggregated (or `client_clock` asks) every
//! target is timed by the client (the decode engine's own times would leave out the prefill
//! leg), so the table compares one clock.
//! Must not: tune the workload or the targets to one another.

pub mod balance;
pub mod client;
pub mod engine;
pub mod report;
pub mod workload;

use crate::simfleet::{self, FleetShape, PdLayout, SimGateway};
use anyhow::{bail, Context, Result};
use balance::Balance;
use client::{Api, ClientOptions, Outcome, PromptFormat};
use kvroute_route::PolicyKind;
use report::TargetReport;
use std::path::PathBuf;
use std::time::Duration;

/// Where requests go.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Url(String),
    /// Several URLs, the replicas of one router: each request goes to the one the balancer
    /// picks (spelled `http://a:1+http://b:2`).
    Balanced(Vec<String>),
    /// A kvroute gateway with this policy, in process, in front of a fresh simulated fleet:
    /// every worker serving whole, or split into prefill and decode pools.
    Kvroute(PolicyKind, Option<PdLayout>),
}

impl Target {
    pub fn parse(s: &str) -> Result<Target> {
        if let Some(rest) = s.strip_prefix("kvroute:") {
            let (p, layout) = match rest.split_once('/') {
                Some((p, l)) => (
                    p,
                    Some(PdLayout::parse(l).map_err(|e| anyhow::anyhow!("--target {s}: {e}"))?),
                ),
                None => (rest, None),
            };
            let policy: PolicyKind = p
                .parse()
                .map_err(|e| anyhow::anyhow!("--target {s}: {e}"))?;
            return Ok(Target::Kvroute(policy, layout));
        }
        let url = |u: &str| -> Result<String> {
            if u.starts_with("http://") || u.starts_with("https://") {
                Ok(u.trim_end_matches('/').to_string())
            } else {
                bail!(
                    "--target {s}: give a URL (http://host:port), replicas joined by + \
                     (http://a:1+http://b:2), or kvroute:POLICY"
                )
            }
        };
        if s.contains('+') {
            let urls = s.split('+').map(url).collect::<Result<Vec<_>>>()?;
            return Ok(Target::Balanced(urls));
        }
        Ok(Target::Url(url(s)?))
    }

    pub fn label(&self) -> String {
        match self {
            Target::Url(u) => u.clone(),
            Target::Balanced(us) => us.join("+"),
            Target::Kvroute(p, None) => format!("kvroute:{}", p.name()),
            Target::Kvroute(p, Some(l)) => format!("kvroute:{}/{}", p.name(), l.label()),
        }
    }

    /// A URL target (one or several replicas), not one the command starts.
    pub fn is_url(&self) -> bool {
        matches!(self, Target::Url(_) | Target::Balanced(_))
    }
}

/// A simulated fleet the command starts itself: `PRESET,N,BLOCKS`.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetSpec {
    pub preset: String,
    pub workers: usize,
    /// KV cache blocks per worker (0: the preset's default).
    pub blocks: usize,
}

impl FleetSpec {
    pub fn parse(s: &str) -> Result<FleetSpec> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let [preset, n, blocks] = parts.as_slice() else {
            bail!("--fleet {s}: expected PRESET,WORKERS,BLOCKS (e.g. qwen3-next,4,1000)");
        };
        kvroute_sim::preset(preset).map_err(|e| anyhow::anyhow!("--fleet {s}: {e}"))?;
        Ok(FleetSpec {
            preset: preset.to_string(),
            workers: n.parse().with_context(|| format!("--fleet {s}: workers"))?,
            blocks: blocks
                .parse()
                .with_context(|| format!("--fleet {s}: blocks"))?,
        })
    }
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub targets: Vec<Target>,
    /// Gateways a `kvroute:POLICY` target starts on its fleet (each subscribed to every
    /// worker); a URL target names its replicas itself and must agree when this is above 1.
    pub replicas: usize,
    /// How requests are spread over a target's replicas (random: seeded by `seed`).
    pub balance: Balance,
    pub model: Option<String>,
    pub fleet: Option<FleetSpec>,
    /// A built-in generator (`shared-prefix`, `multi-turn`, `agentic`, `rag`, `tenants`,
    /// `mooncake`).
    pub workload: Option<String>,
    pub trace: Option<PathBuf>,
    pub tokens_per_block: usize,
    pub max_prompt: Option<usize>,
    pub max_output: u32,
    pub seed: u64,
    /// Sessions a built-in generator makes (default: its own count).
    pub sessions: Option<usize>,
    pub speedup: f64,
    /// Sessions per second (wall, before `speedup`); rescales the workload's schedule.
    pub rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub max_requests: Option<usize>,
    pub duration: Option<Duration>,
    pub prompt_format: PromptFormat,
    pub api: Api,
    /// Tokens per block of the oracle (default: the fleet preset's hit alignment, else 16).
    pub block_size: Option<usize>,
    /// Engine seconds per wall second of a URL target (client times are multiplied by it).
    pub time_scale: f64,
    /// Every target timed by the client's clock, whatever the engines report (implied when a
    /// target is disaggregated).
    pub client_clock: bool,
    pub repeat: usize,
    pub request_timeout: Duration,
    pub json: Option<PathBuf>,
    pub requests_log: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub progress: bool,
    /// Simulated workers behind a URL target: their `/admin/requests` give every request's
    /// engine times and cached tokens (matched by prompt digest), whatever the gateway forwards.
    pub engine_urls: Vec<String>,
    /// The in-process gateway's cost model (default: `ttft` in real time, `tokens` when the
    /// fleet runs faster), load weight and junction weight.
    pub cost: Option<crate::gateway::config::CostModel>,
    pub lambda: Option<f64>,
    pub junction_weight: Option<f64>,
    /// The in-process gateway's `weights.later_turns` (default: the gateway's own).
    pub later_turns: Option<bool>,
    /// The in-process gateway's `weights.delay_to_others` (default: the gateway's own).
    pub delay_to_others: Option<bool>,
    /// The in-process gateway's `weights.decode_interference` (default: the gateway's own).
    pub decode_interference: Option<bool>,
    /// The in-process gateway's `weights.prefill_stall` (default: the gateway's own).
    pub prefill_stall: Option<crate::gateway::config::PrefillStall>,
    /// The in-process gateway's `weights.eviction` (default: the gateway's own).
    pub eviction: Option<bool>,
    /// The in-process gateway's `weights.next_arrivals` (default: the gateway's own).
    pub next_arrivals: Option<bool>,
    /// The in-process gateway's `weights.queue_drain`.
    pub queue_drain: Option<bool>,
    /// The in-process gateway's `weights.in_flight_forecast`.
    pub in_flight_forecast: Option<bool>,
    /// What in-process replicas share (`[peers]`, as a deployment configures them).
    pub replica_sharing: simfleet::Sharing,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            targets: Vec::new(),
            replicas: 1,
            balance: Balance::RoundRobin,
            model: None,
            fleet: None,
            workload: None,
            trace: None,
            tokens_per_block: workload::MOONCAKE_BLOCK,
            max_prompt: None,
            max_output: 32,
            seed: 1,
            sessions: None,
            speedup: 1.0,
            rate: None,
            max_concurrency: None,
            max_requests: None,
            duration: None,
            prompt_format: PromptFormat::Tokens,
            api: Api::Completions,
            block_size: None,
            time_scale: 1.0,
            client_clock: false,
            repeat: 1,
            request_timeout: Duration::from_secs(600),
            json: None,
            requests_log: None,
            plot: None,
            progress: true,
            engine_urls: Vec::new(),
            cost: None,
            lambda: None,
            junction_weight: None,
            later_turns: None,
            delay_to_others: None,
            decode_interference: None,
            prefill_stall: None,
            eviction: None,
            next_arrivals: None,
            queue_drain: None,
            in_flight_forecast: None,
            replica_sharing: simfleet::Sharing::Learning,
        }
    }
}

async fn start_kvroute(
    o: &BenchOptions,
    fleet: &FleetSpec,
    policy: PolicyKind,
    pd: Option<PdLayout>,
) -> Result<SimGateway> {
    let mut weights = crate::gateway::config::PolicyWeights::default();
    if let Some(l) = o.lambda {
        weights.lambda = l;
    }
    if let Some(j) = o.junction_weight {
        weights.junction = j;
    }
    if let Some(l) = o.later_turns {
        weights.later_turns = l;
    }
    if let Some(d) = o.delay_to_others {
        weights.delay_to_others = d;
    }
    if let Some(d) = o.decode_interference {
        weights.decode_interference = d;
    }
    if let Some(p) = o.prefill_stall {
        weights.prefill_stall = p;
    }
    if let Some(e) = o.eviction {
        weights.eviction = e;
    }
    if let Some(n) = o.next_arrivals {
        weights.next_arrivals = n;
    }
    if let Some(q) = o.queue_drain {
        weights.queue_drain = q;
    }
    if let Some(f) = o.in_flight_forecast {
        weights.in_flight_forecast = f;
    }
    weights.cost = simfleet::cost_for(o.speedup, o.cost);
    let shape = FleetShape {
        preset: fleet.preset.clone(),
        workers: fleet.workers,
        blocks: fleet.blocks,
        speedup: o.speedup,
        pd,
    };
    simfleet::start_replicas(&shape, policy, weights, o.replicas, o.replica_sharing).await
}

fn shape(o: &BenchOptions) -> Result<workload::Shape> {
    let spec = o
        .fleet
        .as_ref()
        .map(|f| kvroute_sim::preset(&f.preset))
        .transpose()?;
    let vocab = spec.as_ref().map_or(32_000, |m| m.vocab_size);
    let model_len = spec.as_ref().map_or(8192, |m| m.max_model_len as usize);
    let max_prompt = o
        .max_prompt
        .unwrap_or_else(|| model_len.saturating_sub(o.max_output as usize + 8));
    Ok(workload::Shape {
        vocab,
        max_prompt: max_prompt.max(1),
        max_output: o.max_output.max(1),
        seed: o.seed,
    })
}

fn block_size(o: &BenchOptions) -> usize {
    o.block_size
        .or_else(|| {
            o.fleet
                .as_ref()
                .and_then(|f| kvroute_sim::preset(&f.preset).ok())
                .and_then(|m| m.params().ok())
                .map(|p| p.align as usize)
        })
        .unwrap_or(16)
}

fn validate(o: &BenchOptions) -> Result<()> {
    if o.targets.is_empty() {
        bail!("give at least one --target (a URL, or kvroute:POLICY with --fleet)");
    }
    if o.targets.iter().any(|t| matches!(t, Target::Kvroute(..))) && o.fleet.is_none() {
        bail!("kvroute:POLICY targets need --fleet PRESET,WORKERS,BLOCKS");
    }
    if let Some(f) = &o.fleet {
        for t in &o.targets {
            if let Target::Kvroute(_, Some(l)) = t {
                if l.workers() != f.workers {
                    bail!(
                        "--target {}: {} workers, but --fleet has {}",
                        t.label(),
                        l.workers(),
                        f.workers
                    );
                }
            }
        }
    }
    validate_replicas(o)?;
    if o.api == Api::Chat && o.prompt_format == PromptFormat::Tokens {
        bail!("--api chat sends text: use --prompt-format text");
    }
    if !(o.speedup.is_finite() && o.speedup > 0.0) {
        bail!("--speedup must be positive");
    }
    Ok(())
}

fn validate_replicas(o: &BenchOptions) -> Result<()> {
    if o.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    if o.replicas == 1 {
        return Ok(());
    }
    for t in &o.targets {
        match t {
            Target::Url(u) => bail!(
                "--replicas {n} with --target {u}: a URL target is one replica; name every \
                 replica of it in one target joined by + (http://a:1+http://b:2+http://c:3)",
                n = o.replicas
            ),
            Target::Balanced(us) if us.len() != o.replicas => bail!(
                "--target {}: {} replicas, but --replicas is {}",
                t.label(),
                us.len(),
                o.replicas
            ),
            _ => {}
        }
    }
    Ok(())
}

/// Runs every target (`repeat` rounds, targets interleaved); returns one report per target.
pub async fn run(o: BenchOptions) -> Result<Vec<TargetReport>> {
    validate(&o)?;
    let shape = shape(&o)?;
    let mut w = workload::build(
        o.workload.as_deref(),
        o.trace.as_deref(),
        o.tokens_per_block,
        o.sessions,
        &shape,
    )?;
    if let Some(r) = o.rate {
        w.rescale_to_rate(r);
    }
    w.truncate(
        o.max_requests,
        o.duration.map(|d| d.as_secs_f64() * 1000.0 * o.speedup),
    );
    let planned = o.max_requests.map_or(w.requests(), |m| m.min(w.requests()));
    let rounds = o.repeat.max(1);
    let bar = progress_bar(o.progress, (planned * o.targets.len() * rounds) as u64);
    eprintln!(
        "kvroute bench: {} ({} sessions, {} requests), {} target(s) × {rounds}, arrivals ×{}{}{}",
        w.name,
        w.sessions.len(),
        planned,
        o.targets.len(),
        o.speedup,
        o.fleet
            .as_ref()
            .map(|f| format!(", fleet {} × {} (blocks {})", f.workers, f.preset, f.blocks))
            .unwrap_or_default(),
        if o.replicas > 1 {
            format!(", {} replicas ({})", o.replicas, o.balance.name())
        } else {
            String::new()
        }
    );
    let cx = RunContext {
        client_clock: o.client_clock
            || o.targets
                .iter()
                .any(|t| matches!(t, Target::Kvroute(_, Some(_)))),
        block: block_size(&o),
        o: &o,
        w: &w,
        vocab: shape.vocab,
        bar: bar.clone(),
    };
    let mut per_target: Vec<Vec<TargetReport>> = vec![Vec::new(); o.targets.len()];
    let mut log = Vec::new();
    for round in 0..rounds {
        for (t, out) in o.targets.iter().zip(per_target.iter_mut()) {
            let (rep, lines) = run_target(&cx, t, round).await?;
            log.extend(lines);
            out.push(rep);
        }
    }
    bar.finish_and_clear();
    let reports: Vec<TargetReport> = per_target.into_iter().filter_map(report::combine).collect();
    println!("{}", report::table(&reports));
    write_outputs(&o, &reports, &log, &w.name)?;
    Ok(reports)
}

fn progress_bar(show: bool, len: u64) -> indicatif::ProgressBar {
    let bar = if show {
        indicatif::ProgressBar::new(len)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {msg:<24} [{bar:40}] {pos}/{len} requests ({elapsed})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar
}

/// What every target's run shares.
struct RunContext<'a> {
    o: &'a BenchOptions,
    w: &'a workload::Workload,
    /// The workload's vocabulary (replies are tokenized with the target model's when it is a
    /// simulator preset).
    vocab: u32,
    block: usize,
    client_clock: bool,
    bar: indicatif::ProgressBar,
}

/// One round of one target: its replicas up (a fresh fleet and gateways for `kvroute:`), the
/// workload replayed through the balancer, its report and requests-log lines.
async fn run_target(
    cx: &RunContext<'_>,
    t: &Target,
    round: usize,
) -> Result<(TargetReport, Vec<u8>)> {
    let o = cx.o;
    cx.bar.set_message(t.label());
    let (urls, running, time_scale) = match t {
        Target::Url(u) => (vec![u.clone()], None, o.time_scale),
        Target::Balanced(us) => (us.clone(), None, o.time_scale),
        Target::Kvroute(p, pd) => {
            let f = o.fleet.as_ref().context("kvroute targets need --fleet")?;
            let r = start_kvroute(o, f, *p, *pd).await?;
            (r.urls.clone(), Some(r), o.speedup)
        }
    };
    let model = match (&o.model, &o.fleet) {
        (Some(m), _) => m.clone(),
        (None, Some(f)) => f.preset.clone(),
        (None, None) => match urls.first() {
            Some(u) => discover_model(u).await.unwrap_or_default(),
            None => String::new(),
        },
    };
    // Replies are tokenized (and chats rendered) for the oracle's view with the target model's
    // vocabulary when it is a simulator preset, so the view is the engine's.
    let vocab = kvroute_sim::preset(&model).map_or(cx.vocab, |m| m.vocab_size);
    let copts = ClientOptions {
        urls: urls.clone(),
        balance: o.balance,
        seed: o.seed,
        model,
        api: o.api,
        format: o.prompt_format,
        vocab,
        speedup: o.speedup,
        max_concurrency: o.max_concurrency,
        max_requests: o.max_requests,
        duration: o.duration,
        request_timeout: o.request_timeout,
        explain: matches!(t, Target::Kvroute(..)),
    };
    let engines = t.is_url() && !o.engine_urls.is_empty();
    let marks = if engines {
        engine::marks(&o.engine_urls).await?
    } else {
        Vec::new()
    };
    let (mut outcomes, wall) = client::drive(cx.w, copts, cx.bar.clone()).await;
    if engines {
        attach_engines(o, t, &marks, &mut outcomes).await?;
    }
    if let Some(r) = running {
        r.stop().await;
    }
    if cx.client_clock {
        for oc in &mut outcomes {
            (oc.engine_ttft_s, oc.engine_e2e_s) = (None, None);
        }
    }
    let mut rep = report::summarize(
        &t.label(),
        &cx.w.name,
        &outcomes,
        cx.block,
        wall,
        time_scale,
    );
    rep.replicas = report::replicas(&outcomes, &urls, rep.ttft_source == "engine", time_scale);
    let mut log = Vec::new();
    if o.requests_log.is_some() {
        let oracle = report::oracle(&outcomes, cx.block);
        for (oc, or) in outcomes.iter().zip(oracle) {
            log.extend(report::log_line(&t.label(), round, oc, or)?);
        }
    }
    Ok((rep, log))
}

/// The engines' own times and cached tokens for every outcome they recorded.
async fn attach_engines(
    o: &BenchOptions,
    t: &Target,
    marks: &[u64],
    outcomes: &mut [Outcome],
) -> Result<()> {
    let matched = engine::attach(&o.engine_urls, marks, outcomes).await?;
    if matched < outcomes.iter().filter(|x| x.failure.is_none()).count() {
        eprintln!(
            "kvroute bench: {}: {matched} of the completed requests matched an engine record",
            t.label()
        );
    }
    Ok(())
}

/// The first model a target lists on `/v1/models`.
async fn discover_model(url: &str) -> Option<String> {
    let v: serde_json::Value = reqwest::get(format!("{url}/v1/models"))
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    v.get("data")?
        .get(0)?
        .get("id")?
        .as_str()
        .map(str::to_string)
}

fn write_outputs(
    o: &BenchOptions,
    reports: &[TargetReport],
    log: &[u8],
    workload: &str,
) -> Result<()> {
    if let Some(j) = &o.json {
        let doc = serde_json::json!({
            "workload": workload,
            "fleet": o.fleet.as_ref().map(|f| serde_json::json!({"preset": f.preset, "workers": f.workers, "blocks": f.blocks})),
            "speedup": o.speedup,
            "oracle_block_size": block_size(o),
            "balance": o.balance.name(),
            "targets": reports,
        });
        std::fs::write(j, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", j.display()))?;
        println!("json: {}", j.display());
    }
    if let Some(p) = &o.requests_log {
        std::fs::write(p, log).with_context(|| format!("writing {}", p.display()))?;
        println!("requests log: {}", p.display());
    }
    if let Some(p) = &o.plot {
        let rows: Vec<crate::demo::report::PolicyResult> = reports
            .iter()
            .map(|r| crate::demo::report::PolicyResult {
                policy: r.target.clone(),
                reuse: r.reuse,
                prediction_error: 0.0,
                prediction_exact: 0.0,
                ttft_p50_ms: r.ttft_p50_ms,
                ttft_p99_ms: r.ttft_p99_ms,
                throughput_rps: r.throughput_rps,
                requests: r.requests,
                failed: r.failed,
                per_worker: Default::default(),
                spread: None,
            })
            .collect();
        let title = format!("kvroute bench: {workload}");
        let svg = p.with_extension("svg");
        let png = p.with_extension("png");
        std::fs::write(&svg, crate::demo::plot::svg(&rows, &title, "target")?)
            .with_context(|| format!("writing {}", svg.display()))?;
        crate::demo::plot::png(&rows, &title, "target", &png)
            .with_context(|| format!("writing {}", png.display()))?;
        println!("plot: {} and {}", svg.display(), png.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_fleets_parse_or_say_why_not() {
        assert_eq!(
            Target::parse("http://h:1/").unwrap(),
            Target::Url("http://h:1".into())
        );
        assert_eq!(
            Target::parse("kvroute:group-blind").unwrap(),
            Target::Kvroute(PolicyKind::GroupBlind, None)
        );
        let pd = Target::parse("kvroute:hybrid-aware/1p3d").unwrap();
        assert_eq!(
            pd,
            Target::Kvroute(
                PolicyKind::HybridAware,
                Some(PdLayout {
                    prefill: 1,
                    decode: 3
                })
            )
        );
        assert_eq!(pd.label(), "kvroute:hybrid-aware/1p3d");
        for bad in [
            "kvroute:nope",
            "kvroute:hybrid-aware/0p4d",
            "kvroute:hybrid-aware/2p",
            "kvroute:hybrid-aware/xpyd",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
        assert!(Target::parse("h:1").is_err());
        let three = Target::parse("http://a:1+http://b:2/+https://c:3").unwrap();
        assert_eq!(
            three,
            Target::Balanced(vec![
                "http://a:1".into(),
                "http://b:2".into(),
                "https://c:3".into()
            ])
        );
        assert_eq!(three.label(), "http://a:1+http://b:2+https://c:3");
        for bad in ["http://a:1+", "http://a:1+b:2", "+http://a:1"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
        let f = FleetSpec::parse("qwen3-next,4,1000").unwrap();
        assert_eq!(
            (f.preset.as_str(), f.workers, f.blocks),
            ("qwen3-next", 4, 1000)
        );
        assert!(FleetSpec::parse("qwen3-next,4").is_err());
        assert!(FleetSpec::parse("no-such-model,4,10").is_err());
    }

    #[test]
    fn replicas_multiply_kvroute_targets_and_must_match_a_url_targets_own() {
        let with = |targets: &[&str], replicas| BenchOptions {
            targets: targets.iter().map(|t| Target::parse(t).unwrap()).collect(),
            fleet: Some(FleetSpec::parse("llama,2,0").unwrap()),
            replicas,
            ..BenchOptions::default()
        };
        assert!(validate(&with(&["kvroute:hybrid-aware"], 3)).is_ok());
        assert!(validate(&with(&["http://a:1+http://b:2+http://c:3"], 3)).is_ok());
        assert!(validate(&with(&["http://a:1+http://b:2"], 1)).is_ok());
        let err = validate(&with(&["http://a:1"], 3)).unwrap_err().to_string();
        assert!(err.contains("joined by +"), "{err}");
        let err = validate(&with(&["http://a:1+http://b:2"], 3))
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 replicas"), "{err}");
        assert!(validate(&with(&["kvroute:hybrid-aware"], 0)).is_err());
    }
}
