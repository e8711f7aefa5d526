//! Per-kind behaviour of one KV cache group (vLLM's single-type managers): hit rules, which
//! blocks a request needs, which it may free, and which it caches.
//!
//! Owns: `find` (full attention, sliding window, chunked local, Mamba in align mode), the
//! per-request block table (`GroupReq`), allocation counts and allocation, skipped-block
//! freeing, the retention masks (sparse reachable-boundary and junction checkpoints, dense,
//! interval) and the partial-tail / checkpoint re-keying of align-mode Mamba.
//! Invariants: every function mirrors the vLLM 0.32 manager method named in its doc comment,
//! without DCP, KV connectors or fine-grained (partial) hits, none of which the simulator
//! offers; under EAGLE the hit finders drop their last block, the window retention masks
//! keep one block more, shifted by one, and Mamba checkpoints sit one block below the
//! boundary the drop leaves; a block is cached only once its hash exists (with vLLM 0.33's
//! lookahead hashes, `L` tokens after it is full); block tables only grow, with the null block
//! in freed positions; align-mode Mamba allocates no lookahead slots.
//! Must not: touch other groups or decide scheduling.

use crate::cache::{cdiv, Group, ReqCtx};
use crate::pool::{BlockId, BlockPool, Key, StoreRange, NULL};
use crate::spec::{GroupKind, GroupSpec};
use std::collections::HashSet;

/// One request's state in one group.
#[derive(Clone, Debug, Default)]
pub struct GroupReq {
    pub blocks: Vec<BlockId>,
    /// vLLM's `num_cached_block` entry (present once the request is tracked as running).
    pub num_cached: Option<usize>,
    /// Mamba align: the state block of the previous allocation, freed once superseded.
    pub last_state: Option<usize>,
    pub retired: usize,
    pub allocated: bool,
    /// Mamba align: the reserved prefill checkpoint `(position, block index)`.
    pub checkpoint: Option<(usize, usize)>,
}

fn group_hash(hashes: &[u64], h: u32, block: u32, i: usize) -> Option<u64> {
    let k = (block / h.max(1)) as usize;
    hashes.get((i + 1) * k - 1).copied()
}

/// `find_longest_cache_hit` of one lookup (groups of one spec, looked up together); `drop`:
/// EAGLE's drop of the last matched block (full attention and sliding window; the Mamba finder
/// never drops, and a chunked local group is never configured with it).
#[allow(clippy::too_many_arguments)]
pub fn find(
    pool: &BlockPool,
    hashes: &[u64],
    h: u32,
    spec: &GroupSpec,
    ids: &[u32],
    max_len: usize,
    align: usize,
    drop: bool,
) -> (Vec<Vec<BlockId>>, usize) {
    let b = spec.block_size as usize;
    let n = ids.len();
    let cached =
        |i: usize| group_hash(hashes, h, spec.block_size, i).and_then(|x| pool.get_cached(x, ids));
    let max_blocks = max_len / b;
    match spec.kind {
        GroupKind::FullAttention => {
            let mut out: Vec<Vec<BlockId>> = vec![Vec::new(); n];
            for i in 0..max_blocks {
                let Some(found) = cached(i) else { break };
                for (o, f) in out.iter_mut().zip(found) {
                    o.push(f);
                }
            }
            let mut hit = out[0].len() * b;
            if drop && hit > 0 {
                hit -= align.min(b);
            }
            hit -= hit % align;
            let nb = cdiv(hit, b);
            for o in &mut out {
                o.truncate(nb);
            }
            (out, hit)
        }
        GroupKind::SlidingWindow { window } => {
            let need = contiguous_for_hit(window, b, drop);
            let mut out: Vec<Vec<BlockId>> = vec![vec![NULL; max_blocks]; n];
            let mut run = 0usize;
            let mut matched = false;
            for i in (0..max_blocks).rev() {
                if let Some(found) = cached(i) {
                    let post_pop = if drop { i } else { i + 1 };
                    if run == 0 && b != align && (post_pop * b) % align != 0 {
                        continue;
                    }
                    for (o, f) in out.iter_mut().zip(found) {
                        o[i] = f;
                    }
                    run += 1;
                    if run >= need {
                        for o in &mut out {
                            o.truncate(i + run);
                        }
                        matched = true;
                        break;
                    }
                } else {
                    run = 0;
                }
            }
            if !matched {
                for o in &mut out {
                    o.truncate(run);
                }
                while b != align && (out[0].len() * b) % align != 0 {
                    for o in &mut out {
                        o.pop();
                    }
                }
            }
            if drop && !out[0].is_empty() {
                for o in &mut out {
                    o.pop();
                }
                while b != align && (out[0].len() * b) % align != 0 {
                    for o in &mut out {
                        o.pop();
                    }
                }
            }
            let hit = out[0].len() * b;
            (out, hit)
        }
        GroupKind::ChunkedLocal { chunk } => {
            let chunk = chunk as usize;
            let start = if max_len > 0 {
                max_len / chunk * chunk
            } else {
                0
            };
            let start_block = start / b;
            let mut out: Vec<Vec<BlockId>> = vec![vec![NULL; start_block]; n];
            for i in start_block..max_blocks {
                let Some(found) = cached(i) else { break };
                for (o, f) in out.iter_mut().zip(found) {
                    o.push(f);
                }
            }
            let hit = out[0].len() * b;
            (out, hit)
        }
        GroupKind::Mamba => {
            let mut out: Vec<Vec<BlockId>> = vec![Vec::new(); n];
            for i in (0..max_blocks).rev() {
                if let Some(found) = cached(i) {
                    if b != align && ((i + 1) * b) % align != 0 {
                        continue;
                    }
                    for (o, f) in out.iter_mut().zip(found) {
                        o.extend(std::iter::repeat_n(NULL, i));
                        o.push(f);
                    }
                    return (out, (i + 1) * b);
                }
            }
            (out, 0)
        }
    }
}

