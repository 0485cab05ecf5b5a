//! A function's connection to Stitch: the attach socket on the host, or in a guest the
//! virtio-serial port its QEMU joins to that socket. Both carry JSON lines; only the socket
//! carries descriptors.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};
use stitch_core::fdpass;

pub(crate) enum Control {
    Socket(UnixStream),
    /// A virtio-serial port, and the bytes read past the last complete line.
    Serial {
        port: File,
        rest: Vec<u8>,
    },
}

/// Polls `fd` for `events` for up to `timeout` (forever if `None`); the events seen.
fn poll(fd: RawFd, events: i16, timeout: Option<Duration>) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    loop {
        // SAFETY: `p` is one live pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n >= 0 {
            return Ok(if n == 0 { 0 } else { p.revents });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

impl Control {
    /// The guest's virtio-serial port at `device`.
    pub fn serial(device: &Path) -> io::Result<Control> {
        let port = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(device)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot open the port to Stitch {}: {e}", device.display()),
                )
            })?;
        Ok(Control::Serial {
            port,
            rest: Vec::new(),
        })
    }

    /// The same connection on another descriptor.
    pub fn try_clone(&self) -> io::Result<Control> {
        Ok(match self {
            Control::Socket(s) => Control::Socket(s.try_clone()?),
            Control::Serial { port, rest } => Control::Serial {
                port: port.try_clone()?,
                rest: rest.clone(),
            },
        })
    }

    pub fn as_raw_fd(&self) -> RawFd {
        match self {
            Control::Socket(s) => s.as_raw_fd(),
            Control::Serial { port, .. } => port.as_raw_fd(),
        }
    }

    /// Waits until QEMU's end of a virtio-serial port is connected to Stitch (a socket is from
    /// the start).
    pub fn wait_for_host(&self, within: Duration) -> io::Result<()> {
        let deadline = Instant::now() + within;
        while self.closed(false) {
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "Stitch is not connected to this guest's port: is the VM started by a \
                     running Stitch, with `rings: ivshmem`?",
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    pub fn send_line(&mut self, line: &str) -> io::Result<()> {
        let bytes = format!("{line}\n");
        match self {
            Control::Socket(s) => s.write_all(bytes.as_bytes()),
            Control::Serial { port, .. } => port.write_all(bytes.as_bytes()),
        }
    }

    /// Complete lines from Stitch (one at least), with the descriptors that came with them;
    /// waits `within` at most (`None`: as long as it takes). Empty when the connection closed.
    pub fn recv(&mut self, within: Option<Duration>) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
        let deadline = within.map(|w| Instant::now() + w);
        let timed_out = || io::Error::new(io::ErrorKind::TimedOut, "no answer from Stitch");
        let left = |d: Option<Instant>| d.map(|d| d.saturating_duration_since(Instant::now()));
        match self {
            Control::Socket(s) => {
                if poll(s.as_raw_fd(), libc::POLLIN, left(deadline))? == 0 {
                    return Err(timed_out());
                }
                fdpass::recv(s.as_raw_fd(), 4096)
            }
            Control::Serial { port, rest } => loop {
                if let Some(end) = rest.iter().rposition(|b| *b == b'\n') {
                    let tail = rest.split_off(end + 1);
                    return Ok((std::mem::replace(rest, tail), Vec::new()));
                }
                let ev = poll(port.as_raw_fd(), libc::POLLIN, left(deadline))?;
                if ev == 0 {
                    return Err(timed_out());
                }
                if ev & libc::POLLIN == 0 {
                    return Ok((Vec::new(), Vec::new()));
                }
                let mut buf = [0u8; 4096];
                let n = port.read(&mut buf)?;
                if n == 0 {
                    return Ok((Vec::new(), Vec::new()));
                }
                rest.extend_from_slice(&buf[..n]);
            },
        }
    }

    /// Whether Stitch's end has gone (not merely sent a control message). A virtio-serial
    /// port says so with POLLHUP while its QEMU is not connected to Stitch.
    pub fn closed(&self, wait: bool) -> bool {
        let timeout = (!wait).then_some(Duration::ZERO);
        match self {
            Control::Serial { port, .. } => poll(port.as_raw_fd(), libc::POLLIN, timeout)
                .map_or(true, |ev| ev & (libc::POLLHUP | libc::POLLERR) != 0),
            Control::Socket(s) => {
                match poll(s.as_raw_fd(), libc::POLLIN, timeout) {
                    Ok(0) => return false,
                    Ok(_) => {}
                    Err(_) => return true,
                }
                let mut b = 0u8;
                // SAFETY: the kernel writes at most one byte into `b`.
                let n = unsafe {
                    libc::recv(
                        s.as_raw_fd(),
                        &mut b as *mut u8 as *mut libc::c_void,
                        1,
                        libc::MSG_PEEK | libc::MSG_DONTWAIT,
                    )
                };
                n == 0 || (n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock)
            }
        }
    }
}
