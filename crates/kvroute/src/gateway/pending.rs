//! Prefixes a worker is about to cache: the prompts the gateway sent it that are still in flight.
//!
//! Owns: per worker, the in-flight prompts as chained 64-token chunk keys (a prefix map from
//! chunk key to how many in-flight prompts share it) and where the engine will keep a state
//! checkpoint of each once its prefill is done; and the forecast they give a new request, the
//! reuse it can expect there once the prompts ahead of it have stored their blocks. The index
//! only knows what the engine has already stored, so without this a request arriving while its
//! sibling is still being prefilled looks cold everywhere, and a cache-aware router sends it
//! away from the very worker that is building its prefix.
//! Invariants: an entry lives exactly as long as its request's load guard (added before the
//! request is sent, removed when it ends, whatever the outcome), and removing it takes back
//! exactly what adding it put in; a forecast costs one probe per shared chunk (not per prompt
//! in flight), never exceeds `n − 1` tokens and is a multiple of the worker's alignment.
//! Must not: feed the prediction the gateway reports (`predicted_cached` stays the index's
//! exact figure); the forecast only informs the routing cost and the load accounting.

use kvroute_index::hash::content_chain;
use kvroute_index::holder::MixBuild;
use kvroute_index::BlockExtras;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Tokens per chunk key: the forecast's granularity.
pub const CHUNK: usize = 64;

/// What a worker's in-flight prompts promise a new request, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forecast {
    /// Reuse the engine will serve once the in-flight prefills are stored.
    pub cached: u64,
    /// The full-attention prefix it will hold: the longest shared prefix, aligned.
    pub prefix: u64,
}

/// A prompt's chained chunk keys (salt included), computed once per request.
pub fn chunk_keys(tokens: &[u32], extras: &BlockExtras) -> Arc<[u64]> {
    content_chain(tokens, CHUNK, extras).into()
}

/// The last aligned position strictly inside a prompt of `n` tokens: where vLLM keeps the
/// prompt's final state checkpoint (`get_mamba_prefill_checkpoint_position`).
pub fn prompt_checkpoint(n: u64, align: u64) -> u64 {
    let a = align.max(1);
    n.saturating_sub(1) / a * a
}

struct Entry {
    keys: Arc<[u64]>,
    /// (chunk key covering the checkpoint, checkpoint position) for each checkpoint kept.
    checkpoints: Vec<(u64, u64)>,
}

#[derive(Default)]
struct Inner {
    /// Chunk key → in-flight prompts holding that prefix.
    prefixes: HashMap<u64, u32, MixBuild>,
    /// Chunk key → checkpoint positions ending in that chunk (a multiset).
    checkpoints: HashMap<u64, Vec<u64>, MixBuild>,
    entries: HashMap<u64, Entry, MixBuild>,
}

#[derive(Default)]
pub struct Pending {
    inner: Mutex<Inner>,
    next: AtomicU64,
}

