//! vLLM's per-kind reuse rules and their joint fixed point, over the fast holders.
//!
//! Owns: for one (worker, rank), given the request's hash chain at the hash block size `H`,
//! each lookup's "largest servable length ≤ max" and the coordinator's fixed point: starting at
//! `L = n − 1` (`n − L_la` with vLLM 0.33's `L_la ≥ 2` lookahead tokens; aligned down to `A`),
//! each lookup in order lowers `L`; full attention is computed
//! once and afterwards only trimmed; passes repeat until `L` stops changing.
//! Invariants: every returned length is a multiple of `A` and ≤ the `max` it was given; a block
//! is present only when every group of its lookup holds it.
//! Must not: mutate holders or hash anything (the chain is computed once per request).

use crate::event::Rule;
use crate::holder::{Multiset, SpecSet};
use crate::layout::{GroupSpec, Params};
use crate::runs::Runs;
use serde::Serialize;

/// One coordinator lookup: groups with an identical spec, looked up together.
#[derive(Clone, Copy)]
pub struct Lookup<'a> {
    pub spec: &'a GroupSpec,
    pub groups: &'a [u32],
    pub holders: &'a [HolderRef<'a>],
}

/// One group's blocks as the rules see them: its own multiset, or its id in the shared run
/// store with, when the index walked the request through the store already, the number of
/// leading blocks of the request (in the group's own blocks) it holds.
#[derive(Clone, Copy)]
pub enum HolderRef<'a> {
    Own(&'a Multiset),
    /// A slot in a table shared by groups of one spec.
    Spec {
        set: &'a SpecSet,
        slot: u8,
    },
    Shared {
        runs: &'a Runs,
        id: u32,
        prefix: Option<u64>,
    },
}

impl HolderRef<'_> {
    #[inline]
    pub fn contains(&self, h: u64) -> bool {
        match self {
            HolderRef::Own(m) => m.contains(h),
            HolderRef::Spec { set, slot } => set.contains(*slot, h),
            HolderRef::Shared { runs, id, .. } => runs.contains(*id, h),
        }
    }

    fn prefix(&self) -> Option<u64> {
        match self {
            HolderRef::Own(_) | HolderRef::Spec { .. } => None,
            HolderRef::Shared { prefix, .. } => *prefix,
        }
    }
}

/// What one group alone could serve, for `explain` and the group-blind comparison.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GroupEvidence {
    pub group: u32,
    pub kind: String,
    pub window: Option<u32>,
    pub block_size: u32,
    /// The largest length this group alone could serve (≤ n − 1, aligned to `A`).
    pub alone: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Joint {
    /// The engine's predicted `num_cached_tokens`.
    pub cached: u64,
    /// What a router that looks only at full-attention groups would predict.
    pub group_blind: u64,
    /// Each group alone (empty unless evidence was asked for).
    pub groups: Vec<GroupEvidence>,
}

/// Lookups a prediction resolves without allocating; a layout with more takes a `Vec`.
pub const STACK_LOOKUPS: usize = 4;

#[derive(Clone, Copy)]
struct View<'a> {
    hashes: &'a [u64],
    holders: &'a [HolderRef<'a>],
    /// Every holder is a slot of this one table: a block is present when all their bits are
    /// set (one probe for the lookup, not one per group).
    combined: Option<(&'a SpecSet, u8)>,
    /// The only holder, when it is a plain multiset (the common case, probed directly).
    single: Option<&'a Multiset>,
    block: u64,
    k: u64,
    h: u64,
    align: u64,
}

