//! Follow-ups: how many more requests a request's conversation is expected to bring.
//!
//! Owns: [`FollowUps`], which remembers recent prompts and recognises a request whose prompt
//! extends an earlier one token for token (a chat's next turn, an agent's next step, a branch
//! from the same history), keeps the fraction `p` of requests that are such follow-ups
//! (exponentially weighted, forgotten like the TTFT model), and turns it into the expected number of
//! further requests a conversation brings after this one, `p / (1 − p)` (sessions whose
//! length is geometric with continuation probability `p`). The policy multiplies that by a
//! worker's load delay: a conversation's later turns follow its cache to the worker chosen now.
//! [`reference_is_follow_up`] is the literal model the fast structure must equal.
//! Invariants: a request is a follow-up iff some remembered earlier prompt is a strict prefix
//! of it (property-tested against the reference); memory is bounded ([`CAPACITY`] prompts, the
//! oldest forgotten first); the estimate is 0 until follow-ups are seen and at most
//! [`MAX_FOLLOW_UPS`].
//! Must not: look at workers, the index or the clock; it sees prompts and the times the
//! caller gives.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens per link of the prefix chain the tracker keys prompts by (its own unit, unrelated
/// to any engine's block size).
pub const LINK: usize = 16;
/// Prompts remembered. A follow-up arrives within one conversation's think time, so this
/// covers minutes of traffic at hundreds of requests per second.
pub const CAPACITY: usize = 65_536;
/// Remembered prompts per chain key: a prefix shared by many users (a system prompt ending
/// on a link boundary) keeps only its newest prompts.
const PER_KEY: usize = 32;
/// Weight of the newest request in the follow-up fraction: the same forgetting as the TTFT
/// model (`ttft::FORGET`, a weight that halves after about 350 requests).
const WEIGHT: f64 = 1.0 - super::ttft::FORGET;
/// Upper bound on the expected follow-ups (`p` ≥ 0.94): beyond it the load a worker shows now
/// says nothing about what a conversation's distant turns will meet.
pub const MAX_FOLLOW_UPS: f64 = 16.0;

#[derive(Clone, Copy, Debug)]
struct Remembered {
    len: usize,
    /// Digest of the tokens after the prompt's last full link.
    tail: u64,
    seq: u64,
    /// When it was seen.
    at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    /// Chain digest of a prompt's full links → the prompts ending within the next link.
    by_key: HashMap<u64, VecDeque<Remembered>>,
    /// Insertion order, for forgetting the oldest: (key, seq).
    order: VecDeque<(u64, u64)>,
    seq: u64,
    /// Exponentially weighted sum of follow-up indicators, and of weights (the fraction is
    /// their ratio, so the first requests are not biased towards 0).
    weighted: f64,
    weights: f64,
    requests: u64,
    follow_ups: u64,
}

/// The follow-up tracker, shared by every request of the gateway.
#[derive(Debug, Default)]
pub struct FollowUps {
    inner: Mutex<Inner>,
}

/// Digests of a prompt's prefix chain: `keys[i]` covers the first `i` links.
fn chain(tokens: &[u32]) -> Vec<u64> {
    let links = tokens.len() / LINK;
    let mut keys = Vec::with_capacity(links + 1);
    let mut h = 0x6b76_726f_7574_6531_u64;
    keys.push(h);
    for link in tokens.chunks_exact(LINK) {
        h = xxh3_64_with_seed(&words(link), h);
        keys.push(h);
    }
    keys
}

