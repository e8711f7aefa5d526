//! The shared run store: the device blocks of every full-attention group in the index, each
//! distinct hash kept once, in runs of consecutive blocks that share one holder multiset.
//!
//! Owns: hash → (run, offset); runs (their hashes in chain order and their holders: holder id →
//! copies); per-holder totals; holder ids (given out by `add_holder`, returned by
//! `release_holder`). A request's chain is walked once for every holder at the same time:
//! inside a run the walk only compares consecutive hashes, and the holder set changes only at
//! run boundaries.
//! Invariants: every stored hash lives in exactly one run at one offset; every block of a run is
//! held by exactly the run's holders, with the run's copy counts (≥ 1); a run with no holder is
//! deleted with its hashes; a holder's totals equal the sum over the runs that list it. Nothing
//! here assumes that events chain correctly: a run is an ordering for speed, membership is the
//! truth.
//! Must not: know ranks, groups or kinds (holder ids are the caller's), lock, or hash tokens.

use crate::holder::MixBuild;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    run: u32,
    off: u32,
}

#[derive(Default, Debug)]
struct Run {
    /// Hashes in chain order; valid from `lo` (a cut-off front is dropped lazily).
    hashes: Vec<u64>,
    lo: u32,
    /// (holder id, copies ≥ 1), sorted by id; empty only for a free run.
    holders: Vec<(u32, u32)>,
}

impl Run {
    fn end(&self) -> u32 {
        self.hashes.len() as u32
    }
    fn len(&self) -> u32 {
        self.end() - self.lo
    }
    fn copies(&self, id: u32) -> u32 {
        self.holders
            .binary_search_by_key(&id, |(h, _)| *h)
            .map_or(0, |i| self.holders[i].1)
    }
}

#[derive(Default, Clone, Copy, Debug)]
struct Totals {
    live: bool,
    total: u64,
}

/// The shared store (see the module doc).
#[derive(Default, Debug)]
pub struct Runs {
    map: HashMap<u64, Loc, MixBuild>,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    holders: Vec<Totals>,
    free_holders: Vec<u32>,
}

impl Runs {
    pub fn new() -> Runs {
        Runs::default()
    }

    /// A new, empty holder.
    pub fn add_holder(&mut self) -> u32 {
        let t = Totals {
            live: true,
            ..Totals::default()
        };
        match self.free_holders.pop() {
            Some(id) => {
                self.holders[id as usize] = t;
                id
            }
            None => {
                self.holders.push(t);
                (self.holders.len() - 1) as u32
            }
        }
    }

    /// Empties a holder and gives its id back.
    pub fn release_holder(&mut self, id: u32) {
        if !self.is_live(id) {
            return;
        }
        self.clear_holder(id);
        self.holders[id as usize] = Totals::default();
        self.free_holders.push(id);
    }

    fn is_live(&self, id: u32) -> bool {
        self.holders.get(id as usize).is_some_and(|t| t.live)
    }

    /// One past the largest holder id given out (the size of a walk's result).
    pub fn holder_slots(&self) -> usize {
        self.holders.len()
    }

    /// Distinct hashes stored (over every holder).
    pub fn distinct_blocks(&self) -> usize {
        self.map.len()
    }

    /// Copies `id` holds of `h`.
    #[inline]
    pub fn count(&self, id: u32, h: u64) -> u32 {
        self.map
            .get(&h)
            .map_or(0, |loc| self.runs[loc.run as usize].copies(id))
    }

    #[inline]
    pub fn contains(&self, id: u32, h: u64) -> bool {
        self.count(id, h) > 0
    }

    /// Copies `id` holds, duplicates included.
    pub fn total(&self, id: u32) -> u64 {
        self.holders.get(id as usize).map_or(0, |t| t.total)
    }

