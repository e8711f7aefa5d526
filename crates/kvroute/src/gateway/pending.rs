//! Prefixes a worker is about to cache: the prompts the gateway sent it that are still in flight.
//!
//! Owns: per worker, the in-flight prompts (tokens, and the positions where the engine will keep
//! a state checkpoint once their prefill is done) and the forecast they give a new request: the
//! reuse it can expect on that worker once the requests ahead of it in the queue have stored
//! their blocks. The index only knows what the engine has already stored, so without this a
//! request arriving while its sibling is still being prefilled looks cold everywhere, and a
//! cache-aware router sends it away from the very worker that is building its prefix.
//! Invariants: an entry lives exactly as long as its request's load guard (added before the
//! request is sent, removed when it ends, whatever the outcome); a forecast never exceeds
//! `n − 1` tokens and is a multiple of the worker's alignment.
//! Must not: feed the prediction the gateway reports (`predicted_cached` stays the index's
//! exact figure); the forecast only informs the routing cost and the load accounting.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a worker's in-flight prompts promise a new request, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forecast {
    /// Reuse the engine will serve once the in-flight prefills are stored: the highest state
    /// checkpoint of an in-flight prompt that the request shares.
    pub cached: u64,
    /// The full-attention prefix it will hold: the longest shared prefix, aligned.
    pub prefix: u64,
}

struct Entry {
    id: u64,
    tokens: Arc<[u32]>,
    /// Where the engine keeps a state checkpoint of this prompt (0 = none): its last aligned
    /// position before the prompt's end, and its junction (`shared_prefix_boundary`).
    checkpoints: [u64; 2],
}

#[derive(Default)]
pub struct Pending {
    entries: Mutex<Vec<Entry>>,
    next: AtomicU64,
}

/// The last aligned position strictly inside a prompt of `n` tokens: where vLLM keeps the
/// prompt's final state checkpoint (`get_mamba_prefill_checkpoint_position`).
pub fn prompt_checkpoint(n: u64, align: u64) -> u64 {
    let a = align.max(1);
    n.saturating_sub(1) / a * a
}

/// Length of the common prefix of two token sequences (compared a chunk at a time).
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 64;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl Pending {
    /// Records an in-flight prompt; returns the id to remove it with.
    pub fn add(&self, tokens: Arc<[u32]>, checkpoints: [u64; 2]) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.entries.lock().push(Entry {
            id,
            tokens,
            checkpoints,
        });
        id
    }

    pub fn remove(&self, id: u64) {
        self.entries.lock().retain(|e| e.id != id);
    }

    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The forecast for a request of `tokens` on this worker (alignment `align`). With `dense`
    /// (a single KV cache group: every stored block is reusable) the whole shared prefix will
    /// be served; otherwise (hybrid layouts, sparse state) only up to a prompt's checkpoint.
    pub fn forecast(&self, tokens: &[u32], align: u64, dense: bool) -> Forecast {
        let a = align.max(1);
        let max = (tokens.len() as u64).saturating_sub(1) / a * a;
        let mut f = Forecast::default();
        for e in self.entries.lock().iter() {
            let shared = (common_prefix(tokens, &e.tokens) as u64 / a * a).min(max);
            f.prefix = f.prefix.max(shared);
            if dense {
                f.cached = f.cached.max(shared);
            }
            for &c in &e.checkpoints {
                if c > 0 && c <= shared {
                    f.cached = f.cached.max(c);
                }
            }
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(r: std::ops::Range<u32>) -> Arc<[u32]> {
        r.collect::<Vec<_>>().into()
    }

    #[test]
    fn common_prefix_counts_equal_leading_tokens_across_chunk_edges() {
        let a: Vec<u32> = (0..300).collect();
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 300);
        b[130] = 9999;
        assert_eq!(common_prefix(&a, &b), 130);
        assert_eq!(common_prefix(&a, &b[..64]), 64);
        assert_eq!(common_prefix(&[], &b), 0);
    }

    #[test]
    fn a_sibling_of_an_in_flight_prompt_is_forecast_its_checkpoint() {
        let p = Pending::default();
        // In flight: 1,000 tokens at alignment 64; its final checkpoint sits at 960.
        let id = p.add(toks(0..1000), [prompt_checkpoint(1000, 64), 0]);
        // A continuation sharing all 1,000 tokens: the checkpoint at 960 will serve it.
        let f = p.forecast(&toks(0..1200), 64, false);
        assert_eq!(
            f,
            Forecast {
                cached: 960,
                prefix: 960
            }
        );
        // A branch at 700: the full-attention prefix (640) will be there, the state will not.
        let mut branch: Vec<u32> = (0..700).collect();
        branch.extend(5000..5400);
        let f = p.forecast(&branch, 64, false);
        assert_eq!(
            f,
            Forecast {
                cached: 0,
                prefix: 640
            }
        );
        p.remove(id);
        assert_eq!(p.forecast(&toks(0..1200), 64, false), Forecast::default());
        assert!(p.is_empty());
    }

    #[test]
    fn with_a_single_group_the_whole_shared_prefix_is_forecast() {
        let p = Pending::default();
        p.add(toks(0..1000), [960, 0]);
        let mut branch: Vec<u32> = (0..700).collect();
        branch.extend(5000..5400);
        assert_eq!(
            p.forecast(&branch, 16, true),
            Forecast {
                cached: 688,
                prefix: 688
            }
        );
    }

    #[test]
    fn a_junction_checkpoint_serves_a_branch_at_the_junction() {
        let p = Pending::default();
        p.add(toks(0..1000), [960, 512]);
        let mut branch: Vec<u32> = (0..700).collect();
        branch.extend(5000..5400);
        assert_eq!(
            p.forecast(&branch, 64, false),
            Forecast {
                cached: 512,
                prefix: 640
            }
        );
    }

    #[test]
    fn a_forecast_never_reaches_the_last_prompt_token() {
        let p = Pending::default();
        p.add(toks(0..1000), [960, 0]);
        assert_eq!(p.forecast(&toks(0..961), 64, false).cached, 960);
        // 960 tokens: at most 896 can be served, and a checkpoint at 960 serves none of them.
        assert_eq!(
            p.forecast(&toks(0..960), 64, false),
            Forecast {
                cached: 0,
                prefix: 896
            }
        );
    }
}
