//! `stitch bench chain`: generator → N forwarders → sink and the raw-ring baseline (a bare loop
//! moving packets round N + 1 rings) at once on one core, each on a thread of its own; the
//! scheduler gives each its turns of a few milliseconds, so both meet the same minutes of a
//! shared machine, and each one's cost is its own thread's CPU time per packet. The engine's
//! worker takes turns between the chain and generator → sink alone, the forwarders spliced in
//! and out by the live diff, so that the cost of a hop is a difference measured on one thread.
//! With `--latency` it also takes turns with the chain measuring latency (the generator stamping
//! its batches, a histogram on the link into the sink): the cost of measuring is the difference.

use crate::{
    cpu_seconds_of_thread, load_average, median, parse_chain, sink_packets, threads_named,
    HugePageReserve, Sample,
};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::link::{link, Consumer, Producer, DEFAULT_LINK_SIZE};
use stitch_core::{pin_to_core, pool, Engine, Graph, Registry, PULL_BURST};

/// Time for every contender to start and warm up before the first window.
const SETTLE: Duration = Duration::from_millis(300);

/// Where a contender's counts are read: packets so far and its thread's CPU seconds.
struct Reading {
    packets: u64,
    cpu: f64,
}

impl Reading {
    /// What the contender did between `start` and this reading, `wall` seconds apart.
    fn since(&self, start: &Reading, wall: f64) -> Sample {
        Sample {
            packets: self.packets - start.packets,
            wall,
            cpu: self.cpu - start.cpu,
        }
    }
}

/// Millions of packets per second of `s`'s CPU time: what the contender moves on a core of
/// its own (its wall-clock rate counts the turns it waited).
fn mpps_per_cpu_second(s: &Sample) -> f64 {
    1e3 / s.ns_per_packet()
}

/// The engine's side of the comparison: one worker running source → sink, with the chain's
/// forwarders spliced in and out by the engine's live diff (the generator and the sink are kept
/// with their state). The chain and source → sink thus run on the same thread with the same
/// packet buffers and caches, and the per-hop figure, their difference, compares like with
/// like: two identical source → sink engines in one process differ by up to 12 % per packet
/// (which engine's buffers and pages map where in the caches), enough to move the per-hop ratio
/// at N = 8 by ±0.4 when chain and source → sink ran as two engines.
struct SplicedChain {
    engine: Engine,
    thread: libc::pid_t,
    chain: Graph,
    direct: Graph,
    /// The chain measuring its latency, with `--latency`.
    measured: Option<Graph>,
}

/// The graphs a worker takes turns with.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Chain,
    Direct,
    Measured,
}

/// The order of the turns, run twice per run, so that a drift of the machine during a run weighs
/// on every shape alike.
const TURNS: [Shape; 4] = [Shape::Chain, Shape::Direct, Shape::Direct, Shape::Chain];
const TURNS_MEASURED: [Shape; 6] = [
    Shape::Chain,
    Shape::Measured,
    Shape::Direct,
    Shape::Direct,
    Shape::Measured,
    Shape::Chain,
];
/// After a splice, time for the worker to run the new graph before its window.
const SPLICE_SETTLE: Duration = Duration::from_millis(20);
/// The worker the engine's contender runs on.
const WORKER: &str = "chain";

impl SplicedChain {
    fn start(
        registry: &Arc<Registry>,
        hops: usize,
        size: usize,
        core: usize,
        latency: bool,
    ) -> Result<Self> {
        let on = Some((WORKER, core));
        let chain = parse_chain(registry, hops, size, on, false)?;
        let direct = parse_chain(registry, 0, size, on, false)?;
        let measured = match latency {
            true => Some(parse_chain(registry, hops, size, on, true)?),
            false => None,
        };
        let engine = Engine::new(registry.clone());
        engine.apply(chain.clone())?;
        let thread = Self::worker_thread()?;
        Ok(SplicedChain {
            engine,
            thread,
            chain,
            direct,
            measured,
        })
    }

