//! `af_packet`: attaches a graph to any Linux interface through a packet socket — a receive
//! ring shared with the kernel (no copy or syscall per packet to receive) and a transmit ring
//! (one `sendto` per batch). Works on every interface; the fallback where AF_XDP is unavailable.
//!
//! `ring: v2` (the default) is TPACKET_V2: every frame is handed over the moment the kernel has
//! written it, so forwarding adds microseconds, not the block timeout. `ring: v3` is
//! TPACKET_V3: variable-size frames packed into blocks that are handed over when full or after
//! `block_timeout_ms` (1 ms at least) — deeper buffering for capture-like use, at the cost of up
//! to that much latency per hop (libpcap's "immediate mode" makes the same choice).
//!
//! Offloads: the socket uses a virtio-net header, so packets keep their checksum state
//! (partial checksums are completed by the kernel on the way out or by an app that needs final
//! bytes), and GSO super-frames from veth/TAP senders cross the graph whole in large buffers
//! (`gso: keep`, the default) and leave with their virtio-net header, so the kernel or the
//! receiver segments them — or are cut into MSS-sized segments on entry (`gso: segment`).
//! TCP therefore works through Stitch with the interfaces' default offloads.
//!
//! A frame longer than the interface's MTU takes (read again each second) is dropped and counted
//! as `too_big_drops`; a frame the kernel refuses further on (a veth peer of smaller MTU) as
//! `tx_refused_drops` — the port never stops sending behind it.
//!
//! Several `af_packet` apps on one interface with the same `fanout.group` share its traffic
//! (by flow hash by default), e.g. one per worker. Packets the socket itself sent are ignored.
//! The shards of a sharded `af_packet` (`shards: N`) join one such group by themselves (its
//! number from the app's name and the interface, unless `fanout:` gives one), by the kernel's
//! symmetric flow hash: both directions of a flow reach the same shard.
//!
//! ```yaml
//! apps:
//!   eth0: { type: af_packet, interface: eth0, promisc: true, fanout: { group: 7, mode: hash } }
//! links:
//!   - "eth0.output -> fwd.input"      # received from eth0
//!   - "fwd.output -> eth0.input"      # sent to eth0
//! ```

