//! The worker registry: who is behind the gateway, whether they are healthy, how loaded.
//!
//! Owns: per worker its spec, health (with backoff), drain flag, the gateway's own load
//! accounting (in-flight requests, queued prefill tokens — the bookings, less what the engine
//! has worked off since at the worker's learned prefill rate; its readings and the request's
//! guard are [`load`]'s), its learners ([`super::learners`]), the engine's reported queue from
//! its `/metrics`, its engine generation (configured, or detected from its `/version`, which then
//! re-configures the worker in the index), the LoRA adapters it serves (configured, and as its
//! `/v1/models` lists them), and its event subscriptions (one per DP rank) feeding the shared
//! index.
//! Invariants: adding a worker starts its subscriptions; removing it stops them and drops its
//! index state; load counters never underflow (guards release exactly what they took); a
//! request for an adapter is keyed `(name, path)` with the path its workers' engines were
//! given, and goes only to workers serving the adapter from that path.
//! Must not: choose workers (policy does) or proxy requests.

use super::arrivals::LeastLoaded;
use super::config::WorkerSpec;
use super::conversations::TurnStats;
use super::decoding::{DecodeModel, OutputTokens};
use super::engine_load::EngineLoad;
use super::eviction::EvictionView;
use super::intake::RankSink;
use super::learners::Learners;
use super::pending::Pending;
use super::sessions::FollowUps;
use super::ttft::TtftModel;
use kvroute_index::{Engine, Index, RankImage, WorkerId};
use kvroute_wire::{
    spawn_subscription, Dialect, EventSink, StreamPosition, SubscriptionConfig, SubscriptionHandle,
    WireStats,
};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker's load readings and the guard a request in flight holds.
pub mod load;

/// Worker-side request failures in a row that eject a worker.
pub const EJECT_AFTER: u32 = 3;

pub struct Worker {
    pub spec: WorkerSpec,
    pub id: WorkerId,
    pub healthy: AtomicBool,
    pub draining: AtomicBool,
    pub in_flight: AtomicU64,
    pub queued_prefill: AtomicU64,
    /// Every prefill token this gateway has booked here, ever (a running total: the prefill
    /// sent here between two moments is the difference of two readings).
    pub booked_total: AtomicU64,
    /// Every request this gateway has booked here, ever (a running total).
    pub bookings_total: AtomicU64,
    /// This gateway's requests here whose first byte has not come back yet.
    pub prefilling: AtomicU64,
    /// Mean prefill tokens this gateway booked per request here, and the bookings it has
    /// seen: the mean of the first [`MEAN_PREFILL_WINDOW`] bookings, then each newest one
    /// weighs 1/[`MEAN_PREFILL_WINDOW`] ([`Worker::mean_prefill`]).
    mean_prefill: Mutex<(f64, u64)>,
    /// The booked prefill as the engine works it off: (tokens left, as of when), drained at
    /// the worker's learned marginal prefill cost ([`Worker::set_prefill_ms_per_token`]).
    pub backlog: Mutex<(f64, Instant)>,
    /// The worker's marginal prefill cost in ms a token (f64 bits; 0: not known yet).
    pub prefill_ms_per_token: AtomicU64,
    /// The engine's own figures from its `/metrics` ([`super::engine_load`], polled by
    /// [`super::engine_poll`]).
    pub engine_load: Mutex<EngineLoad>,
    pub consecutive_failures: AtomicU32,
    /// Requests in a row the worker failed (5xx, timeouts, broken answers); at
    /// [`EJECT_AFTER`] it is ejected like a failed health check.
    pub request_failures: AtomicU32,
    pub next_check: Mutex<Instant>,
    pub subscriptions: Mutex<Vec<SubscriptionHandle>>,
    /// One event intake per DP rank (what a snapshot captures and readiness waits for).
    pub sinks: Mutex<Vec<Arc<RankSink>>>,
    /// Which engine generation predicts this worker, and why.
    pub engine: Mutex<EngineInfo>,
    /// Prompts in flight on this worker (what it is about to cache).
    pub pending: Pending,
    /// What the gateway has learned about this worker (its TTFT and decode models, live
    /// conversations, request rate, re-prefill rate): plain estimators under this one lock,
    /// so a decision reads them all at once ([`super::learners`]).
    pub learners: Mutex<Learners>,
    /// LoRA adapters served beside the base model: name → path (the spec's, then as the
    /// worker's `/v1/models` lists them).
    pub adapters: RwLock<BTreeMap<String, String>>,
}

