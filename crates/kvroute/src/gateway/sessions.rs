//! Follow-ups: how many more requests a request's conversation is expected to bring.
//!
//! Owns: [`FollowUpTracker`], a plain estimator that remembers recent prompts and recognises a
//! request whose prompt extends an earlier one token for token (a chat's next turn, an agent's
//! next step, a branch from the same history), and keeps the fraction `p` of requests that are
//! such follow-ups (exponentially weighted, forgotten like the TTFT model); shared as
//! [`FollowUps`], which hashes a prompt's prefix chain ([`Chain`]) before it locks; a prompt's
//! [`Mark`] (what the tracker remembers it by) lets a peer replica remember it without its
//! tokens. The routing core turns `p` into the expected number of further requests a
//! conversation brings after this one ([`expected_follow_ups`], re-exported from
//! `kvroute_route::terms`), and the policy multiplies that by a worker's load delay: a
//! conversation's later turns follow its cache to the worker chosen now.
//! [`reference_is_follow_up`] is the literal model the fast structure must equal.
//! Invariants: a request is a follow-up iff some remembered earlier prompt is a strict prefix
//! of it (property-tested against the reference); memory is bounded ([`CAPACITY`] prompts, the
//! oldest forgotten first); the estimate is 0 until follow-ups are seen and at most
//! [`MAX_FOLLOW_UPS`]; the wrapper holds no logic beyond hashing outside its lock.
//! Must not: look at workers, the index or the clock; it sees prompts and the times the
//! caller gives.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use kvroute_route::terms::{expected_follow_ups, MAX_FOLLOW_UPS};

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

#[derive(Clone, Copy, Debug)]
struct Remembered {
    len: usize,
    /// Digest of the tokens after the prompt's last full link.
    tail: u64,
    seq: u64,
    /// When it was seen.
    at: Instant,
}

/// The follow-up tracker as a plain estimator: the prompts remembered and the fraction of
/// follow-ups ([`FollowUps`] shares one between every request of the gateway).
#[derive(Debug, Default)]
pub struct FollowUpTracker {
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

/// A prompt's prefix chain: digest `i` covers its first `i` links (what the tracker keys
/// prompts by), computed without the tracker so callers can hash outside a lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain(Vec<u64>);

impl Chain {
    pub fn of(tokens: &[u32]) -> Chain {
        let links = tokens.len() / LINK;
        let mut keys = Vec::with_capacity(links + 1);
        let mut h = 0x6b76_726f_7574_6531_u64;
        keys.push(h);
        for link in tokens.chunks_exact(LINK) {
            h = digest(link, h);
            keys.push(h);
        }
        Chain(keys)
    }
}

/// A prompt as the tracker remembers it: the chain digest of its full links, its length and
/// the digest of its tail. Enough for another replica to recognise the prompt's follow-ups
/// without its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mark {
    pub key: u64,
    pub len: usize,
    pub tail: u64,
}

impl Mark {
    /// The mark of `tokens`, whose chain is `chain` (`None` when `chain` is another prompt's
    /// and too short for it).
    pub fn of(chain: &Chain, tokens: &[u32]) -> Option<Mark> {
        let links = tokens.len() / LINK;
        let key = *chain.0.get(links)?;
        Some(Mark {
            key,
            len: tokens.len(),
            tail: tail_digest(&tokens[links * LINK..]),
        })
    }
}

/// The xxh3 of at most [`LINK`] tokens' little-endian bytes with `seed`, written out on the
/// stack (a link or a tail: every digest the tracker takes).
fn digest(tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = [0u8; LINK * 4];
    let n = tokens.len().min(LINK);
    for (b, t) in bytes.chunks_exact_mut(4).zip(&tokens[..n]) {
        b.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes[..n * 4], seed)
}

/// The digest of the tokens after a prompt's last full link (fewer than [`LINK`]).
fn tail_digest(tokens: &[u32]) -> u64 {
    digest(tokens, tokens.len() as u64)
}

impl FollowUpTracker {
    /// Records a prompt seen at `now`; returns, if it extends remembered earlier prompts, the
    /// time since the longest of them (its conversation's previous turn) was seen.
    pub fn observe(&mut self, tokens: &[u32], now: Instant) -> Option<Duration> {
        self.observe_chain(&Chain::of(tokens), tokens, now)
    }

