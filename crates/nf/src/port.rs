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
//! When a function exits, crashes or is killed, its connection closes: the port goes down, the
//! buffers it held are reclaimed (`reclaimed`), counters are kept, and it can attach again.
//!
//! ```yaml
//! apps:
//!   tenant1: { type: nf_port, socket: /run/stitch/nf.sock, mode: isolated, wake: blocking,
//!              batch: 1, max_delay_us: 50 }
//! links:
//!   - "in.output -> tenant1.input"
//!   - "tenant1.output -> out.input"
//! ```

use crate::listener::{self, Attachment, Listener, PortSettings, PortShared};
use crate::shm::{Consumer, Desc, Producer, FLAG_DROP};
use serde::Deserialize;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::app::{AppContext, AppError, Counter, Io, PortSpec, Reconfigured};
use stitch_core::{pool, App, Packet};

#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    ZeroCopy,
    Isolated,
}

#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Wake {
    #[default]
    Polling,
    Blocking,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NfPortConfig {
    /// Name the function asks for (default: the app's name).
    #[serde(default)]
    pub port: Option<String>,
    /// Attach socket (default: `/run/stitch/nf.sock` for root).
    #[serde(default)]
    pub socket: Option<PathBuf>,
    #[serde(default)]
    pub mode: Mode,
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
fn default_ring() -> u32 {
    512
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

/// The default attach socket.
pub fn default_socket() -> PathBuf {
    stitch_core::runtime_dir().join("nf.sock")
}

struct Active {
    att: Attachment,
    to_nf: Producer,
    from_nf: Consumer,
    /// Buffers (pool indices or slots) the function holds now, one bit each.
    held: Vec<u64>,
    /// Isolated: slots free for the next packets, and the receive time of the packet in each
    /// (the copy that comes back is a new packet; it keeps the original's time).
    free_slots: Vec<u32>,
    slot_stamps: Vec<u64>,
    /// Blocking: packets handed over since the function last was awake, and since when.
    unsignalled: u32,
    waiting_since: Option<Instant>,
}

impl Active {
    fn new(att: Attachment, zero_copy: bool) -> Active {
        let l = att.layout;
        let to_nf = Producer::new(unsafe { att.region.ring(l.to_nf, l.ring_size) });
        let from_nf = Consumer::new(unsafe { att.region.ring(l.from_nf, l.ring_size) });
        let bits = if zero_copy {
            pool::get().packets()
        } else {
            l.buffers as usize
        };
        Active {
            att,
            to_nf,
            from_nf,
            held: vec![0; bits.div_ceil(64)],
            free_slots: (0..l.buffers).rev().collect(),
            slot_stamps: vec![0; l.buffers as usize],
            unsignalled: 0,
            waiting_since: None,
        }
    }

    #[inline]
    fn hold(&mut self, i: u32) {
        self.held[i as usize / 64] |= 1 << (i % 64);
    }

    /// Clears the bit; false when the function did not hold that buffer.
    #[inline]
    fn release(&mut self, i: u32) -> bool {
        let Some(w) = self.held.get_mut(i as usize / 64) else {
            return false;
        };
        let bit = 1u64 << (i % 64);
        let had = *w & bit != 0;
        *w &= !bit;
        had
    }

    fn slot(&self, i: u32) -> *mut u8 {
        let l = &self.att.layout;
        unsafe {
            self.att
                .region
                .base
                .add(l.bufs + i as usize * l.buffer_size as usize)
        }
    }
}

pub struct NfPort {
    shared: Arc<PortShared>,
    listener: Arc<Listener>,
    active: Option<Active>,
    batch: u32,
    max_delay: Duration,
    to_nf: Counter,
    from_nf: Counter,
    down_drops: Counter,
    ring_full_drops: Counter,
    too_big_drops: Counter,
    bad_descriptors: Counter,
    pool_drops: Counter,
    attaches: Counter,
    detaches: Counter,
    reclaimed: Counter,
    wakeups: Counter,
    attached: Counter,
}

impl App for NfPort {
    type Config = NfPortConfig;

    fn declare(c: &NfPortConfig) -> Result<PortSpec, AppError> {
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
        let listener = listener::listener(&socket)
            .map_err(|e| format!("cannot serve function ports on {}: {e}", socket.display()))?;
        let shared = PortShared::new(&name, settings);
        listener.register(shared.clone())?;
        Ok(NfPort {
            shared,
            listener,
            active: None,
            batch: c.batch,
            max_delay: Duration::from_micros(c.max_delay_us),
            to_nf: ctx.counter("to_function"),
            from_nf: ctx.counter("from_function"),
            down_drops: ctx.counter("down_drops"),
            ring_full_drops: ctx.counter("ring_full_drops"),
            too_big_drops: ctx.counter("too_big_drops"),
            bad_descriptors: ctx.counter("bad_descriptors"),
            pool_drops: ctx.counter("pool_exhausted_drops"),
            attaches: ctx.counter("attaches"),
            detaches: ctx.counter("detaches"),
            reclaimed: ctx.counter("reclaimed"),
            wakeups: ctx.counter("wakeups"),
            attached: ctx.counter("attached"),
        })
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
        Ok(Reconfigured::Done)
    }

    fn pull(&mut self, io: &mut Io) {
        // A plain load first: the flag's cache line stays shared until the listener writes it.
        if self.shared.changed.load(Ordering::Relaxed)
            && self.shared.changed.swap(false, Ordering::AcqRel)
        {
            self.attach_or_detach();
        }
        let Some(a) = self.active.as_mut() else {
            return;
        };
        let Some(n) = a.from_nf.available() else {
            log::warn!(
                "function port `{}`: the function (pid {}) corrupted its ring; detaching it",
                self.shared.name,
                a.att.pid
            );
            self.bad_descriptors.add(1);
            self.detach();
            return;
        };
        if n > 0 {
            self.receive(n, io);
        }
        if self.shared.settings.blocking {
            self.maybe_wake(None);
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
        let Some(mut room) = a.to_nf.free() else {
            input.drain().for_each(drop);
            self.bad_descriptors.add(1);
            self.detach();
            return;
        };
        let zero_copy = self.shared.settings.zero_copy;
        let stamp = stitch_core::packet::now_ns() as u32;
        let (mut sent, mut full, mut big) = (0u64, 0u64, 0u64);
        let pool = pool::get();
        for p in input.drain() {
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
                a.hold(index);
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
                unsafe {
                    std::ptr::copy_nonoverlapping(p.data().as_ptr(), a.slot(slot), p.len());
                }
                a.hold(slot);
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
        if sent > 0 {
            a.to_nf.publish();
            self.to_nf.add(sent);
            if self.shared.settings.blocking {
                a.unsignalled += sent as u32;
                if a.waiting_since.is_none() {
                    a.waiting_since = Some(Instant::now());
                }
                self.maybe_wake(Some(Instant::now()));
            }
        }
        self.ring_full_drops.add(full);
        self.too_big_drops.add(big);
    }

    fn stop(&mut self) {
        self.detach();
        self.listener.unregister(&self.shared);
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
        })
    }
}

impl NfPort {
    fn attach_or_detach(&mut self) {
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
                self.active = Some(Active::new(att, self.shared.settings.zero_copy));
                self.attaches.add(1);
                self.attached.set(1);
            }
        }
    }

    /// Drops the attachment and takes back every buffer the function held.
    fn detach(&mut self) {
        let Some(a) = self.active.take() else {
            return;
        };
        if self.shared.settings.zero_copy {
            let pool = pool::get();
            let mut n = 0;
            for (w, bits) in a.held.iter().enumerate() {
                let mut bits = *bits;
                while bits != 0 {
                    let i = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    // Safety: the bit says this buffer was given up to the function and not
                    // returned; the function is gone.
                    drop(unsafe { pool.take(i) });
                    n += 1;
                }
            }
            self.reclaimed.add(n);
        } else {
            let held: u32 = a.held.iter().map(|w| w.count_ones()).sum();
            self.reclaimed.add(held as u64);
        }
        drop(a);
        self.detaches.add(1);
        self.attached.set(0);
        self.shared.busy.store(false, Ordering::Release);
        // A function that attached meanwhile is picked up at the next breath.
        self.shared.changed.store(true, Ordering::Release);
    }

    fn receive(&mut self, n: u32, io: &mut Io) {
        let a = self.active.as_mut().expect("attached");
        let zero_copy = self.shared.settings.zero_copy;
        let pool = pool::get();
        let (mut got, mut bad, mut exhausted) = (0u64, 0u64, 0u64);
        let mut out = io.output(0);
        for _ in 0..n {
            let d = a.from_nf.take();
            let p: Option<Packet> = if zero_copy {
                if !a.release(d.buffer) {
                    bad += 1;
                    continue;
                }
                // Safety: the function held this buffer (its bit was set) and gave it back.
                let Some(mut p) = (unsafe { pool.take(d.buffer as usize) }) else {
                    bad += 1;
                    continue;
                };
                if d.flags & FLAG_DROP != 0 {
                    continue;
                }
                if p.set_bounds(d.offset as usize, d.len as usize).is_err() {
                    bad += 1;
                    continue;
                }
                Some(p)
            } else {
                if !a.release(d.buffer) {
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
                let src = unsafe { std::slice::from_raw_parts(a.slot(d.buffer).add(off), len) };
                if p.set_data(src).is_err() {
                    bad += 1;
                    continue;
                }
                p.set_timestamp_ns(a.slot_stamps[d.buffer as usize]);
                Some(p)
            };
            if let Some(p) = p {
                got += 1;
                match out.as_mut() {
                    Some(o) => {
                        o.transmit(p);
                    }
                    None => drop(p),
                }
            }
        }
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

    /// Rings the function's doorbell when it sleeps and enough waits, or the oldest waited
    /// long enough.
    fn maybe_wake(&mut self, now: Option<Instant>) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        let Some(since) = a.waiting_since else {
            return;
        };
        let sleeping = &a.att.region.header().sleeping.0;
        // Pairs with the function's store of `sleeping` before it looks at the ring once more:
        // either it sees the packets just published or this load sees it asleep.
        std::sync::atomic::fence(Ordering::SeqCst);
        if sleeping.load(Ordering::SeqCst) == 0 {
            // Awake: it will see the ring without a doorbell.
            a.unsignalled = 0;
            a.waiting_since = None;
            return;
        }
        let due = a.unsignalled >= self.batch
            || now.unwrap_or_else(Instant::now).duration_since(since) >= self.max_delay;
        if due
            && sleeping
                .compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            let one: u64 = 1;
            unsafe {
                libc::write(
                    a.att.doorbell.as_raw_fd(),
                    &one as *const u64 as *const libc::c_void,
                    8,
                );
            }
            self.wakeups.add(1);
            a.unsignalled = 0;
            a.waiting_since = None;
        }
    }
}

impl Drop for NfPort {
    fn drop(&mut self) {
        self.detach();
        self.listener.unregister(&self.shared);
    }
}
