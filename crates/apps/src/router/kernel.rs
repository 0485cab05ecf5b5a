//! A kernel routing table followed from netlink messages (a `kernel_routes` app's output on the
//! router's `kernel` input): the routes a daemon installs in Linux — FRR's zebra, BIRD's kernel
//! protocol, `ip route` — become the router's, as VPP's linux-cp copies them into its FIB.
//!
//! Kept here: the interfaces by number (routes name them so), nexthop objects (FRR installs
//! routes through them), and each prefix's routes of the followed table by metric. A dump of a
//! kind — announced by its request, ended by `NLMSG_DONE` — is the whole table of that kind:
//! what it did not mention is forgotten at its end. [`KernelTable::resolved`] gives each
//! prefix's route of the lowest metric as ways out of the router's interfaces: out of the
//! interface named as the route's (its host side has the interface's name), or else the one
//! whose subnet holds the gateway.

use std::collections::HashMap;
use std::net::IpAddr;
use stitch_wire::netlink::{self, kind, Change, Link, Malformed, Nexthop, Path, Route};

/// Generations of the three kinds of object a dump refreshes.
#[derive(Default)]
struct Generations {
    links: u64,
    nexthops: u64,
    routes: u64,
}

struct Entry {
    route: Route,
    /// The dump (or later change) that last told of it.
    generation: u64,
}

#[derive(Default)]
pub(super) struct KernelTable {
    table: u32,
    links: HashMap<u32, (Link, u64)>,
    nexthops: HashMap<u32, (Nexthop, u64)>,
    /// Each prefix's routes in the table, one per metric.
    routes: HashMap<(IpAddr, u8), Vec<Entry>>,
    generation: u64,
    /// When each kind's dump under way began: `(kind, seq, generation)`.
    dumping: Option<(u16, u32, u64)>,
    /// The generation every object of a kind was last refreshed from (a finished dump).
    swept: Generations,
    /// Routes changed since [`KernelTable::take_dirty`].
    dirty: bool,
    pub(super) messages: u64,
    pub(super) malformed: u64,
    pub(super) refused_dumps: u64,
}

/// A way out resolved to one of the router's interfaces: `(port, gateway, weight)`.
pub(super) type Way = (usize, Option<IpAddr>, u16);

/// Each prefix `(address, length)` with its ways out.
pub(super) type Resolved = Vec<((IpAddr, u8), Vec<Way>)>;

impl KernelTable {
    pub(super) fn new(table: u32) -> Self {
        KernelTable {
            table,
            ..Default::default()
        }
    }

    /// The interface named `name`, as the kernel last told of it.
    pub(super) fn link_named(&self, name: &str) -> Option<&Link> {
        (self.links.values()).find_map(|(l, _)| (l.name == name).then_some(l))
    }

    /// The messages of one packet of the `kernel` input.
    pub(super) fn apply(&mut self, bytes: &[u8]) {
        for m in netlink::messages(bytes) {
            self.messages += 1;
            match m.and_then(|m| netlink::read(&m)) {
                Ok(change) => self.change(change),
                Err(Malformed(why)) => {
                    self.malformed += 1;
                    log::warn!("router: a kernel route message is malformed ({why}): ignored");
                }
            }
        }
    }

