//! The engine-neutral event model shared by the wire decoder, the index and the tools.
//!
//! Owns: `Event` (`Stored`, `Removed`, `Cleared`), block hashes, cache kinds and mediums.
//! Invariants: a `BlockHash` is the engine's 64-bit value (unsigned, last 8 bytes big-endian of
//! the digest when the engine sent bytes); the raw bytes travel beside it when the engine sent
//! them. `group == None` means a legacy one-group engine. These types carry no behaviour beyond
//! classification: what an event *does* to a worker's cache is decided in `index`.
//! Must not: depend on any wire format (msgpack, ZMQ) or on the router's configuration.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// A worker's name as configured by the operator (e.g. `"w0"`).
pub type WorkerId = Arc<str>;

/// The engine's 64-bit block hash value.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The 64-bit external form of a digest: its last 8 bytes read big-endian. Shorter inputs
    /// are left-padded with zeros (so an 8-byte value round-trips).
    pub fn from_digest_tail(bytes: &[u8]) -> BlockHash {
        let mut buf = [0u8; 8];
        let take = bytes.len().min(8);
        buf[8 - take..].copy_from_slice(&bytes[bytes.len() - take..]);
        BlockHash(u64::from_be_bytes(buf))
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A hash as the engine sent it: the 64-bit value, plus the raw bytes when it sent bytes.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct EngineHash {
    pub value: BlockHash,
    #[serde(default, skip_serializing_if = "Option::is_none", with = "hex_opt")]
    pub raw: Option<Box<[u8]>>,
}

impl EngineHash {
    pub fn int(value: u64) -> EngineHash {
        EngineHash {
            value: BlockHash(value),
            raw: None,
        }
    }
    pub fn bytes(raw: &[u8]) -> EngineHash {
        EngineHash {
            value: BlockHash::from_digest_tail(raw),
            raw: Some(raw.into()),
        }
    }
}

/// What kind of KV cache a group holds, as `kv_cache_spec_kind` names it.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheKind {
    FullAttention,
    MlaAttention,
    SinkFullAttention,
    SlidingWindow,
    SlidingWindowMla,
    ChunkedLocalAttention,
    Mamba,
    EncoderOnlyAttention,
    CrossAttention,
    /// Any other string (kept verbatim), including the engine's own `"unknown"`.
    Unknown(String),
}

/// The reuse rule a kind follows (section 4 of the engine notes).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    FullAttention,
    SlidingWindow,
    ChunkedLocal,
    Mamba,
    /// Not prefix-cacheable: ignored by the hit.
    NotCacheable,
}

impl CacheKind {
    pub fn parse(s: &str) -> CacheKind {
        match s {
            "full_attention" => CacheKind::FullAttention,
            "mla_attention" => CacheKind::MlaAttention,
            "sink_full_attention" => CacheKind::SinkFullAttention,
            "sliding_window" => CacheKind::SlidingWindow,
            "sliding_window_mla" => CacheKind::SlidingWindowMla,
            "chunked_local_attention" => CacheKind::ChunkedLocalAttention,
            "mamba" => CacheKind::Mamba,
            "encoder_only_attention" => CacheKind::EncoderOnlyAttention,
            "cross_attention" => CacheKind::CrossAttention,
            other => CacheKind::Unknown(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            CacheKind::FullAttention => "full_attention",
            CacheKind::MlaAttention => "mla_attention",
            CacheKind::SinkFullAttention => "sink_full_attention",
            CacheKind::SlidingWindow => "sliding_window",
            CacheKind::SlidingWindowMla => "sliding_window_mla",
            CacheKind::ChunkedLocalAttention => "chunked_local_attention",
            CacheKind::Mamba => "mamba",
            CacheKind::EncoderOnlyAttention => "encoder_only_attention",
            CacheKind::CrossAttention => "cross_attention",
            CacheKind::Unknown(s) => s,
        }
    }

    pub fn rule(&self) -> Rule {
        match self {
            CacheKind::FullAttention | CacheKind::MlaAttention | CacheKind::SinkFullAttention => {
                Rule::FullAttention
            }
            CacheKind::SlidingWindow | CacheKind::SlidingWindowMla => Rule::SlidingWindow,
            CacheKind::ChunkedLocalAttention => Rule::ChunkedLocal,
            CacheKind::Mamba => Rule::Mamba,
            CacheKind::EncoderOnlyAttention | CacheKind::CrossAttention | CacheKind::Unknown(_) => {
                Rule::NotCacheable
            }
        }
    }
}

impl fmt::Display for CacheKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A value inside `extra_keys`, as the engine published it (untagged).
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KeyValue {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    /// Raw bytes; in JSON `{"bytes": "<hex>"}`.
    Bytes {
        #[serde(with = "hex")]
        bytes: Vec<u8>,
    },
    List(Vec<KeyValue>),
}

/// The storage tier a block lives in. Only the device tier feeds the prediction.
pub fn is_device_medium(medium: Option<&str>) -> bool {
    match medium {
        None => true,
        Some(m) => m.eq_ignore_ascii_case("gpu"),
    }
}

/// A block (or a sparse set of blocks) entered a group's prefix cache.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct Stored {
    pub worker: WorkerId,
    #[serde(default)]
    pub dp_rank: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub medium: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<CacheKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u32>,
    pub block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<EngineHash>,
    pub hashes: Vec<EngineHash>,
    #[serde(default)]
    pub token_ids: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_keys: Option<Vec<Option<KeyValue>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// vLLM 0.33 with lookahead hashes: per hash, the tokens right after its block that its
    /// hash covers (every entry `num_hash_lookahead_tokens` long); absent without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// Blocks left a group's prefix cache (one copy each).
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct Removed {
    pub worker: WorkerId,
    #[serde(default)]
    pub dp_rank: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub medium: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u32>,
    pub hashes: Vec<EngineHash>,
}

/// The device pool of one (worker, rank) was reset: every group is empty.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Cleared {
    pub worker: WorkerId,
    #[serde(default)]
    pub dp_rank: u32,
}

