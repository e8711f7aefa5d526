//! Per-(worker, rank) sequence tracking: the pure state machine behind a subscription.
//!
//! Owns: [`Tracker`], [`LiveVerdict`], [`ReplayVerdict`] and [`DegradeReason`].
//! Invariants: `next` is the sequence number of the next batch to apply; batches are applied
//! only with `seq == next` (or as the first of an instance); a live seq at or below the last
//! live seq means the publisher restarted (one publisher's live stream only goes up); a rank
//! is *degraded* from the moment a batch is known lost until it is *rebuilt*: a contiguous
//! stream that starts at seq 0 of a publisher instance, or that applies an engine
//! `AllBlocksCleared` (device pool empty) — after either, the index holds everything the
//! engine's device tier holds.
//! Must not: do I/O, decode payloads or emit events (the subscription does, following the
//! verdicts).

use serde::Serialize;

/// Why a rank's view may be missing blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DegradeReason {
    /// The first batch seen was not seq 0 and no replay reached back to 0.
    JoinedLate,
    /// A sequence gap that no replay filled (no replay endpoint, or it failed).
    GapUnfilled,
    /// The replay buffer no longer held the missing batches.
    ReplayWindowExceeded,
    /// A batch arrived in sequence but could not be decoded.
    UndecodableBatch,
}

impl DegradeReason {
    pub fn name(self) -> &'static str {
        match self {
            DegradeReason::JoinedLate => "joined_late",
            DegradeReason::GapUnfilled => "gap_unfilled",
            DegradeReason::ReplayWindowExceeded => "replay_window_exceeded",
            DegradeReason::UndecodableBatch => "undecodable_batch",
        }
    }
}

/// What to do with a live message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiveVerdict {
    /// Nothing applied yet in this instance: the subscriber decides how to start.
    First,
    InOrder,
    /// Already applied (it came through a replay first): skip.
    Duplicate,
    /// Batches `from .. seq` are missing.
    Gap {
        from: u64,
    },
    /// The publisher restarted: clear, reset and start over with this message.
    Restart,
}

/// What to do with a replayed batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayVerdict {
    First,
    InOrder,
    Duplicate,
    /// The replay skipped `from .. seq`: its buffer no longer held them.
    Hole {
        from: u64,
    },
}

/// Sequence state of one (worker, rank).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tracker {
    next: Option<u64>,
    last_live: Option<u64>,
    last_applied: Option<(u64, u64)>,
    degraded: Option<DegradeReason>,
}

impl Tracker {
    pub fn new() -> Tracker {
        Tracker::default()
    }

    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// The last consumed batch: `(seq, payload digest)`, used to recognise the same publisher
    /// instance after a reconnect.
    pub fn last_applied(&self) -> Option<(u64, u64)> {
        self.last_applied
    }

    pub fn degraded(&self) -> Option<DegradeReason> {
        self.degraded
    }

    pub fn classify_live(&self, seq: u64) -> LiveVerdict {
        if matches!(self.last_live, Some(l) if seq <= l) {
            return LiveVerdict::Restart;
        }
        match self.next {
            None => LiveVerdict::First,
            Some(n) if seq == n => LiveVerdict::InOrder,
            Some(n) if seq < n => LiveVerdict::Duplicate,
            Some(n) => LiveVerdict::Gap { from: n },
        }
    }

    pub fn classify_replayed(&self, seq: u64) -> ReplayVerdict {
        match self.next {
            None => ReplayVerdict::First,
            Some(n) if seq == n => ReplayVerdict::InOrder,
            Some(n) if seq < n => ReplayVerdict::Duplicate,
            Some(n) => ReplayVerdict::Hole { from: n },
        }
    }

    /// Records the seq of a live message (whatever its verdict).
    pub fn note_live(&mut self, seq: u64) {
        self.last_live = Some(seq);
    }

