//! Warm restarts: the index written to a file and loaded back at start.
//!
//! Owns: the snapshot file format (TOML, `format = "kvroute-snapshot"`, `version = 1`, an xxh3
//! checksum over the body; per worker a fingerprint of what its hashes depend on, per DP rank
//! the stream position its state reflects and its image, block hashes packed as hex), capturing
//! the registry, writing atomically, loading, and matching a loaded snapshot to the configured
//! workers.
//! Invariants: a file is written under a temporary name beside the target, synced, then
//! renamed over it, so a reader finds the previous snapshot or the new one, never a torn one; a
//! file is loaded whole or not at all: a read or parse error (a truncated file), a foreign
//! format or version, a checksum mismatch or a malformed field refuses it, with the reason; a
//! worker whose fingerprint (URL, model, hash settings, DP size, event endpoints) changed starts
//! empty, as does every rank the snapshot does not hold; a snapshot that names none of the
//! configured workers is another fleet's and is refused.
//! Must not: apply anything to the index (the registry loads images as it adds workers), or run
//! on the async runtime's threads (callers use blocking threads: files can be large).

use super::config::WorkerSpec;
use super::registry::Registry;
use kvroute_index::image::{BlockRun, GroupImage, TierImage};
use kvroute_index::RankImage;
use kvroute_wire::StreamPosition;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub const FORMAT: &str = "kvroute-snapshot";
pub const VERSION: u32 = 1;

/// Why a snapshot was not written or not loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a readable snapshot (truncated or not TOML): {0}")]
    Parse(String),
    #[error("not a kvroute snapshot (format = {0:?})")]
    Format(String),
    #[error("snapshot version {0} is not this build's ({VERSION})")]
    Version(i64),
    #[error("checksum mismatch (file says {stated}, body is {actual}): the file is corrupt")]
    Checksum { stated: String, actual: String },
    #[error("malformed field: {0}")]
    Field(String),
    #[error("the snapshot is another fleet's: none of its workers ({0}) is configured")]
    OtherFleet(String),
    #[error("cannot encode the snapshot: {0}")]
    Encode(String),
}

#[derive(Serialize, Deserialize)]
struct File {
    format: String,
    version: u32,
    written_unix_ms: u64,
    checksum: String,
    body: Body,
}

#[derive(Default, Serialize, Deserialize)]
struct Body {
    workers: Vec<WorkerEntry>,
}

#[derive(Serialize, Deserialize)]
struct WorkerEntry {
    name: String,
    fingerprint: String,
    ranks: Vec<RankEntry>,
}

#[derive(Serialize, Deserialize)]
struct RankEntry {
    dp_rank: u32,
    /// The last batch the rank's state reflects, and its payload digest (hex).
    seq: u64,
    batch_digest: String,
    #[serde(default)]
    groups: Vec<GroupEntry>,
    #[serde(default)]
    tiers: Vec<TierEntry>,
}

#[derive(Serialize, Deserialize)]
struct GroupEntry {
    group: u32,
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sliding_window: Option<u32>,
    block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    partial_size: Option<u32>,
    #[serde(default)]
    runs: Vec<RunEntry>,
    /// Content-key workers: (engine hash, content key, copies) packed as 16 + 16 + 8 hex digits.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    content: String,
}

#[derive(Serialize, Deserialize)]
struct RunEntry {
    copies: u32,
    /// Block hashes in order, 16 hex digits each.
    hashes: String,
}

#[derive(Serialize, Deserialize)]
struct TierEntry {
    medium: String,
    /// The group the tier keyed the blocks by (0 when absent).
    #[serde(default)]
    group: u32,
    /// (hash, copies) packed as 16 + 8 hex digits.
    blocks: String,
}

