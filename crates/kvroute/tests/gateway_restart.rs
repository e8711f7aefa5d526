//! Warm restarts over real sockets: the `kvroute serve` binary in front of a simulated fleet,
//! stopped with SIGTERM (the snapshot written at shutdown) or SIGKILL (the last periodic one),
//! restarted from its snapshot while the engines went on caching, predicts exactly what a
//! replica that never stopped predicts. The fleet's replay buffers are too short for a cold
//! start to catch up, so the restart's exactness is the snapshot's: a cold replica started at
//! the same time is degraded. A corrupt snapshot starts the gateway cold and says why. A
//! graceful shutdown lets a stream in flight finish and refuses new connections; readiness
//! waits for the subscriptions' first catch-up, liveness does not.

mod common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";
/// Batches each engine's replay endpoint keeps: fewer than the traffic before a restart, more
/// than the traffic while the gateway is down.
const REPLAY_BUFFER: usize = 24;

async fn fleet() -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    let mut opts = FleetOptions::new(cfg, 2);
    opts.replay_buffer_steps = REPLAY_BUFFER;
    Fleet::start(opts).await.unwrap()
}

/// The replica that never stops (in process, no snapshot).
async fn steady(f: &Fleet) -> GatewayHandle {
    let workers = f.workers.iter().map(|h| common::sim_spec(h, PRESET, true));
    let gw = Gateway::start(common::gateway_config(workers.collect()))
        .await
        .unwrap();
    common::ready(&gw).await;
    gw
}

/// A `kvroute serve` process and its addresses.
struct Served {
    child: Child,
    front: String,
    admin: String,
}

fn worker_flags(f: &Fleet) -> Vec<String> {
    f.workers
        .iter()
        .flat_map(|h| {
            let port = h.zmq[0].rsplit(':').next().unwrap();
            let rport = h.replay[0].rsplit(':').next().unwrap();
            [
                "--worker".to_string(),
                format!(
                    "name={},url={},model={PRESET},events=tcp://*:{port},replay=tcp://*:{rport},host=127.0.0.1",
                    h.name, h.base_url
                ),
            ]
        })
        .collect()
}

/// Starts the binary with a snapshot at `snapshot` and waits for its listening line.
fn serve(f: &Fleet, snapshot: &Path, interval: &str) -> Served {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--snapshot-path", snapshot.to_str().unwrap()])
        .args(["--snapshot-interval-secs", interval])
        .args(["--shutdown-timeout-secs", "5"])
        .args(worker_flags(f))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Keeps reading so the child never blocks on a full pipe.
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kvroute listening on http://") {
                let front = rest.split_whitespace().next().unwrap_or("").to_string();
                let admin = rest
                    .split("admin http://")
                    .nth(1)
                    .unwrap_or("")
                    .trim_end_matches(')')
                    .to_string();
                let _ = tx.send((front, admin));
            }
        }
    });
    let (front, admin) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("kvroute serve printed its addresses");
    Served {
        child,
        front,
        admin,
    }
}

