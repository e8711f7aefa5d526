//! The `tenants` generator: a multi-tenant service where every tenant has its own long system
//! prompt, a few tenants send most of the traffic and the load climbs over the run — the
//! working set of all tenants' prompts overflows a small fleet's cache, so which replica and
//! worker a tenant lands on decides what is reused.
//!
//! Owns: [`Tenants`] (its knobs), [`tenant_prompts`] (every tenant's system prompt, by
//! popularity rank) and [`tenants`] (the single-turn requests: a tenant drawn by Zipf
//! popularity, its system prompt, then a short user part of its own).
//! Invariants: the same shape and seed give the same workload, and the tenants' prompts do not
//! depend on how many requests are drawn; tenant `k` (0-based) is drawn with probability
//! ∝ (k + 1)^−`zipf`; a request's prompt is exactly its tenant's system prompt followed by
//! fresh words; arrivals are a Poisson process whose rate rises linearly from (1 − `rise`)× to
//! (1 + `rise`)× its mean of one request per second (before `--rate`/`--speedup` rescale it);
//! every prompt fits `max_prompt`.
//! Must not: share a user part between requests, or let one tenant's prompt prefix another's.

use super::sessions::{Rng, Session, Shape, Turn, Workload};

/// The knobs of the `tenants` generator.
#[derive(Clone, Debug)]
pub struct Tenants {
    pub tenants: usize,
    pub requests: usize,
    /// Mean system prompt length; each tenant's is within ±1/8 of it.
    pub system: usize,
    /// The user part's length range (tokens).
    pub min_user: usize,
    pub max_user: usize,
    /// The Zipf exponent of tenant popularity.
    pub zipf: f64,
    /// The arrival rate goes from (1 − rise)× to (1 + rise)× its mean over the run (0 ≤ rise < 1).
    pub rise: f64,
}

impl Default for Tenants {
    fn default() -> Self {
        Tenants {
            tenants: 160,
            requests: 1000,
            system: 3072,
            min_user: 100,
            max_user: 300,
            zipf: 1.1,
            rise: 0.5,
        }
    }
}

/// Every tenant's system prompt, the most popular first: random words, ±1/8 around
/// `t.system`, short enough that the longest user part and the reply still fit.
pub fn tenant_prompts(t: &Tenants, s: &Shape) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(s.seed ^ 0x5445_4e41_4e54);
    let room = s
        .max_prompt
        .saturating_sub(t.max_user + s.max_output as usize)
        .max(1);
    (0..t.tenants.max(1))
        .map(|_| {
            let n = rng.range(t.system - t.system / 8, t.system + t.system / 8);
            rng.words(n.clamp(1, room), s.vocab)
        })
        .collect()
}

/// The cumulative Zipf weights of `n` ranks.
fn zipf_cdf(n: usize, exponent: f64) -> Vec<f64> {
    let mut total = 0.0;
    (1..=n)
        .map(|k| {
            total += (k as f64).powf(-exponent);
            total
        })
        .collect()
}

/// The arrival time (ms) at which a linearly rising rate, from `1 − rise` to `1 + rise`
/// requests per second over `span_s` seconds, has produced `e` expected arrivals.
fn rising_time_ms(e: f64, span_s: f64, rise: f64) -> f64 {
    let rise = rise.clamp(0.0, 0.999);
    let (a, b) = (1.0 - rise, 2.0 * rise / span_s.max(1e-9));
    // Λ(t) = a·t + b·t²/2 = e.
    let t = if b <= 0.0 {
        e / a
    } else {
        (-a + (a * a + 2.0 * b * e).sqrt()) / b
    };
    t * 1000.0
}

