//! `kvroute events capture`: record an engine's raw event messages as JSON lines.
//!
//! Owns: one SUB socket (connect, or bind with `--bind`) with a topic filter, an optional
//! replay request from seq 0 first (so a late capture still starts from the beginning of the
//! publisher's buffer), and writing each message as `{"worker", "frames": [base64, ...]}` —
//! the conformance corpus format, so captures replay through `events decode` and
//! `conformance`. Replayed batches are written in the live 3-frame layout.
//! Must not: decode or judge what it records: a capture is raw evidence.

use anyhow::{Context, Result};
use base64::Engine as _;
use bytes::Bytes;
use kvroute_wire::{parse_replay_reply, replay_request, ReplayReply};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

pub struct CaptureOptions {
    pub endpoint: String,
    pub bind: bool,
    pub replay: Option<String>,
    pub topic: String,
    pub worker: String,
    pub out: PathBuf,
    /// Stop after this many messages (None: until the duration ends or Ctrl-C).
    pub count: Option<u64>,
    pub duration: Option<Duration>,
}

fn line(worker: &str, frames: &[&[u8]]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let frames: Vec<String> = frames.iter().map(|f| b64.encode(f)).collect();
    serde_json::json!({"worker": worker, "frames": frames}).to_string()
}

/// Runs a capture; returns the number of messages written.
pub async fn capture(o: CaptureOptions) -> Result<u64> {
    let file = std::fs::File::create(&o.out)
        .with_context(|| format!("cannot create {}", o.out.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let mut sub = SubSocket::new();
    sub.subscribe(&o.topic).await.context("subscribe")?;
    if o.bind {
        sub.bind(&o.endpoint)
            .await
            .with_context(|| format!("bind {}", o.endpoint))?;
    } else {
        sub.connect(&o.endpoint)
            .await
            .with_context(|| format!("connect {}", o.endpoint))?;
    }
    let mut written = 0u64;
    let mut last_replayed: Option<u64> = None;
    if let Some(r) = &o.replay {
        let mut d = DealerSocket::new();
        d.connect(r)
            .await
            .with_context(|| format!("connect replay {r}"))?;
        let req: Vec<Bytes> = replay_request(0).into_iter().map(Bytes::from).collect();
        d.send(ZmqMessage::try_from(req).map_err(|e| anyhow::anyhow!("{e}"))?)
            .await?;
        loop {
            let msg = match tokio::time::timeout(Duration::from_secs(3), d.recv()).await {
                Ok(Ok(m)) => m,
                _ => break,
            };
            let frames: Vec<Bytes> = msg.into_vec();
            let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
            match parse_replay_reply(&refs) {
                Ok(ReplayReply::End) => break,
                Ok(ReplayReply::Batch {
                    topic,
                    seq,
                    payload,
                }) => {
                    let seq_b = seq.to_be_bytes();
                    writeln!(
                        out,
                        "{}",
                        line(
                            &o.worker,
                            &[topic.unwrap_or(o.topic.as_bytes()), &seq_b, payload]
                        )
                    )?;
                    last_replayed = Some(seq);
                    written += 1;
                }
                Err(e) => eprintln!("skipping a malformed replay reply: {e}"),
            }
        }
    }
    out.flush()?;
    let deadline = o.duration.map(|d| tokio::time::Instant::now() + d);
    loop {
        if o.count.is_some_and(|c| written >= c) {
            break;
        }
        let recv = sub.recv();
        let msg = tokio::select! {
            m = recv => m,
            _ = tokio::signal::ctrl_c() => break,
            _ = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => break,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                eprintln!("receive failed: {e}");
                continue;
            }
        };
        let frames: Vec<Bytes> = msg.into_vec();
        // Live messages already covered by the replay are skipped (same seq space).
        if let (Some(last), Some(seq)) = (
            last_replayed,
            frames
                .get(1)
                .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()),
        ) {
            if u64::from_be_bytes(seq) <= last {
                continue;
            }
        }
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        writeln!(out, "{}", line(&o.worker, &refs))?;
        out.flush()?;
        written += 1;
    }
    out.flush()?;
    Ok(written)
}
