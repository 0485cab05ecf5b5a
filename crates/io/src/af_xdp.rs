//! `af_xdp`: kernel-bypass interface port. An XDP program redirects the packets of each chosen
//! queue to an AF_XDP socket whose rings and frame memory (UMEM) are shared with Stitch; sending
//! goes through the socket's TX ring. Zero-copy where the driver supports it, copy mode otherwise
//! (veth supports only copy); native (driver) XDP, or generic XDP where the driver has none.
//!
//! Frames are copied between the UMEM and the packet pool at the edge: UMEM chunks are at most a
//! page, pool buffers hold jumbo frames, and the copy of one frame costs less than the kernel's
//! own copy into the UMEM in copy mode. Packets the program does not redirect (queues without a
//! socket) go on to the kernel stack.
//!
//! Offloads: XDP sees packets after the sender's checksum offload and without its state, so a
//! TCP/UDP packet from a local sender (veth, TAP) may carry only the pseudo-header sum in its
//! checksum field. `complete_checksums` (default on) recognises exactly that value and completes
//! the checksum — this is why TCP works here where Open vSwitch's afxdp ports need `ethtool -K
//! … tx off`. The veth driver itself stops its peer's TSO while an XDP program is attached.
//!
//! Steering: `steer` rules (tcpdump filter expressions, tried in order) send the frames they
//! match out another port of this app, classified in the kernel by the XDP program (the
//! expressions are translated to eBPF, `stitch_wire::filter::ebpf`) before Stitch sees them:
//! each rule's frames arrive on an AF_XDP socket of their own that shares the queue's UMEM.
//! When a rule's port is linked to a zero-copy function port, the function reads that socket's
//! receive ring itself ([`stitch_nf::steer`]): the engine neither receives nor counts those
//! frames (`steered_function_packets` counts them as they come back); when the function
//! leaves, this app reads the socket again from where its frames came back.
//!
//! ```yaml
//! apps:
//!   nic: { type: af_xdp, interface: eth0, queues: [0, 1], xdp_mode: native, zero_copy: auto }
//!   edge:
//!     type: af_xdp
//!     interface: eth1
//!     steer: [{ match: "udp and dst port 4789", to: vxlan }]   # port `vxlan` besides `output`
//! ```

use crate::netdev::{self, explain, setsockopt};
use crate::xdp::XdpRedirect;
use serde::{Deserialize, Serialize};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::mapping::{MapOptions, Mapping};
use stitch_core::{pool, App, AppContext, AppError, Counter, Descriptors, Io, PortSpec};
use stitch_nf::listener::PortShared;
use stitch_nf::steer::{self, SteerOffer, SteerQueue};
use stitch_nf::xsk::{self, getsockopt, Ring};
use stitch_wire::offload;

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native if the driver has it, generic otherwise.
    #[default]
    Auto,
    Native,
    Generic,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ZeroCopy {
    /// Zero-copy if the driver supports it, copy mode otherwise.
    #[default]
    Auto,
    On,
    Off,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AfXdpConfig {
    pub interface: String,
    #[serde(default = "queue0")]
    pub queues: Vec<u32>,
    #[serde(default)]
    pub xdp_mode: XdpMode,
    #[serde(default)]
    pub zero_copy: ZeroCopy,
    /// Frames of UMEM per queue (half for receiving, half for sending).
    #[serde(default = "default_frames")]
    pub frames: u32,
    #[serde(default = "yes")]
    pub complete_checksums: bool,
    /// Rules tried in order by the XDP program: the frames a rule matches leave by its port.
    #[serde(default)]
    pub steer: Vec<SteerRule>,
}

/// Frames `filter` matches leave by port `to` instead of `output`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SteerRule {
    /// A filter expression, as tcpdump takes it.
    #[serde(rename = "match")]
    pub filter: String,
    pub to: String,
}

