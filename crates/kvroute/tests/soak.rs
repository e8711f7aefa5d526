//! A soak: the `kvroute serve` binary in front of a simulated hybrid fleet whose pools are small
//! enough to evict all the time, under sustained open-loop load, sampled every 2 s for RSS,
//! open file descriptors, threads, runtime tasks and the window's p99 latency. Pass: no failed
//! request; RSS after the warm-up grows by at most `RSS_BOUND_MIB` (the bounded caches filling:
//! the digest cache, the follow-up tracker); no descriptor or task growth once the load stops;
//! every request sent answered or failed with a counted reason; and predictions exact again at
//! the end (the gateway's prediction for a probe equals the cached tokens the engine then
//! reports, each probe once the index applied every batch the engines queued).
//!
//! `KVROUTE_SOAK_SECS` sets the load's duration (default 60, the normal test command's short
//! version; docs/reliability.md has the long one); `KVROUTE_SOAK_OUT` a directory for the
//! samples (`soak.csv`) and their plot (`soak.svg`).

mod common;

use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";
const RATE: f64 = 30.0;
const RSS_BOUND_MIB: f64 = 32.0;

#[derive(Clone, Debug)]
struct Sample {
    t: f64,
    rss_mib: f64,
    fds: usize,
    threads: usize,
    tasks: f64,
    p99_ms: f64,
    done: usize,
}

