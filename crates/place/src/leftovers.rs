//! Which instances are alive, and what dead ones left. A running instance holds an exclusive
//! lock (`flock`) on the file beside its API socket (`NAME.lock`) for its whole life; the
//! kernel releases it when the process dies, however it dies. Whoever takes a dead instance's
//! lock may remove what it left — its API socket, its function processes and their cgroups,
//! its kernel data plane, veth pairs and VM sockets — and an instance of that name starting
//! meanwhile is refused until the lock is free, so nothing of a live instance is ever removed.
//! Records of attached containers (`NAME.attached`) are kept: they are how a restarted agent
//! attaches its containers again.

use crate::Placements;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use stitch_core::{Engine, Registry};

/// The lock an instance holds while it runs.
#[derive(Debug)]
pub struct Owner {
    file: File,
    path: PathBuf,
}

impl Owner {
    /// A duplicate of the lock's descriptor: a successor holding it holds the same lock
    /// (`flock` locks belong to the open file), so the instance is never unowned during an
    /// upgrade.
    pub fn try_clone_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        Ok(self.file.try_clone()?.into())
    }

    /// The lock a predecessor of the instance with API socket `socket` handed over, held
    /// already.
    pub fn adopt(fd: std::os::fd::OwnedFd, socket: &Path) -> Owner {
        Owner {
            file: File::from(fd),
            path: lock_path(socket),
        }
    }

    /// At a clean stop: removes the lock file, then lets go of the lock. The file is unlinked
    /// while still held, so a process waiting for it finds, once it holds it, that the path no
    /// longer names that file and locks the path afresh (`lock`): two owners never coexist.
    /// Not for a process handing its instance over: the successor holds the same file.
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Where the instance whose API socket is `socket` listens for a process taking it over
/// (`stitch upgrade`).
pub fn upgrade_socket(socket: &Path) -> PathBuf {
    socket.with_extension("upgrade")
}

/// What the resources on the host (function cgroups, the kernel data plane) of an instance
/// given its API socket with `--control` are named after: the socket's absolute path, made
/// safe for a file name (only one live instance can hold a socket).
pub fn key_of_socket(socket: &Path) -> String {
    let path = std::path::absolute(socket).unwrap_or_else(|_| socket.to_path_buf());
    let flat: Vec<char> = path
        .display()
        .to_string()
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                true => c,
                false => '_',
            },
        )
        .collect();
    flat[flat.len().saturating_sub(200)..].iter().collect()
}

/// The lock file of the instance whose API socket is `socket`.
pub fn lock_path(socket: &Path) -> PathBuf {
    socket.with_extension("lock")
}

/// Takes the instance whose API socket is `socket` for this process; refused while another
/// live process holds it. A sweep by another instance holds a dead instance's lock for a
/// moment, so a held lock is waited for a little before its holder counts as live.
pub fn own(socket: &Path) -> Result<Owner, String> {
    lock(socket, HELD_PATIENCE)
}

/// The instance's lock, waiting at most `patience` while another process holds it.
fn lock(socket: &Path, patience: std::time::Duration) -> Result<Owner, String> {
    let path = lock_path(socket);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let started = std::time::Instant::now();
    loop {
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            if names_the_same_file(&path, &file) {
                return Ok(Owner { file, path });
            }
            // Its owner removed it at a clean stop while this process waited: that lock
            // guards nothing now.
            continue;
        }
        let e = std::io::Error::last_os_error();
        let held = e.raw_os_error() == Some(libc::EWOULDBLOCK);
        if held && started.elapsed() < patience {
            std::thread::sleep(std::time::Duration::from_millis(20));
            continue;
        }
        return Err(if held {
            format!(
                "another stitch instance runs with the API socket {} (it holds {}): stop it, \
                 or give this one another --name",
                socket.display(),
                path.display()
            )
        } else {
            format!("cannot lock {}: {e}", path.display())
        });
    }
}

/// Whether `path` still names the open `file` (a released lock's file is unlinked).
fn names_the_same_file(path: &Path, file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(named), Ok(open)) => named.dev() == open.dev() && named.ino() == open.ino(),
        _ => false,
    }
}

