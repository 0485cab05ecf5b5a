//! Captures of the links of a running graph, without changing the graph: a [`LinkCapture`]
//! puts a tap on each selected link ([`Ring::add_tap`]) and turns what the taps saw into a
//! PCAPNG (or PCAP) stream, one interface per link named `app.port -> app.port`.
//!
//! The tap runs on the thread of the app that receives from the link, once per batch: it runs
//! the filter (libpcap syntax, compiled once), and copies the first `snaplen` bytes of each
//! matching packet with its length and the time into a byte ring of its own. It never waits:
//! when the ring is full — the reader fell behind — the packet is counted as dropped by the tap
//! and goes on unrecorded. The reader ([`LinkCapture::poll`]) formats records from the rings on
//! its own thread. Dropping the capture removes the taps.

use crate::capture_format::{
    append_record, interface_block, pcap_header, section_header, statistics_block, Direction,
    Format, InterfaceCounts, RecordMeta,
};
use ringbuf::traits::{Consumer as _, Observer as _, Producer as _, Split as _};
use ringbuf::{HeapCons, HeapProd, HeapRb};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::graph::LinkDecl;
use stitch_core::link::{LinkTap, Ring};
use stitch_core::packet::{now_ns, Packet};
use stitch_wire::filter::PacketFilter;

/// Bytes in front of each packet in a tap's ring: time (ns), original length, bytes kept.
const TAP_RECORD_HEADER: usize = 16;

/// What to capture and when to stop.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    pub format: Format,
    /// Bytes kept of each packet.
    pub snaplen: u32,
    /// libpcap filter expression; packets that do not match are not copied.
    pub filter: Option<String>,
    /// Stop after this many packets (all links together).
    pub count: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Bytes of each tap's ring between the data path and the reader.
    pub ring_bytes: usize,
}

impl Default for CaptureOptions {
    fn default() -> CaptureOptions {
        CaptureOptions {
            format: Format::Pcapng,
            snaplen: 262_144,
            filter: None,
            count: None,
            duration: None,
            ring_bytes: 16 << 20,
        }
    }
}

/// One link chosen for a capture.
#[derive(Clone)]
pub struct SelectedLink {
    /// `app.port -> app.port`.
    pub name: String,
    pub direction: Direction,
    pub ring: Arc<Ring>,
}

/// The links `selector` names among `links`: `APP` (every link of the app), `APP.PORT` (the
/// links of that port, both directions) or a whole link `APP.PORT -> APP.PORT`. Directions are
/// seen from the named app. The error names what exists.
pub fn select_links(
    links: &[(LinkDecl, Arc<Ring>)],
    selector: &str,
) -> Result<Vec<SelectedLink>, String> {
    let selector = selector.trim();
    let chosen = |d: &LinkDecl, r: &Arc<Ring>, direction| SelectedLink {
        name: d.spec(),
        direction,
        ring: r.clone(),
    };
    let found: Vec<SelectedLink> = if let Some((from, to)) = selector.split_once("->") {
        let (from, to) = (from.trim(), to.trim());
        links
            .iter()
            .filter(|(d, _)| d.from.to_string() == from && d.to.to_string() == to)
            .map(|(d, r)| chosen(d, r, Direction::Unknown))
            .collect()
    } else {
        let (app, port) = match selector.split_once('.') {
            Some((a, p)) => (a, Some(p)),
            None => (selector, None),
        };
        let here =
            |e: &stitch_core::graph::Endpoint| e.app == app && port.is_none_or(|p| e.port == p);
        links
            .iter()
            .filter_map(|(d, r)| {
                if here(&d.to) {
                    Some(chosen(d, r, Direction::Inbound))
                } else if here(&d.from) {
                    Some(chosen(d, r, Direction::Outbound))
                } else {
                    None
                }
            })
            .collect()
    };
    if found.is_empty() {
        let names: Vec<String> = links.iter().map(|(d, _)| d.spec()).collect();
        return Err(format!(
            "no link of the running graph matches `{selector}` (give APP, APP.PORT or `APP.PORT -> APP.PORT`); its links: {}",
            if names.is_empty() { "none".to_string() } else { names.join(", ") }
        ));
    }
    Ok(found)
}

/// The data-path half of one link's capture.
struct Tap {
    writer: Mutex<TapWriter>,
    /// Packets the link delivered while tapped.
    seen: AtomicU64,
    /// Packets that matched the filter (all of them without one).
    accepted: AtomicU64,
    /// Matching packets the ring had no room for.
    dropped: AtomicU64,
}

struct TapWriter {
    filter: Option<PacketFilter>,
    snaplen: usize,
    ring: HeapProd<u8>,
}

