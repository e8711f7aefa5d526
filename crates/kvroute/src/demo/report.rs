//! The demo's per-policy results: collected samples, the table, the JSON.
//!
//! Owns: `Sample` (one request's outcome), `PolicyResult` (reuse, prediction error, TTFT
//! percentiles, throughput, counts) and its rendering.
//! Invariants: reuse is engine-reported cached tokens over prompt tokens; prediction error is
//! the mean absolute difference between the gateway's prediction and the engine's report.
//! Must not: invent numbers: a policy with no completed request reports zeros and its failures.

use crate::bench::report::percentile;
use serde::Serialize;

#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// The request's position in the replayed trace.
    pub index: usize,
    pub prompt_tokens: u64,
    pub cached_reported: Option<u64>,
    pub cached_predicted: Option<u64>,
    /// Engine-time milliseconds to the first token.
    pub ttft_ms: f64,
    pub ok: bool,
    /// The worker the gateway chose.
    pub worker: Option<String>,
    /// The gateway's `x-kvroute-decision` evidence, as sent.
    pub decision: Option<serde_json::Value>,
}

/// One line of the demo's requests log (JSON, newline-terminated).
pub fn log_line(policy: &str, run: usize, s: &Sample) -> serde_json::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(&serde_json::json!({
        "policy": policy,
        "run": run,
        "index": s.index,
        "worker": s.worker,
        "prompt_tokens": s.prompt_tokens,
        "cached_predicted": s.cached_predicted,
        "cached_reported": s.cached_reported,
        "ttft_ms": s.ttft_ms,
        "ok": s.ok,
        "decision": s.decision,
    }))?;
    line.push(b'\n');
    Ok(line)
}

#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub reuse: f64,
    /// Mean |predicted − engine-reported| cached tokens per request.
    pub prediction_error: f64,
    /// Share of requests predicted exactly.
    pub prediction_exact: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub throughput_rps: f64,
    pub requests: usize,
    pub failed: usize,
    /// Requests per worker (how the policy spread the load).
    pub per_worker: std::collections::BTreeMap<String, usize>,
    /// With `--repeat`: the range over the runs (the figures above are their means).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spread: Option<Spread>,
}

/// How far repeated runs of one policy moved.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Spread {
    pub runs: usize,
    pub reuse_min: f64,
    pub reuse_max: f64,
    pub ttft_p50_ms_min: f64,
    pub ttft_p50_ms_max: f64,
    pub ttft_p99_ms_min: f64,
    pub ttft_p99_ms_max: f64,
}

fn range(runs: &[PolicyResult], f: impl Fn(&PolicyResult) -> f64) -> (f64, f64) {
    runs.iter()
        .map(f)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        })
}

/// One policy's repeated runs as one result: the means of the rates and times, the sums of
/// the counts, and the range each figure moved over. A single run is returned as it is.
pub fn combine(runs: &[PolicyResult]) -> Option<PolicyResult> {
    let first = runs.first()?;
    if runs.len() == 1 {
        return Some(first.clone());
    }
    let k = runs.len() as f64;
    let mean = |f: &dyn Fn(&PolicyResult) -> f64| runs.iter().map(f).sum::<f64>() / k;
    let mut per_worker = std::collections::BTreeMap::new();
    for r in runs {
        for (w, n) in &r.per_worker {
            *per_worker.entry(w.clone()).or_insert(0) += n;
        }
    }
    let (reuse_min, reuse_max) = range(runs, |r| r.reuse);
    let (ttft_p50_ms_min, ttft_p50_ms_max) = range(runs, |r| r.ttft_p50_ms);
    let (ttft_p99_ms_min, ttft_p99_ms_max) = range(runs, |r| r.ttft_p99_ms);
    Some(PolicyResult {
        policy: first.policy.clone(),
        reuse: mean(&|r| r.reuse),
        prediction_error: mean(&|r| r.prediction_error),
        prediction_exact: mean(&|r| r.prediction_exact),
        ttft_p50_ms: mean(&|r| r.ttft_p50_ms),
        ttft_p99_ms: mean(&|r| r.ttft_p99_ms),
        throughput_rps: mean(&|r| r.throughput_rps),
        requests: runs.iter().map(|r| r.requests).sum(),
        failed: runs.iter().map(|r| r.failed).sum(),
        per_worker,
        spread: Some(Spread {
            runs: runs.len(),
            reuse_min,
            reuse_max,
            ttft_p50_ms_min,
            ttft_p50_ms_max,
            ttft_p99_ms_min,
            ttft_p99_ms_max,
        }),
    })
}

pub fn summarize(policy: &str, samples: &[Sample], engine_seconds: f64) -> PolicyResult {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|s| s.cached_reported).sum();
    let pairs: Vec<(u64, u64)> = ok
        .iter()
        .filter_map(|s| Some((s.cached_predicted?, s.cached_reported?)))
        .collect();
    let err = if pairs.is_empty() {
        0.0
    } else {
        pairs
            .iter()
            .map(|(p, r)| p.abs_diff(*r) as f64)
            .sum::<f64>()
            / pairs.len() as f64
    };
    let exact = if pairs.is_empty() {
        0.0
    } else {
        pairs.iter().filter(|(p, r)| p == r).count() as f64 / pairs.len() as f64
    };
    let mut ttft: Vec<f64> = ok.iter().map(|s| s.ttft_ms).collect();
    PolicyResult {
        policy: policy.to_string(),
        reuse: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
        prediction_error: err,
        prediction_exact: exact,
        ttft_p50_ms: percentile(&mut ttft, 50.0),
        ttft_p99_ms: percentile(&mut ttft, 99.0),
        throughput_rps: if engine_seconds > 0.0 {
            ok.len() as f64 / engine_seconds
        } else {
            0.0
        },
        requests: samples.len(),
        failed: samples.len() - ok.len(),
        per_worker: samples.iter().filter_map(|s| s.worker.clone()).fold(
            Default::default(),
            |mut m, w| {
                *m.entry(w).or_insert(0) += 1;
                m
            },
        ),
        spread: None,
    }
}

