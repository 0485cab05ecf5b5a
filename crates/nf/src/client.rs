//! The function's side: attach to a port of a running Stitch, then take packets, look at or
//! change them in place, and give each back forwarded or dropped.
//!
//! ```no_run
//! use stitch_nf::client::{Function, Verdict};
//! let mut f = Function::attach("/run/stitch-fn/stitch.sock", "tenant1")?;
//! f.run(|frame: &mut [u8]| if frame.len() < 60 { Verdict::Drop } else { Verdict::Forward })?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! In blocking mode [`Function::run`] sleeps on the port's eventfd when its ring is empty; in
//! polling mode it yields the CPU between empty polls. Either way it returns when Stitch closes
//! the port.

use crate::connection::Control;
use crate::shm::{
    self, ChannelHeader, Consumer, Desc, Layout, Mapping, Producer, Region, RingView, SteerHeader,
    FLAG_DROP, FLAG_STEERED,
};
use serde_json::Value;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use stitch_core::fdpass;

/// What to do with a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Forward,
    Drop,
}

/// An attached function.
pub struct Function {
    /// Where the port was asked for, to ask again (`reattach`).
    socket: PathBuf,
    port: String,
    conn: Control,
    region: Mapping,
    pool: Option<Mapping>,
    /// None in a guest: Stitch cannot ring it there, the function polls.
    doorbell: Option<OwnedFd>,
    layout: Layout,
    to_nf: Consumer,
    from_nf: Producer,
    zero_copy: bool,
    blocking: bool,
    pool_stride: usize,
    pool_header: usize,
    /// Control messages taken from the connection (compared with the region's `control`).
    control_seen: u32,
    /// Direct channels (the inter-VNF bypass, docs/references.md): forwarded packets go straight to
    /// the next function, and packets come straight from the previous one.
    tx: Option<TxChannel>,
    rx: Option<RxChannel>,
    /// An interface's receive rings this function reads itself (the flow-director steering of
    /// fine-grained NFs, docs/references.md).
    steered: Option<SteeredInput>,
}

/// Receive rings of an interface's AF_XDP sockets, read from this function's own index: it
/// writes nothing in them, and gives each frame back on `from_nf` in ring order.
struct SteeredInput {
    header: Mapping,
    queues: Vec<SteeredQueue>,
}

struct SteeredQueue {
    /// Polled (POLLIN) by a blocking function, beside its doorbell.
    socket: OwnedFd,
    rx: stitch_xsk::Ring,
    umem: Mapping,
}

impl SteeredInput {
    fn header(&self) -> &SteerHeader {
        self.header.steer_header().expect("checked when mapped")
    }

    /// Frames waiting in queue `q`'s ring; `None` when the kernel's index is impossible.
    fn waiting(&self, q: usize) -> Option<u32> {
        let r = &self.queues[q].rx;
        let n = r.ready();
        (n <= r.size()).then_some(n)
    }

    /// Maps what Stitch sent: the header page, then each queue's socket and UMEM.
    fn map(msg: &Value, fds: &mut impl Iterator<Item = OwnedFd>) -> io::Result<SteeredInput> {
        let page = fds
            .next()
            .ok_or_else(|| invalid("steered input without its page"))?;
        let header = shm::map_steer_page(page.as_fd())?;
        let mut queues = Vec::new();
        for q in msg["queues"].as_array().into_iter().flatten() {
            let (Some(socket), Some(umem)) = (fds.next(), fds.next()) else {
                return Err(invalid("steered input without its sockets"));
            };
            let field = |k: &str| {
                q[k].as_u64()
                    .ok_or_else(|| invalid(format!("steered input without its `{k}`")))
            };
            let ring_size = u32::try_from(field("ring_size")?)
                .map_err(|_| invalid("steered ring too large"))?;
            let mut rx = stitch_xsk::Ring::map_rx(socket.as_fd(), ring_size).map_err(invalid)?;
            rx.seek(field("start")? as u32);
            let umem = shm::map(umem.as_fd(), field("umem_len")? as usize, false)?;
            queues.push(SteeredQueue { socket, rx, umem });
        }
        Ok(SteeredInput { header, queues })
    }
}

struct TxChannel {
    map: Mapping,
    ring: Producer,
    /// The receiving function's doorbell, rung when it sleeps (none in a guest: the receiver
    /// polls).
    peer_doorbell: Option<OwnedFd>,
}

