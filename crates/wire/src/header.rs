//! Named fields of the headers smoltcp's views leave out or read through a checked
//! constructor, and rewrites that keep checksums right incrementally (RFC 1624).
//!
//! A field is a place in a header, `Field16(offset)`: read and written where it lies, after
//! the one length check the caller makes for the whole header (as smoltcp's `new_unchecked`
//! views are used). Functions name what they touch — `l4::SRC_PORT`, `tcp::CHECKSUM`,
//! `icmp::ECHO_IDENT` — and no byte offset or byte order is spelled outside this crate.

use crate::views::Ipv4Packet;
use crate::{be, checksum};
use std::net::Ipv4Addr;

/// A 16-bit big-endian field at an offset of its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field16(pub usize);

impl Field16 {
    #[inline]
    pub fn get(self, header: &[u8]) -> u16 {
        be::get(header, self.0)
    }

    #[inline]
    pub fn set(self, header: &mut [u8], value: u16) {
        be::set(header, self.0, value);
    }

    /// The field, or `None` where `header` is cut short of it.
    #[inline]
    pub fn try_get(self, header: &[u8]) -> Option<u16> {
        be::try_get(header, self.0)
    }

    /// Writes `value` and returns what the field held.
    #[inline]
    pub fn replace(self, header: &mut [u8], value: u16) -> u16 {
        let old = self.get(header);
        self.set(header, value);
        old
    }

    /// The field's end: a header shorter than this does not hold it.
    pub const fn end(self) -> usize {
        self.0 + 2
    }
}

/// A 32-bit big-endian field at an offset of its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field32(pub usize);

impl Field32 {
    #[inline]
    pub fn get(self, header: &[u8]) -> u32 {
        be::get(header, self.0)
    }

    #[inline]
    pub fn set(self, header: &mut [u8], value: u32) {
        be::set(header, self.0, value);
    }

    pub const fn end(self) -> usize {
        self.0 + 4
    }
}

/// Fields at the head of every transport header with ports (TCP, UDP, SCTP).
pub mod l4 {
    use super::Field16;
    pub const SRC_PORT: Field16 = Field16(0);
    pub const DST_PORT: Field16 = Field16(2);
}

pub mod tcp {
    use super::{Field16, Field32};
    pub const SEQ: Field32 = Field32(4);
    pub const ACK: Field32 = Field32(8);
    pub const WINDOW: Field16 = Field16(14);
    pub const CHECKSUM: Field16 = Field16(16);
}

pub mod udp {
    use super::Field16;
    pub const LEN: Field16 = Field16(4);
    pub const CHECKSUM: Field16 = Field16(6);
}

pub mod icmp {
    use super::Field16;
    pub const CHECKSUM: Field16 = Field16(2);
    /// An echo request's or reply's identifier (the "port" of a NAT's ICMP mapping).
    pub const ECHO_IDENT: Field16 = Field16(4);
    pub const ECHO_SEQ: Field16 = Field16(6);
    /// "Fragmentation needed"'s next-hop MTU (RFC 1191).
    pub const NEXT_HOP_MTU: Field16 = Field16(6);
}

/// The VXLAN header (RFC 7348 §5): flags, reserved bits and a 24-bit VNI.
pub mod vxlan {
    pub const LEN: usize = 8;
    /// The I flag: the VNI is valid.
    const VNI_VALID: u8 = 0x08;

    /// The header's VNI, or `None` when its I flag is clear.
    pub fn vni(h: &[u8]) -> Option<u32> {
        (h[0] & VNI_VALID != 0).then(|| u32::from_be_bytes([0, h[4], h[5], h[6]]))
    }

    /// Writes a header for `vni` (its low 24 bits) into the first [`LEN`] bytes of `h`.
    pub fn write(h: &mut [u8], vni: u32) {
        let [_, a, b, c] = vni.to_be_bytes();
        h[..LEN].copy_from_slice(&[VNI_VALID, 0, 0, 0, a, b, c, 0]);
    }
}

pub mod ethernet {
    use super::Field16;
    pub const ETHERTYPE: Field16 = Field16(12);
}

/// The checksum field of an IPv4 packet's transport header (ICMP's covers no addresses).
pub fn l4_checksum(proto: u8) -> Field16 {
    match proto {
        6 => tcp::CHECKSUM,
        17 => udp::CHECKSUM,
        _ => icmp::CHECKSUM,
    }
}

/// Which end of a packet a rewrite changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Source,
    Destination,
}

