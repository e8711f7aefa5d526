//! `kvroute bench` over real sockets: its figures equal hand-computed ones against a simulated
//! worker, it keeps the arrival schedule against a target that answers only once every
//! request is in flight (an open loop), and it counts every failure
//! class; multi-turn sessions send the reply back and reuse it; a target's replicas — gateways
//! the command starts on one fleet, or URLs joined by `+` — share the requests as the balancer
//! says, per request, and the report counts what each served.

use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use kvroute::bench::balance::{Balance, Balancer};
use kvroute::bench::client::{drive, Api, ClientOptions, PromptFormat};
use kvroute::bench::workload::{Session, Turn, Workload};
use kvroute::bench::{report, BenchOptions, Target};
use kvroute_sim::tokens::FIRST_WORD;
use std::sync::Arc;
use std::time::Duration;

fn options(url: &str) -> ClientOptions {
    ClientOptions {
        urls: vec![url.to_string()],
        balance: Balance::RoundRobin,
        seed: 1,
        model: "m".into(),
        api: Api::Completions,
        format: PromptFormat::Tokens,
        vocab: 32_000,
        speedup: 1.0,
        max_concurrency: None,
        max_requests: None,
        duration: None,
        request_timeout: Duration::from_secs(10),
        explain: false,
    }
}

fn single(start_ms: f64, user: Vec<u32>) -> Session {
    Session {
        start_ms,
        system: Vec::new(),
        turns: vec![Turn {
            user,
            max_tokens: 4,
            think_ms: 0.0,
            branches: Vec::new(),
        }],
    }
}

async fn sim_worker(preset: &str) -> kvroute_sim::Fleet {
    let mut cfg = kvroute_sim::WorkerConfig::for_preset(preset).unwrap();
    cfg.speedup = 100.0;
    kvroute_sim::Fleet::start(kvroute_sim::FleetOptions::new(cfg, 1))
        .await
        .unwrap()
}

/// Three requests of a Mooncake trace in `dir`: 32 tokens per block id (llama hashes 16-token
/// blocks), the second and third sharing the first's two blocks.
fn tiny_trace(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let trace = dir.join("tiny.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 2, \"hash_ids\": [7, 8]}\n\
         {\"timestamp\": 400, \"input_length\": 1536, \"output_length\": 2, \"hash_ids\": [7, 8, 9]}\n\
         {\"timestamp\": 800, \"input_length\": 1024, \"output_length\": 2, \"hash_ids\": [7, 8]}\n",
    )
    .unwrap();
    trace
}

#[tokio::test]
async fn the_report_equals_hand_computed_figures_on_a_tiny_trace() {
    let sims = sim_worker("llama").await;
    let dir = std::env::temp_dir().join(format!("kvroute-bench-{}", std::process::id()));
    let trace = tiny_trace(&dir);
    let json = dir.join("out.json");
    let opts = BenchOptions {
        targets: vec![Target::Url(sims.workers[0].base_url.clone())],
        model: Some("llama".into()),
        trace: Some(trace),
        tokens_per_block: 32,
        block_size: Some(16),
        json: Some(json.clone()),
        progress: false,
        ..BenchOptions::default()
    };
    let reports = kvroute::bench::run(opts).await.unwrap();
    let r = &reports[0];
    assert_eq!((r.requests, r.failed), (3, 0));
    // 64, 96 and 64 prompt tokens; the second reuses both 32-token blocks (64), the third
    // reuses 48 (a hit stops below the last prompt token, at a 16-token block).
    assert_eq!((r.prompt_tokens, r.cached_tokens), (224, 112));
    assert_eq!(r.reuse, 0.5);
    assert_eq!(r.oracle_reuse, 0.5);
    assert_eq!(r.oracle_share, 1.0);
    assert_eq!(r.ttft_source, "engine");
    assert!(r.ttft_p50_ms > 0.0 && r.ttft_p99_ms >= r.ttft_p50_ms);
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let t = &doc["targets"][0];
    for key in [
        "requests",
        "failed",
        "reuse",
        "oracle_reuse",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "throughput_rps",
    ] {
        assert!(t.get(key).is_some(), "the JSON has {key}");
    }
    assert_eq!(t["cached_tokens"], 112);
}

