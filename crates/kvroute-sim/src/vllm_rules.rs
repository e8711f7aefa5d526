//! The simulated engine's own reading of vLLM's rules that kvroute-index also implements: what
//! a speculative configuration turns on per engine generation ([`SpecRules`]), the
//! `OffloadingConnector`'s scheduler-side lookup ([`ChunkGroup`], [`offloading_lookup`]) and
//! where the `SimpleCPUOffloadConnector`'s lookup starts ([`simple_cpu_start`]).
//!
//! Owns: these rules, written from vLLM 0.32's and 0.33's sources (`config/speculative.py`,
//! `VllmConfig.num_hash_lookahead_tokens` and `num_lookahead_tokens`, the scheduler's
//! `update_from_output`, `offloading/scheduler.py`'s
//! `_lookup_complete_chunks`, `simple_kv_offload/manager.py`'s `get_num_new_matched_tokens`),
//! as plain loops over the simulator's own types.
//! Invariants: shares no rule, layout or tier function with kvroute-index (only its
//! configuration types, `Speculative` and `Engine`), so the index, its reference model and the
//! simulator can disagree about a wrong rule; the conformance oracle fixtures check all three.
//! Must not: hold state, or model what makes a connector wait a step (a store still being
//! written, a chunk being loaded, a backend asking to retry) or the drafter-chunk pop (the
//! engine refuses an `OffloadingConnector` tier with flagged drafter groups).

use crate::spec::GroupKind;
use kvroute_index::{Engine as Generation, Speculative};

/// What one speculative configuration turns on in an engine generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecRules {
    /// `num_hash_lookahead_tokens` (vLLM 0.33; 0 on 0.32): each block hash covers the next `L`
    /// tokens.
    pub lookahead: u32,
    /// Matches drop the EAGLE block (`use_eagle_block_drop()`, and on 0.33 only without
    /// lookahead hashes).
    pub eagle_drop: bool,
    /// The engine flags the groups holding the drafter's layers (`is_eagle_group`).
    pub drafter_groups_flagged: bool,
    /// `VllmConfig.num_lookahead_tokens`: KV slots the scheduler allocates past a request's
    /// scheduled tokens for the drafter's KV (k for EAGLE-style methods, MTP, DSpark drafting
    /// from its anchor and a draft model; k + 1 for DFlash; 0 for n-gram and suffix
    /// decoding).
    pub draft_slots: u32,
    /// 0.33 caches a request's computed blocks again right after a sampled token arrives
    /// (`update_from_output`, under any speculative method): a block whose lookahead hash
    /// only that token completes is cached in the same step, even when the request finishes.
    pub cache_after_output: bool,
}

impl SpecRules {
    /// The rules of `generation` under `speculative` (none without speculation). An engine
    /// with a KV connector keeps `L = 0` on 0.33; the simulator's tiers run beside 0.32's
    /// rules or 0.33's without lookahead only as the caller configures them.
    pub fn of(generation: Generation, speculative: Option<&Speculative>) -> SpecRules {
        let Some(s) = speculative else {
            return SpecRules::default();
        };
        // vLLM rewrites every model-specific MTP method (`deepseek_mtp`, …) to `mtp`.
        let method = if s.method == "mtp" || s.method.ends_with("_mtp") {
            "mtp"
        } else {
            s.method.as_str()
        };
        let hidden_state_drafter = ["eagle", "eagle3", "mtp", "dflash", "dspark"].contains(&method);
        // 0.33: DFlash and DSpark build a position's draft KV without the next token.
        let needs_drop = match generation {
            Generation::Vllm032 => hidden_state_drafter,
            Generation::Vllm033 => hidden_state_drafter && method != "dflash" && method != "dspark",
        };
        let block_drop = needs_drop && !s.disable_eagle_block_drop;
        let mut lookahead = 0;
        if generation == Generation::Vllm033 && block_drop && !s.disable_lookahead_block_hashes {
            // `num_prefill_lookahead_tokens`: k for multi-module MTP, else the next token.
            let modules = s.num_nextn_predict_layers.unwrap_or(1);
            lookahead = if method == "mtp" && modules.min(s.num_speculative_tokens) > 1 {
                s.num_speculative_tokens
            } else {
                1
            };
        }
        let drafter_groups_flagged = match generation {
            // 0.32 flags a group for MTP (its last layer's) and DSpark's spec only.
            Generation::Vllm032 => method == "mtp" || method == "dspark",
            // 0.33 marks every draft layer.
            Generation::Vllm033 => true,
        };
        // DSpark with a fill-in drafter (not sampling from its anchor) needs k + 1 as DFlash
        // does; the configuration does not say which, and the anchor-sampling default is taken.
        let draft_slots = match method {
            "dflash" => s.num_speculative_tokens + 1,
            "eagle" | "eagle3" | "mtp" | "dspark" | "draft_model" => s.num_speculative_tokens,
            _ => 0,
        };
        SpecRules {
            lookahead,
            eagle_drop: block_drop && lookahead == 0,
            drafter_groups_flagged,
            draft_slots,
            cache_after_output: generation == Generation::Vllm033 && s.num_speculative_tokens > 0,
        }
    }
}

