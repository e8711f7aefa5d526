//! The `kvroute` command line: subcommands over the index, the wire and the conformance check.
//!
//! Owns: argument parsing (clap) and exit codes. Errors surface through `anyhow` with context.
//! Must not: hold logic that a library crate should own.

use kvroute::gateway::config::{file::GatewayConfig, KvEventsSpec, WorkerSpec};
use kvroute::gateway::{reload, Gateway};
use kvroute::{capture, conformance, events, explain, tokens};
use kvroute_route::PolicyKind;

mod bench_cmd;
mod sim;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use kvroute_index::HashAlgo;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware router for hybrid LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct HashArgs {
    /// vLLM's --prefix-caching-hash-algo (sha256 | sha256_cbor).
    #[arg(long = "algo", alias = "hash-algo", default_value = "sha256")]
    algo: HashAlgo,
    /// NONE_HASH seed: the engine's PYTHONHASHSEED, else vLLM's default.
    #[arg(long, default_value = kvroute_index::hash::DEFAULT_SEED)]
    seed: String,
    /// Hash block size (vLLM's --prefix-match-unit); derived from the events when absent.
    #[arg(long)]
    hash_block_size: Option<u32>,
    /// Chunk size of chunked local attention groups.
    #[arg(long)]
    chunk_size: Option<u32>,
    /// Key blocks by the router's own content keys (SGLang, xxhash engines).
    #[arg(long)]
    content_keys: bool,
    /// The engine runs speculative decoding (EAGLE/MTP): every group drops its last matched unit.
    #[arg(long)]
    eagle: bool,
}

