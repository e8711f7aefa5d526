//! Configuration reload over real sockets: `POST /admin/reload` applies the file's policy,
//! weights (the index keeps eviction figures only under the eviction charge) and worker list
//! while a streaming request finishes on the worker being removed; an invalid file
//! is rejected whole with the reason and the old configuration stays; `kvroute serve` reloads
//! on SIGHUP.

use crate::common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::reload::ConfigSource;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, SimHandle, WorkerConfig};
use serde_json::{json, Value};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";

fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvroute-reload-{tag}-{}.toml", std::process::id()))
}

/// A configuration file on ephemeral loopback ports with `policy` and `workers`.
fn config_text(policy: &str, workers: &[(&str, &SimHandle)], extra: &str) -> String {
    let mut t = format!(
        "listen = '127.0.0.1:0'\nadmin_listen = '127.0.0.1:0'\nhealth_interval_secs = 0.1\n\
         explain_always = true\nworker_drain_timeout_secs = 10\npolicy = '{policy}'\n{extra}\n"
    );
    for (name, h) in workers {
        let port = h.zmq[0].rsplit(':').next().unwrap();
        t += &format!(
            "[[workers]]\nname = '{name}'\nurl = '{}'\nmodel = '{PRESET}'\n\
             [workers.kv_events]\nendpoint = 'tcp://*:{port}'\nhost = '127.0.0.1'\n",
            h.base_url
        );
    }
    t
}

async fn gateway_from(path: &Path) -> GatewayHandle {
    let cfg = GatewayConfig::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    let gw = Gateway::start(cfg).await.unwrap();
    gw.state.reloader.set_source(ConfigSource {
        path: path.to_path_buf(),
        overlay: None,
    });
    gw
}

async fn fleet(n: usize, speedup: f64) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = speedup;
    Fleet::start(FleetOptions::new(cfg, n)).await.unwrap()
}

async fn reload(gw: &GatewayHandle) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/admin/reload", gw.admin_addr))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reload_changes_policy_and_workers_while_a_streaming_request_on_a_removed_worker_finishes(
) {
    let f = fleet(2, 1.0).await;
    let path = temp_file("live");
    std::fs::write(
        &path,
        config_text("hybrid-aware", &[("w0", &f.workers[0])], ""),
    )
    .unwrap();
    let gw = gateway_from(&path).await;
    common::ready(&gw).await;
    let mut stream = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": (3..67).collect::<Vec<u32>>(), "max_tokens": 400, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.unwrap().is_some());

    // The file now names another policy, a body limit, the eviction charge and w1 instead of
    // w0.
    std::fs::write(
        &path,
        config_text(
            "least-load",
            &[("w1", &f.workers[1])],
            "max_body_bytes = 4096\n[weights]\neviction = true",
        ),
    )
    .unwrap();
    assert!(!gw.state.registry.index.tracks_evictions());
    let (status, report) = reload(&gw).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(
        report["policy"],
        json!({"from": "hybrid-aware", "to": "least-load"})
    );
    assert_eq!(report["workers"]["added"], json!(["w1"]));
    assert_eq!(report["workers"]["removed"], json!(["w0"]));
    assert_eq!(report["restart_required"], json!([]));
    // The eviction charge's figures are kept from now on.
    assert!(gw.state.registry.index.tracks_evictions());
    for field in ["policy", "max_body_bytes", "weights", "workers"] {
        assert!(
            report["changed"]
                .as_array()
                .unwrap()
                .contains(&json!(field)),
            "{report}"
        );
    }
    let v = common::admin_workers(&gw).await;
    assert_eq!(v["policy"], "least-load");
    assert_eq!(
        common::worker_names(&v),
        ["w0", "w1"],
        "w0 drains while its stream runs"
    );

    // The new limit applies at once; new requests go to w1.
    let big = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": vec![7u32; 5000], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 413);
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": [5, 6, 7, 8], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let d: Value =
        serde_json::from_str(r.headers()["x-kvroute-decision"].to_str().unwrap()).unwrap();
    assert_eq!(d["worker"], "w1");

    // The stream on w0 finishes whole; then w0 is gone.
    let mut body = Vec::new();
    while let Some(c) = stream.chunk().await.unwrap() {
        body.extend_from_slice(&c);
    }
    let body = String::from_utf8(body).unwrap();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while common::worker_names(&common::admin_workers(&gw).await) != ["w1"] {
        assert!(Instant::now() < deadline, "w0 was never removed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = common::admin_metrics(&gw).await;
    assert_eq!(
        common::metric(&text, "kvroute_config_reloads_total{result=\"ok\"}"),
        1.0
    );
    // The charge off again: the index stops keeping its figures.
    std::fs::write(
        &path,
        config_text(
            "least-load",
            &[("w1", &f.workers[1])],
            "max_body_bytes = 4096",
        ),
    )
    .unwrap();
    let (status, report) = reload(&gw).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["changed"], json!(["weights"]));
    assert!(!gw.state.registry.index.tracks_evictions());
    gw.shutdown().await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_config_is_rejected_whole_with_the_reason_and_the_old_one_stays() {
    let f = fleet(1, 1000.0).await;
    let path = temp_file("invalid");
    let good = config_text("round-robin", &[("w0", &f.workers[0])], "");
    std::fs::write(&path, &good).unwrap();
    let gw = gateway_from(&path).await;
    for (bad, reason) in [
        // A valid policy change beside an invalid worker: neither applies.
        (
            format!(
                "{}[[workers]]\nname = 'x'\nurl = 'ftp://h'\nmodel = 'm'\n",
                config_text("least-load", &[("w0", &f.workers[0])], "")
            ),
            "url",
        ),
        ("policy = 'fastest'\n".to_string(), "policy"),
        ("listen = \n".to_string(), "line 1"),
        (
            config_text(
                "round-robin",
                &[],
                "[discovery]\nkind = 'dns'\nname = 'x'\n",
            ),
            "port",
        ),
    ] {
        std::fs::write(&path, &bad).unwrap();
        let (status, body) = reload(&gw).await;
        assert_eq!(status, 400, "{body}");
        let msg = body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains(reason), "{reason}: {body}");
        assert!(msg.contains("kept"), "{body}");
        let v = common::admin_workers(&gw).await;
        assert_eq!(v["policy"], "round-robin");
        assert_eq!(common::worker_names(&v), ["w0"]);
    }
    assert_eq!(gw.state.config().policy.name(), "round-robin");
    let text = common::admin_metrics(&gw).await;
    assert_eq!(
        common::metric(&text, "kvroute_config_reloads_total{result=\"rejected\"}"),
        4.0
    );
    // The good file again: a reload that changes nothing keeps the worker and its state.
    std::fs::write(&path, &good).unwrap();
    let before = gw.state.registry.get("w0").unwrap();
    let (status, report) = reload(&gw).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["changed"], json!([]));
    assert!(std::sync::Arc::ptr_eq(
        &before,
        &gw.state.registry.get("w0").unwrap()
    ));
    // A listen address needs a restart: reported, the running one kept.
    std::fs::write(
        &path,
        good.replacen("listen = '127.0.0.1:0'", "listen = '127.0.0.1:1'", 1),
    )
    .unwrap();
    let (status, report) = reload(&gw).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["restart_required"], json!(["listen"]));
    assert_eq!(gw.state.config().listen.port(), 0);
    gw.shutdown().await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn a_gateway_started_without_a_file_answers_reload_with_409() {
    let gw = Gateway::start(common::gateway_config(Vec::new()))
        .await
        .unwrap();
    let (status, body) = reload(&gw).await;
    assert_eq!(status, 409);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--config"));
    gw.shutdown().await;
}

