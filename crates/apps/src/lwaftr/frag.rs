//! Fragments: IPv4 reassembly before encapsulation (only a first fragment carries the port that
//! picks the softwire), IPv6 reassembly before decapsulation, and fragmentation to the
//! configured MTUs after translation. The slow path: fragments are buffered in memory, within
//! the configured limits (fragments per packet, packets in reassembly) and a timeout.

use std::collections::HashMap;
use std::time::{Duration, Instant};
use stitch_wire::header::{ipv4, ipv6, ipv6::fragment};

/// Why a fragment was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Overlapping or inconsistent fragments (RFC 5722): the whole packet is dropped.
    Bad,
    /// More fragments than `max-fragments-per-packet`.
    TooManyFragments,
    /// More packets in reassembly than `max-packets`.
    TooManyPackets,
}

pub enum Outcome {
    Complete(Vec<u8>),
    Pending,
    Dropped(Refused),
}

struct Partial {
    /// The unfragmentable part (IPv4 header of the first fragment / IPv6 header), once seen.
    header: Option<Vec<u8>>,
    payload: Vec<u8>,
    ranges: Vec<(usize, usize)>,
    total: Option<usize>,
    fragments: u32,
    started: Instant,
}

pub struct Reassembler {
    v4: HashMap<(u32, u32, u16, u8), Partial, foldhash::fast::RandomState>,
    v6: HashMap<([u8; 16], [u8; 16], u32), Partial, foldhash::fast::RandomState>,
    max_fragments: u32,
    max_packets: usize,
    timeout: Duration,
    /// Reassembled IPv4 packets get identification 0 and no flags, as Snabb's reassembler
    /// writes them (see `Compat::Snabb`); otherwise they keep the fragments' identification
    /// and DF (RFC 791, RFC 6864 §4.1).
    zero_id: bool,
}

impl Reassembler {
    pub fn new(max_fragments: u32, max_packets: u32, zero_id: bool) -> Reassembler {
        Reassembler {
            v4: HashMap::default(),
            v6: HashMap::default(),
            max_fragments,
            max_packets: max_packets as usize,
            timeout: Duration::from_secs(2),
            zero_id,
        }
    }

    /// Forgets packets whose fragments stopped coming.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.v4.len() + self.v6.len();
        let t = self.timeout;
        self.v4.retain(|_, p| now.duration_since(p.started) < t);
        self.v6.retain(|_, p| now.duration_since(p.started) < t);
        before - self.v4.len() - self.v6.len()
    }

    /// One IPv4 fragment (the IP packet, lengths already checked).
    pub fn add_v4(&mut self, ip: &[u8], ihl: usize, total: usize, now: Instant) -> Outcome {
        let key = (
            ipv4::SRC.get(ip),
            ipv4::DST.get(ip),
            ipv4::IDENT.get(ip),
            ipv4::PROTOCOL.get(ip),
        );
        let ff = ipv4::FLAGS_FRAG.get(ip);
        let (offset, more) = (
            (ff & ipv4::OFFSET) as usize * 8,
            ff & ipv4::MORE_FRAGMENTS != 0,
        );
        if !self.v4.contains_key(&key) && self.v4.len() + self.v6.len() >= self.max_packets {
            return Outcome::Dropped(Refused::TooManyPackets);
        }
        let max = self.max_fragments;
        let p = self.v4.entry(key).or_insert_with(|| Partial::new(now));
        let header = (offset == 0).then(|| ip[..ihl].to_vec());
        match p.add(header, offset, &ip[ihl..total], more, max) {
            Err(r) => {
                self.v4.remove(&key);
                Outcome::Dropped(r)
            }
            Ok(false) => Outcome::Pending,
            Ok(true) => {
                let p = self.v4.remove(&key).unwrap();
                let mut out = p.header.unwrap();
                let len = out.len() + p.payload.len();
                if len > 65535 {
                    return Outcome::Dropped(Refused::Bad);
                }
                ipv4::TOTAL_LEN.set(&mut out, len as u16);
                if self.zero_id {
                    ipv4::IDENT.set(&mut out, 0);
                    ipv4::FLAGS_FRAG.set(&mut out, 0);
                } else {
                    // DF kept; MF and the offset cleared.
                    let df = ipv4::FLAGS_FRAG.get(&out) & ipv4::DONT_FRAGMENT;
                    ipv4::FLAGS_FRAG.set(&mut out, df);
                }
                ipv4::fill_checksum(&mut out);
                out.extend_from_slice(&p.payload);
                Outcome::Complete(out)
            }
        }
    }

    /// One IPv6 fragment: the fixed header `ip6[..40]` followed directly by the fragment header
    /// (other extension headers before it are not supported and are refused by the caller).
    pub fn add_v6(&mut self, ip6: &[u8], now: Instant) -> Outcome {
        let fh = &ip6[ipv6::LEN..ipv6::LEN + fragment::LEN];
        let key = (
            ip6[ipv6::SRC].try_into().unwrap(),
            ip6[ipv6::DST].try_into().unwrap(),
            fragment::IDENT.get(fh),
        );
        let off = fragment::OFFSET_MORE.get(fh);
        let (offset, more) = ((off >> 3) as usize * 8, off & 1 != 0);
        if !self.v6.contains_key(&key) && self.v4.len() + self.v6.len() >= self.max_packets {
            return Outcome::Dropped(Refused::TooManyPackets);
        }
        let max = self.max_fragments;
        let p = self.v6.entry(key).or_insert_with(|| Partial::new(now));
        let header = (offset == 0).then(|| {
            let mut h = ip6[..ipv6::LEN].to_vec();
            // The next header of the reassembled packet.
            ipv6::NEXT_HEADER.set(&mut h, fragment::NEXT_HEADER.get(fh));
            h
        });
        let data = &ip6[ipv6::LEN + fragment::LEN..];
        match p.add(header, offset, data, more, max) {
            Err(r) => {
                self.v6.remove(&key);
                Outcome::Dropped(r)
            }
            Ok(false) => Outcome::Pending,
            Ok(true) => {
                let p = self.v6.remove(&key).unwrap();
                let mut out = p.header.unwrap();
                if p.payload.len() > 65535 {
                    return Outcome::Dropped(Refused::Bad);
                }
                ipv6::PAYLOAD_LEN.set(&mut out, p.payload.len() as u16);
                out.extend_from_slice(&p.payload);
                Outcome::Complete(out)
            }
        }
    }
}