    /// Every hash `id` holds with its copies (a scan of every run: for tests and dumps).
    pub fn holder_contents(&self, id: u32) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        for run in &self.runs {
            let c = run.copies(id);
            if c > 0 {
                out.extend(run.hashes[run.lo as usize..].iter().map(|h| (*h, c)));
            }
        }
        out
    }

    /// The runs `id` holds, each as (copies, hashes in chain order): a holder's contents in the
    /// order a walk reads them (what a snapshot writes).
    pub fn holder_runs(&self, id: u32) -> Vec<(u32, Vec<u64>)> {
        self.runs
            .iter()
            .filter_map(|run| {
                let c = run.copies(id);
                (c > 0 && run.len() > 0).then(|| (c, run.hashes[run.lo as usize..].to_vec()))
            })
            .collect()
    }

    /// Approximate heap bytes: table slots (key, location, control byte), run hashes and
    /// holder lists.
    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * (8 + 8 + 1)
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self
                .runs
                .iter()
                .map(|r| r.hashes.capacity() * 8 + r.holders.capacity() * 8)
                .sum::<usize>()
            + self.holders.capacity() * std::mem::size_of::<Totals>()
    }

    /// Stores one copy of each hash for `id`, in order; `parent` is the hash before the first
    /// (a run that ends there and is `id`'s alone is extended instead of starting a new one).
    pub fn insert(&mut self, id: u32, parent: Option<u64>, hashes: &[u64]) {
        self.insert_by(id, parent, hashes, |h| *h)
    }

    /// `insert` of `key(item)` for each item (an event's hashes as they come, not copied).
    pub fn insert_by<T>(
        &mut self,
        id: u32,
        parent: Option<u64>,
        hashes: &[T],
        key: impl Fn(&T) -> u64 + Copy,
    ) {
        if !self.is_live(id) {
            return;
        }
        self.map.reserve(hashes.len());
        let mut prev = parent;
        let mut i = 0;
        while i < hashes.len() {
            let h = key(&hashes[i]);
            match self.map.get(&h).copied() {
                Some(loc) => {
                    let run = &self.runs[loc.run as usize];
                    let (off, end) = (loc.off as usize, run.end() as usize);
                    let m = 1 + hashes[i + 1..]
                        .iter()
                        .map(key)
                        .zip(&run.hashes[(off + 1).min(end)..end])
                        .take_while(|(a, b)| a == *b)
                        .count();
                    let r = self.isolate(h, m as u32);
                    self.add_copy(r, id);
                    self.try_merge(prev, r);
                    prev = Some(key(&hashes[i + m - 1]));
                    i += m;
                }
                None => {
                    let r = match prev.and_then(|p| self.appendable(p, id)) {
                        Some(r) => r,
                        None => self.new_run(vec![(id, 1)]),
                    };
                    let t = &mut self.holders[id as usize];
                    let run = &mut self.runs[r as usize];
                    while i < hashes.len() {
                        let h = key(&hashes[i]);
                        match self.map.entry(h) {
                            Entry::Occupied(_) => break,
                            Entry::Vacant(v) => {
                                v.insert(Loc {
                                    run: r,
                                    off: run.hashes.len() as u32,
                                });
                            }
                        }
                        run.hashes.push(h);
                        t.total += 1;
                        prev = Some(h);
                        i += 1;
                    }
                }
            }
        }
    }

    /// Removes one copy of each hash from `id`; returns (removed, not held).
    pub fn remove(&mut self, id: u32, hashes: &[u64]) -> (u64, u64) {
        self.remove_by(id, hashes, |h| *h)
    }

    /// `remove` of `key(item)` for each item.
    pub fn remove_by<T>(
        &mut self,
        id: u32,
        hashes: &[T],
        key: impl Fn(&T) -> u64 + Copy,
    ) -> (u64, u64) {
        let (mut removed, mut unknown) = (0u64, 0u64);
        let mut i = 0;
        while i < hashes.len() {
            let h = key(&hashes[i]);
            let Some(loc) = self.map.get(&h).copied() else {
                unknown += 1;
                i += 1;
                continue;
            };
            let run = &self.runs[loc.run as usize];
            if run.copies(id) == 0 {
                unknown += 1;
                i += 1;
                continue;
            }
            // The longest stretch of the next hashes that sit next to each other in this run,
            // in either direction (engines evict a request's blocks tail first).
            let (off, lo, end) = (loc.off as usize, run.lo as usize, run.end() as usize);
            let rest = &hashes[i + 1..];
            let up = rest
                .iter()
                .map(key)
                .zip(&run.hashes[(off + 1).min(end)..end])
                .take_while(|(a, b)| a == *b)
                .count();
            let down = rest
                .iter()
                .map(key)
                .zip(run.hashes[lo..off].iter().rev())
                .take_while(|(a, b)| a == *b)
                .count();
            let (start, m) = if down > up {
                (off - down, down + 1)
            } else {
                (off, up + 1)
            };
            if run.holders == [(id, 1)] && (start == lo || start + m == end) {
                // The last copy of an end of the run: cut it off in place.
                self.cut(loc.run, start, m);
            } else {
                let first = run.hashes[start];
                let r = self.isolate(first, m as u32);
                self.drop_copy(r, id);
            }
            removed += m as u64;
            i += m;
        }
        (removed, unknown)
    }

    /// Drops every copy `id` holds (the id stays given out).
    pub fn clear_holder(&mut self, id: u32) {
        if !self.is_live(id) {
            return;
        }
        for r in 0..self.runs.len() as u32 {
            let run = &mut self.runs[r as usize];
            if let Ok(at) = run.holders.binary_search_by_key(&id, |(h, _)| *h) {
                run.holders.remove(at);
                if run.holders.is_empty() {
                    self.delete_run(r);
                }
            }
        }
        self.holders[id as usize].total = 0;
    }

    /// For every holder that holds `chain[0]`, the number of leading hashes of `chain` it holds:
    /// appended to `out` as (holder id, hashes), ids ascending. Holders of none of it are not
    /// listed.
    pub fn walk(&self, chain: &[u64], out: &mut Vec<(u32, u32)>) {
        let Some(first) = chain.first() else { return };
        let Some(mut loc) = self.map.get(first).copied() else {
            return;
        };
        const ACTIVE: u32 = u32::MAX;
        let from = out.len();
        out.extend(
            self.runs[loc.run as usize]
                .holders
                .iter()
                .map(|(id, _)| (*id, ACTIVE)),
        );
        let mut active = out.len() - from;
        let mut i = 0usize;
        loop {
            let run = &self.runs[loc.run as usize];
            let held = &run.hashes[loc.off as usize..];
            // ≥ 1: the run holds chain[i] at `loc`.
            i += common_prefix(held, &chain[i..]);
            let Some(next) = chain.get(i).and_then(|h| self.map.get(h)) else {
                break;
            };
            let holders = &self.runs[next.run as usize].holders;
            for (id, blocks) in out[from..].iter_mut() {
                if *blocks == ACTIVE && holders.binary_search_by_key(id, |(h, _)| *h).is_err() {
                    *blocks = i as u32;
                    active -= 1;
                }
            }
            if active == 0 {
                return;
            }
            loc = *next;
        }
        for (_, blocks) in out[from..].iter_mut() {
            if *blocks == ACTIVE {
                *blocks = i as u32;
            }
        }
    }

    // ---- run maintenance -------------------------------------------------------------

    fn new_run(&mut self, holders: Vec<(u32, u32)>) -> u32 {
        match self.free_runs.pop() {
            Some(r) => {
                self.runs[r as usize].holders = holders;
                r
            }
            None => {
                self.runs.push(Run {
                    holders,
                    ..Run::default()
                });
                (self.runs.len() - 1) as u32
            }
        }
    }

    /// Deletes a run and its hashes.
    fn delete_run(&mut self, r: u32) {
        let run = std::mem::take(&mut self.runs[r as usize]);
        for h in &run.hashes[run.lo as usize..] {
            self.map.remove(h);
        }
        self.free_runs.push(r);
    }

    /// Points `hashes[from..]` of run `r` at their offsets.
    fn relocate(&mut self, r: u32, from: usize) {
        let run = &self.runs[r as usize];
        for (off, h) in run.hashes.iter().enumerate().skip(from) {
            if let Some(loc) = self.map.get_mut(h) {
                *loc = Loc {
                    run: r,
                    off: off as u32,
                };
            }
        }
    }

    /// Splits run `r` before absolute offset `at` (`lo < at < end`), moving the shorter side
    /// to a new run; both keep the holders.
    fn split(&mut self, r: u32, at: u32) {
        let run = &self.runs[r as usize];
        let (lo, end) = (run.lo, run.end());
        debug_assert!(lo < at && at < end);
        let holders = run.holders.clone();
        if at - lo <= end - at {
            let moved = run.hashes[lo as usize..at as usize].to_vec();
            let nr = self.new_run(holders);
            self.runs[nr as usize].hashes = moved;
            self.relocate(nr, 0);
            let run = &mut self.runs[r as usize];
            run.lo = at;
            // Drop a cut-off front once it is most of the vector (amortized O(1) per block).
            if run.lo as usize * 2 > run.hashes.len() {
                run.hashes.drain(..run.lo as usize);
                run.lo = 0;
                self.relocate(r, 0);
            }
        } else {
            let moved = run.hashes[at as usize..].to_vec();
            self.runs[r as usize].hashes.truncate(at as usize);
            let nr = self.new_run(holders);
            self.runs[nr as usize].hashes = moved;
            self.relocate(nr, 0);
        }
    }

    /// Deletes the `m` blocks from absolute offset `start` of run `r`, an end of it, whose
    /// only holder holds them once.
    fn cut(&mut self, r: u32, start: usize, m: usize) {
        let run = &mut self.runs[r as usize];
        let (lo, end) = (run.lo as usize, run.hashes.len());
        if let [(id, _)] = run.holders[..] {
            self.holders[id as usize].total -= m as u64;
        }
        if start == lo && start + m == end {
            self.delete_run(r);
            return;
        }
        for h in &run.hashes[start..start + m] {
            self.map.remove(h);
        }
        if start + m == end {
            run.hashes.truncate(start);
        } else {
            run.lo = (start + m) as u32;
            if run.lo as usize * 2 > run.hashes.len() {
                run.hashes.drain(..run.lo as usize);
                run.lo = 0;
                self.relocate(r, 0);
            }
        }
    }

    /// Makes the `m` blocks starting at hash `first` a run of their own; returns it.
    fn isolate(&mut self, first: u64, m: u32) -> u32 {
        let loc = self.map[&first];
        if loc.off > self.runs[loc.run as usize].lo {
            self.split(loc.run, loc.off);
        }
        let loc = self.map[&first];
        if loc.off + m < self.runs[loc.run as usize].end() {
            self.split(loc.run, loc.off + m);
        }
        self.map[&first].run
    }

    /// One more copy of every block of run `r` for `id`.
    fn add_copy(&mut self, r: u32, id: u32) {
        let run = &mut self.runs[r as usize];
        let m = run.len() as u64;
        let t = &mut self.holders[id as usize];
        match run.holders.binary_search_by_key(&id, |(h, _)| *h) {
            Ok(at) => run.holders[at].1 += 1,
            Err(at) => run.holders.insert(at, (id, 1)),
        }
        t.total += m;
    }

    /// One copy fewer of every block of run `r` for `id` (which holds it).
    fn drop_copy(&mut self, r: u32, id: u32) {
        let run = &mut self.runs[r as usize];
        let m = run.len() as u64;
        let t = &mut self.holders[id as usize];
        if let Ok(at) = run.holders.binary_search_by_key(&id, |(h, _)| *h) {
            t.total -= m;
            run.holders[at].1 -= 1;
            if run.holders[at].1 == 0 {
                run.holders.remove(at);
                if run.holders.is_empty() {
                    self.delete_run(r);
                }
            }
        }
    }

    /// The run ending at `prev` when `id` alone holds it once (new blocks may extend it).
    fn appendable(&self, prev: u64, id: u32) -> Option<u32> {
        let loc = self.map.get(&prev)?;
        let run = &self.runs[loc.run as usize];
        (loc.off + 1 == run.end() && run.holders == [(id, 1)]).then_some(loc.run)
    }

    /// Appends run `r` to the run ending at `prev` when their holders are equal.
    fn try_merge(&mut self, prev: Option<u64>, r: u32) {
        let Some(loc) = prev.and_then(|p| self.map.get(&p).copied()) else {
            return;
        };
        if loc.run == r {
            return;
        }
        let (a, b) = (&self.runs[loc.run as usize], &self.runs[r as usize]);
        if loc.off + 1 != a.end() || a.holders != b.holders {
            return;
        }
        let moved = std::mem::take(&mut self.runs[r as usize]);
        let target = &mut self.runs[loc.run as usize];
        let from = target.hashes.len();
        target
            .hashes
            .extend_from_slice(&moved.hashes[moved.lo as usize..]);
        self.relocate(loc.run, from);
        self.free_runs.push(r);
    }

    /// Checks every invariant (tests).
    #[cfg(test)]
    fn check(&self) {
        let mut totals = vec![0u64; self.holders.len()];
        let mut seen = 0;
        for (r, run) in self.runs.iter().enumerate() {
            if run.holders.is_empty() {
                assert!(
                    run.hashes.len() <= run.lo as usize || self.free_runs.contains(&(r as u32))
                );
                continue;
            }
            assert!(run.len() > 0, "a live run is empty");
            assert!(run.holders.windows(2).all(|w| w[0].0 < w[1].0));
            for (off, h) in run.hashes.iter().enumerate().skip(run.lo as usize) {
                assert_eq!(
                    self.map.get(h),
                    Some(&Loc {
                        run: r as u32,
                        off: off as u32
                    })
                );
                seen += 1;
            }
            for (id, c) in &run.holders {
                assert!(*c >= 1);
                totals[*id as usize] += run.len() as u64 * *c as u64;
            }
        }
        assert_eq!(seen, self.map.len());
        for (id, t) in self.holders.iter().enumerate() {
            assert_eq!(t.total, totals[id], "holder {id}");
        }
    }
}

