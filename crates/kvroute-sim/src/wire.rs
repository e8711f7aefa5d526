//! Encoding event batches exactly as vLLM's `ZmqEventPublisher` does (msgspec msgpack).
//!
//! Owns: `WireFormat` and `encode_batch`: vLLM 0.32's `[ts, events, dp_rank]` with events as
//! tagged maps (fields equal to their `None` default omitted, the rest in declaration order),
//! and the older positional array layout (`["BlockStored", block_hashes, parent, token_ids,
//! block_size, lora_id, medium]`, signed 64-bit hashes) for routers that must accept it.
//! vLLM 0.33's `BlockStored.lookahead_token_ids` is written last, when present (the map
//! layout otherwise unchanged).
//! Invariants: integers take msgpack's smallest encoding, the timestamp is a float64, and
//! 0.32 hashes are unsigned 64-bit values, as msgspec writes them.
//! Must not: own sockets or sequence numbers.

use kvroute_index::{Event, KeyValue, Removed, Stored};
use rmp::encode;

/// The batch layout a simulated engine publishes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WireFormat {
    /// vLLM 0.32: events are tagged maps, hashes unsigned.
    #[default]
    V032,
    /// vLLM ≤ 0.23: events are positional arrays, hashes signed, no group fields.
    LegacyArray,
}

impl std::str::FromStr for WireFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "v0.32" | "map" | "0.32" => Ok(WireFormat::V032),
            "legacy" | "array" => Ok(WireFormat::LegacyArray),
            other => Err(format!("unknown wire format {other:?} (map | array)")),
        }
    }
}

// Writing into a Vec never fails; the results are discarded on purpose.
fn str_(buf: &mut Vec<u8>, s: &str) {
    let _ = encode::write_str(buf, s);
}
fn uint(buf: &mut Vec<u8>, v: u64) {
    let _ = encode::write_uint(buf, v);
}
fn sint(buf: &mut Vec<u8>, v: i64) {
    let _ = encode::write_sint(buf, v);
}
fn nil(buf: &mut Vec<u8>) {
    let _ = encode::write_nil(buf);
}
fn arr(buf: &mut Vec<u8>, n: usize) {
    let _ = encode::write_array_len(buf, n as u32);
}
fn map(buf: &mut Vec<u8>, n: usize) {
    let _ = encode::write_map_len(buf, n as u32);
}

fn hash(buf: &mut Vec<u8>, v: u64, fmt: WireFormat) {
    match fmt {
        WireFormat::V032 => uint(buf, v),
        WireFormat::LegacyArray => sint(buf, v as i64),
    }
}

fn key_value(buf: &mut Vec<u8>, v: &KeyValue) {
    match v {
        KeyValue::Nil => nil(buf),
        KeyValue::Bool(b) => {
            let _ = encode::write_bool(buf, *b);
        }
        KeyValue::Int(i) => sint(buf, *i),
        KeyValue::UInt(u) => uint(buf, *u),
        KeyValue::Float(f) => {
            let _ = encode::write_f64(buf, *f);
        }
        KeyValue::Str(s) => str_(buf, s),
        KeyValue::Bytes { bytes } => {
            let _ = encode::write_bin(buf, bytes);
        }
        KeyValue::List(items) => {
            arr(buf, items.len());
            for i in items {
                key_value(buf, i);
            }
        }
    }
}

fn opt_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => str_(buf, s),
        None => nil(buf),
    }
}

