//! Live subscriptions: one task per (worker endpoint, DP rank), from ZMQ frames to a sink.
//!
//! Owns: [`SubscriptionConfig`], [`EventSink`] (and the channel-backed [`ChannelSink`]),
//! [`spawn_subscription`] and its [`SubscriptionHandle`]; the session loop that connects or
//! binds the SUB socket, asks the replay ROUTER for what it missed (at the start, after a gap or
//! a reconnect, and once when a fresh connection hears nothing live), and follows the
//! [`Tracker`]'s verdicts (apply, skip, replay, clear + degraded, restart).
//! Invariants: events of one (worker, rank) reach the sink in sequence order, re-filed under
//! the rank implied by the port; whenever batches are known lost the sink first receives a
//! `Cleared` for that rank; a fresh session (first start, or after a failure or panic) starts
//! with a `Cleared` and a replay from seq 0; no input, however broken, ends the subscription
//! (a panic inside the ZMQ library restarts the session after a backoff); every wait is
//! bounded by a timeout or the stop signal.
//! Must not: block other subscriptions (no shared locks held across awaits), interpret events,
//! or retry a replay more than once per gap.

use crate::decode::decode_batch_with;
use crate::endpoint::{
    live_endpoint, replay_endpoint, EndpointError, ResolvedEndpoint, SocketMode,
};
use crate::frames::{parse_replay_reply, replay_request, split_live, ReplayReply};
use crate::reasons::{Dialect, Limits};
use crate::sequence::{DegradeReason, LiveVerdict, ReplayVerdict, Tracker};
use crate::stats::{BatchDisposition, WireStats};
use bytes::Bytes;
use kvroute_index::{Cleared, Event, WorkerId};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Everything one subscription needs.
#[derive(Clone, Debug)]
pub struct SubscriptionConfig {
    pub worker: WorkerId,
    /// The DP rank this subscription follows (port + rank; events are re-filed under it).
    pub dp_rank: u32,
    /// The engine's `--kv-events-config` endpoint, as configured on the engine.
    pub endpoint: String,
    /// The engine's `replay_endpoint`, if it has one.
    pub replay_endpoint: Option<String>,
    /// Where the engine runs (replaces wildcard hosts such as `*`).
    pub host: String,
    /// Topic prefix to subscribe to (`""`: everything).
    pub topic: String,
    pub dialect: Dialect,
    pub limits: Limits,
    /// Bound on one connect or bind attempt.
    pub connect_timeout: Duration,
    /// Bound on the wait for each replay reply message.
    pub replay_timeout: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Connected sockets only: after this long without a message, reconnect (and, with a
    /// replay endpoint, verify the publisher is the same instance). A silent publisher is not
    /// an error; this only notices one that went away, which the SUB socket cannot report.
    pub idle_reconnect: Option<Duration>,
    /// With a replay endpoint: when no live batch arrived this long after a (re)connect, ask
    /// the replay endpoint once for what followed the last batch applied. A subscription takes
    /// a moment to reach the publisher, which meanwhile sends its batches to no one; without
    /// this check such a loss shows only at the publisher's next batch (a gap), which an idle
    /// engine may not send for a long time.
    pub join_check: Option<Duration>,
    /// A warm start: the index already holds this rank up to and including this batch (from a
    /// snapshot). The first session asks the replay endpoint for what followed instead of
    /// clearing; when the replay cannot bridge the gap (no replay endpoint, another publisher
    /// instance, the batch left its buffer) the rank is cleared as a fresh session clears it.
    pub resume: Option<StreamPosition>,
}

/// A point in one publisher instance's stream: the last batch applied and its payload digest
/// ([`payload_digest`]), which tells the same instance from a restarted one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPosition {
    pub seq: u64,
    pub digest: u64,
}

/// The digest a [`StreamPosition`] keeps of a batch payload (xxh3, stable across builds, so a
/// snapshot written by one build is recognised by the next).
pub fn payload_digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