/// The number of leading positions where `a` and `b` are equal: eight at a time (one OR of
/// XORs, which the compiler turns into vector compares), then one at a time.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    const LANES: usize = 8;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    for (x, y) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        let diff = x.iter().zip(y).fold(0u64, |acc, (p, q)| acc | (p ^ q));
        if diff != 0 {
            break;
        }
        i += LANES;
    }
    i + a[i..]
        .iter()
        .zip(&b[i..])
        .take_while(|(p, q)| p == q)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_common_prefix_is_found_at_every_position() {
        for n in 0..40usize {
            let a: Vec<u64> = (0..n as u64).collect();
            for cut in 0..=n {
                let mut b = a.clone();
                if cut < n {
                    b[cut] ^= 1;
                }
                assert_eq!(common_prefix(&a, &b), cut, "n {n} cut {cut}");
                assert_eq!(common_prefix(&a[..cut], &a), cut);
            }
        }
    }
    use std::collections::BTreeMap;

    #[test]
    fn a_run_shared_by_two_holders_is_walked_once_for_both() {
        let mut s = Runs::new();
        let (a, b) = (s.add_holder(), s.add_holder());
        s.insert(a, None, &[1, 2, 3, 4]);
        s.insert(a, Some(4), &[5, 6]);
        s.insert(b, None, &[1, 2, 3]);
        s.check();
        let mut got = Vec::new();
        s.walk(&[1, 2, 3, 4, 5, 9], &mut got);
        assert_eq!(got, vec![(a, 5), (b, 3)]);
    }

    #[test]
    fn a_tail_first_removal_leaves_the_front_whole() {
        let mut s = Runs::new();
        let a = s.add_holder();
        s.insert(a, None, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(s.remove(a, &[6, 5, 4]), (3, 0));
        assert_eq!(s.remove(a, &[9]), (0, 1));
        s.check();
        assert_eq!(s.runs.iter().filter(|r| !r.holders.is_empty()).count(), 1);
        let mut got = s.holder_contents(a);
        got.sort();
        assert_eq!(got, vec![(1, 1), (2, 1), (3, 1)]);
    }

    #[test]
    fn a_hash_stored_twice_needs_two_removals() {
        let mut s = Runs::new();
        let a = s.add_holder();
        s.insert(a, None, &[7, 7]);
        assert_eq!(s.count(a, 7), 2);
        s.remove(a, &[7]);
        assert!(s.contains(a, 7));
        s.remove(a, &[7]);
        assert!(!s.contains(a, 7));
        assert_eq!(s.distinct_blocks(), 0);
        s.check();
    }

    /// The literal model: (holder, hash) → copies.
    #[derive(Default)]
    struct Model(BTreeMap<(u32, u64), u32>);

    impl Model {
        fn prefix(&self, id: u32, chain: &[u64]) -> u32 {
            chain
                .iter()
                .take_while(|h| self.0.contains_key(&(id, **h)))
                .count() as u32
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u32, Option<u64>, Vec<u64>),
        Remove(u32, Vec<u64>),
        Clear(u32),
        Release(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Hashes from a small space so that holders share and stretches line up.
        let seq = (0u64..24, 1usize..10, any::<bool>()).prop_map(|(start, len, rev)| {
            let mut v: Vec<u64> = (start..start + len as u64).collect();
            if rev {
                v.reverse();
            }
            v
        });
        let scattered = prop::collection::vec(0u64..40, 1..8);
        prop_oneof![
            4 => (0u32..4, prop::option::of(0u64..30), seq.clone()).prop_map(|(id, p, v)| Op::Insert(id, p, v)),
            2 => (0u32..4, prop::option::of(0u64..30), scattered.clone()).prop_map(|(id, p, v)| Op::Insert(id, p, v)),
            3 => (0u32..4, seq).prop_map(|(id, v)| Op::Remove(id, v)),
            1 => (0u32..4, scattered).prop_map(|(id, v)| Op::Remove(id, v)),
            1 => (0u32..4).prop_map(Op::Clear),
            1 => (0u32..4).prop_map(Op::Release),
        ]
    }

    proptest! {
        #[test]
        fn the_run_store_equals_a_literal_multiset_per_holder(ops in prop::collection::vec(op(), 1..60)) {
            let mut s = Runs::new();
            let mut m = Model::default();
            let mut ids: Vec<Option<u32>> = vec![None; 4];
            for op in ops {
                match op {
                    Op::Insert(w, parent, hashes) => {
                        let id = *ids[w as usize].get_or_insert_with(|| s.add_holder());
                        s.insert(id, parent, &hashes);
                        for h in hashes {
                            *m.0.entry((id, h)).or_insert(0) += 1;
                        }
                    }
                    Op::Remove(w, hashes) => {
                        let Some(id) = ids[w as usize] else { continue };
                        let (mut removed, mut unknown) = (0, 0);
                        for h in &hashes {
                            match m.0.get_mut(&(id, *h)) {
                                Some(c) => {
                                    removed += 1;
                                    *c -= 1;
                                    if *c == 0 {
                                        m.0.remove(&(id, *h));
                                    }
                                }
                                None => unknown += 1,
                            }
                        }
                        prop_assert_eq!(s.remove(id, &hashes), (removed, unknown));
                    }
                    Op::Clear(w) => {
                        let Some(id) = ids[w as usize] else { continue };
                        s.clear_holder(id);
                        m.0.retain(|(i, _), _| *i != id);
                    }
                    Op::Release(w) => {
                        let Some(id) = ids[w as usize].take() else { continue };
                        s.release_holder(id);
                        m.0.retain(|(i, _), _| *i != id);
                    }
                }
                s.check();
            }
            for id in ids.iter().flatten() {
                let mut got = s.holder_contents(*id);
                got.sort();
                let want: Vec<(u64, u32)> = m.0.iter().filter(|((i, _), _)| i == id).map(|((_, h), c)| (*h, *c)).collect();
                prop_assert_eq!(got, want);
            }
            for start in 0u64..30 {
                let chain: Vec<u64> = (start..start + 12).collect();
                let mut got = Vec::new();
                s.walk(&chain, &mut got);
                prop_assert!(got.windows(2).all(|w| w[0].0 < w[1].0));
                for id in ids.iter().flatten() {
                    let listed = got.iter().find(|(i, _)| i == id).map_or(0, |(_, b)| *b);
                    prop_assert_eq!(listed, m.prefix(*id, &chain), "chain from {}", start);
                }
            }
        }
    }
}
