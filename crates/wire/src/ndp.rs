//! ICMPv6 and Neighbor Discovery (RFC 4443, RFC 4861) pieces shared by the router and the
//! lwAFTR: the ICMPv6 checksum, solicited-node multicast addresses and the link-layer address
//! option of solicitations and advertisements.

use crate::checksum;
use std::net::Ipv6Addr;

/// IPv6 next header of ICMPv6.
pub const ICMPV6: u8 = crate::ip_proto::ICMPV6;

/// The ICMPv6 checksum over the pseudo-header of `src` → `dst` (16 bytes each) and `body`.
/// With the body's checksum field zero it is the value to store; over a received message it is
/// 0 when the message is intact.
pub fn icmp6_checksum(src: &[u8], dst: &[u8], body: &[u8]) -> u16 {
    let s = checksum::sum(src, checksum::sum(dst, 0)) + body.len() as u64 + ICMPV6 as u64;
    checksum::finish(checksum::sum(body, s))
}

/// The solicited-node multicast address of `a` (ff02::1:ffXX:XXXX).
pub fn solicited_node(a: Ipv6Addr) -> Ipv6Addr {
    let o = a.octets();
    Ipv6Addr::new(
        0xff02,
        0,
        0,
        0,
        0,
        1,
        0xff00 | o[13] as u16,
        u16::from_be_bytes([o[14], o[15]]),
    )
}

/// The Ethernet multicast address of IPv6 multicast address `a` (33:33:…).
pub fn multicast_mac(a: Ipv6Addr) -> [u8; 6] {
    let o = a.octets();
    [0x33, 0x33, o[12], o[13], o[14], o[15]]
}

/// The source or target link-layer address option among NS/NA `opts`, if present.
pub fn lladdr_option(opts: &[u8]) -> Option<[u8; 6]> {
    let mut at = 0;
    while at + 8 <= opts.len() {
        let (kind, len) = (opts[at], opts[at + 1] as usize * 8);
        if len == 0 {
            return None;
        }
        if (kind == 1 || kind == 2) && len >= 8 {
            return opts[at + 2..at + 8].try_into().ok();
        }
        at += len;
    }
    None
}

/// The link-local address an interface forms from its MAC address (modified EUI-64, RFC 4291
/// §2.5.6 and appendix A): fe80::, the MAC with the universal/local bit flipped and ff:fe in
/// the middle.
pub fn link_local(mac: [u8; 6]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    o[0] = 0xfe;
    o[1] = 0x80;
    o[8] = mac[0] ^ 0x02;
    o[9] = mac[1];
    o[10] = mac[2];
    o[11] = 0xff;
    o[12] = 0xfe;
    o[13] = mac[3];
    o[14] = mac[4];
    o[15] = mac[5];
    Ipv6Addr::from(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_is_modified_eui64() {
        assert_eq!(
            link_local([0x02, 0, 0, 0, 1, 1]),
            "fe80::ff:fe00:101".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(
            link_local([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]),
            "fe80::5054:ff:fe12:3456".parse::<Ipv6Addr>().unwrap()
        );
    }
}
