//! The `[tracing]` section of the configuration: where the gateway's OpenTelemetry traces go.
//!
//! Owns: [`TracingConfig`] (the OTLP traces endpoint, protocol, service name and the batch
//! export delay), its validation as plain data, each error naming its field, and the OTLP
//! protocols this build exports with ([`OtlpProtocol`], each with the OpenTelemetry
//! specification's default endpoint).
//! Invariants: plain data. Every field is optional: an unset one falls back to the standard
//! `OTEL_*` environment variable, then to the default (`gateway::otel` resolves them); with
//! neither this section nor an endpoint in the environment, tracing is off.
//! Must not: read the environment, start an exporter or reach the network.

use serde::{Deserialize, Serialize};

/// An OTLP protocol this build exports with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `http/protobuf`: protobuf bodies POSTed to the traces endpoint (a collector's 4318).
    HttpProtobuf,
    /// `grpc`: the trace service's `Export` call over HTTP/2 (a collector's 4317).
    Grpc,
}

impl OtlpProtocol {
    /// The protocol's name in `OTEL_EXPORTER_OTLP_PROTOCOL`.
    pub fn name(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::Grpc => "grpc",
        }
    }

    /// The specification's default traces endpoint for the protocol, on this host.
    pub fn default_endpoint(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http://localhost:4318/v1/traces",
            OtlpProtocol::Grpc => "http://localhost:4317",
        }
    }

    /// The traces endpoint under a generic base (`OTEL_EXPORTER_OTLP_ENDPOINT`): OTLP/HTTP
    /// appends the signal's path, gRPC uses the base as it is.
    pub fn traces_endpoint(self, base: &str) -> String {
        match self {
            OtlpProtocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
            OtlpProtocol::Grpc => base.to_string(),
        }
    }
}

/// `[tracing]`: OpenTelemetry traces of each request, exported over OTLP.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The OTLP traces endpoint, used as given (`http://collector:4318/v1/traces`,
    /// `http://collector:4317` for gRPC), as `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and vLLM's
    /// `--otlp-traces-endpoint` are. Beats the environment's `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
    /// and `OTEL_EXPORTER_OTLP_ENDPOINT`; none anywhere: the protocol's default on this host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_traces_endpoint: Option<String>,
    /// The OTLP protocol: `http/protobuf` (the default) or `grpc`. Beats
    /// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` and `OTEL_EXPORTER_OTLP_PROTOCOL`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// The `service.name` of the spans. Beats `OTEL_SERVICE_NAME`; default `kvroute`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// Milliseconds between two batch exports. Beats `OTEL_BSP_SCHEDULE_DELAY`; default 5000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_delay_ms: Option<u64>,
}

impl TracingConfig {
    /// Checks each set field (an unset one is the environment's or the default).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(e) = &self.otlp_traces_endpoint {
            check_endpoint(e).map_err(|m| format!("tracing.otlp_traces_endpoint: {m}"))?;
        }
        if let Some(p) = &self.protocol {
            check_protocol(p).map_err(|m| format!("tracing.protocol: {m}"))?;
        }
        if self
            .service_name
            .as_ref()
            .is_some_and(|s| s.trim().is_empty())
        {
            return Err("tracing.service_name is empty".into());
        }
        if self
            .schedule_delay_ms
            .is_some_and(|d| !(1..=600_000).contains(&d))
        {
            return Err("tracing.schedule_delay_ms must be between 1 and 600000".into());
        }
        Ok(())
    }
}

/// An OTLP endpoint (HTTP or gRPC): an `http://` or `https://` URL with a host.
pub fn check_endpoint(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| format!("`{url}` is not an http:// or https:// URL"))?;
    if rest.is_empty() || rest.starts_with('/') || url.chars().any(char::is_whitespace) {
        return Err(format!("`{url}` has no host"));
    }
    Ok(())
}

/// The protocol named `p`, when this build can export with it.
pub fn check_protocol(p: &str) -> Result<OtlpProtocol, String> {
    match p.trim() {
        "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
        "grpc" => Ok(OtlpProtocol::Grpc),
        "http/json" => Err(format!(
            "`{p}` is not supported by this build: use http/protobuf (a collector's port 4318) \
             or grpc (4317)"
        )),
        other => Err(format!("unknown OTLP protocol `{other}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_protocol_has_the_specifications_default_endpoint_and_base_rule() {
        let (h, g) = (OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc);
        assert_eq!(check_protocol(" grpc "), Ok(g));
        assert_eq!(check_protocol("http/protobuf"), Ok(h));
        assert!(check_protocol("http/json").unwrap_err().contains("grpc"));
        assert_eq!(h.default_endpoint(), "http://localhost:4318/v1/traces");
        assert_eq!(g.default_endpoint(), "http://localhost:4317");
        assert_eq!(
            h.traces_endpoint("http://c:4318/"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(g.traces_endpoint("http://c:4317"), "http://c:4317");
    }

    #[test]
    fn an_empty_section_is_valid_and_names_nothing() {
        assert_eq!(TracingConfig::default().validate(), Ok(()));
    }

    #[test]
    fn each_bad_field_is_named() {
        let bad = |c: TracingConfig, field: &str| {
            let e = c.validate().unwrap_err();
            assert!(e.contains(field), "{e}");
        };
        bad(
            TracingConfig {
                otlp_traces_endpoint: Some("collector:4318".into()),
                ..Default::default()
            },
            "otlp_traces_endpoint",
        );
        bad(
            TracingConfig {
                otlp_traces_endpoint: Some("http:///v1/traces".into()),
                ..Default::default()
            },
            "otlp_traces_endpoint",
        );
        bad(
            TracingConfig {
                protocol: Some("http/json".into()),
                ..Default::default()
            },
            "protocol",
        );
        bad(
            TracingConfig {
                service_name: Some(" ".into()),
                ..Default::default()
            },
            "service_name",
        );
        bad(
            TracingConfig {
                schedule_delay_ms: Some(0),
                ..Default::default()
            },
            "schedule_delay_ms",
        );
        let good = TracingConfig {
            otlp_traces_endpoint: Some("https://otel.example:4318/v1/traces".into()),
            protocol: Some("http/protobuf".into()),
            service_name: Some("router-a".into()),
            schedule_delay_ms: Some(50),
        };
        assert_eq!(good.validate(), Ok(()));
    }
}