impl LinkTap for Tap {
    fn observe(&self, packets: &[Packet]) {
        self.seen.fetch_add(packets.len() as u64, Relaxed);
        // Only the link's consumer takes this lock; it is never held while it waits for anything.
        let Ok(mut w) = self.writer.try_lock() else {
            self.dropped.fetch_add(packets.len() as u64, Relaxed);
            return;
        };
        let w = &mut *w;
        let now = now_ns();
        let (mut accepted, mut dropped) = (0u64, 0u64);
        for p in packets {
            let frame = p.data();
            if w.filter.as_ref().is_some_and(|f| !f.matches(frame)) {
                continue;
            }
            accepted += 1;
            let kept = &frame[..frame.len().min(w.snaplen)];
            if w.ring.vacant_len() < TAP_RECORD_HEADER + kept.len() {
                dropped += 1;
                continue;
            }
            let mut h = [0u8; TAP_RECORD_HEADER];
            h[0..8].copy_from_slice(&now.to_ne_bytes());
            h[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
            h[12..16].copy_from_slice(&(kept.len() as u32).to_ne_bytes());
            w.ring.push_slice(&h);
            w.ring.push_slice(kept);
        }
        self.accepted.fetch_add(accepted, Relaxed);
        self.dropped.fetch_add(dropped, Relaxed);
    }
}

struct TappedLink {
    name: String,
    direction: Direction,
    ring: Arc<Ring>,
    tap: Arc<Tap>,
    /// The same tap as the ring holds it (to remove it).
    installed: Arc<dyn LinkTap>,
    records: HeapCons<u8>,
}

/// Counters of one tapped link.
#[derive(Debug, Clone, Serialize)]
pub struct TapStats {
    pub link: String,
    pub direction: Direction,
    pub seen: u64,
    pub accepted: u64,
    pub captured: u64,
    pub dropped: u64,
}

/// Why a capture ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    Count,
    Duration,
    /// Every tapped link left the running graph.
    LinksGone,
}

/// A capture of some links of a running graph.
pub struct LinkCapture {
    links: Vec<TappedLink>,
    options: CaptureOptions,
    captured: Vec<u64>,
    total: u64,
    deadline: Option<Instant>,
    next_link: usize,
}

impl LinkCapture {
    /// Taps `links`. A filter that does not compile is refused before anything is tapped.
    pub fn start(links: Vec<SelectedLink>, options: CaptureOptions) -> Result<LinkCapture, String> {
        if options.snaplen == 0 {
            return Err("snaplen must be at least 1".into());
        }
        let filter = options
            .filter
            .as_deref()
            .map(str::trim)
            .filter(|f| !f.is_empty());
        let mut tapped = Vec::with_capacity(links.len());
        for l in links {
            let (prod, cons) = HeapRb::<u8>::new(options.ring_bytes.max(1 << 16)).split();
            let tap = Arc::new(Tap {
                writer: Mutex::new(TapWriter {
                    filter: filter.map(PacketFilter::compile).transpose()?,
                    snaplen: options.snaplen as usize,
                    ring: prod,
                }),
                seen: AtomicU64::new(0),
                accepted: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
            });
            tapped.push(TappedLink {
                name: l.name,
                direction: l.direction,
                ring: l.ring,
                installed: tap.clone(),
                tap,
                records: cons,
            });
        }
        for l in &tapped {
            l.ring.add_tap(l.installed.clone());
        }
        Ok(LinkCapture {
            captured: vec![0; tapped.len()],
            links: tapped,
            deadline: options.duration.map(|d| Instant::now() + d),
            options,
            total: 0,
            next_link: 0,
        })
    }

    pub fn format(&self) -> Format {
        self.options.format
    }

    /// The names of the tapped links, in interface order.
    pub fn link_names(&self) -> Vec<String> {
        self.links.iter().map(|l| l.name.clone()).collect()
    }

    /// The start of the stream: the PCAP file header, or the PCAPNG section header and one
    /// interface per link.
    pub fn header(&self, instance: &str) -> Vec<u8> {
        match self.options.format {
            Format::Pcap => pcap_header(self.options.snaplen),
            Format::Pcapng => {
                let mut h = section_header();
                for l in &self.links {
                    let description = format!("link {} of stitch instance {instance}", l.name);
                    h.extend(interface_block(
                        &l.name,
                        Some(&description),
                        self.options.snaplen,
                    ));
                }
                h
            }
        }
    }

