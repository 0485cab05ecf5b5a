//! `stitch bench chain-switch`: the inter-VNF bypass's chain (docs/references.md). A generator
//! feeds port 1 of the OpenFlow `switch`; N function processes (`stitch-nf-signature`, one
//! `nf_port` each) are chained through it by flows `in_port=k → output:k+1`; the last port leads to
//! a latency sink. With `--bypass on` the flows are point to point (the switch moves whole batches
//! ring to ring without a lookup); with `off` each flow also matches `ip`, so every packet is
//! looked up. Flows are programmed with `ovs-ofctl` (openvswitch-common), as a controller would.
//!
//! Between two function ports a point-to-point flow also gets a direct channel: the function
//! writes straight to the next one's ring and the switch is out of the path (the inter-VNF bypass).
//!
//! Per point: Mpps at full load, cores used there (engine + functions, CPU seconds per second),
//! latency (mean, p99) and the engine's CPU per packet at half of that load (or `--rate`), and the
//! switch-over time while every flow is flipped between the two shapes under traffic (`ovs-ofctl
//! replace-flows`, ten times): the data path's own figure (a table's publication to the data path
//! running it, the switch's `switch_over_ns` counter; median), the whole `ovs-ofctl` round trip
//! (process start, flow dump, FLOW_MODs, BARRIER reply), and the direct channels' hand-over (offer
//! → the receiving function reads the channel) and hand-back (end → channel retired), medians.

use crate::kernel::{quiet, sh, Ovs};
use crate::nf_scale::{
    counter_sum, function_counts, register_latency_sink, take_latencies, WithFunctions,
};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{Engine, Registry};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BypassMode {
    On,
    Off,
    Both,
}

#[derive(clap::Args)]
pub struct ChainSwitchArgs {
    /// Chain lengths (function processes), comma-separated.
    #[arg(long, default_value = "1,2,4,8")]
    pub nfs: String,
    #[arg(long, value_enum, default_value_t = BypassMode::Both)]
    pub bypass: BypassMode,
    /// Frame size in bytes.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Measured seconds per phase.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Also measure Open vSwitch's userspace datapath on the same chain (needs
    /// openvswitch-switch): a netdev bridge whose ports are veths into namespaces, each
    /// function a reflector in its namespace's kernel (tc mirred back out of its veth), the
    /// generator a Stitch process sending into the first veth.
    #[arg(long)]
    pub ovs: bool,
    /// Offered load (Mpps) of the latency phase; default: half of what each point carried at
    /// full load. A fixed load compares latency across modes at the same work.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Run the engine busy-polling (one core to itself) instead of sleeping when idle; on a
    /// two-core machine that leaves the functions one core.
    #[arg(long)]
    pub busy_poll: bool,
}

/// Medians over the flips: publication of a table → the data path running it, the whole
/// `ovs-ofctl` round trip, and the direct channels' hand-over and hand-back.
struct SwitchOver {
    table: Duration,
    round_trip: Duration,
    handover: Option<Duration>,
    handback: Option<Duration>,
}

struct Point {
    mpps: f64,
    cores: f64,
    /// The engine's CPU per packet delivered (generator, switch, ports, sink): with direct
    /// channels it should not grow with the chain (the inter-VNF bypass: cores 2+2+N instead of
    /// 2+3N).
    engine_ns: f64,
    mean_us: f64,
    p99_us: f64,
}

/// The flows of a chain of `n`: port 1 (generator) → 2 → … → n+2 (sink).
fn flows(n: usize, bypass: bool) -> String {
    let m = if bypass { "" } else { "ip," };
    (1..=n + 1)
        .map(|k| format!("priority=100,in_port={k},{m}actions=output:{}\n", k + 1))
        .collect()
}

