//! `vxlan`: VXLAN (RFC 7348) tunnel endpoint. Each segment in `segments` is a port (an input
//! and an output of that name) carrying the inner Ethernet frames of one VNI; `underlay` carries
//! the encapsulated packets: outer Ethernet + IPv4 or IPv6 (the family of `local`) + UDP
//! (`port`, 4789 by default) + VXLAN.
//!
//! Frames entering a segment port are encapsulated toward that segment's `remote` VTEP. A
//! segment may name several remotes: then broadcast, multicast and unknown unicast frames go to
//! each of them (head-end replication, RFC 7348 §4.2), and the endpoint learns from decapsulated
//! frames which remote each inner source MAC sits behind, so unicast goes to that one only
//! (entries age out after `aging_seconds`; `stitch show` lists them). The UDP source port is a
//! hash of the inner flow, so the underlay can spread tunnels over paths (§5); over IPv6 the
//! flow label carries the same hash (RFC 6438) and the UDP checksum is computed (RFC 6935 allows
//! zero, but Linux refuses it by default). GSO super-frames are cut into segments and partial
//! checksums completed before encapsulation: the far end gets ordinary frames.
//!
//! Packets entering `underlay` addressed to `local` on the VXLAN port, from a remote of the
//! segment their VNI names, are decapsulated to that segment; others are counted by reason and
//! dropped (not for us, no VNI flag, unknown VNI, foreign VTEP, bad UDP checksum, malformed).
//! Outer MAC addresses are configured (`local_mac`, `next_hop_mac`): put a router in front for
//! resolution.
//!
//! `mtu` is the largest IP packet the underlay carries (1500 by default), so an inner frame
//! whose IP packet exceeds `mtu` less the encapsulation (50 bytes over IPv4, 70 over IPv6; a
//! 1500 underlay carries 1450-byte inner packets) is dropped (`too_big_drops`): the outer
//! header says "don't fragment" (RFC 7348 §4.3). An IPv4 packet with DF set, or an IPv6
//! packet, is answered back out of its segment port with "fragmentation needed" / "packet too
//! big" giving the inner MTU, from the packet's own destination as Linux's tunnels do, at most
//! `icmp_rate` per second: path MTU discovery works through the tunnel. A segment that carries
//! one direction only names the segment of the other direction in `reply_via`.
//!
//! ```yaml
//! apps:
//!   vtep: { type: vxlan, local: 192.0.2.1, local_mac: "02:00:00:00:00:01",
//!           next_hop_mac: "02:00:00:00:00:02",
//!           segments: { tenant1: { vni: 1001, remote: 192.0.2.2 },
//!                       tenant2: { vni: 1002, remote: [192.0.2.3, 192.0.2.4] } } }
//! links:
//!   - "vtep.underlay -> nic.input"
//!   - "nic.output -> vtep.underlay"
//! ```

use crate::OneOrMany;
use indexmap::IndexMap;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::time::{Duration, Instant};
use stitch_core::packet::ChecksumState;
use stitch_core::{App, AppContext, AppError, Counter, Io, Packet, PortNames, PortSpec};
use stitch_wire::ethertype;
use stitch_wire::header::{self, ethernet, ipv6, udp};
use stitch_wire::icmp::{too_big_reply, RateLimit};
use stitch_wire::views::{
    EthernetFrame, EthernetProtocol, IpProtocol, Ipv4Packet, Ipv6Packet, UdpPacket,
};
use stitch_wire::{checksum, flow, ipv4_header, offload, parse_mac};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    /// The VXLAN network identifier (0 to 16 777 215).
    pub vni: u32,
    /// One remote VTEP, or a list for head-end replication with learning.
    pub remote: OneOrMany<IpAddr>,
    /// The segment whose output reaches the senders of this segment's frames, where ICMP
    /// errors about them go (this segment by default): a one-way segment's answers travel back
    /// by the segment of the opposite direction.
    #[serde(default)]
    pub reply_via: Option<String>,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VxlanConfig {
    /// This VTEP's underlay address (its family is the underlay's).
    pub local: IpAddr,
    /// The source MAC of encapsulated frames.
    pub local_mac: String,
    /// The destination MAC of encapsulated frames: the underlay's next hop (a router in front
    /// resolves it).
    pub next_hop_mac: String,
    /// The VXLAN UDP port, sent to and listened on.
    #[serde(default = "default_port")]
    pub port: u16,
    /// A learned inner MAC address (which remote it sits behind) is forgotten after this many
    /// seconds.
    #[serde(default = "default_aging")]
    pub aging_seconds: u64,
    /// The largest IP packet the underlay carries.
    #[serde(default = "default_mtu")]
    pub mtu: usize,
    /// ICMP errors per second at most.
    #[serde(default = "default_icmp_rate")]
    pub icmp_rate: f64,
    /// The segments by name: each is an input and an output of that name, carrying one VNI's inner
    /// frames.
    pub segments: IndexMap<String, Segment>,
}

