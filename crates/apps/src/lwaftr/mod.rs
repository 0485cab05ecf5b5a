//! `lwaftr`: the carrier side of Lightweight 4over6 (RFC 7596), configured with Snabb's own
//! lwAFTR configuration file.
//!
//! Port `v4` faces the IPv4 internet (external interface), port `v6` the IPv6 access network
//! of the B4s (internal interface); each is an input and an output. IPv4 toward a bound
//! (address, port) is encapsulated in IPv6 toward its B4 (TTL decremented, traffic class from
//! the TOS, hop limit 255, next header 4); IPv4-in-IPv6 from a B4 is decapsulated only when the
//! inner source address and port belong to the softwire whose B4 and BR addresses the outer
//! header carries; hairpinned traffic (B4 to B4) is re-encapsulated. The function answers ARP,
//! NDP and ping for its own addresses, resolves next hops given by IP, and sends rate-limited
//! ICMPv4/ICMPv6 errors as the configuration allows. Every drop has its own counter.
//!
//! ```yaml
//! apps:
//!   aftr: { type: lwaftr, conf: lwaftr.conf }   # Snabb's softwire-config text
//! links:
//!   - "internet.output -> aftr.v4"
//!   - "aftr.v4 -> internet.input"
//!   - "access.output -> aftr.v6"
//!   - "aftr.v6 -> access.input"
//! ```
//!
//! Softwires are added and removed at run time through the control socket / API
//! (`{"command": "add_softwire", …}`, `{"command": "remove_softwire", …}`).
//!
//! Fragments are reassembled before translation (IPv4 from the internet, IPv6 from the B4s,
//! within the configured reassembly limits) and packets above the MTU of the side they leave
//! are fragmented (IPv6 fragment identifications start at 0x42424243 and count up, so that runs
//! are reproducible); with DF set, an IPv4 packet too big for the tunnel gets ICMPv4 3/4.
//!
//! ICMPv6 errors from the access network about tunnelled packets are relayed to the IPv4
//! sender as ICMPv4 (RFC 2473 §8). Hop-by-hop, routing and destination options headers in
//! front of the tunnelled packet are stepped over.

pub mod binding;
pub mod config;
pub mod frag;

use binding::{BindingTable, Softwire};
use config::{Interface, LwaftrConfig, NextHop, Policy, SoftwireSpec};
use serde::Deserialize;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stitch_core::app::{AppContext, AppError, Counter, Io, PortNames, PortSpec, Reconfigured};
use stitch_core::{pool, App, Packet};
use stitch_wire::checksum;
use stitch_wire::ndp::{icmp6_checksum, lladdr_option, multicast_mac, solicited_node, ICMPV6};

const V4: usize = 0;
const V6: usize = 1;
const ICMP: u8 = 1;
const TCP: u8 = 6;
const UDP: u8 = 17;
const IPIP: u8 = 4;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LwaftrAppConfig {
    /// Snabb lwAFTR configuration file (`softwire-config { … }`).
    pub conf: PathBuf,
    /// Which `instance { device …; queue { id …; } }` to take (default: the first).
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub queue: Option<u32>,
    /// One interface for both sides (port `wire`): frames are told apart by their VLAN tag when
    /// the sides have different ones, else by EtherType.
    #[serde(default)]
    pub on_a_stick: bool,
}

/// Loads and checks the configuration file named by the app's config.
pub fn load(
    c: &LwaftrAppConfig,
    ctx: Option<&AppContext>,
) -> Result<(LwaftrConfig, usize), String> {
    let path = ctx
        .map(|x| x.path(&c.conf))
        .unwrap_or_else(|| c.conf.clone());
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let cfg = config::parse(&text).map_err(|e| format!("{}:{e}", path.display()))?;
    let q = cfg
        .queues
        .iter()
        .position(|q| {
            c.device.as_ref().is_none_or(|d| *d == q.device) && c.queue.is_none_or(|id| id == q.id)
        })
        .ok_or_else(|| {
            format!(
                "{}: no instance queue matches device {:?} queue {:?}",
                path.display(),
                c.device,
                c.queue
            )
        })?;
    Ok((cfg, q))
}

struct Counters {
    encapsulated: Counter,
    decapsulated: Counter,
    hairpinned: Counter,
    no_softwire: Counter,
    source_mismatch: Counter,
    ttl_expired: Counter,
    fragments: Counter,
    reassembled: Counter,
    fragmented: Counter,
    icmp_policy: Counter,
    too_big: Counter,
    malformed: Counter,
    not_ip: Counter,
    not_for_us: Counter,
    vlan: Counter,
    no_next_hop: Counter,
    icmpv6_errors: Counter,
    icmpv6_relayed: Counter,
    icmp_sent: Counter,
    icmp_rate_limited: Counter,
    arp_replies: Counter,
    ndp_replies: Counter,
    echo_replies: Counter,
}

