//! The simulated engine's CPU tier ([`Tier`]: by the connector that keeps it), and the tier
//! vLLM's `OffloadingConnector` keeps (the backend `--kv-offloading-size` selects; one chunk =
//! one GPU block, its default); `simple_offload` has the `SimpleCPUOffloadConnector`'s.
//!
//! Owns: the tier's slots (one per (chunk key, group)), their LRU order, what a request offers
//! to store as its prefill computes it, the tier's hit for a request (the connector's rule,
//! the simulator's own `vllm_rules::offloading_lookup`) and the events the tier publishes: one `BlockStored`
//! per chunk (`medium = "CPU"`, the group, the key's hash alone, `block_size = 0`, no tokens or
//! parent) and one `BlockRemoved` per evicted chunk.
//! Invariants: at most `capacity` slots are held; a store never evicts a key of the same offer;
//! a request's chunks are ordered head-last in the LRU (its tail is evicted before its head);
//! only prompt tokens are offered; a Mamba group offers the state at the end of a step only
//! when that end is on a chunk boundary (align mode keeps no other), every other group every
//! chunk its prefill completed.
//! Must not: publish anything on a reset (the connector does not), or know about requests
//! beyond the hashes and lengths it is handed.

use crate::cache::KvCache;
use crate::engine::EngineConfig;
use crate::error::SimError;
use crate::pool::BlockId;
use crate::simple_offload::SimpleCpuTier;
use crate::spec::ModelSpec;
use crate::vllm_rules::{offloading_lookup, ChunkGroup, SpecRules};
use kvroute_index::tier::OffloadConnector;
use kvroute_index::{EngineHash, Event, Removed, Stored, WorkerId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The medium the tier's events name.
pub const MEDIUM: &str = "CPU";

/// A slot's key: (the chunk's last hash-block hash, the group).
type Key = (u64, u32);

pub struct CpuTier {
    capacity: usize,
    groups: Vec<ChunkGroup>,
    /// Key → its recency tick; `lru` orders the ticks.
    held: HashMap<Key, u64>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
    events: Vec<Event>,
    worker: WorkerId,
    dp_rank: u32,
}

impl CpuTier {
    /// A tier of `capacity` (chunk, group) slots for a model whose requests hash blocks of
    /// `hash_block` tokens.
    pub fn new(
        capacity: usize,
        spec: &ModelSpec,
        hash_block: u32,
        worker: WorkerId,
        dp_rank: u32,
    ) -> CpuTier {
        let groups = spec
            .groups
            .iter()
            .enumerate()
            .filter_map(|(i, g)| ChunkGroup::new(i as u32, g.kind, g.block_size, 1, hash_block))
            .collect();
        CpuTier {
            capacity,
            groups,
            held: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            events: Vec::new(),
            worker,
            dp_rank,
        }
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn contains(&self, group: u32, hash: u64) -> bool {
        self.held.contains_key(&(hash, group))
    }

    /// The tokens beyond the device hit `local` the tier serves a request of `n` tokens.
    pub fn hit(&self, n: usize, local: usize, hashes: &[u64]) -> usize {
        if self.held.is_empty() {
            return 0;
        }
        offloading_lookup(n, local, hashes, &self.groups, |g, h| self.contains(g, h))
    }

    /// A request's prefill went from `from` to `to` computed tokens of its `prompt_len`-token
    /// prompt: its completed chunks are stored (or refreshed), head last in the LRU.
    pub fn offer(&mut self, hashes: &[u64], prompt_len: usize, from: usize, to: usize) {
        let to = to.min(prompt_len);
        if to <= from || self.capacity == 0 {
            return;
        }
        let mut keys: Vec<(usize, Key)> = Vec::new();
        for g in &self.groups {
            let c = g.tokens_per_chunk;
            let chunks: Vec<usize> = if g.mamba {
                // Only the state at the end of this step exists.
                if to % c == 0 {
                    vec![to / c - 1]
                } else {
                    Vec::new()
                }
            } else {
                (from / c..to / c).filter(|i| (i + 1) * c > from).collect()
            };
            for i in chunks {
                if let Some(h) = hashes.get((i + 1) * g.hashes_per_chunk - 1) {
                    keys.push((i, (*h, g.group)));
                }
            }
        }
        // Tail first, so that the head ends up the most recent.
        keys.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        let offered: HashSet<Key> = keys.iter().map(|(_, k)| *k).collect();
        for (_, key) in keys {
            if self.held.contains_key(&key) {
                self.touch(key);
                continue;
            }
            if self.held.len() >= self.capacity && !self.evict_one(&offered) {
                continue;
            }
            self.touch(key);
            self.events.push(Event::Stored(Stored {
                worker: self.worker.clone(),
                dp_rank: self.dp_rank,
                medium: Some(MEDIUM.into()),
                group: Some(key.1),
                kind: None,
                sliding_window: None,
                block_size: 0,
                parent: None,
                hashes: vec![EngineHash::int(key.0)],
                token_ids: Vec::new(),
                extra_keys: None,
                lora_id: None,
                lora_name: None,
                lookahead_token_ids: None,
            }));
        }
    }

    fn touch(&mut self, key: Key) {
        self.tick += 1;
        if let Some(old) = self.held.insert(key, self.tick) {
            self.lru.remove(&old);
        }
        self.lru.insert(self.tick, key);
    }

    /// Evicts the least recent slot not in `keep`; false when every slot is in it.
    fn evict_one(&mut self, keep: &HashSet<Key>) -> bool {
        let Some((&tick, &key)) = self.lru.iter().find(|(_, k)| !keep.contains(k)) else {
            return false;
        };
        self.lru.remove(&tick);
        self.held.remove(&key);
        self.events.push(Event::Removed(Removed {
            worker: self.worker.clone(),
            dp_rank: self.dp_rank,
            medium: Some(MEDIUM.into()),
            group: Some(key.1),
            hashes: vec![EngineHash::int(key.0)],
        }));
        true
    }

    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }
}

/// The engine's CPU tier, by the connector that keeps it.
pub enum Tier {
    /// `OffloadingConnector`: chunk slots of its own ([`CpuTier`]).
    Offloading(CpuTier),
    /// `SimpleCPUOffloadConnector`: a CPU pool of the device's layout.
    SimpleCpu(SimpleCpuTier),
}

impl Tier {
    /// Refuses what the simulator cannot run: a tier whose connector pops drafter chunks
    /// (EAGLE's drop with drafter groups flagged, beside the `OffloadingConnector`), and a
    /// `SimpleCPUOffloadConnector` without a full-attention group (vLLM asserts one).
    pub fn check(cfg: &EngineConfig, rules: SpecRules) -> Result<(), SimError> {
        if cfg.cpu_tier_slots == 0 {
            return Ok(());
        }
        match cfg.cpu_tier_connector {
            OffloadConnector::Offloading if rules.eagle_drop && rules.drafter_groups_flagged => {
                Err(SimError::Config(
                    "a CPU tier with EAGLE-style speculation's block drop is not simulated".into(),
                ))
            }
            OffloadConnector::SimpleCpu if !cfg.spec.groups.iter().any(|g| g.kind.is_full()) => {
                Err(SimError::Config(
                    "the SimpleCPUOffloadConnector needs a full-attention group".into(),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The tier `cfg` asks for beside the device cache `kv`, if any.
    pub fn for_engine(cfg: &EngineConfig, kv: &KvCache) -> Option<Tier> {
        (cfg.cpu_tier_slots > 0).then(|| match cfg.cpu_tier_connector {
            OffloadConnector::Offloading => Tier::Offloading(CpuTier::new(
                cfg.cpu_tier_slots,
                &cfg.spec,
                kv.params.hash_block,
                cfg.worker.clone(),
                cfg.dp_rank,
            )),
            OffloadConnector::SimpleCpu => Tier::SimpleCpu(SimpleCpuTier::new(
                u32::try_from(cfg.cpu_tier_slots).unwrap_or(u32::MAX),
                kv,
                cfg.engine,
                cfg.worker.clone(),
                cfg.dp_rank,
            )),
        })
    }

    /// The tokens beyond the device hit `local` the tier serves a request of `n` tokens, and
    /// (the `SimpleCPUOffloadConnector`'s) the CPU blocks its load reads.
    pub fn hit(
        &self,
        kv: &KvCache,
        n: usize,
        local: usize,
        hashes: &[u64],
    ) -> (usize, Vec<BlockId>) {
        match self {
            Tier::Offloading(t) => (t.hit(n, local, hashes), Vec::new()),
            Tier::SimpleCpu(t) => t.hit(kv, n, local, hashes),
        }
    }

    /// A hit's load read `blocks`.
    pub fn loaded(&mut self, blocks: &[BlockId]) {
        if let Tier::SimpleCpu(t) = self {
            t.loaded(blocks);
        }
    }

    /// A request's prefill went from `from` to `to` computed tokens of its `prompt_len`-token
    /// prompt (`tokens`, chain `hashes`): the `OffloadingConnector` stores its chunks; the
    /// other scans the request's blocks the device `kv` has cached.
    pub fn offer(
        &mut self,
        kv: &KvCache,
        tokens: &[u32],
        hashes: &[u64],
        prompt_len: usize,
        from: usize,
        to: usize,
    ) {
        match self {
            Tier::Offloading(t) => t.offer(hashes, prompt_len, from, to),
            Tier::SimpleCpu(t) => t.scan(kv, tokens, hashes, from, to.min(prompt_len)),
        }
    }

    /// The tier's events after the device's `device` events of the same batch.
    pub fn take_events(&mut self, device: &[Event]) -> Vec<Event> {
        match self {
            Tier::Offloading(t) => t.take_events(),
            Tier::SimpleCpu(t) => t.take_events(device),
        }
    }

    /// Keys the tier holds.
    pub fn len(&self) -> usize {
        match self {
            Tier::Offloading(t) => t.len(),
            Tier::SimpleCpu(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(capacity: usize) -> CpuTier {
        let spec = crate::spec::preset("llama").unwrap();
        CpuTier::new(capacity, &spec, 16, "w".into(), 0)
    }

    fn hashes(n: usize) -> Vec<u64> {
        (0..n as u64).map(|i| 100 + i).collect()
    }

    #[test]
    fn a_prefill_stores_each_completed_chunk_once_with_one_event_each() {
        let mut t = tier(100);
        let h = hashes(10);
        t.offer(&h, 160, 0, 40);
        t.offer(&h, 160, 40, 200);
        assert_eq!(t.len(), 10);
        let events = t.take_events();
        assert_eq!(events.len(), 10);
        assert!(events.iter().all(|e| matches!(e, Event::Stored(s)
            if s.medium.as_deref() == Some(MEDIUM) && s.block_size == 0 && s.hashes.len() == 1)));
    }

    #[test]
    fn a_full_tier_evicts_another_requests_tail_first() {
        let mut t = tier(4);
        let a = hashes(4);
        t.offer(&a, 64, 0, 64);
        let b: Vec<u64> = (0..2).map(|i| 900 + i).collect();
        t.offer(&b, 32, 0, 32);
        t.take_events();
        // a's tail chunks (3, 2) went first; its head survives.
        assert!(t.contains(0, 100) && t.contains(0, 101));
        assert!(!t.contains(0, 102) && !t.contains(0, 103));
        assert_eq!(t.hit(64, 0, &a), 32);
    }

    #[test]
    fn a_mamba_group_offers_only_the_state_at_a_chunk_boundary() {
        let spec = crate::spec::preset("tiny-qwen3-next").unwrap();
        let mut t = CpuTier::new(100, &spec, 64, "w".into(), 0);
        let h = hashes(4);
        t.offer(&h, 256, 0, 100);
        // Attention chunk 0 only; no state at 100.
        assert_eq!(t.len(), 1);
        t.offer(&h, 256, 100, 192);
        // Attention chunks 1, 2 and the three Mamba groups' state at 192.
        assert_eq!(t.len(), 3 + 3);
        assert!((0..3).all(|g| t.contains(g, 102)));
    }
}