    /// A replay succeeded and held nothing: the publisher's next batch is seq 0.
    pub fn expect_start(&mut self) {
        if self.next.is_none() {
            self.next = Some(0);
        }
    }

    /// Batch `seq` was applied. Returns true when this rebuilt a degraded rank.
    pub fn applied(&mut self, seq: u64, digest: u64, engine_cleared: bool) -> bool {
        self.next = Some(seq.saturating_add(1));
        self.last_applied = Some((seq, digest));
        if self.degraded.is_some() && (seq == 0 || engine_cleared) {
            self.degraded = None;
            return true;
        }
        false
    }

    /// Batches were lost: the subscriber clears the rank; the stream resumes at `resume_at`.
    pub fn lost(&mut self, reason: DegradeReason, resume_at: u64) {
        self.degraded = Some(reason);
        self.next = Some(resume_at);
    }

    /// Batch `seq` was consumed without being applied (undecodable).
    pub fn consumed_unapplied(&mut self, seq: u64, digest: u64) {
        self.lost(DegradeReason::UndecodableBatch, seq.saturating_add(1));
        self.last_applied = Some((seq, digest));
    }

    /// A tracker that continues after batch `seq` (payload digest `digest`) of a publisher
    /// instance, as a warm start does from a snapshot: the next batch to apply is `seq + 1`.
    pub fn resumed(seq: u64, digest: u64) -> Tracker {
        Tracker {
            next: Some(seq.saturating_add(1)),
            last_live: None,
            last_applied: Some((seq, digest)),
            degraded: None,
        }
    }

    /// A new publisher instance: forget its predecessor (the degraded flag stays until the new
    /// instance is seen from seq 0).
    pub fn reset(&mut self) {
        let degraded = self.degraded;
        *self = Tracker::default();
        self.degraded = degraded;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_from_zero_is_applied_in_order_and_duplicates_are_skipped() {
        let mut t = Tracker::new();
        assert_eq!(t.classify_live(0), LiveVerdict::First);
        t.note_live(0);
        t.applied(0, 1, false);
        assert_eq!(t.classify_live(1), LiveVerdict::InOrder);
        t.applied(1, 1, false);
        assert_eq!(t.classify_replayed(1), ReplayVerdict::Duplicate);
        assert_eq!(t.classify_live(5), LiveVerdict::Gap { from: 2 });
        assert_eq!(t.degraded(), None);
    }

    #[test]
    fn a_live_seq_at_or_below_the_last_live_one_is_a_restart() {
        let mut t = Tracker::new();
        t.note_live(7);
        t.applied(7, 1, false);
        assert_eq!(t.classify_live(7), LiveVerdict::Restart);
        assert_eq!(t.classify_live(0), LiveVerdict::Restart);
        // A replayed copy of something below `next` is only a duplicate.
        assert_eq!(t.classify_replayed(3), ReplayVerdict::Duplicate);
    }

    #[test]
    fn live_copies_of_replayed_batches_are_duplicates_not_restarts() {
        let mut t = Tracker::new();
        for s in 0..5 {
            t.applied(s, s, false);
        }
        assert_eq!(t.classify_live(3), LiveVerdict::Duplicate);
        assert_eq!(t.classify_live(5), LiveVerdict::InOrder);
    }

    #[test]
    fn a_degraded_rank_is_rebuilt_by_seq_zero_or_an_engine_clear_only() {
        let mut t = Tracker::new();
        t.lost(DegradeReason::JoinedLate, 10);
        assert!(!t.applied(10, 0, false));
        assert_eq!(t.degraded(), Some(DegradeReason::JoinedLate));
        assert!(t.applied(11, 0, true));
        assert_eq!(t.degraded(), None);
        t.lost(DegradeReason::GapUnfilled, 20);
        t.reset();
        assert_eq!(t.degraded(), Some(DegradeReason::GapUnfilled));
        assert!(t.applied(0, 0, false));
    }
}
