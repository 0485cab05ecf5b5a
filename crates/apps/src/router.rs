//! `router`: an IPv4 and IPv6 router. Each interface in `interfaces` is a port (an input and an
//! output of that name) with a MAC address, an IPv4 `address`/prefix and optionally an
//! `address6`/prefix, which also give connected routes; `routes` adds static routes (`prefix`,
//! `via` next hop, either family). Forwarding looks routes up in a DXR-style table (`router/lpm.rs`:
//! the prefixes flattened into sorted address ranges, a direct table on the top bits pointing at
//! each range bucket), built from the control plane's prefix map after every change, and looks a
//! batch of frames up together with their table lines prefetched; a full IPv4 table takes
//! about 18 MiB. The address a route's gateway resolved to is kept by forwarding-table hop (an
//! adjacency), so a packet routed via a gateway needs no neighbour-table lookup.
//!
//! ARP: the router answers requests for its addresses, resolves next hops (packets wait in a
//! short queue per next hop while it asks), and caches answers for `arp_timeout` seconds.
//! Forwarding checks the IPv4 header (bad checksum or length: dropped and counted), decrements
//! the TTL with an incremental checksum update (RFC 1624), and answers with ICMP errors — time
//! exceeded, net unreachable, fragmentation needed (DF set, over the egress `mtu`) — at most
//! `icmp_rate` per second. Echo requests to its own addresses get replies. IPv6 works the same
//! way with Neighbor Discovery instead of ARP, hop limits and ICMPv6 errors (`router/v6.rs`).
//! Each interface with `address6` also has the link-local address of its MAC (modified
//! EUI-64); with `advertise: true` it sends router advertisements (RFC 4861 §6) for its prefix
//! every `ra_interval` seconds and answers router solicitations, so hosts configure their
//! addresses (SLAAC) and default route from it.
//!
//! ```yaml
//! apps:
//!   r: { type: router,
//!        interfaces: { lan: { mac: "02:00:00:00:01:01", address: "10.0.1.1/24",
//!                             address6: "2001:db8:1::1/64", advertise: true },
//!                      wan: { mac: "02:00:00:00:02:01", address: "192.0.2.2/24" } },
//!        routes: [ { prefix: "0.0.0.0/0", via: "192.0.2.1" } ] }
//! ```

use indexmap::IndexMap;
use ipnet::{Ipv4Net, Ipv6Net};
use lpm::{Lpm, LpmError};
use prefix_trie::PrefixMap;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};
use stitch_core::link::transmit_to;
use stitch_core::{
    pool, App, AppContext, AppError, AppSnapshot, AppState, Counter, Descriptors, Io, Packet,
    PortNames, PortSpec,
};
use stitch_wire::header::{self, icmp, ipv4};
use stitch_wire::icmp::RateLimit;
use stitch_wire::ip_proto::ICMP;
use stitch_wire::{ethertype, icmpv4};

use stitch_wire::{arp, checksum, parse_mac};

mod builder;
mod kernel;
pub mod lpm;
mod v6;

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    /// The interface's MAC address.
    pub mac: String,
    /// Address and prefix length, e.g. `10.0.1.1/24`.
    pub address: String,
    /// IPv6 address and prefix length, e.g. `fd00:1::1/64`.
    pub address6: Option<String>,
    /// The largest IP packet sent out of it: larger ones are fragmentation-needed (DF, IPv6) or
    /// dropped.
    #[serde(default = "default_mtu")]
    pub mtu: usize,
    /// Send router advertisements for `address6`'s prefix on this interface.
    #[serde(default)]
    pub advertise: bool,
}

fn default_mtu() -> usize {
    1500
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The destination prefix (`0.0.0.0/0`, `2001:db8::/32`).
    pub prefix: String,
    /// The next hop: an address on the prefix of one of the interfaces.
    pub via: IpAddr,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// The interfaces by name: each is an input and an output of that name, with connected routes
    /// for its prefixes.
    pub interfaces: IndexMap<String, InterfaceConfig>,
    /// Static routes, IPv4 or IPv6.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Seconds an ARP or NDP answer is kept.
    #[serde(default = "default_arp_timeout")]
    pub arp_timeout: u64,
    /// ICMP errors sent per second at most.
    #[serde(default = "default_icmp_rate")]
    pub icmp_rate: f64,
    /// Seconds between unsolicited router advertisements (RFC 4861 MaxRtrAdvInterval, 4–1800).
    #[serde(default = "default_ra_interval")]
    pub ra_interval: u64,
    /// Give each interface `NAME` a host port `host_NAME` (an input and an output) for the host
    /// side of the interface (a `tap` with its MAC and addresses, where a routing daemon runs):
    /// what is addressed to the router and is not an echo request goes up it (BGP, OSPF, BFD,
    /// multicast), ARP and Neighbor Discovery are copied up it (the host knows its
    /// neighbours), and what the host sends on it leaves by the interface. With
    /// `kernel_table`, an interface takes the state and MTU of the kernel's link of its name
    /// (its TAP): set down, nothing crosses it (`link_down_drops`).
    #[serde(default)]
    pub host_ports: bool,
    /// Follow kernel routing table N (254: main) from the netlink messages a `kernel_routes`
    /// app sends to input `kernel`: its routes — multipath routes and nexthop groups spread
    /// over their gateways by a flow hash — join the configured ones, which win for the same
    /// prefix.
    pub kernel_table: Option<u32>,
}

/// The name of interface `name`'s host port.
fn host_port_name(name: &str) -> String {
    format!("host_{name}")
}

/// The input that takes netlink messages of the followed kernel table.
const KERNEL_INPUT: &str = "kernel";

fn default_ra_interval() -> u64 {
    200
}

fn default_arp_timeout() -> u64 {
    300
}
fn default_icmp_rate() -> f64 {
    100.0
}

struct Iface {
    mac: [u8; 6],
    addr: Ipv4Addr,
    addr6: Option<Ipv6Addr>,
    /// The link-local address (with `addr6`).
    ll6: Option<Ipv6Addr>,
    /// The on-link prefix advertised when `advertise` is set.
    prefix6: Option<Ipv6Net>,
    advertise: bool,
    mtu: usize,
    /// Down when its host side was set down (`ip link set … down`): nothing in or out.
    up: bool,
}

/// Where a prefix leads: out of interface `port`, to `via` (None: the destination itself).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Route<A = Ipv4Addr> {
    port: usize,
    via: Option<A>,
}

/// An IPv6 route.
type Route6 = Route<Ipv6Addr>;

/// The `port` of a route that drops (a kernel blackhole, unreachable or prohibit route).
const DROP: usize = usize::MAX;

impl<A: Copy> Route<A> {
    /// The neighbour a packet to `dst` goes to by this route, the forwarding table's hop
    /// number `hop`.
    #[inline]
    fn next_hop(&self, dst: A, hop: usize) -> NextHop<A> {
        let (addr, gateway) = match self.via {
            Some(via) => (via, Some(hop)),
            None => (dst, None),
        };
        NextHop {
            port: self.port,
            addr,
            gateway,
        }
    }
}

/// Where a packet goes next: out of interface `port` to neighbour `addr`. `gateway` is the
/// forwarding table's hop number when `addr` is a route's gateway rather than the destination
/// itself: the neighbour table then keeps its answer by that number.
#[derive(Clone, Copy)]
struct NextHop<A> {
    port: usize,
    addr: A,
    gateway: Option<usize>,
}

/// Packets wait here while their next hop is being resolved.
const ARP_QUEUE: usize = 16;

struct Neighbor {
    mac: Option<[u8; 6]>,
    expires: Instant,
    waiting: Vec<Packet>,
    asked: Option<Instant>,
}

/// A gateway's link-layer address and until when its neighbour entry stays fresh.
#[derive(Clone, Copy)]
struct Resolved {
    mac: [u8; 6],
    until: Instant,
}

/// Next-hop resolution shared by ARP (IPv4) and Neighbor Discovery (IPv6): answers cached per
/// (interface, address), packets waiting for an answer, and when to ask again.
struct NeighborTable<A> {
    entries: HashMap<(usize, A), Neighbor, foldhash::fast::RandomState>,
    /// The answer for each gateway of the forwarding table (by its hop number) while it is
    /// fresh, an adjacency in VPP's terms: a packet routed via a gateway then skips the hash
    /// lookup. Forgotten whenever an answer is learnt, so a changed address is never missed.
    gateways: Vec<Option<Resolved>>,
}

impl<A: std::hash::Hash + Eq + Copy + std::fmt::Display> NeighborTable<A> {
    /// A table for a forwarding table with `gateways` distinct next hops.
    fn new(gateways: usize) -> Self {
        NeighborTable {
            entries: HashMap::default(),
            gateways: vec![None; gateways],
        }
    }

    fn entry(&mut self, port: usize, ip: A, now: Instant) -> &mut Neighbor {
        self.entries.entry((port, ip)).or_insert(Neighbor {
            mac: None,
            expires: now,
            waiting: Vec::new(),
            asked: None,
        })
    }

