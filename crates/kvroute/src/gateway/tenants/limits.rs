//! The limiters a tenant is held to, on an injectable clock.
//!
//! Owns: `Clock` (monotonic nanoseconds; `ManualClock` for tests), `Bucket` (a token bucket in
//! its GCRA form: one theoretical arrival time in integer nanoseconds, so admission is exact and
//! O(1)), `Concurrency` (requests in flight against a maximum, and the mean time recent requests
//! held their slot, which a rejection's `Retry-After` is computed from), and the literal
//! reference models both are property-tested against.
//! Invariants: a bucket of capacity `C` units refilling one unit per `T` ns admits a request of
//! cost `c` at `t` iff `c ≤ C` and, for every earlier admission at `t_k`, the costs admitted
//! since `t_k` (inclusive) plus `c` are at most `C + (t − t_k)/T` (the reference checks exactly
//! this over its list of timestamps). A rejected request changes nothing. The in-flight count
//! never goes below zero.
//! Must not: read the wall clock itself (everything takes `now`), allocate per request, or
//! sleep.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Nanoseconds on a monotonic clock.
pub trait Clock: Send + Sync + 'static {
    fn now_ns(&self) -> u64;
}

/// The process's monotonic clock, counted from when it was made.
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock(Instant::now())
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told (tests).
#[derive(Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn advance_ns(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

pub use crate::gateway::config::tenants::NS_PER_SEC;

/// Why a bucket refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// It admits the same request after this many nanoseconds (> 0).
    After(u64),
    /// The cost exceeds the capacity: it never admits it.
    Never,
}

/// A token bucket: `capacity` units, one more every `interval_ns`, full at the start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    interval_ns: u64,
    capacity: u64,
    /// When the bucket is full again: the debt is `tat − now` when positive.
    tat: u64,
}

