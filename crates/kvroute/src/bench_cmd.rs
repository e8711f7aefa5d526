//! `kvroute bench`'s command line: flags in the spellings load generators use, turned into
//! [`kvroute::bench::BenchOptions`].
//!
//! Owns: `BenchArgs` and its validation.
//! Must not: run anything itself (that is `kvroute::bench`).

use anyhow::{bail, Result};
use clap::Args;
use kvroute::bench::client::{Api, PromptFormat};
use kvroute::bench::{BenchOptions, FleetSpec, Target};
use kvroute::simfleet;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct BenchArgs {
    /// Where to send requests: a URL (kvroute, SMG, vllm-router, vLLM, a simulated worker);
    /// several URLs joined by + for the replicas of one router behind a balancer
    /// (http://a:8080+http://b:8080+http://c:8080, balanced by --balance); kvroute:POLICY
    /// (in-process gateways, --replicas of them, on a fresh --fleet); or kvroute:POLICY/PpDd
    /// (the fleet split into P prefill and D decode workers, e.g. kvroute:hybrid-aware/2p2d,
    /// served in two legs). Repeat for a side-by-side table.
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Gateway replicas of each kvroute:POLICY target, started on the same fleet, each
    /// subscribed to every worker's events as separate kvroute processes are. A URL target
    /// names its replicas itself (joined by +); with one URL this is an error.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// How a target's replicas share the requests, decided per request (no session pinning,
    /// as an L4/L7 balancer does): round-robin (request k to replica k mod N) or random
    /// (seeded by --seed).
    #[arg(long, default_value = "round-robin")]
    balance: String,
    /// The model name to request (default: the fleet's preset, else the target's first model).
    #[arg(long)]
    model: Option<String>,
    /// Start simulated workers for kvroute:POLICY targets: PRESET,WORKERS,BLOCKS (a fresh
    /// fleet for every run).
    #[arg(long)]
    fleet: Option<String>,
    /// A built-in workload: mooncake (the bundled trace), shared-prefix, multi-turn, agentic, rag,
    /// tenants (many tenants' ~3k-token system prompts, Zipf-popular, under a rising arrival
    /// rate).
    #[arg(long)]
    workload: Option<String>,
    /// A Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Tokens per trace block id (the Mooncake trace's own is 512).
    #[arg(long, default_value_t = 512)]
    tokens_per_block: usize,
    /// Longest prompt (default: the fleet model's length minus the output, else 8,192).
    #[arg(long)]
    max_prompt: Option<usize>,
    /// Output tokens per request (at most; traces give their own below this).
    #[arg(long, default_value_t = 32)]
    max_output: u32,
    /// Seed of the built-in generators.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Sessions a built-in generator makes (multi-turn conversations, agentic tasks, rag
    /// queries, shared-prefix or tenants requests): a longer or shorter run of the same
    /// workload.
    #[arg(long)]
    sessions: Option<usize>,
    /// Arrivals (and a --fleet's engine) this many times faster than the schedule.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Sessions per second: rescale the schedule to this mean arrival rate (before --speedup).
    #[arg(long)]
    rate: Option<f64>,
    /// At most this many requests in flight (a closed cap on the open loop).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Send at most this many requests per target.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Stop sending after this many seconds (wall) per target.
    #[arg(long)]
    duration: Option<f64>,
    /// tokens: token-id prompts; text: text the target tokenizes (SMG takes text only).
    #[arg(long, default_value = "tokens")]
    prompt_format: String,
    /// completions | chat
    #[arg(long, default_value = "completions")]
    api: String,
    /// The oracle's block size (default: the fleet preset's hit alignment, else 16).
    #[arg(long)]
    block_size: Option<usize>,
    /// Engine seconds per wall second behind a URL target (e.g. a simulated fleet started with
    /// --speedup S): client-measured times are multiplied by it.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Time every request by the client's clock (× --time-scale), even when the engine reports
    /// its own times: behind a disaggregated pool the decode engine's clock leaves out the
    /// prefill leg (kvroute:POLICY/PpDd targets imply it).
    #[arg(long)]
    client_clock: bool,
    /// Runs per target (targets interleaved, fresh fleets); the table shows means and ranges.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    #[arg(long)]
    json: Option<PathBuf>,
    /// One JSON line per request (target, session, turn, times, cached and oracle tokens).
    #[arg(long)]
    requests_log: Option<PathBuf>,
    /// Plot path without extension (.svg and .png).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Simulated workers behind the targets (comma-separated base URLs): every request's engine
    /// TTFT and cached tokens are read from their /admin/requests, for every target alike.
    #[arg(long, value_delimiter = ',')]
    engine_urls: Vec<String>,
    /// The in-process gateway's cost model (ttft | tokens; default ttft at --speedup 1, tokens
    /// when the fleet runs faster than real time), λ and μ (default: the gateway's own).
    #[arg(long)]
    cost: Option<kvroute::gateway::config::CostModel>,
    #[arg(long)]
    lambda: Option<f64>,
    #[arg(long)]
    junction_weight: Option<f64>,
    /// The in-process gateway's pricing of a conversation's later turns (true | false).
    #[arg(long)]
    later_turns: Option<bool>,
    /// The in-process gateway's pricing of the wait a request adds to others (true | false).
    #[arg(long)]
    delay_to_others: Option<bool>,
    /// The in-process gateway's pricing of decode interference (true | false).
    #[arg(long)]
    decode_interference: Option<bool>,
    /// The in-process gateway's pricing of the stall prefills add to decoding requests
    /// (off | later-turns | all).
    #[arg(long)]
    prefill_stall: Option<kvroute::gateway::config::PrefillStall>,
    /// The in-process gateway's pricing of the cache a placement evicts (true | false).
    #[arg(long)]
    eviction: Option<bool>,
    /// The in-process gateway's pricing of the next arrivals' wait (true | false).
    #[arg(long)]
    next_arrivals: Option<bool>,
    /// The in-process gateway's draining of queued prefill at the learned rate (true | false).
    #[arg(long)]
    queue_drain: Option<bool>,
    /// The in-process gateway's in-flight forecast (true | false).
    #[arg(long)]
    in_flight_forecast: Option<bool>,
    /// In-process replicas (--replicas above 1) share their bookings as a deployment's
    /// `[peers]` does (true, the default) or each counts only its own between engine polls.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    replica_peers: bool,
    /// Peered in-process replicas also share what their requests teach them (`[peers]
    /// learning`: true, the default) or only their bookings.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    replica_learning: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn positive_secs(v: f64, flag: &str) -> Result<Duration> {
    if v.is_finite() && v > 0.0 {
        Ok(Duration::from_secs_f64(v))
    } else {
        bail!("{flag} must be a positive number of seconds")
    }
}

