//! `stitch bench shards`: one function (`nat` or `firewall`) run as 1, 2, … shards between
//! two veth interfaces, each interface sharded alike (its shards in one `PACKET_FANOUT` group,
//! spread by the kernel's flow hash), each shard of the region on a worker of its own.
//!
//! A load worker sends 64-byte UDP frames of 4096 flows into one veth pair and counts what
//! comes out of the other. For each shard: the packets its function translated or passed and
//! its worker's own CPU time (the shard's interfaces' work included) — packets per CPU-second,
//! which means "per core" on a machine whose cores the threads share; the total is the sum of
//! the shards' rates, beside one shard's in the same run.
//!
//! The hand-off hop — a packet that reached a shard other than its flow's, sent on to the
//! owner over the ring between them — is measured in process as well: two NAT shards driven
//! by one thread, every packet to its owner against every packet to the other shard first.

use crate::{cpu_seconds_of_thread, threads_named, VethPair};
use anyhow::Result;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Registry};

#[derive(clap::Args)]
pub struct ShardsArgs {
    /// Numbers of shards to measure, in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub shards: Vec<usize>,
    /// The function: `nat` or `firewall`.
    #[arg(long, default_value = "nat")]
    pub function: String,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Runs of each number of shards (medians reported), taken in turn.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
}

fn function_config(name: &str) -> Result<String> {
    Ok(match name {
        "nat" => "type: nat, external: [198.18.0.1, 198.18.0.2], ports: \"1024-65535\"".into(),
        "firewall" => "type: firewall, rules: [ { action: accept, from: lan } ]".into(),
        other => anyhow::bail!("--function `{other}`: nat or firewall"),
    })
}

fn graph(function: &str, shards: usize, veths: &[VethPair; 2]) -> String {
    format!(
        "workers: {{ load: {{}} }}\napps:\n  gen: {{ type: generator, size: 64, flows: 4096, src_ip: 10.1.0.1, dst_ip: 198.51.100.1, worker: load }}\n  tx: {{ type: af_packet, interface: {}, worker: load }}\n  lan: {{ type: af_packet, interface: {}, shards: {shards} }}\n  f: {{ shards: {shards}, {function} }}\n  wan: {{ type: af_packet, interface: {}, shards: {shards} }}\n  rx: {{ type: af_packet, interface: {}, worker: load }}\n  out: {{ type: sink, worker: load }}\nlinks:\n  - \"gen.output -> tx.input\"\n  - \"lan.output -> f.lan\"\n  - \"f.wan -> wan.input\"\n  - \"rx.output -> out.input\"\n",
        veths[0].b, veths[0].a, veths[1].a, veths[1].b
    )
}

/// What a shard did in a window: packets through its function, its worker's CPU seconds.
struct ShardSample {
    packets: u64,
    cpu: f64,
}

/// The packets shard `app` of the function has worked on: translated or passed, not handed on.
fn function_packets(e: &Engine, app: &str) -> u64 {
    let stats = e.stats();
    let Some(a) = stats.apps.iter().find(|a| a.name == app) else {
        return 0;
    };
    let c = |k: &str| a.counters.get(k).copied().unwrap_or(0);
    c("translated_out") + c("translated_in") + c("accepted") + c("established_passed")
}

fn measure(
    registry: &Arc<Registry>,
    args: &ShardsArgs,
    n: usize,
) -> Result<(Vec<ShardSample>, f64)> {
    let veths = [
        VethPair::new("stshA0", "stshA1")?,
        VethPair::new("stshB0", "stshB1")?,
    ];
    let text = graph(&function_config(&args.function)?, n, &veths);
    let g = Graph::parse(&text, "<bench shards>", Path::new("."), registry)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = Engine::new(registry.clone());
    engine.apply(g)?;
    std::thread::sleep(Duration::from_millis(500));
    let names: Vec<String> = (0..n)
        .map(|i| if n == 1 { "f".into() } else { format!("f:{i}") })
        .collect();
    let workers: Vec<Vec<libc::pid_t>> = (0..n)
        .map(|i| {
            threads_named(&if n == 1 {
                "stitch-main".into()
            } else {
                format!("stitch-shard{i}")
            })
        })
        .collect();
    anyhow::ensure!(
        workers.iter().all(|w| w.len() == 1),
        "a shard's worker thread not found"
    );
    let cpu = |i: usize| cpu_seconds_of_thread(workers[i][0]);
    let before: Vec<(u64, f64)> = (0..n)
        .map(|i| (function_packets(&engine, &names[i]), cpu(i)))
        .collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let wall = t0.elapsed().as_secs_f64();
    let samples = (0..n)
        .map(|i| ShardSample {
            packets: function_packets(&engine, &names[i]) - before[i].0,
            cpu: cpu(i) - before[i].1,
        })
        .collect();
    engine.stop();
    Ok((samples, wall))
}

