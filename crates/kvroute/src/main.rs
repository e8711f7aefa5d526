//! The `kvroute` command line: subcommands over the index, the wire and the conformance check.
//!
//! Owns: argument parsing (clap) and exit codes. Errors surface through `anyhow` with context.
//! Must not: hold logic that a library crate should own.

mod conformance;
mod events;
mod explain;
mod tokens;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand};
use kvroute_index::HashAlgo;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware router for hybrid LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct HashArgs {
    /// vLLM's --prefix-caching-hash-algo (sha256 | sha256_cbor).
    #[arg(long = "algo", alias = "hash-algo", default_value = "sha256")]
    algo: HashAlgo,
    /// NONE_HASH seed: the engine's PYTHONHASHSEED, else vLLM's default.
    #[arg(long, default_value = kvroute_index::hash::DEFAULT_SEED)]
    seed: String,
    /// Hash block size (vLLM's --prefix-match-unit); derived from the events when absent.
    #[arg(long)]
    hash_block_size: Option<u32>,
    /// Chunk size of chunked local attention groups.
    #[arg(long)]
    chunk_size: Option<u32>,
    /// Key blocks by the router's own content keys (SGLang, xxhash engines).
    #[arg(long)]
    content_keys: bool,
}

impl HashArgs {
    fn settings(&self) -> explain::HashSettings {
        explain::HashSettings {
            algo: self.algo,
            seed: self.seed.clone(),
            hash_block_size: self.hash_block_size,
            chunk_size: self.chunk_size,
            content_keys: self.content_keys,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Print vLLM's block hashes for a token list: index, 64-bit value, full digest.
    Hash {
        #[command(flatten)]
        hash: HashArgs,
        /// cache_salt of the request.
        #[arg(long)]
        salt: Option<String>,
        /// Token ids: `1,2,3`, ranges `0..40`, or `@FILE`.
        #[arg(long)]
        tokens: String,
    },
    /// Apply a file of normalized events and explain the prediction for a request.
    Explain {
        /// Normalized events, JSON lines (see docs/events.md; `kvroute events decode` writes them).
        #[arg(long)]
        events: PathBuf,
        #[arg(long)]
        tokens: String,
        #[arg(long)]
        salt: Option<String>,
        /// Only this worker.
        #[arg(long)]
        worker: Option<String>,
        #[command(flatten)]
        hash: HashArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Engine event tools.
    Events {
        #[command(subcommand)]
        cmd: EventsCmd,
    },
    /// Replay recorded corpora and check every prediction against the engine's own hit.
    Conformance {
        /// Corpus directories (kvroute-conformance/1).
        dirs: Vec<PathBuf>,
        /// Also print requests that pass.
        #[arg(long, short)]
        verbose: bool,
        /// Write the per-corpus report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum EventsCmd {
    /// Decode captured raw messages into normalized events (JSON lines on stdout; counts on stderr).
    Decode {
        file: PathBuf,
        /// vllm | sglang
        #[arg(long, default_value = "vllm")]
        dialect: String,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match cli.cmd {
        Cmd::Hash { hash, salt, tokens } => {
            let toks = tokens::parse_tokens(&tokens)?;
            explain::hash(&toks, &hash.settings(), salt, &mut out)
        }
        Cmd::Explain {
            events,
            tokens,
            salt,
            worker,
            hash,
            json,
        } => {
            let toks = tokens::parse_tokens(&tokens)?;
            explain::explain(
                &events,
                toks,
                salt,
                worker.as_deref(),
                &hash.settings(),
                json,
                &mut out,
            )
        }
        Cmd::Events {
            cmd: EventsCmd::Decode { file, dialect },
        } => {
            let Some(d) = kvroute_wire::Dialect::parse(&dialect) else {
                bail!("unknown dialect {dialect:?} (vllm | sglang)");
            };
            events::decode_file(&file, d, &mut out, &mut std::io::stderr())?;
            Ok(())
        }
        Cmd::Conformance {
            dirs,
            verbose,
            json,
        } => {
            if dirs.is_empty() {
                bail!("name at least one corpus directory");
            }
            let (mut passed, mut failed) = (0, 0);
            let mut reports = Vec::new();
            for d in &dirs {
                let r = conformance::run_corpus(d, &mut out, verbose)?;
                use std::io::Write;
                writeln!(
                    out,
                    "{}: {} requests, {} passed, {} failed; a group-blind predictor would be wrong on {}; hash check {} matched, {} mismatched; {} events dropped",
                    r.corpus, r.requests, r.passed, r.failed, r.group_blind_wrong, r.hash_check_matched, r.hash_check_mismatched, r.dropped_events
                )?;
                passed += r.passed;
                failed += r.failed;
                reports.push(r);
            }
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&reports)?)?;
            }
            use std::io::Write;
            writeln!(out, "{passed} passed, {failed} failed")?;
            if failed > 0 {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
