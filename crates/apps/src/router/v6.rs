//! The IPv6 half of the router: forwarding with hop limits, Neighbor Discovery (RFC 4861:
//! answering solicitations for the router's addresses, global and link-local, resolving next
//! hops through solicited-node multicast, router advertisements), ICMPv6 errors (RFC 4443: time
//! exceeded, unreachable, packet too big, parameter problem; rate-limited with the IPv4 ones)
//! and echo replies. Packets for the router are read behind their extension headers (RFC 8200
//! §4: hop-by-hop, destination options, routing; fragments are not reassembled); link-local
//! sources and destinations are never forwarded (RFC 4291 §2.5.6).

use super::{Iface, NextHop, Router};
use std::net::Ipv6Addr;
use std::time::{Duration, Instant};
use stitch_core::{pool, Packet};
use stitch_wire::be::Put;
use stitch_wire::header::{ethernet, icmp, ipv6};
use stitch_wire::ndp::{icmp6_checksum, lladdr_option, multicast_mac, solicited_node, ICMPV6};
use stitch_wire::{ethertype, icmpv6, ip_proto};

/// All-nodes multicast, where unsolicited advertisements go.
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
/// RFC 4861 §10: at most one multicast advertisement per 3 s in answer to solicitations, and
/// the first few unsolicited ones at most 16 s apart.
const MIN_DELAY_BETWEEN_RAS: Duration = Duration::from_secs(3);
const MAX_INITIAL_RTR_ADVERT_INTERVAL: Duration = Duration::from_secs(16);
const MAX_INITIAL_RTR_ADVERTISEMENTS: u32 = 3;

/// When each advertising interface sends its next router advertisement.
pub(super) struct Advertising {
    interval: Duration,
    next: Vec<Option<Instant>>,
    sent: Vec<u32>,
    last_multicast: Vec<Option<Instant>>,
}

impl Advertising {
    pub(super) fn new(ifaces: &[Iface], interval: Duration) -> Self {
        let now = Instant::now();
        Advertising {
            interval,
            next: ifaces.iter().map(|i| i.advertise.then_some(now)).collect(),
            sent: vec![0; ifaces.len()],
            last_multicast: vec![None; ifaces.len()],
        }
    }

    /// The delay to the next unsolicited advertisement: fast at first, then between ¾ and all
    /// of the interval, spread so routers on one link do not synchronise (RFC 4861 §6.2.4).
    fn delay(&self, port: usize, now: Instant) -> Duration {
        let _ = now;
        let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let jitter = (clock.map_or(0, |d| d.subsec_nanos()) as u64 ^ (port as u64 * 7919)) % 1000;
        let spread = self.interval / 4 * jitter as u32 / 1000;
        let d = self.interval - self.interval / 4 + spread;
        if self.sent[port] < MAX_INITIAL_RTR_ADVERTISEMENTS {
            d.min(MAX_INITIAL_RTR_ADVERT_INTERVAL)
        } else {
            d
        }
    }
}

/// Where the upper-layer header of an IPv6 packet (frame `d`, payload ending at `end`) starts,
/// and its protocol, past hop-by-hop, destination options and routing headers.
enum Upper {
    Found(usize, u8),
    /// A fragment: not reassembled here.
    Fragment,
    /// A routing header with segments left, pointer (from the IPv6 header) to its type field.
    Route(usize),
    Malformed,
}

fn upper_layer(d: &[u8], end: usize) -> Upper {
    let (mut next, mut at) = (ipv6::NEXT_HEADER.get(&d[IP..]), IP + ipv6::LEN);
    loop {
        match next {
            ip_proto::HOP_BY_HOP | ip_proto::DESTINATION_OPTIONS | ip_proto::ROUTING => {
                if at + 8 > end {
                    return Upper::Malformed;
                }
                if next == ip_proto::ROUTING && d[at + 3] != 0 {
                    return Upper::Route(at + 2 - IP);
                }
                next = d[at];
                at += (d[at + 1] as usize + 1) * 8;
            }
            ip_proto::FRAGMENT => return Upper::Fragment,
            _ => {
                return if at <= end {
                    Upper::Found(at, next)
                } else {
                    Upper::Malformed
                }
            }
        }
    }
}

