//! From a graph to what the kernel data plane needs: each app (those a graph file places in
//! the kernel, `stitch-place` picks them) turned into a function kind with its ports and
//! settings, and each link into a pair of port references. Every app must have a kernel
//! version; anything the kernel versions do not do is an error naming the app's line, never
//! ignored.

use indexmap::IndexMap;
use ipnet::Ipv4Net;
use std::net::{IpAddr, Ipv4Addr};
use stitch_apps::{bridge, firewall, router};
use stitch_core::graph::GraphError;
use stitch_core::Graph;

use crate::maps::{self, FwRule, MAX_PORTS, MAX_RULES};

/// A function of the kernel graph.
#[derive(Debug, Clone, PartialEq)]
pub enum Function {
    /// A workload's interface (an `af_packet`/`af_xdp`/`tap` app in user space): the tc hook
    /// of this interface takes its packets into the graph, and packets sent to it are
    /// redirected to it.
    Interface {
        ifname: String,
        /// The interface's other end is Stitch's own engine (a kernel ↔ engine boundary of a
        /// mixed graph): packets for it go into a ring buffer the engine reads instead of
        /// through the interface. Set by `stitch-place`, never by a graph file.
        to_engine: bool,
    },
    Forwarder,
    Bridge {
        vlans: Vec<u16>,
        aging_seconds: u64,
    },
    Router {
        ports: Vec<RouterPort>,
        routes: Vec<StaticRoute>,
        icmp_rate: u32,
    },
    /// The transport manager: one port per tenant segment (VNI, remote VTEP); the kernel's
    /// VXLAN device on `udp_port` carries the packets between hosts.
    Vxlan {
        segments: Vec<(u32, Ipv4Addr)>,
        udp_port: u16,
    },
    Firewall {
        rules: Vec<FwRule>,
        default: u8,
        stateful: bool,
        /// tcp established, tcp transitory, udp, icmp (seconds).
        timeouts: [u64; 4],
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RouterPort {
    pub mac: [u8; 6],
    pub address: Ipv4Net,
    pub mtu: u16,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StaticRoute {
    pub prefix: Ipv4Net,
    pub via: Ipv4Addr,
    pub port: u32,
}

impl Function {
    pub fn kind_name(&self) -> &'static str {
        match self {
            Function::Interface { .. } => "interface",
            Function::Forwarder => "forwarder",
            Function::Bridge { .. } => "bridge",
            Function::Router { .. } => "router",
            Function::Firewall { .. } => "firewall",
            Function::Vxlan { .. } => "vxlan",
        }
    }

    pub fn kind_code(&self) -> u32 {
        match self {
            Function::Interface { .. } => 0,
            Function::Forwarder => maps::FN_FORWARDER,
            Function::Bridge { .. } => maps::FN_BRIDGE,
            Function::Router { .. } => maps::FN_ROUTER,
            Function::Firewall { .. } => maps::FN_FIREWALL,
            Function::Vxlan { .. } => maps::FN_VXLAN,
        }
    }
}

/// One app of the kernel graph.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedApp {
    pub name: String,
    pub function: Function,
    /// Port names in port-number order (an interface has one port for both directions).
    pub ports: Vec<String>,
    pub line: usize,
}

impl PlannedApp {
    /// The port number of a port name (`input` and `output` of an interface are both 0).
    pub fn port(&self, name: &str) -> Option<u32> {
        if let Function::Interface { .. } = self.function {
            return matches!(name, "input" | "output").then_some(0);
        }
        self.ports.iter().position(|p| p == name).map(|i| i as u32)
    }
}

/// A link from one app's port to another's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PlannedLink {
    pub from: (String, u32),
    pub to: (String, u32),
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub apps: IndexMap<String, PlannedApp>,
    pub links: Vec<PlannedLink>,
}

/// A problem at `line` (column 0: the line is known, not where on it).
fn error(line: usize, message: String) -> GraphError {
    GraphError {
        line,
        column: 0,
        message,
    }
}

