//! The gateway's front and admin API over real HTTP: OpenAI-style errors with the right
//! statuses, body limits, the admin token, and adding/removing workers.

use crate::common;

use kvroute::gateway::config::{file::GatewayConfig, WorkerSpec};
use kvroute::gateway::{Gateway, GatewayHandle};
use serde_json::{json, Value};

async fn gateway(workers: Vec<WorkerSpec>, token: Option<&str>) -> GatewayHandle {
    let cfg = GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        admin_token: token.map(Into::into),
        max_body_bytes: 4096,
        health_interval_secs: 0.1,
        workers,
        ..GatewayConfig::default()
    };
    Gateway::start(cfg).await.expect("gateway starts")
}

fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

async fn post(url: String, body: Value) -> (u16, Value, reqwest::header::HeaderMap) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, r.json().await.unwrap_or(Value::Null), headers)
}

#[tokio::test]
async fn malformed_requests_get_openai_style_errors_with_the_right_status() {
    let port = dead_port();
    let gw = gateway(
        vec![WorkerSpec::new(
            "w0",
            &format!("http://127.0.0.1:{port}"),
            "m",
        )],
        None,
    )
    .await;
    let base = format!("http://{}", gw.addr);
    let client = reqwest::Client::new();

    let r = client
        .post(format!("{base}/v1/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 400);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("invalid JSON"));

    let (s, v, _) = post(
        format!("{base}/v1/completions"),
        json!({"model": "nope", "prompt": [1, 2]}),
    )
    .await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["type"], "NotFoundError");

    let (s, _, _) = post(
        format!("{base}/v1/completions"),
        json!({"model": "m", "prompt": [[1], [2]]}),
    )
    .await;
    assert_eq!(s, 400);
    let (s, _, _) = post(
        format!("{base}/v1/chat/completions"),
        json!({"model": "m", "messages": []}),
    )
    .await;
    assert_eq!(s, 400);
    let (s, _, _) = post(
        format!("{base}/v1/completions"),
        json!({"model": "m", "prompt": [1], "cache_salt": 5}),
    )
    .await;
    assert_eq!(s, 400);

    let big = json!({"model": "m", "prompt": vec![1u32; 5000]});
    let (s, v, _) = post(format!("{base}/v1/completions"), big).await;
    assert_eq!(s, 413, "{v}");

    // The only worker is down: a request that reaches it fails upstream (502); once a health
    // check or a failure marked it, requests get 503 with Retry-After.
    let (s, v, _) = post(
        format!("{base}/v1/completions"),
        json!({"model": "m", "prompt": [1, 2, 3]}),
    )
    .await;
    assert!(s == 502 || s == 503, "{v}");
    common::wait_until(common::WAIT, "the dead worker marked down", || async {
        common::admin_workers(&gw).await["workers"][0]["healthy"] == false
    })
    .await;
    let (s, v, h) = post(
        format!("{base}/v1/completions"),
        json!({"model": "m", "prompt": [1, 2, 3]}),
    )
    .await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(h.get("retry-after").map(|v| v.to_str().unwrap()), Some("1"));

    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "m");
    let health = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 503);
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("kvroute_requests_total"), "{metrics}");
    assert!(metrics.contains("kvroute_index_events"), "{metrics}");
    gw.shutdown().await;
}

/// One admin call: (status, JSON body or null).
async fn admin(
    gw: &GatewayHandle,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = reqwest::Client::new().request(method, format!("http://{}{path}", gw.admin_addr));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn the_admin_api_needs_its_token_and_manages_workers() {
    use reqwest::Method;
    let gw = gateway(vec![], Some("s3cret")).await;
    let t = Some("s3cret");
    assert_eq!(
        admin(&gw, Method::GET, "/admin/workers", None, None)
            .await
            .0,
        401
    );
    assert_eq!(
        admin(&gw, Method::GET, "/admin/workers", Some("wrong"), None)
            .await
            .0,
        401
    );

    let bad =
        json!({"name": "w2", "url": "http://127.0.0.1:9", "model": "m", "hash_algo": "xxhash"});
    assert_eq!(
        admin(&gw, Method::POST, "/admin/workers", t, Some(bad))
            .await
            .0,
        400
    );
    let ok = json!({"name": "w1", "url": "http://127.0.0.1:9", "model": "m"});
    assert_eq!(
        admin(&gw, Method::POST, "/admin/workers", t, Some(ok.clone()))
            .await
            .0,
        201
    );
    assert_eq!(
        admin(&gw, Method::POST, "/admin/workers", t, Some(ok))
            .await
            .0,
        409
    );
    assert_eq!(
        admin(&gw, Method::POST, "/admin/workers/w1/drain", t, None)
            .await
            .0,
        200
    );
    let (_, list) = admin(&gw, Method::GET, "/admin/workers", t, None).await;
    assert_eq!(list["workers"][0]["draining"], true);
    assert_eq!(
        admin(&gw, Method::DELETE, "/admin/workers/w1", t, None)
            .await
            .0,
        204
    );
    assert_eq!(
        admin(&gw, Method::DELETE, "/admin/workers/w1", t, None)
            .await
            .0,
        404
    );
    let (s, _) = admin(
        &gw,
        Method::PUT,
        "/admin/policy",
        t,
        Some(json!({"policy": "round-robin"})),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(gw.state.policy().name(), "round-robin");
    let (s, _) = admin(
        &gw,
        Method::PUT,
        "/admin/policy",
        t,
        Some(json!({"policy": "fastest"})),
    )
    .await;
    assert_eq!(s, 400);
    gw.shutdown().await;
}
