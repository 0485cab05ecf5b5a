//! Named fields of the headers smoltcp's views leave out or read through a checked
//! constructor, and rewrites that keep checksums right incrementally (RFC 1624).
//!
//! A field is a place in a header, `Field16(offset)`: read and written where it lies, after
//! the one length check the caller makes for the whole header (as smoltcp's `new_unchecked`
//! views are used). Functions name what they touch — `l4::SRC_PORT`, `tcp::CHECKSUM`,
//! `icmp::ECHO_IDENT` — and no byte offset or byte order is spelled outside this crate.

use crate::{be, checksum};
use std::net::Ipv4Addr;

macro_rules! field {
    ($(#[$doc:meta])* $name:ident, $int:ty) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name(pub usize);

        impl $name {
            #[inline]
            pub fn get(self, header: &[u8]) -> $int {
                be::get(header, self.0)
            }

            #[inline]
            pub fn set(self, header: &mut [u8], value: $int) {
                be::set(header, self.0, value);
            }

            /// The field, or `None` where `header` is cut short of it.
            #[inline]
            pub fn try_get(self, header: &[u8]) -> Option<$int> {
                be::try_get(header, self.0)
            }

            /// Writes `value` and returns what the field held.
            #[inline]
            pub fn replace(self, header: &mut [u8], value: $int) -> $int {
                let old = self.get(header);
                self.set(header, value);
                old
            }

            /// The field's end: a header shorter than this does not hold it.
            pub const fn end(self) -> usize {
                self.0 + std::mem::size_of::<$int>()
            }
        }
    };
}

field!(
    /// A byte of a header at an offset (a TTL, a protocol number, a type).
    Field8,
    u8
);
field!(
    /// A 16-bit big-endian field at an offset of its header.
    Field16,
    u16
);
field!(
    /// A 32-bit big-endian field at an offset of its header.
    Field32,
    u32
);

/// The IPv4 header (RFC 791) as the hot paths read it: after one check of its lengths
/// ([`ipv4::lengths`]), every field is read where it lies.
pub mod ipv4 {
    use super::{Field16, Field32, Field8};
    use crate::checksum;
    use std::net::Ipv4Addr;
    pub const MIN_LEN: usize = 20;
    pub const TOS: Field8 = Field8(1);
    pub const TOTAL_LEN: Field16 = Field16(2);
    pub const IDENT: Field16 = Field16(4);
    /// Flags (3 bits) and fragment offset (13 bits, in 8-byte units).
    pub const FLAGS_FRAG: Field16 = Field16(6);
    pub const TTL: Field8 = Field8(8);
    pub const PROTOCOL: Field8 = Field8(9);
    pub const CHECKSUM: Field16 = Field16(10);
    pub const SRC: Field32 = Field32(12);
    pub const DST: Field32 = Field32(16);
    /// The source and destination addresses' bytes.
    pub const SRC_BYTES: std::ops::Range<usize> = 12..16;
    pub const DST_BYTES: std::ops::Range<usize> = 16..20;
    pub const DONT_FRAGMENT: u16 = 0x4000;
    pub const MORE_FRAGMENTS: u16 = 0x2000;
    pub const OFFSET: u16 = 0x1fff;

    /// The header's length in bytes, from its first byte (IHL).
    #[inline]
    pub fn header_len(ip: &[u8]) -> usize {
        (ip[0] & 0x0f) as usize * 4
    }

    /// The IPv4 packet at the head of `ip`, its lengths checked: (header length, total
    /// length), or `None` when it is not IPv4 or `ip` does not hold what its header says.
    #[inline]
    pub fn lengths(ip: &[u8]) -> Option<(usize, usize)> {
        let first = *ip.first()?;
        let ihl = (first & 0x0f) as usize * 4;
        if first >> 4 != 4 || ihl < MIN_LEN || ip.len() < ihl {
            return None;
        }
        let total = TOTAL_LEN.get(ip) as usize;
        (total >= ihl && total <= ip.len()).then_some((ihl, total))
    }

    /// A fragment: MF set or a non-zero offset.
    #[inline]
    pub fn is_fragment(ip: &[u8]) -> bool {
        FLAGS_FRAG.get(ip) & (MORE_FRAGMENTS | OFFSET) != 0
    }

    #[inline]
    pub fn dont_fragment(ip: &[u8]) -> bool {
        FLAGS_FRAG.get(ip) & DONT_FRAGMENT != 0
    }

    /// Computes the checksum of `header` (all of it, options included) anew.
    pub fn fill_checksum(header: &mut [u8]) {
        CHECKSUM.set(header, 0);
        let cs = checksum::checksum(header);
        CHECKSUM.set(header, cs);
    }

    /// An IPv4 header without options, identification 0.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Header {
        pub src: Ipv4Addr,
        pub dst: Ipv4Addr,
        pub protocol: u8,
        /// The bytes after the header.
        pub payload_len: usize,
        pub ttl: u8,
        pub dont_fragment: bool,
    }

    impl Header {
        /// Writes the header, its checksum filled, into the first [`MIN_LEN`] bytes of `h`.
        #[inline]
        pub fn write(&self, h: &mut [u8]) {
            let h = &mut h[..MIN_LEN];
            h.fill(0);
            h[0] = 0x40 | (MIN_LEN / 4) as u8;
            TOTAL_LEN.set(h, (MIN_LEN + self.payload_len) as u16);
            FLAGS_FRAG.set(h, if self.dont_fragment { DONT_FRAGMENT } else { 0 });
            TTL.set(h, self.ttl);
            PROTOCOL.set(h, self.protocol);
            SRC.set(h, self.src.into());
            DST.set(h, self.dst.into());
            fill_checksum(h);
        }
    }

    /// Decrements the TTL, updating the checksum incrementally (RFC 1624), and returns the
    /// new TTL; a TTL of 0 stays 0.
    #[inline]
    pub fn decrement_ttl(ip: &mut [u8]) -> u8 {
        let ttl = TTL.get(ip);
        if ttl == 0 {
            return 0;
        }
        // TTL and protocol are one 16-bit word of the checksum.
        let word = Field16(TTL.0);
        let old = word.get(ip);
        TTL.set(ip, ttl - 1);
        let cs = checksum::update(CHECKSUM.get(ip), old, word.get(ip));
        CHECKSUM.set(ip, cs);
        ttl - 1
    }
}

