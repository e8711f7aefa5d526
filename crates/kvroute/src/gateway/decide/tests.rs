//! The decision's tests: candidates and their predictions from a real index and registry, each
//! cost term's effect on where a request goes, and the evidence a decision reports.

use super::*;
use crate::gateway::arrivals::GAP_WEIGHT;
use crate::gateway::config::WorkerSpec;
use crate::gateway::config::{CostModel, PrefillStall};
use crate::gateway::observe;
use crate::gateway::registry::load::LoadGuard;
use kvroute_index::event::{CacheKind, Event, Stored};
use kvroute_index::hash::{HashAlgo, DEFAULT_SEED};
use kvroute_index::index::block_hashes;
use kvroute_index::Index;
use kvroute_route::terms::{conversation_cost_ms, next_arrivals_ms};
use kvroute_route::Candidate;

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
        .learners
        .lock()
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
    assert_eq!(workers[0].learners.lock().eviction.rate(), 0.0);
    let on = PolicyWeights {
        eviction: true,
        ..PolicyWeights::default()
    };
    let d = decide(&on);
    assert!((workers[0].learners.lock().eviction.rate() - 0.25).abs() < 1e-12);
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
    let on = PolicyWeights {
        decode_interference: true,
        ..PolicyWeights::default()
    };
    let d = run(&on, None);
    let a = d.candidates.iter().find(|c| &*c.worker == "a").unwrap();
    let b = d.candidates.iter().find(|c| &*c.worker == "b").unwrap();
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
    let short = run(&on, Some(4));
    let a4 = short.candidates.iter().find(|c| &*c.worker == "a").unwrap();
    let overlap = 4.0 - 4.0 * 4.0 / (2.0 * 40.0);
    assert!((a4.decode_interference_ms - 2.0 * delta * overlap * 6.0).abs() < 1e-6);
    // Off (the default), the decode is not priced.
    let d = run(&PolicyWeights::default(), None);
    let a = d.candidates.iter().find(|c| &*c.worker == "a").unwrap();
    assert!((a.cost - a.predicted_ttft_ms - a.later_turns_ms - a.delay_to_others_ms).abs() < 1e-6);
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
        workers[0]
            .learners
            .lock()
            .decode
            .sample_running(3.0, crate::gateway::ttft::WAIT_WEIGHT);
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
    let want = k * s * workers[0].learners.lock().decode.mean_running();
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

/// The proxy's decision for `tokens` (no salt, request 0, no evidence): the placement's
/// readings brought up to date ([`prepare`]), then ranked; `skip` asks it to skip the prefix
/// cache.
fn decide<'t>(
    registry: &Registry,
    workers: &[Arc<Worker>],
    tokens: &'t [u32],
    skip: bool,
    policy: PolicyKind,
    weights: &PolicyWeights,
) -> Ranked<'t> {
    prepare(registry, workers, policy, weights);
    let req = RouteRequest {
        skip_prefix_cache: skip,
        ..RouteRequest::base(registry, tokens)
    };
    decide_with(registry, workers, req, policy, weights)
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
    prepare(registry, workers, PolicyKind::HybridAware, weights);
    let req = RouteRequest {
        follow_up,
        max_tokens,
        ..RouteRequest::base(registry, prompt)
    };
    decide_with(registry, workers, req, PolicyKind::HybridAware, weights).decision
}

/// [`weighed_decision`] on the fleet as it stands at `now` (the clock injected: the figures
/// that decay with time, arrival rates and living conversations, are read at `now` however
/// long the test took to get here).
fn weighed_decision_at(
    registry: &Registry,
    workers: &[Arc<Worker>],
    prompt: &[u32],
    follow_up: bool,
    weights: &PolicyWeights,
    now: Instant,
) -> Decision {
    prepare(registry, workers, PolicyKind::HybridAware, weights);
    let req = RouteRequest {
        follow_up,
        ..RouteRequest::base(registry, prompt)
    };
    let taken = snapshot(
        registry,
        workers,
        &req,
        PolicyKind::HybridAware,
        weights,
        now,
    );
    let facts = RequestFacts {
        tokens: req.tokens.len() as u64,
        follow_up: req.follow_up,
        max_tokens: req.max_tokens,
        rr: req.rr,
    };
    kvroute_route::decide(PolicyKind::HybridAware, weights, &facts, &taken.snapshot)
}

/// The candidate for worker `w` in a decision.
/// The next arrivals' record of a placement on `d`'s chosen worker.
fn record_least_loaded(registry: &Registry, workers: &[Arc<Worker>], d: &Decision) {
    let chosen = workers
        .iter()
        .find(|w| w.spec.name == d.worker)
        .expect("the chosen worker");
    let p =
        observe::placement(chosen, &d.candidates, (None, None), false, true).expect("a placement");
    registry.least_loaded.observe(
        p.load_waits.expect("recorded").0,
        p.load_waits.expect("recorded").1,
    );
}

