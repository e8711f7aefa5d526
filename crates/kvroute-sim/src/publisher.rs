//! The ZMQ event publisher of one simulated engine rank (vLLM's `ZmqEventPublisher`), with
//! fault hooks.
//!
//! Owns: the PUB socket (bound for wildcard endpoints; connected otherwise, in the background
//! through [`crate::zmtp`], so a subscriber that is absent, late or restarting never holds the
//! engine up; DP rank `r` on `port + r`), the per-instance sequence counter, the replay buffer and the ROUTER that
//! answers replay requests (`["", topic, seq, payload]` per batch, then the end marker; or the
//! older `["", seq, payload]` layout), and the faults: dropping the next N batches (they keep
//! their seq and stay replayable, as a high-water-mark drop would), delaying the stream,
//! sending the next N batches twice, holding a batch back until the one after it went out
//! (reordered), shifting the batches' timestamps (a clock jump), answering replay requests
//! with garbage, restarting (seq back to 0, buffer emptied).
//! Invariants: seqs count batches from 0 per publisher instance; one batch per call; nothing
//! is published for an empty batch.
//! Must not: encode events itself beyond calling `wire`, or block the engine loop.

use crate::error::SimError;
use crate::wire::{encode_batch, WireFormat};
use crate::zmtp::{ConnectingPub, PubCounters};
use bytes::Bytes;
use kvroute_index::Event;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's default send high-water mark (`KVEventsConfig.hwm`).
pub const DEFAULT_HWM: usize = 100_000;

/// The replay reply layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplayLayout {
    /// vLLM 0.32: `["", topic, seq, payload]`, end `["", "", END, ""]`.
    #[default]
    WithTopic,
    /// vLLM ≤ 0.25 and SGLang: `["", seq, payload]`, end `["", END, ""]`.
    Old,
}

#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// `tcp://*:5557` binds; `tcp://host:port` with a concrete host connects (vLLM's rule).
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub buffer_steps: usize,
    pub format: WireFormat,
    pub replay_layout: ReplayLayout,
    pub dp_rank: u32,
    /// Messages queued for a connected subscriber before new ones are dropped.
    pub hwm: usize,
}

impl PublisherConfig {
    pub fn new(endpoint: &str) -> PublisherConfig {
        PublisherConfig {
            endpoint: endpoint.to_string(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            format: WireFormat::V032,
            replay_layout: ReplayLayout::WithTopic,
            dp_rank: 0,
            hwm: DEFAULT_HWM,
        }
    }
}

/// vLLM's `offset_endpoint_port`: rank `r` publishes on `port + r` (port 0 stays 0).
pub fn offset_endpoint(endpoint: &str, rank: u32) -> String {
    if rank == 0 {
        return endpoint.to_string();
    }
    if endpoint.contains("inproc") {
        return format!("{endpoint}_dp{rank}");
    }
    if let Some((base, port)) = endpoint.rsplit_once(':') {
        if let Ok(p) = port.parse::<u32>() {
            if p == 0 {
                return endpoint.to_string();
            }
            return format!("{base}:{}", p + rank);
        }
    }
    endpoint.to_string()
}

/// The address to use and whether to bind: vLLM binds wildcard, `::` and ipc endpoints and
/// connects to the rest; a tcp port of 0 (an OS-chosen port) can only be bound.
fn bind_form(endpoint: &str) -> (String, bool) {
    let bind = endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.ends_with(":0");
    (endpoint.replace('*', "0.0.0.0"), bind)
}

fn port_of(ep: &zeromq::Endpoint) -> Option<u16> {
    match ep {
        zeromq::Endpoint::Tcp(_, p) => Some(*p),
        _ => None,
    }
}

/// Takes one from a fault's countdown; whether there was one.
fn take_one(n: &AtomicU64) -> bool {
    n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

fn msg(frames: Vec<Vec<u8>>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).ok()
}

/// Wire faults to set on a worker's publishers (`None`: leave that one as it is); the body of
/// `POST /admin/faults`.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WireFaults {
    pub drop_batches: Option<u64>,
    pub delay_ms: Option<u64>,
    pub duplicate_batches: Option<u64>,
    pub reorder_batches: Option<u64>,
    pub clock_offset_ms: Option<i64>,
    pub garbage_replay: Option<bool>,
}

