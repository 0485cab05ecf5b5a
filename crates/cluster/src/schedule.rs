//! The placement controller's decision, as a pure function: from the cluster's graphs, its
//! hosts (registered and live) and the previous decision, where each app runs, which links
//! become VXLAN tunnels (with which VNI), and the graph document each host runs.
//!
//! An app stays where it was while its host is live and still eligible (pins, labels, the
//! placement it asks for), so a change elsewhere moves nothing; otherwise it goes to the
//! eligible live host with the fewest apps. An app pinned to a host whose agent is gone stays
//! assigned there (`host-down`): the host may still be forwarding, so the tunnels toward it
//! stay. A link's VNI stays with the link while its graph exists, whichever hosts it joins.

use crate::keys::{AppPlace, Assignment, HostRecord, PlacementRecord, Tunnel};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use stitch_place::{AppPlacement, PlacedGraph};

/// VNIs the controller gives links: from here up (lower ones are left to hand-made tunnels).
pub const FIRST_VNI: u32 = 4096;
const LAST_VNI: u32 = (1 << 24) - 1;
/// Apps the controller adds to a host's graph are named with this prefix; graphs may not use it.
pub const RESERVED_PREFIX: &str = "cluster-";

/// One graph of the cluster: its name, the revision of its record and the parsed graph.
pub struct ClusterGraph {
    pub name: String,
    pub revision: i64,
    pub graph: PlacedGraph,
}

/// The hosts as the controller sees them.
#[derive(Default)]
pub struct Hosts {
    pub registered: BTreeMap<String, HostRecord>,
    /// Hosts whose agent holds its liveness lease.
    pub live: BTreeSet<String>,
}

/// The decision: a placement per graph and a graph document per registered host.
#[derive(Debug, Default, PartialEq)]
pub struct Schedule {
    pub placements: BTreeMap<String, PlacementRecord>,
    pub assignments: BTreeMap<String, Assignment>,
}

/// Why `app` (whose entry is `config`) may not run on `host`, if it may not.
fn ineligible(
    app: &AppPlacement,
    config: &serde_json::Value,
    name: &str,
    host: &HostRecord,
) -> Option<String> {
    unfit(app, name, host).or_else(|| not_allowed(app, config, name, host))
}

/// Why `app` does not fit `host` by its pin, labels and placement, if it does not.
fn unfit(app: &AppPlacement, name: &str, host: &HostRecord) -> Option<String> {
    if app.host.as_deref().is_some_and(|pin| pin != name) {
        return Some("pinned elsewhere".into());
    }
    for (label, value) in &app.hosts {
        if host.labels.get(label) != Some(value) {
            return Some(format!("label {label}={value} not on {name}"));
        }
    }
    let placement = app.placement.name();
    if !host.placements.iter().any(|p| p == placement) {
        return Some(format!("{name} cannot run `placement: {placement}`"));
    }
    None
}

/// Why `host`'s allow file refuses `app`, if it does.
fn not_allowed(
    app: &AppPlacement,
    config: &serde_json::Value,
    name: &str,
    host: &HostRecord,
) -> Option<String> {
    host.allowed
        .refusal_for_placement(app.placement.name(), config)
        .map(|why| format!("{name}: {why}"))
}

/// Each app (by graph and name) → the apps it has a link with.
fn linked_apps(graphs: &[ClusterGraph]) -> BTreeMap<(&str, &str), Vec<&str>> {
    let mut linked: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for g in graphs {
        for l in &g.graph.graph.links {
            linked
                .entry((g.name.as_str(), l.from.app.as_str()))
                .or_default()
                .push(&l.to.app);
            linked
                .entry((g.name.as_str(), l.to.app.as_str()))
                .or_default()
                .push(&l.from.app);
        }
    }
    linked
}