impl HashArgs {
    fn settings(&self) -> explain::HashSettings {
        explain::HashSettings {
            algo: self.algo,
            seed: self.seed.clone(),
            hash_block_size: self.hash_block_size,
            chunk_size: self.chunk_size,
            content_keys: self.content_keys,
            eagle: self.eagle,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Print vLLM's block hashes for a token list: index, 64-bit value, full digest.
    Hash {
        #[command(flatten)]
        hash: HashArgs,
        /// cache_salt of the request.
        #[arg(long)]
        salt: Option<String>,
        /// vLLM 0.33's num_hash_lookahead_tokens: each block's hash covers the N tokens after it.
        #[arg(long, default_value_t = 0)]
        lookahead: usize,
        /// Token ids: `1,2,3`, ranges `0..40`, or `@FILE`.
        #[arg(long)]
        tokens: String,
    },
    /// Apply a file of normalized events and explain the prediction for a request.
    Explain {
        /// Normalized events, JSON lines (see docs/events.md; `kvroute events decode` writes them).
        #[arg(long, required_unless_present = "gateway")]
        events: Option<PathBuf>,
        /// Ask a running gateway's admin API instead (e.g. http://127.0.0.1:8081).
        #[arg(long, conflicts_with = "events")]
        gateway: Option<String>,
        /// Bearer token of the gateway's admin API.
        #[arg(long, env = "KVROUTE_ADMIN_TOKEN")]
        token: Option<String>,
        #[arg(long)]
        tokens: String,
        #[arg(long)]
        salt: Option<String>,
        /// Only this worker.
        #[arg(long)]
        worker: Option<String>,
        #[command(flatten)]
        hash: HashArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Engine event tools.
    Events {
        #[command(subcommand)]
        cmd: EventsCmd,
    },
    /// Run the gateway: an OpenAI-compatible router in front of a fleet.
    Serve(ServeArgs),
    /// Simulated hybrid fleet + gateway + the bundled Mooncake trace, once per policy: a table and a plot.
    Demo(DemoArgs),
    /// Replay a workload against OpenAI-compatible targets (kvroute, SMG, vllm-router, vLLM) and
    /// compare reuse, the arrival-time oracle, TTFT and throughput side by side.
    Bench(bench_cmd::BenchArgs),
    /// Run a simulated hybrid vLLM engine (kvroute-sim): real KV events and OpenAI API.
    SimWorker(sim::SimWorkerArgs),
    /// Replay recorded corpora and check every prediction against the engine's own hit.
    Conformance {
        /// Corpus directories (kvroute-conformance/1).
        dirs: Vec<PathBuf>,
        /// Also print requests that pass.
        #[arg(long, short)]
        verbose: bool,
        /// Write the per-corpus report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also replay every corpus into the literal reference model and check its hits.
        #[arg(long)]
        reference: bool,
    },
}

#[derive(Args)]
struct DemoArgs {
    /// Simulator preset of every worker (see `kvroute sim-worker --help`).
    #[arg(long, default_value = "qwen3-next")]
    preset: String,
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// KV cache blocks per worker (num_gpu_blocks_override); 0 = the preset's default.
    #[arg(long, default_value_t = 300)]
    blocks: usize,
    /// A Mooncake-format JSONL trace (default: the bundled one).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Engine time runs this many times faster than wall time (trace arrivals compressed alike).
    #[arg(long, default_value_t = 80.0)]
    speed: f64,
    /// Tokens per trace block id (the trace's own unit is 512).
    #[arg(long, default_value_t = 136)]
    tokens_per_block: usize,
    /// Keep requests whose first block id is a multiple of this (whole prefix families stay).
    #[arg(long, default_value_t = 4)]
    sample: u64,
    #[arg(long, default_value_t = 1000)]
    max_requests: usize,
    #[arg(long, default_value_t = 32)]
    max_output: u32,
    /// Policies to compare, comma-separated.
    #[arg(
        long,
        default_value = "hybrid-aware,group-blind,round-robin,least-load",
        value_delimiter = ','
    )]
    policies: Vec<PolicyKind>,
    /// λ in `expected_uncached + λ·load − μ·junction`.
    #[arg(long, default_value_t = 0.25)]
    lambda: f64,
    /// μ: credit per full-attention prefix token beyond the hit (a junction checkpoint to be);
    /// 0, the gateway's default, credits none.
    #[arg(long, default_value_t = 0.0)]
    junction_weight: f64,
    /// Arrivals this many times denser than the trace's (more load in engine time).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Runs per policy (fresh fleets, policies interleaved): the table shows the means and how
    /// far the runs moved.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Disaggregated layouts (`PpDd`, P + D = --workers; comma-separated) to run the first of
    /// --policies on as well: P prefill workers (NixlConnector KV producers) and D decode
    /// workers. Their TTFT is both legs' engine time, the KV pull included.
    #[arg(long, value_delimiter = ',', value_parser = parse_pd_layout)]
    pd: Vec<kvroute::simfleet::PdLayout>,
    /// Also write the table as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write one JSON line per request and policy (worker, predicted and engine-reported
    /// cached tokens, TTFT, the gateway's decision evidence).
    #[arg(long)]
    requests_log: Option<PathBuf>,
    /// Plot path without extension (.svg and .png are written).
    #[arg(long, default_value = "kvroute-demo")]
    plot: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args, Clone)]
