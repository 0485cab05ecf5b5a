//! `stitch bench kernel`: InKeV's evaluation (docs/references.md) on this machine. Two hosts
//! (namespaces) on either end of a chain of N routers, each pair of routers joined by a bridge
//! (bridge–router– bridge…), built four ways and measured in the same run:
//!
//! - `kernel`: Stitch's in-kernel data plane (`placement: kernel`),
//! - `linux`: Linux router namespaces joined by Linux bridges,
//! - `ovs`: router namespaces joined by Open vSwitch bridges in its userspace datapath (the
//!   seed's reference: OpenStack's Open vSwitch with router namespaces),
//! - `userspace`: Stitch's userspace engine running the same graph file,
//! - `kernel-tapped` (on request): the kernel data plane with every link tapped by one capture
//!   session whose reader formats each record as PCAPNG (and throws it away) — what a capture
//!   costs the links it watches.
//!
//! Measured: UDP request/response round trips per second with median and p99 latency, TCP
//! connection setups per second (connect, 1-byte request, 1-byte response, close), and iperf3
//! TCP throughput. Client and server run inside the host namespaces as threads of this process
//! (setns), so no interpreter or process start sits in the measured path.

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_io::capture_format::{append_record, Direction, Format, RecordMeta};

#[derive(clap::Args)]
pub struct KernelBenchArgs {
    /// Chain lengths (routers between the two hosts).
    #[arg(long, value_delimiter = ',', default_value = "1,3,5,10")]
    pub chains: Vec<usize>,
    /// Which data planes to measure (also `kernel-tapped`, `userspace-packet`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kernel,linux,ovs,userspace"
    )]
    pub contenders: Vec<String>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Print the results as JSON too.
    #[arg(long)]
    pub json: bool,
    /// Round trips with client and server spinning on non-blocking sockets instead of
    /// sleeping in recv: measures the path without the wake-ups (needs both cores, so the
    /// userspace engine starves under it).
    #[arg(long)]
    pub spin: bool,
}

pub(crate) fn sh(cmd: &str) -> Result<String> {
    let o = Command::new("sh").arg("-c").arg(cmd).output()?;
    if !o.status.success() {
        bail!(
            "`{cmd}` failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

pub(crate) fn quiet(cmd: &str) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!("{cmd} >/dev/null 2>&1"))
        .status();
}

/// Runs `f` on a thread inside network namespace `ns`.
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<Result<T>> {
    let path = PathBuf::from("/run/netns").join(ns);
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: a namespace file descriptor; only this thread changes namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        Ok(f())
    })
}

/// Subnet i is 10.50.i.0/24. Host A is 10.50.0.1, host B 10.50.N.1; router j has
/// 10.50.(j-1).254 on its left and 10.50.j.253 on its right.
struct Chain {
    tag: String,
    n: usize,
    hosts: [String; 2],
    outer: [String; 2],
}

impl Chain {
    fn new(tag: &str, n: usize) -> Result<Chain> {
        let c = Chain {
            tag: tag.to_string(),
            n,
            hosts: [format!("{tag}hA"), format!("{tag}hB")],
            outer: [format!("{tag}oA"), format!("{tag}oB")],
        };
        for (i, subnet) in [(0, 0), (1, n)] {
            let (ns, outer) = (&c.hosts[i], &c.outer[i]);
            sh(&format!("ip netns add {ns}"))?;
            sh(&format!(
                "ip link add {outer} type veth peer name eth0 netns {ns}"
            ))?;
            sh(&format!("ip link set {outer} up"))?;
            quiet(&format!("sysctl -qw net.ipv6.conf.{outer}.disable_ipv6=1"));
            sh(&format!("ip -n {ns} link set lo up"))?;
            sh(&format!("ip netns exec {ns} sysctl -qw net.ipv6.conf.eth0.disable_ipv6=1 net.ipv4.tcp_tw_reuse=1"))?;
            sh(&format!("ip -n {ns} addr add 10.50.{subnet}.1/24 dev eth0"))?;
            sh(&format!("ip -n {ns} link set eth0 up"))?;
            let gw = if i == 0 {
                "10.50.0.254".to_string()
            } else {
                format!("10.50.{n}.253")
            };
            sh(&format!("ip -n {ns} route add default via {gw}"))?;
        }
        Ok(c)
    }

