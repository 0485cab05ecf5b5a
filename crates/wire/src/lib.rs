//! Protocol knowledge shared by Stitch's apps and drivers, kept out of the engine core:
//! Internet checksums, offload handling (virtio-net header, checksum completion, GSO
//! segmentation), VLAN tags, flows, and typed zero-copy header views.
//!
//! The header views are smoltcp's `wire` types, re-exported as [`views`]: each is a view over
//! the packet's own bytes, checked once by `new_checked`, with accessors and in-place setters —
//! parsing never copies. VLAN tags (not in smoltcp) are in [`vlan`].

pub mod arp;
pub mod be;
pub mod build;
pub mod checksum;
pub mod filter;
pub mod flow;
pub mod header;
pub mod icmp;
pub mod ndp;
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
