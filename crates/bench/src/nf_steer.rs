//! `stitch bench nf-scale --steer`: the figure 3(c) of fine-grained NFs (docs/references.md). N
//! function processes, each the head of its own chain, fed from an `af_xdp` interface on a veth:
//! with steering, the interface's XDP program sends each function's flow to a socket the function
//! reads itself; without, the engine receives every frame and deals them out (round robin, the
//! cheapest dispatch). A generator on another worker of the same engine sends 64-byte frames over
//! the veth at a fixed rate, so both paths carry the same offered load; the figures are the
//! receiving worker's CPU per packet, each function's, and what arrived.

use crate::nf_scale::{
    children_cpu, function_counts, register_latency_sink, reset_latencies, signature_binary,
    take_latencies, NfScaleArgs,
};
use crate::{cpu_seconds_of_thread, threads_named, VethPair};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::app::{AppContext, AppError, Io, PortSpec};
use stitch_core::{App, AppType};
use stitch_core::{Engine, Graph, Registry};

/// Where a frame's send time rides across the veth: the first payload bytes of the
/// generator's untagged IPv4 UDP frames (14 + 20 + 8).
const CLOCK_AT: usize = 42;

/// Writes the time into each frame's payload (`write: true`, before the sending port), or
/// reads it back into the packet's timestamp (before the latency sink): the generator's own
/// timestamp does not cross the wire.
struct PayloadClock {
    write: bool,
}

impl App for PayloadClock {
    type Config = serde_json::Value;
    fn declare(_: &serde_json::Value) -> Result<PortSpec, AppError> {
        Ok(PortSpec::filter())
    }
    fn new(c: serde_json::Value, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(PayloadClock {
            write: c["write"] == true,
        })
    }
    fn push(&mut self, io: &mut Io) {
        let (Some(input), Some(output)) = io.pair(0, 0) else {
            return;
        };
        let now = stitch_core::packet::now_ns();
        for mut p in input.drain() {
            if let Some(at) = p.data_mut().get_mut(CLOCK_AT..CLOCK_AT + 8) {
                if self.write {
                    at.copy_from_slice(&now.to_le_bytes());
                } else {
                    let sent = u64::from_le_bytes(at.try_into().expect("8 bytes"));
                    p.set_timestamp_ns(sent);
                }
            }
            output.transmit(p);
        }
    }
}

/// Function `i`'s flow: the generator's flow `i` (flows differ in their source address).
fn source(i: usize) -> String {
    format!("10.200.{}.{}", (1 + i) / 256, (1 + i) % 256)
}

fn graph(n: usize, steer: bool, args: &NfScaleArgs, veth: &VethPair, socket: &Path) -> String {
    let wake = if args.mode == crate::nf_scale::ScaleMode::Polling {
        "polling"
    } else {
        "blocking"
    };
    let mut g = format!(
        "engine: {{ busy_poll: false, pool_packets: {pool} }}
apps:
  gen: {{ type: generator, size: {size}, flows: {n}, src_ip: {src}, dst_ip: 10.201.0.1, rate: {rate:.0}, worker: tx }}
  stamp: {{ type: payload_clock, write: true, worker: tx }}
  tx: {{ type: af_packet, interface: {a}, worker: tx }}
  j: {{ type: join, worker: dut }}
  read: {{ type: payload_clock, worker: dut }}
  out: {{ type: latency_sink, worker: dut }}
",
        pool = args.pool_packets,
        size = args.size,
        src = source(0),
        rate = args.steer_mpps * 1e6,
        a = veth.a,
    );
    let mut links =
        String::from("links:\n  - \"gen.output -> stamp.input\"\n  - \"stamp.output -> tx.input\"\n  - \"j.output -> read.input\"\n  - \"read.output -> out.input\"\n");
    if steer {
        g += &format!(
            "  nic:\n    type: af_xdp\n    interface: {}\n    worker: dut\n    steer:\n",
            veth.b
        );
        for i in 0..n {
            g += &format!(
                "      - {{ match: \"src host {}\", to: p{i} }}\n",
                source(i)
            );
            links += &format!("  - \"nic.p{i} -> f{i}.input\"\n");
        }
        g += "  rest: { type: sink, worker: dut }\n";
        links += "  - \"nic.output -> rest.input\"\n";
    } else {
        g += &format!(
            "  nic: {{ type: af_xdp, interface: {}, worker: dut }}\n  rr: {{ type: round_robin, worker: dut }}\n",
            veth.b
        );
        links += "  - \"nic.output -> rr.input\"\n";
        for i in 0..n {
            links += &format!("  - \"rr.o{i} -> f{i}.input\"\n");
        }
    }
    for i in 0..n {
        g += &format!(
            "  f{i}: {{ type: nf_port, socket: {}, mode: zero_copy, wake: {wake}, worker: dut }}\n",
            socket.display()
        );
        links += &format!("  - \"f{i}.output -> j.i{i}\"\n");
    }
    g + &links
}

struct Point {
    offered_mpps: f64,
    mpps: f64,
    /// The receiving worker's CPU per packet, ns.
    engine_ns: f64,
    /// The functions' CPU per packet, ns, all together.
    functions_ns: f64,
    steered: u64,
    drops: u64,
    mean_us: f64,
    p99_us: f64,
}

