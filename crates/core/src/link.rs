//! Links: bounded single-producer/single-consumer rings of packet handles.
//!
//! A link is split into a [`Producer`] (held by the app that feeds it) and a [`Consumer`] (held
//! by the app that reads it). Each side keeps a private copy of the other side's index and reads
//! the shared one only when its copy says the ring is full or empty, so a packet crosses a link
//! with a slot write and an index store, even between threads. Each slot also holds its
//! packet's length, so an app that moves packets on (`forward_to`) or frees them
//! (`free_available`) counts their bytes without reading the packets. Every operation is
//! non-blocking: a full ring drops the newest packet and counts a tx drop.
//!
//! A link can be tapped while it runs ([`Ring::add_tap`]): each [`LinkTap`] sees every packet
//! the consumer is about to receive, in order, as a batch, on the consumer's thread. An untapped
//! link pays one relaxed load per batch for this. A link can carry a latency histogram
//! ([`Ring::set_latency`]) the same way: it counts, per batch, how long ago each packet the
//! consumer is about to receive was stamped.

use crate::latency::LatencyHistogram;
use crate::packet::{Packet, PacketBuf};
use arc_swap::ArcSwapOption;
use crossbeam_utils::CachePadded;
use std::any::Any;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Ring size when the graph does not give one.
pub const DEFAULT_LINK_SIZE: usize = 1024;
/// How many packets ahead of the one being written a burst of fresh packets brings in its lines.
const FRESH_AHEAD: usize = 8;

#[derive(Default)]
struct ProducerSide {
    tail: AtomicUsize,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    tx_drops: AtomicU64,
}

#[derive(Default)]
struct ConsumerSide {
    head: AtomicUsize,
    rx_packets: AtomicU64,
    /// Whether `Ring::taps` holds any tap or `Ring::latency` a histogram: read by the consumer
    /// once per batch, on its own line.
    tapped: AtomicBool,
}

/// The shared part of a link. Counters are written by one side only (relaxed load + store, no
/// read-modify-write) and may be read by anyone. In field order (`repr(C)`): each side's line,
/// then the ring's geometry — mask and both arrays' places — on one line of their own, which
/// every batch reads (left to the compiler, the mask and the arrays straddled two lines).
#[repr(C)]
pub struct Ring {
    prod: CachePadded<ProducerSide>,
    cons: CachePadded<ConsumerSide>,
    mask: usize,
    slots: Box<[UnsafeCell<MaybeUninit<Packet>>]>,
    /// Each slot's packet length, written with the slot: moving packets from link to link
    /// counts their bytes from here, without touching a packet's own memory on every hop.
    lens: Box<[UnsafeCell<u32>]>,
    /// What the app at each end says it is, for the app at the other end (see [`EndTag`]).
    producer_end: OnceLock<EndTag>,
    consumer_end: OnceLock<EndTag>,
    taps: ArcSwapOption<Vec<Arc<dyn LinkTap>>>,
    latency: ArcSwapOption<LatencyHistogram>,
    /// Serialises adding and removing taps and histograms (the data path never takes it).
    tap_edit: Mutex<()>,
}

/// Something that watches the packets a link delivers (a capture). `observe` is called on the
/// consumer's thread with each run of packets as the consumer first sees them, oldest first, in
/// one or two slices (the ring wraps); it must not block: a tap that cannot keep up drops and
/// counts on its own side.
pub trait LinkTap: Send + Sync {
    fn observe(&self, packets: &[Packet]);
}

/// An app's description of itself at its end of a link, set once per link. An app that can
/// take part in something beyond packets — a function port that can be joined straight to
/// another (the inter-VNF bypass), or that can read an interface's rings itself — says so
/// here, one facet per role, and the app at the other end asks for the facet it knows.
#[derive(Clone)]
pub struct EndTag(Arc<[Arc<dyn Any + Send + Sync>]>);

impl EndTag {
    /// A tag of these facets, each a value of a type of its own.
    pub fn new(facets: Vec<Arc<dyn Any + Send + Sync>>) -> EndTag {
        EndTag(facets.into())
    }

    /// The facet of type `T`, if the app gave one.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let facet = self.0.iter().find(|f| (***f).is::<T>())?;
        facet.clone().downcast::<T>().ok()
    }
}

/// An app's tag and the links (by ring) it has tagged with it so far ([`crate::Io::tag_ends`]).
pub struct TaggedEnds {
    pub(crate) tag: EndTag,
    pub(crate) tagged: [usize; 2],
}

impl TaggedEnds {
    pub fn new(tag: EndTag) -> TaggedEnds {
        TaggedEnds {
            tag,
            tagged: [0; 2],
        }
    }
}

// SAFETY: slots are accessed only by the single producer (writes) and the single consumer
// (reads), with ownership handed over by the release/acquire pair on `tail` and `head`.
unsafe impl Sync for Ring {}
// SAFETY: a Ring owns Packets, which are Send; see Sync for how the slots are shared.
unsafe impl Send for Ring {}

/// Counters of one link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkStats {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tx_drops: u64,
    pub rx_packets: u64,
    /// Packets queued at the moment of reading.
    pub queued: u64,
}

#[inline(always)]
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

impl Ring {
    #[inline(always)]
    fn slot_ptr(&self, at: usize) -> *mut MaybeUninit<Packet> {
        UnsafeCell::raw_get(self.slots[at..].as_ptr())
    }

