//! One routing decision from the fleet's state: the snapshot the routing core decides from,
//! and the core's decision mapped back onto workers.
//!
//! Owns: [`snapshot`] (every candidate's figures read once: the index's routing prediction —
//! the ranks that hit, a worker not listed hits 0 —, the in-flight forecast, the queue, the
//! running requests, the learned models' current figures), [`decide_with`] (snapshot →
//! [`kvroute_route::decide`] → the ranked workers, the per-group evidence asked for, the
//! decision log), [`prepare`] (the readings a placement brings up to date before it is decided:
//! each candidate's queue drain rate, its eviction figures when their refresh is due). The
//! placement's records are `gateway::observe`'s.
//! Invariants: only routable workers serving the model are candidates; a worker's prediction
//! is the best of its DP ranks (the engine's own balancer picks the rank); `snapshot` and
//! `decide_with` change nothing (`/admin/explain` calls them), only `prepare` does, and only
//! the proxy calls it.
//! Must not: send anything upstream, or rank: the ranking is the core's.

use super::config::PolicyWeights;
use super::learners::Lent;
use super::pending::{Forecast, Prompt};
use super::registry::{Registry, Worker};
use kvroute_index::{BlockExtras, Params, Query, WorkerId};
use kvroute_route::{
    FleetFacts, LiveFacts, Outlook, PolicyKind, RequestFacts, Snapshot, WorkerFacts,
};
use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

pub use kvroute_route::Decision;

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

pub struct Ranked<'a> {
    /// The workers best first: `order[i]` is `decision.candidates[i]`'s.
    pub order: Vec<Arc<Worker>>,
    /// The request as recorded in flight on the chosen worker (hybrid-aware only).
    pub prompt: Option<Prompt<'a>>,
    pub decision: Decision,
}

/// One request as the decision sees it.
#[derive(Clone, Debug)]
pub struct RouteRequest<'a> {
    pub tokens: &'a [u32],
    /// Its salt and LoRA adapter key, hashed into every block.
    pub extras: BlockExtras,
    pub skip_prefix_cache: bool,
    /// It extends an earlier prompt (the caller asked the follow-up tracker,
    /// [`super::sessions::FollowUps`]).
    pub follow_up: bool,
    /// Its cap on its answer.
    pub max_tokens: Option<u64>,
    /// The request counter (equal candidates take turns by it).
    pub rr: u64,
    /// Whether per-group evidence is computed (for the chosen worker only).
    pub evidence: bool,
}

impl<'a> RouteRequest<'a> {
    /// A base-model request (no salt, no adapter) whose follow-up status the tracker tells
    /// without recording it.
    pub fn base(registry: &Registry, tokens: &'a [u32]) -> RouteRequest<'a> {
        RouteRequest {
            tokens,
            extras: BlockExtras::default(),
            skip_prefix_cache: false,
            follow_up: registry.follow_ups.extends_earlier(tokens),
            max_tokens: None,
            rr: 0,
            evidence: false,
        }
    }
}

pub fn candidates_for(registry: &Registry, model: &str) -> Vec<Arc<Worker>> {
    registry
        .all()
        .into_iter()
        .filter(|w| w.serves(model) && w.routable())
        .collect()
}

/// Brings the readings a placement is decided on up to date (the proxy calls it before each
/// decision it acts on; `/admin/explain` does not): each candidate's queue drains at the rate
/// its TTFT model now predicts with (or not at all with `weights.queue_drain` off), and with
/// the eviction charge on, its re-prefill rate takes the index's figures when its refresh is
/// due.
pub fn prepare(
    registry: &Registry,
    workers: &[Arc<Worker>],
    policy: PolicyKind,
    weights: &PolicyWeights,
) {
    let now = Instant::now();
    let fleet = registry.fleet_ttft.fit();
    let evictions = weights.eviction && policy.uses_cache();
    for w in workers {
        let (fit, claimed) = {
            let mut l = w.learners.lock();
            (l.ttft.fit_or(fleet), evictions && l.eviction.claim(now))
        };
        w.set_prefill_ms_per_token(if weights.queue_drain {
            fit.ms_per_token()
        } else {
            0.0
        });
        if claimed {
            let requests = w.bookings_total.load(std::sync::atomic::Ordering::Relaxed);
            let stats = registry.index.eviction_stats(&w.id);
            w.learners.lock().eviction.observe(now, stats, requests);
        }
    }
}

/// Ranks `workers` for `req` under `policy`: the snapshot, the core's decision, the ranked
/// workers, and the per-group evidence of the chosen worker's best rank when asked for.
pub fn decide_with<'a>(
    registry: &Registry,
    workers: &[Arc<Worker>],
    req: RouteRequest<'a>,
    policy: PolicyKind,
    weights: &PolicyWeights,
) -> Ranked<'a> {
    let start = Instant::now();
    let taken = snapshot(registry, workers, &req, policy, weights, start);
    let facts = RequestFacts {
        tokens: req.tokens.len() as u64,
        follow_up: req.follow_up,
        max_tokens: req.max_tokens,
        rr: req.rr,
    };
    let mut decision = kvroute_route::decide(policy, weights, &facts, &taken.snapshot);
    // Candidate i of the ranking is order[i]: the snapshot lists `workers` in their order, and
    // each candidate keeps its position there.
    let order: Vec<Arc<Worker>> = decision
        .candidates
        .iter()
        .filter_map(|c| workers.get(c.slot).cloned())
        .collect();
    debug_assert!(
        order.len() == decision.candidates.len()
            && order
                .iter()
                .zip(&decision.candidates)
                .all(|(w, c)| *w.spec.name == *c.worker)
    );
    decision.decision_us = start.elapsed().as_micros() as u64;
    log_decision(policy, weights, &facts, &taken.snapshot, &decision);
    if req.evidence && policy.uses_cache() {
        if let (Some(c), Some(w)) = (decision.candidates.first(), order.first()) {
            let rank = taken.ranks.get(c.slot).copied().flatten().unwrap_or(0);
            decision.groups = registry.index.predict(&w.id, rank, &taken.query).groups;
        }
    }
    Ranked {
        order,
        prompt: taken.prompt,
        decision,
    }
}

