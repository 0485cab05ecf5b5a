//! What applying a graph changes in the running one, worked out from the two documents before
//! anything is touched — Snabb's `compute_config_actions`. The engine then carries the actions
//! out ([`crate::engine::Engine::apply`]); keeping the plan pure makes it testable on its own
//! and lets a failure while carrying it out roll back to a known state.

use crate::graph::{Endpoint, Graph, LinkDecl};
use std::collections::{HashMap, HashSet};

/// The actions that turn the running graph into a new one.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ConfigActions {
    /// New names: built before anything is touched.
    pub start: Vec<String>,
    /// Names whose type changed: the new app is built before anything is touched, the running
    /// one stops.
    pub replace: Vec<String>,
    /// Names no longer in the graph. Sorted.
    pub stop: Vec<String>,
    /// Same name and type, new config: reconfigured in place, or rebuilt when the app asks.
    pub reconfigure: Vec<String>,
    /// Same name, type and config: they keep their state.
    pub keep: Vec<String>,
    /// Every link of the new graph, in its order, with what becomes of it.
    pub links: Vec<(LinkDecl, LinkAction)>,
    /// Links of the running graph that leave.
    pub remove_links: Vec<LinkDecl>,
    /// Apps that stay (kept, reconfigured or rebuilt) but run on another worker: they move
    /// with their state and queued packets while the workers are parked.
    pub change_worker: Vec<WorkerMove>,
}

/// An app that changes worker.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WorkerMove {
    pub app: String,
    pub from: String,
    pub to: String,
}

/// What becomes of a link of the new graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkAction {
    /// Its ends were linked the same way, with a ring of the same size: it keeps its ring and
    /// queued packets.
    Keep,
    /// Its ends were linked the same way with another size: its packets move to a new ring.
    Resize,
    /// A new link.
    Add,
}

