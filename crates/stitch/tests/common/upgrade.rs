//! `stitch upgrade` as the tests run it: the new process, and the command.

use super::*;

/// The process that took an instance over (not a child of the test): killed if the test fails.
pub struct Successor(pub i32);

impl Drop for Successor {
    fn drop(&mut self) {
        // SAFETY: kill takes no pointers; a pid already gone fails harmlessly.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

impl Successor {
    /// Stops it like an operator (SIGINT) and returns the final counters it printed on the
    /// standard output it took over from `first`.
    pub fn stop(self, first: Stitch) -> serde_json::Value {
        // SAFETY: as in drop.
        unsafe { libc::kill(self.0, libc::SIGINT) };
        let out = first.process.finish();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{e}: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }
}

/// `stitch upgrade` of `s` with `binary`: its exit status and output.
pub fn upgrade_with(s: &Stitch, binary: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["upgrade", "--control"])
        .arg(&s.socket)
        .args(["--binary", binary])
        .output()
        .unwrap()
}

/// Upgrades `s` to this build; returns the new process and its report.
pub fn upgrade(s: &Stitch) -> (Successor, serde_json::Value) {
    let was = command_line(serving(&s.socket).expect("the instance answers"));
    let o = upgrade_with(s, env!("CARGO_BIN_EXE_stitch"));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "stitch upgrade: {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let json = &out[out.find('{').expect("a report")..];
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    let pid = report["pid"].as_i64().unwrap() as i32;
    // Owned at once: a failed check below still ends it (it is in a session of its own, no
    // child of the test's).
    let successor = Successor(pid);
    // `ps` shows the successor under the command the operator started, not a command of
    // Stitch's own.
    assert!(!was.is_empty());
    assert_eq!(
        command_line(i64::from(pid)),
        was,
        "the successor's command line"
    );
    (successor, report)
}

/// The pid of the process serving the instance on API socket `socket`, as its status says
/// (`None` while nothing answers).
pub fn serving(socket: &std::path::Path) -> Option<i64> {
    let out = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["show", "--control"])
        .arg(socket)
        .output()
        .ok()?;
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    status["pid"].as_i64()
}

/// A process's arguments (empty once it is gone).
pub fn command_line(pid: i64) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}
