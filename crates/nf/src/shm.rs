//! The shared-memory region of one function port, as both sides see it.
//!
//! ```text
//! 0      RegionHeader (one page): magic, version, layout, the function's `sleeping` flag
//! to_nf  Ring: Stitch produces, the function consumes
//! from_nf Ring: the function produces (forwarded or dropped buffers), Stitch consumes
//! bufs   isolated mode only: `buffers` slots of `buffer_size` bytes
//! ```
//!
//! A ring is two cache-line-separated indices (free-running u32) and a power-of-two array of
//! 16-byte descriptors. Each side keeps its own index privately and only *publishes* it to the
//! shared word; it never reads its own index back, so a function that scribbles over the region
//! can confuse only itself — Stitch checks every index and descriptor it reads.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use stitch_core::mapping::MapOptions;

pub const MAGIC: u64 = u64::from_le_bytes(*b"STITCHNF");
/// 2: the `control` word and direct channels. 3: the packet memory can be replaced under an
/// attached function (a `pool` control message: Stitch's process was upgraded). 4: steered
/// input (a `steer` control message: an interface's frames read straight from its sockets).
pub const VERSION: u32 = 4;
const PAGE: usize = 4096;
/// Regions up to this size are faulted in at attach (rings: no page fault on the data path);
/// larger ones (isolated buffer slots) fill in as they are used, so that thousands of ports
/// cost only the memory they touch.
pub const POPULATE_MAX: usize = 1 << 20;

/// The function asks Stitch to free this buffer instead of forwarding it.
pub const FLAG_DROP: u16 = 1;
/// The descriptor gives back a frame the function read from a steered receive ring
/// ([`SteerHeader`]): `buffer` is its index in that ring, `offset` the ring's queue.
pub const FLAG_STEERED: u16 = 2;

/// One packet handed across: which buffer, where its frame starts in it and how long it is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    /// Zero-copy: index of the pool buffer. Isolated: slot in this region.
    pub buffer: u32,
    /// Zero-copy: start of the frame in the buffer's data area. Isolated: in the slot.
    pub offset: u16,
    pub flags: u16,
    pub len: u32,
    /// Time Stitch handed the packet over (ns, CLOCK_REALTIME), for latency measurement.
    pub stamp_lo: u32,
}

#[repr(C, align(64))]
pub struct Index(pub AtomicU32);

#[repr(C)]
pub struct RingHeader {
    /// Written by the producer only.
    pub head: Index,
    /// Written by the consumer only.
    pub tail: Index,
}

#[repr(C)]
pub struct RegionHeader {
    pub magic: u64,
    pub version: u32,
    /// 0 zero-copy, 1 isolated.
    pub mode: u32,
    /// 0 polling, 1 blocking.
    pub wake: u32,
    pub ring_size: u32,
    pub buffers: u32,
    pub buffer_size: u32,
    pub to_nf: u32,
    pub from_nf: u32,
    pub bufs: u32,
    pub region_size: u32,
    /// Zero-copy: stride and header size of pool buffers, and the pool's size in bytes.
    pub pool_stride: u32,
    pub pool_header: u32,
    pub pool_bytes: u64,
    /// Set by a blocking function just before it sleeps on its eventfd.
    pub sleeping: Index,
    /// Messages Stitch sent on the connection since attach (a direct channel to map): the
    /// function reads the socket only when this moved, so a poll costs one load.
    pub control: Index,
    /// Written by the function: the messages it has taken so far (what a message replaced —
    /// a predecessor's packet memory in a guest — is then no longer used). Last, so that a
    /// region laid out before it has it (zero) at the same place.
    pub control_taken: Index,
}

