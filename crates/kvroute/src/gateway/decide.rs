//! One routing decision: candidates, predictions, ranking, and the evidence to show for it.
//!
//! Owns: turning (request tokens, salt, model) into a ranked candidate list under the
//! configured policy, from the index's routing prediction (the ranks that hit; a worker not
//! listed hits 0) and the registry's load figures; feeding each candidate's eviction model
//! the index's eviction figures when its refresh is due; and the `x-kvroute-decision` evidence.
//! Invariants: only routable workers serving the model are candidates; a worker's prediction
//! is the best of its DP ranks (the engine's own balancer picks the rank).
//! Must not: send anything upstream.

use super::arrivals::{delay_to_others_ms, next_arrivals_ms};
use super::config::{CostModel, PolicyWeights, PrefillStall};
use super::conversations::conversation_cost_ms;
use super::decoding::{decode_interference_ms, prefill_stall_ms};
use super::eviction::eviction_ms;
use super::pending::{prompt_checkpoint, Forecast, Prompt};
use super::policy::{junction_credit, rank, Candidate, PolicyKind};
use super::registry::{Registry, Worker};
use super::ttft::Work;
use kvroute_index::rules::GroupEvidence;
use kvroute_index::{BlockExtras, Params, Query};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

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

/// A worker's best DP rank as the index predicts it.
#[derive(Clone, Copy)]
struct Best {
    /// Predicted cached tokens under the policy's view.
    cached: u64,
    /// The part of `cached` an offload tier serves.
    tier: u64,
    rank: u32,
    /// The full-attention prefix (what group-blind predicts), at most `n − 1`.
    blind: u64,
    params: Option<Params>,
}

/// A hybrid-aware candidate's outlook with its in-flight prompts counted.
#[derive(Clone, Copy, Default)]
struct Outlook {
    /// Cached tokens once the in-flight prompts are stored (at least the index's figure).
    forecast: u64,
    /// Full-attention prefix, likewise.
    prefix: u64,
    align: u64,
    junction: u64,
}

pub struct Ranked<'a> {
    pub order: Vec<Arc<Worker>>,
    /// The request as recorded in flight on the chosen worker (hybrid-aware only).
    pub prompt: Option<Prompt<'a>>,
    pub decision: Decision,
}

pub fn candidates_for(registry: &Registry, model: &str) -> Vec<Arc<Worker>> {
    registry
        .all()
        .into_iter()
        .filter(|w| w.serves(model) && w.routable())
        .collect()
}

/// Ranks `workers` for a base-model request (no LoRA adapter): `decide_with` its salt, and
/// whether it extends an earlier prompt as the follow-up tracker holds it (without recording it).
#[allow(clippy::too_many_arguments)]
pub fn decide<'a>(
    registry: &Registry,
    workers: &[Arc<Worker>],
    tokens: &'a [u32],
    salt: Option<String>,
    skip_prefix_cache: bool,
    policy: PolicyKind,
    weights: &PolicyWeights,
    rr: u64,
    evidence: bool,
) -> Ranked<'a> {
    let extras = BlockExtras {
        cache_salt: salt,
        lora: None,
    };
    let follow_up = registry.follow_ups.extends_earlier(tokens);
    decide_with(
        registry,
        workers,
        tokens,
        extras,
        skip_prefix_cache,
        follow_up,
        None,
        policy,
        weights,
        rr,
        evidence,
    )
}

