//! The tenant table on a manual clock: keys, each limit, replacing the table, validation.

use super::limits::reference::ReferenceBucket;
use super::limits::ManualClock;
use super::*;
use proptest::prelude::*;
use serde_json::json;

const SEC: u64 = NS_PER_SEC;

fn bearer(key: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
    );
    h
}

fn table(specs: &[TenantSpec]) -> (Tenants, Arc<ManualClock>, TenantMetrics) {
    let clock = Arc::new(ManualClock::default());
    let metrics = TenantMetrics::new();
    let t = Tenants::with_clock(specs, metrics.clone(), clock.clone()).unwrap();
    (t, clock, metrics)
}

fn rejections(m: &TenantMetrics, tenant: &str, reason: Reason) -> u64 {
    m.rejections
        .with_label_values(&[tenant, reason.label()])
        .get()
}

fn limited(name: &str, key: &str, f: impl FnOnce(&mut TenantSpec)) -> TenantSpec {
    let mut s = TenantSpec::new(name, key);
    f(&mut s);
    s
}

#[test]
fn with_no_tenants_the_door_is_open() {
    let (t, _, _) = table(&[]);
    assert!(t.is_open());
    assert!(t.admit(&HeaderMap::new()).unwrap().is_none());
    assert!(t.authenticate(&bearer("anything")).unwrap().is_none());
}

#[test]
fn a_key_names_its_tenant_and_unknown_or_missing_keys_are_unauthorized() {
    let (t, _, m) = table(&[
        TenantSpec::new("team-a", "sk-a"),
        TenantSpec::new("team-b", "sk-b"),
    ]);
    let a = t.admit(&bearer("sk-a")).unwrap().unwrap();
    assert_eq!(a.tenant(), "team-a");
    let b = t.admit(&bearer("sk-b")).unwrap().unwrap();
    assert_eq!(b.tenant(), "team-b");
    for h in [
        bearer("sk-c"),
        bearer("sk-a2"),
        bearer(""),
        HeaderMap::new(),
    ] {
        let r = t.admit(&h).err().unwrap();
        assert_eq!(r.reason, Reason::Unauthorized);
        assert_eq!(r.retry_after_secs, None);
    }
    assert_eq!(rejections(&m, "", Reason::Unauthorized), 4);
    let resp = t.admit(&bearer("nope")).err().unwrap().into_response();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(resp.headers()["www-authenticate"], "Bearer");
}

#[test]
fn the_bearer_scheme_is_case_insensitive_and_x_api_key_is_accepted() {
    let (t, _, _) = table(&[TenantSpec::new("team-a", "sk-a")]);
    let mut h = HeaderMap::new();
    h.insert("authorization", HeaderValue::from_static("bearer   sk-a "));
    assert!(t.authenticate(&h).unwrap().is_some());
    let mut h = HeaderMap::new();
    h.insert("x-api-key", HeaderValue::from_static("sk-a"));
    assert!(t.authenticate(&h).unwrap().is_some());
    let mut h = HeaderMap::new();
    h.insert("authorization", HeaderValue::from_static("Basic sk-a"));
    assert!(t.authenticate(&h).is_err());
}

#[test]
fn a_tenant_over_its_request_rate_is_refused_until_its_bucket_refills() {
    let (t, clock, m) = table(&[limited("team-a", "sk-a", |s| {
        s.requests_per_second = Some(0.5);
        s.burst = Some(2);
    })]);
    let h = bearer("sk-a");
    drop(t.admit(&h).unwrap());
    drop(t.admit(&h).unwrap());
    let r = t.admit(&h).err().unwrap();
    assert_eq!(r.reason, Reason::Rate);
    // One request every 2 s: the next is 2 s away, then 1.5 s (rounded up to 2), then 0.5 s.
    assert_eq!(r.retry_after_secs, Some(2));
    clock.advance_ns(SEC / 2);
    assert_eq!(t.admit(&h).err().unwrap().retry_after_secs, Some(2));
    clock.advance_ns(SEC);
    assert_eq!(t.admit(&h).err().unwrap().retry_after_secs, Some(1));
    clock.advance_ns(SEC / 2);
    assert!(t.admit(&h).is_ok());
    assert_eq!(rejections(&m, "team-a", Reason::Rate), 3);
    let resp = t.admit(&h).err().unwrap().into_response();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(resp.headers()["retry-after"], "2");
}

