//! The simulator's `OffloadingConnector` rule against vLLM's own connector code: for every
//! oracle fixture with that connector (`conformance/oracle/`), the CPU tier's contents are
//! rebuilt from the connector's own events up to each request, and the simulator's
//! `vllm_rules::offloading_lookup` must return, for every lookup vLLM's connector answered
//! (`get_num_new_matched_tokens`: the device hit handed over, the tokens it loads), the same
//! tokens. Skips the fixtures whose drafter groups are flagged under the drop (vLLM 0.33's
//! EAGLE with a connector: the connector pops a drafter chunk, which the simulator refuses to
//! run). Also: the simulator's lookahead count (`SpecRules`) against the one vLLM's config
//! derived for each fixture.

use crate::common::corpus;
use crate::oracle_agreement::{fixture_engine, read_gz_lines, root};
use kvroute_index::hash::BlockExtras;
use kvroute_index::{Event, HashAlgo};
use kvroute_sim::simple_offload::SimpleCpuTier;
use kvroute_sim::spec::GroupKind;
use kvroute_sim::vllm_rules::{offloading_lookup, ChunkGroup};
use serde::Deserialize;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct Frame {
    worker: String,
    frames: Vec<String>,
}

#[derive(Deserialize)]
struct RequestLine {
    id: String,
    after_frame: usize,
    prompt_token_ids: Vec<u32>,
    get_num_new_matched_tokens: Vec<(usize, Option<usize>)>,
}

/// Every oracle fixture's directory, sorted.
fn fixture_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("meta.json").exists())
        .collect();
    dirs.sort();
    dirs
}

/// Applies the CPU tier's events (`medium = "CPU"`) of `frames` to `held` (group, hash).
fn apply_cpu_events(frames: &[Frame], held: &mut HashSet<(u32, u64)>) {
    for f in frames {
        for e in corpus::decode_frame(&f.worker, &f.frames).events {
            match e {
                Event::Stored(s) if s.medium.as_deref() == Some("CPU") => {
                    for h in &s.hashes {
                        held.insert((s.group.unwrap_or(0), h.value.0));
                    }
                }
                Event::Removed(rm) if rm.medium.as_deref() == Some("CPU") => {
                    for h in &rm.hashes {
                        held.remove(&(rm.group.unwrap_or(0), h.value.0));
                    }
                }
                _ => {}
            }
        }
    }
}

/// The block-hash chain of `tokens` (hashes of `hash_block` tokens).
fn chain_of(algo: HashAlgo, seed: &str, hash_block: u32, tokens: &[u32]) -> Vec<u64> {
    kvroute_index::index::block_hashes(
        algo,
        seed,
        hash_block as usize,
        tokens,
        &BlockExtras::default(),
    )
    .into_iter()
    .map(|(_, v, _)| v)
    .collect()
}

/// Checks one fixture; returns (lookups compared, of them those that loaded something,
/// mismatches).
fn check(dir: &Path) -> (usize, usize, Vec<String>) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
    let oracle = &meta["oracle"];
    let hash_block = oracle["hash_block_size"].as_u64().unwrap() as u32;
    let per_chunk = meta["engine_args"]["kv_transfer_config"]["kv_connector_extra_config"]
        ["blocks_per_chunk"]
        .as_u64()
        .unwrap_or(1) as u32;
    let groups: Vec<ChunkGroup> = oracle["groups"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .filter_map(|(i, g)| {
            let kind = match g["spec"].as_str().unwrap() {
                "FullAttentionSpec" => GroupKind::FullAttention,
                "SlidingWindowSpec" => GroupKind::SlidingWindow {
                    window: g["sliding_window"].as_u64().unwrap() as u32,
                },
                "ChunkedLocalAttentionSpec" => GroupKind::ChunkedLocal {
                    chunk: g["attention_chunk_size"].as_u64().unwrap() as u32,
                },
                "MambaSpec" => GroupKind::Mamba,
                other => panic!("{name}: no simulator kind for {other}"),
            };
            let block = g["block_size"].as_u64().unwrap() as u32;
            ChunkGroup::new(i as u32, kind, block, per_chunk, hash_block)
        })
        .collect();
    let algo: HashAlgo = meta["hash_algo"].as_str().unwrap().parse().unwrap();
    let seed = meta["none_hash_seed"].as_str().unwrap().to_string();
    let frames: Vec<Frame> = read_gz_lines(&dir.join("frames.jsonl.gz"));
    let requests: Vec<RequestLine> = read_gz_lines(&dir.join("requests.jsonl.gz"));
    let mut held: HashSet<(u32, u64)> = HashSet::new();
    let mut applied = 0;
    let mut compared = 0;
    let mut loaded = 0;
    let mut errors = Vec::new();
    for r in &requests {
        apply_cpu_events(
            &frames[applied.min(r.after_frame)..r.after_frame],
            &mut held,
        );
        applied = applied.max(r.after_frame);
        let chain = chain_of(algo, &seed, hash_block, &r.prompt_token_ids);
        let n = r.prompt_token_ids.len();
        for (local, vllm) in &r.get_num_new_matched_tokens {
            let Some(vllm) = vllm else { continue };
            compared += 1;
            loaded += usize::from(*vllm > 0);
            let sim = offloading_lookup(n, *local, &chain, &groups, |g, k| held.contains(&(g, k)));
            if sim != *vllm {
                errors.push(format!(
                    "{name} {}: from {local} the simulator loads {sim}, vLLM's connector {vllm}",
                    r.id
                ));
            }
        }
    }
    (compared, loaded, errors)
}

