//! Index-wide counters: what was applied, what was dropped and why.
//!
//! Owns: one atomic per `Counter`; a snapshot as (stable snake_case name, value) pairs that the
//! gateway publishes as Prometheus metrics.
//! Invariant: names are stable (they are metric label values); counters only grow.
//! Must not: lock.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// Everything the index counts.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Counter { $($variant),* }

        impl Counter {
            pub const ALL: &'static [Counter] = &[$(Counter::$variant),*];
            /// How many counters there are.
            pub const COUNT: usize = [$($name),*].len();
            pub fn name(self) -> &'static str {
                match self { $(Counter::$variant => $name),* }
            }
        }
    };
}

counters! {
    StoreEvents => "store_events",
    RemoveEvents => "remove_events",
    ClearEvents => "clear_events",
    BlocksStored => "blocks_stored",
    BlocksRemoved => "blocks_removed",
    OffloadBlocksStored => "offload_blocks_stored",
    OffloadBlocksRemoved => "offload_blocks_removed",
    OffloadOverflow => "offload_overflow",
    RemovedUnknownGroup => "removed_unknown_group",
    RemovedUnknownHash => "removed_unknown_hash",
    LayoutChanges => "layout_changes",
    KindAbsent => "kind_absent",
    ZeroBlockSize => "zero_block_size",
    ContentUnplaceable => "content_key_unplaceable",
    HashCheckMatched => "hash_check_matched",
    HashCheckMismatched => "hash_check_mismatched",
    HashCheckUnverifiable => "hash_check_unverifiable",
    Predictions => "predictions",
    DigestCacheHits => "digest_cache_hits",
    BlocksHashed => "blocks_hashed",
    LookaheadMismatch => "hash_lookahead_mismatch",
}

#[derive(Default)]
pub struct Counters {
    values: [AtomicU64; Counter::COUNT],
}

impl Counters {
    #[inline]
    pub fn add(&self, c: Counter, n: u64) {
        self.values[c as usize].fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self, c: Counter) -> u64 {
        self.values[c as usize].load(Ordering::Relaxed)
    }
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        Counter::ALL
            .iter()
            .map(|c| (c.name(), self.get(*c)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_has_a_slot_and_a_unique_name() {
        let c = Counters::default();
        for k in Counter::ALL {
            c.add(*k, 1);
        }
        let snap = c.snapshot();
        assert_eq!(snap.len(), Counter::ALL.len());
        assert!(snap.iter().all(|(_, v)| *v == 1));
        let mut names: Vec<_> = snap.iter().map(|(n, _)| *n).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Counter::ALL.len());
    }
}