/// How long a held lock is waited for before its holder counts as a live instance.
const HELD_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// Removes what the dead instance with API socket `socket` and resource key `key` (its name,
/// or its socket's path when it was given one) left; refused while it runs. Returns what was
/// removed, in words.
pub fn clean_dead(socket: &Path, key: &str) -> Result<Vec<String>, String> {
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(format!(
            "an instance answers on {}: it is running, nothing was removed",
            socket.display()
        ));
    }
    // Not waited for: a holder is a live instance, or one starting. Where the socket's folder
    // is gone no instance can hold it (and none is made just to hold a lock).
    let folder_gone = lock_path(socket).parent().is_some_and(|d| !d.exists());
    let owner = match folder_gone {
        true => None,
        false => Some(lock(socket, std::time::Duration::ZERO)?),
    };
    let engine = Arc::new(Engine::new(Arc::new(Registry::new())));
    let mut removed = Placements::new(engine, key).clean_after_crash();
    if std::fs::remove_file(socket).is_ok() {
        removed.push(format!("the API socket {}", socket.display()));
    }
    let upgrade = upgrade_socket(socket);
    if std::fs::remove_file(&upgrade).is_ok() {
        removed.push(format!("the upgrade socket {}", upgrade.display()));
    }
    if let Some(owner) = owner {
        owner.release();
    }
    Ok(removed)
}

/// Cleans every dead instance whose API socket is in `dir` (the runtime folder), except the
/// one with socket `except`: instance name → what was removed (instances that left nothing
/// are not listed). An instance that stopped removed its socket: only one that died leaves
/// it, so instances that ran and stopped cost the sweep nothing.
pub fn sweep(dir: &Path, except: Option<&Path>) -> Vec<(String, Vec<String>)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "sock"))
        .filter_map(|p| p.file_stem()?.to_str().map(String::from))
        .collect();
    names.sort();
    names.dedup();
    let mut out = Vec::new();
    for name in names {
        let socket = dir.join(format!("{name}.sock"));
        if except == Some(socket.as_path()) {
            continue;
        }
        if let Ok(removed) = clean_dead(&socket, &name) {
            if !removed.is_empty() {
                out.push((name, removed));
            }
        }
    }
    remove_free_locks(dir);
    out
}

/// Removes the lock files in `dir` that no process holds and that have no API socket beside
/// them (instances that stopped before their lock files were removed at a clean stop).
fn remove_free_locks(dir: &Path) {
    let locks = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "lock"));
    for lock_file in locks {
        let socket = lock_file.with_extension("sock");
        if socket.exists() {
            continue;
        }
        if let Ok(owner) = lock(&socket, std::time::Duration::ZERO) {
            owner.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_owner_is_never_cleaned_and_a_dead_ones_socket_is() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("leftovers-unit-live.sock");
        let dead = dir.path().join("leftovers-unit-dead.sock");
        let owner = own(&live).unwrap();
        assert!(own(&live)
            .unwrap_err()
            .contains("another stitch instance runs"));
        // A socket nobody listens on, as a process killed -9 leaves it.
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let swept = sweep(dir.path(), None);
        assert_eq!(swept.len(), 1, "{swept:?}");
        assert_eq!(swept[0].0, "leftovers-unit-dead");
        assert!(!dead.exists());
        assert!(lock_path(&live).exists());
        assert!(
            clean_dead(&live, "leftovers-unit-live").is_err(),
            "its lock is held"
        );
        drop(owner);
        assert!(
            clean_dead(&live, "leftovers-unit-live").is_ok(),
            "free once its owner is gone"
        );
    }

    #[test]
    fn a_clean_stop_leaves_no_lock_file_and_a_waiter_never_holds_a_removed_one() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("leftovers-unit-stop.sock");
        let first = own(&socket).unwrap();
        // A second instance starting meanwhile waits for the lock; the first stops cleanly.
        let waiter = std::thread::spawn({
            let socket = socket.clone();
            move || own(&socket)
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        first.release();
        let second = waiter
            .join()
            .unwrap()
            .expect("the lock is free after a clean stop");
        assert!(
            lock_path(&socket).exists(),
            "the second owner's file is at the path"
        );
        assert!(
            own(&socket).is_err(),
            "the path names the file the second owner holds"
        );
        second.release();
        assert!(!lock_path(&socket).exists());
        // Lock files of instances that stopped before they were removed at a stop go with a
        // sweep; a held one stays.
        let stale = dir.path().join("leftovers-unit-stale.lock");
        std::fs::write(&stale, "").unwrap();
        let held = own(&dir.path().join("leftovers-unit-held.sock")).unwrap();
        sweep(dir.path(), None);
        assert!(!stale.exists());
        assert!(dir.path().join("leftovers-unit-held.lock").exists());
        drop(held);
    }

    #[test]
    fn cleaning_after_an_instance_whose_folder_is_gone_makes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("gone");
        let socket = folder.join("ctl.sock");
        let removed = clean_dead(&socket, &socket.display().to_string()).unwrap();
        assert!(removed.is_empty(), "{removed:?}");
        assert!(!folder.exists(), "no folder made to hold a lock in");
    }
}