    fn b_addr(&self) -> String {
        format!("10.50.{}.1", self.n)
    }

    /// Static routes of router j (1-based) toward every subnet it is not on.
    fn routes(&self, j: usize) -> Vec<(String, String)> {
        (0..=self.n)
            .filter(|&k| k + 1 != j && k != j)
            .map(|k| {
                let via = if k > j {
                    format!("10.50.{j}.254")
                } else {
                    format!("10.50.{}.253", j - 1)
                };
                (format!("10.50.{k}.0/24"), via)
            })
            .collect()
    }

    /// The graph file: A and B, bridges br0..brN, routers r1..rN.
    /// `io` is the interface app type (af_packet or af_xdp).
    fn graph(&self, kernel: bool, io: &str) -> String {
        let n = self.n;
        let mut g = String::new();
        if kernel {
            g += "placement: kernel\n";
        }
        g += &format!(
            "apps:\n  a: {{ type: {io}, interface: {} }}\n  b: {{ type: {io}, interface: {} }}\n",
            self.outer[0], self.outer[1]
        );
        for i in 0..=n {
            let (l, r) = match i {
                0 => ("host".to_string(), "r1".to_string()),
                i if i == n => (format!("r{n}"), "host".to_string()),
                i => (format!("r{i}"), format!("r{}", i + 1)),
            };
            g += &format!("  br{i}: {{ type: bridge, ports: {{ {l}: {{}}, {r}: {{}} }} }}\n");
        }
        for j in 1..=n {
            let routes: Vec<String> = self
                .routes(j)
                .iter()
                .map(|(p, via)| format!("{{ prefix: \"{p}\", via: {via} }}"))
                .collect();
            g += &format!(
                "  r{j}: {{ type: router, interfaces: {{ left: {{ mac: \"02:00:00:00:{j:02x}:01\", address: \"10.50.{}.254/24\" }}, right: {{ mac: \"02:00:00:00:{j:02x}:02\", address: \"10.50.{j}.253/24\" }} }}, routes: [{}] }}\n",
                j - 1,
                routes.join(", ")
            );
        }
        g += "links:\n  - \"a.output -> br0.host\"\n  - \"br0.host -> a.input\"\n";
        for j in 1..=n {
            for (x, y) in [
                (format!("br{}.r{j}", j - 1), format!("r{j}.left")),
                (format!("r{j}.right"), format!("br{j}.r{j}")),
            ] {
                g += &format!("  - \"{x} -> {y}\"\n  - \"{y} -> {x}\"\n");
            }
        }
        g += &format!("  - \"b.output -> br{n}.host\"\n  - \"br{n}.host -> b.input\"\n");
        g
    }

    /// Router namespaces rt1..rtN with veths left/right, the root-side ends returned per
    /// subnet (for the bridges of the `linux` and `ovs` contenders).
    fn router_namespaces(&self) -> Result<Vec<Vec<String>>> {
        let mut subnet_ports: Vec<Vec<String>> = vec![Vec::new(); self.n + 1];
        subnet_ports[0].push(self.outer[0].clone());
        subnet_ports[self.n].push(self.outer[1].clone());
        for j in 1..=self.n {
            let ns = format!("{}rt{j}", self.tag);
            sh(&format!("ip netns add {ns}"))?;
            sh(&format!("ip -n {ns} link set lo up"))?;
            sh(&format!(
                "ip netns exec {ns} sysctl -qw net.ipv4.ip_forward=1"
            ))?;
            for (side, subnet, addr) in [
                ("left", j - 1, format!("10.50.{}.254/24", j - 1)),
                ("right", j, format!("10.50.{j}.253/24")),
            ] {
                let outer = format!("{}q{j}{}", self.tag, &side[..1]);
                sh(&format!(
                    "ip link add {outer} type veth peer name {side} netns {ns}"
                ))?;
                quiet(&format!("sysctl -qw net.ipv6.conf.{outer}.disable_ipv6=1"));
                sh(&format!("ip link set {outer} up"))?;
                // The MAC addresses of the graph's routers: the hosts' ARP caches stay right
                // from one contender to the next.
                let mac = format!(
                    "02:00:00:00:{j:02x}:0{}",
                    if side == "left" { 1 } else { 2 }
                );
                sh(&format!("ip -n {ns} link set {side} address {mac}"))?;
                sh(&format!("ip -n {ns} addr add {addr} dev {side}"))?;
                sh(&format!("ip -n {ns} link set {side} up"))?;
                subnet_ports[subnet].push(outer);
            }
            for (p, via) in self.routes(j) {
                sh(&format!("ip -n {ns} route add {p} via {via}"))?;
            }
        }
        Ok(subnet_ports)
    }

