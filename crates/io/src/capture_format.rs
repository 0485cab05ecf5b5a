//! PCAP and PCAPNG records as libpcap writes them: in the host's byte order (readers see the
//! order from the magic number), nanosecond timestamps, Ethernet link type. Shared by the
//! capture files (`capture_file`) and captures of running links (`link_capture`).

use serde::{Deserialize, Serialize};
use stitch_core::packet::now_ns;

#[derive(schemars::JsonSchema, Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Pcap,
    Pcapng,
}

impl Format {
    /// `pcapng` for a `.pcapng` file name, `pcap` otherwise.
    pub fn for_path(p: &std::path::Path) -> Format {
        if p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("pcapng"))
        {
            Format::Pcapng
        } else {
            Format::Pcap
        }
    }

    /// The MIME type of a stream in this format.
    pub fn media_type(self) -> &'static str {
        match self {
            Format::Pcap => "application/vnd.tcpdump.pcap",
            Format::Pcapng => "application/x-pcapng",
        }
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "pcap" => Ok(Format::Pcap),
            "pcapng" => Ok(Format::Pcapng),
            _ => Err(format!("unknown format `{s}`: pcap or pcapng")),
        }
    }
}

/// Which way a packet went, from the point of view of the app a capture was asked about
/// (PCAPNG `epb_flags` bits 0–1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Unknown,
    Inbound,
    Outbound,
}

const LINKTYPE_ETHERNET: u16 = 1;

/// The PCAP file header (nanosecond magic).
pub fn pcap_header(snaplen: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(24);
    h.extend_from_slice(&0xa1b2_3c4du32.to_ne_bytes());
    h.extend_from_slice(&2u16.to_ne_bytes());
    h.extend_from_slice(&4u16.to_ne_bytes());
    h.extend_from_slice(&0i32.to_ne_bytes());
    h.extend_from_slice(&0u32.to_ne_bytes());
    h.extend_from_slice(&snaplen.to_ne_bytes());
    h.extend_from_slice(&u32::from(LINKTYPE_ETHERNET).to_ne_bytes());
    h
}

/// A PCAPNG section header block (section length unknown: the file is written as it goes).
pub fn section_header() -> Vec<u8> {
    let len = 28u32;
    let mut h = Vec::with_capacity(len as usize);
    h.extend_from_slice(&0x0a0d_0d0au32.to_ne_bytes());
    h.extend_from_slice(&len.to_ne_bytes());
    h.extend_from_slice(&0x1a2b_3c4du32.to_ne_bytes());
    h.extend_from_slice(&1u16.to_ne_bytes());
    h.extend_from_slice(&0u16.to_ne_bytes());
    h.extend_from_slice(&(-1i64).to_ne_bytes());
    h.extend_from_slice(&len.to_ne_bytes());
    h
}

/// A PCAPNG interface description block: Ethernet, nanosecond timestamps, `if_name` and, when
/// given, `if_description`.
pub fn interface_block(name: &str, description: Option<&str>, snaplen: u32) -> Vec<u8> {
    let mut opts = Vec::new();
    push_option(&mut opts, 2, name.as_bytes());
    if let Some(d) = description {
        push_option(&mut opts, 3, d.as_bytes());
    }
    push_option(&mut opts, 9, &[9]); // if_tsresol: 10^-9
    opts.extend_from_slice(&[0, 0, 0, 0]);
    let len = (20 + opts.len()) as u32;
    let mut b = Vec::with_capacity(len as usize);
    b.extend_from_slice(&1u32.to_ne_bytes());
    b.extend_from_slice(&len.to_ne_bytes());
    b.extend_from_slice(&LINKTYPE_ETHERNET.to_ne_bytes());
    b.extend_from_slice(&0u16.to_ne_bytes());
    b.extend_from_slice(&snaplen.to_ne_bytes());
    b.extend_from_slice(&opts);
    b.extend_from_slice(&len.to_ne_bytes());
    b
}

/// Counters at the end of a PCAPNG capture of one interface.
#[derive(Debug, Clone, Copy, Default)]
pub struct InterfaceCounts {
    /// Packets the interface (the tapped link) carried while captured.
    pub received: u64,
    /// Packets lost by the capture (no room for them).
    pub dropped: u64,
    /// Packets the filter accepted, when there was a filter.
    pub accepted: Option<u64>,
}