impl View<'_> {
    #[inline]
    fn has_idx(&self, idx: u64) -> bool {
        let Some(hash) = self.hashes.get(idx as usize) else {
            return false;
        };
        if let Some(m) = self.single {
            return m.contains(*hash);
        }
        if let Some((set, mask)) = self.combined {
            return set.contains_all(mask, *hash);
        }
        self.holders.iter().all(|m| m.contains(*hash))
    }
    #[inline]
    fn has_block(&self, i: u64) -> bool {
        self.has_idx((i + 1) * self.k - 1)
    }
    fn floor_a(&self, x: u64) -> u64 {
        x / self.align * self.align
    }

    /// The leading blocks every holder holds, when the index walked the request for all of
    /// them (the least of theirs).
    fn known(&self) -> Option<u64> {
        if self.holders.is_empty() {
            return None;
        }
        self.holders
            .iter()
            .try_fold(u64::MAX, |least, hd| hd.prefix().map(|p| least.min(p)))
    }

    /// Leading blocks present, at most `max_blocks`.
    fn leading(&self, max_blocks: u64) -> u64 {
        if let Some(p) = self.known() {
            return p.min(max_blocks);
        }
        let k = self.k as usize;
        let blocks = self.hashes.get(k - 1..).unwrap_or_default();
        let take = usize::try_from(max_blocks).unwrap_or(usize::MAX);
        let present = |h: &&u64| self.holders.iter().all(|m| m.contains(**h));
        match (k, self.holders) {
            // The common case: one holder, one hash per block.
            (1, [m]) => blocks
                .iter()
                .take(take)
                .take_while(|h| m.contains(**h))
                .count() as u64,
            _ => blocks
                .iter()
                .step_by(k)
                .take(take)
                .take_while(present)
                .count() as u64,
        }
    }

    fn full(&self, max: u64, fine: bool) -> u64 {
        let b = self.block;
        let m = self.leading(max / b);
        let mut hit = m * b;
        if fine {
            for j in (1..self.k).rev() {
                let pos = m * b + j * self.h;
                if pos <= max && self.has_idx(m * self.k + j - 1) {
                    hit = pos;
                    break;
                }
            }
        }
        self.floor_a(hit)
    }

    /// The raw full-attention hit (not aligned): leading blocks, then with fine-grained hits
    /// the highest present hash boundary inside the first missing block.
    fn full_raw(&self, max: u64, fine: bool) -> u64 {
        let b = self.block;
        let m = self.leading(max / b);
        if fine {
            for j in (1..self.k).rev() {
                let pos = m * b + j * self.h;
                if pos <= max && self.has_idx(m * self.k + j - 1) {
                    return pos;
                }
            }
        }
        m * b
    }

    /// Full attention with the EAGLE drop: one unit (`min(A, B)`) off the raw hit, re-aligned.
    fn full_eagle(&self, max: u64, fine: bool, drop: bool) -> u64 {
        let mut hit = self.full_raw(max, fine);
        if drop && hit > 0 {
            hit -= self.align.min(self.block);
        }
        self.floor_a(hit)
    }

    /// Sliding window with the EAGLE drop: `c + 1` contiguous blocks, alignment checked after
    /// the pop, then the last block popped and the result re-aligned (vLLM 0.32's scan).
    fn window_eagle(&self, max: u64, window: Option<u32>, drop: bool) -> u64 {
        let (b, a) = (self.block, self.align);
        let w = window.unwrap_or(2).max(2) as u64;
        let c = (w - 1).div_ceil(b).max(1) + u64::from(drop);
        let mut run = 0u64;
        let mut matched = None;
        for i in (0..max / b).rev() {
            if self.has_block(i) {
                let post = if drop { i } else { i + 1 };
                if run == 0 && b != a && !(post * b).is_multiple_of(a) {
                    continue;
                }
                run += 1;
                if run >= c {
                    matched = Some(i + run);
                    break;
                }
            } else {
                run = 0;
            }
        }
        let realign = |mut len: u64| {
            while b != a && len > 0 && !(len * b).is_multiple_of(a) {
                len -= 1;
            }
            len
        };
        let mut len = matched.unwrap_or_else(|| realign(run));
        if drop && len > 0 {
            len = realign(len - 1);
        }
        len * b
    }

    fn window(&self, max: u64, window: Option<u32>) -> u64 {
        let b = self.block;
        let w = window.unwrap_or(2).max(2) as u64;
        let c = (w - 1).div_ceil(b).max(1);
        let mut l = self.floor_a(max);
        while l > 0 {
            let top = l / b;
            let need = c.min(top);
            match (top - need..top).rev().find(|i| !self.has_block(*i)) {
                None => return l,
                Some(q) => l = self.floor_a(q * b),
            }
        }
        0
    }

    fn chunked(&self, max: u64, chunk: Option<u32>) -> u64 {
        let b = self.block;
        let start = match chunk {
            Some(c) if c > 0 => max / c as u64 * c as u64,
            _ => 0,
        };
        let mut i = start / b;
        while (i + 1) * b <= max && self.has_block(i) {
            i += 1;
        }
        self.floor_a(i * b)
    }

    fn mamba(&self, max: u64) -> u64 {
        let mut l = self.floor_a(max);
        if let Some(hit) = self.mamba_by_states(l) {
            return hit;
        }
        while l > 0 {
            if self.has_idx(l / self.h - 1) {
                return l;
            }
            l -= self.align;
        }
        0
    }

    /// The Mamba rule for a group holding few states: the same downward scan over aligned
    /// lengths, comparing each position's hash with the held states directly instead of
    /// probing the holder's table. `None` when the shape does not allow it (then `mamba`
    /// probes).
    fn mamba_by_states(&self, l: u64) -> Option<u64> {
        const FEW: usize = 8;
        if !self.align.is_multiple_of(self.h) {
            return None;
        }
        let mut held = [0u64; FEW];
        let mut n = 0;
        match self.holders {
            [HolderRef::Own(m)] if m.distinct() <= FEW => {
                for (at, state) in held.iter_mut().zip(m.keys()) {
                    *at = state;
                    n += 1;
                }
            }
            // Listing a slot walks its whole table: only for small tables.
            [HolderRef::Spec { set, slot }]
                if set.len() <= 4 * FEW && set.distinct(*slot) <= FEW as u64 =>
            {
                for (at, state) in held.iter_mut().zip(set.keys(*slot)) {
                    *at = state;
                    n += 1;
                }
            }
            _ => return None,
        }
        let held = &held[..n];
        let mut len = l;
        while len > 0 {
            let idx = (len / self.h - 1) as usize;
            if self.hashes.get(idx).is_some_and(|x| held.contains(x)) {
                return Some(len);
            }
            len -= self.align;
        }
        Some(0)
    }

    fn largest(&self, spec: &GroupSpec, max: u64, fine: bool, chunk: Option<u32>) -> u64 {
        match spec.rule() {
            Rule::FullAttention => self.full(max, fine),
            Rule::SlidingWindow => self.window(max, spec.window),
            Rule::ChunkedLocal => self.chunked(max, chunk),
            Rule::Mamba => self.mamba(max),
            Rule::NotCacheable => max,
        }
    }
}

