//! The engines' own load figures, polled from every worker's `/metrics`.
//!
//! Owns: the parsing of vLLM's `vllm:num_requests_running`, `vllm:num_requests_waiting` and
//! `vllm:kv_cache_usage_perc` (summed, or for the usage averaged, over the engine's DP ranks
//! and label sets), and the [`EngineLoad`] snapshot a
//! worker keeps: the figures and what this gateway itself had in flight there when they were
//! read. A gateway sees only what it sent; replicas of it in front of the same fleet correct
//! their own bookings with these figures ([`EngineLoad::running_estimate`]). The poll loop is
//! [`super::engine_poll`]'s (this module imports no other gateway module: the registry keeps
//! an [`EngineLoad`] per worker).
//! Invariants: a failed or unparsable poll leaves the last figures in place and marks them
//! stale after [`STALE_AFTER_POLLS`] intervals, so a silent engine falls back to the gateway's own count;
//! negative or non-finite figures are ignored.
//! Must not: do I/O, mark workers unhealthy (the health check does) or touch the index.

use serde::Serialize;
use std::time::{Duration, Instant};

/// Intervals after which figures not refreshed no longer count.
pub const STALE_AFTER_POLLS: u32 = 5;

/// What the engine last reported, and when.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct EngineLoad {
    pub running: u64,
    pub waiting: u64,
    /// Fraction of the KV cache in use by requests (0–1), when reported.
    pub kv_cache_usage: Option<f64>,
    /// This gateway's requests in flight on the worker when the figures were read.
    #[serde(skip)]
    pub own_in_flight_at_poll: u64,
    /// This gateway's requests there still before their first byte, likewise.
    #[serde(skip)]
    pub own_prefilling_at_poll: u64,
    #[serde(skip)]
    pub polled_at: Option<Instant>,
    /// The poll interval the figures were read under.
    #[serde(skip)]
    pub interval: Duration,
    pub polls: u64,
    pub failed_polls: u64,
}

impl EngineLoad {
    /// Whether the figures are recent enough to use.
    pub fn fresh(&self, now: Instant) -> bool {
        self.polled_at
            .is_some_and(|t| now.saturating_duration_since(t) <= self.interval * STALE_AFTER_POLLS)
    }

    /// Requests running or waiting on the worker, all senders together: the engine's figure
    /// plus what this gateway sent there since it was read (less what finished), never below
    /// this gateway's own count.
    pub fn running_estimate(&self, own_now: u64, fresh: bool) -> u64 {
        if !fresh {
            return own_now;
        }
        let engine = self.running + self.waiting;
        let since = own_now as i64 - self.own_in_flight_at_poll as i64;
        let est = (engine as i64 + since).max(0) as u64;
        est.max(own_now)
    }
}

/// The sum of every sample of `name` (any labels) in a Prometheus text exposition, and how
/// many samples there were; `None` if there is none.
pub fn metric_samples(text: &str, name: &str) -> Option<(f64, usize)> {
    let mut sum = 0.0;
    let mut n = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // `name{labels} v` or `name v`; not `name_total` and the like.
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            sum += v;
            n += 1;
        }
    }
    (n > 0).then_some((sum, n))
}

/// Reads one exposition into `load` (figures absent from it keep their last values).
pub fn apply_metrics(
    load: &mut EngineLoad,
    text: &str,
    own_in_flight: u64,
    now: Instant,
    interval: Duration,
) -> bool {
    let running = metric_samples(text, "vllm:num_requests_running");
    let waiting = metric_samples(text, "vllm:num_requests_waiting");
    let usage = metric_samples(text, "vllm:kv_cache_usage_perc");
    if running.is_none() && waiting.is_none() {
        return false;
    }
    if let Some((v, _)) = running {
        load.running = v as u64;
    }
    if let Some((v, _)) = waiting {
        load.waiting = v as u64;
    }
    if let Some((v, n)) = usage {
        load.kv_cache_usage = Some((v / n as f64).min(1.0));
    }
    load.own_in_flight_at_poll = own_in_flight;
    load.polled_at = Some(now);
    load.interval = interval;
    load.polls += 1;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const HALF: Duration = Duration::from_millis(500);

    #[test]
    fn figures_are_summed_over_ranks_and_usage_is_averaged() {
        let t = "# HELP x\nvllm:num_requests_running{engine=\"0\"} 2.0\n\
                 vllm:num_requests_running{engine=\"1\"} 3\nvllm:num_requests_running_total 9\n\
                 vllm:num_requests_waiting{engine=\"0\"} 4\n\
                 vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n";
        assert_eq!(
            metric_samples(t, "vllm:num_requests_running"),
            Some((5.0, 2))
        );
        let mut l = EngineLoad::default();
        assert!(apply_metrics(&mut l, t, 1, Instant::now(), HALF));
        assert_eq!((l.running, l.waiting), (5, 4));
        assert_eq!(l.kv_cache_usage, Some(0.375));
    }

    #[test]
    fn garbage_figures_are_ignored_and_leave_the_last_ones() {
        let mut l = EngineLoad::default();
        let now = Instant::now();
        apply_metrics(&mut l, "vllm:num_requests_running 3\n", 0, now, HALF);
        for bad in [
            "",
            "vllm:num_requests_running NaN\n",
            "vllm:num_requests_running -4\n",
            "vllm:num_requests_running{x=\"1\"} lots\n",
            "\u{0}\u{ff}garbage",
        ] {
            assert!(!apply_metrics(&mut l, bad, 0, now, HALF), "{bad:?}");
            assert_eq!(l.running, 3);
        }
    }

    #[test]
    fn a_replica_counts_what_others_sent_plus_what_it_sent_since_the_poll() {
        let now = Instant::now();
        let mut l = EngineLoad::default();
        // The engine runs 10; this gateway had 4 of them in flight when it asked.
        apply_metrics(
            &mut l,
            "vllm:num_requests_running 7\nvllm:num_requests_waiting 3\n",
            4,
            now,
            HALF,
        );
        let fresh = l.fresh(now);
        assert!(fresh);
        // Since then it sent 2 more: 12 in all.
        assert_eq!(l.running_estimate(6, fresh), 12);
        // Two of its own finished: 8.
        assert_eq!(l.running_estimate(2, fresh), 8);
        // Never below its own count.
        assert_eq!(l.running_estimate(20, fresh), 26);
        // Stale figures: its own count only.
        let later = now + Duration::from_secs(10);
        assert!(!l.fresh(later));
        assert_eq!(l.running_estimate(3, false), 3);
    }
}
