//! Who may attach a function port. The attach socket is shared by the functions of every port
//! on it, which may run as different users, so its mode cannot say it (it is 0666 in a folder
//! others may enter but not list); the listener asks the kernel who connected
//! (`SO_PEERCRED`) and lets a hello for port P in only from:
//! - root, or the user Stitch runs as (they could take Stitch itself);
//! - the process Stitch started for P (`placement: process`), or a process it started
//!   ([`expect_process`]: the supervisor names each process it starts or adopts);
//! - a user or group P names (`allow_users`, `allow_groups`: functions started by others).
//!
//! Anything else is refused with the reason, and nothing of the port is given away — no
//! region, no packet memory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Users and groups a port lets attach besides root, Stitch's user and its own process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Peers {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

impl Peers {
    /// The ids of users and groups named in a port's settings; an unknown name is an error.
    pub fn named(users: &[String], groups: &[String]) -> Result<Peers, String> {
        let uids = users
            .iter()
            .map(|u| match nix::unistd::User::from_name(u) {
                Ok(Some(user)) => Ok(user.uid.as_raw()),
                Ok(None) => Err(format!("allow_users: no user `{u}` on this host")),
                Err(e) => Err(format!("allow_users: cannot look up `{u}`: {e}")),
            })
            .collect::<Result<_, _>>()?;
        let gids = groups
            .iter()
            .map(|g| match nix::unistd::Group::from_name(g) {
                Ok(Some(group)) => Ok(group.gid.as_raw()),
                Ok(None) => Err(format!("allow_groups: no group `{g}` on this host")),
                Err(e) => Err(format!("allow_groups: cannot look up `{g}`: {e}")),
            })
            .collect::<Result<_, _>>()?;
        Ok(Peers { uids, gids })
    }
}

pub use stitch_core::fdpass::{peer_cred, Cred};

/// The process Stitch runs for a port, as its supervisor told.
#[derive(Debug, Clone, Copy, Default)]
struct Expected {
    pid: Option<i32>,
    /// A process for the port is being started: its pid is not known yet, and it may say its
    /// hello before the supervisor learns it.
    starting: bool,
}

/// The process Stitch started for each port, by socket path and port name.
fn expected() -> &'static Mutex<HashMap<(PathBuf, String), Expected>> {
    static E: OnceLock<Mutex<HashMap<(PathBuf, String), Expected>>> = OnceLock::new();
    E.get_or_init(Default::default)
}

fn key(socket: &Path, port: &str) -> (PathBuf, String) {
    (socket.to_path_buf(), port.to_string())
}

/// A process for port `port` on `socket` is about to be started by this process: until
/// [`expect_process`] names it, a child of this process may attach the port if no other port
/// expects it.
pub fn expect_a_child(socket: &Path, port: &str) {
    let mut e = expected().lock().unwrap_or_else(|p| p.into_inner());
    e.entry(key(socket, port)).or_default().starting = true;
}

/// Process `pid` (and what it starts) may attach port `port` on `socket`: Stitch started it
/// for that port, or adopted it.
pub fn expect_process(socket: &Path, port: &str, pid: i32) {
    expected().lock().unwrap_or_else(|p| p.into_inner()).insert(
        key(socket, port),
        Expected {
            pid: Some(pid),
            starting: false,
        },
    );
}

/// Process `pid` has ended (or never started): a process that gets its number later is not it.
pub fn forget_process(socket: &Path, port: &str, pid: Option<i32>) {
    let mut e = expected().lock().unwrap_or_else(|p| p.into_inner());
    let k = key(socket, port);
    if e.get(&k).is_some_and(|x| pid.is_none() || x.pid == pid) {
        e.remove(&k);
    }
}

/// Whether `pid` may attach `port` on `socket` as the process Stitch started for it.
fn started_for(socket: &Path, port: &str, pid: i32) -> bool {
    let e = expected().lock().unwrap_or_else(|p| p.into_inner());
    let Some(x) = e.get(&key(socket, port)).copied() else {
        return false;
    };
    if x.pid.is_some_and(|p| descends_from(pid, p)) {
        return true;
    }
    // Its start, not named yet: a child of this process that no other port expects.
    x.starting
        && parent_of(pid) == Some(std::process::id() as i32)
        && !e.values().any(|o| o.pid == Some(pid))
}