/// The one table and the bits of `holders` when there are several and all are slots of it.
fn combined<'a>(holders: &[HolderRef<'a>]) -> Option<(&'a SpecSet, u8)> {
    if holders.len() < 2 {
        return None;
    }
    let mut table: Option<&'a SpecSet> = None;
    let mut mask = 0u8;
    for hd in holders {
        let HolderRef::Spec { set, slot } = *hd else {
            return None;
        };
        match table {
            Some(t) if !std::ptr::eq(t, set) => return None,
            _ => table = Some(set),
        }
        mask |= 1 << slot;
    }
    table.map(|t| (t, mask))
}

fn make_view<'a>(
    spec: &GroupSpec,
    holders: &'a [HolderRef<'a>],
    hashes: &'a [u64],
    p: &Params,
) -> Option<View<'a>> {
    let h = p.hash_block.max(1) as u64;
    let b = spec.block_size as u64;
    if b == 0 || !b.is_multiple_of(h) {
        return None;
    }
    Some(View {
        hashes,
        holders,
        combined: combined(holders),
        single: match holders {
            [HolderRef::Own(m)] => Some(*m),
            _ => None,
        },
        block: b,
        k: b / h,
        h,
        align: p.align.max(1) as u64,
    })
}

/// vLLM's coordinator with EAGLE/MTP on (every group an EAGLE group, or with
/// `Params::eagle_full_only` the full-attention ones), over the lookups in `order`: each EAGLE
/// lookup not yet verified at the current length looks one unit past it and
/// drops back (Mamba never drops, chunked local does not support the drop), a shrink by an
/// unverified-free lookup invalidates the verifications, full attention is computed once and
/// then trimmed, and a two-lookup hybrid led by full attention takes one pass.
fn eagle_coordinate(
    lookups: &[Lookup<'_>],
    views: &[Option<View<'_>>],
    order: &[usize],
    n: usize,
    hashes_len: usize,
    p: &Params,
    chunk: Option<u32>,
) -> u64 {
    let max_len = (n as u64).saturating_sub(1);
    let h = p.hash_block.max(1) as u64;
    let fine = p.fine_grained;
    let find = |v: &View<'_>, spec: &GroupSpec, max: u64, drop: bool| match spec.rule() {
        Rule::FullAttention => v.full_eagle(max, fine, drop),
        Rule::SlidingWindow => v.window_eagle(max, spec.window, drop),
        Rule::ChunkedLocal => v.chunked(max, chunk),
        Rule::Mamba => v.mamba(max),
        Rule::NotCacheable => max,
    };
    // Whether a lookup of this rule is an EAGLE lookup (`Params::eagle_full_only`).
    let eagle_rule = |rule: Rule| !p.eagle_full_only || rule == Rule::FullAttention;
    if p.unitary {
        return match order
            .first()
            .and_then(|i| views[*i].as_ref().map(|v| (v, lookups[*i].spec)))
        {
            Some((v, spec)) => find(v, spec, max_len, eagle_rule(spec.rule())),
            None => 0,
        };
    }
    let mut verified = vec![false; lookups.len()];
    let mut full_hit: Vec<Option<u64>> = vec![None; lookups.len()];
    let simple = order.len() == 2 && lookups[order[0]].spec.rule() == Rule::FullAttention;
    let mut hit_length = max_len;
    loop {
        let mut curr = hit_length;
        for &i in order {
            let Some(v) = views[i].as_ref() else {
                return 0;
            };
            let spec = lookups[i].spec;
            let rule = spec.rule();
            if let (Rule::FullAttention, Some(f)) = (rule, full_hit[i]) {
                curr = curr.min(f);
                continue;
            }
            let drop = eagle_rule(rule) && !verified[i];
            let mut max = curr;
            if drop && rule != Rule::Mamba && rule != Rule::ChunkedLocal {
                let b = spec.block_size as u64;
                let margin = if fine && rule == Rule::FullAttention && b > h {
                    h
                } else {
                    b
                };
                max = (curr + margin).min(hashes_len as u64 * h);
            }
            let new = find(v, spec, max, drop && rule != Rule::ChunkedLocal);
            if drop {
                verified[i] = true;
            } else if new < curr {
                verified.iter_mut().for_each(|x| *x = false);
            }
            curr = new;
            if rule == Rule::FullAttention {
                full_hit[i] = Some(new);
            }
        }
        if curr >= hit_length {
            return hit_length;
        }
        hit_length = curr;
        if simple {
            return hit_length;
        }
    }
}

/// The start of the fixed point: `n − max(1, L)` aligned down to `A` (0 for a request that
/// short), `L` the params' lookahead count: vLLM bounds a hit by `n − 1`, and with lookahead
/// hashes no block past `n − L` has a hash.
pub fn start_length(n: usize, p: &Params) -> u64 {
    let a = p.align.max(1) as u64;
    let reserve = u64::from(p.lookahead.max(1));
    (n as u64).saturating_sub(reserve) / a * a
}

/// Per-lookup scratch of one prediction: the views, and each full-attention lookup's walk
/// from the `max` it was computed for (the group-blind and the joint passes both start a
/// full-attention lookup from `l0`, so it is walked once).
struct Scratch<'a, 'v> {
    lookups: &'v [Lookup<'a>],
    views: &'v [Option<View<'a>>],
    memo: &'v mut [Option<(u64, u64)>],
    p: &'v Params,
    chunk: Option<u32>,
}