/// Where each app runs.
fn place_apps(
    graphs: &[ClusterGraph],
    hosts: &Hosts,
    previous: &BTreeMap<String, PlacementRecord>,
) -> BTreeMap<String, BTreeMap<String, AppPlace>> {
    let mut load: BTreeMap<&str, usize> = hosts.live.iter().map(|h| (h.as_str(), 0)).collect();
    let mut out: BTreeMap<String, BTreeMap<String, AppPlace>> = BTreeMap::new();
    let mut waiting = Vec::new();
    // First what stays: pins, and apps whose host is live and still eligible.
    for g in graphs {
        let places = out.entry(g.name.clone()).or_default();
        for (name, app) in &g.graph.apps {
            let config = &g.graph.graph.apps[name].config;
            let was = previous
                .get(&g.name)
                .and_then(|p| p.apps.get(name))
                .and_then(|p| p.host.clone());
            let place = if let Some(pin) = &app.host {
                match hosts.registered.get(pin) {
                    None => Some(unplaced(format!("host `{pin}` is not in the cluster"))),
                    Some(record) => match ineligible(app, config, pin, record) {
                        Some(why) => Some(unplaced(why)),
                        None if hosts.live.contains(pin) => Some(running(pin)),
                        None => Some(AppPlace {
                            host: Some(pin.clone()),
                            state: "host-down".into(),
                            reason: Some(format!("the agent of `{pin}` is not live")),
                        }),
                    },
                }
            } else {
                was.filter(|h| {
                    hosts.live.contains(h)
                        && hosts
                            .registered
                            .get(h)
                            .is_some_and(|r| ineligible(app, config, h, r).is_none())
                })
                .map(|h| running(&h))
            };
            match place {
                Some(p) => {
                    if p.state == "running" {
                        if let Some(n) = p.host.as_deref().and_then(|h| load.get_mut(h)) {
                            *n += 1;
                        }
                    }
                    places.insert(name.clone(), p);
                }
                None => waiting.push((g, name, app)),
            }
        }
    }
    // Then the rest: beside an app it is linked with while that host has less than its fair
    // share (fewer tunnels), else on the eligible live host with the fewest apps.
    let total: usize = graphs.iter().map(|g| g.graph.apps.len()).sum();
    let fair = total.div_ceil(hosts.live.len().max(1));
    let linked = linked_apps(graphs);
    for (g, name, app) in waiting {
        let config = &g.graph.graph.apps[name].config;
        let eligible: Vec<&str> = load
            .keys()
            .copied()
            .filter(|h| {
                hosts
                    .registered
                    .get(*h)
                    .is_some_and(|r| ineligible(app, config, h, r).is_none())
            })
            .collect();
        let placed = &out[&g.name];
        let beside = linked
            .get(&(g.name.as_str(), name.as_str()))
            .into_iter()
            .flatten()
            .filter_map(|n| placed.get(*n).and_then(|p| p.host.as_deref()))
            .find(|h| eligible.contains(h) && load[h] < fair)
            .map(String::from);
        let choice = beside.or_else(|| {
            eligible
                .iter()
                .min_by_key(|h| (load[**h], **h))
                .map(|h| h.to_string())
        });
        let place = match choice {
            Some(h) => {
                *load.get_mut(h.as_str()).expect("a live host") += 1;
                running(&h)
            }
            None if hosts.live.is_empty() => unplaced("no host is live".into()),
            None => match allow_refusal(app, config, hosts) {
                // Hosts it fits refuse it by their allow files: say so, with the first's reason.
                Some(why) => unplaced(format!("no live host allows it: {why}")),
                None if app.hosts.is_empty() => unplaced(format!(
                    "no live host runs `placement: {}`",
                    app.placement.name()
                )),
                None => unplaced(format!("no live host has the labels {:?}", app.hosts)),
            },
        };
        out.get_mut(&g.name)
            .expect("every graph has its map")
            .insert(name.clone(), place);
    }
    out
}

/// Why the first live host that `app` fits refuses it by its allow file, if one does.
fn allow_refusal(app: &AppPlacement, config: &serde_json::Value, hosts: &Hosts) -> Option<String> {
    hosts
        .live
        .iter()
        .filter_map(|h| hosts.registered.get(h).map(|r| (h, r)))
        .filter(|(h, r)| unfit(app, h, r).is_none())
        .find_map(|(h, r)| not_allowed(app, config, h, r))
}

fn running(host: &str) -> AppPlace {
    AppPlace {
        host: Some(host.to_string()),
        state: "running".into(),
        reason: None,
    }
}

fn unplaced(reason: String) -> AppPlace {
    AppPlace {
        host: None,
        state: "unplaced".into(),
        reason: Some(reason),
    }
}