/// Fault knobs, shared with the admin endpoint.
#[derive(Debug, Default)]
pub struct Faults {
    pub drop_next: AtomicU64,
    pub delay_ms: AtomicU64,
    /// The next N batches go out twice.
    pub duplicate_next: AtomicU64,
    /// The next N batches are each held back and sent right after the batch that follows.
    pub reorder_next: AtomicU64,
    /// Added to every batch's timestamp, in milliseconds (negative: the clock went back).
    pub clock_offset_ms: AtomicI64,
    /// Replay requests are answered with a malformed reply, then every buffered batch with a
    /// payload that is not MessagePack, then the end marker.
    pub garbage_replay: AtomicBool,
    pub published: AtomicU64,
    pub dropped: AtomicU64,
    /// The seq the next batch handed to [`Publisher::publish`] takes: the batches queued since
    /// the start or the last restart (sent, dropped or still waiting in the queue), so a reader
    /// knows which seq a subscriber must have applied to be level with the engine.
    pub queued: AtomicU64,
    /// Connected endpoints: the background connection's counters (batches sent, batches no
    /// subscriber took — they stay replayable —, connects, whether one is connected now).
    pub connection: Option<Arc<PubCounters>>,
}

/// Where batches go: a bound PUB socket, or a connection made in the background.
enum Out {
    Bound(PubSocket),
    Connecting(ConnectingPub),
}

impl Out {
    /// Sends one message; never waits for a subscriber. Returns whether it went out.
    async fn send(&mut self, frames: Vec<Vec<u8>>) -> bool {
        match self {
            Out::Bound(s) => match msg(frames) {
                Some(m) => s.send(m).await.is_ok(),
                None => false,
            },
            Out::Connecting(c) => c.send(frames),
        }
    }

    fn counters(&self) -> Option<Arc<PubCounters>> {
        match self {
            Out::Bound(_) => None,
            Out::Connecting(c) => Some(c.counters()),
        }
    }
}

enum Cmd {
    Batch(f64, Vec<Event>),
    Restart,
}

