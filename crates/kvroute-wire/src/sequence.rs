//! Per-(worker, rank) sequence tracking: the pure state machine behind a subscription.
//!
//! Owns: [`Tracker`], [`LiveVerdict`], [`ReplayVerdict`] and [`DegradeReason`].
//! Invariants: `next` is the sequence number of the next batch to apply; batches are applied
//! only with `seq == next` (or as the first of an instance); a live seq at or below the last
//! live seq means the publisher restarted (one publisher's live stream only goes up) — unless
//! it is a byte-identical copy of one of the last [`RECENT`] batches consumed (same seq, same
//! payload digest: a relay sent it twice, or it arrived after its successor), which is a
//! duplicate; a rank
//! is *degraded* from the moment a batch is known lost until it is *rebuilt*: a contiguous
//! stream that starts at seq 0 of a publisher instance, or that applies an engine
//! `AllBlocksCleared` (device pool empty) — after either, the index holds everything the
//! engine's device tier holds.
//! Must not: do I/O, decode payloads or emit events (the subscription does, following the
//! verdicts).

use serde::Serialize;
use std::collections::VecDeque;

/// How many consumed batches (seq, payload digest) a tracker remembers to recognise late or
/// repeated copies. A copy older than that reads as a restart, which is safe: the rank is
/// cleared and rebuilt from the replay.
pub const RECENT: usize = 128;

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
    /// The last [`RECENT`] batches consumed: (seq, payload digest).
    recent: VecDeque<(u64, u64)>,
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

    /// The verdict on a live batch `seq` whose payload has digest `digest`.
    pub fn classify_live(&self, seq: u64, digest: u64) -> LiveVerdict {
        if matches!(self.last_live, Some(l) if seq <= l) {
            if self.recent.contains(&(seq, digest)) {
                return LiveVerdict::Duplicate;
            }
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

    /// Records the seq of a live message (whatever its verdict): the highest seen so far.
    pub fn note_live(&mut self, seq: u64) {
        self.last_live = Some(self.last_live.map_or(seq, |l| l.max(seq)));
    }

    fn remember(&mut self, seq: u64, digest: u64) {
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, digest));
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
        self.remember(seq, digest);
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
        self.remember(seq, digest);
    }

    /// A tracker that continues after batch `seq` (payload digest `digest`) of a publisher
    /// instance, as a warm start does from a snapshot: the next batch to apply is `seq + 1`.
    pub fn resumed(seq: u64, digest: u64) -> Tracker {
        Tracker {
            next: Some(seq.saturating_add(1)),
            last_live: None,
            last_applied: Some((seq, digest)),
            degraded: None,
            recent: VecDeque::from([(seq, digest)]),
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
        assert_eq!(t.classify_live(0, 10), LiveVerdict::First);
        t.note_live(0);
        t.applied(0, 10, false);
        assert_eq!(t.classify_live(1, 11), LiveVerdict::InOrder);
        t.applied(1, 11, false);
        assert_eq!(t.classify_replayed(1), ReplayVerdict::Duplicate);
        assert_eq!(t.classify_live(5, 15), LiveVerdict::Gap { from: 2 });
        assert_eq!(t.degraded(), None);
    }

    #[test]
    fn a_live_seq_at_or_below_the_last_live_one_is_a_restart() {
        let mut t = Tracker::new();
        t.note_live(7);
        t.applied(7, 1, false);
        // Another payload under a seq already seen: a new instance.
        assert_eq!(t.classify_live(7, 2), LiveVerdict::Restart);
        assert_eq!(t.classify_live(0, 3), LiveVerdict::Restart);
        // A replayed copy of something below `next` is only a duplicate.
        assert_eq!(t.classify_replayed(3), ReplayVerdict::Duplicate);
    }

    #[test]
    fn live_copies_of_replayed_batches_are_duplicates_not_restarts() {
        let mut t = Tracker::new();
        for s in 0..5 {
            t.applied(s, s, false);
        }
        assert_eq!(t.classify_live(3, 3), LiveVerdict::Duplicate);
        assert_eq!(t.classify_live(5, 5), LiveVerdict::InOrder);
    }

    #[test]
    fn a_repeated_or_late_copy_of_a_recent_batch_is_a_duplicate_and_the_stream_goes_on() {
        let mut t = Tracker::new();
        for s in 0..4 {
            t.note_live(s);
            t.applied(s, 100 + s, false);
        }
        // Sent twice, and one arriving after its successor: the same bytes as applied.
        assert_eq!(t.classify_live(3, 103), LiveVerdict::Duplicate);
        t.note_live(3);
        assert_eq!(t.classify_live(1, 101), LiveVerdict::Duplicate);
        t.note_live(1);
        // The live position stays at the highest seq seen.
        assert_eq!(t.classify_live(4, 104), LiveVerdict::InOrder);
        // Older than the memory: read as a restart (safe: cleared and replayed).
        for s in 4..(4 + RECENT as u64) {
            t.note_live(s);
            t.applied(s, 100 + s, false);
        }
        assert_eq!(t.classify_live(1, 101), LiveVerdict::Restart);
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
