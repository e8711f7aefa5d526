//! An engine's process killed (SIGKILL: its sockets close, nothing is said) and started again
//! on the same ports, empty, beside a simulated engine that keeps serving. While it is down no
//! request fails; once it is back the gateway reconnects, sees a new instance from seq 0,
//! rebuilds the rank from the new stream, and predicts it exactly again.

use super::*;
use kvroute::gateway::config::KvEventsSpec;
use std::process::{Child, Command, Stdio};

/// Three loopback ports free right now (HTTP, events, replay).
fn free_ports() -> [u16; 3] {
    let ls: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    [0, 1, 2].map(|i| ls[i].local_addr().unwrap().port())
}

/// `kvroute sim-worker` as its own process on `ports`.
fn spawn_engine(ports: [u16; 3]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "sim-worker",
            "--preset",
            PRESET,
            "--blocks",
            "96",
            "--speedup",
            "1000",
        ])
        .args(["--http", &format!("127.0.0.1:{}", ports[0])])
        .args(["--zmq", &format!("tcp://*:{}", ports[1])])
        .args(["--replay", &format!("tcp://*:{}", ports[2])])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

async fn wait_healthy(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(r) = reqwest::get(format!("{url}/health")).await {
            if r.status() == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} never became healthy");
}

async fn remote_contents(url: &str) -> Contents {
    let v: serde_json::Value = reqwest::get(format!("{url}/admin/cache"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    contents_of(&v)
}

async fn complete_on(url: &str, k: u32) {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": PRESET, "prompt": prompt(k), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// Bounded wait until the gateway's index of "px" equals the process's cache.
async fn px_converged(gw: &GatewayHandle, url: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if index_contents(gw, "px") == remote_contents(url).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_process_killed_and_started_again_on_its_ports_is_rebuilt_and_predicted_exactly()
{
    let ports = free_ports();
    let url = format!("http://127.0.0.1:{}", ports[0]);
    let mut child = spawn_engine(ports);
    wait_healthy(&url).await;
    let other = fleet(1).await;
    let mut px = WorkerSpec::new("px", &url, PRESET);
    px.kv_events = Some(KvEventsSpec {
        endpoint: format!("tcp://*:{}", ports[1]),
        replay_endpoint: Some(format!("tcp://*:{}", ports[2])),
        host: Some("127.0.0.1".into()),
        idle_reconnect_secs: 1.0,
        ..KvEventsSpec::new("")
    });
    let gw = gateway(vec![px, common::sim_spec(&other.workers[0], PRESET, true)]).await;
    for k in 0..6 {
        complete_on(&url, k).await;
    }
    assert!(px_converged(&gw, &url).await);
    let before = gw.state.registry.wire_stats.snapshot();

    child.kill().unwrap();
    let _ = child.wait();
    // Down: every request through the gateway is still served (retried on the other worker,
    // then routed there alone once the health check takes "px" out).
    for k in 0..6 {
        let (status, _, text) = common::post_completion(
            &gw,
            &json!({"model": PRESET, "prompt": prompt(100 + k), "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{text}");
    }

    // Back on the same ports, empty: a new instance whose stream starts at seq 0.
    let mut child = spawn_engine(ports);
    wait_healthy(&url).await;
    for k in 6..12 {
        complete_on(&url, k).await;
    }
    assert!(
        px_converged(&gw, &url).await,
        "the new instance's stream rebuilt the rank"
    );
    assert_eq!(common::degraded_ranks(&gw), 0);
    let after = gw.state.registry.wire_stats.snapshot();
    assert!(after.restarts > before.restarts, "seen as a new instance");
    assert!(after.reconnects > before.reconnects, "reconnected");
    // Probes: the gateway's prediction equals what the restarted engine reports.
    for k in [1u32, 7, 9] {
        let p = prompt(k);
        let predicted = common::predictions(&gw.admin_addr.to_string(), PRESET, &p)
            .await
            .into_iter()
            .find(|(w, _)| w == "px")
            .map_or(0, |(_, c)| c);
        assert_eq!(
            predicted,
            common::engine_cached(&url, PRESET, &p).await,
            "probe {k}"
        );
        assert!(px_converged(&gw, &url).await);
    }
    child.kill().unwrap();
    let _ = child.wait();
    gw.shutdown().await;
}