/// A target that holds every request until `n` requests are in flight at once, then answers
/// each with one streamed token; a request still held after 30 s gets a 500 instead (so a
/// client that waits for each answer before sending the next fails instead of hanging).
async fn target_answering_when_all_arrived(n: usize) -> String {
    let all_in = Arc::new(tokio::sync::Barrier::new(n));
    let app = axum::Router::new().route(
        "/v1/completions",
        post(move || {
            let all_in = all_in.clone();
            async move {
                if tokio::time::timeout(Duration::from_secs(30), all_in.wait())
                    .await
                    .is_err()
                {
                    return Response::builder()
                        .status(500)
                        .body(Body::from("the other requests never arrived"))
                        .unwrap();
                }
                let body = "data: {\"choices\":[{\"text\":\" ba\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n";
                Response::new(Body::from(body))
            }
        }),
    );
    serve(app).await
}

async fn serve(app: axum::Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn arrivals_keep_the_schedule_when_the_target_is_slow() {
    // The target answers nobody until all six requests are in flight: only an open loop, which
    // sends each request at its time whatever the earlier ones are doing, gets any answer. No
    // wall-clock bound decides this; the one timing check left is that no request leaves
    // before its scheduled time, which a working scheduler never does however slow the machine.
    let url = target_answering_when_all_arrived(6).await;
    let w = Workload {
        name: "t".into(),
        sessions: (0..6)
            .map(|i| single(i as f64 * 100.0, vec![FIRST_WORD; 3]))
            .collect(),
    };
    let mut o = options(&url);
    o.request_timeout = Duration::from_secs(60);
    let (outs, _) = drive(&w, o, indicatif::ProgressBar::hidden()).await;
    assert_eq!(outs.len(), 6);
    let failures: Vec<_> = outs.iter().filter_map(|o| o.failure.as_deref()).collect();
    assert!(
        failures.is_empty(),
        "all six were never in flight together: {failures:?}"
    );
    let mut sent: Vec<(usize, f64)> = outs.iter().map(|o| (o.session, o.sent_at_s)).collect();
    sent.sort_by_key(|s| s.0);
    for (i, at) in sent {
        let want = i as f64 * 0.1;
        assert!(
            at >= want - 1e-3,
            "request {i} sent at {at:.3}s, before its time {want:.3}s"
        );
    }
}

/// Answers by the prompt's first token: 0 → 500, 1 → 429, 2 → half a stream, 3 → hangs,
/// 4 → a stream without `[DONE]`, else a good stream.
async fn faulty_target() -> String {
    let app = axum::Router::new().route(
        "/v1/completions",
        post(|body: Bytes| async move {
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let first = (v["prompt"][0].as_u64().unwrap_or(0) as u32).wrapping_sub(FIRST_WORD);
            let good = "data: {\"choices\":[{\"text\":\" ba\"}]}\n\ndata: [DONE]\n\n";
            match first {
                0 => Response::builder()
                    .status(500)
                    .body(Body::from("{}"))
                    .unwrap(),
                1 => Response::builder()
                    .status(429)
                    .body(Body::from("{}"))
                    .unwrap(),
                2 => {
                    // One chunk, then the worker dies mid-stream.
                    let s = futures_util::stream::unfold(0, |k| async move {
                        match k {
                            0 => Some((
                                Ok(Bytes::from_static(
                                    b"data: {\"choices\":[{\"text\":\" ba\"}]}\n\n",
                                )),
                                1,
                            )),
                            1 => {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                Some((Err(std::io::Error::other("worker died")), 2))
                            }
                            _ => None,
                        }
                    });
                    Response::new(Body::from_stream(s))
                }
                3 => {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Response::new(Body::from(good))
                }
                4 => Response::new(Body::from("data: {\"choices\":[{\"text\":\" ba\"}]}\n\n")),
                _ => Response::new(Body::from(good)),
            }
        }),
    );
    serve(app).await
}

#[tokio::test]
async fn every_failure_class_is_counted() {
    let url = faulty_target().await;
    let w = Workload {
        name: "faults".into(),
        sessions: (0..6)
            .map(|k| single(0.0, vec![FIRST_WORD + k, FIRST_WORD]))
            .collect(),
    };
    let mut o = options(&url);
    o.request_timeout = Duration::from_millis(800);
    let (outs, wall) = drive(&w, o, indicatif::ProgressBar::hidden()).await;
    let r = report::summarize("faulty", "faults", &outs, 16, wall, 1.0);
    assert_eq!(r.requests, 6);
    assert_eq!(r.failed, 5);
    let want: Vec<(&str, usize)> = vec![
        ("http_429", 1),
        ("http_500", 1),
        ("incomplete", 1),
        ("stream", 1),
        ("timeout", 1),
    ];
    let got: Vec<(&str, usize)> = r.failures.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(got, want);
    // Nobody listening at all.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let w1 = Workload {
        name: "c".into(),
        sessions: vec![single(0.0, vec![FIRST_WORD + 5])],
    };
    let (outs, _) = drive(&w1, options(&closed), indicatif::ProgressBar::hidden()).await;
    assert_eq!(outs[0].failure.as_deref(), Some("connect"));
}

