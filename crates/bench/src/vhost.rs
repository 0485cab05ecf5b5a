//! `stitch bench vhost`: packets through Stitch between two vhost-user ports, against
//! dpdk-testpmd as the vhost-user back-end, in the same run (issue: ≥ testpmd).
//!
//! One testpmd is the front-end: two virtio-user ports in io forwarding with a first burst
//! (`--tx-first`), pinned to CPU 0, so packets circle port 0 → back-end → port 1 → port 0 ….
//! The back-end joins the two sockets on CPU 1: Stitch (`vhost_user` a ↔ b, busy polling) or
//! testpmd (`net_vhost` vdevs, io forwarding). The rate is the front-end's received packets
//! per second over both ports, the median of its one-second samples.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct VhostBenchArgs {
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Runs per back-end (alternated; medians reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Frame size of the first burst the front-end sends.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Give everyone 2 MiB hugepages, as production deployments do: reserves them for the
    /// run (and gives them back after), mounts a hugetlbfs for both testpmds; Stitch's pool
    /// takes them by itself. Without it, everyone runs on 4 KiB pages (`--no-huge`).
    #[arg(long)]
    pub hugepages: bool,
    /// Packets each of Stitch's links between the two ports holds.
    #[arg(long, default_value_t = stitch_core::link::DEFAULT_LINK_SIZE)]
    pub link_size: usize,
}

/// Hugepages reserved and a hugetlbfs mounted for one invocation; both undone on drop.
struct HugePages {
    _reserved: crate::HugePageReserve,
    dir: tempfile::TempDir,
}

impl HugePages {
    fn reserve(pages: u64) -> Result<HugePages> {
        let reserved = crate::HugePageReserve::at_least(pages)?;
        let dir = tempfile::tempdir()?;
        let ok = Command::new("mount")
            .args(["-t", "hugetlbfs", "none"])
            .arg(dir.path())
            .status()?
            .success();
        if !ok {
            bail!("cannot mount a hugetlbfs on {}", dir.path().display());
        }
        Ok(HugePages {
            _reserved: reserved,
            dir,
        })
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

pub(crate) struct Proc {
    child: Child,
    prefix: Option<String>,
}

impl Proc {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A process to stop with SIGINT (and kill after 3 s) when dropped.
    pub(crate) fn of(child: Child) -> Proc {
        Proc {
            child,
            prefix: None,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(p) = &self.prefix {
            let _ = std::fs::remove_dir_all(format!("/var/run/dpdk/{p}"));
        }
    }
}

pub(crate) fn testpmd(
    prefix: &str,
    cpu: usize,
    vdevs: &[String],
    extra: &[&str],
    huge: Option<&std::path::Path>,
) -> Result<Command> {
    if Command::new("sh")
        .args(["-c", "command -v dpdk-testpmd"])
        .output()?
        .stdout
        .is_empty()
    {
        bail!("dpdk-testpmd is missing: `apt install dpdk-dev`");
    }
    let mut c = Command::new("dpdk-testpmd");
    crate::ends_with_this_process(&mut c);
    c.arg("--lcores").arg(format!("0@{cpu},1@{cpu}")).args([
        "--no-pci",
        "-m",
        "1024",
        "--file-prefix",
        prefix,
    ]);
    match huge {
        // One file per memory region: vhost-user passes at most eight.
        Some(dir) => c.arg("--huge-dir").arg(dir).arg("--single-file-segments"),
        None => c.arg("--no-huge"),
    };
    for v in vdevs {
        c.arg("--vdev").arg(v);
    }
    c.args(["--", "--total-num-mbufs=32768", "--forward-mode=io"]);
    c.args(extra);
    Ok(c)
}

/// Runs the front-end for `secs` and returns the median of its Rx-pps sums.
fn front_end(
    dir: &std::path::Path,
    tag: &str,
    secs: f64,
    size: usize,
    huge: Option<&std::path::Path>,
) -> Result<f64> {
    let prefix = format!("sbv{}{tag}f", std::process::id());
    let vdevs: Vec<String> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            format!(
                "net_virtio_user{i},path={}/{s}.sock,queues=1",
                dir.display()
            )
        })
        .collect();
    let size_arg = format!("--txpkts={size}");
    let mut cmd = testpmd(
        &prefix,
        0,
        &vdevs,
        &["--tx-first", "--stats-period", "1", &size_arg],
        huge,
    )?;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the front-end testpmd")?;
    let out = child.stdout.take().unwrap();
    let samples = Arc::new(Mutex::new(Vec::<f64>::new()));
    let s2 = samples.clone();
    let reader = std::thread::spawn(move || {
        let mut sum = 0.0;
        let mut ports = 0;
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Some(rest) = line.trim().strip_prefix("Rx-pps:") {
                let v: f64 = rest
                    .split_whitespace()
                    .next()
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0.0);
                sum += v;
                ports += 1;
                if ports == 2 {
                    s2.lock().unwrap().push(sum);
                    sum = 0.0;
                    ports = 0;
                }
            }
        }
    });
    let front = Proc {
        child,
        prefix: Some(prefix),
    };
    // testpmd takes seconds to start: count `secs` one-second samples from the first one
    // with traffic, leaving that first (partial) one out.
    let wanted = secs.ceil().max(1.0) as usize;
    let moving = |v: &Vec<f64>| {
        v.iter()
            .skip_while(|x| **x == 0.0)
            .skip(1)
            .copied()
            .collect::<Vec<_>>()
    };
    let t = Instant::now();
    while moving(&samples.lock().unwrap()).len() < wanted
        && t.elapsed() < Duration::from_secs_f64(secs + 20.0)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(front);
    let _ = reader.join();
    let all = samples.lock().unwrap().clone();
    log::debug!("front-end samples: {all:?}");
    let v = moving(&all);
    if v.is_empty() {
        bail!("the front-end moved no packets (samples {all:?})");
    }
    Ok(crate::median(v))
}