/// The IPv6 address at `at` of `b`.
/// A hash of an IPv6 packet's flow — addresses, flow label, the next header and, when it is
/// TCP, UDP or SCTP right after the fixed header, the ports — choosing its ECMP path.
#[inline]
pub(super) fn flow_hash6(d: &[u8]) -> u32 {
    let (src, dst) = (u128::from(src_of(d)), u128::from(dst_of(d)));
    let ip = &d[IP..];
    let next = ipv6::NEXT_HEADER.get(ip);
    let ports = match next {
        stitch_wire::ip_proto::TCP | stitch_wire::ip_proto::UDP | stitch_wire::ip_proto::SCTP => {
            stitch_wire::header::l4::PORTS
                .try_get(&ip[ipv6::LEN..])
                .unwrap_or(0)
        }
        _ => 0,
    };
    let label = u32::from_be_bytes(ip[0..4].try_into().expect("a fixed header")) & 0xf_ffff;
    let folded = (src ^ src >> 64 ^ dst.rotate_left(32) ^ dst >> 64) as u64;
    super::mix(folded ^ (u64::from(ports) << 28 | u64::from(label) << 8 | u64::from(next)))
}

fn addr(b: &[u8], at: usize) -> Ipv6Addr {
    ipv6::addr(b, at..at + 16)
}

/// Where a frame's IPv6 header starts.
const IP: usize = 14;

/// The source address of the IPv6 packet in frame `d`.
fn src_of(d: &[u8]) -> Ipv6Addr {
    ipv6::addr(&d[IP..], ipv6::SRC)
}

fn dst_of(d: &[u8]) -> Ipv6Addr {
    ipv6::addr(&d[IP..], ipv6::DST)
}

/// Where the IPv6 packet in frame `d` ends, as its header says.
fn end_of(d: &[u8]) -> usize {
    IP + ipv6::LEN + ipv6::PAYLOAD_LEN.get(&d[IP..]) as usize
}

impl Router {
    /// An Ethernet + IPv6 frame from interface `port` carrying ICMPv6 `body` (checksum filled).
    fn icmp6_frame(
        &self,
        port: usize,
        dst_mac: [u8; 6],
        src: Ipv6Addr,
        dst: Ipv6Addr,
        mut body: Vec<u8>,
    ) -> Option<Packet> {
        icmp::CHECKSUM.set(&mut body, 0);
        let cs = icmp6_checksum(&src.octets(), &dst.octets(), &body);
        icmp::CHECKSUM.set(&mut body, cs);
        let mut f = vec![0; IP + ipv6::LEN];
        f[0..6].copy_from_slice(&dst_mac);
        f[6..12].copy_from_slice(&self.ifaces[port].mac);
        ethernet::ETHERTYPE.set(&mut f, ethertype::IPV6);
        ipv6::Header {
            traffic_class: 0,
            flow_label: 0,
            payload_len: body.len() as u16,
            next_header: ICMPV6,
            hop_limit: 255,
            src: src.octets(),
            dst: dst.octets(),
        }
        .write(&mut f[IP..]);
        f.extend_from_slice(&body);
        pool::alloc_with(&f)
    }

    fn neighbor_solicitation(&self, port: usize, target: Ipv6Addr) -> Option<Packet> {
        let src = self.ifaces[port].addr6?;
        let mut body = vec![icmpv6::NEIGHBOR_SOLICITATION, 0, 0, 0, 0, 0, 0, 0];
        body.extend_from_slice(&target.octets());
        body.extend_from_slice(&[1, 1]);
        body.extend_from_slice(&self.ifaces[port].mac);
        let dst = solicited_node(target);
        self.icmp6_frame(port, multicast_mac(dst), src, dst, body)
    }

    /// An ICMPv6 error about the packet in `d`, sent back out of `port`.
    fn icmp6_error(
        &mut self,
        d: &[u8],
        port: usize,
        kind: u8,
        code: u8,
        extra: u32,
        now: Instant,
    ) -> Option<(usize, Packet)> {
        let src = self.ifaces[port].addr6?;
        // Never about ICMPv6 errors (types below 128).
        let end = end_of(d).min(d.len());
        if let Upper::Found(at, ICMPV6) = upper_layer(d, end) {
            if d.get(at).is_some_and(|t| *t < 128) {
                return None;
            }
        }
        if !self.icmp_allowed(now) {
            return None;
        }
        let mut body = vec![kind, code, 0, 0];
        body.put(extra);
        body.extend_from_slice(&d[IP..d.len().min(IP + 1280 - 48)]);
        let to = src_of(d);
        let p = self.icmp6_frame(port, d[6..12].try_into().unwrap(), src, to, body)?;
        self.c.icmp_sent.add(1);
        Some((port, p))
    }

