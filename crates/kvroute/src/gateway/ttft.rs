//! Predicted time to first token, learned online per worker.
//!
//! Owns: [`Work`] (what a request asks of a worker when it arrives: the prefill queued ahead
//! of it, its own uncached tokens, its attention work over the cached context, the requests
//! decoding there), [`Rls`] (a linear model `ttft = a + b·tokens + c·pairs + d·running` fitted
//! by recursive least squares with exponential forgetting, from the TTFT the gateway observes
//! on every answered request), [`TtftEstimate`] (that fit and the wait a worker's load recently
//! added, a plain estimator; the fleet's shared as [`TtftModel`]), and [`reference_fit`], the
//! literal weighted least-squares solution the recursion must equal.
//! Invariants: the recursion's estimate equals the weighted least-squares fit with the prior
//! (property-tested); a prediction never falls when work grows (predictions use the fit under
//! bounds — coefficients at least zero, the per-token cost at least a floor — with the others
//! refitted where a bound binds, property-tested against the literal bounded fit); P's trace
//! stays within [`MAX_WINDUP`] times the prior's; before its first observations a model
//! predicts from its prior (an order-of-magnitude prefill rate), so decisions are defined from
//! the first request on.
//! Must not: read sockets or clocks, or hold logic in the shared wrapper; callers pass the
//! observations.

// The 4×4 matrix arithmetic reads clearest with indices.
#![allow(clippy::needless_range_loop)]

use parking_lot::Mutex;
use serde::Serialize;

/// Features, scaled so the coefficients are of similar size: [1, tokens/1000, pairs/1e6,
/// running].
pub use kvroute_route::work::{Work, DIM};

/// Forgetting factor: an observation's weight halves after about 350 newer ones, so a model
/// follows an engine whose speed changes (another tenant, a restart) within minutes.
pub const FORGET: f64 = 0.998;
/// The prior: a fixed cost of 20 ms and 15,000 prefill tokens per second (an 8B-class model on
/// one current GPU, order of magnitude), no attention or decode term; weak, so a few dozen
/// observations replace it.
pub const PRIOR: [f64; DIM] = [20.0, 1000.0 / 15_000.0 * 1000.0, 0.0, 0.0];
/// Prior variances: wide for the fixed cost and the prefill rate, narrower for the attention
/// and decode terms, which few requests excite independently (so a handful of observations
/// cannot swing them to absurd values).
const PRIOR_VARIANCE: [f64; DIM] = [1e4, 1e4, 1e2, 1e2];
/// Lowest per-1000-token cost used when predicting (ms), so more prefill never looks free.
const MIN_TOKEN_MS: f64 = 1e-3;

/// A recursive least-squares fit (milliseconds).
#[derive(Clone, Debug)]
pub struct Rls {
    theta: [f64; DIM],
    p: [[f64; DIM]; DIM],
    samples: u64,
    /// Running mean of squared residuals (ms²): the noise a coefficient must stand out from
    /// before predictions use it.
    noise: f64,
    /// The bounded coefficients predictions use ([`Rls::effective`]), refreshed by every
    /// observation.
    bounded: [f64; DIM],
}

/// How far forgetting may inflate [`Rls`]'s P: its trace stays within this many times the
/// prior's (a direction no answer varies in would otherwise grow by 1/λ an answer, ×e⁴⁰ over
/// 20,000 answers, until rounding makes variances negative).
const MAX_WINDUP: f64 = 100.0;

/// Weight of the newest squared error in [`Rls`]'s noise estimate.
const NOISE_WEIGHT: f64 = 0.02;
/// Answers before any learned coefficient is trusted over the prior.
const TRUST_AFTER: u64 = 8;

impl Default for Rls {
    fn default() -> Self {
        let mut p = [[0.0; DIM]; DIM];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = PRIOR_VARIANCE[i];
        }
        let mut rls = Rls {
            theta: PRIOR,
            p,
            samples: 0,
            noise: 0.0,
            bounded: PRIOR,
        };
        rls.bounded = rls.bound();
        rls
    }
}