impl Scratch<'_, '_> {
    fn full(&mut self, i: usize, v: &View<'_>, max: u64) -> u64 {
        match self.memo[i] {
            Some((m, hit)) if m == max => hit,
            _ => {
                let hit = v.full(max, self.p.fine_grained);
                self.memo[i] = Some((max, hit));
                hit
            }
        }
    }

    /// The coordinator's passes from `l0` over the lookups (full-attention ones only when
    /// `full_only`), in order. `firsts` holds each full-attention lookup's first result.
    fn fixed_point(&mut self, full_only: bool, l0: u64, firsts: &mut [Option<u64>]) -> u64 {
        let mut l = l0;
        loop {
            let before = l;
            let (lookups, views) = (self.lookups, self.views);
            for (i, ((lk, view), first)) in
                lookups.iter().zip(views).zip(firsts.iter_mut()).enumerate()
            {
                let spec = lk.spec;
                let full = spec.rule() == Rule::FullAttention;
                if full_only && !full {
                    continue;
                }
                let Some(v) = *view else {
                    return 0;
                };
                l = if full {
                    let f = match *first {
                        Some(f) => f,
                        None => *first.insert(self.full(i, &v, l)),
                    };
                    f.min(l)
                } else {
                    v.largest(spec, l, self.p.fine_grained, self.chunk)
                };
            }
            if l == before || l == 0 {
                return l;
            }
        }
    }

