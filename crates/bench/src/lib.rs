//! `stitch bench`: performance measured against a baseline taken in the same run. One module per
//! benchmark; the `stitch` binary parses the command line and calls `run`.
//!
//! # Map
//!
//! The modules, in short: the harnesses of `stitch bench`, one module each (`chain`, `lwaftr`,
//! `nf`, `nf_scale`, `chain_switch`, `kernel`, `vhost`, `placement`, `capture_link`, `cluster`,
//! `upgrade`, `soak`, `linux_cp`, `rfc2544` — its `tester` on two vhost-user front-ends, the pure binary
//! `search`, the devices under test in `duts`, the `plot`; `xdp_steer`: steering rules timed in the
//! kernel), every figure beside a baseline measured in the same run.

mod capture_link;
mod chain;
mod chain_switch;
mod cluster;
mod kernel;
mod linux_cp;
mod lwaftr;
mod nf;
mod nf_scale;
mod nf_steer;
mod placement;
mod rfc2544;
mod shards;
mod soak;
mod upgrade;
mod vhost;
mod vm2vm;
mod xdp_steer;

use anyhow::Result;
use clap::Subcommand;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{pool, Engine, Graph, Registry};

#[derive(Subcommand)]
pub enum BenchCmd {
    /// generator → N forwarders → sink on one worker, generator → sink alone and a bare loop
    /// moving packets through the same rings (raw-ring baseline), taking turns on one core.
    Chain(crate::chain::ChainArgs),
    /// The lwAFTR on looped PCAP inputs (Snabb's benchmark), against a refill-only baseline.
    /// With --softwires N, on a generated table of N softwires with random traffic over it.
    Lwaftr {
        conf: Option<std::path::PathBuf>,
        v4: Option<std::path::PathBuf>,
        v6: Option<std::path::PathBuf>,
        #[arg(long, conflicts_with = "conf")]
        softwires: Option<usize>,
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// The chain at full rate with and without a live capture of its middle link (PCAPNG to
    /// tmpfs): the tap's cost and drop rate.
    CaptureLink(crate::capture_link::CaptureLinkArgs),
    /// The experiment of fine-grained NFs (docs/references.md): N function processes, each packet
    /// through two of them.
    NfScale(crate::nf_scale::NfScaleArgs),
    /// The inter-VNF bypass's chain: N function processes chained through the OpenFlow switch, with
    /// the point-to-point path (bypass on) or a lookup per packet (off).
    ChainSwitch(crate::chain_switch::ChainSwitchArgs),
    /// InKeV's evaluation: chains of 1..N routers between two hosts — Stitch in the kernel,
    /// Linux router namespaces, Open vSwitch (userspace datapath) with router namespaces and
    /// Stitch's userspace engine — round trips, connection setups and iperf3 in one run.
    Kernel(crate::kernel::KernelBenchArgs),
    /// The same five-forwarder chain all in the engine and with its middle function in the
    /// kernel, in a function process and behind a vhost-user port, beside one af_packet
    /// interface hop: Mpps and ns per packet per crossing.
    Placement(crate::placement::PlacementArgs),
    /// The cluster's control plane at scale: N agents applying to a dry run against one etcd
    /// cluster, M apps placed; time until every host runs a change, etcd writes, memory.
    Cluster(crate::cluster::ClusterBenchArgs),
    /// The traffic gap and frames lost while a running instance is replaced by `stitch
    /// upgrade` and by kill -9 + restart, beside a live apply and a quiet window.
    Upgrade(crate::upgrade::UpgradeBenchArgs),
    /// Minutes of traffic through the engine and a function process while the instance is
    /// changed live, its API abused, its function killed and the instance upgraded: fails on
    /// growth of memory, descriptors or threads, or on a frame lost without a counter.
    Soak(crate::soak::SoakArgs),
    /// Packets through Stitch between two vhost-user ports, against testpmd as the vhost-user
    /// back-end, with one testpmd of two virtio-user ports as the front-end.
    Vhost(crate::vhost::VhostBenchArgs),
    /// RFC 2544 through vhost-user ports: the no-drop and partial-drop rates by binary search
    /// and latency at fractions of the no-drop rate, Stitch beside testpmd's io forwarding.
    Rfc2544(crate::rfc2544::Rfc2544Args),
    /// The inter-VNF bypass with VMs: chains of testpmd guests through the OpenFlow switch, with
    /// and without direct paths between VM ports.
    Vm2vm(crate::vm2vm::Vm2vmArgs),
    /// What `af_xdp` steering rules cost a frame in the interface's XDP program, timed by the
    /// kernel against the program without rules.
    XdpSteer(crate::xdp_steer::XdpSteerArgs),
    /// One function as 1, 2, … shards between two veth interfaces (fanout), each shard's
    /// packets per CPU-second, and the hand-off hop between shards.
    Shards(crate::shards::ShardsArgs),
    /// A router following a kernel table while a full table is written into it: time until
    /// Stitch forwards by every route beside the kernel taking them, and the forwarding rate
    /// during and after, against the same routes configured.
    LinuxCp(crate::linux_cp::LinuxCpArgs),
    /// One network function with a realistic table against a raw-ring baseline in the same
    /// run.
    Nf {
        /// The function (the names are the benchmark's own list), or `all`.
        #[arg(value_parser = nf_names())]
        name: String,
        /// Measured seconds per loop.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Runs (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[command(flatten)]
        stateful: nf::StatefulArgs,
    },
}

/// What `stitch bench nf` takes: every function it measures, and `all`.
fn nf_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(nf::NAMES.iter().copied().chain(["all"]))
}

