//! Collecting what a subscription delivers, with bounded waits.

use kvroute_index::{Event, WorkerId};
use kvroute_wire::{RankHealth, SinkMessage};
use std::time::Duration;
use tokio::sync::mpsc;

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
