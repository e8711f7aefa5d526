//! The workloads `kvroute bench` replays: a Mooncake-format trace or one of the seeded built-in
//! generators, as sessions of turns with arrival times.
//!
//! Owns: building a [`Workload`] (its data in `sessions`: sessions, each a start time and
//! turns; a turn's prompt is the session's history — the previous prompt, the reply the target
//! gave, then the new user text — so a multi-turn conversation is sent back as a chat client
//! sends it), the Mooncake reader, the generators `shared-prefix`, `multi-turn`, `agentic`, `rag` and `tenants` (in [`tenants`]),
//! and the token spelling that makes text and token-id prompts agree on the simulated engine.
//! Invariants: the same options and seed give the same workload; every generated token is a
//! word id of the simulator's tokenizer (`FIRST_WORD ≤ id < vocab`), so its text spelling
//! tokenizes back to exactly the same ids; in a Mooncake trace two requests share a token
//! prefix exactly when they share leading block ids.
//! Must not: read anything but the given trace file, or depend on the target.

mod sessions;
mod tenants;

pub use sessions::{Rng, Session, Shape, Turn, Workload};
pub use tenants::{tenant_prompts, tenants, Tenants};

use anyhow::{bail, Context, Result};

/// The Mooncake trace's own tokens per block id.
pub const MOONCAKE_BLOCK: usize = 512;

/// A Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
/// `hash_ids`): each line one single-turn session; block id `b` becomes `tokens_per_block`
/// word tokens determined by `b` alone, the prompt trimmed to `input_length` scaled the same
/// way and to `max_prompt`.
pub fn mooncake(text: &str, origin: &str, tokens_per_block: usize, s: &Shape) -> Result<Workload> {
    let lines = crate::demo::trace::parse(text, origin)?;
    let mut sessions = Vec::with_capacity(lines.len());
    let t0 = lines.first().map_or(0.0, |l| l.timestamp);
    for l in &lines {
        let want = ((l.input_length as f64) * tokens_per_block as f64 / MOONCAKE_BLOCK as f64)
            .ceil() as usize;
        let mut user = Vec::with_capacity(want);
        for id in &l.hash_ids {
            user.extend(
                Rng::new(id.wrapping_mul(0x2545_f491_4f6c_dd1d)).words(tokens_per_block, s.vocab),
            );
            if user.len() >= want {
                break;
            }
        }
        user.truncate(want.clamp(1, s.max_prompt.max(1)));
        if user.is_empty() {
            continue;
        }
        sessions.push(Session {
            start_ms: (l.timestamp - t0).max(0.0),
            system: Vec::new(),
            turns: vec![Turn {
                user,
                max_tokens: (l.output_length as u32).clamp(1, s.max_output.max(1)),
                think_ms: 0.0,
                branches: Vec::new(),
            }],
        });
    }
    if sessions.is_empty() {
        bail!("{origin}: no request in the trace");
    }
    Ok(Workload {
        name: format!("mooncake:{origin}"),
        sessions,
    })
}

/// `shared-prefix`: `groups` system prompts of `prefix` tokens, each shared by `users` users
/// who ask `questions` questions of `question` tokens each (single-turn requests, the users'
/// requests interleaved at random, Poisson arrivals at one per second before scaling).
#[derive(Clone, Debug)]
pub struct SharedPrefix {
    pub groups: usize,
    pub prefix: usize,
    pub users: usize,
    pub questions: usize,
    pub question: usize,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        SharedPrefix {
            groups: 8,
            prefix: 2048,
            users: 16,
            questions: 4,
            question: 128,
        }
    }
}

fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.range(0, i);
        v.swap(i, j);
    }
}

fn poisson_starts(sessions: &mut [Session], rng: &mut Rng) {
    let mut t = 0.0;
    for s in sessions.iter_mut() {
        s.start_ms = t;
        t += rng.exp(1000.0);
    }
}

fn clip(mut v: Vec<u32>, n: usize) -> Vec<u32> {
    v.truncate(n.max(1));
    v
}

pub fn shared_prefix(p: &SharedPrefix, s: &Shape) -> Workload {
    let mut rng = Rng::new(s.seed);
    let prefixes: Vec<Vec<u32>> = (0..p.groups)
        .map(|_| {
            rng.words(
                p.prefix.min(s.max_prompt.saturating_sub(p.question)),
                s.vocab,
            )
        })
        .collect();
    let mut sessions = Vec::new();
    for prefix in &prefixes {
        for _ in 0..p.users * p.questions {
            sessions.push(Session {
                start_ms: 0.0,
                system: prefix.clone(),
                turns: vec![Turn {
                    user: clip(
                        rng.words(p.question, s.vocab),
                        s.max_prompt - prefix.len().min(s.max_prompt - 1),
                    ),
                    max_tokens: s.max_output,
                    think_ms: 0.0,
                    branches: Vec::new(),
                }],
            });
        }
    }
    shuffle(&mut sessions, &mut rng);
    poisson_starts(&mut sessions, &mut rng);
    Workload {
        name: "shared-prefix".into(),
        sessions,
    }
}

