//! Where a subscription's events enter the index: one sink per (worker, DP rank).
//!
//! Owns: [`RankSink`]: applying a rank's events to the shared index, the stream position the
//! rank's index state reflects (the last batch applied, or none after a clear), whether the
//! rank is degraded, and whether its subscription has finished its first catch-up (readiness).
//! Invariants: a batch's events and the position after it change together under the sink's
//! lock, so [`RankSink::capture`] (a snapshot's view of the rank) never sees a batch half
//! applied or a position that does not match the state; a clear forgets the position; a
//! degraded rank is never captured (its view may miss blocks).
//! Must not: decide what a stream's sequence numbers mean (the subscription does).

use kvroute_index::{Event, Index, RankImage, WorkerId};
use kvroute_wire::{EventSink, RankHealth, StreamPosition};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Default)]
struct RankIntake {
    position: Option<StreamPosition>,
    degraded: bool,
}

/// One rank's event intake.
pub struct RankSink {
    pub index: Arc<Index>,
    pub worker: WorkerId,
    pub dp_rank: u32,
    state: Mutex<RankIntake>,
    synced: AtomicBool,
}

impl RankSink {
    /// A sink for a rank whose index state reflects the stream up to `position` (a warm start;
    /// `None`: nothing yet).
    pub fn new(
        index: Arc<Index>,
        worker: WorkerId,
        dp_rank: u32,
        position: Option<StreamPosition>,
    ) -> RankSink {
        RankSink {
            index,
            worker,
            dp_rank,
            state: Mutex::new(RankIntake {
                position,
                degraded: false,
            }),
            synced: AtomicBool::new(false),
        }
    }

    /// The rank's image and the position it reflects, when the rank is healthy and has one.
    pub fn capture(&self) -> Option<(StreamPosition, RankImage)> {
        let st = self.state.lock();
        let position = st.position.filter(|_| !st.degraded)?;
        let image = self.index.export_rank(&self.worker, self.dp_rank)?;
        Some((position, image))
    }

    /// The seq after the last batch the index applied for this rank (0 before any, or after
    /// the subscription cleared the rank): an engine that queued no later batch is matched.
    pub fn next_seq(&self) -> u64 {
        self.state.lock().position.map_or(0, |p| p.seq + 1)
    }

    /// Whether the subscription finished its first catch-up with the engine.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    fn clears_this_rank(&self, events: &[Event]) -> bool {
        events.iter().any(|e| {
            matches!(e, Event::Cleared(c) if c.dp_rank == self.dp_rank && c.worker == self.worker)
        })
    }
}

impl EventSink for RankSink {
    fn apply(&self, events: &[Event]) {
        let mut st = self.state.lock();
        self.index.apply_all(events);
        if self.clears_this_rank(events) {
            st.position = None;
        }
    }

    fn apply_batch(&self, events: &[Event], position: StreamPosition) {
        let mut st = self.state.lock();
        if !events.is_empty() {
            self.index.apply_all(events);
        }
        st.position = Some(position);
    }

    fn rank_health(&self, worker: &WorkerId, dp_rank: u32, health: RankHealth) {
        let degraded = !matches!(health, RankHealth::Healthy);
        self.state.lock().degraded = degraded;
        self.index.set_degraded(worker, dp_rank, degraded);
    }

    fn synced(&self, _worker: &WorkerId, _dp_rank: u32) {
        self.synced.store(true, Ordering::Release);
    }
}
