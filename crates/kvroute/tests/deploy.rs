//! The Kubernetes manifests (`deploy/kubernetes`) and the Containerfile, checked without a
//! cluster against what kvroute accepts: every file the kustomization lists parses and every
//! YAML file there is listed; selectors, ports and probe paths agree across the Deployment,
//! Services, PodDisruptionBudget and ServiceMonitor; the gateway container's arguments and
//! environment pass `kvroute serve --check-config` with the ConfigMap's TOML (the validation a
//! start runs) and its environment variables are ones `kvroute serve --help` names; the vLLM
//! container's flags match the discovery template. Then the real binary runs with the
//! ConfigMap's configuration in front of a DNS server on loopback that answers the SRV and A
//! records a headless Service produces, pointing at two simulated engines set up as the vLLM
//! pods are (their HTTP port, their KV event and replay ports, relayed on each pod address):
//! the gateway discovers both, its probe paths answer 200, and a repeated prompt is predicted
//! cached from the events it receives.

#[path = "common/mod.rs"]
mod common;

use common::dns::Dns;
use hickory_resolver::proto::rr::rdata::{A, SRV};
use hickory_resolver::proto::rr::{Name, RData, Record};
use kvroute_sim::{start_worker, PublisherConfig, WireFormat, WorkerConfig};
use serde::Deserialize;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The admin token the tests give the gateway, as the Secret kvroute-admin would.
const TOKEN: &str = "deploy-test-token";
/// The pods' addresses: loopback addresses no other test uses.
const POD_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(127, 0, 0, 12), Ipv4Addr::new(127, 0, 0, 13)];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every resource the kustomization lists, with its namespace.
struct Manifests {
    namespace: String,
    kustomization: Value,
    resources: Vec<Value>,
}

fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

fn manifests() -> Manifests {
    let dir = repo().join("deploy/kubernetes");
    let kustomization = yaml_documents(&dir.join("kustomization.yaml")).remove(0);
    let namespace = kustomization["namespace"].as_str().unwrap().to_string();
    let resources = kustomization["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|f| yaml_documents(&dir.join(f.as_str().unwrap())))
        .collect();
    Manifests {
        namespace,
        kustomization,
        resources,
    }
}

impl Manifests {
    fn get(&self, kind: &str, name: &str) -> &Value {
        self.resources
            .iter()
            .find(|r| r["kind"] == kind && r["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} in the kustomization's resources"))
    }

    fn config_toml(&self) -> String {
        self.get("ConfigMap", "kvroute-config")["data"]["kvroute.toml"]
            .as_str()
            .unwrap()
            .to_string()
    }

    fn config(&self) -> toml::Table {
        toml::from_str(&self.config_toml()).unwrap()
    }
}

/// The one container of a Deployment.
fn container<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The number of a container's port named `name`.
fn container_port(c: &Value, name: &str) -> u16 {
    c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}")) as u16
}

/// Whether every `matchLabels` (or plain selector) pair is among `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let pairs = selector.get("matchLabels").unwrap_or(selector);
    let pairs = pairs.as_object().unwrap();
    !pairs.is_empty() && pairs.iter().all(|(k, v)| labels[k] == *v)
}

fn pod_labels(deployment: &Value) -> &Value {
    &deployment["spec"]["template"]["metadata"]["labels"]
}