/// A PCAPNG interface statistics block for interface `interface`.
pub fn statistics_block(interface: u32, counts: InterfaceCounts) -> Vec<u8> {
    let mut opts = Vec::new();
    push_option(&mut opts, 4, &counts.received.to_ne_bytes()); // isb_ifrecv
    push_option(&mut opts, 5, &counts.dropped.to_ne_bytes()); // isb_ifdrop
    if let Some(a) = counts.accepted {
        push_option(&mut opts, 6, &a.to_ne_bytes()); // isb_filteraccept
    }
    opts.extend_from_slice(&[0, 0, 0, 0]);
    let len = (24 + opts.len()) as u32;
    let ts = now_ns();
    let mut b = Vec::with_capacity(len as usize);
    b.extend_from_slice(&5u32.to_ne_bytes());
    b.extend_from_slice(&len.to_ne_bytes());
    b.extend_from_slice(&interface.to_ne_bytes());
    b.extend_from_slice(&((ts >> 32) as u32).to_ne_bytes());
    b.extend_from_slice(&(ts as u32).to_ne_bytes());
    b.extend_from_slice(&opts);
    b.extend_from_slice(&len.to_ne_bytes());
    b
}

/// One interface of a capture stream: a tapped link, named `app.port -> app.port`.
pub struct StreamInterface {
    pub name: String,
    pub description: String,
}

/// The start of a capture stream: the PCAP file header, or the PCAPNG section header and one
/// interface description block per interface (interface ids in this order).
pub fn stream_header(format: Format, snaplen: u32, interfaces: &[StreamInterface]) -> Vec<u8> {
    match format {
        Format::Pcap => pcap_header(snaplen),
        Format::Pcapng => {
            let mut h = section_header();
            for i in interfaces {
                h.extend(interface_block(&i.name, Some(&i.description), snaplen));
            }
            h
        }
    }
}

/// The end of a capture stream: for PCAPNG one interface statistics block per interface, in
/// interface order; nothing for PCAP, which has no place for them.
pub fn stream_trailer(format: Format, counts: &[InterfaceCounts]) -> Vec<u8> {
    if format != Format::Pcapng {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, c) in counts.iter().enumerate() {
        out.extend(statistics_block(i as u32, *c));
    }
    out
}

fn push_option(v: &mut Vec<u8>, code: u16, value: &[u8]) {
    v.extend_from_slice(&code.to_ne_bytes());
    v.extend_from_slice(&(value.len() as u16).to_ne_bytes());
    v.extend_from_slice(value);
    v.resize(v.len().next_multiple_of(4), 0);
}

/// Where and how a packet was seen, for its record.
#[derive(Debug, Clone, Copy)]
pub struct RecordMeta {
    pub ts_ns: u64,
    pub orig_len: usize,
    /// PCAPNG interface id.
    pub interface: u32,
    pub direction: Direction,
}

/// Bytes of the record for `caplen` bytes of packet.
pub fn record_len(format: Format, caplen: usize, direction: Direction) -> usize {
    match format {
        Format::Pcap => 16 + caplen,
        Format::Pcapng if direction == Direction::Unknown => 32 + caplen.next_multiple_of(4),
        // epb_flags (8 bytes) and the end of options (4).
        Format::Pcapng => 44 + caplen.next_multiple_of(4),
    }
}

/// Appends one record holding `data`, the first bytes of a packet described by `meta`.
#[inline]
pub fn append_record(buf: &mut Vec<u8>, format: Format, meta: RecordMeta, data: &[u8]) {
    let ts = meta.ts_ns;
    match format {
        Format::Pcap => {
            let mut h = [0u8; 16];
            h[0..4].copy_from_slice(&((ts / 1_000_000_000) as u32).to_ne_bytes());
            h[4..8].copy_from_slice(&((ts % 1_000_000_000) as u32).to_ne_bytes());
            h[8..12].copy_from_slice(&(data.len() as u32).to_ne_bytes());
            h[12..16].copy_from_slice(&(meta.orig_len as u32).to_ne_bytes());
            buf.extend_from_slice(&h);
            buf.extend_from_slice(data);
        }
        Format::Pcapng => {
            let padded = data.len().next_multiple_of(4);
            let len = record_len(format, data.len(), meta.direction) as u32;
            let mut h = [0u8; 28];
            h[0..4].copy_from_slice(&6u32.to_ne_bytes());
            h[4..8].copy_from_slice(&len.to_ne_bytes());
            h[8..12].copy_from_slice(&meta.interface.to_ne_bytes());
            h[12..16].copy_from_slice(&((ts >> 32) as u32).to_ne_bytes());
            h[16..20].copy_from_slice(&(ts as u32).to_ne_bytes());
            h[20..24].copy_from_slice(&(data.len() as u32).to_ne_bytes());
            h[24..28].copy_from_slice(&(meta.orig_len as u32).to_ne_bytes());
            buf.extend_from_slice(&h);
            buf.extend_from_slice(data);
            buf.resize(buf.len() + padded - data.len(), 0);
            let flags = match meta.direction {
                Direction::Unknown => None,
                Direction::Inbound => Some(1u32),
                Direction::Outbound => Some(2u32),
            };
            if let Some(f) = flags {
                buf.extend_from_slice(&2u16.to_ne_bytes()); // epb_flags
                buf.extend_from_slice(&4u16.to_ne_bytes());
                buf.extend_from_slice(&f.to_ne_bytes());
                buf.extend_from_slice(&[0, 0, 0, 0]);
            }
            buf.extend_from_slice(&len.to_ne_bytes());
        }
    }
}

