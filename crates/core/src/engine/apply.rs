//! The live change, carried out: the plan's actions ([`super::plan`]) applied while the
//! workers are parked between two breaths — new apps built first, kept apps with their state,
//! links with their queued packets, counters of what leaves folded into what stays.
//!
//! All or nothing, on every way out: an app's `new` or `reconfigure` that fails or panics
//! (caught as a breath's panics are) fails the change with the app's name, and the parked
//! workers get their plans back from [`Parked`] whatever the path — an error, a lost worker,
//! a panic. Only a panic of the engine's own code with its lock held is beyond that: the
//! graph runs on as left, and every further change is refused (`Engine::state_to_change`).

use super::*;
use crate::app::{AppContext, Counters, DynApp, Io, PortNames, Reconfigured};
use crate::engine::plan::{compute_config_actions, ConfigActions, LinkAction};
use crate::graph::{Endpoint, Graph, LinkDecl};
use crate::link::{self, Consumer, Producer, Ring};
use crate::pool;
use indexmap::IndexMap;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

impl Engine {
    /// Makes `graph` the running graph, keeping whatever did not change. What changes is worked
    /// out from the two documents first ([`compute_config_actions`]); new apps are built before
    /// anything is touched, then the workers park between two breaths while the actions are
    /// carried out, and resume.
    pub fn apply(&self, graph: Graph) -> Result<ApplyReport, EngineError> {
        let mut st = self.state_to_change()?;
        check_applicable(&st, &graph)?;
        let actions = compute_config_actions(st.graph.as_ref(), &graph);
        // A failure while building changes nothing.
        let built = self.build_apps(actions.start.iter().chain(&actions.replace), &graph)?;
        self.carry_out(&mut st, &actions, built, graph)
    }

    /// The actions of a change whose new apps are `built`: the workers park, the actions are
    /// carried out (all or nothing), and the workers resume.
    pub(super) fn carry_out(
        &self,
        st: &mut State,
        actions: &ConfigActions,
        built: BuiltApps,
        graph: Graph,
    ) -> Result<ApplyReport, EngineError> {
        let parking = Instant::now();
        let mut parked = park_workers(st)?;
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
                parked.resume()?;
                return Err(EngineError::RolledBack(Box::new(e)));
            }
        };
        let mut report = ApplyReport::of_actions(actions, &reconfigured);
        let (mut slots, ends) = unpark(parked.into_plans());
        for name in &reconfigured.in_place {
            let slot = slots.get_mut(name).expect("kept app has a slot");
            slot.config = graph.apps[name].config.clone();
        }
        let carried = snapshot_resharded(&mut slots, actions, st.graph.as_ref(), &graph);
        let retired = retire_apps(&mut slots, actions, reconfigured.rebuilt, &graph);
        add_built_apps(&mut slots, built, &graph);
        restore_resharded(&mut slots, carried);
        let (links, removed) = rewire(&mut slots, ends, &actions.links, &graph, &mut report);
        for name in actions.stop.iter().chain(&actions.replace) {
            st.folded.remove(name);
        }
        st.orphaned_drops += fold_removed_links(&mut st.folded, &removed, &slots);
        drop(removed);
        self.resume_workers(st, slots, &graph)?;
        st.links = links;
        st.graph = Some(graph);
        report.paused_ms = parking.elapsed().as_secs_f64() * 1e3;
        // Closing a socket or unmapping a ring can wait for the kernel (a packet socket's
        // close waits for an RCU grace period): what left goes once the workers run again.
        drop(retired);
        Ok(report)
    }

    /// Builds the apps named `names` of `graph`, each with fresh counters, adopting what a
    /// predecessor process lent it ([`Engine::prepare_inheriting`]).
    pub(super) fn build_apps<'a>(
        &self,
        names: impl Iterator<Item = &'a String>,
        graph: &Graph,
    ) -> Result<BuiltApps, EngineError> {
        names
            .map(|name| {
                let decl = &graph.apps[name];
                let lent = self.inherited(name, &decl.kind);
                let built = self.build(decl, graph, Counters::default(), lent)?;
                Ok((name.clone(), built))
            })
            .collect()
    }

    /// Gives each parked app of `names` its config in `graph`, in place or (when the app asks)
    /// by a rebuild that keeps its counters. On the first failure the apps already reconfigured
    /// in place get their config in `old` back, and so does the app that failed when it
    /// panicked (its refusal leaves it as it was; a panic, who knows where): if it fails again
    /// it is stopped, as a breath's panic stops an app.
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
                Ok(Reconfigured::Restart) => self
                    .build(decl, graph, slot.counters.clone(), None)
                    .map(|(app, _)| {
                        done.rebuilt.insert(name.clone(), app);
                    }),
                Err(e) => Err(e),
            };
            if let Err(e) = step {
                let old = old.expect("a reconfigured app has an old graph");
                if e.is_panic() {
                    slot.counters.get("panics").add(1);
                    done.in_place.push(name.clone());
                }
                for name in done.in_place.iter().rev() {
                    let slot = parked_slot(parked, name).expect("kept app has a slot");
                    if let Err(e) = self.reconfigure(slot, &old.apps[name], &old.base_dir) {
                        log::error!(
                            "cannot give app `{name}` its previous config back: {e}; it is stopped"
                        );
                        slot.failed.store(true, Ordering::Relaxed);
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
        ctx.set_shard(decl.shard.clone());
        caught(&decl.name, "reconfigure", || {
            slot.app.reconfigure(parsed.into_any(), &mut ctx)
        })
    }

    fn build(
        &self,
        decl: &crate::graph::AppDecl,
        graph: &Graph,
        counters: Counters,
        inherited: Option<crate::app::Descriptors>,
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
        ctx.set_shard(decl.shard.clone());
        if let Some(d) = inherited {
            ctx.inherit(d);
        }
        let app = caught(&decl.name, "new", || t.build(parsed, &mut ctx))?;
        Ok((app, counters))
    }
}

/// Apps built for a graph before it is applied, by name, with their counters.
pub(super) type BuiltApps = HashMap<String, (Box<dyn DynApp>, Counters)>;

/// What reconfiguring kept apps came to.
#[derive(Default)]
pub(super) struct Reconfiguration {
    /// Apps that took their new config in place.
    pub(super) in_place: Vec<String>,
    /// Apps that asked to be rebuilt with it, rebuilt on their old counters.
    pub(super) rebuilt: HashMap<String, Box<dyn DynApp>>,
}

/// Apps that left the graph (or were rebuilt), kept until the workers run again.
pub(super) struct Retired {
    pub(super) _apps: Vec<Box<dyn DynApp>>,
    pub(super) _slots: Vec<AppSlot>,
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
            worker_moves: actions.change_worker.clone(),
            ..ApplyReport::default()
        }
    }
}