#[test]
fn a_tenant_over_its_tokens_per_minute_is_refused_with_the_wait_for_those_tokens() {
    let (t, clock, m) = table(&[limited("team-a", "sk-a", |s| {
        s.tokens_per_minute = Some(600);
    })]);
    let a = t.admit(&bearer("sk-a")).unwrap().unwrap();
    assert_eq!(t.charge(&a, 300, Some(200)), Ok(500));
    let r = t.charge(&a, 100, Some(100)).unwrap_err();
    assert_eq!(r.reason, Reason::Tokens);
    // 100 tokens short at 10 tokens a second.
    assert_eq!(r.retry_after_secs, Some(10));
    clock.advance_ns(10 * SEC);
    assert_eq!(t.charge(&a, 100, Some(100)), Ok(200));
    assert_eq!(m.tokens.with_label_values(&["team-a"]).get(), 700);
    assert_eq!(m.admitted.with_label_values(&["team-a"]).get(), 2);
    assert_eq!(rejections(&m, "team-a", Reason::Tokens), 1);
}

#[test]
fn a_request_larger_than_a_minute_of_tokens_is_told_to_wait_a_full_refill() {
    let (t, _, _) = table(&[limited("team-a", "sk-a", |s| {
        s.tokens_per_minute = Some(100);
    })]);
    let a = t.admit(&bearer("sk-a")).unwrap().unwrap();
    let r = t.charge(&a, 90, Some(20)).unwrap_err();
    assert_eq!(r.retry_after_secs, Some(60));
    assert!(r.message.contains("can never"), "{}", r.message);
}

#[test]
fn a_request_without_max_tokens_is_charged_the_default_completion() {
    let (t, _, _) = table(&[
        TenantSpec::new("team-a", "sk-a"),
        limited("team-b", "sk-b", |s| s.default_max_tokens = Some(16)),
    ]);
    let a = t.admit(&bearer("sk-a")).unwrap().unwrap();
    assert_eq!(t.charge(&a, 10, None), Ok(10 + DEFAULT_MAX_TOKENS));
    let b = t.admit(&bearer("sk-b")).unwrap().unwrap();
    assert_eq!(t.charge(&b, 10, None), Ok(26));
}

#[test]
fn the_completion_budget_is_max_tokens_times_n() {
    assert_eq!(completion_budget(&json!({"max_tokens": 8})), Some(8));
    assert_eq!(
        completion_budget(&json!({"max_tokens": 8, "n": 3})),
        Some(24)
    );
    assert_eq!(
        completion_budget(&json!({"max_completion_tokens": 5})),
        Some(5)
    );
    assert_eq!(completion_budget(&json!({"max_tokens": "8"})), None);
    assert_eq!(completion_budget(&json!({})), None);
}

#[test]
fn a_concurrency_slot_is_held_until_its_admission_drops() {
    let (t, clock, m) = table(&[limited("team-a", "sk-a", |s| s.max_concurrent = Some(2))]);
    let h = bearer("sk-a");
    let first = t.admit(&h).unwrap();
    let second = t.admit(&h).unwrap();
    let r = t.admit(&h).err().unwrap();
    assert_eq!(r.reason, Reason::Concurrency);
    // Nothing was released yet: one second.
    assert_eq!(r.retry_after_secs, Some(1));
    assert_eq!(m.in_flight.with_label_values(&["team-a"]).get(), 2);
    clock.advance_ns(3 * SEC);
    drop(first);
    assert_eq!(m.in_flight.with_label_values(&["team-a"]).get(), 1);
    let third = t.admit(&h).unwrap();
    // Recent requests held their slot 3 s.
    assert_eq!(t.admit(&h).err().unwrap().retry_after_secs, Some(3));
    drop((second, third));
    assert_eq!(m.in_flight.with_label_values(&["team-a"]).get(), 0);
    assert_eq!(t.view()[0].in_flight, 0);
    assert_eq!(rejections(&m, "team-a", Reason::Concurrency), 2);
}

