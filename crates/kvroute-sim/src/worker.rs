//! One simulated worker at run time: its DP ranks (an engine and a publisher each), the engine
//! loops that turn simulated step time into wall time, request submission and the fault hooks.
//!
//! Owns: `WorkerConfig` (with the LoRA adapters served, `LoraModule`, and the KV transfer
//! role), `Worker` (start, submit, pause/resume, publisher restart and faults, prefix-cache
//! reset, the true cache state, metrics, the KV leases of a prefill worker), one tokio task
//! per rank, and each running request's span (ended, and so exported, when the engine finishes
//! the request, as vLLM's output processor does).
//! Invariants: a rank steps only while it has work and is not paused; each step's events are
//! published after the step's (scaled) duration has passed, then its tokens are delivered; a
//! request whose receiver is gone is aborted and its blocks freed; simulated time never runs
//! ahead of wall time × speed-up by more than one step.
//! Must not: parse HTTP or know OpenAI shapes (that is `http`).

use crate::disagg::{KvTransfer, Leases};
use crate::engine::{Engine, EngineConfig, NewRequest, TokenOut};
use crate::error::SimError;
use crate::otlp::{OpenSpan, SpanExport, Usage};
use crate::publisher::{Publisher, PublisherConfig, WireFaults};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;

/// How to run one worker.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// The model name served on `/v1/models` and expected in requests (any name is accepted).
    pub model: String,
    pub engine: EngineConfig,
    /// Ranks, each with its own engine, pool and publisher (`port + rank`).
    pub data_parallel_size: u32,
    /// The event publisher (per rank: endpoint port + rank); `None` publishes nothing.
    pub zmq: Option<PublisherConfig>,
    /// Simulated seconds per wall second.
    pub speedup: f64,
    /// The largest request body the HTTP API reads (larger ones get a 413 in vLLM's shape).
    pub max_body_bytes: usize,
    /// LoRA adapters served beside the base model (vLLM's `--lora-modules`), in load order.
    pub lora_modules: Vec<LoraModule>,
    /// Disaggregated serving (vLLM's `--kv-transfer-config`, [`crate::disagg`]).
    pub kv_transfer: Option<KvTransfer>,
    /// Export each request's `llm_request` span to this OTLP/HTTP traces URL (vLLM's
    /// `--otlp-traces-endpoint`, [`crate::otlp`]); `None` exports nothing.
    pub otlp_traces_endpoint: Option<String>,
}

/// One `--lora-modules name=path` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
}

impl std::str::FromStr for LoraModule {
    type Err = String;
    /// `name=path`, or vLLM's JSON form `{"name": …, "path": …}`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim_start().starts_with('{') {
            let v: Value = serde_json::from_str(s).map_err(|e| format!("--lora-modules: {e}"))?;
            let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
            return match (field("name"), field("path")) {
                (Some(name), Some(path)) if !name.is_empty() && !path.is_empty() => {
                    Ok(LoraModule { name, path })
                }
                _ => Err("--lora-modules JSON needs non-empty `name` and `path`".into()),
            };
        }
        match s.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(LoraModule {
                name: name.to_string(),
                path: path.to_string(),
            }),
            _ => Err(format!("--lora-modules {s:?}: expected name=path")),
        }
    }
}

impl WorkerConfig {
    pub fn for_preset(preset: &str) -> Result<WorkerConfig, SimError> {
        Ok(WorkerConfig {
            model: preset.to_string(),
            engine: EngineConfig::for_preset(preset)?,
            data_parallel_size: 1,
            zmq: None,
            speedup: 1.0,
            max_body_bytes: crate::http::MAX_BODY_BYTES,
            lora_modules: Vec::new(),
            kv_transfer: None,
            otlp_traces_endpoint: None,
        })
    }

    /// The adapter a request's `model` names, with vLLM's `lora_int_id` (1, 2, … in load
    /// order); `None` for the base model or any other name.
    pub fn lora(&self, model: &str) -> Option<crate::engine::Lora> {
        let i = self.lora_modules.iter().position(|m| m.name == model)?;
        let m = &self.lora_modules[i];
        Some(crate::engine::Lora {
            name: m.name.clone(),
            path: m.path.clone(),
            id: i as i64 + 1,
        })
    }
}

