//! Ranking: which worker a request goes to, given its candidates' figures.
//!
//! Owns: [`Candidate`] (one worker's figures for one request, reported as the decision's
//! evidence), the ranking of candidates by cost — for the cache policies the predicted TTFT
//! plus the switched-on charges `decide` computed beside it, less the junction credit priced at
//! the worker's prefill rate ([`cost_ms`]; with cost model `tokens`, the tokens
//! `expected_uncached + λ·load − μ·junction`) —, ties broken by load, then by name order rotated by the request counter `rr` (candidates equal
//! in cost and load take turns, so an idle fleet's cold prompts spread over its workers instead
//! of all landing on the first name and evicting each other there).
//! Invariants: ranking is deterministic for equal inputs, `rr` included; every candidate
//! appears once in the ranking, best first (the retry takes the next one).
//! Must not: look at sockets, clocks or the index: it ranks numbers the caller computed.

use crate::config::{CostModel, PolicyKind, PolicyWeights};
use crate::work::Work;
use serde::Serialize;
use std::sync::Arc;

/// What the gateway knows about one candidate for one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// The worker's name (shared with the snapshot: no copy per candidate).
    pub worker: Arc<str>,
    /// Predicted cached tokens under this policy's view of the cache.
    pub predicted_cached: u64,
    /// Hybrid-aware only: what group-blind predicts on the same rank (its full-attention
    /// prefix), for the A/B of exactness; 0 under other policies and where nothing is stored.
    #[serde(skip_serializing_if = "is_zero")]
    pub blind_cached: u64,
    /// The part of `predicted_cached` the worker's CPU tier serves (loaded, not computed).
    #[serde(skip_serializing_if = "is_zero")]
    pub predicted_tier: u64,
    /// The predicted load of `predicted_tier` (ms; `cpu_load_us_per_token` a token), part of
    /// `predicted_ttft_ms`.
    #[serde(skip_serializing_if = "is_zero_f")]
    pub tier_load_ms: f64,
    /// Prompt tokens minus `predicted_cached`.
    pub uncached: u64,
    /// Hybrid-aware only: cached tokens beyond `predicted_cached` that the worker will serve
    /// once the prompts already in flight on it are stored (their checkpoints).
    #[serde(skip_serializing_if = "is_zero")]
    pub forecast_cached: u64,
    /// Load in tokens (queued prefill + per-request decode charge).
    pub load: f64,
    /// Hybrid-aware only: the junction tokens credited ([`crate::terms::junction_credit`]).
    #[serde(skip_serializing_if = "is_zero")]
    pub junction: u64,
    /// The predicted time to first token here (milliseconds, the gateway's clock): the prefill
    /// queued ahead, this request's expected uncached tokens and attention work, and the
    /// requests decoding there, through the worker's learned model ([`crate::work`]).
    pub predicted_ttft_ms: f64,
    /// The wait this worker's load adds to each later request of the conversation, times the
    /// follow-ups expected ([`crate::terms::later_turns_ms`]): later turns follow the cache placed now
    /// (ms; 0 while no follow-ups are seen).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub later_turns_ms: f64,
    /// This request's own prefill here (ms): the predicted TTFT less the wait for the load.
    pub own_prefill_ms: f64,
    /// The conversations living here (hybrid-aware and group-blind, new conversations only).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub live_conversations: f64,
    /// The wait this request's own prefill here adds to the requests that will reach the
    /// worker before its first token (ms; [`super::arrivals`]).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub delay_to_others_ms: f64,
    /// The end-to-end latency this request's decode here and the requests running here cost
    /// each other (ms; [`super::decoding`]).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub decode_interference_ms: f64,
    /// The end-to-end latency a new conversation's later turns' prefills here add to the
    /// requests decoding beside them (ms; [`super::decoding`]; 0 for a follow-up), and with
    /// `weights.prefill_stall = "all"` this request's own prefill to those in flight here.
    #[serde(skip_serializing_if = "is_zero_f")]
    pub prefill_stall_ms: f64,
    /// The prefill later requests will spend on what this request's uncached tokens push out
    /// of the worker's pool (ms; [`super::eviction`]; 0 with `weights.eviction = false`).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub eviction_ms: f64,
    /// The wait a placement here adds to the requests reaching the fleet while its
    /// least-loaded worker drains (ms; [`super::arrivals::next_arrivals_ms`]; computed and
    /// charged only with `weights.next_arrivals`, else 0).
    #[serde(skip_serializing_if = "is_zero_f")]
    pub next_arrivals_ms: f64,
    /// The wait this worker's load adds to a request sent there now (ms).
    pub load_delay_ms: f64,
    /// What the prediction was made from.
    #[serde(skip)]
    pub work: Work,
    /// The model's cost of one more prefill token here (ms): the junction credit's price.
    #[serde(skip)]
    pub ms_per_token: f64,
    /// Cache policies: `predicted_ttft_ms` plus the enabled charges above (later turns, delay
    /// to others, decode interference, prefill stall, eviction, next arrivals)
    /// `− μ·junction·ms_per_token`
    /// (cost model `ttft`), or
    /// `expected_uncached + λ·load − μ·junction` tokens (cost model `tokens`); `load`
    /// (least-load); position (round-robin).
    pub cost: f64,
    /// Where the engine will checkpoint this prompt if sent here (its last aligned position
    /// and its junction); recorded as in flight on the chosen worker.
    #[serde(skip)]
    pub checkpoints: [u64; 2],
    /// The candidate's position among the snapshot's workers: how the gateway finds the
    /// worker again without looking its name up (not reported).
    #[serde(skip)]
    pub slot: usize,
}

