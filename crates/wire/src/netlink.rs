//! The kernel's routing messages (rtnetlink, RFC 3549; `linux/rtnetlink.h`,
//! `linux/nexthop.h`): the messages split out of a socket's datagram, the routes, nexthop
//! objects and links they carry read into [`Change`]s, and the dump requests that ask for them.
//!
//! Netlink integers are in the host's byte order; every attribute is a length, a type and a
//! value padded to 4 bytes. The reader checks every length against the bytes it was given and
//! answers [`Malformed`] rather than reading past them: a message cut short is never half read.
//! `netlink-packet-route` reads routes and links but not nexthop objects (RTM_NEWNEXTHOP), which
//! FRR's zebra installs by default, so the three are read here, alike.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Message types (`linux/netlink.h`, `linux/rtnetlink.h`).
pub mod kind {
    pub const NOOP: u16 = 1;
    pub const ERROR: u16 = 2;
    pub const DONE: u16 = 3;
    pub const NEWLINK: u16 = 16;
    pub const DELLINK: u16 = 17;
    pub const GETLINK: u16 = 18;
    pub const NEWROUTE: u16 = 24;
    pub const DELROUTE: u16 = 25;
    pub const GETROUTE: u16 = 26;
    pub const NEWNEXTHOP: u16 = 104;
    pub const DELNEXTHOP: u16 = 105;
    pub const GETNEXTHOP: u16 = 106;
}

/// Header flags.
pub const F_REQUEST: u16 = 0x1;
pub const F_MULTI: u16 = 0x2;
/// `NLM_F_ROOT | NLM_F_MATCH`: every object of the kind.
pub const F_DUMP: u16 = 0x300;

/// Multicast groups, as `bind`'s bit mask (the first 32) or by number (`NETLINK_ADD_MEMBERSHIP`).
pub const GROUP_LINK: u32 = 1;
pub const GROUP_IPV4_ROUTE: u32 = 0x40;
pub const GROUP_IPV6_ROUTE: u32 = 0x400;
pub const GROUP_NUMBER_NEXTHOP: u32 = 32;

/// Route types (`rtm_type`) a router acts on.
pub const RTN_UNICAST: u8 = 1;
pub const RTN_BLACKHOLE: u8 = 6;
pub const RTN_UNREACHABLE: u8 = 7;
pub const RTN_PROHIBIT: u8 = 8;
/// `rtm_flags`: a cached clone, not a route.
const RTM_F_CLONED: u32 = 0x200;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const HEADER: usize = 16;

/// Bytes that are not a whole netlink message of their kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed netlink message: {}", self.0)
    }
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One message's header fields and its body.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    pub body: &'a [u8],
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

/// The messages of one datagram, in order; a message whose length does not fit ends the
/// datagram with [`Malformed`].
pub fn messages(datagram: &[u8]) -> impl Iterator<Item = Result<Message<'_>, Malformed>> {
    let mut rest = datagram;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let len = u32_at(rest, 0).map(|l| l as usize);
        let Some(len) = len.filter(|&l| l >= HEADER && l <= rest.len()) else {
            rest = &[];
            return Some(Err(Malformed("length beyond the datagram")));
        };
        let m = Message {
            kind: u16_at(rest, 4).expect("within the header"),
            flags: u16_at(rest, 6).expect("within the header"),
            seq: u32_at(rest, 8).expect("within the header"),
            body: &rest[HEADER..len],
            bytes: &rest[..len],
        };
        rest = &rest[align4(len).min(rest.len())..];
        Some(Ok(m))
    })
}

/// The attributes `(type, value)` of `b`, a run of them; nested flags masked off the type.
fn attributes(b: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), Malformed>> {
    let mut rest = b;
    std::iter::from_fn(move || {
        if rest.len() < 4 {
            return None;
        }
        let len = u16_at(rest, 0).expect("checked") as usize;
        if len < 4 || len > rest.len() {
            rest = &[];
            return Some(Err(Malformed("attribute length beyond its message")));
        }
        let kind = u16_at(rest, 2).expect("checked") & 0x3fff;
        let value = &rest[4..len];
        rest = &rest[align4(len).min(rest.len())..];
        Some(Ok((kind, value)))
    })
}