    fn knows(&self, port: usize, ip: A) -> bool {
        self.entries.contains_key(&(port, ip))
    }

    /// Sends `p` (destination MAC to be filled) to its next hop when that is resolved;
    /// otherwise queues it (bounded; overflow counted in `queue_drops`) and returns true when
    /// a new solicitation is due.
    #[inline]
    fn send(
        &mut self,
        next: NextHop<A>,
        mut p: Packet,
        now: Instant,
        timeout: Duration,
        out: &mut Vec<(usize, Packet)>,
        queue_drops: &Counter,
    ) -> bool {
        if let Some(Some(r)) = next.gateway.map(|g| self.gateways[g]) {
            if r.until > now {
                p.data_mut()[0..6].copy_from_slice(&r.mac);
                out.push((next.port, p));
                return false;
            }
        }
        let n = self.entry(next.port, next.addr, now);
        if let (Some(mac), true) = (n.mac, n.expires > now) {
            let until = n.expires;
            p.data_mut()[0..6].copy_from_slice(&mac);
            out.push((next.port, p));
            if let Some(g) = next.gateway {
                self.gateways[g] = Some(Resolved { mac, until });
            }
            return false;
        }
        if n.waiting.len() >= ARP_QUEUE {
            queue_drops.add(1);
        } else {
            n.waiting.push(p);
        }
        if n.asked
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
        {
            n.asked = Some(now);
            n.expires = now + timeout;
            return true;
        }
        false
    }

    /// Records an answer and sends what waited for it.
    fn learn(
        &mut self,
        port: usize,
        ip: A,
        mac: [u8; 6],
        now: Instant,
        timeout: Duration,
        out: &mut Vec<(usize, Packet)>,
    ) {
        self.gateways.fill(None);
        let n = self.entry(port, ip, now);
        n.mac = Some(mac);
        n.expires = now + timeout;
        for mut p in n.waiting.drain(..) {
            p.data_mut()[0..6].copy_from_slice(&mac);
            out.push((port, p));
        }
    }

    /// Forgets stale neighbours (and what waited for an answer that never came).
    fn expire(&mut self, now: Instant) {
        self.entries.retain(|_, n| {
            n.expires > now
                || n.asked
                    .is_some_and(|t| now.duration_since(t) < Duration::from_secs(3))
        });
    }

    /// The resolved neighbours still fresh at `now`, by port name, for a snapshot.
    fn resolved(&self, names: &[String], now: Instant) -> Vec<NeighborState<A>> {
        (self.entries.iter())
            .filter_map(|(&(port, ip), n)| {
                let left = n.expires.checked_duration_since(now)?;
                Some(NeighborState {
                    port: names[port].clone(),
                    ip,
                    mac: n.mac?,
                    left_ms: left.as_millis() as u64,
                })
            })
            .collect()
    }

    /// Takes back the neighbours a snapshot holds whose port still exists; returns how many.
    fn take_back(&mut self, names: &[String], saved: Vec<NeighborState<A>>, now: Instant) -> usize {
        self.gateways.fill(None);
        let mut kept = 0;
        for e in saved {
            let Some(port) = names.iter().position(|n| *n == e.port) else {
                continue;
            };
            let n = self.entry(port, e.ip, now);
            n.mac = Some(e.mac);
            n.expires = now + Duration::from_millis(e.left_ms);
            kept += 1;
        }
        kept
    }

    fn dump(&self, names: &[String], limit: usize, now: Instant) -> Vec<serde_json::Value> {
        self.entries
            .iter()
            .take(limit)
            .map(|((port, ip), n)| {
                serde_json::json!({ "port": names[*port], "ip": ip.to_string(),
                    "mac": n.mac.map(|m| m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")),
                    "waiting": n.waiting.len(), "expires_in_s": n.expires.saturating_duration_since(now).as_secs() })
            })
            .collect()
    }
}

/// A resolved neighbour as the router carries it across a restart (format
/// [`STATE_VERSION`]): the port by name and the time its entry had left.
#[derive(serde::Serialize, Deserialize)]
struct NeighborState<A> {
    port: String,
    ip: A,
    mac: [u8; 6],
    left_ms: u64,
}

/// The router's neighbours, IPv4 and IPv6.
#[derive(serde::Serialize, Deserialize)]
struct RouterState {
    neighbors: Vec<NeighborState<Ipv4Addr>>,
    neighbors6: Vec<NeighborState<Ipv6Addr>>,
}

const STATE_VERSION: u32 = 1;

pub struct Router {
    ifaces: Vec<Iface>,
    port_names: Vec<String>,
    routes: PrefixMap<Ipv4Net, Route>,
    routes6: PrefixMap<Ipv6Net, Route6>,
    fib: Fib,
    neighbors: NeighborTable<Ipv4Addr>,
    neighbors6: NeighborTable<Ipv6Addr>,
    arp_timeout: Duration,
    icmp_limit: RateLimit,
    /// Packets produced while handling one input packet, kept to avoid allocating.
    pending: Vec<(usize, Packet)>,
    /// Frames taken from an input for one round of lookups, kept to avoid allocating.
    batch: Vec<Packet>,
    ra: v6::Advertising,
    /// With `host_ports`: the first host port's number (interface `i`'s is this plus `i`).
    host_base: Option<usize>,
    /// With `kernel_table`: the table followed.
    kernel: Option<Follower>,
    /// Each interface's host side as the kernel last told of it: its state and MTU are the
    /// interface's.
    host_links: Vec<Option<builder::HostLink>>,
    /// The final word of an upgrade comes next: the kernel table was lent already.
    final_word: bool,
    c: Counters,
}

/// How long a successor waits, in all, for its predecessor's kernel table and its first
/// compile (the predecessor forwards meanwhile; an upgrade's answer is due within 30 s).
const INHERIT_PATIENCE: Duration = Duration::from_secs(15);

/// The kernel table a predecessor lent (`d`, from [`App::hand_over`]) given to `k`'s thread,
/// and the table compiled from it; `None` (the router follows its own dump, as on a fresh
/// start) when it did not come whole in time.
fn inherit_kernel_table(k: &Follower, d: Descriptors) -> Option<builder::Built> {
    let since = Instant::now();
    let file = std::fs::File::from(d.fds.into_iter().next()?);
    let bytes = builder::read_handed(&file, INHERIT_PATIENCE)?;
    let size = bytes.len();
    k.builder.messages(bytes);
    let built = k
        .builder
        .wait_built(INHERIT_PATIENCE.saturating_sub(since.elapsed()));
    match &built {
        Some(_) => log::info!(
            "router: the predecessor's kernel table ({size} bytes of messages) taken and compiled in {:.0} ms",
            since.elapsed().as_secs_f64() * 1e3
        ),
        None => log::warn!(
            "router: the predecessor's kernel table was not compiled within {INHERIT_PATIENCE:?}; it comes with the router's own dump"
        ),
    }
    built
}

/// A kernel table followed: the number of the `kernel` input, the table's number, and the
/// thread that keeps it and compiles the forwarding table.
struct Follower {
    port: usize,
    table: u32,
    builder: builder::Builder,
}

struct Counters {
    forwarded: Counter,
    bad_header: Counter,
    not_ours: Counter,
    no_route: Counter,
    ttl_exceeded: Counter,
    too_big: Counter,
    arp_replies: Counter,
    arp_requests: Counter,
    arp_queue_drops: Counter,
    icmp_sent: Counter,
    icmp_rate_limited: Counter,
    echo_replies: Counter,
    local_drops: Counter,
    scope_drops: Counter,
    parameter_problems: Counter,
    ignored: Counter,
    advertisements: Counter,
    punted: Counter,
    from_host: Counter,
    blackholed: Counter,
    link_down: Counter,
    compiles: Counter,
}

/// The forwarding tables compiled from the routing tables, each distinct next hop kept once.
struct Fib {
    v4: Lpm<u32>,
    hops4: Vec<Route>,
    /// ECMP groups: each a table of hop numbers, each hop as often as its weight.
    groups4: Vec<Box<[u32]>>,
    v6: Lpm6,
    hops6: Vec<Route6>,
    groups6: Vec<Box<[u32]>>,
    /// Packets sent through each hop of a group (per path), by hop number.
    group_packets4: Vec<u64>,
    group_packets6: Vec<u64>,
}

/// A forwarding-table value at or above this is an ECMP group's number plus it.
const GROUP: u32 = 1 << 31;
/// The most entries an ECMP group's table has: weights are scaled down to fit.
const GROUP_SLOTS: u32 = 256;

/// The IPv6 table: keyed on the addresses' top 64 bits when no prefix is longer than /64 (a
/// range boundary then always falls on a multiple of 2^64, so comparing top halves gives the
/// same answer with half the bytes), on whole addresses otherwise.
enum Lpm6 {
    Top64(Lpm<u64>),
    Whole(Lpm<u128>),
}

impl Lpm6 {
    fn build(direct_bits: u32, routes: Vec<(u128, u8, u32)>) -> Result<Lpm6, LpmError> {
        if routes.iter().all(|&(_, len, _)| len <= 64) {
            let top = routes
                .into_iter()
                .map(|(a, len, hop)| ((a >> 64) as u64, len, hop));
            Lpm::build(direct_bits, top).map(Lpm6::Top64)
        } else {
            Lpm::build(direct_bits, routes).map(Lpm6::Whole)
        }
    }

