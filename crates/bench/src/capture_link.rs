//! `stitch bench capture-link`: the 8-forwarder chain at full rate with and without a live
//! capture of its middle link written as PCAPNG to tmpfs, alternated run by run: what a tap
//! costs the link it watches, and how many packets it drops when its reader cannot keep up.

use crate::{load_average, measure_window, median, start_chain, HugePageReserve, Sample};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use stitch_core::{pool, Registry};
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
    /// The chain; its CPU is the whole process's (workers and reader).
    chain: Sample,
    /// Packets the tap saw and dropped, and bytes written.
    seen: u64,
    dropped: u64,
    bytes: u64,
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
        let (p_mpps, t_mpps) = (p.chain.mpps(), t.chain.mpps());
        let extra = t.chain.ns_per_packet() - p.chain.ns_per_packet();
        println!(
            "{run:>3}  {:>10.2} {:>10.2} {:>7.3} {:>11.2} {:>10.1} {:>9.0} {:>10.2}",
            p_mpps,
            t_mpps,
            t_mpps / p_mpps,
            drops,
            mb,
            mb / a.seconds,
            extra
        );
        plain.push(p_mpps);
        tap.push(t_mpps);
        ratio.push(t_mpps / p_mpps);
        drop_pct.push(drops);
        extra_ns.push(extra);
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
    let engine = start_chain(registry, a.hops, a.size)?;
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
    let chain = measure_window(&engine, a.seconds);
    stop.store(true, Ordering::Release);
    let (seen, dropped, bytes) = match reader {
        Some(r) => r.join().expect("capture reader")?,
        None => (0, 0, 0),
    };
    engine.stop();
    Ok(Run {
        chain,
        seen,
        dropped,
        bytes,
    })
}

/// The reader: moves records from the tap to the file until told to stop; returns the packets
/// the tap saw and dropped, and the bytes written.
fn write_capture(
    mut capture: LinkCapture,
    mut out: std::fs::File,
    stop: &AtomicBool,
) -> Result<(u64, u64, u64)> {
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
    Ok((s.seen, s.dropped, bytes + end.len() as u64))
}