    /// The worker's thread; it starts with the graph, so give it a moment to appear.
    fn worker_thread() -> Result<libc::pid_t> {
        let name = format!("stitch-{WORKER}");
        for _ in 0..100 {
            if let Some(&thread) = threads_named(&name).first() {
                return Ok(thread);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        anyhow::bail!("the engine's worker thread {name} did not start")
    }

    /// About `seconds` of turns of the chain, of source → sink and of the chain measuring
    /// latency: what each did in its windows.
    fn measure(&self, seconds: f64) -> Result<(Sample, Sample, Option<Sample>)> {
        let turns: &[Shape] = match self.measured {
            Some(_) => &TURNS_MEASURED,
            None => &TURNS,
        };
        let window = Duration::from_secs_f64(seconds / (2 * turns.len()) as f64);
        let (mut chain, mut direct, mut measured) = Default::default();
        for &shape in turns.iter().chain(turns) {
            let (graph, total) = match (shape, &self.measured) {
                (Shape::Chain, _) => (&self.chain, &mut chain),
                (Shape::Direct, _) => (&self.direct, &mut direct),
                (Shape::Measured, Some(g)) => (g, &mut measured),
                (Shape::Measured, None) => unreachable!("measured turns only with the graph"),
            };
            self.engine.apply(graph.clone())?;
            anyhow::ensure!(
                Self::worker_thread()? == self.thread,
                "the engine replaced its worker thread on a splice"
            );
            std::thread::sleep(SPLICE_SETTLE);
            let (start, t0) = (self.read(), Instant::now());
            std::thread::sleep(window);
            *total += self.read().since(&start, t0.elapsed().as_secs_f64());
        }
        Ok((chain, direct, self.measured.as_ref().map(|_| measured)))
    }

    fn read(&self) -> Reading {
        Reading {
            packets: sink_packets(&self.engine),
            cpu: cpu_seconds_of_thread(self.thread),
        }
    }
}

/// The raw-ring baseline on a thread of its own: the engine's burst of packets ([`PULL_BURST`],
/// what a source brings in each breath) moved round `rings` links with the same `forward_to`
/// call the forwarders make, one packet counted per ring move. Each call then moves as many
/// packets as a forwarder's does, so the ratio weighs what the engine adds to a ring's work, not
/// a difference of batch size (with twice the burst, the ring's fixed cost per call was spread
/// over twice the packets).
struct RawRing {
    moves: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: libc::pid_t,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl RawRing {
    fn start(rings: usize, size: usize, core: usize) -> Result<RawRing> {
        let (moves, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (m, s) = (moves.clone(), stop.clone());
        let handle = std::thread::Builder::new()
            .name("stitch-raw-ring".into())
            .spawn(move || {
                pin_to_core(core);
                // SAFETY: gettid takes no arguments and cannot fail.
                let _ = tid_tx.send(unsafe { libc::gettid() });
                move_round_rings(rings, size, &m, &s);
            })?;
        let thread = tid_rx.recv().context("the raw-ring thread did not start")?;
        Ok(RawRing {
            moves,
            stop,
            thread,
            handle: Some(handle),
        })
    }

    fn read(&self) -> Reading {
        Reading {
            packets: self.moves.load(Ordering::Relaxed),
            cpu: cpu_seconds_of_thread(self.thread),
        }
    }
}

impl Drop for RawRing {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn move_round_rings(rings: usize, size: usize, moves: &AtomicU64, stop: &AtomicBool) {
    let mut ends: Vec<(Producer, Consumer)> = (0..rings).map(|_| link(DEFAULT_LINK_SIZE)).collect();
    for _ in 0..PULL_BURST {
        let mut p = pool::alloc().expect("pool");
        let _ = p.set_len(size);
        ends[0].0.transmit(p);
    }
    let (mut producers, mut consumers): (Vec<Producer>, Vec<Consumer>) = ends.drain(..).unzip();
    let mut moved = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..256 {
            for (i, c) in consumers.iter_mut().enumerate() {
                moved += c.forward_to(&mut producers[(i + 1) % rings]) as u64;
            }
        }
        moves.store(moved, Ordering::Relaxed);
    }
}

/// The core the contenders share: the one this thread runs on (under `taskset -c N`, N).
fn shared_core() -> usize {
    // SAFETY: sched_getcpu takes no arguments; it returns -1 only where unsupported.
    let cpu = unsafe { libc::sched_getcpu() };
    cpu.max(0) as usize
}

/// One row of results: the three windows of a run.
struct Run {
    raw: Sample,
    chain: Sample,
    direct: Sample,
    measured: Option<Sample>,
    hops: usize,
}

impl Run {
    /// The engine's cost per hop: what each forwarder adds to source → sink.
    fn ns_per_hop(&self) -> f64 {
        ((self.chain.ns_per_packet() - self.direct.ns_per_packet()) / self.hops as f64).max(0.0)
    }
    fn ratio(&self) -> f64 {
        self.ns_per_hop() / self.raw.ns_per_packet()
    }
    /// What measuring latency adds to a packet through the chain (stamps and histogram).
    fn latency_ns(&self) -> f64 {
        (self.measured.as_ref()).map_or(0.0, |m| m.ns_per_packet() - self.chain.ns_per_packet())
    }
}

#[derive(clap::Args)]
pub struct ChainArgs {
    /// Forwarders between source and sink.
    #[arg(long, default_value_t = 8)]
    pub hops: usize,
    /// Frame size in bytes.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Seconds per measured window (the three contenders share each).
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Windows (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also take turns with the chain measuring its latency (generator stamps, a histogram
    /// on the link into the sink) and report what that costs per packet.
    #[arg(long)]
    pub latency: bool,
}

pub(crate) fn run(registry: Arc<Registry>, args: ChainArgs) -> Result<()> {
    let ChainArgs {
        hops,
        size,
        seconds,
        runs,
        json,
        latency,
    } = args;
    anyhow::ensure!(hops >= 1, "--hops must be at least 1");
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    for t in ["generator", "forwarder", "sink"] {
        anyhow::ensure!(
            registry.get(t).is_some(),
            "app type {t} missing from this build"
        );
    }
    // Snabb's packets live on hugepages; so do ours when the pool can have them (a TLB miss
    // per packet otherwise: 19 ns source → sink instead of 16: run of 2026-11-24, commit 371c81e).
    let _hugepages = HugePageReserve::for_pool(pool::DEFAULT_PACKETS)?;
    let load = load_average();
    let core = shared_core();
    let raw = RawRing::start(hops + 1, size, core)?;
    let engine = SplicedChain::start(&registry, hops, size, core, latency)?;
    if !json {
        println!(
            "chain: {hops} forwarders, {size}-byte packets, {runs} runs of {seconds} s: the raw ring \
             ({PULL_BURST} packets round {} rings) and \
             the engine taking turns on core {core}, the engine's worker 4 turns each \
             with and without the forwarders{}; load average {load}",
            hops + 1,
            if latency {
                " and with them measuring latency"
            } else {
                ""
            }
        );
        let latency_header = latency.then_some("latency ns/pkt");
        println!(
            "{}",
            columns("run", HEADERS.map(String::from), latency_header)
        );
    }
    std::thread::sleep(SETTLE);
    let mut rows = Vec::new();
    for n in 1..=runs {
        let (start, t0) = (raw.read(), Instant::now());
        let (chain, direct, measured) = engine.measure(seconds)?;
        let row = Run {
            raw: raw.read().since(&start, t0.elapsed().as_secs_f64()),
            chain,
            direct,
            measured,
            hops,
        };
        anyhow::ensure!(
            row.raw.packets > 0 && row.chain.packets > 0 && row.direct.packets > 0,
            "a contender moved no packet in {seconds} s"
        );
        if !json {
            println!("{}", row_line(&n.to_string(), |f| f(&row), latency));
        }
        rows.push(row);
    }
    engine.engine.stop();
    drop(raw);
    let med = |f: fn(&Run) -> f64| median(rows.iter().map(f).collect());
    if json {
        let result = serde_json::json!({
            "hops": hops, "size": size, "seconds": seconds, "runs": runs, "load_average": load,
            "core": core,
            "chain_mpps": med(|r| mpps_per_cpu_second(&r.chain)),
            "chain_ns_per_packet": med(|r| r.chain.ns_per_packet()),
            "source_to_sink_ns_per_packet": med(|r| r.direct.ns_per_packet()),
            "ns_per_hop": med(Run::ns_per_hop),
            "raw_ns_per_hop": med(|r| r.raw.ns_per_packet()),
            "ratio": med(Run::ratio),
            "latency_ns_per_packet": latency.then(|| med(Run::latency_ns)),
            "samples": rows.iter().map(|r| serde_json::json!({"raw": r.raw, "chain": r.chain, "direct": r.direct, "measured": r.measured})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&result)?);
        return Ok(());
    }
    println!("{}", row_line("med", med, latency));
    println!(
        "(ns are each contender's own CPU time per packet; Mpps per second of CPU, what a core \
         of its own would move; ns/hop = (chain − source→sink) / hops{})",
        if latency {
            "; latency ns/pkt = the chain with its generator stamping batches and a latency \
             histogram on the link into the sink − the chain"
        } else {
            ""
        }
    );
    Ok(())
}

const HEADERS: [&str; 6] = [
    "chain Mpps",
    "chain ns/pkt",
    "src→sink ns",
    "ns/hop",
    "raw ns/hop",
    "ratio",
];

/// A line of the table: `label`, then the six figures of [`HEADERS`] and, with `latency`, what
/// measuring it costs, each read from a run by `figure` (one run's, or the runs' median).
fn row_line(label: &str, figure: impl Fn(fn(&Run) -> f64) -> f64, latency: bool) -> String {
    let cells = [
        figure(|r| mpps_per_cpu_second(&r.chain)),
        figure(|r| r.chain.ns_per_packet()),
        figure(|r| r.direct.ns_per_packet()),
        figure(Run::ns_per_hop),
        figure(|r| r.raw.ns_per_packet()),
        figure(Run::ratio),
    ];
    let latency = latency.then(|| format!("{:.2}", figure(Run::latency_ns)));
    columns(label, cells.map(|c| format!("{c:.2}")), latency.as_deref())
}

/// The table's columns, right-aligned.
fn columns(label: &str, cells: [String; 6], latency: Option<&str>) -> String {
    let [a, b, c, d, e, f] = cells;
    let mut line = format!("{label:>3}  {a:>11} {b:>13} {c:>13} {d:>10} {e:>12} {f:>7}");
    if let Some(l) = latency {
        line += &format!(" {l:>15}");
    }
    line
}
