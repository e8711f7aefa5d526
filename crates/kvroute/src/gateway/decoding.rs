//! Decoding: what one more decoding sequence costs a worker's steps, and what a placement's
//! decode costs the requests it shares those steps with.
//!
//! Owns: [`DecodeEstimate`] (a plain estimator; the fleet's shared as [`DecodeModel`]), a
//! worker's inter-token latency as a linear function of the prefill
//! its steps carried and the requests running there, `itl = α + β·prefill + δ·running`,
//! fitted online (the same recursive least squares as the TTFT model, [`super::ttft::Rls`],
//! on its features `[1, prefill/1000, 0, running]`) from every streamed answer, `prefill`
//! being the prefill tokens worked off on the worker while it decoded, per token (what was
//! queued at its first token and booked there since, less what is queued at its last; `β` thus
//! the engine's cost of a thousand prefill tokens) — the prefill chunks a decode step carries
//! are the prefills', not the running requests', so δ is what a running request alone adds;
//! [`AnswerLength`], the fleet's mean answer length (a plain estimator, shared as
//! [`OutputTokens`]). The routing core prices them
//! ([`decode_interference_ms`] and [`prefill_stall_ms`], re-exported from
//! `kvroute_route::terms`). An engine decodes all
//! its running sequences in every step (continuous batching), so each one lengthens every
//! step by δ: a request decoding `O` tokens where `R` others run is slowed by `δ` a token by
//! each of them, and slows each by `δ` a token, while they overlap. A running request has, on
//! average, part of a typical answer (`Ō` tokens, the fleet's mean) left — its remaining
//! tokens spread evenly over `[0, Ō]` — so a pair overlaps `E[min(O, U)] = O − O²/(2·Ō)`
//! tokens (`Ō/2` for a typical answer): `2·δ·R·(O − O²/(2·Ō))` milliseconds of end-to-end
//! latency in all, nothing on an idle worker. Each pair of requests is charged once, to the
//! later of the two. The model also keeps the worker's recent running count (sampled at each
//! routing decision), what a conversation's later turns will decode beside.
//! The steps that carry a prefill's chunks are longer for every sequence decoding in them
//! (chunked prefill batches both), so a prefill of `P` milliseconds where `R` requests decode
//! lengthens each of their answers by about `P`: [`prefill_stall_ms`] `= P·R`, charged for a
//! new conversation's later turns, and with `weights.prefill_stall = "all"` for each
//! request's own prefill (what their decode costs a prefill is already in its predicted
//! TTFT).
//! Invariants: δ and the recent running count are never negative; the decode charge is 0
//! with nothing running, no expected output, or an unfitted model, and grows with each; the
//! stall is 0 with nothing running or no prefill, and grows with each; the mean answer length
//! is finite and never negative.
//! Must not: read sockets or clocks, or hold logic in the shared wrappers; callers pass the
//! observations.

use super::ttft::Rls;
use parking_lot::Mutex;
use serde::Serialize;

/// Streamed answers a worker's own model needs before it is used instead of the fleet's.
pub const OWN_MODEL_AFTER: u64 = 16;

/// One worker's (or the fleet's) inter-token latency model as a plain estimator: the fit and
/// the requests recently running there ([`DecodeModel`] shares the fleet's between threads; a
/// worker's is one of its learners, [`super::learners::Learners`]).
#[derive(Clone, Debug, Default)]
pub struct DecodeEstimate {
    rls: Rls,
    /// Exponentially weighted mean, over the fleet's recent placements, of the requests
    /// running on the worker (the weights of the TTFT model's load wait,
    /// [`super::ttft::wait_weight`]).
    running: f64,
}

/// What a decode model has learned, for the admin view.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct DecodeView {
    pub samples: u64,
    pub ms_per_token: f64,
    /// What a thousand prefill tokens in its steps add to an answer (β).
    pub ms_per_1k_prefill_tokens: f64,
    pub ms_per_running_request: f64,
    /// The requests recently running there ([`DecodeEstimate::mean_running`]).
    pub mean_running: f64,
}

/// The TTFT model's feature layout: the constant, the prefill in the answer's steps per
/// token decoded (thousands of tokens) and the requests running.
fn features(prefill_per_token: f64, running: f64) -> [f64; super::ttft::DIM] {
    [1.0, prefill_per_token / 1000.0, 0.0, running]
}

