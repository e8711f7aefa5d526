//! The simulator's error type.
//!
//! Owns: `SimError`, the one error every fallible library call returns.
//! Invariants: messages name the offending value; nothing here panics.
//! Must not: carry transport-specific types beyond their rendered message.

/// Everything that can go wrong in the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A configuration the engine would refuse (layout, flags, preset).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A request the engine would refuse (too long, empty, bad field).
    #[error("invalid request: {0}")]
    Request(String),
    /// A socket could not be bound or used.
    #[error("socket error on {endpoint}: {message}")]
    Socket { endpoint: String, message: String },
    /// The worker was shut down while a request waited.
    #[error("worker stopped")]
    Stopped,
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}
