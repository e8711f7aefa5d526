//! Every committed conformance corpus replayed over the simulator's own interfaces, as a
//! client and a KV-event subscriber of a vLLM server see them.
//!
//! Per corpus worker: a simulated worker configured as the recorded engine, publishing to a
//! concrete `tcp://127.0.0.1:P` endpoint (it connects, as vLLM does for concrete endpoints),
//! with the subscriber binding `P` only after the worker serves. Each recorded request is sent
//! as `POST /v1/completions` with its token-id prompt, `cache_salt`, its LoRA adapter as the
//! `model` (the worker serving the recorded adapters) and the recorded output
//! (`forced_output_token_ids`), one at a time as recorded; the reply's
//! `usage.prompt_tokens_details.cached_tokens` must equal the engine's hit, and the events the
//! subscriber receives must equal the recorded events (timestamps aside).

use crate::common;

use common::corpus::{self, Corpus};
use common::subscriber::Subscriber;
use common::{get, post};
use kvroute_index::Event;
use kvroute_sim::{fleet, PublisherConfig, WorkerConfig};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use zeromq::{Socket, SubSocket};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

async fn wait_connected(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(addr, "/admin/cache").await.json()["ranks"][0]["publisher"]["connected"]
        != json!(true)
    {
        assert!(Instant::now() < deadline, "the publisher never connected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every event published since the last read.
async fn events(sub: &mut Subscriber, worker: &str) -> Vec<Event> {
    let mut events = Vec::new();
    for (_, frames) in sub.batches().await {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (_, _, batch) = kvroute_wire::decode_message(&worker.into(), &refs).unwrap();
        events.extend(batch.events);
    }
    events
}

/// Replays one corpus over HTTP and ZMQ; returns the mismatches found.
async fn replay(c: &Corpus) -> Vec<String> {
    let mut errors = Vec::new();
    for w in c.workers() {
        let port = free_port();
        let mut cfg = WorkerConfig::for_preset(corpus::preset_of(&c.meta)).unwrap();
        cfg.engine = corpus::config_for(&c.meta, &w);
        cfg.speedup = 1e6;
        cfg.lora_modules = corpus::lora_modules(&c.meta);
        cfg.zmq = Some(PublisherConfig::new(&format!("tcp://127.0.0.1:{port}")));
        let sim = fleet::start_worker(&w, cfg, ([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        assert_eq!(get(sim.http, "/health").await.status, 200, "serves at once");
        let mut sub = SubSocket::new();
        sub.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
        sub.subscribe("").await.unwrap();
        wait_connected(sim.http).await;
        // Probes until the subscription has joined (none of their events is compared).
        let mut sub = Subscriber::probe(sub, sim.http, 0, "the bound subscriber").await;

        let mut recorded: Vec<Event> = Vec::new();
        for f in c.frames.iter().filter(|f| f.worker == w) {
            recorded.extend(corpus::decode_frame(&w, &f.frames).events);
        }
        for r in c.requests.iter().filter(|r| r.worker == w) {
            let model = r
                .lora_name
                .clone()
                .unwrap_or_else(|| sim.worker.config().model.clone());
            let mut body = json!({
                "model": model,
                "prompt": r.prompt_token_ids,
                "max_tokens": r.output_token_ids.len().max(1),
                "forced_output_token_ids": r.output_token_ids,
            });
            if let Some(salt) = &r.cache_salt {
                body["cache_salt"] = json!(salt);
            }
            let reply = post(sim.http, "/v1/completions", &body).await;
            if reply.status != 200 {
                errors.push(format!(
                    "{} {}: HTTP {} {}",
                    c.name, r.id, reply.status, reply.body
                ));
                continue;
            }
            let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
            if cached != Some(r.num_cached_tokens as u64) {
                errors.push(format!(
                    "{} {}: cached_tokens {cached:?}, engine {} (prompt {})",
                    c.name,
                    r.id,
                    r.num_cached_tokens,
                    r.prompt_token_ids.len()
                ));
            }
        }
        let received = events(&mut sub, &w).await;
        if received != recorded {
            errors.push(format!(
                "{} {w}: {} events received, {} recorded (first difference at {:?})",
                c.name,
                received.len(),
                recorded.len(),
                received.iter().zip(&recorded).position(|(a, b)| a != b)
            ));
        }
    }
    errors
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_committed_corpus_gives_the_recorded_hits_and_events_over_http_and_zmq() {
    let names = corpus::all_corpora();
    assert!(names.len() >= 8, "corpora found: {names:?}");
    let mut errors = Vec::new();
    let mut requests = 0;
    for name in &names {
        let c = corpus::load(name).unwrap();
        requests += c.requests.len();
        errors.extend(replay(&c).await);
    }
    for e in &errors {
        eprintln!("{e}");
    }
    assert!(
        errors.is_empty(),
        "{} mismatches over {requests} requests",
        errors.len()
    );
}
