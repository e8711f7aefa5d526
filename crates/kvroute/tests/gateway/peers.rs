//! Replicas joined by the booking channel (`[peers]`), over real sockets: each counts the
//! others' requests in flight the moment they are sent, with no engine poll between; a replica
//! that is killed, cut off or restarted costs the others its bookings (dropped at its silence
//! or its new incarnation), never a request; replicas sharing what they learn decide a request
//! alike whichever of them it reaches, and weigh each sample of a worker's load by the
//! placements the fleet made since their last (at most one per replica heard from), and take
//! turns among equal workers across the fleet as one gateway does.

use crate::common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::config::peers::PeersConfig;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

const PRESET: &str = "tiny-gemma3";

async fn fleet(speedup: f64) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = speedup;
    Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap()
}

/// A replica's configuration: the engines polled once a minute (so what a replica counts of
/// the others' work between polls comes from the channel alone), a fast heartbeat.
fn replica_config(f: &Fleet, name: &str, peers: Vec<String>) -> GatewayConfig {
    let workers = f.workers.iter().map(|h| common::sim_spec(h, PRESET, true));
    GatewayConfig {
        load_poll_interval_secs: 60.0,
        peers: PeersConfig {
            urls: peers,
            name: Some(name.into()),
            heartbeat_secs: 0.1,
            timeout_secs: 0.6,
            ..PeersConfig::default()
        },
        ..common::gateway_config(workers.collect())
    }
}

async fn replica(f: &Fleet, name: &str) -> GatewayHandle {
    let gw = Gateway::start(replica_config(f, name, Vec::new()))
        .await
        .unwrap();
    common::ready(&gw).await;
    gw
}

/// Links every replica to every other (a reload-free reconfiguration: what `[peers]` does).
fn join(replicas: &[&GatewayHandle]) {
    join_sharing(replicas, true);
}

/// [`join`], sharing what the replicas learn (`[peers] learning`) or only their bookings.
fn join_sharing(replicas: &[&GatewayHandle], learning: bool) {
    for g in replicas {
        let mut cfg = (*g.state.config()).clone();
        cfg.peers.learning = learning;
        cfg.peers.urls = replicas
            .iter()
            .map(|o| format!("http://{}", o.admin_addr))
            .collect();
        g.state.peers.configure(
            &cfg.peers,
            kvroute::gateway::peers::SendContext::new(&g.state.client, &cfg),
        );
    }
}

/// Replicas a, b and c in front of `f`, joined, sharing what they learn.
async fn three_joined(f: &Fleet) -> (GatewayHandle, GatewayHandle, GatewayHandle) {
    let (a, b, c) = (
        replica(f, "a").await,
        replica(f, "b").await,
        replica(f, "c").await,
    );
    join(&[&a, &b, &c]);
    (a, b, c)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

/// Sends a completion through `front` in the background; resolves to its status.
fn send(front: String, p: Vec<u32>, max_tokens: u32) -> tokio::task::JoinHandle<u16> {
    tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(format!("http://{front}/v1/completions"))
            .json(&json!({"model": PRESET, "prompt": p, "max_tokens": max_tokens}))
            .send()
            .await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let _ = r.bytes().await;
                status
            }
            Err(_) => 0,
        }
    })
}

/// Requests the only worker has running as `gw` counts them.
fn running(gw: &GatewayHandle) -> u64 {
    gw.state.registry.all()[0].running()
}

