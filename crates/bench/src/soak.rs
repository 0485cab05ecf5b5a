//! `stitch bench soak`: an instance under rate-limited numbered traffic for minutes, through
//! its engine and a function process, while the bench changes it live every period, abuses its
//! API, kills its function now and then and upgrades it every so often. It samples the
//! instance's process (RSS, open descriptors, threads), its packet pool and its drop counters
//! after every period, and fails on growth or on a frame that vanished without a counter
//! saying so.
//!
//! Frames cross the same rig as `stitch bench upgrade --function-process` (two veth pairs,
//! `af_packet` ports, the firewall function in a process of its own, with `--kernel` a
//! forwarder in the kernel, with `--guest` a guest's virtio driver on a `vhost_user` port, a
//! rate meter added and removed by the live changes).

use crate::upgrade::{Hops, Rig, Stream, Traffic};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use stitch_api::client;

#[derive(clap::Args)]
pub struct SoakArgs {
    /// How long to run.
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// Frames sent per second.
    #[arg(long, default_value_t = 2_000)]
    rate: u64,
    /// Seconds between two live changes (and two samples).
    #[arg(long, default_value_t = 5.0)]
    period: f64,
    /// The function process is killed (-9) every this many periods.
    #[arg(long, default_value_t = 5)]
    kill_every: usize,
    /// The instance is upgraded (`stitch upgrade`) every this many seconds.
    #[arg(long, default_value_t = 60.0)]
    upgrade_every: f64,
    /// Write every sample as a CSV row to this file.
    #[arg(long)]
    record: Option<PathBuf>,
    /// The frames also cross a forwarder in the kernel (`placement: kernel`), whose data plane
    /// every upgrade takes as it runs.
    #[arg(long)]
    kernel: bool,
    /// The frames also cross a guest: dpdk-testpmd's virtio-user port (io forwarding) on a
    /// `vhost_user` port, which every upgrade hands over.
    #[arg(long)]
    guest: bool,
}

/// One look at the instance after a period.
#[derive(Debug, Clone, serde::Serialize)]
struct Sample {
    at_s: f64,
    action: &'static str,
    pid: i32,
    /// The process's own memory (`RssAnon`): its heap and stacks.
    rss_anon_kib: u64,
    /// Shared memory it touched (`RssShmem`): mostly the packet pool, whose pages are touched
    /// as buffers are first used, up to the pool's size.
    rss_shmem_kib: u64,
    fds: u64,
    threads: u64,
    pool_in_use: u64,
    sent: u64,
    /// Frames sent before the period's last half second that never arrived.
    lost: u64,
    /// What the instance's counters say it dropped or lost.
    counted: u64,
}

const CSV_HEADER: &str =
    "at_s,action,pid,rss_anon_kib,rss_shmem_kib,fds,threads,pool_in_use,sent,lost,counted";

impl Sample {
    fn csv(&self) -> String {
        format!(
            "{:.1},{},{},{},{},{},{},{},{},{},{}",
            self.at_s,
            self.action,
            self.pid,
            self.rss_anon_kib,
            self.rss_shmem_kib,
            self.fds,
            self.threads,
            self.pool_in_use,
            self.sent,
            self.lost,
            self.counted
        )
    }
}

/// The process that runs the instance on `socket` (`stitch run`, or the `take-over` that
/// replaced it): the one whose command line names the socket.
fn instance_pid(socket: &Path) -> Result<i32> {
    let out = Command::new("pgrep")
        .args(["-n", "-f", &format!("[ ]--control {}", socket.display())])
        .output()?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("no process runs the instance")
}

