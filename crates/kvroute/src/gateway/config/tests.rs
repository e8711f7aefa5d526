//! The configuration's tests: TOML in vLLM's vocabulary, validation naming the field, the
//! engine and speculative settings, the `--worker` keys.

use super::file::GatewayConfig;
use super::*;
use kvroute_route::PolicyKind;

#[test]
fn a_toml_config_reads_like_vllm_flags() {
    let c = GatewayConfig::from_toml(
        r#"
        listen = "127.0.0.1:9000"
        policy = "group-blind"
        [[workers]]
        name = "w0"
        url = "http://127.0.0.1:8000"
        model = "qwen3-next"
        hash_algo = "sha256_cbor"
        hash_seed = "1234"
        dp_size = 2
        [workers.kv_events]
        endpoint = "tcp://*:5557"
        replay_endpoint = "tcp://*:5558"
        topic = "kv"
        "#,
    )
    .unwrap();
    assert_eq!(c.policy, PolicyKind::GroupBlind);
    assert_eq!(c.workers[0].dp_size, 2);
    assert_eq!(c.workers[0].event_host(), "127.0.0.1");
    assert!(matches!(
        c.workers[0].index_config().unwrap().hash,
        HashMode::Engine { .. }
    ));
}

#[test]
fn bad_configs_name_the_offending_field() {
    let e =
        GatewayConfig::from_toml("[[workers]]\nname='a'\nurl='ftp://x'\nmodel='m'\n").unwrap_err();
    assert!(e.contains("url"), "{e}");
    let e = GatewayConfig::from_toml("admin_listen='0.0.0.0:1'\n").unwrap_err();
    assert!(e.contains("admin_token"), "{e}");
    let e = GatewayConfig::from_toml(
        "[[workers]]\nname='a'\nurl='http://x'\nmodel='m'\nhash_algo='xxhash'\n",
    )
    .unwrap_err();
    assert!(e.contains("content"), "{e}");
    let base = "[[workers]]\nname='a'\nurl='http://x'\nmodel='m'\n";
    for (extra, field) in [
        ("engine='vllm-0.34'\n", "engine"),
        (
            "engine='vllm-0.32'\nspeculative=true\nhash_lookahead_tokens=1\n",
            "hash_lookahead_tokens",
        ),
        ("hash_lookahead_tokens=1\n", "hash_lookahead_tokens"),
        (
            "speculative={method='eagle', num_speculative_tokens=0}\n",
            "num_speculative_tokens",
        ),
    ] {
        let e = GatewayConfig::from_toml(&format!("{base}{extra}")).unwrap_err();
        assert!(e.contains(field), "{extra}: {e}");
    }
    for field in [
        "lambda",
        "tokens_per_request",
        "junction",
        "cpu_load_us_per_token",
    ] {
        let e = GatewayConfig::from_toml(&format!("[weights]\n{field} = -1.0\n")).unwrap_err();
        assert!(e.contains(&format!("weights.{field}")), "{field}: {e}");
    }
}

fn engine_config(toml: &str) -> WorkerConfig {
    let c = GatewayConfig::from_toml(&format!(
        "[[workers]]\nname='a'\nurl='http://x'\nmodel='m'\n{toml}"
    ))
    .unwrap();
    c.workers[0].index_config().unwrap()
}

#[test]
fn the_engine_and_speculative_config_decide_the_drop_and_the_lookahead() {
    // (TOML, engine, EAGLE drop, lookahead tokens)
    for (toml, engine, eagle, lookahead) in [
        ("", Engine::Vllm032, false, 0),
        ("speculative = true\n", Engine::Vllm032, true, 0),
        (
            "engine = 'vllm-0.33'\nspeculative = true\n",
            Engine::Vllm033,
            true,
            1,
        ),
        (
            "engine = 'vllm-0.33'\n[workers.speculative]\nmethod = 'mtp'\n\
             num_speculative_tokens = 3\nnum_nextn_predict_layers = 3\n",
            Engine::Vllm033,
            true,
            3,
        ),
        (
            "engine = 'vllm-0.33'\n[workers.speculative]\nmethod = 'eagle3'\n\
             num_speculative_tokens = 4\ndisable_lookahead_block_hashes = true\n\
             model = 'yuhuili/EAGLE3-LLaMA3.1-Instruct-8B'\n",
            Engine::Vllm033,
            true,
            0,
        ),
        (
            "engine = 'vllm-0.33'\nspeculative = true\nhash_lookahead_tokens = 0\n",
            Engine::Vllm033,
            true,
            0,
        ),
        (
            "[workers.speculative]\nmethod = 'dflash'\nnum_speculative_tokens = 4\n",
            Engine::Vllm032,
            true,
            0,
        ),
    ] {
        let cfg = engine_config(toml);
        assert_eq!(
            (cfg.engine, cfg.lookup.eagle, cfg.hash_lookahead_tokens),
            (engine, eagle, lookahead),
            "{toml}"
        );
    }
    // The same spec detected as another generation: 0.33's DFlash neither drops nor
    // hashes ahead; an EAGLE flag hashes one token ahead.
    let c = GatewayConfig::from_toml(
        "[[workers]]\nname='a'\nurl='http://x'\nmodel='m'\nspeculative=true\n",
    )
    .unwrap();
    let on_033 = c.workers[0].index_config_for(Engine::Vllm033).unwrap();
    assert_eq!(on_033.rules().lookahead, 1);
    assert!(!on_033.rules().eagle_drop);
    let mut dflash = c.workers[0].clone();
    dflash.set_flag("speculative_method", "dflash").unwrap();
    let cfg = dflash.index_config_for(Engine::Vllm033).unwrap();
    assert_eq!((cfg.lookup.eagle, cfg.hash_lookahead_tokens), (false, 0));
}

