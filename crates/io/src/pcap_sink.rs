//! `pcap_sink`: writes every packet it receives to a PCAP or PCAPNG file with nanosecond
//! timestamps (the packet's own timestamp, or the time of writing when it has none).
//!
//! `format` defaults to `pcapng` for a `.pcapng` file name and `pcap` otherwise. Records go
//! through a 1 MiB buffer, so there is no system call per packet; `stop` (end of run, SIGINT,
//! SIGTERM, removal by a live change) flushes it. A PCAPNG file ends with an interface statistics
//! block giving the packets received and those its input link dropped. A write error (disk full)
//! is logged once; later packets are counted in `write_drops`. A Stitch process taking the
//! instance over (`stitch upgrade`) writes on in the same file, after the last record this one
//! wrote out.
//!
//! ```yaml
//! apps:
//!   out: { type: pcap_sink, file: out.pcapng, snaplen: 262144 }
//! ```

use crate::capture_format::{self as cf, Direction, InterfaceCounts, RecordMeta};
use pcap_file::pcap::{PcapHeader, PcapWriter};
use pcap_file::{DataLink, Endianness};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;
use stitch_core::link::Ring;
use stitch_core::packet::now_ns;
use stitch_core::{App, AppContext, AppError, Counter, Descriptors, Io, PortSpec};

pub use crate::capture_format::Format;

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcapSinkConfig {
    /// The file written (replaced if it exists; it must not be another user's).
    pub file: PathBuf,
    /// The file format (by default from the file's extension: `.pcapng` is PCAPNG, anything else
    /// PCAP).
    pub format: Option<Format>,
    /// Bytes kept of each packet.
    #[serde(default = "default_snaplen")]
    pub snaplen: u32,
}

fn default_snaplen() -> u32 {
    262144
}

/// Records are written to the file once this many bytes wait.
const BUFFER: usize = 1 << 20;

pub struct PcapSink {
    /// `None` once a write failed.
    file: Option<File>,
    buffer: Vec<u8>,
    format: Format,
    path: PathBuf,
    snaplen: u32,
    input: Option<Arc<Ring>>,
    written: Counter,
    write_drops: Counter,
}

/// What a `pcap_sink` lends a process taking over: the file (its descriptor shares the
/// offset, so the successor writes on where this one's last flush ended).
#[derive(Debug, Serialize, Deserialize)]
struct Position {
    format: Format,
    snaplen: u32,
}

impl PcapSink {
    /// Writes out what waits; a failure is logged and later packets are counted as drops.
    fn flush(&mut self) {
        let Some(f) = self.file.as_mut() else {
            self.buffer.clear();
            return;
        };
        if let Err(e) = f.write_all(&self.buffer) {
            log::error!(
                "pcap_sink {}: write failed: {e}; dropping further packets",
                self.path.display()
            );
            self.file = None;
        }
        self.buffer.clear();
    }

    fn header(format: Format, name: &str, snaplen: u32) -> Vec<u8> {
        match format {
            Format::Pcap => cf::pcap_header(snaplen),
            Format::Pcapng => {
                let mut h = cf::section_header();
                h.extend(cf::interface_block(name, None, snaplen));
                h
            }
        }
    }
}

impl App for PcapSink {
    type Config = PcapSinkConfig;
    const EXAMPLE: &'static str = "file: out.pcapng
snaplen: 262144
";

    fn check_host(c: &PcapSinkConfig, base_dir: &std::path::Path) -> Vec<String> {
        stitch_core::files::missing_folder("file", &c.file, base_dir)
            .into_iter()
            .collect()
    }

    fn declare(c: &PcapSinkConfig) -> Result<PortSpec, AppError> {
        if c.snaplen == 0 {
            return Err("snaplen must be at least 1".into());
        }
        Ok(PortSpec::sink())
    }

