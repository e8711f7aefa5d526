//! The cache a placement destroys: how much of what a worker's engine stores re-does content it
//! evicted, learned from the worker's own events.
//!
//! Owns: per worker, an [`EvictionRate`] (a plain estimator, one of a worker's learners):
//! the running totals read from the index
//! ([`kvroute_index::EvictionStats`]: the tokens its ranks stored in their eviction group, and
//! of those the tokens stored again after their removal) and from the gateway (requests booked
//! there, [`super::registry::Worker::bookings_total`]); their growth in sums that fade by half
//! every [`HALF_LIFE_REQUESTS`] requests booked there; and the rate they give: re-stored tokens
//! per stored token. Both tokens come from the engine's one event stream, so traffic other
//! gateways send the worker counts on both sides. On a full pool each block a prefill stores
//! evicts an older one; the rate is how often what was evicted has been asked for again, so a
//! placement of `u` uncached tokens there is charged [`eviction_ms`] = `u · rate ·
//! ms_per_token` by the routing core (re-exported from `kvroute_route::terms`): the prefill
//! later requests will spend on what this one pushes out. The
//! gateway has the index keep these figures only while `weights.eviction` is on, so the rate
//! is learned only then; switching the charge on or off by a reload starts every worker's
//! model afresh (the index's list of removed blocks starts empty too, so for about one turn of
//! the pool the rate reads low).
//! Invariants: the rate is 0 until the worker has re-stored something (a pool that never
//! evicts, or evicts only what nobody asks for again, costs nothing); it is never negative and
//! never above 1 (a re-stored token was stored); it is shrunk by `B / (B + PRIOR_REQUESTS)`, B
//! the requests booked since the first reading (not faded), so a few early re-stores do not
//! read as a rate. One caller per [`REFRESH`] reads the index for a worker
//! ([`EvictionRate::claim`]), and a reading older than one already applied is dropped, so
//! readings apply in the order they were claimed; totals that go backwards (a rank dropped from
//! the index takes its share along) restart the reading.
//! Must not: read the index itself (the caller passes the totals in) or rank anything.

use kvroute_index::EvictionStats;
use serde::Serialize;
use std::time::{Duration, Instant};

/// The sums fade by half after this many requests booked on the worker: the rate follows the
/// traffic of the last few hundred requests, like the TTFT model's forgetting.
pub const HALF_LIFE_REQUESTS: f64 = 256.0;
/// The shrinkage's weight: a worker's rate counts half after this many requests (as the TTFT
/// and decode models wait for 16 answers before trusting a worker's own figures).
pub const PRIOR_REQUESTS: f64 = 16.0;
/// The index is read for a worker at most this often.
pub const REFRESH: Duration = Duration::from_millis(200);

/// A worker's re-prefill rate as a plain estimator: the faded growth of the totals it was
/// shown (one of a worker's learners, [`super::learners::Learners`], shared under the
/// worker's one lock).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvictionRate {
    /// The last totals read: (tokens restored, tokens stored, requests booked).
    last: Option<(u64, u64, u64)>,
    /// When the last reading was claimed, and when the last one applied was.
    read_at: Option<Instant>,
    applied_at: Option<Instant>,
    restored: f64,
    stored: f64,
    requests: f64,
    /// Requests booked since the first reading, not faded (the shrinkage's count).
    seen: f64,
}

/// What `GET /admin/workers` shows of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct EvictionView {
    /// Re-stored tokens per stored token, shrunk (what the charge multiplies by).
    pub restored_per_stored_token: f64,
    /// The faded sums the rate is made of.
    pub restored_tokens: f64,
    pub stored_tokens: f64,
    pub requests: f64,
    /// Requests booked since the first reading (what the shrinkage counts).
    pub requests_seen: f64,
}

