//! The engine's own span of each request, exported over OTLP as vLLM exports it when started
//! with `--otlp-traces-endpoint`: one `llm_request` span (kind server) per finished request, a
//! child of the `traceparent` the request arrived with (a new trace without a valid one), with
//! vLLM's `gen_ai.*` attributes.
//!
//! Owns: [`SpanExport`] (a worker's queue of finished spans and the task that POSTs them, as
//! OTLP/HTTP protobuf, to the endpoint), [`OpenSpan`] (a request's span from its arrival to its
//! finish) and the W3C `traceparent` parsing it starts from.
//! Invariants: nothing is exported unless the endpoint is configured; a `traceparent` whose
//! sampled flag is off exports nothing (as vLLM's parent-based sampler); the span's start is
//! the request's arrival on the wall clock and its end the engine's finish, while the latency
//! attributes are the engine's simulated seconds. The queue is bounded: a span it cannot take
//! is dropped, and a failed export is logged and dropped.
//! Must not: hold or slow a request (spans are queued, never awaited), or read the environment.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{
    any_value::Value, AnyValue, InstrumentationScope, KeyValue,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, ResourceSpans, ScopeSpans, Span};
use prost::Message;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// The span's name, as vLLM's output processor names it.
pub const SPAN_NAME: &str = "llm_request";
/// The instrumentation scope (vLLM's tracer's module name).
pub const SCOPE: &str = "vllm.llm_engine";
/// Spans waiting for the exporter; more are dropped.
const QUEUE: usize = 4096;
/// Spans sent in one export, at most.
const BATCH: usize = 512;
/// One export's bound (the OTLP default).
const TIMEOUT: Duration = Duration::from_secs(10);

/// A worker's span exporter: the sending end of its queue (the task ends when the last one is
/// dropped).
#[derive(Clone)]
pub struct SpanExport(mpsc::Sender<Span>);

impl SpanExport {
    /// Starts the task exporting to `endpoint` (an OTLP/HTTP traces URL, used as given).
    pub fn start(endpoint: String) -> SpanExport {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(export_loop(endpoint, rx));
        SpanExport(tx)
    }

    /// A request's span, opened at its arrival now: `None` when its `traceparent` is valid and
    /// not sampled.
    pub fn open(
        &self,
        request_id: &str,
        traceparent: Option<&[u8]>,
        tracestate: Option<&[u8]>,
        max_tokens: usize,
    ) -> Option<OpenSpan> {
        let (trace_id, parent, sampled) = match traceparent.and_then(parse_traceparent) {
            Some((t, p, sampled)) => (t, p.to_vec(), sampled),
            None => ([random_id(), random_id()].concat(), Vec::new(), true),
        };
        let trace_state = match (parent.is_empty(), tracestate) {
            (false, Some(s)) => String::from_utf8_lossy(s).into_owned(),
            _ => String::new(),
        };
        sampled.then(|| OpenSpan {
            export: self.clone(),
            span: Span {
                trace_id,
                span_id: random_id(),
                parent_span_id: parent,
                trace_state,
                // Sampled: an unsampled one is not exported at all.
                flags: 1,
                name: SPAN_NAME.into(),
                kind: SpanKind::Server as i32,
                start_time_unix_nano: unix_nanos(),
                attributes: vec![
                    attr("gen_ai.request.id", Value::StringValue(request_id.into())),
                    attr("gen_ai.request.max_tokens", int(max_tokens)),
                ],
                ..Default::default()
            },
        })
    }
}

/// A request's span, open until the engine finishes it.
pub struct OpenSpan {
    export: SpanExport,
    span: Span,
}

/// What the engine reports of a finished request.
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Simulated seconds from arrival to the first token, and to the last.
    pub ttft_s: f64,
    pub e2e_s: f64,
}

