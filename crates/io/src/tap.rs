//! `tap`: creates (or opens, if it exists) a TAP device so that a graph can hand packets to the
//! host's network stack and take packets from it. `input` goes to the host, `output` comes from
//! it. The device uses a virtio-net header with checksum and TSO offloads enabled: the host
//! hands over large TCP frames with partial checksums in one read; they travel whole through the
//! graph in large buffers (cut into segments only when none is free, or by an output that needs
//! it), and partial checksums travel on to outputs that complete them.
//!
//! The device exists while the app runs (unless it was made persistent with `ip tuntap`). It is
//! owned by Stitch's user (a persistent device's owner is taken over): no other user may attach
//! to it.
//!
//! ```yaml
//! apps:
//!   host: { type: tap, name: stitch0, up: true }
//! ```

use crate::netdev;
use serde::Deserialize;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use stitch_core::packet::{MAX_FRAME, MAX_GSO_FRAME};
use stitch_core::{pool, App, AppContext, AppError, Counter, Descriptors, Io, PortSpec};
use stitch_wire::offload::{self, VnetHdr, VNET_HDR_LEN};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TapConfig {
    /// Device name (at most 15 bytes).
    pub name: String,
    /// Bring the device up.
    #[serde(default = "yes")]
    pub up: bool,
    /// The network namespace the device is made in (a name `ip netns add` gave, or a path):
    /// the host side of a router's interface for a routing daemon, say. Default: Stitch's own.
    pub namespace: Option<String>,
    /// The device's MAC address (default: a random one the kernel picks).
    pub mac: Option<String>,
    /// The device's MTU (default: the kernel's, 1500).
    pub mtu: Option<usize>,
    /// Addresses given to the device, IPv4 or IPv6, each `ADDRESS/PREFIX`.
    #[serde(default)]
    pub addresses: Vec<String>,
}

/// The addresses of `c`, parsed.
fn addresses(c: &TapConfig) -> Result<Vec<(std::net::IpAddr, u8)>, String> {
    (c.addresses.iter())
        .map(|a| {
            let bad = || format!("address `{a}` is not ADDRESS/PREFIX");
            let (addr, len) = a.split_once('/').ok_or_else(bad)?;
            let addr: std::net::IpAddr = addr.parse().map_err(|_| bad())?;
            let len: u8 = len.parse().map_err(|_| bad())?;
            if len > if addr.is_ipv4() { 32 } else { 128 } {
                return Err(bad());
            }
            Ok((addr, len))
        })
        .collect()
}

fn yes() -> bool {
    true
}

/// Most reads and writes per breath (the TAP interface is one syscall per packet).
const BURST: usize = 128;
/// Most segments one TSO frame from the host can become (64 KiB at the smallest usual MSS).
const MAX_SEGMENTS: usize = 128;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x400454d8;
const TUNGETIFF: libc::c_ulong = 0x800454d2;
const TUNSETOWNER: libc::c_ulong = 0x400454cc;
const TUN_F_CSUM: libc::c_uint = 0x01;
const TUN_F_TSO4: libc::c_uint = 0x02;
const TUN_F_TSO6: libc::c_uint = 0x04;

pub struct Tap {
    fd: OwnedFd,
    name: String,
    buf: Vec<u8>,
    rx_malformed: Counter,
    gso_segments: Counter,
    gso_frames: Counter,
    gso_refused: Counter,
    pool_exhausted: Counter,
    tx_errors: Counter,
    /// The longest frame the device takes, read again each second (no limit once the device
    /// was moved to another namespace, where its name does not reach it).
    max_frame: usize,
    last_mtu_read: std::time::Instant,
    in_other_namespace: bool,
    too_big: Counter,
}

