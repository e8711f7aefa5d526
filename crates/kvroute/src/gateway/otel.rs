//! OpenTelemetry traces of each request, and the W3C trace context passed to the engines.
//!
//! Owns: [`Tracing`] (one per gateway: the tracer provider exporting over OTLP, or nothing when
//! tracing is not configured — [`export`] resolves and builds it, [`grpc`] holds the gRPC
//! exporter's runtime), [`RequestTrace`] (one per
//! request: the root span, of kind server, a child of the client's `traceparent` when it sent
//! a valid one), the stage spans ([`Stage`]: `parse`, `tokenize`, `decide`), the spans towards
//! an engine ([`Forwarding`]: `forward`, of kind client, with its `first_byte` event) and the
//! headers the engine receives ([`EngineHeaders`]), and ending the root span with the answer's
//! body ([`RequestTrace::finish`]).
//! Invariants: with tracing off nothing is parsed, started or allocated per request beyond
//! copying the client's `traceparent` and `tracestate`, which the engine receives unchanged;
//! with tracing on the engine's `traceparent` names the `forward` span as its parent (a new
//! trace when the client sent none), a malformed client `traceparent` is ignored and counted
//! (`kvroute_trace_context_invalid_total`), and a child span ends before its parent. Attributes
//! are computed only for a live span (the callers pass closures).
//! Must not: decide anything, change a request's body or an answer's bytes, or block a request
//! on the exporter (spans are handed to the batch processor's queue).

pub mod context;
pub mod export;
mod grpc;

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use futures_util::Stream;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span};
use prometheus::IntCounter;
use std::pin::Pin;
use std::task::Poll;

pub use export::{ExportSettings, OtelError};

/// The gateway's tracing: on (a provider exporting over OTLP) or off.
pub struct Tracing {
    live: Option<(SdkTracerProvider, SdkTracer)>,
    /// Client `traceparent` headers ignored as malformed (counted only while tracing is on).
    invalid: IntCounter,
}

impl Tracing {
    /// Tracing as `settings` say (`None`: off); `invalid` counts malformed client headers.
    pub fn new(
        settings: Option<&ExportSettings>,
        invalid: IntCounter,
    ) -> Result<Tracing, OtelError> {
        let live = match settings {
            None => None,
            Some(s) => {
                let provider = export::build(s)?;
                let tracer = provider.tracer_with_scope(export::scope());
                tracing::info!(endpoint = %s.endpoint, protocol = s.protocol.name(), service = %s.service_name, "exporting traces over OTLP");
                Some((provider, tracer))
            }
        };
        Ok(Tracing { live, invalid })
    }

    pub fn enabled(&self) -> bool {
        self.live.is_some()
    }

    /// The trace of one request, started now: `name` is its root span's (`POST /v1/…`).
    pub fn request(
        &self,
        headers: &HeaderMap,
        name: &'static str,
        path: &'static str,
    ) -> RequestTrace {
        let Some((_, tracer)) = &self.live else {
            return RequestTrace {
                live: None,
                client: client_headers(headers),
            };
        };
        let parent = match context::client_parent(headers) {
            Ok(Some(sc)) => Context::new().with_remote_span_context(sc),
            Ok(None) => Context::new(),
            Err(why) => {
                self.invalid.inc();
                tracing::debug!(%why, "client traceparent ignored");
                Context::new()
            }
        };
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("http.route", path),
                KeyValue::new("url.path", path),
            ])
            .start_with_context(tracer, &parent);
        RequestTrace {
            live: Some(Live {
                tracer: tracer.clone(),
                root: parent.with_span(span),
            }),
            client: Vec::new(),
        }
    }

    /// Exports what is queued and stops the exporter (blocking: call it off the runtime's
    /// threads, as [`Tracing::shutdown`] does).
    fn stop(provider: &SdkTracerProvider) {
        if let Err(e) = provider.shutdown() {
            tracing::warn!(error = %e, "the trace exporter did not stop cleanly");
        }
    }

    /// Flushes the queued spans and stops the exporter (a no-op when off).
    pub async fn shutdown(&self) {
        if let Some((provider, _)) = &self.live {
            let provider = provider.clone();
            let _ = tokio::task::spawn_blocking(move || Tracing::stop(&provider)).await;
        }
    }
}

/// The client's trace context headers, as they came.
fn client_headers(headers: &HeaderMap) -> Vec<(&'static str, HeaderValue)> {
    let mut out = Vec::new();
    for name in ["traceparent", "tracestate"] {
        out.extend(headers.get_all(name).iter().map(|v| (name, v.clone())));
    }
    out
}

struct Live {
    tracer: SdkTracer,
    /// The parent context holding the root span.
    root: Context,
}

/// One request's trace: live, or (tracing off) the client's headers to pass on.
pub struct RequestTrace {
    live: Option<Live>,
    client: Vec<(&'static str, HeaderValue)>,
}

impl RequestTrace {
    /// A request outside any gateway's tracing (tracing off, no client headers).
    pub fn none() -> RequestTrace {
        RequestTrace {
            live: None,
            client: Vec::new(),
        }
    }