    /// (cached, group_blind) from `l0`.
    fn solve(&mut self, hashes: &[u64], l0: u64, firsts: &mut [Option<u64>]) -> (u64, u64) {
        let any_full = self
            .lookups
            .iter()
            .any(|lk| lk.spec.rule() == Rule::FullAttention);
        let group_blind = if any_full {
            let blind = self.fixed_point(true, l0, firsts);
            firsts.iter_mut().for_each(|f| *f = None);
            blind
        } else {
            self.lookups
                .first()
                .and_then(|lk| {
                    lk.holders
                        .first()
                        .and_then(|hd| make_view(lk.spec, std::slice::from_ref(hd), hashes, self.p))
                })
                .map_or(0, |v| v.full(l0, self.p.fine_grained))
        };
        let cached = self.fixed_point(false, l0, firsts);
        (cached, group_blind)
    }

    /// Each group alone, from `l0`, sorted by group.
    fn evidence(&mut self, hashes: &[u64], l0: u64) -> Vec<GroupEvidence> {
        let mut groups = Vec::new();
        for (i, lk) in self.lookups.iter().enumerate() {
            for (gid, holder) in lk.groups.iter().zip(lk.holders.iter()) {
                let alone = match self.views[i] {
                    // A full-attention group that is its lookup's only group: the lookup's walk.
                    Some(v) if lk.spec.rule() == Rule::FullAttention && lk.holders.len() == 1 => {
                        self.full(i, &v, l0)
                    }
                    _ => {
                        let single = [*holder];
                        make_view(lk.spec, &single, hashes, self.p).map_or(0, |v| {
                            v.largest(lk.spec, l0, self.p.fine_grained, self.chunk)
                        })
                    }
                };
                groups.push(GroupEvidence {
                    group: *gid,
                    kind: lk.spec.kind.to_string(),
                    window: lk.spec.window,
                    block_size: lk.spec.block_size,
                    alone,
                });
            }
        }
        groups.sort_by_key(|g| g.group);
        groups
    }
}

