//! kvroute-wire's integration suites, in one test binary (one link instead of seven): the
//! real bytes of a vLLM 0.32 engine, every generation of the format, the table of malformed
//! inputs, no panics on arbitrary bytes, subscriptions against publishers in Rust and in
//! Python over real ZMQ, and vLLM 0.33's lookahead hashes. Each module says what it covers.

#[path = "../common/mod.rs"]
mod common;

mod conformance_sample;
mod formats;
mod malformed;
mod no_panic;
mod subscribe_python;
mod subscribe_rust;
mod vllm033;
