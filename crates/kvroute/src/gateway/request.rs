//! The first two stages of a request: parse (the body's bytes into a JSON object) and validate
//! (every OpenAI field the gateway reads or forwards, by type and range), before anything is
//! tokenized or decided.
//!
//! Owns: [`Parsed`] (the model, the prompt, the cache salt, streaming, whether the prompt cache
//! is skipped) and [`Invalid`] (an OpenAI error's status, message and `param`).
//! Invariants: a request that passes reaches the engine with its body unchanged; every refusal
//! names its field in `param`; fields the gateway does not know pass untouched (vLLM ignores
//! them); a value's type is checked as the OpenAI API and vLLM declare it (`null` stands for
//! absent wherever they allow it).
//! Must not: tokenize, decide, or touch the network.

use super::tokenize::{prompt_input, PromptInput};
use axum::http::StatusCode;
use serde_json::Value;

/// The largest `max_tokens` accepted (the engine refuses anything beyond its context anyway).
pub const MAX_TOKENS: u64 = (1 << 31) - 1;

/// A refused request: what the OpenAI error body says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
}

impl Invalid {
    fn field(param: &'static str, message: impl Into<String>) -> Invalid {
        Invalid {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param),
        }
    }
}

/// A request that passed validation.
#[derive(Debug)]
pub struct Parsed {
    pub body: Value,
    pub model: String,
    pub input: PromptInput,
    pub salt: Option<String>,
    pub stream: bool,
    /// `prompt_logprobs` asks for every prompt token's logprob: vLLM then skips the prefix cache.
    pub skip_prefix_cache: bool,
}

/// What a field may hold.
#[derive(Clone, Copy)]
enum Kind {
    Bool,
    Int {
        min: i64,
    },
    Number {
        min: f64,
        max: f64,
    },
    Str,
    NonEmptyStr,
    Object,
    Array,
    /// A string or a list of strings (`stop`).
    StrOrStrs,
    /// A string or an object (`tool_choice`).
    StrOrObject,
    /// Chat: a boolean; completions: an integer ≥ 0 (`logprobs`).
    Logprobs,
    /// An integer token count ≥ 1 up to [`MAX_TOKENS`].
    TokenCount,
}

/// The fields checked, with what each may hold (`null` always allowed).
const FIELDS: &[(&str, Kind)] = &[
    ("stream", Kind::Bool),
    ("stream_options", Kind::Object),
    ("max_tokens", Kind::TokenCount),
    ("max_completion_tokens", Kind::TokenCount),
    ("min_tokens", Kind::Int { min: 0 }),
    ("n", Kind::Int { min: 1 }),
    ("best_of", Kind::Int { min: 1 }),
    (
        "temperature",
        Kind::Number {
            min: 0.0,
            max: f64::MAX,
        },
    ),
    ("top_p", Kind::Number { min: 0.0, max: 1.0 }),
    ("top_k", Kind::Int { min: -1 }),
    ("min_p", Kind::Number { min: 0.0, max: 1.0 }),
    (
        "frequency_penalty",
        Kind::Number {
            min: -2.0,
            max: 2.0,
        },
    ),
    (
        "presence_penalty",
        Kind::Number {
            min: -2.0,
            max: 2.0,
        },
    ),
    (
        "repetition_penalty",
        Kind::Number {
            min: f64::MIN_POSITIVE,
            max: f64::MAX,
        },
    ),
    ("seed", Kind::Int { min: i64::MIN }),
    ("stop", Kind::StrOrStrs),
    ("stop_token_ids", Kind::Array),
    ("logprobs", Kind::Logprobs),
    ("top_logprobs", Kind::Int { min: 0 }),
    ("prompt_logprobs", Kind::Int { min: -1 }),
    ("echo", Kind::Bool),
    ("user", Kind::Str),
    ("suffix", Kind::Str),
    ("logit_bias", Kind::Object),
    ("ignore_eos", Kind::Bool),
    ("skip_special_tokens", Kind::Bool),
    ("return_token_ids", Kind::Bool),
    ("cache_salt", Kind::NonEmptyStr),
    ("priority", Kind::Int { min: i64::MIN }),
    ("response_format", Kind::Object),
    ("tools", Kind::Array),
    ("tool_choice", Kind::StrOrObject),
    ("parallel_tool_calls", Kind::Bool),
    ("chat_template_kwargs", Kind::Object),
];

