//! `stitch bench linux-cp`: a router following a kernel routing table while a full table is
//! written into it — how soon Stitch forwards by every route beside the kernel itself taking
//! them, and the forwarding rate during that churn and after, against the same router with the
//! same routes in its configuration, measured in the same run by the same loop.
//!
//! The routes go into a network namespace of the benchmark's own by `ip -force -batch` (one
//! netlink request per route, as a daemon writes them); a `kernel_routes` app in that namespace
//! feeds the router's `kernel` input, and the router compiles its forwarding table on its own
//! thread. The measuring thread plays the worker: it moves the kernel's messages, feeds 64-byte
//! frames to destinations spread over the table, frees what the router sends, and ticks it
//! every millisecond; its CPU time is the worker's, the builder thread's is reported beside.

use anyhow::{Context, Result};
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use stitch_apps::router::Router;
use stitch_core::app::DynApp;
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pool, App, AppContext, Io};
use stitch_io::kernel_routes::KernelRoutes;

#[derive(clap::Args)]
pub struct LinuxCpArgs {
    /// Routes written into the kernel table (random prefixes /16–/28 over 16 gateways).
    #[arg(long, default_value_t = 1_000_000)]
    pub routes: usize,
    /// Seconds of forwarding measured with the static table, and after the churn.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
}

const LAN_MAC: [u8; 6] = [2, 0, 0, 0, 1, 1];
const WAN_MAC: [u8; 6] = [2, 0, 0, 0, 2, 1];
const HOST: [u8; 6] = [2, 0, 0, 0, 1, 2];
const GATEWAYS: u8 = 16;
const BATCH: usize = 256;

/// The namespace of the run, removed at the end.
struct Namespace(String);

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn ip(args: &[&str]) -> Result<()> {
    let st = Command::new("ip").args(args).status()?;
    anyhow::ensure!(st.success(), "ip {} failed", args.join(" "));
    Ok(())
}

/// `n` distinct random prefixes, `(network, length)`, and one destination inside every 256th.
fn prefixes(n: usize) -> (Vec<(u32, u32)>, Vec<u32>) {
    let mut rng = fastrand::Rng::with_seed(0x05ee_d1c9);
    let mut seen = std::collections::HashSet::with_capacity(n);
    let (mut out, mut dsts) = (Vec::with_capacity(n), Vec::new());
    while out.len() < n {
        let len = 16 + rng.u32(..13);
        let net = (rng.u32(..) | 0x0100_0000) & (u32::MAX << (32 - len));
        if seen.insert((net, len)) {
            if out.len() % 256 == 0 {
                dsts.push(net | (rng.u32(..) & !(u32::MAX << (32 - len))));
            }
            out.push((net, len));
        }
    }
    (out, dsts)
}

fn gateway(i: usize) -> String {
    format!("192.0.2.{}", 10 + i % GATEWAYS as usize)
}

fn prefix_text(net: u32, len: u32) -> String {
    format!("{}/{len}", std::net::Ipv4Addr::from(net))
}

fn ctx() -> AppContext {
    AppContext::new("r", std::path::Path::new("."), Default::default())
}

fn router(cfg: serde_json::Value) -> Result<Box<dyn DynApp>> {
    let c: <Router as App>::Config = serde_json::from_value(cfg)?;
    Router::declare(&c).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Box::new(
        Router::new(c, &mut ctx()).map_err(|e| anyhow::anyhow!("{e}"))?,
    ))
}

fn interfaces() -> serde_json::Value {
    json!({ "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24" },
            "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24" } })
}

/// The router's ports: `lan`, `wan` (and `kernel`, fed by the returned producer when given).
struct Ports {
    feeds: Vec<Producer>,
    drains: Vec<Consumer>,
    io: Io,
}

fn ports(kernel: Option<Consumer>) -> Ports {
    let (mut feeds, mut ins, mut drains, mut outs) = (vec![], vec![], vec![], vec![]);
    for n in ["lan", "wan"] {
        let (tx, rx) = link(4096);
        feeds.push(tx);
        ins.push((n.to_string(), rx));
        let (tx, rx) = link(4096);
        drains.push(rx);
        outs.push((n.to_string(), tx));
    }
    if let Some(k) = kernel {
        ins.push(("kernel".to_string(), k));
    }
    Ports {
        feeds,
        drains,
        io: Io::new(ins, outs),
    }
}