impl Partial {
    fn new(now: Instant) -> Partial {
        Partial {
            header: None,
            payload: Vec::new(),
            ranges: Vec::new(),
            total: None,
            fragments: 0,
            started: now,
        }
    }

    /// Adds a fragment; `Ok(true)` when the packet is complete.
    fn add(
        &mut self,
        header: Option<Vec<u8>>,
        offset: usize,
        data: &[u8],
        more: bool,
        max: u32,
    ) -> Result<bool, Refused> {
        self.fragments += 1;
        if self.fragments > max {
            return Err(Refused::TooManyFragments);
        }
        let end = offset + data.len();
        if more && (data.is_empty() || !data.len().is_multiple_of(8)) {
            return Err(Refused::Bad);
        }
        if self.ranges.iter().any(|&(a, b)| offset < b && a < end) {
            return Err(Refused::Bad);
        }
        if let Some(t) = self.total {
            if end > t || (!more && end != t) {
                return Err(Refused::Bad);
            }
        }
        if !more {
            if self.ranges.iter().any(|&(_, b)| b > end) {
                return Err(Refused::Bad);
            }
            self.total = Some(end);
        }
        if header.is_some() {
            self.header = header;
        }
        if self.payload.len() < end {
            self.payload.resize(end, 0);
        }
        self.payload[offset..end].copy_from_slice(data);
        self.ranges.push((offset, end));
        let have: usize = self.ranges.iter().map(|(a, b)| b - a).sum();
        Ok(self.header.is_some() && self.total == Some(have))
    }
}

/// How a payload of `payload_len` bytes is cut into fragments that carry at most `room`
/// payload bytes each (offsets stay on 8-byte units, so all but the last carry a multiple of
/// 8): (offset, length, more fragments) of each. IPv6 fragments leave 48 bytes of an MTU for
/// headers, IPv4 ones the header's length.
pub fn split(payload_len: usize, room: usize) -> Vec<(usize, usize, bool)> {
    let chunk = room / 8 * 8;
    let mut out = Vec::new();
    let mut off = 0;
    while off < payload_len {
        let rest = payload_len - off;
        let n = if rest <= room { rest } else { chunk };
        out.push((off, n, off + n < payload_len));
        off += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frag4(id: u16, offset: usize, more: bool, data: &[u8]) -> Vec<u8> {
        let mut ip = vec![0; 20];
        ipv4::Header {
            src: [1, 2, 3, 4].into(),
            dst: [5, 6, 7, 8].into(),
            protocol: 17,
            payload_len: data.len(),
            ttl: 64,
            dont_fragment: false,
        }
        .write(&mut ip);
        ipv4::IDENT.set(&mut ip, id);
        let more = if more { ipv4::MORE_FRAGMENTS } else { 0 };
        ipv4::FLAGS_FRAG.set(&mut ip, (offset / 8) as u16 | more);
        ip.extend_from_slice(data);
        ip
    }

    #[test]
    fn reassembles_in_any_order_and_refuses_overlaps() {
        let mut r = Reassembler::new(40, 100, false);
        let now = Instant::now();
        let body: Vec<u8> = (0..40u8).collect();
        let b = frag4(7, 16, true, &body[16..32]);
        let c = frag4(7, 32, false, &body[32..]);
        let a = frag4(7, 0, true, &body[..16]);
        for f in [&b, &c] {
            assert!(matches!(r.add_v4(f, 20, f.len(), now), Outcome::Pending));
        }
        let Outcome::Complete(p) = r.add_v4(&a, 20, a.len(), now) else {
            panic!("incomplete")
        };
        assert_eq!(&p[20..], &body[..]);
        assert_eq!(ipv4::TOTAL_LEN.get(&p), 60);
        assert_eq!(stitch_wire::checksum::checksum(&p[..20]), 0);
        // Overlap: dropped whole.
        let o = frag4(8, 8, true, &body[..16]);
        let a = frag4(8, 0, true, &body[..16]);
        assert!(matches!(r.add_v4(&a, 20, a.len(), now), Outcome::Pending));
        assert!(matches!(
            r.add_v4(&o, 20, o.len(), now),
            Outcome::Dropped(Refused::Bad)
        ));
        // Too many fragments.
        let mut r = Reassembler::new(2, 100, false);
        for (i, off) in [0usize, 8, 16].iter().enumerate() {
            let f = frag4(9, *off, true, &body[..8]);
            let out = r.add_v4(&f, 20, f.len(), now);
            if i == 2 {
                assert!(matches!(out, Outcome::Dropped(Refused::TooManyFragments)));
            }
        }
        assert_eq!(r.expire(now + Duration::from_secs(3)), 0);
    }

    #[test]
    fn split_keeps_offsets_on_8_byte_units() {
        let parts = split(3000, 1460 - 48);
        assert_eq!(
            parts,
            [(0, 1408, true), (1408, 1408, true), (2816, 184, false)]
        );
    }
}
