//! `pcap_source`: sends the packets of a PCAP or PCAPNG file (detected by its magic number),
//! with their recorded timestamps, as fast as the graph takes them or at the recorded pace.
//!
//! Records longer than a jumbo frame (9216 bytes) are counted in `oversize_drops` and skipped;
//! a damaged or cut-off file ends the read with one error line and `errors` counted, never a
//! crash. Without `loop`, the source finishes at the end of the file and `stitch run` ends when
//! its packets are through the graph. `start_after` (seconds) holds the first packet back for
//! that long after the graph starts — so that replays of several files (one per side of a
//! function) come in a chosen order.
//!
//! A looped file of at most 64 MiB of frames is read once and replayed from memory (as DPDK's
//! `net_pcap` does with `infinite_rx`): packets then go out in batches at the rate a traffic
//! generator would offer, without the file's parsing on every pass.
//!
//! Across an upgrade (and a restart with a state file) the replay goes on where it was: the
//! state is the file, its size and the frames of the pass already sent.
//!
//! ```yaml
//! apps:
//!   src: { type: pcap_source, file: in.pcap, loop: false, pace: false, speed: 1.0 }
//! ```

use pcap_file::pcap::PcapReader;
use pcap_file::pcapng::blocks::interface_description::InterfaceDescriptionOption;
use pcap_file::pcapng::{Block, PcapNgReader};
use serde::Deserialize;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stitch_core::app::{AppSnapshot, AppState};
use stitch_core::packet::MAX_FRAME;
use stitch_core::{pool, App, AppContext, AppError, Counter, Io, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcapSourceConfig {
    /// The file to read (relative to the graph file's folder).
    pub file: PathBuf,
    /// Start again at the first packet after the last.
    #[serde(default, rename = "loop")]
    pub repeat: bool,
    /// Send packets at the pace of their timestamps instead of as fast as possible.
    #[serde(default)]
    pub pace: bool,
    /// With `pace`: speed factor (2.0 replays twice as fast).
    #[serde(default = "one")]
    pub speed: f64,
    /// Seconds to wait after the graph starts before sending the first packet.
    #[serde(default)]
    pub start_after: f64,
}

fn one() -> f64 {
    1.0
}

/// Most packets sent per breath.
const BURST: usize = 256;

/// Where a replay stands, as it is carried across an upgrade (format [`STATE_VERSION`]).
#[derive(Debug, serde::Serialize, Deserialize)]
struct Position {
    /// The file, and its size then: a position in another file means nothing.
    file: PathBuf,
    bytes: u64,
    /// Frames of the current pass sent.
    sent_in_pass: u64,
    /// The file was sent to its end (and not looped).
    done: bool,
}

const STATE_VERSION: u32 = 1;

/// The largest looped file (bytes of frames) kept in memory for replay.
const REPLAY_LIMIT: usize = 64 << 20;

/// A whole file's frames in memory, replayed in order from `next`.
struct Replay {
    bytes: Vec<u8>,
    /// Per frame: where it starts in `bytes`, its length and its timestamp.
    frames: Vec<(usize, usize, u64)>,
    /// The frames' mean length, for the prefetch of the lines they are copied to.
    mean_len: usize,
    next: usize,
    /// Whether a frame has been sent (a pass that begins after it is a loop).
    started: bool,
}

impl Replay {
    /// Reads every frame of `path`; `None` when the file is larger than [`REPLAY_LIMIT`],
    /// damaged or empty (the source then reads it pass by pass and reports what it meets).
    fn load(path: &std::path::Path) -> Option<Replay> {
        let mut file = PcapFile::open(path).ok()?;
        let (mut bytes, mut frames) = (Vec::new(), Vec::new());
        while let Some(next) = file.next_packet() {
            let (ts, data) = next.ok()?;
            if data.is_empty() {
                return None; // an oversize record: counted by the pass-by-pass reader
            }
            frames.push((bytes.len(), data.len(), ts));
            bytes.extend_from_slice(data);
            if bytes.len() > REPLAY_LIMIT {
                return None;
            }
        }
        (!frames.is_empty()).then_some(Replay {
            mean_len: bytes.len() / frames.len().max(1),
            bytes,
            frames,
            next: 0,
            started: false,
        })
    }

    /// The next frame and its timestamp, and whether it starts the file again.
    fn next_frame(&mut self) -> (&[u8], u64, bool) {
        let (at, len, ts) = self.frames[self.next];
        let looped = self.next == 0 && self.started;
        self.started = true;
        self.next = if self.next + 1 == self.frames.len() {
            0
        } else {
            self.next + 1
        };
        (&self.bytes[at..at + len], ts, looped)
    }
}

type Input = Box<dyn Read + Send>;

enum Reader {
    /// PCAP, and whether its timestamps are in nanoseconds.
    Pcap(PcapReader<Input>, bool),
    /// PCAPNG with, per interface, the factor from its timestamp units to nanoseconds.
    PcapNg(PcapNgReader<Input>, Vec<TsScale>),
}

#[derive(Clone, Copy)]
enum TsScale {
    Mul(u64),
    Div(u64),
}

/// One packet read from the file, before it is copied into a pool buffer.
enum Next {
    Packet { ts_ns: u64, oversize: bool },
    End,
    Error(String),
}

/// Reads a file of PCAP or PCAPNG packets, whichever its magic number says.
pub struct PcapFile {
    reader: Reader,
    buf: Vec<u8>,
}

fn scale_of(opts: &[InterfaceDescriptionOption]) -> TsScale {
    for o in opts {
        if let InterfaceDescriptionOption::IfTsResol(r) = o {
            let (neg_pow2, exp) = (r & 0x80 != 0, (r & 0x7f) as u32);
            return if neg_pow2 {
                // Units of 2^-exp seconds: ns = units * 1e9 / 2^exp; exact for exp <= 30.
                TsScale::Div(1u64 << exp.min(63))
            } else if exp <= 9 {
                TsScale::Mul(10u64.pow(9 - exp))
            } else {
                TsScale::Div(10u64.pow((exp - 9).min(19)))
            };
        }
    }
    TsScale::Mul(1000) // default: microseconds
}

impl PcapFile {
    pub fn open(path: &std::path::Path) -> Result<PcapFile, String> {
        let name = path.display();
        let f = File::open(path).map_err(|e| format!("cannot open {name}: {e}"))?;
        PcapFile::from_reader(Box::new(BufReader::with_capacity(1 << 20, f)))
            .map_err(|e| format!("{name}: {e}"))
    }

    /// Every packet of a file, in order (for tools that loop over a capture).
    pub fn read_all(path: &std::path::Path) -> Result<Vec<Vec<u8>>, String> {
        let mut f = PcapFile::open(path)?;
        let mut out = Vec::new();
        while let Some(p) = f.next_packet() {
            out.push(p?.1.to_vec());
        }
        Ok(out)
    }

    /// Reads PCAP or PCAPNG from any byte stream (files, pipes, fuzzers).
    pub fn from_reader(mut r: Input) -> Result<PcapFile, String> {
        let mut magic = [0u8; 4];
        r.read_exact(&mut magic)
            .map_err(|_| "too short to be a PCAP or PCAPNG file".to_string())?;
        let r: Input = Box::new(std::io::Cursor::new(magic).chain(r));
        let reader = if magic == [0x0a, 0x0d, 0x0d, 0x0a] {
            Reader::PcapNg(
                PcapNgReader::new(r).map_err(|e| format!("not a valid PCAPNG file: {e}"))?,
                Vec::new(),
            )
        } else {
            let r = PcapReader::new(r).map_err(|e| format!("neither PCAP nor PCAPNG ({e})"))?;
            let nano = r.header().ts_resolution == pcap_file::TsResolution::NanoSecond;
            Reader::Pcap(r, nano)
        };
        Ok(PcapFile {
            reader,
            buf: Vec::with_capacity(MAX_FRAME),
        })
    }

    /// The next packet: timestamp in nanoseconds and bytes; `None` at the end, `Err` when the
    /// file is damaged. Records over `MAX_FRAME` come back empty.
    pub fn next_packet(&mut self) -> Option<Result<(u64, &[u8]), String>> {
        match self.next() {
            Next::End => None,
            Next::Error(e) => Some(Err(e)),
            Next::Packet { ts_ns, .. } => Some(Ok((ts_ns, &self.buf))),
        }
    }

    /// Reads the next packet into the internal buffer.
    fn next(&mut self) -> Next {
        self.buf.clear();
        match &mut self.reader {
            // Raw records: pcap-file's checked records refuse captures cut by a snaplen
            // (orig_len > snaplen), which `tcpdump -s` writes routinely.
            Reader::Pcap(r, nano) => match r.next_raw_packet() {
                None => Next::End,
                Some(Err(e)) => Next::Error(e.to_string()),
                Some(Ok(p)) => {
                    let frac_ns = if *nano { 1 } else { 1000 };
                    let ts = (p.ts_sec as u64) * 1_000_000_000 + p.ts_frac as u64 * frac_ns;
                    let oversize = p.data.len() > MAX_FRAME;
                    if !oversize {
                        self.buf.extend_from_slice(&p.data);
                    }
                    Next::Packet {
                        ts_ns: ts,
                        oversize,
                    }
                }
            },
            Reader::PcapNg(r, scales) => loop {
                let block = match r.next_block() {
                    None => return Next::End,
                    Some(Err(e)) => return Next::Error(e.to_string()),
                    Some(Ok(b)) => b,
                };
                let (iface, raw_ts, data) = match block {
                    Block::InterfaceDescription(idb) => {
                        scales.push(scale_of(&idb.options));
                        continue;
                    }
                    Block::EnhancedPacket(epb) => {
                        // pcap-file hands the raw timestamp units over as nanoseconds.
                        (
                            epb.interface_id as usize,
                            epb.timestamp.as_nanos() as u64,
                            epb.data,
                        )
                    }
                    Block::SimplePacket(spb) => (0, 0, spb.data),
                    Block::Packet(pb) => (pb.interface_id as usize, pb.timestamp, pb.data),
                    _ => continue,
                };
                let ts = match scales.get(iface).copied().unwrap_or(TsScale::Mul(1000)) {
                    TsScale::Mul(m) => raw_ts.saturating_mul(m),
                    TsScale::Div(d) => ((raw_ts as u128 * 1_000_000_000) / d as u128) as u64,
                };
                let oversize = data.len() > MAX_FRAME;
                if !oversize {
                    self.buf.extend_from_slice(&data);
                }
                return Next::Packet {
                    ts_ns: ts,
                    oversize,
                };
            },
        }
    }
}

pub struct PcapSource {
    path: PathBuf,
    file: Option<PcapFile>,
    /// A looped file held in memory (then `file` is not read).
    replay: Option<Replay>,
    repeat: bool,
    pace: bool,
    speed: f64,
    /// Pacing origin: wall time and file time of the first packet.
    origin: Option<(Instant, u64)>,
    start_after: Duration,
    /// When the first packet may go (set at the first pull).
    start: Option<Instant>,
    /// A packet read but held back by pacing or a full link.
    pending: Option<stitch_core::Packet>,
    read_in_pass: u64,
    done: bool,
    oversize: Counter,
    errors: Counter,
    exhausted: Counter,
    loops: Counter,
}

impl PcapSource {
    fn read_one(&mut self) -> Option<stitch_core::Packet> {
        if let Some(replay) = &mut self.replay {
            let Some(mut p) = pool::alloc() else {
                self.exhausted.add(1);
                return None;
            };
            let (data, ts, looped) = replay.next_frame();
            // SAFETY: `transmit_fresh` hands fresh packets (and frames over MAX_FRAME are
            // never loaded).
            unsafe { p.set_fresh_data(data) };
            p.set_timestamp_ns(ts);
            if looped {
                self.new_pass();
            }
            return Some(p);
        }
        loop {
            let file = self.file.as_mut()?;
            match file.next() {
                Next::Packet { oversize: true, .. } => self.oversize.add(1),
                Next::Packet { ts_ns, .. } => {
                    let Some(mut p) = pool::alloc() else {
                        self.exhausted.add(1);
                        return None;
                    };
                    // Cannot fail: checked against MAX_FRAME.
                    let _ = p.set_data(&file.buf);
                    p.set_timestamp_ns(ts_ns);
                    self.read_in_pass += 1;
                    return Some(p);
                }
                Next::Error(e) => {
                    log::error!(
                        "pcap_source {}: {e}; stopping at this point",
                        self.path.display()
                    );
                    self.errors.add(1);
                    self.file = None;
                    self.done = true;
                    return None;
                }
                Next::End => {
                    if self.repeat && self.read_in_pass > 0 {
                        self.new_pass();
                        self.read_in_pass = 0;
                        match PcapFile::open(&self.path) {
                            Ok(f) => self.file = Some(f),
                            Err(e) => {
                                log::error!("pcap_source: {e}");
                                self.file = None;
                                self.done = true;
                                return None;
                            }
                        }
                    } else {
                        self.file = None;
                        self.done = true;
                        return None;
                    }
                }
            }
        }
    }

    /// The file starts again: counted, and pacing takes a new origin.
    fn new_pass(&mut self) {
        self.loops.add(1);
        self.origin = None;
    }

    /// Frames of the current pass sent (one read and held back is not).
    fn sent_in_pass(&self) -> u64 {
        let held = u64::from(self.pending.is_some());
        match &self.replay {
            Some(r) => {
                let len = r.frames.len() as u64;
                (r.next as u64 + len - held) % len
            }
            None => self.read_in_pass.saturating_sub(held),
        }
    }

    /// Goes on after `sent` frames of the pass (taken from a predecessor).
    fn skip(&mut self, sent: u64) -> Result<(), String> {
        if let Some(r) = &mut self.replay {
            r.next = (sent % r.frames.len() as u64) as usize;
            r.started = true;
            return Ok(());
        }
        let file = self.file.as_mut().ok_or("the file is closed")?;
        for read in 0..sent {
            match file.next() {
                Next::Packet { oversize: true, .. } => {}
                Next::Packet { .. } => self.read_in_pass += 1,
                Next::End | Next::Error(_) => {
                    return Err(format!("the file holds {read} frames, not {sent}"));
                }
            }
        }
        Ok(())
    }

    /// Sends up to `n` frames of the in-memory file, written straight into the link's slots
    /// with one pool visit and one link update.
    fn replay_batch(&mut self, n: usize, out: &mut stitch_core::Producer) {
        let Some(replay) = &mut self.replay else {
            return;
        };
        let mut loops = 0;
        let sent = out.transmit_fresh(n, replay.mean_len, |p| {
            let (data, ts, looped) = replay.next_frame();
            // SAFETY: `transmit_fresh` hands fresh packets (and frames over MAX_FRAME are
            // never loaded; `set_fresh_data` checks again).
            unsafe { p.set_fresh_data(data) };
            p.set_timestamp_ns(ts);
            loops += looped as u64;
        });
        // n is at most the link's room: the rest is what the pool could not give.
        if sent < n {
            self.exhausted.add((n - sent) as u64);
        }
        self.loops.add(loops);
    }
}

impl App for PcapSource {
    type Config = PcapSourceConfig;
    const EXAMPLE: &'static str = "file: trace.pcap
loop: true
pace: true
speed: 2.0
";

    fn check_host(c: &PcapSourceConfig, base_dir: &std::path::Path) -> Vec<String> {
        stitch_core::files::missing("file", &c.file, base_dir)
            .into_iter()
            .collect()
    }

    fn declare(c: &PcapSourceConfig) -> Result<PortSpec, AppError> {
        if !(c.speed > 0.0 && c.speed.is_finite()) {
            return Err(format!("speed must be positive, got {}", c.speed).into());
        }
        if !(0.0..=86400.0).contains(&c.start_after) {
            return Err(format!(
                "start_after must be 0..=86400 seconds, got {}",
                c.start_after
            )
            .into());
        }
        Ok(PortSpec::source())
    }

    fn new(c: PcapSourceConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let path = ctx.path(&c.file);
        let file = PcapFile::open(&path)?;
        let replay = c.repeat.then(|| Replay::load(&path)).flatten();
        Ok(PcapSource {
            path,
            file: Some(file),
            replay,

            repeat: c.repeat,
            pace: c.pace,
            speed: c.speed,
            origin: None,
            start_after: Duration::from_secs_f64(c.start_after),
            start: None,
            pending: None,
            read_in_pass: 0,
            done: false,
            oversize: ctx.counter("oversize_drops"),
            errors: ctx.counter("errors"),
            exhausted: ctx.counter("pool_exhausted"),
            loops: ctx.counter("loops"),
        })
    }

    fn pull(&mut self, io: &mut Io) {
        let Some(out) = io.output(0) else { return };
        let n = out.room().min(BURST);
        let now = Instant::now();
        if now < *self.start.get_or_insert(now + self.start_after) {
            return;
        }
        if !self.pace && self.replay.is_some() {
            self.replay_batch(n, out);
            return;
        }
        for _ in 0..n {
            let p = match self.pending.take() {
                Some(p) => p,
                None => match self.read_one() {
                    Some(p) => p,
                    None => return,
                },
            };
            if self.pace {
                let ts = p.timestamp_ns();
                let (t0, f0) = *self.origin.get_or_insert((now, ts));
                let due = Duration::from_nanos((ts.saturating_sub(f0) as f64 / self.speed) as u64);
                if now.duration_since(t0) < due {
                    self.pending = Some(p);
                    return;
                }
            }
            out.transmit(p);
        }
    }

    fn finished(&self) -> Option<bool> {
        Some(self.done && self.pending.is_none())
    }

    fn snapshot(&self) -> Option<AppSnapshot> {
        let position = Position {
            file: self.path.clone(),
            bytes: std::fs::metadata(&self.path).map_or(0, |m| m.len()),
            sent_in_pass: self.sent_in_pass(),
            done: self.done && self.pending.is_none(),
        };
        Some(AppSnapshot::new(STATE_VERSION, position))
    }

    fn restore(&mut self, state: AppState) -> Result<(), String> {
        let at: Position = serde_json::from_value(state.of_version(STATE_VERSION)?)
            .map_err(|e| format!("pcap_source state: {e}"))?;
        let bytes = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if at.file != self.path || at.bytes != bytes {
            return Err(format!(
                "the replay was of {} ({} bytes), this is {} ({bytes} bytes): it starts again",
                at.file.display(),
                at.bytes,
                self.path.display()
            ));
        }
        if at.done {
            self.file = None;
            self.replay = None;
            self.done = true;
        } else if let Err(e) = self.skip(at.sent_in_pass) {
            self.file = Some(PcapFile::open(&self.path)?);
            self.read_in_pass = 0;
            return Err(e);
        }
        // Its first packet was held back already: no second wait.
        self.start = Some(Instant::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
    use stitch_core::link::link;

    fn file_with(dir: &std::path::Path, stamps_ms: &[u64]) -> PathBuf {
        let path = dir.join("t.pcap");
        let header = PcapHeader {
            ts_resolution: pcap_file::TsResolution::NanoSecond,
            ..Default::default()
        };
        let mut w = PcapWriter::with_header(File::create(&path).unwrap(), header).unwrap();
        for (i, ms) in stamps_ms.iter().enumerate() {
            let data = vec![i as u8; 60];
            w.write_packet(&PcapPacket::new(Duration::from_millis(*ms), 60, &data))
                .unwrap();
        }
        path
    }

    fn source(path: PathBuf, repeat: bool, pace: bool, speed: f64) -> PcapSource {
        let mut ctx = AppContext::new("src", std::path::Path::new("/"), Default::default());
        PcapSource::new(
            PcapSourceConfig {
                file: path,
                repeat,
                pace,
                speed,
                start_after: 0.0,
            },
            &mut ctx,
        )
        .unwrap()
    }

    /// Pulls until `n` frames came out (or the file ended); the first bytes of the first `n`.
    fn take(s: &mut PcapSource, n: usize) -> Vec<u8> {
        let (tx, mut rx) = link(1);
        let mut io = Io::new(vec![], vec![("output".into(), tx)]);
        let mut got = Vec::new();
        while got.len() < n && App::finished(s) != Some(true) {
            App::pull(s, &mut io);
            got.extend(rx.drain().map(|p| p.data()[0]));
        }
        got.truncate(n);
        got
    }

    fn carried_over(s: &PcapSource, to: &mut PcapSource) -> Result<(), String> {
        let state = App::snapshot(s).unwrap().into_state().unwrap();
        App::restore(to, state)
    }

    #[test]
    fn a_replay_goes_on_where_its_predecessor_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let path = file_with(dir.path(), &[1, 2, 3, 4, 5]);
        for repeat in [false, true] {
            let mut first = source(path.clone(), repeat, false, 1.0);
            assert_eq!(take(&mut first, 2), [0, 1]);
            let mut next = source(path.clone(), repeat, false, 1.0);
            carried_over(&first, &mut next).unwrap();
            assert_eq!(
                take(&mut next, 5),
                [2, 3, 4, 0, 1][..if repeat { 5 } else { 3 }]
            );
        }
        // Sent to its end: the successor sends nothing again.
        let mut first = source(path.clone(), false, false, 1.0);
        assert_eq!(take(&mut first, 9).len(), 5);
        let mut next = source(path.clone(), false, false, 1.0);
        carried_over(&first, &mut next).unwrap();
        assert!(take(&mut next, 9).is_empty());
        // Another file: refused, and the replay starts at its first frame.
        let other = dir.path().join("other");
        std::fs::create_dir(&other).unwrap();
        let mut next = source(file_with(&other, &[1, 2, 3]), false, false, 1.0);
        assert!(carried_over(&first, &mut next).is_err());
        assert_eq!(take(&mut next, 9), [0, 1, 2]);
    }

    #[test]
    fn loop_starts_again_and_keeps_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = source(file_with(dir.path(), &[1, 2, 3]), true, false, 1.0);
        let (tx, mut rx) = link(8);
        let mut io = Io::new(vec![], vec![("output".into(), tx)]);
        let mut got = Vec::new();
        while got.len() < 10 {
            App::pull(&mut s, &mut io);
            got.extend(rx.drain().map(|p| p.data()[0]));
        }
        assert_eq!(&got[..10], &[0, 1, 2, 0, 1, 2, 0, 1, 2, 0]);
        assert!(s.loops.get() >= 3);
        assert_eq!(App::finished(&s), Some(false));
    }

    #[test]
    fn pace_holds_packets_until_their_time() {
        let dir = tempfile::tempdir().unwrap();
        // Recorded 100 ms apart; replayed at twice the speed: 50 ms apart.
        let mut s = source(file_with(dir.path(), &[1000, 1100, 1200]), false, true, 2.0);
        let (tx, mut rx) = link(8);
        let mut io = Io::new(vec![], vec![("output".into(), tx)]);
        let t0 = Instant::now();
        App::pull(&mut s, &mut io);
        assert_eq!(
            rx.drain().count(),
            1,
            "only the first packet is due at once"
        );
        let mut n = 1;
        while n < 3 {
            App::pull(&mut s, &mut io);
            n += rx.drain().count();
            assert!(t0.elapsed() < Duration::from_secs(10));
        }
        assert!(
            t0.elapsed() >= Duration::from_millis(100),
            "two gaps of 50 ms at speed 2"
        );
        App::pull(&mut s, &mut io);
        assert_eq!(App::finished(&s), Some(true));
    }
}
