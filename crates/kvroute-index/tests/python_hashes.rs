//! Block hashes agree byte for byte with Python's own `pickle` + `hashlib` and `cbor2`, on
//! random inputs: token ids of every pickle integer width, blocks past the 64 KiB pickle
//! frame, salts and LoRA keys, vLLM 0.33's lookahead hashes (1 and 3 tokens), whole request
//! chains, both algorithms, default and custom seeds.
//!
//! Needs `python3` with `cbor2` (installed by `.ci/run`).

use kvroute_index::hash::cache::DigestCache;
use kvroute_index::hash::pickle::PyValue;
use kvroute_index::hash::{BlockExtras, BlockHasher, HashAlgo, DEFAULT_SEED};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::process::{Command, Stdio};

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_token(rng: &mut StdRng) -> u32 {
    match rng.gen_range(0..5) {
        0 => rng.gen_range(0..256),
        1 => rng.gen_range(256..65_536),
        2 => rng.gen_range(65_536..(1 << 31)),
        3 => rng.gen_range((1u32 << 31)..=u32::MAX),
        _ => [
            0,
            255,
            256,
            65_535,
            65_536,
            i32::MAX as u32,
            1 << 31,
            u32::MAX,
        ][rng.gen_range(0..8)],
    }
}

fn random_string(rng: &mut StdRng) -> String {
    let len = [0usize, 1, 5, 255, 256, 300][rng.gen_range(0..6)];
    (0..len)
        .map(|_| ['a', 'Z', '0', 'é', '中', '🙂', '-'][rng.gen_range(0..7)])
        .collect()
}

struct Case {
    algo: HashAlgo,
    seed: String,
    parent: Option<[u8; 32]>,
    tokens: Vec<u32>,
    extras: BlockExtras,
    block_index: usize,
    /// The tokens after the block folded into its hash (vLLM 0.33; empty: none).
    lookahead: Vec<u32>,
}

impl Case {
    fn json(&self) -> serde_json::Value {
        let mut keys: Vec<serde_json::Value> = Vec::new();
        if let Some((name, path)) = &self.extras.lora {
            keys.push(serde_json::json!(["lora", name, path]));
        }
        if self.block_index == 0 {
            if let Some(s) = &self.extras.cache_salt {
                keys.push(serde_json::json!(["cache_salt", s]));
            }
        }
        serde_json::json!({
            "algo": self.algo.to_string(),
            "seed": self.seed,
            "parent": self.parent.map(|p| hex(&p)),
            "tokens": self.tokens,
            "extra": if keys.is_empty() { serde_json::Value::Null } else { serde_json::Value::Array(keys) },
            "lookahead": self.lookahead,
        })
    }
}

fn python_digests(cases: &[Case]) -> Vec<String> {
    let input: Vec<serde_json::Value> = cases.iter().map(Case::json).collect();
    run_python("vllm_hash.py", &input)
}

