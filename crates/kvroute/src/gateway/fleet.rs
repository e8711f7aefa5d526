//! The fleet reconciler: the workers the configuration and discovery ask for, made true in
//! the registry.
//!
//! Owns: the desired set (the configured `workers` ∪ the discovered ones, the configured list
//! winning a name both give), which registered workers it manages and where each came from,
//! and the workers it is retiring.
//! Invariants: one reconcile pass runs at a time; a desired worker missing from the registry is
//! added (its subscriptions start); a managed worker no longer desired is retired: marked
//! draining (no new requests), removed once its in-flight count is 0 or the drain timeout
//! passed (its subscriptions stop, its index state is dropped); a worker whose spec changed is
//! replaced at once (its in-flight requests still finish: they hold the old worker); a worker
//! that is desired again while it drains is taken back unchanged; workers added through the
//! admin API are never touched, and a desired worker whose name they hold is refused.
//! Must not: choose workers for requests, await upstream I/O while holding its state lock, or
//! import the front door (it reaches the shared state through [`FleetHost`]).

use super::config::{file::GatewayConfig, WorkerSpec};
use super::metrics::Metrics;
use super::registry::{Registry, Worker};
use super::snapshot::Unclaimed;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the reconciler (and the discovery loop that feeds it) needs of the gateway's shared
/// state, which implements it (`gateway::state`): the fleet state never imports the front door.
pub trait FleetHost: Send + Sync + 'static {
    fn registry(&self) -> &Arc<Registry>;
    fn fleet(&self) -> &Fleet;
    /// Snapshot entries for workers discovery may add.
    fn unclaimed(&self) -> &Unclaimed;
    fn metrics(&self) -> &Metrics;
    /// The live configuration (read when it is used: a reload may swap it).
    fn config(&self) -> Arc<GatewayConfig>;
}

/// Where a managed worker comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The configuration's `workers`.
    Static,
    /// DNS discovery.
    Dns,
    /// Directory discovery.
    Dir,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Static => "static",
            Source::Dns => "dns",
            Source::Dir => "dir",
        }
    }
}

/// What one reconcile pass did, by worker name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FleetChanges {
    pub added: Vec<String>,
    /// Retired: draining now, removed once idle.
    pub removed: Vec<String>,
    /// Spec changed: removed and added again.
    pub replaced: Vec<String>,
    /// Desired but not added (the name is an admin-added worker's, or the spec was refused).
    pub refused: Vec<String>,
}

impl FleetChanges {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.replaced.is_empty()
            && self.refused.is_empty()
    }
}

struct Managed {
    source: Source,
    worker: Arc<Worker>,
}

#[derive(Default)]
struct Inner {
    statics: Vec<WorkerSpec>,
    discovered: (Option<Source>, Vec<WorkerSpec>),
    managed: BTreeMap<String, Managed>,
    retiring: BTreeMap<String, Arc<Worker>>,
}

#[derive(Default)]
pub struct Fleet {
    inner: Mutex<Inner>,
    /// Held for a whole pass (and for a retirement's final removal).
    pass: tokio::sync::Mutex<()>,
}

impl Fleet {
    /// Takes over the configured workers `Gateway::start` registered.
    pub fn adopt_static(&self, registry: &Registry, specs: &[WorkerSpec]) {
        let mut inner = self.inner.lock();
        inner.statics = specs.to_vec();
        for s in specs {
            if let Some(worker) = registry.get(&s.name) {
                inner.managed.insert(
                    s.name.clone(),
                    Managed {
                        source: Source::Static,
                        worker,
                    },
                );
            }
        }
    }

    /// The source of the managed worker `name` (`None`: added through the admin API).
    pub fn source_of(&self, name: &str) -> Option<Source> {
        self.inner.lock().managed.get(name).map(|m| m.source)
    }

    /// Replaces the configured list (a reload) and reconciles.
    pub async fn set_static<H: FleetHost>(
        &self,
        state: &Arc<H>,
        specs: Vec<WorkerSpec>,
    ) -> FleetChanges {
        let _pass = self.pass.lock().await;
        self.inner.lock().statics = specs;
        self.reconcile(state).await
    }

