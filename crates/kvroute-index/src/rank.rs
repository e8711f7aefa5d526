//! The cache state of one (worker, dp_rank): its learned layout and one holder per group.
//!
//! Owns: applying one normalized event to one rank (stores, removals, clears; device tier vs
//! offload tiers; layout learning and layout changes; content-key placement; the live hash
//! check, with vLLM 0.33's lookahead tokens when a store carries them, in `hash_check`), the
//! per-rank statistics, the eviction figures (the eviction group's stored and re-stored
//! tokens, and the blocks it removed lately; kept only while the index tracks evictions), and
//! the rank's `Plan` (params and lookups) for predictions.
//! Invariants: only device-tier blocks reach the group holders; a removal takes one copy; a
//! clear empties every device group but keeps the layout, and forgets the removed blocks (what
//! follows a clear is no re-prefill of evicted content); a kind change clears the rank first;
//! `plan` always equals `layout.plan(&config.lookup, config.rules())` (recomputed on every
//! layout or configuration change; `layout` is public for reading, and changes only through
//! `store`).
//! Must not: lock anything (the index serializes access per rank) or predict.

use crate::counters::{Counter, Counters};
use crate::engine::{Engine, Rules};
use crate::event::{is_device_medium, CacheKind, Removed, Rule, Stored, WorkerId};
use crate::ghosts::Ghosts;
use crate::hash::{self, BlockHasher, Digest, HashAlgo};
use crate::holder::{MixBuild, Multiset, SpecSet, SPEC_SLOTS};
use crate::layout::{Layout, Learned, LookupConfig, Params, Plan};
use crate::runs::Runs;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

mod hash_check;
use hash_check::first_salt;

/// How the router keys blocks for one worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum HashMode {
    /// Reproduce the engine's own hash (vLLM sha256 / sha256_cbor with a known seed).
    Engine { algo: HashAlgo, seed: String },
    /// The router's own content keys, learned from dense stores (SGLang; xxhash engines).
    ContentKey,
}

impl Default for HashMode {
    fn default() -> Self {
        HashMode::Engine {
            algo: HashAlgo::Sha256,
            seed: hash::DEFAULT_SEED.to_string(),
        }
    }
}

/// Per-worker settings the events do not carry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerConfig {
    pub hash: HashMode,
    pub lookup: LookupConfig,
    /// Recompute reproducible stores and count matches and mismatches.
    pub verify_hashes: bool,
    /// The engine generation whose rules predict this worker.
    #[serde(default)]
    pub engine: Engine,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (`L`): each block hash covers the `L` tokens
    /// after the block, and matches no longer drop the EAGLE block. Only meaningful on a 0.33
    /// engine running EAGLE-style speculation (`Speculative::hash_lookahead_tokens`); ignored
    /// on 0.32.
    #[serde(default)]
    pub hash_lookahead_tokens: u32,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            hash: HashMode::default(),
            lookup: LookupConfig::default(),
            verify_hashes: true,
            engine: Engine::default(),
            hash_lookahead_tokens: 0,
        }
    }
}

impl WorkerConfig {
    /// The rules this worker's predictions apply (its engine's, from `lookup.eagle` and
    /// `hash_lookahead_tokens`).
    pub fn rules(&self) -> Rules {
        Rules::of(self.engine, self.lookup.eagle, self.hash_lookahead_tokens)
    }
}

/// The most distinct keys one offload tier (medium, group) of a rank holds: past it the tier is
/// emptied and counted (`offload_overflow`). A real tier removes what it evicts; one that never
/// does (LMCache's in-process connector publishes stores only) would otherwise grow without
/// bound. 2²⁰ keys is a 16-token-block tier of 16 M tokens, beyond a 64 GiB CPU tier of a 7B
/// model.
pub const MAX_TIER_KEYS: usize = 1 << 20;

