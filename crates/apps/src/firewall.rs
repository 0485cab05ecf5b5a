//! `firewall`: a stateful packet filter between two sides, `lan` and `wan` (each an input and an
//! output of that name: what comes in on one side leaves on the other).
//!
//! Rules are tried in order; the first that matches decides: `accept`, `drop`, or `reject`
//! (a TCP RST, or ICMP/ICMPv6 "administratively prohibited", sent back out of the side the
//! packet came from). A rule matches on `from` (lan, wan, any), `proto` (tcp, udp, icmp,
//! icmpv6 or a number), `src`/`dst` CIDRs (IPv4 or IPv6), `src_port`/`dst_port` (`80` or
//! `"1024-65535"`) and `vlan`. Packets no rule matches get `default`.
//!
//! With `stateful: true` (the default), accepted TCP SYNs, UDP datagrams and ICMP echo requests
//! open a connection; later packets of a connection in either direction pass without the rules,
//! and TCP packets that belong to no connection or break its state machine are dropped as
//! invalid. Connections expire after their timeout (TCP established / transitory, UDP, ICMP).
//! ICMP and ICMPv6 errors about a packet of a tracked connection (unreachable, too big, time
//! exceeded, parameter problem) are related to it and pass without the rules.
//! Non-IP frames (ARP) and IPv6 Neighbor Discovery pass. Counters: per rule, per outcome, and malformed packets by reason.
//!
//! ```yaml
//! apps:
//!   fw: { type: firewall, default: drop, rules: [
//!         { action: accept, from: lan },
//!         { action: accept, from: wan, proto: tcp, dst: "10.0.0.10/32", dst_port: 443 },
//!         { action: reject, from: wan, proto: udp } ] }
//! links:
//!   - "inside.output -> fw.lan"
//!   - "fw.lan -> inside.input"
//!   - "outside.output -> fw.wan"
//!   - "fw.wan -> outside.input"
//! ```

use crate::classify::{self, Bits, Field};
use crate::sessions::{self, Clock, Index, Millis, Sessions};
use serde::Deserialize;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::time::Instant;
use stitch_core::link::transmit_to;
use stitch_core::{
    pool, App, AppContext, AppError, AppSnapshot, AppState, Counter, Io, Packet, PortNames,
    PortSpec,
};
use stitch_wire::build::{Frame, Transport};
use stitch_wire::flow::{self, Flow, Malformed};
use stitch_wire::header;
use stitch_wire::views::{Ipv4Packet, TcpPacket};
use stitch_wire::{ethertype, icmpv4, icmpv6, ip_proto};

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq,
)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Accept,
    Drop,
    Reject,
}

#[derive(
    schemars::JsonSchema, Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Lan,
    Wan,
    #[default]
    Any,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Ports {
    One(u16),
    Range(String),
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Proto {
    Number(u8),
    Name(String),
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// What a matching packet gets: `reject` sends a TCP RST, or ICMP "administratively
    /// prohibited", back out of the side it came from.
    pub action: Action,
    /// The side the packet enters by.
    #[serde(default)]
    pub from: Side,
    /// `tcp`, `udp`, `icmp`, `icmpv6` or an IP protocol number (any when unset).
    pub proto: Option<Proto>,
    /// Source prefix (CIDR, IPv4 or IPv6; `10.0.0.0/8`, `2001:db8::/32`).
    pub src: Option<String>,
    /// Destination prefix (CIDR, IPv4 or IPv6).
    pub dst: Option<String>,
    /// Source port: one (`53`) or a range (`"1024-65535"`).
    pub src_port: Option<Ports>,
    /// Destination port: one (`443`) or a range (`"8000-8080"`).
    pub dst_port: Option<Ports>,
    /// The 802.1Q VLAN id of the packet.
    pub vlan: Option<u16>,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// An established TCP connection.
    pub tcp_established: u64,
    /// A TCP connection being opened or closed.
    pub tcp_transitory: u64,
    /// A UDP flow.
    pub udp: u64,
    /// An ICMP echo exchange.
    pub icmp: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            tcp_established: 7200,
            tcp_transitory: 120,
            udp: 60,
            icmp: 30,
        }
    }
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FirewallConfig {
    /// Tried in order; the first that matches decides.
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// What packets no rule matches get.
    #[serde(default = "drop_action")]
    pub default: Action,
    /// Track connections: accepted TCP SYNs, UDP datagrams and ICMP echo requests open one, later
    /// packets of it in either direction pass without the rules, TCP packets outside a connection's
    /// state are dropped as invalid.
    #[serde(default = "yes")]
    pub stateful: bool,
    /// Seconds a connection lives without a packet, by its kind.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Connections tracked at most (each takes up to 96 bytes once made): beyond it, a new
    /// connection is decided by the rules alone, untracked, and counted
    /// (`connection_table_full`).
    #[serde(default = "default_max")]
    pub max_connections: usize,
}

fn drop_action() -> Action {
    Action::Drop
}
fn yes() -> bool {
    true
}
fn default_max() -> usize {
    1 << 20
}

#[derive(Debug, Clone, Copy)]
struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Cidr {
    fn parse(s: &str) -> Result<Cidr, String> {
        let (a, l) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not an address or CIDR"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = if l.is_empty() {
            max
        } else {
            l.parse().map_err(|_| format!("`{s}`: bad prefix length"))?
        };
        if len > max {
            return Err(format!("`{s}`: prefix length over {max}"));
        }
        Ok(Cidr { addr, len })
    }

    #[cfg(test)]
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u32::MAX << (32 - self.len)
                };
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u128::MAX << (128 - self.len)
                };
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// `80` or `"1024-65535"` as an inclusive range.
pub fn port_range(p: &Ports) -> Result<(u16, u16), String> {
    match p {
        Ports::One(n) => Ok((*n, *n)),
        Ports::Range(s) => {
            let (a, b) = s.split_once('-').unwrap_or((s, s));
            let a: u16 = a
                .trim()
                .parse()
                .map_err(|_| format!("port range `{s}`: use N or A-B"))?;
            let b: u16 = b
                .trim()
                .parse()
                .map_err(|_| format!("port range `{s}`: use N or A-B"))?;
            if a > b {
                return Err(format!("port range `{s}`: {a} > {b}"));
            }
            Ok((a, b))
        }
    }
}

/// A protocol name (tcp, udp, icmp, icmpv6) or number.
pub fn protocol(p: &Proto) -> Result<u8, String> {
    match p {
        Proto::Number(n) => Ok(*n),
        Proto::Name(n) => match n.as_str() {
            "tcp" => Ok(ip_proto::TCP),
            "udp" => Ok(ip_proto::UDP),
            "icmp" => Ok(ip_proto::ICMP),
            "icmpv6" => Ok(ip_proto::ICMPV6),
            _ => Err(format!(
                "proto `{n}`: use tcp, udp, icmp, icmpv6 or a number"
            )),
        },
    }
}

struct Rule {
    action: Action,
    from: Side,
    proto: Option<u8>,
    src: Option<Cidr>,
    dst: Option<Cidr>,
    src_port: Option<(u16, u16)>,
    dst_port: Option<(u16, u16)>,
    vlan: Option<u16>,
    hits: Counter,
}

