//! The block pool shared by every KV cache group of one worker (vLLM's `BlockPool`).
//!
//! Owns: the physical blocks (reference counts, the hash keys each block is cached under), the
//! free queue in eviction order, the prefix-cache map `(hash, group) → blocks`, and the event
//! queue (`BlockStored`, one `BlockRemoved` per evicted key, `AllBlocksCleared`).
//! Invariants: block 0 is the null block and is never queued or freed; a block with
//! `ref_cnt == 0` is in the free queue, anything else is not; evicting a block emits one
//! removal per key it was cached under, in insertion order; duplicates are kept (the same key
//! may map to several blocks, and each copy is removed separately); uncached blocks are freed
//! to the queue's front (LIFO), cached ones to its back (LRU), exactly as vLLM does.
//! Must not: know about requests beyond the token and hash slices it is handed, or decide
//! which blocks to cache (the managers do).

use kvroute_index::hash::BlockExtras;
use kvroute_index::{Cleared, EngineHash, Event, KeyValue, Removed, Stored, WorkerId};
use std::collections::HashMap;

pub type BlockId = u32;
/// A prefix-cache key: the 64-bit external hash and the group.
pub type Key = (u64, u32);

/// The null block (a placeholder for skipped positions).
pub const NULL: BlockId = 0;

#[derive(Clone, Debug, Default)]
struct Block {
    ref_cnt: u32,
    /// The primary key and the prefix length it stands for.
    hash: Option<(Key, u32)>,
    /// Further keys registered on this block (partial entries).
    extra: Vec<Key>,
    queued: bool,
}

/// What the pool needs to know about a request to emit its stores.
pub struct ReqView<'a> {
    pub tokens: &'a [u32],
    /// 64-bit hashes of every full hash block of `tokens`.
    pub hashes: &'a [u64],
    pub extras: &'a BlockExtras,
    /// Lookahead tokens each hash covers (vLLM 0.33's `num_hash_lookahead_tokens`; 0: none).
    pub lookahead: usize,
    /// The request's LoRA adapter id (`BlockStored.lora_id`).
    pub lora_id: Option<i64>,
}

impl ReqView<'_> {
    /// The `L` tokens a hash of a block ending at `end` covers, or `None` without lookahead
    /// (`BlockStored.lookahead_token_ids` holds one such list per stored hash).
    fn lookahead_ids(&self, end: usize) -> Option<Vec<u32>> {
        (self.lookahead > 0).then(|| {
            self.tokens
                .get(end..end + self.lookahead)
                .unwrap_or_default()
                .to_vec()
        })
    }

    /// The hash of group block `i` for a group of `block` tokens (hash block `h`).
    pub fn group_hash(&self, h: u32, block: u32, i: usize) -> Option<u64> {
        let k = (block / h.max(1)) as usize;
        self.hashes.get((i + 1) * k - 1).copied()
    }

    /// The untagged extra keys vLLM publishes for the group block `[start, end)`.
    fn event_extra_keys(&self, start: usize) -> Option<KeyValue> {
        let mut keys = Vec::new();
        if let Some((name, _)) = &self.extras.lora {
            keys.push(KeyValue::Str(name.clone()));
        }
        if start == 0 {
            if let Some(salt) = &self.extras.cache_salt {
                keys.push(KeyValue::Str(salt.clone()));
            }
        }
        if keys.is_empty() {
            None
        } else {
            Some(KeyValue::List(keys))
        }
    }
}

/// One group's store request (`cache_full_blocks`).
pub struct StoreRange<'a> {
    pub blocks: &'a [BlockId],
    pub num_cached: usize,
    pub num_full: usize,
    pub block_size: u32,
    pub group: u32,
    pub mask: Option<&'a [bool]>,
}

pub struct BlockPool {
    blocks: Vec<Block>,
    /// Sentinel index of the free queue (`blocks.len()`); links live in `links`.
    links: Vec<(u32, u32)>,
    num_free: usize,
    cached: HashMap<Key, Vec<BlockId>>,
    events: Vec<Event>,
    hash_block: u32,
    worker: WorkerId,
    dp_rank: u32,
    /// The medium the pool's events name (`GPU` for the device's).
    medium: &'static str,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (null block included), all free.
    pub fn new(num_blocks: u32, hash_block: u32, worker: WorkerId, dp_rank: u32) -> BlockPool {
        let n = num_blocks.max(2) as usize;
        let mut pool = BlockPool {
            blocks: vec![Block::default(); n],
            links: vec![(0, 0); n + 1],
            num_free: 0,
            cached: HashMap::new(),
            events: Vec::new(),
            hash_block,
            worker,
            dp_rank,
            medium: "GPU",
        };
        let s = n as u32;
        pool.links[n] = (s, s);
        for i in 0..n as u32 {
            pool.push_back(i);
        }
        // The null block is taken out for good.
        pool.unlink(NULL);
        pool.blocks[0].ref_cnt = 1;
        pool
    }