fn default_port() -> u16 {
    4789
}
fn default_aging() -> u64 {
    300
}
fn default_mtu() -> usize {
    1500
}
fn default_icmp_rate() -> f64 {
    100.0
}

/// Learned MAC addresses at most (all segments): a remote sending from ever new addresses
/// cannot grow the table without bound; past this, new addresses are flooded to.
const MAX_LEARNED: usize = 65536;

/// Outer headers over IPv4: Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8.
const OUTER4: usize = 50;
/// Outer headers over IPv6: Ethernet 14 + IPv6 40 + UDP 8 + VXLAN 8.
const OUTER6: usize = 70;

/// A learned inner MAC address: the remote it was last seen behind, and when.
struct Learned {
    remote: u16,
    seen: Instant,
}

pub struct Vxlan {
    local: IpAddr,
    local_mac: [u8; 6],
    next_hop_mac: [u8; 6],
    port: u16,
    vnis: Vec<u32>,
    /// Per segment, the segment whose output answers go out of.
    reply_via: Vec<usize>,
    remotes: Vec<Vec<IpAddr>>,
    segment_names: Vec<String>,
    by_vni: HashMap<u32, usize, foldhash::fast::RandomState>,
    learned: HashMap<(usize, [u8; 6]), Learned, foldhash::fast::RandomState>,
    aging: Duration,
    last_sweep: Instant,
    underlay: usize,
    /// Frames of one input after GSO segmentation, reused between pushes.
    staged: Vec<Packet>,
    /// The longest inner frame (Ethernet header, tags and IP packet) that fits.
    max_inner: usize,
    icmp_limit: RateLimit,
    icmp_sent: Counter,
    icmp_rate_limited: Counter,
    encapsulated: Counter,
    decapsulated: Counter,
    flooded: Counter,
    unknown_unicast: Counter,
    not_for_us: Counter,
    unknown_vni: Counter,
    foreign_vtep: Counter,
    bad_checksum: Counter,
    malformed: Counter,
    too_big: Counter,
    table_full: Counter,
}

/// The UDP checksum over IPv6 (RFC 8200 §8.1) of `udp` (header with a zero checksum field,
/// and payload).
fn udp6_checksum(src: &Ipv6Addr, dst: &Ipv6Addr, udp: &[u8]) -> u16 {
    let mut acc = checksum::sum(&src.octets(), 0);
    acc = checksum::sum(&dst.octets(), acc);
    acc += udp.len() as u64 + 17;
    let cs = checksum::finish(checksum::sum(udp, acc));
    if cs == 0 {
        0xffff
    } else {
        cs
    }
}

/// Bytes the outer headers take for an underlay of `local`'s family (outer Ethernet included).
fn outer_len(local: IpAddr) -> usize {
    if local.is_ipv4() {
        OUTER4
    } else {
        OUTER6
    }
}

