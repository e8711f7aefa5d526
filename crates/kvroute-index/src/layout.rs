//! Group layouts learned from stores, and the lookup parameters vLLM derives from them.
//!
//! Owns: per (worker, rank) the map group → (kind, window, block sizes seen), and the derived
//! `Params`: hash block size `H`, alignment `A`, whether fine-grained (partial) hits apply, the
//! engine's rules (the EAGLE drop, vLLM 0.33's lookahead count), and the coordinator's lookup
//! order (full-attention kinds first, identical specs together).
//! `Plan` is both, derived once per layout or configuration change for the prediction's hot path.
//! Invariants: a group's kind and window never change in place (a change is reported so the
//! caller clears the rank); `block_size` is the largest size seen for the group, a smaller one
//! (a partial entry at the hash block size) is kept as `partial_size`.
//! Must not: hold any cached blocks.

use crate::engine::Rules;
use crate::event::{CacheKind, Rule};
use crate::tier::OffloadConnector;
use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GroupSpec {
    pub kind: CacheKind,
    pub window: Option<u32>,
    pub block_size: u32,
    /// A smaller block size seen on this group's stores (partial entries at `H`).
    pub partial_size: Option<u32>,
}

impl GroupSpec {
    pub fn rule(&self) -> Rule {
        self.kind.rule()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Learned {
    Known,
    /// A known group's block size or partial size changed (the derived params may differ).
    Resized,
    NewGroup,
    /// The group's kind or window differs from what was learned: the layout changed.
    Changed,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub groups: GroupTable,
}

/// Group id → spec, sorted by id: a rank has a handful of groups, so a vector sized for them
/// (a B-tree's first node is sized for eleven specs, ≈ 600 bytes per rank). Serializes as a
/// map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupTable(Vec<(u32, GroupSpec)>);

impl GroupTable {
    fn at(&self, id: u32) -> Result<usize, usize> {
        self.0.binary_search_by_key(&id, |(g, _)| *g)
    }

    pub fn get(&self, id: &u32) -> Option<&GroupSpec> {
        self.at(*id).ok().map(|i| &self.0[i].1)
    }

    pub fn get_mut(&mut self, id: &u32) -> Option<&mut GroupSpec> {
        self.at(*id).ok().map(|i| &mut self.0[i].1)
    }

    /// Inserts or replaces a group's spec.
    pub fn insert(&mut self, id: u32, spec: GroupSpec) {
        match self.at(id) {
            Ok(i) => self.0[i].1 = spec,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (id, spec));
            }
        }
    }

    pub fn contains_key(&self, id: &u32) -> bool {
        self.at(*id).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// (id, spec) in id order.
    pub fn iter(&self) -> impl Iterator<Item = (&u32, &GroupSpec)> {
        self.0.iter().map(|(g, s)| (g, s))
    }

    pub fn values(&self) -> impl Iterator<Item = &GroupSpec> {
        self.0.iter().map(|(_, s)| s)
    }
}

impl<'a> IntoIterator for &'a GroupTable {
    type Item = (&'a u32, &'a GroupSpec);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (u32, GroupSpec)>,
        fn(&'a (u32, GroupSpec)) -> (&'a u32, &'a GroupSpec),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(g, s)| (g, s))
    }
}

impl Serialize for GroupTable {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        ser.collect_map(self.0.iter().map(|(g, s)| (g, s)))
    }
}

impl Layout {
    pub fn learn(
        &mut self,
        group: u32,
        kind: &CacheKind,
        window: Option<u32>,
        block_size: u32,
    ) -> Learned {
        match self.groups.get_mut(&group) {
            None => {
                self.groups.insert(
                    group,
                    GroupSpec {
                        kind: kind.clone(),
                        window,
                        block_size,
                        partial_size: None,
                    },
                );
                Learned::NewGroup
            }
            Some(g) if g.kind != *kind || g.window != window => Learned::Changed,
            Some(g) => {
                let before = (g.block_size, g.partial_size);
                if block_size > g.block_size {
                    let old = g.block_size;
                    g.block_size = block_size;
                    g.partial_size = Some(g.partial_size.map_or(old, |p| p.min(old)));
                } else if block_size < g.block_size {
                    g.partial_size = Some(g.partial_size.map_or(block_size, |p| p.min(block_size)));
                }
                if (g.block_size, g.partial_size) == before {
                    Learned::Known
                } else {
                    Learned::Resized
                }
            }
        }
    }

    pub fn contains(&self, group: u32) -> bool {
        self.groups.contains_key(&group)
    }
}