fn open(c: &TapConfig) -> Result<OwnedFd, String> {
    let name = &c.name;
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(format!(
            "`{name}` is not a valid interface name (1..15 characters)"
        ));
    }
    // SAFETY: the path is a NUL-terminated literal.
    let fd = unsafe {
        libc::open(
            c"/dev/net/tun".as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOENT) => "no /dev/net/tun: load the tun module (modprobe tun)".into(),
            _ => netdev::explain("cannot open /dev/net/tun", e),
        });
    }
    // SAFETY: open returned a new descriptor (checked above) that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is a C struct of bytes and a union of integers; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads one ifreq from `req`, which is live.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &req) } < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EBUSY) => format!("tap `{name}` is already in use by another process"),
            Some(libc::EINVAL) => format!("`{name}` exists and is not a TAP device"),
            _ => netdev::explain(&format!("cannot create tap `{name}`"), e),
        });
    }
    // Owned by Stitch's user: without an owner the kernel lets any user attach to the device
    // whenever no process holds it (a persistent device between runs), and read what the
    // router punts to its daemon or send as the router.
    // SAFETY: geteuid cannot fail; TUNSETOWNER takes its argument by value.
    if unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            TUNSETOWNER,
            libc::geteuid() as libc::c_ulong,
        )
    } < 0
    {
        return Err(netdev::explain(
            "TUNSETOWNER",
            std::io::Error::last_os_error(),
        ));
    }
    let hdr_len: libc::c_int = VNET_HDR_LEN as libc::c_int;
    // SAFETY: TUNSETVNETHDRSZ reads one c_int from `hdr_len`.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETVNETHDRSZ, &hdr_len) } < 0 {
        return Err(netdev::explain(
            "TUNSETVNETHDRSZ",
            std::io::Error::last_os_error(),
        ));
    }
    let offloads = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6;
    // SAFETY: TUNSETOFFLOAD takes its argument by value; no pointers.
    if unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            libc::TUNSETOFFLOAD,
            offloads as libc::c_ulong,
        )
    } < 0
    {
        return Err(netdev::explain(
            "TUNSETOFFLOAD",
            std::io::Error::last_os_error(),
        ));
    }
    if let Some(mac) = &c.mac {
        let mac = stitch_wire::parse_mac(mac).map_err(|e| format!("tap `{name}`: {e}"))?;
        netdev::set_mac(name, mac)
            .map_err(|e| netdev::explain(&format!("cannot set the MAC of `{name}`"), e))?;
    }
    if let Some(mtu) = c.mtu {
        netdev::set_mtu(name, mtu)
            .map_err(|e| netdev::explain(&format!("cannot set the MTU of `{name}`"), e))?;
    }
    if c.up {
        netdev::set_up(name)
            .map_err(|e| netdev::explain(&format!("cannot bring `{name}` up"), e))?;
    }
    for (addr, len) in addresses(c)? {
        match netdev::add_address(name, addr, len) {
            Ok(()) => {}
            // Already there: a device kept by a restart, or the address given twice.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(netdev::explain(
                    &format!("cannot give `{name}` address {addr}/{len}"),
                    e,
                ))
            }
        }
    }
    Ok(fd)
}

/// The device a predecessor process held (an upgrade): kept open across the hand-over, the
/// device never goes away and its addresses and routes stay. Checked to be TAP `c.name`.
fn adopt(c: &TapConfig, handed: Descriptors) -> Result<OwnedFd, String> {
    let name = &c.name;
    let [fd]: [OwnedFd; 1] = handed.fds.try_into().map_err(|fds: Vec<OwnedFd>| {
        format!("tap `{name}`: {} descriptors handed over, not 1", fds.len())
    })?;
    // SAFETY: ifreq is a C struct of bytes and a union of integers; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    // SAFETY: TUNGETIFF writes one ifreq into `req`, which is live.
    if unsafe { libc::ioctl(fd.as_raw_fd(), TUNGETIFF, &mut req) } < 0 {
        return Err(format!(
            "tap `{name}`: the descriptor handed over is not a TAP device: {}",
            std::io::Error::last_os_error()
        ));
    }
    let held: Vec<u8> = (req.ifr_name.iter())
        .take_while(|&&b| b != 0)
        .map(|&b| b as u8)
        .collect();
    if held != name.as_bytes() {
        return Err(format!(
            "tap `{name}`: the descriptor handed over is tap `{}`",
            String::from_utf8_lossy(&held)
        ));
    }
    Ok(fd)
}

impl App for Tap {
    type Config = TapConfig;
    const EXAMPLE: &'static str = "name: stitch-tap0
up: true
";

    fn declare(c: &TapConfig) -> Result<PortSpec, AppError> {
        if c.name.is_empty() || c.name.len() >= libc::IFNAMSIZ {
            return Err(format!("name `{}` must be 1..15 bytes", c.name).into());
        }
        addresses(c)?;
        if let Some(mac) = &c.mac {
            stitch_wire::parse_mac(mac).map_err(|e| format!("mac: {e}"))?;
        }
        if c.mtu.is_some_and(|m| !(68..=65535).contains(&m)) {
            return Err("mtu must be 68..=65535".into());
        }
        Ok(PortSpec::filter())
    }

    fn new(c: TapConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let (fd, max_frame) = match (ctx.take_inherited(), &c.namespace) {
            (Some(handed), None) => (adopt(&c, handed)?, netdev::max_frame(&c.name)),
            (Some(handed), Some(ns)) => {
                let (c2, name) = (c.clone(), c.name.clone());
                let fd = adopt(&c2, handed)?;
                (
                    fd,
                    netdev::in_namespace(ns, move || Ok(netdev::max_frame(&name)))?,
                )
            }
            (None, None) => (open(&c)?, netdev::max_frame(&c.name)),
            (None, Some(ns)) => {
                let c2 = c.clone();
                netdev::in_namespace(ns, move || {
                    let fd = open(&c2)?;
                    Ok((fd, netdev::max_frame(&c2.name)))
                })?
            }
        };
        Ok(Tap {
            fd,
            name: c.name.clone(),
            // A GSO frame is at most 64 KiB plus headers.
            buf: vec![0; VNET_HDR_LEN + 65536 + 256],
            rx_malformed: ctx.counter("rx_malformed_drops"),
            gso_segments: ctx.counter("gso_segments"),
            gso_frames: ctx.counter("gso_frames"),
            gso_refused: ctx.counter("gso_refused_drops"),
            pool_exhausted: ctx.counter("pool_exhausted_drops"),
            tx_errors: ctx.counter("tx_error_drops"),
            max_frame,
            last_mtu_read: std::time::Instant::now(),
            in_other_namespace: c.namespace.is_some(),
            too_big: ctx.counter("too_big_drops"),
        })
    }

