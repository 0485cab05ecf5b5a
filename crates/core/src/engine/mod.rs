//! The engine: runs a graph on worker threads and changes it live by diff.
//!
//! Each worker runs the breath loop over its share of the apps: `pull` on every app, then `push`
//! in topological order, repeated for apps whose inputs are still non-empty (cycles, links from
//! later apps) up to a bound so that a cycle can never hang a breath, then `tick` about every
//! millisecond. A breath that moved nothing makes the worker sleep, 1 µs growing to
//! `max_sleep_us`, unless `busy_poll` is set.
//!
//! Applying a graph parks every worker between two breaths, hands their apps and links back to
//! the controller, which keeps what did not change (apps with their state, links with their
//! queued packets), reconfigures or rebuilds what changed, rewires, and resumes the workers.
//!
//! Its rooms: [`breath`] (the worker loop), [`plan`] (what a change does, worked out from the
//! two graphs alone — Snabb's `compute_config_actions`), [`apply`] (carrying the plan out on
//! parked workers), [`stats`] (the counters and reports), [`state`] (the apps' state in a
//! file, across a restart) and [`handover`] (an upgrade's two halves). This file holds the engine's state and what reads it.

mod apply;
mod breath;
mod handover;
pub mod plan;
mod state;
mod stats;

pub use apply::topological_order;
use breath::*;
pub use breath::{breath_started, pin_to_core, WorkerCounters};
pub use handover::{HandOver, HandedApp, HandedLink, Prepared};
pub use state::{RestoreReport, STATE_FILE_FORMAT};
pub use stats::{AppStats, ApplyReport, LinkInfo, Stats, WorkerStats};

use crate::app::{AppError, AppSnapshot, AppState, Counters, DynApp, Io, Registry};
use crate::graph::{Endpoint, Graph, LinkDecl};
use crate::link::{Consumer, Producer, Ring};
use crate::pool;
use indexmap::IndexMap;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("app `{app}`: {source}")]
    Build { app: String, source: AppError },
    #[error("app `{app}`: config: {message}")]
    Config { app: String, message: String },
    #[error("worker `{0}` is gone, and its apps with it (the log says why): restart the instance")]
    WorkerLost(String),
    #[error("{0} (nothing was changed: the graph runs as before)")]
    RolledBack(Box<EngineError>),
    #[error("no app named `{0}`")]
    NoSuchApp(String),
    #[error("{0}")]
    Other(String),
}

/// One app with everything the worker needs to run it; what a breath reads first (`repr(C)`).
#[repr(C)]
struct AppSlot {
    app: Box<dyn DynApp>,
    io: Io,
    name: String,
    kind: String,
    config: serde_json::Value,
    counters: Counters,
    failed: Arc<AtomicBool>,
}

impl AppSlot {
    /// Runs `f` on the app; a panic stops the app (counted, logged) and the worker carries on.
    /// Returns whether the app panicked.
    fn guarded(&mut self, what: &str, f: impl FnOnce(&mut dyn DynApp, &mut Io)) -> bool {
        let r = catch_unwind(AssertUnwindSafe(|| f(self.app.as_mut(), &mut self.io)));
        if let Err(e) = r {
            let msg = panic_text(&*e);
            log::error!(
                "app `{}` ({}) panicked in {what}: {msg}; it is stopped",
                self.name,
                self.kind
            );
            self.counters.get("panics").add(1);
            self.failed.store(true, Ordering::Relaxed);
            return true;
        }
        false
    }

    fn has_inputs(&self) -> bool {
        self.io.inputs.iter().any(Option::is_some)
    }
}

/// What a panic carried, as text (`panic!`'s message, when it has one).
fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    (e.downcast_ref::<&str>().map(|s| s.to_string()))
        .or_else(|| e.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// An app's code panicked outside a breath (while built or reconfigured): the error a change
/// fails with, so that it rolls back instead of unwinding through the engine's lock.
#[derive(Debug, thiserror::Error)]
#[error("panicked in {what}: {message}")]
pub struct AppPanicked {
    pub what: &'static str,
    pub message: String,
}

/// Runs the code of app `app` (its `new` or `reconfigure`: `what`) with a panic caught and
/// turned into the app's error.
fn caught<T>(
    app: &str,
    what: &'static str,
    f: impl FnOnce() -> Result<T, AppError>,
) -> Result<T, EngineError> {
    let source = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(done)) => return Ok(done),
        Ok(Err(e)) => e,
        Err(e) => {
            let message = panic_text(&*e);
            log::error!("app `{app}` panicked in {what}: {message}");
            Box::new(AppPanicked { what, message })
        }
    };
    Err(EngineError::Build {
        app: app.to_string(),
        source,
    })
}

