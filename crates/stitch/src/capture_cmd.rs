//! `stitch capture`: tcpdump's habits, Stitch's data path. Builds the graph
//! `af_packet (filter in the kernel) → capture (writer thread, rotation)` and runs it.

use anyhow::{Context, Result};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Registry};

#[derive(clap::Args)]
pub struct CaptureArgs {
    /// Interface to capture on.
    #[arg(short = 'i')]
    interface: String,
    /// File to write (a strftime pattern with -G).
    #[arg(short = 'w')]
    file: PathBuf,
    /// Bytes kept of each packet.
    #[arg(short = 's', default_value_t = 262144)]
    snaplen: u32,
    /// Stop after this many packets.
    #[arg(short = 'c')]
    count: Option<u64>,
    /// New file when the current one would exceed this many MB (10^6 bytes).
    #[arg(short = 'C')]
    rotate_mb: Option<u64>,
    /// New file every this many seconds.
    #[arg(short = 'G')]
    rotate_seconds: Option<u64>,
    /// Keep at most this many files, reusing their names in a ring.
    #[arg(short = 'W')]
    files: Option<u32>,
    /// Kernel receive ring in MiB.
    #[arg(short = 'B', default_value_t = 64)]
    ring_mb: usize,
    /// Do not put the interface into promiscuous mode.
    #[arg(short = 'p')]
    no_promisc: bool,
    /// File format (default: from the file name; `.pcapng` → pcapng).
    #[arg(long, value_parser = ["pcap", "pcapng"])]
    format: Option<String>,
    /// Stop after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Instance name for `stitch stats` (control socket).
    #[arg(long, default_value = "capture")]
    name: String,
    /// Filter expression in libpcap syntax.
    filter: Vec<String>,
}

fn counter(stats: &stitch_core::Stats, app: &str, name: &str) -> u64 {
    stats
        .apps
        .iter()
        .find(|a| a.name == app)
        .and_then(|a| a.counters.get(name).copied())
        .unwrap_or(0)
}

pub fn run(a: CaptureArgs, registry: Arc<Registry>) -> Result<()> {
    let filter = a.filter.join(" ");
    let mut src = json!({
        "type": "af_packet",
        "interface": a.interface,
        "promisc": !a.no_promisc,
        "ignore_outgoing": false,
        "blocks": a.ring_mb.max(1),
    });
    if !filter.trim().is_empty() {
        src["filter"] = json!(filter);
    }
    let mut cap = json!({
        "type": "capture",
        "file": std::path::absolute(&a.file).context("output file name")?,
        "snaplen": a.snaplen,
        "interface": a.interface,
    });
    for (k, v) in [
        ("count", a.count.map(|v| json!(v))),
        ("rotate_mb", a.rotate_mb.map(|v| json!(v))),
        ("rotate_seconds", a.rotate_seconds.map(|v| json!(v))),
        ("files", a.files.map(|v| json!(v))),
        ("format", a.format.as_ref().map(|v| json!(v))),
    ] {
        if let Some(v) = v {
            cap[k] = v;
        }
    }
    // JSON is YAML: the graph goes through the same parser and checks as a file would.
    let text = serde_json::to_string_pretty(&json!({
        "apps": { "src": src, "cap": cap },
        "links": ["src.output -> cap.input"],
    }))?;
    let graph = Graph::parse(&text, "<capture>", Path::new("."), &registry)
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let engine = Arc::new(Engine::new(registry));
    engine.apply(graph).map_err(|e| anyhow::anyhow!("{e}"))?;
    // The capture is an instance like any other: `stitch stats --name` and the API see it.
    let api = Arc::new(stitch_api::Api::new(engine.clone(), None));
    let config = stitch_api::ApiConfig {
        unix: stitch_api::socket_path(&a.name),
        ..Default::default()
    };
    let server = stitch_api::Server::start(api, &config)
        .inspect_err(|e| log::warn!("{e:#}; capturing without the API"))
        .ok();
    let what = if filter.trim().is_empty() {
        String::new()
    } else {
        format!(", filter `{filter}`")
    };
    eprintln!(
        "stitch: capturing on {}{what} to {}",
        a.interface,
        a.file.display()
    );

    let tty = std::io::stderr().is_terminal();
    let started = Instant::now();
    let (mut last, mut last_n) = (Instant::now(), 0u64);
    loop {
        std::thread::sleep(Duration::from_millis(50));
        if stop.load(Ordering::Relaxed)
            || a.duration
                .is_some_and(|d| started.elapsed().as_secs_f64() >= d)
        {
            break;
        }
        let stats = engine.stats();
        let n = counter(&stats, "cap", "captured");
        if a.count.is_some_and(|c| n >= c) {
            break;
        }
        if tty && last.elapsed() >= Duration::from_secs(1) {
            let rate = (n - last_n) as f64 / last.elapsed().as_secs_f64();
            let drops =
                counter(&stats, "src", "kernel_drops") + counter(&stats, "cap", "writer_drops");
            let mb = counter(&stats, "cap", "bytes_written") as f64 / 1e6;
            eprint!("\r{n} packets captured, {rate:.0} packets/s, {drops} dropped, {mb:.1} MB written   ");
            (last, last_n) = (Instant::now(), n);
        }
    }
    let stats = engine.stop();
    drop(server);
    if tty {
        eprintln!();
    }
    let received = stats.links.first().map(|l| l.stats.tx_packets).unwrap_or(0);
    eprintln!("{} packets captured", counter(&stats, "cap", "captured"));
    eprintln!("{received} packets received by filter");
    eprintln!(
        "{} packets dropped by kernel",
        counter(&stats, "src", "kernel_drops")
    );
    eprintln!(
        "{} packets dropped by stitch (writer queue or disk)",
        counter(&stats, "cap", "writer_drops")
    );
    eprintln!(
        "{} bytes written to {} file(s)",
        counter(&stats, "cap", "bytes_written"),
        counter(&stats, "cap", "files")
    );
    if counter(&stats, "cap", "write_errors") > 0 {
        anyhow::bail!("writing failed (see the error above); the files hold every packet up to it");
    }
    Ok(())
}