fn ofctl(port: u16, args: &[&str]) -> Result<Duration> {
    let t = Instant::now();
    let o = Command::new("ovs-ofctl")
        .args(["-O", "OpenFlow13", "--no-names"])
        .args(args.iter().map(|a| {
            if *a == "SWITCH" {
                format!("tcp:127.0.0.1:{port}")
            } else {
                a.to_string()
            }
        }))
        .output()
        .context("ovs-ofctl is missing: apt install openvswitch-common")?;
    anyhow::ensure!(
        o.status.success(),
        "ovs-ofctl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(t.elapsed())
}

/// One phase of a chain of `n` at `rate` (None: flat out); returns the point and, when asked,
/// the median switch-over time.
/// Every flow flipped between the two shapes and back, five times, under traffic: the switch's
/// own switch-over time, ovs-ofctl's round trip, and the direct channels' hand-over and back.
fn switch_over_times(
    engine: &Engine,
    dir: &tempfile::TempDir,
    port: u16,
    n: usize,
    bypass: bool,
    file: &Path,
) -> Result<SwitchOver> {
    // Flip every flow between the two shapes and back, five times, under traffic
    // (`replace-flows`: ovs-ofctl reads the table and sends the difference, then a BARRIER).
    let other = dir.path().join("other");
    std::fs::write(&other, flows(n, !bypass))?;
    let mut times = Vec::new();
    let mut round_trips = Vec::new();
    let (mut handovers, mut handbacks) = (Vec::new(), Vec::new());
    for k in 0..10 {
        let f: &Path = if k % 2 == 0 { &other } else { file };
        let to_bypass = (k % 2 == 0) != bypass;
        let before = (
            counter_sum(engine, "direct_handover_ns"),
            counter_sum(engine, "direct_handback_ns"),
        );
        round_trips.push(ofctl(
            port,
            &["replace-flows", "SWITCH", f.to_str().unwrap()],
        )?);
        // The data path's own figure: publication of the last table -> running it.
        times.push(Duration::from_nanos(counter_sum(engine, "switch_over_ns")));
        // Between functions the switch also hands direct channels over or back: wait for
        // the last of them (the switch looks every millisecond).
        if n >= 2 {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(2) {
                let now = (
                    counter_sum(engine, "direct_handover_ns"),
                    counter_sum(engine, "direct_handback_ns"),
                );
                let channels = counter_sum(engine, "direct_channels") as usize;
                if to_bypass && channels == n - 1 && now.0 != before.0 {
                    handovers.push(Duration::from_nanos(now.0));
                    break;
                }
                if !to_bypass && channels == 0 && now.1 != before.1 {
                    handbacks.push(Duration::from_nanos(now.1));
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied()
    };
    times.sort();
    round_trips.sort();
    Ok(SwitchOver {
        table: times[times.len() / 2],
        round_trip: round_trips[round_trips.len() / 2],
        handover: median(&mut handovers),
        handback: median(&mut handbacks),
    })
}

fn phase(
    registry: &Arc<Registry>,
    n: usize,
    bypass: bool,
    args: &ChainSwitchArgs,
    rate: Option<f64>,
    switch_overs: bool,
) -> Result<(Point, Option<SwitchOver>)> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("nf.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let names: Vec<String> = std::iter::once("gen".to_string())
        .chain((0..n).map(|i| format!("f{i}")))
        .chain(std::iter::once("out".to_string()))
        .collect();
    let rate = rate.map(|r| format!(", rate: {r:.0}")).unwrap_or_default();
    let mut text = format!(
        "engine: {{ busy_poll: {}, link_size: 4096 }}\napps:\n  gen: {{ type: generator, size: {}, timestamps: true, flows: 64{rate} }}\n  sw: {{ type: switch, ports: [{}], listen: \"127.0.0.1:{port}\" }}\n  out: {{ type: latency_sink }}\n",
        args.busy_poll,
        args.size,
        names.join(", ")
    );
    let mut links =
        String::from("links:\n  - \"gen.output -> sw.gen\"\n  - \"sw.out -> out.input\"\n");
    for i in 0..n {
        text += &format!(
            "  f{i}: {{ type: nf_port, socket: {}, mode: zero_copy, wake: blocking, batch: 1, ring_size: 1024 }}\n",
            socket.display()
        );
        links += &format!("  - \"sw.f{i} -> f{i}.input\"\n  - \"f{i}.output -> sw.f{i}\"\n");
    }
    text += &links;
    let run = WithFunctions::start(
        registry,
        &text,
        "<chain-switch>",
        &socket,
        (0..n).map(|i| vec![format!("f{i}")]).collect(),
        Duration::from_secs(30),
    )?;
    let engine = &run.engine;
    let file = dir.path().join("flows");
    std::fs::write(&file, flows(n, bypass))?;
    ofctl(port, &["add-flows", "SWITCH", file.to_str().unwrap()])?;
    run.go()?;
    let (p0, t0) = (crate::sink_packets(engine), Instant::now());
    let c0 = run.cpu_split();
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let p1 = crate::sink_packets(engine);
    let c1 = run.cpu_split();
    let wall = t0.elapsed().as_secs_f64();
    let switch_over = if switch_overs {
        Some(switch_over_times(engine, &dir, port, n, bypass, &file)?)
    } else {
        None
    };
    run.stop();
    let (mean_us, p99_us) = take_latencies();
    let pps = (p1 - p0) as f64 / wall;
    Ok((
        Point {
            mpps: pps / 1e6,
            cores: (c1.0 + c1.1 - c0.0 - c0.1) / wall,
            engine_ns: (c1.0 - c0.0) * 1e9 / (p1 - p0).max(1) as f64,
            mean_us,
            p99_us,
        },
        switch_over,
    ))
}

/// Removes the namespaces and veths of one Open vSwitch phase, also when it fails.
struct OvsChain {
    tag: String,
    names: Vec<String>,
    generator: Option<Child>,
}

impl Drop for OvsChain {
    fn drop(&mut self) {
        if let Some(mut g) = self.generator.take() {
            let _ = g.kill();
            let _ = g.wait();
        }
        for n in &self.names {
            quiet(&format!("ip link del {}{n}", self.tag));
            quiet(&format!("ip netns del {}{n}", self.tag));
        }
        // The bridge's own port: a tap device that outlives ovs-vswitchd.
        quiet(&format!("ip link del {}br", self.tag));
    }
}

/// Namespace `{tag}{name}` on a veth whose other end is OpenFlow port `ofport` of bridge `br`;
/// a function (`f…`) sends every frame back out of the interface it came in on.
fn add_ovs_port(ovs: &Ovs, br: &str, tag: &str, name: &str, ofport: u32) -> Result<()> {
    let (ns, dev) = (format!("{tag}{name}"), format!("{tag}{name}"));
    sh(&format!("ip netns add {ns}"))?;
    sh(&format!(
        "ip link add {dev} type veth peer name eth0 netns {ns}"
    ))?;
    sh(&format!("sysctl -qw net.ipv6.conf.{dev}.disable_ipv6=1"))?;
    sh(&format!(
        "ip netns exec {ns} sysctl -qw net.ipv6.conf.all.disable_ipv6=1"
    ))?;
    sh(&format!("ip link set {dev} up"))?;
    sh(&format!("ip -n {ns} link set eth0 up"))?;
    ovs.vsctl(&format!(
        "add-port {br} {dev} -- set interface {dev} ofport_request={}",
        ofport
    ))?;
    if name.starts_with('f') {
        // The function: every frame back out of the interface it came in on.
        sh(&format!("tc -n {ns} qdisc add dev eth0 clsact"))?;
        sh(&format!(
            "tc -n {ns} filter add dev eth0 ingress u32 match u32 0 0 action mirred egress redirect dev eth0"
        ))?;
    }
    Ok(())
}

/// One Open vSwitch phase: Mpps at the sink and the CPU of ovs-vswitchd (cores).
fn ovs_phase(n: usize, args: &ChainSwitchArgs) -> Result<(f64, f64)> {
    let ovs = Ovs::start()?;
    let tag = format!("cs{}", std::process::id() % 10000);
    let names: Vec<String> = std::iter::once("g".to_string())
        .chain((0..n).map(|i| format!("f{i}")))
        .chain(std::iter::once("s".to_string()))
        .collect();
    let mut chain = OvsChain {
        tag: tag.clone(),
        names: names.clone(),
        generator: None,
    };
    let br = format!("{tag}br");
    ovs.vsctl(&format!(
        "add-br {br} -- set bridge {br} datapath_type=netdev fail_mode=secure"
    ))?;
    for (k, name) in names.iter().enumerate() {
        add_ovs_port(&ovs, &br, &tag, name, k as u32 + 1)?;
    }
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), flows(n, true))?;
    sh(&format!(
        "{} ovs-ofctl -O OpenFlow13 add-flows {br} {}",
        ovs.env(),
        file.path().display()
    ))?;
    // The generator: a Stitch process in the first namespace, flat out into its veth.
    let dir = tempfile::tempdir()?;
    let graph = dir.path().join("gen.yaml");
    std::fs::write(
        &graph,
        format!(
            "apps:\n  gen: {{ type: generator, size: {}, flows: 64 }}\n  nic: {{ type: af_packet, interface: eth0 }}\nlinks:\n  - \"gen.output -> nic.input\"\n",
            args.size
        ),
    )?;
    chain.generator = Some(
        Command::new("ip")
            .args(["netns", "exec", &format!("{tag}g")])
            .arg(std::env::current_exe()?)
            .args(["run", "--control"])
            .arg(dir.path().join("gen.sock"))
            .arg(&graph)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    );
    let sink_rx = || -> Result<u64> {
        Ok(sh(&format!(
            "ip netns exec {tag}s cat /sys/class/net/eth0/statistics/rx_packets"
        ))?
        .trim()
        .parse()?)
    };
    let pid: i32 = std::fs::read_to_string(
        ovs.env()
            .split_whitespace()
            .next()
            .and_then(|v| v.strip_prefix("OVS_RUNDIR="))
            .map(|d| format!("{d}/ovs-vswitchd.pid"))
            .unwrap_or_default(),
    )?
    .trim()
    .parse()?;
    let vswitchd_cpu = || -> f64 {
        let tick = crate::clock_ticks();
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let f: Vec<String> = s
                    .rsplit_once(')')?
                    .1
                    .split_whitespace()
                    .map(str::to_string)
                    .collect();
                Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / tick)
            })
            .unwrap_or(0.0)
    };
    std::thread::sleep(Duration::from_millis(1500));
    let (p0, c0, t0) = (sink_rx()?, vswitchd_cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let (p1, c1) = (sink_rx()?, vswitchd_cpu());
    let wall = t0.elapsed().as_secs_f64();
    drop(chain);
    drop(ovs);
    Ok(((p1 - p0) as f64 / wall / 1e6, (c1 - c0) / wall))
}

