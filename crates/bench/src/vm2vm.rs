//! `stitch bench vm2vm`: seed 001's own case — VMs chained through the OpenFlow switch. N
//! guests (`dpdk-testpmd` virtio-user front-ends in io forwarding, two ports each, as `stitch
//! bench vhost` uses them) in a chain between the tester's two ports (Stitch's virtio-net
//! driver, [`crate::rfc2544::tester`]) through one `switch`: tester → VM 1 → … → VM N → tester,
//! every hop a flow `in_port=X,actions=output:Y`. Each chain runs twice in the same run: with
//! direct paths (each sending port's worker copies guest to guest) and with `direct_paths:
//! false` (the switch carries every packet). Figures: what arrived (Mpps), the Stitch
//! process's CPU per packet, the paths' switch-over time, and frames lost or reordered.

use crate::rfc2544::duts::add_flows;
use crate::rfc2544::tester::{self, FrameSize, Frames};
use crate::vhost::{stitch_process, testpmd, Proc};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use stitch_vhost::frontend::Frontend;

#[derive(clap::Args)]
pub struct Vm2vmArgs {
    /// Chain lengths (VMs), comma-separated.
    #[arg(long, default_value = "1,2,4")]
    pub vms: String,
    /// Frame sizes in bytes (with FCS), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,1500")]
    pub sizes: Vec<FrameSize>,
    /// Seconds of traffic per measurement.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// The rate the tester offers, Mpps (the same for both ways of each chain: CPU per packet
    /// compares at equal load; 0: as fast as its port takes frames).
    #[arg(long, default_value_t = 0.2)]
    pub rate_mpps: f64,
}

/// The switch between the tester's ports `a` (1) and `b` (2) and each VM's ports `vIa`
/// (2I + 1) and `vIb` (2I + 2), on one worker that sleeps when idle.
fn graph(dir: &Path, vms: usize, port: u16, direct: bool) -> String {
    let mut ports = vec!["a".to_string(), "b".to_string()];
    for i in 1..=vms {
        ports.push(format!("v{i}a"));
        ports.push(format!("v{i}b"));
    }
    let mut g = format!(
        "engine: {{ busy_poll: false }}\napps:\n  sw: {{ type: switch, ports: [{}], listen: \"127.0.0.1:{port}\", direct_paths: {direct} }}\n",
        ports.join(", ")
    );
    let mut links = String::from("links:\n");
    for p in &ports {
        g += &format!(
            "  {p}: {{ type: vhost_user, socket: {}/{p}.sock }}\n",
            dir.display()
        );
        links += &format!("  - \"{p}.output -> sw.{p}\"\n  - \"sw.{p} -> {p}.input\"\n");
    }
    g + &links
}

/// tester → VM 1 → … → VM N → tester.
fn flows(vms: usize) -> String {
    let mut f = String::from("in_port=1,actions=output:3\n");
    for i in 1..vms {
        f += &format!("in_port={},actions=output:{}\n", 2 * i + 2, 2 * i + 3);
    }
    f + &format!("in_port={},actions=output:2\n", 2 * vms + 2)
}

/// A counter of app `app` of the instance whose API socket is in `dir`.
fn counter(dir: &Path, app: &str, name: &str) -> u64 {
    let stats = stitch_api::client::json(
        &dir.join("api.sock"),
        stitch_api::client::Method::GET,
        "/api/v1/stats",
        None,
    );
    stats
        .ok()
        .and_then(|v| {
            v["apps"]
                .as_array()?
                .iter()
                .find(|a| a["name"] == app)?
                .get("counters")?
                .get(name)?
                .as_u64()
        })
        .unwrap_or(0)
}

struct Point {
    mpps: f64,
    ns_per_packet: f64,
    lost: u64,
    reordered: u64,
    paths: u64,
    handover_us: f64,
}

