//! Captures of the links of a kernel graph as a PCAPNG (or PCAP) stream, the same stream a
//! running engine's links give (`stitch_io::link_capture`): one interface per link named
//! `app.port -> app.port`, direction flags seen from the app asked about, and at the end one
//! statistics block per link (packets the link carried while tapped, records the tap's ring had
//! no room for, packets the filter took).
//!
//! The kernel copies every packet of a tapped link (up to the snap length) and the filter runs
//! here, on the reader's side: the patch panel has no libpcap filter of its own.

use crate::datapath::{DataPlane, Error};
use crate::tap::KernelTap;
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use stitch_io::capture_format::{
    append_record, stream_header, stream_trailer, InterfaceCounts, RecordMeta, StreamInterface,
};
use stitch_io::link_capture::{select_links, CaptureOptions, EndReason, SelectedLink, TapStats};
use stitch_wire::filter::PacketFilter;

/// How often the reader checks that the tapped links are still installed.
const LINK_CHECK: Duration = Duration::from_millis(500);

/// How a streamed capture went.
pub struct StreamSummary {
    /// Why it ended by itself, if it did.
    pub end: Option<EndReason>,
    /// The reader of the stream went away.
    pub reader_gone: bool,
    pub stats: Vec<TapStats>,
}

/// Checks that `filter` compiles (libpcap syntax), as a capture would.
pub fn check_filter(filter: &str) -> Result<(), Error> {
    PacketFilter::compile(filter).map(|_| ()).map_err(Error)
}

/// A capture of some links of a kernel data plane.
pub struct KernelLinkCapture {
    plane: DataPlane,
    tap: KernelTap,
    links: Vec<SelectedLink<u32>>,
    /// Index in `links` of the link leaving each VID.
    by_vid: HashMap<u32, usize>,
    filter: Option<PacketFilter>,
    options: CaptureOptions,
    captured: Vec<u64>,
    accepted: Vec<u64>,
    total: u64,
    deadline: Option<Instant>,
    next_check: Instant,
}

impl KernelLinkCapture {
    /// Taps the links of data plane `plane` that `selector` names (`APP`, `APP.PORT` or
    /// `APP.PORT -> APP.PORT`). A bad filter or an unknown link is refused before anything is
    /// tapped.
    pub fn start(
        plane: &str,
        selector: &str,
        options: CaptureOptions,
    ) -> Result<KernelLinkCapture, Error> {
        if options.snaplen == 0 {
            return Err(Error("snaplen must be at least 1".into()));
        }
        let filter = options
            .filter
            .as_deref()
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(PacketFilter::compile)
            .transpose()
            .map_err(Error)?;
        let plane = DataPlane::new(plane)?;
        let links = select_links(&plane.tappable_links()?, selector).map_err(Error)?;
        let vids: Vec<u32> = links.iter().map(|l| l.link).collect();
        let snaplen = options.snaplen.min(crate::maps::TAP_SNAP_MAX);
        let tap = KernelTap::start(&plane, &vids, snaplen)?;
        Ok(KernelLinkCapture {
            by_vid: vids.iter().enumerate().map(|(i, &v)| (v, i)).collect(),
            captured: vec![0; links.len()],
            accepted: vec![0; links.len()],
            deadline: options.duration.map(|d| Instant::now() + d),
            next_check: Instant::now() + LINK_CHECK,
            plane,
            tap,
            links,
            filter,
            options,
            total: 0,
        })
    }

    /// The names of the tapped links, in interface order.
    pub fn link_names(&self) -> Vec<String> {
        self.links.iter().map(|l| l.name.clone()).collect()
    }

    /// The start of the stream.
    pub fn header(&self) -> Vec<u8> {
        let interfaces: Vec<StreamInterface> = self
            .links
            .iter()
            .map(|l| StreamInterface {
                name: l.name.clone(),
                description: format!(
                    "link {} of stitch kernel data plane {}",
                    l.name, self.plane.name
                ),
            })
            .collect();
        stream_header(self.options.format, self.options.snaplen, &interfaces)
    }

