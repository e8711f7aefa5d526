//! Fuzzes the chat-template renderer with hostile templates and messages: the input is a
//! template, a NUL byte, and the messages as JSON (any JSON; a non-JSON tail becomes one user
//! message's content). Rendering must never panic, and the fuel bound must end every template
//! (libFuzzer's `-timeout` reports one that does not).
#![no_main]

use kvroute::gateway::tokenize::render_chat_template;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (template, rest) = text.split_once('\0').unwrap_or((&text, ""));
    let messages = serde_json::from_str::<Value>(rest)
        .unwrap_or_else(|_| json!([{"role": "user", "content": rest}]));
    let _ = render_chat_template(template, &messages, "<s>", "</s>");
});
