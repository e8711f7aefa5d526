//! Collecting what a subscription delivers, with bounded waits, and a sink that also says when
//! the subscription finished its first catch-up.

use kvroute_index::{Event, WorkerId};
use kvroute_wire::{ChannelSink, EventSink, RankHealth, SinkMessage};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A [`ChannelSink`] that also records the subscription's first catch-up (connected, and the
/// replay it asked for applied or failed): what a test waits for before publishing, instead
/// of a pause.
pub struct SyncedSink {
    inner: ChannelSink,
    pub synced: Arc<AtomicBool>,
}

impl SyncedSink {
    pub fn new(tx: mpsc::UnboundedSender<SinkMessage>) -> SyncedSink {
        SyncedSink {
            inner: ChannelSink(tx),
            synced: Arc::default(),
        }
    }
}

impl EventSink for SyncedSink {
    fn apply(&self, events: &[Event]) {
        self.inner.apply(events);
    }
    fn rank_health(&self, worker: &WorkerId, dp_rank: u32, health: RankHealth) {
        self.inner.rank_health(worker, dp_rank, health);
    }
    fn synced(&self, _worker: &WorkerId, _dp_rank: u32) {
        self.synced.store(true, Ordering::Release);
    }
}

/// Waits until `flag` (a [`SyncedSink`]'s) is set; fails the test after `secs` seconds.
pub async fn wait_synced(flag: &AtomicBool, secs: u64) {
    super::wait::wait_until(Duration::from_secs(secs), "the first catch-up", || async {
        flag.load(Ordering::Acquire)
    })
    .await
}

#[derive(Default, Debug)]
pub struct Collected {
    pub events: Vec<Event>,
    pub health: Vec<RankHealth>,
}

impl Collected {
    /// A compact trace: `C` for a clear, the first hash of each store, `R<hash>` for removals.
    pub fn trace(&self) -> Vec<String> {
        self.events
            .iter()
            .map(|e| match e {
                Event::Cleared(_) => "C".to_string(),
                Event::Stored(s) => s
                    .hashes
                    .first()
                    .map(|h| h.value.0.to_string())
                    .unwrap_or_default(),
                Event::Removed(r) => {
                    format!("R{}", r.hashes.first().map(|h| h.value.0).unwrap_or(0))
                }
            })
            .collect()
    }
    pub fn last_health(&self) -> Option<RankHealth> {
        self.health.last().copied()
    }
    pub fn workers(&self) -> Vec<(WorkerId, u32)> {
        self.events
            .iter()
            .map(|e| (e.worker().clone(), e.dp_rank()))
            .collect()
    }
}

/// Receives until `done` holds; panics after `secs` seconds (tests never hang).
pub async fn wait_for(
    rx: &mut mpsc::UnboundedReceiver<SinkMessage>,
    c: &mut Collected,
    secs: u64,
    what: &str,
    done: impl Fn(&Collected) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !done(c) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(SinkMessage::Events(e))) => c.events.extend(e),
            Ok(Some(SinkMessage::Health { health, .. })) => c.health.push(health),
            Ok(None) => panic!("sink closed while waiting for {what}"),
            Err(_) => panic!(
                "timed out waiting for {what}; got {:?} health {:?}",
                c.trace(),
                c.health
            ),
        }
    }
}