    /// The worker and rank the pool's events name.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    pub fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    /// The same pool naming `medium` in its events (a connector's CPU pool).
    pub fn with_medium(mut self, medium: &'static str) -> BlockPool {
        self.medium = medium;
        self
    }

    /// A connector's copy of a block cached elsewhere: a free block is taken (its old keys
    /// evicted, one removal each), cached under `key`, and freed at once to the back of the
    /// queue (cached and evictable, the most recent). False, changing nothing, when `key` is
    /// held already or no block is free.
    pub fn store_copy(&mut self, key: Key) -> bool {
        if self.cached.contains_key(&key) {
            return false;
        }
        let Some(ids) = self.get_new_blocks(1) else {
            return false;
        };
        // The prefix length is not known to a copy (and no lookup reads it).
        self.insert_key(key, ids[0], 0);
        self.free_blocks(ids);
        true
    }

    fn sentinel(&self) -> u32 {
        self.blocks.len() as u32
    }

    fn push_back(&mut self, id: u32) {
        let s = self.sentinel();
        let last = self.links[s as usize].0;
        self.links[id as usize] = (last, s);
        self.links[last as usize].1 = id;
        self.links[s as usize].0 = id;
        self.blocks[id as usize].queued = true;
        self.num_free += 1;
    }

    fn push_front_all(&mut self, ids: &[u32]) {
        // prepend_n: ids[0] ends up first.
        for id in ids.iter().rev() {
            let s = self.sentinel();
            let first = self.links[s as usize].1;
            self.links[*id as usize] = (s, first);
            self.links[first as usize].0 = *id;
            self.links[s as usize].1 = *id;
            self.blocks[*id as usize].queued = true;
            self.num_free += 1;
        }
    }

