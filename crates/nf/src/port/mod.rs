//! `nf_port`: a network function in another process, attached through shared memory.
//!
//! Packets arriving on `input` go to the function; what it sends back leaves on `output`. The
//! function (any program using `stitch_nf::client` or the C ABI) connects to `socket` and asks
//! for this port by name; it may come and go while the graph runs — while none is attached,
//! packets are dropped and counted (`down_drops`).
//!
//! - `mode: zero_copy` (trusted functions): packets are handed over by reference — the function
//!   maps Stitch's packet pool and works on the buffers in place.
//! - `mode: isolated` (untrusted): the function sees only its own buffer slots; Stitch copies
//!   each packet in and out and checks every descriptor it gets back. A function cannot reach
//!   any other packet, and garbage in its rings is counted (`bad_descriptors`) and ignored.
//! - `wake: polling`: the function spins on its ring. `wake: blocking`: it sleeps on an eventfd
//!   and is woken only when `batch` packets wait, or when the oldest has waited `max_delay_us`
//!   (with `batch: 1`, on every empty → non-empty transition).
//!
//! A port hands the function only what its ring has room for and takes back only what its
//! output link has room for: the rest waits (in the link in front, in the function's ring),
//! so a function that is not scheduled for a moment loses nothing — with the default ring of
//! 2048 and links of 1024, 20 ms of a 150 kpps stream (measured: `docs/benchmarks.md`).
//!
//! When a function exits, crashes or is killed, its connection closes: the port goes down, the
//! buffers it held are reclaimed and counted as drops (`reclaimed_drops`), counters are kept, and
//! it can attach again.
//!
//! A `switch` whose rules join two zero-copy function ports point to point gives them a direct
//! channel ([`crate::direct`]): the first function's packets go straight to the second, which
//! counts them in `direct_channel_packets` (they do not cross the links or `from_function` /
//! `to_function`).
//!
//! ```yaml
//! apps:
//!   tenant1: { type: nf_port, socket: /run/stitch-fn/tenants.sock, mode: isolated, wake: blocking,
//!              batch: 1, max_delay_us: 50 }
//! links:
//!   - "in.output -> tenant1.input"
//!   - "tenant1.output -> out.input"
//! ```

use crate::direct::{self, Current, Direct, Held, SenderStep};
use crate::listener::{self, Attachment, Listener, PortSettings, PortShared};
use crate::shm::{Consumer, Desc, Producer, Region, RingView, FLAG_DROP, FLAG_STEERED};
use crate::steer::{self, Steering, Taken};

mod guest;
mod handover;
use serde::Deserialize;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::app::{AppContext, AppError, Counter, Io, PortSpec, Reconfigured};
use stitch_core::link::{EndTag, TaggedEnds};
use stitch_core::Packet;
use stitch_core::{pool, App};
use stitch_xsk::lend::RingBorrower;

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq,
)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    ZeroCopy,
    Isolated,
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq,
)]
#[serde(rename_all = "snake_case")]
pub enum Wake {
    #[default]
    Polling,
    Blocking,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NfPortConfig {
    /// Name the function asks for (default: the app's name).
    #[serde(default)]
    pub port: Option<String>,
    /// Attach socket (default: the instance's, `/run/stitch-fn/INSTANCE.sock` for root).
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// Users besides root, Stitch's user and the process Stitch started for this port that
    /// may attach it (a function started by hand, or by another service).
    #[serde(default)]
    pub allow_users: Vec<String>,
    /// Groups whose members may attach it.
    #[serde(default)]
    pub allow_groups: Vec<String>,
    /// The rings' kind.
    #[serde(default)]
    pub mode: Mode,
    /// How the function learns that packets wait.
    #[serde(default)]
    pub wake: Wake,
    /// Blocking: wake the function when this many packets wait (1: as soon as one does).
    #[serde(default = "default_batch")]
    pub batch: u32,
    /// Blocking: wake it anyway when the oldest packet has waited this long.
    #[serde(default = "default_delay")]
    pub max_delay_us: u64,
    /// Descriptors per ring (power of two).
    #[serde(default = "default_ring")]
    pub ring_size: u32,
    /// Isolated: bytes per buffer slot (longer packets are dropped and counted).
    #[serde(default = "default_buffer")]
    pub buffer_size: u32,
}

/// Wake on the empty → non-empty transition: with many functions each sees too few packets for
/// a batch to form, and waiting only adds latency (measured: `docs/benchmarks.md`).
fn default_batch() -> u32 {
    1
}
fn default_delay() -> u64 {
    50
}
/// With the link in front (1024 by default), room for 20 ms of a 150 kpps stream while the
/// function is not scheduled (measured: `docs/benchmarks.md`, "a function stalled 10 ms").
fn default_ring() -> u32 {
    2048
}
fn default_buffer() -> u32 {
    2048
}

impl NfPortConfig {
    /// What shapes the shared region (and so cannot change while a function is attached).
    fn settings(&self) -> PortSettings {
        PortSettings {
            zero_copy: self.mode == Mode::ZeroCopy,
            blocking: self.wake == Wake::Blocking,
            ring_size: self.ring_size,
            buffers: self.ring_size,
            buffer_size: self.buffer_size,
        }
    }
}

pub use crate::paths::{default_socket, default_socket_folder};

struct Active {
    att: Attachment,
    to_nf: Producer,
    from_nf: Consumer,
    /// Buffers (pool indices or slots) the function holds now.
    held: Arc<Held>,
    /// Isolated: slots free for the next packets, and the receive time of the packet in each
    /// (the copy that comes back is a new packet; it keeps the original's time).
    free_slots: Vec<u32>,
    slot_stamps: Vec<u64>,
    /// Blocking: packets handed over since the function last was awake, and since when.
    unsignalled: u32,
    waiting_since: Option<Instant>,
    /// Direct channels (the inter-VNF bypass) from and to this function, once sent to it.
    outgoing: Option<Arc<Direct>>,
    incoming: Option<Arc<Direct>>,
    /// In a guest: the devices of those channels, unplugged once retired and let go.
    guest_channels: guest::GuestChannels,
    control_sent: u32,
    /// Zero-copy, taken over from a predecessor process: the function maps that process's
    /// packet memory until this one sends its own, before the first packet.
    pool_unsent: bool,
    /// Zero-copy in a guest taken over from a predecessor: this process's packet memory,
    /// plugged while the take-over was prepared and not yet named to the function
    /// ([`handover`]).
    pool_untold: Option<handover::UntoldPool>,
    /// Devices a predecessor left in the guest, unplugged once the function has taken the
    /// `control` message numbered here (the packet memory that replaced them).
    left_in_guest: Option<(Vec<crate::guest::Plugged>, u32)>,
    /// An interface's sockets the function reads ([`crate::steer`]), once offered.
    steering: Option<Steering>,
}

impl Active {
    fn new(att: Attachment, zero_copy: bool) -> Active {
        let (to_nf, from_nf) = rings(&att);
        let l = att.layout;
        let bits = if zero_copy {
            pool::get().packets()
        } else {
            l.buffers as usize
        };
        Active {
            att,
            to_nf: Producer::new(to_nf),
            from_nf: Consumer::new(from_nf),
            held: Held::new(bits),
            free_slots: (0..l.buffers).rev().collect(),
            slot_stamps: vec![0; l.buffers as usize],
            unsignalled: 0,
            waiting_since: None,
            outgoing: None,
            incoming: None,
            guest_channels: guest::GuestChannels::default(),
            control_sent: 0,
            pool_unsent: false,
            pool_untold: None,
            left_in_guest: None,
            steering: None,
        }
    }

