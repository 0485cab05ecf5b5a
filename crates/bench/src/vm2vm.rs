//! `stitch bench vm2vm`: the inter-VNF bypass's own case (docs/references.md) — VMs chained through
//! the OpenFlow switch. N guests (`dpdk-testpmd` virtio-user front-ends in io forwarding, two ports
//! each, as `stitch bench vhost` uses them) in a chain between the tester's two ports (Stitch's
//! virtio-net driver, [`crate::rfc2544::tester`]) through one `switch`: tester → VM 1 → … → VM N →
//! tester, every hop a flow `in_port=X,actions=output:Y`. Each chain runs three ways in the same
//! run: with direct paths (each sending port's worker copies guest to guest), with `direct_paths:
//! false` (the switch carries every packet), and through Open vSwitch's DPDK datapath
//! (`dpdkvhostuserclient` ports, the guests' virtio-user ports in server mode, the same flows).
//! Both switches sleep when idle (Stitch's worker up to 100 µs, its default; Open vSwitch's PMD as
//! long, `pmd-maxsleep`). Figures: what arrived (Mpps), the switch process's CPU time per delivered
//! packet, the paths' switch-over time, and frames lost or reordered; then one trial while a flow
//! of the chain's first hop is changed under traffic and back (hand-back and switch-over under
//! load).

use crate::rfc2544::duts::{accept, add_flows, start_ovs, OvsRunning};
use crate::rfc2544::tester::{self, FrameSize, Frames};
use crate::vhost::{stitch_process, testpmd, Proc};
use anyhow::{Context, Result};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Stdio};
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
    /// How the chains are switched, comma-separated: `switched` (Stitch's switch carries every
    /// frame), `direct` (direct paths between VM ports), `ovs-dpdk`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "switched,direct,ovs-dpdk"
    )]
    pub ways: Vec<Switching>,
}

/// The switch between the tester's ports `a` (1) and `b` (2) and each VM's ports `vIa`
/// (2I + 1) and `vIb` (2I + 2), on one worker that sleeps when idle.
fn graph(dir: &Path, vms: usize, port: u16, direct: bool) -> String {
    let ports = port_names(vms);
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

/// The switch's ports in OpenFlow order: the tester's `a` and `b`, then each VM's two.
fn port_names(vms: usize) -> Vec<String> {
    let mut ports = vec!["a".to_string(), "b".to_string()];
    for i in 1..=vms {
        ports.push(format!("v{i}a"));
        ports.push(format!("v{i}b"));
    }
    ports
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

/// How the chain is switched.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switching {
    /// Stitch's switch with `direct_paths: false`.
    Switched,
    /// Stitch's switch giving each hop a direct path.
    Direct,
    /// Open vSwitch's DPDK datapath.
    #[value(name = "ovs-dpdk")]
    Ovs,
}

impl Switching {
    fn label(self) -> &'static str {
        match self {
            Switching::Switched => "switched",
            Switching::Direct => "direct",
            Switching::Ovs => "ovs-dpdk",
        }
    }
}

struct Point {
    mpps: f64,
    ns_per_packet: f64,
    lost: u64,
    reordered: u64,
    paths: u64,
    handover_us: f64,
}

/// The trial during which the first hop's flow changes and changes back.
struct Flip {
    lost: u64,
    reordered: u64,
    handback_us: f64,
    handover_us: f64,
}

/// The switch of a chain, running.
enum Switch {
    Stitch(Proc),
    Ovs(OvsRunning),
}

impl Switch {
    /// The switch's process: its CPU time is what it spent (both sleep when idle).
    fn pid(&self) -> u32 {
        match self {
            Switch::Stitch(p) => p.pid(),
            Switch::Ovs(o) => o.pid(),
        }
    }
}

/// `dpdk-testpmd` as VM `i` of a chain (io forwarding between its ports `vIa` and `vIb`),
/// on CPU `i % 2`; its virtio-user ports listen when `server` (for a switch that connects).
fn guest(dir: &Path, i: usize, server: bool) -> Result<Proc> {
    let prefix = format!("sbvm{}x{i}", std::process::id());
    let vdevs: Vec<String> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(k, s)| {
            format!(
                "net_virtio_user{k},path={}/v{i}{s}.sock{}",
                dir.display(),
                if server { ",server=1" } else { "" }
            )
        })
        .collect();
    let child = testpmd(&prefix, i % 2, &vdevs, &["--stats-period", "10"], None)?
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting dpdk-testpmd")?;
    Ok(Proc::of(child))
}

