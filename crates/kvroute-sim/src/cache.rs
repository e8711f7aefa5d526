//! The KV cache manager: vLLM 0.32's coordinator and per-kind managers over one block pool.
//!
//! Owns: per (request, group) block tables; the hit lookup (`find_longest_cache_hit`, unitary
//! or the hybrid fixed point, with the junction it detects, and with EAGLE's drop: each group
//! looks one block past the candidate length and drops it, once per candidate length);
//! `allocate_slots` (freeing blocks that left a window, chunk or superseded Mamba state, the
//! admission check, allocation with the drafter's lookahead slots, caching with the retention
//! masks at the replay boundaries); freeing finished requests; the prefix-cache reset.
//! Invariants: events come out of the pool in the order vLLM emits them (evictions during
//! allocation, then one store per group in group order); a group's table holds the null block
//! for skipped positions; hits are multiples of the alignment and at most `n − 1`.
//! Must not: schedule (token budgets, preemption, sampling) or own the wire.

use crate::groups::{self, GroupReq};
use crate::pool::{BlockId, BlockPool, Key, ReqView, NULL};
use crate::spec::{CacheParams, GroupKind, GroupSpec, ModelSpec};
use kvroute_index::{Event, WorkerId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Cache settings that are not part of the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    pub num_blocks: u32,
    pub max_model_len: u32,
    pub max_num_batched_tokens: u32,
    /// vLLM's `--prefix-cache-retention-interval`: `Some(0)` sparse (default), `Some(k)` one
    /// checkpoint per `k` tokens, `None` dense.
    pub retention: Option<u32>,
    /// Mamba layers that export a prefill checkpoint inside one forward pass (Mamba2:
    /// Nemotron-H); GDN (Qwen3-Next) does not, so the scheduler splits chunks there instead.
    pub prefill_checkpoints: bool,
    /// EAGLE-style speculation whose matches drop the last block (vLLM 0.32, or 0.33 without
    /// lookahead hashes): every group is an EAGLE group, or with `eagle_full_only` the
    /// full-attention ones.
    pub eagle_drop: bool,
    /// The engine flags the groups holding the drafter's layers (`vllm_rules::SpecRules::
    /// drafter_groups_flagged`; full attention for every drafter modeled here): only those
    /// groups' managers and lookups drop and shift their window masks, as vLLM's coordinator
    /// decides the drop per spec group (`SpecGroup.use_eagle`).
    pub eagle_full_only: bool,
}

impl CacheConfig {
    /// Whether a group of `kind` is an EAGLE group (drops the EAGLE block).
    pub fn eagle_group(&self, kind: GroupKind) -> bool {
        self.eagle_drop && (!self.eagle_full_only || kind.is_full())
    }
}

/// The request facts the manager needs.
pub struct ReqCtx<'a> {
    pub id: u64,
    pub view: ReqView<'a>,
    pub num_prompt: usize,
    pub shared_prefix_boundary: usize,
}

impl ReqCtx<'_> {
    pub fn num_tokens(&self) -> usize {
        self.view.tokens.len()
    }
}

/// A lookup's result.
#[derive(Clone, Debug, Default)]
pub struct Hit {
    /// Per group, the blocks the hit reuses (null for skipped positions); `None` when no group
    /// found anything (vLLM's empty `KVCacheBlocks`).
    pub blocks: Option<Vec<Vec<BlockId>>>,
    pub tokens: usize,
    /// The longest single-lookup hit minus the joint hit (vLLM's uncached common prefix).
    pub uncached: usize,
}

impl Hit {
    /// `shared_prefix_boundary` as `get_computed_blocks` derives it.
    pub fn junction(&self) -> usize {
        if self.uncached > 0 {
            self.tokens + self.uncached
        } else {
            0
        }
    }
}

pub(crate) struct Group {
    pub id: u32,
    pub spec: GroupSpec,
    pub reqs: HashMap<u64, GroupReq>,
    pub admission_cap: Option<usize>,
}

pub struct KvCache {
    pub spec: ModelSpec,
    pub params: CacheParams,
    pub cfg: CacheConfig,
    pub(crate) pool: BlockPool,
    pub(crate) groups: Vec<Group>,
    lookups: Vec<(GroupSpec, Vec<u32>)>,
    pub(crate) cached_this_step: HashSet<Key>,
}

/// The token counts one `allocate_slots` call gives the groups: `need_slot` with the
/// drafter's lookahead slots (capped at the model length), `main` the target model's alone.
#[derive(Clone, Copy)]
struct SlotCounts {
    need_slot: usize,
    main: usize,
}

