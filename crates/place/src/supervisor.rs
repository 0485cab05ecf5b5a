//! Function processes and VMs kept running: each has a thread that starts its command, watches
//! it, restarts it with backoff when it dies (100 ms doubling to 10 s; back to 100 ms after it
//! ran 10 s), keeps its last stderr lines, and stops it (SIGTERM, or a VM's ACPI power-down)
//! and then, after its grace time, SIGKILL.
//!
//! Function processes and VMs outlive the Stitch process that started them: another that takes
//! the instance over (`stitch upgrade`) adopts them ([`Supervisor::adopt`]), watching each
//! through a pidfd and reading its output; after a crash, the next run of the instance adopts
//! those that run the same command ([`Supervisor::clean_after_crash`] and
//! [`Supervisor::apply`]) and kills the rest. A function asks for its port again for a while
//! (Stitch's function library does); QEMU connects to its vhost-user socket again
//! (`reconnect=1`).

use crate::cgroup::{self, Cgroup};
use crate::pidfd;
use crate::survivors::{self, Records, Survivor};
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use stitch_core::Descriptors;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A run at least this long resets the backoff.
const STABLE_RUN: Duration = Duration::from_secs(10);
const STDERR_LINES: usize = 20;
const POLL: Duration = Duration::from_millis(20);

/// How a process is asked to stop before it is killed.
#[derive(Debug, Clone, PartialEq)]
pub enum StopBy {
    Term,
    /// A VM: `system_powerdown` on its QMP socket.
    Qmp(PathBuf),
}

/// What a function process or VM is: everything that, changed, restarts it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSpec {
    pub app: String,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// The user to run as (`None`: Stitch's).
    pub user: Option<crate::confine::RunAs>,
    /// Root's capabilities and environment kept (`privileged: true`; QEMU): not confined.
    pub privileged: bool,
    /// The default system-call filter (`seccomp: default`).
    pub seccomp: bool,
    /// The attach socket and port of a function: the process may attach it.
    pub attaches: Option<(PathBuf, String)>,
    pub cpu: Option<f64>,
    pub memory_mb: Option<u64>,
    pub stop: StopBy,
    /// How long it has to stop before it is killed.
    pub stop_grace: Duration,
    /// `process` or `vm`, for status.
    pub kind: &'static str,
    /// A VM's serial console, the file its guest's boot and kernel messages go to.
    pub console: Option<PathBuf>,
}

impl ProcessSpec {
    /// How logs name it: "function `f`" or "VM `vm1`".
    pub fn label(&self) -> String {
        let what = if self.kind == "vm" { "VM" } else { "function" };
        format!("{what} `{}`", self.app)
    }
}

#[derive(Default)]
struct Status {
    pid: Option<u32>,
    child: Option<Child>,
    /// A process taken over from a predecessor Stitch (not this one's child): its pidfd.
    adopted: Option<OwnedFd>,
    /// Duplicates of the read ends of its stdout and stderr, to lend to a successor.
    output: Option<[OwnedFd; 2]>,
    /// Why it runs without this process having started it, if it does.
    carried: Option<&'static str>,
    started: Option<Instant>,
    starts: u64,
    restarts: u64,
    last_exit: Option<String>,
    last_error: Option<String>,
    next_start: Option<Instant>,
    stopping: bool,
}

struct Supervised {
    spec: ProcessSpec,
    status: Mutex<Status>,
    wake: Condvar,
    cgroup: Option<Cgroup>,
    /// The last lines the process wrote to stderr (over restarts).
    stderr: Arc<Mutex<VecDeque<String>>>,
    records: Records,
}

/// The running function processes of one instance, by app name.
pub struct Supervisor {
    instance: String,
    running: BTreeMap<String, (Arc<Supervised>, JoinHandle<()>)>,
    records: Records,
    /// Function processes a killed or crashed run of this instance left running, until the
    /// first graph adopts them (or stops them).
    survivors: BTreeMap<String, Survivor>,
}

