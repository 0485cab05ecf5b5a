//! The XDP side of AF_XDP: an XSKMAP and the program that redirects every packet of a queue
//! to the AF_XDP socket bound to it (anything without a socket goes on to the kernel stack),
//! attached with a BPF link so that it disappears when Stitch closes it. With steering rules,
//! the program first runs each rule's filter (translated from classic BPF,
//! `stitch_wire::filter::ebpf`) and sends what a rule matches to that rule's socket for the
//! queue, from a second XSKMAP.
//!
//! Written against the stable `bpf(2)` ABI rather than through a BPF library: the program is
//! generated, not compiled from C, and this keeps the interface apps free of the BPF library
//! choice that the in-kernel data plane makes for its C programs.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;
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
        let mut copy = Attr(self.0);
        // SAFETY: the caller's word, as for `call_mut`.
        unsafe { copy.call_mut(cmd) }
    }

    /// [`Attr::call`] for commands that write their answer into the attribute.
    ///
    /// # Safety
    /// As for [`Attr::call`].
    pub(crate) unsafe fn call_mut(&mut self, cmd: libc::c_long) -> std::io::Result<i64> {
        // SAFETY: the attribute is 128 live bytes; the pointers in it are the caller's word.
        let r =
            unsafe { libc::syscall(libc::SYS_bpf, cmd, self.0.as_mut_ptr(), self.0.len() as u32) };
        if r < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }
}

/// Loads an XDP program (`code` in the kernel's encoding); the error carries the verifier's
/// log.
pub fn load_xdp(code: &[[u8; 8]], name: &str) -> Result<OwnedFd, String> {
    let bytes: Vec<u8> = code.concat();
    let license = c"Dual BSD/GPL";
    let load = |log: &mut [u8]| {
        let attr = Attr::new()
            .u32(0, BPF_PROG_TYPE_XDP)
            .u32(4, code.len() as u32)
            .u64(8, bytes.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, u32::from(!log.is_empty()))
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64)
            .name(48, name)
            .u32(68, BPF_XDP);
        // SAFETY: `bytes`, `license` and `log` (written by the kernel up to its length)
        // outlive the call.
        unsafe { attr.call(BPF_PROG_LOAD) }
    };
    // Without a log first: a long program's log can overflow any buffer, which fails the load.
    let prog = load(&mut []).or_else(|_| {
        let mut log = vec![0u8; 1 << 20];
        load(&mut log).map_err(|e| {
            let verifier = String::from_utf8_lossy(&log);
            let verifier = verifier.trim_end_matches('\0').trim();
            let skip = verifier.chars().count().saturating_sub(2000);
            let tail: String = verifier.chars().skip(skip).collect();
            crate::netdev::explain(&format!("cannot load the XDP program ({tail})"), e)
        })
    })?;
    // SAFETY: BPF_PROG_LOAD returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(prog as RawFd) })
}

/// Runs XDP program `prog` once on `frame` (`BPF_PROG_TEST_RUN`, no interface involved) and
/// returns its verdict.
pub fn test_run(prog: &OwnedFd, frame: &[u8]) -> std::io::Result<u32> {
    test_runs(prog, frame, 1).map(|(verdict, _)| verdict)
}

/// Runs XDP program `prog` `repeat` times on `frame` in the kernel; its verdict and the mean
/// time of a run, ns (the kernel's own timing of the loop).
pub fn test_runs(prog: &OwnedFd, frame: &[u8], repeat: u32) -> std::io::Result<(u32, u32)> {
    let mut out = vec![0u8; frame.len() + 512];
    let mut attr = Attr::new()
        .u32(0, prog.as_raw_fd() as u32)
        .u32(8, frame.len() as u32)
        .u32(12, out.len() as u32)
        .u64(16, frame.as_ptr() as u64)
        .u64(24, out.as_mut_ptr() as u64)
        .u32(32, repeat.max(1));
    // SAFETY: `frame` is read for its length and `out` written up to its length, both live
    // for the call.
    unsafe { attr.call_mut(BPF_PROG_TEST_RUN) }?;
    let word = |at: usize| u32::from_ne_bytes(attr.0[at..at + 4].try_into().unwrap());
    Ok((word(4), word(36)))
}

/// An interface's redirect program with `rules` and its maps, loaded, attached nowhere yet:
/// what [`XdpRedirect::attach`] attaches, and alone what `stitch bench xdp-steer` runs
/// ([`test_runs`]) to measure what the rules cost a frame (its maps empty, a rule's frames
/// fall through to the queue's socket, then to the kernel stack).
pub struct Unattached {
    pub prog: OwnedFd,
    map: OwnedFd,
    steer: Option<OwnedFd>,
    queues: u32,
}