    fn pull(&mut self, io: &mut Io) {
        let Some(out) = io.output(0) else { return };
        // A read may return a 64 KiB TSO frame, i.e. up to MAX_SEGMENTS packets: read only
        // while they would all fit, so that segments never overflow the output link.
        let mut budget = out.room();
        let mut reads = 0;
        while budget >= MAX_SEGMENTS.min(out.ring().capacity()) && reads < BURST {
            reads += 1;
            // SAFETY: the kernel writes at most buf.len() bytes into `buf`, which has that many.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr() as *mut libc::c_void,
                    self.buf.len(),
                )
            };
            if n <= 0 {
                break; // EAGAIN: nothing more now
            }
            let n = n as usize;
            let ts = stitch_core::packet::now_ns();
            let (Some(vnet), true) = (VnetHdr::parse(&self.buf[..n]), n >= VNET_HDR_LEN + 14)
            else {
                self.rx_malformed.add(1);
                continue;
            };
            let frame = &self.buf[VNET_HDR_LEN..n];
            // Super-frames travel whole in a large buffer while one is free.
            let large = if vnet.gso_type != offload::GSO_NONE && frame.len() <= MAX_GSO_FRAME {
                pool::alloc_large()
            } else {
                None
            };
            if let Some(mut p) = large {
                self.gso_frames.add(1);
                let _ = p.set_data(frame);
                p.set_timestamp_ns(ts);
                vnet.apply_to(&mut p);
                out.transmit(p);
                budget -= 1;
                continue;
            }
            if vnet.gso_type != offload::GSO_NONE {
                let mut made = 0;
                match offload::segment(frame, &vnet, ts, |p| {
                    made += 1;
                    out.transmit(p);
                }) {
                    Ok(_) => self.gso_segments.add(made),
                    Err(offload::OffloadError::PoolExhausted) => self.pool_exhausted.add(1),
                    Err(e) => {
                        log::debug!("tap {}: GSO frame refused: {e}", self.name);
                        self.gso_refused.add(1);
                    }
                }
                budget = budget.saturating_sub(made as usize);
                continue;
            }
            if frame.len() > MAX_FRAME {
                self.rx_malformed.add(1);
                continue;
            }
            let Some(mut p) = pool::alloc() else {
                self.pool_exhausted.add(1);
                break;
            };
            let _ = p.set_data(frame);
            p.set_timestamp_ns(ts);
            vnet.apply_to(&mut p);
            out.transmit(p);
            budget -= 1;
        }
    }

    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        let mut hdr = [0u8; VNET_HDR_LEN];
        for p in input.drain().take(BURST) {
            let vnet = VnetHdr::of_packet(&p);
            if vnet.gso_type == offload::GSO_NONE && netdev::frame_too_big(p.data(), self.max_frame)
            {
                self.too_big.add(1);
                continue;
            }
            vnet.write(&mut hdr);
            let iov = [
                libc::iovec {
                    iov_base: hdr.as_mut_ptr() as *mut libc::c_void,
                    iov_len: VNET_HDR_LEN,
                },
                libc::iovec {
                    iov_base: p.data().as_ptr() as *mut libc::c_void,
                    iov_len: p.len(),
                },
            ];
            // SAFETY: both iovecs point at live buffers (`hdr`, the packet's data) of the lengths
            // given; writev only reads them.
            let r = unsafe { libc::writev(self.fd.as_raw_fd(), iov.as_ptr(), 2) };
            if r < 0 {
                self.tx_errors.add(1);
            }
        }
    }

    fn tick(&mut self, _: &mut Io, now: std::time::Instant) {
        // A device in another namespace is not reached by its name from here: its MTU as set.
        if self.in_other_namespace {
            return;
        }
        if now.duration_since(self.last_mtu_read) >= std::time::Duration::from_secs(1) {
            self.last_mtu_read = now;
            self.max_frame = netdev::max_frame_or(&self.name, self.max_frame);
        }
    }

    /// The device's descriptor: a TAP device lives while one is open, so the successor keeps
    /// it with its addresses, routes and the frames queued on it.
    fn hand_over(&mut self) -> Option<Descriptors> {
        Some(Descriptors {
            fds: vec![self.fd.try_clone().ok()?],
            position: serde_json::Value::Null,
        })
    }
}
