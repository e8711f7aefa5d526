//! Block hashing identical to vLLM's prefix cache, and the router's own content keys.
//!
//! Owns: `HashAlgo` (`sha256`, `sha256_cbor`), `NONE_HASH` from a seed string, the tagged extra
//! keys (`("lora", name, path)` on every block, `("cache_salt", salt)` on the first), vLLM
//! 0.33's lookahead block hashes (with `L` lookahead tokens the extra keys are
//! `(E, t_e, …, t_{e+L−1})`, `E` the tagged keys or `None`), the chain over full hash blocks,
//! and the fast content-key chain used where the engine's hash cannot be reproduced; `cache`
//! remembers digests of blocks seen before.
//! Invariants: digests chain on *full* parent digests, never on truncated 64-bit values; the
//! 64-bit external form is the digest's last 8 bytes big-endian; only full hash blocks hash,
//! and with `L` lookahead tokens a block `[s, e)` hashes only when `e + L ≤ n`; `L = 0` is
//! byte-identical to the hash without lookahead.
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

thread_local! {
    /// The block serialization buffer `hash_block_with` reuses on each thread.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
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
        extra: &PyValue,
    ) -> Digest {
        let parent = parent.unwrap_or(&self.none_hash);
        // One serialization buffer per thread, reused by every block it hashes.
        SCRATCH.with_borrow_mut(|bytes| {
            match self.algo {
                HashAlgo::Sha256 => pickle::dumps_block_into(bytes, parent, tokens, extra),
                HashAlgo::Sha256Cbor => cbor::dumps_block_into(bytes, parent, tokens, extra),
            }
            Sha256::digest(bytes.as_slice()).into()
        })
    }

    /// The digest of hash block `block_index` of a request.
    pub fn hash_block(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extras: &BlockExtras,
        block_index: usize,
    ) -> Digest {
        self.hash_block_with(parent, tokens, &extras.tagged(block_index))
    }

    /// The digest of hash block `block_index` of a request under vLLM 0.33's lookahead hashes:
    /// `lookahead` holds the `L` tokens right after the block (empty: the hash without
    /// lookahead, `hash_block`).
    pub fn hash_block_lookahead(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extras: &BlockExtras,
        block_index: usize,
        lookahead: &[u32],
    ) -> Digest {
        self.hash_block_with(
            parent,
            tokens,
            &lookahead_keys(extras.tagged(block_index), lookahead),
        )
    }

    /// Digests of every full `block`-token hash block of `tokens`.
    pub fn chain(&self, tokens: &[u32], block: usize, extras: &BlockExtras) -> Vec<Digest> {
        self.chain_lookahead(tokens, block, extras, 0)
    }

    /// Digests of every `block`-token hash block `[s, e)` of `tokens` with `e + lookahead ≤
    /// n`, each covering the `lookahead` tokens after it (vLLM 0.33's
    /// `num_hash_lookahead_tokens`; 0 is `chain`).
    pub fn chain_lookahead(
        &self,
        tokens: &[u32],
        block: usize,
        extras: &BlockExtras,
        lookahead: usize,
    ) -> Vec<Digest> {
        let mut out: Vec<Digest> = Vec::new();
        if block == 0 {
            return out;
        }
        let blocks = hashable_blocks(tokens.len(), block, lookahead);
        out.reserve_exact(blocks);
        // Without lookahead every block after the first has the same extra keys.
        let later = (lookahead == 0).then(|| extras.tagged(1));
        for i in 0..blocks {
            let (s, e) = (i * block, (i + 1) * block);
            let d = match &later {
                Some(keys) if i > 0 => self.hash_block_with(out.last(), &tokens[s..e], keys),
                _ => self.hash_block_lookahead(
                    out.last(),
                    &tokens[s..e],
                    extras,
                    i,
                    &tokens[e..e + lookahead],
                ),
            };
            out.push(d);
        }
        out
    }
}

