//! What applying a graph changes in the running one, worked out from the two documents before
//! anything is touched — Snabb's `compute_config_actions`. The engine then carries the actions
//! out ([`crate::engine::Engine::apply`]); keeping the plan pure makes it testable on its own
//! and lets a failure while carrying it out roll back to a known state.

use crate::graph::{Graph, LinkDecl};

/// The actions that turn the running graph into a new one.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ConfigActions {
    /// Apps to build before anything is touched: new names, and names whose type changed.
    pub build: Vec<String>,
    /// Running apps that leave: names no longer in the graph, and names whose type changed
    /// (their new version is in `build`). Sorted.
    pub retire: Vec<String>,
    /// Same name and type, new config: reconfigured in place, or rebuilt when the app asks.
    pub reconfigure: Vec<String>,
    /// Same name, type and config: they keep their state.
    pub keep: Vec<String>,
    /// Links of the new graph whose ends were linked the same way before: they keep their ring
    /// and queued packets, or get a ring of the new size with their packets moved over.
    pub keep_links: Vec<LinkDecl>,
    pub resize_links: Vec<LinkDecl>,
    /// Links of the new graph that are new.
    pub add_links: Vec<LinkDecl>,
    /// Links of the running graph that leave.
    pub remove_links: Vec<LinkDecl>,
}

impl ConfigActions {
    /// Whether `name` is rebuilt although an app of that name runs now (its type changed).
    pub fn replaces(&self, name: &str) -> bool {
        self.build.iter().any(|n| n == name) && self.retire.iter().any(|n| n == name)
    }
}

/// The actions from `old` (nothing running when `None`) to `new`. An app is the same app when
/// its name and type are; a link is the same link when its two ends are.
pub fn compute_config_actions(old: Option<&Graph>, new: &Graph) -> ConfigActions {
    let mut actions = ConfigActions::default();
    let old_app = |name: &str| old.and_then(|g| g.apps.get(name));
    for decl in new.apps.values() {
        match old_app(&decl.name) {
            Some(was) if was.kind == decl.kind && was.config == decl.config => {
                actions.keep.push(decl.name.clone())
            }
            Some(was) if was.kind == decl.kind => actions.reconfigure.push(decl.name.clone()),
            _ => actions.build.push(decl.name.clone()),
        }
    }
    if let Some(old) = old {
        actions.retire = old
            .apps
            .values()
            .filter(|was| {
                new.apps
                    .get(&was.name)
                    .is_none_or(|decl| decl.kind != was.kind)
            })
            .map(|was| was.name.clone())
            .collect();
        actions.retire.sort();
    }
    let old_links = old.map(|g| &g.links[..]).unwrap_or_default();
    let same_ends = |a: &LinkDecl, b: &LinkDecl| a.from == b.from && a.to == b.to;
    for l in &new.links {
        match old_links.iter().find(|was| same_ends(was, l)) {
            Some(was) if was.size.next_power_of_two() == l.size.next_power_of_two() => {
                actions.keep_links.push(l.clone())
            }
            Some(_) => actions.resize_links.push(l.clone()),
            None => actions.add_links.push(l.clone()),
        }
    }
    actions.remove_links = old_links
        .iter()
        .filter(|was| !new.links.iter().any(|l| same_ends(was, l)))
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

    #[test]
    fn a_first_graph_builds_everything() {
        let g = graph("apps: {x: {type: a}, y: {type: b}}\nlinks: [\"x.o -> y.i\"]\n");
        let act = compute_config_actions(None, &g);
        assert_eq!(act.build, ["x", "y"]);
        assert!(act.retire.is_empty() && act.keep.is_empty() && act.reconfigure.is_empty());
        assert_eq!(names(&act.add_links), ["x.o -> y.i"]);
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
        assert_eq!(act.build, ["kind", "fresh"]);
        assert_eq!(act.retire, ["gone", "kind"]);
        assert!(act.replaces("kind") && !act.replaces("fresh") && !act.replaces("gone"));
        assert_eq!(names(&act.keep_links), ["same.o -> conf.i"]);
        assert_eq!(names(&act.resize_links), ["conf.o -> kind.i"]);
        assert_eq!(names(&act.add_links), ["kind.o -> fresh.i"]);
        assert_eq!(
            names(&act.remove_links),
            ["kind.o -> gone.i", "same.p -> kind.q"]
        );
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
        assert_eq!(names(&act.keep_links), ["x.o -> y.i"]);
        assert!(act.resize_links.is_empty());
    }
}
