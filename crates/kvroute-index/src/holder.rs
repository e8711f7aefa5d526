//! The fast multiset of block hashes one holder — a (worker, rank, group) — keeps.
//!
//! Owns: presence and copy counts of 64-bit hashes. Most blocks are held once, so the common
//! case is `U64Set`, an open-addressing set of bare `u64` keys (8 bytes a slot, linear probing,
//! keys and tombstones at most 3/4 of the slots, one cache line a probe in the common case);
//! copies beyond the first live in a small side map.
//! Invariants: `count(h) == copies stored − copies removed` (never below zero); a hash is
//! present iff it is in `once`; `extra[h]`, when present, is ≥ 1 and counts copies beyond one.
//! In a `U64Set`, slot values 0 (empty) and `u64::MAX` (tombstone) are markers (those two keys
//! are flags), and every key sits in the unbroken run of non-empty slots (keys or tombstones)
//! that starts at its home slot; a table never fills (at least 1/4 of the slots are empty).
//! Must not: forget a hash on the first of several removals.

use std::collections::HashMap;
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

const EMPTY: u64 = 0;
const TOMB: u64 = u64::MAX;

/// A set of `u64` keys: open addressing, linear probing, removals leave tombstones that the
/// next rebuild drops. The two slot markers (0 = empty, `u64::MAX` = tombstone) are kept as
/// flags when they are keys.
#[derive(Default, Clone, Debug)]
pub struct U64Set {
    slots: Box<[u64]>,
    /// Keys in `slots` (the markers excluded).
    len: usize,
    tombs: usize,
    /// The keys 0 and `u64::MAX`.
    markers: [bool; 2],
    /// `64 − log2(slots.len())`: a key's home is the top bits of its mixed value.
    shift: u32,
}

impl U64Set {
    #[inline]
    fn home(&self, key: u64) -> usize {
        (fold(key) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    #[inline]
    fn marker(key: u64) -> Option<usize> {
        match key {
            EMPTY => Some(0),
            TOMB => Some(1),
            _ => None,
        }
    }

    /// The slot holding `key` (not a marker), if any.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match self.slots[i] {
                EMPTY => return None,
                k if k == key => return Some(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    #[inline]
    pub fn contains(&self, key: u64) -> bool {
        match Self::marker(key) {
            Some(m) => self.markers[m],
            None => self.find(key).is_some(),
        }
    }

    /// Adds `key`; false when it was present already.
    pub fn insert(&mut self, key: u64) -> bool {
        if let Some(m) = Self::marker(key) {
            return !std::mem::replace(&mut self.markers[m], true);
        }
        if (self.len + self.tombs + 1) * 4 > self.slots.len() * 3 {
            // Grow when keys fill half the table; otherwise only drop the tombstones.
            let grow = (self.len + 1) * 2 > self.slots.len();
            let slots = self.slots.len();
            self.rebuild(if grow { (slots * 2).max(8) } else { slots });
        }
        let mask = self.mask();
        let mut i = self.home(key);
        let mut tomb = None;
        loop {
            match self.slots[i] {
                EMPTY => break,
                TOMB => {
                    tomb.get_or_insert(i);
                }
                k if k == key => return false,
                _ => {}
            }
            i = (i + 1) & mask;
        }
        if let Some(t) = tomb {
            i = t;
            self.tombs -= 1;
        }
        self.slots[i] = key;
        self.len += 1;
        true
    }

    /// Removes `key`; false when it was absent.
    pub fn remove(&mut self, key: u64) -> bool {
        if let Some(m) = Self::marker(key) {
            return std::mem::replace(&mut self.markers[m], false);
        }
        let Some(i) = self.find(key) else {
            return false;
        };
        // A slot followed by an empty one ends every probe run through it: it can be empty.
        if self.slots[(i + 1) & self.mask()] == EMPTY {
            self.slots[i] = EMPTY;
        } else {
            self.slots[i] = TOMB;
            self.tombs += 1;
        }
        self.len -= 1;
        true
    }

    fn rebuild(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; slots].into_boxed_slice());
        self.tombs = 0;
        if slots == 0 {
            self.shift = 0;
            return;
        }
        self.shift = 64 - slots.trailing_zeros();
        let mask = self.mask();
        for k in old.iter().copied().filter(|k| *k != EMPTY && *k != TOMB) {
            let mut i = self.home(k);
            while self.slots[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = k;
        }
    }

    pub fn len(&self) -> usize {
        self.len + self.markers.iter().filter(|m| **m).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots allocated.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let markers = [EMPTY, TOMB]
            .into_iter()
            .zip(self.markers)
            .filter_map(|(k, held)| held.then_some(k));
        markers.chain(
            self.slots
                .iter()
                .copied()
                .filter(|k| *k != EMPTY && *k != TOMB),
        )
    }

    /// The smallest table that keeps the set at most 3/4 full, without tombstones.
    pub fn shrink_to_fit(&mut self) {
        let mut want = 0usize;
        if self.len > 0 {
            want = 8;
            while self.len * 4 > want * 3 {
                want *= 2;
            }
        }
        if want < self.slots.len() || self.tombs > 0 {
            self.rebuild(want.min(self.slots.len()));
        }
    }
}

/// A counted set of block hashes.
#[derive(Default, Clone, Debug)]
pub struct Multiset {
    once: U64Set,
    extra: HashMap<u64, u32, MixBuild>,
    total: u64,
}

impl Multiset {
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
        if self.once.remove(h) {
            self.total -= 1;
            true
        } else {
            false
        }
    }

    #[inline]
    pub fn contains(&self, h: u64) -> bool {
        self.once.contains(h)
    }

    pub fn count(&self, h: u64) -> u32 {
        if !self.once.contains(h) {
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
        self.once = U64Set::default();
        self.extra = HashMap::default();
        self.total = 0;
    }

    /// Every distinct hash with its count (unordered).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.once.iter().map(move |h| (h, self.count(h)))
    }

    /// Approximate heap bytes: the set's slots and the side map's (key, count, control byte).
    pub fn heap_bytes(&self) -> usize {
        let once = self.once.capacity() * 8;
        let extra = self.extra.capacity() * (16 + 1);
        once + extra
    }

    pub fn shrink_to_fit(&mut self) {
        self.once.shrink_to_fit();
        self.extra.shrink_to_fit();
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

    /// The open-addressing set against `std`'s on a random mix of inserts and removals with
    /// few distinct keys (long probe runs, wrap-around, the key 0), shrinking now and then.
    #[test]
    fn the_u64_set_equals_a_std_set_under_random_inserts_and_removals() {
        let mut fast = U64Set::default();
        let mut want = std::collections::BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Keys collide in their home slots: few distinct top bits, plus both markers.
            let key = match x % 50 {
                0 => 0,
                1 => u64::MAX,
                _ => ((x % 97) << 58) | ((x >> 40) % 3),
            };
            if x.is_multiple_of(3) {
                assert_eq!(fast.remove(key), want.remove(&key), "step {step}");
            } else {
                assert_eq!(fast.insert(key), want.insert(key), "step {step}");
            }
            if step % 5000 == 0 {
                fast.shrink_to_fit();
            }
            if step % 997 == 0 {
                assert_eq!(fast.len(), want.len());
                let mut got: Vec<u64> = fast.iter().collect();
                got.sort_unstable();
                assert_eq!(got, want.iter().copied().collect::<Vec<_>>());
                for k in &want {
                    assert!(fast.contains(*k));
                }
            }
        }
    }
}