    /// Sends `p` toward IPv6 next hop `next`, soliciting it if unknown.
    fn send6(
        &mut self,
        next: NextHop<Ipv6Addr>,
        p: Packet,
        now: Instant,
        out: &mut Vec<(usize, Packet)>,
    ) {
        if self
            .neighbors6
            .send(next, p, now, self.arp_timeout, out, &self.c.arp_queue_drops)
        {
            if let Some(q) = self.neighbor_solicitation(next.port, next.addr) {
                self.c.arp_requests.add(1);
                out.push((next.port, q));
            }
        }
    }

    /// A router advertisement from interface `port` (RFC 4861 §4.2): source link-layer
    /// address, MTU and the prefix (on-link; autonomous when it is a /64, for SLAAC).
    fn router_advertisement(&self, port: usize, dst: Ipv6Addr, mac: [u8; 6]) -> Option<Packet> {
        let i = &self.ifaces[port];
        let (ll, prefix) = (i.ll6?, i.prefix6?);
        let lifetime = (self.ra.interval.as_secs() * 3).min(9000) as u16;
        let mut body = vec![icmpv6::ROUTER_ADVERTISEMENT, 0, 0, 0, 64, 0];
        body.put(lifetime);
        body.extend_from_slice(&[0; 8]); // reachable time, retrans timer: unspecified
        body.extend_from_slice(&[1, 1]);
        body.extend_from_slice(&i.mac);
        body.extend_from_slice(&[5, 1, 0, 0]);
        body.put(i.mtu as u32);
        let autonomous = if prefix.prefix_len() == 64 { 0x40 } else { 0 };
        body.extend_from_slice(&[3, 4, prefix.prefix_len(), 0x80 | autonomous]);
        body.put(2_592_000u32); // valid: 30 days
        body.put(604_800u32); // preferred: 7 days
        body.extend_from_slice(&[0; 4]);
        body.extend_from_slice(&prefix.network().octets());
        self.icmp6_frame(port, mac, ll, dst, body)
    }

    /// Unsolicited advertisements that are due, with the interface to send each from.
    pub(super) fn due_advertisements(&mut self, now: Instant) -> Vec<(usize, Packet)> {
        let mut due = Vec::new();
        for port in 0..self.ifaces.len() {
            if self.ra.next[port].is_none_or(|t| t > now) {
                continue;
            }
            if let Some(p) = self.router_advertisement(port, ALL_NODES, multicast_mac(ALL_NODES)) {
                self.c.advertisements.add(1);
                due.push((port, p));
            }
            self.ra.sent[port] += 1;
            self.ra.last_multicast[port] = Some(now);
            self.ra.next[port] = Some(now + self.ra.delay(port, now));
        }
        due
    }

    /// A router solicitation on an advertising interface: answered to the host directly when
    /// it says who it is, else by a multicast advertisement no sooner than 3 s after the last.
    fn solicited(
        &mut self,
        port: usize,
        src: Ipv6Addr,
        mac: Option<[u8; 6]>,
        now: Instant,
        out: &mut Vec<(usize, Packet)>,
    ) {
        if !self.ifaces[port].advertise {
            self.c.ignored.add(1);
            return;
        }
        match mac {
            Some(mac) if !src.is_unspecified() => {
                if let Some(p) = self.router_advertisement(port, src, mac) {
                    self.c.advertisements.add(1);
                    out.push((port, p));
                }
            }
            _ => {
                let soonest = self.ra.last_multicast[port]
                    .map_or(now, |t| (t + MIN_DELAY_BETWEEN_RAS).max(now));
                let next = self.ra.next[port].get_or_insert(soonest);
                *next = (*next).min(soonest);
            }
        }
    }

