//! Direct channels between function ports — the inter-VNF bypass (docs/references.md), on Stitch's
//! side.
//!
//! When a switch's rules send everything from function A to function B, the switch offers the
//! pair a [`Direct`]: a ring in a memfd of its own that A writes and B reads, so A's packets
//! reach B without crossing the engine. Both keep their ports; the switch keeps counting.
//!
//! The switch-over is ordered and lossless, one step per actor, each on its own thread:
//!
//! 1. **Offered**: both ports send the channel to their function. A's function starts writing
//!    forwarded packets to it (`sender` = 1); A's port drains what A wrote to `from_nf` before
//!    that, then reads the channel itself (**EngineReads**): packets still cross the switch.
//! 2. **HandingOff**: once B's function mapped the channel, A's port stops reading it between
//!    two batches and notes how many packets it had sent towards the switch; the switch notes,
//!    once it has consumed those, how many it had sent towards B; B's port, once it has moved
//!    those into B's ring, hands the channel to B's function (`reader` = 1). B reads its own
//!    ring empty before it reads the channel (**ReceiverReads**).
//! 3. **Ending** (rules changed, either function left): `end` = 1. B stops reading
//!    (`receiver` = 2); A goes back to `from_nf` (`sender` = 2). A's port reads what is left in
//!    the channel (**EngineDrains**) before anything A wrote to `from_nf` afterwards, then the
//!    channel is **Retired**.
//!
//! Nothing is taken on trust from the functions: the sender gets slots back only through
//! `released`, which moves after B's port has accounted for each descriptor B read — the
//! buffer passes from A's set of held buffers to B's (so a function that dies is reclaimed
//! exactly), and packets and bytes are counted for the switch's flow and port statistics.

use crate::attachment::{Attachment, PortSettings};
use crate::guest::Plugged;
use crate::shm::{channel_size, ChannelHeader, Consumer, Index, Mapping, Region, RingView, MAGIC};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What the listener and a port's app share.
pub struct PortShared {
    pub name: String,
    pub settings: PortSettings,
    /// A new attachment for the app to take.
    pub incoming: Mutex<Option<Attachment>>,
    /// Something for the app to look at (attach or detach); checked every breath, cheaply.
    pub changed: AtomicBool,
    /// Generation of the last attachment whose connection closed.
    pub closed: AtomicU64,
    /// True while the app holds an attachment (a second function is refused).
    pub busy: AtomicBool,
    /// The attachment the app serves now, for a switch that joins two ports directly.
    pub current: Mutex<Option<Current>>,
    /// Direct channels this port takes part in, put here by the switch that offers them and
    /// cleared by the port once they are retired.
    pub direct: Mutex<DirectSlots>,
    /// An interface's sockets offered to this port's function ([`crate::steer`]), put here by
    /// the interface and cleared by the port once it is done with them.
    pub steer: Mutex<Option<Arc<stitch_xsk::lend::SteerOffer>>>,
    /// Devices QEMU refused to plug into this port's guest ([`crate::guest`]).
    pub guest_plug_refusals: AtomicU64,
    /// When QEMU last refused a direct channel into this port's guest: no channel is offered
    /// to it for [`CHANNEL_RETRY`] after (a guest out of PCI slots stays so a while).
    pub channel_refused_at: Mutex<Option<Instant>>,
    /// In a guest: the devices of this port's last channels, kept plugged a while for the
    /// pair's next channel.
    pub(crate) spares: Mutex<Spares>,
    /// Channels into this port's guest that found their device already there.
    pub guest_channels_reused: AtomicU64,
    /// Who besides root, Stitch's user and the process started for it may attach it.
    pub peers: Mutex<crate::peers::Peers>,
}

/// How long a port whose guest refused a direct channel goes without one.
pub const CHANNEL_RETRY: Duration = Duration::from_secs(10);

/// How long the devices of a retired channel stay plugged in its guests, waiting for the
/// pair's next channel: a hot-plug takes a guest 0.1 s and more, reusing the device nothing
/// (a pair whose rules flap gets its channel back at once), and every device takes one of a
/// guest's few PCI slots.
pub const SPARE_KEPT: Duration = Duration::from_secs(10);

/// The end in a guest of a retired channel, its device still plugged: the function there let
/// it go, so once the other end's did too the memory can serve the pair's next channel.
pub(crate) struct Spare {
    pub channel: Arc<Direct>,
    pub device: Plugged,
    pub since: Instant,
}

/// A port's spare devices, one per direction (the newest).
#[derive(Default)]
pub(crate) struct Spares {
    pub outgoing: Option<Spare>,
    pub incoming: Option<Spare>,
}

impl Spares {
    pub fn slot(&mut self, outgoing: bool) -> &mut Option<Spare> {
        if outgoing {
            &mut self.outgoing
        } else {
            &mut self.incoming
        }
    }
}

#[derive(Default)]
pub struct DirectSlots {
    /// From this port's function to another's.
    pub outgoing: Option<Arc<Direct>>,
    /// From another port's function to this one's.
    pub incoming: Option<Arc<Direct>>,
}