/// `_contiguous_blocks_for_hit`: the blocks a window hit needs, one more under EAGLE (the
/// last one is dropped).
fn contiguous_for_hit(window: u32, b: usize, eagle: bool) -> usize {
    cdiv(window as usize - 1, b) + usize::from(eagle)
}

/// `get_num_skipped_tokens`.
fn skipped_tokens(kind: GroupKind, computed: usize) -> usize {
    match kind {
        GroupKind::FullAttention => 0,
        GroupKind::SlidingWindow { window } => (computed + 1).saturating_sub(window as usize),
        GroupKind::ChunkedLocal { chunk } => computed / chunk as usize * chunk as usize,
        GroupKind::Mamba => computed.saturating_sub(1),
    }
}

/// `add_local_computed_blocks`: the request adopts its hit blocks.
pub fn add_local_computed(
    pool: &mut BlockPool,
    g: &mut Group,
    req: u64,
    hit_blocks: &[BlockId],
    local_computed: usize,
) {
    let b = g.spec.block_size as usize;
    let skipped = skipped_tokens(g.spec.kind, local_computed) / b;
    let rest = hit_blocks.get(skipped..).unwrap_or_default();
    pool.touch(rest);
    let r = g.reqs.entry(req).or_default();
    r.blocks.extend(std::iter::repeat_n(NULL, skipped));
    r.blocks.extend_from_slice(rest);
    r.num_cached = Some(r.blocks.len());
}

pub struct AllocCtx {
    pub hash_block: usize,
    pub align: usize,
    pub num_gpu_blocks: usize,
    pub prefill_checkpoints: bool,
    /// Where a Mamba state may be checkpointed.
    pub proof: Proof,
}

fn evictable(pool: &BlockPool, blocks: &[BlockId]) -> i64 {
    blocks
        .iter()
        .filter(|b| **b != NULL && pool.ref_cnt(**b) == 0)
        .count() as i64
}

/// What a Mamba checkpoint must leave after it: with EAGLE's block drop
/// (`drop_eagle_checkpoint_block`, set on every Mamba manager when the engine drops), the block
/// the full-attention match drops; otherwise the token recomputed for logits, or the `L`
/// tokens a lookahead hash covers.
#[derive(Clone, Copy, Debug, Default)]
pub struct Proof {
    pub eagle_drop: bool,
    pub lookahead: usize,
}

