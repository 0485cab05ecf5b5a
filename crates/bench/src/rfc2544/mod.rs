//! `stitch bench rfc2544`: throughput without loss and latency, measured the way RFC 2544 and
//! VSPERF (RFC 8204) compare data planes. A tester outside the device under test — a
//! virtio-net driver of Stitch's own on two vhost-user ports ([`stitch_vhost::frontend`]), on
//! CPU 0 — sends numbered, stamped frames into port `a` and takes them from port `b`; the
//! devices under test take turns on the same two sockets, on CPU 1: Stitch's forwarder, testpmd's
//! io forwarding (the floor: what the vhost-user copies alone cost) or a graph of the user's.
//!
//! For each frame size: the no-drop rate (NDR, loss ≤ 0.001 %) and the partial-drop rate (PDR,
//! ≤ 0.1 %) by binary search over trials of fixed length ([`search`]); then latency (min,
//! p50, p99, p99.9, max) and jitter at 10, 50 and 90 % of the NDR. Unidirectional: frames
//! flow a → b. Figures are comparable only within one run of one machine.

pub(crate) mod duts;
mod plot;
pub mod search;
pub mod tester;

use anyhow::Result;
use duts::{Dut, Setup};
use search::{highest_rate, Bounds, Found, Outcome};
use std::path::PathBuf;
use std::time::Duration;
use stitch_core::latency::LatencyReport;
use stitch_vhost::frontend::Frontend;
use tester::{trial, FrameSize, Frames, TrialResult};

/// Loss allowed at the no-drop rate: 0.001 %, one frame in 100 000 (RFC 2544's throughput
/// allows none; a trial of a million frames on a shared machine rarely loses none anywhere).
const NDR_LOSS: f64 = 0.00001;
/// Loss allowed at the partial-drop rate.
const PDR_LOSS: f64 = 0.001;
/// The fractions of the NDR at which latency is measured.
const LATENCY_AT: [f64; 3] = [0.1, 0.5, 0.9];

#[derive(clap::Args)]
pub struct Rfc2544Args {
    /// Devices under test, in turn: `stitch` (a forwarder between the two ports), `switch`
    /// (Stitch's OpenFlow switch with --flows), `fw-nat` (Stitch's stateful firewall and
    /// NAT), `testpmd` (io forwarding), `ovs` (Open vSwitch's DPDK datapath with --flows),
    /// `graph` (the graph of --graph).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "stitch,switch,fw-nat,testpmd,ovs"
    )]
    pub duts: Vec<String>,
    /// The switches' flow table (`ovs-ofctl add-flows` syntax; ports 1 and 2 are `a` and
    /// `b`); by default port 1 to port 2 and back.
    #[arg(long)]
    pub flows: Option<PathBuf>,
    /// A Stitch graph to measure (with `--duts graph`): its apps `a` and `b` must be
    /// `vhost_user` ports; the benchmark sets their sockets (and pins its main worker to CPU 1
    /// unless it has `workers:`). Frames go in at `a`, out at `b`.
    #[arg(long)]
    pub graph: Option<PathBuf>,
    /// Frame sizes in bytes with the FCS (64..=1518), or `imix` (64, 570, 1518 as 7 : 4 : 1).
    #[arg(long, value_delimiter = ',', default_value = "64,256,1518,imix")]
    pub sizes: Vec<FrameSize>,
    /// Seconds per trial.
    #[arg(long, default_value_t = 1.0)]
    pub trial_seconds: f64,
    /// The highest rate tried, frames per second (default: as fast as the tester sends).
    #[arg(long)]
    pub max_rate: Option<f64>,
    /// Trials at most per rate: the majority decides, so that one trial losing frames to a
    /// stall of the shared host does not fail a rate the device forwards (1: RFC 2544's
    /// single trial).
    #[arg(long, default_value_t = 3)]
    pub trials_per_rate: usize,
    /// The search stops when it has the rate to within this share of the highest rate, %.
    #[arg(long, default_value_t = 1.0)]
    pub resolution: f64,
    /// A folder for the results: `rfc2544.json` and its plot, `rfc2544.png`.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Latency at one offered rate.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyAt {
    pub fraction_of_ndr: f64,
    pub rate_pps: f64,
    pub loss_ratio: f64,
    #[serde(flatten)]
    pub latency: LatencyReport,
    pub jitter_ns: f64,
}

/// The results of one device at one frame size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizeResult {
    pub dut: String,
    pub size: String,
    pub mean_frame_bytes: f64,
    pub ndr: Found,
    pub pdr: Found,
    pub latency: Vec<LatencyAt>,
}

impl SizeResult {
    /// Gbit/s on the wire at `pps` (frames with FCS, plus preamble and gap: 20 bytes each).
    fn gbps(&self, pps: f64) -> f64 {
        pps * (self.mean_frame_bytes + 20.0) * 8.0 / 1e9
    }
}

