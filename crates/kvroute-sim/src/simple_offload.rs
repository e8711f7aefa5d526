//! The simulated engine's CPU tier as vLLM's `SimpleCPUOffloadConnector` keeps one (eager
//! mode, its default): a second block pool of the device's layout, looked up with the device's
//! own rules.
//!
//! Owns: the CPU pool (its blocks, their LRU order, its removals), the copies of what the
//! device caches (every key of every device `BlockStored`, as it is stored, and the connector's
//! positional scan of each scheduled request's attention blocks from block 0, which copies a
//! prefix-cache hit's blocks the tier lost), the tier's hit for
//! a request (the device coordinator over the CPU pool, on the hashes after the device hit,
//! at most `n − 1 − local`: the simulator's own `vllm_rules::simple_cpu_start` says where it
//! starts),
//! and the events the tier publishes: one `BlockStored` per copied key (`medium = "CPU"`, the
//! device store's group, kind, window, block size, parent and tokens) and one `BlockRemoved`
//! per evicted key.
//! Invariants: a key is copied once while the tier holds it (a copy of a held key is skipped,
//! without refreshing it); a copy or a hit's load makes its blocks the most recent; the device's
//! removals and resets leave the tier alone (vLLM resets the connector only when asked to).
//! Must not: model the connector's asynchrony (a store lands in the step that cached it on the
//! device, a hit is loaded at once), its disk backend or lazy mode.

use crate::cache::KvCache;
use crate::pool::{BlockId, BlockPool};
use crate::vllm_rules::simple_cpu_start;
use kvroute_index::{EngineHash, Event, Stored, WorkerId};

/// The medium the tier's events name.
pub const MEDIUM: &str = "CPU";

pub struct SimpleCpuTier {
    pool: BlockPool,
    /// Events queued since the last `take_events`, in order (a copy's evictions before it).
    events: Vec<Event>,
    /// Blocks the positional scan found since the last `take_events`, copied after the
    /// device's stores of the same batch.
    scanned: Vec<Event>,
    engine: kvroute_index::Engine,
}

impl SimpleCpuTier {
    /// A tier of `num_blocks` CPU blocks for the device cache `kv` of an `engine` generation.
    pub fn new(
        num_blocks: u32,
        kv: &KvCache,
        engine: kvroute_index::Engine,
        worker: WorkerId,
        dp_rank: u32,
    ) -> SimpleCpuTier {
        SimpleCpuTier {
            // One block more: the pool's block 0 is its null block.
            pool: BlockPool::new(
                num_blocks.saturating_add(1),
                kv.params.hash_block,
                worker,
                dp_rank,
            )
            .with_medium(MEDIUM),
            events: Vec::new(),
            scanned: Vec::new(),
            engine,
        }
    }

