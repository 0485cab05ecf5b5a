//! `capture`: records every packet that passes through it to PCAP or PCAPNG files, with
//! nanosecond timestamps, and passes it on unchanged — put it into any link of a graph to record
//! exactly what goes from one function to the next. With its output unlinked it is a recording
//! sink (what `stitch capture` builds behind an interface).
//!
//! Records are formatted on the data path into 4 MiB buffers written by a separate thread
//! (one `write` per buffer, no syscall per packet); when all buffers wait for the disk, packets
//! are still passed on but not recorded, counted in `writer_drops` — capture never slows the
//! link. As a sink (output unlinked) it leaves packets queued instead, so that the input link
//! and the ring behind it absorb a slow disk. Rotation follows tcpdump: `rotate_mb` (-C), `rotate_seconds` (-G, strftime file names)
//! and `files` (-W, a ring of files). Files are complete at every rotation and at stop. A
//! Stitch process taking the instance over (`stitch upgrade`) writes on in the current file,
//! after the last record this one wrote, and rotates on from there.
//!
//! ```yaml
//! apps:
//!   tap: { type: capture, file: between-fw-and-nat.pcapng, snaplen: 128, rotate_mb: 100, files: 10 }
//! links:
//!   - "fw.output -> tap.input"
//!   - "tap.output -> nat.input"
//! ```