    #[inline(always)]
    fn len_ptr(&self, at: usize) -> *mut u32 {
        UnsafeCell::raw_get(self.lens[at..].as_ptr())
    }

    /// Writes `p` and its length into slot `at`; returns the length.
    ///
    /// # Safety
    /// Slot `at` is free and the caller is the ring's one producer; the consumer reads the slot
    /// only after the producer's next release store of `tail`.
    #[inline(always)]
    unsafe fn put(&self, at: usize, p: Packet) -> u32 {
        let len = p.len() as u32;
        // SAFETY: the caller's contract: the slot is free and no one else writes or reads it.
        unsafe {
            (*self.slots[at].get()).write(p);
            *self.lens[at].get() = len;
        }
        len
    }

    /// Slots `from..from + n` (unmasked indexes, `n` ≤ capacity) as at most two contiguous runs
    /// of the arrays, `(first slot, count)`; the second is empty unless the ring wraps.
    #[inline(always)]
    fn runs(&self, from: usize, n: usize) -> [(usize, usize); 2] {
        let start = from & self.mask;
        let first = n.min(self.mask + 1 - start);
        [(start, first), (0, n - first)]
    }

    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    pub fn len(&self) -> usize {
        let t = self.prod.tail.load(Ordering::Acquire);
        let h = self.cons.head.load(Ordering::Acquire);
        t.wrapping_sub(h)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tags the producing end (once; later calls keep the first tag).
    pub fn tag_producer_end(&self, tag: EndTag) {
        let _ = self.producer_end.set(tag);
    }

    /// Tags the consuming end (once; later calls keep the first tag).
    pub fn tag_consumer_end(&self, tag: EndTag) {
        let _ = self.consumer_end.set(tag);
    }

    pub fn producer_end(&self) -> Option<&EndTag> {
        self.producer_end.get()
    }

    pub fn consumer_end(&self) -> Option<&EndTag> {
        self.consumer_end.get()
    }

    /// Starts showing the packets this link delivers to `tap` (from the next batch on). Several
    /// taps may watch one link.
    pub fn add_tap(&self, tap: Arc<dyn LinkTap>) {
        let _edit = self.tap_edit.lock().unwrap_or_else(|e| e.into_inner());
        let mut taps: Vec<_> = self
            .taps
            .load_full()
            .map(|t| t.to_vec())
            .unwrap_or_default();
        taps.push(tap);
        self.taps.store(Some(Arc::new(taps)));
        self.cons.tapped.store(true, Ordering::Release);
    }

    /// Stops showing packets to `tap` (the same `Arc` given to `add_tap`); returns whether it
    /// was there. The consumer may still be inside a call to `observe` when this returns.
    pub fn remove_tap(&self, tap: &Arc<dyn LinkTap>) -> bool {
        let _edit = self.tap_edit.lock().unwrap_or_else(|e| e.into_inner());
        let Some(current) = self.taps.load_full() else {
            return false;
        };
        let rest: Vec<_> = current
            .iter()
            .filter(|t| !std::ptr::addr_eq(Arc::as_ptr(t), Arc::as_ptr(tap)))
            .cloned()
            .collect();
        let removed = rest.len() != current.len();
        if rest.is_empty() {
            let measured = self.latency.load().is_some();
            self.cons.tapped.store(measured, Ordering::Release);
            self.taps.store(None);
        } else {
            self.taps.store(Some(Arc::new(rest)));
        }
        removed
    }

    /// Starts (`Some`) or stops (`None`) counting the latency of the packets this link
    /// delivers in `histogram`, from the next batch on.
    pub fn set_latency(&self, histogram: Option<Arc<LatencyHistogram>>) {
        let _edit = self.tap_edit.lock().unwrap_or_else(|e| e.into_inner());
        let watched = histogram.is_some() || self.taps.load().is_some();
        self.latency.store(histogram);
        self.cons.tapped.store(watched, Ordering::Release);
    }

    /// The histogram counting this link's latency, if it has one.
    pub fn latency(&self) -> Option<Arc<LatencyHistogram>> {
        self.latency.load_full()
    }

    /// Taps watching this link now.
    pub fn tap_count(&self) -> usize {
        self.taps.load().as_ref().map_or(0, |t| t.len())
    }

    /// Packets the producer has queued so far (without the drops): cheaper than `stats()`.
    pub fn tx_packets(&self) -> u64 {
        self.prod.tx_packets.load(Ordering::Relaxed)
    }

    /// Packets the consumer has taken so far.
    pub fn rx_packets(&self) -> u64 {
        self.cons.rx_packets.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> LinkStats {
        LinkStats {
            tx_packets: self.prod.tx_packets.load(Ordering::Relaxed),
            tx_bytes: self.prod.tx_bytes.load(Ordering::Relaxed),
            tx_drops: self.prod.tx_drops.load(Ordering::Relaxed),
            rx_packets: self.cons.rx_packets.load(Ordering::Relaxed),
            queued: self.len() as u64,
        }
    }

    /// Sum of counters that change whenever either side does work; the engine compares it
    /// between breaths to detect idleness.
    #[inline]
    pub fn activity(&self) -> u64 {
        self.prod.tx_packets.load(Ordering::Relaxed)
            + self.prod.tx_drops.load(Ordering::Relaxed)
            + self.cons.rx_packets.load(Ordering::Relaxed)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Free queued packets.
        let mut h = *self.cons.head.get_mut();
        let t = *self.prod.tail.get_mut();
        while h != t {
            // SAFETY: slots head..tail hold packets written by the producer and not yet read;
            // `&mut self` means no producer or consumer is left.
            unsafe { (*self.slots[h & self.mask].get()).assume_init_drop() };
            h = h.wrapping_add(1);
        }
    }
}

/// Buffers taken into a link's slots and not yet queued: freed if the app writing them
/// unwinds (the engine catches an app's panic and carries on), forgotten once queued.
struct FreeUnqueued(*const NonNull<PacketBuf>, usize);

impl Drop for FreeUnqueued {
    fn drop(&mut self) {
        // SAFETY: the `self.1` slots from `self.0` were written by `pool::take_owned` and the
        // tail was not moved past them, so nothing else holds or will read these buffers.
        unsafe { crate::pool::free_owned(std::slice::from_raw_parts(self.0, self.1)) };
    }
}

/// Creates a link with room for `size` packets (rounded up to a power of two, at least 2).
pub fn link(size: usize) -> (Producer, Consumer) {
    let size = size.max(2).next_power_of_two();
    let slots = (0..size)
        .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
        .collect();
    let ring = Arc::new(Ring {
        prod: CachePadded::new(ProducerSide::default()),
        cons: CachePadded::new(ConsumerSide::default()),
        mask: size - 1,
        slots,
        lens: (0..size).map(|_| UnsafeCell::new(0)).collect(),
        producer_end: OnceLock::new(),
        consumer_end: OnceLock::new(),
        taps: ArcSwapOption::empty(),
        latency: ArcSwapOption::empty(),
        tap_edit: Mutex::new(()),
    });
    (
        Producer {
            ring: ring.clone(),
            tail: 0,
            cached_head: 0,
        },
        Consumer {
            ring,
            head: 0,
            cached_tail: 0,
        },
    )
}

/// The transmitting end of a link.
pub struct Producer {
    ring: Arc<Ring>,
    tail: usize,
    cached_head: usize,
}

impl Producer {
    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Free slots now (reads the consumer's index: call once per batch, not per packet).
    #[inline]
    pub fn room(&mut self) -> usize {
        self.cached_head = self.ring.cons.head.load(Ordering::Acquire);
        self.ring.mask + 1 - self.tail.wrapping_sub(self.cached_head)
    }

    /// Whether the ring has no free slot.
    #[inline]
    pub fn is_full(&mut self) -> bool {
        self.room() == 0
    }

    /// Queues one packet; when the ring is full the packet is freed and counted as a tx drop.
    /// Returns whether it was queued.
    #[inline]
    pub fn transmit(&mut self, p: Packet) -> bool {
        let cap = self.ring.mask + 1;
        if self.tail.wrapping_sub(self.cached_head) == cap {
            self.cached_head = self.ring.cons.head.load(Ordering::Acquire);
            if self.tail.wrapping_sub(self.cached_head) == cap {
                bump(&self.ring.prod.tx_drops, 1);
                drop(p);
                return false;
            }
        }
        // SAFETY: the slot at tail is free (the ring is not full, checked above), this is the
        // ring's producer, and the release store of the new tail follows.
        let len = unsafe { self.ring.put(self.tail & self.ring.mask, p) };
        self.tail = self.tail.wrapping_add(1);
        self.ring.prod.tail.store(self.tail, Ordering::Release);
        let side = &*self.ring.prod;
        bump(&side.tx_packets, 1);
        bump(&side.tx_bytes, len as u64);
        true
    }

    /// Queues the packets of `batch` in order with one index update, leaving `batch` empty;
    /// those that do not fit are freed and counted as tx drops. Returns how many were queued.
    #[inline]
    pub fn transmit_batch(&mut self, batch: &mut Vec<Packet>) -> usize {
        self.transmit_batch_counted(batch).0
    }

    /// [`Producer::transmit_batch`], which also returns the bytes it queued (read from each
    /// packet once, as it is queued).
    #[inline]
    pub fn transmit_batch_counted(&mut self, batch: &mut Vec<Packet>) -> (usize, u64) {
        let n = batch.len().min(self.room());
        let mut bytes = 0u64;
        for (i, p) in batch.drain(..n).enumerate() {
            let at = self.tail.wrapping_add(i) & self.ring.mask;
            // SAFETY: slots tail..tail+n are free (n ≤ room), this is the ring's producer, and
            // the release store of the new tail follows below.
            bytes += unsafe { self.ring.put(at, p) } as u64;
        }
        self.tail = self.tail.wrapping_add(n);
        self.ring.prod.tail.store(self.tail, Ordering::Release);
        let side = &*self.ring.prod;
        bump(&side.tx_packets, n as u64);
        bump(&side.tx_bytes, bytes);
        if !batch.is_empty() {
            bump(&side.tx_drops, batch.len() as u64);
            crate::pool::free_batch(batch.drain(..));
        }
        (n, bytes)
    }

    /// Takes up to `n` fresh packets from the pool straight into this link's free slots, lets
    /// `write` make each one's frame, and queues them (a source's burst: no batch vector between
    /// the pool and the ring, and each packet's header is written once). Returns how many it
    /// queued: fewer than `n` when the link has less room, or when the pool runs out, which the
    /// pool counts.
    ///
    /// `frame_bytes` is about how long the frames `write` makes are (their usual length): the
    /// lines they fill are brought in a few packets ahead, so that the writes do not wait for
    /// them one by one. It is a hint; any length may be written.
    #[inline]
    pub fn transmit_fresh(
        &mut self,
        n: usize,
        frame_bytes: usize,
        mut write: impl FnMut(&mut Packet),
    ) -> usize {
        let n = n.min(self.room());
        let capacity = crate::pool::small_capacity();
        let mut made = 0;
        for (from, run) in self.ring.runs(self.tail, n) {
            if run == 0 {
                break;
            }
            // SAFETY: slots tail..tail+n are free (n ≤ room) and only this producer writes them
            // until the release store of the new tail below. A slot is a `Packet` behind
            // transparent wrappers, and `Packet` is a transparent buffer pointer, so the run
            // takes the pool's pointers as they are.
            let slots = unsafe {
                std::slice::from_raw_parts_mut(
                    self.ring
                        .slot_ptr(from)
                        .cast::<MaybeUninit<NonNull<PacketBuf>>>(),
                    run,
                )
            };
            let got = crate::pool::take_owned(slots);
            let unwinding = FreeUnqueued(slots.as_ptr().cast(), got);
            let mut bytes = 0u64;
            for i in 0..got {
                if i + FRESH_AHEAD < got {
                    // SAFETY: as below, slot from + i + FRESH_AHEAD holds a buffer of this burst.
                    unsafe {
                        (*self.ring.slot_ptr(from + i + FRESH_AHEAD).cast::<Packet>())
                            .prefetch_fresh(frame_bytes)
                    };
                }
                // SAFETY: `take_owned` wrote slots ..got with buffers only this link holds; the
                // packet is made fresh before `write` sees it.
                unsafe {
                    let p = &mut *self.ring.slot_ptr(from + i).cast::<Packet>();
                    p.reset(capacity);
                    write(p);
                }
            }
            // The lengths are read once the burst is written: read right after `write`, each
            // waited for the stores to its header line just made.
            for i in 0..got {
                // SAFETY: slots ..got hold the packets just written, still only this producer's
                // (the tail is not published yet); the length beside the slot is its to write.
                unsafe {
                    let len = (*self.ring.slot_ptr(from + i).cast::<Packet>()).len() as u32;
                    *self.ring.len_ptr(from + i) = len;
                    bytes += len as u64;
                }
            }
            std::mem::forget(unwinding);
            self.tail = self.tail.wrapping_add(got);
            self.ring.prod.tail.store(self.tail, Ordering::Release);
            let side = &*self.ring.prod;
            bump(&side.tx_packets, got as u64);
            bump(&side.tx_bytes, bytes);
            made += got;
            if got < run {
                break;
            }
        }
        made
    }

    /// Counts `n` packets dropped by the producing app because this link was full (for apps that
    /// check `room` before building packets instead of building and dropping them).
    #[inline]
    pub fn count_drops(&mut self, n: u64) {
        bump(&self.ring.prod.tx_drops, n);
    }
}

/// The receiving end of a link.
pub struct Consumer {
    ring: Arc<Ring>,
    head: usize,
    cached_tail: usize,
}

impl Consumer {
    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }

    /// Packets ready to be received now (reads the producer's index: call once per batch).
    /// Packets seen here for the first time are shown to the link's taps.
    #[inline]
    pub fn available(&mut self) -> usize {
        let tail = self.ring.prod.tail.load(Ordering::Acquire);
        if tail != self.cached_tail && self.ring.cons.tapped.load(Ordering::Relaxed) {
            self.show_taps(tail);
        }
        self.cached_tail = tail;
        self.cached_tail.wrapping_sub(self.head)
    }

    /// Shows the packets between the last tail this consumer saw and `tail` to every tap and
    /// to the latency histogram.
    #[cold]
    #[inline(never)]
    fn show_taps(&self, tail: usize) {
        let n = tail.wrapping_sub(self.cached_tail);
        // SAFETY: slots cached_tail..tail (≥ head) hold packets the producer published with its
        // release store of `tail`, read above with acquire; they stay in place, unchanged, until
        // this consumer takes them, which it cannot do while `&self` is borrowed here, and the
        // producer does not write them before head passes them. `runs` stays inside the slots.
        // `UnsafeCell` and `MaybeUninit` have the layout of the `Packet` they wrap, so
        // initialised slots read as `[Packet]`.
        let runs = self
            .ring
            .runs(self.cached_tail, n)
            .map(|(at, count)| unsafe {
                std::slice::from_raw_parts(
                    self.ring.slot_ptr(at).cast::<Packet>().cast_const(),
                    count,
                )
            });
        if let Some(taps) = self.ring.taps.load().as_ref() {
            for tap in taps.iter() {
                for run in runs.iter().filter(|r| !r.is_empty()) {
                    tap.observe(run);
                }
            }
        }
        if let Some(histogram) = self.ring.latency.load().as_ref() {
            let now = crate::packet::now_ns();
            for run in &runs {
                histogram.observe(run, now);
            }
        }
    }

    #[inline]
    pub fn is_empty(&mut self) -> bool {
        self.available() == 0
    }

    /// Takes one packet.
    #[inline]
    pub fn receive(&mut self) -> Option<Packet> {
        if self.cached_tail == self.head && self.available() == 0 {
            return None;
        }
        // SAFETY: head < tail (a packet is available), so the producer wrote this slot and
        // published it with its release store; the slot is free again after our store below.
        let p = unsafe { (*self.ring.slots[self.head & self.ring.mask].get()).assume_init_read() };
        self.head = self.head.wrapping_add(1);
        self.ring.cons.head.store(self.head, Ordering::Release);
        bump(&self.ring.cons.rx_packets, 1);
        Some(p)
    }

    /// The next packet, without taking it.
    #[inline]
    pub fn peek(&mut self) -> Option<&Packet> {
        if self.cached_tail == self.head && self.available() == 0 {
            return None;
        }
        // SAFETY: a packet is available at head (as in `receive`) and stays there while the
        // returned reference borrows `self`: nothing else takes it or writes the slot.
        Some(unsafe { (*self.ring.slots[self.head & self.ring.mask].get()).assume_init_ref() })
    }

    /// Iterates over the packets available now; the consumer index is published once, when the
    /// iterator is dropped. Packets not taken stay queued.
    #[inline]
    pub fn drain(&mut self) -> Drain<'_> {
        let end = self.head.wrapping_add(self.available());
        Drain {
            start: self.head,
            end,
            consumer: self,
        }
    }

    /// Takes every packet available now, a run of slots at a time, and publishes the consumer
    /// index once: `take` is handed each run (its first slot, read as a `Packet`, and its
    /// length) and must take the packets' ownership, since head moves past them afterwards and
    /// no one reads those slots again. Returns how many there were and their bytes, counted
    /// from the ring's lengths without reading the packets.
    #[inline(always)]
    fn take_available(&mut self, mut take: impl FnMut(*const Packet, usize)) -> (usize, u64) {
        let n = self.available();
        if n == 0 {
            return (0, 0);
        }
        let mut bytes = 0u64;
        for (from, run) in self.ring.runs(self.head, n).into_iter().filter(|r| r.1 > 0) {
            // SAFETY: slots head..head+n hold published packets and the lengths written with
            // them, which only this consumer takes; `run` stays inside the length array.
            let lens = unsafe { std::slice::from_raw_parts(self.ring.len_ptr(from), run) };
            bytes += lens.iter().map(|&l| l as u64).sum::<u64>();
            // A slot is a `Packet` behind transparent wrappers.
            take(self.ring.slot_ptr(from).cast::<Packet>().cast_const(), run);
        }
        self.head = self.head.wrapping_add(n);
        self.ring.cons.head.store(self.head, Ordering::Release);
        bump(&self.ring.cons.rx_packets, n as u64);
        (n, bytes)
    }

    /// Moves every packet available now to the end of `out` — each run of slots in one copy,
    /// the consumer index published once — and returns how many there were and their bytes,
    /// counted from the ring's lengths without reading the packets.
    #[inline]
    pub fn receive_all(&mut self, out: &mut Vec<Packet>) -> (usize, u64) {
        self.take_available(|first, run| {
            out.reserve(run);
            // SAFETY: `take_available` hands `run` published packets from `first` on, whose
            // ownership passes here: their bits move into `out`'s spare capacity, reserved just
            // above, and the slots are not read again.
            unsafe {
                let len = out.len();
                std::ptr::copy_nonoverlapping(first, out.as_mut_ptr().add(len), run);
                out.set_len(len + run);
            }
        })
    }

    /// Frees every packet available now in one batch and returns how many there were and their
    /// bytes, counted from the ring's lengths without reading the packets.
    #[inline]
    pub fn free_available(&mut self) -> (u64, u64) {
        let (n, bytes) = self.take_available(|first, run| {
            // SAFETY: `take_available` hands `run` published packets from `first` on, whose
            // ownership passes here; `Packet` is a transparent buffer pointer, so the run reads
            // as the buffers' pointers, which go back to the pool and are not read again.
            unsafe {
                let bufs = std::slice::from_raw_parts(first.cast::<NonNull<PacketBuf>>(), run);
                crate::pool::free_owned(bufs);
            }
        });
        (n as u64, bytes)
    }

    /// Moves as many packets as fit from this link to `out` with one index update on each side.
    /// Packets that do not fit stay queued here (back-pressure, no drop). Returns the number moved.
    #[inline]
    pub fn forward_to(&mut self, out: &mut Producer) -> usize {
        let n = self.available().min(out.room());
        if n == 0 {
            return 0;
        }
        let (src, dst) = (&*self.ring, &*out.ring);
        let (from, to) = (self.head & src.mask, out.tail & dst.mask);
        // SAFETY: n ≤ available, so source slots head..head+n hold published packets and their
        // lengths, which only this consumer takes; n ≤ room, so destination slots tail..tail+n
        // are free for this producer. Published and free slots are disjoint even when both ends
        // are the same ring. The packets' bits are moved: the source slots count as empty once
        // head is published below.
        let bytes = unsafe {
            if from + n <= src.mask + 1 && to + n <= dst.mask + 1 {
                move_run(src, from, dst, to, n)
            } else {
                move_wrapping(src, from, dst, to, n)
            }
        };
        self.head = self.head.wrapping_add(n);
        out.tail = out.tail.wrapping_add(n);
        src.cons.head.store(self.head, Ordering::Release);
        dst.prod.tail.store(out.tail, Ordering::Release);
        bump(&src.cons.rx_packets, n as u64);
        bump(&dst.prod.tx_packets, n as u64);
        bump(&dst.prod.tx_bytes, bytes);
        n
    }
}

/// Moves the packets of `src`'s slots `from..from + n` into `dst`'s slots `to..to + n`, their
/// lengths with them, and returns their bytes, in one loop (vectorised; the compiler still tests
/// the four arrays against each other once per call, not knowing they are disjoint).
///
/// # Safety
/// Both ranges lie inside their arrays; the source slots hold packets the caller owns and gives
/// up, the destination slots are free and the caller's to write; the two ranges are disjoint
/// (when both are the same ring, published and free slots are).
#[inline(always)]
unsafe fn move_run(src: &Ring, from: usize, dst: &Ring, to: usize, n: usize) -> u64 {
    // SAFETY: the caller's contract: in bounds, disjoint, and no one else touches these slots
    // while the slices live; `UnsafeCell` is transparent, so the cells read as their contents.
    let (from_slots, to_slots, from_lens, to_lens) = unsafe {
        (
            std::slice::from_raw_parts(src.slot_ptr(from), n),
            std::slice::from_raw_parts_mut(dst.slot_ptr(to), n),
            std::slice::from_raw_parts(src.len_ptr(from), n),
            std::slice::from_raw_parts_mut(dst.len_ptr(to), n),
        )
    };
    let mut bytes = 0u64;
    for ((to_slot, from_slot), (to_len, &len)) in
        (to_slots.iter_mut().zip(from_slots)).zip(to_lens.iter_mut().zip(from_lens))
    {
        // SAFETY: a bit copy of a `MaybeUninit`, which asks nothing of its contents; the
        // packet's ownership moves with it (the caller gives up the source slots).
        *to_slot = unsafe { std::ptr::read(from_slot) };
        *to_len = len;
        bytes += len as u64;
    }
    bytes
}

/// [`move_run`] where either range wraps round its ring: up to three runs.
///
/// # Safety
/// As [`move_run`], for ranges of `n` ≤ each ring's capacity slots from `from` and `to`
/// (masked), each going on at its ring's start when it passes the end.
unsafe fn move_wrapping(src: &Ring, from: usize, dst: &Ring, to: usize, n: usize) -> u64 {
    let (mut bytes, mut moved) = (0u64, 0);
    while moved < n {
        let (f, t) = ((from + moved) & src.mask, (to + moved) & dst.mask);
        let run = (n - moved).min(src.mask + 1 - f).min(dst.mask + 1 - t);
        // SAFETY: the caller's contract, for a run that ends at neither array's end.
        bytes += unsafe { move_run(src, f, dst, t, run) };
        moved += run;
    }
    bytes
}

/// Iterator returned by [`Consumer::drain`].
pub struct Drain<'a> {
    consumer: &'a mut Consumer,
    start: usize,
    end: usize,
}