struct RxChannel {
    map: Mapping,
    ring: RingView,
    /// Set once Stitch handed the channel over.
    reading: Option<Consumer>,
}

impl TxChannel {
    fn header(&self) -> &ChannelHeader {
        self.map
            .channel_header()
            .expect("checked by map_named_channel")
    }
}

impl RxChannel {
    fn header(&self) -> &ChannelHeader {
        self.map
            .channel_header()
            .expect("checked by map_named_channel")
    }
}

/// Maps the direct channel a message names: a memfd whatever its size (read from the file),
/// or in a guest the device Stitch plugged (`pci`, `bytes`).
fn map_named_channel(
    msg: &Value,
    fds: &mut impl Iterator<Item = OwnedFd>,
) -> io::Result<(Mapping, RingView)> {
    let map = match msg["pci"].as_str() {
        Some(pci) => {
            let bytes = channel_size(msg["bytes"].as_u64().unwrap_or(0) as usize)?;
            crate::guest::map_bar(pci, bytes, GUEST_WAIT)?
        }
        None => {
            let memfd = fds
                .next()
                .ok_or_else(|| invalid("direct channel without its memory"))?;
            let bytes = channel_size(shm::file_size(memfd.as_fd())?)?;
            shm::map(memfd.as_fd(), bytes, true)?
        }
    };
    // SAFETY: the view is returned with the mapping, and every holder keeps both together (a
    // TxChannel or RxChannel).
    let (_, ring) = unsafe { map.channel()? };
    Ok((map, ring))
}

/// `bytes`, if a direct channel can be that large.
fn channel_size(bytes: usize) -> io::Result<usize> {
    if !(crate::shm::CHANNEL_RING..=64 << 20).contains(&bytes) {
        return Err(invalid("direct channel of an impossible size"));
    }
    Ok(bytes)
}

/// The socket and port Stitch gave a process it started, if it did — or, in a VM whose
/// port Stitch serves (`rings: ivshmem`), the virtio-serial port to Stitch and the port's name.
pub fn env_port() -> Option<(std::path::PathBuf, String)> {
    let from_env = || {
        let socket = std::env::var_os(crate::function::ENV_SOCKET)?;
        let port = std::env::var(crate::function::ENV_PORT).ok()?;
        Some((socket.into(), port))
    };
    from_env().or_else(crate::guest::serial_port)
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// How long a function in a guest waits for Stitch: for its QEMU to be connected, for the
/// answer (QEMU hot-plugs the devices first), for the guest's kernel to show the devices.
const GUEST_WAIT: Duration = Duration::from_secs(30);

/// The memory an attachment gave: the region (`size` bytes of it are Stitch's), the packet
/// memory in zero-copy mode, the doorbell (not in a guest).
struct Memory {
    region: Mapping,
    size: usize,
    pool: Option<Mapping>,
    doorbell: Option<OwnedFd>,
}

/// The hello that asks for `port`: by a process that lost `lost` packets with a Stitch that
/// ended, if it did; over `transport` (a guest's), if not the socket.
fn hello(port: &str, lost: Option<u64>, transport: Option<&str>) -> Value {
    let mut hello = serde_json::json!({ "version": crate::shm::VERSION, "port": port });
    if let Some(lost) = lost {
        hello["resumed"] = serde_json::json!({ "lost": lost });
    }
    if let Some(t) = transport {
        hello["transport"] = t.into();
    }
    hello
}

/// Stitch's answer to a hello, when it is a yes.
fn accepted(bytes: &[u8]) -> io::Result<Value> {
    let reply: Value = serde_json::from_slice(bytes)
        .map_err(|e| invalid(format!("bad answer from Stitch: {e}")))?;
    if reply["ok"] != true {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            reply["error"].as_str().unwrap_or("refused").to_string(),
        ));
    }
    Ok(reply)
}

/// Whether `path` is a character device (a guest's virtio-serial port), not a socket.
fn is_char_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device())
}