impl Supervisor {
    pub fn new(instance: &str) -> Supervisor {
        Supervisor {
            instance: instance.to_string(),
            running: BTreeMap::new(),
            records: Records::of(instance),
            survivors: BTreeMap::new(),
        }
    }

    /// Makes `specs` the running set: stops processes whose app left or whose spec changed,
    /// starts the new and changed ones. Returns the apps started and stopped.
    pub fn apply(&mut self, specs: Vec<ProcessSpec>) -> (Vec<String>, Vec<String>) {
        let wanted: BTreeMap<String, ProcessSpec> =
            specs.into_iter().map(|s| (s.app.clone(), s)).collect();
        let leaving: Vec<String> = self
            .running
            .iter()
            .filter(|(name, (s, _))| wanted.get(*name) != Some(&s.spec))
            .map(|(name, _)| name.clone())
            .collect();
        for name in &leaving {
            self.stop_one(name);
        }
        let mut started = Vec::new();
        for (name, spec) in wanted {
            if self.running.contains_key(&name) {
                continue;
            }
            let status = match self.survivors.remove(&name) {
                Some(s) if s.program == spec.program && s.args == spec.args => {
                    survivor_status(&spec, s)
                }
                _ => Status::default(),
            };
            if status.adopted.is_none() {
                started.push(name);
            }
            self.launch(spec, status);
        }
        self.stop_survivors();
        (started, leaving)
    }

    /// Kills what a crashed run left that the graph does not run again, with its cgroup.
    fn stop_survivors(&mut self) {
        if self.survivors.is_empty() {
            return;
        }
        for (app, s) in std::mem::take(&mut self.survivors) {
            log::info!(
                "function `{app}` (pid {}) kept running after the last run of this instance \
                 ended, but is not in its graph now: killed",
                s.pid
            );
            pidfd::signal(&s.pidfd, libc::SIGKILL);
            pidfd::ended(&s.pidfd, 1000);
            self.records.remove(&app);
        }
        let running: Vec<String> = self.running.keys().cloned().collect();
        cgroup::clean_instance(&self.instance, &running);
    }

    /// Starts the thread that keeps `spec`'s process running, from `status` (a process taken
    /// over, or none yet).
    fn launch(&mut self, spec: ProcessSpec, status: Status) {
        let name = spec.app.clone();
        let cgroup = match Cgroup::create(&self.instance, &name, spec.cpu, spec.memory_mb) {
            Ok(c) => c,
            Err(e) => {
                log::error!("{}: limits not enforced: {e}", spec.label());
                None
            }
        };
        let s = Arc::new(Supervised {
            spec,
            status: Mutex::new(status),
            wake: Condvar::new(),
            cgroup,
            stderr: Default::default(),
            records: self.records.clone(),
        });
        if let Some([out, err]) = &s.status.lock().unwrap().output {
            for (fd, tail) in [(out, None), (err, Some(s.stderr.clone()))] {
                match fd.try_clone() {
                    Ok(fd) => keep_lines(&s.spec, std::fs::File::from(fd), tail),
                    Err(e) => log::warn!("{}: its output is not read: {e}", s.spec.label()),
                }
            }
        }
        let t = s.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fn-{name}"))
            .spawn(move || supervise(&t))
            .expect("spawn a supervision thread");
        self.running.insert(name, (s, thread));
    }

    /// For a process taking this instance over (`stitch upgrade`): each running function
    /// process and VM, as a pidfd and duplicates of the read ends of its stdout and stderr,
    /// with its pid, starts and restarts.
    pub fn lend(&self) -> BTreeMap<String, Descriptors> {
        let mut lent = BTreeMap::new();
        for (name, (s, _)) in &self.running {
            // Under the lock the process is not reaped, so its pid is still its own.
            let st = s.status.lock().unwrap();
            let Some(pid) = st.pid else { continue };
            let fds = (|| -> std::io::Result<Vec<OwnedFd>> {
                let mut fds = vec![match &st.adopted {
                    Some(fd) => fd.try_clone()?,
                    None => pidfd::open(pid)?,
                }];
                for fd in st.output.iter().flatten() {
                    fds.push(fd.try_clone()?);
                }
                Ok(fds)
            })();
            let fds = match fds {
                Ok(fds) => fds,
                Err(e) => {
                    log::warn!("function `{name}` (pid {pid}) cannot be lent: {e}");
                    continue;
                }
            };
            let position = serde_json::json!({
                "pid": pid,
                "starts": st.starts,
                "restarts": st.restarts,
                "up_seconds": st.started.map(|t| t.elapsed().as_secs_f64()),
            });
            lent.insert(name.clone(), Descriptors { fds, position });
        }
        lent
    }

