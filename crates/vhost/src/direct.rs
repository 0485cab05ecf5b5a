//! Direct paths between VM ports — the inter-VNF bypass (docs/references.md) for VMs. When a
//! switch's rules send everything VM port A's guest sends to VM port B, A's worker moves each frame
//! from A's transmit ring straight into B's receive ring: one copy, guest memory to guest memory,
//! no packet buffer, no table walk. The guests see nothing (virtio-net in Linux, DPDK's
//! virtio-user).
//!
//! The switch-over keeps order and loses nothing, one step per actor:
//!
//! 1. **Offered**: the switch puts a [`VmDirect`] in A's slot.
//! 2. **DrainingA**: A stops sending to its link, noting how many it had sent (`a_sent`).
//! 3. **DrainingSwitch**: once the switch has consumed those (and forwarded them), it notes how
//!    many it had sent toward B (`switch_sent`).
//! 4. **Direct**: once B has taken those from its link into its ring, A copies straight into
//!    B's ring. Both devices' locks are held for the copy (B's taken with `try_lock`: a busy
//!    B waits a breath), so B's own pushes and A's copies never interleave within a ring.
//! 5. **Retired**: the rules changed, a port went, a guest's offloads no longer fit — `end`;
//!    A goes back to its link at its next breath. Its copies are synchronous, so nothing is in
//!    flight: what it copied is in B's ring before anything it sends through the switch after.
//!
//! A counts what it copies (`packets`, `bytes`); the switch adds it to the flow's, tables' and
//! ports' OpenFlow statistics, so `ovs-ofctl dump-flows` shows the same counts either way.

use crate::device::{feature, Shared};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use stitch_core::link::Ring;

pub const OFFERED: u32 = 0;
pub const DRAINING_A: u32 = 1;
pub const DRAINING_SWITCH: u32 = 2;
pub const DIRECT: u32 = 3;
pub const RETIRED: u32 = 4;

/// What a VM port says of itself on its links' ends, for a switch that joins two of them.
pub struct VmPort {
    pub shared: Arc<Shared>,
    /// A path from this port, put here by the switch that offers it.
    pub slot: Mutex<Option<Arc<VmDirect>>>,
    /// Set with the slot: the port looks at it at its next breath (one load until then).
    pub offered: AtomicBool,
    /// The port has no policy of its own (MAC check, filters, rates) that a direct path
    /// would skip.
    pub plain: bool,
}

impl VmPort {
    /// Puts `d` in the slot for the port to take at its next breath.
    pub fn offer(&self, d: Arc<VmDirect>) {
        *self.slot.lock().unwrap() = Some(d);
        self.offered.store(true, Ordering::Release);
    }

    /// Frees the slot if it still holds `d`.
    pub fn forget(&self, d: &Arc<VmDirect>) {
        let mut slot = self.slot.lock().unwrap();
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, d)) {
            *slot = None;
        }
    }

    /// The features the guest negotiated, and whether it has live rings; `None` while the
    /// connection thread holds the device.
    pub fn guest(&self) -> Option<(u64, bool)> {
        let mut dev = self.shared.device.try_lock().ok()?;
        let live = dev.connected && (0..dev.queues.len()).any(|q| dev.live(q).is_some());
        Some((dev.features, live))
    }
}

/// A direct path from port `from` to port `to`.
pub struct VmDirect {
    pub from: Arc<VmPort>,
    pub to: Arc<VmPort>,
    /// The switch's link toward `to`: how much of it `to` has taken.
    pub to_link: Arc<Ring>,
    pub phase: AtomicU32,
    pub a_sent: AtomicU64,
    pub switch_sent: AtomicU64,
    pub end: AtomicBool,
    /// Copied straight into `to`'s ring (A writes, the switch reads).
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    /// Frames too long for `to`'s receive buffers, dropped on the way.
    pub too_big: AtomicU64,
    offered_at: Instant,
    /// How long the switch-over took, ns (0 until it did).
    pub handover_ns: AtomicU64,
    /// When `end` was asked (ns since the offer), and how long A took to go back (0 until).
    ended_at_ns: AtomicU64,
    pub handback_ns: AtomicU64,
}

