//! What the gateway reads from an engine's answer.
//!
//! Owns: the usage figures of a whole JSON answer or of a stream's last events (the engine's
//! `cached_tokens`, the answer's `completion_tokens`) and [`DecodeTiming`], a stream's first and
//! last chunk with the prefill queued beside it, which teaches the worker's decode model and the
//! fleet's mean answer length at `[DONE]`.
//! Invariants: a figure that is absent or malformed in the answer reads as `None`, never as 0;
//! nothing here changes the bytes the client receives.
//! Must not: block, or read anything but the bytes and the worker's counters it is given.

use super::observe;
use super::peer_wire::{DecodeSample, Learned};
use super::registry::Worker;
use super::state::AppState;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// `usage.prompt_tokens_details.cached_tokens` of a JSON response.
pub fn reported_cached(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("usage")?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

/// `usage.completion_tokens` of a whole answer.
pub(crate) fn completion_tokens(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("usage")?.get("completion_tokens")?.as_u64()
}

/// `usage.completion_tokens` of a stream's last event that carries it (`tail`: the stream's
/// last bytes).
pub(crate) fn last_completion_tokens_in_sse(tail: &[u8]) -> Option<u64> {
    last_in_sse(tail, "completion_tokens", completion_tokens)
}

/// The engine's `cached_tokens` from a stream's last event that carries it.
pub(crate) fn last_usage_in_sse(tail: &[u8]) -> Option<u64> {
    last_in_sse(tail, "cached_tokens", reported_cached)
}

/// What `read` finds in the last `data:` event of `tail` that mentions `key`.
fn last_in_sse(tail: &[u8], key: &str, read: fn(&[u8]) -> Option<u64>) -> Option<u64> {
    let text = String::from_utf8_lossy(tail);
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| d.contains(key))
        .filter_map(|d| read(d.as_bytes()))
        .next_back()
}

/// A stream's decode, for the decode model and the mean answer length: when its first chunk
/// came, the prefill queued there then and the worker's running total of booked prefill, how
/// many were running beside it, when the last chunk came, and how many events carried tokens.
#[derive(Default)]
pub(crate) struct DecodeTiming {
    first: Option<DecodeStart>,
    last: Option<Instant>,
    events: u64,
}

struct DecodeStart {
    at: Instant,
    queued_tokens: u64,
    booked_total: u64,
    others_running: u64,
}

impl DecodeTiming {
    pub(crate) fn start(&mut self, queued_tokens: u64, booked_total: u64, others_running: u64) {
        self.first = Some(DecodeStart {
            at: Instant::now(),
            queued_tokens,
            booked_total,
            others_running,
        });
    }

    pub(crate) fn chunk(&mut self, c: &[u8]) {
        self.last = Some(Instant::now());
        // One event per `data: {` (a token each, as vLLM streams by default).
        self.events += c.windows(7).filter(|w| w == b"data: {").count() as u64;
    }

    /// At `[DONE]`: the answer's length (the engine's count when the client asked for usage,
    /// which also adds the usage-only event; else the events), its mean inter-token latency,
    /// and the prefill its steps carried: what was queued at its first token and booked there
    /// since, less what is still queued at its last, per token decoded.
    pub(crate) fn finish(&mut self, st: &AppState, worker: &Worker, reported: Option<u64>) {
        let tokens = reported.unwrap_or(self.events).max(1);
        let decode = self.sample(worker, tokens);
        observe::answered(&st.registry, worker, tokens, decode);
        if st.peers.outbox.shares_learning() {
            st.peers.outbox.learned(Learned::Answered {
                worker: worker.spec.name.clone(),
                tokens,
                decode,
            });
        }
    }

    /// The decoding this stream showed, once it decoded two tokens or more: the prefill the
    /// worker worked off per decoded token, the others running beside it, the mean ITL.
    fn sample(&mut self, worker: &Worker, tokens: u64) -> Option<DecodeSample> {
        let (s, t1) = (self.first.take()?, self.last?);
        if tokens < 2 {
            return None;
        }
        let steps = (tokens - 1) as f64;
        let itl_ms = t1.saturating_duration_since(s.at).as_secs_f64() * 1e3 / steps;
        let since = worker
            .booked_total
            .load(Ordering::Relaxed)
            .saturating_sub(s.booked_total);
        let worked_off = s
            .queued_tokens
            .saturating_add(since)
            .saturating_sub(worker.queued_tokens());
        Some(DecodeSample {
            prefill: worked_off as f64 / steps,
            running: s.others_running as f64,
            itl_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_reported_hit_is_read_from_usage() {
        let b =
            br#"{"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}}"#;
        assert_eq!(reported_cached(b), Some(8));
        let sse = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n";
        assert_eq!(last_usage_in_sse(sse), Some(4));
        // The last event that carries the figure wins; a malformed one is skipped.
        let sse = b"data: {\"usage\":{\"completion_tokens\":3}}\n\ndata: {\"usage\":{\"completion_tokens\":7}}\n\ndata: {\"completion_tokens\n\ndata: [DONE]\n\n";
        assert_eq!(last_completion_tokens_in_sse(sse), Some(7));
        assert_eq!(last_usage_in_sse(sse), None);
    }
}