    /// Blocking: the function has seen (or will see without a doorbell) all it was handed.
    fn nothing_waits(&mut self) {
        self.unsignalled = 0;
        self.waiting_since = None;
    }

    /// Sends a direct channel to the function (in a guest: plugs it there first, and sends
    /// later); false when it cannot take it.
    fn send_direct(&mut self, d: &Arc<Direct>, outgoing: bool, port: &Arc<PortShared>) -> bool {
        if let Some(bus) = &self.att.guest {
            let attachment = (&self.att.conn, self.att.generation);
            return match (self.guest_channels).start(bus, attachment, d, outgoing, port) {
                Ok(()) => true,
                Err(e) => {
                    log::warn!("function port `{}`: {e}", port.name);
                    false
                }
            };
        }
        let (msg, fds) = if outgoing {
            (
                serde_json::json!({ "direct": "send" }),
                vec![d.memfd().as_raw_fd(), d.receiver.doorbell.as_raw_fd()],
            )
        } else {
            (
                serde_json::json!({ "direct": "receive" }),
                vec![d.memfd().as_raw_fd()],
            )
        };
        self.send_control(&msg, &fds, "direct channel")
    }

    /// Sends the function a control message with descriptors; false when it cannot take it.
    fn send_control(
        &mut self,
        msg: &serde_json::Value,
        fds: &[std::os::fd::RawFd],
        what: &str,
    ) -> bool {
        if self.att.guest.is_some() {
            log::info!("{what} not sent to the function in a guest: it takes no descriptors");
            return false;
        }
        if let Err(e) = direct::send_control(&self.att.conn, msg, fds) {
            log::info!(
                "{what} not sent to the function (pid {}): {e}",
                self.att.pid
            );
            return false;
        }
        self.control_sent += 1;
        self.att
            .header()
            .control
            .0
            .store(self.control_sent, Ordering::Release);
        true
    }
}

/// The attachment's two rings: to the function and from it.
fn rings(att: &Attachment) -> (RingView, RingView) {
    let l = att.layout;
    // SAFETY: the views live in `Active` beside `att`, which owns the region and outlives
    // them; the listener (or the adoption of a predecessor's port) checked the layout against
    // the region when it made it.
    let (to_nf, from_nf) = unsafe {
        (
            att.region.ring(l.to_nf, l.ring_size),
            att.region.ring(l.from_nf, l.ring_size),
        )
    };
    (
        to_nf.expect("layout checked at attach"),
        from_nf.expect("layout checked at attach"),
    )
}

/// Where isolated slot `i` starts in the region.
fn slot_offset(att: &Attachment, i: u32) -> usize {
    let l = &att.layout;
    l.bufs + i as usize * l.buffer_size as usize
}

/// A function that left while its packets were on a direct channel: the channel is read empty
/// by Stitch before the buffers the function still held are reclaimed.
struct Leaving {
    direct: Arc<Direct>,
    held: Arc<Held>,
}

/// Takes zero-copy descriptors back from `src`: each buffer must be one the function held, or
/// (with `steering`) the next frame of a steered ring; forwarded ones go to `out`.
fn take_back(
    src: &mut Consumer,
    n: u32,
    held: &Held,
    mut out: Option<&mut stitch_core::link::Producer>,
    mut steering: Option<&mut Steering>,
) -> Taken {
    let pool = pool::get();
    let mut held = held.lock();
    let mut t = Taken::default();
    for _ in 0..n {
        let d = src.take();
        if d.flags & FLAG_STEERED != 0 {
            match steering.as_deref_mut() {
                Some(s) => s.take(&d, &mut out, &mut t),
                None => t.bad += 1,
            }
            continue;
        }
        if !held.release(d.buffer) {
            t.bad += 1;
            continue;
        }
        // Safety: the function held this buffer (its bit was set) and gave it back.
        let Some(mut p) = (unsafe { pool.take(d.buffer as usize) }) else {
            t.bad += 1;
            continue;
        };
        if d.flags & FLAG_DROP != 0 {
            continue;
        }
        if p.set_bounds(d.offset as usize, d.len as usize).is_err() {
            t.bad += 1;
            continue;
        }
        t.forwarded += 1;
        if let Some(o) = out.as_mut() {
            o.transmit(p);
        }
    }
    if let Some(s) = steering {
        s.publish();
    }
    t
}

/// Stitch reads a channel as its consumer ([`take_back`] over it); `None` when the sending
/// function published an impossible head.
fn read_channel(
    d: &Direct,
    held: &Held,
    out: Option<&mut stitch_core::link::Producer>,
) -> Option<(u64, u64)> {
    let (mut c, n) = d.engine_reader()?;
    if n == 0 {
        return Some((0, 0));
    }
    let t = take_back(&mut c, n, held, out, None);
    d.engine_read_done(&c);
    Some((t.forwarded, t.bad))
}

/// Isolated: copies `n` returned slots out of the region into fresh packets, each descriptor
/// checked; forwarded ones go to `out`. Returns (forwarded, bad, pool exhausted).
fn copy_back(
    a: &mut Active,
    n: u32,
    mut out: Option<&mut stitch_core::link::Producer>,
) -> (u64, u64, u64) {
    let (mut got, mut bad, mut exhausted) = (0u64, 0u64, 0u64);
    let mut held = a.held.lock();
    for _ in 0..n {
        let d = a.from_nf.take();
        if !held.release(d.buffer) {
            bad += 1;
            continue;
        }
        a.free_slots.push(d.buffer);
        if d.flags & FLAG_DROP != 0 {
            continue;
        }
        let (off, len) = (d.offset as usize, d.len as usize);
        if off + len > a.att.layout.buffer_size as usize {
            bad += 1;
            continue;
        }
        let Some(mut p) = pool::alloc() else {
            exhausted += 1;
            continue;
        };
        let src = a.att.region.bytes(slot_offset(&a.att, d.buffer) + off, len);
        if src.is_none_or(|src| p.set_data(src).is_err()) {
            bad += 1;
            continue;
        }
        p.set_timestamp_ns(a.slot_stamps[d.buffer as usize]);
        got += 1;
        if let Some(o) = out.as_mut() {
            o.transmit(p);
        }
    }
    (got, bad, exhausted)
}

/// Returns every buffer still marked in `held` to the pool; how many.
fn reclaim(held: &Held) -> u64 {
    let pool = pool::get();
    let all = held.lock().take_all();
    for &i in &all {
        // Safety: the bit says this buffer was given up to the function and not returned; the
        // function is gone, and no channel can still hand it on.
        drop(unsafe { pool.take(i) });
    }
    all.len() as u64
}

pub struct NfPort {
    shared: Arc<PortShared>,
    listener: Arc<Listener>,
    active: Option<Active>,
    leaving: Vec<Leaving>,
    /// What this port says it is at its links' ends — a function port a switch can join to
    /// another, a reader of an interface's rings — and the links tagged so far.
    tagged: TaggedEnds,
    direct_packets: Counter,
    /// Frames the function read straight from an interface's rings and forwarded.
    steered: Counter,
    batch: u32,
    max_delay: Duration,
    to_nf: Counter,
    from_nf: Counter,
    down_drops: Counter,
    ring_full_drops: Counter,
    too_big_drops: Counter,
    offload_drops: Counter,
    /// Packets of one push with their offloads resolved (kept to reuse its room).
    finished: Vec<Packet>,
    bad_descriptors: Counter,
    pool_drops: Counter,
    attaches: Counter,
    detaches: Counter,
    reclaimed: Counter,
    /// Packets a function had in its rings when the Stitch process before this one ended
    /// (it said so when it attached again).
    restart_lost: Counter,
    wakeups: Counter,
    attached: Counter,
    /// Devices its guest's QEMU would not plug (a function in a VM: [`crate::guest`]).
    guest_plug_refusals: Counter,
    /// Direct channels into its guest that reused the devices of the pair's last channel.
    guest_channels_reused: Counter,
    /// Taken over from a predecessor process: the generation its attachment had there.
    lent_generation: Option<u64>,
    /// Taken over: the descriptors of the steered input the predecessor served, if any.
    lent_steering: Vec<std::os::fd::OwnedFd>,
}

impl App for NfPort {
    type Config = NfPortConfig;
    const EXAMPLE: &'static str = "mode: isolated
wake: blocking
allow_users: [nobody]
";

