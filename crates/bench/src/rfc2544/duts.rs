//! The devices under test, each started on CPU 1 with its two vhost-user ports on `a.sock`
//! and `b.sock` of a fresh folder: Stitch's forwarder, Stitch's OpenFlow switch with a flow
//! table, Stitch's firewall and NAT, testpmd's io forwarding, Open vSwitch's DPDK datapath with the same flow table
//! (`dpdkvhostuserclient` ports: Open vSwitch connects to sockets the tester listens on), or a
//! graph of the user's.

use crate::vhost::{stitch_backend, stitch_process, testpmd_backend, wait_sockets, Proc};
use anyhow::{bail, Context, Result};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use stitch_vhost::frontend::Frontend;

/// Entries of each of the tester's queues.
const QUEUE_SIZE: u16 = 1024;
/// Open vSwitch's DPDK build (Debian's `openvswitch-switch-dpdk`).
const OVS_DPDK: &str = "/usr/lib/openvswitch-switch-dpdk/ovs-vswitchd-dpdk";
/// Hugepages Open vSwitch's DPDK takes (`dpdk-socket-mem` 1024 MiB).
const OVS_PAGES: u64 = 512;

/// The flows the switches get when the run names none: port 1 to port 2 and back.
pub const DEFAULT_FLOWS: &str = "in_port=1,actions=output:2\nin_port=2,actions=output:1\n";

/// What the devices are given.
pub struct Setup<'a> {
    /// A graph of the user's (`graph`).
    pub graph: Option<&'a Path>,
    /// The switches' flow table, in `ovs-ofctl add-flows` syntax.
    pub flows: &'a str,
}

/// A device under test, running.
pub struct Dut {
    _processes: Vec<Proc>,
    /// The tester's listening sockets when the device connects to them (Open vSwitch).
    listeners: Option<(UnixListener, UnixListener)>,
    _ovs: Option<OvsRunning>,
    dir: tempfile::TempDir,
}

impl Dut {
    pub fn start(kind: &str, setup: &Setup, tag: usize) -> Result<Dut> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let (mut listeners, mut ovs) = (None, None);
        let processes = match kind {
            "stitch" => vec![stitch_backend(d, stitch_core::link::DEFAULT_LINK_SIZE)?],
            "testpmd" => vec![testpmd_backend(d, &format!("r{tag}"), None)?],
            "switch" => {
                let port = crate::free_port()?;
                let graph = d.join("switch.yaml");
                std::fs::write(&graph, switch_graph(d, port))?;
                let switch = stitch_process(d, &graph)?;
                add_flows(port, setup.flows, d)?;
                vec![switch]
            }
            "ovs" => {
                let listen = |name: &str| UnixListener::bind(d.join(name));
                listeners = Some((listen("a.sock")?, listen("b.sock")?));
                // It polls all the time, as the other devices here do.
                ovs = Some(start_ovs(d, &["a", "b"], setup.flows, 0)?);
                vec![]
            }
            "fw-nat" => {
                let graph = d.join("fw-nat.yaml");
                std::fs::write(&graph, firewall_nat_graph(d))?;
                vec![stitch_process(d, &graph)?]
            }
            "graph" => {
                let graph = setup.graph.context("--duts graph needs --graph FILE")?;
                let file = d.join("dut.yaml");
                std::fs::write(&file, graph_on_sockets(graph, d)?)?;
                vec![stitch_process(d, &file)?]
            }
            other => {
                bail!("unknown device under test `{other}` (stitch, switch, fw-nat, testpmd, ovs or graph)")
            }
        };
        if listeners.is_none() {
            wait_sockets(d);
        }
        Ok(Dut {
            _processes: processes,
            listeners,
            _ovs: ovs,
            dir,
        })
    }

    /// The tester's two ports, connected: frames go in at `a` and come out of `b`.
    pub fn connect(&self) -> Result<(Frontend, Frontend)> {
        if let Some((a, b)) = &self.listeners {
            return Ok((accept(a, "a")?, accept(b, "b")?));
        }
        let port = |name: &str| {
            let path = self.dir.path().join(name);
            Frontend::connect(&path, QUEUE_SIZE, Duration::from_secs(10))
                .with_context(|| format!("connecting to {}", path.display()))
        };
        Ok((port("a.sock")?, port("b.sock")?))
    }
}

/// The first back-end to connect to `listener`, within 30 s.
pub(crate) fn accept(listener: &UnixListener, name: &str) -> Result<Frontend> {
    listener.set_nonblocking(true)?;
    let started = Instant::now();
    loop {
        match Frontend::accept(listener, QUEUE_SIZE) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if started.elapsed() > Duration::from_secs(30) {
                    bail!("the device did not connect to port {name} in 30 s");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context(format!("port {name}")),
        }
    }
}