/// A field of `/proc/PID/status` in its unit (kB for sizes).
fn status_field(pid: i32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// Every frame the instance says it dropped or lost: the apps' `drops` (their output links'
/// `tx_drops` and their own counters of drops: `kernel_drops`, `down_drops`, …), what their
/// functions lost in a restart (`restart_lost`) and the drops of links removed by live changes.
fn counted_drops(stats: &Value) -> u64 {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let apps: u64 = (stats["apps"].as_array().into_iter().flatten())
        .map(|app| {
            let lost: u64 = (app["counters"].as_object().into_iter().flatten())
                .filter(|(k, _)| k.ends_with("lost"))
                .map(|(_, v)| n(v))
                .sum();
            n(&app["drops"]) + lost
        })
        .sum();
    apps + n(&stats["removed_link_drops"])
}

/// Malformed and oversized requests: each must be refused with a 4xx and change nothing.
fn abuse_api(socket: &Path) -> Result<()> {
    use client::Method;
    let before = client::call(socket, Method::GET, "/api/v1/graph", None)?.1;
    let requests: [(Method, &str, Vec<u8>); 4] = [
        (Method::PUT, "/api/v1/graph", b"apps: [ {".to_vec()),
        (Method::PUT, "/api/v1/graph", vec![b'{'; 4 << 20]),
        (Method::PUT, "/api/v1/apps/a", b"{\"type\": 7".to_vec()),
        (
            Method::POST,
            "/api/v1/links",
            b"{\"link\": \"nowhere\"}".to_vec(),
        ),
    ];
    for (method, path, body) in requests {
        let (status, answer) = client::call(socket, method.clone(), path, Some(body))?;
        if !(400..500).contains(&status) {
            bail!(
                "{method} {path} with a bad body was answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }
    // Beyond the API's 64 MiB limit: a 413, or the connection closed before the body is read.
    let oversized = vec![b' '; (64 << 20) + 1];
    if let Ok((status, _)) = client::call(socket, Method::PUT, "/api/v1/graph", Some(oversized)) {
        if status != 413 {
            bail!("a graph over the API's size limit was answered {status}");
        }
    }
    // Bytes that are not HTTP at all.
    if let Ok(mut raw) = std::os::unix::net::UnixStream::connect(socket) {
        let _ = raw.write_all(b"\x16\x03\x01\x02\x00 not http\r\n\r\n");
    }
    let after = client::call(socket, Method::GET, "/api/v1/graph", None)?.1;
    if after != before {
        bail!("a refused request changed the graph");
    }
    Ok(())
}

/// What the bench does in period `i`: a live change always, the API abuse always, and now and
/// then a function kill or an upgrade; returns its name for the record.
fn act(rig: &Rig, args: &SoakArgs, i: usize, upgrade_due: bool) -> Result<&'static str> {
    let socket = rig.socket();
    rig.apply_live(i.is_multiple_of(2))?;
    abuse_api(&socket)?;
    if upgrade_due {
        rig.stitch(&["upgrade"])?;
        return Ok("upgrade");
    }
    if i % args.kill_every == args.kill_every - 1 {
        let stats = client::json(&socket, client::Method::GET, "/api/v1/apps/f", None)?;
        let pid = stats["process"]["pid"]
            .as_i64()
            .context("the function has no process")?;
        // SAFETY: kill takes no pointers.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        return Ok("function kill -9");
    }
    Ok("live apply")
}

/// The look from which frames are accounted for. Frames sent before the path is whole (the
/// guest posting its first buffers, the function attaching) are dropped and counted, or not
/// even seen: nobody's to count. The path is whole once a second's frames arrived, every one,
/// and no drop counter moved in that second: then every frame sent before the look's window
/// that is missing was dropped before it, and no frame sent in its window was.
fn settle(rig: &Rig, traffic: &Traffic, rate: u64) -> Result<Sample> {
    let patience = Instant::now();
    let mut before = sample(rig, traffic, rate, "start")?;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = sample(rig, traffic, rate, "start")?;
        let between = lost_until(traffic, rate, now.at_s - 0.5)
            - lost_until(traffic, rate, before.at_s - 0.5);
        if between == 0 && now.counted == before.counted && now.sent > before.sent {
            return Ok(now);
        }
        if patience.elapsed() > Duration::from_secs(30) {
            bail!(
                "the path through the instance did not settle in 30 s: {} frames lost, {} \
                 counted in the last second\n{}",
                between,
                now.counted - before.counted,
                drops_by_place(rig)
            );
        }
        before = now;
    }
}

/// Fails when frames sent before the look `before` still missed at the look `now`, a period
/// later, outnumber every drop the instance counted by `now`; the failure says where the
/// instance counted its drops.
fn check_accounted(
    rig: &Rig,
    traffic: &Traffic,
    rate: u64,
    before: &Sample,
    now: &Sample,
    settled: u64,
) -> Result<()> {
    let missing = lost_until(traffic, rate, before.at_s - 0.5).saturating_sub(settled);
    if missing > now.counted {
        bail!(
            "{} frames vanished: {missing} sent by {:.0} s still missing at {:.0} s, the \
             counters account for {}\n{}\n{}",
            missing - now.counted,
            before.at_s - 0.5,
            now.at_s,
            now.counted,
            where_lost(traffic, rate, before.at_s - 0.5),
            drops_by_place(rig)
        );
    }
    Ok(())
}

/// For a failure's message: every drop counter that is not zero, of each app and of the
/// veths and the host's backlog (drops there are no app's, and no counter of the instance's).
fn drops_by_place(rig: &Rig) -> String {
    let mut out = Vec::new();
    if let Ok(stats) = client::json(&rig.socket(), client::Method::GET, "/api/v1/stats", None) {
        for app in stats["apps"].as_array().into_iter().flatten() {
            let counters = (app["counters"].as_object().into_iter().flatten())
                .filter(|(k, v)| (k.ends_with("drops") || k.ends_with("lost")) && v != &0)
                .map(|(k, v)| format!("{k} {v}"));
            let all: Vec<String> = std::iter::once(format!("drops {}", app["drops"]))
                .chain(counters)
                .collect();
            out.push(format!("app {}: {}", app["name"], all.join(", ")));
        }
        out.push(format!("removed links: {}", stats["removed_link_drops"]));
    }
    for v in rig.interfaces() {
        let read = |what: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{v}/statistics/{what}"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        out.push(format!(
            "{v}: rx_dropped {}, tx_dropped {}",
            read("rx_dropped"),
            read("tx_dropped")
        ));
    }
    // /proc/net/softnet_stat: per CPU, the second column counts the backlog's drops (hex).
    if let Ok(softnet) = std::fs::read_to_string("/proc/net/softnet_stat") {
        let dropped: Vec<&str> = softnet
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect();
        out.push(format!(
            "backlog drops per CPU (hex): {}",
            dropped.join(" ")
        ));
    }
    format!("where frames were dropped:\n  {}", out.join("\n  "))
}