impl Function {
    /// Attaches to the port Stitch named when it started this process (`placement: process`):
    /// the socket and port in `STITCH_NF_SOCKET` and `STITCH_NF_PORT`.
    pub fn attach_from_env() -> io::Result<Function> {
        let (socket, port) = env_port().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{} and {} are not set: name the port (and --socket), or let Stitch start \
                     this function (placement: process)",
                    crate::function::ENV_SOCKET,
                    crate::function::ENV_PORT
                ),
            )
        })?;
        Function::attach(socket, &port)
    }

    /// Connects to `socket` and takes port `port`.
    pub fn attach(socket: impl AsRef<Path>, port: &str) -> io::Result<Function> {
        Function::attach_again(socket.as_ref(), port, None)
    }

    /// [`Function::attach`]; `lost`: this process attached before, to a Stitch process that
    /// ended, and lost that many packets with it (they were in the old rings).
    fn attach_again(socket: &Path, port: &str, lost: Option<u64>) -> io::Result<Function> {
        if is_char_device(socket) {
            return Function::attach_in_guest(socket, port, Control::serial(socket)?, lost);
        }
        let mut conn = UnixStream::connect(socket).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot reach Stitch's function socket {}: {e}",
                    socket.display()
                ),
            )
        })?;
        conn.write_all(format!("{}\n", hello(port, lost, None)).as_bytes())?;
        let (bytes, fds) = fdpass::recv(conn.as_raw_fd(), 4096)?;
        let reply = accepted(&bytes)?;
        let zero_copy = reply["mode"] == "zero_copy";
        let mut fds = fds.into_iter();
        let (Some(memfd), Some(doorbell)) = (fds.next(), fds.next()) else {
            return Err(invalid("Stitch sent no memory"));
        };
        let size = reply["region_size"].as_u64().unwrap_or(0) as usize;
        let region = shm::map(memfd.as_fd(), size, size <= crate::shm::POPULATE_MAX)?;
        let pool = if zero_copy {
            let fd = fds.next().ok_or_else(|| invalid("no packet memory"))?;
            let bytes = region
                .header()
                .ok_or_else(|| invalid("region smaller than its header"))?
                .pool_bytes;
            Some(shm::map(fd.as_fd(), bytes as usize, false)?)
        } else {
            None
        };
        if reply["output"] == true {
            take_output(&mut fds)?;
        }
        let memory = Memory {
            region,
            size,
            pool,
            doorbell: Some(doorbell),
        };
        Function::on(socket, port, Control::Socket(conn), memory)
    }

    /// Attaches through `device`, the virtio-serial port QEMU joins to Stitch's socket: the
    /// region (and the packet memory) come as hot-plugged ivshmem devices, mapped from sysfs.
    fn attach_in_guest(
        device: &Path,
        port: &str,
        mut conn: Control,
        lost: Option<u64>,
    ) -> io::Result<Function> {
        conn.wait_for_host(GUEST_WAIT)?;
        let hello = hello(port, lost, Some(crate::guest::TRANSPORT));
        conn.send_line(&hello.to_string())?;
        let (bytes, _) = conn.recv(Some(GUEST_WAIT))?;
        let reply = accepted(&bytes)?;
        let plugged = |what: &str| -> io::Result<Mapping> {
            let d = &reply["devices"][what];
            let (Some(addr), Some(bytes)) = (d["pci"].as_str(), d["bytes"].as_u64()) else {
                return Err(invalid(format!("Stitch named no {what} device")));
            };
            crate::guest::map_bar(addr, bytes as usize, GUEST_WAIT)
        };
        let region = plugged("region")?;
        let size = region.len();
        let pool = if reply["mode"] == "zero_copy" {
            Some(plugged("pool")?)
        } else {
            None
        };
        let memory = Memory {
            region,
            size,
            pool,
            doorbell: None,
        };
        Function::on(device, port, conn, memory)
    }

    /// The function on memory Stitch gave it, its layout read from the region's header.
    fn on(socket: &Path, port: &str, conn: Control, m: Memory) -> io::Result<Function> {
        let region = m.region;
        let h = region
            .header()
            .ok_or_else(|| invalid("region smaller than its header"))?;
        let layout = Layout::read(h, m.size)?;
        let zero_copy = h.mode == 0;
        if zero_copy != m.pool.is_some() {
            return Err(invalid(
                "Stitch's answer and its region disagree on the mode",
            ));
        }
        let ring = |offset| {
            // SAFETY: the views live in `Function` beside `region`, which outlives them.
            unsafe { region.ring(offset, layout.ring_size) }
                .ok_or_else(|| invalid("ring outside the region"))
        };
        let to_nf = Consumer::new(ring(layout.to_nf)?);
        let from_nf = Producer::new(ring(layout.from_nf)?);
        Ok(Function {
            socket: socket.to_path_buf(),
            port: port.to_string(),
            conn,
            blocking: h.wake == 1,
            pool_stride: h.pool_stride as usize,
            pool_header: h.pool_header as usize,
            region,
            pool: m.pool,
            doorbell: m.doorbell,
            layout,
            to_nf,
            from_nf,
            zero_copy,
            control_seen: 0,
            tx: None,
            rx: None,
            steered: None,
        })
    }

    /// Takes the control messages Stitch sent (a direct channel to use): one load when there
    /// are none.
    fn check_control(&mut self) -> io::Result<()> {
        let sent = self.region_header().control.0.load(Ordering::Acquire);
        while self.control_seen != sent {
            let (bytes, fds) = self.conn.recv(None)?;
            if bytes.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "Stitch closed the port",
                ));
            }
            let mut fds = fds.into_iter();
            for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                let msg: Value = serde_json::from_slice(line)
                    .map_err(|e| invalid(format!("bad control message from Stitch: {e}")))?;
                if msg["ok"] == false {
                    // An answer to something this process sent after its hello (a guest's
                    // port carries both ways): not a control message.
                    eprintln!("Stitch: {}", msg["error"].as_str().unwrap_or("refused"));
                    continue;
                }
                self.control_seen = self.control_seen.wrapping_add(1);
                if let Some(pool) = msg.get("pool") {
                    // A memfd from a process; in a guest, a device named by `pci`.
                    self.use_pool(pool, fds.next())?;
                    continue;
                }
                if let Some(steer) = msg.get("steer") {
                    let input = SteeredInput::map(steer, &mut fds)?;
                    input.header().reader.0.store(1, Ordering::Release);
                    self.steered = Some(input);
                    continue;
                }
                match msg["direct"].as_str() {
                    Some("send") => {
                        let channel = map_named_channel(&msg, &mut fds)?;
                        // The receiver's doorbell follows the memfd (none into a guest).
                        self.use_tx_channel(channel, fds.next())?;
                    }
                    Some("receive") => {
                        let (map, ring) = map_named_channel(&msg, &mut fds)?;
                        let rx = RxChannel {
                            map,
                            ring,
                            reading: None,
                        };
                        rx.header().receiver.0.store(1, Ordering::Release);
                        self.rx = Some(rx);
                    }
                    _ => {}
                }
            }
            // Only when something came: a poll writes nothing Stitch reads.
            (self.region_header().control_taken.0).store(self.control_seen, Ordering::Release);
        }
        Ok(())
    }

    /// Maps the packet memory of the Stitch process that took this port over (`stitch
    /// upgrade`): every descriptor from now on names one of its buffers. The old process
    /// had all its buffers back before it handed over.
    fn use_pool(&mut self, pool: &Value, memfd: Option<OwnedFd>) -> io::Result<()> {
        if !self.zero_copy {
            return Err(invalid("packet memory sent to an isolated port"));
        }
        let field = |k: &str| {
            pool[k]
                .as_u64()
                .ok_or_else(|| invalid(format!("packet memory without its `{k}`")))
        };
        let bytes = field("bytes")? as usize;
        self.pool = Some(match (pool["pci"].as_str(), memfd) {
            (Some(pci), _) => crate::guest::map_bar(pci, bytes, GUEST_WAIT)?,
            (None, Some(memfd)) => shm::map(memfd.as_fd(), bytes, false)?,
            (None, None) => return Err(invalid("no packet memory")),
        });
        self.pool_stride = field("stride")? as usize;
        self.pool_header = field("header")? as usize;
        Ok(())
    }

    fn use_tx_channel(
        &mut self,
        (map, ring): (Mapping, RingView),
        peer_doorbell: Option<OwnedFd>,
    ) -> io::Result<()> {
        let h = map.channel_header().expect("checked by map_named_channel");
        if h.end.0.load(Ordering::Acquire) != 0 {
            h.sender.0.store(2, Ordering::Release);
            return Ok(());
        }
        // SAFETY: `h.released` is in the channel mapping, which the TxChannel built below keeps
        // beside the producer.
        let ring = unsafe { Producer::gated(ring, &h.released.0) };
        // Everything forwarded so far is published on `from_nf` (each poll ends so): from now
        // on forwarded packets go to the channel.
        h.sender.0.store(1, Ordering::Release);
        self.tx = Some(TxChannel {
            map,
            ring,
            peer_doorbell,
        });
        Ok(())
    }

    /// Follows Stitch's word on the channels: hand-over to this function, or the end.
    /// Returns whether the incoming channel may be read.
    fn channel_states(&mut self) -> bool {
        if let Some(tx) = &self.tx {
            if tx.header().end.0.load(Ordering::Acquire) != 0 {
                tx.ring.publish();
                tx.header().sender.0.store(2, Ordering::Release);
                self.tx = None;
            }
        }
        let Some(rx) = &mut self.rx else {
            return false;
        };
        let h = rx
            .map
            .channel_header()
            .expect("checked by map_named_channel");
        if h.end.0.load(Ordering::Acquire) != 0 {
            if let Some(c) = &rx.reading {
                c.release();
            }
            h.receiver.0.store(2, Ordering::Release);
            self.rx = None;
            return false;
        }
        if rx.reading.is_none() && h.reader.0.load(Ordering::Acquire) == 1 {
            rx.reading = Some(Consumer::resuming(rx.ring));
        }
        rx.reading.is_some()
    }

    /// The region's header (checked at attach).
    fn region_header(&self) -> &crate::shm::RegionHeader {
        self.region.header().expect("checked at attach")
    }

    pub fn is_blocking(&self) -> bool {
        self.blocking
    }

    pub fn is_zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// The bytes of one packet, checked to lie inside the shared memory.
    fn frame(&mut self, d: &Desc) -> Option<&mut [u8]> {
        let (map, start) = if let Some(pool) = &mut self.pool {
            let at = (d.buffer as usize).checked_mul(self.pool_stride)?;
            (pool, at.checked_add(self.pool_header + d.offset as usize)?)
        } else {
            let at = (d.buffer as usize).checked_mul(self.layout.buffer_size as usize)?;
            let at = at.checked_add(self.layout.bufs + d.offset as usize)?;
            (&mut self.region, at)
        };
        map.bytes_mut(start, d.len as usize)
    }

    /// Handles up to `max` waiting packets with `f`; returns how many.
    pub fn poll(
        &mut self,
        max: usize,
        mut f: impl FnMut(&mut [u8]) -> Verdict,
    ) -> io::Result<usize> {
        self.check_control()?;
        // The channel's state before the ring's head: packets Stitch queued before it handed
        // the channel over are then visible below.
        let channel = self.channel_states();
        let avail = self
            .to_nf
            .available()
            .ok_or_else(|| invalid("Stitch's ring index is impossible"))?;
        // A control message sent before these descriptors were published (new packet memory)
        // is visible now that the head was read: it is taken before they are.
        if avail > 0 && self.region_header().control.0.load(Ordering::Acquire) != self.control_seen
        {
            self.check_control()?;
        }
        let steered = self.steered_state();
        let mut done = self.serve(false, (avail as usize).min(max), &mut f)?;
        let mut caught_up = done == avail as usize;
        // The channel only once this function's own ring was read empty: what came through
        // Stitch before the hand-over comes first.
        if channel && caught_up && done < max {
            let rx = self
                .rx
                .as_mut()
                .and_then(|r| r.reading.as_mut())
                .expect("reading");
            let more = rx
                .available()
                .ok_or_else(|| invalid("the sending function's ring index is impossible"))?;
            let n = (more as usize).min(max - done);
            let served = self.serve(true, n, &mut f)?;
            caught_up = served == more as usize;
            done += served;
        }
        // The interface's rings likewise: what Stitch read from them before it handed them
        // over is in this function's ring.
        if steered && caught_up && done < max {
            done += self.serve_steered(max - done, &mut f)?;
        }
        Ok(done)
    }

    /// Follows Stitch's word on the steered input: once it wants the rings back, stops
    /// reading them (all that was read is published on `from_nf`: each serve ends so).
    /// Returns whether they may be read.
    fn steered_state(&mut self) -> bool {
        let Some(s) = &self.steered else {
            return false;
        };
        if s.header().end.0.load(Ordering::Acquire) == 0 {
            return true;
        }
        s.header().reader.0.store(2, Ordering::Release);
        self.steered = None;
        false
    }

    /// Serves up to `max` frames from the interface's rings, each given back on `from_nf` in
    /// ring order (Stitch moves the rings on once it has them).
    fn serve_steered(
        &mut self,
        max: usize,
        f: &mut impl FnMut(&mut [u8]) -> Verdict,
    ) -> io::Result<usize> {
        let Some(input) = self.steered.as_mut() else {
            return Ok(0);
        };
        let mut done = 0;
        for q in 0..input.queues.len() {
            let waiting = input
                .waiting(q)
                .ok_or_else(|| invalid("the interface's ring index is impossible"))?;
            let room = self
                .from_nf
                .free()
                .ok_or_else(|| invalid("Stitch's ring index is impossible"))?;
            let n = (waiting as usize).min(room as usize).min(max - done);
            let queue = &mut input.queues[q];
            for _ in 0..n {
                let i = queue.rx.position();
                let (addr, len) = queue.rx.desc(0);
                let frame = usize::try_from(addr)
                    .ok()
                    .and_then(|at| queue.umem.bytes_mut(at, len as usize));
                let verdict = frame.map_or(Verdict::Drop, &mut *f);
                let drop = if verdict == Verdict::Drop {
                    FLAG_DROP
                } else {
                    0
                };
                self.from_nf.put(Desc {
                    buffer: i,
                    offset: q as u16,
                    flags: FLAG_STEERED | drop,
                    len,
                    stamp_lo: 0,
                });
                queue.rx.read_past(1);
            }
            done += n;
        }
        if done > 0 {
            self.from_nf.publish();
        }
        Ok(done)
    }

    /// Serves `n` descriptors from this function's ring or the incoming channel.
    fn serve(
        &mut self,
        from_channel: bool,
        n: usize,
        f: &mut impl FnMut(&mut [u8]) -> Verdict,
    ) -> io::Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        let mut room = self
            .from_nf
            .free()
            .ok_or_else(|| invalid("Stitch's ring index is impossible"))?;
        if let Some(tx) = &mut self.tx {
            room = room.min(
                tx.ring
                    .free()
                    .ok_or_else(|| invalid("Stitch's channel index is impossible"))?,
            );
        }
        let n = n.min(room as usize);
        if n == 0 {
            return Ok(0);
        }
        let mut forwarded = 0;
        for _ in 0..n {
            let mut d = if from_channel {
                self.rx
                    .as_mut()
                    .and_then(|r| r.reading.as_mut())
                    .expect("reading")
                    .take()
            } else {
                self.to_nf.take()
            };
            let verdict = match self.frame(&d) {
                Some(bytes) => f(bytes),
                None => Verdict::Drop,
            };
            match (verdict, &mut self.tx) {
                (Verdict::Forward, Some(tx)) => {
                    d.flags = 0;
                    tx.ring.put(d);
                    forwarded += 1;
                }
                (Verdict::Forward, None) => self.from_nf.put(d),
                (Verdict::Drop, _) => {
                    d.flags |= FLAG_DROP;
                    self.from_nf.put(d);
                }
            }
        }
        // What was read is released before anything is returned through `from_nf`: Stitch
        // accounts the channel first.
        if from_channel {
            self.rx
                .as_ref()
                .and_then(|r| r.reading.as_ref())
                .expect("reading")
                .release();
        } else {
            self.to_nf.release();
        }
        self.from_nf.publish();
        if let Some(tx) = &self.tx {
            if forwarded > 0 {
                tx.ring.publish();
                let sleeping = &tx.header().receiver_sleeping.0;
                std::sync::atomic::fence(Ordering::SeqCst);
                if sleeping.load(Ordering::SeqCst) == 1
                    && sleeping
                        .compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                {
                    if let Some(bell) = &tx.peer_doorbell {
                        crate::direct::ring_doorbell(bell);
                    }
                }
            }
        }
        Ok(n)
    }

    /// Whether anything waits: this function's ring, a handed-over channel, a control message.
    fn has_work(&mut self) -> bool {
        if self.to_nf.available().unwrap_or(0) > 0
            || self.region_header().control.0.load(Ordering::Acquire) != self.control_seen
        {
            return true;
        }
        if let Some(s) = &self.steered {
            if s.header().end.0.load(Ordering::Acquire) != 0
                || (0..s.queues.len()).any(|q| s.waiting(q) != Some(0))
            {
                return true;
            }
        }
        let Some(rx) = &self.rx else { return false };
        let h = rx.header();
        if h.end.0.load(Ordering::Acquire) != 0 {
            return true;
        }
        match &rx.reading {
            Some(c) => c.available().unwrap_or(0) > 0,
            None => h.reader.0.load(Ordering::Acquire) == 1,
        }
    }

    /// Whether the connection has ended (not merely carries a control message).
    fn closed(&self, wait: bool) -> bool {
        self.conn.closed(wait)
    }

    /// Sleeps until Stitch (or the function sending on a direct channel) rings the doorbell —
    /// unless packets already wait. Fails when Stitch closed the port.
    pub fn wait(&mut self) -> io::Result<()> {
        match wait_any(&mut [self], &mut Vec::new())? {
            Some(_) => Err(closed_port()),
            None => Ok(()),
        }
    }

    /// Says (or stops saying) in the shared headers that this function sleeps on its doorbell.
    /// Plain stores: before sleeping the caller fences once for all its ports (then looks at
    /// the rings again); a stale "asleep" seen by Stitch only costs a spare doorbell.
    fn set_sleeping(&self, asleep: bool) {
        let v = asleep as u32;
        self.region_header().sleeping.0.store(v, Ordering::Relaxed);
        if let Some(rx) = &self.rx {
            rx.header().receiver_sleeping.0.store(v, Ordering::Relaxed);
        }
    }

    /// Whether this function runs in a VM, on rings plugged into it ([`crate::guest`]).
    pub fn in_guest(&self) -> bool {
        matches!(self.conn, Control::Serial { .. })
    }

    /// Whether Stitch is still there (cheap: one `poll` with no wait).
    pub fn connected(&self) -> bool {
        !self.closed(false)
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
        let len = self.region.len();
        self.region.bytes_mut(0, len).expect("the whole region")
    }

    /// Serves packets with `f` until Stitch closes the port.
    pub fn run(&mut self, f: impl FnMut(&mut [u8]) -> Verdict) -> io::Result<()> {
        serve_ports(vec![self], f)
    }
}

