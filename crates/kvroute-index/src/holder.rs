//! The fast multiset of block hashes one holder — a (worker, rank, group) — keeps.
//!
//! Owns: presence and copy counts of 64-bit hashes. Most blocks are held once, so the common
//! case is a plain hash set of `u64` (9 bytes a slot before load factor); copies beyond the
//! first live in a small side map.
//! Invariants: `count(h) == copies stored − copies removed` (never below zero); a hash is
//! present iff it is in `once`; `extra[h]`, when present, is ≥ 1 and counts copies beyond one.
//! Must not: forget a hash on the first of several removals.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A cheap mixing hasher for keys that are already (mostly) uniform 64-bit hashes. It still
/// mixes (a folded 64×64→128-bit multiply: both halves of the product, xored), so small or
/// patterned keys from a buggy engine cannot degrade the table. Several writes (a tuple key,
/// a string) are combined, never overwritten.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
fn fold(x: u64) -> u64 {
    let wide = (x as u128).wrapping_mul(MIX as u128);
    (wide as u64) ^ ((wide >> 64) as u64)
}

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        fold(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        // One key from a fresh hasher is the key itself; later writes fold the state first.
        self.0 = if self.0 == 0 { i } else { fold(self.0) ^ i };
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64 | 0x100);
    }
}

pub type MixBuild = BuildHasherDefault<MixHasher>;

/// A counted set of block hashes.
#[derive(Default, Clone, Debug)]
pub struct Multiset {
    once: HashSet<u64, MixBuild>,
    extra: HashMap<u64, u32, MixBuild>,
    total: u64,
}

impl Multiset {
    /// Makes room for `additional` more distinct hashes at once (one growth for a whole
    /// event's blocks instead of one per doubling on the way).
    pub fn reserve(&mut self, additional: usize) {
        self.once.reserve(additional);
    }

    pub fn insert(&mut self, h: u64) {
        self.total += 1;
        if !self.once.insert(h) {
            *self.extra.entry(h).or_insert(0) += 1;
        }
    }

    /// Removes one copy; false when the hash was not held.
    pub fn remove(&mut self, h: u64) -> bool {
        if let Some(c) = self.extra.get_mut(&h) {
            *c -= 1;
            if *c == 0 {
                self.extra.remove(&h);
            }
            self.total -= 1;
            return true;
        }
        if self.once.remove(&h) {
            self.total -= 1;
            true
        } else {
            false
        }
    }

    #[inline]
    pub fn contains(&self, h: u64) -> bool {
        self.once.contains(&h)
    }

    pub fn count(&self, h: u64) -> u32 {
        if !self.once.contains(&h) {
            return 0;
        }
        1 + self.extra.get(&h).copied().unwrap_or(0)
    }

    pub fn distinct(&self) -> usize {
        self.once.len()
    }

    /// Copies held, duplicates included.
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.once.is_empty()
    }

    pub fn clear(&mut self) {
        self.once = HashSet::default();
        self.extra = HashMap::default();
        self.total = 0;
    }

    /// Every distinct hash (unordered).
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.once.iter().copied()
    }

    /// Every distinct hash with its count (unordered).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.once.iter().map(move |h| (*h, self.count(*h)))
    }

    /// Approximate heap bytes: table slots (key + control byte) of both maps.
    pub fn heap_bytes(&self) -> usize {
        let once = self.once.capacity() * (8 + 1);
        let extra = self.extra.capacity() * (16 + 1);
        once + extra
    }

    pub fn shrink_to_fit(&mut self) {
        self.once.shrink_to_fit();
        self.extra.shrink_to_fit();
    }
}

/// Groups one table can hold (one presence bit each).
pub const SPEC_SLOTS: usize = 8;

/// The blocks of up to `SPEC_SLOTS` groups in one table. With one group it is a plain
/// `Multiset`; from the second group on, per hash a bit for each group (slot) that holds it,
/// with copies beyond a slot's first kept apart. Groups of one spec store and evict the same
/// hashes, so one entry serves them all, and a block that every group of a lookup must hold is
/// one probe.
/// Invariants: in the shared form a hash has an entry exactly when some slot holds it, `extra`
/// has (hash, slot) only while that slot holds two copies or more, and per-slot totals equal
/// the contents; the one-group form only ever has slot 0.
#[derive(Clone, Debug)]
pub struct SpecSet {
    inner: Inner,
    distinct: [u64; SPEC_SLOTS],
    total: [u64; SPEC_SLOTS],
}