impl Iterator for Drain<'_> {
    type Item = Packet;

    #[inline]
    fn next(&mut self) -> Option<Packet> {
        let c = &mut *self.consumer;
        if c.head == self.end {
            return None;
        }
        // SAFETY: head < end ≤ the tail seen when the iterator was made, so the slot holds a
        // published packet; it is read once, the head advancing past it.
        let p = unsafe { (*c.ring.slots[c.head & c.ring.mask].get()).assume_init_read() };
        c.head = c.head.wrapping_add(1);
        Some(p)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.end.wrapping_sub(self.consumer.head);
        (n, Some(n))
    }
}

impl Drop for Drain<'_> {
    #[inline]
    fn drop(&mut self) {
        let c = &mut *self.consumer;
        c.ring.cons.head.store(c.head, Ordering::Release);
        bump(
            &c.ring.cons.rx_packets,
            c.head.wrapping_sub(self.start) as u64,
        );
    }
}

/// Transmits on a port slot; a packet for an unlinked port is dropped (freed). Returns whether
/// it was queued.
#[inline]
pub fn transmit_to(slot: &mut Option<Producer>, p: Packet) -> bool {
    match slot.as_mut() {
        Some(o) => o.transmit(p),
        None => false,
    }
}

impl Ring {
    /// Adds the totals a predecessor of this link counted (the same link in the process an
    /// upgrade replaced), so that its counters never go back. Only while neither end runs.
    pub fn count_on_from(&self, before: &LinkStats) {
        bump(&self.prod.tx_packets, before.tx_packets);
        bump(&self.prod.tx_bytes, before.tx_bytes);
        bump(&self.prod.tx_drops, before.tx_drops);
        bump(&self.cons.rx_packets, before.rx_packets);
    }
}