fn micros(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1} µs", d.as_secs_f64() * 1e6))
}

pub fn run(args: ChainSwitchArgs, mut r: Registry) -> Result<()> {
    register_latency_sink(&mut r);
    let registry = Arc::new(r);
    let points = function_counts(&args.nfs, "1,2,4,8")?;
    let modes: &[bool] = match args.bypass {
        BypassMode::On => &[true],
        BypassMode::Off => &[false],
        BypassMode::Both => &[true, false],
    };
    println!(
        "chain-switch: {} B frames, N signature functions (blocking nf_ports) chained through the OpenFlow switch; engine {}; {} s per phase",
        args.size,
        if args.busy_poll { "busy-polling" } else { "sleeping when idle" },
        args.seconds
    );
    println!(
        "{:>3} {:>7} {:>9} {:>7} | {:>10} {:>9} {:>9} {:>10} | {:>12} {:>12} {:>10} {:>10}",
        "N",
        "bypass",
        "max Mpps",
        "cores",
        "at Mpps",
        "mean µs",
        "p99 µs",
        "engine/pkt",
        "switch-over",
        "ofctl trip",
        "hand-over",
        "hand-back"
    );
    for &n in &points {
        anyhow::ensure!(n >= 1, "--nfs values must be at least 1");
        for &bypass in modes {
            let (full, switch_over) = phase(&registry, n, bypass, &args, None, true)?;
            let load = args.rate.unwrap_or(full.mpps / 2.0);
            let (low, _) = phase(&registry, n, bypass, &args, Some(load * 1e6), false)?;
            println!(
                "{:>3} {:>7} {:>9.3} {:>7.2} | {:>10.3} {:>9.1} {:>9.0} {:>7.0} ns | {:>9.1} µs {:>9.1} ms {:>10} {:>10}",
                n,
                if bypass { "on" } else { "off" },
                full.mpps,
                full.cores,
                low.mpps,
                low.mean_us,
                low.p99_us,
                low.engine_ns,
                switch_over.as_ref().map_or(0.0, |d| d.table.as_secs_f64() * 1e6),
                switch_over.as_ref().map_or(0.0, |d| d.round_trip.as_secs_f64() * 1e3),
                micros(switch_over.as_ref().and_then(|d| d.handover)),
                micros(switch_over.as_ref().and_then(|d| d.handback)),
            );
        }
        if args.ovs {
            let (mpps, cores) = ovs_phase(n, &args)?;
            println!(
                "{:>3} {:>7} {:>9.3} {:>7.2} | (Open vSwitch userspace datapath; cores: ovs-vswitchd alone)",
                n, "ovs", mpps, cores
            );
        }
    }
    Ok(())
}
