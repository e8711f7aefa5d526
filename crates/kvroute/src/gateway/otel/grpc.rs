//! The OTLP/gRPC exporter, on a Tokio runtime of its own.
//!
//! Owns: [`GrpcExporter`] (opentelemetry-otlp's tonic exporter for the resolved endpoint, TLS
//! with the system's roots for an `https://` one) and the current-thread runtime its channel
//! connects and sends on, one thread named `kvroute-otlp-grpc`.
//! Invariants: the channel is created inside that runtime, so its connection task never runs on
//! the gateway's runtime; the batch processor's thread only waits on the channel's answers.
//! The runtime lives as long as the exporter (the processor drops it when it stops), and then
//! ends its thread.
//! Must not: block the gateway's runtime, or panic on a setting (a bad one is an error).

use opentelemetry_otlp::tonic_types::transport::ClientTlsConfig;
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use std::future::Future;
use std::time::Duration;
use tokio::sync::oneshot;

/// The tonic span exporter and the runtime its channel lives on (dropped in this order).
#[derive(Debug)]
pub(super) struct GrpcExporter {
    exporter: opentelemetry_otlp::SpanExporter,
    _runtime: Runtime,
}

impl GrpcExporter {
    /// The exporter to `endpoint`, each export bounded by `timeout`, its runtime's thread
    /// started; the error says what failed.
    pub(super) fn new(endpoint: &str, timeout: Duration) -> Result<GrpcExporter, String> {
        let runtime = Runtime::start()?;
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(timeout);
        if endpoint.starts_with("https://") {
            builder = builder.with_tls_config(ClientTlsConfig::new().with_native_roots());
        }
        // The lazily connecting channel spawns its task on the runtime entered here.
        let exporter = {
            let _entered = runtime.handle.enter();
            builder.build()
        }
        .map_err(|e| e.to_string())?;
        Ok(GrpcExporter {
            exporter,
            _runtime: runtime,
        })
    }
}

impl SpanExporter for GrpcExporter {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        self.exporter.export(batch)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.exporter.set_resource(resource);
    }
}

/// A current-thread runtime on a thread of its own, running until this is dropped.
#[derive(Debug)]
struct Runtime {
    handle: tokio::runtime::Handle,
    /// Dropping it ends the runtime's thread (and the runtime, dropped there).
    _stop: oneshot::Sender<()>,
}

impl Runtime {
    fn start() -> Result<Runtime, String> {
        let failed = |e: std::io::Error| format!("the gRPC exporter's runtime: {e}");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(failed)?;
        let handle = rt.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("kvroute-otlp-grpc".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(failed)?;
        Ok(Runtime {
            handle,
            _stop: stop,
        })
    }
}