    /// [`FollowUpTracker::observe`] with the prompt's chain already hashed (`chain` must be
    /// `Chain::of(tokens)`).
    pub fn observe_chain(
        &mut self,
        chain: &Chain,
        tokens: &[u32],
        now: Instant,
    ) -> Option<Duration> {
        self.observe_marked(chain, tokens, now).0
    }

    /// [`FollowUpTracker::observe_chain`], also returning the prompt's [`Mark`] (what another
    /// replica remembers it by; `None` for a chain of another prompt).
    pub fn observe_marked(
        &mut self,
        chain: &Chain,
        tokens: &[u32],
        now: Instant,
    ) -> (Option<Duration>, Option<Mark>) {
        let previous = longest_earlier(&self.by_key, &chain.0, tokens);
        let mark = Mark::of(chain, tokens);
        self.remember(mark, previous.is_some(), now);
        (previous.map(|at| now.saturating_duration_since(at)), mark)
    }

    /// Counts a request another replica saw (`follow_up`: what it found) and remembers its
    /// prompt by `mark` as seen at `now`, as if it had come here.
    pub fn remember(&mut self, mark: Option<Mark>, follow_up: bool, now: Instant) {
        self.count(follow_up);
        let Some(mark) = mark else {
            return;
        };
        let seq = self.seq;
        self.seq += 1;
        let entry = Remembered {
            len: mark.len,
            tail: mark.tail,
            seq,
            at: now,
        };
        let bucket = self.by_key.entry(mark.key).or_default();
        bucket.push_back(entry);
        if bucket.len() > PER_KEY {
            bucket.pop_front();
        }
        self.order.push_back((mark.key, seq));
        self.forget_beyond_capacity();
    }

    /// Counts one request, a follow-up or not, in the totals and the weighted fraction.
    fn count(&mut self, follow_up: bool) {
        self.requests += 1;
        self.follow_ups += u64::from(follow_up);
        let x = if follow_up { 1.0 } else { 0.0 };
        self.weighted = self.weighted * (1.0 - WEIGHT) + x;
        self.weights = self.weights * (1.0 - WEIGHT) + 1.0;
    }

    /// Forgets the oldest prompts until at most [`CAPACITY`] are remembered.
    fn forget_beyond_capacity(&mut self) {
        while self.order.len() > CAPACITY {
            let Some((k, s)) = self.order.pop_front() else {
                break;
            };
            if let Some(b) = self.by_key.get_mut(&k) {
                b.retain(|r| r.seq != s);
                if b.is_empty() {
                    self.by_key.remove(&k);
                }
            }
        }
    }

    /// Whether `tokens` extends a remembered earlier prompt, without recording it.
    pub fn extends_earlier(&self, tokens: &[u32]) -> bool {
        self.extends_earlier_chain(&Chain::of(tokens), tokens)
    }

    /// [`FollowUpTracker::extends_earlier`] with the prompt's chain already hashed.
    pub fn extends_earlier_chain(&self, chain: &Chain, tokens: &[u32]) -> bool {
        longest_earlier(&self.by_key, &chain.0, tokens).is_some()
    }

    /// The fraction of recent requests that were follow-ups (0 before any request).
    pub fn fraction(&self) -> f64 {
        if self.weights > 0.0 {
            self.weighted / self.weights
        } else {
            0.0
        }
    }

    /// Further requests a conversation is expected to bring after this one
    /// ([`expected_follow_ups`] of the fraction).
    pub fn expected(&self) -> f64 {
        expected_follow_ups(self.fraction())
    }

    /// (requests seen, follow-ups among them).
    pub fn counts(&self) -> (u64, u64) {
        (self.requests, self.follow_ups)
    }
}

/// The [`FollowUpTracker`] shared by every request of the gateway; a prompt's chain is hashed
/// before the lock is taken.
#[derive(Debug, Default)]
pub struct FollowUps {
    inner: Mutex<FollowUpTracker>,
}

impl FollowUps {
    /// [`FollowUpTracker::observe`].
    pub fn observe(&self, tokens: &[u32], now: Instant) -> Option<Duration> {
        let chain = Chain::of(tokens);
        self.inner.lock().observe_chain(&chain, tokens, now)
    }

    /// [`FollowUpTracker::observe_marked`].
    pub fn observe_marked(&self, tokens: &[u32], now: Instant) -> (Option<Duration>, Option<Mark>) {
        let chain = Chain::of(tokens);
        self.inner.lock().observe_marked(&chain, tokens, now)
    }