    /// Packets addressed to the router (or multicast): NDP and echo, read past extension
    /// headers.
    fn local6(&mut self, port: usize, p: Packet, now: Instant, out: &mut Vec<(usize, Packet)>) {
        let d = p.data();
        let end = end_of(d);
        let (src, dst) = (src_of(d), dst_of(d));
        let upper = upper_layer(d, end);
        let Some(p) = self.up_to_host6(port, p, &upper, dst, out) else {
            return;
        };
        let d = p.data();
        let at = match upper {
            Upper::Found(at, ICMPV6) if at + 8 <= end => at,
            Upper::Route(pointer) if !dst.is_multicast() => {
                // A source route through the router: no routing header type is supported.
                if let Some(e) = self.icmp6_error(d, port, 4, 0, pointer as u32, now) {
                    self.c.parameter_problems.add(1);
                    out.push(e);
                }
                return;
            }
            Upper::Malformed => {
                self.c.bad_header.add(1);
                return;
            }
            _ => {
                self.c.local_drops.add(1);
                return;
            }
        };
        let body = &d[at..end];
        if icmp6_checksum(&src.octets(), &dst.octets(), body) != 0 {
            self.c.bad_header.add(1);
            return;
        }
        let Some(me) = self.ifaces[port].addr6 else {
            self.c.local_drops.add(1);
            return;
        };
        let ll = self.ifaces[port].ll6.unwrap_or(me);
        // Neighbor Discovery must come from the link itself (RFC 4861 §6.1, §7.1).
        let hop_limit = ipv6::HOP_LIMIT.get(&d[IP..]);
        if icmpv6::is_neighbor_discovery(body[0]) && (hop_limit != 255 || body[1] != 0) {
            self.c.bad_header.add(1);
            return;
        }
        let options = |from: usize| body.get(from..).and_then(lladdr_option);
        match body[0] {
            icmpv6::ROUTER_SOLICITATION => {
                let mac = options(8);
                if let (Some(mac), false) = (mac, src.is_unspecified()) {
                    self.neighbors6
                        .learn(port, src, mac, now, self.arp_timeout, out);
                }
                self.solicited(port, src, mac, now, out);
            }
            // Neighbor solicitation for one of our addresses: advertise, and learn the asker.
            icmpv6::NEIGHBOR_SOLICITATION
                if body.len() >= 24 && [me, ll].contains(&addr(body, 8)) =>
            {
                let target = addr(body, 8);
                if let Some(mac) = options(24) {
                    if !src.is_unspecified() {
                        self.neighbors6
                            .learn(port, src, mac, now, self.arp_timeout, out);
                    }
                }
                // Router + solicited + override.
                let mut na = vec![icmpv6::NEIGHBOR_ADVERTISEMENT, 0, 0, 0, 0xe0, 0, 0, 0];
                na.extend_from_slice(&target.octets());
                na.extend_from_slice(&[2, 1]);
                na.extend_from_slice(&self.ifaces[port].mac);
                let to = if src.is_unspecified() { ALL_NODES } else { src };
                let mac = if src.is_unspecified() {
                    multicast_mac(to)
                } else {
                    d[6..12].try_into().unwrap()
                };
                if let Some(r) = self.icmp6_frame(port, mac, target, to, na) {
                    self.c.arp_replies.add(1);
                    out.push((port, r));
                }
            }
            // Neighbor advertisement: learn it.
            icmpv6::NEIGHBOR_ADVERTISEMENT if body.len() >= 24 => {
                let target = addr(body, 8);
                if let Some(mac) = options(24).or_else(|| d[6..12].try_into().ok()) {
                    self.neighbors6
                        .learn(port, target, mac, now, self.arp_timeout, out);
                }
            }
            icmpv6::ECHO_REQUEST if !dst.is_multicast() => {
                let mut reply = body.to_vec();
                reply[0] = icmpv6::ECHO_REPLY;
                let mac = d[6..12].try_into().unwrap();
                if let Some(r) = self.icmp6_frame(port, mac, dst, src, reply) {
                    self.c.echo_replies.add(1);
                    out.push((port, r));
                }
            }
            // Multicast listener queries and reports, other routers' advertisements,
            // solicitations for other hosts' addresses: not the router's business.
            icmpv6::MLD_QUERY
            | icmpv6::MLD_REPORT
            | icmpv6::MLD_DONE
            | icmpv6::MLDV2_REPORT
            | icmpv6::ROUTER_ADVERTISEMENT
            | icmpv6::NEIGHBOR_SOLICITATION => self.c.ignored.add(1),
            _ => self.c.local_drops.add(1),
        }
    }

