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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

pub const MAGIC: u64 = u64::from_le_bytes(*b"STITCHNF");
/// 2: the `control` word and direct channels.
pub const VERSION: u32 = 2;
const PAGE: usize = 4096;
/// Regions up to this size are faulted in at attach (rings: no page fault on the data path);
/// larger ones (isolated buffer slots) fill in as they are used, so that thousands of ports
/// cost only the memory they touch.
pub const POPULATE_MAX: usize = 1 << 20;

/// The function asks Stitch to free this buffer instead of forwarding it.
pub const FLAG_DROP: u16 = 1;

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
}

/// The header of a direct channel (seed 001's bypass): a ring from one zero-copy function
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

/// Where a channel's descriptors start, and its size for `ring_size` descriptors.
pub const CHANNEL_RING: usize = PAGE;

pub fn channel_size(ring_size: u32) -> usize {
    round_up(
        CHANNEL_RING + ring_size as usize * std::mem::size_of::<Desc>(),
        PAGE,
    )
}

/// Where each part of a region lies for a ring size and buffer count.
#[derive(Clone, Copy, Debug)]
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

/// A shared mapping, unmapped on drop.
pub struct Mapping {
    pub base: *mut u8,
    pub len: usize,
}

// The mapping is plain shared memory; the types built on it decide who touches what.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, read-write; `populate` faults every page in now (for
    /// the small region), else pages come on first touch (the packet pool: hundreds of MiB).
    pub fn map(fd: RawFd, len: usize, populate: bool) -> io::Result<Mapping> {
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            base: p as *mut u8,
            len,
        })
    }

    pub fn header(&self) -> &RegionHeader {
        unsafe { &*(self.base as *const RegionHeader) }
    }

    /// # Safety
    /// `offset` must be the start of a ring of `size` descriptors inside the mapping.
    pub unsafe fn ring(&self, offset: usize, size: u32) -> RingView {
        RingView {
            hdr: self.base.add(offset) as *const RingHeader,
            descs: self.base.add(offset + std::mem::size_of::<RingHeader>()) as *mut Desc,
            mask: size - 1,
        }
    }

    /// The mapping as a direct channel, checked: magic, a power-of-two ring that fits.
    pub fn channel(&self) -> io::Result<(&ChannelHeader, RingView)> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        if self.len < CHANNEL_RING {
            return Err(bad("direct channel too small"));
        }
        let h = unsafe { &*(self.base as *const ChannelHeader) };
        let size = h.ring_size;
        if h.magic != MAGIC || !size.is_power_of_two() || channel_size(size) > self.len {
            return Err(bad("not a direct channel (magic, ring size)"));
        }
        let ring = RingView {
            hdr: &h.ring,
            descs: unsafe { self.base.add(CHANNEL_RING) } as *mut Desc,
            mask: size - 1,
        };
        Ok((h, ring))
    }

    /// A region of `len` bytes of fresh shared memory: the memfd and its mapping.
    pub fn create(name: &str, len: usize) -> io::Result<(OwnedFd, Mapping)> {
        let fd = memfd(name, len)?;
        let m = Mapping::map(fd.as_raw_fd(), len, true)?;
        Ok((fd, m))
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// A new anonymous shared-memory file of `len` bytes.
pub fn memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).unwrap();
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A ring in the region. Producer and consumer each keep their own index in a [`Producer`] or
/// [`Consumer`]; the view only reads the other side's published index.
#[derive(Clone, Copy)]
pub struct RingView {
    hdr: *const RingHeader,
    descs: *mut Desc,
    mask: u32,
}

unsafe impl Send for RingView {}

impl RingView {
    pub fn size(&self) -> u32 {
        self.mask + 1
    }

    /// The descriptor in slot `index` (a copy).
    #[inline]
    pub fn read(&self, index: u32) -> Desc {
        unsafe { self.descs.add((index & self.mask) as usize).read_volatile() }
    }

    /// The producer's published index.
    #[inline]
    pub fn head(&self) -> u32 {
        unsafe { (*self.hdr).head.0.load(Ordering::Acquire) }
    }

    /// The consumer's published index.
    #[inline]
    pub fn tail(&self) -> u32 {
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

unsafe impl Send for Producer {}

impl Producer {
    pub fn new(ring: RingView) -> Producer {
        Producer {
            ring,
            head: 0,
            tail: 0,
            gate: unsafe { &(*ring.hdr).tail.0 },
        }
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
            self.tail = unsafe { (*self.gate).load(Ordering::Acquire) };
        }
        let used = self.head.wrapping_sub(self.tail);
        (used <= size).then(|| size - used)
    }

    /// Writes a descriptor; the caller checked [`Producer::free`].
    #[inline]
    pub fn put(&mut self, d: Desc) {
        unsafe {
            self.ring
                .descs
                .add((self.head & self.ring.mask) as usize)
                .write_volatile(d)
        };
        self.head = self.head.wrapping_add(1);
    }

    /// Makes the descriptors written so far visible to the consumer.
    #[inline]
    pub fn publish(&self) {
        unsafe { (*self.ring.hdr).head.0.store(self.head, Ordering::Release) };
    }

    /// Descriptors written and not yet consumed, as of the last look at the consumer.
    pub fn pending(&mut self) -> u32 {
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
        let head = unsafe { (*self.ring.hdr).head.0.load(Ordering::Acquire) };
        let n = head.wrapping_sub(self.tail);
        (n <= self.ring.size()).then_some(n)
    }

    /// Reads the next descriptor (a copy: the producer may change the slot afterwards).
    #[inline]
    pub fn take(&mut self) -> Desc {
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
        unsafe { (*self.ring.hdr).tail.0.store(self.tail, Ordering::Release) };
    }
}