impl Rule {
    /// The rule's meaning, one packet at a time (the classifier must agree with it).
    #[cfg(test)]
    fn matches(&self, side: Side, f: &Flow) -> bool {
        let in_range = |r: Option<(u16, u16)>, p: u16| r.is_none_or(|(a, b)| (a..=b).contains(&p));
        (self.from == Side::Any || self.from == side)
            && self.proto.is_none_or(|p| p == f.protocol)
            && self.src.is_none_or(|c| c.contains(f.src))
            && self.dst.is_none_or(|c| c.contains(f.dst))
            && in_range(self.src_port, f.src_port)
            && in_range(self.dst_port, f.dst_port)
            && self.vlan.is_none_or(|v| f.vlan == Some(v))
    }
}

impl Cidr {
    /// The inclusive range it covers within address family `v4`; `Some(None)`-like "nothing"
    /// when it is of the other family.
    fn range(&self, v4: bool) -> Option<(u128, u128)> {
        match self.addr {
            IpAddr::V4(n) if v4 => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u32::MAX << (32 - self.len)
                };
                let lo = u32::from(n) & mask;
                Some((lo as u128, (lo | !mask) as u128))
            }
            IpAddr::V6(n) if !v4 => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u128::MAX << (128 - self.len)
                };
                let lo = u128::from(n) & mask;
                Some((lo, lo | !mask))
            }
            // A rule for the other family never matches: an empty range.
            _ => Some((1, 0)),
        }
    }
}

/// The rules as per-field interval tables (see [`crate::classify`]): the first matching rule
/// without walking them.
struct Classifier {
    sides: [Bits; 2],
    protos: Vec<Bits>,
    src4: Field,
    dst4: Field,
    src6: Field,
    dst6: Field,
    src_port: Field,
    dst_port: Field,
    untagged: Bits,
    vlan: Field,
}

impl Classifier {
    fn new(rules: &[Rule]) -> Classifier {
        let field = |f: &dyn Fn(&Rule) -> Option<(u128, u128)>| {
            Field::build(&rules.iter().map(f).collect::<Vec<_>>())
        };
        let exact = |f: &dyn Fn(&Rule) -> bool| {
            // A one-interval field: the rules for which `f` holds.
            Field::build(
                &rules
                    .iter()
                    .map(|r| if f(r) { None } else { Some((1, 0)) })
                    .collect::<Vec<_>>(),
            )
            .lookup(0)
            .clone()
        };
        let cidr = |get: fn(&Rule) -> Option<Cidr>, v4: bool| {
            field(&|r: &Rule| get(r).and_then(|c| c.range(v4)))
        };
        Classifier {
            sides: [
                exact(&|r: &Rule| r.from != Side::Wan),
                exact(&|r: &Rule| r.from != Side::Lan),
            ],
            protos: (0..=255u8)
                .map(|p| exact(&|r: &Rule| r.proto.is_none_or(|x| x == p)))
                .collect(),
            src4: cidr(|r| r.src, true),
            dst4: cidr(|r| r.dst, true),
            src6: cidr(|r| r.src, false),
            dst6: cidr(|r| r.dst, false),
            src_port: field(&|r: &Rule| r.src_port.map(|(a, b)| (a as u128, b as u128))),
            dst_port: field(&|r: &Rule| r.dst_port.map(|(a, b)| (a as u128, b as u128))),
            untagged: exact(&|r: &Rule| r.vlan.is_none()),
            vlan: field(&|r: &Rule| r.vlan.map(|v| (v as u128, v as u128))),
        }
    }

    /// The number of the first rule `f` matches from `side`.
    #[inline]
    fn first(&self, side: Side, f: &Flow) -> Option<usize> {
        let (src, dst) = match (f.src, f.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => (
                self.src4.lookup(u32::from(s) as u128),
                self.dst4.lookup(u32::from(d) as u128),
            ),
            (s, d) => (
                self.src6.lookup(match s {
                    IpAddr::V6(a) => u128::from(a),
                    IpAddr::V4(a) => u128::from(a.to_ipv6_mapped()),
                }),
                self.dst6.lookup(match d {
                    IpAddr::V6(a) => u128::from(a),
                    IpAddr::V4(a) => u128::from(a.to_ipv6_mapped()),
                }),
            ),
        };
        let side = &self.sides[if side == Side::Wan { 1 } else { 0 }];
        let vlan = match f.vlan {
            None => &self.untagged,
            Some(v) => self.vlan.lookup(v as u128),
        };
        classify::first(&[
            side,
            &self.protos[f.protocol as usize],
            src,
            dst,
            self.src_port.lookup(f.src_port as u128),
            self.dst_port.lookup(f.dst_port as u128),
            vlan,
        ])
    }
}

fn compile(c: &FirewallConfig, ctx: Option<&AppContext>) -> Result<Vec<Rule>, String> {
    c.rules
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let at = |e: String| format!("rule {}: {e}", i + 1);
            Ok(Rule {
                action: r.action,
                from: r.from,
                proto: r.proto.as_ref().map(protocol).transpose().map_err(at)?,
                src: r.src.as_deref().map(Cidr::parse).transpose().map_err(at)?,
                dst: r.dst.as_deref().map(Cidr::parse).transpose().map_err(at)?,
                src_port: r
                    .src_port
                    .as_ref()
                    .map(port_range)
                    .transpose()
                    .map_err(at)?,
                dst_port: r
                    .dst_port
                    .as_ref()
                    .map(port_range)
                    .transpose()
                    .map_err(at)?,
                vlan: r.vlan,
                hits: ctx
                    .map(|c| c.counter(&format!("rule{}_hits", i + 1)))
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// TCP connection states (RFC 793 as a middlebox sees them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
enum TcpState {
    SynSent,
    SynReceived,
    Established,
    FinWait,
    Closed,
}

impl TcpState {
    const ALL: [TcpState; 5] = [
        TcpState::SynSent,
        TcpState::SynReceived,
        TcpState::Established,
        TcpState::FinWait,
        TcpState::Closed,
    ];

    /// As a tracked connection keeps it: 0 for none.
    fn code(s: Option<TcpState>) -> u8 {
        s.map_or(0, |s| {
            Self::ALL.iter().position(|x| *x == s).unwrap() as u8 + 1
        })
    }

    fn of_code(c: u8) -> Option<TcpState> {
        c.checked_sub(1)
            .and_then(|i| Self::ALL.get(i as usize).copied())
    }
}

/// Protocol and the two (address, port) ends, lower end first: the same in both directions.
type ConnKey = (u8, (IpAddr, u16), (IpAddr, u16));

/// A connection's key as the table keeps it: both ends as 16 address bytes (IPv4 in the
/// first four) and a port, lower end first.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C)]
struct Key {
    a: [u8; 16],
    b: [u8; 16],
    a_port: u16,
    b_port: u16,
    proto: u8,
    v6: bool,
}

/// Five words, inlined wherever a key is hashed: the table's index and the choice of shard
/// hash keys per packet, and a derived `Hash` shared by both was left out of line.
impl std::hash::Hash for Key {
    #[inline(always)]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let word = |b: &[u8; 16], half: usize| {
            u64::from_ne_bytes(b[half * 8..half * 8 + 8].try_into().expect("eight bytes"))
        };
        state.write_u64(word(&self.a, 0));
        state.write_u64(word(&self.a, 1));
        state.write_u64(word(&self.b, 0));
        state.write_u64(word(&self.b, 1));
        state.write_u64(
            u64::from(self.a_port)
                | u64::from(self.b_port) << 16
                | u64::from(self.proto) << 32
                | u64::from(self.v6) << 40,
        );
    }
}

fn addr_bytes(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(v4) => {
            let mut b = [0; 16];
            b[..4].copy_from_slice(&v4.octets());
            b
        }
        IpAddr::V6(v6) => v6.octets(),
    }
}