/// The header of a direct channel (the inter-VNF bypass): a ring from one zero-copy function
/// straight to another, in a memfd of its own that Stitch hands to both.
///
/// ```text
/// 0     ChannelHeader: ring indices, then the handshake words, each on its own cache line
/// 4096  ring_size descriptors
/// ```
///
/// The sending function produces (`ring.head`); one consumer at a time moves `ring.tail`:
/// Stitch until it sets `reader`, then the receiving function until it sees `end`. Slots come
/// back to the sender only through `released`, which Stitch moves once it has accounted for
/// what was read (buffer ownership, flow and port counters) — so Stitch never has to trust
/// either function's word for what crossed.
#[repr(C)]
pub struct ChannelHeader {
    pub ring: RingHeader,
    /// Stitch: slots the sender may write again.
    pub released: Index,
    /// Stitch: 1 once the receiving function is the consumer.
    pub reader: Index,
    /// Stitch: 1 when the channel is ending (both functions go back to their own rings).
    pub end: Index,
    /// Sending function: 1 once it writes here, 2 once it left after `end`.
    pub sender: Index,
    /// Receiving function: 1 once mapped, 2 once it stopped reading after `end`.
    pub receiver: Index,
    /// Receiving function: asleep on its doorbell (the sender rings it, as Stitch would).
    pub receiver_sleeping: Index,
    pub magic: u64,
    pub ring_size: u32,
}

/// The page Stitch shares with a function it steers an interface's frames to
/// ([`crate::steer`]). The function reads the interface's receive rings itself, from its own
/// index, and writes nothing in them: each frame comes back on `from_nf` (flagged
/// [`FLAG_STEERED`], in ring order), and Stitch moves the rings on.
#[repr(C)]
pub struct SteerHeader {
    /// Stitch: 1 when the interface takes its rings back.
    pub end: Index,
    /// Function: 1 once it reads the rings, 2 once it stopped after `end` (everything it read
    /// was given back before).
    pub reader: Index,
    pub magic: u64,
}

/// The size of a steered input's page.
pub const STEER_PAGE: usize = PAGE;

/// A new steered input's page, its header written (before anyone else maps it).
pub fn new_steer_page() -> io::Result<(OwnedFd, Mapping)> {
    let fd = memfd("stitch-steer", STEER_PAGE)?;
    let mut map = self::map(fd.as_fd(), STEER_PAGE, true)?;
    // SAFETY: SteerHeader is repr(C) of integers and atomics; nobody else maps the page yet.
    let h = unsafe { map.view_mut::<SteerHeader>(0) }
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "steer page too small"))?;
    h.magic = MAGIC;
    Ok((fd, map))
}

/// A steered input's page another side made, checked to be one.
pub fn map_steer_page(fd: BorrowedFd<'_>) -> io::Result<Mapping> {
    let map = self::map(fd, STEER_PAGE, true)?;
    if map.steer_header().is_none_or(|h| h.magic != MAGIC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a steered input's page",
        ));
    }
    Ok(map)
}

/// Where a channel's descriptors start, and its size for `ring_size` descriptors.
pub const CHANNEL_RING: usize = PAGE;

pub fn channel_size(ring_size: u32) -> usize {
    round_up(
        CHANNEL_RING + ring_size as usize * std::mem::size_of::<Desc>(),
        PAGE,
    )
}

/// Where each part of a region lies for a ring size and buffer count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub ring_size: u32,
    pub buffers: u32,
    pub buffer_size: u32,
    pub to_nf: usize,
    pub from_nf: usize,
    pub bufs: usize,
    pub size: usize,
}

impl Layout {
    pub fn new(ring_size: u32, buffers: u32, buffer_size: u32) -> Layout {
        let ring_bytes = round_up(
            std::mem::size_of::<RingHeader>() + ring_size as usize * std::mem::size_of::<Desc>(),
            PAGE,
        );
        let to_nf = PAGE;
        let from_nf = to_nf + ring_bytes;
        let bufs = from_nf + ring_bytes;
        let size = round_up(bufs + buffers as usize * buffer_size as usize, PAGE);
        Layout {
            ring_size,
            buffers,
            buffer_size,
            to_nf,
            from_nf,
            bufs,
            size,
        }
    }

