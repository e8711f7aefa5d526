//! A live fault matrix: a gateway subscribed to simulated engines over real ZMQ, with faults
//! injected through the engines' own hooks (a publisher dropping batches at its high-water
//! mark, delayed batches, an engine restarting empty, a replay endpoint that is not there),
//! one at a time and several at once. After each, the gateway's index must equal the engine's
//! true cache (group → hash → copies, from the engine itself) — or, while a loss cannot be
//! repaired, hold nothing the engine lacks and say the rank is degraded — and predictions must
//! be exact again: for probes, the gateway's prediction equals the cached tokens the engine
//! then reports. `wire` adds the stream's own faults (duplicated, reordered and garbage
//! batches, a replay endpoint answering garbage, a clock jump, the connection cut); `process`
//! kills an engine's process and starts it again on the same ports.

#[path = "../common/mod.rs"]
mod common;
mod process;
mod wire;

use kvroute::gateway::config::WorkerSpec;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, SimHandle, WorkerConfig};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub(crate) const PRESET: &str = "tiny-qwen3-next";

pub(crate) type Contents = BTreeMap<u32, BTreeMap<u64, u32>>;

pub(crate) async fn fleet(n: usize) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    cfg.engine.num_blocks = 96;
    Fleet::start(FleetOptions::new(cfg, n)).await.unwrap()
}

pub(crate) async fn gateway(specs: Vec<WorkerSpec>) -> GatewayHandle {
    let gw = Gateway::start(common::gateway_config(specs)).await.unwrap();
    common::ready(&gw).await;
    gw
}

/// The engine's own cache of rank 0: group → hash → copies.
pub(crate) fn engine_contents(h: &SimHandle) -> Contents {
    contents_of(&h.worker.cache_state())
}

/// Rank 0's blocks in a simulated engine's cache state (`GET /admin/cache`).
pub(crate) fn contents_of(v: &serde_json::Value) -> Contents {
    let mut out = Contents::new();
    if let Some(groups) = v["ranks"][0]["groups"].as_object() {
        for (g, hashes) in groups {
            let m: BTreeMap<u64, u32> = hashes
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, n)| (k.parse().unwrap(), n.as_u64().unwrap() as u32))
                .collect();
            if !m.is_empty() {
                out.insert(g.parse().unwrap(), m);
            }
        }
    }
    out
}

pub(crate) fn index_contents(gw: &GatewayHandle, worker: &str) -> Contents {
    gw.state
        .registry
        .index
        .contents()
        .remove(&(worker.into(), 0))
        .unwrap_or_default()
}

