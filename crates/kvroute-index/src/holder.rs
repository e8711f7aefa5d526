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