/// Every gateway's ARP answer, so that forwarding never waits.
fn resolve_gateways(r: &mut dyn DynApp, p: &mut Ports) {
    for gw in 10..10 + GATEWAYS {
        let mac = [2, 0, 0, 0, 2, gw];
        let mut arp = vec![0u8; 60];
        arp[0..6].copy_from_slice(&WAN_MAC);
        arp[6..12].copy_from_slice(&mac);
        arp[12..22].copy_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 2]);
        arp[22..28].copy_from_slice(&mac);
        arp[28..32].copy_from_slice(&[192, 0, 2, gw]);
        arp[32..38].copy_from_slice(&WAN_MAC);
        arp[38..42].copy_from_slice(&[192, 0, 2, 2]);
        let mut pkt = pool::alloc().expect("pool");
        let _ = pkt.set_data(&arp);
        p.feeds[1].transmit(pkt);
        r.push(&mut p.io);
    }
    for d in p.drains.iter_mut() {
        d.drain().for_each(drop);
    }
}

/// Frames fed and forwarded, and the measuring thread's CPU seconds, over one window; `side`
/// runs between batches (the kernel's messages moved, the router ticked).
fn forward(
    r: &mut dyn DynApp,
    p: &mut Ports,
    templates: &[Vec<u8>],
    window: Duration,
    mut side: impl FnMut(&mut dyn DynApp, &mut Io),
) -> (u64, u64, f64) {
    let (mut next, mut fed, mut out) = (0usize, 0u64, 0u64);
    let deadline = Instant::now() + window;
    let c0 = crate::thread_cpu_seconds();
    let mut tick = Instant::now();
    while Instant::now() < deadline {
        for _ in 0..16 {
            fed += p.feeds[0].transmit_fresh(BATCH, 64, |pk| {
                // SAFETY: `transmit_fresh` hands fresh packets; templates are 60-byte frames.
                unsafe { pk.set_fresh_data(&templates[next]) };
                next = (next + 1) % templates.len();
            }) as u64;
            r.push(&mut p.io);
            for d in p.drains.iter_mut() {
                out += d.free_available().0;
            }
        }
        side(r, &mut p.io);
        let now = Instant::now();
        if now >= tick + Duration::from_millis(1) {
            tick = now;
            r.tick(&mut p.io, now);
        }
    }
    (fed, out, crate::thread_cpu_seconds() - c0)
}

/// The builder thread's id (named after the router app, `r-fib`).
fn builder_tid() -> Option<libc::pid_t> {
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .find_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            (comm.trim() == "r-fib").then(|| t.file_name().to_str()?.parse().ok())?
        })
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (status.lines())
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Frames per CPU second of the worker with the routes in the router's configuration.
fn static_rate(routes: &[(u32, u32)], templates: &[Vec<u8>], window: Duration) -> Result<f64> {
    let built = Instant::now();
    let config_routes: Vec<_> = (routes.iter().enumerate())
        .map(|(i, &(net, len))| json!({ "prefix": prefix_text(net, len), "via": gateway(i) }))
        .collect();
    let mut fixed = router(json!({ "interfaces": interfaces(), "routes": config_routes }))?;
    let mut p = ports(None);
    resolve_gateways(fixed.as_mut(), &mut p);
    let (fed, out, cpu) = forward(fixed.as_mut(), &mut p, templates, window, |_, _| {});
    let static_mpps = fed as f64 / cpu / 1e6;
    println!(
        "static table (configured, built in {:.1} s): {static_mpps:.2} Mpps per core of the worker ({:.1}% forwarded)",
        built.elapsed().as_secs_f64(),
        100.0 * out as f64 / fed.max(1) as f64
    );

    Ok(static_mpps)
}

