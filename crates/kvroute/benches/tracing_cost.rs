//! What OpenTelemetry tracing costs a request, on and off, in the same run. Not a pass/fail
//! test; the figures go to docs/benchmarks.md with this command:
//!
//! ```sh
//! cargo bench -p kvroute --bench tracing_cost
//! # more rounds or requests per round:
//! KVROUTE_BENCH_ROUNDS=20 KVROUTE_BENCH_REQUESTS=400 cargo bench -p kvroute --bench tracing_cost
//! ```
//!
//! Two measurements:
//! 1. End to end: one simulated worker (engine time scaled to almost nothing) behind two
//!    gateways in this process, one with tracing off and one exporting over OTLP/HTTP to a
//!    receiver in this process (it decodes every export, as a collector would). Requests go one
//!    at a time, every one with a client `traceparent`; the rounds alternate which gateway goes
//!    first, so drift on a shared machine falls on both. Reported: the median, p90 and p99 of
//!    each side's request latency over all rounds, and the spread of the per-round medians.
//! 2. The span work alone: a request's trace as the proxy makes it (root, three stages, one
//!    forward span with its first-byte event, the engine's headers, the end), with no request
//!    around it, timed per request, off and on, beside the same loop making no trace call.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::config::otel::{OtlpProtocol, TracingConfig};
use kvroute::gateway::config::{KvEventsSpec, WorkerSpec};
use kvroute::gateway::otel::{ExportSettings, Tracing};
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PRESET: &str = "llama";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn env(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// An OTLP/HTTP receiver that decodes each export and counts its spans.
async fn receiver() -> (String, Arc<AtomicU64>) {
    let spans = Arc::new(AtomicU64::new(0));
    let counted = spans.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let counted = counted.clone();
            async move {
                if let Ok(req) = ExportTraceServiceRequest::decode(body) {
                    let n = req
                        .resource_spans
                        .iter()
                        .flat_map(|r| &r.scope_spans)
                        .map(|s| s.spans.len() as u64)
                        .sum::<u64>();
                    counted.fetch_add(n, Ordering::Relaxed);
                }
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/v1/traces"), spans)
}

async fn gateway(worker: WorkerSpec, tracing: Option<TracingConfig>) -> GatewayHandle {
    let cfg = GatewayConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_listen: "127.0.0.1:0".parse().expect("addr"),
        workers: vec![worker],
        tracing,
        ..GatewayConfig::default()
    };
    let gw = Gateway::start(cfg).await.expect("gateway");
    // Ready once the worker is healthy and its events are subscribed.
    let url = format!("http://{}/health/ready", gw.addr);
    for _ in 0..2000 {
        if reqwest::get(&url).await.is_ok_and(|r| r.status() == 200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gw
}

/// Sends `n` requests one at a time; their latencies, in µs.
async fn run(client: &reqwest::Client, gw: &GatewayHandle, body: &[u8], n: usize) -> Vec<f64> {
    let url = format!("http://{}/v1/completions", gw.addr);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = client
            .post(&url)
            .header("content-type", "application/json")
            .header("traceparent", TRACEPARENT)
            .body(body.to_vec())
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.expect("answer");
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    out
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    quantile(&s, 0.5)
}

/// The end-to-end comparison.
async fn end_to_end(rounds: usize, per_round: usize) {
    let (url, exported) = receiver().await;
    let mut cfg = WorkerConfig::for_preset(PRESET).expect("preset");
    cfg.speedup = 10_000.0;
    let fleet = Fleet::start(FleetOptions::new(cfg, 1))
        .await
        .expect("fleet");
    let h = &fleet.workers[0];
    let mut spec = WorkerSpec::new(&h.name, &h.base_url, PRESET);
    let port = h.zmq[0].rsplit(':').next().unwrap_or_default();
    spec.kv_events = Some(KvEventsSpec {
        endpoint: format!("tcp://*:{port}"),
        host: Some("127.0.0.1".into()),
        ..KvEventsSpec::new("")
    });
    let off = gateway(spec.clone(), None).await;
    assert!(!off.state.otel.enabled(), "unset OTEL_EXPORTER_OTLP_*");
    let on = gateway(
        spec,
        Some(TracingConfig {
            otlp_traces_endpoint: Some(url),
            ..TracingConfig::default()
        }),
    )
    .await;
    let prompt: Vec<u32> = (0..512).map(|i| i % 1000 + 3).collect();
    let body = serde_json::to_vec(&serde_json::json!({
        "model": PRESET, "prompt": prompt, "max_tokens": 1,
    }))
    .expect("body");
    let client = reqwest::Client::new();
    // Warm both (connections, caches, the engine's prefix).
    run(&client, &off, &body, 50).await;
    run(&client, &on, &body, 50).await;
    let (mut all_off, mut all_on) = (Vec::new(), Vec::new());
    let (mut med_off, mut med_on) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let order: [(&GatewayHandle, bool); 2] = if r % 2 == 0 {
            [(&off, false), (&on, true)]
        } else {
            [(&on, true), (&off, false)]
        };
        for (gw, traced) in order {
            let lat = run(&client, gw, &body, per_round).await;
            let (all, med) = if traced {
                (&mut all_on, &mut med_on)
            } else {
                (&mut all_off, &mut med_off)
            };
            med.push(median(&lat));
            all.extend(lat);
        }
    }
    on.shutdown().await;
    off.shutdown().await;
    println!(
        "end to end: {rounds} rounds × {per_round} requests per side, one at a time, 512-token \
         prompt, 1 output token, client traceparent on every request"
    );
    let mut rows = Vec::new();
    for (label, all, med) in [
        ("tracing off", &mut all_off, &med_off),
        ("tracing on ", &mut all_on, &med_on),
    ] {
        all.sort_by(f64::total_cmp);
        let (lo, hi) = med
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), m| (lo.min(*m), hi.max(*m)));
        let m = quantile(all, 0.5);
        println!(
            "  {label}: median {m:7.1} µs  p90 {:7.1}  p99 {:7.1}  per-round medians {lo:.1}–{hi:.1}",
            quantile(all, 0.9),
            quantile(all, 0.99)
        );
        rows.push(m);
    }
    println!(
        "  on − off (medians): {:+.1} µs ({:+.1} %); spans exported: {}",
        rows[1] - rows[0],
        100.0 * (rows[1] - rows[0]) / rows[0],
        exported.load(Ordering::Relaxed)
    );
}

