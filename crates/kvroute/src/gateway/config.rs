//! Gateway configuration: the TOML file and the worker specs, in vLLM's own vocabulary.
//!
//! Owns: `WorkerSpec` (HTTP URL, model, `kv_events` endpoint/replay/topic like vLLM's
//! `--kv-events-config`, DP size, hash settings like `--prefix-caching-hash-algo` and
//! `PYTHONHASHSEED`, the engine generation, `--speculative-config`'s fields and the LoRA
//! adapters of `--lora-modules`) with validation that names the offending field, the
//! `--worker` flag keys for those, and `Secret`. The file's other parts are submodules:
//! [`file`] (`GatewayConfig`, the file as a whole: listen addresses, policy, limits, admin
//! token, snapshot and shutdown settings, drain timeout), the `[weights]` section ([`PolicyWeights`], plain
//! data of the routing core, `kvroute_route::config`), [`tenants`] (the `[[tenants]]` entries) and [`discovery`] (the
//! `[discovery]` section) and [`tls`] (the listeners' and engines' TLS) and [`otel`] (the `[tracing]` section: where
//! OpenTelemetry traces go).
//! Invariants: this module and its submodules are plain data and import no other gateway
//! module beside the routing core's plain data (`kvroute_route`).
//! Must not: start anything.

use kvroute_index::tier::OffloadConnector;
use kvroute_index::{Engine, HashAlgo, HashMode, LookupConfig, Speculative, WorkerConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub mod discovery;
pub mod file;
pub mod otel;
pub mod peers;
pub mod tenants;
pub mod tls;
pub use kvroute_route::config::{CostModel, PolicyWeights, PrefillStall};

/// vLLM's `--kv-events-config`, as the engine was started with it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSpec {
    /// The engine's `endpoint`. vLLM binds wildcard endpoints (`tcp://*:5557`): the router
    /// connects to `host`:5557. vLLM *connects* to concrete tcp addresses
    /// (`tcp://10.0.0.9:5557`): the router binds that address, which must be its own.
    pub endpoint: String,
    /// The engine's `replay_endpoint`, if configured.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub topic: String,
    /// Host to connect to when the endpoint is a wildcard (`*`); defaults to the URL's host.
    #[serde(default)]
    pub host: Option<String>,
    /// `vllm` (default) or `sglang`.
    #[serde(default = "default_dialect")]
    pub dialect: String,
    /// A connected subscription that hears nothing for this long reconnects (and, with a
    /// replay endpoint, asks what it missed): the SUB socket cannot tell a silent engine from
    /// a cut connection. 0 never reconnects on silence.
    #[serde(default = "default_idle_reconnect")]
    pub idle_reconnect_secs: f64,
}

fn default_dialect() -> String {
    "vllm".into()
}

/// The default [`KvEventsSpec::idle_reconnect_secs`].
pub const DEFAULT_IDLE_RECONNECT_SECS: f64 = 30.0;

fn default_idle_reconnect() -> f64 {
    DEFAULT_IDLE_RECONNECT_SECS
}

impl KvEventsSpec {
    /// vLLM's defaults for an engine publishing on `endpoint`.
    pub fn new(endpoint: impl Into<String>) -> KvEventsSpec {
        KvEventsSpec {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            host: None,
            dialect: default_dialect(),
            idle_reconnect_secs: DEFAULT_IDLE_RECONNECT_SECS,
        }
    }
}

