//! A worker's learners, held together: what the gateway has learned about one worker, as plain
//! estimators in one struct, so a decision reads all of them under one lock.
//!
//! Owns: [`Learners`] (the worker's TTFT fit and load wait, its decode fit and recent running
//! count, its live conversations, its request rate and its re-prefill rate: each the plain
//! estimator of its own module; and the fleet's placement count at its last decision sample,
//! which weighs the next), [`Lent`] (what the fleet's models lend a worker that has not
//! learned its own yet, read once per decision) and [`Readings`] (every learned figure a
//! decision takes from one worker, at one instant).
//! Invariants: a worker's learners live behind exactly one lock ([`super::registry::Worker`]'s
//! `learners`), so a decision's readings of one worker are one consistent cut; a reading
//! changes nothing; each figure equals what its estimator answers alone (tested below).
//! Must not: read a clock, the index or another worker; hold a lock itself (the worker's
//! `Mutex` is the shared wrapper); price anything (the routing core does).

use super::arrivals::RequestRate;
use super::conversations::LiveCount;
use super::decoding::{DecodeEstimate, DecodeModel};
use super::eviction::EvictionRate;
use super::ttft::{wait_weight, TtftEstimate, TtftModel};
use kvroute_route::Fit;
use std::time::Instant;

/// One worker's learners as plain estimators.
#[derive(Clone, Debug, Default)]
pub struct Learners {
    /// Its TTFT, learned from what it answered, and the wait its load recently added.
    pub ttft: TtftEstimate,
    /// Its inter-token latency against the requests running there ([`super::decoding`]).
    pub decode: DecodeEstimate,
    /// The conversations living here (started or moved here, fading with their expected life).
    pub live: LiveCount,
    /// The rate of requests routed here (the delay-to-others charge).
    pub arrivals: RequestRate,
    /// How much of what its engine stores re-does content it evicted (the eviction charge).
    pub eviction: EvictionRate,
    /// The fleet's placement count at the last decision's sample ([`Learners::sample`]).
    sampled_at: u64,
}

/// What the fleet's models lend a worker without its own: the fleet's TTFT fit and decode δ,
/// read once per decision (not once per candidate).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Lent {
    pub ttft: Fit,
    pub decode_delta_ms: f64,
}

impl Lent {
    /// The fleet's models as they stand now.
    pub fn of(ttft: &TtftModel, decode: &DecodeModel) -> Lent {
        Lent {
            ttft: ttft.fit(),
            decode_delta_ms: decode.lent_delta(),
        }
    }
}

/// Every learned figure a decision takes from one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Readings {
    /// The TTFT fit predictions use (the worker's own once learned, else the fleet's).
    pub ttft: Fit,
    /// Requests per millisecond routed there lately.
    pub arrivals_per_ms: f64,
    /// The conversations added there and how long ago the last was (ms), before fading.
    pub live: Option<(f64, f64)>,
    /// The wait its load recently added to requests sent there (ms).
    pub load_wait_ms: f64,
    /// δ: what one more running request adds to each decoded token there (ms).
    pub decode_delta_ms: f64,
    /// The requests recently running there.
    pub mean_running: f64,
    /// Its re-prefill rate.
    pub eviction_rate: f64,
}

impl Learners {
    /// The worker's figures at `now`, the fleet's `lent` ones where it has not learned its own.
    pub fn readings(&self, now: Instant, lent: &Lent) -> Readings {
        Readings {
            ttft: self.ttft.fit_or(lent.ttft),
            arrivals_per_ms: self.arrivals.per_ms(now),
            live: self.live.facts(now),
            load_wait_ms: self.ttft.load_wait_ms(),
            decode_delta_ms: self.decode.delta(lent.decode_delta_ms),
            mean_running: self.decode.mean_running(),
            eviction_rate: self.eviction.rate(),
        }
    }

