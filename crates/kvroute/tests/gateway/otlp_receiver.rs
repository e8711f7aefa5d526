//! A real OTLP receiver in the test process, over HTTP (an axum server taking `POST /v1/traces`
//! protobuf bodies) or gRPC (a tonic server of `opentelemetry-proto`'s generated trace
//! service), decoding what it receives with `opentelemetry-proto`, and the spans it holds,
//! looked up by trace with a deadline.

use crate::common;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tonic::transport::server::TcpIncoming;

/// One span as the receiver decoded it (ids in lowercase hex, attributes as JSON values).
#[derive(Clone, Debug)]
pub struct Got {
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent: String,
    pub name: String,
    pub kind: i32,
    pub start: u64,
    pub end: u64,
    pub attrs: BTreeMap<String, Value>,
    pub events: Vec<(String, u64)>,
    pub error: bool,
}

impl Got {
    pub fn attr(&self, key: &str) -> &Value {
        self.attrs.get(key).unwrap_or(&Value::Null)
    }
    /// Starts no earlier and ends no later than `parent`.
    pub fn within(&self, parent: &Got) -> bool {
        parent.start <= self.start && self.end <= parent.end
    }
}

#[derive(Default)]
struct Seen {
    spans: Vec<Got>,
    /// Export requests received, and any that were not OTLP protobuf.
    posts: usize,
    refused: Vec<String>,
}

/// A real OTLP receiver on a loopback port: HTTP protobuf or gRPC.
pub struct Receiver {
    /// The traces endpoint (`…/v1/traces` over HTTP; the origin for gRPC).
    pub url: String,
    seen: Arc<Mutex<Seen>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn json_of(kv: &KeyValue) -> Value {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => json!(s),
        Some(Any::IntValue(i)) => json!(i),
        Some(Any::DoubleValue(d)) => json!(d),
        Some(Any::BoolValue(b)) => json!(b),
        other => json!(format!("{other:?}")),
    }
}

fn decode(body: &[u8]) -> Result<Vec<Got>, String> {
    ExportTraceServiceRequest::decode(body)
        .map(spans_of)
        .map_err(|e| e.to_string())
}

/// The spans of one export request.
fn spans_of(req: ExportTraceServiceRequest) -> Vec<Got> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| json_of(kv).as_str().unwrap_or_default().to_string())
            .unwrap_or_default();
        for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
            out.push(Got {
                service: service.clone(),
                trace_id: hex(&s.trace_id),
                span_id: hex(&s.span_id),
                parent: hex(&s.parent_span_id),
                name: s.name,
                kind: s.kind,
                start: s.start_time_unix_nano,
                end: s.end_time_unix_nano,
                attrs: s
                    .attributes
                    .iter()
                    .map(|kv| (kv.key.clone(), json_of(kv)))
                    .collect(),
                events: s
                    .events
                    .into_iter()
                    .map(|e| (e.name, e.time_unix_nano))
                    .collect(),
                error: s.status.is_some_and(|st| st.code == 2),
            });
        }
    }
    out
}

impl Receiver {
    /// An OTLP/HTTP receiver taking protobuf bodies at `POST /v1/traces`.
    pub async fn start() -> Receiver {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let s = seen.clone();
        let app = Router::new().route(
            "/v1/traces",
            post(move |headers: HeaderMap, body: Bytes| {
                let s = s.clone();
                async move {
                    let ctype = headers
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    let mut g = s.lock().unwrap();
                    g.posts += 1;
                    let decoded = if ctype == "application/x-protobuf" {
                        decode(&body)
                    } else {
                        Err(format!("content-type {ctype:?}"))
                    };
                    match decoded {
                        Ok(spans) => g.spans.extend(spans),
                        Err(e) => {
                            g.refused.push(e);
                            return (StatusCode::BAD_REQUEST, Vec::new());
                        }
                    }
                    (
                        StatusCode::OK,
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver {
            url: format!("http://{addr}/v1/traces"),
            seen,
        }
    }

    /// An OTLP/gRPC receiver: a tonic server of the collector's trace service.
    pub async fn start_grpc() -> Receiver {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = TraceServiceServer::new(GrpcSink(seen.clone()));
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpIncoming::from(listener))
                .await;
        });
        Receiver {
            url: format!("http://{addr}"),
            seen,
        }
    }

    pub fn posts(&self) -> usize {
        self.seen.lock().unwrap().posts
    }

    /// The spans of `trace_id` once `names` have all arrived; fails the test when they do not
    /// within the wait's deadline.
    pub async fn trace(&self, trace_id: &str, names: &[&str]) -> Vec<Got> {
        let what = format!("the spans {names:?} of trace {trace_id}");
        common::wait_for(common::WAIT, &what, || async {
            let g = self.seen.lock().unwrap();
            assert!(g.refused.is_empty(), "refused exports: {:?}", g.refused);
            let spans: Vec<Got> = g
                .spans
                .iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect();
            let missing: Vec<&&str> = names
                .iter()
                .filter(|n| {
                    spans.iter().filter(|s| s.name == **n).count()
                        < names.iter().filter(|m| m == n).count()
                })
                .collect();
            if missing.is_empty() {
                Ok(spans)
            } else {
                Err(format!(
                    "missing {missing:?}; have {:?}",
                    spans.iter().map(|s| &s.name).collect::<Vec<_>>()
                ))
            }
        })
        .await
    }
}

pub fn one<'a>(spans: &'a [Got], name: &str) -> &'a Got {
    let all: Vec<&Got> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(all.len(), 1, "one {name} span: {spans:#?}");
    all[0]
}

/// The gRPC receiver's trace service: every export is kept.
struct GrpcSink(Arc<Mutex<Seen>>);

#[tonic::async_trait]
impl TraceService for GrpcSink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = spans_of(request.into_inner());
        let mut g = self.0.lock().unwrap();
        g.posts += 1;
        g.spans.extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}