/// Length of the record at the start of `buf` (0 if unreadable), for buffers that hold only
/// whole records written by `append_record`.
pub fn record_at(buf: &[u8], format: Format) -> usize {
    let word = |o: usize| {
        buf.get(o..o + 4)
            .map(|b| u32::from_ne_bytes(b.try_into().unwrap()) as usize)
    };
    match format {
        Format::Pcap => word(8).map(|l| 16 + l).unwrap_or(0),
        Format::Pcapng => word(4).unwrap_or(0),
    }
}

/// Counts the packets of a PCAP or PCAPNG stream and reads the drops from its interface
/// statistics blocks, fed in pieces as they arrive (what a client of a capture stream prints
/// at the end). Assumes the host's byte order, as this module writes.
#[derive(Debug, Default)]
pub struct StreamTally {
    pending: Vec<u8>,
    header_seen: bool,
    format: Option<Format>,
    pub packets: u64,
    /// Sum of `isb_ifdrop` over the interfaces.
    pub dropped: u64,
    /// Sum of `isb_ifrecv` over the interfaces.
    pub received: u64,
}

impl StreamTally {
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let need = self.next_len();
            let take = need
                .saturating_sub(self.pending.len())
                .min(bytes.len())
                .max(1);
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() >= self.next_len() {
                self.consume();
            }
        }
    }

    /// Bytes of the piece being read: a header first, then the whole record or block.
    fn next_len(&self) -> usize {
        let word = |o: usize| {
            self.pending
                .get(o..o + 4)
                .map(|b| u32::from_ne_bytes(b.try_into().unwrap()) as usize)
        };
        match self.format {
            None => 4,
            Some(Format::Pcap) if !self.header_seen => 24,
            Some(Format::Pcap) => word(8).map_or(16, |caplen| 16 + caplen),
            Some(Format::Pcapng) => word(4).map_or(8, |len| len.max(12)),
        }
    }

    fn consume(&mut self) {
        let p = std::mem::take(&mut self.pending);
        match self.format {
            None => {
                let magic = u32::from_ne_bytes(p[..4].try_into().unwrap());
                self.format = Some(if magic == 0x0a0d_0d0a {
                    Format::Pcapng
                } else {
                    Format::Pcap
                });
                self.pending = p;
            }
            Some(Format::Pcap) if !self.header_seen => self.header_seen = true,
            Some(Format::Pcap) => self.packets += 1,
            Some(Format::Pcapng) => {
                let kind = u32::from_ne_bytes(p[..4].try_into().unwrap());
                match kind {
                    6 | 3 => self.packets += 1,
                    5 => self.read_statistics(&p),
                    _ => {}
                }
            }
        }
    }

    fn read_statistics(&mut self, block: &[u8]) {
        let mut at = 20;
        while at + 4 <= block.len().saturating_sub(4) {
            let code = u16::from_ne_bytes([block[at], block[at + 1]]);
            let len = u16::from_ne_bytes([block[at + 2], block[at + 3]]) as usize;
            let value = block.get(at + 4..at + 4 + len);
            match (code, value) {
                (0, _) | (_, None) => break,
                (4, Some(v)) if len == 8 => {
                    self.received += u64::from_ne_bytes(v.try_into().unwrap())
                }
                (5, Some(v)) if len == 8 => {
                    self.dropped += u64::from_ne_bytes(v.try_into().unwrap())
                }
                _ => {}
            }
            at += 4 + len.next_multiple_of(4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(format: Format) -> Vec<u8> {
        let mut s = match format {
            Format::Pcap => pcap_header(100),
            Format::Pcapng => {
                let mut h = section_header();
                h.extend(interface_block("a.output -> b.input", None, 100));
                h
            }
        };
        for n in 0..7usize {
            let meta = RecordMeta {
                ts_ns: 1,
                orig_len: 60 + n,
                interface: 0,
                direction: Direction::Inbound,
            };
            append_record(&mut s, format, meta, &vec![n as u8; 60 + n]);
        }
        if format == Format::Pcapng {
            let counts = InterfaceCounts {
                received: 9,
                dropped: 2,
                accepted: Some(7),
            };
            s.extend(statistics_block(0, counts));
        }
        s
    }

    #[test]
    fn the_tally_counts_packets_and_drops_however_the_stream_is_cut() {
        for format in [Format::Pcap, Format::Pcapng] {
            let s = stream(format);
            for piece in [1, 3, 7, 64, s.len()] {
                let mut t = StreamTally::default();
                for chunk in s.chunks(piece) {
                    t.feed(chunk);
                }
                assert_eq!(t.packets, 7, "{format:?} in pieces of {piece}");
                if format == Format::Pcapng {
                    assert_eq!((t.received, t.dropped), (9, 2));
                }
            }
        }
    }
}
