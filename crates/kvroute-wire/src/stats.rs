//! Wire counters: what arrived, what was applied, what was refused and why.
//!
//! Owns: [`WireStats`] (shared, lock-light counters) and its [`WireStatsSnapshot`], which the
//! gateway publishes as Prometheus metrics and the CLI prints as JSON.
//! Invariants: counters only grow; label sets are bounded (reasons are fixed enums, groups
//! beyond [`MAX_GROUP_LABELS`] per event kind fold into `"other"`, ranks are the configured
//! subscriptions); each (worker, reason) drop is logged once at warning level, later ones are
//! only counted.
//! Must not: decide anything (subscriptions and decoders report here, nothing reads back).

use crate::decode::DecodedBatch;
use crate::frames::FrameError;
use crate::reasons::{BatchError, BatchErrorReason, DropReason};
use kvroute_index::{Event, WorkerId};
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Distinct group labels kept per event kind; more fold into `"other"`.
pub const MAX_GROUP_LABELS: usize = 64;

/// What happened to one received batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchDisposition {
    /// Live, in sequence: applied.
    Applied,
    /// Delivered by a replay reply: applied.
    Replayed,
    /// Already applied (a replay overlap, or a live copy of a replayed batch): skipped.
    Duplicate,
    /// In sequence but refused by the decoder: its events are lost (the rank is cleared).
    Undecodable,
    /// Refused before its sequence number was known (frame count, seq frame).
    FrameError,
}

impl BatchDisposition {
    pub const ALL: &'static [BatchDisposition] = &[
        BatchDisposition::Applied,
        BatchDisposition::Replayed,
        BatchDisposition::Duplicate,
        BatchDisposition::Undecodable,
        BatchDisposition::FrameError,
    ];
    pub fn name(self) -> &'static str {
        match self {
            BatchDisposition::Applied => "applied",
            BatchDisposition::Replayed => "replayed",
            BatchDisposition::Duplicate => "duplicate",
            BatchDisposition::Undecodable => "undecodable",
            BatchDisposition::FrameError => "frame_error",
        }
    }
}

/// Per-(worker, rank) state, as last reported by its subscription.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RankSnapshot {
    pub worker: String,
    pub dp_rank: u32,
    /// The next sequence number expected; `None` before anything was applied.
    pub next_seq: Option<u64>,
    /// The index may be missing blocks of this rank (see docs/wire.md, "degraded").
    pub degraded: bool,
    /// Why it became degraded (a stable snake_case name).
    pub degraded_reason: Option<&'static str>,
    /// The live socket is connected or bound.
    pub connected: bool,
    /// Receive time minus the engine's `ts` of the last batch, in seconds.
    pub lag_seconds: Option<f64>,
    pub gaps: u64,
    pub restarts: u64,
}

/// One events counter row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EventCount {
    /// `stored`, `removed` or `cleared`.
    pub kind: &'static str,
    /// The group index, `"none"` for legacy engines, `"other"` past the label cap.
    pub group: String,
    pub count: u64,
}

/// A point-in-time copy of every counter.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WireStatsSnapshot {
    pub batches: BTreeMap<&'static str, u64>,
    pub batch_errors: BTreeMap<&'static str, u64>,
    pub frame_errors: BTreeMap<&'static str, u64>,
    pub drops: BTreeMap<&'static str, u64>,
    pub events: Vec<EventCount>,
    /// Sequence gaps seen on live streams.
    pub gaps: u64,
    /// Batches known to be missing (sum of gap widths).
    pub missed_batches: u64,
    pub replay_requests: u64,
    /// Replay requests made because a (re)connected subscription heard no live batch within
    /// `SubscriptionConfig::join_check` (counted in `replay_requests` too).
    pub join_checks: u64,
    pub replay_failures: u64,
    /// Publisher restarts detected (sequence went back).
    pub restarts: u64,
    /// Connection attempts after the first.
    pub reconnects: u64,
    /// `Cleared` events the subscriptions emitted on their own (gap, restart, bad batch).
    pub clears_emitted: u64,
    pub ranks: Vec<RankSnapshot>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum GroupLabel {
    None,
    Group(u32),
    Other,
}