fn words(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn tail_digest(tokens: &[u32]) -> u64 {
    xxh3_64_with_seed(&words(tokens), tokens.len() as u64)
}

impl FollowUps {
    /// Records a prompt seen at `now`; returns, if it extends remembered earlier prompts, the
    /// time since the longest of them (its conversation's previous turn) was seen.
    pub fn observe(&self, tokens: &[u32], now: Instant) -> Option<Duration> {
        let keys = chain(tokens);
        let mut g = self.inner.lock();
        let previous = longest_earlier(&g.by_key, &keys, tokens);
        let follow_up = previous.is_some();
        g.requests += 1;
        g.follow_ups += u64::from(follow_up);
        let x = if follow_up { 1.0 } else { 0.0 };
        g.weighted = g.weighted * (1.0 - WEIGHT) + x;
        g.weights = g.weights * (1.0 - WEIGHT) + 1.0;
        let links = tokens.len() / LINK;
        let key = keys[links];
        let seq = g.seq;
        g.seq += 1;
        let entry = Remembered {
            len: tokens.len(),
            tail: tail_digest(&tokens[links * LINK..]),
            seq,
            at: now,
        };
        let bucket = g.by_key.entry(key).or_default();
        bucket.push_back(entry);
        if bucket.len() > PER_KEY {
            bucket.pop_front();
        }
        g.order.push_back((key, seq));
        while g.order.len() > CAPACITY {
            let Some((k, s)) = g.order.pop_front() else {
                break;
            };
            if let Some(b) = g.by_key.get_mut(&k) {
                b.retain(|r| r.seq != s);
                if b.is_empty() {
                    g.by_key.remove(&k);
                }
            }
        }
        previous.map(|at| now.saturating_duration_since(at))
    }

    /// Whether `tokens` extends a remembered earlier prompt, without recording it.
    pub fn extends_earlier(&self, tokens: &[u32]) -> bool {
        let keys = chain(tokens);
        longest_earlier(&self.inner.lock().by_key, &keys, tokens).is_some()
    }

    /// The fraction of recent requests that were follow-ups.
    pub fn fraction(&self) -> f64 {
        let g = self.inner.lock();
        if g.weights > 0.0 {
            g.weighted / g.weights
        } else {
            0.0
        }
    }

    /// Further requests a conversation is expected to bring after this one.
    pub fn expected(&self) -> f64 {
        expected_follow_ups(self.fraction())
    }

    /// (requests seen, follow-ups among them).
    pub fn counts(&self) -> (u64, u64) {
        let g = self.inner.lock();
        (g.requests, g.follow_ups)
    }
}

/// `p / (1 − p)`, bounded by [`MAX_FOLLOW_UPS`].
pub fn expected_follow_ups(p: f64) -> f64 {
    if !p.is_finite() || p <= 0.0 {
        return 0.0;
    }
    if p >= 1.0 {
        return MAX_FOLLOW_UPS;
    }
    (p / (1.0 - p)).min(MAX_FOLLOW_UPS)
}

/// When the longest remembered strict prefix of `tokens` was seen (the latest of equals).
fn longest_earlier(
    by_key: &HashMap<u64, VecDeque<Remembered>>,
    keys: &[u64],
    tokens: &[u32],
) -> Option<Instant> {
    // An earlier prompt of `len` tokens is a strict prefix iff its full links match this
    // prompt's first links (the chain key) and its tail matches the tokens after them.
    let mut best: Option<(usize, Instant)> = None;
    for (links, key) in keys.iter().enumerate() {
        let Some(bucket) = by_key.get(key) else {
            continue;
        };
        let start = links * LINK;
        for r in bucket {
            if r.len < tokens.len()
                && r.len / LINK == links
                && r.tail == tail_digest(&tokens[start..r.len])
                && best.is_none_or(|(len, at)| (r.len, r.at) > (len, at))
            {
                best = Some((r.len, r.at));
            }
        }
    }
    best.map(|(_, at)| at)
}

/// The literal model: `tokens` is a follow-up iff one of the `earlier` prompts is a strict
/// prefix of it.
pub fn reference_is_follow_up(earlier: &[Vec<u32>], tokens: &[u32]) -> bool {
    earlier
        .iter()
        .any(|e| e.len() < tokens.len() && tokens.starts_with(e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_chats_next_turn_is_a_follow_up_and_a_new_user_is_not() {
        let f = FollowUps::default();
        let system: Vec<u32> = (0..100).collect();
        let mut turn1 = system.clone();
        turn1.extend([500, 501, 502]);
        let now = Instant::now();
        assert!(f.observe(&turn1, now).is_none());
        let mut turn2 = turn1.clone();
        turn2.extend([900, 901]);
        assert!(f.observe(&turn2, now).is_some());
        // Another user after the same system prompt extends no earlier prompt.
        let mut other = system.clone();
        other.extend([600, 601, 602, 603]);
        assert!(f.observe(&other, now).is_none());
        // The same prompt again is not a follow-up of itself.
        assert!(f.observe(&other, now).is_none());
        let mut turn3 = turn2.clone();
        turn3.push(1);
        assert!(f.extends_earlier(&turn3));
        assert!(!f.extends_earlier(&[42; 30]));
        assert_eq!(f.counts(), (4, 1));
    }

    #[test]
    fn a_follow_up_is_timed_from_its_conversations_previous_turn() {
        let f = FollowUps::default();
        let t0 = Instant::now();
        let turn1: Vec<u32> = (0..40).collect();
        let turn2: Vec<u32> = (0..70).collect();
        let turn3: Vec<u32> = (0..90).collect();
        assert_eq!(f.observe(&turn1, t0), None);
        let gap = f.observe(&turn2, t0 + Duration::from_millis(300));
        assert_eq!(gap, Some(Duration::from_millis(300)));
        // Both earlier turns are prefixes of the third; the gap is from the second.
        let gap = f.observe(&turn3, t0 + Duration::from_millis(1000));
        assert_eq!(gap, Some(Duration::from_millis(700)));
    }

    #[test]
    fn the_expected_follow_ups_follow_the_fraction_of_follow_ups() {
        let f = FollowUps::default();
        assert_eq!(f.expected(), 0.0);
        // Conversations of 4 turns: 3 of every 4 requests are follow-ups.
        let mut next = 10_000u32;
        for _ in 0..2_000 {
            let mut p: Vec<u32> = (next..next + 40).collect();
            next += 40;
            f.observe(&p, Instant::now());
            for _ in 0..3 {
                p.extend(next..next + 20);
                next += 20;
                f.observe(&p, Instant::now());
            }
        }
        let p = f.fraction();
        assert!((p - 0.75).abs() < 0.05, "fraction {p}");
        assert!(
            (f.expected() - 3.0).abs() < 0.8,
            "expected {}",
            f.expected()
        );
    }

    #[test]
    fn the_estimate_is_bounded() {
        assert_eq!(expected_follow_ups(0.0), 0.0);
        assert_eq!(expected_follow_ups(0.5), 1.0);
        assert_eq!(expected_follow_ups(0.999), MAX_FOLLOW_UPS);
        assert_eq!(expected_follow_ups(1.0), MAX_FOLLOW_UPS);
        assert_eq!(expected_follow_ups(f64::NAN), 0.0);
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_prompt_is_forgotten_first() {
        let f = FollowUps::default();
        let first: Vec<u32> = (1..=20).collect();
        f.observe(&first, Instant::now());
        let second: Vec<u32> = (101..=120).collect();
        f.observe(&second, Instant::now());
        // Prompts with distinct first links: one key each.
        for i in 0..CAPACITY as u32 - 1 {
            let mut p = vec![7_000_000 + i];
            p.extend([0; LINK]);
            f.observe(&p, Instant::now());
        }
        assert!(
            !f.extends_earlier(&[first.as_slice(), &[4]].concat()),
            "forgotten"
        );
        assert!(
            f.extends_earlier(&[second.as_slice(), &[4]].concat()),
            "still held"
        );
        let g = f.inner.lock();
        assert_eq!(g.order.len(), CAPACITY);
        let held: usize = g.by_key.values().map(VecDeque::len).sum();
        assert_eq!(held, CAPACITY);
    }

    fn prompts() -> impl Strategy<Value = Vec<Vec<u32>>> {
        // Few distinct tokens and lengths around the link size, so prefixes, shared links and
        // tails shorter than a link all occur.
        let stem = proptest::collection::vec(0u32..3, 0..40);
        proptest::collection::vec((0usize..6, stem), 1..30).prop_map(|rows| {
            let mut out: Vec<Vec<u32>> = Vec::new();
            for (parent, stem) in rows {
                let mut p = match out.get(parent % (out.len().max(1))) {
                    Some(base) if parent < 4 => base.clone(),
                    _ => Vec::new(),
                };
                p.extend(stem);
                out.push(p);
            }
            out
        })
    }

    proptest! {
        #[test]
        fn the_tracker_agrees_with_the_literal_prefix_check(seq in prompts()) {
            let f = FollowUps::default();
            for (i, p) in seq.iter().enumerate() {
                let want = reference_is_follow_up(&seq[..i], p);
                prop_assert_eq!(f.observe(p, Instant::now()).is_some(), want, "prompt {} of {:?}", i, seq);
            }
        }
    }
}
