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
pub mod offline;

use binding::{BindingTable, Softwire};
use config::{Interface, LwaftrConfig, NextHop, Policy, SoftwireSpec};
use serde::Deserialize;
use std::collections::VecDeque;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stitch_core::app::{AppContext, AppError, Counter, Io, PortNames, PortSpec, Reconfigured};
use stitch_core::{pool, App, Packet};
use stitch_wire::ethertype;
use stitch_wire::filter::PacketFilter;
use stitch_wire::header::{self, ethernet, icmp, ipv4, ipv6, Field16};
use stitch_wire::icmpv4;
use stitch_wire::icmpv6;
use stitch_wire::ip_proto::{ICMP, IPIP, TCP, UDP};
use stitch_wire::ndp::{icmp6_checksum, lladdr_option, multicast_mac, solicited_node, ICMPV6};
use stitch_wire::{arp, checksum};

const V4: usize = 0;
const V6: usize = 1;

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LwaftrAppConfig {
    /// Snabb lwAFTR configuration file (`softwire-config { … }`).
    pub conf: PathBuf,
    /// Which `instance { device …; queue { id …; } }` to take (default: the first).
    #[serde(default)]
    pub device: Option<String>,
    /// Which `queue { id …; }` of the instance to take (default: the first).
    #[serde(default)]
    pub queue: Option<u32>,
    /// One interface for both sides (port `wire`): frames are told apart by their VLAN tag when
    /// the sides have different ones, else by EtherType.
    #[serde(default)]
    pub on_a_stick: bool,
    /// `rfc` (default) or `snabb`: where Snabb's lwAFTR departs from the RFCs, `snabb`
    /// reproduces its bytes (docs/lwaftr-snabb-differences.md lists each point).
    #[serde(default)]
    pub compat: Compat,
}

/// Whose bytes the function writes where Snabb's lwAFTR departs from the RFCs.
#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Compat {
    #[default]
    Rfc,
    /// Reassembled IPv4 packets carry identification 0 and no DF, as Snabb's reassembler
    /// writes them (RFC 6864 §4.1: a source must not repeat an identification).
    Snabb,
}

impl std::str::FromStr for Compat {
    type Err = String;
    fn from_str(s: &str) -> Result<Compat, String> {
        match s {
            "rfc" => Ok(Compat::Rfc),
            "snabb" => Ok(Compat::Snabb),
            _ => Err(format!("compat is `rfc` or `snabb`, not `{s}`")),
        }
    }
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
    bad_checksum: Counter,
    no_buffer: Counter,
    ingress_filtered: [Counter; 2],
    egress_filtered: [Counter; 2],
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
            bad_checksum: ctx.counter("bad_checksum_drops"),
            no_buffer: ctx.counter("no_buffer_drops"),
            ingress_filtered: [
                ctx.counter("ingress_filter_v4_drops"),
                ctx.counter("ingress_filter_v6_drops"),
            ],
            egress_filtered: [
                ctx.counter("egress_filter_v4_drops"),
                ctx.counter("egress_filter_v6_drops"),
            ],
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

/// Frames that wait for their side's next hop to be resolved, at most, per side (as Snabb's
/// ARP and NDP apps leave them queued on their input link until then).
const WAITING_MAX: usize = 1024;

/// Seconds between ARP requests / Neighbor Solicitations while a next hop is unresolved.
const SOLICIT_INTERVAL: Duration = Duration::from_secs(3);

/// How many frames ahead of the one being handled its binding-table address entry is
/// requested, and its softwire (read from the address entry, so nearer).
const ADDRESS_LOOKAHEAD: usize = 16;
const SOFTWIRE_LOOKAHEAD: usize = 8;

/// The first IPv4 and IPv6 fragment identifications are these plus one, then they count up,
/// as Snabb's fragmenters do under test, so that runs are reproducible.
const FIRST_FRAGMENT_ID4: u16 = 0x4242;
const FIRST_FRAGMENT_ID6: u32 = 0x4242_4242;

/// Hop limit and TTL of the packets the function originates: errors and neighbour discovery
/// 255 (RFC 4861 requires it for ND), echo replies the usual 64.
const ORIGIN_TTL: u8 = 255;
const ECHO_TTL: u8 = 64;

pub struct Lwaftr {
    table: BindingTable,
    ext: Interface<Ipv4Addr>,
    int: Interface<Ipv6Addr>,
    ext_policy: Policy,
    int_policy: Policy,
    /// Next-hop MAC of each side, once known.
    hop: [Option<[u8; 6]>; 2],
    ext_limit: Limiter,
    int_limit: Limiter,
    last_solicit: Option<Instant>,
    ingress: [Option<PacketFilter>; 2],
    egress: [Option<PacketFilter>; 2],
    c: Counters,
    /// Frames ready to leave on each side (untagged, before the egress stage).
    out: [Vec<Packet>; 2],
    /// Frames waiting for the side's next hop.
    waiting: [VecDeque<Packet>; 2],
    batch: Vec<Packet>,
    keys: Vec<Option<(u32, u16)>>,
    on_a_stick: bool,
    reasm4: frag::Reassembler,
    reasm6: frag::Reassembler,
    next_frag_id4: u16,
    next_frag_id6: u32,
}

fn hop_mac(h: NextHop) -> Option<[u8; 6]> {
    match h {
        NextHop::Mac(m) => Some(m),
        _ => None,
    }
}

fn compile(expr: &Option<String>) -> Result<Option<PacketFilter>, String> {
    expr.as_deref().map(PacketFilter::compile).transpose()
}

impl App for Lwaftr {
    type Config = LwaftrAppConfig;
    const EXAMPLE: &'static str = "conf: lwaftr.conf
compat: rfc
";