/// Shared counters; cheap to update from many subscription tasks.
pub struct WireStats {
    batches: Vec<AtomicU64>,
    batch_errors: Vec<AtomicU64>,
    frame_errors: Vec<AtomicU64>,
    drops: Vec<AtomicU64>,
    events: Mutex<BTreeMap<(&'static str, GroupLabel), u64>>,
    gaps: AtomicU64,
    missed: AtomicU64,
    replay_requests: AtomicU64,
    join_checks: AtomicU64,
    replay_failures: AtomicU64,
    restarts: AtomicU64,
    reconnects: AtomicU64,
    clears: AtomicU64,
    ranks: Mutex<BTreeMap<(WorkerId, u32), RankSnapshot>>,
    warned: Mutex<HashSet<(WorkerId, &'static str)>>,
}

impl Default for WireStats {
    fn default() -> WireStats {
        WireStats::new()
    }
}

fn zeros(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

fn bump(v: &[AtomicU64], i: usize) {
    if let Some(c) = v.get(i) {
        c.fetch_add(1, Relaxed);
    }
}

fn read(v: &[AtomicU64], names: impl Iterator<Item = &'static str>) -> BTreeMap<&'static str, u64> {
    names
        .zip(v.iter())
        .map(|(n, c)| (n, c.load(Relaxed)))
        .collect()
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl WireStats {
    pub fn new() -> WireStats {
        WireStats {
            batches: zeros(BatchDisposition::ALL.len()),
            batch_errors: zeros(BatchErrorReason::ALL.len()),
            frame_errors: zeros(FrameError::NAMES.len()),
            drops: zeros(DropReason::ALL.len()),
            events: Mutex::new(BTreeMap::new()),
            gaps: AtomicU64::new(0),
            missed: AtomicU64::new(0),
            replay_requests: AtomicU64::new(0),
            join_checks: AtomicU64::new(0),
            replay_failures: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            clears: AtomicU64::new(0),
            ranks: Mutex::new(BTreeMap::new()),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// Counts one decoded batch: its disposition, events (by kind and group), drops and lag.
    pub fn record_batch(
        &self,
        worker: &WorkerId,
        dp_rank: u32,
        batch: &DecodedBatch,
        disposition: BatchDisposition,
    ) {
        self.record_disposition(disposition);
        for d in &batch.drops {
            bump(&self.drops, d.reason.index());
            self.warn_once(worker, d.reason.name(), &d.detail);
        }
        if let Ok(mut ev) = self.events.lock() {
            for e in &batch.events {
                let (kind, group) = match e {
                    Event::Stored(s) => ("stored", s.group),
                    Event::Removed(r) => ("removed", r.group),
                    Event::Cleared(_) => ("cleared", None),
                };
                let mut label = group.map_or(GroupLabel::None, GroupLabel::Group);
                if !ev.contains_key(&(kind, label))
                    && ev.keys().filter(|(k, _)| *k == kind).count() >= MAX_GROUP_LABELS
                {
                    label = GroupLabel::Other;
                }
                *ev.entry((kind, label)).or_insert(0) += 1;
            }
        }
        if let Some(ts) = batch.ts {
            let lag = unix_now() - ts;
            self.update_rank(worker, dp_rank, |r| r.lag_seconds = Some(lag));
        }
    }

    pub fn record_disposition(&self, disposition: BatchDisposition) {
        let i = BatchDisposition::ALL
            .iter()
            .position(|d| *d == disposition)
            .unwrap_or(0);
        bump(&self.batches, i);
    }

    /// Counts a batch the decoder refused (without a disposition: the caller records that).
    pub fn record_batch_error(&self, worker: &WorkerId, error: &BatchError) {
        bump(&self.batch_errors, error.reason.index());
        self.warn_once(worker, error.reason.name(), &error.detail);
    }

    /// Counts a refused message; an undecodable payload also counts its batch error.
    pub fn record_frame_error(&self, worker: &WorkerId, error: &FrameError) {
        let i = FrameError::NAMES
            .iter()
            .position(|n| *n == error.name())
            .unwrap_or(0);
        bump(&self.frame_errors, i);
        match error {
            FrameError::Batch { error, .. } => self.record_batch_error(worker, error),
            other => self.warn_once(worker, other.name(), &other.to_string()),
        }
    }

    pub fn record_gap(&self, worker: &WorkerId, dp_rank: u32, missing: u64) {
        self.gaps.fetch_add(1, Relaxed);
        self.missed.fetch_add(missing, Relaxed);
        self.update_rank(worker, dp_rank, |r| r.gaps += 1);
    }

    pub fn record_replay_request(&self) {
        self.replay_requests.fetch_add(1, Relaxed);
    }

    pub fn record_join_check(&self) {
        self.join_checks.fetch_add(1, Relaxed);
    }

    pub fn record_replay_failure(&self, worker: &WorkerId, detail: &str) {
        self.replay_failures.fetch_add(1, Relaxed);
        self.warn_once(worker, "replay_failed", detail);
    }

    pub fn record_restart(&self, worker: &WorkerId, dp_rank: u32) {
        self.restarts.fetch_add(1, Relaxed);
        self.update_rank(worker, dp_rank, |r| r.restarts += 1);
    }

    pub fn record_reconnect(&self) {
        self.reconnects.fetch_add(1, Relaxed);
    }

    pub fn record_clear_emitted(&self) {
        self.clears.fetch_add(1, Relaxed);
    }

    /// Updates (creating if needed) the row of one (worker, rank).
    pub fn update_rank(&self, worker: &WorkerId, dp_rank: u32, f: impl FnOnce(&mut RankSnapshot)) {
        if let Ok(mut ranks) = self.ranks.lock() {
            let row = ranks
                .entry((worker.clone(), dp_rank))
                .or_insert_with(|| RankSnapshot {
                    worker: worker.to_string(),
                    dp_rank,
                    ..RankSnapshot::default()
                });
            f(row);
        }
    }

    /// Logs the first occurrence of `reason` for `worker` at warning level.
    pub fn warn_once(&self, worker: &WorkerId, reason: &'static str, detail: &str) {
        let first = self
            .warned
            .lock()
            .map(|mut w| w.insert((worker.clone(), reason)))
            .unwrap_or(false);
        if first {
            tracing::warn!(
                worker = %worker,
                reason,
                detail,
                "kv event refused (logged once per worker and reason; further ones are only counted)"
            );
        }
    }

    pub fn snapshot(&self) -> WireStatsSnapshot {
        let events = self
            .events
            .lock()
            .map(|ev| {
                ev.iter()
                    .map(|((kind, g), count)| EventCount {
                        kind,
                        group: match g {
                            GroupLabel::None => "none".to_string(),
                            GroupLabel::Group(i) => i.to_string(),
                            GroupLabel::Other => "other".to_string(),
                        },
                        count: *count,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let ranks = self
            .ranks
            .lock()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        WireStatsSnapshot {
            batches: read(
                &self.batches,
                BatchDisposition::ALL.iter().map(|d| d.name()),
            ),
            batch_errors: read(
                &self.batch_errors,
                BatchErrorReason::ALL.iter().map(|r| r.name()),
            ),
            frame_errors: read(&self.frame_errors, FrameError::NAMES.iter().copied()),
            drops: read(&self.drops, DropReason::ALL.iter().map(|r| r.name())),
            events,
            gaps: self.gaps.load(Relaxed),
            missed_batches: self.missed.load(Relaxed),
            replay_requests: self.replay_requests.load(Relaxed),
            join_checks: self.join_checks.load(Relaxed),
            replay_failures: self.replay_failures.load(Relaxed),
            restarts: self.restarts.load(Relaxed),
            reconnects: self.reconnects.load(Relaxed),
            clears_emitted: self.clears.load(Relaxed),
            ranks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::decode_batch;
    use crate::reasons::Dialect;

    fn stored(group: u32) -> Vec<u8> {
        // [ts, [{"type": "BlockStored", ...group_idx}], 0] written by hand.
        let mut ev = vec![0x86];
        for (k, v) in [
            (
                "type",
                vec![
                    0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd',
                ],
            ),
            ("block_hashes", vec![0x91, 0x01]),
            ("token_ids", vec![0x91, 0x01]),
            ("block_size", vec![0x01]),
            (
                "group_idx",
                vec![0xce].into_iter().chain(group.to_be_bytes()).collect(),
            ),
            ("lora_id", vec![0xa1, b'x']),
        ] {
            ev.push(0xa0 | k.len() as u8);
            ev.extend_from_slice(k.as_bytes());
            ev.extend(v);
        }
        [vec![0x93, 0x01, 0x91], ev, vec![0x00]].concat()
    }

    #[test]
    fn events_are_counted_by_kind_and_group_with_a_bounded_label_set() {
        let stats = WireStats::new();
        let w: WorkerId = "w".into();
        for g in 0..(MAX_GROUP_LABELS as u32 + 5) {
            let b = decode_batch(&w, &stored(g), Dialect::Vllm).expect("decodes");
            stats.record_batch(&w, 0, &b, BatchDisposition::Applied);
        }
        let snap = stats.snapshot();
        assert_eq!(snap.batches["applied"], MAX_GROUP_LABELS as u64 + 5);
        assert_eq!(snap.events.len(), MAX_GROUP_LABELS + 1);
        let other = snap
            .events
            .iter()
            .find(|e| e.group == "other")
            .expect("overflow row");
        assert_eq!((other.kind, other.count), ("stored", 5));
        assert_eq!(snap.drops["invalid_lora_id"], MAX_GROUP_LABELS as u64 + 5);
        assert!(snap.ranks[0].lag_seconds.is_some());
    }

    #[test]
    fn a_worker_and_reason_is_logged_once_but_counted_every_time() {
        let stats = WireStats::new();
        let w: WorkerId = "w".into();
        for _ in 0..3 {
            stats.warn_once(&w, "x", "detail");
        }
        assert_eq!(stats.warned.lock().map(|s| s.len()).unwrap_or(0), 1);
    }
}