    fn child(&self, name: &'static str, kind: SpanKind) -> Option<Span> {
        let l = self.live.as_ref()?;
        Some(
            l.tracer
                .span_builder(name)
                .with_kind(kind)
                .start_with_context(&l.tracer, &l.root),
        )
    }

    /// A stage of the request, started now, ended when dropped.
    pub fn stage(&self, name: &'static str) -> Stage {
        Stage(self.child(name, SpanKind::Internal))
    }

    /// Sets attributes on the root span (computed only when it is live).
    pub fn record(&self, attrs: impl FnOnce() -> Vec<KeyValue>) {
        if let Some(l) = &self.live {
            l.root.span().set_attributes(attrs());
        }
    }

    /// The span of one attempt to send the request to an engine at `url` (`worker` its name,
    /// `leg` `whole`, `prefill` or `decode`), and the trace context headers the engine gets.
    pub fn forward(
        &self,
        worker: &str,
        url: &str,
        leg: &'static str,
        attempt: usize,
    ) -> Forwarding {
        let Some(mut span) = self.child("forward", SpanKind::Client) else {
            return Forwarding {
                span: None,
                headers: EngineHeaders(self.client.clone()),
            };
        };
        span.set_attributes([
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("url.full", url.to_string()),
            KeyValue::new("kvroute.worker", worker.to_string()),
            KeyValue::new("kvroute.leg", leg),
            KeyValue::new("kvroute.attempt", attempt as i64),
        ]);
        let sc = span.span_context();
        let mut headers = Vec::with_capacity(2);
        let parent = context::format_traceparent(sc.trace_id(), sc.span_id(), sc.trace_flags());
        if let Ok(v) = HeaderValue::from_str(&parent) {
            headers.push(("traceparent", v));
        }
        let state = sc.trace_state().header();
        if let (false, Ok(v)) = (state.is_empty(), HeaderValue::from_str(&state)) {
            headers.push(("tracestate", v));
        }
        Forwarding {
            span: Some(span),
            headers: EngineHeaders(headers),
        }
    }

    /// Ends the root span with the answer: its status now, its end when the body ends (at once
    /// for a body already whole, else when the last chunk went out or the client went away).
    pub fn finish(self, r: Response) -> Response {
        let Some(live) = self.live else {
            return r;
        };
        let status = r.status();
        let span = live.root.span();
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            span.set_status(Status::error(status.to_string()));
        }
        if r.body().size_hint().exact().is_some() {
            span.end();
            return r;
        }
        let (parts, body) = r.into_parts();
        let stream = EndsRoot {
            body: Some(body.into_data_stream()),
            root: Some(live.root),
        };
        Response::from_parts(parts, Body::from_stream(stream))
    }
}

/// A stage's span (none when tracing is off), ended when dropped.
pub struct Stage(Option<Span>);

impl Stage {
    /// Sets attributes (computed only when the span is live).
    pub fn record(&mut self, attrs: impl FnOnce() -> Vec<KeyValue>) {
        if let Some(s) = &mut self.0 {
            s.set_attributes(attrs());
        }
    }

    /// Marks the stage failed.
    pub fn fail(&mut self, message: impl FnOnce() -> String) {
        if let Some(s) = &mut self.0 {
            s.set_status(Status::error(message()));
        }
    }
}

/// The trace context headers an engine receives.
#[derive(Clone, Debug, Default)]
pub struct EngineHeaders(Vec<(&'static str, HeaderValue)>);

impl EngineHeaders {
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
        self.0.iter().map(|(k, v)| (*k, v))
    }
}

/// One attempt towards an engine: its span (none when tracing is off) and the headers the
/// engine receives. The span ends when this is dropped (with the answer's last byte, for a
/// stream).
pub struct Forwarding {
    span: Option<Span>,
    pub headers: EngineHeaders,
}

impl Forwarding {
    /// The engine's answer's head arrived, with `status`.
    pub fn answered(&mut self, status: u16) {
        if let Some(s) = &mut self.span {
            s.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
        }
    }

    /// The `first_byte` event: a stream's first chunk arrived (a whole answer's head).
    pub fn first_byte(&mut self) {
        if let Some(s) = &mut self.span {
            s.add_event("first_byte", Vec::new());
        }
    }

    /// Marks the attempt failed.
    pub fn fail(&mut self, message: impl FnOnce() -> String) {
        if let Some(s) = &mut self.span {
            s.set_status(Status::error(message()));
        }
    }

    /// Ends the span now.
    pub fn end(mut self) {
        if let Some(s) = &mut self.span {
            s.end();
        }
    }
}

/// A streamed answer's body that ends the root span after its last chunk, or when dropped
/// (the client went away) — after the body it wraps, whose spans end first.
struct EndsRoot<S> {
    body: Option<S>,
    root: Option<Context>,
}

impl<S> EndsRoot<S> {
    fn end(&mut self) {
        self.body = None;
        if let Some(root) = self.root.take() {
            root.span().end();
        }
    }
}

impl<S> Drop for EndsRoot<S> {
    fn drop(&mut self) {
        self.end();
    }
}

impl<S, E> Stream for EndsRoot<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    type Item = Result<Bytes, E>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(None);
        };
        let next = Pin::new(body).poll_next(cx);
        if let Poll::Ready(None) = next {
            self.end();
        }
        next
    }
}
