//! An upgrade's two halves, engine side. The running engine parks its workers, lets the packets
//! queued on its links go out, and gives a successor process each app's counters, state and
//! the descriptors that carry its traffic ([`Engine::hand_over`]); the successor's engine
//! builds the same graph with each app adopting what its predecessor held
//! ([`Engine::apply_inheriting`]). How the two processes talk is the caller's business.

use super::apply::{park_workers, resume_parked};
use super::*;
use crate::app::Descriptors;
use crate::link::LinkStats;
use std::collections::BTreeMap;

/// What one app leaves its successor.
#[derive(Debug)]
pub struct HandedApp {
    pub kind: String,
    /// Its counters, which the successor's app continues from (they never go backwards).
    pub counters: BTreeMap<String, u64>,
    /// Its state ([`crate::App::snapshot`]), as the state file carries it.
    pub state: Option<AppState>,
    /// Its sockets and rings ([`crate::App::hand_over`]).
    pub descriptors: Option<Descriptors>,
}

/// What a running engine gives its successor.
#[derive(Debug)]
pub struct HandOver {
    pub apps: BTreeMap<String, HandedApp>,
    /// Each link's counters by its spec (`a.output -> b.input`), which the successor's
    /// links continue from.
    pub links: BTreeMap<String, LinkStats>,
    /// Packets that were queued on links when the workers parked and went out before the hand-over.
    pub drained: u64,
    /// Packets still queued when draining gave up (a full interface ring): lost to the upgrade.
    pub left_queued: u64,
    /// Apps whose state could not be serialized, with the reason: their successors start fresh.
    pub unsaved: Vec<(String, String)>,
}

/// How long the queued packets are given to leave before the hand-over goes on without them.
const DRAIN_PATIENCE: Duration = Duration::from_millis(100);

impl Engine {
    /// Parks the workers, drains the links, and calls `give` with everything the apps hand
    /// over. When `give` returns true the successor runs the graph: the workers stay parked
    /// and nothing is stopped or closed (the process is expected to exit; apps' `stop` would
    /// undo what the successor now uses). When it returns false, the workers resume where
    /// they were — what was handed were duplicates.
    pub fn hand_over(&self, give: impl FnOnce(HandOver) -> bool) -> Result<bool, EngineError> {
        let mut st = self.state.lock().unwrap();
        if st.stopped {
            return Err(EngineError::Other("the engine is stopping".into()));
        }
        let mut parked = park_workers(&mut st)?;
        let (drained, left_queued) = drain(&mut parked, DRAIN_PATIENCE);
        let (apps, unsaved) = collect(&mut parked);
        let links = (st.links.iter())
            .map(|(decl, ring)| (decl.spec(), ring.stats()))
            .collect();
        let taken = give(HandOver {
            apps,
            links,
            drained,
            left_queued,
            unsaved,
        });
        if taken {
            st.stopped = true;
            // Dropping the apps would close what the successor shares and run teardown
            // (detaching programs, removing devices) under it.
            std::mem::forget(parked);
        } else {
            resume_parked(&st, parked)?;
        }
        Ok(taken)
    }

    /// [`Engine::apply`] for a process taking over from another: each app of `graph` with a
    /// handed-over app of the same name and type starts from its counters, adopts its
    /// descriptors in `new` and takes its state back before its first breath; links of the same
    /// spec continue their predecessors' counters.
    pub fn apply_inheriting(
        &self,
        graph: Graph,
        apps: BTreeMap<String, HandedApp>,
        links: &BTreeMap<String, LinkStats>,
    ) -> Result<(ApplyReport, RestoreReport), EngineError> {
        *self.inheritance.lock().unwrap() = Inheritance {
            apps,
            report: RestoreReport::default(),
        };
        let applied = self.apply(graph);
        let Inheritance { apps, mut report } =
            std::mem::take(&mut *self.inheritance.lock().unwrap());
        report.gone.extend(apps.into_keys());
        let applied = applied?;
        self.continue_link_counters(links)?;
        Ok((applied, report))
    }