/// Moves the queued packets of `old` into a fresh link of `size` slots (used when a live change
/// resizes a link). Packets that do not fit are dropped and counted on the new link.
pub fn resize(old: Consumer, size: usize) -> (Producer, Consumer) {
    let (mut tx, rx) = link(size);
    let mut old = old;
    let before = old.ring().stats();
    for p in old.drain() {
        tx.transmit(p);
    }
    // The link goes on under its name, so its counters carry over: the packets moved are not
    // received or sent again, and those the smaller ring could not take become its drops.
    let lost = tx.ring().prod.tx_drops.load(Ordering::Relaxed);
    let ring = rx.ring();
    ring.prod
        .tx_packets
        .store(before.tx_packets - lost, Ordering::Relaxed);
    ring.prod.tx_bytes.store(before.tx_bytes, Ordering::Relaxed);
    ring.prod
        .tx_drops
        .store(before.tx_drops + lost, Ordering::Relaxed);
    ring.cons
        .rx_packets
        .store(before.rx_packets, Ordering::Relaxed);
    (tx, rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::HEADROOM;
    use crate::pool;

    fn pkt(tag: u8) -> Packet {
        let mut p = pool::alloc().unwrap();
        p.set_data(&[tag; 60]).unwrap();
        p
    }

    #[test]
    fn fifo_and_counters() {
        let (mut tx, mut rx) = link(4);
        for i in 0..3 {
            assert!(tx.transmit(pkt(i)));
        }
        assert_eq!(rx.receive().unwrap().data()[0], 0);
        let rest: Vec<u8> = rx.drain().map(|p| p.data()[0]).collect();
        assert_eq!(rest, vec![1, 2]);
        let s = tx.ring().stats();
        assert_eq!(
            (s.tx_packets, s.tx_bytes, s.rx_packets, s.tx_drops, s.queued),
            (3, 180, 3, 0, 0)
        );
    }

    #[test]
    fn full_ring_drops_newest_and_counts() {
        let (mut tx, mut rx) = link(4);
        for i in 0..6 {
            tx.transmit(pkt(i));
        }
        let got: Vec<u8> = rx.drain().map(|p| p.data()[0]).collect();
        assert_eq!(
            got,
            vec![0, 1, 2, 3],
            "the oldest packets stay, the newest are dropped"
        );
        assert_eq!(tx.ring().stats().tx_drops, 2);
    }

    #[test]
    fn receive_all_moves_every_packet_across_the_wrap_and_counts_bytes() {
        let (mut tx, mut rx) = link(8);
        let mut out = vec![pkt(99)];
        for round in 0..3u8 {
            // 5 a round on 8 slots: the second and third rounds wrap.
            for i in 0..5 {
                let mut p = pkt(round * 10 + i);
                p.set_len(60 + i as usize).unwrap();
                assert!(tx.transmit(p));
            }
            let (n, bytes) = rx.receive_all(&mut out);
            assert_eq!((n, bytes), (5, 5 * 60 + 10));
            assert_eq!(rx.available(), 0);
        }
        let tags: Vec<u8> = out.iter().map(|p| p.data()[0]).collect();
        assert_eq!(
            tags,
            [99, 0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
        );
        assert_eq!(rx.receive_all(&mut out), (0, 0));
        assert_eq!(tx.ring().stats().rx_packets, 15);
    }

    #[test]
    fn partial_drain_keeps_the_rest() {
        let (mut tx, mut rx) = link(8);
        for i in 0..5 {
            tx.transmit(pkt(i));
        }
        let first: Vec<u8> = rx.drain().take(2).map(|p| p.data()[0]).collect();
        assert_eq!(first, vec![0, 1]);
        assert_eq!(rx.peek().map(|p| p.data()[0]), Some(2));
        assert_eq!(rx.available(), 3);
        assert_eq!(tx.ring().stats().rx_packets, 2);
    }

    #[test]
    fn forward_to_respects_room_and_wraps() {
        let (mut atx, mut arx) = link(8);
        let (mut btx, mut brx) = link(4);
        for round in 0..10u8 {
            for i in 0..6 {
                atx.transmit(pkt(round.wrapping_mul(10).wrapping_add(i)));
            }
            assert_eq!(arx.forward_to(&mut btx), 4);
            assert_eq!(arx.available(), 2);
            assert_eq!(brx.drain().count(), 4);
            assert_eq!(arx.forward_to(&mut btx), 2);
            let got: Vec<u8> = brx.drain().map(|p| p.data()[0]).collect();
            assert_eq!(got, vec![round * 10 + 4, round * 10 + 5]);
        }
        assert_eq!(btx.ring().stats().tx_bytes, 60 * 60);
        assert_eq!(atx.ring().stats().tx_drops, 0);
    }

    #[test]
    fn bytes_are_counted_from_the_ring_across_wraps() {
        let (mut atx, mut arx) = link(8);
        let (mut btx, mut brx) = link(4);
        let (mut sent, mut freed, mut freed_bytes) = (0u64, 0u64, 0u64);
        for round in 0..10usize {
            let lens: Vec<usize> = (0..5).map(|i| 60 + 7 * (round * 5 + i)).collect();
            for (i, &len) in lens.iter().enumerate() {
                // Some rounds carry a large buffer: it goes back to its own class.
                let large = round % 3 == 0 && i == 1;
                let mut p = if large {
                    pool::alloc_large()
                } else {
                    pool::alloc()
                }
                .unwrap();
                p.set_data(&vec![len as u8; len]).unwrap();
                atx.transmit(p);
            }
            sent += lens.iter().sum::<usize>() as u64;
            let moved = arx.forward_to(&mut btx);
            assert_eq!(moved, 4);
            let (n, bytes) = brx.free_available();
            assert_eq!((n, bytes), (4, lens[..4].iter().sum::<usize>() as u64));
            assert_eq!(arx.forward_to(&mut btx), 1);
            let last: Vec<usize> = brx.drain().map(|p| p.len()).collect();
            assert_eq!(last, vec![lens[4]]);
            freed += n + 1;
            freed_bytes += bytes + lens[4] as u64;
        }
        let (a, b) = (atx.ring().stats(), btx.ring().stats());
        assert_eq!((a.tx_bytes, b.tx_bytes), (sent, sent));
        assert_eq!((freed, freed_bytes), (50, sent));
        assert_eq!(b.rx_packets, 50);
        assert_eq!(brx.free_available(), (0, 0));
    }

    #[test]
    fn fresh_packets_are_written_in_place_in_order_across_the_wrap() {
        let (mut tx, mut rx) = link(8);
        // Leave stale headers and frames in buffers the pool will hand out again.
        for i in 0..5 {
            let mut p = pkt(i);
            p.set_timestamp_ns(77);
            p.header_mut().user = [9; 4];
            assert!(tx.transmit(p));
        }
        drop(rx.drain().collect::<Vec<_>>());
        let mut next = 0u8;
        let sent = tx.transmit_fresh(20, 64, |p| {
            assert_eq!((p.len(), p.headroom(), p.timestamp_ns()), (0, HEADROOM, 0));
            assert_eq!(p.header().user, [0; 4]);
            p.set_data(&vec![next; 60 + next as usize]).unwrap();
            next += 1;
        });
        assert_eq!(sent, 8, "as many as the link has room for");
        let got: Vec<(u8, usize)> = rx.drain().map(|p| (p.data()[0], p.len())).collect();
        let want: Vec<(u8, usize)> = (0..8).map(|i| (i, 60 + i as usize)).collect();
        assert_eq!(got, want);
        let s = tx.ring().stats();
        assert_eq!(s.tx_packets, 13);
        assert_eq!(s.tx_bytes, 5 * 60 + (0..8).map(|i| 60 + i).sum::<u64>());
        assert_eq!(s.tx_drops, 0);
        assert_eq!(tx.transmit_fresh(0, 64, |_| unreachable!()), 0);
    }

    #[test]
    fn threads_lose_nothing_and_keep_order() {
        let (mut tx, mut rx) = link(256);
        const N: u32 = 200_000;
        let t = std::thread::spawn(move || {
            let mut next = 0u32;
            while next < N {
                if tx.room() == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let mut p = pool::alloc().unwrap();
                p.set_data(&next.to_le_bytes()).unwrap();
                assert!(tx.transmit(p));
                next += 1;
            }
        });
        let mut expect = 0u32;
        while expect < N {
            for p in rx.drain() {
                assert_eq!(u32::from_le_bytes(p.data().try_into().unwrap()), expect);
                expect += 1;
            }
        }
        t.join().unwrap();
    }

    struct Recorder(Mutex<Vec<u8>>);

    impl LinkTap for Recorder {
        fn observe(&self, packets: &[Packet]) {
            self.0
                .lock()
                .unwrap()
                .extend(packets.iter().map(|p| p.data()[0]));
        }
    }

    #[test]
    fn taps_see_every_delivered_packet_once_in_order_across_the_wrap() {
        let (mut atx, mut arx) = link(8);
        let (mut btx, mut brx) = link(8);
        let first = Arc::new(Recorder(Mutex::new(Vec::new())));
        let second = Arc::new(Recorder(Mutex::new(Vec::new())));
        let (t1, t2): (Arc<dyn LinkTap>, Arc<dyn LinkTap>) = (first.clone(), second.clone());
        atx.ring().add_tap(t1.clone());
        atx.ring().add_tap(t2.clone());
        assert_eq!(atx.ring().tap_count(), 2);
        let mut sent = Vec::new();
        for round in 0..7u8 {
            for i in 0..5 {
                let tag = round * 5 + i;
                atx.transmit(pkt(tag));
                sent.push(tag);
            }
            // Every way of reading: one by one, a partial drain, forwarding.
            match round % 3 {
                0 => while arx.receive().is_some() {},
                1 => {
                    let _ = arx.drain().take(2).count();
                    assert!(arx.peek().is_some());
                    let _ = arx.drain().count();
                }
                _ => {
                    arx.forward_to(&mut btx);
                    let _ = brx.drain().count();
                }
            }
        }
        assert_eq!(*first.0.lock().unwrap(), sent);
        assert_eq!(*second.0.lock().unwrap(), sent);
        assert!(atx.ring().remove_tap(&t1));
        assert!(!atx.ring().remove_tap(&t1));
        atx.transmit(pkt(200));
        let _ = arx.drain().count();
        assert_eq!(first.0.lock().unwrap().len(), sent.len());
        assert_eq!(second.0.lock().unwrap().last(), Some(&200));
        assert!(atx.ring().remove_tap(&t2));
        assert_eq!(atx.ring().tap_count(), 0);
        assert!(
            btx.ring().tap_count() == 0,
            "a tap belongs to one link only"
        );
    }

    #[test]
    fn resize_keeps_packets_in_order() {
        let (mut tx, rx) = link(8);
        for i in 0..5 {
            tx.transmit(pkt(i));
        }
        let mut rx = rx;
        rx.receive().unwrap();
        let (ntx, mut nrx) = resize(rx, 4);
        let s = ntx.ring().stats();
        assert_eq!(
            (s.tx_packets, s.rx_packets, s.tx_drops, s.queued),
            (5, 1, 0, 4),
            "the counters carry over"
        );
        let got: Vec<u8> = nrx.drain().map(|p| p.data()[0]).collect();
        assert_eq!(got, vec![1, 2, 3, 4]);
        assert_eq!(ntx.ring().stats().rx_packets, 5);
    }

    #[test]
    fn a_smaller_ring_counts_what_it_cannot_take_as_drops() {
        let (mut tx, rx) = link(8);
        for i in 0..6 {
            tx.transmit(pkt(i));
        }
        let (ntx, _nrx) = resize(rx, 4);
        let s = ntx.ring().stats();
        let kept = s.queued;
        assert_eq!((s.tx_packets, s.tx_drops), (kept, 6 - kept));
    }
}