    #[inline]
    fn lookup(&self, a: u128) -> Option<u32> {
        match self {
            Lpm6::Top64(t) => t.lookup((a >> 64) as u64),
            Lpm6::Whole(t) => t.lookup(a),
        }
    }

    #[inline]
    fn prefetch(&self, a: u128) {
        match self {
            Lpm6::Top64(t) => t.prefetch((a >> 64) as u64),
            Lpm6::Whole(t) => t.prefetch(a),
        }
    }

    #[inline]
    fn prefetch_ranges(&self, a: u128) {
        match self {
            Lpm6::Top64(t) => t.prefetch_ranges((a >> 64) as u64),
            Lpm6::Whole(t) => t.prefetch_ranges(a),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Lpm6::Top64(t) => t.bytes(),
            Lpm6::Whole(t) => t.bytes(),
        }
    }
}

/// Direct-table bits for `routes` routes: about two buckets per route, 256 at least (a router
/// of a few connected routes stays small), 2^20 at most (DXR's D20: 8 MiB of direct table).
/// With a million IPv4 routes, D20 leaves a bucket about one range and D18 about five, a run
/// that often spans two lines: lookups alone ran 1.2–1.4× faster with D20 (criterion, run of
/// 2026-11-27, commit fe7d6d2).
fn direct_bits(routes: usize) -> u32 {
    (routes.max(1).ilog2() + 2).clamp(8, 20)
}

/// Gives each distinct next hop a number, in the order first met.
fn intern<R: Copy + Eq + std::hash::Hash>(
    hops: &mut Vec<R>,
    seen: &mut HashMap<R, u32>,
    r: R,
) -> u32 {
    *seen.entry(r).or_insert_with(|| {
        hops.push(r);
        hops.len() as u32 - 1
    })
}

/// Numbers the hops and ECMP groups of one family's routes.
struct Hops<A> {
    hops: Vec<Route<A>>,
    seen: HashMap<Route<A>, u32>,
    groups: Vec<Box<[u32]>>,
    seen_groups: HashMap<Box<[u32]>, u32>,
}

impl<A: Copy + Eq + std::hash::Hash> Hops<A> {
    fn new() -> Self {
        Hops {
            hops: Vec::new(),
            seen: HashMap::new(),
            groups: Vec::new(),
            seen_groups: HashMap::new(),
        }
    }

    /// The forwarding-table value of ways out `(route, weight)`: one hop, or a group.
    fn value(&mut self, ways: &[(Route<A>, u16)]) -> u32 {
        if let [(r, _)] = ways {
            return intern(&mut self.hops, &mut self.seen, *r);
        }
        let total: u32 = ways.iter().map(|&(_, w)| w as u32).sum();
        let scale = total.div_ceil(GROUP_SLOTS).max(1);
        let mut slots = Vec::new();
        for &(r, w) in ways {
            let h = intern(&mut self.hops, &mut self.seen, r);
            slots.extend(std::iter::repeat_n(h, (w as u32 / scale).max(1) as usize));
        }
        let slots = slots.into_boxed_slice();
        let groups = &mut self.groups;
        GROUP
            + *self.seen_groups.entry(slots.clone()).or_insert_with(|| {
                groups.push(slots);
                groups.len() as u32 - 1
            })
    }
}

/// What the kernel table adds, by family: each prefix with its ways out (none: it drops).
type KernelRoutes = (
    Vec<(Ipv4Net, Vec<(Route, u16)>)>,
    Vec<(Ipv6Net, Vec<(Route6, u16)>)>,
);

fn compile(
    routes: &PrefixMap<Ipv4Net, Route>,
    routes6: &PrefixMap<Ipv6Net, Route6>,
    kernel: &KernelRoutes,
) -> Result<Fib, String> {
    let drop4 = [(
        Route {
            port: DROP,
            via: None,
        },
        1,
    )];
    let mut h4 = Hops::new();
    let mut table4: Vec<(u32, u8, u32)> = Vec::with_capacity(routes.len() + kernel.0.len());
    for (n, ways) in &kernel.0 {
        if routes.get(n).is_none() {
            let ways = if ways.is_empty() { &drop4[..] } else { ways };
            table4.push((u32::from(n.network()), n.prefix_len(), h4.value(ways)));
        }
    }
    for (n, r) in routes.iter() {
        table4.push((u32::from(n.network()), n.prefix_len(), h4.value(&[(*r, 1)])));
    }
    let v4 =
        Lpm::build(direct_bits(table4.len()), table4).map_err(|e| format!("IPv4 routes: {e}"))?;
    let drop6 = [(
        Route6 {
            port: DROP,
            via: None,
        },
        1,
    )];
    let mut h6 = Hops::new();
    let mut table6: Vec<(u128, u8, u32)> = Vec::with_capacity(routes6.len() + kernel.1.len());
    for (n, ways) in &kernel.1 {
        if routes6.get(n).is_none() {
            let ways = if ways.is_empty() { &drop6[..] } else { ways };
            table6.push((u128::from(n.network()), n.prefix_len(), h6.value(ways)));
        }
    }
    for (n, r) in routes6.iter() {
        table6.push((
            u128::from(n.network()),
            n.prefix_len(),
            h6.value(&[(*r, 1)]),
        ));
    }
    let v6 =
        Lpm6::build(direct_bits(table6.len()), table6).map_err(|e| format!("IPv6 routes: {e}"))?;
    Ok(Fib {
        v4,
        group_packets4: vec![0; h4.hops.len()],
        hops4: h4.hops,
        groups4: h4.groups,
        v6,
        group_packets6: vec![0; h6.hops.len()],
        hops6: h6.hops,
        groups6: h6.groups,
    })
}

/// Frames looked up together: their table entries are prefetched, all of them, before the
/// first is routed, so that the memory accesses of a batch overlap.
const LOOKUP_BATCH: usize = 16;

impl Fib {
    /// Prefetches the lookups of a batch of frames in two rounds: the direct-table entries, then
    /// the ranges they point to.
    fn prefetch(&self, batch: &[Packet]) {
        for p in batch {
            match destination(p.data()) {
                Some(IpAddr::V4(a)) => self.v4.prefetch(u32::from(a)),
                Some(IpAddr::V6(a)) => self.v6.prefetch(u128::from(a)),
                None => {}
            }
        }
        for p in batch {
            match destination(p.data()) {
                Some(IpAddr::V4(a)) => self.v4.prefetch_ranges(u32::from(a)),
                Some(IpAddr::V6(a)) => self.v6.prefetch_ranges(u128::from(a)),
                None => {}
            }
        }
    }

    /// The route to `dst` and its hop number; of an ECMP group, the hop `flow` (the packet's
    /// flow hash, asked only then) chooses.
    #[inline]
    fn route4(&mut self, dst: Ipv4Addr, flow: impl FnOnce() -> u32) -> Option<(usize, Route)> {
        let mut h = self.v4.lookup(u32::from(dst))?;
        if h >= GROUP {
            let g = &self.groups4[(h - GROUP) as usize];
            h = g[slot(flow(), g.len())];
            self.group_packets4[h as usize] += 1;
        }
        Some((h as usize, self.hops4[h as usize]))
    }

    /// The route to `dst` and its hop number, as [`Fib::route4`].
    #[inline]
    fn route6(&mut self, dst: Ipv6Addr, flow: impl FnOnce() -> u32) -> Option<(usize, Route6)> {
        let mut h = self.v6.lookup(u128::from(dst))?;
        if h >= GROUP {
            let g = &self.groups6[(h - GROUP) as usize];
            h = g[slot(flow(), g.len())];
            self.group_packets6[h as usize] += 1;
        }
        Some((h as usize, self.hops6[h as usize]))
    }

