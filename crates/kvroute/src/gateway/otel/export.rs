//! Where the spans go: the OTLP settings resolved from the `[tracing]` section and the standard
//! `OTEL_*` environment, and the tracer provider that exports to them.
//!
//! Owns: [`resolve`] (the configuration file beats the environment, the signal-specific variable
//! beats the generic one; no `[tracing]` section and no endpoint in the environment, or
//! `OTEL_SDK_DISABLED=true`: off), [`build`] (the OTLP exporter of the resolved protocol —
//! HTTP protobuf, or gRPC through [`grpc`] — behind the SDK's batch span processor, its
//! resource's `service.name`), and the HTTP exporter's client ([`ExportClient`]).
//! Invariants: the batch processor exports on a thread of its own, never on the gateway's
//! runtime; the HTTP client it uses is a blocking one, built off the runtime and used only
//! there, and the gRPC channel runs on a runtime of its own, so a slow or absent collector never
//! holds a request and a shutdown from inside the runtime cannot wait on the runtime it blocks.
//! A span the processor's queue cannot take is dropped.
//! Must not: read a request, or panic on a setting (a bad one is an [`OtelError`]).

use super::grpc;
use crate::gateway::config::otel::{check_endpoint, check_protocol, OtlpProtocol, TracingConfig};
use bytes::Bytes;
use opentelemetry::InstrumentationScope;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanExporter,
};
use opentelemetry_sdk::Resource;
use std::io::Read;
use std::time::Duration;

/// A tracing setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    #[error("{source_name}: {reason}")]
    Setting {
        /// The configuration field or environment variable.
        source_name: String,
        reason: String,
    },
    #[error("the OTLP exporter could not be built: {0}")]
    Build(String),
}

/// Where and how the spans are exported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSettings {
    /// The traces endpoint, used as it is (`…/v1/traces` over HTTP).
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    pub service_name: String,
    /// The batch processor's delay between exports; `None`: the SDK's (`OTEL_BSP_SCHEDULE_DELAY`,
    /// else 5 s).
    pub schedule_delay: Option<Duration>,
    /// One export's bound.
    pub timeout: Duration,
}

/// The default `service.name`.
pub const SERVICE_NAME: &str = "kvroute";
/// The default export timeout (`OTEL_EXPORTER_OTLP_TIMEOUT`'s default).
const TIMEOUT: Duration = Duration::from_secs(10);
/// The largest collector answer read (it is a small status message).
const MAX_ANSWER: u64 = 4 << 20;

