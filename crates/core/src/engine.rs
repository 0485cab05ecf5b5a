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

use crate::app::{AppContext, AppError, Counters, DynApp, Io, PortNames, Reconfigured, Registry};
use crate::diff::{compute_config_actions, ConfigActions, LinkAction};
use crate::graph::{Endpoint, Graph, LinkDecl, WorkerConfig};
use crate::link::{self, Consumer, LinkStats, Producer, Ring};
use crate::pool;
use indexmap::IndexMap;
use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most push passes in one breath (the first in topological order, the rest for leftovers).
const MAX_PUSH_PASSES: usize = 8;
const TICK_INTERVAL: Duration = Duration::from_millis(1);

thread_local! {
    static BREATH_STARTED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// When the current breath of this worker began: one clock read per breath that apps share
/// (thousands of apps reading the clock each breath cost more than their work). Outside a
/// worker (an app driven by a test) it is the current time.
pub fn breath_started() -> Instant {
    BREATH_STARTED
        .with(|b| b.get())
        .unwrap_or_else(Instant::now)
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("app `{app}`: {source}")]
    Build { app: String, source: AppError },
    #[error("app `{app}`: config: {message}")]
    Config { app: String, message: String },
    #[error("worker `{0}` stopped unexpectedly")]
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
            let msg = e
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| e.downcast_ref::<String>().cloned())
                .unwrap_or_default();
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

/// Per-worker counters.
#[derive(Default)]
pub struct WorkerCounters {
    pub breaths: AtomicU64,
    pub idle_sleeps: AtomicU64,
    /// Whether every finite source of this worker has finished (and it has at least one).
    finite_done: AtomicBool,
    has_finite: AtomicBool,
}

/// What a worker runs: its apps in topological order.
struct Plan {
    slots: Vec<AppSlot>,
    order: BreathOrder,
    rings: Vec<Arc<Ring>>,
    busy_poll: bool,
    max_sleep: Duration,
    core: Option<usize>,
}

enum Command {
    Run(Plan),
    Exit,
}

/// A request for one app, answered by its worker between breaths.
struct Query {
    app: String,
    request: serde_json::Value,
    reply: mpsc::Sender<Result<serde_json::Value, String>>,
}

struct Worker {
    park: Arc<AtomicBool>,
    queries: mpsc::Sender<Query>,
    query_flag: Arc<AtomicBool>,
    to_worker: mpsc::Sender<Command>,
    from_worker: mpsc::Receiver<Plan>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<WorkerCounters>,
    config: WorkerConfig,
}

