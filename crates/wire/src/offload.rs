//! Offload metadata: the virtio-net header that TAP devices and packet sockets use to hand over
//! packets with partial checksums and GSO super-frames, and the software fallbacks —
//! completing a partial checksum and cutting a TCP/UDP super-frame into segments.
//!
//! A packet's offload state travels in its header (`ChecksumState::Partial`, `csum_start`,
//! `csum_offset`): apps that pass packets on unchanged keep it, an output that understands it
//! (a socket or TAP with a virtio-net header) hands it to the kernel, and an app that needs final
//! bytes calls [`complete_checksum`]. Super-frames are cut into segments where they enter the
//! graph ([`segment`]), so every packet of the graph fits one buffer.

use crate::checksum;
use crate::ethertype;
use stitch_core::packet::{ChecksumState, Packet};

pub const VNET_HDR_LEN: usize = 10;
pub const F_NEEDS_CSUM: u8 = 1;
pub const F_DATA_VALID: u8 = 2;
pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_UDP: u8 = 3;
pub const GSO_TCPV6: u8 = 4;
pub const GSO_UDP_L4: u8 = 5;
pub const GSO_ECN: u8 = 0x80;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    #[error("frame too short for its headers")]
    Truncated,
    #[error("checksum position outside the frame")]
    BadChecksumOffset,
    #[error("unsupported GSO type {0}")]
    UnsupportedGso(u8),
    #[error("GSO frame is not TCP/UDP over IPv4/IPv6")]
    NotSegmentable,
    #[error("packet pool exhausted")]
    PoolExhausted,
}

/// `struct virtio_net_hdr` (legacy 10-byte form), host byte order (little-endian here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8]) -> Option<VnetHdr> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Some(VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u(2),
            gso_size: u(4),
            csum_start: u(6),
            csum_offset: u(8),
        })
    }

    pub fn write(&self, b: &mut [u8; VNET_HDR_LEN]) {
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
    }

    /// The header describing a packet of the graph: its checksum state and, for a GSO
    /// super-frame, the segmentation the receiver must do.
    pub fn of_packet(p: &Packet) -> VnetHdr {
        let h = p.header();
        let mut v = match p.checksum_state() {
            ChecksumState::Partial => VnetHdr {
                flags: F_NEEDS_CSUM,
                csum_start: h.csum_start,
                csum_offset: h.csum_offset,
                ..Default::default()
            },
            ChecksumState::Verified => VnetHdr {
                flags: F_DATA_VALID,
                ..Default::default()
            },
            ChecksumState::Unknown => VnetHdr::default(),
        };
        if h.gso_type != GSO_NONE && h.gso_size != 0 {
            v.gso_type = h.gso_type;
            v.gso_size = h.gso_size;
            // Length of all headers: L4 start plus the TCP header length (or 8 for UDP).
            let start = h.csum_start as usize;
            let l4 = if h.gso_type & !GSO_ECN == GSO_UDP_L4 {
                8
            } else {
                p.data()
                    .get(start + 12)
                    .map(|b| (b >> 4) as usize * 4)
                    .unwrap_or(20)
            };
            v.hdr_len = (start + l4) as u16;
        }
        v
    }

    /// Records the offload state of a received packet: checksum state and, for a super-frame,
    /// its GSO type and segment size.
    pub fn apply_to(&self, p: &mut Packet) {
        if self.gso_type != GSO_NONE {
            let h = p.header_mut();
            h.gso_type = self.gso_type;
            h.gso_size = self.gso_size;
        }
        if self.flags & F_NEEDS_CSUM != 0 {
            let h = p.header_mut();
            h.csum_start = self.csum_start;
            h.csum_offset = self.csum_offset;
            p.set_checksum_state(ChecksumState::Partial);
        } else if self.flags & F_DATA_VALID != 0 {
            p.set_checksum_state(ChecksumState::Verified);
        }
    }
}

/// Passes a packet on as MTU-sized packets: a GSO super-frame is cut into segments (with
/// partial checksums), anything else goes out unchanged. For outputs that cannot take
/// super-frames (AF_XDP, apps that rewrite headers). Returns the number of packets produced.
pub fn resolve_gso(p: Packet, mut out: impl FnMut(Packet)) -> Result<usize, OffloadError> {
    let h = p.header();
    if h.gso_type == GSO_NONE || h.gso_size == 0 {
        out(p);
        return Ok(1);
    }
    let hdr = VnetHdr {
        gso_type: h.gso_type,
        gso_size: h.gso_size,
        ..Default::default()
    };
    segment(p.data(), &hdr, p.timestamp_ns(), out)
}

