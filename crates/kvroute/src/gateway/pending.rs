//! Prefixes a worker is about to cache: the prompts the gateway sent it that are still in flight.
//!
//! Owns: per worker, the in-flight prompts as chained 64-token chunk keys (a prefix map from
//! chunk key to how many in-flight prompts share it) and where the engine will keep a state
//! checkpoint of each once its prefill is done (filed under the last whole chunk before it,
//! with the few tokens from there to the checkpoint); and the forecast they give a new request,
//! the reuse it can expect there once the prompts ahead of it have stored their blocks. The
//! index only knows what the engine has already stored, so without this a request arriving
//! while its sibling is still being prefilled looks cold everywhere, and a cache-aware router
//! sends it away from the very worker that is building its prefix.
//! Invariants: an entry lives exactly as long as its request's load guard (added before the
//! request is sent, removed when the response ends, decode included, whatever the outcome),
//! and removing it takes back exactly what adding it put in; a forecast costs one probe per
//! shared chunk and one short compare per distinct checkpoint filed there (not per prompt in
//! flight), never exceeds `n − 1` tokens and is a multiple of the worker's alignment. Records
//! are per worker, not per DP rank (the engine's balancer picks the rank).
//! Must not: feed the prediction the gateway reports (`predicted_cached` stays the index's
//! exact figure); the forecast only informs the routing cost and the load accounting.

use kvroute_index::hash::content_chain;
use kvroute_index::holder::MixBuild;
use kvroute_index::BlockExtras;
pub use kvroute_route::prompt_checkpoint;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Tokens per chunk key: the granularity of the shared full-attention prefix.
pub const CHUNK: usize = 64;

/// The checkpoints (0 = none) of `prompt` within it, each with its tokens from its anchor
/// chunk's end: what [`Pending::add_parts`] files.
pub fn checkpoint_tails(prompt: &Prompt<'_>, checkpoints: [u64; 2]) -> Vec<(u64, Vec<u32>)> {
    checkpoints
        .into_iter()
        .filter(|&at| at != 0 && at as usize <= prompt.tokens.len())
        .map(|at| {
            let c = at as usize;
            (at, prompt.tokens[c / CHUNK * CHUNK..c].to_vec())
        })
        .collect()
}

/// What a worker's in-flight prompts promise a new request, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forecast {
    /// Reuse the engine will serve once the in-flight prefills are stored.
    pub cached: u64,
    /// The full-attention prefix it will hold: the longest shared prefix, aligned.
    pub prefix: u64,
}

/// A request's tokens (borrowed) and chained chunk keys (salt included), keyed once per
/// request.
#[derive(Clone)]
pub struct Prompt<'a> {
    pub tokens: &'a [u32],
    pub keys: Arc<[u64]>,
}

impl<'a> Prompt<'a> {
    pub fn new(tokens: &'a [u32], extras: &BlockExtras) -> Prompt<'a> {
        Prompt {
            tokens,
            keys: content_chain(tokens, CHUNK, extras).into(),
        }
    }
}

/// A checkpoint position with the tokens from its anchor chunk's end up to it, and how many
/// in-flight prompts filed it.
struct Checkpoint {
    at: u64,
    tail: Arc<[u32]>,
    count: u32,
}

/// Where a checkpoint is filed: after the prompt's first `chunks` chunks (`None`: before the
/// first chunk).
type Anchor = Option<u64>;

struct Entry {
    keys: Arc<[u64]>,
    checkpoints: Vec<(Anchor, u64, Arc<[u32]>)>,
}

#[derive(Default)]
struct Inner {
    /// Chunk key → in-flight prompts holding that prefix.
    prefixes: HashMap<u64, u32, MixBuild>,
    /// Anchor → the distinct checkpoints filed there.
    checkpoints: HashMap<Anchor, Vec<Checkpoint>, MixBuild>,
    entries: HashMap<u64, Entry, MixBuild>,
}

#[derive(Default)]
pub struct Pending {
    inner: Mutex<Inner>,
    next: AtomicU64,
}

impl Pending {
    /// Records an in-flight prompt and the positions where the engine will keep a state
    /// checkpoint of it (0 = none); returns the id to remove it with.
    pub fn add(&self, prompt: &Prompt<'_>, checkpoints: [u64; 2]) -> u64 {
        self.add_parts(prompt.keys.clone(), &checkpoint_tails(prompt, checkpoints))
    }

