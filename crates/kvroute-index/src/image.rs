//! A rank's cache state as plain data: what a snapshot writes and a warm start loads.
//!
//! Owns: [`RankImage`] (the learned layout, every device group's blocks with their copies, the
//! content-key map of content-key workers, the offload tiers per group), taking one from a rank
//! (`RankState::export`), checking one that came from outside ([`RankImage::check`]) and loading
//! one into a rank (`RankState::import`).
//! Invariants: a rank loaded from `export`'s image has the same layout, device contents
//! (group → hash → copies), content-key map and offload tiers as the rank it was taken from, so
//! it predicts the same for every request; the full-attention groups keep their runs (a walk
//! through the loaded store reads the same consecutive blocks). Statistics, the digests kept
//! for the live hash check and the refusal log are not carried: a loaded rank starts them
//! afresh (a store chained on a loaded block counts as unverifiable).
//! Must not: read or write files or know their format (the gateway's snapshot does), or load an
//! image that fails `check` (bounds keep a hostile file from allocating without limit).

use crate::event::CacheKind;
use crate::layout::GroupSpec;
use crate::rank::{place_for, RankState};
use crate::runs::Runs;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The most copies of one block an image may claim (an engine holds a block once per request
/// sharing it in flight; far below this).
pub const MAX_COPIES: u32 = 1 << 16;
/// The most groups an image may claim for one rank.
pub const MAX_GROUPS: usize = 1024;

/// One rank's cache state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankImage {
    pub groups: Vec<GroupImage>,
    /// Non-device tiers: medium → (hash, copies).
    pub offload: Vec<TierImage>,
}

/// One group: its spec as learned from the stores, and what it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupImage {
    pub group: u32,
    /// `kv_cache_spec_kind` as the engine named it.
    pub kind: String,
    pub sliding_window: Option<u32>,
    pub block_size: u32,
    pub partial_size: Option<u32>,
    /// The blocks, as runs of hashes that share one copy count (full attention: the run
    /// store's runs in chain order; other kinds: any order).
    pub runs: Vec<BlockRun>,
    /// Content-key workers: engine hash → (content key, copies).
    pub content: Vec<(u64, u64, u32)>,
}

/// Blocks held `copies` times each.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRun {
    pub copies: u32,
    pub hashes: Vec<u64>,
}

/// One group's blocks in one offload tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierImage {
    pub medium: String,
    /// The engine's group index the tier keyed the blocks by.
    #[serde(default)]
    pub group: u32,
    pub blocks: Vec<(u64, u32)>,
}

/// Why an image from outside cannot be loaded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ImageError {
    #[error("{0} groups (at most {MAX_GROUPS})")]
    TooManyGroups(usize),
    #[error("group {0} is listed twice")]
    DuplicateGroup(u32),
    #[error("group {0}: block_size 0")]
    ZeroBlockSize(u32),
    #[error("group {group}: {copies} copies of a block (1..={MAX_COPIES})")]
    Copies { group: u32, copies: u32 },
    #[error("medium {0:?}: {1} copies of a block (1..={MAX_COPIES})")]
    TierCopies(String, u32),
    #[error("medium {0:?} group {1}: {2} blocks (at most {max})", max = crate::rank::MAX_TIER_KEYS)]
    TierTooLarge(String, u32, usize),
}

