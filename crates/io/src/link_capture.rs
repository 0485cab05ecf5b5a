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
    append_record, stream_header, stream_trailer, Direction, Format, InterfaceCounts, RecordMeta,
    StreamInterface,
};
use ringbuf::traits::{Consumer as _, Producer as _, Raw as _, Split as _};
use ringbuf::{HeapCons, HeapProd, HeapRb};
use serde::Serialize;
use std::mem::MaybeUninit;
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

/// One link chosen for a capture; `link` is what the data path knows it by (the engine's
/// ring, a kernel data plane's VID).
#[derive(Clone)]
pub struct SelectedLink<L = Arc<Ring>> {
    /// `app.port -> app.port`.
    pub name: String,
    pub direction: Direction,
    pub link: L,
}

/// The links `selector` names among `links`: `APP` (every link of the app), `APP.PORT` (the
/// links of that port, both directions) or a whole link `APP.PORT -> APP.PORT`. Directions are
/// seen from the named app. The error names what exists.
pub fn select_links<L: Clone>(
    links: &[(LinkDecl, L)],
    selector: &str,
) -> Result<Vec<SelectedLink<L>>, String> {
    let selector = selector.trim();
    let chosen = |d: &LinkDecl, l: &L, direction| SelectedLink {
        name: d.spec(),
        direction,
        link: l.clone(),
    };
    let found: Vec<SelectedLink<L>> = if let Some((from, to)) = selector.split_once("->") {
        let (from, to) = (from.trim(), to.trim());
        links
            .iter()
            .filter(|(d, _)| d.from.to_string() == from && d.to.to_string() == to)
            .map(|(d, l)| chosen(d, l, Direction::Unknown))
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
            .filter_map(|(d, l)| {
                if here(&d.to) {
                    Some(chosen(d, l, Direction::Inbound))
                } else if here(&d.from) {
                    Some(chosen(d, l, Direction::Outbound))
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

/// Packets a filter judges per call into its machine code.
const FILTER_BATCH: usize = 256;

impl LinkTap for Tap {
    fn observe(&self, packets: &[Packet]) {
        // Only the link's consumer takes this lock; it is never held while it waits for anything.
        let Ok(mut w) = self.writer.try_lock() else {
            return;
        };
        // The counters have one writer, the holder of the lock: no read-modify-write needed.
        let bump = |c: &AtomicU64, n: u64| c.store(c.load(Relaxed) + n, Relaxed);
        bump(&self.seen, packets.len() as u64);
        let w = &mut *w;
        let mut records = Records {
            ring: Some(&mut w.ring),
            room: None,
            now: None,
            snaplen: w.snaplen,
            accepted: 0,
            dropped: 0,
        };
        match &w.filter {
            Some(filter) => records.take_matching(filter, packets),
            None => records.take_all(packets),
        }
        let (accepted, dropped) = (records.accepted, records.dropped);
        let written = records.room.map_or(0, |room| room.written);
        if written > 0 {
            // SAFETY: `VacantBytes::put` initialised exactly the first `written` bytes of the
            // vacant slices ringbuf gave out in `Records::room`, in order, and nothing else
            // touched the ring since.
            unsafe { w.ring.advance_write_index(written) };
        }
        if accepted > 0 {
            bump(&self.accepted, accepted);
            bump(&self.dropped, dropped);
        }
    }
}

/// One batch's records going into a tap's ring, with the batch's counts. The ring's indices and
/// the clock are read only once a packet is to be recorded: a filter that takes nothing leaves
/// the lines the reader's core polls alone.
struct Records<'r> {
    ring: Option<&'r mut HeapProd<u8>>,
    room: Option<VacantBytes<'r>>,
    /// The batch's time, read at its first record.
    now: Option<u64>,
    snaplen: usize,
    accepted: u64,
    dropped: u64,
}

impl<'r> Records<'r> {
    /// The free part of the ring, looked up at the first call: one look at the reader's index
    /// per batch.
    fn room(&mut self) -> &mut VacantBytes<'r> {
        if self.room.is_none() {
            let ring = self.ring.take().expect("the ring is lent once");
            let (first, second) = ring.vacant_slices_mut();
            self.room = Some(VacantBytes {
                first,
                second,
                written: 0,
            });
        }
        self.room.as_mut().expect("just set")
    }

    /// Without a filter every packet is taken: once one does not fit, the rest of the batch is
    /// dropped without reading a byte of it.
    fn take_all(&mut self, packets: &[Packet]) {
        // The apps before the tap may never have read these frames: ask for them ahead.
        const AHEAD: usize = 4;
        packets.iter().take(AHEAD).for_each(Packet::prefetch_data);
        for (i, p) in packets.iter().enumerate() {
            if self.room().left() < TAP_RECORD_HEADER + p.len().min(self.snaplen) {
                let rest = (packets.len() - i) as u64;
                self.accepted += rest;
                self.dropped += rest;
                return;
            }
            if let Some(next) = packets.get(i + AHEAD) {
                next.prefetch_data();
            }
            self.accepted += 1;
            self.put(p.data());
        }
    }

    /// The filter's machine code judges up to `FILTER_BATCH` packets per call and names those
    /// that match; only they are read again.
    fn take_matching(&mut self, filter: &PacketFilter, packets: &[Packet]) {
        let mut matched = [0u32; FILTER_BATCH];
        for group in packets.chunks(FILTER_BATCH) {
            let n = filter.select_packets(group, &mut matched);
            self.accepted += n as u64;
            for &i in &matched[..n] {
                self.put(group[i as usize].data());
            }
        }
    }

    /// Copies the first `snaplen` bytes of `frame` behind its record header, or counts it as
    /// dropped when it does not fit.
    fn put(&mut self, frame: &[u8]) {
        let kept = &frame[..frame.len().min(self.snaplen)];
        if self.room().left() < TAP_RECORD_HEADER + kept.len() {
            self.dropped += 1;
            return;
        }
        let now = *self.now.get_or_insert_with(now_ns);
        let mut h = [0u8; TAP_RECORD_HEADER];
        h[0..8].copy_from_slice(&now.to_ne_bytes());
        h[8..12].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        h[12..16].copy_from_slice(&(kept.len() as u32).to_ne_bytes());
        let room = self.room();
        room.put(&h);
        room.put(kept);
    }
}

/// The free part of a tap's ring, filled front to back across the wrap.
struct VacantBytes<'a> {
    first: &'a mut [MaybeUninit<u8>],
    second: &'a mut [MaybeUninit<u8>],
    written: usize,
}

impl VacantBytes<'_> {
    fn left(&self) -> usize {
        self.first.len() + self.second.len() - self.written
    }

    /// Appends `bytes` (the caller checked `left`).
    fn put(&mut self, bytes: &[u8]) {
        let at = self.written;
        let in_first = self.first.len().saturating_sub(at).min(bytes.len());
        if in_first > 0 {
            self.first[at..at + in_first].write_copy_of_slice(&bytes[..in_first]);
        }
        let rest = &bytes[in_first..];
        if !rest.is_empty() {
            let from = (at + in_first) - self.first.len();
            self.second[from..from + rest.len()].write_copy_of_slice(rest);
        }
        self.written += bytes.len();
    }
}

struct TappedLink {
    name: String,
    direction: Direction,
    ring: Arc<Ring>,
    tap: Arc<Tap>,
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
                ring: l.link,
                tap,
                records: cons,
            });
        }
        for l in &tapped {
            l.ring.add_tap(l.tap.clone());
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
        let interfaces: Vec<StreamInterface> = self
            .links
            .iter()
            .map(|l| StreamInterface {
                name: l.name.clone(),
                description: format!("link {} of stitch instance {instance}", l.name),
            })
            .collect();
        stream_header(self.options.format, self.options.snaplen, &interfaces)
    }

    /// Appends the records the taps hold to `out`, up to about `max_bytes`, taking turns
    /// between links. Returns why the capture is over, if it is.
    pub fn poll(&mut self, out: &mut Vec<u8>, max_bytes: usize) -> Option<EndReason> {
        let limit = out.len() + max_bytes;
        let n = self.links.len();
        let mut idle = 0;
        // `take_records` stops at the count, so a reached count ends the loop as idle.
        while idle < n && out.len() < limit {
            let i = self.next_link;
            self.next_link = (i + 1) % n;
            if self.take_records(i, out, limit) > 0 {
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

    /// Moves the whole records link `i` holds to `out`, while `out` stays under `limit` bytes
    /// and the count allows; returns how many.
    fn take_records(&mut self, i: usize, out: &mut Vec<u8>, limit: usize) -> u64 {
        let format = self.options.format;
        let l = &mut self.links[i];
        let (a, b) = l.records.as_slices();
        let queued = a.len() + b.len();
        let (mut at, mut n) = (0usize, 0u64);
        let mut scratch = Vec::new();
        while queued - at >= TAP_RECORD_HEADER
            && out.len() < limit
            && self.options.count.is_none_or(|c| self.total + n < c)
        {
            let mut h = [0u8; TAP_RECORD_HEADER];
            copy_out(a, b, at, &mut h);
            let kept = u32::from_ne_bytes(h[12..16].try_into().unwrap()) as usize;
            // The tap publishes whole batches, so a record is whole once its header is there.
            if queued - at < TAP_RECORD_HEADER + kept {
                break;
            }
            let meta = RecordMeta {
                ts_ns: u64::from_ne_bytes(h[0..8].try_into().unwrap()),
                orig_len: u32::from_ne_bytes(h[8..12].try_into().unwrap()) as usize,
                interface: i as u32,
                direction: l.direction,
            };
            let start = at + TAP_RECORD_HEADER;
            if start + kept <= a.len() {
                append_record(out, format, meta, &a[start..start + kept]);
            } else if start >= a.len() {
                let s = start - a.len();
                append_record(out, format, meta, &b[s..s + kept]);
            } else {
                scratch.resize(kept, 0);
                copy_out(a, b, start, &mut scratch);
                append_record(out, format, meta, &scratch);
            }
            at = start + kept;
            n += 1;
        }
        l.records.skip(at);
        self.captured[i] += n;
        self.total += n;
        n
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
        let filtered = self.options.filter.is_some();
        let counts: Vec<InterfaceCounts> = self
            .stats()
            .iter()
            .map(|s| InterfaceCounts {
                received: s.seen,
                dropped: s.dropped,
                accepted: filtered.then_some(s.accepted),
            })
            .collect();
        stream_trailer(self.options.format, &counts)
    }

    fn remove_taps(&mut self) {
        for l in &self.links {
            let tap: Arc<dyn LinkTap> = l.tap.clone();
            l.ring.remove_tap(&tap);
        }
    }
}

impl Drop for LinkCapture {
    fn drop(&mut self) {
        self.remove_taps();
    }
}

/// Copies `out.len()` bytes from offset `at` of the two slices `a` then `b`.
fn copy_out(a: &[u8], b: &[u8], at: usize, out: &mut [u8]) {
    let from_a = a.len().saturating_sub(at).min(out.len());
    if from_a > 0 {
        out[..from_a].copy_from_slice(&a[at..at + from_a]);
    }
    let rest = out.len() - from_a;
    if rest > 0 {
        let s = (at + from_a) - a.len();
        out[from_a..].copy_from_slice(&b[s..s + rest]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::graph::Endpoint;
    use stitch_core::link::{link, Consumer, Producer};
    use stitch_core::pool;
    use stitch_wire::ethertype;

    fn decl(from: (&str, &str), to: (&str, &str)) -> LinkDecl {
        let e = |(app, port): (&str, &str)| Endpoint {
            app: app.into(),
            port: port.into(),
        };
        LinkDecl {
            from: e(from),
            to: e(to),
            size: 64,
            latency: false,
            line: 0,
        }
    }

    fn udp_frame(n: u8, len: usize) -> Packet {
        let mut f = vec![0u8; len];
        f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
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
    fn records_come_back_whole_and_in_order_as_the_ring_wraps() {
        let (links, mut ends) = two_links();
        let chosen = select_links(&links, "gen.output -> fw.input").unwrap();
        let options = CaptureOptions {
            format: Format::Pcap,
            ring_bytes: 1 << 16,
            ..Default::default()
        };
        let mut cap = LinkCapture::start(chosen, options).unwrap();
        let mut out = cap.header("test");
        let mut sent = Vec::new();
        // Odd sizes, so records straddle the end of the 64 KiB ring in every way.
        for round in 0..300usize {
            for k in 0..7usize {
                let n = (round * 7 + k) as u8;
                let len = 60 + (round * 37 + k * 101) % 1400;
                ends[0].0.transmit(udp_frame(n, len));
                sent.push((len, n));
            }
            let _ = ends[0].1.drain().count();
            assert_eq!(cap.poll(&mut out, 1 << 20), None);
        }
        assert_eq!(cap.stats()[0].dropped, 0);
        let mut reader = pcap_file::pcap::PcapReader::new(&out[..]).unwrap();
        let mut got = Vec::new();
        while let Some(p) = reader.next_packet() {
            let p = p.unwrap();
            got.push((p.orig_len as usize, *p.data.last().unwrap()));
        }
        assert_eq!(got, sent);
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