/// One group as the `OffloadingConnector` offloads it (`GroupOffloadConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkGroup {
    /// The engine's group index (slots are keyed by it).
    pub group: u32,
    /// Tokens per chunk: the block size × blocks per chunk.
    pub tokens_per_chunk: usize,
    /// Hash blocks per chunk; a chunk's key is the hash of its last one.
    pub hashes_per_chunk: usize,
    /// `sliding_window_size_in_chunks`; `None` for full attention.
    pub window_chunks: Option<usize>,
    /// A sliding window's tokens (its first lookup may need one chunk more).
    pub sliding_window: Option<usize>,
    /// A Mamba group (align mode).
    pub mamba: bool,
}

impl ChunkGroup {
    /// Group `group` of `kind` and `block_size`, `blocks_per_chunk` blocks a chunk, over hashes
    /// of `hash_block` tokens; `None` when a chunk holds no whole hash block.
    pub fn new(
        group: u32,
        kind: GroupKind,
        block_size: u32,
        blocks_per_chunk: u32,
        hash_block: u32,
    ) -> Option<ChunkGroup> {
        let c = block_size as usize * blocks_per_chunk.max(1) as usize;
        let hashes_per_chunk = c / (hash_block.max(1) as usize);
        if c == 0 || hashes_per_chunk == 0 {
            return None;
        }
        let ceil = |a: usize| a.div_ceil(c);
        let (window_chunks, sliding_window) = match kind {
            GroupKind::FullAttention => (None, None),
            GroupKind::SlidingWindow { window } => {
                let w = window as usize;
                (Some(ceil(w).max(ceil(w.saturating_sub(1)))), Some(w))
            }
            GroupKind::ChunkedLocal { chunk } => (Some(ceil(chunk as usize)), None),
            GroupKind::Mamba => (Some(1), None),
        };
        Some(ChunkGroup {
            group,
            tokens_per_chunk: c,
            hashes_per_chunk,
            window_chunks,
            sliding_window,
            mamba: matches!(kind, GroupKind::Mamba),
        })
    }
}