#[derive(Clone, Debug)]
enum Inner {
    One(Multiset),
    Many {
        bits: HashMap<u64, u8, MixBuild>,
        extra: HashMap<(u64, u8), u32, MixBuild>,
    },
}

impl Default for SpecSet {
    fn default() -> Self {
        SpecSet {
            inner: Inner::One(Multiset::default()),
            distinct: [0; SPEC_SLOTS],
            total: [0; SPEC_SLOTS],
        }
    }
}

impl SpecSet {
    /// Moves to the shared form (a second group joined); slot 0 keeps its blocks.
    pub fn share(&mut self) {
        let Inner::One(m) = &self.inner else { return };
        let mut bits: HashMap<u64, u8, MixBuild> = HashMap::default();
        let mut extra: HashMap<(u64, u8), u32, MixBuild> = HashMap::default();
        bits.reserve(m.distinct());
        for (h, copies) in m.iter() {
            bits.insert(h, 1);
            if copies > 1 {
                extra.insert((h, 0), copies - 1);
            }
        }
        self.distinct[0] = m.distinct() as u64;
        self.total[0] = m.total();
        self.inner = Inner::Many { bits, extra };
    }

    /// The one group's multiset, while the table has one group.
    #[inline]
    pub fn single(&self) -> Option<&Multiset> {
        match &self.inner {
            Inner::One(m) => Some(m),
            Inner::Many { .. } => None,
        }
    }

    pub fn reserve(&mut self, additional: usize) {
        match &mut self.inner {
            Inner::One(m) => m.reserve(additional),
            Inner::Many { bits, .. } => bits.reserve(additional),
        }
    }

    #[inline]
    pub fn insert(&mut self, slot: u8, h: u64) {
        match &mut self.inner {
            Inner::One(m) => m.insert(h),
            Inner::Many { bits, extra } => {
                let s = slot as usize;
                self.total[s] += 1;
                let b = bits.entry(h).or_insert(0);
                if *b & (1 << slot) == 0 {
                    *b |= 1 << slot;
                    self.distinct[s] += 1;
                } else {
                    *extra.entry((h, slot)).or_insert(0) += 1;
                }
            }
        }
    }

    /// Removes one copy from `slot`; false when the slot did not hold the hash.
    #[inline]
    pub fn remove(&mut self, slot: u8, h: u64) -> bool {
        match &mut self.inner {
            Inner::One(m) => slot == 0 && m.remove(h),
            Inner::Many { bits, extra } => {
                let s = slot as usize;
                let Some(b) = bits.get_mut(&h) else {
                    return false;
                };
                if *b & (1 << slot) == 0 {
                    return false;
                }
                self.total[s] -= 1;
                if !extra.is_empty() {
                    if let Some(c) = extra.get_mut(&(h, slot)) {
                        *c -= 1;
                        if *c == 0 {
                            extra.remove(&(h, slot));
                        }
                        return true;
                    }
                }
                *b &= !(1 << slot);
                self.distinct[s] -= 1;
                if *b == 0 {
                    bits.remove(&h);
                }
                true
            }
        }
    }

    #[inline]
    pub fn contains(&self, slot: u8, h: u64) -> bool {
        match &self.inner {
            Inner::One(m) => slot == 0 && m.contains(h),
            Inner::Many { bits, .. } => bits.get(&h).is_some_and(|b| b & (1 << slot) != 0),
        }
    }

    /// Whether every slot of `mask` holds `h` (one probe).
    #[inline]
    pub fn contains_all(&self, mask: u8, h: u64) -> bool {
        match &self.inner {
            Inner::One(m) => mask == 1 && m.contains(h),
            Inner::Many { bits, .. } => bits.get(&h).is_some_and(|b| b & mask == mask),
        }
    }

    pub fn count(&self, slot: u8, h: u64) -> u32 {
        match &self.inner {
            Inner::One(m) if slot == 0 => m.count(h),
            Inner::One(_) => 0,
            Inner::Many { extra, .. } => {
                if !self.contains(slot, h) {
                    return 0;
                }
                1 + extra.get(&(h, slot)).copied().unwrap_or(0)
            }
        }
    }

    pub fn distinct(&self, slot: u8) -> u64 {
        match &self.inner {
            Inner::One(m) if slot == 0 => m.distinct() as u64,
            Inner::One(_) => 0,
            Inner::Many { .. } => self.distinct[slot as usize],
        }
    }