impl Served {
    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let r = reqwest::get(format!("http://{}/health/ready", self.front)).await;
            if r.is_ok_and(|r| r.status() == 200) {
                return;
            }
            assert!(Instant::now() < deadline, "never ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn admin(&self, path: &str) -> Value {
        reqwest::get(format!("http://{}{path}", self.admin))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    fn terminate(mut self) {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(ok.success());
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "a SIGTERM shutdown exits 0: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

/// Conversations over a few shared prefixes: `k` picks one.
fn request(k: u32) -> Vec<u32> {
    let mut p = prompt(k % 4, 96);
    p.extend(prompt(100 + k, 40 + 4 * (k as usize % 9)));
    p
}

async fn complete(front: &str, prompt: &[u32]) {
    let r = reqwest::Client::new()
        .post(format!("http://{front}/v1/completions"))
        .json(&json!({"model": PRESET, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

async fn predictions(admin: &str, tokens: &[u32]) -> Vec<(String, u64)> {
    common::predictions(admin, PRESET, tokens).await
}

fn probes() -> Vec<Vec<u32>> {
    (0..30u32).map(request).collect()
}

/// Waits until `a` and `b` predict the same for every probe and returns both answers; fails
/// the test with both when they still differ at the wait's deadline.
async fn agreement(a: &str, b: &str) -> (Vec<Vec<(String, u64)>>, Vec<Vec<(String, u64)>>) {
    common::wait_for(
        common::WAIT,
        "both gateways to predict the same",
        || async {
            let (mut pa, mut pb) = (Vec::new(), Vec::new());
            for p in probes() {
                pa.push(predictions(a, &p).await);
                pb.push(predictions(b, &p).await);
            }
            if pa == pb {
                Ok((pa, pb))
            } else {
                Err(format!("{pa:?} against {pb:?}"))
            }
        },
    )
    .await
}

fn temp_snapshot(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-warm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("index.toml")
}

/// Sends requests `from..to` straight to the engines, in turn (both gateways only listen).
async fn traffic(f: &Fleet, from: u32, to: u32) {
    for k in from..to {
        let h = &f.workers[k as usize % f.workers.len()];
        complete(&h.http.to_string(), &request(k)).await;
    }
}

fn steady_admin(g: &GatewayHandle) -> String {
    g.admin_addr.to_string()
}

/// What a restart must show: the snapshot loaded, predictions equal to the steady replica's,
/// and a cold replica started now degraded (the replay buffer could not rebuild it).
async fn assert_warm(f: &Fleet, a: &GatewayHandle, b: &Served) {
    let status = b.admin("/admin/snapshot").await;
    assert_eq!(status["load"]["result"], "loaded", "{status}");
    assert_eq!(status["load"]["matched"]["ranks"], 2, "{status}");
    let (want, got) = agreement(&steady_admin(a), &b.admin).await;
    assert_eq!(
        got, want,
        "the restarted gateway predicts as the steady one"
    );
    assert!(
        want.iter().flatten().any(|(_, c)| *c > 0),
        "the probes hit something"
    );
    let cold = steady(f).await;
    common::wait_until(
        common::WAIT,
        "both ranks of a cold start degraded: it cannot rebuild from the short replay buffers",
        || async { common::degraded_ranks(&cold) == 2 },
    )
    .await;
    cold.shutdown().await;
}

/// A fleet, a steady replica, and a served gateway (snapshots every `interval` s, or only at
/// shutdown for "0") that saw 60 requests and agrees with the steady one.
async fn before_the_restart(tag: &str, interval: &str) -> (Fleet, GatewayHandle, PathBuf, Served) {
    let f = fleet().await;
    let a = steady(&f).await;
    let path = temp_snapshot(tag);
    let b = serve(&f, &path, interval);
    b.wait_ready().await;
    traffic(&f, 0, 60).await;
    let (want, got) = agreement(&steady_admin(&a), &b.admin).await;
    assert_eq!(got, want, "two replicas agree before the restart");
    (f, a, path, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stopped_with_sigterm_restarts_warm_and_replays_what_it_missed() {
    let (f, a, path, b) = before_the_restart("term", "0").await;
    b.terminate();
    assert!(path.exists(), "SIGTERM wrote the snapshot");
    // The engines go on while the gateway is down.
    traffic(&f, 60, 64).await;
    let b = serve(&f, &path, "0");
    b.wait_ready().await;
    assert_warm(&f, &a, &b).await;
    b.terminate();
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_restarts_from_its_last_periodic_snapshot() {
    let (f, a, path, b) = before_the_restart("kill", "0.2").await;
    // A periodic snapshot after the traffic (written after b took it all in), then more
    // events, which b takes in before it is killed.
    common::settle_at(&b.admin, &[]).await;
    let taken_in = std::time::SystemTime::now();
    common::wait_until(
        common::WAIT,
        "a periodic snapshot after the traffic",
        || async {
            std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > taken_in)
        },
    )
    .await;
    traffic(&f, 60, 62).await;
    common::settle_at(&b.admin, &[]).await;
    b.kill();
    traffic(&f, 62, 64).await;
    let b = serve(&f, &path, "0.2");
    b.wait_ready().await;
    assert_warm(&f, &a, &b).await;
    b.kill();
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_snapshot_starts_the_gateway_cold_and_says_why() {
    let f = fleet().await;
    let path = temp_snapshot("corrupt");
    let workers: Vec<_> = f
        .workers
        .iter()
        .map(|h| common::sim_spec(h, PRESET, true))
        .collect();
    let cfg = GatewayConfig {
        snapshot_path: Some(path.clone()),
        ..common::gateway_config(workers)
    };
    let cases = [
        (
            "truncated",
            "format = \"kvroute-snapshot\"\nversion = 1\n[body\n",
        ),
        ("another format", "format = \"other\"\nversion = 1\n"),
        (
            "another version",
            "format = \"kvroute-snapshot\"\nversion = 7\n",
        ),
    ];
    for (what, text) in cases {
        std::fs::write(&path, text).unwrap();
        let gw = Gateway::start(cfg.clone()).await.unwrap();
        let status: Value = reqwest::get(format!("http://{}/admin/snapshot", gw.admin_addr))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(status["load"]["result"], "refused", "{what}: {status}");
        assert!(
            status["load"]["reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "{what}: {status}"
        );
        let metrics = common::admin_metrics(&gw).await;
        assert!(
            metrics.contains("kvroute_snapshot_loads_total{result=\"refused\"} 1"),
            "{what}"
        );
        // Cold, but serving.
        complete(&gw.addr.to_string(), &request(1)).await;
        gw.shutdown().await;
        // The shutdown replaced the bad file with a good one.
        assert!(kvroute::gateway::snapshot::load(&path).is_ok(), "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_lets_the_stream_in_flight_finish_and_accepts_nothing_new() {
    // Engines in real time: a 200-token answer streams for about a second.
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1.0;
    let f = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    let workers = f.workers.iter().map(|h| common::sim_spec(h, PRESET, true));
    let path = temp_snapshot("graceful");
    let gw = Gateway::start(GatewayConfig {
        snapshot_path: Some(path.clone()),
        ..common::gateway_config(workers.collect())
    })
    .await
    .unwrap();
    let front = gw.addr.to_string();
    let mut r = reqwest::Client::new()
        .post(format!("http://{front}/v1/completions"))
        .json(&json!({"model": PRESET, "prompt": request(1), "max_tokens": 200, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.chunk().await.unwrap().is_some(), "the stream started");
    let stopping = tokio::spawn(gw.shutdown());
    common::wait_until(
        common::WAIT,
        "no new connection once the shutdown began",
        || async {
            reqwest::Client::new()
                .get(format!("http://{front}/health/live"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_err()
        },
    )
    .await;
    let mut body = String::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(body.contains("[DONE]"), "the stream in flight finished");
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("the shutdown ends after the stream")
        .unwrap();
    assert!(
        path.exists(),
        "the snapshot was written after the last request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_a_worker_and_the_first_catch_up_while_liveness_answers_at_once() {
    let empty = Gateway::start(common::gateway_config(Vec::new()))
        .await
        .unwrap();
    let live = reqwest::get(format!("http://{}/health/live", empty.addr))
        .await
        .unwrap();
    assert_eq!(live.status(), 200);
    let ready = reqwest::get(format!("http://{}/health/ready", empty.addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let v: Value = ready.json().await.unwrap();
    assert_eq!(v["reason"], "no routable worker");
    empty.shutdown().await;
    // A worker whose event port nobody publishes on: healthy, but never caught up.
    let f = fleet().await;
    let mut spec = common::sim_spec(&f.workers[0], PRESET, true);
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    if let Some(kv) = spec.kv_events.as_mut() {
        kv.endpoint = format!("tcp://*:{port}");
        kv.replay_endpoint = None;
    }
    // No wait: the subscription can never catch up, so it is listed from the start.
    let gw = Gateway::start(common::gateway_config(vec![spec]))
        .await
        .unwrap();
    let ready = reqwest::get(format!("http://{}/health/ready", gw.addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let v: Value = ready.json().await.unwrap();
    assert_eq!(v["catching_up"], json!(["w0"]), "{v}");
    gw.shutdown().await;
    // The fleet as it is: ready once the subscriptions replayed.
    let a = steady(&f).await;
    let ready = reqwest::get(format!("http://{}/health/ready", a.addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_worker_resumes_from_the_snapshot_like_a_configured_one() {
    let f = fleet().await;
    let a = steady(&f).await;
    let path = temp_snapshot("discovered");
    let dir = path.with_file_name("workers.d");
    std::fs::create_dir_all(&dir).unwrap();
    for h in &f.workers {
        let port = h.zmq[0].rsplit(':').next().unwrap();
        let rport = h.replay[0].rsplit(':').next().unwrap();
        std::fs::write(
            dir.join(format!("{}.toml", h.name)),
            format!(
                "name = '{}'\nurl = '{}'\nmodel = '{PRESET}'\n[kv_events]\nendpoint = 'tcp://*:{port}'\nreplay_endpoint = 'tcp://*:{rport}'\nhost = '127.0.0.1'\n",
                h.name, h.base_url
            ),
        )
        .unwrap();
    }
    let start = || async {
        let cfg = GatewayConfig {
            snapshot_path: Some(path.clone()),
            discovery: Some(
                toml::from_str(&format!(
                    "kind = 'dir'\npath = '{}'\ninterval_secs = 0.05\n",
                    dir.display()
                ))
                .unwrap(),
            ),
            ..common::gateway_config(Vec::new())
        };
        let gw = Gateway::start(cfg).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while gw.state.registry.all().len() < 2 {
            assert!(Instant::now() < deadline, "discovery found the workers");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        gw
    };
    let b = start().await;
    common::ready(&b).await;
    traffic(&f, 0, 60).await;
    let (want, got) = agreement(&steady_admin(&a), &b.admin_addr.to_string()).await;
    assert_eq!(got, want);
    b.shutdown().await;
    traffic(&f, 60, 64).await;
    let b = start().await;
    let status = b.state.snapshot.lock().clone();
    let load = status.load.expect("the start met the snapshot");
    assert_eq!(load.result, "loaded");
    assert_eq!(load.matched.gone.len(), 2, "both wait for discovery");
    let (want, got) = agreement(&steady_admin(&a), &b.admin_addr.to_string()).await;
    assert_eq!(
        got, want,
        "the discovered workers resumed and replayed what they missed"
    );
    let degraded = common::degraded_ranks(&b);
    assert_eq!(degraded, 0);
    b.shutdown().await;
    a.shutdown().await;
}