pub fn tenants(t: &Tenants, s: &Shape) -> Workload {
    let prompts = tenant_prompts(t, s);
    let cdf = zipf_cdf(prompts.len(), t.zipf);
    let total = cdf.last().copied().unwrap_or(1.0);
    let mut rng = Rng::new(s.seed ^ 0x5a49_5046);
    let n = t.requests.max(1);
    let mut expected = 0.0;
    let sessions = (0..n)
        .map(|_| {
            expected += rng.exp(1.0);
            let u = rng.unit() * total;
            let k = cdf.partition_point(|c| *c <= u).min(prompts.len() - 1);
            let system = prompts[k].clone();
            let room = s.max_prompt.saturating_sub(system.len()).max(1);
            let user_len = rng.range(t.min_user.max(1), t.max_user.max(t.min_user.max(1)));
            Session {
                start_ms: rising_time_ms(expected, n as f64, t.rise),
                system,
                turns: vec![Turn {
                    user: rng.words(user_len.min(room), s.vocab),
                    max_tokens: s.max_output,
                    think_ms: 0.0,
                    branches: Vec::new(),
                }],
            }
        })
        .collect();
    Workload {
        name: "tenants".into(),
        sessions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn shape(seed: u64) -> Shape {
        Shape {
            vocab: 32_000,
            max_prompt: 8000,
            max_output: 16,
            seed,
        }
    }

    /// Requests per tenant rank, the most popular first.
    fn counts(t: &Tenants, w: &Workload, s: &Shape) -> Vec<usize> {
        let rank: HashMap<Vec<u32>, usize> = tenant_prompts(t, s)
            .into_iter()
            .enumerate()
            .map(|(k, p)| (p, k))
            .collect();
        let mut c = vec![0; t.tenants];
        for sess in &w.sessions {
            c[rank[&sess.system]] += 1;
        }
        c
    }

    #[test]
    fn the_same_seed_gives_the_same_tenants_and_another_seed_does_not() {
        let t = Tenants::default();
        assert_eq!(
            tenants(&t, &shape(3)).sessions,
            tenants(&t, &shape(3)).sessions
        );
        assert_ne!(
            tenants(&t, &shape(3)).sessions,
            tenants(&t, &shape(4)).sessions
        );
        // A longer run draws from the same tenants.
        let more = Tenants {
            requests: 3000,
            ..Tenants::default()
        };
        assert_eq!(
            tenant_prompts(&t, &shape(3)),
            tenant_prompts(&more, &shape(3))
        );
    }

    #[test]
    fn the_most_popular_tenant_sends_many_times_what_the_median_one_sends() {
        let (t, s) = (Tenants::default(), shape(5));
        let mut c = counts(&t, &tenants(&t, &s), &s);
        let top = c[0];
        assert_eq!(top, *c.iter().max().unwrap(), "rank 0 is the most popular");
        c.sort_unstable();
        let median = c[c.len() / 2];
        assert!(
            top > 10 * median.max(1),
            "top tenant {top} requests, median {median}"
        );
        // Zipf 1.1 over 160 tenants gives the first about 22 % of the traffic.
        assert!((150..300).contains(&top), "top tenant {top} of 1000");
    }

    #[test]
    fn arrivals_are_denser_in_the_second_half_of_the_run() {
        let w = tenants(&Tenants::default(), &shape(6));
        assert!(w
            .sessions
            .windows(2)
            .all(|p| p[0].start_ms <= p[1].start_ms));
        let end = w.sessions.last().unwrap().start_ms;
        let first = w.sessions.iter().filter(|s| s.start_ms < end / 2.0).count();
        let second = w.sessions.len() - first;
        // A rate rising from 0.5× to 1.5× puts 3/8 of the arrivals in the first half.
        assert!(
            second as f64 > 1.3 * first as f64,
            "{first} then {second} arrivals"
        );
        // The mean rate is one request per second before rescaling.
        let mean_gap_s = end / 1000.0 / (w.sessions.len() - 1) as f64;
        assert!((0.85..1.15).contains(&mean_gap_s), "{mean_gap_s}");
    }

    #[test]
    fn every_prompt_is_its_tenants_system_prompt_then_a_short_user_part_of_its_own() {
        let (t, s) = (Tenants::default(), shape(7));
        let prompts = tenant_prompts(&t, &s);
        let w = tenants(&t, &s);
        let mut users = std::collections::HashSet::new();
        for sess in &w.sessions {
            assert!(prompts.contains(&sess.system));
            let [turn] = sess.turns.as_slice() else {
                panic!("one request per session")
            };
            assert!((100..=300).contains(&turn.user.len()));
            assert!(users.insert(turn.user.clone()), "a user part repeats");
            assert!(sess.system.len() + turn.user.len() + 16 <= s.max_prompt);
        }
        // No tenant's prompt begins like another's: they share no first block.
        let mut heads: Vec<&[u32]> = prompts.iter().map(|p| &p[..16]).collect();
        heads.sort();
        heads.dedup();
        assert_eq!(heads.len(), t.tenants);
        // ~3k tokens each, together far more than a small fleet holds (4 × 120 blocks of 544).
        assert!(prompts.iter().all(|p| (2688..=3456).contains(&p.len())));
        let all: usize = prompts.iter().map(Vec::len).sum();
        assert!(all > 4 * 120 * 544, "{all} tokens of system prompts");
    }
}