/// How many `block`-token hash blocks of an `n`-token request have a hash with `lookahead`
/// lookahead tokens: those `[s, e)` with `e + lookahead ≤ n` (vLLM 0.33's
/// `request_block_hasher`; `n / block` without lookahead).
pub fn hashable_blocks(n: usize, block: usize, lookahead: usize) -> usize {
    if block == 0 {
        return 0;
    }
    n.saturating_sub(lookahead) / block
}

/// The extra keys of a lookahead block hash: `extra` itself without lookahead tokens, else
/// the flat tuple `(extra, t_e, …, t_{e+L−1})` (`(extra, t_e)` for one token). `extra` is the
/// block's usual tagged keys or `None`, so the value is never plain `None` once `L > 0`.
pub fn lookahead_keys(extra: PyValue, lookahead: &[u32]) -> PyValue {
    if lookahead.is_empty() {
        return extra;
    }
    let mut items = Vec::with_capacity(1 + lookahead.len());
    items.push(extra);
    items.extend(lookahead.iter().map(|t| PyValue::Int(*t as i128)));
    PyValue::Tuple(items)
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
    content_key_in(&mut Vec::new(), parent, tokens, salt, lora)
}

/// `content_key` serializing into `buf` (cleared first), so a chain reuses one buffer.
fn content_key_in(
    buf: &mut Vec<u8>,
    parent: Option<u64>,
    tokens: &[u32],
    salt: Option<&str>,
    lora: Option<&str>,
) -> u64 {
    buf.clear();
    buf.reserve(16 + tokens.len() * 4);
    match parent {
        Some(p) => {
            buf.push(1);
            buf.extend_from_slice(&p.to_le_bytes());
        }
        None => buf.push(0),
    }
    buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    let start = buf.len();
    buf.resize(start + tokens.len() * 4, 0);
    for (out, t) in buf[start..].chunks_exact_mut(4).zip(tokens) {
        out.copy_from_slice(&t.to_le_bytes());
    }
    for (tag, v) in [(2u8, salt), (3u8, lora)] {
        if let Some(v) = v {
            buf.push(tag);
            buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
            buf.extend_from_slice(v.as_bytes());
        }
    }
    xxhash_rust::xxh3::xxh3_64(buf)
}