    fn change(&mut self, change: Change) {
        let g = self.generation;
        match change {
            Change::Route(r) if r.table == self.table => {
                let list = self.routes.entry((r.dst, r.prefix_len)).or_default();
                list.retain(|e| e.route.priority != r.priority);
                list.push(Entry {
                    route: r,
                    generation: g,
                });
                self.dirty = true;
            }
            Change::RouteGone(r) if r.table == self.table => {
                if let Some(list) = self.routes.get_mut(&(r.dst, r.prefix_len)) {
                    list.retain(|e| e.route.priority != r.priority);
                    if list.is_empty() {
                        self.routes.remove(&(r.dst, r.prefix_len));
                    }
                    self.dirty = true;
                }
            }
            Change::Nexthop(n) => {
                self.nexthops.insert(n.id, (n, g));
                self.dirty = true;
            }
            Change::NexthopGone(id) => {
                self.dirty |= self.nexthops.remove(&id).is_some();
            }
            Change::Link(link) => {
                self.links.insert(link.index, (link, g));
                self.dirty = true;
            }
            Change::LinkGone(index) => {
                self.dirty |= self.links.remove(&index).is_some();
            }
            Change::DumpBegins { kind, seq } => {
                self.generation += 1;
                self.dumping = Some((kind, seq, self.generation));
            }
            Change::DumpDone { seq } => {
                if let Some((kind, s, from)) = self.dumping.take() {
                    if s == seq {
                        self.sweep(kind, from);
                    } else {
                        self.dumping = Some((kind, s, from));
                    }
                }
            }
            Change::Error { seq, errno } => {
                if let Some((kind, s, _)) = self.dumping {
                    if s == seq {
                        // A kernel without nexthop objects refuses their dump: nothing to forget.
                        self.dumping = None;
                        if kind != netlink::kind::GETNEXTHOP {
                            self.refused_dumps += 1;
                            log::warn!(
                                "router: the kernel refused a dump of its tables (errno {errno})"
                            );
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// Forgets what a finished dump of `kind` that began at generation `from` did not tell of.
    fn sweep(&mut self, which: u16, from: u64) {
        match which {
            kind::GETROUTE => {
                let before: usize = self.routes.values().map(Vec::len).sum();
                self.routes.retain(|_, list| {
                    list.retain(|e| e.generation >= from);
                    !list.is_empty()
                });
                let after: usize = self.routes.values().map(Vec::len).sum();
                self.dirty |= before != after;
                self.swept.routes = from;
            }
            kind::GETNEXTHOP => {
                let n = self.nexthops.len();
                self.nexthops.retain(|_, (_, g)| *g >= from);
                self.dirty |= n != self.nexthops.len();
                self.swept.nexthops = from;
            }
            kind::GETLINK => {
                let n = self.links.len();
                self.links.retain(|_, (_, g)| *g >= from);
                self.dirty |= n != self.links.len();
                self.swept.links = from;
            }
            _ => {}
        }
    }

    /// Everything the table holds — interfaces, nexthop objects, routes, in that order — as the
    /// kernel's messages, written to `out`: a successor's table [`KernelTable::apply`]s them
    /// and holds the same, until its own dump refreshes it. Returns how many were written.
    pub(super) fn export(&self, out: &mut impl std::io::Write) -> std::io::Result<u64> {
        let mut n = 0;
        for (link, _) in self.links.values() {
            out.write_all(&netlink::link_message(0, link))?;
            n += 1;
        }
        for (nexthop, _) in self.nexthops.values() {
            out.write_all(&netlink::nexthop_message(0, nexthop))?;
            n += 1;
        }
        for e in self.routes.values().flatten() {
            out.write_all(&netlink::route_message(kind::NEWROUTE, 0, &e.route))?;
            n += 1;
        }
        Ok(n)
    }

    /// Whether routes changed since the last call.
    pub(super) fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// Whether a dump is under way (its end not yet come).
    pub(super) fn dumping(&self) -> bool {
        self.dumping.is_some()
    }

    /// Whether a first whole table of routes has arrived.
    pub(super) fn synced(&self) -> bool {
        self.swept.routes > 0
    }

    pub(super) fn len(&self) -> usize {
        self.routes.len()
    }

    /// The ways out of a nexthop object (a group's members' ways, weights multiplied); empty
    /// for a blackhole; `None` when it or a member is unknown.
    fn nexthop_paths(&self, id: u32, depth: u8) -> Option<Vec<Path>> {
        let (n, _) = self.nexthops.get(&id)?;
        if n.blackhole {
            return Some(Vec::new());
        }
        if let Some(p) = n.path {
            return Some(vec![p]);
        }
        if depth > 0 {
            return None; // groups of groups are refused by the kernel too
        }
        let mut out = Vec::new();
        for &(member, weight) in &n.group {
            for mut p in self.nexthop_paths(member, depth + 1)? {
                p.weight = p.weight.saturating_mul(weight);
                out.push(p);
            }
        }
        Some(out)
    }

    /// Each prefix's route of the lowest metric as ways out of the router: an empty list is a
    /// route that drops (blackhole, unreachable, prohibit). `port_named` finds an interface by
    /// the name of the kernel's interface; `on_link` the interface whose subnet holds an
    /// address. Routes that lead nowhere the router reaches are left out and counted.
    pub(super) fn resolved(
        &self,
        port_named: impl Fn(&str) -> Option<usize>,
        on_link: impl Fn(IpAddr) -> Option<usize>,
    ) -> (Resolved, usize) {
        let mut out = Vec::with_capacity(self.routes.len());
        let mut unusable = 0;
        for (&prefix, list) in &self.routes {
            let Some(best) = list.iter().min_by_key(|e| e.route.priority) else {
                continue;
            };
            let r = &best.route;
            match r.kind {
                netlink::RTN_UNICAST => {}
                netlink::RTN_BLACKHOLE | netlink::RTN_UNREACHABLE | netlink::RTN_PROHIBIT => {
                    out.push((prefix, Vec::new()));
                    continue;
                }
                _ => continue,
            }
            let paths = match r.nexthop {
                Some(id) => match self.nexthop_paths(id, 0) {
                    Some(p) => p,
                    None => {
                        unusable += 1;
                        continue;
                    }
                },
                None => r.paths.clone(),
            };
            if paths.is_empty() {
                out.push((prefix, Vec::new()));
                continue;
            }
            let ways: Option<Vec<Way>> = (paths.iter())
                .map(|p| {
                    let named = (self.links.get(&p.oif)).and_then(|(l, _)| port_named(&l.name));
                    let port = named.or_else(|| p.gateway.and_then(&on_link))?;
                    // A gateway of the other family (RFC 5549) is not followed.
                    if p.gateway.is_some_and(|g| g.is_ipv4() != prefix.0.is_ipv4()) {
                        return None;
                    }
                    Some((port, p.gateway, p.weight.max(1)))
                })
                .collect();
            match ways {
                Some(w) => out.push((prefix, w)),
                None => unusable += 1,
            }
        }
        (out, unusable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn link(index: u32, name: &str) -> Link {
        Link {
            index,
            name: name.into(),
            up: true,
            mtu: Some(1500),
        }
    }

    fn route(dst: [u8; 4], len: u8, priority: u32, paths: Vec<Path>) -> Route {
        Route {
            dst: Ipv4Addr::from(dst).into(),
            prefix_len: len,
            table: 254,
            kind: netlink::RTN_UNICAST,
            priority,
            paths,
            nexthop: None,
        }
    }

    fn via(gw: [u8; 4], oif: u32, weight: u16) -> Path {
        Path {
            gateway: Some(Ipv4Addr::from(gw).into()),
            oif,
            weight,
        }
    }

    #[test]
    fn follows_routes_metrics_nexthop_groups_and_forgets_what_a_dump_left_out() {
        let mut t = KernelTable::new(254);
        t.change(Change::DumpBegins {
            kind: kind::GETLINK,
            seq: 1,
        });
        t.change(Change::Link(link(3, "wan")));
        t.change(Change::Link(link(4, "wan2")));
        t.change(Change::DumpDone { seq: 1 });
        t.change(Change::Route(route(
            [10, 1, 0, 0],
            16,
            20,
            vec![via([192, 0, 2, 9], 3, 1)],
        )));
        t.change(Change::Route(route(
            [10, 1, 0, 0],
            16,
            10,
            vec![via([192, 0, 2, 7], 0, 1)],
        )));
        t.change(Change::Nexthop(Nexthop {
            id: 1,
            path: Some(via([192, 0, 2, 9], 3, 1)),
            group: vec![],
            blackhole: false,
        }));
        t.change(Change::Nexthop(Nexthop {
            id: 2,
            path: Some(via([198, 51, 100, 9], 4, 1)),
            group: vec![],
            blackhole: false,
        }));
        t.change(Change::Nexthop(Nexthop {
            id: 3,
            path: None,
            group: vec![(1, 1), (2, 3)],
            blackhole: false,
        }));
        let mut grouped = route([10, 2, 0, 0], 16, 0, vec![]);
        grouped.nexthop = Some(3);
        t.change(Change::Route(grouped));
        let mut other_table = route([10, 3, 0, 0], 16, 0, vec![via([192, 0, 2, 9], 3, 1)]);
        other_table.table = 100;
        t.change(Change::Route(other_table));
        let port_named = |n: &str| ["lan", "wan", "wan2"].iter().position(|&x| x == n);
        let on_link = |a: IpAddr| (a == IpAddr::from([192, 0, 2, 7])).then_some(1);
        let (mut r, unusable) = t.resolved(port_named, on_link);
        r.sort_by_key(|(p, _)| *p);
        assert_eq!(unusable, 0);
        let gw = |a: [u8; 4]| Some(IpAddr::from(a));
        assert_eq!(
            r,
            vec![
                (
                    (IpAddr::from([10, 1, 0, 0]), 16),
                    vec![(1, gw([192, 0, 2, 7]), 1)]
                ),
                (
                    (IpAddr::from([10, 2, 0, 0]), 16),
                    vec![(1, gw([192, 0, 2, 9]), 1), (2, gw([198, 51, 100, 9]), 3)]
                ),
            ],
            "the lowest metric; the group's members with their weights; table 100 not followed"
        );
        // A dump that tells only of 10.2/16: 10.1/16 is forgotten at its end, not before.
        t.take_dirty();
        t.change(Change::DumpBegins {
            kind: kind::GETROUTE,
            seq: 2,
        });
        let mut grouped = route([10, 2, 0, 0], 16, 0, vec![]);
        grouped.nexthop = Some(3);
        t.change(Change::Route(grouped));
        assert_eq!(t.len(), 2);
        t.change(Change::DumpDone { seq: 2 });
        assert_eq!(t.len(), 1);
        assert!(t.take_dirty() && t.synced());
        // A route whose gateway is nowhere the router reaches is left out and counted.
        t.change(Change::Route(route(
            [10, 4, 0, 0],
            16,
            0,
            vec![via([203, 0, 113, 1], 9, 1)],
        )));
        assert_eq!(t.resolved(port_named, on_link).1, 1);
    }

    /// A table exported and applied by another (a successor's, at an upgrade): the same
    /// resolved routes and links, not synced (no dump of its own yet); its first dump forgets
    /// what it does not list.
    #[test]
    fn an_exported_table_is_the_same_in_a_successor_until_its_own_dump() {
        let mut t = KernelTable::new(254);
        t.change(Change::Link(link(3, "wan")));
        t.change(Change::Link(link(4, "wan2")));
        for (id, path) in [
            (1, via([192, 0, 2, 9], 3, 1)),
            (2, via([198, 51, 100, 9], 4, 1)),
        ] {
            t.change(Change::Nexthop(Nexthop {
                id,
                path: Some(path),
                group: vec![],
                blackhole: false,
            }));
        }
        t.change(Change::Nexthop(Nexthop {
            id: 3,
            path: None,
            group: vec![(1, 1), (2, 3)],
            blackhole: false,
        }));
        let mut grouped = route([10, 2, 0, 0], 16, 0, vec![]);
        grouped.nexthop = Some(3);
        t.change(Change::Route(grouped));
        let paths = vec![via([192, 0, 2, 7], 3, 2), via([192, 0, 2, 8], 3, 1)];
        t.change(Change::Route(route([10, 1, 0, 0], 16, 10, paths)));
        t.change(Change::Route(route([10, 1, 0, 0], 16, 20, vec![])));
        let mut bytes = Vec::new();
        let written = t.export(&mut bytes).unwrap();
        assert_eq!(
            written,
            2 + 3 + 3,
            "two links, three nexthops, three routes"
        );
        let mut successor = KernelTable::new(254);
        successor.apply(&bytes);
        assert_eq!(successor.malformed, 0);
        let port_named = |n: &str| ["lan", "wan", "wan2"].iter().position(|&x| x == n);
        let sorted = |t: &KernelTable| {
            let (mut r, unusable) = t.resolved(port_named, |_| None);
            r.sort_by_key(|(p, _)| *p);
            (r, unusable)
        };
        assert_eq!(sorted(&successor), sorted(&t));
        assert_eq!(sorted(&t).0.len(), 2);
        assert_eq!(successor.link_named("wan2"), t.link_named("wan2"));
        assert!(!successor.synced());
        successor.change(Change::DumpBegins {
            kind: kind::GETROUTE,
            seq: 1,
        });
        successor.change(Change::DumpDone { seq: 1 });
        assert_eq!(successor.len(), 0);
    }
}
