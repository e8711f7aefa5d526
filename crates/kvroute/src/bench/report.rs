//! One target's figures from its outcomes: counts, reuse against the arrival-time oracle,
//! latency percentiles, throughput; the side-by-side table and the requests log.
//!
//! Owns: [`TargetReport`] (its JSON is the bench's contract: `requests`, `failed`, `reuse`,
//! `oracle_reuse`, `ttft_p50_ms`, `ttft_p99_ms`, `ttft_mean_ms`, `throughput_rps`, `replicas`
//! and the rest; fields are added, never renamed), [`ReplicaFigures`] (what each replica of a
//! balanced target served), [`oracle`]
//! (what an infinite cache would have reused: for each request in send order, the longest
//! block-aligned prefix any earlier request's prompt had, at most `n − 1` tokens, as vLLM
//! never serves a whole prompt), percentiles, the table.
//! Invariants: reuse is engine-reported cached tokens over prompt tokens of completed requests;
//! the oracle covers the same requests; TTFT is the engine's own when every completed request
//! reported it (`ttft_source = "engine"`), else the client's wall time × `time_scale`
//! (`"client"`), for the percentiles and the mean alike; a report with no completed request
//! reports zeros and its failures; every request that left is counted under exactly one
//! replica.
//! Must not: drop a failure, or mix engine and client times in one percentile.

use super::client::Outcome;
use serde::Serialize;
use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};

/// The arrival-time oracle per outcome (same order as `outcomes`), in tokens.
pub fn oracle(outcomes: &[Outcome], block: usize) -> Vec<u64> {
    let block = block.max(1);
    let mut order: Vec<usize> = (0..outcomes.len()).collect();
    order.sort_by(|a, b| outcomes[*a].sent_at_s.total_cmp(&outcomes[*b].sent_at_s));
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = vec![0; outcomes.len()];
    for i in order {
        let t = &outcomes[i].tokens;
        let reachable = t.len().saturating_sub(1) / block;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let mut chain = Vec::with_capacity(t.len() / block);
        for b in t.chunks_exact(block) {
            b.hash(&mut h);
            chain.push(h.finish());
        }
        let hit = chain
            .iter()
            .take(reachable)
            .take_while(|c| seen.contains(c))
            .count();
        out[i] = (hit * block) as u64;
        seen.extend(chain);
    }
    out
}

/// The `p`-th percentile (nearest rank) of `v`, 0 for none.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[idx.min(v.len() - 1)]
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

