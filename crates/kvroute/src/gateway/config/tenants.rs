//! The `[[tenants]]` section: each tenant's spec (name, keys inline, from a file or from an
//! environment variable, and the optional limits) and its validation.
//!
//! Owns: `TenantSpec`, `TenantError`, the validated `Limits` of a spec, reading a spec's keys
//! (`resolve`, which `validate` and the front door's live table both use) and the key digest.
//! Invariants: a spec that resolves names every key it has and limits that are all positive and
//! bounded; a key never appears in an error or in `Debug` output (the tenant is named instead).
//! Must not: import the gateway's other modules (configuration is plain data; the live table,
//! admission and limiter state are the front door's, in `gateway::tenants`).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

/// Nanoseconds in a second: the unit of the limiters' clock (`gateway::tenants::limits`).
pub const NS_PER_SEC: u64 = 1_000_000_000;

/// What a request without `max_tokens` is charged for its completion, unless the tenant sets
/// `default_max_tokens`.
pub const DEFAULT_MAX_TOKENS: u64 = 256;

/// One `[[tenants]]` entry of the gateway's TOML.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// Shown in metrics and the admin API (never the keys).
    pub name: String,
    /// Keys inline. Never serialized back out.
    #[serde(default, skip_serializing)]
    pub api_keys: Vec<String>,
    /// A file with one key per line (blank lines and `#` comments skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_keys_file: Option<PathBuf>,
    /// An environment variable holding one key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Sustained requests per second (fractions allowed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<f64>,
    /// Requests that may arrive at once above the rate (default: the rate rounded up, ≥ 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Tokens per minute, charged `prompt tokens + max_tokens × n` per request; a minute's
    /// worth may be spent at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight at once (a streamed one until its body ends or the client leaves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    /// What a request without `max_tokens` is charged for its completion (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_max_tokens: Option<u64>,
}

impl std::fmt::Debug for TenantSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantSpec")
            .field("name", &self.name)
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("api_keys_file", &self.api_keys_file)
            .field("api_key_env", &self.api_key_env)
            .field("requests_per_second", &self.requests_per_second)
            .field("burst", &self.burst)
            .field("tokens_per_minute", &self.tokens_per_minute)
            .field("max_concurrent", &self.max_concurrent)
            .field("default_max_tokens", &self.default_max_tokens)
            .finish()
    }
}

impl TenantSpec {
    /// A tenant with one inline key and no limits.
    pub fn new(name: &str, key: &str) -> TenantSpec {
        TenantSpec {
            name: name.into(),
            api_keys: vec![key.into()],
            api_keys_file: None,
            api_key_env: None,
            requests_per_second: None,
            burst: None,
            tokens_per_minute: None,
            max_concurrent: None,
            default_max_tokens: None,
        }
    }
}

/// A tenant table that cannot be built; each names the tenant and the field.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("tenants[{0}].name is empty")]
    EmptyName(usize),
    #[error("tenant {0} is listed twice (tenants.name)")]
    DuplicateName(String),
    #[error("tenant {tenant}: {field} must be greater than 0")]
    NotPositive { tenant: String, field: &'static str },
    #[error("tenant {tenant}: {field} must be at most {max}")]
    TooLarge {
        tenant: String,
        field: &'static str,
        max: String,
    },
    #[error("tenant {0}: burst needs requests_per_second")]
    BurstWithoutRate(String),
    #[error("tenant {0}: no key (set api_keys, api_keys_file or api_key_env)")]
    NoKeys(String),
    #[error("tenant {tenant}: a key in {field} is empty or contains whitespace")]
    BadKey { tenant: String, field: &'static str },
    #[error("tenant {tenant}: api_keys_file {path}: {message}")]
    KeysFile {
        tenant: String,
        path: String,
        message: String,
    },
    #[error("tenant {tenant}: api_key_env: the variable {var} is not set or empty")]
    KeyEnv { tenant: String, var: String },
    #[error("tenants {first} and {second} share an API key (api_keys)")]
    DuplicateKey { first: String, second: String },
}

/// A tenant's limits, validated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Limits {
    /// (ns per request, burst).
    pub(crate) rate: Option<(u64, u64)>,
    /// (ns per token, a minute's tokens).
    pub(crate) tokens: Option<(u64, u64)>,
    pub(crate) max_concurrent: Option<u32>,
    pub(crate) default_max_tokens: u64,
}

