//! The simulated engine core: requests, vLLM's scheduler loop and the per-step outcome.
//!
//! Owns: request state (tokens, block hashes, computed count, first-scheduling hit),
//! continuous batching (running requests first, then waiting ones, FCFS), the token budget,
//! chunked prefill, Mamba block-aligned chunk splitting, preemption when the pool runs out,
//! deterministic sampling (or forced output tokens), the simulated clock and the prefix-cache
//! counters; its arguments, requests and step outcomes are plain data in `types`.
//! The engine generation (vLLM 0.32 or 0.33) and speculative decoding settings select the
//! prefix-cache rules (`vllm_rules::SpecRules`): 0.33 with `L > 0` lookahead tokens hashes each
//! block with the `L` tokens after it (a block has a hash, and can be stored, only once they
//! exist) and drops nothing; otherwise EAGLE-style speculation drops the last matched block.
//! Under speculation every allocation also reserves the drafter's lookahead slots, an admission
//! with one token left is padded to a decode step's `1 + k` rows (the drafts rejected at once:
//! no draft is ever accepted), and 0.33 caches a request's blocks again once a sampled token
//! arrives (a lookahead hash it completes is stored in that step).
//! Invariants: one `step()` is one engine step: its events are exactly what vLLM would publish
//! as one batch (possibly none); a request's `num_cached_tokens` is its hit at first scheduling;
//! time only moves forward; hits are at most `n − max(1, L)`.
//! Must not: do I/O, sleep, or know about sockets and HTTP.

use crate::cache::{CacheConfig, KvCache, ReqCtx};
use crate::error::SimError;
use crate::groups;
use crate::offload::Tier;
use crate::pool::{BlockId, ReqView};
use crate::spec::CacheParams;
use kvroute_index::hash::{self, BlockExtras, BlockHasher, Digest};
use kvroute_index::Event;
use std::collections::{HashMap, VecDeque};

mod types;
pub use types::{
    EngineConfig, EngineStats, Finished, Lookup, Lora, NewRequest, RemoteKv, StepOutcome, TokenOut,
};

struct Req {
    handle: u64,
    prompt_len: usize,
    tokens: Vec<u32>,
    digests: Vec<Digest>,
    hashes: Vec<u64>,
    extras: BlockExtras,
    lora_id: Option<i64>,
    max_tokens: usize,
    forced: Vec<u32>,
    seed: u64,
    num_computed: usize,
    num_cached_tokens: Option<usize>,
    junction: usize,
    skip: bool,
    arrival: f64,
    first_token: Option<f64>,
    preemptions: u32,
    /// Disaggregated decode, until its first scheduling pulls the prompt.
    remote: Option<RemoteKv>,
    /// When the pulled KV has arrived (simulated seconds); the request waits until then.
    ready_at: Option<f64>,
    /// Prompt tokens offered to the CPU tier so far.
    tier_offered: usize,
}