impl Counters {
    fn new(ctx: &AppContext) -> Counters {
        Counters {
            encapsulated: ctx.counter("encapsulated"),
            decapsulated: ctx.counter("decapsulated"),
            hairpinned: ctx.counter("hairpinned"),
            no_softwire: ctx.counter("no_softwire_drops"),
            source_mismatch: ctx.counter("source_mismatch_drops"),
            ttl_expired: ctx.counter("ttl_expired_drops"),
            fragments: ctx.counter("fragment_drops"),
            reassembled: ctx.counter("reassembled"),
            fragmented: ctx.counter("fragmented"),
            icmp_policy: ctx.counter("icmp_policy_drops"),
            too_big: ctx.counter("too_big_drops"),
            malformed: ctx.counter("malformed_drops"),
            not_ip: ctx.counter("wrong_ethertype_drops"),
            not_for_us: ctx.counter("not_for_us_drops"),
            vlan: ctx.counter("vlan_drops"),
            no_next_hop: ctx.counter("next_hop_unresolved_drops"),
            icmpv6_errors: ctx.counter("icmpv6_error_drops"),
            icmpv6_relayed: ctx.counter("icmpv6_errors_relayed"),
            icmp_sent: ctx.counter("icmp_errors_sent"),
            icmp_rate_limited: ctx.counter("icmp_rate_limited"),
            arp_replies: ctx.counter("arp_replies"),
            ndp_replies: ctx.counter("ndp_replies"),
            echo_replies: ctx.counter("echo_replies"),
        }
    }
}

/// Token bucket for generated ICMP errors: `packets` per `period`.
struct Limiter {
    tokens: f64,
    rate: f64,
    burst: f64,
    last: Instant,
}

impl Limiter {
    fn new(p: &Policy) -> Limiter {
        let burst = p.error_rate_packets as f64;
        Limiter {
            tokens: burst,
            rate: burst / p.error_rate_period_s.max(1) as f64,
            burst,
            last: Instant::now(),
        }
    }

    fn allow(&mut self) -> bool {
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

pub struct Lwaftr {
    table: BindingTable,
    ext: Interface<Ipv4Addr>,
    int: Interface<Ipv6Addr>,
    ext_policy: Policy,
    int_policy: Policy,
    ext_hop: Option<[u8; 6]>,
    int_hop: Option<[u8; 6]>,
    ext_limit: Limiter,
    int_limit: Limiter,
    last_solicit: Option<Instant>,
    c: Counters,
    out: [Vec<Packet>; 2],
    batch: Vec<Packet>,
    keys: Vec<Option<(u32, u16)>>,
    on_a_stick: bool,
    reasm4: frag::Reassembler,
    reasm6: frag::Reassembler,
    next_frag_id: u32,
}

fn hop_mac(h: NextHop) -> Option<[u8; 6]> {
    match h {
        NextHop::Mac(m) => Some(m),
        _ => None,
    }
}

impl App for Lwaftr {
    type Config = LwaftrAppConfig;

    fn declare(c: &LwaftrAppConfig) -> Result<PortSpec, AppError> {
        let sides = if c.on_a_stick {
            vec!["wire".to_string()]
        } else {
            vec!["v4".to_string(), "v6".to_string()]
        };
        Ok(PortSpec {
            inputs: PortNames::Fixed(sides.clone()),
            outputs: PortNames::Fixed(sides),
        })
    }

    fn new(c: LwaftrAppConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let (cfg, q) = load(&c, Some(ctx))?;
        let mut l = Lwaftr::build(cfg, q, Counters::new(ctx))?;
        l.on_a_stick = c.on_a_stick;
        Ok(l)
    }

    fn reconfigure(
        &mut self,
        c: LwaftrAppConfig,
        ctx: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        // A changed file is read again in full; the new table replaces the old between breaths.
        let (cfg, q) = load(&c, Some(ctx))?;
        if c.on_a_stick != self.on_a_stick {
            return Ok(Reconfigured::Restart);
        }
        let counters = std::mem::replace(&mut self.c, Counters::new(ctx));
        *self = Lwaftr::build(cfg, q, counters)?;
        self.on_a_stick = c.on_a_stick;
        Ok(Reconfigured::Done)
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        if self.on_a_stick {
            return self.push_on_a_stick(inputs, outputs);
        }
        // Three passes per batch: the first starts loading each packet's address entry into the
        // cache, the second its softwire, so that with a large table the lookups of the third
        // do not wait for memory.
        let mut batch = std::mem::take(&mut self.batch);
        for side in [V4, V6] {
            let Some(input) = inputs[side].as_mut() else {
                continue;
            };
            batch.extend(input.drain());
            let (vlan, skip) = if side == V4 {
                (self.ext.vlan, 0)
            } else {
                (self.int.vlan, 40)
            };
            self.keys.clear();
            for p in &batch {
                let key = peek(p.data(), vlan, skip);
                if let Some((a, _)) = key {
                    self.table.prefetch_address(a);
                }
                self.keys.push(key);
            }
            for &(a, port) in self.keys.iter().flatten() {
                self.table.prefetch(a, port);
            }
            for p in batch.drain(..) {
                if side == V4 {
                    self.handle_internet(p);
                } else {
                    self.handle_b4s(p);
                }
            }
        }
        self.batch = batch;
        for side in [V4, V6] {
            match outputs[side].as_mut() {
                Some(o) => {
                    for p in self.out[side].drain(..) {
                        o.transmit(p);
                    }
                }
                None => self.out[side].clear(),
            }
        }
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        let expired = self.reasm4.expire(now) + self.reasm6.expire(now);
        self.c.fragments.add(expired as u64);
        if self.ext_hop.is_some() && self.int_hop.is_some() {
            return;
        }
        if self
            .last_solicit
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return;
        }
        self.last_solicit = Some(now);
        if let (None, NextHop::Ipv4(hop)) = (self.ext_hop, self.ext.next_hop) {
            let port = if self.on_a_stick { 0 } else { V4 };
            if let (Some(p), Some(o)) = (self.arp_frame(1, [0xff; 6], [0; 6], hop), io.output(port))
            {
                o.transmit(p);
            }
        }
        if let (None, NextHop::Ipv6(hop)) = (self.int_hop, self.int.next_hop) {
            let port = if self.on_a_stick { 0 } else { V6 };
            if let (Some(p), Some(o)) = (self.neighbor_solicitation(hop), io.output(port)) {
                o.transmit(p);
            }
        }
    }

    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        match request["command"].as_str() {
            Some("add_softwire") => match softwire_from_json(request) {
                Ok(s) => match self.table.add(&s) {
                    Ok(()) => serde_json::json!({ "softwires": self.table.len() }),
                    Err(e) => serde_json::json!({ "error": e }),
                },
                Err(e) => serde_json::json!({ "error": e }),
            },
            Some("remove_softwire") => {
                let ipv4 = request["ipv4"].as_str().and_then(|s| s.parse().ok());
                let psid = request["psid"].as_u64().unwrap_or(0) as u16;
                match ipv4 {
                    Some(a) if self.table.remove(a, psid) => {
                        serde_json::json!({ "softwires": self.table.len() })
                    }
                    Some(a) => {
                        serde_json::json!({ "error": format!("no softwire {a} psid {psid}") })
                    }
                    None => {
                        serde_json::json!({ "error": "field `ipv4`: an IPv4 address is needed" })
                    }
                }
            }
            Some(other) => serde_json::json!({
                "error": format!("unknown command `{other}` (add_softwire, remove_softwire)")
            }),
            None => {
                let limit = request["limit"].as_u64().unwrap_or(100) as usize;
                let list: Vec<_> = self
                    .table
                    .dump(limit)
                    .into_iter()
                    .map(|(a, psid, b4, br)| {
                        serde_json::json!({ "ipv4": a, "psid": psid, "b4": b4, "br": br })
                    })
                    .collect();
                serde_json::json!({
                    "softwires": self.table.len(),
                    "list": list,
                    "external_next_hop": self.ext_hop.map(mac_text),
                    "internal_next_hop": self.int_hop.map(mac_text),
                })
            }
        }
    }
}