/// The engine generation a worker is predicted by, where that came from, and what the worker's
/// `GET /version` answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineInfo {
    pub engine: Engine,
    pub source: EngineSource,
    /// The `version` of the worker's `GET /version`, once it answered.
    pub version: Option<String>,
    /// `/version` was asked and answered (or refused for good): not asked again.
    #[serde(skip)]
    pub asked: bool,
}

/// Where a worker's engine generation came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineSource {
    /// The spec's `engine`.
    Configured,
    /// The worker's `GET /version`.
    Detected,
    /// vLLM 0.32's rules: `/version` has not named a supported release (yet).
    Assumed,
}

#[derive(Clone, Debug, Serialize)]
pub struct WorkerView {
    pub name: String,
    pub url: String,
    pub model: String,
    pub role: super::config::Role,
    pub healthy: bool,
    pub draining: bool,
    pub in_flight: u64,
    pub queued_prefill_tokens: u64,
    /// Prompts recorded in flight for the hybrid-aware forecast.
    pub in_flight_prompts: usize,
    /// The engine's own figures (`/metrics`) and how many polls read or failed.
    pub engine_load: EngineLoad,
    /// Requests running or waiting here from every sender, as decisions count them.
    pub running_estimate: u64,
    pub dp_size: u32,
    pub subscriptions: usize,
    /// Per subscribed DP rank: the seq after the last event batch the index applied (0 before
    /// any), to compare with the engine's own count of batches.
    pub events_next_seq: Vec<u64>,
    /// The engine generation predictions follow (`vllm-0.32`, `vllm-0.33`).
    pub engine: Engine,
    pub engine_source: EngineSource,
    /// What the worker's `GET /version` answered.
    pub engine_version: Option<String>,
    /// The lookahead tokens its block hashes cover (vLLM 0.33's `num_hash_lookahead_tokens`).
    pub hash_lookahead_tokens: u32,
    /// Whether its matches drop the EAGLE block.
    pub eagle_drop: bool,
    /// LoRA adapters it serves: name → path.
    pub adapters: BTreeMap<String, String>,
    /// The worker's learned TTFT model.
    pub ttft_model: super::ttft::TtftView,
    pub decode_model: super::decoding::DecodeView,
    /// Its re-prefill rate ([`super::eviction`]).
    pub eviction_model: EvictionView,
}

impl Worker {
    fn new(spec: WorkerSpec) -> Worker {
        let engine = Mutex::new(EngineInfo {
            engine: spec.engine.unwrap_or_default(),
            source: if spec.engine.is_some() {
                EngineSource::Configured
            } else {
                EngineSource::Assumed
            },
            version: None,
            asked: false,
        });
        Worker {
            id: spec.name.as_str().into(),
            engine,
            adapters: RwLock::new(spec.lora_modules.clone()),
            spec,
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
            queued_prefill: AtomicU64::new(0),
            booked_total: AtomicU64::new(0),
            bookings_total: AtomicU64::new(0),
            prefilling: AtomicU64::new(0),
            mean_prefill: Mutex::new((0.0, 0)),
            backlog: Mutex::new((0.0, Instant::now())),
            prefill_ms_per_token: AtomicU64::new(0),
            engine_load: Mutex::new(EngineLoad::default()),
            consecutive_failures: AtomicU32::new(0),
            request_failures: AtomicU32::new(0),
            next_check: Mutex::new(Instant::now()),
            subscriptions: Mutex::new(Vec::new()),
            sinks: Mutex::new(Vec::new()),
            pending: Pending::default(),
            learners: Mutex::new(Learners::default()),
        }
    }