/// Pins the calling thread to `core`; a failure is logged, and the thread runs where it is.
pub fn pin_to_core(core: usize) {
    // SAFETY: cpu_set_t is a bit array, valid when zeroed; CPU_SET stays inside it for any
    // core below CPU_SETSIZE (libc's CPU_SET checks); sched_setaffinity reads `set` only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            log::warn!(
                "cannot pin worker to core {core}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The apps a breath calls, as indices into a plan's slots in topological order: those that
/// pull, and those that push and have an input. Snabb's engine keeps the same two lists
/// (`breathe_pull_order`, `breathe_push_order`) so that a breath walks only the apps with work
/// to do, without a test per app per pass.
#[derive(Default)]
struct BreathOrder {
    pull: Vec<usize>,
    push: Vec<usize>,
}

impl BreathOrder {
    fn of(slots: &[AppSlot]) -> BreathOrder {
        let live = |s: &AppSlot| !s.failed.load(Ordering::Relaxed);
        let indices = |keep: &dyn Fn(&AppSlot) -> bool| -> Vec<usize> {
            (slots.iter().enumerate())
                .filter(|(_, s)| live(s) && keep(s))
                .map(|(i, _)| i)
                .collect()
        };
        BreathOrder {
            pull: indices(&|s| !s.io.lacks.pull),
            push: indices(&|s| !s.io.lacks.push && s.has_inputs()),
        }
    }
}

/// One breath: every app that pulls brings packets in, then apps push, in topological order,
/// until no input holds packets (at most `MAX_PUSH_PASSES` passes, for links against the
/// order). An app that panics leaves the order at once (a later pass must not call it again);
/// one that lacks a callback, after the breath.
fn breathe(plan: &mut Plan) {
    let pulled = pull_all(plan);
    if pulled.panicked {
        plan.order = BreathOrder::of(&plan.slots);
    }
    let mut lacking = pulled.lacking;
    for pass in 0..MAX_PUSH_PASSES {
        let pushed = push_pass(plan, pass);
        lacking |= pushed.lacking;
        if pushed.panicked {
            plan.order = BreathOrder::of(&plan.slots);
        }
        if !pushed.called {
            break;
        }
    }
    if lacking {
        plan.order = BreathOrder::of(&plan.slots);
    }
}

/// What a walk over one of a breath's lists saw.
#[derive(Default)]
struct Walked {
    /// Whether it called any app.
    called: bool,
    /// Whether an app panicked (it is marked failed).
    panicked: bool,
    /// Whether an app turned out to lack the callback.
    lacking: bool,
}

/// `pull` on every app of the pull list.
fn pull_all(plan: &mut Plan) -> Walked {
    let mut walked = Walked::default();
    for &i in &plan.order.pull {
        let s = &mut plan.slots[i];
        walked.panicked |= s.guarded("pull", |a, io| a.pull(io));
        walked.lacking |= s.io.lacks.pull;
        walked.called = true;
    }
    walked
}

/// One pass of `push` over the push list; after the first, only apps whose inputs hold packets.
/// It stops at an app that panics, which must leave the list before anything is called again.
fn push_pass(plan: &mut Plan, pass: usize) -> Walked {
    let mut walked = Walked::default();
    for &i in &plan.order.push {
        let s = &mut plan.slots[i];
        if pass > 0 && !s.io.inputs.iter_mut().flatten().any(|c| !c.is_empty()) {
            continue;
        }
        walked.called = true;
        if s.guarded("push", |a, io| a.push(io)) {
            walked.panicked = true;
            break;
        }
        walked.lacking |= s.io.lacks.push;
    }
    walked
}

/// Every app's `tick`, and whether the worker's finite sources have all finished.
fn tick_apps(plan: &mut Plan, now: Instant, counters: &WorkerCounters) {
    let (mut has_finite, mut done, mut panicked) = (false, true, false);
    for s in plan.slots.iter_mut() {
        if s.failed.load(Ordering::Relaxed) {
            continue;
        }
        panicked |= s.guarded("tick", |a, io| a.tick(io, now));
        if let Some(f) = s.app.finished() {
            has_finite = true;
            done &= f;
        }
    }
    if panicked {
        plan.order = BreathOrder::of(&plan.slots);
    }
    counters.has_finite.store(has_finite, Ordering::Relaxed);
    counters
        .finite_done
        .store(has_finite && done, Ordering::Relaxed);
}

fn answer_queries(plan: &mut Plan, queries: &mpsc::Receiver<Query>) {
    while let Ok(q) = queries.try_recv() {
        let answer = match plan.slots.iter_mut().find(|s| s.name == q.app) {
            None => Err(format!("app `{}` is not on this worker any more", q.app)),
            Some(s) => {
                let mut out = serde_json::Value::Null;
                if s.guarded("query", |a, _| out = a.query(&q.request)) {
                    plan.order = BreathOrder::of(&plan.slots);
                }
                Ok(out)
            }
        };
        let _ = q.reply.send(answer);
    }
}

fn run_worker(
    park: Arc<AtomicBool>,
    from_ctl: mpsc::Receiver<Command>,
    to_ctl: mpsc::Sender<Plan>,
    counters: Arc<WorkerCounters>,
    query_flag: Arc<AtomicBool>,
    queries: mpsc::Receiver<Query>,
) {
    let mut plan = match from_ctl.recv() {
        Ok(Command::Run(p)) => p,
        _ => return,
    };
    let mut pinned = None;
    let mut last_tick = Instant::now();
    let mut sleep = Duration::from_micros(1);
    let mut breaths = 0u64;
    loop {
        if park.load(Ordering::Acquire) {
            counters.breaths.fetch_add(breaths, Ordering::Relaxed);
            breaths = 0;
            if to_ctl.send(plan).is_err() {
                return;
            }
            plan = match from_ctl.recv() {
                Ok(Command::Run(p)) => p,
                _ => return,
            };
            sleep = Duration::from_micros(1);
        }
        // A plain load first: the locked swap only when a query is waiting.
        if query_flag.load(Ordering::Relaxed) && query_flag.swap(false, Ordering::AcqRel) {
            answer_queries(&mut plan, &queries);
        }
        if plan.core != pinned {
            if let Some(c) = plan.core {
                pin_to_core(c);
            }
            pinned = plan.core;
        }
        // Whether a breath moved anything decides the sleep; a busy-polling worker never sleeps.
        let activity = |plan: &Plan| -> u64 {
            if plan.busy_poll {
                0
            } else {
                plan.rings.iter().map(|r| r.activity()).sum()
            }
        };
        let before = activity(&plan);
        let now = Instant::now();
        BREATH_STARTED.with(|b| b.set(Some(now)));
        breathe(&mut plan);
        breaths += 1;
        if now.duration_since(last_tick) >= TICK_INTERVAL {
            last_tick = now;
            // Published once per tick, not once per breath: no locked add on the hot loop.
            counters.breaths.fetch_add(breaths, Ordering::Relaxed);
            breaths = 0;
            tick_apps(&mut plan, now, &counters);
        }
        let after = activity(&plan);
        if after != before || plan.busy_poll {
            sleep = Duration::from_micros(1);
            if plan.busy_poll {
                std::hint::spin_loop();
            }
        } else {
            counters.idle_sleeps.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(plan.max_sleep);
        }
    }
}

/// Counters of one app: its own named counters plus totals of its links.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AppStats {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub worker: String,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Packets this app's output links dropped because they were full, plus the app's own drops.
    pub drops: u64,
    pub failed: bool,
    pub counters: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct LinkInfo {
    pub link: String,
    pub size: usize,
    /// Captures watching the link now.
    pub taps: usize,
    #[serde(flatten)]
    pub stats: LinkStats,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerStats {
    pub name: String,
    pub core: Option<usize>,
    pub breaths: u64,
    pub idle_sleeps: u64,
}

/// A snapshot of all counters.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stats {
    pub uptime_s: f64,
    pub apps: Vec<AppStats>,
    pub links: Vec<LinkInfo>,
    pub workers: Vec<WorkerStats>,
    pub pool: pool::PoolStats,
    /// Packets freed unsent in links that a live change removed together with both their apps
    /// (with an app staying, they are in its `drops`).
    pub removed_link_drops: u64,
}

/// An app that changed placement in an apply (the placements beside the engine fill these in).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Moved {
    pub app: String,
    pub from: crate::graph::Placement,
    pub to: crate::graph::Placement,
    /// How long the app's own traffic had no function to go through, ms: the engine's switch
    /// (the new placement was ready before it, the old one ran until it).
    pub pause_ms: f64,
    /// The state the app had that its new placement starts without, if any.
    pub state_left_behind: Option<String>,
}

