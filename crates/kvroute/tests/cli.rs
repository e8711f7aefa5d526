//! The command line, run as a real process: the conformance check on every committed corpus
//! and on every fixture recorded from vLLM's own scheduler code (`conformance/oracle/`, with
//! the tier part and the reference model),
//! `hash` against the spec's test vectors, `events decode` → `explain` round trip, and clear
//! errors on unreadable corpora; `sim-worker` started as each engine generation.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn kvroute(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run kvroute")
}

#[test]
fn every_committed_corpus_passes_the_conformance_check() {
    let mut dirs: Vec<String> = std::fs::read_dir(repo().join("conformance/corpus"))
        .expect("conformance/corpus")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("meta.json").exists())
        .map(|e| e.path().display().to_string())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty());
    let mut args = vec!["conformance"];
    args.extend(dirs.iter().map(String::as_str));
    let out = kvroute(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.ends_with(" passed, 0 failed"), "{last}");
    assert!(
        stdout.contains("hash check") && stdout.contains(" 0 mismatched"),
        "{stdout}"
    );
}

/// The fixtures `conformance/oracle/drive.py` recorded from vLLM 0.32's and 0.33's own
/// scheduler-side code (KV cache manager, block pool events, offload connectors): the index's
/// prediction, its tier part and the reference model's prediction must equal vLLM's hit on
/// every request, except exactly the requests `known-disagreements.txt` lists.
#[test]
fn every_oracle_fixture_agrees_with_vllm_s_own_code_but_the_listed_disagreements() {
    let root = repo().join("conformance/oracle");
    let mut dirs: Vec<String> = std::fs::read_dir(root.join("fixtures"))
        .expect("conformance/oracle/fixtures")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("meta.json").exists())
        .map(|e| e.path().display().to_string())
        .collect();
    dirs.sort();
    for version in ["v032-", "v033-"] {
        assert!(
            dirs.iter().any(|d| d.contains(version)),
            "no {version} fixture"
        );
    }
    let mut args = vec!["conformance", "--reference"];
    args.extend(dirs.iter().map(String::as_str));
    let out = kvroute(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let failing: std::collections::BTreeSet<String> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("FAIL "))
        .map(|l| {
            let mut words = l.split_whitespace();
            let dir = words.next().unwrap_or_default();
            let name = dir.rsplit('/').next().unwrap_or(dir).trim_end_matches(':');
            format!("{name} {}", words.next().unwrap_or_default())
        })
        .collect();
    let listed = std::fs::read_to_string(root.join("known-disagreements.txt"))
        .expect("known-disagreements.txt");
    let known: std::collections::BTreeSet<String> = listed
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        failing,
        known,
        "failing requests differ from known-disagreements.txt\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.success(), known.is_empty(), "{stdout}");
    // The tier part was checked, and some requests were served from a tier.
    let served: usize = stdout
        .lines()
        .filter_map(|l| l.split("tier part checked on ").nth(1))
        .filter_map(|l| {
            l.split('(')
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .sum();
    assert!(served > 50, "tier-served requests: {served}\n{stdout}");
    assert!(stdout.contains("reference model checked on"), "{stdout}");
}

#[test]
fn hash_prints_the_spec_test_vectors() {
    for (algo, want) in [
        ("sha256", ["3262291359910021016", "7142137847444424233"]),
        (
            "sha256_cbor",
            ["2233398808101521225", "17911472383915781900"],
        ),
    ] {
        let out = kvroute(&[
            "hash",
            "--algo",
            algo,
            "--hash-block-size",
            "16",
            "--tokens",
            "0..40",
        ]);
        let s = String::from_utf8_lossy(&out.stdout);
        let values: Vec<&str> = s
            .lines()
            .map(|l| l.split('\t').nth(1).unwrap_or_default())
            .collect();
        assert_eq!(values, want, "{algo}");
    }
}

/// vLLM 0.33's own request hasher gave these (tokens 1..=10, hash block 4): with one lookahead
/// token both blocks hash, with three only the first (block [4, 8) needs tokens 9..=11).
#[test]
fn hash_with_lookahead_prints_vllm_0_33_s_lookahead_hashes() {
    for (lookahead, want) in [
        ("1", &["8a35c24a38f8f50a", "361f825e09047d65"][..]),
        ("0", &["52a7f141c60918f6", "bee96bce54f5fcab"][..]),
        ("3", &[][..]),
    ] {
        let out = kvroute(&[
            "hash",
            "--hash-block-size",
            "4",
            "--lookahead",
            lookahead,
            "--tokens",
            "1..11",
        ]);
        assert!(out.status.success(), "{out:?}");
        let s = String::from_utf8_lossy(&out.stdout);
        let rows: Vec<Vec<&str>> = s.lines().map(|l| l.split('\t').collect()).collect();
        let heads: Vec<&str> = rows.iter().map(|r| &r[2][..16]).collect();
        if lookahead == "3" {
            assert_eq!(rows.len(), 1, "{s}");
            assert_eq!(rows[0][0], "0");
        } else {
            assert_eq!(heads, want, "L={lookahead}");
            // Index, the 64-bit value (the digest's last 8 bytes), the digest: as without.
            let tail = u64::from_str_radix(&rows[1][2][48..], 16).unwrap();
            assert_eq!(rows[1][1], tail.to_string());
        }
    }
}

/// A vLLM 0.33 batch with lookahead hashes (the wire crate's msgspec fixture) decodes with each
/// block's lookahead tokens in the normalized event.
#[test]
fn events_decode_shows_the_lookahead_tokens_of_a_vllm_0_33_store() {
    let fixture = repo().join("crates/kvroute-wire/tests/data/vllm033-lookahead/batches.jsonl");
    let text = std::fs::read_to_string(&fixture).expect("fixture");
    let line: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
        .find(|v| v["name"] == "bytes-l1")
        .expect("bytes-l1");
    // [topic "kv", seq 0, payload], base64.
    let frames = serde_json::json!({
        "worker": "w0",
        "frames": ["a3Y=", "AAAAAAAAAAA=", line["payload"]],
    });
    let path = std::env::temp_dir().join(format!("kvroute-cli-033-{}.jsonl", std::process::id()));
    std::fs::write(&path, format!("{frames}\n")).expect("write frames");
    let out = kvroute(&["events", "decode", &path.display().to_string()]);
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let tokens: Vec<u64> = serde_json::from_value(line["tokens"].clone()).expect("tokens");
    let want = format!(
        "\"lookahead_token_ids\":[[{}],[{}],[{}]]",
        tokens[4], tokens[8], tokens[12]
    );
    assert!(
        stdout.lines().next().is_some_and(|l| l.contains(&want)),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("events_stored: 2"), "{stderr}");
    assert!(!stderr.contains("dropped_"), "{stderr}");
}

#[test]
fn decoded_events_explain_a_recorded_request_like_the_engine_served_it() {
    let dir = repo().join("conformance/corpus/gemma3-basic");
    let out = kvroute(&[
        "events",
        "decode",
        &dir.join("frames.jsonl").display().to_string(),
    ]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("batches_decoded: 30"), "{stderr}");
    let tmp = std::env::temp_dir().join(format!("kvroute-cli-{}.jsonl", std::process::id()));
    std::fs::write(&tmp, &out.stdout).unwrap();
    // r5 of the sample: 83 tokens, the engine served 64 from cache. The whole stream is applied
    // (the sample has no evictions and nothing later extends r5's prefix), so the answer stays 64.
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert!(lines.len() > 20);
    let requests = std::fs::read_to_string(dir.join("requests.jsonl")).unwrap();
    let r5: serde_json::Value = serde_json::from_str(requests.lines().nth(5).unwrap()).unwrap();
    let toks: Vec<String> = r5["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let out = kvroute(&[
        "explain",
        "--events",
        &tmp.display().to_string(),
        "--tokens",
        &toks.join(","),
    ]);
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("w0 rank 0: predicted 64 cached tokens"), "{s}");
    assert!(s.contains("group  3 full_attention"), "{s}");
    let _ = std::fs::remove_file(tmp);
}