    pub fn total(&self, slot: u8) -> u64 {
        match &self.inner {
            Inner::One(m) if slot == 0 => m.total(),
            Inner::One(_) => 0,
            Inner::Many { .. } => self.total[slot as usize],
        }
    }

    /// Distinct hashes over every slot (the table's size).
    pub fn len(&self) -> usize {
        match &self.inner {
            Inner::One(m) => m.distinct(),
            Inner::Many { bits, .. } => bits.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every hash `slot` holds (unordered).
    pub fn keys(&self, slot: u8) -> impl Iterator<Item = u64> + '_ {
        let one = match &self.inner {
            Inner::One(m) if slot == 0 => Some(m.keys()),
            _ => None,
        };
        let many = match &self.inner {
            Inner::Many { bits, .. } => Some(
                bits.iter()
                    .filter(move |(_, b)| *b & (1 << slot) != 0)
                    .map(|(h, _)| *h),
            ),
            Inner::One(_) => None,
        };
        one.into_iter().flatten().chain(many.into_iter().flatten())
    }

    /// Every hash `slot` holds with its copies (unordered).
    pub fn iter(&self, slot: u8) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.keys(slot).map(move |h| (h, self.count(slot, h)))
    }

    /// Empties one slot.
    pub fn clear_slot(&mut self, slot: u8) {
        match &mut self.inner {
            Inner::One(m) => {
                if slot == 0 {
                    m.clear();
                }
            }
            Inner::Many { bits, extra } => {
                let bit = 1u8 << slot;
                bits.retain(|_, b| {
                    *b &= !bit;
                    *b != 0
                });
                extra.retain(|(_, s), _| *s != slot);
                self.distinct[slot as usize] = 0;
                self.total[slot as usize] = 0;
            }
        }
    }

    /// Approximate heap bytes: table slots (key, value, control byte).
    pub fn heap_bytes(&self) -> usize {
        match &self.inner {
            Inner::One(m) => m.heap_bytes(),
            Inner::Many { bits, extra } => bits.capacity() * (16 + 1) + extra.capacity() * (24 + 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_stored_twice_needs_two_removals_to_disappear() {
        let mut m = Multiset::default();
        m.insert(7);
        m.insert(7);
        assert_eq!(m.count(7), 2);
        assert!(m.remove(7));
        assert!(m.contains(7));
        assert!(m.remove(7));
        assert!(!m.contains(7));
        assert!(!m.remove(7));
        assert_eq!(m.total(), 0);
    }

    #[test]
    fn groups_sharing_a_table_keep_their_own_copies() {
        let mut s = SpecSet::default();
        s.insert(0, 7);
        s.insert(0, 8);
        s.insert(0, 8);
        // A second group joins: slot 0 keeps its blocks and copies.
        s.share();
        assert_eq!((s.count(0, 8), s.distinct(0), s.total(0)), (2, 2, 3));
        assert!(s.remove(0, 8) && s.remove(0, 8) && !s.remove(0, 8));
        s.insert(1, 7);
        s.insert(1, 7);
        s.insert(2, 9);
        assert!(s.contains_all(0b011, 7));
        assert!(!s.contains_all(0b111, 7));
        assert_eq!((s.count(0, 7), s.count(1, 7), s.count(2, 7)), (1, 2, 0));
        assert!(s.remove(1, 7));
        assert!(s.contains(1, 7));
        assert!(s.remove(0, 7));
        assert!(!s.contains(0, 7));
        assert!(!s.remove(0, 7));
        assert_eq!((s.total(1), s.distinct(1), s.len()), (1, 1, 2));
        s.clear_slot(1);
        assert_eq!(s.len(), 1, "9 stays, held by slot 2");
        assert_eq!(s.iter(2).collect::<Vec<_>>(), vec![(9, 1)]);
        assert_eq!((s.total(1), s.distinct(1)), (0, 0));
    }

    /// Tuple and string keys (the index's rank map) hash every part, not only the last write.
    #[test]
    fn the_mix_hasher_combines_every_write() {
        use std::hash::BuildHasher;
        let h = |w: &str, r: u32| MixBuild::default().hash_one((std::sync::Arc::<str>::from(w), r));
        assert_ne!(h("w0", 0), h("w0", 1));
        assert_ne!(h("w0", 0), h("w1", 0));
        assert_ne!(h("worker-long-name-0", 0), h("worker-long-name-1", 0));
    }
}