impl VmDirect {
    pub fn new(from: Arc<VmPort>, to: Arc<VmPort>, to_link: Arc<Ring>) -> Arc<VmDirect> {
        Arc::new(VmDirect {
            from,
            to,
            to_link,
            phase: OFFERED.into(),
            a_sent: 0.into(),
            switch_sent: 0.into(),
            end: false.into(),
            packets: 0.into(),
            bytes: 0.into(),
            too_big: 0.into(),
            offered_at: Instant::now(),
            handover_ns: 0.into(),
            ended_at_ns: 0.into(),
            handback_ns: 0.into(),
        })
    }

    pub fn phase(&self) -> u32 {
        self.phase.load(Ordering::Acquire)
    }

    /// Asks A to go back to its link.
    pub fn end(&self) {
        let now = self.offered_at.elapsed().as_nanos() as u64;
        let _ = (self.ended_at_ns).compare_exchange(
            0,
            now.max(1),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.end.store(true, Ordering::Release);
    }

    /// Ended but A has not gone back yet: the old rules' traffic may still take it.
    pub fn is_draining(&self) -> bool {
        self.end.load(Ordering::Acquire) && self.phase() != RETIRED
    }

    /// The switch's step: once it consumed the `a_sent` packets A sent before it stopped
    /// (`consumed` from A's link, everything consumed already forwarded), it notes how many
    /// it has sent toward B (`sent`).
    pub fn switch_progress(&self, consumed: u64, sent: u64) {
        if self.phase() == DRAINING_A && consumed >= self.a_sent.load(Ordering::Acquire) {
            self.switch_sent.store(sent, Ordering::Release);
            self.phase.store(DRAINING_SWITCH, Ordering::Release);
        }
    }

    /// A's step at the start of a breath, `sent` being what A has sent to its link so far.
    pub fn sender_step(&self, sent: u64) -> Step {
        if self.end.load(Ordering::Acquire) {
            let now = self.offered_at.elapsed().as_nanos() as u64;
            let asked = self.ended_at_ns.load(Ordering::Relaxed);
            self.handback_ns
                .store(now.saturating_sub(asked).max(1), Ordering::Relaxed);
            self.phase.store(RETIRED, Ordering::Release);
            return Step::Retired;
        }
        match self.phase() {
            OFFERED => {
                self.a_sent.store(sent, Ordering::Release);
                self.phase.store(DRAINING_A, Ordering::Release);
                Step::Hold
            }
            DRAINING_SWITCH
                if self.to_link.rx_packets() >= self.switch_sent.load(Ordering::Acquire) =>
            {
                let took = self.offered_at.elapsed().as_nanos() as u64;
                self.handover_ns.store(took.max(1), Ordering::Relaxed);
                self.phase.store(DIRECT, Ordering::Release);
                Step::Direct
            }
            DIRECT => Step::Direct,
            _ => Step::Hold,
        }
    }
}

/// What A does with its guest's frames this breath.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Straight into B's ring.
    Direct,
    /// Leaves them in the guest's ring for a moment (the switch-over).
    Hold,
    /// Through its link, as before.
    Retired,
}

/// Whether every frame a guest with `from` features may send can go to a guest with `to`
/// features as it is: offloads A's guest may use (partial checksums, TSO) are ones B's guest
/// accepts.
pub fn offloads_fit(from: u64, to: u64) -> bool {
    let needs = [
        (feature::NET_CSUM, feature::NET_GUEST_CSUM),
        (feature::NET_HOST_TSO4, feature::NET_GUEST_TSO4),
        (feature::NET_HOST_TSO6, feature::NET_GUEST_TSO6),
    ];
    needs
        .iter()
        .all(|&(sends, takes)| from & sends == 0 || to & takes != 0)
}

/// What became of one frame on a direct path.
enum Copied {
    /// In the other guest's ring, this long.
    Frame(usize),
    /// Malformed or too big for the other guest's buffers: counted and dropped.
    Dropped,
    /// The other guest has no buffer free: the frame waits.
    NoRoom,
}

/// Which side's guest broke its ring during a copy.
enum Broken {
    From(String),
    To(String),
}

impl crate::VhostUser {
    /// Says on each of its links "a VM port is here", so that a switch at the other end can
    /// join it to another directly.
    pub(crate) fn tag_link_ends(&mut self, io: &mut stitch_core::Io) {
        io.tag_ends(&mut self.tagged);
    }

