//! `stitch capture`: tcpdump's habits, Stitch's data path. On an interface (`-i`) it builds the
//! graph `af_packet (filter in the kernel) → capture (writer thread, rotation)` and runs it; on
//! the links of a running instance (`--link`) it asks that instance's API for a live capture
//! stream and writes it to a file or standard output.

use anyhow::{Context, Result};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Registry};
use stitch_io::capture_format::Format;
use stitch_io::link_capture::{CaptureOptions, EndReason};
use stitch_kernel::capture::KernelLinkCapture;

#[derive(clap::Args)]
pub struct CaptureArgs {
    /// Interface to capture on.
    #[arg(short = 'i', required_unless_present = "link", conflicts_with = "link")]
    interface: Option<String>,
    /// Links of a running instance to capture: APP (all its links), APP.PORT (both directions)
    /// or `APP.PORT -> APP.PORT`. The graph is not changed; the taps go when the capture ends.
    #[arg(long)]
    link: Option<String>,
    /// File to write (a strftime pattern with -G); with --link, `-` is standard output.
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
    /// With -i: this capture's instance name (for `stitch stats`; default `capture`). With
    /// --link: the running instance whose links are captured (default `stitch`).
    #[arg(long)]
    name: Option<String>,
    /// With --link: the instance's API socket (overrides --name).
    #[arg(long, requires = "link")]
    control: Option<PathBuf>,
    /// With --link: capture links of this kernel data plane (`stitch kernel apply --name`);
    /// the patch panel copies their packets into a ring buffer this command reads.
    #[arg(long, requires = "link", conflicts_with_all = ["control", "name"])]
    kernel: Option<String>,
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
    match (&a.interface, &a.link) {
        (Some(interface), None) => capture_interface(&a, interface, registry),
        (None, Some(link)) => match &a.kernel {
            Some(plane) => capture_kernel_link(&a, plane, link),
            None => capture_link(&a, link),
        },
        _ => anyhow::bail!("give either -i INTERFACE or --link APP[.PORT]"),
    }
}

