//! `/metrics`: Prometheus text with vLLM's metric names, summed over a worker's ranks.
//!
//! Owns: the exposition of `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`,
//! `vllm:prefix_cache_hits_total`, `vllm:external_prefix_cache_hits_total` (the CPU tier's
//! loads), `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
//! `vllm:generation_tokens_total` and the `vllm:time_to_first_token_seconds` /
//! `vllm:e2e_request_latency_seconds` histograms (simulated seconds).
//! Invariants: counters are written with the `_total` suffix as Python's prometheus_client
//! writes vLLM's counters; every series carries `model_name` and `engine` (the DP rank).
//! Must not: change any state.

use crate::worker::{Histogram, Shared, TTFT_BUCKETS};
use std::fmt::Write as _;

fn histogram(out: &mut String, name: &str, help: &str, model: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (i, b) in TTFT_BUCKETS.iter().enumerate() {
        let c = h.counts.get(i).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "{name}_bucket{{engine=\"0\",le=\"{b}\",model_name=\"{model}\"}} {c}"
        );
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{model}\"}} {}",
        h.count
    );
    let _ = writeln!(
        out,
        "{name}_count{{engine=\"0\",model_name=\"{model}\"}} {}",
        h.count
    );
    let _ = writeln!(
        out,
        "{name}_sum{{engine=\"0\",model_name=\"{model}\"}} {}",
        h.sum
    );
}

pub(crate) fn render(shared: &Shared) -> String {
    let model = shared.cfg.model.replace('"', "");
    let mut out = String::new();
    let mut rows: Vec<[f64; 9]> = Vec::new();
    for rk in &shared.ranks {
        let e = rk.engine.lock();
        rows.push([
            e.num_running() as f64,
            e.num_waiting() as f64,
            e.kv.usage(),
            e.stats.prefix_cache_queries as f64,
            e.stats.prefix_cache_hits as f64,
            e.stats.tier_hits as f64,
            e.stats.preemptions as f64,
            e.stats.prompt_tokens as f64,
            e.stats.generation_tokens as f64,
        ]);
    }
    let series: [(&str, &str, &str); 9] = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
        ),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
        ),
        (
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "Prompt tokens served by the KV connector (the CPU tier).",
        ),
        (
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
        ),
    ];
    for (k, (name, kind, help)) in series.iter().enumerate() {
        let base = name.trim_end_matches("_total");
        let _ = writeln!(out, "# HELP {base} {help}\n# TYPE {base} {kind}");
        for (r, row) in rows.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}{{engine=\"{r}\",model_name=\"{model}\"}} {}",
                row[k]
            );
        }
    }
    histogram(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds (simulated).",
        &model,
        &shared.ttft.lock(),
    );
    histogram(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds (simulated).",
        &model,
        &shared.e2e.lock(),
    );
    out
}