#[test]
fn replacing_the_table_keeps_the_state_of_tenants_whose_name_survives() {
    let rate = |name: &str, key: &str| {
        limited(name, key, |s| {
            s.requests_per_second = Some(1.0);
            s.burst = Some(1);
            s.max_concurrent = Some(5);
        })
    };
    let (t, _, _) = table(&[rate("team-a", "sk-a"), rate("team-b", "sk-b")]);
    let held = t.admit(&bearer("sk-a")).unwrap();
    assert_eq!(t.admit(&bearer("sk-a")).err().unwrap().reason, Reason::Rate);
    // team-a gets a new key; team-b goes; team-c arrives.
    t.replace(&[rate("team-a", "sk-a-2"), rate("team-c", "sk-c")])
        .unwrap();
    assert_eq!(
        t.admit(&bearer("sk-a")).err().unwrap().reason,
        Reason::Unauthorized
    );
    assert_eq!(
        t.admit(&bearer("sk-a-2")).err().unwrap().reason,
        Reason::Rate,
        "the emptied bucket survives"
    );
    assert!(t.admit(&bearer("sk-b")).is_err());
    assert!(t.admit(&bearer("sk-c")).is_ok());
    let view = t.view();
    assert_eq!(view.len(), 2);
    assert_eq!((view[0].name.as_str(), view[0].in_flight), ("team-a", 1));
    drop(held);
    assert_eq!(t.view()[0].in_flight, 0);
}

#[test]
fn a_failed_replace_leaves_the_table_unchanged() {
    let (t, _, _) = table(&[TenantSpec::new("team-a", "sk-a")]);
    let e = t
        .replace(&[
            TenantSpec::new("team-a", "sk"),
            TenantSpec::new("team-b", "sk"),
        ])
        .unwrap_err();
    assert!(matches!(e, TenantError::DuplicateKey { .. }), "{e}");
    assert!(t.authenticate(&bearer("sk-a")).unwrap().is_some());
}