impl Vxlan {
    /// Encapsulates an inner frame (ordinary, complete checksums) toward `remote`.
    fn encapsulate(&self, seg: usize, remote: IpAddr, mut p: Packet) -> Option<Packet> {
        let inner_len = p.len();
        let hash = flow::flow(p.data())
            .ok()
            .flatten()
            .map(|f| f.hash(true))
            .unwrap_or(0);
        let sport = 49152 + (hash % 16384) as u16;
        let udp_len = 8 + 8 + inner_len;
        let outer = outer_len(self.local);
        let h = p.prepend(outer).ok()?;
        let udp = outer - 16;
        // Per packet: plain stores through named fields (smoltcp's setters read, mask and
        // write back each field, which cost this hot path 10 % in `stitch bench nf vxlan`).
        h[ethernet::DST].copy_from_slice(&self.next_hop_mac);
        h[ethernet::SRC].copy_from_slice(&self.local_mac);
        let (eth, rest) = h.split_at_mut(ethernet::LEN);
        let ip = &mut rest[..udp - ethernet::LEN];
        match (self.local, remote) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                ethernet::ETHERTYPE.set(eth, ethertype::IPV4);
                // DF: the underlay must carry the whole frame (RFC 7348 §4.3).
                ip.copy_from_slice(&ipv4_header(src, dst, 17, udp_len, true));
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                ethernet::ETHERTYPE.set(eth, ethertype::IPV6);
                ipv6::Header {
                    traffic_class: 0,
                    flow_label: hash as u32,
                    payload_len: udp_len as u16,
                    next_header: 17,
                    hop_limit: 64,
                    src: src.octets(),
                    dst: dst.octets(),
                }
                .write(ip);
            }
            _ => return None, // refused by `declare`
        }
        let u = &mut h[udp..];
        header::l4::SRC_PORT.set(u, sport);
        header::l4::DST_PORT.set(u, self.port);
        udp::LEN.set(u, udp_len as u16);
        udp::CHECKSUM.set(u, 0); // IPv4: no UDP checksum (§5)
        header::vxlan::write(&mut u[8..], self.vnis[seg]);
        if let (IpAddr::V6(src), IpAddr::V6(dst)) = (self.local, remote) {
            let u = &mut p.data_mut()[udp..];
            let cs = udp6_checksum(&src, &dst, u);
            udp::CHECKSUM.set(u, cs);
        }
        Some(p)
    }

    /// The segment and remote (index) of an encapsulated packet, with the outer headers removed.
    fn decapsulate(&self, mut p: Packet) -> Result<(usize, u16, Packet), &Counter> {
        let d = p.data();
        let ethertype = EthernetFrame::new_checked(d).map(|e| e.ethertype());
        let (udp, src, dst) = match (self.local, ethertype) {
            (IpAddr::V4(_), Ok(EthernetProtocol::Ipv4)) if d.len() >= 34 => {
                let ip = Ipv4Packet::new_unchecked(&d[14..]);
                if ip.version() != 4 || ip.next_header() != IpProtocol::Udp {
                    return Err(&self.not_for_us);
                }
                if ip.header_len() < 20 {
                    return Err(&self.malformed);
                }
                let (src, dst) = (ip.src_addr(), ip.dst_addr());
                (
                    14 + ip.header_len() as usize,
                    IpAddr::V4(src),
                    IpAddr::V4(dst),
                )
            }
            (IpAddr::V6(_), Ok(EthernetProtocol::Ipv6)) if d.len() >= 54 => {
                let ip = Ipv6Packet::new_unchecked(&d[14..]);
                if ip.version() != 6 || ip.next_header() != IpProtocol::Udp {
                    return Err(&self.not_for_us);
                }
                (54, IpAddr::V6(ip.src_addr()), IpAddr::V6(ip.dst_addr()))
            }
            _ => return Err(&self.not_for_us),
        };
        if d.len() < udp + 16 + 14 {
            return Err(&self.malformed);
        }
        let u = UdpPacket::new_unchecked(&d[udp..]);
        if dst != self.local || u.dst_port() != self.port {
            return Err(&self.not_for_us);
        }
        let udp_len = u.len() as usize;
        if udp_len < 16 + 14 || udp + udp_len > d.len() {
            return Err(&self.malformed);
        }
        // A partial checksum (a sender on this host offloading it) is not checked: it is only
        // finished on the wire.
        let partial = p.checksum_state() == ChecksumState::Partial;
        if let (IpAddr::V6(s), IpAddr::V6(t), false) = (src, dst, partial) {
            let cs = u.checksum();
            let mut acc = checksum::sum(&s.octets(), 0);
            acc = checksum::sum(&t.octets(), acc) + udp_len as u64 + 17;
            if cs != 0 && checksum::finish(checksum::sum(&d[udp..udp + udp_len], acc)) != 0 {
                return Err(&self.bad_checksum);
            }
        }
        let Some(vni) = header::vxlan::vni(&d[udp + 8..]) else {
            return Err(&self.malformed);
        };
        let Some(&seg) = self.by_vni.get(&vni) else {
            return Err(&self.unknown_vni);
        };
        let Some(remote) = self.remotes[seg].iter().position(|r| *r == src) else {
            return Err(&self.foreign_vtep);
        };
        // Trailing bytes after the UDP datagram (Ethernet padding) are not part of the frame.
        let end = udp + udp_len;
        if end < p.len() {
            p.set_len(end).map_err(|_| &self.malformed)?;
        }
        let outer = udp + 16;
        p.shift_front(outer).map_err(|_| &self.malformed)?;
        if partial {
            // Offload metadata points into the frame: an inner checksum moves with it, an
            // outer one goes with the outer headers.
            let start = p.header().csum_start as usize;
            if start >= outer {
                p.header_mut().csum_start = (start - outer) as _;
            } else {
                p.set_checksum_state(ChecksumState::Unknown);
            }
        }
        Ok((seg, remote as u16, p))
    }

    /// Where a frame of segment `seg` goes: its learned remote, or every remote (flood).
    fn learned_remote(&self, seg: usize, frame: &[u8], now: Instant) -> Option<u16> {
        if self.remotes[seg].len() == 1 {
            return Some(0);
        }
        if frame[0] & 1 != 0 {
            return None; // broadcast, multicast
        }
        let dst: [u8; 6] = frame[0..6].try_into().unwrap();
        self.learned
            .get(&(seg, dst))
            .filter(|l| now.duration_since(l.seen) < self.aging)
            .map(|l| l.remote)
    }

    fn learn(&mut self, seg: usize, remote: u16, frame: &[u8], now: Instant) {
        if self.remotes[seg].len() == 1 || frame[6] & 1 != 0 {
            return;
        }
        let src: [u8; 6] = frame[6..12].try_into().unwrap();
        let full = self.learned.len() >= MAX_LEARNED;
        match self.learned.get_mut(&(seg, src)) {
            Some(l) => {
                l.remote = remote;
                l.seen = now;
            }
            None if full => self.table_full.add(1),
            None => {
                self.learned
                    .insert((seg, src), Learned { remote, seen: now });
            }
        }
    }

    /// The inner frame `frame` is longer than the underlay carries (its VLAN tags travel in
    /// the outer packet too).
    fn too_big(&self, frame: &[u8]) -> bool {
        frame.len() > self.max_inner
    }

    /// Answers an inner frame too long for the underlay with the ICMP error that tells its
    /// sender the inner MTU, when one is due and the rate allows.
    fn refuse_too_big(
        &mut self,
        frame: &[u8],
        now: Instant,
        back: &mut Option<stitch_core::Producer>,
    ) {
        self.too_big.add(1);
        let Some(back) = back.as_mut() else {
            return;
        };
        // The IP packet's room: what is left of the longest inner frame after this frame's
        // Ethernet header and tags.
        let l2_len = flow::l3(frame).map_or(14, |(at, _, _)| at);
        let inner_mtu = self.max_inner.saturating_sub(l2_len).min(u16::MAX as usize) as u16;
        let Some(answer) = too_big_reply(frame, inner_mtu) else {
            return;
        };
        if self.icmp_limit.allow(now) {
            back.transmit(answer);
            self.icmp_sent.add(1);
        } else {
            self.icmp_rate_limited.add(1);
        }
    }

    /// Encapsulates one inner frame of segment `seg` toward its remote(s).
    fn send(
        &mut self,
        seg: usize,
        p: Packet,
        now: Instant,
        out: &mut Option<stitch_core::Producer>,
    ) {
        let mut targets = 0..self.remotes[seg].len();
        if let Some(r) = self.learned_remote(seg, p.data(), now) {
            targets = r as usize..r as usize + 1;
        } else if p.data()[0] & 1 == 0 {
            self.unknown_unicast.add(1);
        } else {
            self.flooded.add(1);
        }
        let last = targets.end - 1;
        let mut p = Some(p);
        for r in targets {
            let copy = if r == last {
                p.take()
            } else {
                p.as_ref().and_then(|p| p.try_clone())
            };
            let Some(copy) = copy else {
                self.too_big.add(1);
                continue;
            };
            match self.encapsulate(seg, self.remotes[seg][r], copy) {
                Some(outer) => {
                    if let Some(o) = out.as_mut() {
                        o.transmit(outer);
                        self.encapsulated.add(1);
                    }
                }
                None => self.too_big.add(1),
            }
        }
    }
}

