//! The gateway's front and admin API over real HTTP: OpenAI-style errors with the right
//! statuses, body limits, the admin token, and adding/removing workers.

use kvroute::gateway::config::{GatewayConfig, WorkerSpec};
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
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
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

#[tokio::test]
async fn the_admin_api_needs_its_token_and_manages_workers() {
    let gw = gateway(vec![], Some("s3cret")).await;
    let admin = format!("http://{}", gw.admin_addr);
    let client = reqwest::Client::new();
    let r = client
        .get(format!("{admin}/admin/workers"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = client
        .get(format!("{admin}/admin/workers"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);

    let spec = json!({"name": "w1", "url": "http://127.0.0.1:9", "model": "m",
                      "kv_events": {"endpoint": "tcp://127.0.0.1:0"}});
    let bad =
        json!({"name": "w2", "url": "http://127.0.0.1:9", "model": "m", "hash_algo": "xxhash"});
    let r = client
        .post(format!("{admin}/admin/workers"))
        .bearer_auth("s3cret")
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let spec_ok = json!({"name": "w1", "url": "http://127.0.0.1:9", "model": "m"});
    let _ = spec;
    let r = client
        .post(format!("{admin}/admin/workers"))
        .bearer_auth("s3cret")
        .json(&spec_ok)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let r = client
        .post(format!("{admin}/admin/workers"))
        .bearer_auth("s3cret")
        .json(&spec_ok)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let r = client
        .post(format!("{admin}/admin/workers/w1/drain"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let list: Value = client
        .get(format!("{admin}/admin/workers"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["workers"][0]["draining"], true);
    let r = client
        .delete(format!("{admin}/admin/workers/w1"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let r = client
        .delete(format!("{admin}/admin/workers/w1"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = client
        .put(format!("{admin}/admin/policy"))
        .bearer_auth("s3cret")
        .json(&json!({"policy": "round-robin"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(gw.state.policy().name(), "round-robin");
    gw.shutdown().await;
}