fn pcts(mut v: Vec<f64>) -> Percentiles {
    Percentiles {
        p50: percentile(&mut v, 50.0),
        p90: percentile(&mut v, 90.0),
        p99: percentile(&mut v, 99.0),
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct TargetReport {
    pub target: String,
    pub workload: String,
    pub requests: usize,
    pub failed: usize,
    /// Failures by class (`http_503`, `timeout`, …).
    pub failures: BTreeMap<String, usize>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub reuse: f64,
    pub oracle_reuse: f64,
    /// `reuse / oracle_reuse`.
    pub oracle_share: f64,
    pub ttft_source: String,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// The mean TTFT (same source as the percentiles).
    pub ttft_mean_ms: f64,
    /// Client-measured TTFT (wall × time scale), whatever the source above.
    pub client_ttft_ms: Percentiles,
    /// Inter-token latency: per request the engine's time per output token after the first
    /// (`ttft_source = "engine"`), else every gap the client saw between streamed tokens.
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub output_tokens_per_s: f64,
    pub throughput_rps: f64,
    /// Wall seconds the run took.
    pub wall_s: f64,
    /// Requests per worker, where the target said which (kvroute's decision header).
    pub per_worker: BTreeMap<String, usize>,
    /// Per replica of the target (one for a single gateway): what the balancer sent it.
    pub replicas: Vec<ReplicaFigures>,
    /// With `--repeat`: each run's reuse and TTFT p50/p99, and the means above are over them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<RunFigures>,
}

/// One replica's share of a run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ReplicaFigures {
    /// Its index in the target's replicas (the balancer's order).
    pub replica: usize,
    pub url: String,
    /// Requests sent to it, and of those the ones that failed.
    pub requests: usize,
    pub failed: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub reuse: f64,
    pub ttft_mean_ms: f64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunFigures {
    pub reuse: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
}

/// Figures for one run. `time_scale` turns client wall seconds into engine seconds (a
/// simulated fleet running × S reports × S).
pub fn summarize(
    target: &str,
    workload: &str,
    outcomes: &[Outcome],
    block: usize,
    wall_s: f64,
    time_scale: f64,
) -> TargetReport {
    let oracle = oracle(outcomes, block);
    let ok: Vec<usize> = (0..outcomes.len())
        .filter(|i| outcomes[*i].failure.is_none())
        .collect();
    let mut failures = BTreeMap::new();
    for o in outcomes {
        if let Some(f) = &o.failure {
            *failures.entry(f.clone()).or_insert(0) += 1;
        }
    }
    let prompt: u64 = ok.iter().map(|i| outcomes[*i].prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|i| outcomes[*i].cached_tokens).sum();
    let oracle_sum: u64 = ok.iter().map(|i| oracle[*i]).sum();
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let engine = !ok.is_empty() && ok.iter().all(|i| outcomes[*i].engine_ttft_s.is_some());
    let ms = 1000.0;
    let ttft: Vec<f64> = ok
        .iter()
        .filter_map(|i| ttft_ms(&outcomes[*i], engine, time_scale))
        .collect();
    let ttft_mean_ms = mean(&ttft);
    let t = pcts(ttft);
    let client: Vec<f64> = ok
        .iter()
        .filter_map(|i| outcomes[*i].ttft_s)
        .map(|t| t * ms * time_scale)
        .collect();
    // Inter-token latency: the engine's mean time per output token after the first when it
    // reports its times (a client sees streamed chunks coalesce), else the client's gaps.
    let itl: Vec<f64> = if engine {
        ok.iter()
            .filter_map(|i| {
                let o = &outcomes[*i];
                let n = o.output_tokens.checked_sub(1).filter(|n| *n > 0)?;
                Some((o.engine_e2e_s? - o.engine_ttft_s?).max(0.0) / n as f64 * ms)
            })
            .collect()
    } else {
        ok.iter()
            .flat_map(|i| outcomes[*i].itl_s.iter())
            .map(|t| t * ms * time_scale)
            .collect()
    };
    let e2e: Vec<f64> = ok
        .iter()
        .filter_map(|i| {
            let o = &outcomes[*i];
            if engine {
                o.engine_e2e_s.map(|t| t * ms)
            } else {
                o.e2e_s.map(|t| t * ms * time_scale)
            }
        })
        .collect();
    let engine_s = wall_s * time_scale;
    let output: u64 = ok.iter().map(|i| outcomes[*i].output_tokens).sum();
    let reuse = ratio(cached, prompt);
    let oracle_reuse = ratio(oracle_sum, prompt);
    TargetReport {
        target: target.to_string(),
        workload: workload.to_string(),
        requests: outcomes.len(),
        failed: outcomes.len() - ok.len(),
        failures,
        prompt_tokens: prompt,
        cached_tokens: cached,
        reuse,
        oracle_reuse,
        oracle_share: if oracle_reuse > 0.0 {
            reuse / oracle_reuse
        } else {
            0.0
        },
        ttft_source: if engine { "engine" } else { "client" }.into(),
        ttft_p50_ms: t.p50,
        ttft_p90_ms: t.p90,
        ttft_p99_ms: t.p99,
        ttft_mean_ms,
        client_ttft_ms: pcts(client),
        itl_ms: pcts(itl),
        e2e_ms: pcts(e2e),
        output_tokens_per_s: if engine_s > 0.0 {
            output as f64 / engine_s
        } else {
            0.0
        },
        throughput_rps: if engine_s > 0.0 {
            ok.len() as f64 / engine_s
        } else {
            0.0
        },
        wall_s,
        per_worker: outcomes.iter().filter_map(|o| o.worker.clone()).fold(
            BTreeMap::new(),
            |mut m, w| {
                *m.entry(w).or_insert(0) += 1;
                m
            },
        ),
        replicas: Vec::new(),
        runs: Vec::new(),
    }
}

/// One completed request's TTFT in ms: the engine's own, or the client's × `time_scale`.
fn ttft_ms(o: &Outcome, engine: bool, time_scale: f64) -> Option<f64> {
    if engine {
        o.engine_ttft_s.map(|t| t * 1000.0)
    } else {
        o.ttft_s.map(|t| t * 1000.0 * time_scale)
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// What each of `urls` served in one run: the outcomes sent to it, reuse over its completed
/// requests, and their mean TTFT from the report's source (`engine`: the engine's own times).
pub fn replicas(
    outcomes: &[Outcome],
    urls: &[String],
    engine: bool,
    time_scale: f64,
) -> Vec<ReplicaFigures> {
    urls.iter()
        .enumerate()
        .map(|(k, url)| {
            let sent: Vec<&Outcome> = outcomes.iter().filter(|o| o.replica == Some(k)).collect();
            let ok: Vec<&Outcome> = sent
                .iter()
                .copied()
                .filter(|o| o.failure.is_none())
                .collect();
            let prompt_tokens: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
            let cached_tokens: u64 = ok.iter().filter_map(|o| o.cached_tokens).sum();
            let ttft: Vec<f64> = ok
                .iter()
                .filter_map(|o| ttft_ms(o, engine, time_scale))
                .collect();
            ReplicaFigures {
                replica: k,
                url: url.clone(),
                requests: sent.len(),
                failed: sent.len() - ok.len(),
                prompt_tokens,
                cached_tokens,
                reuse: if prompt_tokens == 0 {
                    0.0
                } else {
                    cached_tokens as f64 / prompt_tokens as f64
                },
                ttft_mean_ms: mean(&ttft),
            }
        })
        .collect()
}

/// Every run's replicas as one list, by index: counts summed, reuse over the sums, the mean
/// TTFT the mean of the runs' means (the first run's URL kept).
fn combine_replicas(runs: &[TargetReport]) -> Vec<ReplicaFigures> {
    let mut out: Vec<ReplicaFigures> = Vec::new();
    let mut means: Vec<Vec<f64>> = Vec::new();
    for r in runs.iter().flat_map(|r| &r.replicas) {
        if out.len() <= r.replica {
            out.resize_with(r.replica + 1, ReplicaFigures::default);
            means.resize_with(r.replica + 1, Vec::new);
        }
        let o = &mut out[r.replica];
        if o.url.is_empty() {
            o.url = r.url.clone();
        }
        o.replica = r.replica;
        o.requests += r.requests;
        o.failed += r.failed;
        o.prompt_tokens += r.prompt_tokens;
        o.cached_tokens += r.cached_tokens;
        means[r.replica].push(r.ttft_mean_ms);
    }
    for (o, m) in out.iter_mut().zip(&means) {
        o.reuse = if o.prompt_tokens == 0 {
            0.0
        } else {
            o.cached_tokens as f64 / o.prompt_tokens as f64
        };
        o.ttft_mean_ms = mean(m);
    }
    out
}

/// Repeated runs of one target as one report: means of rates and times, sums of counts, and
/// each run's figures kept.
pub fn combine(runs: Vec<TargetReport>) -> Option<TargetReport> {
    if runs.len() <= 1 {
        return runs.into_iter().next();
    }
    let k = runs.len() as f64;
    let mean = |f: &dyn Fn(&TargetReport) -> f64| runs.iter().map(f).sum::<f64>() / k;
    let mut out = runs[0].clone();
    out.reuse = mean(&|r| r.reuse);
    out.oracle_reuse = mean(&|r| r.oracle_reuse);
    out.oracle_share = mean(&|r| r.oracle_share);
    out.ttft_p50_ms = mean(&|r| r.ttft_p50_ms);
    out.ttft_p90_ms = mean(&|r| r.ttft_p90_ms);
    out.ttft_p99_ms = mean(&|r| r.ttft_p99_ms);
    out.ttft_mean_ms = mean(&|r| r.ttft_mean_ms);
    out.throughput_rps = mean(&|r| r.throughput_rps);
    out.output_tokens_per_s = mean(&|r| r.output_tokens_per_s);
    out.requests = runs.iter().map(|r| r.requests).sum();
    out.failed = runs.iter().map(|r| r.failed).sum();
    out.prompt_tokens = runs.iter().map(|r| r.prompt_tokens).sum();
    out.cached_tokens = runs.iter().map(|r| r.cached_tokens).sum();
    out.wall_s = runs.iter().map(|r| r.wall_s).sum();
    out.failures = BTreeMap::new();
    out.per_worker = BTreeMap::new();
    for r in &runs {
        for (f, n) in &r.failures {
            *out.failures.entry(f.clone()).or_insert(0) += n;
        }
        for (w, n) in &r.per_worker {
            *out.per_worker.entry(w.clone()).or_insert(0) += n;
        }
    }
    out.replicas = combine_replicas(&runs);
    if runs.iter().any(|r| r.ttft_source != out.ttft_source) {
        out.ttft_source = "mixed".into();
    }
    out.runs = runs
        .iter()
        .map(|r| RunFigures {
            reuse: r.reuse,
            ttft_p50_ms: r.ttft_p50_ms,
            ttft_p99_ms: r.ttft_p99_ms,
        })
        .collect();
    Some(out)
}

fn range(r: &TargetReport, f: impl Fn(&RunFigures) -> f64, scale: f64, digits: usize) -> String {
    if r.runs.is_empty() {
        return String::new();
    }
    let lo = r.runs.iter().map(&f).fold(f64::INFINITY, f64::min) * scale;
    let hi = r.runs.iter().map(&f).fold(f64::NEG_INFINITY, f64::max) * scale;
    format!(" ({lo:.digits$}–{hi:.digits$})")
}

pub fn table(reports: &[TargetReport]) -> String {
    let mut s = format!(
        "{:<26} {:>8} {:>8} {:>7} {:>10} {:>10} {:>10} {:>10} {:>9} {:>8} {:>6}\n",
        "target",
        "reuse",
        "oracle",
        "of orc.",
        "ttft mean",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "itl p50",
        "req/s",
        "failed"
    );
    for r in reports {
        s.push_str(&format!(
            "{:<26} {:>7.1}% {:>7.1}% {:>6.0}% {:>7.1} ms {:>7.1} ms {:>7.1} ms {:>7.1} ms {:>6.1} ms {:>8.2} {:>6}\n",
            r.target,
            r.reuse * 100.0,
            r.oracle_reuse * 100.0,
            r.oracle_share * 100.0,
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.itl_ms.p50,
            r.throughput_rps,
            r.failed,
        ));
        if !r.runs.is_empty() {
            s.push_str(&format!(
                "  {} runs: reuse{} %, ttft p50{} ms, p99{} ms\n",
                r.runs.len(),
                range(r, |x| x.reuse, 100.0, 1),
                range(r, |x| x.ttft_p50_ms, 1.0, 1),
                range(r, |x| x.ttft_p99_ms, 1.0, 0),
            ));
        }
        if r.replicas.len() > 1 {
            for x in &r.replicas {
                s.push_str(&format!(
                    "  replica {} {}: {} requests, {} failed, reuse {:.1}%, ttft mean {:.1} ms\n",
                    x.replica,
                    x.url,
                    x.requests,
                    x.failed,
                    x.reuse * 100.0,
                    x.ttft_mean_ms,
                ));
            }
        }
    }
    s
}

/// One JSON line per request.
pub fn log_line(target: &str, run: usize, o: &Outcome, oracle: u64) -> serde_json::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(&serde_json::json!({
        "target": target,
        "run": run,
        "session": o.session,
        "turn": o.turn,
        "branch": o.branch,
        "replica": o.replica,
        "sent_at_s": o.sent_at_s,
        "failure": o.failure,
        "prompt_tokens": o.prompt_tokens,
        "cached_tokens": o.cached_tokens,
        "oracle_tokens": oracle,
        "output_tokens": o.output_tokens,
        "ttft_s": o.ttft_s,
        "engine_ttft_s": o.engine_ttft_s,
        "e2e_s": o.e2e_s,
        "worker": o.worker,
        "decision": o.decision,
    }))?;
    line.push(b'\n');
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(at: f64, tokens: Vec<u32>) -> Outcome {
        Outcome {
            sent_at_s: at,
            prompt_tokens: tokens.len() as u64,
            tokens,
            ..Outcome::default()
        }
    }

    #[test]
    fn the_oracle_counts_whole_blocks_shared_with_earlier_prompts_below_the_last_token() {
        let a: Vec<u32> = (0..40).collect();
        let mut b: Vec<u32> = (0..24).collect();
        b.extend(100..116);
        let outs = vec![
            sent(1.0, b.clone()),
            sent(0.0, a.clone()),
            sent(2.0, a[..32].to_vec()),
        ];
        // b, sent after a, shares its first three blocks of 8; a's first 32 tokens, sent last,
        // may reuse three of their four blocks (never the whole prompt).
        assert_eq!(oracle(&outs, 8), vec![24, 0, 24]);
        // The same prompt again: at most n − 1 tokens, block-aligned.
        let again = vec![sent(0.0, a.clone()), sent(1.0, a.clone())];
        assert_eq!(oracle(&again, 8), vec![0, 32]);
        assert_eq!(oracle(&again, 16), vec![0, 32]);
    }

    #[test]
    fn each_replica_counts_what_the_balancer_sent_it_and_the_mean_ttft_sits_beside_the_ranks() {
        let served = |replica: usize, ttft: f64, failure: Option<&str>| Outcome {
            replica: Some(replica),
            prompt_tokens: 100,
            cached_tokens: Some(50),
            ttft_s: Some(ttft),
            failure: failure.map(str::to_string),
            ..Outcome::default()
        };
        let outs = vec![
            served(0, 0.1, None),
            served(1, 0.2, None),
            served(0, 0.3, None),
            served(1, 0.0, Some("http_500")),
            // Never sent: counted by no replica.
            Outcome {
                failure: Some("concurrency".into()),
                ..Outcome::default()
            },
        ];
        let mut r = summarize("t", "w", &outs, 16, 1.0, 1.0);
        assert!((r.ttft_mean_ms - 200.0).abs() < 1e-9, "{}", r.ttft_mean_ms);
        let urls = ["http://a".to_string(), "http://b".to_string()];
        r.replicas = replicas(&outs, &urls, false, 1.0);
        let counts: Vec<(usize, usize, u64)> = r
            .replicas
            .iter()
            .map(|x| (x.requests, x.failed, x.cached_tokens))
            .collect();
        assert_eq!(counts, [(2, 0, 100), (2, 1, 50)]);
        assert!((r.replicas[0].ttft_mean_ms - 200.0).abs() < 1e-9);
        assert_eq!(r.replicas[1].reuse, 0.5);
        // Two runs: counts add up per replica, the means are averaged.
        let both = combine(vec![r.clone(), r]).unwrap();
        assert_eq!(both.replicas[1].requests, 4);
        assert_eq!(both.replicas[1].failed, 2);
        assert!((both.ttft_mean_ms - 200.0).abs() < 1e-9);
        let t = table(&[both]);
        assert!(t.contains("ttft mean"), "{t}");
        assert!(
            t.contains("replica 1 http://b: 4 requests, 2 failed"),
            "{t}"
        );
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 51.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut [], 50.0), 0.0);
    }
}