    fn declare(c: &NfPortConfig) -> Result<PortSpec, AppError> {
        crate::peers::Peers::named(&c.allow_users, &c.allow_groups)?;
        if !c.ring_size.is_power_of_two() || !(16..=65536).contains(&c.ring_size) {
            return Err(format!(
                "ring_size {} must be a power of two from 16 to 65536",
                c.ring_size
            )
            .into());
        }
        if c.batch == 0 || c.batch > c.ring_size {
            return Err(format!("batch {} must be 1..=ring_size", c.batch).into());
        }
        if !(64..=9216).contains(&c.buffer_size) {
            return Err(format!("buffer_size {} must be 64..=9216", c.buffer_size).into());
        }
        Ok(PortSpec::filter())
    }

    fn new(c: NfPortConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let name = c.port.clone().unwrap_or_else(|| ctx.name().to_string());
        let socket = c
            .socket
            .clone()
            .map(|p| ctx.path(p))
            .unwrap_or_else(default_socket);
        let settings = c.settings();
        let inherited = ctx
            .take_inherited()
            .map(|d| handover::lend_socket(&socket, d));
        let listener = listener::listener(&socket)
            .map_err(|e| format!("cannot serve function ports on {}: {e}", socket.display()))?;
        let shared = PortShared::new(&name, settings);
        *shared.peers.lock().unwrap() =
            crate::peers::Peers::named(&c.allow_users, &c.allow_groups)?;
        listener.register(shared.clone())?;
        let tagged = TaggedEnds::new(EndTag::new(vec![
            shared.clone(),
            Arc::new(shared.clone() as Arc<dyn RingBorrower>),
        ]));
        let mut port = NfPort {
            shared,
            listener,
            active: None,
            leaving: Vec::new(),
            tagged,
            direct_packets: ctx.counter("direct_channel_packets"),
            steered: ctx.counter("steered_packets"),
            batch: c.batch,
            max_delay: Duration::from_micros(c.max_delay_us),
            to_nf: ctx.counter("to_function"),
            from_nf: ctx.counter("from_function"),
            down_drops: ctx.counter("down_drops"),
            ring_full_drops: ctx.counter("ring_full_drops"),
            too_big_drops: ctx.counter("too_big_drops"),
            offload_drops: ctx.counter("offload_drops"),
            finished: Vec::with_capacity(256),
            bad_descriptors: ctx.counter("bad_descriptors"),
            pool_drops: ctx.counter("pool_exhausted_drops"),
            attaches: ctx.counter("attaches"),
            detaches: ctx.counter("detaches"),
            reclaimed: ctx.counter("reclaimed_drops"),
            restart_lost: ctx.counter("restart_lost"),
            wakeups: ctx.counter("wakeups"),
            attached: ctx.counter("attached"),
            guest_plug_refusals: ctx.counter("guest_plug_refusals"),
            guest_channels_reused: ctx.counter("guest_channels_reused"),
            lent_generation: None,
            lent_steering: Vec::new(),
        };
        if let Some(d) = inherited {
            port.adopt(d)?;
        }
        Ok(port)
    }

