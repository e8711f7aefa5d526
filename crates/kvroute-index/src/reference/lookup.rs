//! The reference model's coordinator and single-type managers, as plain loops.
//!
//! Owns: the lookups in coordinator order (identical specs merged, full-attention kinds first),
//! the hybrid coordinator's fixed-point pass and its EAGLE variant, and each manager's
//! `find_longest_cache_hit` (full attention, sliding window, chunked local, Mamba), written
//! from vLLM 0.32's and 0.33's `kv_cache_coordinator.py` and `single_type_kv_cache_manager.py`.
//! Invariant: shares no code with the index's `rules`, `holder` or `layout`.
//! Must not: be used on a hot path.

use super::{Ctx, RefGroup};
use crate::event::Rule;
use std::collections::BTreeMap;

impl Ctx<'_> {
    /// Lookups in coordinator order: identical specs merged, full-attention kinds first.
    pub(super) fn lookups(&self, full_only: bool) -> Vec<(RefGroup, Vec<u32>)> {
        let mut out: Vec<(RefGroup, Vec<u32>)> = Vec::new();
        for pass_full in [true, false] {
            for (id, spec) in &self.rank.layout.groups {
                let rule = spec.rule();
                if rule == Rule::NotCacheable || (rule == Rule::FullAttention) != pass_full {
                    continue;
                }
                if full_only && rule != Rule::FullAttention {
                    continue;
                }
                let mut merged = false;
                for (s, ids) in out.iter_mut() {
                    if s.kind == spec.kind
                        && s.window == spec.window
                        && s.block_size == spec.block_size
                    {
                        ids.push(*id);
                        merged = true;
                    }
                }
                if !merged {
                    out.push((spec.clone(), vec![*id]));
                }
            }
        }
        out
    }

    pub(super) fn k(&self, spec: &RefGroup) -> usize {
        (spec.block_size / self.p.hash_block) as usize
    }

    /// Is hash index `idx` of the request cached in every group of the lookup?
    pub(super) fn cached(&self, groups: &[u32], idx: usize) -> bool {
        if idx >= self.hashes.len() {
            return false;
        }
        let h = self.hashes[idx];
        groups.iter().all(|g| {
            self.rank
                .blocks
                .get(g)
                .is_some_and(|held| held.contains(&h))
        })
    }

    pub(super) fn block_cached(&self, spec: &RefGroup, groups: &[u32], i: usize) -> bool {
        let k = self.k(spec);
        self.cached(groups, (i + 1) * k - 1)
    }

    pub(super) fn coordinate(&self, lookups: &[(RefGroup, Vec<u32>)], max_len: u64) -> u64 {
        for (spec, _) in lookups {
            if spec.block_size % self.p.hash_block != 0 {
                return 0;
            }
        }
        let mut full_hit: BTreeMap<usize, u64> = BTreeMap::new();
        let mut hit_length = max_len;
        loop {
            let before = hit_length;
            for (i, (spec, groups)) in lookups.iter().enumerate() {
                let hit = match spec.rule() {
                    Rule::FullAttention => match full_hit.get(&i) {
                        Some(first) => (*first).min(hit_length),
                        None => {
                            let h = self.full(spec, groups, hit_length);
                            full_hit.insert(i, h);
                            h
                        }
                    },
                    Rule::SlidingWindow => self.sliding_window(spec, groups, hit_length),
                    Rule::ChunkedLocal => self.chunked_local(spec, groups, hit_length),
                    Rule::Mamba => self.mamba(spec, groups, hit_length),
                    Rule::NotCacheable => hit_length,
                };
                hit_length = hit;
            }
            if hit_length == before {
                return hit_length;
            }
        }
    }

    /// HybridKVCacheCoordinator.find_longest_cache_hit with every group an EAGLE group, or
    /// only the full-attention ones (`RefParams::eagle_full_only`) (UnitaryKVCacheCoordinator for
    /// one group).
    pub(super) fn coordinate_eagle(&self, lookups: &[(RefGroup, Vec<u32>)], max_len: u64) -> u64 {
        for (spec, _) in lookups {
            if spec.block_size % self.p.hash_block != 0 {
                return 0;
            }
        }
        // vLLM groups layers of one spec into one lookup and drops in it when any of its
        // groups is flagged as the drafter's; kvroute takes the drafter's layers to be full
        // attention when the engine flags them (`RefParams::eagle_full_only`).
        let is_eagle =
            |spec: &RefGroup| !self.p.eagle_full_only || spec.rule() == Rule::FullAttention;
        if self.p.unitary {
            return match lookups.first() {
                Some((spec, groups)) => self.find_eagle(spec, groups, max_len, is_eagle(spec)),
                None => 0,
            };
        }
        let hash_block = self.p.hash_block as u64;
        let mut hit_length = max_len;
        let mut hit_length_by_lookup: BTreeMap<usize, u64> = BTreeMap::new();
        let mut eagle_verified: Vec<usize> = Vec::new();
        let is_simple_hybrid = lookups.len() == 2 && lookups[0].0.rule() == Rule::FullAttention;
        loop {
            let mut curr_hit_length = hit_length;
            for (idx, (spec, groups)) in lookups.iter().enumerate() {
                if spec.rule() == Rule::FullAttention {
                    if let Some(h) = hit_length_by_lookup.get(&idx) {
                        curr_hit_length = curr_hit_length.min(*h);
                        continue;
                    }
                }
                let drop_eagle_block = is_eagle(spec) && !eagle_verified.contains(&idx);
                let mut max_length = curr_hit_length;
                if drop_eagle_block
                    && spec.rule() != Rule::Mamba
                    && spec.rule() != Rule::ChunkedLocal
                {
                    let block_size = spec.block_size as u64;
                    let fine_lookup = self.p.fine_grained && spec.rule() == Rule::FullAttention;
                    let margin = if fine_lookup && block_size > hash_block {
                        hash_block
                    } else {
                        block_size
                    };
                    max_length =
                        (curr_hit_length + margin).min(self.hashes.len() as u64 * hash_block);
                }
                let drop = drop_eagle_block && spec.rule() != Rule::ChunkedLocal;
                let new_hit_length = self.find_eagle(spec, groups, max_length, drop);
                if drop_eagle_block {
                    eagle_verified.push(idx);
                } else if new_hit_length < curr_hit_length {
                    eagle_verified.clear();
                }
                curr_hit_length = new_hit_length;
                hit_length_by_lookup.insert(idx, new_hit_length);
            }
            if curr_hit_length >= hit_length {
                break;
            }
            hit_length = curr_hit_length;
            if is_simple_hybrid {
                break;
            }
        }
        hit_length
    }

    pub(super) fn find_eagle(
        &self,
        spec: &RefGroup,
        groups: &[u32],
        max_length: u64,
        drop: bool,
    ) -> u64 {
        match spec.rule() {
            Rule::FullAttention => self.full_eagle(spec, groups, max_length, drop),
            Rule::SlidingWindow => self.sliding_window_eagle(spec, groups, max_length, drop),
            Rule::ChunkedLocal => self.chunked_local(spec, groups, max_length),
            Rule::Mamba => self.mamba(spec, groups, max_length),
            Rule::NotCacheable => max_length,
        }
    }

    /// FullAttentionManager.find_longest_cache_hit (phase 1, phase 2, the EAGLE drop).
    pub(super) fn full_eagle(
        &self,
        spec: &RefGroup,
        groups: &[u32],
        max_length: u64,
        drop: bool,
    ) -> u64 {
        let block_size = spec.block_size as u64;
        let alignment_tokens = self.align();
        let mut num_blocks = 0u64;
        for i in 0..(max_length / block_size) as usize {
            if !self.block_cached(spec, groups, i) {
                break;
            }
            num_blocks += 1;
        }
        let mut hit_length = num_blocks * block_size;
        let fine_grained =
            alignment_tokens < block_size && block_size.is_multiple_of(alignment_tokens);
        if fine_grained {
            let scale_factor = block_size / alignment_tokens;
            let first_partial_idx = num_blocks * scale_factor;
            let max_partial_idx = (first_partial_idx + scale_factor - 1)
                .min(max_length / alignment_tokens)
                .min(self.hashes.len() as u64);
            let mut fine_idx = max_partial_idx;
            while fine_idx > first_partial_idx {
                fine_idx -= 1;
                if self.cached(groups, fine_idx as usize) {
                    hit_length = (fine_idx + 1) * alignment_tokens;
                    break;
                }
            }
        }
        if drop && hit_length > 0 {
            hit_length -= alignment_tokens.min(block_size);
        }
        hit_length - hit_length % alignment_tokens
    }

    /// SlidingWindowManager.find_longest_cache_hit with the EAGLE variant.
    pub(super) fn sliding_window_eagle(
        &self,
        spec: &RefGroup,
        groups: &[u32],
        max_length: u64,
        drop: bool,
    ) -> u64 {
        let block_size = spec.block_size as u64;
        let alignment_tokens = self.align();
        let window = spec.window.unwrap_or(2).max(2) as u64;
        let mut contiguous_needed = (window - 1).div_ceil(block_size).max(1);
        if drop {
            contiguous_needed += 1;
        }
        let max_num_blocks = (max_length / block_size) as i64;
        let mut computed: Vec<bool> = vec![false; max_num_blocks.max(0) as usize];
        let mut num_contiguous = 0u64;
        let mut match_found = false;
        let mut i = max_num_blocks - 1;
        while i >= 0 {
            if self.block_cached(spec, groups, i as usize) {
                if num_contiguous == 0 && block_size != alignment_tokens {
                    let post_pop_blocks = if drop { i as u64 } else { i as u64 + 1 };
                    if !(post_pop_blocks * block_size).is_multiple_of(alignment_tokens) {
                        i -= 1;
                        continue;
                    }
                }
                computed[i as usize] = true;
                num_contiguous += 1;
                if num_contiguous >= contiguous_needed {
                    computed.truncate(i as usize + num_contiguous as usize);
                    match_found = true;
                    break;
                }
            } else {
                num_contiguous = 0;
            }
            i -= 1;
        }
        if !match_found {
            computed.truncate(num_contiguous as usize);
            while block_size != alignment_tokens
                && !(computed.len() as u64 * block_size).is_multiple_of(alignment_tokens)
            {
                computed.pop();
            }
        }
        if drop && !computed.is_empty() {
            computed.pop();
            while block_size != alignment_tokens
                && !(computed.len() as u64 * block_size).is_multiple_of(alignment_tokens)
            {
                computed.pop();
            }
        }
        computed.len() as u64 * block_size
    }

    pub(super) fn align(&self) -> u64 {
        self.p.align as u64
    }

    pub(super) fn full(&self, spec: &RefGroup, groups: &[u32], max_length: u64) -> u64 {
        let b = spec.block_size as u64;
        let max_num_blocks = (max_length / b) as usize;
        let mut computed = 0usize;
        for i in 0..max_num_blocks {
            if self.block_cached(spec, groups, i) {
                computed += 1;
            } else {
                break;
            }
        }
        if !self.p.fine_grained {
            while computed > 0 && !(computed as u64 * b).is_multiple_of(self.align()) {
                computed -= 1;
            }
            return computed as u64 * b;
        }
        let mut hit = computed as u64 * b;
        let k = self.k(spec);
        let h = self.p.hash_block as u64;
        let mut j = k - 1;
        while j >= 1 {
            let pos = hit + j as u64 * h;
            if pos <= max_length && self.cached(groups, computed * k + j - 1) {
                hit = pos;
                break;
            }
            j -= 1;
        }
        hit
    }

    pub(super) fn sliding_window(&self, spec: &RefGroup, groups: &[u32], max_length: u64) -> u64 {
        let b = spec.block_size as u64;
        let a = self.align();
        let window = spec.window.unwrap_or(2).max(2) as u64;
        let contiguous_needed = (window - 1).div_ceil(b).max(1);
        let max_num_blocks = (max_length / b) as i64;
        let mut num_contiguous = 0u64;
        let mut i = max_num_blocks - 1;
        while i >= 0 {
            if self.block_cached(spec, groups, i as usize) {
                if num_contiguous == 0 && b != a && !((i as u64 + 1) * b).is_multiple_of(a) {
                    i -= 1;
                    continue;
                }
                num_contiguous += 1;
                if num_contiguous >= contiguous_needed {
                    return (i as u64 + num_contiguous) * b;
                }
            } else {
                num_contiguous = 0;
            }
            i -= 1;
        }
        let mut blocks = num_contiguous;
        while b != a && !(blocks * b).is_multiple_of(a) {
            blocks -= 1;
        }
        blocks * b
    }

    pub(super) fn chunked_local(&self, spec: &RefGroup, groups: &[u32], max_length: u64) -> u64 {
        let b = spec.block_size as u64;
        let start = match self.chunk {
            Some(c) if c > 0 => max_length / c as u64 * c as u64,
            _ => 0,
        };
        let start_block = (start / b) as usize;
        let max_num_blocks = (max_length / b) as usize;
        let mut computed = start_block;
        for i in start_block..max_num_blocks {
            if self.block_cached(spec, groups, i) {
                computed += 1;
            } else {
                break;
            }
        }
        let hit = computed as u64 * b;
        hit - hit % self.align()
    }

    pub(super) fn mamba(&self, spec: &RefGroup, groups: &[u32], max_length: u64) -> u64 {
        let a = self.align();
        let (unit, k) = if self.p.fine_grained {
            (self.p.hash_block as u64, 1usize)
        } else {
            (spec.block_size as u64, self.k(spec))
        };
        let max_num = (max_length / unit) as i64;
        let mut i = max_num - 1;
        while i >= 0 {
            if self.cached(groups, (i as usize + 1) * k - 1) {
                if unit != a && !((i as u64 + 1) * unit).is_multiple_of(a) {
                    i -= 1;
                    continue;
                }
                return (i as u64 + 1) * unit;
            }
            i -= 1;
        }
        0
    }
}