/// One normalized event. Serialized as JSON lines tagged by `"event"`.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(tag = "event")]
pub enum Event {
    Stored(Stored),
    Removed(Removed),
    Cleared(Cleared),
}

impl Stored {
    /// A device-tier store of 64-bit hashes into `group` (no parent, tokens or extra keys):
    /// what tests, benchmarks and simulations build most often.
    pub fn device(
        worker: &str,
        group: u32,
        kind: CacheKind,
        sliding_window: Option<u32>,
        block_size: u32,
        hashes: &[u64],
    ) -> Stored {
        Stored {
            worker: worker.into(),
            dp_rank: 0,
            medium: None,
            group: Some(group),
            kind: Some(kind),
            sliding_window,
            block_size,
            parent: None,
            hashes: hashes.iter().map(|h| EngineHash::int(*h)).collect(),
            token_ids: Vec::new(),
            extra_keys: None,
            lora_id: None,
            lora_name: None,
            lookahead_token_ids: None,
        }
    }
}

impl Removed {
    /// A device-tier removal of 64-bit hashes from `group`.
    pub fn device(worker: &str, group: u32, hashes: &[u64]) -> Removed {
        Removed {
            worker: worker.into(),
            dp_rank: 0,
            medium: None,
            group: Some(group),
            hashes: hashes.iter().map(|h| EngineHash::int(*h)).collect(),
        }
    }
}

impl Event {
    pub fn worker(&self) -> &WorkerId {
        match self {
            Event::Stored(s) => &s.worker,
            Event::Removed(r) => &r.worker,
            Event::Cleared(c) => &c.worker,
        }
    }
    pub fn dp_rank(&self) -> u32 {
        match self {
            Event::Stored(s) => s.dp_rank,
            Event::Removed(r) => r.dp_rank,
            Event::Cleared(c) => c.dp_rank,
        }
    }
}

mod hex {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(v))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        decode(&s).ok_or_else(|| serde::de::Error::custom("invalid hex string"))
    }
    pub fn encode(v: &[u8]) -> String {
        v.iter().map(|b| format!("{b:02x}")).collect()
    }
    pub fn decode(s: &str) -> Option<Vec<u8>> {
        if !s.len().is_multiple_of(2) {
            return None;
        }
        (0..s.len())
            .step_by(2)
            .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect()
    }
}

mod hex_opt {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Box<[u8]>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_str(&super::hex::encode(b)),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Box<[u8]>>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        match s {
            None => Ok(None),
            Some(s) => super::hex::decode(&s)
                .map(|v| Some(v.into_boxed_slice()))
                .ok_or_else(|| serde::de::Error::custom("invalid hex string")),
        }
    }
}

pub use hex::encode as hex_encode;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_tail_reads_the_last_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(
            BlockHash::from_digest_tail(&d),
            BlockHash(0x0102_0304_0506_0708)
        );
        assert_eq!(BlockHash::from_digest_tail(&[1, 2]), BlockHash(0x0102));
    }

    #[test]
    fn events_round_trip_through_json_lines() {
        let e = Event::Stored(Stored {
            worker: "w0".into(),
            dp_rank: 1,
            medium: Some("GPU".into()),
            group: Some(2),
            kind: Some(CacheKind::SlidingWindow),
            sliding_window: Some(64),
            block_size: 32,
            parent: Some(EngineHash::bytes(&[9u8; 32])),
            hashes: vec![EngineHash::int(u64::MAX), EngineHash::int(7)],
            token_ids: vec![1, 2, 3],
            extra_keys: Some(vec![None, Some(KeyValue::Str("salt".into()))]),
            lora_id: None,
            lora_name: None,
            lookahead_token_ids: Some(vec![vec![4], vec![9]]),
        });
        let line = serde_json::to_string(&e).unwrap();
        let back: Event = serde_json::from_str(&line).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn unknown_kind_strings_are_kept_verbatim_and_not_cacheable() {
        let k = CacheKind::parse("circular_buffer");
        assert_eq!(k.as_str(), "circular_buffer");
        assert_eq!(k.rule(), Rule::NotCacheable);
        assert_eq!(CacheKind::parse("mamba").rule(), Rule::Mamba);
    }
}