/// The tunnels of every graph: each link whose ends are placed on different hosts, with the
/// VNI it had or the lowest free one.
fn tunnels(
    graphs: &[ClusterGraph],
    apps: &BTreeMap<String, BTreeMap<String, AppPlace>>,
    previous: &BTreeMap<String, PlacementRecord>,
) -> BTreeMap<String, Vec<Tunnel>> {
    let mut used: BTreeSet<u32> = BTreeSet::new();
    let mut known: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    for g in graphs {
        for t in previous.get(&g.name).map(|p| &p.tunnels[..]).unwrap_or(&[]) {
            if used.insert(t.vni) {
                known.insert((g.name.as_str(), t.link.as_str()), t.vni);
            }
        }
    }
    let mut next = FIRST_VNI;
    let mut out = BTreeMap::new();
    for g in graphs {
        let mut list = Vec::new();
        for l in &g.graph.graph.links {
            let host = |app: &str| apps[&g.name].get(app).and_then(|p| p.host.clone());
            let (Some(from), Some(to)) = (host(&l.from.app), host(&l.to.app)) else {
                continue;
            };
            if from == to {
                continue;
            }
            let link = l.spec();
            let vni = match known.get(&(g.name.as_str(), link.as_str())) {
                Some(v) => *v,
                None => {
                    while used.contains(&next) && next < LAST_VNI {
                        next += 1;
                    }
                    used.insert(next);
                    next
                }
            };
            list.push(Tunnel {
                link,
                vni,
                from_host: from,
                to_host: to,
            });
        }
        out.insert(g.name.clone(), list);
    }
    out
}

/// Computes where everything runs and what each registered host's graph is. A host whose
/// graph document comes out as in `assigned` keeps that assignment as it is (no write).
pub fn schedule(
    graphs: &[ClusterGraph],
    hosts: &Hosts,
    previous: &BTreeMap<String, PlacementRecord>,
    assigned: &BTreeMap<String, Assignment>,
) -> Schedule {
    let apps = place_apps(graphs, hosts, previous);
    let mut tunnels = tunnels(graphs, &apps, previous);
    let mut placements = BTreeMap::new();
    for g in graphs {
        placements.insert(
            g.name.clone(),
            PlacementRecord {
                graph_revision: g.revision,
                error: None,
                apps: apps[&g.name].clone(),
                tunnels: tunnels.remove(&g.name).unwrap_or_default(),
                hosts: BTreeMap::new(),
            },
        );
    }
    // Each graph in its document shape once, not once per host.
    let documents: Vec<Value> = graphs.iter().map(|g| g.graph.to_document()).collect();
    let assignments: BTreeMap<String, Assignment> = hosts
        .registered
        .keys()
        .map(|h| {
            let new = host_assignment(h, graphs, &documents, &placements, hosts);
            // A host whose part is what it runs keeps its assignment, revisions and all: it
            // is not written again, and its agent does not apply it again.
            let kept = assigned.get(h).filter(|old| old.same_part(&new));
            (h.clone(), kept.cloned().unwrap_or(new))
        })
        .collect();
    for (host, a) in &assignments {
        for (graph, revision) in &a.graphs {
            if let Some(p) = placements.get_mut(graph) {
                p.hosts.insert(host.clone(), *revision);
            }
        }
    }
    Schedule {
        placements,
        assignments,
    }
}

/// The graph document host `me` runs: its apps, the links between them, and for each other
/// host it exchanges tunnelled links with, a `vxlan` app (one segment per link) and an
/// `af_packet` app on the underlay interface that takes only that host's VXLAN packets.
fn host_assignment(
    me: &str,
    graphs: &[ClusterGraph],
    documents: &[Value],
    placements: &BTreeMap<String, PlacementRecord>,
    hosts: &Hosts,
) -> Assignment {
    let mut apps = Map::new();
    let mut links = Vec::new();
    let mut workers = Map::new();
    let mut engine = None;
    let mut graph_revisions = BTreeMap::new();
    // Remote host → its segments (VNI) and the links through them.
    let mut segments: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for (g, doc) in graphs.iter().zip(documents) {
        let place = &placements[&g.name];
        let here = |app: &str| {
            place
                .apps
                .get(app)
                .is_some_and(|p| p.host.as_deref() == Some(me))
        };
        let mut any = false;
        for (name, entry) in doc["apps"].as_object().into_iter().flatten() {
            if !here(name) {
                continue;
            }
            any = true;
            let mut entry = entry.clone();
            if let Some(e) = entry.as_object_mut() {
                e.remove("host");
                e.remove("hosts");
                if let Some(w) = e.get("worker").and_then(Value::as_str) {
                    if let Some(cfg) = doc["workers"].get(w) {
                        workers.insert(w.to_string(), cfg.clone());
                    }
                }
            }
            apps.insert(name.clone(), entry);
        }
        if any {
            engine.get_or_insert_with(|| doc["engine"].clone());
        }
        for l in &g.graph.graph.links {
            if here(&l.from.app) && here(&l.to.app) {
                links.push(link_entry(
                    &l.spec(),
                    l.size,
                    g.graph.graph.engine.link_size,
                ));
            }
        }
        any |= tunnel_ends(me, place, hosts, &mut segments, &mut links);
        if any {
            graph_revisions.insert(g.name.clone(), g.revision);
        }
    }
    if let Some(mine) = hosts.registered.get(me) {
        for (remote, segs) in segments {
            add_tunnel_endpoint(mine, &remote, segs, hosts, &mut apps, &mut links);
        }
    }
    let mut document = json!({ "apps": apps, "links": links, "workers": workers });
    if let Some(e) = engine {
        document["engine"] = e;
    }
    Assignment {
        graphs: graph_revisions,
        document,
        workload_mtu: workload_mtu(hosts.registered.values()),
    }
}

