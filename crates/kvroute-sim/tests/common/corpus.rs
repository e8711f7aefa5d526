//! Reading committed conformance corpora (`kvroute-conformance/1`, `conformance/corpus/`) for
//! the simulator's agreement tests: the metadata, the recorded frames and requests, and the
//! simulator configuration that reproduces the recorded engine.

use base64::Engine as _;
use kvroute_index::hash::HashAlgo;
use kvroute_index::Event;
use kvroute_sim::EngineConfig;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
pub struct Meta {
    pub model_config: serde_json::Value,
    pub engine_args: serde_json::Value,
    pub hash_algo: String,
    pub none_hash_seed: String,
    /// The LoRA adapters the engine served, in load order (`lora_int_id` 1, 2, …).
    #[serde(default)]
    pub lora_modules: Vec<LoraModuleLine>,
}

#[derive(Deserialize)]
pub struct LoraModuleLine {
    pub name: String,
    pub path: String,
}

#[derive(Deserialize)]
pub struct FrameLine {
    pub worker: String,
    pub frames: Vec<String>,
}

#[derive(Deserialize)]
pub struct RequestLine {
    pub id: String,
    pub worker: String,
    pub after_frame: usize,
    pub prompt_token_ids: Vec<u32>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    pub output_token_ids: Vec<u32>,
    pub num_cached_tokens: usize,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub lora_path: Option<String>,
    #[serde(default)]
    pub lora_id: Option<i64>,
}

impl RequestLine {
    /// The adapter the request ran with.
    pub fn lora(&self) -> Option<kvroute_sim::Lora> {
        Some(kvroute_sim::Lora {
            name: self.lora_name.clone()?,
            path: self.lora_path.clone()?,
            id: self.lora_id?,
        })
    }
}

/// One corpus, read whole.
pub struct Corpus {
    pub name: String,
    pub meta: Meta,
    pub frames: Vec<FrameLine>,
    pub requests: Vec<RequestLine>,
}

impl Corpus {
    /// The corpus's workers, sorted.
    pub fn workers(&self) -> Vec<String> {
        let mut w: Vec<String> = self.requests.iter().map(|r| r.worker.clone()).collect();
        w.sort();
        w.dedup();
        w
    }
}

pub fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/corpus")
}

/// The names of every committed corpus (a directory with a `meta.json`), sorted.
pub fn all_corpora() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(corpus_root())
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().join("meta.json").exists())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(p: &Path) -> Vec<T> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// Reads a committed corpus; `None` when it is not committed.
pub fn load(name: &str) -> Option<Corpus> {
    let dir = corpus_root().join(name);
    let meta = std::fs::read(dir.join("meta.json")).ok()?;
    Some(Corpus {
        name: name.to_string(),
        meta: serde_json::from_slice(&meta).unwrap_or_else(|e| panic!("{name}: {e}")),
        frames: read_jsonl(&dir.join("frames.jsonl")),
        requests: read_jsonl(&dir.join("requests.jsonl")),
    })
}

fn arg(meta: &Meta, key: &str) -> Option<u64> {
    meta.engine_args.get(key).and_then(|v| v.as_u64())
}

/// The simulator preset of the corpus's model.
pub fn preset_of(meta: &Meta) -> &'static str {
    let arch = meta.model_config["architectures"][0].as_str().unwrap_or("");
    match arch {
        "Gemma3ForCausalLM" => "tiny-gemma3",
        "NemotronHForCausalLM" => "tiny-nemotron-h",
        "Qwen3NextForCausalLM" => "tiny-qwen3-next",
        other => panic!("no preset for {other}"),
    }
}

/// The worker configuration's adapters for the recorded engine's, in load order.
pub fn lora_modules(meta: &Meta) -> Vec<kvroute_sim::LoraModule> {
    meta.lora_modules
        .iter()
        .map(|m| kvroute_sim::LoraModule {
            name: m.name.clone(),
            path: m.path.clone(),
        })
        .collect()
}

/// The engine configuration that reproduces the recorded engine for `worker`.
pub fn config_for(meta: &Meta, worker: &str) -> EngineConfig {
    let mut cfg = EngineConfig::for_preset(preset_of(meta)).unwrap();
    if !cfg.spec.has_mamba() {
        if let Some(b) = arg(meta, "block_size") {
            cfg.spec = cfg.spec.clone().with_block_size(b as u32);
        }
    }
    cfg.max_model_len = arg(meta, "max_model_len").unwrap_or(1024) as u32;
    cfg.max_num_seqs = arg(meta, "max_num_seqs").unwrap_or(8) as u32;
    cfg.max_num_batched_tokens = arg(meta, "max_num_batched_tokens").unwrap_or(2048) as u32;
    cfg.num_blocks = arg(meta, "num_gpu_blocks_override").unwrap_or(100_000) as u32;
    cfg.hash_algo = meta.hash_algo.parse::<HashAlgo>().unwrap();
    cfg.hash_seed = meta.none_hash_seed.clone();
    cfg.worker = worker.into();
    cfg
}

/// A recorded batch: its events, timestamp and raw payload.
pub struct Recorded {
    pub events: Vec<Event>,
    pub ts: f64,
    pub payload: Vec<u8>,
}

pub fn decode_frame(worker: &str, frames: &[String]) -> Recorded {
    let b64 = base64::engine::general_purpose::STANDARD;
    let raw: Vec<Vec<u8>> = frames.iter().map(|f| b64.decode(f).unwrap()).collect();
    let refs: Vec<&[u8]> = raw.iter().map(Vec::as_slice).collect();
    let live = kvroute_wire::split_live(&refs).unwrap();
    let b = kvroute_wire::decode_batch(&worker.into(), live.payload, kvroute_wire::Dialect::Vllm)
        .unwrap();
    Recorded {
        events: b.events,
        ts: b.ts.unwrap_or(0.0),
        payload: live.payload.to_vec(),
    }
}