    /// Replaces the discovered set and reconciles.
    pub async fn set_discovered<H: FleetHost>(
        &self,
        state: &Arc<H>,
        source: Source,
        specs: Vec<WorkerSpec>,
    ) -> FleetChanges {
        let _pass = self.pass.lock().await;
        self.inner.lock().discovered = (Some(source), specs);
        self.reconcile(state).await
    }

    /// Workers desired, by name: the configured list first.
    fn desired(inner: &Inner) -> BTreeMap<String, (Source, WorkerSpec)> {
        let mut out = BTreeMap::new();
        for s in &inner.statics {
            out.insert(s.name.clone(), (Source::Static, s.clone()));
        }
        if let (Some(source), specs) = &inner.discovered {
            for s in specs {
                if out.contains_key(&s.name) {
                    tracing::warn!(worker = %s.name, "discovered worker has a configured worker's name: the configured one is kept");
                    continue;
                }
                out.insert(s.name.clone(), (*source, s.clone()));
            }
        }
        out
    }

    /// One pass; the caller holds `pass`.
    async fn reconcile<H: FleetHost>(&self, state: &Arc<H>) -> FleetChanges {
        let registry = state.registry();
        let mut changes = FleetChanges::default();
        let (desired, mut replace) = {
            let mut inner = self.inner.lock();
            let desired = Self::desired(&inner);
            // Managed workers someone removed through the admin API are forgotten (and added
            // again below when still desired).
            inner.managed.retain(|name, m| {
                registry
                    .get(name)
                    .is_some_and(|w| Arc::ptr_eq(&w, &m.worker))
            });
            let mut replace = Vec::new();
            let names: Vec<String> = inner.managed.keys().cloned().collect();
            for name in names {
                match desired.get(&name) {
                    None => {
                        if let Some(m) = inner.managed.remove(&name) {
                            m.worker.draining.store(true, Ordering::Relaxed);
                            inner.retiring.insert(name.clone(), m.worker.clone());
                            tokio::spawn(retire(state.clone(), name.clone(), m.worker));
                            changes.removed.push(name);
                        }
                    }
                    Some((_, spec)) if *spec != inner.managed[&name].worker.spec => {
                        inner.managed.remove(&name);
                        replace.push(name);
                    }
                    Some((source, _)) => {
                        if let Some(m) = inner.managed.get_mut(&name) {
                            m.source = *source;
                        }
                    }
                }
            }
            (desired, replace)
        };
        // Retiring workers desired again: taken back when unchanged, else removed now.
        for (name, (_, spec)) in &desired {
            let retiring = self.inner.lock().retiring.get(name).cloned();
            let Some(w) = retiring else { continue };
            if w.spec == *spec && registry.get(name).is_some_and(|r| Arc::ptr_eq(&r, &w)) {
                w.draining.store(false, Ordering::Relaxed);
                let mut inner = self.inner.lock();
                inner.retiring.remove(name);
                inner.managed.insert(
                    name.clone(),
                    Managed {
                        source: desired[name].0,
                        worker: w,
                    },
                );
                changes.added.push(name.clone());
            } else {
                self.inner.lock().retiring.remove(name);
                replace.push(name.clone());
            }
        }
        replace.sort();
        replace.dedup();
        for name in &replace {
            if let Err(e) = registry.remove(name).await {
                tracing::debug!(worker = %name, "replacing: {e}");
            }
        }
        for (name, (source, spec)) in desired {
            if self.inner.lock().managed.contains_key(&name) {
                continue;
            }
            if registry.get(&name).is_some() {
                tracing::warn!(worker = %name, "a worker of this name was added through the admin API: left alone");
                changes.refused.push(name);
                continue;
            }
            let resume = state.unclaimed().take(&spec);
            match registry.add_resumed(spec, resume) {
                Ok(worker) => {
                    tracing::info!(worker = %name, source = source.name(), url = %worker.spec.url, "worker added");
                    self.inner
                        .lock()
                        .managed
                        .insert(name.clone(), Managed { source, worker });
                    if replace.contains(&name) {
                        changes.replaced.push(name);
                    } else {
                        changes.added.push(name);
                    }
                }
                Err(e) => {
                    tracing::warn!(worker = %name, source = source.name(), "worker refused: {e}");
                    changes.refused.push(name);
                }
            }
        }
        let discovered = self
            .inner
            .lock()
            .managed
            .values()
            .filter(|m| m.source != Source::Static)
            .count();
        state.metrics().discovered_workers.set(discovered as i64);
        for (label, names) in [
            ("added", &changes.added),
            ("removed", &changes.removed),
            ("replaced", &changes.replaced),
            ("refused", &changes.refused),
        ] {
            if !names.is_empty() {
                state
                    .metrics()
                    .fleet_changes
                    .with_label_values(&[label])
                    .inc_by(names.len() as u64);
            }
        }
        changes
    }
}

