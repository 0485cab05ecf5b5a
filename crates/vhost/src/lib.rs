//! `vhost_user`: a virtio-net device for a VM (QEMU) or a DPDK virtio-user process, with the
//! front-end's rings and memory shared with Stitch (as Snabb's snabbnfv does): `input` goes to the
//! guest, what the guest sends comes out of `output`.
//!
//! The port is a vhost-user back-end on `socket`: `mode: server` listens (QEMU
//! `-chardev socket,path=…` without `server=on`, DPDK `--vdev net_virtio_user0,path=…`);
//! `mode: client` connects and keeps reconnecting (QEMU `…,server=on`), so either side may
//! restart. `queues` queue pairs (multiqueue). Rings are polled on the engine's breath (the
//! guest is asked not to kick); the guest is interrupted through its call eventfd once per
//! batch unless it asked not to be. Mergeable receive buffers and indirect descriptors are
//! offered; with `offloads: true` (default) checksum and TSO offloads are negotiated: a
//! packet with a partial checksum or a GSO super-frame is handed to the guest as such when
//! the guest accepted that offload, and completed or segmented first when it did not.
//!
//! Live migration: the port offers dirty logging (VHOST_F_LOG_ALL with a shared log), marks
//! every guest page it writes while QEMU migrates, and announces a guest that arrived (a RARP
//! from its MAC, when QEMU sends SEND_RARP).
//!
//! The socket of a listening port is 0600 and root's, or its `owner`'s (`owner: NAME`, the user
//! a QEMU runs as; `placement: vm` sets it): a connection from anyone else but root is refused.
//!
//! Policy per port, as snabbnfv had it: `port_id`, `mac_address`, `ingress_filter` /
//! `egress_filter` (libpcap syntax; ingress is toward the guest), `rx_rate` / `tx_rate`.
//!
//! A guest that gives descriptors outside its memory, loops in a chain, or indexes past its
//! ring gets that queue stopped with a message and `guest_faults` counted — never a read
//! outside the memory it shared. The queue starts again when the guest sets it up again.
//!
//! ```yaml
//! apps:
//!   vm1: { type: vhost_user, socket: /run/stitch/vm1.sock, mode: server, queues: 1 }
//! links:
//!   - "nic.output -> vm1.input"
//!   - "vm1.output -> nic.input"
//! ```
//!
//! # Map
//!
//! The modules, in short: the `vhost_user` app: `message` (vhost-user requests decoded with every
//! size checked), `device` (the connection thread: features, memory table, rings;
//! `device/handover`: a connected device described for a successor process and built again there),
//! `handover` (the port lent at an upgrade: its connection thread held between messages for the
//! final word), `memory` (the front-end's memory mapped, bounds-checked access), `virtq` (split
//! virtqueues: chains walked with loop and bounds checks); `frontend` (the other side: a virtio-net
//! driver over vhost-user, one receive and one transmit queue in a memfd, polled, for testers
//! outside a device); `direct` (a VM port's frames copied straight into another's receive ring: the
//! switch-over, the copy); the `vm` app (a `vhost_user` port whose QEMU `stitch-place` launches).

pub mod device;
pub mod direct;
pub mod frontend;
mod handover;
pub mod memory;
pub mod message;
pub mod policy;
pub mod virtq;
pub mod vm;

use device::{feature, Device, Endpoint, Shared};
use direct::{Step, VmDirect, VmPort};
use serde::Deserialize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_apps::generator::RateSpec;
use stitch_core::app::AppType;
use stitch_core::{
    pool, App, AppContext, AppError, Counter, Descriptors, Io, Packet, PortSpec, Registry,
};
use stitch_wire::offload::{self, VnetHdr, VNET_HDR_LEN};
use virtq::{prefetch, Segment, Vring};

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Server,
    Client,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostUserConfig {
    /// The vhost-user Unix socket.
    pub socket: PathBuf,
    /// `server`: Stitch listens on `socket` and QEMU connects; `client`: Stitch connects to a
    /// socket QEMU listens on.
    #[serde(default)]
    pub mode: Mode,
    /// Queue pairs (1..=8).
    #[serde(default = "one")]
    pub queues: usize,
    /// Offer checksum and TSO offloads to the guest.
    #[serde(default = "yes")]
    pub offloads: bool,
    /// The port's name in the operator's inventory (shown by `stitch show`).
    pub port_id: Option<String>,
    /// The guest's MAC address: frames from it with another source address, and unicast
    /// frames to it for another address, are dropped.
    pub mac_address: Option<String>,
    /// libpcap filter for frames toward the guest.
    pub ingress_filter: Option<String>,
    /// libpcap filter for frames from the guest.
    pub egress_filter: Option<String>,
    /// Rate limit toward the guest (pps, or text like `"100 Mbit/s"`).
    pub rx_rate: Option<RateSpec>,
    /// Rate limit from the guest.
    pub tx_rate: Option<RateSpec>,
    /// The user whose front-end connects to a listening port (a QEMU that runs as that user:
    /// `placement: vm` sets it to the VM's user): the socket is given to it (0600) and a
    /// connection from anyone else but root is refused. Without it, root's alone.
    pub owner: Option<String>,
}