#[tokio::test]
async fn a_multi_turn_session_sends_its_replies_back_and_reuses_them() {
    let sims = sim_worker("llama").await;
    let turn = |user: Vec<u32>| Turn {
        user,
        max_tokens: 8,
        think_ms: 50.0,
        branches: Vec::new(),
    };
    let w = Workload {
        name: "mt".into(),
        sessions: vec![Session {
            start_ms: 0.0,
            system: (0..40).map(|i| FIRST_WORD + i).collect(),
            turns: vec![
                turn((100..140).map(|i| FIRST_WORD + i).collect()),
                turn((200..230).map(|i| FIRST_WORD + i).collect()),
                turn((300..310).map(|i| FIRST_WORD + i).collect()),
            ],
        }],
    };
    for (api, format) in [
        (Api::Completions, PromptFormat::Tokens),
        (Api::Completions, PromptFormat::Text),
        (Api::Chat, PromptFormat::Text),
    ] {
        sims.workers[0].worker.reset_prefix_cache();
        let base = sims.workers[0].base_url.clone();
        let mut o = options(&base);
        o.api = api;
        o.format = format;
        o.vocab = kvroute_sim::preset("llama").unwrap().vocab_size;
        let marks = kvroute::bench::engine::marks(std::slice::from_ref(&base))
            .await
            .unwrap();
        let (mut outs, _) = drive(&w, o, indicatif::ProgressBar::hidden()).await;
        // Every prompt's token view is exactly what the engine tokenized.
        let matched = kvroute::bench::engine::attach(&[base], &marks, &mut outs)
            .await
            .unwrap();
        assert_eq!(matched, 3, "{api:?} {format:?}");
        outs.sort_by_key(|o| o.turn);
        assert_eq!(outs.len(), 3, "{api:?} {format:?}");
        for (k, o) in outs.iter().enumerate() {
            assert!(
                o.failure.is_none(),
                "{api:?} {format:?} turn {k}: {:?}",
                o.failure
            );
            assert_eq!(
                o.prompt_tokens as usize,
                o.tokens.len(),
                "the engine saw the prompt we meant"
            );
        }
        // Each turn's prompt starts with the previous prompt and its reply.
        for k in 1..3 {
            let prev = &outs[k - 1];
            assert!(outs[k].tokens.len() > prev.tokens.len() + 8);
            let cached = outs[k].cached_tokens.unwrap();
            let whole = (prev.tokens.len() as u64) / 16 * 16;
            assert!(
                cached >= whole,
                "{api:?} {format:?} turn {k} reused {cached} of the previous {whole}"
            );
        }
    }
}

/// A gateway that forwards to `upstream` but passes on only the streamed text (no usage, no
/// engine extension), as some routers re-serialise responses.
async fn stripping_proxy(upstream: String) -> String {
    let app = axum::Router::new().route(
        "/v1/completions",
        post(move |body: Bytes| {
            let upstream = upstream.clone();
            async move {
                let r = reqwest::Client::new()
                    .post(format!("{upstream}/v1/completions"))
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let text = r.text().await.unwrap();
                let mut out = String::new();
                for line in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
                    if line == "[DONE]" {
                        out.push_str("data: [DONE]\n\n");
                    } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                        let t = v["choices"][0]["text"].as_str().unwrap_or_default();
                        out.push_str(&format!(
                            "data: {}\n\n",
                            serde_json::json!({"choices": [{"text": t}]})
                        ));
                    }
                }
                Response::new(Body::from(out))
            }
        }),
    );
    serve(app).await
}