impl Limits {
    fn of(spec: &TenantSpec) -> Result<Limits, TenantError> {
        let name = || spec.name.clone();
        let positive = |field, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(TenantError::NotPositive {
                    tenant: name(),
                    field,
                })
            }
        };
        let rate = match spec.requests_per_second {
            None if spec.burst.is_some() => return Err(TenantError::BurstWithoutRate(name())),
            None => None,
            Some(rps) => {
                positive("requests_per_second", rps.is_finite() && rps > 0.0)?;
                if rps > 1e9 {
                    return Err(TenantError::TooLarge {
                        tenant: name(),
                        field: "requests_per_second",
                        max: "1e9".into(),
                    });
                }
                let burst = spec.burst.unwrap_or(rps.ceil().max(1.0) as u32);
                positive("burst", burst > 0)?;
                Some(((NS_PER_SEC as f64 / rps).round() as u64, burst as u64))
            }
        };
        let tokens = match spec.tokens_per_minute {
            None => None,
            Some(tpm) => {
                positive("tokens_per_minute", tpm > 0)?;
                let max = 60 * NS_PER_SEC;
                if tpm > max {
                    return Err(TenantError::TooLarge {
                        tenant: name(),
                        field: "tokens_per_minute",
                        max: max.to_string(),
                    });
                }
                Some(((max as f64 / tpm as f64).round() as u64, tpm))
            }
        };
        if let Some(m) = spec.max_concurrent {
            positive("max_concurrent", m > 0)?;
        }
        if let Some(d) = spec.default_max_tokens {
            positive("default_max_tokens", d > 0)?;
        }
        Ok(Limits {
            rate,
            tokens,
            max_concurrent: spec.max_concurrent,
            default_max_tokens: spec.default_max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        })
    }
}

/// Every key of a spec: inline, from its file, from its variable.
fn keys_of(spec: &TenantSpec) -> Result<Vec<String>, TenantError> {
    let tenant = || spec.name.clone();
    let check = |field, k: &str| {
        if k.is_empty() || k.chars().any(char::is_whitespace) {
            Err(TenantError::BadKey {
                tenant: tenant(),
                field,
            })
        } else {
            Ok(())
        }
    };
    let mut keys = Vec::new();
    for k in &spec.api_keys {
        check("api_keys", k)?;
        keys.push(k.clone());
    }
    if let Some(path) = &spec.api_keys_file {
        let text = std::fs::read_to_string(path).map_err(|e| TenantError::KeysFile {
            tenant: tenant(),
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            check("api_keys_file", line)?;
            keys.push(line.to_string());
        }
    }
    if let Some(var) = &spec.api_key_env {
        let k = std::env::var(var).unwrap_or_default();
        let k = k.trim();
        if k.is_empty() {
            return Err(TenantError::KeyEnv {
                tenant: tenant(),
                var: var.clone(),
            });
        }
        check("api_key_env", k)?;
        keys.push(k.to_string());
    }
    if keys.is_empty() {
        return Err(TenantError::NoKeys(tenant()));
    }
    Ok(keys)
}

/// Checks a list of tenants as `Tenants::replace` would (keys are read from their files and
/// variables).
pub fn validate(specs: &[TenantSpec]) -> Result<(), TenantError> {
    resolve(specs).map(|_| ())
}

/// A validated spec: its name, limits and keys (what `Tenants` builds its table from).
pub(crate) struct Resolved {
    pub(crate) name: String,
    pub(crate) limits: Limits,
    pub(crate) keys: Vec<String>,
}

pub(crate) fn resolve(specs: &[TenantSpec]) -> Result<Vec<Resolved>, TenantError> {
    let mut names = BTreeMap::new();
    let mut owners: HashMap<[u8; 32], &str> = HashMap::new();
    let mut out = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        if spec.name.trim().is_empty() {
            return Err(TenantError::EmptyName(i));
        }
        if names.insert(spec.name.as_str(), i).is_some() {
            return Err(TenantError::DuplicateName(spec.name.clone()));
        }
        let limits = Limits::of(spec)?;
        let keys = keys_of(spec)?;
        for k in &keys {
            if let Some(first) = owners.insert(digest(k.as_bytes()), &spec.name) {
                return Err(TenantError::DuplicateKey {
                    first: first.to_string(),
                    second: spec.name.clone(),
                });
            }
        }
        out.push(Resolved {
            name: spec.name.clone(),
            limits,
            keys,
        });
    }
    Ok(out)
}

/// A key's SHA-256: what the live table looks keys up by.
pub(crate) fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}
