//! What replicas tell each other about the requests they have in flight, and the outgoing
//! side of it: the messages, their batch, and the [`Outbox`] a booking announces itself to.
//!
//! Owns: [`Message`] and [`Batch`] (the JSON a replica posts to another's
//! `POST /admin/peers/bookings`), [`Learned`] (what a request taught the replica that routed
//! it), the outbox's links (one bounded queue per peer, fed by
//! `try_send`), the ids of this replica's open bookings (what a heartbeat lists) and the
//! count of what a full queue dropped.
//! Invariants: announcing never waits (a full queue drops the message and counts it); each
//! peer's queue keeps the order of what was announced; an id is open from its `Booked` until
//! its `Done`; with no link, announcing costs one atomic load and keeps no id.
//! Must not: send anything itself (the sender tasks are `gateway::peers`'), or import the
//! registry (the registry's load guard imports this module).

use super::sessions::Mark;
use kvroute_route::Work;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::sync::mpsc;

/// A request this replica sent to a worker: what a peer books for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Booked {
    pub id: u64,
    pub worker: String,
    /// Prompt tokens the worker is expected to prefill (not served from its cache).
    pub prefill: u64,
    /// The prompt's chained 64-token chunk keys (`gateway::pending`).
    #[serde(default)]
    pub keys: Vec<u64>,
    /// Where the engine will keep a state checkpoint, with the tokens from the anchor chunk's
    /// end up to it.
    #[serde(default)]
    pub checkpoints: Vec<(u64, Vec<u32>)>,
}

/// What one request taught the replica that routed it: applied to its own learners and, where
/// `[peers] learning` is on, announced so its peers learn it too (`gateway::observe`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "what", rename_all = "snake_case")]
pub enum Learned {
    /// Where a request went.
    Placed(Placed),
    /// A request's first byte came back `ms` after it was sent, for `work`.
    Ttft { worker: String, work: Work, ms: f64 },
    /// A request ended with `tokens` output tokens, and what its decoding showed.
    Answered {
        worker: String,
        tokens: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decode: Option<DecodeSample>,
    },
}

/// A placement's records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placed {
    pub worker: String,
    /// The prompt as the follow-up tracker remembers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Mark>,
    /// A follow-up's time since its conversation's previous turn (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gap_ms: Option<f64>,
    /// A follow-up placed off the worker holding most of its history.
    #[serde(default)]
    pub moved: bool,
    /// The prefill predicted for it on the chosen worker (ms).
    pub own_prefill_ms: f64,
    /// The chosen worker's load wait and the least among the candidates' (ms), while the
    /// next arrivals' charge is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_waits: Option<(f64, f64)>,
}

/// One answer's decoding: prefill worked off per decoded token, requests running beside it,
/// and its mean inter-token latency (ms).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeSample {
    pub prefill: f64,
    pub running: f64,
    pub itl_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Message {
    Booked(Booked),
    /// The request's first byte came back: its prefill is done.
    FirstByte {
        id: u64,
    },
    /// The request ended, whatever the outcome.
    Done {
        id: u64,
    },
    /// The heartbeat: the bookings still open at the sender; a peer drops any other.
    Live {
        ids: Vec<u64>,
    },
    /// What a request taught the sender.
    Learned(Learned),
}

impl Message {
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Booked(_) => "booked",
            Message::FirstByte { .. } => "first_byte",
            Message::Done { .. } => "done",
            Message::Live { .. } => "live",
            Message::Learned(_) => "learned",
        }
    }
}

/// One POST's body: who sends, which run of it (a restart is a new incarnation), and the
/// messages in the order they were announced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    pub replica: String,
    pub incarnation: u64,
    pub messages: Vec<Message>,
}

/// One peer's queue.
struct Link {
    url: String,
    tx: mpsc::Sender<Message>,
}

/// Where this replica's bookings announce themselves.
#[derive(Default)]
pub struct Outbox {
    links: RwLock<Vec<Link>>,
    active: AtomicBool,
    /// Whether what this replica learns is announced too (`[peers] learning`).
    learning: AtomicBool,
    next_id: AtomicU64,
    open: Mutex<HashSet<u64>>,
    /// Messages a full queue dropped.
    pub dropped_full: AtomicU64,
    /// Messages queued, all peers together.
    pub queued: AtomicU64,
}

impl Outbox {
    /// Replaces the links: `links` are (peer URL, its queue's sending end). A link left out is
    /// closed (its sender task ends once its queue is drained).
    pub fn set_links(&self, links: Vec<(String, mpsc::Sender<Message>)>) {
        let mut l = self.links.write();
        *l = links
            .into_iter()
            .map(|(url, tx)| Link { url, tx })
            .collect();
        self.active.store(!l.is_empty(), Ordering::Release);
        if l.is_empty() {
            self.open.lock().clear();
        }
    }

