//! The vocabulary of decoding: dialects, limits, and every reason a batch, event or field is
//! refused.
//!
//! Owns: [`Dialect`], [`Limits`], [`DropReason`] (with its [`Cost`]), [`Dropped`],
//! [`BatchError`] and [`BatchErrorReason`].
//! Invariants: every reason has a stable snake_case name (`name()`), used verbatim as a metric
//! label and in docs/wire.md; `ALL` lists every variant once, in a fixed order. Renaming a
//! name is a breaking change for dashboards.
//! Must not: decode anything or hold state.

use crate::msgpack::MsgError;
use serde::Serialize;
use std::fmt;

/// Which engine family produced the stream. The framing is identical; see docs/wire.md for
/// the (small) differences.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Dialect {
    /// vLLM, every generation (maps or positional arrays, optional group fields).
    #[default]
    Vllm,
    /// SGLang: signed hashes, `[ts, events, attn_dp_rank]`, no group fields, optional
    /// `cache_salt`; positional events stop after `medium`.
    Sglang,
}

impl Dialect {
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
        }
    }

    pub fn parse(s: &str) -> Option<Dialect> {
        match s.to_ascii_lowercase().as_str() {
            "vllm" => Some(Dialect::Vllm),
            "sglang" => Some(Dialect::Sglang),
            _ => None,
        }
    }
}

/// Bounds that keep a hostile or broken payload from costing more than it is worth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Larger payloads are refused unread.
    pub max_payload_bytes: usize,
    /// Container nesting allowed anywhere in a payload (batch = 1, events = 2, event = 3).
    pub max_depth: usize,
    /// Events in one batch; more refuses the batch.
    pub max_events: usize,
    /// Hashes in one event; more drops the event.
    pub max_hashes_per_event: usize,
    /// Token ids in one event; more drops the event.
    pub max_tokens_per_event: usize,
    /// Hashes decoded from one batch; events past the budget are dropped.
    pub max_hashes_per_batch: usize,
    /// Longest raw (bytes) hash accepted.
    pub max_hash_bytes: usize,
    /// Longest short string accepted (medium, kind, lora name, locality, …).
    pub max_string_bytes: usize,
    /// Nesting allowed inside one `extra_keys` entry.
    pub max_extra_key_depth: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_payload_bytes: 16 << 20,
            max_depth: 32,
            max_events: 1 << 20,
            max_hashes_per_event: 1 << 20,
            max_tokens_per_event: 1 << 24,
            max_hashes_per_batch: 1 << 22,
            max_hash_bytes: 64,
            max_string_bytes: 4096,
            max_extra_key_depth: 8,
        }
    }
}

/// What a [`DropReason`] costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cost {
    /// The event is not delivered.
    Event,
    /// The event is delivered without that field (or the batch without its `ts`).
    Field,
}

macro_rules! reasons {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $v:ident => $s:literal;)* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        $vis enum $name { $($(#[$vm])* $v,)* }
        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v,)*];
            /// The stable metric label.
            pub fn name(self) -> &'static str { match self { $($name::$v => $s,)* } }
            pub(crate) fn index(self) -> usize { self as usize }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.name()) }
        }
    };
}

