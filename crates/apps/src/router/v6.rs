//! The IPv6 half of the router: forwarding with hop limits, Neighbor Discovery (RFC 4861:
//! answering solicitations for the router's addresses, resolving next hops through
//! solicited-node multicast), ICMPv6 errors (RFC 4443: time exceeded, unreachable, packet too
//! big; rate-limited with the IPv4 ones) and echo replies.

use super::Router;
use std::net::Ipv6Addr;
use std::time::Instant;
use stitch_core::{pool, Packet};
use stitch_wire::ndp::{icmp6_checksum, lladdr_option, multicast_mac, solicited_node, ICMPV6};

fn addr(d: &[u8], at: usize) -> Ipv6Addr {
    Ipv6Addr::from(<[u8; 16]>::try_from(&d[at..at + 16]).unwrap())
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
        body[2..4].copy_from_slice(&[0, 0]);
        let cs = icmp6_checksum(&src.octets(), &dst.octets(), &body);
        body[2..4].copy_from_slice(&cs.to_be_bytes());
        let mut f = Vec::with_capacity(54 + body.len());
        f.extend_from_slice(&dst_mac);
        f.extend_from_slice(&self.ifaces[port].mac);
        f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
        f.extend_from_slice(&(body.len() as u16).to_be_bytes());
        f.push(ICMPV6);
        f.push(255);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.extend_from_slice(&body);
        let mut p = pool::alloc()?;
        p.set_data(&f).ok()?;
        Some(p)
    }

    fn neighbor_solicitation(&self, port: usize, target: Ipv6Addr) -> Option<Packet> {
        let src = self.ifaces[port].addr6?;
        let mut body = vec![135, 0, 0, 0, 0, 0, 0, 0];
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
        if d[20] == ICMPV6 && d.get(54).is_some_and(|t| *t < 128) {
            return None;
        }
        if !self.icmp_allowed(now) {
            return None;
        }
        let mut body = vec![kind, code, 0, 0];
        body.extend_from_slice(&extra.to_be_bytes());
        body.extend_from_slice(&d[14..d.len().min(14 + 1280 - 48)]);
        let to = addr(d, 22);
        let p = self.icmp6_frame(port, d[6..12].try_into().unwrap(), src, to, body)?;
        self.c.icmp_sent.add(1);
        Some((port, p))
    }

    /// Sends `p` toward IPv6 next hop `hop` on `port`, soliciting it if unknown.
    fn send6(
        &mut self,
        port: usize,
        hop: Ipv6Addr,
        p: Packet,
        now: Instant,
        out: &mut Vec<(usize, Packet)>,
    ) {
        if self.neighbors6.send(
            port,
            hop,
            p,
            now,
            self.arp_timeout,
            out,
            &self.c.arp_queue_drops,
        ) {
            if let Some(q) = self.neighbor_solicitation(port, hop) {
                self.c.arp_requests.add(1);
                out.push((port, q));
            }
        }
    }

    /// ICMPv6 addressed to the router: NDP and echo.
    fn local6(&mut self, port: usize, p: Packet, now: Instant, out: &mut Vec<(usize, Packet)>) {
        let d = p.data();
        if d[20] != ICMPV6 || d.len() < 62 {
            self.c.local_drops.add(1);
            return;
        }
        let plen = u16::from_be_bytes([d[18], d[19]]) as usize;
        let body = &d[54..(54 + plen).min(d.len())];
        let (src, dst) = (addr(d, 22), addr(d, 38));
        if icmp6_checksum(&src.octets(), &dst.octets(), body) != 0 {
            self.c.bad_header.add(1);
            return;
        }
        let Some(me) = self.ifaces[port].addr6 else {
            return;
        };
        match body[0] {
            // Neighbor solicitation for one of our addresses: advertise, and learn the asker.
            135 if body.len() >= 24 && addr(body, 8) == me => {
                if let Some(mac) = lladdr_option(&body[24..]) {
                    if !src.is_unspecified() {
                        self.neighbors6
                            .learn(port, src, mac, now, self.arp_timeout, out);
                    }
                }
                let mut na = vec![136, 0, 0, 0, 0x60, 0, 0, 0]; // solicited + override
                na.extend_from_slice(&me.octets());
                na.extend_from_slice(&[2, 1]);
                na.extend_from_slice(&self.ifaces[port].mac);
                let to = if src.is_unspecified() {
                    Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1)
                } else {
                    src
                };
                let mac = if src.is_unspecified() {
                    multicast_mac(to)
                } else {
                    d[6..12].try_into().unwrap()
                };
                if let Some(r) = self.icmp6_frame(port, mac, me, to, na) {
                    self.c.arp_replies.add(1);
                    out.push((port, r));
                }
            }
            // Neighbor advertisement: learn it.
            136 if body.len() >= 24 => {
                let target = addr(body, 8);
                if let Some(mac) = lladdr_option(&body[24..]).or_else(|| d[6..12].try_into().ok()) {
                    self.neighbors6
                        .learn(port, target, mac, now, self.arp_timeout, out);
                }
            }
            128 if dst == me => {
                let mut reply = body.to_vec();
                reply[0] = 129;
                let mac = d[6..12].try_into().unwrap();
                if let Some(r) = self.icmp6_frame(port, mac, me, src, reply) {
                    self.c.echo_replies.add(1);
                    out.push((port, r));
                }
            }
            _ => self.c.local_drops.add(1),
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
        if d.len() < 54
            || d[14] >> 4 != 6
            || 54 + u16::from_be_bytes([d[18], d[19]]) as usize > d.len()
        {
            self.c.bad_header.add(1);
            return;
        }
        let dst = addr(d, 38);
        let mine = self.ifaces.iter().any(|i| i.addr6 == Some(dst));
        if mine || dst.is_multicast() {
            return self.local6(port, p, now, out);
        }
        if d[21] <= 1 {
            self.c.ttl_exceeded.add(1);
            if let Some(e) = self.icmp6_error(d, port, 3, 0, 0, now) {
                out.push(e);
            }
            return;
        }
        let Some(r) = self
            .routes6
            .get_lpm(&ipnet::Ipv6Net::from(dst))
            .map(|(_, r)| *r)
        else {
            self.c.no_route.add(1);
            if let Some(e) = self.icmp6_error(d, port, 1, 0, 0, now) {
                out.push(e);
            }
            return;
        };
        let mtu = self.ifaces[r.port].mtu;
        if d.len() - 14 > mtu && p.header().gso_size == 0 {
            self.c.too_big.add(1);
            if let Some(e) = self.icmp6_error(d, port, 2, 0, mtu as u32, now) {
                out.push(e);
            }
            return;
        }
        let d = p.data_mut();
        d[21] -= 1; // no header checksum in IPv6
        d[6..12].copy_from_slice(&self.ifaces[r.port].mac);
        self.c.forwarded.add(1);
        self.send6(r.port, r.via.unwrap_or(dst), p, now, out);
    }
}