/// The benchmark's namespace (a link whose subnet holds the gateways) and the `ip -batch`
/// file that writes `routes` into its main table.
fn namespace_and_batch(routes: &[(u32, u32)]) -> Result<(Namespace, tempfile::NamedTempFile)> {
    let n = routes.len();
    let ns = Namespace(format!("stitch-bench-lcp-{}", std::process::id()));
    ip(&["netns", "add", &ns.0])?;
    ip(&[
        "-n", &ns.0, "link", "add", "d0", "type", "veth", "peer", "name", "d1",
    ])?;
    ip(&["-n", &ns.0, "link", "set", "d0", "up"])?;
    ip(&["-n", &ns.0, "link", "set", "d1", "up"])?;
    ip(&["-n", &ns.0, "addr", "add", "192.0.2.2/24", "dev", "d0"])?;
    let batch = tempfile::NamedTempFile::new()?;
    let mut text = String::with_capacity(n * 48);
    for (i, &(net, len)) in routes.iter().enumerate() {
        text += &format!("route add {} via {}\n", prefix_text(net, len), gateway(i));
    }
    std::fs::write(batch.path(), text)?;
    Ok((ns, batch))
}

/// The writer's end and the moment the kernel had every route.
type Writer = (
    std::thread::JoinHandle<std::io::Result<std::process::ExitStatus>>,
    std::sync::Arc<std::sync::Mutex<Option<Duration>>>,
);

/// Writes the routes of `batch` into `ns`'s table, from `t0`: the writer's end, and when the
/// kernel had them all, to the moment (a thread waits for the writer).
fn write_routes(ns: &Namespace, batch: &std::path::Path, t0: Instant) -> Result<Writer> {
    let mut writer = Command::new("ip")
        .args(["-n", &ns.0, "-force", "-batch"])
        .arg(batch)
        .stdout(Stdio::null())
        .spawn()
        .context("ip -batch")?;
    let written = std::sync::Arc::new(std::sync::Mutex::new(None));
    let waiter = {
        let written = written.clone();
        std::thread::spawn(move || {
            let status = writer.wait();
            *written.lock().unwrap() = Some(t0.elapsed());
            status
        })
    };
    Ok((waiter, written))
}

/// The time a new `kernel_routes` and router take from start to forwarding by every one of
/// the `n` routes already in `ns`'s table (Stitch's own programming rate, the kernel's writer
/// out of the way), forwarding all along.
fn follow_from_dump(ns: &Namespace, n: usize, templates: &[Vec<u8>]) -> Result<Duration> {
    let t0 = Instant::now();
    let kr_cfg = serde_json::from_value(json!({ "namespace": ns.0 }))?;
    let mut kr: Box<dyn DynApp> =
        Box::new(KernelRoutes::new(kr_cfg, &mut ctx()).map_err(|e| anyhow::anyhow!("{e}"))?);
    let (kernel_tx, kernel_rx) = link(4096);
    let mut kr_io = Io::new(vec![], vec![("output".to_string(), kernel_tx)]);
    let mut r = router(json!({ "interfaces": interfaces(), "kernel_table": 254 }))?;
    let mut p = ports(Some(kernel_rx));
    resolve_gateways(r.as_mut(), &mut p);
    while t0.elapsed() < Duration::from_secs(120) {
        forward(
            r.as_mut(),
            &mut p,
            templates,
            Duration::from_millis(10),
            |_, _| kr.pull(&mut kr_io),
        );
        let view = r.query(&json!({ "limit": 0 }))["kernel"].clone();
        if view["routes"].as_u64().unwrap_or(0) as usize >= n && view["pending"] == false {
            return Ok(t0.elapsed());
        }
    }
    anyhow::bail!("a new router did not follow the table in 120 s")
}