fn stored(buf: &mut Vec<u8>, s: &Stored, fmt: WireFormat) {
    let hashes = |buf: &mut Vec<u8>| {
        arr(buf, s.hashes.len());
        for h in &s.hashes {
            hash(buf, h.value.0, fmt);
        }
    };
    let tokens = |buf: &mut Vec<u8>| {
        arr(buf, s.token_ids.len());
        for t in &s.token_ids {
            uint(buf, u64::from(*t));
        }
    };
    if fmt == WireFormat::LegacyArray {
        arr(buf, 7);
        str_(buf, "BlockStored");
        hashes(buf);
        match &s.parent {
            Some(p) => hash(buf, p.value.0, fmt),
            None => nil(buf),
        }
        tokens(buf);
        uint(buf, u64::from(s.block_size));
        nil(buf);
        opt_str(buf, s.medium.as_deref());
        return;
    }
    let optional = usize::from(s.extra_keys.is_some())
        + usize::from(s.group.is_some())
        + usize::from(s.kind.is_some())
        + usize::from(s.sliding_window.is_some())
        + usize::from(s.lookahead_token_ids.is_some());
    map(buf, 8 + optional);
    str_(buf, "type");
    str_(buf, "BlockStored");
    str_(buf, "block_hashes");
    hashes(buf);
    str_(buf, "parent_block_hash");
    match &s.parent {
        Some(p) => hash(buf, p.value.0, fmt),
        None => nil(buf),
    }
    str_(buf, "token_ids");
    tokens(buf);
    str_(buf, "block_size");
    uint(buf, u64::from(s.block_size));
    str_(buf, "lora_id");
    match s.lora_id {
        Some(i) => sint(buf, i),
        None => nil(buf),
    }
    str_(buf, "medium");
    opt_str(buf, s.medium.as_deref());
    str_(buf, "lora_name");
    opt_str(buf, s.lora_name.as_deref());
    if let Some(keys) = &s.extra_keys {
        str_(buf, "extra_keys");
        arr(buf, keys.len());
        for k in keys {
            match k {
                Some(v) => key_value(buf, v),
                None => nil(buf),
            }
        }
    }
    if let Some(g) = s.group {
        str_(buf, "group_idx");
        uint(buf, u64::from(g));
    }
    if let Some(k) = &s.kind {
        str_(buf, "kv_cache_spec_kind");
        str_(buf, k.as_str());
    }
    if let Some(w) = s.sliding_window {
        str_(buf, "kv_cache_spec_sliding_window");
        uint(buf, u64::from(w));
    }
    if let Some(lists) = &s.lookahead_token_ids {
        // vLLM 0.33: the tokens after each stored block that its hash covers.
        str_(buf, "lookahead_token_ids");
        arr(buf, lists.len());
        for ids in lists {
            arr(buf, ids.len());
            for t in ids {
                uint(buf, u64::from(*t));
            }
        }
    }
}

fn removed(buf: &mut Vec<u8>, r: &Removed, fmt: WireFormat) {
    if fmt == WireFormat::LegacyArray {
        arr(buf, 3);
        str_(buf, "BlockRemoved");
    } else {
        map(buf, 3 + usize::from(r.group.is_some()));
        str_(buf, "type");
        str_(buf, "BlockRemoved");
        str_(buf, "block_hashes");
    }
    arr(buf, r.hashes.len());
    for h in &r.hashes {
        hash(buf, h.value.0, fmt);
    }
    if fmt == WireFormat::V032 {
        str_(buf, "medium");
    }
    opt_str(buf, r.medium.as_deref());
    if fmt == WireFormat::V032 {
        if let Some(g) = r.group {
            str_(buf, "group_idx");
            uint(buf, u64::from(g));
        }
    }
}

/// One batch payload: `[ts, [events…], dp_rank]`.
pub fn encode_batch(ts: f64, events: &[Event], dp_rank: u32, fmt: WireFormat) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 64);
    arr(&mut buf, 3);
    let _ = encode::write_f64(&mut buf, ts);
    arr(&mut buf, events.len());
    for e in events {
        match e {
            Event::Stored(s) => stored(&mut buf, s, fmt),
            Event::Removed(r) => removed(&mut buf, r, fmt),
            Event::Cleared(_) => {
                if fmt == WireFormat::LegacyArray {
                    arr(&mut buf, 1);
                } else {
                    map(&mut buf, 1);
                    str_(&mut buf, "type");
                }
                str_(&mut buf, "AllBlocksCleared");
            }
        }
    }
    uint(&mut buf, u64::from(dp_rank));
    buf
}