/// For a failure's message: when the missing frames were sent (runs of consecutive sequence
/// numbers, by send time), so that a stall tells itself apart from a steady leak.
fn where_lost(traffic: &Traffic, rate: u64, until: f64) -> String {
    let last = ((until * rate as f64) as usize).min(traffic.arrivals.len());
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (seq, a) in traffic.arrivals[..last].iter().enumerate() {
        if a.load(Ordering::Relaxed) != 0 {
            continue;
        }
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == seq => *end = seq,
            _ => runs.push((seq, seq)),
        }
    }
    let at = |seq: usize| seq as f64 / rate as f64;
    let shown: Vec<String> = (runs.iter().take(12))
        .map(|&(a, b)| format!("{:.3}–{:.3} s ({})", at(a), at(b), b - a + 1))
        .collect();
    format!(
        "missing frames were sent in {} runs: {}{}",
        runs.len(),
        shown.join(", "),
        if runs.len() > shown.len() {
            ", …"
        } else {
            ""
        }
    )
}

/// Frames sent from the start up to `until` seconds that never arrived.
fn lost_until(traffic: &Traffic, rate: u64, until: f64) -> u64 {
    let last = ((until * rate as f64) as usize).min(traffic.arrivals.len());
    (traffic.arrivals[..last].iter())
        .filter(|a| a.load(Ordering::Relaxed) == 0)
        .count() as u64
}

fn sample(rig: &Rig, traffic: &Traffic, rate: u64, action: &'static str) -> Result<Sample> {
    let socket = rig.socket();
    let stats = client::json(&socket, client::Method::GET, "/api/v1/stats", None)?;
    let at_s = traffic.start.elapsed().as_secs_f64();
    let pid = instance_pid(&socket)?;
    Ok(Sample {
        at_s,
        action,
        pid,
        rss_anon_kib: status_field(pid, "RssAnon")?,
        rss_shmem_kib: status_field(pid, "RssShmem")?,
        fds: std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64,
        threads: status_field(pid, "Threads")?,
        pool_in_use: stats["pool"]["in_use"].as_u64().unwrap_or(0),
        sent: traffic.sent.load(Ordering::Relaxed),
        // Frames sent in the last half second may still be on their way.
        lost: lost_until(traffic, rate, at_s - 0.5),
        counted: counted_drops(&stats),
    })
}

