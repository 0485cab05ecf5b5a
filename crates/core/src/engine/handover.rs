//! An upgrade's two halves, engine side, in the order they happen. The running engine lends
//! duplicates of each app's descriptors ([`Engine::lend_descriptors`]) and runs on while the
//! successor's engine builds the same graph on them ([`Engine::prepare_inheriting`]); then it
//! parks, lets the packets queued on its links go out and gives each app's final position,
//! counters and state ([`Engine::hand_over`]), which the successor's apps take before their
//! first breath ([`Engine::commit_inheriting`]). How the two processes talk is the caller's
//! business.

use super::apply::{check_applicable, park_workers, BuiltApps};
use super::plan::{compute_config_actions, ConfigActions};
use super::*;
use crate::app::Descriptors;
use crate::latency::LatencyCounts;
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

/// What one link leaves its successor (the link of the same spec): its counters and its
/// latency histogram's, which the successor continues from.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandedLink {
    #[serde(flatten)]
    pub counters: LinkStats,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<LatencyCounts>,
}

/// What a running engine gives its successor.
#[derive(Debug)]
pub struct HandOver {
    pub apps: BTreeMap<String, HandedApp>,
    /// Each link's counters by its spec (`a.output -> b.input`), which the successor's
    /// links continue from.
    pub links: BTreeMap<String, HandedLink>,
    /// Packets that were queued on links when the workers parked and went out before the hand-over.
    pub drained: u64,
    /// Packets still queued when draining gave up (a full interface ring, a function process
    /// that did not give its packets back): lost to the upgrade.
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
        let mut st = self.state_to_change()?;
        if st.stopped {
            return Err(EngineError::Other("the engine is stopping".into()));
        }
        let mut parked = park_workers(&mut st)?;
        let (drained, left_queued) = drain(&mut parked, DRAIN_PATIENCE);
        let (apps, unsaved) = collect(&mut parked);
        let links = (st.links.iter())
            .map(|(decl, ring)| {
                let handed = HandedLink {
                    counters: ring.stats(),
                    latency: ring.latency().map(|h| h.counts()),
                };
                (decl.spec(), handed)
            })
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
            parked.keep_parked();
        } else {
            for s in parked.iter_mut().flat_map(|(_, p)| p.slots.iter_mut()) {
                s.app.carry_on();
            }
            parked.resume()?;
        }
        Ok(taken)
    }

    /// Duplicates of every app's descriptors ([`crate::App::hand_over`]), taken with the
    /// workers parked for a moment: lent to a successor that builds its apps on them while
    /// this engine runs on; their positions are provisional until [`Engine::hand_over`].
    pub fn lend_descriptors(&self) -> Result<BTreeMap<String, (String, Descriptors)>, EngineError> {
        let mut st = self.state_to_change()?;
        if st.stopped {
            return Err(EngineError::Other("the engine is stopping".into()));
        }
        let mut parked = park_workers(&mut st)?;
        let lent = (parked.iter_mut().flat_map(|(_, p)| p.slots.iter_mut()))
            .filter(|s| !s.failed.load(Ordering::Relaxed))
            .filter_map(|s| {
                s.app.prepare_for_hand_over();
                Some((s.name.clone(), (s.kind.clone(), s.app.hand_over()?)))
            })
            .collect();
        parked.resume()?;
        Ok(lent)
    }

    /// The upgrade [`Engine::lend_descriptors`] began ends before [`Engine::hand_over`] (the
    /// successor failed or went silent): every app carries on as before.
    pub fn abandon_hand_over(&self) -> Result<(), EngineError> {
        let mut st = self.state_to_change()?;
        if st.stopped {
            return Ok(());
        }
        let mut parked = park_workers(&mut st)?;
        for s in parked.iter_mut().flat_map(|(_, p)| p.slots.iter_mut()) {
            s.app.carry_on();
        }
        parked.resume()
    }

    /// First half of taking over from another process: builds `graph`'s apps (an engine that
    /// runs nothing yet), each adopting the descriptors lent for an app of its name and type.
    /// Nothing runs until [`Engine::commit_inheriting`].
    pub fn prepare_inheriting(
        &self,
        graph: Graph,
        lent: BTreeMap<String, (String, Descriptors)>,
    ) -> Result<Prepared, EngineError> {
        let st = self.state_to_change()?;
        if st.graph.is_some() {
            return Err(EngineError::Other(
                "an engine that runs a graph cannot take another over".into(),
            ));
        }
        check_applicable(&st, &graph)?;
        let actions = compute_config_actions(None, &graph);
        *self.inheritance() = Inheritance { lent };
        let built = self.build_apps(actions.start.iter().chain(&actions.replace), &graph);
        let unused = std::mem::take(&mut self.inheritance().lent);
        Ok(Prepared {
            graph,
            actions,
            built: built?,
            unused: unused.into_keys().collect(),
        })
    }

    /// Second half: each prepared app continues its predecessor's counters, takes its final
    /// position and its state (`finals`, from [`Engine::hand_over`]), the graph starts, and
    /// links of the same spec continue their predecessors' counters. A position an app
    /// refuses fails the whole (nothing starts).
    pub fn commit_inheriting(
        &self,
        mut prepared: Prepared,
        finals: BTreeMap<String, HandedApp>,
        links: &BTreeMap<String, HandedLink>,
    ) -> Result<(ApplyReport, RestoreReport), EngineError> {
        let mut report = RestoreReport {
            gone: prepared.unused.clone(),
            ..RestoreReport::default()
        };
        for (name, handed) in finals {
            let Some((app, counters)) = (prepared.built.get_mut(&name))
                .filter(|_| prepared.graph.apps[&name].kind == handed.kind)
            else {
                report.gone.push(name);
                continue;
            };
            counters.continue_from(&handed.counters);
            if let Some(d) = handed.descriptors {
                app.take_position(d.position)
                    .map_err(|e| EngineError::Other(format!("app `{name}`: {e}")))?;
            }
            if let Some(state) = handed.state {
                match app.restore(state) {
                    Ok(()) => report.restored.push(name),
                    Err(e) => report.refused.push((name, e)),
                }
            }
        }
        let mut st = self.state_to_change()?;
        let Prepared {
            graph,
            actions,
            built,
            ..
        } = prepared;
        let applied = self.carry_out(&mut st, &actions, built, graph)?;
        drop(st);
        self.continue_link_counters(links)?;
        Ok((applied, report))
    }

    /// Adds `before`'s counters to the running links of the same spec, with the workers
    /// parked (a link's counters are written by its two ends alone while they run).
    fn continue_link_counters(
        &self,
        before: &BTreeMap<String, HandedLink>,
    ) -> Result<(), EngineError> {
        let mut st = self.state_to_change()?;
        let parked = park_workers(&mut st)?;
        for (decl, ring) in &st.links {
            let Some(b) = before.get(&decl.spec()) else {
                continue;
            };
            ring.count_on_from(&b.counters);
            if let (Some(histogram), Some(counts)) = (ring.latency(), &b.latency) {
                histogram.continue_from(counts);
            }
        }
        parked.resume()
    }

    /// What a predecessor lent (a panic while it was held leaves it as it was: still read).
    fn inheritance(&self) -> std::sync::MutexGuard<'_, Inheritance> {
        self.inheritance
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The descriptors lent for app `name` of type `kind`, if any.
    pub(super) fn inherited(&self, name: &str, kind: &str) -> Option<Descriptors> {
        let mut inheritance = self.inheritance();
        if inheritance.lent.get(name).is_some_and(|(k, _)| k == kind) {
            inheritance.lent.remove(name).map(|(_, d)| d)
        } else {
            None
        }
    }
}