/// A Stitch graph between the two ports on one busy-polling worker on CPU 1: `apps` (graph
/// entries, one per line) and `links`.
fn ported_graph(dir: &Path, apps: &[&str], links: &[&str]) -> String {
    let mut g = format!(
        "engine: {{ busy_poll: true }}\nworkers: {{ main: {{ core: 1 }} }}\napps:\n  a: {{ type: vhost_user, socket: {d}/a.sock }}\n  b: {{ type: vhost_user, socket: {d}/b.sock }}\n",
        d = dir.display()
    );
    for a in apps {
        g += &format!("  {a}\n");
    }
    g += "links:\n";
    for l in links {
        g += &format!("  - \"{l}\"\n");
    }
    g
}

/// Stitch's OpenFlow switch between the two ports, its controller endpoint on `port`.
fn switch_graph(dir: &Path, port: u16) -> String {
    let switch = format!("sw: {{ type: switch, ports: [a, b], listen: \"127.0.0.1:{port}\" }}");
    let links = [
        "a.output -> sw.a",
        "sw.a -> a.input",
        "b.output -> sw.b",
        "sw.b -> b.input",
    ];
    ported_graph(dir, &[&switch], &links)
}

/// A stateful firewall (the lan side opens connections) and a NAT that masquerades what
/// leaves behind one address: `a` is inside, `b` outside.
fn firewall_nat_graph(dir: &Path) -> String {
    let apps = [
        "fw: { type: firewall, default: drop, rules: [ { action: accept, from: lan } ] }",
        "nat: { type: nat, external: 198.19.255.1, ports: \"1024-65535\" }",
    ];
    let links = [
        "a.output -> fw.lan",
        "fw.lan -> a.input",
        "fw.wan -> nat.lan",
        "nat.lan -> fw.wan",
        "nat.wan -> b.input",
        "b.output -> nat.wan",
    ];
    ported_graph(dir, &apps, &links)
}

