//! One routing decision: candidates, predictions, ranking, and the evidence to show for it.
//!
//! Owns: turning (request tokens, salt, model) into a ranked candidate list under the
//! configured policy, from the index's per-rank predictions and the registry's load figures;
//! and the `x-kvroute-decision` evidence.
//! Invariants: only routable workers serving the model are candidates; a worker's prediction
//! is the best of its DP ranks (the engine's own balancer picks the rank).
//! Must not: send anything upstream.

use super::config::PolicyWeights;
use super::pending::{chunk_keys, prompt_checkpoint, Forecast};
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

/// A hybrid-aware candidate's view with its in-flight prompts counted.
#[derive(Clone, Copy, Default)]
struct Plan {
    /// Cached tokens once the in-flight prompts are stored (at least the index's figure).
    forecast: u64,
    /// Full-attention prefix, likewise.
    prefix: u64,
    align: u64,
    junction: u64,
}

pub struct Ranked {
    pub order: Vec<Arc<Worker>>,
    /// The request's chunk keys (hybrid-aware only; empty otherwise), for the in-flight record.
    pub keys: Arc<[u64]>,
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
    // Best rank per worker: (predicted, rank, full-attention prefix, alignment, single group).
    let mut best: HashMap<&str, (u64, u32, u64, u64, bool)> = HashMap::new();
    let by_id: HashMap<&str, &str> = workers
        .iter()
        .map(|w| (&*w.id, w.spec.name.as_str()))
        .collect();
    let hybrid = policy == PolicyKind::HybridAware;
    if policy.uses_cache() {
        for p in registry.index.predict_all_detail(&q, Detail::Cached) {
            let blind = p.group_blind.min(n.saturating_sub(1));
            let v = if policy == PolicyKind::GroupBlind {
                blind
            } else {
                p.cached
            };
            let align = p.params.map_or(0, |x| u64::from(x.align));
            let dense = p.params.is_some_and(|x| x.unitary);
            if let Some(name) = by_id.get(&*p.worker) {
                let e = best
                    .entry(name)
                    .or_insert((v, p.dp_rank, blind, align, dense));
                if (v, blind) > (e.0, e.2) {
                    *e = (v, p.dp_rank, blind, align, dense);
                }
            }
        }
    }
    // Hybrid-aware: what each worker will hold once its in-flight prompts are stored, and the
    // junction credit on top of the best the fleet can serve (now or once those are stored).
    let mut plans: HashMap<&str, Plan> = HashMap::new();
    let keys = if hybrid {
        chunk_keys(tokens, &q.extras)
    } else {
        Arc::from(Vec::new())
    };
    if hybrid {
        for w in workers {
            let name = w.spec.name.as_str();
            let Some(&(cached, _, blind, align, dense)) = best.get(name) else {
                continue;
            };
            let f = if align > 0 {
                w.pending.forecast(&keys, n, align, dense)
            } else {
                Forecast::default()
            };
            plans.insert(
                name,
                Plan {
                    forecast: f.cached.max(cached),
                    prefix: f.prefix.max(blind),
                    align,
                    junction: 0,
                },
            );
        }
        let fleet_best = plans.values().map(|p| p.forecast).max().unwrap_or(0);
        for p in plans.values_mut() {
            p.junction = junction_credit(p.prefix, p.forecast, fleet_best);
        }
    }
    let cands: Vec<Candidate> = workers
        .iter()
        .map(|w| {
            let name = w.spec.name.as_str();
            let cached = best.get(name).map_or(0, |b| b.0);
            let plan = plans.get(name).copied().unwrap_or_default();
            let checkpoints = if plan.align > 0 {
                let junction = if plan.prefix > plan.forecast {
                    plan.prefix
                } else {
                    0
                };
                [prompt_checkpoint(n, plan.align), junction]
            } else {
                [0, 0]
            };
            Candidate {
                worker: w.spec.name.clone(),
                predicted_cached: cached,
                uncached: n - cached.min(n),
                forecast_cached: plan.forecast.saturating_sub(cached),
                load: w.load_tokens(weights.tokens_per_request),
                junction: plan.junction,
                cost: 0.0,
                checkpoints,
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
        keys,
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
        let hashes: Vec<u64> = block_hashes(
            HashAlgo::Sha256,
            DEFAULT_SEED,
            16,
            tokens,
            &BlockExtras::default(),
        )
        .iter()
        .map(|(_, h, _)| *h)
        .collect();
        registry.index.apply(&Event::Stored(Stored::device(
            worker,
            0,
            CacheKind::FullAttention,
            None,
            16,
            &hashes,
        )));
    }

    #[test]
    fn a_sibling_follows_its_prefix_to_the_worker_still_prefilling_it() {
        let registry = Registry::new(Arc::new(Index::new()));
        let mut workers = Vec::new();
        for (name, port) in [("a", 1), ("b", 2)] {
            let mut spec = WorkerSpec::new(name, &format!("http://127.0.0.1:{port}"), "m");
            spec.hash_algo = "sha256".into();
            workers.push(registry.add(spec).expect("valid spec"));
        }
        let prompt: Vec<u32> = (1..=200).collect();
        // "a" has stored the prompt's first 64 tokens; "b" (which holds something else, so its
        // layout is known) is still prefilling the whole prompt.
        store(&registry, "a", &prompt[..64]);
        store(&registry, "b", &[7; 32]);
        let _in_flight = LoadGuard::new(workers[1].clone(), 200)
            .with_prompt(chunk_keys(&prompt, &BlockExtras::default()), [192, 0]);
        let mut sibling = prompt[..190].to_vec();
        sibling.extend(900..950);
        let weights = PolicyWeights {
            lambda: 0.0,
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
}
