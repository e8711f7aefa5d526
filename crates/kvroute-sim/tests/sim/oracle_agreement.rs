//! Agreement with vLLM's own scheduler code: the fixtures `conformance/oracle/drive.py` recorded
//! from vLLM 0.32's and 0.33's `Scheduler` (its KV cache manager, coordinator and block pool;
//! `conformance/oracle/README.md`) are replayed on the simulator's engine core configured with
//! the fixture's groups, pool, model length, engine generation and speculative configuration.
//! Each request's `num_cached_tokens` must equal vLLM's, except on exactly the requests
//! `conformance/oracle/known-sim-disagreements.txt` lists.
//! Covers the fixtures without a KV connector: the simulator's CPU tier counts slots, not
//! vLLM's bytes, so a connector fixture's tier cannot be sized alike.

use kvroute_index::tier::OffloadConnector;
use kvroute_index::{Engine as Generation, Speculative};
use kvroute_sim::spec::{GroupKind, GroupSpec};
use kvroute_sim::{Engine, EngineConfig, NewRequest};
use serde::Deserialize;
use std::io::BufRead;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct Meta {
    engine: String,
    engine_args: serde_json::Value,
    oracle: Oracle,
}

#[derive(Deserialize)]
struct Oracle {
    num_gpu_blocks: u32,
    groups: Vec<OracleGroup>,
}

#[derive(Deserialize)]
struct OracleGroup {
    spec: String,
    block_size: u32,
    sliding_window: Option<u32>,
    attention_chunk_size: Option<u32>,
}

#[derive(Deserialize)]
struct RequestLine {
    id: String,
    prompt_token_ids: Vec<u32>,
    output_token_ids: Vec<u32>,
    num_cached_tokens: usize,
}

/// The oracle fixtures (shared with `oracle_tiers`).
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/oracle/fixtures")
}

/// A gzipped JSON-lines file, one `T` a line (shared with `oracle_tiers`).
pub(crate) fn read_gz_lines<T: for<'de> Deserialize<'de>>(p: &Path) -> Vec<T> {
    let f = std::fs::File::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    std::io::BufReader::new(flate2::read::GzDecoder::new(f))
        .lines()
        .map(|l| l.unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(&l).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

/// The simulator configuration of a fixture: vLLM's groups in its order, its pool.
fn config(meta: &Meta) -> EngineConfig {
    let mut cfg = EngineConfig::for_preset("llama").unwrap();
    cfg.spec.name = "oracle".into();
    cfg.spec.groups = meta
        .oracle
        .groups
        .iter()
        .map(|g| GroupSpec {
            kind: match g.spec.as_str() {
                "FullAttentionSpec" => GroupKind::FullAttention,
                "SlidingWindowSpec" => GroupKind::SlidingWindow {
                    window: g.sliding_window.unwrap(),
                },
                "ChunkedLocalAttentionSpec" => GroupKind::ChunkedLocal {
                    chunk: g.attention_chunk_size.unwrap(),
                },
                "MambaSpec" => GroupKind::Mamba,
                other => panic!("no simulator kind for {other}"),
            },
            block_size: g.block_size,
        })
        .collect();
    let arg = |k: &str| meta.engine_args.get(k).and_then(|v| v.as_u64()).unwrap() as u32;
    cfg.num_blocks = meta.oracle.num_gpu_blocks;
    cfg.max_model_len = arg("max_model_len");
    cfg.max_num_batched_tokens = arg("max_num_batched_tokens");
    cfg.engine = meta
        .engine
        .split_whitespace()
        .last()
        .and_then(Generation::from_version)
        .unwrap();
    cfg.speculative = meta
        .engine_args
        .get("speculative_config")
        .filter(|v| !v.is_null())
        .map(|v| serde_json::from_value::<Speculative>(v.clone()).unwrap());
    cfg
}

/// The simulator's engine core configured as fixture `dir`'s vLLM was (its groups, pool,
/// model length, generation, speculative configuration; shared with `oracle_tiers`).
pub(crate) fn fixture_engine(dir: &Path) -> Engine {
    let meta: Meta = serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut cfg = config(&meta);
    let connector = &meta.engine_args["kv_transfer_config"]["kv_connector"];
    cfg.cpu_tier_connector = match connector.as_str() {
        Some("SimpleCPUOffloadConnector") => OffloadConnector::SimpleCpu,
        Some("OffloadingConnector") => OffloadConnector::Offloading,
        Some(other) => panic!("{}: no simulator connector for {other}", dir.display()),
        None => return Engine::new(cfg).unwrap_or_else(|e| panic!("{}: {e}", dir.display())),
    };
    // The tier's size does not enter a lookup (the checks fill their own); its presence sets
    // the rules a connector implies.
    cfg.cpu_tier_slots = 1;
    Engine::new(cfg).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Replays one fixture; returns (requests, hit mismatches).
fn replay(dir: &Path) -> (usize, Vec<String>) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let meta: Meta = serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let requests: Vec<RequestLine> = read_gz_lines(&dir.join("requests.jsonl.gz"));
    let mut engine = Engine::new(config(&meta)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut errors = Vec::new();
    for r in &requests {
        let handle = engine
            .add_request(NewRequest {
                id: r.id.clone(),
                prompt: r.prompt_token_ids.clone(),
                max_tokens: r.output_token_ids.len(),
                forced_output: Some(r.output_token_ids.clone()),
                ..NewRequest::default()
            })
            .unwrap();
        let mut cached = None;
        for _ in 0..10_000 {
            let out = engine.step();
            if let Some(t) = out.tokens.iter().find(|t| t.handle == handle) {
                cached.get_or_insert(t.num_cached_tokens);
                if t.finished.is_some() {
                    break;
                }
            }
        }
        if cached != Some(r.num_cached_tokens) {
            errors.push(format!(
                "{name} {}: sim hit {cached:?}, vLLM {} (prompt {})",
                r.id,
                r.num_cached_tokens,
                r.prompt_token_ids.len()
            ));
        }
    }
    (requests.len(), errors)
}

#[test]
fn every_oracle_fixture_without_a_connector_replays_with_vllm_s_hits_but_the_listed_ones() {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("meta.json").exists())
        .collect();
    dirs.sort();
    let mut checked = 0;
    let mut errors = Vec::new();
    for d in &dirs {
        let meta = std::fs::read_to_string(d.join("meta.json")).unwrap();
        if meta.contains("kv_transfer_config") {
            continue;
        }
        let (n, e) = replay(d);
        checked += n;
        errors.extend(e);
    }
    for e in &errors {
        eprintln!("{e}");
    }
    assert!(checked > 300, "requests checked: {checked}");
    let failing: std::collections::BTreeSet<String> = errors
        .iter()
        .filter_map(|e| e.split(':').next())
        .map(str::to_string)
        .collect();
    let listed = std::fs::read_to_string(root().join("../known-sim-disagreements.txt"))
        .expect("known-sim-disagreements.txt");
    let known: std::collections::BTreeSet<String> = listed
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    assert_eq!(failing, known, "mismatching requests differ from the list");
}