/// The tokens after `local` the `OffloadingConnector` loads for a request of `n` tokens whose
/// hash chain is `hashes`, when `held(group, key)` says what its tier holds: full-attention
/// groups scan from the left, windowed ones (largest window first) from the right; a group
/// that lowers the end sends the windowed groups round again.
pub fn offloading_lookup(
    n: usize,
    local: usize,
    hashes: &[u64],
    groups: &[ChunkGroup],
    held: impl Fn(u32, u64) -> bool,
) -> usize {
    let mut full: Vec<usize> = Vec::new();
    let mut windowed: Vec<usize> = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        match g.window_chunks {
            None => full.push(i),
            Some(_) => windowed.push(i),
        }
    }
    // Largest window first; equal windows keep their order.
    windowed.sort_by(|a, b| groups[*b].window_chunks.cmp(&groups[*a].window_chunks));
    let mut order = full;
    order.extend(windowed.iter().copied());

    let local = local as i64;
    let mut end = n as i64;
    if !windowed.is_empty() {
        // The last prompt token is computed again for its logits.
        end -= 1;
        if let Some(m) = groups.iter().find(|g| g.mamba) {
            let c = m.tokens_per_chunk as i64;
            end = end.div_euclid(c) * c;
        }
    }
    let mut hit: i64 = 0;
    let mut pending = order;
    while !pending.is_empty() {
        let pass = std::mem::take(&mut pending);
        let mut window_seen = false;
        for gi in pass {
            let g = &groups[gi];
            let c = g.tokens_per_chunk as i64;
            let num_keys = (hashes.len() / g.hashes_per_chunk) as i64;
            let key = |chunk: i64| hashes[(chunk as usize + 1) * g.hashes_per_chunk - 1];
            end = end.min(num_keys * c);
            if end - local < c {
                return 0;
            }
            let last_chunk = ((end + c - 1) / c).min(num_keys);
            let first_chunk = local / c;
            let found = match g.window_chunks {
                None => {
                    let mut run = 0;
                    let mut chunk = first_chunk;
                    while chunk < last_chunk && held(g.group, key(chunk)) {
                        run += 1;
                        chunk += 1;
                    }
                    run
                }
                Some(window) => {
                    let window = window as i64;
                    let mut first_need = window;
                    if let Some(w) = g.sliding_window {
                        let candidate = end.min(last_chunk * c);
                        let pad = (c - candidate % c) % c;
                        first_need = first_need.max((w as i64 - 1 + pad + c - 1) / c);
                    }
                    let mut need = first_need;
                    let mut run = 0;
                    let mut answer = None;
                    let mut chunk = last_chunk - 1;
                    while chunk >= first_chunk {
                        if held(g.group, key(chunk)) {
                            run += 1;
                        } else {
                            run = 0;
                            need = window;
                        }
                        if run == need {
                            answer = Some(chunk - first_chunk + need);
                            break;
                        }
                        chunk -= 1;
                    }
                    answer.unwrap_or(run)
                }
            };
            if found == 0 {
                return 0;
            }
            end = end.min(c * (first_chunk + found));
            let now = end - local;
            if now < c {
                return 0;
            }
            if now < hit && window_seen && pending.is_empty() {
                pending = windowed.clone();
            }
            window_seen |= g.window_chunks.is_some();
            hit = now;
        }
    }
    hit.max(0) as usize
}

