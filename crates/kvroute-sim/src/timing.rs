//! The step time model: how long one engine step takes, in simulated seconds.
//!
//! Owns: `TimeModel` (a fixed cost per step, a cost per prefill token, attention's quadratic
//! term over the prefill context, a cost per decoding sequence and per context token it
//! reads, the time a disaggregated decode worker takes to pull one token's KV from its
//! prefill worker, and the time a CPU tier takes to load one) and `StepWork`, the tally of one step.
//! Invariants: durations are non-negative and grow with every term; the defaults are the
//! calibration documented in docs/sim.md.
//! Must not: sleep (the worker runtime turns simulated time into wall time).

use serde::{Deserialize, Serialize};

/// Per-step cost model. Defaults: an 8B-class dense model on one H100-class GPU, order of
/// magnitude only (see docs/sim.md).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimeModel {
    /// Fixed cost of one step (scheduling, kernel launches, sampling).
    pub step_overhead_s: f64,
    /// Linear cost per prefill token (weights: MLP and projections).
    pub prefill_token_s: f64,
    /// Attention's quadratic term: per (new token × context token) pair in prefill.
    pub attention_pair_s: f64,
    /// Cost per sequence in a decode step.
    pub decode_seq_s: f64,
    /// Cost per context token a decoding sequence reads (KV bandwidth).
    pub decode_context_token_s: f64,
    /// Time to pull one prompt token's KV from a prefill worker (disaggregated serving; the
    /// pull runs beside the decode worker's steps, as NIXL's does).
    #[serde(default = "default_kv_transfer_token_s")]
    pub kv_transfer_token_s: f64,
    /// Time to load one prompt token's KV from the CPU tier (before the request's prefill
    /// resumes, beside the steps, as the connector's asynchronous load does).
    #[serde(default = "default_cpu_load_token_s")]
    pub cpu_load_token_s: f64,
}

/// 5 µs a token: an 8B-class model's KV (about 128 KiB a token: 32 layers × 8 KV heads × 128
/// dims × K and V × 2 bytes) over a 25 GB/s RDMA link, order of magnitude only.
fn default_kv_transfer_token_s() -> f64 {
    5e-6
}

/// 5 µs a token: the same 128 KiB a token over a PCIe 4.0 ×16 link (about 25 GB/s), order of
/// magnitude only.
fn default_cpu_load_token_s() -> f64 {
    5e-6
}

impl Default for TimeModel {
    fn default() -> Self {
        TimeModel {
            step_overhead_s: 0.004,
            prefill_token_s: 60e-6,
            attention_pair_s: 2e-9,
            decode_seq_s: 0.2e-3,
            decode_context_token_s: 5e-9,
            kv_transfer_token_s: default_kv_transfer_token_s(),
            cpu_load_token_s: default_cpu_load_token_s(),
        }
    }
}

/// What one step computes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepWork {
    pub prefill_tokens: u64,
    /// Σ over prefill chunks of new tokens × mean context length they attend to.
    pub attention_pairs: f64,
    pub decode_seqs: u64,
    pub decode_context_tokens: u64,
}

impl StepWork {
    /// A prefill chunk of `n` tokens after `computed` tokens.
    pub fn prefill(&mut self, computed: usize, n: usize) {
        self.prefill_tokens += n as u64;
        self.attention_pairs += n as f64 * (computed as f64 + (n as f64 + 1.0) / 2.0);
    }

    /// One decoding sequence with `context` tokens before it.
    pub fn decode(&mut self, context: usize) {
        self.decode_seqs += 1;
        self.decode_context_tokens += context as u64;
    }
}

impl TimeModel {
    pub fn step_seconds(&self, w: &StepWork) -> f64 {
        let t = self.step_overhead_s
            + self.prefill_token_s * w.prefill_tokens as f64
            + self.attention_pair_s * w.attention_pairs
            + self.decode_seq_s * w.decode_seqs as f64
            + self.decode_context_token_s * w.decode_context_tokens as f64;
        t.max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_longer_prefill_costs_more_than_linearly() {
        let m = TimeModel::default();
        let mut a = StepWork::default();
        a.prefill(0, 1000);
        let mut b = StepWork::default();
        b.prefill(0, 8000);
        let (ta, tb) = (m.step_seconds(&a), m.step_seconds(&b));
        assert!(tb - m.step_overhead_s > 8.0 * (ta - m.step_overhead_s));
    }

    #[test]
    fn a_reused_prefix_shortens_the_prefill() {
        let m = TimeModel::default();
        let mut cold = StepWork::default();
        cold.prefill(0, 4096);
        let mut warm = StepWork::default();
        warm.prefill(3584, 512);
        assert!(m.step_seconds(&warm) < m.step_seconds(&cold) / 4.0);
    }
}
