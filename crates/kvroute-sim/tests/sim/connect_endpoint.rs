//! A simulated worker whose event endpoint names a concrete host connects to its subscriber, as
//! vLLM does: it serves HTTP at once with nobody listening, delivers events to a subscriber
//! that binds later, and reconnects to one that restarts — on every DP rank's port.

use crate::common;

use common::{get, post};
use kvroute_sim::{fleet, PublisherConfig, WorkerConfig};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketRecv, SubSocket};

/// A port `p` with `p + 1` free too (DP rank 1 publishes on `p + 1`).
fn two_free_ports() -> u16 {
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

async fn completion(addr: SocketAddr, first: u32) -> serde_json::Value {
    let prompt: Vec<u32> = (first..first + 200).map(|t| t % 1000).collect();
    let body = json!({"prompt": prompt, "max_tokens": 2});
    tokio::time::timeout(
        Duration::from_secs(10),
        post(addr, "/v1/completions", &body),
    )
    .await
    .expect("the worker answers without a subscriber")
    .json()
}

async fn connected(addr: SocketAddr, rank: usize) -> bool {
    let cache = get(addr, "/admin/cache").await.json();
    cache["ranks"][rank]["publisher"]["connected"] == json!(true)
}

async fn wait_connected(addr: SocketAddr, ranks: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for r in 0..ranks {
        while !connected(addr, r).await {
            assert!(Instant::now() < deadline, "rank {r} never connected");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn bind_subscribers(port: u16, ranks: u16) -> Vec<SubSocket> {
    let mut subs = Vec::new();
    for r in 0..ranks {
        // A port the sockets just dropped held may take a moment to be free again.
        let endpoint = format!("tcp://127.0.0.1:{}", port + r);
        let mut s = common::wait_for(common::WAIT, &format!("binding {endpoint}"), || async {
            let mut s = SubSocket::new();
            s.bind(&endpoint)
                .await
                .map(|_| s)
                .map_err(|e| e.to_string())
        })
        .await;
        s.subscribe("").await.unwrap();
        subs.push(s);
    }
    subs
}

/// Sends distinct prompts until every subscriber has received a batch from its own rank.
async fn every_rank_delivers(addr: SocketAddr, subs: &mut [SubSocket], first: u32) {
    for (rank, sub) in subs.iter_mut().enumerate() {
        let mut got = None;
        for k in 0..20u32 {
            completion(addr, first + k * 211).await;
            if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
                got = Some(m);
                break;
            }
        }
        let m = got.unwrap_or_else(|| panic!("rank {rank} delivered nothing"));
        let frames: Vec<Vec<u8>> = m.into_vec().iter().map(|f| f.to_vec()).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (_, _, batch) = kvroute_wire::decode_message(&"w0".into(), &refs).unwrap();
        assert_eq!(batch.dp_rank, Some(rank as u32), "filed under its own rank");
        assert!(!batch.events.is_empty());
    }
}

#[tokio::test]
async fn a_connecting_worker_serves_before_its_subscriber_exists_and_delivers_once_it_binds() {
    let port = two_free_ports();
    let mut cfg = WorkerConfig::for_preset("tiny-gemma3").unwrap();
    cfg.speedup = 1000.0;
    cfg.data_parallel_size = 2;
    cfg.zmq = Some(PublisherConfig::new(&format!("tcp://127.0.0.1:{port}")));
    let w = tokio::time::timeout(
        Duration::from_secs(5),
        fleet::start_worker("w0", cfg, ([127, 0, 0, 1], 0).into()),
    )
    .await
    .expect("starting does not wait for a subscriber")
    .unwrap();
    assert_eq!(get(w.http, "/health").await.status, 200);
    // Nobody listens: requests are served and their batches counted as undelivered.
    for k in 0..4 {
        let r = completion(w.http, 10 + k * 300).await;
        assert_eq!(r["usage"]["prompt_tokens"], 200);
    }
    let cache = get(w.http, "/admin/cache").await.json();
    let undelivered: u64 = (0..2)
        .map(|r| {
            cache["ranks"][r]["publisher"]["undelivered"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(undelivered > 0, "batches with no subscriber are counted");

    let mut subs = bind_subscribers(port, 2).await;
    wait_connected(w.http, 2).await;
    every_rank_delivers(w.http, &mut subs, 5000).await;

    // The subscribers restart on the same ports: the worker reconnects to the new ones.
    // No pause: every_rank_delivers sends until a batch arrives on the new sockets.
    drop(subs);
    let mut subs = bind_subscribers(port, 2).await;
    wait_connected(w.http, 2).await;
    every_rank_delivers(w.http, &mut subs, 9000).await;
    let cache = get(w.http, "/admin/cache").await.json();
    for r in 0..2 {
        assert!(cache["ranks"][r]["publisher"]["connects"].as_u64().unwrap() >= 2);
    }
}
