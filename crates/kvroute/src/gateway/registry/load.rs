//! A worker's load as this gateway accounts it: the requests running or waiting there, the
//! prefill queued there (its own bookings worked off at the worker's learned rate, and other
//! senders' requests at its mean prefill while the engine's figures are fresh), and the
//! [`LoadGuard`] each request holds while it is in flight.
//!
//! Owns: the [`Worker`]'s load readings (`running`, `queued_tokens`, `load_at`), its booking
//! figures (mean prefill per request, the draining backlog, the drain rate) and
//! [`LoadGuard`].
//! Invariants: load counters never underflow (a guard releases exactly what it took, once);
//! the backlog never exceeds the bookings and is what an engine working one token at a time
//! at the learned rate has left (property-tested); reading the load changes nothing.
//! Must not: choose workers or price load (the routing core does).

use super::Worker;
use crate::gateway::engine_load::EngineLoad;
use crate::gateway::peer_wire::Outbox;
use crate::gateway::pending::Prompt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Worker {
    /// Requests running or waiting here, from every sender: the engine's last figures plus
    /// what this gateway sent since (other replicas and clients included), or the gateway's
    /// own count while the engine reports nothing fresh.
    pub fn running(&self) -> u64 {
        self.running_at(Instant::now())
    }

    /// [`Worker::running`], the engine's figures counted as fresh or not at `now`.
    pub fn running_at(&self, now: Instant) -> u64 {
        let own = self.in_flight.load(Ordering::Relaxed);
        let load = *self.engine_load.lock();
        load.running_estimate(own, load.fresh(now))
    }

    /// Prefill tokens queued here: this gateway's own bookings, plus, while the engine's
    /// figures are fresh, the requests waiting there that are not this gateway's (other
    /// replicas, other clients) at this gateway's mean prefill per request.
    pub fn queued_tokens(&self) -> u64 {
        let ms = f64::from_bits(self.prefill_ms_per_token.load(Ordering::Relaxed));
        self.queued_tokens_draining(ms, Instant::now())
    }

    /// [`Worker::queued_tokens`] at `now` with the backlog draining at `ms_per_token` (0: not
    /// at all), whatever rate the bookings last set: what a decision reads for the rate its
    /// model predicts with, changing nothing.
    pub fn queued_tokens_draining(&self, ms_per_token: f64, now: Instant) -> u64 {
        let load = *self.engine_load.lock();
        self.queued_given(&load, ms_per_token, now)
    }

    /// [`Worker::queued_tokens_draining`] and [`Worker::running_at`] from one reading of the
    /// engine's figures: what a decision reads of the worker's load.
    pub fn load_at(&self, ms_per_token: f64, now: Instant) -> (u64, u64) {
        let load = *self.engine_load.lock();
        let own = self.in_flight.load(Ordering::Relaxed);
        (
            self.queued_given(&load, ms_per_token, now),
            load.running_estimate(own, load.fresh(now)),
        )
    }

    /// The queued prefill given the engine's figures `load`.
    fn queued_given(&self, load: &EngineLoad, ms_per_token: f64, now: Instant) -> u64 {
        let booked = self.queued_prefill.load(Ordering::Relaxed);
        // What is booked but already worked off (the engine has been prefilling it since it
        // was sent) is no longer ahead of a new request.
        let draining = valid_rate(ms_per_token).to_bits() != 0;
        let own = if draining {
            booked.min(self.backlog_draining(now, valid_rate(ms_per_token)).ceil() as u64)
        } else {
            booked
        };
        if !load.fresh(now) {
            return own;
        }
        let others = load.waiting.saturating_sub(load.own_prefilling_at_poll);
        own + (others as f64 * self.mean_prefill()) as u64
    }

    /// Mean prefill tokens this gateway booked per request here (0 before the first).
    pub fn mean_prefill(&self) -> f64 {
        self.mean_prefill.lock().0
    }

    fn book_mean_prefill(&self, prefill: u64) {
        let mut m = self.mean_prefill.lock();
        m.1 += 1;
        m.0 += (prefill as f64 - m.0) / m.1.min(MEAN_PREFILL_WINDOW) as f64;
    }

    /// The worker's learned marginal prefill cost, for draining the backlog (0: do not drain;
    /// the queue is then the whole bookings).
    pub fn set_prefill_ms_per_token(&self, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            self.prefill_ms_per_token
                .store(ms.to_bits(), Ordering::Relaxed);
        }
    }

    /// The booked prefill not yet worked off at `now`: each booking adds its tokens, and the
    /// engine works them off at the learned rate while any are left.
    fn backlog_at(&self, now: Instant) -> f64 {
        let ms = f64::from_bits(self.prefill_ms_per_token.load(Ordering::Relaxed));
        self.backlog_draining(now, ms)
    }

    /// The backlog at `now` worked off at `ms` a token since the last booking.
    fn backlog_draining(&self, now: Instant, ms: f64) -> f64 {
        let (left, at) = *self.backlog.lock();
        if ms <= 0.0 {
            return left;
        }
        let worked = now.saturating_duration_since(at).as_secs_f64() * 1000.0 / ms;
        (left - worked).max(0.0)
    }

    fn book_backlog(&self, tokens: u64, now: Instant) {
        let left = self.backlog_at(now);
        *self.backlog.lock() = (left + tokens as f64, now);
    }
}