/// `name`'s uid and primary gid.
fn owner_ids(name: &str) -> Result<(u32, u32), String> {
    match nix::unistd::User::from_name(name) {
        Ok(Some(u)) => Ok((u.uid.as_raw(), u.gid.as_raw())),
        Ok(None) => Err(format!("owner: no user `{name}` on this host")),
        Err(e) => Err(format!("owner: cannot look up user `{name}`: {e}")),
    }
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}

const BURST: usize = 256;
/// Chains taken from a ring before frames are copied from or into them.
const RING_BURST: usize = 32;

/// Largest frame a guest may send without TSO, and with it.
const MAX_FRAME: usize = 9216;
const MAX_GSO_FRAME: usize = 65536 + 256;

pub fn register(r: &mut Registry) {
    r.register(AppType::of::<VhostUser>(
        "vhost_user",
        "a VM's virtio-net port (vhost-user back-end): shared rings, multiqueue, offloads",
    ));
    r.register(AppType::of::<vm::VmPort>(
        "vm",
        "a VM Stitch launches with QEMU on a vhost-user port, restarts when it dies and powers down (placement: vm)",
    ));
}

pub struct VhostUser {
    name: String,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// A duplicate of the listening socket (server mode), to lend at an upgrade.
    listener: Option<OwnedFd>,
    /// Taken over from another process: its connection thread's changes when it lent the
    /// port, which the final word must match.
    lent_changes: Option<u64>,
    /// The connection thread is held between two messages for the final hand-over.
    held: bool,
    /// Chains taken from a ring for a burst: head, first segment, segment count.
    chains: Vec<(u16, usize, usize)>,
    rx_segs: Vec<Segment>,
    /// Packets of a burst toward the guest with their chains: index in the batch, first
    /// chain (the next packet's first chain ends them).
    placed: Vec<(usize, usize)>,
    scratch: Vec<Packet>,
    /// The receive ring of each packet in `scratch`.
    scratch_queues: Vec<u8>,
    to_guest: Counter,
    to_guest_no_buffers: Counter,
    to_guest_too_big: Counter,
    from_guest_malformed: Counter,
    pool_exhausted: Counter,
    guest_faults: Counter,
    interrupts: Counter,
    announcements: Counter,
    gso_segmented: Counter,
    checksums_completed: Counter,
    connections: Counter,
    seen_connections: u64,
    seen_peer_faults: u64,
    port_id: Option<String>,
    /// Whose front-end may connect besides root (`owner`), for `stitch show`.
    owner: Option<String>,
    mac: Option<[u8; 6]>,
    ingress: policy::Direction,
    egress: policy::Direction,
    /// This port as a switch sees it at its links' ends (for direct paths between VMs).
    port: Arc<VmPort>,
    /// `port` as its links' ends say it, and the links tagged so far.
    tagged: stitch_core::link::TaggedEnds,
    /// A direct path from this port's guest to another port's ([`direct`]).
    direct: Option<Arc<VmDirect>>,
    /// The burst of the guest's chains being copied on a direct path: their segments, and
    /// each chain's head and place among them (scratch).
    direct_segs: Vec<Segment>,
    direct_chains: Vec<(u16, usize, usize)>,
    direct_packets: Counter,
}

/// The virtio-net header at the start of a chain's buffers (`hlen` bytes, which they hold):
/// read in place when the first buffer holds it (the usual case), else gathered from the
/// buffers it is split over.
fn read_header(segs: &[Segment], hlen: usize) -> Option<VnetHdr> {
    if segs[0].len as usize >= hlen {
        // SAFETY: every segment was checked against guest memory by Vring::chain.
        return VnetHdr::parse(unsafe { std::slice::from_raw_parts(segs[0].ptr, VNET_HDR_LEN) });
    }
    let mut hdr = [0u8; 12];
    let mut copied = 0;
    for s in segs {
        // SAFETY: as above.
        let b = unsafe { std::slice::from_raw_parts(s.ptr, s.len as usize) };
        let take = (hlen - copied).min(b.len());
        hdr[copied..copied + take].copy_from_slice(&b[..take]);
        copied += take;
        if copied == hlen {
            break;
        }
    }
    VnetHdr::parse(&hdr[..VNET_HDR_LEN])
}