    fn remove_router_namespaces(&self) {
        for j in 1..=self.n {
            quiet(&format!("ip netns del {}rt{j}", self.tag));
            for side in ["l", "r"] {
                quiet(&format!("ip link del {}q{j}{side}", self.tag));
            }
        }
    }
}

impl Drop for Chain {
    fn drop(&mut self) {
        self.remove_router_namespaces();
        for i in 0..2 {
            quiet(&format!("ip link del {}", self.outer[i]));
            quiet(&format!(
                "ip netns pids {} | xargs -r kill -9",
                self.hosts[i]
            ));
            quiet(&format!("ip netns del {}", self.hosts[i]));
        }
    }
}

#[derive(Debug, Default, Clone, serde::Serialize)]
struct Figures {
    rr_per_s: f64,
    rr_median_us: f64,
    rr_p99_us: f64,
    rr_lost: u64,
    crr_per_s: f64,
    crr_failed: u64,
    iperf_gbps: f64,
}

/// UDP request/response: one outstanding request at a time for `secs`.
fn round_trips(c: &Chain, secs: f64, spin: bool) -> Result<(f64, f64, f64, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let server_addr: SocketAddr = format!("{}:7000", c.b_addr()).parse()?;
    let s2 = stop.clone();
    let server = in_netns(&c.hosts[1], move || -> Result<()> {
        let s = UdpSocket::bind(server_addr)?;
        s.set_read_timeout(Some(Duration::from_millis(100)))?;
        s.set_nonblocking(spin)?;
        let mut buf = [0u8; 64];
        while !s2.load(Ordering::Relaxed) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                let _ = s.send_to(&buf[..n], from);
            }
        }
        Ok(())
    });
    std::thread::sleep(Duration::from_millis(200));
    let client = in_netns(&c.hosts[0], move || -> Result<(f64, f64, f64, u64)> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.connect(server_addr)?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut buf = [0u8; 64];
        // Warm up: ARP along the chain, learning in the bridges.
        let warm = Instant::now();
        loop {
            s.send(b"warmup")?;
            if s.recv(&mut buf).is_ok() {
                break;
            }
            if warm.elapsed() > Duration::from_secs(10) {
                bail!("no answer across the chain after 10 s");
            }
        }
        for _ in 0..100 {
            s.send(b"w")?;
            let _ = s.recv(&mut buf);
        }
        let mut lat = Vec::with_capacity(1 << 20);
        let mut lost = 0;
        s.set_nonblocking(spin)?;
        let start = Instant::now();
        let end = start + Duration::from_secs_f64(secs);
        while Instant::now() < end {
            let t = Instant::now();
            s.send(b"ping")?;
            loop {
                match s.recv(&mut buf) {
                    Ok(_) => lat.push(t.elapsed().as_nanos() as u64),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if t.elapsed() < Duration::from_millis(500) {
                            continue;
                        }
                        lost += 1;
                    }
                    Err(_) => lost += 1,
                }
                break;
            }
        }
        let wall = start.elapsed().as_secs_f64();
        lat.sort_unstable();
        let pick = |q: f64| {
            lat.get(((lat.len() as f64 - 1.0) * q) as usize)
                .copied()
                .unwrap_or(0) as f64
                / 1e3
        };
        Ok((lat.len() as f64 / wall, pick(0.5), pick(0.99), lost))
    });
    let r = client.join().expect("client thread");
    stop.store(true, Ordering::Relaxed);
    server.join().expect("server thread")??;
    r?
}

