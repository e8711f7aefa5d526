//! kvroute-index: the hybrid cache index.
//!
//! Owns the engine-neutral event model, engine-identical block hashing, the per-(worker, rank,
//! group) holders, vLLM's per-kind reuse rules and their joint fixed point, and a literal
//! reference model the fast index is tested against.
//! Must not: know about wire formats, sockets or HTTP.

pub mod event;

pub use event::*;
mod chains;
pub mod counters;
pub mod engine;
pub mod ghosts;
pub mod hash;
pub mod holder;
pub mod image;
pub mod index;
pub mod layout;
pub mod rank;
pub mod rules;
pub mod runs;
mod sparse;
pub mod tier;
mod tier_lookup;

pub use engine::{Engine, Rules, Speculative};
pub use hash::{BlockExtras, HashAlgo};
pub use image::{ImageError, RankImage};
pub use index::{Detail, EvictionStats, Index, IndexStats, Prediction, Query, RankId};
pub use layout::{GroupSpec, Layout, LookupConfig, Params};
pub use rank::{HashMode, RankStats, WorkerConfig};
pub use sparse::Hit;
pub mod reference;