/// Why a guest's receive ring had no room for a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shortage {
    /// No buffers posted: the guest has not caught up.
    Buffers,
    /// Its buffers are too short for the frame (and it takes no mergeable buffers).
    TooBig,
}

/// The virtio-net header (virtio 1.x §5.1.6, 12 bytes with `num_buffers`) as two
/// little-endian words: bytes 0..8 and 8..12 (of which a 10-byte header uses the first two).
fn header_words(v: &VnetHdr, num_buffers: u16) -> (u64, u32) {
    let low = v.flags as u64
        | (v.gso_type as u64) << 8
        | (v.hdr_len as u64) << 16
        | (v.gso_size as u64) << 32
        | (v.csum_start as u64) << 48;
    (low, v.csum_offset as u32 | (num_buffers as u32) << 16)
}

fn signal(call: Option<&OwnedFd>, interrupts: &Counter) {
    if let Some(fd) = call {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to an eventfd.
        unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
        interrupts.add(1);
    }
}

/// Bytes of the virtio-net header the driver uses.
fn header_len(features: u64) -> usize {
    if features & (feature::VERSION_1 | feature::NET_MRG_RXBUF) != 0 {
        12
    } else {
        VNET_HDR_LEN
    }
}

impl App for VhostUser {
    type Config = VhostUserConfig;
    const EXAMPLE: &'static str = r#"socket: /run/stitch/vm1.sock
queues: 2
mac_address: "52:54:00:12:34:56"
rx_rate: "1 Gbit/s"
"#;

    /// A client port's socket is QEMU's: it must be there.
    fn check_host(c: &VhostUserConfig, base_dir: &std::path::Path) -> Vec<String> {
        match c.mode {
            Mode::Client => stitch_core::files::missing("socket", &c.socket, base_dir)
                .into_iter()
                .collect(),
            Mode::Server => Vec::new(),
        }
    }

    fn declare(c: &VhostUserConfig) -> Result<PortSpec, AppError> {
        if !(1..=8).contains(&c.queues) {
            return Err(format!("queues {} (1..=8 queue pairs)", c.queues).into());
        }
        if c.socket.as_os_str().is_empty() {
            return Err("socket: a path is needed".into());
        }
        if let Some(o) = &c.owner {
            owner_ids(o)?;
        }
        if let Some(m) = &c.mac_address {
            stitch_wire::parse_mac(m).map_err(|e| format!("mac_address: {e}"))?;
        }
        for (k, f) in [
            ("ingress_filter", &c.ingress_filter),
            ("egress_filter", &c.egress_filter),
        ] {
            if let Some(f) = f {
                stitch_io::af_packet::compile_filter(f).map_err(|e| format!("{k}: {e}"))?;
            }
        }
        for (k, r) in [("rx_rate", &c.rx_rate), ("tx_rate", &c.tx_rate)] {
            if let Some(r) = r {
                stitch_apps::policer::rate_of(r).map_err(|e| format!("{k}: {e}"))?;
            }
        }
        Ok(PortSpec::filter())
    }