fn counter(e: &Engine, app: &str, name: &str) -> u64 {
    e.stats()
        .apps
        .iter()
        .find(|a| a.name == app)
        .and_then(|a| a.counters.get(name).copied())
        .unwrap_or(0)
}

fn delivered(e: &Engine) -> (u64, u64) {
    let stats = e.stats();
    let app = |n: &str| stats.apps.iter().find(|a| a.name == n);
    (
        app("gen").map_or(0, |a| a.tx_packets),
        app("out").map_or(0, |a| a.rx_packets),
    )
}

fn phase(registry: &Arc<Registry>, n: usize, steer: bool, args: &NfScaleArgs) -> Result<Point> {
    // The generator sends on `a`; `nic` receives on `b`.
    let tag = std::process::id() % 100_000;
    let veth = VethPair::new(&format!("sxs{tag}a"), &format!("sxs{tag}b"))?;
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("nf.sock");
    let text = graph(n, steer, args, &veth, &socket);
    let graph = Graph::parse(&text, "<nf-scale --steer>", dir.path(), registry)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = Engine::new(registry.clone());
    let mut idle = graph.clone();
    idle.links.retain(|l| l.from.app != "gen");
    engine.apply(idle)?;
    let bin = signature_binary()?;
    let mut functions = Functions(Vec::new());
    for i in 0..n {
        functions.0.push(
            Command::new(&bin)
                .arg("--socket")
                .arg(&socket)
                .arg(format!("f{i}"))
                .spawn()
                .context("cannot start a function")?,
        );
    }
    let t = Instant::now();
    let ready = |e: &Engine| {
        (0..n).all(|i| {
            let name = format!("f{i}");
            counter(e, &name, "attached") == 1
                && (!steer
                    || e.query(&name, serde_json::json!({}))
                        .is_ok_and(|v| v["steered_from"].is_string()))
        })
    };
    while !ready(&engine) {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(30),
            "the functions did not attach (or were not steered to) in 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    engine.apply(graph)?;
    std::thread::sleep(Duration::from_millis(500));
    reset_latencies();
    let dut = *threads_named("stitch-dut")
        .first()
        .context("no `dut` worker thread")?;
    let drops = |e: &Engine| -> u64 {
        e.stats()
            .apps
            .iter()
            .map(|a| a.drops + a.counters.get("kernel_drops").copied().unwrap_or(0))
            .sum()
    };
    let (g0, d0) = delivered(&engine);
    let (e0, f0, x0, t0) = (
        cpu_seconds_of_thread(dut),
        children_cpu(&functions.0),
        drops(&engine),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let (g1, d1) = delivered(&engine);
    let (e1, f1, x1) = (
        cpu_seconds_of_thread(dut),
        children_cpu(&functions.0),
        drops(&engine),
    );
    let wall = t0.elapsed().as_secs_f64();
    let got = (d1 - d0).max(1) as f64;
    let steered = counter(&engine, "nic", "steered_function_packets");
    engine.stop();
    let (mean_us, p99_us) = take_latencies();
    Ok(Point {
        offered_mpps: (g1 - g0) as f64 / wall / 1e6,
        mpps: (d1 - d0) as f64 / wall / 1e6,
        engine_ns: (e1 - e0) / got * 1e9,
        functions_ns: (f1 - f0) / got * 1e9,
        steered,
        drops: x1 - x0,
        mean_us,
        p99_us,
    })
}

/// The function processes, killed and reaped when the phase ends however it ends.
struct Functions(Vec<Child>);

impl Drop for Functions {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn run(args: NfScaleArgs, mut registry: Registry) -> Result<()> {
    register_latency_sink(&mut registry);
    registry.register(AppType::of::<PayloadClock>(
        "payload_clock",
        "writes the time into a frame's payload, or reads it back into its timestamp",
    ));
    {
        let registry = Arc::new(registry);
        let points = function_counts(&args.nfs, "1,2,4,8")?;
        println!(
            "nf-scale --steer: {} B frames at {:.3} Mpps from a generator over a veth into af_xdp; N {:?} functions (stitch-nf-signature), each the head of its own chain; {} s per phase",
            args.size, args.steer_mpps, args.mode, args.seconds
        );
        println!(
            "{:>3} {:>8} {:>9} {:>9} {:>14} {:>14} {:>10} {:>8} {:>8} {:>8}",
            "N",
            "path",
            "offered",
            "Mpps",
            "engine ns/pkt",
            "functions ns/pkt",
            "steered",
            "drops",
            "mean µs",
            "p99 µs"
        );
        for n in points {
            anyhow::ensure!(n >= 1, "--nfs values must be at least 1");
            let mut engine_ns = [0.0; 2];
            for (k, steer) in [false, true].into_iter().enumerate() {
                let p = phase(&registry, n, steer, &args)?;
                engine_ns[k] = p.engine_ns;
                println!(
                    "{:>3} {:>8} {:>9.3} {:>9.3} {:>14.0} {:>14.0} {:>10} {:>8} {:>8.1} {:>8.0}",
                    n,
                    if steer { "steered" } else { "engine" },
                    p.offered_mpps,
                    p.mpps,
                    p.engine_ns,
                    p.functions_ns,
                    p.steered,
                    p.drops,
                    p.mean_us,
                    p.p99_us
                );
            }
            println!(
                "{n:>3} steered / engine path, the receiving worker's CPU per packet: {:.2}",
                engine_ns[1] / engine_ns[0]
            );
        }
        Ok(())
    }
}