/// One chain, running: the switch, the guests and the tester's ports.
fn measure(vms: usize, direct: bool, args: &Vm2vmArgs) -> Result<Vec<Point>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let port = crate::free_port()?;
    let file = d.join("vm2vm.yaml");
    std::fs::write(&file, graph(d, vms, port, direct))?;
    let switch = stitch_process(d, &file)?;
    add_flows(port, &flows(vms), d)?;
    let mut guests: Vec<Proc> = Vec::new();
    for i in 1..=vms {
        let prefix = format!("sbvm{}x{i}", std::process::id());
        let vdevs: Vec<String> = ["a", "b"]
            .iter()
            .enumerate()
            .map(|(k, s)| format!("net_virtio_user{k},path={}/v{i}{s}.sock", d.display()))
            .collect();
        // The guests take turns on the two CPUs.
        let child = testpmd(&prefix, i % 2, &vdevs, &["--stats-period", "10"], None)?
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting dpdk-testpmd")?;
        guests.push(Proc::of(child));
    }
    let connect = |name: &str| {
        Frontend::connect(&d.join(name), 1024, Duration::from_secs(10))
            .with_context(|| format!("the tester's port {name}"))
    };
    let (mut tx, mut rx) = (connect("a.sock")?, connect("b.sock")?);
    // Direct paths come once every guest is there; a short trial warms the chain up.
    let started = Instant::now();
    let frames = Frames::new(FrameSize::Fixed(64));
    loop {
        tester::trial(&mut tx, &mut rx, &frames, Some(10_000.0), 0.1, 0, false);
        let paths = counter(d, "sw", "direct_channels");
        if !direct || paths == vms as u64 + 1 || started.elapsed() > Duration::from_secs(20) {
            break;
        }
    }
    let mut points = Vec::new();
    let rate = (args.rate_mpps > 0.0).then_some(args.rate_mpps * 1e6);
    for (k, &size) in args.sizes.iter().enumerate() {
        let frames = Frames::new(size);
        let cpu0 = crate::process_cpu_seconds(switch.pid()).unwrap_or(0.0);
        let tag = k as u16 + 1;
        let r = tester::trial(&mut tx, &mut rx, &frames, rate, args.seconds, tag, false);
        let cpu = crate::process_cpu_seconds(switch.pid()).unwrap_or(0.0) - cpu0;
        points.push(Point {
            mpps: r.received as f64 / r.seconds / 1e6,
            ns_per_packet: cpu / r.received.max(1) as f64 * 1e9,
            lost: r.sent.saturating_sub(r.received),
            reordered: r.reordered,
            paths: counter(d, "sw", "direct_channels"),
            handover_us: counter(d, "sw", "direct_handover_ns") as f64 / 1e3,
        });
    }
    drop(guests);
    drop(switch);
    Ok(points)
}

pub fn run(args: Vm2vmArgs) -> Result<()> {
    let chains = crate::nf_scale::function_counts(&args.vms, "1,2,4")?;
    println!(
        "vm2vm: chains of testpmd guests (io forwarding) between the tester's two vhost-user ports through Stitch's switch; {} s per figure at {}",
        args.seconds,
        match args.rate_mpps {
            r if r > 0.0 => format!("{r} Mpps offered"),
            _ => "the rate the tester's port takes".into(),
        }
    );
    println!(
        "{:>3} {:>9} {:>6} {:>9} {:>13} {:>8} {:>10} {:>6} {:>12}",
        "VMs",
        "paths",
        "bytes",
        "Mpps",
        "switch ns/pkt",
        "lost",
        "reordered",
        "direct",
        "switch-over µs"
    );
    for n in chains {
        anyhow::ensure!(n >= 1, "--vms values must be at least 1");
        let (mut mpps, mut cpu) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        for (k, direct) in [false, true].into_iter().enumerate() {
            let points = measure(n, direct, &args)?;
            for (size, p) in args.sizes.iter().zip(&points) {
                println!(
                    "{:>3} {:>9} {:>6} {:>9.3} {:>13.0} {:>8} {:>10} {:>6} {:>12.0}",
                    n,
                    if direct { "direct" } else { "switched" },
                    size.to_string(),
                    p.mpps,
                    p.ns_per_packet,
                    p.lost,
                    p.reordered,
                    p.paths,
                    p.handover_us
                );
            }
            mpps[k] = points.iter().map(|p| p.mpps).collect();
            cpu[k] = points.iter().map(|p| p.ns_per_packet).collect();
        }
        for (i, size) in args.sizes.iter().enumerate() {
            println!(
                "{n:>3} VMs, {size} B: direct / switched, delivered {:.2}, the switch's CPU per packet {:.2}",
                mpps[1][i] / mpps[0][i].max(1e-9),
                cpu[1][i] / cpu[0][i].max(1e-9)
            );
        }
    }
    Ok(())
}