impl PortShared {
    pub fn new(name: &str, settings: PortSettings) -> Arc<PortShared> {
        Arc::new(PortShared {
            name: name.to_string(),
            settings,
            incoming: Mutex::new(None),
            changed: AtomicBool::new(false),
            closed: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            current: Mutex::new(None),
            direct: Mutex::new(DirectSlots::default()),
            steer: Mutex::new(None),
            guest_plug_refusals: AtomicU64::new(0),
            channel_refused_at: Mutex::new(None),
            spares: Mutex::new(Spares::default()),
            guest_channels_reused: AtomicU64::new(0),
            peers: Mutex::new(Default::default()),
        })
    }

    /// Keeps `spare` for the pair's next channel; the one it replaces is unplugged.
    pub(crate) fn keep_spare(&self, spare: Spare, outgoing: bool) {
        let old = self.spares.lock().unwrap().slot(outgoing).replace(spare);
        if let Some(old) = old {
            old.device.unplug();
        }
    }

    /// Unplugs the spares kept past [`SPARE_KEPT`] and those whose pair changed (either
    /// function attached again or left): no channel can use them any more.
    pub(crate) fn expire_spares(&self) {
        let mut spares = self.spares.lock().unwrap();
        for outgoing in [true, false] {
            let slot = spares.slot(outgoing);
            if slot.as_ref().is_some_and(|s| !s.usable()) {
                slot.take().expect("checked").device.unplug();
            }
        }
    }

    /// Forgets the spares without unplugging them: the attachment whose guest holds them
    /// ended, and its guest is swept at the next hello.
    pub(crate) fn forget_spares(&self) {
        *self.spares.lock().unwrap() = Spares::default();
    }

    /// Frees the slot of a channel that is done with, if the slot still holds that one.
    pub fn forget_direct(&self, d: &Arc<Direct>, outgoing: bool) {
        let mut slots = self.direct.lock().unwrap();
        let slot = if outgoing {
            &mut slots.outgoing
        } else {
            &mut slots.incoming
        };
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, d)) {
            *slot = None;
        }
    }
}

/// The buffers one attachment holds, one bit each (pool indices, or slots when isolated).
/// Locked once per batch by its port, and by the port that accounts a channel into it.
#[derive(Default)]
pub struct Held(Mutex<Vec<u64>>);

impl Held {
    pub fn new(bits: usize) -> Arc<Held> {
        Arc::new(Held(Mutex::new(vec![0; bits.div_ceil(64)])))
    }

    pub fn lock(&self) -> HeldBits<'_> {
        HeldBits(self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

pub struct HeldBits<'a>(MutexGuard<'a, Vec<u64>>);

impl HeldBits<'_> {
    #[inline]
    pub fn hold(&mut self, i: u32) {
        if let Some(w) = self.0.get_mut(i as usize / 64) {
            *w |= 1 << (i % 64);
        }
    }

    /// Clears the bit; false when the buffer was not held.
    #[inline]
    pub fn release(&mut self, i: u32) -> bool {
        let Some(w) = self.0.get_mut(i as usize / 64) else {
            return false;
        };
        let bit = 1u64 << (i % 64);
        let had = *w & bit != 0;
        *w &= !bit;
        had
    }

    /// Every held index, clearing them all.
    pub fn take_all(&mut self) -> Vec<usize> {
        let mut out = Vec::new();
        for (w, bits) in self.0.iter_mut().enumerate() {
            let mut b = std::mem::take(bits);
            while b != 0 {
                out.push(w * 64 + b.trailing_zeros() as usize);
                b &= b - 1;
            }
        }
        out
    }

    pub fn count(&self) -> u64 {
        self.0.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Whether some buffer is marked in both sets (never true between two functions).
    pub fn shares_any(&self, other: &HeldBits) -> bool {
        self.0.iter().zip(other.0.iter()).any(|(a, b)| a & b != 0)
    }
}

/// What a port publishes about its current attachment, for a switch building a channel.
#[derive(Clone)]
pub struct Current {
    pub generation: u64,
    pub held: Arc<Held>,
    pub doorbell: Arc<OwnedFd>,
    pub blocking: bool,
    /// The function runs in a VM: it rings no doorbell.
    pub in_guest: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Offered,
    EngineReads,
    HandingOff,
    ReceiverReads,
    Ending,
    EngineDrains,
    Retired,
}

struct State {
    phase: Phase,
    /// Channel slots accounted (and, while Stitch reads, consumed) so far.
    released: u32,
    /// Packets A's port had put on its output when it stopped reading the channel.
    handoff_at: u64,
    /// Packets the switch had put on B's link once it had consumed those.
    through_at: Option<u64>,
    since: Instant,
    warned: bool,
    /// When the switch asked for the end.
    end_asked: Option<Instant>,
}

impl Spare {
    /// `device`, of the retired `channel`, kept from now on.
    pub fn kept(channel: Arc<Direct>, device: Plugged) -> Spare {
        Spare {
            channel,
            device,
            since: Instant::now(),
        }
    }

