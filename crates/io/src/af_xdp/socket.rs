//! The sockets: an AF_XDP socket per queue with its UMEM (half the frames for receiving, half
//! for sending) and four rings, bound zero-copy or in copy mode, and the steering sockets that
//! share its UMEM; the XDP program that sends each queue to its socket.

use super::ZeroCopy;
use crate::netdev::{explain, setsockopt};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};
use stitch_core::mapping::Mapping;
use stitch_xsk::ring::{self, Ring, RingKind};

const AF_XDP: i32 = libc::AF_XDP;
const SOL_XDP: i32 = libc::SOL_XDP;
pub(super) const XDP_STATISTICS: i32 = libc::XDP_STATISTICS;
const XDP_SHARED_UMEM: u16 = libc::XDP_SHARED_UMEM;
const XDP_COPY: u16 = libc::XDP_COPY;
const XDP_ZEROCOPY: u16 = libc::XDP_ZEROCOPY;
const XDP_USE_NEED_WAKEUP: u16 = libc::XDP_USE_NEED_WAKEUP;
/// The UMEM's chunk: one frame each, at most a page.
pub(super) const FRAME_SIZE: u32 = 4096;

#[repr(C)]
struct UmemReg {
    addr: u64,
    len: u64,
    chunk_size: u32,
    headroom: u32,
    flags: u32,
    tx_metadata_len: u32,
}

#[repr(C)]
struct SockaddrXdp {
    family: u16,
    flags: u16,
    ifindex: u32,
    queue_id: u32,
    shared_umem_fd: u32,
}

#[repr(C)]
#[derive(Default)]
pub(super) struct XdpStatistics {
    pub rx_dropped: u64,
    rx_invalid_descs: u64,
    tx_invalid_descs: u64,
    pub rx_ring_full: u64,
    rx_fill_ring_empty_descs: u64,
    tx_ring_empty_descs: u64,
}

/// One AF_XDP socket with its own UMEM.
pub(super) struct Xsk {
    pub(super) fd: OwnedFd,
    pub(super) queue: u32,
    /// The frames the kernel receives into and sends from.
    pub(super) umem: Mapping,
    /// The UMEM's file, to lend at an upgrade.
    pub(super) umem_fd: OwnedFd,
    pub(super) frames: u32,
    pub(super) ring_size: u32,
    pub(super) fill: Ring,
    pub(super) comp: Ring,
    pub(super) rx: Ring,
    pub(super) tx: Ring,
    pub(super) tx_free: Vec<u64>,
    pub(super) zero_copy: bool,
    /// Sockets on the same queue and UMEM that receive what the steering rules match, one per
    /// port they send to.
    pub(super) steered: Vec<Steered>,
}

/// A socket sharing a queue's socket's UMEM and fill ring, receiving what the steering rules
/// for one port match on that queue.
pub(super) struct Steered {
    pub(super) fd: OwnedFd,
    pub(super) rx: Ring,
    /// The app's output the frames leave by.
    pub(super) output: usize,
}

impl Steered {
    /// A socket on `owner`'s queue and UMEM for output `output`.
    pub(super) fn open(owner: &Xsk, ifindex: u32, output: usize) -> Result<Steered, String> {
        let fd = xdp_socket()?;
        setsockopt(
            fd.as_raw_fd(),
            SOL_XDP,
            RingKind::Rx.size_option(),
            &owner.ring_size,
        )
        .map_err(|e| format!("AF_XDP rx ring: {e}"))?;
        // A socket sharing a UMEM on the same queue takes no other flag.
        let sa = SockaddrXdp {
            family: AF_XDP as u16,
            flags: XDP_SHARED_UMEM,
            ifindex,
            queue_id: owner.queue,
            shared_umem_fd: owner.fd.as_raw_fd() as u32,
        };
        bind_to(fd.as_raw_fd(), &sa).map_err(|e| {
            explain(
                &format!("cannot bind a steering socket to queue {}", owner.queue),
                e,
            )
        })?;
        Steered::map(fd, owner.ring_size, output)
    }

