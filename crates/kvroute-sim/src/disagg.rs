//! Disaggregated prefill and decode, as vLLM's `NixlConnector` does it (pull mode).
//!
//! Owns: [`KvTransfer`] (vLLM's `--kv-transfer-config`: `kv_connector = "NixlConnector"`,
//! `kv_role` `kv_producer` | `kv_consumer` | `kv_both`, `engine_id`), what a request's
//! `kv_transfer_params` ask of this worker ([`ask`]), the parameters a prefill worker answers
//! with ([`producer_params`]), the KV it holds for decode workers to pull ([`Leases`], kept
//! [`LEASE`] like vLLM's `kv_lease_duration`), and the pull itself ([`pull`]).
//!
//! The protocol: a proxy sends the prefill worker the request with `kv_transfer_params =
//! {do_remote_decode: true, ...}`, `stream = false`, `max_tokens = 1`; the prefill worker
//! computes the prompt and answers, on the non-streaming response, `kv_transfer_params =
//! {do_remote_prefill: true, remote_engine_id, remote_request_id, remote_host, remote_port,
//! remote_block_ids, remote_num_tokens, remote_prefill_cached_tokens, tp_size, ...}`. The
//! proxy sends the decode worker the original request with those parameters; the decode worker
//! pulls the prompt's KV beyond its own hit, computes the last prompt token and decodes, and
//! reports the prefill worker's cached tokens as its own. NIXL's side channel is, here, the
//! prefill worker's own HTTP address (`POST /admin/kv_pull`), as the proxy addressed it.
//! Invariants: a lease is pulled at most once and never after it expires; a pull names the
//! engine that granted it; parameters a worker's role does not consume are ignored, as vLLM's
//! connector ignores them.
//! Must not: touch the engine (the HTTP layer submits what [`ask`] decided).

use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a prefill worker holds a request's KV for a decode worker (vLLM's default
/// `kv_lease_duration`).
pub const LEASE: Duration = Duration::from_secs(30);

/// What the worker does with KV transfer parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvRole {
    /// Prefills for decode workers (`kv_producer`).
    Producer,
    /// Decodes what prefill workers computed (`kv_consumer`).
    Consumer,
    /// Both (`kv_both`).
    Both,
}

impl KvRole {
    pub fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }
    pub fn consumes(self) -> bool {
        matches!(self, KvRole::Consumer | KvRole::Both)
    }
}

/// vLLM's `--kv-transfer-config` as the simulator implements it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvTransfer {
    pub role: KvRole,
    /// The engine's id in the transfer parameters (vLLM: a random UUID unless configured).
    pub engine_id: String,
}

impl std::str::FromStr for KvTransfer {
    type Err = String;
    /// vLLM's JSON: `{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}`, with an
    /// optional `engine_id`; other fields are accepted and ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let v: Value = serde_json::from_str(s).map_err(|e| format!("--kv-transfer-config: {e}"))?;
        let connector = v.get("kv_connector").and_then(Value::as_str);
        if connector != Some("NixlConnector") {
            return Err(format!(
                "--kv-transfer-config: kv_connector {connector:?}: the simulator implements \
                 NixlConnector"
            ));
        }
        let role = match v.get("kv_role").and_then(Value::as_str) {
            Some("kv_producer") => KvRole::Producer,
            Some("kv_consumer") => KvRole::Consumer,
            Some("kv_both") => KvRole::Both,
            other => {
                return Err(format!(
                    "--kv-transfer-config: kv_role {other:?} (kv_producer | kv_consumer | \
                     kv_both)"
                ))
            }
        };
        let engine_id = match v.get("engine_id") {
            None | Some(Value::Null) => {
                format!(
                    "sim-{:016x}",
                    xxhash_rust::xxh3::xxh3_64(s.as_bytes()) ^ nonce()
                )
            }
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            Some(_) => return Err("--kv-transfer-config: engine_id must be a string".into()),
        };
        Ok(KvTransfer { role, engine_id })
    }
}

/// A per-process value, so two workers given the same configuration get different engine ids.
fn nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    xxhash_rust::xxh3::xxh3_64(&[t.to_le_bytes(), n.to_le_bytes()].concat())
}

/// The KV a prefill worker holds for decode workers: request id → (prompt tokens, expiry).
#[derive(Debug, Default)]
pub struct Leases {
    inner: Mutex<HashMap<String, (usize, Instant)>>,
}

