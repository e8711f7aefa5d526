//! Agreement with the real engine: every committed conformance corpus (recorded from vLLM
//! 0.32) is replayed on the simulator configured as the corpus's model. Each request's
//! `num_cached_tokens` must equal the engine's, and the events of each engine step must equal
//! the recorded batch (timestamps aside), batch by batch.

use base64::Engine as _;
use kvroute_index::hash::HashAlgo;
use kvroute_index::Event;
use kvroute_sim::{Engine, EngineConfig, NewRequest, WireFormat};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct Meta {
    model_config: serde_json::Value,
    engine_args: serde_json::Value,
    hash_algo: String,
    none_hash_seed: String,
}

#[derive(Deserialize)]
struct FrameLine {
    worker: String,
    frames: Vec<String>,
}

#[derive(Deserialize)]
struct RequestLine {
    id: String,
    worker: String,
    after_frame: usize,
    prompt_token_ids: Vec<u32>,
    #[serde(default)]
    cache_salt: Option<String>,
    output_token_ids: Vec<u32>,
    num_cached_tokens: usize,
}

fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/corpus")
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(p: &Path) -> Vec<T> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn arg(meta: &Meta, key: &str) -> Option<u64> {
    meta.engine_args.get(key).and_then(|v| v.as_u64())
}

fn config_for(meta: &Meta, worker: &str) -> EngineConfig {
    let arch = meta.model_config["architectures"][0].as_str().unwrap_or("");
    let preset = match arch {
        "Gemma3ForCausalLM" => "tiny-gemma3",
        "NemotronHForCausalLM" => "tiny-nemotron-h",
        "Qwen3NextForCausalLM" => "tiny-qwen3-next",
        other => panic!("no preset for {other}"),
    };
    let mut cfg = EngineConfig::for_preset(preset).unwrap();
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
struct Recorded {
    events: Vec<Event>,
    ts: f64,
    payload: Vec<u8>,
}

fn decode_frame(worker: &str, frames: &[String]) -> Recorded {
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

/// Replays one corpus; returns (requests, hit mismatches, batch mismatches) and prints each.
fn replay(name: &str) -> (usize, Vec<String>, Vec<String>) {
    let dir = corpus_root().join(name);
    let meta: Meta =
        serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
    let frames: Vec<FrameLine> = read_jsonl(&dir.join("frames.jsonl"));
    let requests: Vec<RequestLine> = read_jsonl(&dir.join("requests.jsonl"));
    let mut workers: Vec<String> = requests.iter().map(|r| r.worker.clone()).collect();
    workers.sort();
    workers.dedup();
    let (mut hit_errors, mut event_errors) = (Vec::new(), Vec::new());
    for w in &workers {
        let mut engine = Engine::new(config_for(&meta, w)).unwrap();
        let reqs: Vec<&RequestLine> = requests.iter().filter(|r| &r.worker == w).collect();
        for (k, r) in reqs.iter().enumerate() {
            let end = reqs.get(k + 1).map_or(frames.len(), |n| n.after_frame);
            let raw: Vec<Recorded> = frames[r.after_frame..end]
                .iter()
                .filter(|f| &f.worker == w)
                .map(|f| decode_frame(w, &f.frames))
                .collect();
            let recorded: Vec<Vec<Event>> = raw.iter().map(|b| b.events.clone()).collect();
            let handle = engine
                .add_request(NewRequest {
                    id: r.id.clone(),
                    prompt: r.prompt_token_ids.clone(),
                    max_tokens: r.output_token_ids.len(),
                    forced_output: Some(r.output_token_ids.clone()),
                    cache_salt: r.cache_salt.clone(),
                    skip_prefix_cache: false,
                })
                .unwrap();
            let mut batches: Vec<Vec<Event>> = Vec::new();
            let mut cached = None;
            for _ in 0..10_000 {
                let out = engine.step();
                if !out.events.is_empty() {
                    batches.push(out.events);
                }
                if let Some(t) = out.tokens.iter().find(|t| t.handle == handle) {
                    cached = Some(t.num_cached_tokens);
                    if t.finished.is_some() {
                        break;
                    }
                }
            }
            if cached != Some(r.num_cached_tokens) {
                hit_errors.push(format!(
                    "{name} {}: sim hit {:?}, engine {} (prompt {})",
                    r.id,
                    cached,
                    r.num_cached_tokens,
                    r.prompt_token_ids.len()
                ));
            }
            if batches == recorded {
                // Same events: the bytes must be the engine's too (its timestamp aside).
                for (b, rec) in batches.iter().zip(&raw) {
                    let ours = kvroute_sim::wire::encode_batch(rec.ts, b, 0, WireFormat::V032);
                    if ours != rec.payload {
                        event_errors.push(format!("{name} {}: payload bytes differ", r.id));
                    }
                }
            } else {
                event_errors.push(format!(
                    "{name} {}: {} sim batches {:?}\n   vs {} recorded {:?}",
                    r.id,
                    batches.len(),
                    summarize(&batches),
                    recorded.len(),
                    summarize(&recorded)
                ));
            }
        }
    }
    for e in hit_errors.iter().chain(&event_errors) {
        eprintln!("{e}");
    }
    (requests.len(), hit_errors, event_errors)
}

fn summarize(batches: &[Vec<Event>]) -> Vec<Vec<String>> {
    batches
        .iter()
        .map(|b| {
            b.iter()
                .map(|e| match e {
                    Event::Stored(s) => format!(
                        "S g{} p{:?} n{} t{} {:?}",
                        s.group.unwrap_or(0),
                        s.parent.as_ref().map(|p| p.value.0 % 1000),
                        s.hashes.len(),
                        s.token_ids.len(),
                        s.hashes
                            .iter()
                            .map(|h| h.value.0 % 1000)
                            .collect::<Vec<_>>()
                    ),
                    Event::Removed(r) => format!(
                        "R g{} {:?}",
                        r.group.unwrap_or(0),
                        r.hashes
                            .iter()
                            .map(|h| h.value.0 % 1000)
                            .collect::<Vec<_>>()
                    ),
                    Event::Cleared(_) => "C".into(),
                })
                .collect()
        })
        .collect()
}

fn check(name: &str) {
    if !corpus_root().join(name).join("meta.json").exists() {
        eprintln!("corpus {name} not committed; skipped");
        return;
    }
    let (n, hits, events) = replay(name);
    assert!(n > 0, "{name} has no requests");
    assert!(hits.is_empty(), "{name}: {} hit mismatches", hits.len());
    assert!(
        events.is_empty(),
        "{name}: {} event mismatches",
        events.len()
    );
}

#[test]
fn the_gemma3_developer_sample_replays_with_identical_hits_and_events() {
    check("gemma3-basic");
}

#[test]
fn the_gemma3_mixed_corpus_replays_with_identical_hits_and_events() {
    check("gemma3-mixed");
}

#[test]
fn the_gemma3_eviction_corpus_replays_with_identical_hits_and_events() {
    check("gemma3-eviction");
}

#[test]
fn the_gemma3_salted_cbor_corpus_replays_with_identical_hits_and_events() {
    check("gemma3-salt-cbor");
}

#[test]
fn the_nemotron_h_mixed_corpus_replays_with_identical_hits_and_events() {
    check("nemotron-h-mixed");
}

#[test]
fn the_nemotron_h_eviction_corpus_replays_with_identical_hits_and_events() {
    check("nemotron-h-eviction");
}

#[test]
fn the_qwen3_next_mixed_corpus_replays_with_identical_hits_and_events() {
    check("qwen3-next-mixed");
}