/// Waits (bounded) until the index holds exactly what every engine holds.
pub(crate) async fn converged(gw: &GatewayHandle, f: &Fleet) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all = f
            .workers
            .iter()
            .all(|h| index_contents(gw, &h.name) == engine_contents(h));
        if all {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn prompt(k: u32) -> Vec<u32> {
    let p = k % 5;
    let mut v: Vec<u32> = (0..96).map(|i| (p * 211 + i * 17) % 900 + 5).collect();
    v.extend((0..(8 + 24 * (k % 4))).map(|i| (k * 13 + i * 7) % 900 + 5));
    v
}

/// Requests `from..to` straight to the engines, in turn.
pub(crate) async fn traffic(f: &Fleet, from: u32, to: u32) {
    let client = reqwest::Client::new();
    for k in from..to {
        let h = &f.workers[k as usize % f.workers.len()];
        let r = client
            .post(format!("{}/v1/completions", h.base_url))
            .json(&json!({"model": PRESET, "prompt": prompt(k), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
}

/// The first engine restarts empty and takes traffic `from..to`: its stream from seq 0
/// rebuilds the degraded rank, no rank stays degraded, and predictions are exact again.
pub(crate) async fn restart_and_assert_rebuilt(gw: &GatewayHandle, f: &Fleet, from: u32, to: u32) {
    f.workers[0].worker.restart(true).unwrap();
    traffic(f, from, to).await;
    assert!(converged(gw, f).await);
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::degraded_ranks(gw) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::degraded_ranks(gw), 0, "rebuilt");
    assert_exact(gw, f).await;
}

/// For a few probes on each engine: the gateway's prediction, then the engine's answer.
pub(crate) async fn assert_exact(gw: &GatewayHandle, f: &Fleet) {
    let mut hits = 0;
    for h in &f.workers {
        for k in [1u32, 7, 12] {
            let p = prompt(k);
            let predicted = common::predictions(&gw.admin_addr.to_string(), PRESET, &p)
                .await
                .into_iter()
                .find(|(w, _)| *w == h.name)
                .map_or(0, |(_, c)| c);
            let reported = common::engine_cached(&h.base_url, PRESET, &p).await;
            assert_eq!(predicted, reported, "{} probe {k}", h.name);
            hits += usize::from(reported > 0);
            // The probe's own blocks reach the index before the next prediction.
            assert!(converged(gw, f).await);
        }
        assert!(!engine_contents(h).is_empty(), "{} holds blocks", h.name);
    }
    assert!(hits > 0, "some probes hit the cache");
}

/// Never more than the engine holds: the rank was cleared before the loss.
pub(crate) fn assert_holds_nothing_extra(gw: &GatewayHandle, h: &SimHandle) {
    let engine = engine_contents(h);
    for (g, blocks) in index_contents(gw, &h.name) {
        for (hash, n) in blocks {
            let held = engine
                .get(&g)
                .and_then(|m| m.get(&hash))
                .copied()
                .unwrap_or(0);
            assert!(
                n <= held,
                "group {g} block {hash}: index {n}, engine {held}"
            );
        }
    }
}

pub(crate) fn specs(f: &Fleet, replay: bool) -> Vec<WorkerSpec> {
    f.workers
        .iter()
        .map(|h| common::sim_spec(h, PRESET, replay))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_dropped_at_the_high_water_mark_are_replayed_and_the_index_equals_the_engine() {
    let f = fleet(1).await;
    let gw = gateway(specs(&f, true)).await;
    traffic(&f, 0, 6).await;
    f.workers[0].worker.set_faults(Some(4), None);
    traffic(&f, 6, 12).await;
    assert!(converged(&gw, &f).await, "the replay filled the gap");
    assert_eq!(common::degraded_ranks(&gw), 0);
    let wire = gw.state.registry.wire_stats.snapshot();
    assert!(wire.gaps >= 1, "the drop was seen as a gap");
    assert_exact(&gw, &f).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_empty_is_cleared_and_rebuilt_from_its_new_stream() {
    let f = fleet(1).await;
    let gw = gateway(specs(&f, true)).await;
    traffic(&f, 0, 8).await;
    assert!(converged(&gw, &f).await);
    f.workers[0].worker.restart(true).unwrap();
    traffic(&f, 8, 14).await;
    assert!(
        converged(&gw, &f).await,
        "the new instance's stream rebuilt the rank"
    );
    assert_eq!(common::degraded_ranks(&gw), 0);
    assert!(gw.state.registry.wire_stats.snapshot().restarts >= 1);
    assert_exact(&gw, &f).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_endpoint_a_loss_degrades_the_rank_with_nothing_extra_until_a_restart() {
    let f = fleet(1).await;
    let gw = gateway(specs(&f, false)).await;
    traffic(&f, 0, 6).await;
    assert!(converged(&gw, &f).await);
    f.workers[0].worker.set_faults(Some(3), None);
    traffic(&f, 6, 12).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while common::degraded_ranks(&gw) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        common::degraded_ranks(&gw),
        1,
        "the unfilled gap is reported"
    );
    assert_holds_nothing_extra(&gw, &f.workers[0]);
    // The engine restarts empty: its stream from seq 0 rebuilds the rank.
    restart_and_assert_rebuilt(&gw, &f, 12, 16).await;
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_faults_at_once_on_two_engines_leave_the_index_equal_to_both() {
    let f = fleet(2).await;
    let gw = gateway(specs(&f, true)).await;
    traffic(&f, 0, 8).await;
    // w0 drops, delays and repeats batches with its clock an hour ahead; w1 restarts empty in
    // the middle of the traffic, then drops and reorders batches.
    f.workers[0]
        .worker
        .set_wire_faults(&kvroute_sim::WireFaults {
            drop_batches: Some(3),
            delay_ms: Some(20),
            duplicate_batches: Some(2),
            clock_offset_ms: Some(3_600_000),
            ..Default::default()
        });
    traffic(&f, 8, 12).await;
    f.workers[1].worker.restart(true).unwrap();
    f.workers[1]
        .worker
        .set_wire_faults(&kvroute_sim::WireFaults {
            drop_batches: Some(2),
            reorder_batches: Some(2),
            ..Default::default()
        });
    traffic(&f, 12, 20).await;
    f.workers[0].worker.set_faults(None, Some(0));
    traffic(&f, 20, 22).await;
    assert!(converged(&gw, &f).await, "both ranks equal their engines");
    assert_eq!(common::degraded_ranks(&gw), 0);
    assert_exact(&gw, &f).await;
    // The front kept serving throughout.
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&json!({"model": PRESET, "prompt": prompt(3), "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.shutdown().await;
}