impl Key {
    fn of(k: &ConnKey) -> Key {
        let (proto, (a, a_port), (b, b_port)) = *k;
        Key {
            a: addr_bytes(a),
            b: addr_bytes(b),
            a_port,
            b_port,
            proto,
            v6: a.is_ipv6(),
        }
    }

    fn conn_key(&self) -> ConnKey {
        let addr = |b: [u8; 16]| -> IpAddr {
            if self.v6 {
                b.into()
            } else {
                <[u8; 4]>::try_from(&b[..4]).unwrap().into()
            }
        };
        (
            self.proto,
            (addr(self.a), self.a_port),
            (addr(self.b), self.b_port),
        )
    }
}

/// A tracked connection: 44 bytes, a 64-byte record with its expiry and list links.
#[derive(Clone, Copy)]
#[repr(C)]
struct Conn {
    key: Key,
    /// Side of the packet that opened the connection (`Side::Lan` 0, `Side::Wan` 1).
    origin: u8,
    /// Its TCP state ([`TcpState::code`]).
    tcp: u8,
    _pad: [u8; 4],
}

// SAFETY: integers, byte arrays and bools only.
unsafe impl stitch_core::mapping::Zeroable for Conn {}

const _: () = assert!(Sessions::<Conn>::RECORD_BYTES == 64);

impl Conn {
    fn origin(&self) -> Side {
        if self.origin == 0 {
            Side::Lan
        } else {
            Side::Wan
        }
    }
}

/// Timeout classes, one expiry list each.
const ESTABLISHED: u8 = 0;
const TRANSITORY: u8 = 1;
const UDP: u8 = 2;
const ICMP: u8 = 3;

fn class_of(proto: u8, tcp: Option<TcpState>) -> u8 {
    match (tcp, proto) {
        (Some(TcpState::Established), _) => ESTABLISHED,
        (Some(_), _) => TRANSITORY,
        (None, ip_proto::UDP) => UDP,
        _ => ICMP,
    }
}

fn timeouts(t: &Timeouts) -> Result<[Millis; 4], String> {
    Ok([
        sessions::timeout_millis("timeouts.tcp_established", t.tcp_established)?,
        sessions::timeout_millis("timeouts.tcp_transitory", t.tcp_transitory)?,
        sessions::timeout_millis("timeouts.udp", t.udp)?,
        sessions::timeout_millis("timeouts.icmp", t.icmp)?,
    ])
}

/// The tracked connections and their index.
struct ConnTable {
    sessions: Sessions<Conn>,
    index: Index,
    hasher: foldhash::fast::RandomState,
}

impl ConnTable {
    fn new(capacity: usize, t: &Timeouts) -> Result<ConnTable, String> {
        Ok(ConnTable {
            sessions: Sessions::new(capacity, &timeouts(t)?)?,
            index: Index::new(capacity)?,
            hasher: Default::default(),
        })
    }

    #[inline(always)]
    fn hash(&self, k: &Key) -> u32 {
        sessions::short_hash(self.hasher.hash_one(*k))
    }

    #[inline(always)]
    fn find(&self, k: &Key, hash: u32) -> Option<u32> {
        let s = &self.sessions;
        self.index.find(hash, |id| s.get(id).key == *k)
    }

    fn add(&mut self, c: Conn, class: u8, expires: Option<Millis>, now: Millis) -> Option<u32> {
        let id = match expires {
            Some(t) => self.sessions.insert_until(c, class, t, now)?,
            None => self.sessions.insert(c, class, now)?,
        };
        self.index.insert(self.hash(&c.key), id);
        Some(id)
    }

    fn forget(&mut self, id: u32) {
        let c = self.sessions.remove(id);
        let h = self.hash(&c.key);
        self.index.remove(h, id);
    }

    fn reclaim(&mut self, now: Millis, budget: usize) -> usize {
        let mut n = 0;
        while n < budget {
            let Some(id) = self.sessions.oldest_expired(now) else {
                break;
            };
            self.forget(id);
            n += 1;
        }
        n
    }

    /// The live connections, for snapshots and queries: (key, origin, state, ms left).
    fn alive(
        &self,
        now: Millis,
    ) -> impl Iterator<Item = (ConnKey, Side, Option<TcpState>, Millis)> + '_ {
        self.sessions.iter_alive(now).map(move |(id, c)| {
            (
                c.key.conn_key(),
                c.origin(),
                TcpState::of_code(c.tcp),
                self.sessions.expires(id).wrapping_sub(now),
            )
        })
    }
}

/// Connections reclaimed at most per tick (a millisecond).
const RECLAIM_PER_TICK: usize = 4096;
/// Packets worked on as one batch: their index slots, then their connections, fetched ahead.
const BATCH: usize = 32;

/// The connection an ICMP/ICMPv6 error is about: the key of the packet it quotes (RELATED).
fn related_key(d: &[u8], f: &Flow) -> Option<ConnKey> {
    let is_error = match (f.protocol, f.icmp_type) {
        (ip_proto::ICMP, Some(t)) => icmpv4::is_error(t),
        (ip_proto::ICMPV6, Some(t)) => icmpv6::is_error(t),
        _ => false,
    };
    if !is_error {
        return None;
    }
    let (at, _, _) = flow::l3(d).ok()?;
    let ip = d.get(at..)?;
    let (quoted, v6) = if f.protocol == ip_proto::ICMP {
        (ip.get((ip.first()? & 0x0f) as usize * 4 + 8..)?, false)
    } else {
        (ip.get(48..)?, true)
    };
    let (proto, src, dst, l4) = if v6 {
        let src: [u8; 16] = quoted.get(8..24)?.try_into().ok()?;
        let dst: [u8; 16] = quoted.get(24..40)?.try_into().ok()?;
        (
            *quoted.get(6)?,
            IpAddr::from(src),
            IpAddr::from(dst),
            quoted.get(40..)?,
        )
    } else {
        let ihl = (quoted.first()? & 0x0f) as usize * 4;
        let src: [u8; 4] = quoted.get(12..16)?.try_into().ok()?;
        let dst: [u8; 4] = quoted.get(16..20)?.try_into().ok()?;
        (
            *quoted.get(9)?,
            IpAddr::from(src),
            IpAddr::from(dst),
            quoted.get(ihl..)?,
        )
    };
    let (sp, dp) = match proto {
        ip_proto::TCP | ip_proto::UDP => (
            header::l4::SRC_PORT.try_get(l4)?,
            header::l4::DST_PORT.try_get(l4)?,
        ),
        // A quoted echo: both "ports" are its identifier, as the tracker keys it.
        ip_proto::ICMP | ip_proto::ICMPV6 => {
            let id = header::icmp::ECHO_IDENT.try_get(l4)?;
            (id, id)
        }
        _ => return None,
    };
    Some(conn_key(&Flow {
        vlan: f.vlan,
        src,
        dst,
        protocol: proto,
        src_port: sp,
        dst_port: dp,
        icmp_type: None,
    }))
}

/// A connection key that is the same in both directions (shards find a connection's owner by
/// its hash).
fn conn_key(f: &Flow) -> ConnKey {
    let (mut a, mut b) = ((f.src, f.src_port), (f.dst, f.dst_port));
    if b < a {
        std::mem::swap(&mut a, &mut b);
    }
    (f.protocol, a, b)
}