    /// The layout a header describes, checked against the mapping's size.
    pub fn read(h: &RegionHeader, mapped: usize) -> io::Result<Layout> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        if h.magic != MAGIC || h.version != VERSION {
            return Err(bad("not a Stitch function port region (magic or version)"));
        }
        if !h.ring_size.is_power_of_two() {
            return Err(bad("ring size is not a power of two"));
        }
        let l = Layout::new(h.ring_size, h.buffers, h.buffer_size);
        if l.size > mapped
            || l.to_nf != h.to_nf as usize
            || l.from_nf != h.from_nf as usize
            || l.bufs != h.bufs as usize
        {
            return Err(bad("region layout does not match its header"));
        }
        Ok(l)
    }
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

pub use stitch_core::mapping::Mapping;

/// Maps `len` bytes of `fd` shared, read-write; `populate` faults every page in now (for
/// the small region), else pages come on first touch (the packet pool: hundreds of MiB).
pub fn map(fd: BorrowedFd<'_>, len: usize, populate: bool) -> io::Result<Mapping> {
    let opts = MapOptions {
        populate,
        ..MapOptions::default()
    };
    Mapping::shared(fd, len, opts)
}

/// The length of the file behind `fd` (a memfd someone else made).
pub fn file_size(fd: BorrowedFd<'_>) -> io::Result<usize> {
    Ok(std::fs::File::from(fd.try_clone_to_owned()?)
        .metadata()?
        .len() as usize)
}

/// A new anonymous shared-memory file of `len` bytes.
pub fn memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    stitch_core::mapping::memfd(name, len, false)
}

/// The structures of a port region or a direct channel in a mapping.
pub trait Region {
    /// The region header; `None` if the mapping is too small for one.
    fn header(&self) -> Option<&RegionHeader>;

    /// The header of a direct channel; `None` if the mapping is too small for one.
    fn channel_header(&self) -> Option<&ChannelHeader>;

    /// The header of a steered input; `None` if the mapping is too small for one.
    fn steer_header(&self) -> Option<&SteerHeader>;

    /// The ring at `offset` of `size` descriptors (a power of two); `None` unless it lies
    /// inside the mapping, aligned.
    ///
    /// # Safety
    /// The view must not outlive the mapping (it holds no borrow of it).
    unsafe fn ring(&self, offset: usize, size: u32) -> Option<RingView>;

    /// The mapping as a direct channel, checked: magic, a power-of-two ring that fits.
    ///
    /// # Safety
    /// As for `ring`: the view must not outlive the mapping.
    unsafe fn channel(&self) -> io::Result<(&ChannelHeader, RingView)>;
}

impl Region for Mapping {
    fn header(&self) -> Option<&RegionHeader> {
        // SAFETY: RegionHeader is repr(C) of integers and atomics (any bytes are a value); the
        // fields the function changes while Stitch reads are atomics.
        unsafe { self.view::<RegionHeader>(0) }
    }

    fn channel_header(&self) -> Option<&ChannelHeader> {
        // SAFETY: ChannelHeader is repr(C) of integers and atomics; the fields the other side
        // writes while this side reads are atomics.
        unsafe { self.view::<ChannelHeader>(0) }
    }

    fn steer_header(&self) -> Option<&SteerHeader> {
        // SAFETY: SteerHeader is repr(C) of integers and atomics; the fields either side
        // writes while the other reads are atomics.
        unsafe { self.view::<SteerHeader>(0) }
    }

