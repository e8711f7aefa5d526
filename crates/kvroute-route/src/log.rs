//! The decision log: one decision with everything it was decided from, as one JSON line.
//!
//! Owns: [`Entry`] (policy, weights, request facts, snapshot, the decision as reported, and
//! what each candidate would book: its work, prefill rate and checkpoints, which the decision's
//! JSON leaves out) and [`Entry::replay`], the decision the core gives for the entry's inputs
//! now.
//! Invariants: a line parses back to the same inputs bit for bit (floats round-trip); the
//! recorded decision carries no timing (`decision_us` 0) and no per-group evidence, so a
//! replay of the same inputs equals it exactly.
//! Must not: write files (the gateway does), or read a clock.

use crate::config::{PolicyKind, PolicyWeights};
use crate::decide::{decide, Decision};
use crate::snapshot::{RequestFacts, Snapshot};
use crate::work::Work;
use serde::{Deserialize, Serialize};

/// One logged decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub policy: PolicyKind,
    pub weights: PolicyWeights,
    pub request: RequestFacts,
    pub snapshot: Snapshot,
    /// The decision as the gateway reports it, without timing or per-group evidence.
    pub decision: serde_json::Value,
    /// What each ranked candidate would book, in rank order.
    pub bookings: Vec<Booking>,
}

/// What a ranked candidate books if the request goes there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Booking {
    pub worker: String,
    pub work: Work,
    pub ms_per_token: f64,
    pub checkpoints: [u64; 2],
}

/// The decision's report without what varies between runs of the same inputs.
fn comparable(d: &Decision) -> serde_json::Value {
    let mut d = d.clone();
    d.decision_us = 0;
    d.groups.clear();
    serde_json::to_value(&d).unwrap_or(serde_json::Value::Null)
}

fn bookings(d: &Decision) -> Vec<Booking> {
    d.candidates
        .iter()
        .map(|c| Booking {
            worker: c.worker.to_string(),
            work: c.work,
            ms_per_token: c.ms_per_token,
            checkpoints: c.checkpoints,
        })
        .collect()
}

impl Entry {
    pub fn new(
        policy: PolicyKind,
        weights: &PolicyWeights,
        request: &RequestFacts,
        snapshot: &Snapshot,
        decision: &Decision,
    ) -> Entry {
        Entry {
            policy,
            weights: weights.clone(),
            request: *request,
            snapshot: snapshot.clone(),
            decision: comparable(decision),
            bookings: bookings(decision),
        }
    }

    /// The entry as one line of JSON, newline included.
    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_default();
        s.push('\n');
        s
    }

    /// The decision and bookings the core gives for this entry's inputs.
    pub fn replay(&self) -> (serde_json::Value, Vec<Booking>) {
        let d = decide(self.policy, &self.weights, &self.request, &self.snapshot);
        (comparable(&d), bookings(&d))
    }
}