impl Candidate {
    /// The prefill this request will cost here: `uncached` less what the in-flight prompts
    /// ahead of it will have stored by the time it is scheduled.
    pub fn expected_uncached(&self) -> u64 {
        self.uncached.saturating_sub(self.forecast_cached)
    }
}

/// Where group-blind's view of one hybrid-aware decision differs from the exact one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlindGap {
    /// The chosen worker's group-blind prediction is not its exact one.
    pub prediction_differs: bool,
    /// Tokens group-blind predicts on the chosen worker beyond what it will serve.
    pub overpromised: u64,
    /// Every worker group-blind sees as holding the most serves less than the best worker by
    /// the exact view: group-blind would look for the prompt's cache elsewhere.
    pub best_elsewhere: bool,
}

/// The gap between the exact and the group-blind view of ranked hybrid-aware candidates (the
/// first is the chosen one).
pub fn blind_gap(ranked: &[Candidate]) -> BlindGap {
    let Some(chosen) = ranked.first() else {
        return BlindGap::default();
    };
    let best_exact = ranked.iter().map(|c| c.predicted_cached).max().unwrap_or(0);
    let best_blind = ranked.iter().map(|c| c.blind_cached).max().unwrap_or(0);
    BlindGap {
        prediction_differs: chosen.blind_cached != chosen.predicted_cached,
        overpromised: chosen.blind_cached.saturating_sub(chosen.predicted_cached),
        best_elsewhere: best_blind > 0
            && ranked
                .iter()
                .filter(|c| c.blind_cached == best_blind)
                .all(|c| c.predicted_cached < best_exact),
    }
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

fn is_zero_f(x: &f64) -> bool {
    *x == 0.0
}

/// The `ttft` cost of a candidate: its predicted TTFT plus the charges the weights switch on,
/// less the junction credit at its prefill rate. Each switch is read once: here for the terms
/// that are reported whatever the switch says (`later_turns`, `delay_to_others`,
/// `decode_interference`), in `decide` for those computed only when on (the prefill stall's
/// variant, `eviction`, `next_arrivals`: 0 otherwise, added here as they are).
pub fn cost_ms(c: &Candidate, weights: &PolicyWeights) -> f64 {
    let later = if weights.later_turns {
        c.later_turns_ms
    } else {
        0.0
    };
    let others = if weights.delay_to_others {
        c.delay_to_others_ms
    } else {
        0.0
    };
    let decode = if weights.decode_interference {
        c.decode_interference_ms
    } else {
        0.0
    };
    c.predicted_ttft_ms
        + later
        + others
        + decode
        + c.prefill_stall_ms
        + c.eviction_ms
        + c.next_arrivals_ms
        - weights.junction * c.junction as f64 * c.ms_per_token
}

/// Ranks candidates best first. `rr` is the round-robin counter for this request.
pub fn rank(
    policy: PolicyKind,
    mut cands: Vec<Candidate>,
    weights: &PolicyWeights,
    rr: u64,
) -> Vec<Candidate> {
    let lambda = weights.lambda;
    if cands.is_empty() {
        return cands;
    }
    // The candidates are ordered by their positions (`order`), and moved once at the end: a
    // candidate is a few hundred bytes, and sorting them in place moved each many times.
    // Name order rotated by `rr`: round-robin's order, and the other policies' last key (a
    // stable sort below keeps it among candidates equal in cost and load).
    let mut order: Vec<usize> = (0..cands.len()).collect();
    order.sort_by(|&a, &b| cands[a].worker.cmp(&cands[b].worker));
    let start = (rr % cands.len() as u64) as usize;
    order.rotate_left(start);
    match policy {
        PolicyKind::RoundRobin => {
            for (i, &k) in order.iter().enumerate() {
                cands[k].cost = i as f64;
            }
            return in_order(cands, &order);
        }
        PolicyKind::LeastLoad => {
            for c in cands.iter_mut() {
                c.cost = c.load;
            }
        }
        PolicyKind::HybridAware | PolicyKind::GroupBlind => {
            for c in cands.iter_mut() {
                c.cost = match weights.cost {
                    CostModel::Ttft => cost_ms(c, weights),
                    CostModel::Tokens => {
                        c.expected_uncached() as f64 + lambda * c.load
                            - weights.junction * c.junction as f64
                    }
                };
            }
        }
    }
    order.sort_by(|&a, &b| {
        let (a, b) = (&cands[a], &cands[b]);
        a.cost.total_cmp(&b.cost).then(a.load.total_cmp(&b.load))
    });
    in_order(cands, &order)
}

/// `cands` rearranged so that the `i`-th is `cands[order[i]]` (`order` a permutation).
fn in_order(cands: Vec<Candidate>, order: &[usize]) -> Vec<Candidate> {
    let mut slots: Vec<Option<Candidate>> = cands.into_iter().map(Some).collect();
    let mut out = Vec::with_capacity(order.len());
    out.extend(order.iter().filter_map(|&k| slots[k].take()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::terms::junction_credit;

    fn c(w: &str, cached: u64, n: u64, load: f64) -> Candidate {
        Candidate {
            worker: w.into(),
            predicted_cached: cached,
            blind_cached: 0,
            predicted_tier: 0,
            tier_load_ms: 0.0,
            uncached: n - cached,
            forecast_cached: 0,
            load,
            junction: 0,
            predicted_ttft_ms: 0.0,
            later_turns_ms: 0.0,
            delay_to_others_ms: 0.0,
            decode_interference_ms: 0.0,
            prefill_stall_ms: 0.0,
            eviction_ms: 0.0,
            next_arrivals_ms: 0.0,
            own_prefill_ms: 0.0,
            live_conversations: 0.0,
            load_delay_ms: 0.0,
            work: Work::default(),
            ms_per_token: 0.0,
            cost: 0.0,
            checkpoints: [0, 0],
            slot: 0,
        }
    }

    fn w(lambda: f64) -> PolicyWeights {
        PolicyWeights {
            lambda,
            cost: CostModel::Tokens,
            ..PolicyWeights::default()
        }
    }

    fn timed(w: &str, ttft: f64, junction: u64, ms_per_token: f64) -> Candidate {
        let mut x = c(w, 0, 1000, 0.0);
        x.predicted_ttft_ms = ttft;
        x.junction = junction;
        x.ms_per_token = ms_per_token;
        x
    }

    #[test]
    fn a_conversation_starts_where_its_later_turns_will_wait_least() {
        let weights = PolicyWeights::default();
        // "warm" serves this request 100 ms sooner, but its load makes each of the five turns
        // expected after it wait 40 ms: over the conversation the cold worker is ahead.
        let mut warm = timed("warm", 60.0, 0, 0.05);
        warm.later_turns_ms = 5.0 * 40.0;
        let cold = timed("cold", 160.0, 0, 0.05);
        let r = rank(
            PolicyKind::HybridAware,
            vec![warm.clone(), cold.clone()],
            &weights,
            0,
        );
        assert_eq!(&*r[0].worker, "cold");
        // Switched off, or with no follow-ups expected, only this request's TTFT counts.
        let myopic = PolicyWeights {
            later_turns: false,
            ..PolicyWeights::default()
        };
        let r = rank(
            PolicyKind::HybridAware,
            vec![warm.clone(), cold.clone()],
            &myopic,
            0,
        );
        assert_eq!(&*r[0].worker, "warm");
        warm.later_turns_ms = 0.0;
        let r = rank(PolicyKind::HybridAware, vec![warm, cold], &weights, 0);
        assert_eq!(&*r[0].worker, "warm");
    }

    #[test]
    fn the_ttft_cost_picks_the_lowest_predicted_ttft_less_the_junctions_worth() {
        let weights = PolicyWeights::default();
        assert_eq!(weights.cost, CostModel::Ttft);
        let r = rank(
            PolicyKind::HybridAware,
            vec![timed("a", 120.0, 0, 0.05), timed("b", 80.0, 0, 0.05)],
            &weights,
            0,
        );
        assert_eq!(&*r[0].worker, "b");
        assert_eq!(r[0].cost, 80.0);
        // μ = 0 by default: the junction is worth nothing.
        let junctions = || vec![timed("a", 120.0, 1000, 0.05), timed("b", 80.0, 0, 0.05)];
        let r = rank(PolicyKind::HybridAware, junctions(), &weights, 0);
        assert_eq!((&*r[0].worker, r[0].cost), ("b", 80.0));
        // At μ = 1, 1000 junction tokens at 0.05 ms each are worth 50 ms of later prefill.
        let credited = PolicyWeights {
            junction: 1.0,
            ..weights
        };
        let r = rank(PolicyKind::HybridAware, junctions(), &credited, 0);
        assert_eq!(&*r[0].worker, "a");
        assert_eq!(r[0].cost, 70.0);
    }

    #[test]
    fn the_warm_worker_wins_until_its_load_outweighs_the_saved_prefill() {
        let r = rank(
            PolicyKind::HybridAware,
            vec![c("a", 0, 1000, 0.0), c("b", 800, 1000, 100.0)],
            &w(1.0),
            0,
        );
        assert_eq!(&*r[0].worker, "b");
        let r = rank(
            PolicyKind::HybridAware,
            vec![c("a", 0, 1000, 0.0), c("b", 800, 1000, 900.0)],
            &w(1.0),
            0,
        );
        assert_eq!(&*r[0].worker, "a");
    }

    #[test]
    fn equal_candidates_take_turns_as_the_request_counter_advances() {
        let idle = vec![
            c("w0", 0, 100, 0.0),
            c("w1", 0, 100, 0.0),
            c("w2", 0, 100, 0.0),
        ];
        let firsts: Vec<String> = (0..6)
            .map(|rr| {
                rank(PolicyKind::HybridAware, idle.clone(), &w(1.0), rr)[0]
                    .worker
                    .to_string()
            })
            .collect();
        assert_eq!(firsts, ["w0", "w1", "w2", "w0", "w1", "w2"]);
        // A cheaper candidate still wins whatever the counter says.
        let mut warm = idle.clone();
        warm[2] = c("w2", 64, 100, 0.0);
        for rr in 0..6 {
            assert_eq!(
                &*rank(PolicyKind::HybridAware, warm.clone(), &w(1.0), rr)[0].worker,
                "w2"
            );
        }
    }

    /// The literal model of the ranking's order: the candidates themselves sorted by name,
    /// rotated by `rr`, then stably sorted by cost and load.
    fn sorted_in_place(
        policy: PolicyKind,
        cands: &[Candidate],
        weights: &PolicyWeights,
        rr: u64,
    ) -> Vec<String> {
        let mut c = cands.to_vec();
        c.sort_by(|a, b| a.worker.cmp(&b.worker));
        let start = (rr % c.len().max(1) as u64) as usize;
        c.rotate_left(start);
        if policy != PolicyKind::RoundRobin {
            let cost = |x: &Candidate| match policy {
                PolicyKind::LeastLoad => x.load,
                _ => match weights.cost {
                    CostModel::Ttft => cost_ms(x, weights),
                    CostModel::Tokens => {
                        x.expected_uncached() as f64 + weights.lambda * x.load
                            - weights.junction * x.junction as f64
                    }
                },
            };
            c.sort_by(|a, b| cost(a).total_cmp(&cost(b)).then(a.load.total_cmp(&b.load)));
        }
        c.into_iter().map(|x| x.worker.to_string()).collect()
    }

    proptest::proptest! {
        #[test]
        fn the_ranking_orders_candidates_as_sorting_them_in_place_would(
            rows in proptest::collection::vec((0u8..6, 0u64..4, 0u8..4, 0u64..3), 0..24),
            rr in 0u64..50, tokens in proptest::bool::ANY, pick in 0usize..4,
        ) {
            // Few distinct names, costs and loads: ties (and equal names) are common.
            let cands: Vec<Candidate> = rows
                .iter()
                .enumerate()
                .map(|(i, (name, cached, load, ttft))| Candidate {
                    slot: i,
                    predicted_ttft_ms: *ttft as f64 * 10.0,
                    ..c(&format!("w{name}"), cached * 16, 64, f64::from(*load))
                })
                .collect();
            let policy = [
                PolicyKind::HybridAware,
                PolicyKind::GroupBlind,
                PolicyKind::LeastLoad,
                PolicyKind::RoundRobin,
            ][pick];
            let weights = if tokens { w(0.5) } else { PolicyWeights::default() };
            let ranked = rank(policy, cands.clone(), &weights, rr);
            let names: Vec<String> = ranked.iter().map(|x| x.worker.to_string()).collect();
            proptest::prop_assert_eq!(names, sorted_in_place(policy, &cands, &weights, rr));
            let mut slots: Vec<usize> = ranked.iter().map(|x| x.slot).collect();
            slots.sort_unstable();
            proptest::prop_assert_eq!(slots, (0..cands.len()).collect::<Vec<_>>(), "each candidate once");
        }
    }

    #[test]
    fn blind_gap_counts_what_group_blind_would_promise_and_where_it_would_look() {
        let with = |w: &str, exact: u64, blind: u64| Candidate {
            blind_cached: blind,
            ..c(w, exact, 1000, 0.0)
        };
        assert_eq!(blind_gap(&[]), BlindGap::default());
        // Both views agree: no gap.
        let same = [with("a", 256, 256), with("b", 0, 0)];
        assert_eq!(blind_gap(&same), BlindGap::default());
        // The chosen worker's window group lost the tail: blind promises 128 more, but it
        // still sees the chosen worker as holding the most.
        let lost = [with("a", 128, 256), with("b", 0, 0)];
        assert_eq!(
            blind_gap(&lost),
            BlindGap {
                prediction_differs: true,
                overpromised: 128,
                best_elsewhere: false
            }
        );
        // Blind sees "b" holding the most, where the exact view serves less than on "a".
        let elsewhere = [with("a", 192, 192), with("b", 64, 512)];
        assert_eq!(
            blind_gap(&elsewhere),
            BlindGap {
                prediction_differs: false,
                overpromised: 0,
                best_elsewhere: true
            }
        );
        // A blind favourite that the exact view also ranks best is not elsewhere.
        let shared = [with("a", 192, 192), with("b", 192, 512), with("c", 0, 512)];
        assert!(!blind_gap(&shared).best_elsewhere);
    }

    #[test]
    fn ties_break_by_load_then_by_name_at_the_first_request() {
        let r = rank(
            PolicyKind::HybridAware,
            vec![c("b", 0, 10, 0.0), c("a", 5, 10, 0.0), c("c", 0, 10, 5.0)],
            &w(0.0),
            0,
        );
        assert_eq!(
            r.iter().map(|x| &*x.worker).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
    }

    #[test]
    fn a_junction_makes_the_worker_with_the_full_attention_prefix_worth_more() {
        let mut a = c("a", 0, 1000, 0.0);
        let b = c("b", 0, 1000, 0.0);
        a.junction = 512;
        let plain = PolicyWeights {
            junction: 0.0,
            ..w(1.0)
        };
        // Without the junction term "a" and "b" tie and the name decides; with it "a" wins
        // even against a little load.
        assert_eq!(
            rank(
                PolicyKind::HybridAware,
                vec![b.clone(), a.clone()],
                &plain,
                0
            )[0]
            .worker,
            "a".into()
        );
        let mut loaded = a.clone();
        loaded.load = 100.0;
        assert_eq!(
            rank(
                PolicyKind::HybridAware,
                vec![b.clone(), loaded.clone()],
                &plain,
                0
            )[0]
            .worker,
            "b".into()
        );
        let with = PolicyWeights {
            junction: 0.5,
            ..w(1.0)
        };
        assert_eq!(
            rank(PolicyKind::HybridAware, vec![b, loaded], &with, 0)[0].worker,
            "a".into()
        );
    }

    #[test]
    fn a_worker_that_lost_state_another_worker_holds_earns_no_junction_credit() {
        // "a" holds the full-attention prefix (900) but lost its Mamba state; "b" serves 900.
        let fleet_best = 900;
        assert_eq!(junction_credit(900, 0, fleet_best), 0);
        assert_eq!(junction_credit(900, 900, fleet_best), 0);
        let mut a = c("a", 0, 1000, 0.0);
        a.junction = junction_credit(900, 0, fleet_best);
        let b = c("b", 900, 1000, 50.0);
        let r = rank(PolicyKind::HybridAware, vec![a, b], &w(1.0), 0);
        assert_eq!(&*r[0].worker, "b");
        // Where nobody serves the prefix yet, the checkpoint to be is credited in full...
        assert_eq!(junction_credit(900, 0, 0), 900);
        // ...and beyond the fleet's best only.
        assert_eq!(junction_credit(900, 100, 400), 500);
    }

    #[test]
    fn round_robin_rotates_and_least_load_ignores_the_cache() {
        let cands = vec![c("a", 0, 10, 3.0), c("b", 9, 10, 1.0), c("c", 0, 10, 2.0)];
        let r = rank(PolicyKind::RoundRobin, cands.clone(), &w(1.0), 4);
        assert_eq!(&*r[0].worker, "b");
        let r = rank(PolicyKind::LeastLoad, cands, &w(1.0), 0);
        assert_eq!(&*r[0].worker, "b");
        assert_eq!(
            "group-blind".parse::<PolicyKind>(),
            Ok(PolicyKind::GroupBlind)
        );
    }
}