/// One engine behind the gateway.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    pub name: String,
    /// Base URL of the OpenAI-compatible server, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// The served model name(s).
    pub model: String,
    #[serde(default)]
    pub kv_events: Option<KvEventsSpec>,
    /// `--data-parallel-size` of the engine: ranks publish on `port + rank`.
    #[serde(default = "one")]
    pub dp_size: u32,
    /// `--prefix-caching-hash-algo`: `sha256` (default), `sha256_cbor`; anything else (xxhash)
    /// needs `content_keys`.
    #[serde(default = "default_algo")]
    pub hash_algo: String,
    /// The engine's `PYTHONHASHSEED`, if set (else vLLM's default seed).
    #[serde(default)]
    pub hash_seed: Option<String>,
    /// `--prefix-match-unit`, if set.
    #[serde(default)]
    pub hash_block_size: Option<u32>,
    /// Chunk of chunked local attention (the model's `attention_chunk_size`).
    #[serde(default)]
    pub chunk_size: Option<u32>,
    /// GPU blocks per chunk of the engine's `OffloadingConnector` (its `blocks_per_chunk`, or
    /// its `block_size` over the GPU block); 1, the connector's default, when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_chunk_blocks: Option<u32>,
    /// The connector keeping the engine's offload tiers: `offloading` (the
    /// `OffloadingConnector`, the default) or `simple-cpu` (the `SimpleCPUOffloadConnector`).
    #[serde(default, skip_serializing_if = "is_default_connector")]
    pub offload_connector: OffloadConnector,
    /// Key blocks by the router's own content keys (SGLang; xxhash engines).
    #[serde(default)]
    pub content_keys: bool,
    /// The engine generation (`vllm-0.32`, `vllm-0.33`); when absent, the worker's
    /// `GET /version` names it (vLLM 0.32's rules until it answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<Engine>,
    /// The engine's speculative decoding: `true` for an EAGLE-style drafter reading one token
    /// ahead (EAGLE, EAGLE3, single-module MTP), or vLLM's `--speculative-config` fields
    /// (`{ method = "mtp", num_speculative_tokens = 3, num_nextn_predict_layers = 3 }`).
    #[serde(default)]
    pub speculative: SpeculativeSpec,
    /// vLLM 0.33's `num_hash_lookahead_tokens`, when the engine's differs from what
    /// `speculative` implies (a KV connector keeps it 0). Only meaningful on vLLM 0.33.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_lookahead_tokens: Option<u32>,
    /// A model directory with `tokenizer.json` (and `tokenizer_config.json`'s chat template):
    /// the gateway tokenizes itself instead of asking the worker's `/tokenize`.
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// LoRA adapters the engine serves (its `--lora-modules`): name → path, the path exactly as
    /// the engine was given it (it is part of the block hash). The worker's `/v1/models`
    /// (adapters listed with a `parent`, `root` the path) adds and overrides these.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lora_modules: BTreeMap<String, String>,
    /// Its part in disaggregated serving ([`Role`]).
    #[serde(default)]
    pub role: Role,
}

/// A worker's part in disaggregated serving. A model with `prefill` and `decode` workers is
/// served in two legs: the prompt on a prefill worker (its engine a KV producer), the answer
/// on a decode worker (a KV consumer) that pulls the prefill worker's KV; `both` workers serve
/// requests whole, as do prefill or decode workers of a model that lacks the other role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(format!("unknown role {s:?} (both | prefill | decode)")),
        }
    }
}

/// A worker's speculative decoding, as the spec gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SpeculativeSpec {
    /// `false`: none; `true`: an EAGLE-style drafter reading one token ahead (as
    /// `{ method = "eagle" }`).
    Flag(bool),
    /// vLLM's `--speculative-config` fields (the rest of vLLM's JSON is accepted and ignored).
    Config(Speculative),
}

impl Default for SpeculativeSpec {
    fn default() -> Self {
        SpeculativeSpec::Flag(false)
    }
}

impl std::str::FromStr for SpeculativeSpec {
    type Err = std::str::ParseBoolError;
    /// The `--worker` form `speculative=true|false`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(SpeculativeSpec::Flag)
    }
}

impl SpeculativeSpec {
    /// Whether matches drop the EAGLE block on `engine` (before lookahead hashes, which
    /// `lookahead` decides, turn it off).
    fn drops(&self, engine: Engine) -> bool {
        match self {
            SpeculativeSpec::Flag(on) => *on,
            SpeculativeSpec::Config(s) => s.drops_eagle_block(engine),
        }
    }

    /// Whether `engine` flags KV cache groups as the drafter's (`true` is an `eagle` drafter).
    fn flags_drafter_groups(&self, engine: Engine) -> bool {
        match self {
            SpeculativeSpec::Flag(on) => *on && engine == Engine::Vllm033,
            SpeculativeSpec::Config(s) => s.flags_drafter_groups(engine),
        }
    }

    /// The lookahead count `engine` derives.
    fn lookahead(&self, engine: Engine) -> u32 {
        match self {
            SpeculativeSpec::Flag(true) if engine == Engine::Vllm033 => 1,
            SpeculativeSpec::Flag(_) => 0,
            SpeculativeSpec::Config(s) => s.hash_lookahead_tokens(engine),
        }
    }