/// Kernel versions exist for these app types.
pub const KERNEL_TYPES: &str =
    "af_packet, af_xdp, tap (workload interfaces), forwarder, bridge, router, firewall, vxlan";

impl Plan {
    pub fn from_graph(graph: &Graph) -> Result<Plan, Vec<GraphError>> {
        let mut errors = Vec::new();
        let mut apps = IndexMap::new();
        for decl in graph.apps.values() {
            match plan_app(&decl.kind, &decl.config) {
                Ok((function, ports)) => {
                    apps.insert(
                        decl.name.clone(),
                        PlannedApp {
                            name: decl.name.clone(),
                            function,
                            ports,
                            line: decl.line,
                        },
                    );
                }
                Err(m) => {
                    let (line, column) = decl.locate(&m);
                    errors.push(GraphError {
                        line,
                        column,
                        message: format!("app `{}` ({}) in the kernel: {m}", decl.name, decl.kind),
                    })
                }
            }
        }
        let mut links = Vec::new();
        let mut used_outputs: IndexMap<(String, u32), usize> = IndexMap::new();
        for l in &graph.links {
            let (Some(a), Some(b)) = (apps.get(&l.from.app), apps.get(&l.to.app)) else {
                continue; // the app has an error already
            };
            let (Some(pa), Some(pb)) = (a.port(&l.from.port), b.port(&l.to.port)) else {
                let underlay = [(a, &l.from.port), (b, &l.to.port)].iter().any(|(x, p)| {
                    matches!(x.function, Function::Vxlan { .. }) && p.as_str() == "underlay"
                });
                let why = if underlay {
                    "in the kernel, tunnel packets go through the host's own routing and a \
                     VXLAN device the data plane creates: leave `underlay` unlinked"
                } else {
                    "no such port"
                };
                errors.push(error(l.line, format!("link `{}`: {why}", l.spec())));
                continue;
            };
            let from = (a.name.clone(), pa);
            if let Some(first) = used_outputs.insert(from.clone(), l.line) {
                errors.push(error(
                    l.line,
                    format!(
                        "link `{}`: `{}` is already linked on line {first}; in the kernel a \
                         port leads to one place (use a bridge to fan out)",
                        l.spec(),
                        l.from
                    ),
                ));
                continue;
            }
            links.push(PlannedLink {
                from,
                to: (b.name.clone(), pb),
                line: l.line,
            });
        }
        errors.extend(vxlan_conflicts(&apps));
        if errors.is_empty() {
            Ok(Plan { apps, links })
        } else {
            Err(errors)
        }
    }
}

/// What the kernel's `vxlan` apps cannot share: a VNI, or differing UDP ports (the data plane
/// has one VXLAN device).
fn vxlan_conflicts(apps: &IndexMap<String, PlannedApp>) -> Vec<GraphError> {
    let mut errors = Vec::new();
    let mut vnis: IndexMap<u32, &str> = IndexMap::new();
    let mut udp_ports = Vec::new();
    for a in apps.values() {
        if let Function::Vxlan { segments, udp_port } = &a.function {
            udp_ports.push(*udp_port);
            for (vni, _) in segments {
                if let Some(other) = vnis.insert(*vni, &a.name) {
                    errors.push(error(
                        a.line,
                        format!("app `{}`: VNI {vni} is also a segment of `{other}`", a.name),
                    ));
                }
            }
        }
    }
    udp_ports.dedup();
    if udp_ports.len() > 1 {
        errors.push(error(
            0,
            "all kernel `vxlan` apps must use the same UDP `port` (one VXLAN device per \
             data plane)"
                .into(),
        ));
    }
    errors
}

fn parse<T: serde::de::DeserializeOwned>(config: &serde_json::Value) -> Result<T, String> {
    serde_json::from_value(config.clone()).map_err(|e| e.to_string())
}