    /// [`FollowUpTracker::remember`].
    pub fn remember(&self, mark: Option<Mark>, follow_up: bool, now: Instant) {
        self.inner.lock().remember(mark, follow_up, now);
    }

    /// [`FollowUpTracker::extends_earlier`].
    pub fn extends_earlier(&self, tokens: &[u32]) -> bool {
        let chain = Chain::of(tokens);
        self.inner.lock().extends_earlier_chain(&chain, tokens)
    }

    /// [`FollowUpTracker::fraction`].
    pub fn fraction(&self) -> f64 {
        self.inner.lock().fraction()
    }

    /// [`FollowUpTracker::expected`].
    pub fn expected(&self) -> f64 {
        self.inner.lock().expected()
    }

    /// [`FollowUpTracker::counts`].
    pub fn counts(&self) -> (u64, u64) {
        self.inner.lock().counts()
    }
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
        let mut f = FollowUpTracker::default();
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
        let mut f = FollowUpTracker::default();
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
        let mut f = FollowUpTracker::default();
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
        let mut f = FollowUpTracker::default();
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
        assert_eq!(f.order.len(), CAPACITY);
        let held: usize = f.by_key.values().map(VecDeque::len).sum();
        assert_eq!(held, CAPACITY);
    }

    #[test]
    fn the_fraction_weighs_the_newest_requests_most_and_starts_unbiased() {
        let mut f = FollowUpTracker::default();
        assert_eq!(f.fraction(), 0.0, "no request, no follow-up");
        let t0 = Instant::now();
        let first: Vec<u32> = (0..20).collect();
        f.observe(&first, t0);
        assert_eq!(f.fraction(), 0.0);
        f.observe(&[first.as_slice(), &[7]].concat(), t0);
        // Two requests, one a follow-up: the ratio of weighted sums, not a mean started at 0.
        let want = 1.0 / (1.0 + (1.0 - WEIGHT));
        assert!((f.fraction() - want).abs() < 1e-12, "{}", f.fraction());
        assert_eq!(f.counts(), (2, 1));
    }

    #[test]
    fn a_shared_prefix_keeps_only_its_newest_prompts() {
        let mut f = FollowUpTracker::default();
        let t0 = Instant::now();
        // PER_KEY + 1 prompts ending within the same link after the same 16 tokens.
        let stem: Vec<u32> = (0..LINK as u32).collect();
        let prompts: Vec<Vec<u32>> = (0..=PER_KEY as u32)
            .map(|i| [stem.as_slice(), &[1_000 + i]].concat())
            .collect();
        for p in &prompts {
            f.observe(p, t0);
        }
        let extend = |p: &Vec<u32>| [p.as_slice(), &[5]].concat();
        assert!(!f.extends_earlier(&extend(&prompts[0])), "the oldest went");
        assert!(f.extends_earlier(&extend(&prompts[1])));
        assert!(f.extends_earlier(&extend(&prompts[PER_KEY])));
    }

    #[test]
    fn the_shared_tracker_is_the_plain_one_behind_a_lock() {
        let (shared, mut plain) = (FollowUps::default(), FollowUpTracker::default());
        let t0 = Instant::now();
        let mut p: Vec<u32> = (0..50).collect();
        for i in 0..20u64 {
            let now = t0 + Duration::from_millis(100 * i);
            assert_eq!(shared.observe(&p, now), plain.observe(&p, now));
            p.extend([i as u32; 7]);
        }
        assert_eq!(shared.extends_earlier(&p), plain.extends_earlier(&p));
        assert_eq!(shared.counts(), plain.counts());
        assert_eq!(shared.fraction(), plain.fraction());
        assert_eq!(shared.expected(), plain.expected());
    }

    #[test]
    fn a_link_is_digested_as_its_little_endian_bytes() {
        let link: Vec<u32> = (0..LINK as u32).map(|t| t * 0x0101_0101 + 7).collect();
        let bytes: Vec<u8> = link.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(digest(&link, 42), xxh3_64_with_seed(&bytes, 42));
        assert_eq!(tail_digest(&link[..5]), xxh3_64_with_seed(&bytes[..20], 5));
        assert_eq!(tail_digest(&[]), xxh3_64_with_seed(&[], 0));
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
            let mut f = FollowUpTracker::default();
            for (i, p) in seq.iter().enumerate() {
                let want = reference_is_follow_up(&seq[..i], p);
                prop_assert_eq!(f.observe(p, Instant::now()).is_some(), want, "prompt {} of {:?}", i, seq);
            }
        }
    }
}