    fn new(c: PcapSinkConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let path = ctx.path(&c.file);
        let format = c.format.unwrap_or(Format::for_path(&path));
        let mut buffer = Vec::with_capacity(BUFFER + 65536);
        let file = match ctx.take_inherited() {
            // Taken over: the predecessor's file, written on from where it stopped.
            Some(mut lent) => {
                let at: Position = serde_json::from_value(lent.position)
                    .map_err(|e| format!("lent position: {e}"))?;
                if (at.format, at.snaplen) != (format, c.snaplen) {
                    return Err(format!(
                        "the predecessor wrote {} as {:?} with snaplen {}",
                        path.display(),
                        at.format,
                        at.snaplen
                    )
                    .into());
                }
                File::from(lent.fds.pop().ok_or("no file lent")?)
            }
            None => {
                buffer.extend(PcapSink::header(format, ctx.name(), c.snaplen));
                stitch_core::files::create_output(&path, 0o600, 0)
                    .map_err(|e| format!("cannot create {}: {e}", path.display()))?
            }
        };
        Ok(PcapSink {
            file: Some(file),
            buffer,
            format,
            path,
            snaplen: c.snaplen,
            input: None,
            written: ctx.counter("written"),
            write_drops: ctx.counter("write_drops"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        if self.input.is_none() {
            self.input = Some(input.ring().clone());
        }
        if self.file.is_none() {
            let n = input.drain().count();
            self.write_drops.add(n as u64);
            return;
        }
        let mut written = 0;
        for p in input.drain() {
            let ts_ns = match p.timestamp_ns() {
                0 => now_ns(),
                t => t,
            };
            let data = &p.data()[..p.len().min(self.snaplen as usize)];
            let meta = RecordMeta {
                ts_ns,
                orig_len: p.len(),
                interface: 0,
                direction: Direction::Unknown,
            };
            cf::append_record(&mut self.buffer, self.format, meta, data);
            written += 1;
        }
        self.written.add(written);
        if self.buffer.len() >= BUFFER {
            self.flush();
        }
    }

    fn stop(&mut self) {
        if self.format == Format::Pcapng && self.file.is_some() {
            let link_drops = self.input.as_ref().map(|r| r.stats().tx_drops).unwrap_or(0);
            let counts = InterfaceCounts {
                received: self.written.get() + link_drops,
                dropped: link_drops,
                accepted: None,
            };
            self.buffer.extend(cf::statistics_block(0, counts));
        }
        self.flush();
    }

    /// The file, after writing out what waits: the successor appends to it.
    fn hand_over(&mut self) -> Option<Descriptors> {
        self.flush();
        let fd = self.file.as_ref()?.try_clone().ok()?;
        let position = Position {
            format: self.format,
            snaplen: self.snaplen,
        };
        Some(Descriptors {
            fds: vec![fd.into()],
            position: serde_json::to_value(position).ok()?,
        })
    }
}

/// A classic PCAP file for Ethernet frames as offline tools write them (snaplen 65535,
/// microsecond timestamps), so outputs compare with other tools' files packet by packet.
pub fn ethernet_pcap_writer(path: &std::path::Path) -> Result<PcapWriter<BufWriter<File>>, String> {
    let f = stitch_core::files::create_output(path, 0o600, 0)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    let header = PcapHeader {
        snaplen: 65535,
        datalink: DataLink::ETHERNET,
        endianness: Endianness::native(),
        ..Default::default()
    };
    PcapWriter::with_header(BufWriter::new(f), header)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_written_in_the_hosts_byte_order_as_libpcap_writes_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.pcap");
        drop(ethernet_pcap_writer(&path).unwrap());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes[..4], 0xa1b2_c3d4u32.to_ne_bytes());
        assert_eq!(
            crate::capture_format::pcap_header(100)[..4],
            0xa1b2_3c4du32.to_ne_bytes()
        );
        assert_eq!(
            crate::capture_format::section_header()[8..12],
            0x1a2b_3c4du32.to_ne_bytes()
        );
    }
}