/// The middle and the last third of `samples` (the first third warms up: the allocator's
/// arenas fill, the pool's buffers are first touched).
fn middle_and_last(samples: &[Sample]) -> Option<(&[Sample], &[Sample])> {
    let third = samples.len() / 3;
    (third > 0).then(|| {
        (
            &samples[third..samples.len() - third],
            &samples[samples.len() - third..],
        )
    })
}

/// Growth from the middle to the last third of the run: descriptors, threads and packets in
/// use no more than two above; the process's own memory, judged over the longest-lived process
/// (an upgrade starts a fresh one), within a quarter and 32 MiB. Each third is judged by its
/// least, so that a sample taken mid-restart of the function or after a large request does not
/// count, while a leak raises them all.
fn check_growth(samples: &[Sample]) -> Result<()> {
    let least = |s: &[Sample], f: fn(&Sample) -> u64| s.iter().map(f).min().unwrap_or(0);
    let (middle, late) = middle_and_last(samples)
        .context("too short to judge growth: run at least three periods")?;
    for (what, f) in [
        (
            "open descriptors",
            (|s: &Sample| s.fds) as fn(&Sample) -> u64,
        ),
        ("threads", |s: &Sample| s.threads),
        ("packets in use", |s: &Sample| s.pool_in_use),
    ] {
        if least(late, f) > least(middle, f) + 2 {
            bail!(
                "{what} grew: at least {} in the middle third of the run, {} in the last",
                least(middle, f),
                least(late, f)
            );
        }
    }
    let longest = (samples.chunk_by(|a, b| a.pid == b.pid))
        .max_by_key(|run| run.len())
        .unwrap_or_default();
    if let Some((middle, late)) = middle_and_last(longest) {
        let rss = |s: &Sample| s.rss_anon_kib;
        if least(late, rss) > least(middle, rss) * 5 / 4 + 32 * 1024 {
            bail!(
                "process {}'s own memory grew: at least {} KiB in the middle third of its life, {} KiB in the last",
                longest[0].pid,
                least(middle, rss),
                least(late, rss)
            );
        }
    }
    Ok(())
}