    fn reconfigure(
        &mut self,
        c: NfPortConfig,
        _: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        // A function holds the region of the old settings: a new one needs a new port.
        if c.settings() != self.shared.settings {
            return Ok(Reconfigured::Restart);
        }
        self.batch = c.batch;
        self.max_delay = Duration::from_micros(c.max_delay_us);
        // Taken at the next hello; an attached function stays.
        *self.shared.peers.lock().unwrap() =
            crate::peers::Peers::named(&c.allow_users, &c.allow_groups)?;
        Ok(Reconfigured::Done)
    }

    fn pull(&mut self, io: &mut Io) {
        self.tag_link_ends(io);
        // A plain load first: the flag's cache line stays shared until the listener writes it.
        if self.shared.changed.load(Ordering::Relaxed)
            && self.shared.changed.swap(false, Ordering::AcqRel)
        {
            self.attach_or_detach();
            self.tend_guest_channels();
            self.take_direct_offers();
            self.take_steer_offer();
        }
        if !self.leaving.is_empty() {
            self.drain_leaving(io);
        }
        if HAS_ORPHANS.load(Ordering::Relaxed) {
            finish_orphans();
        }
        let Some(a) = self.active.as_mut() else {
            return;
        };
        // The head of `from_nf` first: whatever the function returns there that it read from
        // an incoming channel, it read before this load — and is accounted just below.
        let Some(n) = a.from_nf.available() else {
            log::warn!(
                "function port `{}`: the function (pid {}) corrupted its ring; detaching it \
                 (it attaches again on new rings)",
                self.shared.name,
                a.att.pid
            );
            self.bad_descriptors.add(1);
            self.cut_off();
            return;
        };
        if let Some(d) = &a.incoming {
            let consumed = io.input(0).map_or(0, |c| c.ring().rx_packets());
            let (live, read) = d.receiver_pull(consumed, true);
            self.direct_packets.add(read);
            if !live {
                self.clear_direct(false);
            }
        }
        let a = self.active.as_mut().expect("attached");
        let step = match &a.outgoing {
            Some(d) => {
                let sent = io.output(0).map_or(0, |o| o.ring().tx_packets());
                d.sender_step(sent, true)
            }
            None => SenderStep::FromNf,
        };
        if step == SenderStep::Retired {
            self.clear_direct(true);
        }
        if matches!(
            step,
            SenderStep::FromNf | SenderStep::FromNfThenChannel | SenderStep::Retired
        ) && n > 0
        {
            self.receive(n, io);
        }
        if matches!(step, SenderStep::FromNfThenChannel | SenderStep::Channel) {
            self.receive_channel(io);
        }
        if self.active.as_ref().is_some_and(|a| a.steering.is_some()) {
            self.steer_step(io);
        }
        if self.shared.settings.blocking {
            self.maybe_wake();
        }
    }

    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        if input.is_empty() {
            // Thousands of ports per breath: touch nothing shared when there is nothing to send.
            return;
        }
        let Some(a) = self.active.as_mut() else {
            let n = input.drain().count();
            self.down_drops.add(n as u64);
            return;
        };
        if a.pool_unsent {
            // Taken over: the function gets this process's packet memory first.
            return;
        }
        let Some(mut room) = a.to_nf.free() else {
            input.drain().for_each(drop);
            self.bad_descriptors.add(1);
            self.cut_off();
            return;
        };
        // A function gets final packets, as a NIC would give them: checksums complete and
        // super-frames cut to MTU-sized segments (its buffers hold one frame, and the offload
        // state does not survive the trip through a process, whose writes Stitch does not trust).
        //
        // Only what the ring has room for leaves the link: the rest waits there (backpressure),
        // so a function that stalls for a moment is covered by its ring and the link together.
        let zero_copy = self.shared.settings.zero_copy;
        let fits = if zero_copy {
            room as usize
        } else {
            (room as usize).min(a.free_slots.len())
        };
        let mut finished = std::mem::take(&mut self.finished);
        let mut bad_offloads = 0u64;
        for p in input.drain().take(fits) {
            if finish_offloads(p, &mut finished).is_err() {
                bad_offloads += 1;
            }
        }
        self.offload_drops.add(bad_offloads);
        let stamp = stitch_core::packet::now_ns() as u32;
        let (mut sent, mut full, mut big) = (0u64, 0u64, 0u64);
        let pool = pool::get();
        let held_arc = a.held.clone();
        let mut held = held_arc.lock();
        for p in finished.drain(..) {
            if room == 0 {
                full += 1;
                continue;
            }
            if zero_copy {
                if p.is_large() {
                    big += 1;
                    continue;
                }
                let index = pool.index_of(&p) as u32;
                held.hold(index);
                a.to_nf.put(Desc {
                    buffer: index,
                    offset: p.headroom() as u16,
                    flags: 0,
                    len: p.len() as u32,
                    stamp_lo: stamp,
                });
                // The function holds the buffer now; it comes back through `from_nf` or is
                // reclaimed on detach.
                let _ = p.into_raw();
            } else {
                if p.len() > a.att.layout.buffer_size as usize {
                    big += 1;
                    continue;
                }
                let Some(slot) = a.free_slots.pop() else {
                    full += 1;
                    continue;
                };
                if !a.att.region.write(slot_offset(&a.att, slot), p.data()) {
                    big += 1;
                    continue;
                }
                held.hold(slot);
                a.slot_stamps[slot as usize] = p.timestamp_ns();
                a.to_nf.put(Desc {
                    buffer: slot,
                    offset: 0,
                    flags: 0,
                    len: p.len() as u32,
                    stamp_lo: stamp,
                });
            }
            room -= 1;
            sent += 1;
        }
        drop(held);
        self.finished = finished;
        if sent > 0 {
            a.to_nf.publish();
            self.to_nf.add(sent);
            self.handed_over(sent);
        }
        self.ring_full_drops.add(full);
        self.too_big_drops.add(big);
    }

