//! The gateway's smaller integration suites, in one test binary (one link instead of ten):
//! the circuit breaker, LoRA adapters, engine generations, several replicas, the front and
//! admin API's errors, disaggregated prefill and decode, workers failing over HTTP, OpenTelemetry
//! traces against real OTLP receivers (HTTP and gRPC, `otlp_receiver`), tenants at
//! the front door, configuration reload and worker discovery. Each module says what it covers.

#[path = "../common/mod.rs"]
mod common;

mod breaker;
mod disagg;
mod discovery;
mod engines;
mod errors;
mod explain;
mod lora;
mod otlp_receiver;
mod peers;
mod reload;
mod replicas;
mod tenants;
mod tiers;
mod traces;
mod traces_grpc;
mod worker_faults;