impl Rls {
    /// One observation: features `x`, observed milliseconds `y`.
    pub fn observe(&mut self, x: &[f64; DIM], y: f64) {
        if !y.is_finite() || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let px: [f64; DIM] = std::array::from_fn(|i| (0..DIM).map(|j| self.p[i][j] * x[j]).sum());
        let denom = FORGET + (0..DIM).map(|i| x[i] * px[i]).sum::<f64>();
        if denom <= 0.0 || !denom.is_finite() {
            return;
        }
        let k: [f64; DIM] = std::array::from_fn(|i| px[i] / denom);
        // P = (P − k·(Px)ᵀ) / λ, kept symmetric (P is, so xᵀP = (Px)ᵀ); an update that would
        // leave a variance that is not positive (rounding once P has grown) is skipped whole.
        let mut next = [[0.0; DIM]; DIM];
        for i in 0..DIM {
            for j in 0..DIM {
                let a = self.p[i][j] - k[i] * px[j];
                let b = self.p[j][i] - k[j] * px[i];
                next[i][j] = (a + b) / 2.0 / FORGET;
            }
        }
        if (0..DIM).any(|i| !(next[i][i] > 0.0 && next[i][i].is_finite())) {
            return;
        }
        let err = y - (0..DIM).map(|i| x[i] * self.theta[i]).sum::<f64>();
        for i in 0..DIM {
            self.theta[i] += k[i] * err;
        }
        // The noise is read from what the updated fit still misses.
        let residual = y - (0..DIM).map(|i| x[i] * self.theta[i]).sum::<f64>();
        self.noise = if self.samples == 0 {
            residual * residual
        } else {
            (1.0 - NOISE_WEIGHT) * self.noise + NOISE_WEIGHT * residual * residual
        };
        // Forgetting inflates P along directions the answers never vary in (the attention
        // work moving with the token count): past MAX_WINDUP times the prior's total variance
        // it is scaled back, so P cannot grow until rounding breaks it.
        let trace: f64 = (0..DIM).map(|i| next[i][i]).sum();
        let cap = MAX_WINDUP * PRIOR_VARIANCE.iter().sum::<f64>();
        let scale = if trace > cap { cap / trace } else { 1.0 };
        for i in 0..DIM {
            for j in 0..DIM {
                self.p[i][j] = next[i][j] * scale;
            }
        }
        self.samples += 1;
        self.bounded = self.bound();
    }