struct ServeArgs {
    /// TOML configuration (see docs/operations.md); flags below override it. SIGHUP or
    /// `POST /admin/reload` reads it again (the flags still override it).
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    #[arg(long)]
    admin_listen: Option<std::net::SocketAddr>,
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN")]
    admin_token: Option<String>,
    /// Another replica of this gateway in front of the same fleet, by its admin URL
    /// (`http://host:port`; repeat for each): this replica announces the requests it has in
    /// flight to them, and counts theirs (`[peers]` in the configuration).
    #[arg(long = "peer")]
    peers: Vec<String>,
    /// This replica's name in what it announces (default: $HOSTNAME, else a random one).
    #[arg(long)]
    replica_name: Option<String>,
    /// hybrid-aware | group-blind | round-robin | least-load
    #[arg(long)]
    policy: Option<PolicyKind>,
    /// The cache policies' cost: ttft (predicted time to first token, learned per worker) or
    /// tokens (`expected_uncached + λ·load − μ·junction`).
    #[arg(long)]
    cost: Option<kvroute::gateway::config::CostModel>,
    /// λ in `expected_uncached + λ·load − μ·junction` (cost model tokens).
    #[arg(long)]
    lambda: Option<f64>,
    /// Cost model ttft: price the wait a worker's load adds to the conversation's later turns
    /// (true, the default) or rank by this request's TTFT alone (false).
    #[arg(long)]
    later_turns: Option<bool>,
    /// Cost model ttft: price the wait a request's own prefill adds to the requests queuing
    /// behind it on the worker (true, the default) or leave it out (false).
    #[arg(long)]
    delay_to_others: Option<bool>,
    /// Cost model ttft: price the decode slowdown a request and the requests running on the
    /// worker cause each other (true, the default) or leave it out (false).
    #[arg(long)]
    decode_interference: Option<bool>,
    /// Cost model ttft: which prefills pay the end-to-end latency they add to the requests
    /// decoding on the worker: a new conversation's later turns (later-turns, the default),
    /// also each request's own (all), or none (off).
    #[arg(long)]
    prefill_stall: Option<kvroute::gateway::config::PrefillStall>,
    /// Cost model ttft: price the prefill later requests spend on what a placement pushes out
    /// of the worker's pool, at the worker's learned re-prefill rate (true) or leave it out
    /// (false, the default).
    #[arg(long)]
    eviction: Option<bool>,
    /// Cost model ttft: price the wait a placement adds to the requests reaching the fleet
    /// while its least-loaded worker drains (true) or leave it out (false, the default).
    #[arg(long)]
    next_arrivals: Option<bool>,
    /// The prefill queued on a worker drains at its learned prefill rate (true, the default)
    /// or counts whole until each request's first byte (false).
    #[arg(long)]
    queue_drain: Option<bool>,
    /// Hybrid-aware: count the prompts in flight on a worker as what it will hold (true, the
    /// default) or rank by what the index holds now (false).
    #[arg(long)]
    in_flight_forecast: Option<bool>,
    /// Cost model ttft: µs to load one token's KV from a worker's CPU tier (default 5).
    #[arg(long)]
    cpu_load_us_per_token: Option<f64>,
    /// μ: credit per full-attention prefix token beyond the hit (hybrid-aware).
    #[arg(long)]
    junction_weight: Option<f64>,
    /// A worker: `name=w0,url=http://127.0.0.1:8000,model=m[,events=tcp://*:5557][,replay=tcp://*:5558]
    /// [,topic=kv][,dp=2][,hash_algo=sha256_cbor][,hash_seed=S][,content_keys=true]
    /// [,idle_reconnect_secs=30]` (repeatable).
    #[arg(long = "worker")]
    workers: Vec<String>,
    /// Attach the routing decision to every response.
    #[arg(long)]
    explain_always: bool,
    /// Write the index here on shutdown and periodically, and load it at start (a warm
    /// restart).
    #[arg(long)]
    snapshot_path: Option<PathBuf>,
    /// Seconds between periodic snapshots (0: at shutdown only).
    #[arg(long)]
    snapshot_interval_secs: Option<f64>,
    /// On SIGTERM or Ctrl-C: how long in-flight requests may take to finish, seconds.
    #[arg(long)]
    shutdown_timeout_secs: Option<f64>,
    /// Export OpenTelemetry traces over OTLP to this URL, used as given
    /// (`http://collector:4318/v1/traces`, or `http://collector:4317` with the protocol `grpc`,
    /// as vLLM's `--otlp-traces-endpoint`); beats the file's `[tracing]` and the
    /// `OTEL_EXPORTER_OTLP_*` environment. Without any: tracing is off.
    #[arg(long)]
    otlp_traces_endpoint: Option<String>,
    /// Read the file, lay the flags over it and validate the result as a start does (the
    /// tracing environment too), then exit (0: valid) without binding a port or reaching a
    /// worker.
    #[arg(long)]
    check_config: bool,
}

fn parse_pd_layout(s: &str) -> Result<kvroute::simfleet::PdLayout> {
    kvroute::simfleet::PdLayout::parse(s)
}

