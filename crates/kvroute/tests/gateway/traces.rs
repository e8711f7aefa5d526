//! OpenTelemetry traces end to end, over real sockets: a real OTLP/HTTP receiver in the test
//! process (an axum server taking `POST /v1/traces` protobuf bodies, decoded with
//! `opentelemetry-proto`), simulated workers recording the `traceparent` each request reached
//! them with (`GET /admin/trace_context`), and the gateway exporting to the receiver. Checked:
//! a request's spans arrive as children of the client's `traceparent`, with the decision's
//! attributes and ordered timings; the engine joins the trace under the `forward` span; without
//! a client `traceparent` a trace is started and still handed to the engine; a malformed one is
//! ignored and counted; both legs of a disaggregated request hand their engine their own span;
//! with tracing off nothing is exported and the client's headers reach the engine unchanged.
//! Every wait is on a condition with a deadline; no timing is asserted beyond ordering.

use crate::common;
use crate::otlp_receiver::{one, Got, Receiver};
use kvroute::gateway::config::otel::TracingConfig;
use kvroute::gateway::config::{Role, WorkerSpec};
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, KvTransfer, SimHandle, WorkerConfig};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use serde_json::{json, Value};

pub(crate) const PRESET: &str = "llama";
pub(crate) const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
pub(crate) const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const CLIENT_STATE: &str = "vendor=opaque,other=7";
/// A whole request's spans: the root and its stages.
pub(crate) const STAGES: [&str; 5] = [
    "POST /v1/completions",
    "parse",
    "tokenize",
    "decide",
    "forward",
];

/// The engine's span of a request (vLLM's name).
const ENGINE_SPAN: &str = "llm_request";

pub(crate) fn client_traceparent() -> String {
    format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
}

async fn fleet(n: usize) -> Fleet {
    exporting_fleet(n, None).await
}

/// `n` simulated workers; with `spans_to`, each exports its own `llm_request` span of every
/// request there (as vLLM with `--otlp-traces-endpoint`).
pub(crate) async fn exporting_fleet(n: usize, spans_to: Option<String>) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    cfg.otlp_traces_endpoint = spans_to;
    Fleet::start(FleetOptions::new(cfg, n)).await.unwrap()
}

fn tracing_to(r: &Receiver) -> TracingConfig {
    TracingConfig {
        otlp_traces_endpoint: Some(r.url.clone()),
        service_name: Some("kvroute-under-test".into()),
        // Exported within milliseconds, so the waits below end early.
        schedule_delay_ms: Some(20),
        ..TracingConfig::default()
    }
}

pub(crate) async fn gateway(
    specs: Vec<WorkerSpec>,
    tracing: Option<TracingConfig>,
) -> GatewayHandle {
    let mut cfg = common::gateway_config(specs);
    cfg.tracing = tracing;
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    gw
}

pub(crate) fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

/// Sends a completion with `headers`, reads the whole answer: the status and the decision.
pub(crate) async fn complete(
    gw: &GatewayHandle,
    body: Value,
    headers: &[(&str, String)],
) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let decision = r
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| serde_json::from_str(v.to_str().ok()?).ok())
        .unwrap_or(Value::Null);
    let _ = r.bytes().await.unwrap();
    (status, decision)
}