    /// Takes a path a switch offered, and follows its switch-over; `sent` is what this port
    /// has sent to its link so far.
    pub(crate) fn direct_step(&mut self, sent: u64) -> Step {
        if self.port.offered.load(Ordering::Relaxed)
            && self.port.offered.swap(false, Ordering::AcqRel)
        {
            self.direct = self.port.slot.lock().unwrap().clone();
        }
        let Some(d) = &self.direct else {
            return Step::Retired;
        };
        let step = d.sender_step(sent);
        if step == Step::Retired {
            let d = self.direct.take().expect("a path");
            self.port.forget(&d);
        }
        step
    }

    /// Moves what this port's guest sent straight into the other port's receive ring; whether
    /// it moved any. A busy other port is tried again next breath; one whose guest is gone, or
    /// whose offloads no longer fit, ends the path (the switch's path drops and counts what it
    /// cannot deliver).
    pub(crate) fn copy_direct(&mut self, from: &mut crate::Device) -> bool {
        let d = self.direct.clone().expect("a path");
        let Ok(mut to) = d.to.shared.device.try_lock() else {
            return false;
        };
        if !offloads_fit(from.features, to.features) {
            d.end();
            return false;
        }
        let Some(qb) = (0..to.queues.len())
            .step_by(2)
            .find(|&q| to.live(q).is_some())
        else {
            d.end();
            return false;
        };
        let before = d.packets.load(Ordering::Relaxed);
        let (hlen_a, hlen_b) = (
            crate::header_len(from.features),
            crate::header_len(to.features),
        );
        let mergeable = to.features & feature::NET_MRG_RXBUF != 0;
        for qa in (1..from.queues.len()).step_by(2) {
            let Some(a) = from.live(qa) else { continue };
            let b = to.live(qb).expect("live above");
            match self.copy_ring(a, b, (hlen_a, hlen_b), mergeable, &d) {
                Ok(()) => {}
                Err(Broken::From(why)) => self.fault(from, qa, why),
                Err(Broken::To(why)) => {
                    log::error!(
                        "vhost_user {}: queue {qb} stopped, the guest broke it: {why} (found by a direct path from {}; it restarts when the guest sets the queue up again)",
                        d.to.shared.name,
                        self.name
                    );
                    (d.to.shared.faults_found_by_peers).fetch_add(1, Ordering::Relaxed);
                    to.stop_queue(qb, why);
                    d.end();
                    return false;
                }
            }
        }
        d.packets.load(Ordering::Relaxed) != before
    }

    /// One burst from transmit ring `a` into receive ring `b`; `hlens` are the two guests'
    /// virtio-net header lengths. The burst's chains are walked first
    /// ([`crate::Vring::take_burst`]), then copied one by one.
    fn copy_ring(
        &mut self,
        a: crate::device::Live<'_>,
        mut b: crate::device::Live<'_>,
        hlens: (usize, usize),
        mergeable: bool,
        d: &VmDirect,
    ) -> Result<(), Broken> {
        let mut segs = std::mem::take(&mut self.direct_segs);
        let mut chains = std::mem::take(&mut self.direct_chains);
        let gathered = a.ring.take_burst(crate::BURST, &mut segs, &mut chains);
        let mut result = gathered.map_err(|f| Broken::From(f.to_string()));
        b.ring.prefetch_descriptors(chains.len() as u16);
        let (mut packets, mut bytes) = (0u64, 0u64);
        for (k, &(head, first, count)) in chains.iter().enumerate() {
            match self.copy_chain(&segs[first..first + count], hlens, &mut b, mergeable, d) {
                Ok(Copied::Frame(len)) => {
                    packets += 1;
                    bytes += len as u64;
                }
                Ok(Copied::Dropped) => {}
                Ok(Copied::NoRoom) => {
                    // The other guest has not caught up: the rest wait in this one's ring.
                    a.ring.unget((chains.len() - k) as u16);
                    break;
                }
                Err(broken) => {
                    a.ring.unget((chains.len() - k) as u16);
                    result = Err(broken);
                    break;
                }
            }
            a.ring.add_used(head, 0, a.log);
        }
        self.direct_segs = segs;
        self.direct_chains = chains;
        if packets > 0 {
            if b.ring.publish(b.log) {
                crate::signal(b.call, &self.interrupts);
            }
            d.packets.fetch_add(packets, Ordering::Relaxed);
            d.bytes.fetch_add(bytes, Ordering::Relaxed);
            self.direct_packets.add(packets);
        }
        if a.ring.publish(a.log) {
            crate::signal(a.call, &self.interrupts);
        }
        result
    }

