//! The gateway: an OpenAI-compatible router in front of a fleet of engines.
//!
//! Its modules import one way, checked by `tools/modcycles.py` in CI:
//! - the front door: the listeners ([`listen`], their TLS [`tls`]), the request's parse and validation
//!   ([`request`], [`tokenize`]), the tenants ([`tenants`]), the proxy handler ([`proxy`],
//!   [`forward`], [`disagg`], the error bodies [`reply`]), its traces ([`otel`]), reading answers ([`answer`]), the
//!   admin API ([`admin`]), the probes ([`probes`]), reloads ([`reload`]), the shared state
//!   ([`state`]) and starting it all ([`server`]);
//! - the fleet state: the registry ([`registry`]), health checks ([`health`]), engine load
//!   ([`engine_load`], [`engine_poll`]), discovery ([`discovery`]), the reconciler ([`fleet`]),
//!   intake ([`intake`]), snapshots ([`snapshot`]) and the learners ([`arrivals`],
//!   [`conversations`], [`decoding`], [`eviction`], [`pending`], [`sessions`], [`ttft`]);
//! - the routing core: [`policy`] and [`decide`].
//!
//! Configuration ([`config`]) is plain data and [`metrics`] a leaf both layers use.
//! This file only declares the modules and re-exports the entry points (nothing inside imports
//! them from here).

pub mod admin;
pub mod answer;
pub mod arrivals;
pub mod config;
pub mod conversations;
pub mod decide;
pub mod decoding;
pub mod disagg;
pub mod discovery;
pub mod engine_load;
pub mod engine_poll;
pub mod eviction;
pub mod fleet;
pub mod forward;
pub mod health;
pub mod intake;
pub mod learners;
pub mod listen;
pub mod metrics;
pub mod observe;
pub mod otel;
pub mod peer_wire;
pub mod peers;
pub mod pending;
pub mod probes;
pub mod proxy;
pub mod registry;
pub mod reload;
pub mod reply;
pub mod request;
pub mod server;
pub mod sessions;
pub mod snapshot;
pub mod state;
pub mod tenants;
pub mod tls;
pub mod tokenize;
pub mod ttft;

pub use server::{admin_router, front_router, Gateway, GatewayHandle};
pub use state::AppState;