pub fn table(results: &[PolicyResult]) -> String {
    // The name column fits the longest row name (a disaggregated row's is `policy PpDd`).
    let w = results
        .iter()
        .map(|r| r.policy.chars().count())
        .max()
        .unwrap_or(0)
        .max(14);
    let mut s = String::new();
    s.push_str(&format!(
        "{:<w$} {:>8} {:>12} {:>8} {:>11} {:>11} {:>10} {:>8} {:>6}\n",
        "policy",
        "reuse",
        "pred.err",
        "exact",
        "ttft p50",
        "ttft p99",
        "req/s",
        "requests",
        "failed"
    ));
    for r in results {
        s.push_str(&format!(
            "{:<w$} {:>7.1}% {:>8.1} tok {:>7.1}% {:>8.1} ms {:>8.1} ms {:>10.2} {:>8} {:>6}\n",
            r.policy,
            r.reuse * 100.0,
            r.prediction_error,
            r.prediction_exact * 100.0,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.throughput_rps,
            r.requests,
            r.failed
        ));
    }
    for r in results {
        if let Some(sp) = &r.spread {
            s.push_str(&format!(
                "{:<w$} over {} runs (means; counts summed): reuse {:.1}–{:.1}%, ttft p50 {:.1}–{:.1} ms, p99 {:.1}–{:.1} ms\n",
                r.policy,
                sp.runs,
                sp.reuse_min * 100.0,
                sp.reuse_max * 100.0,
                sp.ttft_p50_ms_min,
                sp.ttft_p50_ms_max,
                sp.ttft_p99_ms_min,
                sp.ttft_p99_ms_max
            ));
        }
    }
    for r in results {
        let spread: Vec<String> = r
            .per_worker
            .iter()
            .map(|(w, n)| format!("{w} {n}"))
            .collect();
        s.push_str(&format!(
            "{:<w$} requests per worker: {}\n",
            r.policy,
            spread.join(", ")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_counts_reuse_error_and_failures() {
        let s = vec![
            Sample {
                prompt_tokens: 100,
                cached_reported: Some(50),
                cached_predicted: Some(50),
                ttft_ms: 10.0,
                ok: true,
                worker: Some("a".into()),
                ..Sample::default()
            },
            Sample {
                prompt_tokens: 100,
                cached_reported: Some(0),
                cached_predicted: Some(64),
                ttft_ms: 30.0,
                ok: true,
                worker: Some("b".into()),
                ..Sample::default()
            },
            Sample {
                ok: false,
                ..Sample::default()
            },
        ];
        let r = summarize("p", &s, 2.0);
        assert!((r.reuse - 0.25).abs() < 1e-9);
        assert!((r.prediction_error - 32.0).abs() < 1e-9);
        assert!((r.prediction_exact - 0.5).abs() < 1e-9);
        assert_eq!((r.requests, r.failed), (3, 1));
        assert_eq!(r.ttft_p50_ms, 30.0);
        assert!((r.throughput_rps - 1.0).abs() < 1e-9);
        assert_eq!(r.per_worker.get("a"), Some(&1));
    }

    #[test]
    fn a_requests_log_line_is_one_json_object_per_request() {
        let s = Sample {
            index: 7,
            prompt_tokens: 100,
            cached_reported: Some(64),
            cached_predicted: Some(64),
            worker: Some("w1".into()),
            decision: Some(serde_json::json!({"worker": "w1"})),
            ..Sample::default()
        };
        let line = log_line("hybrid-aware", 2, &s).unwrap_or_default();
        assert_eq!(line.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap_or_default();
        assert_eq!(v["policy"], "hybrid-aware");
        assert_eq!(v["index"], 7);
        assert_eq!(v["run"], 2);
        assert_eq!(v["cached_reported"], 64);
        assert_eq!(v["decision"]["worker"], "w1");
    }

    #[test]
    fn repeated_runs_combine_into_means_sums_and_ranges() {
        let run = |reuse: f64, p50: f64, n: usize| PolicyResult {
            policy: "p".into(),
            reuse,
            prediction_error: 0.0,
            prediction_exact: 1.0,
            ttft_p50_ms: p50,
            ttft_p99_ms: 2.0 * p50,
            throughput_rps: 1.0,
            requests: n,
            failed: 1,
            per_worker: [("w0".to_string(), n)].into_iter().collect(),
            spread: None,
        };
        let one = run(0.4, 30.0, 10);
        assert_eq!(
            combine(std::slice::from_ref(&one)).map(|r| r.spread),
            Some(None)
        );
        assert!(combine(&[]).is_none());
        let c = combine(&[run(0.4, 30.0, 10), run(0.5, 40.0, 10)]).unwrap_or(one);
        assert!((c.reuse - 0.45).abs() < 1e-9);
        assert!((c.ttft_p50_ms - 35.0).abs() < 1e-9);
        assert_eq!((c.requests, c.failed), (20, 2));
        assert_eq!(c.per_worker.get("w0"), Some(&20));
        let sp = c
            .spread
            .clone()
            .unwrap_or_else(|| panic!("a spread for two runs"));
        assert_eq!(sp.runs, 2);
        assert_eq!((sp.reuse_min, sp.reuse_max), (0.4, 0.5));
        assert_eq!((sp.ttft_p99_ms_min, sp.ttft_p99_ms_max), (60.0, 80.0));
        assert!(table(&[c]).contains("summed): reuse 40.0–50.0%"));
    }
}