/// `multi-turn`: conversations with a short system prompt shared by all, `turns` turns each
/// (between `min_turns` and `max_turns`), user messages of `message` tokens, the assistant's
/// replies sent back as history; conversations start as a Poisson process, turns follow the
/// reply after a think time.
#[derive(Clone, Debug)]
pub struct MultiTurn {
    pub conversations: usize,
    pub system: usize,
    pub min_turns: usize,
    pub max_turns: usize,
    pub message: usize,
    pub think_ms: f64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        MultiTurn {
            conversations: 64,
            system: 256,
            min_turns: 3,
            max_turns: 8,
            message: 384,
            think_ms: 2000.0,
        }
    }
}

/// How many tokens a session's history can reach; turns past `max_prompt` are not generated.
fn fits(len: usize, user: usize, reply: u32, max_prompt: usize) -> bool {
    len + user + reply as usize <= max_prompt
}

/// Sessions over one shared system prompt, each with its turns (those with none dropped),
/// starting as a Poisson process.
fn conversations(name: &str, system: &[u32], turns: Vec<Vec<Turn>>, rng: &mut Rng) -> Workload {
    let mut sessions: Vec<Session> = turns
        .into_iter()
        .filter(|t| !t.is_empty())
        .map(|turns| Session {
            start_ms: 0.0,
            system: system.to_vec(),
            turns,
        })
        .collect();
    poisson_starts(&mut sessions, rng);
    Workload {
        name: name.into(),
        sessions,
    }
}

pub fn multi_turn(m: &MultiTurn, s: &Shape) -> Workload {
    let mut rng = Rng::new(s.seed ^ 0x4d54);
    let system = rng.words(m.system.min(s.max_prompt / 4), s.vocab);
    let mut sessions = Vec::new();
    for _ in 0..m.conversations {
        let n = rng.range(m.min_turns.max(1), m.max_turns.max(m.min_turns.max(1)));
        let mut len = system.len();
        let mut turns = Vec::new();
        for k in 0..n {
            let user_len = rng.range(m.message / 2, m.message * 3 / 2).max(1);
            if !fits(len, user_len, s.max_output, s.max_prompt) {
                break;
            }
            len += user_len + s.max_output as usize;
            turns.push(Turn {
                user: rng.words(user_len, s.vocab),
                max_tokens: s.max_output,
                think_ms: if k == 0 { 0.0 } else { rng.exp(m.think_ms) },
                branches: Vec::new(),
            });
        }
        sessions.push(turns);
    }
    conversations("multi-turn", &system, sessions, &mut rng)
}

/// `agentic`: one long tool-use system prompt shared by every task; each task is a loop of
/// tool calls (the model's reply, then a tool result of `tool_result` tokens, sent back), and
/// with probability `branch` a step also tries an alternative tool result from the same
/// history.
#[derive(Clone, Debug)]
pub struct Agentic {
    pub tasks: usize,
    pub system: usize,
    pub task: usize,
    pub min_steps: usize,
    pub max_steps: usize,
    pub tool_result: usize,
    pub branch: f64,
    pub think_ms: f64,
}

impl Default for Agentic {
    fn default() -> Self {
        Agentic {
            tasks: 48,
            system: 3072,
            task: 256,
            min_steps: 3,
            max_steps: 10,
            tool_result: 320,
            branch: 0.15,
            think_ms: 300.0,
        }
    }
}

pub fn agentic(a: &Agentic, s: &Shape) -> Workload {
    let mut rng = Rng::new(s.seed ^ 0x4147);
    let system = rng.words(a.system.min(s.max_prompt / 2), s.vocab);
    let mut sessions = Vec::new();
    for _ in 0..a.tasks {
        let steps = rng.range(a.min_steps.max(1), a.max_steps.max(a.min_steps.max(1)));
        let mut len = system.len();
        let mut turns = Vec::new();
        for k in 0..steps {
            let n = if k == 0 {
                a.task
            } else {
                rng.range(a.tool_result / 2, a.tool_result * 3 / 2).max(1)
            };
            if !fits(len, n, s.max_output, s.max_prompt) {
                break;
            }
            len += n + s.max_output as usize;
            let branches = if k > 0 && rng.unit() < a.branch {
                vec![rng.words(n, s.vocab)]
            } else {
                Vec::new()
            };
            turns.push(Turn {
                user: rng.words(n, s.vocab),
                max_tokens: s.max_output,
                think_ms: if k == 0 { 0.0 } else { rng.exp(a.think_ms) },
                branches,
            });
        }
        sessions.push(turns);
    }
    conversations("agentic", &system, sessions, &mut rng)
}