    /// Records an in-flight prompt given as its chunk keys and its checkpoints with their
    /// tails (what another replica announces: [`checkpoint_tails`]); a checkpoint whose tail
    /// does not end it where its anchor chunk says, or past the keys, is left out.
    pub fn add_parts(&self, keys: Arc<[u64]>, checkpoints: &[(u64, Vec<u32>)]) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.inner.lock();
        for k in keys.iter() {
            *inner.prefixes.entry(*k).or_insert(0) += 1;
        }
        let mut kept = Vec::new();
        for (at, tail) in checkpoints {
            let c = *at as usize;
            let whole = c / CHUNK;
            if *at == 0 || tail.len() != c - whole * CHUNK {
                continue;
            }
            let anchor = match whole.checked_sub(1) {
                None => None,
                Some(i) => match keys.get(i) {
                    Some(k) => Some(*k),
                    None => continue,
                },
            };
            let tail: Arc<[u32]> = tail.as_slice().into();
            let list = inner.checkpoints.entry(anchor).or_default();
            match list.iter_mut().find(|x| x.at == *at && x.tail == tail) {
                Some(x) => x.count += 1,
                None => list.push(Checkpoint {
                    at: *at,
                    tail: tail.clone(),
                    count: 1,
                }),
            }
            kept.push((anchor, *at, tail));
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
        for (anchor, at, tail) in e.checkpoints {
            if let Some(list) = inner.checkpoints.get_mut(&anchor) {
                if let Some(i) = list.iter().position(|x| x.at == at && x.tail == tail) {
                    list[i].count -= 1;
                    if list[i].count == 0 {
                        list.swap_remove(i);
                    }
                }
                if list.is_empty() {
                    inner.checkpoints.remove(&anchor);
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

    /// The forecast for `prompt` on this worker (alignment `align`). With `dense` (a single KV
    /// cache group: every stored block is reusable) the whole shared prefix will be served;
    /// otherwise (hybrid layouts, sparse state) only up to a checkpoint of an in-flight prompt
    /// that the request shares up to that position.
    pub fn forecast(&self, prompt: &Prompt<'_>, align: u64, dense: bool) -> Forecast {
        let a = align.max(1);
        let n = prompt.tokens.len();
        let max = prompt_checkpoint(n as u64, a);
        let inner = self.inner.lock();
        if inner.entries.is_empty() {
            return Forecast::default();
        }
        let mut cached = 0;
        let mut take = |anchor: Anchor, from: usize| {
            for c in inner.checkpoints.get(&anchor).into_iter().flatten() {
                let end = from + c.tail.len();
                if c.at <= max && c.at > cached && prompt.tokens.get(from..end) == Some(&*c.tail) {
                    cached = c.at;
                }
            }
        };
        take(None, 0);
        let mut matched = 0;
        for k in prompt.keys.iter() {
            if !inner.prefixes.contains_key(k) {
                break;
            }
            matched += 1;
            take(Some(*k), matched * CHUNK);
        }
        let prefix = ((matched * CHUNK) as u64 / a * a).min(max);
        Forecast {
            cached: if dense { prefix } else { cached },
            prefix: prefix.max(cached),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(t: &[u32]) -> Prompt<'_> {
        Prompt::new(t, &BlockExtras::default())
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
        let id = p.add(&prompt(&seq(0..1000)), [prompt_checkpoint(1000, 64), 0]);
        // A continuation sharing all 1,000 tokens: the checkpoint at 960 will serve it.
        let long = seq(0..1200);
        assert_eq!(
            p.forecast(&prompt(&long), 64, false),
            Forecast {
                cached: 960,
                prefix: 960
            }
        );
        // A branch at 700: the full-attention prefix (640) will be there, the state will not.
        let b = branch_at(700);
        assert_eq!(
            p.forecast(&prompt(&b), 64, false),
            Forecast {
                cached: 0,
                prefix: 640
            }
        );
        p.remove(id);
        assert_eq!(p.forecast(&prompt(&long), 64, false), Forecast::default());
        assert!(p.is_empty());
    }

    #[test]
    fn a_prompt_announced_as_keys_and_tails_forecasts_what_the_prompt_itself_does() {
        for (n, cps) in [
            (1000, [960, 512]),
            (130, [128, 0]),
            (700, [640, 100]),
            (64, [0, 0]),
        ] {
            let tokens = seq(0..n);
            let whole = Pending::default();
            whole.add(&prompt(&tokens), cps);
            let parts = Pending::default();
            let p = prompt(&tokens);
            parts.add_parts(p.keys.clone(), &checkpoint_tails(&p, cps));
            for probe in [seq(0..1200), branch_at(700), branch_at(120), seq(0..n)] {
                for (align, dense) in [(64, false), (16, true), (16, false)] {
                    assert_eq!(
                        whole.forecast(&prompt(&probe), align, dense),
                        parts.forecast(&prompt(&probe), align, dense),
                        "prompt {n}, checkpoints {cps:?}"
                    );
                }
            }
        }
        // A tail that does not end where its anchor says is left out, not filed wrong.
        let p = Pending::default();
        let tokens = seq(0..1000);
        p.add_parts(prompt(&tokens).keys, &[(960, vec![1, 2, 3])]);
        assert_eq!(p.forecast(&prompt(&seq(0..1200)), 64, false).cached, 0);
    }

    #[test]
    fn with_a_single_group_the_whole_shared_prefix_is_forecast() {
        let p = Pending::default();
        p.add(&prompt(&seq(0..1000)), [960, 0]);
        let b = branch_at(700);
        assert_eq!(
            p.forecast(&prompt(&b), 16, true),
            Forecast {
                cached: 640,
                prefix: 640
            }
        );
    }

    #[test]
    fn a_junction_checkpoint_serves_a_branch_at_the_junction() {
        let p = Pending::default();
        p.add(&prompt(&seq(0..1000)), [960, 512]);
        let b = branch_at(700);
        assert_eq!(
            p.forecast(&prompt(&b), 64, false),
            Forecast {
                cached: 512,
                prefix: 640
            }
        );
    }

    #[test]
    fn a_forecast_never_reaches_the_last_prompt_token() {
        let p = Pending::default();
        p.add(&prompt(&seq(0..1000)), [960, 0]);
        assert_eq!(p.forecast(&prompt(&seq(0..961)), 64, false).cached, 960);
        // 960 tokens: at most 896 can be served, and a checkpoint at 960 serves none of them.
        assert_eq!(
            p.forecast(&prompt(&seq(0..960)), 64, false),
            Forecast {
                cached: 0,
                prefix: 896
            }
        );
    }

    #[test]
    fn removing_a_prompt_takes_back_only_its_share() {
        let p = Pending::default();
        let a = p.add(&prompt(&seq(0..1000)), [960, 0]);
        let b = p.add(&prompt(&seq(0..1000)), [960, 0]);
        let other = p.add(&prompt(&branch_at(300)), [256, 0]);
        p.remove(a);
        let long = seq(0..1200);
        assert_eq!(p.forecast(&prompt(&long), 64, false).cached, 960);
        p.remove(b);
        assert_eq!(
            p.forecast(&prompt(&long), 64, false),
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
        p.add(&Prompt::new(&seq(0..1000), &salted), [960, 0]);
        assert_eq!(
            p.forecast(&prompt(&seq(0..1200)), 64, false),
            Forecast::default()
        );
    }

    #[test]
    fn a_checkpoint_inside_a_chunk_serves_a_branch_exactly_at_it() {
        // Alignment 544 (Qwen3-Next): 544 = 8 chunks + 32 tokens.
        let p = Pending::default();
        let first = seq(0..700);
        p.add(&prompt(&first), [prompt_checkpoint(700, 544), 0]);
        // A sibling that shares exactly the first 544 tokens is served from the checkpoint.
        let b = branch_at(544);
        assert_eq!(
            p.forecast(&prompt(&b), 544, false),
            Forecast {
                cached: 544,
                prefix: 544
            }
        );
        // One that branches a token earlier is not.
        let b = branch_at(543);
        assert_eq!(p.forecast(&prompt(&b), 544, false), Forecast::default());
    }

    #[test]
    fn a_checkpoint_before_the_first_whole_chunk_is_kept() {
        let p = Pending::default();
        p.add(&prompt(&seq(0..100)), [48, 0]);
        assert_eq!(
            p.forecast(&prompt(&branch_at(60)), 16, false),
            Forecast {
                cached: 48,
                prefix: 48
            }
        );
    }
}