#[test]
fn an_unreadable_corpus_is_a_clear_error_naming_the_file_and_line() {
    let dir = std::env::temp_dir().join(format!("kvroute-bad-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("meta.json"),
        r#"{"format": "kvroute-conformance/1"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("frames.jsonl"),
        "{\"worker\": \"w0\", \"frames\": []}\nnot json\n",
    )
    .unwrap();
    std::fs::write(dir.join("requests.jsonl"), "").unwrap();
    let out = kvroute(&["conformance", &dir.display().to_string()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("frames.jsonl:2"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_small_demo_prints_the_table_with_a_disaggregated_row_and_writes_json_and_both_plots() {
    let dir = std::env::temp_dir().join(format!("kvroute-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("demo.json");
    let plot = dir.join("plot");
    let out = kvroute(&[
        "demo",
        "--preset",
        "tiny-qwen3-next",
        "--tokens-per-block",
        "16",
        "--max-requests",
        "24",
        "--blocks",
        "200",
        "--speed",
        "200",
        "--pd",
        "2p2d",
        "--quiet",
        "--json",
        &json.display().to_string(),
        "--plot",
        &plot.display().to_string(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for p in [
        "hybrid-aware",
        "group-blind",
        "round-robin",
        "least-load",
        "hybrid-aware 2p2d",
    ] {
        assert!(stdout.contains(p), "{stdout}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 5);
    // The disaggregated row ran on the decode pool only (every answer is a decode worker's),
    // with both legs' engine time in its TTFT.
    let pd = &rows[4];
    assert_eq!(pd["policy"], "hybrid-aware 2p2d");
    let answered: Vec<&String> = pd["per_worker"].as_object().unwrap().keys().collect();
    assert!(!answered.is_empty(), "{pd}");
    assert!(answered.iter().all(|w| w.starts_with('d')), "{pd}");
    assert!(pd["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{pd}");
    for r in rows {
        for k in [
            "reuse",
            "prediction_error",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "throughput_rps",
            "requests",
            "failed",
        ] {
            assert!(r.get(k).is_some(), "{k} missing in {r}");
        }
        assert_eq!(r["requests"], 24);
        assert_eq!(r["failed"], 0, "{r}");
    }
    assert!(std::fs::read_to_string(dir.join("plot.svg"))
        .unwrap()
        .starts_with("<svg"));
    assert_eq!(
        &std::fs::read(dir.join("plot.png")).unwrap()[..4],
        b"\x89PNG"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `GET /version` of a server on `port`, once it answers.
fn version_of(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.write_all(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let json = body.split("\r\n\r\n").nth(1)?;
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v["version"].as_str().map(str::to_string)
}

#[test]
fn a_sim_worker_started_as_vllm_0_33_with_an_eagle_drafter_reports_0_33() {
    for (flags, want) in [
        (vec![], "0.32.0"),
        (
            vec![
                "--engine-version",
                "0.33",
                "--speculative-config",
                r#"{"method": "eagle3", "num_speculative_tokens": 3}"#,
            ],
            "0.33.0",
        ),
    ] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let http = format!("127.0.0.1:{port}");
        let mut args = vec!["sim-worker", "--preset", "llama", "--http", &http];
        args.extend(flags.iter().copied());
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(&args)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start sim-worker");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut got = None;
        while got.is_none() && std::time::Instant::now() < deadline {
            got = version_of(port);
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(got.as_deref(), Some(want), "{args:?}");
    }
    let out = kvroute(&[
        "sim-worker",
        "--preset",
        "llama",
        "--engine-version",
        "0.31",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported engine version"));
}

#[test]
fn serve_check_config_validates_the_file_and_flags_then_exits_without_listening() {
    let dir = std::env::temp_dir().join(format!("kvroute-check-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvroute.toml");
    // A port something already listens on: a start would fail to bind, a check never binds.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    std::fs::write(
        &file,
        format!("listen = \"{listen}\"\nadmin_listen = \"0.0.0.0:8081\"\n"),
    )
    .unwrap();
    let check = |token: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvroute"));
        c.args([
            "serve",
            "--config",
            file.to_str().unwrap(),
            "--check-config",
        ])
        .env_remove("KVROUTE_ADMIN_TOKEN");
        if let Some(t) = token {
            c.env("KVROUTE_ADMIN_TOKEN", t);
        }
        c.output().expect("run kvroute serve --check-config")
    };
    // The admin API beyond loopback without a token: refused, naming the file and the reason.
    let refused = check(None);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        stderr.contains("kvroute.toml") && stderr.contains("admin_listen is not loopback"),
        "{stderr}"
    );
    // The token from the environment (as the flag's env var) makes it valid.
    let ok = check(Some("secret"));
    let stderr = String::from_utf8_lossy(&ok.stderr);
    assert!(ok.status.success(), "{stderr}");
    assert!(stderr.contains("configuration valid"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_check_config_refuses_an_unusable_trace_endpoint_or_protocol_naming_it() {
    let check = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvroute"));
        c.args(["serve", "--check-config"]).args(args);
        for k in [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_SDK_DISABLED",
        ] {
            c.env_remove(k);
        }
        c.envs(env.iter().copied());
        let out = c.output().expect("run kvroute serve --check-config");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let flag = ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"];
    let (ok, stderr) = check(&flag, &[]);
    assert!(ok && stderr.contains("configuration valid"), "{stderr}");
    let (ok, stderr) = check(&["--otlp-traces-endpoint", "collector:4318"], &[]);
    assert!(
        !ok && stderr.contains("tracing.otlp_traces_endpoint"),
        "{stderr}"
    );
    // The environment's protocol applies to the flag's endpoint: grpc is built in, http/json
    // is not.
    let (ok, stderr) = check(&flag, &[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]);
    assert!(ok && stderr.contains("configuration valid"), "{stderr}");
    let (ok, stderr) = check(&flag, &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]);
    assert!(
        !ok && stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL"),
        "{stderr}"
    );
    let (ok, stderr) = check(&[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "4318")]);
    assert!(
        !ok && stderr.contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
        "{stderr}"
    );
}
