//! Workers that come and go, over real sockets: a DNS server on loopback (`common::dns`,
//! answering from records the test changes) names simulated workers by A or SRV
//! records; a directory of worker files does the same. Added workers serve; removed ones drain
//! (their in-flight requests finish) and then lose their index state; DNS failures and
//! malformed files cost nothing that was there.

use crate::common;

use crate::common::dns::Dns;
use hickory_resolver::proto::rr::rdata::{A, SRV};
use hickory_resolver::proto::rr::{Name, RData, Record};
use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::discovery::DiscoveryConfig;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{start_worker, Fleet, PublisherConfig, SimHandle, WireFormat, WorkerConfig};
use serde_json::{json, Value};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";
const NAME: &str = "vllm.disc.test.";

/// Waits until the index holds no rank of `worker` (the registry lists a removed worker no
/// more before its subscriptions have stopped and its index state is dropped).
async fn wait_unindexed(gw: &GatewayHandle, worker: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while indexed(gw, worker) {
        assert!(Instant::now() < deadline, "{worker}'s index state stays");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether the index holds any rank of `worker`.
fn indexed(gw: &GatewayHandle, worker: &str) -> bool {
    gw.state
        .registry
        .index
        .ranks()
        .iter()
        .any(|(w, _)| &**w == worker)
}

fn name(n: &str) -> Name {
    Name::from_ascii(n).unwrap()
}

fn a(host: &str, ip: Ipv4Addr) -> Record {
    Record::from_rdata(name(host), 1, RData::A(A(ip)))
}

fn srv(port: u16, target: &str) -> Record {
    Record::from_rdata(
        name(NAME),
        1,
        RData::SRV(SRV::new(0, 0, port, name(target))),
    )
}

fn discovery(toml: &str) -> DiscoveryConfig {
    toml::from_str(toml).unwrap()
}

async fn gateway(discovery: DiscoveryConfig) -> GatewayHandle {
    let cfg = GatewayConfig {
        discovery: Some(discovery),
        worker_drain_timeout_secs: 10.0,
        ..common::gateway_config(Vec::new())
    };
    Gateway::start(cfg).await.unwrap()
}

/// Waits until the gateway's workers are exactly `names` (sorted); returns the admin view.
async fn wait_for_workers(gw: &GatewayHandle, names: &[&str]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = common::admin_workers(gw).await;
        let have = common::worker_names(&v);
        if have == names {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "workers {have:?}, expected {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn worker<'a>(view: &'a Value, name: &str) -> &'a Value {
    view["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == name)
        .unwrap()
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 7) % 1000 + 3)
        .collect()
}

async fn complete(gw: &GatewayHandle, seed: u32) -> String {
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": prompt(seed, 64), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let d: Value = serde_json::from_str(
        r.headers()
            .get("x-kvroute-decision")
            .unwrap()
            .to_str()
            .unwrap(),
    )
    .unwrap();
    d["worker"].as_str().unwrap().to_string()
}

/// A simulated worker at `ip` on `http` (0: any) publishing on `events` (0: any), in real
/// time.
async fn worker_at(name: &str, ip: &str, http: u16, events: u16) -> SimHandle {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1.0;
    cfg.zmq = Some(PublisherConfig {
        endpoint: format!("tcp://{ip}:{events}"),
        replay_endpoint: None,
        topic: String::new(),
        buffer_steps: 10_000,
        format: WireFormat::V032,
        replay_layout: Default::default(),
        dp_rank: 0,
        hwm: kvroute_sim::publisher::DEFAULT_HWM,
    });
    let addr: SocketAddr = format!("{ip}:{http}").parse().unwrap();
    start_worker(name, cfg, addr).await.unwrap()
}

/// Two simulated workers on 127.0.0.2 and 127.0.0.3 with the same HTTP and event ports (as
/// two pods behind one headless Service).
async fn two_pods() -> (SimHandle, SimHandle) {
    for _ in 0..20 {
        let first = worker_at("pod-a", "127.0.0.2", 0, 0).await;
        let events = first.zmq[0].rsplit(':').next().unwrap().parse().unwrap();
        let http = first.http.port();
        // The same ports on the other address are almost always free; try again if not.
        let second = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::spawn(async move { worker_at("pod-b", "127.0.0.3", http, events).await }),
        )
        .await;
        if let Ok(Ok(second)) = second {
            return (first, second);
        }
    }
    panic!("no common free ports on 127.0.0.2 and 127.0.0.3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_records_become_workers_that_serve_and_a_removed_record_drains_then_drops_its_index_state(
) {
    let dns = Dns::start("disc.test.").await;
    let (pod_a, pod_b) = two_pods().await;
    let (http, events) = (pod_a.http.port(), pod_a.zmq[0].rsplit(':').next().unwrap());
    dns.set(vec![a(NAME, Ipv4Addr::new(127, 0, 0, 2))]);
    let gw = gateway(discovery(&format!(
        "kind = 'dns'\nname = '{NAME}'\nport = {http}\nnameserver = '{}'\ninterval_secs = 0.05\n\
         [template]\nmodel = '{PRESET}'\n[template.kv_events]\nendpoint = 'tcp://*:{events}'\n",
        dns.addr
    )))
    .await;
    let (name_a, name_b) = (
        format!("vllm-127.0.0.2-{http}"),
        format!("vllm-127.0.0.3-{http}"),
    );
    let v = wait_for_workers(&gw, &[&name_a]).await;
    assert_eq!(worker(&v, &name_a)["source"], "dns");
    assert_eq!(complete(&gw, 1).await, name_a);

    // A second record: a second worker, subscribed and serving.
    dns.set(vec![
        a(NAME, Ipv4Addr::new(127, 0, 0, 2)),
        a(NAME, Ipv4Addr::new(127, 0, 0, 3)),
    ]);
    wait_for_workers(&gw, &[&name_a, &name_b]).await;
    *gw.state.policy.write() = kvroute_route::PolicyKind::RoundRobin;
    let mut served = std::collections::BTreeSet::new();
    for seed in 2..6 {
        served.insert(complete(&gw, seed).await);
    }
    assert_eq!(served.len(), 2, "both workers serve: {served:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !(indexed(&gw, &name_a) && indexed(&gw, &name_b)) {
        assert!(Instant::now() < deadline, "both workers have index state");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A long answer streams from one of them while its record goes away.
    let mut stream = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": prompt(9, 64), "max_tokens": 400, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let d: Value =
        serde_json::from_str(stream.headers()["x-kvroute-decision"].to_str().unwrap()).unwrap();
    let busy = d["worker"].as_str().unwrap().to_string();
    let (kept, kept_ip) = if busy == name_a {
        (&name_b, Ipv4Addr::new(127, 0, 0, 3))
    } else {
        (&name_a, Ipv4Addr::new(127, 0, 0, 2))
    };
    assert!(stream.chunk().await.unwrap().is_some());
    dns.set(vec![a(NAME, kept_ip)]);
    // Draining: still listed, no new requests, the stream goes on.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let v = common::admin_workers(&gw).await;
        if worker(&v, &busy)["draining"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "{busy} never drained");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for seed in 10..13 {
        assert_eq!(
            &complete(&gw, seed).await,
            kept,
            "no new requests while draining"
        );
    }
    let mut body = Vec::new();
    while let Some(c) = stream.chunk().await.unwrap() {
        body.extend_from_slice(&c);
    }
    let body = String::from_utf8(body).unwrap();
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "the stream finished: {body}"
    );
    // Then removed, with its index state.
    wait_for_workers(&gw, &[kept]).await;
    wait_unindexed(&gw, &busy).await;
    assert!(indexed(&gw, kept));
    let text = common::admin_metrics(&gw).await;
    assert_eq!(common::metric(&text, "kvroute_discovered_workers "), 1.0);
    assert!(
        common::metric(
            &text,
            "kvroute_discovery_resolutions_total{kind=\"dns\",result=\"ok\"}"
        ) > 0.0
    );
    assert_eq!(
        common::metric(&text, "kvroute_fleet_changes_total{change=\"removed\"}"),
        1.0
    );
    drop((pod_a, pod_b));
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srv_records_name_workers_by_target_and_port_and_dns_failures_keep_the_fleet() {
    let dns = Dns::start("disc.test.").await;
    let fleet = Fleet::preset(PRESET, 2, 1000.0).await.unwrap();
    let ports: Vec<u16> = fleet.workers.iter().map(|w| w.http.port()).collect();
    let host = "engines.disc.test.";
    dns.set(vec![
        srv(ports[0], host),
        srv(ports[1], host),
        a(host, Ipv4Addr::LOCALHOST),
    ]);
    let gw = gateway(discovery(&format!(
        "kind = 'dns'\nname = '{NAME}'\nrecord = 'srv'\nname_prefix = 'gpu'\n\
         nameserver = '{}'\ninterval_secs = 0.05\ntimeout_secs = 0.5\n[template]\nmodel = '{PRESET}'\n",
        dns.addr
    )))
    .await;
    let names: Vec<String> = ports.iter().map(|p| format!("gpu-127.0.0.1-{p}")).collect();
    let mut sorted: Vec<&str> = names.iter().map(String::as_str).collect();
    sorted.sort();
    wait_for_workers(&gw, &sorted).await;
    complete(&gw, 1).await;

    // The server fails, then answers with no records: the fleet stays, each result counted.
    dns.fail.store(true, Ordering::Relaxed);
    let errors = "kvroute_discovery_resolutions_total{kind=\"dns\",result=\"error\"}";
    let empty = "kvroute_discovery_resolutions_total{kind=\"dns\",result=\"empty\"}";
    let counted = |name: &'static str| {
        let gw = &gw;
        move || async move {
            let text = common::admin_metrics(gw).await;
            common::metric_if_present(&text, name).is_some_and(|n| n >= 2.0)
        }
    };
    common::wait_until(
        common::WAIT,
        "two failed resolutions counted",
        counted(errors),
    )
    .await;
    dns.fail.store(false, Ordering::Relaxed);
    dns.set(Vec::new());
    common::wait_until(common::WAIT, "two empty answers counted", counted(empty)).await;
    wait_for_workers(&gw, &sorted).await;
    complete(&gw, 2).await;

    // One SRV record goes: that worker goes (it is idle: at once).
    dns.set(vec![srv(ports[1], host), a(host, Ipv4Addr::LOCALHOST)]);
    wait_for_workers(&gw, &[&names[1]]).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_files_in_a_directory_come_and_go_and_a_malformed_file_costs_only_itself() {
    let fleet = Fleet::preset(PRESET, 2, 1000.0).await.unwrap();
    let dir = std::env::temp_dir().join(format!("kvroute-workers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let spec = |name: &str, h: &SimHandle| {
        let port = h.zmq[0].rsplit(':').next().unwrap();
        format!(
            "name = '{name}'\nurl = '{}'\nmodel = '{PRESET}'\n[kv_events]\nendpoint = 'tcp://*:{port}'\n",
            h.base_url
        )
    };
    std::fs::write(dir.join("a.toml"), spec("file-a", &fleet.workers[0])).unwrap();
    std::fs::write(dir.join("notes.txt"), "not a worker").unwrap();
    let gw = gateway(discovery(&format!(
        "kind = 'dir'\npath = '{}'\ninterval_secs = 0.05\n",
        dir.display()
    )))
    .await;
    let v = wait_for_workers(&gw, &["file-a"]).await;
    assert_eq!(worker(&v, "file-a")["source"], "dir");
    std::fs::write(dir.join("b.toml"), spec("file-b", &fleet.workers[1])).unwrap();
    wait_for_workers(&gw, &["file-a", "file-b"]).await;

    // b.toml broken, c.toml malformed from the start: b's worker stays, c gives none.
    std::fs::write(
        dir.join("b.toml"),
        "name = 'file-b'\nurl = 'nope'\nmodel = 'm'\n",
    )
    .unwrap();
    std::fs::write(dir.join("c.toml"), "[[workers]\nname = ").unwrap();
    let scans = "kvroute_discovery_resolutions_total{kind=\"dir\",result=\"ok\"}";
    let before = common::metric(&common::admin_metrics(&gw).await, scans);
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::metric(&common::admin_metrics(&gw).await, scans) < before + 3.0 {
        assert!(Instant::now() < deadline, "no scans");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for_workers(&gw, &["file-a", "file-b"]).await;
    let b = gw.state.registry.get("file-b").unwrap();
    assert_eq!(
        b.spec.url, fleet.workers[1].base_url,
        "the last good spec is kept"
    );

    // a.toml removed: its worker drains (idle) and goes with its index state.
    std::fs::remove_file(dir.join("a.toml")).unwrap();
    wait_for_workers(&gw, &["file-b"]).await;
    wait_unindexed(&gw, "file-a").await;
    // b.toml fixed with another spec: the worker is replaced.
    std::fs::write(
        dir.join("b.toml"),
        format!(
            "name = 'file-b'\nurl = '{}'\nmodel = '{PRESET}'\n",
            fleet.workers[0].base_url
        ),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while gw
        .state
        .registry
        .get("file-b")
        .is_none_or(|w| w.spec.url != fleet.workers[0].base_url)
    {
        assert!(Instant::now() < deadline, "file-b never replaced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    complete(&gw, 3).await;
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