    fn tick(&mut self, _io: &mut Io, _now: Instant) {
        self.tend_guest_channels();
        self.unplug_left_in_guest();
    }

    fn stop(&mut self) {
        self.detach();
        self.orphan_channels();
        self.listener.unregister(&self.shared);
    }

    fn hand_over(&mut self) -> Option<stitch_core::Descriptors> {
        self.lend()
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        self.resume(position)
    }

    /// The packets its function holds, and one for each direct channel not yet given back:
    /// an upgrade's drain pulls the port until the channel retired (the switch hands its
    /// channels back as the upgrade begins, and a function in a slow guest may take a while).
    fn outstanding(&self) -> u64 {
        let active = self.active.as_ref().map_or(0, |a| {
            let channels = u64::from(a.outgoing.is_some()) + u64::from(a.incoming.is_some());
            a.held.lock().count() + channels
        });
        active
            + self
                .leaving
                .iter()
                .map(|l| l.held.lock().count())
                .sum::<u64>()
    }

    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        let s = self.shared.settings;
        serde_json::json!({
            "port": self.shared.name,
            "socket": self.listener.path(),
            "mode": if s.zero_copy { "zero_copy" } else { "isolated" },
            "wake": if s.blocking { "blocking" } else { "polling" },
            "attached": self.active.is_some(),
            "pid": self.active.as_ref().map(|a| a.att.pid),
            // In a guest, `pid` is its QEMU's.
            "in_guest": self.active.as_ref().map(|a| a.att.guest.is_some()),
            "guest_devices": self.active.as_ref().map(|a| &a.att.guest_devices),
            "direct_out": self.active.as_ref().and_then(|a| a.outgoing.as_ref()).map(|d| format!("{} ({:?})", d.to.name, d.phase())),
            "direct_in": self.active.as_ref().and_then(|a| a.incoming.as_ref()).map(|d| format!("{} ({:?})", d.from.name, d.phase())),
            "steered_from": self.active.as_ref().and_then(|a| a.steering.as_ref()).map(|s| s.offer.from.clone()),
        })
    }
}