/// A snapshot and what the gateway keeps beside it for after the decision.
pub struct Taken<'a> {
    pub snapshot: Snapshot,
    /// The request as the index and the in-flight records see it.
    pub query: Query,
    pub prompt: Option<Prompt<'a>>,
    /// Each candidate's best DP rank (by its position among the workers), where predicted.
    pub ranks: Vec<Option<u32>>,
}

/// The fleet's figures and every candidate's as of `now`, read once, for `req` under `policy`:
/// the same state and `now` give the same snapshot.
pub fn snapshot<'a>(
    registry: &Registry,
    workers: &[Arc<Worker>],
    req: &RouteRequest<'a>,
    policy: PolicyKind,
    weights: &PolicyWeights,
    now: Instant,
) -> Taken<'a> {
    let query = Query {
        tokens: req.tokens.to_vec(),
        extras: req.extras.clone(),
        skip_prefix_cache: req.skip_prefix_cache,
    };
    let best = best_ranks(registry, workers, &query, policy);
    let prompt =
        (policy == PolicyKind::HybridAware).then(|| Prompt::new(req.tokens, &query.extras));
    let lent = Lent::of(&registry.fleet_ttft, &registry.fleet_decode);
    let facts: Vec<WorkerFacts> = workers
        .iter()
        .zip(&best)
        .map(|(w, b)| {
            let outlook = match (&prompt, b) {
                (Some(p), Some(b)) => outlook(
                    w,
                    p,
                    b,
                    req.skip_prefix_cache || !weights.in_flight_forecast,
                ),
                _ => None,
            };
            worker_facts(w, b.as_ref(), outlook, &lent, weights, now)
        })
        .collect();
    let fleet = FleetFacts {
        follow_ups: registry.follow_ups.expected(),
        cycle: registry.turns.cycle(),
        output_mean: registry.output_tokens.mean(),
        least_loaded_share: registry.least_loaded.share(),
    };
    let ranks = best.iter().map(|b| b.map(|b| b.rank)).collect();
    Taken {
        snapshot: Snapshot {
            fleet,
            workers: facts,
        },
        query,
        prompt,
        ranks,
    }
}

/// Each worker's best DP rank under the policy's view, by the worker's position: only the
/// ranks that hit are listed by the index (one walk of the request through its shared store);
/// hybrid-aware also lists a worker that hits nothing with its lookup parameters (for the
/// checkpoints the request would leave there and the forecast of a sibling it may be
/// prefilling), asked for all such workers at once.
fn best_ranks(
    registry: &Registry,
    workers: &[Arc<Worker>],
    q: &Query,
    policy: PolicyKind,
) -> Vec<Option<Best>> {
    let n = q.tokens.len() as u64;
    let mut best: Vec<Option<Best>> = vec![None; workers.len()];
    if policy.uses_cache() {
        let blind_view = policy == PolicyKind::GroupBlind;
        let positions = Positions::of(workers);
        for p in registry.index.predict_hits(q) {
            let blind = p.group_blind.min(n.saturating_sub(1));
            let row = Best {
                cached: if blind_view { blind } else { p.cached },
                tier: if blind_view { 0 } else { p.tier },
                rank: p.dp_rank,
                blind,
                params: p.params,
            };
            if let Some(e) = positions.of_id(&p.worker).and_then(|i| best.get_mut(i)) {
                match e {
                    Some(e) if (row.cached, row.blind) <= (e.cached, e.blind) => {}
                    _ => *e = Some(row),
                }
            }
        }
    }
    if policy == PolicyKind::HybridAware {
        let cold: Vec<usize> = (0..workers.len()).filter(|&i| best[i].is_none()).collect();
        let ids: Vec<&WorkerId> = cold.iter().map(|&i| &workers[i].id).collect();
        for (i, found) in cold.into_iter().zip(registry.index.params_of_each(&ids)) {
            best[i] = found.map(|(rank, params)| Best {
                cached: 0,
                tier: 0,
                rank,
                blind: 0,
                params: Some(params),
            });
        }
    }
    best
}

