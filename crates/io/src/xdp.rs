//! The XDP side of AF_XDP: an XSKMAP and the six-instruction program that redirects every
//! packet of a queue to the AF_XDP socket bound to it (anything without a socket goes on to the
//! kernel stack), attached with a BPF link so that it disappears when Stitch closes it.
//!
//! Written against the stable `bpf(2)` ABI rather than through a BPF library: the program is
//! fixed and tiny, and this keeps the interface apps free of the BPF library choice that the
//! in-kernel data plane makes for its C programs.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
pub const XDP_FLAGS_SKB_MODE: u32 = 2;
pub const XDP_FLAGS_DRV_MODE: u32 = 4;
const BPF_FUNC_REDIRECT_MAP: i32 = 51;
const XDP_PASS: i32 = 2;

/// A zeroed `union bpf_attr` with fields written at their offsets (also used by
/// `kernel_ring` to open a pinned ring buffer).
pub(crate) struct Attr([u8; 128]);

impl Attr {
    pub(crate) fn new() -> Attr {
        Attr([0; 128])
    }
    pub(crate) fn u32(mut self, off: usize, v: u32) -> Attr {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    pub(crate) fn u64(mut self, off: usize, v: u64) -> Attr {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn name(mut self, off: usize, n: &str) -> Attr {
        for (i, b) in n.bytes().take(15).enumerate() {
            self.0[off + i] = b;
        }
        self
    }
    /// Runs `bpf(cmd, attr)`.
    ///
    /// # Safety
    /// Every pointer written into the attribute must be valid, for what `cmd` does with it
    /// (reads, or writes of the length given beside it), for the whole call.
    pub(crate) unsafe fn call(&self, cmd: libc::c_long) -> std::io::Result<i64> {
        // SAFETY: the attribute is 128 live bytes; the pointers in it are the caller's word.
        let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, self.0.as_ptr(), self.0.len() as u32) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }
}

/// One eBPF instruction.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | (dst & 0x0f);
    b[2..4].copy_from_slice(&off.to_ne_bytes());
    b[4..8].copy_from_slice(&imm.to_ne_bytes());
    b
}

/// An XSKMAP, the redirect program and its attachment to one interface.
pub struct XdpRedirect {
    map: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
    pub native: bool,
}

