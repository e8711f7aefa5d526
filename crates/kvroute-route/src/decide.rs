//! One routing decision as a pure function: a snapshot and a request in, the ranked candidates
//! with their evidence out.
//!
//! Owns: [`decide`] (each candidate's figures from the snapshot through the cost terms, then
//! the ranking) and [`Decision`], the evidence the gateway reports (`x-kvroute-decision`,
//! `/admin/explain`).
//! Invariants: the same (policy, weights, request, snapshot) always give the same decision,
//! byte for byte; every candidate of the snapshot appears once, best first; `predicted_cached`
//! is the index's exact figure (the in-flight forecast only informs the cost); per-group
//! evidence, the time a decision took and a disaggregated request's prefill leg are the
//! caller's to fill in.
//! Must not: read clocks, locks, sockets or the index, or change anything: learners change only
//! through the observations the gateway applies after a placement.

use crate::config::{CostModel, PolicyKind, PolicyWeights, PrefillStall};
use crate::rank::{rank, Candidate};
use crate::snapshot::{Outlook, RequestFacts, Snapshot, WorkerFacts};
use crate::terms::{
    conversation_life_ms, decode_interference_ms, delay_to_others_ms, eviction_ms, expected_output,
    faded, junction_credit, later_turns_ms, load_delay_ms, next_arrivals_ms, prefill_stall_ms,
    tier_load_ms,
};
use crate::work::Work;
use kvroute_index::rules::GroupEvidence;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Decision {
    pub policy: &'static str,
    pub worker: String,
    pub prompt_tokens: usize,
    pub predicted_cached: u64,
    /// The part of `predicted_cached` the chosen worker's CPU tier serves (loaded before the
    /// prefill; the rest is the device hit).
    #[serde(skip_serializing_if = "is_zero")]
    pub predicted_tier: u64,
    /// The chosen worker's predicted time to first token (ms, the gateway's clock).
    pub predicted_ttft_ms: f64,
    /// The most any candidate was predicted to serve from cache (what load or a junction
    /// outweighed when it exceeds `predicted_cached`).
    pub best_cached: u64,
    /// Further requests this one's conversation is expected to bring (the horizon of
    /// `later_turns_ms`).
    pub follow_ups: f64,
    /// Each group of the chosen worker's best rank, alone (when evidence was asked for).
    pub groups: Vec<GroupEvidence>,
    pub candidates: Vec<Candidate>,
    pub decision_us: u64,
    /// Disaggregated serving: the prefill leg's decision (this one is the decode leg's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<Box<Decision>>,
}

/// What the request's conversation and answer bring, the same for every candidate.
struct Horizon {
    /// Further requests of a new conversation (0 for a follow-up or a cache-blind policy).
    follow_ups: f64,
    /// The fleet's turn cycle, where follow-ups are expected.
    cycle: Option<(f64, f64)>,
    /// A conversation's expected remaining life (ms).
    life_ms: f64,
    /// This answer's expected length, and the fleet's mean (tokens).
    output_tokens: f64,
    mean_output: f64,
}

fn horizon(policy: PolicyKind, req: &RequestFacts, snap: &Snapshot) -> Horizon {
    // Where a conversation starts, its later turns follow: a new conversation is priced with
    // the wait each candidate's load will add to them. A follow-up's conversation already
    // lives where its history is cached, so it is ranked by its own TTFT.
    let follow_ups = if policy.uses_cache() && !req.follow_up {
        snap.fleet.follow_ups
    } else {
        0.0
    };
    let cycle = snap.fleet.cycle.filter(|_| follow_ups > 0.0);
    let life_ms = conversation_life_ms(follow_ups, snap.fleet.cycle).unwrap_or(0.0);
    let output_tokens = if policy.uses_cache() {
        expected_output(snap.fleet.output_mean, req.max_tokens)
    } else {
        0.0
    };
    Horizon {
        follow_ups,
        cycle,
        life_ms,
        output_tokens,
        // What the requests running there have left is spread up to the fleet's mean answer.
        mean_output: snap.fleet.output_mean.unwrap_or(output_tokens),
    }
}

