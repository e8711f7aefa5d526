//! `kvroute sim-worker`: one simulated hybrid vLLM engine (kvroute-sim) on the real wire.
//!
//! Owns: the subcommand's flags (named after vLLM's engine arguments where they change cache
//! behaviour) and turning them into a `kvroute_sim::WorkerConfig`.
//! Must not: hold simulator logic (that is kvroute-sim).

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_index::HashAlgo;
use kvroute_sim::{PublisherConfig, ReplayLayout, WireFormat, WorkerConfig};
use std::net::SocketAddr;

#[derive(Args)]
pub struct SimWorkerArgs {
    /// Layout preset: llama, gpt-oss, gemma3, qwen3-next, nemotron-h, llama4, tiny-gemma3,
    /// tiny-nemotron-h, tiny-qwen3-next (see docs/sim.md).
    #[arg(long)]
    preset: String,
    /// HTTP address of the OpenAI-compatible API.
    #[arg(long, default_value = "127.0.0.1:8000")]
    http: SocketAddr,
    /// KV event PUB endpoint, as vLLM's kv-events `endpoint` (`tcp://*:5557` binds; a
    /// concrete host connects). DP rank r publishes on port + r. No events without it.
    #[arg(long)]
    zmq: Option<String>,
    /// Replay ROUTER endpoint (always bound), as vLLM's `replay_endpoint`.
    #[arg(long)]
    replay: Option<String>,
    /// Topic frame of every live message.
    #[arg(long, default_value = "")]
    topic: String,
    /// Pool size in blocks, null block included (vLLM's `num_gpu_blocks_override`).
    #[arg(long)]
    blocks: Option<u32>,
    /// Block size of every group (Mamba hybrids keep one size for all groups).
    #[arg(long)]
    block_size: Option<u32>,
    #[arg(long)]
    max_num_batched_tokens: Option<u32>,
    #[arg(long)]
    max_num_seqs: Option<u32>,
    #[arg(long)]
    max_model_len: Option<u32>,
    /// sha256 | sha256_cbor.
    #[arg(long, default_value = "sha256")]
    prefix_caching_hash_algo: HashAlgo,
    /// NONE_HASH seed: what vLLM takes from PYTHONHASHSEED.
    #[arg(long, default_value = kvroute_index::hash::DEFAULT_SEED)]
    hash_seed: String,
    /// vLLM's `--prefix-cache-retention-interval`: 0 (sparse, default), a multiple of the
    /// scheduler block, or `none` (dense).
    #[arg(long, default_value = "0")]
    prefix_cache_retention_interval: String,
    /// Simulated seconds per wall second.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    #[arg(long, default_value_t = 1)]
    data_parallel_size: u32,
    /// Model name served on /v1/models (default: the preset).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Batch layout: map (vLLM 0.32) | array (vLLM ≤ 0.23).
    #[arg(long, default_value = "map")]
    wire_format: WireFormat,
    /// Answer replays with the old `["", seq, payload]` layout (no topic frame).
    #[arg(long)]
    old_replay_layout: bool,
    /// Batches queued for a connected subscriber before new ones are dropped (vLLM's `hwm`).
    #[arg(long, default_value_t = kvroute_sim::publisher::DEFAULT_HWM)]
    hwm: usize,
    /// Replay buffer size in batches (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    buffer_steps: usize,
    /// The vLLM release whose prefix-cache rules and events the engine follows: 0.32 | 0.33
    /// (what `GET /version` reports).
    #[arg(long, default_value = "0.32", value_parser = parse_engine)]
    engine_version: kvroute_index::Engine,
    /// vLLM's `--speculative-config` JSON (`method`, `num_speculative_tokens`,
    /// `num_nextn_predict_layers`, `disable_lookahead_block_hashes`,
    /// `disable_eagle_block_drop`; other fields ignored), e.g.
    /// `{"method": "eagle3", "num_speculative_tokens": 3}`. On 0.33 an EAGLE-style method
    /// hashes blocks with lookahead tokens; on 0.32 its matches drop the last block.
    #[arg(long, value_parser = parse_speculative)]
    speculative_config: Option<kvroute_index::Speculative>,
    /// LoRA adapters served beside the base model, as vLLM's `--lora-modules`: `name=path`
    /// (or `{"name": …, "path": …}`), one or more. A request whose `model` is `name` runs with
    /// the adapter: its blocks hash with `("lora", name, path)` and its stores name it.
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<kvroute_sim::LoraModule>,
    /// Disaggregated serving, as vLLM's `--kv-transfer-config`:
    /// `{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}` (a prefill worker),
    /// `"kv_consumer"` (a decode worker) or `"kv_both"`; `engine_id` optional.
    #[arg(long)]
    kv_transfer_config: Option<kvroute_sim::KvTransfer>,
    /// Export each request's `llm_request` span, a child of the `traceparent` it arrived with,
    /// to this OTLP traces URL (OTLP/HTTP protobuf: `http://collector:4318/v1/traces`), as
    /// vLLM's `--otlp-traces-endpoint` does.
    #[arg(long)]
    otlp_traces_endpoint: Option<String>,
    /// A CPU tier of this many slots, as vLLM's `--kv-offloading-size` with the default
    /// `OffloadingConnector` (one chunk a GPU block; a slot holds one chunk of one group):
    /// prompt blocks are stored there as their prefill completes, evicted LRU, published with
    /// `medium = "CPU"`, and loaded back (counted in `cached_tokens`) when the tier serves
    /// more than the device. 0: none.
    #[arg(long, default_value_t = 0)]
    kv_offloading_slots: usize,
    /// The connector keeping the CPU tier: `offloading` (vLLM's `OffloadingConnector`, the
    /// default) or `simple-cpu` (its `SimpleCPUOffloadConnector`, `VLLM_USE_SIMPLE_KV_OFFLOAD=1`:
    /// a slot is a CPU block, every block the device caches is copied there, and it is looked up
    /// with the device's own rules from the device hit).
    #[arg(long, default_value = "offloading")]
    kv_offloading_connector: kvroute_index::tier::OffloadConnector,
}