/// `p` as final packets into `out`: a super-frame cut into segments, partial checksums
/// completed. Err when the offload metadata does not fit the frame (the packet is dropped).
fn finish_offloads(
    mut p: Packet,
    out: &mut Vec<Packet>,
) -> Result<(), stitch_wire::offload::OffloadError> {
    use stitch_wire::offload;
    if p.header().gso_type == offload::GSO_NONE {
        offload::complete_checksum(&mut p)?;
        out.push(p);
        return Ok(());
    }
    let mut bad = Ok(());
    offload::resolve_gso(p, |mut seg| match offload::complete_checksum(&mut seg) {
        Ok(()) => out.push(seg),
        Err(e) => bad = Err(e),
    })?;
    bad
}

impl NfPort {
    fn attach_or_detach(&mut self) {
        (self.guest_plug_refusals).set(self.shared.guest_plug_refusals.load(Ordering::Relaxed));
        (self.guest_channels_reused).set(self.shared.guest_channels_reused.load(Ordering::Relaxed));
        if self.active.as_ref().is_some_and(|a| a.pool_unsent) {
            self.send_pool();
        }
        if let Some(a) = &self.active {
            if self.shared.closed.load(Ordering::Acquire) >= a.att.generation {
                log::info!(
                    "function (pid {}) left port `{}`",
                    a.att.pid,
                    self.shared.name
                );
                self.detach();
            }
        }
        if self.active.is_none() {
            if let Some(att) = self.shared.incoming.lock().unwrap().take() {
                if self.shared.closed.load(Ordering::Acquire) >= att.generation {
                    return; // It left before it was ever served.
                }
                self.shared.busy.store(true, Ordering::Release);
                self.restart_lost.add(att.lost_before.unwrap_or(0));
                let a = Active::new(att, self.shared.settings.zero_copy);
                *self.shared.current.lock().unwrap() = Some(Current {
                    generation: a.att.generation,
                    held: a.held.clone(),
                    doorbell: a.att.doorbell.clone(),
                    blocking: self.shared.settings.blocking,
                    in_guest: a.att.guest.is_some(),
                });
                self.active = Some(a);
                self.attaches.add(1);
                self.attached.set(1);
            }
        }
    }

    /// Says on each of its links "a function port is here", so that a switch at the other end
    /// can offer it a direct channel.
    fn tag_link_ends(&mut self, io: &mut Io) {
        if self.shared.settings.zero_copy {
            io.tag_ends(&mut self.tagged);
        }
    }

    /// Sends direct channels a switch offered to the function; ends those meant for another
    /// attachment.
    fn take_direct_offers(&mut self) {
        let slots = self.shared.direct.lock().unwrap();
        let (out, inc) = (slots.outgoing.clone(), slots.incoming.clone());
        drop(slots);
        for (d, outgoing) in [(out, true), (inc, false)] {
            let Some(d) = d else { continue };
            let Some(a) = self.active.as_mut() else {
                // No function to give it to: ended at once (nothing was ever written to it).
                d.end();
                if outgoing {
                    d.sender_step(0, false);
                } else {
                    d.receiver_left();
                }
                self.shared.forget_direct(&d, outgoing);
                continue;
            };
            let mine = if outgoing { &a.outgoing } else { &a.incoming };
            if mine.as_ref().is_some_and(|m| Arc::ptr_eq(m, &d)) {
                continue;
            }
            let generation = if outgoing {
                d.sender.generation
            } else {
                d.receiver.generation
            };
            if generation != a.att.generation || !a.send_direct(&d, outgoing, &self.shared) {
                d.end();
            }
            if outgoing {
                a.outgoing = Some(d);
            } else {
                a.incoming = Some(d);
            }
        }
    }

    /// Takes an interface's offer of its sockets for the function; declines it (the interface
    /// reads them again) when no function is attached or they cannot be mapped.
    fn take_steer_offer(&mut self) {
        let Some(offer) = self.shared.steer.lock().unwrap().clone() else {
            return;
        };
        if offer.phase() == steer::DONE {
            return;
        }
        let Some(a) = self.active.as_mut() else {
            offer.finish();
            self.forget_steer(&offer);
            return;
        };
        if a.steering.is_some() {
            return;
        }
        match Steering::new(offer.clone()) {
            Ok(st) => a.steering = Some(st),
            Err(e) => {
                log::warn!(
                    "function port `{}`: frames steered from {} stay on the engine's path: {e}",
                    self.shared.name,
                    offer.from
                );
                offer.finish();
                self.forget_steer(&offer);
            }
        }
    }