pub(crate) fn stitch_backend(dir: &std::path::Path, link_size: usize) -> Result<Proc> {
    let graph = dir.join("vhost.yaml");
    std::fs::write(
        &graph,
        format!(
            "engine: {{ busy_poll: true, link_size: {link_size} }}\nworkers: {{ main: {{ core: 1 }} }}\napps:\n  a: {{ type: vhost_user, socket: {d}/a.sock }}\n  b: {{ type: vhost_user, socket: {d}/b.sock }}\nlinks:\n  - \"a.output -> b.input\"\n  - \"b.output -> a.input\"\n",
            d = dir.display()
        ),
    )?;
    stitch_process(dir, &graph)
}

/// `stitch run` of `graph`, its API socket in `dir`.
pub(crate) fn stitch_process(dir: &std::path::Path, graph: &std::path::Path) -> Result<Proc> {
    let child = crate::ends_with_this_process(&mut Command::new(std::env::current_exe()?))
        .args(["run", "--control"])
        .arg(dir.join("api.sock"))
        .arg(graph)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(Proc {
        child,
        prefix: None,
    })
}

pub(crate) fn testpmd_backend(
    dir: &std::path::Path,
    tag: &str,
    huge: Option<&std::path::Path>,
) -> Result<Proc> {
    let prefix = format!("sbv{}{tag}b", std::process::id());
    let vdevs: Vec<String> = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, s)| format!("net_vhost{i},iface={}/{s}.sock,queues=1", dir.display()))
        .collect();
    let child = testpmd(&prefix, 1, &vdevs, &["--stats-period", "5"], huge)?
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(Proc {
        child,
        prefix: Some(prefix),
    })
}

pub(crate) fn wait_sockets(dir: &std::path::Path) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10)
        && !(dir.join("a.sock").exists() && dir.join("b.sock").exists())
    {
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(args: VhostBenchArgs) -> Result<()> {
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "bench vhost: {} B frames, {} pages, {} s × {} runs per back-end, front-end on CPU 0, back-end on CPU 1, load average {}",
        args.size,
        if args.hugepages { "2 MiB" } else { "4 KiB" },
        args.seconds,
        args.runs,
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    // Two testpmds of 1 GiB each and Stitch's pool.
    let huge = args
        .hugepages
        .then(|| HugePages::reserve(1600))
        .transpose()?;
    let huge_dir = huge.as_ref().map(|h| h.dir.path());
    let mut stitch = Vec::new();
    let mut reference = Vec::new();
    for run in 0..args.runs {
        for backend in ["stitch", "testpmd"] {
            let dir = tempfile::tempdir()?;
            let tag = format!("{run}{}", &backend[..1]);
            let _b = if backend == "stitch" {
                stitch_backend(dir.path(), args.link_size)?
            } else {
                testpmd_backend(dir.path(), &tag, huge_dir)?
            };
            wait_sockets(dir.path());
            let mpps = front_end(dir.path(), &tag, args.seconds, args.size, huge_dir)? / 1e6;
            println!("  run {}: {backend:<8} {mpps:.2} Mpps", run + 1);
            if backend == "stitch" {
                stitch.push(mpps);
            } else {
                reference.push(mpps);
            }
        }
    }
    // The machine drifts between slow and fast phases for seconds at a time: the ratio of each
    // run's two back-ends, measured one right after the other, is steadier than the ratio of
    // the two medians.
    let pairs: Vec<f64> = stitch.iter().zip(&reference).map(|(s, t)| s / t).collect();
    let (s, t) = (crate::median(stitch), crate::median(reference));
    println!(
        "median: Stitch {s:.2} Mpps, testpmd (vhost back-end) {t:.2} Mpps — Stitch/testpmd {:.2}; median of the per-run ratios {:.2}",
        s / t,
        crate::median(pairs)
    );
    Ok(())
}