#[test]
fn bad_tenants_are_refused_with_the_offending_field_named() {
    let dir = std::env::temp_dir().join(format!("kvroute-tenants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.txt");
    let cases: Vec<(Vec<TenantSpec>, &str)> = vec![
        (vec![TenantSpec::new(" ", "k")], "name"),
        (
            vec![TenantSpec::new("a", "k1"), TenantSpec::new("a", "k2")],
            "listed twice",
        ),
        (
            vec![TenantSpec::new("a", "k"), TenantSpec::new("b", "k")],
            "share an API key",
        ),
        (
            vec![limited("a", "k", |s| s.requests_per_second = Some(0.0))],
            "requests_per_second",
        ),
        (
            vec![limited("a", "k", |s| {
                s.requests_per_second = Some(f64::NAN)
            })],
            "requests_per_second",
        ),
        (
            vec![limited("a", "k", |s| {
                s.requests_per_second = Some(1.0);
                s.burst = Some(0);
            })],
            "burst",
        ),
        (vec![limited("a", "k", |s| s.burst = Some(3))], "burst"),
        (
            vec![limited("a", "k", |s| s.tokens_per_minute = Some(0))],
            "tokens_per_minute",
        ),
        (
            vec![limited("a", "k", |s| s.max_concurrent = Some(0))],
            "max_concurrent",
        ),
        (
            vec![limited("a", "k", |s| s.default_max_tokens = Some(0))],
            "default_max_tokens",
        ),
        (vec![limited("a", "k", |s| s.api_keys.clear())], "api_keys"),
        (vec![TenantSpec::new("a", "sk with space")], "api_keys"),
        (
            vec![limited("a", "k", |s| {
                s.api_keys_file = Some(missing.clone())
            })],
            "api_keys_file",
        ),
        (
            vec![limited("a", "k", |s| {
                s.api_key_env = Some("KVROUTE_TEST_NO_SUCH_VARIABLE".into())
            })],
            "api_key_env",
        ),
    ];
    for (specs, field) in cases {
        let e = validate(&specs).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
    let file = dir.join("keys.txt");
    std::fs::write(&file, "# team a\nsk-file-1\n\n  sk-file-2  \n").unwrap();
    let (t, _, _) = table(&[limited("a", "k", |s| s.api_keys_file = Some(file.clone()))]);
    for k in ["k", "sk-file-1", "sk-file-2"] {
        assert!(t.authenticate(&bearer(k)).unwrap().is_some(), "{k}");
    }
    assert_eq!(t.view()[0].keys, 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn keys_appear_in_no_error_debug_output_or_view() {
    let spec = TenantSpec::new("team-a", "sk-secret-123");
    assert!(!format!("{spec:?}").contains("sk-secret"));
    let json = serde_json::to_string(&spec).unwrap();
    assert!(!json.contains("sk-secret"), "{json}");
    let e = validate(&[spec.clone(), limited("team-b", "sk-secret-123", |_| {})]).unwrap_err();
    assert!(!e.to_string().contains("sk-secret"), "{e}");
    let (t, _, _) = table(&[spec]);
    let view = serde_json::to_string(&t.view()).unwrap();
    assert!(!view.contains("sk-secret"), "{view}");
    let r = t.admit(&bearer("sk-secret-124")).err().unwrap();
    assert!(!r.message.contains("sk-secret"), "{}", r.message);
}

proptest! {
    #[test]
    fn admission_through_the_table_agrees_with_the_reference_rate_and_token_models(
        burst in 1u32..5,
        tpm in 1u64..400,
        arrivals in proptest::collection::vec((0u64..3 * SEC, 0u64..60), 1..80),
    ) {
        // One request per 2 s; `tpm` tokens a minute.
        let (t, clock, _) = table(&[limited("a", "k", |s| {
            s.requests_per_second = Some(0.5);
            s.burst = Some(burst);
            s.tokens_per_minute = Some(tpm);
        })]);
        let mut rate = ReferenceBucket {
            interval_ns: 2 * SEC,
            capacity: burst as u64,
            admitted: vec![],
        };
        let tok_interval = (60.0 * SEC as f64 / tpm as f64).round() as u64;
        let mut tokens = ReferenceBucket {
            interval_ns: tok_interval,
            capacity: tpm,
            admitted: vec![],
        };
        let h = bearer("k");
        for (gap, cost) in arrivals {
            clock.advance_ns(gap);
            let now = clock.now_ns();
            let expect_rate = rate.take(now, 1);
            match t.admit(&h) {
                Ok(Some(a)) => {
                    prop_assert_eq!(expect_rate, None);
                    let expect_tokens = tokens.take(now, cost);
                    let got = t.charge(&a, cost, Some(0));
                    match (got, expect_tokens) {
                        (Ok(c), None) => prop_assert_eq!(c, cost),
                        (Err(r), Some(w)) => {
                            let ns = w.unwrap_or(tok_interval * tpm);
                            prop_assert_eq!(r.retry_after_secs, Some(retry_secs(ns)));
                        }
                        (got, expect) => prop_assert!(false, "{:?} vs {:?}", got, expect),
                    }
                }
                Ok(None) => prop_assert!(false, "the door is closed"),
                Err(r) => {
                    let w = expect_rate.flatten();
                    prop_assert!(w.is_some());
                    prop_assert_eq!(r.retry_after_secs, w.map(retry_secs));
                }
            }
        }
    }
}