impl BenchArgs {
    pub fn options(self) -> Result<BenchOptions> {
        let targets = self
            .targets
            .iter()
            .map(|t| Target::parse(t))
            .collect::<Result<Vec<_>>>()?;
        let prompt_format = match self.prompt_format.as_str() {
            "tokens" => PromptFormat::Tokens,
            "text" => PromptFormat::Text,
            other => bail!("--prompt-format {other}: use tokens or text"),
        };
        let api = match self.api.as_str() {
            "completions" => Api::Completions,
            "chat" => Api::Chat,
            other => bail!("--api {other}: use completions or chat"),
        };
        let balance = self
            .balance
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--{e}"))?;
        Ok(BenchOptions {
            targets,
            replicas: self.replicas,
            balance,
            model: self.model,
            fleet: self.fleet.as_deref().map(FleetSpec::parse).transpose()?,
            workload: self.workload,
            trace: self.trace,
            tokens_per_block: self.tokens_per_block.max(1),
            max_prompt: self.max_prompt,
            max_output: self.max_output,
            seed: self.seed,
            sessions: self.sessions,
            speedup: self.speedup,
            rate: self.rate,
            max_concurrency: self.max_concurrency,
            max_requests: self.max_requests,
            duration: self
                .duration
                .map(|d| positive_secs(d, "--duration"))
                .transpose()?,
            prompt_format,
            api,
            block_size: self.block_size,
            time_scale: self.time_scale,
            client_clock: self.client_clock,
            repeat: self.repeat,
            request_timeout: positive_secs(self.timeout, "--timeout")?,
            json: self.json,
            requests_log: self.requests_log,
            plot: self.plot,
            progress: !self.quiet,
            engine_urls: self.engine_urls,
            cost: self.cost,
            lambda: self.lambda,
            junction_weight: self.junction_weight,
            later_turns: self.later_turns,
            delay_to_others: self.delay_to_others,
            decode_interference: self.decode_interference,
            prefill_stall: self.prefill_stall,
            eviction: self.eviction,
            next_arrivals: self.next_arrivals,
            queue_drain: self.queue_drain,
            in_flight_forecast: self.in_flight_forecast,
            replica_sharing: match (self.replica_peers, self.replica_learning) {
                (false, _) => simfleet::Sharing::Isolated,
                (true, false) => simfleet::Sharing::Bookings,
                (true, true) => simfleet::Sharing::Learning,
            },
        })
    }
}
