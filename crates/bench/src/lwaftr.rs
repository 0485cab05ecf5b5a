//! `stitch bench lwaftr`: the function alone on one thread, fed from looped PCAP packets (Snabb's
//! benchmark packets, or a generated table of N softwires with random traffic over it), against
//! the refill alone in the same run.

use anyhow::{Context, Result};
use pcap_file::pcap::PcapPacket;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use stitch_apps::lwaftr::offline::Offline;
use stitch_apps::lwaftr::Compat;
use stitch_core::link::link;
use stitch_core::pool;
use stitch_io::pcap_sink::ethernet_pcap_writer;
use stitch_io::pcap_source::PcapFile;

/// `--softwires N`: the benchmark on a generated table and 100 000 packets per direction.
pub fn bench_generated(n: usize, seconds: f64, runs: usize) -> Result<()> {
    anyhow::ensure!(n >= 1, "--softwires must be at least 1");
    let dir = tempfile::tempdir()?;
    let t = Instant::now();
    let (conf, v4, v6) = generate(dir.path(), n, 100_000, 550)?;
    println!(
        "generated {n} softwires and 100000 random packets per direction in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    bench(&conf, &v4, &v6, seconds, runs)
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
    let mut rng = fastrand::Rng::with_seed(0x2545f4914f6cdd1d);
    let mut next = move || rng.u64(..);
    let (in4, in6) = (dir.join("v4.pcap"), dir.join("v6.pcap"));
    let (mut w4, mut w6) = (
        ethernet_pcap_writer(&in4).map_err(anyhow::Error::msg)?,
        ethernet_pcap_writer(&in6).map_err(anyhow::Error::msg)?,
    );
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
pub fn bench(conf: &Path, v4: &Path, v6: &Path, seconds: f64, runs: usize) -> Result<()> {
    let read = |p: &Path| PcapFile::read_all(p).map_err(anyhow::Error::msg);
    let (p4, p6) = (read(v4)?, read(v6)?);
    anyhow::ensure!(
        !p4.is_empty() && !p6.is_empty(),
        "both PCAP files need packets"
    );
    let cpu = || crate::cpu_seconds(libc::RUSAGE_THREAD);
    const BATCH: usize = 128;
    let mut results = Vec::new();
    for _ in 0..runs {
        let mut h = Offline::new(conf, Compat::Rfc).map_err(anyhow::Error::msg)?;
        let (mut i4, mut i6) = (0usize, 0usize);
        let (mut n, mut out) = (0u64, [0u64; 2]);
        let t = Instant::now();
        let c0 = cpu();
        while t.elapsed().as_secs_f64() < seconds {
            for _ in 0..BATCH {
                h.feed(0, &p4[i4 % p4.len()]).map_err(anyhow::Error::msg)?;
                h.feed(1, &p6[i6 % p6.len()]).map_err(anyhow::Error::msg)?;
                i4 += 1;
                i6 += 1;
            }
            h.push();
            for (side, o) in out.iter_mut().enumerate() {
                *o += h.drain(side).count() as u64;
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