    fn new(c: VhostUserConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let shared = Arc::new(Shared::new(
            ctx.name(),
            c.queues,
            device::offered_features(c.offloads, c.queues),
        ));
        let socket = ctx.path(&c.socket);
        let (sockets, lent_changes) = match ctx.take_inherited() {
            Some(lent) => {
                let (sockets, changes) = handover::adopt(&shared, c.queues, lent)?;
                (sockets, Some(changes))
            }
            None => (device::Sockets::default(), None),
        };
        let mac = match &c.mac_address {
            Some(m) => Some(stitch_wire::parse_mac(m)?),
            None => None,
        };
        let ingress = policy::Direction::new(
            ctx,
            "ingress",
            c.ingress_filter.as_deref(),
            c.rx_rate.as_ref(),
        )?;
        let egress = policy::Direction::new(
            ctx,
            "egress",
            c.egress_filter.as_deref(),
            c.tx_rate.as_ref(),
        )?;
        let port = Arc::new(VmPort {
            shared: shared.clone(),
            slot: std::sync::Mutex::new(None),
            offered: false.into(),
            plain: mac.is_none() && ingress.is_open() && egress.is_open(),
        });
        let connection = device::spawn(
            Endpoint {
                path: socket.clone(),
                server: c.mode == Mode::Server,
                owner: c.owner.as_deref().map(owner_ids).transpose()?,
            },
            shared.clone(),
            sockets,
        )
        .map_err(|e| format!("socket {}: {e}", socket.display()))?;
        Ok(VhostUser {
            name: ctx.name().to_string(),
            shared,
            thread: Some(connection.thread),
            listener: connection.listener,
            lent_changes,
            held: false,
            chains: Vec::with_capacity(64),
            rx_segs: Vec::with_capacity(64),
            placed: Vec::with_capacity(RING_BURST),
            scratch: Vec::with_capacity(BURST * 2),
            scratch_queues: Vec::with_capacity(BURST * 2),
            to_guest: ctx.counter("to_guest_packets"),
            to_guest_no_buffers: ctx.counter("to_guest_no_buffer_drops"),
            to_guest_too_big: ctx.counter("to_guest_too_big_drops"),
            from_guest_malformed: ctx.counter("from_guest_malformed_drops"),
            pool_exhausted: ctx.counter("pool_exhausted_drops"),
            guest_faults: ctx.counter("guest_faults"),
            interrupts: ctx.counter("interrupts"),
            announcements: ctx.counter("announcements"),
            gso_segmented: ctx.counter("gso_segmented"),
            checksums_completed: ctx.counter("checksums_completed"),
            connections: ctx.counter("connections"),
            seen_connections: 0,
            seen_peer_faults: 0,
            port_id: c.port_id,
            owner: c.owner.clone(),
            mac,
            ingress,
            egress,
            tagged: stitch_core::link::TaggedEnds::new(stitch_core::link::EndTag::new(vec![
                port.clone()
            ])),
            port,
            direct: None,
            direct_segs: Vec::with_capacity(BURST * 2),
            direct_chains: Vec::with_capacity(BURST),
            direct_packets: ctx.counter("direct_vm_packets"),
        })
    }

    /// From the guest: its transmit rings (odd indexes) into `output`.
    fn pull(&mut self, io: &mut Io) {
        self.tag_link_ends(io);
        let Some(out) = io.output(0) else { return };
        let step = self.direct_step(out.ring().tx_packets());
        let shared = self.shared.clone();
        let Ok(mut dev) = shared.device.try_lock() else {
            return;
        };
        let hlen = header_len(dev.features);
        if let Some(mac) = dev.announce.take() {
            // As QEMU's self-announcement does: a RARP from the guest's address, so that
            // switches learn where the migrated guest is now.
            if let Some(p) = rarp(mac) {
                out.transmit(p);
                self.announcements.add(1);
            }
        }
        match step {
            Step::Hold => return,
            Step::Direct => {
                if self.copy_direct(&mut dev) {
                    io.moved_off_links();
                }
                return;
            }
            Step::Retired => {}
        }
        for q in (1..dev.queues.len()).step_by(2) {
            let mut fault = None;
            if let Some(device::Live { ring, call, log }) = dev.live(q) {
                let mut budget = BURST.min(out.room());
                // The clock is read only when there is something to stamp: an idle port polled
                // in a busy loop would otherwise spend its time in clock_gettime.
                let mut now = None;
                self.egress.refill();
                // A burst at a time: take the heads and walk their chains first, then copy.
                let mut chains = std::mem::take(&mut self.chains);
                let mut segs = std::mem::take(&mut self.rx_segs);
                while budget > 0 && fault.is_none() {
                    if let Err(f) = ring.take_burst(budget.min(RING_BURST), &mut segs, &mut chains)
                    {
                        fault = Some(f.to_string());
                    }
                    if chains.is_empty() {
                        break;
                    }
                    let now = *now.get_or_insert_with(stitch_core::packet::now_ns);
                    for &(head, first, count) in &chains {
                        if let Some(p) =
                            self.take_from_guest(&segs[first..first + count], hlen, now)
                        {
                            if (self.mac.is_none() && self.egress.is_open())
                                || self.egress.admit(&p, self.mac, true)
                            {
                                out.transmit(p);
                                budget -= 1;
                            }
                        }
                        ring.add_used(head, 0, log);
                    }
                }
                self.chains = chains;
                self.rx_segs = segs;
                if ring.publish(log) {
                    signal(call, &self.interrupts);
                }
            }
            if let Some(why) = fault {
                self.fault(&mut dev, q, why);
            }
        }
    }

