//! The live hash check of one rank: each reproducible store recomputed with the worker's hash
//! settings and compared with the engine's hashes, and the lookahead-token check.
//!
//! Owns: `RankState::check_lookahead`, `RankState::check_hashes` (a store is reproducible when
//! its blocks are dense at the hash block size, its extra keys are at most the first block's
//! salt, it names no LoRA adapter, and its parent's digest is known: raw in the event, or
//! remembered), `RankState::remember_digests`, and the first-block salt reader.
//! Invariants: the checks run after the store is applied and only observe it: a mismatch is
//! counted and logged once per rank and reason, and the store stays applied either way; a
//! checked store counts once, as matched, mismatched or unverifiable (none is checked before
//! the layout gives a hash block size); of the stores, only a matched one's digests are
//! remembered (beside those of the requests the router hashed, `remember_digests`); the
//! digest cache is emptied whenever adding a store's digests would take it past
//! `DIGEST_CACHE_MAX` entries.
//! Must not: change the rank's holders or layout.

use super::{HashMode, RankState, DIGEST_CACHE_MAX};
use crate::counters::{Counter, Counters};
use crate::event::{KeyValue, Stored};
use crate::hash::{self, BlockExtras, BlockHasher, Digest};

impl RankState {
    /// A store whose lookahead tokens (their count; 0 without) differ from the worker's
    /// configured count: the router hashes this worker's requests otherwise than the engine
    /// does.
    pub(super) fn check_lookahead(&mut self, ev: &Stored, counters: &Counters) {
        if ev.hashes.is_empty() {
            return;
        }
        let want = self.config.rules().lookahead as usize;
        let got = match &ev.lookahead_token_ids {
            None => 0,
            Some(l) => l.first().map_or(0, Vec::len),
        };
        if got != want {
            let detail = format!(
                "a store's hashes cover {got} lookahead tokens, the worker is configured for \
                 {want}: set the worker's engine and hash_lookahead_tokens (docs/engines.md)"
            );
            self.refuse(Counter::LookaheadMismatch, 1, counters, &ev.worker, &detail);
        }
    }

    /// The live hash check: recompute a reproducible store and compare.
    pub(super) fn check_hashes(&mut self, ev: &Stored, counters: &Counters) {
        let Some(params) = self.plan.params else {
            return;
        };
        let h = params.hash_block as usize;
        let reproducible_extras = ev.lora_name.is_none()
            && match &ev.extra_keys {
                None => true,
                Some(keys) => keys.iter().enumerate().all(|(i, k)| {
                    k.is_none() || (i == 0 && ev.parent.is_none() && first_salt(ev).is_some())
                }),
            };
        // vLLM 0.33's lookahead hashes: the tokens after each block, one entry per hash.
        let lookahead = ev.lookahead_token_ids.as_deref();
        let dense = ev.block_size as usize == h
            && !ev.hashes.is_empty()
            && ev.hashes.len() * h == ev.token_ids.len()
            && lookahead.is_none_or(|l| l.len() == ev.hashes.len());
        let parent: Option<Option<Digest>> = match &ev.parent {
            None => Some(None),
            Some(p) => match &p.raw {
                Some(raw) if raw.len() == 32 => {
                    let mut d = [0u8; 32];
                    d.copy_from_slice(raw);
                    Some(Some(d))
                }
                _ => self.digests.get(&p.value.0).map(|d| Some(*d)),
            },
        };
        let (true, true, Some(mut parent)) = (dense, reproducible_extras, parent) else {
            counters.add(Counter::HashCheckUnverifiable, 1);
            self.stats.hash_unverifiable += 1;
            return;
        };
        if self.hasher.is_none() {
            // Built on the first store that can be checked (its seed digest is a SHA-256).
            if let HashMode::Engine { algo, seed } = &self.config.hash {
                self.hasher = Some(BlockHasher::new(*algo, seed));
            }
        }
        let Some(hasher) = &self.hasher else { return };
        let extras = BlockExtras {
            cache_salt: if ev.parent.is_none() {
                first_salt(ev)
            } else {
                None
            },
            lora: None,
        };
        let mut ok = true;
        let mut computed = Vec::with_capacity(ev.hashes.len());
        for (i, (block, got)) in ev.token_ids.chunks_exact(h).zip(&ev.hashes).enumerate() {
            let idx = if ev.parent.is_none() { i } else { i + 1 };
            let after = lookahead
                .and_then(|l| l.get(i))
                .map_or(&[][..], Vec::as_slice);
            let d = hasher.hash_block_lookahead(parent.as_ref(), block, &extras, idx, after);
            let matches = match &got.raw {
                Some(raw) => raw.as_ref() == d.as_slice() || hash::external(&d) == got.value,
                None => hash::external(&d) == got.value,
            };
            ok &= matches;
            computed.push((got.value.0, d));
            parent = Some(d);
        }
        if ok {
            if self.digests.len() + computed.len() > DIGEST_CACHE_MAX {
                self.digests.clear();
            }
            self.digests.extend(computed);
            counters.add(Counter::HashCheckMatched, 1);
            self.stats.hash_matched += 1;
        } else {
            self.refuse(Counter::HashCheckMismatched, 1, counters, &ev.worker, "a recomputed store does not match the engine's hashes: the router's hash settings (algorithm, seed, hash block size) differ from the engine's");
            self.stats.hash_mismatched += 1;
        }
    }

    /// Remembers the digests of a request the router hashed, so later stores chained on them
    /// can be checked.
    pub fn remember_digests(&mut self, digests: &[Digest]) {
        if self.digests.len() + digests.len() > DIGEST_CACHE_MAX {
            self.digests.clear();
        }
        for d in digests {
            self.digests.insert(hash::external(d).0, *d);
        }
    }
}

/// The salt an engine published for a request's first block (untagged).
pub(super) fn first_salt(ev: &Stored) -> Option<String> {
    match ev.extra_keys.as_ref()?.first()?.as_ref()? {
        KeyValue::Str(s) => Some(s.clone()),
        KeyValue::List(items) => items.iter().find_map(|k| match k {
            KeyValue::Str(s) => Some(s.clone()),
            _ => None,
        }),
        _ => None,
    }
}