/// 2 MiB hugepages reserved for one benchmark (the packet pool takes them by itself when
/// there are enough) and given back when dropped.
pub(crate) struct HugePageReserve {
    before: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// A temporary folder that function processes, which run as another user, may enter (not
/// list): the folder of their attach socket.
fn enterable_tempdir() -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))?;
    Ok(dir)
}

/// 2 MiB hugepages the kernel holds reserved now.
fn nr_hugepages() -> Result<u64> {
    Ok(std::fs::read_to_string(NR_HUGEPAGES)?.trim().parse()?)
}

impl HugePageReserve {
    pub(crate) fn at_least(pages: u64) -> Result<HugePageReserve> {
        use anyhow::Context;
        let before = nr_hugepages()?;
        if before < pages {
            std::fs::write(NR_HUGEPAGES, pages.to_string())
                .context("reserving hugepages (needs root)")?;
            let mut got = nr_hugepages()?;
            if got < pages {
                // Memory fragmented by earlier runs: compact it and ask again.
                let _ = std::fs::write("/proc/sys/vm/compact_memory", "1");
                let _ = std::fs::write(NR_HUGEPAGES, pages.to_string());
                got = nr_hugepages()?;
            }
            if got < pages {
                log::warn!(
                    "only {got} of {pages} hugepages could be reserved: the pool may fall back \
                     to ordinary pages"
                );
            }
        }
        Ok(HugePageReserve { before })
    }

    /// Pages for a pool of `packets` ordinary buffers and the default large ones.
    pub(crate) fn for_pool(packets: usize) -> Result<HugePageReserve> {
        Self::at_least(pool::hugepages_needed(packets, pool::DEFAULT_LARGE_PACKETS) as u64)
    }
}

impl Drop for HugePageReserve {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
    }
}

/// A veth pair `a`–`b` in this namespace, up, without IPv6 (no router solicitations on the
/// wire), removed when dropped.
pub(crate) struct VethPair {
    pub a: String,
    pub b: String,
}

impl VethPair {
    pub(crate) fn new(a: &str, b: &str) -> Result<VethPair> {
        crate::kernel::quiet(&format!("ip link del {a}"));
        crate::kernel::sh(&format!(
            "ip link add {a} type veth peer name {b} && for d in {a} {b}; do sysctl -qw net.ipv6.conf.$d.disable_ipv6=1; ip link set $d up; done"
        ))?;
        Ok(VethPair {
            a: a.to_string(),
            b: b.to_string(),
        })
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        crate::kernel::quiet(&format!("ip link del {}", self.a));
    }
}

/// CPU time (user and system) of process `pid` so far, from /proc; `None` once it is gone.
pub(crate) fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / clock_ticks())
}

