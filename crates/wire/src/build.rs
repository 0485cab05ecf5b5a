//! Frames made from their fields, every length and checksum right (smoltcp's views write the
//! headers): the generator's templates and the frames of tests.
//!
//! ```
//! use stitch_wire::build::{Frame, Transport};
//! let f = Frame::ipv4([10, 0, 0, 1], [10, 0, 0, 2], Transport::udp(5000, 53))
//!     .payload_len(18)
//!     .bytes();
//! assert_eq!(f.len(), 14 + 20 + 8 + 18);
//! ```

use crate::views::{
    EthernetAddress, EthernetFrame, EthernetProtocol, Icmpv4Message, Icmpv4Packet, IpAddress,
    IpProtocol, Ipv6Packet, TcpPacket, TcpSeqNumber, UdpPacket,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The transport header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp {
        src_port: u16,
        dst_port: u16,
    },
    Tcp {
        src_port: u16,
        dst_port: u16,
        seq: u32,
        ack: u32,
        /// FIN 0x01, SYN 0x02, RST 0x04, PSH 0x08, ACK 0x10.
        flags: u8,
        window: u16,
    },
    IcmpEcho {
        request: bool,
        ident: u16,
        seq: u16,
    },
    /// Any other ICMP (ICMPv6 over IPv6) message: its type, code and the 4 bytes after the
    /// checksum (an error's unused field or next-hop MTU); the payload is what it quotes.
    Icmp {
        kind: u8,
        code: u8,
        rest: u32,
    },
}

impl Transport {
    pub fn udp(src_port: u16, dst_port: u16) -> Transport {
        Transport::Udp { src_port, dst_port }
    }

    /// A TCP segment in an established connection: PSH+ACK, sequence and acknowledgment 1.
    pub fn tcp(src_port: u16, dst_port: u16) -> Transport {
        Transport::Tcp {
            src_port,
            dst_port,
            seq: 1,
            ack: 1,
            flags: 0x18,
            window: 65535,
        }
    }

    pub fn echo_request(ident: u16, seq: u16) -> Transport {
        Transport::IcmpEcho {
            request: true,
            ident,
            seq,
        }
    }

    pub fn echo_reply(ident: u16, seq: u16) -> Transport {
        Transport::IcmpEcho {
            request: false,
            ident,
            seq,
        }
    }

    fn header_len(self) -> usize {
        match self {
            Transport::Tcp { .. } => 20,
            _ => 8,
        }
    }

    fn protocol(self, v6: bool) -> IpProtocol {
        match self {
            Transport::Udp { .. } => IpProtocol::Udp,
            Transport::Tcp { .. } => IpProtocol::Tcp,
            Transport::IcmpEcho { .. } | Transport::Icmp { .. } if v6 => IpProtocol::Icmpv6,
            Transport::IcmpEcho { .. } | Transport::Icmp { .. } => IpProtocol::Icmp,
        }
    }
}

/// An Ethernet frame carrying one IP packet (no VLAN tag, no IP options).
#[derive(Debug, Clone)]
pub struct Frame {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub transport: Transport,
    pub payload: Vec<u8>,
    pub ttl: u8,
    pub dont_fragment: bool,
}

impl Frame {
    /// IPv4 from `src` to `dst`, MACs 02:00:00:00:00:01 → 02:00:00:00:00:02, TTL 64, DF clear.
    pub fn ipv4(src: impl Into<Ipv4Addr>, dst: impl Into<Ipv4Addr>, t: Transport) -> Frame {
        Frame::new(IpAddr::V4(src.into()), IpAddr::V4(dst.into()), t)
    }

    /// IPv6 from `src` to `dst` (ICMP echo becomes ICMPv6 echo).
    pub fn ipv6(src: impl Into<Ipv6Addr>, dst: impl Into<Ipv6Addr>, t: Transport) -> Frame {
        Frame::new(IpAddr::V6(src.into()), IpAddr::V6(dst.into()), t)
    }

    fn new(src: IpAddr, dst: IpAddr, transport: Transport) -> Frame {
        Frame {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src,
            dst,
            transport,
            payload: Vec::new(),
            ttl: 64,
            dont_fragment: false,
        }
    }

    pub fn macs(mut self, src: [u8; 6], dst: [u8; 6]) -> Frame {
        (self.src_mac, self.dst_mac) = (src, dst);
        self
    }

    pub fn payload(mut self, payload: &[u8]) -> Frame {
        self.payload = payload.to_vec();
        self
    }

    /// A payload of `len` zero bytes.
    pub fn payload_len(mut self, len: usize) -> Frame {
        self.payload = vec![0; len];
        self
    }

    pub fn ttl(mut self, ttl: u8) -> Frame {
        self.ttl = ttl;
        self
    }

    pub fn dont_fragment(mut self, df: bool) -> Frame {
        self.dont_fragment = df;
        self
    }

    fn ip_header_len(&self) -> usize {
        if self.src.is_ipv4() {
            20
        } else {
            40
        }
    }