fn mac_text(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn softwire_from_json(r: &serde_json::Value) -> Result<SoftwireSpec, String> {
    let field = |k: &str| {
        r[k].as_str()
            .ok_or_else(|| format!("field `{k}` is missing"))
    };
    Ok(SoftwireSpec {
        ipv4: field("ipv4")?
            .parse()
            .map_err(|_| "field `ipv4`: not an IPv4 address")?,
        psid: r["psid"].as_u64().unwrap_or(0) as u16,
        b4: field("b4")?
            .parse()
            .map_err(|_| "field `b4`: not an IPv6 address")?,
        br: field("br")?
            .parse()
            .map_err(|_| "field `br`: not an IPv6 address")?,
        psid_length: r["psid_length"].as_u64().unwrap_or(0).min(16) as u8,
        reserved_bits: r["reserved_bits"].as_u64().unwrap_or(0).min(16) as u8,
        line: 0,
    })
}

/// Where the IP header starts after the Ethernet header (and the side's VLAN tag, which must
/// be the configured one), and the EtherType; `Err(())` for a VLAN mismatch.
#[inline]
fn l2(d: &[u8], vlan: Option<u16>) -> Option<Result<(usize, u16), ()>> {
    let et = u16::from_be_bytes([*d.get(12)?, *d.get(13)?]);
    match (vlan, et) {
        (Some(v), 0x8100) => {
            let tci = u16::from_be_bytes([*d.get(14)?, *d.get(15)?]);
            let inner = u16::from_be_bytes([*d.get(16)?, *d.get(17)?]);
            Some(if tci & 0x0fff == v {
                Ok((18, inner))
            } else {
                Err(())
            })
        }
        (Some(_), _) | (None, 0x8100) => Some(Err(())),
        (None, et) => Some(Ok((14, et))),
    }
}

/// The IPv4 header at `ip`, its lengths checked: (header length, total length). The header
/// checksum is not verified (as in Snabb's lwAFTR, whose benchmark packets carry none): the
/// incremental TTL update keeps a bad checksum bad, so the receiver still sees the damage.
#[inline]
fn ipv4(ip: &[u8]) -> Option<(usize, usize)> {
    let first = *ip.first()?;
    let ihl = (first & 0x0f) as usize * 4;
    if first >> 4 != 4 || ihl < 20 || ip.len() < ihl {
        return None;
    }
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    if total < ihl || total > ip.len() {
        return None;
    }
    Some((ihl, total))
}

#[inline]
fn is_fragment(ip: &[u8]) -> bool {
    u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0
}

#[inline]
fn be16(d: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*d.get(at)?, *d.get(at + 1)?]))
}

/// The port that identifies the flow of an IPv4 packet on the side of address `which`
/// (destination: toward a B4; source: from a B4): TCP/UDP port, ICMP echo identifier, or for an
/// ICMP error the port of the embedded packet on the other side.
fn port_of(ip: &[u8], ihl: usize, total: usize, destination: bool) -> Option<u16> {
    let l4 = &ip[ihl..total];
    match ip[9] {
        TCP | UDP => be16(l4, if destination { 2 } else { 0 }),
        ICMP => match *l4.first()? {
            0 | 8 => be16(l4, 4),
            3 | 4 | 5 | 11 | 12 => {
                // The embedded packet travelled the other way.
                let inner = l4.get(8..)?;
                let iihl = (*inner.first()? & 0x0f) as usize * 4;
                let il4 = inner.get(iihl..)?;
                match *inner.get(9)? {
                    TCP | UDP => be16(il4, if destination { 0 } else { 2 }),
                    ICMP => be16(il4, 4),
                    _ => None,
                }
            }
            _ => None,
        },
        _ => None,
    }
}