impl XdpRedirect {
    /// Loads and attaches the program to `ifindex`: native (driver) mode, or generic (SKB) mode
    /// when `native` is false. `queues` bounds the queue ids the map can hold.
    pub fn attach(
        ifname: &str,
        ifindex: u32,
        native: bool,
        queues: u32,
    ) -> Result<XdpRedirect, String> {
        let attr = Attr::new()
            .u32(0, BPF_MAP_TYPE_XSKMAP)
            .u32(4, 4)
            .u32(8, 4)
            .u32(12, queues.max(1))
            .name(28, "stitch_xsks");
        // SAFETY: the attribute holds no pointers.
        let map = unsafe { attr.call(BPF_MAP_CREATE) }
            .map_err(|e| crate::netdev::explain("cannot create the XSKMAP (bpf)", e))?;
        // SAFETY: BPF_MAP_CREATE returned a new descriptor that nothing else owns.
        let map = unsafe { OwnedFd::from_raw_fd(map as RawFd) };
        let code: Vec<[u8; 8]> = vec![
            insn(0x61, 2, 1, 16, 0),                    // r2 = ctx->rx_queue_index
            insn(0x18, 1, 1, 0, map.as_raw_fd()),       // r1 = &xsks (map fd)
            insn(0, 0, 0, 0, 0),                        //   (second half of ld_imm64)
            insn(0xb7, 3, 0, 0, XDP_PASS),              // r3 = XDP_PASS (when no socket)
            insn(0x85, 0, 0, 0, BPF_FUNC_REDIRECT_MAP), // bpf_redirect_map(r1, r2, r3)
            insn(0x95, 0, 0, 0, 0),                     // return
        ];
        let bytes: Vec<u8> = code.concat();
        let license = c"Dual BSD/GPL";
        let mut log = vec![0u8; 4096];
        let attr = Attr::new()
            .u32(0, BPF_PROG_TYPE_XDP)
            .u32(4, code.len() as u32)
            .u64(8, bytes.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, 1)
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64)
            .name(48, "stitch_xsk")
            .u32(68, BPF_XDP);
        // SAFETY: `bytes`, `license` and `log` (written by the kernel up to its length) outlive the call.
        let prog = unsafe { attr.call(BPF_PROG_LOAD) }.map_err(|e| {
            let verifier = String::from_utf8_lossy(&log);
            crate::netdev::explain(
                &format!(
                    "cannot load the XDP program ({})",
                    verifier.trim_end_matches('\0').trim()
                ),
                e,
            )
        })?;
        // SAFETY: BPF_PROG_LOAD returned a new descriptor that nothing else owns.
        let prog = unsafe { OwnedFd::from_raw_fd(prog as RawFd) };
        let flags = if native {
            XDP_FLAGS_DRV_MODE
        } else {
            XDP_FLAGS_SKB_MODE
        };
        let attr = Attr::new()
            .u32(0, prog.as_raw_fd() as u32)
            .u32(4, ifindex)
            .u32(8, BPF_XDP)
            .u32(12, flags);
        // SAFETY: the attribute holds no pointers.
        let link = unsafe { attr.call(BPF_LINK_CREATE) }
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EBUSY) | Some(libc::EEXIST) => format!(
                    "an XDP program is already attached to `{ifname}` (see `ip link show {ifname}`; \
                     remove it with `ip link set dev {ifname} xdp off` if it is not in use)"
                ),
                Some(libc::EOPNOTSUPP) | Some(libc::EINVAL) if native => format!(
                    "the driver of `{ifname}` has no native XDP ({e}); use `xdp_mode: generic` or the af_packet app"
                ),
                _ => crate::netdev::explain(&format!("cannot attach XDP to `{ifname}`"), e),
            })?;
        // SAFETY: BPF_LINK_CREATE returned a new descriptor that nothing else owns.
        let link = unsafe { OwnedFd::from_raw_fd(link as RawFd) };
        Ok(XdpRedirect {
            map,
            _prog: prog,
            _link: link,
            native,
        })
    }

    /// Duplicates of the map, the program and the link, for a Stitch process taking over: the
    /// program stays attached while any process holds the link.
    pub fn lend(&self) -> std::io::Result<Vec<OwnedFd>> {
        Ok(vec![
            self.map.try_clone()?,
            self._prog.try_clone()?,
            self._link.try_clone()?,
        ])
    }

    /// The redirect a predecessor lent ([`XdpRedirect::lend`]), attached as it is, its map
    /// pointing at the predecessor's sockets.
    pub fn adopt(
        fds: &mut impl Iterator<Item = OwnedFd>,
        native: bool,
    ) -> Result<XdpRedirect, String> {
        let mut next = || {
            fds.next()
                .ok_or("the XDP program's descriptors were not lent")
        };
        Ok(XdpRedirect {
            map: next()?,
            _prog: next()?,
            _link: next()?,
            native,
        })
    }

    /// Directs queue `queue` to socket `xsk`.
    pub fn bind_queue(&self, queue: u32, xsk: RawFd) -> Result<(), String> {
        let (key, value) = (queue, xsk as u32);
        let attr = Attr::new()
            .u32(0, self.map.as_raw_fd() as u32)
            .u64(8, &key as *const u32 as u64)
            .u64(16, &value as *const u32 as u64);
        // SAFETY: `key` and `value` are live u32s, the map's key and value size.
        unsafe { attr.call(BPF_MAP_UPDATE_ELEM) }
            .map(|_| ())
            .map_err(|e| {
                format!("cannot add the AF_XDP socket of queue {queue} to the XSKMAP: {e}")
            })
    }

    /// Stops directing queue `queue` to a socket.
    pub fn unbind_queue(&self, queue: u32) {
        let key = queue;
        let attr = Attr::new()
            .u32(0, self.map.as_raw_fd() as u32)
            .u64(8, &key as *const u32 as u64);
        // SAFETY: `key` is a live u32, the map's key size.
        let _ = unsafe { attr.call(BPF_MAP_DELETE_ELEM) };
    }
}