fn address(family: u8, v: &[u8]) -> Result<IpAddr, Malformed> {
    match (family, v.len()) {
        (AF_INET, 4) => Ok(IpAddr::V4(Ipv4Addr::from(
            <[u8; 4]>::try_from(v).expect("4 bytes"),
        ))),
        (AF_INET6, 16) => Ok(IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(v).expect("16 bytes"),
        ))),
        _ => Err(Malformed("an address of the wrong length for its family")),
    }
}

fn value_u32(v: &[u8]) -> Result<u32, Malformed> {
    u32_at(v, 0).ok_or(Malformed("a 32-bit attribute shorter than 4 bytes"))
}

/// One way out of a route: a gateway (none: the destination is on the link) out of
/// interface `oif` (0: not given), chosen `weight` times in the sum of a multipath route's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Path {
    pub gateway: Option<IpAddr>,
    pub oif: u32,
    pub weight: u16,
}

/// A route of a kernel routing table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: IpAddr,
    pub prefix_len: u8,
    pub table: u32,
    /// `RTN_UNICAST`, `RTN_BLACKHOLE`, …
    pub kind: u8,
    /// The metric: of routes to one prefix, the lowest is used.
    pub priority: u32,
    /// The ways out (several: a multipath route); empty when `nexthop` names them.
    pub paths: Vec<Path>,
    /// A nexthop object's number (`RTA_NH_ID`), holding the ways out instead.
    pub nexthop: Option<u32>,
}

/// A nexthop object (`ip nexthop`): one way out, or a group of other objects with weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nexthop {
    pub id: u32,
    pub path: Option<Path>,
    /// `(id, weight)` of each member, for a group.
    pub group: Vec<(u32, u16)>,
    pub blackhole: bool,
}

/// An interface as `RTM_NEWLINK` tells of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// `IFLA_MTU`, when the message gives it.
    pub mtu: Option<u32>,
}

/// What one message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Route(Route),
    RouteGone(Route),
    Nexthop(Nexthop),
    NexthopGone(u32),
    Link(Link),
    LinkGone(u32),
    /// A request for a dump of `kind` (`kind::GETROUTE`, …) numbered `seq`: what follows with
    /// that number is the whole table of that kind.
    DumpBegins {
        kind: u16,
        seq: u32,
    },
    DumpDone {
        seq: u32,
    },
    /// The kernel refused request `seq` with `errno`.
    Error {
        seq: u32,
        errno: i32,
    },
    /// A message that changes nothing a router keeps (a cloned route, another family, …).
    Other,
}

fn route(m: &Message) -> Result<Option<Route>, Malformed> {
    let b = m.body;
    if b.len() < 12 {
        return Err(Malformed("a route message shorter than its header"));
    }
    let (family, prefix_len, table, kind) = (b[0], b[1], b[4] as u32, b[7]);
    let flags = u32_at(b, 8).expect("checked");
    if !matches!(family, AF_INET | AF_INET6) || flags & RTM_F_CLONED != 0 {
        return Ok(None);
    }
    let bits = if family == AF_INET { 32 } else { 128 };
    if prefix_len > bits {
        return Err(Malformed("a prefix longer than its address"));
    }
    let mut r = Route {
        dst: if family == AF_INET {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        },
        prefix_len,
        table,
        kind,
        priority: 0,
        paths: Vec::new(),
        nexthop: None,
    };
    let mut single = Path {
        gateway: None,
        oif: 0,
        weight: 1,
    };
    let mut multipath = false;
    for a in attributes(&b[12..]) {
        let (t, v) = a?;
        match t {
            1 => r.dst = address(family, v)?,                // RTA_DST
            4 => single.oif = value_u32(v)?,                 // RTA_OIF
            5 => single.gateway = Some(address(family, v)?), // RTA_GATEWAY
            6 => r.priority = value_u32(v)?,                 // RTA_PRIORITY
            15 => r.table = value_u32(v)?,                   // RTA_TABLE
            30 => r.nexthop = Some(value_u32(v)?),           // RTA_NH_ID
            18 => single.gateway = Some(via(family, v)?),    // RTA_VIA
            9 => {
                // RTA_MULTIPATH: struct rtnexthop { len u16, flags u8, hops u8, ifindex i32 }
                // each followed by its own attributes.
                multipath = true;
                let mut rest = v;
                while rest.len() >= 8 {
                    let len = u16_at(rest, 0).expect("checked") as usize;
                    if len < 8 || len > rest.len() {
                        return Err(Malformed("a multipath hop beyond its attribute"));
                    }
                    let mut p = Path {
                        gateway: None,
                        oif: u32_at(rest, 4).expect("checked"),
                        weight: rest[3] as u16 + 1,
                    };
                    for a in attributes(&rest[8..len]) {
                        let (t, v) = a?;
                        match t {
                            5 => p.gateway = Some(address(family, v)?),
                            18 => p.gateway = Some(via(family, v)?),
                            _ => {}
                        }
                    }
                    r.paths.push(p);
                    rest = &rest[align4(len).min(rest.len())..];
                }
            }
            _ => {}
        }
    }
    if !multipath && r.nexthop.is_none() && (single.gateway.is_some() || single.oif != 0) {
        r.paths.push(single);
    }
    Ok(Some(r))
}

