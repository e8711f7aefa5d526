//! The gateway's Prometheus metrics.
//!
//! Owns: the registry and every metric the gateway publishes: requests and decisions by policy
//! and worker, predicted vs engine-reported cached tokens (the prediction error histogram),
//! predicted vs observed TTFT, decisions where load outweighed the cache (and the cached tokens
//! given up), hybrid-aware decisions group-blind would see otherwise, decision and proxy
//! latency, worker failures by reason, snapshot writes and loads, connections per listener
//! (`ListenerCounts`, what `gateway::listen` counts into), discovery refreshes, discovered
//! workers, fleet changes and configuration reloads, plus, rendered at scrape time, the
//! index's counters and size and the wire intake's counters, and the front door's per-tenant
//! figures (`TenantMetrics`), the replicas' booking channel (`PeerMetrics`) and malformed
//! client trace contexts.
//! Invariants: metric names are stable, prefixed `kvroute_`.
//! Must not: block a request on anything but an atomic update, or import the front door or the
//! fleet state (both count into it; it reads only the routing core's decision types).

use kvroute_index::Index;
use kvroute_route::{blind_gap, Candidate};
use kvroute_wire::WireStats;
use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub decisions: IntCounterVec,
    pub prediction_error: HistogramVec,
    pub predicted_cached: IntCounterVec,
    pub reported_cached: IntCounterVec,
    pub decision_seconds: HistogramVec,
    pub proxy_seconds: HistogramVec,
    pub retries: IntCounterVec,
    /// Predicted minus observed TTFT (seconds), and the observed TTFT's relative error.
    pub ttft_error: HistogramVec,
    pub ttft_relative_error: HistogramVec,
    /// Decisions where the chosen worker serves less from cache than the best candidate
    /// offered (load or a junction outweighed the cache), and the cached tokens given up.
    pub cache_overridden: IntCounterVec,
    /// Hybrid-aware decisions where group-blind's view differs, by kind (`prediction`,
    /// `best_worker`), and the cached tokens it would promise beyond the exact prediction.
    pub blind_disagreements: IntCounterVec,
    pub blind_overpromised: IntCounter,
    pub cached_forgone: IntCounterVec,
    /// Requests whose prompt extends an earlier one, and the further requests a conversation
    /// is expected to bring (the policy's horizon, [`super::sessions`]).
    pub follow_ups: IntCounter,
    /// Client `traceparent` headers ignored as malformed while tracing is on
    /// ([`super::otel`]).
    pub trace_context_invalid: IntCounter,
    /// Workers ejected after failed requests in a row.
    pub ejections: IntCounterVec,
    /// Worker-side request failures by reason ([`super::forward`]'s `Failure`).
    pub upstream_failures: IntCounterVec,
    pub expected_follow_ups: Gauge,
    /// Snapshots written (`ok`, `failed`), loads at start (`loaded`, `absent`, `refused`), and
    /// the last write's duration and size.
    pub snapshot_writes: IntCounterVec,
    pub snapshot_loads: IntCounterVec,
    pub snapshot_seconds: Gauge,
    pub snapshot_bytes: Gauge,
    /// Tokio tasks alive in the gateway's runtime (read at scrape time).
    runtime_tasks: prometheus::IntGauge,
    connections_open: IntGaugeVec,
    connections_refused: IntCounterVec,
    accept_errors: IntCounterVec,
    tls_handshake_failures: IntCounterVec,
    /// The front door: admitted, rejected, tokens charged and in flight, per tenant.
    pub tenants: TenantMetrics,
    /// The replicas' booking channel ([`PeerMetrics`]).
    pub peers: PeerMetrics,
    /// Discovery refreshes (one DNS resolution or directory scan) by kind and result.
    pub discovery_resolutions: IntCounterVec,
    /// Workers the reconciler manages that discovery found.
    pub discovered_workers: IntGauge,
    /// Reconciler changes to the fleet (added, removed, replaced, refused workers).
    pub fleet_changes: IntCounterVec,
    /// Configuration reloads by result (`ok`, `rejected`).
    pub config_reloads: IntCounterVec,
    index_counters: IntGaugeVec,
    index_size: IntGaugeVec,
    wire: IntGaugeVec,
}

