//! The front door: client API keys, each naming a tenant, and every tenant's limits.
//!
//! Owns: `Tenants` (the `[[tenants]]` entries themselves, `TenantSpec` with the optional limits
//! `requests_per_second` with `burst`, `tokens_per_minute`, `max_concurrent`, and their
//! validation are configuration, in `config::tenants`, re-exported here): the live table of
//! keys → tenant, each tenant's limiter state (`limits`), admission (`admit`, then `charge`
//! once the prompt's tokens are known) and the RAII `Admission` that holds a concurrency slot
//! until the response body is dropped. `replace` swaps the table at runtime and keeps the
//! limiter state (and the requests in flight) of every tenant whose name survives.
//! Invariants: with no tenants configured every request passes untouched. A key is looked up
//! by its SHA-256 and then compared in constant time with the stored key. A request rejected by
//! a limit takes nothing from it (a request charged for its rate and then refused for tokens
//! keeps its rate charge). Every rejection and admission is counted per tenant.
//! Must not: log, return or expose a key (errors, `Debug`, metrics and the admin view name the
//! tenant only); read the request body; hold a lock across an await.

pub mod limits;

use super::config::tenants::{digest, resolve, Limits};
pub use super::config::tenants::{validate, TenantError, TenantSpec, DEFAULT_MAX_TOKENS};
use super::metrics::TenantMetrics;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use limits::{retry_secs, Bucket, Clock, Concurrency, MonotonicClock, Wait, NS_PER_SEC};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// The concurrency rejection's `Retry-After` is the mean recent hold, at most this (seconds).
const MAX_CONCURRENCY_RETRY_SECS: u64 = 60;

/// Whether two secrets are equal, in time that depends on neither their contents nor their
/// lengths (their SHA-256 digests are compared in constant time).
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    constant_time_eq(&Sha256::digest(a), &Sha256::digest(b))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// One tenant's live state.
pub struct Tenant {
    pub name: String,
    state: Mutex<State>,
}

struct State {
    limits: Limits,
    rate: Option<Bucket>,
    tokens: Option<Bucket>,
    concurrency: Concurrency,
}

impl State {
    fn new(limits: Limits) -> State {
        State {
            limits,
            rate: limits.rate.map(|(i, c)| Bucket::new(i, c)),
            tokens: limits.tokens.map(|(i, c)| Bucket::new(i, c)),
            concurrency: Concurrency::new(limits.max_concurrent),
        }
    }

    /// New limits at `now`, keeping how full each surviving bucket is and what is in flight.
    fn retune(&mut self, limits: Limits, now: u64) {
        let keep = |old: &Option<Bucket>, new: Option<(u64, u64)>| {
            new.map(|(i, c)| match old {
                Some(b) => b.retuned(now, i, c),
                None => Bucket::new(i, c),
            })
        };
        self.rate = keep(&self.rate, limits.rate);
        self.tokens = keep(&self.tokens, limits.tokens);
        self.concurrency.set_max(limits.max_concurrent);
        self.limits = limits;
    }
}

/// Why the front door refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Unauthorized,
    Rate,
    Tokens,
    Concurrency,
}

impl Reason {
    /// The `reason` label of `kvroute_tenant_rejections_total`.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Unauthorized => "unauthorized",
            Reason::Rate => "rate",
            Reason::Tokens => "tokens",
            Reason::Concurrency => "concurrency",
        }
    }
}

/// A refused request: 401, or 429 with the seconds to wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub message: String,
    /// `Retry-After` (429 only).
    pub retry_after_secs: Option<u64>,
}

