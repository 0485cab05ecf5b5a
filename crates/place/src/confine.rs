//! What a function process may do: Stitch runs as root, its functions need nothing of root's.
//! By default a function runs as the system user `stitch-fn` (made by `scripts/install-deps`),
//! with an empty capability bounding set and `no_new_privs` (no setuid program, no file
//! capability gives any back), a clean environment (`PATH` and what the app and Stitch set),
//! and no descriptor of Stitch's past its standard three. `user:` names another user (`root`
//! too, still without capabilities); `privileged: true` is the explicit word for the old way:
//! root's capabilities and environment.
//!
//! The steps that drop privileges run in the child between fork and exec, in this order: the
//! bounding set first (it needs CAP_SETPCAP, which the user change takes away), then groups,
//! group and user, then `no_new_privs`, then every descriptor past 2 marked close-on-exec.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The user functions run as unless their app says otherwise.
pub const FUNCTION_USER: &str = "stitch-fn";

/// A user to run as, with its groups, looked up before the fork.
#[derive(Debug, Clone, PartialEq)]
pub struct RunAs {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Its supplementary groups (the primary one among them).
    pub groups: Vec<u32>,
}

/// `name`'s ids and groups from the host's user database.
pub fn lookup(name: &str) -> Result<RunAs, String> {
    let user = match nix::unistd::User::from_name(name) {
        Ok(Some(u)) => u,
        Ok(None) => return Err(format!("no user `{name}` on this host")),
        Err(e) => return Err(format!("cannot look up user `{name}`: {e}")),
    };
    let cname =
        std::ffi::CString::new(name).map_err(|_| format!("user `{name}`: a NUL in the name"))?;
    let groups = nix::unistd::getgrouplist(&cname, user.gid)
        .map_err(|e| format!("cannot list the groups of `{name}`: {e}"))?
        .into_iter()
        .map(|g| g.as_raw())
        .collect();
    Ok(RunAs {
        name: name.to_string(),
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        groups,
    })
}

/// The user a function runs as: the one its app names; else, for a Stitch running as root,
/// `stitch-fn`; else Stitch's own (`None`: no change).
pub fn user_for(named: Option<&str>) -> Result<Option<RunAs>, String> {
    match named {
        Some(name) => lookup(name).map(Some),
        // SAFETY: geteuid has no preconditions and cannot fail.
        None if unsafe { libc::geteuid() } == 0 => lookup(FUNCTION_USER).map(Some).map_err(|_| {
            format!(
                "functions run as the system user `{FUNCTION_USER}`, and this host has none: `scripts/install-deps` makes it (`useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {FUNCTION_USER}`); or give the app `user: NAME`"
            )
        }),
        None => Ok(None),
    }
}

/// Refuses a function whose user cannot enter every folder above its attach socket (it would
/// start, fail to attach and restart for ever): names the folder and its mode.
pub fn check_reachable(user: &RunAs, socket: &Path) -> Result<(), String> {
    if user.uid == 0 {
        return Ok(());
    }
    let Some(folder) = socket.parent() else {
        return Ok(());
    };
    for dir in folder.ancestors().filter(|d| !d.as_os_str().is_empty()) {
        // A folder not made yet is made for the socket, enterable by all (0711).
        let Ok(m) = std::fs::metadata(dir) else {
            continue;
        };
        if bits_for(user, &m) & 1 == 0 {
            return Err(format!(
                "it runs as `{}` (uid {}), which cannot enter {} (mode {:o}, uid {}, gid {}) to reach its socket {}: put the socket in a folder it may enter (the default is /run/stitch-fn/INSTANCE.sock), or run it as a user who may",
                user.name,
                user.uid,
                dir.display(),
                m.mode() & 0o7777,
                m.uid(),
                m.gid(),
                socket.display()
            ));
        }
    }
    Ok(())
}

/// The permission bits of `m` that apply to `user` — its owner's, its group's or the others'
/// — as 4 (read), 2 (write), 1 (execute, or enter).
fn bits_for(user: &RunAs, m: &std::fs::Metadata) -> u32 {
    let shift = if m.uid() == user.uid {
        6
    } else if user.groups.contains(&m.gid()) || m.gid() == user.gid {
        3
    } else {
        0
    };
    (m.mode() >> shift) & 7
}