    /// Waits up to `timeout` for packets and appends their records to `out`. Returns why the
    /// capture is over, if it is.
    pub fn poll(
        &mut self,
        out: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<Option<EndReason>, Error> {
        let format = self.options.format;
        let snaplen = self.options.snaplen as usize;
        let count = self.options.count;
        let (filter, by_vid, links) = (&self.filter, &self.by_vid, &self.links);
        let (captured, accepted, total) = (&mut self.captured, &mut self.accepted, &mut self.total);
        self.tap.poll(timeout, |r| {
            let Some(&i) = by_vid.get(&r.vid) else {
                return;
            };
            if count.is_some_and(|c| *total >= c) {
                return;
            }
            if filter.as_ref().is_some_and(|f| !f.matches(r.data)) {
                return;
            }
            accepted[i] += 1;
            let meta = RecordMeta {
                ts_ns: r.time_ns,
                orig_len: r.len as usize,
                interface: i as u32,
                direction: links[i].direction,
            };
            append_record(out, format, meta, &r.data[..r.data.len().min(snaplen)]);
            captured[i] += 1;
            *total += 1;
        })?;
        if self.options.count.is_some_and(|c| self.total >= c) {
            return Ok(Some(EndReason::Count));
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Some(EndReason::Duration));
        }
        if Instant::now() >= self.next_check {
            self.next_check = Instant::now() + LINK_CHECK;
            if !self.links_installed() {
                return Ok(Some(EndReason::LinksGone));
            }
        }
        Ok(None)
    }

    /// Whether every tapped link is still installed with the same VID (an apply that removed
    /// or renumbered it ends the capture).
    fn links_installed(&self) -> bool {
        let Ok(now) = self.plane.tappable_links() else {
            return false;
        };
        self.links.iter().all(|l| {
            now.iter()
                .any(|(d, vid)| *vid == l.link && d.spec() == l.name)
        })
    }

    /// Counters of every tapped link.
    pub fn stats(&self) -> Vec<TapStats> {
        let carried = self.tap.carried();
        let dropped = self.tap.dropped();
        self.links
            .iter()
            .enumerate()
            .map(|(i, l)| TapStats {
                link: l.name.clone(),
                direction: l.direction,
                seen: carried[i],
                accepted: self.accepted[i],
                captured: self.captured[i],
                dropped: dropped[i],
            })
            .collect()
    }

    /// Writes the whole stream to `out` until `stop` is set, the capture ends (count,
    /// duration, the links leaving the installed graph) or the reader of `out` goes away;
    /// flushes after every poll when `flush_each` (a pipe to Wireshark). Removes the taps.
    pub fn stream(
        mut self,
        out: &mut dyn Write,
        stop: &AtomicBool,
        flush_each: bool,
    ) -> Result<StreamSummary, Error> {
        let write = |out: &mut dyn Write, bytes: &[u8]| -> Result<bool, Error> {
            let written =
                out.write_all(bytes)
                    .and_then(|_| if flush_each { out.flush() } else { Ok(()) });
            match written {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
                Err(e) => Err(Error(format!("writing the capture: {e}"))),
            }
        };
        let mut buf = self.header();
        let mut end = None;
        let mut reader_gone = false;
        while !stop.load(Ordering::Relaxed) {
            end = self.poll(&mut buf, Duration::from_millis(20))?;
            if !write(out, &buf)? {
                reader_gone = true;
                break;
            }
            buf.clear();
            if end.is_some() {
                break;
            }
        }
        let stats = self.stats();
        let trailer = self.finish();
        if !reader_gone && write(out, &trailer)? {
            out.flush()
                .map_err(|e| Error(format!("writing the capture: {e}")))?;
        }
        Ok(StreamSummary {
            end,
            reader_gone,
            stats,
        })
    }

    /// Removes the taps and returns the end of the stream (PCAPNG statistics blocks).
    pub fn finish(self) -> Vec<u8> {
        let filtered = self.filter.is_some();
        let counts: Vec<InterfaceCounts> = self
            .stats()
            .iter()
            .map(|s| InterfaceCounts {
                received: s.seen,
                dropped: s.dropped,
                accepted: filtered.then_some(s.accepted),
            })
            .collect();
        let trailer = stream_trailer(self.options.format, &counts);
        drop(self.tap);
        trailer
    }
}
