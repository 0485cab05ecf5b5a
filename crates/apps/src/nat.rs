//! `nat`: IPv4 network address and port translation between `lan` and `wan` (each an input and
//! an output of that name).
//!
//! Source NAT (masquerade): TCP, UDP and ICMP echo from the lan side leave with an `external`
//! address and a port (echo identifier) from `ports`, keeping the inside port when it is free.
//! `external` is one address, a prefix (`192.0.2.8/29`: its host addresses) or a list of these;
//! with several, each inside host is given one of them by a hash of its address and keeps it for
//! all its mappings ("paired" pooling, RFC 4787 REQ-2), and each has its own port range — so
//! four addresses carry four times the mappings of one. Mappings are endpoint-independent (RFC 4787 REQ-1, RFC 5382 REQ-1): one inside
//! address and port keep one outside port whatever the destination, and replies from any
//! outside endpoint reach them (endpoint-independent filtering). Mappings expire after
//! `udp_timeout` / `tcp_timeout` / `icmp_timeout` seconds without outbound traffic.
//!
//! The NAT holds up to `max_mappings` (default 1 048 576) in a [`crate::sessions`] table: 32
//! bytes per mapping and two index slots of 8 bytes at most half full — at most 96 bytes per
//! mapping, in pages touched only as mappings are made. Lookups run a batch at a time with the
//! index slots and then the records fetched ahead; expired mappings are reclaimed from the
//! heads of per-protocol lists (within a second of expiry), never by a scan. Free ports are
//! kept per external address and protocol in a bitmap, so a free port — the inside port first
//! — is found in a few word operations and an exhausted range is known at once (counted in
//! `ports_exhausted_drops`): a port scan from inside costs the NAT no more per packet than any
//! other traffic.
//!
//! Sharded (`shards: N`, between interfaces sharded alike), each shard owns the external ports
//! `p` with `p % N` its number and the inside endpoints a fixed hash gives it: a packet from
//! the lan side goes to the shard of its inside endpoint (which makes its mapping from its own
//! ports), one from the wan side to the shard of its destination port — so a reply always
//! finds the mapping, whichever shard the interface gave it to; a packet that reached another
//! shard is handed over (`handed_off`). A change of the number of shards keeps every mapping:
//! each goes to the shard of its port, and the shard of its inside endpoint, if another, keeps
//! a pointer to it that outbound traffic refreshes as it does the mapping.
//!
//! Destination NAT (`forwards`): packets to `external:port` from the wan side go to
//! `to_address:to_port` (`external` of a forward: which external address, the first by default). A lan host that uses the external address of a forward is hairpinned:
//! its packet goes back out of `lan` to the inside server, with the source translated too, so
//! the server answers through the NAT (RFC 4787 REQ-9, RFC 5382 REQ-8).
//!
//! Checksums are updated incrementally (RFC 1624), partial checksums (offloaded senders) as
//! partial sums. Packets that are not IPv4 TCP/UDP/ICMP echo pass unchanged; inbound packets
//! without a mapping are dropped and counted. ICMP errors from outside about translated packets
//! are translated back (outer destination and the quoted packet, RFC 5508).
//!
//! The NAT owns its external addresses on the wan side's link: it answers ARP requests for them
//! with its `mac` (by default 02:4e: and the first external address's four bytes, the same on
//! every host and after restarts), announces them with a gratuitous ARP when it starts, and
//! sends translated packets from that MAC. Inbound packets go to the inside host's own MAC,
//! learned from its ARP and its outbound packets (an inside host not yet seen is asked with an
//! ARP probe, RFC 5227, and the packet keeps its MAC meanwhile): no neighbour entry or address
//! has to be added by hand on either side.
//!
//! ```yaml
//! apps:
//!   nat: { type: nat, external: [192.0.2.10, 198.51.100.8/30], ports: "20000-59999",
//!          forwards: [ { proto: tcp, port: 8080, to_address: 10.0.0.5, to_port: 80 } ] }
//! ```