/// The joint prediction over `lookups` for a request of `n` tokens whose chain at `H` is
/// `hashes`; with `evidence`, also each group alone (otherwise `groups` is empty). Allocates
/// nothing without evidence when there are at most `STACK_LOOKUPS` lookups.
pub fn joint(
    lookups: &[Lookup<'_>],
    hashes: &[u64],
    n: usize,
    p: &Params,
    chunk: Option<u32>,
    evidence: bool,
) -> Joint {
    let l0 = start_length(n, p);
    if p.eagle {
        let views: Vec<Option<View<'_>>> = lookups
            .iter()
            .map(|lk| make_view(lk.spec, lk.holders, hashes, p))
            .collect();
        let all: Vec<usize> = (0..lookups.len()).collect();
        let full: Vec<usize> = all
            .iter()
            .copied()
            .filter(|i| lookups[*i].spec.rule() == Rule::FullAttention)
            .collect();
        let cached = eagle_coordinate(lookups, &views, &all, n, hashes.len(), p, chunk);
        let group_blind = if full.is_empty() {
            0
        } else {
            eagle_coordinate(lookups, &views, &full, n, hashes.len(), p, chunk)
        };
        let mut memo = vec![None; lookups.len()];
        let groups = if evidence {
            Scratch {
                lookups,
                views: &views,
                memo: &mut memo,
                p,
                chunk,
            }
            .evidence(hashes, l0)
        } else {
            Vec::new()
        };
        return Joint {
            cached,
            group_blind,
            groups,
        };
    }
    if let ([lk], false) = (lookups, evidence) {
        if lk.spec.rule() == Rule::FullAttention {
            // One full-attention lookup: its walk from `l0` is both answers.
            let hit =
                make_view(lk.spec, lk.holders, hashes, p).map_or(0, |v| v.full(l0, p.fine_grained));
            return Joint {
                cached: hit,
                group_blind: hit,
                groups: Vec::new(),
            };
        }
    }
    // A full-attention lookup serving nothing from `l0` makes both answers 0 (a pass only
    // lowers the length, and a full-attention walk never grows as its bound shrinks): the
    // ranks holding nothing of the request, most of a fleet, stop here without other views.
    let mut first_full = None;
    if !evidence {
        if let Some(i) = lookups
            .iter()
            .position(|lk| lk.spec.rule() == Rule::FullAttention)
        {
            let lk = &lookups[i];
            let hit =
                make_view(lk.spec, lk.holders, hashes, p).map_or(0, |v| v.full(l0, p.fine_grained));
            if hit == 0 {
                return Joint {
                    cached: 0,
                    group_blind: 0,
                    groups: Vec::new(),
                };
            }
            first_full = Some((i, hit));
        }
    }
    let count = lookups.len();
    let mut views_stack: [Option<View<'_>>; STACK_LOOKUPS] = [None; STACK_LOOKUPS];
    let mut memo_stack = [None; STACK_LOOKUPS];
    let mut firsts_stack = [None; STACK_LOOKUPS];
    let (mut views_heap, mut memo_heap, mut firsts_heap) = (Vec::new(), Vec::new(), Vec::new());
    let (views, memo, firsts) = if count <= STACK_LOOKUPS {
        (
            &mut views_stack[..count],
            &mut memo_stack[..count],
            &mut firsts_stack[..count],
        )
    } else {
        views_heap.resize(count, None);
        memo_heap.resize(count, None);
        firsts_heap.resize(count, None);
        (
            &mut views_heap[..],
            &mut memo_heap[..],
            &mut firsts_heap[..],
        )
    };
    for (v, lk) in views.iter_mut().zip(lookups) {
        *v = make_view(lk.spec, lk.holders, hashes, p);
    }
    if let Some((i, hit)) = first_full {
        memo[i] = Some((l0, hit));
    }
    let mut s = Scratch {
        lookups,
        views,
        memo,
        p,
        chunk,
    };
    let groups = if evidence {
        s.evidence(hashes, l0)
    } else {
        Vec::new()
    };
    let (cached, group_blind) = s.solve(hashes, l0, firsts);
    Joint {
        cached,
        group_blind,
        groups,
    }
}