/// Ranks `workers` for a request hashed with `extras` (its salt and LoRA adapter key);
/// `follow_up`: whether it extends an earlier prompt (the caller asked the follow-up tracker,
/// [`super::sessions::FollowUps`]); `max_tokens`: the request's cap on its answer. The request is hashed once; per-group evidence is computed
/// (for the chosen worker only) when `evidence` is set.
#[allow(clippy::too_many_arguments)]
pub fn decide_with<'a>(
    registry: &Registry,
    workers: &[Arc<Worker>],
    tokens: &'a [u32],
    extras: BlockExtras,
    skip_prefix_cache: bool,
    follow_up: bool,
    max_tokens: Option<u64>,
    policy: PolicyKind,
    weights: &PolicyWeights,
    rr: u64,
    evidence: bool,
) -> Ranked<'a> {
    let start = std::time::Instant::now();
    let q = Query {
        tokens: tokens.to_vec(),
        extras,
        skip_prefix_cache,
    };
    let n = tokens.len() as u64;
    let mut best: HashMap<&str, Best> = HashMap::new();
    let by_id: HashMap<&str, &str> = workers
        .iter()
        .map(|w| (&*w.id, w.spec.name.as_str()))
        .collect();
    let hybrid = policy == PolicyKind::HybridAware;
    if policy.uses_cache() {
        // Only the ranks that hit are listed (the rest predict 0): one walk of the request
        // through the index's shared store, not one visit per rank.
        for p in registry.index.predict_hits(&q) {
            let blind = p.group_blind.min(n.saturating_sub(1));
            let blind_view = policy == PolicyKind::GroupBlind;
            let row = Best {
                cached: if blind_view { blind } else { p.cached },
                tier: if blind_view { 0 } else { p.tier },
                rank: p.dp_rank,
                blind,
                params: p.params,
            };
            if let Some(name) = by_id.get(&*p.worker) {
                let e = best.entry(name).or_insert(row);
                if (row.cached, row.blind) > (e.cached, e.blind) {
                    *e = row;
                }
            }
        }
    }
    // Hybrid-aware: what each worker will hold once its in-flight prompts are stored, and the
    // junction credit on top of the best the fleet can serve (now or once those are stored).
    let mut outlooks: HashMap<&str, Outlook> = HashMap::new();
    let prompt = hybrid.then(|| Prompt::new(tokens, &q.extras));
    if prompt.is_some() {
        // A worker that hits nothing still needs its lookup parameters: for the checkpoints
        // this request would leave there, and for the forecast of a sibling it may be
        // prefilling.
        for w in workers {
            let name = w.spec.name.as_str();
            if best.contains_key(name) {
                continue;
            }
            if let Some((rank, params)) = registry.index.params_of(&w.id) {
                let row = Best {
                    cached: 0,
                    tier: 0,
                    rank,
                    blind: 0,
                    params: Some(params),
                };
                best.insert(name, row);
            }
        }
    }
    if let Some(prompt) = &prompt {
        for w in workers {
            let name = w.spec.name.as_str();
            let Some(b) = best.get(name) else { continue };
            let Some(params) = b.params else { continue };
            let align = u64::from(params.align).max(1);
            // A request that skips the prefix cache reuses nothing, whatever is in flight.
            let mut f = if skip_prefix_cache {
                Forecast::default()
            } else {
                w.pending.forecast(prompt, align, params.unitary)
            };
            if params.eagle && f.cached > 0 {
                // The engine drops part of a hit to re-verify it; the forecast drops one
                // alignment unit (the index drops `min(align, block)` and re-aligns).
                f.cached = (f.cached - align) / align * align;
            }
            outlooks.insert(
                name,
                Outlook {
                    forecast: f.cached.max(b.cached),
                    prefix: f.prefix.max(b.blind),
                    align,
                    junction: 0,
                },
            );
        }
        let fleet_best = outlooks.values().map(|o| o.forecast).max().unwrap_or(0);
        for o in outlooks.values_mut() {
            o.junction = junction_credit(o.prefix, o.forecast, fleet_best);
        }
    }
    // Where a conversation starts, its later turns follow: a new conversation is priced with
    // the wait each candidate's load will add to them. A follow-up's conversation already
    // lives where its history is cached; moving it would re-prefill and re-store that history
    // (what that pushes out is the eviction charge's, off by default; the history left behind
    // is not priced),
    // so it is ranked by its own TTFT.
    let follow_ups = if policy.uses_cache() && !follow_up {
        registry.follow_ups.expected()
    } else {
        0.0
    };
    // A new conversation's later turns meet the conversations living on each worker, and
    // theirs meet it (`conversations.rs`).
    let now = std::time::Instant::now();
    let cycle = registry.turns.cycle().filter(|_| follow_ups > 0.0);
    let life_ms = cycle.map_or(0.0, |(gap, _)| follow_ups * gap);
    // Its decode shares every step with the requests running where it goes.
    let output_tokens = if policy.uses_cache() {
        registry.output_tokens.expected(max_tokens)
    } else {
        0.0
    };
    // What the requests running there have left is spread up to the fleet's mean answer.
    let mean_output = registry.output_tokens.mean().unwrap_or(output_tokens);
    let mut cands: Vec<Candidate> = workers
        .iter()
        .map(|w| {
            let name = w.spec.name.as_str();
            let b = best.get(name);
            let cached = b.map_or(0, |b| b.cached);
            let tier = b.map_or(0, |b| b.tier);
            // The tier's part is loaded, not computed: it costs its transfer before the prefill.
            let tier_load_ms = tier as f64 * weights.cpu_load_us_per_token / 1000.0;
            let o = outlooks.get(name).copied().unwrap_or_default();
            let checkpoints = if o.align > 0 {
                let junction = if o.prefix > o.forecast { o.prefix } else { 0 };
                [prompt_checkpoint(n, o.align), junction]
            } else {
                [0, 0]
            };
            let forecast_cached = o.forecast.saturating_sub(cached);
            let expected = n.saturating_sub(cached + forecast_cached);
            // The queue ahead drains at the rate the prediction uses (before it is read).
            let model = w.ttft.model(&registry.fleet_ttft);
            let ms_per_token = model.ms_per_token();
            w.set_prefill_ms_per_token(if weights.queue_drain {
                ms_per_token
            } else {
                0.0
            });
            let work = Work::new(w.queued_tokens(), n - expected, expected, w.running());
            let device_ttft_ms = model.predict(&work.features());
            let predicted_ttft_ms = device_ttft_ms + tier_load_ms;
            let (load_delay_ms, busy_ms) = load_delay_ms(registry, w, &work);
            let own_ms = (predicted_ttft_ms - busy_ms).max(0.0);
            // The requests reaching the worker before this one's first token queue behind it.
            let rate = if policy.uses_cache() {
                w.arrivals.per_ms(now)
            } else {
                0.0
            };
            let delay_to_others_ms = delay_to_others_ms(own_ms, rate, predicted_ttft_ms);
            // Later turns meet the load the worker has been showing (not the queue of this
            // instant, which will have drained by then) or, if larger, the turns of the
            // conversations living there; and theirs wait for this conversation's.
            let live = if cycle.is_some() {
                w.live.count(now, life_ms)
            } else {
                0.0
            };
            let (conversation_ms, own_turns_ms) = cycle.map_or((0.0, 0.0), |(gap, s)| {
                conversation_cost_ms(live, follow_ups, gap, s)
            });
            let later_turns_ms = conversation_ms - own_turns_ms
                + (follow_ups * w.ttft.load_wait_ms()).max(own_turns_ms);
            // This answer decodes beside the requests running there now; a new conversation's
            // `k` later turns (a follow-up's `k` is 0) beside as many as have recently run there.
            let delta = w.decode.delta(&registry.fleet_decode);
            let decode_interference_ms =
                decode_interference_ms(delta, output_tokens, mean_output, w.running() as f64)
                    + follow_ups
                        * decode_interference_ms(
                            delta,
                            output_tokens,
                            mean_output,
                            w.decode.mean_running(),
                        );
            // Each of a new conversation's later turns lengthens, with its prefill's chunks,
            // the steps of the requests running there then; with `all`, so does this
            // request's own prefill those in flight now (those queued ahead of it are decoding
            // by the time its chunks run; a tier's load is a transfer beside the steps, not
            // compute in them).
            let later_stall_ms = || {
                cycle.map_or(0.0, |(_, s)| {
                    follow_ups * prefill_stall_ms(s, w.decode.mean_running())
                })
            };
            let prefill_stall_ms = match weights.prefill_stall {
                PrefillStall::Off => 0.0,
                PrefillStall::LaterTurns => later_stall_ms(),
                PrefillStall::All => {
                    later_stall_ms()
                        + prefill_stall_ms((own_ms - tier_load_ms).max(0.0), w.running() as f64)
                }
            };
            // With the eviction charge on (the index then keeps the figures), the worker's
            // re-prefill rate is learned under every cache policy; what this request's
            // uncached tokens push out of a full pool at that rate is charged under the ttft
            // cost.
            if weights.eviction && policy.uses_cache() && w.eviction.claim(now) {
                let requests = w.bookings_total.load(std::sync::atomic::Ordering::Relaxed);
                w.eviction
                    .observe(now, registry.index.eviction_stats(&w.id), requests);
            }
            let eviction_ms =
                if weights.eviction && weights.cost == CostModel::Ttft && policy.uses_cache() {
                    eviction_ms(expected as f64, w.eviction.rate(), ms_per_token)
                } else {
                    0.0
                };
            Candidate {
                worker: w.spec.name.clone(),
                predicted_cached: cached,
                blind_cached: if hybrid { b.map_or(0, |b| b.blind) } else { 0 },
                predicted_tier: tier,
                tier_load_ms,
                uncached: n - cached.min(n),
                forecast_cached,
                load: w.load_tokens(weights.tokens_per_request),
                junction: o.junction,
                predicted_ttft_ms,
                later_turns_ms,
                delay_to_others_ms,
                decode_interference_ms,
                prefill_stall_ms,
                eviction_ms,
                next_arrivals_ms: 0.0,
                own_prefill_ms: own_ms,
                live_conversations: live,
                load_delay_ms,
                work,
                ms_per_token,
                cost: 0.0,
                checkpoints,
            }
        })
        .collect();
    if policy.uses_cache() && weights.next_arrivals {
        price_next_arrivals(&mut cands, registry, workers, now);
    }
    let ranked = rank(policy, cands, weights, rr);
    let order: Vec<Arc<Worker>> = ranked
        .iter()
        .filter_map(|c| workers.iter().find(|w| w.spec.name == c.worker).cloned())
        .collect();
    let decision_us = start.elapsed().as_micros() as u64;
    let first = ranked.first().cloned();
    let groups = match (&first, evidence && policy.uses_cache()) {
        (Some(c), true) => order
            .first()
            .map(|w| {
                let rank = best.get(c.worker.as_str()).map_or(0, |b| b.rank);
                registry.index.predict(&w.id, rank, &q).groups
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    Ranked {
        order,
        prompt,
        decision: Decision {
            policy: policy.name(),
            worker: first.as_ref().map(|c| c.worker.clone()).unwrap_or_default(),
            prompt_tokens: tokens.len(),
            predicted_cached: first.as_ref().map_or(0, |c| c.predicted_cached),
            predicted_tier: first.as_ref().map_or(0, |c| c.predicted_tier),
            predicted_ttft_ms: first.as_ref().map_or(0.0, |c| c.predicted_ttft_ms),
            best_cached: ranked.iter().map(|c| c.predicted_cached).max().unwrap_or(0),
            follow_ups,
            groups,
            candidates: ranked,
            decision_us,
            prefill: None,
        },
    }
}

/// Records where a request went: the chosen worker's request rate; for the conversation charge,
/// a follow-up teaches the turn cycle (`gap`, the time since its previous turn) and its prefill
/// there; a new conversation, or a follow-up moved off the worker holding its history
/// (`moved`), lives on the chosen worker from now.
pub fn record_placement(
    registry: &Registry,
    chosen: &Worker,
    cand: &Candidate,
    gap: Option<std::time::Duration>,
    moved: bool,
) {
    chosen.arrivals.observe(std::time::Instant::now());
    if let Some(gap) = gap {
        registry.turns.observe_gap(gap);
        registry.turns.observe_prefill(cand.own_prefill_ms);
    }
    if gap.is_none() || moved {
        let k = registry.follow_ups.expected();
        if let Some((cycle, _)) = registry.turns.cycle().filter(|_| k > 0.0) {
            chosen.live.add(std::time::Instant::now(), k * cycle);
        }
    }
}

/// Records, for the next arrivals' charge, whether a request went where its wait was least:
/// the chosen candidate (`ranked`'s first) had no candidate's load wait below its own. Called
/// only while the charge is on, so a request pays for no bookkeeping nobody reads.
pub fn record_least_loaded(registry: &Registry, ranked: &[Candidate]) {
    let Some(chosen) = ranked.first() else {
        return;
    };
    let least = ranked
        .iter()
        .map(|c| c.load_delay_ms)
        .fold(f64::INFINITY, f64::min);
    registry.least_loaded.observe(chosen.load_delay_ms, least);
}

/// The wait a worker's load adds to a request sent there now: its model's prediction for a
/// request with no prefill of its own, less the same on an idle worker; and that prediction
/// itself (the TTFT less this request's own prefill).
fn load_delay_ms(registry: &Registry, w: &Worker, work: &Work) -> (f64, f64) {
    let loaded = Work {
        own_tokens: 0,
        pairs: 0.0,
        ..*work
    };
    let (busy, _) = w.ttft.predict(&registry.fleet_ttft, &loaded);
    let (idle, _) = w.ttft.predict(&registry.fleet_ttft, &Work::default());
    ((busy - idle).max(0.0), busy)
}

/// Each candidate's [`next_arrivals_ms`]: the fleet's request rate (every worker's together)
/// times the share of requests that went where their wait was least, each worker's wait for
/// its load now (`load_delay_ms`), and the work this request adds to its queue there (its own
/// prefill; a tier's load is a transfer beside the steps).
fn price_next_arrivals(
    cands: &mut [Candidate],
    registry: &Registry,
    workers: &[Arc<Worker>],
    now: std::time::Instant,
) {
    let rate: f64 = workers.iter().map(|w| w.arrivals.per_ms(now)).sum();
    let per_ms = rate * registry.least_loaded.share();
    let waits: Vec<f64> = cands.iter().map(|c| c.load_delay_ms).collect();
    for (i, c) in cands.iter_mut().enumerate() {
        let own = (c.own_prefill_ms - c.tier_load_ms).max(0.0);
        c.next_arrivals_ms = next_arrivals_ms(&waits, i, own, per_ms);
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[cfg(test)]
mod tests;
