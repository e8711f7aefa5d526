//! The load balancer `kvroute bench` puts in front of a target's replicas: which replica each
//! request goes to, decided per request as an L4/L7 balancer does (no session pinning: one
//! conversation's turns go wherever the balancer sends them).
//!
//! Owns: [`Balance`] (the spelling `round-robin | random`) and [`Balancer`] (the per-run state:
//! a counter, or a seeded generator).
//! Invariants: round robin sends the k-th request picked to replica `k mod n`, so over any run
//! every replica serves ⌊m/n⌋ or ⌈m/n⌉ of m requests; random picks uniformly from a generator
//! seeded by the run's seed, so the same seed gives the same sequence of picks; a pick is always
//! `< n` (and 0 for one replica).
//! Must not: look at the request, the session or the replicas' state.

use super::workload::Rng;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// How requests are spread over a target's replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Balance {
    /// Request k (in send order) to replica `k mod n`.
    #[default]
    RoundRobin,
    /// A uniformly random replica per request, from a generator seeded with `--seed`.
    Random,
}

impl Balance {
    pub fn name(self) -> &'static str {
        match self {
            Balance::RoundRobin => "round-robin",
            Balance::Random => "random",
        }
    }
}

impl FromStr for Balance {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" => Ok(Balance::RoundRobin),
            "random" => Ok(Balance::Random),
            other => Err(format!("balance {other:?}: use round-robin or random")),
        }
    }
}

/// One run's balancer over `n` replicas.
pub struct Balancer {
    n: usize,
    kind: Balance,
    next: AtomicUsize,
    rng: Mutex<Rng>,
}

impl Balancer {
    pub fn new(kind: Balance, replicas: usize, seed: u64) -> Balancer {
        Balancer {
            n: replicas.max(1),
            kind,
            next: AtomicUsize::new(0),
            rng: Mutex::new(Rng::new(seed ^ 0x0042_414c_414e_4345)),
        }
    }

    /// The replica the next request goes to.
    pub fn pick(&self) -> usize {
        if self.n == 1 {
            return 0;
        }
        match self.kind {
            Balance::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % self.n,
            Balance::Random => {
                // A poisoned lock only means another pick panicked; its generator is still fine.
                let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
                rng.range(0, self.n - 1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_cycles_through_every_replica_in_turn() {
        let b = Balancer::new(Balance::RoundRobin, 3, 1);
        let picks: Vec<usize> = (0..7).map(|_| b.pick()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
        let one = Balancer::new(Balance::RoundRobin, 1, 1);
        assert!((0..5).all(|_| one.pick() == 0));
    }

    #[test]
    fn random_picks_repeat_for_a_seed_and_reach_every_replica() {
        let picks = |seed| {
            let b = Balancer::new(Balance::Random, 4, seed);
            (0..400).map(|_| b.pick()).collect::<Vec<usize>>()
        };
        assert_eq!(picks(7), picks(7));
        assert_ne!(picks(7), picks(8));
        let p = picks(7);
        assert!((0..4).all(|r| p.iter().filter(|x| **x == r).count() > 50));
        assert!(p.iter().all(|x| *x < 4));
    }

    #[test]
    fn balances_are_spelled_as_the_help_says() {
        assert_eq!("round-robin".parse(), Ok(Balance::RoundRobin));
        assert_eq!("random".parse(), Ok(Balance::Random));
        assert!("sticky".parse::<Balance>().is_err());
        assert_eq!(Balance::default().name(), "round-robin");
    }
}