impl EngineError {
    /// Whether the error is an app's panic ([`AppPanicked`]).
    fn is_panic(&self) -> bool {
        matches!(self, EngineError::Build { source, .. } if source.is::<AppPanicked>())
    }
}

struct AppInfo {
    kind: String,
    worker: String,
    counters: Counters,
    failed: Arc<AtomicBool>,
    inputs: Vec<Arc<Ring>>,
    outputs: Vec<Arc<Ring>>,
}

struct State {
    graph: Option<Graph>,
    workers: IndexMap<String, Worker>,
    apps: IndexMap<String, AppInfo>,
    links: Vec<(LinkDecl, Arc<Ring>)>,
    /// What the links an app no longer has carried, by app, so that its totals never go back.
    folded: HashMap<String, LinkTotals>,
    /// Packets freed in links that left the graph with both their apps.
    orphaned_drops: u64,
    stopped: bool,
}

/// Packet and byte totals of the links an app had and lost to a live change.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct LinkTotals {
    rx_packets: u64,
    rx_bytes: u64,
    tx_packets: u64,
    tx_bytes: u64,
    /// Full-link drops on its outputs, and packets still queued toward it when a link left.
    drops: u64,
}

/// The apps' counters with, before the first shard of each sharded app, its totals.
fn with_sharded_totals(apps: Vec<AppStats>, links: &[(LinkDecl, Arc<Ring>)]) -> Vec<AppStats> {
    if apps.iter().all(|a| a.shard_of.is_none()) {
        return apps;
    }
    let of = |app: &str| {
        apps.iter()
            .find(|a| a.name == app)
            .and_then(|a| a.shard_of.clone())
    };
    let mut handed: HashMap<String, (u64, u64)> = HashMap::new();
    for (l, r) in links {
        if let (Some(a), Some(b)) = (of(&l.from.app), of(&l.to.app)) {
            if a == b {
                let s = r.stats();
                let h = handed.entry(a).or_default();
                h.0 += s.tx_packets;
                h.1 += s.tx_bytes;
            }
        }
    }
    let mut out = Vec::with_capacity(apps.len());
    let mut done = std::collections::HashSet::new();
    for a in &apps {
        if let Some(base) = &a.shard_of {
            if done.insert(base.clone()) {
                let shards: Vec<&AppStats> = apps
                    .iter()
                    .filter(|s| s.shard_of.as_ref() == Some(base))
                    .collect();
                let h = handed.get(base).copied().unwrap_or_default();
                out.push(AppStats::of_shards(base, &shards, h));
            }
        }
        out.push(a.clone());
    }
    out
}

/// A running graph.
pub struct Engine {
    registry: Arc<Registry>,
    state: Mutex<State>,
    started: Instant,
    /// What a predecessor process lent, while [`Engine::prepare_inheriting`] builds.
    inheritance: Mutex<handover::Inheritance>,
}

/// Link ends taken out of parked apps, by endpoint.
#[derive(Default)]
struct LinkEnds {
    producers: HashMap<Endpoint, Producer>,
    consumers: HashMap<Endpoint, Consumer>,
}

impl Engine {
    pub fn new(registry: Arc<Registry>) -> Engine {
        Engine {
            registry,
            state: Mutex::new(State {
                graph: None,
                workers: IndexMap::new(),
                apps: IndexMap::new(),
                links: Vec::new(),
                folded: HashMap::new(),
                orphaned_drops: 0,
                stopped: false,
            }),
            started: Instant::now(),
            inheritance: Mutex::default(),
        }
    }

