//! `stitch bench lwaftr`: the function alone on one thread, fed from looped PCAP packets (Snabb's
//! benchmark packets) or with random traffic over a generated table of N softwires, against the
//! refill alone in the same run.

use anyhow::Result;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::Instant;
use stitch_apps::lwaftr::offline::Offline;
use stitch_apps::lwaftr::Compat;
use stitch_core::link::link;
use stitch_core::{Consumer, Producer};
use stitch_io::pcap_source::PcapFile;

/// `--softwires N`: the benchmark on a generated table with random traffic over all of it.
pub fn bench_generated(n: usize, seconds: f64, runs: usize) -> Result<()> {
    anyhow::ensure!(n >= 1, "--softwires must be at least 1");
    let dir = tempfile::tempdir()?;
    let t = Instant::now();
    let conf = generated_table(dir.path(), n)?;
    println!(
        "generated {n} softwires in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    bench(
        &conf,
        Traffic::Random(RandomTraffic::new(n, 550)),
        seconds,
        runs,
    )
}

/// Softwire `i` of a generated table: 16 per IPv4 address (PSID length 4, 4096 ports each).
fn softwire_ipv4(i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::from(0x0a00_0000u32 + (i / 16) as u32)
}

fn softwire_b4(i: usize) -> std::net::Ipv6Addr {
    std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, (i >> 16) as u16, i as u16)
}

const GENERATED_BR: std::net::Ipv6Addr =
    std::net::Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1);

/// A binding table of `n` softwires written as a Snabb configuration.
pub fn generated_table(dir: &Path, n: usize) -> Result<PathBuf> {
    use std::io::Write;
    let conf = dir.join("lwaftr-generated.conf");
    let mut f = BufWriter::new(File::create(&conf)?);
    writeln!(f, "softwire-config {{\n  binding-table {{")?;
    let br = GENERATED_BR;
    for i in 0..n {
        writeln!(
            f,
            "    softwire {{ ipv4 {}; psid {}; b4-ipv6 {}; br-address {br}; port-set {{ psid-length 4; }} }}",
            softwire_ipv4(i),
            i % 16,
            softwire_b4(i)
        )?;
    }
    writeln!(f, "  }}\n  instance {{ device bench; queue {{ id 0;\n    external-interface {{ ip 192.0.2.1; mac 02:00:00:00:00:01; next-hop {{ mac 02:00:00:00:00:02; }} }}\n    internal-interface {{ ip {br}; mac 02:00:00:00:00:03; next-hop {{ mac 02:00:00:00:00:04; }} }} }} }}\n}}")?;
    f.flush()?;
    Ok(conf)
}

/// Random UDP traffic over a generated table: toward a random bound port from the internet,
/// from a random B4 with a matching inner source from the B4s.
pub struct RandomTraffic {
    softwires: usize,
    frames: [Vec<u8>; 2],
    /// Each side's IPv4 header summed with its checksum, address and remote byte at zero: the
    /// checksum is completed from the new values, without reading back bytes just written
    /// (which would stall on store forwarding).
    header_sums: [u64; 2],
    rng: fastrand::Rng,
}

/// Offsets in the frames of [`RandomTraffic`]: Ethernet, then IPv4 and UDP on side 0; Ethernet,
/// IPv6, then the inner IPv4 and UDP on side 1.
const V4_IP: usize = 14;
const V6_IP: usize = 14;
const V6_INNER: usize = 14 + 40;