    /// With host ports, sends what is addressed to the router up to the host — BGP, OSPFv3
    /// (the packet itself, its checksum perhaps still partial), and a copy of ICMPv6 but echo
    /// requests (Neighbor Discovery is also handled here, so the host's neighbours and the
    /// router's agree). Gives back the packet when something is left to do here.
    fn up_to_host6(
        &self,
        port: usize,
        p: Packet,
        upper: &Upper,
        dst: Ipv6Addr,
        out: &mut Vec<(usize, Packet)>,
    ) -> Option<Packet> {
        let Some(base) = self.host_base else {
            return Some(p);
        };
        match *upper {
            Upper::Found(at, ICMPV6) => {
                let echo = p.data().get(at) == Some(&icmpv6::ECHO_REQUEST) && !dst.is_multicast();
                if !echo {
                    self.copy_to_host(port, &p, out);
                }
                Some(p)
            }
            _ => {
                self.c.punted.add(1);
                out.push((base + port, p));
                None
            }
        }
    }

    pub(super) fn route6(
        &mut self,
        port: usize,
        mut p: Packet,
        now: Instant,
        out: &mut Vec<(usize, Packet)>,
    ) {
        let d = p.data();
        // One length check; the fields are then read from a header of known length.
        let Some(ip) = d.get(IP..IP + ipv6::LEN) else {
            self.c.bad_header.add(1);
            return;
        };
        if ip[0] >> 4 != 6 || IP + ipv6::LEN + ipv6::PAYLOAD_LEN.get(ip) as usize > d.len() {
            self.c.bad_header.add(1);
            return;
        }
        let dst = ipv6::addr(ip, ipv6::DST);
        let mine = self
            .ifaces
            .iter()
            .any(|i| i.addr6 == Some(dst) || i.ll6 == Some(dst));
        if mine || dst.is_multicast() {
            return self.local6(port, p, now, out);
        }
        // Link-local addresses stay on their link (RFC 4291 §2.5.6).
        let link_local = |a: Ipv6Addr| a.segments()[0] & 0xffc0 == 0xfe80;
        if link_local(dst) {
            self.c.scope_drops.add(1);
            return;
        }
        if link_local(ipv6::addr(ip, ipv6::SRC)) {
            self.c.scope_drops.add(1);
            if let Some(e) = self.icmp6_error(d, port, 1, 2, 0, now) {
                out.push(e);
            }
            return;
        }
        if ipv6::HOP_LIMIT.get(ip) <= 1 {
            self.c.ttl_exceeded.add(1);
            if let Some(e) = self.icmp6_error(d, port, 3, 0, 0, now) {
                out.push(e);
            }
            return;
        }
        let Some((h, r)) = self.fib.route6(dst, || flow_hash6(d)) else {
            self.c.no_route.add(1);
            if let Some(e) = self.icmp6_error(d, port, 1, 0, 0, now) {
                out.push(e);
            }
            return;
        };
        if r.port == super::DROP {
            self.c.blackholed.add(1);
            return;
        }
        if !self.ifaces[r.port].up {
            self.c.link_down.add(1);
            return;
        }
        let mtu = self.ifaces[r.port].mtu;
        if d.len() - 14 > mtu && p.header().gso_size == 0 {
            self.c.too_big.add(1);
            if let Some(e) = self.icmp6_error(d, port, 2, 0, mtu as u32, now) {
                out.push(e);
            }
            return;
        }
        let d = p.data_mut();
        let hops = &mut d[IP..];
        ipv6::HOP_LIMIT.set(hops, ipv6::HOP_LIMIT.get(hops) - 1); // no header checksum in IPv6
        d[6..12].copy_from_slice(&self.ifaces[r.port].mac);
        self.c.forwarded.add(1);
        self.send6(r.next_hop(dst, h), p, now, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::{Consumer, Producer};
    use stitch_core::{App, Io};
    use stitch_wire::be;

    const R_LAN: [u8; 6] = [2, 0, 0, 0, 1, 1];
    const HOST: [u8; 6] = [2, 0, 0, 0, 1, 2];

    struct Rig {
        r: Router,
        io: Io,
        lan_in: Producer,
        lan_out: Consumer,
        _wan: (Producer, Consumer),
    }

    fn rig() -> Rig {
        let r = crate::testing::build::<Router>(serde_json::json!({
            "interfaces": {
                "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24",
                         "address6": "2001:db8:1::1/64", "advertise": true },
                "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24",
                         "address6": "2001:db8:2::1/64" }
            }
        }));
        let (io, [lan_in, wan_in], [lan_out, wan_out]) = crate::testing::ports(["lan", "wan"]);
        Rig {
            r,
            io,
            lan_in,
            lan_out,
            _wan: (wan_in, wan_out),
        }
    }