impl RankImage {
    /// Whether the image can be loaded: bounded groups, copies and tiers, no group twice, no
    /// zero block size.
    pub fn check(&self) -> Result<(), ImageError> {
        if self.groups.len() > MAX_GROUPS {
            return Err(ImageError::TooManyGroups(self.groups.len()));
        }
        let bad = |c: u32| c == 0 || c > MAX_COPIES;
        let mut seen = std::collections::BTreeSet::new();
        for g in &self.groups {
            if !seen.insert(g.group) {
                return Err(ImageError::DuplicateGroup(g.group));
            }
            if g.block_size == 0 {
                return Err(ImageError::ZeroBlockSize(g.group));
            }
            let copies = g.runs.iter().map(|r| r.copies);
            if let Some(c) = copies
                .chain(g.content.iter().map(|c| c.2))
                .find(|c| bad(*c))
            {
                return Err(ImageError::Copies {
                    group: g.group,
                    copies: c,
                });
            }
        }
        // Entries of one (medium, group) load into one tier: bound their sum.
        let mut per_tier: std::collections::BTreeMap<(&str, u32), usize> = Default::default();
        for t in &self.offload {
            if let Some((_, c)) = t.blocks.iter().find(|(_, c)| bad(*c)) {
                return Err(ImageError::TierCopies(t.medium.clone(), *c));
            }
            let n = per_tier.entry((t.medium.as_str(), t.group)).or_default();
            *n += t.blocks.len();
            if *n > crate::rank::MAX_TIER_KEYS {
                return Err(ImageError::TierTooLarge(t.medium.clone(), t.group, *n));
            }
        }
        Ok(())
    }

    /// Block copies on the device tier.
    pub fn block_copies(&self) -> u64 {
        self.groups
            .iter()
            .flat_map(|g| &g.runs)
            .map(|r| r.copies as u64 * r.hashes.len() as u64)
            .sum()
    }
}

/// Runs of equal copy counts from (hash, copies) pairs.
fn runs_of(items: impl Iterator<Item = (u64, u32)>) -> Vec<BlockRun> {
    let mut out: Vec<BlockRun> = Vec::new();
    for (h, c) in items {
        match out.last_mut() {
            Some(r) if r.copies == c => r.hashes.push(h),
            _ => out.push(BlockRun {
                copies: c,
                hashes: vec![h],
            }),
        }
    }
    out
}

impl RankState {
    /// The rank's state as an image.
    pub(crate) fn export(&self, runs: &Runs) -> RankImage {
        let groups = self
            .layout
            .groups
            .iter()
            .map(|(id, spec)| {
                let state = self.groups.get(id);
                let blocks = match state.map(|s| (s.shared, s.own)) {
                    Some((Some(holder), _)) => {
                        let mut held: Vec<BlockRun> = runs
                            .holder_runs(holder)
                            .into_iter()
                            .map(|(copies, hashes)| BlockRun { copies, hashes })
                            .collect();
                        // The store's run order is its slot reuse; an image lists them by
                        // their first block, so equal states write equal files.
                        held.sort_unstable_by_key(|r| r.hashes.first().copied());
                        held
                    }
                    Some((None, Some((t, slot)))) => self
                        .specs
                        .get(t)
                        .map(|set| {
                            let mut items: Vec<(u64, u32)> = set.iter(slot).collect();
                            items.sort_unstable_by_key(|(h, c)| (*c, *h));
                            runs_of(items.into_iter())
                        })
                        .unwrap_or_default(),
                    _ => Vec::new(),
                };
                let mut content: Vec<(u64, u64, u32)> = state
                    .map(|s| s.content.iter().map(|(h, (k, c))| (*h, *k, *c)).collect())
                    .unwrap_or_default();
                content.sort_unstable();
                GroupImage {
                    group: *id,
                    kind: spec.kind.as_str().to_string(),
                    sliding_window: spec.window,
                    block_size: spec.block_size,
                    partial_size: spec.partial_size,
                    runs: blocks,
                    content,
                }
            })
            .collect();
        let offload = self
            .offload
            .iter()
            .map(|((medium, group), set)| {
                let mut blocks: Vec<(u64, u32)> = set.iter().collect();
                blocks.sort_unstable();
                TierImage {
                    medium: medium.clone(),
                    group: *group,
                    blocks,
                }
            })
            .collect();
        RankImage { groups, offload }
    }