#[test]
fn kvroute_serve_reloads_its_config_file_on_sighup() {
    let path = temp_file("sighup");
    let base = "listen = '127.0.0.1:0'\nadmin_listen = '127.0.0.1:0'\n";
    std::fs::write(&path, format!("{base}policy = 'round-robin'\n")).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--config"])
        .arg(&path)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let admin = loop {
        let line = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        if let Some(rest) = line.split("(admin http://").nth(1) {
            break rest.trim_end_matches(')').to_string();
        }
    };
    let policy = || -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let v: Value = reqwest::get(format!("http://{admin}/admin/workers"))
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["policy"].as_str().unwrap().to_string()
        })
    };
    assert_eq!(policy(), "round-robin");
    std::fs::write(&path, format!("{base}policy = 'least-load'\n")).unwrap();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while policy() != "least-load" {
        assert!(Instant::now() < deadline, "SIGHUP did not reload");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn a_reload_swaps_the_tenants_keys_and_a_bad_key_file_rejects_it_whole() {
    let f = fleet(1, 1000.0).await;
    let path = temp_file("tenants");
    let open = config_text("round-robin", &[("w0", &f.workers[0])], "");
    std::fs::write(&path, &open).unwrap();
    let gw = gateway_from(&path).await;
    let ask = |key: Option<&'static str>| {
        let url = format!("http://{}/v1/completions", gw.addr);
        async move {
            let mut r = reqwest::Client::new()
                .post(url)
                .json(&json!({"model": PRESET, "prompt": [1, 2, 3], "max_tokens": 1}));
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            r.send().await.unwrap().status().as_u16()
        }
    };
    assert_eq!(ask(None).await, 200, "no tenants: the door is open");
    let with = |keys: &str| {
        let (head, rest) = open.split_once("[[workers]]").unwrap();
        format!("{head}[[tenants]]\nname = 'team-a'\n{keys}\n[[workers]]{rest}")
    };
    std::fs::write(&path, with("api_keys = ['sk-one']")).unwrap();
    let (status, report) = reload(&gw).await;
    assert_eq!(status, 200, "{report}");
    assert!(report["changed"]
        .as_array()
        .unwrap()
        .contains(&json!("tenants")));
    assert_eq!(ask(None).await, 401);
    assert_eq!(ask(Some("sk-one")).await, 200);
    // A key file that cannot be read: nothing changes.
    std::fs::write(
        &path,
        with("api_keys_file = '/nonexistent/kvroute-keys'\nrequests_per_second = 1"),
    )
    .unwrap();
    let (status, body) = reload(&gw).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(ask(Some("sk-one")).await, 200, "the old keys stay");
    gw.shutdown().await;
    let _ = std::fs::remove_file(&path);
}