fn parse_worker(s: &str) -> Result<WorkerSpec> {
    let mut w = WorkerSpec::new("", "", "");
    let mut kv: Option<KvEventsSpec> = None;
    for part in s.split(',') {
        let Some((k, v)) = part.split_once('=') else {
            bail!("worker {s:?}: expected key=value, got {part:?}")
        };
        let v = v.trim().to_string();
        let ev = || KvEventsSpec::new("");
        match k.trim() {
            "name" => w.name = v,
            "url" => w.url = v,
            "model" => w.model = v,
            "events" => kv.get_or_insert_with(ev).endpoint = v,
            "replay" => kv.get_or_insert_with(ev).replay_endpoint = Some(v),
            "topic" => kv.get_or_insert_with(ev).topic = v,
            "host" => kv.get_or_insert_with(ev).host = Some(v),
            "dialect" => kv.get_or_insert_with(ev).dialect = v,
            "idle_reconnect_secs" => kv.get_or_insert_with(ev).idle_reconnect_secs = v.parse()?,
            "dp" | "dp_size" => w.dp_size = v.parse()?,
            "hash_algo" => w.hash_algo = v,
            "hash_seed" => w.hash_seed = Some(v),
            "hash_block_size" => w.hash_block_size = Some(v.parse()?),
            "chunk_size" => w.chunk_size = Some(v.parse()?),
            "offload_chunk_blocks" => w.offload_chunk_blocks = Some(v.parse()?),
            "offload_connector" => w.offload_connector = v.parse()?,
            "content_keys" => w.content_keys = v.parse()?,
            "speculative" | "eagle" => w.speculative = v.parse()?,
            "model_dir" => w.model_dir = Some(v.into()),
            other => w
                .set_flag(other, &v)
                .map_err(|e| anyhow::anyhow!("worker {s:?}: {e}"))?,
        }
    }
    if let Some(k) = &kv {
        if k.endpoint.is_empty() {
            bail!("worker {s:?}: replay/topic given without events=");
        }
    }
    w.kv_events = kv;
    w.validate().map_err(anyhow::Error::msg)?;
    Ok(w)
}

async fn serve(a: ServeArgs) -> Result<()> {
    let mut cfg = match &a.config {
        Some(p) => toml::from_str::<GatewayConfig>(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
        None => GatewayConfig::default(),
    };
    apply_flags(&mut cfg, &a)?;
    if let Some(p) = &a.config {
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    }
    if a.check_config {
        cfg.validate().map_err(anyhow::Error::msg)?;
        kvroute::gateway::otel::export::resolve(cfg.tracing.as_ref(), |k| std::env::var(k).ok())?;
        eprintln!("configuration valid");
        return Ok(());
    }
    let handle = Gateway::start(cfg).await?;
    // Installed before the address is printed: from then on SIGHUP reloads, never terminates.
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    if let Some(path) = a.config.clone() {
        // A reload reads the file again and lays the same flags over it.
        let flags = a.clone();
        let overlay: reload::Overlay = std::sync::Arc::new(move |c: &mut GatewayConfig| {
            apply_flags(c, &flags).map_err(|e| format!("{e:#}"))
        });
        handle.state.reloader.set_source(reload::ConfigSource {
            path,
            overlay: Some(overlay),
        });
    }
    eprintln!(
        "kvroute listening on http://{} (admin http://{})",
        handle.addr, handle.admin_addr
    );
    let stop = stop_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            r = &mut stop => {
                r?;
                break;
            }
            _ = hangup.recv() => {
                // SIGHUP: the same reload as `POST /admin/reload`; a rejection is logged.
                if let Ok(report) = reload::reload(&handle.state).await {
                    eprintln!("configuration reloaded: {}", serde_json::to_string(&report)?);
                }
            }
        }
    }
    eprintln!("kvroute shutting down: finishing in-flight requests, writing the snapshot");
    handle.shutdown().await;
    Ok(())
}

