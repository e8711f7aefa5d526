//! Decoding one msgpack event batch into normalized [`Event`]s.
//!
//! Owns: [`decode_batch`] / [`decode_batch_with`] and [`DecodedBatch`]: the batch layouts
//! `[ts, events, dp_rank]` and `[ts, events]`, events as tagged maps or positional arrays
//! (vLLM 0.32's fields and 0.33's `lookahead_token_ids`), hash normalization and the
//! validation rules of docs/wire.md.
//! Invariants: a batch is checked structurally before any event is decoded, so it is delivered
//! whole (minus individually dropped events/fields) or not at all; each event either becomes
//! exactly one [`Event`] or one [`Dropped`] with an event-costing reason; a field-costing
//! problem records a [`Dropped`] and delivers the event without that field; a group field that
//! is present but unusable never lets its event be filed under group `None`.
//! Must not: panic, allocate in proportion to a claimed length, count metrics or log (that is
//! [`crate::stats`]'s job), or know about sockets and sequence numbers.

use crate::msgpack::{check_document, open, Head, Reader};
use crate::reasons::{BatchError, BatchErrorReason, Dialect, DropReason, Dropped, Limits};
use kvroute_index::{Cleared, Event, KeyValue, Removed, Stored, WorkerId};
use serde::Serialize;

mod fields;

/// The decoded content of one batch.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DecodedBatch {
    /// The engine's timestamp (seconds since the epoch), when it sent a number.
    pub ts: Option<f64>,
    /// The rank the batch names (third element), when present and not nil.
    pub dp_rank: Option<u32>,
    /// Events in wire order; each carries `dp_rank.unwrap_or(0)`.
    pub events: Vec<Event>,
    /// Everything that was refused, in wire order.
    pub drops: Vec<Dropped>,
}

impl DecodedBatch {
    /// Re-files every event under `rank` (the rank implied by the subscription's port).
    pub fn set_dp_rank(&mut self, rank: u32) {
        for e in &mut self.events {
            match e {
                Event::Stored(s) => s.dp_rank = rank,
                Event::Removed(r) => r.dp_rank = rank,
                Event::Cleared(c) => c.dp_rank = rank,
            }
        }
    }
}

/// Decodes one batch payload with the default [`Limits`].
pub fn decode_batch(
    worker: &WorkerId,
    payload: &[u8],
    dialect: Dialect,
) -> Result<DecodedBatch, BatchError> {
    decode_batch_with(worker, payload, dialect, &Limits::default())
}