/// Finds a worker's position among the candidates by its id: by binary search where they are
/// listed in ascending order of id (as the registry lists them), else through a map.
enum Positions<'w> {
    Sorted(&'w [Arc<Worker>]),
    Map(HashMap<&'w str, usize>),
}

impl<'w> Positions<'w> {
    fn of(workers: &'w [Arc<Worker>]) -> Positions<'w> {
        if workers.windows(2).all(|p| p[0].id < p[1].id) {
            Positions::Sorted(workers)
        } else {
            Positions::Map(
                workers
                    .iter()
                    .enumerate()
                    .map(|(i, w)| (&*w.id, i))
                    .collect(),
            )
        }
    }

    fn of_id(&self, id: &str) -> Option<usize> {
        match self {
            Positions::Sorted(ws) => ws.binary_search_by(|w| (*w.id).cmp(id)).ok(),
            Positions::Map(m) => m.get(id).copied(),
        }
    }
}

/// A hybrid-aware candidate's outlook: what it will hold once its in-flight prompts are stored
/// (at least the index's figure; nothing counts for a request that skips the prefix cache, or
/// with `weights.in_flight_forecast` off).
fn outlook(w: &Worker, prompt: &Prompt<'_>, b: &Best, skip: bool) -> Option<Outlook> {
    let params = b.params?;
    let align = u64::from(params.align).max(1);
    let mut f = if skip {
        Forecast::default()
    } else {
        w.pending.forecast(prompt, align, params.unitary)
    };
    if params.eagle && f.cached > 0 {
        // The engine drops part of a hit to re-verify it; the forecast drops one alignment
        // unit (the index drops `min(align, block)` and re-aligns).
        f.cached = (f.cached - align) / align * align;
    }
    Some(Outlook {
        forecast: f.cached.max(b.cached),
        prefix: f.prefix.max(b.blind),
        align,
    })
}

/// One worker's figures at `now`: its learners read under their one lock (the fleet's models
/// lent where it has none of its own), its queue drained at its model's current rate (what
/// [`prepare`] sets for the bookings) and its running requests from one reading of the
/// engine's figures.
fn worker_facts(
    w: &Worker,
    b: Option<&Best>,
    outlook: Option<Outlook>,
    lent: &Lent,
    weights: &PolicyWeights,
    now: Instant,
) -> WorkerFacts {
    let r = w.learners.lock().readings(now, lent);
    let drain = if weights.queue_drain {
        r.ttft.ms_per_token()
    } else {
        0.0
    };
    let (queued_tokens, running) = w.load_at(drain, now);
    WorkerFacts {
        name: w.id.clone(),
        cached: b.map_or(0, |b| b.cached),
        tier: b.map_or(0, |b| b.tier),
        blind: b.map_or(0, |b| b.blind),
        outlook,
        queued_tokens,
        running,
        ttft: r.ttft,
        arrivals_per_ms: r.arrivals_per_ms,
        live: r.live.map(|(weight, age_ms)| LiveFacts { weight, age_ms }),
        load_wait_ms: r.load_wait_ms,
        decode_delta_ms: r.decode_delta_ms,
        mean_running: r.mean_running,
        eviction_rate: r.eviction_rate,
    }
}

/// Appends the decision and everything it was decided from to the decision log, one JSON
/// object a line, when `KVROUTE_DECISION_LOG` names a file (read once, at the first decision):
/// what `kvroute-route`'s replay test and an operator's offline analysis read. A log that
/// cannot be opened or written is reported once and then left alone.
fn log_decision(
    policy: PolicyKind,
    weights: &PolicyWeights,
    req: &RequestFacts,
    snapshot: &Snapshot,
    decision: &Decision,
) {
    static LOG: std::sync::OnceLock<Option<parking_lot::Mutex<std::fs::File>>> =
        std::sync::OnceLock::new();
    let log = LOG.get_or_init(|| {
        let path = std::env::var_os("KVROUTE_DECISION_LOG")?;
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            Ok(f) => Some(parking_lot::Mutex::new(f)),
            Err(e) => {
                tracing::warn!(path = ?path, error = %e, "decision log not opened");
                None
            }
        }
    });
    let Some(file) = log else { return };
    static FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let line = kvroute_route::log::Entry::new(policy, weights, req, snapshot, decision).line();
    // One write of the whole line under the lock: concurrent decisions never interleave.
    if let Err(e) = file.lock().write_all(line.as_bytes()) {
        if !FAILED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(error = %e, "decision log not written (reported once)");
        }
    }
}

#[cfg(test)]
mod tests;