pub fn run(args: LinuxCpArgs) -> Result<()> {
    anyhow::ensure!(args.routes >= 1, "--routes must be at least 1");
    let n = args.routes;
    let (routes, dsts) = prefixes(n);
    let templates: Vec<Vec<u8>> = (dsts.iter())
        .map(|d| crate::nf::udp_frame(LAN_MAC, HOST, [10, 0, 1, 2], 1000, d.to_be_bytes(), 53))
        .collect();
    println!(
        "linux-cp: {n} random IPv4 prefixes /16–/28 over {GATEWAYS} gateways, 64-byte frames to {} destinations among them",
        templates.len()
    );

    let window = Duration::from_secs_f64(args.seconds);
    let static_mpps = static_rate(&routes, &templates, window)?;
    // The kernel's table, written while the router follows it.
    let (ns, batch) = namespace_and_batch(&routes)?;
    let rss0 = rss_bytes();
    let kr_cfg = serde_json::from_value(json!({ "namespace": ns.0 }))?;
    let mut kr: Box<dyn DynApp> =
        Box::new(KernelRoutes::new(kr_cfg, &mut ctx()).map_err(|e| anyhow::anyhow!("{e}"))?);
    let (kernel_tx, kernel_rx) = link(4096);
    let mut kr_io = Io::new(vec![], vec![("output".to_string(), kernel_tx)]);
    let mut follower = router(json!({ "interfaces": interfaces(), "kernel_table": 254 }))?;
    let mut p = ports(Some(kernel_rx));
    resolve_gateways(follower.as_mut(), &mut p);
    let t0 = Instant::now();
    let (waiter, written) = write_routes(&ns, batch.path(), t0)?;
    println!(
        "{:>6} {:>14} {:>16} {:>12}",
        "t (s)", "Stitch routes", "worker Mpps/core", "forwarded %"
    );
    let (mut kernel_done, mut all_at) = (None, None);
    let (mut churn_fed, mut churn_cpu) = (0u64, 0.0);
    let builder = builder_tid();
    let builder_cpu0 = builder.map_or(0.0, crate::cpu_seconds_of_thread);
    let mut windows = 0u64;
    while all_at.is_none() && t0.elapsed() < Duration::from_secs(600) {
        let (fed, out, cpu) = forward(
            follower.as_mut(),
            &mut p,
            &templates,
            Duration::from_millis(50),
            |_, _| kr.pull(&mut kr_io),
        );
        windows += 1;
        kernel_done = *written.lock().unwrap();
        let view = follower.query(&json!({ "limit": 0 }))["kernel"].clone();
        let followed = view["routes"].as_u64().unwrap_or(0) as usize;
        if kernel_done.is_none() || followed < n || view["pending"] != false {
            churn_fed += fed;
            churn_cpu += cpu;
        } else {
            all_at = Some(t0.elapsed());
        }
        if !windows.is_multiple_of(20) && all_at.is_none() {
            continue;
        }
        println!(
            "{:>6.2} {followed:>14} {:>16.2} {:>12.1}",
            t0.elapsed().as_secs_f64(),
            fed as f64 / cpu / 1e6,
            100.0 * out as f64 / fed.max(1) as f64
        );
    }
    let kernel_done = kernel_done.context("ip -batch did not finish in 600 s")?;
    let all_at = all_at.context("Stitch did not follow every route in 600 s")?;
    let builder_cpu = builder.map_or(0.0, crate::cpu_seconds_of_thread) - builder_cpu0;
    let (fed, out, cpu) = forward(follower.as_mut(), &mut p, &templates, window, |_, _| {
        kr.pull(&mut kr_io)
    });
    let after = fed as f64 / cpu / 1e6;
    let churn = churn_fed as f64 / churn_cpu.max(1e-9) / 1e6;
    println!(
        "the kernel took {n} routes in {:.1} s ({:.0} routes/s, ip -batch); Stitch forwarded by all of them at {:.1} s ({:.0} routes/s)",
        kernel_done.as_secs_f64(),
        n as f64 / kernel_done.as_secs_f64(),
        all_at.as_secs_f64(),
        n as f64 / all_at.as_secs_f64()
    );
    println!(
        "forwarding: static {static_mpps:.2}, during the churn {churn:.2} ({:.2}×), after {after:.2} ({:.2}×) Mpps per core of the worker ({:.1}% forwarded after)",
        churn / static_mpps,
        after / static_mpps,
        100.0 * out as f64 / fed.max(1) as f64
    );
    println!(
        "builder thread: {builder_cpu:.2} CPU s for the churn; memory: {:.0} bytes per route (resident growth)",
        rss_bytes().saturating_sub(rss0) as f64 / n as f64
    );
    drop((follower, kr));
    println!(
        "a new router given the whole table by a dump (as after a restart or an upgrade): {:.2} s",
        follow_from_dump(&ns, n, &templates)?.as_secs_f64()
    );
    let status = waiter
        .join()
        .map_err(|_| anyhow::anyhow!("the waiting thread panicked"))??;
    if !status.success() {
        println!("note: ip -batch reported errors (some routes refused): {status}");
    }
    Ok(())
}
