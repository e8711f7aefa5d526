//! `kvroute events decode`: raw captured messages → normalized events, with counts.
//!
//! Owns: reading capture/corpus frame files (`{"worker", "frames": [base64, ...]}` lines),
//! decoding each message with kvroute-wire, printing events as JSON lines on stdout and, at
//! the end, counts by disposition and drop reason on stderr.
//! Must not: stop at a bad line: it is counted and reported, the rest still decodes.

use crate::conformance::FrameLine;
use anyhow::{Context, Result};
use base64::Engine as _;
use kvroute_wire::{decode_batch, split_live, Dialect};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

pub fn decode_file(
    path: &Path,
    dialect: Dialect,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<BTreeMap<String, u64>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut bump = |k: String| *counts.entry(k).or_insert(0) += 1;
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: unreadable", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let rec: FrameLine = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                writeln!(err, "{}:{}: invalid record: {e}", path.display(), i + 1)?;
                bump("messages_invalid_record".into());
                continue;
            }
        };
        let Ok(raw) = rec
            .frames
            .iter()
            .map(|f| b64.decode(f))
            .collect::<Result<Vec<_>, _>>()
        else {
            writeln!(err, "{}:{}: bad base64", path.display(), i + 1)?;
            bump("messages_bad_base64".into());
            continue;
        };
        let refs: Vec<&[u8]> = raw.iter().map(Vec::as_slice).collect();
        let live = match split_live(&refs) {
            Ok(l) => l,
            Err(e) => {
                bump(format!("messages_{}", e.name()));
                continue;
            }
        };
        let worker: kvroute_index::WorkerId = rec.worker.as_str().into();
        match decode_batch(&worker, live.payload, dialect) {
            Ok(batch) => {
                bump("batches_decoded".into());
                for ev in &batch.events {
                    bump(format!(
                        "events_{}",
                        match ev {
                            kvroute_index::Event::Stored(_) => "stored",
                            kvroute_index::Event::Removed(_) => "removed",
                            kvroute_index::Event::Cleared(_) => "cleared",
                        }
                    ));
                    writeln!(out, "{}", serde_json::to_string(ev)?)?;
                }
                for d in &batch.drops {
                    bump(format!("dropped_{}", d.reason.name()));
                }
            }
            Err(e) => bump(format!("batches_refused_{}", e.reason.name())),
        }
    }
    for (k, v) in &counts {
        writeln!(err, "{k}: {v}")?;
    }
    Ok(counts)
}