/// Waits for `worker` to finish its in-flight requests (at most the drain timeout), then
/// removes it, unless it was taken back meanwhile.
async fn retire<H: FleetHost>(state: Arc<H>, name: String, worker: Arc<Worker>) {
    let timeout = Duration::from_secs_f64(state.config().worker_drain_timeout_secs.max(0.0));
    let deadline = Instant::now() + timeout;
    while worker.in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fleet = state.fleet();
    let _pass = fleet.pass.lock().await;
    {
        let mut inner = fleet.inner.lock();
        if !inner
            .retiring
            .get(&name)
            .is_some_and(|w| Arc::ptr_eq(w, &worker))
        {
            return;
        }
        inner.retiring.remove(&name);
    }
    let left = worker.in_flight.load(Ordering::Relaxed);
    if state
        .registry()
        .get(&name)
        .is_some_and(|w| Arc::ptr_eq(&w, &worker))
    {
        let _ = state.registry().remove(&name).await;
        if left > 0 {
            tracing::warn!(worker = %name, in_flight = left, "drain timed out: worker removed with requests in flight");
        } else {
            tracing::info!(worker = %name, "worker drained and removed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::config::file::GatewayConfig;
    use crate::gateway::registry::load::LoadGuard;
    use crate::gateway::Gateway;

    #[tokio::test]
    async fn a_worker_desired_again_while_it_drains_is_taken_back_and_admin_workers_are_left_alone()
    {
        let s1 = WorkerSpec::new("s1", "http://127.0.0.1:1", "m");
        let gw = Gateway::start(GatewayConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            admin_listen: "127.0.0.1:0".parse().unwrap(),
            workers: vec![s1.clone()],
            ..GatewayConfig::default()
        })
        .await
        .unwrap();
        let st = gw.state.clone();
        let admin = WorkerSpec::new("adm", "http://127.0.0.1:2", "m");
        st.registry.add(admin.clone()).unwrap();
        assert_eq!(st.fleet.source_of("s1"), Some(Source::Static));
        assert_eq!(st.fleet.source_of("adm"), None);

        // s1 leaves with a request in flight: it drains and stays until the request is done.
        let w = st.registry.get("s1").unwrap();
        let guard = LoadGuard::new(w.clone(), 10);
        let c = st.fleet.set_static(&st, Vec::new()).await;
        assert_eq!(c.removed, ["s1"]);
        assert!(w.draining.load(Ordering::Relaxed));
        assert!(
            st.registry.get("adm").is_some(),
            "admin workers are not removed"
        );
        // Back before it drained: the same worker, routable again.
        let c = st.fleet.set_static(&st, vec![s1.clone()]).await;
        assert_eq!(c.added, ["s1"]);
        assert!(Arc::ptr_eq(&w, &st.registry.get("s1").unwrap()));
        assert!(!w.draining.load(Ordering::Relaxed));
        // A configured worker named like an admin-added one is refused; the admin one stays.
        let c = st.fleet.set_static(&st, vec![s1.clone(), admin]).await;
        assert_eq!(c.refused, ["adm"]);
        assert_eq!(
            st.registry.get("adm").unwrap().spec.url,
            "http://127.0.0.1:2"
        );
        // A changed spec replaces the worker at once.
        let mut s1_dp2 = s1.clone();
        s1_dp2.dp_size = 2;
        let c = st.fleet.set_static(&st, vec![s1_dp2]).await;
        assert_eq!(c.replaced, ["s1"]);
        assert_eq!(st.registry.get("s1").unwrap().spec.dp_size, 2);
        drop(guard);
        // Gone for good once idle.
        st.fleet.set_static(&st, Vec::new()).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while st.registry.get("s1").is_some() {
            assert!(Instant::now() < deadline, "s1 was never removed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        gw.shutdown().await;
    }
}