    unsafe fn ring(&self, offset: usize, size: u32) -> Option<RingView> {
        if !size.is_power_of_two() {
            return None;
        }
        let descs = offset.checked_add(std::mem::size_of::<RingHeader>())?;
        let bytes = (size as usize).checked_mul(std::mem::size_of::<Desc>())?;
        // SAFETY: RingHeader is repr(C) of atomics.
        let hdr = unsafe { self.view::<RingHeader>(offset)? };
        let slots = self.bytes(descs, bytes)?;
        if !(slots.as_ptr() as usize).is_multiple_of(std::mem::align_of::<Desc>()) {
            return None;
        }
        Some(RingView {
            hdr,
            descs: slots.as_ptr() as *mut Desc,
            mask: size - 1,
        })
    }

    unsafe fn channel(&self) -> io::Result<(&ChannelHeader, RingView)> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        let h = self
            .channel_header()
            .ok_or_else(|| bad("direct channel too small"))?;
        let size = h.ring_size;
        if h.magic != MAGIC || !size.is_power_of_two() || channel_size(size) > self.len() {
            return Err(bad("not a direct channel (magic, ring size)"));
        }
        let slots = self
            .bytes(CHANNEL_RING, size as usize * std::mem::size_of::<Desc>())
            .filter(|d| (d.as_ptr() as usize).is_multiple_of(std::mem::align_of::<Desc>()))
            .ok_or_else(|| bad("direct channel ring outside the mapping"))?;
        let ring = RingView {
            hdr: &h.ring,
            descs: slots.as_ptr() as *mut Desc,
            mask: size - 1,
        };
        Ok((h, ring))
    }
}

/// A ring in the region. Producer and consumer each keep their own index in a [`Producer`] or
/// [`Consumer`]; the view only reads the other side's published index.
///
/// Made only by [`Region::ring`] and [`Region::channel`], which check that the header and
/// `mask + 1` descriptors lie inside the mapping, and whose callers keep the mapping alive as
/// long as the view: the pointers below are valid for the view's whole life.
#[derive(Clone, Copy)]
pub struct RingView {
    hdr: *const RingHeader,
    descs: *mut Desc,
    mask: u32,
}

// SAFETY: the view points into shared memory meant for concurrent use (atomic indexes,
// descriptors copied in and out with volatile accesses); moving it to another thread changes
// nothing about who may touch what.
unsafe impl Send for RingView {}

impl RingView {
    pub fn size(&self) -> u32 {
        self.mask + 1
    }

    /// The descriptor in slot `index` (a copy).
    #[inline]
    pub fn read(&self, index: u32) -> Desc {
        // SAFETY: index & mask < mask + 1 descriptors, all inside the mapping (RingView).
        unsafe { self.descs.add((index & self.mask) as usize).read_volatile() }
    }

    /// The producer's published index.
    #[inline]
    pub fn head(&self) -> u32 {
        // SAFETY: `hdr` is valid while the view lives (RingView).
        unsafe { (*self.hdr).head.0.load(Ordering::Acquire) }
    }

    /// The consumer's published index.
    #[inline]
    pub fn tail(&self) -> u32 {
        // SAFETY: `hdr` is valid while the view lives (RingView).
        unsafe { (*self.hdr).tail.0.load(Ordering::Acquire) }
    }
}

/// The producing side of a ring.
pub struct Producer {
    ring: RingView,
    head: u32,
    /// Last consumer index seen.
    tail: u32,
    /// The index that frees slots: the consumer's, or a channel's `released`.
    gate: *const AtomicU32,
}

// SAFETY: as for RingView; `gate` points into the same mapping (or one that outlives it,
// `Producer::gated`'s contract).
unsafe impl Send for Producer {}

impl Producer {
    pub fn new(ring: RingView) -> Producer {
        Producer {
            ring,
            head: 0,
            tail: 0,
            // SAFETY: `hdr` is valid while the view lives (RingView).
            gate: unsafe { &(*ring.hdr).tail.0 },
        }
    }

    /// A producer that takes over at `head` (its predecessor's private index).
    pub fn at(ring: RingView, head: u32) -> Producer {
        let mut p = Producer::new(ring);
        p.head = head;
        p.tail = ring.tail();
        p
    }