/// The trace contexts `h`'s engine received, oldest first.
async fn engine_saw(h: &SimHandle) -> Vec<Value> {
    let v: Value = reqwest::get(format!("{}/admin/trace_context", h.base_url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["received"].as_array().cloned().unwrap_or_default()
}

/// The `traceparent` the engine named `worker` among `fleet` received last, split into its
/// trace id and parent span id.
pub(crate) async fn engine_parent(fleet: &[SimHandle], worker: &str) -> (String, String, Value) {
    let h = fleet.iter().find(|h| h.name == worker).expect("the worker");
    let last = engine_saw(h)
        .await
        .pop()
        .expect("a request reached the engine");
    let tp = last["traceparent"]
        .as_str()
        .expect("a traceparent")
        .to_string();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!((parts.len(), parts[0]), (4, "00"), "{tp}");
    (parts[1].to_string(), parts[2].to_string(), last)
}

/// The root span of `spans` (one request's), after checking the tree's shape and timings:
/// every other span is the root's child and lies within it, each starts before it ends, and
/// the stages present follow one another.
pub(crate) fn checked_tree(spans: &[Got]) -> &Got {
    let root = one(spans, "POST /v1/completions");
    assert_eq!(root.kind, SpanKind::Server as i32);
    for s in spans {
        assert!(s.start <= s.end, "{s:?}");
        if s.span_id != root.span_id {
            assert_eq!(s.parent, root.span_id, "{} is the root's child", s.name);
            assert!(
                s.within(root),
                "{} lies within the root: {s:?} {root:?}",
                s.name
            );
        }
    }
    let order: Vec<&Got> = ["parse", "tokenize", "decide", "forward"]
        .iter()
        .filter_map(|n| spans.iter().find(|s| s.name == *n))
        .collect();
    for w in order.windows(2) {
        assert!(w[0].end <= w[1].start, "{} before {}", w[0].name, w[1].name);
    }
    root
}

/// Checks that `engine` holds the engine's one span of the request `saw` records (the
/// simulator's, as vLLM's with `--otlp-traces-endpoint`): a child of the gateway's `forward`
/// span `fwd`, within it, with vLLM's attributes.
fn engine_joined(engine: &[Got], fwd: &Got, saw: &Value, prompt: usize, completion: usize) {
    let llm = one(engine, ENGINE_SPAN);
    assert_eq!(
        (llm.trace_id.as_str(), llm.parent.as_str()),
        (fwd.trace_id.as_str(), fwd.span_id.as_str()),
        "the engine's span is the forward span's child"
    );
    assert_eq!(llm.kind, SpanKind::Server as i32);
    assert!(llm.within(fwd), "{llm:?} {fwd:?}");
    assert_eq!(llm.attr("gen_ai.request.id"), &saw["request_id"]);
    assert_eq!(llm.attr("gen_ai.usage.prompt_tokens"), &json!(prompt));
    assert_eq!(
        llm.attr("gen_ai.usage.completion_tokens"),
        &json!(completion)
    );
    let ttft = llm.attr("gen_ai.latency.time_to_first_token").as_f64();
    let e2e = llm.attr("gen_ai.latency.e2e").as_f64();
    assert!(
        ttft.zip(e2e).is_some_and(|(t, e)| 0.0 < t && t <= e),
        "{llm:?}"
    );
}

/// The `first_byte` event's time on `fwd`, checked to be the one and within the span.
pub(crate) fn first_byte(fwd: &Got) -> u64 {
    let at: Vec<u64> = fwd
        .events
        .iter()
        .filter(|(n, _)| n == "first_byte")
        .map(|e| e.1)
        .collect();
    assert_eq!(at.len(), 1, "{fwd:?}");
    assert!(fwd.start <= at[0] && at[0] <= fwd.end, "{fwd:?}");
    at[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_spans_reach_the_receiver_as_children_of_the_clients_traceparent() {
    let rx = Receiver::start().await;
    let f = exporting_fleet(2, Some(rx.url.clone())).await;
    let specs = f
        .workers
        .iter()
        .map(|h| common::sim_spec(h, PRESET, false))
        .collect();
    let gw = gateway(specs, Some(tracing_to(&rx))).await;
    // The first request caches the prompt on its worker; the traced one is predicted to hit.
    let tokens = prompt(3, 600);
    let body = json!({"model": PRESET, "prompt": tokens, "max_tokens": 8, "stream": true,
                      "stream_options": {"include_usage": true}});
    assert_eq!(complete(&gw, body.clone(), &[]).await.0, 200);
    common::settle(&gw).await;
    let headers = [
        ("traceparent", client_traceparent()),
        ("tracestate", CLIENT_STATE.into()),
    ];
    let (status, decision) = complete(&gw, body, &headers).await;
    assert_eq!(status, 200);
    let mut names = STAGES.to_vec();
    names.push(ENGINE_SPAN);
    let (engine, spans): (Vec<Got>, Vec<Got>) = rx
        .trace(CLIENT_TRACE, &names)
        .await
        .into_iter()
        .partition(|s| s.name == ENGINE_SPAN);
    let root = checked_tree(&spans);
    assert_eq!(
        root.parent, CLIENT_SPAN,
        "the root span is the client's span's child"
    );
    assert_eq!(root.service, "kvroute-under-test");
    assert_eq!(root.attr("http.response.status_code"), &json!(200));
    assert_eq!(root.attr("gen_ai.request.model"), &json!(PRESET));
    let decide = one(&spans, "decide");
    let worker = decision["worker"].as_str().unwrap();
    let predicted = decision["predicted_cached"].as_u64().unwrap();
    assert!(
        predicted > 0,
        "the repeated prompt is predicted to hit: {decision}"
    );
    assert_eq!(decide.attr("kvroute.worker"), &json!(worker));
    assert_eq!(
        decide.attr("kvroute.predicted_cached_tokens"),
        &json!(predicted)
    );
    let ratio = decide.attr("kvroute.predicted_hit_ratio").as_f64().unwrap();
    assert!(
        (ratio - predicted as f64 / tokens.len() as f64).abs() < 1e-9,
        "{ratio}"
    );
    assert_eq!(decide.attr("kvroute.policy"), &json!(decision["policy"]));
    assert_eq!(decide.attr("kvroute.prompt_tokens"), &json!(tokens.len()));
    assert_eq!(decide.attr("kvroute.candidates"), &json!(2));
    let tokenize = one(&spans, "tokenize");
    assert_eq!(tokenize.attr("kvroute.prompt_tokens"), &json!(tokens.len()));
    let fwd = one(&spans, "forward");
    assert_eq!(fwd.kind, SpanKind::Client as i32);
    assert_eq!(fwd.attr("kvroute.worker"), &json!(worker));
    assert_eq!(fwd.attr("http.response.status_code"), &json!(200));
    assert!(!root.error && !fwd.error, "{root:?} {fwd:?}");
    first_byte(fwd);
    // The engine joined the trace under the forward span, with the client's tracestate.
    let (trace, parent, saw) = engine_parent(&f.workers, worker).await;
    assert_eq!(
        (trace.as_str(), parent.as_str()),
        (CLIENT_TRACE, fwd.span_id.as_str())
    );
    assert_eq!(saw["tracestate"], CLIENT_STATE, "{saw}");
    engine_joined(&engine, fwd, &saw, tokens.len(), 8);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_client_traceparent_a_trace_is_started_and_still_handed_to_the_engine() {
    let rx = Receiver::start().await;
    let f = fleet(1).await;
    let gw = gateway(
        vec![common::sim_spec(&f.workers[0], PRESET, false)],
        Some(tracing_to(&rx)),
    )
    .await;
    let body = json!({"model": PRESET, "prompt": prompt(5, 200), "max_tokens": 4});
    let (status, _) = complete(&gw, body, &[]).await;
    assert_eq!(status, 200);
    let (trace, parent, saw) = engine_parent(&f.workers, &f.workers[0].name).await;
    assert_ne!(trace, "0".repeat(32));
    assert!(saw["tracestate"].is_null(), "{saw}");
    let spans = rx.trace(&trace, &STAGES).await;
    let root = checked_tree(&spans);
    assert_eq!(root.parent, "", "a new trace's root has no parent");
    let fwd = one(&spans, "forward");
    assert_eq!(
        (fwd.parent.as_str(), parent.as_str()),
        (root.span_id.as_str(), fwd.span_id.as_str())
    );
    // A whole answer's first byte is its head.
    first_byte(fwd);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_traceparent_is_ignored_counted_and_never_fails_the_request() {
    let rx = Receiver::start().await;
    let f = fleet(1).await;
    let gw = gateway(
        vec![common::sim_spec(&f.workers[0], PRESET, false)],
        Some(tracing_to(&rx)),
    )
    .await;
    for (i, bad) in [
        "00-nothex-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ]
    .into_iter()
    .enumerate()
    {
        let body = json!({"model": PRESET, "prompt": prompt(9 + i as u32, 100), "max_tokens": 2});
        let headers = [
            ("traceparent", bad.to_string()),
            ("tracestate", CLIENT_STATE.into()),
        ];
        assert_eq!(complete(&gw, body, &headers).await.0, 200, "{bad}");
        // The request started a trace of its own, without the client's tracestate.
        let (trace, _, saw) = engine_parent(&f.workers, &f.workers[0].name).await;
        assert_ne!(saw["traceparent"], bad);
        assert!(saw["tracestate"].is_null(), "{saw}");
        let spans = rx.trace(&trace, &["POST /v1/completions"]).await;
        assert_eq!(one(&spans, "POST /v1/completions").parent, "");
    }
    let metrics = common::admin_metrics(&gw).await;
    assert_eq!(
        common::metric(&metrics, "kvroute_trace_context_invalid_total"),
        2.0
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_leg_of_a_disaggregated_request_hands_its_engine_its_own_forward_span() {
    let rx = Receiver::start().await;
    let pool = |prefix: &'static str, role: &'static str| async move {
        let mut cfg = WorkerConfig::for_preset("qwen3-next").unwrap();
        cfg.speedup = 200.0;
        cfg.kv_transfer = Some(
            format!(r#"{{"kv_connector": "NixlConnector", "kv_role": "{role}"}}"#)
                .parse::<KvTransfer>()
                .unwrap(),
        );
        let mut opts = FleetOptions::new(cfg, 1);
        opts.name_prefix = prefix.into();
        Fleet::start(opts).await.unwrap()
    };
    let (p, d) = (
        pool("p", "kv_producer").await,
        pool("d", "kv_consumer").await,
    );
    let mut specs = Vec::new();
    for (h, role) in [
        (&p.workers[0], Role::Prefill),
        (&d.workers[0], Role::Decode),
    ] {
        let mut s = common::sim_spec(h, "qwen3-next", true);
        s.role = role;
        specs.push(s);
    }
    let gw = gateway(specs, Some(tracing_to(&rx))).await;
    let body =
        json!({"model": "qwen3-next", "prompt": prompt(11, 300), "max_tokens": 4, "stream": true});
    let (status, _) = complete(&gw, body, &[("traceparent", client_traceparent())]).await;
    assert_eq!(status, 200);
    let spans = rx
        .trace(
            CLIENT_TRACE,
            &["POST /v1/completions", "decide", "forward", "forward"],
        )
        .await;
    let root = one(&spans, "POST /v1/completions");
    let decide = one(&spans, "decide");
    assert_eq!(
        decide.attr("kvroute.decode_worker"),
        &json!(d.workers[0].name)
    );
    for (fleet, leg) in [(&p.workers, "prefill"), (&d.workers, "decode")] {
        let fwd = spans
            .iter()
            .find(|s| s.name == "forward" && s.attr("kvroute.leg") == &json!(leg))
            .unwrap_or_else(|| panic!("a {leg} forward span: {spans:#?}"));
        assert_eq!(fwd.parent, root.span_id);
        assert!(fwd.within(root), "{fwd:?} {root:?}");
        let (trace, parent, _) = engine_parent(fleet, &fleet[0].name).await;
        assert_eq!(
            (trace.as_str(), parent.as_str()),
            (CLIENT_TRACE, fwd.span_id.as_str()),
            "{leg}"
        );
    }
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tracing_off_nothing_is_exported_and_the_clients_headers_reach_the_engine_unchanged() {
    let rx = Receiver::start().await;
    let f = fleet(1).await;
    let h = &f.workers[0];
    let gw = gateway(vec![common::sim_spec(h, PRESET, false)], None).await;
    assert!(
        !gw.state.otel.enabled(),
        "tracing is on without configuration: is OTEL_EXPORTER_OTLP_ENDPOINT set for the tests?"
    );
    // Passed through as sent, even what the gateway would refuse to parse.
    let sent = [
        (Some(client_traceparent()), Some(CLIENT_STATE.to_string())),
        (Some("00-not-a-valid-traceparent".to_string()), None),
        (None, None),
    ];
    for (i, (tp, ts)) in sent.iter().enumerate() {
        let mut headers = Vec::new();
        if let Some(v) = tp {
            headers.push(("traceparent", v.clone()));
        }
        if let Some(v) = ts {
            headers.push(("tracestate", v.clone()));
        }
        let body = json!({"model": PRESET, "prompt": prompt(20 + i as u32, 100), "max_tokens": 2});
        assert_eq!(complete(&gw, body, &headers).await.0, 200);
        let last = engine_saw(h).await.pop().unwrap();
        assert_eq!(last["traceparent"].as_str(), tp.as_deref(), "{last}");
        assert_eq!(last["tracestate"].as_str(), ts.as_deref(), "{last}");
    }
    // A shutdown flushes any exporter: after it, none has sent anything.
    gw.shutdown().await;
    assert_eq!(rx.posts(), 0);
}