/// Refuses a VM whose user could not open `file` — to read, and with `write` to write too
/// (QEMU would start and exit at once): names the folder or the file in the way.
pub fn check_file(user: &RunAs, file: &Path, write: bool) -> Result<(), String> {
    if user.uid == 0 {
        return Ok(());
    }
    check_reachable(user, file)?;
    let m = std::fs::metadata(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let need = if write { 6 } else { 4 };
    if bits_for(user, &m) & need != need {
        return Err(format!(
            "it runs as `{}` (uid {}), which cannot {} {} (mode {:o}, uid {}, gid {}): give that user access (its group, or `chmod o+r`), or run it as a user who has it (`user:`)",
            user.name,
            user.uid,
            if write { "read and write" } else { "read" },
            file.display(),
            m.mode() & 0o7777,
            m.uid(),
            m.gid(),
        ));
    }
    Ok(())
}

/// What the child does between fork and exec, prepared before the fork (no allocation after).
#[derive(Debug)]
pub struct ChildSteps {
    user: Option<RunAs>,
    last_capability: u32,
    filter: Option<seccompiler::BpfProgram>,
    exec: Exec,
}

/// The program, opened by Stitch before the fork and run from that descriptor (`execveat`):
/// its user need not be able to reach it by its path (a checkout in a home folder of 0700),
/// only to execute the file. Its arguments and environment, laid out for the call.
#[derive(Debug)]
struct Exec {
    program: std::os::fd::OwnedFd,
    _argv: Vec<std::ffi::CString>,
    argv: Vec<*const libc::c_char>,
    _envp: Vec<std::ffi::CString>,
    envp: Vec<*const libc::c_char>,
}

// SAFETY: the pointers point into the CStrings the same value owns (moved with it, their heap
// buffers never move), and are only read, by the child's execveat.
unsafe impl Send for Exec {}
// SAFETY: as above: nothing writes through them.
unsafe impl Sync for Exec {}

/// NUL-terminated strings and the null-terminated array of pointers to them that exec takes.
fn c_strings(
    items: impl Iterator<Item = String>,
) -> Result<(Vec<std::ffi::CString>, Vec<*const libc::c_char>), String> {
    let owned: Vec<std::ffi::CString> = items
        .map(|s| {
            std::ffi::CString::new(s).map_err(|_| "a NUL in an argument or variable".to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut pointers: Vec<*const libc::c_char> = owned.iter().map(|c| c.as_ptr()).collect();
    pointers.push(std::ptr::null());
    Ok((owned, pointers))
}

impl Exec {
    fn new(program: &Path, args: &[String], env: &[(String, String)]) -> Result<Exec, String> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
            .open(program)
            .map_err(|e| format!("cannot open {}: {e}", program.display()))?;
        let (_argv, argv) =
            c_strings(std::iter::once(program.display().to_string()).chain(args.iter().cloned()))?;
        let (_envp, envp) = c_strings(
            std::iter::once(format!("PATH={PATH}"))
                .chain(env.iter().map(|(k, v)| format!("{k}={v}"))),
        )?;
        Ok(Exec {
            program: file.into(),
            _argv,
            argv,
            _envp,
            envp,
        })
    }
}

/// The child's steps for a confined function running as `user` (or Stitch's user), with the
/// default system-call filter when `seccomp`, ending in the exec of `program` with `args` and
/// `env` (after `PATH`).
pub fn steps(
    user: Option<RunAs>,
    seccomp: bool,
    (program, args, env): (&Path, &[String], &[(String, String)]),
) -> Result<ChildSteps, String> {
    let last_capability = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63);
    Ok(ChildSteps {
        user,
        last_capability,
        filter: seccomp.then(default_filter).transpose()?,
        exec: Exec::new(program, args, env)?,
    })
}

/// The system calls a function on Stitch's rings makes — its start (the dynamic loader),
/// memory, files it reads, threads, waiting and clocks, its Unix socket (and the AF_XDP
/// sockets it is lent: send and receive only) — found by tracing Stitch's functions and a
/// Python one; anything else is answered EPERM, as Docker's default profile answers.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_openat,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_lseek,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_select,
    libc::SYS_pselect6,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getppid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getrandom,
    libc::SYS_set_tid_address,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_arch_prctl,
    libc::SYS_prlimit64,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_access,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_wait4,
    libc::SYS_tgkill,
    libc::SYS_restart_syscall,
    libc::SYS_membarrier,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_connect,
    libc::SYS_getsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_shutdown,
];

/// The default filter: [`ALLOWED`], plus `socket` for Unix sockets only, `ioctl` for a
/// terminal's questions and `prctl` for a thread's name.
fn default_filter() -> Result<seccompiler::BpfProgram, String> {
    use seccompiler::{SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op};
    use seccompiler::{SeccompCondition as Cond, SeccompFilter, SeccompRule};
    let e = |e: seccompiler::BackendError| e.to_string();
    let arg_is = |arg: u8, values: &[u64]| -> Result<Vec<SeccompRule>, String> {
        values
            .iter()
            .map(|v| {
                SeccompRule::new(vec![Cond::new(arg, Len::Dword, Op::Eq, *v).map_err(e)?])
                    .map_err(e)
            })
            .collect()
    };
    let mut rules: std::collections::BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|s| (*s, Vec::new())).collect();
    rules.insert(libc::SYS_socket, arg_is(0, &[libc::AF_UNIX as u64])?);
    rules.insert(
        libc::SYS_ioctl,
        arg_is(
            1,
            &[libc::TCGETS, libc::TIOCGWINSZ, libc::FIONBIO, libc::FIOCLEX],
        )?,
    );
    rules.insert(
        libc::SYS_prctl,
        arg_is(0, &[libc::PR_SET_NAME as u64, libc::PR_GET_NAME as u64])?,
    );
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch,
    )
    .map_err(e)?;
    filter.try_into().map_err(e)
}