    /// Appends the records the taps hold to `out`, up to about `max_bytes`, taking turns
    /// between links. Returns why the capture is over, if it is.
    pub fn poll(&mut self, out: &mut Vec<u8>, max_bytes: usize) -> Option<EndReason> {
        let limit = out.len() + max_bytes;
        let n = self.links.len();
        let mut idle = 0;
        while idle < n && out.len() < limit {
            if self.options.count.is_some_and(|c| self.total >= c) {
                return Some(EndReason::Count);
            }
            let i = self.next_link;
            self.next_link = (i + 1) % n;
            if self.take_record(i, out) {
                idle = 0;
            } else {
                idle += 1;
            }
        }
        if self.options.count.is_some_and(|c| self.total >= c) {
            return Some(EndReason::Count);
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(EndReason::Duration);
        }
        // The capture holds one reference; the running graph holds the others.
        if self.links.iter().all(|l| Arc::strong_count(&l.ring) == 1) && idle == n {
            return Some(EndReason::LinksGone);
        }
        None
    }

    /// Moves one whole record of link `i` from its ring to `out`; false when there is none yet.
    fn take_record(&mut self, i: usize, out: &mut Vec<u8>) -> bool {
        let l = &mut self.links[i];
        let mut h = [0u8; TAP_RECORD_HEADER];
        if l.records.occupied_len() < TAP_RECORD_HEADER {
            return false;
        }
        copy_front(&l.records, &mut h);
        let ts_ns = u64::from_ne_bytes(h[0..8].try_into().unwrap());
        let orig_len = u32::from_ne_bytes(h[8..12].try_into().unwrap()) as usize;
        let kept = u32::from_ne_bytes(h[12..16].try_into().unwrap()) as usize;
        // The tap writes the header and the bytes in two steps: wait for both.
        if l.records.occupied_len() < TAP_RECORD_HEADER + kept {
            return false;
        }
        l.records.skip(TAP_RECORD_HEADER);
        let meta = RecordMeta {
            ts_ns,
            orig_len,
            interface: i as u32,
            direction: l.direction,
        };
        let (a, b) = l.records.as_slices();
        if a.len() >= kept {
            append_record(out, self.options.format, meta, &a[..kept]);
        } else {
            let mut data = Vec::with_capacity(kept);
            data.extend_from_slice(a);
            data.extend_from_slice(&b[..kept - a.len()]);
            append_record(out, self.options.format, meta, &data);
        }
        l.records.skip(kept);
        self.captured[i] += 1;
        self.total += 1;
        true
    }

    /// Counters of every tapped link.
    pub fn stats(&self) -> Vec<TapStats> {
        self.links
            .iter()
            .zip(&self.captured)
            .map(|(l, &captured)| TapStats {
                link: l.name.clone(),
                direction: l.direction,
                seen: l.tap.seen.load(Relaxed),
                accepted: l.tap.accepted.load(Relaxed),
                captured,
                dropped: l.tap.dropped.load(Relaxed),
            })
            .collect()
    }

    /// Removes the taps and returns the end of the stream: for PCAPNG one interface statistics
    /// block per link (packets the link carried, those the tap dropped, those the filter took).
    /// Records still in the rings are not written (a count was reached, or the reader stops).
    pub fn finish(&mut self) -> Vec<u8> {
        self.remove_taps();
        if self.options.format != Format::Pcapng {
            return Vec::new();
        }
        let filtered = self.options.filter.is_some();
        let mut out = Vec::new();
        for (i, s) in self.stats().iter().enumerate() {
            let counts = InterfaceCounts {
                received: s.seen,
                dropped: s.dropped,
                accepted: filtered.then_some(s.accepted),
            };
            out.extend(statistics_block(i as u32, counts));
        }
        out
    }

    fn remove_taps(&mut self) {
        for l in &self.links {
            l.ring.remove_tap(&l.installed);
        }
    }
}

impl Drop for LinkCapture {
    fn drop(&mut self) {
        self.remove_taps();
    }
}