/// TCP connection setups: connect, 1-byte request, 1-byte response, close.
fn connection_setups(c: &Chain, secs: f64) -> Result<(f64, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let addr: SocketAddr = format!("{}:7001", c.b_addr()).parse()?;
    let s2 = stop.clone();
    let server = in_netns(&c.hosts[1], move || -> Result<()> {
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        while !s2.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(Duration::from_secs(1)))?;
                    if s.read_exact(&mut b).is_ok() {
                        let _ = s.write_all(&b);
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_micros(20)),
            }
        }
        Ok(())
    });
    std::thread::sleep(Duration::from_millis(200));
    let client = in_netns(&c.hosts[0], move || -> Result<(f64, u64)> {
        let mut b = [0u8; 1];
        let mut done = 0u64;
        let mut failed = 0u64;
        let start = Instant::now();
        let end = start + Duration::from_secs_f64(secs);
        while Instant::now() < end {
            let ok = (|| -> std::io::Result<()> {
                let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
                s.set_read_timeout(Some(Duration::from_secs(1)))?;
                s.write_all(b"x")?;
                s.read_exact(&mut b)?;
                Ok(())
            })();
            match ok {
                Ok(()) => done += 1,
                Err(_) => failed += 1,
            }
        }
        Ok((done as f64 / start.elapsed().as_secs_f64(), failed))
    });
    let r = client.join().expect("client thread");
    stop.store(true, Ordering::Relaxed);
    server.join().expect("server thread")??;
    r?
}

fn iperf(c: &Chain, secs: f64) -> Result<f64> {
    let mut server = Command::new("ip")
        .args([
            "netns",
            "exec",
            &c.hosts[1],
            "iperf3",
            "-s",
            "-1",
            "-p",
            "7002",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &c.hosts[0],
            "iperf3",
            "-c",
            &c.b_addr(),
            "-p",
            "7002",
            "-J",
        ])
        .args(["-t", &format!("{}", secs.ceil() as u64)])
        .output()?;
    let _ = server.kill();
    let _ = server.wait();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    Ok(v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0)
        / 1e9)
}

fn measure(c: &Chain, secs: f64, spin: bool) -> Result<Figures> {
    for ns in &c.hosts {
        quiet(&format!("ip -n {ns} neigh flush all"));
    }
    let (rr, med, p99, lost) = round_trips(c, secs, spin)?;
    let (crr, crr_failed) = connection_setups(c, secs)?;
    let gbps = iperf(c, secs)?;
    Ok(Figures {
        rr_per_s: rr,
        rr_median_us: med,
        rr_p99_us: p99,
        rr_lost: lost,
        crr_per_s: crr,
        crr_failed,
        iperf_gbps: gbps,
    })
}

/// One capture session on every link of a kernel data plane, read on a thread of its own.
struct TapAll {
    stop: Arc<AtomicBool>,
    reader: std::thread::JoinHandle<Result<u64>>,
}

impl TapAll {
    fn start(plane: &str) -> Result<TapAll> {
        let dp = stitch_kernel::DataPlane::new(plane)?;
        let vids: Vec<u32> = dp.tappable_links()?.iter().map(|(_, v)| *v).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let reader = std::thread::spawn(move || -> Result<u64> {
            // The tap's ring reader is not Send: it lives on this thread.
            let mut tap = match stitch_kernel::tap::KernelTap::start(&dp, &vids, 262_144) {
                Ok(t) => t,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return Ok(0);
                }
            };
            let _ = ready_tx.send(Ok(()));
            let mut out = Vec::with_capacity(1 << 20);
            let mut records = 0u64;
            while !flag.load(Ordering::Relaxed) {
                out.clear();
                tap.poll(Duration::from_millis(20), |r| {
                    let meta = RecordMeta {
                        ts_ns: r.time_ns,
                        orig_len: r.len as usize,
                        interface: 0,
                        direction: Direction::Unknown,
                    };
                    append_record(&mut out, Format::Pcapng, meta, r.data);
                    records += 1;
                })?;
            }
            Ok(records)
        });
        ready
            .recv()
            .context("the tap's reader")?
            .map_err(anyhow::Error::msg)?;
        Ok(TapAll { stop, reader })
    }

    /// Stops the reader; returns how many records it read.
    fn stop(self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.reader
            .join()
            .map_err(|_| anyhow::anyhow!("the tap's reader panicked"))?
    }
}

/// A private Open vSwitch (ovsdb-server + ovs-vswitchd) in a temporary folder.
pub(crate) struct Ovs {
    dir: tempfile::TempDir,
}

impl Ovs {
    pub(crate) fn env(&self) -> String {
        let d = self.dir.path().display();
        format!("OVS_RUNDIR={d} OVS_DBDIR={d} OVS_LOGDIR={d}")
    }

