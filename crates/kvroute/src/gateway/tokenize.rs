//! Turning OpenAI request bodies into exactly the engine's prompt tokens.
//!
//! Owns: token-id prompts (used as given); text prompts and chat messages through the model's
//! own `tokenizer.json` and chat template (HF `tokenizers` + `minijinja` with Python-compatible
//! methods) when a model directory is configured, else through the worker's `/tokenize`
//! endpoint (vLLM's request/response shape).
//! Invariants: completions add the tokenizer's special tokens; chat renders the template with
//! `add_generation_prompt = true` and adds none (the template carries them), as vLLM does.
//! Must not: guess: a prompt that cannot be tokenized is an error for the caller to report.

use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("worker /tokenize failed: {0}")]
    Upstream(String),
}

/// What the request asks the engine to process.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    Tokens(Vec<u32>),
    Text(String),
    Chat(Value),
}

/// Extracts the prompt of a `/v1/completions` or `/v1/chat/completions` body.
pub fn prompt_input(body: &Value, chat: bool) -> Result<PromptInput, TokenizeError> {
    if chat {
        let msgs = body
            .get("messages")
            .ok_or_else(|| TokenizeError::Invalid("`messages` is required".into()))?;
        if msgs.as_array().is_none_or(|a| a.is_empty()) {
            return Err(TokenizeError::Invalid(
                "`messages` must be a non-empty array".into(),
            ));
        }
        return Ok(PromptInput::Chat(msgs.clone()));
    }
    let p = body
        .get("prompt")
        .ok_or_else(|| TokenizeError::Invalid("`prompt` is required".into()))?;
    let one = match p {
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => &items[0],
        other => other,
    };
    match one {
        Value::String(s) => Ok(PromptInput::Text(s.clone())),
        Value::Array(items) => items
            .iter()
            .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(PromptInput::Tokens)
            .ok_or_else(|| {
                TokenizeError::Invalid("`prompt` must be a string, a list of token ids, or one of either (batches are not routed)".into())
            }),
        _ => Err(TokenizeError::Invalid("`prompt` must be a string or a list of token ids".into())),
    }
}

/// A model's own tokenizer and chat template.
pub struct LocalTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<String>,
    bos: String,
    eos: String,
}

fn special(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl LocalTokenizer {
    pub fn load(dir: &Path) -> Result<LocalTokenizer, TokenizeError> {
        let tokenizer =
            tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| {
                TokenizeError::Tokenizer(format!("{}: {e}", dir.join("tokenizer.json").display()))
            })?;
        let cfg: Value = match std::fs::read(dir.join("tokenizer_config.json")) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| TokenizeError::Tokenizer(format!("tokenizer_config.json: {e}")))?,
            Err(_) => Value::Null,
        };
        let mut template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| named.first())
                .and_then(|t| t.get("template").and_then(|x| x.as_str()))
                .map(str::to_string),
            _ => None,
        };
        if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
            template = Some(t);
        }
        Ok(LocalTokenizer {
            tokenizer,
            template,
            bos: special(cfg.get("bos_token")),
            eos: special(cfg.get("eos_token")),
        })
    }

    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    }

    /// Renders the chat template like `apply_chat_template(messages, add_generation_prompt=True,
    /// tokenize=False)`.
    pub fn render_chat(&self, messages: &Value) -> Result<String, TokenizeError> {
        let template = self
            .template
            .as_deref()
            .ok_or_else(|| TokenizeError::Tokenizer("the model has no chat template".into()))?;
        render_chat_template(template, messages, &self.bos, &self.eos)
    }
}

/// The most template instructions one chat rendering may execute: a long real conversation
/// takes a few hundred thousand; a hostile template (nested loops over huge ranges) is stopped
/// with an error instead of holding a runtime thread.
pub const CHAT_TEMPLATE_FUEL: u64 = 5_000_000;

/// Renders a Jinja chat template (Hugging Face's dialect, as `transformers` runs it) over
/// `messages` with the generation prompt. Bounded: a template that does not compile, raises,
/// or runs past [`CHAT_TEMPLATE_FUEL`] is an error, never a hang or a panic.
pub fn render_chat_template(
    template: &str,
    messages: &Value,
    bos: &str,
    eos: &str,
) -> Result<String, TokenizeError> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
    env.add_template("chat", template)
        .map_err(|e| TokenizeError::Tokenizer(format!("chat template: {e}")))?;
    let t = env
        .get_template("chat")
        .map_err(|e| TokenizeError::Tokenizer(e.to_string()))?;
    t.render(minijinja::context! {
        messages => minijinja::Value::from_serialize(messages),
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
    })
    .map_err(|e| TokenizeError::Invalid(format!("chat template: {e}")))
}

/// Tokenizers by model directory, loaded once.
#[derive(Default)]
pub struct Tokenizers {
    local: Mutex<HashMap<PathBuf, Arc<LocalTokenizer>>>,
}

impl Tokenizers {
    pub fn local(&self, dir: &Path) -> Result<Arc<LocalTokenizer>, TokenizeError> {
        if let Some(t) = self.local.lock().get(dir) {
            return Ok(t.clone());
        }
        let t = Arc::new(LocalTokenizer::load(dir)?);
        self.local.lock().insert(dir.to_path_buf(), t.clone());
        Ok(t)
    }