/// The binding-table key of a packet, read without checks beyond bounds, for prefetching: the
/// destination (IPv4 from the internet) or the inner source (IPv4-in-IPv6 from a B4, `skip` 40).
#[inline]
fn peek(d: &[u8], vlan: Option<u16>, skip: usize) -> Option<(u32, u16)> {
    let at = vlan.map_or(14, |_| 18) + skip;
    let ip = d.get(at..)?;
    let ihl = (*ip.first()? & 0x0f) as usize * 4;
    let total = (be16(ip, 2)? as usize).min(ip.len());
    if ihl < 20 || total < ihl + 8 {
        return None;
    }
    let (addr_at, destination) = if skip == 0 { (16, true) } else { (12, false) };
    let a = u32::from_be_bytes(ip.get(addr_at..addr_at + 4)?.try_into().ok()?);
    Some((a, port_of(ip, ihl, total, destination)?))
}

impl Lwaftr {
    fn build(cfg: LwaftrConfig, q: usize, c: Counters) -> Result<Lwaftr, String> {
        let table = BindingTable::new(&cfg.softwires)?;
        let (reasm4, reasm6) = (
            frag::Reassembler::new(
                cfg.external.max_fragments_per_packet,
                cfg.external.max_reassembly_packets,
            ),
            frag::Reassembler::new(
                cfg.internal.max_fragments_per_packet,
                cfg.internal.max_reassembly_packets,
            ),
        );
        let queue = cfg.queues[q].clone();
        Ok(Lwaftr {
            table,
            ext_hop: hop_mac(queue.external.next_hop),
            int_hop: hop_mac(queue.internal.next_hop),
            ext: queue.external,
            int: queue.internal,
            ext_limit: Limiter::new(&cfg.external),
            int_limit: Limiter::new(&cfg.internal),
            ext_policy: cfg.external,
            int_policy: cfg.internal,
            last_solicit: None,
            c,
            out: [Vec::with_capacity(256), Vec::with_capacity(256)],
            batch: Vec::with_capacity(1024),
            keys: Vec::with_capacity(1024),
            on_a_stick: false,
            reasm4,
            reasm6,
            next_frag_id: 0x4242_4243,
        })
    }

    /// Writes the Ethernet header (and VLAN tag) of `side` in front of `p`'s IP packet.
    fn frame(&self, p: Packet, side: usize, dst: [u8; 6]) -> Option<Packet> {
        self.frame_as(p, side, dst, if side == V4 { 0x0800 } else { 0x86dd })
    }

    /// Writes the Ethernet header (and VLAN tag) of `side` for EtherType `et`.
    fn frame_as(&self, mut p: Packet, side: usize, dst: [u8; 6], et: u16) -> Option<Packet> {
        let (mac, vlan) = if side == V4 {
            (self.ext.mac, self.ext.vlan)
        } else {
            (self.int.mac, self.int.vlan)
        };
        let n = if vlan.is_some() { 18 } else { 14 };
        let h = p.prepend(n).ok()?;
        h[0..6].copy_from_slice(&dst);
        h[6..12].copy_from_slice(&mac);
        if let Some(v) = vlan {
            h[12..14].copy_from_slice(&0x8100u16.to_be_bytes());
            h[14..16].copy_from_slice(&v.to_be_bytes());
        }
        h[n - 2..n].copy_from_slice(&et.to_be_bytes());
        Some(p)
    }

    /// An IP packet built from `bytes`, framed for `side`.
    fn new_frame(&self, side: usize, dst: [u8; 6], bytes: &[u8]) -> Option<Packet> {
        self.new_frame_as(side, dst, if side == V4 { 0x0800 } else { 0x86dd }, bytes)
    }

    /// A frame of EtherType `et` carrying `bytes`, for `side`, padded to the Ethernet minimum.
    fn new_frame_as(&self, side: usize, dst: [u8; 6], et: u16, bytes: &[u8]) -> Option<Packet> {
        let mut p = pool::alloc()?;
        p.set_data(bytes).ok()?;
        let mut p = self.frame_as(p, side, dst, et)?;
        if p.len() < 60 {
            let n = p.len();
            p.set_len(60).ok()?;
            p.data_mut()[n..].fill(0);
        }
        Some(p)
    }

    fn handle_internet(&mut self, mut p: Packet) {
        let d = p.data();
        let (at, et) = match l2(d, self.ext.vlan) {
            None => return self.c.malformed.add(1),
            Some(Err(())) => return self.c.vlan.add(1),
            Some(Ok(x)) => x,
        };
        if et == 0x0806 {
            return self.arp(&d[at..], [d[6], d[7], d[8], d[9], d[10], d[11]]);
        }
        if et != 0x0800 {
            return self.c.not_ip.add(1);
        }
        let ip = &d[at..];
        let Some((ihl, total)) = ipv4(ip) else {
            return self.c.malformed.add(1);
        };
        let dst = u32::from_be_bytes([ip[16], ip[17], ip[18], ip[19]]);
        if dst == u32::from(self.ext.ip) {
            return self.answer_ping_v4(p, at, ihl, total);
        }
        if is_fragment(ip) {
            let l2h = d[..at].to_vec();
            let outcome = self.reasm4.add_v4(ip, ihl, total, Instant::now());
            if let Some(whole) = self.reassembled(outcome, &l2h) {
                self.handle_internet(whole);
            }
            return;
        }
        if ip[9] == ICMP && !self.ext_policy.allow_incoming_icmp {
            return self.c.icmp_policy.add(1);
        }
        let Some(sw) = port_of(ip, ihl, total, true).and_then(|port| self.table.lookup(dst, port))
        else {
            self.c.no_softwire.add(1);
            if self.ext_policy.generate_icmp_errors {
                self.icmp4_error(&p.data()[at..], 3, 1, 0);
            }
            return;
        };
        let sw = *sw;
        if p.shift_front(at).is_err() || p.set_len(total).is_err() {
            return self.c.malformed.add(1);
        }
        self.encapsulate(p, sw, V4);
    }

