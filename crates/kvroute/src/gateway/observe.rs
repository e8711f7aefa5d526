//! The observations the learners change through: a placement, a first byte's timing, an
//! answer's length and decoding. Each is applied here the same way whether this replica made
//! it or a peer announced it (`[peers] learning`), so replicas that share what they learn
//! hold learners fed by the whole fleet's traffic.
//!
//! Owns: applying a [`Learned`] to the registry's learners ([`placed`], [`ttft`],
//! [`answered`], [`from_peer`]) and the checks a peer's observation passes first.
//! Invariants: a learner changes only here (and in `prepare`'s eviction refresh, fed by the
//! index); a peer's observation is applied exactly as a local one, plus what the sender had
//! already recorded at home (its prompt, counted by the follow-up tracker); one malformed
//! observation, or one naming a worker this replica does not know, is refused whole and
//! changes nothing.
//! Must not: decide anything, read the index, send anything (announcing is the caller's,
//! through `peer_wire::Outbox`).

use super::peer_wire::{DecodeSample, Learned, Placed};
use super::registry::{Registry, Worker};
use kvroute_route::terms::conversation_life_ms;
use kvroute_route::{Candidate, Work};
use std::time::{Duration, Instant};

/// A longest plausible time (ms) in an observation: a day.
const MAX_MS: f64 = 86_400_000.0;
/// The most output tokens one answer may claim.
const MAX_TOKENS: u64 = 1 << 24;

/// The placement's records of a request sent to `chosen`, the first of `ranked`: its
/// prompt's mark and follow-up gap (from the tracker), whether it moved off its history, its
/// own prefill there and, while the next arrivals' charge is on, the load waits.
pub fn placement(
    chosen: &Worker,
    ranked: &[Candidate],
    follow_up: (Option<Duration>, Option<super::sessions::Mark>),
    moved: bool,
    next_arrivals: bool,
) -> Option<Placed> {
    let cand = ranked.first()?;
    let (gap, prompt) = follow_up;
    let load_waits = next_arrivals.then(|| {
        let least = ranked
            .iter()
            .map(|c| c.load_delay_ms)
            .fold(f64::INFINITY, f64::min);
        (cand.load_delay_ms, least)
    });
    Some(Placed {
        worker: chosen.spec.name.clone(),
        prompt,
        gap_ms: gap.map(|g| g.as_secs_f64() * 1000.0),
        moved,
        own_prefill_ms: cand.own_prefill_ms,
        load_waits,
    })
}

/// Records where a request went: the chosen worker's request rate; for the conversation
/// charge, a follow-up teaches the turn cycle (its gap) and its prefill there; a new
/// conversation, or a follow-up moved off the worker holding its history, lives on the chosen
/// worker from `now`; with the next arrivals' charge on, whether it went where its wait was
/// least.
pub fn placed(registry: &Registry, chosen: &Worker, p: &Placed, now: Instant) {
    registry.count_placement();
    chosen.learners.lock().arrivals.observe(now);
    if let Some(gap_ms) = p.gap_ms {
        registry
            .turns
            .observe_gap(Duration::from_secs_f64(gap_ms / 1000.0));
        registry.turns.observe_prefill(p.own_prefill_ms);
    }
    if p.gap_ms.is_none() || p.moved {
        let k = registry.follow_ups.expected();
        if let Some(life_ms) = conversation_life_ms(k, registry.turns.cycle()) {
            chosen.learners.lock().live.add(now, life_ms);
        }
    }
    if let Some((chosen_ms, least_ms)) = p.load_waits {
        registry.least_loaded.observe(chosen_ms, least_ms);
    }
}

/// Feeds a TTFT observed on `worker` for `work` to its model and the fleet's.
pub fn ttft(registry: &Registry, worker: &Worker, work: &Work, ms: f64) {
    worker.learners.lock().ttft.observe(work, ms);
    registry.fleet_ttft.observe(work, ms);
}

/// Feeds an answer's length to the fleet's mean and its decoding, if measured, to the
/// worker's and the fleet's decode models.
pub fn answered(registry: &Registry, worker: &Worker, tokens: u64, decode: Option<DecodeSample>) {
    registry.output_tokens.observe(tokens);
    if let Some(d) = decode {
        worker
            .learners
            .lock()
            .decode
            .observe(d.prefill, d.running, d.itl_ms);
        registry
            .fleet_decode
            .observe(d.prefill, d.running, d.itl_ms);
    }
}

/// Applies what a peer learned, as received at `now`; the reason it was refused otherwise
/// (a metric label).
pub fn from_peer(registry: &Registry, l: Learned, now: Instant) -> Result<(), &'static str> {
    if !plausible(&l) {
        return Err("malformed");
    }
    match l {
        Learned::Placed(p) => {
            let w = registry.get(&p.worker).ok_or("unknown_worker")?;
            // The sender's tracker counted and remembered its prompt: so does this one's.
            registry
                .follow_ups
                .remember(p.prompt, p.gap_ms.is_some(), now);
            registry.count_peer_placement();
            placed(registry, &w, &p, now);
        }
        Learned::Ttft { worker, work, ms } => {
            let w = registry.get(&worker).ok_or("unknown_worker")?;
            ttft(registry, &w, &work, ms);
        }
        Learned::Answered {
            worker,
            tokens,
            decode,
        } => {
            let w = registry.get(&worker).ok_or("unknown_worker")?;
            answered(registry, &w, tokens, decode);
        }
    }
    Ok(())
}

/// Whether every figure of a peer's observation is one a replica could have measured.
fn plausible(l: &Learned) -> bool {
    let ms = |x: f64| x.is_finite() && (0.0..=MAX_MS).contains(&x);
    match l {
        Learned::Placed(p) => {
            ms(p.own_prefill_ms)
                && p.gap_ms.is_none_or(ms)
                && p.load_waits.is_none_or(|(a, b)| ms(a) && ms(b))
        }
        Learned::Ttft { work, ms: t, .. } => ms(*t) && work.pairs.is_finite() && work.pairs >= 0.0,
        Learned::Answered { tokens, decode, .. } => {
            *tokens <= MAX_TOKENS
                && decode.is_none_or(|d| {
                    ms(d.itl_ms)
                        && d.prefill.is_finite()
                        && d.prefill >= 0.0
                        && d.running.is_finite()
                        && d.running >= 0.0
                })
        }
    }
}

#[cfg(test)]
mod tests;
