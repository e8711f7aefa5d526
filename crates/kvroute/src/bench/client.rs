//! The load generator's client: sessions sent open-loop on their arrival schedule, each request
//! streamed and timed, replies carried into the next turn.
//!
//! Owns: [`Api`] and [`PromptFormat`] (how a prompt is spelled on the wire), [`Outcome`] (one
//! request's result: status or failure class, client-measured TTFT / inter-token gaps /
//! end-to-end time, the engine's own times when it reports them, usage, the token view the
//! oracle reads, the replica that served it), and [`drive`], which schedules every session at
//! its start time, sends each turn after the previous reply plus its think time, fires branches
//! beside their turn, sends each request to the replica the balancer picks as it leaves, and
//! honours `max_concurrency`, `max_requests` and `duration`.
//! Invariants: the schedule is kept whatever the target does (open loop: a slow reply delays
//! only its own session's next turn; a session whose turn failed stops there); every request
//! ends in exactly one outcome; nothing a target answers can panic the client.
//! Must not: retry, or change the workload.

use super::balance::{Balance, Balancer};
use super::workload::{Session, Workload};
use futures_util::StreamExt;
use kvroute_sim::tokens::{self, Message, BOS};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptFormat {
    /// Token ids (`/v1/completions` only).
    Tokens,
    /// Text the target tokenizes (the simulator's word spelling: the same ids).
    Text,
}

/// How requests are sent.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// The target's replicas (one for a plain target): each request goes to the one `balance`
    /// picks when it is sent.
    pub urls: Vec<String>,
    pub balance: Balance,
    /// Seeds a random balance.
    pub seed: u64,
    pub model: String,
    pub api: Api,
    pub format: PromptFormat,
    /// The target model's vocabulary (the simulator's spelling): how replies are tokenized and
    /// chats rendered for the prompt's token view.
    pub vocab: u32,
    /// Arrival times and think times are divided by this.
    pub speedup: f64,
    pub max_concurrency: Option<usize>,
    pub max_requests: Option<usize>,
    pub duration: Option<Duration>,
    pub request_timeout: Duration,
    /// Ask a kvroute gateway for its decision evidence (`x-kvroute-explain`).
    pub explain: bool,
}

/// One request's result.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub session: usize,
    pub turn: usize,
    pub branch: bool,
    /// The index (in `ClientOptions::urls`) of the replica it was sent to; `None` when it
    /// never left.
    pub replica: Option<usize>,
    /// Seconds from the run's start to the send.
    pub sent_at_s: f64,
    /// `None` when it completed; else the failure class (`http_500`, `connect`, `timeout`,
    /// `stream`, `incomplete`, `concurrency`).
    pub failure: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: Option<u64>,
    pub output_tokens: u64,
    pub ttft_s: Option<f64>,
    /// Gaps between streamed tokens after the first.
    pub itl_s: Vec<f64>,
    pub e2e_s: Option<f64>,
    /// The engine's own TTFT and end-to-end time (the simulator's `sim` extension).
    pub engine_ttft_s: Option<f64>,
    pub engine_e2e_s: Option<f64>,
    /// The prompt as token ids (the oracle's view).
    pub tokens: Vec<u32>,
    /// The worker a kvroute gateway chose, and its decision header.
    pub worker: Option<String>,
    pub decision: Option<Value>,
    /// The reply (text, and ids when the target returned them).
    pub reply_text: String,
    pub reply_ids: Option<Vec<u32>>,
}

/// A session's history as the client holds it.
#[derive(Clone, Debug, Default)]
struct History {
    ids: Vec<u32>,
    text: String,
    messages: Vec<Message>,
}

fn message(role: &str, content: String) -> Message {
    Message {
        role: role.into(),
        content,
    }
}

impl History {
    fn start(system: &[u32]) -> History {
        let text = tokens::detokenize(system);
        History {
            ids: system.to_vec(),
            messages: if system.is_empty() {
                Vec::new()
            } else {
                vec![message("system", text.clone())]
            },
            text,
        }
    }

    /// The history with `user` appended (this turn's prompt).
    fn with_user(&self, user: &[u32]) -> History {
        let mut h = self.clone();
        h.ids.extend_from_slice(user);
        let t = tokens::detokenize(user);
        h.text.push_str(&t);
        h.messages.push(message("user", t));
        h
    }

    /// The prompt followed by the reply (the next turn's history).
    fn with_reply(&self, o: &Outcome, vocab: u32) -> History {
        let mut h = self.clone();
        let ids = o
            .reply_ids
            .clone()
            .unwrap_or_else(|| tokens::tokenize(&o.reply_text, vocab));
        h.ids.extend_from_slice(&ids);
        h.text.push_str(&o.reply_text);
        h.messages.push(message("assistant", o.reply_text.clone()));
        h
    }
}