    /// To the guest: `input` into its receive rings (even indexes).
    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        let shared = self.shared.clone();
        let Ok(mut dev) = shared.device.try_lock() else {
            return;
        };
        let features = dev.features;
        let hlen = header_len(features);
        let mergeable = features & feature::NET_MRG_RXBUF != 0;
        // Live receive rings, without allocating: at most 8 queue pairs.
        let mut rx = [0usize; 8];
        let mut live = 0;
        for q in (0..dev.queues.len()).step_by(2) {
            if dev.live(q).is_some() {
                rx[live] = q;
                live += 1;
            }
        }
        let rx = &rx[..live];
        if rx.is_empty() {
            // No guest, or it has not set up its rings yet: drop, counted by the link as
            // packets this app took.
            if !input.is_empty() {
                let n = input.drain().count();
                self.to_guest_no_buffers.add(n as u64);
            }
            return;
        }
        // Stage 1: every packet made acceptable to the guest, with its ring.
        let (batch, queue_of) = self.stage_for_guest(input, rx, features);
        // Stage 2: ring by ring, one lookup each.
        for &q in rx {
            let mut delivered = 0;
            let mut fault = None;
            if let Some(device::Live { ring, call, log }) = dev.live(q) {
                // A burst at a time: take the chains of up to RING_BURST packets first,
                // asking for their buffers' lines for writing as they are found, then fill
                // them — so that the cross-core misses of a burst overlap instead of each
                // packet's copy waiting for its own.
                let mut todo = (0..batch.len()).filter(|&i| queue_of[i] as usize == q);
                let mut more = true;
                while more && fault.is_none() {
                    self.chains.clear();
                    self.rx_segs.clear();
                    self.placed.clear();
                    ring.prefetch_descriptors(RING_BURST as u16);
                    while self.placed.len() < RING_BURST {
                        let Some(i) = todo.next() else {
                            more = false;
                            break;
                        };
                        let chains_before = self.chains.len();
                        match self.reserve(ring, hlen + batch[i].len(), mergeable) {
                            Ok(true) => self.placed.push((i, chains_before)),
                            Ok(false) => {}
                            Err(f) => {
                                // The packets placed before it are still delivered.
                                fault = Some(f.to_string());
                                break;
                            }
                        }
                    }
                    for k in 0..self.placed.len() {
                        let (i, from) = self.placed[k];
                        let to = self.placed.get(k + 1).map_or(self.chains.len(), |n| n.1);
                        self.fill(ring, log, &batch[i], from..to, hlen);
                        delivered += 1;
                    }
                }
                if delivered > 0 {
                    if ring.publish(log) {
                        signal(call, &self.interrupts);
                    }
                    // The next burst's buffers, while the guest reads this one.
                    ring.warm(RING_BURST as u16, log.is_some());
                }
            }
            self.to_guest.add(delivered);
            if let Some(why) = fault {
                self.fault(&mut dev, q, why);
            }
        }
        let (mut batch, mut queue_of) = (batch, queue_of);
        batch.clear();
        queue_of.clear();
        self.scratch = batch;
        self.scratch_queues = queue_of;
    }

    fn tick(&mut self, _io: &mut Io, _now: std::time::Instant) {
        let c = self.shared.connections.load(Ordering::Relaxed);
        if c != self.seen_connections {
            self.connections.add(c - self.seen_connections);
            self.seen_connections = c;
        }
        let f = self.shared.faults_found_by_peers.load(Ordering::Relaxed);
        if f != self.seen_peer_faults {
            self.guest_faults.add(f - self.seen_peer_faults);
            self.seen_peer_faults = f;
        }
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    fn hold_for_hand_over(&mut self) {
        self.held = self.shared.hold(handover::HOLD_PATIENCE);
    }

    fn carry_on(&mut self) {
        self.held = false;
        self.shared.paused.store(false, Ordering::SeqCst);
    }

    fn hand_over(&mut self) -> Option<Descriptors> {
        Some(self.lend())
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        self.resume(position)
    }

    fn query(&mut self, _request: &serde_json::Value) -> serde_json::Value {
        let dev = self.shared.device.lock().unwrap();
        let queues: Vec<serde_json::Value> = dev
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                serde_json::json!({
                    "index": i,
                    "direction": if i % 2 == 0 { "to_guest" } else { "from_guest" },
                    "ready": q.ring.is_some(),
                    "fault": q.fault,
                })
            })
            .collect();
        serde_json::json!({
            "port_id": self.port_id,
            "connected": dev.connected,
            "features": format!("{:#x}", dev.features),
            "memory_bytes": dev.mem.as_ref().map(|m| m.total_size()).unwrap_or(0),
            "queues": queues,
            "protocol_errors": self.shared.protocol_errors.load(Ordering::Relaxed),
            "owner": self.owner,
            "refused_connections": self.shared.refused_connections.load(Ordering::Relaxed),
        })
    }
}