/// The command-line flags laid over the configuration file (at start and on every reload).
fn apply_flags(cfg: &mut GatewayConfig, a: &ServeArgs) -> Result<()> {
    if let Some(l) = a.listen {
        cfg.listen = l;
    }
    if let Some(l) = a.admin_listen {
        cfg.admin_listen = l;
    }
    if a.admin_token.is_some() {
        cfg.admin_token = a.admin_token.clone().map(Into::into);
    }
    if !a.peers.is_empty() {
        cfg.peers.urls = a.peers.clone();
    }
    if a.replica_name.is_some() {
        cfg.peers.name = a.replica_name.clone();
    }
    if let Some(p) = a.policy {
        cfg.policy = p;
    }
    if let Some(l) = a.lambda {
        cfg.weights.lambda = l;
    }
    if let Some(j) = a.junction_weight {
        cfg.weights.junction = j;
    }
    if let Some(c) = a.cost {
        cfg.weights.cost = c;
    }
    if let Some(l) = a.later_turns {
        cfg.weights.later_turns = l;
    }
    if let Some(d) = a.delay_to_others {
        cfg.weights.delay_to_others = d;
    }
    if let Some(d) = a.decode_interference {
        cfg.weights.decode_interference = d;
    }
    if let Some(p) = a.prefill_stall {
        cfg.weights.prefill_stall = p;
    }
    if let Some(e) = a.eviction {
        cfg.weights.eviction = e;
    }
    if let Some(n) = a.next_arrivals {
        cfg.weights.next_arrivals = n;
    }
    if let Some(q) = a.queue_drain {
        cfg.weights.queue_drain = q;
    }
    if let Some(f) = a.in_flight_forecast {
        cfg.weights.in_flight_forecast = f;
    }
    if let Some(us) = a.cpu_load_us_per_token {
        cfg.weights.cpu_load_us_per_token = us;
    }
    cfg.explain_always |= a.explain_always;
    if a.snapshot_path.is_some() {
        cfg.snapshot_path = a.snapshot_path.clone();
    }
    if let Some(v) = a.snapshot_interval_secs {
        cfg.snapshot_interval_secs = v;
    }
    if let Some(v) = a.shutdown_timeout_secs {
        cfg.shutdown_timeout_secs = v;
    }
    if let Some(url) = &a.otlp_traces_endpoint {
        cfg.tracing
            .get_or_insert_with(Default::default)
            .otlp_traces_endpoint = Some(url.clone());
    }
    for w in &a.workers {
        cfg.workers.push(parse_worker(w)?);
    }
    Ok(())
}

/// Waits for Ctrl-C, or SIGTERM where there are Unix signals (what a process manager sends).
async fn stop_signal() -> Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await?;
        Ok(())
    }
}

async fn explain_remote(
    url: &str,
    token: Option<&str>,
    tokens: Vec<u32>,
    salt: Option<String>,
) -> Result<()> {
    let client = reqwest::Client::new();
    let mut req = client
        .post(format!("{}/admin/explain", url.trim_end_matches('/')))
        .json(&serde_json::json!({"tokens": tokens, "cache_salt": salt}));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await?;
    if !status.is_success() {
        bail!("gateway answered {status}: {body}");
    }
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(())
}