impl App for Vxlan {
    type Config = VxlanConfig;
    const EXAMPLE: &'static str = r#"local: 192.0.2.1
local_mac: "02:00:00:00:00:01"
next_hop_mac: "02:00:00:00:00:02"
segments:
  tenant1: { vni: 1001, remote: 192.0.2.2 }
  tenant2: { vni: 1002, remote: [192.0.2.3, 192.0.2.4] }
"#;

    fn declare(c: &VxlanConfig) -> Result<PortSpec, AppError> {
        parse_mac(&c.local_mac)?;
        parse_mac(&c.next_hop_mac)?;
        if c.segments.is_empty() {
            return Err("give at least one segment".into());
        }
        let outer = outer_len(c.local);
        if c.mtu < outer - 14 + 68 || c.mtu > 65535 {
            return Err(format!(
                "mtu {} cannot carry tunnelled packets: give the underlay's MTU, {}–65535",
                c.mtu,
                outer - 14 + 68
            )
            .into());
        }
        let mut seen = std::collections::HashSet::new();
        for (name, s) in &c.segments {
            if name == "underlay" {
                return Err(
                    "`underlay` is the name of the tunnel port; name the segment otherwise".into(),
                );
            }
            if s.vni >= 1 << 24 || !seen.insert(s.vni) {
                return Err(format!(
                    "segment `{name}`: VNI {} must be below 2^24 and unique",
                    s.vni
                )
                .into());
            }
            let remotes = s.remote.to_vec();
            if remotes.is_empty() || remotes.len() > u16::MAX as usize {
                return Err(format!("segment `{name}`: give one remote VTEP or a list").into());
            }
            if let Some(via) = s
                .reply_via
                .as_ref()
                .filter(|v| !c.segments.contains_key(*v))
            {
                return Err(format!(
                    "segment `{name}`: reply_via `{via}` is not a segment of this app"
                )
                .into());
            }
            if let Some(r) = remotes.iter().find(|r| r.is_ipv4() != c.local.is_ipv4()) {
                return Err(format!(
                    "segment `{name}`: remote {r} is not of the family of `local` {} (one \
                     underlay family per vxlan app)",
                    c.local
                )
                .into());
            }
        }
        let mut names: Vec<String> = c.segments.keys().cloned().collect();
        names.push("underlay".into());
        Ok(PortSpec {
            inputs: PortNames::Fixed(names.clone()),
            outputs: PortNames::Fixed(names),
        })
    }

