//! The blocks a rank evicted lately: what tells a re-prefill of evicted content apart from new
//! content.
//!
//! Owns: a bounded set of the block keys (engine hashes, or content keys in content-key mode)
//! that the rank's engine removed from its eviction group (the rank's lowest full-attention
//! group, the only one counted), in the order it removed them, and `take`, which answers
//! whether a block now stored again was among them (and forgets it).
//! Invariants: at most `cap` keys are remembered, the most recently removed ones; a key is
//! remembered once (removing it again moves it to the newest place); a key taken or pushed out
//! is gone. The removal queue also holds stale entries (keys taken or removed again since),
//! and never more than `2 · cap` entries in all: a push that finds it that full compacts it
//! first. Keys are kept as 32-bit fingerprints: a block never removed reads as removed with a
//! chance of at most `cap / 2³²` (4 in a million at 2¹⁴), which the eviction figures tolerate.
//! Must not: hold anything but key fingerprints (no tokens, no block contents), or grow past
//! its bound.

use crate::holder::MixBuild;
use std::collections::{HashMap, VecDeque};

/// The most keys one rank remembers: 2¹⁴ blocks (262,144 tokens in 16-token blocks, about
/// half an 8B model's pool on an 80 GB GPU), so a block needed again within about half a
/// pool's turnover of evictions is still recognised; at most about 0.53 MiB a rank (a
/// 2¹⁵-bucket map of 9-byte entries and a 2¹⁵-entry queue of 8 bytes), reached only once the
/// rank has evicted that many blocks.
pub const GHOST_KEYS: usize = 1 << 14;

/// A key's fingerprint.
type Key = u32;

fn fingerprint(key: u64) -> Key {
    (key ^ (key >> 32)) as u32
}

/// Recently removed blocks, oldest first.
#[derive(Clone, Debug)]
pub struct Ghosts {
    cap: usize,
    /// Key → the sequence number of its newest removal (the live entry). Numbers wrap; an
    /// entry leaves the queue long before 2³² later pushes could repeat its number.
    live: HashMap<Key, u32, MixBuild>,
    /// (key, sequence number) in removal order; an entry whose number is no longer the key's
    /// live one is stale.
    order: VecDeque<(Key, u32)>,
    next: u32,
}

impl Default for Ghosts {
    fn default() -> Self {
        Ghosts::with_capacity(GHOST_KEYS)
    }
}

impl Ghosts {
    pub fn with_capacity(cap: usize) -> Ghosts {
        Ghosts {
            cap: cap.max(1),
            live: HashMap::default(),
            order: VecDeque::new(),
            next: 0,
        }
    }

    /// Remembers that block `key` was removed (the newest removal).
    pub fn push(&mut self, key: u64) {
        let key = fingerprint(key);
        if self.order.len() >= 2 * self.cap {
            let live = &self.live;
            self.order.retain(|(k, n)| live.get(k) == Some(n));
        }
        self.live.insert(key, self.next);
        self.order.push_back((key, self.next));
        self.next = self.next.wrapping_add(1);
        while self.live.len() > self.cap && self.pop_oldest() {}
    }

    /// Whether block `key` is remembered as removed; forgets it if so.
    pub fn take(&mut self, key: u64) -> bool {
        self.live.remove(&fingerprint(key)).is_some()
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn clear(&mut self) {
        self.live.clear();
        self.order.clear();
    }

    /// Forgets the oldest live key; false if the queue ran out first (never, as every live
    /// key has its entry).
    fn pop_oldest(&mut self) -> bool {
        while let Some((k, n)) = self.order.pop_front() {
            if self.live.get(&k) == Some(&n) {
                self.live.remove(&k);
                return true;
            }
        }
        false
    }

    /// Heap bytes: the map's buckets (a power of two above its capacity at 7/8 load, one
    /// control byte each) and the queue's slots.
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(Key, u32)>();
        let buckets = match self.live.capacity() {
            0 => 0,
            c => (c * 8 / 7).next_power_of_two(),
        };
        buckets * (entry + 1) + self.order.capacity() * entry
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The literal model: the remembered keys, oldest first, each once.
    #[derive(Default)]
    struct Model {
        cap: usize,
        keys: Vec<u64>,
    }

    impl Model {
        fn push(&mut self, k: u64) {
            self.keys.retain(|x| *x != k);
            self.keys.push(k);
            while self.keys.len() > self.cap {
                self.keys.remove(0);
            }
        }
        fn take(&mut self, k: u64) -> bool {
            let had = self.keys.contains(&k);
            self.keys.retain(|x| *x != k);
            had
        }
    }

    #[test]
    fn a_block_removed_then_stored_again_is_recognised_once() {
        let mut g = Ghosts::with_capacity(4);
        g.push(7);
        assert!(!g.take(8), "a block never removed is new");
        assert!(g.take(7));
        assert!(!g.take(7));
        g.push(7);
        g.clear();
        assert!(!g.take(7), "a cleared rank forgets what it removed");
    }

    #[test]
    fn the_oldest_removals_are_forgotten_first() {
        let mut g = Ghosts::with_capacity(2);
        g.push(1);
        g.push(2);
        g.push(1); // removed again: now the newest
        g.push(3);
        assert!(!g.take(2));
        assert!(g.take(1));
        assert!(g.take(3));
    }

    proptest! {
        #[test]
        fn ghosts_agree_with_the_literal_model(
            cap in 1usize..6,
            ops in prop::collection::vec((0u8..3, 0u64..16), 0..200),
        ) {
            let mut fast = Ghosts::with_capacity(cap);
            let mut model = Model { cap, keys: Vec::new() };
            for (op, key) in ops {
                match op {
                    0 => prop_assert_eq!(fast.take(key), model.take(key)),
                    // Clears are rare in an engine's life; one op in 48 here.
                    1 if key == 0 => {
                        fast.clear();
                        model.keys.clear();
                    }
                    _ => {
                        fast.push(key);
                        model.push(key);
                    }
                }
                prop_assert_eq!(fast.len(), model.keys.len());
                prop_assert!(fast.order.len() <= 2 * cap);
            }
        }
    }
}