impl SubscriptionConfig {
    pub fn new(worker: impl Into<WorkerId>, dp_rank: u32, endpoint: &str, host: &str) -> Self {
        SubscriptionConfig {
            worker: worker.into(),
            dp_rank,
            endpoint: endpoint.to_string(),
            replay_endpoint: None,
            host: host.to_string(),
            topic: String::new(),
            dialect: Dialect::Vllm,
            limits: Limits::default(),
            connect_timeout: Duration::from_secs(2),
            replay_timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            idle_reconnect: Some(Duration::from_secs(30)),
            join_check: Some(Duration::from_secs(1)),
            resume: None,
        }
    }
}

/// Whether the index can trust a rank's view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankHealth {
    Healthy,
    /// Blocks may be missing (never extra: a `Cleared` preceded the loss).
    Degraded(DegradeReason),
}

/// Where a subscription delivers. Called from the subscription's own task, in order.
pub trait EventSink: Send + Sync + 'static {
    /// Events of one batch (or one subscription-made `Cleared`), in wire order.
    fn apply(&self, events: &[Event]);
    /// Events of batch `position.seq` (possibly none), after which the rank's view reflects
    /// the stream up to and including that batch.
    fn apply_batch(&self, events: &[Event], _position: StreamPosition) {
        if !events.is_empty() {
            self.apply(events);
        }
    }
    /// The rank's health changed.
    fn rank_health(&self, _worker: &WorkerId, _dp_rank: u32, _health: RankHealth) {}
    /// A session finished its first catch-up with the publisher (the replay it asked for has
    /// been applied, or failed, or there is no replay endpoint).
    fn synced(&self, _worker: &WorkerId, _dp_rank: u32) {}
}

/// What a [`ChannelSink`] forwards.
#[derive(Clone, Debug, PartialEq)]
pub enum SinkMessage {
    Events(Vec<Event>),
    Health {
        worker: WorkerId,
        dp_rank: u32,
        health: RankHealth,
    },
}

/// A sink that forwards to an unbounded channel (never blocks the subscription).
pub struct ChannelSink(pub mpsc::UnboundedSender<SinkMessage>);

impl EventSink for ChannelSink {
    fn apply(&self, events: &[Event]) {
        let _ = self.0.send(SinkMessage::Events(events.to_vec()));
    }
    fn rank_health(&self, worker: &WorkerId, dp_rank: u32, health: RankHealth) {
        let _ = self.0.send(SinkMessage::Health {
            worker: worker.clone(),
            dp_rank,
            health,
        });
    }
}