    fn is_on(&self) -> bool {
        !matches!(self, SpeculativeSpec::Flag(false))
    }

    /// The fields, turning `true`/`false` into an EAGLE config first (the `--worker` keys).
    fn config_mut(&mut self) -> &mut Speculative {
        if let SpeculativeSpec::Flag(_) = self {
            *self = SpeculativeSpec::Config(Speculative {
                method: "eagle".into(),
                num_speculative_tokens: 1,
                num_nextn_predict_layers: None,
                disable_lookahead_block_hashes: false,
                disable_eagle_block_drop: false,
            });
        }
        match self {
            SpeculativeSpec::Config(s) => s,
            SpeculativeSpec::Flag(_) => unreachable!("turned into a config above"),
        }
    }
}

/// The largest `hash_lookahead_tokens` accepted (vLLM requires the block size to cover it).
const MAX_LOOKAHEAD: u32 = 4096;

fn one() -> u32 {
    1
}
fn is_default_connector(c: &OffloadConnector) -> bool {
    *c == OffloadConnector::default()
}

fn default_algo() -> String {
    "sha256".into()
}

impl WorkerSpec {
    pub fn new(name: &str, url: &str, model: &str) -> WorkerSpec {
        WorkerSpec {
            name: name.into(),
            url: url.into(),
            model: model.into(),
            kv_events: None,
            dp_size: 1,
            hash_algo: default_algo(),
            hash_seed: None,
            hash_block_size: None,
            chunk_size: None,
            offload_chunk_blocks: None,
            offload_connector: Default::default(),
            content_keys: false,
            engine: None,
            speculative: SpeculativeSpec::default(),
            hash_lookahead_tokens: None,
            model_dir: None,
            lora_modules: BTreeMap::new(),
            role: Role::Both,
        }
    }

    /// Whether the configuration names a KV connector on the engine: a
    /// `SimpleCPUOffloadConnector`, an `OffloadingConnector` chunk, or a prefill/decode role.
    fn names_a_kv_connector(&self) -> bool {
        self.offload_connector == OffloadConnector::SimpleCpu
            || self.offload_chunk_blocks.is_some()
            || self.role != Role::Both
    }

    /// The index configuration this worker needs, under its configured engine (vLLM 0.32's
    /// when none is configured).
    pub fn index_config(&self) -> Result<WorkerConfig, String> {
        self.index_config_for(self.engine.unwrap_or_default())
    }

    /// The index configuration this worker needs when it runs `engine`: the EAGLE drop and
    /// the lookahead count follow from `speculative` (or `hash_lookahead_tokens`) as that
    /// generation derives them.
    pub fn index_config_for(&self, engine: Engine) -> Result<WorkerConfig, String> {
        let hash = if self.content_keys
            || self
                .kv_events
                .as_ref()
                .is_some_and(|k| k.dialect == "sglang")
        {
            HashMode::ContentKey
        } else {
            let algo: HashAlgo = self
                .hash_algo
                .parse()
                .map_err(|e| format!("worker {}: {e}", self.name))?;
            HashMode::Engine {
                algo,
                seed: self
                    .hash_seed
                    .clone()
                    .unwrap_or_else(|| kvroute_index::hash::DEFAULT_SEED.into()),
            }
        };
        Ok(WorkerConfig {
            hash,
            lookup: LookupConfig {
                hash_block_size: self.hash_block_size,
                chunk_size: self.chunk_size,
                eagle: self.speculative.drops(engine),
                offload_chunk_blocks: self.offload_chunk_blocks,
                offload_connector: self.offload_connector,
                drafter_groups_unflagged: !self.speculative.flags_drafter_groups(engine),
            },
            verify_hashes: true,
            engine,
            hash_lookahead_tokens: self.hash_lookahead_tokens.unwrap_or_else(|| {
                if self.names_a_kv_connector() {
                    // vLLM turns lookahead hashes off under any KV connector.
                    0
                } else {
                    self.speculative.lookahead(engine)
                }
            }),
        })
    }