    fn new(c: VxlanConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let vnis: Vec<u32> = c.segments.values().map(|s| s.vni).collect();
        let by_vni = vnis.iter().enumerate().map(|(i, v)| (*v, i)).collect();
        Ok(Vxlan {
            local: c.local,
            local_mac: parse_mac(&c.local_mac)?,
            next_hop_mac: parse_mac(&c.next_hop_mac)?,
            port: c.port,
            underlay: vnis.len(),
            remotes: c.segments.values().map(|s| s.remote.to_vec()).collect(),
            reply_via: c
                .segments
                .iter()
                .enumerate()
                .map(|(i, (_, s))| {
                    s.reply_via
                        .as_ref()
                        .and_then(|v| c.segments.get_index_of(v))
                        .unwrap_or(i)
                })
                .collect(),
            segment_names: c.segments.keys().cloned().collect(),
            vnis,
            by_vni,
            learned: HashMap::default(),
            aging: Duration::from_secs(c.aging_seconds),
            last_sweep: Instant::now(),
            staged: Vec::new(),
            max_inner: c.mtu + 14 - outer_len(c.local),
            icmp_limit: RateLimit::new(c.icmp_rate),
            icmp_sent: ctx.counter("icmp_sent"),
            icmp_rate_limited: ctx.counter("icmp_rate_limited"),
            encapsulated: ctx.counter("encapsulated"),
            decapsulated: ctx.counter("decapsulated"),
            flooded: ctx.counter("flooded"),
            unknown_unicast: ctx.counter("unknown_unicast_flooded"),
            not_for_us: ctx.counter("not_for_us_drops"),
            unknown_vni: ctx.counter("unknown_vni_drops"),
            foreign_vtep: ctx.counter("foreign_vtep_drops"),
            bad_checksum: ctx.counter("bad_checksum_drops"),
            malformed: ctx.counter("malformed_drops"),
            too_big: ctx.counter("too_big_drops"),
            table_full: ctx.counter("learning_table_full"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let now = Instant::now();
        let (inputs, outputs) = io.split();
        for (port, input) in inputs.iter_mut().enumerate() {
            let Some(input) = input.as_mut() else {
                continue;
            };
            if port == self.underlay {
                for p in input.drain() {
                    if p.len() < 14 {
                        self.malformed.add(1);
                        continue;
                    }
                    match self.decapsulate(p) {
                        Ok((seg, remote, inner)) => {
                            self.learn(seg, remote, inner.data(), now);
                            if let Some(o) = outputs[seg].as_mut() {
                                o.transmit(inner);
                                self.decapsulated.add(1);
                            }
                        }
                        Err(counter) => counter.add(1),
                    }
                }
                continue;
            }
            let mut staged = std::mem::take(&mut self.staged);
            for p in input.drain() {
                if p.len() < 14 {
                    self.malformed.add(1);
                    continue;
                }
                // Ordinary frames with complete checksums: the outer headers move the offsets
                // that offload metadata points at, and the far end may not offload at all.
                let cut = offload::resolve_gso(p, |mut s| {
                    if offload::complete_checksum(&mut s).is_ok() {
                        staged.push(s);
                    }
                });
                if cut.is_err() {
                    self.malformed.add(1);
                }
            }
            for p in staged.drain(..) {
                if self.too_big(p.data()) {
                    self.refuse_too_big(p.data(), now, &mut outputs[self.reply_via[port]]);
                    continue;
                }
                self.send(port, p, now, &mut outputs[self.underlay]);
            }
            self.staged = staged;
        }
    }

    /// The learned table: `{"count", "entries": [{segment, mac, remote, age_s}]}`.
    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        let limit = request["limit"].as_u64().unwrap_or(1000) as usize;
        let now = Instant::now();
        let mut entries: Vec<_> = self
            .learned
            .iter()
            .filter(|(_, l)| now.duration_since(l.seen) < self.aging)
            .map(|((seg, mac), l)| {
                let mac = mac
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(":");
                serde_json::json!({ "segment": self.segment_names[*seg], "mac": mac,
                    "remote": self.remotes[*seg][l.remote as usize].to_string(),
                    "age_s": now.duration_since(l.seen).as_secs() })
            })
            .collect();
        let count = entries.len();
        entries.sort_by_key(|e| e.to_string());
        entries.truncate(limit);
        serde_json::json!({ "count": count, "entries": entries })
    }

    /// Forgets aged entries, once a second.
    fn tick(&mut self, _: &mut Io, now: Instant) {
        if self.learned.is_empty() || now.duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        let aging = self.aging;
        self.learned
            .retain(|_, l| now.duration_since(l.seen) < aging);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use stitch_core::link::{link, Consumer};
    use stitch_core::pool;

    fn vtep(local: &str, remote: serde_json::Value) -> Vxlan {
        crate::testing::build::<Vxlan>(serde_json::json!({
            "local": local, "local_mac": "02:00:00:00:00:01", "next_hop_mac": "02:00:00:00:00:02",
            "segments": { "a": { "vni": 7, "remote": remote } }
        }))
    }

    fn frame(dst: [u8; 6], src: [u8; 6]) -> Packet {
        let mut f: Vec<u8> = (0..60u8).collect();
        f[0..6].copy_from_slice(&dst);
        f[6..12].copy_from_slice(&src);
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        p
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn round_trip_and_refusals_are_counted() {
        let v1 = vtep("192.0.2.1", serde_json::json!("192.0.2.2"));
        let v2 = vtep("192.0.2.2", serde_json::json!("192.0.2.1"));
        let inner = frame([2; 6], [4; 6]);
        let bytes = inner.data().to_vec();
        let outer = v1.encapsulate(0, ip("192.0.2.2"), inner).unwrap();
        assert_eq!(outer.len(), 60 + OUTER4);
        assert_eq!(checksum::checksum(&outer.data()[14..34]), 0);
        let copy = outer.try_clone().unwrap();
        let (seg, remote, back) = v2.decapsulate(outer).unwrap();
        assert_eq!((seg, remote, back.data()), (0, 0, &bytes[..]));
        // Not addressed to v1's own local address: refused and counted there.
        assert!(v1.decapsulate(copy).is_err());
        // Unknown VNI.
        let mut o = v1
            .encapsulate(0, ip("192.0.2.2"), frame([2; 6], [4; 6]))
            .unwrap();
        o.data_mut()[48] = 9;
        assert!(std::ptr::eq(
            v2.decapsulate(o).unwrap_err(),
            &v2.unknown_vni
        ));
        // From a VTEP that is not the segment's remote.
        let v3 = vtep("192.0.2.3", serde_json::json!("192.0.2.1"));
        let o = v3
            .encapsulate(0, ip("192.0.2.2"), frame([2; 6], [4; 6]))
            .unwrap();
        assert!(std::ptr::eq(
            v2.decapsulate(o).unwrap_err(),
            &v2.foreign_vtep
        ));
        // The port layout: segments, then underlay.
        let c: VxlanConfig = serde_json::from_value(serde_json::json!({
            "local": "192.0.2.1", "local_mac": "02:00:00:00:00:01", "next_hop_mac": "02:00:00:00:00:02",
            "segments": { "a": { "vni": 7, "remote": "192.0.2.2" } } })).unwrap();
        let spec = Vxlan::declare(&c).unwrap();
        assert_eq!(
            spec.inputs,
            PortNames::Fixed(vec!["a".into(), "underlay".into()])
        );
    }

    #[test]
    fn ipv6_underlay_carries_a_udp_checksum_and_a_flow_label() {
        let v1 = vtep("2001:db8::1", serde_json::json!("2001:db8::2"));
        let v2 = vtep("2001:db8::2", serde_json::json!(["2001:db8::1"]));
        let inner = frame([2; 6], [4; 6]);
        let bytes = inner.data().to_vec();
        let outer = v1.encapsulate(0, ip("2001:db8::2"), inner).unwrap();
        let d = outer.data();
        assert_eq!(outer.len(), 60 + OUTER6);
        assert_eq!(
            (&d[12..14], d[20], d[21]),
            (&ethertype::IPV6.to_be_bytes()[..], 17, 64)
        );
        assert_eq!(Ipv6Packet::new_unchecked(&d[14..]).payload_len(), 16 + 60);
        let mut acc = checksum::sum(&d[22..54], 0) + 17 + 76;
        acc = checksum::sum(&d[54..], acc);
        assert_eq!(
            checksum::finish(acc),
            0,
            "UDP checksum over the pseudo-header"
        );
        assert_ne!(UdpPacket::new_unchecked(&d[54..]).checksum(), 0);
        let mut bad = outer.try_clone().unwrap();
        let (seg, _, back) = v2.decapsulate(outer).unwrap();
        assert_eq!((seg, back.data()), (0, &bytes[..]));
        let n = bad.len();
        bad.data_mut()[n - 1] ^= 0xff;
        assert!(std::ptr::eq(
            v2.decapsulate(bad).unwrap_err(),
            &v2.bad_checksum
        ));
    }

    #[test]
    fn mixed_families_are_refused() {
        let c: VxlanConfig = serde_json::from_value(serde_json::json!({
            "local": "192.0.2.1", "local_mac": "02:00:00:00:00:01", "next_hop_mac": "02:00:00:00:00:02",
            "segments": { "a": { "vni": 7, "remote": ["192.0.2.2", "2001:db8::2"] } } }))
        .unwrap();
        let e = Vxlan::declare(&c).expect_err("refused").to_string();
        assert!(e.contains("not of the family"), "{e}");
    }

    /// An IPv4 frame whose IP packet is `ip_len` bytes long, DF set.
    fn ipv4_df(ip_len: usize) -> Packet {
        let mut f = vec![0u8; 14];
        f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 0xb]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 0xa]);
        f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
        let (a, b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        f.extend_from_slice(&ipv4_header(a, b, 17, ip_len - 20, true));
        f.resize(14 + ip_len, 0);
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        p
    }

    #[test]
    fn frames_the_underlay_cannot_carry_are_answered_with_the_inner_mtu() {
        let mut v = crate::testing::build::<Vxlan>(serde_json::json!({
            "local": "192.0.2.1", "local_mac": "02:00:00:00:00:01",
            "next_hop_mac": "02:00:00:00:00:02", "mtu": 1500, "icmp_rate": 2,
            "segments": { "a": { "vni": 7, "remote": "192.0.2.2" } }
        }));
        let (mut io, [mut seg_in, _wire_in], [mut seg_out, mut wire_out]) =
            crate::testing::ports(["a", "underlay"]);
        seg_in.transmit(ipv4_df(1450));
        for _ in 0..3 {
            seg_in.transmit(ipv4_df(1451));
        }
        v.push(&mut io);
        let sent: Vec<usize> = wire_out.drain().map(|p| p.len()).collect();
        assert_eq!(
            sent,
            vec![14 + 1450 + OUTER4],
            "an outer IP packet of 1500 bytes"
        );
        let answers: Vec<Packet> = seg_out.drain().collect();
        assert_eq!(answers.len(), 2, "the rest is rate-limited");
        let d = answers[0].data();
        assert_eq!((d[34], d[35]), (3, 4), "fragmentation needed");
        assert_eq!(header::icmp::NEXT_HOP_MTU.get(&d[34..]), 1450);
        assert_eq!(&d[26..30], &[10, 0, 0, 2], "from the packet's destination");
        assert_eq!(
            (
                v.too_big.get(),
                v.icmp_sent.get(),
                v.icmp_rate_limited.get()
            ),
            (3, 2, 1)
        );
        let c: VxlanConfig = serde_json::from_value(serde_json::json!({
            "local": "2001:db8::1", "local_mac": "02:00:00:00:00:01",
            "next_hop_mac": "02:00:00:00:00:02", "mtu": 100,
            "segments": { "a": { "vni": 7, "remote": "2001:db8::2" } } }))
        .unwrap();
        let e = Vxlan::declare(&c).expect_err("refused").to_string();
        assert!(e.contains("mtu 100 cannot carry"), "{e}");
    }

    #[test]
    fn a_tagged_frame_counts_its_tags_against_the_underlay() {
        let mut v = crate::testing::build::<Vxlan>(serde_json::json!({
            "local": "192.0.2.1", "local_mac": "02:00:00:00:00:01",
            "next_hop_mac": "02:00:00:00:00:02",
            "segments": { "a": { "vni": 7, "remote": "192.0.2.2" } }
        }));
        let (mut io, [mut seg_in, _wire_in], [mut seg_out, mut wire_out]) =
            crate::testing::ports(["a", "underlay"]);
        let tagged = |ip_len: usize| {
            let mut p = ipv4_df(ip_len);
            stitch_wire::vlan::push(&mut p, ethertype::VLAN, 7).unwrap();
            p
        };
        seg_in.transmit(tagged(1446));
        seg_in.transmit(tagged(1447));
        v.push(&mut io);
        let sent: Vec<usize> = wire_out.drain().map(|p| p.len()).collect();
        assert_eq!(
            sent,
            vec![14 + 1500],
            "tag and all, a 1500-byte outer packet"
        );
        let answer = seg_out.drain().next().expect("an answer");
        let d = answer.data();
        assert_eq!(
            (d[38], d[39]),
            (3, 4),
            "fragmentation needed, behind the tag"
        );
        assert_eq!(header::icmp::NEXT_HOP_MTU.get(&d[38..]), 1446);
    }

    #[test]
    fn a_one_way_segment_answers_by_the_segment_of_the_other_way() {
        let config = |via: &str| {
            serde_json::json!({
                "local": "192.0.2.1", "local_mac": "02:00:00:00:00:01",
                "next_hop_mac": "02:00:00:00:00:02",
                "segments": { "there": { "vni": 7, "remote": "192.0.2.2", "reply_via": via },
                              "back": { "vni": 8, "remote": "192.0.2.2" } }
            })
        };
        let mut v = crate::testing::build::<Vxlan>(config("back"));
        let (mut io, [mut there_in, _back_in, _wire_in], [mut there_out, mut back_out, _wire_out]) =
            crate::testing::ports(["there", "back", "underlay"]);
        there_in.transmit(ipv4_df(1451));
        v.push(&mut io);
        assert_eq!(there_out.drain().count(), 0);
        assert_eq!(back_out.drain().count(), 1, "the answer");
        let c: VxlanConfig = serde_json::from_value(config("nowhere")).unwrap();
        let e = Vxlan::declare(&c).expect_err("refused").to_string();
        assert!(e.contains("reply_via `nowhere` is not a segment"), "{e}");
    }

    #[test]
    fn floods_to_every_remote_until_it_learns_where_a_mac_is() {
        let mut v = vtep("192.0.2.1", serde_json::json!(["192.0.2.2", "192.0.2.3"]));
        let (mut io, [mut seg_in, mut wire_in], [mut seg_out, mut wire_out]) =
            crate::testing::ports(["a", "underlay"]);
        let dests = |w: &mut Consumer| -> Vec<[u8; 4]> {
            w.drain()
                .map(|p| p.data()[30..34].try_into().unwrap())
                .collect()
        };
        let (host, far) = ([2, 0, 0, 0, 0, 0xa], [2, 0, 0, 0, 0, 0xb]);
        // Broadcast and unknown unicast: one copy per remote.
        seg_in.transmit(frame([0xff; 6], host));
        seg_in.transmit(frame(far, host));
        v.push(&mut io);
        assert_eq!(
            dests(&mut wire_out),
            vec![
                [192, 0, 2, 2],
                [192, 0, 2, 3],
                [192, 0, 2, 2],
                [192, 0, 2, 3]
            ]
        );
        // `far` answers from behind 192.0.2.3: learned.
        let peer = vtep("192.0.2.3", serde_json::json!("192.0.2.1"));
        wire_in.transmit(
            peer.encapsulate(0, ip("192.0.2.1"), frame(host, far))
                .unwrap(),
        );
        v.push(&mut io);
        assert_eq!(seg_out.drain().count(), 1);
        seg_in.transmit(frame(far, host));
        v.push(&mut io);
        assert_eq!(dests(&mut wire_out), vec![[192, 0, 2, 3]]);
        assert_eq!((v.flooded.get(), v.unknown_unicast.get()), (1, 1));
        let table = v.query(&serde_json::json!({}));
        assert_eq!(table["count"], 1);
        assert_eq!(table["entries"][0]["remote"], "192.0.2.3");
        assert_eq!(table["entries"][0]["mac"], "02:00:00:00:00:0b");
    }

    #[test]
    fn gso_super_frames_and_partial_checksums_leave_as_ordinary_frames() {
        // A TCP super-frame of 3000 bytes of payload, MSS 1000, with a partial checksum.
        let mut f = vec![0u8; 54 + 3000];
        f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
        f[14..34].copy_from_slice(&ipv4_header(
            Ipv4Addr::new(10, 0, 0, 1),
            Ipv4Addr::new(10, 0, 0, 2),
            6,
            3020,
            true,
        ));
        f[46] = 5 << 4;
        f[47] = 0x18;
        let ps = checksum::sum(&f[26..34], 0) + 6 + 3020;
        let mut folded = ps;
        while folded > 0xffff {
            folded = (folded & 0xffff) + (folded >> 16);
        }
        header::tcp::CHECKSUM.set(&mut f[34..], folded as u16);
        let mut p = pool::alloc_large().unwrap();
        p.set_data(&f).unwrap();
        {
            let h = p.header_mut();
            h.csum_start = 34;
            h.csum_offset = 16;
            h.gso_type = offload::GSO_TCPV4;
            h.gso_size = 1000;
        }
        p.set_checksum_state(ChecksumState::Partial);
        let mut v = vtep("192.0.2.1", serde_json::json!("192.0.2.2"));
        let (mut io, [mut seg_in, _], [_, mut wire_out]) = crate::testing::ports(["a", "underlay"]);
        seg_in.transmit(p);
        v.push(&mut io);
        let out: Vec<Packet> = wire_out.drain().collect();
        assert_eq!(out.len(), 3);
        for o in &out {
            let inner = &o.data()[OUTER4..];
            assert_eq!(inner.len(), 54 + 1000);
            let tcp = &inner[34..];
            let acc = checksum::sum(&inner[26..34], 0) + 6 + tcp.len() as u64;
            assert_eq!(
                checksum::finish(checksum::sum(tcp, acc)),
                0,
                "complete TCP checksum"
            );
        }
    }

    #[test]
    fn the_learning_table_is_bounded_and_ages() {
        let mut v = vtep("192.0.2.1", serde_json::json!(["192.0.2.2", "192.0.2.3"]));
        let now = Instant::now();
        let mut f = [0u8; 14];
        for i in 0..=MAX_LEARNED as u32 {
            f[6..12].copy_from_slice(&[
                2,
                0,
                (i >> 24) as u8,
                (i >> 16) as u8,
                (i >> 8) as u8,
                i as u8,
            ]);
            v.learn(0, 1, &f, now);
        }
        assert_eq!(v.learned.len(), MAX_LEARNED);
        assert_eq!(
            v.table_full.get(),
            1,
            "the address past the bound is not learned"
        );
        // Entries older than the aging time go at the next sweep.
        v.aging = Duration::from_secs(1);
        let (_, a) = link(4);
        let (b, _) = link(4);
        let mut io = Io::new(vec![("a".into(), a)], vec![("a".into(), b)]);
        v.tick(&mut io, now + Duration::from_secs(3));
        assert!(v.learned.is_empty());
    }
}