#[test]
fn the_simulator_s_offloading_rule_loads_what_vllm_s_connector_loaded_on_every_oracle_lookup() {
    let dirs = fixture_dirs();
    let (mut fixtures, mut compared, mut loaded, mut errors) = (0, 0, 0, Vec::new());
    for d in &dirs {
        let meta = std::fs::read_to_string(d.join("meta.json")).unwrap();
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        if !meta.contains("\"OffloadingConnector\"")
            || (name.starts_with("v033") && name.contains("eagle"))
        {
            continue;
        }
        let (n, l, e) = check(d);
        fixtures += 1;
        compared += n;
        loaded += l;
        errors.extend(e);
    }
    assert!(fixtures >= 8, "fixtures checked: {fixtures}");
    assert!(compared > 100, "lookups compared: {compared}");
    assert!(
        loaded > 20,
        "lookups that loaded from the tier: {loaded} of {compared}"
    );
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The simulator's own reading of `--speculative-config` (`vllm_rules::SpecRules`) against the
/// `num_hash_lookahead_tokens` vLLM derived for every oracle fixture without a KV connector.
#[test]
fn the_simulator_s_lookahead_count_is_the_one_vllm_derived_for_every_oracle_fixture() {
    let mut checked = 0;
    for d in std::fs::read_dir(root()).unwrap().filter_map(Result::ok) {
        let d = d.path();
        if !d.join("meta.json").exists() {
            continue;
        }
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("meta.json")).unwrap()).unwrap();
        let args = &meta["engine_args"];
        if args.get("kv_transfer_config").is_some_and(|v| !v.is_null()) {
            continue;
        }
        let generation = meta["engine"]
            .as_str()
            .and_then(|e| e.split_whitespace().last())
            .and_then(kvroute_index::Engine::from_version)
            .unwrap();
        let spec = args
            .get("speculative_config")
            .filter(|v| !v.is_null())
            .map(|v| serde_json::from_value::<kvroute_index::Speculative>(v.clone()).unwrap());
        let ours = kvroute_sim::vllm_rules::SpecRules::of(generation, spec.as_ref()).lookahead;
        let vllm = meta["oracle"]["num_hash_lookahead_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(u64::from(ours), vllm, "{name}");
        checked += 1;
    }
    assert!(checked >= 20, "fixtures checked: {checked}");
}

/// Checks one `SimpleCPUOffloadConnector` fixture: before each request the simulator's tier
/// holds what vLLM's connector reported holding (its CPU events up to then), and its own hit
/// (`SimpleCpuTier::hit`: `vllm_rules::simple_cpu_start` and the device coordinator over the
/// tier) must be the tokens vLLM's connector matched from every device hit it was handed.
/// Returns (lookups compared, of them those that loaded something, mismatches).
fn check_simple_cpu(dir: &Path) -> (usize, usize, Vec<String>) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
    let hash_block = meta["oracle"]["hash_block_size"].as_u64().unwrap() as u32;
    let algo: HashAlgo = meta["hash_algo"].as_str().unwrap().parse().unwrap();
    let seed = meta["none_hash_seed"].as_str().unwrap().to_string();
    let engine = fixture_engine(dir);
    let frames: Vec<Frame> = read_gz_lines(&dir.join("frames.jsonl.gz"));
    let requests: Vec<RequestLine> = read_gz_lines(&dir.join("requests.jsonl.gz"));
    let mut held: HashSet<(u32, u64)> = HashSet::new();
    let (mut applied, mut compared, mut loaded, mut errors) = (0, 0, 0, Vec::new());
    for r in &requests {
        apply_cpu_events(
            &frames[applied.min(r.after_frame)..r.after_frame],
            &mut held,
        );
        applied = applied.max(r.after_frame);
        let mut tier = SimpleCpuTier::new(
            held.len() as u32 + 1,
            &engine.kv,
            engine.cfg.engine,
            kvroute_index::WorkerId::from("oracle"),
            0,
        );
        for &(group, hash) in &held {
            assert!(tier.hold(hash, group), "{name}: the tier took every key");
        }
        let chain = chain_of(algo, &seed, hash_block, &r.prompt_token_ids);
        let n = r.prompt_token_ids.len();
        for (local, vllm) in &r.get_num_new_matched_tokens {
            let Some(vllm) = vllm else { continue };
            compared += 1;
            loaded += usize::from(*vllm > 0);
            let (sim, _) = tier.hit(&engine.kv, n, *local, &chain);
            if sim != *vllm {
                errors.push(format!(
                    "{name} {}: from {local} the simulator's tier serves {sim}, vLLM's connector {vllm}",
                    r.id
                ));
            }
        }
    }
    (compared, loaded, errors)
}

#[test]
fn the_simulator_s_simple_cpu_tier_serves_what_vllm_s_simple_connector_matched_on_every_oracle_lookup(
) {
    let dirs = fixture_dirs();
    let (mut fixtures, mut compared, mut loaded, mut errors) = (0, 0, 0, Vec::new());
    for d in &dirs {
        let meta = std::fs::read_to_string(d.join("meta.json")).unwrap();
        if !meta.contains("\"SimpleCPUOffloadConnector\"") {
            continue;
        }
        let (n, l, e) = check_simple_cpu(d);
        fixtures += 1;
        compared += n;
        loaded += l;
        errors.extend(e);
    }
    eprintln!("simple CPU: {fixtures} fixtures, {compared} lookups, {loaded} loaded");
    assert!(fixtures >= 6, "fixtures checked: {fixtures}");
    assert!(compared > 100, "lookups compared: {compared}");
    assert!(
        loaded > 20,
        "lookups that loaded from the tier: {loaded} of {compared}"
    );
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
