//! `stitch bench placement`: what crossing a placement costs. The same chain — generator → five
//! forwarders → sink — runs all in the engine, then with its middle forwarder placed elsewhere:
//! in the kernel (`placement: kernel`: out through a veth pair Stitch makes, through the eBPF
//! forwarder, back through the boundary's BPF ring buffer), in a function process (`placement: process`,
//! `stitch-nf-firewall` without rules, zero-copy rings), and behind a `vhost_user` port whose
//! guest is a DPDK virtio-user testpmd forwarding every packet back (what a VM's virtio driver
//! does, without the emulation a TCG guest would add). The yardstick, in the same run: one
//! `af_packet` interface hop (an `af_packet` app on each end of a veth pair). Variants are
//! alternated run by run; each figure is the median.

use crate::{load_average, median};
use anyhow::{bail, Context, Result};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{Engine, Registry};

#[derive(clap::Args)]
pub struct PlacementArgs {
    /// Seconds measured per run (after 0.5 s of warm-up).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Frame size in bytes.
    #[arg(long, default_value_t = 64)]
    size: usize,
    /// Which variants, comma-separated: engine, kernel, process, vm, af_packet.
    #[arg(long, default_value = "engine,kernel,process,vm,af_packet")]
    variants: String,
}

const INSTANCE: &str = "bench-placement";

/// The chain with its middle forwarder `f3` as `middle` (a YAML app entry), or, for the
/// af_packet yardstick, the generator's packets across one veth pair between two af_packet apps.
fn graph(source: &str, middle: &str) -> String {
    let mut s =
        format!("engine: {{ busy_poll: true }}\napps:\n  src: {source}\n  out: {{ type: sink }}\n");
    for i in 1..=5 {
        let entry = if i == 3 {
            middle
        } else {
            "{ type: forwarder }"
        };
        s += &format!("  f{i}: {entry}\n");
    }
    s += "links:\n  - \"src.output -> f1.input\"\n";
    for i in 1..5 {
        s += &format!("  - \"f{i}.output -> f{}.input\"\n", i + 1);
    }
    s += "  - \"f5.output -> out.input\"\n";
    s
}

fn yardstick_graph(source: &str, a: &str, b: &str) -> String {
    format!(
        "engine: {{ busy_poll: true }}\napps:\n  src: {source}\n  tx: {{ type: af_packet, interface: {a} }}\n  rx: {{ type: af_packet, interface: {b} }}\n  out: {{ type: sink }}\nlinks:\n  - \"src.output -> tx.input\"\n  - \"rx.output -> out.input\"\n"
    )
}

/// What one variant needs beside its graph, removed when dropped.
enum Extra {
    None,
    /// Removed when the pair drops.
    Veth {
        _pair: crate::VethPair,
    },
    Testpmd(std::process::Child, String),
}

impl Drop for Extra {
    fn drop(&mut self) {
        match self {
            Extra::None => {}
            Extra::Veth { .. } => {}
            Extra::Testpmd(child, prefix) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(format!("/var/run/dpdk/{prefix}"));
            }
        }
    }
}

