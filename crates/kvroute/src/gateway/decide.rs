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
            let cached = best.get(name).map_or(0, |b| b.cached);
            let tier = best.get(name).map_or(0, |b| b.tier);
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

/// Records where a request went, for the conversation charge: a follow-up teaches the turn
/// cycle (`gap`, the time since its previous turn) and its prefill there; a new conversation,
/// or a follow-up moved off the worker holding its history (`moved`), lives on the chosen
/// worker from now.
pub fn record_placement(
    registry: &Registry,
    chosen: &Worker,
    cand: &Candidate,
    gap: Option<std::time::Duration>,
    moved: bool,
) {
    chosen.arrivals.observe(std::time::Instant::now());
    registry.cold.observe(
        cand.expected_uncached(),
        cand.predicted_cached + cand.uncached,
    );
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
/// times the share of prompt work placed uncached (the requests that go where the wait is
/// least), each worker's wait for its load now (`load_delay_ms`), and the work this request
/// adds to its queue there (its own prefill; a tier's load is a transfer beside the steps).
fn price_next_arrivals(
    cands: &mut [Candidate],
    registry: &Registry,
    workers: &[Arc<Worker>],
    now: std::time::Instant,
) {
    let rate: f64 = workers.iter().map(|w| w.arrivals.per_ms(now)).sum();
    let per_ms = rate * registry.cold.share();
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
mod tests {
    use super::*;
    use crate::gateway::config::WorkerSpec;
    use crate::gateway::registry::LoadGuard;
    use kvroute_index::event::{CacheKind, Event, Stored};
    use kvroute_index::hash::{HashAlgo, DEFAULT_SEED};
    use kvroute_index::index::block_hashes;
    use kvroute_index::Index;

    fn store(registry: &Registry, worker: &str, tokens: &[u32]) {
        store_group(
            registry,
            worker,
            0,
            CacheKind::FullAttention,
            tokens,
            |_| true,
        );
    }

    /// Stores the full blocks of `tokens` in one group, those whose index `keep` accepts.
    fn store_group(
        registry: &Registry,
        worker: &str,
        group: u32,
        kind: CacheKind,
        tokens: &[u32],
        keep: impl Fn(usize) -> bool,
    ) {
        let hashes: Vec<u64> = block_hashes(
            HashAlgo::Sha256,
            DEFAULT_SEED,
            16,
            tokens,
            &BlockExtras::default(),
        )
        .iter()
        .filter(|(i, _, _)| keep(*i))
        .map(|(_, h, _)| *h)
        .collect();
        registry.index.apply(&Event::Stored(Stored::device(
            worker, group, kind, None, 16, &hashes,
        )));
    }

    fn fleet(names: &[&str]) -> (Registry, Vec<Arc<Worker>>) {
        let registry = Registry::new(Arc::new(Index::new()));
        let mut workers = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let mut spec = WorkerSpec::new(name, &format!("http://127.0.0.1:{}", i + 1), "m");
            spec.hash_algo = "sha256".into();
            workers.push(registry.add(spec).expect("valid spec"));
        }
        (registry, workers)
    }

    /// Teaches the registry conversations of `turns` turns, one turn every `gap_ms`, each
    /// follow-up costing `prefill_ms` of prefill.
    fn teach_conversations(registry: &Registry, turns: u32, gap_ms: u64, prefill_ms: f64) {
        let t0 = std::time::Instant::now();
        for c in 0..400u32 {
            let mut p: Vec<u32> = (0..32).map(|i| 100_000 + c * 64 + i).collect();
            for turn in 0..turns {
                registry.follow_ups.observe(&p, t0);
                p.extend((0..16).map(|i| 900_000 + c * 64 + turn * 16 + i));
            }
        }
        for _ in 0..50 {
            registry
                .turns
                .observe_gap(std::time::Duration::from_millis(gap_ms));
            registry.turns.observe_prefill(prefill_ms);
        }
    }

    #[test]
    fn a_worker_re_prefilling_what_it_evicted_is_charged_for_what_a_placement_pushes_out() {
        use kvroute_index::event::Removed;
        let (registry, workers) = fleet(&["a", "b"]);
        registry.index.set_eviction_tracking(true);
        // Neither holds the prompt. Since "a"'s figures were last read, it stored 100 blocks,
        // evicted them and stored them all again (1,600 of 3,200 tokens re-prefilled) over 16
        // requests: half, counted half, a rate of a quarter.
        let before = std::time::Instant::now();
        let before = before
            .checked_sub(std::time::Duration::from_millis(1))
            .unwrap_or(before);
        workers[0]
            .eviction
            .observe(before, kvroute_index::EvictionStats::default(), 0);
        let blocks: Vec<u64> = (1..=100).collect();
        let stored = || {
            Event::Stored(Stored::device(
                "a",
                0,
                CacheKind::FullAttention,
                None,
                16,
                &blocks,
            ))
        };
        registry.index.apply(&stored());
        registry
            .index
            .apply(&Event::Removed(Removed::device("a", 0, &blocks)));
        registry.index.apply(&stored());
        workers[0]
            .bookings_total
            .store(16, std::sync::atomic::Ordering::Relaxed);
        let prompt: Vec<u32> = (0..640).collect();
        let decide = |weights: &PolicyWeights| {
            weighed_decision(&registry, &workers, &prompt, true, None, weights)
        };
        // Off (the default), nothing is charged or learned and the tie goes to the first name.
        let d = decide(&PolicyWeights::default());
        assert_eq!(candidate(&d, "a").eviction_ms, 0.0);
        assert_eq!(d.worker, "a");
        assert_eq!(workers[0].eviction.rate(), 0.0);
        let on = PolicyWeights {
            eviction: true,
            ..PolicyWeights::default()
        };
        let d = decide(&on);
        assert!((workers[0].eviction.rate() - 0.25).abs() < 1e-12);
        let a = candidate(&d, "a");
        assert!(
            (a.eviction_ms - 640.0 * 0.25 * a.ms_per_token).abs() < 1e-9,
            "{a:?}"
        );
        assert!(a.eviction_ms > 0.0);
        assert_eq!(candidate(&d, "b").eviction_ms, 0.0);
        assert_eq!(d.worker, "b");
        // Under the token cost (which has no milliseconds to add it to) nothing is charged.
        let tokens = PolicyWeights {
            cost: CostModel::Tokens,
            ..on
        };
        let d = decide(&tokens);
        assert_eq!(candidate(&d, "a").eviction_ms, 0.0);
        assert_eq!(d.worker, "a");
    }

    #[test]
    fn a_request_goes_where_its_decode_slows_the_fewest_running_requests() {
        let (registry, workers) = fleet(&["a", "b"]);
        // Both serve the prompt from cache alike; "a" sorts first and has 6 requests running.
        let prompt = [7u32; 64];
        store(&registry, "a", &prompt);
        store(&registry, "b", &prompt);
        workers[0]
            .in_flight
            .store(6, std::sync::atomic::Ordering::Relaxed);
        teach_decode(&registry);
        let run = |weights: &PolicyWeights, max_tokens: Option<u64>| {
            weighed_decision(&registry, &workers, &prompt, true, max_tokens, weights)
        };
        let d = run(&PolicyWeights::default(), None);
        let a = d.candidates.iter().find(|c| c.worker == "a").unwrap();
        let b = d.candidates.iter().find(|c| c.worker == "b").unwrap();
        let delta = registry.fleet_decode.ms_per_running();
        assert!((delta - 0.5).abs() < 0.01, "{delta}");
        // A typical answer overlaps half of each running one's: δ·Ō·R.
        assert!(
            (a.decode_interference_ms - delta * 40.0 * 6.0).abs() < 1e-6,
            "{a:?}"
        );
        assert_eq!(b.decode_interference_ms, 0.0);
        assert_eq!(d.worker, "b");
        // A short answer brings less: capped by the request's max_tokens.
        let short = run(&PolicyWeights::default(), Some(4));
        let a4 = short.candidates.iter().find(|c| c.worker == "a").unwrap();
        let overlap = 4.0 - 4.0 * 4.0 / (2.0 * 40.0);
        assert!((a4.decode_interference_ms - 2.0 * delta * overlap * 6.0).abs() < 1e-6);
        // Switched off, the decode is not priced.
        let off = PolicyWeights {
            decode_interference: false,
            ..PolicyWeights::default()
        };
        let d = run(&off, None);
        let a = d.candidates.iter().find(|c| c.worker == "a").unwrap();
        assert!(
            (a.cost - a.predicted_ttft_ms - a.later_turns_ms - a.delay_to_others_ms).abs() < 1e-6
        );
    }

    #[test]
    fn a_new_conversation_starts_where_its_later_turns_stall_the_fewest_decoding_requests() {
        let (registry, workers) = fleet(&["a", "b"]);
        // "a" holds three quarters of the prompt and has recently had three requests running;
        // "b" holds nothing and has been idle. Conversations run five turns, each follow-up's
        // prefill 100 ms.
        let prompt: Vec<u32> = (0..4096).collect();
        store(&registry, "a", &prompt[..3072]);
        teach_conversations(&registry, 5, 1000, 100.0);
        for _ in 0..2000 {
            workers[0].decode.sample_running(3.0);
        }
        let run = |weights: &PolicyWeights, follow_up: bool| {
            weighed_decision(&registry, &workers, &prompt, follow_up, None, weights)
        };
        let pick = candidate;
        let k = registry.follow_ups.expected();
        let (_, s) = registry.turns.cycle().expect("cycle learned");
        let d = run(&PolicyWeights::default(), false);
        let (a, b) = (pick(&d, "a"), pick(&d, "b"));
        // Each of its k later turns stalls the three decoding there by its prefill.
        let want = k * s * workers[0].decode.mean_running();
        assert!(k > 1.0 && (a.prefill_stall_ms - want).abs() < 1e-6, "{a:?}");
        assert_eq!(b.prefill_stall_ms, 0.0);
        assert!(a.own_prefill_ms < b.own_prefill_ms, "{d:?}");
        assert_eq!(d.worker, "b", "{d:?}");
        // Switched off, nothing is charged and the worker holding most of the prompt wins.
        let off = PolicyWeights {
            prefill_stall: PrefillStall::Off,
            ..PolicyWeights::default()
        };
        let d = run(&off, false);
        assert!(d.candidates.iter().all(|c| c.prefill_stall_ms == 0.0));
        assert_eq!(d.worker, "a");
        // Asked to, its own prefill is charged too: here, with nothing in flight, nothing more;
        // with six in flight on "a", six times its prefill there.
        let all = PolicyWeights {
            prefill_stall: PrefillStall::All,
            ..PolicyWeights::default()
        };
        assert!((pick(&run(&all, false), "a").prefill_stall_ms - want).abs() < 1e-6);
        workers[0]
            .in_flight
            .store(6, std::sync::atomic::Ordering::Relaxed);
        let a6 = pick(&run(&all, true), "a");
        assert!(
            (a6.prefill_stall_ms - 6.0 * a6.own_prefill_ms).abs() < 1e-6,
            "{a6:?}"
        );
        // A new conversation pays both: its own prefill's and its later turns'.
        let n6 = pick(&run(&all, false), "a");
        assert!(
            (n6.prefill_stall_ms - (want + 6.0 * n6.own_prefill_ms)).abs() < 1e-6,
            "{n6:?}"
        );
        workers[0]
            .in_flight
            .store(0, std::sync::atomic::Ordering::Relaxed);
        // A follow-up brings no later turns of its own here: nothing is charged.
        let f = run(&PolicyWeights::default(), true);
        assert!(
            f.candidates.iter().all(|c| c.prefill_stall_ms == 0.0),
            "{f:?}"
        );
        assert_eq!(f.worker, "a");
    }

    /// The fleet's decode model and answers: each running request adds 0.5 ms to a token;
    /// answers are 40 tokens long.
    fn teach_decode(registry: &Registry) {
        for i in 0..64u64 {
            let r = (i % 8) as f64;
            registry.fleet_decode.observe(0.0, r, 6.0 + 0.5 * r);
        }
        for _ in 0..8 {
            registry.output_tokens.observe(40);
        }
    }

    /// The hybrid-aware decision, default weights, for `prompt` as a new conversation or a
    /// follow-up.
    fn hybrid_decision(
        registry: &Registry,
        workers: &[Arc<Worker>],
        prompt: &[u32],
        follow_up: bool,
    ) -> Decision {
        weighed_decision(
            registry,
            workers,
            prompt,
            follow_up,
            None,
            &PolicyWeights::default(),
        )
    }

    /// The hybrid-aware decision under `weights`, the answer capped at `max_tokens`.
    fn weighed_decision(
        registry: &Registry,
        workers: &[Arc<Worker>],
        prompt: &[u32],
        follow_up: bool,
        max_tokens: Option<u64>,
        weights: &PolicyWeights,
    ) -> Decision {
        decide_with(
            registry,
            workers,
            prompt,
            BlockExtras::default(),
            false,
            follow_up,
            max_tokens,
            PolicyKind::HybridAware,
            weights,
            0,
            false,
        )
        .decision
    }

    /// The candidate for worker `w` in a decision.
    fn candidate(d: &Decision, w: &str) -> Candidate {
        d.candidates
            .iter()
            .find(|c| c.worker == w)
            .cloned()
            .expect("candidate")
    }

    #[test]
    fn a_new_conversations_later_turns_are_charged_the_decode_they_will_share() {
        let (registry, workers) = fleet(&["a", "b"]);
        teach_conversations(&registry, 5, 1000, 100.0);
        let k = registry.follow_ups.expected();
        assert!(k > 1.0, "expected follow-ups {k}");
        workers[0]
            .in_flight
            .store(4, std::sync::atomic::Ordering::Relaxed);
        teach_decode(&registry);
        let run = |follow_up: bool| hybrid_decision(&registry, &workers, &[5; 64], follow_up);
        let charge = |d: &Decision, w: &str| {
            d.candidates
                .iter()
                .find(|c| c.worker == w)
                .map(|c| c.decode_interference_ms)
                .expect("candidate")
        };
        // One answer beside the four requests running now: δ·Ō·R. A new conversation brings
        // k more, each beside the two that have recently run there.
        for _ in 0..2000 {
            workers[0].decode.sample_running(2.0);
        }
        let delta = registry.fleet_decode.ms_per_running();
        let (now, recent) = (
            delta * 40.0 * 4.0,
            delta * 40.0 * workers[0].decode.mean_running(),
        );
        assert!((workers[0].decode.mean_running() - 2.0).abs() < 1e-6);
        let (new, follow) = (run(false), run(true));
        assert!(
            (charge(&new, "a") - (now + k * recent)).abs() < 1e-6,
            "{new:?}"
        );
        assert!((charge(&follow, "a") - now).abs() < 1e-6, "{follow:?}");
        assert_eq!((charge(&new, "b"), charge(&follow, "b")), (0.0, 0.0));
    }

    #[test]
    fn a_new_conversation_is_priced_with_the_conversations_living_on_each_worker() {
        let (registry, workers) = fleet(&["a", "b"]);
        // Conversations of five turns, a turn a second, 100 ms of prefill each: every
        // conversation keeps its worker 10 % busy.
        teach_conversations(&registry, 5, 1000, 100.0);
        let k = registry.follow_ups.expected();
        assert!((3.0..5.0).contains(&k), "expected follow-ups {k}");
        let life = k * 1000.0;
        let now = std::time::Instant::now();
        for _ in 0..6 {
            workers[0].live.add(now, life);
        }
        workers[1].live.add(now, life);
        let run = |follow_up: bool| hybrid_decision(&registry, &workers, &[9; 64], follow_up);
        let d = run(false);
        let by = |d: &Decision, w: &str| {
            d.candidates
                .iter()
                .find(|c| c.worker == w)
                .cloned()
                .expect("candidate")
        };
        let (a, b) = (by(&d, "a"), by(&d, "b"));
        assert!(a.live_conversations > 5.9 && b.live_conversations > 0.9);
        // Six conversations (ρ = 0.6) against one (ρ = 0.1): the same TTFT now, but the later
        // turns on "a" wait for five others and make them wait.
        assert_eq!(a.predicted_ttft_ms, b.predicted_ttft_ms);
        let (want_a, _) = conversation_cost_ms(a.live_conversations, k, 1000.0, 100.0);
        assert!((a.later_turns_ms - want_a).abs() < 1e-6, "{a:?}");
        assert!(a.later_turns_ms > b.later_turns_ms + 100.0, "{a:?} {b:?}");
        assert_eq!(d.worker, "b");
        // A follow-up is not charged for later turns: its conversation lives where it is.
        let d = run(true);
        assert!(d.candidates.iter().all(|c| c.later_turns_ms == 0.0));
        // A placement records the conversation on the chosen worker.
        let before = workers[1].live.count(std::time::Instant::now(), life);
        record_placement(&registry, &workers[1], &by(&d, "b"), None, false);
        let after = workers[1].live.count(std::time::Instant::now(), life);
        assert!(after > before + 0.9, "{before} → {after}");
    }

    #[test]
    fn on_a_hybrid_layout_a_sibling_is_forecast_the_in_flight_prompts_checkpoint() {
        let (registry, workers) = fleet(&["a", "b"]);
        // Both workers run full attention + Mamba (block 16) and hold something unrelated.
        for w in ["a", "b"] {
            store_group(&registry, w, 0, CacheKind::FullAttention, &[7; 64], |_| {
                true
            });
            store_group(&registry, w, 1, CacheKind::Mamba, &[7; 64], |i| i == 3);
        }
        // The token cost without load: the forecast alone decides (the TTFT cost would weigh
        // the prefill queued on "a" against the forecast; see the test below).
        let weights = PolicyWeights {
            lambda: 0.0,
            cost: CostModel::Tokens,
            ..PolicyWeights::default()
        };
        fn run<'t>(
            registry: &Registry,
            workers: &[Arc<Worker>],
            weights: &PolicyWeights,
            tokens: &'t [u32],
        ) -> Ranked<'t> {
            decide(
                registry,
                workers,
                tokens,
                None,
                false,
                PolicyKind::HybridAware,
                weights,
                0,
                false,
            )
        }
        let run = |tokens| run(&registry, &workers, &weights, tokens);
        // The first prompt goes to "a" (a tie, broken by name); its checkpoints are what the
        // gateway records in flight there.
        let first: Vec<u32> = (1..=200).collect();
        let r = run(&first);
        assert_eq!(r.decision.worker, "a");
        let chosen = &r.decision.candidates[0];
        assert_eq!(chosen.checkpoints, [192, 0]);
        let _in_flight = LoadGuard::new(workers[0].clone(), chosen.expected_uncached())
            .with_prompt(
                r.prompt.as_ref().expect("hybrid-aware keeps the prompt"),
                chosen.checkpoints,
            );
        // A sibling sharing 195 tokens will be served from the checkpoint at 192 on "a".
        let mut sibling = first[..195].to_vec();
        sibling.extend(900..950);
        let d = run(&sibling).decision;
        assert_eq!(d.worker, "a");
        assert_eq!(
            (
                d.candidates[0].predicted_cached,
                d.candidates[0].forecast_cached
            ),
            (0, 192)
        );
        // A branch at 100 shares 64 tokens of full-attention prefix but no state: no forecast,
        // only the junction credit for the prefix "a" will hold.
        let mut branch = first[..100].to_vec();
        branch.extend(900..950);
        let d = run(&branch).decision;
        let a = d
            .candidates
            .iter()
            .find(|c| c.worker == "a")
            .expect("a is a candidate");
        assert_eq!((a.forecast_cached, a.junction), (0, 64));
        // A request that skips the prefix cache is forecast nothing.
        let d = decide(
            &registry,
            &workers,
            &sibling,
            None,
            true,
            PolicyKind::HybridAware,
            &weights,
            0,
            false,
        )
        .decision;
        assert!(d.candidates.iter().all(|c| c.forecast_cached == 0));
    }

    #[test]
    fn a_sibling_follows_its_prefix_to_the_worker_still_prefilling_it() {
        let (registry, workers) = fleet(&["a", "b"]);
        let prompt: Vec<u32> = (1..=200).collect();
        // "a" has stored the prompt's first 64 tokens; "b" (which holds something else, so its
        // layout is known) is still prefilling the whole prompt.
        store(&registry, "a", &prompt[..64]);
        store(&registry, "b", &[7; 32]);
        let _in_flight = LoadGuard::new(workers[1].clone(), 200)
            .with_prompt(&Prompt::new(&prompt, &BlockExtras::default()), [192, 0]);
        let mut sibling = prompt[..190].to_vec();
        sibling.extend(900..950);
        let weights = PolicyWeights {
            lambda: 0.0,
            cost: CostModel::Tokens,
            ..PolicyWeights::default()
        };
        let run = |policy| {
            decide(
                &registry, &workers, &sibling, None, false, policy, &weights, 0, false,
            )
            .decision
        };
        let d = run(PolicyKind::HybridAware);
        assert_eq!(d.worker, "b");
        assert_eq!(
            d.predicted_cached, 0,
            "the reported prediction stays the index's"
        );
        // The shared 190 tokens hold two full 64-token chunks: 128 forecast on "b".
        assert_eq!(d.candidates[0].forecast_cached, 128);
        assert_eq!(d.candidates[0].expected_uncached(), 240 - 128);
        // Group-blind, like other routers, sees only what is stored.
        assert_eq!(run(PolicyKind::GroupBlind).worker, "a");
    }

    #[test]
    fn with_the_next_arrivals_charge_a_long_prompt_leaves_the_last_idle_worker_to_short_ones() {
        let (registry, workers) = fleet(&["a", "b", "c", "d"]);
        // "a", "b" and "c" are prefilling 3,000, 4,000 and 5,000 tokens; "d" is idle. Requests
        // have been reaching every worker every 20 ms (the fleet: one every 5 ms).
        let _busy: Vec<LoadGuard> = [3000, 4000, 5000]
            .iter()
            .zip(&workers)
            .map(|(tokens, w)| LoadGuard::new(w.clone(), *tokens))
            .collect();
        let now = std::time::Instant::now();
        for w in &workers {
            for i in (0..=64u64).rev() {
                if let Some(t) = now.checked_sub(std::time::Duration::from_millis(20 * i)) {
                    w.arrivals.observe(t);
                }
            }
        }
        // The bookings count whole, and the other requests' delay is left out: this isolates
        // the charge.
        let base = PolicyWeights {
            queue_drain: false,
            delay_to_others: false,
            ..PolicyWeights::default()
        };
        let charged = PolicyWeights {
            next_arrivals: true,
            ..base.clone()
        };
        let long: Vec<u32> = (1..=2000).collect();
        let short: Vec<u32> = (1..=16).collect();
        let d = weighed_decision(&registry, &workers, &long, false, None, &base);
        assert_eq!(
            d.worker, "d",
            "by its own TTFT the long prompt takes the idle worker"
        );
        // Off, the charge is not computed.
        assert!(d.candidates.iter().all(|c| c.next_arrivals_ms == 0.0));
        let d = weighed_decision(&registry, &workers, &long, false, None, &charged);
        assert_eq!(
            d.worker, "a",
            "charged, it queues behind the shortest queue"
        );
        // Only the idle worker's placement has a charge, and it is the candidates' own waits
        // through `next_arrivals_ms` at the fleet's rate (0.2 requests a ms while the last
        // arrival is under 20 ms old; lower after, never lower than the rate read now).
        let idle = candidate(&d, "d");
        for w in ["a", "b", "c"] {
            assert_eq!(candidate(&d, w).next_arrivals_ms, 0.0);
        }
        let waits: Vec<f64> = d.candidates.iter().map(|c| c.load_delay_ms).collect();
        let at = d
            .candidates
            .iter()
            .position(|c| c.worker == "d")
            .expect("candidate d");
        let rate_now: f64 = workers
            .iter()
            .map(|w| w.arrivals.per_ms(std::time::Instant::now()))
            .sum();
        let lo = next_arrivals_ms(&waits, at, idle.own_prefill_ms, rate_now);
        let hi = next_arrivals_ms(&waits, at, idle.own_prefill_ms, 0.2);
        assert!(lo > 0.0, "{idle:?}");
        assert!(
            lo * (1.0 - 1e-9) <= idle.next_arrivals_ms
                && idle.next_arrivals_ms <= hi * (1.0 + 1e-9),
            "{lo} <= {} <= {hi}",
            idle.next_arrivals_ms
        );
        let d = weighed_decision(&registry, &workers, &short, false, None, &charged);
        assert_eq!(d.worker, "d", "a short prompt still takes the idle worker");
    }

    #[test]
    fn the_ttft_cost_waits_for_a_prefilling_sibling_only_when_waiting_is_faster() {
        let (registry, workers) = fleet(&["a", "b"]);
        let prompt: Vec<u32> = (1..=2000).collect();
        store(&registry, "a", &[7; 32]);
        store(&registry, "b", &[7; 32]);
        // "b" is prefilling the whole prompt (2,000 tokens queued).
        let _in_flight = LoadGuard::new(workers[1].clone(), 2000)
            .with_prompt(&Prompt::new(&prompt, &BlockExtras::default()), [1984, 0]);
        // The bookings count whole (no drain: the queue must not depend on the test's timing;
        // the drain has tests of its own in `registry`).
        let weights = PolicyWeights {
            queue_drain: false,
            ..PolicyWeights::default()
        };
        let run = |tokens: &[u32]| {
            decide(
                &registry,
                &workers,
                tokens,
                None,
                false,
                PolicyKind::HybridAware,
                &weights,
                0,
                false,
            )
            .decision
        };
        // A sibling that shares 1,990 tokens: waiting for "b" and reusing 1,984 costs about
        // 2,000 + 56 token-times, computing 2,040 on "a" about the same: the one with less
        // total work wins, and the estimate is shown.
        let mut near = prompt[..1990].to_vec();
        near.extend(5000..5050);
        let d = run(&near);
        let by = |w: &str| {
            d.candidates
                .iter()
                .find(|c| c.worker == w)
                .cloned()
                .expect("candidate")
        };
        assert!(by("b").predicted_ttft_ms > 0.0 && by("a").predicted_ttft_ms > 0.0);
        assert_eq!(by("b").work.queued_tokens, 2000);
        assert_eq!(by("b").work.own_tokens, 2040 - 1984);
        assert_eq!(
            d.worker, "a",
            "2,000 + 56 queued-and-own tokens lose to 2,040"
        );
        assert_eq!(d.predicted_ttft_ms, by("a").predicted_ttft_ms);
        // Once "a" has 3,000 tokens of other prefill queued, waiting for "b" is faster.
        let _busy = LoadGuard::new(workers[0].clone(), 3000);
        let d = run(&near);
        assert_eq!(d.worker, "b");
        assert_eq!(
            d.predicted_cached, 0,
            "the reported prediction stays the index's"
        );
    }
}