/// The IPv6 header (RFC 8200).
pub mod ipv6 {
    use super::{Field16, Field32, Field8};
    pub const LEN: usize = 40;
    /// Version (4 bits), traffic class (8) and flow label (20).
    pub const VERSION_CLASS_FLOW: Field32 = Field32(0);
    pub const PAYLOAD_LEN: Field16 = Field16(4);
    pub const NEXT_HEADER: Field8 = Field8(6);
    pub const HOP_LIMIT: Field8 = Field8(7);
    pub const SRC: std::ops::Range<usize> = 8..24;
    pub const DST: std::ops::Range<usize> = 24..40;
    pub const FRAGMENT: u8 = 44;

    /// An IPv6 header.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Header {
        pub traffic_class: u8,
        /// The low 20 bits are the flow label.
        pub flow_label: u32,
        pub payload_len: u16,
        pub next_header: u8,
        pub hop_limit: u8,
        pub src: [u8; 16],
        pub dst: [u8; 16],
    }

    impl Header {
        /// Writes the header into the first [`LEN`] bytes of `h`. Always inlined: the
        /// encapsulating hot paths (VXLAN over IPv6, the lwAFTR) write one per packet.
        #[inline(always)]
        pub fn write(&self, h: &mut [u8]) {
            let word = 6 << 28 | (self.traffic_class as u32) << 20 | (self.flow_label & 0xfffff);
            VERSION_CLASS_FLOW.set(h, word);
            PAYLOAD_LEN.set(h, self.payload_len);
            NEXT_HEADER.set(h, self.next_header);
            HOP_LIMIT.set(h, self.hop_limit);
            h[SRC].copy_from_slice(&self.src);
            h[DST].copy_from_slice(&self.dst);
        }
    }

    /// The source or destination address of the header at the head of `ip`.
    #[inline]
    pub fn addr(ip: &[u8], which: std::ops::Range<usize>) -> std::net::Ipv6Addr {
        let octets: [u8; 16] = ip[which].try_into().expect("a 16-byte range");
        octets.into()
    }

    /// The fragment header (RFC 8200 §4.5).
    pub mod fragment {
        use super::{Field16, Field32, Field8};
        pub const LEN: usize = 8;
        pub const NEXT_HEADER: Field8 = Field8(0);
        /// Offset (13 bits, in 8-byte units, shifted left by 3) and the M flag (bit 0).
        pub const OFFSET_MORE: Field16 = Field16(2);
        pub const IDENT: Field32 = Field32(4);
    }
}

/// The ARP message for Ethernet and IPv4 (RFC 826).
pub mod arp {
    use super::Field16;
    use std::ops::Range;
    pub const LEN: usize = 28;
    pub const HARDWARE: Field16 = Field16(0);
    pub const PROTOCOL: Field16 = Field16(2);
    pub const OPERATION: Field16 = Field16(6);
    pub const SENDER_MAC: Range<usize> = 8..14;
    pub const SENDER_IP: Range<usize> = 14..18;
    pub const TARGET_MAC: Range<usize> = 18..24;
    pub const TARGET_IP: Range<usize> = 24..28;
}