impl Rejection {
    fn unauthorized(message: &str) -> Rejection {
        Rejection {
            reason: Reason::Unauthorized,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    fn limited(reason: Reason, message: String, wait_ns: u64) -> Rejection {
        Rejection {
            reason,
            message,
            retry_after_secs: Some(retry_secs(wait_ns)),
        }
    }

    /// The OpenAI-shaped error: 401 with `WWW-Authenticate`, or 429 with `Retry-After`.
    pub fn into_response(self) -> Response {
        let status = match self.reason {
            Reason::Unauthorized => StatusCode::UNAUTHORIZED,
            _ => StatusCode::TOO_MANY_REQUESTS,
        };
        let mut r = super::reply::error(status, self.message);
        if let Some(s) = self.retry_after_secs {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert("retry-after", v);
            }
        }
        if self.reason == Reason::Unauthorized {
            r.headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// A key's entry: the key itself (compared in constant time) and its tenant.
struct Entry {
    key: Vec<u8>,
    tenant: Arc<Tenant>,
}

#[derive(Default)]
struct Table {
    by_digest: HashMap<[u8; 32], Entry>,
    by_name: BTreeMap<String, Arc<Tenant>>,
}

/// The live tenant table and the limiter state of every tenant.
pub struct Tenants {
    table: RwLock<Arc<Table>>,
    clock: Arc<dyn Clock>,
    metrics: TenantMetrics,
}

/// An admitted request's hold on its tenant: one concurrency slot, released on drop (keep it
/// alive as long as the response body).
pub struct Admission {
    tenant: Arc<Tenant>,
    started: u64,
    clock: Arc<dyn Clock>,
    metrics: TenantMetrics,
}

impl Admission {
    pub fn tenant(&self) -> &str {
        &self.tenant.name
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let held = self.clock.now_ns().saturating_sub(self.started);
        let mut s = self.tenant.state.lock();
        s.concurrency.release(held);
        self.metrics
            .in_flight
            .with_label_values(&[&self.tenant.name])
            .set(s.concurrency.in_flight() as i64);
    }
}

/// A tenant in the admin view: its name and limits, never its keys.
#[derive(Clone, Debug, Serialize)]
pub struct TenantView {
    pub name: String,
    pub keys: usize,
    pub requests_per_second: Option<f64>,
    pub burst: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    pub default_max_tokens: u64,
    pub in_flight: u32,
}

impl Tenants {
    /// The table for `specs` on the process's monotonic clock.
    pub fn new(specs: &[TenantSpec], metrics: TenantMetrics) -> Result<Tenants, TenantError> {
        Tenants::with_clock(specs, metrics, Arc::new(MonotonicClock::default()))
    }

    pub fn with_clock(
        specs: &[TenantSpec],
        metrics: TenantMetrics,
        clock: Arc<dyn Clock>,
    ) -> Result<Tenants, TenantError> {
        let t = Tenants {
            table: RwLock::new(Arc::new(Table::default())),
            clock,
            metrics,
        };
        t.replace(specs)?;
        Ok(t)
    }

    /// Replaces the table. A tenant whose name survives keeps its limiter state (how full its
    /// buckets are, its requests in flight) under its new limits; its keys are the new ones.
    /// On error the table is unchanged.
    pub fn replace(&self, specs: &[TenantSpec]) -> Result<(), TenantError> {
        let resolved = resolve(specs)?;
        let now = self.clock.now_ns();
        let old = self.table.read().clone();
        let mut table = Table::default();
        for r in resolved {
            let tenant = match old.by_name.get(&r.name) {
                Some(t) => {
                    t.state.lock().retune(r.limits, now);
                    t.clone()
                }
                None => Arc::new(Tenant {
                    name: r.name.clone(),
                    state: Mutex::new(State::new(r.limits)),
                }),
            };
            let in_flight = tenant.state.lock().concurrency.in_flight();
            let m = &self.metrics;
            m.admitted.with_label_values(&[&r.name]);
            m.tokens.with_label_values(&[&r.name]);
            m.in_flight
                .with_label_values(&[&r.name])
                .set(in_flight as i64);
            for k in r.keys {
                table.by_digest.insert(
                    digest(k.as_bytes()),
                    Entry {
                        key: k.into_bytes(),
                        tenant: tenant.clone(),
                    },
                );
            }
            table.by_name.insert(r.name, tenant);
        }
        for (name, t) in &old.by_name {
            if !table.by_name.contains_key(name) && t.state.lock().concurrency.in_flight() == 0 {
                let _ = self.metrics.in_flight.remove_label_values(&[name]);
            }
        }
        *self.table.write() = Arc::new(table);
        Ok(())
    }

    /// Whether the front door is open (no tenants configured).
    pub fn is_open(&self) -> bool {
        self.table.read().by_name.is_empty()
    }

    /// The tenant the request's key names: `Ok(None)` when the door is open.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Arc<Tenant>>, Rejection> {
        let table = self.table.read().clone();
        if table.by_name.is_empty() {
            return Ok(None);
        }
        let found = match presented_key(headers) {
            None => Err(Rejection::unauthorized(
                "missing API key: send `Authorization: Bearer <key>`",
            )),
            Some(key) => table
                .by_digest
                .get(&digest(key))
                .filter(|e| constant_time_eq(&e.key, key))
                .map(|e| Some(e.tenant.clone()))
                .ok_or_else(|| Rejection::unauthorized("invalid API key")),
        };
        if found.is_err() {
            self.reject("", Reason::Unauthorized);
        }
        found
    }

    /// Authenticates the request and takes a concurrency slot and a request-rate token for it.
    /// `Ok(None)`: the door is open.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Option<Admission>, Rejection> {
        let Some(tenant) = self.authenticate(headers)? else {
            return Ok(None);
        };
        let now = self.clock.now_ns();
        let mut s = tenant.state.lock();
        if s.concurrency.full() {
            let wait = s
                .concurrency
                .mean_hold_ns()
                .unwrap_or(NS_PER_SEC)
                .min(MAX_CONCURRENCY_RETRY_SECS * NS_PER_SEC);
            let max = s.limits.max_concurrent.unwrap_or(0);
            drop(s);
            self.reject(&tenant.name, Reason::Concurrency);
            return Err(Rejection::limited(
                Reason::Concurrency,
                format!(
                    "tenant {} has {max} requests in flight (max_concurrent)",
                    tenant.name
                ),
                wait,
            ));
        }
        if let Some(b) = &mut s.rate {
            if let Err(w) = b.take(now, 1) {
                let wait = match w {
                    Wait::After(ns) => ns,
                    Wait::Never => b.full_refill_ns(),
                };
                drop(s);
                self.reject(&tenant.name, Reason::Rate);
                return Err(Rejection::limited(
                    Reason::Rate,
                    format!(
                        "tenant {} is over its request rate (requests_per_second)",
                        tenant.name
                    ),
                    wait,
                ));
            }
        }
        s.concurrency.acquire();
        self.metrics
            .in_flight
            .with_label_values(&[&tenant.name])
            .set(s.concurrency.in_flight() as i64);
        drop(s);
        Ok(Some(Admission {
            tenant,
            started: now,
            clock: self.clock.clone(),
            metrics: self.metrics.clone(),
        }))
    }

    /// Charges an admitted request its tokens: `prompt_tokens` plus `completion` (its
    /// `max_tokens × n`, or the tenant's `default_max_tokens` when it named none). Counts it
    /// admitted on success. Returns the tokens charged.
    pub fn charge(
        &self,
        admission: &Admission,
        prompt_tokens: u64,
        completion: Option<u64>,
    ) -> Result<u64, Rejection> {
        let tenant = &admission.tenant;
        let now = self.clock.now_ns();
        let mut s = tenant.state.lock();
        let cost = prompt_tokens.saturating_add(completion.unwrap_or(s.limits.default_max_tokens));
        if let Some(b) = &mut s.tokens {
            if let Err(w) = b.take(now, cost) {
                let capacity = b.capacity();
                let (wait, why) = match w {
                    Wait::After(ns) => (ns, "is over its token budget"),
                    Wait::Never => (b.full_refill_ns(), "can never afford"),
                };
                drop(s);
                self.reject(&tenant.name, Reason::Tokens);
                return Err(Rejection::limited(
                    Reason::Tokens,
                    format!(
                        "tenant {} {why} this request's {cost} tokens (prompt + max_tokens; \
                         tokens_per_minute = {capacity})",
                        tenant.name
                    ),
                    wait,
                ));
            }
        }
        drop(s);
        self.metrics
            .admitted
            .with_label_values(&[&tenant.name])
            .inc();
        self.metrics
            .tokens
            .with_label_values(&[&tenant.name])
            .inc_by(cost);
        Ok(cost)
    }

    fn reject(&self, tenant: &str, reason: Reason) {
        self.metrics
            .rejections
            .with_label_values(&[tenant, reason.label()])
            .inc();
    }

    /// Every tenant's name, limits and requests in flight (no keys).
    pub fn view(&self) -> Vec<TenantView> {
        let table = self.table.read().clone();
        let mut keys: BTreeMap<&str, usize> = BTreeMap::new();
        for e in table.by_digest.values() {
            *keys.entry(e.tenant.name.as_str()).or_default() += 1;
        }
        table
            .by_name
            .values()
            .map(|t| {
                let s = t.state.lock();
                TenantView {
                    name: t.name.clone(),
                    keys: keys.get(t.name.as_str()).copied().unwrap_or(0),
                    requests_per_second: s.limits.rate.map(|(i, _)| NS_PER_SEC as f64 / i as f64),
                    burst: s.limits.rate.map(|(_, b)| b),
                    tokens_per_minute: s.limits.tokens.map(|(_, c)| c),
                    max_concurrent: s.limits.max_concurrent,
                    default_max_tokens: s.limits.default_max_tokens,
                    in_flight: s.concurrency.in_flight(),
                }
            })
            .collect()
    }
}

/// The key a request presents: `Authorization: Bearer <key>` (scheme case-insensitive), else
/// `x-api-key`.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get("authorization") {
        let v = v.as_bytes();
        let (scheme, rest) = v.split_at(v.len().min(7));
        return (scheme.eq_ignore_ascii_case(b"bearer ") && !rest.trim_ascii().is_empty())
            .then(|| rest.trim_ascii());
    }
    headers
        .get("x-api-key")
        .map(|v| v.as_bytes().trim_ascii())
        .filter(|k| !k.is_empty())
}

/// The completion budget a request names: `max_tokens` (chat: or `max_completion_tokens`)
/// times `n` (default 1); `None` when it names no `max_tokens`.
pub fn completion_budget(req: &Value) -> Option<u64> {
    let max = req
        .get("max_tokens")
        .and_then(Value::as_u64)
        .or_else(|| req.get("max_completion_tokens").and_then(Value::as_u64))?;
    let n = req.get("n").and_then(Value::as_u64).unwrap_or(1).max(1);
    Some(max.saturating_mul(n))
}

#[cfg(test)]
mod tests;