use crate::sessions::{self, Clock, FreePorts, Index, Millis, Sessions};
use crate::OneOrMany;
use ipnet::Ipv4Net;
use serde::Deserialize;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};
use stitch_core::link::transmit_to;
use stitch_core::packet::ChecksumState;
use stitch_core::{
    App, AppContext, AppError, AppSnapshot, AppState, Counter, Io, Packet, PortNames, PortSpec,
};
use stitch_wire::header::{self, icmp, ipv4, l4, End, Field16, L4Sum};
use stitch_wire::views::Ipv4Packet;
use stitch_wire::{arp, checksum, flow, parse_mac};
use stitch_wire::{ethertype, icmpv4, ip_proto};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forward {
    /// `tcp` or `udp`.
    pub proto: String,
    /// The external port.
    pub port: u16,
    /// The inside server's address.
    pub to_address: Ipv4Addr,
    /// The inside server's port.
    pub to_port: u16,
    /// The external address the forward listens on (default: the first).
    pub external: Option<Ipv4Addr>,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatConfig {
    /// An address, a prefix or a list of these.
    pub external: OneOrMany<String>,
    /// The external port range mappings are made from (`"low-high"`); each external address has all
    /// of it.
    #[serde(default = "default_ports")]
    pub ports: String,
    /// Destination NAT: packets from the wan side to an external address and port go to an inside
    /// server.
    #[serde(default)]
    pub forwards: Vec<Forward>,
    /// Seconds a UDP mapping lives without outbound traffic.
    #[serde(default = "default_udp")]
    pub udp_timeout: u64,
    /// Seconds a TCP mapping lives without outbound traffic.
    #[serde(default = "default_tcp")]
    pub tcp_timeout: u64,
    /// Seconds an ICMP echo mapping lives without outbound traffic.
    #[serde(default = "default_icmp")]
    pub icmp_timeout: u64,
    /// The MAC address the external addresses answer from (default: 02:4e: and the first
    /// external address).
    pub mac: Option<String>,
    /// Mappings held at most (each takes up to 96 bytes once made).
    #[serde(default = "default_max_mappings")]
    pub max_mappings: usize,
}

fn default_max_mappings() -> usize {
    1 << 20
}

fn default_ports() -> String {
    "1024-65535".into()
}
fn default_udp() -> u64 {
    300
}
fn default_tcp() -> u64 {
    7440
}
fn default_icmp() -> u64 {
    60
}

type Inside = (Ipv4Addr, u16);

/// Inside hosts whose MAC address the NAT keeps at most: a lan side sending from ever new
/// addresses cannot grow the table without bound (past this, packets keep their MAC).
const MAX_HOSTS: usize = 65536;
/// Inside hosts the NAT asks for in one second at most, and how often it asks for one.
const PROBES_PER_SECOND: usize = 64;
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// External addresses announced at start at most.
const ANNOUNCED: usize = 16;
/// Packets worked on as one batch: their index slots, then their mappings, fetched ahead.
const BATCH: usize = 32;

/// An outside endpoint of the NAT: protocol, index into the external addresses, port.
type Outside = (u8, u16, u16);

/// A mapping: an inside endpoint and the external address (index) and port it was given.
#[derive(Clone, Copy)]
#[repr(C)]
struct Mapping {
    inside_ip: u32,
    inside_port: u16,
    ext: u16,
    port: u16,
    proto: u8,
    _pad: u8,
}

// SAFETY: integers only.
unsafe impl stitch_core::mapping::Zeroable for Mapping {}

impl Mapping {
    fn inside(&self) -> Inside {
        (Ipv4Addr::from(self.inside_ip), self.inside_port)
    }
}

/// The key of a mapping by its inside endpoint.
#[inline(always)]
fn inside_key(proto: u8, (ip, port): Inside) -> u64 {
    (proto as u64) << 48 | (u32::from(ip) as u64) << 16 | port as u64
}

/// The key of a mapping by its outside endpoint.
#[inline(always)]
fn outside_key((proto, ext, port): Outside) -> u64 {
    (proto as u64) << 32 | (ext as u64) << 16 | port as u64
}

/// The timeout class of a protocol's mappings (one expiry list each).
#[inline(always)]
fn class_of(proto: u8) -> u8 {
    match proto {
        ip_proto::TCP => 0,
        ip_proto::UDP => 1,
        _ => 2,
    }
}

/// The mappings, found by either end, and the free ports of each external address.
struct Table {
    sessions: Sessions<Mapping>,
    by_inside: Index,
    by_outside: Index,
    hasher: foldhash::fast::RandomState,
    /// Free ports per external address and protocol class (`ext * 3 + class`), made when
    /// first used; and where the search for the next one goes on.
    free: Vec<Option<Box<FreePorts>>>,
    cursors: Vec<u16>,
}

impl Table {
    #[inline(always)]
    fn hash(&self, key: u64) -> u32 {
        sessions::short_hash(self.hasher.hash_one(key))
    }

    #[inline(always)]
    fn find_inside(&self, proto: u8, inside: Inside) -> Option<u32> {
        let key = inside_key(proto, inside);
        let s = &self.sessions;
        self.by_inside.find(self.hash(key), |id| {
            let m = s.get(id);
            m.proto == proto && m.inside() == inside
        })
    }

    #[inline(always)]
    fn find_outside(&self, key: Outside) -> Option<u32> {
        let s = &self.sessions;
        self.by_outside.find(self.hash(outside_key(key)), |id| {
            let m = s.get(id);
            (m.proto, m.ext, m.port) == key
        })
    }

    /// Forgets a mapping and gives its port back.
    fn forget(&mut self, id: u32) {
        let m = self.sessions.remove(id);
        let inside = self.hash(inside_key(m.proto, m.inside()));
        let outside = self.hash(outside_key((m.proto, m.ext, m.port)));
        self.by_inside.remove(inside, id);
        self.by_outside.remove(outside, id);
        if let Some(f) = &mut self.free[m.ext as usize * 3 + class_of(m.proto) as usize] {
            f.put(m.port);
        }
    }

    /// Forgets up to `budget` expired mappings, oldest first; how many it forgot.
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

    /// Makes a mapping of `inside` to `(ext, port)` (its port already taken).
    fn add(
        &mut self,
        proto: u8,
        inside: Inside,
        ext: u16,
        port: u16,
        expires: Option<Millis>,
        now: Millis,
    ) -> Option<u32> {
        let m = Mapping {
            inside_ip: inside.0.into(),
            inside_port: inside.1,
            ext,
            port,
            proto,
            _pad: 0,
        };
        let class = class_of(proto);
        let id = match expires {
            Some(t) => self.sessions.insert_until(m, class, t, now)?,
            None => self.sessions.insert(m, class, now)?,
        };
        let (hi, ho) = (
            self.hash(inside_key(proto, inside)),
            self.hash(outside_key((proto, ext, port))),
        );
        self.by_inside.insert(hi, id);
        self.by_outside.insert(ho, id);
        Some(id)
    }
}

/// Mappings reclaimed at most per tick (a millisecond): far above any setup rate one core
/// reaches, so expired mappings never pile up, and a bounded pause.
const RECLAIM_PER_TICK: usize = 4096;

pub struct Nat {
    mac: [u8; 6],
    /// Inside hosts' MAC addresses by IPv4 address.
    hosts: HashMap<Ipv4Addr, [u8; 6], foldhash::fast::RandomState>,
    /// Inside hosts asked for (ARP probe) and when, this second.
    asked: HashMap<Ipv4Addr, Instant, foldhash::fast::RandomState>,
    /// ARP frames to send out of `lan` (probes) and `wan` (answers, announcements).
    arp_out: [Vec<Packet>; 2],
    announced: bool,
    externals: Vec<Ipv4Addr>,
    external_index: HashMap<Ipv4Addr, u16, foldhash::fast::RandomState>,
    /// The lowest and highest external address.
    external_span: (u32, u32),
    range: (u16, u16),
    forwards: HashMap<Outside, Inside, foldhash::fast::RandomState>,
    /// The forwards by their inside server: a server's replies to hairpinned clients.
    forwarded_from: HashMap<(u8, Inside), Outside, foldhash::fast::RandomState>,
    table: Table,
    clock: Clock,
    /// This shard's number and the number of shards (0 and 1 when not sharded).
    shard: (u16, u16),
    /// Inside endpoints whose mapping another shard holds (taken back after a change of the
    /// number of shards): the shard and until when, refreshed by outbound traffic.
    held_elsewhere: HashMap<(u8, Inside), (u16, Millis), foldhash::fast::RandomState>,
    /// Packets of one batch, taken from an input before they are worked on.
    batch: Vec<Packet>,
    last_sweep: Instant,
    translated_out: Counter,
    translated_in: Counter,
    handed_off: Counter,
    hairpinned: Counter,
    no_mapping: Counter,
    ports_exhausted: Counter,
    table_full: Counter,
    passed: Counter,
    malformed: Counter,
    mappings: Counter,
    arp_answered: Counter,
    arp_probes: Counter,
    unresolved: Counter,
}

fn proto_number(p: &str) -> Result<u8, String> {
    match p {
        "tcp" => Ok(ip_proto::TCP),
        "udp" => Ok(ip_proto::UDP),
        _ => Err(format!("forward proto `{p}`: tcp or udp")),
    }
}

/// The external addresses: each entry an address or a prefix (its host addresses).
fn parse_externals(e: &OneOrMany<String>) -> Result<Vec<Ipv4Addr>, String> {
    let mut out = Vec::new();
    for s in e.to_vec() {
        if s.contains('/') {
            let net: Ipv4Net = s
                .parse()
                .map_err(|_| format!("external `{s}`: an IPv4 address or prefix"))?;
            if net.prefix_len() < 16 {
                return Err(format!("external `{s}`: at most a /16 of addresses"));
            }
            out.extend(net.hosts());
        } else {
            out.push(
                s.parse()
                    .map_err(|_| format!("external `{s}`: an IPv4 address or prefix"))?,
            );
        }
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = out.iter().find(|a| !seen.insert(**a)) {
        return Err(format!("external address {dup} is given twice"));
    }
    if out.is_empty() {
        return Err("give at least one external address".into());
    }
    Ok(out)
}

fn parse_range(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| format!("ports `{s}`: use A-B"))?;
    let (a, b): (u16, u16) = (
        a.trim().parse().map_err(|_| format!("ports `{s}`"))?,
        b.trim().parse().map_err(|_| format!("ports `{s}`"))?,
    );
    if a == 0 || a > b {
        return Err(format!("ports `{s}`: need 1 <= A <= B"));
    }
    Ok((a, b))
}

/// Offsets of the IPv4 header and L4 header of a frame; `None` if it is not one to translate.
fn layout(d: &[u8]) -> Option<(usize, usize, u8)> {
    let (l3, ethertype, _) = flow::l3(d).ok()?;
    if ethertype != ethertype::IPV4 || d.len() < l3 + 20 {
        return None;
    }
    let ip = &d[l3..];
    let ihl = ipv4::header_len(ip);
    let proto = ipv4::PROTOCOL.get(ip);
    if ihl < ipv4::MIN_LEN || ipv4::FLAGS_FRAG.get(ip) & ipv4::OFFSET != 0 {
        return None; // a header shorter than IPv4's, or a non-first fragment: no L4 header
    }
    let need = match proto {
        ip_proto::TCP => 20,
        ip_proto::UDP => 8,
        ip_proto::ICMP => 8,
        _ => return None,
    };
    (d.len() >= l3 + ihl + need).then_some((l3, l3 + ihl, proto))
}

/// An ARP frame from `eth_src` to `eth_dst`, as a packet.
fn arp_frame(
    eth_dst: [u8; 6],
    eth_src: [u8; 6],
    op: u16,
    sender: ([u8; 6], Ipv4Addr),
    target: ([u8; 6], Ipv4Addr),
) -> Option<Packet> {
    stitch_core::pool::alloc_with(&arp::frame(eth_dst, eth_src, op, sender, target))
}

/// Where the headers of a frame are: IPv4 header, L4 header, protocol.
#[derive(Clone, Copy)]
struct At {
    l3: usize,
    l4: usize,
    proto: u8,
}

/// The field of a NAT mapping's "port" in an IPv4 packet's transport header at `end`: the
/// port, or ICMP echo's identifier (at both ends).
fn port_field(proto: u8, end: End) -> Field16 {
    match (proto, end) {
        (ip_proto::ICMP, _) => icmp::ECHO_IDENT,
        (_, End::Source) => l4::SRC_PORT,
        (_, End::Destination) => l4::DST_PORT,
    }
}

/// Rewrites the address and port at `end` of the packet, updating the checksums incrementally.
fn rewrite(p: &mut Packet, at: At, end: End, (addr, port): (Ipv4Addr, u16)) {
    let sum = match p.checksum_state() {
        ChecksumState::Partial => L4Sum::Partial,
        _ => L4Sum::Full,
    };
    let (ip, l4) = p.data_mut()[at.l3..].split_at_mut(at.l4 - at.l3);
    let field = port_field(at.proto, end);
    header::rewrite_ipv4_endpoint(ip, l4, end, (addr, field, port), sum);
}

/// The timeouts of the protocol classes (TCP, UDP, ICMP echo), checked.
fn timeouts(c: &NatConfig) -> Result<[Millis; 3], String> {
    Ok([
        sessions::timeout_millis("tcp_timeout", c.tcp_timeout)?,
        sessions::timeout_millis("udp_timeout", c.udp_timeout)?,
        sessions::timeout_millis("icmp_timeout", c.icmp_timeout)?,
    ])
}

impl Nat {
    /// The external address (index) of an inside host: fixed by its address, so all its
    /// mappings share one external address (paired pooling).
    fn external_of(&self, inside: Ipv4Addr) -> u16 {
        let n = self.externals.len() as u64;
        if n == 1 {
            return 0;
        }
        let h = u32::from(inside).wrapping_mul(0x9e37_79b1) as u64;
        ((h * n) >> 32) as u16
    }

    /// The index of `a` among the external addresses.
    #[inline]
    fn external_index(&self, a: Ipv4Addr) -> Option<u16> {
        if self.externals.len() == 1 {
            return (a == self.externals[0]).then_some(0);
        }
        // Most packets are for none of them: a range check first.
        let (lo, hi) = self.external_span;
        if !(lo..=hi).contains(&u32::from(a)) {
            return None;
        }
        self.external_index.get(&a).copied()
    }

    /// The free ports of external address `ext` for `proto`, made on first use.
    fn free_ports(&mut self, proto: u8, ext: u16) -> &mut FreePorts {
        let at = ext as usize * 3 + class_of(proto) as usize;
        let (lo, hi) = self.range;
        let forwards = &self.forwards;
        let (me, shards) = self.shard;
        self.table.free[at].get_or_insert_with(|| {
            Box::new(FreePorts::new(lo, hi, |p| {
                forwards.contains_key(&(proto, ext, p)) || p % shards != me
            }))
        })
    }

    /// The outside endpoint (external address index, port) of an inside endpoint, allocating a
    /// port if needed. Outbound traffic keeps a mapping alive (RFC 4787 REQ-6); a mapping
    /// found expired but not yet reclaimed lives on with its port.
    #[inline]
    fn map_out(&mut self, proto: u8, inside: Inside, now: Instant) -> Option<(u16, u16)> {
        let now = self.clock.at(now);
        if let Some(id) = self.table.find_inside(proto, inside) {
            self.table.sessions.refresh(id, now);
            let m = self.table.sessions.get(id);
            return Some((m.ext, m.port));
        }
        self.new_mapping(proto, inside, now)
    }

    /// A new mapping: the inside port when it is free (port preservation), else the next
    /// free one after the last given. Expired mappings are reclaimed first when the range or
    /// the table is full.
    fn new_mapping(&mut self, proto: u8, inside: Inside, now: Millis) -> Option<(u16, u16)> {
        let ext = self.external_of(inside.0);
        let cursor_at = ext as usize * 3 + class_of(proto) as usize;
        let mut port = None;
        for attempt in 0..2 {
            if attempt == 1 && self.table.reclaim(now, 16) == 0 {
                break;
            }
            let cursor = self.table.cursors[cursor_at];
            let free = self.free_ports(proto, ext);
            port = if free.take(inside.1) {
                Some(inside.1)
            } else {
                free.take_next(cursor)
            };
            if port.is_some() {
                break;
            }
        }
        let Some(port) = port else {
            self.ports_exhausted.add(1);
            return None;
        };
        if self.table.sessions.len() == self.table.sessions.capacity() {
            self.table.reclaim(now, 16);
        }
        if self
            .table
            .add(proto, inside, ext, port, None, now)
            .is_none()
        {
            self.free_ports(proto, ext).put(port);
            self.table_full.add(1);
            return None;
        }
        if port != inside.1 {
            self.table.cursors[cursor_at] = port.wrapping_add(1);
        }
        Some((ext, port))
    }

    /// The shard that makes and holds the mappings of inside endpoint `inside`: a fixed hash,
    /// the same in every shard.
    #[inline]
    fn inside_owner(&self, proto: u8, inside: Inside) -> u16 {
        let h = inside_key(proto, inside).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
        ((h * self.shard.1 as u64) >> 32) as u16
    }

    /// The shard a frame from `side` (0 lan, 1 wan) belongs to: the owner of its mapping,
    /// found from the frame alone; this shard when any shard can take it (untranslated, a
    /// forward).
    pub fn shard_of_frame(&self, side: usize, d: &[u8]) -> u16 {
        self.owner(side, d)
    }

    #[inline]
    fn owner(&self, side: usize, d: &[u8]) -> u16 {
        let me = self.shard.0;
        if d.len() < 14 || d[12..14] == ethertype::ARP.to_be_bytes() {
            return me;
        }
        let Some((l3, l4, proto)) = layout(d) else {
            return me;
        };
        let ip = &d[l3..];
        let (src, dst): (Ipv4Addr, Ipv4Addr) = (ipv4::SRC.get(ip).into(), ipv4::DST.get(ip).into());
        let dport = port_field(proto, End::Destination).get(&d[l4..]);
        let port_owner = |p: u16| p % self.shard.1;
        if side == 0 {
            if proto == ip_proto::ICMP && d[l4] != icmpv4::ECHO_REQUEST {
                return me;
            }
            let sport = port_field(proto, End::Source).get(&d[l4..]);
            return match self.external_index(dst) {
                // A reply of a hairpinned connection, to the client's mapped port.
                Some(e) if !self.forwards.contains_key(&(proto, e, dport)) => port_owner(dport),
                _ if !self.forwarded_from.is_empty()
                    && self.forwarded_from.contains_key(&(proto, (src, sport))) =>
                {
                    me
                }
                _ => self.inside_owner(proto, (src, sport)),
            };
        }
        let Some(ext) = self.external_index(dst) else {
            return me;
        };
        if proto == ip_proto::ICMP {
            return match d[l4] {
                icmpv4::ECHO_REPLY => port_owner(dport),
                icmpv4::DESTINATION_UNREACHABLE
                | icmpv4::TIME_EXCEEDED
                | icmpv4::PARAMETER_PROBLEM => {
                    // The packet it quotes: its source port is the mapped one.
                    let q = l4 + 8;
                    let quoted = d.get(q..).filter(|b| b.len() >= 20).and_then(|b| {
                        let ql4 = q + (b[0] & 0x0f) as usize * 4;
                        port_field(b[9], End::Source).try_get(d.get(ql4..)?)
                    });
                    quoted.map_or(me, port_owner)
                }
                _ => me,
            };
        }
        if self.forwards.contains_key(&(proto, ext, dport)) {
            return me;
        }
        port_owner(dport)
    }

    /// Brings in what the lookups of a batch will read: each packet's index slot, then the
    /// mapping it leads to. Hints only: each packet's own path looks its mapping up again.
    fn fetch_ahead(&self, side: Option<usize>, batch: &[Packet]) {
        let mut hashes = [(0u32, 0usize); BATCH];
        let mut n = 0;
        for p in batch {
            let side = side.unwrap_or(p.header().user[0] as usize);
            let d = p.data();
            let Some((l3, l4, proto)) = layout(d) else {
                continue;
            };
            let ip = &d[l3..];
            let key = if side == 0 {
                let sport = port_field(proto, End::Source).get(&d[l4..]);
                inside_key(proto, (ipv4::SRC.get(ip).into(), sport))
            } else {
                let Some(ext) = self.external_index(ipv4::DST.get(ip).into()) else {
                    continue;
                };
                outside_key((
                    proto,
                    ext,
                    port_field(proto, End::Destination).get(&d[l4..]),
                ))
            };
            let h = self.table.hash(key);
            let index = if side == 0 {
                &self.table.by_inside
            } else {
                &self.table.by_outside
            };
            index.prefetch(h);
            hashes[n] = (h, side);
            n += 1;
        }
        for &(h, side) in &hashes[..n] {
            let index = if side == 0 {
                &self.table.by_inside
            } else {
                &self.table.by_outside
            };
            if let Some(id) = index.first(h) {
                self.table.sessions.prefetch(id);
            }
        }
    }

    /// The shard that holds `inside`'s mapping when another does (since a change of the number
    /// of shards), refreshed as outbound traffic refreshes the mapping there.
    fn held_elsewhere_refresh(&mut self, proto: u8, inside: Inside, now: Instant) -> Option<u16> {
        let now = self.clock.at(now);
        if self.table.find_inside(proto, inside).is_some() {
            return None;
        }
        let timeout = self.table.sessions.timeout(class_of(proto));
        let (shard, until) = self.held_elsewhere.get_mut(&(proto, inside))?;
        if !sessions::ahead(*until, now) {
            return None;
        }
        *until = now.wrapping_add(timeout);
        Some(*shard)
    }

    /// The inside endpoint mapped to an outside one, if the mapping is alive.
    #[inline]
    fn inside_of(&mut self, key: Outside, now: Instant) -> Option<Inside> {
        let id = self.table.find_outside(key)?;
        let s = &self.table.sessions;
        s.is_alive(id, self.clock.at(now))
            .then(|| s.get(id).inside())
    }

    /// An ARP frame that entered from `side`: requests for an external address on the wan side
    /// are answered, inside hosts learnt on the lan side. Returns whether the frame passes on.
    fn arp(&mut self, side: usize, d: &[u8]) -> bool {
        let Some(m) = arp::Message::read(d) else {
            return true;
        };
        if side == 0 {
            if !m.sender_ip.is_unspecified() {
                self.learn(m.sender_ip, m.sender_mac);
            }
            // Answers to the NAT's own probes stop here.
            return d[0..6] != self.mac;
        }
        if m.is_request() && self.external_index(m.target_ip).is_some() {
            let answer = arp_frame(
                m.sender_mac,
                self.mac,
                2,
                (self.mac, m.target_ip),
                (m.sender_mac, m.sender_ip),
            );
            if let Some(a) = answer {
                self.arp_out[1].push(a);
                self.arp_answered.add(1);
            }
            return false;
        }
        true
    }

    /// Keeps `mac` as inside host `ip`'s address.
    fn learn(&mut self, ip: Ipv4Addr, mac: [u8; 6]) {
        if mac[0] & 1 == 1 || mac == [0; 6] || mac == self.mac {
            return;
        }
        let full = self.hosts.len() >= MAX_HOSTS;
        match self.hosts.get_mut(&ip) {
            Some(known) => *known = mac,
            None if !full => {
                self.hosts.insert(ip, mac);
            }
            None => {}
        }
    }

    /// A translated packet of inside host `src` leaves from the NAT's MAC address.
    fn send_from_nat_mac(&mut self, p: &mut Packet, src: Ipv4Addr) {
        let d = p.data_mut();
        let mac: [u8; 6] = d[6..12].try_into().unwrap();
        d[6..12].copy_from_slice(&self.mac);
        self.learn(src, mac);
    }

    /// A translated packet goes to inside host `to`'s MAC address, once the NAT knows it.
    fn address_inside_host(&mut self, p: &mut Packet, to: Ipv4Addr, now: Instant) {
        match self.hosts.get(&to) {
            Some(mac) => p.data_mut()[0..6].copy_from_slice(mac),
            None => {
                self.unresolved.add(1);
                self.probe(to, now);
            }
        }
    }

    /// Asks for inside host `ip` with an ARP probe (RFC 5227: sender address 0.0.0.0, as
    /// the NAT has no address of its own on the lan side), at most once a second.
    fn probe(&mut self, ip: Ipv4Addr, now: Instant) {
        if self.asked.len() >= PROBES_PER_SECOND || self.asked.contains_key(&ip) {
            return;
        }
        self.asked.insert(ip, now);
        let probe = arp_frame(
            [0xff; 6],
            self.mac,
            1,
            (self.mac, Ipv4Addr::UNSPECIFIED),
            ([0; 6], ip),
        );
        if let Some(f) = probe {
            self.arp_out[0].push(f);
            self.arp_probes.add(1);
        }
    }

    /// Gratuitous ARP for the external addresses, once: neighbours that knew them at another
    /// MAC address (an earlier NAT) update at once.
    fn announce(&mut self) {
        self.announced = true;
        for i in 0..self.externals.len().min(ANNOUNCED) {
            let ext = self.externals[i];
            if let Some(f) = arp_frame([0xff; 6], self.mac, 1, (self.mac, ext), ([0; 6], ext)) {
                self.arp_out[1].push(f);
            }
        }
    }

    fn send_arp(&mut self, outputs: &mut [Option<stitch_core::Producer>]) {
        for (side, frames) in self.arp_out.iter_mut().enumerate() {
            for f in frames.drain(..) {
                transmit_to(&mut outputs[side], f);
            }
        }
    }

    /// Translates a packet from the lan side; returns the side to send it out of.
    fn outbound(&mut self, p: &mut Packet, now: Instant) -> Option<usize> {
        let Some((l3, l4, proto)) = layout(p.data()) else {
            self.passed.add(1);
            return Some(1);
        };
        let d = p.data();
        if proto == ip_proto::ICMP && d[l4] != icmpv4::ECHO_REQUEST {
            self.passed.add(1);
            return Some(1);
        }
        let ip = &d[l3..];
        let (src, dst) = (ipv4::SRC.get(ip).into(), ipv4::DST.get(ip).into());
        let sport = port_field(proto, End::Source).get(&d[l4..]);
        let dport = port_field(proto, End::Destination).get(&d[l4..]);
        let at = At { l3, l4, proto };
        // A forward's server answering an outside client: from the forward's address and
        // port, with no mapping of its own.
        if let Some(&(_, e, fport)) = self.forwarded_from.get(&(proto, (src, sport))) {
            if self.external_index(dst).is_none() {
                rewrite(p, at, End::Source, (self.externals[e as usize], fport));
                self.send_from_nat_mac(p, src);
                self.translated_out.add(1);
                return Some(1);
            }
        }
        // Hairpin: a lan host talking to a forwarded external port.
        let hairpin = self
            .external_index(dst)
            .and_then(|e| self.forwards.get(&(proto, e, dport)).copied());
        if !self.held_elsewhere.is_empty() {
            if let Some(shard) = self.held_elsewhere_refresh(proto, (src, sport), now) {
                return Some(2 + shard as usize);
            }
        }
        let (ext, ext_port) = self.map_out(proto, (src, sport), now)?;
        rewrite(p, at, End::Source, (self.externals[ext as usize], ext_port));
        self.send_from_nat_mac(p, src);
        if let Some(to) = hairpin {
            let to_ip = to.0;
            rewrite(p, at, End::Destination, to);
            self.address_inside_host(p, to_ip, now);
            self.hairpinned.add(1);
            return Some(0);
        }
        self.translated_out.add(1);
        Some(1)
    }

    /// Translates a packet from the wan side; returns the side to send it out of.
    fn inbound(&mut self, p: &mut Packet, now: Instant) -> Option<usize> {
        let Some((l3, l4, proto)) = layout(p.data()) else {
            self.passed.add(1);
            return Some(0);
        };
        let d = p.data();
        let dst = ipv4::DST.get(&d[l3..]).into();
        let Some(ext) = self.external_index(dst) else {
            self.passed.add(1);
            return Some(0);
        };
        let icmp_error = matches!(
            d[l4],
            icmpv4::DESTINATION_UNREACHABLE | icmpv4::TIME_EXCEEDED | icmpv4::PARAMETER_PROBLEM
        );
        if proto == ip_proto::ICMP && icmp_error {
            return self.icmp_error_in(p, At { l3, l4, proto }, ext, now);
        }
        if proto == ip_proto::ICMP && d[l4] != icmpv4::ECHO_REPLY {
            self.passed.add(1);
            return Some(0);
        }
        let dport = port_field(proto, End::Destination).get(&d[l4..]);
        let target = match self.forwards.get(&(proto, ext, dport)) {
            Some(&t) => t,
            None => match self.inside_of((proto, ext, dport), now) {
                Some(inside) => inside,
                None => {
                    self.no_mapping.add(1);
                    return None;
                }
            },
        };
        rewrite(p, At { l3, l4, proto }, End::Destination, target);
        self.address_inside_host(p, target.0, now);
        self.translated_in.add(1);
        Some(0)
    }

    /// An ICMP error from outside about a packet this NAT translated (RFC 5508 §4.2): the
    /// packet it quotes carries the external address and port, so both the outer destination
    /// and the quoted source go back to the inside endpoint, with every checksum updated.
    fn icmp_error_in(&mut self, p: &mut Packet, at: At, ext: u16, now: Instant) -> Option<usize> {
        let d = p.data();
        let q = at.l4 + 8; // quoted IPv4 header
                           // A quote is cut short of the length its header gives: no checked view.
        let Some(quote) = d.get(q..).filter(|b| b.len() >= 20) else {
            self.malformed.add(1);
            return None;
        };
        let quote = Ipv4Packet::new_unchecked(quote);
        let qproto = u8::from(quote.next_header());
        let ql4 = q + quote.header_len() as usize;
        let field = port_field(qproto, End::Source);
        if quote.version() != 4
            || (quote.header_len() as usize) < ipv4::MIN_LEN
            || d.len() < ql4 + field.end()
            || !matches!(qproto, ip_proto::ICMP | ip_proto::TCP | ip_proto::UDP)
        {
            self.malformed.add(1);
            return None;
        }
        let Some(inside) = self.inside_of((qproto, ext, field.get(&d[ql4..])), now) else {
            self.no_mapping.add(1);
            return None;
        };
        // The quoted packet: source address and port back to the inside endpoint. Its L4
        // checksum is updated only when the quote holds it.
        let quoted = At {
            l3: q,
            l4: ql4,
            proto: qproto,
        };
        if d.len() >= ql4 + header::l4_checksum(qproto).end() {
            rewrite(p, quoted, End::Source, inside);
        } else {
            let (qip, ql4) = p.data_mut()[q..].split_at_mut(ql4 - q);
            header::set_ipv4_addr(qip, End::Source, inside.0);
            field.set(ql4, inside.1);
        }
        // The outer destination, then the ICMP checksum over the whole (changed) message.
        let (ip, icmp_message) = p.data_mut()[at.l3..].split_at_mut(at.l4 - at.l3);
        header::set_ipv4_addr(ip, End::Destination, inside.0);
        let end = (ipv4::TOTAL_LEN.get(ip) as usize)
            .saturating_sub(ip.len())
            .min(icmp_message.len());
        icmp::CHECKSUM.set(icmp_message, 0);
        let cs = checksum::checksum(&icmp_message[..end]);
        icmp::CHECKSUM.set(icmp_message, cs);
        self.address_inside_host(p, inside.0, now);
        self.translated_in.add(1);
        Some(0)
    }

    /// A reply of a hairpinned connection comes back from the inside server on the lan side:
    /// it must look like it comes from the external address, to the original client.
    fn hairpin_reply(&mut self, p: &mut Packet, now: Instant) -> bool {
        let Some((l3, l4, proto)) = layout(p.data()) else {
            return false;
        };
        let d = p.data();
        let ip = &d[l3..];
        let (src, dst): (Ipv4Addr, Ipv4Addr) = (ipv4::SRC.get(ip).into(), ipv4::DST.get(ip).into());
        let (sport, dport) = (l4::SRC_PORT.get(&d[l4..]), l4::DST_PORT.get(&d[l4..]));
        let Some(ext) = self.external_index(dst) else {
            return false;
        };
        let Some(&(_, fwd_ext, fwd_port)) = self.forwarded_from.get(&(proto, (src, sport))) else {
            return false;
        };
        let Some(client) = self.inside_of((proto, ext, dport), now) else {
            return false;
        };
        let fwd_addr = self.externals[fwd_ext as usize];
        let at = At { l3, l4, proto };
        rewrite(p, at, End::Source, (fwd_addr, fwd_port));
        rewrite(p, at, End::Destination, client);
        self.send_from_nat_mac(p, src);
        self.address_inside_host(p, client.0, now);
        self.hairpinned.add(1);
        true
    }
}

/// What the NAT carries across a restart of Stitch (format version [`STATE_VERSION`]): its
/// live mappings, each with the time it has left, the inside hosts' MAC addresses, and — a
/// shard's — which inside endpoints it owns have their mapping on another shard (made before
/// a change of the number of shards): without them, an upgrade would have such an endpoint's
/// next packet make a new mapping, another external port, here.
#[derive(serde::Serialize, Deserialize)]
struct NatState {
    mappings: Vec<MappingState>,
    hosts: Vec<(Ipv4Addr, [u8; 6])>,
    /// The number of shards the pointers are for (a snapshot of an older version has none).
    #[serde(default)]
    shards: u16,
    #[serde(default)]
    held_elsewhere: Vec<PointerState>,
}

#[derive(serde::Serialize, Deserialize)]
struct PointerState {
    proto: u8,
    inside: Inside,
    shard: u16,
    expires_in_ms: u64,
}

#[derive(serde::Serialize, Deserialize)]
struct MappingState {
    proto: u8,
    inside: Inside,
    external: Ipv4Addr,
    port: u16,
    expires_in_ms: u64,
}

const STATE_VERSION: u32 = 1;

impl Nat {
    fn state(&self, now: Instant) -> NatState {
        let now = self.clock.at(now);
        let s = &self.table.sessions;
        let mappings = s
            .iter_alive(now)
            .map(|(id, m)| MappingState {
                proto: m.proto,
                inside: m.inside(),
                external: self.externals[m.ext as usize],
                port: m.port,
                expires_in_ms: s.expires(id).wrapping_sub(now) as u64,
            })
            .collect();
        let hosts = self.hosts.iter().map(|(ip, mac)| (*ip, *mac)).collect();
        let held_elsewhere = (self.held_elsewhere.iter())
            .filter(|(_, (_, until))| sessions::ahead(*until, now))
            .map(|(&(proto, inside), &(shard, until))| PointerState {
                proto,
                inside,
                shard,
                expires_in_ms: until.wrapping_sub(now) as u64,
            })
            .collect();
        NatState {
            mappings,
            hosts,
            shards: self.shard.1,
            held_elsewhere,
        }
    }

    /// Notes that shard `holder` holds the mapping of `inside`, when that inside endpoint is
    /// this shard's, for `expires_in_ms` more (at most its protocol's timeout).
    fn point_elsewhere(
        &mut self,
        proto: u8,
        inside: Inside,
        holder: u16,
        expires_in_ms: u64,
        now: Millis,
    ) {
        if self.inside_owner(proto, inside) != self.shard.0 {
            return;
        }
        let timeout = self.table.sessions.timeout(class_of(proto));
        let until = now.wrapping_add(expires_in_ms.min(timeout as u64) as Millis);
        self.held_elsewhere.insert((proto, inside), (holder, until));
    }

    /// Takes back a mapping from a snapshot when this configuration would have made it: the
    /// same external address for its inside host, a port of the range that no forward holds
    /// and no other mapping took. Mappings come in order of expiry.
    fn take_back(&mut self, m: MappingState, now: Millis) -> bool {
        let ext = self.external_of(m.inside.0);
        let timeout = self.table.sessions.timeout(class_of(m.proto));
        let expires_in = m.expires_in_ms.min(timeout as u64) as Millis;
        let (me, shards) = self.shard;
        let holder = m.port % shards;
        if holder != me {
            // Another shard's port: it takes the mapping back; this one points to it when the
            // inside endpoint is this shard's.
            if self.externals[ext as usize] == m.external {
                self.point_elsewhere(m.proto, m.inside, holder, m.expires_in_ms, now);
            }
            return false;
        }
        let fits = self.externals[ext as usize] == m.external
            && self.table.find_inside(m.proto, m.inside).is_none()
            && self.free_ports(m.proto, ext).take(m.port);
        if !fits {
            return false;
        }
        let expires = now.wrapping_add(expires_in);
        if self
            .table
            .add(m.proto, m.inside, ext, m.port, Some(expires), now)
            .is_none()
        {
            self.free_ports(m.proto, ext).put(m.port);
            return false;
        }
        true
    }
}

impl App for Nat {
    type Config = NatConfig;
    const EXAMPLE: &'static str = r#"external: 192.0.2.8/29
ports: "10000-60000"
forwards:
  - { proto: tcp, port: 8080, to_address: 10.0.0.5, to_port: 80 }
"#;
    const HANDS_OFF: bool = true;

    fn declare(c: &NatConfig) -> Result<PortSpec, AppError> {
        parse_range(&c.ports)?;
        timeouts(c)?;
        if c.max_mappings == 0 {
            return Err("max_mappings: at least 1".into());
        }
        let externals = parse_externals(&c.external)?;
        for f in &c.forwards {
            proto_number(&f.proto)?;
            if let Some(e) = f.external.filter(|e| !externals.contains(e)) {
                return Err(
                    format!("forward to port {}: {e} is not an external address", f.port).into(),
                );
            }
        }
        let sides = vec!["lan".to_string(), "wan".to_string()];
        Ok(PortSpec {
            inputs: PortNames::Fixed(sides.clone()),
            outputs: PortNames::Fixed(sides),
        })
    }

    fn new(c: NatConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let range = parse_range(&c.ports)?;
        let externals = parse_externals(&c.external)?;
        let external_index: HashMap<Ipv4Addr, u16, _> = externals
            .iter()
            .enumerate()
            .map(|(i, a)| (*a, i as u16))
            .collect();
        let mut forwards = HashMap::default();
        for f in &c.forwards {
            let ext = f
                .external
                .map_or(Some(0), |e| external_index.get(&e).copied());
            let ext =
                ext.ok_or_else(|| format!("forward to port {}: not an external address", f.port))?;
            forwards.insert(
                (proto_number(&f.proto)?, ext, f.port),
                (f.to_address, f.to_port),
            );
        }
        let forwarded_from = forwards
            .iter()
            .map(|(&(proto, ext, port), &to)| ((proto, to), (proto, ext, port)))
            .collect();
        let timeouts = timeouts(&c)?;
        let shard = ctx
            .shard()
            .map_or((0, 1), |s| (s.index as u16, s.count as u16));
        let table = Table {
            sessions: Sessions::new(c.max_mappings, &timeouts)?,
            by_inside: Index::new(c.max_mappings)?,
            by_outside: Index::new(c.max_mappings)?,
            hasher: Default::default(),
            free: (0..externals.len() * 3).map(|_| None).collect(),
            cursors: vec![range.0; externals.len() * 3],
        };
        let mac = match &c.mac {
            Some(m) => parse_mac(m)?,
            None => {
                let [a, b, c, d] = externals[0].octets();
                [0x02, 0x4e, a, b, c, d]
            }
        };
        Ok(Nat {
            mac,
            hosts: HashMap::default(),
            asked: HashMap::default(),
            arp_out: [Vec::new(), Vec::new()],
            announced: false,
            external_span: (
                externals.iter().map(|&a| u32::from(a)).min().unwrap_or(0),
                externals.iter().map(|&a| u32::from(a)).max().unwrap_or(0),
            ),
            externals,
            external_index,
            range,
            forwards,
            forwarded_from,
            table,
            clock: Clock::default(),
            shard,
            held_elsewhere: HashMap::default(),
            batch: Vec::with_capacity(BATCH),
            last_sweep: Instant::now(),
            translated_out: ctx.counter("translated_out"),
            translated_in: ctx.counter("translated_in"),
            handed_off: ctx.counter("handed_off"),
            hairpinned: ctx.counter("hairpinned"),
            no_mapping: ctx.counter("no_mapping_drops"),
            ports_exhausted: ctx.counter("ports_exhausted_drops"),
            table_full: ctx.counter("mapping_table_full_drops"),
            passed: ctx.counter("passed_untranslated"),
            malformed: ctx.counter("malformed_drops"),
            mappings: ctx.counter("mappings"),
            arp_answered: ctx.counter("arp_answered"),
            arp_probes: ctx.counter("arp_probes"),
            unresolved: ctx.counter("unresolved_inside_mac"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let now = Instant::now();
        let (me, shards) = self.shard;
        let (inputs, outputs) = io.split();
        for (slot, input) in inputs.iter_mut().enumerate() {
            let Some(input) = input.as_mut() else {
                continue;
            };
            // Slots 0 and 1: the lan and wan sides; from 2 on, what another shard handed over,
            // its side in the packet.
            let from_side = (slot < 2).then_some(slot);
            loop {
                let mut batch = std::mem::take(&mut self.batch);
                let mut took = 0;
                for mut p in input.drain().take(BATCH) {
                    took += 1;
                    // A packet of another shard's flow goes on to it before any lookup.
                    if let Some(side) = from_side.filter(|_| shards > 1) {
                        let owner = self.owner(side, p.data());
                        if owner != me {
                            p.header_mut().user[0] = side as u64;
                            self.handed_off.add(1);
                            transmit_to(&mut outputs[2 + owner as usize], p);
                            continue;
                        }
                    }
                    batch.push(p);
                }
                if took == 0 {
                    self.batch = batch;
                    break;
                }
                self.fetch_ahead(from_side, &batch);
                for mut p in batch.drain(..) {
                    let side = from_side.unwrap_or_else(|| p.header().user[0] as usize);
                    if p.len() < 14 {
                        self.malformed.add(1);
                        continue;
                    }
                    if p.data()[12..14] == ethertype::ARP.to_be_bytes() {
                        if self.arp(side, p.data()) {
                            self.passed.add(1);
                            transmit_to(&mut outputs[1 - side], p);
                        }
                        continue;
                    }
                    let to = if side == 0 {
                        if self.hairpin_reply(&mut p, now) {
                            Some(0)
                        } else {
                            self.outbound(&mut p, now)
                        }
                    } else {
                        self.inbound(&mut p, now)
                    };
                    match to {
                        Some(o) if o >= 2 => {
                            p.header_mut().user[0] = side as u64;
                            self.handed_off.add(1);
                            transmit_to(&mut outputs[o], p);
                        }
                        Some(o) => {
                            transmit_to(&mut outputs[o], p);
                        }
                        None => {}
                    }
                }
                self.batch = batch;
            }
        }
        self.send_arp(outputs);
        self.mappings.set(self.table.sessions.len() as u64);
    }

    /// Mappings: `{"count", "capacity", "memory_bytes", "mappings": [{proto, inside,
    /// outside, expires_in_s}]}`.
    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        let limit = request["limit"].as_u64().unwrap_or(1000) as usize;
        let now = self.clock.at(Instant::now());
        let t = &self.table;
        let mappings: Vec<_> = t
            .sessions
            .iter_alive(now)
            .take(limit)
            .map(|(id, m)| {
                serde_json::json!({ "proto": m.proto,
                "inside": format!("{}:{}", Ipv4Addr::from(m.inside_ip), m.inside_port),
                "outside": format!("{}:{}", self.externals[m.ext as usize], m.port),
                "expires_in_s": t.sessions.expires(id).wrapping_sub(now) / 1000 })
            })
            .collect();
        let memory =
            t.sessions.memory_bytes() + t.by_inside.memory_bytes() + t.by_outside.memory_bytes();
        serde_json::json!({ "count": t.sessions.len(), "capacity": t.sessions.capacity(),
            "memory_bytes": memory, "mappings": mappings })
    }

    fn snapshot(&self) -> Option<AppSnapshot> {
        Some(AppSnapshot::new(STATE_VERSION, self.state(Instant::now())))
    }

    /// Mappings this configuration would not have made (another external address or port
    /// range) are left out and counted in the log line.
    fn restore(&mut self, state: AppState) -> Result<(), String> {
        let state: NatState = serde_json::from_value(state.of_version(STATE_VERSION)?)
            .map_err(|e| format!("NAT state: {e}"))?;
        let now = self.clock.at(Instant::now());
        let total = state.mappings.len();
        let mut mappings = state.mappings;
        // In order of expiry: the expiry lists stay in order.
        mappings.sort_by_key(|m| m.expires_in_ms);
        let kept = mappings
            .into_iter()
            .filter(|m| m.expires_in_ms > 0)
            .map(|m| self.take_back(m, now))
            .filter(|&kept| kept)
            .count();
        for (ip, mac) in state.hosts.into_iter().take(MAX_HOSTS) {
            self.hosts.insert(ip, mac);
        }
        // A shard's pointers, when it is the same shard of as many (a change of the number
        // of shards makes them again from the mappings above).
        let (me, shards) = self.shard;
        if state.shards == shards {
            for p in state.held_elsewhere {
                if p.shard != me && p.shard < shards && p.expires_in_ms > 0 {
                    self.point_elsewhere(p.proto, p.inside, p.shard, p.expires_in_ms, now);
                }
            }
        }
        self.mappings.set(self.table.sessions.len() as u64);
        log::info!("nat: {kept} of {total} mappings taken back from the snapshot");
        Ok(())
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        if !self.announced && self.shard.0 == 0 {
            self.announce();
            self.send_arp(io.split().1);
        }
        self.table.reclaim(self.clock.at(now), RECLAIM_PER_TICK);
        self.mappings.set(self.table.sessions.len() as u64);
        if now.duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        self.asked
            .retain(|_, at| now.duration_since(*at) < PROBE_INTERVAL);
        let now = self.clock.at(now);
        self.held_elsewhere
            .retain(|_, (_, until)| sessions::ahead(*until, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::Consumer;
    use stitch_core::pool;
    use stitch_wire::build::{Frame, Transport};

    fn l4_ok(d: &[u8]) -> bool {
        let ip = Ipv4Packet::new_checked(&d[14..]).unwrap();
        let l4 = ip.payload();
        let proto = u8::from(ip.next_header());
        let mut s = 0;
        if proto != ip_proto::ICMP {
            s = checksum::sum(&d[26..34], 0) + proto as u64 + l4.len() as u64;
        }
        ip.verify_checksum() && checksum::finish(checksum::sum(l4, s)) == 0
    }

    /// The source address and port of a frame.
    fn src(d: &[u8]) -> (&[u8], u16) {
        (&d[26..30], l4::SRC_PORT.get(&d[34..]))
    }

    /// The destination address and port of a frame.
    fn dst(d: &[u8]) -> (&[u8], u16) {
        (&d[30..34], l4::DST_PORT.get(&d[34..]))
    }

    /// A frame of `proto` (ICMP: an echo request with identifier `dp`, or a reply if `sp` is
    /// 0) with 10 bytes of payload.
    fn packet(proto: u8, src: [u8; 4], sp: u16, dst: [u8; 4], dp: u16) -> Packet {
        let transport = match proto {
            ip_proto::TCP => Transport::tcp(sp, dp),
            ip_proto::UDP => Transport::udp(sp, dp),
            _ if sp == 0 => Transport::echo_reply(dp, 0),
            _ => Transport::echo_request(dp, 0),
        };
        let payload: Vec<u8> = (0..10).collect();
        let f = Frame::ipv4(src, dst, transport)
            .macs([2, 0, 0, 0, src[2], src[3]], [2, 0, 0, 0, dst[2], dst[3]])
            .payload(&payload)
            .bytes();
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        p
    }

    struct Rig {
        nat: Nat,
        io: Io,
        lan: stitch_core::Producer,
        wan: stitch_core::Producer,
        to_lan: Consumer,
        to_wan: Consumer,
        /// ARP frames the NAT sent: (side, frame).
        arp: Vec<(usize, Vec<u8>)>,
    }

    fn rig() -> Rig {
        rig_with(serde_json::json!("192.0.2.10"))
    }

    fn rig_with(external: serde_json::Value) -> Rig {
        let nat = crate::testing::build::<Nat>(serde_json::json!({
            "external": external, "ports": "5000-5001",
            "forwards": [ { "proto": "tcp", "port": 8080, "to_address": "10.0.0.7", "to_port": 80 } ]
        }));
        let (io, [lan, wan], [to_lan, to_wan]) = crate::testing::ports(["lan", "wan"]);
        Rig {
            nat,
            io,
            lan,
            wan,
            to_lan,
            to_wan,
            arp: Vec::new(),
        }
    }

    impl Rig {
        /// The IP frames out of lan and wan; ARP frames go to `arp`.
        fn run(&mut self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
            self.nat.push(&mut self.io);
            let mut out = [Vec::new(), Vec::new()];
            for (side, c) in [&mut self.to_lan, &mut self.to_wan].into_iter().enumerate() {
                for p in c.drain() {
                    let f = p.data().to_vec();
                    if f[12..14] == ethertype::ARP.to_be_bytes() {
                        self.arp.push((side, f));
                    } else {
                        out[side].push(f);
                    }
                }
            }
            let [l, w] = out;
            (l, w)
        }
    }

    const IN: [u8; 4] = [10, 0, 0, 5];
    const SRV: [u8; 4] = [10, 0, 0, 7];
    const OUT: [u8; 4] = [198, 51, 100, 1];
    const EXT: [u8; 4] = [192, 0, 2, 10];

    fn arp_request(sender: ([u8; 6], [u8; 4]), target: [u8; 4]) -> Packet {
        let f = arp_frame(
            [0xff; 6],
            sender.0,
            1,
            (sender.0, sender.1.into()),
            ([0; 6], target.into()),
        );
        f.unwrap()
    }

    #[test]
    fn external_addresses_are_answered_in_arp_and_inside_hosts_get_their_own_mac() {
        let mut r = rig();
        let router = [2, 0, 0, 0, 0, 0x99];
        let nat_mac = [0x02, 0x4e, 192, 0, 2, 10];
        r.nat.tick(&mut r.io, Instant::now());
        r.run();
        assert_eq!(
            r.arp.len(),
            1,
            "one gratuitous ARP for the one external address"
        );
        assert_eq!((r.arp[0].0, &r.arp[0].1[28..32]), (1, &EXT[..]));
        r.arp.clear();
        // Who has the external address? The NAT, on the wan side; other addresses pass.
        r.wan.transmit(arp_request((router, OUT), EXT));
        r.wan.transmit(arp_request((router, OUT), [192, 0, 2, 11]));
        let (l, _) = r.run();
        assert_eq!(r.arp.len(), 2);
        let (side, answer) = &r.arp[1];
        assert_eq!(
            (*side, &answer[0..6], &answer[20..22]),
            (1, &router[..], &[0, 2][..])
        );
        assert_eq!((&answer[22..28], &answer[28..32]), (&nat_mac[..], &EXT[..]));
        assert_eq!(r.arp[0].0, 0, "the other request is passed to lan");
        assert!(l.is_empty());
        r.arp.clear();
        // An inside host's packet leaves from the NAT's MAC; the reply reaches the host's.
        r.lan.transmit(packet(ip_proto::UDP, IN, 5000, OUT, 53));
        let (_, w) = r.run();
        assert_eq!(&w[0][6..12], &nat_mac);
        r.wan.transmit(packet(ip_proto::UDP, OUT, 53, EXT, 5000));
        let (l, _) = r.run();
        assert_eq!(&l[0][0..6], &[2, 0, 0, 0, 0, 5], "IN's own MAC");
        // A forward's server not seen yet: the packet keeps its MAC and the server is probed
        // once; its answer is learnt and stops at the NAT.
        r.wan.transmit(packet(ip_proto::TCP, OUT, 1234, EXT, 8080));
        r.wan.transmit(packet(ip_proto::TCP, OUT, 1235, EXT, 8080));
        let (l, _) = r.run();
        assert_eq!(l.len(), 2);
        assert_eq!(r.arp.len(), 1, "one probe");
        let (side, probe) = &r.arp[0];
        assert_eq!(
            (*side, &probe[28..32], &probe[38..42]),
            (0, &[0u8; 4][..], &SRV[..])
        );
        let server = [2, 0, 0, 0, 0, 7];
        let mut answer = arp_frame(
            nat_mac,
            server,
            2,
            (server, SRV.into()),
            (nat_mac, [0; 4].into()),
        )
        .unwrap();
        answer.data_mut()[0..6].copy_from_slice(&nat_mac);
        r.lan.transmit(answer);
        r.arp.clear();
        let (_, w) = r.run();
        assert!(
            w.is_empty() && r.arp.is_empty(),
            "the probe's answer is the NAT's"
        );
        r.wan.transmit(packet(ip_proto::TCP, OUT, 1236, EXT, 8080));
        let (l, _) = r.run();
        assert_eq!(&l[0][0..6], &server);
        assert_eq!(
            (
                r.nat.arp_answered.get(),
                r.nat.arp_probes.get(),
                r.nat.unresolved.get()
            ),
            (1, 1, 2)
        );
    }

    #[test]
    fn masquerade_keeps_mappings_and_checksums() {
        let mut r = rig();
        r.lan.transmit(packet(ip_proto::UDP, IN, 5000, OUT, 53));
        r.lan.transmit(packet(ip_proto::TCP, IN, 40000, OUT, 443));
        let (_, w) = r.run();
        assert_eq!(w.len(), 2);
        assert_eq!(src(&w[0]), (&EXT[..], 5000), "port kept");
        assert_eq!(&w[1][26..30], &EXT[..]);
        let tcp_port = l4::SRC_PORT.get(&w[1][34..]);
        assert!((5000..=5001).contains(&tcp_port));
        assert!(w.iter().all(|f| l4_ok(f)), "checksums after SNAT");
        // Replies from any outside endpoint reach the inside host (endpoint-independent).
        r.wan
            .transmit(packet(ip_proto::UDP, [203, 0, 113, 9], 7777, EXT, 5000));
        r.wan
            .transmit(packet(ip_proto::TCP, OUT, 443, EXT, tcp_port));
        r.wan.transmit(packet(ip_proto::UDP, OUT, 53, EXT, 5001));
        let (l, _) = r.run();
        assert_eq!(l.len(), 2);
        assert_eq!(dst(&l[0]), (&IN[..], 5000));
        assert_eq!(dst(&l[1]), (&IN[..], 40000));
        assert!(
            l.iter().all(|f| l4_ok(f)),
            "checksums after reverse translation"
        );
        assert_eq!(r.nat.no_mapping.get(), 1);
        // ICMP echo: the identifier is the port.
        r.lan.transmit(packet(ip_proto::ICMP, IN, 1, OUT, 777));
        let (_, w) = r.run();
        assert!(l4_ok(&w[0]) && w[0][26..30] == EXT);
    }

    #[test]
    fn icmp_errors_about_translated_packets_reach_the_inside_host() {
        let mut r = rig();
        r.lan.transmit(packet(ip_proto::UDP, IN, 5000, OUT, 53));
        let (_, w) = r.run();
        let sent = &w[0];
        // OUT answers "port unreachable", quoting the translated IP header and 8 bytes of UDP.
        let quote = &sent[14..14 + 28];
        let unreachable = Transport::Icmp {
            kind: 3,
            code: 3,
            rest: 0,
        };
        let f = Frame::ipv4(OUT, EXT, unreachable).payload(quote).bytes();
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        r.wan.transmit(p);
        let (l, _) = r.run();
        assert_eq!(l.len(), 1);
        let d = &l[0];
        assert_eq!(&d[30..34], &IN[..], "outer destination");
        assert_eq!(checksum::checksum(&d[14..34]), 0);
        assert_eq!(checksum::checksum(&d[34..]), 0, "ICMP checksum");
        let q = 42;
        assert_eq!(&d[q + 12..q + 16], &IN[..], "quoted source address");
        assert_eq!(l4::SRC_PORT.get(&d[q + 20..]), 5000, "quoted source port");
        assert_eq!(
            checksum::checksum(&d[q..q + 20]),
            0,
            "quoted IP header checksum"
        );
    }

    /// Found by the `network_functions` fuzz target: an IPv4 header length below 20 bytes
    /// (IHL < 5), in a packet or in the packet an ICMP error quotes, cut the header short of
    /// its addresses and the rewrite panicked. Neither is translated now, and nothing panics.
    #[test]
    fn headers_shorter_than_ipv4_s_are_not_translated() {
        let mut r = rig();
        let mut f = packet(ip_proto::UDP, IN, 5000, OUT, 53);
        f.data_mut()[14] = 0x43;
        r.lan.transmit(f);
        let (_, w) = r.run();
        assert_eq!(w.len(), 1, "passed as it came");
        assert_eq!(&w[0][26..30], &IN[..], "untranslated");
        r.lan.transmit(packet(ip_proto::UDP, IN, 5000, OUT, 53));
        let (_, w) = r.run();
        let mut quote = w[0][14..14 + 28].to_vec();
        quote[0] = 0x43;
        let unreachable = Transport::Icmp {
            kind: 3,
            code: 3,
            rest: 0,
        };
        let f = Frame::ipv4(OUT, EXT, unreachable).payload(&quote).bytes();
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        let before = r.nat.malformed.get();
        r.wan.transmit(p);
        let (l, _) = r.run();
        assert!(l.is_empty());
        assert_eq!(r.nat.malformed.get(), before + 1);
    }

    /// A restarted NAT given the old one's snapshot answers replies on the mappings the old one
    /// made — the second host's moved port included, which a fresh NAT would give the first
    /// host that asks; another format version is refused, never misread.
    #[test]
    fn mappings_survive_a_restart_through_a_snapshot() {
        let mut old = rig();
        old.lan.transmit(packet(ip_proto::UDP, IN, 5000, OUT, 53));
        old.lan.transmit(packet(ip_proto::UDP, SRV, 5000, OUT, 53));
        let (_, w) = old.run();
        let moved = src(&w[1]).1;
        assert_eq!(moved, 5001, "the second host's port 5000 was taken");
        let state = old.nat.snapshot().unwrap().into_state().unwrap();
        let mut new = rig();
        assert!(new
            .nat
            .restore(AppState {
                version: 99,
                state: state.state.clone()
            })
            .unwrap_err()
            .contains("version 99"));
        new.nat.restore(state).unwrap();
        new.wan.transmit(packet(ip_proto::UDP, OUT, 53, EXT, 5001));
        new.wan.transmit(packet(ip_proto::UDP, OUT, 53, EXT, 5000));
        let (l, _) = new.run();
        assert_eq!(l.len(), 2, "both replies found their mapping");
        assert_eq!(dst(&l[0]), (&SRV[..], 5000));
        assert_eq!(dst(&l[1]), (&IN[..], 5000));
        assert_eq!(new.nat.no_mapping.get(), 0);
    }

    #[test]
    fn port_forward_and_hairpin() {
        let mut r = rig();
        r.wan.transmit(packet(ip_proto::TCP, OUT, 33333, EXT, 8080));
        let (l, _) = r.run();
        assert_eq!(dst(&l[0]), (&SRV[..], 80));
        assert!(l4_ok(&l[0]));
        // A lan host uses the external address: back out of lan to the server, source translated.
        r.lan.transmit(packet(ip_proto::TCP, IN, 41000, EXT, 8080));
        let (l, w) = r.run();
        assert!(w.is_empty());
        assert_eq!(&l[0][26..30], &EXT[..]);
        assert_eq!(dst(&l[0]), (&SRV[..], 80));
        assert!(l4_ok(&l[0]));
        let mapped = l4::SRC_PORT.get(&l[0][34..]);
        // The server answers the external address; the client sees the forward's address.
        r.lan.transmit(packet(ip_proto::TCP, SRV, 80, EXT, mapped));
        let (l, _) = r.run();
        assert_eq!(src(&l[0]), (&EXT[..], 8080));
        assert_eq!(dst(&l[0]), (&IN[..], 41000));
        assert!(l4_ok(&l[0]));
        assert_eq!(r.nat.hairpinned.get(), 2);
    }

    #[test]
    fn partial_checksums_stay_partial_sums() {
        let mut r = rig();
        let mut p = packet(ip_proto::TCP, IN, 40000, OUT, 443);
        // Make it look like an offloaded send: the field holds the pseudo-header sum.
        let d = p.data_mut();
        let ps = checksum::sum(&d[26..34], 0) + 6 + (d.len() - 34) as u64;
        let mut f = ps;
        while f > 0xffff {
            f = (f & 0xffff) + (f >> 16);
        }
        header::tcp::CHECKSUM.set(&mut d[34..], f as u16);
        p.header_mut().csum_start = 34;
        p.header_mut().csum_offset = 16;
        p.set_checksum_state(ChecksumState::Partial);
        r.lan.transmit(p);
        r.nat.push(&mut r.io);
        let mut out: Vec<Packet> = r.to_wan.drain().collect();
        stitch_wire::offload::complete_checksum(&mut out[0]).unwrap();
        assert!(
            l4_ok(out[0].data()),
            "completing after translation gives a valid checksum"
        );
    }

    #[test]
    fn several_external_addresses_pair_each_host_with_one() {
        // 192.0.2.20/30 gives .21 and .22; with .10 three addresses of two ports each.
        let mut r = rig_with(serde_json::json!(["192.0.2.10", "192.0.2.20/30"]));
        assert_eq!(r.nat.externals.len(), 3);
        let mut by_host = std::collections::HashMap::new();
        for host in 1..=24u8 {
            for sport in [1000, 2000] {
                r.lan
                    .transmit(packet(ip_proto::UDP, [10, 0, 1, host], sport, OUT, 53));
            }
            let (_, w) = r.run();
            // Two ports per address: both mappings of a host fit on its address.
            assert_eq!(w.len(), 2, "host {host}");
            let ext: Vec<[u8; 4]> = w.iter().map(|f| f[26..30].try_into().unwrap()).collect();
            assert_eq!(
                ext[0], ext[1],
                "one external address per host (paired pooling)"
            );
            assert!(w.iter().all(|f| l4_ok(f)));
            by_host.insert(host, (ext[0], l4::SRC_PORT.get(&w[0][34..])));
            // Free the ports again so the next host finds room on any address.
            r.nat.forget_all();
        }
        let used: std::collections::HashSet<_> = by_host.values().map(|v| v.0).collect();
        assert_eq!(used.len(), 3, "hosts spread over all external addresses");
        // A reply to the second address reaches the host mapped there, and only it.
        let (host, (ext, port)) = by_host
            .iter()
            .find(|(_, (e, _))| *e == [192, 0, 2, 22])
            .map(|(h, v)| (*h, *v))
            .unwrap();
        r.lan
            .transmit(packet(ip_proto::UDP, [10, 0, 1, host], 1000, OUT, 53));
        r.run();
        r.wan.transmit(packet(ip_proto::UDP, OUT, 53, ext, port));
        let other = [192, 0, 2, 21];
        r.wan.transmit(packet(ip_proto::UDP, OUT, 53, other, port));
        let (l, _) = r.run();
        assert_eq!(l.len(), 1);
        assert_eq!(&l[0][30..34], &[10, 0, 1, host][..]);
        assert!(l4_ok(&l[0]));
        assert_eq!(
            r.nat.no_mapping.get(),
            1,
            "same port on another address: no mapping"
        );
        // The forward listens on the first address only.
        r.wan
            .transmit(packet(ip_proto::TCP, OUT, 33333, [192, 0, 2, 22], 8080));
        r.wan.transmit(packet(ip_proto::TCP, OUT, 33333, EXT, 8080));
        let (l, _) = r.run();
        assert_eq!(l.len(), 1);
        assert_eq!(&l[0][30..34], &SRV[..]);
    }

    impl Nat {
        /// Forgets every mapping (a test's reset).
        fn forget_all(&mut self) {
            let ids: Vec<u32> = self
                .table
                .sessions
                .iter_alive(self.clock.at(Instant::now()))
                .map(|(id, _)| id)
                .collect();
            for id in ids {
                self.table.forget(id);
            }
        }
    }

    /// With every port of the range taken, new flows are refused at once and counted, the
    /// established ones go on being translated both ways, and a port comes back when its
    /// mapping expires (reclaimed by the tick, or by the next new flow that needs it).
    #[test]
    fn an_exhausted_range_refuses_new_flows_and_keeps_established_ones() {
        let mut r = rig();
        r.nat.table.sessions.set_timeouts(&[10_000; 3]);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut a = packet(ip_proto::UDP, IN, 5000, OUT, 53);
        let mut b = packet(ip_proto::UDP, SRV, 7000, OUT, 53);
        assert_eq!(r.nat.outbound(&mut a, t0), Some(1));
        assert_eq!(r.nat.outbound(&mut b, t0), Some(1));
        assert_eq!(r.nat.table.free[1].as_ref().unwrap().free(), 0);
        for i in 0..1000u16 {
            let mut p = packet(
                ip_proto::UDP,
                [10, 0, 9, (i % 200) as u8],
                1000 + i,
                OUT,
                53,
            );
            assert_eq!(r.nat.outbound(&mut p, at(1)), None);
        }
        assert_eq!(r.nat.ports_exhausted.get(), 1000);
        // Established flows: out and back, while the scan goes on.
        for ms in [2_000, 4_000, 6_000] {
            let mut a = packet(ip_proto::UDP, IN, 5000, OUT, 53);
            assert_eq!(r.nat.outbound(&mut a, at(ms)), Some(1));
            assert_eq!(src(a.data()), (&EXT[..], 5000));
            let mut reply = packet(ip_proto::UDP, OUT, 53, EXT, 5001);
            assert_eq!(r.nat.inbound(&mut reply, at(ms)), Some(0));
            assert_eq!(dst(reply.data()), (&SRV[..], 7000));
        }
        // SRV's mapping, silent since 0 s, expires at 10 s; the next new flow gets its port
        // without waiting for a tick.
        let mut late = packet(ip_proto::UDP, [10, 0, 9, 1], 1234, OUT, 53);
        assert_eq!(r.nat.outbound(&mut late, at(10_500)), Some(1));
        assert_eq!(src(late.data()), (&EXT[..], 5001));
        assert_eq!(r.nat.table.sessions.len(), 2);
        // The tick reclaims IN's mapping once it has expired (16 s: refreshed at 6 s).
        r.nat.tick(&mut r.io, at(15_000));
        assert_eq!(r.nat.table.sessions.len(), 2);
        r.nat.tick(&mut r.io, at(17_000));
        assert_eq!(r.nat.table.sessions.len(), 1);
        assert_eq!(r.nat.table.free[1].as_ref().unwrap().free(), 1);
    }

    /// A NAT holds `max_mappings` at most: the next new flow is refused and counted, until a
    /// mapping expires.
    #[test]
    fn the_mapping_table_has_a_size() {
        let mut r = Rig {
            nat: crate::testing::build::<Nat>(serde_json::json!({
                "external": "192.0.2.10", "max_mappings": 2, "udp_timeout": 5 })),
            ..rig()
        };
        let t0 = Instant::now();
        for (i, p) in [1000u16, 1001, 1002].into_iter().enumerate() {
            let mut f = packet(ip_proto::UDP, IN, p, OUT, 53);
            let out = r.nat.outbound(&mut f, t0);
            assert_eq!(out.is_some(), i < 2);
        }
        assert_eq!(r.nat.table_full.get(), 1);
        let mut f = packet(ip_proto::UDP, IN, 1002, OUT, 53);
        assert_eq!(r.nat.outbound(&mut f, t0 + Duration::from_secs(6)), Some(1));
        assert_eq!(r.nat.table.sessions.len(), 1, "both old ones reclaimed");
    }

    /// Two shards: whichever shard a packet reaches, its mapping is made by the shard of its
    /// inside endpoint from that shard's own ports, and a reply reaching the other shard is
    /// handed to it — endpoint-independent mapping and filtering kept across shards.
    #[test]
    fn shards_map_from_their_own_ports_and_replies_find_the_shard_that_did() {
        use crate::testing::TwoShards;
        let mut t = TwoShards::<Nat>::new(
            serde_json::json!({ "external": "192.0.2.10", "ports": "5000-5999" }),
        );
        let mut made = Vec::new();
        for k in 0..40u16 {
            let host = [10, 0, 1, (k % 10) as u8 + 1];
            t.feeds[(k % 2) as usize][0].transmit(packet(ip_proto::UDP, host, 1000 + k, OUT, 53));
            let out = t.run();
            let sent: Vec<(usize, &Vec<u8>)> = (0..2)
                .flat_map(|s| out[s].1.iter().map(move |f| (s, f)))
                .collect();
            assert_eq!(sent.len(), 1, "one frame out of one shard");
            let (shard, frame) = sent[0];
            let port = src(frame).1;
            assert_eq!(port as usize % 2, shard, "a shard's own port");
            made.push((host, 1000 + k, port, shard));
        }
        let handed = t.apps[0].handed_off.get() + t.apps[1].handed_off.get();
        assert!(handed > 0 && handed < 40, "{handed} handed over");
        assert!(made.iter().any(|m| m.3 == 0) && made.iter().any(|m| m.3 == 1));
        for &(host, sport, port, shard) in &made {
            // A reply from another endpoint, into the shard that did not make the mapping.
            t.feeds[1 - shard][1].transmit(packet(
                ip_proto::UDP,
                [203, 0, 113, 7],
                9999,
                EXT,
                port,
            ));
            let out = t.run();
            assert!(out[1 - shard].0.is_empty());
            assert_eq!(out[shard].0.len(), 1);
            assert_eq!(dst(&out[shard].0[0]), (&host[..], sport));
            // The same inside endpoint toward another destination keeps its mapping.
            t.feeds[1 - shard][0].transmit(packet(
                ip_proto::UDP,
                host,
                sport,
                [203, 0, 113, 8],
                80,
            ));
            let out = t.run();
            assert_eq!(src(&out[shard].1[0]).1, port);
        }
        assert_eq!(t.apps[0].no_mapping.get() + t.apps[1].no_mapping.get(), 0);
        assert_eq!(
            t.apps[0].table.sessions.len() + t.apps[1].table.sessions.len(),
            40
        );
    }

    /// From one shard to two: each mapping goes to the shard of its port; the shard of its
    /// inside endpoint, if the other, points outbound packets to it. Nothing is remapped.
    #[test]
    fn mappings_are_redistributed_when_the_number_of_shards_changes() {
        use crate::testing::TwoShards;
        let cfg = serde_json::json!({ "external": "192.0.2.10", "ports": "5000-5999" });
        let mut one = crate::testing::build::<Nat>(cfg.clone());
        let (mut io, [mut lan, _wan], [_to_lan, mut to_wan]) =
            crate::testing::ports(["lan", "wan"]);
        let mut made = Vec::new();
        for k in 0..30u16 {
            let host = [10, 0, 2, k as u8 + 1];
            lan.transmit(packet(ip_proto::UDP, host, 2000, OUT, 53));
            one.push(&mut io);
            let f = to_wan.drain().next().unwrap();
            made.push((host, src(f.data()).1));
        }
        let state = one.snapshot().unwrap().into_state().unwrap();
        let mut t = TwoShards::<Nat>::new(cfg);
        for app in &mut t.apps {
            app.restore(state.clone()).unwrap();
        }
        assert_eq!(
            t.apps[0].table.sessions.len() + t.apps[1].table.sessions.len(),
            30
        );
        for (host, port) in made {
            for entry in 0..2 {
                t.feeds[entry][0].transmit(packet(ip_proto::UDP, host, 2000, OUT, 53));
                let out = t.run();
                let shard = port as usize % 2;
                assert_eq!(
                    src(&out[shard].1[0]).1,
                    port,
                    "the same port, from its shard"
                );
                t.feeds[entry][1].transmit(packet(ip_proto::UDP, OUT, 53, EXT, port));
                let out = t.run();
                assert_eq!(dst(&out[shard].0[0]), (&host[..], 2000));
            }
        }
        assert_eq!(
            t.apps[0].table.sessions.len() + t.apps[1].table.sessions.len(),
            30,
            "none made anew"
        );
    }

    /// A forward's server answers an outside client from the forward's address and port.
    #[test]
    fn a_forward_s_replies_leave_from_its_address_and_port() {
        let mut r = rig();
        r.wan.transmit(packet(ip_proto::TCP, OUT, 33333, EXT, 8080));
        r.run();
        r.lan.transmit(packet(ip_proto::TCP, SRV, 80, OUT, 33333));
        let (_, w) = r.run();
        assert_eq!(src(&w[0]), (&EXT[..], 8080));
        assert_eq!(dst(&w[0]), (&OUT[..], 33333));
        assert!(l4_ok(&w[0]));
        assert!(r.nat.table.sessions.is_empty(), "no mapping of its own");
    }

    #[test]
    fn bad_external_addresses_are_refused() {
        for (e, msg) in [
            (serde_json::json!("192.0.2.300"), "IPv4 address or prefix"),
            (
                serde_json::json!(["192.0.2.1", "192.0.2.0/30"]),
                "given twice",
            ),
            (serde_json::json!("10.0.0.0/8"), "at most a /16"),
            (serde_json::json!([]), "at least one"),
        ] {
            let c: NatConfig =
                serde_json::from_value(serde_json::json!({ "external": e })).unwrap();
            let err = Nat::declare(&c).expect_err("refused").to_string();
            assert!(err.contains(msg), "{err}");
        }
    }

    #[test]
    fn outbound_traffic_keeps_a_mapping_alive_and_silence_ends_it() {
        let mut r = rig();
        r.nat.table.sessions.set_timeouts(&[10_000; 3]);
        let t0 = Instant::now();
        let secs = |s: u64| t0 + Duration::from_secs(s);
        let mut out = packet(ip_proto::UDP, IN, 5000, OUT, 53);
        assert_eq!(r.nat.outbound(&mut out, t0), Some(1));
        // Refreshed by outbound traffic at 8 s: alive until 18 s, also for replies, whose
        // copy of the expiry is brought up to date on the way.
        let mut again = packet(ip_proto::UDP, IN, 5000, OUT, 53);
        r.nat.outbound(&mut again, secs(8));
        let mut reply = packet(ip_proto::UDP, OUT, 53, EXT, 5000);
        assert_eq!(r.nat.inbound(&mut reply, secs(15)), Some(0));
        assert_eq!(&reply.data()[30..34], &IN[..]);
        // Replies alone do not refresh it (RFC 4787 REQ-6: outbound refresh).
        let mut late = packet(ip_proto::UDP, OUT, 53, EXT, 5000);
        assert_eq!(r.nat.inbound(&mut late, secs(19)), None);
        // The sweep forgets both halves; the port can go to another host.
        r.nat.tick(&mut r.io, secs(19));
        assert!(r.nat.table.sessions.is_empty() && r.nat.table.by_outside.is_empty());
        let mut other = packet(ip_proto::UDP, SRV, 5000, OUT, 53);
        r.nat.outbound(&mut other, secs(20));
        assert_eq!(l4::SRC_PORT.get(&other.data()[34..]), 5000);
    }
}