    /// One frame of the sending guest (its chain `chain`) into the receiving guest's ring `b`.
    fn copy_chain(
        &mut self,
        chain: &[crate::Segment],
        (hlen_a, hlen_b): (usize, usize),
        b: &mut crate::device::Live<'_>,
        mergeable: bool,
        d: &VmDirect,
    ) -> Result<Copied, Broken> {
        let total: usize = chain.iter().map(|s| s.len as usize).sum();
        let vnet = (total >= hlen_a + 14 && chain.iter().all(|s| !s.writable))
            .then(|| crate::read_header(chain, hlen_a))
            .flatten();
        let Some(vnet) = vnet else {
            self.from_guest_malformed.add(1);
            return Ok(Copied::Dropped);
        };
        let frame_len = total - hlen_a;
        self.chains.clear();
        self.rx_segs.clear();
        match self.reserve_quietly(b.ring, hlen_b + frame_len, mergeable) {
            Err(f) => return Err(Broken::To(f.to_string())),
            Ok(Some(crate::Shortage::Buffers)) => return Ok(Copied::NoRoom),
            Ok(Some(crate::Shortage::TooBig)) => {
                d.too_big.fetch_add(1, Ordering::Relaxed);
                return Ok(Copied::Dropped);
            }
            Ok(None) => {}
        }
        let (low, high) = crate::header_words(&vnet, self.chains.len() as u16);
        let mut hdr = [0u8; 12];
        hdr[..8].copy_from_slice(&low.to_le_bytes());
        hdr[8..].copy_from_slice(&high.to_le_bytes());
        self.scatter(b.ring, b.log, &hdr[..hlen_b], chain, hlen_a);
        Ok(Copied::Frame(frame_len))
    }

    /// Writes `hdr`, then the bytes of `src` past its first `skip`, into the reserved chains
    /// (`self.chains`), and marks each used with what it holds. The two guests' buffers may
    /// be the same memory (one guest on both ports, or one that lies): the copy is a move.
    fn scatter(
        &self,
        ring: &mut crate::Vring,
        log: Option<&crate::memory::DirtyLog>,
        hdr: &[u8],
        src: &[crate::Segment],
        skip: usize,
    ) {
        let (mut si, mut soff, mut hoff) = (0usize, skip, 0usize);
        while si < src.len() && soff >= src[si].len as usize {
            soff -= src[si].len as usize;
            si += 1;
        }
        for &(head, first, count) in &self.chains {
            let mut written = 0u32;
            for s in &self.rx_segs[first..first + count] {
                let cap = s.len as usize;
                let mut off = 0usize;
                while off < cap && hoff < hdr.len() {
                    let n = (cap - off).min(hdr.len() - hoff);
                    // SAFETY: `s` lies in the receiving guest's memory and holds `cap` bytes
                    // (checked by Vring::chain); `off + n` ≤ `cap`.
                    unsafe { std::ptr::copy(hdr.as_ptr().add(hoff), s.ptr.add(off), n) };
                    off += n;
                    hoff += n;
                }
                while off < cap && si < src.len() {
                    let from = src[si];
                    let n = (cap - off).min(from.len as usize - soff);
                    // SAFETY: `from` lies in the sending guest's memory with `from.len` bytes
                    // and `soff + n` ≤ that; `s` as above. `copy` allows the two to overlap.
                    unsafe { std::ptr::copy(from.ptr.add(soff), s.ptr.add(off), n) };
                    off += n;
                    soff += n;
                    if soff == from.len as usize {
                        si += 1;
                        soff = 0;
                    }
                }
                if let (Some(log), true) = (log, off > 0) {
                    log.mark(s.gpa, off as u64);
                }
                written += off as u32;
            }
            ring.add_used(head, written, log);
        }
    }
}
