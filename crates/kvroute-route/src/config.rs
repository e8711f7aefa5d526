//! The routing core's configuration, as plain data: the policy ([`PolicyKind`]), the cost's
//! weights and switches ([`PolicyWeights`], the gateway's `[weights]` section) and the choices
//! among its models ([`CostModel`], [`PrefillStall`]).
//!
//! Owns: the policy names, the weights with their defaults and the flag spellings of the
//! choices.
//! Invariants: every weight has a default, so a partial `[weights]` section (or none) is valid;
//! unknown fields are refused.
//! Must not: check ranges (the gateway's `GatewayConfig::validate` refuses a negative or
//! non-finite λ, μ, per-request load or CPU-tier load cost), import anything of the gateway, or
//! start anything.

use serde::{Deserialize, Serialize};
use std::str::FromStr;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// The index's exact per-group prediction.
    #[default]
    HybridAware,
    /// Only the full-attention groups' prefix (what other routers predict), for A/B runs.
    GroupBlind,
    RoundRobin,
    LeastLoad,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::HybridAware,
        PolicyKind::GroupBlind,
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::HybridAware => "hybrid-aware",
            PolicyKind::GroupBlind => "group-blind",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastLoad => "least-load",
        }
    }

    /// Whether the policy reads the cache index at all.
    pub fn uses_cache(self) -> bool {
        matches!(self, PolicyKind::HybridAware | PolicyKind::GroupBlind)
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown policy {s:?} (hybrid-aware | group-blind | round-robin | least-load)"
                )
            })
    }
}

/// The cache policies' cost: with the default cost model `ttft`, the predicted time to first
/// token plus the switched-on charges less the junction credit ([`crate::terms`]); with
/// `tokens`, `expected_uncached + λ·load − μ·junction`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyWeights {
    /// λ: how many tokens of extra prefill one token of queued load is worth. Below 1 the
    /// router keeps prefixes together until load differences grow large: on the bundled trace
    /// 0.25 gave 1–3 points more reuse than 1 with the same or better TTFT (README).
    #[serde(default = "default_lambda")]
    pub lambda: f64,
    /// Load tokens charged per in-flight request (its decode work).
    #[serde(default = "default_request_tokens")]
    pub tokens_per_request: f64,
    /// μ: credit per full-attention prefix token a worker holds beyond what it will serve and
    /// what the fleet's best worker serves, counting in-flight prompts (routing there makes the engine store a
    /// junction checkpoint that later requests sharing the prefix reuse). Hybrid-aware only.
    /// 0 by default: switched off alone it measured ahead on `tenants` and behind on `agentic`
    /// (docs/routing.md, "The default-on cost terms, A/B").
    #[serde(default)]
    pub junction: f64,
    /// What the cache policies minimise: `ttft` (the predicted time to first token, learned
    /// per worker) or `tokens` (`expected_uncached + λ·load − μ·junction`).
    #[serde(default)]
    pub cost: CostModel,
    /// Cost model `ttft`: add, for each candidate, the wait its load adds to each later request
    /// of the conversation times the follow-ups expected (learned from the traffic,
    /// [`crate::terms::later_turns_ms`]). `false` ranks by this request's TTFT alone.
    #[serde(default = "default_on")]
    pub later_turns: bool,
    /// Cost model `ttft`: add, for each candidate, the wait this request's own prefill there
    /// adds to the requests that will reach the worker before its first token (the fleet's
    /// request rate at the worker's share, [`crate::terms::delay_to_others_ms`]). `false` leaves other
    /// requests' waits out. Off by default: ahead on `shared-prefix`, behind on `tenants`
    /// (docs/routing.md, "The default-on cost terms, A/B").
    #[serde(default)]
    pub delay_to_others: bool,
    /// Cost model `ttft`: add, for each candidate, the end-to-end latency this request's
    /// decode adds to the requests running there and theirs to it (`2·δ·running·overlap`,
    /// [`crate::terms::decode_interference_ms`]). `false` leaves decoding out. Off by default:
    /// ahead on `agentic`'s TTFT and ITL, behind on `shared-prefix`'s reuse at three replicas
    /// (docs/routing.md, "The default-on cost terms, A/B").
    #[serde(default)]
    pub decode_interference: bool,
    /// Cost model `ttft`: which prefills are charged the end-to-end latency they add to the
    /// requests decoding beside them, whose steps carry their chunks
    /// ([`crate::terms::prefill_stall_ms`]): a new conversation's later turns
    /// (`later-turns`, the default), also every request's own (`all`), or none (`off`).
    #[serde(default)]
    pub prefill_stall: PrefillStall,
    /// Cost model `ttft`: add, for each candidate, the prefill later requests will spend on
    /// what this request's uncached tokens push out of the worker's pool: those tokens times
    /// the worker's re-prefill rate (learned from its events, [`crate::terms::eviction_ms`]) at its
    /// prefill cost. Off by default: on the eviction-heavy matrix cells it measured even to
    /// worse (docs/routing-analyses.md, "The eviction charge").
    #[serde(default)]
    pub eviction: bool,
    /// Cost model `ttft`: add, for each candidate, the wait a placement there adds to the
    /// requests reaching the fleet while its least-loaded worker drains, each going where it
    /// waits least ([`crate::terms::next_arrivals_ms`]): a long prompt pays for taking the
    /// last idle worker from the short ones behind it. Off by default
    /// (docs/routing-analyses.md, "The next arrivals' wait").
    #[serde(default)]
    pub next_arrivals: bool,
    /// The prefill queued on a worker is its bookings less what the engine has worked off
    /// since, at the worker's learned prefill rate (the gateway's `Worker::queued_tokens`).
    /// `false` counts every booking whole until its first byte. On by default, with the
    /// in-flight forecast: the two together measured ahead on `multi-turn` and even on
    /// `tenants` (docs/routing.md, "The default-on cost terms, A/B").
    #[serde(default = "default_on")]
    pub queue_drain: bool,
    /// Hybrid-aware: count what a candidate will hold once the prompts in flight there are
    /// stored (the gateway's in-flight forecast; with peers, the other replicas' prompts too).
    /// `false` ranks by what the index holds now. On by default, with the queue drain (above).
    #[serde(default = "default_on", skip_serializing_if = "is_true")]
    pub in_flight_forecast: bool,
    /// Cost model `ttft`: the time to load one token's KV from a worker's CPU tier (µs; the
    /// `OffloadingConnector`'s hit, `medium = "CPU"`), added to its predicted TTFT. The
    /// default, 5, is an 8B-class model's 128 KiB a token over PCIe 4.0 ×16 (about 25 GB/s):
    /// set the model's KV bytes per token over the host link's bandwidth.
    #[serde(default = "default_cpu_load_us_per_token")]
    pub cpu_load_us_per_token: f64,
}