/// A running subscription.
pub struct SubscriptionHandle {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl SubscriptionHandle {
    /// Asks the subscription to stop and waits (bounded) for it.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(5), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// Starts one subscription on the current tokio runtime. Fails only on an endpoint no
/// subscriber can follow; everything after that is retried.
pub fn spawn_subscription(
    cfg: SubscriptionConfig,
    sink: Arc<dyn EventSink>,
    stats: Arc<WireStats>,
) -> Result<SubscriptionHandle, EndpointError> {
    let live = live_endpoint(&cfg.endpoint, cfg.dp_rank, &cfg.host)?;
    let replay = cfg
        .replay_endpoint
        .as_deref()
        .map(|e| replay_endpoint(e, cfg.dp_rank, &cfg.host))
        .transpose()?;
    let (stop, stop_rx) = watch::channel(false);
    let ctx = Arc::new(Ctx {
        cfg,
        live,
        replay,
        sink,
        stats,
    });
    let task = tokio::spawn(supervise(ctx, stop_rx));
    Ok(SubscriptionHandle { stop, task })
}

struct Ctx {
    cfg: SubscriptionConfig,
    live: ResolvedEndpoint,
    replay: Option<ResolvedEndpoint>,
    sink: Arc<dyn EventSink>,
    stats: Arc<WireStats>,
}

enum End {
    Stopped,
    Failed(String),
}

async fn supervise(ctx: Arc<Ctx>, stop: watch::Receiver<bool>) {
    let mut backoff = ctx.cfg.backoff_initial;
    let mut resume = ctx.cfg.resume;
    loop {
        let mut session = Session::new(ctx.clone(), stop.clone(), resume.take());
        let outcome = tokio::spawn(async move { session.run().await }).await;
        let worker = &ctx.cfg.worker;
        match outcome {
            Ok(End::Stopped) => return,
            Ok(End::Failed(e)) => {
                tracing::warn!(worker = %worker, dp_rank = ctx.cfg.dp_rank, error = %e, "kv event subscription failed; restarting")
            }
            Err(e) => {
                tracing::error!(worker = %worker, dp_rank = ctx.cfg.dp_rank, error = %e, "kv event subscription panicked; restarting")
            }
        }
        ctx.stats
            .update_rank(worker, ctx.cfg.dp_rank, |r| r.connected = false);
        ctx.stats.record_reconnect();
        if sleep_or_stop(backoff, &stop).await {
            return;
        }
        backoff = (backoff * 2).min(ctx.cfg.backoff_max);
    }
}

/// Sleeps; returns true when asked to stop meanwhile.
async fn sleep_or_stop(d: Duration, stop: &watch::Receiver<bool>) -> bool {
    let mut stop = stop.clone();
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

fn digest(payload: &[u8]) -> u64 {
    payload_digest(payload)
}

struct Session {
    ctx: Arc<Ctx>,
    stop: watch::Receiver<bool>,
    tracker: Tracker,
    dealer: Option<DealerSocket>,
    reported: Option<RankHealth>,
    /// A warm start's position, until the first sync used it.
    resume: Option<StreamPosition>,
}

enum ReplayError {
    Failed(String),
    Stopped,
}

impl Session {
    fn new(ctx: Arc<Ctx>, stop: watch::Receiver<bool>, resume: Option<StreamPosition>) -> Session {
        Session {
            ctx,
            stop,
            tracker: resume.map_or_else(Tracker::new, |p| Tracker::resumed(p.seq, p.digest)),
            dealer: None,
            reported: None,
            resume,
        }
    }

    fn worker(&self) -> &WorkerId {
        &self.ctx.cfg.worker
    }

    fn rank(&self) -> u32 {
        self.ctx.cfg.dp_rank
    }

    async fn run(&mut self) -> End {
        // A fresh session knows nothing of what the index holds for this rank; a warm start
        // knows it up to its position and bridges from there (or clears then).
        if self.resume.is_none() {
            self.clear();
        }
        self.report_health();
        let mut first = true;
        let mut backoff = self.ctx.cfg.backoff_initial;
        loop {
            let mut sub = match self.open_live().await {
                Ok(s) => s,
                Err(e) if self.ctx.live.mode == SocketMode::Bind => return End::Failed(e),
                Err(e) => {
                    tracing::debug!(worker = %self.worker(), error = %e, "connect failed; retrying");
                    self.ctx.stats.record_reconnect();
                    if sleep_or_stop(backoff, &self.stop).await {
                        return End::Stopped;
                    }
                    backoff = (backoff * 2).min(self.ctx.cfg.backoff_max);
                    continue;
                }
            };
            backoff = self.ctx.cfg.backoff_initial;
            let (worker, rank) = (self.worker().clone(), self.rank());
            self.ctx
                .stats
                .update_rank(&worker, rank, |r| r.connected = true);
            let synced = match (first, self.resume.take()) {
                (true, Some(at)) => self.resume_from(at).await,
                (true, None) => self.initial_sync().await,
                (false, _) => self.verify_after_reconnect().await,
            };
            if let Err(ReplayError::Stopped) = synced {
                return End::Stopped;
            }
            if first {
                self.ctx.sink.synced(&worker, rank);
            }
            first = false;
            match self.receive(&mut sub).await {
                Some(end) => return end,
                None => {
                    self.ctx
                        .stats
                        .update_rank(&worker, rank, |r| r.connected = false);
                    self.ctx.stats.record_reconnect();
                }
            }
        }
    }

    async fn open_live(&self) -> Result<SubSocket, String> {
        let mut sub = SubSocket::new();
        let t = self.ctx.cfg.connect_timeout;
        let addr = self.ctx.live.address.as_str();
        sub.subscribe(&self.ctx.cfg.topic)
            .await
            .map_err(|e| e.to_string())?;
        let res = match self.ctx.live.mode {
            SocketMode::Connect => tokio::time::timeout(t, sub.connect(addr))
                .await
                .map(|r| r.map(|_| ())),
            SocketMode::Bind => tokio::time::timeout(t, sub.bind(addr))
                .await
                .map(|r| r.map(|_| ())),
        };
        match res {
            Ok(Ok(())) => Ok(sub),
            Ok(Err(e)) => Err(format!("{addr}: {e}")),
            Err(_) => Err(format!("{addr}: timed out")),
        }
    }

    /// Receives until stopped (`Some`) or until the socket should be reopened (`None`).
    async fn receive(&mut self, sub: &mut SubSocket) -> Option<End> {
        let idle = match self.ctx.live.mode {
            SocketMode::Connect => self.ctx.cfg.idle_reconnect,
            SocketMode::Bind => None,
        };
        // The join check is still due: no live message on this socket yet, none made.
        let mut join_due = self.ctx.replay.is_some() && self.ctx.cfg.join_check.is_some();
        loop {
            let mut stop = self.stop.clone();
            if *stop.borrow() {
                return Some(End::Stopped);
            }
            let wait = match (join_due, self.ctx.cfg.join_check) {
                (true, Some(j)) => Some(idle.map_or(j, |d| d.min(j))),
                _ => idle,
            };
            let recv = async {
                match wait {
                    Some(d) => tokio::time::timeout(d, sub.recv()).await.ok(),
                    None => Some(sub.recv().await),
                }
            };
            let msg = tokio::select! {
                _ = stop.changed() => return Some(End::Stopped),
                m = recv => m,
            };
            if join_due {
                join_due = false;
                if msg.is_none() {
                    // Silent since the connect: catch up on what the publisher may have sent
                    // before the subscription reached it.
                    self.ctx.stats.record_join_check();
                    if let Err(ReplayError::Stopped) = self.verify_after_reconnect().await {
                        return Some(End::Stopped);
                    }
                    continue;
                }
            }
            match msg {
                None => {
                    tracing::debug!(worker = %self.worker(), "no message for the idle period; reconnecting");
                    return None;
                }
                Some(Err(e)) => {
                    tracing::debug!(worker = %self.worker(), error = %e, "receive failed; reconnecting");
                    return None;
                }
                Some(Ok(m)) => {
                    if let Err(ReplayError::Stopped) = self.on_live(m).await {
                        return Some(End::Stopped);
                    }
                }
            }
        }
    }

    async fn on_live(&mut self, msg: ZmqMessage) -> Result<(), ReplayError> {
        let frames: Vec<Bytes> = msg.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let live = match split_live(&refs) {
            Ok(l) => l,
            Err(e) => {
                self.ctx.stats.record_frame_error(self.worker(), &e);
                self.ctx
                    .stats
                    .record_disposition(BatchDisposition::FrameError);
                return Ok(());
            }
        };
        if !live.topic.starts_with(self.ctx.cfg.topic.as_bytes()) {
            return Ok(());
        }
        let (seq, payload) = (live.seq, live.payload);
        let mut verdict = self.tracker.classify_live(seq, digest(payload));
        if verdict == LiveVerdict::Restart {
            tracing::info!(worker = %self.worker(), dp_rank = self.rank(), seq, "publisher restarted");
            self.ctx.stats.record_restart(self.worker(), self.rank());
            self.clear();
            self.tracker.reset();
            verdict = LiveVerdict::First;
        }
        self.tracker.note_live(seq);
        match verdict {
            LiveVerdict::InOrder => self.apply(seq, payload, BatchDisposition::Applied),
            LiveVerdict::Duplicate => self
                .ctx
                .stats
                .record_disposition(BatchDisposition::Duplicate),
            LiveVerdict::First if seq == 0 => self.apply(seq, payload, BatchDisposition::Applied),
            LiveVerdict::First | LiveVerdict::Gap { .. } | LiveVerdict::Restart => {
                let from = match verdict {
                    LiveVerdict::Gap { from } => {
                        self.ctx
                            .stats
                            .record_gap(self.worker(), self.rank(), seq - from);
                        from
                    }
                    _ => 0,
                };
                if self.ctx.replay.is_some() {
                    match self.replay(from).await {
                        Err(ReplayError::Stopped) => return Err(ReplayError::Stopped),
                        Err(ReplayError::Failed(_)) | Ok(()) => {}
                    }
                }
                match self.tracker.classify_replayed(seq) {
                    ReplayVerdict::Duplicate => self
                        .ctx
                        .stats
                        .record_disposition(BatchDisposition::Duplicate),
                    ReplayVerdict::InOrder => self.apply(seq, payload, BatchDisposition::Applied),
                    ReplayVerdict::First => {
                        self.lose(DegradeReason::JoinedLate, seq);
                        self.apply(seq, payload, BatchDisposition::Applied);
                    }
                    ReplayVerdict::Hole { .. } => {
                        self.lose(DegradeReason::GapUnfilled, seq);
                        self.apply(seq, payload, BatchDisposition::Applied);
                    }
                }
            }
        }
        Ok(())
    }

    /// Decodes and delivers batch `seq`; an undecodable batch clears the rank.
    fn apply(&mut self, seq: u64, payload: &[u8], disposition: BatchDisposition) {
        let (worker, rank) = (self.worker().clone(), self.rank());
        let d = digest(payload);
        match decode_batch_with(&worker, payload, self.ctx.cfg.dialect, &self.ctx.cfg.limits) {
            Ok(mut batch) => {
                batch.set_dp_rank(rank);
                self.ctx
                    .stats
                    .record_batch(&worker, rank, &batch, disposition);
                let engine_cleared = batch.events.iter().any(|e| matches!(e, Event::Cleared(_)));
                self.tracker.applied(seq, d, engine_cleared);
                let next = self.tracker.next();
                self.ctx
                    .stats
                    .update_rank(&worker, rank, |r| r.next_seq = next);
                self.ctx
                    .sink
                    .apply_batch(&batch.events, StreamPosition { seq, digest: d });
            }
            Err(e) => {
                self.ctx.stats.record_batch_error(&worker, &e);
                self.ctx
                    .stats
                    .record_disposition(BatchDisposition::Undecodable);
                self.clear();
                self.tracker.consumed_unapplied(seq, d);
            }
        }
        self.report_health();
    }

    /// Batches before `resume_at` are lost: clear the rank and mark it degraded.
    fn lose(&mut self, reason: DegradeReason, resume_at: u64) {
        self.clear();
        self.tracker.lost(reason, resume_at);
        self.report_health();
    }

    fn clear(&self) {
        let ev = Event::Cleared(Cleared {
            worker: self.worker().clone(),
            dp_rank: self.rank(),
        });
        self.ctx.stats.record_clear_emitted();
        self.ctx.sink.apply(&[ev]);
    }

    fn report_health(&mut self) {
        let health = match self.tracker.degraded() {
            None => RankHealth::Healthy,
            Some(r) => RankHealth::Degraded(r),
        };
        let next = self.tracker.next();
        let (worker, rank) = (self.worker().clone(), self.rank());
        self.ctx.stats.update_rank(&worker, rank, |r| {
            r.next_seq = next;
            r.degraded = health != RankHealth::Healthy;
            r.degraded_reason = match health {
                RankHealth::Degraded(d) => Some(d.name()),
                RankHealth::Healthy => None,
            };
        });
        if self.reported != Some(health) {
            self.reported = Some(health);
            self.ctx.sink.rank_health(&worker, rank, health);
        }
    }

    /// At start: everything the publisher still buffers (the slow-joiner problem).
    async fn initial_sync(&mut self) -> Result<(), ReplayError> {
        if self.ctx.replay.is_none() {
            return Ok(());
        }
        match self.replay(0).await {
            Ok(()) => {
                self.tracker.expect_start();
                self.report_health();
                Ok(())
            }
            Err(ReplayError::Stopped) => Err(ReplayError::Stopped),
            Err(ReplayError::Failed(_)) => Ok(()),
        }
    }

    /// After a reconnect: is it the same publisher instance, and what did we miss?
    async fn verify_after_reconnect(&mut self) -> Result<(), ReplayError> {
        if self.ctx.replay.is_none() {
            return Ok(());
        }
        let Some((seq, d)) = self.tracker.last_applied() else {
            return self.initial_sync().await;
        };
        self.bridge(seq, d).await
    }

    /// A warm start: the index holds the stream up to `at`. Without a replay endpoint nothing
    /// can bridge the time the router was away: the rank starts as a fresh session does.
    async fn resume_from(&mut self, at: StreamPosition) -> Result<(), ReplayError> {
        if self.ctx.replay.is_none() {
            tracing::info!(worker = %self.worker(), dp_rank = self.rank(), "no replay endpoint to resume from: the rank starts empty");
            self.start_over();
            return Ok(());
        }
        match self.bridge(at.seq, at.digest).await {
            Err(ReplayError::Failed(e)) => {
                tracing::info!(worker = %self.worker(), dp_rank = self.rank(), error = %e, "the replay could not resume the rank: it starts empty");
                self.start_over();
                Ok(())
            }
            other => {
                tracing::info!(worker = %self.worker(), dp_rank = self.rank(), seq = at.seq, next = ?self.tracker.next(), "resumed from the snapshot's position");
                other
            }
        }
    }

    /// Forgets the position and what the index holds for the rank (as a fresh session).
    fn start_over(&mut self) {
        self.clear();
        self.tracker = Tracker::new();
        self.report_health();
    }

    /// Asks the replay endpoint for batch `seq` onwards: the same instance (batch `seq` has
    /// digest `d`) continues with what followed; a later first batch means ours left the
    /// buffer (lost, degraded); anything else is another instance (cleared, replayed from 0).
    async fn bridge(&mut self, seq: u64, d: u64) -> Result<(), ReplayError> {
        match self.request_replay(seq).await? {
            Some(ReplyOwned::Batch { seq: s, payload }) if s == seq && digest(&payload) == d => {
                // Same instance: take whatever followed.
                self.ctx
                    .stats
                    .record_disposition(BatchDisposition::Duplicate);
                self.drain_replay().await
            }
            Some(ReplyOwned::Batch { seq: s, payload }) if s > seq => {
                // Our last batch left the buffer: cannot tell; treat as lost.
                self.on_replayed(s, &payload);
                self.drain_replay().await
            }
            _ => {
                // No batch at or after ours, or a different one: a new instance.
                self.dealer = None;
                tracing::info!(worker = %self.worker(), dp_rank = self.rank(), "publisher restarted while disconnected");
                self.ctx.stats.record_restart(self.worker(), self.rank());
                self.clear();
                self.tracker.reset();
                self.initial_sync().await
            }
        }
    }

    /// Requests a replay from `from` and applies every reply until the end marker.
    async fn replay(&mut self, from: u64) -> Result<(), ReplayError> {
        match self.request_replay(from).await? {
            None => Ok(()),
            Some(ReplyOwned::Batch { seq, payload }) => {
                self.on_replayed(seq, &payload);
                self.drain_replay().await
            }
        }
    }

    fn on_replayed(&mut self, seq: u64, payload: &[u8]) {
        match self.tracker.classify_replayed(seq) {
            ReplayVerdict::Duplicate => self
                .ctx
                .stats
                .record_disposition(BatchDisposition::Duplicate),
            ReplayVerdict::InOrder => self.apply(seq, payload, BatchDisposition::Replayed),
            ReplayVerdict::First if seq == 0 => {
                self.apply(seq, payload, BatchDisposition::Replayed)
            }
            ReplayVerdict::First => {
                self.lose(DegradeReason::JoinedLate, seq);
                self.apply(seq, payload, BatchDisposition::Replayed);
            }
            ReplayVerdict::Hole { .. } => {
                self.lose(DegradeReason::ReplayWindowExceeded, seq);
                self.apply(seq, payload, BatchDisposition::Replayed);
            }
        }
    }

    async fn drain_replay(&mut self) -> Result<(), ReplayError> {
        while let Some(ReplyOwned::Batch { seq, payload }) = self.next_reply().await? {
            self.on_replayed(seq, &payload);
        }
        Ok(())
    }

    /// Sends the request and returns the first reply (`None`: the end marker right away).
    async fn request_replay(&mut self, from: u64) -> Result<Option<ReplyOwned>, ReplayError> {
        self.ctx.stats.record_replay_request();
        let res = self.send_request(from).await;
        if let Err(ReplayError::Failed(e)) = &res {
            let detail = e.clone();
            self.replay_failed(&detail);
        }
        res?;
        self.next_reply().await
    }

    async fn send_request(&mut self, from: u64) -> Result<(), ReplayError> {
        let Some(ep) = self.ctx.replay.clone() else {
            return Err(ReplayError::Failed("no replay endpoint".into()));
        };
        if self.dealer.is_none() {
            let mut d = DealerSocket::new();
            match tokio::time::timeout(self.ctx.cfg.connect_timeout, d.connect(&ep.address)).await {
                Ok(Ok(())) => self.dealer = Some(d),
                Ok(Err(e)) => return Err(ReplayError::Failed(format!("{}: {e}", ep.address))),
                Err(_) => {
                    return Err(ReplayError::Failed(format!(
                        "{}: connect timed out",
                        ep.address
                    )))
                }
            }
        }
        let Some(dealer) = self.dealer.as_mut() else {
            return Err(ReplayError::Failed("no replay socket".into()));
        };
        let frames: Vec<Bytes> = replay_request(from).into_iter().map(Bytes::from).collect();
        let msg = ZmqMessage::try_from(frames).map_err(|e| ReplayError::Failed(e.to_string()))?;
        match tokio::time::timeout(self.ctx.cfg.replay_timeout, dealer.send(msg)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ReplayError::Failed(e.to_string())),
            Err(_) => Err(ReplayError::Failed("send timed out".into())),
        }
    }

    /// The next replay reply; `None` at the end marker. Any failure drops the socket (so late
    /// replies to this request cannot be mistaken for the next one's) and is counted.
    async fn next_reply(&mut self) -> Result<Option<ReplyOwned>, ReplayError> {
        loop {
            let Some(dealer) = self.dealer.as_mut() else {
                return Err(ReplayError::Failed("no replay socket".into()));
            };
            let mut stop = self.stop.clone();
            let t = self.ctx.cfg.replay_timeout;
            let got = tokio::select! {
                _ = stop.changed() => return Err(ReplayError::Stopped),
                r = tokio::time::timeout(t, dealer.recv()) => r,
            };
            let msg = match got {
                Ok(Ok(m)) => m,
                Ok(Err(e)) => return Err(self.replay_failed(&e.to_string())),
                Err(_) => return Err(self.replay_failed("timed out waiting for a reply")),
            };
            let frames: Vec<Bytes> = msg.into_vec();
            let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
            match parse_replay_reply(&refs) {
                Ok(ReplayReply::End) => return Ok(None),
                Ok(ReplayReply::Batch { seq, payload, .. }) => {
                    return Ok(Some(ReplyOwned::Batch {
                        seq,
                        payload: payload.to_vec(),
                    }))
                }
                Err(e) => {
                    // One bad reply costs that reply; the replay goes on.
                    self.ctx.stats.record_frame_error(self.worker(), &e);
                    self.ctx
                        .stats
                        .record_disposition(BatchDisposition::FrameError);
                }
            }
        }
    }

    fn replay_failed(&mut self, detail: &str) -> ReplayError {
        self.dealer = None;
        self.ctx.stats.record_replay_failure(self.worker(), detail);
        ReplayError::Failed(detail.to_string())
    }
}

enum ReplyOwned {
    Batch { seq: u64, payload: Vec<u8> },
}
