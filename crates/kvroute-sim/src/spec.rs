//! Model layouts: the KV cache groups of a simulated worker, the parameters vLLM derives from
//! them, and the named presets.
//!
//! Owns: `GroupKind`, `GroupSpec`, `ModelSpec`, `CacheParams` (hash block size `H`, scheduler
//! block size, hit alignment `A`, unitary or hybrid) and `preset()`.
//! Invariants: every group's block size is a positive multiple of `H`; a chunked-local group
//! shares its block size with every other group (vLLM requires `B = A` there); fine-grained
//! (partial) hits are never enabled, because the simulator does not take `--prefix-match-unit`
//! (see docs/sim.md).
//! Must not: hold cache state.

use crate::error::SimError;
use kvroute_index::CacheKind;
use serde::Serialize;

/// What one KV cache group holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GroupKind {
    FullAttention,
    SlidingWindow {
        window: u32,
    },
    ChunkedLocal {
        chunk: u32,
    },
    /// Mamba, GDN, linear attention: one recurrent state, prefix caching in "align" mode.
    Mamba,
}

impl GroupKind {
    /// `kv_cache_spec_kind` as vLLM reports it on stores.
    pub fn cache_kind(&self) -> CacheKind {
        match self {
            GroupKind::FullAttention => CacheKind::FullAttention,
            GroupKind::SlidingWindow { .. } => CacheKind::SlidingWindow,
            GroupKind::ChunkedLocal { .. } => CacheKind::ChunkedLocalAttention,
            GroupKind::Mamba => CacheKind::Mamba,
        }
    }

    /// `kv_cache_spec_sliding_window` as vLLM reports it (windows only).
    pub fn reported_window(&self) -> Option<u32> {
        match self {
            GroupKind::SlidingWindow { window } => Some(*window),
            _ => None,
        }
    }

    pub fn is_full(&self) -> bool {
        matches!(self, GroupKind::FullAttention)
    }
}

/// One KV cache group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct GroupSpec {
    #[serde(flatten)]
    pub kind: GroupKind,
    pub block_size: u32,
}

/// A simulated model: its groups (in vLLM's group order) and vocabulary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelSpec {
    pub name: String,
    pub groups: Vec<GroupSpec>,
    pub vocab_size: u32,
    /// Default pool size in blocks (vLLM's `num_gpu_blocks`), null block included.
    pub default_blocks: u32,
    pub max_model_len: u32,
}

/// The lookup parameters vLLM derives from a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CacheParams {
    /// `hash_block_size`: request hashes are computed over blocks of this many tokens.
    pub hash_block: u32,
    /// The scheduler block size: the LCM of every group's block size.
    pub scheduler_block: u32,
    /// Every hit is a multiple of this.
    pub align: u32,
    /// One group: vLLM's `UnitaryKVCacheCoordinator`.
    pub unitary: bool,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl ModelSpec {
    /// Checks the layout and derives `CacheParams`.
    pub fn params(&self) -> Result<CacheParams, SimError> {
        if self.groups.is_empty() {
            return Err(SimError::Config("a model needs at least one group".into()));
        }
        if self.groups.iter().any(|g| g.block_size == 0) {
            return Err(SimError::Config("block sizes must be positive".into()));
        }
        let unitary = self.groups.len() == 1;
        let h = self
            .groups
            .iter()
            .fold(0u64, |acc, g| gcd(acc, g.block_size as u64));
        let lcm = self.groups.iter().fold(1u64, |acc, g| {
            acc / gcd(acc, g.block_size as u64) * g.block_size as u64
        });
        let lcm = u32::try_from(lcm)
            .map_err(|_| SimError::Config("scheduler block size overflows".into()))?;
        for g in &self.groups {
            match g.kind {
                GroupKind::SlidingWindow { window } if window < 2 => {
                    return Err(SimError::Config("a sliding window must be ≥ 2".into()))
                }
                GroupKind::ChunkedLocal { chunk } => {
                    if g.block_size != lcm {
                        return Err(SimError::Config(
                            "chunked local attention needs every group at one block size".into(),
                        ));
                    }
                    if chunk == 0 || chunk % g.block_size != 0 {
                        return Err(SimError::Config(
                            "the attention chunk must be a multiple of the block size".into(),
                        ));
                    }
                }
                _ => {}
            }
        }
        let h = h as u32;
        Ok(CacheParams {
            hash_block: if unitary {
                self.groups[0].block_size
            } else {
                h
            },
            scheduler_block: lcm,
            align: if unitary {
                self.groups[0].block_size
            } else {
                lcm
            },
            unitary,
        })
    }

    /// Replaces every group's block size (vLLM's `--block-size`; Mamba hybrids in align mode
    /// keep every group at one size, so a single value fits every preset).
    pub fn with_block_size(mut self, block: u32) -> ModelSpec {
        for g in &mut self.groups {
            g.block_size = block;
        }
        self
    }

    pub fn has_mamba(&self) -> bool {
        self.groups.iter().any(|g| g.kind == GroupKind::Mamba)
    }
}