#[derive(Subcommand)]
enum EventsCmd {
    /// Record an engine's raw event messages as JSON lines (the corpus frame format).
    Capture {
        /// Where to subscribe: `tcp://HOST:PORT` (connect) or, with --bind, the address to bind.
        #[arg(long)]
        endpoint: String,
        #[arg(long)]
        bind: bool,
        /// The engine's replay endpoint: capture its buffered history first.
        #[arg(long)]
        replay: Option<String>,
        #[arg(long, default_value = "")]
        topic: String,
        /// Worker name written into each line.
        #[arg(long, default_value = "w0")]
        worker: String,
        #[arg(long)]
        out: PathBuf,
        /// Stop after this many messages.
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this many seconds.
        #[arg(long)]
        seconds: Option<f64>,
    },
    /// Decode captured raw messages into normalized events (JSON lines on stdout; counts on stderr).
    Decode {
        file: PathBuf,
        /// vllm | sglang
        #[arg(long, default_value = "vllm")]
        dialect: String,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    // Long-running services log their lifecycle; one-shot tools only warnings. RUST_LOG wins.
    let default_level = if matches!(cli.cmd, Cmd::Serve(_) | Cmd::SimWorker(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match cli.cmd {
        Cmd::Hash {
            hash,
            salt,
            lookahead,
            tokens,
        } => {
            let toks = tokens::parse_tokens(&tokens)?;
            explain::hash(&toks, &hash.settings(), salt, lookahead, &mut out)
        }
        Cmd::Explain {
            events,
            gateway,
            token,
            tokens,
            salt,
            worker,
            hash,
            json,
        } => {
            let toks = tokens::parse_tokens(&tokens)?;
            match (events, gateway) {
                (_, Some(url)) => explain_remote(&url, token.as_deref(), toks, salt).await,
                (Some(ev), None) => explain::explain(
                    &ev,
                    toks,
                    salt,
                    worker.as_deref(),
                    &hash.settings(),
                    json,
                    &mut out,
                ),
                (None, None) => bail!("give --events FILE or --gateway URL"),
            }
        }
        Cmd::Serve(a) => serve(a).await,
        Cmd::Demo(a) => {
            let opts = kvroute::demo::DemoOptions {
                preset: a.preset,
                workers: a.workers,
                blocks: a.blocks,
                trace: a.trace,
                speedup: a.speed,
                tokens_per_block: a.tokens_per_block,
                sample: a.sample,
                max_requests: a.max_requests,
                max_output: a.max_output,
                policies: a.policies,
                json: a.json,
                requests_log: a.requests_log,
                plot: a.plot,
                progress: !a.quiet,
                lambda: a.lambda,
                junction_weight: a.junction_weight,
                rate: a.rate,
                repeat: a.repeat,
                pd: a.pd,
            };
            kvroute::demo::run(opts).await.map(|_| ())
        }
        Cmd::Bench(a) => kvroute::bench::run(a.options()?).await.map(|_| ()),
        Cmd::SimWorker(a) => sim::run(a).await,
        Cmd::Events {
            cmd:
                EventsCmd::Capture {
                    endpoint,
                    bind,
                    replay,
                    topic,
                    worker,
                    out: path,
                    count,
                    seconds,
                },
        } => {
            let n = capture::capture(capture::CaptureOptions {
                endpoint,
                bind,
                replay,
                topic,
                worker,
                out: path.clone(),
                count,
                duration: seconds.map(std::time::Duration::from_secs_f64),
            })
            .await?;
            eprintln!("{n} messages written to {}", path.display());
            Ok(())
        }
        Cmd::Events {
            cmd: EventsCmd::Decode { file, dialect },
        } => {
            let Some(d) = kvroute_wire::Dialect::parse(&dialect) else {
                bail!("unknown dialect {dialect:?} (vllm | sglang)");
            };
            events::decode_file(&file, d, &mut out, &mut std::io::stderr())?;
            Ok(())
        }
        Cmd::Conformance {
            dirs,
            verbose,
            json,
            reference,
        } => {
            if dirs.is_empty() {
                bail!("name at least one corpus directory");
            }
            let (mut passed, mut failed) = (0, 0);
            let mut reports = Vec::new();
            for d in &dirs {
                let options = conformance::CheckOptions { reference };
                let r = conformance::run_corpus_with(d, &mut out, verbose, options)?;
                use std::io::Write;
                writeln!(
                    out,
                    "{}: {} requests, {} passed, {} failed; a group-blind predictor would be wrong on {} ({} too high); hash check {} matched, {} mismatched; {} events dropped",
                    r.corpus, r.requests, r.passed, r.failed, r.group_blind_wrong, r.group_blind_over, r.hash_check_matched, r.hash_check_mismatched, r.dropped_events
                )?;
                if r.tier_checked > 0 {
                    writeln!(
                        out,
                        "{}: tier part checked on {} requests ({} served from a tier)",
                        r.corpus, r.tier_checked, r.tier_served
                    )?;
                }
                if reference {
                    writeln!(
                        out,
                        "{}: reference model checked on {} requests, {} wrong",
                        r.corpus, r.reference_checked, r.reference_failed
                    )?;
                }
                passed += r.passed;
                failed += r.failed;
                reports.push(r);
            }
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&reports)?)?;
            }
            use std::io::Write;
            writeln!(out, "{passed} passed, {failed} failed")?;
            if failed > 0 {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