impl EvictionRate {
    /// Whether the caller is to read the totals at `now`: true at most once per [`REFRESH`]
    /// (checked and marked in one step under the worker's learners' lock, so concurrent
    /// decisions do not both read).
    pub fn claim(&mut self, now: Instant) -> bool {
        let s = self;
        let due = s
            .read_at
            .is_none_or(|t| now.saturating_duration_since(t) >= REFRESH);
        if due {
            s.read_at = Some(now);
        }
        due
    }

    /// Adds the totals' growth since the last reading: the index's `stats` and `requests`
    /// booked on the worker, all running totals, read after a [`EvictionRate::claim`] at
    /// `claimed` (a reading claimed before one already applied is dropped).
    pub fn observe(&mut self, claimed: Instant, stats: EvictionStats, requests: u64) {
        let now = (stats.tokens_restored, stats.tokens_stored, requests);
        let s = self;
        if s.applied_at.is_some_and(|t| claimed <= t) {
            return;
        }
        s.applied_at = Some(claimed);
        let Some((r0, s0, q0)) = s.last.replace(now) else {
            return;
        };
        if now.0 < r0 || now.1 < s0 || now.2 < q0 {
            return;
        }
        let dq = (now.2 - q0) as f64;
        let fade = 0.5f64.powf(dq / HALF_LIFE_REQUESTS);
        s.restored = s.restored * fade + (now.0 - r0) as f64;
        s.stored = s.stored * fade + (now.1 - s0) as f64;
        s.requests = s.requests * fade + dq;
        s.seen += dq;
    }

    /// Forgets everything learned (the charge was switched on or off: the index's figures
    /// stood still meanwhile while the worker's bookings went on).
    pub fn reset(&mut self) {
        *self = EvictionRate::default();
    }

    /// Re-stored tokens per stored token, shrunk by the requests seen.
    pub fn rate(&self) -> f64 {
        let s = self;
        rate_of(s.restored, s.stored, s.seen)
    }

    pub fn view(&self) -> EvictionView {
        let s = self;
        EvictionView {
            restored_per_stored_token: rate_of(s.restored, s.stored, s.seen),
            restored_tokens: s.restored,
            stored_tokens: s.stored,
            requests: s.requests,
            requests_seen: s.seen,
        }
    }
}