/// The environment a confined function starts with, before its app's and Stitch's variables.
pub const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl ChildSteps {
    /// Drops what the function must not have, then runs it (returns only on failure). Runs in
    /// the child after fork: only system calls (none allocates or takes a lock), on data
    /// prepared before the fork.
    pub fn run(&self) -> std::io::Result<()> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let running_as_root = unsafe { libc::geteuid() } == 0;
        if running_as_root {
            for cap in 0..=self.last_capability {
                // SAFETY: prctl with integer arguments only.
                let r =
                    unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
                // A capability this kernel does not know is not in the set: EINVAL is fine.
                if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        if let (Some(u), true) = (&self.user, running_as_root) {
            // SAFETY: `groups` is a live slice of the given length, only read.
            check(unsafe { libc::setgroups(u.groups.len(), u.groups.as_ptr()) })?;
            // SAFETY: setgid and setuid take integers only.
            check(unsafe { libc::setgid(u.gid) })?;
            // SAFETY: as above.
            check(unsafe { libc::setuid(u.uid) })?;
        }
        // SAFETY: prctl with integer arguments only.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
        // Every descriptor but the standard three closes at exec (std's own error pipe is
        // close-on-exec already).
        // SAFETY: close_range takes integers only; it marks descriptors, closing none now.
        let r = unsafe {
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            )
        };
        check(r as libc::c_int)?;
        // Last: after it, the calls above would be refused. (No allocation: the program was
        // compiled before the fork.)
        if let Some(f) = &self.filter {
            seccompiler::apply_filter(f).map_err(std::io::Error::other)?;
        }
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is open (Stitch's, until exec), the empty path and both
        // arrays are NUL- and null-terminated and live in `self.exec`; it returns only on
        // failure.
        unsafe {
            libc::syscall(
                libc::SYS_execveat,
                self.exec.program.as_raw_fd(),
                c"".as_ptr(),
                self.exec.argv.as_ptr(),
                self.exec.envp.as_ptr(),
                libc::AT_EMPTY_PATH,
            )
        };
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_the_user_cannot_enter_is_named() {
        let dir = tempfile::tempdir().unwrap();
        use std::os::unix::fs::PermissionsExt;
        let inner = dir.path().join("closed");
        std::fs::create_dir(&inner).unwrap();
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let nobody = RunAs {
            name: "nobody".into(),
            uid: 65534,
            gid: 65534,
            groups: vec![65534],
        };
        let e = check_reachable(&nobody, &inner.join("nf.sock")).unwrap_err();
        assert!(e.contains("cannot enter") && e.contains("closed"), "{e}");
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o711)).unwrap();
        check_reachable(&nobody, &inner.join("nf.sock")).unwrap();
        // Not made yet: the listener makes it enterable.
        check_reachable(&nobody, &inner.join("new/nf.sock")).unwrap();
    }
}
