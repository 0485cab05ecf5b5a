//! `stitch run --supervise`: a small parent that keeps an instance running where no service
//! manager does. It starts `stitch run` with the same arguments and, when that process is
//! killed or crashes, starts it again (100 ms, doubling to 10 s; back to 100 ms after 10 s of
//! running): the new process reads the state file and adopts the function processes the
//! old one left running. A `stitch upgrade` hands the instance to a process that is not this
//! one's child: the old process names it on the notify socket this parent gives its child
//! (`NOTIFY_SOCKET`, as systemd does: `MAINPID=`), and this parent watches it through a pidfd
//! from then on. SIGINT, SIGTERM and SIGHUP are passed on to whichever process runs the
//! instance. A crash is a signal or a panic (exit status 101) — or, for a successor, an end
//! that leaves the API socket behind; any other end (a stop, a graph that does not load)
//! ends this parent too, with the same status.

use anyhow::{Context, Result};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_place::pidfd;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
const STABLE_RUN: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(20);

/// The process that runs the instance now.
enum Runner {
    Child(Child),
    /// A successor that took over (`stitch upgrade`), not this process's child.
    Adopted {
        pid: u32,
        pidfd: OwnedFd,
    },
}

impl Runner {
    fn pid(&self) -> u32 {
        match self {
            Runner::Child(c) => c.id(),
            Runner::Adopted { pid, .. } => *pid,
        }
    }

    fn signal(&self, signal: i32) {
        match self {
            // SAFETY: kill takes no pointers; the child is not reaped before this call.
            Runner::Child(c) => unsafe {
                libc::kill(c.id() as i32, signal);
            },
            Runner::Adopted { pidfd, .. } => {
                pidfd::signal(pidfd, signal);
            }
        }
    }

    /// How it ended, once it has.
    fn ended(&mut self, api_socket: &Path) -> Option<End> {
        match self {
            Runner::Child(c) => {
                use std::os::unix::process::ExitStatusExt;
                let status = c.try_wait().ok()??;
                Some(match (status.code(), status.signal()) {
                    // A panic (101) or a signal: a crash.
                    (Some(101), _) | (None, Some(_)) => End::Crashed(status.to_string()),
                    (code, _) => End::Stopped(code.unwrap_or(1)),
                })
            }
            // Not a child: its status is not for this process to read. A stop removes the
            // API socket; a crash leaves it.
            Runner::Adopted { pidfd, .. } => pidfd::ended(pidfd, 0).then(|| {
                if api_socket.exists() {
                    End::Crashed("ended, leaving its API socket".into())
                } else {
                    End::Stopped(0)
                }
            }),
        }
    }
}

enum End {
    /// Stopped, or refused to start (a graph error: starting again would not help).
    Stopped(i32),
    Crashed(String),
}

/// Runs `stitch run ARGS` (this binary, `args` without `--supervise`) until it stops.
pub fn run(args: Vec<String>, api_socket: PathBuf) -> Result<()> {
    let signals = Arc::new(AtomicUsize::new(0));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR2] {
        signal_hook::flag::register_usize(sig, signals.clone(), sig as usize)
            .context("cannot install signal handler")?;
    }
    let notify_dir = tempfile::tempdir()?;
    let notify_path = notify_dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path)?;
    notify.set_nonblocking(true)?;
    let start = || -> Result<Runner> {
        let child = Command::new(std::env::current_exe()?)
            .args(&args[1..])
            .env("NOTIFY_SOCKET", &notify_path)
            .spawn()
            .context("cannot start stitch run")?;
        Ok(Runner::Child(child))
    };
    let mut runner = start()?;
    let mut backoff = FIRST_BACKOFF;
    let mut since = Instant::now();
    // The stop signal passed on, if one was: a successor named after it gets it too.
    let mut stopping: Option<i32> = None;
    loop {
        // A successor named before a signal came gets that signal, not the process it replaced.
        if let Some(successor) = read_main_pid(&notify) {
            runner = adopt(runner, successor, stopping);
        }
        let sig = signals.swap(0, Ordering::Relaxed);
        if sig != 0 {
            // HUP (re-read the graph) and USR2 (upgrade) keep the instance.
            if sig != libc::SIGHUP as usize && sig != libc::SIGUSR2 as usize {
                stopping = Some(sig as i32);
            }
            runner.signal(sig as i32);
        }
        let Some(end) = runner.ended(&api_socket) else {
            std::thread::sleep(POLL);
            continue;
        };
        // The process that ended may have named a successor just before (an upgrade).
        if let Some(successor) = read_main_pid(&notify) {
            runner = adopt(runner, successor, stopping);
            continue;
        }
        let how = match end {
            End::Stopped(code) => std::process::exit(code),
            End::Crashed(_) if stopping.is_some() => return Ok(()),
            End::Crashed(how) => how,
        };
        if since.elapsed() >= STABLE_RUN {
            backoff = FIRST_BACKOFF;
        }
        log::warn!(
            "stitch run (pid {}) crashed ({how}); starting it again in {backoff:?}",
            runner.pid()
        );
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(MAX_BACKOFF);
        runner = start()?;
        since = Instant::now();
    }
}

/// The pid a `MAINPID=` line of the notify socket names, if one came.
fn read_main_pid(notify: &UnixDatagram) -> Option<u32> {
    let mut buf = [0u8; 512];
    let mut found = None;
    while let Ok(n) = notify.recv(&mut buf) {
        let text = String::from_utf8_lossy(&buf[..n]);
        found = text
            .lines()
            .find_map(|l| l.strip_prefix("MAINPID="))
            .and_then(|p| p.trim().parse().ok())
            .or(found);
    }
    found
}

/// Watches `successor` from now on, passing on `stopping` (a stop asked of the old runner as
/// it left); the old runner (its child, exiting) is reaped.
fn adopt(old: Runner, successor: u32, stopping: Option<i32>) -> Runner {
    match pidfd::open(successor) {
        Ok(fd) => {
            if let Runner::Child(mut c) = old {
                std::thread::spawn(move || c.wait());
            }
            log::info!("the instance runs in process {successor} now (stitch upgrade)");
            let runner = Runner::Adopted {
                pid: successor,
                pidfd: fd,
            };
            if let Some(sig) = stopping {
                runner.signal(sig);
            }
            runner
        }
        Err(e) => {
            log::warn!("process {successor} named as the instance's cannot be watched: {e}");
            old
        }
    }
}
