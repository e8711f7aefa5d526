//! The replicas' booking channel: each replica tells the others what it sends to which worker
//! while it is in flight, so that every replica's load accounting counts every replica's work
//! between two polls of the engines' `/metrics`.
//!
//! Owns: this replica's name and incarnation, the peers' URLs (listed, and found in DNS every
//! `[peers.dns]` interval: a headless Service's records), the sender tasks (one per URL: batches of
//! [`Message`]s posted to the peer's `POST /admin/peers/bookings`), the heartbeat (the open
//! bookings, every `heartbeat_secs`), and the other replicas' bookings held here as load guards
//! on the local workers ([`Peers::receive`]) until their `Done`, a heartbeat that no longer
//! lists them, the peer's restart (a new incarnation) or its silence for `timeout_secs`.
//! Invariants: nothing here delays a request (announcing is a `try_send`; a post that fails
//! drops its batch, counted); a remote booking takes exactly what a local one would from its
//! worker's counters and gives it back exactly once; a replica ignores its own messages; the
//! bookings held per peer are bounded ([`MAX_REMOTE_BOOKINGS`]).
//! Must not: route, change the index, or hold a lock across an await.

use super::config::file::GatewayConfig;
use super::config::peers::{PeersConfig, PeersDns};
use super::discovery::dns::{build_resolver, resolve};
use super::metrics::PeerMetrics;
use super::observe;
use super::peer_wire::{Batch, Booked, Message, Outbox};
use super::registry::load::LoadGuard;
use super::registry::Registry;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Bookings held for one peer at most (a malformed or hostile stream cannot grow past it).
pub const MAX_REMOTE_BOOKINGS: usize = 100_000;
/// Chunk keys one announced prompt may carry (64 tokens each: 4M tokens).
pub const MAX_KEYS: usize = 65_536;
/// Messages one post carries at most.
const MAX_BATCH: usize = 512;

/// One other replica, as heard here.
struct Remote {
    incarnation: u64,
    last_seen: Instant,
    guards: HashMap<u64, LoadGuard>,
}

/// What one received batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Received {
    pub applied: usize,
    pub dropped: usize,
}

/// A peer as `GET /admin/peers` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct PeerView {
    pub replica: String,
    pub incarnation: u64,
    pub last_seen_ms_ago: u64,
    pub bookings: usize,
}

/// `GET /admin/peers`.
#[derive(Clone, Debug, Serialize)]
pub struct PeersView {
    pub replica: String,
    pub incarnation: u64,
    pub urls: Vec<String>,
    pub open_bookings: usize,
    pub heard: Vec<PeerView>,
}

pub struct Peers {
    pub outbox: Arc<Outbox>,
    name: String,
    incarnation: u64,
    remotes: Mutex<HashMap<String, Remote>>,
    config: Mutex<PeersConfig>,
    metrics: PeerMetrics,
    /// Each linked peer's queue, by URL.
    links: Mutex<HashMap<String, mpsc::Sender<Message>>>,
    /// What the senders post with (set by [`Peers::configure`]).
    ctx: Mutex<Option<SendContext>>,
    /// The peer URLs the last good DNS answer named.
    resolved: Mutex<Vec<String>>,
}

/// What a sender task needs besides its queue.
#[derive(Clone)]
pub struct SendContext {
    pub client: reqwest::Client,
    /// The admin token the peers require (the replicas share one).
    pub token: Option<String>,
}

impl SendContext {
    /// Posts with `client` (the engines': its CA bundle) and `config`'s admin token.
    pub fn new(client: &reqwest::Client, config: &GatewayConfig) -> SendContext {
        SendContext {
            client: client.clone(),
            token: config.admin_token.as_ref().map(|t| t.expose().to_string()),
        }
    }
}