/// Where a setting came from (a configuration field or an environment variable) and its value.
type Found = (&'static str, String);

/// The settings from `cfg` and the environment (`env` looks a variable up): `Ok(None)` when
/// tracing is off.
pub fn resolve(
    cfg: Option<&TracingConfig>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<ExportSettings>, OtelError> {
    // The configuration's value when set, else the first of `vars` set to something.
    let first = |from_cfg: Option<Found>, vars: &[&'static str]| -> Option<Found> {
        from_cfg.or_else(|| {
            vars.iter().find_map(|k| {
                let v = env(k)?.trim().to_string();
                (!v.is_empty()).then_some((*k, v))
            })
        })
    };
    let field = |name: &'static str, f: fn(&TracingConfig) -> &Option<String>| {
        cfg.and_then(|c| f(c).clone()).map(|v| (name, v))
    };
    let bad = |(name, reason): (&str, String)| OtelError::Setting {
        source_name: name.to_string(),
        reason,
    };
    if first(None, &["OTEL_SDK_DISABLED"]).is_some_and(|(_, v)| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    // Off without a `[tracing]` section or an endpoint in the environment, whatever else the
    // environment holds (another program's protocol setting does not stop a start).
    let env_endpoint = first(
        None,
        &[
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ],
    );
    if cfg.is_none() && env_endpoint.is_none() {
        return Ok(None);
    }
    let protocol = match first(
        field("tracing.protocol", |c| &c.protocol),
        &[
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ],
    ) {
        Some((from, p)) => check_protocol(&p).map_err(|m| bad((from, m)))?,
        None => OtlpProtocol::HttpProtobuf,
    };
    let (from, endpoint) = first(
        field("tracing.otlp_traces_endpoint", |c| &c.otlp_traces_endpoint),
        &["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"],
    )
    .or_else(|| {
        // The generic endpoint is a base: OTLP/HTTP puts the traces' path after it.
        let (k, base) = first(None, &["OTEL_EXPORTER_OTLP_ENDPOINT"])?;
        Some((k, protocol.traces_endpoint(&base)))
    })
    // Else a `[tracing]` section is configuration enough: the protocol's default endpoint.
    .unwrap_or_else(|| ("the default endpoint", protocol.default_endpoint().into()));
    check_endpoint(&endpoint).map_err(|m| bad((from, m)))?;
    let service_name = first(
        field("tracing.service_name", |c| &c.service_name),
        &["OTEL_SERVICE_NAME"],
    )
    .map_or_else(|| SERVICE_NAME.to_string(), |(_, v)| v);
    let timeout = match first(
        None,
        &[
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ],
    ) {
        None => TIMEOUT,
        Some((k, v)) => match v.parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => {
                return Err(bad((
                    k,
                    format!("`{v}` is not a positive number of milliseconds"),
                )))
            }
        },
    };
    Ok(Some(ExportSettings {
        endpoint,
        protocol,
        service_name,
        schedule_delay: cfg
            .and_then(|c| c.schedule_delay_ms)
            .map(Duration::from_millis),
        timeout,
    }))
}

/// The tracer provider exporting to `s` (its batch processor's thread started).
pub fn build(s: &ExportSettings) -> Result<SdkTracerProvider, OtelError> {
    match s.protocol {
        OtlpProtocol::HttpProtobuf => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(ExportClient::new(s.timeout)?)
                .with_endpoint(s.endpoint.clone())
                .with_protocol(Protocol::HttpBinary)
                .with_timeout(s.timeout)
                .build()
                .map_err(|e| OtelError::Build(e.to_string()))?;
            Ok(provider(exporter, s))
        }
        OtlpProtocol::Grpc => {
            let exporter =
                grpc::GrpcExporter::new(&s.endpoint, s.timeout).map_err(OtelError::Build)?;
            Ok(provider(exporter, s))
        }
    }
}

/// The provider exporting through `exporter` behind a batch processor.
fn provider(exporter: impl SpanExporter + 'static, s: &ExportSettings) -> SdkTracerProvider {
    let mut batch = BatchConfigBuilder::default();
    if let Some(d) = s.schedule_delay {
        batch = batch.with_scheduled_delay(d);
    }
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch.build())
        .build();
    let resource = Resource::builder()
        .with_service_name(s.service_name.clone())
        .build();
    SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build()
}

/// The instrumentation scope of the gateway's spans.
pub fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("kvroute")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

/// The exporter's HTTP client: the workspace's reqwest, blocking, on the batch processor's
/// thread (TLS with the system's roots for an `https://` collector).
#[derive(Debug)]
struct ExportClient(reqwest::blocking::Client);