/// A prefill rate as [`Worker::set_prefill_ms_per_token`] keeps it: finite and not negative,
/// else 0 (no drain).
fn valid_rate(ms: f64) -> f64 {
    if ms.is_finite() && ms >= 0.0 {
        ms
    } else {
        0.0
    }
}

/// Holds a request's share of a worker's load (and its in-flight prompt) until dropped.
pub struct LoadGuard {
    worker: Arc<Worker>,
    prefill: u64,
    prefill_released: bool,
    pending: Option<u64>,
    /// Where the request was announced to the other replicas, and its id there.
    announced: Option<(Arc<Outbox>, u64)>,
}

impl LoadGuard {
    pub fn new(worker: Arc<Worker>, prefill: u64) -> LoadGuard {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        worker.queued_prefill.fetch_add(prefill, Ordering::Relaxed);
        worker.booked_total.fetch_add(prefill, Ordering::Relaxed);
        worker.bookings_total.fetch_add(1, Ordering::Relaxed);
        worker.book_backlog(prefill, Instant::now());
        worker.prefilling.fetch_add(1, Ordering::Relaxed);
        worker.book_mean_prefill(prefill);
        LoadGuard {
            worker,
            prefill,
            prefill_released: false,
            pending: None,
            announced: None,
        }
    }

    /// Also records the prompt as in flight on the worker until the guard drops.
    pub fn with_prompt(mut self, prompt: &Prompt<'_>, checkpoints: [u64; 2]) -> LoadGuard {
        self.pending = Some(self.worker.pending.add(prompt, checkpoints));
        self
    }
    /// Also records a prompt announced by another replica (its chunk keys and checkpoint
    /// tails) as in flight on the worker until the guard drops.
    pub fn with_announced_prompt(
        mut self,
        keys: Arc<[u64]>,
        checkpoints: &[(u64, Vec<u32>)],
    ) -> LoadGuard {
        self.pending = Some(self.worker.pending.add_parts(keys, checkpoints));
        self
    }

    /// Tells the other replicas, through `outbox`, when the prefill is done and when the
    /// request ends (`id`: what the booking was announced as).
    pub fn announced(mut self, outbox: Arc<Outbox>, id: u64) -> LoadGuard {
        self.announced = Some((outbox, id));
        self
    }

    /// The prefill tokens booked.
    pub fn prefill(&self) -> u64 {
        self.prefill
    }

    /// The first byte came back: the prefill is done.
    pub fn prefill_done(&mut self) {
        if !self.prefill_released {
            self.prefill_released = true;
            if let Some((outbox, id)) = &self.announced {
                outbox.first_byte(*id);
            }
            self.worker
                .queued_prefill
                .fetch_sub(self.prefill, Ordering::Relaxed);
            self.worker.prefilling.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.prefill_done();
        if let Some(id) = self.pending.take() {
            self.worker.pending.remove(id);
        }
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some((outbox, id)) = self.announced.take() {
            outbox.done(id);
        }
    }
}

/// How many bookings the mean prefill per request follows ([`Worker::mean_prefill`]): the
/// plain mean up to there (no start from 0 that reads as small prefills for the first
/// hundred requests), then the newest weighs 1/32.
pub const MEAN_PREFILL_WINDOW: u64 = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::config::WorkerSpec;
    use crate::gateway::registry::Registry;
    use kvroute_index::{BlockExtras, Index};
    use std::time::Duration;

    #[test]
    fn the_mean_prefill_is_the_plain_mean_of_the_first_bookings_and_then_follows_the_newest() {
        let registry = Registry::new(Arc::new(Index::new()));
        let w = registry
            .add(WorkerSpec::new("a", "http://127.0.0.1:1", "m"))
            .expect("valid spec");
        for prefill in [1000, 3000] {
            drop(LoadGuard::new(w.clone(), prefill));
        }
        assert!((w.mean_prefill() - 2000.0).abs() < 1e-9);
        for _ in 2..MEAN_PREFILL_WINDOW {
            drop(LoadGuard::new(w.clone(), 2000));
        }
        assert!((w.mean_prefill() - 2000.0).abs() < 1e-9);
        // Past the window the newest weighs 1/32.
        drop(LoadGuard::new(w.clone(), 2000 + 32 * 64));
        assert!((w.mean_prefill() - 2064.0).abs() < 1e-9);
    }