pub struct Firewall {
    rules: Vec<Rule>,
    classifier: Classifier,
    default: Action,
    stateful: bool,
    timeouts: Timeouts,
    table: ConnTable,
    clock: Clock,
    /// This shard's number and the number of shards (0 and 1 when not sharded).
    shard: (u16, u16),
    handed_off: Counter,
    /// Packets of one batch and what was read of them: their flow and key hash.
    batch: Vec<Packet>,
    flows: Vec<(Result<Option<Flow>, Malformed>, Key, u32)>,
    accepted: Counter,
    dropped: Counter,
    rejected: Counter,
    established: Counter,
    related: Counter,
    invalid: Counter,
    table_full: Counter,
    connections: Counter,
    ndp: Counter,
    malformed: [Counter; 4],
}

/// TCP flags of a frame whose L4 header starts at `l4`.
fn tcp_flags(d: &[u8]) -> Option<u8> {
    let (l3, _, _) = flow::l3(d).ok()?;
    let l4 = if d.get(l3)? >> 4 == 4 {
        l3 + (d[l3] & 0x0f) as usize * 4
    } else {
        l3 + 40
    };
    d.get(l4 + 13).copied()
}

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;

impl Firewall {
    /// Advances a tracked connection; false when the packet breaks its state machine.
    #[inline]
    fn track(
        &mut self,
        (key, hash): (&Key, u32),
        side: Side,
        flags: Option<u8>,
        icmp: Option<u8>,
        now: Millis,
    ) -> Option<bool> {
        let id = self.table.find(key, hash)?;
        let sessions = &mut self.table.sessions;
        if !sessions.is_alive(id, now) {
            self.table.forget(id);
            return None;
        }
        let conn = *sessions.get(id);
        let reply = side != conn.origin();
        let ok = match (TcpState::of_code(conn.tcp), flags) {
            (Some(state), Some(fl)) => {
                let next = if fl & RST != 0 {
                    Some(TcpState::Closed)
                } else {
                    match state {
                        TcpState::SynSent if reply && fl & (SYN | ACK) == SYN | ACK => {
                            Some(TcpState::SynReceived)
                        }
                        TcpState::SynSent if !reply && fl & SYN != 0 => Some(TcpState::SynSent),
                        TcpState::SynReceived if !reply && fl & ACK != 0 && fl & SYN == 0 => {
                            Some(TcpState::Established)
                        }
                        TcpState::SynReceived if reply && fl & SYN != 0 => {
                            Some(TcpState::SynReceived)
                        }
                        TcpState::Established | TcpState::FinWait if fl & SYN == 0 => {
                            Some(if fl & FIN != 0 {
                                TcpState::FinWait
                            } else {
                                state
                            })
                        }
                        _ => None,
                    }
                };
                match next {
                    Some(s) => {
                        sessions.get_mut(id).tcp = TcpState::code(Some(s));
                        sessions.set_class(id, class_of(conn.key.proto, Some(s)), now);
                        true
                    }
                    None => false,
                }
            }
            // ICMP echo: requests only from the side that opened it, replies only from the other.
            _ if icmp.is_some() => {
                let want = if reply { [0, 129] } else { [8, 128] };
                let ok = icmp.is_some_and(|t| want.contains(&t));
                if ok {
                    sessions.refresh(id, now);
                }
                ok
            }
            _ => {
                sessions.refresh(id, now);
                true
            }
        };
        Some(ok)
    }

    /// Opens a connection for an accepted packet, if it is one that may open one.
    fn open(&mut self, f: &Flow, key: &Key, side: Side, flags: Option<u8>, now: Millis) -> bool {
        let tcp = match (f.protocol, flags) {
            (ip_proto::TCP, Some(fl)) if fl & SYN != 0 && fl & (ACK | RST | FIN) == 0 => {
                Some(TcpState::SynSent)
            }
            (ip_proto::TCP, _) => return false,
            (ip_proto::UDP, _) => None,
            // Only echo requests open ICMP state; other accepted ICMP passes without it.
            (ip_proto::ICMP | ip_proto::ICMPV6, _)
                if !matches!(
                    f.icmp_type,
                    Some(icmpv4::ECHO_REQUEST) | Some(icmpv6::ECHO_REQUEST)
                ) =>
            {
                return true
            }
            (ip_proto::ICMP | ip_proto::ICMPV6, _) => None,
            // Other protocols pass by rule only.
            _ => return true,
        };
        let conn = Conn {
            key: *key,
            origin: (side == Side::Wan) as u8,
            tcp: TcpState::code(tcp),
            _pad: [0; 4],
        };
        let class = class_of(f.protocol, tcp);
        if self.table.sessions.len() == self.table.sessions.capacity() {
            self.table.reclaim(now, 16);
        }
        if self.table.add(conn, class, None, now).is_none() {
            self.table_full.add(1);
        }
        true
    }

    /// Reads the flows of a batch, and brings in each one's index slot, then the connection
    /// it leads to — but for packets another shard tracks (`owners`), which go on to it.
    fn read_batch(&mut self, sharded: bool) {
        self.flows.clear();
        for p in &self.batch {
            let f = flow::flow(p.data());
            let key = match &f {
                Ok(Some(f)) => Key::of(&conn_key(f)),
                _ => Key::of(&(0, (IpAddr::from([0u8; 4]), 0), (IpAddr::from([0u8; 4]), 0))),
            };
            let h = self.table.hash(&key);
            if !sharded || self.owner(&key) == self.shard.0 {
                self.table.index.prefetch(h);
            }
            self.flows.push((f, key, h));
        }
        for (f, _, h) in &self.flows {
            if matches!(f, Ok(Some(_))) {
                if let Some(id) = self.table.index.first(*h) {
                    self.table.sessions.prefetch(id);
                }
            }
        }
    }
}

/// Builds the reject answer to frame `d`: a TCP RST for TCP, else ICMP "administratively
/// prohibited" quoting the packet. `None` when the frame cannot be answered.
fn rejection(d: &[u8], f: &Flow) -> Option<Packet> {
    let (l3, ethertype, _) = flow::l3(d).ok()?;
    let v4 = ethertype == ethertype::IPV4;
    let ihl = if v4 {
        Ipv4Packet::new_unchecked(d.get(l3..l3 + 20)?).header_len() as usize
    } else {
        40
    };
    let l4 = l3 + ihl;
    let (transport, quote) = if f.protocol == ip_proto::TCP {
        let t = TcpPacket::new_unchecked(d.get(l4..l4 + 20)?);
        let payload = d.len().saturating_sub(l4 + t.header_len() as usize) as u32;
        let syn_fin = (t.syn() || t.fin()) as u32;
        let (seq, ack, flags) = if t.ack() {
            (t.ack_number().0 as u32, 0, RST)
        } else {
            let ack = (t.seq_number().0 as u32).wrapping_add(payload + syn_fin);
            (0, ack, RST | ACK)
        };
        let rst = Transport::Tcp {
            src_port: t.dst_port(),
            dst_port: t.src_port(),
            seq,
            ack,
            flags,
            window: 0,
        };
        (rst, &[][..])
    } else {
        // ICMP type 3 code 13 / ICMPv6 type 1 code 1, quoting as much as fits in 576/1280 bytes.
        let quote_max = if v4 { 576 - 20 - 8 } else { 1280 - 40 - 8 };
        let (kind, code) = if v4 {
            (
                icmpv4::DESTINATION_UNREACHABLE,
                icmpv4::CODE_ADMIN_PROHIBITED,
            )
        } else {
            (
                icmpv6::DESTINATION_UNREACHABLE,
                icmpv6::CODE_ADMIN_PROHIBITED,
            )
        };
        let prohibited = Transport::Icmp {
            kind,
            code,
            rest: 0,
        };
        (prohibited, &d[l3..d.len().min(l3 + quote_max)])
    };
    // Back to the sender, from the address it wrote to.
    let frame = match (f.dst, f.src) {
        (IpAddr::V4(s), IpAddr::V4(t)) => Frame::ipv4(s, t, transport),
        (IpAddr::V6(s), IpAddr::V6(t)) => Frame::ipv6(s, t, transport),
        _ => return None,
    };
    let mut out = frame
        .macs(d[0..6].try_into().ok()?, d[6..12].try_into().ok()?)
        .payload(quote)
        .bytes();
    if out.len() < 60 {
        out.resize(60, 0);
    }
    let mut p = pool::alloc()?;
    p.set_data(&out).ok()?;
    Some(p)
}

