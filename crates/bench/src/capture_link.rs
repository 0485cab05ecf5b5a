//! `stitch bench capture-link`: the 8-forwarder chain at full rate with and without a live
//! capture of its middle link written as PCAPNG to tmpfs: what a tap costs the link it watches,
//! and how many packets it drops when its reader cannot keep up.
//!
//! One chain runs throughout; the tap is put on and taken off turn by turn, so that each turn's
//! ratio compares two windows a fraction of a second apart on a machine whose speed swings by
//! 1.5-2x from one second to the next (runs of a fresh chain each, seconds apart, gave ratios
//! from 0.54 to 0.96 for one build).

use crate::{load_average, measure_window, quartiles, start_chain, HugePageReserve, Sample};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use stitch_core::{pool, Engine, Registry};
use stitch_io::link_capture::{select_links, CaptureOptions, LinkCapture};

/// After the tap is put on or taken off, how long before a window starts: the reader thread
/// starts or ends, and the chain's caches settle.
const SETTLE: Duration = Duration::from_millis(100);
/// Before the first turn: the chain's pool and rings warm up.
const WARM_UP: Duration = Duration::from_millis(1000);

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
    /// Measured seconds of each window, untapped and tapped.
    #[arg(long, alias = "seconds", default_value_t = 0.5)]
    window: f64,
    /// Turns: an untapped and a tapped window each (their order alternates), medians reported.
    #[arg(long, alias = "runs", default_value_t = 20)]
    turns: usize,
}

/// One tapped window: the chain, and what the tap saw, dropped and wrote.
struct Tapped {
    /// The chain; its CPU is the whole process's (workers and reader).
    chain: Sample,
    seen: u64,
    dropped: u64,
    bytes: u64,
}

pub fn run(a: CaptureLinkArgs, registry: Registry) -> Result<()> {
    anyhow::ensure!(
        a.hops >= 2,
        "--hops must be at least 2 (the tap sits between two)"
    );
    anyhow::ensure!(a.turns >= 1, "--turns must be at least 1");
    anyhow::ensure!(
        a.window > 0.0 && a.window.is_finite(),
        "--window must be a positive number of seconds"
    );
    let registry = Arc::new(registry);
    let _hugepages = HugePageReserve::for_pool(pool::DEFAULT_PACKETS)?;
    let middle = a.hops / 2;
    let tapped = format!("f{middle}.output -> f{}.input", middle + 1);
    let file = a.dir.join(format!(
        "stitch-bench-capture-{}.pcapng",
        std::process::id()
    ));
    println!(
        "capture-link: {} forwarders, {}-byte packets, tap on `{tapped}` (snaplen {}{}) writing {}, {} turns of {} s per contender; load average {}",
        a.hops,
        a.size,
        a.snaplen,
        a.filter.as_deref().map(|f| format!(", filter `{f}`")).unwrap_or_default(),
        file.display(),
        a.turns,
        a.window,
        load_average()
    );
    println!(
        "{:>4}  {:>10} {:>10} {:>7} {:>11} {:>10} {:>10}",
        "turn", "plain Mpps", "tap Mpps", "ratio", "tap drops %", "MB/s", "tap ns/pkt"
    );
    let engine = start_chain(&registry, a.hops, a.size)?;
    std::thread::sleep(WARM_UP);
    let turns = take_turns(&engine, &a, &tapped, &file);
    engine.stop();
    let _ = std::fs::remove_file(&file);
    report(&turns?);
    Ok(())
}

/// The turns, each printed as it ends: the untapped window and the tapped one.
fn take_turns(
    engine: &Engine,
    a: &CaptureLinkArgs,
    tapped: &str,
    file: &Path,
) -> Result<Vec<(Sample, Tapped)>> {
    let mut turns = Vec::with_capacity(a.turns);
    for turn in 1..=a.turns {
        let (plain, tap) = if turn % 2 == 1 {
            let plain = measure_window(engine, SETTLE, a.window);
            (plain, window_tapped(engine, a, tapped, file)?)
        } else {
            let tap = window_tapped(engine, a, tapped, file)?;
            (measure_window(engine, SETTLE, a.window), tap)
        };
        let (p_mpps, t_mpps) = (plain.mpps(), tap.chain.mpps());
        println!(
            "{turn:>4}  {:>10.2} {:>10.2} {:>7.3} {:>11.2} {:>10.0} {:>10.2}",
            p_mpps,
            t_mpps,
            t_mpps / p_mpps,
            drop_percent(&tap),
            tap.bytes as f64 / 1e6 / (tap.chain.wall + SETTLE.as_secs_f64()),
            tap.chain.ns_per_packet() - plain.ns_per_packet()
        );
        turns.push((plain, tap));
    }
    Ok(turns)
}

fn drop_percent(t: &Tapped) -> f64 {
    100.0 * t.dropped as f64 / t.seen.max(1) as f64
}

/// Medians over the turns; the ratio's quartiles too.
fn report(turns: &[(Sample, Tapped)]) {
    let column = |f: &dyn Fn(&(Sample, Tapped)) -> f64| quartiles(turns.iter().map(f).collect());
    let plain = column(&|(p, _)| p.mpps());
    let tap = column(&|(_, t)| t.chain.mpps());
    let ratio = column(&|(p, t)| t.chain.mpps() / p.mpps());
    let drops = column(&|(_, t)| drop_percent(t));
    let extra = column(&|(p, t)| t.chain.ns_per_packet() - p.ns_per_packet());
    println!(
        " med  {:>10.2} {:>10.2} {:>7.3} {:>11.2} {:>10} {:>10.2}",
        plain.1, tap.1, ratio.1, drops.1, "", extra.1
    );
    println!(
        "ratio with the tap / without: median {:.3}, quartiles {:.3}..{:.3} over {} turns",
        ratio.1,
        ratio.0,
        ratio.2,
        turns.len()
    );
    println!(
        "(tap ns/pkt = extra CPU of the process, workers and reader, per packet through the chain)"
    );
}

/// A window with `link` captured to `file` (from before the settling to after the window).
fn window_tapped(engine: &Engine, a: &CaptureLinkArgs, link: &str, file: &Path) -> Result<Tapped> {
    let links = select_links(&engine.link_rings(), link).map_err(anyhow::Error::msg)?;
    let options = CaptureOptions {
        snaplen: a.snaplen,
        filter: a.filter.clone(),
        ..Default::default()
    };
    let capture = LinkCapture::start(links, options).map_err(anyhow::Error::msg)?;
    let out =
        std::fs::File::create(file).with_context(|| format!("cannot create {}", file.display()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || write_capture(capture, out, &stop))
    };
    let chain = measure_window(engine, SETTLE, a.window);
    stop.store(true, Ordering::Release);
    let (seen, dropped, bytes) = reader.join().expect("capture reader")?;
    Ok(Tapped {
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