impl Peers {
    pub fn new(cfg: &PeersConfig, metrics: PeerMetrics) -> Peers {
        let name = cfg
            .name
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| format!("kvroute-{:016x}", random_u64()));
        Peers {
            outbox: Arc::new(Outbox::default()),
            name,
            incarnation: random_u64(),
            remotes: Mutex::new(HashMap::new()),
            config: Mutex::new(cfg.clone()),
            metrics,
            links: Mutex::new(HashMap::new()),
            ctx: Mutex::new(None),
            resolved: Mutex::new(Vec::new()),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Links this replica to `cfg`'s peers with `ctx`: a sender task per URL, listed or found
    /// in DNS (every link is made afresh: the previous ones close, their tasks end once their
    /// queues drain). Needs a Tokio runtime.
    pub fn configure(self: &Arc<Self>, cfg: &PeersConfig, ctx: SendContext) {
        *self.config.lock() = cfg.clone();
        self.outbox.set_learning(cfg.learning);
        *self.ctx.lock() = Some(ctx);
        if cfg.dns.is_none() {
            self.resolved.lock().clear();
        }
        self.links.lock().clear();
        self.relink();
    }

    /// Links every peer URL listed or resolved that has no link yet, and closes the links of
    /// those no longer named.
    fn relink(self: &Arc<Self>) {
        let Some(ctx) = self.ctx.lock().clone() else {
            return;
        };
        let cfg = self.config.lock().clone();
        let mut want = cfg.urls.clone();
        want.extend(self.resolved.lock().iter().cloned());
        want.sort();
        want.dedup();
        let mut links = self.links.lock();
        links.retain(|url, _| want.contains(url));
        for url in want {
            if links.contains_key(&url) {
                continue;
            }
            let (tx, rx) = mpsc::channel(cfg.queue);
            let target = Target {
                url: format!("{}/admin/peers/bookings", url.trim_end_matches('/')),
                header: (self.name.clone(), self.incarnation),
            };
            tokio::spawn(send_loop(rx, target, ctx.clone(), self.metrics.clone()));
            links.insert(url, tx);
        }
        self.outbox.set_links(
            links
                .iter()
                .map(|(url, tx)| (url.clone(), tx.clone()))
                .collect(),
        );
    }

    /// Resolves `[peers.dns]` every `interval_secs` until `stop`, relinking when the replicas
    /// it names change; a failed or empty answer keeps the last good set.
    pub async fn run_dns(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            let dns = self.config.lock().dns.clone();
            let every = dns.as_ref().map_or(Duration::from_secs(1), |d| {
                Duration::from_secs_f64(d.interval_secs)
            });
            if let Some(d) = dns {
                self.refresh_dns(&d).await;
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
        }
    }

    async fn refresh_dns(self: &Arc<Self>, d: &PeersDns) {
        let found = match build_resolver(d.nameserver.as_deref(), d.timeout_secs) {
            Ok(r) => resolve(&r, &d.name, d.record, d.port).await,
            Err(e) => Err(e),
        };
        let urls: Vec<String> = match found {
            Ok(addrs) if !addrs.is_empty() => addrs.into_iter().map(|a| d.url_for(a)).collect(),
            Ok(_) => return,
            Err(e) => {
                tracing::debug!("peers: {e}");
                return;
            }
        };
        if *self.resolved.lock() != urls {
            tracing::info!(peers = ?urls, "peers found in DNS");
            *self.resolved.lock() = urls;
            self.relink();
        }
    }

    /// The heartbeat and the expiry of silent peers, every `heartbeat_secs`, until `stop`.
    pub async fn run_heartbeat(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            let every = Duration::from_secs_f64(self.config.lock().heartbeat_secs);
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
            self.outbox.heartbeat();
            self.expire(Instant::now());
            self.count_drops(
                "queue_full",
                self.outbox.dropped_full.swap(0, Ordering::Relaxed) as usize,
            );
        }
    }

    /// Drops the bookings of every peer not heard from within the timeout.
    pub fn expire(&self, now: Instant) -> usize {
        let timeout = Duration::from_secs_f64(self.config.lock().timeout_secs);
        let mut remotes = self.remotes.lock();
        let mut dropped = 0;
        remotes.retain(|replica, r| {
            let silent = now.saturating_duration_since(r.last_seen) > timeout;
            if silent {
                dropped += r.guards.len();
                tracing::warn!(%replica, bookings = r.guards.len(), "peer silent: its bookings dropped");
            }
            !silent
        });
        self.count_drops("peer_silent", dropped);
        self.refresh_gauges(&remotes);
        dropped
    }

    /// Applies a batch another replica posted.
    pub fn receive(&self, batch: Batch, registry: &Registry, now: Instant) -> Received {
        let mut out = Received::default();
        if batch.replica == self.name && batch.incarnation == self.incarnation {
            out.dropped = batch.messages.len();
            self.count_drops("own", out.dropped);
            return out;
        }
        let mut remotes = self.remotes.lock();
        let r = remotes.entry(batch.replica.clone()).or_insert(Remote {
            incarnation: batch.incarnation,
            last_seen: now,
            guards: HashMap::new(),
        });
        if r.incarnation != batch.incarnation {
            // The peer restarted: what its last run had in flight ended with it.
            self.count_drops("peer_restarted", r.guards.len());
            tracing::info!(replica = %batch.replica, "peer restarted: its earlier bookings dropped");
            r.guards.clear();
            r.incarnation = batch.incarnation;
        }
        r.last_seen = now;
        for m in batch.messages {
            self.metrics
                .messages
                .with_label_values(&["received", m.kind()])
                .inc();
            match self.apply(r, m, registry) {
                Ok(()) => out.applied += 1,
                Err(reason) => {
                    out.dropped += 1;
                    self.count_drops(reason, 1);
                }
            }
        }
        self.refresh_gauges(&remotes);
        out
    }

