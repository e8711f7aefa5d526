//! Arrivals: how fast requests reach a worker, and the wait a request's prefill adds to the
//! requests that will queue behind it.
//!
//! Owns: [`RequestRate`], a worker's request rate as a plain estimator (an exponentially
//! weighted mean of the gaps between the requests routed to it, on the gateway's monotonic
//! clock; a worker that has gone quiet for longer than its mean gap is credited with the quiet
//! time instead), one of a worker's learners; [`LeastLoadedShare`], the share of the fleet's
//! requests that went to the worker whose load made them wait least (a plain estimator, shared
//! as [`LeastLoaded`]). The two externalities
//! the routing core prices from them (`kvroute_route::terms`, re-exported here) are:
//! - [`delay_to_others_ms`]: an engine schedules waiting requests first come, first served
//!   (vLLM's scheduler: running requests, then the waiting queue in order), so a request's own
//!   prefill delays every request that reaches the same worker before its first token — about
//!   `rate × predicted TTFT` of them. A placement that re-prefills a long history on a busy
//!   pool makes those requests wait; one that reuses the history does not. The count leaves
//!   out requests arriving after the first token while the queue it lengthened drains, so the
//!   charge is a lower bound of the total delay (exact as load goes to zero, an underestimate
//!   near saturation).
//! - [`next_arrivals_ms`]: a request with no cached prefix anywhere goes where it waits least,
//!   so the requests reaching the fleet while its least-loaded worker drains each wait what is
//!   left of that worker's queue: `λ·m²/2` in all, λ the fleet's rate and `m` the smallest
//!   wait. A placement on that worker raises `m`; one anywhere else leaves it. Long prompts
//!   are then charged for taking the last idle worker from the short ones behind them, short
//!   ones hardly at all (their own work is small). Not every request goes where the wait is
//!   least (a cached prompt goes to its holder; a charged long prompt queues elsewhere), so λ
//!   is the fleet's rate times the share that did ([`LeastLoadedShare`]). Only the arrivals
//!   after the next one make the charge worth paying: counting the next one alone, the charge
//!   is at most `m' − m`, no more than the placement elsewhere costs the request itself, and
//!   would never move it.
//!
//! Invariants: the rate is 0 until two requests were seen, finite, and never negative; both
//! externalities are 0 when the request adds no prefill, never negative, finite, and grow with
//! the prefill and the rate (the core's tests and the ones below).
//! Must not: read the index, workers or the clock; it sees decision times and numbers the
//! caller computed (the wrappers only lock).

use parking_lot::Mutex;
use std::time::Instant;

/// Weight of the newest gap: about the last 64 requests, a second or less at the loads where
/// the charge matters (tens of requests per second), so a burst is seen within it.
pub const GAP_WEIGHT: f64 = 1.0 / 64.0;

/// A worker's request rate as a plain estimator: the weighted mean gap between the requests
/// routed there and when the last came (one of a worker's learners,
/// [`super::learners::Learners`], shared under the worker's one lock).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestRate {
    last: Option<Instant>,
    /// Weighted mean gap between requests (ms); `None` until the second request.
    gap_ms: Option<f64>,
}

impl RequestRate {
    /// Records a request routed at `now`.
    pub fn observe(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let gap = now.saturating_duration_since(last).as_secs_f64() * 1e3;
            self.gap_ms = Some(weighted(self.gap_ms, gap));
        }
        self.last = Some(now.max(self.last.unwrap_or(now)));
    }

    /// Requests per millisecond reaching the worker at `now`: the inverse of the mean gap, or
    /// of the time since the last request where that is longer (0 until two were seen, or
    /// when they came at the same instant every time: no gap to measure).
    pub fn per_ms(&self, now: Instant) -> f64 {
        let quiet = self.last.map_or(0.0, |l| {
            now.saturating_duration_since(l).as_secs_f64() * 1e3
        });
        match self.gap_ms {
            Some(m) if m > 0.0 && m.is_finite() => 1.0 / m.max(quiet),
            _ => 0.0,
        }
    }
}

