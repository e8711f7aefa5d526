//! A simulated worker with a real ZMQ subscriber on its event stream, and the batches read from
//! it. No sleep stands in for ZMQ's slow joiner or for the stream going quiet: a subscription
//! has joined once a probe batch reached it (the engine's `/reset_prefix_cache` on an idle
//! engine publishes an `AllBlocksCleared` and changes nothing else), and a read ends when the
//! subscriber holds the engine's last batch (its `next_seq`, `/admin/cache`).

use super::{get, post, WAIT};
use kvroute_index::{Event, Stored};
use kvroute_sim::{fleet, PublisherConfig, SimHandle, WorkerConfig};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketRecv, SubSocket};

/// One live message: its seq and its frames.
pub type Batch = (u64, Vec<Vec<u8>>);

/// Starts worker `w0` from `cfg` (engine time ×10⁶, a bound PUB socket) and subscribes to it,
/// returning once the subscription has joined and holds everything published.
pub async fn subscribed_worker(mut cfg: WorkerConfig) -> (SimHandle, Subscriber) {
    cfg.speedup = 1e6;
    cfg.zmq = Some(PublisherConfig::new("tcp://127.0.0.1:0"));
    let h = fleet::start_worker("w0", cfg, ([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let sub = Subscriber::join(&h.zmq[0], h.http, 0).await;
    (h, sub)
}

/// A SUB socket on one rank's stream, level with the engine when it is returned and after each
/// read.
pub struct Subscriber {
    sub: SubSocket,
    http: SocketAddr,
    rank: usize,
    /// The seq of the last batch received.
    last: Option<u64>,
}

impl Subscriber {
    /// Subscribes to `endpoint` (rank `rank` of the worker serving HTTP on `http`) and probes
    /// with `/reset_prefix_cache` (the worker must be idle) until a batch arrives; then reads
    /// until level with the engine. Fails the test past the wait's deadline.
    pub async fn join(endpoint: &str, http: SocketAddr, rank: usize) -> Subscriber {
        let mut sub = SubSocket::new();
        sub.connect(endpoint).await.unwrap();
        sub.subscribe("").await.unwrap();
        Subscriber::probe(sub, http, rank, endpoint).await
    }

    /// [`Subscriber::join`] for a socket already connected or bound and subscribed (`what`
    /// names it in a failure).
    pub async fn probe(sub: SubSocket, http: SocketAddr, rank: usize, what: &str) -> Subscriber {
        let endpoint = what;
        let mut s = Subscriber {
            sub,
            http,
            rank,
            last: None,
        };
        let deadline = Instant::now() + WAIT;
        while s.last.is_none() {
            assert!(
                Instant::now() < deadline,
                "the subscription to {endpoint} never received a probe"
            );
            post(http, "/reset_prefix_cache", &json!({})).await;
            if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(50), s.sub.recv()).await {
                s.last = Some(seq_of(&frames_of(m)));
            }
        }
        s.batches().await;
        s
    }

    /// Every batch received until the subscriber holds the engine's last one.
    pub async fn batches(&mut self) -> Vec<Batch> {
        let mut out = Vec::new();
        let deadline = Instant::now() + WAIT;
        loop {
            let cache = get(self.http, "/admin/cache").await.json();
            let engine = cache["ranks"][self.rank]["publisher"]["next_seq"]
                .as_u64()
                .expect("the engine reports its publisher's next seq");
            if self.last.map_or(engine == 0, |s| s + 1 == engine) {
                return out;
            }
            assert!(
                Instant::now() < deadline,
                "the subscriber stopped at {:?}, the engine is at {engine}",
                self.last
            );
            while let Ok(Ok(m)) =
                tokio::time::timeout(Duration::from_millis(20), self.sub.recv()).await
            {
                let frames = frames_of(m);
                let seq = seq_of(&frames);
                self.last = Some(seq);
                out.push((seq, frames));
            }
        }
    }
}

impl Subscriber {
    /// The next `n` batches (where a publisher restart makes "level with the engine" ambiguous:
    /// its seqs start again); fails the test when they do not all come within the deadline.
    pub async fn take(&mut self, n: usize) -> Vec<Batch> {
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        while out.len() < n {
            let m = tokio::time::timeout_at(deadline, self.sub.recv())
                .await
                .unwrap_or_else(|_| panic!("{} of {n} batches came", out.len()))
                .unwrap();
            let frames = frames_of(m);
            let seq = seq_of(&frames);
            self.last = Some(seq);
            out.push((seq, frames));
        }
        out
    }
}

fn frames_of(m: zeromq::ZmqMessage) -> Vec<Vec<u8>> {
    m.into_vec().iter().map(|f| f.to_vec()).collect()
}

fn seq_of(frames: &[Vec<u8>]) -> u64 {
    u64::from_be_bytes(frames[1].as_slice().try_into().unwrap())
}

/// The stores of every batch published since the last read.
pub async fn stores(sub: &mut Subscriber) -> Vec<Stored> {
    let mut out = Vec::new();
    for (_, frames) in sub.batches().await {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (_, _, batch) = kvroute_wire::decode_message(&"w0".into(), &refs).unwrap();
        out.extend(batch.events.into_iter().filter_map(|e| match e {
            Event::Stored(s) => Some(s),
            _ => None,
        }));
    }
    out
}
