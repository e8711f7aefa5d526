//! vLLM's per-kind reuse rules and their joint fixed point, over the fast holders.
//!
//! Owns: for one (worker, rank), given the request's hash chain at the hash block size `H`,
//! each lookup's "largest servable length ≤ max" and the coordinator's fixed point: starting at
//! `L = n − 1` (aligned down to `A`), each lookup in order lowers `L`; full attention is computed
//! once and afterwards only trimmed; passes repeat until `L` stops changing.
//! Invariants: every returned length is a multiple of `A` and ≤ the `max` it was given; a block
//! is present only when every group of its lookup holds it.
//! Must not: mutate holders or hash anything (the chain is computed once per request).

use crate::event::Rule;
use crate::holder::Multiset;
use crate::layout::{GroupSpec, Params};
use serde::Serialize;

/// One coordinator lookup: groups with an identical spec, looked up together.
pub struct Lookup<'a> {
    pub spec: &'a GroupSpec,
    pub groups: Vec<u32>,
    pub holders: Vec<&'a Multiset>,
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
    pub groups: Vec<GroupEvidence>,
}

struct View<'a> {
    hashes: &'a [u64],
    holders: &'a [&'a Multiset],
    block: u64,
    k: u64,
    h: u64,
    align: u64,
}

impl View<'_> {
    #[inline]
    fn has_idx(&self, idx: u64) -> bool {
        match self.hashes.get(idx as usize) {
            Some(hash) => self.holders.iter().all(|m| m.contains(*hash)),
            None => false,
        }
    }
    #[inline]
    fn has_block(&self, i: u64) -> bool {
        self.has_idx((i + 1) * self.k - 1)
    }
    fn floor_a(&self, x: u64) -> u64 {
        x / self.align * self.align
    }

    fn full(&self, max: u64, fine: bool) -> u64 {
        let b = self.block;
        let mut m = 0;
        while (m + 1) * b <= max && self.has_block(m) {
            m += 1;
        }
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
        while l > 0 {
            if self.has_idx(l / self.h - 1) {
                return l;
            }
            l -= self.align;
        }
        0
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

fn make_view<'a>(
    spec: &GroupSpec,
    holders: &'a [&'a Multiset],
    hashes: &'a [u64],
    p: &Params,
) -> Option<View<'a>> {
    let h = p.hash_block.max(1) as u64;
    let b = spec.block_size as u64;
    if b == 0 || b % h != 0 {
        return None;
    }
    Some(View {
        hashes,
        holders,
        block: b,
        k: b / h,
        h,
        align: p.align.max(1) as u64,
    })
}

/// Full-attention hits of one request per lookup, by the `max` they were computed from: the
/// evidence, the group-blind and the joint passes all start a full-attention lookup's walk
/// from `l0`, so it is walked once.
struct FullMemo(Vec<Option<(u64, u64)>>);

impl FullMemo {
    fn get(&mut self, i: usize, v: &View<'_>, max: u64, fine: bool) -> u64 {
        match self.0[i] {
            Some((m, hit)) if m == max => hit,
            _ => {
                let hit = v.full(max, fine);
                self.0[i] = Some((max, hit));
                hit
            }
        }
    }
}

/// The coordinator's passes over the lookups `order` (indices into `lookups`), from `l0`.
fn fixed_point(
    lookups: &[Lookup<'_>],
    views: &[Option<View<'_>>],
    order: &[usize],
    l0: u64,
    p: &Params,
    chunk: Option<u32>,
    memo: &mut FullMemo,
) -> u64 {
    let mut full_hits: Vec<Option<u64>> = vec![None; lookups.len()];
    let mut l = l0;
    loop {
        let before = l;
        for &i in order {
            let Some(v) = views[i].as_ref() else {
                return 0;
            };
            let spec = lookups[i].spec;
            l = if spec.rule() == Rule::FullAttention {
                let f = match full_hits[i] {
                    Some(f) => f,
                    None => *full_hits[i].insert(memo.get(i, v, l, p.fine_grained)),
                };
                f.min(l)
            } else {
                v.largest(spec, l, p.fine_grained, chunk)
            };
        }
        if l == before || l == 0 {
            return l;
        }
    }
}

/// The start of the fixed point: `n − 1` aligned down to `A` (0 for an empty request).
pub fn start_length(n: usize, align: u32) -> u64 {
    let a = align.max(1) as u64;
    (n as u64).saturating_sub(1) / a * a
}

/// The joint prediction over `lookups` for a request of `n` tokens whose chain at `H` is
/// `hashes`.
pub fn joint(
    lookups: &[Lookup<'_>],
    hashes: &[u64],
    n: usize,
    p: &Params,
    chunk: Option<u32>,
) -> Joint {
    let l0 = start_length(n, p.align);
    let views: Vec<Option<View<'_>>> = lookups
        .iter()
        .map(|lk| make_view(lk.spec, &lk.holders, hashes, p))
        .collect();

    let mut memo = FullMemo(vec![None; lookups.len()]);

    // Evidence: each group alone, from the same start.
    let mut groups = Vec::new();
    for (i, lk) in lookups.iter().enumerate() {
        for (gid, holder) in lk.groups.iter().zip(lk.holders.iter()) {
            let alone = match views[i].as_ref() {
                // A full-attention group that is its lookup's only group: the lookup's own walk.
                Some(v) if lk.spec.rule() == Rule::FullAttention && lk.holders.len() == 1 => {
                    memo.get(i, v, l0, p.fine_grained)
                }
                _ => {
                    let single = [*holder];
                    make_view(lk.spec, &single, hashes, p)
                        .map_or(0, |v| v.largest(lk.spec, l0, p.fine_grained, chunk))
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
    let full_only: Vec<usize> = (0..lookups.len())
        .filter(|i| lookups[*i].spec.rule() == Rule::FullAttention)
        .collect();
    let group_blind = if full_only.is_empty() {
        lookups
            .first()
            .and_then(|lk| {
                lk.holders
                    .first()
                    .and_then(|hd| make_view(lk.spec, std::slice::from_ref(hd), hashes, p))
            })
            .map_or(0, |v| v.full(l0, p.fine_grained))
    } else {
        fixed_point(lookups, &views, &full_only, l0, p, chunk, &mut memo)
    };
    let all: Vec<usize> = (0..lookups.len()).collect();
    let l = fixed_point(lookups, &views, &all, l0, p, chunk, &mut memo);
    Joint {
        cached: l,
        group_blind,
        groups,
    }
}
