//! QEMU's machine protocol (QMP): a client on a VM's QMP socket. Stitch asks a guest to power
//! down (the ACPI power button) and asks QEMU whether the guest runs (a VM paused by QEMU —
//! after a host I/O error, or by an operator's `stop` — forwards nothing, and says so nowhere
//! else).
//!
//! The protocol: QEMU greets each connection (`{"QMP": …}`), the client leaves negotiation mode
//! with `qmp_capabilities`, then each `{"execute": CMD, "arguments": …}` is answered by one
//! `{"return": …}` or `{"error": {"class", "desc"}}`; asynchronous events (`{"event": …}`) may
//! come between a command and its answer and are passed over.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// What went wrong talking to QEMU.
#[derive(Debug)]
pub enum QmpError {
    /// The socket: no QEMU there, or it did not answer in time.
    Io(std::io::Error),
    /// QEMU refused the command: its error class and description.
    Refused { class: String, desc: String },
    /// Something that is not QMP.
    Protocol(String),
}

impl std::fmt::Display for QmpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QmpError::Io(e) => write!(f, "QMP socket: {e}"),
            QmpError::Refused { class, desc } => write!(f, "QEMU refused it ({class}): {desc}"),
            QmpError::Protocol(what) => write!(f, "not QMP: {what}"),
        }
    }
}

impl std::error::Error for QmpError {}

impl From<std::io::Error> for QmpError {
    fn from(e: std::io::Error) -> QmpError {
        QmpError::Io(e)
    }
}

/// A QMP connection out of negotiation mode, ready for commands.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects to the QMP socket `path`, each read waiting at most `patience`.
    pub fn connect(path: &Path, patience: Duration) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(patience))?;
        stream.set_write_timeout(Some(patience))?;
        let writer = stream.try_clone()?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = qmp.message()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("greeting {greeting}")));
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    /// Runs `command` with `arguments`; what it returned.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let line = request(command, arguments);
        self.writer.write_all(line.as_bytes())?;
        self.answer()
    }

    /// Runs `command` with descriptor `fd` passed along (SCM_RIGHTS: `add-fd`, `getfd`), so
    /// that QEMU gets its own copy whatever user it runs as.
    pub fn execute_passing(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        use std::os::fd::AsRawFd;
        let line = request(command, arguments);
        stitch_core::fdpass::send(self.writer.as_raw_fd(), line.as_bytes(), &[fd.as_raw_fd()])?;
        self.answer()
    }

    /// The answer to the command just sent, past any events.
    fn answer(&mut self) -> Result<Value, QmpError> {
        loop {
            let mut answer = self.message()?;
            if let Some(r) = answer.get_mut("return") {
                return Ok(r.take());
            }
            if let Some(e) = answer.get("error") {
                let text = |k: &str| e[k].as_str().unwrap_or_default().to_string();
                return Err(QmpError::Refused {
                    class: text("class"),
                    desc: text("desc"),
                });
            }
            if answer.get("event").is_none() {
                return Err(QmpError::Protocol(format!("answer {answer}")));
            }
        }
    }

    /// The next JSON object QEMU sends (one a line).
    fn message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(QmpError::Protocol("QEMU closed the connection".into()));
        }
        serde_json::from_str(&line).map_err(|e| QmpError::Protocol(format!("{e}: {line}")))
    }
}

/// One command as QMP reads it: a JSON object on a line.
fn request(command: &str, arguments: Option<Value>) -> String {
    let mut request = json!({ "execute": command });
    if let Some(a) = arguments {
        request["arguments"] = a;
    }
    let mut line = request.to_string();
    line.push('\n');
    line
}

/// Asks the VM behind QMP socket `qmp` to power down (the ACPI power button). False when QEMU
/// did not take the request.
pub fn power_down(qmp: &Path) -> bool {
    Qmp::connect(qmp, Duration::from_secs(1))
        .and_then(|mut q| q.execute("system_powerdown", None))
        .is_ok()
}

/// Whether the guest behind QMP socket `qmp` runs: QEMU's `query-status` (`status`: `running`,
/// `paused`, `shutdown`, `internal-error`, `io-error`, …; `running`), or why it could not be
/// asked.
pub fn guest_status(qmp: &Path) -> Value {
    match Qmp::connect(qmp, Duration::from_millis(500))
        .and_then(|mut q| q.execute("query-status", None))
    {
        Ok(s) => json!({ "status": s["status"], "running": s["running"] }),
        Err(e) => json!({ "status": null, "error": e.to_string() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A QMP server that greets, then answers each line with the next of `answers`.
    fn fake_qemu(path: &Path, answers: Vec<&'static str>) -> std::thread::JoinHandle<Vec<String>> {
        let listener = UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut asked = Vec::new();
            for a in answers {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                asked.push(line.trim().to_string());
                s.write_all(a.as_bytes()).unwrap();
            }
            asked
        })
    }

    #[test]
    fn commands_are_answered_past_events_and_refusals_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp");
        let server = fake_qemu(
            &path,
            vec![
                "{\"return\": {}}\n",
                "{\"event\": \"STOP\", \"timestamp\": {}}\n{\"return\": {\"status\": \"paused\", \"running\": false}}\n",
                "{\"error\": {\"class\": \"GenericError\", \"desc\": \"Duplicate ID 'm1'\"}}\n",
            ],
        );
        let mut q = Qmp::connect(&path, Duration::from_secs(2)).unwrap();
        let status = q.execute("query-status", None).unwrap();
        assert_eq!(status["status"], "paused");
        let refused = q
            .execute(
                "object-add",
                Some(json!({ "qom-type": "memory-backend-file", "id": "m1" })),
            )
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "QEMU refused it (GenericError): Duplicate ID 'm1'"
        );
        let asked = server.join().unwrap();
        assert_eq!(asked[0], "{\"execute\":\"qmp_capabilities\"}");
        assert!(asked[2].contains("\"id\":\"m1\""), "{}", asked[2]);
    }

    #[test]
    fn no_qemu_and_a_stranger_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let absent = guest_status(&dir.path().join("none"));
        assert!(
            absent["error"].as_str().unwrap().starts_with("QMP socket"),
            "{absent}"
        );
        let path = dir.path().join("stranger");
        let listener = UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"SSH-2.0-OpenSSH\n").unwrap();
        });
        let e = Qmp::connect(&path, Duration::from_secs(2)).err().unwrap();
        assert!(matches!(e, QmpError::Protocol(_)), "{e}");
        t.join().unwrap();
    }
}