impl Unattached {
    pub fn load(
        rules: &[Vec<stitch_wire::filter::cbpf::Insn>],
        queues: u32,
    ) -> Result<Unattached, String> {
        let queues = queues.max(1);
        let map = xskmap(queues, "stitch_xsks")?;
        let steer = match rules.len() {
            0 => None,
            n => Some(xskmap(n as u32 * queues, "stitch_steer")?),
        };
        let code = redirect_program(&map, steer.as_ref(), rules, queues)?;
        let prog = load_xdp(&code, "stitch_xsk")?;
        Ok(Unattached {
            prog,
            map,
            steer,
            queues,
        })
    }
}

/// An XSKMAP, the redirect program and its attachment to one interface; with steering rules,
/// a second XSKMAP of the sockets each rule sends its frames to.
pub struct XdpRedirect {
    map: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
    pub native: bool,
    /// The rules' sockets, at `rule * queues + queue`.
    steer: Option<OwnedFd>,
    queues: u32,
}

/// An XSKMAP of `entries` sockets.
fn xskmap(entries: u32, name: &str) -> Result<OwnedFd, String> {
    let attr = Attr::new()
        .u32(0, BPF_MAP_TYPE_XSKMAP)
        .u32(4, 4)
        .u32(8, 4)
        .u32(12, entries.max(1))
        .name(28, name);
    // SAFETY: the attribute holds no pointers.
    let map = unsafe { attr.call(BPF_MAP_CREATE) }
        .map_err(|e| crate::netdev::explain("cannot create an XSKMAP (bpf)", e))?;
    // SAFETY: BPF_MAP_CREATE returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(map as RawFd) })
}

/// Puts socket `xsk` at `key` of XSKMAP `map`.
fn put_socket(map: &OwnedFd, key: u32, xsk: RawFd) -> std::io::Result<()> {
    let value = xsk as u32;
    let attr = Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, &key as *const u32 as u64)
        .u64(16, &value as *const u32 as u64);
    // SAFETY: `key` and `value` are live u32s, the map's key and value size.
    unsafe { attr.call(BPF_MAP_UPDATE_ELEM) }.map(|_| ())
}

/// The program: each steering rule in order, a frame it accepts going to the rule's socket
/// for the frame's queue (on to the next rule when there is none), then every other frame to
/// the queue's own socket, or the kernel stack.
fn redirect_program(
    xsks: &OwnedFd,
    steer: Option<&OwnedFd>,
    rules: &[Vec<stitch_wire::filter::cbpf::Insn>],
    queues: u32,
) -> Result<Vec<[u8; 8]>, String> {
    use stitch_wire::filter::ebpf::{Asm, QUEUE_SLOT, R0, R1, R2, R3};
    const XDP_REDIRECT: i32 = 4;
    let mut asm = Asm::new();
    asm.xdp_prologue();
    let own_socket = asm.label();
    if let Some(steer) = steer {
        asm.load_stack(R2, QUEUE_SLOT);
        asm.jump_if_at_least(R2, queues as i32, own_socket);
        for (i, rule) in rules.iter().enumerate() {
            let next = asm.label();
            asm.filter(rule, next)
                .map_err(|e| format!("steering rule {}: {e}", i + 1))?;
            asm.load_map(R1, steer.as_raw_fd());
            asm.load_stack(R2, QUEUE_SLOT);
            asm.add_imm(R2, (i as u32 * queues) as i32);
            asm.mov_imm(R3, 0);
            asm.call(BPF_FUNC_REDIRECT_MAP);
            asm.jump_if_not(R0, XDP_REDIRECT, next);
            asm.exit();
            asm.bind(next);
        }
    }
    asm.bind(own_socket);
    asm.load_map(R1, xsks.as_raw_fd());
    asm.load_stack(R2, QUEUE_SLOT);
    asm.mov_imm(R3, XDP_PASS);
    asm.call(BPF_FUNC_REDIRECT_MAP);
    asm.exit();
    asm.finish()
}