/// Sets the address at `end` of an IPv4 header, updating its checksum; returns the old one.
pub fn set_ipv4_addr<T: AsRef<[u8]> + AsMut<[u8]>>(
    ip: &mut Ipv4Packet<T>,
    end: End,
    addr: Ipv4Addr,
) -> Ipv4Addr {
    let old = match end {
        End::Source => ip.src_addr(),
        End::Destination => ip.dst_addr(),
    };
    match end {
        End::Source => ip.set_src_addr(addr),
        End::Destination => ip.set_dst_addr(addr),
    }
    let cs = checksum::update32(ip.checksum(), old.into(), addr.into());
    ip.set_checksum(cs);
    old
}

/// How a transport checksum field is to be kept right after its packet changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4Sum {
    /// A full checksum (zero in a UDP header: none, left so).
    Full,
    /// The pseudo-header's sum of a packet whose checksum the NIC completes (checksum
    /// offload): only the addresses are part of it.
    Partial,
}

/// Rewrites the address at `end` of an IPv4 packet and `port` (a port, or ICMP echo's
/// identifier) of its transport header `l4`, keeping the IPv4 and transport checksums right:
/// a NAT's one step.
pub fn rewrite_ipv4_endpoint<T: AsRef<[u8]> + AsMut<[u8]>>(
    ip: &mut Ipv4Packet<T>,
    l4: &mut [u8],
    end: End,
    (addr, port_field, port): (Ipv4Addr, Field16, u16),
    sum: L4Sum,
) {
    let proto = u8::from(ip.next_header());
    let old_addr = set_ipv4_addr(ip, end, addr);
    let old_port = port_field.replace(l4, port);
    let field = l4_checksum(proto);
    let cs = field.get(l4);
    let (old_addr, new_addr) = (u32::from(old_addr), u32::from(addr));
    let cs = match sum {
        L4Sum::Full if proto == 17 && cs == 0 => return,
        L4Sum::Partial => !checksum::update32(!cs, old_addr, new_addr),
        L4Sum::Full => {
            let mut cs = cs;
            if proto != 1 {
                cs = checksum::update32(cs, old_addr, new_addr);
            }
            match checksum::update(cs, old_port, port) {
                0 if proto == 17 => 0xffff,
                cs => cs,
            }
        }
    };
    field.set(l4, cs);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::build::{Frame, Transport};

    fn sums_ok(f: &[u8]) -> bool {
        let ip = Ipv4Packet::new_unchecked(&f[14..]);
        let l4 = &f[34..14 + ip.total_len() as usize];
        let pseudo = match u8::from(ip.next_header()) {
            1 => 0,
            p => checksum::sum(&f[26..34], 0) + p as u64 + l4.len() as u64,
        };
        ip.verify_checksum() && checksum::finish(checksum::sum(l4, pseudo)) == 0
    }

    #[test]
    fn an_endpoint_rewrite_keeps_every_checksum_right() {
        for transport in [
            Transport::udp(5000, 53),
            Transport::tcp(40000, 443),
            Transport::echo_request(77, 1),
        ] {
            let port = if matches!(transport, Transport::IcmpEcho { .. }) {
                icmp::ECHO_IDENT
            } else {
                l4::SRC_PORT
            };
            let mut f = Frame::ipv4([10, 0, 0, 1], [192, 0, 2, 9], transport)
                .payload(&[1, 2, 3, 4, 5])
                .bytes();
            assert!(sums_ok(&f));
            let (ip, l4) = f[14..].split_at_mut(20);
            let mut ip = Ipv4Packet::new_unchecked(ip);
            let new = (Ipv4Addr::new(203, 0, 113, 5), port, 1024);
            rewrite_ipv4_endpoint(&mut ip, l4, End::Source, new, L4Sum::Full);
            assert_eq!(ip.src_addr(), new.0);
            assert_eq!(port.get(l4), 1024);
            assert!(sums_ok(&f), "{transport:?}");
        }
    }

    #[test]
    fn a_udp_packet_without_checksum_keeps_none() {
        let mut f = Frame::ipv4([10, 0, 0, 1], [192, 0, 2, 9], Transport::udp(1, 2)).bytes();
        udp::CHECKSUM.set(&mut f[34..], 0);
        let (ip, l4) = f[14..].split_at_mut(20);
        let new = (Ipv4Addr::new(203, 0, 113, 5), l4::SRC_PORT, 9);
        let mut ip = Ipv4Packet::new_unchecked(ip);
        rewrite_ipv4_endpoint(&mut ip, l4, End::Source, new, L4Sum::Full);
        assert_eq!(udp::CHECKSUM.get(l4), 0);
        assert!(ip.verify_checksum());
    }
}
