//! Mooncake-format traces turned into token-id requests.
//!
//! Owns: reading a Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`,
//! `hash_ids` — one id per 512-token block), selecting a subset that keeps whole prefix families
//! (by the first block's id), and turning each id into a deterministic block of token ids (the
//! same id → the same tokens), scaled to `tokens_per_block` tokens per id, the last block
//! trimmed in proportion to `input_length`.
//! Invariants: two requests share a token prefix exactly when they share leading hash ids.
//! Must not: read the network or anything but the given file or the bundled trace.

use anyhow::{Context, Result};
use serde::Deserialize;

/// The bundled public trace (see data/traces/README.md).
pub const BUNDLED: &str = include_str!("../../../../data/traces/mooncake_synthetic_trace.jsonl");

#[derive(Deserialize, Clone, Debug)]
pub struct TraceLine {
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

#[derive(Clone, Debug)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the start (unscaled).
    pub at_ms: f64,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
}

pub fn parse(text: &str, origin: &str) -> Result<Vec<TraceLine>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{origin}:{}: not a Mooncake trace line", i + 1))
        })
        .collect()
}

fn block_tokens(id: u64, n: usize, vocab: u32) -> impl Iterator<Item = u32> {
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % vocab as u64) as u32
    })
}

pub struct Shape {
    /// Tokens per trace block id (the trace's own is 512).
    pub tokens_per_block: usize,
    /// Keep requests whose first block id ≡ 0 (mod `sample`): whole prefix families stay.
    pub sample: u64,
    pub max_requests: usize,
    pub max_output: u32,
    pub vocab: u32,
    /// Longest prompt kept (the workers' `max_model_len` minus the output).
    pub max_prompt: usize,
}

pub fn requests(lines: &[TraceLine], s: &Shape) -> Vec<TraceRequest> {
    let mut out = Vec::new();
    for l in lines {
        if out.len() >= s.max_requests {
            break;
        }
        let Some(first) = l.hash_ids.first() else {
            continue;
        };
        if first % s.sample.max(1) != 0 {
            continue;
        }
        let want = ((l.input_length as f64) * s.tokens_per_block as f64 / 512.0).ceil() as usize;
        let mut tokens = Vec::with_capacity(want);
        for id in &l.hash_ids {
            tokens.extend(block_tokens(*id, s.tokens_per_block, s.vocab));
        }
        tokens.truncate(want.clamp(1, s.max_prompt.max(1)));
        if tokens.is_empty() {
            continue;
        }
        out.push(TraceRequest {
            at_ms: l.timestamp,
            tokens,
            max_tokens: (l.output_length as u32).clamp(1, s.max_output.max(1)),
        });
    }
    if let Some(t0) = out.first().map(|r| r.at_ms) {
        for r in &mut out {
            r.at_ms -= t0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_leading_ids_become_shared_token_prefixes() {
        let lines = parse(
            "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 5, \"input_length\": 1000, \"output_length\": 3, \"hash_ids\": [0, 2]}\n",
            "t",
        )
        .unwrap();
        let shape = Shape {
            tokens_per_block: 16,
            sample: 1,
            max_requests: 10,
            max_output: 8,
            vocab: 1000,
            max_prompt: 10_000,
        };
        let r = requests(&lines, &shape);
        assert_eq!(r[0].tokens.len(), 32);
        assert_eq!(r[1].tokens.len(), 32);
        assert_eq!(r[0].tokens[..16], r[1].tokens[..16]);
        assert_ne!(r[0].tokens[16..], r[1].tokens[16..]);
    }

    #[test]
    fn the_bundled_trace_parses() {
        let lines = parse(BUNDLED, "bundled").unwrap();
        assert_eq!(lines.len(), 3993);
    }
}
