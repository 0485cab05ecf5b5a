//! Test scaffolding shared by the integration tests: network namespaces joined by veth pairs
//! (unique names, always removed), and a running `stitch` instance.
#![allow(dead_code)]

pub mod frames;
pub mod testpmd;
pub mod upgrade;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub fn sh(cmd: &str) -> Output {
    Command::new("sh").arg("-c").arg(cmd).output().unwrap()
}

pub fn must(cmd: &str) -> String {
    let o = sh(cmd);
    assert!(
        o.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn require_root_and_tools(tools: &[&str]) {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "these tests create network namespaces: run them as root"
    );
    for t in tools {
        assert!(
            sh(&format!("command -v {t}")).status.success(),
            "{t} is needed: scripts/install-deps installs it"
        );
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Two namespaces, each joined to the root namespace by a veth pair:
/// `ns[0]` (`inner[0]`, 10.X.Y.1/24, fd00:X:Y::1/64) ⇄ `outer[0]` … `outer[1]` ⇄ `ns[1]` (`inner[1]`, .2).
/// The outer ends are up, without addresses, for Stitch to attach to. Everything is removed on drop.
pub struct TwoHosts {
    pub ns: [String; 2],
    pub inner: [String; 2],
    pub outer: [String; 2],
    pub ip: [String; 2],
    pub ip6: [String; 2],
}

impl TwoHosts {
    pub fn new() -> TwoHosts {
        TwoHosts::with_queues(1)
    }

    /// Like [`TwoHosts::new`], with veth pairs of `queues` receive and transmit queues each
    /// (a veth delivers on the receive queue numbered like the sender's transmit queue).
    pub fn with_queues(queues: u32) -> TwoHosts {
        let id = std::process::id() % 10000;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{id}x{n}");
        let hosts = TwoHosts {
            ns: [format!("st{tag}a"), format!("st{tag}b")],
            inner: ["eth0".into(), "eth0".into()],
            outer: [format!("st{tag}a"), format!("st{tag}b")],
            ip: [
                format!("10.{}.{}.1", 100 + n % 100, id % 250),
                format!("10.{}.{}.2", 100 + n % 100, id % 250),
            ],
            ip6: [format!("fd00:{n}:{id}::1"), format!("fd00:{n}:{id}::2")],
        };
        for i in 0..2 {
            let (ns, outer, inner) = (&hosts.ns[i], &hosts.outer[i], &hosts.inner[i]);
            must(&format!("ip netns add {ns}"));
            let q = format!("numtxqueues {queues} numrxqueues {queues}");
            must(&format!(
                "ip link add {outer} {q} type veth peer name {inner} {q} netns {ns}"
            ));
            must(&format!("ip link set {outer} up"));
            must(&format!("sysctl -qw net.ipv6.conf.{outer}.disable_ipv6=1"));
            must(&format!("ip -n {ns} link set lo up"));
            must(&format!(
                "ip -n {ns} addr add {}/24 dev {inner}",
                hosts.ip[i]
            ));
            must(&format!(
                "ip -n {ns} addr add {}/64 dev {inner} nodad",
                hosts.ip6[i]
            ));
            must(&format!("ip -n {ns} link set {inner} up"));
        }
        hosts
    }

    /// Runs a command inside namespace `i`.
    pub fn exec(&self, i: usize, cmd: &str) -> Output {
        sh(&format!("ip netns exec {} {cmd}", self.ns[i]))
    }

    /// Pings `to` from host `i` until one answer comes (ARP first; the machine may be busy),
    /// for at most `secs`.
    pub fn reaches(&self, i: usize, to: &str, secs: u64) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(secs) {
            if self
                .exec(i, &format!("ping -c 1 -W 1 {to}"))
                .status
                .success()
            {
                return true;
            }
        }
        false
    }

    /// A server in host `i` whose first line of output is `ready`, printed once it listens:
    /// returned when it has said so (a fixed wait is too short on a loaded machine).
    pub fn spawn_ready(&self, i: usize, cmd: &str) -> Listening {
        let mut process = self.spawn(i, cmd);
        let mut out = std::io::BufReader::new(process.0.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), "ready", "`{cmd}` did not start");
        Listening { process, out }
    }

    pub fn spawn(&self, i: usize, cmd: &str) -> Background {
        Background(
            Command::new("ip")
                .args(["netns", "exec", &self.ns[i], "sh", "-c", cmd])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        )
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for i in 0..2 {
            let _ = sh(&format!("ip link del {} 2>/dev/null", self.outer[i]));
            let _ = sh(&format!(
                "ip netns pids {} 2>/dev/null | xargs -r kill -9",
                self.ns[i]
            ));
            let _ = sh(&format!("ip netns del {} 2>/dev/null", self.ns[i]));
        }
    }
}

impl TwoHosts {
    /// Puts host 0 on 10.N.1.2/24 and host 1 on 10.N.2.2/24, each routed via .1 (a router
    /// between them).
    pub fn two_subnets(&self, n: u32) {
        for (i, net) in [(0, 1), (1, 2)] {
            must(&format!(
                "ip -n {} addr flush dev {}",
                self.ns[i], self.inner[i]
            ));
            must(&format!(
                "ip -n {} addr add 10.{n}.{net}.2/24 dev {}",
                self.ns[i], self.inner[i]
            ));
            must(&format!(
                "ip -n {} route add default via 10.{n}.{net}.1",
                self.ns[i]
            ));
        }
    }

    /// Waits for a TCP server in host `i` to listen on `port`.
    pub fn wait_listening(&self, i: usize, port: u16) {
        wait_until(&format!("a server listening on {port}"), 10, || {
            !sh(&format!(
                "ip netns exec {} ss -Hltn 'sport = :{port}'",
                self.ns[i]
            ))
            .stdout
            .is_empty()
        });
    }

    /// iperf3 TCP from host 0 to `to` (host 1's address) for `secs`; received bits per second.
    /// Fails the test if iperf3 does.
    pub fn iperf_tcp(&self, to: &str, secs: u32) -> f64 {
        // The server gives up by itself (`timeout`) if no test completes, so a stalled data
        // path fails the test instead of hanging it.
        let server = self.spawn(1, &format!("timeout {} iperf3 -s -1 -p 5299", secs + 30));
        self.wait_listening(1, 5299);
        let o = self.exec(
            0,
            &format!(
                "timeout {} iperf3 -c {to} -p 5299 -t {secs} --connect-timeout 5000 -J",
                secs + 20
            ),
        );
        let _ = server.finish();
        iperf_bits(&o, to)
    }
}

/// The received bits per second of an `iperf3 -J` client run to `to`; fails the test if
/// iperf3 failed.
pub fn iperf_bits(o: &Output, to: &str) -> f64 {
    assert!(
        o.status.success(),
        "iperf3 to {to} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or_else(|| panic!("iperf3 to {to} gave no result: {v}"))
}

/// Of what a `ping -D` printed: the replies received between `from` and `to` (UNIX seconds),
/// and the longest time between two in a row (seconds).
pub fn ping_replies_and_gap(out: &str, from: f64, to: f64) -> (usize, f64) {
    let times: Vec<f64> = out
        .lines()
        .filter(|l| l.contains("bytes from"))
        .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.parse().ok())
        .filter(|t| *t >= from && *t <= to)
        .collect();
    let gap = times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
    (times.len(), gap)
}

/// Runs a graph that must not start; returns what stitch printed on stderr.
pub fn run_must_fail(text: &str) -> String {
    run_must_fail_with(text, &["--duration", "1"])
}

/// `stitch run` of graph `text` with more arguments, which must fail; its standard error.
pub fn run_must_fail_with(text: &str, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let g = dir.path().join("g.yaml");
    std::fs::write(&g, text).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["run", "--control"])
        .arg(dir.path().join("s.sock"))
        .arg(&g)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "the graph started: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Waits until `f` holds, failing the test after `secs` seconds.
pub fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process killed when dropped (also when a test fails).
pub struct Background(pub Child);

impl Background {
    pub fn finish(mut self) -> Output {
        let child = std::mem::replace(&mut self.0, Command::new("true").spawn().unwrap());
        child.wait_with_output().unwrap()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
        unsafe { libc::kill(self.0.id() as i32, sig) };
    }
}

/// A server started by [`TwoHosts::spawn_ready`].
pub struct Listening {
    pub process: Background,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Listening {
    /// The next line it prints, without its end; `None` once it has ended.
    #[allow(dead_code)]
    pub fn next_line(&mut self) -> Option<String> {
        let mut line = String::new();
        match std::io::BufRead::read_line(&mut self.out, &mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(line.trim_end().to_string()),
        }
    }

    /// What it printed after `ready`, once it has ended.
    pub fn finish(mut self) -> String {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        let _ = self.process.finish();
        rest
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        // Its children first: a `--supervise` parent killed alone leaves its instance running
        // (an orphan that keeps the socket, so `stitch cleanup` spares its VMs too).
        let _ = Command::new("pkill")
            .args(["-KILL", "-P", &self.0.id().to_string()])
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `stitch run` of a graph, with its control socket in a temporary folder.
pub struct Stitch {
    pub process: Background,
    /// Declared after `process`: removed once it is gone.
    pub leftovers: Leftovers,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
}

/// What an instance killed by a failing test left running (VMs and function processes outlive
/// a killed Stitch, for the next run to adopt): removed by `stitch cleanup`, which never
/// touches an instance that runs (one that took this one over).
pub struct Leftovers(pub PathBuf);

impl Drop for Leftovers {
    fn drop(&mut self) {
        if self.0.exists() {
            let _ = Command::new(env!("CARGO_BIN_EXE_stitch"))
                .args(["cleanup", "--control"])
                .arg(&self.0)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Stitch {
    pub fn run(graph: &str) -> Stitch {
        Stitch::run_with(graph, &[])
    }

    /// Runs `graph` with more `stitch run` arguments (e.g. `--listen`).
    pub fn run_with(graph: &str, extra: &[&str]) -> Stitch {
        Stitch::run_with_env(graph, extra, &[])
    }

    /// [`Stitch::run_with`] with more environment variables.
    pub fn run_with_env(graph: &str, extra: &[&str], env: &[(&str, &Path)]) -> Stitch {
        let mut command = Command::new(env!("CARGO_BIN_EXE_stitch"));
        command.envs(env.iter().copied());
        Stitch::run_as(command, graph, extra)
    }

    /// [`Stitch::run_with`] started by `command`: the stitch binary, or a program that runs
    /// it with the arguments given after its own (`sh -c 'umask 0; exec "$0" "$@"' stitch`).
    pub fn run_as(mut command: Command, graph: &str, extra: &[&str]) -> Stitch {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("graph.yaml");
        std::fs::write(&file, graph).unwrap();
        let socket = dir.path().join("ctl.sock");
        let child = command
            .args(["run", "--json", "--control"])
            .arg(&socket)
            .arg(&file)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut s = Stitch {
            process: Background(child),
            leftovers: Leftovers(socket.clone()),
            socket,
            dir,
        };
        let t = Instant::now();
        // Ready once the graph runs: the API answers from before the graph is applied. (An
        // instance whose graph already finished and exited counts as ready, as before.)
        let graph_runs = |s: &Stitch| {
            stitch_api::client::call(
                &s.socket,
                stitch_api::client::Method::GET,
                "/api/v1/graph",
                None,
            )
            .map(|(status, _)| status == 200)
            .unwrap_or(true)
        };
        while s.stats().is_none() || !graph_runs(&s) {
            if let Ok(Some(status)) = s.process.0.try_wait() {
                let out = std::mem::replace(
                    &mut s.process,
                    Background(Command::new("true").spawn().unwrap()),
                )
                .finish();
                panic!(
                    "stitch exited with {status}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "stitch did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn stats(&self) -> Option<serde_json::Value> {
        let out = Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["stats", "--json", "--control"])
            .arg(&self.socket)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).unwrap())
    }

    /// Counter `name` of app `app_name`, as `stitch stats` gives it now; `None` when the
    /// instance does not answer or has no such counter.
    pub fn counter(&self, app_name: &str, name: &str) -> Option<u64> {
        self.stats()
            .and_then(|st| app(&st, app_name)["counters"][name].as_u64())
    }

    /// One API request on the instance's Unix socket: status and JSON body (`null` when the
    /// body is not JSON).
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
        let method = stitch_api::client::Method::from_bytes(method.as_bytes()).unwrap();
        let (status, bytes) = stitch_api::client::call(
            &self.socket,
            method,
            path,
            body.map(|b| b.as_bytes().to_vec()),
        )
        .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }

    /// Writes `graph` to the instance's graph file and applies it with `stitch apply`, which
    /// must succeed; what it printed.
    pub fn apply(&self, graph: &str) -> String {
        std::fs::write(self.graph_file(), graph).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["apply", "--control"])
            .arg(&self.socket)
            .arg(self.graph_file())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "stitch apply: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The graph file the instance runs.
    pub fn graph_file(&self) -> PathBuf {
        self.dir.path().join("graph.yaml")
    }

    /// Stops with SIGINT and returns the final counters.
    pub fn stop(self) -> serde_json::Value {
        self.stop_with_log().0
    }

    /// Stops the instance: its last counters and its log.
    pub fn stop_with_log(self) -> (serde_json::Value, String) {
        self.process.signal(libc::SIGINT);
        let out = self.process.finish();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "stitch failed: {log}");
        (serde_json::from_slice(&out.stdout).unwrap(), log)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The token of `role` (read, capture, admin) that the instance made for its API on TCP.
    pub fn token(&self, role: &str) -> String {
        let file = self.socket.with_extension("tokens").join(role);
        std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .to_string()
    }
}

/// A TCP port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn link<'a>(stats: &'a serde_json::Value, spec: &str) -> &'a serde_json::Value {
    stats["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["link"] == spec)
        .unwrap_or_else(|| panic!("no link {spec}"))
}

pub fn app<'a>(stats: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    stats["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == name)
        .unwrap_or_else(|| panic!("no app {name}"))
}

/// Runs a graph to its end (`stitch run --json`) from `dir`/g.yaml and returns the final counters.
pub fn run_graph(dir: &Path, text: &str, extra: &[&str]) -> serde_json::Value {
    let g = dir.join("g.yaml");
    std::fs::write(&g, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["run", "--json", "--control"])
        .arg(dir.join("s.sock"))
        .args(extra)
        .arg(&g)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The given fields of every frame of a capture file, one line per frame, as tshark decodes them.
pub fn tshark_fields(file: &Path, fields: &[&str]) -> Vec<String> {
    let args: Vec<String> = fields.iter().map(|x| format!("-e {x}")).collect();
    must(&format!(
        "tshark -r {} -T fields {}",
        file.display(),
        args.join(" ")
    ))
    .lines()
    .map(str::to_string)
    .collect()
}

/// Like [`tshark_fields`], with tshark checking IPv4, UDP and TCP checksums (their
/// `*.checksum.status` fields: 1 good, 0 bad).
pub fn tshark_checked(file: &Path, fields: &[&str]) -> Vec<String> {
    tshark_checked_where(file, "frame", fields)
}

/// [`tshark_checked`] of the frames that match display filter `filter` only.
pub fn tshark_checked_where(file: &Path, filter: &str, fields: &[&str]) -> Vec<String> {
    let args: Vec<String> = fields.iter().map(|x| format!("-e {x}")).collect();
    must(&format!(
        "tshark -o ip.check_checksum:TRUE -o udp.check_checksum:TRUE -o tcp.check_checksum:TRUE \
         -r {} -Y '{filter}' -T fields {}",
        file.display(),
        args.join(" ")
    ))
    .lines()
    .map(str::to_string)
    .collect()
}

/// Packets in a capture file, as capinfos counts them.
pub fn capinfos_count(file: &Path) -> u64 {
    let s = must(&format!("capinfos -M -c {}", file.display()));
    let line = s
        .lines()
        .find(|l| l.contains("Number of packets"))
        .expect("capinfos count");
    line.rsplit(' ').next().unwrap().trim().parse().unwrap()
}

/// `stitch-extcap`, built beside `stitch` by `cargo build --workspace` (as `scripts/test` does).
pub fn extcap_binary() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_stitch")).with_file_name("stitch-extcap");
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` first (scripts/test does)",
        p.display()
    );
    p
}

/// The extcap linked into Wireshark's extcap folder for a test, removed after.
pub struct InstalledExtcap(PathBuf);

impl Drop for InstalledExtcap {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Links `stitch-extcap` into Wireshark's extcap folder (`stitch-extcap --install`).
pub fn install_extcap() -> InstalledExtcap {
    let out = Command::new(extcap_binary())
        .arg("--install")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let at = String::from_utf8_lossy(&out.stdout);
    InstalledExtcap(PathBuf::from(at.split(" -> ").next().unwrap()))
}

/// The QEMU guest of the VM tests (`scripts/vm-image`, built once into `target/vm-image`).
pub fn vm_image() -> PathBuf {
    vm_image_with("vm-image", &[])
}

/// The repository's top folder (README.md, docs/, scripts/).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The test guest with `programs` (beside the `stitch` binary: Stitch's functions) in its
/// `/bin`, built into `target/NAME`.
pub fn vm_image_with(name: &str, programs: &[&str]) -> PathBuf {
    let root = repo();
    let out = root.join("target").join(name);
    let beside = Path::new(env!("CARGO_BIN_EXE_stitch")).parent().unwrap();
    let programs: Vec<String> = (programs.iter())
        .map(|p| beside.join(p).display().to_string())
        .collect();
    must(&format!(
        "{} {} {}",
        root.join("scripts/vm-image").display(),
        out.display(),
        programs.join(" ")
    ));
    out
}

/// Starts the instance on control socket `socket` again with graph `file` for a second (after a
/// crash: it removes what the dead one left), which must succeed.
pub fn run_again(socket: &Path, file: &Path) {
    let _ = std::fs::remove_file(socket);
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["run", "--duration", "1", "--control"])
        .arg(socket)
        .arg(file)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "stitch run again: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `ovs-ofctl -O OpenFlow13 ARGS` against the switch listening on `port`, which must succeed;
/// what it printed.
pub fn ofctl(port: u16, args: &[&str]) -> String {
    // Options, the command, the switch, the command's arguments.
    let cmd = args.iter().position(|a| !a.starts_with("--")).unwrap();
    let out = Command::new("ovs-ofctl")
        .args(["-O", "OpenFlow13"])
        .args(&args[..=cmd])
        .arg(format!("tcp:127.0.0.1:{port}"))
        .args(&args[cmd + 1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ovs-ofctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `stitch show APP` of instance `s`, as JSON.
pub fn show(s: &Stitch, app: &str) -> serde_json::Value {
    try_show(s, app).unwrap_or_else(|e| panic!("stitch show {app}: {e}"))
}

/// `stitch show APP`, or why it failed (the instance not answering yet, no such app).
pub fn try_show(s: &Stitch, app: &str) -> Result<serde_json::Value, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["show", app, "--control"])
        .arg(&s.socket)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

/// The pid of app `app`'s process, if it runs one.
pub fn pid_of(s: &Stitch, app: &str) -> Option<i32> {
    show(s, app)["process"]["pid"].as_i64().map(|p| p as i32)
}

/// Whether process `pid` runs (exists and is no zombie).
pub fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// The `vm1` app: the test guest of `scripts/vm-image` at `cidr`, running `run`.
pub fn vm_app(image: &Path, cidr: &str, run: &str, mac: &str) -> String {
    format!(
        "  vm1:
    placement: vm
    kernel: {image}/vmlinux
    initrd: {image}/initrd.gz
    append: 'console=ttyS0 quiet stitch.ip={cidr} stitch.run=\"{run}\"'
    mac: \"{mac}\"
    memory_mb: 512
",
        image = image.display()
    )
}

/// App `name`: the test guest of [`vm_image_with`] running `run`, whose function runs on its
/// port's rings hot-plugged as ivshmem devices (`rings: ivshmem`) in `mode`.
pub fn ivshmem_vm_app(name: &str, image: &Path, run: &str, mode: &str) -> String {
    format!(
        "  {name}:
    placement: vm
    kernel: {image}/vmlinux
    initrd: {image}/initrd.gz
    append: 'console=ttyS0 quiet stitch.run=\"{run}\"'
    memory_mb: 256
    rings: ivshmem
    mode: {mode}
",
        image = image.display()
    )
}

/// A guest's shell loop that prints `IVSHMEM-AT=xADDR,ADDR,…` and `IVSHMEM-DEVICES=N` each
/// time the ivshmem devices its `lspci` lists change, beside `function` started in the
/// background. (No quotes: it goes on the kernel's command line.)
pub fn guest_watching_ivshmem(function: &str) -> String {
    format!(
        "{function} & L=none; while true; \
         do A=x$(lspci -n | grep 1af4:1110 | while read a b; do echo -n $a,; done); \
         [ $A != $L ] && echo IVSHMEM-AT=$A && \
         echo IVSHMEM-DEVICES=$(echo $A | grep -o : | wc -l); L=$A; sleep 0.2; done"
    )
}

/// A guest whose function polls takes a core of the two: one test with such guests at a
/// time in a test binary (tests of one binary run side by side).
pub fn one_guest_test_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The ivshmem devices VM app `vm`'s guest listed last (the last `IVSHMEM-DEVICES=` of a
/// [`guest_watching_ivshmem`] guest).
pub fn ivshmem_devices_now(s: &Stitch, vm: &str) -> Option<u32> {
    let said = console_of(s, vm);
    let last = said
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("IVSHMEM-DEVICES="));
    last.and_then(|n| n.parse().ok())
}

/// The PCI addresses of the ivshmem devices VM app `vm`'s guest listed last (as
/// [`ivshmem_devices_now`]).
pub fn ivshmem_addresses_now(s: &Stitch, vm: &str) -> Option<Vec<String>> {
    let said = console_of(s, vm);
    let last = said
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("IVSHMEM-AT=x"))?;
    Some(last.split_terminator(',').map(str::to_string).collect())
}

/// The VM app `vm`'s console so far.
pub fn console_of(s: &Stitch, vm: &str) -> String {
    let v = show(s, vm);
    let console = v["process"]["console"].as_str().unwrap_or_default();
    std::fs::read_to_string(console).unwrap_or_default()
}

/// ping's summary of 300 pings 10 ms apart from host `i` to `to`, with `during` done 300 ms in.
/// Whether `ping`'s summary says every request was answered, and at least `count` were
/// sent. With `-w` and `-c`, ping sends until `count` replies came, so a late reply makes it
/// send one more: "302 packets transmitted, 302 received" lost nothing.
pub fn ping_lost_nothing(out: &str, count: u64) -> bool {
    let summary = out.lines().find(|l| l.contains("packets transmitted"));
    let numbers: Vec<u64> = summary
        .into_iter()
        .flat_map(|l| l.split([' ', ',']))
        .filter_map(|w| w.parse().ok())
        .take(2)
        .collect();
    matches!(numbers[..], [sent, received] if sent == received && received >= count)
}

pub fn paced_ping_while(hosts: &TwoHosts, i: usize, to: &str, during: impl FnOnce()) -> String {
    // `-w`: wait for the last reply too (without it ping leaves twice the slowest round trip
    // after the last request, and a late last reply from a busy guest reads as a loss).
    let paced = hosts.spawn(i, &format!("ping -n -i 0.01 -c 300 -w 10 {to}"));
    std::thread::sleep(std::time::Duration::from_millis(300));
    during();
    String::from_utf8_lossy(&paced.finish().stdout).into_owned()
}

/// A `switch` between VM ports `a` (OpenFlow port 1) and `b` (2), on vhost-user sockets
/// `a.sock` and `b.sock` of `dir`, its OpenFlow endpoint on `port`.
pub fn switch_between_two_vm_ports(dir: &Path, port: u16) -> String {
    format!(
        "apps:
  sw: {{ type: switch, ports: [a, b], listen: \"127.0.0.1:{port}\" }}
  a: {{ type: vhost_user, socket: {d}/a.sock }}
  b: {{ type: vhost_user, socket: {d}/b.sock }}
links:
  - \"sw.a -> a.input\"
  - \"a.output -> sw.a\"
  - \"sw.b -> b.input\"
  - \"b.output -> sw.b\"
",
        d = dir.display()
    )
}

/// `stitch bench ARGS`, which must succeed; what it printed (echoed to the test's output).
pub fn run_bench(args: &[&str]) -> String {
    let run = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .arg("bench")
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "stitch bench {}: {text}{}",
        args.join(" "),
        String::from_utf8_lossy(&run.stderr)
    );
    eprintln!("{text}");
    text
}

/// A numbered UDP frame from 02:00:00:00:00:01 to 02:00:00:00:00:02 (its sequence number at
/// byte 42, as `write_sequence` writes them) into `buf`; its length.
pub fn numbered_frame(buf: &mut [u8], seq: u32) -> usize {
    let mut ip = [
        0x45, 0, 0, 32, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
    ];
    let c = stitch_wire::checksum::checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    buf[..14].copy_from_slice(&[2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 8, 0]);
    buf[14..34].copy_from_slice(&ip);
    buf[34..42].copy_from_slice(&[0x30, 0x39, 0x30, 0x39, 0, 12, 0, 0]);
    buf[42..46].copy_from_slice(&seq.to_be_bytes());
    buf[46..60].fill(0);
    60
}

/// Frames numbered 0..`n` sent by guest `a`, sixteen a millisecond (about 16 kpps: long
/// enough for changes to happen mid-stream), while guest `b` takes what arrives; the numbers
/// `b` received, in the order it did, once all arrived or after 5 s without a frame.
///
/// `a` never has more frames unreceived than `b` has receive buffers: a switch path has no
/// back-pressure (a guest whose ring is full loses what comes, counted as
/// `to_guest_no_buffer_drops`, as with any virtio back-end), so without this window a test
/// thread or worker that loses the CPU for a few milliseconds would see frames dropped that
/// the switch-over did not lose. With it, any frame missing is one Stitch lost.
pub fn stream_numbered(
    a: &mut stitch_vhost::frontend::Frontend,
    b: &mut stitch_vhost::frontend::Frontend,
    n: u32,
) -> Vec<u32> {
    let window = u32::from(b.queue_size());
    stream_numbered_while(a, b, window, |sent| sent < n).1
}

/// Frames sent by `a` as [`stream_numbered`] does, for as long as `more(sent so far)` says and
/// with at most `window` of them unreceived, then until what was sent arrived or 5 s passed
/// without a frame: how many were sent, and the numbers received. A window that stays full
/// (frames lost) ends the sending too, once nothing arrived for 5 s.
pub fn stream_numbered_while(
    a: &mut stitch_vhost::frontend::Frontend,
    b: &mut stitch_vhost::frontend::Frontend,
    window: u32,
    more: impl Fn(u32) -> bool,
) -> (u32, Vec<u32>) {
    // Long beside any stall of a busy machine: the wait is only ever paid when frames are lost.
    const QUIET: Duration = Duration::from_secs(5);
    let (mut next, mut got) = (0u32, Vec::new());
    let (t, mut last_arrival) = (Instant::now(), Instant::now());
    loop {
        while more(next) && next - (got.len() as u32) < window {
            let seq = next;
            if a.send(1, |buf| numbered_frame(buf, seq)) == 0 {
                break;
            }
            next += 1;
            if next % 16 == 0 {
                break;
            }
        }
        if b.receive(|f| got.push(u32::from_be_bytes(f[42..46].try_into().unwrap()))) > 0 {
            last_arrival = Instant::now();
        }
        let sending = more(next) && next - (got.len() as u32) < window;
        let quiet = !sending && last_arrival.elapsed() > QUIET;
        let done = !more(next) && got.len() >= next as usize;
        if done || quiet || t.elapsed() > Duration::from_secs(60) {
            return (next, got);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Stitch's virtio-net driver as the guest of VM ports `a` and `b` of `dir` (served by `s`'s
/// switch between them, with a flow from 1 to 2), sending frames written by `filler` from `a`
/// until the switch has given the pair a direct path; the two guests and how many frames
/// that took.
pub fn guests_on_a_direct_path(
    s: &Stitch,
    dir: &Path,
    filler: impl Fn(&mut [u8]) -> usize,
) -> (
    stitch_vhost::frontend::Frontend,
    stitch_vhost::frontend::Frontend,
    u32,
) {
    let mut a = vm_guest(dir, "a.sock");
    let mut b = vm_guest(dir, "b.sock");
    let sent = send_until_direct(s, &mut a, &mut b, filler);
    (a, b, sent)
}

/// Stitch's virtio-net driver on the VM port whose socket is `name` in `dir`.
pub fn vm_guest(dir: &Path, name: &str) -> stitch_vhost::frontend::Frontend {
    stitch_vhost::frontend::Frontend::connect(&dir.join(name), 256, Duration::from_secs(10))
        .unwrap()
}

/// The phase of the first direct VM path of `s`'s switch `sw` (`none` without one).
pub fn vm_path_phase(s: &Stitch) -> String {
    let (_, v) = s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
    v["direct_vm_paths"][0]["phase"]
        .as_str()
        .unwrap_or("none")
        .to_string()
}

/// Guest `a` sends filler frames until `s`'s switch has ended its direct path (10 s at most,
/// else the test fails saying `why` the path should have ended).
pub fn send_until_handed_back(s: &Stitch, a: &mut stitch_vhost::frontend::Frontend, why: &str) {
    let t = Instant::now();
    while vm_path_phase(s) == "Direct" {
        a.send(1, |buf| numbered_frame(buf, u32::MAX));
        assert!(t.elapsed() < Duration::from_secs(10), "{why}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Guest `a` sends frames written by `filler` while guest `b` takes what arrives, until `s`'s
/// switch has a direct path (once both guests are there and `a` sends; 10 s at most), then
/// until nothing is in flight between them; how many `a` sent.
pub fn send_until_direct(
    s: &Stitch,
    a: &mut stitch_vhost::frontend::Frontend,
    b: &mut stitch_vhost::frontend::Frontend,
    filler: impl Fn(&mut [u8]) -> usize,
) -> u32 {
    let (t, mut sent) = (Instant::now(), 0u32);
    while vm_path_phase(s) != "Direct" {
        sent += a.send(1, &filler) as u32;
        b.receive(|_| {});
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no direct path: {}",
            vm_path_phase(s)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    while b.receive(|_| {}) > 0 || a.in_flight() > 0 {
        a.reclaim();
        std::thread::sleep(Duration::from_millis(10));
    }
    sent
}

/// A CA in `dir` named `ca`, and certificates it signs: `name.crt` and `name.key` (0600).
pub fn pki(dir: &Path, ca: &str, names: &[&str]) {
    let d = dir.display();
    must(&format!(
        "cd {d} && openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN={ca} -keyout {ca}.key -out {ca}.crt 2>&1"
    ));
    for name in names {
        must(&format!(
            "cd {d} && openssl req -newkey rsa:2048 -nodes -subj /CN={name} -keyout {name}.key -out {name}.csr 2>&1 && \
             printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > {name}.ext && \
             openssl x509 -req -in {name}.csr -CA {ca}.crt -CAkey {ca}.key -CAcreateserial -days 2 -extfile {name}.ext -out {name}.crt 2>&1 && \
             chmod 600 {name}.key"
        ));
    }
}
