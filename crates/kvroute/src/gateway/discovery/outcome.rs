//! How one discovery refresh went (its own module so the lookups, [`super::dns`] and
//! [`super::dir`], and the loop that counts and logs it share it without importing each other).
//!
//! Owns: [`Outcome`] and its metric label.
//! Must not: import anything of the gateway.

/// How a refresh went, as the `result` label of `kvroute_discovery_resolutions_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// An empty answer (no records, no files): the last good set is kept.
    Empty,
    Error,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Empty => "empty",
            Outcome::Error => "error",
        }
    }
}
