//! The simulated engine's generations over its real interfaces: a vLLM 0.33 worker with an
//! EAGLE drafter answers `GET /version` as 0.33 and publishes msgpack `BlockStored` events
//! whose hashes cover the next token (`lookahead_token_ids`), storing a block only once that
//! token exists (a sampled one in the step that samples it); a 0.32 worker with the same drafter publishes plain stores and drops the
//! last matched block.

use crate::common;

use common::subscriber::{stores, subscribed_worker, Subscriber};
use common::{get, post};
use kvroute_index::hash::{self, BlockExtras, BlockHasher, HashAlgo, DEFAULT_SEED};
use kvroute_index::{Engine as Generation, Speculative};
use kvroute_sim::{SimHandle, WorkerConfig};
use serde_json::json;

async fn worker(engine: Generation) -> (SimHandle, Subscriber) {
    let mut cfg = WorkerConfig::for_preset("llama").unwrap();
    cfg.engine.engine = engine;
    cfg.engine.speculative = Some(Speculative {
        method: "eagle".into(),
        num_speculative_tokens: 3,
        num_nextn_predict_layers: None,
        disable_lookahead_block_hashes: false,
        disable_eagle_block_drop: false,
    });
    subscribed_worker(cfg).await
}

async fn cached(h: &SimHandle, prompt: &[u32], max_tokens: usize) -> u64 {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens});
    post(h.http, "/v1/completions", &body).await.json()["usage"]["prompt_tokens_details"]
        ["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn a_vllm_0_33_eagle_worker_publishes_lookahead_hashes_and_stores_a_block_once_its_next_token_exists(
) {
    let (h, mut sub) = worker(Generation::Vllm033).await;
    assert_eq!(get(h.http, "/version").await.json()["version"], "0.33.0");
    let b = 16usize;
    // Four full blocks and nothing after them: the fourth block's next token is the sampled
    // one, and 0.33 stores the block in the step that samples it.
    let prompt: Vec<u32> = (0..4 * b as u32).map(|t| 100 + t).collect();
    assert_eq!(cached(&h, &prompt, 1).await, 0);
    let got = stores(&mut sub).await;
    let hashes: Vec<u64> = got
        .iter()
        .flat_map(|s| s.hashes.iter().map(|x| x.value.0))
        .collect();
    let lookahead: Vec<Vec<u32>> = got
        .iter()
        .flat_map(|s| s.lookahead_token_ids.clone().unwrap_or_default())
        .collect();
    assert_eq!(lookahead.len(), 4, "every block has its next token");
    assert_eq!(lookahead[..3], [vec![116], vec![132], vec![148]]);
    let sampled = lookahead[3][0];
    let mut answered = prompt.clone();
    answered.push(sampled);
    let hasher = BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED);
    let want: Vec<u64> = hasher
        .chain_lookahead(&answered, b, &BlockExtras::default(), 1)
        .iter()
        .map(|d| hash::external(d).0)
        .collect();
    assert_eq!(
        hashes, want,
        "the engine's hashes are vLLM 0.33's lookahead hashes"
    );

    // One other token more: the fourth block's hash differs and the same prompt hits three
    // blocks, then four (its bound is n − 1 and nothing drops).
    let mut longer = prompt.clone();
    longer.push(if sampled == 7 { 8 } else { 7 });
    assert_eq!(cached(&h, &longer, 1).await, 3 * b as u64);
    assert_eq!(cached(&h, &longer, 1).await, 4 * b as u64);
}

#[tokio::test]
async fn a_vllm_0_32_eagle_worker_publishes_plain_hashes_and_drops_the_last_matched_block() {
    let (h, mut sub) = worker(Generation::Vllm032).await;
    assert_eq!(get(h.http, "/version").await.json()["version"], "0.32.0");
    let prompt: Vec<u32> = (0..65).map(|t| 300 + t).collect();
    assert_eq!(cached(&h, &prompt, 1).await, 0);
    let got = stores(&mut sub).await;
    assert!(!got.is_empty());
    assert!(got.iter().all(|s| s.lookahead_token_ids.is_none()));
    // Four blocks are cached; the drop leaves three.
    assert_eq!(cached(&h, &prompt, 1).await, 48);
}
