//! A virtio-net driver over vhost-user: the front-end's side of the protocol, where a VM's
//! driver or DPDK's virtio-user stands, for testers that measure a back-end from outside it
//! (`stitch bench rfc2544`: Stitch's `vhost_user` port, testpmd's `net_vhost`, Open vSwitch's
//! `dpdkvhostuser` ports).
//!
//! One receive and one transmit queue (the back-end's queues 0 and 1), split rings,
//! `VIRTIO_F_VERSION_1` and nothing else: no offloads and no mergeable buffers, so every frame
//! fits one [`BUFFER`]-byte buffer behind its 12-byte virtio-net header. Rings and buffers live
//! in one memfd the back-end maps (guest physical address = offset in it). The driver asks the
//! back-end not to interrupt it and polls the used rings; it kicks once per batch, and only
//! while the back-end asks for kicks.

use crate::message::{req, HEADER_LEN, VERSION};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::time::{Duration, Instant};
use stitch_core::fdpass;
use stitch_core::mapping::Mapping;

const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// The virtio-net header in front of every frame (`VIRTIO_F_VERSION_1`: 12 bytes).
const NET_HDR_LEN: usize = 12;
/// Bytes of one buffer, header included.
pub const BUFFER: usize = 2048;
/// The longest frame a buffer holds.
pub const MAX_FRAME: usize = BUFFER - NET_HDR_LEN;
const DESC_F_WRITE: u16 = 2;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
const USED_F_NO_NOTIFY: u16 = 1;
const RX: usize = 0;
const TX: usize = 1;

/// Where one queue's rings are in the memory, as offsets.
#[derive(Debug, Clone, Copy)]
struct Rings {
    desc: usize,
    avail: usize,
    used: usize,
}

/// One queue as the driver keeps it.
struct Queue {
    rings: Rings,
    /// The next avail ring entry to fill (free-running).
    next_avail: u16,
    /// The used ring entries consumed so far (free-running).
    seen_used: u16,
    /// Descriptors (= buffers) the driver owns: for TX, those it may fill; unused for RX,
    /// whose buffers are always with the back-end except between `receive`'s read and
    /// its giving them back.
    free: Vec<u16>,
    kick: OwnedFd,
    /// Kept for the back-end, which signals it unless told not to; never read.
    _call: OwnedFd,
}

/// A connected front-end with its two queues running.
pub struct Frontend {
    socket: UnixStream,
    mem: Mapping,
    size: u16,
    queues: [Queue; 2],
    /// Where each queue's buffers start.
    buffers: [usize; 2],
}