/// The front door's figures per tenant (labelled by tenant name only, never a key).
#[derive(Clone)]
pub struct TenantMetrics {
    /// Requests that passed every limit.
    pub admitted: IntCounterVec,
    /// Refused requests by `reason`: `unauthorized` (tenant `""`), `rate`, `tokens`,
    /// `concurrency`.
    pub rejections: IntCounterVec,
    /// Tokens charged (prompt + max_tokens).
    pub tokens: IntCounterVec,
    pub in_flight: IntGaugeVec,
}

impl TenantMetrics {
    /// The four families, not yet registered anywhere.
    pub fn new() -> TenantMetrics {
        TenantMetrics {
            admitted: must(IntCounterVec::new(
                Opts::new(
                    "kvroute_tenant_requests_total",
                    "Requests a tenant sent that passed every limit",
                ),
                &["tenant"],
            )),
            rejections: must(IntCounterVec::new(
                Opts::new(
                    "kvroute_tenant_rejections_total",
                    "Requests refused at the front door, by tenant and reason \
                     (unauthorized, rate, tokens, concurrency)",
                ),
                &["tenant", "reason"],
            )),
            tokens: must(IntCounterVec::new(
                Opts::new(
                    "kvroute_tenant_tokens_total",
                    "Tokens charged to a tenant (prompt tokens + max_tokens)",
                ),
                &["tenant"],
            )),
            in_flight: must(IntGaugeVec::new(
                Opts::new(
                    "kvroute_tenant_in_flight",
                    "A tenant's requests in flight (streamed ones until their body ends)",
                ),
                &["tenant"],
            )),
        }
    }

    fn register(&self, registry: &Registry) {
        for c in [&self.admitted, &self.rejections, &self.tokens] {
            must(registry.register(Box::new(c.clone())));
        }
        must(registry.register(Box::new(self.in_flight.clone())));
    }
}

impl Default for TenantMetrics {
    fn default() -> Self {
        TenantMetrics::new()
    }
}

/// The booking channel between replicas (`gateway::peers`).
#[derive(Clone)]
pub struct PeerMetrics {
    /// Messages by `direction` (`sent`, `received`) and `kind` (`booked`, `first_byte`,
    /// `done`, `live`).
    pub messages: IntCounterVec,
    /// Batches posted to a peer by `outcome` (`ok`, `failed`).
    pub batches: IntCounterVec,
    /// Body bytes by `direction`.
    pub bytes: IntCounterVec,
    /// What was dropped, by `reason` (`queue_full`, `send_failed`, `unknown_worker`,
    /// `malformed`, `too_many`, `own`, `peer_silent`, `peer_restarted`, `not_live`).
    pub dropped: IntCounterVec,
    /// Other replicas' requests in flight held here.
    pub remote_bookings: IntGauge,
    /// Peers heard from within the timeout.
    pub peers_heard: IntGauge,
}

impl PeerMetrics {
    pub fn new() -> PeerMetrics {
        let vec = |name: &str, help: &str, labels: &[&str]| {
            must(IntCounterVec::new(Opts::new(name, help), labels))
        };
        PeerMetrics {
            messages: vec(
                "kvroute_peer_messages_total",
                "Booking messages exchanged with other replicas, by direction and kind",
                &["direction", "kind"],
            ),
            batches: vec(
                "kvroute_peer_batches_total",
                "Batches of booking messages posted to other replicas, by outcome",
                &["outcome"],
            ),
            bytes: vec(
                "kvroute_peer_bytes_total",
                "Bytes of booking batches, by direction",
                &["direction"],
            ),
            dropped: vec(
                "kvroute_peer_dropped_total",
                "Booking messages or bookings dropped, by reason",
                &["reason"],
            ),
            remote_bookings: must(IntGauge::new(
                "kvroute_peer_remote_bookings",
                "Other replicas' requests in flight that this replica counts",
            )),
            peers_heard: must(IntGauge::new(
                "kvroute_peers_heard",
                "Other replicas heard from within the peer timeout",
            )),
        }
    }

    fn register(&self, registry: &Registry) {
        for c in [&self.messages, &self.batches, &self.bytes, &self.dropped] {
            must(registry.register(Box::new(c.clone())));
        }
        for g in [&self.remote_bookings, &self.peers_heard] {
            must(registry.register(Box::new(g.clone())));
        }
    }
}

impl Default for PeerMetrics {
    fn default() -> Self {
        PeerMetrics::new()
    }
}

fn must<T>(r: prometheus::Result<T>) -> T {
    match r {
        Ok(v) => v,
        // Metric definitions are static: a failure here is a programming error caught by tests.
        Err(e) => panic!("metric definition: {e}"),
    }
}