impl XdpRedirect {
    /// Loads and attaches the program to `ifindex`: native (driver) mode, or generic (SKB) mode
    /// when `native` is false. `queues` bounds the queue ids the maps hold; `rules` are the
    /// steering rules' classic BPF programs, in order.
    pub fn attach(
        ifname: &str,
        ifindex: u32,
        native: bool,
        queues: u32,
        rules: &[Vec<stitch_wire::filter::cbpf::Insn>],
    ) -> Result<XdpRedirect, String> {
        let Unattached {
            prog,
            map,
            steer,
            queues,
        } = Unattached::load(rules, queues)?;
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
            steer,
            queues,
        })
    }

    /// Duplicates of the map, the program and the link, for a Stitch process taking over: the
    /// program stays attached while any process holds the link.
    pub fn lend(&self) -> std::io::Result<Vec<OwnedFd>> {
        let mut fds = vec![
            self.map.try_clone()?,
            self._prog.try_clone()?,
            self._link.try_clone()?,
        ];
        if let Some(steer) = &self.steer {
            fds.push(steer.try_clone()?);
        }
        Ok(fds)
    }

    /// The redirect a predecessor lent ([`XdpRedirect::lend`]), attached as it is, its map
    /// pointing at the predecessor's sockets.
    pub fn adopt(
        fds: &mut impl Iterator<Item = OwnedFd>,
        native: bool,
        queues: u32,
        steering: bool,
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
            steer: if steering { Some(next()?) } else { None },
            queues: queues.max(1),
        })
    }

    /// Swaps in a program with new steering `rules` and fresh maps, which `bind` fills (each
    /// queue's socket, each rule's) before the new program replaces the attached one in one
    /// step (`BPF_LINK_UPDATE`): no frame meets a half-filled map, none goes to the kernel
    /// stack on the way. On an error the attached program stays as it was.
    pub fn replace_rules(
        &mut self,
        rules: &[Vec<stitch_wire::filter::cbpf::Insn>],
        bind: impl FnOnce(&XdpRedirect) -> Result<(), String>,
    ) -> Result<(), String> {
        let u = Unattached::load(rules, self.queues)?;
        let staged = XdpRedirect {
            map: u.map,
            _prog: u.prog,
            _link: self
                ._link
                .try_clone()
                .map_err(|e| format!("cannot keep the XDP link: {e}"))?,
            native: self.native,
            steer: u.steer,
            queues: u.queues,
        };
        bind(&staged)?;
        let attr = Attr::new()
            .u32(0, self._link.as_raw_fd() as u32)
            .u32(4, staged._prog.as_raw_fd() as u32);
        // SAFETY: the attribute holds no pointers.
        unsafe { attr.call(BPF_LINK_UPDATE) }
            .map_err(|e| format!("cannot replace the XDP program with the new rules: {e}"))?;
        *self = staged;
        Ok(())
    }

    /// Directs what steering rule `rule` accepts on queue `queue` to socket `xsk`.
    pub fn bind_steered(&self, rule: usize, queue: u32, xsk: RawFd) -> Result<(), String> {
        let steer = self.steer.as_ref().ok_or("no steering rules")?;
        put_socket(steer, rule as u32 * self.queues + queue, xsk).map_err(|e| {
            format!(
                "cannot add the socket of steering rule {} to the map: {e}",
                rule + 1
            )
        })
    }

    /// Directs queue `queue` to socket `xsk`.
    pub fn bind_queue(&self, queue: u32, xsk: RawFd) -> Result<(), String> {
        put_socket(&self.map, queue, xsk).map_err(|e| {
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

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_wire::build::{Frame, Transport};
    use stitch_wire::ethertype;
    use stitch_wire::filter::cbpf::{reference, testing, Insn};
    use stitch_wire::filter::{ebpf::Asm, PacketFilter};

    const XDP_DROP: i32 = 1;

    /// An XDP program that passes the frames `program` accepts and drops the others.
    fn verdict_program(program: &[Insn]) -> OwnedFd {
        let mut asm = Asm::new();
        let miss = asm.label();
        asm.xdp_prologue();
        asm.filter(program, miss).expect("translates");
        asm.ret(XDP_PASS);
        asm.bind(miss);
        asm.ret(XDP_DROP);
        let code = asm.finish().expect("assembles");
        load_xdp(&code, "stitch_test")
            .unwrap_or_else(|e| panic!("the verifier refused {program:?}: {e}"))
    }

    /// Whether the kernel, running the translation, accepts `frame`.
    fn kernel_accepts(prog: &OwnedFd, frame: &[u8]) -> bool {
        match test_run(prog, frame).expect("BPF_PROG_TEST_RUN") as i32 {
            XDP_PASS => true,
            XDP_DROP => false,
            other => panic!("verdict {other}"),
        }
    }

    fn require_root() {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(
            uid, 0,
            "loading XDP programs needs root (the project's tests run as root)"
        );
    }

    /// Frames of the kinds a steering rule looks at, and each damaged and cut short.
    fn frames(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
        let whole = [
            Frame::ipv4([10, 0, 0, 1], [10, 0, 0, 2], Transport::udp(5000, 4789)).payload_len(50),
            Frame::ipv4([10, 1, 2, 3], [192, 168, 0, 9], Transport::tcp(40000, 80))
                .payload(b"GET / HTTP/1.1\r\n"),
            Frame::ipv4([10, 0, 0, 1], [224, 0, 0, 5], Transport::echo_request(7, 1)),
            Frame::ipv6(
                [0xfd00, 0, 0, 0, 0, 0, 0, 1],
                [0xfd00, 0, 0, 0, 0, 0, 0, 2],
                Transport::udp(53, 4789),
            ),
            Frame::ipv6(
                [0xfd00, 0, 0, 0, 0, 0, 0, 1],
                [0xfd00, 0, 0, 0, 0, 0, 0, 2],
                Transport::tcp(22, 1234),
            )
            .payload_len(900),
        ];
        let mut out = Vec::new();
        for f in whole.iter().map(Frame::bytes) {
            out.push(f.clone());
            // An 802.1Q tag (VLAN 100) in front of the EtherType.
            let mut tagged = f[..12].to_vec();
            tagged.extend([0x81, 0x00, 0x00, 100]);
            tagged.extend(&f[12..]);
            out.push(tagged);
            // A fragment that is not the first.
            if f[12..14] == ethertype::IPV4.to_be_bytes() {
                let mut fragment = f.clone();
                fragment[20] = 0x00;
                fragment[21] = 0x10;
                out.push(fragment);
            }
            for _ in 0..6 {
                let mut damaged = f.clone();
                for _ in 0..rng.usize(1..4) {
                    let at = rng.usize(12..damaged.len());
                    damaged[at] = rng.u8(..);
                }
                damaged.truncate(rng.usize(14..=damaged.len()));
                out.push(damaged);
            }
        }
        out
    }

    #[test]
    fn filter_expressions_steer_in_the_kernel_as_libpcap_decides() {
        require_root();
        let mut rng = fastrand::Rng::with_seed(4789);
        let frames = frames(&mut rng);
        let expressions = [
            "udp and dst port 4789",
            "ip and udp",
            "tcp port 80 and tcp[((tcp[12:1] & 0xf0) >> 2):4] = 0x47455420",
            "ip6 and tcp",
            "vlan 100 and udp",
            "vlan and ip6",
            "icmp or arp",
            "ip[6:2] & 0x1fff = 0",
            "net 10.0.0.0/8 and not host 10.0.0.2",
            "ip multicast",
            "ether host 02:00:00:00:00:01 or ether broadcast",
            "len > 100",
            "greater 200 and less 1000",
            "portrange 1000-2000 or port 22",
            "ip proto 17 or ip6 proto 17",
            "udp[8:2] = 0x0800",
            "ip[0] & 0xf != 5",
            "tcp[tcpflags] & (tcp-syn|tcp-ack) != 0",
        ];
        for expression in expressions {
            let filter = PacketFilter::compile(expression).unwrap();
            let program = filter.instructions();
            let prog = verdict_program(&program);
            for frame in &frames {
                assert_eq!(
                    kernel_accepts(&prog, frame),
                    filter.matches_interpreted(frame),
                    "`{expression}` on {frame:02x?}"
                );
            }
        }
    }

    #[test]
    fn random_programs_decide_in_the_kernel_as_libpcap_interprets() {
        require_root();
        let mut rng = fastrand::Rng::with_seed(17);
        // An interface never gives XDP a frame shorter than an Ethernet header.
        let frames: Vec<Vec<u8>> = std::iter::repeat_with(|| testing::random_frame(&mut rng))
            .filter(|f| f.len() >= 14)
            .take(48)
            .collect();
        for _ in 0..3000 {
            let program = testing::random_program(&mut rng);
            assert!(reference::valid(&program), "{program:?}");
            let prog = verdict_program(&program);
            for frame in &frames {
                assert_eq!(
                    kernel_accepts(&prog, frame),
                    reference::interpret(&program, frame),
                    "{program:?} on {frame:02x?}"
                );
            }
        }
    }
}
