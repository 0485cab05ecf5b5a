//! `dpdk-testpmd` with one virtio-user port: a real virtio driver on a vhost-user socket,
//! the guest side of a `vhost_user` port without a VM.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A testpmd with a virtio-user port on `sock`, in `mode` (txonly, rxonly, io).
pub struct Testpmd {
    child: Option<Child>,
    prefix: String,
}

/// testpmd's accumulated counters: (RX-packets, TX-packets).
pub fn accumulated(out: &str) -> (u64, u64) {
    let block = out
        .split("Accumulated forward statistics for all ports")
        .nth(1)
        .unwrap_or_else(|| panic!("no final statistics from testpmd:\n{out}"));
    let field = |name: &str| -> u64 {
        let at = block
            .find(name)
            .unwrap_or_else(|| panic!("{name} in {block}"));
        block[at + name.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (field("RX-packets:"), field("TX-packets:"))
}

impl Testpmd {
    pub fn start(sock: &std::path::Path, mode: &str, tag: &str) -> Testpmd {
        Testpmd::start_with(sock, mode, tag, "")
    }

    /// `vdev_extra` is appended to the virtio-user device arguments (e.g. `,server=1`).
    pub fn start_with(sock: &std::path::Path, mode: &str, tag: &str, vdev_extra: &str) -> Testpmd {
        Testpmd::spawn(
            &format!(
                "net_virtio_user0,path={},queues=1{vdev_extra}",
                sock.display()
            ),
            &[&format!("--forward-mode={mode}")],
            tag,
            "start",
        )
    }

    /// An interactive testpmd (commands on its standard input) with one virtio-user `vdev`;
    /// forwarding starts with `start_command`.
    pub fn spawn(vdev: &str, args: &[&str], tag: &str, start_command: &str) -> Testpmd {
        use std::io::Write;
        let prefix = format!("st{}{tag}", std::process::id());
        let mut child = Command::new("dpdk-testpmd")
            .args(["-l", "0,1", "--no-pci", "--no-huge", "-m", "512"])
            .args([
                "--file-prefix",
                &prefix,
                "--log-level",
                "pmd.net.virtio.*:error",
            ])
            .args(["--vdev", vdev])
            .args(["--", "-i", "--total-num-mbufs=32768"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dpdk-testpmd (package dpdk-dev) is needed");
        writeln!(child.stdin.as_mut().unwrap(), "{start_command}").unwrap();
        Testpmd {
            child: Some(child),
            prefix,
        }
    }

    /// Stops forwarding (the ports stay up, so the back-end can take what was queued), then
    /// quits; returns testpmd's (RX, TX) packet counts at the stop.
    pub fn stop(mut self) -> (u64, u64) {
        use std::io::Write;
        let mut child = self.child.take().unwrap();
        let stdin = child.stdin.as_mut().unwrap();
        writeln!(stdin, "stop").unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let _ = writeln!(stdin, "quit");
        let out = child.wait_with_output().unwrap();
        accumulated(&String::from_utf8_lossy(&out.stdout))
    }
}

impl Drop for Testpmd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(format!("/var/run/dpdk/{}", self.prefix));
    }
}

impl Testpmd {
    /// io forwarding: what port 0 receives it sends back on port 0.
    pub fn start_io(sock: &std::path::Path) -> Testpmd {
        Testpmd::spawn(
            &format!("net_virtio_user0,path={},queues=1", sock.display()),
            &["--forward-mode=io"],
            "io",
            "start tx_first",
        )
    }
}