/// Runs the searches and latency trials of one device at one size.
fn measure(
    dut: &str,
    ports: &mut (Frontend, Frontend),
    size: FrameSize,
    args: &Rfc2544Args,
    tag: &mut u16,
) -> Result<SizeResult> {
    let frames = Frames::new(size);
    let (tx, rx) = ports;
    let mut run = |rate: Option<f64>, latency: bool| -> TrialResult {
        *tag = tag.wrapping_add(1);
        let r = trial(tx, rx, &frames, rate, args.trial_seconds, *tag, latency);
        log::debug!(
            "{dut} {size} at {rate:?}/s: offered {} (over the full input ring {}, the tester behind {}), received {}, reordered {}, stale {}",
            r.sent, r.input_overflow, r.tester_behind, r.received, r.reordered, r.stale
        );
        // Frames still inside the device go out before the next trial starts.
        std::thread::sleep(Duration::from_millis(20));
        r
    };
    let max = match args.max_rate {
        Some(r) => r,
        None => run(None, false).offered_pps(),
    };
    let bounds = |loss_ratio, passes_at_pps| Bounds {
        max_pps: max,
        resolution_pps: max * args.resolution / 100.0,
        loss_ratio,
        passes_at_pps,
        trials_per_rate: args.trials_per_rate,
    };
    let mut search = |loss, floor| {
        highest_rate(bounds(loss, floor), |rate| {
            let r = run(Some(rate), false);
            Ok(Outcome {
                offered_pps: r.offered_pps(),
                loss_ratio: r.loss_ratio(),
            })
        })
    };
    let ndr = search(NDR_LOSS, 0.0)?;
    // What loses nothing loses less than the partial drop allows.
    let pdr = search(PDR_LOSS, ndr.rate_pps)?;
    let mut latency = Vec::new();
    for fraction in LATENCY_AT.iter().filter(|_| ndr.rate_pps > 0.0) {
        let rate = ndr.rate_pps * fraction;
        let r = run(Some(rate), true);
        latency.push(LatencyAt {
            fraction_of_ndr: *fraction,
            rate_pps: rate,
            loss_ratio: r.loss_ratio(),
            latency: r.latency.map(|l| l.report()).unwrap_or_default(),
            jitter_ns: r.jitter_ns,
        });
    }
    Ok(SizeResult {
        dut: dut.to_string(),
        size: size.to_string(),
        mean_frame_bytes: size.mean_bytes(),
        ndr,
        pdr,
        latency,
    })
}

pub fn run(args: Rfc2544Args) -> Result<()> {
    anyhow::ensure!(args.trial_seconds > 0.0, "--trial-seconds must be positive");
    anyhow::ensure!(
        args.resolution > 0.0 && args.resolution < 50.0,
        "--resolution is a percentage of the highest rate, above 0 and below 50"
    );
    anyhow::ensure!(!args.sizes.is_empty(), "--sizes names no frame size");
    stitch_core::pin_to_core(0);
    let load = crate::load_average();
    if !args.json {
        println!(
            "bench rfc2544: {} at {} B, trials of {} s, resolution {} % of the highest rate; \
             tester on CPU 0, device on CPU 1; load average {load}",
            args.duts.join(", "),
            args.sizes
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join("/"),
            args.trial_seconds,
            args.resolution
        );
    }
    let flows = duts::flows(args.flows.as_ref())?;
    let setup = Setup {
        graph: args.graph.as_deref(),
        flows: &flows,
    };
    let mut results = Vec::new();
    let mut tag = 0u16;
    for (i, kind) in args.duts.iter().enumerate() {
        let dut = Dut::start(kind, &setup, i)?;
        let mut ports = dut.connect()?;
        for &size in &args.sizes {
            let r = measure(kind, &mut ports, size, &args, &mut tag)?;
            if !args.json {
                println!("{}", row(&r));
            }
            results.push(r);
        }
    }
    let doc = serde_json::json!({
        "load_average": load,
        "trial_seconds": args.trial_seconds,
        "resolution_percent": args.resolution,
        "trials_per_rate": args.trials_per_rate,
        "ndr_loss": NDR_LOSS,
        "pdr_loss": PDR_LOSS,
        "results": results,
    });
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)?;
        let file = dir.join("rfc2544.json");
        std::fs::write(&file, serde_json::to_string_pretty(&doc)?)?;
        let picture = dir.join("rfc2544.png");
        plot::draw(&results, &picture)?;
        if !args.json {
            println!("results in {} and {}", file.display(), picture.display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

/// One line of the table: a device at a size.
fn row(r: &SizeResult) -> String {
    let us = |ns: u64| ns as f64 / 1e3;
    let mut line = format!(
        "{:<8} {:>5} B  NDR {:>7.3} Mpps ({:>6.2} Gbit/s{})  PDR {:>7.3} Mpps",
        r.dut,
        r.size,
        r.ndr.rate_pps / 1e6,
        r.gbps(r.ndr.rate_pps),
        if r.ndr.tester_limited {
            ", tester-bound"
        } else {
            ""
        },
        r.pdr.rate_pps / 1e6,
    );
    for l in &r.latency {
        line += &format!(
            "\n    at {:>3.0} % of NDR: latency min {:.1} p50 {:.1} p99 {:.1} p99.9 {:.1} max {:.1} µs, jitter {:.2} µs",
            l.fraction_of_ndr * 100.0,
            us(l.latency.summary.min_ns),
            us(l.latency.summary.p50_ns),
            us(l.latency.summary.p99_ns),
            us(l.latency.summary.p999_ns),
            us(l.latency.summary.max_ns),
            l.jitter_ns / 1e3
        );
    }
    line
}
