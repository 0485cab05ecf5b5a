//! `kernel_routes`: the kernel's routing tables as a stream of netlink messages on its output,
//! for a `router` with `kernel_table` to follow (VPP's linux-cp: routes a daemon — FRR, BIRD —
//! installs in Linux become the data plane's).
//!
//! It listens to the links, nexthop objects and IPv4/IPv6 routes of a network namespace
//! (rtnetlink multicast groups) and first dumps each of them: every dump is preceded on the
//! output by the request that asked for it and ended by the kernel's `NLMSG_DONE`, so the reader
//! knows the table was sent whole and can forget what it no longer holds. Each message is one
//! packet, as the kernel wrote it (a capture of the link is read by Wireshark's netlink
//! dissector). Nothing is dropped for want of room: messages wait here while the output is
//! full, the socket's buffer fills, and when the kernel reports it overflowed (`ENOBUFS`) the
//! tables are dumped again (counted in `resyncs`). Only the kernel's messages are taken: one
//! sent to the socket by another process (only root may send to it at all) is dropped and
//! counted in `not_from_kernel_drops`.

use serde::Deserialize;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use stitch_core::{pool, App, AppContext, AppError, Counter, Io, Packet, PortSpec};
use stitch_wire::netlink::{self, kind};

use crate::netdev;

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRoutesConfig {
    /// The network namespace whose tables are followed (a name `ip netns add` gave, or a
    /// path). Default: Stitch's own.
    pub namespace: Option<String>,
    /// Bytes of the socket's receive buffer: what the kernel holds while the router is busy
    /// before it overflows and everything is dumped again.
    #[serde(default = "default_buffer")]
    pub buffer: usize,
}

fn default_buffer() -> usize {
    32 << 20
}

/// The dumps made at start and after an overflow, in order: interfaces first, so that routes
/// name interfaces already known; nexthop objects before the routes that use them.
const DUMPS: [u16; 3] = [kind::GETLINK, kind::GETNEXTHOP, kind::GETROUTE];
/// Datagrams read per breath at most (fewer when the output fills): a dump of a million
/// routes comes in a few thousand, but a daemon's changes come one route per datagram.
const READS_PER_BREATH: usize = 1024;

pub struct KernelRoutes {
    socket: OwnedFd,
    buf: Vec<u8>,
    /// Messages read and not yet sent: the output was full.
    waiting: VecDeque<Packet>,
    /// The dump under way: its index in `DUMPS` and its number.
    dumping: Option<(usize, u32)>,
    /// The kernel overflowed during a dump: that dump is not whole, so its end is not passed
    /// on (the reader would forget what it lost) and the dumps start again after it.
    resync_after_dump: bool,
    seq: u32,
    messages: Counter,
    resyncs: Counter,
    malformed: Counter,
    pool_exhausted: Counter,
    errors: Counter,
    foreign: Counter,
}

fn open(buffer: usize) -> Result<OwnedFd, String> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(netdev::explain(
            "cannot open a netlink socket",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let size = buffer.min(i32::MAX as usize) as libc::c_int;
    // Beyond net.core.rmem_max: allowed to root (CAP_NET_ADMIN), else the plain option.
    if netdev::setsockopt(
        fd.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_RCVBUFFORCE,
        &size,
    )
    .is_err()
    {
        netdev::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, &size)
            .map_err(|e| netdev::explain("SO_RCVBUF", e))?;
    }
    // SAFETY: sockaddr_nl is plain data; all zeroes is valid.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = netlink::GROUP_LINK | netlink::GROUP_IPV4_ROUTE | netlink::GROUP_IPV6_ROUTE;
    // SAFETY: bind reads one sockaddr_nl of the size given.
    if unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    } < 0
    {
        return Err(netdev::explain(
            "cannot bind the netlink socket",
            std::io::Error::last_os_error(),
        ));
    }
    // Nexthop objects have a group above 31, joined by number; a kernel without them refuses,
    // and its routes name their gateways themselves.
    let _ = netdev::setsockopt(
        fd.as_raw_fd(),
        libc::SOL_NETLINK,
        libc::NETLINK_ADD_MEMBERSHIP,
        &netlink::GROUP_NUMBER_NEXTHOP,
    );
    Ok(fd)
}