/// `get_mamba_prefill_checkpoint_position`: the last `unit`-aligned position at most
/// `n − max(1, L)`, or under EAGLE's drop the aligned position one `unit` below `n`'s.
pub fn checkpoint_position(num_tokens: usize, unit: usize, proof: Proof) -> usize {
    if proof.eagle_drop {
        return (num_tokens / unit * unit).saturating_sub(unit);
    }
    num_tokens.saturating_sub(proof.lookahead.max(1)) / unit * unit
}

/// `is_mamba_prefill_checkpoint_valid` with a checkpoint alignment of 1 (Mamba2).
pub fn checkpoint_valid(qs: usize, qe: usize, cp: usize, h: usize, b: usize) -> bool {
    let initial_col = (qs as i64 - 1).div_euclid(b as i64);
    let cp_col = cdiv(qe, b) as i64 - 2;
    qs % h == 0 && cp_col > initial_col && qs + h <= cp && qs < cp && cp < qe
}

/// `get_num_blocks_to_allocate` (may be negative for Mamba, as in vLLM).
#[allow(clippy::too_many_arguments)]
pub fn num_blocks_to_allocate(
    pool: &BlockPool,
    cached_this_step: &HashSet<Key>,
    ctx: &AllocCtx,
    g: &mut Group,
    req: u64,
    num_tokens: usize,
    new_computed: &[BlockId],
    total_computed: usize,
    _local_computed: usize,
    admission: bool,
    prefill_end: usize,
) -> i64 {
    let b = g.spec.block_size as usize;
    if g.spec.kind == GroupKind::Mamba {
        if let Some(last) = new_computed.last() {
            if pool
                .primary_key(*last)
                .is_some_and(|k| cached_this_step.contains(&k))
            {
                return ctx.num_gpu_blocks as i64 + 1;
            }
        }
        let required = cdiv(num_tokens, b) as i64;
        let r = g.reqs.entry(req).or_default();
        let mut num_new = required - new_computed.len() as i64 - r.blocks.len() as i64;
        let mut cp = checkpoint_position(num_tokens, ctx.align, ctx.proof);
        let cp_idx = cdiv(num_tokens, b) as i64 - 2;
        let needs = ctx.prefill_checkpoints
            && num_tokens >= prefill_end
            && checkpoint_valid(total_computed, num_tokens, cp, ctx.hash_block, b)
            && cp_idx >= 0
            && (cp_idx as usize >= r.blocks.len()
                || r.blocks[cp_idx as usize] == NULL
                || (r.allocated && cp_idx as usize >= r.blocks.len()));
        if !needs {
            cp = 0;
        }
        let cp_block = i64::from(cp > 0);
        if !admission {
            r.checkpoint = (cp > 0).then_some((cp, cp_idx.max(0) as usize));
        }
        if num_new > 0 {
            num_new = num_new.min(1 + cp_block);
        }
        return num_new + evictable(pool, new_computed);
    }
    let mut required = cdiv(num_tokens, b);
    if admission {
        if let Some(cap) = g.admission_cap {
            required = required.min(cap);
        }
    }
    let r = g.reqs.entry(req).or_default();
    let have = r.blocks.len();
    if r.num_cached.is_some() {
        return required.saturating_sub(have) as i64;
    }
    let skipped = skipped_tokens(g.spec.kind, total_computed) / b;
    let local_blocks = new_computed.len() + have;
    let num_new = required.saturating_sub(skipped.max(local_blocks));
    let skip_new = skipped.saturating_sub(have);
    num_new as i64 + evictable(pool, new_computed.get(skip_new..).unwrap_or_default())
}

/// `allocate_new_blocks`. `None` only if the pool runs dry despite the admission count.
pub fn allocate_new(
    pool: &mut BlockPool,
    g: &mut Group,
    req: u64,
    num_tokens: usize,
) -> Option<()> {
    let b = g.spec.block_size as usize;
    let r = g.reqs.entry(req).or_default();
    let required = cdiv(num_tokens, b);
    if g.spec.kind != GroupKind::Mamba {
        let n = required.saturating_sub(r.blocks.len());
        if n > 0 {
            let new = pool.get_new_blocks(n)?;
            r.blocks.extend(new);
        }
        return Some(());
    }
    let cp_block = usize::from(r.checkpoint.is_some());
    if required <= r.blocks.len() && cp_block == 0 {
        r.allocated = true;
        return Some(());
    }
    let prev = r.blocks.len();
    if prev > 0 {
        r.last_state = Some(prev - 1);
    }
    let skipped = required.saturating_sub(1);
    if prev < skipped {
        let null_end = skipped - cp_block;
        if null_end > prev {
            r.blocks.extend(std::iter::repeat_n(NULL, null_end - prev));
        }
    }
    let n = required.saturating_sub(r.blocks.len());
    let new = pool.get_new_blocks(n)?;
    r.blocks.extend(new);
    r.allocated = true;
    Some(())
}

