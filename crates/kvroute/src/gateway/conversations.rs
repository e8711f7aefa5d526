//! Conversations: the load a worker's live conversations will bring, and what one more
//! conversation there costs their later turns and its own.
//!
//! Owns: [`TurnCycle`] (the fleet's turn cycle `G`, the time from a prompt to its follow-up,
//! and `S`, the prefill a follow-up costs on the worker it is sent to — both exponentially
//! weighted means, learned from the traffic; a plain estimator, shared as [`TurnStats`]) and
//! [`LiveCount`] (a worker's live conversations: one per conversation started or moved there,
//! each fading with the expected remaining life of a conversation, `k · G` for `k` expected
//! follow-ups, [`conversation_life_ms`]; a plain estimator, one of a worker's learners). The routing
//! core prices them ([`conversation_cost_ms`], re-exported from `kvroute_route::terms` with the
//! life).
//!
//! The model: each live conversation brings one follow-up of `S` ms of prefill per cycle of
//! `G` ms, so `L` of them keep the worker's prefill busy a fraction `ρ = L · S / G`. A
//! follow-up then waits, on average, what a queue with Poisson arrivals and service `S` makes
//! it wait: `W(ρ) = S · ρ / (2 · (1 − ρ))` (M/D/1; linear past [`RHO_MAX`]). One more
//! conversation's `k` turns wait `W(L·ρ₁)` each (`ρ₁ = S / G`), and each of the `L` already
//! there waits `W(L·ρ₁) − W((L−1)·ρ₁)` more per turn: a worker that just took several new
//! conversations is priced with the turns they will bring, before its queue shows them.
//! Invariants: every figure is finite and non-negative; the cost is 0 with no follow-ups
//! expected or nothing learned yet, and grows with the live conversations; the plain
//! estimators take the time as an argument, the wrappers only lock.
//! Must not: read the index, sockets or the clock; the caller brings times and numbers.

use kvroute_route::terms::faded;
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// Weight of the newest observation in the turn cycle and the follow-up prefill: the same
/// forgetting as the follow-up fraction (about the last 350 follow-ups).
const WEIGHT: f64 = 1.0 - super::ttft::FORGET;
/// The fleet's turn cycle and follow-up prefill as a plain estimator ([`TurnStats`] shares
/// one between threads).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TurnCycle {
    gap_ms: Option<f64>,
    prefill_ms: Option<f64>,
}

/// The fleet's turn cycle and follow-up prefill.
#[derive(Debug, Default)]
pub struct TurnStats {
    inner: Mutex<TurnCycle>,
}

fn update(mean: &mut Option<f64>, x: f64) {
    if !x.is_finite() || x < 0.0 {
        return;
    }
    *mean = Some(match *mean {
        Some(m) => m + WEIGHT * (x - m),
        None => x,
    });
}

impl TurnCycle {
    /// A follow-up arrived `gap` after the prompt it extends.
    pub fn observe_gap(&mut self, gap: Duration) {
        update(&mut self.gap_ms, gap.as_secs_f64() * 1e3);
    }

    /// A follow-up was sent where its own prefill is predicted to take `ms`.
    pub fn observe_prefill(&mut self, ms: f64) {
        update(&mut self.prefill_ms, ms);
    }

    /// (turn cycle `G`, follow-up prefill `S`) in ms, once both were seen.
    pub fn cycle(&self) -> Option<(f64, f64)> {
        match (self.gap_ms, self.prefill_ms) {
            (Some(gap), Some(s)) if gap > 0.0 => Some((gap, s)),
            _ => None,
        }
    }
}

impl TurnStats {
    /// [`TurnCycle::observe_gap`].
    pub fn observe_gap(&self, gap: Duration) {
        self.inner.lock().observe_gap(gap);
    }

    /// [`TurnCycle::observe_prefill`].
    pub fn observe_prefill(&self, ms: f64) {
        self.inner.lock().observe_prefill(ms);
    }

    /// [`TurnCycle::cycle`].
    pub fn cycle(&self) -> Option<(f64, f64)> {
        self.inner.lock().cycle()
    }
}