    fn unlink(&mut self, id: u32) {
        let (p, n) = self.links[id as usize];
        self.links[p as usize].1 = n;
        self.links[n as usize].0 = p;
        self.blocks[id as usize].queued = false;
        self.num_free -= 1;
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// vLLM's `kv_cache_usage_perc` (the null block excluded).
    pub fn usage(&self) -> f64 {
        let total = self.blocks.len() - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - self.num_free as f64 / total as f64
    }

    pub fn hash_block(&self) -> u32 {
        self.hash_block
    }

    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// The prefix length a block's primary key stands for.
    pub fn hash_tokens(&self, id: BlockId) -> Option<u32> {
        self.blocks[id as usize].hash.map(|(_, t)| t)
    }

    pub fn primary_key(&self, id: BlockId) -> Option<Key> {
        self.blocks[id as usize].hash.map(|(k, _)| k)
    }

    /// One cached block per group for `hash`, or `None` when any group misses.
    pub fn get_cached(&self, hash: u64, groups: &[u32]) -> Option<Vec<BlockId>> {
        groups
            .iter()
            .map(|g| {
                self.cached
                    .get(&(hash, *g))
                    .and_then(|v| v.first().copied())
            })
            .collect()
    }

    pub fn contains(&self, key: Key) -> bool {
        self.cached.contains_key(&key)
    }

    /// Takes `n` blocks from the front of the free queue, evicting their cached keys.
    pub fn get_new_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let s = self.sentinel();
            let id = self.links[s as usize].1;
            self.unlink(id);
            self.evict(id);
            self.blocks[id as usize].ref_cnt += 1;
            out.push(id);
        }
        Some(out)
    }

    /// Removes every key of a block from the cache, emitting one removal each.
    pub fn evict(&mut self, id: BlockId) -> bool {
        let removed = self.remove_keys(id);
        let any = !removed.is_empty();
        self.emit_removed(&removed);
        any
    }

    fn remove_keys(&mut self, id: BlockId) -> Vec<Key> {
        let b = &mut self.blocks[id as usize];
        let mut keys: Vec<Key> = b.hash.take().map(|(k, _)| k).into_iter().collect();
        keys.append(&mut b.extra);
        let mut removed = Vec::new();
        for k in keys {
            if let Some(v) = self.cached.get_mut(&k) {
                if let Some(pos) = v.iter().position(|b| *b == id) {
                    v.remove(pos);
                    removed.push(k);
                }
                if v.is_empty() {
                    self.cached.remove(&k);
                }
            }
        }
        removed
    }

    fn emit_removed(&mut self, keys: &[Key]) {
        for (h, g) in keys {
            self.events.push(Event::Removed(Removed {
                worker: self.worker.clone(),
                dp_rank: self.dp_rank,
                medium: Some(self.medium.into()),
                group: Some(*g),
                hashes: vec![EngineHash::int(*h)],
            }));
        }
    }

    fn insert_key(&mut self, key: Key, id: BlockId, tokens: u32) {
        let b = &self.blocks[id as usize];
        if b.hash.map(|(k, _)| k) == Some(key) {
            return;
        }
        if self.cached.get(&key).is_some_and(|v| v.contains(&id)) {
            return;
        }
        let b = &mut self.blocks[id as usize];
        if b.hash.is_none() {
            b.hash = Some((key, tokens));
        } else {
            b.extra.push(key);
        }
        self.cached.entry(key).or_default().push(id);
    }

    /// A request references these blocks (prefix hit): they leave the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for id in ids {
            if *id == NULL {
                continue;
            }
            if self.blocks[*id as usize].ref_cnt == 0 && self.blocks[*id as usize].queued {
                self.unlink(*id);
            }
            self.blocks[*id as usize].ref_cnt += 1;
        }
    }

    /// Frees blocks in eviction-priority order (first = evicted first).
    pub fn free_blocks(&mut self, ordered: impl IntoIterator<Item = BlockId>) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for id in ordered {
            if id == NULL {
                continue;
            }
            let b = &mut self.blocks[id as usize];
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                if b.hash.is_none() {
                    first.push(id);
                } else {
                    last.push(id);
                }
            }
        }
        self.push_front_all(&first);
        for id in last {
            self.push_back(id);
        }
    }

    /// `cache_full_blocks`: caches blocks `[num_cached, num_full)` of one group (skipping null
    /// and masked-out blocks) and emits one `BlockStored` for the range.
    pub fn cache_full_blocks(&mut self, req: &ReqView<'_>, r: &StoreRange<'_>) {
        if r.num_cached >= r.num_full {
            return;
        }
        let h = self.hash_block;
        let mut hashes = Vec::new();
        let mut extra_keys = Vec::new();
        let mut lookahead: Option<Vec<Vec<u32>>> = (req.lookahead > 0).then(Vec::new);
        for i in r.num_cached..r.num_full {
            let id = r.blocks.get(i).copied().unwrap_or(NULL);
            let keep = r
                .mask
                .is_none_or(|m| m.get(i - r.num_cached).copied().unwrap_or(false));
            if id == NULL || !keep {
                continue;
            }
            let Some(hash) = req.group_hash(h, r.block_size, i) else {
                continue;
            };
            let tokens = (i as u32 + 1) * r.block_size;
            if self.blocks[id as usize].hash.is_some() {
                // Partial→full promotion of the same block: its old keys go first.
                let removed = self.remove_keys(id);
                self.emit_removed(&removed);
            }
            self.insert_key((hash, r.group), id, tokens);
            hashes.push(EngineHash::int(hash));
            extra_keys.push(req.event_extra_keys(i * r.block_size as usize));
            if let (Some(la), Some(ids)) = (lookahead.as_mut(), req.lookahead_ids(tokens as usize))
            {
                la.push(ids);
            }
        }
        let parent = if r.num_cached == 0 {
            None
        } else {
            req.group_hash(h, r.block_size, r.num_cached - 1)
                .map(EngineHash::int)
        };
        let start = r.num_cached * r.block_size as usize;
        let end = (r.num_full * r.block_size as usize).min(req.tokens.len());
        self.events.push(Event::Stored(Stored {
            worker: self.worker.clone(),
            dp_rank: self.dp_rank,
            medium: Some(self.medium.into()),
            group: Some(r.group),
            kind: None,
            sliding_window: None,
            block_size: r.block_size,
            parent,
            hashes,
            token_ids: req.tokens.get(start..end).unwrap_or_default().to_vec(),
            extra_keys: if extra_keys.is_empty() {
                None
            } else {
                Some(extra_keys)
            },
            lora_id: req.lora_id,
            lora_name: req.extras.lora.as_ref().map(|(n, _)| n.clone()),
            lookahead_token_ids: lookahead,
        }));
    }

    /// `cache_partial_block`: registers the prefix of `num_tokens` (a multiple of the hash
    /// block) on an existing block; with `replace`, the block's old keys are removed first.
    /// Returns the key, or `None` for the null block.
    pub fn cache_partial_block(
        &mut self,
        req: &ReqView<'_>,
        id: BlockId,
        num_tokens: u32,
        group: u32,
        replace: bool,
    ) -> Option<Key> {
        if id == NULL || num_tokens == 0 {
            return None;
        }
        let h = self.hash_block;
        let n_hash = (num_tokens / h) as usize;
        let hash = *req.hashes.get(n_hash.checked_sub(1)?)?;
        let key = (hash, group);
        let b = &self.blocks[id as usize];
        let mut already = b.hash.map(|(k, _)| k) == Some(key)
            || self.cached.get(&key).is_some_and(|v| v.contains(&id));
        if replace {
            let removed = self.remove_keys(id);
            self.emit_removed(&removed);
            already = false;
        } else if !already && b.hash.is_some_and(|(_, t)| t < num_tokens) {
            let removed = self.remove_keys(id);
            self.emit_removed(&removed);
        }
        self.insert_key(key, id, num_tokens);
        if !already {
            let start = (n_hash - 1) * h as usize;
            let end = num_tokens as usize;
            let parent = if n_hash > 1 {
                req.hashes.get(n_hash - 2).copied().map(EngineHash::int)
            } else {
                None
            };
            self.events.push(Event::Stored(Stored {
                worker: self.worker.clone(),
                dp_rank: self.dp_rank,
                medium: Some(self.medium.into()),
                group: Some(group),
                kind: None,
                sliding_window: None,
                block_size: (end - start) as u32,
                parent,
                hashes: vec![EngineHash::int(hash)],
                token_ids: req.tokens.get(start..end).unwrap_or_default().to_vec(),
                extra_keys: Some(vec![req.event_extra_keys(start)]),
                lora_id: req.lora_id,
                lora_name: req.extras.lora.as_ref().map(|(n, _)| n.clone()),
                lookahead_token_ids: req.lookahead_ids(end).map(|ids| vec![ids]),
            }));
        }
        Some(key)
    }

    /// `reset_prefix_cache`: only when every block is free; emits `AllBlocksCleared`.
    pub fn reset(&mut self) -> bool {
        if self.num_free != self.blocks.len() - 1 {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
            b.extra.clear();
        }
        self.events.push(Event::Cleared(Cleared {
            worker: self.worker.clone(),
            dp_rank: self.dp_rank,
        }));
        true
    }

    /// Events queued since the last `take_events`.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Every cached key with its number of copies (the true cache state).
    pub fn contents(&self) -> impl Iterator<Item = (&Key, usize)> {
        self.cached.iter().map(|(k, v)| (k, v.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(tokens: &'a [u32], hashes: &'a [u64], extras: &'a BlockExtras) -> ReqView<'a> {
        ReqView {
            tokens,
            hashes,
            extras,
            lookahead: 0,
            lora_id: None,
        }
    }

    #[test]
    fn evicting_a_cached_block_emits_one_removal_per_key() {
        let mut pool = BlockPool::new(3, 2, "w".into(), 0);
        let blocks = pool.get_new_blocks(2).unwrap();
        let ex = BlockExtras::default();
        let tokens = [1, 2, 3, 4];
        let hashes = [11, 22];
        pool.cache_full_blocks(
            &view(&tokens, &hashes, &ex),
            &StoreRange {
                blocks: &blocks,
                num_cached: 0,
                num_full: 2,
                block_size: 2,
                group: 0,
                mask: None,
            },
        );
        pool.free_blocks(blocks.iter().rev().copied());
        assert_eq!(pool.num_free(), 2);
        let ev = pool.take_events();
        assert_eq!(ev.len(), 1);
        // The tail block was freed first, so it is evicted first.
        let again = pool.get_new_blocks(1).unwrap();
        assert_eq!(again, vec![blocks[1]]);
        let ev = pool.take_events();
        assert!(matches!(&ev[0], Event::Removed(r) if r.hashes[0].value.0 == 22));
    }

    #[test]
    fn uncached_blocks_are_reused_before_cached_ones() {
        let mut pool = BlockPool::new(4, 2, "w".into(), 0);
        let b = pool.get_new_blocks(3).unwrap();
        let ex = BlockExtras::default();
        let tokens = [1, 2];
        let hashes = [5];
        pool.cache_full_blocks(
            &view(&tokens, &hashes, &ex),
            &StoreRange {
                blocks: &b[..1],
                num_cached: 0,
                num_full: 1,
                block_size: 2,
                group: 0,
                mask: None,
            },
        );
        pool.free_blocks(b.iter().rev().copied());
        assert_eq!(pool.get_new_blocks(2).unwrap(), vec![b[2], b[1]]);
        assert!(pool.get_cached(5, &[0]).is_some());
    }

    #[test]
    fn a_reset_fails_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(4, 2, "w".into(), 0);
        let b = pool.get_new_blocks(1).unwrap();
        assert!(!pool.reset());
        pool.free_blocks(b);
        assert!(pool.reset());
        assert!(matches!(pool.take_events()[0], Event::Cleared(_)));
    }
}