fn body(o: &ClientOptions, h: &History, max_tokens: u32) -> (String, Value, Vec<u32>) {
    match o.api {
        Api::Chat => {
            let msgs: Vec<Value> = h
                .messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            (
                "/v1/chat/completions".into(),
                json!({
                    "model": o.model,
                    "messages": msgs,
                    "max_tokens": max_tokens,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                    "ignore_eos": true,
                }),
                tokens::render_chat(&h.messages, true, o.vocab),
            )
        }
        Api::Completions => {
            let (prompt, view) = match o.format {
                PromptFormat::Tokens => (json!(h.ids), h.ids.clone()),
                PromptFormat::Text => {
                    let mut v = vec![BOS];
                    v.extend_from_slice(&h.ids);
                    (json!(h.text), v)
                }
            };
            (
                "/v1/completions".into(),
                json!({
                    "model": o.model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                    "ignore_eos": true,
                    "return_token_ids": o.format == PromptFormat::Tokens,
                }),
                view,
            )
        }
    }
}

/// What one SSE `data:` payload adds to an outcome; returns whether it carried tokens.
fn absorb(out: &mut Outcome, v: &Value, chat: bool) -> bool {
    let mut carried = false;
    if let Some(c) = v.get("choices").and_then(|c| c.get(0)) {
        let text = if chat {
            c.get("delta").and_then(|d| d.get("content"))
        } else {
            c.get("text")
        }
        .and_then(Value::as_str)
        .unwrap_or_default();
        if !text.is_empty() {
            out.reply_text.push_str(text);
            carried = true;
        }
        if let Some(ids) = c.get("token_ids").and_then(Value::as_array) {
            let ids: Vec<u32> = ids
                .iter()
                .filter_map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect();
            carried |= !ids.is_empty();
            out.reply_ids.get_or_insert_with(Vec::new).extend(ids);
        }
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        out.cached_tokens = u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .or(out.cached_tokens);
        if let Some(p) = u.get("prompt_tokens").and_then(Value::as_u64) {
            out.prompt_tokens = p;
        }
        if let Some(c) = u.get("completion_tokens").and_then(Value::as_u64) {
            out.output_tokens = c;
        }
    }
    if let Some(s) = v.get("sim") {
        out.engine_ttft_s = s
            .get("ttft_s")
            .and_then(Value::as_f64)
            .or(out.engine_ttft_s);
        out.engine_e2e_s = s.get("e2e_s").and_then(Value::as_f64).or(out.engine_e2e_s);
    }
    carried
}

/// Sends one streaming request and reads it to the end.
async fn send(
    client: &reqwest::Client,
    o: &ClientOptions,
    url: &str,
    h: &History,
    max_tokens: u32,
    out: &mut Outcome,
) {
    let (path, body, view) = body(o, h, max_tokens);
    out.prompt_tokens = view.len() as u64;
    out.tokens = view;
    let chat = o.api == Api::Chat;
    let start = Instant::now();
    let mut req = client.post(format!("{url}{path}")).json(&body);
    if o.explain {
        req = req.header("x-kvroute-explain", "1");
    }
    let resp = match tokio::time::timeout(o.request_timeout, req.send()).await {
        Err(_) => return out.failure = Some("timeout".into()),
        Ok(Err(e)) => {
            out.failure = Some(if e.is_connect() { "connect" } else { "request" }.into());
            return;
        }
        Ok(Ok(r)) => r,
    };
    if !resp.status().is_success() {
        out.failure = Some(format!("http_{}", resp.status().as_u16()));
        return;
    }
    if let Some(d) = resp
        .headers()
        .get("x-kvroute-decision")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| serde_json::from_str::<Value>(v).ok())
    {
        out.worker = d.get("worker").and_then(Value::as_str).map(str::to_string);
        out.decision = Some(d);
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut last_token: Option<Instant> = None;
    let mut done = false;
    let deadline = tokio::time::Instant::now() + o.request_timeout;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return out.failure = Some("timeout".into()),
            Ok(None) => break,
            Ok(Some(Err(_))) => return out.failure = Some("stream".into()),
            Ok(Some(Ok(c))) => c,
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if absorb(out, &v, chat) {
                let now = Instant::now();
                match last_token {
                    None => out.ttft_s = Some(now.duration_since(start).as_secs_f64()),
                    Some(t) => out.itl_s.push(now.duration_since(t).as_secs_f64()),
                }
                last_token = Some(now);
            }
        }
    }
    out.e2e_s = Some(start.elapsed().as_secs_f64());
    if !done {
        out.failure = Some("incomplete".into());
    } else if out.ttft_s.is_none() {
        // A reply without a single token: count the whole time as TTFT.
        out.ttft_s = out.e2e_s;
    }
}

/// Shared by every session task of one run.
struct Run {
    opts: ClientOptions,
    client: reqwest::Client,
    start: Instant,
    sent: AtomicUsize,
    limit: Option<Arc<Semaphore>>,
    balancer: Balancer,
    bar: indicatif::ProgressBar,
}

