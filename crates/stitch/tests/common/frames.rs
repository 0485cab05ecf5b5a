//! Frames built byte by byte for PCAP-in → PCAP-out tests: Ethernet (with an optional VLAN
//! tag), IPv4 and IPv6, UDP, TCP, ICMP and ICMPv6 with their checksums, and PCAP files of them.
#![allow(dead_code)]

use pcap_file::pcap::{PcapPacket, PcapWriter};
use std::path::Path;
use std::time::Duration;

pub fn v4(s: &str) -> [u8; 4] {
    s.parse::<std::net::Ipv4Addr>().unwrap().octets()
}

pub fn v6(s: &str) -> [u8; 16] {
    s.parse::<std::net::Ipv6Addr>().unwrap().octets()
}

pub struct Ip4 {
    pub src: &'static str,
    pub dst: &'static str,
    pub proto: u8,
    pub ttl: u8,
    pub tos: u8,
    pub flags_frag: u16,
}

pub fn ip4(h: Ip4, l4: &[u8]) -> Vec<u8> {
    let mut ip = vec![0x45, h.tos];
    ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x12, 0x34]);
    ip.extend_from_slice(&h.flags_frag.to_be_bytes());
    ip.extend_from_slice(&[h.ttl, h.proto, 0, 0]);
    ip.extend_from_slice(&v4(h.src));
    ip.extend_from_slice(&v4(h.dst));
    let c = stitch_wire::checksum::checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend_from_slice(l4);
    ip
}

pub fn plain(src: &'static str, dst: &'static str, proto: u8) -> Ip4 {
    Ip4 {
        src,
        dst,
        proto,
        ttl: 64,
        tos: 0,
        flags_frag: 0,
    }
}

pub fn udp(sport: u16, dport: u16, payload: usize) -> Vec<u8> {
    let mut u = sport.to_be_bytes().to_vec();
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&((8 + payload) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.resize(8 + payload, 0xab);
    u
}

pub fn tcp(sport: u16, dport: u16) -> Vec<u8> {
    let mut t = sport.to_be_bytes().to_vec();
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    t
}

pub fn icmp(kind: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0];
    m.extend_from_slice(&rest);
    m.extend_from_slice(body);
    let c = stitch_wire::checksum::checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

pub fn eth(dst: [u8; 6], src: [u8; 6], et: u16, vlan: Option<u16>, payload: &[u8]) -> Vec<u8> {
    let mut f = dst.to_vec();
    f.extend_from_slice(&src);
    if let Some(v) = vlan {
        f.extend_from_slice(&[0x81, 0x00]);
        f.extend_from_slice(&v.to_be_bytes());
    }
    f.extend_from_slice(&et.to_be_bytes());
    f.extend_from_slice(payload);
    if f.len() < 60 {
        f.resize(60, 0);
    }
    f
}

pub fn ip6(src: &str, dst: &str, nh: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    h.extend_from_slice(&[nh, 64]);
    h.extend_from_slice(&v6(src));
    h.extend_from_slice(&v6(dst));
    h.extend_from_slice(payload);
    h
}

pub fn icmp6(src: &str, dst: &str, body: &[u8]) -> Vec<u8> {
    let mut b = body.to_vec();
    let mut pseudo = v6(src).to_vec();
    pseudo.extend_from_slice(&v6(dst));
    pseudo.extend_from_slice(&(b.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 58]);
    pseudo.extend_from_slice(&b);
    let c = stitch_wire::checksum::checksum(&pseudo);
    b[2..4].copy_from_slice(&c.to_be_bytes());
    ip6(src, dst, 58, &b)
}

pub fn write(path: &Path, frames: &[Vec<u8>]) {
    write_timed(
        path,
        &frames
            .iter()
            .map(|f| (Duration::ZERO, f.clone()))
            .collect::<Vec<_>>(),
    );
}

/// A PCAP file of `frames`, each with its timestamp (for `pcap_source` with `pace: true`).
pub fn write_timed(path: &Path, frames: &[(Duration, Vec<u8>)]) {
    let mut w = PcapWriter::new(std::fs::File::create(path).unwrap()).unwrap();
    for (t, f) in frames {
        w.write_packet(&PcapPacket::new(*t, f.len() as u32, f))
            .unwrap();
    }
}

/// An IPv4 packet (see [`ip4`]) whose TCP or UDP checksum is filled in.
pub fn ip4_checksummed(h: Ip4, l4: &[u8]) -> Vec<u8> {
    let mut l4 = l4.to_vec();
    let at = match h.proto {
        6 => 16,
        17 => 6,
        _ => return ip4(h, &l4),
    };
    l4[at..at + 2].copy_from_slice(&[0, 0]);
    let mut acc = stitch_wire::checksum::sum(&v4(h.src), 0);
    acc = stitch_wire::checksum::sum(&v4(h.dst), acc) + h.proto as u64 + l4.len() as u64;
    let mut c = stitch_wire::checksum::finish(stitch_wire::checksum::sum(&l4, acc));
    if c == 0 && h.proto == 17 {
        c = 0xffff;
    }
    l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
    ip4(h, &l4)
}