    /// Sets one `--worker` key this module owns: `engine`, `speculative_method`,
    /// `num_speculative_tokens`, `num_nextn_predict_layers`, `disable_lookahead_block_hashes`,
    /// `disable_eagle_block_drop`, `hash_lookahead_tokens`, `lora_module` (`name:path`, once
    /// per adapter). Any other key is an error.
    pub fn set_flag(&mut self, key: &str, value: &str) -> Result<(), String> {
        let bad = |e: &dyn std::fmt::Display| format!("{key}={value}: {e}");
        match key {
            "engine" => self.engine = Some(value.parse().map_err(|e: String| bad(&e))?),
            "role" => self.role = value.parse().map_err(|e: String| bad(&e))?,
            "speculative_method" => self.speculative.config_mut().method = value.into(),
            "num_speculative_tokens" => {
                self.speculative.config_mut().num_speculative_tokens =
                    value.parse().map_err(|e| bad(&e))?
            }
            "num_nextn_predict_layers" => {
                self.speculative.config_mut().num_nextn_predict_layers =
                    Some(value.parse().map_err(|e| bad(&e))?)
            }
            "disable_lookahead_block_hashes" => {
                self.speculative.config_mut().disable_lookahead_block_hashes =
                    value.parse().map_err(|e| bad(&e))?
            }
            "disable_eagle_block_drop" => {
                self.speculative.config_mut().disable_eagle_block_drop =
                    value.parse().map_err(|e| bad(&e))?
            }
            "hash_lookahead_tokens" => {
                self.hash_lookahead_tokens = Some(value.parse().map_err(|e| bad(&e))?)
            }
            "lora_module" => match value.split_once(':') {
                Some((name, path)) if !name.is_empty() && !path.is_empty() => {
                    self.lora_modules.insert(name.into(), path.into());
                }
                _ => return Err(bad(&"expected name:path")),
            },
            other => return Err(format!("unknown key {other:?}")),
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > 128 || self.name.contains(char::is_whitespace)
        {
            return Err(format!(
                "worker name {:?}: 1-128 characters, no spaces",
                self.name
            ));
        }
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return Err(format!(
                "worker {}: url must start with http:// or https://",
                self.name
            ));
        }
        if self.model.is_empty() {
            return Err(format!("worker {}: model is empty", self.name));
        }
        if self.dp_size == 0 || self.dp_size > 1024 {
            return Err(format!("worker {}: dp_size must be 1..=1024", self.name));
        }
        if let Some(k) = &self.kv_events {
            if kvroute_wire::Dialect::parse(&k.dialect).is_none() {
                return Err(format!(
                    "worker {}: kv_events.dialect must be vllm or sglang",
                    self.name
                ));
            }
            if !(k.idle_reconnect_secs.is_finite() && k.idle_reconnect_secs >= 0.0) {
                return Err(format!(
                    "worker {}: kv_events.idle_reconnect_secs must be 0 or a positive number of seconds",
                    self.name
                ));
            }
        }
        if let SpeculativeSpec::Config(s) = &self.speculative {
            if s.num_speculative_tokens == 0 {
                return Err(format!(
                    "worker {}: speculative.num_speculative_tokens must be at least 1",
                    self.name
                ));
            }
        }
        if let Some(l) = self.hash_lookahead_tokens {
            if l > MAX_LOOKAHEAD {
                return Err(format!(
                    "worker {}: hash_lookahead_tokens must be at most {MAX_LOOKAHEAD}",
                    self.name
                ));
            }
            if l > 0 && self.engine == Some(Engine::Vllm032) {
                return Err(format!(
                    "worker {}: hash_lookahead_tokens is vLLM 0.33's (engine is vllm-0.32)",
                    self.name
                ));
            }
            if l > 0 && !self.speculative.is_on() {
                return Err(format!(
                    "worker {}: hash_lookahead_tokens > 0 needs speculative (vLLM hashes with \
                     lookahead only under EAGLE-style speculation)",
                    self.name
                ));
            }
        }
        self.index_config().map(|_| ())
    }

    /// The host to reach this worker's wildcard event endpoints on.
    pub fn event_host(&self) -> String {
        if let Some(h) = self.kv_events.as_ref().and_then(|k| k.host.clone()) {
            return h;
        }
        let rest = self.url.split("://").nth(1).unwrap_or("127.0.0.1");
        let hostport = rest.split('/').next().unwrap_or("127.0.0.1");
        match hostport.rsplit_once(':') {
            Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']').to_string(),
            None => hostport.to_string(),
        }
    }
}

/// A credential from the configuration: compared, never shown (`Debug` prints `<redacted>`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret(s.into())
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(s)
    }
}

#[cfg(test)]
mod tests;