    /// Keys the tier holds.
    pub fn len(&self) -> usize {
        self.pool.contents().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tokens beyond the device hit `local` the tier serves a request of `n` tokens whose
    /// chain is `hashes`, and the CPU blocks it would load.
    pub fn hit(
        &self,
        kv: &KvCache,
        n: usize,
        local: usize,
        hashes: &[u64],
    ) -> (usize, Vec<BlockId>) {
        let chunk = kv.spec.groups.iter().find_map(|g| match g.kind {
            crate::spec::GroupKind::ChunkedLocal { chunk } => Some(chunk),
            _ => None,
        });
        let Some((skip, max_hit_len)) = simple_cpu_start(
            n,
            local,
            kv.params.hash_block,
            scheduler_block(kv),
            chunk,
            self.engine,
            hashes.len(),
        ) else {
            return (0, Vec::new());
        };
        let hit = kv.find_longest_cache_hit_in(&self.pool, &hashes[skip..], max_hit_len);
        let blocks = hit
            .blocks
            .map(|per_group| per_group.into_iter().flatten().collect())
            .unwrap_or_default();
        (hit.tokens, blocks)
    }

    /// Holds `hash` of `group` as a copy would, without an event: a tier rebuilt from another
    /// engine's `medium = "CPU"` stores (the oracle checks). False when held already or full.
    pub fn hold(&mut self, hash: u64, group: u32) -> bool {
        let stored = self.pool.store_copy((hash, group));
        self.pool.take_events();
        stored
    }

    /// A hit was loaded: its blocks become the most recent.
    pub fn loaded(&mut self, blocks: &[BlockId]) {
        self.pool.touch(blocks);
        self.pool.free_blocks(blocks.iter().copied());
    }

    /// Copies every key the device's `events` store (the connector's eager stores), one event
    /// per key copied.
    pub fn copy_stores(&mut self, events: &[Event]) {
        for e in events {
            let Event::Stored(s) = e else { continue };
            // Per-key tokens and parents only when the store is one contiguous run of blocks.
            let b = s.block_size as usize;
            let contiguous = b > 0 && s.token_ids.len() == s.hashes.len() * b;
            for (i, h) in s.hashes.iter().enumerate() {
                if !self.pool.store_copy((h.value.0, s.group.unwrap_or(0))) {
                    continue;
                }
                self.events.extend(self.pool.take_events());
                let parent = match i {
                    0 => s.parent.clone(),
                    _ if contiguous => Some(s.hashes[i - 1].clone()),
                    _ => None,
                };
                let tokens = if contiguous {
                    s.token_ids[i * b..(i + 1) * b].to_vec()
                } else {
                    Vec::new()
                };
                self.events.push(Event::Stored(Stored {
                    worker: s.worker.clone(),
                    dp_rank: s.dp_rank,
                    medium: Some(MEDIUM.into()),
                    group: s.group,
                    kind: s.kind.clone(),
                    sliding_window: s.sliding_window,
                    block_size: s.block_size,
                    parent,
                    hashes: vec![EngineHash::int(h.value.0)],
                    token_ids: tokens,
                    extra_keys: s
                        .extra_keys
                        .as_ref()
                        .and_then(|k| k.get(i).cloned())
                        .map(|k| vec![k]),
                    lora_id: s.lora_id,
                    lora_name: s.lora_name.clone(),
                    lookahead_token_ids: s
                        .lookahead_token_ids
                        .as_ref()
                        .and_then(|l| l.get(i).cloned())
                        .map(|l| vec![l]),
                }));
            }
        }
    }

    /// A request's computed prompt went from `from` to `to` tokens: the connector's positional
    /// scan over each attention group's blocks of `[from, to)` (the request's prefix-cache hit
    /// included: its scan starts at block 0), offering every block the device still has cached
    /// (a window block the table nulled included); the tier copies those it lacks. Mamba states
    /// reach it only as the device caches them (`copy_stores`).
    pub fn scan(&mut self, kv: &KvCache, tokens: &[u32], hashes: &[u64], from: usize, to: usize) {
        let h = kv.params.hash_block;
        for (g, spec) in kv.spec.groups.iter().enumerate() {
            if matches!(spec.kind, crate::spec::GroupKind::Mamba) {
                continue;
            }
            let b = spec.block_size as usize;
            let k = (spec.block_size / h.max(1)) as usize;
            let key = |i: usize| hashes.get((i + 1) * k - 1).copied();
            for i in from / b..to / b {
                let Some(hash) = key(i) else { break };
                if !kv.pool.contains((hash, g as u32)) {
                    continue;
                }
                self.scanned.push(Event::Stored(Stored {
                    worker: self.pool.worker().clone(),
                    dp_rank: self.pool.dp_rank(),
                    medium: Some("GPU".into()),
                    group: Some(g as u32),
                    kind: Some(spec.kind.cache_kind()),
                    sliding_window: spec.kind.reported_window(),
                    block_size: spec.block_size,
                    parent: i.checked_sub(1).and_then(key).map(EngineHash::int),
                    hashes: vec![EngineHash::int(hash)],
                    token_ids: tokens.get(i * b..(i + 1) * b).unwrap_or_default().to_vec(),
                    extra_keys: None,
                    lora_id: None,
                    lora_name: None,
                    lookahead_token_ids: None,
                }));
            }
        }
    }

    /// The tier's events since the last call, in order: after the device's `device` stores
    /// are copied, what the positional scan found.
    pub fn take_events(&mut self, device: &[Event]) -> Vec<Event> {
        self.copy_stores(device);
        let scanned = std::mem::take(&mut self.scanned);
        self.copy_stores(&scanned);
        self.events.extend(self.pool.take_events());
        std::mem::take(&mut self.events)
    }
}

/// vLLM's scheduler block: the least common multiple of the groups' block sizes.
fn scheduler_block(kv: &KvCache) -> u32 {
    fn gcd(a: u32, b: u32) -> u32 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    kv.spec
        .groups
        .iter()
        .map(|g| g.block_size.max(1))
        .fold(1, |acc, b| acc / gcd(acc, b) * b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineConfig};

    fn device() -> Engine {
        Engine::new(EngineConfig::for_preset("llama").unwrap()).unwrap()
    }

    fn stored(group: u32, hashes: &[u64]) -> Event {
        Event::Stored(Stored {
            worker: "w".into(),
            dp_rank: 0,
            medium: Some("GPU".into()),
            group: Some(group),
            kind: None,
            sliding_window: None,
            block_size: 16,
            parent: None,
            hashes: hashes.iter().map(|h| EngineHash::int(*h)).collect(),
            token_ids: (0..16 * hashes.len() as u32).collect(),
            extra_keys: None,
            lora_id: None,
            lora_name: None,
            lookahead_token_ids: None,
        })
    }

    fn summary(events: &[Event]) -> Vec<(char, u64)> {
        events
            .iter()
            .map(|e| match e {
                Event::Stored(s) => ('+', s.hashes[0].value.0),
                Event::Removed(r) => ('-', r.hashes[0].value.0),
                _ => ('?', 0),
            })
            .collect()
    }

    #[test]
    fn every_device_store_is_copied_once_a_key_with_its_evictions_before_it() {
        let kv = device().kv;
        let mut t = SimpleCpuTier::new(2, &kv, kvroute_index::Engine::Vllm032, "w".into(), 0);
        t.copy_stores(&[stored(0, &[1, 2])]);
        // A held key is not copied again; a third key evicts the least recent.
        let events = t.take_events(&[stored(0, &[2, 3])]);
        assert_eq!(summary(&events), [('+', 1), ('+', 2), ('-', 1), ('+', 3)]);
        assert!(events.iter().all(|e| match e {
            Event::Stored(s) => s.medium.as_deref() == Some(MEDIUM) && s.token_ids.len() == 16,
            Event::Removed(r) => r.medium.as_deref() == Some(MEDIUM),
            _ => false,
        }));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn the_hit_follows_the_device_rules_from_the_device_hit_and_keeps_the_last_token() {
        let kv = device().kv;
        let mut t = SimpleCpuTier::new(16, &kv, kvroute_index::Engine::Vllm032, "w".into(), 0);
        let chain: Vec<u64> = (0..6).map(|i| 500 + i).collect();
        t.copy_stores(&[stored(0, &chain[2..])]);
        // 96 tokens, 32 on the device: at most 63 more, three whole blocks.
        let (hit, blocks) = t.hit(&kv, 96, 32, &chain);
        assert_eq!((hit, blocks.len()), (48, 3));
        // A device hit off the block gets nothing; one that leaves a gap gets nothing.
        assert_eq!(t.hit(&kv, 96, 24, &chain).0, 0);
        assert_eq!(t.hit(&kv, 96, 16, &chain).0, 0);
    }

    #[test]
    fn the_positional_scan_copies_a_request_s_blocks_the_device_still_caches() {
        let mut e = device();
        let prompt: Vec<u32> = (100..164).collect();
        e.add_request(crate::engine::NewRequest {
            id: "a".into(),
            prompt: prompt.clone(),
            max_tokens: 1,
            forced_output: None,
            cache_salt: None,
            skip_prefix_cache: false,
            lora: None,
            remote_kv: None,
        })
        .unwrap();
        while e.has_work() {
            e.step();
        }
        let hashes: Vec<u64> = kvroute_index::index::block_hashes(
            kvroute_index::HashAlgo::Sha256,
            kvroute_index::hash::DEFAULT_SEED,
            16,
            &prompt,
            &kvroute_index::BlockExtras::default(),
        )
        .into_iter()
        .map(|(_, h, _)| h)
        .collect();
        // A tier that never saw the request's stores (it lost them): the scan of its prompt
        // copies the four blocks the device still caches, one event each, after the batch.
        let mut t = SimpleCpuTier::new(16, &e.kv, kvroute_index::Engine::Vllm032, "w".into(), 0);
        t.scan(&e.kv, &prompt, &hashes, 0, 64);
        assert!(t.is_empty());
        let events = t.take_events(&[]);
        assert_eq!(t.len(), 4);
        assert_eq!(
            summary(&events),
            hashes.iter().map(|h| ('+', *h)).collect::<Vec<_>>()
        );
        // A block the device does not cache is not offered.
        let mut t = SimpleCpuTier::new(16, &e.kv, kvroute_index::Engine::Vllm032, "w".into(), 0);
        t.scan(&e.kv, &prompt, &[1, 2, 3, 4], 0, 64);
        assert!(t.take_events(&[]).is_empty());
    }
}
