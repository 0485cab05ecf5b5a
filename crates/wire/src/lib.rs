//! Protocol knowledge shared by Stitch's apps and drivers, kept out of the engine core:
//! Internet checksums, offload handling (virtio-net header, checksum completion, GSO
//! segmentation), VLAN tags, flows, and typed zero-copy header views.
//!
//! The header views are smoltcp's `wire` types, re-exported as [`views`]: each is a view over
//! the packet's own bytes, checked once by `new_checked`, with accessors and in-place setters —
//! parsing never copies. VLAN tags (not in smoltcp) are in [`vlan`].
//!
//! # Map
//!
//! The modules, in short: protocol knowledge shared by apps and drivers — the numbers protocols are
//! told apart by, named once (`numbers`: `ethertype`, `ip_proto`, `icmpv4`, `icmpv6`;
//! `scripts/wire-names` keeps literals out of the other crates), one way to read and write a
//! header: zero-copy header views (smoltcp's `wire` types), named fields read where they lie after
//! one length check (`header`: `ipv4` — lengths, fragment flags, TTL decrement, header builder —,
//! `ipv6` and its fragment header, `arp`, `nd`, `ethernet`, `l4::SRC_PORT`, `tcp::CHECKSUM`,
//! `icmp::ECHO_IDENT`, `vxlan`; an IPv4 endpoint rewrite with incremental checksums), ARP messages
//! read and written through smoltcp's view (`arp`), integers in network byte order (`be`: at an
//! offset, or appended to an OpenFlow message), frames built from their fields (`build::Frame`:
//! generator templates, answers, tests), VLAN tags, flows (5-tuple), libpcap filter expressions run
//! on frames as machine code (`filter`: libpcap compiles, `filter::cbpf` checks the classic BPF
//! program and keeps libpcap's interpreter as the reference, `filter::native` emits it as x86-64
//! code looping over a batch of packets, `filter::ebpf` translates it to eBPF for XDP, every frame
//! load checked for the kernel's verifier), Internet checksum with RFC 1624 updates, offloads
//! (virtio-net header, completing partial checksums, GSO segmentation), the kernel's routing
//! messages read (`netlink`: routes, nexthop objects, links, dump requests).

pub mod arp;
pub mod be;
pub mod build;
pub mod checksum;
pub mod filter;
pub mod flow;
pub mod header;
pub mod icmp;
pub mod ndp;
pub mod netlink;
mod numbers;
pub mod offload;
pub mod vlan;

pub use numbers::{ethertype, icmpv4, icmpv6, ip_proto};

/// Typed zero-copy views of headers: `EthernetFrame`, `ArpPacket`, `Ipv4Packet`, `Ipv6Packet`,
/// `Icmpv4Packet`, `Icmpv6Packet`, `UdpPacket`, `TcpPacket`, ...
pub mod views {
    pub use smoltcp::wire::*;
}

/// A 20-byte IPv4 header (no options, TTL 64, id 0) with its checksum filled, for a packet
/// carrying `payload_len` bytes of protocol `proto`.
pub fn ipv4_header(
    src: std::net::Ipv4Addr,
    dst: std::net::Ipv4Addr,
    protocol: u8,
    payload_len: usize,
    dont_fragment: bool,
) -> [u8; 20] {
    let mut ip = [0u8; 20];
    header::ipv4::Header {
        src,
        dst,
        protocol,
        payload_len,
        ttl: 64,
        dont_fragment,
    }
    .write(&mut ip);
    ip
}

/// Parses a MAC address written `02:00:00:00:00:01`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let bad = || format!("`{s}` is not a MAC address like 02:00:00:00:00:01");
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut m = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        m[i] = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(m)
}
