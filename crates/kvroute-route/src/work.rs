//! What a request asks of a worker, and the TTFT model's prediction of what that takes.
//!
//! Owns: [`Work`] (the prefill queued ahead of a request, its own uncached tokens, its
//! attention work over the cached context, the requests decoding there) and its feature
//! vector; [`Fit`], the coefficients a worker's learned TTFT model predicts with
//! (`ttft = a + b·tokens + c·pairs + d·running`, the learner keeps them bounded so more work
//! never predicts less time).
//! Invariants: the features are `[1, (queued + own)/1000, pairs/1e6, running]`, the order the
//! learner fits them in; a prediction is the coefficients' dot product with them, summed in
//! that order.
//! Must not: learn anything: the gateway's learner fits the coefficients and hands them over.

use serde::{Deserialize, Serialize};

/// The number of features (and coefficients) of the TTFT model.
pub const DIM: usize = 4;

/// What a request asks of one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Work {
    /// Prefill tokens queued ahead of it (in-flight requests' exact uncached tokens).
    pub queued_tokens: u64,
    /// Its own uncached tokens there.
    pub own_tokens: u64,
    /// Attention work of its prefill: uncached × (cached + uncached / 2) token pairs.
    pub pairs: f64,
    /// Requests running (decoding) there.
    pub running: u64,
}

impl Work {
    pub fn new(queued_tokens: u64, cached: u64, uncached: u64, running: u64) -> Work {
        Work {
            queued_tokens,
            own_tokens: uncached,
            pairs: uncached as f64 * (cached as f64 + uncached as f64 / 2.0),
            running,
        }
    }

    pub fn features(&self) -> [f64; DIM] {
        [
            1.0,
            (self.queued_tokens + self.own_tokens) as f64 / 1000.0,
            self.pairs / 1e6,
            self.running as f64,
        ]
    }
}

/// The coefficients a worker's TTFT model predicts with: fixed ms, ms per 1,000 tokens, ms per
/// million attention pairs, ms per running request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fit(pub [f64; DIM]);

impl Fit {
    /// Predicted milliseconds for `x` (a [`Work::features`] vector).
    pub fn predict(&self, x: &[f64; DIM]) -> f64 {
        let e = &self.0;
        (0..DIM).map(|i| e[i] * x[i]).sum()
    }

    /// Milliseconds one more prefill token costs (the model's marginal rate).
    pub fn ms_per_token(&self) -> f64 {
        self.0[1] / 1000.0
    }

    /// The prediction for `w`.
    pub fn ttft_ms(&self, w: &Work) -> f64 {
        self.predict(&w.features())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prediction_is_the_coefficients_dot_the_features() {
        let f = Fit([20.0, 66.0, 3.0, 2.0]);
        let w = Work::new(1000, 500, 1000, 4);
        // features: 1, 2.0 (queued + own = 2,000 tokens), 1.0 (1,000 × 1,000 pairs), 4.
        assert_eq!(w.features(), [1.0, 2.0, 1.0, 4.0]);
        assert_eq!(f.ttft_ms(&w), 20.0 + 132.0 + 3.0 + 8.0);
        assert_eq!(f.ms_per_token(), 0.066);
        assert_eq!(f.ttft_ms(&Work::default()), 20.0);
    }
}