/// Copies the first `out.len()` bytes queued in `ring` without taking them.
fn copy_front(ring: &HeapCons<u8>, out: &mut [u8]) {
    let (a, b) = ring.as_slices();
    let n = a.len().min(out.len());
    out[..n].copy_from_slice(&a[..n]);
    let rest = out.len() - n;
    out[n..].copy_from_slice(&b[..rest]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::graph::Endpoint;
    use stitch_core::link::{link, Consumer, Producer};
    use stitch_core::pool;

    fn decl(from: (&str, &str), to: (&str, &str)) -> LinkDecl {
        let e = |(app, port): (&str, &str)| Endpoint {
            app: app.into(),
            port: port.into(),
        };
        LinkDecl {
            from: e(from),
            to: e(to),
            size: 64,
            line: 0,
        }
    }

    fn udp_frame(n: u8, len: usize) -> Packet {
        let mut f = vec![0u8; len];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[23] = if n.is_multiple_of(2) { 17 } else { 6 };
        f[len - 1] = n;
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        p
    }

    type Links = Vec<(LinkDecl, Arc<Ring>)>;

    fn two_links() -> (Links, Vec<(Producer, Consumer)>) {
        let a = link(64);
        let b = link(64);
        let links = vec![
            (decl(("gen", "output"), ("fw", "input")), a.0.ring().clone()),
            (decl(("fw", "output"), ("out", "input")), b.0.ring().clone()),
        ];
        (links, vec![a, b])
    }

    #[test]
    fn selectors_name_apps_ports_and_links() {
        let (links, _ends) = two_links();
        let sel = |s: &str| {
            select_links(&links, s).map(|v| {
                v.iter()
                    .map(|l| (l.name.clone(), l.direction))
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(
            sel("fw").unwrap(),
            vec![
                ("gen.output -> fw.input".into(), Direction::Inbound),
                ("fw.output -> out.input".into(), Direction::Outbound)
            ]
        );
        assert_eq!(
            sel("fw.output").unwrap(),
            vec![("fw.output -> out.input".into(), Direction::Outbound)]
        );
        assert_eq!(
            sel("gen.output->fw.input").unwrap(),
            vec![("gen.output -> fw.input".into(), Direction::Unknown)]
        );
        let e = sel("nat").unwrap_err();
        assert!(
            e.contains("`nat`") && e.contains("fw.output -> out.input"),
            "{e}"
        );
        assert!(sel("fw.nope").is_err());
    }

    #[test]
    fn captures_what_the_consumer_receives_filtered_and_cut_to_snaplen() {
        let (links, mut ends) = two_links();
        let chosen = select_links(&links, "fw").unwrap();
        let options = CaptureOptions {
            snaplen: 100,
            filter: Some("udp".into()),
            ring_bytes: 1 << 16,
            ..Default::default()
        };
        let mut cap = LinkCapture::start(chosen, options).unwrap();
        assert_eq!(links[0].1.tap_count(), 1);
        for n in 0..10u8 {
            ends[0].0.transmit(udp_frame(n, 60 + n as usize * 20));
        }
        let (first, rest) = ends.split_at_mut(1);
        first[0].1.forward_to(&mut rest[0].0);
        let _ = rest[0].1.drain().count();
        let mut out = cap.header("test");
        assert_eq!(cap.poll(&mut out, 1 << 20), None);
        let stats = cap.stats();
        assert_eq!(
            (stats[0].seen, stats[0].accepted, stats[0].captured),
            (10, 5, 5)
        );
        assert_eq!((stats[1].seen, stats[1].captured), (10, 5));
        out.extend(cap.finish());
        assert_eq!(links[0].1.tap_count(), 0, "finishing removes the taps");
        // Read back with an independent reader.
        let mut reader = pcap_file::pcapng::PcapNgReader::new(&out[..]).unwrap();
        let mut packets = Vec::new();
        while let Some(b) = reader.next_block() {
            if let pcap_file::pcapng::Block::EnhancedPacket(p) = b.unwrap() {
                packets.push((
                    p.interface_id,
                    p.original_len,
                    p.data.len(),
                    p.options.len(),
                ));
            }
        }
        assert_eq!(packets.len(), 10);
        assert!(packets.iter().all(|p| p.3 == 1), "direction flags");
        let lens: Vec<u32> = packets.iter().filter(|p| p.0 == 0).map(|p| p.1).collect();
        assert_eq!(lens, vec![60, 100, 140, 180, 220]);
        assert!(packets.iter().all(|p| p.2 <= 100));
    }

    #[test]
    fn a_full_ring_drops_and_counts_and_count_ends_the_capture() {
        let (links, mut ends) = two_links();
        let chosen = select_links(&links, "gen.output -> fw.input").unwrap();
        let options = CaptureOptions {
            count: Some(3),
            ring_bytes: 1 << 16,
            ..Default::default()
        };
        let mut cap = LinkCapture::start(chosen, options).unwrap();
        // 64 KiB of ring: 1500-byte frames overflow it within one batch of 64.
        for _ in 0..2 {
            for n in 0..60u8 {
                ends[0].0.transmit(udp_frame(n, 1500));
            }
            let _ = ends[0].1.drain().count();
        }
        let s = &cap.stats()[0];
        assert_eq!(s.seen, 120);
        assert!(s.dropped > 0 && s.dropped < 120, "{s:?}");
        let mut out = Vec::new();
        assert_eq!(cap.poll(&mut out, 1 << 20), Some(EndReason::Count));
        assert_eq!(cap.stats()[0].captured, 3);
    }

    #[test]
    fn a_bad_filter_is_refused_before_tapping() {
        let (links, _ends) = two_links();
        let chosen = select_links(&links, "fw").unwrap();
        let options = CaptureOptions {
            filter: Some("udp and and".into()),
            ..Default::default()
        };
        let e = LinkCapture::start(chosen, options).err().unwrap();
        assert!(e.contains("udp and and"), "{e}");
        assert!(links.iter().all(|(_, r)| r.tap_count() == 0));
    }
}
