//! The gateway's smaller integration suites, in one test binary (one link instead of six):
//! the circuit breaker, LoRA adapters, engine generations, several replicas, the front and
//! admin API's errors, and disaggregated prefill and decode. Each module says what it covers.

#[path = "../common/mod.rs"]
mod common;

mod breaker;
mod disagg;
mod engines;
mod errors;
mod lora;
mod replicas;