/// Clock ticks per second, the unit of CPU times in /proc/PID/stat.
pub(crate) fn clock_ticks() -> f64 {
    // SAFETY: sysconf takes no pointers.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// CPU seconds used by `who` (RUSAGE_SELF, RUSAGE_CHILDREN; for the calling thread,
/// [`thread_cpu_seconds`]).
pub(crate) fn cpu_seconds(who: i32) -> f64 {
    // SAFETY: rusage is a C struct of integers; all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into `u`, which is live.
    unsafe { libc::getrusage(who, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// CPU time of the calling thread, to the nanosecond (getrusage brings a running thread's time
/// up to date only at the scheduler's ticks, too coarse for slices of milliseconds).
pub(crate) fn thread_cpu_seconds() -> f64 {
    clock_seconds(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of thread `tid` of this process, to the nanosecond: the thread's own CPU-time
/// clock, as glibc's `pthread_getcpuclockid` makes its id from a thread id.
pub(crate) fn cpu_seconds_of_thread(tid: libc::pid_t) -> f64 {
    const CPUCLOCK_SCHED: libc::clockid_t = 2;
    const CPUCLOCK_PERTHREAD: libc::clockid_t = 4;
    clock_seconds((!tid << 3) | CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED)
}

/// Seconds on `clock`; 0 for a clock that does not exist (a thread that has gone).
fn clock_seconds(clock: libc::clockid_t) -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `t`, which is live; an id naming no
    // clock makes it fail with EINVAL and leave `t` at zero.
    unsafe { libc::clock_gettime(clock, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// The ids of this process's threads named `name` (at most 15 bytes, as Linux keeps them).
pub(crate) fn threads_named(name: &str) -> Vec<libc::pid_t> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// One measurement: packets through, wall seconds, CPU seconds of the measuring scope.
#[derive(Clone, Copy, Default, serde::Serialize)]
pub(crate) struct Sample {
    packets: u64,
    wall: f64,
    cpu: f64,
}

/// Windows added up: their packets, wall and CPU time.
impl std::ops::AddAssign for Sample {
    fn add_assign(&mut self, other: Sample) {
        self.packets += other.packets;
        self.wall += other.wall;
        self.cpu += other.cpu;
    }
}

impl Sample {
    pub(crate) fn mpps(&self) -> f64 {
        self.packets as f64 / self.wall / 1e6
    }
    /// Nanoseconds of CPU per packet (robust to preemption on a shared machine).
    pub(crate) fn ns_per_packet(&self) -> f64 {
        self.cpu * 1e9 / self.packets.max(1) as f64
    }
}

/// Makes the process `cmd` starts receive SIGTERM when this one ends, however it ends: an
/// interrupted benchmark leaves no device under test or peer running.
pub(crate) fn ends_with_this_process(
    cmd: &mut std::process::Command,
) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl, which
    // is async-signal-safe and touches no memory.
    unsafe {
        cmd.pre_exec(
            || match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            },
        )
    }
}

/// A TCP port of 127.0.0.1 free a moment ago.
pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The chain's graph; with `worker`, all its apps on that worker, pinned to the given core.
fn chain_graph(hops: usize, size: usize, worker: Option<(&str, usize)>, latency: bool) -> String {
    let (workers, on) = match worker {
        Some((name, core)) => (
            format!("workers: {{ {name}: {{ core: {core} }} }}\n"),
            format!(", worker: {name}"),
        ),
        None => (String::new(), String::new()),
    };
    let mut s = format!(
        "engine: {{ busy_poll: true }}\n{workers}apps:\n  src: {{ type: generator, size: {size}, timestamps: {latency}{on} }}\n  out: {{ type: sink{on} }}\n"
    );
    for i in 1..=hops {
        s += &format!("  f{i}: {{ type: forwarder{on} }}\n");
    }
    s += "links:\n";
    let mut prev = "src.output".to_string();
    for i in 1..=hops {
        s += &format!("  - \"{prev} -> f{i}.input\"\n");
        prev = format!("f{i}.output");
    }
    s += &format!("  - {{ link: \"{prev} -> out.input\", latency: {latency} }}\n");
    s
}

/// Packets the app named `out` has received: its own `packets` counter where it keeps one (a
/// `sink`'s survives the graph's changes, while its links' counters start again with each new
/// link), else what its links delivered.
pub(crate) fn sink_packets(e: &Engine) -> u64 {
    e.stats()
        .apps
        .iter()
        .find(|a| a.name == "out")
        .map(|a| a.counters.get("packets").copied().unwrap_or(a.rx_packets))
        .unwrap_or(0)
}

/// The chain of `hops` forwarders running in a fresh engine.
pub(crate) fn start_chain(registry: &Arc<Registry>, hops: usize, size: usize) -> Result<Engine> {
    start_chain_on(registry, hops, size, None)
}

/// [`start_chain`], with `worker` naming the worker thread and the core it is pinned to.
pub(crate) fn start_chain_on(
    registry: &Arc<Registry>,
    hops: usize,
    size: usize,
    worker: Option<(&str, usize)>,
) -> Result<Engine> {
    let engine = Engine::new(registry.clone());
    engine.apply(parse_chain(registry, hops, size, worker, false)?)?;
    Ok(engine)
}

/// The chain's graph ([`chain_graph`]) parsed for `registry`.
pub(crate) fn parse_chain(
    registry: &Arc<Registry>,
    hops: usize,
    size: usize,
    worker: Option<(&str, usize)>,
    latency: bool,
) -> Result<Graph> {
    Graph::parse(
        &chain_graph(hops, size, worker, latency),
        "<bench>",
        Path::new("."),
        registry,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// After `settle`, `secs` of the running chain: packets into `out`, wall time and the whole
/// process's CPU time.
pub(crate) fn measure_window(engine: &Engine, settle: Duration, secs: f64) -> Sample {
    std::thread::sleep(settle);
    let (p0, t0, c0) = (
        sink_packets(engine),
        Instant::now(),
        cpu_seconds(libc::RUSAGE_SELF),
    );
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (p1, c1) = (sink_packets(engine), cpu_seconds(libc::RUSAGE_SELF));
    Sample {
        packets: p1 - p0,
        wall: t0.elapsed().as_secs_f64(),
        cpu: c1 - c0,
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The first quartile, the median and the third quartile of `v` (not empty), each the value at
/// its rank (no interpolation), as [`median`] takes it.
pub(crate) fn quartiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: usize| v[(v.len() * q / 4).min(v.len() - 1)];
    (at(1), at(2), at(3))
}

/// Runs one benchmark; `registry` makes the app types of this build (the engine benchmarks
/// build their graphs from it).
pub fn run(cmd: BenchCmd, registry: fn() -> Registry) -> Result<()> {
    match cmd {
        BenchCmd::Chain(args) => chain::run(Arc::new(registry()), args),
        BenchCmd::Lwaftr {
            conf,
            v4,
            v6,
            softwires,
            seconds,
            runs,
        } => {
            anyhow::ensure!(runs >= 1, "--runs must be at least 1");
            match (softwires, conf, v4, v6) {
                (Some(n), ..) => lwaftr::bench_generated(n, seconds, runs),
                (None, Some(conf), Some(v4), Some(v6)) => {
                    lwaftr::bench(&conf, lwaftr::looped(&v4, &v6)?, seconds, runs)
                }
                _ => anyhow::bail!("give CONF V4.pcap V6.pcap, or --softwires N"),
            }
        }
        BenchCmd::CaptureLink(args) => capture_link::run(args, registry()),
        BenchCmd::NfScale(args) if args.steer => nf_steer::run(args, registry()),
        BenchCmd::NfScale(args) => nf_scale::run(args, registry()),
        BenchCmd::ChainSwitch(args) => chain_switch::run(args, registry()),
        BenchCmd::Kernel(args) => kernel::run(args),
        BenchCmd::Placement(args) => placement::run(args, registry()),
        BenchCmd::Upgrade(args) => upgrade::run(args),
        BenchCmd::Soak(args) => soak::run(args),
        BenchCmd::Cluster(args) => cluster::run(args, registry()),
        BenchCmd::Vhost(args) => vhost::run(args),
        BenchCmd::Rfc2544(args) => rfc2544::run(args),
        BenchCmd::Vm2vm(args) => vm2vm::run(args),
        BenchCmd::XdpSteer(args) => xdp_steer::run(args),
        BenchCmd::LinuxCp(args) => linux_cp::run(args),
        BenchCmd::Shards(args) => shards::run(args, registry),
        BenchCmd::Nf {
            name,
            seconds,
            runs,
            stateful,
        } => {
            anyhow::ensure!(runs >= 1, "--runs must be at least 1");
            if name == "all" {
                for n in nf::NAMES {
                    nf::run(n, seconds, runs, &Default::default())?;
                }
                return Ok(());
            }
            nf::run(&name, seconds, runs, &stateful)
        }
    }
}