fn rate_of(restored: f64, stored: f64, seen: f64) -> f64 {
    if restored <= 0.0 || stored <= 0.0 || seen <= 0.0 {
        return 0.0;
    }
    let rate = restored / stored * seen / (seen + PRIOR_REQUESTS);
    if rate.is_finite() {
        rate.clamp(0.0, 1.0)
    } else {
        0.0
    }
}
pub use kvroute_route::terms::eviction_ms;

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds a reading claimed just after the previous one.
    fn observe(m: &mut EvictionRate, stats: EvictionStats, requests: u64) {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::OnceLock;
        static TICKS: AtomicU64 = AtomicU64::new(1);
        static BASE: OnceLock<Instant> = OnceLock::new();
        let base = *BASE.get_or_init(Instant::now);
        let ms = TICKS.fetch_add(1, Ordering::Relaxed);
        m.observe(base + Duration::from_millis(ms), stats, requests);
    }

    fn stats(tokens_stored: u64, tokens_restored: u64) -> EvictionStats {
        EvictionStats {
            tokens_stored,
            tokens_restored,
        }
    }

    #[test]
    fn a_pool_that_never_re_stores_costs_nothing() {
        let mut m = EvictionRate::default();
        observe(&mut m, stats(0, 0), 0);
        observe(&mut m, stats(500_000, 0), 1_000);
        assert_eq!(m.rate(), 0.0);
        assert_eq!(eviction_ms(2000.0, m.rate(), 0.06), 0.0);
    }

    #[test]
    fn a_reset_model_takes_its_next_reading_as_a_baseline_not_as_growth() {
        let mut m = EvictionRate::default();
        observe(&mut m, stats(1_000, 100), 3);
        observe(&mut m, stats(5_000, 1_100), 19);
        assert!(m.rate() > 0.0);
        m.reset();
        assert_eq!(m.view(), EvictionView::default());
        // The totals stood still while the worker booked 5,000 requests: no growth, no fade.
        observe(&mut m, stats(5_000, 1_100), 5_019);
        assert_eq!(m.view(), EvictionView::default());
        observe(&mut m, stats(9_000, 2_100), 5_035);
        assert!((m.rate() - 0.125).abs() < 1e-12);
    }

    #[test]
    fn the_rate_is_re_stored_over_stored_tokens_shrunk_by_the_requests_seen() {
        let mut m = EvictionRate::default();
        observe(&mut m, stats(1_000, 100), 3);
        // The first reading only sets the baseline.
        assert_eq!(m.rate(), 0.0);
        observe(&mut m, stats(5_000, 1_100), 19);
        // 1,000 of 4,000 tokens re-stored over 16 requests: a quarter, counted half.
        assert!((m.rate() - 0.125).abs() < 1e-12);
        observe(&mut m, stats(50_000, 1_100), 19 + 10_000);
        assert!(m.rate() < 1e-9, "old re-stores fade under new stores");
        assert!((eviction_ms(400.0, 0.25, 0.05) - 5.0).abs() < 1e-12);
    }

    #[test]
    fn old_traffic_fades_by_half_after_the_half_life() {
        let mut m = EvictionRate::default();
        let life = HALF_LIFE_REQUESTS as u64;
        observe(&mut m, stats(0, 0), 0);
        observe(&mut m, stats(1_000, 1_000), 0);
        // A half-life of requests storing nothing halves the old sums.
        observe(&mut m, stats(1_000, 1_000), life);
        let v = m.view();
        assert!((v.restored_tokens - 500.0).abs() < 1e-6);
        assert!((v.stored_tokens - 500.0).abs() < 1e-6);
        assert!((v.requests - life as f64).abs() < 1e-6);
    }

    #[test]
    fn totals_that_go_backwards_restart_the_reading() {
        let mut m = EvictionRate::default();
        observe(&mut m, stats(1_000, 500), 10);
        observe(&mut m, stats(20, 10), 10);
        assert_eq!(m.view().stored_tokens, 0.0);
        observe(&mut m, stats(120, 20), 10 + 1_000_000);
        assert!((m.rate() - 0.1).abs() < 1e-5);
    }

    #[test]
    fn the_rate_never_leaves_zero_to_one_and_the_charge_is_never_negative() {
        assert_eq!(rate_of(10.0, 1.0, 1e12), 1.0);
        assert_eq!(rate_of(-1.0, 1.0, 1.0), 0.0);
        assert_eq!(rate_of(1.0, 0.0, 1.0), 0.0);
        assert_eq!(rate_of(f64::INFINITY, 1.0, 1.0), 0.0);
        assert_eq!(eviction_ms(-5.0, 0.5, 0.1), 0.0);
        assert_eq!(eviction_ms(f64::INFINITY, 0.5, 0.1), 0.0);
    }

    #[test]
    fn a_reading_claimed_before_one_already_applied_is_dropped() {
        let mut m = EvictionRate::default();
        let t = Instant::now();
        m.observe(t, stats(0, 0), 0);
        m.observe(t + REFRESH * 2, stats(1_000, 500), 100);
        // A slow reader claimed in between and read older totals: applying them would look
        // like totals going backwards and count the gap twice.
        m.observe(t + REFRESH, stats(400, 200), 40);
        let v = m.view();
        assert_eq!((v.stored_tokens, v.restored_tokens), (1_000.0, 500.0));
        assert_eq!(v.requests_seen, 100.0);
    }

    #[test]
    fn one_caller_reads_the_index_per_refresh_interval() {
        let mut m = EvictionRate::default();
        let t = Instant::now();
        assert!(m.claim(t));
        assert!(
            !m.claim(t),
            "a second decision at the same moment does not read again"
        );
        assert!(!m.claim(t + REFRESH / 2));
        assert!(m.claim(t + REFRESH));
    }
}