reasons! {
    /// Why (part of) one event was not delivered. See docs/wire.md for each meaning.
    pub enum DropReason {
        /// An element of `events` is neither a map nor an array.
        NotAnEvent => "not_an_event";
        /// A map without `"type"`, or an empty array.
        MissingEventType => "missing_event_type";
        /// The tag is not a UTF-8 string.
        InvalidEventType => "invalid_event_type";
        /// A well-formed tag this router does not know (counted and skipped).
        UnknownEventType => "unknown_event_type";
        /// `block_hashes` missing, nil, not a list, or with an element that is not a hash.
        InvalidBlockHashes => "invalid_block_hashes";
        /// More hashes in one event than [`Limits::max_hashes_per_event`].
        TooManyBlockHashes => "too_many_block_hashes";
        /// `parent_block_hash` present, not nil and not a hash (nil would mean "no parent").
        InvalidParentBlockHash => "invalid_parent_block_hash";
        /// `token_ids` missing, nil, not a list, or an element outside `[0, 2^32)`.
        InvalidTokenIds => "invalid_token_ids";
        /// More token ids in one event than [`Limits::max_tokens_per_event`].
        TooManyTokenIds => "too_many_token_ids";
        /// `block_size` missing or not an integer in `[1, 2^32)`.
        InvalidBlockSize => "invalid_block_size";
        /// `medium` neither nil nor a short UTF-8 string (nil would mean the device tier).
        InvalidMedium => "invalid_medium";
        /// `group_idx` present but not an integer in `[0, 2^32)` (bools refused).
        InvalidGroupIdx => "invalid_group_idx";
        /// `kv_cache_spec_kind` present but not a non-empty short UTF-8 string.
        InvalidKvCacheSpecKind => "invalid_kv_cache_spec_kind";
        /// `kv_cache_spec_sliding_window` present but not an integer in `[1, 2^32)`.
        InvalidKvCacheSpecSlidingWindow => "invalid_kv_cache_spec_sliding_window";
        /// A sliding-window kind without its window: the reuse rule cannot be applied.
        MissingKvCacheSpecSlidingWindow => "missing_kv_cache_spec_sliding_window";
        /// The batch already decoded [`Limits::max_hashes_per_batch`] hashes.
        BatchHashBudgetExceeded => "batch_hash_budget_exceeded";
        /// `lora_id` neither nil nor a 64-bit signed integer.
        InvalidLoraId => "invalid_lora_id";
        /// `lora_name` neither nil nor a short UTF-8 string.
        InvalidLoraName => "invalid_lora_name";
        /// `extra_keys` not a list of one entry per hash, or an entry this model cannot hold.
        InvalidExtraKeys => "invalid_extra_keys";
        /// `locality` neither nil nor a string.
        InvalidLocality => "invalid_locality";
        /// `ownership` neither nil, a string nor an integer.
        InvalidOwnership => "invalid_ownership";
        /// `session_id` neither nil, a string nor an integer.
        InvalidSessionId => "invalid_session_id";
        /// SGLang `cache_salt` neither nil nor a short UTF-8 string.
        InvalidCacheSalt => "invalid_cache_salt";
        /// vLLM 0.33 `lookahead_token_ids` not a list of one equally long, non-empty list of
        /// token ids (each in `[0, 2^32)`) per hash.
        InvalidLookaheadTokenIds => "invalid_lookahead_token_ids";
        /// The batch's `ts` is not a number (the batch is kept; lag is not measured).
        InvalidTs => "invalid_ts";
    }
}

impl DropReason {
    /// What this reason costs: the event, or only the field it names.
    pub fn cost(self) -> Cost {
        match self {
            DropReason::InvalidLoraId
            | DropReason::InvalidLoraName
            | DropReason::InvalidExtraKeys
            | DropReason::InvalidLocality
            | DropReason::InvalidOwnership
            | DropReason::InvalidSessionId
            | DropReason::InvalidCacheSalt
            | DropReason::InvalidLookaheadTokenIds
            | DropReason::InvalidTs => Cost::Field,
            _ => Cost::Event,
        }
    }
}

/// One refused event or field, with a human-readable detail (event index, what was seen).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Dropped {
    pub reason: DropReason,
    pub detail: String,
}

reasons! {
    /// Why a whole batch was refused. Every variant costs the batch.
    pub enum BatchErrorReason {
        /// Larger than [`Limits::max_payload_bytes`].
        PayloadTooLarge => "payload_too_large";
        /// Not well-formed msgpack (truncated, reserved marker, trailing bytes).
        MalformedMsgpack => "malformed_msgpack";
        /// Nested deeper than [`Limits::max_depth`].
        TooDeep => "too_deep";
        /// The top-level value is not an array.
        BatchNotAnArray => "batch_not_an_array";
        /// An array of fewer than two elements (`[ts, events]` is the oldest layout).
        BatchTooShort => "batch_too_short";
        /// `events` is not a list.
        EventsNotAList => "events_not_a_list";
        /// More events than [`Limits::max_events`].
        TooManyEvents => "too_many_events";
        /// The third element is neither nil nor an integer in `[0, 2^32)`.
        InvalidDpRank => "invalid_dp_rank";
    }
}

/// A batch that could not be decoded at all; none of its events are delivered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct BatchError {
    pub reason: BatchErrorReason,
    pub detail: String,
}

impl BatchError {
    pub(crate) fn new(reason: BatchErrorReason, detail: impl Into<String>) -> BatchError {
        BatchError {
            reason,
            detail: detail.into(),
        }
    }
}

impl From<MsgError> for BatchError {
    fn from(e: MsgError) -> BatchError {
        let reason = match e {
            MsgError::TooDeep => BatchErrorReason::TooDeep,
            _ => BatchErrorReason::MalformedMsgpack,
        };
        BatchError::new(reason, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn reason_names_are_unique_snake_case_labels() {
        let mut seen = HashSet::new();
        let names = DropReason::ALL
            .iter()
            .map(|r| r.name())
            .chain(BatchErrorReason::ALL.iter().map(|r| r.name()));
        for n in names {
            assert!(seen.insert(n), "duplicate {n}");
            assert!(n.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{n}");
        }
        for (i, r) in DropReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}