/// One step of the exponentially weighted mean (weight [`GAP_WEIGHT`]); the first value
/// starts it.
fn weighted(mean: Option<f64>, x: f64) -> f64 {
    match mean {
        Some(m) => m + GAP_WEIGHT * (x - m),
        None => x,
    }
}

/// The share of routed requests that went to a worker whose load made them wait least (no
/// candidate's load wait below the chosen one's) as a plain estimator: an exponentially
/// weighted mean over the fleet's requests (weight [`GAP_WEIGHT`]); 1 until the first request
/// ([`LeastLoaded`] shares one between threads).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LeastLoadedShare {
    mean: Option<f64>,
}

impl LeastLoadedShare {
    /// Records a request that went to the worker whose load adds `chosen_ms` of wait, where
    /// the least any candidate's load added was `least_ms` (a wait that is not a number is
    /// not the least).
    pub fn observe(&mut self, chosen_ms: f64, least_ms: f64) {
        let x = if chosen_ms <= least_ms { 1.0 } else { 0.0 };
        self.mean = Some(weighted(self.mean, x));
    }

    /// The share, in `[0, 1]`; 1 before any request (every arrival then counts).
    pub fn share(&self) -> f64 {
        self.mean.unwrap_or(1.0)
    }
}

/// The fleet's [`LeastLoadedShare`], shared by the decisions that record and read it.
#[derive(Debug, Default)]
pub struct LeastLoaded {
    inner: Mutex<LeastLoadedShare>,
}

impl LeastLoaded {
    /// [`LeastLoadedShare::observe`].
    pub fn observe(&self, chosen_ms: f64, least_ms: f64) {
        self.inner.lock().observe(chosen_ms, least_ms);
    }

    /// [`LeastLoadedShare::share`].
    pub fn share(&self) -> f64 {
        self.inner.lock().share()
    }
}