fn proc_status(pid: u32, key: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0.0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

async fn gauge(admin: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing or unreadable on {admin}/metrics"))
}

fn p99(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}

/// Request `k`: one of 12 shared prefixes and a tail of its own (a conversation's next turn
/// extends the previous one's tail).
fn prompt(k: u64) -> Vec<u32> {
    let p = (k % 12) as u32;
    let mut v: Vec<u32> = (0..64).map(|i| (p * 97 + i * 13) % 900 + 5).collect();
    let turn = (k / 12) % 6;
    v.extend((0..(24 + 16 * turn) as u32).map(|i| (p * 31 + i * 7) % 900 + 5));
    v
}

fn svg(samples: &[Sample]) -> String {
    let (w, h, pad) = (900.0, 360.0, 60.0);
    let tmax = samples.last().map_or(1.0, |s| s.t).max(1.0);
    let panel = |x0: f64, title: &str, unit: &str, vals: Vec<(f64, f64)>| {
        let pw = w / 2.0 - pad * 1.5;
        let ph = h - pad * 2.0;
        let vmax = vals.iter().map(|v| v.1).fold(0.0f64, f64::max).max(1e-9) * 1.1;
        let pts: Vec<String> = vals
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1}", x0 + t / tmax * pw, pad + ph - v / vmax * ph))
            .collect();
        let mut g = format!(
            "<text x='{:.0}' y='30' font-size='15' text-anchor='middle'>{title}</text>\
             <line x1='{x0}' y1='{:.0}' x2='{:.0}' y2='{:.0}' stroke='black'/>\
             <line x1='{x0}' y1='{pad}' x2='{x0}' y2='{:.0}' stroke='black'/>\
             <polyline fill='none' stroke='#1f77b4' stroke-width='2' points='{}'/>\
             <text x='{:.0}' y='{:.0}' font-size='12' text-anchor='middle'>time (s)</text>\
             <text x='{:.0}' y='{:.0}' font-size='12' text-anchor='middle' transform='rotate(-90 {:.0} {:.0})'>{unit}</text>",
            x0 + pw / 2.0,
            pad + ph,
            x0 + pw,
            pad + ph,
            pad + ph,
            pts.join(" "),
            x0 + pw / 2.0,
            h - 15.0,
            x0 - 42.0,
            pad + ph / 2.0,
            x0 - 42.0,
            pad + ph / 2.0,
        );
        for i in 0..=4 {
            let f = i as f64 / 4.0;
            g += &format!(
                "<text x='{:.0}' y='{:.0}' font-size='11' text-anchor='end'>{:.0}</text>\
                 <text x='{:.0}' y='{:.0}' font-size='11' text-anchor='middle'>{:.0}</text>",
                x0 - 6.0,
                pad + ph - f * ph + 4.0,
                f * vmax,
                x0 + f * pw,
                pad + ph + 16.0,
                f * tmax
            );
        }
        g
    };
    let rss = samples.iter().map(|s| (s.t, s.rss_mib)).collect();
    let lat = samples.iter().map(|s| (s.t, s.p99_ms)).collect();
    format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='DejaVu Sans, Arial, sans-serif'>\
         <rect width='100%' height='100%' fill='white'/>{}{}</svg>",
        panel(pad * 1.2, "gateway RSS", "RSS (MiB)", rss),
        panel(w / 2.0 + pad * 0.8, "request latency p99 per 2 s window", "p99 (ms)", lat),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sustained_load_with_eviction_keeps_memory_descriptors_and_tasks_flat_and_predictions_exact(
) {
    let secs: f64 = std::env::var("KVROUTE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 200.0;
    cfg.engine.num_blocks = 64;
    let f = Fleet::start(FleetOptions::new(cfg, 2)).await.unwrap();
    let mut args = vec![
        "serve".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--admin-listen".into(),
        "127.0.0.1:0".into(),
    ];
    for h in &f.workers {
        let port = h.zmq[0].rsplit(':').next().unwrap();
        let rport = h.replay[0].rsplit(':').next().unwrap();
        args.push("--worker".into());
        args.push(format!(
            "name={},url={},model={PRESET},events=tcp://*:{port},replay=tcp://*:{rport},host=127.0.0.1",
            h.name, h.base_url
        ));
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kvroute listening on http://") {
                let front = rest.split_whitespace().next().unwrap_or("").to_string();
                let admin = rest.split("admin http://").nth(1).unwrap_or("");
                let _ = tx.send((front, admin.trim_end_matches(')').to_string()));
            }
        }
    });
    let (front, admin) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
    common::ready_at(&front).await;
    let tasks_idle = gauge(&admin, "kvroute_runtime_tasks").await;
    let fds_idle = fds(pid);

    let latencies: Arc<Mutex<Vec<(f64, f64)>>> = Arc::default();
    let failures: Arc<Mutex<Vec<String>>> = Arc::default();
    let client = reqwest::Client::new();
    let start = Instant::now();
    let sender = {
        let (latencies, failures, client, front) = (
            latencies.clone(),
            failures.clone(),
            client.clone(),
            front.clone(),
        );
        tokio::spawn(async move {
            let mut k = 0u64;
            while start.elapsed().as_secs_f64() < secs {
                let due = start + Duration::from_secs_f64(k as f64 / RATE);
                tokio::time::sleep_until(due.into()).await;
                let (latencies, failures, client, front) = (
                    latencies.clone(),
                    failures.clone(),
                    client.clone(),
                    front.clone(),
                );
                tokio::spawn(async move {
                    let sent = Instant::now();
                    let stream = k.is_multiple_of(3);
                    let r = client
                        .post(format!("http://{front}/v1/completions"))
                        .json(&json!({"model": PRESET, "prompt": prompt(k), "max_tokens": 4, "stream": stream}))
                        .timeout(Duration::from_secs(30))
                        .send()
                        .await;
                    let ok = match r {
                        Ok(r) if r.status() == 200 => r.bytes().await.is_ok(),
                        Ok(r) => {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("status {}", r.status()));
                            return;
                        }
                        Err(e) => {
                            failures.lock().unwrap().push(e.to_string());
                            return;
                        }
                    };
                    if ok {
                        let done = start.elapsed().as_secs_f64();
                        let ms = sent.elapsed().as_secs_f64() * 1e3;
                        latencies.lock().unwrap().push((done, ms));
                    } else {
                        failures.lock().unwrap().push("body".into());
                    }
                });
                k += 1;
            }
            k
        })
    };
    let mut samples: Vec<Sample> = Vec::new();
    let mut seen = 0usize;
    while !sender.is_finished() {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let t = start.elapsed().as_secs_f64();
        let window: Vec<f64> = {
            let l = latencies.lock().unwrap();
            let w = l[seen..].iter().map(|x| x.1).collect();
            seen = l.len();
            w
        };
        samples.push(Sample {
            t,
            rss_mib: proc_status(pid, "VmRSS:") / 1024.0,
            fds: fds(pid),
            threads: proc_status(pid, "Threads:") as usize,
            tasks: gauge(&admin, "kvroute_runtime_tasks").await,
            p99_ms: p99(window),
            done: seen,
        });
    }
    let sent = sender.await.unwrap();
    // Every request sent is answered or failed with a counted reason (each has a 30 s client
    // timeout, so none can stay unaccounted for), then the index takes in the last events.
    common::wait_until(
        Duration::from_secs(60),
        "every request answered or failed",
        || async {
            latencies.lock().unwrap().len() + failures.lock().unwrap().len() == sent as usize
        },
    )
    .await;
    common::settle_at(&admin, &[]).await;
    let tasks_end = gauge(&admin, "kvroute_runtime_tasks").await;
    let evicted = gauge(&admin, "kvroute_index_events{counter=\"blocks_removed\"}").await;
    let fds_end = fds(pid);
    let failed = failures.lock().unwrap().clone();
    let done = latencies.lock().unwrap().len();

    // Exact again at rest: the gateway's prediction for w0, then w0's own answer.
    let mut exact = 0;
    for k in 0..12u64 {
        let p = prompt(k * 12 + 3);
        let predicted = common::predictions(&admin, PRESET, &p)
            .await
            .into_iter()
            .find(|(w, _)| w == "w0")
            .map_or(0, |(_, c)| c);
        let reported = common::engine_cached(&f.workers[0].base_url, PRESET, &p).await;
        assert_eq!(
            predicted, reported,
            "probe {k}: predicted vs engine-reported"
        );
        exact += 1;
        // The probe's own request changed w0's cache; the next prediction waits for its events.
        common::settle_at(&admin, &[]).await;
    }
    let _ = child.kill();
    let _ = child.wait();

    if let Ok(dir) = std::env::var("KVROUTE_SOAK_OUT") {
        std::fs::create_dir_all(&dir).unwrap();
        let mut csv = String::from("t_s,rss_mib,fds,threads,tasks,p99_ms,requests_done\n");
        for s in &samples {
            csv += &format!(
                "{:.1},{:.1},{},{},{},{:.1},{}\n",
                s.t, s.rss_mib, s.fds, s.threads, s.tasks, s.p99_ms, s.done
            );
        }
        std::fs::write(format!("{dir}/soak.csv"), csv).unwrap();
        std::fs::write(format!("{dir}/soak.svg"), svg(&samples)).unwrap();
    }
    let warm = samples
        .iter()
        .find(|s| s.t >= (secs * 0.2).max(10.0).min(secs * 0.5))
        .or(samples.first())
        .cloned()
        .unwrap();
    let last = samples.last().cloned().unwrap();
    let peak = samples.iter().map(|s| s.rss_mib).fold(0.0, f64::max);
    eprintln!(
        "soak: {secs:.0} s, {sent} sent, {done} done, {} failed; RSS {:.1} MiB after warm-up \
         (t = {:.0} s), {:.1} at the end, peak {peak:.1}; fds {fds_idle} idle, {fds_end} at the \
         end; tasks {tasks_idle} idle, {tasks_end} at the end; threads {}; p99 {:.1} ms in the \
         last window; {evicted} blocks evicted; {exact} probes exact",
        failed.len(),
        warm.rss_mib,
        warm.t,
        last.rss_mib,
        last.threads,
        last.p99_ms
    );
    assert!(evicted > 0.0, "the pools evicted");
    assert_eq!(
        done + failed.len(),
        sent as usize,
        "every request sent is accounted for"
    );
    assert!(
        failed.is_empty(),
        "failed requests: {:?}",
        &failed[..failed.len().min(5)]
    );
    assert!(
        peak - warm.rss_mib <= RSS_BOUND_MIB,
        "RSS grew {:.1} MiB after the warm-up",
        peak - warm.rss_mib
    );
    assert!(
        fds_end <= fds_idle + 8,
        "descriptors {fds_idle} → {fds_end}"
    );
    assert!(
        tasks_end <= tasks_idle + 8.0,
        "tasks {tasks_idle} → {tasks_end}"
    );
}