/// The ends on host `me` of graph placement `place`'s tunnels: for each, a segment of the
/// `vxlan` app toward the other host (in `segments`) and the link to or from it (in `links`).
/// Returns whether there was any.
fn tunnel_ends(
    me: &str,
    place: &PlacementRecord,
    hosts: &Hosts,
    segments: &mut BTreeMap<String, Map<String, Value>>,
    links: &mut Vec<Value>,
) -> bool {
    let mut any = false;
    for t in &place.tunnels {
        let (from, to) = t.link.split_once(" -> ").expect("a link spec");
        let (remote, entry) = if t.from_host == me {
            (
                &t.to_host,
                format!("{from} -> {}.v{}", vtep(&t.to_host), t.vni),
            )
        } else if t.to_host == me {
            (
                &t.from_host,
                format!("{}.v{} -> {to}", vtep(&t.from_host), t.vni),
            )
        } else {
            continue;
        };
        let Some(record) = hosts.registered.get(remote) else {
            continue;
        };
        let mut segment = json!({ "vni": t.vni, "remote": record.underlay });
        // ICMP errors about a link's frames (too big for the tunnel) go back to their
        // sender by the tunnel of the link the other way, when the graph has one.
        let reverse = place.tunnels.iter().find(|r| {
            r.link == format!("{to} -> {from}")
                && r.from_host == t.to_host
                && r.to_host == t.from_host
        });
        if let (Some(r), true) = (reverse, t.from_host == me) {
            segment["reply_via"] = json!(format!("v{}", r.vni));
        }
        segments
            .entry(remote.clone())
            .or_default()
            .insert(format!("v{}", t.vni), segment);
        links.push(json!(entry));
        any = true;
    }
    any
}

/// The largest IP packet that crosses every tunnel the cluster's hosts can make: each host's
/// underlay MTU less the encapsulation, the smallest of them.
pub fn workload_mtu<'a>(hosts: impl IntoIterator<Item = &'a HostRecord>) -> Option<u32> {
    hosts
        .into_iter()
        .map(|h| h.mtu.saturating_sub(h.tunnel_overhead()))
        .min()
}

/// Toward `remote`: a `vxlan` app holding the segments of the links to it, and an
/// `af_packet` app on this host's underlay interface that takes only `remote`'s VXLAN packets.
fn add_tunnel_endpoint(
    mine: &HostRecord,
    remote: &str,
    segs: Map<String, Value>,
    hosts: &Hosts,
    apps: &mut Map<String, Value>,
    links: &mut Vec<Value>,
) {
    let theirs = &hosts.registered[remote];
    apps.insert(
        vtep(remote),
        json!({
            "type": "vxlan",
            "local": mine.underlay,
            "local_mac": mine.mac,
            "next_hop_mac": theirs.mac,
            "mtu": mine.mtu.min(theirs.mtu),
            "segments": segs,
        }),
    );
    apps.insert(
        underlay(remote),
        json!({
            "type": "af_packet",
            "interface": mine.interface,
            "promisc": false,
            "filter": format!(
                "udp dst port 4789 and src host {} and dst host {}",
                theirs.underlay, mine.underlay
            ),
        }),
    );
    links.push(json!(format!(
        "{}.underlay -> {}.input",
        vtep(remote),
        underlay(remote)
    )));
    links.push(json!(format!(
        "{}.output -> {}.underlay",
        underlay(remote),
        vtep(remote)
    )));
}

