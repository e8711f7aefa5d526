//! The reference model's offload tier lookups, as plain loops.
//!
//! Owns: the device hit extended by a tier (`with_tier`), the `OffloadingConnector`'s
//! `_lookup_complete_chunks` and the `SimpleCPUOffloadConnector`'s `get_num_new_matched_tokens`.
//! Invariant: shares no code with the index's `tier` or `tier_lookup`.
//! Must not: be used on a hot path.

use super::{Ctx, RefGroup, RefRank};
use crate::engine::Engine;
use crate::event::Rule;
use crate::rank::WorkerConfig;
use crate::tier::OffloadConnector;

impl Ctx<'_> {
    /// The device hit `device` extended by the offload tier that serves most, by the worker's
    /// connector. vLLM's scheduler hands the connector its device hit rounded down to the
    /// scheduler block (`block_aligned_local`) and keeps the connector's hit only when it goes
    /// past the unrounded one.
    pub(super) fn with_tier(
        &self,
        lookups: &[(RefGroup, Vec<u32>)],
        n: usize,
        device: u64,
        cfg: &WorkerConfig,
    ) -> u64 {
        let local = device - device % self.p.sched;
        let mut best = device;
        let media: Vec<&String> = self.rank.tiers.keys().map(|(m, _)| m).collect();
        for medium in media {
            let ext = match cfg.lookup.offload_connector {
                OffloadConnector::Offloading => self.offloading_hit(n, local, medium, cfg),
                OffloadConnector::SimpleCpu => self.simple_cpu_hit(lookups, n, local, medium, cfg),
            };
            best = best.max(local + ext);
        }
        best
    }

    /// Does the tier `medium` hold `key` in group `group`?
    pub(super) fn tier_holds(&self, medium: &str, group: u32, key: u64) -> bool {
        self.rank
            .tiers
            .get(&(medium.to_string(), group))
            .is_some_and(|held| held.contains(&key))
    }

    /// The `OffloadingConnector`'s scheduler-side lookup (`_lookup_complete_chunks` in
    /// `offloading/scheduler.py`, vLLM 0.32 and 0.33) as plain loops: the tokens after `local`
    /// it can load from `medium`. No group is a flagged drafter group here (`predict` asks only
    /// then), no lookup is deferred, no chunk is being loaded, no `max_load_tokens`.
    pub(super) fn offloading_hit(
        &self,
        n: usize,
        local: u64,
        medium: &str,
        cfg: &WorkerConfig,
    ) -> u64 {
        /// One offloaded group (`GroupOffloadConfig`).
        struct Offloaded {
            group: u32,
            tokens_per_chunk: i64,
            hashes_per_chunk: usize,
            /// `sliding_window_size_in_chunks` (`None`: full attention).
            window_chunks: Option<i64>,
            /// A sliding window's tokens (`load_window_size_in_chunks` widens by it).
            sliding_window: Option<i64>,
        }
        let blocks_per_chunk = i64::from(cfg.lookup.offload_chunk_blocks.unwrap_or(1).max(1));
        let hash_block = i64::from(self.p.hash_block);
        let mut configs: Vec<Offloaded> = Vec::new();
        let mut mamba_align: Option<i64> = None;
        for (id, spec) in &self.rank.layout.groups {
            let rule = spec.rule();
            if rule == Rule::NotCacheable || spec.block_size == 0 {
                continue;
            }
            let c = i64::from(spec.block_size) * blocks_per_chunk;
            let hashes_per_chunk = (c / hash_block) as usize;
            if hashes_per_chunk == 0 {
                continue;
            }
            let (window_chunks, sliding_window) = match rule {
                Rule::FullAttention => (None, None),
                Rule::SlidingWindow => {
                    let Some(w) = spec.window.filter(|w| *w > 0).map(i64::from) else {
                        continue;
                    };
                    // max(⌈w / c⌉, ⌈(w − 1 + extra_retained_tokens) / c⌉), no extra tokens.
                    let a = (w + c - 1) / c;
                    let b = (w - 1 + c - 1) / c;
                    (Some(a.max(b)), Some(w))
                }
                Rule::ChunkedLocal => {
                    let Some(chunk) = self.chunk.or(spec.window).filter(|c| *c > 0) else {
                        continue;
                    };
                    (Some((i64::from(chunk) + c - 1) / c), None)
                }
                Rule::Mamba => {
                    mamba_align = Some(c);
                    (Some(1), None)
                }
                Rule::NotCacheable => continue,
            };
            configs.push(Offloaded {
                group: *id,
                tokens_per_chunk: c,
                hashes_per_chunk,
                window_chunks,
                sliding_window,
            });
        }
        // Full attention first, then the windowed groups by window, largest first (a stable
        // sort, as Python's).
        let mut full_groups: Vec<usize> = Vec::new();
        let mut window_groups: Vec<usize> = Vec::new();
        for (i, g) in configs.iter().enumerate() {
            if g.window_chunks.is_none() {
                full_groups.push(i);
            } else {
                window_groups.push(i);
            }
        }
        window_groups.sort_by_key(|i| std::cmp::Reverse(configs[*i].window_chunks));
        let mut all_groups = full_groups.clone();
        all_groups.extend(window_groups.iter().copied());

        let local = local as i64;
        let mut max_hit = n as i64;
        if !window_groups.is_empty() {
            // The last prompt token is computed again.
            max_hit -= 1;
            if let Some(m) = mamba_align {
                max_hit -= max_hit.rem_euclid(m);
            }
        }
        let mut num_hit: i64 = 0;
        let mut lookup_groups = all_groups.clone();
        while !lookup_groups.is_empty() {
            let mut looked_up_window = false;
            let this_pass = std::mem::take(&mut lookup_groups);
            for gi in this_pass {
                let g = &configs[gi];
                let c = g.tokens_per_chunk;
                // The group's keys: the hash ending each whole chunk.
                let mut keys: Vec<u64> = Vec::new();
                let mut idx = g.hashes_per_chunk - 1;
                while idx < self.hashes.len() {
                    keys.push(self.hashes[idx]);
                    idx += g.hashes_per_chunk;
                }
                let num_keys = keys.len() as i64;
                max_hit = max_hit.min(num_keys * c);
                if max_hit - local < c {
                    return 0;
                }
                let num_chunks = ((max_hit + c - 1) / c).min(num_keys);
                let start = local / c;
                let window: Vec<u64> = if start < num_chunks {
                    keys[start as usize..num_chunks as usize].to_vec()
                } else {
                    Vec::new()
                };
                let holds = |key: u64| self.tier_holds(medium, g.group, key);
                let num_hit_chunks: i64 = match g.window_chunks {
                    None => {
                        // The longest run of held keys from the start.
                        let mut count = 0;
                        for key in &window {
                            if !holds(*key) {
                                break;
                            }
                            count += 1;
                        }
                        count
                    }
                    Some(required) => {
                        let candidate_end = max_hit.min(num_chunks * c);
                        // `load_window_size_in_chunks`: a sliding window also covers the
                        // chunk the end rounds up into.
                        let mut initial = required;
                        if let Some(w) = g.sliding_window {
                            let pad = (-candidate_end).rem_euclid(c);
                            initial = initial.max((w - 1 + pad + c - 1) / c);
                        }
                        // Scanning from the right: the end of the first run of `need` held
                        // keys (`initial` for the run touching the right edge), else the
                        // length of the run reaching the start.
                        let mut consecutive = 0i64;
                        let mut need = if initial != 0 { initial } else { required };
                        let mut found = None;
                        for i in (0..window.len()).rev() {
                            if holds(window[i]) {
                                consecutive += 1;
                            } else {
                                consecutive = 0;
                                need = required;
                            }
                            if consecutive == need {
                                found = Some(i as i64 + need);
                                break;
                            }
                        }
                        found.unwrap_or(consecutive)
                    }
                };
                if num_hit_chunks == 0 {
                    return 0;
                }
                max_hit = max_hit.min(c * (start + num_hit_chunks));
                let new_num_hit = max_hit - local;
                if new_num_hit < c {
                    return 0;
                }
                if new_num_hit < num_hit && looked_up_window && lookup_groups.is_empty() {
                    // A window group looked up at a longer end is looked up again.
                    lookup_groups = window_groups.clone();
                }
                looked_up_window |= g.window_chunks.is_some();
                num_hit = new_num_hit;
            }
        }
        num_hit.max(0) as u64
    }

    /// The `SimpleCPUOffloadConnector`'s `get_num_new_matched_tokens` (`simple_kv_offload/
    /// manager.py`): the coordinator's own rules over the tier's blocks, on the hashes after
    /// `local`, at most `n − 1 − local`.
    pub(super) fn simple_cpu_hit(
        &self,
        lookups: &[(RefGroup, Vec<u32>)],
        n: usize,
        local: u64,
        medium: &str,
        cfg: &WorkerConfig,
    ) -> u64 {
        // Copies are whole scheduler blocks.
        if !local.is_multiple_of(self.p.sched) {
            return 0;
        }
        // 0.33: the suffix's chunk boundaries must be the request's.
        if cfg.engine == Engine::Vllm033 {
            for (spec, _) in lookups {
                if spec.rule() != Rule::ChunkedLocal {
                    continue;
                }
                if let Some(chunk) = self.chunk.or(spec.window).filter(|c| *c > 0) {
                    if !local.is_multiple_of(u64::from(chunk)) {
                        return 0;
                    }
                }
            }
        }
        let skipped = (local / u64::from(self.p.hash_block.max(1))) as usize;
        if skipped >= self.hashes.len() {
            return 0;
        }
        let max_hit_len = n as i64 - 1 - local as i64;
        if max_hit_len <= 0 {
            return 0;
        }
        let mut cpu = RefRank {
            layout: self.rank.layout.clone(),
            ..RefRank::default()
        };
        for ((med, g), held) in &self.rank.tiers {
            if med == medium {
                cpu.blocks.insert(*g, held.clone());
            }
        }
        let ctx = Ctx {
            rank: &cpu,
            hashes: &self.hashes[skipped..],
            p: self.p,
            chunk: self.chunk,
        };
        if self.p.eagle {
            ctx.coordinate_eagle(lookups, max_hit_len as u64)
        } else {
            ctx.coordinate(lookups, max_hit_len as u64)
        }
    }
}