/// The actions from `old` (nothing running when `None`) to `new`. An app is the same app when
/// its name and type are; a link is the same link when its two ends are.
pub fn compute_config_actions(old: Option<&Graph>, new: &Graph) -> ConfigActions {
    let mut actions = ConfigActions::default();
    for decl in new.apps.values() {
        let name = decl.name.clone();
        match old.and_then(|g| g.apps.get(&decl.name)) {
            None => actions.start.push(name),
            // Another type, or another shard of another number of shards: a new instance.
            Some(was) if was.kind != decl.kind || was.shard != decl.shard => {
                actions.replace.push(name)
            }
            Some(was) if was.config == decl.config => actions.keep.push(name),
            Some(_) => actions.reconfigure.push(name),
        }
    }
    let Some(old) = old else {
        actions.links = (new.links.iter())
            .map(|l| (l.clone(), LinkAction::Add))
            .collect();
        return actions;
    };
    actions.stop = (old.apps.keys())
        .filter(|name| !new.apps.contains_key(*name))
        .cloned()
        .collect();
    actions.stop.sort();
    actions.change_worker = (new.apps.values())
        .filter_map(|decl| {
            let was = old.apps.get(&decl.name)?;
            (was.kind == decl.kind && was.worker != decl.worker).then(|| WorkerMove {
                app: decl.name.clone(),
                from: was.worker.clone(),
                to: decl.worker.clone(),
            })
        })
        .collect();
    fn ends(l: &LinkDecl) -> (&Endpoint, &Endpoint) {
        (&l.from, &l.to)
    }
    let old_sizes: HashMap<_, usize> = old.links.iter().map(|l| (ends(l), l.size)).collect();
    for l in &new.links {
        let action = match old_sizes.get(&ends(l)) {
            Some(was) if was.next_power_of_two() == l.size.next_power_of_two() => LinkAction::Keep,
            Some(_) => LinkAction::Resize,
            None => LinkAction::Add,
        };
        actions.links.push((l.clone(), action));
    }
    let new_ends: HashSet<_> = new.links.iter().map(ends).collect();
    actions.remove_links = (old.links.iter())
        .filter(|was| !new_ends.contains(&ends(was)))
        .cloned()
        .collect();
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::{App, AppContext, AppError, AppType, PortNames, PortSpec, Registry};

    struct Nop;
    impl App for Nop {
        type Config = serde_json::Value;
        fn declare(_: &serde_json::Value) -> Result<PortSpec, AppError> {
            Ok(PortSpec {
                inputs: PortNames::Any,
                outputs: PortNames::Any,
            })
        }
        fn new(_: serde_json::Value, _: &mut AppContext) -> Result<Self, AppError> {
            Ok(Nop)
        }
    }

    fn graph(text: &str) -> Graph {
        let mut r = Registry::new();
        r.register(AppType::of::<Nop>("a", "test app"));
        r.register(AppType::of::<Nop>("b", "test app"));
        Graph::parse(text, "t.yaml", std::path::Path::new("."), &r).unwrap()
    }

    fn names(links: &[LinkDecl]) -> Vec<String> {
        links.iter().map(LinkDecl::spec).collect()
    }

    fn with(act: &ConfigActions, action: LinkAction) -> Vec<String> {
        (act.links.iter())
            .filter(|(_, a)| *a == action)
            .map(|(l, _)| l.spec())
            .collect()
    }

    #[test]
    fn a_first_graph_builds_everything() {
        let g = graph("apps: {x: {type: a}, y: {type: b}}\nlinks: [\"x.o -> y.i\"]\n");
        let act = compute_config_actions(None, &g);
        assert_eq!(act.start, ["x", "y"]);
        assert!(act.replace.is_empty() && act.stop.is_empty());
        assert!(act.keep.is_empty() && act.reconfigure.is_empty());
        assert_eq!(with(&act, LinkAction::Add), ["x.o -> y.i"]);
    }

    #[test]
    fn each_app_and_link_gets_the_action_its_change_needs() {
        let old = graph(
            "apps:\n  same: {type: a, k: 1}\n  conf: {type: a, k: 1}\n  kind: {type: a}\n  gone: {type: b}\nlinks:\n  - same.o -> conf.i\n  - conf.o -> kind.i\n  - kind.o -> gone.i\n  - same.p -> kind.q\n",
        );
        let new = graph(
            "apps:\n  same: {type: a, k: 1}\n  conf: {type: a, k: 2}\n  kind: {type: b}\n  fresh: {type: a}\nlinks:\n  - same.o -> conf.i\n  - {link: conf.o -> kind.i, size: 4096}\n  - kind.o -> fresh.i\n",
        );
        let act = compute_config_actions(Some(&old), &new);
        assert_eq!(act.keep, ["same"]);
        assert_eq!(act.reconfigure, ["conf"]);
        assert_eq!(act.start, ["fresh"]);
        assert_eq!(act.replace, ["kind"]);
        assert_eq!(act.stop, ["gone"]);
        assert_eq!(with(&act, LinkAction::Keep), ["same.o -> conf.i"]);
        assert_eq!(with(&act, LinkAction::Resize), ["conf.o -> kind.i"]);
        assert_eq!(with(&act, LinkAction::Add), ["kind.o -> fresh.i"]);
        assert_eq!(
            names(&act.remove_links),
            ["kind.o -> gone.i", "same.p -> kind.q"]
        );
    }

    #[test]
    fn an_app_on_another_worker_is_kept_and_said_to_move() {
        let old = graph("apps: {x: {type: a}, y: {type: a, worker: w1}}\nlinks: []\n");
        let new = graph("apps: {x: {type: a, worker: w2}, y: {type: a}}\nlinks: []\n");
        let act = compute_config_actions(Some(&old), &new);
        assert_eq!(act.keep, ["x", "y"]);
        let moves: Vec<(&str, &str, &str)> = (act.change_worker.iter())
            .map(|m| (m.app.as_str(), m.from.as_str(), m.to.as_str()))
            .collect();
        assert_eq!(moves, [("x", "main", "w2"), ("y", "w1", "main")]);
    }

    #[test]
    fn a_size_that_rounds_to_the_same_ring_keeps_the_link() {
        let old = graph(
            "apps: {x: {type: a}, y: {type: a}}\nlinks:\n  - {link: x.o -> y.i, size: 1000}\n",
        );
        let new = graph(
            "apps: {x: {type: a}, y: {type: a}}\nlinks:\n  - {link: x.o -> y.i, size: 1024}\n",
        );
        let act = compute_config_actions(Some(&old), &new);
        assert_eq!(with(&act, LinkAction::Keep), ["x.o -> y.i"]);
        assert!(with(&act, LinkAction::Resize).is_empty());
    }
}