    /// The engine's prompt tokens for `input`.
    pub async fn tokens(
        &self,
        input: &PromptInput,
        model: &str,
        model_dir: Option<&Path>,
        worker_url: &str,
        client: &reqwest::Client,
    ) -> Result<Vec<u32>, TokenizeError> {
        match (input, model_dir) {
            (PromptInput::Tokens(t), _) => Ok(t.clone()),
            (PromptInput::Text(s), Some(dir)) => self.local(dir)?.encode(s, true),
            (PromptInput::Chat(m), Some(dir)) => {
                let tok = self.local(dir)?;
                let text = tok.render_chat(m)?;
                tok.encode(&text, false)
            }
            (PromptInput::Text(s), None) => {
                remote(client, worker_url, json!({"model": model, "prompt": s, "add_special_tokens": true})).await
            }
            (PromptInput::Chat(m), None) => {
                remote(client, worker_url, json!({"model": model, "messages": m, "add_generation_prompt": true, "add_special_tokens": false})).await
            }
        }
    }
}

async fn remote(
    client: &reqwest::Client,
    url: &str,
    body: Value,
) -> Result<Vec<u32>, TokenizeError> {
    let resp = client
        .post(format!("{}/tokenize", url.trim_end_matches('/')))
        .json(&body)
        .send()
        .await
        .map_err(|e| TokenizeError::Upstream(e.to_string()))?;
    let status = resp.status();
    let v: Value = resp
        .json()
        .await
        .map_err(|e| TokenizeError::Upstream(e.to_string()))?;
    if !status.is_success() {
        return Err(if status.is_client_error() {
            TokenizeError::Invalid(
                v.get("error")
                    .and_then(|e| e.get("message"))
                    .and_then(|m| m.as_str())
                    .unwrap_or("rejected by the worker")
                    .to_string(),
            )
        } else {
            TokenizeError::Upstream(format!("status {status}"))
        });
    }
    v.get("tokens")
        .and_then(|t| t.as_array())
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>()
        })
        .ok_or_else(|| TokenizeError::Upstream("no `tokens` list in the /tokenize reply".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"<s>": 0, "<unk>": 1, "hello": 2, "world": 3, "<": 4, "|": 5, ">": 6, "user": 7, "assistant": 8, "system": 9, "be": 10, "brief": 11, ".": 12, "im_start": 13, "im_end": 14}, "unk_token": "<unk>"}}"#;

    const CONFIG: &str = r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"},
      "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'].strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"}"#;

    #[test]
    fn a_model_directory_tokenizes_text_and_renders_its_chat_template() {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), CONFIG).unwrap();
        let t = LocalTokenizer::load(&dir).unwrap();
        // Completions add the special tokens (BOS here).
        assert_eq!(t.encode("hello world", true).unwrap(), vec![0, 2, 3]);
        let msgs = json!([{"role": "system", "content": " be brief. "}, {"role": "user", "content": "hello"}]);
        let text = t.render_chat(&msgs).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system be brief.<|im_end|>\n<|im_start|>user hello<|im_end|>\n<|im_start|>assistant"
        );
        // Chat adds none: the template carries them.
        // Whitespace pre-tokenization: word runs and punctuation runs (`<|`, `|>`, `.<|` are
        // out of this toy vocabulary: 1 = <unk>).
        let ids = t.encode(&text, false).unwrap();
        assert_eq!(
            ids,
            vec![1, 13, 1, 9, 10, 11, 1, 14, 1, 1, 13, 1, 7, 2, 1, 14, 1, 1, 13, 1, 8]
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn prompts_are_token_lists_text_or_one_of_either() {
        assert_eq!(
            prompt_input(&json!({"prompt": [1, 2]}), false).unwrap(),
            PromptInput::Tokens(vec![1, 2])
        );
        assert_eq!(
            prompt_input(&json!({"prompt": ["hi"]}), false).unwrap(),
            PromptInput::Text("hi".into())
        );
        assert_eq!(
            prompt_input(&json!({"prompt": [[3]]}), false).unwrap(),
            PromptInput::Tokens(vec![3])
        );
        assert!(prompt_input(&json!({"prompt": [-1]}), false).is_err());
        assert!(prompt_input(&json!({"prompt": ["a", "b"]}), false).is_err());
        assert!(prompt_input(&json!({}), false).is_err());
        assert!(prompt_input(&json!({"messages": []}), true).is_err());
    }

    #[test]
    fn a_hostile_chat_template_is_an_error_not_a_hang() {
        let msgs = json!([{"role": "user", "content": "hello"}]);
        for template in [
            // Ten billion iterations: stopped by the fuel bound.
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            // Unbounded recursion through a macro.
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "{{ raise_exception('no system role') }}",
            "{% for m in messages %}{{ m.content.nope() }}{% endfor %}",
            "{% if %}",
        ] {
            assert!(
                render_chat_template(template, &msgs, "", "").is_err(),
                "{template}"
            );
        }
        // A long real-looking conversation stays well inside the bound.
        let long: Vec<Value> = (0..2000)
            .map(|i| json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": format!("turn {i}")}))
            .collect();
        let ok = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let text = render_chat_template(ok, &Value::Array(long), "", "").unwrap();
        assert!(text.ends_with("<|assistant|>"));
    }
}