/// Where the `SimpleCPUOffloadConnector` looks for a request of `n` tokens (a chain of
/// `chain_len` hashes of `hash_block` tokens) whose device hit handed over is `local`:
/// `Some((skipped, max_hit_len))` — the chain from hash `skipped` on, the hit at most
/// `n − 1 − local` tokens — or `None` when it serves nothing: `local` off the scheduler block
/// `sched_block` (copies are whole blocks), on 0.33 off a chunked local group's `chunk`, no
/// hash left, or no token left to load.
pub fn simple_cpu_start(
    n: usize,
    local: usize,
    hash_block: u32,
    sched_block: u32,
    chunk: Option<u32>,
    generation: Generation,
    chain_len: usize,
) -> Option<(usize, usize)> {
    if local % (sched_block.max(1) as usize) != 0 {
        return None;
    }
    if generation == Generation::Vllm033 {
        if let Some(c) = chunk {
            if c > 0 && local % c as usize != 0 {
                return None;
            }
        }
    }
    let skipped = local / (hash_block.max(1) as usize);
    if skipped >= chain_len {
        return None;
    }
    let max_hit_len = n as i64 - 1 - local as i64;
    if max_hit_len <= 0 {
        return None;
    }
    Some((skipped, max_hit_len as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(method: &str, k: u32) -> Speculative {
        Speculative {
            method: method.into(),
            num_speculative_tokens: k,
            num_nextn_predict_layers: None,
            disable_lookahead_block_hashes: false,
            disable_eagle_block_drop: false,
        }
    }

    #[test]
    fn eagle_drops_on_0_32_hashes_one_lookahead_token_on_0_33_and_reserves_k_draft_slots_on_both() {
        let s = spec("eagle", 2);
        let on_032 = SpecRules::of(Generation::Vllm032, Some(&s));
        assert_eq!((on_032.lookahead, on_032.eagle_drop), (0, true));
        assert!(!on_032.drafter_groups_flagged);
        let on_033 = SpecRules::of(Generation::Vllm033, Some(&s));
        assert_eq!((on_033.lookahead, on_033.eagle_drop), (1, false));
        let mut legacy = s.clone();
        legacy.disable_lookahead_block_hashes = true;
        let r = SpecRules::of(Generation::Vllm033, Some(&legacy));
        assert_eq!((r.lookahead, r.eagle_drop), (0, true));
        assert_eq!(
            (on_032.draft_slots, on_033.draft_slots, r.draft_slots),
            (2, 2, 2)
        );
    }

    #[test]
    fn multi_module_mtp_looks_ahead_k_tokens_and_dflash_stops_dropping_on_0_33() {
        let mut mtp = spec("deepseek_mtp", 3);
        mtp.num_nextn_predict_layers = Some(3);
        assert_eq!(SpecRules::of(Generation::Vllm033, Some(&mtp)).lookahead, 3);
        assert!(SpecRules::of(Generation::Vllm032, Some(&mtp)).drafter_groups_flagged);
        assert!(SpecRules::of(Generation::Vllm032, Some(&spec("dflash", 2))).eagle_drop);
        assert_eq!(
            SpecRules::of(Generation::Vllm033, Some(&spec("dflash", 2))),
            SpecRules {
                lookahead: 0,
                eagle_drop: false,
                drafter_groups_flagged: true,
                draft_slots: 3,
                cache_after_output: true,
            }
        );
        assert_eq!(
            SpecRules::of(Generation::Vllm032, Some(&spec("ngram", 2))),
            SpecRules::default()
        );
    }

    #[test]
    fn a_full_attention_chunk_run_from_the_device_hit_is_the_offloaded_hit() {
        let g = ChunkGroup::new(0, GroupKind::FullAttention, 16, 1, 16).unwrap();
        let chain: Vec<u64> = (0..12).collect();
        let held = |_: u32, k: u64| k < 10;
        assert_eq!(48 + offloading_lookup(200, 48, &chain, &[g], held), 160);
        let gap = |_: u32, k: u64| k < 10 && k != 3;
        assert_eq!(offloading_lookup(200, 48, &chain, &[g], gap), 0);
    }

    #[test]
    fn a_window_group_needs_its_last_window_below_n_minus_one() {
        let f = ChunkGroup::new(0, GroupKind::FullAttention, 16, 1, 16).unwrap();
        let w = ChunkGroup::new(1, GroupKind::SlidingWindow { window: 128 }, 16, 1, 16).unwrap();
        let chain: Vec<u64> = (0..12).collect();
        // Window chunks only from 2 on: the last window (chunks 3..11) is all there.
        let held = |g: u32, k: u64| g == 0 || k >= 2;
        assert_eq!(48 + offloading_lookup(192, 48, &chain, &[f, w], held), 191);
    }

    #[test]
    fn a_simple_cpu_lookup_starts_on_the_scheduler_block_below_the_last_token() {
        let g = Generation::Vllm032;
        assert_eq!(simple_cpu_start(100, 32, 16, 16, None, g, 6), Some((2, 67)));
        assert_eq!(simple_cpu_start(300, 48, 16, 64, None, g, 18), None);
        assert_eq!(simple_cpu_start(33, 32, 16, 16, None, g, 2), None);
        let g = Generation::Vllm033;
        assert_eq!(simple_cpu_start(300, 64, 16, 64, Some(128), g, 18), None);
        assert_eq!(
            simple_cpu_start(300, 128, 16, 64, Some(128), g, 18),
            Some((8, 171))
        );
    }
}
