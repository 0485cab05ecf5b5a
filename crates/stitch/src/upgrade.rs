//! `stitch upgrade`: a new Stitch process takes a running instance over without closing
//! anything that carries traffic (the protocol is `stitch_api::handover`). The command starts
//! the new binary (`stitch take-over`, in a session of its own) and waits for its word: the
//! graph runs there, or why it does not — in which case the running instance carries on.

use crate::{Cli, Cmd, Instance, RunArgs, Running, StateKeeper};
use anyhow::{Context, Result};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use stitch_api::handover;
use stitch_place::PlacedGraph;

#[derive(clap::Args)]
pub struct UpgradeArgs {
    #[command(flatten)]
    instance: Instance,
    /// The Stitch binary to run the instance from now on (by default this one: after a
    /// package upgrade, the new version).
    #[arg(long)]
    binary: Option<PathBuf>,
}

/// What a process taking over starts its instance on.
pub struct Inherited {
    pub lock: OwnedFd,
    pub listeners: stitch_api::Listeners,
}

/// Lets a new process take the running instance over for the rest of its life.
pub fn offer_hand_over(running: &Running) -> Result<()> {
    let holdings = handover::Holdings {
        lock: running.owner.try_clone_fd()?,
        listeners: running.server.listeners().try_clone()?,
        command_line: running.command_line.clone(),
    };
    handover::serve(
        running.api.clone(),
        handover::socket_path(&running.config.unix),
        holdings,
    )?;
    upgrade_on_sigusr2(running.config.unix.clone())
}

/// SIGUSR2 upgrades the instance to the binary at the path this process was started from (after
/// a package upgrade, the new version: `systemctl kill -s USR2 stitch@NAME`), as `stitch
/// upgrade` would; the outcome goes to the log.
fn upgrade_on_sigusr2(socket: PathBuf) -> Result<()> {
    let binary = std::env::current_exe().context("which binary runs this instance")?;
    // A package upgrade replaces the file: the kernel then names the running one "PATH (deleted)".
    let binary = match binary.to_str().and_then(|p| p.strip_suffix(" (deleted)")) {
        Some(path) => PathBuf::from(path),
        None => binary,
    };
    on_sigusr2(move || {
        log::info!("SIGUSR2: upgrading to {}", binary.display());
        let out = std::process::Command::new(&binary)
            .args(["upgrade", "--control"])
            .arg(&socket)
            .arg("--binary")
            .arg(&binary)
            .stdin(std::process::Stdio::null())
            // Its report would be written after this process left.
            .stdout(std::process::Stdio::null())
            .output();
        match out {
            // Handed over: this process is leaving (the hand-over thread exits it).
            Ok(o) if o.status.success() => {}
            Ok(o) => log::error!(
                "SIGUSR2: upgrade failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => log::error!("SIGUSR2: cannot run {}: {e}", binary.display()),
        }
    })
}

/// Runs `action` on a thread of its own at every SIGUSR2.
fn on_sigusr2(mut action: impl FnMut() + Send + 'static) -> Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR2])
        .context("cannot install the SIGUSR2 handler")?;
    std::thread::Builder::new()
        .name("stitch-sigusr2".into())
        .spawn(move || signals.forever().for_each(|_| action()))?;
    Ok(())
}

/// SIGUSR2 asks a `stitch run` instance to upgrade; an agent is not upgraded in place, and
/// the signal's default would end it (and its host's traffic) without a word: it says so in
/// the log and runs on.
pub fn refuse_on_sigusr2() -> Result<()> {
    on_sigusr2(|| {
        log::warn!(
            "SIGUSR2: an agent is not upgraded in place; it runs on (restart it with the new \
             binary: it finds its host's graph again in etcd)"
        )
    })
}

/// The descriptor number the new process reports on.
const READY_FD: i32 = 3;

/// The environment that tells a process to take an instance over: its API socket, and the
/// descriptor it reports on.
const TAKE_OVER_ENV: &str = "STITCH_TAKE_OVER";
const READY_FD_ENV: &str = "STITCH_READY_FD";

/// What this process was told to take over (and removes the word from its environment, so
/// that nothing it starts inherits it).
pub fn taking_over() -> Option<(PathBuf, i32)> {
    let socket = std::env::var_os(TAKE_OVER_ENV)?;
    let fd = std::env::var(READY_FD_ENV)
        .ok()
        .and_then(|f| f.parse().ok());
    // SAFETY: called in main before any thread is started (the log subscriber starts none).
    unsafe {
        std::env::remove_var(TAKE_OVER_ENV);
        std::env::remove_var(READY_FD_ENV);
    }
    Some((PathBuf::from(socket), fd.unwrap_or(READY_FD)))
}

/// The command line of the process the instance's status names (`pid`; the socket's peer
/// credentials would name the process that first listened, gone after an upgrade): the
/// successor is started under the same, so `ps` shows what the operator started.
fn command_line_of(status: &serde_json::Value) -> Option<Vec<std::ffi::OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let pid = status["pid"].as_u64()?;
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<std::ffi::OsString> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| std::ffi::OsStr::from_bytes(a).to_os_string())
        .collect();
    (!args.is_empty()).then_some(args)
}