/// What a worker's block hashes and event streams depend on: a snapshot taken under other
/// settings describes other blocks.
pub fn fingerprint(spec: &WorkerSpec) -> String {
    let hash = spec
        .index_config()
        .map(|c| format!("{:?}", c.hash))
        .unwrap_or_default();
    let events = spec
        .kv_events
        .as_ref()
        .map(|k| {
            format!(
                "{}|{:?}|{}|{}|{:?}",
                k.endpoint, k.replay_endpoint, k.topic, k.dialect, k.host
            )
        })
        .unwrap_or_default();
    let text = format!(
        "{}|{}|{}|{hash}|{:?}|{:?}|{events}",
        spec.url, spec.model, spec.dp_size, spec.hash_block_size, spec.chunk_size
    );
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

/// A captured fleet, ready to write.
pub struct Captured {
    body: Body,
    pub ranks: usize,
    /// Ranks not captured: degraded, or not yet positioned in their stream.
    pub ranks_skipped: usize,
    pub block_copies: u64,
}

/// Every healthy, positioned rank of every worker, each consistent with its position.
pub fn capture(registry: &Registry) -> Captured {
    let mut out = Captured {
        body: Body::default(),
        ranks: 0,
        ranks_skipped: 0,
        block_copies: 0,
    };
    for w in registry.all() {
        let mut ranks = Vec::new();
        for sink in w.sinks.lock().iter() {
            match sink.capture() {
                Some((at, image)) => {
                    out.block_copies += image.block_copies();
                    ranks.push(rank_entry(sink.dp_rank, at, &image));
                }
                None => out.ranks_skipped += 1,
            }
        }
        out.ranks += ranks.len();
        if !ranks.is_empty() {
            out.body.workers.push(WorkerEntry {
                name: w.spec.name.clone(),
                fingerprint: fingerprint(&w.spec),
                ranks,
            });
        }
    }
    out
}

/// What a write did.
#[derive(Clone, Debug, Serialize)]
pub struct Written {
    pub bytes: u64,
    pub ranks: usize,
    pub ranks_skipped: usize,
    pub block_copies: u64,
    pub seconds: f64,
    pub written_unix_ms: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn checksum(body: &Body) -> Result<String, SnapshotError> {
    let text = toml::to_string(body).map_err(|e| SnapshotError::Encode(e.to_string()))?;
    Ok(format!(
        "xxh3:{:016x}",
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    ))
}

/// Writes `captured` to `path` atomically (temporary file, fsync, rename, directory fsync).
pub fn write(path: &Path, captured: Captured) -> Result<Written, SnapshotError> {
    let started = Instant::now();
    let written_unix_ms = now_ms();
    let file = File {
        format: FORMAT.into(),
        version: VERSION,
        written_unix_ms,
        checksum: checksum(&captured.body)?,
        body: captured.body,
    };
    let text = toml::to_string(&file).map_err(|e| SnapshotError::Encode(e.to_string()))?;
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| SnapshotError::Io { path: p, source }
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(text.as_bytes()).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // The rename is durable once the directory is; not every platform can open one.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(Written {
        bytes: text.len() as u64,
        ranks: captured.ranks,
        ranks_skipped: captured.ranks_skipped,
        block_copies: captured.block_copies,
        seconds: started.elapsed().as_secs_f64(),
        written_unix_ms,
    })
}

/// One worker's ranks as a snapshot holds them.
pub type WorkerResume = BTreeMap<u32, (StreamPosition, RankImage)>;

/// A snapshot read and checked.
pub struct Loaded {
    pub written_unix_ms: u64,
    /// Worker name → (fingerprint, ranks).
    pub workers: BTreeMap<String, (String, WorkerResume)>,
}

/// Reads and checks the snapshot at `path`: `Ok(None)` when there is none.
pub fn load(path: &Path) -> Result<Option<Loaded>, SnapshotError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SnapshotError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    parse(&text).map(Some)
}

