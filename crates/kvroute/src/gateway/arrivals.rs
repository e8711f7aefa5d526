//! Arrivals: how fast requests reach a worker, and the wait a request's prefill adds to the
//! requests that will queue behind it.
//!
//! Owns: [`Arrivals`], a worker's request rate (an exponentially weighted mean of the gaps
//! between the requests routed to it, on the gateway's monotonic clock; a worker that has
//! gone quiet for longer than its mean gap is credited with the quiet time instead), and
//! [`delay_to_others_ms`], the externality the cost model adds to a candidate. An engine
//! schedules waiting requests first come, first served (vLLM's scheduler: running requests,
//! then the waiting queue in order), so a request's own prefill delays every request that
//! reaches the same worker before its first token — about `rate × predicted TTFT` of them.
//! A placement that re-prefills a long history on a busy pool makes those
//! requests wait; one that reuses the history does not. The count leaves out requests
//! arriving after the first token while the queue it lengthened drains, so the charge is a
//! lower bound of the total delay (exact as load goes to zero, an underestimate near
//! saturation).
//! Invariants: the rate is 0 until two requests were seen, finite, and never negative; the
//! externality is 0 when the request adds no prefill, and grows with the prefill, the rate
//! and the time it stays ahead.
//! Must not: read the index or workers; it sees decision times and numbers the caller
//! computed.

use parking_lot::Mutex;
use std::time::Instant;

/// Weight of the newest gap: about the last 64 requests, a second or less at the loads where
/// the charge matters (tens of requests per second), so a burst is seen within it.
pub const GAP_WEIGHT: f64 = 1.0 / 64.0;

#[derive(Debug, Default)]
struct Inner {
    last: Option<Instant>,
    /// Weighted mean gap between requests (ms); `None` until the second request.
    gap_ms: Option<f64>,
}

/// One worker's request rate.
#[derive(Debug, Default)]
pub struct Arrivals {
    inner: Mutex<Inner>,
}

impl Arrivals {
    /// Records a request routed at `now`.
    pub fn observe(&self, now: Instant) {
        let mut g = self.inner.lock();
        if let Some(last) = g.last {
            let gap = now.saturating_duration_since(last).as_secs_f64() * 1e3;
            g.gap_ms = Some(match g.gap_ms {
                Some(m) => m + GAP_WEIGHT * (gap - m),
                None => gap,
            });
        }
        g.last = Some(now.max(g.last.unwrap_or(now)));
    }

    /// Requests per millisecond reaching the worker at `now`: the inverse of the mean gap, or
    /// of the time since the last request where that is longer (0 until two were seen, or
    /// when they came at the same instant every time: no gap to measure).
    pub fn per_ms(&self, now: Instant) -> f64 {
        let g = self.inner.lock();
        let quiet = g.last.map_or(0.0, |l| {
            now.saturating_duration_since(l).as_secs_f64() * 1e3
        });
        match g.gap_ms {
            Some(m) if m > 0.0 && m.is_finite() => 1.0 / m.max(quiet),
            _ => 0.0,
        }
    }
}

/// The wait a request's own prefill (`own_ms`, milliseconds of the worker's time) adds to
/// the requests reaching its worker (`per_ms` requests per millisecond) before its first
/// token, `ttft_ms` from now: `own_ms × per_ms × ttft_ms`.
pub fn delay_to_others_ms(own_ms: f64, per_ms: f64, ttft_ms: f64) -> f64 {
    let x = own_ms.max(0.0) * per_ms.max(0.0) * ttft_ms.max(0.0);
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    #[test]
    fn the_rate_is_the_inverse_of_the_mean_gap_between_requests() {
        let a = Arrivals::default();
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
        let a = Arrivals::default();
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
        let a = Arrivals::default();
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

    proptest! {
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
        fn the_rate_equals_the_literal_weighted_mean_of_the_gaps(
            gaps in proptest::collection::vec(0u64..1000, 1..100),
        ) {
            let a = Arrivals::default();
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