/// An agent's instance (its status has an `agent` section) offers no hand-over: it is
/// restarted instead, and finds its host's graph again in etcd.
fn refuse_an_agent(socket: &Path, status: &serde_json::Value) -> Result<()> {
    if status.get("agent").is_some() {
        anyhow::bail!(
            "{} is a cluster agent's instance: an agent is not upgraded in place; restart it \
             with the new binary (systemctl restart, or stop it and start `stitch agent` \
             again): it finds its host's graph again in etcd (docs/cluster.md)",
            socket.display()
        );
    }
    Ok(())
}

/// `stitch upgrade`: starts the new process and reports what it says.
pub fn upgrade(args: UpgradeArgs) -> Result<()> {
    let binary = match args.binary {
        Some(b) => b,
        None => std::env::current_exe().context("which binary runs this command")?,
    };
    let socket = args.instance.socket();
    // Unanswered: the hand-over below says why (no instance, or one that cannot upgrade).
    let status = stitch_api::client::json(
        &socket,
        stitch_api::client::Method::GET,
        "/api/v1/status",
        None,
    )
    .unwrap_or_default();
    refuse_an_agent(&socket, &status)?;
    let (mut ready, ready_w) = std::io::pipe()?;
    let ready_w: OwnedFd = ready_w.into();
    let raw = ready_w.as_raw_fd();
    let mut cmd = std::process::Command::new(&binary);
    match command_line_of(&status) {
        Some(argv) => {
            cmd.arg0(&argv[0])
                .args(&argv[1..])
                .env(TAKE_OVER_ENV, &socket)
                .env(READY_FD_ENV, READY_FD.to_string());
        }
        // Not known (another user's process): under a command line of its own.
        None => {
            cmd.arg("take-over")
                .arg("--control")
                .arg(&socket)
                .arg("--ready-fd")
                .arg(READY_FD.to_string());
        }
    }
    cmd.stdin(std::process::Stdio::null());
    // SAFETY: between fork and exec only async-signal-safe calls (dup2, setsid) on descriptors
    // this process owns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, READY_FD) < 0 || libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    drop(ready_w);
    let mut said = String::new();
    let _ = ready.read_to_string(&mut said);
    let word: serde_json::Value = serde_json::from_str(said.trim()).unwrap_or_default();
    if let Some(mut ok) = word.get("took_over").cloned() {
        ok["pid"] = child.id().into();
        println!(
            "upgraded `{}`: process {} took over from {} in {:.0} ms",
            socket.display(),
            child.id(),
            ok["from"],
            started.elapsed().as_secs_f64() * 1e3
        );
        println!("{}", serde_json::to_string_pretty(&ok)?);
        return Ok(());
    }
    let status = child.wait()?;
    let why = word["error"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| format!("{} ended ({status}) without taking over", binary.display()));
    anyhow::bail!("{why}; the running instance carries on unchanged")
}

/// `stitch take-over`: receives the instance on `socket` and runs it; `ready_fd` hears the outcome.
pub fn take_over(socket: &Path, ready_fd: i32) -> Result<()> {
    // SAFETY: the parent (`stitch upgrade`) opened this descriptor for us and nothing else
    // in this process owns it.
    let mut ready = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(ready_fd) });
    let taken = handover::take_over(socket).and_then(|(inh, answer)| {
        start_inherited(inh, answer).map_err(|(answer, e)| {
            if let Some(a) = answer {
                a.failed(&format!("{e:#}"));
            }
            e
        })
    });
    let started = match taken {
        Ok(t) => t,
        Err(e) => {
            let said = writeln!(
                ready,
                "{}",
                serde_json::json!({ "error": format!("{e:#}") })
            );
            if said.is_ok() {
                // `stitch upgrade` prints it; printed here too, its terminal would show it twice.
                std::process::exit(1);
            }
            return Err(e);
        }
    };
    let report = started.report;
    let _ = writeln!(ready, "{}", serde_json::json!({ "took_over": report }));
    drop(ready);
    log::info!("took over: {report}");
    let s = started.settings;
    crate::serve_until_stopped(
        started.running,
        started.keeper,
        &s.file,
        s.duration,
        (s.json, s.keep_running),
    )
}