impl Leases {
    /// Holds `num_tokens` of a finished request's prompt until `now + LEASE`.
    pub fn grant(&self, request_id: &str, num_tokens: usize, now: Instant) {
        let mut g = self.inner.lock();
        g.retain(|_, (_, until)| *until > now);
        g.insert(request_id.to_string(), (num_tokens, now + LEASE));
    }

    /// The prompt tokens held for `request_id`, released; `None` if never granted, pulled
    /// already or expired.
    pub fn take(&self, request_id: &str, now: Instant) -> Option<usize> {
        let (n, until) = self.inner.lock().remove(request_id)?;
        (until > now).then_some(n)
    }

    /// Leases held (expired ones included until the next grant).
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a decode worker pulls a request's KV from, and what the prefill worker reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    pub host: String,
    pub port: u16,
    pub engine_id: String,
    pub request_id: String,
    /// The prefill worker's `num_cached_tokens`.
    pub cached_tokens: usize,
    /// The prompt tokens it prefilled.
    pub num_tokens: Option<usize>,
    /// The prefill leg's engine time in microseconds (`sim_prefill_leg_s`, the simulator's own
    /// field: arrival at the prefill worker to its answer), when the prefill worker is
    /// simulated too.
    pub prefill_leg_us: Option<u64>,
}

/// What a request's `kv_transfer_params` ask of this worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Serve it as usual.
    Local,
    /// Prefill it for a decode worker (`do_remote_decode`).
    PrefillForRemote,
    /// Decode it from a prefill worker's KV (`do_remote_prefill`).
    DecodeFromRemote(Remote),
}

/// Reads `kv_transfer_params` under the worker's role: parameters the role does not consume,
/// or no connector at all, mean a local request.
pub fn ask(body: &Value, cfg: Option<&KvTransfer>) -> Result<Ask, String> {
    let (Some(cfg), Some(p)) = (cfg, body.get("kv_transfer_params")) else {
        return Ok(Ask::Local);
    };
    if p.is_null() {
        return Ok(Ask::Local);
    }
    if !p.is_object() {
        return Err("`kv_transfer_params` must be an object".into());
    }
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("do_remote_prefill") && cfg.role.consumes() {
        let text = |k: &str| {
            p.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .ok_or_else(|| format!("`kv_transfer_params.{k}` must be a non-empty string"))
        };
        let port = p
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|v| u16::try_from(v).ok())
            .ok_or("`kv_transfer_params.remote_port` must be a port number")?;
        let count = |k: &str| p.get(k).and_then(Value::as_u64).map(|v| v as usize);
        return Ok(Ask::DecodeFromRemote(Remote {
            host: text("remote_host")?,
            port,
            engine_id: text("remote_engine_id")?,
            request_id: text("remote_request_id")?,
            cached_tokens: count("remote_prefill_cached_tokens").unwrap_or(0),
            num_tokens: count("remote_num_tokens"),
            prefill_leg_us: p
                .get("sim_prefill_leg_s")
                .and_then(Value::as_f64)
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(|s| (s * 1e6).round() as u64),
        }));
    }
    if flag("do_remote_decode") && cfg.role.produces() {
        return Ok(Ask::PrefillForRemote);
    }
    Ok(Ask::Local)
}

/// The `kv_transfer_params` a prefill worker answers with, for a request `request_id` whose
/// `prompt_tokens` it computed with `cached` of them from its cache in `leg_s` seconds of
/// engine time (arrival to answer); `side_channel` is its `host:port`. Beside vLLM's keys, the
/// simulator's own `sim_prefill_leg_s` carries `leg_s` to the decode worker, which reports it
/// (`sim.prefill_leg_s`) so that a client can time both legs on the engines' clock.
pub fn producer_params(
    cfg: &KvTransfer,
    request_id: &str,
    side_channel: &str,
    prompt_tokens: usize,
    cached: usize,
    block_size: usize,
    leg_s: f64,
) -> Value {
    let (host, port) = match side_channel.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse::<u16>().ok()),
        None => (side_channel.to_string(), None),
    };
    let blocks = prompt_tokens.div_ceil(block_size.max(1));
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": cfg.engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": [(0..blocks).collect::<Vec<usize>>()],
        "remote_num_tokens": prompt_tokens,
        "remote_prefill_cached_tokens": cached,
        "tp_size": 1,
        "transfer_mode": "pull",
        "sim_prefill_leg_s": leg_s,
    })
}

