//! The analysis scripts under `bench/` whose figures `docs/routing.md` and
//! `docs/routing-analyses.md` quote (`matrix.py`, `paired.py`, `means.py`, `crossing.py`,
//! `floor.py`, `prederr.py`, `tails.py`, `followers.py`, `decisions.py`, `terms.py`), each run with python3
//! over a few files written into a scratch directory the way `bench/peers.sh`, `kvroute bench
//! --requests-log` and `KVROUTE_DECISION_LOG` write them (`CELL.ROUTER.RUN.json`,
//! `.requests.jsonl`, `.metrics.prom`, `.workers.json`, decision logs):
//! every figure a script prints equals one computed by hand from round inputs, and what each
//! script's docstring promises (percentile ranks `int(p/100 · n)`, failures left out, the first
//! run of each router, the crossers) holds. The scripts use Python's standard library only;
//! python3 must be installed (see `.ci/run`).

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

const CELL: &str = "tiny.llama.tight.low";

/// A directory under the system's temporary directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-bench-scripts-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch(dir)
    }

    /// Writes `CELL.NAME`; its path.
    fn write(&self, name: &str, text: &str) -> String {
        self.write_as(&format!("{CELL}.{name}"), text)
    }

    fn write_as(&self, file: &str, text: &str) -> String {
        let path = self.0.join(file);
        std::fs::write(&path, text).expect("write a fixture file");
        path.display().to_string()
    }

    /// Writes the requests log `CELL.ROUTER_RUN.requests.jsonl`; its path.
    fn log(&self, router_run: &str, reqs: &[Value]) -> String {
        let text: String = reqs.iter().map(|r| format!("{r}\n")).collect();
        self.write(&format!("{router_run}.requests.jsonl"), &text)
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `bench/SCRIPT ARGS…` with python3; its standard output, or a failure with its stderr.
fn python(script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench")
        .join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        // crossing.py imports paired.py: leave no __pycache__ in bench/.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 must be installed (see .ci/run)");
    assert!(
        out.status.success(),
        "{script} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("the script prints UTF-8")
}

/// Request `i` of a requests log, with every field `report::log_line` writes: session `i`, turn
/// 0, sent at `i` s with 100·(i + 1) prompt tokens, none cached or reusable, served by port
/// 8001 with an engine (and client) TTFT of `ms` (unmeasured when `None`), 500 ms end to end.
fn req(i: u64, ms: Option<f64>) -> Value {
    json!({
        "target": "http://127.0.0.1:8000", "run": 0, "session": i, "turn": 0, "branch": false,
        "sent_at_s": i as f64, "failure": null, "prompt_tokens": 100 * (i + 1),
        "cached_tokens": 0, "oracle_tokens": 0, "output_tokens": 8,
        "ttft_s": ms.map(|m| m / 1e3), "engine_ttft_s": ms.map(|m| m / 1e3), "e2e_s": 0.5,
        "worker": "http://127.0.0.1:8001", "decision": null,
    })
}

/// `r` with `fields` set over it.
fn with(mut r: Value, fields: Value) -> Value {
    if let (Some(r), Value::Object(f)) = (r.as_object_mut(), fields) {
        r.extend(f);
    }
    r
}

/// Requests 0, 1, … as `req` makes them, with these engine TTFTs (ms).
fn served(ms: impl IntoIterator<Item = f64>) -> Vec<Value> {
    (0..).zip(ms).map(|(i, m)| req(i, Some(m))).collect()
}

/// A run's summary as `kvroute bench --json` writes it: one target's figures.
fn summary(figures: Value) -> String {
    json!({ "targets": [figures] }).to_string()
}

#[test]
fn matrix_tabulates_the_mean_and_range_of_each_routers_runs_and_kvroute_against_the_best_peer() {
    let (a, b) = (Scratch::new("matrix-a"), Scratch::new("matrix-b"));
    let run = |reuse, p50, p99, itl, e2e, rps, failed| {
        summary(
            json!({ "reuse": reuse, "oracle_reuse": 0.8, "ttft_p50_ms": p50,
            "ttft_p99_ms": p99, "itl_ms": { "p50": itl }, "e2e_ms": { "p50": e2e },
            "throughput_rps": rps, "failed": failed }),
        )
    };
    // Engines' request counts per worker: the busiest takes 3/4 and 13/20 of kvroute's runs.
    let counted = |text: String, w0: u32, w1: u32| {
        let per_worker = json!({ "per_worker": { "w0": w0, "w1": w1 } });
        let doc: Value = serde_json::from_str(&text).expect("a summary");
        summary(with(doc["targets"][0].clone(), per_worker))
    };
    // kvroute-hybrid's two runs, one in each directory.
    a.write(
        "kvroute-hybrid.1.json",
        &counted(run(0.5, 100, 400, 10, 300, 2.0, 1), 3, 1),
    );
    b.write(
        "kvroute-hybrid.2.json",
        &counted(run(0.7, 120, 500, 12, 340, 3.0, 0), 13, 7),
    );
    // A run's saved /admin/workers is no run (read as one, it has no "targets").
    a.write("kvroute-hybrid.1.workers.json", r#"{"workers": []}"#);
    a.write(
        "kvroute-blind.1.json",
        &counted(run(0.4, 150, 600, 11, 400, 2.5, 0), 5, 5),
    );
    // A peer whose engines counted nothing, and one without the count.
    a.write(
        "smg-cache.1.json",
        &counted(run(0.5, 220, 800, 10, 400, 2.5, 2), 0, 0),
    );
    a.write("vr-cache.1.json", &run(0.65, 250, 500, 10, 500, 2.5, 0));
    // A cell without kvroute-hybrid: a row, no verdict.
    let high = run(0.2, 50, 60, 5, 70, 4.0, 0);
    a.write_as("tiny.llama.tight.high.smg-cache.1.json", &high);

    let out = python("matrix.py", &[&a.path(), &b.path()]);
    let want = [
        "| cell | router | runs | reuse % | oracle % | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | e2e p50 ms | req/s | busiest worker | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| tiny.llama.tight.high | smg-cache | 1 | 20.0 | 80.0 | 50 | 60 | 5.0 | 70 | 4.0 | – | 0 |",
        // Means over both directories' runs (min–max); busiest (75 % + 65 %) / 2; failures summed.
        "| tiny.llama.tight.low | kvroute-hybrid | 2 | 60.0 (50.0–70.0) | 80.0 | 110 (100–120) | 450 (400–500) | 11.0 | 320 (300–340) | 2.5 | 70 % | 1 |",
        "| tiny.llama.tight.low | kvroute-blind | 1 | 40.0 | 80.0 | 150 | 600 | 11.0 | 400 | 2.5 | 50 % | 0 |",
        "| tiny.llama.tight.low | smg-cache | 1 | 50.0 | 80.0 | 220 | 800 | 10.0 | 400 | 2.5 | – | 2 |",
        "| tiny.llama.tight.low | vr-cache | 1 | 65.0 | 80.0 | 250 | 500 | 10.0 | 500 | 2.5 | – | 0 |",
        "",
        "| cell | kvroute p50 / best peer | kvroute p99 / best peer | e2e p50 / best peer | kvroute reuse − best peer (pts) | of oracle | hybrid − blind reuse (pts) |",
        "|---|---|---|---|---|---|---|",
        // 110 / 220, 450 / 500, 320 / 400; 60 − 65 pts; 60 / 80; 60 − 40 pts.
        "| tiny.llama.tight.low | 0.50 | 0.90 | 0.80 | -5.0 | 75 % | +20.0 |",
    ];
    let want = want.join("\n") + "\n";
    assert_eq!(out, format!("{want}\n"));
    let md = std::fs::read_to_string(a.0.join("matrix.md")).expect("matrix.md in the first dir");
    assert_eq!(md, want);
    assert!(!b.0.join("matrix.md").exists());
}

#[test]
fn matrix_marks_a_cell_run_as_replicas_and_counts_smg_mesh_as_a_peer() {
    let d = Scratch::new("matrix-replicas");
    let run = |reuse, p50, replicas: usize| {
        let per_replica: Vec<Value> = (0..replicas)
            .map(|k| json!({ "replica": k, "requests": 10, "failed": 0 }))
            .collect();
        summary(
            json!({ "reuse": reuse, "oracle_reuse": 0.8, "ttft_p50_ms": p50,
            "ttft_p99_ms": 2 * p50, "itl_ms": { "p50": 10 }, "e2e_ms": { "p50": 4 * p50 },
            "throughput_rps": 2.0, "failed": 0, "replicas": per_replica }),
        )
    };
    d.write("kvroute-hybrid.1.json", &run(0.6, 100, 3));
    d.write("smg-mesh.1.json", &run(0.5, 200, 3));
    // One replica is the plain cell.
    d.write_as("tiny.llama.tight.high.smg-cache.1.json", &run(0.2, 50, 1));
    let out = python("matrix.py", &[&d.path()]);
    let want = [
        "| tiny.llama.tight.high | smg-cache | 1 | 20.0 | 80.0 | 50 | 100 | 10.0 | 200 | 2.0 | – | 0 |",
        "| tiny.llama.tight.low ×3 | kvroute-hybrid | 1 | 60.0 | 80.0 | 100 | 200 | 10.0 | 400 | 2.0 | – | 0 |",
        "| tiny.llama.tight.low ×3 | smg-mesh | 1 | 50.0 | 80.0 | 200 | 400 | 10.0 | 800 | 2.0 | – | 0 |",
        // 100 / 200, 200 / 400, 400 / 800; 60 − 50 pts; 60 / 80; no blind run.
        "| tiny.llama.tight.low ×3 | 0.50 | 0.50 | 0.50 | +10.0 | 75 % | – |",
    ];
    for line in want {
        assert!(out.contains(line), "{line}\n{out}");
    }
}

#[test]
fn paired_reports_the_geometric_mean_of_per_request_ttft_ratios_over_the_requests_both_served() {
    let d = Scratch::new("paired");
    // Engine TTFT ms. kvroute / smg-cache: 1/2, 32, 2, 2, 2, 2, 1.05, 1/1.05, product 2^8,
    // geometric mean 2. Differences sorted -50 -50 +0.5 +0.8 +50 +100 +200 +310: median
    // (0.8 + 50) / 2. Faster by over 10 % and 1 ms: the first only; slower: the 2nd to 4th (the
    // 5th and 6th are twice as slow but by under 1 ms, the 7th slower by only 5 %).
    let mine = [50.0, 320.0, 200.0, 400.0, 1.0, 1.6, 1050.0, 1000.0];
    let smg = [100.0, 10.0, 100.0, 200.0, 0.5, 0.8, 1000.0, 1050.0];
    // Left out: kvroute's failure, a key kvroute logged twice, the peer's unmeasured request and
    // one only the peer logged.
    let mut h = served(mine);
    h.push(with(req(8, Some(5.0)), json!({ "failure": "timeout" })));
    h.extend([req(9, Some(5.0)), req(9, Some(6.0)), req(10, Some(5.0))]);
    let mut s = served(smg);
    s.extend([
        req(8, Some(1.0)),
        req(9, Some(1.0)),
        req(10, None),
        req(11, Some(1.0)),
    ]);
    d.log("kvroute-hybrid.1", &h);
    // Only each router's first run is paired.
    d.log("kvroute-hybrid.2", &[req(0, Some(1.0))]);
    d.log("smg-cache.1", &s);
    // vr-cache took twice as long on each: ratio 1/2; differences -m, median (-200 - 320) / 2;
    // kvroute faster on all but the one it beat by exactly 1 ms. kvroute-blind is no peer.
    d.log("vr-cache.1", &served(mine.map(|m| 2.0 * m)));
    d.log("kvroute-blind.1", &s);

    let out = python("paired.py", &[&d.path()]);
    let want = [
        "| cell | peer | paired | kvroute-hybrid / peer (TTFT, geometric mean) | median difference ms | kvroute-hybrid faster | slower |",
        "|---|---|---|---|---|---|---|",
        "| tiny.llama.tight.low | smg-cache | 8 | 2.00 | +25.4 | 1 | 3 |",
        "| tiny.llama.tight.low | vr-cache | 8 | 0.50 | -260.0 | 7 | 0 |",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
}

#[test]
fn paired_ab_compares_each_run_of_one_router_in_two_directories_by_end_to_end_latency() {
    let (a, b) = (Scratch::new("ab-a"), Scratch::new("ab-b"));
    // End-to-end ms over equal engine TTFTs. A / B: 1/4, 1/2, 1/2, 1, geometric mean 1/2;
    // differences -750 -500 -500 0, median -500; A faster on three.
    let e2e = |ms: [f64; 4]| -> Vec<Value> {
        let e = |(r, m): (Value, f64)| with(r, json!({ "e2e_s": m / 1e3 }));
        served([100.0; 4]).into_iter().zip(ms).map(e).collect()
    };
    a.log("kvroute-hybrid.1", &e2e([250.0, 500.0, 500.0, 800.0]));
    b.log("kvroute-hybrid.1", &e2e([1000.0, 1000.0, 1000.0, 800.0]));
    // A run B lacks, and another router's run, are not compared.
    a.log("kvroute-hybrid.2", &[req(0, Some(1.0))]);
    a.log("smg-cache.1", &[req(0, Some(1.0))]);
    b.log("smg-cache.1", &[req(0, Some(9.0))]);

    let out = python("paired.py", &["--ab", "--e2e", &a.path(), &b.path()]);
    let want = [
        "| cell | run | paired | A / B (end-to-end, geometric mean) | median difference ms | A faster | slower |",
        "|---|---|---|---|---|---|---|",
        "| tiny.llama.tight.low | 1 | 4 | 0.50 | -500.0 | 3 | 0 |",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
    // By engine TTFT the two settings served every request alike.
    let out = python("paired.py", &["--ab", &a.path(), &b.path()]);
    let last = out.lines().last().unwrap_or_default();
    assert_eq!(
        last,
        "| tiny.llama.tight.low | 1 | 4 | 1.00 | +0.0 | 0 | 0 |"
    );
}

#[test]
fn means_sets_each_runs_mean_ttft_against_the_other_whole_and_by_prompt_length() {
    let (a, b) = (Scratch::new("means-a"), Scratch::new("means-b"));
    // Requests 0–9 have prompts of 100–1,000 tokens. A: 1, 2, …, 10 s; B: 3 4 3 4 5 6 7 6 7
    // 8 s. Means 5.5 and 5.3 s, 1.038; prompts under 300 tokens (0, 1): 1.5 against 3.5 s,
    // 4 s less in all; of 800 or more (7–9): 9 against 7 s, 6 s more.
    let a_ms = (1..=10).map(|s| 1000.0 * s as f64);
    let b_ms = [3.0, 4.0, 3.0, 4.0, 5.0, 6.0, 7.0, 6.0, 7.0, 8.0].map(|s| 1000.0 * s);
    let mut a_log = served(a_ms);
    let mut b_log = served(b_ms);
    // A failure in A and an unmeasured request in B (both 1,100-token prompts) count nowhere.
    a_log.push(with(req(10, Some(1.0)), json!({ "failure": "status 500" })));
    b_log.push(req(10, None));
    a.log("kvroute-hybrid.1", &a_log);
    b.log("kvroute-hybrid.1", &b_log);
    // A run B lacks, and another router's run, are not compared.
    a.log("kvroute-hybrid.2", &served([1.0]));
    a.log("smg-cache.1", &served([1.0]));
    b.log("smg-cache.1", &served([9.0]));

    let args = ["--short", "300", "--long", "800", &a.path(), &b.path()];
    let out = python("means.py", &args);
    let want = [
        "| cell | run | mean TTFT A / B ms | A / B | prompts < 300: n · mean A / B ms · sum A − B s | prompts ≥ 800: n · mean A / B ms · sum A − B s |",
        "|---|---|---|---|---|---|",
        "| tiny.llama.tight.low | 1 | 5500.0 / 5300.0 | 1.038 | 2 · 1500 / 3500 · -4.0 | 3 · 9000 / 7000 · +6.0 |",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
    // By default short is under 1,000 tokens (requests 0–8, 5 s on average under both) and
    // long 8,000 or more (none here).
    let out = python("means.py", &[&a.path(), &b.path()]);
    let last = out.lines().last().unwrap_or_default();
    assert_eq!(
        last,
        "| tiny.llama.tight.low | 1 | 5500.0 / 5300.0 | 1.038 | 9 · 5000 / 5000 · +0.0 | 0 · – · – |"
    );
}

/// A cell's logs for crossing.py. Engine TTFT ms of requests 0–9 (sent at 0–9 s, prompts 100–
/// 1000): kvroute 10 20 30 40 50 100 110 120 130 140, smg-cache the same but 90 60 70 for
/// requests 4–6, vr-cache the same as kvroute. Request 10 failed under kvroute.
fn crossing_logs(d: &Scratch) {
    let hybrid = [
        10.0, 20.0, 30.0, 40.0, 50.0, 100.0, 110.0, 120.0, 130.0, 140.0,
    ];
    let mut smg = hybrid;
    smg[4..7].copy_from_slice(&[90.0, 60.0, 70.0]);
    let mut h = served(hybrid);
    for r in &mut h[4..7] {
        r["cached_tokens"] = json!(256);
    }
    // Under kvroute, request 4 decodes on 8001 until 5.5 s (when request 5 is sent there) and
    // request 5 until 6.2 s; request 6 goes to 8002.
    h[4]["e2e_s"] = json!(1.5);
    h[5]["e2e_s"] = json!(1.2);
    h[6]["worker"] = json!("http://127.0.0.1:8002");
    h.push(with(req(10, Some(5.0)), json!({ "failure": "timeout" })));
    let mut s = served(smg);
    // Under smg-cache, request 3 waits on 8001 for its first token until 4.2 s.
    s[3] = with(s[3].clone(), json!({ "ttft_s": 1.2, "e2e_s": 1.5 }));
    s.push(req(10, Some(5.0)));
    d.log("kvroute-hybrid.1", &h);
    d.log("smg-cache.1", &s);
    d.log("vr-cache.1", &served(hybrid));
    d.log("kvroute-hybrid.2", &h[..2]);
}

#[test]
fn crossing_names_the_requests_on_either_side_of_the_peers_p50_with_what_each_worker_was_doing() {
    let d = Scratch::new("crossing");
    crossing_logs(&d);
    let out = python("crossing.py", &[&d.path(), CELL]);
    // p50 of 10 at rank int(0.5 · 10) = 5: kvroute 100 ms, smg-cache 70 ms (the lower peer:
    // vr-cache's is 100), so T = 70. Above T under kvroute only: requests 5 and 6 (smg-cache's 70
    // counts as at or below); under smg-cache only: request 4. kvroute holds 5 requests at or
    // below T against smg-cache's 6: net +1 rank.
    let want = [
        "tiny.llama.tight.low, run 1, engine TTFT p50 over the 10 requests both served",
        "  kvroute-hybrid  p50 = 100.0 ms (rank 5); ranks 0-10 as prompt:ms: 100:10 200:20 300:30 400:40 500:50 600:100 700:110 800:120 900:130 1000:140",
        "  smg-cache       p50 = 70.0 ms (rank 5); ranks 0-10 as prompt:ms: 100:10 200:20 300:30 400:40 600:60 700:70 500:90 800:120 900:130 1000:140",
        "  at T = 70.0 ms: 2 requests above T under kvroute-hybrid only, 1 under smg-cache only (net +1 ranks)",
        "  2 above T under kvroute-hybrid, at or below under smg-cache:",
        "    t=5.00s prompt 600 (cached 256/0): kvroute-hybrid 100 ms, smg-cache 60 ms",
        "      kvroute-hybrid  on 8001: [D500:500]; elsewhere busy {}",
        "      smg-cache       on 8001: [idle]; elsewhere busy {}",
        "    t=6.00s prompt 700 (cached 256/0): kvroute-hybrid 110 ms, smg-cache 70 ms",
        "      kvroute-hybrid  on 8002: [idle]; elsewhere busy {'8001': 1}",
        "      smg-cache       on 8001: [idle]; elsewhere busy {}",
        "  1 at or below T under kvroute-hybrid, above under smg-cache:",
        "    t=4.00s prompt 500 (cached 256/0): kvroute-hybrid 50 ms, smg-cache 90 ms",
        "      kvroute-hybrid  on 8001: [idle]; elsewhere busy {}",
        "      smg-cache       on 8001: [P400:200]; elsewhere busy {}",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
}

#[test]
fn crossing_reads_the_percentile_at_rank_int_p_over_100_times_n_clamped_to_the_last() {
    let d = Scratch::new("crossing-rank");
    crossing_logs(&d);
    // p45 of 10: rank int(4.5) = 4, not interpolated; against the peer named.
    let out = python(
        "crossing.py",
        &["--p", "45", "--peer", "vr-cache", &d.path(), CELL],
    );
    let lines: Vec<&str> = out.lines().collect();
    let (hybrid, vr) = (
        "  kvroute-hybrid  p45 = 50.0 ms (rank 4); ",
        "  vr-cache        p45 = 50.0 ms (rank 4); ",
    );
    assert!(
        lines[1].starts_with(hybrid) && lines[2].starts_with(vr),
        "{out}"
    );
    assert_eq!(lines[3], "  at T = 50.0 ms: 0 requests above T under kvroute-hybrid only, 0 under vr-cache only (net +0 ranks)");
    // p100: rank 10 is past the end, so the last, 9.
    let out = python("crossing.py", &["--p", "100", &d.path(), CELL]);
    let lines: Vec<&str> = out.lines().collect();
    let (hybrid, smg) = (
        "  kvroute-hybrid  p100 = 140.0 ms (rank 9); ranks 4-14 as prompt:ms: 500:50 600:100 ",
        "  smg-cache       p100 = 140.0 ms (rank 9); ",
    );
    assert!(
        lines[1].starts_with(hybrid) && lines[2].starts_with(smg),
        "{out}"
    );
}

#[test]
fn floor_bounds_each_cell_by_the_idle_engine_ttft_at_the_oracles_reuse() {
    let d = Scratch::new("floor");
    // (prompt, oracle, cached, engine TTFT ms). Floors at the oracle's reuse, ms (4 a step of
    // at most 2,048 tokens, 0.06 a token, 2e-6 an attention pair, at least one token computed):
    //   1000 all reusable, 1 token: 4 + 0.06 + 2e-6 · 1 · (1000 + 1)    = 4.062
    //   1000 none:          4 + 60 + 2e-6 · 1000 · 500.5                = 65.001
    //   2000 half:          4 + 60 + 2e-6 · 1000 · (1000 + 500.5)       = 67.001
    //   2048 none, 1 step:  4 + 122.88 + 2e-6 · 2048 · 1024.5           = 131.076
    //   2049 none, 2 steps: 8 + 122.94 + 2e-6 · 2049 · 1025             = 135.140
    // p50 = sorted[int(0.5 · 5)] = 67.001, p99 = sorted[int(0.99 · 5)] = 135.140.
    let rows = [
        (1000, 1000, 1000, 4.05),
        (1000, 0, 0, 50.0),
        (2000, 1000, 0, 130.0),
        (2048, 0, 0, 140.0),
        (2049, 0, 0, 140.0),
    ];
    let log = |ms: Option<f64>| -> Vec<Value> {
        let tokens =
            |(p, o, c, _)| json!({ "prompt_tokens": p, "oracle_tokens": o, "cached_tokens": c });
        let ms = rows.map(|r| ms.unwrap_or(r.3));
        served(ms)
            .into_iter()
            .zip(rows)
            .map(|(r, t)| with(r, tokens(t)))
            .collect()
    };
    // Measured faster than the floor at their own reuse: only the 50 ms of 1000 uncached tokens
    // (4.05 ms is within the 1 % allowed of 4.062; 130 ms is above 128.002 at no reuse). Left
    // out: a failure and an unmeasured request, either of which would be a floor.
    let mut h = log(None);
    h.push(with(
        req(5, Some(0.001)),
        json!({ "prompt_tokens": 5000, "failure": "timeout" }),
    ));
    h.push(with(req(6, None), json!({ "prompt_tokens": 5000 })));
    let t = |p50: f64, p99: f64| summary(json!({ "ttft_p50_ms": p50, "ttft_p99_ms": p99 }));
    d.write("kvroute-hybrid.1.json", &t(80.0, 150.0));
    d.log("kvroute-hybrid.1", &h);
    d.write("kvroute-hybrid.1.workers.json", r#"{"workers": []}"#);
    // smg-cache: p50 (90 + 110) / 2 = 100, p99 320; its log all 500 ms. vr-cache: p99 270.
    d.write("smg-cache.1.json", &t(90.0, 300.0));
    d.write("smg-cache.2.json", &t(110.0, 340.0));
    d.log("smg-cache.1", &log(Some(500.0)));
    d.write("vr-cache.1.json", &t(120.0, 270.0));
    // A cell without requests logs has no floor and no row.
    d.write_as("tiny.llama.tight.high.smg-cache.1.json", &t(90.0, 300.0));

    let out = python("floor.py", &[&d.path()]);
    let want = [
        "| cell | best peer TTFT p50 / p99 ms | floor p50 / p99 ms | most any router can cut p50 | p99 |",
        "|---|---|---|---|---|",
        // 1 − 67.001 / 100, 1 − 135.140 / 270.
        "| tiny.llama.tight.low | 100 / 270 | 67 / 135 | 33 % | 50 % |",
        "",
        "requests measured faster than the floor at their own reuse: 1 of 10",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
}

/// Prometheus lines of one worker's histogram `name`: cumulative `counts` over `bounds`.
fn histogram(name: &str, worker: &str, bounds: &[&str], counts: &[u32], sum: f64) -> String {
    let mut s = String::new();
    for (le, c) in bounds.iter().zip(counts) {
        s += &format!("{name}_bucket{{worker=\"{worker}\",le=\"{le}\"}} {c}\n");
    }
    let n = counts.last().copied().unwrap_or(0);
    let label = format!("{{worker=\"{worker}\"}}");
    s + &format!("{name}_sum{label} {sum}\n{name}_count{label} {n}\n")
}

#[test]
fn prederr_sums_every_workers_histogram_per_run_and_per_router() {
    let d = Scratch::new("prederr");
    const REL: &str = "kvroute_ttft_prediction_relative_error";
    const ERR: &str = "kvroute_ttft_prediction_error_seconds";
    let le = [
        "0.02", "0.05", "0.1", "0.2", "0.3", "0.5", "1", "2", "5", "+Inf",
    ];
    let rel = |w, counts: &[u32]| histogram(REL, w, &le, counts, 1.5);
    let err = |w, n: u32, sum| histogram(ERR, w, &["+Inf"], &[n], sum);
    // Run 1, two workers of 10 answers: cumulative 2 5 8 13 14 18 19 20 20 20 of 20.
    let run1 = [
        "# TYPE kvroute_ttft_prediction_relative_error histogram\n".to_string(),
        rel("w0", &[2, 4, 6, 8, 8, 10, 10, 10, 10, 10]),
        rel("w1", &[0, 1, 2, 5, 6, 8, 9, 10, 10, 10]),
        err("w0", 10, 0.2),
        err("w1", 10, -0.1),
    ];
    // Run 2: 5 answers, 4 of them over 500 %.
    let run2 = [
        rel("w0", &[0, 0, 0, 0, 0, 0, 0, 0, 1, 5]),
        err("w0", 5, -0.4),
    ];
    d.write("kvroute-hybrid.1.metrics.prom", &run1.concat());
    d.write("kvroute-hybrid.2.metrics.prom", &run2.concat());
    d.write("kvroute-blind.1.metrics.prom", "kvroute_requests_total 3\n");

    let out = python("prederr.py", &[&d.path()]);
    let want = [
        "| run | answers | ≤ 5 % | ≤ 10 % | ≤ 20 % | median rel. error | mean predicted − observed ms |",
        "|---|---|---|---|---|---|---|",
        "| tiny.llama.tight.low.kvroute-blind.1 | 0 | | | | | |",
        // 5, 8, 13 of 20; the 10th answer lies in (0.1, 0.2], 2 of its 5: 0.1 + 0.1 · 2/5;
        // (0.2 − 0.1) s / 20.
        "| tiny.llama.tight.low.kvroute-hybrid.1 | 20 | 25 % | 40 % | 65 % | 14.0 % | +5.0 |",
        // The median lies beyond the last bound: 500 %. −0.4 s / 5.
        "| tiny.llama.tight.low.kvroute-hybrid.2 | 5 | 0 % | 0 % | 0 % | 500.0 % | -80.0 |",
        "| all kvroute-blind | 0 | | | | | |",
        // 5, 8, 13 of 25; the 12.5th answer: 0.1 + 0.1 · 4.5/5; (0.2 − 0.1 − 0.4) s / 25.
        "| all kvroute-hybrid | 25 | 20 % | 32 % | 52 % | 19.0 % | -12.0 |",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
}

#[test]
fn tails_splits_a_run_at_the_skip_time_and_counts_requests_served_below_the_oracle() {
    let d = Scratch::new("tails");
    // Sent at (s), engine TTFT (ms), cached and reusable tokens of requests 0–9.
    let sent = [0.1, 0.5, 1.2, 1.9, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5];
    let ms = [
        100.0, 900.0, 400.0, 500.0, 30.0, 20.0, 60.0, 70.0, 80.0, 10.0,
    ];
    let cached = [0, 0, 32, 0, 64, 64, 0, 16, 0, 0];
    let oracle = [0, 64, 32, 32, 64, 64, 0, 48, 0, 0];
    let mut reqs = served(ms);
    for (i, r) in reqs.iter_mut().enumerate() {
        // The client's clock reads i + 1 ms more than the engine's.
        let client = (ms[i] + i as f64 + 1.0) / 1e3;
        let f = json!({ "sent_at_s": sent[i], "cached_tokens": cached[i],
                        "oracle_tokens": oracle[i], "ttft_s": client });
        *r = with(r.clone(), f);
    }
    // Request 3 is a follow-up and 7 a branch (1 is a first request); 0–2 ran on a second
    // worker.
    reqs[3] = with(reqs[3].clone(), json!({ "turn": 2 }));
    reqs[7] = with(reqs[7].clone(), json!({ "turn": 1, "branch": true }));
    for r in &mut reqs[..3] {
        *r = with(r.clone(), json!({ "worker": "http://127.0.0.1:8002" }));
    }
    // Left out, though slow and short of the oracle: a failure and an unmeasured request.
    let failed = json!({ "sent_at_s": 0.2, "oracle_tokens": 500, "failure": "timeout" });
    reqs.push(with(req(10, Some(9000.0)), failed));
    reqs.push(with(
        req(11, None),
        json!({ "sent_at_s": 1.0, "oracle_tokens": 100 }),
    ));
    let log = d.log("kvroute-hybrid.1", &reqs);

    // All 10 sorted: 10 20 30 60 70 80 100 400 500 900: p50 = [int(5)] = 80, p99 = [int(9.9)]
    // = 900. Sent at 2 s or later: 10 20 30 60 70 80: p50 = [3] = 60, p99 = [int(5.94)] = 80.
    // Short of the oracle: 64 tokens at 0.5 s, 32 at 1.9 s, 32 at 3.5 s. The slowest 5 % of 10,
    // from rank int(9.5): the 900 ms request, sent at 0.5 s and short of the oracle.
    let out = python("tails.py", &[&log]);
    let want = [
        "tiny.llama.tight.low.kvroute-hybrid.1.requests.jsonl",
        "  requests 10: TTFT p50 80 ms, p99 900 ms",
        "  sent after 2 s (6): TTFT p50 60 ms, p99 80 ms",
        "  below the oracle: 3 requests, 128 tokens; by second sent: 0: 1, 1: 1, 3: 1",
        "  below the oracle by kind: first requests 64 tokens (1), follow-ups 32 tokens (1), \
         branches 32 tokens (1); requests per worker: 7, 3",
        "  slowest 5 % (1): 1 sent in the first 2 s; 1 below the oracle",
        // Gaps 1..10 ms: p10 = [1] = 2, p50 = [5] = 6, p90 = [9] = 10, p99 = [int(9.9)] = 10.
        "  client - engine TTFT: p10 2.0, p50 6.0, p90 10.0, p99 10.0 ms",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
    // From 3 s: 10 60 70 80: p50 = [2] = 70, p99 = [3] = 80.
    let out = python("tails.py", &["--skip", "3", &log]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[2], "  sent after 3 s (4): TTFT p50 70 ms, p99 80 ms");
    assert_eq!(
        lines[5],
        "  slowest 5 % (1): 1 sent in the first 3 s; 1 below the oracle"
    );
}

#[test]
fn followers_counts_the_prompts_sent_to_a_requests_worker_within_the_window() {
    let d = Scratch::new("followers");
    const W2: &str = "http://127.0.0.1:8002";
    // Sent at (s), client TTFT (ms), predicted TTFT (ms), worker: a's first token comes at
    // 0.10 s, after b (0.05 s) and d (0.08 s) reached its worker; b's at 0.09, after d; c is
    // alone on W2; d's and e's come before anything else reaches their worker.
    let rows = [
        (0.00, 100.0, Some(80.0), None),
        (0.05, 40.0, Some(42.0), None),
        (0.06, 10.0, Some(10.0), Some(W2)),
        (0.08, 20.0, Some(25.0), None),
        (0.50, 30.0, None, None),
    ];
    let mut reqs: Vec<Value> = (0..)
        .zip(rows)
        .map(|(i, (sent, ms, predicted, worker))| {
            let mut r = with(req(i, Some(ms)), json!({ "sent_at_s": sent }));
            if let Some(p) = predicted {
                r = with(r, json!({ "decision": { "predicted_ttft_ms": p } }));
            }
            if let Some(w) = worker {
                r = with(r, json!({ "worker": w }));
            }
            r
        })
        .collect();
    // Left out: a failure sent in a's wait on its worker.
    reqs.push(with(
        req(5, Some(5.0)),
        json!({ "sent_at_s": 0.01, "failure": "status 503" }),
    ));
    let log = d.log("kvroute-hybrid.1", &reqs);
    let name = "tiny.llama.tight.low.kvroute-hybrid.1.requests.jsonl";

    // The default window, 40 ms: a's ends at 0.04 s, before b; b's at its first token, 0.09 s,
    // after d. 0 followers: a, c, d, e (TTFT 10, 20, 30, 100: lower middle 20); predicted c 10,
    // d 25, a 80 (lower middle 25), errors 0, 25 and 20 % (lower middle 20), one within 10 %,
    // mean (0 + 5 − 20) / 3.
    let out = python("followers.py", &[&log]);
    let want = [
        name,
        "  followers 0: 4 requests (80 %), TTFT median 20.0 ms; predicted median 25.0 ms, \
         median relative error 20.0 %, within 10 % 33 %, mean predicted - observed -5.0 ms",
        "  followers 1: 1 requests (20 %), TTFT median 40.0 ms; predicted median 42.0 ms, \
         median relative error 5.0 %, within 10 % 100 %, mean predicted - observed +2.0 ms",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);

    // A 100 ms window reaches every first token: a has b and d. 0 followers: c, d, e (lower
    // middle 20); predicted c 10, d 25 (lower middle 10), errors 0 and 25 % (lower middle 0).
    let out = python("followers.py", &["--window", "100", &log]);
    let want = [
        name,
        "  followers 0: 3 requests (60 %), TTFT median 20.0 ms; predicted median 10.0 ms, \
         median relative error 0.0 %, within 10 % 50 %, mean predicted - observed +2.5 ms",
        "  followers 1: 1 requests (20 %), TTFT median 40.0 ms; predicted median 42.0 ms, \
         median relative error 5.0 %, within 10 % 100 %, mean predicted - observed +2.0 ms",
        "  followers 2+: 1 requests (20 %), TTFT median 100.0 ms; predicted median 80.0 ms, \
         median relative error 20.0 %, within 10 % 0 %, mean predicted - observed -20.0 ms",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
}

/// One decision-log line (the fields `decisions.py` reads of what `KVROUTE_DECISION_LOG`
/// writes): a prompt of `tokens`, sent to `to`, two workers w0 and w1 with `running` requests
/// each at decision time.
fn decision(tokens: u64, to: &str, running: [u64; 2]) -> String {
    let worker = |i: usize| {
        json!({"name": format!("w{i}"), "cached": 0, "queued_tokens": 10 * running[i],
               "running": running[i], "ttft": [20.0, 0.05, 0.0, 0.0], "load_wait_ms": 0.0})
    };
    let cand = |i: usize| {
        json!({"worker": format!("w{i}"), "predicted_ttft_ms": 100.0 + 10.0 * i as f64,
               "predicted_cached": 16 * i as u64})
    };
    let line = json!({
        "request": {"tokens": tokens, "follow_up": false, "rr": 0},
        "snapshot": {"workers": [worker(0), worker(1)]},
        "decision": {"worker": to, "candidates": [cand(0), cand(1)]},
    });
    format!("{line}\n")
}

#[test]
fn decisions_counts_the_requests_sent_elsewhere_and_the_chosen_workers_mean_load() {
    let d = Scratch::new("decisions");
    let one = [
        decision(100, "w0", [0, 0]),
        decision(200, "w1", [1, 0]),
        decision(300, "w0", [0, 1]),
        decision(400, "w1", [1, 1]),
    ];
    let mut three = one.clone();
    three[1] = decision(200, "w0", [1, 0]);
    three[3] = decision(999, "w0", [1, 1]);
    let a = d.write_as("one.jsonl", &one.concat());
    let b = d.write_as("three.jsonl", &three.concat());
    let out = python("decisions.py", &[&a, &b]);
    // The fourth pair's prompts differ: three pairs compared, the second sent elsewhere.
    assert!(
        out.contains("decision 3: the prompts differ (400 against 999 tokens)"),
        "{out}"
    );
    assert!(out.contains("decision 1: w1 against w0"), "{out}");
    assert!(
        out.contains("1 of 3 decisions went to another worker"),
        "{out}"
    );
    // The first log's chosen workers: w0 (0 running), w1 (0), w0 (0): mean 0, TTFT (100 + 110
    // + 100) / 3; the second's: w0 (0), w0 (1), w0 (0): 0.33 running, 3 tokens queued.
    assert!(
        out.contains(
            "one.jsonl: chosen worker's running 0.00, queued 0 tokens, predicted TTFT 103.3 ms, \
             predicted cached 5 tokens"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "three.jsonl: chosen worker's running 0.33, queued 3 tokens, predicted TTFT 100.0 \
             ms, predicted cached 0 tokens"
        ),
        "{out}"
    );
}

/// One `kvroute bench --json` run as `bench/terms.py` reads it: every figure fixed but the
/// mean TTFT.
fn replica_run(ttft_mean_ms: f64) -> String {
    json!({"targets": [{
        "reuse": 0.5,
        "ttft_mean_ms": ttft_mean_ms,
        "ttft_p50_ms": 90.0,
        "ttft_p99_ms": 300.0,
        "itl_ms": {"p50": 5.0},
        "e2e_ms": {"p50": 700.0},
    }]})
    .to_string()
}

#[test]
fn terms_sets_three_replicas_against_one_and_one_against_itself_as_the_noise_control() {
    let d = Scratch::new("terms-replicas");
    for (setting, means) in [
        ("r1.defaults", [100.0, 102.0]),
        ("r3.peers", [110.0, 111.0]),
    ] {
        for (rep, m) in means.into_iter().enumerate() {
            d.write_as(
                &format!("tiny.llama.120.8.{setting}.{}.json", rep + 1),
                &replica_run(m),
            );
        }
    }
    // Without a second one-replica setting: the replicas' table alone.
    let out = python("terms.py", &["--replicas", &d.path()]);
    // Mean TTFT 110.5 against 101 with a noise of 2 (one replica's range): behind.
    assert!(out.contains("+9.5 (2.0) **behind**"), "{out}");
    assert!(
        out.contains(
            "r3.peers against r1.defaults: figures within the noise: 5, ahead: 0, behind: 1"
        ),
        "{out}"
    );
    assert!(!out.contains("r1.again"), "{out}");
    // One replica again: its mean 102 against 101, within the noise (2).
    for (rep, m) in [101.0, 103.0].into_iter().enumerate() {
        d.write_as(
            &format!("tiny.llama.120.8.r1.again.{}.json", rep + 1),
            &replica_run(m),
        );
    }
    let out = python("terms.py", &["--replicas", &d.path()]);
    assert!(out.contains("| ttft_mean_ms 1 − 1 (noise) |"), "{out}");
    assert!(out.contains("+1.0 (2.0)"), "{out}");
    assert!(
        out.contains(
            "r1.again against r1.defaults: figures within the noise: 6, ahead: 0, behind: 0"
        ),
        "{out}"
    );
}
