//! kvroute-wire: what the engines send, decoded; and the live subscriptions that receive it.
//!
//! Owns: the msgpack batch/event decoder (vLLM every generation, SGLang), ZMQ frame layouts
//! (live and replay), wire counters, and per-(worker, rank) subscriptions with sequence
//! tracking, replay and restart handling. docs/wire.md is the reference for every format,
//! field and drop reason.
//! Invariants: nothing here panics on input; every refusal is a named, counted reason; events
//! of one (worker, rank) are delivered in wire order.
//! Must not: interpret events (which group rule, what a hit is): that is kvroute-index.

pub mod decode;
pub mod endpoint;
pub mod frames;
pub mod msgpack;
pub mod reasons;
pub mod sequence;
pub mod stats;
pub mod subscribe;

pub use decode::{decode_batch, decode_batch_with, DecodedBatch};
pub use endpoint::{live_endpoint, replay_endpoint, EndpointError, ResolvedEndpoint, SocketMode};
pub use frames::{
    decode_message, decode_message_with, parse_replay_reply, replay_request, split_live,
    FrameError, LiveFrames, ReplayReply, END_SEQ,
};
pub use reasons::{BatchError, BatchErrorReason, Cost, Dialect, DropReason, Dropped, Limits};
pub use sequence::DegradeReason;
pub use stats::{BatchDisposition, RankSnapshot, WireStats, WireStatsSnapshot};
pub use subscribe::{
    payload_digest, spawn_subscription, ChannelSink, EventSink, RankHealth, SinkMessage,
    StreamPosition, SubscriptionConfig, SubscriptionHandle,
};