/// A flag in an argv as argparse and clap read it: `--name=value`, `--name value`, or `--name`
/// alone (`Some(None)`).
fn flag(args: &[String], name: &str) -> Option<Option<String>> {
    let long = format!("--{name}");
    for (i, a) in args.iter().enumerate() {
        if let Some(v) = a.strip_prefix(&format!("{long}=")) {
            return Some(Some(v.to_string()));
        }
        if *a == long {
            return Some(args.get(i + 1).filter(|n| !n.starts_with("--")).cloned());
        }
    }
    None
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

fn env_value(c: &Value, name: &str) -> Option<String> {
    c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
        .map(str::to_string)
}

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

/// The ConfigMap's TOML written as the pod sees it mounted, and the gateway container's
/// arguments with the mount path replaced by that directory.
fn mounted_config(m: &Manifests, dir: &Path) -> Vec<String> {
    let gw = container(m.get("Deployment", "kvroute"), "kvroute");
    let mount = gw["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "config")
        .and_then(|v| v["mountPath"].as_str())
        .unwrap();
    std::fs::write(dir.join("kvroute.toml"), m.config_toml()).unwrap();
    let args = strings(&gw["args"]);
    let config = flag(&args, "config").flatten().unwrap();
    assert_eq!(
        config,
        format!("{mount}/kvroute.toml"),
        "--config names the mounted ConfigMap's key"
    );
    args.iter()
        .map(|a| a.replace(mount, dir.to_str().unwrap()))
        .collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvroute-deploy-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn every_manifest_parses_and_the_kustomization_lists_every_yaml_file() {
    let m = manifests();
    let dir = repo().join("deploy/kubernetes");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    on_disk.sort();
    let mut listed = strings(&m.kustomization["resources"]);
    listed.sort();
    assert_eq!(listed, on_disk, "every manifest is listed once");
    let mut seen = std::collections::BTreeSet::new();
    for r in &m.resources {
        let (kind, name) = (r["kind"].as_str().unwrap(), r["metadata"]["name"].as_str());
        assert!(r["apiVersion"].is_string(), "{r}");
        let name = name.unwrap_or_else(|| panic!("{kind} without a name"));
        assert!(seen.insert((kind, name)), "{kind} {name} twice");
    }
    for kind in [
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
    ] {
        assert!(seen.iter().any(|(k, _)| *k == kind), "no {kind}");
    }
    m.get("Namespace", &m.namespace);
    // The image the gateway runs is the one the kustomization sets.
    let image = container(m.get("Deployment", "kvroute"), "kvroute")["image"].clone();
    assert!(m.kustomization["images"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == image));
}

#[test]
fn the_gateway_runs_two_replicas_spread_across_nodes_behind_a_service_a_budget_and_a_service_monitor(
) {
    let m = manifests();
    let d = m.get("Deployment", "kvroute");
    let labels = pod_labels(d);
    assert!(selects(&d["spec"]["selector"], labels));
    let replicas = d["spec"]["replicas"].as_u64().unwrap();
    assert!(replicas >= 2, "{replicas} replicas");
    let spread = d["spec"]["template"]["spec"]["topologySpreadConstraints"]
        .as_array()
        .unwrap();
    assert!(
        spread
            .iter()
            .any(|c| c["topologyKey"] == "kubernetes.io/hostname"
                && c["whenUnsatisfiable"] == "DoNotSchedule"
                && c["maxSkew"] == 1
                && selects(&c["labelSelector"], labels)),
        "replicas spread across nodes: {spread:?}"
    );

    let pdb = m.get("PodDisruptionBudget", "kvroute");
    assert!(selects(&pdb["spec"]["selector"], labels));
    let min = pdb["spec"]["minAvailable"].as_u64().unwrap();
    assert!((1..replicas).contains(&min), "minAvailable {min}");

    let gw = container(d, "kvroute");
    let svc = m.get("Service", "kvroute");
    assert!(selects(&svc["spec"]["selector"], labels));
    let port_names: Vec<&str> = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let target = p["targetPort"].as_str().unwrap();
            container_port(gw, target);
            p["name"].as_str().unwrap()
        })
        .collect();

    let sm = m.get("ServiceMonitor", "kvroute");
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert!(selects(&sm["spec"]["selector"], &svc["metadata"]["labels"]));
    for e in sm["spec"]["endpoints"].as_array().unwrap() {
        assert!(port_names.contains(&e["port"].as_str().unwrap()), "{e}");
        assert_eq!(e["path"], "/metrics");
    }

    // The probes ask the front door for the paths the gateway serves them on.
    assert_eq!(gw["livenessProbe"]["httpGet"]["path"], "/health/live");
    assert_eq!(gw["readinessProbe"]["httpGet"]["path"], "/health/ready");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(gw[probe]["httpGet"]["port"], "http");
    }
    // Container ports are the configuration's listeners.
    let cfg = m.config();
    for (port, key) in [("http", "listen"), ("admin", "admin_listen")] {
        let addr: SocketAddr = cfg[key].as_str().unwrap().parse().unwrap();
        assert_eq!(container_port(gw, port), addr.port(), "{key}");
        assert!(
            addr.ip().is_unspecified(),
            "{key} listens on the pod network"
        );
    }
    // The replicas find each other through a headless Service over their admin port.
    let peers = m.get("Service", "kvroute-peers");
    assert_eq!(peers["spec"]["clusterIP"], "None", "headless");
    assert!(selects(&peers["spec"]["selector"], labels));
    let admin = peers["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["targetPort"] == "admin")
        .expect("the peers' Service exposes the admin port");
    let admin_listen: SocketAddr = cfg["admin_listen"].as_str().unwrap().parse().unwrap();
    assert_eq!(admin["port"].as_u64(), Some(u64::from(admin_listen.port())));
    let dns = cfg["peers"]["dns"].as_table().unwrap();
    assert_eq!(dns["record"].as_str(), Some("srv"));
    assert_eq!(
        dns["name"].as_str().unwrap(),
        format!(
            "_{}._tcp.{}.{}.svc.cluster.local",
            admin["name"].as_str().unwrap(),
            peers["metadata"]["name"].as_str().unwrap(),
            m.namespace
        )
    );
    // The pod stops after the gateway's own shutdown timeout.
    let grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_f64()
        .unwrap();
    assert!(grace > cfg["shutdown_timeout_secs"].as_integer().unwrap() as f64);
}

#[test]
fn the_gateway_container_s_arguments_environment_and_configmap_pass_kvroute_serve_s_own_validation()
{
    let m = manifests();
    let dir = temp_dir("check");
    let args = mounted_config(&m, &dir);
    let gw = container(m.get("Deployment", "kvroute"), "kvroute");

    let run = |token: Option<&str>| {
        let mut c = kvroute();
        c.args(&args)
            .arg("--check-config")
            .env_remove("KVROUTE_ADMIN_TOKEN");
        if let Some(t) = token {
            c.env("KVROUTE_ADMIN_TOKEN", t);
        }
        c.output().unwrap()
    };
    let ok = run(Some(TOKEN));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stderr).contains("configuration valid"));
    // The admin API listens on the pod network: without the Secret's token it does not start.
    let refused = run(None);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("admin_listen is not loopback"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );

    // Every variable the container sets is one kvroute reads: a flag's [env: …] or RUST_LOG
    // (the log filter, read before any flag).
    let help = kvroute().args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for e in gw["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        assert!(
            name == "RUST_LOG" || help.contains(&format!("[env: {name}")),
            "kvroute serve reads no {name}"
        );
    }
    assert_eq!(
        gw["env"][0]["valueFrom"]["secretKeyRef"]["name"], "kvroute-admin",
        "the admin token comes from a Secret"
    );

    // The Containerfile's defaults are the Deployment's: its command, ports and user.
    let containerfile = std::fs::read_to_string(repo().join("Containerfile")).unwrap();
    let runtime = containerfile.rsplit("\nFROM ").next().unwrap();
    let line = |key: &str| {
        runtime
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} ")))
            .unwrap_or_else(|| panic!("no {key} in the runtime stage"))
            .to_string()
    };
    let cmd: Vec<String> = serde_json::from_str(&line("CMD")).unwrap();
    assert_eq!(cmd, strings(&gw["args"]));
    let entrypoint: Vec<String> = serde_json::from_str(&line("ENTRYPOINT")).unwrap();
    assert_eq!(entrypoint, ["/usr/local/bin/kvroute"]);
    let exposed: Vec<u16> = line("EXPOSE")
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(
        exposed,
        [container_port(gw, "http"), container_port(gw, "admin")]
    );
    let pod_security =
        &m.get("Deployment", "kvroute")["spec"]["template"]["spec"]["securityContext"];
    let user = line("USER");
    assert_eq!(
        user,
        format!(
            "{}:{}",
            pod_security["runAsUser"], pod_security["runAsGroup"]
        )
    );
    assert_eq!(pod_security["runAsNonRoot"], true);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the vLLM container of the example Deployment is started with.