/// Ranks the snapshot's candidates for the request under `policy` and `weights`.
pub fn decide(
    policy: PolicyKind,
    weights: &PolicyWeights,
    req: &RequestFacts,
    snap: &Snapshot,
) -> Decision {
    let h = horizon(policy, req, snap);
    // The junction credit is measured against the best any worker will serve (in-flight
    // prompts counted).
    let fleet_best = snap
        .workers
        .iter()
        .filter_map(|w| w.outlook.map(|o| o.forecast))
        .max()
        .unwrap_or(0);
    let mut cands: Vec<Candidate> = snap
        .workers
        .iter()
        .enumerate()
        .map(|(slot, w)| Candidate {
            slot,
            ..candidate(policy, weights, req, &h, w, fleet_best)
        })
        .collect();
    if policy.uses_cache() && weights.next_arrivals {
        price_next_arrivals(&mut cands, snap);
    }
    let ranked = rank(policy, cands, weights, req.rr);
    let first = ranked.first();
    Decision {
        policy: policy.name(),
        worker: first.map(|c| c.worker.to_string()).unwrap_or_default(),
        prompt_tokens: req.tokens as usize,
        predicted_cached: first.map_or(0, |c| c.predicted_cached),
        predicted_tier: first.map_or(0, |c| c.predicted_tier),
        predicted_ttft_ms: first.map_or(0.0, |c| c.predicted_ttft_ms),
        best_cached: ranked.iter().map(|c| c.predicted_cached).max().unwrap_or(0),
        follow_ups: h.follow_ups,
        groups: Vec::new(),
        candidates: ranked,
        decision_us: 0,
        prefill: None,
    }
}

/// One candidate's figures: its prediction and forecast, the TTFT its model predicts, and each
/// cost term ([`crate::terms`]).
fn candidate(
    policy: PolicyKind,
    weights: &PolicyWeights,
    req: &RequestFacts,
    h: &Horizon,
    w: &WorkerFacts,
    fleet_best: u64,
) -> Candidate {
    let n = req.tokens;
    let hybrid = policy == PolicyKind::HybridAware;
    let (cached, tier) = (w.cached, w.tier);
    // The tier's part is loaded, not computed: it costs its transfer before the prefill.
    let tier_load = tier_load_ms(tier, weights.cpu_load_us_per_token);
    let o = w.outlook.filter(|_| hybrid).unwrap_or_default();
    let junction = if hybrid && w.outlook.is_some() {
        junction_credit(o.prefix, o.forecast, fleet_best)
    } else {
        0
    };
    let checkpoints = checkpoints(n, &o);
    let forecast_cached = o.forecast.saturating_sub(cached);
    let expected = n.saturating_sub(cached + forecast_cached);
    let ms_per_token = w.ttft.ms_per_token();
    let work = Work::new(w.queued_tokens, n - expected, expected, w.running);
    let predicted_ttft_ms = w.ttft.ttft_ms(&work) + tier_load;
    let (load_delay, busy_ms) = load_delay_ms(&w.ttft, &work);
    let own_ms = (predicted_ttft_ms - busy_ms).max(0.0);
    // The requests reaching the worker before this one's first token queue behind it.
    let rate = if policy.uses_cache() {
        w.arrivals_per_ms
    } else {
        0.0
    };
    let live = match (h.cycle, w.live) {
        (Some(_), Some(l)) => faded(l.weight, l.age_ms, h.life_ms),
        _ => 0.0,
    };
    // This answer decodes beside the requests running there now; a new conversation's `k`
    // later turns (a follow-up's `k` is 0) beside as many as have recently run there.
    let decode = |running: f64| {
        decode_interference_ms(w.decode_delta_ms, h.output_tokens, h.mean_output, running)
    };
    let decode_interference = decode(w.running as f64) + h.follow_ups * decode(w.mean_running);
    let prefill_stall = prefill_stall(weights.prefill_stall, h, w, (own_ms - tier_load).max(0.0));
    let eviction = if weights.eviction && weights.cost == CostModel::Ttft && policy.uses_cache() {
        eviction_ms(expected as f64, w.eviction_rate, ms_per_token)
    } else {
        0.0
    };
    Candidate {
        worker: w.name.clone(),
        predicted_cached: cached,
        blind_cached: if hybrid { w.blind } else { 0 },
        predicted_tier: tier,
        tier_load_ms: tier_load,
        uncached: n - cached.min(n),
        forecast_cached,
        load: w.queued_tokens as f64 + weights.tokens_per_request * w.running as f64,
        junction,
        predicted_ttft_ms,
        later_turns_ms: later_turns_ms(live, h.follow_ups, h.cycle, w.load_wait_ms),
        delay_to_others_ms: delay_to_others_ms(own_ms, rate, predicted_ttft_ms),
        decode_interference_ms: decode_interference,
        prefill_stall_ms: prefill_stall,
        eviction_ms: eviction,
        next_arrivals_ms: 0.0,
        own_prefill_ms: own_ms,
        live_conversations: live,
        load_delay_ms: load_delay,
        work,
        ms_per_token,
        cost: 0.0,
        checkpoints,
        slot: 0,
    }
}

