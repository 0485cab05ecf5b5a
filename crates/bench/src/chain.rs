//! `stitch bench chain`: generator → N forwarders → sink on one worker, generator → sink alone,
//! and the raw-ring baseline (a bare loop moving packets round N + 1 rings), all three at once
//! on one core. The scheduler gives each its turns of a few milliseconds, so all three meet the
//! same minutes of a shared machine; each one's cost is its own thread's CPU time per packet.

use crate::{
    cpu_seconds_of_thread, load_average, median, sink_packets, start_chain_on, threads_named,
    HugePageReserve, Sample,
};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pin_to_core, pool, Engine, Registry};

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

/// A chain in its own engine, on a worker of its own name.
struct EngineContender {
    engine: Engine,
    thread: libc::pid_t,
}

impl EngineContender {
    fn start(
        registry: &Arc<Registry>,
        hops: usize,
        size: usize,
        name: &str,
        core: usize,
    ) -> Result<Self> {
        let engine = start_chain_on(registry, hops, size, Some((name, core)))?;
        let thread_name = format!("stitch-{name}");
        // The worker starts with the graph; give it a moment to appear.
        for _ in 0..100 {
            if let Some(&thread) = threads_named(&thread_name).first() {
                return Ok(EngineContender { engine, thread });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        anyhow::bail!("the engine's worker thread {thread_name} did not start")
    }

    fn read(&self) -> Reading {
        Reading {
            packets: sink_packets(&self.engine),
            cpu: cpu_seconds_of_thread(self.thread),
        }
    }
}

/// The raw-ring baseline on a thread of its own: 512 packets moved round `rings` links with the
/// same `forward_to` call the forwarders make, one packet counted per ring move.
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
    let mut ends: Vec<(Producer, Consumer)> = (0..rings).map(|_| link(1024)).collect();
    for _ in 0..512 {
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
}

pub(crate) fn run(
    registry: Arc<Registry>,
    hops: usize,
    size: usize,
    seconds: f64,
    runs: usize,
    json: bool,
) -> Result<()> {
    anyhow::ensure!(hops >= 1, "--hops must be at least 1");
    anyhow::ensure!(runs >= 1, "--runs must be at least 1");
    for t in ["generator", "forwarder", "sink"] {
        anyhow::ensure!(
            registry.get(t).is_some(),
            "app type {t} missing from this build"
        );
    }
    // Snabb's packets live on hugepages; so do ours when the pool can have them (a TLB miss
    // per packet otherwise: 19 ns source → sink instead of 16 on the machine of session 10).
    let _hugepages = HugePageReserve::for_pool(pool::DEFAULT_PACKETS)?;
    let load = load_average();
    let core = shared_core();
    let raw = RawRing::start(hops + 1, size, core)?;
    let chain = EngineContender::start(&registry, hops, size, "chain", core)?;
    let direct = EngineContender::start(&registry, 0, size, "direct", core)?;
    if !json {
        println!(
            "chain: {hops} forwarders, {size}-byte packets, {runs} windows of {seconds} s with the chain, \
             source → sink and the raw ring taking turns on core {core}; load average {load}"
        );
        println!(
            "{:>3}  {:>11} {:>13} {:>13} {:>10} {:>12} {:>7}",
            "run", "chain Mpps", "chain ns/pkt", "src→sink ns", "ns/hop", "raw ns/hop", "ratio"
        );
    }
    std::thread::sleep(SETTLE);
    let mut rows = Vec::new();
    for n in 1..=runs {
        let (start, t0) = ([raw.read(), chain.read(), direct.read()], Instant::now());
        std::thread::sleep(Duration::from_secs_f64(seconds));
        let end = [raw.read(), chain.read(), direct.read()];
        let wall = t0.elapsed().as_secs_f64();
        let row = Run {
            raw: end[0].since(&start[0], wall),
            chain: end[1].since(&start[1], wall),
            direct: end[2].since(&start[2], wall),
            hops,
        };
        anyhow::ensure!(
            row.raw.packets > 0 && row.chain.packets > 0 && row.direct.packets > 0,
            "a contender moved no packet in {seconds} s"
        );
        if !json {
            println!(
                "{n:>3}  {:>11.2} {:>13.2} {:>13.2} {:>10.2} {:>12.2} {:>7.2}",
                mpps_per_cpu_second(&row.chain),
                row.chain.ns_per_packet(),
                row.direct.ns_per_packet(),
                row.ns_per_hop(),
                row.raw.ns_per_packet(),
                row.ratio()
            );
        }
        rows.push(row);
    }
    chain.engine.stop();
    direct.engine.stop();
    drop(raw);
    let med = |f: fn(&Run) -> f64| median(rows.iter().map(f).collect());
    let result = serde_json::json!({
        "hops": hops, "size": size, "seconds": seconds, "runs": runs, "load_average": load,
        "core": core,
        "chain_mpps": med(|r| mpps_per_cpu_second(&r.chain)),
        "chain_ns_per_packet": med(|r| r.chain.ns_per_packet()),
        "source_to_sink_ns_per_packet": med(|r| r.direct.ns_per_packet()),
        "ns_per_hop": med(Run::ns_per_hop),
        "raw_ns_per_hop": med(|r| r.raw.ns_per_packet()),
        "ratio": med(Run::ratio),
        "samples": rows.iter().map(|r| serde_json::json!({"raw": r.raw, "chain": r.chain, "direct": r.direct})).collect::<Vec<_>>(),
    });
    if json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        println!(
            "med  {:>11.2} {:>13.2} {:>13.2} {:>10.2} {:>12.2} {:>7.2}",
            med(|r| mpps_per_cpu_second(&r.chain)),
            med(|r| r.chain.ns_per_packet()),
            med(|r| r.direct.ns_per_packet()),
            med(Run::ns_per_hop),
            med(|r| r.raw.ns_per_packet()),
            med(Run::ratio)
        );
        println!(
            "(ns are each contender's own CPU time per packet; Mpps per second of CPU, what a core \
             of its own would move; ns/hop = (chain − source→sink) / hops)"
        );
    }
    Ok(())
}