/// A chain running: its switch, guests and the tester's two ports.
struct Chain {
    switch: Switch,
    /// The switch's OpenFlow endpoint (Stitch's; Open vSwitch's is only used to add flows).
    of_port: u16,
    _guests: Vec<Proc>,
    tx: Frontend,
    rx: Frontend,
    dir: tempfile::TempDir,
}

impl Chain {
    fn start(vms: usize, how: Switching) -> Result<Chain> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let mut guests = Vec::new();
        let (switch, of_port, tx, rx) = if how == Switching::Ovs {
            let listen = |name: &str| UnixListener::bind(d.join(name));
            let (a, b) = (listen("a.sock")?, listen("b.sock")?);
            for i in 1..=vms {
                guests.push(guest(d, i, true)?);
            }
            let names = port_names(vms);
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            // Its PMD sleeps when idle as Stitch's worker does here (up to 100 µs, Stitch's
            // default): a core polled all the time is one the guests lack.
            let ovs = start_ovs(d, &names, &flows(vms), 100)?;
            let (tx, rx) = (accept(&a, "a")?, accept(&b, "b")?);
            (Switch::Ovs(ovs), 0, tx, rx)
        } else {
            let port = crate::free_port()?;
            let file = d.join("vm2vm.yaml");
            std::fs::write(&file, graph(d, vms, port, how == Switching::Direct))?;
            let switch = stitch_process(d, &file)?;
            add_flows(port, &flows(vms), d)?;
            for i in 1..=vms {
                guests.push(guest(d, i, false)?);
            }
            let connect = |name: &str| {
                Frontend::connect(&d.join(name), 1024, Duration::from_secs(10))
                    .with_context(|| format!("the tester's port {name}"))
            };
            let (tx, rx) = (connect("a.sock")?, connect("b.sock")?);
            (Switch::Stitch(switch), port, tx, rx)
        };
        Ok(Chain {
            switch,
            of_port,
            _guests: guests,
            tx,
            rx,
            dir,
        })
    }

    fn counter(&self, name: &str) -> u64 {
        match self.switch {
            Switch::Stitch(_) => counter(self.dir.path(), "sw", name),
            Switch::Ovs(_) => 0,
        }
    }

    /// Short trials until the chain carries every frame of one — the guests forward (a path
    /// can be direct before its guest has given its ring buffers: what is sent then waits in
    /// the sender's ring) — and, with direct paths, every hop has its own (20 s at most).
    fn warm_up(&mut self, vms: usize, how: Switching) {
        let started = Instant::now();
        let frames = Frames::new(FrameSize::Fixed(64));
        loop {
            let r = tester::trial(
                &mut self.tx,
                &mut self.rx,
                &frames,
                Some(10_000.0),
                0.1,
                0,
                false,
            );
            let ready = r.received > 0
                && r.received == r.sent
                && (how != Switching::Direct || self.counter("direct_channels") == vms as u64 + 1);
            if ready || started.elapsed() > Duration::from_secs(20) {
                return;
            }
        }
    }

    fn point(&mut self, size: FrameSize, tag: u16, args: &Vm2vmArgs) -> Point {
        let frames = Frames::new(size);
        let rate = (args.rate_mpps > 0.0).then_some(args.rate_mpps * 1e6);
        let cpu0 = crate::process_cpu_seconds(self.switch.pid()).unwrap_or(0.0);
        let r = tester::trial(
            &mut self.tx,
            &mut self.rx,
            &frames,
            rate,
            args.seconds,
            tag,
            false,
        );
        let cpu = crate::process_cpu_seconds(self.switch.pid()).unwrap_or(0.0) - cpu0;
        Point {
            mpps: r.received as f64 / r.seconds / 1e6,
            ns_per_packet: cpu / r.received.max(1) as f64 * 1e9,
            lost: r.sent.saturating_sub(r.received),
            reordered: r.reordered,
            paths: self.counter("direct_channels"),
            handover_us: self.counter("direct_handover_ns") as f64 / 1e3,
        }
    }

    /// A trial at the run's rate (64 B) during which a second flow is put on the first hop —
    /// UDP only, at a higher priority, to the same port: the hop is no longer one port's
    /// everything to another's, so its path is handed back — and taken away again a second
    /// later (the path comes back).
    fn flip(&mut self, tag: u16, args: &Vm2vmArgs) -> Result<Flip> {
        let target = match self.switch {
            Switch::Stitch(_) => format!("tcp:127.0.0.1:{}", self.of_port),
            Switch::Ovs(ref o) => o.openflow_target(),
        };
        // Above the chain's flows (ovs-ofctl's default priority, 32768).
        let rule = "priority=40000,in_port=1,udp";
        let ofctl = move |args: &[&str]| {
            Command::new("ovs-ofctl")
                .args(["-O", "OpenFlow13"])
                .args(args)
                .output()
                .map(|o| o.status.success())
        };
        let frames = Frames::new(FrameSize::Fixed(64));
        let rate = (args.rate_mpps > 0.0).then_some(args.rate_mpps * 1e6);
        let seconds = args.seconds.max(3.0);
        let changes = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs_f64(seconds / 3.0));
            let added = ofctl(&["add-flow", &target, &format!("{rule},actions=output:3")]);

            std::thread::sleep(Duration::from_secs_f64(seconds / 3.0));
            let deleted = ofctl(&["--strict", "del-flows", &target, rule]);
            matches!((added, deleted), (Ok(true), Ok(true)))
        });
        let r = tester::trial(
            &mut self.tx,
            &mut self.rx,
            &frames,
            rate,
            seconds,
            tag,
            false,
        );
        anyhow::ensure!(
            changes.join().unwrap_or(false),
            "ovs-ofctl could not change the first hop's flow"
        );
        Ok(Flip {
            lost: r.sent.saturating_sub(r.received),
            reordered: r.reordered,
            handback_us: self.counter("direct_handback_ns") as f64 / 1e3,
            handover_us: self.counter("direct_handover_ns") as f64 / 1e3,
        })
    }
}