struct Vllm {
    args: Vec<String>,
    events: Value,
    http: u16,
    hash_seed: Option<String>,
}

fn vllm(m: &Manifests) -> Vllm {
    let c = container(m.get("Deployment", "vllm"), "vllm");
    let args = strings(&c["args"]);
    let events: Value = serde_json::from_str(&flag(&args, "kv-events-config").flatten().unwrap())
        .expect("--kv-events-config is JSON");
    let http: u16 = flag(&args, "port").flatten().unwrap().parse().unwrap();
    Vllm {
        args,
        events,
        http,
        hash_seed: env_value(c, "PYTHONHASHSEED"),
    }
}

fn endpoint_port(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn the_vllm_deployment_carries_the_flags_the_discovery_template_assumes() {
    let m = manifests();
    let v = vllm(&m);
    let cfg = m.config();
    let template = cfg["discovery"]["template"].as_table().unwrap();
    let kv = template["kv_events"].as_table().unwrap();

    for required in ["enable-prefix-caching", "enable-prompt-tokens-details"] {
        assert_eq!(flag(&v.args, required), Some(None), "--{required}");
    }
    assert_eq!(v.events["enable_kv_cache_events"], true);
    assert_eq!(v.events["publisher"], "zmq");
    for (json_key, toml_key) in [
        ("endpoint", "endpoint"),
        ("replay_endpoint", "replay_endpoint"),
        ("topic", "topic"),
    ] {
        assert_eq!(
            v.events[json_key].as_str(),
            kv[toml_key].as_str(),
            "kv_events.{toml_key}"
        );
    }
    assert!(
        v.events["endpoint"].as_str().unwrap().contains('*'),
        "the engine binds; the gateway connects to each pod"
    );
    // The hash: the same algorithm and NONE_HASH seed on both sides.
    let algo = flag(&v.args, "prefix-caching-hash-algo")
        .flatten()
        .unwrap_or("sha256".into());
    assert_eq!(template["hash_algo"].as_str(), Some(algo.as_str()));
    assert_eq!(
        template.get("hash_seed").and_then(|s| s.as_str()),
        v.hash_seed.as_deref()
    );
    let model = flag(&v.args, "served-model-name")
        .or_else(|| flag(&v.args, "model"))
        .flatten()
        .unwrap();
    assert_eq!(template["model"].as_str(), Some(model.as_str()));
    let dp: i64 = flag(&v.args, "data-parallel-size")
        .flatten()
        .map_or(1, |n| n.parse().unwrap());
    assert_eq!(
        template
            .get("dp_size")
            .and_then(|d| d.as_integer())
            .unwrap_or(1),
        dp
    );

    // Ports: the container's, the headless Service's, the SRV name the gateway asks.
    let c = container(m.get("Deployment", "vllm"), "vllm");
    assert_eq!(container_port(c, "http"), v.http);
    assert_eq!(
        container_port(c, "kv-events"),
        endpoint_port(kv["endpoint"].as_str().unwrap())
    );
    assert_eq!(
        container_port(c, "kv-replay"),
        endpoint_port(kv["replay_endpoint"].as_str().unwrap())
    );
    let svc = m.get("Service", "vllm");
    assert_eq!(svc["spec"]["clusterIP"], "None", "headless");
    assert!(selects(
        &svc["spec"]["selector"],
        pod_labels(m.get("Deployment", "vllm"))
    ));
    let http = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == v.http)
        .expect("the Service's port for the engines' HTTP");
    let discovery = cfg["discovery"].as_table().unwrap();
    assert_eq!(discovery["kind"].as_str(), Some("dns"));
    assert_eq!(discovery["record"].as_str(), Some("srv"));
    assert_eq!(
        discovery["name"].as_str().unwrap(),
        format!(
            "_{}._tcp.{}.{}.svc.cluster.local",
            http["name"].as_str().unwrap(),
            svc["metadata"]["name"].as_str().unwrap(),
            m.namespace
        )
    );
    // A pod that leaves the Service drains in the gateway before it is killed.
    let grace = m.get("Deployment", "vllm")["spec"]["template"]["spec"]
        ["terminationGracePeriodSeconds"]
        .as_i64()
        .unwrap();
    assert!(cfg["worker_drain_timeout_secs"].as_integer().unwrap() <= grace);
}