#[tokio::test]
async fn a_gateway_that_strips_usage_is_still_measured_by_the_engine() {
    let sims = sim_worker("llama").await;
    let base = sims.workers[0].base_url.clone();
    let proxy = stripping_proxy(base.clone()).await;
    let prompt: Vec<u32> = (0..48).map(|i| FIRST_WORD + i).collect();
    let w = Workload {
        name: "strip".into(),
        sessions: vec![single(0.0, prompt.clone()), single(300.0, prompt)],
    };
    let marks = kvroute::bench::engine::marks(std::slice::from_ref(&base))
        .await
        .unwrap();
    let (mut outs, wall) = drive(&w, options(&proxy), indicatif::ProgressBar::hidden()).await;
    assert!(outs
        .iter()
        .all(|o| o.cached_tokens.is_none() && o.engine_ttft_s.is_none()));
    let matched = kvroute::bench::engine::attach(&[base], &marks, &mut outs)
        .await
        .unwrap();
    assert_eq!(matched, 2);
    let r = report::summarize("strip", "strip", &outs, 16, wall, 1.0);
    assert_eq!(
        r.per_worker.get(&sims.workers[0].base_url),
        Some(&2),
        "filed under its engine"
    );
    assert_eq!(r.ttft_source, "engine");
    // The second request reuses the first's two full blocks below its last token.
    assert_eq!((r.prompt_tokens, r.cached_tokens), (96, 32));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_layout_is_benched_beside_the_aggregated_fleet_on_one_clock() {
    // The hand-computed trace of the first test: 224 prompt tokens, 112 of them reusable.
    let trace =
        tiny_trace(&std::env::temp_dir().join(format!("kvroute-bench-pd-{}", std::process::id())));
    let opts = BenchOptions {
        targets: vec![
            Target::parse("kvroute:hybrid-aware").unwrap(),
            Target::parse("kvroute:hybrid-aware/1p1d").unwrap(),
        ],
        fleet: Some(kvroute::bench::FleetSpec::parse("llama,2,0").unwrap()),
        trace: Some(trace),
        tokens_per_block: 32,
        block_size: Some(16),
        speedup: 10.0,
        progress: false,
        ..BenchOptions::default()
    };
    let reports = kvroute::bench::run(opts).await.unwrap();
    assert_eq!(reports.len(), 2);
    for r in &reports {
        assert_eq!((r.requests, r.failed), (3, 0), "{}", r.target);
        // One clock for the table: the decode engine's own TTFT would leave out the prefill leg.
        assert_eq!(r.ttft_source, "client", "{}", r.target);
        assert!(r.ttft_p50_ms > 0.0, "{}", r.target);
    }
    let pd = &reports[1];
    assert_eq!(pd.target, "kvroute:hybrid-aware/1p1d");
    // Every prompt is computed on the one prefill worker, whose hits the decode worker reports.
    assert_eq!((pd.prompt_tokens, pd.cached_tokens), (224, 112));
    assert!(
        !pd.per_worker.is_empty() && pd.per_worker.keys().all(|w| w.starts_with('d')),
        "the decode worker answers: {:?}",
        pd.per_worker
    );
    // A layout that does not add up to the fleet is refused before anything starts.
    let wrong = BenchOptions {
        targets: vec![Target::parse("kvroute:hybrid-aware/2p2d").unwrap()],
        fleet: Some(kvroute::bench::FleetSpec::parse("llama,2,0").unwrap()),
        workload: Some("shared-prefix".into()),
        progress: false,
        ..BenchOptions::default()
    };
    let err = kvroute::bench::run(wrong).await.unwrap_err().to_string();
    assert!(err.contains("2p2d"), "{err}");
}

/// The requests log's lines as JSON.
fn log_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateway_replicas_on_one_fleet_share_every_request_round_robin() {
    let dir = std::env::temp_dir().join(format!("kvroute-bench-rep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, log) = (dir.join("out.json"), dir.join("requests.jsonl"));
    let opts = BenchOptions {
        targets: vec![Target::parse("kvroute:hybrid-aware").unwrap()],
        replicas: 3,
        fleet: Some(kvroute::bench::FleetSpec::parse("llama,2,0").unwrap()),
        workload: Some("multi-turn".into()),
        sessions: Some(4),
        rate: Some(8.0),
        speedup: 20.0,
        max_output: 8,
        json: Some(json.clone()),
        requests_log: Some(log.clone()),
        progress: false,
        ..BenchOptions::default()
    };
    // The workload the command builds: llama's length less the output and its margin.
    let shape = kvroute::bench::workload::Shape {
        vocab: kvroute_sim::preset("llama").unwrap().vocab_size,
        max_prompt: kvroute_sim::preset("llama").unwrap().max_model_len as usize - 16,
        max_output: 8,
        seed: 1,
    };
    let n = kvroute::bench::workload::build(Some("multi-turn"), None, 512, Some(4), &shape)
        .unwrap()
        .requests();
    let reports = kvroute::bench::run(opts).await.unwrap();
    let r = &reports[0];
    assert_eq!((r.requests, r.failed), (n, 0), "every request answered");
    let counts: Vec<usize> = r.replicas.iter().map(|x| x.requests).collect();
    assert_eq!(counts.len(), 3);
    assert_eq!(counts.iter().sum::<usize>(), n);
    for c in &counts {
        assert!(
            *c == n / 3 || *c == n.div_ceil(3),
            "{counts:?} of {n}: round robin gives each ⌊n/3⌋ or ⌈n/3⌉"
        );
    }
    assert!(r.replicas.iter().all(|x| x.failed == 0));
    assert!(r.ttft_mean_ms > 0.0);
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let t = &doc["targets"][0];
    assert!(
        t["ttft_mean_ms"].as_f64().unwrap() > 0.0,
        "the JSON has the mean TTFT"
    );
    assert_eq!(t["replicas"].as_array().unwrap().len(), 3);
    assert_eq!(t["replicas"][1]["requests"], counts[1]);
    assert_eq!(doc["balance"], "round-robin");
    // Balanced per request, not per session: some conversation's turns met several replicas.
    let mut seen: std::collections::HashMap<u64, std::collections::HashSet<u64>> =
        Default::default();
    for l in log_lines(&log) {
        let (session, replica) = (
            l["session"].as_u64().unwrap(),
            l["replica"].as_u64().unwrap(),
        );
        seen.entry(session).or_default().insert(replica);
    }
    assert!(seen.values().any(|r| r.len() > 1), "{seen:?}");
}

/// The value a Prometheus text exposition gives `name`, summed over its labels.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_target_naming_three_replicas_is_balanced_at_random_by_the_seed() {
    // Three separate gateways in front of one simulated fleet, as three kvroute processes.
    let shape = kvroute::simfleet::FleetShape {
        preset: "llama".into(),
        workers: 2,
        blocks: 0,
        speedup: 20.0,
        pd: None,
    };
    let weights = kvroute::gateway::config::PolicyWeights {
        cost: kvroute::gateway::config::CostModel::Tokens,
        ..Default::default()
    };
    let gws = kvroute::simfleet::start_replicas(
        &shape,
        kvroute_route::PolicyKind::HybridAware,
        weights,
        3,
        kvroute::simfleet::Sharing::Learning,
    )
    .await
    .unwrap();
    let target = gws.urls.join("+");
    let seed = 9;
    let opts = BenchOptions {
        targets: vec![Target::parse(&target).unwrap()],
        balance: Balance::Random,
        seed,
        model: Some("llama".into()),
        workload: Some("tenants".into()),
        sessions: Some(24),
        max_prompt: Some(4000),
        rate: Some(40.0),
        speedup: 20.0,
        time_scale: 20.0,
        max_output: 4,
        progress: false,
        ..BenchOptions::default()
    };
    let r = kvroute::bench::run(opts).await.unwrap().remove(0);
    assert_eq!((r.requests, r.failed), (24, 0));
    assert_eq!(r.target, target);
    // Random picks depend on the seed alone: the run's first 24 picks, whatever their order.
    let b = Balancer::new(Balance::Random, 3, seed);
    let mut want = [0; 3];
    for _ in 0..24 {
        want[b.pick()] += 1;
    }
    let got: Vec<usize> = r.replicas.iter().map(|x| x.requests).collect();
    assert_eq!(got, want);
    // And each gateway decided exactly the requests the report files under it.
    let client = reqwest::Client::new();
    for (x, url) in r.replicas.iter().zip(&gws.urls) {
        assert_eq!(&x.url, url);
        let text = client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(
            metric_sum(&text, "kvroute_decisions_total") as usize,
            x.requests,
            "{url}"
        );
    }
    gws.stop().await;
    // One URL is one replica: --replicas cannot multiply it.
    let one = BenchOptions {
        targets: vec![Target::parse("http://127.0.0.1:9").unwrap()],
        replicas: 3,
        progress: false,
        ..BenchOptions::default()
    };
    let err = kvroute::bench::run(one).await.unwrap_err().to_string();
    assert!(err.contains("--replicas 3") && err.contains('+'), "{err}");
}
