//! The event stream's own faults, each over real ZMQ: batches sent twice or out of order, a
//! replay endpoint answering garbage, a jump in the engines' clocks, and the connection cut
//! for seconds by a TCP relay between the gateway and the engine. After each the index equals
//! the engine (or, while a loss cannot be repaired, holds nothing the engine lacks and says the
//! rank is degraded) and predictions are exact again.

use super::*;
use kvroute::gateway::config::KvEventsSpec;
use kvroute_sim::WireFaults;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicated_and_reordered_batches_are_applied_once_and_the_index_equals_the_engine() {
    let f = fleet(1).await;
    let gw = gateway(specs(&f, true)).await;
    traffic(&f, 0, 6).await;
    assert!(converged(&gw, &f).await);
    let w = &f.workers[0].worker;
    w.set_wire_faults(&WireFaults {
        duplicate_batches: Some(3),
        ..WireFaults::default()
    });
    traffic(&f, 6, 10).await;
    w.set_wire_faults(&WireFaults {
        reorder_batches: Some(2),
        ..WireFaults::default()
    });
    traffic(&f, 10, 18).await;
    assert!(
        converged(&gw, &f).await,
        "each batch applied once, in order"
    );
    assert_eq!(common::degraded_ranks(&gw), 0);
    let wire = gw.state.registry.wire_stats.snapshot();
    // Three second copies; a reordered batch's successor opens a gap that the replay fills,
    // after which both live copies are old.
    assert!(wire.batches["duplicate"] >= 5, "{:?}", wire.batches);
    assert!(wire.gaps >= 2, "a batch ahead of its turn is seen as a gap");
    assert_eq!(wire.restarts, 0, "nothing looked like a restart");
    assert_exact(&gw, &f).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_endpoint_answering_garbage_costs_that_rank_its_gap_and_disturbs_no_other() {
    let f = fleet(2).await;
    let gw = gateway(specs(&f, true)).await;
    traffic(&f, 0, 6).await;
    assert!(converged(&gw, &f).await);
    // w0 loses two batches and its replay answers a malformed reply, then batches that are
    // not MessagePack: the gap cannot be filled.
    f.workers[0].worker.set_wire_faults(&WireFaults {
        drop_batches: Some(2),
        garbage_replay: Some(true),
        ..WireFaults::default()
    });
    traffic(&f, 6, 14).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::degraded_ranks(&gw) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        common::degraded_ranks(&gw),
        1,
        "w0's rank says it is degraded"
    );
    assert_holds_nothing_extra(&gw, &f.workers[0]);
    let wire = gw.state.registry.wire_stats.snapshot();
    assert!(
        !wire.frame_errors.is_empty(),
        "the malformed reply is counted"
    );
    assert!(
        !wire.batch_errors.is_empty(),
        "the garbage batches are counted"
    );
    // The other engine's rank is untouched.
    assert_eq!(index_contents(&gw, "w1"), engine_contents(&f.workers[1]));
    // Its replay mended and the engine restarted: rebuilt and exact.
    f.workers[0].worker.set_wire_faults(&WireFaults {
        garbage_replay: Some(false),
        ..WireFaults::default()
    });
    restart_and_assert_rebuilt(&gw, &f, 14, 18).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jump_in_the_engines_clock_shows_in_the_lag_and_changes_nothing_the_index_holds() {
    let f = fleet(1).await;
    let gw = gateway(specs(&f, true)).await;
    traffic(&f, 0, 4).await;
    assert!(converged(&gw, &f).await);
    let lag = |gw: &GatewayHandle| {
        let wire = gw.state.registry.wire_stats.snapshot();
        wire.ranks
            .iter()
            .find(|r| r.worker == "w0")
            .and_then(|r| r.lag_seconds)
    };
    // An hour ahead: the lag reads about −3,600 s.
    f.workers[0].worker.set_wire_faults(&WireFaults {
        clock_offset_ms: Some(3_600_000),
        ..WireFaults::default()
    });
    traffic(&f, 4, 8).await;
    assert!(converged(&gw, &f).await);
    let ahead = lag(&gw).unwrap();
    assert!((-3_700.0..-3_500.0).contains(&ahead), "lag {ahead}");
    // Two hours behind.
    f.workers[0].worker.set_wire_faults(&WireFaults {
        clock_offset_ms: Some(-7_200_000),
        ..WireFaults::default()
    });
    traffic(&f, 8, 12).await;
    assert!(converged(&gw, &f).await);
    let behind = lag(&gw).unwrap();
    assert!((7_100.0..7_300.0).contains(&behind), "lag {behind}");
    assert_eq!(common::degraded_ranks(&gw), 0);
    let wire = gw.state.registry.wire_stats.snapshot();
    assert_eq!((wire.gaps, wire.restarts), (0, 0));
    assert_exact(&gw, &f).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_event_connection_is_noticed_by_its_silence_reconnected_and_its_gap_replayed() {
    let f = fleet(1).await;
    let h = &f.workers[0];
    let live = Relay::start(port_of(&h.zmq[0])).await;
    let replay = Relay::start(port_of(&h.replay[0])).await;
    let mut s = WorkerSpec::new(&h.name, &h.base_url, PRESET);
    s.kv_events = Some(KvEventsSpec {
        endpoint: format!("tcp://*:{}", live.port),
        replay_endpoint: Some(format!("tcp://*:{}", replay.port)),
        host: Some("127.0.0.1".into()),
        idle_reconnect_secs: 1.0,
        ..KvEventsSpec::new("")
    });
    let gw = gateway(vec![s]).await;
    traffic(&f, 0, 4).await;
    assert!(converged(&gw, &f).await);
    let before = gw.state.registry.wire_stats.snapshot();
    // No network: what the engine publishes meanwhile never arrives, and the gateway's
    // reconnects (after a second without a message) are refused; the cut lasts until two were.
    live.cut();
    replay.cut();
    traffic(&f, 4, 10).await;
    common::wait_until(
        common::WAIT,
        "two refused reconnects during the cut",
        || async { gw.state.registry.wire_stats.snapshot().reconnects >= before.reconnects + 2 },
    )
    .await;
    assert_ne!(
        index_contents(&gw, "w0"),
        engine_contents(h),
        "the cut lost batches"
    );
    live.restore();
    replay.restore();
    // No new traffic: the reconnect itself asks the replay endpoint what it missed.
    let deadline = Instant::now() + Duration::from_secs(20);
    while index_contents(&gw, "w0") != engine_contents(h) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        index_contents(&gw, "w0"),
        engine_contents(h),
        "the replay filled the cut"
    );
    assert_eq!(common::degraded_ranks(&gw), 0);
    let after = gw.state.registry.wire_stats.snapshot();
    assert!(after.reconnects > before.reconnects, "reconnected");
    assert!(
        after.replay_requests > before.replay_requests,
        "asked what it missed"
    );
    assert_eq!(after.restarts, 0, "the same engine instance");
    assert_exact(&gw, &f).await;
    gw.shutdown().await;
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// A TCP relay on loopback in front of one engine port. `cut` closes every relayed connection
/// and refuses new ones (accepted and closed at once) until `restore`.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Relay {
    async fn start(target: u16) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (c, k) = (cut.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut down, _)) = l.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let h = tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(("127.0.0.1", target)).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                k.lock().unwrap().push(h);
            }
        });
        Relay {
            port,
            cut,
            conns,
            accept,
        }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for h in self.conns.lock().unwrap().drain(..) {
            h.abort();
        }
    }

    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
        for h in self.conns.lock().unwrap().drain(..) {
            h.abort();
        }
    }
}