impl OpenSpan {
    /// Ends the span now with `u`'s attributes and queues it (dropped when the queue is full).
    pub fn finish(mut self, u: &Usage) {
        self.span.end_time_unix_nano = unix_nanos().max(self.span.start_time_unix_nano);
        self.span.attributes.extend([
            attr("gen_ai.usage.prompt_tokens", int(u.prompt_tokens)),
            attr("gen_ai.usage.completion_tokens", int(u.completion_tokens)),
            attr(
                "gen_ai.latency.time_to_first_token",
                Value::DoubleValue(u.ttft_s),
            ),
            attr("gen_ai.latency.e2e", Value::DoubleValue(u.e2e_s)),
        ]);
        if self.export.0.try_send(self.span).is_err() {
            tracing::debug!("the span queue is full: a span is dropped");
        }
    }
}

fn attr(key: &str, value: Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

fn int(n: usize) -> Value {
    Value::IntValue(i64::try_from(n).unwrap_or(i64::MAX))
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Eight bytes that are not all zero, different on each call.
fn random_id() -> Vec<u8> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(SEQ.fetch_add(1, Ordering::Relaxed));
    h.write_u64(unix_nanos());
    h.finish().max(1).to_be_bytes().to_vec()
}

/// A W3C `traceparent` (version `00`'s layout; any version but `ff`): the trace id, the parent
/// span id and the sampled flag; `None` when malformed or an id is all zeros.
fn parse_traceparent(v: &[u8]) -> Option<(Vec<u8>, [u8; 8], bool)> {
    let v = std::str::from_utf8(v).ok()?.trim();
    let parts: Vec<&str> = v.split('-').collect();
    let [version, trace, span, flags, ..] = parts.as_slice() else {
        return None;
    };
    if *version == "ff" || (*version == "00" && parts.len() != 4) {
        return None;
    }
    let trace = hex(trace, 16)?;
    let span: [u8; 8] = hex(span, 8)?.try_into().ok()?;
    let version = hex(version, 1)?;
    let flags = hex(flags, 1)?;
    let zero = |b: &[u8]| b.iter().all(|x| *x == 0);
    if version.len() != 1 || zero(&trace) || zero(&span) {
        return None;
    }
    Some((trace, span, flags[0] & 1 == 1))
}

/// `s` as `n` bytes of lowercase hex.
fn hex(s: &str, n: usize) -> Option<Vec<u8>> {
    if s.len() != 2 * n || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..n)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// The export request carrying `spans` under vLLM's resource and scope.
fn request(spans: Vec<Span>) -> ExportTraceServiceRequest {
    let resource = Resource {
        attributes: vec![
            // What the OpenTelemetry SDK names a process without `OTEL_SERVICE_NAME`.
            attr("service.name", Value::StringValue("unknown_service".into())),
            attr(
                "vllm.instrumenting_module_name",
                Value::StringValue(SCOPE.into()),
            ),
            attr(
                "vllm.process_id",
                Value::StringValue(std::process::id().to_string()),
            ),
        ],
        ..Default::default()
    };
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: SCOPE.into(),
                    ..Default::default()
                }),
                spans,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// Exports what is queued, a batch at a time, until every sender is gone.
async fn export_loop(endpoint: String, mut rx: mpsc::Receiver<Span>) {
    let client = reqwest::Client::new();
    while let Some(first) = rx.recv().await {
        let mut spans = vec![first];
        while spans.len() < BATCH {
            match rx.try_recv() {
                Ok(s) => spans.push(s),
                Err(_) => break,
            }
        }
        let n = spans.len();
        let sent = client
            .post(&endpoint)
            .header("content-type", "application/x-protobuf")
            .timeout(TIMEOUT)
            .body(request(spans).encode_to_vec())
            .send()
            .await
            .and_then(reqwest::Response::error_for_status);
        if let Err(e) = sent {
            tracing::warn!(%endpoint, error = %e, spans = n, "the OTLP export failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_parsed_as_the_w3c_format_says() {
        let (t, p, sampled) =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(t[0], 0x4b);
        assert_eq!(p, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert!(sampled);
        let unsampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!parse_traceparent(unsampled).unwrap().2);
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736",
        ] {
            assert_eq!(parse_traceparent(bad.as_bytes()), None, "{bad}");
        }
    }
}