/// `pid`'s parent, from `/proc/PID/stat` (its fourth field, after the name in parentheses,
/// which may itself hold spaces and parentheses).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is `ancestor` or descends from it (a function's wrapper may fork).
fn descends_from(pid: i32, ancestor: i32) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if p == ancestor {
            return true;
        }
        match parent_of(p) {
            Some(parent) if parent > 1 => p = parent,
            _ => return false,
        }
    }
    false
}

/// Every group of process `pid` (its supplementary groups, from `/proc/PID/status`).
fn groups_of(pid: i32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Refuses `cred` for port `port` on `socket` unless it may attach it (module docs).
pub fn check(socket: &Path, port: &str, peers: &Peers, cred: Option<Cred>) -> Result<(), String> {
    let Some(cred) = cred else {
        return Err("the kernel does not say who connected: refused".into());
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if cred.uid == 0 || cred.uid == me || peers.uids.contains(&cred.uid) {
        return Ok(());
    }
    if started_for(socket, port, cred.pid) {
        return Ok(());
    }
    if peers.gids.contains(&cred.gid) || groups_of(cred.pid).iter().any(|g| peers.gids.contains(g))
    {
        return Ok(());
    }
    Err(format!(
        "uid {} (pid {}) may not attach function port `{port}`: only the process Stitch started for it, root, and the users and groups its `allow_users` and `allow_groups` name may",
        cred.uid, cred.pid
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_descends_from_its_parents_and_not_from_others() {
        let me = std::process::id() as i32;
        assert!(descends_from(me, me));
        let parent = parent_of(me).unwrap();
        assert!(descends_from(me, parent));
        assert!(!descends_from(parent, me));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(descends_from(child.id() as i32, me));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn another_user_gets_in_only_as_the_expected_process_or_by_name() {
        let socket = Path::new("/nowhere/peers-test.sock");
        let me = std::process::id() as i32;
        let stranger = Cred {
            pid: me,
            uid: 54321,
            gid: 54321,
        };
        let none = Peers::default();
        let e = check(socket, "p", &none, Some(stranger)).unwrap_err();
        assert!(
            e.contains("uid 54321") && e.contains("may not attach"),
            "{e}"
        );
        assert!(check(socket, "p", &none, None).is_err());
        // Named by uid or by group.
        let by_uid = Peers {
            uids: vec![54321],
            gids: vec![],
        };
        check(socket, "p", &by_uid, Some(stranger)).unwrap();
        let by_gid = Peers {
            uids: vec![],
            gids: vec![54321],
        };
        check(socket, "p", &by_gid, Some(stranger)).unwrap();
        // The process started for the port (here: this one), not for another port.
        expect_process(socket, "p", me);
        check(socket, "p", &none, Some(stranger)).unwrap();
        assert!(check(socket, "q", &none, Some(stranger)).is_err());
        forget_process(socket, "p", Some(me));
        assert!(check(socket, "p", &none, Some(stranger)).is_err());
        // While a process for the port starts, a child of this process that no other port
        // expects; not this process itself (no child of its own).
        let child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let child_cred = Cred {
            pid: child.id() as i32,
            ..stranger
        };
        assert!(check(socket, "p", &none, Some(child_cred)).is_err());
        expect_a_child(socket, "p");
        check(socket, "p", &none, Some(child_cred)).unwrap();
        assert!(check(socket, "p", &none, Some(stranger)).is_err());
        expect_process(socket, "q", child_cred.pid);
        assert!(
            check(socket, "p", &none, Some(child_cred)).is_err(),
            "q's process"
        );
        forget_process(socket, "p", None);
        forget_process(socket, "q", None);
        let mut child = child;
        child.kill().unwrap();
        child.wait().unwrap();
        // Root and Stitch's own user always.
        let root = Cred { uid: 0, ..stranger };
        check(socket, "p", &none, Some(root)).unwrap();
    }
}
