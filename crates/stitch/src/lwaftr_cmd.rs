//! `stitch lwaftr check|run` and `stitch bench lwaftr`: the lwAFTR offline on PCAP files (for
//! byte-for-byte comparisons), on interfaces, and measured.

use anyhow::{Context, Result};
use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::DataLink;
use serde_json::json;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use stitch_core::app::{Counters, DynApp};
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pool, AppContext, Io, Registry};
use stitch_io::pcap_source::PcapFile;

#[derive(clap::Subcommand)]
pub enum LwaftrCmd {
    /// Runs the function on PCAP inputs and writes its outputs (timestamps zero, snaplen 65535,
    /// Ethernet), as Snabb's `lwaftr check` does, so that results compare byte for byte.
    Check {
        conf: PathBuf,
        in_v4: PathBuf,
        in_v6: PathBuf,
        out_v4: PathBuf,
        out_v6: PathBuf,
        /// Print the counters as JSON.
        #[arg(long)]
        counters: bool,
        /// `snabb` reproduces Snabb's bytes where Snabb departs from the RFCs (the lwaftr
        /// app's `compat` setting; docs/lwaftr-snabb-differences.md).
        #[arg(long, default_value = "rfc")]
        compat: String,
    },
    /// Runs the function between two interfaces (AF_PACKET).
    Run {
        conf: PathBuf,
        /// Interface toward the IPv4 internet.
        #[arg(long)]
        v4: String,
        /// Interface toward the B4s (IPv6).
        #[arg(long)]
        v6: String,
        #[arg(long)]
        duration: Option<f64>,
        #[arg(long, default_value = "lwaftr")]
        name: String,
    },
}

fn read_all(path: &Path) -> Result<Vec<Vec<u8>>> {
    let mut f = PcapFile::open(path).map_err(anyhow::Error::msg)?;
    let mut out = Vec::new();
    while let Some(p) = f.next_packet() {
        out.push(p.map_err(anyhow::Error::msg)?.1.to_vec());
    }
    Ok(out)
}

fn writer(path: &Path) -> Result<PcapWriter<BufWriter<File>>> {
    let f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let header = PcapHeader {
        snaplen: 65535,
        datalink: DataLink::ETHERNET,
        ..Default::default()
    };
    Ok(PcapWriter::with_header(BufWriter::new(f), header)?)
}

/// The function with its four link ends, driven directly (no engine, no threads).
struct Harness {
    app: Box<dyn DynApp>,
    io: Io,
    inputs: [Producer; 2],
    outputs: [Consumer; 2],
    counters: Counters,
}

impl Harness {
    fn new(registry: &Registry, conf: &Path, compat: &str) -> Result<Harness> {
        let t = registry
            .get("lwaftr")
            .context("lwaftr missing from this build")?;
        let conf = std::path::absolute(conf)?;
        let parsed = t
            .parse(&json!({ "conf": conf, "compat": compat }))
            .map_err(|e| anyhow::anyhow!("{}: {}", e.path, e.message))?;
        let counters = Counters::default();
        let mut ctx = AppContext::new("lwaftr", Path::new("."), counters.clone());
        let app = t
            .build(parsed, &mut ctx)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (p4, c4) = link(4096);
        let (p6, c6) = link(4096);
        let (o4, r4) = link(8192);
        let (o6, r6) = link(8192);
        let io = Io::new(
            vec![("v4".into(), c4), ("v6".into(), c6)],
            vec![("v4".into(), o4), ("v6".into(), o6)],
        );
        Ok(Harness {
            app,
            io,
            inputs: [p4, p6],
            outputs: [r4, r6],
            counters,
        })
    }

    fn feed(&mut self, side: usize, bytes: &[u8]) -> Result<()> {
        let mut p = pool::alloc().context("packet pool exhausted")?;
        p.set_data(bytes)
            .map_err(|_| anyhow::anyhow!("a {} byte packet does not fit a buffer", bytes.len()))?;
        self.inputs[side].transmit(p);
        Ok(())
    }
}

