//! Which capture sessions tap a kernel data plane: a claim file per session (its process,
//! snap length and VIDs) beside the plane's record, written whole under a lock, and the tap
//! points recomputed from the claims that exist. Kept apart from the sessions themselves
//! ([`crate::tap`]) so that the data plane can clear what dead readers left without knowing
//! about sessions.

use crate::error::Error;
use crate::maps::{Pod, TapPoint, MAX_VIDS, TAP_SESSIONS};
use libbpf_rs::{MapCore, MapFlags, MapHandle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// What a claim file holds.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Claim {
    pub pid: u32,
    pub snaplen: u32,
    pub vids: Vec<u32>,
}

pub(crate) fn open_pinned(dir: &Path, name: &str) -> Result<MapHandle, Error> {
    let path = dir.join(name);
    MapHandle::from_pinned_path(&path).map_err(|e| {
        Error(format!(
            "cannot open {}: {e} (is the data plane installed by this version? `stitch kernel \
             apply`)",
            path.display()
        ))
    })
}

pub(crate) fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// An exclusive lock on a file, released when dropped.
pub(crate) struct FileLock(std::fs::File);

impl FileLock {
    pub(crate) fn take(path: &Path) -> Result<FileLock, Error> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| Error(format!("cannot open {}: {e}", path.display())))?;
        // SAFETY: a valid, open file descriptor.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(Error(format!(
                "cannot lock {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            )));
        }
        Ok(FileLock(f))
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: a valid, open file descriptor.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

pub(crate) fn claim_path(dir: &Path, plane: &str, session: u32) -> PathBuf {
    dir.join(format!("{plane}.tap.{session}"))
}

pub(crate) fn read_claim(path: &Path) -> Option<Claim> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Clears the claims of sessions whose process is gone, their rings and their tap points.
/// Called with the lock held.
pub(crate) fn clear_dead_sessions(
    dir: &Path,
    plane: &str,
    taps: &MapHandle,
    tap_rings: &MapHandle,
) -> Result<(), Error> {
    let mut orphaned = Vec::new();
    let mut unknown = false;
    for n in 0..TAP_SESSIONS {
        let path = claim_path(dir, plane, n);
        let dead = match read_claim(&path) {
            Some(c) if !process_alive(c.pid) => Some(c.vids),
            Some(_) => None,
            // Unreadable: claims are written whole under the lock, so nobody is writing it.
            // Its VIDs are unknown: every point is recomputed.
            None if path.exists() => {
                unknown = true;
                Some(Vec::new())
            }
            None => None,
        };
        if let Some(vids) = dead {
            let _ = tap_rings.delete(&n.to_ne_bytes());
            let _ = std::fs::remove_file(&path);
            orphaned.extend(vids);
        }
    }
    if unknown {
        orphaned = (1..MAX_VIDS).collect();
    }
    write_points(taps, dir, plane, &orphaned)
}

/// Clears what capture sessions whose process is gone left in data plane `plane` (a reader
/// killed before it could remove its taps).
pub(crate) fn clear_dead(dir: &Path, plane: &str, pin_dir: &Path) -> Result<(), Error> {
    let lock = dir.join(format!("{plane}.taps.lock"));
    if !lock.exists() {
        return Ok(());
    }
    let taps = open_pinned(pin_dir, "taps")?;
    let tap_rings = open_pinned(pin_dir, "tap_rings")?;
    let _held = FileLock::take(&lock)?;
    clear_dead_sessions(dir, plane, &taps, &tap_rings)
}

/// Recomputes the tap points of `vids` from the claims that exist.
pub(crate) fn write_points(
    taps: &MapHandle,
    dir: &Path,
    plane: &str,
    vids: &[u32],
) -> Result<(), Error> {
    let claims: Vec<(u32, Claim)> = (0..TAP_SESSIONS)
        .filter_map(|n| read_claim(&claim_path(dir, plane, n)).map(|c| (n, c)))
        .collect();
    let touched: BTreeSet<u32> = vids.iter().copied().collect();
    for vid in touched {
        let mut point = TapPoint::default();
        for (n, c) in &claims {
            if c.vids.contains(&vid) {
                point.sessions |= 1 << n;
                point.snaplen = point.snaplen.max(c.snaplen);
            }
        }
        taps.update(&vid.to_ne_bytes(), point.bytes(), MapFlags::ANY)
            .map_err(|e| Error(format!("writing map taps: {e}")))?;
    }
    Ok(())
}

/// Removes the claim files of a data plane (its maps are gone).
pub(crate) fn forget_claims(dir: &Path, plane: &str) {
    for n in 0..TAP_SESSIONS {
        let _ = std::fs::remove_file(claim_path(dir, plane, n));
    }
    let _ = std::fs::remove_file(dir.join(format!("{plane}.taps.lock")));
}