    pub fn theta(&self) -> [f64; DIM] {
        self.theta
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Whether coefficient `i` stands out from the noise: positive and more than twice its
    /// standard error (`√(noise · Pᵢᵢ)`), after [`TRUST_AFTER`] answers.
    fn trusted(&self, i: usize) -> bool {
        self.samples >= TRUST_AFTER
            && self.theta[i] > 2.0 * (self.noise * self.p[i][i].max(0.0)).sqrt()
    }

    /// The coefficients predictions use: the least-squares fit under bounds — the fixed cost,
    /// the attention and decode terms at least 0, the prefill rate at least
    /// [`MIN_TOKEN_MS`], and the rate held at the prior's once it does not stand out from the
    /// noise (where an engine's prefill hides in the noise of its answers, as behind a
    /// simulator running faster than real time, a typical rate still ranks more work as
    /// slower). A bound that binds refits the other coefficients with that one held
    /// ([`bounded`]): clamping a negative coefficient to 0 and keeping the rest would
    /// predict every request too slow by what that coefficient took off.
    pub fn effective(&self) -> [f64; DIM] {
        self.bounded
    }

    fn bound(&self) -> [f64; DIM] {
        bounded(&self.theta, &self.p, self.trusted(1))
    }

    /// Predicted milliseconds from [`Rls::effective`]: more work never costs less.
    pub fn predict(&self, x: &[f64; DIM]) -> f64 {
        let e = self.effective();
        (0..DIM).map(|i| e[i] * x[i]).sum()
    }

    /// Milliseconds one more prefill token costs (the model's marginal rate).
    pub fn ms_per_token(&self) -> f64 {
        self.effective()[1] / 1000.0
    }

    /// The coefficients predictions use, for the routing core ([`kvroute_route::Fit`] predicts
    /// exactly as [`Rls::predict`]).
    pub fn fit(&self) -> kvroute_route::Fit {
        kvroute_route::Fit(self.effective())
    }
}

/// The lower bounds [`Rls::effective`] keeps coefficients to.
const LOWER: [f64; DIM] = [0.0, MIN_TOKEN_MS, 0.0, 0.0];

/// The fit `theta` (with `p`, its inverse normal matrix as the recursion keeps it) under the
/// bounds [`LOWER`], the rate held at the prior's unless `trusted_rate`: of
/// every set of coefficients held at their bounds (the forced one among them), the one whose
/// refit of the others (`θ + P[:,S] P[S,S]⁻¹ (v_S − θ_S)`, the least-squares solution with
/// those held) stays within the bounds and costs the least fit
/// (`(v_S − θ_S)ᵀ P[S,S]⁻¹ (v_S − θ_S)`). With four coefficients that is 16 sets at most.
fn bounded(theta: &[f64; DIM], p: &[[f64; DIM]; DIM], trusted_rate: bool) -> [f64; DIM] {
    let forced: u32 = if trusted_rate { 0 } else { 1 << 1 };
    let mut best: Option<(f64, [f64; DIM])> = None;
    for set in 0u32..(1 << DIM) {
        if set & forced != forced {
            continue;
        }
        let held = |i: usize| set & (1 << i) != 0;
        let value = |i: usize| {
            if i == 1 && forced != 0 {
                PRIOR[1]
            } else {
                LOWER[i]
            }
        };
        // P[S,S] z = v_S − θ_S, identity elsewhere.
        let mut a = [[0.0; DIM]; DIM];
        let mut b = [0.0; DIM];
        for i in 0..DIM {
            if held(i) {
                for j in 0..DIM {
                    if held(j) {
                        a[i][j] = p[i][j];
                    }
                }
                b[i] = value(i) - theta[i];
            } else {
                a[i][i] = 1.0;
            }
        }
        let z = solve(a, b);
        let fit: [f64; DIM] = std::array::from_fn(|i| {
            if held(i) {
                value(i)
            } else {
                theta[i]
                    + (0..DIM)
                        .filter(|j| held(*j))
                        .map(|j| p[i][j] * z[j])
                        .sum::<f64>()
            }
        });
        // The cost is a quadratic form of a positive definite matrix: a negative one is
        // rounding on a near-singular P[S,S], and that set is not trusted.
        let cost: f64 = (0..DIM).filter(|i| held(*i)).map(|i| z[i] * b[i]).sum();
        let within = (0..DIM).all(|i| fit[i].is_finite() && fit[i] >= LOWER[i] - 1e-9);
        if within && cost.is_finite() && cost >= 0.0 && best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, fit));
        }
    }
    // Without a set to trust (non-finite input), each coefficient clamped alone.
    let fit = best.map_or_else(
        || {
            std::array::from_fn(|i| {
                if i == 1 && forced != 0 {
                    PRIOR[1]
                } else {
                    theta[i]
                }
            })
        },
        |(_, fit)| fit,
    );
    std::array::from_fn(|i| {
        if fit[i].is_finite() {
            fit[i].max(LOWER[i])
        } else {
            LOWER[i]
        }
    })
}

/// The weighted least-squares fit the recursion equals: minimizes
/// `Σ λ^(n−i) (y_i − x_iᵀθ)² + λ^n (θ − θ₀)ᵀ P₀⁻¹ (θ − θ₀)`, solved by the normal equations.
pub fn reference_fit(obs: &[([f64; DIM], f64)]) -> [f64; DIM] {
    let (a, b) = normal_equations(obs);
    solve(a, b)
}

/// The normal equations `A θ = b` of [`reference_fit`]'s objective.
fn normal_equations(obs: &[([f64; DIM], f64)]) -> ([[f64; DIM]; DIM], [f64; DIM]) {
    let n = obs.len() as i32;
    let mut a = [[0.0; DIM]; DIM];
    let mut b = [0.0; DIM];
    for i in 0..DIM {
        let prior_w = FORGET.powi(n) / PRIOR_VARIANCE[i];
        a[i][i] += prior_w;
        b[i] += prior_w * PRIOR[i];
    }
    for (k, (x, y)) in obs.iter().enumerate() {
        let w = FORGET.powi(n - 1 - k as i32);
        for i in 0..DIM {
            for j in 0..DIM {
                a[i][j] += w * x[i] * x[j];
            }
            b[i] += w * x[i] * y;
        }
    }
    (a, b)
}