    pub(super) fn map(fd: OwnedFd, ring_size: u32, output: usize) -> Result<Steered, String> {
        let rx = Ring::map_rx(fd.as_fd(), ring_size)?;
        Ok(Steered { fd, rx, output })
    }
}

/// A new AF_XDP socket.
fn xdp_socket() -> Result<OwnedFd, String> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(explain(
            "cannot open an AF_XDP socket",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: socket returned a new descriptor (checked above) that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `bind(2)` of AF_XDP socket `raw` to `sa`.
fn bind_to(raw: RawFd, sa: &SockaddrXdp) -> std::io::Result<()> {
    // SAFETY: `sa` is a live sockaddr_xdp and the length passed is its size.
    let r = unsafe {
        libc::bind(
            raw,
            sa as *const SockaddrXdp as *const libc::sockaddr,
            std::mem::size_of::<SockaddrXdp>() as u32,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Binds AF_XDP socket `raw` to `queue` of `ifname`, zero-copy as `zc` asks; returns whether
/// zero-copy was taken.
fn bind(raw: i32, ifname: &str, ifindex: u32, queue: u32, zc: ZeroCopy) -> Result<bool, String> {
    let try_bind = |flags: u16| {
        let sa = SockaddrXdp {
            family: AF_XDP as u16,
            flags: flags | XDP_USE_NEED_WAKEUP,
            ifindex,
            queue_id: queue,
            shared_umem_fd: 0,
        };
        bind_to(raw, &sa)
    };
    let bind_once = || match zc {
        ZeroCopy::On => try_bind(XDP_ZEROCOPY).map(|_| true),
        ZeroCopy::Off => try_bind(XDP_COPY).map(|_| false),
        ZeroCopy::Auto => try_bind(XDP_ZEROCOPY)
            .map(|_| true)
            .or_else(|_| try_bind(XDP_COPY).map(|_| false)),
    };
    // The kernel lets go of a queue a moment after its last socket closes (the pool is
    // released from a work queue): a queue whose previous owner just died — a Stitch killed
    // and started again, a function that let go of a steering socket — is busy for that long.
    let deadline = Instant::now() + Duration::from_secs(2);
    let bound = loop {
        match bind_once() {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => break other,
        }
    };
    bound.map_err(|e| match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) => {
            format!("`{ifname}` does not support AF_XDP zero-copy; use `zero_copy: auto`")
        }
        Some(libc::EINVAL) => {
            format!("cannot bind AF_XDP to `{ifname}` queue {queue}: no such queue? ({e})")
        }
        Some(libc::EBUSY) => {
            format!("queue {queue} of `{ifname}` is already used by another AF_XDP socket")
        }
        _ => explain(
            &format!("cannot bind AF_XDP to `{ifname}` queue {queue}"),
            e,
        ),
    })
}

impl Xsk {
    pub(super) fn open(
        ifname: &str,
        ifindex: u32,
        queue: u32,
        frames: u32,
        zc: ZeroCopy,
    ) -> Result<Xsk, String> {
        let fd = xdp_socket()?;
        let raw = fd.as_raw_fd();
        let umem_len = (frames * FRAME_SIZE) as usize;
        let (umem_fd, umem) = Mapping::create(&format!("stitch-xdp-{ifname}-{queue}"), umem_len)
            .map_err(|e| explain("cannot allocate UMEM", e))?;
        let reg = UmemReg {
            addr: umem.as_ptr() as u64,
            len: umem_len as u64,
            chunk_size: FRAME_SIZE,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        setsockopt(raw, SOL_XDP, libc::XDP_UMEM_REG, &reg)
            .map_err(|e| explain("cannot register UMEM (locked memory limit? `ulimit -l`)", e))?;
        let half = frames / 2;
        let ring_size = half.next_power_of_two();
        for kind in [
            RingKind::Fill,
            RingKind::Completion,
            RingKind::Rx,
            RingKind::Tx,
        ] {
            setsockopt(raw, SOL_XDP, kind.size_option(), &ring_size)
                .map_err(|e| format!("AF_XDP {kind:?} ring: {e}"))?;
        }
        let [fill, comp, rx, tx] = map_rings(fd.as_fd(), ring_size)?;
        let mut xsk = Xsk {
            fd,
            queue,
            umem,
            umem_fd,
            frames,
            ring_size,
            fill,
            comp,
            rx,
            tx,
            tx_free: Vec::new(),
            zero_copy: false,
            steered: Vec::new(),
        };
        // First half of the frames waits in the fill ring for received packets, the rest is for
        // sending.
        for i in 0..half {
            xsk.fill.set_addr(i, (i * FRAME_SIZE) as u64);
        }
        xsk.fill.submit(half);
        xsk.tx_free = (half..frames).map(|i| (i * FRAME_SIZE) as u64).collect();

        xsk.zero_copy = bind(raw, ifname, ifindex, queue, zc)?;
        Ok(xsk)
    }

    pub(super) fn kick_rx(&self) {
        // SAFETY: a null buffer of length 0 only wakes the kernel's receive path; nothing is
        // written.
        unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
    }

    pub(super) fn kick_tx(&self) {
        // SAFETY: a null buffer of length 0 only wakes the kernel's transmit path; nothing is read.
        unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
    }

    /// Where each of the UMEM's frames is now, by owner (`stitch show`): the rings' shares read
    /// from their indices, the kernel's the rest (frames it took from the fill ring and has not
    /// put in a receive ring yet, and frames it is sending).
    pub(super) fn frames_by_owner(&self, ports: &[String]) -> serde_json::Value {
        let fill = self.fill.in_flight();
        let rx = self.rx.ready();
        let tx_ring = self.tx_pending();
        let completion = self.comp.ready();
        let mut steered = serde_json::Map::new();
        let mut held = u64::from(fill) + u64::from(rx) + u64::from(tx_ring) + u64::from(completion);
        held += self.tx_free.len() as u64;
        for s in &self.steered {
            let n = s.rx.ready();
            held += u64::from(n);
            let port = ports.get(s.output - 1).cloned().unwrap_or_default();
            steered.insert(port, n.into());
        }
        serde_json::json!({
            "queue": self.queue,
            "zero_copy": self.zero_copy,
            "frames": self.frames,
            "by_owner": {
                "fill_ring": fill,
                "rx_ring": rx,
                "steered_rx_rings": steered,
                "tx_free": self.tx_free.len(),
                "tx_ring": tx_ring,
                "completion_ring": completion,
                "kernel": i64::from(self.frames) - held as i64,
            },
        })
    }

    /// Descriptors queued for sending that the kernel has not taken yet.
    pub(super) fn tx_pending(&self) -> u32 {
        self.tx.in_flight()
    }

    /// In copy mode the kernel sends at most 32 frames per wakeup: wake it until the queue is
    /// empty (a few calls per breath at most) so that nothing waits for the next packet.
    pub(super) fn flush_tx(&mut self) {
        if self.zero_copy && !self.tx.needs_wakeup() {
            return;
        }
        for _ in 0..16 {
            if self.tx_pending() == 0 {
                break;
            }
            self.kick_tx();
        }
    }

    /// Takes back the frames the kernel has sent.
    pub(super) fn reclaim(&mut self) {
        let n = self.comp.ready();
        for k in 0..n {
            let addr = self.comp.addr(k);
            self.tx_free.push(addr & !(FRAME_SIZE as u64 - 1));
        }
        self.comp.consume(n);
    }
}

/// The fill, completion, receive and transmit rings of socket `fd`, mapped.
pub(super) fn map_rings(fd: BorrowedFd<'_>, ring_size: u32) -> Result<[Ring; 4], String> {
    let off = ring::offsets(fd)?;
    Ok([
        Ring::map(fd, &off.fr, ring_size, RingKind::Fill)?,
        Ring::map(fd, &off.cr, ring_size, RingKind::Completion)?,
        Ring::map(fd, &off.rx, ring_size, RingKind::Rx)?,
        Ring::map(fd, &off.tx, ring_size, RingKind::Tx)?,
    ])
}