/// A RARP request (RFC 903) from `mac`, broadcast, padded to 60 bytes.
fn rarp(mac: [u8; 6]) -> Option<Packet> {
    let mut f = [0u8; 60];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x8035u16.to_be_bytes());
    f[14..22].copy_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 3]); // Ethernet/IPv4, op 3
    f[22..28].copy_from_slice(&mac);
    f[32..38].copy_from_slice(&mac);
    let mut p = pool::alloc()?;
    p.set_data(&f).ok()?;
    Some(p)
}

impl VhostUser {
    /// A burst of `input` admitted by the port's policy and made acceptable to the guest
    /// (offloads it did not negotiate resolved), each with the receive ring of its flow.
    #[inline]
    fn stage_for_guest(
        &mut self,
        input: &mut stitch_core::Consumer,
        rx: &[usize],
        features: u64,
    ) -> (Vec<Packet>, Vec<u8>) {
        let mut batch = std::mem::take(&mut self.scratch);
        let mut queue_of = std::mem::take(&mut self.scratch_queues);
        let open = self.mac.is_none() && self.ingress.is_open();
        self.ingress.refill();
        for p in input.drain().take(BURST) {
            if !open && !self.ingress.admit(&p, self.mac, false) {
                continue;
            }
            let q = if rx.len() == 1 {
                rx[0]
            } else {
                let h = stitch_wire::flow::flow(p.data())
                    .ok()
                    .flatten()
                    .map(|f| f.hash(true))
                    .unwrap_or(0);
                rx[h as usize % rx.len()]
            };
            self.adapt(p, features, &mut batch);
            queue_of.resize(batch.len(), q as u8);
        }
        (batch, queue_of)
    }

    fn fault(&mut self, dev: &mut Device, q: usize, why: String) {
        log::error!(
            "vhost_user {}: queue {q} stopped, the guest broke it: {why} (it restarts when the guest sets the queue up again)",
            self.name
        );
        self.guest_faults.add(1);
        dev.stop_queue(q, why);
    }

    /// One packet from the buffers of one chain (the header first, then the frame).
    fn take_from_guest(&self, segs: &[Segment], hlen: usize, now: u64) -> Option<Packet> {
        let total: usize = segs.iter().map(|s| s.len as usize).sum();
        if total < hlen + 14 || segs.iter().any(|s| s.writable) {
            self.from_guest_malformed.add(1);
            return None;
        }
        let vnet = read_header(segs, hlen)?;
        let frame_len = total - hlen;
        let gso = vnet.gso_type != offload::GSO_NONE;
        if let ([s], false, true) = (segs, gso, frame_len <= MAX_FRAME) {
            // The usual case: header and frame in one buffer, no segmentation.
            let Some(mut p) = pool::alloc() else {
                self.pool_exhausted.add(1);
                return None;
            };
            // An ordinary packet holds MAX_FRAME bytes.
            p.set_len(frame_len).ok()?;
            // SAFETY: the segment lies in guest memory (checked by Vring::chain) and holds
            // `hlen + frame_len` bytes; the packet has just been given room for `frame_len`.
            unsafe {
                stitch_core::copy_bytes(s.ptr.add(hlen), p.data_mut().as_mut_ptr(), frame_len)
            };
            p.set_timestamp_ns(now);
            vnet.apply_to(&mut p);
            return Some(p);
        }
        let p = if frame_len <= MAX_FRAME && !gso {
            pool::alloc()
        } else if gso && frame_len <= MAX_GSO_FRAME {
            pool::alloc_large()
        } else {
            self.from_guest_malformed.add(1);
            return None;
        };
        let Some(mut p) = p else {
            self.pool_exhausted.add(1);
            return None;
        };
        let _ = p.set_len(0);
        // Copy the frame: the stream of all segments after the first `hlen` bytes.
        let mut offset = hlen;
        for s in segs {
            let len = s.len as usize;
            if offset >= len {
                offset -= len;
                continue;
            }
            let n = len - offset;
            let old = p.len();
            if p.set_len(old + n).is_err() {
                self.from_guest_malformed.add(1);
                return None;
            }
            // SAFETY: the segment lies in guest memory (checked by Vring::chain); the packet
            // has just been given room for `n` more bytes.
            unsafe {
                stitch_core::copy_bytes(s.ptr.add(offset), p.data_mut().as_mut_ptr().add(old), n)
            };
            offset = 0;
        }
        p.set_timestamp_ns(now);
        vnet.apply_to(&mut p);
        Some(p)
    }

