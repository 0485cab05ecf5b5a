//! `stitch bench upgrade`: what a running instance's traffic sees while the instance is
//! replaced — by `stitch upgrade`, and by a `kill -9` followed by a start with the state file —
//! beside a live `stitch apply` (the engine's own pause) and a quiet window, in one run.
//!
//! Frames numbered by the bench go into one veth pair, cross a `stitch run` instance (two
//! `af_packet` ports; with `--function-process` a function process between them; with
//! `--kernel` a forwarder in the kernel; with `--guest` a guest's virtio driver on a
//! `vhost_user` port — `dpdk-testpmd`'s virtio-user
//! forwarding what it receives, the vhost-user server, which the instance connects to again
//! after a restart) and come out of another; for each window the bench reports the longest
//! time between two arrivals and the frames sent in it that never arrived.

use anyhow::{bail, Context, Result};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct UpgradeBenchArgs {
    /// Rounds of each action (medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Frames sent per second.
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// The frames also cross a function process (Stitch's firewall, `placement: process`,
    /// forwarding them all) between the two ports.
    #[arg(long)]
    function_process: bool,
    /// The frames also cross a forwarder in the kernel (`placement: kernel`).
    #[arg(long)]
    kernel: bool,
    /// The frames also cross a guest: dpdk-testpmd's virtio-user port (io forwarding) on a
    /// `vhost_user` port.
    #[arg(long)]
    guest: bool,
    /// Print results as JSON.
    #[arg(long)]
    json: bool,
}

/// The local experimental EtherType (IEEE 802): nothing else on the veths uses it.
const ETHERTYPE: u16 = 0x88b5;
/// Seconds watched around each action.
const WINDOW: f64 = 2.0;

/// What the frames cross between the instance's two ports, beside the engine.
#[derive(Clone, Copy)]
pub(crate) struct Hops {
    /// Stitch's firewall, `placement: process`.
    pub(crate) function_process: bool,
    /// A forwarder in the kernel (`placement: kernel`): the instance's own data plane, joined
    /// to the engine by veth pairs.
    pub(crate) kernel: bool,
    /// A guest's virtio driver on a `vhost_user` port (dpdk-testpmd's virtio-user).
    pub(crate) guest: bool,
}

/// The veth pairs, the guest and the instance, removed when dropped.
pub(crate) struct Rig {
    veths: [String; 2],
    hops: Hops,
    instance: Option<Child>,
    guest: Option<Child>,
    pub(crate) dir: tempfile::TempDir,
    /// Whether `tear_down` has removed everything already.
    torn_down: bool,
}

impl Drop for Rig {
    fn drop(&mut self) {
        if !self.torn_down {
            for left in self.remove_everything() {
                log::warn!("the bench left {left}");
            }
        }
    }
}

impl Rig {
    /// Kills the instance and the guest and removes what they left; an error names what
    /// stayed (a bench that leaves a kernel data plane behind fails).
    pub(crate) fn tear_down(mut self) -> Result<()> {
        self.torn_down = true;
        let left = self.remove_everything();
        if !left.is_empty() {
            bail!("the bench left {}", left.join("; "));
        }
        Ok(())
    }

    /// Kills, cleans up and returns what is still there.
    fn remove_everything(&mut self) -> Vec<String> {
        for c in [self.instance.as_mut(), self.guest.as_mut()]
            .into_iter()
            .flatten()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
        kill_by_socket(&self.socket());
        let mut left = Vec::new();
        // What a killed instance leaves (a kernel data plane, its veths, VM sockets).
        match std::env::current_exe().and_then(|exe| {
            Command::new(exe)
                .arg("cleanup")
                .arg("--control")
                .arg(self.socket())
                .stdout(Stdio::null())
                .output()
        }) {
            Ok(out) if out.status.success() => {}
            Ok(out) => left.push(format!(
                "what `stitch cleanup` refused to remove: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => left.push(format!("what `stitch cleanup` was to remove: {e}")),
        }
        for v in &self.veths {
            let _ = Command::new("ip").args(["link", "del", v]).status();
        }
        let _ = std::fs::remove_dir_all(format!("/var/run/dpdk/{}", self.guest_prefix()));
        let plane = Path::new("/sys/fs/bpf/stitch").join(&self.kernel_names().plane);
        if plane.exists() {
            left.push(format!("its kernel data plane {}", plane.display()));
        }
        for v in self.kernel_veths() {
            left.push(format!("the veth {v}"));
        }
        left
    }

    /// The names of the instance's kernel data plane (its pinned folder, its veths' prefix).
    fn kernel_names(&self) -> stitch_place::kernel::KernelNames {
        let key = stitch_place::leftovers::key_of_socket(&self.socket());
        stitch_place::kernel::KernelNames::of(&key)
    }

    /// The veths of the instance's kernel data plane that exist now.
    fn kernel_veths(&self) -> Vec<String> {
        let prefix = self.kernel_names().veth_prefix;
        let dir = std::fs::read_dir("/sys/class/net").into_iter().flatten();
        dir.flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&prefix))
            .collect()
    }