fn link_entry(spec: &str, size: usize, default: usize) -> Value {
    if size == default {
        json!(spec)
    } else {
        json!({ "link": spec, "size": size })
    }
}

/// The `vxlan` app toward `remote`.
pub fn vtep(remote: &str) -> String {
    format!("{RESERVED_PREFIX}vtep-{remote}")
}

/// The `af_packet` app on the underlay that carries the tunnels of `remote`.
pub fn underlay(remote: &str) -> String {
    format!("{RESERVED_PREFIX}underlay-{remote}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn registry() -> stitch_core::Registry {
        let mut r = stitch_core::Registry::new();
        stitch_apps::register(&mut r);
        stitch_io::register(&mut r);
        r
    }

    fn host(n: u8, labels: &[(&str, &str)]) -> HostRecord {
        HostRecord {
            underlay: format!("192.0.2.{n}").parse().unwrap(),
            interface: "ul0".into(),
            mac: format!("02:00:00:00:00:0{n}"),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            placements: vec!["engine".into(), "process".into()],
            probe_port: 0,
            mtu: 1500,
            allowed: Default::default(),
        }
    }

    fn hosts(live: &[&str]) -> Hosts {
        let mut h = Hosts::default();
        h.registered.insert("h1".into(), host(1, &[("zone", "a")]));
        h.registered.insert("h2".into(), host(2, &[("zone", "b")]));
        h.registered.insert("h3".into(), host(3, &[("zone", "b")]));
        h.live = live.iter().map(|s| s.to_string()).collect();
        h
    }

    fn graph(text: &str) -> ClusterGraph {
        ClusterGraph {
            name: "chain".into(),
            revision: 7,
            graph: PlacedGraph::parse(text, "chain.yaml", Path::new("."), &registry()).unwrap(),
        }
    }

    const CHAIN: &str = "apps:\n  a: { type: forwarder, host: h1 }\n  b: { type: forwarder, hosts: { zone: b } }\n  c: { type: forwarder, host: h3 }\nlinks:\n  - \"a.output -> b.input\"\n  - \"b.output -> c.input\"\n  - \"c.output -> a.input\"\n";

    /// A new revision that changes one host's app leaves the other hosts' assignments as they
    /// were (their recorded revision included), so nothing is written for them.
    #[test]
    fn a_change_on_one_host_leaves_the_others_assignments_alone() {
        let live = hosts(&["h1", "h2", "h3"]);
        let first = schedule(&[graph(CHAIN)], &live, &BTreeMap::new(), &BTreeMap::new());
        let mut changed = graph(&CHAIN.replace(
            "c: { type: forwarder, host: h3 }",
            "c: { type: rate_meter, host: h3 }",
        ));
        changed.revision = 8;
        let second = schedule(&[changed], &live, &first.placements, &first.assignments);
        assert_eq!(second.assignments["h1"], first.assignments["h1"]);
        assert_eq!(second.assignments["h2"], first.assignments["h2"]);
        assert_eq!(second.assignments["h1"].graphs["chain"], 7);
        assert_ne!(second.assignments["h3"], first.assignments["h3"]);
        assert_eq!(second.assignments["h3"].graphs["chain"], 8);
        // What `apply --wait` waits for: h3 at 8, the others at what they run.
        let hosts = &second.placements["chain"].hosts;
        assert_eq!((hosts["h1"], hosts["h2"], hosts["h3"]), (7, 7, 8));
    }

    #[test]
    fn pins_and_labels_place_apps_and_cross_host_links_become_tunnels() {
        let g = [graph(CHAIN)];
        let s = schedule(
            &g,
            &hosts(&["h1", "h2", "h3"]),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        let p = &s.placements["chain"];
        assert_eq!(p.apps["a"].host.as_deref(), Some("h1"));
        // h2 and h3 match zone=b; h3 already runs c, so b goes to h2.
        assert_eq!(p.apps["b"].host.as_deref(), Some("h2"));
        assert_eq!(p.tunnels.len(), 3);
        let vnis: BTreeSet<u32> = p.tunnels.iter().map(|t| t.vni).collect();
        assert_eq!(vnis.len(), 3);
        assert!(vnis.iter().all(|v| *v >= FIRST_VNI));
        let h1 = &s.assignments["h1"].document;
        assert!(
            h1["apps"]["a"].get("host").is_none(),
            "pins are not passed on"
        );
        assert_eq!(
            h1["apps"]["cluster-vtep-h2"]["next_hop_mac"],
            "02:00:00:00:00:02"
        );
        assert_eq!(h1["apps"]["cluster-vtep-h2"]["local"], "192.0.2.1");
        assert_eq!(
            h1["apps"]["cluster-underlay-h3"]["filter"],
            "udp dst port 4789 and src host 192.0.2.3 and dst host 192.0.2.1"
        );
        let links: Vec<&str> = h1["links"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let ab = p
            .tunnels
            .iter()
            .find(|t| t.link == "a.output -> b.input")
            .unwrap();
        assert!(links.contains(&format!("a.output -> cluster-vtep-h2.v{}", ab.vni).as_str()));
        assert_eq!(s.assignments["h1"].graphs["chain"], 7);
        // Every host document is a graph the parser takes.
        for a in s.assignments.values() {
            let text = serde_json::to_string(&a.document).unwrap();
            if let Err(e) = PlacedGraph::parse(&text, "doc", Path::new("."), &registry()) {
                panic!("{e}\n{text}");
            }
        }
    }

    #[test]
    fn tunnels_carry_the_smaller_mtu_and_answer_by_the_link_the_other_way() {
        let g = [graph("apps:\n  a: { type: firewall, host: h1 }\n  b: { type: firewall, host: h2 }\nlinks:\n  - \"a.wan -> b.lan\"\n  - \"b.lan -> a.wan\"\n")];
        let mut h = hosts(&["h1", "h2", "h3"]);
        h.registered.get_mut("h2").unwrap().mtu = 9000;
        h.registered.get_mut("h3").unwrap().mtu = 1400;
        let s = schedule(&g, &h, &BTreeMap::new(), &BTreeMap::new());
        let vni = |link: &str| {
            s.placements["chain"]
                .tunnels
                .iter()
                .find(|t| t.link == link)
                .unwrap()
                .vni
        };
        let (there, back) = (vni("a.wan -> b.lan"), vni("b.lan -> a.wan"));
        let vtep = &s.assignments["h1"].document["apps"]["cluster-vtep-h2"];
        assert_eq!(vtep["mtu"], 1500, "the smaller of 1500 and 9000");
        assert_eq!(
            vtep["segments"][format!("v{there}")]["reply_via"],
            format!("v{back}")
        );
        assert!(vtep["segments"][format!("v{back}")]
            .get("reply_via")
            .is_none());
        assert_eq!(
            s.assignments["h1"].workload_mtu,
            Some(1350),
            "h3's 1400 less 50 bounds every host's workloads"
        );
        let text = serde_json::to_string(&s.assignments["h1"].document).unwrap();
        PlacedGraph::parse(&text, "doc", Path::new("."), &registry()).unwrap();
    }

    #[test]
    fn a_dead_hosts_unpinned_apps_move_and_keep_their_vnis_while_pins_stay() {
        let g = [graph(CHAIN)];
        let before = schedule(
            &g,
            &hosts(&["h1", "h2", "h3"]),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        let after = schedule(
            &g,
            &hosts(&["h1", "h3"]),
            &before.placements,
            &before.assignments,
        );
        let p = &after.placements["chain"];
        assert_eq!(
            p.apps["b"].host.as_deref(),
            Some("h3"),
            "b moves to the other zone-b host"
        );
        let vni = |s: &Schedule, link: &str| {
            s.placements["chain"]
                .tunnels
                .iter()
                .find(|t| t.link == link)
                .map(|t| t.vni)
        };
        assert_eq!(
            vni(&after, "a.output -> b.input"),
            vni(&before, "a.output -> b.input")
        );
        assert_eq!(
            vni(&after, "b.output -> c.input"),
            None,
            "b and c share h3 now"
        );
        // h3 dies too: c is pinned, so it stays there, reported, with its tunnels.
        let later = schedule(&g, &hosts(&["h1"]), &after.placements, &after.assignments);
        let c = &later.placements["chain"].apps["c"];
        assert_eq!(
            (c.host.as_deref(), c.state.as_str()),
            (Some("h3"), "host-down")
        );
        assert_eq!(later.placements["chain"].apps["b"].state, "unplaced");
        assert!(later.placements["chain"]
            .tunnels
            .iter()
            .any(|t| t.link == "c.output -> a.input"));
        // An unrelated change moves nothing.
        let again = schedule(
            &g,
            &hosts(&["h1", "h2", "h3"]),
            &after.placements,
            &after.assignments,
        );
        assert_eq!(
            again.placements["chain"].apps["b"].host.as_deref(),
            Some("h3")
        );
    }
}