/// Decodes one batch payload. An `Err` costs the whole batch; anything smaller is reported in
/// [`DecodedBatch::drops`].
pub fn decode_batch_with(
    worker: &WorkerId,
    payload: &[u8],
    dialect: Dialect,
    limits: &Limits,
) -> Result<DecodedBatch, BatchError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(BatchError::new(
            BatchErrorReason::PayloadTooLarge,
            format!("{} bytes > {}", payload.len(), limits.max_payload_bytes),
        ));
    }
    check_document(payload, limits.max_depth)?;
    let (head, mut r) = open(payload)?;
    let n = match head {
        Head::Array(n) => n,
        other => {
            return Err(BatchError::new(
                BatchErrorReason::BatchNotAnArray,
                format!("top-level {}", other.type_name()),
            ))
        }
    };
    if n < 2 {
        return Err(BatchError::new(
            BatchErrorReason::BatchTooShort,
            format!("{n} elements"),
        ));
    }
    let mut out = DecodedBatch::default();
    let ts_raw = r.value_slice(limits.max_depth)?;
    out.ts = match open(ts_raw)?.0 {
        Head::F64(v) => Some(v),
        Head::F32(v) => Some(f64::from(v)),
        Head::Uint(v) => Some(v as f64),
        Head::Neg(v) => Some(v as f64),
        Head::Nil => None,
        other => {
            out.drops.push(Dropped {
                reason: DropReason::InvalidTs,
                detail: format!("ts is {}", other.type_name()),
            });
            None
        }
    };
    let events_raw = r.value_slice(limits.max_depth)?;
    if n >= 3 {
        let rank_raw = r.value_slice(limits.max_depth)?;
        out.dp_rank = match open(rank_raw)?.0 {
            Head::Nil => None,
            Head::Uint(v) => Some(u32::try_from(v).map_err(|_| {
                BatchError::new(BatchErrorReason::InvalidDpRank, format!("{v} ≥ 2^32"))
            })?),
            other => {
                return Err(BatchError::new(
                    BatchErrorReason::InvalidDpRank,
                    format!("dp_rank is {}", describe(&other)),
                ))
            }
        };
    }
    // Further elements belong to future layouts and are ignored.
    let (events_head, mut er) = open(events_raw)?;
    let count = match events_head {
        Head::Array(c) => c,
        other => {
            return Err(BatchError::new(
                BatchErrorReason::EventsNotAList,
                format!("events is {}", other.type_name()),
            ))
        }
    };
    if count as usize > limits.max_events {
        return Err(BatchError::new(
            BatchErrorReason::TooManyEvents,
            format!("{count} events > {}", limits.max_events),
        ));
    }
    let mut ctx = Ctx {
        worker,
        dp_rank: out.dp_rank.unwrap_or(0),
        dialect,
        limits,
        hashes_left: limits.max_hashes_per_batch,
        drops: Vec::new(),
    };
    out.events.reserve(count as usize);
    for i in 0..count as usize {
        let raw = er.value_slice(limits.max_depth)?;
        match ctx.event(raw) {
            Ok(ev) => {
                out.events.push(ev);
                for d in ctx.drops.drain(..) {
                    out.drops.push(Dropped {
                        reason: d.reason,
                        detail: format!("event {i}: {}", d.detail),
                    });
                }
            }
            Err((reason, detail)) => {
                // Field problems of a refused event are moot.
                ctx.drops.clear();
                out.drops.push(Dropped {
                    reason,
                    detail: format!("event {i}: {detail}"),
                });
            }
        }
    }
    Ok(out)
}

type Refusal = (DropReason, String);

/// The known fields, by name; each holds the raw bytes of exactly one msgpack value.
#[derive(Clone, Copy, PartialEq, Eq)]
enum F {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    Kind,
    Window,
    Locality,
    Ownership,
    SessionId,
    CacheSalt,
    Lookahead,
}
const NF: usize = 16;

const STORED_POSITIONS: [F; 15] = [
    F::BlockHashes,
    F::Parent,
    F::TokenIds,
    F::BlockSize,
    F::LoraId,
    F::Medium,
    F::LoraName,
    F::ExtraKeys,
    F::GroupIdx,
    F::Kind,
    F::Window,
    F::Locality,
    F::Ownership,
    F::SessionId,
    F::Lookahead,
];
const REMOVED_POSITIONS: [F; 5] = [
    F::BlockHashes,
    F::Medium,
    F::GroupIdx,
    F::Locality,
    F::Ownership,
];
/// SGLang's positional events stop after `medium`.
const SGLANG_STORED_POSITIONS: usize = 6;
const SGLANG_REMOVED_POSITIONS: usize = 2;

fn field_by_name(key: &[u8], dialect: Dialect) -> Option<F> {
    Some(match key {
        b"block_hashes" => F::BlockHashes,
        b"parent_block_hash" => F::Parent,
        b"token_ids" => F::TokenIds,
        b"block_size" => F::BlockSize,
        b"lora_id" => F::LoraId,
        b"medium" => F::Medium,
        b"lora_name" => F::LoraName,
        b"extra_keys" => F::ExtraKeys,
        b"group_idx" => F::GroupIdx,
        b"kv_cache_spec_kind" => F::Kind,
        b"kv_cache_spec_sliding_window" => F::Window,
        b"locality" => F::Locality,
        b"ownership" => F::Ownership,
        b"session_id" => F::SessionId,
        b"lookahead_token_ids" => F::Lookahead,
        b"cache_salt" if dialect == Dialect::Sglang => F::CacheSalt,
        _ => return None,
    })
}

#[derive(Default)]
struct Fields<'a>([Option<&'a [u8]>; NF]);