    /// The rig's veths, both ends, and those of the instance's kernel data plane.
    pub(crate) fn interfaces(&self) -> Vec<String> {
        let ends = self.veths.iter().flat_map(|v| [v.clone(), format!("{v}s")]);
        ends.chain(self.kernel_veths()).collect()
    }

    /// Two veth pairs (`PREFIX…a`/`…as`, `…b`/`…bs`) and the graph file between their inner ends.
    pub(crate) fn new(prefix: &str, hops: Hops) -> Result<Rig> {
        let tag = std::process::id() % 100_000;
        let veths = [format!("{prefix}{tag}a"), format!("{prefix}{tag}b")];
        let mut made = Vec::new();
        for v in &veths {
            let cmd = format!(
                "ip link add {v} type veth peer name {v}s && for d in {v} {v}s; do sysctl -qw net.ipv6.conf.$d.disable_ipv6=1; ip link set $d up; done"
            );
            if !Command::new("sh").args(["-c", &cmd]).status()?.success() {
                for m in made {
                    let _ = Command::new("ip").args(["link", "del", m]).status();
                }
                bail!("`{cmd}` failed (root is needed)");
            }
            made.push(v);
        }
        let mut rig = Rig {
            veths,
            hops,
            instance: None,
            guest: None,
            dir: crate::enterable_tempdir()?,
            torn_down: false,
        };
        std::fs::write(rig.dir.path().join("graph.yaml"), rig.graph(false))?;
        if hops.guest {
            rig.guest = Some(rig.start_guest()?);
        }
        Ok(rig)
    }

    fn guest_prefix(&self) -> String {
        format!("stitch-bench-{}", std::process::id())
    }