use crate::capture_file::{CaptureWriter, FileSpec, FileState, Format};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::link::Ring;
use stitch_core::packet::now_ns;
use stitch_core::{App, AppContext, AppError, Counter, Descriptors, Io, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureConfig {
    /// File to write (relative to the graph file's folder); a strftime pattern with
    /// `rotate_seconds`.
    pub file: PathBuf,
    /// `pcap` or `pcapng`; by default from the file name.
    pub format: Option<Format>,
    /// Bytes kept of each packet.
    #[serde(default = "default_snaplen")]
    pub snaplen: u32,
    /// Stop recording after this many packets (they keep flowing).
    pub count: Option<u64>,
    /// New file when this many MB (10^6 bytes, as tcpdump -C) would be exceeded.
    pub rotate_mb: Option<u64>,
    /// New file every this many seconds.
    pub rotate_seconds: Option<u64>,
    /// Ring of at most this many files.
    pub files: Option<u32>,
    /// Memory for buffers waiting for the disk, in MiB.
    #[serde(default = "default_buffer_mb")]
    pub buffer_mb: usize,
    /// Interface name recorded in PCAPNG files (default: the app's name).
    pub interface: Option<String>,
}

fn default_snaplen() -> u32 {
    262144
}
fn default_buffer_mb() -> usize {
    64
}

pub struct Capture {
    /// `None` in a process taking over until the predecessor's final word says where its file
    /// stands ([`App::take_position`]).
    writer: Option<CaptureWriter>,
    spec: FileSpec,
    /// The writer held for the final hand-over, and where its file stood.
    held: Option<Option<FileState>>,
    remaining: Option<u64>,
    input: Option<Arc<Ring>>,
    last_flush: Instant,
    captured: Counter,
    writer_drops: Counter,
    bytes_written: Counter,
    files: Counter,
    write_errors: Counter,
}

/// Where a capture stands at an upgrade: its file (`None` at the loan, or when it had none
/// left) and the packets it may still record.
#[derive(Debug, Serialize, Deserialize)]
struct Position {
    file: Option<FileState>,
    remaining: Option<u64>,
}

impl App for Capture {
    type Config = CaptureConfig;
    const EXAMPLE: &'static str = r#"file: "captures/edge-%Y%m%d-%H%M%S.pcapng"
rotate_seconds: 3600
files: 24
snaplen: 128
"#;

    fn check_host(c: &CaptureConfig, base_dir: &std::path::Path) -> Vec<String> {
        stitch_core::files::missing_folder("file", &c.file, base_dir)
            .into_iter()
            .collect()
    }

    fn declare(c: &CaptureConfig) -> Result<PortSpec, AppError> {
        if c.snaplen == 0 {
            return Err("snaplen must be at least 1".into());
        }
        if c.files.is_some() && c.rotate_mb.is_none() && c.rotate_seconds.is_none() {
            return Err("files (a ring of files) needs rotate_mb or rotate_seconds".into());
        }
        if c.files == Some(0) || c.rotate_mb == Some(0) || c.rotate_seconds == Some(0) {
            return Err("files, rotate_mb and rotate_seconds must be at least 1".into());
        }
        if c.buffer_mb < 8 {
            return Err("buffer_mb must be at least 8".into());
        }
        Ok(PortSpec::filter())
    }

    fn new(c: CaptureConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let path = ctx.path(&c.file);
        let spec = FileSpec {
            format: c.format.unwrap_or_else(|| Format::for_path(&path)),
            path,
            snaplen: c.snaplen,
            interface: c
                .interface
                .clone()
                .unwrap_or_else(|| ctx.name().to_string()),
            rotate_bytes: c.rotate_mb.map(|m| m * 1_000_000),
            rotate_seconds: c.rotate_seconds,
            files: c.files,
            buffers: c.buffer_mb / (crate::capture_file::BUFFER_BYTES >> 20),
        };
        // Taken over: the file is the predecessor's, opened once it says where it stands.
        let writer = match ctx.take_inherited() {
            Some(_) => None,
            None => Some(CaptureWriter::start(spec.clone())?),
        };
        Ok(Capture {
            writer,
            spec,
            held: None,
            remaining: c.count,
            input: None,
            last_flush: Instant::now(),
            captured: ctx.counter("captured"),
            writer_drops: ctx.counter("writer_drops"),
            bytes_written: ctx.counter("bytes_written"),
            files: ctx.counter("files"),
            write_errors: ctx.counter("write_errors"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        let Some(input) = inputs.first_mut().and_then(Option::as_mut) else {
            return;
        };
        if self.input.is_none() {
            self.input = Some(input.ring().clone());
        }
        let mut out = outputs.first_mut().and_then(Option::as_mut);
        let (mut captured, mut dropped) = (0, 0);
        if out.is_none() {
            // A recording sink: when every buffer waits for the disk, leave packets queued
            // (the input and the kernel ring behind it absorb a slow disk) instead of dropping.
            while let Some(p) = input.peek() {
                if self.remaining != Some(0) {
                    let ts = match p.timestamp_ns() {
                        0 => now_ns(),
                        t => t,
                    };
                    let Some(writer) = self.writer.as_mut() else {
                        break;
                    };
                    if !writer.record(ts, p.data()) {
                        break;
                    }
                    captured += 1;
                    if let Some(r) = self.remaining.as_mut() {
                        *r -= 1;
                    }
                }
                drop(input.receive());
            }
            self.captured.add(captured);
            return;
        }
        // Like a forwarder, take only what the next app can accept: the tap never adds drops.
        let n = out.as_mut().map(|o| o.room()).unwrap_or(usize::MAX);
        for p in input.drain().take(n) {
            if self.remaining != Some(0) {
                let ts = match p.timestamp_ns() {
                    0 => now_ns(),
                    t => t,
                };
                if self.writer.as_mut().is_some_and(|w| w.record(ts, p.data())) {
                    captured += 1;
                    if let Some(r) = self.remaining.as_mut() {
                        *r -= 1;
                    }
                } else {
                    dropped += 1;
                }
            }
            if let Some(o) = out.as_mut() {
                o.transmit(p);
            }
        }
        self.captured.add(captured);
        self.writer_drops.add(dropped);
    }

    fn tick(&mut self, _: &mut Io, now: Instant) {
        if self.writer.is_none() {
            // Taken over from a predecessor that gave no final word for this app (it had
            // failed there): a file of its own, as a start makes.
            log::warn!(
                "capture {}: no file to write on from the process before; starting one",
                self.spec.path.display()
            );
            self.writer = CaptureWriter::start(self.spec.clone()).ok();
        }
        let Some(writer) = self.writer.as_mut() else {
            return;
        };
        if now.duration_since(self.last_flush) >= Duration::from_millis(100) {
            self.last_flush = now;
            writer.flush_if_older(Duration::from_millis(200));
            let s = &writer.stats;
            self.bytes_written.set(s.bytes_written.load(Relaxed));
            self.files.set(s.files_opened.load(Relaxed));
            self.write_errors.set(s.write_errors.load(Relaxed));
        }
    }

    fn stop(&mut self) {
        let Some(writer) = self.writer.as_mut() else {
            return;
        };
        let upstream = self.input.as_ref().map(|r| r.stats().tx_drops).unwrap_or(0);
        let dropped = self.writer_drops.get() + upstream;
        writer.close(self.captured.get() + dropped, dropped);
        let s = &writer.stats;
        self.bytes_written.set(s.bytes_written.load(Relaxed));
        self.files.set(s.files_opened.load(Relaxed));
        self.write_errors.set(s.write_errors.load(Relaxed));
        let lost = s.records_lost.load(Relaxed);
        if lost > 0 {
            self.writer_drops.add(lost);
            self.captured.set(self.captured.get().saturating_sub(lost));
        }
    }

    fn hold_for_hand_over(&mut self) {
        self.held = Some(self.writer.as_mut().and_then(CaptureWriter::hold));
    }

    fn carry_on(&mut self) {
        if self.held.take().is_some() {
            if let Some(w) = self.writer.as_mut() {
                w.resume();
            }
        }
    }

    /// Nothing to lend (the successor opens the file by its name); the final word says where
    /// the held file stands.
    fn hand_over(&mut self) -> Option<Descriptors> {
        let position = Position {
            file: self.held.clone().flatten(),
            remaining: self.remaining,
        };
        Some(Descriptors {
            fds: Vec::new(),
            position: serde_json::to_value(position).ok()?,
        })
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        let at: Position = serde_json::from_value(position).map_err(|e| e.to_string())?;
        self.remaining = at.remaining;
        self.writer = Some(match at.file {
            Some(file) => CaptureWriter::resume_at(self.spec.clone(), file)?,
            // The predecessor had no file left (a write failed): start one, as a start would.
            None => CaptureWriter::start(self.spec.clone())?,
        });
        Ok(())
    }
}