pub fn run(args: SoakArgs) -> Result<()> {
    if args.kill_every == 0 || args.period <= 0.0 {
        bail!("--kill-every and --period must be above 0");
    }
    let hops = Hops {
        function_process: true,
        kernel: args.kernel,
        guest: args.guest,
    };
    let mut rig = Rig::new("sbs", hops)?;
    rig.start()?;
    let total = args.minutes * 60.0 + 2.0 * args.period + 5.0;
    let stream = Stream::start(&rig, total, args.rate);
    let traffic = stream.traffic.clone();
    let mut record = match &args.record {
        Some(path) => {
            let mut f = std::fs::File::create(path)
                .with_context(|| format!("cannot write {}", path.display()))?;
            writeln!(f, "{CSV_HEADER}")?;
            Some(f)
        }
        None => None,
    };
    let settled = settle(&rig, &traffic, args.rate)?;
    let outcome = (|| -> Result<Vec<Sample>> {
        let mut samples = Vec::new();
        let mut last_upgrade = 0.0;
        let mut i = 0;
        while traffic.start.elapsed().as_secs_f64() < args.minutes * 60.0 {
            let at = traffic.start.elapsed().as_secs_f64();
            let upgrade_due = at - last_upgrade >= args.upgrade_every;
            let action =
                act(&rig, &args, i, upgrade_due).with_context(|| format!("at {at:.0} s"))?;
            if upgrade_due {
                last_upgrade = at;
            }
            std::thread::sleep(Duration::from_secs_f64(
                (at + args.period - traffic.start.elapsed().as_secs_f64()).max(0.0),
            ));
            let mut s = sample(&rig, &traffic, args.rate, action)?;
            s.lost -= settled.lost.min(s.lost);
            s.counted -= settled.counted.min(s.counted);
            if let Some(f) = record.as_mut() {
                writeln!(f, "{}", s.csv())?;
            }
            eprintln!("{}", s.csv());
            // A frame may be late (a stall on a loaded machine): it has vanished when, a period
            // after the last look, it still has not come and no counter says it was dropped.
            if let Some(before) = samples.last() {
                check_accounted(&rig, &traffic, args.rate, before, &s, settled.lost)?;
            }
            samples.push(s);
            i += 1;
        }
        // The last look's frames get their period too.
        if let Some(last) = samples.last() {
            std::thread::sleep(Duration::from_secs_f64(args.period));
            let mut s = sample(&rig, &traffic, args.rate, "last look")?;
            s.counted -= settled.counted.min(s.counted);
            check_accounted(&rig, &traffic, args.rate, last, &s, settled.lost)?;
        }
        Ok(samples)
    })();
    drop(traffic);
    let bench_socket_drops = stream.stop()?;
    let samples = outcome?;
    rig.tear_down()?;
    check_growth(&samples)?;
    let last = samples.last().context("no sample")?;
    let json = serde_json::json!({
        "minutes": args.minutes,
        "rate": args.rate,
        "periods": samples.len(),
        "upgrades": samples.iter().filter(|s| s.action == "upgrade").count(),
        "function_kills": samples.iter().filter(|s| s.action == "function kill -9").count(),
        "sent": last.sent,
        "lost": last.lost,
        "counted_drops": last.counted,
        "bench_socket_drops": bench_socket_drops,
        "rss_anon_kib": [samples[0].rss_anon_kib, last.rss_anon_kib],
        "rss_shmem_kib": [samples[0].rss_shmem_kib, last.rss_shmem_kib],
        "fds": [samples[0].fds, last.fds],
        "threads": [samples[0].threads, last.threads],
    });
    println!("{}", serde_json::to_string_pretty(&json)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(rss: impl Fn(usize) -> u64, fds: impl Fn(usize) -> u64) -> Vec<Sample> {
        (0..12)
            .map(|i| Sample {
                at_s: i as f64,
                action: "live apply",
                pid: 1,
                rss_anon_kib: rss(i),
                rss_shmem_kib: 0,
                fds: fds(i),
                threads: 11,
                pool_in_use: 0,
                sent: 0,
                lost: 0,
                counted: 0,
            })
            .collect()
    }

    #[test]
    fn a_warm_up_and_a_plateau_pass_a_leak_does_not() {
        let plateau = |i: usize| {
            if i < 4 {
                4_000 * (i as u64 + 1)
            } else {
                70_000
            }
        };
        assert!(check_growth(&samples(plateau, |_| 32)).is_ok());
        let leaking_memory = |i: usize| 70_000 + 20_000 * i as u64;
        let mut upgraded = samples(leaking_memory, |_| 32);
        upgraded[11].pid = 2;
        upgraded[11].rss_anon_kib = 4_000;
        let e = check_growth(&upgraded).unwrap_err();
        assert!(e.to_string().contains("process 1's own memory grew"), "{e}");
        let e = check_growth(&samples(leaking_memory, |_| 32)).unwrap_err();
        assert!(e.to_string().contains("memory grew"), "{e}");
        let leaking_fds = |i: usize| 32 + i as u64;
        let e = check_growth(&samples(|_| 70_000, leaking_fds)).unwrap_err();
        assert!(e.to_string().contains("open descriptors grew"), "{e}");
        assert!(check_growth(&samples(|_| 1, |_| 1)[..2]).is_err());
    }

    #[test]
    fn counted_drops_takes_each_drop_once() {
        let stats = serde_json::json!({
            "apps": [
                { "drops": 7, "counters": { "down_drops": 5, "kernel_drops": 2, "restart_lost": 3 } },
                { "drops": 1, "counters": {} },
            ],
            "links": [ { "tx_drops": 1 } ],
            "removed_link_drops": 4,
        });
        // An app's `drops` already holds its `…drops` counters and its output links' drops.
        assert_eq!(counted_drops(&stats), 7 + 3 + 1 + 4);
    }
}