pub fn run(cmd: LwaftrCmd, registry: Registry) -> Result<()> {
    match cmd {
        LwaftrCmd::Check {
            conf,
            in_v4,
            in_v6,
            out_v4,
            out_v6,
            counters,
            compat,
        } => {
            let mut h = Harness::new(&registry, &conf, &compat)?;
            let (v4, v6) = (read_all(&in_v4)?, read_all(&in_v6)?);
            let mut w = [writer(&out_v4)?, writer(&out_v6)?];
            let mut written = [0u64; 2];
            let mut write = |h: &mut Harness| -> Result<()> {
                for side in 0..2 {
                    for p in h.outputs[side].drain() {
                        w[side].write_packet(&PcapPacket::new(
                            Duration::ZERO,
                            p.len() as u32,
                            p.data(),
                        ))?;
                        written[side] += 1;
                    }
                }
                Ok(())
            };
            // The function's start: what it sends before any input (ARP requests and neighbor
            // solicitations for next hops given by IP).
            h.app.tick(&mut h.io, Instant::now());
            write(&mut h)?;
            // In batches, IPv4 input first, as the function would see them in one breath.
            for (b4, b6) in v4.chunks(1024).zip(v6.chunks(1024)).chain(
                v4.chunks(1024)
                    .skip(v6.chunks(1024).count())
                    .map(|b| (b, &[][..]))
                    .chain(
                        v6.chunks(1024)
                            .skip(v4.chunks(1024).count())
                            .map(|b| (&[][..], b)),
                    ),
            ) {
                for p in b4 {
                    h.feed(0, p)?;
                }
                for p in b6 {
                    h.feed(1, p)?;
                }
                h.app.push(&mut h.io);
                write(&mut h)?;
            }
            h.app.stop();
            eprintln!(
                "lwaftr check: {} IPv4 + {} IPv6 packets in, {} out on v4 ({}), {} out on v6 ({})",
                v4.len(),
                v6.len(),
                written[0],
                out_v4.display(),
                written[1],
                out_v6.display()
            );
            let snapshot = h.counters.snapshot();
            if counters {
                println!("{}", serde_json::to_string_pretty(&snapshot)?);
            } else {
                for (k, v) in snapshot.iter().filter(|(_, v)| **v > 0) {
                    eprintln!("  {k:<28} {v}");
                }
            }
            Ok(())
        }
        LwaftrCmd::Run { .. } => unreachable!("run by main with the graph of `run_graph`"),
    }
}

/// The graph of `stitch lwaftr run`: AF_PACKET on both interfaces around the function, in a
/// temporary folder that lives as long as the returned handle.
pub fn run_graph(conf: &Path, v4: &str, v6: &str) -> Result<(tempfile::TempDir, PathBuf)> {
    let conf = std::path::absolute(conf)?;
    let dir = tempfile::tempdir()?;
    let graph = dir.path().join("lwaftr.yaml");
    let text = serde_json::to_string_pretty(&json!({
        "apps": {
            "v4": { "type": "af_packet", "interface": v4 },
            "v6": { "type": "af_packet", "interface": v6 },
            "aftr": { "type": "lwaftr", "conf": conf },
        },
        "links": ["v4.output -> aftr.v4", "aftr.v4 -> v4.input",
                  "v6.output -> aftr.v6", "aftr.v6 -> v6.input"],
    }))?;
    std::fs::write(&graph, text)?;
    Ok((dir, graph))
}