/// Completes a partial checksum in place (the field holds the pseudo-header sum, as Linux
/// leaves it for CHECKSUM_PARTIAL). Packets in another state are left alone.
pub fn complete_checksum(p: &mut Packet) -> Result<(), OffloadError> {
    if p.checksum_state() != ChecksumState::Partial {
        return Ok(());
    }
    let (start, off) = (
        p.header().csum_start as usize,
        p.header().csum_offset as usize,
    );
    complete_in(p.data_mut(), start, off)?;
    p.set_checksum_state(ChecksumState::Unknown);
    Ok(())
}

fn complete_in(d: &mut [u8], start: usize, off: usize) -> Result<(), OffloadError> {
    if start + off + 2 > d.len() {
        return Err(OffloadError::BadChecksumOffset);
    }
    let mut cs = checksum::finish(checksum::sum(&d[start..], 0));
    if cs == 0 && off == 6 {
        cs = 0xffff; // UDP: zero means "no checksum"
    }
    d[start + off..start + off + 2].copy_from_slice(&cs.to_be_bytes());
    Ok(())
}

/// Completes the TCP/UDP checksum of a frame whose checksum field holds exactly the folded
/// pseudo-header sum — the mark of a partial checksum whose state was lost (AF_XDP sees
/// packets after the sender's checksum offload). A complete checksum that happens to hold the
/// same value is recomputed to the same value, so the check cannot damage a good packet.
/// Returns whether it completed one.
pub fn complete_if_partial(frame: &mut [u8]) -> bool {
    let Ok(lay) = layout(frame) else { return false };
    let l4_len = if lay.ipv4 {
        let ip = &frame[lay.l3..];
        if u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
            return false; // a fragment: the L4 header is not all here
        }
        (u16::from_be_bytes([ip[2], ip[3]]) as usize).checked_sub(lay.l4 - lay.l3)
    } else {
        Some(u16::from_be_bytes([frame[lay.l3 + 4], frame[lay.l3 + 5]]) as usize)
    };
    let Some(l4_len) = l4_len.filter(|&n| lay.l4 + n <= frame.len() && lay.l4 + n >= lay.payload)
    else {
        return false;
    };
    let off = if lay.tcp { 16 } else { 6 };
    let field = u16::from_be_bytes([frame[lay.l4 + off], frame[lay.l4 + off + 1]]);
    if (!lay.tcp && field == 0) || field != fold(pseudo_sum(frame, &lay, l4_len)) {
        return false;
    }
    complete_in(&mut frame[..lay.l4 + l4_len], lay.l4, off).is_ok()
}

/// Layout of an Ethernet + IP + TCP/UDP frame.
struct Layout {
    l3: usize,
    l4: usize,
    payload: usize,
    ipv4: bool,
    tcp: bool,
}

fn layout(f: &[u8]) -> Result<Layout, OffloadError> {
    let get = |i: usize| f.get(i).copied().ok_or(OffloadError::Truncated);
    let mut l3 = 14;
    let mut ethertype = u16::from_be_bytes([get(12)?, get(13)?]);
    while ethertype == ethertype::VLAN || ethertype == ethertype::QINQ {
        ethertype = u16::from_be_bytes([get(l3 + 2)?, get(l3 + 3)?]);
        l3 += 4;
    }
    let (ipv4, l4, proto) = match ethertype {
        ethertype::IPV4 => {
            let ihl = (get(l3)? & 0x0f) as usize * 4;
            if ihl < 20 {
                return Err(OffloadError::NotSegmentable);
            }
            (true, l3 + ihl, get(l3 + 9)?)
        }
        ethertype::IPV6 => (false, l3 + 40, get(l3 + 6)?),
        _ => return Err(OffloadError::NotSegmentable),
    };
    let (tcp, payload) = match proto {
        crate::ip_proto::TCP => {
            let doff = (get(l4 + 12)? >> 4) as usize * 4;
            if doff < 20 {
                return Err(OffloadError::NotSegmentable); // a TCP header is at least 20 bytes
            }
            (true, l4 + doff)
        }
        crate::ip_proto::UDP => (false, l4 + 8),
        _ => return Err(OffloadError::NotSegmentable),
    };
    if payload > f.len() {
        return Err(OffloadError::Truncated);
    }
    Ok(Layout {
        l3,
        l4,
        payload,
        ipv4,
        tcp,
    })
}