    fn apply(&self, r: &mut Remote, m: Message, registry: &Registry) -> Result<(), &'static str> {
        match m {
            Message::Booked(b) => {
                if r.guards.len() >= MAX_REMOTE_BOOKINGS && !r.guards.contains_key(&b.id) {
                    return Err("too_many");
                }
                let id = b.id;
                r.guards.insert(id, remote_guard(b, registry)?);
            }
            Message::FirstByte { id } => {
                if let Some(g) = r.guards.get_mut(&id) {
                    g.prefill_done();
                }
            }
            Message::Done { id } => {
                r.guards.remove(&id);
            }
            Message::Live { ids } => {
                let live: HashSet<u64> = ids.into_iter().collect();
                let before = r.guards.len();
                r.guards.retain(|id, _| live.contains(id));
                self.count_drops("not_live", before - r.guards.len());
            }
            Message::Learned(l) => observe::from_peer(registry, l, Instant::now())?,
        }
        Ok(())
    }

    fn count_drops(&self, reason: &str, n: usize) {
        if n > 0 {
            self.metrics
                .dropped
                .with_label_values(&[reason])
                .inc_by(n as u64);
        }
    }

    fn refresh_gauges(&self, remotes: &HashMap<String, Remote>) {
        let held: usize = remotes.values().map(|r| r.guards.len()).sum();
        self.metrics.remote_bookings.set(held as i64);
        self.metrics.peers_heard.set(remotes.len() as i64);
    }

    /// Replicas heard from (not timed out, not this one): the gauge every change of the
    /// remotes refreshes ([`Peers::refresh_gauges`]), read without their lock (each routing
    /// decision reads it).
    pub fn heard(&self) -> usize {
        self.metrics.peers_heard.get().max(0) as usize
    }

    /// Other replicas' bookings held here.
    pub fn remote_bookings(&self) -> usize {
        self.remotes.lock().values().map(|r| r.guards.len()).sum()
    }

    pub fn view(&self, now: Instant) -> PeersView {
        let remotes = self.remotes.lock();
        let mut heard: Vec<PeerView> = remotes
            .iter()
            .map(|(replica, r)| PeerView {
                replica: replica.clone(),
                incarnation: r.incarnation,
                last_seen_ms_ago: now.saturating_duration_since(r.last_seen).as_millis() as u64,
                bookings: r.guards.len(),
            })
            .collect();
        heard.sort_by(|a, b| a.replica.cmp(&b.replica));
        PeersView {
            replica: self.name.clone(),
            incarnation: self.incarnation,
            urls: self.outbox.urls(),
            open_bookings: self.outbox.open(),
            heard,
        }
    }
}

/// The load guard a peer's booking takes on the local worker it names.
fn remote_guard(b: Booked, registry: &Registry) -> Result<LoadGuard, &'static str> {
    if b.keys.len() > MAX_KEYS || b.checkpoints.len() > 2 {
        return Err("malformed");
    }
    let worker = registry.get(&b.worker).ok_or("unknown_worker")?;
    let guard = LoadGuard::new(worker, b.prefill.min(u32::MAX as u64));
    Ok(if b.keys.is_empty() {
        guard
    } else {
        guard.with_announced_prompt(b.keys.into(), &b.checkpoints)
    })
}

/// Where a sender task posts, and who it says it is.
struct Target {
    url: String,
    header: (String, u64),
}

/// Posts what the queue holds, a batch at a time, in order, until the queue closes.
async fn send_loop(
    mut rx: mpsc::Receiver<Message>,
    target: Target,
    ctx: SendContext,
    metrics: PeerMetrics,
) {
    let mut failing = false;
    while let Some(first) = rx.recv().await {
        let mut messages = vec![first];
        while messages.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(m) => messages.push(m),
                Err(_) => break,
            }
        }
        let n = messages.len();
        let kinds: Vec<&'static str> = messages.iter().map(Message::kind).collect();
        let batch = Batch {
            replica: target.header.0.clone(),
            incarnation: target.header.1,
            messages,
        };
        let Ok(body) = serde_json::to_vec(&batch) else {
            continue;
        };
        let bytes = body.len() as u64;
        let mut req = ctx
            .client
            .post(&target.url)
            .header("content-type", "application/json")
            .timeout(Duration::from_secs(2))
            .body(body);
        if let Some(t) = &ctx.token {
            req = req.bearer_auth(t);
        }
        let ok = matches!(req.send().await, Ok(r) if r.status().is_success());
        if ok {
            metrics.batches.with_label_values(&["ok"]).inc();
            metrics.bytes.with_label_values(&["sent"]).inc_by(bytes);
            for k in kinds {
                metrics.messages.with_label_values(&["sent", k]).inc();
            }
            if failing {
                tracing::info!(peer = %target.url, "peer reachable again");
            }
        } else {
            metrics.batches.with_label_values(&["failed"]).inc();
            metrics
                .dropped
                .with_label_values(&["send_failed"])
                .inc_by(n as u64);
            if !failing {
                tracing::warn!(peer = %target.url, "peer unreachable: its view of this replica's bookings lapses until it is back");
            }
        }
        failing = !ok;
    }
}

/// A random 64-bit number (names and incarnations; no cryptographic use).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}