/// TTFT buckets of vLLM's `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[derive(Clone, Debug, Default)]
pub(crate) struct Histogram {
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; TTFT_BUCKETS.len()];
        }
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

pub(crate) struct Rank {
    pub engine: Mutex<Engine>,
    notify: Notify,
    senders: Mutex<HashMap<u64, mpsc::UnboundedSender<TokenOut>>>,
    /// Each running request's [`prompt_digest`], for its [`FinishedRecord`].
    digests: Mutex<HashMap<u64, u64>>,
    /// Each running request's span, ended when it finishes (exporting only).
    spans: Mutex<HashMap<u64, OpenSpan>>,
    pub publisher: Option<Publisher>,
}

pub(crate) struct Shared {
    pub cfg: WorkerConfig,
    pub ranks: Vec<Rank>,
    paused: AtomicBool,
    stopped: AtomicBool,
    next: AtomicUsize,
    start: Instant,
    pub ttft: Mutex<Histogram>,
    pub e2e: Mutex<Histogram>,
    /// The last [`FINISHED_KEPT`] finished requests, oldest first, and how many finished in all.
    finished: Mutex<(VecDeque<FinishedRecord>, u64)>,
    /// Prefill worker: the KV held for decode workers to pull.
    leases: Leases,
    /// Decode worker: the client its pulls go through.
    client: reqwest::Client,
    /// The trace context each completion request arrived with (`GET /admin/trace_context`).
    pub(crate) trace_contexts: crate::trace_context::TraceContexts,
    /// The engine's span exporter (`otlp_traces_endpoint` set).
    spans: Option<SpanExport>,
}

/// How many finished requests `/admin/requests` keeps.
pub const FINISHED_KEPT: usize = 100_000;

/// One finished request as the engine saw it (`GET /admin/requests`): a load generator in
/// front of any gateway matches its requests to these by prompt digest, so every gateway is
/// measured by the same engine clock, whatever it forwards of the response.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FinishedRecord {
    /// Position among all requests this worker finished (from 0).
    pub seq: u64,
    /// [`prompt_digest`] of the prompt token ids, in hex.
    pub prompt_digest: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub dp_rank: u32,
    pub ttft_s: f64,
    pub e2e_s: f64,
}

/// The digest that names a prompt in [`FinishedRecord`]: xxh3-64 of its token ids as
/// little-endian u32s.
pub fn prompt_digest(tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

impl Shared {
    fn sim_now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * self.cfg.speedup
    }

    fn record_finished(
        &self,
        digest: u64,
        dp_rank: u32,
        cached: usize,
        f: &crate::engine::Finished,
    ) {
        let mut g = self.finished.lock();
        let (kept, total) = &mut *g;
        kept.push_back(FinishedRecord {
            seq: *total,
            prompt_digest: format!("{digest:016x}"),
            prompt_tokens: f.prompt_tokens,
            cached_tokens: cached,
            completion_tokens: f.completion_tokens,
            dp_rank,
            ttft_s: f.ttft_s,
            e2e_s: f.e2e_s,
        });
        *total += 1;
        while kept.len() > FINISHED_KEPT {
            kept.pop_front();
        }
    }
}

/// A request in flight: its tokens arrive on `tokens`.
pub struct Submission {
    pub rank: u32,
    pub handle: u64,
    pub tokens: mpsc::UnboundedReceiver<TokenOut>,
}

