//! TLS over real sockets, with certificates made here (rcgen): the official `openai` client
//! completes a request over HTTPS; the admin listener with client certificates refuses a
//! missing and a wrong one and accepts the right one; a certificate replaced on disk and
//! reloaded is the one the next connection gets; an engine behind TLS is reached over HTTPS
//! with the configured CA bundle.

mod common;

use kvroute::gateway::config::file::GatewayConfig;
use kvroute::gateway::config::peers::PeersTls;
use kvroute::gateway::config::tls::ListenerTls;
use kvroute::gateway::reload::ConfigSource;
use kvroute::gateway::{tls, Gateway, GatewayHandle};
use kvroute_sim::{Fleet, FleetOptions, WorkerConfig};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const PRESET: &str = "tiny-gemma3";

/// A certificate authority made for one test.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let pem = p.self_signed(&key).unwrap().pem();
        Ca {
            issuer: Issuer::new(p, key),
            pem,
        }
    }

    /// A certificate (PEM) and its key (PEM) for loopback, as a server's or a client's.
    fn issue(&self, name: &str, client: bool) -> (String, String) {
        let mut p = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A fresh directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-tls-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes a server certificate issued by `ca` to `dir` (`server.pem`, `server.key`) and the
/// CA to `ca.pem`.
fn write_server(dir: &Path, ca: &Ca) -> ListenerTls {
    let (cert, key) = ca.issue("kvroute test server", false);
    std::fs::write(dir.join("server.pem"), cert).unwrap();
    std::fs::write(dir.join("server.key"), key).unwrap();
    std::fs::write(dir.join("ca.pem"), &ca.pem).unwrap();
    ListenerTls {
        cert_file: dir.join("server.pem"),
        key_file: dir.join("server.key"),
        client_ca_file: None,
    }
}

/// A new HTTPS client trusting only `ca_pem`, presenting `identity` (certificate and key
/// PEM) when given. A new client is a new connection.
fn client(ca_pem: &str, identity: Option<(&str, &str)>) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10));
    if let Some((cert, key)) = identity {
        b = b.identity(reqwest::Identity::from_pem(format!("{cert}\n{key}").as_bytes()).unwrap());
    }
    b.build().unwrap()
}

async fn fleet(n: usize) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(PRESET).unwrap();
    cfg.speedup = 1000.0;
    Fleet::start(FleetOptions::new(cfg, n)).await.unwrap()
}

/// Starts a gateway: its listeners are bound when this returns (a test that routes a request
/// also waits for [`ready`]).
async fn start(cfg: GatewayConfig) -> GatewayHandle {
    Gateway::start(cfg).await.unwrap()
}

use common::metric;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_completes_a_request_over_https_with_the_test_ca() {
    if !common::python::python_has(&["openai"], "openai") {
        return;
    }
    let dir = scratch("openai");
    let ca = Ca::new("kvroute test CA");
    let f = fleet(1).await;
    let mut cfg = common::gateway_config(vec![common::sim_spec(&f.workers[0], PRESET, true)]);
    cfg.tls = Some(write_server(&dir, &ca));
    let gw = start(cfg).await;
    let base = format!("https://127.0.0.1:{}", gw.addr.port());
    common::ready_with(&client(&ca.pem, None), &base).await;
    let script = r#"
import ssl, sys, openai
ctx = ssl.create_default_context(cafile=sys.argv[2])
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none",
                  http_client=openai.DefaultHttpxClient(verify=ctx))