    /// Sends the sockets once the frames read before are all in the function's ring; hands
    /// them back when the interface asks.
    fn steer_step(&mut self, io: &mut Io) {
        let a = self.active.as_mut().expect("attached");
        let mut st = a.steering.take().expect("steering");
        if !st.sent() {
            if io.input(0).is_some_and(|i| !i.is_empty()) {
                a.steering = Some(st);
                return;
            }
            let sent = match st.message() {
                Ok((msg, fds)) => a.send_control(&msg, &fds, "steered input"),
                Err(e) => {
                    log::warn!("steered input for port `{}`: {e}", self.shared.name);
                    false
                }
            };
            if !sent {
                self.end_steering(st);
                return;
            }
            log::info!(
                "function (pid {}) of port `{}` reads the frames {} steers to it",
                a.att.pid,
                self.shared.name,
                st.offer.from
            );
            st.offer.phase.store(steer::FUNCTION, Ordering::Release);
            a.steering = Some(st);
            return;
        }
        if st.offer.end.load(Ordering::Acquire)
            && st.hand_back(&a.from_nf, || direct::ring_doorbell(&a.att.doorbell))
        {
            self.end_steering(st);
            return;
        }
        a.steering = Some(st);
    }

    /// The interface reads its sockets again from where the function's frames came back.
    fn end_steering(&mut self, st: Steering) {
        st.offer.finish();
        self.forget_steer(&st.offer);
    }

    fn forget_steer(&self, offer: &Arc<steer::SteerOffer>) {
        let mut slot = self.shared.steer.lock().unwrap();
        if slot.as_ref().is_some_and(|o| Arc::ptr_eq(o, offer)) {
            *slot = None;
        }
    }

    /// The port is going away: its function's channels are finished by the ports that remain.
    fn orphan_channels(&mut self) {
        if self.leaving.is_empty() {
            return;
        }
        ORPHANS.lock().unwrap().append(&mut self.leaving);
        HAS_ORPHANS.store(true, Ordering::Relaxed);
    }