    /// The engine's state to read. The lock is poisoned only by a panic of the engine's own
    /// code while it held the lock (an app's panics are caught where its code runs); what
    /// that left is still read, counters and graph, and [`Engine::state_to_change`] refuses
    /// every further change.
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The engine's state to change: refused after a panic of the engine itself (a worker
    /// may still wait for a plan no one will send it; parking it again would never end).
    fn state_to_change(&self) -> Result<std::sync::MutexGuard<'_, State>, EngineError> {
        self.state.lock().map_err(|_| {
            EngineError::Other(
                "an earlier change failed inside the engine itself (a bug: its panic is in the \
                 log); the graph runs as that change left it and takes no further change: \
                 restart the instance (`stitch upgrade`, or a restart with --state) to change it"
                    .into(),
            )
        })
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The graph now running.
    pub fn graph(&self) -> Option<Graph> {
        self.state().graph.clone()
    }

    /// Current counters of every app, link and worker.
    pub fn stats(&self) -> Stats {
        let st = self.state();
        let mut apps = Vec::new();
        for (name, a) in &st.apps {
            let mut s = AppStats {
                name: name.clone(),
                kind: a.kind.clone(),
                worker: a.worker.clone(),
                rx_packets: 0,
                rx_bytes: 0,
                tx_packets: 0,
                tx_bytes: 0,
                drops: 0,
                failed: a.failed.load(Ordering::Relaxed),
                counters: a.counters.snapshot(),
                shard_of: (st.graph.as_ref())
                    .and_then(|g| g.apps.get(name)?.shard.as_ref())
                    .map(|s| s.of.clone()),
                shards: Vec::new(),
            };
            if let Some(t) = st.folded.get(name) {
                s.rx_packets = t.rx_packets;
                s.rx_bytes = t.rx_bytes;
                s.tx_packets = t.tx_packets;
                s.tx_bytes = t.tx_bytes;
                s.drops = t.drops;
            }
            for r in &a.inputs {
                let l = r.stats();
                s.rx_packets += l.rx_packets;
                // Bytes are counted once per link, on transmit; received bytes are transmitted
                // bytes minus what is still queued, which is exact when the link is empty.
                s.rx_bytes += l.tx_bytes;
            }
            for r in &a.outputs {
                let l = r.stats();
                s.tx_packets += l.tx_packets;
                s.tx_bytes += l.tx_bytes;
                s.drops += l.tx_drops;
            }
            s.drops += s
                .counters
                .iter()
                .filter(|(k, _)| k.ends_with("drops"))
                .map(|(_, v)| v)
                .sum::<u64>();
            apps.push(s);
        }
        let links = st
            .links
            .iter()
            .map(|(d, r)| LinkInfo {
                link: d.spec(),
                size: r.capacity(),
                taps: r.tap_count(),
                stats: r.stats(),
                latency: r.latency().map(|h| h.counts().report()),
            })
            .collect();
        let workers = st
            .workers
            .iter()
            .map(|(n, w)| WorkerStats {
                name: n.clone(),
                core: w.config.core,
                breaths: w.counters.breaths.load(Ordering::Relaxed),
                idle_sleeps: w.counters.idle_sleeps.load(Ordering::Relaxed),
            })
            .collect();
        let apps = with_sharded_totals(apps, &st.links);
        Stats {
            uptime_s: self.started.elapsed().as_secs_f64(),
            apps,
            links,
            workers,
            pool: pool::stats(),
            removed_link_drops: st.orphaned_drops,
        }
    }

    /// Asks app `app` an app-specific question (its `query`), answered by its worker between
    /// breaths.
    pub fn query(
        &self,
        app: &str,
        request: serde_json::Value,
    ) -> Result<serde_json::Value, EngineError> {
        match self.ask(app, Ask::Query(request))? {
            Answer::Value(v) => Ok(v),
            Answer::Snapshot(_) => unreachable!("a query is answered with a value"),
        }
    }

    /// App `app`'s state to carry across a restart ([`crate::App::snapshot`]), taken by its
    /// worker between breaths; `None` when it keeps none.
    pub fn snapshot_app(&self, app: &str) -> Result<Option<AppSnapshot>, EngineError> {
        match self.ask(app, Ask::Snapshot)? {
            Answer::Snapshot(s) => Ok(s),
            Answer::Value(_) => unreachable!("a snapshot is answered with a snapshot"),
        }
    }

