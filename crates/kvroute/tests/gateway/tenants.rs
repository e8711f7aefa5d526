//! The front door over real sockets: a gateway with tenants in front of a simulated worker.
//! Unknown keys get 401; a tenant over its request rate, its tokens per minute or its
//! concurrency gets 429 with a `Retry-After` computed from its limiter; many clients at once
//! get exactly the rejections the limit implies; a client leaving mid-stream gives its slot
//! back; the table is replaced at runtime; every figure is counted per tenant.
//! Pass/fail never depends on timing: rates are slow enough that no refill lands within a
//! test, and requests are held in flight by pausing the simulated engine.

use crate::common;

use futures_util::future::join_all;
use kvroute::gateway::tenants::TenantSpec;
use kvroute::gateway::{Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PRESET: &str = "tiny-gemma3";

async fn fleet(speedup: f64) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = speedup;
    Fleet::start(FleetOptions::new(cfg, 1)).await.unwrap()
}

async fn gateway(f: &Fleet, tenants: Vec<TenantSpec>) -> GatewayHandle {
    let mut cfg = common::gateway_config(vec![common::sim_spec(&f.workers[0], PRESET, true)]);
    cfg.tenants = tenants;
    let gw = Gateway::start(cfg).await.unwrap();
    common::ready(&gw).await;
    gw
}

fn tenant(name: &str, key: &str, f: impl FnOnce(&mut TenantSpec)) -> TenantSpec {
    let mut s = TenantSpec::new(name, key);
    f(&mut s);
    s
}

fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (seed * 31 + i * 7) % 900 + 5).collect()
}

struct Reply {
    status: u16,
    body: Value,
    retry_after: Option<u64>,
}

async fn complete(gw: &GatewayHandle, key: Option<&str>, body: Value) -> Reply {
    let mut req = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let body = r.json().await.unwrap_or(Value::Null);
    Reply {
        status,
        body,
        retry_after,
    }
}

fn small(seed: u32) -> Value {
    json!({"model": PRESET, "prompt": prompt(seed, 40), "max_tokens": 2})
}

/// The value of the metric line naming `name` with every one of `labels`; fails the test when
/// there is none.
async fn metric(gw: &GatewayHandle, name: &str, labels: &[&str]) -> f64 {
    let text = common::admin_metrics(gw).await;
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .next()
        .unwrap_or_else(|| panic!("no metric {name} with {labels:?} in:\n{text}"))
}

