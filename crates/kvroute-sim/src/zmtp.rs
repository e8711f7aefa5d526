//! A PUB peer that *connects* (vLLM's rule for a concrete tcp endpoint), speaking ZMTP 3.0 with
//! the NULL mechanism, in the background.
//!
//! Owns: the connection task to one subscriber address — connect, handshake, follow the
//! subscriber's subscriptions, send the messages that match one, and reconnect after the
//! subscriber goes away (every `RECONNECT` while it is absent, like libzmq's
//! `ZMQ_RECONNECT_IVL`) — and the bounded queue in front of it (the send high-water mark).
//! Invariants: [`ConnectingPub::send`] never waits: a message is dropped (and counted) when no
//! subscriber is connected, when none of the connected subscriber's subscriptions match its
//! first frame (libzmq's PUB drops before the subscription arrives too), or when the queue is
//! at its high-water mark; nothing a peer sends can panic the task or end it.
//! Must not: block the engine loop or the HTTP API on the subscriber, or buffer without bound.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How long to wait before trying again while the subscriber is absent.
pub const RECONNECT: Duration = Duration::from_millis(100);
/// Bound on one connect plus handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest frame a subscriber may send us (subscriptions are topic prefixes).
const MAX_PEER_FRAME: u64 = 1 << 20;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// What happened to the messages given to [`ConnectingPub::send`].
#[derive(Debug, Default)]
pub struct PubCounters {
    /// Messages written to a subscriber.
    pub sent: AtomicU64,
    /// Messages dropped: no subscriber, no matching subscription, or the queue was full.
    pub undelivered: AtomicU64,
    /// Connections made (the first one and every reconnect).
    pub connects: AtomicU64,
    /// Whether a subscriber is connected now.
    pub connected: AtomicBool,
}

/// The sending side; dropping it stops the connection task.
pub struct ConnectingPub {
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    counters: Arc<PubCounters>,
    task: JoinHandle<()>,
}

impl Drop for ConnectingPub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ConnectingPub {
    /// Starts connecting to `addr` (`host:port`) in the background and returns at once.
    pub fn start(addr: String, hwm: usize) -> ConnectingPub {
        let (tx, rx) = mpsc::channel(hwm.max(1));
        let counters = Arc::new(PubCounters::default());
        let task = tokio::spawn(run(addr, rx, counters.clone()));
        ConnectingPub { tx, counters, task }
    }

    /// Queues one multipart message for the connected subscriber; never waits. False when it
    /// was dropped at once (nobody connected, or the queue is at its high-water mark).
    pub fn send(&self, frames: Vec<Vec<u8>>) -> bool {
        let queued =
            self.counters.connected.load(Ordering::Relaxed) && self.tx.try_send(frames).is_ok();
        if !queued {
            self.counters.undelivered.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    pub fn counters(&self) -> Arc<PubCounters> {
        self.counters.clone()
    }
}

/// Why a connection ended.
#[derive(Debug)]
enum Ended {
    Io(std::io::Error),
    Protocol(&'static str),
    Closed,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Io(e) => write!(f, "{e}"),
            Ended::Protocol(why) => f.write_str(why),
            Ended::Closed => f.write_str("closed"),
        }
    }
}

impl From<std::io::Error> for Ended {
    fn from(e: std::io::Error) -> Self {
        Ended::Io(e)
    }
}

async fn run(addr: String, mut rx: mpsc::Receiver<Vec<Vec<u8>>>, c: Arc<PubCounters>) {
    loop {
        let attempt = tokio::time::timeout(HANDSHAKE_TIMEOUT, connect(&addr)).await;
        match attempt {
            Ok(Ok((reader, writer))) => {
                c.connects.fetch_add(1, Ordering::Relaxed);
                // Whatever was queued while nobody listened is stale: drop it.
                while rx.try_recv().is_ok() {
                    c.undelivered.fetch_add(1, Ordering::Relaxed);
                }
                c.connected.store(true, Ordering::Relaxed);
                let why = serve(reader, writer, &mut rx, &c).await;
                c.connected.store(false, Ordering::Relaxed);
                tracing::debug!(%addr, %why, "subscriber connection ended; reconnecting");
            }
            Ok(Err(e)) => tracing::trace!(%addr, %e, "subscriber not reachable yet"),
            Err(_) => tracing::debug!(%addr, "connect or handshake timed out"),
        }
        tokio::time::sleep(RECONNECT).await;
    }
}

/// The 64-byte ZMTP 3.0 greeting of a NULL-mechanism client.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command body announcing a PUB socket.
fn ready() -> Vec<u8> {
    let mut b = vec![5];
    b.extend_from_slice(b"READY");
    b.push(11);
    b.extend_from_slice(b"Socket-Type");
    b.extend_from_slice(&3u32.to_be_bytes());
    b.extend_from_slice(b"PUB");
    b
}

async fn connect(addr: &str) -> Result<(OwnedReadHalf, BufWriter<OwnedWriteHalf>), Ended> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut r, w) = stream.into_split();
    let mut w = BufWriter::new(w);
    w.write_all(&greeting()).await?;
    w.flush().await?;
    let mut peer = [0u8; 64];
    r.read_exact(&mut peer).await?;
    if peer[0] != 0xFF || peer[9] & 0x01 != 0x01 || peer[10] < 3 {
        return Err(Ended::Protocol("not a ZMTP 3 greeting"));
    }
    if &peer[12..16] != b"NULL" {
        return Err(Ended::Protocol(
            "the subscriber asks for a security mechanism",
        ));
    }
    write_frame(&mut w, FLAG_COMMAND, &ready()).await?;
    w.flush().await?;
    let (flags, body) = read_frame(&mut r).await?;
    if flags & FLAG_COMMAND == 0 || !body.starts_with(b"\x05READY") {
        return Err(Ended::Protocol("the peer did not answer READY"));
    }
    if !socket_type_is(&body, b"SUB") && !socket_type_is(&body, b"XSUB") {
        return Err(Ended::Protocol("the peer is not a SUB socket"));
    }
    Ok((r, w))
}