impl Function {
    /// Asks for the port again after the Stitch process serving it ended (killed, or
    /// crashed), for as long as the Stitch that started this process allows
    /// ([`crate::function::ENV_REATTACH`]): the Stitch started in its place adopts this process
    /// and serves the port again. What was in the old rings is lost, and told to the new
    /// Stitch. False when not allowed, or when no Stitch served the port in time.
    pub fn reattach(&mut self) -> bool {
        let in_guest = self.in_guest();
        // In a guest, always: its QEMU connects to the next Stitch by itself.
        let Some(window) = reattach_window().or(in_guest.then_some(GUEST_WAIT)) else {
            return false;
        };
        let lost =
            u64::from(self.to_nf.available().unwrap_or(0)) + u64::from(self.from_nf.pending());
        // The interface's sockets and memory go with the Stitch that lent them: a queue
        // stays bound while any socket on it is open, and the next Stitch binds it afresh.
        self.steered = None;
        let deadline = Instant::now() + window;
        while Instant::now() < deadline {
            let again = if in_guest {
                // The same open port: a virtio-serial port takes one opener at a time.
                (self.conn.try_clone()).and_then(|conn| {
                    Function::attach_in_guest(&self.socket, &self.port, conn, Some(lost))
                })
            } else {
                Function::attach_again(&self.socket, &self.port, Some(lost))
            };
            match again {
                Ok(again) => {
                    *self = again;
                    return true;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        false
    }
}

/// How long a function started by Stitch waits for its port to be served again.
fn reattach_window() -> Option<Duration> {
    let seconds: f64 = std::env::var(crate::function::ENV_REATTACH)
        .ok()?
        .parse()
        .ok()?;
    (seconds > 0.0).then(|| Duration::from_secs_f64(seconds.min(3600.0)))
}

/// Makes the two descriptors after the region's this process's standard output and error
/// (the Stitch that adopted it reads them from now on; the old one's pipes died with it).
fn take_output(fds: &mut impl Iterator<Item = OwnedFd>) -> io::Result<()> {
    let (Some(out), Some(err)) = (fds.next(), fds.next()) else {
        return Err(invalid("Stitch said it sends output pipes and sent none"));
    };
    for (fd, to) in [(out, 1), (err, 2)] {
        // SAFETY: dup2 onto the standard descriptors, which this process keeps open.
        if unsafe { libc::dup2(fd.as_raw_fd(), to) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn closed_port() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "Stitch closed the port")
}

/// Serves several ports from one thread until Stitch closed them all, as one process with one
/// doorbell would (the functions of fine-grained NFs, docs/references.md): a wake-up for one port
/// serves whatever waits on all of them, so a function with two ports is scheduled up to half as
/// often as with a thread per port. A port Stitch closes is left out from then on; an error on any
/// port ends the call.
pub fn run_all(functions: &mut [Function], f: impl FnMut(&mut [u8]) -> Verdict) -> io::Result<()> {
    serve_ports(functions.iter_mut().collect(), f)
}

/// Serves the ports until Stitch closed each of them.
fn serve_ports(
    mut functions: Vec<&mut Function>,
    mut f: impl FnMut(&mut [u8]) -> Verdict,
) -> io::Result<()> {
    let mut idle = 0u32;
    // The poll set of `wait_any`, kept between sleeps (no allocation per wake-up).
    let mut fds = Vec::new();
    while !functions.is_empty() {
        let mut done = 0;
        for fun in functions.iter_mut() {
            done += fun.poll(256, &mut f)?;
        }
        if done > 0 {
            idle = 0;
            continue;
        }
        if functions.iter().all(|fun| fun.blocking) {
            if functions.iter_mut().any(|fun| fun.has_work()) {
                // Work waits but its output is full: give the core to the functions
                // downstream for a moment instead of spinning on it — and look now and then
                // whether Stitch is still there to empty it.
                std::thread::sleep(std::time::Duration::from_micros(20));
                idle += 1;
                if idle.is_multiple_of(256) {
                    functions.retain_mut(|fun| fun.connected() || fun.reattach());
                }
                continue;
            }
            if let Some(i) = wait_any(&mut functions, &mut fds)? {
                if !functions[i].reattach() {
                    functions.swap_remove(i);
                }
            }
        } else {
            idle += 1;
            if idle.is_multiple_of(1024) {
                functions.retain_mut(|fun| fun.connected() || fun.reattach());
            }
            // In a guest nothing can wake the function, and a vCPU spinning on an empty ring
            // takes a host core: after a while idle it naps, 1 µs growing to 100 µs (as
            // Stitch's own workers do).
            let nap = u64::from(idle / 256).min(100);
            if nap > 0 && functions.iter().all(|fun| fun.in_guest()) {
                std::thread::sleep(Duration::from_micros(nap));
            } else {
                std::thread::yield_now();
            }
        }
    }
    Ok(())
}

/// Sleeps until one of the functions' doorbells rings (Stitch, or a function sending on a
/// direct channel) — unless packets already wait. Returns a port that Stitch closed, if one
/// did. `fds` is scratch space for the poll set.
fn wait_any(
    functions: &mut [&mut Function],
    fds: &mut Vec<libc::pollfd>,
) -> io::Result<Option<usize>> {
    for fun in functions.iter() {
        fun.set_sleeping(true);
    }
    std::sync::atomic::fence(Ordering::SeqCst);
    let awake = |functions: &[&mut Function]| {
        for fun in functions {
            fun.set_sleeping(false);
        }
    };
    if functions.iter_mut().any(|fun| fun.has_work()) {
        awake(functions);
        return Ok(None);
    }
    // Per port: its doorbell, then its connection (readable for a control message, or when
    // Stitch is gone).
    fds.clear();
    // After them, the sockets of steered inputs (readable while their ring holds frames).
    let pollin = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    fds.extend(
        functions
            .iter()
            .flat_map(|fun| {
                [
                    fun.doorbell.as_ref().map_or(-1, |d| d.as_raw_fd()),
                    fun.conn.as_raw_fd(),
                ]
            })
            .map(pollin),
    );
    let sockets = fds.len();
    fds.extend(
        (functions.iter())
            .filter_map(|fun| fun.steered.as_ref())
            .flat_map(|s| s.queues.iter().map(|q| q.socket.as_raw_fd()))
            .map(pollin),
    );
    loop {
        // SAFETY: `fds` is a live array of fds.len() pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break;
    }
    awake(functions);
    if fds[..sockets].iter().all(|p| p.revents == 0) {
        // Only a steered ring: it stays readable for the kernel until Stitch has moved its
        // consumer past the frames this function gave back, which takes a breath.
        std::thread::sleep(Duration::from_micros(20));
    }
    let mut gone = None;
    for (i, fun) in functions.iter().enumerate() {
        if let (true, Some(doorbell)) = (fds[2 * i].revents != 0, &fun.doorbell) {
            let mut v = 0u64;
            // SAFETY: the kernel writes at most 8 bytes into `v`, a u64.
            unsafe {
                libc::read(
                    doorbell.as_raw_fd(),
                    &mut v as *mut u64 as *mut libc::c_void,
                    8,
                )
            };
        }
        if fds[2 * i + 1].revents != 0 && fun.closed(false) {
            gone = Some(i);
        }
    }
    Ok(gone)
}