/// Per-rank statistics (the conformance report's; the gateway reads the eviction figures).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RankStats {
    pub stores: u64,
    pub removals: u64,
    pub clears: u64,
    pub layout_changes: u64,
    pub hash_matched: u64,
    pub hash_mismatched: u64,
    pub hash_unverifiable: u64,
    pub content_unplaceable: u64,
    /// Device tokens the rank stored in its eviction group (its lowest-numbered full-attention
    /// group: every group of a prefill stores together, so one counts each prefill once).
    pub eviction_group_tokens_stored: u64,
    /// Of those, the tokens of blocks stored again after this rank removed them (within the
    /// last [`crate::ghosts::GHOST_KEYS`] removals) and held by no offload tier of the rank:
    /// content the engine evicted and then had to prefill again.
    pub eviction_group_tokens_restored: u64,
}

#[derive(Default, Clone, Debug)]
pub(crate) struct GroupState {
    /// Full attention: the group's holder id in the index's shared run store.
    pub shared: Option<u32>,
    /// Every other kind: (table, slot) in the rank's tables of identical-spec groups.
    pub own: Option<(u16, u8)>,
    /// Content-key mode: engine hash → (content key, copies).
    pub content: HashMap<u64, (u64, u32), MixBuild>,
}

/// A rank's group states by group id, sorted: a rank has a handful of groups, so a vector
/// (allocated for exactly those) replaces a B-tree node sized for eleven.
#[derive(Default, Clone, Debug)]
pub(crate) struct GroupMap(Vec<(u32, GroupState)>);

impl GroupMap {
    pub fn get(&self, group: &u32) -> Option<&GroupState> {
        self.0
            .binary_search_by_key(group, |(g, _)| *g)
            .ok()
            .map(|i| &self.0[i].1)
    }

    /// The group's state, created empty if new; a new shared group (`shared`: full attention)
    /// gets a holder id in the shared run store.
    pub fn entry_or_default(
        &mut self,
        group: u32,
        place: Place<'_>,
        runs: &mut Runs,
    ) -> &mut GroupState {
        let i = match self.0.binary_search_by_key(&group, |(g, _)| *g) {
            Ok(i) => i,
            Err(i) => {
                self.0.reserve_exact(1);
                let state = match place {
                    Place::Shared => GroupState {
                        shared: Some(runs.add_holder()),
                        ..GroupState::default()
                    },
                    Place::Own(tables, key) => GroupState {
                        own: Some(tables.assign(key)),
                        ..GroupState::default()
                    },
                };
                self.0.insert(i, (group, state));
                i
            }
        };
        &mut self.0[i].1
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u32, &GroupState)> {
        self.0.iter().map(|(g, s)| (g, s))
    }

