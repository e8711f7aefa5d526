//! `kvroute explain` and `kvroute hash`: the index's evidence for one request, from a file of
//! normalized events; and the engine's block hashes for a token list.
//!
//! Owns: reading normalized-event JSON lines (docs/events.md), building an index with the
//! given hash settings, and printing per worker and rank each group's own servable length and
//! the joint prediction.
//! Must not: guess settings the events do not carry: they come from flags.

use crate::conformance::read_jsonl;
use anyhow::Result;
use kvroute_index::event::{hex_encode, Event};
use kvroute_index::{BlockExtras, HashAlgo, HashMode, Index, LookupConfig, Query, WorkerConfig};
use std::io::Write;
use std::path::Path;

pub struct HashSettings {
    pub algo: HashAlgo,
    pub seed: String,
    pub hash_block_size: Option<u32>,
    pub chunk_size: Option<u32>,
    pub content_keys: bool,
    pub eagle: bool,
}

pub fn explain(
    events: &Path,
    tokens: Vec<u32>,
    salt: Option<String>,
    worker: Option<&str>,
    s: &HashSettings,
    json: bool,
    out: &mut impl Write,
) -> Result<()> {
    let evs: Vec<Event> = read_jsonl(events)?;
    let index = Index::with_default(WorkerConfig {
        hash: if s.content_keys {
            HashMode::ContentKey
        } else {
            HashMode::Engine {
                algo: s.algo,
                seed: s.seed.clone(),
            }
        },
        lookup: LookupConfig {
            hash_block_size: s.hash_block_size,
            chunk_size: s.chunk_size,
            eagle: s.eagle,
            offload_chunk_blocks: None,
            offload_connector: Default::default(),
            drafter_groups_unflagged: false,
        },
        verify_hashes: true,
        ..WorkerConfig::default()
    });
    index.apply_all(&evs);
    let q = Query {
        tokens,
        extras: BlockExtras {
            cache_salt: salt,
            lora: None,
        },
        skip_prefix_cache: false,
    };
    let preds: Vec<_> = index
        .predict_all(&q)
        .into_iter()
        .filter(|p| worker.is_none_or(|w| &*p.worker == w))
        .collect();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&preds)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "request: {} tokens, {} events applied",
        q.tokens.len(),
        evs.len()
    )?;
    if preds.is_empty() {
        writeln!(out, "no worker matches")?;
    }
    for p in preds {
        let params = p
            .params
            .as_ref()
            .map(|x| {
                format!(
                    "hash block {}, alignment {}{}",
                    x.hash_block,
                    x.align,
                    if x.fine_grained { ", fine-grained" } else { "" }
                )
            })
            .unwrap_or_else(|| "no cacheable group".into());
        writeln!(
            out,
            "{} rank {}: predicted {} cached tokens (group-blind {}); {}{}",
            p.worker,
            p.dp_rank,
            p.cached,
            p.group_blind,
            params,
            if p.degraded { " [degraded]" } else { "" }
        )?;
        for g in &p.groups {
            writeln!(
                out,
                "  group {:>2} {:<24} block {:>5}{}: alone {}",
                g.group,
                g.kind,
                g.block_size,
                g.window.map(|w| format!(" window {w}")).unwrap_or_default(),
                g.alone
            )?;
        }
    }
    Ok(())
}

/// Prints (index, 64-bit value, digest) of every block of `tokens` that has a hash; with
/// `lookahead` > 0, vLLM 0.33's lookahead hashes (a block hashes once its `lookahead` next
/// tokens exist).
pub fn hash(
    tokens: &[u32],
    s: &HashSettings,
    salt: Option<String>,
    lookahead: usize,
    out: &mut impl Write,
) -> Result<()> {
    let block = s.hash_block_size.unwrap_or(16).max(1) as usize;
    let extras = BlockExtras {
        cache_salt: salt,
        lora: None,
    };
    let rows = kvroute_index::index::block_hashes_lookahead(
        s.algo, &s.seed, block, tokens, &extras, lookahead,
    );
    for (i, v, d) in rows {
        writeln!(out, "{i}\t{v}\t{}", hex_encode(&d))?;
    }
    Ok(())
}