fn assert_openai_error(body: &Value, status: u16, kind: &str) {
    let e = &body["error"];
    assert_eq!(e["code"], status, "{body}");
    assert_eq!(e["type"], kind, "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e.get("param").is_some(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_or_missing_keys_get_401_while_health_and_metrics_stay_open() {
    let f = fleet(1000.0).await;
    let gw = gateway(&f, vec![TenantSpec::new("team-a", "sk-team-a-secret")]).await;
    let base = format!("http://{}", gw.addr);
    let client = reqwest::Client::new();

    for key in [None, Some("sk-wrong"), Some("sk-team-a-secre")] {
        let r = complete(&gw, key, small(1)).await;
        assert_eq!(r.status, 401, "{key:?}");
        assert_openai_error(&r.body, 401, "AuthenticationError");
        assert_eq!(r.retry_after, None);
    }
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .header("x-api-key", "sk-wrong")
        .json(&json!({"model": PRESET, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");

    // The models list needs a key too; health and metrics on the front do not.
    let r = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .get(format!("{base}/v1/models"))
        .bearer_auth("sk-team-a-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for path in ["/health", "/metrics"] {
        let r = client.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }

    let ok = complete(&gw, Some("sk-team-a-secret"), small(2)).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let x = client
        .post(format!("{base}/v1/completions"))
        .header("x-api-key", "sk-team-a-secret")
        .json(&small(3))
        .send()
        .await
        .unwrap();
    assert_eq!(x.status(), 200);

    let text = common::admin_metrics(&gw).await;
    assert!(!text.contains("sk-team-a"), "a key in the metrics");
    assert_eq!(
        metric(
            &gw,
            "kvroute_tenant_rejections_total",
            &["reason=\"unauthorized\"", "tenant=\"\""]
        )
        .await,
        5.0,
        "three completions, one chat and one models list: {text}"
    );
    assert_eq!(
        metric(&gw, "kvroute_tenant_requests_total", &["tenant=\"team-a\""]).await,
        2.0
    );
    let admin: Value = reqwest::get(format!("http://{}/admin/tenants", gw.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(admin["tenants"][0]["name"], "team-a");
    assert_eq!(admin["tenants"][0]["keys"], 1);
    assert!(!admin.to_string().contains("sk-team-a"), "{admin}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_request_rate_gets_429_with_retry_after() {
    let f = fleet(1000.0).await;
    // One request per 10 s after a burst of 2: no refill lands within the test.
    let gw = gateway(
        &f,
        vec![
            tenant("team-a", "sk-a", |s| {
                s.requests_per_second = Some(0.1);
                s.burst = Some(2);
            }),
            TenantSpec::new("team-b", "sk-b"),
        ],
    )
    .await;
    for k in 0..2 {
        assert_eq!(complete(&gw, Some("sk-a"), small(k)).await.status, 200);
    }
    let r = complete(&gw, Some("sk-a"), small(9)).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_openai_error(&r.body, 429, "RateLimitError");
    // The bucket is one request short: ≈ 10 s, rounded up, never below 1.
    let wait = r.retry_after.expect("Retry-After");
    assert!((1..=10).contains(&wait), "{wait}");
    // Another tenant is not held to team-a's rate.
    for k in 0..3 {
        assert_eq!(complete(&gw, Some("sk-b"), small(20 + k)).await.status, 200);
    }
    let rate = ["tenant=\"team-a\"", "reason=\"rate\""];
    assert_eq!(
        metric(&gw, "kvroute_tenant_rejections_total", &rate).await,
        1.0
    );
    assert_eq!(
        metric(&gw, "kvroute_tenant_requests_total", &["tenant=\"team-a\""]).await,
        2.0
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_tokens_per_minute_gets_429_and_its_charged_tokens_are_counted() {
    let f = fleet(1000.0).await;
    let gw = gateway(
        &f,
        vec![tenant("team-a", "sk-a", |s| {
            s.tokens_per_minute = Some(100);
            s.default_max_tokens = Some(10);
        })],
    )
    .await;
    // 40 prompt tokens + 2 = 42 each; a third would need 126 of 100.
    for k in 0..2 {
        assert_eq!(complete(&gw, Some("sk-a"), small(k)).await.status, 200);
    }
    let r = complete(&gw, Some("sk-a"), small(5)).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert_openai_error(&r.body, 429, "RateLimitError");
    // 26 tokens short at 100 a minute: ≈ 16 s.
    let wait = r.retry_after.expect("Retry-After");
    assert!((1..=16).contains(&wait), "{wait}");
    let tokens = ["tenant=\"team-a\""];
    assert_eq!(
        metric(&gw, "kvroute_tenant_tokens_total", &tokens).await,
        84.0
    );
    // A request larger than a minute's tokens is refused whatever the bucket holds.
    let huge = json!({"model": PRESET, "prompt": prompt(7, 40), "max_tokens": 500});
    let r = complete(&gw, Some("sk-a"), huge).await;
    assert_eq!(r.status, 429);
    assert!(r.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("can never"));
    let reason = ["tenant=\"team-a\"", "reason=\"tokens\""];
    assert_eq!(
        metric(&gw, "kvroute_tenant_rejections_total", &reason).await,
        2.0
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_at_once_against_a_limit_of_five_get_exactly_forty_five_429s() {
    let f = fleet(1000.0).await;
    let gw = gateway(
        &f,
        vec![tenant("team-a", "sk-a", |s| s.max_concurrent = Some(5))],
    )
    .await;
    // The engine holds every request it gets until resumed: five stay in flight.
    f.workers[0].worker.pause();
    let gw_ref = &gw;
    let clients = (0..50u32).map(|k| async move {
        let r = complete(gw_ref, Some("sk-a"), small(100 + k)).await;
        (r.status, r.retry_after, r.body)
    });
    let mut pending: Vec<_> = clients.map(Box::pin).collect();
    let mut rejected = Vec::new();
    // Collect the rejections as they come; the admitted five cannot finish while paused.
    while rejected.len() < 45 {
        let (done, _, rest) = futures_util::future::select_all(pending).await;
        pending = rest;
        rejected.push(done);
    }
    assert_eq!(
        metric(&gw, "kvroute_tenant_in_flight", &["tenant=\"team-a\""]).await,
        5.0
    );
    f.workers[0].worker.resume();
    let admitted = join_all(pending).await;
    assert!(rejected.iter().all(|(s, _, _)| *s == 429), "{rejected:?}");
    for (_, retry, body) in &rejected {
        assert!(retry.is_some_and(|s| s >= 1), "{retry:?}");
        assert_openai_error(body, 429, "RateLimitError");
    }
    assert_eq!(admitted.len(), 5);
    assert!(admitted.iter().all(|(s, _, _)| *s == 200), "{admitted:?}");
    assert_eq!(
        metric(&gw, "kvroute_tenant_in_flight", &["tenant=\"team-a\""]).await,
        0.0
    );
    let reason = ["tenant=\"team-a\"", "reason=\"concurrency\""];
    assert_eq!(
        metric(&gw, "kvroute_tenant_rejections_total", &reason).await,
        45.0
    );
    assert_eq!(
        metric(&gw, "kvroute_tenant_requests_total", &["tenant=\"team-a\""]).await,
        5.0
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_gives_its_concurrency_slot_back() {
    // Real time: a 900-token answer streams for seconds.
    let f = fleet(1.0).await;
    let gw = gateway(
        &f,
        vec![tenant("team-a", "sk-a", |s| s.max_concurrent = Some(1))],
    )
    .await;
    let mut stream = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gw.addr))
        .bearer_auth("sk-a")
        .json(&json!({"model": PRESET, "prompt": prompt(3, 64), "max_tokens": 900, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.unwrap().is_some());
    // The stream holds the only slot.
    let r = complete(&gw, Some("sk-a"), small(1)).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.retry_after.is_some_and(|s| s >= 1));
    let in_flight = || metric(&gw, "kvroute_tenant_in_flight", &["tenant=\"team-a\""]);
    assert_eq!(in_flight().await, 1.0);
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight().await > 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(in_flight().await, 0.0, "the slot came back");
    assert_eq!(complete(&gw, Some("sk-a"), small(2)).await.status, 200);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_the_tenants_at_runtime_takes_new_keys_and_keeps_a_surviving_tenants_rate() {
    let f = fleet(1000.0).await;
    let rated = |key: &str| {
        tenant("team-a", key, |s| {
            s.requests_per_second = Some(0.1);
            s.burst = Some(1);
        })
    };
    let gw = gateway(&f, vec![rated("sk-old")]).await;
    assert_eq!(complete(&gw, Some("sk-old"), small(1)).await.status, 200);
    gw.state
        .tenants
        .replace(&[rated("sk-new"), TenantSpec::new("team-b", "sk-b")])
        .unwrap();
    assert_eq!(complete(&gw, Some("sk-old"), small(2)).await.status, 401);
    // team-a's bucket is still empty under its new key.
    assert_eq!(complete(&gw, Some("sk-new"), small(3)).await.status, 429);
    assert_eq!(complete(&gw, Some("sk-b"), small(4)).await.status, 200);
    // An invalid table is refused and the old one stays.
    let e = gw
        .state
        .tenants
        .replace(&[
            TenantSpec::new("team-c", "sk-b"),
            TenantSpec::new("team-d", "sk-b"),
        ])
        .unwrap_err();
    assert!(e.to_string().contains("share an API key"), "{e}");
    assert_eq!(complete(&gw, Some("sk-b"), small(5)).await.status, 200);
    gw.shutdown().await;
}

#[test]
fn a_toml_config_declares_tenants_and_bad_ones_name_the_field() {
    use kvroute::gateway::config::file::GatewayConfig;
    let c = GatewayConfig::from_toml(
        r#"
        [[tenants]]
        name = "team-a"
        api_keys = ["sk-a1", "sk-a2"]
        requests_per_second = 5
        burst = 10
        tokens_per_minute = 200000
        max_concurrent = 8

        [[tenants]]
        name = "team-b"
        api_keys = ["sk-b"]
        "#,
    )
    .unwrap();
    assert_eq!(c.tenants.len(), 2);
    assert_eq!(c.tenants[0].requests_per_second, Some(5.0));
    assert_eq!(c.tenants[0].max_concurrent, Some(8));
    for (toml, field) in [
        (
            "[[tenants]]\nname='a'\napi_keys=['k']\nmax_concurrent=0\n",
            "max_concurrent",
        ),
        (
            "[[tenants]]\nname='a'\napi_keys=['k']\n[[tenants]]\nname='b'\napi_keys=['k']\n",
            "share an API key",
        ),
        ("[[tenants]]\nname=''\napi_keys=['k']\n", "name"),
        ("[[tenants]]\nname='a'\napi_keys=['k']\nrps=3\n", "rps"),
    ] {
        let e = GatewayConfig::from_toml(toml).unwrap_err();
        assert!(e.contains(field), "{toml}: {e}");
    }
}
