//! ICMP errors about frames a hop cannot carry: "fragmentation needed" (RFC 792, RFC 1191) and
//! "packet too big" (RFC 4443 §3.2), sent so that path MTU discovery (RFC 1191, RFC 8201) works
//! through an element that is not a router — a tunnel endpoint bridging Ethernet frames. Like
//! Linux's tunnels (`iptunnel_pmtud_build_icmp`, since 5.9), the answer comes from the
//! packet's own destination address and MAC, so the sender's stack takes it as from the path.
//! Also the token bucket that keeps ICMP errors within a rate (RFC 1812 §4.3.2.8).

use crate::checksum;
use crate::ethertype;
use crate::ndp::{icmp6_checksum, ICMPV6};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Instant;
use stitch_core::{pool, Packet};

/// At most `rate` errors per second, in bursts of at most `rate` (at least one).
pub struct RateLimit {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl RateLimit {
    pub fn new(rate: f64) -> Self {
        RateLimit {
            rate,
            tokens: rate.max(1.0),
            last: Instant::now(),
        }
    }

    /// Whether one more error may be sent at `now` (and takes its token if so).
    pub fn allow(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.rate.max(1.0));
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The longest Ethernet header answered: two VLAN tags.
const MAX_L2: usize = 18;

/// The ICMP error telling the sender of `frame` that the path carries IP packets of at most
/// `mtu` bytes: IPv4 "destination unreachable, fragmentation needed" with the next-hop MTU,
/// IPv6 "packet too big". The answer goes from the frame's destination (MAC and IP) to its
/// source, keeps its VLAN tags, and quotes the offending header as the RFCs ask (IPv4: header
/// and 8 bytes; IPv6: as much as fits in 1280 bytes). None when no answer is due — IPv4
/// without DF, an ICMP error, a non-first fragment, a multicast or broadcast address, not IP,
/// malformed — or the pool is empty.
pub fn too_big_reply(frame: &[u8], mtu: u16) -> Option<Packet> {
    let (l2_len, ethertype, _) = crate::flow::l3(frame).ok()?;
    if l2_len > MAX_L2 {
        return None;
    }
    match ethertype {
        ethertype::IPV4 => frag_needed(frame, l2_len, mtu),
        ethertype::IPV6 => packet_too_big(frame, l2_len, mtu),
        _ => None,
    }
}

/// Writes the answer's Ethernet header (addresses swapped, tags kept) and returns where the
/// IP header starts.
fn reply_l2(frame: &[u8], l2_len: usize, out: &mut [u8]) -> usize {
    out[0..6].copy_from_slice(&frame[6..12]);
    out[6..12].copy_from_slice(&frame[0..6]);
    out[12..l2_len].copy_from_slice(&frame[12..l2_len]);
    l2_len
}

fn frag_needed(frame: &[u8], l2_len: usize, mtu: u16) -> Option<Packet> {
    let ip = frame.get(l2_len..)?;
    let ihl = (*ip.first()? & 0x0f) as usize * 4;
    if ip[0] >> 4 != 4 || ihl < 20 || ip.len() < ihl {
        return None;
    }
    let flags_fragment = u16::from_be_bytes([ip[6], ip[7]]);
    let dont_fragment = flags_fragment & 0x4000 != 0;
    let first_fragment = flags_fragment & 0x1fff == 0;
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let about_an_error = ip[9] == 1 && ip.get(ihl).is_some_and(|t| ![0, 8, 13, 15].contains(t));
    if !dont_fragment
        || !first_fragment
        || about_an_error
        || frame[0] & 1 == 1
        || [src, dst]
            .iter()
            .any(|a| a.is_multicast() || a.is_broadcast() || a.is_unspecified())
    {
        return None;
    }
    let quote = &ip[..ip.len().min(ihl + 8)];
    let mut out = [0u8; MAX_L2 + 20 + 8 + 60 + 8];
    let at = reply_l2(frame, l2_len, &mut out);
    let icmp_len = 8 + quote.len();
    out[at..at + 20].copy_from_slice(&crate::ipv4_header(dst, src, 1, icmp_len, false));
    let icmp = &mut out[at + 20..at + 20 + icmp_len];
    icmp[0] = 3; // destination unreachable
    icmp[1] = 4; // fragmentation needed and DF set
    icmp[6..8].copy_from_slice(&mtu.to_be_bytes());
    icmp[8..].copy_from_slice(quote);
    let cs = checksum::checksum(icmp);
    icmp[2..4].copy_from_slice(&cs.to_be_bytes());
    let end = (at + 20 + icmp_len).max(60);
    pool::alloc_with(&out[..end])
}

/// The minimum IPv6 MTU, and so the largest ICMPv6 error (RFC 4443 §2.4 (c)).
const IPV6_MIN_MTU: usize = 1280;

fn packet_too_big(frame: &[u8], l2_len: usize, mtu: u16) -> Option<Packet> {
    let ip = frame.get(l2_len..l2_len + 40)?;
    if ip[0] >> 4 != 6 {
        return None;
    }
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?);
    // Only the plain case is recognised as an ICMPv6 error; behind extension headers the
    // packet is answered (an error about an error there costs one rate-limited message).
    let about_an_error = ip[6] == ICMPV6 && frame.get(l2_len + 40).is_some_and(|t| *t < 128);
    if about_an_error
        || frame[0] & 1 == 1
        || src.is_multicast()
        || src.is_unspecified()
        || dst.is_multicast()
    {
        return None;
    }
    let whole = &frame[l2_len..];
    let quote = &whole[..whole.len().min(IPV6_MIN_MTU - 48)];
    let mut out = [0u8; MAX_L2 + IPV6_MIN_MTU];
    let at = reply_l2(frame, l2_len, &mut out);
    let icmp_len = 8 + quote.len();
    let header = &mut out[at..at + 40];
    header[0] = 0x60;
    header[4..6].copy_from_slice(&(icmp_len as u16).to_be_bytes());
    header[6] = ICMPV6;
    header[7] = 64;
    header[8..24].copy_from_slice(&dst.octets());
    header[24..40].copy_from_slice(&src.octets());
    let icmp = &mut out[at + 40..at + 40 + icmp_len];
    icmp[0] = 2; // packet too big
    icmp[4..8].copy_from_slice(&(mtu as u32).to_be_bytes());
    icmp[8..].copy_from_slice(quote);
    let cs = icmp6_checksum(&dst.octets(), &src.octets(), icmp);
    icmp[2..4].copy_from_slice(&cs.to_be_bytes());
    pool::alloc_with(&out[..at + 40 + icmp_len])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::{
        EthernetFrame, Icmpv4Message, Icmpv4Packet, Icmpv6Message, Icmpv6Packet, Ipv4Packet,
        Ipv6Packet,
    };