fn groups(pattern: &[(GroupKind, usize)], block: u32) -> Vec<GroupSpec> {
    pattern
        .iter()
        .flat_map(|(k, n)| {
            std::iter::repeat_n(
                GroupSpec {
                    kind: *k,
                    block_size: block,
                },
                *n,
            )
        })
        .collect()
}

/// Every preset name, in documentation order.
pub const PRESETS: &[&str] = &[
    "llama",
    "gpt-oss",
    "gemma3",
    "qwen3-next",
    "nemotron-h",
    "llama4",
    "tiny-gemma3",
    "tiny-nemotron-h",
    "tiny-qwen3-next",
];

/// A named layout (docs/sim.md documents each).
pub fn preset(name: &str) -> Result<ModelSpec, SimError> {
    use GroupKind::*;
    let (pattern, block, vocab, blocks, max_len): (Vec<(GroupKind, usize)>, u32, u32, u32, u32) =
        match name {
            "llama" => (vec![(FullAttention, 1)], 16, 128_256, 8192, 8192),
            "gpt-oss" => (
                vec![(SlidingWindow { window: 128 }, 1), (FullAttention, 1)],
                16,
                201_088,
                8192,
                8192,
            ),
            "gemma3" => (
                vec![(SlidingWindow { window: 1024 }, 5), (FullAttention, 1)],
                16,
                262_144,
                16384,
                8192,
            ),
            "qwen3-next" => (
                vec![(Mamba, 3), (FullAttention, 1)],
                544,
                151_936,
                2048,
                32768,
            ),
            "nemotron-h" => (
                vec![(Mamba, 6), (FullAttention, 1)],
                528,
                131_072,
                2048,
                32768,
            ),
            "llama4" => (
                vec![(ChunkedLocal { chunk: 8192 }, 3), (FullAttention, 1)],
                16,
                202_048,
                16384,
                32768,
            ),
            "tiny-gemma3" => (
                vec![(SlidingWindow { window: 64 }, 3), (FullAttention, 1)],
                32,
                1024,
                4096,
                1024,
            ),
            "tiny-nemotron-h" => (vec![(Mamba, 2), (FullAttention, 1)], 64, 1024, 1024, 1024),
            "tiny-qwen3-next" => (vec![(Mamba, 3), (FullAttention, 1)], 64, 1024, 1024, 1024),
            other => {
                return Err(SimError::Config(format!(
                    "unknown preset {other:?} (one of {})",
                    PRESETS.join(", ")
                )))
            }
        };
    Ok(ModelSpec {
        name: name.to_string(),
        groups: groups(&pattern, block),
        vocab_size: vocab,
        default_blocks: blocks,
        max_model_len: max_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_derives_valid_parameters() {
        for name in PRESETS {
            let spec = preset(name).unwrap();
            let p = spec.params().unwrap();
            assert!(p.align % p.hash_block == 0, "{name}");
            for g in &spec.groups {
                assert_eq!(g.block_size % p.hash_block, 0, "{name}");
            }
        }
    }

    #[test]
    fn a_single_group_model_is_unitary_and_aligns_to_its_block() {
        let p = preset("llama").unwrap().params().unwrap();
        assert_eq!((p.hash_block, p.align, p.unitary), (16, 16, true));
    }

    #[test]
    fn mixed_block_sizes_hash_at_the_gcd_and_align_to_the_lcm() {
        let spec = ModelSpec {
            name: "x".into(),
            groups: vec![
                GroupSpec {
                    kind: GroupKind::FullAttention,
                    block_size: 16,
                },
                GroupSpec {
                    kind: GroupKind::SlidingWindow { window: 64 },
                    block_size: 48,
                },
            ],
            vocab_size: 10,
            default_blocks: 10,
            max_model_len: 100,
        };
        let p = spec.params().unwrap();
        assert_eq!((p.hash_block, p.scheduler_block, p.align), (16, 48, 48));
    }

    #[test]
    fn unknown_presets_are_refused_with_the_list() {
        let e = preset("nope").unwrap_err().to_string();
        assert!(e.contains("tiny-gemma3"));
    }
}