fn candidate(d: &Decision, w: &str) -> Candidate {
    d.candidates
        .iter()
        .find(|c| &*c.worker == w)
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
            .find(|c| &*c.worker == w)
            .map(|c| c.decode_interference_ms)
            .expect("candidate")
    };
    // One answer beside the four requests running now: δ·Ō·R. A new conversation brings
    // k more, each beside the two that have recently run there.
    for _ in 0..2000 {
        workers[0]
            .learners
            .lock()
            .decode
            .sample_running(2.0, crate::gateway::ttft::WAIT_WEIGHT);
    }
    let delta = registry.fleet_decode.ms_per_running();
    let (now, recent) = (
        delta * 40.0 * 4.0,
        delta * 40.0 * workers[0].learners.lock().decode.mean_running(),
    );
    assert!((workers[0].learners.lock().decode.mean_running() - 2.0).abs() < 1e-6);
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
        workers[0].learners.lock().live.add(now, life);
    }
    workers[1].learners.lock().live.add(now, life);
    let weights = PolicyWeights::default();
    let run = |follow_up: bool| {
        weighed_decision_at(&registry, &workers, &[9; 64], follow_up, &weights, now)
    };
    let d = run(false);
    let by = |d: &Decision, w: &str| {
        d.candidates
            .iter()
            .find(|c| &*c.worker == w)
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
    let before = workers[1]
        .learners
        .lock()
        .live
        .count(std::time::Instant::now(), life);
    let b = [by(&d, "b")];
    let p = observe::placement(&workers[1], &b, (None, None), false, false).expect("a placement");
    observe::placed(&registry, &workers[1], &p, std::time::Instant::now());
    let after = workers[1]
        .learners
        .lock()
        .live
        .count(std::time::Instant::now(), life);
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
        junction: 1.0,
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
            false,
            PolicyKind::HybridAware,
            weights,
        )
    }
    let run = |tokens| run(&registry, &workers, &weights, tokens);
    // The first prompt goes to "a" (a tie; request 0 starts the turn at the first name); its
    // checkpoints are what the gateway records in flight there.
    let first: Vec<u32> = (1..=200).collect();
    let r = run(&first);
    assert_eq!(r.decision.worker, "a");
    let chosen = &r.decision.candidates[0];
    assert_eq!(chosen.checkpoints, [192, 0]);
    let _in_flight = LoadGuard::new(workers[0].clone(), chosen.expected_uncached()).with_prompt(
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
        .find(|c| &*c.worker == "a")
        .expect("a is a candidate");
    assert_eq!((a.forecast_cached, a.junction), (0, 64));
    // A request that skips the prefix cache is forecast nothing.
    let d = decide(
        &registry,
        &workers,
        &sibling,
        true,
        PolicyKind::HybridAware,
        &weights,
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
        junction: 1.0,
        ..PolicyWeights::default()
    };
    let run = |policy| decide(&registry, &workers, &sibling, false, policy, &weights).decision;
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
                w.learners.lock().arrivals.observe(t);
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
    let d = weighed_decision_at(&registry, &workers, &long, false, &base, now);
    assert_eq!(
        d.worker, "d",
        "by its own TTFT the long prompt takes the idle worker"
    );
    // Off, the charge is not computed.
    assert!(d.candidates.iter().all(|c| c.next_arrivals_ms == 0.0));
    let d = weighed_decision_at(&registry, &workers, &long, false, &charged, now);
    assert_eq!(
        d.worker, "a",
        "charged, it queues behind the shortest queue"
    );
    // Only the idle worker's placement has a charge, and it is the candidates' own waits
    // through `next_arrivals_ms` at the fleet's rate (0.2 requests a ms while the last
    // arrival is under 20 ms old; lower after, never lower than the rate at the decision's
    // `now`, the clock every decision here is given).
    let idle = candidate(&d, "d");
    for w in ["a", "b", "c"] {
        assert_eq!(candidate(&d, w).next_arrivals_ms, 0.0);
    }
    let waits: Vec<f64> = d.candidates.iter().map(|c| c.load_delay_ms).collect();
    let at = d
        .candidates
        .iter()
        .position(|c| &*c.worker == "d")
        .expect("candidate d");
    let rate_now: f64 = workers
        .iter()
        .map(|w| w.learners.lock().arrivals.per_ms(now))
        .sum();
    let lo = next_arrivals_ms(&waits, at, idle.own_prefill_ms, rate_now);
    let hi = next_arrivals_ms(&waits, at, idle.own_prefill_ms, 0.2);
    assert!(lo > 0.0, "{idle:?}");
    assert!(
        lo * (1.0 - 1e-9) <= idle.next_arrivals_ms && idle.next_arrivals_ms <= hi * (1.0 + 1e-9),
        "{lo} <= {} <= {hi}",
        idle.next_arrivals_ms
    );
    let d = weighed_decision_at(&registry, &workers, &short, false, &charged, now);
    assert_eq!(d.worker, "d", "a short prompt still takes the idle worker");
    // λ counts the requests that went where the wait was least: the short prompt did, the
    // long one queuing behind "a" did not.
    record_least_loaded(&registry, &workers, &d);
    assert_eq!(registry.least_loaded.share(), 1.0);
    let d = weighed_decision_at(&registry, &workers, &long, false, &charged, now);
    assert_eq!(d.worker, "a");
    record_least_loaded(&registry, &workers, &d);
    let share = registry.least_loaded.share();
    assert!((share - (1.0 - GAP_WEIGHT)).abs() < 1e-12, "{share}");
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
            false,
            PolicyKind::HybridAware,
            &weights,
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
            .find(|c| &*c.worker == w)
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