    /// Whether a channel of its pair may still come to use it.
    fn usable(&self) -> bool {
        let generation = |p: &PortShared| p.current.lock().unwrap().as_ref().map(|c| c.generation);
        let d = &self.channel;
        self.since.elapsed() < SPARE_KEPT
            && generation(&d.from) == Some(d.sender.generation)
            && generation(&d.to) == Some(d.receiver.generation)
    }
}

/// A direct channel's memory: a ring in a memfd. Plugged into a guest, it outlives its channel
/// a while ([`Spare`]) to serve the pair's next one.
pub struct ChannelMemory {
    pub memfd: OwnedFd,
    map: Mapping,
    ring: RingView,
}

// SAFETY: the ring view points into `map`, which lives as long as the `ChannelMemory`; who
// touches which index is decided by the phase of the channel using it, under its `state`.
unsafe impl Send for ChannelMemory {}
// SAFETY: as for Send.
unsafe impl Sync for ChannelMemory {}

impl ChannelMemory {
    fn create(name: &str, ring_size: u32) -> Result<ChannelMemory, String> {
        let len = channel_size(ring_size);
        let (memfd, mut map) = Mapping::create(name, len)
            .map_err(|e| format!("cannot create a direct channel: {e}"))?;
        // SAFETY: ChannelHeader is repr(C) of integers and atomics; nobody else has the memfd yet.
        let h = unsafe { map.view_mut::<ChannelHeader>(0) }.ok_or("direct channel too small")?;
        h.magic = MAGIC;
        h.ring_size = ring_size;
        // SAFETY: the view is kept beside `map`, which outlives it.
        let (_, ring) = unsafe { map.channel() }.map_err(|e| format!("direct channel: {e}"))?;
        Ok(ChannelMemory { memfd, map, ring })
    }

    pub fn header(&self) -> &ChannelHeader {
        self.map.channel_header().expect("checked when created")
    }

    /// Every index and flag as a new channel's. Only once its last channel retired and both
    /// functions let it go: nobody else touches it.
    fn reset(&self) {
        let h = self.header();
        for i in [
            &h.ring.head,
            &h.ring.tail,
            &h.released,
            &h.reader,
            &h.end,
            &h.sender,
            &h.receiver,
            &h.receiver_sleeping,
        ] {
            store(i, 0);
        }
    }
}

/// One direct channel from `from`'s function to `to`'s.
pub struct Direct {
    pub from: Arc<PortShared>,
    pub to: Arc<PortShared>,
    pub sender: Current,
    pub receiver: Current,
    memory: Arc<ChannelMemory>,
    ring: RingView,
    /// The devices of the pair's last channel still plugged in the sender's and the
    /// receiver's guests, if it runs in one: taken by each port when it sends the channel.
    guest_devices: Mutex<[Option<Plugged>; 2]>,
    state: Mutex<State>,
    /// Read by B's function and accounted, for the switch's statistics.
    packets: AtomicU64,
    bytes: AtomicU64,
    /// Descriptors B read that named a buffer A did not hold.
    pub bad: AtomicU64,
    created: Instant,
    /// From the offer to B's function reading (hand-over), and from the end asked to the
    /// channel retired (hand-back), in ns; 0 until done.
    pub handover_ns: AtomicU64,
    pub handback_ns: AtomicU64,
}

// SAFETY: the ring view points into `memory`, which lives as long as the `Direct`; who
// touches which index is decided by the phase, under `state`.
unsafe impl Send for Direct {}
// SAFETY: as for Send.
unsafe impl Sync for Direct {}

/// Counters of one accounting pass.
#[derive(Default)]
pub struct Accounted {
    pub packets: u64,
    pub bad: u64,
}

impl Direct {
    /// A channel from `from` to `to`, both attached zero-copy ports; `None` (with the reason)
    /// when either is not attached.
    pub fn new(
        from: &Arc<PortShared>,
        to: &Arc<PortShared>,
        ring_size: u32,
    ) -> Result<Arc<Direct>, String> {
        let current = |p: &Arc<PortShared>| {
            p.current
                .lock()
                .unwrap()
                .clone()
                .ok_or_else(|| format!("function port `{}` has no function", p.name))
        };
        let (sender, receiver) = (current(from)?, current(to)?);
        for p in [from, to] {
            if let Some(at) = *p.channel_refused_at.lock().unwrap() {
                if at.elapsed() < CHANNEL_RETRY {
                    return Err(format!(
                        "`{}`'s guest refused a direct channel {:.1} s ago: tried again {} s after",
                        p.name,
                        at.elapsed().as_secs_f64(),
                        CHANNEL_RETRY.as_secs()
                    ));
                }
            }
        }
        if sender.in_guest && receiver.blocking {
            return Err(format!(
                "`{}` runs in a guest, which rings no doorbell: a channel from it goes to a \
                 polling function only (`{}` blocks)",
                from.name, to.name
            ));
        }
        let (memory, devices) = match reuse_spares(from, to, (&sender, &receiver), ring_size) {
            Some(reused) => reused,
            None => {
                let name = format!("stitch-direct-{}-{}", from.name, to.name);
                (
                    Arc::new(ChannelMemory::create(&name, ring_size)?),
                    [None, None],
                )
            }
        };
        Ok(Arc::new(Direct {
            from: from.clone(),
            to: to.clone(),
            sender,
            receiver,
            ring: memory.ring,
            memory,
            guest_devices: Mutex::new(devices),
            state: Mutex::new(State {
                phase: Phase::Offered,
                released: 0,
                handoff_at: 0,
                through_at: None,
                since: Instant::now(),
                warned: false,
                end_asked: None,
            }),
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            bad: AtomicU64::new(0),
            created: Instant::now(),
            handover_ns: AtomicU64::new(0),
            handback_ns: AtomicU64::new(0),
        }))
    }

