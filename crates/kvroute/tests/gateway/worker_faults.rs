//! A worker's HTTP failing in every way a process or a network can, over real sockets: it
//! accepts and never answers, resets the connection, answers a stream request with 503, or
//! streams half an answer and dies. Before any byte reached the client the request is retried
//! on the next worker and the client is served; after, the client's stream ends with vLLM's
//! error event and `[DONE]` instead of a cut connection. Each failure counts against the
//! worker, and a good request right after is served.

use crate::common;
use kvroute::gateway::config::WorkerSpec;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const PRESET: &str = "tiny-gemma3";

#[derive(Clone, Copy, Debug)]
pub(crate) enum Fault {
    /// Reads the request and never answers.
    Hang,
    /// Reads the request and closes the connection.
    Reset,
    /// Answers 503 with an error body (to a stream request too).
    Unavailable,
    /// Answers 200 with a stream, sends half an event, and closes.
    HalfStream,
}

/// A raw-TCP engine with one fault on its completions; `GET`s (health, metrics) answer 200.
/// Returns its URL and how many completions it took.
pub(crate) async fn faulty_engine(fault: Fault) -> (String, Arc<AtomicU64>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let hits = Arc::new(AtomicU64::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s, fault, h.clone()));
        }
    });
    (url, hits)
}

async fn serve(mut s: TcpStream, fault: Fault, hits: Arc<AtomicU64>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = Vec::new();
    // Read the head and, for a POST, its body (Content-Length).
    loop {
        let Ok(n) = s.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            return;
        }
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
        let len = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if got.len() < end + 4 + len {
            continue;
        }
        if head.starts_with("get ") {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await;
            got.clear();
            continue;
        }
        break;
    }
    hits.fetch_add(1, Ordering::SeqCst);
    match fault {
        Fault::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
        Fault::Reset => {}
        Fault::Unavailable => {
            let body = r#"{"error":{"message":"overloaded","type":"ServiceUnavailableError","param":null,"code":503}}"#;
            let head = format!(
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
        }
        Fault::HalfStream => {
            let event = br#"data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" a","finish_reason":null}]}

data: {"id":"cmpl-1","object":"text_completion","choices":[{"ind"#;
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let _ = s.write_all(head.as_bytes()).await;
            let chunk = format!("{:x}\r\n", event.len());
            let _ = s.write_all(chunk.as_bytes()).await;
            let _ = s.write_all(event).await;
            let _ = s.write_all(b"\r\n").await;
            let _ = s.flush().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// "a-bad" and "b-good" (a simulated worker) cost the same to a cold prompt, so they take turns
/// at being tried first.
async fn gateway_in_front_of(bad_url: &str, good: &Fleet) -> GatewayHandle {
    let mut cfg = common::gateway_config(vec![
        WorkerSpec::new("a-bad", bad_url, PRESET),
        WorkerSpec::new("b-good", &good.workers[0].base_url, PRESET),
    ]);
    cfg.request_timeout_secs = 1.0;
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    gw
}

async fn good_fleet() -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap()
}

fn body(seed: u32, stream: bool) -> Value {
    let prompt: Vec<u32> = (0..40).map(|i| (seed * 31 + i * 7) % 900 + 5).collect();
    json!({"model": PRESET, "prompt": prompt, "max_tokens": 3, "stream": stream})
}

/// The client's view: status, the decision's worker, the whole body.
async fn send(gw: &GatewayHandle, seed: u32, stream: bool) -> (u16, String, String) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&body(seed, stream))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let worker = r
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| serde_json::from_slice::<Value>(v.as_bytes()).ok())
        .and_then(|d| d["worker"].as_str().map(str::to_string))
        .unwrap_or_default();
    let text = r.text().await.expect("the body ends cleanly");
    (status, worker, text)
}

/// `kvroute_upstream_failures_total` of "a-bad" with `reason`.
fn failures(metrics: &str, reason: &str) -> f64 {
    let label = format!("reason=\"{reason}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_upstream_failures_total{"))
        .filter(|l| l.contains("worker=\"a-bad\"") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_hangs_resets_or_refuses_a_stream_costs_no_request_before_any_byte() {
    let good = good_fleet().await;
    for (fault, reason) in [
        (Fault::Hang, "timeout"),
        (Fault::Reset, "transport"),
        (Fault::Unavailable, "status_5xx"),
    ] {
        let (url, hits) = faulty_engine(fault).await;
        let gw = gateway_in_front_of(&url, &good).await;
        // Equal candidates take turns at being tried first: send each kind of request until
        // the faulty worker has taken one; every answer comes from the good worker.
        let mut seed = 0u32;
        for (taken, stream) in [(1u64, false), (2, true)] {
            while hits.load(Ordering::SeqCst) < taken {
                seed += 1;
                assert!(
                    seed <= 8,
                    "{fault:?}: the faulty worker is never tried first"
                );
                let (status, worker, text) = send(&gw, seed, stream).await;
                assert_eq!(status, 200, "{fault:?} stream={stream}: {text}");
                assert_eq!(worker, "b-good", "{fault:?}: retried on the next worker");
                if stream {
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                    assert!(!text.contains("\"error\""), "{text}");
                }
            }
        }
        assert_eq!(hits.load(Ordering::SeqCst), 2, "{fault:?}: tried twice");
        let m = common::admin_metrics(&gw).await;
        assert_eq!(
            failures(&m, reason),
            2.0,
            "{fault:?}: counted against it\n{m}"
        );
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_dies_halfway_ends_with_an_error_event_and_the_next_request_is_served() {
    let good = good_fleet().await;
    let (url, hits) = faulty_engine(Fault::HalfStream).await;
    let gw = gateway_in_front_of(&url, &good).await;
    // The two take turns at being tried first; the good worker's answers are whole.
    let mut seed = 0u32;
    let text = loop {
        seed += 1;
        assert!(seed <= 4, "the faulty worker is never tried first");
        let (status, worker, text) = send(&gw, seed, true).await;
        assert_eq!(status, 200, "{text}");
        if worker == "a-bad" {
            break text;
        }
        assert!(!text.contains("\"error\""), "{text}");
    };
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    // The whole event that arrived, then the cut one closed, the error and the end.
    let events: Vec<&str> = text
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    assert!(events[0].contains("\" a\""), "{text}");
    let err = events
        .iter()
        .find_map(|e| {
            serde_json::from_str::<Value>(e.strip_prefix("data: ")?)
                .ok()?
                .get("error")
                .cloned()
        })
        .unwrap_or_else(|| panic!("an error event: {text}"));
    assert_eq!(err["code"], 502);
    assert!(err["message"].as_str().unwrap().contains("a-bad"), "{err}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let m = common::admin_metrics(&gw).await;
    assert_eq!(failures(&m, "stream_cut"), 1.0, "{m}");
    // Nothing else disturbed: the next requests are served. A worker whose streams die is
    // not rescued by the chunks it sent: its failures run on until it is ejected.
    for k in seed + 1..seed + 7 {
        let (status, worker, text) = send(&gw, k, k % 2 == 0).await;
        assert_eq!(status, 200, "{text}");
        if worker == "a-bad" {
            assert!(
                text.contains("\"error\""),
                "only a-bad's cut streams carry errors"
            );
        } else {
            assert!(!text.contains("\"error\""), "{text}");
        }
    }
    let m = common::admin_metrics(&gw).await;
    assert!(
        m.contains("kvroute_worker_ejections_total{worker=\"a-bad\"} 1"),
        "ejected after three failures in a row ({} tries)\n{m}",
        hits.load(Ordering::SeqCst)
    );
    gw.shutdown().await;
}