/// Checks and decodes a snapshot's text.
pub fn parse(text: &str) -> Result<Loaded, SnapshotError> {
    // The header first, so a foreign file is named as such rather than as a parse error of
    // fields it never had.
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| SnapshotError::Parse(e.message().to_string()))?;
    match table.get("format").and_then(|v| v.as_str()) {
        Some(FORMAT) => {}
        other => return Err(SnapshotError::Format(other.unwrap_or("").to_string())),
    }
    match table.get("version").and_then(|v| v.as_integer()) {
        Some(v) if v == VERSION as i64 => {}
        other => return Err(SnapshotError::Version(other.unwrap_or(-1))),
    }
    let file: File = toml::Table::try_into(table)
        .map_err(|e: toml::de::Error| SnapshotError::Parse(e.message().to_string()))?;
    let actual = checksum(&file.body)?;
    if actual != file.checksum {
        return Err(SnapshotError::Checksum {
            stated: file.checksum,
            actual,
        });
    }
    let mut workers = BTreeMap::new();
    for w in file.body.workers {
        let mut ranks = BTreeMap::new();
        for r in &w.ranks {
            let at = StreamPosition {
                seq: r.seq,
                digest: u64::from_str_radix(&r.batch_digest, 16)
                    .map_err(|_| field(&w.name, r.dp_rank, "batch_digest is not 16 hex digits"))?,
            };
            let image = rank_image(r).map_err(|e| field(&w.name, r.dp_rank, &e))?;
            image
                .check()
                .map_err(|e| field(&w.name, r.dp_rank, &e.to_string()))?;
            if ranks.insert(r.dp_rank, (at, image)).is_some() {
                return Err(field(&w.name, r.dp_rank, "rank listed twice"));
            }
        }
        if workers
            .insert(w.name.clone(), (w.fingerprint, ranks))
            .is_some()
        {
            return Err(SnapshotError::Field(format!(
                "worker {} listed twice",
                w.name
            )));
        }
    }
    Ok(Loaded {
        written_unix_ms: file.written_unix_ms,
        workers,
    })
}

fn field(worker: &str, rank: u32, what: &str) -> SnapshotError {
    SnapshotError::Field(format!("worker {worker} rank {rank}: {what}"))
}

/// How a loaded snapshot met the configured workers.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Matched {
    /// Workers whose ranks are resumed.
    pub resumed: Vec<String>,
    /// Workers in the snapshot whose settings changed since: they start empty.
    pub changed: Vec<String>,
    /// Workers in the snapshot that are not configured: with discovery on, kept for the
    /// workers it finds (a discovered worker of that name and fingerprint resumes them);
    /// otherwise dropped.
    pub gone: Vec<String>,
    pub ranks: usize,
}

/// Snapshot entries not claimed at start, for workers discovery may add: name →
/// (fingerprint, ranks). A worker takes its entry once, and only with the same fingerprint.
#[derive(Default)]
pub struct Unclaimed(parking_lot::Mutex<BTreeMap<String, (String, WorkerResume)>>);

impl Unclaimed {
    pub fn new(entries: BTreeMap<String, (String, WorkerResume)>) -> Unclaimed {
        Unclaimed(parking_lot::Mutex::new(entries))
    }

    /// Replaces the entries (at start, once the snapshot is read).
    pub fn set(&self, entries: BTreeMap<String, (String, WorkerResume)>) {
        *self.0.lock() = entries;
    }

    /// The ranks `spec` resumes, if the snapshot held its name under the same fingerprint.
    pub fn take(&self, spec: &WorkerSpec) -> WorkerResume {
        let mut m = self.0.lock();
        match m.remove(&spec.name) {
            Some((fp, ranks)) if fp == fingerprint(spec) => {
                tracing::info!(worker = %spec.name, ranks = ranks.len(), "discovered worker resumes from the snapshot");
                ranks
            }
            Some(_) => {
                tracing::warn!(worker = %spec.name, "discovered worker's settings changed since the snapshot: it starts empty");
                WorkerResume::new()
            }
            None => WorkerResume::new(),
        }
    }
}

/// What the start does with a loaded snapshot: the configured workers' ranks, the entries left
/// for discovery, and the report.
pub struct Plan {
    pub resume: BTreeMap<String, WorkerResume>,
    pub unclaimed: BTreeMap<String, (String, WorkerResume)>,
    pub matched: Matched,
}