impl RandomTraffic {
    pub fn new(softwires: usize, size: usize) -> RandomTraffic {
        let remote = std::net::Ipv4Addr::new(198, 51, 100, 1);
        let udp = |src: std::net::Ipv4Addr, sport: u16, dst: std::net::Ipv4Addr, dport: u16| {
            let mut ip = stitch_wire::ipv4_header(src, dst, 17, size - 34, false).to_vec();
            ip.extend_from_slice(&sport.to_be_bytes());
            ip.extend_from_slice(&dport.to_be_bytes());
            ip.extend_from_slice(&((size - 34) as u16).to_be_bytes());
            ip.extend_from_slice(&[0, 0]);
            ip.resize(size - 14, 0);
            ip
        };
        let mut f4 = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 8, 0];
        f4.extend_from_slice(&udp(remote, 443, softwire_ipv4(0), 0));
        let inner = udp(softwire_ipv4(0), 0, remote, 443);
        let mut f6 = vec![
            2, 0, 0, 0, 0, 3, 2, 0, 0, 0, 0, 4, 0x86, 0xdd, 0x60, 0, 0, 0,
        ];
        f6.extend_from_slice(&(inner.len() as u16).to_be_bytes());
        f6.extend_from_slice(&[4, 64]);
        f6.extend_from_slice(&softwire_b4(0).octets());
        f6.extend_from_slice(&GENERATED_BR.octets());
        f6.extend_from_slice(&inner);
        let header_sum = |f: &[u8], ip: usize, variable: [std::ops::Range<usize>; 2]| {
            let mut h = f[ip..ip + 20].to_vec();
            h[10..12].fill(0);
            for r in variable {
                h[r].fill(0);
            }
            stitch_wire::checksum::sum(&h, 0)
        };
        RandomTraffic {
            softwires,
            header_sums: [
                header_sum(&f4, V4_IP, [15..16, 16..20]),
                header_sum(&f6, V6_INNER, [12..16, 19..20]),
            ],
            frames: [f4, f6],
            rng: fastrand::Rng::with_seed(0x2545_f491_4f6c_dd1d),
        }
    }

    /// Writes `side`'s frame into the fresh packet `p`, then rewrites it there for a random
    /// softwire and port. The template is never written: a copy that read bytes just stored
    /// into it would wait for those narrow stores to reach the cache (store forwarding fails
    /// for a wide load over several of them) — 79 % of the copy's time, once.
    #[inline]
    fn write_fresh(&mut self, side: usize, p: &mut stitch_core::Packet) {
        write_fresh(p, &self.frames[side]);
        self.rewrite(side, p.data_mut());
    }

    /// Rewrites `f`, a copy of `side`'s template, for a random softwire and port.
    #[inline]
    fn rewrite(&mut self, side: usize, f: &mut [u8]) {
        let i = self.rng.usize(..self.softwires);
        let port = ((i % 16) as u16) << 12 | (self.rng.u16(..) & 0x0fff);
        let remote = self.rng.u8(1..251);
        let address = u32::from(softwire_ipv4(i));
        let ip = if side == 0 {
            f[V4_IP + 15] = remote;
            f[V4_IP + 16..V4_IP + 20].copy_from_slice(&address.to_be_bytes());
            f[V4_IP + 22..V4_IP + 24].copy_from_slice(&port.to_be_bytes());
            V4_IP
        } else {
            f[V6_IP + 8..V6_IP + 24].copy_from_slice(&softwire_b4(i).octets());
            f[V6_INNER + 12..V6_INNER + 16].copy_from_slice(&address.to_be_bytes());
            f[V6_INNER + 19] = remote;
            f[V6_INNER + 20..V6_INNER + 22].copy_from_slice(&port.to_be_bytes());
            V6_INNER
        };
        // The remote is the low byte of its word in both headers.
        let sum = self.header_sums[side]
            + remote as u64
            + (address >> 16) as u64
            + (address & 0xffff) as u64;
        let cs = stitch_wire::checksum::finish(sum);
        f[ip + 10..ip + 12].copy_from_slice(&cs.to_be_bytes());
    }
}

/// Where the benchmark's input frames come from, side by side (0: IPv4, 1: IPv6).
pub enum Traffic {
    /// Frames looped from PCAP files, each copied whole, as Snabb's benchmark replays its files.
    Looped {
        v4: Vec<Vec<u8>>,
        v6: Vec<Vec<u8>>,
        next: [usize; 2],
    },
    /// Random traffic over a generated table: one template frame per side, copied into each
    /// packet whose addresses, ports and checksums are then rewritten (a traffic generator's
    /// field engine), so every packet's softwire is drawn afresh from the whole table and the
    /// frame to copy stays in the cache, as a NIC delivering into the cache would leave it.
    Random(RandomTraffic),
}

impl Traffic {
    /// Writes the next frame for `side` into `p`, a fresh packet of `transmit_fresh`.
    #[inline]
    fn write_fresh(&mut self, side: usize, p: &mut stitch_core::Packet) {
        match self {
            Traffic::Looped { v4, v6, next } => {
                let frames = if side == 0 { v4 } else { v6 };
                let i = next[side];
                next[side] = if i + 1 == frames.len() { 0 } else { i + 1 };
                write_fresh(p, &frames[i])
            }
            Traffic::Random(r) => r.write_fresh(side, p),
        }
    }