/// A running simulated worker. Dropping it stops its engine loops and publishers.
pub struct Worker {
    pub(crate) shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Relaxed);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Worker {
    /// Builds the ranks, binds their publishers and starts their engine loops.
    pub async fn start(cfg: WorkerConfig) -> Result<Worker, SimError> {
        if !(cfg.speedup.is_finite() && cfg.speedup > 0.0) {
            return Err(SimError::Config("the speed-up must be positive".into()));
        }
        let mut ranks = Vec::new();
        for r in 0..cfg.data_parallel_size.max(1) {
            let mut ecfg = cfg.engine.clone();
            ecfg.dp_rank = r;
            let engine = Engine::new(ecfg)?;
            let publisher = match &cfg.zmq {
                Some(p) => {
                    let mut p = p.clone();
                    p.dp_rank = r;
                    Some(Publisher::start(p).await?)
                }
                None => None,
            };
            ranks.push(Rank {
                engine: Mutex::new(engine),
                notify: Notify::new(),
                senders: Mutex::new(HashMap::new()),
                digests: Mutex::new(HashMap::new()),
                spans: Mutex::new(HashMap::new()),
                publisher,
            });
        }
        let spans = cfg.otlp_traces_endpoint.clone().map(SpanExport::start);
        let shared = Arc::new(Shared {
            cfg,
            ranks,
            paused: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            start: Instant::now(),
            ttft: Mutex::new(Histogram::default()),
            e2e: Mutex::new(Histogram::default()),
            finished: Mutex::new((VecDeque::new(), 0)),
            leases: Leases::default(),
            client: reqwest::Client::new(),
            trace_contexts: Default::default(),
            spans,
        });
        let tasks = (0..shared.ranks.len())
            .map(|r| tokio::spawn(run_rank(shared.clone(), r)))
            .collect();
        Ok(Worker { shared, tasks })
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.shared.cfg
    }

    /// The KV this worker holds for decode workers (a prefill worker's).
    pub fn leases(&self) -> &Leases {
        &self.shared.leases
    }

    /// The HTTP client a decode worker pulls KV with.
    pub fn client(&self) -> &reqwest::Client {
        &self.shared.client
    }

    /// Queues a request on the least loaded rank.
    pub fn submit(&self, req: NewRequest) -> Result<Submission, SimError> {
        self.submit_traced(req, None)
    }

    /// The span exporter, when this worker exports (`otlp_traces_endpoint` set).
    pub fn span_export(&self) -> Option<&SpanExport> {
        self.shared.spans.as_ref()
    }

    /// [`Worker::submit`], with the request's span, ended when the engine finishes it.
    pub fn submit_traced(
        &self,
        req: NewRequest,
        span: Option<OpenSpan>,
    ) -> Result<Submission, SimError> {
        if self.shared.stopped.load(Ordering::Relaxed) {
            return Err(SimError::Stopped);
        }
        let n = self.shared.ranks.len();
        let first = self.shared.next.fetch_add(1, Ordering::Relaxed) % n;
        let rank = (0..n)
            .map(|k| (first + k) % n)
            .min_by_key(|r| {
                let e = self.shared.ranks[*r].engine.lock();
                e.num_running() + e.num_waiting()
            })
            .unwrap_or(0);
        let rk = &self.shared.ranks[rank];
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = {
            let mut e = rk.engine.lock();
            let now = self.shared.sim_now();
            e.advance_to(now);
            let digest = prompt_digest(&req.prompt);
            // Mid-step the engine's clock reads the step's end: the request arrived now.
            let h = e.add_request_at(req, now)?;
            rk.senders.lock().insert(h, tx);
            rk.digests.lock().insert(h, digest);
            if let Some(s) = span {
                rk.spans.lock().insert(h, s);
            }
            h
        };
        rk.notify.notify_one();
        Ok(Submission {
            rank: rank as u32,
            handle,
            tokens: rx,
        })
    }

    /// Cancels a request (its blocks are freed).
    pub fn abort(&self, rank: u32, handle: u64) {
        if let Some(rk) = self.shared.ranks.get(rank as usize) {
            rk.digests.lock().remove(&handle);
            rk.spans.lock().remove(&handle);
            rk.engine.lock().abort(handle);
            rk.senders.lock().remove(&handle);
        }
    }

    /// Stops stepping (requests queue up) until `resume`.
    pub fn pause(&self) {
        self.shared.paused.store(true, Ordering::Relaxed);
    }

    pub fn resume(&self) {
        self.shared.paused.store(false, Ordering::Relaxed);
        for rk in &self.shared.ranks {
            rk.notify.notify_one();
        }
    }

    pub fn is_paused(&self) -> bool {
        self.shared.paused.load(Ordering::Relaxed)
    }

    /// Drops the next `n` batches on the wire (they keep their seq and stay replayable) and
    /// delays every batch by `delay_ms`, on every rank.
    pub fn set_faults(&self, drop_batches: Option<u64>, delay_ms: Option<u64>) {
        self.set_wire_faults(&WireFaults {
            drop_batches,
            delay_ms,
            ..WireFaults::default()
        });
    }

    /// Sets the given wire faults on every rank's publisher; `None` leaves one as it is.
    pub fn set_wire_faults(&self, f: &WireFaults) {
        for rk in &self.shared.ranks {
            if let Some(p) = &rk.publisher {
                let k = &p.faults;
                let set = |slot: &AtomicU64, v: Option<u64>| {
                    if let Some(v) = v {
                        slot.store(v, Ordering::Relaxed);
                    }
                };
                set(&k.drop_next, f.drop_batches);
                set(&k.delay_ms, f.delay_ms);
                set(&k.duplicate_next, f.duplicate_batches);
                set(&k.reorder_next, f.reorder_batches);
                if let Some(ms) = f.clock_offset_ms {
                    k.clock_offset_ms.store(ms, Ordering::Relaxed);
                }
                if let Some(g) = f.garbage_replay {
                    k.garbage_replay.store(g, Ordering::Relaxed);
                }
            }
        }
    }

    /// A publisher restart on every rank (seq back to 0). With `clear_cache`, every rank's
    /// engine restarts empty too, silently, as a restarted process would (no
    /// `AllBlocksCleared`); requests in flight are aborted then.
    pub fn restart(&self, clear_cache: bool) -> Result<(), SimError> {
        for rk in &self.shared.ranks {
            if clear_cache {
                let mut e = rk.engine.lock();
                let cfg = e.cfg.clone();
                *e = Engine::new(cfg)?;
                e.advance_to(self.shared.sim_now());
                rk.senders.lock().clear();
            }
            if let Some(p) = &rk.publisher {
                p.restart();
            }
        }
        Ok(())
    }

    /// vLLM's `/reset_prefix_cache`: true when every rank was idle and reset (each publishes
    /// `AllBlocksCleared`).
    pub fn reset_prefix_cache(&self) -> bool {
        let mut all = true;
        for rk in &self.shared.ranks {
            let mut e = rk.engine.lock();
            let ok = e.reset_prefix_cache();
            all &= ok;
            let events = e.take_events();
            if let Some(p) = &rk.publisher {
                p.publish(unix_now(), events);
            }
        }
        all
    }

    /// The PUB and replay ports each rank bound (tcp, bound endpoints only).
    pub fn zmq_ports(&self) -> Vec<(Option<u16>, Option<u16>)> {
        self.shared
            .ranks
            .iter()
            .map(|r| {
                r.publisher
                    .as_ref()
                    .map_or((None, None), |p| (p.port, p.replay_port))
            })
            .collect()
    }

    /// The true cache state: per rank, per group, every cached hash with its copies.
    pub fn cache_state(&self) -> Value {
        let ranks: Vec<Value> = self
            .shared
            .ranks
            .iter()
            .enumerate()
            .map(|(r, rk)| {
                let e = rk.engine.lock();
                let groups: serde_json::Map<String, Value> =
                    e.kv.contents()
                        .into_iter()
                        .map(|(g, hashes)| {
                            let h: serde_json::Map<String, Value> = hashes
                                .into_iter()
                                .map(|(k, n)| (k.to_string(), json!(n)))
                                .collect();
                            (g.to_string(), Value::Object(h))
                        })
                        .collect();
                json!({
                    "dp_rank": r,
                    "layout": e.cfg.spec,
                    "params": e.params,
                    "num_blocks": e.cfg.num_blocks,
                    "free_blocks": e.kv.num_free_blocks(),
                    "usage": e.kv.usage(),
                    "running": e.num_running(),
                    "waiting": e.num_waiting(),
                    "sim_time_s": e.now(),
                    "publisher": rk.publisher.as_ref().map(publisher_state),
                    "groups": groups,
                })
            })
            .collect();
        json!({ "model": self.shared.cfg.model, "paused": self.is_paused(), "ranks": ranks })
    }

    /// Prometheus text with vLLM's metric names.
    /// Finished requests with `seq ≥ since`, oldest first, and how many finished in all.
    pub fn finished_since(&self, since: u64) -> (Vec<FinishedRecord>, u64) {
        let g = self.shared.finished.lock();
        (
            g.0.iter().filter(|r| r.seq >= since).cloned().collect(),
            g.1,
        )
    }

    /// The trace contexts the last completion requests arrived with.
    pub fn trace_contexts(&self) -> &crate::trace_context::TraceContexts {
        &self.shared.trace_contexts
    }

    pub fn metrics_text(&self) -> String {
        crate::metrics::render(&self.shared)
    }
}