use crate::kernel_ring::KernelRing;
use crate::netdev::{self, explain, setsockopt};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use stitch_core::mapping::{MapOptions, Mapping};
use stitch_core::packet::{MAX_FRAME, MAX_GSO_FRAME};
use stitch_core::{pool, App, AppContext, AppError, Counter, Descriptors, Io, PortSpec};
use stitch_wire::ethertype;
use stitch_wire::offload::{self, VnetHdr, VNET_HDR_LEN};

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum FanoutMode {
    /// By flow hash: a flow stays on one socket.
    #[default]
    Hash,
    /// Round robin.
    Lb,
    /// By the CPU that received the packet.
    Cpu,
    /// By the NIC's receive queue.
    Qm,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fanout {
    /// The fanout group's number: apps with the same number on one interface share its traffic.
    pub group: u16,
    #[serde(default)]
    pub mode: FanoutMode,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AfPacketConfig {
    /// The Linux interface (`eth0`, a veth end, a bond…); it must exist when the app starts.
    pub interface: String,
    /// Receive frames for every destination, not only this interface's MAC (forwarding needs it).
    #[serde(default = "yes")]
    pub promisc: bool,
    /// Share the interface's traffic with the other `af_packet` apps of the same group (one per
    /// worker, say); a sharded app joins one by itself.
    pub fanout: Option<Fanout>,
    /// Receive ring layout: `v2` (frame by frame, lowest latency) or `v3` (blocks).
    #[serde(default)]
    pub ring: RingVersion,
    /// `v2`: frames in the receive ring (each holds a 64 KiB GSO frame).
    #[serde(default = "default_frames")]
    pub frames: usize,
    /// `v3`: bytes per ring block (a power of two, at least 128 KiB to hold a 64 KiB GSO frame).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// `v3`: blocks in the receive ring.
    #[serde(default = "default_blocks")]
    pub blocks: usize,
    /// `v3`: a partly filled block is handed over after this many milliseconds.
    #[serde(default = "one")]
    pub block_timeout_ms: u32,
    /// A filter in libpcap syntax (as tcpdump takes it), run by the kernel before the ring.
    pub filter: Option<String>,
    /// Leave out packets this host sends on the interface (on for forwarding, off for capture).
    #[serde(default = "yes")]
    pub ignore_outgoing: bool,
    /// GSO super-frames: `keep` them whole through the graph (sent on with their virtio-net
    /// header, segmented by the kernel or the receiver), or `segment` them on entry.
    #[serde(default)]
    pub gso: GsoMode,
    /// A pinned BPF ring buffer (its path in bpffs) the kernel data plane writes this port's
    /// packets into: set by Stitch on the engine end of a kernel ↔ engine boundary, where the
    /// interface then only carries packets toward the kernel.
    pub kernel_ring: Option<std::path::PathBuf>,
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum RingVersion {
    #[default]
    V2,
    V3,
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum GsoMode {
    #[default]
    Keep,
    Segment,
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}
fn default_block_size() -> usize {
    1 << 20
}
fn default_blocks() -> usize {
    32
}
fn default_frames() -> usize {
    512
}

/// A TPACKET_V2 receive frame: 64 KiB of GSO frame behind the headers, whole pages; fifteen
/// of them to a 1 MiB block (the kernel allocates blocks in powers of two of pages).
const V2_FRAME_SIZE: usize = 17 * 4096;
const V2_BLOCK_SIZE: usize = 1 << 20;
const V2_FRAMES_PER_BLOCK: usize = V2_BLOCK_SIZE / V2_FRAME_SIZE;

/// Where frame `i` of a TPACKET_V2 ring starts.
fn v2_frame_offset(i: usize) -> usize {
    i / V2_FRAMES_PER_BLOCK * V2_BLOCK_SIZE + i % V2_FRAMES_PER_BLOCK * V2_FRAME_SIZE
}

/// Frames of a TPACKET_V2 ring of at least `n` frames (whole blocks).
fn v2_frames(n: usize) -> usize {
    n.div_ceil(V2_FRAMES_PER_BLOCK) * V2_FRAMES_PER_BLOCK
}

/// Most packets taken from the ring or sent per breath.
const BURST: usize = 256;
/// Transmit ring: fixed frames big enough for a jumbo frame behind the two headers.
const TX_FRAME_SIZE: usize = 16384;
const TX_FRAMES: usize = 256;
/// Bytes of each transmitted frame the kernel copies into the socket buffer's linear part:
/// the headers any function or the kernel's stack reads (the data plane makes this many
/// linear at its tc hook anyway).
const TX_LINEAR_BYTES: usize = 256;
const TX_BLOCK_SIZE: usize = 4 * TX_FRAME_SIZE;
/// Offset of the data in a transmit frame: `TPACKETx_HDRLEN - sizeof(struct sockaddr_ll)`.
const TX_DATA_OFFSET_V2: usize = 32;
const TX_DATA_OFFSET_V3: usize = 48;
/// Bytes of a frame header read on receive (tpacket3_hdr up to its VLAN fields; more than
/// tpacket2_hdr).
const RX_HEADER_BYTES: usize = 40;
const TP_STATUS_SEND_REQUEST: u32 = 1;
const TP_STATUS_WRONG_FORMAT: u32 = 4;
const TP_STATUS_VLAN_VALID: u32 = 0x10;
const TP_STATUS_VLAN_TPID_VALID: u32 = 0x40;

/// Where the reader is in the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Cursor {
    block: usize,
    /// Packets of the current block already taken, and the offset of the next one.
    taken: u32,
    offset: usize,
}

/// The receive ring's layout and the reader's place in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Rx {
    /// TPACKET_V2: `frames` fixed frames; `next` is the next one to read.
    V2 { frames: usize, next: usize },
    /// TPACKET_V3: blocks of packed frames.
    V3 {
        block_size: usize,
        blocks: usize,
        cursor: Cursor,
    },
}

/// What the kernel says about one received frame (both header versions carry it).
struct RxMeta {
    ts: u64,
    /// Bytes on the wire, and bytes the ring holds (fewer: cut off by the frame size).
    len: usize,
    snaplen: usize,
    mac: usize,
    status: u32,
    vlan_tci: u16,
    vlan_tpid: u16,
}

impl RxMeta {
    /// Reads the `tpacket2_hdr` (`v2`) or `tpacket3_hdr` at `frame`; `None` if the ring
    /// cannot hold one there.
    fn read(ring: &Mapping, frame: usize, v2: bool) -> Option<RxMeta> {
        let h = ring.bytes(frame, RX_HEADER_BYTES)?;
        let rd = |off: usize| u32::from_ne_bytes([h[off], h[off + 1], h[off + 2], h[off + 3]]);
        let rd16 = |off: usize| u16::from_ne_bytes([h[off], h[off + 1]]);
        Some(if v2 {
            RxMeta {
                status: rd(0),
                len: rd(4) as usize,
                snaplen: rd(8) as usize,
                mac: rd16(12) as usize,
                ts: rd(16) as u64 * 1_000_000_000 + rd(20) as u64,
                vlan_tci: rd16(24),
                vlan_tpid: rd16(26),
            }
        } else {
            RxMeta {
                ts: rd(4) as u64 * 1_000_000_000 + rd(8) as u64,
                snaplen: rd(12) as usize,
                len: rd(16) as usize,
                status: rd(20),
                mac: rd16(24) as usize,
                vlan_tci: rd(32) as u16,
                vlan_tpid: rd16(36),
            }
        })
    }
}

pub struct AfPacket {
    fd: OwnedFd,
    /// The receive ring followed by the transmit ring, shared with the kernel.
    ring: Mapping,
    rx: Rx,
    /// Transmit ring frame layout: data offset, and where `tp_status` and `tp_len` are.
    tx_v2: bool,
    /// Start of the transmit ring (after the receive ring in the same mapping).
    tx_ring: usize,
    tx_next: usize,
    /// Which submitted frames the kernel has not yet moved past.
    tx_pending: TxPending,
    /// The longest frame the interface takes (MTU + Ethernet header), read again each second:
    /// a longer frame that is not a GSO super-frame is dropped before the kernel sees it.
    max_frame: usize,
    too_big: Counter,
    /// Frames the kernel refused twice in a row (a drop further on: the veth peer's MTU, a
    /// device that is down), skipped so that the frames behind them go.
    tx_refused: Counter,
    /// What turns a received frame into packets (shared by the ring and the kernel ring).
    rx_path: RxPath,
    /// The engine end of a kernel ↔ engine boundary: what the kernel data plane sends this
    /// port arrives in this BPF ring buffer rather than through the interface.
    kernel_ring: Option<KernelRing>,
    large_tx: OwnedFd,
    last_stats: Instant,
    kernel_drops: Counter,
    tx_errors: Counter,
    interface: String,
}

/// The transmit ring's frames submitted and not yet past the kernel's head, oldest first.
///
/// The kernel sends a ring's frames in order from its head. A frame whose transmission the
/// driver drops (`NET_XMIT_DROP`: a veth whose peer has a smaller MTU) comes back marked
/// `SEND_REQUEST` with the head left on it and `sendto` failing with ENOBUFS: every later
/// `sendto` tries it again and nothing behind it ever goes (`PACKET_LOSS` skips only frames
/// the kernel finds malformed). So the port remembers the frame at the head when a send fails,
/// and when the next send fails on the same frame it makes that frame malformed on purpose —
/// a length longer than a ring frame — which the kernel skips and marks available.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct TxPending {
    oldest: usize,
    count: usize,
    /// The head frame of the last failed send, given one more try.
    suspect: Option<usize>,
}

impl TxPending {
    /// Moves past the frames the kernel is done with (sent, in flight or skipped): everything
    /// before the first frame still marked `SEND_REQUEST`.
    fn advance(&mut self, status_of: impl Fn(usize) -> u32) {
        while self.count > 0 && status_of(self.oldest) != TP_STATUS_SEND_REQUEST {
            self.oldest = (self.oldest + 1) % TX_FRAMES;
            self.count -= 1;
        }
    }

    /// After a failed send (frames already advanced): the frame to refuse now, if the same
    /// frame was at the head of the send before or `refuse_now` says so; else it is remembered
    /// for the next.
    fn after_failure(&mut self, refuse_now: impl Fn(usize) -> bool) -> Option<usize> {
        if self.count == 0 {
            self.suspect = None;
            return None;
        }
        if self.suspect == Some(self.oldest) || refuse_now(self.oldest) {
            self.suspect = None;
            Some(self.oldest)
        } else {
            self.suspect = Some(self.oldest);
            None
        }
    }
}

/// A received frame's way into the graph: whole, or cut into segments when it is a
/// super-frame that cannot be kept whole.
struct RxPath {
    /// Room to re-insert a VLAN tag into a GSO frame before segmenting it.
    scratch: Vec<u8>,
    keep_gso: bool,
    large_exhausted: Counter,
    gso_frames: Counter,
    rx_malformed: Counter,
    gso_segments: Counter,
    gso_refused: Counter,
    pool_exhausted: Counter,
}

/// A raw packet socket for `proto` (network byte order; 0 receives nothing).
pub fn packet_socket(proto: u16) -> Result<OwnedFd, String> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            proto as i32,
        )
    };
    if fd < 0 {
        return Err(explain(
            "cannot open a packet socket",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: socket returned a new descriptor (checked above) that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Binds a packet socket to interface `ifindex` (named `name` in errors).
pub fn bind_to(fd: &OwnedFd, ifindex: u32, proto: u16, name: &str) -> Result<(), String> {
    // SAFETY: sockaddr_ll is a C struct of integers; all zeroes is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: `sll` is a live sockaddr_ll and the length passed is its size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sll as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if r < 0 {
        return Err(explain(
            &format!("af_packet: bind to `{name}`"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The socket, its mapping (receive ring, then transmit ring), and the receive ring's length.
fn open(c: &AfPacketConfig) -> Result<(OwnedFd, Mapping, usize), String> {
    let name = &c.interface;
    let ifindex = netdev::ifindex(name)?;
    let flags = netdev::flags(name).map_err(|e| format!("interface `{name}`: {e}"))?;
    if flags & libc::IFF_UP == 0 {
        return Err(format!(
            "interface `{name}` is down (ip link set {name} up)"
        ));
    }
    // Protocol 0 until the bind below: a socket opened for ETH_P_ALL receives every
    // interface's frames at once, and those that arrive while the rings are set up would leave
    // through this graph (as libpcap does, the protocol is given with the interface).
    let proto = (libc::ETH_P_ALL as u16).to_be();
    let fd = packet_socket(0)?;
    let raw = fd.as_raw_fd();
    set_options(raw, c)?;
    let rx_len = request_rings(raw, c)?;
    // One mapping holds the receive ring followed by the transmit ring.
    let ring_len = rx_len + TX_FRAMES * TX_FRAME_SIZE;
    let locked = MapOptions {
        lock: true,
        ..MapOptions::default()
    };
    let ring = Mapping::shared(fd.as_fd(), ring_len, locked)
        .map_err(|e| explain(&format!("af_packet {name}: mapping the ring"), e))?;
    bind_to(&fd, ifindex, proto, name)?;
    join(raw, c, ifindex)?;
    Ok((fd, ring, rx_len))
}

/// The result of setting socket option `what` on the port's socket, explained.
fn option_set(c: &AfPacketConfig, what: &str, r: std::io::Result<()>) -> Result<(), String> {
    r.map_err(|e| explain(&format!("af_packet {}: {what}", c.interface), e))
}

/// The socket's options before its rings exist: virtio-net headers, ring version, what it
/// hears and how it sends.
fn set_options(raw: std::os::fd::RawFd, c: &AfPacketConfig) -> Result<(), String> {
    let sol = libc::SOL_PACKET;
    let opt = |what: &str, r| option_set(c, what, r);
    opt(
        "PACKET_VNET_HDR",
        setsockopt(raw, sol, libc::PACKET_VNET_HDR, &1i32),
    )?;
    opt(
        "PACKET_VERSION",
        setsockopt(
            raw,
            sol,
            libc::PACKET_VERSION,
            &(match c.ring {
                RingVersion::V2 => libc::tpacket_versions::TPACKET_V2,
                RingVersion::V3 => libc::tpacket_versions::TPACKET_V3,
            } as i32),
        ),
    )?;
    // Our own transmissions would otherwise come back to the ring.
    if c.ignore_outgoing {
        opt(
            "PACKET_IGNORE_OUTGOING",
            setsockopt(raw, sol, libc::PACKET_IGNORE_OUTGOING, &1i32),
        )?;
    }
    if let Some(expr) = &c.filter {
        let prog = compile_filter(expr)?;
        let insns = prog.get_instructions();
        let fprog = libc::sock_fprog {
            len: insns.len() as u16,
            filter: insns.as_ptr() as *mut libc::sock_filter,
        };
        opt(
            "attaching the filter",
            setsockopt(raw, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fprog),
        )?;
    }
    opt(
        "PACKET_QDISC_BYPASS",
        setsockopt(raw, sol, libc::PACKET_QDISC_BYPASS, &1i32),
    )?;
    // Without it a frame the kernel refuses (too long for the interface, a virtio-net header
    // it rejects) stays marked WRONG_FORMAT at the kernel's transmit head, and the kernel sends
    // nothing after it until the ring wraps round to it: one bad frame would silence the port.
    opt(
        "PACKET_LOSS",
        setsockopt(raw, sol, libc::PACKET_LOSS, &1i32),
    )?;
    Ok(())
}

/// Asks for the receive ring (version 2 or 3, as configured) and the transmit ring; returns
/// the receive ring's length in bytes.
fn request_rings(raw: std::os::fd::RawFd, c: &AfPacketConfig) -> Result<usize, String> {
    let sol = libc::SOL_PACKET;
    let opt = |what: &str, r| option_set(c, what, r);
    let tx = (
        TX_BLOCK_SIZE,
        TX_FRAMES * TX_FRAME_SIZE / TX_BLOCK_SIZE,
        TX_FRAME_SIZE,
        TX_FRAMES,
    );
    Ok(match c.ring {
        RingVersion::V2 => {
            let req =
                |(block, blocks, frame, frames): (usize, usize, usize, usize)| libc::tpacket_req {
                    tp_block_size: block as u32,
                    tp_block_nr: blocks as u32,
                    tp_frame_size: frame as u32,
                    tp_frame_nr: frames as u32,
                };
            let frames = v2_frames(c.frames);
            let rx = (
                V2_BLOCK_SIZE,
                frames / V2_FRAMES_PER_BLOCK,
                V2_FRAME_SIZE,
                frames,
            );
            opt(
                "PACKET_RX_RING",
                setsockopt(raw, sol, libc::PACKET_RX_RING, &req(rx)),
            )?;
            opt(
                "PACKET_TX_RING",
                setsockopt(raw, sol, libc::PACKET_TX_RING, &req(tx)),
            )?;
            frames / V2_FRAMES_PER_BLOCK * V2_BLOCK_SIZE
        }
        RingVersion::V3 => {
            let req = |(block, blocks, frame, frames): (usize, usize, usize, usize), tov| {
                libc::tpacket_req3 {
                    tp_block_size: block as u32,
                    tp_block_nr: blocks as u32,
                    tp_frame_size: frame as u32,
                    tp_frame_nr: frames as u32,
                    tp_retire_blk_tov: tov,
                    tp_sizeof_priv: 0,
                    tp_feature_req_word: 0,
                }
            };
            let rx = (c.block_size, c.blocks, 2048, c.block_size * c.blocks / 2048);
            opt(
                "PACKET_RX_RING",
                setsockopt(raw, sol, libc::PACKET_RX_RING, &req(rx, c.block_timeout_ms)),
            )?;
            opt(
                "PACKET_TX_RING",
                setsockopt(raw, sol, libc::PACKET_TX_RING, &req(tx, 0)),
            )?;
            c.block_size * c.blocks
        }
    })
}

/// The receive ring of `c`, before anything was read from it.
fn fresh_rx(c: &AfPacketConfig) -> Rx {
    match c.ring {
        RingVersion::V2 => Rx::V2 {
            frames: v2_frames(c.frames),
            next: 0,
        },
        RingVersion::V3 => Rx::V3 {
            block_size: c.block_size,
            blocks: c.blocks,
            cursor: Cursor {
                block: 0,
                taken: 0,
                offset: 0,
            },
        },
    }
}

/// An `af_packet` port's place in its rings, handed to a successor at an upgrade with the
/// socket and the large-frame socket.
#[derive(Debug, Serialize, Deserialize)]
struct RingPosition {
    rx_len: usize,
    rx: Rx,
    tx_next: usize,
    tx_pending: TxPending,
}

/// The sockets and ring of a port taken over from the process before: its two sockets, the
/// ring mapped again, and where it stood in them. Refused, with the reason, when the rings
/// are not laid out as `c` lays them out (another config, another version's defaults).
fn adopt(
    c: &AfPacketConfig,
    handed: Descriptors,
) -> Result<(OwnedFd, Mapping, OwnedFd, RingPosition), String> {
    let name = &c.interface;
    let refuse = |why: String| format!("af_packet {name}: the socket handed over: {why}");
    let at: RingPosition = serde_json::from_value(handed.position)
        .map_err(|e| refuse(format!("its position does not read: {e}")))?;
    let [fd, large_tx]: [OwnedFd; 2] = handed
        .fds
        .try_into()
        .map_err(|fds: Vec<OwnedFd>| refuse(format!("{} descriptors, not 2", fds.len())))?;
    for s in [&fd, &large_tx] {
        match netdev::socket_domain(s.as_raw_fd()) {
            Ok(libc::AF_PACKET) => {}
            Ok(d) => return Err(refuse(format!("address family {d}, not AF_PACKET"))),
            Err(e) => return Err(refuse(e.to_string())),
        }
    }
    let same_layout = match (at.rx, fresh_rx(c)) {
        (Rx::V2 { frames: a, .. }, Rx::V2 { frames: b, .. }) => a == b,
        (
            Rx::V3 {
                block_size: a,
                blocks: m,
                ..
            },
            Rx::V3 {
                block_size: b,
                blocks: n,
                ..
            },
        ) => a == b && m == n,
        _ => false,
    };
    if !same_layout {
        return Err(refuse(format!(
            "its receive ring is {:?}, this config's is {:?}",
            at.rx,
            fresh_rx(c)
        )));
    }
    let locked = MapOptions {
        lock: true,
        ..MapOptions::default()
    };
    let ring = Mapping::shared(fd.as_fd(), at.rx_len + TX_FRAMES * TX_FRAME_SIZE, locked)
        .map_err(|e| explain(&format!("af_packet {name}: mapping the handed ring"), e))?;
    Ok((fd, ring, large_tx, at))
}

/// The fanout group of the shards of app `app` on `interface`: a number from both names (FNV-1a
/// folded to 16 bits), the same in every process that runs the graph.
fn shard_group(app: &str, interface: &str) -> u16 {
    let h = format!("{app}@{interface}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
    (h ^ h >> 16 ^ h >> 32 ^ h >> 48) as u16
}

/// Promiscuous mode and the fanout group, once the socket is bound.
fn join(raw: std::os::fd::RawFd, c: &AfPacketConfig, ifindex: u32) -> Result<(), String> {
    let sol = libc::SOL_PACKET;
    let opt = |what: &str, r| option_set(c, what, r);
    if c.promisc {
        let mreq = libc::packet_mreq {
            mr_ifindex: ifindex as i32,
            mr_type: libc::PACKET_MR_PROMISC as u16,
            mr_alen: 0,
            mr_address: [0; 8],
        };
        opt(
            "promiscuous mode",
            setsockopt(raw, sol, libc::PACKET_ADD_MEMBERSHIP, &mreq),
        )?;
    }
    if let Some(f) = &c.fanout {
        let mode = match f.mode {
            FanoutMode::Hash => libc::PACKET_FANOUT_HASH,
            FanoutMode::Lb => libc::PACKET_FANOUT_LB,
            FanoutMode::Cpu => libc::PACKET_FANOUT_CPU,
            FanoutMode::Qm => libc::PACKET_FANOUT_QM,
        };
        let arg: u32 = f.group as u32 | (mode << 16);
        opt(
            "PACKET_FANOUT (same group with another mode on this interface?)",
            setsockopt(raw, sol, libc::PACKET_FANOUT, &arg),
        )?;
    }
    Ok(())
}

/// Compiles a libpcap filter expression for Ethernet frames.
pub fn compile_filter(expr: &str) -> Result<pcap::BpfProgram, String> {
    let dead =
        pcap::Capture::dead(pcap::Linktype::ETHERNET).map_err(|e| format!("libpcap: {e}"))?;
    dead.compile(expr, true)
        .map_err(|e| format!("filter `{expr}`: {e}"))
}

/// A second, send-only socket for frames larger than a transmit-ring frame: on a socket with a
/// TX ring, `sendmsg` sends ring frames and ignores its own data. Protocol 0: it receives nothing.
fn open_large_tx(c: &AfPacketConfig) -> Result<OwnedFd, String> {
    let name = &c.interface;
    let fd = packet_socket(0)?;
    let raw = fd.as_raw_fd();
    let opt = |what: &str, r: std::io::Result<()>| {
        r.map_err(|e| explain(&format!("af_packet {name}: {what}"), e))
    };
    opt(
        "PACKET_VNET_HDR",
        setsockopt(raw, libc::SOL_PACKET, libc::PACKET_VNET_HDR, &1i32),
    )?;
    opt(
        "PACKET_QDISC_BYPASS",
        setsockopt(raw, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &1i32),
    )?;
    bind_to(&fd, netdev::ifindex(name)?, 0, name)?;
    Ok(fd)
}

impl AfPacket {
    /// Turns one ring frame into packets on `out`; returns how many it produced.
    /// `frame` is the frame's offset in the ring and `room` the bytes it may span (the rest
    /// of its slot or block): the kernel's offsets are checked against it.
    fn receive_frame(
        &mut self,
        frame: usize,
        room: usize,
        m: &RxMeta,
        out: &mut stitch_core::Producer,
    ) -> usize {
        let RxMeta {
            ts,
            len: wire_len,
            snaplen,
            mac,
            status,
            vlan_tci,
            vlan_tpid,
        } = *m;
        // A frame the ring could not hold whole is not forwarded cut short.
        let inside = mac.checked_add(snaplen).is_some_and(|end| end <= room);
        if mac < VNET_HDR_LEN + 32 || snaplen < 14 || snaplen < wire_len || !inside {
            self.rx_path.rx_malformed.add(1);
            return 0;
        }
        let (Some(vnet_bytes), Some(data)) = (
            self.ring.bytes(frame + mac - VNET_HDR_LEN, VNET_HDR_LEN),
            self.ring.bytes(frame + mac, snaplen),
        ) else {
            self.rx_path.rx_malformed.add(1);
            return 0;
        };
        let vnet = VnetHdr::parse(vnet_bytes).unwrap_or_default();
        // The kernel lifts VLAN tags out of the frame; put them back where they were.
        let vlan = (status & TP_STATUS_VLAN_VALID != 0).then(|| {
            let tpid = if status & TP_STATUS_VLAN_TPID_VALID != 0 {
                vlan_tpid
            } else {
                ethertype::VLAN
            };
            let mut tag = [0u8; 4];
            tag[..2].copy_from_slice(&tpid.to_be_bytes());
            tag[2..].copy_from_slice(&vlan_tci.to_be_bytes());
            tag
        });
        self.rx_path
            .deliver(&self.interface, &vnet, vlan, data, ts, out)
    }

    /// Where transmit frame `i` starts in the mapping.
    #[inline]
    fn tx_frame(&self, i: usize) -> usize {
        self.tx_ring + i * TX_FRAME_SIZE
    }

    /// Where a transmit frame's `tp_len` is: after `tp_status` in tpacket2_hdr, after the next
    /// offset and time in tpacket3_hdr.
    #[inline]
    fn tx_len_at(&self) -> usize {
        if self.tx_v2 {
            4
        } else {
            16
        }
    }

    #[inline]
    fn tx_status(&self, i: usize) -> &AtomicU32 {
        // tp_status: first in tpacket2_hdr, after next offset, time and lengths in tpacket3_hdr.
        let at = if self.tx_v2 { 0 } else { 20 };
        self.ring
            .atomic_u32(self.tx_frame(i) + at)
            .expect("transmit frames lie inside the mapping, 16-aligned")
    }

    /// Packets `frame` turns into, and whether that many fit in `budget`.
    fn fits(&self, frame: usize, m: &RxMeta, budget: usize, capacity: usize) -> bool {
        let need = self.rx_path.packets_needed(m.snaplen, capacity, || {
            (m.mac >= VNET_HDR_LEN)
                .then(|| self.ring.bytes(frame + m.mac - VNET_HDR_LEN, VNET_HDR_LEN))
                .flatten()
                .and_then(VnetHdr::parse)
        });
        need <= budget
    }

    /// The kernel data plane's packets for this port, from its BPF ring buffer. A record
    /// whose segments would not all fit waits for the next breath.
    fn pull_kernel_ring(&mut self, out: &mut stitch_core::Producer, mut budget: usize) {
        let Some(ring) = self.kernel_ring.as_mut() else {
            return;
        };
        if !ring.has_data() {
            return;
        }
        let (rx_path, interface) = (&mut self.rx_path, self.interface.as_str());
        let capacity = out.ring().capacity();
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        ring.consume(|record| {
            let Some(r) = record else {
                rx_path.rx_malformed.add(1);
                return true;
            };
            if rx_path.packets_needed(r.frame.len(), capacity, || Some(r.vnet)) > budget {
                return false;
            }
            let made = rx_path.deliver(interface, &r.vnet, r.vlan, r.frame, ts, out);
            budget = budget.saturating_sub(made.max(1));
            true
        });
    }

    /// TPACKET_V2: frame by frame, each given back as soon as it is read.
    fn pull_v2(&mut self, out: &mut stitch_core::Producer, mut budget: usize) {
        let capacity = out.ring().capacity();
        while budget > 0 {
            let Rx::V2 { frames, next } = self.rx else {
                return;
            };
            let frame = v2_frame_offset(next);
            if status_word(&self.ring, frame).load(Ordering::Acquire) & libc::TP_STATUS_USER == 0 {
                return;
            }
            let Some(m) = RxMeta::read(&self.ring, frame, true) else {
                return;
            };
            if !self.fits(frame, &m, budget, capacity) {
                return;
            }
            let made = self.receive_frame(frame, V2_FRAME_SIZE, &m, out);
            budget = budget.saturating_sub(made.max(1));
            status_word(&self.ring, frame).store(libc::TP_STATUS_KERNEL, Ordering::Release);
            self.rx = Rx::V2 {
                frames,
                next: (next + 1) % frames,
            };
        }
    }

    /// TPACKET_V3: block by block, each given back when all its frames are read.
    fn pull_v3(&mut self, out: &mut stitch_core::Producer, mut budget: usize) {
        let capacity = out.ring().capacity();
        let Rx::V3 {
            block_size, blocks, ..
        } = self.rx
        else {
            return;
        };
        while budget > 0 {
            let Rx::V3 { cursor, .. } = &mut self.rx else {
                return;
            };
            let (b, mut taken, mut offset) = (cursor.block, cursor.taken, cursor.offset);
            let base = b * block_size;
            // tpacket_block_desc: version, offset_to_priv, then hdr.bh1.block_status,
            // num_pkts, offset_to_first_pkt.
            if status_word(&self.ring, base + 8).load(Ordering::Acquire) & libc::TP_STATUS_USER == 0
            {
                break;
            }
            let num = self.ring.read_u32(base + 12).unwrap_or(0);
            if taken == 0 {
                offset = self.ring.read_u32(base + 16).unwrap_or(0) as usize;
            }
            while taken < num {
                // A frame the block cannot hold (a bad offset) ends the block.
                let Some(m) = (offset < block_size)
                    .then(|| RxMeta::read(&self.ring, base + offset, false))
                    .flatten()
                else {
                    self.rx_path.rx_malformed.add(1);
                    break;
                };
                let frame = base + offset;
                if !self.fits(frame, &m, budget, capacity) {
                    if let Rx::V3 { cursor, .. } = &mut self.rx {
                        (cursor.taken, cursor.offset) = (taken, offset);
                    }
                    return;
                }
                let next = self.ring.read_u32(frame).unwrap_or(0) as usize;
                let made = self.receive_frame(frame, block_size - offset, &m, out);
                budget = budget.saturating_sub(made.max(1));
                taken += 1;
                offset += next;
            }
            // Block done: give it back to the kernel.
            status_word(&self.ring, base + 8).store(libc::TP_STATUS_KERNEL, Ordering::Release);
            if let Rx::V3 { cursor, .. } = &mut self.rx {
                *cursor = Cursor {
                    block: (b + 1) % blocks,
                    taken: 0,
                    offset: 0,
                };
            }
        }
    }

    /// Sends one frame with `sendmsg` (for frames larger than a ring frame).
    fn send_one(&mut self, hdr: &mut [u8; VNET_HDR_LEN], data: &[u8]) {
        let iov = [
            libc::iovec {
                iov_base: hdr.as_mut_ptr() as *mut libc::c_void,
                iov_len: VNET_HDR_LEN,
            },
            libc::iovec {
                iov_base: data.as_ptr() as *mut libc::c_void,
                iov_len: data.len(),
            },
        ];
        // SAFETY: msghdr is a C struct of integers and pointers; all zeroes is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = 2;
        // SAFETY: `msg` points at `iov`, whose two entries point at `hdr` and `data`, all alive for
        // the call; sendmsg only reads them.
        if unsafe { libc::sendmsg(self.large_tx.as_raw_fd(), &msg, libc::MSG_DONTWAIT) } < 0 {
            self.tx_errors.add(1);
            log::debug!(
                "af_packet {}: send: {}",
                self.interface,
                std::io::Error::last_os_error()
            );
        }
    }

    /// Asks the kernel to send every frame marked for sending.
    fn kick(&mut self) -> Result<(), i32> {
        // SAFETY: a null buffer of length 0 asks the kernel to send the frames queued in the
        // transmit ring; nothing is read from the pointer.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            let errno = e.raw_os_error().unwrap_or(0);
            if !matches!(errno, libc::EAGAIN | libc::ENOBUFS | libc::EINTR) {
                log::debug!("af_packet {}: send: {e}", self.interface);
            }
            return Err(errno);
        }
        Ok(())
    }

    /// Sends what is queued in the transmit ring; a frame the kernel refuses on two sends in a
    /// row is dropped, counted, and the rest sent after it (see [`TxPending`]).
    /// Within one flush, a frame failing right after a refused one at least as long is refused
    /// at once: a run of frames too long for the peer goes in one flush, not one per breath.
    fn flush(&mut self) {
        let mut refused_len = usize::MAX;
        for _ in 0..TX_FRAMES {
            let sent = self.kick();
            let mut pending = self.tx_pending;
            pending.advance(|i| self.tx_status(i).load(Ordering::Acquire));
            let refuse = match sent {
                Ok(()) => {
                    pending.suspect = None;
                    None
                }
                // The socket's send buffer is full: frames in flight complete and make room.
                Err(libc::EAGAIN) | Err(libc::EINTR) => None,
                Err(_) => pending.after_failure(|i| self.tx_len(i) >= refused_len),
            };
            self.tx_pending = pending;
            let Some(frame) = refuse else { return };
            refused_len = refused_len.min(self.tx_len(frame));
            self.refuse(frame);
        }
    }

    /// The length written into transmit frame `i` (its virtio-net header included).
    fn tx_len(&self, i: usize) -> usize {
        self.ring
            .bytes(self.tx_frame(i) + self.tx_len_at(), 4)
            .map_or(0, |b| u32::from_ne_bytes(b.try_into().unwrap()) as usize)
    }

    /// Makes transmit frame `i` one the kernel skips: a length longer than any ring frame,
    /// which it refuses as malformed and, with `PACKET_LOSS`, marks available.
    fn refuse(&mut self, i: usize) {
        let too_long = (TX_FRAME_SIZE as u32 + 1).to_ne_bytes();
        let written = self
            .ring
            .write(self.tx_frame(i) + self.tx_len_at(), &too_long);
        debug_assert!(written, "a transmit frame's header lies inside the ring");
        self.tx_refused.add(1);
        log::debug!(
            "af_packet {}: the kernel refused a frame twice; dropped",
            self.interface
        );
    }

    /// Whether `p` is longer than the interface takes (GSO super-frames are cut to size by the
    /// kernel or the receiver).
    fn too_big(&self, p: &stitch_core::Packet, vnet: &VnetHdr) -> bool {
        vnet.gso_type == offload::GSO_NONE && netdev::frame_too_big(p.data(), self.max_frame)
    }

    fn read_kernel_stats(&mut self) {
        // SAFETY: tpacket_stats_v3 is three integers; all zeroes is a valid value.
        let mut st: libc::tpacket_stats_v3 = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tpacket_stats_v3>() as u32;
        // SAFETY: the kernel writes at most `len` bytes, the size of `st`, into `st`.
        let r = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                &mut st as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        // The kernel resets its counters on every read: accumulate.
        if r == 0 {
            self.kernel_drops.add(st.tp_drops as u64);
        }
    }
}

/// The status word of a receive frame or block at `at`: frames and blocks lie inside the ring at
/// offsets fixed when it was set up, aligned.
fn status_word(ring: &Mapping, at: usize) -> &AtomicU32 {
    ring.atomic_u32(at)
        .expect("frame and block headers lie inside the mapping, aligned")
}

impl App for AfPacket {
    type Config = AfPacketConfig;
    const EXAMPLE: &'static str = r#"interface: eth0
fanout: { group: 7, mode: hash }
filter: "not port 22"
"#;

    fn check_host(c: &AfPacketConfig, _base_dir: &std::path::Path) -> Vec<String> {
        netdev::ifindex(&c.interface).err().into_iter().collect()
    }

    fn declare(c: &AfPacketConfig) -> Result<PortSpec, AppError> {
        if let Some(expr) = &c.filter {
            compile_filter(expr)?;
        }
        if !c.block_size.is_power_of_two() || c.block_size < (128 << 10) {
            return Err(format!(
                "block_size must be a power of two ≥ 131072, got {}",
                c.block_size
            )
            .into());
        }
        if c.blocks == 0 || c.blocks * c.block_size > (1 << 31) {
            return Err("blocks × block_size must be between one block and 2 GiB".into());
        }
        if !(8..=16384).contains(&c.frames) {
            return Err(format!("frames must be 8..=16384, got {}", c.frames).into());
        }
        Ok(PortSpec::filter())
    }

    fn new(mut c: AfPacketConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        if let Some(shard) = ctx.shard().filter(|s| s.count > 1 && c.fanout.is_none()) {
            c.fanout = Some(Fanout {
                group: shard_group(&shard.of, &c.interface),
                mode: FanoutMode::Hash,
            });
        }
        let (fd, ring, large_tx, at) = match ctx.take_inherited() {
            Some(handed) => adopt(&c, handed)?,
            None => {
                let (fd, ring, rx_len) = open(&c)?;
                let at = RingPosition {
                    rx_len,
                    rx: fresh_rx(&c),
                    tx_next: 0,
                    tx_pending: TxPending::default(),
                };
                (fd, ring, open_large_tx(&c)?, at)
            }
        };
        let kernel_ring = match &c.kernel_ring {
            Some(path) => Some(KernelRing::open(path).map_err(|e| {
                format!(
                    "af_packet {}: kernel ring {}: {e} (Stitch makes it with the kernel data \
                     plane of a mixed graph; is that data plane installed?)",
                    c.interface,
                    path.display()
                )
            })?),
            None => None,
        };
        Ok(AfPacket {
            fd,
            ring,
            rx: at.rx,
            tx_v2: c.ring == RingVersion::V2,
            tx_ring: at.rx_len,
            tx_next: at.tx_next,
            rx_path: RxPath {
                scratch: Vec::with_capacity(65536 + 64),
                keep_gso: c.gso == GsoMode::Keep,
                large_exhausted: ctx.counter("large_pool_exhausted"),
                gso_frames: ctx.counter("gso_frames"),
                rx_malformed: ctx.counter("rx_malformed_drops"),
                gso_segments: ctx.counter("gso_segments"),
                gso_refused: ctx.counter("gso_refused_drops"),
                pool_exhausted: ctx.counter("pool_exhausted_drops"),
            },
            kernel_ring,
            large_tx,
            last_stats: Instant::now(),
            kernel_drops: ctx.counter("kernel_drops"),
            tx_errors: ctx.counter("tx_error_drops"),
            tx_pending: at.tx_pending,
            max_frame: netdev::max_frame(&c.interface),
            too_big: ctx.counter("too_big_drops"),
            tx_refused: ctx.counter("tx_refused_drops"),
            interface: c.interface,
        })
    }

    fn pull(&mut self, io: &mut Io) {
        let Some(out) = io.output(0) else { return };
        let budget = out.room().min(BURST);
        match self.rx {
            Rx::V2 { .. } => self.pull_v2(out, budget),
            Rx::V3 { .. } => self.pull_v3(out, budget),
        }
        if self.kernel_ring.is_some() {
            let budget = out.room().min(BURST);
            self.pull_kernel_ring(out, budget);
        }
    }

    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        let mut queued = 0;
        while queued < BURST {
            let i = self.tx_next;
            let status = self.tx_status(i).load(Ordering::Acquire);
            if status == TP_STATUS_WRONG_FORMAT {
                self.tx_errors.add(1);
            } else if status != libc::TP_STATUS_AVAILABLE {
                break; // ring full: the rest waits in the input link
            }
            let Some(p) = input.receive() else { break };
            let len = p.len();
            let mut hdr = [0u8; VNET_HDR_LEN];
            let mut vnet = VnetHdr::of_packet(&p);
            if self.too_big(&p, &vnet) {
                self.too_big.add(1);
                continue;
            }
            // The kernel copies `hdr_len` bytes into the socket buffer's linear part and
            // attaches the rest as zero-copy fragments of the ring frame; left at 0, only the
            // Ethernet header is linear. Whatever then reads further into the frame — the
            // in-kernel data plane's programs at a kernel ↔ engine boundary, a packet socket
            // on the receiving end — first has the fragments copied (`skb_copy_ubufs`) or
            // pulled into a new head: cheaper to copy the first bytes once here.
            if vnet.hdr_len == 0 {
                vnet.hdr_len = len.min(TX_LINEAR_BYTES) as u16;
            }
            vnet.write(&mut hdr);
            let data_at = if self.tx_v2 {
                TX_DATA_OFFSET_V2
            } else {
                TX_DATA_OFFSET_V3
            };
            if data_at + VNET_HDR_LEN + len > TX_FRAME_SIZE {
                // A super-frame does not fit a ring frame: send what is queued, then it alone.
                if queued > 0 {
                    self.flush();
                    queued = 0;
                }
                self.send_one(&mut hdr, p.data());
                continue;
            }
            let frame = self.tx_frame(i);
            let len_at = self.tx_len_at();
            let tp_len = ((VNET_HDR_LEN + len) as u32).to_ne_bytes();
            let written = self.ring.write(frame + data_at, &hdr)
                && self.ring.write(frame + data_at + VNET_HDR_LEN, p.data())
                && self.ring.write(frame + len_at, &tp_len);
            debug_assert!(
                written,
                "a frame that fits TX_FRAME_SIZE lies inside the ring"
            );
            self.tx_status(i)
                .store(TP_STATUS_SEND_REQUEST, Ordering::Release);
            self.tx_next = (i + 1) % TX_FRAMES;
            self.tx_pending.count += 1;
            queued += 1;
        }
        // A frame refused at the head waits for the next send to be tried again, even when
        // nothing new came.
        if queued > 0 || self.tx_pending.suspect.is_some() {
            self.flush();
        }
    }

    fn tick(&mut self, _: &mut Io, now: Instant) {
        if now.duration_since(self.last_stats) >= Duration::from_secs(1) {
            self.last_stats = now;
            self.read_kernel_stats();
            self.max_frame = netdev::max_frame_or(&self.interface, self.max_frame);
        }
    }

    fn stop(&mut self) {
        self.read_kernel_stats();
    }

    /// Both sockets and the rings' cursors: the successor maps the same rings and reads on
    /// from the next frame, so nothing the kernel queued meanwhile is lost or read twice. A
    /// port fed by a kernel data plane's ring buffer (a mixed graph's boundary) needs nothing
    /// more: the successor opens the pinned ring, whose consumer position is shared.
    fn hand_over(&mut self) -> Option<Descriptors> {
        let at = RingPosition {
            rx_len: self.tx_ring,
            rx: self.rx,
            tx_next: self.tx_next,
            tx_pending: self.tx_pending,
        };
        Some(Descriptors {
            fds: vec![self.fd.try_clone().ok()?, self.large_tx.try_clone().ok()?],
            position: serde_json::to_value(at).ok()?,
        })
    }

    /// The cursors where the predecessor stopped, on the rings this port already maps.
    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        let at: RingPosition = serde_json::from_value(position)
            .map_err(|e| format!("af_packet {}: position: {e}", self.interface))?;
        let same = at.rx_len == self.tx_ring
            && std::mem::discriminant(&at.rx) == std::mem::discriminant(&self.rx)
            && at.tx_next < TX_FRAMES;
        if !same {
            return Err(format!(
                "af_packet {}: the predecessor's rings ({:?}) are not these ({:?})",
                self.interface, at.rx, self.rx
            ));
        }
        self.rx = at.rx;
        self.tx_next = at.tx_next;
        self.tx_pending = at.tx_pending;
        Ok(())
    }
}

impl RxPath {
    /// How many packets a received frame of `len` bytes may become, for taking it only when
    /// they all fit the output link (else it waits where it is): 1 while super-frames stay
    /// whole; else its segments, at most what the link and a burst hold, so that a frame of
    /// more segments than that is still taken rather than waiting forever. `vnet` is read only
    /// when segmenting.
    fn packets_needed(
        &self,
        len: usize,
        capacity: usize,
        vnet: impl FnOnce() -> Option<VnetHdr>,
    ) -> usize {
        if self.keep_gso {
            return 1;
        }
        match vnet() {
            Some(h) if h.gso_type != offload::GSO_NONE && h.gso_size > 0 => {
                len.div_ceil(h.gso_size as usize).min(capacity).min(BURST)
            }
            _ => 1,
        }
    }

    /// Turns one received frame (`vlan`: a tag the kernel lifted out of it) into packets on
    /// `out`; returns how many it produced.
    fn deliver(
        &mut self,
        interface: &str,
        vnet: &VnetHdr,
        vlan: Option<[u8; 4]>,
        data: &[u8],
        ts: u64,
        out: &mut stitch_core::Producer,
    ) -> usize {
        // A super-frame travels whole in a large buffer; it is cut into segments only when
        // asked to, or when no large buffer is free.
        let mut large = None;
        if vnet.gso_type != offload::GSO_NONE && self.keep_gso {
            large = pool::alloc_large();
            match large {
                Some(_) => self.gso_frames.add(1),
                None => self.large_exhausted.add(1),
            }
        }
        if vnet.gso_type != offload::GSO_NONE && large.is_none() {
            // A tagged super-frame is rebuilt in a buffer kept for that, not allocated per frame.
            let mut scratch = std::mem::take(&mut self.scratch);
            let frame_bytes: &[u8] = match vlan {
                None => data,
                Some(tag) => {
                    scratch.clear();
                    scratch.extend_from_slice(&data[..12]);
                    scratch.extend_from_slice(&tag);
                    scratch.extend_from_slice(&data[12..]);
                    &scratch
                }
            };
            let mut n = 0;
            match offload::segment(frame_bytes, vnet, ts, |p| {
                n += 1;
                out.transmit(p);
            }) {
                Ok(_) => self.gso_segments.add(n),
                Err(offload::OffloadError::PoolExhausted) => self.pool_exhausted.add(1),
                Err(e) => {
                    log::debug!("af_packet {interface}: GSO frame refused: {e}");
                    self.gso_refused.add(1);
                }
            }
            self.scratch = scratch;
            return n as usize;
        }
        let len = data.len() + if vlan.is_some() { 4 } else { 0 };
        if len
            > if large.is_some() {
                MAX_GSO_FRAME
            } else {
                MAX_FRAME
            }
        {
            self.rx_malformed.add(1);
            return 0;
        }
        let Some(mut p) = large.or_else(pool::alloc) else {
            self.pool_exhausted.add(1);
            return 0;
        };
        let _ = p.set_len(len);
        let d = p.data_mut();
        match vlan {
            None => d.copy_from_slice(data),
            Some(tag) => {
                d[..12].copy_from_slice(&data[..12]);
                d[12..16].copy_from_slice(&tag);
                d[16..].copy_from_slice(&data[12..]);
            }
        }
        p.set_timestamp_ns(ts);
        vnet.apply_to(&mut p);
        if vlan.is_some() && p.checksum_state() == stitch_core::packet::ChecksumState::Partial {
            p.header_mut().csum_start += 4;
        }
        out.transmit(p);
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_refused_on_two_sends_in_a_row_is_given_up_and_the_rest_go() {
        let status = std::cell::RefCell::new(vec![libc::TP_STATUS_AVAILABLE; TX_FRAMES]);
        let mut pending = TxPending::default();
        // Three frames submitted; the kernel sends the first and stops at the second.
        for i in 0..3 {
            status.borrow_mut()[i] = TP_STATUS_SEND_REQUEST;
            pending.count += 1;
        }
        status.borrow_mut()[0] = libc::TP_STATUS_AVAILABLE;
        let of = |i: usize| status.borrow()[i];
        pending.advance(of);
        assert_eq!((pending.oldest, pending.count), (1, 2));
        assert_eq!(pending.after_failure(|_| false), None, "one more try first");
        assert_eq!(pending.suspect, Some(1));
        pending.advance(of);
        assert_eq!(
            pending.after_failure(|_| false),
            Some(1),
            "the same frame again"
        );
        // The kernel skipped it and sent the third.
        status.borrow_mut()[1] = libc::TP_STATUS_AVAILABLE;
        status.borrow_mut()[2] = libc::TP_STATUS_AVAILABLE;
        pending.advance(of);
        assert_eq!(
            (pending.oldest, pending.count, pending.suspect),
            (3, 0, None)
        );
        assert_eq!(
            pending.after_failure(|_| true),
            None,
            "nothing of ours is waiting"
        );
    }

    #[test]
    fn a_failure_on_another_frame_starts_its_own_count() {
        let mut pending = TxPending {
            oldest: TX_FRAMES - 1,
            count: 2,
            suspect: None,
        };
        assert_eq!(pending.after_failure(|_| false), None);
        // The head moved on (the suspect went after all) and the next frame fails once.
        pending.advance(|i| {
            if i == TX_FRAMES - 1 {
                libc::TP_STATUS_AVAILABLE
            } else {
                TP_STATUS_SEND_REQUEST
            }
        });
        assert_eq!((pending.oldest, pending.count), (0, 1));
        assert_eq!(pending.after_failure(|_| false), None);
        assert_eq!(pending.after_failure(|i| i == 0), Some(0));
    }

    fn rx_path(keep_gso: bool) -> RxPath {
        RxPath {
            scratch: Vec::new(),
            keep_gso,
            large_exhausted: Counter::default(),
            gso_frames: Counter::default(),
            rx_malformed: Counter::default(),
            gso_segments: Counter::default(),
            gso_refused: Counter::default(),
            pool_exhausted: Counter::default(),
        }
    }

    #[test]
    fn a_frame_needs_room_for_its_segments_at_most_a_link_or_a_burst() {
        let tcp = VnetHdr {
            gso_type: offload::GSO_TCPV4,
            gso_size: 1000,
            ..Default::default()
        };
        let (split, whole) = (rx_path(false), rx_path(true));
        assert_eq!(split.packets_needed(64_000, 1024, || Some(tcp)), 64);
        assert_eq!(whole.packets_needed(64_000, 1024, || panic!("not read")), 1);
        assert_eq!(split.packets_needed(1500, 1024, || None), 1);
        let tiny = VnetHdr {
            gso_size: 100,
            ..tcp
        };
        assert_eq!(split.packets_needed(64_000, 1024, || Some(tiny)), BURST);
        assert_eq!(split.packets_needed(64_000, 32, || Some(tiny)), 32);
    }
}