/// Accepts on `listen` and relays each connection to `to` (a pod's port mapped onto the
/// simulated engine's socket).
async fn relay(listen: SocketAddr, to: SocketAddr) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| panic!("binding {listen}: {e}"));
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = l.accept().await {
            tokio::spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    })
}

fn socket_of(endpoint: &str) -> SocketAddr {
    endpoint.trim_start_matches("tcp://").parse().unwrap()
}

/// The gateway process, killed when dropped.
struct Gateway {
    child: Child,
    front: String,
    admin: String,
    /// Everything the process wrote to stderr so far (shown when a check fails).
    log: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    /// The last `n` lines the gateway logged.
    fn log_tail(&self, n: usize) -> String {
        let lines = self.log.lock().map(|l| l.clone()).unwrap_or_default();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_gateway(args: &[String], extra: &[&str]) -> Gateway {
    let mut child = kvroute()
        .args(args)
        .args(extra)
        .env("KVROUTE_ADMIN_TOKEN", TOKEN)
        // The subscriptions' reconnects and failed receives too (debug), for a failed check.
        .env("RUST_LOG", "info,kvroute_wire=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let log = Arc::new(Mutex::new(Vec::new()));
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(mut kept) = kept.lock() {
                kept.push(line.clone());
            }
            if let Some(rest) = line.strip_prefix("kvroute listening on http://") {
                let front = rest.split_whitespace().next().unwrap_or("").to_string();
                let admin = rest.split("admin http://").nth(1).unwrap_or("");
                let _ = tx.send((front, admin.trim_end_matches(')').to_string()));
            }
        }
    });
    let (front, admin) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("kvroute serve printed its addresses");
    Gateway {
        child,
        front,
        admin,
        log,
    }
}