pub fn run(args: ShardsArgs, registry: fn() -> Registry) -> Result<()> {
    anyhow::ensure!(
        args.shards.iter().all(|&n| (1..=8).contains(&n)),
        "--shards: from 1 to 8 each"
    );
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    function_config(&args.function)?;
    let registry = Arc::new(registry());
    println!(
        "bench shards: {} between two veth pairs, 64-byte UDP frames of 4096 flows, {} s per run, {} runs; machine load {}",
        args.function,
        args.seconds,
        args.runs,
        crate::load_average()
    );
    println!(
        "{:>6} {:>4}  {:>14} {:>10} {:>18}   per shard (Mpps per CPU-second)",
        "shards", "run", "Mpps (wall)", "CPU s", "Mpps per CPU-s, sum"
    );
    let mut totals: Vec<(usize, Vec<f64>)> = args.shards.iter().map(|&n| (n, Vec::new())).collect();
    for run in 1..=args.runs {
        for (n, results) in totals.iter_mut() {
            let (samples, wall) = measure(&registry, &args, *n)?;
            let per: Vec<f64> = samples
                .iter()
                .map(|s| s.packets as f64 / s.cpu.max(1e-9) / 1e6)
                .collect();
            let sum: f64 = per.iter().sum();
            let packets: u64 = samples.iter().map(|s| s.packets).sum();
            let cpu: f64 = samples.iter().map(|s| s.cpu).sum();
            println!(
                "{n:>6} {run:>4}  {:>14.3} {cpu:>10.2} {sum:>18.3}   {}",
                packets as f64 / wall / 1e6,
                per.iter()
                    .map(|p| format!("{p:.3}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            results.push(sum);
        }
    }
    let base = totals
        .first()
        .map(|(_, r)| crate::median(r.clone()))
        .unwrap_or(1.0);
    for (n, r) in &totals {
        let m = crate::median(r.clone());
        println!(
            "median: {n} shard(s) {m:.3} Mpps per CPU-second in sum = {:.2}× {} shard(s)",
            m / base,
            totals[0].0
        );
    }
    handoff_hop()?;
    Ok(())
}

/// The hand-off hop in process: ns per packet of two NAT shards, every packet sent to the
/// shard that owns it, against every packet sent to the other one first.
fn handoff_hop() -> Result<()> {
    use stitch_core::link::{link, Consumer, Producer};
    use stitch_core::{App, AppContext, Io};
    let config = json!({ "external": "198.18.0.1", "ports": "1024-65535" });
    let build = |i: usize| -> Result<stitch_apps::nat::Nat> {
        let c: stitch_apps::nat::NatConfig = serde_json::from_value(config.clone())?;
        let mut ctx = AppContext::new("bench", Path::new("."), Default::default());
        ctx.set_shard(Some(stitch_core::graph::Shard {
            of: "f".into(),
            index: i,
            count: 2,
        }));
        stitch_apps::nat::Nat::new(c, &mut ctx).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let mut apps = [build(0)?, build(1)?];
    // Per shard, every port the NAT declares, in its order (lan, wan, shard0, shard1), each
    // with a link: the lan input fed, the wan output drained, the hand-off output to the
    // other shard feeding its hand-off input; the rest idle.
    let (a_to_b, b_from_a) = link(4096);
    let (b_to_a, a_from_b) = link(4096);
    let mut handoff_in = [Some(a_from_b), Some(b_from_a)];
    let mut handoff_out = [Some(a_to_b), Some(b_to_a)];
    let mut feeds: Vec<Producer> = Vec::new();
    let mut drains: Vec<Consumer> = Vec::new();
    let mut idle: Vec<(Producer, Consumer)> = Vec::new();
    let mut ios = Vec::new();
    for k in 0..2 {
        let (lan_feed, lan_in) = link(4096);
        let (wan_out, wan_drain) = link(4096);
        feeds.push(lan_feed);
        drains.push(wan_drain);
        let mut spare = || {
            let (p, c) = link(64);
            let (p2, c2) = link(64);
            idle.push((p2, c));
            (p, c2)
        };
        let (lan_out, wan_in) = spare();
        let (own_out, own_in) = spare();
        let names = |i: usize| ["lan", "wan", "shard0", "shard1"][i].to_string();
        let mut ins: Vec<Option<Consumer>> = vec![Some(lan_in), Some(wan_in), None, None];
        let mut outs: Vec<Option<Producer>> = vec![Some(lan_out), Some(wan_out), None, None];
        ins[2 + k] = Some(own_in);
        outs[2 + k] = Some(own_out);
        ins[3 - k] = handoff_in[k].take();
        outs[3 - k] = handoff_out[k].take();
        ios.push(Io::new(
            ins.into_iter()
                .enumerate()
                .map(|(i, c)| (names(i), c.unwrap()))
                .collect(),
            outs.into_iter()
                .enumerate()
                .map(|(i, p)| (names(i), p.unwrap()))
                .collect(),
        ));
    }
    // Frames of 4096 flows from as many inside hosts, with the shard that owns each.
    let frames: Vec<(usize, Vec<u8>)> = (0..4096u32)
        .map(|i| {
            let f = crate::nf::udp_frame(
                [2, 0, 0, 0, 2, 1],
                [2, 0, 0, 0, 1, 2],
                [10, 2, (i >> 8) as u8, i as u8],
                10000 + i as u16,
                [198, 51, 100, 1],
                53,
            );
            (apps[0].shard_of_frame(0, &f) as usize, f)
        })
        .collect();
    let ns: Vec<f64> = [false, true]
        .into_iter()
        .map(|misplaced| {
            ns_per_packet(
                &mut apps,
                &mut ios,
                &mut feeds,
                &mut drains,
                &frames,
                misplaced,
            )
        })
        .collect();
    println!(
        "hand-off hop, in process (two NAT shards, one thread): {:.1} ns per packet at its owner, {:.1} ns handed on first: the hop {:.1} ns",
        ns[0],
        ns[1],
        ns[1] - ns[0]
    );
    Ok(())
}

/// CPU ns per packet of the two shards, each frame fed to its owner or, `misplaced`, to the
/// other shard first.
fn ns_per_packet(
    apps: &mut [stitch_apps::nat::Nat; 2],
    ios: &mut [stitch_core::Io],
    feeds: &mut [stitch_core::link::Producer],
    drains: &mut [stitch_core::link::Consumer],
    frames: &[(usize, Vec<u8>)],
    misplaced: bool,
) -> f64 {
    use stitch_core::App;
    let secs = 1.0;
    let (mut packets, mut cpu) = (0u64, 0.0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut next = 0;
    while Instant::now() < deadline {
        let c0 = crate::thread_cpu_seconds();
        for _ in 0..64 {
            for _ in 0..32 {
                let (owner, f) = &frames[next];
                next = (next + 1) % frames.len();
                let to = if misplaced { 1 - owner } else { *owner };
                let mut p = stitch_core::pool::alloc().expect("pool");
                let _ = p.set_data(f);
                feeds[to].transmit(p);
            }
            // Twice: what one shard handed on is worked on by the other.
            for _ in 0..2 {
                for (app, io) in apps.iter_mut().zip(ios.iter_mut()) {
                    app.push(io);
                }
            }
            for d in drains.iter_mut() {
                packets += d.free_available().0;
            }
        }
        cpu += crate::thread_cpu_seconds() - c0;
    }
    cpu * 1e9 / packets.max(1) as f64
}