/// Pulls a request's KV from the prefill worker named in `r`: the prompt tokens it held.
pub async fn pull(client: &reqwest::Client, r: &Remote) -> Result<usize, String> {
    let url = format!("http://{}:{}/admin/kv_pull", r.host, r.port);
    let resp = client
        .post(&url)
        .timeout(Duration::from_secs(10))
        .json(&json!({
            "remote_engine_id": r.engine_id,
            "remote_request_id": r.request_id,
        }))
        .send()
        .await
        .map_err(|e| format!("pulling KV from {url}: {e}"))?;
    let status = resp.status();
    let v: Value = resp
        .json()
        .await
        .map_err(|e| format!("pulling KV from {url}: {e}"))?;
    if !status.is_success() {
        let msg = v["error"]["message"].as_str().unwrap_or("no message");
        return Err(format!("pulling KV from {url}: {status}: {msg}"));
    }
    v.get("num_tokens")
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .ok_or_else(|| format!("pulling KV from {url}: no num_tokens in the answer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn producer() -> KvTransfer {
        r#"{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "p0"}"#
            .parse()
            .unwrap()
    }

    #[test]
    fn vllms_kv_transfer_config_is_read_and_other_connectors_are_refused() {
        let p = producer();
        assert_eq!((p.role, p.engine_id.as_str()), (KvRole::Producer, "p0"));
        let c: KvTransfer = r#"{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}"#
            .parse()
            .unwrap();
        assert!(c.role.consumes() && !c.role.produces());
        let again: KvTransfer = r#"{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}"#
            .parse()
            .unwrap();
        assert_ne!(c.engine_id, again.engine_id, "engine ids are unique");
        for bad in [
            r#"{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}"#,
            r#"{"kv_connector": "NixlConnector", "kv_role": "prefill"}"#,
            r#"{"kv_connector": "NixlConnector"}"#,
            "not json",
        ] {
            assert!(bad.parse::<KvTransfer>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_lease_is_pulled_once_and_never_after_it_expires() {
        let l = Leases::default();
        let t0 = Instant::now();
        l.grant("a", 100, t0);
        l.grant("b", 50, t0);
        assert_eq!(l.take("a", t0 + Duration::from_secs(1)), Some(100));
        assert_eq!(l.take("a", t0 + Duration::from_secs(1)), None);
        assert_eq!(l.take("b", t0 + LEASE + Duration::from_millis(1)), None);
        assert_eq!(l.take("never", t0), None);
        assert!(l.is_empty());
    }

    #[test]
    fn the_params_a_role_does_not_consume_are_ignored() {
        let p = producer();
        let c: KvTransfer = r#"{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}"#
            .parse()
            .unwrap();
        let decode_me = json!({"kv_transfer_params": {"do_remote_decode": true}});
        assert_eq!(ask(&decode_me, Some(&p)), Ok(Ask::PrefillForRemote));
        assert_eq!(ask(&decode_me, Some(&c)), Ok(Ask::Local));
        assert_eq!(ask(&decode_me, None), Ok(Ask::Local));
        let answer = producer_params(&p, "cmpl-1", "127.0.0.1:8100", 100, 32, 16, 0.25);
        assert_eq!(answer["remote_port"], 8100);
        assert_eq!(answer["remote_block_ids"][0].as_array().unwrap().len(), 7);
        let from_remote = json!({"kv_transfer_params": answer});
        match ask(&from_remote, Some(&c)) {
            Ok(Ask::DecodeFromRemote(r)) => {
                assert_eq!((r.host.as_str(), r.port), ("127.0.0.1", 8100));
                assert_eq!((r.cached_tokens, r.num_tokens), (32, Some(100)));
                assert_eq!(r.request_id, "cmpl-1");
                assert_eq!(r.prefill_leg_us, Some(250_000));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ask(&from_remote, Some(&p)), Ok(Ask::Local));
        let broken = json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "h"}});
        assert!(ask(&broken, Some(&c)).is_err());
        assert!(ask(&json!({"kv_transfer_params": 3}), Some(&c)).is_err());
    }
}