/// One chain, measured: a point per frame size, then the flip.
fn measure(vms: usize, how: Switching, args: &Vm2vmArgs) -> Result<(Vec<Point>, Flip)> {
    let mut chain = Chain::start(vms, how)?;
    chain.warm_up(vms, how);
    let points = (args.sizes.iter().enumerate())
        .map(|(k, &size)| chain.point(size, k as u16 + 1, args))
        .collect();
    let flip = chain.flip(args.sizes.len() as u16 + 1, args)?;
    Ok((points, flip))
}

pub fn run(args: Vm2vmArgs) -> Result<()> {
    let chains = crate::nf_scale::function_counts(&args.vms, "1,2,4")?;
    println!(
        "vm2vm: chains of testpmd guests (io forwarding) between the tester's two vhost-user ports through Stitch's switch (switched, direct) and Open vSwitch's DPDK datapath; {} s per figure at {}",
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
    let ways = args.ways.clone();
    for n in chains {
        anyhow::ensure!(n >= 1, "--vms values must be at least 1");
        let mut results = Vec::new();
        for &how in &ways {
            let (points, flip) = measure(n, how, &args)?;
            for (size, p) in args.sizes.iter().zip(&points) {
                println!(
                    "{:>3} {:>9} {:>6} {:>9.3} {:>13.0} {:>8} {:>10} {:>6} {:>12.0}",
                    n,
                    how.label(),
                    size.to_string(),
                    p.mpps,
                    p.ns_per_packet,
                    p.lost,
                    p.reordered,
                    p.paths,
                    p.handover_us
                );
            }
            results.push((points, flip));
        }
        for (how, (_, flip)) in ways.iter().zip(&results) {
            print!(
                "{n:>3} VMs, {}: the first hop's flow changed and back under traffic: {} lost, {} reordered",
                how.label(),
                flip.lost,
                flip.reordered
            );
            if *how == Switching::Direct {
                print!(
                    "; hand-back {:.1} µs, switch-over {:.1} µs",
                    flip.handback_us, flip.handover_us
                );
            }
            println!();
        }
        let ratio = |a: f64, b: f64| a / b.max(1e-9);
        let of = |w: Switching| ways.iter().position(|&x| x == w).map(|k| &results[k].0);
        let Some(direct) = of(Switching::Direct) else {
            continue;
        };
        for other in [Switching::Switched, Switching::Ovs] {
            let Some(them) = of(other) else { continue };
            for (i, size) in args.sizes.iter().enumerate() {
                println!(
                    "{n:>3} VMs, {size} B, direct / {}: delivered {:.2}, the switch's CPU per packet {:.2}",
                    other.label(),
                    ratio(direct[i].mpps, them[i].mpps),
                    ratio(direct[i].ns_per_packet, them[i].ns_per_packet),
                );
            }
        }
    }
    Ok(())
}