/// Whether a READY body names `want` as its `Socket-Type`.
fn socket_type_is(body: &[u8], want: &[u8]) -> bool {
    let mut p = 6;
    while p < body.len() {
        let n = body[p] as usize;
        let Some(name) = body.get(p + 1..p + 1 + n) else {
            return false;
        };
        let Some(len) = body.get(p + 1 + n..p + 5 + n) else {
            return false;
        };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let Some(value) = body.get(p + 5 + n..p + 5 + n + len) else {
            return false;
        };
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return value == want;
        }
        p += 5 + n + len;
    }
    false
}

async fn write_frame(
    w: &mut BufWriter<OwnedWriteHalf>,
    flags: u8,
    body: &[u8],
) -> std::io::Result<()> {
    if body.len() > 255 {
        w.write_all(&[flags | FLAG_LONG]).await?;
        w.write_all(&(body.len() as u64).to_be_bytes()).await?;
    } else {
        w.write_all(&[flags, body.len() as u8]).await?;
    }
    w.write_all(body).await
}

async fn read_frame(r: &mut OwnedReadHalf) -> Result<(u8, Vec<u8>), Ended> {
    let flags = r.read_u8().await?;
    let len = if flags & FLAG_LONG != 0 {
        r.read_u64().await?
    } else {
        u64::from(r.read_u8().await?)
    };
    if len > MAX_PEER_FRAME {
        return Err(Ended::Protocol("frame from the subscriber too large"));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    Ok((flags, body))
}

/// A subscription change a subscriber sent.
#[derive(Debug, PartialEq, Eq)]
enum Change {
    Subscribe(Vec<u8>),
    Cancel(Vec<u8>),
    Ping(Vec<u8>),
    Other,
}

/// ZMTP 3.0 sends subscriptions as a message `0x01 topic` / `0x00 topic`; ZMTP 3.1 as the
/// commands `SUBSCRIBE` / `CANCEL`; either may ping.
fn change(flags: u8, body: Vec<u8>) -> Change {
    if flags & FLAG_COMMAND != 0 {
        let n = body.first().copied().unwrap_or(0) as usize;
        let name = body.get(1..1 + n).unwrap_or_default();
        let rest = body.get(1 + n..).unwrap_or_default().to_vec();
        return match name {
            b"SUBSCRIBE" => Change::Subscribe(rest),
            b"CANCEL" => Change::Cancel(rest),
            // PING: a 2-byte TTL, then the context the PONG echoes.
            b"PING" => Change::Ping(rest.get(2..).unwrap_or_default().to_vec()),
            _ => Change::Other,
        };
    }
    match body.split_first() {
        Some((1, topic)) => Change::Subscribe(topic.to_vec()),
        Some((0, topic)) => Change::Cancel(topic.to_vec()),
        _ => Change::Other,
    }
}

fn matches(subs: &[Vec<u8>], frames: &[Vec<u8>]) -> bool {
    let first = frames.first().map(Vec::as_slice).unwrap_or_default();
    subs.iter().any(|s| first.starts_with(s))
}

/// Reads what the subscriber sends until it goes away (its own task, so a frame is never
/// half read when a message to send wins the race).
async fn read_changes(mut r: OwnedReadHalf, tx: mpsc::Sender<Change>) -> Ended {
    loop {
        let (flags, body) = match read_frame(&mut r).await {
            Ok(f) => f,
            Err(Ended::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ended::Closed
            }
            Err(e) => return e,
        };
        let ch = change(flags, body);
        if ch != Change::Other && tx.send(ch).await.is_err() {
            return Ended::Closed;
        }
    }
}

async fn serve(
    r: OwnedReadHalf,
    mut w: BufWriter<OwnedWriteHalf>,
    rx: &mut mpsc::Receiver<Vec<Vec<u8>>>,
    c: &PubCounters,
) -> Ended {
    let (ch_tx, mut ch_rx) = mpsc::channel(64);
    let mut reader = tokio::spawn(read_changes(r, ch_tx));
    let mut subs: Vec<Vec<u8>> = Vec::new();
    let why = loop {
        tokio::select! {
            ended = &mut reader => {
                break ended.unwrap_or(Ended::Protocol("the reader stopped"));
            }
            Some(ch) = ch_rx.recv() => {
                if let Err(e) = apply(ch, &mut subs, &mut w).await {
                    break e.into();
                }
            }
            msg = rx.recv() => {
                let Some(frames) = msg else { break Ended::Protocol("the publisher stopped") };
                if !matches(&subs, &frames) {
                    c.undelivered.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if let Err(e) = write_message(&mut w, &frames).await {
                    break e.into();
                }
                c.sent.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    reader.abort();
    why
}

/// Follows one subscription change (answering a PING with its PONG).
async fn apply(
    ch: Change,
    subs: &mut Vec<Vec<u8>>,
    w: &mut BufWriter<OwnedWriteHalf>,
) -> std::io::Result<()> {
    match ch {
        Change::Subscribe(t) => subs.push(t),
        Change::Cancel(t) => {
            if let Some(i) = subs.iter().position(|s| *s == t) {
                subs.swap_remove(i);
            }
        }
        Change::Ping(ctx) => {
            let mut pong = vec![4];
            pong.extend_from_slice(b"PONG");
            pong.extend_from_slice(&ctx);
            write_frame(w, FLAG_COMMAND, &pong).await?;
            w.flush().await?;
        }
        Change::Other => {}
    }
    Ok(())
}

async fn write_message(
    w: &mut BufWriter<OwnedWriteHalf>,
    frames: &[Vec<u8>],
) -> std::io::Result<()> {
    let last = frames.len().saturating_sub(1);
    for (i, f) in frames.iter().enumerate() {
        let flags = if i < last { FLAG_MORE } else { 0 };
        write_frame(w, flags, f).await?;
    }
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_names_a_pub_socket() {
        let b = ready();
        assert!(socket_type_is(&b, b"PUB"));
        assert!(!socket_type_is(&b, b"SUB"));
        assert!(!socket_type_is(&b[..b.len() - 1], b"PUB"));
    }

    #[test]
    fn subscriptions_are_read_in_both_zmtp_spellings() {
        assert_eq!(
            change(0, b"\x01kv".to_vec()),
            Change::Subscribe(b"kv".to_vec())
        );
        assert_eq!(
            change(0, b"\x00kv".to_vec()),
            Change::Cancel(b"kv".to_vec())
        );
        let mut cmd = vec![9];
        cmd.extend_from_slice(b"SUBSCRIBE");
        assert_eq!(change(FLAG_COMMAND, cmd), Change::Subscribe(vec![]));
        assert_eq!(change(FLAG_COMMAND, vec![200]), Change::Other);
        assert_eq!(change(0, vec![]), Change::Other);
    }

    #[test]
    fn only_messages_under_a_subscribed_prefix_match() {
        let frames = vec![b"kv@w0".to_vec(), vec![1]];
        assert!(matches(&[b"".to_vec()], &frames));
        assert!(matches(&[b"kv".to_vec()], &frames));
        assert!(!matches(&[b"other".to_vec()], &frames));
        assert!(!matches(&[], &frames));
    }
}