    /// Gives app `app` back state an earlier snapshot took ([`crate::App::restore`]); its
    /// refusal says why.
    pub fn restore_app(&self, app: &str, state: AppState) -> Result<(), EngineError> {
        self.ask(app, Ask::Restore(state)).map(drop)
    }

    fn ask(&self, app: &str, ask: Ask) -> Result<Answer, EngineError> {
        let (tx, flag) = {
            let st = self.state();
            let info = st
                .apps
                .get(app)
                .ok_or_else(|| EngineError::NoSuchApp(app.to_string()))?;
            let w = st
                .workers
                .get(&info.worker)
                .ok_or_else(|| EngineError::WorkerLost(info.worker.clone()))?;
            (w.queries.clone(), w.query_flag.clone())
        };
        let (reply, answer) = mpsc::channel();
        tx.send(Query {
            app: app.to_string(),
            ask,
            reply,
        })
        .map_err(|_| EngineError::Other("the worker is gone".into()))?;
        flag.store(true, Ordering::Release);
        match answer.recv_timeout(Duration::from_secs(5)) {
            Ok(r) => r.map_err(EngineError::Other),
            Err(_) => Err(EngineError::Other(format!(
                "app `{app}` did not answer within 5 s"
            ))),
        }
    }

    /// True when the graph has finite sources, all of them finished, and every link is empty.
    pub fn finished(&self) -> bool {
        let st = self.state();
        let mut any_finite = false;
        for w in st.workers.values() {
            if w.counters.has_finite.load(Ordering::Relaxed) {
                any_finite = true;
                if !w.counters.finite_done.load(Ordering::Relaxed) {
                    return false;
                }
            }
        }
        any_finite && st.links.iter().all(|(_, r)| r.is_empty())
    }

    /// Every link of the running graph with its ring, in the order of the graph file (to tap
    /// them: see [`Ring::add_tap`]).
    pub fn link_rings(&self) -> Vec<(LinkDecl, Arc<Ring>)> {
        self.state().links.clone()
    }

    /// Total link activity, to see whether anything still moves.
    pub fn activity(&self) -> u64 {
        self.state().links.iter().map(|(_, r)| r.activity()).sum()
    }