    pub fn header(&self) -> &ChannelHeader {
        self.memory.header()
    }

    pub fn memfd(&self) -> &OwnedFd {
        &self.memory.memfd
    }

    /// The channel's size in bytes (its memfd's).
    pub fn bytes(&self) -> usize {
        self.memory.map.len()
    }

    /// The device of the pair's last channel still plugged into the sender's guest
    /// (`outgoing`) or the receiver's, if this channel reuses its memory.
    pub(crate) fn take_guest_device(&self, outgoing: bool) -> Option<Plugged> {
        self.guest_devices.lock().unwrap()[usize::from(!outgoing)].take()
    }

    /// Whether the receiving function read from it (its hand-over was done).
    pub fn was_handed_over(&self) -> bool {
        self.handover_ns.load(Ordering::Relaxed) > 0
    }

    pub fn ring_size(&self) -> u32 {
        self.ring.size()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase
    }

    fn set_phase(&self, st: &mut State, p: Phase) {
        st.phase = p;
        st.since = Instant::now();
        st.warned = false;
        let ns = |from: Instant| (st.since - from).as_nanos().max(1) as u64;
        match p {
            Phase::ReceiverReads => self.handover_ns.store(ns(self.created), Ordering::Relaxed),
            Phase::Ending | Phase::EngineDrains if st.end_asked.is_none() => {
                st.end_asked = Some(st.since)
            }
            Phase::Retired => {
                let from = st.end_asked.unwrap_or(self.created);
                self.handback_ns.store(ns(from), Ordering::Relaxed)
            }
            _ => {}
        }
    }

    /// Ends the channel (rules changed, or one side left); a no-op once ending.
    pub fn end(&self) {
        let mut st = self.lock();
        let next = match st.phase {
            Phase::ReceiverReads => Phase::Ending,
            Phase::Ending | Phase::EngineDrains | Phase::Retired => return,
            _ => Phase::EngineDrains,
        };
        self.set_phase(&mut st, next);
        store(&self.header().end, 1);
        drop(st);
        // Sleeping functions must see `end` to let go.
        for c in [&self.receiver, &self.sender] {
            if c.blocking {
                ring_doorbell(&c.doorbell);
            }
        }
    }

    /// Ending and not yet retired: packets may still cross it under the old rules.
    pub fn is_draining(&self) -> bool {
        matches!(self.phase(), Phase::Ending | Phase::EngineDrains)
    }

    /// Packets and bytes B's function has read from the channel so far (accounted).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.packets.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }

    /// The switch's step of the hand-off: once it has consumed `handoff_at` packets from A's
    /// link (`consumed_from_a`), the packets it has put on B's link so far are the last that
    /// B must see before the channel's.
    pub fn switch_progress(&self, consumed_from_a: u64, sent_to_b: u64) {
        let mut st = self.lock();
        if st.phase == Phase::HandingOff
            && st.through_at.is_none()
            && consumed_from_a >= st.handoff_at
        {
            st.through_at = Some(sent_to_b);
        }
    }

    /// Accounts what B's function read: each buffer passes from A's held set to B's, counted.
    fn account(&self, st: &mut State) -> Accounted {
        let mut r = Accounted::default();
        let tail = self.ring.tail();
        let n = tail.wrapping_sub(st.released);
        if n == 0 {
            return r;
        }
        if n > self.ring.size() || n > self.ring.head().wrapping_sub(st.released) {
            // The receiving function published an impossible index: take nothing on its word.
            r.bad += 1;
            return r;
        }
        let (a, b) = (&self.sender.held, &self.receiver.held);
        let (mut ha, mut hb) = if Arc::as_ptr(a) < Arc::as_ptr(b) {
            let ha = a.lock();
            (ha, b.lock())
        } else {
            let hb = b.lock();
            (a.lock(), hb)
        };
        let mut bytes = 0u64;
        for i in 0..n {
            let d = self.ring.read(st.released.wrapping_add(i));
            if ha.release(d.buffer) {
                hb.hold(d.buffer);
                r.packets += 1;
                bytes += d.len as u64;
            } else {
                r.bad += 1;
            }
        }
        drop((ha, hb));
        st.released = tail;
        store(&self.header().released, tail);
        self.packets.store(
            self.packets.load(Ordering::Relaxed) + r.packets,
            Ordering::Relaxed,
        );
        self.bytes.store(
            self.bytes.load(Ordering::Relaxed) + bytes,
            Ordering::Relaxed,
        );
        self.bad.fetch_add(r.bad, Ordering::Relaxed);
        r
    }