/// `remove_skipped_blocks` on the processed-token basis.
pub fn remove_skipped(pool: &mut BlockPool, g: &mut Group, req: u64, computed: usize) {
    let b = g.spec.block_size as usize;
    let Some(r) = g.reqs.get_mut(&req) else {
        return;
    };
    let skipped = skipped_tokens(g.spec.kind, computed);
    let mamba = g.spec.kind == GroupKind::Mamba;
    if skipped > 0 {
        let last = (skipped / b).min(r.blocks.len());
        let first = if mamba { r.retired } else { 0 };
        if first < last {
            let mut freed = Vec::new();
            for i in (first..last).rev() {
                if r.blocks[i] == NULL {
                    if mamba {
                        continue;
                    }
                    break;
                }
                freed.push(r.blocks[i]);
                r.blocks[i] = NULL;
            }
            pool.free_blocks(freed);
            if mamba {
                r.retired = last;
            }
        }
    }
    if mamba {
        if let Some(ls) = r.last_state {
            if ls + 1 < cdiv(computed, b) && r.blocks.get(ls).is_some_and(|x| *x != NULL) {
                pool.free_blocks([r.blocks[ls]]);
                r.blocks[ls] = NULL;
            }
        }
    }
}

pub struct CacheCtx<'a> {
    pub align: usize,
    pub hash_block: usize,
    pub retention: Option<u32>,
    pub boundaries: &'a [usize],
    /// The groups drop the EAGLE block (window masks keep one block more, shifted by one).
    pub eagle: bool,
    /// Where a Mamba state may be checkpointed.
    pub proof: Proof,
}

/// `reachable_block_mask` for blocks `[start, end)`; `None` keeps every block.
fn mask(
    kind: GroupKind,
    b: usize,
    start: usize,
    end: usize,
    ctx: &CacheCtx<'_>,
    boundaries: &[usize],
) -> Option<Vec<bool>> {
    let a = ctx.align;
    let mut m = vec![false; end - start];
    match kind {
        GroupKind::SlidingWindow { window } => {
            if a % b != 0 {
                return None;
            }
            let need = contiguous_for_hit(window, b, ctx.eagle);
            // The run a hit matches ends on the boundary block itself when EAGLE looks one
            // block past it, else on the block before the boundary.
            let shift = usize::from(ctx.eagle);
            let segment = match ctx.retention {
                None => Some(a),
                Some(0) => None,
                Some(k) => Some(k as usize),
            };
            if let Some(seg) = segment {
                let per = seg / b;
                if need >= per {
                    return None;
                }
                for i in start..end {
                    if i >= shift && (i - shift) % per >= per - need {
                        m[i - start] = true;
                    }
                }
            }
            if ctx.retention.is_some() {
                for bd in boundaries {
                    let e = bd / a * a / b + shift;
                    for j in start.max(e.saturating_sub(need))..end.min(e) {
                        m[j - start] = true;
                    }
                }
            }
            Some(m)
        }
        GroupKind::Mamba => {
            let retention = ctx.retention?;
            if retention > 0 {
                let per = retention as usize / b;
                if per <= 1 {
                    return None;
                }
                let first = (start + per) / per * per - 1;
                let mut i = first;
                while i < end {
                    if i >= start {
                        m[i - start] = true;
                    }
                    i += per;
                }
            }
            for bd in boundaries {
                let aligned = bd / a * a;
                if aligned >= b {
                    let bb = aligned / b - 1;
                    if start <= bb && bb < end {
                        m[bb - start] = true;
                    }
                }
            }
            Some(m)
        }
        _ => None,
    }
}