#[test]
fn worker_flags_set_the_engine_and_vllm_s_speculative_fields() {
    let mut w = WorkerSpec::new("a", "http://x", "m");
    for (k, v) in [
        ("engine", "vllm-0.33"),
        ("speculative_method", "deepseek_mtp"),
        ("num_speculative_tokens", "2"),
        ("num_nextn_predict_layers", "2"),
    ] {
        w.set_flag(k, v).unwrap();
    }
    w.validate().unwrap();
    let cfg = w.index_config().unwrap();
    assert_eq!(
        (cfg.engine, cfg.lookup.eagle, cfg.hash_lookahead_tokens),
        (Engine::Vllm033, true, 2)
    );
    w.set_flag("hash_lookahead_tokens", "1").unwrap();
    assert_eq!(w.index_config().unwrap().hash_lookahead_tokens, 1);
    assert!(w
        .set_flag("engine", "sglang")
        .unwrap_err()
        .contains("engine"));
    assert!(w.set_flag("num_speculative_tokens", "x").is_err());
    assert!(w.set_flag("nope", "1").unwrap_err().contains("unknown key"));
    // The spec round-trips through JSON (the admin API's add body).
    let json = serde_json::to_string(&w).unwrap();
    assert_eq!(serde_json::from_str::<WorkerSpec>(&json).unwrap(), w);
}

#[test]
fn an_eagle_worker_s_cpu_tier_follows_whether_its_engine_flags_drafter_groups() {
    let mut w = WorkerSpec::new("a", "http://x", "m");
    w.set_flag("speculative_method", "eagle3").unwrap();
    w.set_flag("num_speculative_tokens", "3").unwrap();
    // 0.32 flags no group for EAGLE3 (the connector pops nothing); 0.33 flags its drafter's.
    let on = |w: &WorkerSpec, e| {
        w.index_config_for(e)
            .unwrap()
            .lookup
            .drafter_groups_unflagged
    };
    assert!(on(&w, Engine::Vllm032));
    assert!(!on(&w, Engine::Vllm033));
    w.set_flag("speculative_method", "mtp").unwrap();
    assert!(!on(&w, Engine::Vllm032));
}

#[test]
fn a_worker_that_names_a_kv_connector_hashes_without_lookahead_and_drops() {
    let mut w = WorkerSpec::new("a", "http://x", "m");
    w.set_flag("speculative_method", "eagle3").unwrap();
    w.set_flag("num_speculative_tokens", "3").unwrap();
    let cfg = w.index_config_for(Engine::Vllm033).unwrap();
    assert_eq!((cfg.lookup.eagle, cfg.hash_lookahead_tokens), (true, 1));
    w.offload_connector = kvroute_index::tier::OffloadConnector::SimpleCpu;
    let cfg = w.index_config_for(Engine::Vllm033).unwrap();
    assert_eq!((cfg.lookup.eagle, cfg.hash_lookahead_tokens), (true, 0));
    assert!(cfg.rules().eagle_drop);
    // An explicit count still wins.
    w.hash_lookahead_tokens = Some(1);
    assert_eq!(
        w.index_config_for(Engine::Vllm033)
            .unwrap()
            .hash_lookahead_tokens,
        1
    );
}

#[test]
fn the_prefill_stall_reads_as_a_word_and_a_wrong_one_names_the_field() {
    let base = "[[workers]]\nname='a'\nurl='http://x'\nmodel='m'\n";
    let c = GatewayConfig::from_toml(base).unwrap();
    assert_eq!(c.weights.prefill_stall, PrefillStall::LaterTurns);
    for (word, want) in [
        ("off", PrefillStall::Off),
        ("later-turns", PrefillStall::LaterTurns),
        ("all", PrefillStall::All),
    ] {
        let c = GatewayConfig::from_toml(&format!("[weights]\nprefill_stall = '{word}'\n{base}"))
            .unwrap();
        assert_eq!(c.weights.prefill_stall, want);
        assert_eq!(word.parse::<PrefillStall>(), Ok(want));
    }
    let e =
        GatewayConfig::from_toml(&format!("[weights]\nprefill_stall = true\n{base}")).unwrap_err();
    assert!(e.contains("prefill_stall"), "{e}");
    assert!("sometimes".parse::<PrefillStall>().is_err());
}
