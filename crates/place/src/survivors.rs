//! Function processes that outlive the Stitch process that started them, when it is killed or
//! crashes: each asks for its port again for a while (`client::Function::reattach`, allowed by
//! `STITCH_NF_REATTACH_SECONDS`), and the Stitch started in its place adopts it instead of
//! starting another. Each running process is recorded beside the instance
//! (`fn-HASH/APP.json`: its pid, its start time and its command) when it starts; a record is
//! believed only for a live process with the same start time, so a reused pid is never
//! adopted.

use crate::pidfd;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The records of one instance's function processes.
#[derive(Clone)]
pub struct Records {
    dir: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct Record {
    pid: u32,
    /// Clock ticks from boot to the process's start (`/proc/PID/stat`).
    started: u64,
    program: PathBuf,
    args: Vec<String>,
}

/// A recorded process that still runs.
pub struct Survivor {
    pub pid: u32,
    pub pidfd: OwnedFd,
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl Records {
    pub fn of(instance: &str) -> Records {
        Records {
            dir: stitch_core::runtime_dir()
                .join(format!("fn-{:016x}", stitch_nf::paths::name_hash(instance))),
        }
    }

    /// Records `app`'s process `pid` (written whole, then renamed into place).
    pub fn write(&self, app: &str, pid: u32, program: &Path, args: &[String]) {
        let Some(started) = start_time(pid) else {
            return;
        };
        let record = Record {
            pid,
            started,
            program: program.to_path_buf(),
            args: args.to_vec(),
        };
        let written = std::fs::create_dir_all(&self.dir).and_then(|()| {
            stitch_core::files::write_atomically(
                &self.dir.join(format!("{app}.json")),
                &serde_json::to_vec(&record)?,
                0o600,
            )
        });
        if let Err(e) = written {
            log::warn!(
                "function `{app}` (pid {pid}) not recorded in {}: a restart of Stitch will not \
                 find it: {e}",
                self.dir.display()
            );
        }
    }

    pub fn remove(&self, app: &str) {
        let _ = std::fs::remove_file(self.dir.join(format!("{app}.json")));
    }

    pub fn remove_all(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// The recorded processes still running as recorded, by app; the other records are
    /// removed.
    pub fn survivors(&self) -> BTreeMap<String, Survivor> {
        let mut found = BTreeMap::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return found;
        };
        for e in entries.flatten() {
            let path = e.path();
            let Some(app) = (path.file_name().and_then(|n| n.to_str()))
                .and_then(|n| n.strip_suffix(".json"))
                .filter(|n| !n.starts_with('.'))
            else {
                let _ = std::fs::remove_file(&path);
                continue;
            };
            match std::fs::read(&path).ok().and_then(|b| alive(&b)) {
                Some(s) => {
                    found.insert(app.to_string(), s);
                }
                None => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        found
    }
}

/// The process a record names, if it runs and is the one recorded.
fn alive(record: &[u8]) -> Option<Survivor> {
    let r: Record = serde_json::from_slice(record).ok()?;
    let pidfd = pidfd::open(r.pid).ok()?;
    // Checked after the pidfd is held: the pid cannot be reused while it is.
    (start_time(r.pid)? == r.started && !pidfd::ended(&pidfd, 0)).then_some(Survivor {
        pid: r.pid,
        pidfd,
        program: r.program,
        args: r.args,
    })
}

/// When process `pid` started, in clock ticks from boot (field 22 of `/proc/PID/stat`).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command (field 2) may hold spaces and parentheses: fields after its last `)`.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Two pipes, for a process's standard output and error: (read ends, write ends).
pub fn output_pipes() -> io::Result<([OwnedFd; 2], [OwnedFd; 2])> {
    let pipe = || -> io::Result<(OwnedFd, OwnedFd)> {
        let mut fds = [0i32; 2];
        // SAFETY: the kernel writes two descriptors into `fds`, a live array of two.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 returned two new descriptors that nothing else owns.
        Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
    };
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    Ok(([out_r, err_r], [out_w, err_w]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_believed_only_for_the_process_it_names() {
        let records = Records {
            dir: tempfile::tempdir().unwrap().keep(),
        };
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        records.write("live", child.id(), Path::new("/bin/sleep"), &["30".into()]);
        // This test's own pid, with another start time: a reused pid.
        let me = std::process::id();
        let forged = Record {
            pid: me,
            started: start_time(me).unwrap() + 1,
            program: "/bin/true".into(),
            args: vec![],
        };
        std::fs::write(
            records.dir.join("reused.json"),
            serde_json::to_vec(&forged).unwrap(),
        )
        .unwrap();
        std::fs::write(records.dir.join("garbage.json"), b"{").unwrap();
        let found = records.survivors();
        assert_eq!(found.keys().collect::<Vec<_>>(), ["live"]);
        assert_eq!(found["live"].pid, child.id());
        assert_eq!(found["live"].args, ["30"]);
        assert!(!records.dir.join("reused.json").exists());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            records.survivors().is_empty(),
            "a dead process is no survivor"
        );
        records.remove_all();
    }
}