/// Refuses a change to a stopped engine, before anything is touched; makes the packet pool
/// for the first graph.
pub(super) fn check_applicable(st: &State, graph: &Graph) -> Result<(), EngineError> {
    if st.stopped {
        return Err(EngineError::Other("engine is stopped".into()));
    }
    if st.graph.is_none() {
        pool::init(graph.engine.pool_packets, graph.engine.pool_large_packets)
            .map_err(|e| EngineError::Other(e.to_string()))?;
    }
    Ok(())
}

/// Workers parked between two breaths, with their plans. However it is left — an error, a
/// panic on the way — it hands every worker its plan back unchanged, unless the plans were
/// taken ([`Parked::into_plans`]) or are to stay ([`Parked::keep_parked`]): no path out of a
/// change leaves a worker waiting for a plan (`link.rs`'s `FreeUnqueued` is the same idiom).
#[derive(Default)]
pub(super) struct Parked {
    plans: Vec<(String, Plan)>,
    /// Each plan's way back to its worker, in the plans' order.
    to_workers: Vec<mpsc::Sender<Command>>,
}

impl Parked {
    /// Every worker gets its plan back; the first worker found gone is the error (the others
    /// resume all the same).
    pub(super) fn resume(mut self) -> Result<(), EngineError> {
        self.resume_all()
    }

    fn resume_all(&mut self) -> Result<(), EngineError> {
        let mut lost = None;
        for ((wname, plan), to) in self.plans.drain(..).zip(self.to_workers.drain(..)) {
            if to.send(Command::Run(plan)).is_err() {
                lost.get_or_insert(wname);
            }
        }
        lost.map_or(Ok(()), |w| Err(EngineError::WorkerLost(w)))
    }

    /// The plans, for the change to take apart; resuming is then the change's to do.
    pub(super) fn into_plans(mut self) -> Vec<(String, Plan)> {
        self.to_workers.clear();
        std::mem::take(&mut self.plans)
    }

    /// The workers stay parked and their apps are never dropped: a successor process runs
    /// them now, and dropping the apps would close what it shares and run their teardown
    /// (detaching programs, removing devices) under it.
    pub(super) fn keep_parked(mut self) {
        self.to_workers.clear();
        std::mem::forget(std::mem::take(&mut self.plans));
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        if let Err(e) = self.resume_all() {
            log::error!("resuming the workers after a failed change: {e}");
        }
    }
}

impl std::ops::Deref for Parked {
    type Target = Vec<(String, Plan)>;
    fn deref(&self) -> &Self::Target {
        &self.plans
    }
}

impl std::ops::DerefMut for Parked {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.plans
    }
}