    /// Puts an IPv4 packet (starting at the IP header) into a softwire toward its B4.
    fn encapsulate(&mut self, mut p: Packet, sw: Softwire, from: usize) {
        let total = p.len();
        let ttl = p.data()[8];
        if ttl <= 1 {
            self.c.ttl_expired.add(1);
            if self.ext_policy.generate_icmp_errors && from == V4 {
                self.icmp4_error(p.data(), 11, 0, 0);
            }
            return;
        }
        let too_big = 40 + total > self.int_policy.mtu as usize;
        if too_big && p.data()[6] & 0x40 != 0 {
            self.c.too_big.add(1);
            if self.ext_policy.generate_icmp_errors && from == V4 {
                let mtu = (self.int_policy.mtu - 40) as u32;
                self.icmp4_error(p.data(), 3, 4, mtu);
            }
            return;
        }
        let Some(hop) = self.int_hop else {
            return self.c.no_next_hop.add(1);
        };
        {
            let ip = p.data_mut();
            let old = u16::from_be_bytes([ip[8], ip[9]]);
            ip[8] = ttl - 1;
            let new = u16::from_be_bytes([ip[8], ip[9]]);
            let cs = checksum::update(u16::from_be_bytes([ip[10], ip[11]]), old, new);
            ip[10..12].copy_from_slice(&cs.to_be_bytes());
        }
        let tos = p.data()[1];
        let flow = self.int_policy.flow_label & 0xfffff;
        if too_big {
            return self.encapsulate_fragments(p, sw, hop, tos, flow, from);
        }
        let Ok(h) = p.prepend(40) else {
            return self.c.malformed.add(1);
        };
        let word = 6u32 << 28 | (tos as u32) << 20 | flow;
        h[0..4].copy_from_slice(&word.to_be_bytes());
        h[4..6].copy_from_slice(&(total as u16).to_be_bytes());
        h[6] = IPIP;
        h[7] = 255;
        h[8..24].copy_from_slice(&sw.br);
        h[24..40].copy_from_slice(&sw.b4);
        if let Some(p) = self.frame(p, V6, hop) {
            self.c.encapsulated.add(1);
            if from == V6 {
                self.c.hairpinned.add(1);
            }
            self.out[V6].push(p);
        }
    }

    fn handle_b4s(&mut self, mut p: Packet) {
        let d = p.data();
        let (at, et) = match l2(d, self.int.vlan) {
            None => return self.c.malformed.add(1),
            Some(Err(())) => return self.c.vlan.add(1),
            Some(Ok(x)) => x,
        };
        if et != 0x86dd {
            return self.c.not_ip.add(1);
        }
        let ip6 = &d[at..];
        if ip6.len() < 40 || ip6[0] >> 4 != 6 {
            return self.c.malformed.add(1);
        }
        let plen = u16::from_be_bytes([ip6[4], ip6[5]]) as usize;
        if 40 + plen > ip6.len() {
            return self.c.malformed.add(1);
        }
        let (src, dst) = (&ip6[8..24], &ip6[24..40]);
        // Hop-by-hop, routing and destination options headers are stepped over.
        let (mut nh, mut off) = (ip6[6], 40);
        while matches!(nh, 0 | 43 | 60) {
            let Some(h) = ip6.get(off..off + 2) else {
                return self.c.malformed.add(1);
            };
            let len = (h[1] as usize + 1) * 8;
            if off + len > 40 + plen {
                return self.c.malformed.add(1);
            }
            nh = h[0];
            off += len;
        }
        if off != 40 && nh != IPIP {
            // Fragments and ICMPv6 behind extension headers are not for this function.
            return self.c.not_for_us.add(1);
        }
        if nh == 44 && plen >= 8 && self.table.is_br_address(dst) {
            let l2h = d[..at].to_vec();
            let outcome = self.reasm6.add_v6(&ip6[..40 + plen], Instant::now());
            if let Some(whole) = self.reassembled(outcome, &l2h) {
                self.handle_b4s(whole);
            }
            return;
        }
        if nh == ICMPV6 {
            return self.icmp6_in(p, at, plen);
        }
        if nh != IPIP || !self.table.is_br_address(dst) {
            return self.c.not_for_us.add(1);
        }
        let inner = &ip6[off..40 + plen];
        let Some((ihl, total)) = ipv4(inner) else {
            return self.c.malformed.add(1);
        };
        if is_fragment(inner) {
            return self.c.fragments.add(1);
        }
        if inner[9] == ICMP && !self.int_policy.allow_incoming_icmp {
            return self.c.icmp_policy.add(1);
        }
        let isrc = u32::from_be_bytes([inner[12], inner[13], inner[14], inner[15]]);
        let bound = port_of(inner, ihl, total, false)
            .and_then(|port| self.table.lookup(isrc, port))
            .is_some_and(|sw| sw.b4 == src && sw.br == dst);
        if !bound {
            self.c.source_mismatch.add(1);
            if self.int_policy.generate_icmp_errors {
                self.icmp6_error(&p, at, 1, 5);
            }
            return;
        }
        // Hairpinning: the destination is itself a softwire of this lwAFTR.
        let idst = u32::from_be_bytes([inner[16], inner[17], inner[18], inner[19]]);
        let hairpin = if self.int_policy.hairpinning {
            port_of(inner, ihl, total, true).and_then(|port| self.table.lookup(idst, port).copied())
        } else {
            None
        };
        if p.shift_front(at + off).is_err() || p.set_len(total).is_err() {
            return self.c.malformed.add(1);
        }
        if let Some(sw) = hairpin {
            return self.encapsulate(p, sw, V6);
        }
        let Some(hop) = self.ext_hop else {
            return self.c.no_next_hop.add(1);
        };
        if total > self.ext_policy.mtu as usize {
            if p.data()[6] & 0x40 != 0 {
                return self.c.too_big.add(1);
            }
            return self.decapsulate_fragments(p, ihl, hop);
        }
        if let Some(p) = self.frame(p, V4, hop) {
            self.c.decapsulated.add(1);
            self.out[V4].push(p);
        }
    }