    /// B's port, every pull, before it reads B's `from_nf` (whose head it loaded first: what B
    /// returns there it read here before). `consumed` is what B's port has taken off its
    /// input link; `attached` whether B's function is still there. Returns false once the
    /// channel no longer concerns B, and the packets B read since the last call.
    pub fn receiver_pull(&self, consumed: u64, attached: bool) -> (bool, u64) {
        let mut st = self.lock();
        let mut read = 0;
        match st.phase {
            Phase::HandingOff => {
                if st.through_at.is_some_and(|t| consumed >= t) {
                    store(&self.header().reader, 1);
                    self.set_phase(&mut st, Phase::ReceiverReads);
                }
            }
            Phase::ReceiverReads => {
                read = self.account(&mut st).packets;
            }
            Phase::Ending => {
                // The flag is loaded before the last accounting: nothing read after it.
                let stopped = !attached || load(&self.header().receiver) >= 2;
                read = self.account(&mut st).packets;
                if stopped {
                    self.set_phase(&mut st, Phase::EngineDrains);
                } else {
                    self.warn_if_stuck(&mut st, &self.to.name, "stop reading");
                }
            }
            Phase::EngineDrains | Phase::Retired => return (false, 0),
            Phase::Offered | Phase::EngineReads => {}
        }
        (true, read)
    }

    /// B's function is gone: what it read is its own (reclaimed with it), the rest goes back
    /// through Stitch.
    pub fn receiver_left(&self) {
        self.end();
        let mut st = self.lock();
        if st.phase == Phase::Ending {
            self.account(&mut st);
            self.set_phase(&mut st, Phase::EngineDrains);
        }
    }

    /// A's port, every pull: which of its rings it may read and in which order.
    /// `sent` is what it has put on its output link so far.
    pub fn sender_step(&self, sent: u64, sender_attached: bool) -> SenderStep {
        let mut st = self.lock();
        let h = self.header();
        match st.phase {
            Phase::Offered => {
                if load(&h.sender) >= 1 {
                    // From here on A forwards only to the channel: once `from_nf` has been
                    // read empty, the channel comes next.
                    self.set_phase(&mut st, Phase::EngineReads);
                    return SenderStep::FromNfThenChannel;
                }
                if !sender_attached {
                    self.end_locked(&mut st);
                }
                SenderStep::FromNf
            }
            Phase::EngineReads => {
                if load(&h.receiver) >= 1 {
                    st.handoff_at = sent;
                    self.set_phase(&mut st, Phase::HandingOff);
                    return SenderStep::FromNf;
                }
                SenderStep::FromNfThenChannel
            }
            Phase::HandingOff | Phase::ReceiverReads => SenderStep::FromNf,
            // Anything A wrote to `from_nf` after leaving waits for the channel to empty.
            Phase::Ending => {
                self.warn_if_stuck(&mut st, &self.to.name, "stop reading");
                SenderStep::Nothing
            }
            Phase::EngineDrains => {
                let left = !sender_attached || load(&h.sender) != 1;
                let empty = self.ring.head() == st.released;
                if left && empty {
                    self.set_phase(&mut st, Phase::Retired);
                    return SenderStep::Retired;
                }
                if !left {
                    self.warn_if_stuck(&mut st, &self.from.name, "leave the channel");
                }
                SenderStep::Channel
            }
            Phase::Retired => SenderStep::Retired,
        }
    }

    fn end_locked(&self, st: &mut State) {
        if !matches!(
            st.phase,
            Phase::Ending | Phase::EngineDrains | Phase::Retired
        ) {
            self.set_phase(st, Phase::EngineDrains);
            store(&self.header().end, 1);
        }
    }

    /// A's port reads the channel itself (EngineReads, EngineDrains): a consumer at the
    /// accounted position, and how many descriptors wait (`None`: impossible head).
    pub fn engine_reader(&self) -> Option<(Consumer, u32)> {
        let st = self.lock();
        let c = Consumer::at(self.ring, st.released);
        let n = c.available()?;
        Some((c, n))
    }

    /// A's port has read up to `c`'s position: the slots go back to A.
    pub fn engine_read_done(&self, c: &Consumer) {
        let mut st = self.lock();
        st.released = c.position();
        c.release();
        store(&self.header().released, st.released);
    }