    /// Adds `before`'s counters to the running links of the same spec, with the workers
    /// parked (a link's counters are written by its two ends alone while they run).
    fn continue_link_counters(
        &self,
        before: &BTreeMap<String, LinkStats>,
    ) -> Result<(), EngineError> {
        let mut st = self.state.lock().unwrap();
        let parked = park_workers(&mut st)?;
        for (decl, ring) in &st.links {
            if let Some(b) = before.get(&decl.spec()) {
                ring.count_on_from(b);
            }
        }
        resume_parked(&st, parked)
    }

    /// The counters and descriptors a predecessor left for app `name` of type `kind`, if any.
    pub(super) fn inherited(&self, name: &str, kind: &str) -> Option<HandedApp> {
        let mut inheritance = self.inheritance.lock().unwrap();
        if inheritance.apps.get(name).is_some_and(|h| h.kind == kind) {
            inheritance.apps.remove(name)
        } else {
            None
        }
    }

    /// Gives a just-built app its predecessor's state, noting the outcome.
    pub(super) fn restore_inherited(&self, name: &str, app: &mut dyn DynApp, state: AppState) {
        let outcome = app.restore(state);
        let mut inheritance = self.inheritance.lock().unwrap();
        match outcome {
            Ok(()) => inheritance.report.restored.push(name.to_string()),
            Err(e) => inheritance.report.refused.push((name.to_string(), e)),
        }
    }
}

/// What an engine taking over is given, consumed as its apps are built.
#[derive(Default)]
pub(super) struct Inheritance {
    apps: BTreeMap<String, HandedApp>,
    report: RestoreReport,
}

/// Pushes on the parked plans, on this thread, until every link is empty or `patience` has
/// passed; returns the packets that went and those left queued.
fn drain(parked: &mut [(String, Plan)], patience: Duration) -> (u64, u64) {
    let queued = |parked: &[(String, Plan)]| -> u64 {
        let mut rings: Vec<&Arc<Ring>> = parked.iter().flat_map(|(_, p)| &p.rings).collect();
        rings.sort_by_key(|r| Arc::as_ptr(r));
        rings.dedup_by_key(|r| Arc::as_ptr(r));
        rings.iter().map(|r| r.len() as u64).sum()
    };
    let before = queued(parked);
    let deadline = Instant::now() + patience;
    let mut left = before;
    while left > 0 && Instant::now() < deadline {
        for (_, plan) in parked.iter_mut() {
            // Past the first pass only apps whose inputs hold packets are called.
            if push_pass(plan, 1).panicked {
                plan.order = BreathOrder::of(&plan.slots);
            }
        }
        let now = queued(parked);
        if now == left {
            std::thread::sleep(Duration::from_micros(100));
        }
        left = now;
    }
    (before - left.min(before), left)
}

/// Every parked app's counters, state and descriptors.
fn collect(parked: &mut [(String, Plan)]) -> (BTreeMap<String, HandedApp>, Vec<(String, String)>) {
    let mut apps = BTreeMap::new();
    let mut unsaved = Vec::new();
    for s in parked.iter_mut().flat_map(|(_, p)| p.slots.iter_mut()) {
        let failed = s.failed.load(Ordering::Relaxed);
        let state = match s.app.snapshot().map(AppSnapshot::into_state) {
            Some(Ok(state)) if !failed => Some(state),
            Some(Err(e)) => {
                unsaved.push((s.name.clone(), e));
                None
            }
            _ => None,
        };
        let descriptors = if failed { None } else { s.app.hand_over() };
        apps.insert(
            s.name.clone(),
            HandedApp {
                kind: s.kind.clone(),
                counters: s.counters.snapshot(),
                state,
                descriptors,
            },
        );
    }
    (apps, unsaved)
}