/// An instance started on what its predecessor handed over.
struct Started {
    running: Running,
    keeper: Option<StateKeeper>,
    settings: RunArgs,
    report: serde_json::Value,
}

/// A failure, with the answer still owed to the old process (none once it has been given).
type Failure = (Option<handover::AnswerTo>, anyhow::Error);

/// Builds the graph on what the old process lent while it runs on, then asks for its final
/// word (it parks), starts, and answers.
fn start_inherited(
    inh: handover::Inheritance,
    mut answer: handover::AnswerTo,
) -> Result<Started, Failure> {
    let handover::Inheritance {
        offer,
        lock,
        listeners,
        stdout,
        stderr,
        lent,
    } = inh;
    let prepared = (|| {
        std::env::set_current_dir(&offer.cwd)
            .with_context(|| format!("cannot work in {}", offer.cwd.display()))?;
        let settings = run_settings(&offer.args)?;
        let registry = Arc::new(crate::registry());
        let graph = PlacedGraph::parse(&offer.graph, &offer.graph_name, &offer.base_dir, &registry)
            .map_err(|e| anyhow::anyhow!("the running graph does not parse here: {e}"))?;
        let graph_file = Some(std::path::absolute(&settings.file)?);
        let parts =
            crate::new_instance(registry, &settings.instance, &settings.listen, graph_file)?;
        let prepared = (parts.api.placements())
            .prepare_inheriting(graph, lent)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok((settings, parts, prepared))
    })();
    let (settings, parts, prepared) = match prepared {
        Ok(p) => p,
        Err(e) => return Err((Some(answer), e)),
    };
    // The old process parks now: from here until `started`, its traffic waits.
    let asked = Instant::now();
    let mut last = answer.ready().map_err(|e| (None, e))?;
    let committed = (parts.api.placements())
        .commit_inheriting(prepared, last.apps(), &last.links)
        .map_err(|e| anyhow::anyhow!("{e}"));
    let (applied, restored) = match committed {
        Ok(c) => c,
        Err(e) => return Err((Some(answer), e)),
    };
    let paused_ms = asked.elapsed().as_secs_f64() * 1e3;
    let api = parts.api.clone();
    let mut running = match parts.serve(Some(Inherited { lock, listeners })) {
        Ok(r) => r,
        Err(e) => return Err((Some(answer), e)),
    };
    running.command_line = offer.args.clone();
    handover::inherit_service_manager(offer.notify_socket.clone());
    let from = offer.pid;
    answer.started().map_err(|e| (None, e))?;
    let kernel_loaded = api.placements().reload_kernel();
    // Log lines go where the old process's went (a journal, a file) from here on.
    for (from, to) in [(&stdout, 1), (&stderr, 2)] {
        // SAFETY: dup2 onto the standard descriptors, which this process keeps open.
        unsafe { libc::dup2(from.as_raw_fd(), to) };
    }
    let report = serde_json::json!({
        "from": from,
        "paused_ms_at_most": paused_ms,
        "apps": applied.engine.started.len(),
        "packets_drained": last.drained,
        "packets_left_queued": last.left_queued,
        "state_restored": restored.restored,
        "state_refused": restored.refused,
        "state_unsaved": last.unsaved,
        "kernel_programs_loaded_ms": kernel_loaded.map(|t| t.as_secs_f64() * 1e3),
    });
    let keeper = StateKeeper::after_take_over(&settings.state, restored).map_err(|e| (None, e))?;
    Ok(Started {
        running,
        keeper,
        settings,
        report,
    })
}

/// The old process's `stitch run` arguments, read by this version.
fn run_settings(args: &[String]) -> Result<RunArgs> {
    use clap::Parser;
    let cli = Cli::try_parse_from(args).map_err(|e| {
        anyhow::anyhow!("this Stitch does not take the running one's arguments {args:?}: {e}")
    })?;
    match cli.cmd {
        Cmd::Run(run) => Ok(run),
        _ => anyhow::bail!("only an instance started by `stitch run` can be taken over"),
    }
}