    pub(crate) fn start() -> Result<Ovs> {
        if Command::new("sh")
            .arg("-c")
            .arg("command -v ovs-vswitchd")
            .output()?
            .stdout
            .is_empty()
        {
            bail!("ovs-vswitchd is missing: `apt install openvswitch-switch`");
        }
        let o = Ovs {
            dir: tempfile::tempdir()?,
        };
        let d = o.dir.path().display().to_string();
        let e = o.env();
        sh(&format!(
            "{e} ovsdb-tool create {d}/conf.db /usr/share/openvswitch/vswitch.ovsschema"
        ))?;
        sh(&format!(
            "{e} ovsdb-server {d}/conf.db --remote=punix:{d}/db.sock --pidfile --detach --log-file"
        ))?;
        sh(&format!("{e} ovs-vsctl --no-wait init"))?;
        sh(&format!("{e} ovs-vswitchd --pidfile --detach --log-file"))?;
        Ok(o)
    }

    pub(crate) fn vsctl(&self, args: &str) -> Result<String> {
        sh(&format!("{} ovs-vsctl {args}", self.env()))
    }
}

impl Drop for Ovs {
    fn drop(&mut self) {
        let d = self.dir.path().display().to_string();
        for p in ["ovs-vswitchd", "ovsdb-server"] {
            quiet(&format!("kill $(cat {d}/{p}.pid)"));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn run_contender(name: &str, c: &Chain, secs: f64, spin: bool, tag: &str) -> Result<Figures> {
    let exe = std::env::current_exe()?;
    let dir = tempfile::tempdir()?;
    match name {
        "kernel" => run_kernel(&exe, dir.path(), c, secs, spin, tag),
        "kernel-tapped" => run_kernel_tapped(&exe, dir.path(), c, secs, spin, tag),
        "userspace" | "userspace-packet" => run_userspace(name, &exe, dir.path(), c, secs, spin),
        "linux" | "ovs" => run_bridges(name, c, secs, spin, tag),
        other => {
            bail!("unknown contender `{other}` (kernel, kernel-tapped, linux, ovs, userspace, userspace-packet)")
        }
    }
}

/// The chain in Stitch's kernel data plane named `plane`, measured by `measure_it`, then
/// torn down.
fn with_kernel_plane(
    exe: &Path,
    dir: &Path,
    c: &Chain,
    plane: &str,
    measure_it: impl FnOnce() -> Result<Figures>,
) -> Result<Figures> {
    let file = dir.join("graph.yaml");
    std::fs::write(&file, c.graph(true, "af_packet"))?;
    sh(&format!(
        "{} kernel apply --name {plane} {}",
        exe.display(),
        file.display()
    ))?;
    let r = measure_it();
    quiet(&format!("{} kernel teardown --name {plane}", exe.display()));
    r
}

/// The chain in Stitch's kernel data plane.
fn run_kernel(
    exe: &Path,
    dir: &Path,
    c: &Chain,
    secs: f64,
    spin: bool,
    tag: &str,
) -> Result<Figures> {
    with_kernel_plane(exe, dir, c, &format!("bk{tag}"), || measure(c, secs, spin))
}

/// The same, with every link captured by a tap.
fn run_kernel_tapped(
    exe: &Path,
    dir: &Path,
    c: &Chain,
    secs: f64,
    spin: bool,
    tag: &str,
) -> Result<Figures> {
    let plane = format!("bt{tag}");
    with_kernel_plane(exe, dir, c, &plane, || {
        TapAll::start(&plane).and_then(|tap| {
            let r = measure(c, secs, spin);
            let records = tap.stop()?;
            anyhow::ensure!(records > 0, "the taps saw nothing");
            r
        })
    })
}

/// The chain in Stitch's engine, over AF_XDP (`userspace`) or `af_packet`.
fn run_userspace(
    name: &str,
    exe: &Path,
    dir: &Path,
    c: &Chain,
    secs: f64,
    spin: bool,
) -> Result<Figures> {
    // AF_XDP by default; `userspace-packet` runs the same graph over `af_packet`
    // (TPACKET_V2: frames handed over one by one, no block timeout in the round trip).
    let io = if name == "userspace" {
        "af_xdp"
    } else {
        "af_packet"
    };
    let file = dir.join("graph.yaml");
    std::fs::write(&file, c.graph(false, io))?;
    let sock = dir.join("api.sock");
    let mut child: Child = Command::new(exe)
        .args(["run", "--control"])
        .arg(&sock)
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let t = Instant::now();
    while !sock.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = measure(c, secs, spin);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    r
}

/// The routers joined by Linux bridges (`linux`) or Open vSwitch's userspace datapath (`ovs`).
fn run_bridges(name: &str, c: &Chain, secs: f64, spin: bool, tag: &str) -> Result<Figures> {
    let ports = c.router_namespaces()?;
    let ovs = if name == "ovs" {
        Some(Ovs::start()?)
    } else {
        None
    };
    let mut bridges = Vec::new();
    let setup = (|| -> Result<()> {
        for (i, members) in ports.iter().enumerate() {
            let br = format!("{tag}br{i}");
            match &ovs {
                None => {
                    sh(&format!(
                        "ip link add {br} type bridge stp_state 0 forward_delay 0"
                    ))?;
                    sh(&format!("ip link set {br} up"))?;
                    for m in members {
                        sh(&format!("ip link set {m} master {br}"))?;
                    }
                }
                Some(o) => {
                    o.vsctl(&format!(
                        "add-br {br} -- set bridge {br} datapath_type=netdev"
                    ))?;
                    for m in members {
                        o.vsctl(&format!("add-port {br} {m}"))?;
                    }
                }
            }
            bridges.push(br);
        }
        if ovs.is_some() {
            // The userspace datapath forwards veth's partial checksums and GSO frames
            // raw: TCP only works with the offloads off on every veth (a known
            // Open vSwitch issue; Stitch completes checksums itself).
            for members in &ports {
                for m in members {
                    quiet(&format!("ethtool -K {m} tx off tso off gso off"));
                }
            }
            for j in 1..=c.n {
                for side in ["left", "right"] {
                    quiet(&format!(
                        "ip netns exec {tag}rt{j} ethtool -K {side} tx off tso off gso off"
                    ));
                }
            }
            for ns in &c.hosts {
                quiet(&format!(
                    "ip netns exec {ns} ethtool -K eth0 tx off tso off gso off"
                ));
            }
        }
        Ok(())
    })();
    let r = setup.and_then(|_| measure(c, secs, spin));
    for br in &bridges {
        match &ovs {
            None => quiet(&format!("ip link del {br}")),
            Some(o) => {
                let _ = o.vsctl(&format!("del-br {br}"));
            }
        }
    }
    drop(ovs);
    c.remove_router_namespaces();
    if name == "ovs" {
        for ns in &c.hosts {
            quiet(&format!(
                "ip netns exec {ns} ethtool -K eth0 tx on tso on gso on"
            ));
        }
    }
    r
}

pub fn run(args: KernelBenchArgs) -> Result<()> {
    anyhow::ensure!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() } == 0,
        "the kernel benchmark builds namespaces and loads BPF programs: run it as root"
    );
    let tag = format!("b{}", std::process::id() % 1000);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "bench kernel: chains {:?}, {} s per measurement, load average {}",
        args.chains,
        args.seconds,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "{:<10} {:>6} {:>10} {:>9} {:>9} {:>10} {:>9}",
        "contender", "chain", "RR/s", "med µs", "p99 µs", "CRR/s", "Gbit/s"
    );
    let mut results = Vec::new();
    for &n in &args.chains {
        anyhow::ensure!((1..=40).contains(&n), "chain lengths are 1..40");
        let chain = Chain::new(&tag, n)?;
        for name in &args.contenders {
            let f = match run_contender(name, &chain, args.seconds, args.spin, &tag) {
                Ok(f) => f,
                Err(e) => {
                    println!("{name:<10} {n:>6}  failed: {e:#}");
                    continue;
                }
            };
            println!(
                "{:<10} {:>6} {:>10.0} {:>9.1} {:>9.1} {:>10.0} {:>9.2}{}",
                name,
                n,
                f.rr_per_s,
                f.rr_median_us,
                f.rr_p99_us,
                f.crr_per_s,
                f.iperf_gbps,
                if f.rr_lost + f.crr_failed > 0 {
                    format!("  (lost {} RR, {} CRR failed)", f.rr_lost, f.crr_failed)
                } else {
                    String::new()
                }
            );
            results.push(serde_json::json!({"contender": name, "chain": n, "figures": f}));
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(())
}