impl DecodeEstimate {
    /// One streamed answer: its mean inter-token latency while its steps carried
    /// `prefill_per_token` prefill tokens per token it decoded and `running` other requests
    /// ran on the worker (an observation that is not a positive latency of finite,
    /// non-negative figures is ignored).
    pub fn observe(&mut self, prefill_per_token: f64, running: f64, itl_ms: f64) {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if ok(itl_ms) && itl_ms > 0.0 && ok(running) && ok(prefill_per_token) {
            self.rls
                .observe(&features(prefill_per_token, running), itl_ms);
        }
    }

    pub fn samples(&self) -> u64 {
        self.rls.samples()
    }

    /// Records the requests running on the worker now (one sample per routing decision,
    /// every candidate alike) with the sample's `weight` ([`super::ttft::wait_weight`]).
    pub fn sample_running(&mut self, running: f64, weight: f64) {
        if running.is_finite() {
            self.running += weight.clamp(0.0, 1.0) * (running.max(0.0) - self.running);
        }
    }

    /// The requests recently running on the worker: what a conversation's later turns sent
    /// here will decode beside (the count of this instant comes and goes with each answer).
    pub fn mean_running(&self) -> f64 {
        self.running
    }

    /// δ: milliseconds one more running request adds to each token (at least 0).
    pub fn ms_per_running(&self) -> f64 {
        self.rls.effective()[3]
    }

    /// The δ this model lends a worker without its own yet: its own once it has seen any
    /// answer, else 0 (nothing is charged before any answer).
    pub fn lent_delta(&self) -> f64 {
        if self.samples() > 0 {
            self.ms_per_running()
        } else {
            0.0
        }
    }

    /// δ from this model once it has seen [`OWN_MODEL_AFTER`] answers, else `fleet_delta`
    /// (the fleet's [`DecodeEstimate::lent_delta`], read once per decision).
    pub fn delta(&self, fleet_delta: f64) -> f64 {
        if self.samples() >= OWN_MODEL_AFTER {
            self.ms_per_running()
        } else {
            fleet_delta
        }
    }

    pub fn view(&self) -> DecodeView {
        let m = &self.rls;
        let e = m.effective();
        DecodeView {
            samples: m.samples(),
            ms_per_token: e[0],
            ms_per_1k_prefill_tokens: m.theta()[1],
            ms_per_running_request: e[3],
            mean_running: self.running,
        }
    }
}

/// The fleet's [`DecodeEstimate`], shared by every streamed answer that teaches it and every
/// decision that borrows its δ.
#[derive(Debug, Default)]
pub struct DecodeModel {
    inner: Mutex<DecodeEstimate>,
}

impl DecodeModel {
    /// [`DecodeEstimate::observe`].
    pub fn observe(&self, prefill_per_token: f64, running: f64, itl_ms: f64) {
        self.inner
            .lock()
            .observe(prefill_per_token, running, itl_ms);
    }

    /// [`DecodeEstimate::ms_per_running`].
    pub fn ms_per_running(&self) -> f64 {
        self.inner.lock().ms_per_running()
    }

    /// [`DecodeEstimate::lent_delta`].
    pub fn lent_delta(&self) -> f64 {
        self.inner.lock().lent_delta()
    }

    /// [`DecodeEstimate::view`].
    pub fn view(&self) -> DecodeView {
        self.inner.lock().view()
    }
}

/// Weight of the newest answer in [`AnswerLength`].
pub const OUTPUT_WEIGHT: f64 = 1.0 / 64.0;

/// The fleet's mean answer length (completion tokens) as a plain estimator: an exponentially
/// weighted mean over about the last 64 answers, started by the first ([`OutputTokens`]
/// shares one between threads).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AnswerLength {
    /// `None` before the first answer.
    mean: Option<f64>,
}

impl AnswerLength {
    /// One answer of `tokens` completion tokens.
    pub fn observe(&mut self, tokens: u64) {
        let t = tokens as f64;
        self.mean = Some(match self.mean {
            Some(x) => x + OUTPUT_WEIGHT * (t - x),
            None => t,
        });
    }

    pub fn mean(&self) -> Option<f64> {
        self.mean
    }

    /// What a request is expected to generate ([`kvroute_route::terms::expected_output`]):
    /// the fleet's mean answer, capped by the request's own `max_tokens`; its `max_tokens`
    /// before any answer was seen; else 0.
    pub fn expected(&self, max_tokens: Option<u64>) -> f64 {
        kvroute_route::terms::expected_output(self.mean, max_tokens)
    }
}

/// The fleet's [`AnswerLength`], shared by the answers that teach it and the decisions that
/// read it.
#[derive(Debug, Default)]
pub struct OutputTokens {
    inner: Mutex<AnswerLength>,
}