    fn ll() -> Ipv6Addr {
        "fe80::ff:fe00:101".parse().unwrap()
    }

    fn host_ll() -> Ipv6Addr {
        "fe80::ff:fe00:102".parse().unwrap()
    }

    /// An IPv6 frame from HOST: `headers` (extension headers, their next-header bytes already
    /// chained) and then an ICMPv6 `body` (checksum filled) or raw payload.
    fn frame(
        src: Ipv6Addr,
        dst: Ipv6Addr,
        hops: u8,
        first: u8,
        headers: &[u8],
        body: &[u8],
        icmp: bool,
    ) -> Packet {
        let mut body = body.to_vec();
        if icmp {
            body[2..4].copy_from_slice(&[0, 0]);
            let cs = icmp6_checksum(&src.octets(), &dst.octets(), &body);
            icmp::CHECKSUM.set(&mut body, cs);
        }
        let mut f = Vec::new();
        let dmac = if dst.is_multicast() {
            multicast_mac(dst)
        } else {
            R_LAN
        };
        f.extend_from_slice(&dmac);
        f.extend_from_slice(&HOST);
        f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
        f.put((headers.len() + body.len()) as u16);
        f.push(first);
        f.push(hops);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.extend_from_slice(headers);
        f.extend_from_slice(&body);
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        p
    }

    fn run(r: &mut Rig) -> Vec<Vec<u8>> {
        r.r.push(&mut r.io);
        r.lan_out.drain().map(|p| p.data().to_vec()).collect()
    }

    fn icmp_ok(f: &[u8]) -> bool {
        let plen = ipv6::PAYLOAD_LEN.get(&f[IP..]) as usize;
        icmp6_checksum(&f[22..38], &f[38..54], &f[54..54 + plen]) == 0
    }

