//! Live subscriptions against real ZMQ sockets on loopback, with an in-process publisher that
//! behaves like vLLM's. Every wait is bounded.

use crate::common;

use common::publisher::{Layout, TestPublisher};
use common::sink::{wait_for, wait_synced, Collected, SyncedSink};
use common::*;
use kvroute_wire::{
    payload_digest, spawn_subscription, DegradeReason, RankHealth, SinkMessage, StreamPosition,
    SubscriptionConfig, SubscriptionHandle, WireStats,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

const T: u64 = 15;

fn store(tag: u64) -> Vec<u8> {
    batch(vec![good_stored(&[tag])], 0)
}

struct Sub {
    handle: SubscriptionHandle,
    rx: mpsc::UnboundedReceiver<SinkMessage>,
    got: Collected,
    stats: Arc<WireStats>,
}

fn config(worker: &str, publisher: &TestPublisher, replay: bool) -> SubscriptionConfig {
    let mut cfg = SubscriptionConfig::new(
        worker,
        0,
        &format!("tcp://*:{}", publisher.port),
        "127.0.0.1",
    );
    if replay {
        cfg.replay_endpoint = Some(format!("tcp://*:{}", publisher.replay_port));
    }
    cfg.replay_timeout = Duration::from_secs(2);
    cfg.idle_reconnect = Some(Duration::from_secs(5));
    cfg
}

/// Starts a subscription and waits until it is connected and has settled its first sync.
async fn subscribe(cfg: SubscriptionConfig) -> Sub {
    let (tx, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(WireStats::new());
    let sink = Arc::new(SyncedSink::new(tx));
    let synced = sink.synced.clone();
    let handle = spawn_subscription(cfg, sink, stats.clone()).expect("spawn");
    wait_synced(&synced, T).await;
    Sub {
        handle,
        rx,
        got: Collected::default(),
        stats,
    }
}

impl Sub {
    async fn wait_trace(&mut self, want: &[&str]) {
        let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        let n = want.len();
        wait_for(&mut self.rx, &mut self.got, T, "the expected events", |c| {
            c.events.len() >= n
        })
        .await;
        assert_eq!(self.got.trace(), want);
    }

    async fn wait_health(&mut self, want: RankHealth) {
        wait_for(&mut self.rx, &mut self.got, T, "the expected health", |c| {
            c.last_health() == Some(want)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_recovers_history_by_replay_then_follows_the_live_stream() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    for t in 100..103 {
        p.publish(&store(t)).await;
    }
    let mut s = subscribe(config("w0", &p, true)).await;
    p.publish(&store(103)).await;
    p.publish(&store(104)).await;
    s.wait_trace(&["C", "100", "101", "102", "103", "104"])
        .await;
    s.wait_health(RankHealth::Healthy).await;
    let snap = s.stats.snapshot();
    assert_eq!((snap.batches["replayed"], snap.batches["applied"]), (3, 2));
    assert_eq!(snap.ranks[0].next_seq, Some(5));
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_by_one_replay_request() {
    let mut p = TestPublisher::start(Layout::Old, 0).await;
    let mut s = subscribe(config("w0", &p, true)).await;
    p.publish(&store(1)).await;
    p.publish_unseen(&store(2));
    p.publish_unseen(&store(3));
    p.publish(&store(4)).await;
    s.wait_trace(&["C", "1", "2", "3", "4"]).await;
    let snap = s.stats.snapshot();
    assert_eq!(
        (snap.gaps, snap.missed_batches, snap.clears_emitted),
        (1, 2, 1)
    );
    assert_eq!(
        snap.replay_requests, 2,
        "the startup replay and one for the gap"
    );
    s.wait_health(RankHealth::Healthy).await;
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_older_than_the_replay_buffer_clears_the_rank_and_marks_it_degraded() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    p.set_buffer_steps(2);
    let mut s = subscribe(config("w0", &p, true)).await;
    p.publish(&store(0)).await;
    for t in 1..5 {
        p.publish_unseen(&store(t));
    }
    p.publish(&store(5)).await;
    s.wait_trace(&["C", "0", "C", "4", "5"]).await;
    s.wait_health(RankHealth::Degraded(DegradeReason::ReplayWindowExceeded))
        .await;
    let snap = s.stats.snapshot();
    assert!(snap.ranks[0].degraded);
    assert_eq!(
        snap.ranks[0].degraded_reason,
        Some("replay_window_exceeded")
    );
    // An engine reset rebuilds the rank.
    p.publish(&batch(
        vec![M::A(vec![common::s("AllBlocksCleared")]), good_stored(&[6])],
        0,
    ))
    .await;
    s.wait_health(RankHealth::Healthy).await;
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restart_clears_the_rank_and_starts_over_from_seq_zero() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    let mut s = subscribe(config("w0", &p, true)).await;
    for t in 10..13 {
        p.publish(&store(t)).await;
    }
    s.wait_trace(&["C", "10", "11", "12"]).await;
    p.restart();
    p.publish(&store(20)).await;
    p.publish(&store(21)).await;
    s.wait_trace(&["C", "10", "11", "12", "C", "20", "21"])
        .await;
    let snap = s.stats.snapshot();
    assert_eq!((snap.restarts, snap.ranks[0].restarts), (1, 1));
    s.wait_health(RankHealth::Healthy).await;
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_late_join_is_degraded_until_a_new_instance_starts_at_zero() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    for t in 0..3 {
        p.publish(&store(t)).await;
    }
    let mut s = subscribe(config("w0", &p, false)).await;
    p.publish(&store(3)).await;
    s.wait_trace(&["C", "C", "3"]).await;
    s.wait_health(RankHealth::Degraded(DegradeReason::JoinedLate))
        .await;
    p.restart();
    p.publish(&store(50)).await;
    s.wait_trace(&["C", "C", "3", "C", "50"]).await;
    s.wait_health(RankHealth::Healthy).await;
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_interleave_and_each_rank_is_filed_by_its_port() {
    let mut a = TestPublisher::start(Layout::V032, 0).await;
    let mut b = TestPublisher::start(Layout::Old, 0).await;
    let mut sa = subscribe(config("wa", &a, true)).await;
    // Worker b is followed as DP rank 2: its port is the configured port + 2.
    let mut cfg = SubscriptionConfig::new("wb", 2, &format!("tcp://*:{}", b.port - 2), "127.0.0.1");
    cfg.replay_endpoint = Some(format!("tcp://*:{}", b.replay_port - 2));
    let mut sb = subscribe(cfg).await;
    for t in 0..20u64 {
        a.publish(&store(1000 + t)).await;
        b.publish(&store(2000 + t)).await;
    }
    let want_a: Vec<String> = std::iter::once("C".to_string())
        .chain((0..20).map(|t| (1000 + t).to_string()))
        .collect();
    let want_b: Vec<String> = std::iter::once("C".to_string())
        .chain((0..20).map(|t| (2000 + t).to_string()))
        .collect();
    sa.wait_trace(&want_a.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    sb.wait_trace(&want_b.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    assert!(sa
        .got
        .workers()
        .iter()
        .all(|(w, r)| &**w == "wa" && *r == 0));
    assert!(
        sb.got
            .workers()
            .iter()
            .all(|(w, r)| &**w == "wb" && *r == 2),
        "re-filed under the port's rank"
    );
    sa.handle.stop().await;
    sb.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sending_garbage_never_disturbs_another_and_survives_it() {
    let mut good = TestPublisher::start(Layout::V032, 0).await;
    let mut bad = TestPublisher::start(Layout::V032, 0).await;
    let mut sg = subscribe(config("good", &good, true)).await;
    let mut sb = subscribe(config("bad", &bad, false)).await;
    bad.publish(&store(1)).await;
    let seq1 = 1u64.to_be_bytes().to_vec();
    let garbage: Vec<Vec<Vec<u8>>> = vec![
        vec![b"kv".to_vec()],
        vec![b"kv".to_vec(), seq1.clone()],
        vec![b"kv".to_vec(), seq1.clone(), store(9), vec![]],
        vec![b"kv".to_vec(), vec![1, 2, 3], store(9)],
        vec![b"kv".to_vec(), seq1.clone(), vec![0x91; 100_000]],
    ];
    for (i, frames) in garbage.into_iter().enumerate() {
        bad.send_raw(frames).await;
        good.publish(&store(100 + i as u64)).await;
    }
    // The bad worker's seq 1 was consumed by an undecodable payload: cleared and degraded.
    bad.send_raw(vec![b"kv".to_vec(), 2u64.to_be_bytes().to_vec(), store(2)])
        .await;
    sb.wait_trace(&["C", "1", "C", "2"]).await;
    sb.wait_health(RankHealth::Degraded(DegradeReason::UndecodableBatch))
        .await;
    sg.wait_trace(&["C", "100", "101", "102", "103", "104"])
        .await;
    let snap = sb.stats.snapshot();
    assert_eq!(snap.frame_errors["wrong_frame_count"], 3);
    assert_eq!(snap.frame_errors["invalid_seq"], 1);
    assert_eq!(snap.batch_errors["too_deep"], 1);
    assert_eq!(sg.stats.snapshot().batch_errors.values().sum::<u64>(), 0);
    assert!(!sb.handle.is_finished());
    sg.handle.stop().await;
    sb.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sent_before_the_subscription_reached_the_publisher_is_fetched_without_a_later_one()
{
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    let mut cfg = config("w0", &p, true);
    cfg.join_check = Some(Duration::from_millis(300));
    let mut s = subscribe(cfg).await;
    // Sent to no subscriber (the slow joiner's loss), and nothing after it: no gap shows it.
    p.publish_unseen(&store(1));
    s.wait_trace(&["C", "1"]).await;
    let snap = s.stats.snapshot();
    assert_eq!(
        (snap.join_checks, snap.gaps, snap.clears_emitted),
        (1, 0, 1)
    );
    assert_eq!(snap.batches["replayed"], 1);
    // One check per connect: the live stream goes on as before.
    p.publish(&store(2)).await;
    s.wait_trace(&["C", "1", "2"]).await;
    assert_eq!(s.stats.snapshot().join_checks, 1);
    s.wait_health(RankHealth::Healthy).await;
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_that_hears_its_publisher_makes_no_join_check() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    let mut cfg = config("w0", &p, true);
    let join = Duration::from_secs(2);
    cfg.join_check = Some(join);
    let s = subscribe(cfg).await;
    let synced = std::time::Instant::now();
    // Published until one arrives live: one sent before the subscription reached the publisher
    // goes to no one (and shows as a gap at the next).
    let mut tag = 1;
    while s.stats.snapshot().batches["applied"] == 0 {
        assert!(
            synced.elapsed() < join,
            "no batch arrived live within the join check"
        );
        p.publish(&store(tag)).await;
        tag += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep((join + Duration::from_millis(500)).saturating_sub(synced.elapsed())).await;
    let snap = s.stats.snapshot();
    assert_eq!(snap.join_checks, 0, "heard live: no check");
    assert_eq!(
        snap.replay_requests,
        1 + snap.gaps,
        "the startup replay and one a gap"
    );
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_is_retried_until_the_publisher_appears() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("probe")
        .local_addr()
        .expect("addr")
        .port();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stats = Arc::new(WireStats::new());
    let mut cfg = SubscriptionConfig::new("w0", 0, &format!("tcp://*:{port}"), "127.0.0.1");
    cfg.connect_timeout = Duration::from_millis(300);
    cfg.backoff_max = Duration::from_millis(300);
    let sink = Arc::new(SyncedSink::new(tx));
    let synced = sink.synced.clone();
    let handle = spawn_subscription(cfg, sink, stats.clone()).expect("spawn");
    common::wait::wait_until(Duration::from_secs(T), "two failed attempts", || async {
        stats.snapshot().reconnects >= 2
    })
    .await;
    assert!(!synced.load(Ordering::Acquire), "nothing to sync with yet");
    let mut p = TestPublisher::start(Layout::V032, port).await;
    wait_synced(&synced, T).await;
    p.publish(&store(0)).await;
    let mut got = Collected::default();
    wait_for(&mut rx, &mut got, T, "the first batch", |c| {
        c.trace().contains(&"0".to_string())
    })
    .await;
    handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_connects_is_bound_for_by_the_subscriber() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("probe")
        .local_addr()
        .expect("addr")
        .port();
    let cfg = SubscriptionConfig::new("w0", 0, &format!("tcp://127.0.0.1:{port}"), "ignored");
    let mut s = subscribe(cfg).await;
    let mut p = TestPublisher::connecting(&format!("tcp://127.0.0.1:{port}")).await;
    // A PUB drops what it sends before the subscriber's subscription reaches it: the first
    // batch is sent again (same sequence number) until the subscriber has it.
    p.publish(&store(0)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(T);
    loop {
        let got = tokio::time::timeout(Duration::from_millis(100), s.rx.recv()).await;
        match got {
            Ok(Some(SinkMessage::Events(e))) => s.got.events.extend(e),
            Ok(Some(SinkMessage::Health { health, .. })) => s.got.health.push(health),
            Ok(None) => panic!("sink closed before the first batch arrived"),
            Err(_) => {}
        }
        if s.got.trace().contains(&"0".to_string()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber never received the first batch; got {:?}",
            s.got.trace()
        );
        p.resend_last().await;
    }
    p.publish(&store(1)).await;
    s.wait_trace(&["C", "0", "1"]).await;
    assert_eq!(s.stats.snapshot().gaps, 0, "no batch went missing");
    s.handle.stop().await;
}

/// The position of batch `seq` with payload `payload` (what a snapshot records).
fn position(seq: u64, payload: &[u8]) -> StreamPosition {
    StreamPosition {
        seq,
        digest: payload_digest(payload),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_subscription_applies_only_what_followed_its_position_and_never_clears() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    for t in 0..5 {
        p.publish(&store(t)).await;
    }
    let mut cfg = config("w0", &p, true);
    cfg.resume = Some(position(2, &store(2)));
    let mut s = subscribe(cfg).await;
    p.publish(&store(5)).await;
    s.wait_trace(&["3", "4", "5"]).await;
    s.wait_health(RankHealth::Healthy).await;
    let snap = s.stats.snapshot();
    assert_eq!(snap.clears_emitted, 0);
    assert_eq!(snap.ranks[0].next_seq, Some(6));
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_whose_batch_left_the_replay_buffer_clears_the_rank_and_marks_it_degraded() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    p.set_buffer_steps(2);
    for t in 0..6 {
        p.publish(&store(t)).await;
    }
    let mut cfg = config("w0", &p, true);
    cfg.resume = Some(position(1, &store(1)));
    let mut s = subscribe(cfg).await;
    s.wait_trace(&["C", "4", "5"]).await;
    s.wait_health(RankHealth::Degraded(DegradeReason::ReplayWindowExceeded))
        .await;
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_against_a_restarted_publisher_clears_and_replays_the_new_instance_from_zero() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    for t in 0..3 {
        p.publish(&store(t)).await;
    }
    // The snapshot's batch 1 was another payload: another instance wrote it.
    let mut cfg = config("w0", &p, true);
    cfg.resume = Some(position(1, &store(99)));
    let mut s = subscribe(cfg).await;
    s.wait_trace(&["C", "0", "1", "2"]).await;
    s.wait_health(RankHealth::Healthy).await;
    assert_eq!(s.stats.snapshot().restarts, 1);
    s.handle.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_without_a_replay_endpoint_starts_the_rank_empty() {
    let mut p = TestPublisher::start(Layout::V032, 0).await;
    for t in 0..3 {
        p.publish(&store(t)).await;
    }
    let mut cfg = config("w0", &p, false);
    cfg.resume = Some(position(2, &store(2)));
    let mut s = subscribe(cfg).await;
    p.publish(&store(3)).await;
    s.wait_trace(&["C", "C", "3"]).await;
    s.wait_health(RankHealth::Degraded(DegradeReason::JoinedLate))
        .await;
    s.handle.stop().await;
}
