//! Subscriptions against a publisher written in Python with `pyzmq` + `msgspec`, encoding
//! batches the way the engines do, in both replay-reply layouts. Skipped (with a message saying
//! how to install them) when python3 or those modules are missing, except under `CI=true`,
//! where that fails; `.ci/run` installs them.

use crate::common;

use common::sink::{wait_for, wait_synced, Collected, SyncedSink};
use kvroute_wire::{spawn_subscription, Dialect, RankHealth, SubscriptionConfig, WireStats};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;

const T: u64 = 15;

fn python_ready() -> bool {
    common::python::python_has(&["zmq", "msgspec"], "pyzmq msgspec")
}

struct PyPublisher {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    port: u16,
    replay_port: u16,
}

impl PyPublisher {
    async fn start(layout: &str) -> PyPublisher {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/publisher.py");
        let mut child = Command::new("python3")
            .args([script, layout])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let line = tokio::time::timeout(Duration::from_secs(T), stdout.next_line())
            .await
            .expect("publisher ready in time")
            .expect("read")
            .expect("a ready line");
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts.first(), Some(&"ready"), "{line}");
        let port = parts[1].parse().expect("port");
        let replay_port = parts[2].parse().expect("replay port");
        PyPublisher {
            child,
            stdin,
            stdout,
            port,
            replay_port,
        }
    }

    async fn cmd(&mut self, json: String) -> String {
        self.stdin
            .write_all(format!("{json}\n").as_bytes())
            .await
            .expect("write");
        self.stdin.flush().await.expect("flush");
        tokio::time::timeout(Duration::from_secs(T), self.stdout.next_line())
            .await
            .expect("publisher answered in time")
            .expect("read")
            .expect("an answer")
    }

    async fn publish(&mut self, hashes: &[u64], live: bool) {
        let h: Vec<String> = hashes.iter().map(|x| x.to_string()).collect();
        let r = self
            .cmd(format!(
                r#"{{"op":"publish","hashes":[{}],"live":{live}}}"#,
                h.join(",")
            ))
            .await;
        assert!(r.starts_with("ok"), "{r}");
    }

    async fn restart(&mut self) {
        assert_eq!(self.cmd(r#"{"op":"restart"}"#.into()).await, "ok");
    }

    async fn quit(mut self) {
        let _ = self.stdin.write_all(b"{\"op\":\"quit\"}\n").await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }
}

async fn run_scenario(layout: &str, dialect: Dialect) {
    let mut p = PyPublisher::start(layout).await;
    // Published before anyone listens: only the startup replay can recover these.
    let big = u64::MAX - 5;
    p.publish(&[1, big], true).await;
    p.publish(&[2], true).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stats = Arc::new(WireStats::new());
    let mut cfg = SubscriptionConfig::new("py", 0, &format!("tcp://*:{}", p.port), "127.0.0.1");
    cfg.replay_endpoint = Some(format!("tcp://*:{}", p.replay_port));
    cfg.topic = "kv".into();
    cfg.dialect = dialect;
    let sink = Arc::new(SyncedSink::new(tx));
    let synced = sink.synced.clone();
    let handle = spawn_subscription(cfg, sink, stats.clone()).expect("spawn");
    wait_synced(&synced, T).await;
    let mut got = Collected::default();
    // Live, then a gap the replay must fill, then live again.
    p.publish(&[3], true).await;
    p.publish(&[4], false).await;
    p.publish(&[5], true).await;
    let want = ["C", "1", "2", "3", "4", "5"];
    wait_for(
        &mut rx,
        &mut got,
        T,
        "history, live and the filled gap",
        |c| c.events.len() >= want.len(),
    )
    .await;
    assert_eq!(got.trace(), want);
    let first = match &got.events[1] {
        kvroute_index::Event::Stored(s) => s.hashes.iter().map(|h| h.value.0).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        first,
        vec![1, big],
        "signed or unsigned on the wire, the same 64 bits"
    );
    let snap = stats.snapshot();
    // Startup replay: seqs 0, 1; the gap replay: 3 and 4 (the live copy of 4 is then skipped).
    assert_eq!((snap.gaps, snap.batches["replayed"]), (1, 4));
    assert!(snap.drops.values().all(|n| *n == 0), "{:?}", snap.drops);
    // The engine restarts: the rank is cleared and followed again from seq 0.
    p.restart().await;
    p.publish(&[6], true).await;
    wait_for(&mut rx, &mut got, T, "the restart", |c| {
        c.events.len() >= want.len() + 2
    })
    .await;
    assert_eq!(&got.trace()[want.len()..], ["C", "6"]);
    wait_for(&mut rx, &mut got, T, "healthy", |c| {
        c.last_health() == Some(RankHealth::Healthy)
    })
    .await;
    assert_eq!(stats.snapshot().restarts, 1);
    handle.stop().await;
    p.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_vllm_032_publisher_is_followed_through_replay_gaps_and_restarts() {
    if !python_ready() {
        return;
    }
    run_scenario("v032", Dialect::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_sglang_style_publisher_with_three_frame_replies_is_followed_too() {
    if !python_ready() {
        return;
    }
    run_scenario("old", Dialect::Sglang).await;
}
