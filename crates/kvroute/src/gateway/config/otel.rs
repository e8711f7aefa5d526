//! The `[tracing]` section of the configuration: where the gateway's OpenTelemetry traces go.
//!
//! Owns: [`TracingConfig`] (the OTLP traces endpoint, protocol, service name and the batch
//! export delay) and its validation as plain data, each error naming its field.
//! Invariants: plain data. Every field is optional: an unset one falls back to the standard
//! `OTEL_*` environment variable, then to the default (`gateway::otel` resolves them); with no
//! endpoint here nor in the environment, tracing is off.
//! Must not: read the environment, start an exporter or reach the network.

use serde::{Deserialize, Serialize};

/// The one OTLP protocol this build exports with.
pub const HTTP_PROTOBUF: &str = "http/protobuf";

/// `[tracing]`: OpenTelemetry traces of each request, exported over OTLP.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The OTLP traces endpoint, used as given (`http://collector:4318/v1/traces`), as
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and vLLM's `--otlp-traces-endpoint` are. Beats the
    /// environment's `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and `OTEL_EXPORTER_OTLP_ENDPOINT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_traces_endpoint: Option<String>,
    /// The OTLP protocol: `http/protobuf` (the only one this build speaks). Beats
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

/// An OTLP/HTTP endpoint: an `http://` or `https://` URL with a host.
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

/// The protocol, when this build can export with it.
pub fn check_protocol(p: &str) -> Result<(), String> {
    match p.trim() {
        HTTP_PROTOBUF => Ok(()),
        "grpc" | "http/json" => Err(format!(
            "`{p}` is not supported by this build: use http/protobuf (a collector's port 4318)"
        )),
        other => Err(format!("unknown OTLP protocol `{other}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                protocol: Some("grpc".into()),
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