    /// A producer whose slots come back through `gate` (a channel's `released`), starting at
    /// the ring's published head.
    ///
    /// # Safety
    /// `gate` must live as long as the ring's mapping.
    pub unsafe fn gated(ring: RingView, gate: &AtomicU32) -> Producer {
        let head = ring.head();
        Producer {
            ring,
            head,
            tail: gate.load(Ordering::Acquire),
            gate,
        }
    }

    /// Free slots (one read of the consumer's index: call once per batch); `None` when the
    /// consumer published an impossible index.
    #[inline]
    pub fn free(&mut self) -> Option<u32> {
        let size = self.ring.size();
        if self.head != self.tail {
            // SAFETY: `gate` lives as long as the ring's mapping (`new`, `gated`).
            self.tail = unsafe { (*self.gate).load(Ordering::Acquire) };
        }
        let used = self.head.wrapping_sub(self.tail);
        (used <= size).then(|| size - used)
    }

    /// Writes a descriptor; the caller checked [`Producer::free`].
    #[inline]
    pub fn put(&mut self, d: Desc) {
        // SAFETY: the slot index is masked into the ring, inside the mapping (RingView).
        unsafe {
            self.ring
                .descs
                .add((self.head & self.ring.mask) as usize)
                .write_volatile(d)
        };
        self.head = self.head.wrapping_add(1);
    }

    /// The next descriptor's index (published or not).
    pub fn position(&self) -> u32 {
        self.head
    }

    /// Makes the descriptors written so far visible to the consumer.
    #[inline]
    pub fn publish(&self) {
        // SAFETY: `hdr` is valid while the view lives (RingView).
        unsafe { (*self.ring.hdr).head.0.store(self.head, Ordering::Release) };
    }

    /// Descriptors written and not yet consumed, as of the last look at the consumer.
    pub fn pending(&mut self) -> u32 {
        // SAFETY: `gate` lives as long as the ring's mapping (`new`, `gated`).
        self.tail = unsafe { (*self.gate).load(Ordering::Acquire) };
        self.head.wrapping_sub(self.tail).min(self.ring.size())
    }
}

/// The consuming side of a ring.
pub struct Consumer {
    ring: RingView,
    tail: u32,
}

impl Consumer {
    pub fn new(ring: RingView) -> Consumer {
        Consumer { ring, tail: 0 }
    }

    /// A consumer that takes over at the ring's published tail.
    pub fn resuming(ring: RingView) -> Consumer {
        Consumer {
            ring,
            tail: ring.tail(),
        }
    }

    /// Starts reading at `tail` (a consumer taking over from another).
    pub fn at(ring: RingView, tail: u32) -> Consumer {
        Consumer { ring, tail }
    }

    pub fn position(&self) -> u32 {
        self.tail
    }

    /// Descriptors ready; `None` when the producer published an impossible index.
    #[inline]
    pub fn available(&self) -> Option<u32> {
        // SAFETY: `hdr` is valid while the view lives (RingView).
        let head = unsafe { (*self.ring.hdr).head.0.load(Ordering::Acquire) };
        let n = head.wrapping_sub(self.tail);
        (n <= self.ring.size()).then_some(n)
    }

    /// Reads the next descriptor (a copy: the producer may change the slot afterwards).
    #[inline]
    pub fn take(&mut self) -> Desc {
        // SAFETY: the slot index is masked into the ring, inside the mapping (RingView).
        let d = unsafe {
            self.ring
                .descs
                .add((self.tail & self.ring.mask) as usize)
                .read_volatile()
        };
        self.tail = self.tail.wrapping_add(1);
        d
    }

    /// Gives the consumed slots back to the producer.
    #[inline]
    pub fn release(&self) {
        // SAFETY: `hdr` is valid while the view lives (RingView).
        unsafe { (*self.ring.hdr).tail.0.store(self.tail, Ordering::Release) };
    }
}