impl OutputTokens {
    /// [`AnswerLength::observe`].
    pub fn observe(&self, tokens: u64) {
        self.inner.lock().observe(tokens);
    }

    /// [`AnswerLength::mean`].
    pub fn mean(&self) -> Option<f64> {
        self.inner.lock().mean()
    }

    /// [`AnswerLength::expected`].
    pub fn expected(&self, max_tokens: Option<u64>) -> f64 {
        self.inner.lock().expected(max_tokens)
    }
}
pub use kvroute_route::terms::{decode_interference_ms, prefill_stall_ms};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_stalls_each_running_request_by_its_own_length() {
        assert_eq!(prefill_stall_ms(40.0, 3.0), 120.0);
        assert_eq!(prefill_stall_ms(40.0, 0.0), 0.0);
        assert_eq!(prefill_stall_ms(0.0, 5.0), 0.0);
        assert_eq!(prefill_stall_ms(-1.0, 5.0), 0.0);
        assert_eq!(prefill_stall_ms(f64::INFINITY, 5.0), 0.0);
        assert!(prefill_stall_ms(50.0, 3.0) > prefill_stall_ms(40.0, 3.0));
        assert!(prefill_stall_ms(40.0, 4.0) > prefill_stall_ms(40.0, 3.0));
    }

    #[test]
    fn the_model_learns_what_each_running_request_adds_to_a_token() {
        let mut m = DecodeEstimate::default();
        // An engine whose token takes 5 ms, plus 0.25 ms per running request, plus the prefill
        // chunks its steps carry (60 ms per 1,000 prefill tokens, spread over the answer's
        // tokens), where busier workers have both more running and more prefill: the fit
        // tells the two apart.
        for i in 0..400u64 {
            let r = (i * 7 % 13) as f64;
            let per_token = 10.0 * r + 5.0 * (i % 5) as f64;
            m.observe(per_token, r, 5.0 + 0.25 * r + 0.06 * per_token);
        }
        assert!((m.ms_per_running() - 0.25).abs() < 0.01, "{:?}", m.view());
        assert!((m.view().ms_per_token - 5.0).abs() < 0.05, "{:?}", m.view());
        assert!(
            (m.view().ms_per_1k_prefill_tokens - 60.0).abs() < 0.5,
            "{:?}",
            m.view()
        );
        // Nonsense observations are ignored.
        m.observe(0.0, -1.0, 5.0);
        m.observe(0.0, 2.0, f64::NAN);
        m.observe(0.0, 2.0, 0.0);
        m.observe(f64::INFINITY, 2.0, 5.0);
        assert_eq!(m.samples(), 400);
    }

    #[test]
    fn a_young_worker_borrows_the_fleets_delta_and_nothing_is_charged_before_any_answer() {
        let (mut w, fleet) = (DecodeEstimate::default(), DecodeModel::default());
        assert_eq!(w.delta(fleet.lent_delta()), 0.0);
        for i in 0..40u64 {
            fleet.observe(0.0, (i % 5) as f64, 4.0 + 0.5 * (i % 5) as f64);
        }
        assert!((w.delta(fleet.lent_delta()) - fleet.ms_per_running()).abs() < 1e-12);
        for i in 0..OWN_MODEL_AFTER {
            w.observe(0.0, (i % 5) as f64, 4.0 + 0.1 * (i % 5) as f64);
        }
        assert!((w.delta(fleet.lent_delta()) - w.ms_per_running()).abs() < 1e-12);
    }

    #[test]
    fn the_recent_running_count_follows_the_samples_and_ignores_nonsense() {
        let mut m = DecodeEstimate::default();
        assert_eq!(m.mean_running(), 0.0);
        m.sample_running(32.0, crate::gateway::ttft::WAIT_WEIGHT);
        assert!(
            (m.mean_running() - 1.0).abs() < 1e-12,
            "a thirty-second of the first"
        );
        for _ in 0..1_000 {
            m.sample_running(4.0, crate::gateway::ttft::WAIT_WEIGHT);
        }
        assert!((m.mean_running() - 4.0).abs() < 1e-9);
        m.sample_running(f64::NAN, crate::gateway::ttft::WAIT_WEIGHT);
        m.sample_running(f64::INFINITY, crate::gateway::ttft::WAIT_WEIGHT);
        assert!((m.mean_running() - 4.0).abs() < 1e-9);
        m.sample_running(-8.0, crate::gateway::ttft::WAIT_WEIGHT);
        assert!(m.mean_running() >= 0.0, "a negative count counts as none");
    }

    #[test]
    fn the_shared_fleet_model_is_the_plain_estimate_behind_a_lock() {
        let (shared, mut plain) = (DecodeModel::default(), DecodeEstimate::default());
        for i in 0..30u64 {
            let r = (i % 4) as f64;
            shared.observe(1.0, r, 5.0 + 0.3 * r);
            plain.observe(1.0, r, 5.0 + 0.3 * r);
        }
        assert_eq!(shared.ms_per_running(), plain.ms_per_running());
        assert_eq!(shared.lent_delta(), plain.lent_delta());
        assert_eq!(shared.view().samples, plain.samples());
    }

    #[test]
    fn a_typical_answer_overlaps_half_of_each_running_answer() {
        // O = Ō: each pair overlaps Ō/2 tokens, both ways: δ·Ō·R.
        assert!((decode_interference_ms(0.2, 50.0, 50.0, 3.0) - 0.2 * 50.0 * 3.0).abs() < 1e-9);
        // A short answer overlaps nearly all of itself: O − O²/(2Ō).
        let short = decode_interference_ms(0.2, 10.0, 50.0, 3.0);
        assert!((short - 2.0 * 0.2 * 3.0 * (10.0 - 1.0)).abs() < 1e-9);
        // A longer one overlaps no more than the others have left.
        assert_eq!(
            decode_interference_ms(0.2, 500.0, 50.0, 3.0),
            decode_interference_ms(0.2, 50.0, 50.0, 3.0)
        );
        assert_eq!(decode_interference_ms(0.2, 50.0, 50.0, 0.0), 0.0);
        assert_eq!(decode_interference_ms(-1.0, 50.0, 50.0, 3.0), 0.0);
        assert_eq!(
            decode_interference_ms(0.2, f64::INFINITY, f64::INFINITY, 3.0),
            0.0
        );
        assert_eq!(decode_interference_ms(0.2, 50.0, 0.0, 3.0), 0.0);
        let more = decode_interference_ms(0.2, 50.0, 50.0, 4.0);
        assert!(more > decode_interference_ms(0.2, 50.0, 50.0, 3.0));
    }

    #[test]
    fn the_expected_answer_is_the_fleets_mean_capped_by_max_tokens() {
        let mut o = AnswerLength::default();
        assert_eq!(o.expected(None), 0.0);
        assert_eq!(o.expected(Some(16)), 16.0);
        o.observe(100);
        assert_eq!(o.expected(None), 100.0);
        assert_eq!(o.expected(Some(16)), 16.0);
        assert_eq!(o.expected(Some(400)), 100.0);
    }

    #[test]
    fn the_first_answer_is_the_mean_and_each_newer_one_weighs_a_sixty_fourth() {
        let mut o = AnswerLength::default();
        assert_eq!(o.mean(), None);
        o.observe(100);
        assert_eq!(o.mean(), Some(100.0));
        o.observe(36);
        assert!((o.mean().unwrap_or(0.0) - (100.0 - 64.0 / 64.0)).abs() < 1e-9);
        for _ in 0..2_000 {
            o.observe(10);
        }
        assert!(
            (o.mean().unwrap_or(0.0) - 10.0).abs() < 1e-6,
            "{:?}",
            o.mean()
        );
    }

    #[test]
    fn the_shared_answer_length_is_the_plain_one_behind_a_lock() {
        let (shared, mut plain) = (OutputTokens::default(), AnswerLength::default());
        for t in [5, 900, 0, 64, 64, 3] {
            shared.observe(t);
            plain.observe(t);
        }
        assert_eq!(shared.mean(), plain.mean());
        assert_eq!(shared.expected(Some(40)), plain.expected(Some(40)));
    }

    proptest::proptest! {
        #[test]
        fn the_mean_answer_stays_within_the_answers_seen(
            answers in proptest::collection::vec(0u64..100_000, 1..200),
        ) {
            let mut o = AnswerLength::default();
            for t in &answers {
                o.observe(*t);
            }
            let (lo, hi) = (answers.iter().min(), answers.iter().max());
            let m = o.mean().unwrap_or(f64::NAN);
            let (lo, hi) = (lo.copied().unwrap_or(0) as f64, hi.copied().unwrap_or(0) as f64);
            proptest::prop_assert!(m >= lo - 1e-6 && m <= hi + 1e-6, "{} not in [{}, {}]", m, lo, hi);
        }
    }
}