    /// Whether requests for `model` may go here: the base model or one of its adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.spec.model == model || self.adapters.read().contains_key(model)
    }

    /// The path the worker serves adapter `name` from.
    pub fn adapter_path(&self, name: &str) -> Option<String> {
        self.adapters.read().get(name).cloned()
    }

    /// Records the adapters the worker's `/v1/models` lists (name → path): they add to and
    /// override the configured ones (the engine's path is the one it hashes with).
    pub fn adapters_listed(&self, listed: BTreeMap<String, String>) {
        let mut all = self.spec.lora_modules.clone();
        all.extend(listed);
        let mut current = self.adapters.write();
        if *current != all {
            tracing::info!(worker = %self.spec.name, adapters = ?all, "LoRA adapters");
            *current = all;
        }
    }

    pub fn routable(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }

    /// A request failed on the worker's side (5xx, a timeout, a reset or broken answer);
    /// returns whether that ejected it: [`EJECT_AFTER`] in a row make it unhealthy until the
    /// health check, after its backoff, finds it answering again. Client errors (4xx) are not
    /// the worker's failures and must not be reported here.
    pub fn request_failed(&self) -> bool {
        let n = self.request_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= EJECT_AFTER {
            self.request_failures.store(0, Ordering::Relaxed);
            self.mark_failure();
            return true;
        }
        false
    }

    /// A request was answered (any status below 500): the failure streak ends.
    pub fn request_answered(&self) {
        self.request_failures.store(0, Ordering::Relaxed);
    }

    pub fn mark_success(&self) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.healthy.store(true, Ordering::Relaxed);
    }

    /// Marks a failure; unhealthy after the first, retried with exponential backoff.
    pub fn mark_failure(&self) {
        let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        self.healthy.store(false, Ordering::Relaxed);
        let backoff = Duration::from_millis(100u64.saturating_mul(1 << n.min(8)))
            .min(Duration::from_secs(30));
        *self.next_check.lock() = Instant::now() + backoff;
    }

    /// Whether the worker's `/version` is still to be asked (vLLM dialect only: the rules are
    /// vLLM's).
    pub fn wants_version(&self) -> bool {
        let vllm = self
            .spec
            .kv_events
            .as_ref()
            .is_none_or(|k| k.dialect != "sglang");
        vllm && !self.engine.lock().asked
    }

    pub fn view(&self) -> WorkerView {
        // Copied out first: the guard must not live into `running()`, which locks it again.
        let engine_load = *self.engine_load.lock();
        let info = self.engine.lock().clone();
        let learned = self.learners.lock().clone();
        let rules = self
            .spec
            .index_config_for(info.engine)
            .map(|c| c.rules())
            .unwrap_or_default();
        WorkerView {
            name: self.spec.name.clone(),
            url: self.spec.url.clone(),
            model: self.spec.model.clone(),
            role: self.spec.role,
            healthy: self.healthy.load(Ordering::Relaxed),
            draining: self.draining.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            queued_prefill_tokens: self.queued_prefill.load(Ordering::Relaxed),
            in_flight_prompts: self.pending.len(),
            engine_load,
            running_estimate: self.running(),
            dp_size: self.spec.dp_size,
            subscriptions: self.subscriptions.lock().len(),
            events_next_seq: self.sinks.lock().iter().map(|s| s.next_seq()).collect(),
            engine: info.engine,
            engine_source: info.source,
            engine_version: info.version,
            hash_lookahead_tokens: rules.lookahead,
            eagle_drop: rules.eagle_drop,
            adapters: self.adapters.read().clone(),
            ttft_model: learned.ttft.view(),
            decode_model: learned.decode.view(),
            eviction_model: learned.eviction.view(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("worker {0} already exists")]
    Exists(String),
    #[error("no worker named {0}")]
    Unknown(String),
    #[error("{0}")]
    Invalid(String),
}

pub struct Registry {
    workers: RwLock<BTreeMap<String, Arc<Worker>>>,
    pub index: Arc<Index>,
    /// The TTFT model of the whole fleet: what a worker predicts from until it has its own.
    pub fleet_ttft: TtftModel,
    /// The fleet's decode model, which workers borrow until they have their own, and its mean
    /// answer length.
    pub fleet_decode: DecodeModel,
    pub output_tokens: OutputTokens,
    /// How many further requests a conversation brings (the policy's horizon).
    pub follow_ups: FollowUps,
    /// The fleet's turn cycle and follow-up prefill (the conversation charge).
    pub turns: TurnStats,
    /// The share of requests that went where their wait was least (the next arrivals' charge).
    pub least_loaded: LeastLoaded,
    pub wire_stats: Arc<WireStats>,
    /// Placements recorded (`observe::placed`: this replica's and its peers'): the clock of
    /// the learners' per-decision samples.
    placements: AtomicU64,
    /// The part of `placements` that peers announced ([`super::observe::from_peer`]).
    peer_placements: AtomicU64,
}

impl Registry {
    pub fn new(index: Arc<Index>) -> Registry {
        Registry {
            workers: RwLock::new(BTreeMap::new()),
            index,
            fleet_ttft: TtftModel::default(),
            fleet_decode: DecodeModel::default(),
            output_tokens: OutputTokens::default(),
            follow_ups: FollowUps::default(),
            turns: TurnStats::default(),
            least_loaded: LeastLoaded::default(),
            wire_stats: Arc::new(WireStats::new()),
            placements: AtomicU64::new(0),
            peer_placements: AtomicU64::new(0),
        }
    }

    /// Placements recorded so far, this replica's and its peers'.
    pub fn placements(&self) -> u64 {
        self.placements.load(Ordering::Relaxed)
    }

    /// Counts one placement ([`super::observe::placed`]).
    pub fn count_placement(&self) {
        self.placements.fetch_add(1, Ordering::Relaxed);
    }

    /// Placements announced by peers so far (0 for a gateway alone or sharing only bookings).
    pub fn peer_placements(&self) -> u64 {
        self.peer_placements.load(Ordering::Relaxed)
    }

    /// Counts one placement a peer announced (besides [`Registry::count_placement`]).
    pub fn count_peer_placement(&self) {
        self.peer_placements.fetch_add(1, Ordering::Relaxed);
    }

    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.workers.read().values().cloned().collect()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Worker>> {
        self.workers.read().get(name).cloned()
    }

    /// Every model a request may name: the workers' base models and their adapters.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = Vec::new();
        for w in self.workers.read().values() {
            m.push(w.spec.model.clone());
            m.extend(w.adapters.read().keys().cloned());
        }
        m.sort();
        m.dedup();
        m
    }

    /// The LoRA key of a request for `model` among `workers` (those serving it): `None` when
    /// `model` is a base model (`workers` keeps the workers serving it as their base);
    /// otherwise the adapter's `(name, path)` as the first of them (by name) serves it, with
    /// `workers` narrowed to those serving it from that same path (another path is another
    /// key, so another cache).
    pub fn adapter_key(model: &str, workers: &mut Vec<Arc<Worker>>) -> Option<(String, String)> {
        if workers.iter().any(|w| w.spec.model == model) {
            workers.retain(|w| w.spec.model == model);
            return None;
        }
        let path = workers.iter().find_map(|w| w.adapter_path(model))?;
        workers.retain(|w| w.adapter_path(model).as_deref() == Some(path.as_str()));
        Some((model.to_string(), path))
    }

    /// Adds a worker and (inside a tokio runtime) starts its event subscriptions.
    pub fn add(&self, spec: WorkerSpec) -> Result<Arc<Worker>, RegistryError> {
        self.add_resumed(spec, BTreeMap::new())
    }

    /// Adds a worker whose ranks in `resume` are loaded from a snapshot: each rank's image is
    /// loaded into the index and its subscription resumes from the position the image
    /// reflects (an image the index refuses leaves its rank to start empty).
    pub fn add_resumed(
        &self,
        spec: WorkerSpec,
        mut resume: BTreeMap<u32, (StreamPosition, RankImage)>,
    ) -> Result<Arc<Worker>, RegistryError> {
        spec.validate().map_err(RegistryError::Invalid)?;
        let config = spec.index_config().map_err(RegistryError::Invalid)?;
        let worker = Arc::new(Worker::new(spec));
        {
            let mut ws = self.workers.write();
            if ws.contains_key(&worker.spec.name) {
                return Err(RegistryError::Exists(worker.spec.name.clone()));
            }
            ws.insert(worker.spec.name.clone(), worker.clone());
        }
        self.index.configure_worker(&worker.id, config);
        if let Some(kv) = &worker.spec.kv_events {
            let dialect = Dialect::parse(&kv.dialect).unwrap_or_default();
            let host = worker.spec.event_host();
            let mut subs = worker.subscriptions.lock();
            for rank in 0..worker.spec.dp_size {
                let position = resume.remove(&rank).and_then(|(at, image)| {
                    match self.index.import_rank(&worker.id, rank, &image) {
                        Ok(()) => Some(at),
                        Err(e) => {
                            tracing::warn!(worker = %worker.spec.name, dp_rank = rank, error = %e, "snapshot image refused: the rank starts empty");
                            None
                        }
                    }
                });
                let sink = Arc::new(RankSink::new(
                    self.index.clone(),
                    worker.id.clone(),
                    rank,
                    position,
                ));
                worker.sinks.lock().push(sink.clone());
                let mut cfg = SubscriptionConfig::new(worker.id.clone(), rank, &kv.endpoint, &host);
                cfg.replay_endpoint = kv.replay_endpoint.clone();
                cfg.topic = kv.topic.clone();
                cfg.dialect = dialect;
                cfg.idle_reconnect = (kv.idle_reconnect_secs > 0.0)
                    .then(|| Duration::from_secs_f64(kv.idle_reconnect_secs));
                cfg.resume = position;
                let sink: Arc<dyn EventSink> = sink;
                match spawn_subscription(cfg, sink, self.wire_stats.clone()) {
                    Ok(h) => subs.push(h),
                    Err(e) => {
                        drop(subs);
                        self.workers.write().remove(&worker.spec.name);
                        self.index.remove_worker(&worker.id);
                        return Err(RegistryError::Invalid(format!(
                            "worker {}: {e}",
                            worker.spec.name
                        )));
                    }
                }
            }
        }
        Ok(worker)
    }

    /// Removes a worker: stops its subscriptions and drops its index state.
    pub async fn remove(&self, name: &str) -> Result<(), RegistryError> {
        let w = self
            .workers
            .write()
            .remove(name)
            .ok_or_else(|| RegistryError::Unknown(name.into()))?;
        let subs: Vec<SubscriptionHandle> = std::mem::take(&mut *w.subscriptions.lock());
        for s in subs {
            s.stop().await;
        }
        self.index.remove_worker(&w.id);
        Ok(())
    }

    /// Records what a worker's `GET /version` answered (`None`: no usable answer, not asked
    /// again). A worker without a configured engine is predicted from then on by the
    /// generation the version names (its index configuration replaced); a configured engine
    /// is kept, with a warning when the version names another; an unsupported version keeps
    /// vLLM 0.32's rules, with a warning.
    pub fn engine_reported(&self, w: &Arc<Worker>, version: Option<&str>) {
        let current = self
            .workers
            .read()
            .get(&w.spec.name)
            .is_some_and(|x| Arc::ptr_eq(x, w));
        if !current {
            // Removed (or replaced) while its /version was on its way.
            return;
        }
        let detected = version.and_then(Engine::from_version);
        let mut info = w.engine.lock();
        if info.asked {
            return;
        }
        info.asked = true;
        info.version = version.map(str::to_string);
        let name = &w.spec.name;
        match (info.source, detected) {
            (EngineSource::Configured, Some(d)) if d != info.engine => tracing::warn!(
                worker = %name, configured = %info.engine, detected = %d, version = ?version,
                "the worker's /version names another engine than configured: predictions follow the configured one"
            ),
            (EngineSource::Configured, _) => tracing::info!(
                worker = %name, engine = %info.engine, version = ?version, "engine configured"
            ),
            (_, Some(d)) => match w.spec.index_config_for(d) {
                Ok(config) => {
                    info.engine = d;
                    info.source = EngineSource::Detected;
                    tracing::info!(
                        worker = %name, engine = %d, version = ?version,
                        hash_lookahead_tokens = config.rules().lookahead,
                        "engine detected from /version"
                    );
                    drop(info);
                    self.index.configure_worker(&w.id, config);
                }
                Err(e) => tracing::warn!(worker = %name, "engine {d} detected but not usable: {e}"),
            },
            (_, None) => tracing::warn!(
                worker = %name, version = ?version,
                "/version names no supported vLLM release (vllm-0.32, vllm-0.33): predicted by vLLM 0.32's rules; set the worker's engine"
            ),
        }
    }

    pub fn drain(&self, name: &str, draining: bool) -> Result<(), RegistryError> {
        let w = self
            .get(name)
            .ok_or_else(|| RegistryError::Unknown(name.into()))?;
        w.draining.store(draining, Ordering::Relaxed);
        Ok(())
    }
}