model = c.models.list().data[0].id
r = c.completions.create(model=model, prompt=list(range(3, 103)), max_tokens=4)
assert r.usage.prompt_tokens == 100, r.usage
msgs = [{"role": "user", "content": "Hello over TLS!"}]
chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=4, stream=True))
assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
print("ok")
"#;
    let args = vec![
        "-c".to_string(),
        script.to_string(),
        format!("https://127.0.0.1:{}", gw.addr.port()),
        dir.join("ca.pem").display().to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Plain HTTP on the TLS port is a failed handshake, counted; the listener goes on.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/health/live", gw.addr))
        .send()
        .await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success());
    // The client may see the refusal before the listener's task has counted it.
    common::wait_for_metric(
        &format!("http://{}/metrics", gw.admin_addr),
        "kvroute_tls_handshake_failures_total{listener=\"front\"}",
        1.0,
    )
    .await;
    let again = client(&ca.pem, None)
        .get(format!("https://127.0.0.1:{}/health/live", gw.addr.port()))
        .send()
        .await
        .unwrap();
    assert!(again.status().is_success());
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_with_client_certificates_refuses_a_missing_and_a_wrong_one_and_accepts_the_right_one(
) {
    let dir = scratch("mtls");
    let ca = Ca::new("kvroute test CA");
    let other = Ca::new("someone else's CA");
    let mut admin = write_server(&dir, &ca);
    admin.client_ca_file = Some(dir.join("ca.pem"));
    let mut cfg = common::gateway_config(Vec::new());
    cfg.admin_tls = Some(admin);
    let gw = start(cfg).await;
    let url = format!("https://127.0.0.1:{}/admin/workers", gw.admin_addr.port());
    let missing = client(&ca.pem, None).get(&url).send().await;
    assert!(missing.is_err(), "no client certificate: {missing:?}");
    let (wrong_cert, wrong_key) = other.issue("intruder", true);
    let wrong = client(&ca.pem, Some((&wrong_cert, &wrong_key)))
        .get(&url)
        .send()
        .await;
    assert!(wrong.is_err(), "a certificate of another CA: {wrong:?}");
    let (cert, key) = ca.issue("operator", true);
    let right = client(&ca.pem, Some((&cert, &key)))
        .get(&url)
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), 200);
    // Both refusals are counted (each by its connection's task, which may finish after the
    // client saw the refusal); the front listener stayed plain HTTP.
    common::wait_for_metric(
        &format!("http://{}/metrics", gw.addr),
        "kvroute_tls_handshake_failures_total{listener=\"admin\"}",
        2.0,
    )
    .await;
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_reaches_a_peer_whose_admin_requires_client_certificates_with_its_peers_certificate(
) {
    let dir = scratch("peers");
    let ca = Ca::new("kvroute test CA");
    let mut admin = write_server(&dir, &ca);
    admin.client_ca_file = Some(dir.join("ca.pem"));
    let mut cfg = common::gateway_config(Vec::new());
    cfg.admin_tls = Some(admin);
    let guarded = start(cfg).await;
    let peer_url = format!("https://127.0.0.1:{}", guarded.admin_addr.port());

    // Without a client certificate (the CA trusted, so only mTLS can refuse it): refused.
    let mut cfg = common::gateway_config(Vec::new());
    cfg.peers.urls = vec![peer_url.clone()];
    cfg.engine_ca_file = Some(dir.join("ca.pem"));
    let anonymous = start(cfg).await;
    // The counter appears with its first failed batch.
    common::wait_for_metric(
        &format!("http://{}/metrics", anonymous.admin_addr),
        "kvroute_peer_batches_total{outcome=\"failed\"}",
        1.0,
    )
    .await;
    let heard = |gw: &GatewayHandle| format!("http://{}/metrics", gw.addr);
    let text = common::metrics_at(&heard(&guarded)).await;
    assert_eq!(
        metric(&text, "kvroute_peers_heard"),
        0.0,
        "nobody got through"
    );
    anonymous.shutdown().await;

    // With `[peers.tls]`: its certificate, issued by the CA the peer's admin trusts.
    let (cert, key) = ca.issue("replica", true);
    std::fs::write(dir.join("replica.pem"), cert).unwrap();
    std::fs::write(dir.join("replica.key"), key).unwrap();
    let mut cfg = common::gateway_config(Vec::new());
    cfg.peers.urls = vec![peer_url];
    cfg.peers.tls = Some(PeersTls {
        client_cert_file: dir.join("replica.pem"),
        client_key_file: dir.join("replica.key"),
        ca_file: Some(dir.join("ca.pem")),
    });
    let replica = start(cfg).await;
    common::wait_for_metric(&heard(&guarded), "kvroute_peers_heard", 1.0).await;

    // A key file that does not read: the replica does not start, naming the field.
    let mut cfg = common::gateway_config(Vec::new());
    cfg.peers.urls = vec!["https://127.0.0.1:9".into()];
    cfg.peers.tls = Some(PeersTls {
        client_cert_file: dir.join("replica.pem"),
        client_key_file: dir.join("missing.key"),
        ca_file: None,
    });
    let err = Gateway::start(cfg).await.err().map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("peers.tls.client_key_file")),
        "{err:?}"
    );
    replica.shutdown().await;
    guarded.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_replaced_on_disk_is_used_by_the_next_connection_after_a_reload() {
    let dir = scratch("reload");
    let first = Ca::new("first CA");
    let tls = write_server(&dir, &first);
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        tls.cert_file.display().to_string(),
        tls.key_file.display().to_string()
    );
    let path = dir.join("kvroute.toml");
    std::fs::write(&path, &toml).unwrap();
    let gw = start(GatewayConfig::from_toml(&toml).unwrap()).await;
    gw.state.reloader.set_source(ConfigSource {
        path: path.clone(),
        overlay: None,
    });
    let live = format!("https://127.0.0.1:{}/health/live", gw.addr.port());
    let reload = format!("http://{}/admin/reload", gw.admin_addr);
    assert!(client(&first.pem, None)
        .get(&live)
        .send()
        .await
        .unwrap()
        .status()
        .is_success());

    // A broken key is refused whole, naming the field; the running certificate stays.
    std::fs::write(&tls.key_file, "not a key").unwrap();
    let r = reqwest::Client::new().post(&reload).send().await.unwrap();
    let body = r.text().await.unwrap();
    assert!(body.contains("tls.key_file"), "{body}");
    assert!(client(&first.pem, None).get(&live).send().await.is_ok());

    let second = Ca::new("second CA");
    write_server(&dir, &second);
    let r = reqwest::Client::new().post(&reload).send().await.unwrap();
    assert!(r.status().is_success());
    let report: serde_json::Value = r.json().await.unwrap();
    assert_eq!(report["tls_reloaded"], json!(["tls"]), "{report}");
    let by_second = client(&second.pem, None).get(&live).send().await.unwrap();
    assert!(by_second.status().is_success());
    let by_first = client(&first.pem, None).get(&live).send().await;
    assert!(
        by_first.is_err(),
        "the old certificate is no longer served: {by_first:?}"
    );
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Terminates TLS on a loopback port and forwards the bytes to `target` (an engine that
/// speaks plain HTTP, as a sidecar or a load balancer in front of it would).
async fn tls_in_front_of(target: String, tls: &ListenerTls) -> u16 {
    let config = tls::server_config(tls, "test").unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((io, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let target = target.clone();
            tokio::spawn(async move {
                let Ok(mut front) = acceptor.accept(io).await else {
                    return;
                };
                let Ok(mut back) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut front, &mut back).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_behind_tls_is_reached_over_https_with_the_configured_ca_bundle() {
    let dir = scratch("engine");
    let ca = Ca::new("engines' CA");
    let engine_tls = write_server(&dir, &ca);
    let f = fleet(1).await;
    let sim = &f.workers[0];
    let plain = sim.base_url.trim_start_matches("http://").to_string();
    let port = tls_in_front_of(plain, &engine_tls).await;
    let mut spec = common::sim_spec(sim, PRESET, true);
    spec.url = format!("https://127.0.0.1:{port}");

    let mut cfg = common::gateway_config(vec![spec.clone()]);
    cfg.engine_ca_file = Some(dir.join("ca.pem"));
    let gw = start(cfg).await;
    common::ready_at(&gw.addr.to_string()).await;
    let body = json!({"model": PRESET, "prompt": (3..203).collect::<Vec<u32>>(), "max_tokens": 4});
    let (status, decision, text) = common::post_completion(&gw, &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(decision["worker"], sim.name.as_str(), "{decision}");
    gw.shutdown().await;

    // Without the bundle the engine's certificate is not trusted: no request reaches it.
    let gw = start(common::gateway_config(vec![spec])).await;
    let (status, _, text) = common::post_completion(&gw, &body).await;
    assert_ne!(status, 200, "{text}");
    gw.shutdown().await;

    // A bundle that does not parse is refused at start, naming the field.
    std::fs::write(dir.join("bad.pem"), "-----BEGIN CERTIFICATE-----\nnope\n").unwrap();
    let mut cfg = common::gateway_config(Vec::new());
    cfg.engine_ca_file = Some(dir.join("bad.pem"));
    let err = Gateway::start(cfg).await.err().unwrap().to_string();
    assert!(err.contains("engine_ca_file"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