/// Per-worker knobs that the events do not carry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct LookupConfig {
    /// vLLM's hash block size (`--prefix-match-unit`); derived from the layout when absent.
    pub hash_block_size: Option<u32>,
    /// Chunk size of chunked local attention groups (e.g. 8192 for Llama 4).
    pub chunk_size: Option<u32>,
    /// Speculative decoding (EAGLE/MTP) is on: every group is an EAGLE group and drops its last
    /// matched unit, as vLLM's coordinator does (not on a vLLM 0.33 worker with lookahead
    /// hashes: `WorkerConfig::rules`).
    #[serde(default)]
    pub eagle: bool,
    /// GPU blocks per chunk of the worker's `OffloadingConnector` (its `blocks_per_chunk`, or
    /// `block_size` / the GPU block); 1, the connector's default, when absent.
    #[serde(default)]
    pub offload_chunk_blocks: Option<u32>,
    /// The connector that keeps the worker's offload tiers (the `OffloadingConnector` when
    /// absent): it decides how a tier hit is looked up.
    #[serde(default)]
    pub offload_connector: OffloadConnector,
    /// Under the EAGLE drop, the engine flags no KV cache group as its drafter's
    /// (`Speculative::flags_drafter_groups` is false: vLLM 0.32's `eagle`, `eagle3`,
    /// `dflash`): the `OffloadingConnector` then pops no chunk and its tier is predicted by its
    /// plain rule. Otherwise (and when unknown) an EAGLE worker's `OffloadingConnector` tier is
    /// not predicted.
    #[serde(default)]
    pub drafter_groups_unflagged: bool,
}

/// The lookup parameters of one (worker, rank), derived like vLLM's coordinator does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Params {
    pub hash_block: u32,
    pub align: u32,
    pub fine_grained: bool,
    pub unitary: bool,
    /// EAGLE/MTP drop (`LookupConfig::eagle`, unless vLLM 0.33's lookahead hashes are on).
    pub eagle: bool,
    /// Under the drop, only full-attention lookups drop: the engine flags the groups holding
    /// the drafter's layers (`LookupConfig::drafter_groups_unflagged` is false), which are
    /// full attention for every drafter kvroute knows, and vLLM's coordinator drops only in
    /// the spec groups holding a flagged group (`SpecGroup.use_eagle` in vLLM 0.33's
    /// `v1/core/kv_cache_coordinator.py`). False: every lookup drops (no group flagged).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub eagle_full_only: bool,
    /// vLLM 0.33's lookahead tokens per block hash (`WorkerConfig::hash_lookahead_tokens` on a
    /// 0.33 worker; 0 otherwise): the request is hashed with them and a hit is at most
    /// `⌊(n − max(1, L)) / A⌋ · A`.
    #[serde(skip_serializing_if = "is_zero")]
    pub lookahead: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `Layout::params` and `Layout::lookups` of one layout and configuration, kept by the rank so
/// a prediction derives nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub params: Option<Params>,
    pub lookups: Vec<(GroupSpec, Vec<u32>)>,
}

impl Layout {
    /// The plan under an engine's `rules` (`WorkerConfig::rules`).
    pub fn plan(&self, cfg: &LookupConfig, rules: Rules) -> Plan {
        Plan {
            params: self.params_with(cfg, rules),
            lookups: self.lookups(),
        }
    }

    /// The params under vLLM 0.32's rules (the drop from `cfg.eagle`, no lookahead); `None`
    /// when no group is prefix-cacheable (nothing can hit).
    pub fn params(&self, cfg: &LookupConfig) -> Option<Params> {
        self.params_with(
            cfg,
            Rules {
                lookahead: 0,
                eagle_drop: cfg.eagle,
            },
        )
    }

