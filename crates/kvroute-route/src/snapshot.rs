//! What the routing core decides from: a snapshot of the fleet and the candidates, and the
//! request's routing facts, as plain data.
//!
//! Owns: [`Snapshot`] (the fleet's learned figures and one [`WorkerFacts`] per candidate) and
//! [`RequestFacts`].
//! Invariants: every figure is what the gateway's state held at one decision — time comes in
//! already applied (rates, ages, drained queues), so the same snapshot always gives the same
//! decision; a snapshot serializes and deserializes losslessly (the decision log replays it).
//! Must not: hold references to live state, locks or clocks.

use crate::work::Fit;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The fleet's figures and its candidates, as the gateway's state held them at one decision.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub fleet: FleetFacts,
    /// The candidates, in the order the gateway listed them.
    pub workers: Vec<WorkerFacts>,
}

/// What the gateway has learned about the whole fleet's traffic.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetFacts {
    /// Further requests a conversation is expected to bring (the follow-up tracker's estimate).
    pub follow_ups: f64,
    /// The turn cycle `G` and a follow-up's prefill `S` (ms), once both were seen.
    pub cycle: Option<(f64, f64)>,
    /// The fleet's mean answer length (tokens), once an answer was seen.
    pub output_mean: Option<f64>,
    /// The share of requests that went where their wait was least (1 until learned).
    pub least_loaded_share: f64,
}

/// One candidate worker's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerFacts {
    /// The worker's name (shared with the gateway's record of it: no copy per decision).
    pub name: Arc<str>,
    /// The index's prediction for the worker's best DP rank, under the policy's view.
    pub cached: u64,
    /// The part of `cached` an offload tier serves.
    pub tier: u64,
    /// The full-attention prefix on that rank (what group-blind predicts), at most `n − 1`.
    pub blind: u64,
    /// Hybrid-aware: the outlook once the prompts in flight on the worker are stored (absent
    /// where the worker's lookup parameters are not known yet).
    pub outlook: Option<Outlook>,
    /// Prefill tokens queued there (drained at the learned rate, other senders' included).
    pub queued_tokens: u64,
    /// Requests running or waiting there.
    pub running: u64,
    /// The TTFT model's coefficients for the worker (its own once learned, else the fleet's).
    pub ttft: Fit,
    /// Requests per millisecond routed there lately.
    pub arrivals_per_ms: f64,
    /// The conversations started or moved there, not yet faded.
    pub live: Option<LiveFacts>,
    /// The wait the worker's load recently added to requests sent there (ms).
    pub load_wait_ms: f64,
    /// δ: milliseconds one more running request adds to each decoded token there.
    pub decode_delta_ms: f64,
    /// The requests recently running there.
    pub mean_running: f64,
    /// The worker's re-prefill rate (0 unless the eviction charge is on).
    pub eviction_rate: f64,
}

/// A hybrid-aware candidate's outlook with its in-flight prompts counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Outlook {
    /// Cached tokens once the in-flight prompts are stored (at least the index's figure).
    pub forecast: u64,
    /// The full-attention prefix, likewise.
    pub prefix: u64,
    /// The worker's alignment (tokens), at least 1.
    pub align: u64,
}

/// A worker's live conversations: `weight` of them as of `age_ms` ago.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveFacts {
    pub weight: f64,
    pub age_ms: f64,
}

/// The routing facts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestFacts {
    /// Prompt tokens.
    pub tokens: u64,
    /// It extends an earlier prompt (a conversation's later turn).
    pub follow_up: bool,
    /// Its cap on the answer's length.
    pub max_tokens: Option<u64>,
    /// The request counter: candidates equal in cost and load take turns by it.
    pub rr: u64,
}
