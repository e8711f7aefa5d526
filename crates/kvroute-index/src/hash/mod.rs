//! Block hashing identical to vLLM's prefix cache, and the router's own content keys.
//!
//! Owns: `HashAlgo` (`sha256`, `sha256_cbor`), `NONE_HASH` from a seed string, the tagged extra
//! keys (`("lora", name, path)` on every block, `("cache_salt", salt)` on the first), the chain
//! over full hash blocks, and the fast content-key chain used where the engine's hash cannot be
//! reproduced; `cache` remembers digests of blocks seen before.
//! Invariants: digests chain on *full* parent digests, never on truncated 64-bit values; the
//! 64-bit external form is the digest's last 8 bytes big-endian; only full hash blocks hash.
//! Must not: allocate per token on the hot path beyond the one serialization buffer per block.

pub mod cache;
pub mod cbor;
pub mod pickle;

use crate::event::BlockHash;
use pickle::PyValue;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fmt;
use std::str::FromStr;

/// vLLM's default `NONE_HASH` seed for the sha256 variants.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// `--prefix-caching-hash-algo` values whose output the router can reproduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgo {
    #[default]
    Sha256,
    Sha256Cbor,
}

impl FromStr for HashAlgo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256" => Ok(HashAlgo::Sha256),
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            other => Err(format!(
                "unsupported hash algorithm {other:?} (expected sha256 or sha256_cbor; \
                 xxhash engines need content-key mode)"
            )),
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
        })
    }
}

/// A full 32-byte block digest.
pub type Digest = [u8; 32];

/// Request-level inputs to the extra keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockExtras {
    /// `cache_salt` of the request (tagged on the first block only).
    pub cache_salt: Option<String>,
    /// LoRA adapter `(name, path)` (tagged on every block).
    pub lora: Option<(String, String)>,
}

impl BlockExtras {
    fn tagged(&self, block_index: usize) -> PyValue {
        let mut keys = Vec::new();
        if let Some((name, path)) = &self.lora {
            keys.push(PyValue::Tuple(vec![
                PyValue::Str("lora".into()),
                PyValue::Str(name.clone()),
                PyValue::Str(path.clone()),
            ]));
        }
        if block_index == 0 {
            if let Some(salt) = &self.cache_salt {
                keys.push(PyValue::Tuple(vec![
                    PyValue::Str("cache_salt".into()),
                    PyValue::Str(salt.clone()),
                ]));
            }
        }
        if keys.is_empty() {
            PyValue::None
        } else {
            PyValue::Tuple(keys)
        }
    }
}

/// Hashes blocks exactly as one engine configuration does.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: Digest,
}

impl BlockHasher {
    pub fn new(algo: HashAlgo, seed: &str) -> BlockHasher {
        let none_hash = digest_of(algo, &PyValue::Str(seed.to_string()));
        BlockHasher { algo, none_hash }
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    pub fn none_hash(&self) -> &Digest {
        &self.none_hash
    }

    /// `hash((parent or NONE_HASH, tuple(tokens), extra_keys))` with extra keys given as the
    /// Python value vLLM would build (`None` or a tuple of tagged tuples).
    pub fn hash_block_with(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extra: PyValue,
    ) -> Digest {
        let parent = parent.unwrap_or(&self.none_hash);
        let bytes = match self.algo {
            HashAlgo::Sha256 => pickle::dumps_block(parent, tokens, &extra),
            HashAlgo::Sha256Cbor => cbor::dumps_block(parent, tokens, &extra),
        };
        Sha256::digest(&bytes).into()
    }

    /// The digest of hash block `block_index` of a request.
    pub fn hash_block(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extras: &BlockExtras,
        block_index: usize,
    ) -> Digest {
        self.hash_block_with(parent, tokens, extras.tagged(block_index))
    }

    /// Digests of every full `block`-token hash block of `tokens`.
    pub fn chain(&self, tokens: &[u32], block: usize, extras: &BlockExtras) -> Vec<Digest> {
        let mut out: Vec<Digest> = Vec::with_capacity(tokens.len() / block.max(1));
        if block == 0 {
            return out;
        }
        for (i, chunk) in tokens.chunks_exact(block).enumerate() {
            let d = self.hash_block(out.last(), chunk, extras, i);
            out.push(d);
        }
        out
    }
}

fn digest_of(algo: HashAlgo, obj: &PyValue) -> Digest {
    let bytes = match algo {
        HashAlgo::Sha256 => pickle::dumps(obj),
        HashAlgo::Sha256Cbor => cbor::dumps(obj),
    };
    Sha256::digest(&bytes).into()
}

/// The 64-bit value an engine in int mode publishes for a digest.
pub fn external(d: &Digest) -> BlockHash {
    BlockHash::from_digest_tail(d)
}

/// The router's own chained content key (for engines whose hash cannot be reproduced):
/// xxh3-64 over the parent key, the block's tokens and the extras that change reuse.
pub fn content_key(
    parent: Option<u64>,
    tokens: &[u32],
    salt: Option<&str>,
    lora: Option<&str>,
) -> u64 {
    let mut buf = Vec::with_capacity(16 + tokens.len() * 4);
    match parent {
        Some(p) => {
            buf.push(1);
            buf.extend_from_slice(&p.to_le_bytes());
        }
        None => buf.push(0),
    }
    buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    for (tag, v) in [(2u8, salt), (3u8, lora)] {
        if let Some(v) = v {
            buf.push(tag);
            buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
            buf.extend_from_slice(v.as_bytes());
        }
    }
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// Content keys of every full `block`-token block of `tokens` (salt on the first block only).
pub fn content_chain(tokens: &[u32], block: usize, extras: &BlockExtras) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    if block == 0 {
        return out;
    }
    let lora = extras.lora.as_ref().map(|(n, _)| n.as_str());
    for (i, chunk) in tokens.chunks_exact(block).enumerate() {
        let salt = if i == 0 {
            extras.cache_salt.as_deref()
        } else {
            None
        };
        out.push(content_key(out.last().copied(), chunk, salt, lora));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &Digest) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn none_hash_matches_the_spec_vector() {
        let h = BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED);
        assert_eq!(
            hex(h.none_hash()),
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
        );
    }

    #[test]
    fn both_chains_match_the_spec_vectors() {
        let tokens: Vec<u32> = (0..40).collect();
        for (algo, want) in [
            (HashAlgo::Sha256, [3262291359910021016, 7142137847444424233]),
            (
                HashAlgo::Sha256Cbor,
                [2233398808101521225, 17911472383915781900],
            ),
        ] {
            let ext: Vec<u64> = BlockHasher::new(algo, DEFAULT_SEED)
                .chain(&tokens, 16, &BlockExtras::default())
                .iter()
                .map(|d| external(d).0)
                .collect();
            assert_eq!(ext, want, "{algo}");
        }
    }

    #[test]
    fn a_salt_changes_only_the_chain_from_its_first_block_on() {
        let h = BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED);
        let tokens: Vec<u32> = (0..32).collect();
        let plain = h.chain(&tokens, 16, &BlockExtras::default());
        let salted = h.chain(
            &tokens,
            16,
            &BlockExtras {
                cache_salt: Some("s".into()),
                lora: None,
            },
        );
        assert_ne!(plain[0], salted[0]);
        assert_ne!(plain[1], salted[1]);
    }

    #[test]
    fn content_chains_depend_on_every_earlier_token() {
        let a = content_chain(&[1, 2, 3, 4], 2, &BlockExtras::default());
        let b = content_chain(&[9, 2, 3, 4], 2, &BlockExtras::default());
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1]);
    }
}