pub use kvroute_route::terms::{delay_to_others_ms, next_arrivals_ms};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    #[test]
    fn the_rate_is_the_inverse_of_the_mean_gap_between_requests() {
        let mut a = RequestRate::default();
        let t0 = Instant::now();
        assert_eq!(a.per_ms(t0), 0.0);
        a.observe(t0);
        assert_eq!(a.per_ms(t0), 0.0, "one request has no gap");
        for i in 1..=200u64 {
            a.observe(t0 + Duration::from_millis(20 * i));
        }
        let last = t0 + Duration::from_millis(4000);
        assert!((a.per_ms(last) - 0.05).abs() < 1e-9, "{}", a.per_ms(last));
        // Quiet for a second: at most one request a second.
        let quiet = last + Duration::from_millis(1000);
        assert!((a.per_ms(quiet) - 0.001).abs() < 1e-12);
    }

    #[test]
    fn a_faster_stream_is_followed_within_a_few_hundred_requests() {
        let mut a = RequestRate::default();
        let t0 = Instant::now();
        let mut t = t0;
        for _ in 0..100 {
            t += Duration::from_millis(100);
            a.observe(t);
        }
        for _ in 0..400 {
            t += Duration::from_millis(10);
            a.observe(t);
        }
        assert!((a.per_ms(t) - 0.1).abs() < 0.01, "{}", a.per_ms(t));
    }

    #[test]
    fn requests_at_the_same_instant_have_no_rate() {
        let mut a = RequestRate::default();
        let t0 = Instant::now();
        a.observe(t0);
        a.observe(t0);
        assert_eq!(a.per_ms(t0), 0.0);
    }

    #[test]
    fn a_request_that_adds_no_prefill_delays_nobody() {
        assert_eq!(delay_to_others_ms(0.0, 0.01, 500.0), 0.0);
        assert_eq!(delay_to_others_ms(100.0, 0.0, 500.0), 0.0);
        // 100 ms of prefill, 4 requests a second reaching the worker, 500 ms ahead of them:
        // two requests wait 100 ms each.
        assert!((delay_to_others_ms(100.0, 0.004, 500.0) - 200.0).abs() < 1e-9);
        assert_eq!(delay_to_others_ms(f64::INFINITY, 1.0, 1.0), 0.0);
    }

    /// The literal model: the next arrivals' total wait, `per_ms · ∫ min_i (waits_i − t)⁺ dt`,
    /// summed in steps of `h` ms (the midpoint of each step).
    fn waiting_of_the_next_arrivals(waits: &[f64], per_ms: f64, h: f64) -> f64 {
        let end = waits.iter().cloned().fold(0.0, f64::max);
        let mut total = 0.0;
        let mut t = h / 2.0;
        while t < end {
            let least = waits
                .iter()
                .map(|w| (w - t).max(0.0))
                .fold(f64::INFINITY, f64::min);
            total += per_ms * least * h;
            t += h;
        }
        total
    }

    #[test]
    fn the_least_loaded_share_is_the_weighted_mean_of_requests_that_took_the_least_wait() {
        let mut c = LeastLoadedShare::default();
        assert_eq!(c.share(), 1.0, "before any request every arrival counts");
        c.observe(0.0, 0.0);
        assert_eq!(c.share(), 1.0, "a tie for the least wait is the least wait");
        c.observe(120.0, 40.0);
        assert!((c.share() - (1.0 - GAP_WEIGHT)).abs() < 1e-12);
        c.observe(f64::NAN, 0.0);
        assert!(
            (c.share() - (1.0 - GAP_WEIGHT) * (1.0 - GAP_WEIGHT)).abs() < 1e-12,
            "a wait that is not a number is not the least"
        );
        for _ in 0..2000 {
            c.observe(50.0, 10.0);
        }
        assert!(c.share() < 1e-9, "{}", c.share());
        for _ in 0..2000 {
            c.observe(10.0, 10.0);
        }
        assert!(c.share() > 1.0 - 1e-9, "{}", c.share());
    }

    #[test]
    fn the_shared_least_loaded_share_is_the_plain_one_behind_a_lock() {
        let (shared, mut plain) = (LeastLoaded::default(), LeastLoadedShare::default());
        assert_eq!(shared.share(), plain.share());
        for (chosen, least) in [(0.0, 0.0), (5.0, 1.0), (2.0, 2.0), (f64::NAN, 0.0)] {
            shared.observe(chosen, least);
            plain.observe(chosen, least);
        }
        assert_eq!(shared.share(), plain.share());
    }

    #[test]
    fn a_worker_gone_quiet_is_credited_with_the_quiet_time() {
        let mut r = RequestRate::default();
        let t0 = Instant::now();
        r.observe(t0);
        r.observe(t0 + Duration::from_millis(10));
        let t1 = t0 + Duration::from_millis(10);
        assert!((r.per_ms(t1) - 0.1).abs() < 1e-12);
        // Shorter quiet than the mean gap: the mean gap stands.
        assert!((r.per_ms(t1 + Duration::from_millis(5)) - 0.1).abs() < 1e-12);
        assert!((r.per_ms(t1 + Duration::from_millis(40)) - 0.025).abs() < 1e-12);
    }

    #[test]
    fn taking_the_last_idle_worker_charges_the_arrivals_that_would_have_used_it() {
        // Three workers busy for 300, 400 and 500 ms, one idle; 10 requests a second.
        let waits = [300.0, 400.0, 500.0, 0.0];
        // 570 ms of prefill on the idle worker: the next arrivals now find at best 300 ms
        // left, 0.01 · 300² / 2 = 450 ms of waiting in all.
        assert!((next_arrivals_ms(&waits, 3, 570.0, 0.01) - 450.0).abs() < 1e-9);
        // On a busy worker it leaves the idle one to them.
        assert_eq!(next_arrivals_ms(&waits, 0, 570.0, 0.01), 0.0);
        // A 5 ms prompt on the idle worker costs them 0.01 · 25 / 2.
        assert!((next_arrivals_ms(&waits, 3, 5.0, 0.01) - 0.125).abs() < 1e-12);
        // Nobody arriving, no prefill, or no worker: no charge.
        assert_eq!(next_arrivals_ms(&waits, 3, 570.0, 0.0), 0.0);
        assert_eq!(next_arrivals_ms(&waits, 3, 0.0, 0.01), 0.0);
        assert_eq!(next_arrivals_ms(&[], 0, 570.0, 0.01), 0.0);
        // A wait that is not a number is no worker: the one left is the least loaded.
        assert!((next_arrivals_ms(&[f64::NAN, 0.0], 1, 10.0, 0.01) - 0.5).abs() < 1e-12);
        assert_eq!(next_arrivals_ms(&waits, 3, f64::INFINITY, 0.01), 0.0);
    }

    proptest! {
        #[test]
        fn the_next_arrivals_charge_equals_the_literal_waiting_it_adds(
            waits in proptest::collection::vec(0.0f64..1000.0, 1..6),
            pick in 0usize..6, own in 0.0f64..1000.0, per_ms in 0.0f64..0.05,
        ) {
            let at = pick % waits.len();
            let mut after = waits.clone();
            after[at] += own;
            let h = 0.5;
            let want = waiting_of_the_next_arrivals(&after, per_ms, h)
                - waiting_of_the_next_arrivals(&waits, per_ms, h);
            let got = next_arrivals_ms(&waits, at, own, per_ms);
            // The integrand is linear but where the least wait runs out: the midpoint sum is
            // off by at most per_ms · h² / 8 there, in each of the two sums.
            let tolerance = per_ms * h * h / 4.0 + 1e-9;
            prop_assert!((got - want).abs() <= tolerance, "{got} vs {want}");
            prop_assert!(got >= 0.0 && got.is_finite());
            prop_assert!(next_arrivals_ms(&waits, at, own + 10.0, per_ms) >= got);
            prop_assert!(next_arrivals_ms(&waits, at, own, per_ms * 2.0) >= got);
        }

        #[test]
        fn the_delay_grows_with_the_prefill_the_rate_and_the_time_ahead(
            own in 0.0f64..1e4, rate in 0.0f64..1.0, ttft in 0.0f64..1e4, more in 0.0f64..1e3,
        ) {
            let d = delay_to_others_ms(own, rate, ttft);
            prop_assert!(d >= 0.0 && d.is_finite());
            prop_assert!(delay_to_others_ms(own + more, rate, ttft) >= d);
            prop_assert!(delay_to_others_ms(own, rate + more / 1e3, ttft) >= d);
            prop_assert!(delay_to_others_ms(own, rate, ttft + more) >= d);
        }

        #[test]
        fn the_least_loaded_share_equals_the_literal_weighted_mean_and_stays_a_share(
            rows in proptest::collection::vec((0.0f64..100.0, 0.0f64..100.0), 0..300),
        ) {
            let mut c = LeastLoadedShare::default();
            let mut want: Option<f64> = None;
            for (chosen, other) in &rows {
                let least = chosen.min(*other);
                c.observe(*chosen, least);
                let x = if chosen <= other { 1.0 } else { 0.0 };
                want = Some(match want { Some(m) => m + GAP_WEIGHT * (x - m), None => x });
            }
            let got = c.share();
            prop_assert!((got - want.unwrap_or(1.0)).abs() < 1e-12, "{} vs {:?}", got, want);
            prop_assert!((0.0..=1.0).contains(&got));
        }

        #[test]
        fn the_rate_equals_the_literal_weighted_mean_of_the_gaps(
            gaps in proptest::collection::vec(0u64..1000, 1..100),
        ) {
            let mut a = RequestRate::default();
            let t0 = Instant::now();
            let mut t = t0;
            a.observe(t);
            let mut mean: Option<f64> = None;
            for g in &gaps {
                t += Duration::from_millis(*g);
                a.observe(t);
                let g = *g as f64;
                mean = Some(match mean { Some(m) => m + GAP_WEIGHT * (g - m), None => g });
            }
            let m = mean.unwrap_or(0.0);
            let want = if m > 0.0 { 1.0 / m } else { 0.0 };
            prop_assert!((a.per_ms(t) - want).abs() <= 1e-9 * want.max(1.0));
        }
    }
}