async fn peers_view(admin: &str) -> Value {
    reqwest::get(format!("http://{admin}/admin/peers"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peered_replicas_count_each_others_requests_in_flight_with_no_engine_poll_between() {
    let f = fleet(0.05).await;
    let (a, b, c) = three_joined(&f).await;
    let tasks: Vec<_> = (0..3)
        .map(|k| send(b.addr.to_string(), prompt(600 + k, 200), 64))
        .collect();
    for g in [&a, &c] {
        common::wait_until(
            common::WAIT,
            "a peer counting b's three requests",
            || async { running(g) == 3 },
        )
        .await;
        let w = &g.state.registry.all()[0];
        assert_eq!(w.pending.len(), 3, "b's prompts are in flight here too");
        assert_eq!(g.state.peers.remote_bookings(), 3);
    }
    // b's own count is its own requests only: it ignores its own messages.
    assert_eq!(running(&b), 3);
    assert_eq!(b.state.peers.remote_bookings(), 0);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    for g in [&a, &c] {
        common::wait_until(
            common::WAIT,
            "b's requests released on its peers",
            || async { running(g) == 0 && g.state.peers.remote_bookings() == 0 },
        )
        .await;
        assert!(g.state.registry.all()[0].pending.is_empty());
    }
    let text = common::admin_metrics(&a).await;
    assert!(
        common::metric(
            &text,
            "kvroute_peer_messages_total{direction=\"received\",kind=\"booked\"}"
        ) >= 3.0
    );
    assert!(
        common::metric(
            &text,
            "kvroute_peer_messages_total{direction=\"received\",kind=\"done\"}"
        ) >= 3.0
    );
    for g in [a, b, c] {
        g.shutdown().await;
    }
}

/// The requests recently running on the only worker, as `gw` has sampled them.
fn mean_running(gw: &GatewayHandle) -> f64 {
    gw.state.registry.all()[0]
        .learners
        .lock()
        .decode
        .mean_running()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_sample_weighs_its_peers_placements_since_the_last_at_most_one_per_replica_heard(
) {
    let f = fleet(0.05).await;
    let (a, b, c) = three_joined(&f).await;
    common::wait_until(common::WAIT, "a hearing from b and c", || async {
        a.state.peers.heard() == 2
    })
    .await;
    // Four long requests placed by b and c: a counts their placements and their requests in
    // flight, and has sampled nothing yet.
    let tasks: Vec<_> = (0..4)
        .map(|k| {
            let front = if k % 2 == 0 { &b } else { &c };
            send(front.addr.to_string(), prompt(800 + k, 200), 400)
        })
        .collect();
    common::wait_until(common::WAIT, "a counting four placements", || async {
        a.state.registry.placements() == 4 && running(&a) == 4
    })
    .await;
    assert_eq!(mean_running(&a), 0.0);
    // a's own decision samples the four running there once, weighed as the three placements
    // one replica in three would have sampled (uncapped: four; peers' placements uncounted: one).
    let own = send(a.addr.to_string(), prompt(900, 200), 400);
    common::wait_until(common::WAIT, "a placing its own request", || async {
        a.state.registry.placements() == 5
    })
    .await;
    assert_eq!(running(&a), 5, "no request ended while a decided");
    let expected = 4.0 * kvroute::gateway::ttft::wait_weight(3);
    let got = mean_running(&a);
    assert!(
        (got - expected).abs() < 1e-9,
        "a's sample weighs {} placements' worth, not 3",
        (1.0 - got / 4.0).ln() / (1.0 - kvroute::gateway::ttft::WAIT_WEIGHT).ln()
    );
    for t in tasks.into_iter().chain([own]) {
        t.abort();
    }
    for g in [a, b, c] {
        g.shutdown().await;
    }
}

/// Sends a completion through `gw`; the worker it went to (every decision is explained).
async fn placed_on(gw: &GatewayHandle, p: Vec<u32>) -> String {
    let body = json!({"model": PRESET, "prompt": p, "max_tokens": 4});
    let (status, decision, _) = common::post_completion(gw, &body).await;
    assert_eq!(status, 200);
    decision["worker"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peered_replicas_take_turns_among_equal_workers_across_the_fleet_as_one_gateway_does() {
    let cfg = WorkerConfig::for_preset(PRESET).unwrap();
    let f = Fleet::start(FleetOptions::new(cfg, 4)).await.unwrap();
    let (a, b, c) = three_joined(&f).await;
    let replicas = [&a, &b, &c];
    // Eight new prompts, one at a time on an idle fleet (every worker equal), request i to
    // replica i mod 3: each replica counting only its own turns would send the first request
    // each of them sees to the same worker.
    let mut chosen = Vec::new();
    for i in 0..8usize {
        chosen.push(placed_on(replicas[i % 3], prompt(300 + i as u32, 64)).await);
        common::wait_until(
            common::WAIT,
            "every replica counting the placement",
            || async {
                replicas.iter().all(|g| {
                    g.state.registry.placements() == i as u64 + 1
                        && g.state.registry.all().iter().all(|w| w.running() == 0)
                })
            },
        )
        .await;
    }
    for four in chosen.chunks(4) {
        let distinct: std::collections::BTreeSet<&String> = four.iter().collect();
        assert_eq!(distinct.len(), 4, "equal workers take turns: {chosen:?}");
    }
    for g in [a, b, c] {
        g.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_without_peers_see_another_replicas_requests_only_at_the_next_engine_poll() {
    let f = fleet(0.05).await;
    let (a, b) = (replica(&f, "a").await, replica(&f, "b").await);
    let tasks: Vec<_> = (0..2)
        .map(|k| send(b.addr.to_string(), prompt(700 + k, 200), 64))
        .collect();
    common::wait_until(common::WAIT, "b counting its two requests", || async {
        running(&b) == 2
    })
    .await;
    // Nothing tells a: its engine figures are a minute old.
    assert_eq!(running(&a), 0);
    assert_eq!(a.state.peers.remote_bookings(), 0);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    for g in [a, b] {
        g.shutdown().await;
    }
}

/// A TCP forwarder that can be cut (every connection dropped, new ones refused) and restored:
/// a network partition between two replicas.
struct Cable {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    generation: Arc<AtomicU64>,
}

impl Cable {
    async fn to(target: SocketAddr) -> Cable {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let generation = Arc::new(AtomicU64::new(0));
        let (c, g) = (cut.clone(), generation.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let (c, g) = (c.clone(), g.clone());
                let born = g.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    let Ok(mut out) = TcpStream::connect(target).await else {
                        return;
                    };
                    let pipe = tokio::io::copy_bidirectional(&mut inbound, &mut out);
                    let watch = async {
                        while !c.load(Ordering::SeqCst) && g.load(Ordering::SeqCst) == born {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    };
                    tokio::select! { _ = pipe => {}, _ = watch => {} }
                });
            }
        });
        Cable {
            addr,
            cut,
            generation,
        }
    }

    fn cut(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.cut.store(true, Ordering::SeqCst);
    }

    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// `kvroute serve` as a child process (a replica that can be killed), and its front address as
/// it printed it.
struct Child {
    process: std::process::Child,
    front: String,
}

fn spawn_replica(cfg: &GatewayConfig, dir: &std::path::Path, name: &str) -> Child {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, toml::to_string(cfg).unwrap()).unwrap();
    let mut process = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--config"])
        .arg(&path)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = process.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let line = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the replica printed its addresses");
        if line.contains("(admin http://") {
            break line;
        }
    };
    let front = line
        .split("listening on http://")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap()
        .to_string();
    Child { process, front }
}

/// A steady load through `fronts` (round robin) until `stop`: every answer's status and
/// when it came back.
fn steady_load(
    fronts: Vec<String>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(u16, Instant)>> {
    tokio::spawn(async move {
        let mut out = Vec::new();
        let mut k = 0u32;
        while !stop.load(Ordering::SeqCst) {
            let batch: Vec<_> = (0..2)
                .map(|j| {
                    k += 1;
                    send(
                        fronts[(k as usize + j) % fronts.len()].clone(),
                        prompt(k, 80),
                        4,
                    )
                })
                .collect();
            for t in batch {
                out.push((t.await.unwrap(), Instant::now()));
            }
        }
        out
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_cut_off_or_restarted_costs_the_others_its_bookings_never_a_request() {
    let f = fleet(0.2).await;
    let dir = std::env::temp_dir().join(format!("kvroute-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (replica(&f, "a").await, replica(&f, "b").await);
    // c, a process, reaches a through a cable that can be cut, and b directly.
    let cable = Cable::to(a.admin_addr).await;
    let c_cfg = replica_config(
        &f,
        "c",
        vec![
            format!("http://{}", cable.addr),
            format!("http://{}", b.admin_addr),
        ],
    );
    let mut c = spawn_replica(&c_cfg, &dir, "c");
    common::ready_at(&c.front).await;
    join(&[&a, &b]);
    let stop = Arc::new(AtomicBool::new(false));
    let load = steady_load(vec![a.addr.to_string(), b.addr.to_string()], stop.clone());

    // c's long requests are counted by a and b.
    let long = |k: u32| send(c.front.clone(), prompt(900 + k, 200), 400);
    let first: Vec<_> = (0..2).map(long).collect();
    for g in [&a, &b] {
        common::wait_until(common::WAIT, "c's two requests counted", || async {
            g.state.peers.remote_bookings() == 2
        })
        .await;
    }

    // Cut off from a: a drops c's bookings at c's silence; b, still linked, keeps them.
    cable.cut();
    common::wait_until(
        common::WAIT,
        "a dropping the silent c's bookings",
        || async { a.state.peers.remote_bookings() == 0 },
    )
    .await;
    assert_eq!(b.state.peers.remote_bookings(), 2);
    // Restored: c's next heartbeat brings its open bookings back as live, not the bookings
    // themselves (their `Booked` went to the cut cable); a counts c's new requests again.
    cable.restore();
    common::wait_until(common::WAIT, "a hearing c's heartbeat again", || async {
        let v = peers_view(&a.admin_addr.to_string()).await;
        v["heard"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["replica"] == "c")
    })
    .await;
    let second: Vec<_> = (2..3).map(long).collect();
    common::wait_until(common::WAIT, "a hearing c again", || async {
        a.state.peers.remote_bookings() >= 1
    })
    .await;
    let before = peers_view(&a.admin_addr.to_string()).await;
    let incarnation = before["heard"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["replica"] == "c")
        .map(|p| p["incarnation"].clone())
        .unwrap();

    // Killed: c's bookings go at its silence, on both.
    let killed_at = Instant::now();
    c.process.kill().unwrap();
    c.process.wait().unwrap();
    for g in [&a, &b] {
        common::wait_until(common::WAIT, "the dead c's bookings dropped", || async {
            g.state.peers.remote_bookings() == 0
                && running(g) == g.state.registry.all()[0].in_flight.load(Ordering::Relaxed)
        })
        .await;
    }
    for t in first.into_iter().chain(second) {
        // c's clients saw their connection end with c; nothing else did.
        let _ = t.await.unwrap();
    }

    // Restarted under the same name: a new incarnation, heard by both.
    let mut c2 = spawn_replica(&c_cfg, &dir, "c");
    common::ready_at(&c2.front).await;
    let fresh = send(c2.front.clone(), prompt(990, 200), 400);
    common::wait_until(common::WAIT, "the restarted c heard", || async {
        let v = peers_view(&a.admin_addr.to_string()).await;
        v["heard"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["replica"] == "c" && p["incarnation"] != incarnation && p["bookings"] == 1)
    })
    .await;
    fresh.abort();

    stop.store(true, Ordering::SeqCst);
    let answers = load.await.unwrap();
    let failed: Vec<_> = answers.iter().filter(|(s, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "requests through a and b failed: {failed:?}"
    );
    assert!(
        answers.iter().any(|(_, t)| *t < killed_at) && answers.iter().any(|(_, t)| *t > killed_at),
        "the load overlapped the kill: {} answers",
        answers.len()
    );
    let text = common::admin_metrics(&a).await;
    assert!(common::metric(&text, "kvroute_peer_dropped_total{reason=\"peer_silent\"}") >= 2.0);
    let _ = c2.process.kill();
    let _ = c2.process.wait();
    for g in [a, b] {
        g.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_find_each_other_in_dns_srv_records_as_a_headless_service_names_them() {
    use crate::common::dns::Dns;
    use hickory_resolver::proto::rr::rdata::{A, SRV};
    use hickory_resolver::proto::rr::{Name, RData, Record};
    use kvroute::gateway::config::peers::PeersDns;

    let f = fleet(0.05).await;
    let dns = Dns::with_glue("peers.test.").await;
    let service = "kvroute-peers.peers.test.";
    let name = |n: &str| Name::from_ascii(n).unwrap();
    let start = |n: &'static str| {
        let mut cfg = replica_config(&f, n, Vec::new());
        cfg.peers.dns = Some(PeersDns {
            name: service.into(),
            record: kvroute::gateway::discovery::RecordKind::Srv,
            port: 0,
            scheme: "http".into(),
            nameserver: Some(dns.addr.to_string()),
            interval_secs: 0.1,
            timeout_secs: 1.0,
        });
        async move {
            let gw = Gateway::start(cfg).await.unwrap();
            common::ready(&gw).await;
            gw
        }
    };
    let (a, b) = (start("a").await, start("b").await);
    // The headless Service's records: one SRV per pod (this replica included) on its admin port.
    let mut records = Vec::new();
    for (host, g) in [("a.peers.test.", &a), ("b.peers.test.", &b)] {
        records.push(Record::from_rdata(
            name(service),
            1,
            RData::SRV(SRV::new(0, 0, g.admin_addr.port(), name(host))),
        ));
        records.push(Record::from_rdata(
            name(host),
            1,
            RData::A(A(std::net::Ipv4Addr::LOCALHOST)),
        ));
    }
    dns.set(records);
    for g in [&a, &b] {
        common::wait_until(common::WAIT, "both replicas linked from DNS", || async {
            g.state.peers.outbox.urls().len() == 2
        })
        .await;
    }
    let tasks: Vec<_> = (0..2)
        .map(|k| send(b.addr.to_string(), prompt(800 + k, 200), 64))
        .collect();
    common::wait_until(common::WAIT, "a counting b's requests", || async {
        running(&a) == 2 && a.state.peers.remote_bookings() == 2
    })
    .await;
    // Each replica posts to itself too (its own record): those messages are dropped as its own.
    let text = common::admin_metrics(&b).await;
    assert!(common::metric(&text, "kvroute_peer_dropped_total{reason=\"own\"}") >= 2.0);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    for g in [a, b] {
        g.shutdown().await;
    }
}

/// What a replica has learned, as far as two replicas fed the same observations in the same
/// order must agree on it exactly: follow-ups (requests, follow-ups), the fleet's mean answer
/// length and TTFT fit, and each worker's TTFT fit.
fn learned(g: &GatewayHandle) -> String {
    let r = &g.state.registry;
    let own: Vec<String> = r
        .all()
        .iter()
        .map(|w| format!("{:?}", w.learners.lock().ttft.fit()))
        .collect();
    format!(
        "{:?} {:?} {:?} {own:?}",
        r.follow_ups.counts(),
        r.output_tokens.mean(),
        r.fleet_ttft.fit()
    )
}

/// The parts of `/admin/explain`'s decision on `tokens` that depend on no clock: the worker
/// chosen, the follow-ups expected, and each candidate's predicted hit and TTFT.
async fn explained(g: &GatewayHandle, tokens: &[u32]) -> Value {
    let v = common::explain(&g.admin_addr.to_string(), PRESET, tokens).await;
    let d = &v["decision"];
    let cands: Vec<Value> = d["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| json!([c["worker"], c["predicted_cached"], c["predicted_ttft_ms"]]))
        .collect();
    json!({"worker": d["worker"], "follow_ups": d["follow_ups"], "candidates": cands})
}

/// Four conversations of three turns each, each turn extending the one before, sent one at a
/// time to replica i mod 3 (so each turn reaches another replica than the turns before it);
/// returns each replica's (requests, follow-ups) counted once the channel is quiet, and checks
/// (with `learning`) that every replica explains each request alike and has learned alike.
async fn conversations_over(replicas: &[&GatewayHandle; 3], learning: bool) -> Vec<(u64, u64)> {
    let mut sent = 0;
    for turn in 0..3usize {
        for conv in 0..4u32 {
            let tokens = prompt(900 + conv, 120 + 40 * turn);
            if learning {
                let first = explained(replicas[0], &tokens).await;
                for g in &replicas[1..] {
                    assert_eq!(explained(g, &tokens).await, first, "turn {turn} of {conv}");
                }
            }
            let front = replicas[sent % 3].addr.to_string();
            assert_eq!(send(front, tokens, 8).await.unwrap(), 200);
            sent += 1;
            let settled = || async {
                let quiet = replicas.iter().all(|g| {
                    g.state.peers.remote_bookings() == 0 && g.state.peers.outbox.open() == 0
                });
                let views: Vec<String> = replicas.iter().map(|g| learned(g)).collect();
                let counted = replicas
                    .iter()
                    .all(|g| g.state.registry.follow_ups.counts().0 == sent as u64);
                quiet && (!learning || (counted && views.iter().all(|v| *v == views[0])))
            };
            common::wait_until(common::WAIT, "the replicas settled", settled).await;
        }
    }
    replicas
        .iter()
        .map(|g| g.state.registry.follow_ups.counts())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_what_they_learn_decide_a_request_alike_whichever_it_reaches() {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 0.05;
    let f = Fleet::start(FleetOptions::new(cfg, 2)).await.unwrap();
    let (a, b, c) = (
        replica(&f, "a").await,
        replica(&f, "b").await,
        replica(&f, "c").await,
    );
    join_sharing(&[&a, &b, &c], true);
    let counts = conversations_over(&[&a, &b, &c], true).await;
    assert_eq!(
        counts,
        vec![(12, 8); 3],
        "every replica counts every turn after the first"
    );
    // Sharing only bookings, a replica recognises a follow-up only where it saw an earlier
    // turn, and here none did: what the check above asks is not met by a replica's own share.
    let (d, e, g) = (
        replica(&f, "d").await,
        replica(&f, "e").await,
        replica(&f, "g").await,
    );
    join_sharing(&[&d, &e, &g], false);
    let alone = conversations_over(&[&d, &e, &g], false).await;
    assert_eq!(alone, vec![(4, 0); 3]);
    for gw in [a, b, c, d, e, g] {
        gw.shutdown().await;
    }
}