/// A tracked connection as the firewall carries it across a restart (format
/// [`STATE_VERSION`]): its key, state and the time it has left.
#[derive(serde::Serialize, Deserialize)]
struct ConnState {
    key: ConnKey,
    origin: Side,
    tcp: Option<TcpState>,
    expires_in_ms: u64,
}

const STATE_VERSION: u32 = 1;

impl App for Firewall {
    type Config = FirewallConfig;
    const EXAMPLE: &'static str = r#"default: drop
rules:
  - { action: accept, from: lan }
  - { action: accept, from: wan, proto: tcp, dst: "10.0.0.10/32", dst_port: 443 }
  - { action: reject, from: wan, proto: udp }
timeouts: { tcp_established: 3600 }
"#;
    const HANDS_OFF: bool = true;

    fn declare(c: &FirewallConfig) -> Result<PortSpec, AppError> {
        compile(c, None)?;
        timeouts(&c.timeouts)?;
        if c.max_connections == 0 {
            return Err("max_connections: at least 1".into());
        }
        let sides = vec!["lan".to_string(), "wan".to_string()];
        Ok(PortSpec {
            inputs: PortNames::Fixed(sides.clone()),
            outputs: PortNames::Fixed(sides),
        })
    }

    fn new(c: FirewallConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let m = [
            Malformed::Ethernet,
            Malformed::Ipv4,
            Malformed::Ipv6,
            Malformed::L4,
        ];
        let rules = compile(&c, Some(ctx))?;
        Ok(Firewall {
            classifier: Classifier::new(&rules),
            rules,
            default: c.default,
            stateful: c.stateful,
            table: ConnTable::new(c.max_connections, &c.timeouts)?,
            timeouts: c.timeouts,
            clock: Clock::default(),
            shard: ctx
                .shard()
                .map_or((0, 1), |s| (s.index as u16, s.count as u16)),
            handed_off: ctx.counter("handed_off"),
            batch: Vec::with_capacity(BATCH),
            flows: Vec::with_capacity(BATCH),
            accepted: ctx.counter("accepted"),
            dropped: ctx.counter("rule_drops"),
            rejected: ctx.counter("rejected"),
            established: ctx.counter("established_passed"),
            related: ctx.counter("related_passed"),
            invalid: ctx.counter("invalid_drops"),
            table_full: ctx.counter("connection_table_full"),
            connections: ctx.counter("connections"),
            ndp: ctx.counter("ndp_passed"),
            malformed: m.map(|r| ctx.counter(r.counter())),
        })
    }

    fn reconfigure(
        &mut self,
        c: FirewallConfig,
        ctx: &mut AppContext,
    ) -> Result<stitch_core::Reconfigured, AppError> {
        // New rules apply at once; tracked connections stay.
        self.rules = compile(&c, Some(ctx))?;
        self.classifier = Classifier::new(&self.rules);
        self.default = c.default;
        self.stateful = c.stateful;
        let t = timeouts(&c.timeouts)?;
        if c.max_connections != self.table.sessions.capacity() {
            // Another size: the live connections move to a new table, in order of expiry
            // (those past the new size are left out, counted as the table being full).
            let now = self.clock.at(Instant::now());
            let mut table = ConnTable::new(c.max_connections, &c.timeouts)?;
            let mut live: Vec<(Conn, u8, Millis)> = self
                .table
                .sessions
                .iter_alive(now)
                .map(|(id, c)| {
                    (
                        *c,
                        self.table.sessions.class(id),
                        self.table.sessions.expires(id),
                    )
                })
                .collect();
            live.sort_by_key(|(_, _, e)| e.wrapping_sub(now));
            for (conn, class, expires) in live {
                if table.add(conn, class, Some(expires), now).is_none() {
                    self.table_full.add(1);
                }
            }
            self.table = table;
        } else {
            self.table.sessions.set_timeouts(&t);
        }
        self.timeouts = c.timeouts;
        Ok(stitch_core::Reconfigured::Done)
    }

    /// Tracked connections: `{"count", "connections": [{proto, a, b, origin, state, expires_in_s}]}`.
    fn snapshot(&self) -> Option<AppSnapshot> {
        let now = self.clock.at(Instant::now());
        let conns: Vec<ConnState> = self
            .table
            .alive(now)
            .map(|(key, origin, tcp, left)| ConnState {
                key,
                origin,
                tcp,
                expires_in_ms: left as u64,
            })
            .collect();
        Some(AppSnapshot::new(STATE_VERSION, conns))
    }

    /// Connections come back as they were tracked; the rules of the new configuration judge
    /// their next packets as they judge any tracked connection's.
    fn restore(&mut self, state: AppState) -> Result<(), String> {
        let mut conns: Vec<ConnState> = serde_json::from_value(state.of_version(STATE_VERSION)?)
            .map_err(|e| format!("firewall state: {e}"))?;
        let now = self.clock.at(Instant::now());
        // In order of expiry: the expiry lists stay in order.
        conns.sort_by_key(|c| c.expires_in_ms);
        let mut elsewhere = 0;
        for c in conns {
            let key = Key::of(&c.key);
            if self.owner(&key) != self.shard.0 {
                elsewhere += 1;
                continue;
            }
            if c.expires_in_ms == 0 || self.table.find(&key, self.table.hash(&key)).is_some() {
                continue;
            }
            let class = class_of(key.proto, c.tcp);
            let left = c
                .expires_in_ms
                .min(self.table.sessions.timeout(class) as u64) as Millis;
            let conn = Conn {
                key,
                origin: (c.origin == Side::Wan) as u8,
                tcp: TcpState::code(c.tcp),
                _pad: [0; 4],
            };
            if self
                .table
                .add(conn, class, Some(now.wrapping_add(left)), now)
                .is_none()
            {
                break;
            }
        }
        log::info!(
            "firewall: {} tracked connections taken back from the snapshot ({elsewhere} another shard's)",
            self.table.sessions.len()
        );
        Ok(())
    }

