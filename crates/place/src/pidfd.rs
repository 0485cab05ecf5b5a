//! Processes by pidfd: a descriptor that names one process and never another that reuses its
//! pid — for processes this Stitch did not start (taken over by an upgrade, or left running
//! by a Stitch process that ended), which it cannot wait for.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// A descriptor for process `pid` that stays its own even once the pid is reused.
pub fn open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags, no pointers.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `signal` to the process; false when it is gone.
pub fn signal(fd: &OwnedFd, signal: i32) -> bool {
    // SAFETY: no siginfo (null) and no flags: the call reads nothing from this process.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r == 0
}

/// Whether the process ended (its pidfd reads ready), waiting up to `wait_ms`.
pub fn ended(fd: &OwnedFd, wait_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `p` is one live pollfd.
    unsafe { libc::poll(&mut p, 1, wait_ms) > 0 }
}