/// A worker's live conversations as a plain estimator: how many were added, faded to the
/// instant the last was, and that instant (one of a worker's learners,
/// [`super::learners::Learners`], shared under the worker's one lock). Each fades
/// with a conversation's expected remaining life, so, the life being the same throughout, the
/// count is the sum of every added conversation's own fading (property-tested against that
/// literal sum).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LiveCount {
    /// (conversations as of the last addition, when that was); `None` before the first.
    last: Option<(f64, Instant)>,
}

impl LiveCount {
    /// A conversation started (or moved) here at `now`; `life_ms` is a conversation's
    /// expected remaining life. One added before the last (threads racing) counts as added
    /// with it: the instant never goes back.
    pub fn add(&mut self, now: Instant, life_ms: f64) {
        let before = self.count(now, life_ms);
        let at = self.last.map_or(now, |(_, t)| now.max(t));
        self.last = Some((before + 1.0, at));
    }

    /// The expected number of conversations still living here at `now`.
    pub fn count(&self, now: Instant, life_ms: f64) -> f64 {
        self.facts(now)
            .map_or(0.0, |(w, age_ms)| faded(w, age_ms, life_ms))
    }

    /// The conversations added here and how long ago the last was (ms), before fading: what
    /// [`LiveCount::count`] fades with a conversation's expected life.
    pub fn facts(&self, now: Instant) -> Option<(f64, f64)> {
        self.last
            .map(|(w, t)| (w, now.saturating_duration_since(t).as_secs_f64() * 1e3))
    }
}