    /// Makes `p` something the guest accepted (segmented, checksummed) into `self.scratch`.
    fn adapt(&mut self, mut p: Packet, features: u64, out: &mut Vec<Packet>) {
        let h = p.header();
        if h.gso_type != offload::GSO_NONE && h.gso_size != 0 {
            let v6 = h.gso_type & !offload::GSO_ECN == offload::GSO_TCPV6;
            let accepted = if v6 {
                feature::NET_GUEST_TSO6
            } else {
                feature::NET_GUEST_TSO4
            };
            let tcp = matches!(
                h.gso_type & !offload::GSO_ECN,
                offload::GSO_TCPV4 | offload::GSO_TCPV6
            );
            if !(tcp && features & accepted != 0 && features & feature::NET_GUEST_CSUM != 0) {
                let mut made = 0;
                if offload::resolve_gso(p, |s| {
                    made += 1;
                    out.push(s);
                })
                .is_err()
                {
                    self.to_guest_too_big.add(1);
                }
                self.gso_segmented.add(made);
                return;
            }
        } else if p.checksum_state() == stitch_core::packet::ChecksumState::Partial
            && features & feature::NET_GUEST_CSUM == 0
            && offload::complete_checksum(&mut p).is_ok()
        {
            self.checksums_completed.add(1);
        }
        out.push(p);
    }

    /// Takes chains from the receive ring until they hold `total` bytes (one chain without
    /// mergeable buffers), appended to `chains`/`rx_segs`, asking for their buffers' first
    /// lines for writing. Ok(false), with the chains given back, when the ring has no room;
    /// on a fault too `chains`/`rx_segs` are left as they were.
    fn reserve(
        &mut self,
        ring: &mut Vring,
        total: usize,
        mergeable: bool,
    ) -> Result<bool, virtq::Fault> {
        let r = self.reserve_quietly(ring, total, mergeable);
        match r {
            Ok(Some(Shortage::Buffers)) => self.to_guest_no_buffers.add(1),
            Ok(Some(Shortage::TooBig)) => self.to_guest_too_big.add(1),
            _ => {}
        }
        r.map(|short| short.is_none())
    }

    /// [`VhostUser::reserve`], saying why it found no room instead of counting it.
    fn reserve_quietly(
        &mut self,
        ring: &mut Vring,
        total: usize,
        mergeable: bool,
    ) -> Result<Option<Shortage>, virtq::Fault> {
        let (chains_before, segs_before) = (self.chains.len(), self.rx_segs.len());
        let r = self.take_chains(ring, total, mergeable, chains_before);
        if !matches!(r, Ok(None)) {
            self.chains.truncate(chains_before);
            self.rx_segs.truncate(segs_before);
        }
        r
    }

    /// `reserve`'s walk: chains from the ring appended until they hold `total` bytes; the
    /// ones taken since `chains_before` are given back to the ring when it has no room.
    fn take_chains(
        &mut self,
        ring: &mut Vring,
        total: usize,
        mergeable: bool,
        chains_before: usize,
    ) -> Result<Option<Shortage>, virtq::Fault> {
        let mut room = 0usize;
        while room < total {
            let taken = self.chains.len() - chains_before;
            let out_of_buffers = ring.pending() == 0;
            if out_of_buffers || (!mergeable && taken > 0) {
                ring.unget(taken as u16);
                return Ok(Some(match out_of_buffers {
                    true => Shortage::Buffers,
                    false => Shortage::TooBig,
                }));
            }
            let head = ring.next_head()?;
            let first = self.rx_segs.len();
            ring.chain_onto(head, &mut self.rx_segs)?;
            let segs = &self.rx_segs[first..];
            if segs.iter().any(|s| !s.writable) {
                return Err(virtq::Fault::ReadOnlyReceiveBuffer { head });
            }
            for s in segs {
                prefetch(s.ptr, true);
            }
            room += segs.iter().map(|s| s.len as usize).sum::<usize>();
            self.chains.push((head, first, segs.len()));
        }
        Ok(None)
    }