/// A running publisher. Dropping it stops the task.
pub struct Publisher {
    tx: mpsc::UnboundedSender<Cmd>,
    pub faults: Arc<Faults>,
    /// The bound PUB port (when bound over tcp), useful with port 0.
    pub port: Option<u16>,
    pub replay_port: Option<u16>,
    task: JoinHandle<()>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Publisher {
    pub async fn start(cfg: PublisherConfig) -> Result<Publisher, SimError> {
        let endpoint = offset_endpoint(&cfg.endpoint, cfg.dp_rank);
        let (addr, bind) = bind_form(&endpoint);
        let err = |e: zeromq::ZmqError| SimError::Socket {
            endpoint: endpoint.clone(),
            message: e.to_string(),
        };
        let (out, port) = if bind {
            let mut pub_sock = PubSocket::new();
            let port = port_of(&pub_sock.bind(&addr).await.map_err(err)?);
            (Out::Bound(pub_sock), port)
        } else {
            let hostport = addr
                .strip_prefix("tcp://")
                .ok_or_else(|| SimError::Socket {
                    endpoint: endpoint.clone(),
                    message: "only tcp endpoints can be connected to".into(),
                })?;
            (
                Out::Connecting(ConnectingPub::start(hostport.to_string(), cfg.hwm)),
                None,
            )
        };
        let (router, replay_port) = match &cfg.replay_endpoint {
            Some(r) => {
                let r = offset_endpoint(r, cfg.dp_rank);
                let (raddr, _) = bind_form(&r);
                let mut sock = RouterSocket::new();
                let ep = sock.bind(&raddr).await.map_err(|e| SimError::Socket {
                    endpoint: r.clone(),
                    message: e.to_string(),
                })?;
                (Some(sock), port_of(&ep))
            }
            None => (None, None),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let faults = Arc::new(Faults {
            connection: out.counters(),
            ..Faults::default()
        });
        let task = tokio::spawn(run(cfg, out, router, rx, faults.clone()));
        Ok(Publisher {
            tx,
            faults,
            port,
            replay_port,
            task,
        })
    }

    /// Queues one step's events (nothing is sent for an empty batch).
    pub fn publish(&self, ts: f64, events: Vec<Event>) {
        if !events.is_empty() {
            self.faults.queued.fetch_add(1, Ordering::Relaxed);
            let _ = self.tx.send(Cmd::Batch(ts, events));
        }
    }

    /// A new publisher instance behind the same sockets: seq 0, empty replay buffer.
    pub fn restart(&self) {
        self.faults.queued.store(0, Ordering::Relaxed);
        let _ = self.tx.send(Cmd::Restart);
    }
}

struct State {
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
}

async fn run(
    cfg: PublisherConfig,
    mut out: Out,
    mut router: Option<RouterSocket>,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    faults: Arc<Faults>,
) {
    let mut st = State {
        next_seq: 0,
        buffer: VecDeque::new(),
    };
    let topic = cfg.topic.as_bytes().to_vec();
    // A batch held back by the reorder fault, sent after the next one.
    let mut held: Option<Vec<Vec<u8>>> = None;
    loop {
        let replay = async {
            match router.as_mut() {
                Some(r) => r.recv().await.ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None => break,
                Some(Cmd::Restart) => {
                    st.next_seq = 0;
                    st.buffer.clear();
                    held = None;
                }
                Some(Cmd::Batch(ts, events)) => {
                    let ts = ts + faults.clock_offset_ms.load(Ordering::Relaxed) as f64 / 1000.0;
                    let payload = encode_batch(ts, &events, cfg.dp_rank, cfg.format);
                    let seq = st.next_seq;
                    st.next_seq += 1;
                    st.buffer.push_back((seq, payload.clone()));
                    while st.buffer.len() > cfg.buffer_steps.max(1) {
                        st.buffer.pop_front();
                    }
                    let delay = faults.delay_ms.load(Ordering::Relaxed);
                    if delay > 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
                    }
                    if take_one(&faults.drop_next) {
                        faults.dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let frames = vec![topic.clone(), seq.to_be_bytes().to_vec(), payload];
                    if held.is_none() && take_one(&faults.reorder_next) {
                        held = Some(frames);
                        continue;
                    }
                    let copies = if take_one(&faults.duplicate_next) { 2 } else { 1 };
                    for _ in 0..copies {
                        if out.send(frames.clone()).await {
                            faults.published.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if let Some(h) = held.take() {
                        if out.send(h).await {
                            faults.published.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            },
            req = replay => {
                if let (Some(req), Some(r)) = (req, router.as_mut()) {
                    let garbage = faults.garbage_replay.load(Ordering::Relaxed);
                    serve_replay(r, req, &st, &topic, cfg.replay_layout, garbage).await;
                }
            }
        }
    }
}

async fn serve_replay(
    router: &mut RouterSocket,
    req: ZmqMessage,
    st: &State,
    topic: &[u8],
    layout: ReplayLayout,
    garbage: bool,
) {
    let frames = req.into_vec();
    if frames.len() != 3 {
        return;
    }
    let id = frames[0].to_vec();
    let Ok(start) = <[u8; 8]>::try_from(frames[2].as_ref()) else {
        return;
    };
    let start = u64::from_be_bytes(start);
    if garbage {
        // A reply whose seq frame is three bytes long.
        if let Some(m) = msg(vec![
            id.clone(),
            vec![],
            topic.to_vec(),
            vec![0, 0, 1],
            vec![0xc1],
        ]) {
            let _ = router.send(m).await;
        }
    }
    for (seq, payload) in st.buffer.iter().filter(|(s, _)| *s >= start) {
        let payload = if garbage {
            // 0xc1 is never used in MessagePack.
            vec![0xc1; payload.len().max(1)]
        } else {
            payload.clone()
        };
        let f = match layout {
            ReplayLayout::WithTopic => vec![
                id.clone(),
                vec![],
                topic.to_vec(),
                seq.to_be_bytes().to_vec(),
                payload,
            ],
            ReplayLayout::Old => vec![id.clone(), vec![], seq.to_be_bytes().to_vec(), payload],
        };
        let Some(m) = msg(f) else { return };
        if router.send(m).await.is_err() {
            return;
        }
    }
    let end = u64::MAX.to_be_bytes().to_vec();
    let f = match layout {
        ReplayLayout::WithTopic => vec![id, vec![], vec![], end, vec![]],
        ReplayLayout::Old => vec![id, vec![], end, vec![]],
    };
    if let Some(m) = msg(f) {
        let _ = router.send(m).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_ranks_publish_on_port_plus_rank() {
        assert_eq!(offset_endpoint("tcp://*:5557", 0), "tcp://*:5557");
        assert_eq!(offset_endpoint("tcp://*:5557", 2), "tcp://*:5559");
        assert_eq!(offset_endpoint("tcp://*:0", 3), "tcp://*:0");
        assert_eq!(offset_endpoint("inproc://cache", 1), "inproc://cache_dp1");
    }

    #[test]
    fn wildcard_endpoints_bind_and_concrete_hosts_connect() {
        assert_eq!(
            bind_form("tcp://*:5557"),
            ("tcp://0.0.0.0:5557".into(), true)
        );
        assert_eq!(
            bind_form("tcp://10.0.0.1:5557"),
            ("tcp://10.0.0.1:5557".into(), false)
        );
        assert!(bind_form("tcp://127.0.0.1:0").1);
    }
}