/// The steering rules of an `af_xdp` app's config as a graph holds it (none when it has
/// none, or when they do not parse: the app's own check says why).
pub fn steering_rules(config: &serde_json::Value) -> Vec<SteerRule> {
    config
        .get("steer")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// The ports `rules` send to, in the order they first appear (outputs 1, 2, …).
fn steer_ports(rules: &[SteerRule]) -> Vec<String> {
    let mut ports: Vec<String> = Vec::new();
    for r in rules {
        if !ports.contains(&r.to) {
            ports.push(r.to.clone());
        }
    }
    ports
}

/// The most steering rules an interface takes (each one runs on every frame that the earlier
/// ones did not match).
const MAX_RULES: usize = 32;

impl AfXdpConfig {
    /// Whether `other` differs from this config in its steering rules only.
    fn same_but_rules(&self, other: &AfXdpConfig) -> bool {
        let bare = |c: &AfXdpConfig| AfXdpConfig {
            steer: Vec::new(),
            ..c.clone()
        };
        bare(self) == bare(other)
    }

    /// One more than the highest queue id: the size of the XDP maps' per-queue ranges.
    fn queue_bound(&self) -> u32 {
        self.queues.iter().max().copied().unwrap_or(0) + 1
    }

    /// Each rule's program, or the reason a rule is refused.
    fn steer_programs(&self) -> Result<Vec<Vec<stitch_wire::filter::cbpf::Insn>>, String> {
        if self.steer.len() > MAX_RULES {
            return Err(format!(
                "steer: at most {MAX_RULES} rules, got {}",
                self.steer.len()
            ));
        }
        (self.steer.iter().enumerate())
            .map(|(i, r)| {
                let valid = !r.to.is_empty()
                    && r.to != "output"
                    && r.to.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if !valid {
                    return Err(format!(
                        "steer rule {}: `to: {}` must name a port of its own (letters, digits, _ and -; not `output`)",
                        i + 1,
                        r.to
                    ));
                }
                stitch_wire::filter::PacketFilter::compile(&r.filter)
                    .map(|f| f.instructions())
                    .map_err(|e| format!("steer rule {}: {e}", i + 1))
            })
            .collect()
    }
}

fn queue0() -> Vec<u32> {
    vec![0]
}
fn default_frames() -> u32 {
    4096
}
fn yes() -> bool {
    true
}

const AF_XDP: i32 = 44;
const SOL_XDP: i32 = 283;
const XDP_RX_RING: i32 = 2;
const XDP_TX_RING: i32 = 3;
const XDP_UMEM_REG: i32 = 4;
const XDP_UMEM_FILL_RING: i32 = 5;
const XDP_UMEM_COMPLETION_RING: i32 = 6;
const XDP_STATISTICS: i32 = 7;
const XDP_SHARED_UMEM: u16 = 1;
const XDP_COPY: u16 = 2;
const XDP_ZEROCOPY: u16 = 4;
const XDP_USE_NEED_WAKEUP: u16 = 8;
const FRAME_SIZE: u32 = 4096;
const BURST: usize = 256;

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
struct XdpStatistics {
    rx_dropped: u64,
    rx_invalid_descs: u64,
    tx_invalid_descs: u64,
    rx_ring_full: u64,
    rx_fill_ring_empty_descs: u64,
    tx_ring_empty_descs: u64,
}

/// One AF_XDP socket with its own UMEM.
struct Xsk {
    fd: OwnedFd,
    queue: u32,
    /// The frames the kernel receives into and sends from.
    umem: Mapping,
    /// The UMEM's file, to lend at an upgrade.
    umem_fd: OwnedFd,
    frames: u32,
    ring_size: u32,
    fill: Ring,
    comp: Ring,
    rx: Ring,
    tx: Ring,
    tx_free: Vec<u64>,
    zero_copy: bool,
    /// Sockets on the same queue and UMEM that receive what the steering rules match, one per
    /// port they send to.
    steered: Vec<Steered>,
}

/// A socket sharing a queue's socket's UMEM and fill ring, receiving what the steering rules
/// for one port match on that queue.
struct Steered {
    fd: OwnedFd,
    rx: Ring,
    /// The app's output the frames leave by.
    output: usize,
}

impl Steered {
    /// A socket on `owner`'s queue and UMEM for output `output`.
    fn open(owner: &Xsk, ifindex: u32, output: usize) -> Result<Steered, String> {
        let fd = xdp_socket()?;
        setsockopt(fd.as_raw_fd(), SOL_XDP, XDP_RX_RING, &owner.ring_size)
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

    fn map(fd: OwnedFd, ring_size: u32, output: usize) -> Result<Steered, String> {
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
    fn open(
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
        setsockopt(raw, SOL_XDP, XDP_UMEM_REG, &reg)
            .map_err(|e| explain("cannot register UMEM (locked memory limit? `ulimit -l`)", e))?;
        let half = frames / 2;
        let ring_size = half.next_power_of_two();
        for (opt, what) in [
            (XDP_UMEM_FILL_RING, "fill"),
            (XDP_UMEM_COMPLETION_RING, "completion"),
            (XDP_RX_RING, "rx"),
            (XDP_TX_RING, "tx"),
        ] {
            setsockopt(raw, SOL_XDP, opt, &ring_size)
                .map_err(|e| format!("AF_XDP {what} ring: {e}"))?;
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
            xsk.fill
                .set_addr(xsk.fill.local.wrapping_add(i), (i * FRAME_SIZE) as u64);
        }
        xsk.fill.local = xsk.fill.local.wrapping_add(half);
        xsk.fill.prod().store(xsk.fill.local, Ordering::Release);
        xsk.tx_free = (half..frames).map(|i| (i * FRAME_SIZE) as u64).collect();

        xsk.zero_copy = bind(raw, ifname, ifindex, queue, zc)?;
        Ok(xsk)
    }

    /// The socket and its UMEM's file, and where it stands, for a process taking over.
    fn lend(&self) -> std::io::Result<(Vec<OwnedFd>, XskPosition)> {
        let position = XskPosition {
            queue: self.queue,
            frames: self.frames,
            ring_size: self.ring_size,
            zero_copy: self.zero_copy,
            tx_free: self.tx_free.clone(),
            steered: self.steered.iter().map(|s| s.output).collect(),
        };
        let mut fds = vec![self.fd.try_clone()?, self.umem_fd.try_clone()?];
        for s in &self.steered {
            fds.push(s.fd.try_clone()?);
        }
        Ok((fds, position))
    }

    /// The socket a predecessor lent, on its UMEM and rings (the XSKMAP already points at it),
    /// and its steering sockets from `more`.
    fn adopt(
        fd: OwnedFd,
        umem_fd: OwnedFd,
        at: &XskPosition,
        more: &mut impl Iterator<Item = OwnedFd>,
    ) -> Result<Xsk, String> {
        let len = (at.frames * FRAME_SIZE) as usize;
        let opts = MapOptions {
            populate: true,
            ..MapOptions::default()
        };
        let umem = Mapping::shared(umem_fd.as_fd(), len, opts)
            .map_err(|e| explain("cannot map the lent UMEM", e))?;
        let [fill, comp, rx, tx] = map_rings(fd.as_fd(), at.ring_size)?;
        let mut steered = Vec::new();
        for &output in &at.steered {
            let fd = more
                .next()
                .ok_or_else(|| format!("queue {}: a steering socket was not lent", at.queue))?;
            steered.push(Steered::map(fd, at.ring_size, output)?);
        }
        Ok(Xsk {
            fd,
            queue: at.queue,
            umem,
            umem_fd,
            frames: at.frames,
            ring_size: at.ring_size,
            fill,
            comp,
            rx,
            tx,
            tx_free: at.tx_free.clone(),
            zero_copy: at.zero_copy,
            steered,
        })
    }

    /// Carries on where the predecessor stopped: its free transmit frames, and each ring's
    /// index on this side as the shared ring words hold it (each was published before the
    /// final word).
    fn resume_at(&mut self, at: &XskPosition) {
        self.tx_free = at.tx_free.clone();
        self.fill.local = self.fill.prod().load(Ordering::Acquire);
        self.tx.local = self.tx.prod().load(Ordering::Acquire);
        self.rx.local = self.rx.cons().load(Ordering::Acquire);
        self.comp.local = self.comp.cons().load(Ordering::Acquire);
        for s in &mut self.steered {
            s.rx.local = s.rx.cons().load(Ordering::Acquire);
        }
    }

    fn kick_rx(&self) {
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

    fn kick_tx(&self) {
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
    fn frames_by_owner(&self, ports: &[String]) -> serde_json::Value {
        let fill = self
            .fill
            .local
            .wrapping_sub(self.fill.cons().load(Ordering::Acquire));
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
    fn tx_pending(&self) -> u32 {
        self.tx
            .local
            .wrapping_sub(self.tx.cons().load(Ordering::Acquire))
    }

    /// In copy mode the kernel sends at most 32 frames per wakeup: wake it until the queue is
    /// empty (a few calls per breath at most) so that nothing waits for the next packet.
    fn flush_tx(&mut self) {
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
    fn reclaim(&mut self) {
        let n = self.comp.ready();
        for i in 0..n {
            let addr = self.comp.addr(self.comp.local.wrapping_add(i));
            self.tx_free.push(addr & !(FRAME_SIZE as u64 - 1));
        }
        self.comp.local = self.comp.local.wrapping_add(n);
        self.comp.cons().store(self.comp.local, Ordering::Release);
    }
}

/// The fill, completion, receive and transmit rings of socket `fd`, mapped.
fn map_rings(fd: BorrowedFd<'_>, ring_size: u32) -> Result<[Ring; 4], String> {
    let off = xsk::offsets(fd)?;
    Ok([
        Ring::map(fd, &off.fr, ring_size, 8, xsk::PGOFF_FILL)?,
        Ring::map(fd, &off.cr, ring_size, 8, xsk::PGOFF_COMPLETION)?,
        Ring::map(fd, &off.rx, ring_size, xsk::DESC_SIZE, xsk::PGOFF_RX)?,
        Ring::map(fd, &off.tx, ring_size, xsk::DESC_SIZE, xsk::PGOFF_TX)?,
    ])
}

/// Where one socket stands at an upgrade: its set-up and the transmit frames this side holds
/// (the others are in the kernel's rings).
#[derive(Debug, Serialize, Deserialize)]
struct XskPosition {
    queue: u32,
    frames: u32,
    ring_size: u32,
    zero_copy: bool,
    tx_free: Vec<u64>,
    /// The outputs of its steering sockets, in order.
    #[serde(default)]
    steered: Vec<usize>,
}

/// Where an `af_xdp` port stands at an upgrade. Its descriptors: the XDP map, program and
/// link (and the steering map, with rules), then each socket, its UMEM's file and its
/// steering sockets.
#[derive(Debug, Serialize, Deserialize)]
struct Position {
    native: bool,
    socks: Vec<XskPosition>,
    /// The steering rules the program runs.
    #[serde(default)]
    steer: Vec<SteerRule>,
    /// Steering ports whose rings a function reads itself: its port in the successor takes
    /// the function on, and this app's successor leaves those rings to it.
    #[serde(default)]
    read_by_functions: Vec<String>,
}

/// The XDP program attached to the interface and a socket per queue, bound and mapped.
fn open(c: &AfXdpConfig, ifindex: u32) -> Result<(XdpRedirect, Vec<Xsk>), String> {
    let name = &c.interface;
    let max_queue = c.queue_bound();
    let rules = c.steer_programs()?;
    let attach = |native| XdpRedirect::attach(name, ifindex, native, max_queue, &rules);
    let xdp = match c.xdp_mode {
        XdpMode::Native => attach(true)?,
        XdpMode::Generic => attach(false)?,
        XdpMode::Auto => match attach(true) {
            Ok(x) => x,
            Err(e) if e.contains("no native XDP") => {
                log::warn!("{e}; using generic XDP");
                attach(false)?
            }
            Err(e) => return Err(e),
        },
    };
    let ports = steer_ports(&c.steer);
    let mut socks = Vec::new();
    for &q in &c.queues {
        let mut x = Xsk::open(name, ifindex, q, c.frames, c.zero_copy)?;
        for (p, port) in ports.iter().enumerate() {
            let steered = Steered::open(&x, ifindex, p + 1)?;
            for (rule, _) in c.steer.iter().enumerate().filter(|(_, r)| &r.to == port) {
                xdp.bind_steered(rule, q, steered.fd.as_raw_fd())?;
            }
            x.steered.push(steered);
        }
        xdp.bind_queue(q, x.fd.as_raw_fd())?;
        socks.push(x);
    }
    Ok((xdp, socks))
}

/// The program and sockets a predecessor lent, for the same queues.
fn adopt(c: &AfXdpConfig, lent: Descriptors) -> Result<(XdpRedirect, Vec<Xsk>), String> {
    let at: Position =
        serde_json::from_value(lent.position).map_err(|e| format!("lent position: {e}"))?;
    let lent_queues: Vec<u32> = at.socks.iter().map(|s| s.queue).collect();
    if lent_queues != c.queues {
        return Err(format!(
            "the predecessor served queues {lent_queues:?}, this graph asks for {:?}",
            c.queues
        ));
    }
    if at.steer != c.steer {
        return Err("the predecessor's steering rules differ from this graph's".into());
    }
    let max_queue = c.queue_bound();
    let mut fds = lent.fds.into_iter();
    let xdp = XdpRedirect::adopt(&mut fds, at.native, max_queue, !at.steer.is_empty())?;
    let mut socks = Vec::new();
    for s in &at.socks {
        let (Some(fd), Some(umem_fd)) = (fds.next(), fds.next()) else {
            return Err(format!("queue {}: its socket was not lent", s.queue));
        };
        socks.push(Xsk::adopt(fd, umem_fd, s, &mut fds)?);
    }
    Ok((xdp, socks))
}

pub struct AfXdp {
    socks: Vec<Xsk>,
    xdp: XdpRedirect,
    /// The XSKMAP entries are this process's to remove when the port goes (not while a
    /// predecessor still serves the sockets it lent).
    owns: bool,
    complete_checksums: bool,
    next_rx: usize,
    next_tx: usize,
    last_stats: Instant,
    kernel_drops: Counter,
    checksums_completed: Counter,
    rx_malformed: Counter,
    pool_exhausted: Counter,
    tx_full: Counter,
    interface: String,
    /// The longest frame the interface takes, read again each second.
    max_frame: usize,
    too_big: Counter,
    /// Packets received per queue (`queueN_rx_packets`), to see how traffic spreads.
    queue_rx: Vec<Counter>,
    /// Frames the steering rules sent to their ports.
    steered: Counter,
    /// Steered frames dropped because their port has no link.
    unlinked: Counter,
    /// Per steering port: its sockets lent to a function, or waiting to be.
    lending: Vec<Lending>,
    /// Steered frames a function read straight from the rings and gave back.
    function_steered: Counter,
    /// When this app took its sockets over from a predecessor.
    taken_over_at: Instant,
    /// Steering sockets of ports the rules no longer have, kept until a function they were
    /// lent to has given back what it read; then the frames left in their rings go back to
    /// the fill ring (counted) and the sockets close.
    retiring: Vec<Retiring>,
    removed_drops: Counter,
    config: AfXdpConfig,
    ifindex: u32,
}

/// A steering port the rules no longer have: its socket on each queue (by queue index).
struct Retiring {
    sockets: Vec<(usize, Steered)>,
    offer: Option<Offered>,
    /// When the program that sent it frames was replaced: a frame that program was
    /// redirecting then may land a moment later.
    since: Instant,
}

/// Sockets of one steering port lent to a function ([`stitch_nf::steer`]).
struct Offered {
    offer: Arc<SteerOffer>,
    to: Arc<PortShared>,
}

/// One steering port's sockets and the function port its link leads to.
#[derive(Default)]
struct Lending {
    /// Lent to that function port's function, until it is done with them.
    offer: Option<Offered>,
    /// The function's attachment they were last offered to (not offered twice).
    offered_to: Option<u64>,
    /// Taken over: a function read them in the predecessor; left alone until its port
    /// offers them back (or turns out not to have carried the function on).
    awaiting: bool,
}

impl Lending {
    /// Whether a function reads the sockets, or may: this app leaves them alone.
    fn away(&self) -> bool {
        self.awaiting || self.offer.is_some()
    }
}

impl Drop for AfXdp {
    fn drop(&mut self) {
        for o in self.lending.iter().filter_map(|l| l.offer.as_ref()) {
            o.offer.end.store(true, Ordering::Release);
        }
        if !self.owns {
            return;
        }
        for s in &self.socks {
            self.xdp.unbind_queue(s.queue);
        }
    }
}

impl AfXdp {
    /// Takes up to `budget` frames from queue socket `s`'s receive ring (or, with `steered`,
    /// from that steering socket's) into `out`; without `out` they are dropped and counted.
    fn receive(
        &mut self,
        s: usize,
        steered: Option<usize>,
        mut out: Option<&mut stitch_core::Producer>,
        budget: usize,
    ) -> usize {
        let complete = self.complete_checksums;
        let x = &mut self.socks[s];
        let rx = match steered {
            None => &mut x.rx,
            Some(j) => &mut x.steered[j].rx,
        };
        let n = (rx.ready() as usize).min(budget);
        if n == 0 {
            if x.fill.needs_wakeup() {
                x.kick_rx();
            }
            return 0;
        }
        let ts = stitch_core::packet::now_ns();
        self.queue_rx[s].add(n as u64);
        if steered.is_some() {
            self.steered.add(n as u64);
        }
        let mut made = 0;
        for i in 0..n as u32 {
            let (addr, len) = rx.desc(rx.local.wrapping_add(i));
            // Give the frame back to the fill ring at once: the data is copied below.
            x.fill.set_addr(
                x.fill.local.wrapping_add(i),
                addr & !(FRAME_SIZE as u64 - 1),
            );
            let Some(out) = out.as_deref_mut() else {
                self.unlinked.add(1);
                continue;
            };
            let bytes = usize::try_from(addr)
                .ok()
                .and_then(|at| x.umem.bytes(at, len as usize));
            let Some(bytes) = bytes.filter(|b| b.len() >= 14) else {
                self.rx_malformed.add(1);
                continue;
            };
            let Some(mut p) = pool::alloc() else {
                self.pool_exhausted.add(1);
                continue;
            };
            let _ = p.set_data(bytes);
            p.set_timestamp_ns(ts);
            if complete && offload::complete_if_partial(p.data_mut()) {
                self.checksums_completed.add(1);
            }
            out.transmit(p);
            made += 1;
        }
        rx.local = rx.local.wrapping_add(n as u32);
        rx.cons().store(rx.local, Ordering::Release);
        x.fill.local = x.fill.local.wrapping_add(n as u32);
        x.fill.prod().store(x.fill.local, Ordering::Release);
        made
    }

    fn read_kernel_stats(&mut self) {
        let mut drops = 0;
        for s in &self.socks {
            if let Ok(st) = getsockopt::<XdpStatistics>(s.fd.as_raw_fd(), XDP_STATISTICS) {
                drops += st.rx_dropped + st.rx_ring_full;
            }
        }
        // These kernel counters are cumulative.
        self.kernel_drops.set(drops);
    }
}

/// Puts the frames of receive ring `rx` up to ring index `upto` back in fill ring `fill`
/// and moves `rx` past them; how many (never past what the kernel put there).
fn refill_from(fill: &mut Ring, rx: &mut Ring, upto: u32) -> u32 {
    let n = upto.wrapping_sub(rx.local);
    if n == 0 || n > rx.ready() {
        return 0;
    }
    for i in 0..n {
        let (addr, _) = rx.desc(rx.local.wrapping_add(i));
        fill.set_addr(fill.local.wrapping_add(i), addr & !(FRAME_SIZE as u64 - 1));
    }
    rx.local = rx.local.wrapping_add(n);
    rx.cons().store(rx.local, Ordering::Release);
    fill.local = fill.local.wrapping_add(n);
    fill.prod().store(fill.local, Ordering::Release);
    n
}

impl AfXdp {
    /// Puts the frames functions gave back (up to each queue's `returned`) in the fill rings
    /// and moves the lent sockets' rings on past them — of every lent port, or of `only`.
    fn take_back_from_functions(&mut self, only: Option<usize>) {
        for (s, x) in self.socks.iter_mut().enumerate() {
            let mut given_back = 0;
            for st in &mut x.steered {
                let port = st.output - 1;
                let Some(o) = &self.lending[port].offer else {
                    continue;
                };
                if only.is_none_or(|p| p == port) {
                    let upto = o.offer.queues[s].returned.load(Ordering::Acquire);
                    given_back += refill_from(&mut x.fill, &mut st.rx, upto);
                }
            }
            if given_back > 0 {
                self.function_steered.add(u64::from(given_back));
                if x.fill.needs_wakeup() {
                    x.kick_rx();
                }
            }
        }
    }

    /// Offers steering port `port`'s sockets to the zero-copy function port its link leads
    /// to, once per attachment of a function there; asks for them back when the link no
    /// longer leads there; forgets an offer the port is done with (this app reads the
    /// sockets again from where the function's frames came back).
    fn follow_offer(&mut self, port: usize, io: &mut Io) {
        let linked = io
            .output(port + 1)
            .and_then(|o| o.ring().consumer_end().cloned())
            .and_then(|tag| tag.downcast::<PortShared>().ok())
            .filter(|p| p.settings.zero_copy);
        if let Some(o) = &self.lending[port].offer {
            if o.offer.phase() == steer::DONE {
                // Its last frames first, then the sockets are this app's again.
                self.take_back_from_functions(Some(port));
                self.lending[port].offer = None;
            } else if linked.is_none_or(|to| !Arc::ptr_eq(&to, &o.to)) {
                o.offer.end.store(true, Ordering::Release);
            }
            return;
        }
        if self.lending[port].awaiting {
            self.take_on_offer(port, linked);
            return;
        }
        let Some(to) = linked else { return };
        let generation = to.current.lock().unwrap().as_ref().map(|c| c.generation);
        if generation.is_none() || generation == self.lending[port].offered_to {
            return;
        }
        let mut slot = to.steer.lock().unwrap();
        if slot.is_some() {
            return; // A predecessor's offer is still being handed back.
        }
        let Some(offer) = self.offer(port) else {
            return;
        };
        *slot = Some(offer.clone());
        drop(slot);
        to.changed.store(true, Ordering::Release);
        self.lending[port].offered_to = generation;
        self.lending[port].offer = Some(Offered { offer, to });
    }

    /// Taken over: the function port that read steering port `port`'s rings in the
    /// predecessor offers them again from its slot (its successor carried the function on);
    /// if its slot holds nothing, or the port no longer leads to one, this app reads them.
    fn take_on_offer(&mut self, port: usize, linked: Option<Arc<PortShared>>) {
        let Some(to) = linked else {
            // Its port tags the link on its first breath; a link to anything else (or none)
            // gets its frames from this app after a moment.
            if self.taken_over_at.elapsed() >= Duration::from_secs(1) {
                self.lending[port].awaiting = false;
            }
            return;
        };
        let l = &mut self.lending[port];
        l.awaiting = false;
        let offer = to.steer.lock().unwrap().clone();
        let Some(offer) = offer.filter(|o| o.phase() == steer::FUNCTION) else {
            return;
        };
        l.offered_to = to.current.lock().unwrap().as_ref().map(|c| c.generation);
        l.offer = Some(Offered { offer, to });
    }

    /// Changes the steering rules in place: steering sockets of ports that stay are kept
    /// (with their rings and any function reading them), ports that are new get sockets, and
    /// the new program replaces the old one in one step once its maps are filled. Sockets of
    /// ports that go retire ([`Retiring`]). On an error nothing has changed.
    fn change_rules(&mut self, c: &AfXdpConfig) -> Result<(), String> {
        let rules = c.steer_programs()?;
        let old_ports = steer_ports(&self.config.steer);
        let new_ports = steer_ports(&c.steer);
        // Sockets for the new ports first: a failure here leaves the running program alone.
        let mut opened: Vec<Vec<Option<Steered>>> = Vec::new();
        for x in &self.socks {
            let mut mine = Vec::new();
            for (p, name) in new_ports.iter().enumerate() {
                mine.push(match old_ports.contains(name) {
                    true => None,
                    false => Some(Steered::open(x, self.ifindex, p + 1)?),
                });
            }
            opened.push(mine);
        }
        let socket_of = |s: usize, port: &str| -> RawFd {
            let p = new_ports
                .iter()
                .position(|n| n == port)
                .expect("a rule's port");
            match &opened[s][p] {
                Some(st) => st.fd.as_raw_fd(),
                None => {
                    let old = old_ports.iter().position(|n| n == port).expect("kept");
                    let x = &self.socks[s];
                    let st = x
                        .steered
                        .iter()
                        .find(|t| t.output == old + 1)
                        .expect("kept");
                    st.fd.as_raw_fd()
                }
            }
        };
        let socks = &self.socks;
        self.xdp.replace_rules(&rules, |staged| {
            for (s, x) in socks.iter().enumerate() {
                staged.bind_queue(x.queue, x.fd.as_raw_fd())?;
                for (rule, r) in c.steer.iter().enumerate() {
                    staged.bind_steered(rule, x.queue, socket_of(s, &r.to))?;
                }
            }
            Ok(())
        })?;
        // The new program runs: each queue's sockets in the new ports' order.
        let mut lending: Vec<Lending> = new_ports.iter().map(|_| Lending::default()).collect();
        let mut retiring: Vec<Retiring> = Vec::new();
        for (old, name) in old_ports.iter().enumerate() {
            let l = std::mem::take(&mut self.lending[old]);
            match new_ports.iter().position(|n| n == name) {
                Some(p) => lending[p] = l,
                None => {
                    let offer = l.offer;
                    if let Some(o) = &offer {
                        o.offer.end.store(true, Ordering::Release);
                    }
                    retiring.push(Retiring {
                        sockets: Vec::new(),
                        offer,
                        since: Instant::now(),
                    });
                }
            }
        }
        for (s, (x, mut fresh)) in self.socks.iter_mut().zip(opened).enumerate() {
            let mut kept: Vec<Steered> = Vec::new();
            for mut st in std::mem::take(&mut x.steered) {
                let name = &old_ports[st.output - 1];
                match new_ports.iter().position(|n| n == name) {
                    Some(p) => {
                        st.output = p + 1;
                        kept.push(st);
                    }
                    None => {
                        let gone = old_ports.iter().filter(|n| !new_ports.contains(n));
                        let r = gone.clone().position(|n| n == name).expect("gone");
                        retiring[r].sockets.push((s, st));
                    }
                }
            }
            kept.extend(fresh.iter_mut().filter_map(Option::take));
            kept.sort_by_key(|st| st.output);
            x.steered = kept;
        }
        self.retiring.extend(retiring);
        self.lending = lending;
        log::info!(
            "af_xdp {}: {} steering rules to {:?} now",
            self.interface,
            c.steer.len(),
            new_ports
        );
        Ok(())
    }

    /// Retiring sockets: what a function gives back goes to the fill ring; once it is done
    /// (or none had them), the frames left in their rings too, counted, and they close.
    fn retire(&mut self) {
        let mut i = 0;
        while i < self.retiring.len() {
            let r = &mut self.retiring[i];
            let done = r
                .offer
                .as_ref()
                .is_none_or(|o| o.offer.phase() == steer::DONE)
                && r.since.elapsed() >= Duration::from_millis(10);
            for (s, st) in &mut r.sockets {
                let x = &mut self.socks[*s];
                if let Some(o) = &r.offer {
                    let upto = o.offer.queues[*s].returned.load(Ordering::Acquire);
                    let n = refill_from(&mut x.fill, &mut st.rx, upto);
                    self.function_steered.add(u64::from(n));
                }
                if done {
                    let upto = st.rx.prod().load(Ordering::Acquire);
                    let n = refill_from(&mut x.fill, &mut st.rx, upto);
                    self.removed_drops.add(u64::from(n));
                }
            }
            if done {
                self.retiring.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Port `port`'s sockets on every queue, from where this app stopped reading them.
    fn offer(&self, port: usize) -> Option<Arc<SteerOffer>> {
        let mut queues = Vec::new();
        for x in &self.socks {
            let s = x.steered.iter().find(|s| s.output == port + 1)?;
            queues.push(SteerQueue {
                socket: s.fd.try_clone().ok()?,
                umem: x.umem_fd.try_clone().ok()?,
                umem_len: (x.frames * FRAME_SIZE) as usize,
                ring_size: x.ring_size,
                start: s.rx.local,
                returned: s.rx.local.into(),
            });
        }
        let ports = steer_ports(&self.config.steer);
        Some(Arc::new(SteerOffer {
            from: format!("af_xdp `{}` port `{}`", self.interface, ports[port]),
            queues,
            phase: steer::OFFERED.into(),
            end: false.into(),
            complete_checksums: self.complete_checksums,
        }))
    }
}

impl App for AfXdp {
    type Config = AfXdpConfig;

    fn declare(c: &AfXdpConfig) -> Result<PortSpec, AppError> {
        if c.queues.is_empty() {
            return Err("queues: give at least one queue id".into());
        }
        if c.frames < 64 || !c.frames.is_power_of_two() || c.frames > 1 << 18 {
            return Err(format!(
                "frames must be a power of two in 64..=262144, got {}",
                c.frames
            )
            .into());
        }
        c.steer_programs()?;
        let mut spec = PortSpec::filter();
        if !c.steer.is_empty() {
            let outputs = std::iter::once("output".to_string()).chain(steer_ports(&c.steer));
            spec.outputs = stitch_core::app::PortNames::Fixed(outputs.collect());
        }
        Ok(spec)
    }

    fn new(c: AfXdpConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let name = &c.interface;
        let ifindex = netdev::ifindex(name)?;
        if netdev::flags(name).map_err(|e| format!("interface `{name}`: {e}"))? & libc::IFF_UP == 0
        {
            return Err(format!("interface `{name}` is down (ip link set {name} up)").into());
        }
        let (xdp, socks, owns) = match ctx.take_inherited() {
            Some(lent) => {
                let (xdp, socks) = adopt(&c, lent)?;
                (xdp, socks, false)
            }
            None => {
                let (xdp, socks) = open(&c, ifindex)?;
                (xdp, socks, true)
            }
        };
        log::info!(
            "af_xdp {name}: queues {:?}, {} XDP, {}{}{}",
            c.queues,
            if xdp.native { "native" } else { "generic" },
            if socks.iter().all(|s| s.zero_copy) {
                "zero-copy"
            } else {
                "copy mode"
            },
            if owns { "" } else { ", taken over" },
            match c.steer.len() {
                0 => String::new(),
                n => format!(", {n} steering rules to {:?}", steer_ports(&c.steer)),
            }
        );
        Ok(AfXdp {
            socks,
            xdp,
            owns,
            complete_checksums: c.complete_checksums,
            next_rx: 0,
            next_tx: 0,
            last_stats: Instant::now(),
            kernel_drops: ctx.counter("kernel_drops"),
            checksums_completed: ctx.counter("checksums_completed"),
            rx_malformed: ctx.counter("rx_malformed_drops"),
            pool_exhausted: ctx.counter("pool_exhausted_drops"),
            tx_full: ctx.counter("tx_ring_full"),
            max_frame: netdev::max_frame(name),
            interface: c.interface.clone(),
            too_big: ctx.counter("too_big_drops"),
            queue_rx: c
                .queues
                .iter()
                .map(|q| ctx.counter(&format!("queue{q}_rx_packets")))
                .collect(),
            steered: ctx.counter("steered_packets"),
            unlinked: ctx.counter("steered_unlinked_drops"),
            lending: steer_ports(&c.steer)
                .iter()
                .map(|_| Lending::default())
                .collect(),
            function_steered: ctx.counter("steered_function_packets"),
            retiring: Vec::new(),
            taken_over_at: Instant::now(),
            removed_drops: ctx.counter("steer_removed_drops"),
            config: c.clone(),
            ifindex,
        })
    }

    /// Steering rules change in place; anything else needs a new port.
    fn reconfigure(
        &mut self,
        c: AfXdpConfig,
        _: &mut AppContext,
    ) -> Result<stitch_core::app::Reconfigured, AppError> {
        use stitch_core::app::Reconfigured;
        if !c.same_but_rules(&self.config) {
            return Ok(Reconfigured::Restart);
        }
        if c.steer != self.config.steer {
            if !self.owns {
                return Err(
                    "the steering rules cannot change while an upgrade hands this \
                            interface over; apply them again once it is done"
                        .into(),
                );
            }
            self.change_rules(&c)?;
        }
        self.config = c;
        Ok(Reconfigured::Done)
    }

    fn pull(&mut self, io: &mut Io) {
        if !self.retiring.is_empty() {
            self.retire();
        }
        for x in &mut self.socks {
            if x.tx_pending() > 0 {
                x.flush_tx();
            }
        }
        if let Some(out) = io.output(0) {
            let mut budget = out.room().min(BURST);
            for k in 0..self.socks.len() {
                let s = (self.next_rx + k) % self.socks.len();
                budget -= self.receive(s, None, Some(&mut *out), budget).min(budget);
            }
        }
        if self.lending.iter().any(|l| l.offer.is_some()) {
            self.take_back_from_functions(None);
        }
        for s in 0..self.socks.len() {
            for j in 0..self.socks[s].steered.len() {
                let output = self.socks[s].steered[j].output;
                if self.lending[output - 1].away() {
                    continue;
                }
                let mut out = io.output(output);
                let budget = out.as_mut().map_or(BURST, |o| o.room().min(BURST));
                self.receive(s, Some(j), out, budget);
            }
        }
        self.next_rx = (self.next_rx + 1) % self.socks.len();
    }

    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        if input.is_empty() {
            return;
        }
        let s = self.next_tx;
        self.next_tx = (self.next_tx + 1) % self.socks.len();
        let x = &mut self.socks[s];
        x.reclaim();
        let room = (x.tx.free() as usize).min(x.tx_free.len()).min(BURST);
        let mut n = 0u32;
        let mut malformed = 0;
        let mut too_big = 0;
        let max_frame = self.max_frame;
        loop {
            // A super-frame is cut into segments here: take it only when they all fit.
            let need = match input.peek() {
                None => break,
                Some(p) if p.header().gso_size > 0 => p.len() / p.header().gso_size as usize + 1,
                Some(_) => 1,
            };
            if n as usize + need > room {
                break;
            }
            let p = input.receive().expect("peeked");
            let r = offload::resolve_gso(p, |mut seg| {
                if offload::complete_checksum(&mut seg).is_err() || seg.len() > FRAME_SIZE as usize
                {
                    malformed += 1;
                    return;
                }
                if netdev::frame_too_big(seg.data(), max_frame) {
                    too_big += 1;
                    return;
                }
                let addr = x.tx_free.pop().expect("room counted above");
                // Free frames are whole FRAME_SIZE chunks of the UMEM and the segment fits one.
                let written = x.umem.write(addr as usize, seg.data());
                debug_assert!(written, "transmit frames lie inside the UMEM");
                x.tx.set_desc(x.tx.local.wrapping_add(n), addr, seg.len() as u32);
                n += 1;
            });
            if r.is_err() {
                malformed += 1;
            }
        }
        self.rx_malformed.add(malformed);
        self.too_big.add(too_big);
        if n > 0 {
            x.tx.local = x.tx.local.wrapping_add(n);
            x.tx.prod().store(x.tx.local, Ordering::Release);
        }
        x.flush_tx();
        x.reclaim();
        if !input.is_empty() && room == 0 {
            self.tx_full.add(1);
        }
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        for x in &mut self.socks {
            x.reclaim();
        }
        for port in 0..self.lending.len() {
            self.follow_offer(port, io);
        }
        if now.duration_since(self.last_stats) >= Duration::from_secs(1) {
            self.last_stats = now;
            self.read_kernel_stats();
            self.max_frame = netdev::max_frame_or(&self.interface, self.max_frame);
        }
    }

    fn stop(&mut self) {
        self.read_kernel_stats();
    }

    /// The interface, its steering rules and where each queue's frames are.
    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        let ports = steer_ports(&self.config.steer);
        serde_json::json!({
            "interface": self.interface,
            "xdp": if self.xdp.native { "native" } else { "generic" },
            "steer": self.config.steer,
            // Per steering port, the function port reading its rings itself, if one does.
            "read_by": (ports.iter().zip(&self.lending))
                .map(|(p, l)| (p.clone(), l.offer.as_ref().map(|o| o.to.name.clone()).into()))
                .collect::<serde_json::Map<String, serde_json::Value>>(),
            "queues": self.socks.iter().map(|x| x.frames_by_owner(&ports)).collect::<Vec<_>>(),
        })
    }

    /// The program, the sockets and their UMEMs: the successor maps the same rings and
    /// frames and carries on at the indices the rings hold, the XSKMAP pointing at the same
    /// sockets throughout.
    fn hand_over(&mut self) -> Option<Descriptors> {
        if !self.retiring.is_empty() || self.lending.iter().any(|l| l.awaiting) {
            return None; // Sockets of removed rules still hold frames for a moment.
        }
        // What the functions gave back goes to the fill ring first: the rings' consumer
        // indices, which the successor starts from, are then where their ports stand.
        self.take_back_from_functions(None);
        let ports = steer_ports(&self.config.steer);
        let read_by_functions = (ports.iter().zip(&self.lending))
            .filter(|(_, l)| (l.offer.as_ref()).is_some_and(|o| o.offer.phase() == steer::FUNCTION))
            .map(|(p, _)| p.clone())
            .collect();
        let mut fds = self.xdp.lend().ok()?;
        let mut socks = Vec::new();
        for x in &self.socks {
            let (lent, position) = x.lend().ok()?;
            fds.extend(lent);
            socks.push(position);
        }
        let position = Position {
            native: self.xdp.native,
            socks,
            steer: self.config.steer.clone(),
            read_by_functions,
        };
        Some(Descriptors {
            fds,
            position: serde_json::to_value(position).ok()?,
        })
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        let at: Position = serde_json::from_value(position).map_err(|e| e.to_string())?;
        if at.socks.len() != self.socks.len() {
            return Err(format!(
                "af_xdp {}: the predecessor's sockets changed",
                self.interface
            ));
        }
        for (x, s) in self.socks.iter_mut().zip(&at.socks) {
            x.resume_at(s);
        }
        let ports = steer_ports(&self.config.steer);
        for (l, name) in self.lending.iter_mut().zip(&ports) {
            l.awaiting = at.read_by_functions.contains(name);
        }
        self.taken_over_at = Instant::now();
        self.owns = true;
        Ok(())
    }
}