/// The prefill stall charged under `variant`: each of a new conversation's later turns
/// lengthens, with its prefill's chunks, the steps of the requests running there then; with
/// `all`, so does this request's own prefill (`own_compute_ms`: a tier's load is a transfer
/// beside the steps, not compute in them) those in flight now.
fn prefill_stall(variant: PrefillStall, h: &Horizon, w: &WorkerFacts, own_compute_ms: f64) -> f64 {
    let later_stall = || {
        h.cycle.map_or(0.0, |(_, s)| {
            h.follow_ups * prefill_stall_ms(s, w.mean_running)
        })
    };
    match variant {
        PrefillStall::Off => 0.0,
        PrefillStall::LaterTurns => later_stall(),
        PrefillStall::All => later_stall() + prefill_stall_ms(own_compute_ms, w.running as f64),
    }
}

/// Where the engine will checkpoint a prompt of `n` tokens sent to a worker with outlook `o`:
/// its last aligned position, and its junction where the worker holds a longer full-attention
/// prefix than it serves (none without an outlook).
fn checkpoints(n: u64, o: &Outlook) -> [u64; 2] {
    if o.align == 0 {
        return [0, 0];
    }
    let at_junction = if o.prefix > o.forecast { o.prefix } else { 0 };
    [prompt_checkpoint(n, o.align), at_junction]
}

/// Each candidate's [`next_arrivals_ms`]: the fleet's request rate (every candidate's
/// together) times the share of requests that went where their wait was least, each worker's
/// wait for its load now (`load_delay_ms`), and the work this request adds to its queue there
/// (its own prefill; a tier's load is a transfer beside the steps).
fn price_next_arrivals(cands: &mut [Candidate], snap: &Snapshot) {
    let rate: f64 = snap.workers.iter().map(|w| w.arrivals_per_ms).sum();
    let per_ms = rate * snap.fleet.least_loaded_share;
    let waits: Vec<f64> = cands.iter().map(|c| c.load_delay_ms).collect();
    for (i, c) in cands.iter_mut().enumerate() {
        let own = (c.own_prefill_ms - c.tier_load_ms).max(0.0);
        c.next_arrivals_ms = next_arrivals_ms(&waits, i, own, per_ms);
    }
}

/// The last aligned position strictly inside a prompt of `n` tokens: where vLLM keeps the
/// prompt's final state checkpoint (`get_mamba_prefill_checkpoint_position`).
pub fn prompt_checkpoint(n: u64, align: u64) -> u64 {
    let a = align.max(1);
    n.saturating_sub(1) / a * a
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}