impl KernelRoutes {
    /// Asks for dump `index` of `DUMPS` and puts the request on the output as its beginning.
    fn start_dump(&mut self, index: usize) {
        self.seq = self.seq.wrapping_add(1).max(1);
        let request = netlink::dump_request(DUMPS[index], self.seq);
        // SAFETY: send reads `request.len()` bytes of a live buffer; the socket is connected
        // to the kernel (address 0) by default.
        let sent = unsafe {
            libc::send(
                self.socket.as_raw_fd(),
                request.as_ptr() as *const libc::c_void,
                request.len(),
                0,
            )
        };
        if sent < 0 {
            log::warn!(
                "kernel_routes: cannot ask for a dump: {}",
                std::io::Error::last_os_error()
            );
            self.errors.add(1);
            self.dumping = None;
            return;
        }
        self.dumping = Some((index, self.seq));
        self.queue(&request);
    }

    fn queue(&mut self, message: &[u8]) {
        match pool::alloc_with(message) {
            Some(p) => {
                self.messages.add(1);
                self.waiting.push_back(p);
            }
            None => self.pool_exhausted.add(1),
        }
    }

    /// One datagram's messages queued; the dump under way moved on at its end.
    fn take(&mut self, n: usize) {
        let datagram = std::mem::take(&mut self.buf);
        let mut next_dump = None;
        for m in netlink::messages(&datagram[..n]) {
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    log::warn!("kernel_routes: {e}");
                    self.malformed.add(1);
                    break;
                }
            };
            let ends_dump = self
                .dumping
                .is_some_and(|(_, seq)| seq == m.seq && matches!(m.kind, kind::DONE | kind::ERROR));
            if !ends_dump {
                self.queue(m.bytes);
                continue;
            }
            let (index, _) = self.dumping.expect("checked");
            if std::mem::take(&mut self.resync_after_dump) {
                next_dump = Some(0);
            } else {
                self.queue(m.bytes);
                next_dump = Some(index + 1);
            }
        }
        self.buf = datagram;
        if let Some(i) = next_dump {
            self.dumping = None;
            if i < DUMPS.len() {
                self.start_dump(i);
            }
        }
    }

    /// The kernel dropped messages: everything again.
    fn resync(&mut self) {
        self.resyncs.add(1);
        log::warn!(
            "kernel_routes: the socket's buffer overflowed (`buffer` is too small for the rate of changes); dumping the tables again"
        );
        if self.dumping.is_some() {
            self.resync_after_dump = true;
        } else {
            self.start_dump(0);
        }
    }
}

impl App for KernelRoutes {
    type Config = KernelRoutesConfig;
    const EXAMPLE: &'static str = "namespace: cp\n";

    fn declare(_: &KernelRoutesConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::source())
    }

    fn new(c: KernelRoutesConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let buffer = c.buffer;
        let socket = match &c.namespace {
            Some(ns) => netdev::in_namespace(ns, move || open(buffer))?,
            None => open(buffer)?,
        };
        let mut app = KernelRoutes {
            socket,
            buf: vec![0; 64 << 10],
            waiting: VecDeque::new(),
            dumping: None,
            resync_after_dump: false,
            seq: 0,
            messages: ctx.counter("messages"),
            resyncs: ctx.counter("resyncs"),
            malformed: ctx.counter("malformed_drops"),
            pool_exhausted: ctx.counter("pool_exhausted_drops"),
            errors: ctx.counter("errors"),
            foreign: ctx.counter("not_from_kernel_drops"),
        };
        app.start_dump(0);
        Ok(app)
    }

    fn pull(&mut self, io: &mut Io) {
        let Some(out) = io.output(0) else { return };
        for _ in 0..READS_PER_BREATH {
            while !self.waiting.is_empty() && !out.is_full() {
                out.transmit(self.waiting.pop_front().expect("not empty"));
            }
            if !self.waiting.is_empty() {
                return; // the reader is behind: the kernel keeps the rest
            }
            // SAFETY: sockaddr_nl is plain data; all zeroes is valid.
            let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            let mut from_len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            // SAFETY: recvfrom writes at most `buf.len()` bytes into the live buffer and at
            // most `from_len` bytes of address into `from`.
            let n = unsafe {
                libc::recvfrom(
                    self.socket.as_raw_fd(),
                    self.buf.as_mut_ptr() as *mut libc::c_void,
                    self.buf.len(),
                    libc::MSG_DONTWAIT,
                    &mut from as *mut libc::sockaddr_nl as *mut libc::sockaddr,
                    &mut from_len,
                )
            };
            if n < 0 {
                match std::io::Error::last_os_error().raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => return,
                    Some(libc::ENOBUFS) => self.resync(),
                    _ => {
                        self.errors.add(1);
                        return;
                    }
                }
                continue;
            }
            if from.nl_pid != 0 {
                // Only the kernel speaks for its tables: another process's message (root may
                // send one to this socket's port) is dropped and counted.
                self.foreign.add(1);
                continue;
            }
            self.take(n as usize);
        }
    }
}
