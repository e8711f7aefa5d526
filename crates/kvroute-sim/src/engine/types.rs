//! What goes into and comes out of the simulated engine: its arguments ([`EngineConfig`],
//! named after vLLM's), a submitted request ([`NewRequest`], with a decode worker's
//! [`RemoteKv`] and a [`Lora`] adapter), and each step's outcome ([`StepOutcome`]: the
//! [`TokenOut`]s, each finished request's [`Finished`] figures, the hits [`Lookup`]) and
//! counters ([`EngineStats`]).
//! Invariants: plain data; a preset's defaults are its [`crate::spec::ModelSpec`]'s (blocks,
//! model length) and the simulator's (2,048 batched tokens a step, 256 sequences).
//! Must not: hold engine state or behaviour.

use crate::error::SimError;
use crate::spec::ModelSpec;
use crate::timing::TimeModel;
use crate::vllm_rules::SpecRules;
use kvroute_index::hash::{self, HashAlgo};
use kvroute_index::tier::OffloadConnector;
use kvroute_index::{Event, Speculative, WorkerId};

/// Engine arguments (named after vLLM's where they exist).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub spec: ModelSpec,
    /// `num_gpu_blocks_override` (null block included).
    pub num_blocks: u32,
    pub max_num_batched_tokens: u32,
    pub max_num_seqs: u32,
    pub max_model_len: u32,
    pub hash_algo: HashAlgo,
    /// NONE_HASH seed (`PYTHONHASHSEED`, else vLLM's default).
    pub hash_seed: String,
    /// `--prefix-cache-retention-interval` (`Some(0)` default sparse, `None` dense).
    pub retention: Option<u32>,
    /// Mamba layers export prefill checkpoints in-pass (Mamba2); GDN layers do not.
    pub prefill_checkpoints: bool,
    pub time: TimeModel,
    pub worker: WorkerId,
    pub dp_rank: u32,
    /// The vLLM generation whose prefix-cache rules the engine follows.
    pub engine: kvroute_index::Engine,
    /// `--speculative-config` (its prefix-caching fields); `None` without speculation. No
    /// draft token is ever accepted: a step decodes one token per request.
    pub speculative: Option<Speculative>,
    /// Slots of a CPU tier (`OffloadingConnector`: one GPU block a chunk, one slot per chunk
    /// and group; `SimpleCPUOffloadConnector`: CPU blocks); 0: none.
    pub cpu_tier_slots: usize,
    /// The connector keeping the CPU tier.
    pub cpu_tier_connector: OffloadConnector,
}

impl EngineConfig {
    /// A preset's defaults.
    pub fn for_preset(name: &str) -> Result<EngineConfig, SimError> {
        let spec = crate::spec::preset(name)?;
        Ok(EngineConfig {
            num_blocks: spec.default_blocks,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: spec.max_model_len,
            hash_algo: HashAlgo::Sha256,
            hash_seed: hash::DEFAULT_SEED.to_string(),
            retention: Some(0),
            prefill_checkpoints: name.contains("nemotron"),
            time: TimeModel::default(),
            worker: "sim".into(),
            dp_rank: 0,
            engine: kvroute_index::Engine::Vllm032,
            speculative: None,
            cpu_tier_slots: 0,
            cpu_tier_connector: OffloadConnector::Offloading,
            spec,
        })
    }

    /// The prefix-cache rules of this generation and speculative setting: the lookahead count
    /// `L` (vLLM 0.33's `num_hash_lookahead_tokens`), whether matches drop the EAGLE block and
    /// whether the drafter's groups are flagged (the simulator's own reading of vLLM:
    /// `vllm_rules`).
    pub fn rules(&self) -> SpecRules {
        match (&self.speculative, self.cpu_tier_slots > 0) {
            // vLLM hashes no lookahead token beside a KV connector (its
            // `num_hash_lookahead_tokens` is 0 then): 0.33 falls back to the block drop.
            (Some(s), true) => {
                let mut s = s.clone();
                s.disable_lookahead_block_hashes = true;
                SpecRules::of(self.engine, Some(&s))
            }
            (s, _) => SpecRules::of(self.engine, s.as_ref()),
        }
    }
}

/// A request as submitted.
#[derive(Clone, Debug, Default)]
pub struct NewRequest {
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Emit exactly these tokens (then deterministic ones if `max_tokens` is larger).
    pub forced_output: Option<Vec<u32>>,
    pub cache_salt: Option<String>,
    /// Requests that skip reading the prefix cache (prompt logprobs) hit 0.
    pub skip_prefix_cache: bool,
    /// The LoRA adapter the request runs with: its blocks hash with `("lora", name, path)`
    /// and its stores name it.
    pub lora: Option<Lora>,
    /// Disaggregated decode: the prompt's KV comes from a prefill worker.
    pub remote_kv: Option<RemoteKv>,
}

/// A decode worker's request whose prompt was prefilled elsewhere (vLLM's
/// `do_remote_prefill`): at its first scheduling the tokens beyond the local hit, but the last,
/// are pulled (at `kv_transfer_token_s` each, beside the steps) instead of computed; the last
/// token is computed to produce the first output. The request reports the prefill worker's
/// cached tokens as its own, as vLLM's decode worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteKv {
    /// The prefill worker's `num_cached_tokens` (`remote_prefill_cached_tokens`).
    pub cached_tokens: usize,
}

/// A LoRA adapter as vLLM's `LoRARequest` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lora {
    /// `lora_name`: what requests ask for as their `model`.
    pub name: String,
    /// `lora_path`, as given to `--lora-modules` (part of the block hash).
    pub path: String,
    /// `lora_int_id`: 1, 2, … in the order the adapters were loaded (`BlockStored.lora_id`).
    pub id: i64,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    pub handle: u64,
    pub token: u32,
    /// The request's `num_cached_tokens` (its hit at first scheduling).
    pub num_cached_tokens: usize,
    pub finished: Option<Finished>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Simulated seconds from arrival to the first token and to the last.
    pub ttft_s: f64,
    pub e2e_s: f64,
    pub preemptions: u32,
}

/// A prefix-cache lookup made during a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    pub handle: u64,
    /// How many of the step's events had been emitted when the lookup ran.
    pub event_pos: usize,
    /// The request's length at lookup (prompt, plus outputs after a preemption).
    pub num_tokens: usize,
    /// The device's hit.
    pub hit: usize,
    /// What the CPU tier serves beyond `hit` (the request reports `hit + tier` cached).
    pub tier: usize,
}

/// What one step did.
#[derive(Clone, Debug, Default)]
pub struct StepOutcome {
    pub events: Vec<Event>,
    /// Every lookup, in order.
    pub lookups: Vec<Lookup>,
    pub tokens: Vec<TokenOut>,
    /// Simulated duration of the step.
    pub duration_s: f64,
    /// Tokens scheduled (vLLM's `num_scheduled_tokens`), padded draft rows included.
    pub scheduled_tokens: usize,
}

/// Engine-wide counters (vLLM metric names in the HTTP layer).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Prompt tokens loaded from the CPU tier (vLLM's `external_prefix_cache_hits`).
    pub tier_hits: u64,
    pub preemptions: u64,
    pub steps: u64,
    pub finished: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
}