impl ExportClient {
    /// Built on a thread of its own: a blocking client starts a runtime, which must not happen
    /// inside the gateway's.
    fn new(timeout: Duration) -> Result<ExportClient, OtelError> {
        std::thread::spawn(move || {
            reqwest::blocking::Client::builder()
                .use_rustls_tls()
                .timeout(timeout)
                .build()
        })
        .join()
        .map_err(|_| OtelError::Build("building the HTTP client panicked".into()))?
        .map(ExportClient)
        .map_err(|e| OtelError::Build(e.to_string()))
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let answer = self
            .0
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .send()?;
        let status = answer.status();
        let headers = answer.headers().clone();
        let mut bytes = Vec::new();
        answer.take(MAX_ANSWER).read_to_end(&mut bytes)?;
        let mut r = Response::new(Bytes::from(bytes));
        *r.status_mut() = status;
        *r.headers_mut() = headers;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn without_a_section_or_an_endpoint_in_the_environment_tracing_is_off() {
        assert_eq!(resolve(None, env(&[])).unwrap(), None);
        let no_endpoint = [
            ("OTEL_SERVICE_NAME", "r"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", " "),
        ];
        assert_eq!(resolve(None, env(&no_endpoint)).unwrap(), None);
        // A protocol this build cannot export with is no error while tracing is off.
        let json = [("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")];
        assert_eq!(resolve(None, env(&json)).unwrap(), None);
    }

    #[test]
    fn a_section_without_an_endpoint_exports_to_the_protocols_default_endpoint() {
        let cfg = TracingConfig {
            service_name: Some("r".into()),
            ..Default::default()
        };
        let s = resolve(Some(&cfg), env(&[])).unwrap().unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.protocol),
            (
                "http://localhost:4318/v1/traces",
                OtlpProtocol::HttpProtobuf
            )
        );
        let grpc = [("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")];
        let s = resolve(Some(&cfg), env(&grpc)).unwrap().unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.protocol),
            ("http://localhost:4317", OtlpProtocol::Grpc)
        );
    }

    #[test]
    fn over_grpc_the_generic_endpoint_is_used_as_it_is() {
        let e = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ];
        let s = resolve(None, env(&e)).unwrap().unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.protocol),
            ("http://c:4317", OtlpProtocol::Grpc)
        );
        // The signal's protocol beats the generic one.
        let both = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        ];
        let s = resolve(None, env(&both)).unwrap().unwrap();
        assert_eq!(s.endpoint, "http://c:4318/v1/traces");
    }

    #[test]
    fn the_generic_endpoint_is_a_base_and_the_traces_endpoint_is_used_as_given() {
        let s = resolve(
            None,
            env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.endpoint, "http://c:4318/v1/traces");
        assert_eq!(s.service_name, SERVICE_NAME);
        assert_eq!((s.schedule_delay, s.timeout), (None, TIMEOUT));
        let both = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:9/traces"),
            ("OTEL_SERVICE_NAME", "router-a"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
        ];
        let s = resolve(None, env(&both)).unwrap().unwrap();
        assert_eq!(s.endpoint, "http://t:9/traces");
        assert_eq!(s.service_name, "router-a");
        assert_eq!(s.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn the_configuration_file_beats_the_environment() {
        let cfg = TracingConfig {
            otlp_traces_endpoint: Some("https://file:4318/v1/traces".into()),
            protocol: Some("http/protobuf".into()),
            service_name: Some("from-file".into()),
            schedule_delay_ms: Some(20),
        };
        let e = [
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://env:4318/v1/traces",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_SERVICE_NAME", "from-env"),
        ];
        let s = resolve(Some(&cfg), env(&e)).unwrap().unwrap();
        assert_eq!(s.endpoint, "https://file:4318/v1/traces");
        assert_eq!(s.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(s.service_name, "from-file");
        assert_eq!(s.schedule_delay, Some(Duration::from_millis(20)));
        let off = [("OTEL_SDK_DISABLED", "TRUE")];
        assert_eq!(resolve(Some(&cfg), env(&off)).unwrap(), None);
    }

    #[test]
    fn an_unusable_setting_is_an_error_naming_where_it_came_from() {
        let json = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ];
        let e = resolve(None, env(&json)).unwrap_err().to_string();
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") && e.contains("http/json"),
            "{e}"
        );
        let no_scheme = [("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "c:4318")];
        let e = resolve(None, env(&no_scheme)).unwrap_err().to_string();
        assert!(e.contains("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), "{e}");
        let timeout = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon"),
        ];
        let e = resolve(None, env(&timeout)).unwrap_err().to_string();
        assert!(e.contains("OTEL_EXPORTER_OTLP_TIMEOUT"), "{e}");
    }
}