/// `rag`: `documents` shared documents of `document` tokens; each query puts `per_query` of
/// them, chosen and ordered at random, after a short instruction, then a question.
#[derive(Clone, Debug)]
pub struct Rag {
    pub queries: usize,
    pub documents: usize,
    pub document: usize,
    pub per_query: usize,
    pub instruction: usize,
    pub question: usize,
}

impl Default for Rag {
    fn default() -> Self {
        Rag {
            queries: 400,
            documents: 12,
            document: 1024,
            per_query: 3,
            instruction: 64,
            question: 96,
        }
    }
}

pub fn rag(r: &Rag, s: &Shape) -> Workload {
    let mut rng = Rng::new(s.seed ^ 0x524147);
    let instruction = rng.words(r.instruction, s.vocab);
    let docs: Vec<Vec<u32>> = (0..r.documents.max(1))
        .map(|_| rng.words(r.document, s.vocab))
        .collect();
    let mut sessions = Vec::new();
    for _ in 0..r.queries {
        let mut order: Vec<usize> = (0..docs.len()).collect();
        shuffle(&mut order, &mut rng);
        let mut user = Vec::new();
        for d in order.iter().take(r.per_query.max(1)) {
            user.extend_from_slice(&docs[*d]);
        }
        user.extend(rng.words(r.question, s.vocab));
        let room = s.max_prompt.saturating_sub(instruction.len()).max(1);
        user.truncate(room);
        sessions.push(Session {
            start_ms: 0.0,
            system: instruction.clone(),
            turns: vec![Turn {
                user,
                max_tokens: s.max_output,
                think_ms: 0.0,
                branches: Vec::new(),
            }],
        });
    }
    poisson_starts(&mut sessions, &mut rng);
    Workload {
        name: "rag".into(),
        sessions,
    }
}