    fn warn_if_stuck(&self, st: &mut State, who: &str, what: &str) {
        if !st.warned && st.since.elapsed().as_secs() >= 1 {
            st.warned = true;
            log::warn!(
                "direct channel {} -> {}: the function on `{who}` did not {what} for a second; the switch-over waits for it (detach it to go on)",
                self.from.name,
                self.to.name
            );
        }
    }
}

/// The memory and devices of the last channel from `from` to `to` between the same two
/// attachments, if the ports in guests kept their devices ([`Spare`]) and a function process
/// at either end let it go: reset for a new channel, they spare it a hot-plug into each guest
/// (the process is sent the same memfd again).
fn reuse_spares(
    from: &Arc<PortShared>,
    to: &Arc<PortShared>,
    (sender, receiver): (&Current, &Current),
    ring_size: u32,
) -> Option<(Arc<ChannelMemory>, [Option<Plugged>; 2])> {
    if !(sender.in_guest || receiver.in_guest) || Arc::ptr_eq(from, to) {
        return None;
    }
    // Two ports' locks, in one order whoever asks (the pair's other direction may be asking).
    let (mut out, mut inc) = if Arc::as_ptr(from) < Arc::as_ptr(to) {
        let out = from.spares.lock().unwrap();
        (out, to.spares.lock().unwrap())
    } else {
        let inc = to.spares.lock().unwrap();
        (from.spares.lock().unwrap(), inc)
    };
    // The spare each end in a guest must have kept, of one and the same channel.
    let kept = |slot: &Option<Spare>, in_guest: bool| match (slot, in_guest) {
        (Some(s), true) => Some(Some(s.channel.clone())),
        (None, true) => None,
        (_, false) => Some(None),
    };
    let (s, r) = (
        kept(&out.outgoing, sender.in_guest)?,
        kept(&inc.incoming, receiver.in_guest)?,
    );
    let old = s.as_ref().or(r.as_ref())?;
    let h = old.header();
    // A process at either end: it let the channel go (a 0 would be a message it has yet to
    // take, and would take for the new channel).
    let let_go = |in_guest: bool, flag: &Index| in_guest || load(flag) >= 2;
    let same_pair = [&s, &r]
        .iter()
        .all(|c| c.as_ref().is_none_or(|c| Arc::ptr_eq(c, old)))
        && Arc::ptr_eq(&old.from, from)
        && Arc::ptr_eq(&old.to, to)
        && old.sender.generation == sender.generation
        && old.receiver.generation == receiver.generation
        && old.ring_size() == ring_size
        && old.phase() == Phase::Retired
        && let_go(sender.in_guest, &h.sender)
        && let_go(receiver.in_guest, &h.receiver);
    if !same_pair {
        return None;
    }
    let memory = old.memory.clone();
    let take = |slot: &mut Option<Spare>, in_guest: bool| {
        in_guest.then(|| slot.take()).flatten().map(|s| s.device)
    };
    let devices = [
        take(&mut out.outgoing, sender.in_guest),
        take(&mut inc.incoming, receiver.in_guest),
    ];
    memory.reset();
    for p in [from, to] {
        p.guest_channels_reused.fetch_add(1, Ordering::Relaxed);
    }
    Some((memory, devices))
}

/// What A's port reads this pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SenderStep {
    /// Its own ring only.
    FromNf,
    /// Its own ring, then — if that was read empty — the channel.
    FromNfThenChannel,
    /// The channel only.
    Channel,
    /// Neither (waiting for the receiver to let go).
    Nothing,
    /// The channel is done: back to its own ring.
    Retired,
}

#[inline]
fn store(i: &Index, v: u32) {
    i.0.store(v, Ordering::Release);
}

#[inline]
fn load(i: &Index) -> u32 {
    i.0.load(Ordering::Acquire)
}

pub fn ring_doorbell(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: the kernel reads 8 bytes from `one`, a live u64.
    unsafe {
        libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8);
    }
}

/// Sends a control message (one JSON line and descriptors) on a function's connection.
pub fn send_control(
    conn: &OwnedFd,
    message: &serde_json::Value,
    fds: &[std::os::fd::RawFd],
) -> io::Result<()> {
    let line = format!("{message}\n");
    stitch_core::fdpass::send_flags(conn.as_raw_fd(), line.as_bytes(), fds, libc::MSG_DONTWAIT)
}

/// A zero-copy port with a function attached (generation `generation`) holding nothing, for
/// tests and fuzzing of channels without an engine.
#[doc(hidden)]
pub fn test_port(name: &str, generation: u64) -> (Arc<PortShared>, Arc<Held>) {
    use std::os::fd::FromRawFd;
    let p = PortShared::new(
        name,
        PortSettings {
            zero_copy: true,
            blocking: false,
            ring_size: 64,
            buffers: 64,
            buffer_size: 2048,
        },
    );
    let held = Held::new(4096);
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    *p.current.lock().unwrap() = Some(Current {
        generation,
        held: held.clone(),
        doorbell: Arc::new(fd),
        blocking: false,
        in_guest: false,
    });
    (p, held)
}