    const A: [u8; 6] = [2, 0, 0, 0, 0, 0xa];
    const B: [u8; 6] = [2, 0, 0, 0, 0, 0xb];

    fn ipv4_frame(df: bool, proto: u8, payload: usize, tagged: bool) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&B);
        f.extend_from_slice(&A);
        if tagged {
            f.extend_from_slice(&[0x81, 0x00, 0x00, 0x07]);
        }
        f.extend_from_slice(&ethertype::IPV4.to_be_bytes());
        f.extend_from_slice(&crate::ipv4_header(
            Ipv4Addr::new(10, 0, 0, 1),
            Ipv4Addr::new(10, 0, 0, 2),
            proto,
            payload,
            df,
        ));
        f.extend((0..payload).map(|i| if i == 0 { 8 } else { i as u8 }));
        f
    }

    fn answer(p: Option<Packet>) -> Vec<u8> {
        p.expect("an answer").data().to_vec()
    }

    #[test]
    fn an_ipv4_df_packet_gets_fragmentation_needed_from_its_destination() {
        let f = ipv4_frame(true, 1, 1472, false);
        let r = answer(too_big_reply(&f, 1450));
        let eth = EthernetFrame::new_checked(&r[..]).unwrap();
        assert_eq!(eth.dst_addr().0, A);
        assert_eq!(eth.src_addr().0, B);
        let ip = Ipv4Packet::new_checked(eth.payload()).unwrap();
        assert!(ip.verify_checksum());
        assert_eq!(ip.src_addr().octets(), [10, 0, 0, 2]);
        assert_eq!(ip.dst_addr().octets(), [10, 0, 0, 1]);
        let icmp = Icmpv4Packet::new_checked(ip.payload()).unwrap();
        assert!(icmp.verify_checksum());
        assert_eq!(icmp.msg_type(), Icmpv4Message::DstUnreachable);
        assert_eq!(icmp.msg_code(), 4);
        assert_eq!(&ip.payload()[6..8], &1450u16.to_be_bytes());
        assert_eq!(
            &ip.payload()[8..36],
            &f[14..42],
            "header and 8 bytes quoted"
        );
    }

    #[test]
    fn vlan_tags_are_kept_and_silent_cases_stay_silent() {
        let r = answer(too_big_reply(&ipv4_frame(true, 17, 1472, true), 1400));
        assert_eq!(&r[12..18], &[0x81, 0x00, 0x00, 0x07, 0x08, 0x00]);
        assert!(too_big_reply(&ipv4_frame(false, 17, 1472, false), 1400).is_none());
        let mut error = ipv4_frame(true, 1, 1472, false);
        error[34] = 3; // an ICMP error itself
        assert!(too_big_reply(&error, 1400).is_none());
        let mut later_fragment = ipv4_frame(true, 17, 1472, false);
        later_fragment[21] = 10;
        assert!(too_big_reply(&later_fragment, 1400).is_none());
        assert!(too_big_reply(&[0u8; 20], 1400).is_none());
        assert!(too_big_reply(&ipv4_frame(true, 17, 0, false)[..20], 1400).is_none());
    }

    #[test]
    fn an_ipv6_packet_gets_packet_too_big_quoting_up_to_1280_bytes() {
        let (src, dst): (Ipv6Addr, Ipv6Addr) =
            ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        let mut f = Vec::new();
        f.extend_from_slice(&B);
        f.extend_from_slice(&A);
        f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
        f.extend_from_slice(&1500u16.to_be_bytes());
        f.extend_from_slice(&[17, 64]);
        f.extend_from_slice(&src.octets());
        f.extend_from_slice(&dst.octets());
        f.resize(14 + 40 + 1500, 0xab);
        let r = answer(too_big_reply(&f, 1430));
        assert_eq!(r.len(), 14 + 1280);
        let ip = Ipv6Packet::new_checked(&r[14..]).unwrap();
        assert_eq!((ip.src_addr(), ip.dst_addr()), (dst, src));
        let icmp = Icmpv6Packet::new_checked(ip.payload()).unwrap();
        assert!(icmp.verify_checksum(&dst, &src));
        assert_eq!(icmp.msg_type(), Icmpv6Message::PktTooBig);
        assert_eq!(icmp.pkt_too_big_mtu(), 1430);
        f[54] = 1;
        f[20] = ICMPV6; // an ICMPv6 error itself
        assert!(too_big_reply(&f, 1430).is_none());
    }

    #[test]
    fn the_rate_limit_allows_a_burst_then_the_rate() {
        let mut r = RateLimit::new(3.0);
        let t = Instant::now();
        assert_eq!((0..5).filter(|_| r.allow(t)).count(), 3);
        assert!(r.allow(t + std::time::Duration::from_millis(400)));
        assert!(!r.allow(t + std::time::Duration::from_millis(450)));
    }
}