/// Pairs a snapshot's workers with the configured ones: what each configured worker resumes.
/// With `discovery` on, the entries no configured worker claims are kept for discovered ones
/// (and a snapshot matching no configured worker is not another fleet's: its workers may all
/// be discovered).
pub fn match_workers(
    loaded: Loaded,
    specs: &[WorkerSpec],
    discovery: bool,
) -> Result<Plan, SnapshotError> {
    let mut m = Matched::default();
    let mut out = BTreeMap::new();
    let named: Vec<String> = loaded.workers.keys().cloned().collect();
    let mut workers = loaded.workers;
    for spec in specs {
        let Some((fp, ranks)) = workers.remove(&spec.name) else {
            continue;
        };
        if fp != fingerprint(spec) {
            m.changed.push(spec.name.clone());
            continue;
        }
        m.ranks += ranks.len();
        m.resumed.push(spec.name.clone());
        out.insert(spec.name.clone(), ranks);
    }
    m.gone = workers.keys().cloned().collect();
    if !discovery && !named.is_empty() && m.resumed.is_empty() && m.changed.is_empty() {
        return Err(SnapshotError::OtherFleet(named.join(", ")));
    }
    Ok(Plan {
        resume: out,
        unclaimed: if discovery { workers } else { BTreeMap::new() },
        matched: m,
    })
}

fn hex_u64s(values: impl Iterator<Item = u64>) -> String {
    values.map(|v| format!("{v:016x}")).collect()
}

fn rank_entry(dp_rank: u32, at: StreamPosition, image: &RankImage) -> RankEntry {
    RankEntry {
        dp_rank,
        seq: at.seq,
        batch_digest: format!("{:016x}", at.digest),
        groups: image
            .groups
            .iter()
            .map(|g| GroupEntry {
                group: g.group,
                kind: g.kind.clone(),
                sliding_window: g.sliding_window,
                block_size: g.block_size,
                partial_size: g.partial_size,
                runs: g
                    .runs
                    .iter()
                    .map(|r| RunEntry {
                        copies: r.copies,
                        hashes: hex_u64s(r.hashes.iter().copied()),
                    })
                    .collect(),
                content: g
                    .content
                    .iter()
                    .map(|(h, k, c)| format!("{h:016x}{k:016x}{c:08x}"))
                    .collect(),
            })
            .collect(),
        tiers: image
            .offload
            .iter()
            .map(|t| TierEntry {
                medium: t.medium.clone(),
                group: t.group,
                blocks: t
                    .blocks
                    .iter()
                    .map(|(h, c)| format!("{h:016x}{c:08x}"))
                    .collect(),
            })
            .collect(),
    }
}

/// Splits packed hex into records of `widths` hex digits each.
fn unpack(text: &str, widths: &[usize], what: &str) -> Result<Vec<Vec<u64>>, String> {
    let record: usize = widths.iter().sum();
    if !text.is_ascii() || !text.len().is_multiple_of(record) {
        return Err(format!("{what}: not records of {record} hex digits"));
    }
    text.as_bytes()
        .chunks(record)
        .map(|rec| {
            let mut at = 0;
            widths
                .iter()
                .map(|w| {
                    let digits = std::str::from_utf8(&rec[at..at + w]).unwrap_or("");
                    at += w;
                    u64::from_str_radix(digits, 16)
                        .map_err(|_| format!("{what}: {digits:?} is not hex"))
                })
                .collect()
        })
        .collect()
}

