//! The reference model's groups and lookup parameters, from vLLM's source with plain code.
//!
//! Owns: learning a rank's groups from its stores (`RefLayout::learn`: kind, window, every block
//! size seen), the manager vLLM gives each kind (`RefGroup::rule`, as `spec_manager_map` in
//! `single_type_kv_cache_manager.py` does), and `RefParams::derive`.
//! Invariant: shares no code with the index's `layout`, `engine::Rules` or `CacheKind::rule`.
//! Must not: hold blocks.

use super::{RefGroup, RefLayout, RefParams};
use crate::engine::Engine;
use crate::event::{CacheKind, Rule};
use crate::rank::WorkerConfig;

impl RefGroup {
    /// The reuse rule of the manager vLLM builds for the group's spec: full attention for
    /// `FullAttentionSpec`, `MLAAttentionSpec` and `SinkFullAttentionSpec`; the sliding-window
    /// manager for both sliding-window specs; the chunked-local and Mamba managers for theirs;
    /// no prefix hit for cross attention, encoder-only layers or a kind this model does not
    /// know.
    pub(super) fn rule(&self) -> Rule {
        match &self.kind {
            CacheKind::FullAttention => Rule::FullAttention,
            CacheKind::MlaAttention => Rule::FullAttention,
            CacheKind::SinkFullAttention => Rule::FullAttention,
            CacheKind::SlidingWindow => Rule::SlidingWindow,
            CacheKind::SlidingWindowMla => Rule::SlidingWindow,
            CacheKind::ChunkedLocalAttention => Rule::ChunkedLocal,
            CacheKind::Mamba => Rule::Mamba,
            CacheKind::CrossAttention => Rule::NotCacheable,
            CacheKind::EncoderOnlyAttention => Rule::NotCacheable,
            CacheKind::Unknown(_) => Rule::NotCacheable,
        }
    }
}

impl RefLayout {
    /// Records a store of `block_size` tokens in `group`. `false` when the group was known with
    /// another kind or window: the engine's layout changed, and the caller starts the rank
    /// afresh. A group's block size is the largest size its stores showed; a smaller one (the
    /// partial entries at the hash block) is its `partial_size`, the smallest seen.
    pub(super) fn learn(
        &mut self,
        group: u32,
        kind: &CacheKind,
        window: Option<u32>,
        block_size: u32,
    ) -> bool {
        if let Some(known) = self.groups.get(&group) {
            if known.kind != *kind || known.window != window {
                return false;
            }
        }
        let sizes = self.sizes.entry(group).or_default();
        sizes.insert(block_size);
        let largest = sizes.iter().copied().max().unwrap_or(block_size);
        let smallest = sizes.iter().copied().min().unwrap_or(block_size);
        self.groups.insert(
            group,
            RefGroup {
                kind: kind.clone(),
                window,
                block_size: largest,
                partial_size: (smallest < largest).then_some(smallest),
            },
        );
        true
    }
}

impl RefParams {
    /// `None` when no group is prefix-cacheable.
    pub(super) fn derive(layout: &RefLayout, cfg: &WorkerConfig) -> Option<RefParams> {
        let mut cacheable: Vec<&RefGroup> = Vec::new();
        for spec in layout.groups.values() {
            if spec.rule() != Rule::NotCacheable && spec.block_size > 0 {
                cacheable.push(spec);
            }
        }
        let first = *cacheable.first()?;
        // The scheduler block: the LCM of every group's block size.
        let mut sched = 1u64;
        for spec in layout.groups.values() {
            let b = u64::from(spec.block_size);
            if b == 0 {
                continue;
            }
            let (mut x, mut y) = (sched, b);
            while y != 0 {
                (x, y) = (y, x % y);
            }
            match (sched / x).checked_mul(b) {
                Some(l) if l <= u64::from(u32::MAX) => sched = l,
                _ => {
                    sched = u64::from(u32::MAX);
                    break;
                }
            }
        }
        let unitary = layout.groups.len() == 1;
        // The hash block: the configured prefix-match unit, else the smallest (partial) block
        // size the events showed, else the GCD of the cacheable groups' block sizes (one
        // group's block size when there is one). vLLM refuses to start with a unit other than
        // the block size on one group, so on a running engine the configured unit there is
        // the block size; kvroute's configuration is taken as given (as the index does).
        let mut h = 0u64;
        let mut smallest_partial: Option<u64> = None;
        for spec in &cacheable {
            let b = u64::from(spec.block_size);
            let (mut x, mut y) = (h, b);
            while y != 0 {
                (x, y) = (y, x % y);
            }
            h = x;
            if let Some(p) = spec.partial_size {
                let p = u64::from(p);
                smallest_partial = Some(smallest_partial.map_or(p, |s| s.min(p)));
            }
        }
        if let Some(p) = smallest_partial {
            h = p;
        }
        if let Some(unit) = cfg.lookup.hash_block_size {
            h = u64::from(unit);
        }
        let h = h.max(1);
        let (hash_block, align, fine_grained) = if unitary {
            // One group (`UnitaryKVCacheCoordinator`): hits at its block size.
            (h, u64::from(first.block_size), false)
        } else {
            // Partial hash hits: an align-mode Mamba group coarser than the hash block, and
            // every other cacheable group either one whose manager looks up fine-grained
            // (full attention, Mamba) or one at the hash block.
            let mut mamba_coarser = false;
            let mut all_support = true;
            for spec in &cacheable {
                let b = u64::from(spec.block_size);
                match spec.rule() {
                    Rule::Mamba => mamba_coarser |= b > h,
                    Rule::FullAttention => {}
                    _ => all_support &= b == h,
                }
            }
            let fine = mamba_coarser && all_support;
            (h, if fine { h } else { sched }, fine)
        };
        // The engine's rules: lookahead hashes only on 0.33, and then no drop.
        let lookahead = if cfg.engine == Engine::Vllm033 {
            cfg.hash_lookahead_tokens
        } else {
            0
        };
        let eagle = cfg.lookup.eagle && lookahead == 0;
        Some(RefParams {
            hash_block: u32::try_from(hash_block).ok()?,
            sched,
            align: u32::try_from(align).ok()?,
            fine_grained,
            unitary,
            eagle,
            eagle_full_only: eagle && !cfg.lookup.drafter_groups_unflagged,
            lookahead,
        })
    }
}
