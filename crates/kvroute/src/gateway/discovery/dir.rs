//! Directory discovery: a directory of worker files, scanned every interval.
//!
//! Owns: per `*.toml` file its content hash and the workers it last gave; parsing a file (one
//! worker spec, or `[[workers]]` specs).
//! Invariants: every file is read every scan (worker files are small; a modification time can
//! be too coarse to see a rewrite) and parsed again only when its content hash changed; a file that does not parse or names an invalid worker is refused whole
//! with one log line per content, and keeps the workers it gave before (a new file gives none);
//! a removed file takes its workers with it; files are read in name order and a worker name
//! already given by an earlier file is refused; an unreadable directory is an error and an
//! empty one empty (the caller keeps its last good set either way).
//! Must not: follow anything but regular files ending in `.toml` (hidden files are skipped).

use super::outcome::Outcome;
use crate::gateway::config::discovery::DiscoveryConfig;
use crate::gateway::config::WorkerSpec;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[derive(Default)]
pub struct DirState {
    files: BTreeMap<PathBuf, FileState>,
}

struct FileState {
    hash: u64,
    /// The workers of the last version of the file that was accepted.
    specs: Vec<WorkerSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerList {
    workers: Vec<WorkerSpec>,
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The workers one file names.
pub fn parse_file(text: &str) -> Result<Vec<WorkerSpec>, String> {
    let table: toml::Table = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
    let specs = if table.contains_key("workers") {
        toml::Value::Table(table)
            .try_into::<WorkerList>()
            .map_err(|e| e.message().to_string())?
            .workers
    } else {
        vec![toml::Value::Table(table)
            .try_into::<WorkerSpec>()
            .map_err(|e| e.message().to_string())?]
    };
    let mut names = BTreeSet::new();
    for s in &specs {
        s.validate()?;
        if !names.insert(s.name.as_str()) {
            return Err(format!("worker {} is listed twice", s.name));
        }
    }
    Ok(specs)
}

impl DirState {
    /// One scan: every accepted file's workers (`None` keeps the last good set).
    pub async fn refresh(&mut self, c: &DiscoveryConfig) -> (Outcome, Option<Vec<WorkerSpec>>) {
        let Some(dir) = c.path.as_deref() else {
            return (Outcome::Error, None);
        };
        let present = match list(dir).await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(dir = %dir.display(), "reading the worker directory: {e}");
                return (Outcome::Error, None);
            }
        };
        self.files.retain(|p, _| present.contains(p));
        for path in present {
            self.read(path).await;
        }
        let mut specs = Vec::new();
        let mut names = BTreeSet::new();
        for (path, f) in &self.files {
            for s in &f.specs {
                if names.insert(s.name.clone()) {
                    specs.push(s.clone());
                } else {
                    tracing::debug!(file = %path.display(), worker = %s.name, "worker named by an earlier file too: refused");
                }
            }
        }
        if specs.is_empty() {
            return (Outcome::Empty, None);
        }
        (Outcome::Ok, Some(specs))
    }

    async fn read(&mut self, path: PathBuf) {
        let bytes = match tokio::fs::read(&path).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(file = %path.display(), "worker file unreadable: {e}");
                return;
            }
        };
        let hash = xxhash_rust::xxh3::xxh3_64(&bytes);
        if let Some(f) = self.files.get_mut(&path) {
            if f.hash == hash {
                return;
            }
            f.hash = hash;
        }
        let parsed = std::str::from_utf8(&bytes)
            .map_err(|e| format!("not UTF-8: {e}"))
            .and_then(parse_file);
        match parsed {
            Ok(specs) => {
                tracing::info!(file = %path.display(), workers = specs.len(), "worker file loaded");
                self.files.insert(path, FileState { hash, specs });
            }
            Err(e) => {
                let kept = self.files.get(&path).map_or(0, |f| f.specs.len());
                tracing::warn!(
                    file = %path.display(), kept_workers = kept,
                    "worker file refused, its previous workers kept: {e}"
                );
                self.files.entry(path).or_insert(FileState {
                    hash,
                    specs: Vec::new(),
                });
            }
        }
    }
}

/// The directory's `*.toml` regular files.
async fn list(dir: &Path) -> std::io::Result<BTreeSet<PathBuf>> {
    let mut out = BTreeSet::new();
    let mut entries = tokio::fs::read_dir(dir).await?;
    while let Some(e) = entries.next_entry().await? {
        let path = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || !name.ends_with(".toml") {
            continue;
        }
        let Ok(meta) = tokio::fs::metadata(&path).await else {
            continue;
        };
        if meta.is_file() {
            out.insert(path);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_file_holds_one_spec_or_a_list_and_refuses_bad_ones_whole() {
        let one = parse_file("name = 'a'\nurl = 'http://h:1'\nmodel = 'm'\n").unwrap();
        assert_eq!(one[0].name, "a");
        let two = parse_file(
            "[[workers]]\nname = 'a'\nurl = 'http://h:1'\nmodel = 'm'\n\
             [[workers]]\nname = 'b'\nurl = 'http://h:2'\nmodel = 'm'\n",
        )
        .unwrap();
        assert_eq!(two.len(), 2);
        for (text, why) in [
            ("name = 'a'\nurl = 'ftp://h'\nmodel = 'm'\n", "url"),
            ("name = 'a'\nurl = 'http://h'\n", "model"),
            ("name = 'a'\nurl = 'http://h'\nmodel = 'm'\ndp = 2\n", "dp"),
            ("name = ", "line 1"),
            (
                "[[workers]]\nname = 'a'\nurl = 'http://h:1'\nmodel = 'm'\n\
                 [[workers]]\nname = 'a'\nurl = 'http://h:2'\nmodel = 'm'\n",
                "twice",
            ),
        ] {
            let e = parse_file(text).unwrap_err();
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
