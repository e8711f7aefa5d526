//! The field readers of one event: each field of a `BlockStored` or `BlockRemoved` checked
//! and converted (medium, group and kind, hashes, token ids, vLLM 0.33's lookahead tokens,
//! extra keys and the cache salt, and the fields accepted and ignored).
//!
//! Owns: the `Ctx` methods that read one field each.
//! Invariants: an event-costing problem is a `Refusal`; a field-costing one records a
//! [`crate::reasons::Dropped`] through `field_drop` and leaves the field out; counts and sizes
//! are checked against `Limits` before anything is kept (hashes per event and per batch, hash
//! bytes, token ids, the string bytes of the medium, the kind, the LoRA name and the salt, and
//! the extra keys' nesting depth); the extra keys' own strings and bytes are bounded by the
//! payload's size, which `decode_batch` checks, with its structure, before any event.
//! Must not: panic or allocate in proportion to a claimed length.

use super::{describe, Ctx, Fields, Refusal, F};
use crate::msgpack::{open, Head, Reader};
use crate::reasons::DropReason;
use kvroute_index::{CacheKind, EngineHash, KeyValue};

impl Ctx<'_, '_> {
    pub(super) fn medium(&self, f: &Fields<'_>) -> Result<Option<String>, Refusal> {
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
    pub(super) fn group(
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

    pub(super) fn hashes(&mut self, f: &Fields<'_>) -> Result<Vec<EngineHash>, Refusal> {
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

    pub(super) fn hash(&self, h: Head<'_>) -> Result<EngineHash, String> {
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

    pub(super) fn token_ids(&self, f: &Fields<'_>) -> Result<Vec<u32>, Refusal> {
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
    pub(super) fn lookahead(&mut self, f: &Fields<'_>, hashes: usize) -> Option<Vec<Vec<u32>>> {
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
    pub(super) fn extra_keys(
        &mut self,
        f: &Fields<'_>,
        hashes: usize,
    ) -> Option<Vec<Option<KeyValue>>> {
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

    pub(super) fn opt_string(
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
    pub(super) fn salt(&mut self, f: &Fields<'_>) -> Option<String> {
        self.opt_string(f, F::CacheSalt, DropReason::InvalidCacheSalt, "cache_salt")
    }

    /// `locality`, `ownership`, `session_id`: accepted and ignored, types checked leniently.
    pub(super) fn check_lenient(&mut self, f: &Fields<'_>) {
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