impl Bucket {
    /// `interval_ns` and `capacity` are at least 1 (callers validate; 0 is raised to 1).
    pub fn new(interval_ns: u64, capacity: u64) -> Bucket {
        Bucket {
            interval_ns: interval_ns.max(1),
            capacity: capacity.max(1),
            tat: 0,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn interval_ns(&self) -> u64 {
        self.interval_ns
    }

    /// Nanoseconds of refill the bucket is short of full at `now`.
    fn debt(&self, now: u64) -> u64 {
        self.tat.saturating_sub(now)
    }

    /// Takes `cost` units at `now`, or says how long until it could (and takes nothing).
    pub fn take(&mut self, now: u64, cost: u64) -> Result<(), Wait> {
        if cost > self.capacity {
            return Err(Wait::Never);
        }
        let after = self.debt(now) as u128 + cost as u128 * self.interval_ns as u128;
        let room = self.capacity as u128 * self.interval_ns as u128;
        if after <= room {
            self.tat = now.saturating_add(u64::try_from(after).unwrap_or(u64::MAX));
            Ok(())
        } else {
            Err(Wait::After(u64::try_from(after - room).unwrap_or(u64::MAX)))
        }
    }

    /// The nanoseconds a full refill takes (what a request that can never pass is told).
    pub fn full_refill_ns(&self) -> u64 {
        self.capacity.saturating_mul(self.interval_ns)
    }

    /// The same bucket under new parameters at `now`, keeping the fraction it is short of full.
    pub fn retuned(&self, now: u64, interval_ns: u64, capacity: u64) -> Bucket {
        let mut b = Bucket::new(interval_ns, capacity);
        // Debt in units (old) → nanoseconds (new), at most the new capacity.
        let units_ns = self.debt(now) as u128 * b.interval_ns as u128 / self.interval_ns as u128;
        let debt = units_ns.min(b.capacity as u128 * b.interval_ns as u128);
        b.tat = now.saturating_add(u64::try_from(debt).unwrap_or(u64::MAX));
        b
    }
}

/// Slots recent holds are averaged over.
const RECENT: usize = 16;

/// Requests in flight against an optional maximum, and how long recent ones held their slot.
#[derive(Clone, Debug, Default)]
pub struct Concurrency {
    max: Option<u32>,
    in_flight: u32,
    recent: [u64; RECENT],
    /// Holds recorded so far, up to `RECENT` (the ring's next slot is `count % RECENT`).
    count: u64,
    sum: u64,
}

impl Concurrency {
    pub fn new(max: Option<u32>) -> Concurrency {
        Concurrency {
            max,
            ..Concurrency::default()
        }
    }

    pub fn set_max(&mut self, max: Option<u32>) {
        self.max = max;
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Whether one more request would exceed the maximum.
    pub fn full(&self) -> bool {
        self.max.is_some_and(|m| self.in_flight >= m)
    }

    /// Takes a slot (callers check `full` first; the count itself is unbounded).
    pub fn acquire(&mut self) {
        self.in_flight = self.in_flight.saturating_add(1);
    }

    /// Gives a slot back after it was held `held_ns`.
    pub fn release(&mut self, held_ns: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        let slot = (self.count % RECENT as u64) as usize;
        if self.count >= RECENT as u64 {
            self.sum -= self.recent[slot];
        }
        self.recent[slot] = held_ns;
        self.sum = self.sum.saturating_add(held_ns);
        self.count += 1;
    }

    /// The mean hold of the last `RECENT` released slots, in ns (`None` before the first).
    pub fn mean_hold_ns(&self) -> Option<u64> {
        let n = self.count.min(RECENT as u64);
        (n > 0).then(|| self.sum / n)
    }
}

/// Whole seconds to tell a client to wait (`Retry-After`): `ns` rounded up, at least 1.
pub fn retry_secs(ns: u64) -> u64 {
    ns.div_ceil(NS_PER_SEC).max(1)
}

#[cfg(test)]
pub mod reference {
    //! The literal models: every admission kept as a timestamp, every in-flight request as an
    //! entry in a list.

    /// A bucket as the list of what it admitted: `(time, cost)`.
    pub struct ReferenceBucket {
        pub interval_ns: u64,
        pub capacity: u64,
        pub admitted: Vec<(u64, u64)>,
    }

    impl ReferenceBucket {
        /// `None`: admitted. `Some(None)`: never. `Some(Some(w))`: admitted after `w` ns.
        pub fn take(&mut self, now: u64, cost: u64) -> Option<Option<u64>> {
            if cost > self.capacity {
                return Some(None);
            }
            // For each earlier admission, the wait until the costs since it fit.
            let mut wait = 0u128;
            for k in 0..self.admitted.len() {
                let since: u64 = self.admitted[k..].iter().map(|&(_, c)| c).sum();
                let need =
                    (since + cost).saturating_sub(self.capacity) as u128 * self.interval_ns as u128;
                let elapsed = (now - self.admitted[k].0) as u128;
                wait = wait.max(need.saturating_sub(elapsed));
            }
            if wait == 0 {
                self.admitted.push((now, cost));
                None
            } else {
                Some(Some(wait as u64))
            }
        }
    }

    /// Requests in flight as a list of start times, and every hold ever released.
    pub struct ReferenceConcurrency {
        pub max: Option<u32>,
        pub live: Vec<(u64, u64)>,
        pub holds: Vec<u64>,
    }

    impl ReferenceConcurrency {
        pub fn acquire(&mut self, id: u64, now: u64) -> bool {
            if self.max.is_some_and(|m| self.live.len() >= m as usize) {
                return false;
            }
            self.live.push((id, now));
            true
        }

        pub fn release(&mut self, id: u64, now: u64) {
            if let Some(i) = self.live.iter().position(|&(x, _)| x == id) {
                let (_, start) = self.live.remove(i);
                self.holds.push(now - start);
            }
        }

        pub fn mean_hold_ns(&self) -> Option<u64> {
            let last: Vec<u64> = self.holds.iter().rev().take(16).copied().collect();
            (!last.is_empty()).then(|| last.iter().sum::<u64>() / last.len() as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reference::*;
    use super::*;
    use proptest::prelude::*;

    fn fast_answer(r: Result<(), Wait>) -> Option<Option<u64>> {
        match r {
            Ok(()) => None,
            Err(Wait::Never) => Some(None),
            Err(Wait::After(w)) => Some(Some(w)),
        }
    }

    proptest! {
        #[test]
        fn the_bucket_admits_exactly_what_the_list_of_timestamps_admits(
            interval in 1u64..2_000,
            capacity in 1u64..12,
            arrivals in proptest::collection::vec((0u64..3_000, 0u64..14), 1..120),
        ) {
            let mut fast = Bucket::new(interval, capacity);
            let mut reference = ReferenceBucket {
                interval_ns: interval,
                capacity,
                admitted: vec![],
            };
            let mut now = 0;
            for (gap, cost) in arrivals {
                now += gap;
                let f = fast_answer(fast.take(now, cost));
                let r = reference.take(now, cost);
                prop_assert_eq!(f, r, "at {} cost {}", now, cost);
            }
        }

        #[test]
        fn the_concurrency_limit_agrees_with_the_list_of_requests_in_flight(
            max in proptest::option::of(1u32..6),
            ops in proptest::collection::vec((any::<bool>(), 0usize..8, 0u64..5_000), 1..200),
        ) {
            let mut fast = Concurrency::new(max);
            let mut reference = ReferenceConcurrency { max, live: vec![], holds: vec![] };
            let mut held: Vec<(u64, u64)> = Vec::new();
            let mut now = 0;
            for (id, (arrive, pick, gap)) in ops.into_iter().enumerate() {
                now += gap;
                if arrive || held.is_empty() {
                    let admitted = !fast.full();
                    if admitted {
                        fast.acquire();
                        held.push((id as u64, now));
                    }
                    prop_assert_eq!(admitted, reference.acquire(id as u64, now));
                } else {
                    let (id, start) = held.remove(pick % held.len());
                    fast.release(now - start);
                    reference.release(id, now);
                }
                prop_assert_eq!(fast.in_flight() as usize, reference.live.len());
                prop_assert_eq!(fast.mean_hold_ns(), reference.mean_hold_ns());
            }
        }
    }

    #[test]
    fn a_bucket_refills_one_unit_per_interval_up_to_its_capacity() {
        let mut b = Bucket::new(100, 2);
        assert_eq!(b.take(0, 1), Ok(()));
        assert_eq!(b.take(0, 1), Ok(()));
        assert_eq!(b.take(0, 1), Err(Wait::After(100)));
        assert_eq!(b.take(60, 1), Err(Wait::After(40)));
        assert_eq!(b.take(100, 1), Ok(()));
        // A long idle time fills it only to capacity.
        assert_eq!(b.take(10_000, 2), Ok(()));
        assert_eq!(b.take(10_000, 1), Err(Wait::After(100)));
        assert_eq!(b.take(10_000, 3), Err(Wait::Never));
    }

    #[test]
    fn retuning_a_bucket_keeps_how_far_it_is_from_full() {
        let mut b = Bucket::new(100, 4);
        assert_eq!(b.take(0, 2), Ok(()));
        // Half empty; twice the rate and twice the capacity: still two units short.
        let mut r = b.retuned(0, 50, 8);
        assert_eq!(r.take(0, 6), Ok(()));
        assert_eq!(r.take(0, 1), Err(Wait::After(50)));
        // A smaller capacity caps the debt.
        let s = b.retuned(0, 100, 1);
        assert_eq!(s.clone().take(0, 1), Err(Wait::After(100)));
        assert_eq!(s.clone().take(100, 1), Ok(()));
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_at_least_one() {
        assert_eq!(retry_secs(0), 1);
        assert_eq!(retry_secs(1), 1);
        assert_eq!(retry_secs(NS_PER_SEC), 1);
        assert_eq!(retry_secs(NS_PER_SEC + 1), 2);
    }

    #[test]
    fn the_manual_clock_moves_only_when_told() {
        let c = ManualClock::default();
        assert_eq!(c.now_ns(), 0);
        c.advance_ns(5);
        assert_eq!(c.now_ns(), 5);
    }
}