    /// Bytes of the whole frame.
    pub fn frame_len(&self) -> usize {
        14 + self.ip_header_len() + self.transport.header_len() + self.payload.len()
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0; self.frame_len()];
        self.write(&mut out);
        out
    }

    /// Writes the frame into `out`, which is [`Frame::frame_len`] bytes long.
    pub fn write(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.frame_len(), "a frame's buffer fits it");
        out.fill(0);
        let (eth, rest) = out.split_at_mut(14);
        let mut e = EthernetFrame::new_unchecked(eth);
        e.set_src_addr(EthernetAddress(self.src_mac));
        e.set_dst_addr(EthernetAddress(self.dst_mac));
        let (ip, l4) = rest.split_at_mut(self.ip_header_len());
        let v6 = self.src.is_ipv6();
        let proto = self.transport.protocol(v6);
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                e.set_ethertype(EthernetProtocol::Ipv4);
                crate::header::ipv4::Header {
                    src: s,
                    dst: d,
                    protocol: proto.into(),
                    payload_len: l4.len(),
                    ttl: self.ttl,
                    dont_fragment: self.dont_fragment,
                }
                .write(ip);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                e.set_ethertype(EthernetProtocol::Ipv6);
                let mut ip = Ipv6Packet::new_unchecked(ip);
                ip.set_version(6);
                ip.set_payload_len(l4.len() as u16);
                ip.set_next_header(proto);
                ip.set_hop_limit(self.ttl);
                ip.set_src_addr(s);
                ip.set_dst_addr(d);
            }
            _ => panic!("a frame's addresses are of one family"),
        }
        let header = self.transport.header_len();
        l4[header..].copy_from_slice(&self.payload);
        self.write_transport(l4);
    }

    fn write_transport(&self, l4: &mut [u8]) {
        let (src, dst) = (IpAddress::from(self.src), IpAddress::from(self.dst));
        match self.transport {
            Transport::Udp { src_port, dst_port } => {
                let mut u = UdpPacket::new_unchecked(l4);
                u.set_src_port(src_port);
                u.set_dst_port(dst_port);
                u.set_len(u.as_ref().len() as u16);
                u.fill_checksum(&src, &dst);
            }
            Transport::Tcp {
                src_port,
                dst_port,
                seq,
                ack,
                flags,
                window,
            } => {
                let mut t = TcpPacket::new_unchecked(l4);
                t.set_src_port(src_port);
                t.set_dst_port(dst_port);
                t.set_seq_number(TcpSeqNumber(seq as i32));
                t.set_ack_number(TcpSeqNumber(ack as i32));
                t.set_header_len(20);
                t.clear_flags();
                t.set_fin(flags & 0x01 != 0);
                t.set_syn(flags & 0x02 != 0);
                t.set_rst(flags & 0x04 != 0);
                t.set_psh(flags & 0x08 != 0);
                t.set_ack(flags & 0x10 != 0);
                t.set_window_len(window);
                t.fill_checksum(&src, &dst);
            }
            Transport::IcmpEcho {
                request,
                ident,
                seq,
            } => self.write_echo(l4, request, ident, seq),
            Transport::Icmp { kind, code, rest } => {
                (l4[0], l4[1]) = (kind, code);
                crate::header::icmp::REST.set(l4, rest);
                self.fill_icmp_checksum(l4);
            }
        }
    }

    fn write_echo(&self, l4: &mut [u8], request: bool, ident: u16, seq: u16) {
        use crate::header::icmp;
        if let (IpAddr::V4(_), IpAddr::V4(_)) = (self.src, self.dst) {
            let mut i = Icmpv4Packet::new_unchecked(l4);
            i.set_msg_type(if request {
                Icmpv4Message::EchoRequest
            } else {
                Icmpv4Message::EchoReply
            });
            i.set_msg_code(0);
            i.set_echo_ident(ident);
            i.set_echo_seq_no(seq);
            i.fill_checksum();
            return;
        }
        l4[0] = if request { 128 } else { 129 };
        l4[1] = 0;
        icmp::ECHO_IDENT.set(l4, ident);
        icmp::ECHO_SEQ.set(l4, seq);
        self.fill_icmp_checksum(l4);
    }

    /// ICMP's checksum covers the message; ICMPv6's also the pseudo-header (RFC 4443).
    fn fill_icmp_checksum(&self, l4: &mut [u8]) {
        use crate::checksum::{finish, sum};
        use crate::header::icmp;
        icmp::CHECKSUM.set(l4, 0);
        let pseudo = match (self.src, self.dst) {
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                sum(&s.octets(), 0) + sum(&d.octets(), 0) + 58 + l4.len() as u64
            }
            _ => 0,
        };
        icmp::CHECKSUM.set(l4, finish(sum(l4, pseudo)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum;
    use crate::views::Ipv4Packet;

    #[test]
    fn frames_carry_right_lengths_and_checksums() {
        let f = Frame::ipv4([10, 0, 0, 1], [10, 0, 0, 2], Transport::tcp(1, 2))
            .payload(b"hello")
            .dont_fragment(true)
            .bytes();
        let ip = Ipv4Packet::new_checked(&f[14..]).unwrap();
        assert!(ip.verify_checksum() && ip.dont_frag());
        let t = TcpPacket::new_checked(ip.payload()).unwrap();
        let (s, d) = (
            IpAddress::from(ip.src_addr()),
            IpAddress::from(ip.dst_addr()),
        );
        assert!(t.verify_checksum(&s, &d) && t.psh() && t.ack());
        assert_eq!(t.payload(), b"hello");
        let f = Frame::ipv6(
            Ipv6Addr::LOCALHOST,
            Ipv6Addr::LOCALHOST,
            Transport::echo_request(7, 1),
        )
        .payload_len(4)
        .bytes();
        let ip = Ipv6Packet::new_checked(&f[14..]).unwrap();
        let pseudo = checksum::sum(&f[22..54], 0) + 58 + ip.payload_len() as u64;
        assert_eq!(checksum::finish(checksum::sum(&f[54..], pseudo)), 0);
    }
}