/// `RTA_VIA`: a family and an address (an IPv6 gateway of an IPv4 route, RFC 5549).
fn via(_route_family: u8, v: &[u8]) -> Result<IpAddr, Malformed> {
    let family = u16_at(v, 0).ok_or(Malformed("a via attribute without its family"))?;
    address(family as u8, &v[2..])
}

fn nexthop(m: &Message) -> Result<Nexthop, Malformed> {
    let b = m.body;
    if b.len() < 8 {
        return Err(Malformed("a nexthop message shorter than its header"));
    }
    let family = b[0];
    let mut n = Nexthop {
        id: 0,
        path: None,
        group: Vec::new(),
        blackhole: false,
    };
    let (mut gateway, mut oif) = (None, 0);
    for a in attributes(&b[8..]) {
        let (t, v) = a?;
        match t {
            1 => n.id = value_u32(v)?, // NHA_ID
            2 => {
                // NHA_GROUP: struct nexthop_grp { id u32, weight u8, resvd u8, resvd u16 }
                for g in v.chunks(8) {
                    let id = u32_at(g, 0).ok_or(Malformed("a group member cut short"))?;
                    n.group.push((id, g.get(4).map_or(1, |&w| w as u16 + 1)));
                }
            }
            4 => n.blackhole = true,                  // NHA_BLACKHOLE
            5 => oif = value_u32(v)?,                 // NHA_OIF
            6 => gateway = Some(address(family, v)?), // NHA_GATEWAY
            _ => {}
        }
    }
    if n.id == 0 {
        return Err(Malformed("a nexthop without its id"));
    }
    if n.group.is_empty() && !n.blackhole {
        n.path = Some(Path {
            gateway,
            oif,
            weight: 1,
        });
    }
    Ok(n)
}

/// A link message's interface (`ifinfomsg`: family, pad, type, index, flags, change), with
/// `None` for the name when it gives none.
fn link(m: &Message) -> Result<(Link, bool), Malformed> {
    let b = m.body;
    if b.len() < 16 {
        return Err(Malformed("a link message shorter than its header"));
    }
    let index = u32_at(b, 4).expect("checked");
    let flags = u32_at(b, 8).expect("checked");
    let (mut name, mut mtu) = (None, None);
    for a in attributes(&b[16..]) {
        match a? {
            // IFLA_IFNAME, NUL-terminated.
            (3, v) => {
                let s = v.split(|&c| c == 0).next().unwrap_or_default();
                name = Some(String::from_utf8_lossy(s).into_owned());
            }
            // IFLA_MTU.
            (4, v) => mtu = Some(u32_at(v, 0).ok_or(Malformed("a link's MTU is short"))?),
            _ => {}
        }
    }
    let named = name.is_some();
    let link = Link {
        index,
        name: name.unwrap_or_default(),
        up: flags & 1 != 0,
        mtu,
    };
    Ok((link, named))
}