    /// Makes `specs` the running set, as [`Supervisor::apply`] does, but each process `lent`
    /// by the predecessor this process takes over from ([`Supervisor::lend`]) is adopted,
    /// not started: it keeps running, attached to its port.
    pub fn adopt(
        &mut self,
        specs: Vec<ProcessSpec>,
        mut lent: BTreeMap<String, Descriptors>,
    ) -> (Vec<String>, Vec<String>) {
        let mut rest = Vec::new();
        for spec in specs {
            match lent
                .remove(&spec.app)
                .and_then(|d| adopted_status(&spec.app, d))
            {
                Some(status) if !self.running.contains_key(&spec.app) => {
                    log::info!(
                        "{} (pid {}) carries on under this process",
                        spec.label(),
                        status.pid.unwrap_or(0)
                    );
                    self.launch(spec, status);
                }
                _ => rest.push(spec),
            }
        }
        let kept: Vec<ProcessSpec> = (self.running.values())
            .map(|(s, _)| s.spec.clone())
            .chain(rest)
            .collect();
        self.apply(kept)
    }

    fn stop_one(&mut self, name: &str) {
        let Some((s, thread)) = self.running.remove(name) else {
            return;
        };
        let asked = match &s.spec.stop {
            StopBy::Qmp(qmp) => crate::qmp::power_down(qmp),
            StopBy::Term => false,
        };
        if asked {
            log::info!(
                "{}: asked to power down (ACPI); killed if still running after {:?} (`shutdown_timeout_s`)",
                s.spec.label(),
                s.spec.stop_grace
            );
        }
        {
            let mut st = s.status.lock().unwrap();
            st.stopping = true;
            if let (Some(fd), false) = (&st.adopted, asked) {
                pidfd::signal(fd, libc::SIGTERM);
            } else if let (Some(pid), false) = (st.pid, asked) {
                // SAFETY: kill has no memory preconditions. The child is not reaped while the
                // lock is held (the thread reaps it under this lock), so `pid` is still ours.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
            s.wake.notify_all();
        }
        let _ = thread.join();
        self.records.remove(name);
        if let Some(c) = &s.cgroup {
            c.remove();
        }
    }

    /// Removes what a previous run of this instance left when it died (its cgroups, and any
    /// process still in them); returns how many cgroups. Only for the instance that now owns
    /// the name.
    /// `adopting`: function processes that run as recorded are spared: they ask for their
    /// ports again, and the first graph applied adopts those it still runs
    /// ([`Supervisor::apply`]).
    pub fn clean_after_crash(&mut self, adopting: bool) -> usize {
        if !adopting {
            for (app, s) in self.records.survivors() {
                log::info!("function `{app}` (pid {}) left running: killed", s.pid);
                pidfd::signal(&s.pidfd, libc::SIGKILL);
                pidfd::ended(&s.pidfd, 1000);
            }
            self.records.remove_all();
            return cgroup::clean_instance(&self.instance, &[]);
        }
        self.survivors = self.records.survivors();
        let spared: Vec<String> = self.survivors.keys().cloned().collect();
        if !spared.is_empty() {
            log::info!("function processes left running by the last run of this instance, to adopt: {spared:?}");
        }
        cgroup::clean_instance(&self.instance, &spared)
    }

    /// Stops every process.
    pub fn stop_all(&mut self) {
        let names: Vec<String> = self.running.keys().cloned().collect();
        for n in names {
            self.stop_one(&n);
        }
        self.stop_survivors();
        self.records.remove_all();
        cgroup::remove_instance(&self.instance);
    }

    /// Each running process or VM: app, kind, pid and cgroup.
    pub fn created(&self) -> Vec<serde_json::Value> {
        self.running
            .iter()
            .map(|(name, (s, _))| {
                let mut made = serde_json::json!({
                    "app": name,
                    "kind": s.spec.kind,
                    "pid": s.status.lock().unwrap().pid,
                    "cgroups": s.cgroup.as_ref().map(|c| c.limits()["cgroups"].clone()),
                });
                if let Some(console) = &s.spec.console {
                    made["console"] = serde_json::json!(console);
                }
                made
            })
            .collect()
    }

    /// The QMP socket of app `name`'s VM while its QEMU runs.
    pub fn qmp_of(&self, name: &str) -> Option<PathBuf> {
        let (s, _) = self.running.get(name)?;
        let running = s.status.lock().unwrap().pid.is_some();
        match &s.spec.stop {
            StopBy::Qmp(qmp) if running => Some(qmp.clone()),
            _ => None,
        }
    }

    /// The state of app `name`'s process, if it is one.
    pub fn status(&self, name: &str) -> Option<serde_json::Value> {
        let (s, _) = self.running.get(name)?;
        let st = s.status.lock().unwrap();
        let mut command = vec![s.spec.program.display().to_string()];
        command.extend(s.spec.args.iter().cloned());
        Some(serde_json::json!({
            "kind": s.spec.kind,
            "command": command,
            "state": if st.pid.is_some() { "running" } else if st.stopping { "stopping" } else { "waiting to restart" },
            "pid": st.pid,
            "up_seconds": st.started.filter(|_| st.pid.is_some()).map(|t| t.elapsed().as_secs_f64()),
            "starts": st.starts,
            "restarts": st.restarts,
            "last_exit": st.last_exit,
            "last_error": st.last_error,
            "carried_over": st.carried,
            "restart_in_seconds": st.next_start.map(|t| t.saturating_duration_since(Instant::now()).as_secs_f64()),
            "stderr": s.stderr.lock().unwrap().iter().collect::<Vec<_>>(),
            "limits": s.cgroup.as_ref().map(Cgroup::limits),
            "console": s.spec.console,
        }))
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// The thread of one function: start (unless it was taken over running), watch, restart,
/// until told to stop.
fn supervise(s: &Supervised) {
    let mut backoff = FIRST_BACKOFF;
    let mut running = s.status.lock().unwrap().adopted.is_some();
    loop {
        let began = Instant::now();
        let started = if std::mem::take(&mut running) {
            Ok(())
        } else {
            // Its hello may come before `start` knows its pid: `peers::expect_a_child`.
            if let Some((socket, port)) = &s.spec.attaches {
                stitch_nf::peers::expect_a_child(socket, port);
            }
            start(s)
        };
        // The function process (started or adopted) may attach its port (`peers`), until it
        // ends.
        let pid = s.status.lock().unwrap().pid.map(|p| p as i32);
        if let (Some((socket, port)), Some(pid), true) = (&s.spec.attaches, pid, started.is_ok()) {
            stitch_nf::peers::expect_process(socket, port, pid);
        }
        match started {
            Ok(()) => watch(s),
            Err(e) => {
                log::error!("{}: cannot start: {e}", s.spec.label());
                s.status.lock().unwrap().last_error = Some(e.to_string());
            }
        }
        if let Some((socket, port)) = &s.spec.attaches {
            stitch_nf::peers::forget_process(socket, port, pid);
        }
        let mut st = s.status.lock().unwrap();
        if st.stopping {
            return;
        }
        if began.elapsed() >= STABLE_RUN {
            backoff = FIRST_BACKOFF;
        }
        let at = Instant::now() + backoff;
        st.next_start = Some(at);
        log::warn!(
            "{} ended ({}); restarting in {:?}",
            s.spec.label(),
            st.last_exit.as_deref().unwrap_or("did not start"),
            backoff
        );
        while !st.stopping && Instant::now() < at {
            let left = at.saturating_duration_since(Instant::now());
            st = s.wake.wait_timeout(st, left).unwrap().0;
        }
        st.next_start = None;
        if st.stopping {
            return;
        }
        st.restarts += 1;
        drop(st);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn start(s: &Supervised) -> std::io::Result<()> {
    let spec = &s.spec;
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let confined = match spec.privileged {
        true => None,
        false => Some(
            crate::confine::steps(
                spec.user.clone(),
                spec.seccomp,
                (&spec.program, &spec.args, &spec.env),
            )
            .map_err(std::io::Error::other)?,
        ),
    };
    // A confined process is run by its steps, with their own user, environment and exec; an
    // unconfined one (`privileged`, QEMU) by `cmd`, with Stitch's environment and the spec's.
    if confined.is_none() {
        if let Some(u) = &spec.user {
            cmd.uid(u.uid).gid(u.gid);
        }
        cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
    }
    let join = match &s.cgroup {
        Some(c) => c.join_fds()?,
        None => Vec::new(),
    };
    let fds = cgroup::raw(&join);
    // SAFETY: the closure runs in the child between fork and exec and makes only system calls
    // (write, prctl, setgroups, setgid, setuid, close_range, seccomp, execveat) on data made
    // before the fork: no allocation, no lock.
    unsafe {
        cmd.pre_exec(move || {
            // Into the cgroup first, as root: the confinement takes that right away.
            cgroup::join_in_child(&fds)?;
            match &confined {
                Some(steps) => steps.run(),
                None => Ok(()),
            }
        });
    }
    let mut st = s.status.lock().unwrap();
    if st.stopping {
        return Ok(());
    }
    let mut child = cmd.spawn()?;
    drop(join);
    let pid = child.id();
    log::info!("{} started (pid {pid})", spec.label());
    st.output = match (&child.stdout, &child.stderr) {
        (Some(out), Some(err)) => Some([
            out.as_fd().try_clone_to_owned()?,
            err.as_fd().try_clone_to_owned()?,
        ]),
        _ => None,
    };
    if let Some(err) = child.stderr.take() {
        keep_lines(spec, err, Some(s.stderr.clone()));
    }
    if let Some(out) = child.stdout.take() {
        keep_lines(spec, out, None);
    }
    s.records.write(&spec.app, pid, &spec.program, &spec.args);
    st.pid = Some(pid);
    st.child = Some(child);
    st.started = Some(Instant::now());
    st.starts += 1;
    st.last_error = None;
    Ok(())
}

/// Logs the lines of a function's or VM's stdout or stderr; keeps the last stderr lines in
/// `tail`.
fn keep_lines(
    spec: &ProcessSpec,
    from: impl std::io::Read + Send + 'static,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) {
    let label = spec.label();
    let _ = std::thread::Builder::new()
        .name(format!("fn-{}-out", spec.app))
        .spawn(move || {
            for line in BufReader::new(from).lines().map_while(Result::ok) {
                match &tail {
                    Some(t) => {
                        log::warn!("{label}: {line}");
                        let mut t = t.lock().unwrap();
                        if t.len() == STDERR_LINES {
                            t.pop_front();
                        }
                        t.push_back(line);
                    }
                    None => log::info!("{label}: {line}"),
                }
            }
        });
}

/// Waits for the process to end (polled, so that a stop can signal it under the lock without
/// racing the reaping), then records how it ended. Once told to stop, it waits
/// its grace time for the SIGTERM or power-down to work, then kills.
fn watch(s: &Supervised) {
    let mut asked_at: Option<Instant> = None;
    loop {
        let mut st = s.status.lock().unwrap();
        if st.child.is_none() && st.adopted.is_none() {
            return;
        }
        if let Some(how) = ended(&mut st) {
            if let Some(at) = asked_at {
                let waited = at.elapsed();
                log::info!(
                    "{} stopped ({how}) {waited:.1?} after it was asked",
                    s.spec.label()
                );
            }
            record_exit(&mut st, how);
            return;
        }
        if st.stopping && asked_at.get_or_insert_with(Instant::now).elapsed() >= s.spec.stop_grace {
            let hint = match s.spec.stop {
                StopBy::Qmp(_) => " (its guest ignores the ACPI power button: run acpid in it, or lower `shutdown_timeout_s`)",
                StopBy::Term => " (it ignores SIGTERM)",
            };
            log::warn!(
                "{} did not stop within {:?}: killed{hint}",
                s.spec.label(),
                s.spec.stop_grace
            );
            let how = kill(&mut st);
            record_exit(&mut st, how);
            return;
        }
        drop(st);
        std::thread::sleep(POLL);
    }
}

/// How the process ended, if it has.
fn ended(st: &mut Status) -> Option<String> {
    if let Some(child) = st.child.as_mut() {
        return match child.try_wait() {
            Ok(Some(status)) => Some(describe(status)),
            Ok(None) => None,
            Err(_) => Some("unknown".into()),
        };
    }
    let fd = st.adopted.as_ref()?;
    pidfd::ended(fd, 0)
        .then(|| "ended (taken over from another Stitch process, which is told how)".into())
}

/// Kills the process and waits for it; how it ended.
fn kill(st: &mut Status) -> String {
    if let Some(child) = st.child.as_mut() {
        let _ = child.kill();
        return child.wait().map_or("unknown".into(), describe);
    }
    if let Some(fd) = &st.adopted {
        pidfd::signal(fd, libc::SIGKILL);
        pidfd::ended(fd, 1000);
    }
    "killed by signal 9".into()
}

fn record_exit(st: &mut Status, how: String) {
    st.child = None;
    st.adopted = None;
    st.output = None;
    st.carried = None;
    st.pid = None;
    st.last_exit = Some(how);
}

fn describe(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => s.to_string(),
    }
}

/// What a predecessor lent for one running process ([`Supervisor::lend`]), as a status.
fn adopted_status(app: &str, lent: Descriptors) -> Option<Status> {
    let p = &lent.position;
    let pid = p["pid"].as_u64()? as u32;
    let mut fds = lent.fds.into_iter();
    let pidfd = fds.next()?;
    if pidfd::ended(&pidfd, 0) {
        log::info!("function `{app}` (pid {pid}) ended before it could be taken over");
        return None;
    }
    let output = match (fds.next(), fds.next()) {
        (Some(out), Some(err)) => Some([out, err]),
        _ => None,
    };
    let up = Duration::from_secs_f64(p["up_seconds"].as_f64().unwrap_or(0.0).max(0.0));
    Some(Status {
        pid: Some(pid),
        adopted: Some(pidfd),
        output,
        started: Instant::now().checked_sub(up),
        starts: p["starts"].as_u64().unwrap_or(1),
        restarts: p["restarts"].as_u64().unwrap_or(0),
        carried: Some("taken over from the Stitch process before this one (stitch upgrade)"),
        ..Status::default()
    })
}

/// A process a killed or crashed run left running ([`Supervisor::clean_after_crash`]), as
/// the status of its app, adopted: it gets new pipes for its output (the old ones died with
/// the old process) when it attaches again.
fn survivor_status(spec: &ProcessSpec, s: Survivor) -> Status {
    log::info!(
        "{} (pid {}) kept running after the last run of this instance ended: adopted",
        spec.label(),
        s.pid
    );
    let var = |k: &str| {
        spec.env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    let socket = var(stitch_nf::function::ENV_SOCKET);
    let port = var(stitch_nf::function::ENV_PORT);
    let output = match (socket, port, survivors::output_pipes()) {
        (Some(socket), Some(port), Ok((read, write))) => {
            stitch_nf::listener::offer_output(std::path::Path::new(&socket), &port, write);
            Some(read)
        }
        (_, _, Err(e)) => {
            log::warn!("{}: its output is not read: {e}", spec.label());
            None
        }
        _ => None,
    };
    Status {
        pid: Some(s.pid),
        adopted: Some(s.pidfd),
        output,
        starts: 1,
        carried: Some("kept running when the Stitch process before this one ended"),
        ..Status::default()
    }
}