/// A binding table of `n` softwires (16 per IPv4 address, 4096 ports each) written as a Snabb
/// configuration, and `count` random packets per direction over it: IPv4 toward a random bound
/// port, IPv6 from a random B4 with a matching inner source.
pub fn generate(
    dir: &Path,
    n: usize,
    count: usize,
    size: usize,
) -> Result<(PathBuf, PathBuf, PathBuf)> {
    use std::io::Write;
    let conf = dir.join("lwaftr-generated.conf");
    let mut f = BufWriter::new(File::create(&conf)?);
    writeln!(f, "softwire-config {{\n  binding-table {{")?;
    let addr = |i: usize| std::net::Ipv4Addr::from(0x0a00_0000u32 + (i / 16) as u32);
    let b4 =
        |i: usize| std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, (i >> 16) as u16, i as u16);
    let br = std::net::Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1);
    for i in 0..n {
        writeln!(
            f,
            "    softwire {{ ipv4 {}; psid {}; b4-ipv6 {}; br-address {br}; port-set {{ psid-length 4; }} }}",
            addr(i),
            i % 16,
            b4(i)
        )?;
    }
    writeln!(f, "  }}\n  instance {{ device bench; queue {{ id 0;\n    external-interface {{ ip 192.0.2.1; mac 02:00:00:00:00:01; next-hop {{ mac 02:00:00:00:00:02; }} }}\n    internal-interface {{ ip {br}; mac 02:00:00:00:00:03; next-hop {{ mac 02:00:00:00:00:04; }} }} }} }}\n}}")?;
    drop(f);
    let mut rng = 0x2545f4914f6cdd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (in4, in6) = (dir.join("v4.pcap"), dir.join("v6.pcap"));
    let (mut w4, mut w6) = (writer(&in4)?, writer(&in6)?);
    for _ in 0..count {
        let i = next() as usize % n;
        let port = ((i % 16) as u16) << 12 | (next() as u16 & 0x0fff);
        let udp = |src: std::net::Ipv4Addr, sport: u16, dst: std::net::Ipv4Addr, dport: u16| {
            let mut ip = stitch_wire::ipv4_header(src, dst, 17, size - 34, false).to_vec();
            ip.extend_from_slice(&sport.to_be_bytes());
            ip.extend_from_slice(&dport.to_be_bytes());
            ip.extend_from_slice(&((size - 34) as u16).to_be_bytes());
            ip.extend_from_slice(&[0, 0]);
            ip.resize(size - 14, 0);
            ip
        };
        let remote = std::net::Ipv4Addr::new(198, 51, 100, (next() % 250) as u8 + 1);
        let mut f4 = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 8, 0];
        f4.extend_from_slice(&udp(remote, 443, addr(i), port));
        w4.write_packet(&PcapPacket::new(Duration::ZERO, f4.len() as u32, &f4))?;
        let inner = udp(addr(i), port, remote, 443);
        let mut f6 = vec![
            2, 0, 0, 0, 0, 3, 2, 0, 0, 0, 0, 4, 0x86, 0xdd, 0x60, 0, 0, 0,
        ];
        f6.extend_from_slice(&(inner.len() as u16).to_be_bytes());
        f6.extend_from_slice(&[4, 64]);
        f6.extend_from_slice(&b4(i).octets());
        f6.extend_from_slice(&br.octets());
        f6.extend_from_slice(&inner);
        w6.write_packet(&PcapPacket::new(Duration::ZERO, f6.len() as u32, &f6))?;
    }
    Ok((conf, in4, in6))
}

/// `stitch bench lwaftr`: the function alone on one thread, its inputs refilled from the
/// given packets in a loop, against a baseline that moves the same refilled batches without
/// the function, in the same run.
pub fn bench(
    registry: Registry,
    conf: &Path,
    v4: &Path,
    v6: &Path,
    seconds: f64,
    runs: usize,
) -> Result<()> {
    let (p4, p6) = (read_all(v4)?, read_all(v6)?);
    anyhow::ensure!(
        !p4.is_empty() && !p6.is_empty(),
        "both PCAP files need packets"
    );
    let cpu = || crate::bench::cpu_seconds(libc::RUSAGE_THREAD);
    const BATCH: usize = 128;
    let mut results = Vec::new();
    for _ in 0..runs {
        let mut h = Harness::new(&registry, conf, "rfc")?;
        let (mut i4, mut i6) = (0usize, 0usize);
        let (mut n, mut out) = (0u64, [0u64; 2]);
        let t = Instant::now();
        let c0 = cpu();
        while t.elapsed().as_secs_f64() < seconds {
            for _ in 0..BATCH {
                h.feed(0, &p4[i4 % p4.len()])?;
                h.feed(1, &p6[i6 % p6.len()])?;
                i4 += 1;
                i6 += 1;
            }
            h.app.push(&mut h.io);
            for (side, o) in out.iter_mut().enumerate() {
                *o += h.outputs[side].drain().count() as u64;
            }
            n += 2 * BATCH as u64;
        }
        let lw = cpu() - c0;
        // Baseline: the same refill, moved straight to the outputs.
        let (mut bi, mut bn) = (0usize, 0u64);
        let (mut bp, mut bc) = link(8192);
        let t = Instant::now();
        let c0 = cpu();
        while t.elapsed().as_secs_f64() < seconds {
            for _ in 0..BATCH {
                for bytes in [&p4[bi % p4.len()], &p6[bi % p6.len()]] {
                    let mut p = pool::alloc().context("pool")?;
                    let _ = p.set_data(bytes);
                    bp.transmit(p);
                }
                bi += 1;
            }
            bn += bc.drain().count() as u64;
        }
        let base = cpu() - c0;
        let ns_lw = lw * 1e9 / n as f64;
        let ns_base = base * 1e9 / bn as f64;
        results.push((ns_lw, ns_base, out, n));
    }
    results.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    let (ns_lw, ns_base, out, n) = results[results.len() / 2];
    let own = (ns_lw - ns_base).max(0.1);
    println!(
        "lwaftr {}: {} IPv4 + {} IPv6 packets looped; median of {runs} runs of {seconds} s",
        conf.display(),
        p4.len(),
        p6.len()
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
    Ok(())
}
