//! The function's side: attach to a port of a running Stitch, then take packets, look at or
//! change them in place, and give each back forwarded or dropped.
//!
//! ```no_run
//! use stitch_nf::client::{Function, Verdict};
//! let mut f = Function::attach("/run/stitch/nf.sock", "tenant1")?;
//! f.run(|frame: &mut [u8]| if frame.len() < 60 { Verdict::Drop } else { Verdict::Forward })?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! In blocking mode [`Function::run`] sleeps on the port's eventfd when its ring is empty; in
//! polling mode it yields the CPU between empty polls. Either way it returns when Stitch closes
//! the port.

use crate::shm::{Consumer, Desc, Layout, Mapping, Producer, FLAG_DROP};
use serde_json::Value;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use stitch_core::fdpass;

/// What to do with a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Forward,
    Drop,
}

/// An attached function.
pub struct Function {
    conn: UnixStream,
    region: Mapping,
    pool: Option<Mapping>,
    doorbell: OwnedFd,
    layout: Layout,
    to_nf: Consumer,
    from_nf: Producer,
    zero_copy: bool,
    blocking: bool,
    pool_stride: usize,
    pool_header: usize,
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Function {
    /// Connects to `socket` and takes port `port`.
    pub fn attach(socket: impl AsRef<Path>, port: &str) -> io::Result<Function> {
        let socket = socket.as_ref();
        let mut conn = UnixStream::connect(socket).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot reach Stitch's function socket {}: {e}",
                    socket.display()
                ),
            )
        })?;
        let hello = serde_json::json!({ "version": crate::shm::VERSION, "port": port });
        conn.write_all(format!("{hello}\n").as_bytes())?;
        let (bytes, fds) = fdpass::recv(conn.as_raw_fd(), 4096)?;
        let reply: Value = serde_json::from_slice(&bytes)
            .map_err(|e| invalid(format!("bad answer from Stitch: {e}")))?;
        if reply["ok"] != true {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                reply["error"].as_str().unwrap_or("refused").to_string(),
            ));
        }
        let zero_copy = reply["mode"] == "zero_copy";
        let mut fds = fds.into_iter();
        let (Some(memfd), Some(doorbell)) = (fds.next(), fds.next()) else {
            return Err(invalid("Stitch sent no memory"));
        };
        let size = reply["region_size"].as_u64().unwrap_or(0) as usize;
        let region = Mapping::map(memfd.as_raw_fd(), size, size <= crate::shm::POPULATE_MAX)?;
        let h = region.header();
        let layout = Layout::read(h, size)?;
        let pool = if zero_copy {
            let fd = fds.next().ok_or_else(|| invalid("no packet memory"))?;
            Some(Mapping::map(fd.as_raw_fd(), h.pool_bytes as usize, false)?)
        } else {
            None
        };
        let to_nf = Consumer::new(unsafe { region.ring(layout.to_nf, layout.ring_size) });
        let from_nf = Producer::new(unsafe { region.ring(layout.from_nf, layout.ring_size) });
        Ok(Function {
            conn,
            blocking: h.wake == 1,
            pool_stride: h.pool_stride as usize,
            pool_header: h.pool_header as usize,
            region,
            pool,
            doorbell,
            layout,
            to_nf,
            from_nf,
            zero_copy,
        })
    }

    pub fn is_blocking(&self) -> bool {
        self.blocking
    }

    pub fn is_zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// The bytes of one packet, checked to lie inside the shared memory.
    fn frame(&self, d: &Desc) -> Option<&'static mut [u8]> {
        let (base, len, start) = if let Some(pool) = &self.pool {
            let start = d.buffer as usize * self.pool_stride + self.pool_header + d.offset as usize;
            (pool.base, pool.len, start)
        } else {
            let start = self.layout.bufs
                + d.buffer as usize * self.layout.buffer_size as usize
                + d.offset as usize;
            (self.region.base, self.region.len, start)
        };
        let end = start.checked_add(d.len as usize)?;
        (end <= len)
            .then(|| unsafe { std::slice::from_raw_parts_mut(base.add(start), d.len as usize) })
    }

    /// Handles up to `max` waiting packets with `f`; returns how many.
    pub fn poll(
        &mut self,
        max: usize,
        mut f: impl FnMut(&mut [u8]) -> Verdict,
    ) -> io::Result<usize> {
        let avail = self
            .to_nf
            .available()
            .ok_or_else(|| invalid("Stitch's ring index is impossible"))?;
        let room = self
            .from_nf
            .free()
            .ok_or_else(|| invalid("Stitch's ring index is impossible"))?;
        let n = (avail.min(room) as usize).min(max);
        for _ in 0..n {
            let mut d = self.to_nf.take();
            let verdict = match self.frame(&d) {
                Some(bytes) => f(bytes),
                None => Verdict::Drop,
            };
            if verdict == Verdict::Drop {
                d.flags |= FLAG_DROP;
            }
            self.from_nf.put(d);
        }
        if n > 0 {
            self.to_nf.release();
            self.from_nf.publish();
        }
        Ok(n)
    }

    /// Sleeps until Stitch rings the doorbell (blocking mode) — unless packets already wait.
    /// Fails when Stitch closed the port.
    pub fn wait(&mut self) -> io::Result<()> {
        let sleeping = &self.region.header().sleeping.0;
        sleeping.store(1, Ordering::SeqCst);
        if self.to_nf.available().unwrap_or(0) > 0 {
            sleeping.store(0, Ordering::SeqCst);
            return Ok(());
        }
        let mut fds = [
            libc::pollfd {
                fd: self.doorbell.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.conn.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        loop {
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            break;
        }
        if fds[1].revents != 0 {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "Stitch closed the port",
            ));
        }
        let mut v = 0u64;
        unsafe {
            libc::read(
                self.doorbell.as_raw_fd(),
                &mut v as *mut u64 as *mut libc::c_void,
                8,
            )
        };
        sleeping.store(0, Ordering::SeqCst);
        Ok(())
    }

    /// Whether Stitch is still there (cheap: one `poll` with no wait).
    pub fn connected(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self.conn.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        unsafe { libc::poll(&mut fd, 1, 0) == 0 }
    }

    /// Fault injection for tests: puts an arbitrary descriptor on the ring back to Stitch.
    #[doc(hidden)]
    pub fn inject(&mut self, d: Desc) -> bool {
        if self.from_nf.free().unwrap_or(0) == 0 {
            return false;
        }
        self.from_nf.put(d);
        self.from_nf.publish();
        true
    }

    /// Fault injection for tests: the whole shared region, to scribble over.
    #[doc(hidden)]
    pub fn region_bytes(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.region.base, self.region.len) }
    }

    /// Serves packets with `f` until Stitch closes the port.
    pub fn run(&mut self, mut f: impl FnMut(&mut [u8]) -> Verdict) -> io::Result<()> {
        let mut idle = 0u32;
        loop {
            if self.poll(256, &mut f)? > 0 {
                idle = 0;
                continue;
            }
            if self.blocking {
                match self.wait() {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => return Ok(()),
                    Err(e) => return Err(e),
                }
            } else {
                idle += 1;
                if idle.is_multiple_of(1024) && !self.connected() {
                    return Ok(());
                }
                std::thread::yield_now();
            }
        }
    }
}
