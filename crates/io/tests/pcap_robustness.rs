//! The PCAP/PCAPNG reader against damaged input: every mutated file ends in packets, a clean end
//! or an error — never a panic. (The same inputs drive the cargo-fuzz target in `fuzz/`.)

use pcap_file::pcap::{PcapHeader, PcapWriter};
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
use pcap_file::pcapng::blocks::interface_description::{
    InterfaceDescriptionBlock, InterfaceDescriptionOption,
};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::{DataLink, TsResolution};
use std::borrow::Cow;
use std::time::Duration;
use stitch_io::pcap_source::PcapFile;

fn pcap(resolution: TsResolution, snaplen: u32, frames: &[(u64, Vec<u8>, u32)]) -> Vec<u8> {
    let header = PcapHeader {
        snaplen,
        datalink: DataLink::ETHERNET,
        ts_resolution: resolution,
        ..Default::default()
    };
    let mut w = PcapWriter::with_header(Vec::new(), header).unwrap();
    for (ts, data, orig) in frames {
        // Raw records, so that orig_len may exceed snaplen as in real truncated captures.
        let frac = if resolution == TsResolution::NanoSecond {
            ts % 1_000_000_000
        } else {
            ts % 1_000_000_000 / 1000
        };
        let raw = pcap_file::pcap::RawPcapPacket {
            ts_sec: (ts / 1_000_000_000) as u32,
            ts_frac: frac as u32,
            incl_len: data.len() as u32,
            orig_len: *orig,
            data: Cow::Borrowed(data),
        };
        w.write_raw_packet(&raw).unwrap();
    }
    w.into_writer()
}

fn pcapng(tsresol: u8, frames: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut w = PcapNgWriter::new(Vec::new()).unwrap();
    w.write_pcapng_block(InterfaceDescriptionBlock {
        linktype: DataLink::ETHERNET,
        snaplen: 0,
        options: vec![InterfaceDescriptionOption::IfTsResol(tsresol)],
    })
    .unwrap();
    for (raw_ts, data) in frames {
        w.write_pcapng_block(EnhancedPacketBlock {
            interface_id: 0,
            // pcap-file writes the raw units given here.
            timestamp: Duration::from_nanos(*raw_ts),
            original_len: data.len() as u32,
            data: Cow::Borrowed(data),
            options: vec![],
        })
        .unwrap();
    }
    w.into_inner()
}

fn read_all(bytes: Vec<u8>) -> Result<Vec<(u64, Vec<u8>)>, String> {
    let mut f = PcapFile::from_reader(Box::new(std::io::Cursor::new(bytes)))?;
    let mut out = Vec::new();
    while let Some(r) = f.next_packet() {
        let (ts, data) = r?;
        out.push((ts, data.to_vec()));
        if out.len() > 100_000 {
            break;
        }
    }
    Ok(out)
}

fn frames() -> Vec<Vec<u8>> {
    [60usize, 64, 1514, 9216]
        .iter()
        .enumerate()
        .map(|(i, &n)| vec![i as u8; n])
        .collect()
}

#[test]
fn truncated_captures_and_timestamp_units_read_right() {
    // tcpdump -s 96: orig_len above snaplen is normal and must be read.
    let f = vec![(1_000_000_123_456_789, vec![7u8; 96], 1500u32)];
    let got = read_all(pcap(TsResolution::NanoSecond, 96, &f)).unwrap();
    assert_eq!(got, vec![(1_000_000_123_456_789, vec![7u8; 96])]);
    let got = read_all(pcap(TsResolution::MicroSecond, 96, &f)).unwrap();
    assert_eq!(got[0].0, 1_000_000_123_456_000);
    // PCAPNG: microseconds (6), nanoseconds (9), and 2^-10 s units.
    let data = vec![1u8; 60];
    assert_eq!(
        read_all(pcapng(6, &[(5_000_001, data.clone())])).unwrap()[0].0,
        5_000_001_000
    );
    assert_eq!(
        read_all(pcapng(9, &[(5_000_001, data.clone())])).unwrap()[0].0,
        5_000_001
    );
    assert_eq!(
        read_all(pcapng(0x80 | 10, &[(2048, data)])).unwrap()[0].0,
        2_000_000_000
    );
}

#[test]
fn damaged_files_end_in_an_error_not_a_crash() {
    let good = pcap(
        TsResolution::NanoSecond,
        65535,
        &[(1, vec![0; 64], 64), (2, vec![0; 64], 64)],
    );
    assert_eq!(read_all(good.clone()).unwrap().len(), 2);
    // Cut in the middle of the second record.
    let err = read_all(good[..good.len() - 10].to_vec()).unwrap_err();
    assert!(!err.is_empty());
    assert!(read_all(vec![1, 2]).unwrap_err().contains("too short"));
    assert!(read_all(b"not a capture file at all".to_vec())
        .unwrap_err()
        .contains("neither PCAP nor PCAPNG"));
}

/// xorshift64*: deterministic, so a failure reproduces.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

#[test]
fn mutated_files_never_panic() {
    let fr = frames();
    let seeds = [
        pcap(
            TsResolution::NanoSecond,
            262144,
            &fr.iter()
                .enumerate()
                .map(|(i, f)| (i as u64 * 1000, f.clone(), f.len() as u32))
                .collect::<Vec<_>>(),
        ),
        pcap(
            TsResolution::MicroSecond,
            128,
            &fr.iter()
                .map(|f| (7, f[..f.len().min(128)].to_vec(), f.len() as u32))
                .collect::<Vec<_>>(),
        ),
        pcapng(
            9,
            &fr.iter()
                .enumerate()
                .map(|(i, f)| (i as u64, f.clone()))
                .collect::<Vec<_>>(),
        ),
    ];
    let mut rng = Rng(0x5717_c4ed);
    let mut outcomes = [0usize; 2];
    for _ in 0..3000 {
        let mut b = seeds[rng.below(seeds.len())].clone();
        for _ in 0..1 + rng.below(6) {
            if b.is_empty() {
                break;
            }
            let at = rng.below(b.len());
            match rng.below(5) {
                0 => b[at] ^= 1 << rng.below(8),
                1 => b.truncate(at),
                2 => {
                    // Overwrite a 32-bit field (lengths, magic, counts) with an extreme value.
                    let v =
                        [0u32, 1, 0x7fff_ffff, 0xffff_ffff, 9217, 4][rng.below(6)].to_le_bytes();
                    for (k, x) in v.iter().enumerate() {
                        if let Some(y) = b.get_mut(at + k) {
                            *y = *x;
                        }
                    }
                }
                3 => b.insert(at, rng.next() as u8),
                _ => {
                    let end = (at + 1 + rng.below(64)).min(b.len());
                    b.drain(at..end);
                }
            }
        }
        outcomes[read_all(b).is_ok() as usize] += 1;
    }
    // Both outcomes occur: the mutations really reach the parser.
    assert!(outcomes[0] > 100 && outcomes[1] > 100, "{outcomes:?}");
}
