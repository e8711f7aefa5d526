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
use kvroute_index::{CacheKind, Cleared, EngineHash, Event, KeyValue, Removed, Stored, WorkerId};
use serde::Serialize;

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

    fn medium(&self, f: &Fields<'_>) -> Result<Option<String>, Refusal> {
        match f.head(F::Medium) {
            None => Ok(None),
            Some((h, _)) => self
                .short_string(h)
                .map(Some)
                .map_err(|d| (DropReason::InvalidMedium, format!("medium {d}"))),
        }
    }

    /// `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`: absent or nil is a
    /// legacy engine (None); present and unusable drops the event.
    #[allow(clippy::type_complexity)]
    fn group(
        &self,
        f: &Fields<'_>,
    ) -> Result<(Option<u32>, Option<CacheKind>, Option<u32>), Refusal> {
        let group = match f.head(F::GroupIdx) {
            None => None,
            Some((Head::Uint(v), _)) if v <= u64::from(u32::MAX) => Some(v as u32),
            Some((h, _)) => {
                return Err((
                    DropReason::InvalidGroupIdx,
                    format!("group_idx is {}", describe(&h)),
                ))
            }
        };
        let kind = match f.head(F::Kind) {
            None => None,
            Some((h, _)) => match self.short_string(h) {
                Ok(s) if !s.is_empty() => Some(CacheKind::parse(&s)),
                Ok(_) => {
                    return Err((
                        DropReason::InvalidKvCacheSpecKind,
                        "kv_cache_spec_kind is empty".into(),
                    ))
                }
                Err(d) => {
                    return Err((
                        DropReason::InvalidKvCacheSpecKind,
                        format!("kv_cache_spec_kind {d}"),
                    ))
                }
            },
        };
        let window = match f.head(F::Window) {
            None => None,
            Some((Head::Uint(v), _)) if v >= 1 && v <= u64::from(u32::MAX) => Some(v as u32),
            Some((h, _)) => {
                return Err((
                    DropReason::InvalidKvCacheSpecSlidingWindow,
                    format!("kv_cache_spec_sliding_window is {}", describe(&h)),
                ))
            }
        };
        if window.is_none()
            && matches!(
                kind,
                Some(CacheKind::SlidingWindow) | Some(CacheKind::SlidingWindowMla)
            )
        {
            return Err((
                DropReason::MissingKvCacheSpecSlidingWindow,
                format!(
                    "kind {} without kv_cache_spec_sliding_window",
                    kind.as_ref().map(|k| k.as_str()).unwrap_or_default()
                ),
            ));
        }
        Ok((group, kind, window))
    }

    fn hashes(&mut self, f: &Fields<'_>) -> Result<Vec<EngineHash>, Refusal> {
        let bad = |d: String| (DropReason::InvalidBlockHashes, d);
        let Some(raw) = f.get(F::BlockHashes) else {
            return Err(bad("block_hashes missing".into()));
        };
        let (head, mut r) = open(raw).map_err(|e| bad(e.to_string()))?;
        let Head::Array(n) = head else {
            return Err(bad(format!("block_hashes is {}", head.type_name())));
        };
        let n = n as usize;
        if n > self.limits.max_hashes_per_event {
            return Err((
                DropReason::TooManyBlockHashes,
                format!("{n} hashes > {}", self.limits.max_hashes_per_event),
            ));
        }
        if n > self.hashes_left {
            return Err((
                DropReason::BatchHashBudgetExceeded,
                format!("{n} hashes, {} left in the batch", self.hashes_left),
            ));
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let h = r.head().map_err(|e| bad(e.to_string()))?;
            out.push(
                self.hash(h)
                    .map_err(|d| bad(format!("block_hashes[{i}] {d}")))?,
            );
        }
        self.hashes_left -= n;
        Ok(out)
    }

    fn hash(&self, h: Head<'_>) -> Result<EngineHash, String> {
        match h {
            Head::Uint(v) => Ok(EngineHash::int(v)),
            Head::Neg(v) => Ok(EngineHash::int(v as u64)),
            Head::Bin(b) if !b.is_empty() && b.len() <= self.limits.max_hash_bytes => {
                Ok(EngineHash::bytes(b))
            }
            Head::Bin(b) => Err(format!("is {} raw bytes", b.len())),
            other => Err(format!("is {}", describe(&other))),
        }
    }

    fn token_ids(&self, f: &Fields<'_>) -> Result<Vec<u32>, Refusal> {
        let bad = |d: String| (DropReason::InvalidTokenIds, d);
        let Some((head, mut r)) = f.head(F::TokenIds) else {
            return Err(bad("token_ids missing or nil".into()));
        };
        let Head::Array(n) = head else {
            return Err(bad(format!("token_ids is {}", head.type_name())));
        };
        let n = n as usize;
        if n > self.limits.max_tokens_per_event {
            return Err((
                DropReason::TooManyTokenIds,
                format!("{n} token ids > {}", self.limits.max_tokens_per_event),
            ));
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            match r.head().map_err(|e| bad(e.to_string()))? {
                Head::Uint(v) if v <= u64::from(u32::MAX) => out.push(v as u32),
                other => return Err(bad(format!("token_ids[{i}] is {}", describe(&other)))),
            }
        }
        Ok(out)
    }

    /// `lookahead_token_ids` (vLLM 0.33): one list per hash of the tokens after its block, all
    /// of one length `L ≥ 1` (the engine's `num_hash_lookahead_tokens`), at most
    /// `max_tokens_per_event` in all. Any problem costs the field.
    fn lookahead(&mut self, f: &Fields<'_>, hashes: usize) -> Option<Vec<Vec<u32>>> {
        let (head, mut r) = f.head(F::Lookahead)?;
        let result = (|| {
            let Head::Array(n) = head else {
                return Err(format!("lookahead_token_ids is {}", head.type_name()));
            };
            if n as usize != hashes {
                return Err(format!(
                    "{n} lookahead_token_ids entries for {hashes} hashes"
                ));
            }
            let mut out: Vec<Vec<u32>> = Vec::with_capacity(hashes);
            let mut total = 0usize;
            for i in 0..hashes {
                let entry = r.head().map_err(|e| e.to_string())?;
                let Head::Array(len) = entry else {
                    return Err(format!("lookahead_token_ids[{i}] is {}", describe(&entry)));
                };
                let len = len as usize;
                match out.first() {
                    _ if len == 0 => return Err(format!("lookahead_token_ids[{i}] is empty")),
                    Some(first) if first.len() != len => {
                        return Err(format!(
                            "lookahead_token_ids[{i}] has {len} tokens, [0] has {}",
                            first.len()
                        ))
                    }
                    _ => {}
                }
                total += len;
                if total > self.limits.max_tokens_per_event {
                    return Err(format!(
                        "more than {} lookahead tokens",
                        self.limits.max_tokens_per_event
                    ));
                }
                let mut tokens = Vec::with_capacity(len);
                for j in 0..len {
                    match r.head().map_err(|e| e.to_string())? {
                        Head::Uint(v) if v <= u64::from(u32::MAX) => tokens.push(v as u32),
                        other => {
                            return Err(format!(
                                "lookahead_token_ids[{i}][{j}] is {}",
                                describe(&other)
                            ))
                        }
                    }
                }
                out.push(tokens);
            }
            Ok(out)
        })();
        match result {
            Ok(v) => Some(v),
            Err(d) => {
                self.field_drop(DropReason::InvalidLookaheadTokenIds, d);
                None
            }
        }
    }

    /// `extra_keys`: one entry per hash, nil for a plain block. Any problem costs the field.
    fn extra_keys(&mut self, f: &Fields<'_>, hashes: usize) -> Option<Vec<Option<KeyValue>>> {
        let (head, mut r) = f.head(F::ExtraKeys)?;
        let result = (|| {
            let Head::Array(n) = head else {
                return Err(format!("extra_keys is {}", head.type_name()));
            };
            if n as usize != hashes {
                return Err(format!("{n} extra_keys entries for {hashes} hashes"));
            }
            let mut out = Vec::with_capacity(hashes);
            for i in 0..n {
                let raw = r
                    .value_slice(self.limits.max_depth)
                    .map_err(|e| e.to_string())?;
                match open(raw).map_err(|e| e.to_string())? {
                    (Head::Nil, _) => out.push(None),
                    (h, mut inner) => out.push(Some(
                        self.key_value(h, &mut inner, 0)
                            .map_err(|d| format!("extra_keys[{i}] {d}"))?,
                    )),
                }
            }
            Ok(out)
        })();
        match result {
            Ok(v) => Some(v),
            Err(d) => {
                self.field_drop(DropReason::InvalidExtraKeys, d);
                None
            }
        }
    }

    fn key_value(&self, h: Head<'_>, r: &mut Reader<'_>, depth: usize) -> Result<KeyValue, String> {
        Ok(match h {
            Head::Nil => KeyValue::Nil,
            Head::Bool(b) => KeyValue::Bool(b),
            Head::Uint(v) => match i64::try_from(v) {
                Ok(i) => KeyValue::Int(i),
                Err(_) => KeyValue::UInt(v),
            },
            Head::Neg(v) => KeyValue::Int(v),
            Head::F32(v) => KeyValue::Float(f64::from(v)),
            Head::F64(v) => KeyValue::Float(v),
            Head::Str(s) => KeyValue::Str(
                std::str::from_utf8(s)
                    .map_err(|_| "has a non-UTF-8 string".to_string())?
                    .to_string(),
            ),
            Head::Bin(b) => KeyValue::Bytes { bytes: b.to_vec() },
            Head::Array(n) => {
                if depth >= self.limits.max_extra_key_depth {
                    return Err("nests too deep".into());
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let inner = r.head().map_err(|e| e.to_string())?;
                    items.push(self.key_value(inner, r, depth + 1)?);
                }
                KeyValue::List(items)
            }
            Head::Map(_) => return Err("holds a map".into()),
            Head::Ext(..) => return Err("holds an ext value".into()),
        })
    }

    fn short_string(&self, h: Head<'_>) -> Result<String, String> {
        match h {
            Head::Str(s) if s.len() > self.limits.max_string_bytes => {
                Err(format!("is a {}-byte string", s.len()))
            }
            Head::Str(s) => std::str::from_utf8(s)
                .map(str::to_string)
                .map_err(|_| "is not UTF-8".to_string()),
            other => Err(format!("is {}", describe(&other))),
        }
    }

    fn opt_string(
        &mut self,
        f: &Fields<'_>,
        field: F,
        reason: DropReason,
        name: &str,
    ) -> Option<String> {
        let (h, _) = f.head(field)?;
        match self.short_string(h) {
            Ok(s) => Some(s),
            Err(d) => {
                self.field_drop(reason, format!("{name} {d}"));
                None
            }
        }
    }

    /// SGLang's `cache_salt`, carried into `extra_keys` (see docs/wire.md).
    fn salt(&mut self, f: &Fields<'_>) -> Option<String> {
        self.opt_string(f, F::CacheSalt, DropReason::InvalidCacheSalt, "cache_salt")
    }

    /// `locality`, `ownership`, `session_id`: accepted and ignored, types checked leniently.
    fn check_lenient(&mut self, f: &Fields<'_>) {
        let checks = [
            (F::Locality, DropReason::InvalidLocality, "locality", false),
            (
                F::Ownership,
                DropReason::InvalidOwnership,
                "ownership",
                true,
            ),
            (
                F::SessionId,
                DropReason::InvalidSessionId,
                "session_id",
                true,
            ),
        ];
        for (field, reason, name, int_ok) in checks {
            match f.head(field) {
                None | Some((Head::Str(_), _)) => {}
                Some((Head::Uint(_) | Head::Neg(_), _)) if int_ok => {}
                Some((h, _)) => self.field_drop(reason, format!("{name} is {}", describe(&h))),
            }
        }
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
