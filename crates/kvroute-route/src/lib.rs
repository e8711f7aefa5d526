//! kvroute's routing core: a snapshot of the candidates and a request in, a ranked decision
//! with its evidence out.
//!
//! Owns: the policy configuration as plain data ([`config`]), the snapshot a decision reads
//! ([`snapshot`]), each cost term as one named function ([`terms`]), the TTFT model's
//! prediction from learned coefficients ([`work`]), the ranking ([`rank`]) and the decision
//! ([`decide`]).
//! Invariants: [`decide::decide`] is a pure function — the same inputs give the same decision
//! byte for byte, whoever calls it and however often (`/admin/explain` included).
//! Must not: do I/O, read a clock, take a lock, spawn a task, or change a learner: the gateway's
//! fleet state builds the snapshot and applies observations.

pub mod config;
pub mod decide;
pub mod log;
pub mod rank;
pub mod snapshot;
pub mod terms;
pub mod work;

pub use config::{CostModel, PolicyKind, PolicyWeights, PrefillStall};
pub use decide::{decide, prompt_checkpoint, Decision};
pub use rank::{blind_gap, rank, BlindGap, Candidate};
pub use snapshot::{FleetFacts, LiveFacts, Outlook, RequestFacts, Snapshot, WorkerFacts};
pub use work::{Fit, Work, DIM};
