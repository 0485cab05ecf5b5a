//! `stitch bench capture-link`: the 8-forwarder chain at full rate with and without a live
//! capture of its middle link written as PCAPNG to tmpfs, alternated run by run: what a tap
//! costs the link it watches, and how many packets it drops when its reader cannot keep up.

use crate::{chain_graph, cpu_seconds, load_average, median, sink_packets, HugePageReserve};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{pool, Engine, Graph, Registry};
use stitch_io::link_capture::{select_links, CaptureOptions, LinkCapture};

#[derive(clap::Args)]
pub struct CaptureLinkArgs {
    /// Forwarders in the chain; the tap watches the link in the middle.
    #[arg(long, default_value_t = 8)]
    hops: usize,
    /// Frame size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Bytes the tap keeps of each packet.
    #[arg(long, default_value_t = 262_144)]
    snaplen: u32,
    /// libpcap filter at the tap.
    #[arg(long)]
    filter: Option<String>,
    /// Folder for the capture file (a tmpfs, so the disk is not what is measured).
    #[arg(long, default_value = "/dev/shm")]
    dir: PathBuf,
    /// Measured seconds per run and contender.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Runs (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

struct Run {
    mpps: f64,
    /// Packets the tap saw, dropped and wrote, and bytes written.
    seen: u64,
    dropped: u64,
    captured: u64,
    bytes: u64,
    /// CPU seconds of the whole process (workers and reader) per packet through the chain.
    cpu_ns_per_packet: f64,
}

pub fn run(a: CaptureLinkArgs, registry: Registry) -> Result<()> {
    anyhow::ensure!(
        a.hops >= 2,
        "--hops must be at least 2 (the tap sits between two)"
    );
    anyhow::ensure!(a.runs >= 1, "--runs must be at least 1");
    let registry = Arc::new(registry);
    let _hugepages = HugePageReserve::for_pool(pool::DEFAULT_PACKETS)?;
    let middle = a.hops / 2;
    let tapped = format!("f{middle}.output -> f{}.input", middle + 1);
    let file = a.dir.join(format!(
        "stitch-bench-capture-{}.pcapng",
        std::process::id()
    ));
    println!(
        "capture-link: {} forwarders, {}-byte packets, tap on `{tapped}` (snaplen {}{}) writing {}, {} s per contender, {} runs; load average {}",
        a.hops,
        a.size,
        a.snaplen,
        a.filter.as_deref().map(|f| format!(", filter `{f}`")).unwrap_or_default(),
        file.display(),
        a.seconds,
        a.runs,
        load_average()
    );
    println!(
        "{:>3}  {:>10} {:>10} {:>7} {:>11} {:>10} {:>9} {:>10}",
        "run", "plain Mpps", "tap Mpps", "ratio", "tap drops %", "written MB", "MB/s", "tap ns/pkt"
    );
    let (mut plain, mut tap, mut ratio, mut drop_pct, mut extra_ns) =
        (vec![], vec![], vec![], vec![], vec![]);
    for run in 1..=a.runs {
        let p = measure(&registry, &a, None, &file)?;
        let t = measure(&registry, &a, Some(&tapped), &file)?;
        let drops = 100.0 * t.dropped as f64 / t.seen.max(1) as f64;
        let mb = t.bytes as f64 / 1e6;
        println!(
            "{run:>3}  {:>10.2} {:>10.2} {:>7.3} {:>11.2} {:>10.1} {:>9.0} {:>10.2}",
            p.mpps,
            t.mpps,
            t.mpps / p.mpps,
            drops,
            mb,
            mb / a.seconds,
            t.cpu_ns_per_packet - p.cpu_ns_per_packet
        );
        plain.push(p.mpps);
        tap.push(t.mpps);
        ratio.push(t.mpps / p.mpps);
        drop_pct.push(drops);
        extra_ns.push(t.cpu_ns_per_packet - p.cpu_ns_per_packet);
        let _ = t.captured;
    }
    println!(
        "med  {:>10.2} {:>10.2} {:>7.3} {:>11.2}  {:>31.2}",
        median(plain),
        median(tap),
        median(ratio),
        median(drop_pct),
        median(extra_ns)
    );
    println!("(ratio = chain Mpps with the tap / without; tap ns/pkt = extra CPU of the process, workers and reader, per packet through the chain)");
    let _ = std::fs::remove_file(&file);
    Ok(())
}

/// One run of the chain; with `tap`, that link is captured to `file` for the whole run.
fn measure(
    registry: &Arc<Registry>,
    a: &CaptureLinkArgs,
    tap: Option<&str>,
    file: &Path,
) -> Result<Run> {
    let g = Graph::parse(
        &chain_graph(a.hops, a.size),
        "<bench>",
        Path::new("."),
        registry,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = Engine::new(registry.clone());
    engine.apply(g)?;
    let stop = Arc::new(AtomicBool::new(false));
    let reader = match tap {
        None => None,
        Some(link) => {
            let links = select_links(&engine.link_rings(), link).map_err(anyhow::Error::msg)?;
            let options = CaptureOptions {
                snaplen: a.snaplen,
                filter: a.filter.clone(),
                ..Default::default()
            };
            let capture = LinkCapture::start(links, options).map_err(anyhow::Error::msg)?;
            let out = std::fs::File::create(file)
                .with_context(|| format!("cannot create {}", file.display()))?;
            let stop = stop.clone();
            Some(std::thread::spawn(move || {
                write_capture(capture, out, &stop)
            }))
        }
    };
    std::thread::sleep(Duration::from_millis(300));
    let (p0, t0, c0) = (
        sink_packets(&engine),
        Instant::now(),
        cpu_seconds(libc::RUSAGE_SELF),
    );
    std::thread::sleep(Duration::from_secs_f64(a.seconds));
    let (p1, c1) = (sink_packets(&engine), cpu_seconds(libc::RUSAGE_SELF));
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    let (seen, dropped, captured, bytes) = match reader {
        Some(r) => r.join().expect("capture reader")?,
        None => (0, 0, 0, 0),
    };
    engine.stop();
    let packets = p1 - p0;
    Ok(Run {
        mpps: packets as f64 / wall / 1e6,
        seen,
        dropped,
        captured,
        bytes,
        cpu_ns_per_packet: (c1 - c0) * 1e9 / packets.max(1) as f64,
    })
}

/// The reader: moves records from the tap to the file until told to stop; returns the tap's
/// counters and the bytes written.
fn write_capture(
    mut capture: LinkCapture,
    mut out: std::fs::File,
    stop: &AtomicBool,
) -> Result<(u64, u64, u64, u64)> {
    let mut bytes = 0u64;
    let header = capture.header("bench");
    out.write_all(&header)?;
    bytes += header.len() as u64;
    let mut chunk = Vec::with_capacity(4 << 20);
    while !stop.load(Ordering::Acquire) {
        chunk.clear();
        capture.poll(&mut chunk, 4 << 20);
        if chunk.is_empty() {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        out.write_all(&chunk)?;
        bytes += chunk.len() as u64;
    }
    let s = capture.stats().remove(0);
    let end = capture.finish();
    out.write_all(&end)?;
    Ok((s.seen, s.dropped, s.captured, bytes + end.len() as u64))
}