    pub fn values(&self) -> impl Iterator<Item = &GroupState> {
        self.0.iter().map(|(_, s)| s)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut GroupState> {
        self.0.iter_mut().map(|(_, s)| s)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Drops every group, giving shared holder ids back (the caller drops the tables).
    pub fn clear(&mut self, runs: &mut Runs) {
        for (_, g) in &self.0 {
            if let Some(id) = g.shared {
                runs.release_holder(id);
            }
        }
        self.0 = Vec::new();
    }
}

/// Where a new group's blocks go.
pub(crate) enum Place<'a> {
    /// The shared run store (full attention).
    Shared,
    /// A slot in the rank's table for groups of this spec.
    Own(&'a mut SpecTables, SpecKey),
}

/// (kind, window, block size): groups with one key store and evict the same hashes.
pub(crate) type SpecKey = (CacheKind, Option<u32>, u32);

/// A rank's tables of identical-spec groups (`SpecSet`), each with the key it was opened for
/// and the slots in use. A group keeps its slot for life (a group whose block size grows later
/// stays where it is: a table is storage, the lookup's groups are what the rules combine).
#[derive(Default, Clone, Debug)]
pub(crate) struct SpecTables(Vec<(SpecKey, u8, SpecSet)>);

impl SpecTables {
    /// A free slot in the key's table (a new table when every one is full).
    fn assign(&mut self, key: SpecKey) -> (u16, u8) {
        let found = self
            .0
            .iter()
            .position(|(k, used, _)| *k == key && used.count_ones() < SPEC_SLOTS as u32);
        let t = match found {
            Some(t) => t,
            None => {
                self.0.push((key, 0, SpecSet::default()));
                self.0.len() - 1
            }
        };
        let (_, used, set) = &mut self.0[t];
        let slot = used.trailing_ones() as u8;
        *used |= 1 << slot;
        if used.count_ones() == 2 {
            set.share();
        }
        (t as u16, slot)
    }

    pub fn get(&self, t: u16) -> Option<&SpecSet> {
        self.0.get(t as usize).map(|(_, _, s)| s)
    }

    pub(crate) fn get_mut(&mut self, t: u16) -> Option<&mut SpecSet> {
        self.0.get_mut(t as usize).map(|(_, _, s)| s)
    }

    fn heap_bytes(&self) -> usize {
        self.0.iter().map(|(_, _, s)| s.heap_bytes()).sum()
    }
}

const DIGEST_CACHE_MAX: usize = 65_536;

pub struct RankState {
    pub(crate) config: WorkerConfig,
    /// The engine's hash function (engine hash mode), built lazily for the live check.
    pub(crate) hasher: Option<BlockHasher>,
    pub layout: Layout,
    pub(crate) plan: Plan,
    /// Bumped whenever `plan` is re-derived (the index rebuilds its roster of shared holders).
    pub(crate) plan_gen: u64,
    /// The index's id for this rank (set when the index creates it).
    pub(crate) id: u64,
    /// Set (under the shared store's write lock) when the index drops the rank: an event still
    /// in flight for it is ignored instead of filing blocks nobody would ever release.
    pub(crate) dropped: bool,
    pub(crate) groups: GroupMap,
    pub(crate) specs: SpecTables,
    /// Non-device tiers: (medium, group) → the chunk keys stored there.
    pub(crate) offload: BTreeMap<(String, u32), Multiset>,
    /// Full digests of blocks the router recomputed, by 64-bit value (parents for the check).
    digests: HashMap<u64, Digest, MixBuild>,
    pub stats: RankStats,
    /// The eviction group's blocks removed lately (a later store of one re-prefilled it).
    pub(crate) ghosts: Ghosts,
    /// Whether the rank keeps `ghosts` and counts the eviction figures (the index's
    /// [`crate::Index::set_eviction_tracking`]); off, removals and stores skip that work.
    pub(crate) track_evictions: bool,
    /// Set by the intake while the rank's event stream has an unfilled gap.
    pub degraded: bool,
    /// Refusal reasons already logged for this rank (one bit per `Counter`).
    logged: u64,
}

impl RankState {
    pub fn new(config: WorkerConfig) -> RankState {
        RankState {
            config,
            hasher: None,
            layout: Layout::default(),
            plan: Plan::default(),
            plan_gen: 0,
            id: 0,
            dropped: false,
            groups: GroupMap::default(),
            specs: SpecTables::default(),
            offload: BTreeMap::new(),
            digests: HashMap::default(),
            ghosts: Ghosts::default(),
            track_evictions: false,
            stats: RankStats::default(),
            degraded: false,
            logged: 0,
        }
    }

    /// Counts a refusal and logs it the first time this rank sees that reason.
    fn refuse(&mut self, c: Counter, n: u64, counters: &Counters, worker: &WorkerId, detail: &str) {
        counters.add(c, n);
        let bit = 1u64 << (c as u32);
        if self.logged & bit == 0 {
            self.logged |= bit;
            tracing::warn!(worker = %worker, reason = c.name(), "{detail} (counted; logged once per worker and reason)");
        }
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    pub fn params(&self) -> Option<Params> {
        self.plan.params
    }

    /// The derived params and lookups predictions use.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Replaces the configuration (same hash mode) and re-derives the plan.
    pub(crate) fn set_config(&mut self, config: WorkerConfig) {
        self.config = config;
        self.replan();
    }

    pub(crate) fn replan(&mut self) {
        self.plan_gen += 1;
        self.plan = self.layout.plan(&self.config.lookup, self.config.rules());
    }

    /// Starts or stops keeping the eviction figures. Stopping forgets the removed blocks (and
    /// their memory); the running totals stay as they are.
    pub(crate) fn set_eviction_tracking(&mut self, on: bool) {
        self.track_evictions = on;
        if !on {
            self.ghosts = Ghosts::default();
        }
    }

    /// Empties every device group (the layout stays known).
    pub fn clear(&mut self, runs: &mut Runs) {
        for g in self.groups.values_mut() {
            g.content.clear();
            if let Some(id) = g.shared {
                runs.clear_holder(id);
            }
            if let Some((t, slot)) = g.own {
                if let Some(set) = self.specs.get_mut(t) {
                    set.clear_slot(slot);
                }
            }
        }
        self.digests.clear();
        self.ghosts.clear();
    }

    /// Forgets everything, layout included, and gives its shared holder ids back (call before
    /// dropping a rank).
    pub fn reset(&mut self, runs: &mut Runs) {
        self.groups.clear(runs);
        self.specs = SpecTables::default();
        self.layout = Layout::default();
        self.replan();
        self.digests.clear();
        self.ghosts.clear();
    }

    pub fn store(&mut self, ev: &Stored, counters: &Counters, runs: &mut Runs) {
        counters.add(Counter::StoreEvents, 1);
        self.stats.stores += 1;
        if !is_device_medium(ev.medium.as_deref()) {
            let key = (ev.medium.clone().unwrap_or_default(), ev.group.unwrap_or(0));
            if !self.offload.contains_key(&key) {
                // The index's roster predicts tiered ranks in full.
                self.plan_gen += 1;
            }
            let tier = self.offload.entry(key).or_default();
            for h in &ev.hashes {
                tier.insert(h.value.0);
            }
            counters.add(Counter::OffloadBlocksStored, ev.hashes.len() as u64);
            if tier.distinct() > MAX_TIER_KEYS {
                tier.clear();
                self.refuse(
                    Counter::OffloadOverflow,
                    1,
                    counters,
                    &ev.worker,
                    "an offload tier outgrew its bound (a connector that publishes no removals, \
                     such as LMCache's in-process one?): its blocks were dropped",
                );
            }
            return;
        }
        if ev.block_size == 0 {
            self.refuse(
                Counter::ZeroBlockSize,
                1,
                counters,
                &ev.worker,
                "a store with block_size 0 was ignored",
            );
            return;
        }
        let group = ev.group.unwrap_or(0);
        let kind = match (&ev.kind, ev.group) {
            (Some(k), _) => k.clone(),
            (None, None) => CacheKind::FullAttention,
            (None, Some(_)) => {
                self.refuse(
                    Counter::KindAbsent,
                    1,
                    counters,
                    &ev.worker,
                    "a group without a kind is treated as full attention",
                );
                CacheKind::FullAttention
            }
        };
        match self
            .layout
            .learn(group, &kind, ev.sliding_window, ev.block_size)
        {
            Learned::Known => {}
            Learned::Resized | Learned::NewGroup => self.replan(),
            Learned::Changed => {
                self.refuse(
                    Counter::LayoutChanges,
                    1,
                    counters,
                    &ev.worker,
                    "a group changed kind or window: the rank was cleared",
                );
                self.stats.layout_changes += 1;
                self.reset(runs);
                self.layout
                    .learn(group, &kind, ev.sliding_window, ev.block_size);
                self.replan();
            }
        }
        match self.config.hash {
            HashMode::Engine { .. } => {
                let place = place_for(&self.layout, &mut self.specs, group);
                let g = self.groups.entry_or_default(group, place, runs);
                match (g.shared, g.own) {
                    (Some(id), _) => {
                        let parent = ev.parent.as_ref().map(|p| p.value.0);
                        runs.insert_by(id, parent, &ev.hashes, |h| h.value.0);
                        if self.is_eviction_group(group) {
                            let blocks = ev.hashes.iter().map(|h| (h.value.0, h.value.0));
                            self.count_stores(group, ev.block_size, blocks);
                        }
                    }
                    (None, Some((t, slot))) => {
                        if let Some(set) = self.specs.get_mut(t) {
                            set.reserve(ev.hashes.len());
                            for h in &ev.hashes {
                                set.insert(slot, h.value.0);
                            }
                        }
                    }
                    (None, None) => {}
                }
                counters.add(Counter::BlocksStored, ev.hashes.len() as u64);
                if self.config.verify_hashes {
                    self.check_lookahead(ev, counters);
                    self.check_hashes(ev, counters);
                }
            }
            HashMode::ContentKey => self.store_content(group, ev, counters, runs),
        }
    }

    pub fn remove(&mut self, ev: &Removed, counters: &Counters, runs: &mut Runs) {
        counters.add(Counter::RemoveEvents, 1);
        self.stats.removals += 1;
        if !is_device_medium(ev.medium.as_deref()) {
            let key = (ev.medium.clone().unwrap_or_default(), ev.group.unwrap_or(0));
            if let Some(tier) = self.offload.get_mut(&key) {
                for h in &ev.hashes {
                    tier.remove(h.value.0);
                }
            }
            counters.add(Counter::OffloadBlocksRemoved, ev.hashes.len() as u64);
            return;
        }
        let group = ev.group.unwrap_or(0);
        if !self.layout.contains(group) {
            self.refuse(
                Counter::RemovedUnknownGroup,
                1,
                counters,
                &ev.worker,
                "a removal for a group never stored was ignored",
            );
            return;
        }
        let content_mode = self.config.hash == HashMode::ContentKey;
        let counted = self.is_eviction_group(group);
        let place = place_for(&self.layout, &mut self.specs, group);
        let g = self.groups.entry_or_default(group, place, runs);
        let mut own = g
            .own
            .and_then(|(t, slot)| Some((self.specs.get_mut(t)?, slot)));
        let (mut removed, mut unknown) = (0u64, 0u64);
        // Shared groups remove a whole event's keys at once (runs cut once per stretch); in
        // engine-hash mode the keys are the event's own hashes.
        let mut batch: Vec<u64> = Vec::new();
        let direct = !content_mode && g.shared.is_some();
        for h in ev.hashes.iter().filter(|_| !direct) {
            let key = if content_mode {
                match g.content.get_mut(&h.value.0) {
                    Some((key, copies)) => {
                        let key = *key;
                        *copies -= 1;
                        if *copies == 0 {
                            g.content.remove(&h.value.0);
                        }
                        Some(key)
                    }
                    None => None,
                }
            } else {
                Some(h.value.0)
            };
            match (key, g.shared) {
                (Some(k), Some(_)) => batch.push(k),
                (Some(k), None) if own.as_mut().is_some_and(|(set, slot)| set.remove(*slot, k)) => {
                    removed += 1
                }
                _ => unknown += 1,
            }
        }
        if let Some(id) = g.shared {
            let (r, u) = if direct {
                runs.remove_by(id, &ev.hashes, |h| h.value.0)
            } else {
                runs.remove(id, &batch)
            };
            removed += r;
            unknown += u;
            if counted {
                // Evicted: a key of the event (the engine hash, or its content key) whose last
                // copy went; one with a copy still held is no eviction.
                // (`batch` is empty on the direct path; content keys fill it otherwise.)
                let hashes = ev.hashes.iter().map(|h| h.value.0).filter(|_| direct);
                for k in hashes.chain(batch.iter().copied()) {
                    if runs.contains(id, k) {
                        continue;
                    }
                    self.ghosts.push(k);
                }
            }
        }
        // One atomic add per event, not per block.
        counters.add(Counter::BlocksRemoved, removed);
        if unknown > 0 {
            self.refuse(
                Counter::RemovedUnknownHash,
                unknown,
                counters,
                &ev.worker,
                "a removal named a block the rank does not hold",
            );
        }
    }

    /// Content-key mode: place a store's blocks by the router's own chained keys.
    fn store_content(&mut self, group: u32, ev: &Stored, counters: &Counters, runs: &mut Runs) {
        let h = self.params().map_or(ev.block_size, |p| p.hash_block).max(1) as usize;
        let b = ev.block_size as usize;
        let dense = !ev.hashes.is_empty()
            && ev.hashes.len() * b == ev.token_ids.len()
            && b.is_multiple_of(h);
        let parent_key = match &ev.parent {
            None => Some(None),
            Some(p) => self.lookup_content(group, p.value.0).map(Some),
        };
        let mut placed = 0u64;
        let mut unplaceable = 0u64;
        let mut keys: Vec<Option<u64>> = Vec::with_capacity(ev.hashes.len());
        match (dense, parent_key) {
            (true, Some(mut parent)) => {
                let lora = ev.lora_name.as_deref();
                for (i, block) in ev.token_ids.chunks_exact(b).enumerate() {
                    let salt = if i == 0 && ev.parent.is_none() {
                        first_salt(ev)
                    } else {
                        None
                    };
                    for (j, sub) in block.chunks_exact(h).enumerate() {
                        let s = if j == 0 { salt.as_deref() } else { None };
                        parent = Some(hash::content_key(parent, sub, s, lora));
                    }
                    keys.push(parent);
                }
            }
            _ => {
                for hsh in &ev.hashes {
                    keys.push(self.lookup_content(group, hsh.value.0));
                }
            }
        }
        let parent_key = parent_key.flatten();
        let place = place_for(&self.layout, &mut self.specs, group);
        let g = self.groups.entry_or_default(group, place, runs);
        let mut own = g
            .own
            .and_then(|(t, slot)| Some((self.specs.get_mut(t)?, slot)));
        let mut batch: Vec<u64> = Vec::new();
        let mut placed_hashes: Vec<u64> = Vec::new();
        for (hsh, key) in ev.hashes.iter().zip(keys) {
            match key {
                Some(k) => {
                    match (g.shared, own.as_mut()) {
                        (Some(_), _) => {
                            batch.push(k);
                            placed_hashes.push(hsh.value.0);
                        }
                        (None, Some((set, slot))) => set.insert(*slot, k),
                        (None, None) => {}
                    }
                    g.content.entry(hsh.value.0).or_insert((k, 0)).1 += 1;
                    placed += 1;
                }
                None => unplaceable += 1,
            }
        }
        let shared = g.shared;
        if let Some(id) = shared {
            runs.insert(id, parent_key, &batch);
        }
        if shared.is_some() && self.is_eviction_group(group) {
            // `batch` holds the placed blocks' keys in the event's order, `placed_hashes`
            // their engine hashes (what an offload tier holds).
            let blocks = placed_hashes.into_iter().zip(batch);
            self.count_stores(group, ev.block_size, blocks);
        }
        counters.add(Counter::BlocksStored, placed);
        if unplaceable > 0 {
            self.refuse(
                Counter::ContentUnplaceable,
                unplaceable,
                counters,
                &ev.worker,
                "content-key mode: a store that cannot be placed was dropped",
            );
            self.stats.content_unplaceable += unplaceable;
        }
    }

    /// Whether `group` is the rank's eviction group: its lowest-numbered group under the
    /// full-attention rule (full, MLA or sink attention; the one whose stores and removals the
    /// eviction figures count). A rank without one, or not tracking evictions, counts nothing.
    fn is_eviction_group(&self, group: u32) -> bool {
        self.track_evictions
            && self
                .layout
                .groups
                .iter()
                .find(|(_, spec)| spec.rule() == Rule::FullAttention)
                .is_some_and(|(id, _)| *id == group)
    }

    /// Counts a device store of the eviction group: its tokens, and those of the blocks the
    /// rank removed lately (`blocks`: each block's engine hash and its key in the holder) that
    /// no offload tier of the group holds (a tier load is no prefill).
    fn count_stores(
        &mut self,
        group: u32,
        block_size: u32,
        blocks: impl Iterator<Item = (u64, u64)>,
    ) {
        let (ghosts, offload) = (&mut self.ghosts, &self.offload);
        let (mut stored, mut restored) = (0u64, 0u64);
        for (engine_hash, key) in blocks {
            stored += 1;
            let loaded = || {
                offload
                    .iter()
                    .any(|((_, g), tier)| *g == group && tier.contains(engine_hash))
            };
            if ghosts.take(key) && !loaded() {
                restored += 1;
            }
        }
        self.stats.eviction_group_tokens_stored += stored * u64::from(block_size);
        self.stats.eviction_group_tokens_restored += restored * u64::from(block_size);
    }

    fn lookup_content(&self, group: u32, engine_hash: u64) -> Option<u64> {
        if let Some((k, _)) = self
            .groups
            .get(&group)
            .and_then(|g| g.content.get(&engine_hash))
        {
            return Some(*k);
        }
        self.groups
            .values()
            .find_map(|g| g.content.get(&engine_hash).map(|(k, _)| *k))
    }

    /// (group, hash, copies) of every device block, sorted: the state compared in tests.
    pub fn contents(&self, runs: &Runs) -> BTreeMap<u32, BTreeMap<u64, u32>> {
        self.groups
            .iter()
            .map(|(g, s)| {
                let blocks = match (s.shared, s.own) {
                    (Some(id), _) => runs.holder_contents(id).into_iter().collect(),
                    (None, Some((t, slot))) => self
                        .specs
                        .get(t)
                        .map(|set| set.iter(slot).collect())
                        .unwrap_or_default(),
                    (None, None) => BTreeMap::new(),
                };
                (*g, blocks)
            })
            .filter(|(_, m)| !m.is_empty())
            .collect()
    }

    /// Block copies per non-device medium, over its groups.
    pub fn offload_blocks(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for ((medium, _), set) in &self.offload {
            *out.entry(medium.clone()).or_insert(0) += set.total();
        }
        out
    }

    /// Heap bytes of the rank's own holders (shared groups live in the index's run store).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.groups
            .values()
            .map(|g| g.content.capacity() * 25)
            .sum::<usize>()
            + self.specs.heap_bytes()
            + self.digests.capacity() * 41
            + self.ghosts.heap_bytes()
    }

    pub(crate) fn block_copies(&self, runs: &Runs) -> u64 {
        self.groups
            .values()
            .map(|g| match (g.shared, g.own) {
                (Some(id), _) => runs.total(id),
                (None, Some((t, slot))) => self.specs.get(t).map_or(0, |set| set.total(slot)),
                (None, None) => 0,
            })
            .sum()
    }
}

/// Where `group`'s blocks go: the shared run store for full-attention kinds, else a slot in
/// the rank's table for its spec. (Sliding-window groups were tried in the shared store too: on
/// the simulator's gemma3 fleet, where windows free their front blocks, applying events was
/// 1.3× and routing 1.6× slower; docs/benchmarks.md.)
pub(crate) fn place_for<'a>(layout: &Layout, specs: &'a mut SpecTables, group: u32) -> Place<'a> {
    match layout.groups.get(&group) {
        Some(g) if g.rule() == Rule::FullAttention => Place::Shared,
        Some(g) => Place::Own(specs, (g.kind.clone(), g.window, g.block_size)),
        None => Place::Own(specs, (CacheKind::Unknown(String::new()), None, 0)),
    }
}