/// What `apply` did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ApplyReport {
    pub started: Vec<String>,
    pub stopped: Vec<String>,
    pub reconfigured: Vec<String>,
    pub restarted: Vec<String>,
    pub kept: Vec<String>,
    pub links_added: Vec<String>,
    pub links_removed: Vec<String>,
    pub links_kept: Vec<String>,
    /// Apps that changed placement.
    pub moved: Vec<Moved>,
    /// How long the workers were parked (no packet moved anywhere in the engine), ms.
    pub paused_ms: f64,
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

/// A running graph.
pub struct Engine {
    registry: Arc<Registry>,
    state: Mutex<State>,
    started: Instant,
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
        }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The graph now running.
    pub fn graph(&self) -> Option<Graph> {
        self.state.lock().unwrap().graph.clone()
    }

    /// Makes `graph` the running graph, keeping whatever did not change. What changes is worked
    /// out from the two documents first ([`compute_config_actions`]); new apps are built before
    /// anything is touched, then the workers park between two breaths while the actions are
    /// carried out, and resume.
    pub fn apply(&self, graph: Graph) -> Result<ApplyReport, EngineError> {
        let mut st = self.state.lock().unwrap();
        check_applicable(&st, &graph)?;
        let actions = compute_config_actions(st.graph.as_ref(), &graph);
        // A failure while building changes nothing.
        let built = self.build_apps(actions.start.iter().chain(&actions.replace), &graph)?;
        let parking = Instant::now();
        let mut parked = park_workers(&mut st)?;
        // All or nothing: a failure gives the apps already reconfigured their old config back
        // and the workers resume with the graph as it was.
        let reconfigured = match self.reconfigure_apps(
            &actions.reconfigure,
            st.graph.as_ref(),
            &graph,
            &mut parked,
        ) {
            Ok(r) => r,
            Err(e) => {
                resume_parked(&st, parked)?;
                return Err(EngineError::RolledBack(Box::new(e)));
            }
        };
        let mut report = ApplyReport::of_actions(&actions, &reconfigured);
        let (mut slots, ends) = unpark(parked);
        for name in &reconfigured.in_place {
            let slot = slots.get_mut(name).expect("kept app has a slot");
            slot.config = graph.apps[name].config.clone();
        }
        let retired = retire_apps(&mut slots, &actions, reconfigured.rebuilt, &graph);
        add_built_apps(&mut slots, built, &graph);
        let (links, removed) = rewire(&mut slots, ends, &actions.links, &graph, &mut report);
        for name in actions.stop.iter().chain(&actions.replace) {
            st.folded.remove(name);
        }
        st.orphaned_drops += fold_removed_links(&mut st.folded, &removed, &slots);
        drop(removed);
        self.resume_workers(&mut st, slots, &graph)?;
        st.links = links;
        st.graph = Some(graph);
        report.paused_ms = parking.elapsed().as_secs_f64() * 1e3;
        // Closing a socket or unmapping a ring can wait for the kernel (a packet socket's
        // close waits for an RCU grace period): what left goes once the workers run again.
        drop(retired);
        Ok(report)
    }

    /// Builds the apps named `names` of `graph`, each with fresh counters.
    fn build_apps<'a>(
        &self,
        names: impl Iterator<Item = &'a String>,
        graph: &Graph,
    ) -> Result<BuiltApps, EngineError> {
        names
            .map(|name| {
                let built = self.build(&graph.apps[name], graph, Counters::default())?;
                Ok((name.clone(), built))
            })
            .collect()
    }

    /// Gives each parked app of `names` its config in `graph`, in place or (when the app asks)
    /// by a rebuild that keeps its counters. On the first failure the apps already reconfigured
    /// in place get their config in `old` back.
    fn reconfigure_apps(
        &self,
        names: &[String],
        old: Option<&Graph>,
        graph: &Graph,
        parked: &mut [(String, Plan)],
    ) -> Result<Reconfiguration, EngineError> {
        let mut done = Reconfiguration::default();
        for name in names {
            let slot = parked_slot(parked, name).expect("kept app has a slot");
            let decl = &graph.apps[name];
            let step = match self.reconfigure(slot, decl, &graph.base_dir) {
                Ok(Reconfigured::Done) => {
                    done.in_place.push(name.clone());
                    Ok(())
                }
                Ok(Reconfigured::Restart) => {
                    self.build(decl, graph, slot.counters.clone())
                        .map(|(app, _)| {
                            done.rebuilt.insert(name.clone(), app);
                        })
                }
                Err(e) => Err(e),
            };
            if let Err(e) = step {
                let old = old.expect("a reconfigured app has an old graph");
                for name in done.in_place.iter().rev() {
                    let slot = parked_slot(parked, name).expect("kept app has a slot");
                    if let Err(e) = self.reconfigure(slot, &old.apps[name], &old.base_dir) {
                        log::error!("cannot give app `{name}` its previous config back: {e}");
                    }
                }
                return Err(e);
            }
        }
        Ok(done)
    }

    /// Hands every worker its share of `slots` in topological order (recording each app's
    /// place and links in `st.apps`), stops workers the graph no longer has and starts its new
    /// ones.
    fn resume_workers(
        &self,
        st: &mut State,
        slots: HashMap<String, AppSlot>,
        graph: &Graph,
    ) -> Result<(), EngineError> {
        let (plans, apps) = distribute(slots, graph);
        st.apps = apps;
        let gone: Vec<String> = st
            .workers
            .keys()
            .filter(|w| !plans.contains_key(*w))
            .cloned()
            .collect();
        for w in gone {
            let mut worker = st.workers.shift_remove(&w).unwrap();
            let _ = worker.to_worker.send(Command::Exit);
            if let Some(t) = worker.thread.take() {
                let _ = t.join();
            }
        }
        for (wname, plan) in plans {
            let cfg = graph.workers[&wname].clone();
            let w = match st.workers.get_mut(&wname) {
                Some(w) => w,
                None => {
                    let w = spawn_worker(&wname, cfg.clone())?;
                    st.workers.entry(wname.clone()).or_insert(w)
                }
            };
            w.config = cfg;
            w.to_worker
                .send(Command::Run(plan))
                .map_err(|_| EngineError::WorkerLost(wname))?;
        }
        Ok(())
    }

    /// Gives a running app its new config in place.
    fn reconfigure(
        &self,
        slot: &mut AppSlot,
        decl: &crate::graph::AppDecl,
        base_dir: &Path,
    ) -> Result<Reconfigured, EngineError> {
        let t = self.registry.get(&decl.kind).expect("validated type");
        let parsed = t.parse(&decl.config).map_err(|e| EngineError::Config {
            app: decl.name.clone(),
            message: format!("{}: {}", e.path, e.message),
        })?;
        let mut ctx = AppContext::new(&decl.name, base_dir, slot.counters.clone());
        slot.app
            .reconfigure(parsed.into_any(), &mut ctx)
            .map_err(|source| EngineError::Build {
                app: decl.name.clone(),
                source,
            })
    }

    fn build(
        &self,
        decl: &crate::graph::AppDecl,
        graph: &Graph,
        counters: Counters,
    ) -> Result<(Box<dyn DynApp>, Counters), EngineError> {
        let t = self
            .registry
            .get(&decl.kind)
            .ok_or_else(|| EngineError::Config {
                app: decl.name.clone(),
                message: format!("unknown app type `{}`", decl.kind),
            })?;
        let parsed = t.parse(&decl.config).map_err(|e| EngineError::Config {
            app: decl.name.clone(),
            message: format!("{}: {}", e.path, e.message),
        })?;
        let mut ctx = AppContext::new(&decl.name, &graph.base_dir, counters.clone());
        let app = t
            .build(parsed, &mut ctx)
            .map_err(|source| EngineError::Build {
                app: decl.name.clone(),
                source,
            })?;
        Ok((app, counters))
    }

    /// Current counters of every app, link and worker.
    pub fn stats(&self) -> Stats {
        let st = self.state.lock().unwrap();
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
        Stats {
            uptime_s: self.started.elapsed().as_secs_f64(),
            apps,
            links,
            workers,
            pool: pool::get().stats(),
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
        let (tx, flag) = {
            let st = self.state.lock().unwrap();
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
            request,
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
        let st = self.state.lock().unwrap();
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
        self.state.lock().unwrap().links.clone()
    }

    /// Total link activity, to see whether anything still moves.
    pub fn activity(&self) -> u64 {
        self.state
            .lock()
            .unwrap()
            .links
            .iter()
            .map(|(_, r)| r.activity())
            .sum()
    }

    /// Stops every worker, then every app (which flushes its output), and returns the final
    /// counters. Queued packets stay counted as queued.
    pub fn stop(&self) -> Stats {
        let mut slots = Vec::new();
        {
            let mut st = self.state.lock().unwrap();
            if st.stopped {
                drop(st);
                return self.stats();
            }
            st.stopped = true;
            for (_, w) in st.workers.iter_mut() {
                w.park.store(true, Ordering::Release);
                if let Ok(plan) = w.from_worker.recv() {
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

fn spawn_worker(name: &str, config: WorkerConfig) -> Result<Worker, EngineError> {
    let (to_worker, from_ctl) = mpsc::channel();
    let (to_ctl, from_worker) = mpsc::channel();
    let park = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(WorkerCounters::default());
    let (queries, queries_rx) = mpsc::channel();
    let query_flag = Arc::new(AtomicBool::new(false));
    let (p, c, f) = (park.clone(), counters.clone(), query_flag.clone());
    let thread = std::thread::Builder::new()
        .name(format!("stitch-{name}"))
        .spawn(move || run_worker(p, from_ctl, to_ctl, c, f, queries_rx))
        .map_err(|e| EngineError::Other(format!("cannot start worker `{name}`: {e}")))?;
    Ok(Worker {
        park,
        queries,
        query_flag,
        to_worker,
        from_worker,
        thread: Some(thread),
        counters,
        config,
    })
}

/// Apps built for a graph before it is applied, by name, with their counters.
type BuiltApps = HashMap<String, (Box<dyn DynApp>, Counters)>;

/// What reconfiguring kept apps came to.
#[derive(Default)]
struct Reconfiguration {
    /// Apps that took their new config in place.
    in_place: Vec<String>,
    /// Apps that asked to be rebuilt with it, rebuilt on their old counters.
    rebuilt: HashMap<String, Box<dyn DynApp>>,
}

/// Apps that left the graph (or were rebuilt), kept until the workers run again.
struct Retired {
    _apps: Vec<Box<dyn DynApp>>,
    _slots: Vec<AppSlot>,
}

impl ApplyReport {
    /// The report of `actions` once carried out, its links still to be filled in by
    /// [`rewire`].
    fn of_actions(actions: &ConfigActions, done: &Reconfiguration) -> ApplyReport {
        let mut restarted: Vec<String> = (actions.replace.iter())
            .chain(done.rebuilt.keys())
            .cloned()
            .collect();
        restarted.sort();
        ApplyReport {
            started: actions.start.clone(),
            stopped: actions.stop.clone(),
            reconfigured: done.in_place.clone(),
            restarted,
            kept: actions.keep.clone(),
            links_removed: actions.remove_links.iter().map(LinkDecl::spec).collect(),
            ..ApplyReport::default()
        }
    }
}

/// Refuses a graph the engine cannot run, before anything is touched; makes the packet pool
/// for the first graph.
fn check_applicable(st: &State, graph: &Graph) -> Result<(), EngineError> {
    if st.stopped {
        return Err(EngineError::Other("engine is stopped".into()));
    }
    if let Some(a) = graph
        .apps
        .values()
        .find(|a| a.placement != crate::graph::Placement::Engine)
    {
        return Err(EngineError::Config {
            app: a.name.clone(),
            message: format!(
                "line {}: the engine runs `placement: engine` apps; a `placement: {}` app \
                 is placed beside it (`stitch run` does that, or `stitch kernel apply` for \
                 a kernel-only graph)",
                a.line, a.placement
            ),
        });
    }
    if st.graph.is_none() {
        pool::init(graph.engine.pool_packets, graph.engine.pool_large_packets)
            .map_err(|e| EngineError::Other(e.to_string()))?;
    }
    Ok(())
}

/// Parks every worker between two breaths. Their plans come back whole, so that a change that
/// fails can resume them exactly as they were.
fn park_workers(st: &mut State) -> Result<Vec<(String, Plan)>, EngineError> {
    let mut parked = Vec::new();
    for (wname, w) in st.workers.iter_mut() {
        w.park.store(true, Ordering::Release);
        let plan = w
            .from_worker
            .recv()
            .map_err(|_| EngineError::WorkerLost(wname.clone()))?;
        w.park.store(false, Ordering::Release);
        parked.push((wname.clone(), plan));
    }
    Ok(parked)
}

/// Gives every parked worker its plan back unchanged.
fn resume_parked(st: &State, parked: Vec<(String, Plan)>) -> Result<(), EngineError> {
    for (wname, plan) in parked {
        st.workers[&wname]
            .to_worker
            .send(Command::Run(plan))
            .map_err(|_| EngineError::WorkerLost(wname))?;
    }
    Ok(())
}

/// The parked workers' apps by name, with their link ends taken out for rewiring.
fn unpark(parked: Vec<(String, Plan)>) -> (HashMap<String, AppSlot>, LinkEnds) {
    let mut slots = HashMap::new();
    let mut ends = LinkEnds::default();
    for (_, plan) in parked {
        for mut s in plan.slots {
            take_ends(&mut s, &mut ends);
            slots.insert(s.name.clone(), s);
        }
    }
    (slots, ends)
}

/// Stops the apps that leave (their slots taken out: names gone, and names whose type
/// changed, whose new app takes a new slot) and the old versions of the apps `rebuilt`
/// replaces (their slots, links and counters stay), in name order.
fn retire_apps(
    slots: &mut HashMap<String, AppSlot>,
    actions: &ConfigActions,
    rebuilt: HashMap<String, Box<dyn DynApp>>,
    graph: &Graph,
) -> Retired {
    let mut apps = Vec::new();
    let mut rebuilt: Vec<(String, Box<dyn DynApp>)> = rebuilt.into_iter().collect();
    rebuilt.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, app) in rebuilt {
        let s = slots.get_mut(&name).expect("kept app has a slot");
        s.guarded("stop", |a, _| a.stop());
        apps.push(std::mem::replace(&mut s.app, app));
        s.config = graph.apps[&name].config.clone();
    }
    let mut leaving: Vec<&String> = actions.stop.iter().chain(&actions.replace).collect();
    leaving.sort();
    let mut gone = Vec::new();
    for name in leaving {
        if let Some(mut s) = slots.remove(name) {
            s.guarded("stop", |a, _| a.stop());
            gone.push(s);
        }
    }
    Retired {
        _apps: apps,
        _slots: gone,
    }
}

/// Gives each newly built app a slot, its ports still unconnected.
fn add_built_apps(slots: &mut HashMap<String, AppSlot>, built: BuiltApps, graph: &Graph) {
    for (name, (app, counters)) in built {
        let decl = &graph.apps[&name];
        slots.insert(
            name.clone(),
            AppSlot {
                name,
                kind: decl.kind.clone(),
                config: decl.config.clone(),
                app,
                io: Io::default(),
                counters,
                failed: Arc::new(AtomicBool::new(false)),
            },
        );
    }
}

/// Connects every link of the new graph as its action says: a kept link gets its ring back
/// (with its queued packets; moved to a ring of the new size when that changed), the others a
/// new ring. Ends left in
/// `ends` belong to removed links and close with them.
fn rewire(
    slots: &mut HashMap<String, AppSlot>,
    mut ends: LinkEnds,
    links: &[(LinkDecl, LinkAction)],
    graph: &Graph,
    report: &mut ApplyReport,
) -> (Vec<(LinkDecl, Arc<Ring>)>, LinkEnds) {
    let mut rings = Vec::new();
    for (l, action) in links {
        let (p, c) = match (ends.producers.remove(&l.from), ends.consumers.remove(&l.to)) {
            (Some(p), Some(c)) if *action != LinkAction::Add && Arc::ptr_eq(p.ring(), c.ring()) => {
                if *action == LinkAction::Keep {
                    report.links_kept.push(l.spec());
                    (p, c)
                } else {
                    report.links_added.push(l.spec());
                    link::resize(c, l.size)
                }
            }
            (p, c) => {
                // An end that belonged to another link goes back for that link's removal.
                if let Some(p) = p {
                    ends.producers.insert(l.from.clone(), p);
                }
                if let Some(c) = c {
                    ends.consumers.insert(l.to.clone(), c);
                }
                report.links_added.push(l.spec());
                link::link(l.size)
            }
        };
        rings.push((l.clone(), p.ring().clone()));
        let from = slots.get_mut(&l.from.app).expect("validated app");
        attach_output(from, &l.from.port, p, graph);
        let to = slots.get_mut(&l.to.app).expect("validated app");
        attach_input(to, &l.to.port, c, graph);
    }
    (rings, ends)
}

/// Adds the counts of the links that leave (their ends left over from [`rewire`]) to the
/// totals of the apps that stay (`slots`): a producer keeps what it sent, a consumer what it
/// received and, as drops, what was still queued toward it. Returns the packets queued in links
/// whose two apps both left.
fn fold_removed_links(
    folded: &mut HashMap<String, LinkTotals>,
    removed: &LinkEnds,
    slots: &HashMap<String, AppSlot>,
) -> u64 {
    let mut orphaned = 0;
    for (from, p) in &removed.producers {
        let ring = p.ring();
        let to = (removed.consumers.iter())
            .find(|(_, c)| Arc::ptr_eq(c.ring(), ring))
            .map(|(e, _)| e.app.as_str());
        let l = ring.stats();
        let producer_stays = slots.contains_key(&from.app);
        if producer_stays {
            let t = folded.entry(from.app.clone()).or_default();
            t.tx_packets += l.tx_packets;
            t.tx_bytes += l.tx_bytes;
            t.drops += l.tx_drops;
        }
        match to.filter(|app| slots.contains_key(*app)) {
            Some(app) => {
                let t = folded.entry(app.to_string()).or_default();
                t.rx_packets += l.rx_packets;
                t.rx_bytes += l.tx_bytes;
                t.drops += l.queued;
            }
            None if producer_stays => {
                folded.get_mut(&from.app).expect("added above").drops += l.queued
            }
            None => orphaned += l.queued,
        }
    }
    orphaned
}

/// Each worker's plan — its apps in topological order and the rings they touch — and what the
/// engine records of each app.
fn distribute(
    mut slots: HashMap<String, AppSlot>,
    graph: &Graph,
) -> (IndexMap<String, Plan>, IndexMap<String, AppInfo>) {
    let mut plans: IndexMap<String, Plan> = graph
        .workers
        .iter()
        .map(|(wname, wcfg)| {
            let plan = Plan {
                slots: Vec::new(),
                order: BreathOrder::default(),
                rings: Vec::new(),
                busy_poll: graph.engine.busy_poll,
                max_sleep: Duration::from_micros(graph.engine.max_sleep_us.max(1)),
                core: wcfg.core,
            };
            (wname.clone(), plan)
        })
        .collect();
    let mut apps = IndexMap::new();
    for name in topological_order(graph) {
        let s = slots.remove(&name).expect("slot for every app");
        let decl = &graph.apps[&name];
        let inputs: Vec<Arc<Ring>> = (s.io.inputs.iter().flatten())
            .map(|c| c.ring().clone())
            .collect();
        let outputs: Vec<Arc<Ring>> = (s.io.outputs.iter().flatten())
            .map(|p| p.ring().clone())
            .collect();
        let plan = plans.get_mut(&decl.worker).expect("worker of every app");
        for r in inputs.iter().chain(&outputs) {
            if !plan.rings.iter().any(|x| Arc::ptr_eq(x, r)) {
                plan.rings.push(r.clone());
            }
        }
        apps.insert(
            name,
            AppInfo {
                kind: decl.kind.clone(),
                worker: decl.worker.clone(),
                counters: s.counters.clone(),
                failed: s.failed.clone(),
                inputs,
                outputs,
            },
        );
        plan.slots.push(s);
    }
    for plan in plans.values_mut() {
        plan.order = BreathOrder::of(&plan.slots);
    }
    (plans, apps)
}

fn parked_slot<'a>(parked: &'a mut [(String, Plan)], name: &str) -> Option<&'a mut AppSlot> {
    parked
        .iter_mut()
        .flat_map(|(_, p)| p.slots.iter_mut())
        .find(|s| s.name == name)
}

fn take_ends(s: &mut AppSlot, ends: &mut LinkEnds) {
    let io = std::mem::take(&mut s.io);
    for (name, c) in io.input_names.into_iter().zip(io.inputs) {
        if let Some(c) = c {
            ends.consumers.insert(
                Endpoint {
                    app: s.name.clone(),
                    port: name,
                },
                c,
            );
        }
    }
    for (name, p) in io.output_names.into_iter().zip(io.outputs) {
        if let Some(p) = p {
            ends.producers.insert(
                Endpoint {
                    app: s.name.clone(),
                    port: name,
                },
                p,
            );
        }
    }
}

fn prepare_io(s: &mut AppSlot, graph: &Graph) {
    if s.io.input_names.is_empty() && s.io.output_names.is_empty() {
        let ports = &graph.apps[&s.name].ports;
        if let PortNames::Fixed(n) = &ports.inputs {
            s.io.input_names = n.clone();
            s.io.inputs = n.iter().map(|_| None).collect();
        }
        if let PortNames::Fixed(n) = &ports.outputs {
            s.io.output_names = n.clone();
            s.io.outputs = n.iter().map(|_| None).collect();
        }
    }
}

fn attach_output(s: &mut AppSlot, port: &str, p: Producer, graph: &Graph) {
    prepare_io(s, graph);
    match s.io.output_slot(port) {
        Some(i) => s.io.outputs[i] = Some(p),
        None => {
            s.io.output_names.push(port.to_string());
            s.io.outputs.push(Some(p));
        }
    }
}

fn attach_input(s: &mut AppSlot, port: &str, c: Consumer, graph: &Graph) {
    prepare_io(s, graph);
    match s.io.input_slot(port) {
        Some(i) => s.io.inputs[i] = Some(c),
        None => {
            s.io.input_names.push(port.to_string());
            s.io.inputs.push(Some(c));
        }
    }
}

/// Apps ordered so that producers come before consumers; in a cycle, the app listed first in the
/// graph file goes first.
pub fn topological_order(graph: &Graph) -> Vec<String> {
    let names: Vec<&String> = graph.apps.keys().collect();
    let index: HashMap<&String, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut indegree = vec![0usize; names.len()];
    let mut succ = vec![Vec::new(); names.len()];
    for l in &graph.links {
        let (a, b) = (index[&l.from.app], index[&l.to.app]);
        succ[a].push(b);
        indegree[b] += 1;
    }
    let mut done = vec![false; names.len()];
    let mut order = Vec::with_capacity(names.len());
    while order.len() < names.len() {
        // Lowest-index app with no pending producer; when a cycle blocks, the lowest-index
        // remaining app.
        let next = (0..names.len())
            .find(|&i| !done[i] && indegree[i] == 0)
            .or_else(|| (0..names.len()).find(|&i| !done[i]))
            .unwrap();
        done[next] = true;
        order.push(names[next].clone());
        for &s in &succ[next] {
            indegree[s] = indegree[s].saturating_sub(1);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::{App, AppContext, AppError, PortSpec};
    use crate::link::link;
    use crate::pool;

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