fn check(name: &'static str, kind: Kind, v: &Value, chat: bool) -> Result<(), Invalid> {
    let bad = |what: &str| Invalid::field(name, format!("`{name}` must be {what}"));
    let ok = match kind {
        Kind::Bool => v.is_boolean(),
        Kind::Int { min } => v.as_i64().is_some_and(|x| x >= min),
        Kind::Number { min, max } => v
            .as_f64()
            .is_some_and(|x| x.is_finite() && x >= min && x <= max),
        Kind::Str => v.is_string(),
        Kind::NonEmptyStr => v.as_str().is_some_and(|s| !s.is_empty()),
        Kind::Object => v.is_object(),
        Kind::Array => v.is_array(),
        Kind::StrOrStrs => {
            v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string))
        }
        Kind::StrOrObject => v.is_string() || v.is_object(),
        Kind::Logprobs if chat => v.is_boolean(),
        Kind::Logprobs => v.as_i64().is_some_and(|x| x >= 0),
        Kind::TokenCount => v.as_u64().is_some_and(|x| (1..=MAX_TOKENS).contains(&x)),
    };
    if ok {
        return Ok(());
    }
    Err(match kind {
        Kind::Bool => bad("a boolean"),
        Kind::Int { min } if min == i64::MIN => bad("an integer"),
        Kind::Int { min } => bad(&format!("an integer ≥ {min}")),
        Kind::Number { min, max } if max == f64::MAX => bad(&format!("a number ≥ {min}")),
        Kind::Number { min, max } => bad(&format!("a number between {min} and {max}")),
        Kind::Str => bad("a string"),
        Kind::NonEmptyStr => bad("a non-empty string"),
        Kind::Object => bad("an object"),
        Kind::Array => bad("an array"),
        Kind::StrOrStrs => bad("a string or a list of strings"),
        Kind::StrOrObject => bad("a string or an object"),
        Kind::Logprobs if chat => bad("a boolean"),
        Kind::Logprobs => bad("an integer ≥ 0"),
        Kind::TokenCount => bad(&format!("an integer between 1 and {MAX_TOKENS}")),
    })
}

