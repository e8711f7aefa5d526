//! OpenTelemetry traces over OTLP/gRPC, end to end: a real gRPC receiver in the test process
//! (a tonic server of the collector's trace service, `otlp_receiver`), simulated workers, and
//! the gateway exporting to it — configured in the `[tracing]` section, and, as the `kvroute
//! serve` binary, through the standard `OTEL_*` environment alone. Checked: a request's spans
//! arrive over gRPC as children of the client's `traceparent`, with the decision's attributes,
//! and the engine is handed the `forward` span; the environment's endpoint (a gRPC base used as
//! it is), protocol and service name are the ones the spans arrive with. Every wait is on a
//! condition with a deadline.

use crate::common;
use crate::otlp_receiver::{one, Receiver};
use crate::traces::{
    checked_tree, client_traceparent, complete, engine_parent, exporting_fleet, first_byte,
    gateway, prompt, CLIENT_SPAN, CLIENT_TRACE, PRESET, STAGES,
};
use kvroute::gateway::config::otel::TracingConfig;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_grpc_a_requests_spans_reach_the_receiver_as_children_of_the_clients_traceparent() {
    let rx = Receiver::start_grpc().await;
    let f = exporting_fleet(2, None).await;
    let specs = f
        .workers
        .iter()
        .map(|h| common::sim_spec(h, PRESET, false))
        .collect();
    let tracing = TracingConfig {
        otlp_traces_endpoint: Some(rx.url.clone()),
        protocol: Some("grpc".into()),
        service_name: Some("kvroute-over-grpc".into()),
        schedule_delay_ms: Some(20),
    };
    let gw = gateway(specs, Some(tracing)).await;
    let tokens = prompt(31, 300);
    let body = json!({"model": PRESET, "prompt": tokens, "max_tokens": 4, "stream": true});
    let (status, decision) = complete(&gw, body, &[("traceparent", client_traceparent())]).await;
    assert_eq!(status, 200);
    let spans = rx.trace(CLIENT_TRACE, &STAGES).await;
    let root = checked_tree(&spans);
    assert_eq!(root.parent, CLIENT_SPAN);
    assert_eq!(root.service, "kvroute-over-grpc");
    assert_eq!(root.attr("http.response.status_code"), &json!(200));
    let worker = decision["worker"].as_str().expect("the decision's worker");
    let decide = one(&spans, "decide");
    assert_eq!(decide.attr("kvroute.worker"), &json!(worker));
    assert_eq!(decide.attr("kvroute.prompt_tokens"), &json!(tokens.len()));
    let fwd = one(&spans, "forward");
    assert_eq!(fwd.kind, SpanKind::Client as i32);
    assert_eq!(fwd.attr("kvroute.worker"), &json!(worker));
    first_byte(fwd);
    let (trace, parent, _) = engine_parent(&f.workers, worker).await;
    assert_eq!(
        (trace.as_str(), parent.as_str()),
        (CLIENT_TRACE, fwd.span_id.as_str())
    );
    gw.shutdown().await;
}

/// A `kvroute serve` process, killed when dropped.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the binary in front of `worker` with `env` (and no other `OTEL_*` variable that
/// names where traces go) and waits for its listening line: the process and its front door.
fn serve(worker: &kvroute_sim::SimHandle, env: &[(&str, &str)]) -> (Served, String) {
    let port = worker.zmq[0].rsplit(':').next().unwrap_or_default();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    cmd.args(["serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "127.0.0.1:0", "--worker"])
        .arg(format!(
            "name={},url={},model={PRESET},events=tcp://*:{port},host=127.0.0.1",
            worker.name, worker.base_url
        ));
    for k in [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_SDK_DISABLED",
    ] {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvroute serve");
    let stderr = child.stderr.take().expect("its stderr");
    let served = Served(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Keeps reading so the child never blocks on a full pipe.
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kvroute listening on http://") {
                let front = rest.split_whitespace().next().unwrap_or_default();
                let _ = tx.send(front.to_string());
            }
        }
    });
    let front = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("kvroute serve printed its address");
    (served, front)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_otel_environment_alone_turns_grpc_tracing_on_with_its_service_name() {
    let rx = Receiver::start_grpc().await;
    let f = exporting_fleet(1, None).await;
    let env = [
        // A gRPC base is the endpoint as it is (nothing appended).
        ("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_SERVICE_NAME", "kvroute-from-env"),
        ("OTEL_BSP_SCHEDULE_DELAY", "20"),
    ];
    let (_served, front) = serve(&f.workers[0], &env);
    common::ready_at(&front).await;
    let body = json!({"model": PRESET, "prompt": prompt(41, 120), "max_tokens": 2});
    let r = reqwest::Client::new()
        .post(format!("http://{front}/v1/completions"))
        .header("traceparent", client_traceparent())
        .json(&body)
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(r.status(), 200);
    let spans = rx.trace(CLIENT_TRACE, &STAGES).await;
    let root = checked_tree(&spans);
    assert_eq!(root.parent, CLIENT_SPAN);
    for s in &spans {
        assert_eq!(s.service, "kvroute-from-env", "{s:?}");
    }
}