impl<'a> Fields<'a> {
    fn get(&self, f: F) -> Option<&'a [u8]> {
        self.0.get(f as usize).copied().flatten()
    }
    fn set(&mut self, f: F, raw: &'a [u8]) {
        if let Some(slot) = self.0.get_mut(f as usize) {
            *slot = Some(raw);
        }
    }
    /// The field's head, with nil folded into "absent".
    fn head(&self, f: F) -> Option<(Head<'a>, Reader<'a>)> {
        let raw = self.get(f)?;
        match open(raw) {
            Ok((Head::Nil, _)) | Err(_) => None,
            Ok(hr) => Some(hr),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

struct Ctx<'w, 'l> {
    worker: &'w WorkerId,
    dp_rank: u32,
    dialect: Dialect,
    limits: &'l Limits,
    hashes_left: usize,
    /// Field-costing drops of the event being decoded.
    drops: Vec<Dropped>,
}

impl Ctx<'_, '_> {
    fn event(&mut self, raw: &[u8]) -> Result<Event, Refusal> {
        let depth = self.limits.max_depth;
        let malformed = |e: crate::msgpack::MsgError| (DropReason::NotAnEvent, e.to_string());
        let (head, mut r) = open(raw).map_err(malformed)?;
        let mut fields = Fields::default();
        let tag = match head {
            Head::Map(n) => {
                let mut tag = None;
                for _ in 0..n {
                    let key = r.head().map_err(malformed)?;
                    let val = r.value_slice(depth).map_err(malformed)?;
                    let Head::Str(k) = key else { continue };
                    if k == b"type" {
                        tag = Some(val);
                    } else if let Some(f) = field_by_name(k, self.dialect) {
                        fields.set(f, val);
                    }
                }
                let tag_raw = tag.ok_or((
                    DropReason::MissingEventType,
                    "map without \"type\"".to_string(),
                ))?;
                parse_tag(tag_raw)?
            }
            Head::Array(n) => {
                if n == 0 {
                    return Err((DropReason::MissingEventType, "empty array".into()));
                }
                let tag = parse_tag(r.value_slice(depth).map_err(malformed)?)?;
                let positions: &[F] = match (tag, self.dialect) {
                    (Tag::Stored, Dialect::Vllm) => &STORED_POSITIONS,
                    (Tag::Stored, Dialect::Sglang) => &STORED_POSITIONS[..SGLANG_STORED_POSITIONS],
                    (Tag::Removed, Dialect::Vllm) => &REMOVED_POSITIONS,
                    (Tag::Removed, Dialect::Sglang) => {
                        &REMOVED_POSITIONS[..SGLANG_REMOVED_POSITIONS]
                    }
                    (Tag::Cleared, _) => &[],
                };
                // Longer (future) arrays: the extra positions are ignored, unread.
                for f in positions.iter().take(n as usize - 1) {
                    fields.set(*f, r.value_slice(depth).map_err(malformed)?);
                }
                tag
            }
            other => {
                return Err((
                    DropReason::NotAnEvent,
                    format!("event is {}", other.type_name()),
                ))
            }
        };
        match tag {
            Tag::Stored => self.stored(&fields).map(Event::Stored),
            Tag::Removed => self.removed(&fields).map(Event::Removed),
            Tag::Cleared => Ok(Event::Cleared(Cleared {
                worker: self.worker.clone(),
                dp_rank: self.dp_rank,
            })),
        }
    }

    fn stored(&mut self, f: &Fields<'_>) -> Result<Stored, Refusal> {
        let medium = self.medium(f)?;
        let (group, kind, sliding_window) = self.group(f)?;
        let hashes = self.hashes(f)?;
        let parent = match f.head(F::Parent) {
            None => None,
            Some((h, _)) => Some(self.hash(h).map_err(|d| {
                (
                    DropReason::InvalidParentBlockHash,
                    format!("parent_block_hash {d}"),
                )
            })?),
        };
        let token_ids = self.token_ids(f)?;
        // vLLM's OffloadingConnector announces each CPU chunk with its last block's hash, no
        // tokens and block size 0: a tier entry, kept (tiers are hash sets, their block size is
        // not used). A device store needs a real block size.
        let tier = !kvroute_index::event::is_device_medium(medium.as_deref());
        let block_size = match f.head(F::BlockSize) {
            Some((Head::Uint(v), _)) if v >= 1 && v <= u64::from(u32::MAX) => v as u32,
            Some((Head::Uint(0), _)) if tier => 0,
            other => {
                return Err((
                    DropReason::InvalidBlockSize,
                    format!("block_size is {}", describe_opt(other.map(|x| x.0))),
                ))
            }
        };
        let extra_keys = self.extra_keys(f, hashes.len());
        let lora_id = match f.head(F::LoraId) {
            None => None,
            Some((Head::Uint(v), _)) if i64::try_from(v).is_ok() => i64::try_from(v).ok(),
            Some((Head::Neg(v), _)) => Some(v),
            Some((h, _)) => {
                self.field_drop(
                    DropReason::InvalidLoraId,
                    format!("lora_id is {}", describe(&h)),
                );
                None
            }
        };
        let lora_name = self.opt_string(f, F::LoraName, DropReason::InvalidLoraName, "lora_name");
        let lookahead_token_ids = self.lookahead(f, hashes.len());
        self.check_lenient(f);
        let extra_keys = match (extra_keys, self.salt(f)) {
            (None, Some(salt)) => Some(vec![Some(KeyValue::Str(salt)); hashes.len()]),
            (keys, _) => keys,
        };
        Ok(Stored {
            worker: self.worker.clone(),
            dp_rank: self.dp_rank,
            medium,
            group,
            kind,
            sliding_window,
            block_size,
            parent,
            hashes,
            token_ids,
            extra_keys,
            lora_id,
            lora_name,
            lookahead_token_ids,
        })
    }

    fn removed(&mut self, f: &Fields<'_>) -> Result<Removed, Refusal> {
        let medium = self.medium(f)?;
        let (group, _, _) = self.group(f)?;
        let hashes = self.hashes(f)?;
        self.check_lenient(f);
        Ok(Removed {
            worker: self.worker.clone(),
            dp_rank: self.dp_rank,
            medium,
            group,
            hashes,
        })
    }

    fn field_drop(&mut self, reason: DropReason, detail: String) {
        self.drops.push(Dropped { reason, detail });
    }
}

fn parse_tag(raw: &[u8]) -> Result<Tag, Refusal> {
    let h = open(raw)
        .map_err(|e| (DropReason::InvalidEventType, e.to_string()))?
        .0;
    let Head::Str(s) = h else {
        return Err((
            DropReason::InvalidEventType,
            format!("type is {}", h.type_name()),
        ));
    };
    match s {
        b"BlockStored" => Ok(Tag::Stored),
        b"BlockRemoved" => Ok(Tag::Removed),
        b"AllBlocksCleared" => Ok(Tag::Cleared),
        other => match std::str::from_utf8(other) {
            Ok(name) => Err((
                DropReason::UnknownEventType,
                format!("type {:?}", truncate(name, 64)),
            )),
            Err(_) => Err((DropReason::InvalidEventType, "type is not UTF-8".into())),
        },
    }
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => s.get(..i).unwrap_or(s),
        None => s,
    }
}

/// The type, plus the value for scalars where it helps (`-3`, `true`, `1.5`).
fn describe(h: &Head<'_>) -> String {
    match h {
        Head::Bool(b) => format!("bool {b}"),
        Head::Uint(v) => format!("int {v}"),
        Head::Neg(v) => format!("int {v}"),
        Head::F32(v) => format!("float {v}"),
        Head::F64(v) => format!("float {v}"),
        Head::Str(s) => match std::str::from_utf8(s) {
            Ok(t) => format!("str {:?}", truncate(t, 32)),
            Err(_) => "non-UTF-8 str".into(),
        },
        other => other.type_name().to_string(),
    }
}

fn describe_opt(h: Option<Head<'_>>) -> String {
    match h {
        None => "missing or nil".into(),
        Some(h) => describe(&h),
    }
}
