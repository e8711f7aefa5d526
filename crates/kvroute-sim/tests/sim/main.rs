//! The simulator's integration suites, in one test binary (one link instead of ten): the
//! engine core against the recorded corpora and the index, engine generations, LoRA, the HTTP
//! API (raw sockets and the official `openai` client), the recorded corpora over HTTP, the
//! wire stream, and publishing to a concrete endpoint. Each module says what it covers.

#[path = "../common/mod.rs"]
mod common;

mod connect_endpoint;
mod corpus_agreement;
mod corpus_http;
mod engine_behaviour;
mod engine_versions;
mod http_api;
mod index_agreement;
mod lora;
mod openai_client;
mod oracle_agreement;
mod oracle_tiers;
mod wire_stream;