fn rank_image(r: &RankEntry) -> Result<RankImage, String> {
    let mut groups = Vec::with_capacity(r.groups.len());
    for g in &r.groups {
        let mut runs = Vec::with_capacity(g.runs.len());
        for run in &g.runs {
            let hashes = unpack(&run.hashes, &[16], "hashes")?;
            runs.push(BlockRun {
                copies: run.copies,
                hashes: hashes.into_iter().map(|v| v[0]).collect(),
            });
        }
        let content = unpack(&g.content, &[16, 16, 8], "content")?
            .into_iter()
            .map(|v| (v[0], v[1], v[2] as u32))
            .collect();
        groups.push(GroupImage {
            group: g.group,
            kind: g.kind.clone(),
            sliding_window: g.sliding_window,
            block_size: g.block_size,
            partial_size: g.partial_size,
            runs,
            content,
        });
    }
    let mut offload = Vec::with_capacity(r.tiers.len());
    for t in &r.tiers {
        let blocks = unpack(&t.blocks, &[16, 8], "tier blocks")?
            .into_iter()
            .map(|v| (v[0], v[1] as u32))
            .collect();
        offload.push(TierImage {
            medium: t.medium.clone(),
            group: t.group,
            blocks,
        });
    }
    Ok(RankImage { groups, offload })
}

/// What the start did with the snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    /// `loaded`, `absent` (no file: a cold start) or `refused` (a cold start, with the reason).
    pub result: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub written_unix_ms: Option<u64>,
    pub matched: Matched,
    pub seconds: f64,
}

/// The snapshot state an operator sees (`GET /admin/snapshot`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    pub path: Option<PathBuf>,
    pub load: Option<LoadReport>,
    pub last_write: Option<Written>,
    pub last_error: Option<String>,
    pub writes: u64,
    pub failures: u64,
}

/// Reads the snapshot at `path` and matches it to `specs` (on a blocking thread): what each
/// worker resumes, and the report. Every refusal is a cold start, logged with its reason.
pub async fn load_for(
    path: PathBuf,
    specs: Vec<WorkerSpec>,
    discovery: bool,
) -> (Plan, LoadReport) {
    let started = Instant::now();
    let shown = path.display().to_string();
    let outcome = tokio::task::spawn_blocking(move || -> Result<_, SnapshotError> {
        match load(&path)? {
            None => Ok(None),
            Some(loaded) => {
                let at = loaded.written_unix_ms;
                let plan = match_workers(loaded, &specs, discovery)?;
                Ok(Some((plan, at)))
            }
        }
    })
    .await
    .unwrap_or_else(|e| Err(SnapshotError::Parse(format!("loader stopped: {e}"))));
    let seconds = started.elapsed().as_secs_f64();
    let report = |result, reason, written_unix_ms, matched| LoadReport {
        result,
        reason,
        written_unix_ms,
        matched,
        seconds,
    };
    let empty = || Plan {
        resume: BTreeMap::new(),
        unclaimed: BTreeMap::new(),
        matched: Matched::default(),
    };
    match outcome {
        Ok(None) => {
            tracing::info!(path = %shown, "no snapshot: a cold start");
            (empty(), report("absent", None, None, Matched::default()))
        }
        Ok(Some((plan, at))) => {
            let matched = plan.matched.clone();
            let age = now_ms().saturating_sub(at) as f64 / 1000.0;
            tracing::info!(
                path = %shown, ranks = matched.ranks, resumed = ?matched.resumed,
                changed = ?matched.changed, gone = ?matched.gone, age_secs = age, seconds,
                "snapshot loaded: ranks resume from their positions through the engines' replay"
            );
            if !matched.changed.is_empty() {
                tracing::warn!(workers = ?matched.changed, "workers whose settings changed since the snapshot start empty");
            }
            (plan, report("loaded", None, Some(at), matched))
        }
        Err(e) => {
            tracing::warn!(path = %shown, reason = %e, "snapshot refused: a cold start");
            (
                empty(),
                report("refused", Some(e.to_string()), None, Matched::default()),
            )
        }
    }
}

/// Captures and writes the registry's index to `path` on a blocking thread.
pub async fn write_registry(
    registry: std::sync::Arc<Registry>,
    path: PathBuf,
) -> Result<Written, SnapshotError> {
    tokio::task::spawn_blocking(move || write(&path, capture(&registry)))
        .await
        .unwrap_or_else(|e| Err(SnapshotError::Encode(format!("writer stopped: {e}"))))
}

#[cfg(test)]
mod tests;