/// Where each pod's event stream stands, for a failed check: what each pod's publisher queued
/// and sent, what the gateway's index applied of each, and the gateway's wire and index
/// counters.
async fn streams(client: &reqwest::Client, gw: &Gateway, port: u16) -> String {
    let mut out = String::from("the event streams:\n");
    for ip in POD_IPS {
        let url = format!("http://{ip}:{port}/admin/cache");
        let cache = common::json_at(client, url, None)
            .await
            .unwrap_or_else(|e| json!(e));
        let publishers: Vec<&Value> = cache["ranks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| &r["publisher"])
            .collect();
        out += &format!("  pod {ip}: publishers {publishers:?}\n");
    }
    match common::admin_workers_at(client, &gw.admin, Some(TOKEN)).await {
        Ok(workers) => {
            for w in workers {
                out += &format!(
                    "  gateway: {} applied up to {} ({} subscriptions)\n",
                    w["name"], w["events_next_seq"], w["subscriptions"]
                );
            }
        }
        Err(e) => out += &format!("  gateway: {e}\n"),
    }
    let text = match client
        .get(format!("http://{}/metrics", gw.front))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(e) => e.to_string(),
    };
    for l in text
        .lines()
        .filter(|l| l.starts_with("kvroute_wire") || l.starts_with("kvroute_index_events"))
    {
        out += &format!("  {l}\n");
    }
    out
}