/// Neighbor Discovery's solicitation and advertisement (RFC 4861 §4.3, §4.4).
pub mod nd {
    use std::ops::Range;
    pub const TARGET: Range<usize> = 8..24;
    /// Where the options start.
    pub const OPTIONS: usize = 24;
}

/// Fields at the head of every transport header with ports (TCP, UDP, SCTP).
pub mod l4 {
    use super::{Field16, Field32};
    pub const SRC_PORT: Field16 = Field16(0);
    pub const DST_PORT: Field16 = Field16(2);
    /// Both ports as one word (a flow hash's input).
    pub const PORTS: Field32 = Field32(0);
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
    use super::{Field16, Field32};
    pub const CHECKSUM: Field16 = Field16(2);
    /// The 4 bytes after the checksum: an error's unused word or next-hop MTU.
    pub const REST: Field32 = Field32(4);
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
    #[inline]
    pub fn write(h: &mut [u8], vni: u32) {
        let [_, a, b, c] = vni.to_be_bytes();
        h[..LEN].copy_from_slice(&[VNI_VALID, 0, 0, 0, a, b, c, 0]);
    }
}

pub mod ethernet {
    use super::Field16;
    use std::ops::Range;
    pub const LEN: usize = 14;
    pub const DST: Range<usize> = 0..6;
    pub const SRC: Range<usize> = 6..12;
    pub const ETHERTYPE: Field16 = Field16(12);
}

/// The checksum field of an IPv4 packet's transport header (ICMP's covers no addresses).
pub fn l4_checksum(proto: u8) -> Field16 {
    match proto {
        crate::ip_proto::TCP => tcp::CHECKSUM,
        crate::ip_proto::UDP => udp::CHECKSUM,
        _ => icmp::CHECKSUM,
    }
}

/// Which end of a packet a rewrite changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Source,
    Destination,
}

/// Sets the address at `end` of IPv4 header `ip` (at least 20 bytes), updating its checksum;
/// returns the old one.
#[inline]
pub fn set_ipv4_addr(ip: &mut [u8], end: End, addr: Ipv4Addr) -> Ipv4Addr {
    let field = match end {
        End::Source => ipv4::SRC,
        End::Destination => ipv4::DST,
    };
    let new = u32::from(addr);
    let old = field.replace(ip, new);
    let cs = checksum::update32(ipv4::CHECKSUM.get(ip), old, new);
    ipv4::CHECKSUM.set(ip, cs);
    old.into()
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
#[inline]
pub fn rewrite_ipv4_endpoint(
    ip: &mut [u8],
    l4: &mut [u8],
    end: End,
    (addr, port_field, port): (Ipv4Addr, Field16, u16),
    sum: L4Sum,
) {
    let proto = ipv4::PROTOCOL.get(ip);
    let old_addr = set_ipv4_addr(ip, end, addr);
    let old_port = port_field.replace(l4, port);
    let field = l4_checksum(proto);
    let cs = field.get(l4);
    let (old_addr, new_addr) = (u32::from(old_addr), u32::from(addr));
    let cs = match sum {
        L4Sum::Full if proto == crate::ip_proto::UDP && cs == 0 => return,
        L4Sum::Partial => !checksum::update32(!cs, old_addr, new_addr),
        L4Sum::Full => {
            let mut cs = cs;
            if proto != crate::ip_proto::ICMP {
                cs = checksum::update32(cs, old_addr, new_addr);
            }
            match checksum::update(cs, old_port, port) {
                0 if proto == crate::ip_proto::UDP => 0xffff,
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
    use crate::views::Ipv4Packet;

    fn sums_ok(f: &[u8]) -> bool {
        let ip = Ipv4Packet::new_unchecked(&f[14..]);
        let l4 = &f[34..14 + ip.total_len() as usize];
        let pseudo = match u8::from(ip.next_header()) {
            crate::ip_proto::ICMP => 0,
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
            let new = (Ipv4Addr::new(203, 0, 113, 5), port, 1024);
            rewrite_ipv4_endpoint(ip, l4, End::Source, new, L4Sum::Full);
            assert_eq!(Ipv4Packet::new_unchecked(&*ip).src_addr(), new.0);
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
        rewrite_ipv4_endpoint(ip, l4, End::Source, new, L4Sum::Full);
        assert_eq!(udp::CHECKSUM.get(l4), 0);
        assert!(Ipv4Packet::new_unchecked(&*ip).verify_checksum());
    }
}
