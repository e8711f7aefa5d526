//! One routing decision: candidates, predictions, ranking, and the evidence to show for it.
//!
//! Owns: turning (request tokens, salt, model) into a ranked candidate list under the
//! configured policy, from the index's per-rank predictions and the registry's load figures;
//! and the `x-kvroute-decision` evidence.
//! Invariants: only routable workers serving the model are candidates; a worker's prediction
//! is the best of its DP ranks (the engine's own balancer picks the rank).
//! Must not: send anything upstream.

use super::config::PolicyWeights;
use super::policy::{junction_credit, rank, Candidate, PolicyKind};
use super::registry::{Registry, Worker};
use kvroute_index::index::Detail;
use kvroute_index::rules::GroupEvidence;
use kvroute_index::{BlockExtras, Query};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Debug, Serialize)]
pub struct Decision {
    pub policy: &'static str,
    pub worker: String,
    pub prompt_tokens: usize,
    pub predicted_cached: u64,
    /// Each group of the chosen worker's best rank, alone (when evidence was asked for).
    pub groups: Vec<GroupEvidence>,
    pub candidates: Vec<Candidate>,
    pub decision_us: u64,
}

pub struct Ranked {
    pub order: Vec<Arc<Worker>>,
    pub decision: Decision,
}

pub fn candidates_for(registry: &Registry, model: &str) -> Vec<Arc<Worker>> {
    registry
        .all()
        .into_iter()
        .filter(|w| w.spec.model == model && w.routable())
        .collect()
}

/// Ranks `workers` for a request. The request is hashed once; per-group evidence is computed
/// (for the chosen worker only) when `evidence` is set.
#[allow(clippy::too_many_arguments)]
pub fn decide(
    registry: &Registry,
    workers: &[Arc<Worker>],
    tokens: &[u32],
    salt: Option<String>,
    skip_prefix_cache: bool,
    policy: PolicyKind,
    weights: &PolicyWeights,
    rr: u64,
    evidence: bool,
) -> Ranked {
    let start = std::time::Instant::now();
    let q = Query {
        tokens: tokens.to_vec(),
        extras: BlockExtras {
            cache_salt: salt,
            lora: None,
        },
        skip_prefix_cache,
    };
    let n = tokens.len() as u64;
    // Best rank per worker: (predicted, rank, junction tokens).
    let mut best: HashMap<&str, (u64, u32, u64)> = HashMap::new();
    let by_id: HashMap<&str, &str> = workers
        .iter()
        .map(|w| (&*w.id, w.spec.name.as_str()))
        .collect();
    if policy.uses_cache() {
        for p in registry.index.predict_all_detail(&q, Detail::Cached) {
            let v = if policy == PolicyKind::GroupBlind {
                p.group_blind.min(n.saturating_sub(1))
            } else {
                p.cached
            };
            // Prefix tokens the engine would checkpoint if sent here, before discounting what
            // another worker can already serve (below).
            let junction = if policy == PolicyKind::HybridAware {
                p.group_blind.min(n.saturating_sub(1))
            } else {
                0
            };
            if let Some(name) = by_id.get(&*p.worker) {
                let e = best.entry(name).or_insert((v, p.dp_rank, junction));
                if (v, junction) > (e.0, e.2) {
                    *e = (v, p.dp_rank, junction);
                }
            }
        }
    }
    let fleet_best = best.values().map(|b| b.0).max().unwrap_or(0);
    for b in best.values_mut() {
        b.2 = junction_credit(b.2, b.0, fleet_best);
    }
    let cands: Vec<Candidate> = workers
        .iter()
        .map(|w| {
            let (cached, junction) = best
                .get(w.spec.name.as_str())
                .map_or((0, 0), |b| (b.0, b.2));
            Candidate {
                worker: w.spec.name.clone(),
                predicted_cached: cached,
                uncached: n - cached.min(n),
                load: w.load_tokens(weights.tokens_per_request),
                junction,
                cost: 0.0,
            }
        })
        .collect();
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
                let rank = best.get(c.worker.as_str()).map_or(0, |b| b.1);
                registry.index.predict(&w.id, rank, &q).groups
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    Ranked {
        order,
        decision: Decision {
            policy: policy.name(),
            worker: first.as_ref().map(|c| c.worker.clone()).unwrap_or_default(),
            prompt_tokens: tokens.len(),
            predicted_cached: first.as_ref().map_or(0, |c| c.predicted_cached),
            groups,
            candidates: ranked,
            decision_us,
        },
    }
}