    /// Stops every worker, then every app (which flushes its output), and returns the final
    /// counters. Queued packets stay counted as queued.
    pub fn stop(&self) -> Stats {
        let mut slots = Vec::new();
        {
            let poisoned = self.state.is_poisoned();
            let mut st = self.state();
            if st.stopped {
                drop(st);
                return self.stats();
            }
            st.stopped = true;
            for (_, w) in st.workers.iter_mut() {
                w.park.store(true, Ordering::Release);
                // After the engine's own panic a worker may be parked already, waiting for a
                // plan: it gets a moment to answer, then the command to leave.
                let plan = if poisoned {
                    w.from_worker.recv_timeout(Duration::from_secs(1)).ok()
                } else {
                    w.from_worker.recv().ok()
                };
                if let Some(plan) = plan {
                    slots.extend(plan.slots);
                }
                let _ = w.to_worker.send(Command::Exit);
                if let Some(t) = w.thread.take() {
                    let _ = t.join();
                }
            }
        }
        for s in slots.iter_mut() {
            s.guarded("stop", |a, _| a.stop());
        }
        let stats = self.stats();
        drop(slots);
        stats
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::{App, AppContext, AppError, PortSpec};
    use crate::link::link;
    use crate::pool;
    use std::sync::atomic::AtomicU64;

    /// Sends one packet a breath; counts its `pull` calls.
    struct Source(Arc<AtomicU64>);
    /// Frees what it receives (no `pull`); counts its `push` calls and panics in `tick`.
    struct Drain(Arc<AtomicU64>);

    impl App for Source {
        type Config = ();
        fn declare(_: &()) -> Result<PortSpec, AppError> {
            Ok(PortSpec::source())
        }
        fn new(_: (), _: &mut AppContext) -> Result<Self, AppError> {
            unreachable!("built by hand")
        }
        fn pull(&mut self, io: &mut Io) {
            self.0.fetch_add(1, Ordering::Relaxed);
            if let (Some(out), Some(p)) = (io.output(0), pool::alloc()) {
                out.transmit(p);
            }
        }
    }

    impl App for Drain {
        type Config = ();
        fn declare(_: &()) -> Result<PortSpec, AppError> {
            Ok(PortSpec::sink())
        }
        fn new(_: (), _: &mut AppContext) -> Result<Self, AppError> {
            unreachable!("built by hand")
        }
        fn push(&mut self, io: &mut Io) {
            self.0.fetch_add(1, Ordering::Relaxed);
            if let Some(input) = io.input(0) {
                input.free_available();
            }
        }
        fn tick(&mut self, _: &mut Io, _: Instant) {
            panic!("tick fails on purpose");
        }
    }

    fn slot(name: &str, app: Box<dyn DynApp>, io: Io) -> AppSlot {
        AppSlot {
            app,
            io,
            name: name.into(),
            kind: name.into(),
            config: serde_json::Value::Null,
            counters: Counters::default(),
            failed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// source → drain on one plan, and the two apps' call counters.
    fn source_to_drain() -> (Plan, Arc<AtomicU64>, Arc<AtomicU64>) {
        let (pulls, pushes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (tx, rx) = link(64);
        let slots = vec![
            slot(
                "source",
                Box::new(Source(pulls.clone())),
                Io::new(vec![], vec![("output".into(), tx)]),
            ),
            slot(
                "drain",
                Box::new(Drain(pushes.clone())),
                Io::new(vec![("input".into(), rx)], vec![]),
            ),
        ];
        let plan = Plan {
            order: BreathOrder::of(&slots),
            slots,
            rings: Vec::new(),
            busy_poll: true,
            max_sleep: Duration::from_millis(1),
            core: None,
        };
        (plan, pulls, pushes)
    }

    /// Moves packets no link sees on every other breath (as a direct path between guests does).
    struct OffLinks(u64);

    impl App for OffLinks {
        type Config = ();
        fn declare(_: &()) -> Result<PortSpec, AppError> {
            Ok(PortSpec::source())
        }
        fn new(_: (), _: &mut AppContext) -> Result<Self, AppError> {
            unreachable!("built by hand")
        }
        fn pull(&mut self, io: &mut Io) {
            self.0 += 1;
            if self.0 % 2 == 1 {
                io.moved_off_links();
            }
        }
    }

    #[test]
    fn a_breath_says_when_an_app_moved_packets_no_link_saw() {
        let slots = vec![slot(
            "direct",
            Box::new(OffLinks(0)),
            Io::new(vec![], vec![]),
        )];
        let mut plan = Plan {
            order: BreathOrder::of(&slots),
            slots,
            rings: Vec::new(),
            busy_poll: false,
            max_sleep: Duration::from_millis(1),
            core: None,
        };
        let said: Vec<bool> = (0..4).map(|_| breathe(&mut plan)).collect();
        assert_eq!(said, [true, false, true, false]);
    }

    #[test]
    fn a_breath_calls_only_the_callbacks_an_app_has() {
        let (mut plan, pulls, pushes) = source_to_drain();
        // Until the first breath the engine cannot know which callbacks are the defaults.
        assert_eq!(
            (&plan.order.pull[..], &plan.order.push[..]),
            (&[0, 1][..], &[1][..])
        );
        for _ in 0..3 {
            breathe(&mut plan);
        }
        assert_eq!(
            (&plan.order.pull[..], &plan.order.push[..]),
            (&[0][..], &[1][..])
        );
        assert_eq!(pulls.load(Ordering::Relaxed), 3);
        // The drain pushes once a breath: a second pass finds its input empty.
        assert_eq!(pushes.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn an_app_that_panics_outside_a_breath_leaves_the_breath_order() {
        let (mut plan, pulls, pushes) = source_to_drain();
        breathe(&mut plan);
        tick_apps(&mut plan, Instant::now(), &WorkerCounters::default());
        assert!(plan.slots[1].failed.load(Ordering::Relaxed));
        assert!(plan.order.push.is_empty());
        for _ in 0..3 {
            breathe(&mut plan);
        }
        assert_eq!(pushes.load(Ordering::Relaxed), 1, "no push after the panic");
        assert_eq!(pulls.load(Ordering::Relaxed), 4, "the source runs on");
    }
}