    /// Counts the messages of channels plugged into the function's guest since the last
    /// look; ends those QEMU refused (their traffic stays with the switch); unplugs those
    /// retired that the function let go.
    fn tend_guest_channels(&mut self) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        self.shared.expire_spares();
        if a.guest_channels.is_empty() {
            return;
        }
        let t = a.guest_channels.tend(&self.shared);
        if t.told > 0 {
            a.control_sent += t.told;
            (a.att.header().control.0).store(a.control_sent, Ordering::Release);
        }
        for (d, e) in t.refused {
            log::warn!(
                "function port `{}`: no direct channel into its guest: {e}; the switch keeps \
                 the traffic (and offers one again in {} s)",
                self.shared.name,
                direct::CHANNEL_RETRY.as_secs()
            );
            *self.shared.channel_refused_at.lock().unwrap() = Some(Instant::now());
            d.end();
        }
    }

    /// Forgets a retired channel (and frees its slot for the next offer).
    fn clear_direct(&mut self, outgoing: bool) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        let d = if outgoing {
            a.outgoing.take()
        } else {
            a.incoming.take()
        };
        if let Some(d) = d {
            a.guest_channels.retire(&d);
            self.shared.forget_direct(&d, outgoing);
        }
    }

    /// Reads an outgoing channel as its consumer (before the receiver takes it, after it let go).
    fn receive_channel(&mut self, io: &mut Io) {
        let a = self.active.as_mut().expect("attached");
        let d = a.outgoing.clone().expect("a channel");
        let Some((got, bad)) = read_channel(&d, &a.held, io.output(0)) else {
            self.bad_descriptors.add(1);
            d.end();
            return;
        };
        self.from_nf.add(got);
        self.bad_descriptors.add(bad);
    }

    /// Channels of functions that left: read empty, then their buffers reclaimed.
    fn drain_leaving(&mut self, io: &mut Io) {
        let sent = io.output(0).map_or(0, |o| o.ring().tx_packets());
        let mut i = 0;
        while i < self.leaving.len() {
            let l = &self.leaving[i];
            match l.direct.sender_step(sent, false) {
                SenderStep::Channel => {
                    if let Some((got, bad)) = read_channel(&l.direct, &l.held, io.output(0)) {
                        self.from_nf.add(got);
                        self.bad_descriptors.add(bad);
                    } else {
                        // An impossible head from a dead function: nothing more to read.
                        self.retire_leaving(i);
                        continue;
                    }
                }
                SenderStep::Retired => {
                    self.retire_leaving(i);
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }

    fn retire_leaving(&mut self, i: usize) {
        let l = self.leaving.swap_remove(i);
        self.reclaimed.add(reclaim(&l.held));
        self.shared.forget_direct(&l.direct, true);
    }

    /// Detaches a function this port will serve no more although it is still there (it broke
    /// its rings, or cannot take a message), and hangs up on it so that it knows: a function
    /// left on rings nobody serves would wait for ever; told, it attaches again (a guest's
    /// QEMU connects again, and its function says its hello).
    fn cut_off(&mut self) {
        if let Some(a) = &self.active {
            let hung_up = (a.att.conn.try_clone()).and_then(|c| {
                std::os::unix::net::UnixStream::from(c).shutdown(std::net::Shutdown::Both)
            });
            if let Err(e) = hung_up {
                log::warn!(
                    "function port `{}`: cannot hang up on its function: {e}",
                    self.shared.name
                );
            }
        }
        self.detach();
    }

    /// Drops the attachment and takes back every buffer the function held.
    fn detach(&mut self) {
        let Some(mut a) = self.active.take() else {
            return;
        };
        *self.shared.current.lock().unwrap() = None;
        self.shared.forget_spares();
        // What it gave back of an interface's frames is accounted: the interface reads the
        // rest again.
        if let Some(st) = a.steering.take() {
            self.end_steering(st);
        }
        // What it read from an incoming channel is its own: accounted before the reclaim.
        if let Some(d) = a.incoming.take() {
            d.receiver_left();
            self.shared.forget_direct(&d, false);
        }
        if self.shared.settings.zero_copy {
            if let Some(d) = a.outgoing.take() {
                // Its packets on the channel still go on (read by Stitch) before its buffers
                // are reclaimed.
                d.end();
                self.leaving.push(Leaving {
                    direct: d,
                    held: a.held.clone(),
                });
            } else {
                self.reclaimed.add(reclaim(&a.held));
            }
        } else {
            self.reclaimed.add(a.held.lock().count());
        }
        drop(a);
        self.detaches.add(1);
        self.attached.set(0);
        self.shared.busy.store(false, Ordering::Release);
        // A function that attached meanwhile is picked up at the next breath.
        self.shared.changed.store(true, Ordering::Release);
    }

    fn receive(&mut self, n: u32, io: &mut Io) {
        // No more than the output link takes: the rest waits in the function's ring (and the
        // function, once that is full, waits too) instead of being dropped on the link.
        let n = io
            .output(0)
            .map_or(n, |o| n.min(o.room().min(u32::MAX as usize) as u32));
        if n == 0 {
            return;
        }
        let a = self.active.as_mut().expect("attached");
        let (got, bad, exhausted) = if self.shared.settings.zero_copy {
            let t = take_back(
                &mut a.from_nf,
                n,
                &a.held,
                io.output(0),
                a.steering.as_mut(),
            );
            self.steered.add(t.steered);
            (t.forwarded, t.bad, t.exhausted)
        } else {
            copy_back(a, n, io.output(0))
        };
        a.from_nf.release();
        self.from_nf.add(got);
        self.bad_descriptors.add(bad);
        self.pool_drops.add(exhausted);
        if bad > 0 {
            log::debug!(
                "function port `{}`: {bad} bad descriptors from pid {}",
                self.shared.name,
                a.att.pid
            );
        }
    }

    /// After `sent` packets were put in the function's ring: a blocking function is woken when
    /// enough wait or the oldest waited long enough.
    fn handed_over(&mut self, sent: u64) {
        if !self.shared.settings.blocking {
            return;
        }
        let Some(a) = self.active.as_mut() else {
            return;
        };
        a.unsignalled += sent as u32;
        if a.waiting_since.is_none() {
            a.waiting_since = Some(stitch_core::engine::breath_started());
        }
        self.maybe_wake();
    }

    /// Rings the function's doorbell when enough waits or the oldest waited long enough, and
    /// it sleeps. Whether it is due is decided first, from this port's own state and the
    /// breath's clock: with thousands of ports, most checks touch no line a function wrote.
    fn maybe_wake(&mut self) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        let Some(since) = a.waiting_since else {
            return;
        };
        let aged = stitch_core::engine::breath_started().saturating_duration_since(since)
            >= self.max_delay;
        if a.unsignalled < self.batch && !aged {
            return;
        }
        let sleeping = &a.att.header().sleeping.0;
        // Pairs with the function's store of `sleeping` before it looks at the ring once more:
        // either it sees the packets just published or this load sees it asleep.
        std::sync::atomic::fence(Ordering::SeqCst);
        if sleeping.load(Ordering::SeqCst) == 0 {
            // Awake: it will see the ring without a doorbell.
            a.nothing_waits();
            return;
        }
        // What waits now, not what was handed over: it may have taken some before it slept.
        let pending = a.to_nf.pending();
        if pending == 0 {
            a.nothing_waits();
            return;
        }
        if pending < self.batch && !aged {
            a.unsignalled = pending;
            return;
        }
        if sleeping
            .compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let one: u64 = 1;
            // SAFETY: the kernel reads 8 bytes from `one`, a live u64.
            unsafe {
                libc::write(
                    a.att.doorbell.as_raw_fd(),
                    &one as *const u64 as *const libc::c_void,
                    8,
                );
            }
            self.wakeups.add(1);
            a.nothing_waits();
        }
    }
}

impl Drop for NfPort {
    fn drop(&mut self) {
        self.detach();
        self.orphan_channels();
        self.listener.unregister(&self.shared);
    }
}

/// Channels whose sending port was removed while they still held its function's packets:
/// any other function port finishes them (reads them empty, frees what is left).
static ORPHANS: Mutex<Vec<Leaving>> = Mutex::new(Vec::new());
static HAS_ORPHANS: AtomicBool = AtomicBool::new(false);

fn finish_orphans() {
    let Ok(mut orphans) = ORPHANS.try_lock() else {
        return;
    };
    orphans.retain(|l| match l.direct.sender_step(0, false) {
        SenderStep::Channel => {
            if read_channel(&l.direct, &l.held, None).is_some() {
                true
            } else {
                reclaim(&l.held);
                false
            }
        }
        SenderStep::Retired => {
            reclaim(&l.held);
            false
        }
        _ => true,
    });
    HAS_ORPHANS.store(!orphans.is_empty(), Ordering::Relaxed);
}