/// `ovs-ofctl add-flows` of `flows` into the switch listening on `port`, once it answers.
pub(crate) fn add_flows(port: u16, flows: &str, dir: &Path) -> Result<()> {
    let target = format!("tcp:127.0.0.1:{port}");
    let ofctl = |args: &[&str]| {
        Command::new("ovs-ofctl")
            .args(["-O", "OpenFlow13"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("ovs-ofctl (apt install openvswitch-common)")
    };
    let started = Instant::now();
    while !ofctl(&["show", &target])?.status.success() {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the switch did not answer OpenFlow on {target} in 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let file = dir.join("flows");
    std::fs::write(&file, flows)?;
    let out = ofctl(&["add-flows", &target, &file.display().to_string()])?;
    if !out.status.success() {
        bail!(
            "ovs-ofctl add-flows: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn run(program: &str, args: &[&str], env: &[(&str, &Path)]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .with_context(|| format!("{program} (apt install openvswitch-switch-dpdk)"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Open vSwitch's programs run in a folder of their own (its database, sockets and logs).
struct Ovs {
    dir: PathBuf,
}

impl Ovs {
    fn env(&self) -> [(&'static str, &Path); 3] {
        let d = self.dir.as_path();
        [("OVS_RUNDIR", d), ("OVS_LOGDIR", d), ("OVS_DBDIR", d)]
    }

    fn db(&self) -> PathBuf {
        self.dir.join("db.sock")
    }

    /// `program` with `args`, its output in `PROGRAM.log`, stopped when the result is dropped.
    fn spawn(&self, program: &str, args: Vec<String>) -> Result<Proc> {
        let name = Path::new(program).file_name().unwrap_or_default();
        let log = std::fs::File::create(self.dir.join(format!("{}.log", name.to_string_lossy())))?;
        let child = crate::ends_with_this_process(&mut Command::new(program))
            .args(args)
            .envs(self.env())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        Ok(Proc::of(child))
    }

    fn vsctl(&self, args: &[&str]) -> Result<()> {
        let db = format!("--db=unix:{}", self.db().display());
        let all: Vec<&str> = ["--timeout=60", db.as_str()]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        run("ovs-vsctl", &all, &self.env())
    }

    /// A fresh database and its server.
    fn database(&self) -> Result<Proc> {
        let conf = self.dir.join("conf.db").display().to_string();
        run(
            "ovsdb-tool",
            &["create", &conf, "/usr/share/openvswitch/vswitch.ovsschema"],
            &[],
        )?;
        let server = self.spawn(
            "ovsdb-server",
            vec![
                conf,
                format!("--remote=punix:{}", self.db().display()),
                format!("--unixctl={}", self.dir.join("db.ctl").display()),
            ],
        )?;
        let started = Instant::now();
        while !self.db().exists() && started.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.vsctl(&["--no-wait", "init"])?;
        Ok(server)
    }

    /// The switch daemon with DPDK: its main thread on CPU 0, one PMD on CPU 1 that sleeps
    /// up to `pmd_max_sleep_us` when it finds little to do (`pmd-maxsleep`; 0: it polls all
    /// the time).
    fn switch(&self, pmd_max_sleep_us: u32) -> Result<Proc> {
        self.vsctl(&[
            "--no-wait",
            "set",
            "Open_vSwitch",
            ".",
            "other_config:dpdk-init=true",
            "other_config:dpdk-extra=--no-pci --file-prefix=stitch-rfc2544-ovs",
            "other_config:dpdk-socket-mem=1024",
            "other_config:pmd-cpu-mask=0x2",
            "other_config:dpdk-lcore-mask=0x1",
            &format!("other_config:pmd-maxsleep={pmd_max_sleep_us}"),
        ])?;
        self.spawn(
            OVS_DPDK,
            vec![
                format!("unix:{}", self.db().display()),
                format!("--unixctl={}", self.dir.join("vs.ctl").display()),
            ],
        )
    }

    /// A netdev bridge whose OpenFlow ports 1, 2, … are `ports` in order, each connecting to
    /// the socket of its name in `sockets`, its OpenFlow endpoint on `port`.
    fn bridge(&self, sockets: &Path, ports: &[&str], port: u16) -> Result<()> {
        let mut args: Vec<String> = [
            "add-br",
            "br0",
            "--",
            "set",
            "bridge",
            "br0",
            "datapath_type=netdev",
            "protocols=OpenFlow13",
            "fail-mode=secure",
        ]
        .map(String::from)
        .to_vec();
        for (i, name) in ports.iter().enumerate() {
            let socket = sockets.join(format!("{name}.sock"));
            args.extend([
                "--".into(),
                "add-port".into(),
                "br0".into(),
                name.to_string(),
                "--".into(),
                "set".into(),
                "interface".into(),
                name.to_string(),
                "type=dpdkvhostuserclient".into(),
                format!("options:vhost-server-path={}", socket.display()),
                format!("ofport_request={}", i + 1),
            ]);
        }
        args.extend([
            "--".into(),
            "set-controller".into(),
            "br0".into(),
            format!("ptcp:{port}:127.0.0.1"),
        ]);
        self.vsctl(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }
}

/// Open vSwitch's DPDK datapath started by [`start_ovs`].
pub(crate) struct OvsRunning {
    _ovs: Ovs,
    /// Its OpenFlow endpoint on 127.0.0.1.
    of_port: u16,
    _processes: Vec<Proc>,
    _hugepages: crate::HugePageReserve,
}

impl OvsRunning {
    /// Where `ovs-ofctl` reaches its bridge.
    pub(crate) fn openflow_target(&self) -> String {
        format!("tcp:127.0.0.1:{}", self.of_port)
    }

    /// The switch daemon's process (`ovs-vswitchd`, its PMD threads included).
    pub(crate) fn pid(&self) -> u32 {
        self._processes[0].pid()
    }
}

/// Open vSwitch with DPDK, its folder in `dir`: a bridge whose ports 1, 2, … are `ports`,
/// connecting to the sockets of their names in `dir` (someone must listen there), with
/// `flows` in its table, its PMD sleeping up to `pmd_max_sleep_us` when idle.
pub(crate) fn start_ovs(
    dir: &Path,
    ports: &[&str],
    flows: &str,
    pmd_max_sleep_us: u32,
) -> Result<OvsRunning> {
    if !Path::new(OVS_DPDK).exists() {
        bail!("{OVS_DPDK} is needed: apt install openvswitch-switch-dpdk");
    }
    let hugepages = crate::HugePageReserve::at_least(OVS_PAGES)?;
    let ovs = Ovs {
        dir: dir.join("ovs"),
    };
    std::fs::create_dir(&ovs.dir)?;
    let database = ovs.database()?;
    let switch = ovs.switch(pmd_max_sleep_us)?;
    let port = crate::free_port()?;
    ovs.bridge(dir, ports, port)?;
    add_flows(port, flows, dir)?;
    Ok(OvsRunning {
        _ovs: ovs,
        of_port: port,
        _processes: vec![switch, database],
        _hugepages: hugepages,
    })
}

/// The graph of `file` with its apps `a` and `b` (vhost_user ports) listening in `dir`, its
/// main worker on CPU 1 if it pins none.
fn graph_on_sockets(file: &Path, dir: &Path) -> Result<String> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut doc: serde_json::Value =
        serde_saphyr::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    for port in ["a", "b"] {
        let app = doc["apps"]
            .get_mut(port)
            .filter(|a| a["type"] == "vhost_user")
            .with_context(|| {
                format!(
                    "{}: the benchmark sends into app `a` and takes from app `b`, which must be \
                     vhost_user ports",
                    file.display()
                )
            })?;
        app["socket"] = dir
            .join(format!("{port}.sock"))
            .display()
            .to_string()
            .into();
    }
    // The device's core, unless the graph places its workers itself.
    if doc.get("workers").is_none_or(serde_json::Value::is_null) {
        doc["workers"] = serde_json::json!({ "main": { "core": 1 } });
    }
    Ok(serde_json::to_string_pretty(&doc)?)
}

/// The flow table in `file`, or the default.
pub fn flows(file: Option<&PathBuf>) -> Result<String> {
    match file {
        Some(f) => std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display())),
        None => Ok(DEFAULT_FLOWS.to_string()),
    }
}