    /// One routing decision's sample of the worker: the wait its load adds to a request sent
    /// there now and the requests running there (every candidate alike), when the fleet had
    /// made `placements` placements (the registry's count, peers' included) and `replicas`
    /// gateways share the traffic (this one and the peers heard from): weighed by the
    /// placements made since the last sample, at most `replicas` ([`wait_weight`]), so a
    /// replica that decides one request in N averages over the same stretch of traffic as one
    /// that decides them all, and one gateway weighs every sample alike (a worker sampled
    /// rarely, as one serving a model with little traffic, is not weighed by the others').
    pub fn sample(&mut self, load_wait_ms: f64, running: f64, placements: u64, replicas: u64) {
        let since = placements.saturating_sub(self.sampled_at);
        let weight = wait_weight(since.min(replicas));
        self.sampled_at = self.sampled_at.max(placements);
        self.ttft.sample_load_wait(load_wait_ms, weight);
        self.decode.sample_running(running, weight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::ttft::{Work, OWN_MODEL_AFTER};
    use std::time::Duration;

    /// Learners that have seen a little of everything.
    fn taught(t0: Instant, answers: u64) -> Learners {
        let mut l = Learners::default();
        for k in 0..answers {
            let w = Work::new(100 * k, 0, 500 + 20 * (k % 9), k % 4);
            l.ttft
                .observe(&w, 9.0 + 0.03 * (w.own_tokens + w.queued_tokens) as f64);
            l.decode
                .observe(2.0, (k % 4) as f64, 5.0 + 0.4 * (k % 4) as f64);
        }
        for ms in [0, 40, 90] {
            l.arrivals.observe(t0 + Duration::from_millis(ms));
        }
        l.live.add(t0 + Duration::from_millis(90), 2_000.0);
        l.sample(35.0, 3.0, 1, 1);
        l
    }

    #[test]
    fn each_reading_is_what_its_estimator_answers_alone() {
        let t0 = Instant::now();
        let l = taught(t0, OWN_MODEL_AFTER);
        let lent = Lent {
            ttft: Fit([1.0, 2.0, 3.0, 4.0]),
            decode_delta_ms: 0.7,
        };
        let now = t0 + Duration::from_millis(150);
        let r = l.readings(now, &lent);
        assert_eq!(r.ttft, l.ttft.fit());
        assert_eq!(r.arrivals_per_ms, l.arrivals.per_ms(now));
        assert_eq!(r.live, l.live.facts(now));
        assert_eq!(r.load_wait_ms, l.ttft.load_wait_ms());
        assert_eq!(r.decode_delta_ms, l.decode.ms_per_running());
        assert_eq!(r.mean_running, l.decode.mean_running());
        assert_eq!(r.eviction_rate, l.eviction.rate());
    }

    #[test]
    fn a_worker_that_has_not_learned_its_own_models_reads_the_fleets() {
        let t0 = Instant::now();
        let l = taught(t0, OWN_MODEL_AFTER - 1);
        let lent = Lent {
            ttft: Fit([1.0, 2.0, 3.0, 4.0]),
            decode_delta_ms: 0.7,
        };
        let r = l.readings(t0, &lent);
        assert_eq!(r.ttft, lent.ttft);
        assert_eq!(r.decode_delta_ms, 0.7);
    }

    #[test]
    fn the_fleet_lends_its_prior_and_no_delta_before_any_answer() {
        let lent = Lent::of(&TtftModel::default(), &DecodeModel::default());
        assert_eq!(lent.ttft, TtftEstimate::default().fit());
        assert_eq!(lent.decode_delta_ms, 0.0);
    }

    #[test]
    fn a_replica_sampling_one_placement_in_three_follows_the_same_stretch_of_traffic() {
        // The running count rises from 0 to 6 over 96 placements, then stays. One replica
        // samples at every placement; one of three replicas at every third, told how many
        // placements the fleet made since.
        let running = |k: u64| (k as f64 / 16.0).min(6.0);
        let (mut all, mut third) = (Learners::default(), Learners::default());
        for k in 0..120u64 {
            all.sample(0.0, running(k), k, 1);
            if k % 3 == 0 {
                third.sample(0.0, running(k), k, 3);
            }
        }
        let (a, t) = (all.decode.mean_running(), third.decode.mean_running());
        assert!(
            (a - t).abs() < 0.05 * a,
            "every placement {a}, every third {t}"
        );
        // Without the placements' count, every third sample would weigh one placement each
        // and lag the rise.
        let mut unweighted = Learners::default();
        for k in (0..120u64).step_by(3) {
            unweighted.sample(0.0, running(k), k, 1);
        }
        assert!(unweighted.decode.mean_running() < a - 0.3);
        // One gateway weighs every sample as one placement, however many the fleet made
        // since (its other workers' placements).
        let (mut rare, mut plain) = (Learners::default(), Learners::default());
        for k in 0..40u64 {
            rare.sample(0.0, running(k), 10 * k, 1);
            plain.sample(0.0, running(k), k, 1);
        }
        assert_eq!(rare.decode.mean_running(), plain.decode.mean_running());
    }

    #[test]
    fn a_reading_changes_nothing() {
        let t0 = Instant::now();
        let l = taught(t0, 3);
        let before = format!("{l:?}");
        let lent = Lent::default();
        let first = l.readings(t0 + Duration::from_millis(500), &lent);
        assert_eq!(format!("{l:?}"), before);
        assert_eq!(l.readings(t0 + Duration::from_millis(500), &lent), first);
    }
}
