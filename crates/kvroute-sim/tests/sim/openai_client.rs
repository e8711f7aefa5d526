//! The official `openai` Python client against a simulated worker: completions (token ids and
//! text), chat with and without streaming, and the cached-token count it reports.
//! Skipped (with how to install it) where `python3 -c "import openai"` fails, except under
//! `CI=true`, where that fails; `.ci/run` installs it.

use crate::common;
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use std::process::Command;

const SCRIPT: &str = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = c.models.list().data[0].id
assert model == "tiny-qwen3-next", model
prompt = list(range(3, 203))
r1 = c.completions.create(model=model, prompt=prompt, max_tokens=4)
r2 = c.completions.create(model=model, prompt=prompt, max_tokens=4)
assert r1.usage.prompt_tokens == 200, r1.usage
assert r1.usage.prompt_tokens_details.cached_tokens == 0, r1.usage
assert r2.usage.prompt_tokens_details.cached_tokens == 192, r2.usage
assert r1.choices[0].text == r2.choices[0].text
t = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=3,
                         extra_body={"cache_salt": "tenant-a"})
assert t.usage.completion_tokens == 3
msgs = [{"role": "system", "content": "Be brief. " * 60},
        {"role": "user", "content": "Hello!"}]
a = c.chat.completions.create(model=model, messages=msgs, max_tokens=6)
assert a.choices[0].message.role == "assistant"
msgs += [{"role": "assistant", "content": a.choices[0].message.content},
         {"role": "user", "content": "Again?"}]
chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=6, stream=True,
                                        stream_options={"include_usage": True}))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert len(text) > 0
usage = [ch.usage for ch in chunks if ch.usage is not None][-1]
assert usage.prompt_tokens_details.cached_tokens >= 64, usage
print("ok", usage.prompt_tokens_details.cached_tokens)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_gets_completions_chat_streams_and_cached_tokens() {
    if !common::python::python_has(&["openai"], "openai") {
        return;
    }
    let mut cfg = WorkerConfig::for_preset("tiny-qwen3-next").unwrap();
    cfg.speedup = 1000.0;
    let f = Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap();
    let url = f.workers[0].base_url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", SCRIPT, &url])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("ok"), "{stdout}");
}