/// The pseudo-header sum for an L4 segment of `l4_len` bytes.
fn pseudo_sum(f: &[u8], lay: &Layout, l4_len: usize) -> u64 {
    let mut s = if lay.ipv4 {
        checksum::sum(&f[lay.l3 + 12..lay.l3 + 20], 0)
    } else {
        checksum::sum(&f[lay.l3 + 8..lay.l3 + 40], 0)
    };
    s += if lay.tcp { 6 } else { 17 };
    s + l4_len as u64
}

/// Folds a sum to 16 bits without complementing (the form a partial checksum field holds).
fn fold(mut s: u64) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// Cuts a GSO super-frame into segments of at most `hdr.gso_size` payload bytes, each a new
/// pool packet with its own IP length, IPv4 id and header checksum, TCP sequence number and
/// flags, and a partial L4 checksum (`ChecksumState::Partial`). Returns the number of segments.
pub fn segment(
    frame: &[u8],
    hdr: &VnetHdr,
    timestamp_ns: u64,
    mut out: impl FnMut(Packet),
) -> Result<usize, OffloadError> {
    let kind = hdr.gso_type & !GSO_ECN;
    if !matches!(kind, GSO_TCPV4 | GSO_TCPV6 | GSO_UDP_L4) {
        return Err(OffloadError::UnsupportedGso(hdr.gso_type));
    }
    let lay = layout(frame)?;
    let fits = match kind {
        GSO_TCPV4 => lay.tcp && lay.ipv4,
        GSO_TCPV6 => lay.tcp && !lay.ipv4,
        _ => !lay.tcp,
    };
    if !fits {
        return Err(OffloadError::NotSegmentable);
    }
    let mss = hdr.gso_size.max(1) as usize;
    let headers = &frame[..lay.payload];
    let payload = &frame[lay.payload..];
    let count = payload.len().div_ceil(mss).max(1);
    let seq0 = if lay.tcp {
        u32::from_be_bytes(frame[lay.l4 + 4..lay.l4 + 8].try_into().unwrap())
    } else {
        0
    };
    let id0 = if lay.ipv4 {
        u16::from_be_bytes([frame[lay.l3 + 4], frame[lay.l3 + 5]])
    } else {
        0
    };
    for i in 0..count {
        let chunk = &payload[(i * mss).min(payload.len())..((i + 1) * mss).min(payload.len())];
        let mut p = stitch_core::pool::alloc().ok_or(OffloadError::PoolExhausted)?;
        p.set_len(headers.len() + chunk.len())
            .map_err(|_| OffloadError::Truncated)?;
        p.set_timestamp_ns(timestamp_ns);
        let d = p.data_mut();
        d[..headers.len()].copy_from_slice(headers);
        d[headers.len()..].copy_from_slice(chunk);
        let l4_len = d.len() - lay.l4;
        if lay.ipv4 {
            let ip = &mut d[lay.l3..lay.l4];
            ip[2..4].copy_from_slice(&((lay.l4 - lay.l3 + l4_len) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&id0.wrapping_add(i as u16).to_be_bytes());
            ip[10..12].copy_from_slice(&[0, 0]);
            let cs = checksum::checksum(ip);
            ip[10..12].copy_from_slice(&cs.to_be_bytes());
        } else {
            d[lay.l3 + 4..lay.l3 + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
        }
        let csum_offset = if lay.tcp {
            let t = &mut d[lay.l4..];
            t[4..8].copy_from_slice(&seq0.wrapping_add((i * mss) as u32).to_be_bytes());
            if i + 1 < count {
                t[13] &= !(0x01 | 0x08); // FIN, PSH only on the last segment
            }
            if i > 0 {
                t[13] &= !0x80; // CWR only on the first
            }
            16
        } else {
            d[lay.l4 + 4..lay.l4 + 6].copy_from_slice(&(l4_len as u16).to_be_bytes());
            6
        };
        let ps = fold(pseudo_sum(d, &lay, l4_len));
        d[lay.l4 + csum_offset..lay.l4 + csum_offset + 2].copy_from_slice(&ps.to_be_bytes());
        let h = p.header_mut();
        h.csum_start = lay.l4 as u16;
        h.csum_offset = csum_offset as u16;
        p.set_checksum_state(ChecksumState::Partial);
        out(p);
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::pool;

    /// An IPv4 or IPv6 TCP frame with `payload` bytes and a correct checksum.
    fn tcp_frame(v6: bool, payload: usize) -> Vec<u8> {
        let l3 = if v6 { 40 } else { 20 };
        let mut f = vec![0u8; 14 + l3 + 20 + payload];
        let ip = if v6 { ethertype::IPV6 } else { ethertype::IPV4 };
        f[12..14].copy_from_slice(&ip.to_be_bytes());
        if v6 {
            f[14] = 0x60;
            f[18..20].copy_from_slice(&((20 + payload) as u16).to_be_bytes());
            f[20] = 6;
            f[21] = 64;
            f[22..38].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
            f[38..54].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        } else {
            f[14] = 0x45;
            f[16..18].copy_from_slice(&((20 + 20 + payload) as u16).to_be_bytes());
            f[18..20].copy_from_slice(&[0x12, 0x34]);
            f[22] = 64;
            f[23] = 6;
            f[26..30].copy_from_slice(&[10, 0, 0, 1]);
            f[30..34].copy_from_slice(&[10, 0, 0, 2]);
            let cs = checksum::checksum(&f[14..34]);
            f[24..26].copy_from_slice(&cs.to_be_bytes());
        }
        let t = 14 + l3;
        f[t + 4..t + 8].copy_from_slice(&1000u32.to_be_bytes());
        f[t + 12] = 5 << 4;
        f[t + 13] = 0x18 | 0x01 | 0x80; // PSH ACK FIN CWR
        for (i, b) in f[t + 20..].iter_mut().enumerate() {
            *b = i as u8;
        }
        f
    }

    fn l4_valid(d: &[u8], v6: bool) -> bool {
        let t = if v6 { 54 } else { 34 };
        let mut s = if v6 {
            checksum::sum(&d[22..54], 0)
        } else {
            checksum::sum(&d[26..34], 0)
        };
        s += 6 + (d.len() - t) as u64;
        checksum::finish(checksum::sum(&d[t..], s)) == 0
    }

    #[test]
    fn tcp_super_frames_become_valid_segments() {
        for v6 in [false, true] {
            let f = tcp_frame(v6, 3000);
            let hdr = VnetHdr {
                gso_type: if v6 { GSO_TCPV6 } else { GSO_TCPV4 },
                gso_size: 1448,
                ..Default::default()
            };
            let mut segs = Vec::new();
            assert_eq!(segment(&f, &hdr, 5, |p| segs.push(p)).unwrap(), 3);
            let t = if v6 { 54 } else { 34 };
            let mut payload = Vec::new();
            for (i, mut p) in segs.into_iter().enumerate() {
                assert_eq!(p.checksum_state(), ChecksumState::Partial);
                assert_eq!(p.timestamp_ns(), 5);
                complete_checksum(&mut p).unwrap();
                let d = p.data();
                assert!(l4_valid(d, v6), "segment {i} v6={v6}");
                if !v6 {
                    assert_eq!(checksum::checksum(&d[14..34]), 0);
                    assert_eq!(u16::from_be_bytes([d[16], d[17]]) as usize, d.len() - 14);
                    assert_eq!(u16::from_be_bytes([d[18], d[19]]), 0x1234 + i as u16);
                } else {
                    assert_eq!(u16::from_be_bytes([d[18], d[19]]) as usize, d.len() - 54);
                }
                let seq = u32::from_be_bytes(d[t + 4..t + 8].try_into().unwrap());
                assert_eq!(seq, 1000 + (i * 1448) as u32);
                let flags = d[t + 13];
                assert_eq!(flags & 0x01 != 0, i == 2, "FIN only last");
                assert_eq!(flags & 0x80 != 0, i == 0, "CWR only first");
                payload.extend_from_slice(&d[t + 20..]);
            }
            assert_eq!(payload, f[t + 20..].to_vec());
        }
    }

    #[test]
    fn super_frames_travel_whole_and_resolve_on_demand() {
        let f = tcp_frame(true, 5000);
        let mut p = pool::alloc_large().unwrap();
        p.set_data(&f).unwrap();
        let v = VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: GSO_TCPV6,
            gso_size: 1440,
            csum_start: 54,
            csum_offset: 16,
            hdr_len: 74,
        };
        v.apply_to(&mut p);
        assert_eq!(
            VnetHdr::of_packet(&p),
            v,
            "the header a socket gets back is the one received"
        );
        let mut segs = Vec::new();
        assert_eq!(resolve_gso(p, |s| segs.push(s)).unwrap(), 4);
        assert!(segs
            .iter()
            .all(|s| s.len() <= 14 + 40 + 20 + 1440 && s.header().gso_type == GSO_NONE));
        let mut plain = pool::alloc().unwrap();
        plain.set_data(&tcp_frame(false, 10)).unwrap();
        let mut n = 0;
        assert_eq!(resolve_gso(plain, |_| n += 1).unwrap(), 1);
        assert_eq!(n, 1);
    }

    #[test]
    fn partial_checksum_is_completed() {
        let mut f = tcp_frame(false, 100);
        // Replace the TCP checksum by the pseudo-header sum, as the kernel leaves it.
        let lay = layout(&f).unwrap();
        let ps = fold(pseudo_sum(&f, &lay, f.len() - 34));
        f[50..52].copy_from_slice(&ps.to_be_bytes());
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        VnetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: 34,
            csum_offset: 16,
            ..Default::default()
        }
        .apply_to(&mut p);
        complete_checksum(&mut p).unwrap();
        assert!(l4_valid(p.data(), false));
        assert_eq!(p.checksum_state(), ChecksumState::Unknown);
    }

    #[test]
    fn lost_partial_checksums_are_recognised_and_good_ones_kept() {
        let good = tcp_frame(false, 100);
        let mut f = good.clone();
        assert!(
            !complete_if_partial(&mut f),
            "a correct checksum is left alone"
        );
        assert_eq!(f, good);
        let lay = layout(&f).unwrap();
        let ps = fold(pseudo_sum(&f, &lay, f.len() - 34));
        f[50..52].copy_from_slice(&ps.to_be_bytes());
        assert!(complete_if_partial(&mut f));
        assert!(l4_valid(&f, false));
        // Ethernet padding after the IP packet is not summed.
        let mut padded = tcp_frame(true, 2);
        let lay = layout(&padded).unwrap();
        let ps = fold(pseudo_sum(&padded, &lay, padded.len() - 54));
        padded[70..72].copy_from_slice(&ps.to_be_bytes());
        padded.extend_from_slice(&[0xee; 6]);
        assert!(complete_if_partial(&mut padded));
        let n = padded.len() - 6;
        assert!(l4_valid(&padded[..n], true));
        assert!(!complete_if_partial(&mut [0u8; 30]));
    }

    #[test]
    fn bad_input_is_refused_not_panicking() {
        let hdr = VnetHdr {
            gso_type: GSO_TCPV4,
            gso_size: 100,
            ..Default::default()
        };
        assert_eq!(
            segment(&[0u8; 10], &hdr, 0, |_| {}),
            Err(OffloadError::Truncated)
        );
        // Found by the packet_views fuzz target: a TCP data offset below 5 words.
        let mut short_tcp = tcp_frame(false, 500);
        short_tcp[34 + 12] = 2 << 4;
        assert_eq!(
            segment(&short_tcp, &hdr, 0, |_| {}),
            Err(OffloadError::NotSegmentable)
        );
        let udp_fo = VnetHdr {
            gso_type: GSO_UDP,
            gso_size: 100,
            ..Default::default()
        };
        assert_eq!(
            segment(&tcp_frame(false, 500), &udp_fo, 0, |_| {}),
            Err(OffloadError::UnsupportedGso(GSO_UDP))
        );
        let mut p = pool::alloc().unwrap();
        p.set_data(&[0u8; 20]).unwrap();
        VnetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: 18,
            csum_offset: 16,
            ..Default::default()
        }
        .apply_to(&mut p);
        assert_eq!(
            complete_checksum(&mut p),
            Err(OffloadError::BadChecksumOffset)
        );
        let mut h = [0u8; 10];
        let v = VnetHdr {
            flags: 1,
            gso_type: 4,
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 54,
            csum_offset: 16,
        };
        v.write(&mut h);
        assert_eq!(VnetHdr::parse(&h), Some(v));
    }
}