/// `cache_blocks` of one group (with the full-attention partial tail and the Mamba
/// checkpoint / partial-tail handling).
pub fn cache_blocks(
    pool: &mut BlockPool,
    cached_this_step: &mut HashSet<Key>,
    g: &mut Group,
    ctx: &CacheCtx<'_>,
    req: &ReqCtx<'_>,
    num_tokens: usize,
) {
    let b = g.spec.block_size as usize;
    let kind = g.spec.kind;
    let r = g.reqs.entry(req.id).or_default();
    let before = r.num_cached.unwrap_or(0);
    // Only blocks whose hash exists are cached (with lookahead hashes, the last ones later).
    let num_full = num_tokens.min(req.view.hashes.len() * ctx.hash_block) / b;
    if before < num_full {
        let mut boundaries: Vec<usize> = ctx.boundaries.to_vec();
        if req.shared_prefix_boundary > 0 {
            boundaries.push(req.shared_prefix_boundary);
        }
        let m = mask(kind, b, before, num_full, ctx, &boundaries);
        pool.cache_full_blocks(
            &req.view,
            &StoreRange {
                blocks: &r.blocks,
                num_cached: before,
                num_full,
                block_size: g.spec.block_size,
                group: g.id,
                mask: m.as_deref(),
            },
        );
        r.num_cached = Some(num_full);
    }
    match kind {
        GroupKind::FullAttention if b != ctx.hash_block => {
            full_partial_tail(pool, g, ctx, req, num_tokens);
        }
        GroupKind::Mamba => {
            if let Some(key) = mamba_partial_tail(pool, g, ctx, req, num_tokens) {
                cached_this_step.insert(key);
            }
            let r = g.reqs.entry(req.id).or_default();
            let after = r.num_cached.unwrap_or(0);
            for idx in before..after {
                if let Some(id) = r.blocks.get(idx).copied() {
                    if id != NULL {
                        if let Some(k) = pool.primary_key(id) {
                            cached_this_step.insert(k);
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

/// `FullAttentionManager._cache_partial_tail_block`.
fn full_partial_tail(
    pool: &mut BlockPool,
    g: &mut Group,
    ctx: &CacheCtx<'_>,
    req: &ReqCtx<'_>,
    num_tokens: usize,
) {
    let b = g.spec.block_size as usize;
    let h = ctx.hash_block;
    let boundary = req.num_prompt.saturating_sub(1) / h * h;
    if boundary == 0 || boundary > num_tokens || boundary % b == 0 {
        return;
    }
    let Some(r) = g.reqs.get(&req.id) else { return };
    let Some(id) = r.blocks.get(boundary / b).copied() else {
        return;
    };
    pool.cache_partial_block(&req.view, id, boundary as u32, g.id, false);
}

/// `MambaManager._cache_partial_tail_block` (align mode, no EAGLE, no shared-prefix
/// checkpoint option).
fn mamba_partial_tail(
    pool: &mut BlockPool,
    g: &mut Group,
    ctx: &CacheCtx<'_>,
    req: &ReqCtx<'_>,
    num_tokens: usize,
) -> Option<Key> {
    let b = g.spec.block_size as usize;
    let h = ctx.hash_block;
    let r = g.reqs.get(&req.id)?;
    if let Some((pos, idx)) = r.checkpoint {
        let id = *r.blocks.get(idx)?;
        let prompt_cp = pos == checkpoint_position(req.num_prompt, ctx.align, ctx.proof);
        let mut retained = false;
        if pos % b == 0 && pos >= b {
            let bi = pos / b - 1;
            retained = mask(g.spec.kind, b, bi, bi + 1, ctx, &[]).is_none_or(|m| m[0]);
        }
        if !prompt_cp && !retained && pos != req.shared_prefix_boundary {
            pool.evict(id);
            return None;
        }
        if pool.hash_tokens(id) == Some(pos as u32) {
            return None;
        }
        return pool.cache_partial_block(&req.view, id, pos as u32, g.id, true);
    }
    if num_tokens == 0 || num_tokens % h != 0 {
        return None;
    }
    if num_tokens != checkpoint_position(req.num_prompt, h, ctx.proof) {
        return None;
    }
    let idx = cdiv(num_tokens, b) - 1;
    let id = *r.blocks.get(idx)?;
    if id == NULL {
        return None;
    }
    pool.cache_partial_block(&req.view, id, num_tokens as u32, g.id, false)
}
