//! LoRA adapters on a simulated worker, over its real HTTP API and ZMQ publisher: adapters are
//! listed on `/v1/models` as vLLM lists them (`root` the path, `parent` the base model); a
//! request naming an adapter hashes its blocks with `("lora", name, path)` and its stores name
//! the adapter (`lora_name`, `lora_id`); base-model and adapter requests never share blocks.

use crate::common;

use common::subscriber::{stores, subscribed_worker, Subscriber};
use common::{get, post};
use kvroute_index::hash::{self, BlockExtras, BlockHasher, HashAlgo, DEFAULT_SEED};
use kvroute_sim::{LoraModule, SimHandle, WorkerConfig};
use serde_json::json;

async fn worker() -> (SimHandle, Subscriber) {
    let mut cfg = WorkerConfig::for_preset("llama").unwrap();
    cfg.model = "base".into();
    cfg.lora_modules = vec![
        "sql=/adapters/sql".parse().unwrap(),
        r#"{"name": "chat", "path": "/adapters/chat"}"#.parse().unwrap(),
    ];
    subscribed_worker(cfg).await
}

async fn cached(h: &SimHandle, model: &str, prompt: &[u32]) -> u64 {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
    let r = post(h.http, "/v1/completions", &body).await.json();
    assert_eq!(r["model"], model);
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn lora_modules_parse_as_vllm_s_flag_forms_and_refuse_anything_else() {
    let m: LoraModule = "a=/p/a".parse().unwrap();
    assert_eq!((m.name.as_str(), m.path.as_str()), ("a", "/p/a"));
    for bad in ["a", "=p", "a=", r#"{"name": "a"}"#, "{not json"] {
        assert!(bad.parse::<LoraModule>().is_err(), "{bad:?}");
    }
}

#[tokio::test]
async fn adapters_are_listed_with_their_parent_and_path_as_vllm_lists_them() {
    let (h, _sub) = worker().await;
    let m = get(h.http, "/v1/models").await.json();
    let data = m["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(data[0]["id"], "base");
    assert!(data[0]["parent"].is_null());
    for (card, (name, path)) in data[1..]
        .iter()
        .zip([("sql", "/adapters/sql"), ("chat", "/adapters/chat")])
    {
        assert_eq!(card["id"], name);
        assert_eq!(card["root"], path);
        assert_eq!(card["parent"], "base");
        assert_eq!(card["owned_by"], "vllm");
    }
}

#[tokio::test]
async fn an_adapter_request_hashes_with_the_adapter_key_and_shares_no_cache_with_the_base_model() {
    let (h, mut sub) = worker().await;
    let prompt: Vec<u32> = (0..65).map(|t| 500 + t).collect();
    assert_eq!(cached(&h, "chat", &prompt).await, 0);
    let got = stores(&mut sub).await;
    let hasher = BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED);
    let extras = BlockExtras {
        cache_salt: None,
        lora: Some(("chat".into(), "/adapters/chat".into())),
    };
    let want: Vec<u64> = hasher
        .chain(&prompt, 16, &extras)
        .iter()
        .map(|d| hash::external(d).0)
        .collect();
    let hashes: Vec<u64> = got
        .iter()
        .flat_map(|s| s.hashes.iter().map(|x| x.value.0))
        .collect();
    assert_eq!(hashes, want, "hashed with (\"lora\", name, path)");
    for s in &got {
        assert_eq!(s.lora_name.as_deref(), Some("chat"));
        assert_eq!(s.lora_id, Some(2), "the second adapter loaded");
    }
    // The base model and the other adapter miss what `chat` cached; `chat` hits it.
    assert_eq!(cached(&h, "base", &prompt).await, 0);
    assert_eq!(cached(&h, "sql", &prompt).await, 0);
    assert_eq!(cached(&h, "chat", &prompt).await, 64);
    assert_eq!(cached(&h, "base", &prompt).await, 64);
}