/// One request's trace as the proxy makes it, with no request around it.
fn one_trace(t: &Tracing, headers: &HeaderMap) -> usize {
    let trace = t.request(headers, "POST /v1/completions", "/v1/completions");
    for name in ["parse", "tokenize", "decide"] {
        let mut s = trace.stage(name);
        s.record(|| vec![opentelemetry::KeyValue::new("kvroute.prompt_tokens", 512)]);
    }
    let mut f = trace.forward("w0", "http://127.0.0.1:8000/v1/completions", "whole", 0);
    let n = f.headers.iter().count();
    f.answered(200);
    f.first_byte();
    f.end();
    let _ = trace.finish(Response::new(Body::from("{}")));
    n
}

/// The span work alone, per request, off and on.
async fn span_work(iterations: usize) {
    let (url, exported) = receiver().await;
    let mut headers = HeaderMap::new();
    headers.insert("traceparent", HeaderValue::from_static(TRACEPARENT));
    println!("span work alone ({iterations} requests' traces, root + 3 stages + forward):");
    let settings = ExportSettings {
        endpoint: url,
        protocol: OtlpProtocol::HttpProtobuf,
        service_name: "kvroute-bench".into(),
        schedule_delay: None,
        timeout: Duration::from_secs(10),
    };
    // What the loop costs without any trace call: the answer it ends each trace with.
    let start = Instant::now();
    for _ in 0..iterations {
        std::hint::black_box(Response::new(Body::from("{}")));
    }
    let per = start.elapsed().as_secs_f64() * 1e9 / iterations as f64;
    println!("  no trace calls (the loop and its answer): {per:5.0} ns per request");
    for (label, s) in [("tracing off", None), ("tracing on ", Some(&settings))] {
        let counter = prometheus::IntCounter::new("c", "c").expect("counter");
        let t = Tracing::new(s, counter).expect("tracing");
        let mut sink = 0;
        for _ in 0..iterations / 10 {
            sink += one_trace(&t, &headers);
        }
        let start = Instant::now();
        for _ in 0..iterations {
            sink += one_trace(&t, &headers);
        }
        let per = start.elapsed().as_secs_f64() * 1e9 / iterations as f64;
        t.shutdown().await;
        println!("  {label}: {per:8.0} ns per request ({sink} engine headers)");
    }
    println!(
        "  spans exported: {} (a full queue drops spans rather than wait)",
        exported.load(Ordering::Relaxed)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds = env("KVROUTE_BENCH_ROUNDS", 10);
    let per_round = env("KVROUTE_BENCH_REQUESTS", 200);
    end_to_end(rounds, per_round).await;
    span_work(env("KVROUTE_BENCH_SPAN_ITERATIONS", 100_000)).await;
}