    /// The whole packet once its last fragment arrived (framed with `l2`), counted either way.
    fn reassembled(&mut self, outcome: frag::Outcome, l2: &[u8]) -> Option<Packet> {
        match outcome {
            frag::Outcome::Complete(whole) => {
                self.c.reassembled.add(1);
                let p = packet_of(l2, &whole);
                if p.is_none() {
                    self.c.too_big.add(1);
                }
                p
            }
            frag::Outcome::Pending => None,
            frag::Outcome::Dropped(_) => {
                self.c.fragments.add(1);
                None
            }
        }
    }

    /// An IPv4 packet too big for the access network's MTU, in IPv6 fragments.
    fn encapsulate_fragments(
        &mut self,
        p: Packet,
        sw: Softwire,
        hop: [u8; 6],
        tos: u8,
        flow: u32,
        from: usize,
    ) {
        let ip = p.data();
        let id = self.next_frag_id;
        self.next_frag_id = self.next_frag_id.wrapping_add(1);
        let word = 6u32 << 28 | (tos as u32) << 20 | flow;
        for (off, n, more) in frag::split(ip.len(), self.int_policy.mtu as usize - 48) {
            let mut f = Vec::with_capacity(48 + n);
            f.extend_from_slice(&word.to_be_bytes());
            f.extend_from_slice(&((8 + n) as u16).to_be_bytes());
            f.extend_from_slice(&[44, 255]);
            f.extend_from_slice(&sw.br);
            f.extend_from_slice(&sw.b4);
            f.extend_from_slice(&[IPIP, 0]);
            f.extend_from_slice(&(off as u16 | more as u16).to_be_bytes());
            f.extend_from_slice(&id.to_be_bytes());
            f.extend_from_slice(&ip[off..off + n]);
            match self.new_frame(V6, hop, &f) {
                Some(q) => self.out[V6].push(q),
                None => return self.c.too_big.add(1),
            }
        }
        self.c.fragmented.add(1);
        self.c.encapsulated.add(1);
        if from == V6 {
            self.c.hairpinned.add(1);
        }
    }

    /// A decapsulated IPv4 packet too big for the internet side's MTU, in IPv4 fragments.
    fn decapsulate_fragments(&mut self, p: Packet, ihl: usize, hop: [u8; 6]) {
        let ip = p.data();
        let body = &ip[ihl..];
        for (off, n, more) in frag::split(body.len(), self.ext_policy.mtu as usize - ihl) {
            let mut f = ip[..ihl].to_vec();
            f[2..4].copy_from_slice(&((ihl + n) as u16).to_be_bytes());
            let ff = (off / 8) as u16 | if more { 0x2000 } else { 0 };
            f[6..8].copy_from_slice(&ff.to_be_bytes());
            f[10..12].fill(0);
            let cs = checksum::checksum(&f);
            f[10..12].copy_from_slice(&cs.to_be_bytes());
            f.extend_from_slice(&body[off..off + n]);
            match self.new_frame(V4, hop, &f) {
                Some(q) => self.out[V4].push(q),
                None => return self.c.too_big.add(1),
            }
        }
        self.c.fragmented.add(1);
        self.c.decapsulated.add(1);
    }

    /// An ICMPv4 error (type, code) about the IPv4 packet `ip`, out of `v4`.
    fn icmp4_error(&mut self, ip: &[u8], kind: u8, code: u8, extra: u32) {
        // Never about ICMP errors.
        let ihl = (ip[0] & 0x0f) as usize * 4;
        if ip[9] == ICMP && ip.get(ihl).is_some_and(|t| ![0u8, 8].contains(t)) {
            return;
        }
        let Some(hop) = self.ext_hop else { return };
        if !self.ext_limit.allow() {
            return self.c.icmp_rate_limited.add(1);
        }
        // At most 576 bytes in all (RFC 1812 4.3.2.3).
        let quote = &ip[..ip.len().min(576 - 28)];
        let mut body = vec![kind, code, 0, 0];
        body.extend_from_slice(&extra.to_be_bytes());
        body.extend_from_slice(quote);
        let cs = checksum::checksum(&body);
        body[2..4].copy_from_slice(&cs.to_be_bytes());
        let to = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
        let mut pkt = stitch_wire::ipv4_header(self.ext.ip, to, ICMP, body.len(), false).to_vec();
        pkt.extend_from_slice(&body);
        if let Some(f) = self.new_frame(V4, hop, &pkt) {
            self.c.icmp_sent.add(1);
            self.out[V4].push(f);
        }
    }