impl Req {
    fn outputs(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

pub struct Engine {
    pub cfg: EngineConfig,
    pub params: CacheParams,
    pub kv: KvCache,
    /// The CPU tier, when configured.
    pub cpu: Option<Tier>,
    hasher: BlockHasher,
    /// Lookahead tokens each block hash covers (`L`).
    lookahead: usize,
    /// Slots allocated past a request's scheduled tokens for the drafter's KV (vLLM's
    /// `num_lookahead_tokens`).
    draft_slots: usize,
    /// Cache a request's computed blocks again once its sampled token arrives (vLLM 0.33
    /// under speculative decoding).
    cache_after_output: bool,
    reqs: HashMap<u64, Req>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    next_handle: u64,
    now: f64,
    pub stats: EngineStats,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Engine, SimError> {
        let params = cfg.spec.params()?;
        if cfg.max_num_batched_tokens == 0 || cfg.max_num_seqs == 0 || cfg.max_model_len < 2 {
            return Err(SimError::Config(
                "max_num_batched_tokens, max_num_seqs and max_model_len must be positive".into(),
            ));
        }
        if cfg.num_blocks < 2 {
            return Err(SimError::Config("the pool needs at least 2 blocks".into()));
        }
        let rules = cfg.rules();
        let chunked = cfg
            .spec
            .groups
            .iter()
            .any(|g| matches!(g.kind, crate::spec::GroupKind::ChunkedLocal { .. }));
        if rules.eagle_drop && chunked {
            // vLLM's chunked local manager asserts that it never drops the EAGLE block.
            return Err(SimError::Config(
                "EAGLE-style speculation with a chunked local attention group is not supported \
                 by this vLLM generation's KV cache manager"
                    .into(),
            ));
        }
        Tier::check(&cfg, rules)?;
        let kv = KvCache::new(
            cfg.spec.clone(),
            params,
            CacheConfig {
                num_blocks: cfg.num_blocks,
                max_model_len: cfg.max_model_len,
                max_num_batched_tokens: cfg.max_num_batched_tokens,
                retention: cfg.retention,
                prefill_checkpoints: cfg.prefill_checkpoints,
                eagle_drop: rules.eagle_drop,
                eagle_full_only: rules.eagle_drop && rules.drafter_groups_flagged,
            },
            cfg.worker.clone(),
            cfg.dp_rank,
        );
        let cpu = Tier::for_engine(&cfg, &kv);
        Ok(Engine {
            cpu,
            hasher: BlockHasher::new(cfg.hash_algo, &cfg.hash_seed),
            lookahead: rules.lookahead as usize,
            draft_slots: rules.draft_slots as usize,
            cache_after_output: rules.cache_after_output,
            params,
            kv,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_handle: 1,
            now: 0.0,
            stats: EngineStats::default(),
            cfg,
        })
    }

    /// The simulated clock (seconds).
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Moves the clock forward (idle time); never backwards.
    pub fn advance_to(&mut self, t: f64) {
        if t > self.now {
            self.now = t;
        }
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The earliest time a request waiting for pulled KV can run (simulated seconds).
    pub fn next_ready_at(&self) -> Option<f64> {
        self.running
            .iter()
            .filter_map(|h| self.reqs.get(h)?.ready_at)
            .filter(|t| *t > self.now)
            .min_by(f64::total_cmp)
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a request arriving now; returns its handle.
    pub fn add_request(&mut self, r: NewRequest) -> Result<u64, SimError> {
        self.add_request_at(r, self.now)
    }

    /// Queues a request that arrived at `arrival` (simulated seconds): while a step runs the
    /// clock already reads the step's end, and a request that arrives meanwhile waits for that
    /// step, so its TTFT counts from its own arrival, as vLLM's `arrival_time` does. It is
    /// scheduled from the next step on; an `arrival` after the clock reads as now.
    pub fn add_request_at(&mut self, r: NewRequest, arrival: f64) -> Result<u64, SimError> {
        if r.prompt.is_empty() {
            return Err(SimError::Request("the prompt is empty".into()));
        }
        let max_len = self.cfg.max_model_len as usize;
        if r.prompt.len() >= max_len {
            return Err(SimError::Request(format!(
                "the prompt ({} tokens) does not fit max_model_len {max_len}",
                r.prompt.len()
            )));
        }
        let vocab = self.cfg.spec.vocab_size;
        if let Some(t) = r.prompt.iter().find(|t| **t >= vocab) {
            return Err(SimError::Request(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        let seed = xxhash_rust::xxh3::xxh3_64(
            &r.prompt
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let mut req = Req {
            handle,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            digests: Vec::new(),
            hashes: Vec::new(),
            lora_id: r.lora.as_ref().map(|l| l.id),
            extras: BlockExtras {
                cache_salt: r.cache_salt,
                lora: r.lora.map(|l| (l.name, l.path)),
            },
            max_tokens: r.max_tokens.max(1),
            forced: r.forced_output.unwrap_or_default(),
            seed,
            num_computed: 0,
            num_cached_tokens: None,
            junction: 0,
            skip: r.skip_prefix_cache,
            arrival: if arrival.is_finite() {
                arrival.min(self.now)
            } else {
                self.now
            },
            first_token: None,
            preemptions: 0,
            remote: r.remote_kv,
            ready_at: None,
            tier_offered: 0,
        };
        Self::update_hashes(
            &self.hasher,
            self.params.hash_block as usize,
            self.lookahead,
            &mut req,
        );
        self.reqs.insert(handle, req);
        self.waiting.push_back(handle);
        Ok(handle)
    }

    /// Cancels a request (client gone); its blocks are freed.
    pub fn abort(&mut self, handle: u64) {
        if self.reqs.remove(&handle).is_some() {
            self.waiting.retain(|h| *h != handle);
            self.running.retain(|h| *h != handle);
            self.kv.free(handle);
        }
    }

    /// Hashes every block `[s, e)` not hashed yet with `e + lookahead ≤ n` (vLLM 0.33's
    /// `request_block_hasher`; without lookahead, every full block).
    fn update_hashes(hasher: &BlockHasher, h: usize, lookahead: usize, r: &mut Req) {
        while (r.digests.len() + 1) * h + lookahead <= r.tokens.len() {
            let i = r.digests.len();
            let (s, e) = (i * h, (i + 1) * h);
            let d = hasher.hash_block_lookahead(
                r.digests.last(),
                &r.tokens[s..e],
                &r.extras,
                i,
                &r.tokens[e..e + lookahead],
            );
            r.hashes.push(hash::external(&d).0);
            r.digests.push(d);
        }
    }

    /// `reset_prefix_cache`; fails while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset()
    }

    /// Events queued outside a step (a reset), taken for publishing: the device pool's, then
    /// the CPU tier's (vLLM's connector events follow the pool's in a batch).
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut events = self.kv.take_events();
        if let Some(cpu) = &mut self.cpu {
            let tier = cpu.take_events(&events);
            events.extend(tier);
        }
        events
    }

    /// Admits the first waiting request, `handle`, whose KV beyond the device's `hit` arrives
    /// from elsewhere (a prefill worker, the CPU tier): `load` more tokens are allocated and
    /// counted as computed, the request runs once `transfer_s` has passed, and it reports
    /// `cached` tokens. False, admitting nothing, when the pool cannot hold them.
    fn admit_loading(
        &mut self,
        handle: u64,
        hit: &crate::cache::Hit,
        load: usize,
        transfer_s: f64,
        cached: usize,
    ) -> bool {
        let Some(r) = self.reqs.get(&handle) else {
            return false;
        };
        let ctx = Self::ctx(r, self.lookahead);
        if self
            .kv
            .allocate_slots(&ctx, 0, load, hit.tokens, hit.blocks.as_deref(), 0, true)
            .is_none()
        {
            return false;
        }
        self.stats.prefix_cache_queries += r.tokens.len() as u64;
        self.stats.prefix_cache_hits += hit.tokens as u64;
        self.waiting.pop_front();
        self.running.push(handle);
        let ready = self.now + transfer_s;
        if let Some(r) = self.reqs.get_mut(&handle) {
            r.num_cached_tokens = Some(cached);
            r.num_computed = hit.tokens + load;
            r.ready_at = Some(ready);
        }
        true
    }

    /// (`num_cached_tokens`, tokens computed once loaded, the CPU blocks read) when the CPU
    /// tier serves more of `r` than the device's `hit`: the connector's hit from the
    /// block-aligned device hit; a whole prompt served still computes its last token.
    fn tier_load(&self, r: &Req, hit: usize) -> Option<(usize, usize, Vec<BlockId>)> {
        let cpu = self.cpu.as_ref().filter(|_| !r.skip)?;
        let n = r.tokens.len();
        let local = hit - hit % self.params.align.max(1) as usize;
        let (tier, blocks) = cpu.hit(&self.kv, n, local, &r.hashes);
        let total = local + tier;
        (total > hit).then(|| (total, total.min(n - 1), blocks))
    }

    /// The largest hit a request of `n` tokens may get: `n − 1` (the last token is always
    /// computed), and with lookahead no block past `n − L` has a hash.
    fn max_hit(&self, n: usize) -> usize {
        n.saturating_sub(self.lookahead.max(1))
    }

    fn ctx(r: &Req, lookahead: usize) -> ReqCtx<'_> {
        ReqCtx {
            id: r.handle,
            view: ReqView {
                tokens: &r.tokens,
                hashes: &r.hashes,
                extras: &r.extras,
                lookahead,
                lora_id: r.lora_id,
            },
            num_prompt: r.prompt_len,
            shared_prefix_boundary: r.junction,
        }
    }

    /// `_mamba_block_aligned_split` (no fine-grained hits).
    fn mamba_split(&self, r: &Req, n: usize, new_local: usize) -> usize {
        let start = r.num_computed + new_local;
        let prefill_end = r.prompt_len.max(r.tokens.len().saturating_sub(1));
        if start >= prefill_end {
            return n;
        }
        let b = self.params.scheduler_block as usize;
        let h = self.params.hash_block as usize;
        let proof = groups::Proof {
            eagle_drop: self.kv.cfg.eagle_drop,
            lookahead: self.lookahead,
        };
        let mut last_cache = groups::checkpoint_position(r.tokens.len(), b, proof);
        let mut end = start + n;
        let cp = groups::checkpoint_position(prefill_end, b, proof);
        let internal = self.cfg.prefill_checkpoints
            && end >= prefill_end
            && groups::checkpoint_valid(start, end, cp, h, b);
        if internal {
            last_cache = 0;
        }
        if end < prefill_end {
            let aligned = end / b * b;
            if aligned > start || b <= self.cfg.max_num_batched_tokens as usize {
                end = aligned;
            }
        }
        let next_boundary = (start / b + 1) * b;
        let j = r.junction as i64;
        let floored = start as i64 + (j - start as i64).div_euclid(b as i64) * b as i64;
        let stops = [
            if start % b != 0 && !internal {
                next_boundary as i64
            } else {
                0
            },
            last_cache as i64,
            if (start as i64) < j && j < end as i64 {
                floored
            } else {
                0
            },
        ];
        let end = stops
            .iter()
            .copied()
            .filter(|s| *s > start as i64 && *s < end as i64)
            .min()
            .map_or(end, |s| s as usize);
        end.saturating_sub(start)
    }

    fn preempt(&mut self, handle: u64) {
        self.kv.free(handle);
        if let Some(r) = self.reqs.get_mut(&handle) {
            r.num_computed = 0;
            r.preemptions += 1;
        }
        self.stats.preemptions += 1;
        self.waiting.push_front(handle);
    }

    /// One engine step: schedule, "run" (advance the clock by the time model), sample, free
    /// finished requests, and collect the step's events.
    pub fn step(&mut self) -> StepOutcome {
        self.kv.new_step_starts();
        let mut budget = self.cfg.max_num_batched_tokens as usize;
        let max_len = self.cfg.max_model_len as usize;
        let mamba = self.cfg.spec.has_mamba();
        let mut scheduled: Vec<(u64, usize)> = Vec::new();
        let mut lookups = Vec::new();
        let mut preempted = false;
        // A running request scheduled this step still prefills after it.
        let mut prefill_scheduled = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let handle = self.running[i];
            let Some(r) = self.reqs.get(&handle) else {
                self.running.remove(i);
                continue;
            };
            if r.ready_at.is_some_and(|t| t > self.now) {
                // Its KV is still being pulled.
                i += 1;
                continue;
            }
            let mut n = (r.tokens.len() - r.num_computed).min(budget);
            n = n.min(max_len.saturating_sub(r.num_computed + 1));
            if mamba {
                n = self.mamba_split(r, n, 0);
            }
            if n == 0 {
                i += 1;
                continue;
            }
            let mut ok = false;
            loop {
                let r = &self.reqs[&handle];
                let ctx = Self::ctx(r, self.lookahead);
                if self
                    .kv
                    .allocate_slots(&ctx, r.num_computed, n, 0, None, self.draft_slots, false)
                    .is_some()
                {
                    ok = true;
                    break;
                }
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                preempted = true;
                if victim == handle {
                    break;
                }
            }
            if !ok {
                break;
            }
            let r = &self.reqs[&handle];
            prefill_scheduled |= r.num_computed + n < r.tokens.len();
            scheduled.push((handle, n));
            budget -= n;
            i += 1;
        }
        let running_scheduled = scheduled.len();
        // Padded draft rows scheduled this step (counted as scheduled, never computed).
        let mut draft_rows = 0;
        if !preempted {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
                let Some(&handle) = self.waiting.front() else {
                    break;
                };
                let Some(r) = self.reqs.get(&handle) else {
                    self.waiting.pop_front();
                    continue;
                };
                let hit = if r.skip {
                    Default::default()
                } else {
                    self.kv
                        .find_longest_cache_hit(&r.hashes, self.max_hit(r.tokens.len()))
                };
                let tiered = if r.remote.is_some() {
                    None
                } else {
                    self.tier_load(r, hit.tokens)
                };
                lookups.push(Lookup {
                    handle,
                    event_pos: self.kv.pending_events(),
                    num_tokens: r.tokens.len(),
                    hit: hit.tokens,
                    tier: tiered.as_ref().map_or(0, |(total, ..)| total - hit.tokens),
                });
                let junction = hit.junction();
                if let Some(r) = self.reqs.get_mut(&handle) {
                    r.junction = junction;
                }
                let r = &self.reqs[&handle];
                if let Some(remote) = r.remote.filter(|_| !r.skip) {
                    // Pull every prompt token beyond the hit but the last; none of the budget.
                    let load = (r.tokens.len() - 1).saturating_sub(hit.tokens);
                    if load > 0 {
                        let pull_s = load as f64 * self.cfg.time.kv_transfer_token_s;
                        if !self.admit_loading(handle, &hit, load, pull_s, remote.cached_tokens) {
                            break;
                        }
                        if let Some(r) = self.reqs.get_mut(&handle) {
                            r.remote = None;
                        }
                        continue;
                    }
                }
                if let Some((total, computed, blocks)) = tiered {
                    // The CPU tier serves more than the device: load it, then compute the rest.
                    let loaded = total - hit.tokens;
                    let load_s = loaded as f64 * self.cfg.time.cpu_load_token_s;
                    if !self.admit_loading(handle, &hit, computed - hit.tokens, load_s, total) {
                        break;
                    }
                    if let Some(cpu) = &mut self.cpu {
                        cpu.loaded(&blocks);
                    }
                    self.stats.tier_hits += loaded as u64;
                    if let Some(r) = self.reqs.get_mut(&handle) {
                        r.tier_offered = total.min(r.prompt_len);
                    }
                    continue;
                }
                let mut n = r.tokens.len() - hit.tokens;
                // Speculative decoding pads an admission with one token left (a hit on all
                // but the last) to a decode step's `1 + k` rows; those k draft rows are
                // rejected at once (no drafter runs), but their slots are allocated.
                let k = self
                    .cfg
                    .speculative
                    .as_ref()
                    .map_or(0, |s| s.num_speculative_tokens);
                let k = k as usize;
                let pad = k > 0
                    && n == 1
                    && !prefill_scheduled
                    && (running_scheduled > 0 || hit.tokens > 0)
                    // Room for the rows and the sampled token.
                    && hit.tokens + 1 + k < max_len;
                if pad {
                    if 1 + k > budget {
                        break;
                    }
                    n = 1 + k;
                }
                n = n.min(budget);
                if mamba {
                    n = self.mamba_split(r, n, hit.tokens);
                }
                if n == 0 {
                    break;
                }
                // Rows past the request's tokens: the padding, unless alignment clipped it.
                let drafts = if pad && n == 1 + k { k } else { 0 };
                if pad && drafts == 0 {
                    n = 1;
                }
                let ctx = Self::ctx(r, self.lookahead);
                if self
                    .kv
                    .allocate_slots(
                        &ctx,
                        0,
                        n,
                        hit.tokens,
                        hit.blocks.as_deref(),
                        self.draft_slots,
                        true,
                    )
                    .is_none()
                {
                    break;
                }
                if !r.skip {
                    self.stats.prefix_cache_queries += r.tokens.len() as u64;
                    self.stats.prefix_cache_hits += hit.tokens as u64;
                }
                self.waiting.pop_front();
                self.running.push(handle);
                if let Some(r) = self.reqs.get_mut(&handle) {
                    if r.num_cached_tokens.is_none() {
                        // A decode request whose prompt is all local still reports the
                        // prefill worker's count.
                        let reported = r.remote.map_or(hit.tokens, |x| x.cached_tokens);
                        r.num_cached_tokens = Some(reported);
                    }
                    r.remote = None;
                    r.num_computed = hit.tokens;
                }
                scheduled.push((handle, n - drafts));
                draft_rows += drafts;
                budget -= n;
            }
        }
        let mut out = StepOutcome {
            lookups,
            ..StepOutcome::default()
        };
        if scheduled.is_empty() {
            out.events = self.take_events();
            return out;
        }
        let mut work = crate::timing::StepWork::default();
        for (handle, n) in &scheduled {
            if let Some(r) = self.reqs.get_mut(handle) {
                if r.num_computed >= r.prompt_len && *n == 1 {
                    work.decode(r.num_computed);
                } else {
                    work.prefill(r.num_computed, *n);
                }
                r.num_computed += n;
            }
        }
        out.duration_s = self.cfg.time.step_seconds(&work);
        out.scheduled_tokens = scheduled.iter().map(|(_, n)| n).sum::<usize>() + draft_rows;
        self.now += out.duration_s;
        self.stats.steps += 1;
        for (handle, _) in &scheduled {
            self.sample(*handle, &mut out);
        }
        if let Some(cpu) = &mut self.cpu {
            for (handle, _) in &scheduled {
                if let Some(r) = self.reqs.get_mut(handle) {
                    let to = r.num_computed.min(r.prompt_len);
                    cpu.offer(
                        &self.kv,
                        &r.tokens,
                        &r.hashes,
                        r.prompt_len,
                        r.tier_offered,
                        to,
                    );
                    r.tier_offered = r.tier_offered.max(to);
                }
            }
        }
        out.events = self.take_events();
        out
    }

    fn sample(&mut self, handle: u64, out: &mut StepOutcome) {
        let now = self.now;
        let vocab = self.cfg.spec.vocab_size.max(1);
        let max_len = self.cfg.max_model_len as usize;
        let lookahead = self.lookahead;
        let Some(r) = self.reqs.get_mut(&handle) else {
            return;
        };
        if r.num_computed < r.tokens.len() {
            return;
        }
        let k = r.outputs();
        let token = r.forced.get(k).copied().unwrap_or_else(|| {
            let x = xxhash_rust::xxh3::xxh3_64_with_seed(&(k as u64).to_le_bytes(), r.seed);
            crate::tokens::sample_id(x, vocab)
        });
        r.tokens.push(token);
        if r.first_token.is_none() {
            r.first_token = Some(now);
        }
        let done = r.outputs() >= r.max_tokens || r.tokens.len() >= max_len;
        let finished = done.then(|| Finished {
            prompt_tokens: r.prompt_len,
            completion_tokens: r.outputs(),
            ttft_s: r.first_token.unwrap_or(now) - r.arrival,
            e2e_s: now - r.arrival,
            preemptions: r.preemptions,
        });
        out.tokens.push(TokenOut {
            handle,
            token,
            num_cached_tokens: r.num_cached_tokens.unwrap_or(0),
            finished: finished.clone(),
        });
        self.stats.generation_tokens += 1;
        Self::update_hashes(&self.hasher, self.params.hash_block as usize, lookahead, r);
        if self.cache_after_output {
            self.kv
                .cache_blocks(&Self::ctx(r, lookahead), r.num_computed);
        }
        if let Some(f) = finished {
            self.stats.finished += 1;
            self.stats.prompt_tokens += f.prompt_tokens as u64;
            self.running.retain(|h| *h != handle);
            self.kv.free(handle);
            self.reqs.remove(&handle);
        }
    }

    /// The request's hit if it arrived now (no state change): for tests and the admin view.
    pub fn peek_hit(&self, prompt: &[u32], salt: Option<&str>, lora: Option<&Lora>) -> usize {
        let extras = BlockExtras {
            cache_salt: salt.map(str::to_string),
            lora: lora.map(|l| (l.name.clone(), l.path.clone())),
        };
        let h = self.params.hash_block as usize;
        let hashes: Vec<u64> = self
            .hasher
            .chain_lookahead(prompt, h, &extras, self.lookahead)
            .iter()
            .map(|d| hash::external(d).0)
            .collect();
        self.kv
            .find_longest_cache_hit(&hashes, self.max_hit(prompt.len()))
            .tokens
    }
}