/// What message `m` says.
pub fn read(m: &Message) -> Result<Change, Malformed> {
    Ok(match m.kind {
        kind::NEWROUTE => route(m)?.map_or(Change::Other, Change::Route),
        kind::DELROUTE => route(m)?.map_or(Change::Other, Change::RouteGone),
        kind::NEWNEXTHOP => Change::Nexthop(nexthop(m)?),
        kind::DELNEXTHOP => Change::NexthopGone(nexthop(m)?.id),
        kind::NEWLINK => match link(m)? {
            (link, true) => Change::Link(link),
            _ => Change::Other,
        },
        kind::DELLINK => Change::LinkGone(link(m)?.0.index),
        kind::GETROUTE | kind::GETNEXTHOP | kind::GETLINK if m.flags & F_DUMP == F_DUMP => {
            Change::DumpBegins {
                kind: m.kind,
                seq: m.seq,
            }
        }
        kind::DONE => Change::DumpDone { seq: m.seq },
        kind::ERROR => {
            let errno = u32_at(m.body, 0).ok_or(Malformed("an error without its number"))?;
            // The refused request's header follows the number: its seq is the one asked.
            let seq = u32_at(m.body, 4 + 8).unwrap_or(m.seq);
            Change::Error {
                seq,
                errno: -(errno as i32),
            }
        }
        _ => Change::Other,
    })
}

/// A request for every object of `kind` (`kind::GETLINK`, `GETROUTE`, `GETNEXTHOP`) of all
/// families, numbered `seq`.
pub fn dump_request(kind: u16, seq: u32) -> Vec<u8> {
    let body_len = match kind {
        kind::GETLINK => 16,   // struct ifinfomsg
        kind::GETNEXTHOP => 8, // struct nhmsg
        _ => 12,               // struct rtmsg
    };
    let len = HEADER + body_len;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&(F_REQUEST | F_DUMP).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.resize(len, 0);
    m
}

