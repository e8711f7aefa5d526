//! The data every workload is made of: sessions of turns with their arrival times, the seeded
//! generator the built-in workloads draw from, and the target's shape they must fit.
//!
//! Owns: [`Turn`], [`Session`], [`Workload`] (with its truncation and rate rescaling), [`Rng`]
//! (splitmix64) and [`Shape`].
//! Invariants: the same seed gives the same draws everywhere; every word drawn is a word id of
//! the simulator's tokenizer (`FIRST_WORD ≤ id < vocab`); rescaling keeps the order of
//! arrivals and scales think times with them.
//! Must not: know any generator (they import this, never the other way round).

use kvroute_sim::tokens::FIRST_WORD;

/// One user turn of a session.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// The new user text (token ids) appended after the history.
    pub user: Vec<u32>,
    pub max_tokens: u32,
    /// Wall milliseconds (before `--speedup`) between the previous reply and this turn.
    pub think_ms: f64,
    /// Alternative continuations sent at the same time as this turn from the same history
    /// (an agent trying several tool calls); their replies are not carried on.
    pub branches: Vec<Vec<u32>>,
}

/// A conversation: its first turn arrives at `start_ms`, each later one after the previous
/// reply.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub start_ms: f64,
    /// The system prompt (token ids; the chat API sends it as a system message).
    pub system: Vec<u32>,
    pub turns: Vec<Turn>,
}

#[derive(Clone, Debug)]
pub struct Workload {
    pub name: String,
    pub sessions: Vec<Session>,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.sessions
            .iter()
            .flat_map(|s| &s.turns)
            .map(|t| 1 + t.branches.len())
            .sum()
    }

    /// Keeps the sessions that can still send: those starting before `before_ms`, and, in
    /// start order, only as many as are needed for `max_requests` requests.
    pub fn truncate(&mut self, max_requests: Option<usize>, before_ms: Option<f64>) {
        self.sessions
            .sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        if let Some(t) = before_ms {
            self.sessions.retain(|s| s.start_ms < t);
        }
        if let Some(max) = max_requests {
            let mut n = 0;
            let keep = self
                .sessions
                .iter()
                .take_while(|s| {
                    let more = n < max;
                    n += s.turns.iter().map(|t| 1 + t.branches.len()).sum::<usize>();
                    more
                })
                .count();
            self.sessions.truncate(keep);
        }
    }

    /// Arrival times scaled so sessions start at `rate` per second on average.
    pub fn rescale_to_rate(&mut self, rate: f64) {
        let n = self.sessions.len();
        let span = self.sessions.iter().map(|s| s.start_ms).fold(0.0, f64::max);
        if n < 2 || span <= 0.0 || rate.is_nan() || rate <= 0.0 {
            return;
        }
        let want_ms = (n - 1) as f64 / rate * 1000.0;
        let k = want_ms / span;
        for s in &mut self.sessions {
            s.start_ms *= k;
            for t in &mut s.turns {
                t.think_ms *= k;
            }
        }
    }
}

/// A small seeded generator (splitmix64): the same seed, the same workload everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6a09_e667_f3bc_c909)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// An exponential gap with the given mean (Poisson arrivals).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// `n` word tokens.
    pub fn words(&mut self, n: usize, vocab: u32) -> Vec<u32> {
        let space = u64::from(vocab.saturating_sub(FIRST_WORD).max(1));
        (0..n)
            .map(|_| FIRST_WORD + (self.next_u64() % space) as u32)
            .collect()
    }
}

/// What every generator needs to know about the target.
#[derive(Clone, Debug)]
pub struct Shape {
    pub vocab: u32,
    /// The longest prompt a request may carry (the model's length minus the output).
    pub max_prompt: usize,
    pub max_output: u32,
    pub seed: u64,
}