/// A workload by name: `shared-prefix`, `multi-turn`, `agentic`, `rag`, `tenants`, or a trace
/// file.
/// `sessions` sizes a built-in generator (its own count when `None`); a trace has its own.
pub fn build(
    name: Option<&str>,
    trace: Option<&std::path::Path>,
    tokens_per_block: usize,
    sessions: Option<usize>,
    s: &Shape,
) -> Result<Workload> {
    let generated = matches!(name, Some(n) if n != "mooncake") && trace.is_none();
    if sessions.is_some() && !generated {
        bail!("--sessions sizes a built-in generator; a trace's length is set by --max-requests");
    }
    if sessions == Some(0) {
        bail!("--sessions must be at least 1");
    }
    match (name, trace) {
        (Some(_), Some(_)) => bail!("give either --workload or --trace, not both"),
        (_, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            mooncake(&text, &path.display().to_string(), tokens_per_block, s)
        }
        (None, None) | (Some("mooncake"), None) => {
            mooncake(crate::demo::trace::BUNDLED, "bundled", tokens_per_block, s)
        }
        (Some("shared-prefix"), None) => {
            let d = SharedPrefix::default();
            let per_user = d.groups * d.questions;
            let p = SharedPrefix {
                users: sessions.map_or(d.users, |n| n.div_ceil(per_user)),
                ..d
            };
            let mut w = shared_prefix(&p, s);
            // Whole users per group overshoot; the first `n` arrivals are the run.
            w.sessions.truncate(sessions.unwrap_or(usize::MAX));
            Ok(w)
        }
        (Some("multi-turn"), None) => {
            let d = MultiTurn::default();
            let m = MultiTurn {
                conversations: sessions.unwrap_or(d.conversations),
                ..d
            };
            Ok(multi_turn(&m, s))
        }
        (Some("agentic"), None) => {
            let d = Agentic::default();
            let a = Agentic {
                tasks: sessions.unwrap_or(d.tasks),
                ..d
            };
            Ok(agentic(&a, s))
        }
        (Some("rag"), None) => {
            let d = Rag::default();
            let r = Rag {
                queries: sessions.unwrap_or(d.queries),
                ..d
            };
            Ok(rag(&r, s))
        }
        (Some("tenants"), None) => {
            let d = Tenants::default();
            let t = Tenants {
                requests: sessions.unwrap_or(d.requests),
                ..d
            };
            Ok(tenants(&t, s))
        }
        (Some(other), None) => bail!(
            "unknown workload {other:?}: use mooncake, shared-prefix, multi-turn, agentic, rag \
             or tenants"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sim::tokens::FIRST_WORD;

    fn shape() -> Shape {
        Shape {
            vocab: 32_000,
            max_prompt: 8000,
            max_output: 16,
            seed: 7,
        }
    }

    #[test]
    fn shared_block_ids_become_shared_prefixes_of_word_tokens() {
        let text = "{\"timestamp\": 10, \"input_length\": 1024, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 15, \"input_length\": 1000, \"output_length\": 3, \"hash_ids\": [0, 2]}\n";
        let w = mooncake(text, "t", 16, &shape()).unwrap();
        let a = &w.sessions[0].turns[0].user;
        let b = &w.sessions[1].turns[0].user;
        assert_eq!((a.len(), b.len()), (32, 32));
        assert_eq!(a[..16], b[..16]);
        assert_ne!(a[16..], b[16..]);
        assert!(a.iter().all(|t| *t >= FIRST_WORD && *t < 32_000));
        assert_eq!(w.sessions[1].start_ms, 5.0);
    }

    #[test]
    fn generators_are_deterministic_for_a_seed() {
        let s = shape();
        assert_eq!(
            multi_turn(&MultiTurn::default(), &s).sessions,
            multi_turn(&MultiTurn::default(), &s).sessions
        );
        let mut other = s.clone();
        other.seed = 8;
        assert_ne!(
            agentic(&Agentic::default(), &s).sessions,
            agentic(&Agentic::default(), &other).sessions
        );
    }

    #[test]
    fn shared_prefix_gives_every_group_its_users_questions() {
        let p = SharedPrefix {
            groups: 3,
            prefix: 100,
            users: 2,
            questions: 2,
            question: 10,
        };
        let w = shared_prefix(&p, &shape());
        assert_eq!(w.sessions.len(), 12);
        let mut systems: Vec<&Vec<u32>> = w.sessions.iter().map(|s| &s.system).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 3);
        assert!(w
            .sessions
            .windows(2)
            .all(|p| p[0].start_ms <= p[1].start_ms));
    }

    #[test]
    fn sessions_sizes_every_generator_and_no_trace() {
        let s = shape();
        for (name, n) in [
            ("multi-turn", 150),
            ("agentic", 200),
            ("rag", 37),
            ("shared-prefix", 999),
            ("tenants", 321),
        ] {
            let w = build(Some(name), None, 256, Some(n), &s).unwrap();
            assert_eq!(w.sessions.len(), n, "{name}");
            assert!(w
                .sessions
                .windows(2)
                .all(|p| p[0].start_ms <= p[1].start_ms));
        }
        let agentic = build(Some("agentic"), None, 256, None, &s).unwrap();
        assert_eq!(agentic.sessions.len(), Agentic::default().tasks);
        // A longer run of the same workload: one system prompt, the same shape of tasks.
        let long = build(Some("agentic"), None, 256, Some(200), &s).unwrap();
        assert_eq!(long.sessions[0].system, agentic.sessions[0].system);
        for (name, sessions) in [(Some("mooncake"), Some(10)), (Some("agentic"), Some(0))] {
            let e = build(name, None, 256, sessions, &s)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--sessions"), "{e}");
        }
        let e = build(None, None, 256, Some(10), &s)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--max-requests"), "{e}");
    }

    #[test]
    fn conversations_never_outgrow_the_model() {
        let mut s = shape();
        s.max_prompt = 2000;
        for w in [
            multi_turn(&MultiTurn::default(), &s),
            agentic(&Agentic::default(), &s),
        ] {
            for sess in &w.sessions {
                let total: usize = sess.system.len()
                    + sess
                        .turns
                        .iter()
                        .map(|t| t.user.len() + t.max_tokens as usize)
                        .sum::<usize>();
                assert!(total <= 2000, "{} grows to {total}", w.name);
            }
        }
    }

    #[test]
    fn truncation_keeps_the_earliest_sessions_that_can_still_send() {
        let mut w = multi_turn(&MultiTurn::default(), &shape());
        let total = w.requests();
        w.truncate(Some(10), None);
        assert!(w.requests() >= 10 && w.requests() < total);
        let first = w.sessions[0].turns.len();
        w.truncate(Some(1), None);
        assert_eq!((w.sessions.len(), w.requests()), (1, first));
        let mut r = rag(&Rag::default(), &shape());
        r.truncate(None, Some(5000.0));
        assert!(r.sessions.iter().all(|s| s.start_ms < 5000.0));
    }

    #[test]
    fn rescaling_sets_the_mean_session_rate() {
        let mut w = rag(&Rag::default(), &shape());
        w.rescale_to_rate(10.0);
        let last = w.sessions.last().unwrap().start_ms;
        let want = (w.sessions.len() - 1) as f64 / 10.0 * 1000.0;
        assert!((last - want).abs() < 1e-6 * want);
    }
}