fn put_attr(m: &mut Vec<u8>, kind: u16, value: &[u8]) {
    m.extend_from_slice(&(4 + value.len() as u16).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(value);
    m.resize(align4(m.len()), 0);
}

fn address_bytes(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Route `r` as the kernel writes it in a message of `kind` (`kind::NEWROUTE`, `DELROUTE`):
/// what `ip route` would have the kernel announce, for tests and tools.
pub fn route_message(kind: u16, seq: u32, r: &Route) -> Vec<u8> {
    let family = if r.dst.is_ipv4() { AF_INET } else { AF_INET6 };
    let table = r.table.min(255) as u8;
    let mut m = vec![0u8; HEADER];
    m.extend_from_slice(&[family, r.prefix_len, 0, 0, table, 3, 0, r.kind, 0, 0, 0, 0]);
    put_attr(&mut m, 15, &r.table.to_ne_bytes());
    put_attr(&mut m, 1, &address_bytes(r.dst));
    put_attr(&mut m, 6, &r.priority.to_ne_bytes());
    if let Some(id) = r.nexthop {
        put_attr(&mut m, 30, &id.to_ne_bytes());
    } else if let [p @ Path { weight: 1, .. }] = r.paths.as_slice() {
        if let Some(g) = p.gateway {
            put_gateway(&mut m, family, g);
        }
        put_attr(&mut m, 4, &p.oif.to_ne_bytes());
    } else if !r.paths.is_empty() {
        let mut hops = Vec::new();
        for p in &r.paths {
            let start = hops.len();
            hops.extend_from_slice(&[0, 0, 0, p.weight.saturating_sub(1).min(255) as u8]);
            hops.extend_from_slice(&p.oif.to_ne_bytes());
            if let Some(g) = p.gateway {
                put_gateway(&mut hops, family, g);
            }
            let len = (hops.len() - start) as u16;
            hops[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
        put_attr(&mut m, 9, &hops);
    }
    finish(m, kind, seq)
}

/// A gateway of a route of `family`: `RTA_GATEWAY`, or `RTA_VIA` with its own family when it
/// is of the other (RFC 5549).
fn put_gateway(m: &mut Vec<u8>, family: u8, g: IpAddr) {
    let own = if g.is_ipv4() { AF_INET } else { AF_INET6 };
    if own == family {
        put_attr(m, 5, &address_bytes(g));
    } else {
        let mut v = (own as u16).to_ne_bytes().to_vec();
        v.extend_from_slice(&address_bytes(g));
        put_attr(m, 18, &v);
    }
}

/// Sets a message's length, kind and number in its header.
fn finish(mut m: Vec<u8>, kind: u16, seq: u32) -> Vec<u8> {
    let len = m.len() as u32;
    m[0..4].copy_from_slice(&len.to_ne_bytes());
    m[4..6].copy_from_slice(&kind.to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    m
}

/// Nexthop object `n` as the kernel announces it (`RTM_NEWNEXTHOP`): what [`read`] reads back
/// as the same object.
pub fn nexthop_message(seq: u32, n: &Nexthop) -> Vec<u8> {
    let family = match n.path.and_then(|p| p.gateway) {
        Some(IpAddr::V4(_)) => AF_INET,
        Some(IpAddr::V6(_)) => AF_INET6,
        None => 0,
    };
    let mut m = vec![0u8; HEADER];
    m.extend_from_slice(&[family, 0, 3, 0, 0, 0, 0, 0]); // struct nhmsg: family, scope, protocol
    put_attr(&mut m, 1, &n.id.to_ne_bytes());
    if n.blackhole {
        put_attr(&mut m, 4, &[]);
    } else if !n.group.is_empty() {
        let mut members = Vec::with_capacity(8 * n.group.len());
        for &(id, weight) in &n.group {
            members.extend_from_slice(&id.to_ne_bytes());
            members.extend_from_slice(&[weight.saturating_sub(1).min(255) as u8, 0, 0, 0]);
        }
        put_attr(&mut m, 2, &members);
    } else if let Some(p) = n.path {
        put_attr(&mut m, 5, &p.oif.to_ne_bytes());
        if let Some(g) = p.gateway {
            put_attr(&mut m, 6, &address_bytes(g));
        }
    }
    finish(m, kind::NEWNEXTHOP, seq)
}

/// Interface `l` as the kernel announces it (`RTM_NEWLINK`): what [`read`] reads back as the
/// same link.
pub fn link_message(seq: u32, l: &Link) -> Vec<u8> {
    let mut m = vec![0u8; HEADER];
    m.extend_from_slice(&[0, 0, 1, 0]); // family, pad, type ARPHRD_ETHER
    m.extend_from_slice(&l.index.to_ne_bytes());
    m.extend_from_slice(&u32::from(l.up).to_ne_bytes()); // flags: IFF_UP
    m.extend_from_slice(&u32::MAX.to_ne_bytes()); // change
    let mut name = l.name.as_bytes().to_vec();
    name.push(0);
    put_attr(&mut m, 3, &name);
    if let Some(mtu) = l.mtu {
        put_attr(&mut m, 4, &mtu.to_ne_bytes());
    }
    finish(m, kind::NEWLINK, seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(t: u16, v: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&(4 + v.len() as u16).to_ne_bytes());
        a.extend_from_slice(&t.to_ne_bytes());
        a.extend_from_slice(v);
        a.resize(align4(a.len()), 0);
        a
    }

    fn message(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((HEADER + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&flags.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&7u32.to_ne_bytes());
        m.extend_from_slice(body);
        m
    }

    fn rtmsg(family: u8, len: u8, table: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut b = vec![family, len, 0, 0, table, 3, 0, RTN_UNICAST, 0, 0, 0, 0];
        for a in attrs {
            b.extend_from_slice(a);
        }
        b
    }

    /// A route, a multipath route, a nexthop group, a link and a dump's end, in one datagram.
    fn datagram() -> Vec<u8> {
        let single = message(
            kind::NEWROUTE,
            0,
            0,
            &rtmsg(
                AF_INET,
                24,
                254,
                &[
                    attr(1, &[10, 100, 5, 0]),
                    attr(5, &[192, 0, 2, 9]),
                    attr(4, &3u32.to_ne_bytes()),
                    attr(6, &20u32.to_ne_bytes()),
                ],
            ),
        );
        let mut hops = Vec::new();
        for (gw, oif, w) in [([192u8, 0, 2, 9], 3u32, 0u8), ([192, 0, 2, 10], 4, 2)] {
            let g = attr(5, &gw);
            hops.extend_from_slice(&((8 + g.len()) as u16).to_ne_bytes());
            hops.extend_from_slice(&[0, w]);
            hops.extend_from_slice(&oif.to_ne_bytes());
            hops.extend_from_slice(&g);
        }
        let multi = message(
            kind::NEWROUTE,
            F_MULTI,
            5,
            &rtmsg(AF_INET, 0, 254, &[attr(9, &hops)]),
        );
        let mut group = Vec::new();
        for (id, w) in [(11u32, 0u8), (12, 4)] {
            group.extend_from_slice(&id.to_ne_bytes());
            group.extend_from_slice(&[w, 0, 0, 0]);
        }
        let nh = message(
            kind::NEWNEXTHOP,
            0,
            0,
            &[
                &[AF_INET, 0, 0, 0, 0, 0, 0, 0][..],
                &attr(1, &13u32.to_ne_bytes()),
                &attr(2, &group),
            ]
            .concat(),
        );
        let mut ifinfo = vec![0u8; 16];
        ifinfo[4..8].copy_from_slice(&3u32.to_ne_bytes());
        ifinfo[8..12].copy_from_slice(&0x1003u32.to_ne_bytes()); // UP, BROADCAST, MULTICAST
        ifinfo.extend_from_slice(&attr(3, b"wan\0"));
        ifinfo.extend_from_slice(&attr(4, &1400u32.to_ne_bytes()));
        let link_msg = message(kind::NEWLINK, 0, 0, &ifinfo);
        let done = message(kind::DONE, F_MULTI, 5, &0u32.to_ne_bytes());
        [single, multi, nh, link_msg, done].concat()
    }

    #[test]
    fn reads_a_route_a_multipath_route_a_nexthop_group_and_a_link() {
        let datagram = datagram();
        let changes: Vec<Change> = messages(&datagram)
            .map(|m| read(&m.unwrap()).unwrap())
            .collect();
        let gw = |a: [u8; 4]| Some(IpAddr::from(a));
        assert_eq!(
            changes[0],
            Change::Route(Route {
                dst: IpAddr::from([10, 100, 5, 0]),
                prefix_len: 24,
                table: 254,
                kind: RTN_UNICAST,
                priority: 20,
                paths: vec![Path {
                    gateway: gw([192, 0, 2, 9]),
                    oif: 3,
                    weight: 1
                }],
                nexthop: None,
            })
        );
        let Change::Route(m) = &changes[1] else {
            panic!("{:?}", changes[1])
        };
        assert_eq!(
            m.paths,
            vec![
                Path {
                    gateway: gw([192, 0, 2, 9]),
                    oif: 3,
                    weight: 1
                },
                Path {
                    gateway: gw([192, 0, 2, 10]),
                    oif: 4,
                    weight: 3
                }
            ]
        );
        assert_eq!(
            changes[2],
            Change::Nexthop(Nexthop {
                id: 13,
                path: None,
                group: vec![(11, 1), (12, 5)],
                blackhole: false
            })
        );
        assert_eq!(
            changes[3],
            Change::Link(Link {
                index: 3,
                name: "wan".into(),
                up: true,
                mtu: Some(1400)
            })
        );
        assert_eq!(changes[4], Change::DumpDone { seq: 5 });
    }

    #[test]
    fn a_dump_request_reads_as_a_dump_beginning() {
        let request = dump_request(kind::GETROUTE, 9);
        let m = messages(&request).next().unwrap().unwrap();
        assert_eq!(
            read(&m).unwrap(),
            Change::DumpBegins {
                kind: kind::GETROUTE,
                seq: 9
            }
        );
    }

    #[test]
    fn routes_written_read_back_the_same() {
        let gw = |a: [u8; 4]| Some(IpAddr::from(a));
        let mut r = Route {
            dst: IpAddr::from([10, 2, 0, 0]),
            prefix_len: 16,
            table: 1000,
            kind: RTN_UNICAST,
            priority: 20,
            paths: vec![
                Path {
                    gateway: gw([192, 0, 2, 9]),
                    oif: 3,
                    weight: 1,
                },
                Path {
                    gateway: gw([192, 0, 2, 10]),
                    oif: 3,
                    weight: 7,
                },
            ],
            nexthop: None,
        };
        for paths in [2, 1, 0] {
            r.paths.truncate(paths);
            let m = route_message(kind::NEWROUTE, 0, &r);
            let read_back = read(&messages(&m).next().unwrap().unwrap()).unwrap();
            assert_eq!(read_back, Change::Route(r.clone()));
        }
    }

    fn read_one(m: &[u8]) -> Change {
        read(&messages(m).next().unwrap().unwrap()).unwrap()
    }

    /// What a router keeps of the kernel's table, written as messages (a table handed to a
    /// successor) and read again: the same objects.
    #[test]
    fn nexthops_links_and_odd_routes_written_read_back_the_same() {
        let v6: IpAddr = "fe80::1".parse().unwrap();
        let path = |gateway, oif, weight| Path {
            gateway,
            oif,
            weight,
        };
        // One path of weight 3 (a multipath route left with one hop); an IPv4 route by an
        // IPv6 gateway (RFC 5549).
        for paths in [vec![path(None, 4, 3)], vec![path(Some(v6), 2, 1)]] {
            let r = Route {
                dst: IpAddr::from([10, 9, 0, 0]),
                prefix_len: 24,
                table: 254,
                kind: RTN_UNICAST,
                priority: 0,
                paths,
                nexthop: None,
            };
            let m = route_message(kind::NEWROUTE, 5, &r);
            assert_eq!(read_one(&m), Change::Route(r));
        }
        let objects = [
            Nexthop {
                id: 1,
                path: Some(path(Some(IpAddr::from([192, 0, 2, 1])), 3, 1)),
                group: vec![],
                blackhole: false,
            },
            Nexthop {
                id: 2,
                path: Some(path(Some(v6), 3, 1)),
                group: vec![],
                blackhole: false,
            },
            Nexthop {
                id: 3,
                path: Some(path(None, 7, 1)),
                group: vec![],
                blackhole: false,
            },
            Nexthop {
                id: 4,
                path: None,
                group: vec![(1, 1), (3, 200)],
                blackhole: false,
            },
            Nexthop {
                id: 5,
                path: None,
                group: vec![],
                blackhole: true,
            },
        ];
        for n in objects {
            assert_eq!(read_one(&nexthop_message(9, &n)), Change::Nexthop(n));
        }
        for (up, mtu) in [(true, Some(1500)), (false, None)] {
            let l = Link {
                index: 12,
                name: "wan".into(),
                up,
                mtu,
            };
            assert_eq!(read_one(&link_message(0, &l)), Change::Link(l));
        }
    }

    #[test]
    fn cut_and_lying_lengths_are_malformed_never_read_past() {
        let m = message(
            kind::NEWROUTE,
            0,
            0,
            &rtmsg(AF_INET, 24, 254, &[attr(1, &[10, 100, 5, 0])]),
        );
        for cut in 0..m.len() {
            for msg in messages(&m[..cut]).flatten() {
                let _ = read(&msg);
            }
        }
        let mut lying = m.clone();
        lying[HEADER + 12] = 200; // the attribute's length
        let msg = messages(&lying).next().unwrap().unwrap();
        assert!(read(&msg).is_err());
        let mut long = rtmsg(AF_INET, 33, 254, &[]);
        long[1] = 33;
        let m = message(kind::NEWROUTE, 0, 0, &long);
        assert!(read(&messages(&m).next().unwrap().unwrap()).is_err());
    }
}