pub use kvroute_route::terms::{
    conversation_cost_ms, conversation_life_ms, follow_up_wait_ms, RHO_MAX,
};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_idle_worker_costs_a_new_conversation_nothing() {
        assert_eq!(conversation_cost_ms(0.0, 5.0, 1000.0, 50.0), (0.0, 0.0));
        // Nothing learned, or no follow-ups expected: no charge.
        assert_eq!(conversation_cost_ms(4.0, 0.0, 1000.0, 50.0), (0.0, 0.0));
        assert_eq!(conversation_cost_ms(4.0, 5.0, 0.0, 50.0), (0.0, 0.0));
    }

    #[test]
    fn a_worker_with_more_live_conversations_costs_more() {
        // Follow-ups of 50 ms every second: each conversation keeps the worker 5 % busy.
        let (one, _) = conversation_cost_ms(1.0, 5.0, 1000.0, 50.0);
        let (ten, own) = conversation_cost_ms(10.0, 5.0, 1000.0, 50.0);
        assert!(one > 0.0 && ten > 3.0 * one, "{one} {ten}");
        // Ten conversations: ρ = 0.5, each turn waits 25 ms; five turns: 125 ms of its own.
        assert!((own - 125.0).abs() < 1e-9, "{own}");
    }

    #[test]
    fn the_wait_follows_the_mdone_formula_and_stays_finite_past_saturation() {
        assert_eq!(follow_up_wait_ms(0.0, 50.0), 0.0);
        assert!((follow_up_wait_ms(0.5, 50.0) - 25.0).abs() < 1e-9);
        let at = follow_up_wait_ms(RHO_MAX, 50.0);
        let past = follow_up_wait_ms(3.0, 50.0);
        assert!(past.is_finite() && past > at && at > follow_up_wait_ms(0.9, 50.0));
        assert_eq!(follow_up_wait_ms(f64::NAN, 50.0), 0.0);
    }

    #[test]
    fn conversations_added_at_one_instant_fade_together_with_their_expected_life() {
        let mut live = LiveCount::default();
        let t0 = Instant::now();
        live.add(t0, 1000.0);
        live.add(t0, 1000.0);
        assert!((live.count(t0, 1000.0) - 2.0).abs() < 1e-9);
        let later = live.count(t0 + Duration::from_millis(1000), 1000.0);
        assert!((later - 2.0 * (-1.0f64).exp()).abs() < 1e-9, "{later}");
        assert_eq!(live.count(t0, 0.0), 0.0, "no life, nobody living");
        assert_eq!(live.count(t0, f64::INFINITY), 0.0);
    }

    #[test]
    fn a_worker_nobody_was_sent_to_has_no_live_conversations() {
        let live = LiveCount::default();
        let t0 = Instant::now();
        assert_eq!(live.facts(t0), None);
        assert_eq!(live.count(t0, 1000.0), 0.0);
    }

    #[test]
    fn an_earlier_conversation_has_faded_when_the_next_is_added() {
        let mut live = LiveCount::default();
        let t0 = Instant::now();
        live.add(t0, 500.0);
        let t1 = t0 + Duration::from_millis(500);
        live.add(t1, 500.0);
        let (weight, age_ms) = live.facts(t1).expect("added");
        assert!((weight - (1.0 + (-1.0f64).exp())).abs() < 1e-12, "{weight}");
        assert_eq!(age_ms, 0.0);
        let (_, age_ms) = live.facts(t1 + Duration::from_millis(40)).expect("added");
        assert!((age_ms - 40.0).abs() < 1e-9);
    }

    #[test]
    fn a_conversation_added_late_by_a_racing_thread_does_not_move_the_instant_back() {
        let mut live = LiveCount::default();
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(300);
        live.add(t1, 1000.0);
        live.add(t0, 1000.0);
        let (weight, age_ms) = live.facts(t1).expect("added");
        assert_eq!((weight, age_ms), (2.0, 0.0));
    }

    #[test]
    fn a_conversation_lives_its_follow_ups_times_the_turn_cycle() {
        assert_eq!(conversation_life_ms(3.0, Some((800.0, 40.0))), Some(2400.0));
        assert_eq!(conversation_life_ms(0.0, Some((800.0, 40.0))), None);
        assert_eq!(conversation_life_ms(3.0, None), None);
    }

    #[test]
    fn the_turn_cycle_is_learned_from_follow_ups() {
        let s = TurnStats::default();
        assert_eq!(s.cycle(), None);
        for _ in 0..10 {
            s.observe_gap(Duration::from_millis(800));
            s.observe_prefill(40.0);
        }
        s.observe_prefill(f64::NAN);
        assert_eq!(s.cycle(), Some((800.0, 40.0)));
    }

    proptest! {
        #[test]
        fn the_cost_is_finite_and_grows_with_the_live_conversations(
            live in 0.0f64..100.0, more in 0.0f64..10.0, k in 0.0f64..16.0,
            gap in 1.0f64..1e5, s in 0.1f64..1e4,
        ) {
            let (a, own_a) = conversation_cost_ms(live, k, gap, s);
            let (b, own_b) = conversation_cost_ms(live + more, k, gap, s);
            prop_assert!(a.is_finite() && a >= 0.0 && own_a <= a + 1e-9);
            prop_assert!(b + 1e-9 >= a, "{} then {}", a, b);
            prop_assert!(own_b + 1e-9 >= own_a);
        }

        #[test]
        fn the_live_count_equals_the_literal_sum_of_each_conversations_own_fading(
            gaps in proptest::collection::vec(0u64..3_000, 1..40),
            life_ms in 1.0f64..5_000.0, after in 0u64..10_000,
        ) {
            let t0 = Instant::now();
            let mut live = LiveCount::default();
            let mut added = Vec::new();
            let mut t = t0;
            for g in gaps {
                t += Duration::from_millis(g);
                live.add(t, life_ms);
                added.push(t);
            }
            let now = t + Duration::from_millis(after);
            // The literal model: every conversation fades on its own from when it was added.
            let want: f64 = added
                .iter()
                .map(|a| (-(now - *a).as_secs_f64() * 1e3 / life_ms).exp())
                .sum();
            let got = live.count(now, life_ms);
            prop_assert!((got - want).abs() <= 1e-9 * want.max(1.0), "{} vs {}", got, want);
        }

        #[test]
        fn the_wait_is_convex_so_each_conversation_costs_more_than_the_last(
            rho in 0.0f64..3.0, d in 0.001f64..0.5, s in 0.1f64..1e3,
        ) {
            let w = |r: f64| follow_up_wait_ms(r, s);
            let (a, b, c) = (w(rho), w(rho + d), w(rho + 2.0 * d));
            prop_assert!(b >= a && c - b + 1e-9 * c.max(1.0) >= b - a, "{} {} {}", a, b, c);
        }
    }
}
