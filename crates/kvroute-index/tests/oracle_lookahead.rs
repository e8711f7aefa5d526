//! kvroute's reading of `--speculative-config` against vLLM's own: every oracle fixture
//! (`conformance/oracle/`) records the `num_hash_lookahead_tokens` vLLM's `VllmConfig` derived
//! for its engine arguments, and `Speculative::hash_lookahead_tokens` (0 beside any KV
//! connector) must give the same count. The conformance replay configures the index and the
//! reference model from this reading, so it is checked here on its own.

use kvroute_index::{Engine, Speculative};
use std::path::{Path, PathBuf};

#[test]
fn kvroute_s_lookahead_count_is_the_one_vllm_derived_for_every_oracle_fixture() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/oracle/fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("meta.json").exists())
        .collect();
    dirs.sort();
    let mut checked = 0;
    let mut with_lookahead = 0;
    for d in &dirs {
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("meta.json")).unwrap()).unwrap();
        let engine = meta["engine"]
            .as_str()
            .and_then(|e| e.split_whitespace().last())
            .and_then(Engine::from_version)
            .unwrap_or_else(|| panic!("{name}: no engine version"));
        let args = &meta["engine_args"];
        let spec = args
            .get("speculative_config")
            .filter(|v| !v.is_null())
            .map(|v| serde_json::from_value::<Speculative>(v.clone()).unwrap());
        let connector = args.get("kv_transfer_config").is_some_and(|v| !v.is_null());
        let ours = match (&spec, connector) {
            (Some(s), false) => s.hash_lookahead_tokens(engine),
            _ => 0,
        };
        let vllm = meta["oracle"]["num_hash_lookahead_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: no recorded lookahead count"));
        assert_eq!(u64::from(ours), vllm, "{name}");
        checked += 1;
        with_lookahead += usize::from(vllm > 0);
    }
    assert!(checked >= 30, "fixtures checked: {checked}");
    assert!(
        with_lookahead >= 4,
        "fixtures with lookahead: {with_lookahead}"
    );
}