fn too_many(what: &str, n: usize, max: u32) -> Result<(), String> {
    if n > max as usize {
        return Err(format!(
            "{n} {what}: the kernel versions take at most {max}"
        ));
    }
    Ok(())
}

fn plan_app(kind: &str, config: &serde_json::Value) -> Result<(Function, Vec<String>), String> {
    match kind {
        "af_packet" | "af_xdp" | "tap" => {
            let ifname = config
                .get("interface")
                .or_else(|| config.get("name"))
                .and_then(|v| v.as_str())
                .ok_or("needs `interface`")?
                .to_string();
            Ok((
                Function::Interface {
                    ifname,
                    to_engine: false,
                },
                vec!["input".into()],
            ))
        }
        "forwarder" => Ok((Function::Forwarder, vec!["input".into(), "output".into()])),
        "bridge" => {
            let c: bridge::BridgeConfig = parse(config)?;
            too_many("ports", c.ports.len(), MAX_PORTS)?;
            let mut vlans = Vec::new();
            for (name, p) in &c.ports {
                if p.mode != bridge::PortMode::Access {
                    return Err(format!(
                        "port `{name}` is a trunk; the kernel bridge has access ports only \
                         (place this bridge in user space for trunks)"
                    ));
                }
                vlans.push(p.vlan);
            }
            Ok((
                Function::Bridge {
                    vlans,
                    aging_seconds: c.aging_seconds,
                },
                c.ports.keys().cloned().collect(),
            ))
        }
        "router" => plan_router(parse(config)?),
        "vxlan" => {
            let c: stitch_apps::vxlan::VxlanConfig = parse(config)?;
            too_many("segments", c.segments.len(), MAX_PORTS)?;
            let mut segments = Vec::new();
            for (name, s) in &c.segments {
                if s.vni == 0 || s.vni >= 1 << 24 {
                    return Err(format!(
                        "segment `{name}`: VNI {} is not 1..16777215",
                        s.vni
                    ));
                }
                let remote = match (c.local, s.remote.to_vec().as_slice()) {
                    (std::net::IpAddr::V4(_), [std::net::IpAddr::V4(r)]) => *r,
                    _ => {
                        return Err(format!(
                            "segment `{name}`: the kernel transport manager takes an IPv4 `local` \
                             and one IPv4 `remote` per segment (place this vxlan in user space \
                             for IPv6 or several remotes)"
                        ))
                    }
                };
                segments.push((s.vni, remote));
            }
            Ok((
                Function::Vxlan {
                    segments,
                    udp_port: c.port,
                },
                c.segments.keys().cloned().collect(),
            ))
        }
        "firewall" => plan_firewall(parse(config)?),
        other => Err(format!(
            "`{other}` has no kernel version (kernel versions: {KERNEL_TYPES}); place it in \
             user space"
        )),
    }
}

fn plan_router(c: router::RouterConfig) -> Result<(Function, Vec<String>), String> {
    too_many("interfaces", c.interfaces.len(), MAX_PORTS)?;
    let mut ports = Vec::new();
    for (name, i) in &c.interfaces {
        if i.address6.is_some() {
            return Err(format!(
                "interface `{name}` has `address6`: the kernel router routes IPv4 only (place \
                 it in user space for IPv6)"
            ));
        }
        let address: Ipv4Net = i.address.parse().map_err(|_| {
            format!(
                "interface `{name}`: address `{}` is not A.B.C.D/N",
                i.address
            )
        })?;
        let mac = stitch_wire::parse_mac(&i.mac).map_err(|e| format!("interface `{name}`: {e}"))?;
        let mtu = u16::try_from(i.mtu).map_err(|_| format!("interface `{name}`: mtu too large"))?;
        ports.push(RouterPort { mac, address, mtu });
    }
    let mut routes = Vec::new();
    for r in &c.routes {
        let prefix: Ipv4Net = r.prefix.parse().map_err(|_| {
            format!(
                "route `{}`: the kernel router routes IPv4 prefixes only",
                r.prefix
            )
        })?;
        let IpAddr::V4(via) = r.via else {
            return Err(format!("route `{}`: next hop must be IPv4", r.prefix));
        };
        let port = ports
            .iter()
            .position(|p| p.address.contains(&via))
            .ok_or_else(|| {
                format!(
                    "route `{}`: next hop {via} is on none of the router's subnets",
                    r.prefix
                )
            })?;
        routes.push(StaticRoute {
            prefix: prefix.trunc(),
            via,
            port: port as u32,
        });
    }
    Ok((
        Function::Router {
            ports,
            routes,
            icmp_rate: c.icmp_rate.max(0.0).round() as u32,
        },
        c.interfaces.keys().cloned().collect(),
    ))
}

