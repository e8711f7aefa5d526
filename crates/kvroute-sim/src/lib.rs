//! kvroute-sim: a simulated hybrid vLLM engine on the real wire.
//!
//! Owns: vLLM 0.32's KV cache manager for full attention, sliding window, chunked local and
//! align-mode Mamba groups sharing one block pool (`pool`, `groups`, `cache`), with the
//! prefix-cache rules of vLLM 0.32 or 0.33 under speculative decoding (the EAGLE drop,
//! 0.33's lookahead hashes); its scheduler
//! and a step time model (`engine`, `timing`); the layouts and presets (`spec`); the ZMQ event
//! publisher (`wire`, `publisher`); the OpenAI-compatible HTTP server with metrics and fault
//! hooks (`http`, `worker`; the trace context each request arrived with, `trace_context`, and
//! the engine's span of each request exported over OTLP as vLLM's, `otlp`); disaggregated
//! prefill and decode over NixlConnector's protocol
//! (`disagg`); a CPU tier as either offload connector keeps one (`offload`, `simple_offload`);
//! the rules it reads from vLLM's sources itself, sharing none with kvroute-index (`vllm_rules`);
//! and the in-process fleet API (`fleet`). docs/sim.md is the
//! reference.
//! Invariants: the simulator's reported hit is the engine's hit computed by vLLM's rules over
//! the simulator's own pool, and every cache change is published as vLLM would publish it.
//! Must not: depend on the router's crates beyond the shared hashing and event model.

pub mod cache;
pub mod disagg;
pub mod engine;
pub mod error;
pub mod fleet;
pub(crate) mod groups;
pub mod http;
pub(crate) mod metrics;
pub mod offload;
pub mod otlp;
pub mod pool;
pub mod publisher;
pub mod simple_offload;
pub mod spec;
pub mod timing;
pub mod tokens;
pub mod trace_context;
pub mod vllm_rules;
pub mod wire;
pub mod worker;
pub mod zmtp;

pub use disagg::{KvRole, KvTransfer};
pub use engine::{Engine, EngineConfig, Lookup, Lora, NewRequest, RemoteKv, StepOutcome, TokenOut};
pub use error::SimError;
pub use fleet::{serve, start_worker, Fleet, FleetOptions, SimHandle};
pub use publisher::{PublisherConfig, ReplayLayout, WireFaults};
pub use spec::{preset, GroupKind, GroupSpec, ModelSpec, PRESETS};
pub use timing::TimeModel;
pub use wire::WireFormat;
pub use worker::{LoraModule, Submission, Worker, WorkerConfig};