/// Parks every worker between two breaths. Their plans come back whole, so that a change that
/// fails can resume them exactly as they were; a worker found gone resumes those parked
/// before it.
pub(super) fn park_workers(st: &mut State) -> Result<Parked, EngineError> {
    let mut parked = Parked::default();
    for (wname, w) in st.workers.iter_mut() {
        w.park.store(true, Ordering::Release);
        let plan = w.from_worker.recv();
        w.park.store(false, Ordering::Release);
        let plan = plan.map_err(|_| EngineError::WorkerLost(wname.clone()))?;
        parked.plans.push((wname.clone(), plan));
        parked.to_workers.push(w.to_worker.clone());
    }
    Ok(parked)
}

/// The parked workers' apps by name, with their link ends taken out for rewiring.
pub(super) fn unpark(parked: Vec<(String, Plan)>) -> (HashMap<String, AppSlot>, LinkEnds) {
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
pub(super) fn retire_apps(
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

/// The base name of an app: the app it is a shard of, or its own.
fn base_name(decl: &crate::graph::AppDecl) -> &str {
    decl.shard.as_ref().map_or(&decl.name, |s| &s.of)
}

/// The state of apps whose number of shards changes ([`crate::graph`]): each leaving instance
/// of an app that arrives again with the same type under other shards is asked for its
/// state, before it stops. By the arriving instances' names.
fn snapshot_resharded(
    slots: &mut HashMap<String, AppSlot>,
    actions: &ConfigActions,
    old: Option<&Graph>,
    new: &Graph,
) -> Vec<(String, Vec<AppState>)> {
    let Some(old) = old else {
        return Vec::new();
    };
    let arriving: Vec<&crate::graph::AppDecl> = (actions.start.iter().chain(&actions.replace))
        .map(|n| &new.apps[n])
        .collect();
    let mut leaving: Vec<&crate::graph::AppDecl> = (actions.stop.iter().chain(&actions.replace))
        .filter_map(|n| old.apps.get(n))
        .filter(|was| {
            arriving.iter().any(|a| {
                base_name(a) == base_name(was) && a.kind == was.kind && a.shard != was.shard
            })
        })
        .collect();
    leaving.sort_by(|a, b| a.name.cmp(&b.name));
    let mut states: HashMap<&str, Vec<AppState>> = HashMap::new();
    for was in leaving {
        let Some(slot) = slots.get_mut(&was.name) else {
            continue;
        };
        let mut snapshot = None;
        slot.guarded("snapshot", |a, _| snapshot = a.snapshot());
        match snapshot.map(AppSnapshot::into_state) {
            Some(Ok(state)) => states.entry(base_name(was)).or_default().push(state),
            Some(Err(e)) => log::warn!(
                "app `{}`: its state could not be carried over: {e}",
                was.name
            ),
            None => {}
        }
    }
    arriving
        .iter()
        .filter_map(|a| Some((a.name.clone(), states.get(base_name(a))?.clone())))
        .collect()
}

/// Gives each arriving instance the state of the instances it replaces; each takes what is
/// its own (a shard, what its shard owns).
fn restore_resharded(slots: &mut HashMap<String, AppSlot>, carried: Vec<(String, Vec<AppState>)>) {
    for (name, states) in carried {
        let Some(slot) = slots.get_mut(&name) else {
            continue;
        };
        for state in states {
            let mut result = Ok(());
            slot.guarded("restore", |a, _| result = a.restore(state));
            if let Err(e) = result {
                log::warn!("app `{name}`: the state of its earlier shards was refused: {e}");
            }
        }
    }
}

/// Gives each newly built app a slot, its ports still unconnected.
pub(super) fn add_built_apps(
    slots: &mut HashMap<String, AppSlot>,
    built: BuiltApps,
    graph: &Graph,
) {
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
pub(super) fn rewire(
    slots: &mut HashMap<String, AppSlot>,
    mut ends: LinkEnds,
    links: &[(LinkDecl, LinkAction)],
    graph: &Graph,
    report: &mut ApplyReport,
) -> (Vec<(LinkDecl, Arc<Ring>)>, LinkEnds) {
    let mut rings = Vec::new();
    for (l, action) in links {
        let mut histogram = None;
        let (p, c) = match (ends.producers.remove(&l.from), ends.consumers.remove(&l.to)) {
            (Some(p), Some(c)) if *action != LinkAction::Add && Arc::ptr_eq(p.ring(), c.ring()) => {
                histogram = c.ring().latency();
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
        // A link keeps counting in the histogram it had (its counts never go back).
        p.ring()
            .set_latency(l.latency.then(|| histogram.unwrap_or_default()));
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
pub(super) fn fold_removed_links(
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
pub(super) fn distribute(
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

pub(super) fn parked_slot<'a>(
    parked: &'a mut [(String, Plan)],
    name: &str,
) -> Option<&'a mut AppSlot> {
    parked
        .iter_mut()
        .flat_map(|(_, p)| p.slots.iter_mut())
        .find(|s| s.name == name)
}

pub(super) fn take_ends(s: &mut AppSlot, ends: &mut LinkEnds) {
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

pub(super) fn prepare_io(s: &mut AppSlot, graph: &Graph) {
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

pub(super) fn attach_output(s: &mut AppSlot, port: &str, p: Producer, graph: &Graph) {
    prepare_io(s, graph);
    match s.io.output_slot(port) {
        Some(i) => s.io.outputs[i] = Some(p),
        None => {
            s.io.output_names.push(port.to_string());
            s.io.outputs.push(Some(p));
        }
    }
}

pub(super) fn attach_input(s: &mut AppSlot, port: &str, c: Consumer, graph: &Graph) {
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
    use crate::app::{App, AppContext, AppError, AppType, Counter, PortSpec, Registry};

    /// Counts its breaths (`beats`): whether its worker runs.
    struct Beat(Counter);

    impl App for Beat {
        type Config = serde_json::Value;
        fn declare(_: &serde_json::Value) -> Result<PortSpec, AppError> {
            Ok(PortSpec::source())
        }
        fn new(_: serde_json::Value, ctx: &mut AppContext) -> Result<Self, AppError> {
            Ok(Beat(ctx.counter("beats")))
        }
        fn pull(&mut self, _: &mut Io) {
            self.0.add(1);
        }
    }

    fn beats(engine: &Engine, app: &str) -> u64 {
        let stats = engine.stats();
        let app = stats.apps.iter().find(|a| a.name == app).unwrap();
        app.counters["beats"]
    }

    /// Waits until `app`'s worker has breathed again.
    fn runs(engine: &Engine, app: &str) {
        let before = beats(engine, app);
        let t = Instant::now();
        while beats(engine, app) <= before {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "`{app}` no longer runs"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A registry of `beat` apps.
    fn beats_only() -> Arc<Registry> {
        let mut r = Registry::new();
        r.register(AppType::of::<Beat>("beat", "counts its breaths"));
        Arc::new(r)
    }

    #[test]
    fn a_worker_lost_while_the_second_of_three_parks_leaves_the_others_running() {
        let r = beats_only();
        let engine = Engine::new(r.clone());
        let text = "apps:\n  one: {type: beat, worker: w1}\n  two: {type: beat, worker: w2}\n  three: {type: beat, worker: w3}\n";
        let graph = Graph::parse(text, "t.yaml", Path::new("."), &r).unwrap();
        engine.apply(graph.clone()).unwrap();
        // The second worker goes as a panic outside any app would take it: its thread ends.
        let second = {
            let mut st = engine.state();
            let (name, w) = st.workers.get_index_mut(1).unwrap();
            w.park.store(true, Ordering::Release);
            drop(w.from_worker.recv().unwrap());
            w.to_worker.send(Command::Exit).unwrap();
            w.thread.take().unwrap().join().unwrap();
            name.clone()
        };
        let change = text.replace("  three:", "  four: {type: beat, worker: w1}\n  three:");
        let change = Graph::parse(&change, "t.yaml", Path::new("."), &r).unwrap();
        let err = engine.apply(change).unwrap_err();
        assert!(
            matches!(&err, EngineError::WorkerLost(w) if *w == second),
            "{err}"
        );
        // The first was parked before the second was found gone: it got its plan back; the
        // third was never parked.
        let (first, third) = {
            let st = engine.state();
            let on = |i: usize| {
                let (worker, _) = st.workers.get_index(i).unwrap();
                let app = st.apps.iter().find(|(_, a)| a.worker == *worker).unwrap();
                app.0.clone()
            };
            (on(0), on(2))
        };
        runs(&engine, &first);
        runs(&engine, &third);
        assert!(engine.graph().unwrap().apps.get("four").is_none());
        engine.stop();
    }

    #[test]
    fn after_a_panic_of_the_engine_itself_changes_are_refused_and_counters_still_read() {
        let r = beats_only();
        let engine = Arc::new(Engine::new(r.clone()));
        let text = "apps:\n  one: {type: beat}\n";
        let graph = Graph::parse(text, "t.yaml", Path::new("."), &r).unwrap();
        engine.apply(graph.clone()).unwrap();
        let e = engine.clone();
        let poisoner = std::thread::spawn(move || {
            let _st = e.state();
            panic!("the engine's own bug, with its lock held");
        });
        assert!(poisoner.join().is_err());
        let err = engine.apply(graph).unwrap_err().to_string();
        assert!(err.contains("restart the instance"), "{err}");
        runs(&engine, "one");
        assert!(engine.stop().apps.iter().any(|a| a.name == "one"));
    }
}