    #[test]
    fn a_load_guard_gives_back_its_load_and_its_in_flight_prompt_when_dropped() {
        let registry = Registry::new(Arc::new(Index::new()));
        let w = registry
            .add(WorkerSpec::new("a", "http://127.0.0.1:1", "m"))
            .expect("valid spec");
        let tokens: Vec<u32> = (0..300).collect();
        let prompt = Prompt::new(&tokens, &BlockExtras::default());
        let mut guard = LoadGuard::new(w.clone(), 300).with_prompt(&prompt, [256, 0]);
        assert_eq!(w.view().in_flight, 1);
        assert_eq!(w.view().queued_prefill_tokens, 300);
        assert_eq!(w.view().in_flight_prompts, 1);
        // The first byte releases the prefill, not the prompt: the engine is still storing it.
        guard.prefill_done();
        assert_eq!(w.view().queued_prefill_tokens, 0);
        assert_eq!(w.pending.len(), 1);
        drop(guard);
        let v = w.view();
        assert_eq!(
            (v.in_flight, v.queued_prefill_tokens, v.in_flight_prompts),
            (0, 0, 0)
        );
    }

    #[test]
    fn booked_prefill_is_worked_off_at_the_learned_rate_and_never_exceeds_the_bookings() {
        let registry = Registry::new(Arc::new(Index::new()));
        let w = registry
            .add(WorkerSpec::new("a", "http://127.0.0.1:1", "m"))
            .expect("valid spec");
        // Unknown rate: nothing is worked off.
        let mut guard = LoadGuard::new(w.clone(), 1000);
        let (_, at) = *w.backlog.lock();
        assert_eq!(w.backlog_at(at + Duration::from_millis(500)), 1000.0);
        // 0.1 ms a token: 50 ms later half is left, 100 ms later none.
        w.set_prefill_ms_per_token(0.1);
        assert!((w.backlog_at(at + Duration::from_millis(50)) - 500.0).abs() < 1e-6);
        assert_eq!(w.backlog_at(at + Duration::from_millis(150)), 0.0);
        assert!(w.queued_tokens() <= 1000);
        // Not draining (`weights.queue_drain = false`), the queue is the whole bookings.
        w.set_prefill_ms_per_token(0.0);
        assert_eq!(w.queued_tokens(), 1000);
        w.set_prefill_ms_per_token(0.1);
        // The bookings bound it: once the first byte came back, nothing is queued.
        guard.prefill_done();
        assert_eq!(w.queued_tokens(), 0);
        // Nonsense rates are ignored.
        w.set_prefill_ms_per_token(f64::NAN);
        w.set_prefill_ms_per_token(-1.0);
        assert_eq!(
            f64::from_bits(w.prefill_ms_per_token.load(Ordering::Relaxed)),
            0.1
        );
    }

    proptest::proptest! {
        /// The backlog against a literal engine that works one token at a time, FCFS, at the
        /// learned rate, from bookings arriving at given times.
        #[test]
        fn the_backlog_is_what_a_token_at_a_time_engine_has_left(
            bookings in proptest::collection::vec((0u64..400, 0u64..300), 1..12),
            ms_per_token in 1u64..4,
        ) {
            let registry = Registry::new(Arc::new(Index::new()));
            let w = registry
                .add(WorkerSpec::new("a", "http://127.0.0.1:1", "m"))
                .expect("valid spec");
            w.set_prefill_ms_per_token(ms_per_token as f64);
            let t0 = Instant::now();
            let (mut now_ms, mut left, mut busy_until) = (0u64, 0u64, 0u64);
            for (gap_ms, tokens) in bookings {
                now_ms += gap_ms;
                // The literal engine: one token every `ms_per_token` ms while any is left.
                while left > 0 && busy_until + ms_per_token <= now_ms {
                    busy_until += ms_per_token;
                    left -= 1;
                }
                if left == 0 {
                    busy_until = now_ms;
                }
                left += tokens;
                w.book_backlog(tokens, t0 + Duration::from_millis(now_ms));
                let fast = w.backlog_at(t0 + Duration::from_millis(now_ms));
                // The closed form works fractions of a token off; the literal engine whole ones.
                proptest::prop_assert!(fast <= left as f64 + 1e-6, "{fast} > {left}");
                proptest::prop_assert!(fast + 1.0 > left as f64 - 1e-6, "{fast} vs {left}");
            }
        }
    }
}