/// Parses a body and validates it; `models` are the names the fleet serves (the model may be
/// left out when there is exactly one).
pub fn parse(raw: &[u8], chat: bool, models: &[String]) -> Result<Parsed, Invalid> {
    let body: Value = match serde_json::from_slice(raw) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return Err(Invalid {
                status: StatusCode::BAD_REQUEST,
                message: "the body must be a JSON object".into(),
                param: None,
            })
        }
        Err(e) => {
            return Err(Invalid {
                status: StatusCode::BAD_REQUEST,
                message: format!("invalid JSON: {e}"),
                param: None,
            })
        }
    };
    let model = match body.get("model") {
        Some(Value::String(m)) => m.clone(),
        None | Some(Value::Null) if models.len() == 1 => models[0].clone(),
        None | Some(Value::Null) => return Err(Invalid::field("model", "`model` is required")),
        Some(_) => return Err(Invalid::field("model", "`model` must be a string")),
    };
    if !models.contains(&model) {
        return Err(Invalid {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{model}` does not exist"),
            param: Some("model"),
        });
    }
    for (name, kind) in FIELDS {
        match body.get(*name) {
            None | Some(Value::Null) => {}
            Some(v) => check(name, *kind, v, chat)?,
        }
    }
    let input = prompt_input(&body, chat)
        .map_err(|e| Invalid::field(if chat { "messages" } else { "prompt" }, e.to_string()))?;
    if let PromptInput::Chat(msgs) = &input {
        check_messages(msgs)?;
    }
    let salt = body
        .get("cache_salt")
        .and_then(Value::as_str)
        .map(str::to_string);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let skip_prefix_cache = body.get("prompt_logprobs").is_some_and(|v| !v.is_null());
    Ok(Parsed {
        body,
        model,
        input,
        salt,
        stream,
        skip_prefix_cache,
    })
}

/// Each message: an object with a string `role` and a `content` that is a string, a list of
/// parts, or absent/null (an assistant turn with tool calls).
fn check_messages(msgs: &Value) -> Result<(), Invalid> {
    let bad = |i: usize, what: &str| Invalid::field("messages", format!("`messages[{i}]` {what}"));
    for (i, m) in msgs.as_array().into_iter().flatten().enumerate() {
        let Some(m) = m.as_object() else {
            return Err(bad(i, "must be an object"));
        };
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(bad(i, "needs a string `role`"));
        }
        match m.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) if parts.iter().all(Value::is_object) => {}
            Some(_) => {
                return Err(bad(
                    i,
                    "has a `content` that is neither a string nor a list of parts",
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn models() -> Vec<String> {
        vec!["m".into()]
    }

    fn refusal(body: Value, chat: bool) -> Invalid {
        match parse(body.to_string().as_bytes(), chat, &models()) {
            Ok(_) => panic!("{body} passed"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_wrong_type_in_any_checked_field_is_refused_naming_the_field() {
        for (name, _) in FIELDS {
            // An array of objects fits no checked field's type but `tools`'s.
            let wrong = if *name == "tools" || *name == "stop_token_ids" {
                json!("x")
            } else {
                json!([{"x": 1}])
            };
            for chat in [false, true] {
                let mut body = if chat {
                    json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                } else {
                    json!({"model": "m", "prompt": [1, 2, 3]})
                };
                body[*name] = wrong.clone();
                let e = refusal(body, chat);
                assert_eq!((e.status, e.param), (StatusCode::BAD_REQUEST, Some(*name)));
            }
        }
    }

    #[test]
    fn out_of_range_values_are_refused_and_nulls_and_unknown_fields_pass() {
        for (field, value) in [
            ("max_tokens", json!(0)),
            ("max_tokens", json!(-5)),
            ("max_tokens", json!(1u64 << 40)),
            ("n", json!(0)),
            ("temperature", json!(-1.0)),
            ("top_p", json!(1.5)),
            ("cache_salt", json!("")),
        ] {
            let mut body = json!({"model": "m", "prompt": "hi"});
            body[field] = value;
            assert_eq!(refusal(body, false).param, Some(field));
        }
        let ok = json!({"model": "m", "prompt": "hi", "max_tokens": null, "stream": null,
            "n": 2, "some_future_field": {"a": 1}, "temperature": 0.7});
        let p = parse(ok.to_string().as_bytes(), false, &models()).expect("passes");
        assert_eq!(p.body, ok, "the body passes unchanged");
        assert!(!p.stream);
    }

    #[test]
    fn malformed_bodies_and_models_get_the_openai_status() {
        let bad = |raw: &[u8]| parse(raw, false, &models()).err().map(|e| e.status);
        assert_eq!(bad(b"{\"prompt\": "), Some(StatusCode::BAD_REQUEST));
        assert_eq!(bad(b"[1, 2]"), Some(StatusCode::BAD_REQUEST));
        assert_eq!(
            bad(b"{\"prompt\": \"\xff\xfe\"}"),
            Some(StatusCode::BAD_REQUEST)
        );
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(bad(deep.as_bytes()), Some(StatusCode::BAD_REQUEST));
        let e = refusal(json!({"model": "other", "prompt": "hi"}), false);
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        let e = refusal(json!({"model": 3, "prompt": "hi"}), false);
        assert_eq!(e.param, Some("model"));
        let two = vec!["a".to_string(), "b".to_string()];
        let e = parse(br#"{"prompt": "hi"}"#, false, &two).err();
        assert_eq!(e.and_then(|e| e.param), Some("model"));
        let e = refusal(json!({"model": "m", "prompt": [1, -2]}), false);
        assert_eq!(e.param, Some("prompt"));
        let e = refusal(json!({"model": "m", "messages": [{"content": "x"}]}), true);
        assert_eq!(e.param, Some("messages"));
        let e = refusal(
            json!({"model": "m", "messages": [{"role": "user", "content": 5}]}),
            true,
        );
        assert_eq!(e.param, Some("messages"));
    }
}