impl Pending {
    /// Records an in-flight prompt (its chunk keys and the positions where the engine will keep
    /// a state checkpoint, 0 = none); returns the id to remove it with.
    pub fn add(&self, keys: Arc<[u64]>, checkpoints: [u64; 2]) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.inner.lock();
        for k in keys.iter() {
            *inner.prefixes.entry(*k).or_insert(0) += 1;
        }
        let mut kept = Vec::new();
        for c in checkpoints {
            let chunks = (c as usize).div_ceil(CHUNK);
            if let Some(&k) = chunks.checked_sub(1).and_then(|i| keys.get(i)) {
                inner.checkpoints.entry(k).or_default().push(c);
                kept.push((k, c));
            }
        }
        inner.entries.insert(
            id,
            Entry {
                keys,
                checkpoints: kept,
            },
        );
        id
    }

    pub fn remove(&self, id: u64) {
        let mut inner = self.inner.lock();
        let Some(e) = inner.entries.remove(&id) else {
            return;
        };
        for k in e.keys.iter() {
            if let Some(n) = inner.prefixes.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    inner.prefixes.remove(k);
                }
            }
        }
        for (k, c) in e.checkpoints {
            if let Some(v) = inner.checkpoints.get_mut(&k) {
                if let Some(at) = v.iter().position(|x| *x == c) {
                    v.swap_remove(at);
                }
                if v.is_empty() {
                    inner.checkpoints.remove(&k);
                }
            }
        }
    }

    /// In-flight prompts recorded.
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The forecast for a request of `n` tokens with chunk keys `keys` on this worker
    /// (alignment `align`). With `dense` (a single KV cache group: every stored block is
    /// reusable) the whole shared prefix will be served; otherwise (hybrid layouts, sparse
    /// state) only up to a checkpoint of an in-flight prompt that the request shares.
    pub fn forecast(&self, keys: &[u64], n: u64, align: u64, dense: bool) -> Forecast {
        let a = align.max(1);
        let max = prompt_checkpoint(n, a);
        let inner = self.inner.lock();
        if inner.entries.is_empty() {
            return Forecast::default();
        }
        let mut cached = 0;
        let mut matched = 0;
        for k in keys {
            if !inner.prefixes.contains_key(k) {
                break;
            }
            matched += 1;
            if let Some(cs) = inner.checkpoints.get(k) {
                cached = cs
                    .iter()
                    .copied()
                    .filter(|c| *c <= max)
                    .fold(cached, u64::max);
            }
        }
        let prefix = ((matched * CHUNK) as u64 / a * a).min(max);
        Forecast {
            cached: if dense { prefix } else { cached.min(prefix) },
            prefix,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(t: &[u32]) -> Arc<[u64]> {
        chunk_keys(t, &BlockExtras::default())
    }

    fn seq(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    fn branch_at(at: u32) -> Vec<u32> {
        let mut t = seq(0..at);
        t.extend(5000..5400);
        t
    }

    #[test]
    fn a_sibling_of_an_in_flight_prompt_is_forecast_its_checkpoint() {
        let p = Pending::default();
        // In flight: 1,000 tokens at alignment 64; its final checkpoint sits at 960.
        let id = p.add(keys(&seq(0..1000)), [prompt_checkpoint(1000, 64), 0]);
        // A continuation sharing all 1,000 tokens: the checkpoint at 960 will serve it.
        let long = seq(0..1200);
        assert_eq!(
            p.forecast(&keys(&long), 1200, 64, false),
            Forecast {
                cached: 960,
                prefix: 960
            }
        );
        // A branch at 700: the full-attention prefix (640) will be there, the state will not.
        let b = branch_at(700);
        assert_eq!(
            p.forecast(&keys(&b), b.len() as u64, 64, false),
            Forecast {
                cached: 0,
                prefix: 640
            }
        );
        p.remove(id);
        assert_eq!(
            p.forecast(&keys(&long), 1200, 64, false),
            Forecast::default()
        );
        assert!(p.is_empty());
    }

    #[test]
    fn with_a_single_group_the_whole_shared_prefix_is_forecast() {
        let p = Pending::default();
        p.add(keys(&seq(0..1000)), [960, 0]);
        let b = branch_at(700);
        assert_eq!(
            p.forecast(&keys(&b), b.len() as u64, 16, true),
            Forecast {
                cached: 640,
                prefix: 640
            }
        );
    }

    #[test]
    fn a_junction_checkpoint_serves_a_branch_at_the_junction() {
        let p = Pending::default();
        p.add(keys(&seq(0..1000)), [960, 512]);
        let b = branch_at(700);
        assert_eq!(
            p.forecast(&keys(&b), b.len() as u64, 64, false),
            Forecast {
                cached: 512,
                prefix: 640
            }
        );
    }

    #[test]
    fn a_forecast_never_reaches_the_last_prompt_token() {
        let p = Pending::default();
        p.add(keys(&seq(0..1000)), [960, 0]);
        assert_eq!(p.forecast(&keys(&seq(0..961)), 961, 64, false).cached, 960);
        // 960 tokens: at most 896 can be served, and a checkpoint at 960 serves none of them.
        assert_eq!(
            p.forecast(&keys(&seq(0..960)), 960, 64, false),
            Forecast {
                cached: 0,
                prefix: 896
            }
        );
    }

    #[test]
    fn removing_a_prompt_takes_back_only_its_share() {
        let p = Pending::default();
        let a = p.add(keys(&seq(0..1000)), [960, 0]);
        let b = p.add(keys(&seq(0..1000)), [960, 0]);
        let other = p.add(keys(&branch_at(300)), [256, 0]);
        p.remove(a);
        let long = seq(0..1200);
        assert_eq!(p.forecast(&keys(&long), 1200, 64, false).cached, 960);
        p.remove(b);
        assert_eq!(
            p.forecast(&keys(&long), 1200, 64, false),
            Forecast {
                cached: 256,
                prefix: 256
            }
        );
        p.remove(other);
        p.remove(other);
        assert!(p.is_empty());
        let inner = p.inner.lock();
        assert!(inner.prefixes.is_empty() && inner.checkpoints.is_empty());
    }

    #[test]
    fn a_salted_prompt_shares_nothing_with_an_unsalted_one() {
        let p = Pending::default();
        let salted = BlockExtras {
            cache_salt: Some("tenant-a".into()),
            lora: None,
        };
        p.add(chunk_keys(&seq(0..1000), &salted), [960, 0]);
        assert_eq!(
            p.forecast(&keys(&seq(0..1200)), 1200, 64, false),
            Forecast::default()
        );
    }
}
