//! CPU and memory limits of a function process: a cgroup of its own under
//! `stitch/INSTANCE/APP`, in the unified hierarchy (cgroup v2: `cpu.max`, `memory.max`) when
//! its controllers are there, else in the v1 `cpu` and `memory` hierarchies
//! (`cpu.cfs_quota_us`, `memory.limit_in_bytes`), as hosts still mounting v1 have them.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hierarchy {
    V2,
    V1,
}

fn hierarchy() -> Option<Hierarchy> {
    let controllers = fs::read_to_string(Path::new(ROOT).join("cgroup.controllers")).ok();
    match controllers {
        Some(c) if c.split_whitespace().any(|x| x == "memory") => Some(Hierarchy::V2),
        _ if Path::new(ROOT)
            .join("memory/memory.limit_in_bytes")
            .exists() =>
        {
            Some(Hierarchy::V1)
        }
        _ => None,
    }
}

/// The folders of one instance's cgroups (one per hierarchy used).
fn instance_dirs(h: Hierarchy, instance: &str) -> Vec<PathBuf> {
    if instance.is_empty() {
        return Vec::new();
    }
    match h {
        Hierarchy::V2 => vec![Path::new(ROOT).join("stitch").join(instance)],
        Hierarchy::V1 => ["cpu", "memory"]
            .iter()
            .map(|c| Path::new(ROOT).join(c).join("stitch").join(instance))
            .collect(),
    }
}

/// A function's cgroup with its limits written; the process joins it between fork and exec
/// through [`Cgroup::join_fds`].
#[derive(Debug)]
pub struct Cgroup {
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    /// Creates (or reuses) the cgroup of `app` and writes its limits. `Ok(None)` when neither
    /// limit is asked for.
    pub fn create(
        instance: &str,
        app: &str,
        cpu: Option<f64>,
        memory_mb: Option<u64>,
    ) -> io::Result<Option<Cgroup>> {
        if cpu.is_none() && memory_mb.is_none() {
            return Ok(None);
        }
        if instance.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this engine has no instance name to own cgroups under",
            ));
        }
        let h = hierarchy().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!("no cgroup hierarchy with the memory controller under {ROOT}: cpu and memory_mb cannot be enforced here"),
            )
        })?;
        let quota = cpu.map(|c| ((c * CPU_PERIOD_US as f64).round() as u64).max(1000));
        let bytes = memory_mb.map(|m| m << 20);
        let mut dirs = Vec::new();
        match h {
            Hierarchy::V2 => {
                let top = Path::new(ROOT).join("stitch");
                fs::create_dir_all(top.join(instance))?;
                // Controllers reach a child only when its parent hands them down.
                for d in [Path::new(ROOT), &top, &top.join(instance)] {
                    let _ = fs::write(d.join("cgroup.subtree_control"), "+cpu +memory");
                }
                let dir = top.join(instance).join(app);
                fs::create_dir_all(&dir)?;
                if let Some(q) = quota {
                    fs::write(dir.join("cpu.max"), format!("{q} {CPU_PERIOD_US}"))?;
                }
                if let Some(b) = bytes {
                    fs::write(dir.join("memory.max"), b.to_string())?;
                    let _ = fs::write(dir.join("memory.swap.max"), "0");
                }
                dirs.push(dir);
            }
            Hierarchy::V1 => {
                if let Some(q) = quota {
                    let dir = Path::new(ROOT).join("cpu/stitch").join(instance).join(app);
                    fs::create_dir_all(&dir)?;
                    fs::write(dir.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string())?;
                    fs::write(dir.join("cpu.cfs_quota_us"), q.to_string())?;
                    dirs.push(dir);
                }
                if let Some(b) = bytes {
                    let dir = Path::new(ROOT)
                        .join("memory/stitch")
                        .join(instance)
                        .join(app);
                    fs::create_dir_all(&dir)?;
                    fs::write(dir.join("memory.limit_in_bytes"), b.to_string())?;
                    dirs.push(dir);
                }
            }
        }
        Ok(Some(Cgroup { dirs }))
    }

    /// `cgroup.procs` of each folder, opened for the child to write "0" (itself) into after
    /// fork: opening allocates, which a forked child of a threaded process must not do.
    pub fn join_fds(&self) -> io::Result<Vec<OwnedFd>> {
        self.dirs
            .iter()
            .map(|d| {
                fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("cgroup.procs"))
                    .map(OwnedFd::from)
            })
            .collect()
    }

    /// The limits as the kernel holds them, for `stitch show`.
    pub fn limits(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for d in &self.dirs {
            for f in [
                "cpu.max",
                "memory.max",
                "cpu.cfs_quota_us",
                "memory.limit_in_bytes",
            ] {
                if let Ok(v) = fs::read_to_string(d.join(f)) {
                    m.insert(f.into(), v.trim().into());
                }
            }
        }
        m.insert(
            "cgroups".into(),
            self.dirs
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .into(),
        );
        serde_json::Value::Object(m)
    }

    /// Removes the folders (the process has left them by exiting).
    pub fn remove(&self) {
        for d in &self.dirs {
            let _ = fs::remove_dir(d);
        }
    }
}

/// Removes the instance's own cgroup folders once its functions' are gone.
pub fn remove_instance(instance: &str) {
    if let Some(h) = hierarchy() {
        for top in instance_dirs(h, instance) {
            let _ = fs::remove_dir(&top);
        }
    }
}

/// Writes "0" to each fd: the calling process joins those cgroups. Runs in the child between
/// fork and exec, so it only makes system calls.
pub fn join_in_child(fds: &[i32]) -> io::Result<()> {
    for &fd in fds {
        // SAFETY: `fd` is open for the whole call (the parent keeps the OwnedFd until the
        // child has exec'd or failed), and the buffer is a static one-byte string.
        let n = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
        if n != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Raw numbers of `fds`, for the child.
pub fn raw(fds: &[OwnedFd]) -> Vec<i32> {
    fds.iter().map(AsRawFd::as_raw_fd).collect()
}

/// Removes the cgroups a previous run of `instance` left, but those of the apps in `spare`
/// (function processes that outlived it, to adopt). Any process still inside is killed first.
pub fn clean_instance(instance: &str, spare: &[String]) -> usize {
    let Some(h) = hierarchy() else { return 0 };
    let mut removed = 0;
    for top in instance_dirs(h, instance) {
        let Ok(entries) = fs::read_dir(&top) else {
            continue;
        };
        for e in entries.flatten() {
            let dir = e.path();
            if !dir.is_dir() || spare.iter().any(|a| dir.file_name() == Some(a.as_ref())) {
                continue;
            }
            if let Ok(pids) = fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in pids
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: kill has no memory preconditions; a pid that is gone fails.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            for _ in 0..50 {
                if fs::remove_dir(&dir).is_ok() {
                    removed += 1;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        let _ = fs::remove_dir(&top);
    }
    removed
}