impl Run {
    /// Claims a request slot; false once `max_requests` or `duration` is reached.
    fn claim(&self) -> bool {
        if let Some(d) = self.opts.duration {
            if self.start.elapsed() >= d {
                return false;
            }
        }
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        match self.opts.max_requests {
            Some(m) => n < m,
            None => true,
        }
    }

    async fn one(
        &self,
        session: usize,
        turn: usize,
        branch: bool,
        h: &History,
        max_tokens: u32,
    ) -> Outcome {
        let mut out = Outcome {
            session,
            turn,
            branch,
            ..Outcome::default()
        };
        let _permit = match &self.limit {
            Some(s) => match s.clone().acquire_owned().await {
                Ok(p) => Some(p),
                Err(_) => {
                    out.failure = Some("concurrency".into());
                    return out;
                }
            },
            None => None,
        };
        let replica = self.balancer.pick();
        let Some(url) = self.opts.urls.get(replica) else {
            out.failure = Some("connect".into());
            return out;
        };
        out.replica = Some(replica);
        out.sent_at_s = self.start.elapsed().as_secs_f64();
        send(&self.client, &self.opts, url, h, max_tokens, &mut out).await;
        self.bar.inc(1);
        out
    }
}

async fn run_session(run: Arc<Run>, index: usize, s: Session) -> Vec<Outcome> {
    let speed = run.opts.speedup.max(1e-9);
    let at = Duration::from_secs_f64(s.start_ms.max(0.0) / 1000.0 / speed);
    tokio::time::sleep_until(tokio::time::Instant::from_std(run.start + at)).await;
    let mut history = History::start(&s.system);
    let mut outcomes = Vec::new();
    for (k, turn) in s.turns.iter().enumerate() {
        if k > 0 && turn.think_ms > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(turn.think_ms / 1000.0 / speed)).await;
        }
        if !run.claim() {
            break;
        }
        let prompt = history.with_user(&turn.user);
        let mut branches = Vec::new();
        for b in &turn.branches {
            if run.claim() {
                let run = run.clone();
                let h = history.with_user(b);
                let max = turn.max_tokens;
                branches.push(tokio::spawn(async move {
                    run.one(index, k, true, &h, max).await
                }));
            }
        }
        let out = run.one(index, k, false, &prompt, turn.max_tokens).await;
        let ok = out.failure.is_none();
        if ok {
            history = prompt.with_reply(&out, run.opts.vocab);
        }
        outcomes.push(out);
        for b in branches {
            if let Ok(o) = b.await {
                outcomes.push(o);
            }
        }
        if !ok {
            break;
        }
    }
    outcomes
}

/// Replays `w` against one target; returns every outcome (in no particular order) and the
/// wall seconds the run took.
pub async fn drive(
    w: &Workload,
    opts: ClientOptions,
    bar: indicatif::ProgressBar,
) -> (Vec<Outcome>, f64) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .build()
        .unwrap_or_default();
    let run = Arc::new(Run {
        limit: opts
            .max_concurrency
            .map(|n| Arc::new(Semaphore::new(n.max(1)))),
        balancer: Balancer::new(opts.balance, opts.urls.len(), opts.seed),
        opts,
        client,
        start: Instant::now(),
        sent: AtomicUsize::new(0),
        bar,
    });
    let tasks: Vec<_> = w
        .sessions
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, s)| tokio::spawn(run_session(run.clone(), i, s)))
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        if let Ok(v) = t.await {
            all.extend(v);
        }
    }
    (all, run.start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_chunks_fill_the_outcome() {
        let mut o = Outcome::default();
        assert!(absorb(
            &mut o,
            &json!({"choices": [{"text": " ba", "token_ids": [300]}]}),
            false
        ));
        assert!(!absorb(
            &mut o,
            &json!({"choices": [{"text": ""}], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 32}}, "sim": {"ttft_s": 0.5, "e2e_s": 0.7}}),
            false
        ));
        assert_eq!(o.reply_text, " ba");
        assert_eq!(o.reply_ids, Some(vec![300]));
        assert_eq!(
            (o.prompt_tokens, o.cached_tokens, o.output_tokens),
            (40, Some(32), 1)
        );
        assert_eq!((o.engine_ttft_s, o.engine_e2e_s), (Some(0.5), Some(0.7)));
        let mut c = Outcome::default();
        assert!(absorb(
            &mut c,
            &json!({"choices": [{"delta": {"content": " fe"}}]}),
            true
        ));
        assert_eq!(c.reply_text, " fe");
    }

    #[test]
    fn a_turn_sends_the_previous_prompt_and_reply_back() {
        let h = History::start(&[300, 301]).with_user(&[302]);
        let o = Outcome {
            reply_text: tokens::detokenize(&[400, 401]),
            ..Outcome::default()
        };
        let next = h.with_reply(&o, 32_000).with_user(&[303]);
        assert_eq!(next.ids, vec![300, 301, 302, 400, 401, 303]);
        assert_eq!(
            tokens::tokenize(&next.text, 32_000),
            next.ids,
            "text and ids agree"
        );
        let roles: Vec<&str> = next.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
    }
}