impl SlotCounts {
    /// A group's count: align-mode Mamba allocates no lookahead slots (they would break its
    /// block alignment, and no drafter modeled here has Mamba layers), the others do.
    fn of(self, kind: GroupKind) -> usize {
        if kind == GroupKind::Mamba {
            self.main
        } else {
            self.need_slot
        }
    }
}

pub(crate) fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b.max(1))
}

impl KvCache {
    pub fn new(
        spec: ModelSpec,
        params: CacheParams,
        cfg: CacheConfig,
        worker: WorkerId,
        dp_rank: u32,
    ) -> KvCache {
        let in_flight = cfg.max_num_batched_tokens as usize;
        let max_len = cfg.max_model_len as usize;
        let groups: Vec<Group> = spec
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let b = g.block_size as usize;
                let admission_cap = match g.kind {
                    GroupKind::SlidingWindow { window } => {
                        Some(cdiv((window as usize - 1 + in_flight).min(max_len), b) + 1)
                    }
                    GroupKind::ChunkedLocal { chunk } => {
                        Some(cdiv((chunk as usize + in_flight).min(max_len), b))
                    }
                    _ => None,
                };
                Group {
                    id: i as u32,
                    spec: *g,
                    reqs: HashMap::new(),
                    admission_cap,
                }
            })
            .collect();
        let mut lookups: Vec<(GroupSpec, Vec<u32>)> = Vec::new();
        for g in &groups {
            match lookups.iter_mut().find(|(s, _)| *s == g.spec) {
                Some((_, ids)) => ids.push(g.id),
                None => lookups.push((g.spec, vec![g.id])),
            }
        }
        lookups.sort_by_key(|(s, _)| !s.kind.is_full());
        KvCache {
            pool: BlockPool::new(cfg.num_blocks, params.hash_block, worker, dp_rank),
            spec,
            params,
            cfg,
            groups,
            lookups,
            cached_this_step: HashSet::new(),
        }
    }

    pub fn new_step_starts(&mut self) {
        self.cached_this_step.clear();
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// The engine's hit for a request of `hashes` with at most `max_len` tokens reused.
    pub fn find_longest_cache_hit(&self, hashes: &[u64], max_len: usize) -> Hit {
        self.find_longest_cache_hit_in(&self.pool, hashes, max_len)
    }

    /// The coordinator's hit over another pool of this layout's blocks (a connector's CPU pool
    /// is looked up with the device's rules).
    pub fn find_longest_cache_hit_in(
        &self,
        pool: &BlockPool,
        hashes: &[u64],
        max_len: usize,
    ) -> Hit {
        let a = self.params.align as usize;
        let h = self.params.hash_block;
        let n_groups = self.groups.len();
        if self.params.unitary {
            let (spec, ids) = &self.lookups[0];
            let eagle = self.cfg.eagle_group(spec.kind);
            let (blocks, len) = groups::find(pool, hashes, h, spec, ids, max_len, a, eagle);
            return finish(n_groups, vec![(ids.clone(), blocks)], len, 0);
        }
        let mut hit = max_len;
        let mut longest = 0usize;
        let mut found: Vec<Option<(Vec<BlockId>, usize)>> = vec![None; n_groups];
        let simple = self.lookups.len() == 2 && self.lookups[0].0.kind.is_full();
        // Lookups whose EAGLE drop is verified at the current candidate length.
        let mut verified = vec![false; self.lookups.len()];
        loop {
            let mut curr = hit;
            for (li, (spec, ids)) in self.lookups.iter().enumerate() {
                let first = ids[0] as usize;
                if spec.kind.is_full() {
                    if let Some((_, len)) = &found[first] {
                        curr = curr.min(*len);
                        continue;
                    }
                }
                let drop = self.cfg.eagle_group(spec.kind) && !verified[li];
                let mut max = curr;
                if drop && spec.kind != GroupKind::Mamba {
                    // Match one block past the candidate, then drop it (a Mamba finder never
                    // drops, so it gets no margin).
                    max = (curr + spec.block_size as usize).min(hashes.len() * h as usize);
                }
                let (blocks, len) = groups::find(pool, hashes, h, spec, ids, max, a, drop);
                if drop {
                    verified[li] = true;
                } else if len < curr {
                    verified.iter_mut().for_each(|v| *v = false);
                }
                curr = len;
                for (gid, bl) in ids.iter().zip(blocks) {
                    found[*gid as usize] = Some((bl, len));
                }
                longest = longest.max(curr);
            }
            if curr >= hit {
                break;
            }
            hit = curr;
            if simple {
                break;
            }
        }
        for (spec, ids) in &self.lookups {
            if !spec.kind.is_full() {
                continue;
            }
            let nb = cdiv(hit, spec.block_size as usize);
            for gid in ids {
                if let Some((bl, len)) = &mut found[*gid as usize] {
                    bl.truncate(nb);
                    *len = hit;
                }
            }
        }
        let per_group: Vec<(Vec<u32>, Vec<Vec<BlockId>>)> = found
            .into_iter()
            .enumerate()
            .map(|(i, f)| (vec![i as u32], vec![f.map(|(b, _)| b).unwrap_or_default()]))
            .collect();
        finish(n_groups, per_group, hit, longest.saturating_sub(hit))
    }

    /// `allocate_slots`. `None` when the pool cannot hold the step (nothing allocated then,
    /// though blocks outside windows may have been freed, as in vLLM). `num_lookahead` slots
    /// past the scheduled tokens are allocated for a drafter's KV (vLLM's
    /// `num_lookahead_tokens`) in every group but Mamba's, whose align mode ignores them; they
    /// are never cached.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_slots(
        &mut self,
        req: &ReqCtx<'_>,
        num_computed: usize,
        num_new_tokens: usize,
        num_new_computed: usize,
        new_computed: Option<&[Vec<BlockId>]>,
        num_lookahead: usize,
        full_sequence_must_fit: bool,
    ) -> Option<()> {
        let max_len = self.cfg.max_model_len as usize;
        let local = num_computed + num_new_computed;
        let total = local.min(max_len);
        let n_tokens = req.num_tokens();
        let prefill_end = req.num_prompt.max(n_tokens.saturating_sub(1));
        let empty: Vec<Vec<BlockId>> = vec![Vec::new(); self.groups.len()];
        let nc = new_computed.unwrap_or(&empty);
        if full_sequence_must_fit {
            let full = n_tokens.min(max_len);
            let sizes = SlotCounts {
                need_slot: full,
                main: full,
            };
            let need = self.num_blocks_to_allocate(req, sizes, nc, total, local, true, prefill_end);
            if need > self.pool.num_free() as i64 {
                return None;
            }
        }
        let main = total + num_new_tokens;
        let sizes = SlotCounts {
            need_slot: (main + num_lookahead).min(max_len),
            main,
        };
        self.remove_skipped_blocks(req.id, total);
        let need = self.num_blocks_to_allocate(req, sizes, nc, total, local, false, prefill_end);
        if need > self.pool.num_free() as i64 {
            return None;
        }
        if let Some(nc) = new_computed {
            let running = self
                .groups
                .iter()
                .any(|g| g.reqs.get(&req.id).is_some_and(|r| r.num_cached.is_some()));
            if !running {
                for (g, blocks) in self.groups.iter_mut().zip(nc) {
                    groups::add_local_computed(&mut self.pool, g, req.id, blocks, local);
                }
            }
        }
        for gi in 0..self.groups.len() {
            let n = sizes.of(self.groups[gi].spec.kind);
            groups::allocate_new(&mut self.pool, &mut self.groups[gi], req.id, n)?;
        }
        let to_cache = (total + num_new_tokens).min(n_tokens);
        self.cache_blocks(req, to_cache);
        Some(())
    }

    #[allow(clippy::too_many_arguments)]
    fn num_blocks_to_allocate(
        &mut self,
        req: &ReqCtx<'_>,
        sizes: SlotCounts,
        new_computed: &[Vec<BlockId>],
        total_computed: usize,
        local_computed: usize,
        admission: bool,
        prefill_end: usize,
    ) -> i64 {
        let prefill_end = if self.cfg.retention == Some(0) {
            prefill_end
        } else {
            0
        };
        let ctx = groups::AllocCtx {
            hash_block: self.params.hash_block as usize,
            align: self.params.align as usize,
            num_gpu_blocks: self.pool.num_blocks(),
            prefill_checkpoints: self.cfg.prefill_checkpoints,
            proof: self.proof(req),
        };
        let mut sum = 0i64;
        for (g, nc) in self.groups.iter_mut().zip(new_computed) {
            let num_tokens = sizes.of(g.spec.kind);
            sum += groups::num_blocks_to_allocate(
                &self.pool,
                &self.cached_this_step,
                &ctx,
                g,
                req.id,
                num_tokens,
                nc,
                total_computed,
                local_computed,
                admission,
                prefill_end,
            );
        }
        sum
    }

    /// Frees blocks no longer needed for attention (outside a window or chunk, superseded
    /// Mamba states).
    pub fn remove_skipped_blocks(&mut self, req: u64, computed: usize) {
        for g in &mut self.groups {
            groups::remove_skipped(&mut self.pool, g, req, computed);
        }
    }

    /// `cache_blocks` for every group.
    pub fn cache_blocks(&mut self, req: &ReqCtx<'_>, num_computed: usize) {
        let boundaries = self.replay_boundaries(req.num_prompt);
        let proof = self.proof(req);
        let sched = self.params.scheduler_block as usize;
        let unitary = self.params.unitary;
        for gi in 0..self.groups.len() {
            let ctx = groups::CacheCtx {
                align: self.params.align as usize,
                hash_block: self.params.hash_block as usize,
                retention: self.cfg.retention,
                boundaries: &boundaries,
                eagle: self.cfg.eagle_group(self.groups[gi].spec.kind),
                proof,
            };
            let n = if unitary {
                num_computed
            } else {
                num_computed / sched * sched
            };
            groups::cache_blocks(
                &mut self.pool,
                &mut self.cached_this_step,
                &mut self.groups[gi],
                &ctx,
                req,
                n,
            );
        }
    }

    /// Where a Mamba state may be checkpointed: EAGLE's drop applies to every Mamba group
    /// whenever the engine drops (vLLM's `drop_eagle_checkpoint_block`), not per group.
    fn proof(&self, req: &ReqCtx<'_>) -> groups::Proof {
        groups::Proof {
            eagle_drop: self.cfg.eagle_drop,
            lookahead: req.view.lookahead,
        }
    }

    /// `replay_boundaries`: the positions a later request replaying a prompt of `n` tokens
    /// resumes at, whose blocks the retention masks keep: `n − 1` (a resend computes its last
    /// token again); with a dropping group, the scheduler-block boundary one block below a
    /// resend's (`n − 1` floored) and one below a longer sibling's (`n` floored), as the
    /// match looks one block past each and drops it.
    fn replay_boundaries(&self, n: usize) -> Vec<usize> {
        if !self.cfg.eagle_drop {
            return vec![n.saturating_sub(1)];
        }
        let b = self.params.scheduler_block as usize;
        let resend = n.saturating_sub(1) / b * b;
        let extension = n / b * b;
        let mut out = vec![resend.saturating_sub(b), extension.saturating_sub(b)];
        out.dedup();
        out
    }

    /// Frees a finished or preempted request's blocks (each group's tail first).
    pub fn free(&mut self, req: u64) {
        for g in &mut self.groups {
            if let Some(r) = g.reqs.remove(&req) {
                self.pool.free_blocks(r.blocks.into_iter().rev());
            }
        }
    }

    /// `reset_prefix_cache`: succeeds only when no request holds blocks.
    pub fn reset(&mut self) -> bool {
        self.pool.reset()
    }

    /// Events queued so far in this step (a position in the step's batch).
    pub fn pending_events(&self) -> usize {
        self.pool.pending_events()
    }

    /// The pool's queued events, each store annotated with its group's kind and window.
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut events = self.pool.take_events();
        for e in &mut events {
            if let Event::Stored(s) = e {
                if let Some(g) = s.group.and_then(|g| self.spec.groups.get(g as usize)) {
                    s.kind = Some(g.kind.cache_kind());
                    s.sliding_window = g.kind.reported_window();
                }
            }
        }
        events
    }

    /// The true cache state: group → 64-bit hash → copies.
    pub fn contents(&self) -> BTreeMap<u32, BTreeMap<u64, u32>> {
        let mut out: BTreeMap<u32, BTreeMap<u64, u32>> = BTreeMap::new();
        for ((h, g), n) in self.pool.contents() {
            out.entry(*g).or_default().insert(*h, n as u32);
        }
        out
    }

    /// Blocks a request holds per group (null positions excluded).
    pub fn held_blocks(&self, req: u64) -> Vec<usize> {
        self.groups
            .iter()
            .map(|g| {
                g.reqs
                    .get(&req)
                    .map_or(0, |r| r.blocks.iter().filter(|b| **b != NULL).count())
            })
            .collect()
    }
}

fn finish(
    n_groups: usize,
    per: Vec<(Vec<u32>, Vec<Vec<BlockId>>)>,
    tokens: usize,
    uncached: usize,
) -> Hit {
    let mut blocks = vec![Vec::new(); n_groups];
    for (ids, bl) in per {
        for (gid, b) in ids.into_iter().zip(bl) {
            blocks[gid as usize] = b;
        }
    }
    let any = blocks.iter().any(|b| !b.is_empty());
    Hit {
        blocks: any.then_some(blocks),
        tokens,
        uncached,
    }
}
