//! Protocol knowledge shared by Stitch's apps and drivers, kept out of the engine core:
//! Internet checksums, offload handling (virtio-net header, checksum completion, GSO
//! segmentation), VLAN tags, flows, and typed zero-copy header views.
//!
//! The header views are smoltcp's `wire` types, re-exported as [`views`]: each is a view over
//! the packet's own bytes, checked once by `new_checked`, with accessors and in-place setters —
//! parsing never copies. VLAN tags (not in smoltcp) are in [`vlan`].

pub mod be;
pub mod build;
pub mod checksum;
pub mod filter;
pub mod flow;
pub mod header;
pub mod icmp;
pub mod ndp;
pub mod offload;
pub mod vlan;

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
    proto: u8,
    payload_len: usize,
    dont_fragment: bool,
) -> [u8; 20] {
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + payload_len) as u16).to_be_bytes());
    if dont_fragment {
        ip[6] = 0x40;
    }
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let cs = checksum::checksum(&ip);
    ip[10..12].copy_from_slice(&cs.to_be_bytes());
    ip
}

/// An ARP message for Ethernet and IPv4 (RFC 826): `op` 1 request, 2 reply.
pub fn arp_payload(
    op: u16,
    sender_mac: [u8; 6],
    sender_ip: std::net::Ipv4Addr,
    target_mac: [u8; 6],
    target_ip: std::net::Ipv4Addr,
) -> [u8; 28] {
    let mut a = [0u8; 28];
    a[0..6].copy_from_slice(&[0, 1, 0x08, 0x00, 6, 4]);
    a[6..8].copy_from_slice(&op.to_be_bytes());
    a[8..14].copy_from_slice(&sender_mac);
    a[14..18].copy_from_slice(&sender_ip.octets());
    a[18..24].copy_from_slice(&target_mac);
    a[24..28].copy_from_slice(&target_ip.octets());
    a
}

/// An Ethernet frame from `eth_src` to `eth_dst` carrying an ARP message (`op` 1 request, 2
/// reply) from `sender` about `target` (MAC and address each), padded to the Ethernet minimum.
pub fn arp_frame(
    eth_dst: [u8; 6],
    eth_src: [u8; 6],
    op: u16,
    sender: ([u8; 6], std::net::Ipv4Addr),
    target: ([u8; 6], std::net::Ipv4Addr),
) -> [u8; 60] {
    let mut f = [0u8; 60];
    f[0..6].copy_from_slice(&eth_dst);
    f[6..12].copy_from_slice(&eth_src);
    f[12..14].copy_from_slice(&[0x08, 0x06]);
    f[14..42].copy_from_slice(&arp_payload(op, sender.0, sender.1, target.0, target.1));
    f
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