    /// The params under an engine's `rules` (which decide the drop and the lookahead; `cfg`
    /// the rest).
    pub fn params_with(&self, cfg: &LookupConfig, rules: Rules) -> Option<Params> {
        let cacheable: Vec<&GroupSpec> = self
            .groups
            .values()
            .filter(|g| g.rule() != Rule::NotCacheable && g.block_size > 0)
            .collect();
        if cacheable.is_empty() {
            return None;
        }
        let unitary = self.groups.len() == 1;
        let derived = match cacheable.iter().filter_map(|g| g.partial_size).min() {
            Some(p) => p as u64,
            None => cacheable
                .iter()
                .fold(0u64, |acc, g| gcd(acc, g.block_size as u64)),
        };
        let h = cfg.hash_block_size.map(u64::from).unwrap_or(derived).max(1);
        let fine_grained = !unitary
            && cacheable
                .iter()
                .any(|g| g.rule() == Rule::Mamba && g.block_size as u64 > h)
            && cacheable.iter().all(|g| {
                matches!(g.rule(), Rule::FullAttention | Rule::Mamba) || g.block_size as u64 == h
            });
        let align = if unitary {
            cacheable[0].block_size as u64
        } else if fine_grained {
            h
        } else {
            self.groups
                .values()
                .filter(|g| g.block_size > 0)
                .fold(1u64, |acc, g| {
                    acc / gcd(acc, g.block_size as u64) * g.block_size as u64
                })
        };
        Some(Params {
            hash_block: u32::try_from(h).ok()?,
            align: u32::try_from(align).ok()?,
            fine_grained,
            unitary,
            eagle: rules.eagle_drop,
            eagle_full_only: rules.eagle_drop && !cfg.drafter_groups_unflagged,
            lookahead: rules.lookahead,
        })
    }

    /// The coordinator's lookups: sets of groups with an identical spec, full-attention kinds
    /// first, then the rest in group order. Non-cacheable groups are left out.
    pub fn lookups(&self) -> Vec<(GroupSpec, Vec<u32>)> {
        let mut out: Vec<(GroupSpec, Vec<u32>)> = Vec::new();
        let mut ordered: Vec<(&u32, &GroupSpec)> = self
            .groups
            .iter()
            .filter(|(_, g)| g.rule() != Rule::NotCacheable && g.block_size > 0)
            .collect();
        ordered.sort_by_key(|(id, g)| (g.rule() != Rule::FullAttention, **id));
        for (id, g) in ordered {
            let same = |s: &GroupSpec| {
                s.kind == g.kind && s.window == g.window && s.block_size == g.block_size
            };
            match out.iter_mut().find(|(s, _)| same(s)) {
                Some((_, ids)) => ids.push(*id),
                None => out.push((g.clone(), vec![*id])),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: &str, window: Option<u32>, b: u32) -> GroupSpec {
        GroupSpec {
            kind: CacheKind::parse(kind),
            window,
            block_size: b,
            partial_size: None,
        }
    }

    #[test]
    fn gemma3_layout_aligns_to_its_one_block_size() {
        let mut l = Layout::default();
        for g in 0..3 {
            l.groups.insert(g, spec("sliding_window", Some(64), 32));
        }
        l.groups.insert(3, spec("full_attention", None, 32));
        let p = l.params(&LookupConfig::default()).unwrap();
        assert_eq!(
            (p.hash_block, p.align, p.fine_grained, p.unitary),
            (32, 32, false, false)
        );
        let lookups = l.lookups();
        assert_eq!(lookups.len(), 2);
        assert_eq!(lookups[0].1, vec![3]);
        assert_eq!(lookups[1].1, vec![0, 1, 2]);
    }

    #[test]
    fn a_mamba_hybrid_with_a_smaller_match_unit_uses_fine_grained_hits() {
        let mut l = Layout::default();
        l.groups.insert(0, spec("mamba", None, 528));
        l.groups.insert(1, spec("full_attention", None, 528));
        let cfg = LookupConfig {
            hash_block_size: Some(16),
            chunk_size: None,
            eagle: false,
            offload_chunk_blocks: None,
            offload_connector: Default::default(),
            drafter_groups_unflagged: false,
        };
        let p = l.params(&cfg).unwrap();
        assert_eq!((p.hash_block, p.align, p.fine_grained), (16, 16, true));
        let p = l.params(&LookupConfig::default()).unwrap();
        assert_eq!((p.hash_block, p.align, p.fine_grained), (528, 528, false));
    }

    #[test]
    fn a_kind_change_is_reported_and_a_smaller_block_is_a_partial_size() {
        let mut l = Layout::default();
        assert_eq!(
            l.learn(0, &CacheKind::FullAttention, None, 64),
            Learned::NewGroup
        );
        assert_eq!(
            l.learn(0, &CacheKind::FullAttention, None, 16),
            Learned::Resized
        );
        assert_eq!(
            l.learn(0, &CacheKind::FullAttention, None, 16),
            Learned::Known
        );
        assert_eq!(l.groups.get(&0).map(|g| g.partial_size), Some(Some(16)));
        assert_eq!(l.learn(0, &CacheKind::Mamba, None, 64), Learned::Changed);
    }
}