fn parse_engine(s: &str) -> Result<kvroute_index::Engine, String> {
    kvroute_index::Engine::from_version(s)
        .or_else(|| s.parse().ok())
        .ok_or_else(|| format!("unsupported engine version {s:?} (0.32 or 0.33)"))
}

fn parse_speculative(s: &str) -> Result<kvroute_index::Speculative, String> {
    serde_json::from_str(s).map_err(|e| format!("--speculative-config: {e}"))
}

fn config(a: &SimWorkerArgs) -> Result<WorkerConfig> {
    let mut cfg = WorkerConfig::for_preset(&a.preset)?;
    let e = &mut cfg.engine;
    if let Some(b) = a.block_size {
        e.spec = e.spec.clone().with_block_size(b);
    }
    if let Some(n) = a.blocks {
        e.num_blocks = n;
    }
    if let Some(n) = a.max_num_batched_tokens {
        e.max_num_batched_tokens = n;
    }
    if let Some(n) = a.max_num_seqs {
        e.max_num_seqs = n;
    }
    if let Some(n) = a.max_model_len {
        e.max_model_len = n;
    }
    e.hash_algo = a.prefix_caching_hash_algo;
    e.hash_seed = a.hash_seed.clone();
    e.retention = match a.prefix_cache_retention_interval.as_str() {
        "none" | "None" => None,
        s => Some(s.parse().context("--prefix-cache-retention-interval")?),
    };
    e.engine = a.engine_version;
    e.speculative = a.speculative_config.clone();
    e.cpu_tier_slots = a.kv_offloading_slots;
    e.cpu_tier_connector = a.kv_offloading_connector;
    e.spec.params()?;
    cfg.lora_modules = a.lora_modules.clone();
    cfg.kv_transfer = a.kv_transfer_config.clone();
    if let Some(url) = &a.otlp_traces_endpoint {
        kvroute::gateway::config::otel::check_endpoint(url)
            .map_err(|e| anyhow::anyhow!("--otlp-traces-endpoint: {e}"))?;
    }
    cfg.otlp_traces_endpoint = a.otlp_traces_endpoint.clone();
    if let Some(name) = &a.served_model_name {
        cfg.model = name.clone();
    }
    cfg.speedup = a.speedup;
    cfg.data_parallel_size = a.data_parallel_size;
    cfg.zmq = match &a.zmq {
        Some(ep) => Some(PublisherConfig {
            endpoint: ep.clone(),
            replay_endpoint: a.replay.clone(),
            topic: a.topic.clone(),
            buffer_steps: a.buffer_steps,
            format: a.wire_format,
            replay_layout: if a.old_replay_layout {
                ReplayLayout::Old
            } else {
                ReplayLayout::WithTopic
            },
            dp_rank: 0,
            hwm: a.hwm,
        }),
        None if a.replay.is_some() => bail!("--replay needs --zmq"),
        None => None,
    };
    Ok(cfg)
}

pub async fn run(a: SimWorkerArgs) -> Result<()> {
    let cfg = config(&a)?;
    let name = cfg.model.clone();
    let h = kvroute_sim::start_worker(&name, cfg, a.http)
        .await
        .with_context(|| format!("starting the simulated worker on {}", a.http))?;
    eprintln!(
        "kvroute sim-worker {}: http {} zmq {:?} replay {:?}",
        a.preset, h.base_url, h.zmq, h.replay
    );
    tokio::signal::ctrl_c().await?;
    Ok(())
}