    /// Replaces the rank's state with a checked image's (its configuration stays).
    pub(crate) fn import(&mut self, img: &RankImage, runs: &mut Runs) {
        self.reset(runs);
        self.offload.clear();
        for g in &img.groups {
            self.layout.groups.insert(
                g.group,
                GroupSpec {
                    kind: CacheKind::parse(&g.kind),
                    window: g.sliding_window,
                    block_size: g.block_size,
                    partial_size: g.partial_size,
                },
            );
        }
        self.replan();
        for g in &img.groups {
            let place = place_for(&self.layout, &mut self.specs, g.group);
            let state = self.groups.entry_or_default(g.group, place, runs);
            state
                .content
                .extend(g.content.iter().map(|(h, k, c)| (*h, (*k, *c))));
            match (state.shared, state.own) {
                (Some(holder), _) => {
                    for r in &g.runs {
                        for _ in 0..r.copies {
                            runs.insert(holder, None, &r.hashes);
                        }
                    }
                }
                (None, Some((t, slot))) => {
                    if let Some(set) = self.specs.get_mut(t) {
                        for r in &g.runs {
                            set.reserve(r.hashes.len());
                            for h in &r.hashes {
                                for _ in 0..r.copies {
                                    set.insert(slot, *h);
                                }
                            }
                        }
                    }
                }
                (None, None) => {}
            }
        }
        for t in &img.offload {
            let tier = self.offload.entry((t.medium.clone(), t.group)).or_default();
            for (h, c) in &t.blocks {
                for _ in 0..*c {
                    tier.insert(*h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(id: u32, copies: u32) -> GroupImage {
        GroupImage {
            group: id,
            kind: "full_attention".into(),
            sliding_window: None,
            block_size: 16,
            partial_size: None,
            runs: vec![BlockRun {
                copies,
                hashes: vec![1, 2],
            }],
            content: Vec::new(),
        }
    }

    #[test]
    fn an_image_from_outside_is_bounded_before_it_is_loaded() {
        let ok = RankImage {
            groups: vec![group(0, 2), group(1, 1)],
            offload: Vec::new(),
        };
        assert_eq!(ok.check(), Ok(()));
        assert_eq!(ok.block_copies(), 6);
        let twice = RankImage {
            groups: vec![group(0, 1), group(0, 1)],
            offload: Vec::new(),
        };
        assert_eq!(twice.check(), Err(ImageError::DuplicateGroup(0)));
        let mut zero = group(3, 1);
        zero.block_size = 0;
        let zero = RankImage {
            groups: vec![zero],
            offload: Vec::new(),
        };
        assert_eq!(zero.check(), Err(ImageError::ZeroBlockSize(3)));
        for copies in [0, MAX_COPIES + 1] {
            let img = RankImage {
                groups: vec![group(0, copies)],
                offload: Vec::new(),
            };
            assert_eq!(img.check(), Err(ImageError::Copies { group: 0, copies }));
        }
        let tier = RankImage {
            groups: Vec::new(),
            offload: vec![TierImage {
                medium: "CPU".into(),
                group: 0,
                blocks: vec![(1, 0)],
            }],
        };
        assert_eq!(tier.check(), Err(ImageError::TierCopies("CPU".into(), 0)));
        let n = crate::rank::MAX_TIER_KEYS + 1;
        let big = RankImage {
            groups: Vec::new(),
            offload: vec![TierImage {
                medium: "cpu".into(),
                group: 0,
                blocks: (0..n as u64).map(|h| (h, 1)).collect(),
            }],
        };
        assert_eq!(
            big.check(),
            Err(ImageError::TierTooLarge("cpu".into(), 0, n))
        );
        // Two entries of one tier count together.
        let half = |from: u64| TierImage {
            medium: "cpu".into(),
            group: 0,
            blocks: (from..from + n as u64 / 2 + 1).map(|h| (h, 1)).collect(),
        };
        let split = RankImage {
            groups: Vec::new(),
            offload: vec![half(0), half(1 << 40)],
        };
        assert!(matches!(split.check(), Err(ImageError::TierTooLarge(..))));
        let many = RankImage {
            groups: (0..=MAX_GROUPS as u32).map(|g| group(g, 1)).collect(),
            offload: Vec::new(),
        };
        assert_eq!(many.check(), Err(ImageError::TooManyGroups(MAX_GROUPS + 1)));
    }
}
