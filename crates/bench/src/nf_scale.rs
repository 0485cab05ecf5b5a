//! `stitch bench nf-scale`: the experiment of fine-grained NFs (docs/references.md). N function
//! processes (the `signature` function); every packet goes through two of them — function i, then
//! function i+1 — and consecutive packets go to different functions (round robin). Reports the
//! throughput and latency (mean, p99) at full offered load, and the latency at the highest of 1/2,
//! 1/4, 1/8, 1/16 of that load which the functions keep up with, for polling, blocking and isolated
//! (blocking, copying) ports.

use crate::cpu_seconds;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::app::{AppContext, AppError, Io, PortNames, PortSpec};
use stitch_core::{App, AppType, Engine, Graph, Registry};

/// Latencies in 1 µs buckets up to 1 s (the last bucket takes the rest).
const BUCKETS: usize = 1_000_000;

static LATENCIES: Mutex<Option<Vec<u64>>> = Mutex::new(None);

/// A sink that records each packet's time since its generator stamped it.
struct LatencySink {
    hist: Vec<u64>,
}

impl App for LatencySink {
    type Config = serde_json::Value;
    fn declare(_: &serde_json::Value) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::Any,
            outputs: PortNames::none(),
        })
    }
    fn new(_: serde_json::Value, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(LatencySink {
            hist: vec![0; BUCKETS],
        })
    }
    fn push(&mut self, io: &mut Io) {
        let now = stitch_core::packet::now_ns();
        let (inputs, _) = io.split();
        for input in inputs.iter_mut().flatten() {
            for p in input.drain() {
                let us = now.saturating_sub(p.timestamp_ns()) / 1000;
                self.hist[(us as usize).min(BUCKETS - 1)] += 1;
            }
        }
    }
    fn stop(&mut self) {
        let mut g = LATENCIES.lock().unwrap();
        let all = g.get_or_insert_with(|| vec![0; BUCKETS]);
        for (a, b) in all.iter_mut().zip(&self.hist) {
            *a += b;
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleMode {
    Polling,
    Blocking,
    Isolated,
}

#[derive(clap::Args)]
pub struct NfScaleArgs {
    /// Function processes (comma-separated list for several points).
    #[arg(long, default_value = "1,10,100")]
    pub nfs: String,
    #[arg(long, value_enum, default_value_t = ScaleMode::Blocking)]
    pub mode: ScaleMode,
    /// Frame size in bytes.
    #[arg(long, default_value_t = 700)]
    pub size: usize,
    /// Measured seconds per phase.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Blocking modes: wake a function when this many packets wait...
    #[arg(long, default_value_t = 1)]
    pub batch: u32,
    /// ...or when the oldest has waited this long.
    #[arg(long, default_value_t = 50)]
    pub max_delay_us: u64,
    /// Let the engine sleep when idle instead of polling without pause (which keeps one core).
    #[arg(long)]
    pub engine_sleeps: bool,
    /// Packets in the pool: what is in flight (rate × latency) must fit, so long aging
    /// timeouts at high rates need more than the default.
    #[arg(long, default_value_t = stitch_core::pool::DEFAULT_PACKETS)]
    pub pool_packets: usize,
    /// Put the pool on 2 MiB hugepages (reserved for the run, given back after). Every
    /// function maps the whole pool: on 4 KiB pages thousands of them spend their time in
    /// page faults and page tables.
    #[arg(long)]
    pub hugepages: bool,
    /// Fine-grained NFs' figure 3(c) instead: traffic from an `af_xdp` interface on a veth, each
    /// function the head of its own chain, with the interface steering each function's flow
    /// straight to it and without (the engine deals every frame out), at `--steer-mpps`.
    #[arg(long)]
    pub steer: bool,
    /// `--steer`: the offered load, Mpps (the same for both paths).
    #[arg(long, default_value_t = 0.1)]
    pub steer_mpps: f64,
}

struct Point {
    /// Delivered to the sink.
    mpps: f64,
    /// Sent by the generator.
    offered_mpps: f64,
    gbps: f64,
    cpu_per_mpps: f64,
    mean_us: f64,
    p99_us: f64,
    /// Every drop on the way: full links and rings, an exhausted pool.
    drops: u64,
}

/// Counters read at the start and end of a phase.
struct Snapshot {
    generated: u64,
    delivered: u64,
    drops: u64,
}

impl Snapshot {
    fn of(e: &Engine) -> Snapshot {
        let stats = e.stats();
        let app = |name: &str| stats.apps.iter().find(|a| a.name == name);
        Snapshot {
            generated: app("gen").map_or(0, |a| a.tx_packets),
            delivered: app("out").map_or(0, |a| a.rx_packets),
            drops: stats
                .apps
                .iter()
                .map(|a| a.drops + a.counters.get("pool_exhausted_drops").copied().unwrap_or(0))
                .sum(),
        }
    }
}

pub(crate) fn signature_binary() -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let p = me.with_file_name("stitch-nf-signature");
    anyhow::ensure!(
        p.exists(),
        "{} is missing: build it with `cargo build --release -p stitch-nf`",
        p.display()
    );
    Ok(p)
}

fn graph(n: usize, args: &NfScaleArgs, socket: &Path, rate: Option<f64>) -> String {
    let (mode, wake) = match args.mode {
        ScaleMode::Polling => ("zero_copy", "polling"),
        ScaleMode::Blocking => ("zero_copy", "blocking"),
        ScaleMode::Isolated => ("isolated", "blocking"),
    };
    let rate = rate.map(|r| format!(", rate: {r:.0}")).unwrap_or_default();
    let mut s = format!(
        "engine: {{ busy_poll: {}, link_size: 4096, pool_packets: {} }}\napps:\n  gen: {{ type: generator, size: {}, timestamps: true, flows: 64{rate} }}\n  rr: {{ type: round_robin }}\n  j: {{ type: join }}\n  out: {{ type: latency_sink }}\n",
        !args.engine_sleeps,
        args.pool_packets,
        args.size
    );
    let port = |name: String| {
        format!(
            "  {name}: {{ type: nf_port, socket: {}, mode: {mode}, wake: {wake}, batch: {}, max_delay_us: {}, ring_size: 1024 }}\n",
            socket.display(),
            args.batch,
            args.max_delay_us
        )
    };
    let mut links =
        String::from("links:\n  - \"gen.output -> rr.input\"\n  - \"j.output -> out.input\"\n");
    for i in 0..n {
        s += &port(format!("a{i}"));
        s += &port(format!("b{i}"));
        links += &format!(
            "  - \"rr.o{i} -> a{i}.input\"\n  - \"a{i}.output -> b{}.input\"\n  - \"b{i}.output -> j.i{i}\"\n",
            (i + 1) % n
        );
    }
    s + &links
}

pub(crate) fn counter_sum(e: &Engine, name: &str) -> u64 {
    e.stats()
        .apps
        .iter()
        .filter_map(|a| a.counters.get(name))
        .sum()
}

/// An engine running a graph whose `nf_port`s are served by `stitch-nf-signature` processes
/// (one per list of ports), started without the generator's link so that every function has
/// attached before traffic flows. The processes are killed when it is dropped.
pub(crate) struct WithFunctions {
    pub engine: Engine,
    graph: Graph,
    children: Vec<Child>,
}

impl WithFunctions {
    pub(crate) fn start(
        registry: &Arc<Registry>,
        text: &str,
        what: &str,
        socket: &Path,
        ports: Vec<Vec<String>>,
        attach_within: Duration,
    ) -> Result<WithFunctions> {
        let graph = Graph::parse(text, what, Path::new("."), registry)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let engine = Engine::new(registry.clone());
        let mut idle = graph.clone();
        idle.links.retain(|l| l.from.app != "gen");
        engine.apply(idle)?;
        let bin = signature_binary()?;
        let total: usize = ports.iter().map(Vec::len).sum();
        let mut run = WithFunctions {
            engine,
            graph,
            children: Vec::with_capacity(ports.len()),
        };
        for names in ports {
            run.children.push(
                Command::new(&bin)
                    .arg("--socket")
                    .arg(socket)
                    .args(names)
                    .spawn()
                    .context("cannot start a function")?,
            );
        }
        let t = Instant::now();
        while counter_sum(&run.engine, "attached") < total as u64 {
            anyhow::ensure!(
                t.elapsed() < attach_within,
                "only {} of {total} function ports attached",
                counter_sum(&run.engine, "attached")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(run)
    }

    /// Links the generator in (latency records start afresh) and lets traffic settle.
    pub(crate) fn go(&self) -> Result<()> {
        reset_latencies();
        self.engine.apply(self.graph.clone())?;
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    }

    /// CPU seconds used so far by this process (the engine) and the functions.
    pub(crate) fn cpu(&self) -> f64 {
        let (engine, functions) = self.cpu_split();
        engine + functions
    }

    /// CPU seconds so far of this process (the engine) and of the functions, apart.
    pub(crate) fn cpu_split(&self) -> (f64, f64) {
        (cpu_seconds(libc::RUSAGE_SELF), children_cpu(&self.children))
    }

    /// Stops the engine (the latency sinks hand in their records) and the functions.
    pub(crate) fn stop(self) {
        self.engine.stop();
    }
}

impl Drop for WithFunctions {
    fn drop(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Process CPU time of the functions, from /proc (they are still running).
pub(crate) fn children_cpu(children: &[Child]) -> f64 {
    (children.iter())
        .filter_map(|c| crate::process_cpu_seconds(c.id()))
        .sum()
}

/// One phase: run at `rate` (None: as fast as the generator goes) and measure.
fn phase(
    registry: &Arc<Registry>,
    n: usize,
    args: &NfScaleArgs,
    rate: Option<f64>,
) -> Result<Point> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("nf.sock");
    let text = graph(n, args, &socket, rate);
    let ports = (0..n).map(|i| vec![format!("a{i}"), format!("b{i}")]);
    let run = WithFunctions::start(
        registry,
        &text,
        "<nf-scale>",
        &socket,
        ports.collect(),
        Duration::from_secs(60),
    )?;
    run.go()?;
    let engine = &run.engine;
    let (s0, t0, c0) = (Snapshot::of(engine), Instant::now(), run.cpu());
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let (s1, c1) = (Snapshot::of(engine), run.cpu());
    let wall = t0.elapsed().as_secs_f64();
    run.stop();
    let (mean, p99) = take_latencies();
    let pps = (s1.delivered - s0.delivered) as f64 / wall;
    Ok(Point {
        mpps: pps / 1e6,
        offered_mpps: (s1.generated - s0.generated) as f64 / wall / 1e6,
        gbps: pps * args.size as f64 * 8.0 / 1e9,
        cpu_per_mpps: (c1 - c0) / wall / (pps / 1e6).max(1e-9),
        mean_us: mean,
        p99_us: p99,
        drops: s1.drops - s0.drops,
    })
}

/// Forgets what the latency sinks recorded so far.
pub(crate) fn reset_latencies() {
    *LATENCIES.lock().unwrap() = None;
}

/// Mean and 99th percentile (µs) of what the latency sinks recorded since the last call.
pub(crate) fn take_latencies() -> (f64, f64) {
    let hist = LATENCIES.lock().unwrap().take().unwrap_or_default();
    let total: u64 = hist.iter().sum();
    let mean = hist
        .iter()
        .enumerate()
        .map(|(us, c)| us as f64 * *c as f64)
        .sum::<f64>()
        / total.max(1) as f64;
    let mut acc = 0;
    let p99 = hist
        .iter()
        .position(|c| {
            acc += c;
            acc * 100 >= total * 99
        })
        .unwrap_or(0);
    (mean, p99 as f64)
}

/// Adds `latency_sink` (records each packet's age since its generator stamped it).
pub(crate) fn register_latency_sink(r: &mut Registry) {
    r.register(AppType::of::<LatencySink>(
        "latency_sink",
        "records packet latency",
    ));
}

/// The function counts of `--nfs` (comma-separated); `example` shows a good value in the error.
pub(crate) fn function_counts(list: &str, example: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("--nfs takes numbers, e.g. {example}"))
}

pub fn run(args: NfScaleArgs, mut r: Registry) -> Result<()> {
    register_latency_sink(&mut r);
    let registry = Arc::new(r);
    let points = function_counts(&args.nfs, "1,10,100")?;
    let _hugepages = args
        .hugepages
        .then(|| crate::HugePageReserve::for_pool(args.pool_packets))
        .transpose()?;
    println!(
        "nf-scale: {:?} ports, {} B frames, each packet through 2 of N signature functions (round robin); {} s per phase",
        args.mode, args.size, args.seconds
    );
    println!(
        "{:>6} {:>9} {:>8} {:>9} {:>11} {:>9} {:>9} | {:>9} {:>9} {:>10} {:>10}",
        "N",
        "max Mpps",
        "Gbit/s",
        "drops",
        "CPU s/Mpkt",
        "mean µs",
        "p99 µs",
        "offered",
        "kept Mpps",
        "mean µs",
        "p99 µs"
    );
    for n in points {
        anyhow::ensure!(n >= 1, "--nfs values must be at least 1");
        let full = phase(&registry, n, &args, None)?;
        // Latency where the system keeps up: half the maximum, halved again until the
        // generator reaches 95 % of the rate asked (a busy engine breathes too slowly for it)
        // and 98 % of what it sent arrives — so that it is not the queueing of overload.
        let mut offered = full.mpps / 2.0;
        let mut low = phase(&registry, n, &args, Some(offered * 1e6))?;
        for _ in 0..3 {
            if low.offered_mpps >= 0.95 * offered && low.mpps >= 0.98 * low.offered_mpps {
                break;
            }
            println!(
                "{n:>6} not kept at {offered:.3} Mpps: generated {:.3}, delivered {:.3}, {} dropped, mean {:.1} µs",
                low.offered_mpps, low.mpps, low.drops, low.mean_us
            );
            offered /= 2.0;
            low = phase(&registry, n, &args, Some(offered * 1e6))?;
        }
        println!(
            "{:>6} {:>9.3} {:>8.2} {:>9} {:>11.2} {:>9.1} {:>9.0} | {:>9.3} {:>9.3} {:>10.1} {:>10.0}",
            n,
            full.mpps,
            full.gbps,
            full.drops,
            full.cpu_per_mpps,
            full.mean_us,
            full.p99_us,
            low.offered_mpps,
            low.mpps,
            low.mean_us,
            low.p99_us
        );
    }
    Ok(())
}