/// The gateway's workers (`GET /admin/workers` with the admin token); fails the test on a
/// refused call.
async fn workers(client: &reqwest::Client, gw: &Gateway) -> Vec<Value> {
    common::admin_workers_at(client, &gw.admin, Some(TOKEN))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configmap_discovers_the_headless_service_s_pods_by_srv_records_and_routes_to_them() {
    let m = manifests();
    let v = vllm(&m);
    let cfg = m.config();
    let discovery = cfg["discovery"].as_table().unwrap();
    let template = discovery["template"].as_table().unwrap();
    let kv = template["kv_events"].as_table().unwrap();
    let model = template["model"].as_str().unwrap();
    let (events_port, replay_port) = (
        endpoint_port(kv["endpoint"].as_str().unwrap()),
        endpoint_port(kv["replay_endpoint"].as_str().unwrap()),
    );

    // Two pods: a simulated engine each, serving HTTP on the pod's address and port, its event
    // and replay sockets reached on the pod's address at the vLLM container's ports.
    let mut pods = Vec::new();
    let mut relays = Vec::new();
    for (i, ip) in POD_IPS.iter().enumerate() {
        let mut w = WorkerConfig::for_preset("tiny-qwen3-next").unwrap();
        w.model = model.to_string();
        if let Some(Some(algo)) = flag(&v.args, "prefix-caching-hash-algo") {
            w.engine.hash_algo = algo.parse().unwrap();
        }
        if let Some(seed) = &v.hash_seed {
            w.engine.hash_seed = seed.clone();
        }
        w.zmq = Some(PublisherConfig {
            endpoint: format!("tcp://{ip}:0"),
            replay_endpoint: Some(format!("tcp://{ip}:0")),
            topic: v.events["topic"].as_str().unwrap_or("").to_string(),
            buffer_steps: v.events["buffer_steps"].as_u64().unwrap_or(10_000) as usize,
            format: WireFormat::V032,
            replay_layout: Default::default(),
            dp_rank: 0,
            hwm: kvroute_sim::publisher::DEFAULT_HWM,
        });
        let http = SocketAddr::from((*ip, v.http));
        let h = start_worker(&format!("vllm-{i}"), w, http)
            .await
            .unwrap_or_else(|e| panic!("a simulated engine on {http}: {e}"));
        relays.push(relay((*ip, events_port).into(), socket_of(&h.zmq[0])).await);
        relays.push(relay((*ip, replay_port).into(), socket_of(&h.replay[0])).await);
        pods.push(h);
    }

    // The cluster DNS's answer for the headless Service: an SRV record per ready pod, on the
    // Service's http port, its target the pod's A record (also sent as glue).
    let name = format!("{}.", discovery["name"].as_str().unwrap());
    let zone = format!("{}.svc.cluster.local.", m.namespace);
    let dns = Dns::with_glue(&zone).await;
    let mut records = Vec::new();
    for ip in POD_IPS {
        let target = format!("{}.vllm.{zone}", ip.to_string().replace('.', "-"));
        let target = Name::from_ascii(&target).unwrap();
        records.push(Record::from_rdata(
            Name::from_ascii(&name).unwrap(),
            30,
            RData::SRV(SRV::new(0, 50, v.http, target.clone())),
        ));
        records.push(Record::from_rdata(target, 30, RData::A(A(ip))));
    }
    dns.set(records);

    // The gateway: the container's arguments and the ConfigMap's TOML, with only the test's
    // nameserver added and the listeners and snapshot moved to loopback and a temporary dir.
    let dir = temp_dir("dns");
    let args = mounted_config(&m, &dir);
    let mut table = cfg.clone();
    table["discovery"]
        .as_table_mut()
        .unwrap()
        .insert("nameserver".into(), dns.addr.to_string().into());
    std::fs::write(dir.join("kvroute.toml"), toml::to_string(&table).unwrap()).unwrap();
    let snapshot = dir.join("index.snapshot");
    let gw = tokio::task::spawn_blocking({
        let args = args.clone();
        let snapshot = snapshot.display().to_string();
        move || {
            start_gateway(
                &args,
                &[
                    "--listen",
                    "127.0.0.1:0",
                    "--admin-listen",
                    "127.0.0.1:0",
                    "--snapshot-path",
                    &snapshot,
                ],
            )
        }
    })
    .await
    .unwrap();

    let client = reqwest::Client::new();
    let port = v.http;
    let mut want: Vec<String> = POD_IPS
        .iter()
        .map(|ip| format!("vllm-{ip}-{port}"))
        .collect();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ws = workers(&client, &gw).await;
        let mut names: Vec<String> = ws
            .iter()
            .filter(|w| w["source"] == "dns")
            .map(|w| w["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        if names == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "workers {names:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The probes the Deployment declares, on the front door.
    let c = container(m.get("Deployment", "kvroute"), "kvroute");
    for probe in ["livenessProbe", "readinessProbe"] {
        let path = c[probe]["httpGet"]["path"].as_str().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let r = client
                .get(format!("http://{}{path}", gw.front))
                .send()
                .await;
            if r.is_ok_and(|r| r.status() == 200) {
                break;
            }
            assert!(Instant::now() < deadline, "{path} never answered 200");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The pods' event streams joined (a batch published now reaches the gateway), so the
    // first prompt's events are not published before the subscription took hold.
    common::joined_at(&gw.admin, Some(TOKEN)).await;

    // A prompt, then the same prompt again: predicted cached from the pods' events.
    let prompt: Vec<u32> = (0..256).map(|i| (i * 7 + 3) % 1000 + 3).collect();
    let complete = || async {
        let r = client
            .post(format!("http://{}/v1/completions", gw.front))
            .header("x-kvroute-explain", "1")
            .json(&json!({"model": model, "prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let d: Value =
            serde_json::from_str(r.headers()["x-kvroute-decision"].to_str().unwrap()).unwrap();
        d
    };
    let first = complete().await;
    assert!(want.iter().any(|w| first["worker"] == *w), "{first}");
    // Wait (asking the admin API's explain, which changes nothing) until the gateway's index
    // holds the prompt on the pod that served it; only then send it again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v: Value = client
            .post(format!("http://{}/admin/explain", gw.admin))
            .bearer_auth(TOKEN)
            .json(&json!({"tokens": prompt, "model": model}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let held = v["predictions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["worker"] == first["worker"] && p["cached"].as_u64().unwrap_or(0) > 0);
        if held {
            break;
        }
        if Instant::now() >= deadline {
            panic!(
                "the pod's events never arrived: {v}\n{}\nthe gateway's log:\n{}",
                streams(&client, &gw, port).await,
                gw.log_tail(60)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = complete().await;
    assert_eq!(again["worker"], first["worker"], "{again}");
    assert!(
        again["predicted_cached"].as_u64().unwrap_or(0) > 0,
        "{again}"
    );

    // What the ServiceMonitor scrapes.
    let sm = m.get("ServiceMonitor", "kvroute");
    let path = sm["spec"]["endpoints"][0]["path"].as_str().unwrap();
    let text = client
        .get(format!("http://{}{path}", gw.front))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.lines().any(|l| l == "kvroute_discovered_workers 2"),
        "{text}"
    );
    // The engines hash as the template says: no stored block's digest differs from the
    // gateway's.
    let mismatched = text
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_index_events{counter=\"hash_check_mismatched\"} "));
    assert!(mismatched.is_none_or(|n| n == "0"), "{mismatched:?}");
    drop(gw);
    for r in relays {
        r.abort();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