/// Gaussian elimination with partial pivoting.
fn solve(mut a: [[f64; DIM]; DIM], mut b: [f64; DIM]) -> [f64; DIM] {
    for col in 0..DIM {
        let piv = (col..DIM)
            .max_by(|x, y| a[*x][col].abs().total_cmp(&a[*y][col].abs()))
            .unwrap_or(col);
        a.swap(col, piv);
        b.swap(col, piv);
        let d = a[col][col];
        let scale = a.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs()));
        if d.abs() <= 1e-13 * scale {
            // Singular in this column: its unknown is left at 0.
            a[col][col] = 0.0;
            continue;
        }
        for row in col + 1..DIM {
            let f = a[row][col] / d;
            for k in col..DIM {
                a[row][k] -= f * a[col][k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; DIM];
    for i in (0..DIM).rev() {
        let s: f64 = (i + 1..DIM).map(|k| a[i][k] * x[k]).sum();
        x[i] = if a[i][i] == 0.0 {
            0.0
        } else {
            (b[i] - s) / a[i][i]
        };
    }
    x
}

/// A model's coefficients as the admin API shows them.
#[derive(Clone, Debug, Serialize)]
pub struct TtftView {
    pub samples: u64,
    pub fixed_ms: f64,
    pub ms_per_1k_tokens: f64,
    pub ms_per_m_attention_pairs: f64,
    pub ms_per_running_request: f64,
    /// Whether predictions use the fitted prefill rate (else the prior's; see
    /// [`Rls::effective`]).
    pub prefill_rate_learned: bool,
    /// The wait the worker's load recently added to requests sent there (ms,
    /// [`TtftEstimate::load_wait_ms`]).
    pub load_wait_ms: f64,
}

/// Observations a worker's own model needs before it is trusted over the fleet's.
pub const OWN_MODEL_AFTER: u64 = 16;

/// Weight of one placement in a worker's load wait: about the last 32 placements, the
/// seconds within which a conversation's next turn arrives at hundreds of requests per
/// minute; a queue that comes and goes between two decisions is averaged out.
pub const WAIT_WEIGHT: f64 = 1.0 / 32.0;

/// The weight of a decision's sample when `placements` of the fleet's placements (this
/// replica's and, with `[peers] learning`, its peers') were made since the worker's last
/// sample: what `placements` samples of [`WAIT_WEIGHT`] each would have given. One replica
/// samples at every placement (`placements` = 1: [`WAIT_WEIGHT`]); each of N replicas samples
/// about one placement in N, so weighing its samples by the placements between them keeps the
/// mean over the same recent stretch of the fleet's traffic at any replica count.
pub fn wait_weight(placements: u64) -> f64 {
    let k = placements.clamp(1, 1 << 16) as i32;
    1.0 - (1.0 - WAIT_WEIGHT).powi(k)
}

/// One worker's (or the fleet's) TTFT as a plain estimator: the fit and the wait its load
/// recently added ([`TtftModel`] shares the fleet's between threads; a worker's is one of its
/// learners, [`super::learners::Learners`]).
#[derive(Clone, Debug, Default)]
pub struct TtftEstimate {
    rls: Rls,
    /// Exponentially weighted mean, over the fleet's recent placements, of the wait the
    /// worker's load added to a request sent there (ms).
    wait: f64,
}

impl TtftEstimate {
    /// One answered request: the work it asked for and its observed TTFT.
    pub fn observe(&mut self, w: &Work, observed_ms: f64) {
        self.rls.observe(&w.features(), observed_ms);
    }

    /// Records the wait the worker's load adds to a request sent there now (one sample per
    /// routing decision, every candidate alike) with the sample's `weight` ([`wait_weight`]);
    /// a wait that is not a number is ignored.
    pub fn sample_load_wait(&mut self, now_ms: f64, weight: f64) {
        if now_ms.is_finite() {
            self.wait += weight.clamp(0.0, 1.0) * (now_ms.max(0.0) - self.wait);
        }
    }

    /// The wait this worker's load recently added to requests sent there: what a
    /// conversation's later turns sent here can expect.
    pub fn load_wait_ms(&self) -> f64 {
        self.wait
    }

    pub fn samples(&self) -> u64 {
        self.rls.samples()
    }

    /// The coefficients this model predicts with ([`Rls::fit`]).
    pub fn fit(&self) -> kvroute_route::Fit {
        self.rls.fit()
    }

    /// The fit predictions use: this model's once it has seen [`OWN_MODEL_AFTER`] requests,
    /// else `fleet` (the fleet's, read once per decision).
    pub fn fit_or(&self, fleet: kvroute_route::Fit) -> kvroute_route::Fit {
        if self.samples() >= OWN_MODEL_AFTER {
            self.fit()
        } else {
            fleet
        }
    }

    /// What the model has learned, for the admin view.
    pub fn view(&self) -> TtftView {
        let m = &self.rls;
        let t = m.theta();
        TtftView {
            samples: m.samples(),
            fixed_ms: t[0],
            ms_per_1k_tokens: t[1],
            ms_per_m_attention_pairs: t[2],
            ms_per_running_request: t[3],
            prefill_rate_learned: m.trusted(1),
            load_wait_ms: self.wait,
        }
    }
}

/// The fleet's [`TtftEstimate`], shared by every answer that teaches it and every decision
/// that borrows it for a worker without its own yet.
#[derive(Debug, Default)]
pub struct TtftModel {
    inner: Mutex<TtftEstimate>,
}

impl TtftModel {
    /// [`TtftEstimate::observe`].
    pub fn observe(&self, w: &Work, observed_ms: f64) {
        self.inner.lock().observe(w, observed_ms);
    }

    /// [`TtftEstimate::fit`].
    pub fn fit(&self) -> kvroute_route::Fit {
        self.inner.lock().fit()
    }

    /// [`TtftEstimate::view`].
    pub fn view(&self) -> TtftView {
        self.inner.lock().view()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_model_learns_an_engines_prefill_rate_and_fixed_cost() {
        let mut m = Rls::default();
        // An engine with 8 ms fixed cost, 40 µs per token, 2 ms per running request.
        for i in 0..400u64 {
            let w = Work::new((i * 37) % 5000, 0, 200 + (i * 91) % 3000, i % 7);
            let x = w.features();
            let y = 8.0 + 0.04 * (w.queued_tokens + w.own_tokens) as f64 + 2.0 * w.running as f64;
            m.observe(&x, y);
        }
        let t = m.theta();
        assert!((t[0] - 8.0).abs() < 0.05, "{t:?}");
        assert!((t[1] - 40.0).abs() < 0.05, "{t:?}");
        assert!(t[2].abs() < 0.05 && (t[3] - 2.0).abs() < 0.05, "{t:?}");
        assert!((m.ms_per_token() - 0.04).abs() < 1e-4);
    }

    #[test]
    fn more_work_never_predicts_less_time() {
        let mut m = Rls::default();
        // Nonsense observations that would fit a negative slope.
        for i in 0..50u64 {
            let w = Work::new(0, 0, i * 100, 0);
            m.observe(&w.features(), 1000.0 - i as f64 * 10.0);
        }
        let small = m.predict(&Work::new(0, 0, 100, 0).features());
        let big = m.predict(&Work::new(0, 0, 4000, 0).features());
        assert!(big >= small);
    }

    #[test]
    fn before_any_observation_a_model_predicts_from_its_prior() {
        let fleet = TtftModel::default();
        let own = TtftEstimate::default();
        let fit = own.fit_or(fleet.fit());
        let ms = fit.ttft_ms(&Work::new(0, 0, 15_000, 0));
        assert!((ms - 1020.0).abs() < 1e-6, "{ms}");
        assert!((fit.ms_per_token() - 1.0 / 15.0).abs() < 1e-9);
    }

    #[test]
    fn a_worker_borrows_the_fleets_model_until_it_has_its_own() {
        let fleet = TtftModel::default();
        let mut own = TtftEstimate::default();
        // The fleet's engines: 10 ms + 0.4 ms a token; this worker's: 5 ms + 0.04 ms a token.
        let at = |k: u64| Work::new(0, 0, 500 + 250 * (k % 5), 0);
        for k in 0..OWN_MODEL_AFTER * 2 {
            fleet.observe(&at(k), 10.0 + 0.4 * at(k).own_tokens as f64);
        }
        for k in 0..OWN_MODEL_AFTER - 1 {
            own.observe(&at(k), 5.0 + 0.04 * at(k).own_tokens as f64);
        }
        let w = Work::new(0, 0, 1000, 0);
        let from_fleet = own.fit_or(fleet.fit()).ttft_ms(&w);
        own.observe(
            &at(OWN_MODEL_AFTER),
            5.0 + 0.04 * at(OWN_MODEL_AFTER).own_tokens as f64,
        );
        let from_own = own.fit_or(fleet.fit()).ttft_ms(&w);
        assert!((from_fleet - 410.0).abs() < 5.0, "{from_fleet}");
        assert!((from_own - 45.0).abs() < 5.0, "{from_own}");
    }

    #[test]
    fn the_shared_fleet_model_is_the_plain_estimate_behind_a_lock() {
        let (shared, mut plain) = (TtftModel::default(), TtftEstimate::default());
        for k in 0..40u64 {
            let w = Work::new(k * 10, 0, 100 + 30 * (k % 7), k % 3);
            let ms = 12.0 + 0.05 * w.own_tokens as f64;
            shared.observe(&w, ms);
            plain.observe(&w, ms);
        }
        assert_eq!(shared.fit(), plain.fit());
        assert_eq!(shared.view().samples, plain.samples());
    }

    /// A seeded draw, uniform in ±`half_width` (a linear congruential generator).
    fn uniform(rng: &mut u64, half_width: f64) -> f64 {
        *rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*rng >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * half_width
    }

    #[test]
    fn a_prefill_rate_hidden_in_noise_falls_back_to_the_prior() {
        let mut m = Rls::default();
        // 25 ms ± 10 ms whatever the work: no rate to see.
        let mut rng = 12345u64;
        for i in 0..300u64 {
            let noise = uniform(&mut rng, 10.0);
            let w = Work::new((i * 37) % 3000, 0, 100 + (i * 91) % 2000, i % 5);
            m.observe(&w.features(), 25.0 + noise);
        }
        assert_eq!(m.effective()[1], PRIOR[1]);
        assert!((m.ms_per_token() - PRIOR[1] / 1000.0).abs() < 1e-12);
        let small = m.predict(&Work::new(0, 0, 100, 0).features());
        let big = m.predict(&Work::new(0, 0, 3000, 0).features());
        assert!(
            big > small + 100.0,
            "more prefill still ranks as slower: {small} {big}"
        );
    }

    #[test]
    fn a_workers_load_wait_is_the_mean_of_recent_samples_and_forgets_a_passing_queue() {
        let mut m = TtftEstimate::default();
        for _ in 0..256 {
            m.sample_load_wait(40.0, WAIT_WEIGHT);
        }
        assert!(
            (m.load_wait_ms() - 40.0).abs() < 0.1,
            "{}",
            m.load_wait_ms()
        );
        // One decision that saw a long queue moves the mean by a thirty-second of it.
        m.sample_load_wait(360.0, WAIT_WEIGHT);
        assert!(
            (m.load_wait_ms() - 50.0).abs() < 0.1,
            "{}",
            m.load_wait_ms()
        );
        for _ in 0..256 {
            m.sample_load_wait(0.0, WAIT_WEIGHT);
        }
        assert!(m.load_wait_ms() < 0.1);
        m.sample_load_wait(f64::NAN, WAIT_WEIGHT);
        m.sample_load_wait(-5.0, WAIT_WEIGHT);
        assert!(m.load_wait_ms().is_finite() && m.load_wait_ms() >= 0.0);
    }

    #[test]
    fn one_sample_after_k_placements_weighs_what_k_samples_of_the_same_wait_would() {
        for k in [1u64, 2, 3, 7, 32, 100] {
            let (mut once, mut each) = (TtftEstimate::default(), TtftEstimate::default());
            once.sample_load_wait(10.0, WAIT_WEIGHT);
            each.sample_load_wait(10.0, WAIT_WEIGHT);
            once.sample_load_wait(90.0, wait_weight(k));
            for _ in 0..k {
                each.sample_load_wait(90.0, WAIT_WEIGHT);
            }
            assert!(
                (once.load_wait_ms() - each.load_wait_ms()).abs() < 1e-9,
                "k = {k}: {} against {}",
                once.load_wait_ms(),
                each.load_wait_ms()
            );
        }
        assert_eq!(
            wait_weight(0),
            WAIT_WEIGHT,
            "a sample weighs at least one placement"
        );
        assert!(wait_weight(u64::MAX) <= 1.0);
    }

    #[test]
    fn garbage_observations_are_ignored() {
        let mut m = Rls::default();
        m.observe(&[1.0, f64::NAN, 0.0, 0.0], 5.0);
        m.observe(&[1.0, 1.0, 0.0, 0.0], f64::INFINITY);
        assert_eq!(m.samples(), 0);
        assert_eq!(m.theta(), PRIOR);
    }

    /// The weighted least-squares objective [`reference_fit`] minimizes, at `theta`.
    fn objective(obs: &[([f64; DIM], f64)], theta: &[f64; DIM]) -> f64 {
        let n = obs.len() as i32;
        let prior: f64 = (0..DIM)
            .map(|i| FORGET.powi(n) / PRIOR_VARIANCE[i] * (theta[i] - PRIOR[i]).powi(2))
            .sum();
        let fit: f64 = obs
            .iter()
            .enumerate()
            .map(|(k, (x, y))| {
                let r = y - (0..DIM).map(|i| x[i] * theta[i]).sum::<f64>();
                FORGET.powi(n - 1 - k as i32) * r * r
            })
            .sum();
        prior + fit
    }

    /// The literal bounded fit: for every set of coefficients held at their bounds, the
    /// normal equations of the others; the best of those within the bounds.
    fn reference_bounded_fit(obs: &[([f64; DIM], f64)], trusted_rate: bool) -> [f64; DIM] {
        let (a, b) = normal_equations(obs);
        let mut best: Option<(f64, [f64; DIM])> = None;
        for set in 0u32..16 {
            if !trusted_rate && set & 2 == 0 {
                continue;
            }
            let held = |i: usize| set & (1 << i) != 0;
            let v = |i: usize| {
                if i == 1 && !trusted_rate {
                    PRIOR[1]
                } else {
                    LOWER[i]
                }
            };
            let (mut ra, mut rb) = ([[0.0; DIM]; DIM], [0.0; DIM]);
            for i in 0..DIM {
                if held(i) {
                    ra[i][i] = 1.0;
                    rb[i] = v(i);
                } else {
                    for j in 0..DIM {
                        if held(j) {
                            rb[i] -= a[i][j] * v(j);
                        } else {
                            ra[i][j] = a[i][j];
                        }
                    }
                    rb[i] += b[i];
                }
            }
            let theta = solve(ra, rb);
            if (0..DIM).all(|i| theta[i] >= LOWER[i] - 1e-9) {
                let c = objective(obs, &theta);
                if best.is_none_or(|(bc, _)| c < bc) {
                    best = Some((c, theta));
                }
            }
        }
        best.map(|(_, t)| t).unwrap_or([
            LOWER[0],
            if trusted_rate { LOWER[1] } else { PRIOR[1] },
            LOWER[2],
            LOWER[3],
        ])
    }

    #[test]
    fn a_negative_fitted_term_is_held_at_zero_and_the_others_refit_without_it() {
        let mut m = Rls::default();
        // An engine whose answers take 30 ms + 50 µs a token less 4 ms per million attention
        // pairs (a feature that, fitted free, comes out negative): held at 0, the fixed cost
        // and the rate take up the difference, and predictions stay centred on the answers.
        let mut obs = Vec::new();
        for i in 0..400u64 {
            let w = Work::new(0, 1000 + (i * 53) % 3000, 100 + (i * 91) % 1500, 0);
            let x = w.features();
            let y = 30.0 + 0.05 * w.own_tokens as f64 - 4.0 * w.pairs / 1e6;
            m.observe(&x, y);
            obs.push((x, y));
        }
        assert!(m.theta()[2] < -1.0, "{:?}", m.theta());
        let e = m.effective();
        assert_eq!(e[2], 0.0);
        let mean_error = obs.iter().map(|(x, y)| m.predict(x) - y).sum::<f64>() / obs.len() as f64;
        let clamped: [f64; DIM] = std::array::from_fn(|i| m.theta()[i].max(LOWER[i]));
        let clamped_error = obs
            .iter()
            .map(|(x, y)| (0..DIM).map(|i| x[i] * clamped[i]).sum::<f64>() - y)
            .sum::<f64>()
            / obs.len() as f64;
        assert!(mean_error.abs() < 1.0, "{mean_error}");
        assert!(clamped_error > 3.0, "{clamped_error}");
    }

    #[test]
    fn tens_of_thousands_of_answers_whose_attention_work_moves_with_their_tokens_keep_the_fit_sane()
    {
        let mut m = Rls::default();
        // Shared-prefix-like work: ~130 uncached tokens on a 2,048-token cached prefix, so the
        // attention pairs are the token count times a constant; 30 ms + 50 µs a token.
        let mut rng = 99u64;
        for i in 0..30_000u64 {
            let noise = uniform(&mut rng, 3.0);
            let w = Work::new(0, 2048, 120 + i % 20, 0);
            m.observe(&w.features(), 30.0 + 0.05 * w.own_tokens as f64 + noise);
        }
        for i in 0..DIM {
            assert!(m.p[i][i] > 0.0 && m.p[i][i].is_finite(), "{:?}", m.p);
        }
        let at = |u: u64| m.predict(&Work::new(0, 2048, u, 0).features());
        let want = 30.0 + 0.05 * 130.0;
        assert!((at(130) - want).abs() < 2.0, "{} vs {want}", at(130));
        assert!(at(4000) >= at(130));
    }

    /// A model fed `rows` (queued, cached, uncached, running, observed ms), and the
    /// observations as fed.
    fn fitted(rows: Vec<(u64, u64, u64, u64, f64)>) -> (Rls, Vec<([f64; DIM], f64)>) {
        let mut m = Rls::default();
        let mut obs = Vec::new();
        for (q, c, u, r, y) in rows {
            let x = Work::new(q, c, u, r).features();
            m.observe(&x, y);
            obs.push((x, y));
        }
        (m, obs)
    }

    proptest! {
        #[test]
        fn the_bounded_coefficients_fit_as_well_as_the_literal_best_bounded_fit(
            rows in proptest::collection::vec((0u64..20_000, 0u64..8_000, 0u64..4_000, 0u64..64, 0.0f64..5_000.0), 1..80)
        ) {
            let (m, obs) = fitted(rows);
            let got = m.effective();
            for i in 0..DIM {
                prop_assert!(got[i] >= LOWER[i] - 1e-9, "{got:?}");
            }
            if !m.trusted(1) {
                prop_assert_eq!(got[1], PRIOR[1]);
            }
            let want = reference_bounded_fit(&obs, m.trusted(1));
            let (g, w) = (objective(&obs, &got), objective(&obs, &want));
            prop_assert!(g <= w * (1.0 + 1e-6) + 1e-3, "{got:?} {g} vs {want:?} {w}");
            // The rate left free whatever the noise (random answers rarely make it stand out).
            let free = bounded(&m.theta, &m.p, true);
            let want = reference_bounded_fit(&obs, true);
            let (g, w) = (objective(&obs, &free), objective(&obs, &want));
            prop_assert!(g <= w * (1.0 + 1e-6) + 1e-3, "{free:?} {g} vs {want:?} {w}");
        }

        #[test]
        fn the_recursion_equals_the_weighted_least_squares_fit(
            rows in proptest::collection::vec((0u64..20_000, 0u64..8_000, 0u64..4_000, 0u64..64, 0.0f64..5_000.0), 1..120)
        ) {
            let (m, obs) = fitted(rows);
            let want = reference_fit(&obs);
            let got = m.theta();
            // Compare predictions over the observed points (coefficients of collinear
            // features are not identifiable, predictions are).
            for (x, _) in &obs {
                let p: f64 = (0..DIM).map(|i| x[i] * got[i]).sum();
                let q: f64 = (0..DIM).map(|i| x[i] * want[i]).sum();
                prop_assert!((p - q).abs() <= 1e-6 * (1.0 + q.abs()) + 1e-3, "{p} vs {q}");
            }
        }
    }
}