/// Runs `variant` once with the generator at `rate` packets/s (unlimited: `None`): Mpps into
/// the sink over `secs`.
fn measure(
    registry: &Arc<Registry>,
    variant: &str,
    size: usize,
    rate: Option<f64>,
    secs: f64,
) -> Result<f64> {
    let dir = crate::enterable_tempdir()?;
    let source = match rate {
        Some(r) => format!(
            "{{ type: generator, size: {size}, timestamps: false, rate: {} }}",
            r as u64
        ),
        None => format!("{{ type: generator, size: {size}, timestamps: false }}"),
    };
    let source = source.as_str();
    let sock = dir.path().join("vm.sock");
    let tag = std::process::id() % 100_000;
    let (text, mut extra) = match variant {
        "engine" => (graph(source, "{ type: forwarder }"), Extra::None),
        "kernel" => (
            graph(source, "{ type: forwarder, placement: kernel }"),
            Extra::None,
        ),
        "process" => (
            graph(
                source,
                &format!(
                    "{{ placement: process, command: [stitch-nf-firewall], wake: polling, socket: {} }}",
                    dir.path().join("nf.sock").display()
                ),
            ),
            Extra::None,
        ),
        "vm" => (
            graph(
                source,
                &format!("{{ type: vhost_user, socket: {} }}", sock.display()),
            ),
            Extra::None,
        ),
        "af_packet" => {
            let pair = crate::VethPair::new(&format!("sbp{tag}a"), &format!("sbp{tag}b"))?;
            (yardstick_graph(source, &pair.a, &pair.b), Extra::Veth { _pair: pair })
        }
        other => bail!("unknown variant `{other}`: engine, kernel, process, vm, af_packet"),
    };
    let g = stitch_place::PlacedGraph::parse(&text, "<bench placement>", dir.path(), registry)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = Arc::new(Engine::new(registry.clone()));
    let placements = stitch_place::Placements::new(engine.clone(), INSTANCE);
    placements.clean_after_crash();
    placements
        .apply(g)
        .map_err(|e| anyhow::anyhow!("{variant}: {e}"))?;
    if variant == "vm" {
        let prefix = format!("sbpvm{tag}");
        let mut c = crate::vhost::testpmd(
            &prefix,
            1,
            &[format!("net_virtio_user0,path={}", sock.display())],
            &["--stats-period", "10"],
            None,
        )?;
        let child = c
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting dpdk-testpmd")?;
        extra = Extra::Testpmd(child, prefix);
    }
    if variant == "process" || variant == "vm" {
        // The function process or testpmd attaches within a second or two.
        let t = Instant::now();
        while crate::sink_packets(&engine) == 0 && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let (p0, t0) = (crate::sink_packets(&engine), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let p1 = crate::sink_packets(&engine);
    let mpps = (p1 - p0) as f64 / t0.elapsed().as_secs_f64() / 1e6;
    placements.stop();
    drop(extra);
    Ok(mpps)
}

/// Paths through the host's network stack drop what they cannot take instead of pushing back
/// (a veth's backlog overflows): offered more than they carry, they carry less. Their figure is
/// the highest offered rate that arrives with less than 1 % lost (as RFC 2544 defines
/// throughput: doubling from 62.5 kpps, then three bisections); the others push back on the
/// generator and run unlimited.
fn throughput(registry: &Arc<Registry>, variant: &str, size: usize, secs: f64) -> Result<f64> {
    if !matches!(variant, "kernel" | "af_packet") {
        return measure(registry, variant, size, None, secs);
    }
    let carries = |rate: f64| -> Result<Option<f64>> {
        let got = measure(registry, variant, size, Some(rate), secs)?;
        Ok((got * 1e6 >= rate * 0.99).then_some(got))
    };
    let (mut best, mut low, mut high) = (0.0, 0.0, 62_500.0);
    while high <= 16e6 {
        match carries(high)? {
            Some(got) => (best, low, high) = (got, high, high * 2.0),
            None => break,
        }
    }
    // Three halvings of the interval between what was carried and what was not.
    for _ in 0..3 {
        let mid = (low + high) / 2.0;
        match carries(mid)? {
            Some(got) => (best, low) = (got, mid),
            None => high = mid,
        }
    }
    Ok(best)
}

pub fn run(args: PlacementArgs, registry: Registry) -> Result<()> {
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    let registry = Arc::new(registry);
    let variants: Vec<&str> = args.variants.split(',').map(str::trim).collect();
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for run in 0..args.runs {
        for (i, v) in variants.iter().enumerate() {
            let mpps = throughput(&registry, v, args.size, args.seconds)?;
            eprintln!("run {}: {v:<10} {mpps:7.3} Mpps", run + 1);
            results[i].push(mpps);
        }
    }
    println!(
        "chain of five forwarders, {} B frames, {} s × {} runs (median), load average {}",
        args.size,
        args.seconds,
        args.runs,
        load_average()
    );
    let med: Vec<f64> = results.into_iter().map(median).collect();
    let engine = variants.iter().position(|v| *v == "engine").map(|i| med[i]);
    let yardstick = variants
        .iter()
        .position(|v| *v == "af_packet")
        .map(|i| med[i]);
    println!(
        "{:<12} {:>9} {:>12} {:>22}",
        "placement", "Mpps", "ns/packet", "crossing ns/packet"
    );
    for (v, m) in variants.iter().zip(&med) {
        let ns = 1e3 / m.max(1e-9);
        let crossing = match (engine, *v) {
            (Some(e), "kernel" | "process" | "vm") => format!("{:.1}", ns - 1e3 / e.max(1e-9)),
            _ => "-".into(),
        };
        println!("{v:<12} {m:>9.3} {ns:>12.1} {crossing:>22}");
    }
    if let Some(y) = yardstick {
        let hop = 1e3 / y.max(1e-9);
        println!(
            "af_packet: one interface hop (veth, af_packet on both ends) = {hop:.1} ns/packet"
        );
        let kernel = variants.iter().position(|v| *v == "kernel").map(|i| med[i]);
        if let (Some(e), Some(k)) = (engine, kernel) {
            let crossing = 1e3 / k.max(1e-9) - 1e3 / e.max(1e-9);
            println!(
                "kernel ↔ engine crossing / one af_packet hop = {:.2}",
                crossing / hop
            );
        }
    }
    Ok(())
}