    /// dpdk-testpmd with a virtio-user port in server mode (it outlives instances and takes
    /// each one's connection), forwarding what it receives back out.
    fn start_guest(&self) -> Result<Child> {
        use std::io::Write;
        let vdev = format!(
            // 1024 descriptors: half a second of the soak's stream waits there through a stall.
            "net_virtio_user0,path={},queues=1,server=1,queue_size=1024",
            self.dir.path().join("guest.sock").display()
        );
        let mut child = Command::new("dpdk-testpmd")
            .args([
                "-l",
                "0,1",
                "--no-pci",
                "--no-huge",
                "-m",
                "512",
                "--file-prefix",
            ])
            .arg(self.guest_prefix())
            .args(["--log-level", "pmd.net.virtio.*:error", "--vdev", &vdev])
            .args(["--", "-i", "--total-num-mbufs=32768", "--forward-mode=io"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("dpdk-testpmd (Debian: apt install dpdk) is needed for --guest")?;
        writeln!(child.stdin.as_mut().context("testpmd's input")?, "start")?;
        Ok(child)
    }

    /// Whether the guest's rings are set up (always, without a guest).
    fn guest_ready(&self) -> bool {
        if !self.hops.guest {
            return true;
        }
        let Ok((200, body)) = stitch_api::client::call(
            &self.socket(),
            stitch_api::client::Method::POST,
            "/api/v1/apps/g/query",
            Some(b"{}".to_vec()),
        ) else {
            return false;
        };
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        (v["queues"].as_array()).is_some_and(|q| q.iter().all(|q| q["ready"] == true))
    }

    pub(crate) fn socket(&self) -> PathBuf {
        self.dir.path().join("ctl.sock")
    }

    /// a → (function process) → (kernel) → (guest) → (rate meter) → b.
    fn graph(&self, through_meter: bool) -> String {
        let [a, b] = &self.veths;
        let mut apps = format!(
            "apps:\n  a: {{ type: af_packet, interface: {a}s }}\n  b: {{ type: af_packet, interface: {b}s }}\n"
        );
        let mut hops = vec!["a"];
        if self.hops.function_process {
            let nf = self.dir.path().join("nf.sock");
            apps += &format!(
                "  f: {{ placement: process, command: [stitch-nf-firewall], socket: {} }}\n",
                nf.display()
            );
            hops.push("f");
        }
        if self.hops.kernel {
            apps += "  k: { type: forwarder, placement: kernel }\n";
            hops.push("k");
        }
        if self.hops.guest {
            let socket = self.dir.path().join("guest.sock");
            apps += &format!(
                "  g: {{ type: vhost_user, socket: {}, mode: client }}\n",
                socket.display()
            );
            hops.push("g");
        }
        if through_meter {
            apps += "  m: { type: rate_meter }\n";
            hops.push("m");
        }
        hops.push("b");
        let links: String = (hops.windows(2))
            .map(|w| format!("  - \"{}.output -> {}.input\"\n", w[0], w[1]))
            .collect();
        format!("{apps}links:\n{links}")
    }

    /// Runs the `stitch` subcommand `args` on the instance; fails with its error output.
    pub(crate) fn stitch(&self, args: &[&str]) -> Result<()> {
        let out = Command::new(std::env::current_exe()?)
            .args(args)
            .arg("--control")
            .arg(self.socket())
            .stdout(Stdio::null())
            .output()?;
        if !out.status.success() {
            bail!(
                "stitch {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Writes the graph with or without the rate meter and applies it live (`stitch apply`).
    pub(crate) fn apply_live(&self, through_meter: bool) -> Result<()> {
        let file = self.dir.path().join("graph.yaml");
        std::fs::write(&file, self.graph(through_meter))?;
        self.stitch(&["apply", &file.display().to_string()])
    }

    /// Starts `stitch run` on the graph file with the state file; returns once its API answers
    /// (and the guest's rings are up).
    pub(crate) fn start(&mut self) -> Result<()> {
        let exe = std::env::current_exe()?;
        let file = self.dir.path().join("graph.yaml");
        let child = Command::new(exe)
            .arg("run")
            .arg(&file)
            .arg("--control")
            .arg(self.socket())
            .args(["--keep-running", "--state"])
            .arg(self.dir.path().join("state"))
            .args(["--state-interval", "0.2"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.instance = Some(child);
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err() || !self.guest_ready()
        {
            if t.elapsed() > Duration::from_secs(20) {
                bail!("the instance did not start (or the guest did not set its rings up)");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

/// Kills (-9) whatever process runs the instance on `socket`, found by its command line.
fn kill_by_socket(socket: &Path) -> Option<i32> {
    let out = Command::new("pgrep")
        .args(["-f", &socket.display().to_string()])
        .output()
        .ok()?;
    let mut killed = Vec::new();
    for pid in String::from_utf8_lossy(&out.stdout).lines() {
        if let Ok(pid) = pid.trim().parse::<i32>() {
            // SAFETY: kill takes no pointers.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed.push(pid);
        }
    }
    // Until a killed process has exited it holds its socket and lock, and `stitch cleanup`
    // would take it for a live instance and remove nothing (its kernel data plane stayed).
    let started = Instant::now();
    while killed.iter().any(|&pid| still_running(pid)) && started.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    killed.last().copied()
}

/// Whether any thread of process `pid` has yet to exit. A killed process's main thread turns
/// zombie before its other threads have gone, and until the last has, the descriptors they
/// share stay open: its API socket answered `stitch cleanup`, which removed nothing.
fn still_running(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(") ")?.1.chars().next())
            .is_some_and(|state| !matches!(state, 'Z' | 'X'))
    })
}

/// A raw packet socket on `interface` for the bench's EtherType.
fn packet_socket(interface: &str) -> Result<OwnedFd> {
    use stitch_io::{af_packet, netdev};
    let proto = ETHERTYPE.to_be();
    let fd = af_packet::packet_socket(proto).map_err(anyhow::Error::msg)?;
    let index = netdev::ifindex(interface).map_err(anyhow::Error::msg)?;
    af_packet::bind_to(&fd, index, proto, interface).map_err(anyhow::Error::msg)?;
    Ok(fd)
}

/// What the sender and the receiver share: frames sent, and the arrival of each (µs since
/// `start`, 0 = not arrived).
pub(crate) struct Traffic {
    pub(crate) start: Instant,
    pub(crate) sent: AtomicU64,
    pub(crate) arrivals: Vec<AtomicU64>,
    stop: AtomicBool,
}

/// Numbered frames flowing from the rig's first veth to its second: a sender and a receiver
/// thread sharing one [`Traffic`].
pub(crate) struct Stream {
    pub(crate) traffic: Arc<Traffic>,
    sender: std::thread::JoinHandle<Result<()>>,
    receiver: std::thread::JoinHandle<Result<u32>>,
}

impl Stream {
    /// Starts `rate` frames a second, with room to record `seconds` of them.
    pub(crate) fn start(rig: &Rig, seconds: f64, rate: u64) -> Stream {
        let traffic = Arc::new(Traffic {
            start: Instant::now(),
            sent: AtomicU64::new(0),
            arrivals: (0..(seconds * rate as f64) as usize)
                .map(|_| AtomicU64::new(0))
                .collect(),
            stop: AtomicBool::new(false),
        });
        let (rx_if, tx_if) = (rig.veths[1].clone(), rig.veths[0].clone());
        let receiver = {
            let t = traffic.clone();
            std::thread::spawn(move || receive(&t, &rx_if))
        };
        let sender = {
            let t = traffic.clone();
            std::thread::spawn(move || send(&t, &tx_if, rate))
        };
        Stream {
            traffic,
            sender,
            receiver,
        }
    }

    /// Stops both threads; returns what the bench's receiving socket dropped itself.
    pub(crate) fn stop(self) -> Result<u32> {
        self.traffic.stop.store(true, Ordering::Relaxed);
        self.sender.join().expect("sender")?;
        self.receiver.join().expect("receiver")
    }
}

/// Sends numbered frames into `interface` at `rate` a second, 1 ms of them at a time.
fn send(traffic: &Traffic, interface: &str, rate: u64) -> Result<()> {
    let fd = packet_socket(interface)?;
    let mut frame = [0u8; 60];
    frame[0..6].copy_from_slice(&[0xff; 6]);
    frame[6..12].copy_from_slice(&[2, 0, 0, 0x5b, 0, 1]);
    frame[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    let mut seq = 0u64;
    while !traffic.stop.load(Ordering::Relaxed) && (seq as usize) < traffic.arrivals.len() {
        let due = (traffic.start.elapsed().as_secs_f64() * rate as f64) as u64;
        while seq < due && (seq as usize) < traffic.arrivals.len() {
            frame[14..22].copy_from_slice(&seq.to_be_bytes());
            // SAFETY: send reads `frame`, which is live, for its length.
            unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr() as *const _, frame.len(), 0) };
            seq += 1;
            traffic.sent.store(seq, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    Ok(())
}

/// Records when each numbered frame comes out of `interface`.
fn receive(traffic: &Traffic, interface: &str) -> Result<u32> {
    let fd = packet_socket(interface)?;
    // The frames held up by a pause arrive in one burst: room for seconds of them, so that
    // the bench's own socket never drops what the instance delivered.
    let room: libc::c_int = 64 << 20;
    // SAFETY: setsockopt reads one c_int from `room`, which is live.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &room as *const libc::c_int as *const _,
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 100_000,
    };
    // SAFETY: setsockopt reads one timeval from `timeout`, which is live.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &timeout as *const libc::timeval as *const _,
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    let mut buf = [0u8; 128];
    while !traffic.stop.load(Ordering::Relaxed) {
        // SAFETY: recv writes at most `buf.len()` bytes into `buf`, which is live.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr() as *mut _, buf.len(), 0) };
        if n < 22 {
            continue;
        }
        let seq = u64::from_be_bytes(buf[14..22].try_into().unwrap()) as usize;
        let at = traffic.start.elapsed().as_micros() as u64;
        if let Some(slot) = traffic.arrivals.get(seq) {
            let _ = slot.compare_exchange(0, at.max(1), Ordering::Relaxed, Ordering::Relaxed);
        }
    }
    // What this socket dropped itself (they would count as lost): reported, to trust the rest.
    let mut stats = [0u32; 2];
    let mut len = std::mem::size_of_val(&stats) as libc::socklen_t;
    // SAFETY: PACKET_STATISTICS writes a tpacket_stats (two u32) into `stats`, which is live.
    unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            stats.as_mut_ptr() as *mut _,
            &mut len,
        )
    };
    Ok(stats[1])
}

/// One window: the longest time between two arrivals and the frames sent in it that never
/// arrived.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Window {
    gap_ms: f64,
    lost: u64,
}

/// The window of frames sent from `from` to `to` seconds after the start.
fn window(traffic: &Traffic, rate: u64, from: f64, to: f64) -> Window {
    let (first, last) = ((from * rate as f64) as usize, (to * rate as f64) as usize);
    let mut arrived: Vec<u64> = Vec::new();
    let mut lost = 0;
    for slot in &traffic.arrivals[first..last.min(traffic.arrivals.len())] {
        match slot.load(Ordering::Relaxed) {
            0 => lost += 1,
            at => arrived.push(at),
        }
    }
    arrived.sort_unstable();
    let gap_us = arrived.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    Window {
        gap_ms: gap_us as f64 / 1e3,
        lost,
    }
}

const ACTIONS: [&str; 4] = ["quiet", "live apply", "stitch upgrade", "kill -9 + restart"];

/// Carries out action `i` on the instance.
fn act(rig: &mut Rig, i: usize, round: usize) -> Result<()> {
    match i {
        0 => {}
        1 => rig.apply_live(round.is_multiple_of(2))?,
        2 => rig.stitch(&["upgrade"])?,
        _ => {
            kill_by_socket(&rig.socket()).context("no instance to kill")?;
            if let Some(mut c) = rig.instance.take() {
                let _ = c.wait();
            }
            let _ = std::fs::remove_file(rig.socket());
            rig.start()?;
        }
    }
    Ok(())
}

pub fn run(args: UpgradeBenchArgs) -> Result<()> {
    let hops = Hops {
        function_process: args.function_process,
        kernel: args.kernel,
        guest: args.guest,
    };
    let mut rig = Rig::new("sbu", hops)?;
    rig.start()?;
    let total = (ACTIONS.len() * args.rounds) as f64 * WINDOW + 2.0;
    let stream = Stream::start(&rig, total, args.rate);
    let traffic = stream.traffic.clone();
    std::thread::sleep(Duration::from_secs(1));
    let mut results: Vec<Vec<Window>> = vec![Vec::new(); ACTIONS.len()];
    for round in 0..args.rounds {
        for (i, result) in results.iter_mut().enumerate() {
            let at = traffic.start.elapsed().as_secs_f64();
            act(&mut rig, i, round)?;
            let until = at + WINDOW;
            std::thread::sleep(Duration::from_secs_f64(
                (until - traffic.start.elapsed().as_secs_f64()).max(0.0),
            ));
            // Frames sent in the last 0.3 s of the window may still be on their way.
            result.push(window(&traffic, args.rate, at, until - 0.3));
        }
    }
    drop(traffic);
    let receiver_drops = stream.stop()?;
    rig.tear_down()?;
    report(&args, &results, receiver_drops)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(args: &UpgradeBenchArgs, results: &[Vec<Window>], receiver_drops: u32) -> Result<()> {
    if receiver_drops > 0 {
        log::warn!(
            "the bench's receiving socket dropped {receiver_drops} frames: losses are overstated"
        );
    }
    let gaps: Vec<f64> = (results.iter())
        .map(|r| median(r.iter().map(|w| w.gap_ms).collect()))
        .collect();
    let lost: Vec<f64> = (results.iter())
        .map(|r| median(r.iter().map(|w| w.lost as f64).collect()))
        .collect();
    if args.json {
        let rows: Vec<serde_json::Value> = (0..ACTIONS.len())
            .map(|i| {
                serde_json::json!({ "action": ACTIONS[i], "gap_ms": gaps[i], "lost": lost[i],
                    "gap_vs_live_apply": gaps[i] / gaps[1], "rounds": results[i] })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let mut through = vec!["two af_packet ports"];
    for (on, what) in [
        (args.function_process, "a function process"),
        (args.kernel, "a kernel forwarder"),
        (args.guest, "a guest (testpmd on a vhost_user port)"),
    ] {
        if on {
            through.push(what);
        }
    }
    let through = through.join(", ");
    println!(
        "{} frames/s through {through}; medians of {} rounds, {WINDOW} s windows",
        args.rate, args.rounds
    );
    println!(
        "{:<20} {:>12} {:>8} {:>18}",
        "action", "max gap ms", "lost", "gap / live apply"
    );
    for i in 0..ACTIONS.len() {
        println!(
            "{:<20} {:>12.2} {:>8} {:>18.2}",
            ACTIONS[i],
            gaps[i],
            lost[i],
            gaps[i] / gaps[1]
        );
    }
    Ok(())
}