    /// An ICMPv6 error (type, code) about the IPv6 packet at `at` in `p`, out of `v6`.
    fn icmp6_error(&mut self, p: &Packet, at: usize, kind: u8, code: u8) {
        let Some(hop) = self.int_hop else { return };
        if !self.int_limit.allow() {
            return self.c.icmp_rate_limited.add(1);
        }
        let ip6 = &p.data()[at..];
        // At most 1280 bytes in all (RFC 4443 2.4).
        let mut body = vec![kind, code, 0, 0, 0, 0, 0, 0];
        body.extend_from_slice(&ip6[..ip6.len().min(1280 - 48)]);
        if let Some(f) = self.icmp6_frame(hop, &ip6[8..24], body) {
            self.c.icmp_sent.add(1);
            self.out[V6].push(f);
        }
    }

    /// IPv4 to the function's own external address: ping is answered, the rest dropped.
    fn answer_ping_v4(&mut self, mut p: Packet, at: usize, ihl: usize, total: usize) {
        let d = p.data();
        if d[at + 9] != ICMP || d.get(at + ihl) != Some(&8) || is_fragment(&d[at..]) {
            return self.c.not_for_us.add(1);
        }
        let src_mac: [u8; 6] = d[6..12].try_into().unwrap();
        if p.shift_front(at).is_err() || p.set_len(total).is_err() {
            return self.c.malformed.add(1);
        }
        let ip = p.data_mut();
        let (src, dst): ([u8; 4], [u8; 4]) = (
            ip[12..16].try_into().unwrap(),
            ip[16..20].try_into().unwrap(),
        );
        ip[12..16].copy_from_slice(&dst);
        ip[16..20].copy_from_slice(&src);
        ip[8] = 64;
        ip[10..12].fill(0);
        let cs = checksum::checksum(&ip[..ihl]);
        ip[10..12].copy_from_slice(&cs.to_be_bytes());
        let icmp = &mut ip[ihl..];
        icmp[0] = 0;
        icmp[2..4].fill(0);
        let cs = checksum::checksum(icmp);
        icmp[2..4].copy_from_slice(&cs.to_be_bytes());
        if let Some(p) = self.frame(p, V4, src_mac) {
            self.c.echo_replies.add(1);
            self.out[V4].push(p);
        }
    }

    fn arp_frame(
        &self,
        op: u16,
        eth_dst: [u8; 6],
        target_mac: [u8; 6],
        target: Ipv4Addr,
    ) -> Option<Packet> {
        let arp = stitch_wire::arp_payload(op, self.ext.mac, self.ext.ip, target_mac, target);
        self.new_frame_as(V4, eth_dst, 0x0806, &arp)
    }

    fn arp(&mut self, a: &[u8], eth_src: [u8; 6]) {
        let Some(a) = a.get(..28) else {
            return self.c.malformed.add(1);
        };
        if a[0..6] != [0, 1, 0x08, 0x00, 6, 4] {
            return self.c.malformed.add(1);
        }
        let op = u16::from_be_bytes([a[6], a[7]]);
        let sender_mac: [u8; 6] = a[8..14].try_into().unwrap();
        let sender = Ipv4Addr::new(a[14], a[15], a[16], a[17]);
        let target = Ipv4Addr::new(a[24], a[25], a[26], a[27]);
        if self.ext.next_hop == NextHop::Ipv4(sender) {
            self.ext_hop = Some(sender_mac);
        }
        if op == 1 && target == self.ext.ip {
            if let Some(p) = self.arp_frame(2, eth_src, sender_mac, sender) {
                self.c.arp_replies.add(1);
                self.out[V4].push(p);
            }
        }
    }

    fn icmp6_frame(&self, dst_mac: [u8; 6], dst: &[u8], mut body: Vec<u8>) -> Option<Packet> {
        let me = self.int.ip.octets();
        body[2..4].fill(0);
        let cs = icmp6_checksum(&me, dst, &body);
        body[2..4].copy_from_slice(&cs.to_be_bytes());
        let mut pkt = vec![0x60, 0, 0, 0];
        pkt.extend_from_slice(&(body.len() as u16).to_be_bytes());
        pkt.extend_from_slice(&[ICMPV6, 255]);
        pkt.extend_from_slice(&me);
        pkt.extend_from_slice(dst);
        pkt.extend_from_slice(&body);
        self.new_frame(V6, dst_mac, &pkt)
    }

    fn neighbor_solicitation(&self, target: Ipv6Addr) -> Option<Packet> {
        let mut body = vec![135, 0, 0, 0, 0, 0, 0, 0];
        body.extend_from_slice(&target.octets());
        body.extend_from_slice(&[1, 1]);
        body.extend_from_slice(&self.int.mac);
        let dst = solicited_node(target);
        self.icmp6_frame(multicast_mac(dst), &dst.octets(), body)
    }

