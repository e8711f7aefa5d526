//! An in-process engine stand-in for subscription tests: a PUB socket and a replay ROUTER
//! (zeromq crate) that behave like vLLM's `ZmqEventPublisher`, with knobs to lose messages,
//! shrink the replay buffer, restart, and send garbage.

use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Which replay reply layout the ROUTER uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `["", topic, seq, payload]` (vLLM 0.32).
    V032,
    /// `["", seq, payload]` (older vLLM, SGLang).
    Old,
}

struct State {
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    layout: Layout,
    topic: Vec<u8>,
}

pub struct TestPublisher {
    pub port: u16,
    pub replay_port: u16,
    socket: PubSocket,
    state: Arc<Mutex<State>>,
    replay_task: JoinHandle<()>,
}

impl Drop for TestPublisher {
    fn drop(&mut self) {
        self.replay_task.abort();
    }
}

fn port_of(ep: &zeromq::Endpoint) -> u16 {
    match ep {
        zeromq::Endpoint::Tcp(_, p) => *p,
        other => panic!("tcp endpoint expected, got {other}"),
    }
}

fn msg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).expect("frames")
}

impl TestPublisher {
    /// Binds PUB on `port` (0: any) and a replay ROUTER on any port.
    pub async fn start(layout: Layout, port: u16) -> TestPublisher {
        let mut socket = PubSocket::new();
        let ep = socket
            .bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .expect("bind pub");
        let mut router = RouterSocket::new();
        let rep = router.bind("tcp://127.0.0.1:0").await.expect("bind router");
        let state = Arc::new(Mutex::new(State {
            next_seq: 0,
            buffer: VecDeque::new(),
            buffer_steps: 10_000,
            layout,
            topic: b"kv".to_vec(),
        }));
        let st = state.clone();
        let replay_task = tokio::spawn(async move {
            while let Ok(req) = router.recv().await {
                let frames = req.into_vec();
                if frames.len() != 3 {
                    continue;
                }
                let id = frames[0].to_vec();
                let start = u64::from_be_bytes(frames[2].as_ref().try_into().unwrap_or([0; 8]));
                let (replies, layout, topic) = {
                    let s = st.lock().expect("state");
                    let r: Vec<(u64, Vec<u8>)> = s
                        .buffer
                        .iter()
                        .filter(|(q, _)| *q >= start)
                        .cloned()
                        .collect();
                    (r, s.layout, s.topic.clone())
                };
                for (q, p) in replies {
                    let f = match layout {
                        Layout::V032 => vec![
                            id.clone(),
                            vec![],
                            topic.clone(),
                            q.to_be_bytes().to_vec(),
                            p,
                        ],
                        Layout::Old => vec![id.clone(), vec![], q.to_be_bytes().to_vec(), p],
                    };
                    if router.send(msg(f)).await.is_err() {
                        break;
                    }
                }
                let end = u64::MAX.to_be_bytes().to_vec();
                let f = match layout {
                    Layout::V032 => vec![id, vec![], vec![], end, vec![]],
                    Layout::Old => vec![id, vec![], end, vec![]],
                };
                let _ = router.send(msg(f)).await;
            }
        });
        TestPublisher {
            port: port_of(&ep),
            replay_port: port_of(&rep),
            socket,
            state,
            replay_task,
        }
    }

    /// A PUB that *connects* to `addr` (an engine configured with a non-wildcard endpoint).
    pub async fn connecting(addr: &str) -> TestPublisher {
        let mut p = TestPublisher::start(Layout::V032, 0).await;
        let mut socket = PubSocket::new();
        socket.connect(addr).await.expect("connect pub");
        p.socket = socket;
        p
    }

    pub fn set_buffer_steps(&self, n: usize) {
        self.state.lock().expect("state").buffer_steps = n;
    }

    fn record(&self, payload: &[u8]) -> u64 {
        let mut s = self.state.lock().expect("state");
        let seq = s.next_seq;
        s.next_seq += 1;
        s.buffer.push_back((seq, payload.to_vec()));
        while s.buffer.len() > s.buffer_steps {
            s.buffer.pop_front();
        }
        seq
    }

    /// Publishes a batch (buffered for replay too). Returns its seq.
    pub async fn publish(&mut self, payload: &[u8]) -> u64 {
        let seq = self.record(payload);
        let topic = self.state.lock().expect("state").topic.clone();
        self.socket
            .send(msg(vec![
                topic,
                seq.to_be_bytes().to_vec(),
                payload.to_vec(),
            ]))
            .await
            .expect("publish");
        seq
    }

    /// Sends the last published batch again under its own sequence number (what a PUB that
    /// had no subscriber yet dropped); a subscriber that had it drops the copy as a duplicate.
    pub async fn resend_last(&mut self) {
        let (topic, last) = {
            let s = self.state.lock().expect("state");
            (s.topic.clone(), s.buffer.back().cloned())
        };
        let Some((seq, payload)) = last else {
            return;
        };
        self.socket
            .send(msg(vec![topic, seq.to_be_bytes().to_vec(), payload]))
            .await
            .expect("resend");
    }

    /// Buffers a batch without sending it live (what a high-water-mark drop looks like).
    pub fn publish_unseen(&self, payload: &[u8]) -> u64 {
        self.record(payload)
    }

    /// Sends arbitrary frames on the PUB socket.
    pub async fn send_raw(&mut self, frames: Vec<Vec<u8>>) {
        self.socket.send(msg(frames)).await.expect("send raw");
    }

    /// A new engine instance behind the same sockets: seq back to 0, empty buffer.
    pub fn restart(&self) {
        let mut s = self.state.lock().expect("state");
        s.next_seq = 0;
        s.buffer.clear();
    }
}