fn default_cpu_load_us_per_token() -> f64 {
    5.0
}

fn default_on() -> bool {
    true
}
/// Whether a switch is at its default, on (left out of the serialized weights: the decision
/// logs recorded before the switch existed read back identically).
fn is_true(b: &bool) -> bool {
    *b
}

/// Which prefills the `ttft` cost charges for stalling the requests decoding beside them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefillStall {
    Off,
    /// A new conversation's expected later turns, each beside the requests recently running.
    #[default]
    LaterTurns,
    /// Those, and this request's own prefill beside the requests in flight now.
    All,
}

impl FromStr for PrefillStall {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(PrefillStall::Off),
            "later-turns" => Ok(PrefillStall::LaterTurns),
            "all" => Ok(PrefillStall::All),
            _ => Err(format!(
                "unknown prefill stall {s:?} (off | later-turns | all)"
            )),
        }
    }
}

/// The cache policies' cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CostModel {
    #[default]
    Ttft,
    Tokens,
}

impl FromStr for CostModel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ttft" => Ok(CostModel::Ttft),
            "tokens" => Ok(CostModel::Tokens),
            _ => Err(format!("unknown cost model {s:?} (ttft | tokens)")),
        }
    }
}

fn default_lambda() -> f64 {
    0.25
}
fn default_request_tokens() -> f64 {
    64.0
}

impl Default for PolicyWeights {
    fn default() -> Self {
        PolicyWeights {
            lambda: default_lambda(),
            tokens_per_request: default_request_tokens(),
            junction: 0.0,
            cost: CostModel::default(),
            later_turns: default_on(),
            delay_to_others: false,
            decode_interference: false,
            prefill_stall: PrefillStall::default(),
            eviction: false,
            next_arrivals: false,
            queue_drain: default_on(),
            in_flight_forecast: default_on(),
            cpu_load_us_per_token: default_cpu_load_us_per_token(),
        }
    }
}