fn capture_interface(a: &CaptureArgs, interface: &str, registry: Arc<Registry>) -> Result<()> {
    let filter = a.filter.join(" ");
    let graph = capture_graph(a, interface, &filter, &registry)?;

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let engine = Arc::new(Engine::new(registry));
    engine.apply(graph).map_err(|e| anyhow::anyhow!("{e}"))?;
    // The capture is an instance like any other: `stitch stats --name` and the API see it.
    let api = Arc::new(stitch_api::Api::new(engine.clone(), None));
    let config = stitch_api::ApiConfig {
        unix: stitch_api::socket_path(a.name.as_deref().unwrap_or("capture")),
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
        "stitch: capturing on {interface}{what} to {}",
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
    print_summary(&stats)
}

/// The capture's graph: an `af_packet` app on `interface` into a `capture` app, through the
/// same parser and checks as a graph file.
fn capture_graph(
    a: &CaptureArgs,
    interface: &str,
    filter: &str,
    registry: &Registry,
) -> Result<Graph> {
    let mut src = json!({
        "type": "af_packet",
        "interface": interface,
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
        "interface": interface,
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
    let graph = Graph::parse(&text, "<capture>", Path::new("."), registry)
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    Ok(graph)
}

/// tcpdump's closing lines; an error when writing failed.
fn print_summary(stats: &stitch_core::Stats) -> Result<()> {
    let received = stats.links.first().map(|l| l.stats.tx_packets).unwrap_or(0);
    eprintln!("{} packets captured", counter(stats, "cap", "captured"));
    eprintln!("{received} packets received by filter");
    eprintln!(
        "{} packets dropped by kernel",
        counter(stats, "src", "kernel_drops")
    );
    eprintln!(
        "{} packets dropped by stitch (writer queue or disk)",
        counter(stats, "cap", "writer_drops")
    );
    eprintln!(
        "{} bytes written to {} file(s)",
        counter(stats, "cap", "bytes_written"),
        counter(stats, "cap", "files")
    );
    if counter(stats, "cap", "write_errors") > 0 {
        anyhow::bail!("writing failed (see the error above); the files hold every packet up to it");
    }
    Ok(())
}

/// `stitch capture --link`: streams a live capture of links of a running instance from its
/// API to a file or standard output; Ctrl-C ends it cleanly (the stream closes with its
/// statistics), and so do -c and --duration, on the instance's side.
fn capture_link(a: &CaptureArgs, link: &str) -> Result<()> {
    refuse_interface_options(a)?;
    let to_stdout = a.file.as_os_str() == "-";
    let format = link_format(a, to_stdout);
    let filter = a.filter.join(" ");
    let request = stitch_api::client::CaptureRequest {
        format: Some(
            match format {
                Format::Pcap => "pcap",
                Format::Pcapng => "pcapng",
            }
            .to_string(),
        ),
        snaplen: Some(a.snaplen),
        count: a.count,
        duration: a.duration,
        filter: Some(filter.clone()),
    };
    let socket = a
        .control
        .clone()
        .unwrap_or_else(|| stitch_api::socket_path(a.name.as_deref().unwrap_or("stitch")));

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let mut out = open_output(&a.file, to_stdout)?;
    let announce = || announce_link(a, link, &filter, to_stdout);
    // On a pipe (tshark, Wireshark) packets are passed on as they come.
    let tally = stitch_api::client::capture_link(
        &socket, link, &request, &stop, &mut out, to_stdout, announce,
    )?;
    eprintln!("{} packets captured", tally.packets);
    eprintln!(
        "{} packets carried by the link(s) while tapped",
        tally.received
    );
    eprintln!(
        "{} packets dropped by the tap (the reader fell behind)",
        tally.dropped
    );
    Ok(())
}

fn refuse_interface_options(a: &CaptureArgs) -> Result<()> {
    for (given, flag) in [
        (a.rotate_mb.is_some(), "-C"),
        (a.rotate_seconds.is_some(), "-G"),
        (a.files.is_some(), "-W"),
        (a.no_promisc, "-p"),
    ] {
        if given {
            anyhow::bail!(
                "{flag} is for interface captures (-i); a link capture writes one file or a stream"
            );
        }
    }
    Ok(())
}

/// The format of a link capture: `--format`, else PCAP for a `.pcap` file, else PCAPNG.
fn link_format(a: &CaptureArgs, to_stdout: bool) -> Format {
    match a.format.as_deref() {
        Some("pcap") => Format::Pcap,
        Some(_) => Format::Pcapng,
        None if !to_stdout
            && a.file
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("pcap")) =>
        {
            Format::Pcap
        }
        None => Format::Pcapng,
    }
}

fn open_output(file: &Path, to_stdout: bool) -> Result<Box<dyn std::io::Write>> {
    Ok(if to_stdout {
        Box::new(std::io::stdout().lock())
    } else {
        let f = stitch_core::files::create_output(file, 0o600, 0)
            .with_context(|| format!("cannot create {}", file.display()))?;
        Box::new(std::io::BufWriter::with_capacity(1 << 20, f))
    })
}

fn announce_link(a: &CaptureArgs, link: &str, filter: &str, to_stdout: bool) {
    let what = if filter.trim().is_empty() {
        String::new()
    } else {
        format!(", filter `{filter}`")
    };
    let to = if to_stdout {
        "standard output".to_string()
    } else {
        a.file.display().to_string()
    };
    eprintln!("stitch: capturing link {link}{what} to {to}");
}

/// `stitch capture --link --kernel`: the same stream as a running instance's, read from the
/// kernel data plane's tap ring by this process. Ctrl-C, -c, --duration, the link leaving the
/// installed graph or the reader of standard output going away end it; the taps go with it.
fn capture_kernel_link(a: &CaptureArgs, plane: &str, link: &str) -> Result<()> {
    refuse_interface_options(a)?;
    let to_stdout = a.file.as_os_str() == "-";
    let filter = a.filter.join(" ");
    let options = CaptureOptions {
        format: link_format(a, to_stdout),
        snaplen: a.snaplen,
        filter: Some(filter.clone()),
        count: a.count,
        duration: a.duration.map(Duration::from_secs_f64),
        ..CaptureOptions::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let capture = KernelLinkCapture::start(plane, link, options)?;
    let mut out = open_output(&a.file, to_stdout)?;
    announce_link(a, link, &filter, to_stdout);
    let summary = capture.stream(&mut out, &stop, to_stdout)?;
    if summary.end == Some(EndReason::LinksGone) {
        eprintln!("stitch: the tapped link(s) left the installed graph");
    }
    let stats = summary.stats;
    let sum = |f: fn(&stitch_io::link_capture::TapStats) -> u64| stats.iter().map(f).sum::<u64>();
    eprintln!("{} packets captured", sum(|s| s.captured));
    eprintln!(
        "{} packets carried by the link(s) while tapped",
        sum(|s| s.seen)
    );
    eprintln!(
        "{} packets dropped by the tap (the reader fell behind)",
        sum(|s| s.dropped)
    );
    Ok(())
}