/// What a listener counts (`gateway::listen` counts into it).
#[derive(Clone)]
pub struct ListenerCounts {
    pub open: IntGauge,
    pub refused: IntCounter,
    pub accept_errors: IntCounter,
    /// TLS handshakes that failed or timed out (bad certificates, plain HTTP on a TLS port).
    pub tls_handshake_failures: IntCounter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = must(IntCounterVec::new(
            Opts::new(
                "kvroute_requests_total",
                "Requests by endpoint and status class",
            ),
            &["endpoint", "status"],
        ));
        let decisions = must(IntCounterVec::new(
            Opts::new(
                "kvroute_decisions_total",
                "Routing decisions by policy and worker",
            ),
            &["policy", "worker"],
        ));
        let prediction_error = must(HistogramVec::new(
            HistogramOpts::new(
                "kvroute_prediction_error_tokens",
                "Predicted minus engine-reported cached tokens",
            )
            .buckets(vec![
                -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 1.0, 16.0, 64.0, 256.0, 1024.0,
                4096.0,
            ]),
            &["worker"],
        ));
        let predicted_cached = must(IntCounterVec::new(
            Opts::new(
                "kvroute_predicted_cached_tokens_total",
                "Cached tokens predicted for routed requests",
            ),
            &["worker"],
        ));
        let reported_cached = must(IntCounterVec::new(
            Opts::new(
                "kvroute_reported_cached_tokens_total",
                "Cached tokens the engine reported",
            ),
            &["worker"],
        ));
        let decision_seconds = must(HistogramVec::new(
            HistogramOpts::new(
                "kvroute_decision_seconds",
                "Time to choose a worker (hashing and prediction included)",
            )
            .buckets(vec![
                1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2,
            ]),
            &["policy"],
        ));
        let proxy_seconds = must(HistogramVec::new(
            HistogramOpts::new("kvroute_proxy_seconds", "Upstream time to the first byte")
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).unwrap_or_default()),
            &["worker"],
        ));
        let retries = must(IntCounterVec::new(
            Opts::new(
                "kvroute_retries_total",
                "Requests retried on the next-best worker",
            ),
            &["worker"],
        ));
        let ttft_error = must(HistogramVec::new(
            HistogramOpts::new(
                "kvroute_ttft_prediction_error_seconds",
                "Predicted minus observed time to first token (streamed requests)",
            )
            .buckets(vec![
                -2.0, -0.5, -0.2, -0.1, -0.05, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.05,
                0.1, 0.2, 0.5, 2.0,
            ]),
            &["worker"],
        ));
        let ttft_relative_error = must(HistogramVec::new(
            HistogramOpts::new(
                "kvroute_ttft_prediction_relative_error",
                "|predicted - observed| / observed time to first token (streamed requests)",
            )
            .buckets(vec![0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0]),
            &["worker"],
        ));
        let cache_overridden = must(IntCounterVec::new(
            Opts::new(
                "kvroute_decisions_cache_overridden_total",
                "Decisions whose worker serves less from cache than the best candidate offered",
            ),
            &["policy"],
        ));
        let blind_disagreements = must(IntCounterVec::new(
            Opts::new(
                "kvroute_group_blind_disagreements_total",
                "Hybrid-aware decisions where group-blind's view differs: `prediction` (on the \
                 chosen worker) or `best_worker` (it would look for the cache elsewhere)",
            ),
            &["kind"],
        ));
        let blind_overpromised = must(IntCounter::new(
            "kvroute_group_blind_overpromised_tokens_total",
            "Cached tokens group-blind predicts on hybrid-aware's chosen workers beyond the exact \
             prediction",
        ));
        let cached_forgone = must(IntCounterVec::new(
            Opts::new(
                "kvroute_decision_cached_tokens_forgone_total",
                "Predicted cached tokens of the best candidate the chosen worker does not serve",
            ),
            &["policy"],
        ));
        let follow_ups = must(IntCounter::new(
            "kvroute_follow_up_requests_total",
            "Requests whose prompt extends an earlier request's prompt token for token",
        ));
        let expected_follow_ups = must(Gauge::new(
            "kvroute_expected_follow_ups",
            "Further requests a conversation is expected to bring after the current one",
        ));
        must(registry.register(Box::new(follow_ups.clone())));
        let trace_context_invalid = must(IntCounter::new(
            "kvroute_trace_context_invalid_total",
            "Client traceparent headers ignored as malformed (tracing on; the request starts a trace of its own)",
        ));
        must(registry.register(Box::new(trace_context_invalid.clone())));
        must(registry.register(Box::new(blind_overpromised.clone())));
        let ejections = must(IntCounterVec::new(
            Opts::new(
                "kvroute_worker_ejections_total",
                "Workers ejected after failed requests (5xx, timeouts, resets) in a row",
            ),
            &["worker"],
        ));
        must(registry.register(Box::new(ejections.clone())));
        let upstream_failures = must(IntCounterVec::new(
            Opts::new(
                "kvroute_upstream_failures_total",
                "Requests a worker failed: refused, timeout, transport (reset or closed), status_5xx, body (reading a whole answer), stream_cut (after bytes went out)",
            ),
            &["worker", "reason"],
        ));
        must(registry.register(Box::new(upstream_failures.clone())));
        must(registry.register(Box::new(expected_follow_ups.clone())));
        let snapshot_writes = must(IntCounterVec::new(
            Opts::new(
                "kvroute_snapshot_writes_total",
                "Index snapshots written, by result (ok, failed)",
            ),
            &["result"],
        ));
        let snapshot_loads = must(IntCounterVec::new(
            Opts::new(
                "kvroute_snapshot_loads_total",
                "Snapshots met at start, by result (loaded, absent, refused)",
            ),
            &["result"],
        ));
        let snapshot_seconds = must(Gauge::new(
            "kvroute_snapshot_write_seconds",
            "Duration of the last snapshot write, seconds",
        ));
        let snapshot_bytes = must(Gauge::new(
            "kvroute_snapshot_bytes",
            "Size of the last snapshot written, bytes",
        ));
        must(registry.register(Box::new(snapshot_writes.clone())));
        must(registry.register(Box::new(snapshot_loads.clone())));
        must(registry.register(Box::new(snapshot_seconds.clone())));
        must(registry.register(Box::new(snapshot_bytes.clone())));
        let connections_open = must(IntGaugeVec::new(
            Opts::new(
                "kvroute_connections_open",
                "Client connections open, by listener",
            ),
            &["listener"],
        ));
        let connections_refused = must(IntCounterVec::new(
            Opts::new(
                "kvroute_connections_refused_total",
                "Connections closed at accept because max_connections were open, by listener",
            ),
            &["listener"],
        ));
        let accept_errors = must(IntCounterVec::new(
            Opts::new(
                "kvroute_connections_accept_errors_total",
                "Failed accepts (e.g. out of file descriptors), by listener",
            ),
            &["listener"],
        ));
        let runtime_tasks = must(prometheus::IntGauge::new(
            "kvroute_runtime_tasks",
            "Tokio tasks alive in the gateway's runtime",
        ));
        must(registry.register(Box::new(runtime_tasks.clone())));
        must(registry.register(Box::new(connections_open.clone())));
        must(registry.register(Box::new(connections_refused.clone())));
        must(registry.register(Box::new(accept_errors.clone())));
        let tls_handshake_failures = must(IntCounterVec::new(
            Opts::new(
                "kvroute_tls_handshake_failures_total",
                "TLS handshakes that failed or timed out (a refused or missing client certificate, a client speaking plain HTTP), by listener",
            ),
            &["listener"],
        ));
        must(registry.register(Box::new(tls_handshake_failures.clone())));
        let discovery_resolutions = must(IntCounterVec::new(
            Opts::new(
                "kvroute_discovery_resolutions_total",
                "Discovery refreshes (a DNS resolution, a directory scan) by kind and result (ok, empty, error; the last two keep the last good set)",
            ),
            &["kind", "result"],
        ));
        let discovered_workers = must(IntGauge::new(
            "kvroute_discovered_workers",
            "Workers in the fleet that discovery found",
        ));
        let fleet_changes = must(IntCounterVec::new(
            Opts::new(
                "kvroute_fleet_changes_total",
                "Workers the reconciler added, retired (removed), replaced or refused",
            ),
            &["change"],
        ));
        let config_reloads = must(IntCounterVec::new(
            Opts::new(
                "kvroute_config_reloads_total",
                "Configuration reloads by result (ok, rejected)",
            ),
            &["result"],
        ));
        must(registry.register(Box::new(discovered_workers.clone())));
        let index_counters = must(IntGaugeVec::new(
            Opts::new("kvroute_index_events", "Index counters (monotonic)"),
            &["counter"],
        ));
        let index_size = must(IntGaugeVec::new(
            Opts::new("kvroute_index_size", "Index size"),
            &["what"],
        ));
        let wire = must(IntGaugeVec::new(
            Opts::new("kvroute_wire", "Wire intake counters (monotonic)"),
            &["counter"],
        ));
        for c in [
            &requests,
            &decisions,
            &predicted_cached,
            &reported_cached,
            &retries,
            &cache_overridden,
            &blind_disagreements,
            &cached_forgone,
            &discovery_resolutions,
            &fleet_changes,
            &config_reloads,
        ] {
            must(registry.register(Box::new(c.clone())));
        }
        for h in [
            &prediction_error,
            &decision_seconds,
            &proxy_seconds,
            &ttft_error,
            &ttft_relative_error,
        ] {
            must(registry.register(Box::new(h.clone())));
        }
        for g in [&index_counters, &index_size, &wire] {
            must(registry.register(Box::new(g.clone())));
        }
        let tenants = TenantMetrics::new();
        tenants.register(&registry);
        let peers = PeerMetrics::new();
        peers.register(&registry);
        Metrics {
            registry,
            requests,
            decisions,
            prediction_error,
            predicted_cached,
            reported_cached,
            decision_seconds,
            proxy_seconds,
            retries,
            ttft_error,
            ttft_relative_error,
            cache_overridden,
            blind_disagreements,
            blind_overpromised,
            cached_forgone,
            follow_ups,
            trace_context_invalid,
            ejections,
            upstream_failures,
            expected_follow_ups,
            snapshot_writes,
            snapshot_loads,
            snapshot_seconds,
            snapshot_bytes,
            runtime_tasks,
            connections_open,
            connections_refused,
            accept_errors,
            tls_handshake_failures,
            tenants,
            peers,
            discovery_resolutions,
            discovered_workers,
            fleet_changes,
            config_reloads,
            index_counters,
            index_size,
            wire,
        }
    }

    /// Counts where group-blind's view of a hybrid-aware decision (its ranked candidates)
    /// differs from the exact one ([`blind_gap`]).
    pub fn record_blind_gap(&self, ranked: &[Candidate]) {
        let gap = blind_gap(ranked);
        if gap.prediction_differs {
            self.blind_disagreements
                .with_label_values(&["prediction"])
                .inc();
        }
        if gap.best_elsewhere {
            self.blind_disagreements
                .with_label_values(&["best_worker"])
                .inc();
        }
        self.blind_overpromised.inc_by(gap.overpromised);
    }

    /// The connection counters of one listener (`front`, `admin`).
    pub fn listener(&self, name: &str) -> ListenerCounts {
        ListenerCounts {
            open: self.connections_open.with_label_values(&[name]),
            refused: self.connections_refused.with_label_values(&[name]),
            accept_errors: self.accept_errors.with_label_values(&[name]),
            tls_handshake_failures: self.tls_handshake_failures.with_label_values(&[name]),
        }
    }

    /// The text exposition, with index and wire figures refreshed.
    pub fn render(&self, index: &Index, wire: &WireStats) -> String {
        for (name, v) in index.counters().snapshot() {
            self.index_counters.with_label_values(&[name]).set(v as i64);
        }
        let s = index.stats();
        self.index_size
            .with_label_values(&["ranks"])
            .set(s.ranks as i64);
        self.index_size
            .with_label_values(&["holders"])
            .set(s.holders as i64);
        self.index_size
            .with_label_values(&["block_copies"])
            .set(s.block_copies as i64);
        self.index_size
            .with_label_values(&["heap_bytes"])
            .set(s.heap_bytes as i64);
        self.index_size
            .with_label_values(&["digest_cache_bytes"])
            .set(s.digest_cache_bytes as i64);
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            self.runtime_tasks.set(h.metrics().num_alive_tasks() as i64);
        }
        if let Ok(v) = serde_json::to_value(wire.snapshot()) {
            flatten("", &v, &mut |k, n| self.wire.with_label_values(&[k]).set(n));
        }
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Numeric leaves of a JSON value as `a_b_c` names (per-worker detail stays out of labels).
fn flatten(prefix: &str, v: &serde_json::Value, f: &mut impl FnMut(&str, i64)) {
    match v {
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64().or_else(|| n.as_f64().map(|x| x as i64)) {
                f(prefix, i);
            }
        }
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}_{k}")
                };
                let key: String = key
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '_' {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect();
                flatten(&key, x, f);
            }
        }
        _ => {}
    }
}