/// Content keys of every full `block`-token block of `tokens`, each chained on the one
/// before (the first carries the salt, every one the LoRA name).
pub fn content_chain(tokens: &[u32], block: usize, extras: &BlockExtras) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    if block == 0 {
        return out;
    }
    out.reserve_exact(tokens.len() / block);
    let mut buf = Vec::new();
    let lora = extras.lora.as_ref().map(|(n, _)| n.as_str());
    for (i, chunk) in tokens.chunks_exact(block).enumerate() {
        let salt = if i == 0 {
            extras.cache_salt.as_deref()
        } else {
            None
        };
        out.push(content_key_in(
            &mut buf,
            out.last().copied(),
            chunk,
            salt,
            lora,
        ));
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

    fn heads(chain: &[Digest]) -> Vec<String> {
        chain.iter().map(|d| hex(d)[..16].to_string()).collect()
    }

    /// The vectors of vLLM 0.33's own `get_request_block_hasher` (tokens 1..=10, hash block 4,
    /// `PYTHONHASHSEED` unset): the first 8 bytes of each digest.
    #[test]
    fn lookahead_chains_match_vllm_0_33_s_own_hasher() {
        let tokens: Vec<u32> = (1..=10).collect();
        let lora_salt = BlockExtras {
            cache_salt: Some("s".into()),
            lora: Some(("a".into(), "/p/a".into())),
        };
        let cases: [(HashAlgo, usize, &BlockExtras, [&str; 2]); 8] = [
            (
                HashAlgo::Sha256,
                0,
                &BlockExtras::default(),
                ["52a7f141c60918f6", "bee96bce54f5fcab"],
            ),
            (
                HashAlgo::Sha256,
                1,
                &BlockExtras::default(),
                ["8a35c24a38f8f50a", "361f825e09047d65"],
            ),
            (
                HashAlgo::Sha256,
                2,
                &BlockExtras::default(),
                ["324ebf1e45c7844e", "55f429f53087f3e5"],
            ),
            (
                HashAlgo::Sha256,
                1,
                &lora_salt,
                ["a54e296df7ca240d", "4a800d1b80517c98"],
            ),
            (
                HashAlgo::Sha256Cbor,
                0,
                &BlockExtras::default(),
                ["58d0879dff3800f6", "e1bc29393a2da9fd"],
            ),
            (
                HashAlgo::Sha256Cbor,
                1,
                &BlockExtras::default(),
                ["45a8d824e18169fe", "1909786c93c17199"],
            ),
            (
                HashAlgo::Sha256Cbor,
                2,
                &BlockExtras::default(),
                ["829ef94de632ca50", "fb14d04c49d94bfe"],
            ),
            (
                HashAlgo::Sha256Cbor,
                1,
                &lora_salt,
                ["415202f2c657b380", "8666e0cfc4fa839c"],
            ),
        ];
        for (algo, lookahead, extras, want) in cases {
            let h = BlockHasher::new(algo, DEFAULT_SEED);
            let got = heads(&h.chain_lookahead(&tokens, 4, extras, lookahead));
            assert_eq!(got, want, "{algo} L={lookahead} {extras:?}");
        }
        assert_eq!(
            &hex(BlockHasher::new(HashAlgo::Sha256Cbor, DEFAULT_SEED).none_hash())[..16],
            "9bd96a485ad84efd"
        );
    }

    #[test]
    fn a_lookahead_block_hashes_only_once_its_lookahead_tokens_exist() {
        let h = BlockHasher::new(HashAlgo::Sha256, DEFAULT_SEED);
        let tokens: Vec<u32> = (1..=8).collect();
        // Block [4, 8) needs token 9 for L = 1.
        assert_eq!(
            h.chain_lookahead(&tokens, 4, &BlockExtras::default(), 1)
                .len(),
            1
        );
        assert_eq!(
            h.chain_lookahead(&tokens, 4, &BlockExtras::default(), 0)
                .len(),
            2
        );
        assert_eq!(hashable_blocks(8, 4, 3), 1);
        assert_eq!(hashable_blocks(2, 4, 3), 0);
        assert_eq!(hashable_blocks(9, 0, 1), 0);
        // With L = 0 the lookahead chain is the plain one.
        assert_eq!(
            h.chain_lookahead(&tokens, 4, &BlockExtras::default(), 0),
            h.chain(&tokens, 4, &BlockExtras::default())
        );
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

    /// The content key's bytes spelled out one field at a time: the reference the fast
    /// serialization must match (keys are compared across processes and snapshots).
    fn content_key_reference(
        parent: Option<u64>,
        tokens: &[u32],
        salt: Option<&str>,
        lora: Option<&str>,
    ) -> u64 {
        let mut buf = Vec::new();
        match parent {
            Some(p) => {
                buf.push(1u8);
                buf.extend_from_slice(&p.to_le_bytes());
            }
            None => buf.push(0),
        }
        buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        if let Some(v) = salt {
            buf.push(2);
            buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
            buf.extend_from_slice(v.as_bytes());
        }
        if let Some(v) = lora {
            buf.push(3);
            buf.extend_from_slice(&(v.len() as u32).to_le_bytes());
            buf.extend_from_slice(v.as_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    proptest::proptest! {
        #[test]
        fn content_chains_equal_the_reference_key_by_key(
            tokens in proptest::collection::vec(proptest::num::u32::ANY, 0..300),
            block in 1usize..70,
            salt in proptest::option::of("[a-z]{0,5}"),
            lora in proptest::option::of("[a-z]{1,5}"),
        ) {
            let extras = BlockExtras {
                cache_salt: salt.clone(),
                lora: lora.clone().map(|n| (n, "/p".to_string())),
            };
            let mut want: Vec<u64> = Vec::new();
            for (i, chunk) in tokens.chunks_exact(block).enumerate() {
                let s = if i == 0 { salt.as_deref() } else { None };
                want.push(content_key_reference(want.last().copied(), chunk, s, lora.as_deref()));
            }
            proptest::prop_assert_eq!(content_chain(&tokens, block, &extras), want);
        }
    }
}