    #[test]
    fn advertises_its_prefix_at_start_and_to_a_soliciting_host() {
        let mut r = rig();
        let due = r.r.due_advertisements(Instant::now());
        assert_eq!(due.len(), 1, "only the advertising interface");
        let (port, ra) = &due[0];
        let d = ra.data();
        assert_eq!(*port, 0);
        assert_eq!(&d[0..6], &[0x33, 0x33, 0, 0, 0, 1]);
        assert_eq!((d[21], addr(d, 22), addr(d, 38)), (255, ll(), ALL_NODES));
        assert!(icmp_ok(d));
        let ra = &d[54..];
        assert_eq!((ra[0], ra[4]), (134, 64));
        assert_eq!(be::get::<u16>(ra, 6), 600, "3 × ra_interval");
        // Options: source link-layer address, MTU, prefix (on-link + autonomous).
        assert_eq!(&ra[16..24], &[1, 1, 2, 0, 0, 0, 1, 1]);
        assert_eq!(&ra[24..32], &[5, 1, 0, 0, 0, 0, 0x05, 0xdc]);
        assert_eq!(&ra[32..36], &[3, 4, 64, 0xc0]);
        assert_eq!(addr(ra, 48), "2001:db8:1::".parse::<Ipv6Addr>().unwrap());
        // Not again until the next interval (at most 16 s for the first ones).
        assert!(r.r.due_advertisements(Instant::now()).is_empty());
        // A solicitation with the host's link-layer address: answered to it directly.
        let mut rs = vec![133, 0, 0, 0, 0, 0, 0, 0, 1, 1];
        rs.extend_from_slice(&HOST);
        let all_routers = "ff02::2".parse().unwrap();
        r.lan_in
            .transmit(frame(host_ll(), all_routers, 255, ICMPV6, &[], &rs, true));
        let out = run(&mut r);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (&out[0][0..6], addr(&out[0], 38), out[0][54]),
            (&HOST[..], host_ll(), 134)
        );
        // One from an unspecified source: a multicast advertisement is brought forward.
        r.lan_in.transmit(frame(
            Ipv6Addr::UNSPECIFIED,
            all_routers,
            255,
            ICMPV6,
            &[],
            &rs[..8],
            true,
        ));
        assert!(run(&mut r).is_empty());
        let later = Instant::now() + MIN_DELAY_BETWEEN_RAS;
        assert_eq!(r.r.due_advertisements(later).len(), 1);
        // Solicitations that did not come from the link itself are refused.
        r.lan_in
            .transmit(frame(host_ll(), all_routers, 64, ICMPV6, &[], &rs, true));
        assert!(run(&mut r).is_empty());
    }

    #[test]
    fn answers_for_its_link_local_address_behind_extension_headers() {
        let mut r = rig();
        // Neighbor solicitation for the link-local address.
        let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
        ns.extend_from_slice(&ll().octets());
        ns.extend_from_slice(&[1, 1]);
        ns.extend_from_slice(&HOST);
        r.lan_in.transmit(frame(
            host_ll(),
            solicited_node(ll()),
            255,
            ICMPV6,
            &[],
            &ns,
            true,
        ));
        let out = run(&mut r);
        assert_eq!(out.len(), 1);
        let na = &out[0];
        assert!(icmp_ok(na));
        assert_eq!(
            (na[54], na[58] & 0xe0, addr(na, 22), addr(na, 62)),
            (136, 0xe0, ll(), ll())
        );
        // Echo request behind a hop-by-hop and a destination options header (PadN).
        let hbh = [60, 0, 1, 4, 0, 0, 0, 0];
        let dst_opts = [ICMPV6, 0, 1, 4, 0, 0, 0, 0];
        let mut ext = hbh.to_vec();
        ext.extend_from_slice(&dst_opts);
        let echo = [128, 0, 0, 0, 0x12, 0x34, 0, 1, b'h', b'i'];
        r.lan_in
            .transmit(frame(host_ll(), ll(), 64, 0, &ext, &echo, false));
        // (The ICMPv6 checksum covers only the ICMPv6 message: fill it by hand.)
        let out = run(&mut r);
        assert!(out.is_empty(), "bad checksum: dropped");
        let mut body = echo.to_vec();
        let cs = icmp6_checksum(&host_ll().octets(), &ll().octets(), &body);
        icmp::CHECKSUM.set(&mut body, cs);
        r.lan_in
            .transmit(frame(host_ll(), ll(), 64, 0, &ext, &body, false));
        let out = run(&mut r);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0][54], addr(&out[0], 22), &out[0][58..64]),
            (129, ll(), &[0x12, 0x34, 0, 1, b'h', b'i'][..])
        );
        assert!(icmp_ok(&out[0]));
        // A routing header with segments left: parameter problem pointing at its type field.
        let me: Ipv6Addr = "2001:db8:1::1".parse().unwrap();
        let src: Ipv6Addr = "2001:db8:1::2".parse().unwrap();
        let mut rh = vec![ICMPV6, 2, 0, 1, 0, 0, 0, 0];
        rh.extend_from_slice(&[0; 16]);
        r.lan_in.transmit(frame(src, me, 64, 43, &rh, &body, false));
        let out = run(&mut r);
        assert_eq!(out.len(), 1);
        let pp = &out[0];
        assert_eq!((pp[54], pp[55]), (4, 0));
        assert_eq!(icmp::REST.get(&pp[54..]), 42, "40 + 2");
        // Multicast listener reports are not the router's business: ignored, no answer.
        let report = [143, 0, 0, 0, 0, 0, 0, 0];
        let mld: Ipv6Addr = "ff02::16".parse().unwrap();
        r.lan_in.transmit(frame(
            host_ll(),
            mld,
            1,
            0,
            &[ICMPV6, 0, 5, 2, 0, 0, 1, 0],
            &report,
            false,
        ));
        assert!(run(&mut r).is_empty());
    }

    #[test]
    fn link_local_sources_are_not_forwarded() {
        let mut r = rig();
        let far: Ipv6Addr = "2001:db8:2::7".parse().unwrap();
        let udp = [0u8; 16];
        r.lan_in
            .transmit(frame(host_ll(), far, 64, 17, &[], &udp, false));
        let out = run(&mut r);
        assert_eq!(out.len(), 1, "destination unreachable back to the host");
        assert_eq!(
            (out[0][54], out[0][55]),
            (1, 2),
            "beyond scope of source address"
        );
        assert_eq!(r.r.c.scope_drops.get(), 1);
    }
}