fn align(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// The layout for queues of `size` entries: each queue's rings, each queue's buffers, and
/// the whole length.
fn layout(size: u16) -> ([Rings; 2], [usize; 2], usize) {
    let n = size as usize;
    let mut at = 0;
    let mut rings = [Rings {
        desc: 0,
        avail: 0,
        used: 0,
    }; 2];
    for r in &mut rings {
        r.desc = at;
        r.avail = at + 16 * n;
        r.used = align(r.avail + 6 + 2 * n, 4);
        at = align(r.used + 6 + 8 * n, 4096);
    }
    let buffers = [at, at + n * BUFFER];
    (rings, buffers, align(at + 2 * n * BUFFER, 4096))
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd has no memory arguments; a non-negative result is a fresh descriptor.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn u32_u32(a: u32, b: u32) -> Vec<u8> {
    [a.to_le_bytes(), b.to_le_bytes()].concat()
}

impl Frontend {
    /// Connects to a back-end listening on `path` (waiting up to `patience` for it to
    /// appear) and starts queues of `size` entries (a power of two, at most 32768).
    pub fn connect(path: &Path, size: u16, patience: Duration) -> io::Result<Frontend> {
        let started = Instant::now();
        let socket = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if started.elapsed() >= patience => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("no vhost-user back-end on {}: {e}", path.display()),
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        Frontend::start(socket, size)
    }

    /// Takes the first back-end that connects to `listener` (one in client mode, as Open
    /// vSwitch's `dpdkvhostuserclient` ports are) and starts queues of `size` entries.
    pub fn accept(listener: &UnixListener, size: u16) -> io::Result<Frontend> {
        let (socket, _) = listener.accept()?;
        Frontend::start(socket, size)
    }

    fn start(socket: UnixStream, size: u16) -> io::Result<Frontend> {
        if !size.is_power_of_two() || size > 32768 {
            return Err(io::Error::other(format!(
                "queue size {size} is not a power of two up to 32768"
            )));
        }
        let (rings, buffers, len) = layout(size);
        let (memfd, mem) = Mapping::create("stitch-frontend", len)?;
        let queue = |rings| -> io::Result<Queue> {
            Ok(Queue {
                rings,
                next_avail: 0,
                seen_used: 0,
                free: Vec::with_capacity(size as usize),
                kick: eventfd()?,
                _call: eventfd()?,
            })
        };
        let mut f = Frontend {
            socket,
            mem,
            size,
            queues: [queue(rings[RX])?, queue(rings[TX])?],
            buffers,
        };
        f.negotiate(&memfd)?;
        f.post_receive_buffers();
        f.queues[TX].free = (0..size).rev().collect();
        Ok(f)
    }

    /// Sends one request with its payload and descriptors.
    fn request(&self, code: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut msg = Vec::with_capacity(HEADER_LEN + payload.len());
        msg.extend_from_slice(&code.to_le_bytes());
        msg.extend_from_slice(&VERSION.to_le_bytes());
        msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        msg.extend_from_slice(payload);
        fdpass::send(self.socket.as_raw_fd(), &msg, fds)
    }

    /// Sends a request whose reply is a u64 and reads the reply.
    fn ask_u64(&self, code: u32) -> io::Result<u64> {
        self.request(code, &[], &[])?;
        let mut reply = [0u8; HEADER_LEN + 8];
        (&self.socket).read_exact(&mut reply)?;
        let got = u32::from_le_bytes(reply[0..4].try_into().unwrap());
        let size = u32::from_le_bytes(reply[8..12].try_into().unwrap());
        if got != code || size != 8 {
            return Err(io::Error::other(format!(
                "the back-end answered request {code} with request {got}, {size} bytes"
            )));
        }
        Ok(u64::from_le_bytes(reply[12..20].try_into().unwrap()))
    }

    /// The vhost-user set-up, in the order QEMU and DPDK's virtio-user send it.
    fn negotiate(&mut self, memfd: &OwnedFd) -> io::Result<()> {
        self.request(req::SET_OWNER, &[], &[])?;
        let offered = self.ask_u64(req::GET_FEATURES)?;
        if offered & VIRTIO_F_VERSION_1 == 0 {
            return Err(io::Error::other(
                "the back-end does not offer VIRTIO_F_VERSION_1",
            ));
        }
        self.request(req::SET_FEATURES, &VIRTIO_F_VERSION_1.to_le_bytes(), &[])?;
        let base = self.mem.as_ptr() as u64;
        let mut table = u32_u32(1, 0);
        for v in [0, self.mem.len() as u64, base, 0] {
            table.extend_from_slice(&v.to_le_bytes());
        }
        self.request(req::SET_MEM_TABLE, &table, &[memfd.as_raw_fd()])?;
        for q in &self.queues {
            q.rings.init(&self.mem, self.size);
        }
        for (index, q) in self.queues.iter().enumerate() {
            let i = index as u32;
            self.request(req::SET_VRING_NUM, &u32_u32(i, self.size as u32), &[])?;
            let mut addr = u32_u32(i, 0);
            for off in [q.rings.desc, q.rings.used, q.rings.avail] {
                addr.extend_from_slice(&(base + off as u64).to_le_bytes());
            }
            addr.extend_from_slice(&0u64.to_le_bytes());
            self.request(req::SET_VRING_ADDR, &addr, &[])?;
            self.request(req::SET_VRING_BASE, &u32_u32(i, 0), &[])?;
            let which = (i as u64).to_le_bytes();
            self.request(req::SET_VRING_CALL, &which, &[q._call.as_raw_fd()])?;
            self.request(req::SET_VRING_KICK, &which, &[q.kick.as_raw_fd()])?;
        }
        Ok(())
    }

    fn word(&self, off: usize) -> &AtomicU16 {
        assert!(off + 2 <= self.mem.len() && off.is_multiple_of(2));
        // SAFETY: in bounds and 2-aligned (checked above; the mapping is page-aligned);
        // AtomicU16 has u16's layout and any bit pattern is valid; the mapping outlives the
        // borrow. The back-end writes these words concurrently, hence atomics.
        unsafe { &*(self.mem.as_ptr().add(off) as *const AtomicU16) }
    }

    fn buffer(&self, queue: usize, id: u16) -> usize {
        self.buffers[queue] + id as usize * BUFFER
    }

    /// Writes descriptor `id` of `queue`: its buffer, `len` bytes, `flags`.
    fn set_desc(&self, queue: usize, id: u16, len: u32, flags: u16) {
        self.write_desc(queue, id, self.buffer(queue, id) as u64, len, flags);
    }

    /// Writes descriptor `id` of `queue`: `len` bytes at guest address `addr`, `flags`.
    fn write_desc(&self, queue: usize, id: u16, addr: u64, len: u32, flags: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        let at = self.queues[queue].rings.desc + 16 * id as usize;
        assert!(self.mem.write(at, &d), "descriptor inside the rings");
    }

    /// Puts `id` in `queue`'s avail ring (published by [`Frontend::publish`]).
    fn offer(&mut self, queue: usize, id: u16) {
        let q = &self.queues[queue];
        let slot = q.rings.avail + 4 + 2 * (q.next_avail % self.size) as usize;
        self.word(slot).store(id, Ordering::Relaxed);
        self.queues[queue].next_avail = q.next_avail.wrapping_add(1);
    }

    /// Publishes what [`Frontend::offer`] put in the avail ring and kicks if the back-end
    /// wants kicks.
    fn publish(&self, queue: usize) {
        let q = &self.queues[queue];
        fence(Ordering::Release);
        self.word(q.rings.avail + 2)
            .store(q.next_avail, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.word(q.rings.used).load(Ordering::Relaxed) & USED_F_NO_NOTIFY == 0 {
            // Nonblocking: a full counter means a kick is pending already.
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to our own eventfd.
            let _ = unsafe { libc::write(q.kick.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }

    /// Entries the back-end has put in `queue`'s used ring and the driver has not read.
    fn used_ready(&self, queue: usize) -> u16 {
        let q = &self.queues[queue];
        let idx = self.word(q.rings.used + 2).load(Ordering::Acquire);
        idx.wrapping_sub(q.seen_used)
    }

    /// The used ring entry `n` after the last one read: (descriptor id, bytes written).
    fn used_entry(&self, queue: usize, n: u16) -> (u16, u32) {
        let q = &self.queues[queue];
        let at = q.rings.used + 4 + 8 * (q.seen_used.wrapping_add(n) % self.size) as usize;
        let id = self.mem.read_u32(at).expect("used ring inside the mapping");
        let len = self
            .mem
            .read_u32(at + 4)
            .expect("used ring inside the mapping");
        (u32::from_le(id) as u16 % self.size, u32::from_le(len))
    }

    fn post_receive_buffers(&mut self) {
        for id in 0..self.size {
            self.set_desc(RX, id, BUFFER as u32, DESC_F_WRITE);
            self.offer(RX, id);
        }
        self.publish(RX);
    }

    /// Takes back the transmit buffers the back-end is done with; returns how many.
    pub fn reclaim(&mut self) -> usize {
        let n = self.used_ready(TX);
        for i in 0..n {
            let (id, _) = self.used_entry(TX, i);
            self.queues[TX].free.push(id);
        }
        let q = &mut self.queues[TX];
        q.seen_used = q.seen_used.wrapping_add(n);
        n as usize
    }

    /// Sends up to `n` frames, each written by `write` into a buffer of [`MAX_FRAME`] bytes
    /// (it returns the frame's length), as long as transmit buffers are free; returns how
    /// many were sent. One publication (and kick) for the batch.
    pub fn send(&mut self, n: usize, mut write: impl FnMut(&mut [u8]) -> usize) -> usize {
        self.reclaim();
        let mut sent = 0;
        while sent < n {
            let Some(id) = self.queues[TX].free.pop() else {
                break;
            };
            let at = self.buffer(TX, id);
            let buf = self
                .mem
                .bytes_mut(at, BUFFER)
                .expect("buffers inside the mapping");
            buf[..NET_HDR_LEN].fill(0);
            let len = write(&mut buf[NET_HDR_LEN..]).min(MAX_FRAME);
            self.set_desc(TX, id, (NET_HDR_LEN + len) as u32, 0);
            self.offer(TX, id);
            sent += 1;
        }
        if sent > 0 {
            self.publish(TX);
        }
        sent
    }

    /// Hands every frame received so far to `read` (the frame, without the virtio-net
    /// header) and gives the buffers back; returns how many there were.
    pub fn receive(&mut self, mut read: impl FnMut(&[u8])) -> usize {
        let n = self.used_ready(RX);
        for i in 0..n {
            let (id, len) = self.used_entry(RX, i);
            let len = (len as usize).clamp(NET_HDR_LEN, BUFFER);
            let at = self.buffer(RX, id) + NET_HDR_LEN;
            if let Some(frame) = self.mem.bytes(at, len - NET_HDR_LEN) {
                read(frame);
            }
            self.offer(RX, id);
        }
        if n > 0 {
            let q = &mut self.queues[RX];
            q.seen_used = q.seen_used.wrapping_add(n);
            self.publish(RX);
        }
        n as usize
    }

    /// Descriptors per queue: how many receive buffers this driver keeps offered.
    pub fn queue_size(&self) -> u16 {
        self.size
    }

    /// Transmit buffers the back-end still holds.
    pub fn in_flight(&self) -> usize {
        self.size as usize - self.queues[TX].free.len()
    }

    /// Behaves as a broken or hostile driver would, to test a back-end's containment: every
    /// receive descriptor now names a buffer beyond the memory the back-end was given.
    pub fn scribble_on_receive_descriptors(&mut self) {
        for id in 0..self.size {
            self.set_wild_desc(RX, id, DESC_F_WRITE);
        }
    }

    /// Behaves as a broken or hostile driver would: sends one frame whose descriptor names a
    /// buffer beyond the memory the back-end was given; whether a transmit buffer was free.
    pub fn send_wild_descriptor(&mut self) -> bool {
        self.reclaim();
        let Some(id) = self.queues[TX].free.pop() else {
            return false;
        };
        self.set_wild_desc(TX, id, 0);
        self.offer(TX, id);
        self.publish(TX);
        true
    }

    /// Points descriptor `id` of `queue` at a buffer beyond the memory the back-end has.
    fn set_wild_desc(&self, queue: usize, id: u16, flags: u16) {
        let beyond = self.mem.len() as u64 + (1 << 30);
        self.write_desc(queue, id, beyond, BUFFER as u32, flags);
    }
}

impl Rings {
    /// Zeroes the rings and asks the back-end not to interrupt.
    fn init(&self, mem: &Mapping, size: u16) {
        let zeros = vec![0u8; self.used + 6 + 8 * size as usize - self.desc];
        assert!(mem.write(self.desc, &zeros), "rings inside the mapping");
        assert!(mem.write(self.avail, &AVAIL_F_NO_INTERRUPT.to_le_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rings_and_buffers_do_not_overlap() {
        let (rings, buffers, len) = layout(256);
        assert_eq!(rings[0].desc, 0);
        assert!(rings[0].avail >= 16 * 256 && rings[0].used >= rings[0].avail + 6 + 512);
        assert_eq!(rings[0].used % 4, 0);
        assert!(rings[1].desc >= rings[0].used + 6 + 8 * 256);
        assert!(buffers[0] >= rings[1].used + 6 + 8 * 256);
        assert_eq!(buffers[1], buffers[0] + 256 * BUFFER);
        assert!(len >= buffers[1] + 256 * BUFFER);
    }
}