/// Runs one of the oracle scripts in `tests/py` on JSON cases and reads its JSON answer.
fn run_python<T: serde::de::DeserializeOwned>(script: &str, cases: &[serde_json::Value]) -> T {
    let script = format!("{}/tests/py/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 must be installed (see .ci/run)");
    let input = serde_json::to_vec(cases).unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python reference failed (is cbor2 installed? .ci/run installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn block_hashes_match_python_pickle_hashlib_and_cbor2_on_random_inputs() {
    let mut rng = StdRng::seed_from_u64(20261130);
    let mut cases = Vec::new();
    for i in 0..400 {
        let len = match i % 10 {
            0 => 0,
            1 => rng.gen_range(13_000..17_000), // past the 64 KiB pickle frame
            _ => rng.gen_range(1..600),
        };
        let extras = BlockExtras {
            cache_salt: rng.gen_bool(0.3).then(|| random_string(&mut rng)),
            lora: rng
                .gen_bool(0.2)
                .then(|| (random_string(&mut rng), random_string(&mut rng))),
        };
        cases.push(Case {
            algo: if rng.gen_bool(0.5) {
                HashAlgo::Sha256
            } else {
                HashAlgo::Sha256Cbor
            },
            seed: if rng.gen_bool(0.7) {
                DEFAULT_SEED.to_string()
            } else {
                format!("{}", rng.gen::<u32>())
            },
            parent: rng.gen_bool(0.6).then(|| rng.gen()),
            tokens: (0..len).map(|_| random_token(&mut rng)).collect(),
            extras,
            block_index: rng.gen_range(0..2),
            lookahead: Vec::new(),
        });
    }
    let want = python_digests(&cases);
    for (c, w) in cases.iter().zip(&want) {
        let got = BlockHasher::new(c.algo, &c.seed).hash_block(
            c.parent.as_ref(),
            &c.tokens,
            &c.extras,
            c.block_index,
        );
        assert_eq!(
            &hex(&got),
            w,
            "algo {} len {} extras {:?}",
            c.algo,
            c.tokens.len(),
            c.extras
        );
    }
}

fn random_extras(rng: &mut StdRng) -> BlockExtras {
    // vLLM refuses an empty cache_salt at its API, so a salt is never empty.
    let salt = rng.gen_bool(0.3).then(|| random_string(rng));
    BlockExtras {
        cache_salt: salt.filter(|s| !s.is_empty()),
        lora: rng
            .gen_bool(0.3)
            .then(|| (random_string(rng), random_string(rng))),
    }
}

#[test]
fn lookahead_block_hashes_match_python_on_random_inputs() {
    let mut rng = StdRng::seed_from_u64(20330);
    let mut cases = Vec::new();
    for i in 0..300 {
        let len = if i % 25 == 0 {
            rng.gen_range(13_000..14_000)
        } else {
            rng.gen_range(1..200)
        };
        let lookahead = [1usize, 3][i % 2];
        cases.push(Case {
            algo: if rng.gen_bool(0.5) {
                HashAlgo::Sha256
            } else {
                HashAlgo::Sha256Cbor
            },
            seed: if rng.gen_bool(0.7) {
                DEFAULT_SEED.to_string()
            } else {
                format!("{}", rng.gen::<u32>())
            },
            parent: rng.gen_bool(0.6).then(|| rng.gen()),
            tokens: (0..len).map(|_| random_token(&mut rng)).collect(),
            extras: random_extras(&mut rng),
            block_index: rng.gen_range(0..2),
            lookahead: (0..lookahead).map(|_| random_token(&mut rng)).collect(),
        });
    }
    let want = python_digests(&cases);
    for (c, w) in cases.iter().zip(&want) {
        let got = BlockHasher::new(c.algo, &c.seed).hash_block_lookahead(
            c.parent.as_ref(),
            &c.tokens,
            &c.extras,
            c.block_index,
            &c.lookahead,
        );
        assert_eq!(
            &hex(&got),
            w,
            "algo {} len {} extras {:?} lookahead {:?}",
            c.algo,
            c.tokens.len(),
            c.extras,
            c.lookahead
        );
    }
}

/// Whole request chains, as vLLM 0.33's request hasher walks them (a block hashes once its
/// lookahead tokens exist), through the index's digest cache and without it.
#[test]
fn lookahead_request_chains_match_python_on_random_inputs() {
    let mut rng = StdRng::seed_from_u64(20331);
    let mut cases = Vec::new();
    let mut inputs = Vec::new();
    for i in 0..200 {
        let algo = if rng.gen_bool(0.5) {
            HashAlgo::Sha256
        } else {
            HashAlgo::Sha256Cbor
        };
        let seed = if rng.gen_bool(0.7) {
            DEFAULT_SEED.to_string()
        } else {
            format!("{}", rng.gen::<u32>())
        };
        let block = [1usize, 4, 16][rng.gen_range(0..3)];
        let lookahead = [0usize, 1, 3][i % 3];
        let n = rng.gen_range(0..6 * block + 4);
        let tokens: Vec<u32> = (0..n).map(|_| random_token(&mut rng)).collect();
        let extras = random_extras(&mut rng);
        inputs.push(serde_json::json!({
            "algo": algo.to_string(),
            "seed": seed,
            "tokens": tokens,
            "block": block,
            "lookahead": lookahead,
            "lora": extras.lora.as_ref().map(|(n, p)| [n, p]),
            "salt": extras.cache_salt,
        }));
        cases.push((algo, seed, tokens, block, lookahead, extras));
    }
    let want: Vec<Vec<String>> = run_python("vllm_chain.py", &inputs);
    let cache = DigestCache::default();
    for ((algo, seed, tokens, block, lookahead, extras), w) in cases.iter().zip(&want) {
        let hasher = BlockHasher::new(*algo, seed);
        let plain = hasher.chain_lookahead(tokens, *block, extras, *lookahead);
        let got: Vec<String> = plain.iter().map(|d| hex(d)).collect();
        assert_eq!(
            &got,
            w,
            "{algo} block {block} L={lookahead} n={} {extras:?}",
            tokens.len()
        );
        // Twice through the cache: the second time from it.
        for _ in 0..2 {
            let (cached, _) = cache.chain(&hasher, tokens, *block, extras, *lookahead);
            assert_eq!(cached, plain, "{algo} block {block} L={lookahead}");
        }
    }
}

#[test]
fn long_blocks_cross_the_pickle_frame_boundary_like_cpython() {
    // Blocks sized so the pickle lands just below, at and above 64 KiB frames.
    let mut cases = Vec::new();
    for len in [13_100usize, 13_106, 13_107, 13_108, 13_110, 26_214, 26_300] {
        for tok in [7u32, 70_000, u32::MAX] {
            cases.push(Case {
                algo: HashAlgo::Sha256,
                seed: DEFAULT_SEED.into(),
                parent: None,
                tokens: vec![tok; len],
                extras: BlockExtras::default(),
                block_index: 1,
                lookahead: Vec::new(),
            });
        }
    }
    let want = python_digests(&cases);
    for (c, w) in cases.iter().zip(&want) {
        let got = BlockHasher::new(c.algo, &c.seed).hash_block(None, &c.tokens, &c.extras, 1);
        assert_eq!(
            &hex(&got),
            w,
            "len {} token {}",
            c.tokens.len(),
            c.tokens[0]
        );
    }
}

#[test]
fn the_pickle_of_a_plain_value_matches_python() {
    let v = PyValue::Tuple(vec![
        PyValue::Int(-1),
        PyValue::Int(1 << 70),
        PyValue::Str("x".repeat(300)),
    ]);
    let out = Command::new("python3")
        .args(["-c", "import pickle,sys; sys.stdout.write(pickle.dumps((-1, 1<<70, 'x'*300), protocol=5).hex())"])
        .output()
        .expect("python3");
    assert_eq!(
        hex(&kvroute_index::hash::pickle::dumps(&v)),
        String::from_utf8_lossy(&out.stdout)
    );
}