    /// ICMPv6 arriving from the access network: neighbour discovery and ping for the
    /// function's own address; errors (RFC 2473 translation not done yet) are counted.
    fn icmp6_in(&mut self, p: Packet, at: usize, plen: usize) {
        let d = p.data();
        let ip6 = &d[at..at + 40 + plen];
        let body = &ip6[40..];
        let Some(&kind) = body.first() else {
            return self.c.malformed.add(1);
        };
        let me = self.int.ip.octets();
        let eth_src: [u8; 6] = d[6..12].try_into().unwrap();
        let src: [u8; 16] = ip6[8..24].try_into().unwrap();
        match kind {
            135 if body.len() >= 24 && body[8..24] == me => {
                if let Some(mac) = lladdr_option(&body[24..]) {
                    if self.int.next_hop == NextHop::Ipv6(Ipv6Addr::from(src)) {
                        self.int_hop = Some(mac);
                    }
                }
                let mut na = vec![136, 0, 0, 0, 0x60, 0, 0, 0];
                na.extend_from_slice(&me);
                na.extend_from_slice(&[2, 1]);
                na.extend_from_slice(&self.int.mac);
                if let Some(r) = self.icmp6_frame(eth_src, &src, na) {
                    self.c.ndp_replies.add(1);
                    self.out[V6].push(r);
                }
            }
            136 if body.len() >= 24 => {
                let target = Ipv6Addr::from(<[u8; 16]>::try_from(&body[8..24]).unwrap());
                if self.int.next_hop == NextHop::Ipv6(target) {
                    self.int_hop = lladdr_option(&body[24..]).or(Some(eth_src));
                }
            }
            128 if ip6[24..40] == me => {
                let mut reply = body.to_vec();
                reply[0] = 129;
                if let Some(r) = self.icmp6_frame(eth_src, &src, reply) {
                    self.c.echo_replies.add(1);
                    self.out[V6].push(r);
                }
            }
            k if k < 128 => {
                if self.relay_icmp6_error(body) {
                    self.c.icmpv6_relayed.add(1);
                } else {
                    self.c.icmpv6_errors.add(1);
                }
            }
            _ => self.c.not_for_us.add(1),
        }
    }
}

/// A packet holding `l2` then `ip`, in a large buffer when it does not fit an ordinary one.
fn packet_of(l2: &[u8], ip: &[u8]) -> Option<Packet> {
    let n = l2.len() + ip.len();
    let mut p = if n + stitch_core::packet::HEADROOM <= stitch_core::packet::DATA_AREA {
        pool::alloc()?
    } else {
        pool::alloc_large()?
    };
    p.set_len(n).ok()?;
    let d = p.data_mut();
    d[..l2.len()].copy_from_slice(l2);
    d[l2.len()..].copy_from_slice(ip);
    Some(p)
}

impl Lwaftr {
    /// Both sides on one port: each frame goes to the side its VLAN tag (when the sides' tags
    /// differ) or its EtherType names; both sides' output leaves on the same port.
    fn push_on_a_stick(
        &mut self,
        inputs: &mut [Option<stitch_core::Consumer>],
        outputs: &mut [Option<stitch_core::Producer>],
    ) {
        let mut batch = std::mem::take(&mut self.batch);
        if let Some(input) = inputs[0].as_mut() {
            batch.extend(input.drain());
        }
        let by_tag =
            self.ext.vlan != self.int.vlan && self.ext.vlan.is_some() && self.int.vlan.is_some();
        for p in batch.drain(..) {
            let d = p.data();
            let v6 = if by_tag {
                stitch_wire::vlan::outer_tag(d)
                    .is_some_and(|(_, tci)| Some(stitch_wire::vlan::vid(tci)) == self.int.vlan)
            } else {
                let at = if self.int.vlan.is_some() { 16 } else { 12 };
                be16(d, at) == Some(0x86dd)
            };
            if v6 {
                self.handle_b4s(p);
            } else {
                self.handle_internet(p);
            }
        }
        self.batch = batch;
        for side in [V4, V6] {
            match outputs[0].as_mut() {
                Some(o) => {
                    for p in self.out[side].drain(..) {
                        o.transmit(p);
                    }
                }
                None => self.out[side].clear(),
            }
        }
    }

    /// An ICMPv6 error from the access network about a packet this function tunnelled (RFC
    /// 2473 §8): relayed to the IPv4 sender of the tunnelled packet as ICMPv4 — packet too big
    /// as "fragmentation needed" with the tunnel's MTU, anything else as "host unreachable".
    fn relay_icmp6_error(&mut self, body: &[u8]) -> bool {
        if !self.int_policy.allow_incoming_icmp || !self.ext_policy.generate_icmp_errors {
            return false;
        }
        let Some(inner6) = body.get(8..) else {
            return false;
        };
        if inner6.len() < 60
            || inner6[0] >> 4 != 6
            || inner6[6] != IPIP
            || !self.table.is_br_address(&inner6[8..24])
        {
            return false;
        }
        let ip = &inner6[40..];
        let ihl = (ip[0] & 0x0f) as usize * 4;
        if ip[0] >> 4 != 4 || ihl < 20 || ip.len() < ihl {
            return false;
        }
        let (code, extra) = if body[0] == 2 {
            if ip[6] & 0x40 == 0 {
                // DF clear: later packets are fragmented by the tunnel; nothing to tell.
                return false;
            }
            let mtu = u32::from_be_bytes(body[4..8].try_into().unwrap());
            (4, mtu.saturating_sub(40).min(0xffff))
        } else {
            (1, 0)
        };
        let ip = ip.to_vec();
        self.icmp4_error(&ip, 3, code, extra);
        true
    }
}
