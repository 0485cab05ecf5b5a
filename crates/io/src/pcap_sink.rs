//! `pcap_sink`: writes every packet it receives to a PCAP or PCAPNG file with nanosecond
//! timestamps (the packet's own timestamp, or the time of writing when it has none).
//!
//! `format` defaults to `pcapng` for a `.pcapng` file name and `pcap` otherwise. Records go
//! through a 1 MiB buffer, so there is no system call per packet; `stop` (end of run, SIGINT,
//! SIGTERM, removal by a live change) flushes it. A PCAPNG file ends with an interface statistics
//! block giving the packets received and those its input link dropped. A write error (disk full)
//! is logged once; later packets are counted in `write_drops`.
//!
//! ```yaml
//! apps:
//!   out: { type: pcap_sink, file: out.pcapng, snaplen: 262144 }
//! ```

use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
use pcap_file::pcapng::blocks::interface_description::{
    InterfaceDescriptionBlock, InterfaceDescriptionOption,
};
use pcap_file::pcapng::blocks::interface_statistics::{
    InterfaceStatisticsBlock, InterfaceStatisticsOption,
};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::{DataLink, Endianness, TsResolution};
use serde::Deserialize;
use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use stitch_core::link::Ring;
use stitch_core::packet::now_ns;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortSpec};

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Pcap,
    Pcapng,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcapSinkConfig {
    pub file: PathBuf,
    pub format: Option<Format>,
    /// Bytes kept of each packet.
    #[serde(default = "default_snaplen")]
    pub snaplen: u32,
}

fn default_snaplen() -> u32 {
    262144
}

type Out = BufWriter<File>;

enum Writer {
    Pcap(PcapWriter<Out>),
    PcapNg(PcapNgWriter<Out>),
}

pub struct PcapSink {
    writer: Option<Writer>,
    path: PathBuf,
    snaplen: u32,
    input: Option<Arc<Ring>>,
    written: Counter,
    write_drops: Counter,
}

impl PcapSink {
    fn fail(&mut self, e: impl std::fmt::Display) {
        log::error!(
            "pcap_sink {}: write failed: {e}; dropping further packets",
            self.path.display()
        );
        self.writer = None;
    }
}

impl App for PcapSink {
    type Config = PcapSinkConfig;

    fn declare(c: &PcapSinkConfig) -> Result<PortSpec, AppError> {
        if c.snaplen == 0 {
            return Err("snaplen must be at least 1".into());
        }
        Ok(PortSpec::sink())
    }

    fn new(c: PcapSinkConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let path = ctx.path(&c.file);
        let format = c.format.unwrap_or(
            if path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("pcapng"))
            {
                Format::Pcapng
            } else {
                Format::Pcap
            },
        );
        let f =
            File::create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let out = BufWriter::with_capacity(1 << 20, f);
        let writer = match format {
            Format::Pcap => {
                let header = PcapHeader {
                    snaplen: c.snaplen,
                    datalink: DataLink::ETHERNET,
                    ts_resolution: TsResolution::NanoSecond,
                    endianness: Endianness::native(),
                    ..Default::default()
                };
                Writer::Pcap(PcapWriter::with_header(out, header)?)
            }
            Format::Pcapng => {
                let mut w = PcapNgWriter::new(out)?;
                let idb = InterfaceDescriptionBlock {
                    linktype: DataLink::ETHERNET,
                    snaplen: c.snaplen,
                    options: vec![
                        InterfaceDescriptionOption::IfName(Cow::Owned(ctx.name().to_string())),
                        InterfaceDescriptionOption::IfTsResol(9),
                    ],
                };
                w.write_pcapng_block(idb)?;
                Writer::PcapNg(w)
            }
        };
        Ok(PcapSink {
            writer: Some(writer),
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
        let (mut written, mut dropped) = (0, 0);
        let mut error = None;
        for p in input.drain() {
            let Some(w) = self.writer.as_mut() else {
                dropped += 1;
                continue;
            };
            let ts = match p.timestamp_ns() {
                0 => now_ns(),
                t => t,
            };
            let data = &p.data()[..p.len().min(self.snaplen as usize)];
            let r = match w {
                Writer::Pcap(w) => w.write_packet(&PcapPacket::new(
                    Duration::from_nanos(ts),
                    p.len() as u32,
                    data,
                )),
                Writer::PcapNg(w) => w.write_pcapng_block(EnhancedPacketBlock {
                    interface_id: 0,
                    timestamp: Duration::from_nanos(ts),
                    original_len: p.len() as u32,
                    data: Cow::Borrowed(data),
                    options: vec![],
                }),
            };
            match r {
                Ok(_) => written += 1,
                Err(e) => {
                    dropped += 1;
                    error = Some(e);
                    self.writer = None;
                }
            }
        }
        self.written.add(written);
        self.write_drops.add(dropped);
        if let Some(e) = error {
            self.fail(e);
        }
    }

    fn stop(&mut self) {
        let Some(w) = self.writer.take() else { return };
        let r = match w {
            Writer::Pcap(w) => w.into_writer().flush(),
            Writer::PcapNg(mut w) => {
                let link_drops = self.input.as_ref().map(|r| r.stats().tx_drops).unwrap_or(0);
                let isb = InterfaceStatisticsBlock {
                    interface_id: 0,
                    timestamp: now_ns(),
                    options: vec![
                        InterfaceStatisticsOption::IsbIfRecv(self.written.get() + link_drops),
                        InterfaceStatisticsOption::IsbIfDrop(link_drops),
                    ],
                };
                match w.write_pcapng_block(isb) {
                    Ok(_) => w.into_inner().flush(),
                    Err(e) => Err(std::io::Error::other(e.to_string())),
                }
            }
        };
        if let Err(e) = r {
            log::error!("pcap_sink {}: final flush failed: {e}", self.path.display());
        }
    }
}

/// A classic PCAP file for Ethernet frames as offline tools write them (snaplen 65535,
/// microsecond timestamps), so outputs compare with other tools' files packet by packet.
pub fn ethernet_pcap_writer(path: &std::path::Path) -> Result<PcapWriter<BufWriter<File>>, String> {
    let f = File::create(path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
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