fn action_code(a: firewall::Action) -> u8 {
    match a {
        firewall::Action::Accept => 0,
        firewall::Action::Drop => 1,
        firewall::Action::Reject => 2,
    }
}

fn cidr(s: &str) -> Result<([u8; 4], [u8; 4]), String> {
    let net: Ipv4Net = if s.contains('/') {
        s.parse()
    } else {
        format!("{s}/32").parse()
    }
    .map_err(|_| {
        format!("`{s}`: the kernel firewall matches IPv4 prefixes only (place it in user space for IPv6)")
    })?;
    Ok((net.network().octets(), net.netmask().octets()))
}

fn plan_firewall(c: firewall::FirewallConfig) -> Result<(Function, Vec<String>), String> {
    too_many("rules", c.rules.len(), MAX_RULES)?;
    let mut rules = Vec::new();
    for (i, r) in c.rules.iter().enumerate() {
        let at = |m: String| format!("rule {}: {m}", i + 1);
        let mut k = FwRule {
            action: action_code(r.action),
            from: match r.from {
                firewall::Side::Lan => 0,
                firewall::Side::Wan => 1,
                firewall::Side::Any => 2,
            },
            sport_hi: 0xffff,
            dport_hi: 0xffff,
            ..FwRule::default()
        };
        if let Some(p) = &r.proto {
            k.proto = firewall::protocol(p).map_err(at)?;
            if k.proto == stitch_wire::ip_proto::ICMPV6 {
                return Err(at("icmpv6: the kernel firewall filters IPv4 only".into()));
            }
        }
        if let Some(s) = &r.src {
            (k.src, k.src_mask) = cidr(s).map_err(at)?;
        }
        if let Some(s) = &r.dst {
            (k.dst, k.dst_mask) = cidr(s).map_err(at)?;
        }
        if let Some(p) = &r.src_port {
            (k.sport_lo, k.sport_hi) = firewall::port_range(p).map_err(at)?;
        }
        if let Some(p) = &r.dst_port {
            (k.dport_lo, k.dport_hi) = firewall::port_range(p).map_err(at)?;
        }
        if let Some(v) = r.vlan {
            k.has_vlan = 1;
            k.vlan = v;
        }
        rules.push(k);
    }
    let t = &c.timeouts;
    Ok((
        Function::Firewall {
            rules,
            default: action_code(c.default),
            stateful: c.stateful,
            timeouts: [t.tcp_established, t.tcp_transitory, t.udp, t.icmp],
        },
        vec!["lan".into(), "wan".into()],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::Registry;

    fn plan(text: &str) -> Result<Plan, Vec<GraphError>> {
        let mut r = Registry::new();
        stitch_apps::register(&mut r);
        stitch_io::register(&mut r);
        let g = Graph::parse(text, "g.yaml", std::path::Path::new("."), &r)
            .unwrap_or_else(|e| panic!("{e}"));
        Plan::from_graph(&g)
    }

    /// The first error of the graph file or, when the file is valid, of the kernel plan.
    fn first_error(text: &str) -> GraphError {
        let mut r = Registry::new();
        stitch_apps::register(&mut r);
        stitch_io::register(&mut r);
        match Graph::parse(text, "g.yaml", std::path::Path::new("."), &r) {
            Err(mut e) => e.errors.remove(0),
            Ok(g) => Plan::from_graph(&g)
                .expect_err("the plan must fail")
                .remove(0),
        }
    }

    const ROUTER: &str = "apps:\n  a: { type: af_packet, interface: x0 }\n  r: { type: router, interfaces: { left: { mac: \"02:00:00:00:00:01\", address: \"10.0.1.1/24\" }, right: { mac: \"02:00:00:00:00:02\", address: \"10.0.2.1/24\" } }, routes: [ { prefix: \"10.9.0.0/16\", via: 10.0.2.7 } ] }\nlinks:\n  - \"a.output -> r.left\"\n  - \"r.left -> a.input\"\n";

    #[test]
    fn ports_links_and_routes_are_planned() {
        let p = plan(ROUTER).unwrap();
        let r = &p.apps["r"];
        assert_eq!(r.ports, ["left", "right"]);
        let Function::Router { ports, routes, .. } = &r.function else {
            panic!("{r:?}")
        };
        assert_eq!(ports[1].address.to_string(), "10.0.2.1/24");
        assert_eq!(routes[0].port, 1, "the next hop is on the right subnet");
        assert_eq!(p.apps["a"].port("output"), Some(0));
        assert_eq!(p.apps["a"].port("input"), Some(0));
        assert_eq!(
            p.links[0],
            PlannedLink {
                from: ("a".into(), 0),
                to: ("r".into(), 0),
                line: 5
            }
        );
    }

    #[test]
    fn what_the_kernel_versions_lack_is_an_error_on_its_line() {
        let e = first_error(&ROUTER.replace("10.0.2.7", "10.0.3.7"));
        assert!(e.message.contains("on no interface's subnet"), "{e:?}");
        assert_eq!(e.line, 3);
        let e = first_error(
            "apps:\n  r: { type: router, interfaces: { x: { mac: \"02:00:00:00:00:01\", address: \"10.0.1.1/24\", address6: \"fd00::1/64\" } } }\n",
        );
        assert!(e.message.contains("IPv4 only"), "{e:?}");
        let e = first_error(
            "apps:\n  f: { type: firewall, rules: [ { action: accept, src: \"fd00::/8\" } ] }\n",
        );
        assert!(
            e.message.contains("rule 1") && e.message.contains("IPv4"),
            "{e:?}"
        );
        let e = first_error("apps:\n  n: { type: nat, external: 192.0.2.1 }\n");
        assert!(e.message.contains("no kernel version"), "{e:?}");
        let e = first_error("apps:\n  b: { type: bridge, ports: { p: { mode: trunk }, q: {} } }\n");
        assert!(e.message.contains("trunk"), "{e:?}");
    }

    #[test]
    fn a_port_leads_to_one_place_and_vnis_are_unique() {
        let e = first_error(&format!("{ROUTER}  - \"a.output -> r.right\"\n"));
        assert!(e.message.contains("already linked"), "{e:?}");
        assert_eq!(e.line, 7);
        let vx = "apps:\n  v: { type: vxlan, local: 192.0.2.1, local_mac: \"02:00:00:00:00:01\", next_hop_mac: \"02:00:00:00:00:02\", segments: { t1: { vni: 7, remote: 192.0.2.2 } } }\n  w: { type: vxlan, local: 192.0.2.1, local_mac: \"02:00:00:00:00:01\", next_hop_mac: \"02:00:00:00:00:02\", segments: { t2: { vni: 7, remote: 192.0.2.3 } } }\n";
        let e = first_error(vx);
        assert!(e.message.contains("VNI 7"), "{e:?}");
        let e = first_error(&format!(
            "{}links:\n  - \"v.underlay -> v.t1\"\n",
            vx.replace("vni: 7, remote: 192.0.2.3", "vni: 8, remote: 192.0.2.3")
        ));
        assert!(e.message.contains("leave `underlay` unlinked"), "{e:?}");
    }
}