/// What one rank's publisher has done: batches sent, injected drops, the seq of the next batch
/// (`next_seq`: a subscriber that applied every earlier one is level) and, for a connected
/// endpoint, whether a subscriber is connected and what nobody took.
fn publisher_state(p: &Publisher) -> Value {
    let f = &p.faults;
    let mut v = json!({
        "published": f.published.load(Ordering::Relaxed),
        "fault_dropped": f.dropped.load(Ordering::Relaxed),
        "next_seq": f.queued.load(Ordering::Relaxed),
    });
    if let Some(c) = &f.connection {
        v["connected"] = json!(c.connected.load(Ordering::Relaxed));
        v["connects"] = json!(c.connects.load(Ordering::Relaxed));
        v["sent"] = json!(c.sent.load(Ordering::Relaxed));
        v["undelivered"] = json!(c.undelivered.load(Ordering::Relaxed));
    }
    v
}

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn run_rank(shared: Arc<Shared>, r: usize) {
    let rank = &shared.ranks[r];
    loop {
        if shared.stopped.load(Ordering::Relaxed) {
            return;
        }
        let wake = rank.notify.notified();
        let ready = !shared.paused.load(Ordering::Relaxed) && rank.engine.lock().has_work();
        if !ready {
            let _ = tokio::time::timeout(Duration::from_millis(200), wake).await;
            continue;
        }
        let out = {
            let mut e = rank.engine.lock();
            e.advance_to(shared.sim_now());
            e.step()
        };
        if out.scheduled_tokens == 0 {
            // Nothing fits right now (pool full, Mamba deferral, KV still being pulled): do
            // not spin; wake when a pull completes, or in 5 ms.
            if let Some(p) = &rank.publisher {
                p.publish(unix_now(), out.events);
            }
            let pull = {
                let e = rank.engine.lock();
                e.next_ready_at()
                    .map(|t| (t - e.now()) / shared.cfg.speedup)
            };
            let wait = pull.map_or(0.005, |s| s.clamp(0.000_05, 0.005));
            let _ = tokio::time::timeout(Duration::from_secs_f64(wait), wake).await;
            continue;
        }
        let wall = out.duration_s / shared.cfg.speedup;
        if wall >= 0.0005 {
            tokio::time::sleep(Duration::from_secs_f64(wall)).await;
        } else {
            tokio::task::yield_now().await;
        }
        if let Some(p) = &rank.publisher {
            p.publish(unix_now(), out.events);
        }
        for t in out.tokens {
            if let Some(f) = &t.finished {
                shared.ttft.lock().observe(f.ttft_s);
                shared.e2e.lock().observe(f.e2e_s);
                let digest = rank.digests.lock().remove(&t.handle).unwrap_or(0);
                shared.record_finished(digest, r as u32, t.num_cached_tokens, f);
                if let Some(s) = rank.spans.lock().remove(&t.handle) {
                    s.finish(&Usage {
                        prompt_tokens: f.prompt_tokens,
                        completion_tokens: f.completion_tokens,
                        ttft_s: f.ttft_s,
                        e2e_s: f.e2e_s,
                    });
                }
            }
            let done = t.finished.is_some();
            let handle = t.handle;
            let mut senders = rank.senders.lock();
            let gone = senders.get(&handle).is_some_and(|s| s.send(t).is_err());
            if done || gone {
                senders.remove(&handle);
            }
            drop(senders);
            if gone && !done {
                rank.digests.lock().remove(&handle);
                rank.spans.lock().remove(&handle);
                rank.engine.lock().abort(handle);
            }
        }
    }
}
