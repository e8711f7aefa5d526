//! The kvroute product: the gateway (OpenAI-compatible router in front of a fleet) and the
//! command-line tools built on the index and the wire crates.
//!
//! Owns: `gateway` (config, worker registry and health, routing policy, proxy, admin API,
//! metrics, event intake), `bench` (the load generator), `conformance`, `explain`, `events` and token-list parsing.
//! Must not: reimplement what kvroute-index or kvroute-wire own.

pub mod bench;
pub mod capture;
pub mod conformance;
pub mod demo;
pub mod events;
pub mod explain;
pub mod gateway;
pub mod simfleet;
pub mod tokens;