    /// Each ECMP path with the packets sent through it, for `stitch show`.
    fn paths(&self, names: &[String]) -> Vec<serde_json::Value> {
        fn of<A: std::fmt::Display + Copy>(
            hops: &[Route<A>],
            packets: &[u64],
            names: &[String],
        ) -> impl Iterator<Item = serde_json::Value> {
            (hops.iter().zip(packets))
                .filter(|(_, &n)| n > 0)
                .map(|(r, n)| {
                    serde_json::json!({ "port": names.get(r.port), "via": r.via.map(|v| v.to_string()), "packets": n })
                })
                .collect::<Vec<_>>()
                .into_iter()
        }
        of(&self.hops4, &self.group_packets4, names)
            .chain(of(&self.hops6, &self.group_packets6, names))
            .collect()
    }
}

/// The slot of `len` a flow hash chooses, by its high bits (Lemire's multiply-shift: no
/// division, and the bits a multiplicative hash spreads best).
#[inline]
fn slot(hash: u32, len: usize) -> usize {
    ((hash as u64 * len as u64) >> 32) as usize
}

/// A hash of an IPv4 packet's flow — addresses, protocol and, for TCP, UDP and SCTP in a first
/// fragment, ports — choosing its path in an ECMP group: a flow keeps its path.
#[inline]
fn flow_hash4(ip: &[u8]) -> u32 {
    let proto = ipv4::PROTOCOL.get(ip);
    let ports = match proto {
        stitch_wire::ip_proto::TCP | stitch_wire::ip_proto::UDP | stitch_wire::ip_proto::SCTP
            if ipv4::FLAGS_FRAG.get(ip) & ipv4::OFFSET == 0 =>
        {
            header::l4::PORTS
                .try_get(&ip[ipv4::header_len(ip)..])
                .unwrap_or(0)
        }
        _ => 0,
    };
    let addrs = u64::from(ipv4::SRC.get(ip)) << 32 | u64::from(ipv4::DST.get(ip));
    mix(addrs ^ (u64::from(ports) << 8 | u64::from(proto)).rotate_left(17))
}

/// A 64-bit value folded to 32 bits whose high ones are well spread (halves folded, then a
/// multiply by the golden ratio's odd constant, Fibonacci hashing): [`slot`] reads those.
#[inline]
fn mix(x: u64) -> u32 {
    ((x ^ x >> 32).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32
}

/// The destination address of an untagged IPv4 or IPv6 frame long enough to hold it.
#[inline]
fn destination(d: &[u8]) -> Option<IpAddr> {
    match u16::from_be_bytes(d.get(12..14)?.try_into().ok()?) {
        ethertype::IPV4 => {
            let a: [u8; 4] = d.get(30..34)?.try_into().ok()?;
            Some(IpAddr::from(a))
        }
        ethertype::IPV6 => {
            let a: [u8; 16] = d.get(38..54)?.try_into().ok()?;
            Some(IpAddr::from(a))
        }
        _ => None,
    }
}

/// What `build` makes of a config: interfaces and both routing tables.
type Tables = (
    Vec<Iface>,
    PrefixMap<Ipv4Net, Route>,
    PrefixMap<Ipv6Net, Route6>,
);

fn build(c: &RouterConfig) -> Result<Tables, String> {
    let mut ifaces = Vec::new();
    let mut routes = PrefixMap::new();
    let mut routes6 = PrefixMap::new();
    for (i, (name, ic)) in c.interfaces.iter().enumerate() {
        let net: Ipv4Net = ic
            .address
            .parse()
            .map_err(|_| format!("interface `{name}`: `{}` is not ADDRESS/PREFIX", ic.address))?;
        let net6: Option<Ipv6Net> = ic
            .address6
            .as_deref()
            .map(|a| {
                a.parse()
                    .map_err(|_| format!("interface `{name}`: `{a}` is not an IPv6 ADDRESS/PREFIX"))
            })
            .transpose()?;
        if !(1280..=9000).contains(&ic.mtu) {
            return Err(format!("interface `{name}`: mtu must be 1280..=9000"));
        }
        if ic.advertise && net6.is_none() {
            return Err(format!(
                "interface `{name}`: `advertise` needs an `address6` whose prefix to advertise"
            ));
        }
        let mac = parse_mac(&ic.mac).map_err(|e| format!("interface `{name}`: {e}"))?;
        ifaces.push(Iface {
            mac,
            addr: net.addr(),
            addr6: net6.map(|n| n.addr()),
            ll6: net6.map(|_| stitch_wire::ndp::link_local(mac)),
            prefix6: net6.map(|n| n.trunc()),
            advertise: ic.advertise,
            mtu: ic.mtu,
            up: true,
        });
        routes.insert(net.trunc(), Route { port: i, via: None });
        if let Some(n) = net6 {
            routes6.insert(n.trunc(), Route6 { port: i, via: None });
        }
    }
    if ifaces.is_empty() {
        return Err("a router needs at least one interface".into());
    }
    if !(4..=1800).contains(&c.ra_interval) {
        return Err("`ra_interval` must be 4..=1800 seconds (RFC 4861 §6.2.1)".into());
    }
    for (k, r) in c.routes.iter().enumerate() {
        let unreachable = || {
            format!(
                "route {}: next hop {} is on no interface's subnet",
                k + 1,
                r.via
            )
        };
        let bad = || {
            format!(
                "route {}: `{}` is not a prefix of the next hop's family",
                k + 1,
                r.prefix
            )
        };
        match r.via {
            IpAddr::V4(via) => {
                let net: Ipv4Net = r.prefix.parse().map_err(|_| bad())?;
                let port = routes
                    .get_lpm(&Ipv4Net::from(via))
                    .map(|(_, r)| r.port)
                    .ok_or_else(unreachable)?;
                routes.insert(
                    net.trunc(),
                    Route {
                        port,
                        via: Some(via),
                    },
                );
            }
            IpAddr::V6(via) => {
                let net: Ipv6Net = r.prefix.parse().map_err(|_| bad())?;
                let port = routes6
                    .get_lpm(&Ipv6Net::from(via))
                    .map(|(_, r)| r.port)
                    .ok_or_else(unreachable)?;
                routes6.insert(
                    net.trunc(),
                    Route6 {
                        port,
                        via: Some(via),
                    },
                );
            }
        }
    }
    Ok((ifaces, routes, routes6))
}

impl Router {
    /// One frame from interface `port`: ARP, IPv4 or IPv6.
    #[inline]
    fn handle(&mut self, port: usize, p: Packet, now: Instant, out: &mut Vec<(usize, Packet)>) {
        let d = p.data();
        if d.len() < 14 {
            self.c.bad_header.add(1);
            return;
        }
        let for_us = d[0..6] == self.ifaces[port].mac || d[0] & 1 == 1;
        if !for_us {
            self.c.not_ours.add(1);
            return;
        }
        match header::ethernet::ETHERTYPE.get(d) {
            ethertype::ARP => self.arp(port, d, now, out),
            ethertype::IPV4 => self.route(port, p, now, out),
            ethertype::IPV6 => self.route6(port, p, now, out),
            _ => self.c.not_ours.add(1),
        }
    }

    fn icmp_allowed(&mut self, now: Instant) -> bool {
        if self.icmp_limit.allow(now) {
            true
        } else {
            self.c.icmp_rate_limited.add(1);
            false
        }
    }

    /// An ICMP error (`kind`, `code`) about the IPv4 packet at `d[14..]`, from interface `port`.
    fn icmp_error(
        &mut self,
        d: &[u8],
        port: usize,
        kind: u8,
        code: u8,
        extra: u32,
        now: Instant,
    ) -> Option<(usize, Packet)> {
        if !self.icmp_allowed(now) {
            return None;
        }
        let ip = &d[14..];
        let ihl = ipv4::header_len(ip);
        // Never about ICMP errors themselves, nor about non-first fragments.
        if ipv4::PROTOCOL.get(ip) == ICMP
            && ip
                .get(ihl)
                .is_some_and(|t| !matches!(*t, icmpv4::ECHO_REPLY | icmpv4::ECHO_REQUEST))
        {
            return None;
        }
        let quote = &ip[..ip.len().min(ihl + 8)];
        let mut body = vec![kind, code, 0, 0, 0, 0, 0, 0];
        icmp::REST.set(&mut body, extra);
        body.extend_from_slice(quote);
        let cs = checksum::checksum(&body);
        icmp::CHECKSUM.set(&mut body, cs);
        let src = self.ifaces[port].addr;
        let dst = Ipv4Addr::from(ipv4::SRC.get(ip));
        let sender_mac = d[6..12].try_into().expect("an Ethernet header");
        let p = self.ipv4_frame(port, sender_mac, src, dst, ICMP, &body)?;
        self.c.icmp_sent.add(1);
        Some((port, p))
    }

    fn ipv4_frame(
        &self,
        port: usize,
        dst_mac: [u8; 6],
        src: Ipv4Addr,
        dst: Ipv4Addr,
        proto: u8,
        body: &[u8],
    ) -> Option<Packet> {
        let mut f = Vec::with_capacity(34 + body.len());
        f.extend_from_slice(&dst_mac);
        f.extend_from_slice(&self.ifaces[port].mac);
        f.extend_from_slice(&ethertype::IPV4.to_be_bytes());
        f.extend_from_slice(&stitch_wire::ipv4_header(
            src,
            dst,
            proto,
            body.len(),
            false,
        ));
        f.extend_from_slice(body);
        if f.len() < 60 {
            f.resize(60, 0);
        }
        pool::alloc_with(&f)
    }

    fn arp_frame(
        &self,
        port: usize,
        op: u16,
        target_mac: [u8; 6],
        target_ip: Ipv4Addr,
        eth_dst: [u8; 6],
    ) -> Option<Packet> {
        let me = &self.ifaces[port];
        pool::alloc_with(&arp::frame(
            eth_dst,
            me.mac,
            op,
            (me.mac, me.addr),
            (target_mac, target_ip),
        ))
    }

    fn arp(&mut self, port: usize, d: &[u8], now: Instant, out: &mut Vec<(usize, Packet)>) {
        let Some(m) = arp::Message::read(d) else {
            return;
        };
        // Learn (or refresh) the sender when it is a neighbour we care about or addressed us.
        let for_us = m.target_ip == self.ifaces[port].addr;
        if for_us || self.neighbors.knows(port, m.sender_ip) {
            self.neighbors
                .learn(port, m.sender_ip, m.sender_mac, now, self.arp_timeout, out);
        }
        if m.is_request() && for_us {
            if let Some(r) = self.arp_frame(port, 2, m.sender_mac, m.sender_ip, m.sender_mac) {
                self.c.arp_replies.add(1);
                out.push((port, r));
            }
        }
        if for_us {
            // The host learns its neighbours too (and answers its own questions' replies).
            // ARP has no checksum: a copy of the bytes is the whole message.
            if let (Some(base), Some(p)) = (self.host_base, pool::alloc_with(d)) {
                self.c.punted.add(1);
                out.push((base + port, p));
            }
        }
    }

    /// Sends `p` (destination MAC to be filled) to `next`, resolving it if needed.
    fn send_to_neighbor(
        &mut self,
        next: NextHop<Ipv4Addr>,
        p: Packet,
        now: Instant,
        out: &mut Vec<(usize, Packet)>,
    ) {
        if self
            .neighbors
            .send(next, p, now, self.arp_timeout, out, &self.c.arp_queue_drops)
        {
            if let Some(q) = self.arp_frame(next.port, 1, [0; 6], next.addr, [0xff; 6]) {
                self.c.arp_requests.add(1);
                out.push((next.port, q));
            }
        }
    }

    fn local(&mut self, port: usize, mut p: Packet, now: Instant, out: &mut Vec<(usize, Packet)>) {
        let ip = &p.data()[14..];
        let ihl = ipv4::header_len(ip);
        let total = ipv4::TOTAL_LEN.get(ip) as usize;
        if ipv4::PROTOCOL.get(ip) != ICMP
            || ip.get(ihl) != Some(&icmpv4::ECHO_REQUEST)
            || total > ip.len()
        {
            match self.host_base {
                // BGP, BFD, SSH, ICMP errors: up to the host.
                Some(base) => {
                    self.c.punted.add(1);
                    out.push((base + port, p));
                }
                None => self.c.local_drops.add(1),
            }
            return;
        }
        // Echo request → echo reply: swap addresses, type 0, incremental checksum.
        let d = p.data_mut();
        let (mac_src, mac_dst): ([u8; 6], [u8; 6]) =
            (d[6..12].try_into().unwrap(), d[0..6].try_into().unwrap());
        d[0..6].copy_from_slice(&mac_src);
        d[6..12].copy_from_slice(&mac_dst);
        let ip = &mut d[14..];
        let (s, t) = (ipv4::SRC.get(ip), ipv4::DST.get(ip));
        ipv4::SRC.set(ip, t);
        ipv4::DST.set(ip, s);
        ipv4::TTL.set(ip, 64);
        ipv4::fill_checksum(&mut ip[..ihl]);
        let echo = &mut ip[ihl..];
        echo[0] = icmpv4::ECHO_REPLY;
        // The type and code word changed from request to reply (code 0 both).
        let (request, reply) = ([icmpv4::ECHO_REQUEST, 0], [icmpv4::ECHO_REPLY, 0]);
        let old = icmp::CHECKSUM.get(echo);
        let new = checksum::update(old, u16::from_be_bytes(request), u16::from_be_bytes(reply));
        icmp::CHECKSUM.set(echo, new);
        self.c.echo_replies.add(1);
        let _ = now;
        out.push((port, p));
    }

    fn route(&mut self, port: usize, mut p: Packet, now: Instant, out: &mut Vec<(usize, Packet)>) {
        let d = p.data();
        let ip = &d[14..];
        let Some(total) = ipv4::lengths(ip)
            .filter(|&(ihl, _)| checksum::checksum(&ip[..ihl]) == 0)
            .map(|(_, total)| total)
        else {
            self.c.bad_header.add(1);
            return;
        };
        let dst = Ipv4Addr::from(ipv4::DST.get(ip));
        if self.ifaces.iter().any(|i| i.addr == dst) {
            return self.local(port, p, now, out);
        }
        if let Some(base) = (self.host_base).filter(|_| dst.is_multicast() || dst.is_broadcast()) {
            // OSPF's hellos (224.0.0.5), RIP, VRRP: the host's daemons' business.
            self.c.punted.add(1);
            out.push((base + port, p));
            return;
        }
        if ipv4::TTL.get(ip) <= 1 {
            self.c.ttl_exceeded.add(1);
            if let Some(e) = self.icmp_error(
                d,
                port,
                icmpv4::TIME_EXCEEDED,
                icmpv4::CODE_TTL_EXCEEDED,
                0,
                now,
            ) {
                out.push(e);
            }
            return;
        }
        let Some((h, r)) = self.fib.route4(dst, || flow_hash4(&d[14..])) else {
            self.c.no_route.add(1);
            if let Some(e) = self.icmp_error(
                d,
                port,
                icmpv4::DESTINATION_UNREACHABLE,
                icmpv4::CODE_NET_UNREACHABLE,
                0,
                now,
            ) {
                out.push(e);
            }
            return;
        };
        if r.port == DROP {
            self.c.blackholed.add(1);
            return;
        }
        if !self.ifaces[r.port].up {
            self.c.link_down.add(1);
            return;
        }
        let mtu = self.ifaces[r.port].mtu;
        let df = ipv4::dont_fragment(ip);
        if total > mtu && p.header().gso_size == 0 {
            if df {
                self.c.too_big.add(1);
                if let Some(e) = self.icmp_error(
                    d,
                    port,
                    icmpv4::DESTINATION_UNREACHABLE,
                    icmpv4::CODE_FRAGMENTATION_NEEDED,
                    mtu as u32,
                    now,
                ) {
                    out.push(e);
                }
            } else {
                self.c.too_big.add(1); // fragmentation is not done here: counted and dropped
            }
            return;
        }
        let d = p.data_mut();
        ipv4::decrement_ttl(&mut d[14..]);
        d[6..12].copy_from_slice(&self.ifaces[r.port].mac);
        self.c.forwarded.add(1);
        self.send_to_neighbor(r.next_hop(dst, h), p, now, out);
    }
}

impl Router {
    /// Compiles the forwarding table again from the configured routes and the kernel's. The
    /// neighbours stay; the gateways' adjacencies are asked again (hop numbers changed).
    fn compile_again(&mut self) -> Result<(), String> {
        if let Some(k) = &self.kernel {
            // With the kernel's routes, by the builder: swapped in when it is ready.
            k.builder.configured(self.configured());
            return Ok(());
        }
        let fib = compile(&self.routes, &self.routes6, &Default::default())?;
        self.swap(fib);
        Ok(())
    }

    /// Forwards by `fib` from now on.
    fn swap(&mut self, fib: Fib) -> Fib {
        self.neighbors.gateways = vec![None; fib.hops4.len()];
        self.neighbors6.gateways = vec![None; fib.hops6.len()];
        self.c.compiles.add(1);
        std::mem::replace(&mut self.fib, fib)
    }

    /// A table compiled from the kernel's routes, and its host sides' state, in use.
    fn take_built(&mut self, built: builder::Built) {
        let old = self.swap(*built.fib);
        if let Some(k) = &self.kernel {
            k.builder.retire(Box::new(old));
        }
        self.host_links = built.links;
        self.follow_host_links();
    }

    fn configured(&self) -> builder::Configured {
        builder::Configured {
            routes: self.routes.clone(),
            routes6: self.routes6.clone(),
            names: self.port_names.clone(),
        }
    }

    /// Each interface takes the state and MTU of its host side, where the kernel told of it
    /// (an operator's `ip link set wan down` or `mtu 1400` on the TAP, a daemon's).
    fn follow_host_links(&mut self) {
        for (iface, link) in self.ifaces.iter_mut().zip(&self.host_links) {
            if let Some(l) = link {
                iface.up = l.up;
                if let Some(mtu) = l.mtu {
                    iface.mtu = mtu;
                }
            }
        }
    }

    /// Sends a copy of `p` up interface `port`'s host port, if it has one — with its offload
    /// state: a TCP segment's checksum may still be partial (the host completes it).
    fn copy_to_host(&self, port: usize, p: &Packet, out: &mut Vec<(usize, Packet)>) {
        if let Some(base) = self.host_base {
            if let Some(p) = p.try_clone() {
                self.c.punted.add(1);
                out.push((base + port, p));
            }
        }
    }
}

impl App for Router {
    type Config = RouterConfig;
    const EXAMPLE: &'static str = r#"interfaces:
  lan: { mac: "02:00:00:00:01:01", address: 10.0.1.1/24, address6: "2001:db8:1::1/64", advertise: true }
  wan: { mac: "02:00:00:00:02:01", address: 192.0.2.2/24 }
routes:
  - { prefix: 0.0.0.0/0, via: 192.0.2.1 }
"#;

    fn declare(c: &RouterConfig) -> Result<PortSpec, AppError> {
        build(c)?;
        let mut names: Vec<String> = c.interfaces.keys().cloned().collect();
        if c.host_ports {
            let host: Vec<String> = names.iter().map(|n| host_port_name(n)).collect();
            names.extend(host);
        }
        let mut inputs = names.clone();
        if c.kernel_table.is_some() {
            inputs.push(KERNEL_INPUT.into());
        }
        Ok(PortSpec {
            inputs: PortNames::Fixed(inputs),
            outputs: PortNames::Fixed(names),
        })
    }

    fn new(c: RouterConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let (ifaces, routes, routes6) = build(&c)?;
        let fib = compile(&routes, &routes6, &Default::default())?;
        let n = ifaces.len();
        let host_base = c.host_ports.then_some(n);
        let kernel = match c.kernel_table {
            Some(table) => {
                let configured = builder::Configured {
                    routes: routes.clone(),
                    routes6: routes6.clone(),
                    names: c.interfaces.keys().cloned().collect(),
                };
                Some(Follower {
                    port: n * (1 + c.host_ports as usize),
                    table,
                    builder: builder::Builder::start(table, configured, ctx.name())?,
                })
            }
            None => None,
        };
        // Taking over at an upgrade: forward by the predecessor's kernel table from the first
        // breath, while this one's own dump comes (2.8 s at a million routes).
        let inherited = match (&kernel, ctx.take_inherited()) {
            (Some(k), Some(d)) => inherit_kernel_table(k, d),
            _ => None,
        };
        let (neighbors, neighbors6) = (
            NeighborTable::new(fib.hops4.len()),
            NeighborTable::new(fib.hops6.len()),
        );
        let ra = v6::Advertising::new(&ifaces, Duration::from_secs(c.ra_interval));
        let k = |n: &str| ctx.counter(n);
        let mut router = Router {
            port_names: c.interfaces.keys().cloned().collect(),
            ifaces,
            routes,
            routes6,
            fib,
            neighbors,
            neighbors6,
            arp_timeout: Duration::from_secs(c.arp_timeout),
            icmp_limit: RateLimit::new(c.icmp_rate),
            pending: Vec::with_capacity(ARP_QUEUE + 2),
            batch: Vec::with_capacity(LOOKUP_BATCH),
            ra,
            host_base,
            kernel,
            host_links: Vec::new(),
            c: Counters {
                forwarded: k("forwarded"),
                bad_header: k("bad_ipv4_header_drops"),
                not_ours: k("not_for_us_drops"),
                no_route: k("no_route_drops"),
                ttl_exceeded: k("ttl_exceeded_drops"),
                too_big: k("too_big_drops"),
                arp_replies: k("arp_replies"),
                arp_requests: k("arp_requests"),
                arp_queue_drops: k("arp_queue_drops"),
                icmp_sent: k("icmp_errors_sent"),
                icmp_rate_limited: k("icmp_rate_limited"),
                echo_replies: k("echo_replies"),
                local_drops: k("local_drops"),
                scope_drops: k("scope_drops"),
                parameter_problems: k("parameter_problems_sent"),
                ignored: k("ignored_local"),
                advertisements: k("router_advertisements"),
                punted: k("punted_to_host"),
                from_host: k("from_host"),
                blackholed: k("blackhole_drops"),
                link_down: k("link_down_drops"),
                compiles: k("table_compiles"),
            },
            final_word: false,
        };
        if let Some(built) = inherited {
            router.take_built(built);
        }
        Ok(router)
    }

    fn push(&mut self, io: &mut Io) {
        let now = Instant::now();
        let (inputs, outputs) = io.split();
        let mut out = std::mem::take(&mut self.pending);
        let mut batch = std::mem::take(&mut self.batch);
        for (port, input) in inputs.iter_mut().enumerate() {
            let Some(input) = input.as_mut() else {
                continue;
            };
            if let Some(k) = &self.kernel {
                if port == k.port {
                    // The breath's messages to the builder in one piece (each message's length
                    // kept to netlink's 4-byte alignment, as in a datagram).
                    let mut bytes = Vec::new();
                    for p in input.drain() {
                        bytes.extend_from_slice(p.data());
                        bytes.resize(bytes.len().next_multiple_of(4), 0);
                    }
                    if !bytes.is_empty() {
                        k.builder.messages(bytes);
                    }
                    continue;
                }
            }
            if let Some(base) = self.host_base.filter(|&b| port >= b) {
                // From the host side: out of the interface as it is.
                for p in input.drain() {
                    self.c.from_host.add(1);
                    transmit_to(&mut outputs[port - base], p);
                }
                continue;
            }
            if !self.ifaces[port].up {
                let dropped = input.drain().count();
                self.c.link_down.add(dropped as u64);
                continue;
            }
            loop {
                batch.extend(input.drain().take(LOOKUP_BATCH));
                if batch.is_empty() {
                    break;
                }
                self.fib.prefetch(&batch);
                for p in batch.drain(..) {
                    self.handle(port, p, now, &mut out);
                    for (o, q) in out.drain(..) {
                        transmit_to(&mut outputs[o], q);
                    }
                }
            }
        }
        self.pending = out;
        self.batch = batch;
    }

    /// A new config with the same ports (interfaces, host ports, kernel table) is taken in
    /// place: addresses, static routes and timers change, and the neighbours and the kernel's
    /// routes stay (the `kernel_routes` app, unchanged, would not send them again).
    fn reconfigure(
        &mut self,
        c: RouterConfig,
        _ctx: &mut AppContext,
    ) -> Result<stitch_core::Reconfigured, AppError> {
        let same_ports = c.interfaces.keys().eq(self.port_names.iter())
            && c.host_ports == self.host_base.is_some()
            && c.kernel_table == self.kernel.as_ref().map(|k| k.table);
        if !same_ports {
            return Ok(stitch_core::Reconfigured::Restart);
        }
        let (ifaces, routes, routes6) = build(&c)?;
        self.ra = v6::Advertising::new(&ifaces, Duration::from_secs(c.ra_interval));
        self.ifaces = ifaces;
        self.follow_host_links();
        self.routes = routes;
        self.routes6 = routes6;
        self.arp_timeout = Duration::from_secs(c.arp_timeout);
        self.icmp_limit = RateLimit::new(c.icmp_rate);
        self.compile_again()?;
        Ok(stitch_core::Reconfigured::Done)
    }

    /// At an upgrade, the kernel table followed: a memfd its thread fills (forwarding goes
    /// on) and the successor reads, so that it forwards by the learnt routes from its first
    /// breath instead of only once its own dump is compiled. Nothing at the final word.
    fn hand_over(&mut self) -> Option<Descriptors> {
        let k = self.kernel.as_ref()?;
        if self.final_word {
            return None;
        }
        let lent = stitch_core::mapping::memfd("stitch-kernel-table", 0, false)
            .map(std::fs::File::from)
            .and_then(|f| Ok((f.try_clone()?, f)));
        match lent {
            Ok((for_thread, lent)) => {
                k.builder.export(for_thread);
                Some(Descriptors {
                    fds: vec![lent.into()],
                    position: serde_json::json!({ "kernel_table": k.table }),
                })
            }
            Err(e) => {
                log::warn!(
                    "router: no memfd for the kernel table ({e}): the successor dumps its own"
                );
                None
            }
        }
    }

    fn hold_for_hand_over(&mut self) {
        self.final_word = true;
    }

    fn carry_on(&mut self) {
        self.final_word = false;
    }

    /// The resolved neighbours with the time they had left: after a restart the router
    /// forwards at once instead of asking again while packets wait.
    fn snapshot(&self) -> Option<AppSnapshot> {
        let now = Instant::now();
        let state = RouterState {
            neighbors: self.neighbors.resolved(&self.port_names, now),
            neighbors6: self.neighbors6.resolved(&self.port_names, now),
        };
        Some(AppSnapshot::new(STATE_VERSION, state))
    }

    fn restore(&mut self, state: AppState) -> Result<(), String> {
        let saved: RouterState = serde_json::from_value(state.of_version(STATE_VERSION)?)
            .map_err(|e| format!("router state: {e}"))?;
        let now = Instant::now();
        let total = saved.neighbors.len() + saved.neighbors6.len();
        let kept = self
            .neighbors
            .take_back(&self.port_names, saved.neighbors, now)
            + self
                .neighbors6
                .take_back(&self.port_names, saved.neighbors6, now);
        log::info!("router: {kept} of {total} neighbours taken back from the snapshot");
        Ok(())
    }

    /// Routes and neighbours: `{"routes": [{prefix, port, via}], "neighbors": [...]}`.
    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        let limit = request["limit"].as_u64().unwrap_or(1000) as usize;
        let routes: Vec<_> = self
            .routes
            .iter()
            .take(limit)
            .map(|(p, r)| {
                serde_json::json!({ "prefix": p.to_string(), "port": self.port_names[r.port],
                                              "via": r.via.map(|v| v.to_string()) })
            })
            .collect();
        let now = Instant::now();
        let neighbors = self.neighbors.dump(&self.port_names, limit, now);
        let neighbors6 = self.neighbors6.dump(&self.port_names, limit, now);
        let kernel = (self.kernel.as_ref()).map(|k| serde_json::json!(k.builder.view()));
        serde_json::json!({ "route_count": self.routes.len(), "route6_count": self.routes6.len(),
                            "lookup_bytes": self.fib.v4.bytes() + self.fib.v6.bytes(),
                            "routes": routes, "neighbors": neighbors, "neighbors6": neighbors6,
                            "kernel": kernel, "ecmp_paths": self.fib.paths(&self.port_names) })
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        if let Some(built) = self.kernel.as_ref().and_then(|k| k.builder.take_built()) {
            self.take_built(built);
        }
        self.neighbors.expire(now);
        self.neighbors6.expire(now);
        let (_, outputs) = io.split();
        for (port, ra) in self.due_advertisements(now) {
            transmit_to(&mut outputs[port], ra);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::Consumer;
    use stitch_wire::build::{Frame, Transport};

    /// An IPv6 table with no prefix beyond /64 is keyed on the top halves and answers as the
    /// table on whole addresses does (itself checked against a linear scan in `lpm`), for
    /// addresses inside the prefixes and anywhere; one /128 route makes it whole again.
    #[test]
    fn ipv6_tables_of_prefixes_up_to_64_bits_key_on_the_top_half() {
        let mut rng = fastrand::Rng::with_seed(0x5eed);
        let random = |rng: &mut fastrand::Rng| (rng.u64(..) as u128) << 64 | rng.u64(..) as u128;
        let mut routes: Vec<(u128, u8, u32)> = Vec::new();
        for i in 0..3000 {
            let len = rng.u8(16..=64);
            let addr = if i > 0 && rng.u8(..).is_multiple_of(3) {
                let (a, _, _) = routes[rng.usize(..routes.len())];
                a ^ (random(&mut rng) >> rng.u32(16..64))
            } else {
                random(&mut rng)
            };
            routes.push((addr, len, rng.u32(..40)));
        }
        let whole = Lpm::<u128>::build(12, routes.iter().copied()).unwrap();
        let table = Lpm6::build(12, routes.clone()).unwrap();
        assert!(matches!(table, Lpm6::Top64(_)));
        for k in 0..20_000 {
            let addr = if k % 2 == 0 {
                let (a, len, _) = routes[rng.usize(..routes.len())];
                let host = u128::MAX.checked_shr(len as u32).unwrap_or(0);
                (a & !host) | (random(&mut rng) & host)
            } else {
                random(&mut rng)
            };
            assert_eq!(table.lookup(addr), whole.lookup(addr), "{addr:#x}");
        }
        routes.push((1, 128, 7));
        let table = Lpm6::build(12, routes).unwrap();
        assert!(matches!(table, Lpm6::Whole(_)));
        assert_eq!(table.lookup(1), Some(7));
    }

    const R_LAN: [u8; 6] = [2, 0, 0, 0, 1, 1];
    const R_WAN: [u8; 6] = [2, 0, 0, 0, 2, 1];
    const HOST: [u8; 6] = [2, 0, 0, 0, 1, 2];
    const GW: [u8; 6] = [2, 0, 0, 0, 2, 9];

    fn ipv4(dst: [u8; 4], ttl: u8) -> Vec<u8> {
        Frame::ipv4([10, 0, 1, 2], dst, Transport::udp(1000, 2000))
            .macs(HOST, R_LAN)
            .ttl(ttl)
            .payload_len(18)
            .bytes()
    }

    fn rig() -> (
        Router,
        Io,
        stitch_core::Producer,
        stitch_core::Producer,
        Consumer,
        Consumer,
    ) {
        let c: RouterConfig = serde_json::from_value(serde_json::json!({
            "interfaces": {
                "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24" },
                "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24" }
            },
            "routes": [ { "prefix": "0.0.0.0/0", "via": "192.0.2.9" }, { "prefix": "198.51.100.0/24", "via": "10.0.1.9" } ]
        }))
        .unwrap();
        Router::declare(&c).unwrap();
        let mut ctx = AppContext::new("r", std::path::Path::new("."), Default::default());
        let r = Router::new(c, &mut ctx).unwrap();
        let (io, [lan_in, wan_in], [lan_out, wan_out]) = crate::testing::ports(["lan", "wan"]);
        (r, io, lan_in, wan_in, lan_out, wan_out)
    }

    /// The default gateway's ARP answer to the router's wan address.
    fn gateway_answer() -> Vec<u8> {
        let mut reply = vec![0u8; 60];
        reply[0..6].copy_from_slice(&R_WAN);
        reply[6..12].copy_from_slice(&GW);
        reply[12..22].copy_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 2]);
        reply[22..28].copy_from_slice(&GW);
        reply[28..32].copy_from_slice(&[192, 0, 2, 9]);
        reply[32..38].copy_from_slice(&R_WAN);
        reply[38..42].copy_from_slice(&[192, 0, 2, 2]);
        reply
    }

    /// A restarted router given the old one's snapshot forwards to a resolved gateway at once,
    /// without asking again; another version is refused.
    #[test]
    fn resolved_neighbours_survive_a_restart_through_a_snapshot() {
        let (mut old, mut io, mut lan_in, mut wan_in, _lan_out, mut wan_out) = rig();
        lan_in.transmit(pkt(&ipv4([203, 0, 113, 5], 64)));
        old.push(&mut io);
        wan_in.transmit(pkt(&gateway_answer()));
        old.push(&mut io);
        assert_eq!(wan_out.drain().count(), 2, "the question, then the packet");
        let state = old.snapshot().unwrap().into_state().unwrap();
        let (mut new, mut io, mut lan_in, _wan_in, _lan_out, mut wan_out) = rig();
        let other = AppState {
            version: 9,
            state: state.state.clone(),
        };
        assert!(new.restore(other).unwrap_err().contains("version 9"));
        new.restore(state).unwrap();
        lan_in.transmit(pkt(&ipv4([203, 0, 113, 5], 64)));
        new.push(&mut io);
        let fwd: Vec<Packet> = wan_out.drain().collect();
        assert_eq!(fwd.len(), 1);
        assert_eq!(&fwd[0].data()[0..6], &GW[..], "straight to the gateway");
    }

    fn pkt(f: &[u8]) -> Packet {
        let mut p = pool::alloc().unwrap();
        p.set_data(f).unwrap();
        p
    }

    #[test]
    fn resolves_the_next_hop_then_forwards_with_ttl_and_checksum_updated() {
        let (mut r, mut io, mut lan_in, mut wan_in, mut lan_out, mut wan_out) = rig();
        lan_in.transmit(pkt(&ipv4([203, 0, 113, 5], 64)));
        r.push(&mut io);
        // Default route: the router asks who has 192.0.2.9 on wan; the packet waits.
        let asked: Vec<Packet> = wan_out.drain().collect();
        assert_eq!(asked.len(), 1);
        let a = asked[0].data();
        assert_eq!(
            (&a[12..14], a[21], &a[38..42]),
            (&[0x08u8, 0x06][..], 1, &[192u8, 0, 2, 9][..])
        );
        // The gateway answers; the waiting packet leaves toward it.
        wan_in.transmit(pkt(&gateway_answer()));
        r.push(&mut io);
        let fwd: Vec<Packet> = wan_out.drain().collect();
        assert_eq!(fwd.len(), 1);
        let d = fwd[0].data();
        assert_eq!((&d[0..6], &d[6..12], d[22]), (&GW[..], &R_WAN[..], 63));
        assert_eq!(
            checksum::checksum(&d[14..34]),
            0,
            "incremental checksum update"
        );
        // Now resolved: the next packet goes at once; a bad header is counted and dropped.
        lan_in.transmit(pkt(&ipv4([203, 0, 113, 6], 10)));
        let mut bad = ipv4([203, 0, 113, 7], 10);
        bad[24] ^= 0xff;
        lan_in.transmit(pkt(&bad));
        r.push(&mut io);
        assert_eq!(wan_out.drain().count(), 1);
        assert_eq!(r.c.bad_header.get(), 1);
        // The gateway answers again from a new MAC: packets follow it from the next one on.
        let moved = [2, 0, 0, 0, 2, 0x99];
        let mut reply = gateway_answer();
        reply[6..12].copy_from_slice(&moved);
        reply[22..28].copy_from_slice(&moved);
        wan_in.transmit(pkt(&reply));
        r.push(&mut io);
        lan_in.transmit(pkt(&ipv4([203, 0, 113, 8], 10)));
        r.push(&mut io);
        let fwd: Vec<Packet> = wan_out.drain().collect();
        assert_eq!(fwd.len(), 1);
        assert_eq!(&fwd[0].data()[0..6], &moved[..]);
        // Longest prefix: 198.51.100.0/24 goes back out of lan toward 10.0.1.9 (an ARP request).
        lan_in.transmit(pkt(&ipv4([198, 51, 100, 1], 10)));
        r.push(&mut io);
        let l: Vec<Packet> = lan_out.drain().collect();
        assert_eq!(l.len(), 1);
        assert_eq!(&l[0].data()[38..42], &[10, 0, 1, 9]);
    }

    /// Kernel route messages to the router's `kernel` input: 203.0.113.0/24 over two gateways
    /// of `wan` (192.0.2.9 and .10), a blackhole for 198.18.0.0/15, and another table's
    /// default route.
    fn send_kernel_routes(kernel: &mut stitch_core::Producer) {
        use stitch_wire::netlink::{self, kind, Path, Route as KRoute};
        let gw = |last: u8| Some(IpAddr::from([192, 0, 2, last]));
        let route = |dst: [u8; 4], len, kind, paths| KRoute {
            dst: IpAddr::from(dst),
            prefix_len: len,
            table: 254,
            kind,
            priority: 0,
            paths,
            nexthop: None,
        };
        let two = vec![
            Path {
                gateway: gw(9),
                oif: 0,
                weight: 1,
            },
            Path {
                gateway: gw(10),
                oif: 0,
                weight: 1,
            },
        ];
        for m in [
            netlink::route_message(
                kind::NEWROUTE,
                0,
                &route([203, 0, 113, 0], 24, netlink::RTN_UNICAST, two),
            ),
            netlink::route_message(
                kind::NEWROUTE,
                0,
                &route([198, 18, 0, 0], 15, netlink::RTN_BLACKHOLE, vec![]),
            ),
            // Another table's: not followed.
            netlink::route_message(
                kind::NEWROUTE,
                0,
                &KRoute {
                    table: 100,
                    ..route(
                        [0, 0, 0, 0],
                        0,
                        netlink::RTN_UNICAST,
                        vec![Path {
                            gateway: gw(9),
                            oif: 0,
                            weight: 1,
                        }],
                    )
                },
            ),
        ] {
            kernel.transmit(pkt(&m));
        }
    }

    /// Ticks `r` until the builder's first table is in use.
    fn wait_for_table(r: &mut Router, io: &mut Io) {
        // The builder compiles beside the worker; its table is taken at a tick.
        let asked = Instant::now();
        while r.c.compiles.get() == 0 {
            assert!(asked.elapsed() < Duration::from_secs(10), "no table built");
            std::thread::sleep(Duration::from_millis(5));
            r.tick(io, Instant::now());
        }
    }

    /// A router with host ports following a kernel table: a multipath route spreads flows
    /// over its gateways and keeps each flow on one; a blackhole drops; what is addressed to
    /// the router goes up its host port, ARP is copied up, and the host's frames leave by the
    /// interface.
    #[test]
    fn kernel_multipath_routes_spread_flows_and_the_host_ports_carry_the_control_plane() {
        let c: RouterConfig = serde_json::from_value(serde_json::json!({
            "interfaces": {
                "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24" },
                "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24" }
            },
            "host_ports": true, "kernel_table": 254
        }))
        .unwrap();
        let spec = Router::declare(&c).unwrap();
        assert!(matches!(&spec.inputs, PortNames::Fixed(n) if n.len() == 5 && n[4] == "kernel"));
        let mut ctx = AppContext::new("r", std::path::Path::new("."), Default::default());
        let mut r = Router::new(c, &mut ctx).unwrap();
        let (
            mut io,
            [mut lan_in, mut wan_in, _, mut host_wan_in, mut kernel],
            [_, mut wan_out, _, mut host_wan_out, _],
        ) = crate::testing::ports(["lan", "wan", "host_lan", "host_wan", "kernel"]);
        send_kernel_routes(&mut kernel);
        r.push(&mut io);
        wait_for_table(&mut r, &mut io);
        let view = r.query(&serde_json::json!({}))["kernel"].clone();
        assert_eq!(
            (view["routes"].as_u64(), view["pending"].as_bool()),
            (Some(2), Some(false)),
            "{view}"
        );
        let flow = |sport: u16, dst: [u8; 4]| {
            Frame::ipv4([10, 0, 1, 2], dst, Transport::udp(sport, 53))
                .macs(HOST, R_LAN)
                .payload_len(18)
                .bytes()
        };
        lan_in.transmit(pkt(&flow(1, [203, 0, 113, 5])));
        r.push(&mut io);
        // Both gateways answer whatever the router asked (one of them so far).
        let mac_of = |last: u8| [2, 0, 0, 0, 2, last];
        for last in [9u8, 10] {
            let mut answer = gateway_answer();
            answer[6..12].copy_from_slice(&mac_of(last));
            answer[22..28].copy_from_slice(&mac_of(last));
            answer[31] = last;
            wan_in.transmit(pkt(&answer));
        }
        r.push(&mut io);
        wan_out.drain().for_each(drop);
        assert_eq!(
            host_wan_out.drain().count(),
            2,
            "ARP for the router copied up"
        );
        for round in 0..2 {
            let mut sent: Vec<Packet> = Vec::new();
            for sport in 0..200u16 {
                lan_in.transmit(pkt(&flow(sport, [203, 0, 113, 5])));
                if sport % 32 == 31 {
                    r.push(&mut io);
                    sent.extend(wan_out.drain());
                }
            }
            r.push(&mut io);
            sent.extend(wan_out.drain());
            // Frames still waiting for the other gateway's answer arrive later: ask again.
            let by_9 = sent.iter().filter(|p| p.data()[0..6] == mac_of(9)).count();
            let by_10 = sent.iter().filter(|p| p.data()[0..6] == mac_of(10)).count();
            if round == 1 {
                assert_eq!(by_9 + by_10, 200, "every flow sent, once");
                assert!(by_9 > 40 && by_10 > 40, "spread: {by_9} and {by_10}");
            }
        }
        // A flow keeps its gateway.
        let gateway_of = |r: &mut Router,
                          io: &mut Io,
                          lan_in: &mut stitch_core::Producer,
                          wan_out: &mut Consumer| {
            lan_in.transmit(pkt(&flow(777, [203, 0, 113, 5])));
            r.push(io);
            wan_out.drain().next().unwrap().data()[0..6].to_vec()
        };
        let first = gateway_of(&mut r, &mut io, &mut lan_in, &mut wan_out);
        for _ in 0..5 {
            assert_eq!(
                gateway_of(&mut r, &mut io, &mut lan_in, &mut wan_out),
                first
            );
        }
        lan_in.transmit(pkt(&flow(1, [198, 18, 3, 4])));
        r.push(&mut io);
        assert_eq!(r.c.blackholed.get(), 1);
        // To the router itself (BGP's port): up the host port, as it came.
        let bgp = Frame::ipv4([192, 0, 2, 9], [192, 0, 2, 2], Transport::udp(40000, 179))
            .macs(mac_of(9), R_WAN)
            .payload_len(18)
            .bytes();
        wan_in.transmit(pkt(&bgp));
        r.push(&mut io);
        let up: Vec<Packet> = host_wan_out.drain().collect();
        assert_eq!(up.len(), 1);
        assert_eq!(up[0].data(), &bgp[..]);
        // The host's answer leaves by the interface unchanged.
        host_wan_in.transmit(pkt(&bgp));
        r.push(&mut io);
        let out: Vec<Packet> = wan_out.drain().collect();
        assert_eq!((out.len(), out[0].data()), (1, &bgp[..]));
        assert_eq!(r.c.from_host.get(), 1);
    }

    #[test]
    fn bad_configs_are_refused() {
        let c: RouterConfig = serde_json::from_value(serde_json::json!({
            "interfaces": { "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24" } },
            "routes": [ { "prefix": "0.0.0.0/0", "via": "192.0.2.9" } ]
        }))
        .unwrap();
        let e = Router::declare(&c).unwrap_err().to_string();
        assert!(
            e.contains("route 1") && e.contains("on no interface"),
            "{e}"
        );
    }
}