    /// The mean length of `side`'s frames, for the prefetch of the lines they are written to.
    fn frame_bytes(&self, side: usize) -> usize {
        match self {
            Traffic::Looped { v4, v6, .. } => {
                let frames = if side == 0 { v4 } else { v6 };
                frames.iter().map(Vec::len).sum::<usize>() / frames.len().max(1)
            }
            Traffic::Random(r) => r.frames[side].len(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Traffic::Looped { v4, v6, .. } => {
                format!("{} IPv4 + {} IPv6 packets looped", v4.len(), v6.len())
            }
            Traffic::Random(r) => format!(
                "random traffic over {} softwires ({}-byte frames rewritten per packet)",
                r.softwires,
                r.frames[0].len()
            ),
        }
    }
}

/// Packets per side that the benchmark writes into an input before each push.
const BATCH: usize = 128;

/// How long the function and the refill alone each run before the other takes its turn.
const SLICE_SECONDS: f64 = 0.01;

/// `stitch bench lwaftr`: the function alone on one thread, its inputs refilled from `traffic`,
/// against a baseline that moves the same refilled batches without the function, in the same
/// run. The two take turns in slices of `SLICE_SECONDS`, so that both see the same minutes of
/// a shared machine whose speed changes from one second to the next.
pub fn bench(conf: &Path, mut traffic: Traffic, seconds: f64, runs: usize) -> Result<()> {
    let frame_bytes = [traffic.frame_bytes(0), traffic.frame_bytes(1)];
    let mut results = Vec::new();
    let mut table = (0usize, 0usize, false);
    for _ in 0..runs {
        let mut h = Offline::new(conf, Compat::Rfc).map_err(anyhow::Error::msg)?;
        let t = h.function().binding_table();
        table = (t.len(), t.memory_bytes(), t.in_huge_pages());
        let (mut bp, mut bc) = link(8192);
        // A turn of each first, uncounted: the pool grows to what the run keeps in flight.
        slice_through_function(&mut h, &mut traffic, frame_bytes)?;
        slice_of_refill_alone(&mut bp, &mut bc, &mut traffic, frame_bytes)?;
        let (mut n, mut bn, mut out) = (0u64, 0u64, [0u64; 2]);
        let (mut lw, mut base) = (0f64, 0f64);
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < 2.0 * seconds {
            let c0 = crate::thread_cpu_seconds();
            let (fed, through) = slice_through_function(&mut h, &mut traffic, frame_bytes)?;
            let c1 = crate::thread_cpu_seconds();
            bn += slice_of_refill_alone(&mut bp, &mut bc, &mut traffic, frame_bytes)?;
            base += crate::thread_cpu_seconds() - c1;
            lw += c1 - c0;
            n += fed;
            out = [out[0] + through[0], out[1] + through[1]];
        }
        let ns_lw = lw * 1e9 / n as f64;
        let ns_base = base * 1e9 / bn as f64;
        results.push((ns_lw, ns_base, out, n));
    }
    results.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    let (ns_lw, ns_base, out, n) = results[results.len() / 2];
    let own = (ns_lw - ns_base).max(0.1);
    println!(
        "lwaftr {}: {}; median of {runs} runs of {seconds} s",
        conf.display(),
        traffic.describe()
    );
    println!(
        "  with refill: {ns_lw:.1} ns/packet ({:.2} Mpps per direction on one core); refill alone {ns_base:.1} ns/packet",
        1e3 / ns_lw / 2.0
    );
    println!(
        "  function alone: {own:.1} ns/packet = {:.2} Mpps per direction per core (both directions at once)",
        1e3 / own / 2.0
    );
    println!("  out: {} on v4, {} on v6 of {} in", out[0], out[1], n);
    println!(
        "  binding table: {} softwires in {:.1} MB, {:.1} bytes per softwire, {}",
        table.0,
        table.1 as f64 / 1e6,
        table.1 as f64 / table.0.max(1) as f64,
        if table.2 {
            "in huge pages"
        } else {
            "in 4 KiB pages (under 2 MiB, or transparent huge pages are off)"
        }
    );
    anyhow::ensure!(
        out[0] + out[1] >= n * 9 / 10,
        "the function dropped most packets: the traffic does not match its table"
    );
    Ok(())
}

/// The function's turn: batches written into both inputs and pushed through, the outputs freed,
/// for `SLICE_SECONDS`. Returns the packets fed and those that came out of each side.
fn slice_through_function(
    h: &mut Offline,
    traffic: &mut Traffic,
    frame_bytes: [usize; 2],
) -> Result<(u64, [u64; 2])> {
    let (mut n, mut out) = (0u64, [0u64; 2]);
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < SLICE_SECONDS {
        for (side, &bytes) in frame_bytes.iter().enumerate() {
            let fed = h.feed_fresh(side, BATCH, bytes, |p| traffic.write_fresh(side, p));
            anyhow::ensure!(fed == BATCH, "the packet pool ran out");
        }
        h.push();
        for (side, o) in out.iter_mut().enumerate() {
            *o += h.discard(side);
        }
        n += 2 * BATCH as u64;
    }
    Ok((n, out))
}

/// The baseline's turn: the same refill, moved straight to a link and freed, for
/// `SLICE_SECONDS`. Returns the packets moved.
fn slice_of_refill_alone(
    input: &mut Producer,
    output: &mut Consumer,
    traffic: &mut Traffic,
    frame_bytes: [usize; 2],
) -> Result<u64> {
    let mut n = 0;
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < SLICE_SECONDS {
        for (side, &bytes) in frame_bytes.iter().enumerate() {
            let fed = input.transmit_fresh(BATCH, bytes, |p| traffic.write_fresh(side, p));
            anyhow::ensure!(fed == BATCH, "the packet pool ran out");
        }
        n += output.free_available().0;
    }
    Ok(n)
}

/// Copies `frame` into a packet `transmit_fresh` hands (the frames were read from PCAP files
/// or built to fit a buffer).
#[inline(always)]
fn write_fresh(p: &mut stitch_core::Packet, frame: &[u8]) {
    // SAFETY: `transmit_fresh` (and `feed_fresh` over it) hands fresh packets.
    unsafe { p.set_fresh_data(frame) }
}

/// Looped frames from two PCAP files.
pub fn looped(v4: &Path, v6: &Path) -> Result<Traffic> {
    let read = |p: &Path| PcapFile::read_all(p).map_err(anyhow::Error::msg);
    let (v4, v6) = (read(v4)?, read(v6)?);
    anyhow::ensure!(
        !v4.is_empty() && !v6.is_empty(),
        "both PCAP files need packets"
    );
    Ok(Traffic::Looped {
        v4,
        v6,
        next: [0, 0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_traffic_is_valid_and_every_packet_matches_a_softwire() {
        let dir = tempfile::tempdir().unwrap();
        // Large enough for the function to fetch its lookups ahead, as with a million.
        let n = 16384;
        let conf = generated_table(dir.path(), n).unwrap();
        let mut traffic = RandomTraffic::new(n, 550);
        let mut h = Offline::new(&conf, Compat::Rfc).unwrap();
        assert!(h.function().binding_table().prefetch_pays());
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            for (side, ip) in [(0, V4_IP), (1, V6_INNER)] {
                let mut f = traffic.frames[side].clone();
                traffic.rewrite(side, &mut f);
                // The IPv6 side carries the 550-byte IPv4 frame's packet in 40 more bytes.
                assert_eq!(f.len(), 550 + 40 * side);
                assert_eq!(
                    stitch_wire::checksum::checksum(&f[ip..ip + 20]),
                    0,
                    "a valid IPv4 header checksum"
                );
                seen.insert(f[ip + 12..ip + 20].to_vec());
                h.feed(side, &f).unwrap();
            }
        }
        h.push();
        assert_eq!(h.drain(0).count(), 200, "every B4 packet decapsulated");
        assert_eq!(
            h.drain(1).count(),
            200,
            "every internet packet encapsulated"
        );
        assert!(seen.len() > 300, "addresses drawn afresh for each packet");
        // The benchmark's own way in and out: bursts written into the inputs, outputs freed.
        for side in 0..2 {
            let bytes = traffic.frames[side].len();
            let fed = h.feed_fresh(side, 200, bytes, |p| traffic.write_fresh(side, p));
            assert_eq!(fed, 200);
        }
        h.push();
        assert_eq!((h.discard(0), h.discard(1)), (200, 200));
        assert_eq!(h.drain(0).count() + h.drain(1).count(), 0);
        assert_eq!(h.function().binding_table().len(), n);
    }
}