    /// The configuration file is read and parsed, and its instance and queue looked up, as
    /// a start would.
    fn check_host(c: &LwaftrAppConfig, base_dir: &std::path::Path) -> Vec<String> {
        if let Some(missing) = stitch_core::files::missing("conf", &c.conf, base_dir) {
            return vec![missing];
        }
        let at = LwaftrAppConfig {
            conf: base_dir.join(&c.conf),
            ..c.clone()
        };
        load(&at, None)
            .err()
            .map(|e| format!("conf `{}`: {e}", c.conf.display()))
            .into_iter()
            .collect()
    }

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
        let mut l = Lwaftr::build(cfg, q, c.compat, Counters::new(ctx))?;
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
        *self = Lwaftr::build(cfg, q, c.compat, counters)?;
        self.on_a_stick = c.on_a_stick;
        Ok(Reconfigured::Done)
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        if self.on_a_stick {
            self.receive_on_a_stick(inputs);
        } else {
            for side in [V4, V6] {
                if let Some(input) = inputs[side].as_mut() {
                    self.receive(side, input);
                }
            }
        }
        self.emit_all(outputs);
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        let expired = self.reasm4.expire(now) + self.reasm6.expire(now);
        self.c.fragments.add(expired as u64);
        if self.hop[V4].is_none() || self.hop[V6].is_none() {
            self.solicit_next_hops(now);
        }
        let (_, outputs) = io.split();
        self.emit_all(outputs);
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
                let filter =
                    |f: &Option<PacketFilter>| f.as_ref().map(|f| f.expression().to_string());
                serde_json::json!({
                    "softwires": self.table.len(),
                    "list": list,
                    "external_next_hop": self.hop[V4].map(mac_text),
                    "internal_next_hop": self.hop[V6].map(mac_text),
                    "waiting_for_next_hop": [self.waiting[V4].len(), self.waiting[V6].len()],
                    "filters": {
                        "external_ingress": filter(&self.ingress[V4]),
                        "external_egress": filter(&self.egress[V4]),
                        "internal_ingress": filter(&self.ingress[V6]),
                        "internal_egress": filter(&self.egress[V6]),
                    },
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

#[inline]
fn is_unicast(mac: &[u8]) -> bool {
    mac[0] & 1 == 0
}

/// The port that picks the softwire of an IPv4 packet on the side of address `which`
/// (`destination`: the softwire the packet goes to; else the one it comes from): the TCP/UDP
/// port; for ping, RFC 7596 §8.1 — a B4 puts a port of its set in the identifier of the echo
/// requests it sends, so requests from a B4 and replies toward one are looked up by the
/// identifier, and requests toward a B4 and replies from one by port 0 (only a softwire holding
/// port 0 is pingable); for an ICMP error, the port of the embedded packet on the other side.
fn port_of(ip: &[u8], ihl: usize, total: usize, destination: bool) -> Option<u16> {
    let l4 = &ip[ihl..total];
    let (this_end, other_end) = if destination {
        (header::l4::DST_PORT, header::l4::SRC_PORT)
    } else {
        (header::l4::SRC_PORT, header::l4::DST_PORT)
    };
    match ipv4::PROTOCOL.get(ip) {
        TCP | UDP => this_end.try_get(l4),
        ICMP => match *l4.first()? {
            icmpv4::ECHO_REQUEST if destination => Some(0),
            icmpv4::ECHO_REPLY if !destination => Some(0),
            icmpv4::ECHO_REPLY | icmpv4::ECHO_REQUEST => icmp::ECHO_IDENT.try_get(l4),
            t if icmpv4::is_error(t) => {
                // The embedded packet travelled the other way.
                let inner = l4.get(8..)?;
                let iihl = (*inner.first()? & 0x0f) as usize * 4;
                let il4 = inner.get(iihl..)?;
                match ipv4::PROTOCOL.try_get(inner)? {
                    TCP | UDP => other_end.try_get(il4),
                    ICMP => icmp::ECHO_IDENT.try_get(il4),
                    _ => None,
                }
            }
            _ => None,
        },
        _ => None,
    }
}

/// The binding-table key of an untagged frame, read without checks beyond bounds, for
/// prefetching: the destination (IPv4 from the internet) or the inner source (IPv4-in-IPv6 from
/// a B4, `skip` 40).
#[inline]
fn peek(d: &[u8], skip: usize) -> Option<(u32, u16)> {
    let ip = d.get(14 + skip..)?;
    let ihl = (*ip.first()? & 0x0f) as usize * 4;
    let total = (ipv4::TOTAL_LEN.try_get(ip)? as usize).min(ip.len());
    if ihl < 20 || total < ihl + 8 {
        return None;
    }
    let (addr, destination) = if skip == 0 {
        (ipv4::DST, true)
    } else {
        (ipv4::SRC, false)
    };
    Some((addr.try_get(ip)?, port_of(ip, ihl, total, destination)?))
}

/// Ethernet header of a reply to frame `d`: back to its sender, from the address it was sent
/// to — or from `own` when it was sent to a group address.
fn reply_addresses(d: &mut [u8], own: [u8; 6]) {
    let (to, from): ([u8; 6], [u8; 6]) =
        (d[6..12].try_into().unwrap(), d[0..6].try_into().unwrap());
    d[0..6].copy_from_slice(&to);
    d[6..12].copy_from_slice(if is_unicast(&from) { &from } else { &own });
}

impl Lwaftr {
    /// The binding table: its softwires and the bytes it holds.
    pub fn binding_table(&self) -> &BindingTable {
        &self.table
    }

    fn build(cfg: LwaftrConfig, q: usize, compat: Compat, c: Counters) -> Result<Lwaftr, String> {
        let table = BindingTable::new(&cfg.softwires)?;
        let (reasm4, reasm6) = (
            frag::Reassembler::new(
                cfg.external.max_fragments_per_packet,
                cfg.external.max_reassembly_packets,
                compat == Compat::Snabb,
            ),
            frag::Reassembler::new(
                cfg.internal.max_fragments_per_packet,
                cfg.internal.max_reassembly_packets,
                false,
            ),
        );
        let queue = cfg.queues[q].clone();
        Ok(Lwaftr {
            table,
            hop: [
                hop_mac(queue.external.next_hop),
                hop_mac(queue.internal.next_hop),
            ],
            ext: queue.external,
            int: queue.internal,
            ext_limit: Limiter::new(&cfg.external),
            int_limit: Limiter::new(&cfg.internal),
            ingress: [
                compile(&cfg.external.ingress_filter)?,
                compile(&cfg.internal.ingress_filter)?,
            ],
            egress: [
                compile(&cfg.external.egress_filter)?,
                compile(&cfg.internal.egress_filter)?,
            ],
            ext_policy: cfg.external,
            int_policy: cfg.internal,
            last_solicit: None,
            c,
            out: [Vec::with_capacity(256), Vec::with_capacity(256)],
            waiting: [VecDeque::new(), VecDeque::new()],
            batch: Vec::with_capacity(1024),
            keys: Vec::with_capacity(1024),
            on_a_stick: false,
            reasm4,
            reasm6,
            next_frag_id4: FIRST_FRAGMENT_ID4,
            next_frag_id6: FIRST_FRAGMENT_ID6,
        })
    }

    fn mac(&self, side: usize) -> [u8; 6] {
        if side == V4 {
            self.ext.mac
        } else {
            self.int.mac
        }
    }

    fn vlan(&self, side: usize) -> Option<u16> {
        if side == V4 {
            self.ext.vlan
        } else {
            self.int.vlan
        }
    }

    fn mtu(&self, side: usize) -> usize {
        if side == V4 {
            self.ext_policy.mtu as usize
        } else {
            self.int_policy.mtu as usize
        }
    }

    // ---- ingress: untag, then each side's handler (reassembly, filter, ND, echo, core) ----

    /// One side's input: each frame untagged, then handled while the lookups of the frames a
    /// little further on are fetched ahead (with a large table: [`Self::fetch_ahead`]).
    fn receive(&mut self, side: usize, input: &mut stitch_core::Consumer) {
        let mut batch = std::mem::take(&mut self.batch);
        for p in input.drain() {
            if let Some(p) = self.untag(p, side) {
                batch.push(p);
            }
        }
        let fetching = self.table.prefetch_pays();
        if fetching {
            self.read_keys(side, &batch);
            self.start_fetching();
        }
        for (i, p) in batch.drain(..).enumerate() {
            if fetching {
                self.fetch_ahead(i);
            }
            if side == V4 {
                self.handle_internet(p);
            } else {
                self.handle_b4s(p);
            }
        }
        self.batch = batch;
    }

    /// Each frame's binding-table key into `keys`, in the batch's order, and the headroom line
    /// an encapsulated frame's IPv6 header goes to into the cache.
    fn read_keys(&mut self, side: usize, batch: &[Packet]) {
        let skip = if side == V4 { 0 } else { 40 };
        self.keys.clear();
        for p in batch {
            if side == V4 {
                // Encapsulated, the frame starts 40 bytes earlier (an IPv6 header more).
                p.prefetch_front(40);
            }
            self.keys.push(peek(p.data(), skip));
        }
    }

    /// The fetches [`Self::fetch_ahead`] would have made before the batch's first frame.
    fn start_fetching(&self) {
        for &(a, _) in self.keys.iter().take(ADDRESS_LOOKAHEAD).flatten() {
            self.table.prefetch_address(a);
        }
        for &(a, port) in self.keys.iter().take(SOFTWIRE_LOOKAHEAD).flatten() {
            self.table.prefetch(a, port);
        }
    }

    /// While frame `i` is handled: the address entry of frame `i + ADDRESS_LOOKAHEAD` is
    /// requested, and the softwire of frame `i + SOFTWIRE_LOOKAHEAD`, whose address entry came
    /// in meanwhile. A software pipeline keeps a few misses in flight at a time; requesting a
    /// whole batch's entries, then its softwires, in two passes asked for a hundred lines at
    /// once, more than a core's miss buffers hold, and most came too late (1M softwires:
    /// 1.35x faster with the refill on an AMD EPYC; within 3 % on the Xeons before).
    #[inline(always)]
    fn fetch_ahead(&self, i: usize) {
        if let Some(Some((a, _))) = self.keys.get(i + ADDRESS_LOOKAHEAD) {
            self.table.prefetch_address(*a);
        }
        if let Some(Some((a, port))) = self.keys.get(i + SOFTWIRE_LOOKAHEAD) {
            self.table.prefetch(*a, *port);
        }
    }

    /// Both sides on one port: each frame goes to the side its VLAN tag (when the sides' tags
    /// differ) or its EtherType names.
    fn receive_on_a_stick(&mut self, inputs: &mut [Option<stitch_core::Consumer>]) {
        let mut batch = std::mem::take(&mut self.batch);
        if let Some(input) = inputs[0].as_mut() {
            input.receive_all(&mut batch);
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
                Field16(at).try_get(d) == Some(ethertype::IPV6)
            };
            let side = if v6 { V6 } else { V4 };
            if let Some(p) = self.untag(p, side) {
                if v6 {
                    self.handle_b4s(p);
                } else {
                    self.handle_internet(p);
                }
            }
        }
        self.batch = batch;
    }

    /// The frame without its side's VLAN tag (the rest of the function sees untagged frames
    /// only); `None`, counted, for a frame whose tagging does not match the side's.
    fn untag(&mut self, mut p: Packet, side: usize) -> Option<Packet> {
        let tag =
            stitch_wire::vlan::outer_tag(p.data()).map(|(_, tci)| stitch_wire::vlan::vid(tci));
        match (self.vlan(side), tag) {
            (None, None) => Some(p),
            (Some(v), Some(t)) if v == t && stitch_wire::vlan::pop(&mut p).is_some() => Some(p),
            _ => {
                self.c.vlan.add(1);
                None
            }
        }
    }

    /// Whether the side's ingress filter lets `p` in (counted when not).
    fn admitted(&mut self, side: usize, p: &Packet) -> bool {
        match &self.ingress[side] {
            Some(f) if !f.matches(p.data()) => {
                self.c.ingress_filtered[side].add(1);
                false
            }
            _ => true,
        }
    }

    fn handle_internet(&mut self, p: Packet) {
        let d = p.data();
        let Some(et) = ethernet::ETHERTYPE.try_get(d) else {
            return self.c.malformed.add(1);
        };
        if et == ethertype::IPV4 {
            let ip = &d[14..];
            // The header checksum is not verified (as in Snabb's lwAFTR, whose benchmark
            // packets carry none): the incremental TTL update keeps a bad checksum bad, so the
            // receiver still sees the damage.
            let Some((ihl, total)) = ipv4::lengths(ip) else {
                return self.c.malformed.add(1);
            };
            if ipv4::is_fragment(ip) {
                let outcome = self.reasm4.add_v4(ip, ihl, total, Instant::now());
                if let Some(whole) = self.reassembled(outcome, &d[..14]) {
                    self.handle_internet(whole);
                }
                return;
            }
        }
        if !self.admitted(V4, &p) {
            return;
        }
        match et {
            ethertype::ARP => return self.arp(&p),
            ethertype::IPV4 => {}
            _ => return self.c.not_ip.add(1),
        }
        let ip = &d[14..];
        let (ihl, total) = ipv4::lengths(ip).expect("checked above");
        let dst = ipv4::DST.get(ip);
        if dst == u32::from(self.ext.ip) {
            return self.answer_ping_v4(p, ihl, total);
        }
        if ipv4::PROTOCOL.get(ip) == ICMP {
            if !self.ext_policy.allow_incoming_icmp {
                return self.c.icmp_policy.add(1);
            }
            // RFC 5508 §4.6: ICMP with a bad checksum is dropped silently.
            if checksum::checksum(&ip[ihl..total]) != 0 {
                return self.c.bad_checksum.add(1);
            }
        }
        let Some(sw) = port_of(ip, ihl, total, true).and_then(|port| self.table.lookup(dst, port))
        else {
            return self.unreachable(&ip[..total]);
        };
        let sw = *sw;
        let mut p = p;
        if p.shift_front(14).is_err() || p.set_len(total).is_err() {
            return self.c.malformed.add(1);
        }
        self.encapsulate(p, sw, V4);
    }

    /// An IPv4 packet toward an address of the table whose port no softwire holds: ICMPv4
    /// 3/1 to its sender when errors are on — never for ICMP (RFC 7596 §8.1: dropped).
    fn unreachable(&mut self, ip: &[u8]) {
        self.c.no_softwire.add(1);
        if self.ext_policy.generate_icmp_errors && ipv4::PROTOCOL.get(ip) != ICMP {
            self.icmp4_error(
                ip,
                icmpv4::DESTINATION_UNREACHABLE,
                icmpv4::CODE_HOST_UNREACHABLE,
                0,
            );
        }
    }

    /// Puts an IPv4 packet (starting at the IP header) into a softwire toward its B4, its TTL
    /// decremented first (errors quote the packet as it would have been forwarded, as RFC 1812
    /// §4.3.2.3 allows).
    fn encapsulate(&mut self, mut p: Packet, sw: Softwire, from: usize) {
        let ttl = ipv4::decrement_ttl(p.data_mut());
        if ttl == 0 {
            self.c.ttl_expired.add(1);
            if self.ext_policy.generate_icmp_errors {
                let (kind, code) = (icmpv4::TIME_EXCEEDED, icmpv4::CODE_TTL_EXCEEDED);
                self.icmp4_error(p.data(), kind, code, 0);
            }
            return;
        }
        let total = p.len();
        if ipv6::LEN + total > self.int_policy.mtu as usize && ipv4::dont_fragment(p.data()) {
            self.c.too_big.add(1);
            if self.ext_policy.generate_icmp_errors {
                let mtu = (self.int_policy.mtu - 40) as u32;
                let kind = icmpv4::DESTINATION_UNREACHABLE;
                self.icmp4_error(p.data(), kind, icmpv4::CODE_FRAGMENTATION_NEEDED, mtu);
            }
            return;
        }
        let header = ipv6::Header {
            traffic_class: ipv4::TOS.get(p.data()),
            flow_label: self.int_policy.flow_label,
            payload_len: total as u16,
            next_header: IPIP,
            hop_limit: 255,
            src: sw.br,
            dst: sw.b4,
        };
        let Ok(h) = p.prepend(ipv6::LEN) else {
            return self.c.malformed.add(1);
        };
        header.write(h);
        self.c.encapsulated.add(1);
        if from == V6 {
            self.c.hairpinned.add(1);
        }
        self.route(p, V6);
    }

    fn handle_b4s(&mut self, p: Packet) {
        let d = p.data();
        match ethernet::ETHERTYPE.try_get(d) {
            None => return self.c.malformed.add(1),
            Some(ethertype::IPV6) => {}
            Some(_) => {
                if self.admitted(V6, &p) {
                    self.c.not_ip.add(1);
                }
                return;
            }
        }
        let ip6 = &d[14..];
        if ip6.len() < ipv6::LEN || ip6[0] >> 4 != 6 {
            return self.c.malformed.add(1);
        }
        let plen = ipv6::PAYLOAD_LEN.get(ip6) as usize;
        if 40 + plen > ip6.len() {
            return self.c.malformed.add(1);
        }
        let dst = &ip6[ipv6::DST];
        // Hop-by-hop, routing and destination options headers are stepped over.
        let (mut nh, mut off) = (ipv6::NEXT_HEADER.get(ip6), ipv6::LEN);
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
        if nh == ipv6::FRAGMENT
            && plen >= ipv6::fragment::LEN
            && (self.table.is_br_address(dst) || *dst == self.int.ip.octets())
        {
            let outcome = self.reasm6.add_v6(&ip6[..40 + plen], Instant::now());
            if let Some(whole) = self.reassembled(outcome, &d[..14]) {
                self.handle_b4s(whole);
            }
            return;
        }
        if !self.admitted(V6, &p) {
            return;
        }
        if nh == ICMPV6 {
            return self.icmp6_in(p, plen);
        }
        if nh != IPIP || !self.table.is_br_address(dst) {
            return self.c.not_for_us.add(1);
        }
        let inner = &ip6[off..40 + plen];
        let Some((ihl, total)) = ipv4::lengths(inner) else {
            return self.c.malformed.add(1);
        };
        if ipv4::is_fragment(inner) {
            return self.c.fragments.add(1);
        }
        if ipv4::PROTOCOL.get(inner) == ICMP && !self.int_policy.allow_incoming_icmp {
            return self.c.icmp_policy.add(1);
        }
        let src = &ip6[ipv6::SRC];
        let isrc = ipv4::SRC.get(inner);
        let bound = port_of(inner, ihl, total, false)
            .and_then(|port| self.table.lookup(isrc, port))
            .is_some_and(|sw| sw.b4 == src && sw.br == dst);
        if !bound {
            self.c.source_mismatch.add(1);
            if self.int_policy.generate_icmp_errors {
                let from: [u8; 16] = dst.try_into().unwrap();
                let kind = icmpv6::DESTINATION_UNREACHABLE;
                self.icmp6_error(&p, kind, icmpv6::CODE_SOURCE_POLICY_FAILED, from);
            }
            return;
        }
        // Hairpinning: the destination is an address of this lwAFTR's table.
        let idst = ipv4::DST.get(inner);
        let hairpin = self.int_policy.hairpinning && self.table.is_managed_address(idst);
        let mut p = p;
        if p.shift_front(14 + off).is_err() || p.set_len(total).is_err() {
            return self.c.malformed.add(1);
        }
        if hairpin {
            let ip = p.data();
            return match port_of(ip, ihl, total, true)
                .and_then(|port| self.table.lookup(idst, port))
            {
                Some(sw) => {
                    let sw = *sw;
                    self.encapsulate(p, sw, V6)
                }
                None => self.unreachable(p.data()),
            };
        }
        self.c.decapsulated.add(1);
        self.route(p, V4);
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

    // ---- packets the function originates ----

    /// An ICMPv4 error (type, code) about the IPv4 packet `ip`, from the external address to
    /// its sender; through the sender's softwire when the sender is behind a B4.
    fn icmp4_error(&mut self, ip: &[u8], kind: u8, code: u8, extra: u32) {
        // Never about an ICMP error (RFC 1812 §4.3.2.7).
        let ihl = ipv4::header_len(ip);
        if ipv4::PROTOCOL.get(ip) == ICMP && ip.get(ihl).is_some_and(|t| ![0u8, 8].contains(t)) {
            return;
        }
        if !self.ext_limit.allow() {
            return self.c.icmp_rate_limited.add(1);
        }
        // As much of the packet as fits in 576 bytes (RFC 1812 §4.3.2.3).
        let quote = &ip[..ip.len().min(576 - 28)];
        let to = Ipv4Addr::from(ipv4::SRC.get(ip));
        let Some(mut p) = pool::alloc() else {
            return self.c.no_buffer.add(1);
        };
        let mut header = [0u8; ipv4::MIN_LEN];
        ipv4::Header {
            src: self.ext.ip,
            dst: to,
            protocol: ICMP,
            payload_len: 8 + quote.len(),
            ttl: ORIGIN_TTL,
            dont_fragment: false,
        }
        .write(&mut header);
        let mut message = [kind, code, 0, 0, 0, 0, 0, 0];
        icmp::REST.set(&mut message, extra);
        let cs = checksum::finish(checksum::sum(quote, checksum::sum(&message, 0)));
        icmp::CHECKSUM.set(&mut message, cs);
        if p.set_data(&header).is_err() || p.append(&message).is_err() || p.append(quote).is_err() {
            return self.c.malformed.add(1);
        }
        self.c.icmp_sent.add(1);
        let to = u32::from(to);
        if !self.table.is_managed_address(to) {
            return self.route(p, V4);
        }
        let d = p.data();
        match port_of(d, 20, d.len(), true).and_then(|port| self.table.lookup(to, port)) {
            Some(sw) => {
                let sw = *sw;
                self.encapsulate(p, sw, V4)
            }
            None => self.c.no_softwire.add(1),
        }
    }

    /// An ICMPv6 error (type, code) from `from` about the IPv6 frame `p`, back to its sender.
    fn icmp6_error(&mut self, p: &Packet, kind: u8, code: u8, from: [u8; 16]) {
        if !self.int_limit.allow() {
            return self.c.icmp_rate_limited.add(1);
        }
        let ip6 = &p.data()[14..];
        let ip6 = &ip6[..(ipv6::LEN + ipv6::PAYLOAD_LEN.get(ip6) as usize).min(ip6.len())];
        // As much of the packet as fits in the minimum MTU (RFC 4443 §2.4).
        let quote = &ip6[..ip6.len().min(1280 - 48)];
        let mut body = Vec::with_capacity(8 + quote.len());
        body.extend_from_slice(&[kind, code, 0, 0, 0, 0, 0, 0]);
        body.extend_from_slice(quote);
        let to: [u8; 16] = ip6[ipv6::SRC].try_into().unwrap();
        if let Some(packet) = self.icmp6_packet(from, to, body) {
            self.c.icmp_sent.add(1);
            self.route(packet, V6);
        }
    }

    /// An ICMPv6 message `body` (checksum filled here) in an IPv6 packet, hop limit 255.
    fn icmp6_packet(&mut self, src: [u8; 16], dst: [u8; 16], mut body: Vec<u8>) -> Option<Packet> {
        icmp::CHECKSUM.set(&mut body, 0);
        let cs = icmp6_checksum(&src, &dst, &body);
        icmp::CHECKSUM.set(&mut body, cs);
        let mut header = [0u8; ipv6::LEN];
        ipv6::Header {
            traffic_class: 0,
            flow_label: 0,
            payload_len: body.len() as u16,
            next_header: ICMPV6,
            hop_limit: ORIGIN_TTL,
            src,
            dst,
        }
        .write(&mut header);
        let Some(mut p) = pool::alloc() else {
            self.c.no_buffer.add(1);
            return None;
        };
        if p.set_data(&header).is_err() || p.append(&body).is_err() {
            self.c.malformed.add(1);
            return None;
        }
        Some(p)
    }

    /// A frame of EtherType `et` carrying `bytes` from `side`'s address to `dst`.
    fn new_frame(&mut self, side: usize, dst: [u8; 6], et: u16, bytes: &[u8]) -> Option<Packet> {
        let Some(mut p) = pool::alloc() else {
            self.c.no_buffer.add(1);
            return None;
        };
        p.set_data(bytes).ok()?;
        self.address(&mut p, side, dst, et).then_some(p)
    }

    /// Puts an Ethernet header in front of `p`: to `dst`, from `side`'s address.
    fn address(&mut self, p: &mut Packet, side: usize, dst: [u8; 6], et: u16) -> bool {
        let src = self.mac(side);
        match p.prepend(14) {
            Ok(h) => {
                h[0..6].copy_from_slice(&dst);
                h[6..12].copy_from_slice(&src);
                ethernet::ETHERTYPE.set(h, et);
                true
            }
            Err(_) => {
                self.c.malformed.add(1);
                false
            }
        }
    }

    /// Sends an IP packet (starting at its header) to `side`'s next hop, or keeps it until the
    /// next hop is resolved.
    fn route(&mut self, mut p: Packet, side: usize) {
        let et = if side == V4 {
            ethertype::IPV4
        } else {
            ethertype::IPV6
        };
        let hop = self.hop[side];
        if !self.address(&mut p, side, hop.unwrap_or([0; 6]), et) {
            return;
        }
        if hop.is_some() {
            self.out[side].push(p);
        } else if self.waiting[side].len() < WAITING_MAX {
            self.waiting[side].push_back(p);
        } else {
            self.c.no_next_hop.add(1);
        }
    }

    /// The next hop of `side` is `mac`: frames that waited for it leave now, in order.
    fn resolved(&mut self, side: usize, mac: [u8; 6]) {
        self.hop[side] = Some(mac);
        while let Some(mut p) = self.waiting[side].pop_front() {
            p.data_mut()[0..6].copy_from_slice(&mac);
            self.out[side].push(p);
        }
    }

    /// ARP requests and Neighbor Solicitations for next hops given by IP and not yet
    /// resolved: at start and every few seconds until an answer comes.
    fn solicit_next_hops(&mut self, now: Instant) {
        if self
            .last_solicit
            .is_some_and(|t| now.duration_since(t) < SOLICIT_INTERVAL)
        {
            return;
        }
        self.last_solicit = Some(now);
        if let (None, NextHop::Ipv4(hop)) = (self.hop[V4], self.ext.next_hop) {
            let arp = arp::payload(1, (self.ext.mac, self.ext.ip), ([0; 6], hop));
            if let Some(p) = self.new_frame(V4, [0xff; 6], ethertype::ARP, &arp) {
                self.out[V4].push(p);
            }
        }
        if let (None, NextHop::Ipv6(hop)) = (self.hop[V6], self.int.next_hop) {
            let mut body = vec![icmpv6::NEIGHBOR_SOLICITATION, 0, 0, 0, 0, 0, 0, 0];
            body.extend_from_slice(&hop.octets());
            body.extend_from_slice(&[1, 1]);
            body.extend_from_slice(&self.int.mac);
            let group = solicited_node(hop);
            if let Some(mut p) = self.icmp6_packet(self.int.ip.octets(), group.octets(), body) {
                if self.address(&mut p, V6, multicast_mac(group), ethertype::IPV6) {
                    self.out[V6].push(p);
                }
            }
        }
    }

    // ---- ARP, neighbour discovery and ping for the function's own addresses ----

    fn arp(&mut self, p: &Packet) {
        let Some(m) = arp::Message::read(p.data()) else {
            return self.c.malformed.add(1);
        };
        let (sender_mac, sender, target) = (m.sender_mac, m.sender_ip, m.target_ip);
        if self.ext.next_hop == NextHop::Ipv4(sender) && is_unicast(&sender_mac) {
            self.resolved(V4, sender_mac);
        }
        if m.is_request() && target == self.ext.ip {
            let arp = arp::payload(2, (self.ext.mac, self.ext.ip), (sender_mac, sender));
            if let Some(reply) = self.new_frame(V4, sender_mac, ethertype::ARP, &arp) {
                self.c.arp_replies.add(1);
                self.out[V4].push(reply);
            }
        }
    }

    /// IPv4 to the function's own external address: an echo request is answered in place
    /// (addresses swapped, TTL 64, flags cleared, the rest as it came), the rest dropped.
    fn answer_ping_v4(&mut self, mut p: Packet, ihl: usize, total: usize) {
        let d = p.data();
        let ip = &d[14..];
        if ipv4::PROTOCOL.get(ip) != ICMP
            || total < ihl + 8
            || ip[ihl] != icmpv4::ECHO_REQUEST
            || ip[ihl + 1] != 0
        {
            return self.c.not_for_us.add(1);
        }
        if p.set_len(14 + total).is_err() {
            return self.c.malformed.add(1);
        }
        let own = self.ext.mac;
        let d = p.data_mut();
        reply_addresses(d, own);
        let ip = &mut d[14..];
        let (src, dst) = (ipv4::SRC.get(ip), ipv4::DST.get(ip));
        ipv4::SRC.set(ip, dst);
        ipv4::DST.set(ip, src);
        let offset = ipv4::FLAGS_FRAG.get(ip) & ipv4::OFFSET;
        ipv4::FLAGS_FRAG.set(ip, offset);
        ipv4::TTL.set(ip, ECHO_TTL);
        ipv4::fill_checksum(&mut ip[..ihl]);
        let reply = &mut ip[ihl..total];
        reply[0] = 0;
        icmp::CHECKSUM.set(reply, 0);
        let cs = checksum::checksum(reply);
        icmp::CHECKSUM.set(reply, cs);
        self.c.echo_replies.add(1);
        self.out[V4].push(p);
    }

    /// ICMPv6 echo request to the internal address, answered in place (addresses swapped, hop
    /// limit 64, traffic class and flow label kept).
    fn answer_ping_v6(&mut self, mut p: Packet, plen: usize) {
        if p.set_len(14 + 40 + plen).is_err() {
            return self.c.malformed.add(1);
        }
        let own = self.int.mac;
        let d = p.data_mut();
        reply_addresses(d, own);
        let ip6 = &mut d[14..];
        let src: [u8; 16] = ip6[ipv6::SRC].try_into().unwrap();
        let dst: [u8; 16] = ip6[ipv6::DST].try_into().unwrap();
        ip6[ipv6::SRC].copy_from_slice(&dst);
        ip6[ipv6::DST].copy_from_slice(&src);
        ipv6::HOP_LIMIT.set(ip6, ECHO_TTL);
        let body = &mut ip6[ipv6::LEN..];
        body[0] = icmpv6::ECHO_REPLY;
        icmp::CHECKSUM.set(body, 0);
        let cs = icmp6_checksum(&dst, &src, body);
        icmp::CHECKSUM.set(body, cs);
        self.c.echo_replies.add(1);
        self.out[V6].push(p);
    }

    /// ICMPv6 arriving from the access network: neighbour discovery and ping for the
    /// function's own address (whatever the ICMP policy), errors about tunnelled packets
    /// relayed to their IPv4 sender when incoming ICMP is allowed.
    fn icmp6_in(&mut self, p: Packet, plen: usize) {
        let d = p.data();
        let ip6 = &d[14..14 + 40 + plen];
        let body = &ip6[40..];
        let Some(&kind) = body.first() else {
            return self.c.malformed.add(1);
        };
        let me = self.int.ip.octets();
        match kind {
            icmpv6::NEIGHBOR_SOLICITATION if body.len() >= 24 && body[8..24] == me => {
                self.neighbor_solicitation(&p, plen)
            }
            icmpv6::NEIGHBOR_ADVERTISEMENT if body.len() >= 24 => {
                let target = Ipv6Addr::from(<[u8; 16]>::try_from(&body[8..24]).unwrap());
                if self.int.next_hop == NextHop::Ipv6(target) {
                    let eth_src: [u8; 6] = d[6..12].try_into().unwrap();
                    let mac = lladdr_option(&body[24..]).unwrap_or(eth_src);
                    self.resolved(V6, mac);
                }
            }
            icmpv6::ECHO_REQUEST if ip6[ipv6::DST] == me && body.len() >= 8 && body[1] == 0 => {
                self.answer_ping_v6(p, plen)
            }
            _ if !self.int_policy.allow_incoming_icmp => self.c.icmp_policy.add(1),
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

    /// A Neighbor Solicitation for the internal address: checked as RFC 4861 §7.1.1 asks,
    /// answered with a solicited advertisement (router and solicited flags, our link-layer
    /// address); the soliciting next hop is learnt on the way.
    fn neighbor_solicitation(&mut self, p: &Packet, plen: usize) {
        let d = p.data();
        let ip6 = &d[14..14 + 40 + plen];
        let (src, dst, body) = (&ip6[ipv6::SRC], &ip6[ipv6::DST], &ip6[ipv6::LEN..]);
        let unspecified = src.iter().all(|&b| b == 0);
        let options = &body[24..];
        let valid = ipv6::HOP_LIMIT.get(ip6) == 255
            && body[1] == 0
            && icmp6_checksum(src, dst, body) == 0
            && body[8] != 0xff
            && options_are_sound(options)
            && !(unspecified && lladdr_option(options).is_some());
        if !valid {
            return self.c.malformed.add(1);
        }
        let src: [u8; 16] = src.try_into().unwrap();
        if let Some(mac) = lladdr_option(options) {
            if self.int.next_hop == NextHop::Ipv6(Ipv6Addr::from(src)) && self.hop[V6].is_none() {
                self.resolved(V6, mac);
            }
        }
        let me = self.int.ip.octets();
        let mut na = vec![icmpv6::NEIGHBOR_ADVERTISEMENT, 0, 0, 0, 0xc0, 0, 0, 0];
        na.extend_from_slice(&me);
        na.extend_from_slice(&[2, 1]);
        na.extend_from_slice(&self.int.mac);
        let to = if unspecified {
            Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).octets()
        } else {
            src
        };
        let eth_src: [u8; 6] = d[6..12].try_into().unwrap();
        if let Some(mut reply) = self.icmp6_packet(me, to, na) {
            if self.address(&mut reply, V6, eth_src, ethertype::IPV6) {
                self.c.ndp_replies.add(1);
                self.out[V6].push(reply);
            }
        }
    }

    /// An ICMPv6 error from the access network about a packet this function tunnelled (RFC
    /// 2473 §8): relayed to the IPv4 sender of the tunnelled packet as ICMPv4 — packet too big
    /// (code 0) as "fragmentation needed" with the tunnel's MTU; destination unreachable (any
    /// code), hop limit exceeded in transit and parameter problem as "host unreachable".
    fn relay_icmp6_error(&mut self, body: &[u8]) -> bool {
        let (code, extra) = match (body[0], body.get(1)) {
            (icmpv6::PACKET_TOO_BIG, Some(0)) => {
                let Some(mtu) = icmp::REST.try_get(body) else {
                    return false;
                };
                let mtu = mtu.saturating_sub(40).min(0xffff);
                (icmpv4::CODE_FRAGMENTATION_NEEDED, mtu)
            }
            (icmpv6::DESTINATION_UNREACHABLE | icmpv6::PARAMETER_PROBLEM, Some(_))
            | (icmpv6::TIME_EXCEEDED, Some(0)) => (icmpv4::CODE_HOST_UNREACHABLE, 0),
            _ => return false,
        };
        let Some(inner6) = body.get(8..) else {
            return false;
        };
        if inner6.len() < 60
            || inner6[0] >> 4 != 6
            || ipv6::NEXT_HEADER.get(inner6) != IPIP
            || !self.table.is_br_address(&inner6[ipv6::SRC])
        {
            return false;
        }
        let ip = &inner6[ipv6::LEN..];
        let ihl = ipv4::header_len(ip);
        if ip[0] >> 4 != 4 || ihl < 20 || ip.len() < ihl {
            return false;
        }
        self.icmp4_error(ip, icmpv4::DESTINATION_UNREACHABLE, code, extra);
        true
    }

    // ---- egress: filter, fragment to the side's MTU, tag, transmit ----

    fn emit_all(&mut self, outputs: &mut [Option<stitch_core::Producer>]) {
        for side in [V4, V6] {
            let port = if self.on_a_stick { 0 } else { side };
            self.emit(side, outputs[port].as_mut());
        }
    }

    fn emit(&mut self, side: usize, mut output: Option<&mut stitch_core::Producer>) {
        if self.out[side].is_empty() {
            return;
        }
        let mut out = std::mem::take(&mut self.out[side]);
        let max = 14 + self.mtu(side);
        let ip_type = if side == V4 {
            ethertype::IPV4
        } else {
            ethertype::IPV6
        };
        // The usual case: no filter, no tag, nothing above the MTU — straight to the link.
        if self.egress[side].is_none()
            && self.vlan(side).is_none()
            && out.iter().all(|p| p.len() <= max)
        {
            match output {
                Some(o) => {
                    o.transmit_batch(&mut out);
                }
                None => out.clear(),
            }
            self.out[side] = out;
            return;
        }
        for p in out.drain(..) {
            if let Some(f) = &self.egress[side] {
                if !f.matches(p.data()) {
                    self.c.egress_filtered[side].add(1);
                    continue;
                }
            }
            if p.len() > max && ethernet::ETHERTYPE.try_get(p.data()) == Some(ip_type) {
                for f in self.fragment(side, &p) {
                    self.transmit(side, f, output.as_deref_mut());
                }
                continue;
            }
            self.transmit(side, p, output.as_deref_mut());
        }
        self.out[side] = out;
    }

    fn transmit(&mut self, side: usize, mut p: Packet, output: Option<&mut stitch_core::Producer>) {
        if let Some(v) = self.vlan(side) {
            if stitch_wire::vlan::push(&mut p, ethertype::VLAN, v).is_err() {
                return self.c.malformed.add(1);
            }
        }
        if let Some(o) = output {
            o.transmit(p);
        }
    }

    /// A frame above the side's MTU in fragments (RFC 791 for IPv4 — none when DF is set —,
    /// RFC 8200 §4.5 for IPv6), each with a new identification from the side's counter.
    fn fragment(&mut self, side: usize, p: &Packet) -> Vec<Packet> {
        let d = p.data();
        let mtu = self.mtu(side);
        let mut pieces = Vec::new();
        if side == V4 {
            let ip = &d[14..];
            let Some((ihl, total)) = ipv4::lengths(ip) else {
                self.c.malformed.add(1);
                return pieces;
            };
            if ipv4::dont_fragment(ip) {
                self.c.too_big.add(1);
                return pieces;
            }
            self.next_frag_id4 = self.next_frag_id4.wrapping_add(1);
            let id = self.next_frag_id4;
            let flags = ipv4::FLAGS_FRAG.get(ip) & !ipv4::OFFSET;
            for (off, n, more) in frag::split(total - ihl, mtu - ihl) {
                let mut h = [0u8; 60];
                let h = &mut h[..ihl];
                h.copy_from_slice(&ip[..ihl]);
                ipv4::TOTAL_LEN.set(h, (ihl + n) as u16);
                ipv4::IDENT.set(h, id);
                let ff = (off / 8) as u16
                    | if more {
                        flags | ipv4::MORE_FRAGMENTS
                    } else {
                        flags & !ipv4::MORE_FRAGMENTS
                    };
                ipv4::FLAGS_FRAG.set(h, ff);
                ipv4::fill_checksum(h);
                match self.piece(&d[..14], h, &ip[ihl + off..ihl + off + n]) {
                    Some(f) => pieces.push(f),
                    None => return Vec::new(),
                }
            }
        } else {
            let ip6 = &d[14..];
            let plen = ipv6::PAYLOAD_LEN.get(ip6) as usize;
            if ip6.len() < 40 + plen {
                self.c.malformed.add(1);
                return pieces;
            }
            self.next_frag_id6 = self.next_frag_id6.wrapping_add(1);
            let id = self.next_frag_id6;
            for (off, n, more) in frag::split(plen, mtu - 48) {
                let mut h = [0u8; ipv6::LEN + ipv6::fragment::LEN];
                h[..ipv6::LEN].copy_from_slice(&ip6[..ipv6::LEN]);
                ipv6::PAYLOAD_LEN.set(&mut h, (ipv6::fragment::LEN + n) as u16);
                ipv6::NEXT_HEADER.set(&mut h, ipv6::FRAGMENT);
                let fragment = &mut h[ipv6::LEN..];
                ipv6::fragment::NEXT_HEADER.set(fragment, ipv6::NEXT_HEADER.get(ip6));
                ipv6::fragment::OFFSET_MORE.set(fragment, off as u16 | more as u16);
                ipv6::fragment::IDENT.set(fragment, id);
                match self.piece(&d[..14], &h, &ip6[40 + off..40 + off + n]) {
                    Some(f) => pieces.push(f),
                    None => return Vec::new(),
                }
            }
        }
        self.c.fragmented.add(1);
        pieces
    }

    /// One fragment: Ethernet header, IP header(s), data.
    fn piece(&mut self, l2: &[u8], header: &[u8], data: &[u8]) -> Option<Packet> {
        let Some(mut f) = pool::alloc() else {
            self.c.no_buffer.add(1);
            return None;
        };
        if f.set_data(l2).is_err() || f.append(header).is_err() || f.append(data).is_err() {
            self.c.too_big.add(1);
            return None;
        }
        Some(f)
    }
}

/// Neighbour discovery options whose lengths are all non-zero and within the message.
fn options_are_sound(mut opts: &[u8]) -> bool {
    while !opts.is_empty() {
        let len = opts.get(1).map_or(0, |&l| l as usize * 8);
        if len == 0 || len > opts.len() {
            return false;
        }
        opts = &opts[len..];
    }
    true
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