    /// Writes `p`, behind its virtio-net header, into the reserved chains `chains` and
    /// marks them used.
    fn fill(
        &self,
        ring: &mut Vring,
        log: Option<&memory::DirtyLog>,
        p: &Packet,
        chains: std::ops::Range<usize>,
        hlen: usize,
    ) {
        let chains = &self.chains[chains];
        let (low, high) = header_words(&VnetHdr::of_packet(p), chains.len() as u16);
        // The header goes straight into the first buffer when it holds it (always, with the
        // drivers seen so far), built in registers: copied out of a stack array written
        // field by field, its loads could not be forwarded from those narrower stores and
        // waited for the store buffer to drain — behind the previous packet's stores into
        // guest memory — once per packet. Otherwise it is scattered like the frame.
        let first_seg = self.rx_segs[chains[0].1];
        let mut hdr = [0u8; 12];
        let (mut part, mut first_offset) = (0usize, 0usize);
        if first_seg.len as usize >= hlen {
            // SAFETY: the first segment lies in guest memory (checked by Vring::chain) and
            // holds `hlen` (10 or 12) bytes.
            unsafe {
                std::ptr::write_unaligned(first_seg.ptr as *mut u64, low.to_le());
                if hlen == 12 {
                    std::ptr::write_unaligned(first_seg.ptr.add(8) as *mut u32, high.to_le());
                } else {
                    std::ptr::write_unaligned(
                        first_seg.ptr.add(8) as *mut u16,
                        (high as u16).to_le(),
                    );
                }
            }
            let (head, _, count) = chains[0];
            if chains.len() == 1 && count == 1 && log.is_none() {
                // The usual case: the whole frame fits behind the header in one buffer.
                // (`reserve` took chains holding hlen + len bytes, so one buffer holds it.)
                let data = p.data();
                // SAFETY: as above; the buffer holds `hlen + data.len()` bytes.
                unsafe {
                    stitch_core::copy_bytes(data.as_ptr(), first_seg.ptr.add(hlen), data.len())
                };
                ring.add_used(head, (hlen + data.len()) as u32, None);
                return;
            }
            part = 1;
            first_offset = hlen;
        } else {
            hdr[..8].copy_from_slice(&low.to_le_bytes());
            hdr[8..].copy_from_slice(&high.to_le_bytes());
        }
        // Scatter (the rest of) header + frame over the chains' buffers, chain by chain.
        let stream = [&hdr[..hlen], p.data()];
        let mut at = 0usize;
        for &(head, first, count) in chains {
            let mut written = first_offset as u32;
            for s in &self.rx_segs[first..first + count] {
                if let (Some(log), true) = (log, part < stream.len()) {
                    // Marks the whole buffer: cheaper to over-mark than to track how much of
                    // it this frame fills, and only while the guest migrates.
                    log.mark(s.gpa, s.len as u64);
                }
                let mut off = std::mem::take(&mut first_offset);
                while off < s.len as usize && part < stream.len() {
                    let src = &stream[part][at..];
                    let n = src.len().min(s.len as usize - off);
                    // SAFETY: the segment lies in guest memory (checked by Vring::chain).
                    unsafe { stitch_core::copy_bytes(src.as_ptr(), s.ptr.add(off), n) };
                    off += n;
                    at += n;
                    written += n as u32;
                    if at == stream[part].len() {
                        part += 1;
                        at = 0;
                    }
                }
            }
            ring.add_used(head, written, log);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::header_words;
    use stitch_wire::offload::{VnetHdr, VNET_HDR_LEN};

    #[test]
    fn header_words_are_the_header_bytes() {
        let v = VnetHdr {
            flags: 0x01,
            gso_type: 0x04,
            hdr_len: 0x0302,
            gso_size: 0x0504,
            csum_start: 0x0706,
            csum_offset: 0x0908,
        };
        let mut b = [0u8; VNET_HDR_LEN];
        v.write(&mut b);
        let (low, high) = header_words(&v, 0x0b0a);
        let mut words = low.to_le_bytes().to_vec();
        words.extend_from_slice(&high.to_le_bytes());
        assert_eq!(&words[..VNET_HDR_LEN], &b[..]);
        assert_eq!(&words[VNET_HDR_LEN..], &[0x0a, 0x0b]);
    }
}