/// A graph built on lent descriptors, waiting for [`Engine::commit_inheriting`].
pub struct Prepared {
    graph: Graph,
    actions: ConfigActions,
    built: BuiltApps,
    /// Lent descriptors no app of the graph took.
    unused: Vec<String>,
}

/// The descriptors lent to an engine taking over, consumed as its apps are built.
#[derive(Default)]
pub(super) struct Inheritance {
    lent: BTreeMap<String, (String, Descriptors)>,
}

/// Pushes on the parked plans, on this thread, until every link is empty and every app has
/// its packets back from outside the process ([`crate::App::outstanding`]: those apps are
/// pulled too), or `patience` has passed; returns the packets that went and those left
/// queued (on links or outside).
fn drain(parked: &mut [(String, Plan)], patience: Duration) -> (u64, u64) {
    let before = queued(parked);
    let deadline = Instant::now() + patience;
    let mut left = before;
    while left > 0 && Instant::now() < deadline {
        for (_, plan) in parked.iter_mut() {
            pull_outstanding(plan);
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
    (before.saturating_sub(left), left)
}

/// Packets on the parked plans' links, and out of the process waiting to come back.
fn queued(parked: &[(String, Plan)]) -> u64 {
    let mut rings: Vec<&Arc<Ring>> = parked.iter().flat_map(|(_, p)| &p.rings).collect();
    rings.sort_by_key(|r| Arc::as_ptr(r));
    rings.dedup_by_key(|r| Arc::as_ptr(r));
    let outside: u64 = (parked.iter().flat_map(|(_, p)| &p.slots))
        .filter(|s| !s.failed.load(Ordering::Relaxed))
        .map(|s| s.app.outstanding())
        .sum();
    rings.iter().map(|r| r.len() as u64).sum::<u64>() + outside
}

/// Pulls the apps that wait for packets from outside the process (and only those: an
/// interface pulled now would take in new traffic, which is the successor's).
fn pull_outstanding(plan: &mut Plan) {
    for s in plan.slots.iter_mut() {
        if !s.failed.load(Ordering::Relaxed) && s.app.outstanding() > 0 {
            s.guarded("pull", |a, io| a.pull(io));
        }
    }
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
        let descriptors = if failed {
            None
        } else {
            s.app.hold_for_hand_over();
            s.app.hand_over()
        };
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