    /// Announces what this replica learns too, or stops.
    pub fn set_learning(&self, on: bool) {
        self.learning.store(on, Ordering::Release);
    }

    /// Whether a [`Outbox::learned`] would reach a peer (so a caller builds nothing when not).
    pub fn shares_learning(&self) -> bool {
        self.active.load(Ordering::Acquire) && self.learning.load(Ordering::Acquire)
    }

    /// Announces what a request taught this replica, when learning is shared.
    pub fn learned(&self, l: Learned) {
        if self.shares_learning() {
            self.broadcast(Message::Learned(l));
        }
    }

    /// The peers linked, by URL.
    pub fn urls(&self) -> Vec<String> {
        self.links.read().iter().map(|l| l.url.clone()).collect()
    }

    /// Announces a booking; its id, or `None` when no peer is linked.
    pub fn book(&self, booked: impl FnOnce(u64) -> Booked) -> Option<u64> {
        if !self.active.load(Ordering::Acquire) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.open.lock().insert(id);
        self.broadcast(Message::Booked(booked(id)));
        Some(id)
    }

    pub fn first_byte(&self, id: u64) {
        self.broadcast(Message::FirstByte { id });
    }

    pub fn done(&self, id: u64) {
        self.open.lock().remove(&id);
        self.broadcast(Message::Done { id });
    }

    /// Sends the heartbeat (the open bookings) to every peer.
    pub fn heartbeat(&self) {
        if !self.active.load(Ordering::Acquire) {
            return;
        }
        let mut ids: Vec<u64> = self.open.lock().iter().copied().collect();
        ids.sort_unstable();
        self.broadcast(Message::Live { ids });
    }

    /// Bookings announced and not yet done.
    pub fn open(&self) -> usize {
        self.open.lock().len()
    }

    fn broadcast(&self, m: Message) {
        for l in self.links.read().iter() {
            match l.tx.try_send(m.clone()) {
                Ok(()) => {
                    self.queued.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    self.dropped_full.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booked(id: u64) -> Booked {
        Booked {
            id,
            worker: "w0".into(),
            prefill: 100,
            keys: vec![1, 2],
            checkpoints: vec![(130, vec![7, 8])],
        }
    }

    #[test]
    fn without_a_peer_a_booking_announces_nothing_and_keeps_no_id() {
        let o = Outbox::default();
        assert_eq!(o.book(booked), None);
        assert_eq!(o.open(), 0);
    }

    #[test]
    fn every_peer_gets_the_messages_in_order_and_a_heartbeat_lists_the_open_bookings() {
        let o = Outbox::default();
        let (a, mut ra) = mpsc::channel(16);
        let (b, mut rb) = mpsc::channel(16);
        o.set_links(vec![("http://a".into(), a), ("http://b".into(), b)]);
        let first = o.book(booked).unwrap();
        let second = o.book(booked).unwrap();
        o.first_byte(first);
        o.done(first);
        o.heartbeat();
        for rx in [&mut ra, &mut rb] {
            let kinds: Vec<Message> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
            assert_eq!(kinds.len(), 5);
            assert_eq!(kinds[0], Message::Booked(booked(first)));
            assert_eq!(kinds[2], Message::FirstByte { id: first });
            assert_eq!(kinds[3], Message::Done { id: first });
            assert_eq!(kinds[4], Message::Live { ids: vec![second] });
        }
    }

    #[test]
    fn a_full_queue_drops_the_message_and_counts_it_without_waiting() {
        let o = Outbox::default();
        let (a, _ra) = mpsc::channel(1);
        o.set_links(vec![("http://a".into(), a)]);
        o.book(booked);
        o.book(booked);
        assert_eq!(o.dropped_full.load(Ordering::Relaxed), 1);
        assert_eq!(o.open(), 2);
    }

    #[test]
    fn messages_read_back_from_their_json() {
        let b = Batch {
            replica: "r1".into(),
            incarnation: 7,
            messages: vec![
                Message::Booked(booked(3)),
                Message::FirstByte { id: 3 },
                Message::Done { id: 3 },
                Message::Live { ids: vec![4, 5] },
            ],
        };
        let text = serde_json::to_string(&b).unwrap();
        assert!(text.contains("\"kind\":\"first_byte\""), "{text}");
        assert_eq!(serde_json::from_str::<Batch>(&text).unwrap(), b);
    }
}