/// The channel's mapping as the functions see it (tests and fuzzing).
#[doc(hidden)]
pub fn test_ring(d: &Direct) -> RingView {
    d.ring
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{Desc, Producer};

    fn desc(buffer: u32) -> Desc {
        Desc {
            buffer,
            offset: 0,
            flags: 0,
            len: 60,
            stamp_lo: 0,
        }
    }

    /// Records what it is asked to unplug.
    #[derive(Default)]
    struct Unplugs(Mutex<Vec<String>>);

    impl crate::guest::GuestBus for Unplugs {
        fn plug(
            &self,
            _: &str,
            _: std::os::fd::BorrowedFd<'_>,
            _: usize,
        ) -> Result<String, String> {
            Err("not in this test".into())
        }
        fn unplug(&self, id: &str) -> Result<(), String> {
            self.0.lock().unwrap().push(id.to_string());
            Ok(())
        }
        fn sweep(&self, _: &str) -> Result<Vec<String>, String> {
            Ok(Vec::new())
        }
    }

    impl Unplugs {
        /// Waits for `id` to be unplugged (on a thread of its own).
        fn saw(&self, id: &str) -> bool {
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(2) {
                if self.0.lock().unwrap().iter().any(|u| u == id) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            false
        }
    }

    fn in_guest(p: &PortShared) {
        p.current.lock().unwrap().as_mut().unwrap().in_guest = true;
    }

    /// Both functions take the channel, then let it go; the engine retires it.
    fn hand_over_and_back(d: &Direct) {
        let h = d.header();
        h.sender.0.store(1, Ordering::Release);
        assert_eq!(d.sender_step(0, true), SenderStep::FromNfThenChannel);
        h.receiver.0.store(1, Ordering::Release);
        assert_eq!(d.sender_step(0, true), SenderStep::FromNf);
        d.switch_progress(0, 0);
        d.receiver_pull(0, true);
        assert!(d.was_handed_over());
        d.end();
        h.receiver.0.store(2, Ordering::Release);
        d.receiver_pull(0, true);
        h.sender.0.store(2, Ordering::Release);
        assert_eq!(d.sender_step(0, true), SenderStep::Retired);
    }

    fn keep_both(d: &Arc<Direct>, bus: &Arc<Unplugs>, since: Instant) {
        for (port, outgoing, id) in [(&d.from, true, "tx"), (&d.to, false, "rx")] {
            let device = Plugged {
                bus: bus.clone(),
                id: id.to_string(),
                pci: format!("0000:00:0{}.0", 5 + usize::from(outgoing)),
            };
            let spare = Spare::kept(d.clone(), device);
            port.keep_spare(Spare { since, ..spare }, outgoing);
        }
    }

    #[test]
    fn the_next_channel_of_two_guests_reuses_the_last_ones_devices_until_the_pair_changes() {
        let (a, _) = test_port("a", 1);
        let (b, _) = test_port("b", 2);
        let bus = Arc::new(Unplugs::default());
        // From a guest to a process: the guest's device is kept; the process is sent the
        // same memory again once it let the last channel go.
        in_guest(&a);
        let first = Direct::new(&a, &b, 64).unwrap();
        hand_over_and_back(&first);
        first.header().receiver.0.store(0, Ordering::Release);
        keep_both(&first, &bus, Instant::now());
        b.forget_spares();
        let not_yet = Direct::new(&a, &b, 64).unwrap();
        assert!(
            not_yet.take_guest_device(true).is_none(),
            "the process never took the last channel: it may still take it"
        );
        first.header().receiver.0.store(2, Ordering::Release);
        let second = Direct::new(&a, &b, 64).unwrap();
        assert_eq!(second.memfd().as_raw_fd(), first.memfd().as_raw_fd());
        assert!(second.take_guest_device(true).is_some());
        assert!(second.take_guest_device(false).is_none());
        // Between two guests, both devices.
        in_guest(&b);
        let first = Direct::new(&a, &b, 64).unwrap();
        hand_over_and_back(&first);
        let h = first.header();
        for i in [&h.ring.head, &h.ring.tail, &h.released] {
            i.0.store(7, Ordering::Release);
        }
        keep_both(&first, &bus, Instant::now());
        // The pair's other direction finds nothing of this one's.
        let back = Direct::new(&b, &a, 64).unwrap();
        assert!(back.take_guest_device(true).is_none());
        let second = Direct::new(&a, &b, 64).unwrap();
        assert_eq!(
            second.memfd().as_raw_fd(),
            first.memfd().as_raw_fd(),
            "the same memory"
        );
        let h = second.header();
        assert_eq!(
            (
                h.ring.head.0.load(Ordering::Acquire),
                h.end.0.load(Ordering::Acquire)
            ),
            (0, 0),
            "reset as a new channel's"
        );
        assert_eq!(second.take_guest_device(true).unwrap().pci, "0000:00:06.0");
        assert_eq!(second.take_guest_device(false).unwrap().pci, "0000:00:05.0");
        assert_eq!(a.guest_channels_reused.load(Ordering::Relaxed), 2);
        assert_eq!(b.guest_channels_reused.load(Ordering::Relaxed), 2);
        // A channel not yet retired is never reused, even if kept.
        keep_both(&second, &bus, Instant::now());
        let third = Direct::new(&a, &b, 64).unwrap();
        assert_ne!(third.memfd().as_raw_fd(), second.memfd().as_raw_fd());
        a.expire_spares();
        std::thread::sleep(Duration::from_millis(50));
        assert!(bus.0.lock().unwrap().is_empty(), "still usable");
        // B's function attached again: A's spare is of no use and goes.
        hand_over_and_back(&second);
        b.current.lock().unwrap().as_mut().unwrap().generation = 3;
        a.expire_spares();
        assert!(bus.saw("tx"));
        assert!(a.spares.lock().unwrap().outgoing.is_none());
        // Kept too long: goes too.
        b.current.lock().unwrap().as_mut().unwrap().generation = 2;
        hand_over_and_back(&third);
        keep_both(&third, &bus, Instant::now() - SPARE_KEPT);
        bus.0.lock().unwrap().clear();
        b.expire_spares();
        assert!(bus.saw("rx"));
    }

    /// No buffer is ever held by both functions, and none is lost between them.
    fn check(a: &Held, b: &Held, total: u64) {
        let (x, y) = (a.lock(), b.lock());
        assert!(!x.shares_any(&y), "a buffer held twice");
        assert!(x.count() + y.count() <= total);
    }

    #[test]
    fn a_channel_hands_over_accounts_and_survives_garbage() {
        let (a, held_a) = test_port("a", 1);
        let (b, held_b) = test_port("b", 2);
        {
            let mut h = held_a.lock();
            for i in 0..200 {
                h.hold(i);
            }
        }
        let d = Direct::new(&a, &b, 64).unwrap();
        let h = d.header();
        let ring = test_ring(&d);
        // SAFETY: `h.released` is in the channel mapping, which `d` keeps alive for the whole test.
        let mut tx = unsafe { Producer::gated(ring, &h.released.0) };
        // Offered: A's port reads only its own ring until A writes here.
        assert_eq!(d.sender_step(0, true), SenderStep::FromNf);
        h.sender.0.store(1, Ordering::Release);
        assert_eq!(d.sender_step(0, true), SenderStep::FromNfThenChannel);
        for i in 0..10 {
            tx.put(desc(i));
        }
        tx.publish();
        // Stitch reads the channel while B has not mapped it.
        let (mut c, n) = d.engine_reader().unwrap();
        assert_eq!(n, 10);
        for _ in 0..n {
            held_a.lock().release(c.take().buffer);
        }
        d.engine_read_done(&c);
        // B mapped it: A's port stops reading after 10 packets sent; the switch passes them
        // on (12 on B's link by then); B's port hands over once it consumed those.
        h.receiver.0.store(1, Ordering::Release);
        assert_eq!(d.sender_step(10, true), SenderStep::FromNf);
        d.switch_progress(9, 11);
        assert_eq!(d.receiver_pull(100, true), (true, 0));
        assert_eq!(
            d.phase(),
            Phase::HandingOff,
            "the switch has not consumed all 10"
        );
        d.switch_progress(10, 12);
        assert_eq!(d.receiver_pull(11, true), (true, 0));
        assert_eq!(d.phase(), Phase::HandingOff, "B's port has not consumed 12");
        assert_eq!(d.receiver_pull(12, true), (true, 0));
        assert_eq!(d.phase(), Phase::ReceiverReads);
        assert_eq!(h.reader.0.load(Ordering::Acquire), 1);
        // B reads 30 of 40: they become B's, counted.
        for i in 10..50 {
            tx.put(desc(i));
        }
        tx.publish();
        let mut rx = Consumer::resuming(ring);
        for _ in 0..30 {
            rx.take();
        }
        rx.release();
        assert_eq!(d.receiver_pull(12, true), (true, 30));
        assert_eq!(d.counts(), (30, 1800));
        assert_eq!(held_b.lock().count(), 30);
        check(&held_a, &held_b, 200);
        // Garbage from A: a buffer it does not hold. From B: an impossible tail.
        tx.put(desc(3000));
        tx.publish();
        for _ in 0..11 {
            rx.take();
        }
        rx.release();
        assert_eq!(d.receiver_pull(12, true), (true, 10));
        assert_eq!(d.bad.load(Ordering::Relaxed), 1);
        h.ring.tail.0.store(rx.position() + 1000, Ordering::Release);
        assert_eq!(d.receiver_pull(12, true), (true, 0));
        h.ring.tail.0.store(rx.position(), Ordering::Release);
        check(&held_a, &held_b, 200);
        // The end: B stops, A leaves after 5 more, Stitch drains them, the channel retires.
        for i in 50..55 {
            tx.put(desc(i));
        }
        tx.publish();
        d.end();
        assert_eq!(d.sender_step(10, true), SenderStep::Nothing);
        h.receiver.0.store(2, Ordering::Release);
        assert_eq!(d.receiver_pull(12, true), (true, 0));
        assert_eq!(d.phase(), Phase::EngineDrains);
        assert_eq!(d.sender_step(10, true), SenderStep::Channel);
        let (mut c, n) = d.engine_reader().unwrap();
        assert_eq!(n, 5);
        for _ in 0..n {
            assert!(held_a.lock().release(c.take().buffer));
        }
        d.engine_read_done(&c);
        assert_eq!(
            d.sender_step(10, true),
            SenderStep::Channel,
            "A has not left"
        );
        h.sender.0.store(2, Ordering::Release);
        assert_eq!(d.sender_step(10, true), SenderStep::Retired);
        assert!(d.handover_ns.load(Ordering::Relaxed) > 0);
        assert!(d.handback_ns.load(Ordering::Relaxed) > 0);
        check(&held_a, &held_b, 200);
        assert_eq!(held_a.lock().count() + held_b.lock().count(), 200 - 10 - 5);
    }
}