    /// Tracked connections: `{"count", "capacity", "memory_bytes", "connections": [{proto, a,
    /// b, origin, state, expires_in_s}]}`.
    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        let limit = request["limit"].as_u64().unwrap_or(1000) as usize;
        let now = self.clock.at(Instant::now());
        let conns: Vec<_> = self
            .table
            .alive(now)
            .take(limit)
            .map(|((proto, a, b), origin, tcp, left)| {
                serde_json::json!({ "proto": proto, "a": format!("{}:{}", a.0, a.1),
                "b": format!("{}:{}", b.0, b.1), "origin": format!("{origin:?}").to_lowercase(),
                "state": tcp.map(|s| format!("{s:?}")), "expires_in_s": left / 1000 })
            })
            .collect();
        let t = &self.table;
        serde_json::json!({ "count": t.sessions.len(), "capacity": t.sessions.capacity(),
            "memory_bytes": t.sessions.memory_bytes() + t.index.memory_bytes(),
            "connections": conns })
    }

    fn tick(&mut self, _io: &mut Io, now: Instant) {
        self.table.reclaim(self.clock.at(now), RECLAIM_PER_TICK);
        self.connections.set(self.table.sessions.len() as u64);
    }

    fn push(&mut self, io: &mut Io) {
        let now = self.clock.at(Instant::now());
        let (inputs, outputs) = io.split();
        for (slot, input) in inputs.iter_mut().enumerate() {
            let Some(input) = input.as_mut() else {
                continue;
            };
            // Slots 0 and 1: the lan and wan sides; from 2 on, what another shard handed over,
            // its side in the packet. A side known at compile time keeps the unsharded path as
            // short as it was before shards.
            match slot {
                0 => self.push_from(input, outputs, Some((0, Side::Lan)), now),
                1 => self.push_from(input, outputs, Some((1, Side::Wan)), now),
                _ => self.push_from(input, outputs, None, now),
            }
        }
        self.connections.set(self.table.sessions.len() as u64);
    }
}

impl Firewall {
    /// Every packet of one input, a batch at a time: from side `from`, or (`None`) handed
    /// over by another shard, its side in the packet.
    #[inline(always)]
    fn push_from(
        &mut self,
        input: &mut stitch_core::Consumer,
        outputs: &mut [Option<stitch_core::Producer>],
        from: Option<(usize, Side)>,
        now: Millis,
    ) {
        let sharded = self.shard.1 > 1 && from.is_some();
        loop {
            self.batch.extend(input.drain().take(BATCH));
            if self.batch.is_empty() {
                break;
            }
            self.read_batch(sharded);
            let mut batch = std::mem::take(&mut self.batch);
            let mut flows = std::mem::take(&mut self.flows);
            for (mut p, (f, key, hash)) in batch.drain(..).zip(flows.drain(..)) {
                let (i, side) = from.unwrap_or_else(|| match p.header().user[0] & 1 {
                    0 => (0, Side::Lan),
                    _ => (1, Side::Wan),
                });
                // A packet of another shard's connection goes on to it.
                if sharded && matches!(f, Ok(Some(_))) {
                    let owner = self.owner(&key);
                    if owner != self.shard.0 {
                        p.header_mut().user[0] = i as u64;
                        self.handed_off.add(1);
                        transmit_to(&mut outputs[2 + owner as usize], p);
                        continue;
                    }
                }
                self.judge(p, f, (&key, hash), (i, side), outputs, now);
            }
            self.batch = batch;
            self.flows = flows;
        }
    }

    /// The shard that tracks a connection: by a hash of its key (the same in both
    /// directions), the same in every shard.
    #[inline]
    fn owner(&self, key: &Key) -> u16 {
        if self.shard.1 == 1 {
            return 0;
        }
        const SHARDS: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x5_4a2d);
        (((SHARDS.hash_one(*key) >> 32) * self.shard.1 as u64) >> 32) as u16
    }

    /// One packet from side `i`: passed on by its connection, by the rules, or dropped.
    #[inline(always)]
    fn judge(
        &mut self,
        p: Packet,
        f: Result<Option<Flow>, Malformed>,
        key: (&Key, u32),
        (i, side): (usize, Side),
        outputs: &mut [Option<stitch_core::Producer>],
        now: Millis,
    ) {
        let other = 1 - i;
        let f = match f {
            Ok(Some(f)) => f,
            Ok(None) => {
                transmit_to(&mut outputs[other], p);
                return;
            }
            Err(m) => {
                let k = [
                    Malformed::Ethernet,
                    Malformed::Ipv4,
                    Malformed::Ipv6,
                    Malformed::L4,
                ]
                .iter()
                .position(|x| *x == m)
                .unwrap_or(0);
                self.malformed[k].add(1);
                return;
            }
        };
        // Neighbor Discovery (RFC 4861, ICMPv6 133–137) is what makes IPv6 work on a
        // link at all: it passes like ARP does.
        if f.protocol == ip_proto::ICMPV6 && f.icmp_type.is_some_and(icmpv6::is_neighbor_discovery)
        {
            self.ndp.add(1);
            transmit_to(&mut outputs[other], p);
            return;
        }
        let flags = if f.protocol == ip_proto::TCP {
            tcp_flags(p.data())
        } else {
            None
        };
        if self.stateful {
            match self.track(key, side, flags, f.icmp_type, now) {
                Some(true) => {
                    self.established.add(1);
                    transmit_to(&mut outputs[other], p);
                    return;
                }
                Some(false) => {
                    self.invalid.add(1);
                    return;
                }
                None => {}
            }
            let related = related_key(p.data(), &f).is_some_and(|k| {
                let k = Key::of(&k);
                self.table
                    .find(&k, self.table.hash(&k))
                    .is_some_and(|id| self.table.sessions.is_alive(id, now))
            });
            if related {
                self.related.add(1);
                transmit_to(&mut outputs[other], p);
                return;
            }
        }
        let rule = self.classifier.first(side, &f);
        let action = match rule {
            Some(k) => {
                self.rules[k].hits.add(1);
                self.rules[k].action
            }
            None => self.default,
        };
        match action {
            Action::Accept => {
                if self.stateful && !self.open(&f, key.0, side, flags, now) {
                    self.invalid.add(1);
                    return;
                }
                self.accepted.add(1);
                transmit_to(&mut outputs[other], p);
            }
            Action::Drop => self.dropped.add(1),
            Action::Reject => {
                self.rejected.add(1);
                if let Some(r) = rejection(p.data(), &f) {
                    transmit_to(&mut outputs[i], r);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::Consumer;

    fn tcp(src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16, flags: u8) -> Packet {
        let segment = Transport::Tcp {
            src_port: sp,
            dst_port: dp,
            seq: 1000,
            ack: 0,
            flags,
            window: 0,
        };
        let f = Frame::ipv4(src, dst, segment)
            .macs([2, 0, 0, 0, 0, src[3]], [2, 0, 0, 0, 0, dst[3]])
            .bytes();
        packet(&f)
    }

    struct Rig {
        fw: Firewall,
        io: Io,
        lan_in: stitch_core::Producer,
        wan_in: stitch_core::Producer,
        lan_out: Consumer,
        wan_out: Consumer,
    }

    fn rig(cfg: serde_json::Value) -> Rig {
        let fw = crate::testing::build::<Firewall>(cfg);
        let (io, [lan_in, wan_in], [lan_out, wan_out]) = crate::testing::ports(["lan", "wan"]);
        Rig {
            fw,
            io,
            lan_in,
            wan_in,
            lan_out,
            wan_out,
        }
    }

    impl Rig {
        fn in_from_lan(&mut self, p: Packet) -> (usize, usize) {
            self.lan_in.transmit(p);
            self.run()
        }
        fn in_from_wan(&mut self, p: Packet) -> (usize, usize) {
            self.wan_in.transmit(p);
            self.run()
        }
        /// Packets that left on (lan, wan).
        fn run(&mut self) -> (usize, usize) {
            self.fw.push(&mut self.io);
            (self.lan_out.drain().count(), self.wan_out.drain().count())
        }
    }

    const H: [u8; 4] = [10, 0, 0, 1];
    const S: [u8; 4] = [192, 0, 2, 1];

    #[test]
    fn tcp_state_lets_replies_in_and_strays_out() {
        let mut r = rig(serde_json::json!({ "rules": [{ "action": "accept", "from": "lan" }] }));
        assert_eq!(r.in_from_lan(tcp(H, S, 40000, 80, SYN)), (0, 1), "SYN out");
        assert_eq!(
            r.in_from_wan(tcp(S, H, 80, 40000, SYN | ACK)),
            (1, 0),
            "SYN-ACK back in"
        );
        assert_eq!(r.in_from_lan(tcp(H, S, 40000, 80, ACK)), (0, 1));
        assert_eq!(
            r.in_from_wan(tcp(S, H, 80, 40000, ACK)),
            (1, 0),
            "established"
        );
        assert_eq!(r.fw.table.sessions.len(), 1);
        // A connection the wan side starts: no rule for it, default drop.
        assert_eq!(r.in_from_wan(tcp(S, H, 5555, 22, SYN)), (0, 0));
        assert_eq!(r.fw.dropped.get(), 1);
        // A stray ACK from lan with no connection is invalid, even though lan is accepted.
        assert_eq!(r.in_from_lan(tcp(H, S, 41000, 80, ACK)), (0, 0));
        assert_eq!(r.fw.invalid.get(), 1);
        // A SYN inside an established connection breaks the state machine.
        assert_eq!(r.in_from_wan(tcp(S, H, 80, 40000, SYN)), (0, 0));
        assert_eq!(r.fw.invalid.get(), 2);
        // RST closes; the next packet of the old connection is refused by state.
        assert_eq!(r.in_from_lan(tcp(H, S, 40000, 80, RST)), (0, 1));
        assert_eq!(r.in_from_wan(tcp(S, H, 80, 40000, ACK)), (0, 0));
    }

    /// An established TCP connection tracked by a firewall that stops goes on through the next
    /// one given the snapshot: its packets from the wan side are let in (a fresh firewall finds
    /// no connection and refuses them as invalid).
    #[test]
    fn tracked_connections_survive_a_restart_through_a_snapshot() {
        let cfg = serde_json::json!({ "rules": [{ "action": "accept", "from": "lan" }] });
        let mut old = rig(cfg.clone());
        old.in_from_lan(tcp(H, S, 40000, 80, SYN));
        old.in_from_wan(tcp(S, H, 80, 40000, SYN | ACK));
        old.in_from_lan(tcp(H, S, 40000, 80, ACK));
        let state = old.fw.snapshot().unwrap().into_state().unwrap();
        let mut fresh = rig(cfg.clone());
        assert_eq!(fresh.in_from_wan(tcp(S, H, 80, 40000, ACK)), (0, 0));
        let mut new = rig(cfg);
        new.fw.restore(state).unwrap();
        assert_eq!(new.in_from_wan(tcp(S, H, 80, 40000, ACK)), (1, 0));
        assert_eq!(new.in_from_lan(tcp(H, S, 40000, 80, ACK)), (0, 1));
    }

    fn udp(src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16) -> Packet {
        packet(&ip_frame(src, dst, Transport::udp(sp, dp), b"data"))
    }

    /// Connections expire after their timeout and are reclaimed by the tick; a full table
    /// opens no more (counted) until one expires; a new size keeps the live ones.
    #[test]
    fn connections_expire_the_table_has_a_size_and_can_be_resized() {
        let cfg = serde_json::json!({ "rules": [{ "action": "accept", "from": "lan" }],
            "max_connections": 2, "timeouts": { "udp": 1 } });
        let mut r = rig(cfg);
        assert_eq!(r.in_from_lan(udp(H, S, 1000, 53)), (0, 1));
        assert_eq!(r.in_from_lan(udp(H, S, 1001, 53)), (0, 1));
        assert_eq!(r.in_from_lan(udp(H, S, 1002, 53)), (0, 1), "passed by rule");
        assert_eq!(r.fw.table_full.get(), 1);
        assert_eq!(r.in_from_wan(udp(S, H, 53, 1001)), (1, 0), "a reply");
        assert_eq!(r.in_from_wan(udp(S, H, 53, 1002)), (0, 0), "untracked");
        // Resized with both connections live: the reply of one still passes.
        let bigger: FirewallConfig = serde_json::from_value(serde_json::json!({
            "rules": [{ "action": "accept", "from": "lan" }],
            "max_connections": 100, "timeouts": { "udp": 1 } }))
        .unwrap();
        let mut ctx = AppContext::new("test", std::path::Path::new("."), Default::default());
        r.fw.reconfigure(bigger, &mut ctx).unwrap();
        assert_eq!(r.fw.table.sessions.capacity(), 100);
        assert_eq!(r.in_from_wan(udp(S, H, 53, 1000)), (1, 0));
        assert_eq!(r.fw.table.sessions.len(), 2);
        // After a second and a half of silence, the tick forgets them.
        let later = Instant::now() + std::time::Duration::from_millis(2500);
        r.fw.tick(&mut r.io, later);
        assert_eq!(r.fw.table.sessions.len(), 0);
        assert_eq!(r.fw.connections.get(), 0);
    }

    /// Two shards: a connection opened through either shard is tracked by the shard its key
    /// hashes to, and replies that reach the other shard are handed to it and pass. Taken
    /// from one shard's snapshot, each connection goes to its shard.
    #[test]
    fn shards_track_each_connection_once_and_replies_pass_on_either() {
        use crate::testing::TwoShards;
        let cfg = serde_json::json!({ "rules": [{ "action": "accept", "from": "lan" }] });
        let mut t = TwoShards::<Firewall>::new(cfg.clone());
        for k in 0..40u16 {
            t.feeds[(k % 2) as usize][0].transmit(tcp(H, S, 40000 + k, 80, SYN));
            let out = t.run();
            assert_eq!(out[0].1.len() + out[1].1.len(), 1, "SYN out");
            t.feeds[((k + 1) % 2) as usize][1].transmit(tcp(S, H, 80, 40000 + k, SYN | ACK));
            let out = t.run();
            assert_eq!(
                out[0].0.len() + out[1].0.len(),
                1,
                "SYN-ACK in, on the other shard"
            );
        }
        let counts = [
            t.apps[0].table.sessions.len(),
            t.apps[1].table.sessions.len(),
        ];
        assert_eq!(counts[0] + counts[1], 40);
        assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
        assert_eq!(t.apps[0].invalid.get() + t.apps[1].invalid.get(), 0);
        // A stray from the wan side is dropped by its shard's rules, whichever.
        t.feeds[0][1].transmit(tcp(S, H, 5555, 22, SYN));
        t.run();
        assert_eq!(t.apps[0].dropped.get() + t.apps[1].dropped.get(), 1);
        // One shard's connections into two.
        let mut one = rig(cfg.clone());
        for k in 0..20u16 {
            one.in_from_lan(tcp(H, S, 41000 + k, 80, SYN));
        }
        let state = one.fw.snapshot().unwrap().into_state().unwrap();
        let mut two = TwoShards::<Firewall>::new(cfg);
        for app in &mut two.apps {
            app.restore(state.clone()).unwrap();
        }
        assert_eq!(
            two.apps[0].table.sessions.len() + two.apps[1].table.sessions.len(),
            20
        );
        for k in 0..20u16 {
            two.feeds[(k % 2) as usize][1].transmit(tcp(S, H, 80, 41000 + k, SYN | ACK));
            let out = two.run();
            assert_eq!(out[0].0.len() + out[1].0.len(), 1);
        }
    }

    /// An IPv4 frame from `src` to `dst` with protocol `proto` and payload `l4`.
    fn ip_frame(src: [u8; 4], dst: [u8; 4], transport: Transport, payload: &[u8]) -> Vec<u8> {
        Frame::ipv4(src, dst, transport)
            .macs([2, 0, 0, 0, 0, src[3]], [2, 0, 0, 0, 0, dst[3]])
            .payload(payload)
            .bytes()
    }

    const UNREACHABLE: Transport = Transport::Icmp {
        kind: 3,
        code: 3,
        rest: 0,
    };

    fn packet(bytes: &[u8]) -> Packet {
        let mut p = pool::alloc().unwrap();
        p.set_data(bytes).unwrap();
        p
    }

    #[test]
    fn icmp_errors_about_tracked_connections_are_related() {
        let mut r = rig(serde_json::json!({ "rules": [{ "action": "accept", "from": "lan" }] }));
        // H sends a UDP query to S: the connection is tracked.
        let query = ip_frame(H, S, Transport::udp(40000, 53), &[]);
        assert_eq!(r.in_from_lan(packet(&query)), (0, 1));
        // A router says S's port is unreachable, quoting the query: related, it passes in.
        let router = [198, 51, 100, 9];
        assert_eq!(
            r.in_from_wan(packet(&ip_frame(router, H, UNREACHABLE, &query[14..]))),
            (1, 0)
        );
        assert_eq!(r.fw.related.get(), 1);
        // The same error about a query nobody sent: no connection, default drop.
        let other = ip_frame(H, S, Transport::udp(40001, 53), &[]);
        assert_eq!(
            r.in_from_wan(packet(&ip_frame(router, H, UNREACHABLE, &other[14..]))),
            (0, 0)
        );
        assert_eq!(r.fw.related.get(), 1);
    }

    #[test]
    fn rules_match_in_order_with_cidrs_ports_and_reject_with_rst() {
        let mut r = rig(serde_json::json!({
            "default": "accept", "stateful": false,
            "rules": [
                { "action": "reject", "proto": "tcp", "dst": "192.0.2.0/24", "dst_port": "20-25" },
                { "action": "drop", "proto": "tcp", "src": "10.0.0.0/8" },
            ]
        }));
        // Rejected: the RST goes back out of lan with ports swapped and a valid checksum.
        r.lan_in.transmit(tcp(H, S, 40000, 22, SYN));
        r.fw.push(&mut r.io);
        let rst: Vec<Packet> = r.lan_out.drain().collect();
        assert_eq!(rst.len(), 1);
        let ip = Ipv4Packet::new_checked(&rst[0].data()[14..]).unwrap();
        assert_eq!((ip.src_addr().octets(), ip.dst_addr().octets()), (S, H));
        assert!(ip.verify_checksum());
        let t = TcpPacket::new_checked(ip.payload()).unwrap();
        assert_eq!((t.src_port(), t.dst_port()), (22, 40000));
        assert!(t.rst() && t.ack() && !t.syn());
        assert_eq!(t.ack_number().0, 1001, "acknowledges the SYN");
        let (s, d) = (ip.src_addr().into(), ip.dst_addr().into());
        assert!(t.verify_checksum(&s, &d), "TCP checksum");
        assert_eq!(r.wan_out.drain().count(), 0);
        // Second rule: other TCP from 10/8 dropped; other traffic accepted by default.
        assert_eq!(r.in_from_lan(tcp(H, S, 40000, 80, SYN)), (0, 0));
        assert_eq!(
            r.in_from_lan(tcp([172, 16, 0, 1], S, 40000, 80, SYN)),
            (0, 1)
        );
        assert_eq!(r.fw.rules[0].hits.get(), 1);
        assert_eq!(r.fw.rules[1].hits.get(), 1);
    }

    #[test]
    fn bad_rules_are_refused_with_their_number() {
        let c: FirewallConfig = serde_json::from_value(serde_json::json!({
            "rules": [{ "action": "accept" }, { "action": "drop", "dst": "10.0.0.0/40" }]
        }))
        .unwrap();
        let e = Firewall::declare(&c).unwrap_err().to_string();
        assert!(e.contains("rule 2") && e.contains("prefix length"), "{e}");
    }

    #[test]
    fn the_classifier_agrees_with_the_rules_one_by_one() {
        let mut x = 0x2545f4914f6cdd1du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let pick = |r: u64, opts: &[&str]| opts[(r % opts.len() as u64) as usize].to_string();
        let mut rules = Vec::new();
        for _ in 0..300 {
            let mut r = serde_json::json!({ "action": pick(rnd(), &["accept", "drop"]) });
            if rnd() % 2 == 0 {
                r["from"] = serde_json::json!(pick(rnd(), &["lan", "wan"]));
            }
            if rnd() % 2 == 0 {
                r["proto"] = serde_json::json!(pick(rnd(), &["tcp", "udp", "icmp"]));
            }
            if rnd() % 2 == 0 {
                r["dst"] = serde_json::json!(format!("10.{}.0.0/{}", rnd() % 4, 8 + rnd() % 17));
            }
            if rnd() % 3 == 0 {
                r["src"] =
                    serde_json::json!(pick(rnd(), &["192.168.0.0/16", "fd00::/8", "192.168.1.7"]));
            }
            if rnd() % 2 == 0 {
                let a = rnd() % 2000;
                r["dst_port"] = serde_json::json!(format!("{a}-{}", a + rnd() % 500));
            }
            if rnd() % 5 == 0 {
                r["vlan"] = serde_json::json!(rnd() % 3 + 1);
            }
            rules.push(r);
        }
        let c: FirewallConfig =
            serde_json::from_value(serde_json::json!({ "rules": rules })).unwrap();
        let rules = compile(&c, None).unwrap();
        let cls = Classifier::new(&rules);
        for _ in 0..20_000 {
            let v6 = rnd() % 5 == 0;
            let f = Flow {
                vlan: if rnd() % 4 == 0 {
                    Some((rnd() % 4) as u16)
                } else {
                    None
                },
                src: if v6 {
                    IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1))
                } else {
                    IpAddr::V4(std::net::Ipv4Addr::new(
                        192,
                        168,
                        (rnd() % 3) as u8,
                        (rnd() % 10) as u8,
                    ))
                },
                dst: if v6 {
                    IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2))
                } else {
                    IpAddr::V4(std::net::Ipv4Addr::new(
                        10,
                        (rnd() % 5) as u8,
                        (rnd() % 256) as u8,
                        1,
                    ))
                },
                protocol: [6u8, 17, 1, 47][(rnd() % 4) as usize],
                src_port: (rnd() % 3000) as u16,
                dst_port: (rnd() % 3000) as u16,
                icmp_type: None,
            };
            let side = if rnd() % 2 == 0 { Side::Lan } else { Side::Wan };
            let linear = rules.iter().position(|r| r.matches(side, &f));
            assert_eq!(cls.first(side, &f), linear, "{f:?} from {side:?}");
        }
    }
}
