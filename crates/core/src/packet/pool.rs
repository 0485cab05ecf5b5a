//! The packet pool: preallocated regions of fixed-size buffers for the whole process.
//!
//! Two classes: ordinary buffers (a jumbo frame each) and a smaller number of large buffers for
//! whole GSO super-frames. Each class is one memfd (2 MiB hugepages when the system has them
//! reserved, ordinary pages otherwise) so that it can later be handed to other processes
//! (shared-memory ports) or to the kernel (AF_XDP UMEM) as-is. Buffers circulate through
//! per-thread caches that trade with the global free list in batches, so allocating or freeing a
//! packet takes no lock and no syscall. When a class is empty, allocation returns `None` and is
//! counted: nothing ever waits.

use super::{Packet, PacketBuf, BUFFER_STRIDE, DATA_AREA, LARGE_DATA_AREA, LARGE_STRIDE};
use crate::mapping::{memfd, MapOptions, Mapping, HUGE_PAGE};
use crossbeam_utils::CachePadded;
use std::cell::RefCell;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

/// Ordinary packets in the pool when nothing else is configured (644 MiB of address space;
/// only touched pages cost memory with ordinary pages).
pub const DEFAULT_PACKETS: usize = 65536;
/// Large (GSO) packets when nothing else is configured (18 MiB).
pub const DEFAULT_LARGE_PACKETS: usize = 256;
/// Buffers moved between a thread cache and the global list at once, for a class large enough
/// (a thread keeps at most twice its class's batch).
const CACHE_BATCH: usize = 256;
/// A class's batch is at most this fraction of its buffers, so that a few threads cannot hoard a
/// small class: with 256 GSO buffers a thread trades 4 and keeps at most 8, and every worker gets
/// large buffers while any are free.
const CACHE_SHARE_DIVISOR: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("packet pool: cannot map {bytes} bytes: {source} (lower engine.pool_packets)")]
    Map {
        bytes: usize,
        source: std::io::Error,
    },
    #[error("packet pool: pool_packets must be at least {min}, got {got}")]
    TooSmall { min: usize, got: usize },
}

/// Counters of the pool, as seen by `stitch stats`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PoolStats {
    pub packets: usize,
    pub in_use: usize,
    pub exhausted: u64,
    pub large_packets: usize,
    pub large_in_use: usize,
    pub large_exhausted: u64,
    pub hugepages: bool,
}

/// One class of buffers: a mapping, its free list and counters.
struct Class {
    base: *mut u8,
    /// Where `base` points; the pool lives as long as the process, so this is never unmapped.
    _mapping: Mapping,
    bytes: usize,
    stride: usize,
    capacity: usize,
    count: usize,
    memfd: OwnedFd,
    hugepages: bool,
    free: Mutex<Vec<NonNull<PacketBuf>>>,
    global_free: AtomicUsize,
    exhausted: AtomicU64,
    /// Buffers a thread cache takes from or gives to `free` at once.
    cache_batch: usize,
    /// Most buffers of this class a thread cache keeps.
    cache_max: usize,
}

/// The batch a thread cache trades in for a class of `count` buffers.
fn cache_batch_for(count: usize) -> usize {
    (count / CACHE_SHARE_DIVISOR).clamp(1, CACHE_BATCH)
}

pub struct Pool {
    classes: [Class; 2],
    caches: Mutex<Vec<Arc<[CachePadded<AtomicUsize>; 2]>>>,
}

// SAFETY: the raw pointers refer to the pool's own mappings, which live for the whole process;
// the free lists are behind mutexes and the counters are atomics.
unsafe impl Send for Pool {}
// SAFETY: as for Send: every shared field is a Mutex or an atomic.
unsafe impl Sync for Pool {}

static POOL: OnceLock<Pool> = OnceLock::new();

const SMALL: usize = 0;
const LARGE: usize = 1;

/// Creates the process pool with `packets` ordinary and `large` GSO buffers. Only the first call
/// creates it; later calls (and the lazy default of [`get`]) return the existing pool.
pub fn init(packets: usize, large: usize) -> Result<&'static Pool, PoolError> {
    if let Some(p) = POOL.get() {
        if p.classes[SMALL].count != packets {
            log::warn!(
                "packet pool already holds {} packets; keeping it (asked for {packets})",
                p.classes[SMALL].count
            );
        }
        return Ok(p);
    }
    if packets < 2 * CACHE_BATCH {
        return Err(PoolError::TooSmall {
            min: 2 * CACHE_BATCH,
            got: packets,
        });
    }
    let small = Class::map("stitch-packets", packets, BUFFER_STRIDE, DATA_AREA)?;
    let large = Class::map(
        "stitch-gso-packets",
        large.max(1),
        LARGE_STRIDE,
        LARGE_DATA_AREA,
    )?;
    let pool = Pool {
        classes: [small, large],
        caches: Mutex::new(Vec::new()),
    };
    Ok(POOL.get_or_init(|| pool))
}

/// Bytes a class of `count` buffers of `stride` bytes maps: whole 2 MiB pages.
fn class_bytes(count: usize, stride: usize) -> usize {
    (count * stride).div_ceil(HUGE_PAGE) * HUGE_PAGE
}

/// 2 MiB hugepages a pool of `packets` ordinary and `large` GSO buffers maps (what to reserve
/// so that [`init`] puts it on hugepages).
pub fn hugepages_needed(packets: usize, large: usize) -> usize {
    (class_bytes(packets, BUFFER_STRIDE) + class_bytes(large.max(1), LARGE_STRIDE)) / HUGE_PAGE
}

/// The process pool's counters; zeros while no pool is made (no packet exists), so that a
/// process that only reads counters (`stitch cleanup` stopping a dead instance's leftovers)
/// does not map 644 MiB to say so.
pub fn stats() -> PoolStats {
    POOL.get().map(Pool::stats).unwrap_or_default()
}

/// The process pool, created with the defaults on first use if `init` was not called.
#[inline]
pub fn get() -> &'static Pool {
    match POOL.get() {
        Some(p) => p,
        None => init(DEFAULT_PACKETS, DEFAULT_LARGE_PACKETS)
            .expect("cannot create the default packet pool"),
    }
}

impl Class {
    fn map(name: &str, count: usize, stride: usize, capacity: usize) -> Result<Class, PoolError> {
        let bytes = class_bytes(count, stride);
        let (memfd, mapping, hugepages) = match map_memfd(name, bytes, true) {
            Ok((fd, mapping)) => (fd, mapping, true),
            Err(e) => {
                // The file holds the total reserved: what to write there is that plus this
                // pool's pages (each pool says its own; the README gives the sum for both).
                let reserved: usize = std::fs::read_to_string("/proc/sys/vm/nr_hugepages")
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
                    .unwrap_or(0);
                log::info!(
                    "no 2 MiB hugepages for the {} MiB {name} pool ({e}); using ordinary pages \
                     (it takes {} of them: echo {} > /proc/sys/vm/nr_hugepages)",
                    bytes >> 20,
                    bytes / HUGE_PAGE,
                    reserved + bytes / HUGE_PAGE
                );
                let (fd, mapping) = map_memfd(name, bytes, false)
                    .map_err(|source| PoolError::Map { bytes, source })?;
                (fd, mapping, false)
            }
        };
        let count = bytes / stride;
        let base = mapping.as_ptr();
        // Reverse order so that the first allocations take the lowest addresses.
        let free: Vec<NonNull<PacketBuf>> = (0..count)
            .rev()
            .map(|i| {
                // SAFETY: buffer i ends at (i + 1) * stride <= bytes, inside the mapping, whose
                // base is not null.
                unsafe { NonNull::new_unchecked(base.add(i * stride) as *mut PacketBuf) }
            })
            .collect();
        Ok(Class {
            base,
            _mapping: mapping,
            bytes,
            stride,
            capacity,
            count,
            memfd,
            hugepages,
            global_free: AtomicUsize::new(free.len()),
            free: Mutex::new(free),
            exhausted: AtomicU64::new(0),
            cache_batch: cache_batch_for(count),
            cache_max: 2 * cache_batch_for(count),
        })
    }

    fn take(&self, into: &mut Vec<NonNull<PacketBuf>>, n: usize) {
        let mut free = self.free.lock().unwrap();
        let k = n.min(free.len());
        let at = free.len() - k;
        into.extend(free.drain(at..));
        self.global_free.store(free.len(), Relaxed);
    }

    fn give(&self, from: &mut Vec<NonNull<PacketBuf>>, n: usize) {
        let mut free = self.free.lock().unwrap();
        let at = from.len() - n.min(from.len());
        free.extend(from.drain(at..));
        self.global_free.store(free.len(), Relaxed);
    }

    fn contains(&self, p: *const u8) -> bool {
        (self.base as usize..self.base as usize + self.bytes).contains(&(p as usize))
    }
}

impl Pool {
    /// Ordinary packets in the pool.
    pub fn packets(&self) -> usize {
        self.classes[SMALL].count
    }

    /// Start and length of the ordinary-buffer mapping, e.g. to register it as AF_XDP UMEM.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.classes[SMALL].base, self.classes[SMALL].bytes)
    }

    /// The memfd behind the ordinary buffers, for sharing them with another process.
    pub fn memfd(&self) -> RawFd {
        self.classes[SMALL].memfd.as_raw_fd()
    }

    pub fn uses_hugepages(&self) -> bool {
        self.classes[SMALL].hugepages
    }

    /// Index of an ordinary buffer in its region (stable across processes that map the memfd).
    #[inline]
    pub fn index_of(&self, p: &Packet) -> usize {
        (p.as_ptr() as usize - self.classes[SMALL].base as usize) / self.classes[SMALL].stride
    }

    /// Bytes between two ordinary buffers in the region.
    pub fn stride(&self) -> usize {
        self.classes[SMALL].stride
    }

    /// Takes back ownership of ordinary buffer `index`, given up earlier with
    /// [`Packet::into_raw`] (e.g. while another process held it).
    ///
    /// # Safety
    /// The buffer must have been given up and not be owned by anything else.
    #[inline]
    pub unsafe fn take(&self, index: usize) -> Option<Packet> {
        let c = &self.classes[SMALL];
        if index >= c.count {
            return None;
        }
        // SAFETY: index < count, so the buffer lies inside the class's mapping; the caller
        // guarantees nobody else owns it.
        let mut p = unsafe {
            let buf = c.base.add(index * c.stride) as *mut PacketBuf;
            Packet::from_raw_owned(NonNull::new_unchecked(buf))
        };
        // Another process may have written the header while it held the buffer: the fields
        // that bound the data are the pool's again before anything reads them.
        p.reclaim_header(c.capacity);
        Some(p)
    }

    pub fn stats(&self) -> PoolStats {
        let mut cached = [0usize; 2];
        for c in self.caches.lock().unwrap().iter() {
            cached[SMALL] += c[SMALL].load(Relaxed);
            cached[LARGE] += c[LARGE].load(Relaxed);
        }
        let in_use = |k: usize| {
            let c = &self.classes[k];
            c.count
                .saturating_sub(c.global_free.load(Relaxed) + cached[k])
        };
        PoolStats {
            packets: self.classes[SMALL].count,
            in_use: in_use(SMALL),
            exhausted: self.classes[SMALL].exhausted.load(Relaxed),
            large_packets: self.classes[LARGE].count,
            large_in_use: in_use(LARGE),
            large_exhausted: self.classes[LARGE].exhausted.load(Relaxed),
            hugepages: self.classes[SMALL].hugepages,
        }
    }

    fn class_of(&self, p: NonNull<PacketBuf>) -> usize {
        if self.classes[LARGE].contains(p.as_ptr() as *const u8) {
            LARGE
        } else {
            SMALL
        }
    }
}

fn map_memfd(name: &str, bytes: usize, huge: bool) -> std::io::Result<(OwnedFd, Mapping)> {
    let fd = memfd(name, bytes, huge)?;
    let opts = MapOptions {
        populate: huge,
        ..MapOptions::default()
    };
    let mapping = Mapping::shared(fd.as_fd(), bytes, opts)?;
    Ok((fd, mapping))
}

struct Cache {
    bufs: [Vec<NonNull<PacketBuf>>; 2],
    /// Lengths of `bufs`, published for pool occupancy statistics.
    published: Arc<[CachePadded<AtomicUsize>; 2]>,
}

impl Cache {
    fn new() -> Cache {
        let published = Arc::new([
            CachePadded::new(AtomicUsize::new(0)),
            CachePadded::new(AtomicUsize::new(0)),
        ]);
        get().caches.lock().unwrap().push(published.clone());
        Cache {
            bufs: [
                Vec::with_capacity(3 * CACHE_BATCH),
                Vec::with_capacity(3 * CACHE_BATCH),
            ],
            published,
        }
    }

    /// Makes the cache's lengths visible to [`Pool::stats`].
    #[inline]
    fn publish(&self) {
        self.published[SMALL].store(self.bufs[SMALL].len(), Relaxed);
        self.published[LARGE].store(self.bufs[LARGE].len(), Relaxed);
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        let pool = get();
        for k in [SMALL, LARGE] {
            let n = self.bufs[k].len();
            pool.classes[k].give(&mut self.bufs[k], n);
            self.published[k].store(0, Relaxed);
        }
        pool.caches
            .lock()
            .unwrap()
            .retain(|c| !Arc::ptr_eq(c, &self.published));
    }
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::new());
}

/// Fills the calling thread's cache of class `k` from the global list when it has fewer than
/// `want` buffers; one lock for a whole batch.
#[inline]
fn refill(cache: &mut Cache, class: &Class, k: usize, want: usize) {
    let have = cache.bufs[k].len();
    if have < want {
        class.take(&mut cache.bufs[k], class.cache_batch.max(want - have));
    }
}

/// A buffer of class `k` straight from the global list, for a thread whose cache is gone
/// (exiting) or busy (a packet freed while the cache is being worked on).
#[cold]
fn take_uncached(class: &Class) -> Option<NonNull<PacketBuf>> {
    let mut one = Vec::with_capacity(1);
    class.take(&mut one, 1);
    one.pop()
}

#[inline]
fn alloc_class(k: usize) -> Option<Packet> {
    let class = &get().classes[k];
    let buf = CACHE
        .try_with(|c| match c.try_borrow_mut() {
            Ok(mut c) => {
                refill(&mut c, class, k, 1);
                let b = c.bufs[k].pop();
                c.published[k].store(c.bufs[k].len(), Relaxed);
                b
            }
            Err(_) => take_uncached(class),
        })
        .unwrap_or_else(|_| take_uncached(class));
    match buf {
        Some(b) => {
            // SAFETY: `b` came off a free list, so nothing else holds it.
            let mut p = unsafe { Packet::from_raw(b) };
            p.reset(class.capacity);
            Some(p)
        }
        None => {
            class.exhausted.fetch_add(1, Relaxed);
            None
        }
    }
}

/// Takes a fresh packet (length 0, `HEADROOM` bytes of headroom, room for a jumbo frame).
/// `None` when the pool is exhausted; the pool counts every such failure.
#[inline]
pub fn alloc() -> Option<Packet> {
    alloc_class(SMALL)
}

/// A fresh packet holding a copy of `data` (a frame an app makes: an answer, an error).
/// `None` when the pool is exhausted or `data` is longer than a buffer holds.
pub fn alloc_with(data: &[u8]) -> Option<Packet> {
    let mut p = alloc()?;
    p.set_data(data).ok()?;
    Some(p)
}

/// Appends up to `n` fresh packets (as [`alloc`] makes them) to `out` with one visit to the
/// thread's cache, and returns how many it appended. Fewer than `n` only when the pool is
/// exhausted; each packet missing is counted as one failed allocation.
pub fn alloc_batch(n: usize, out: &mut Vec<Packet>) -> usize {
    out.reserve(n);
    let before = out.len();
    let spare = &mut out.spare_capacity_mut()[..n];
    // SAFETY: `Packet` is a transparent buffer pointer and `MaybeUninit` is transparent, so the
    // spare room of a `Vec<Packet>` has the layout of uninitialised buffer pointers; the slice
    // borrows `out` only until `take_owned` returns.
    let spare = unsafe {
        std::slice::from_raw_parts_mut(
            spare
                .as_mut_ptr()
                .cast::<std::mem::MaybeUninit<NonNull<PacketBuf>>>(),
            n,
        )
    };
    let got = take_owned(spare);
    // SAFETY: `take_owned` initialised the first `got` spare elements with buffers off a free
    // list, which nothing else holds; each is made a fresh packet just below.
    unsafe { out.set_len(before + got) };
    let capacity = small_capacity();
    for p in &mut out[before..] {
        p.reset(capacity);
    }
    got
}

/// Moves up to `into.len()` ordinary buffers from the thread's cache into `into` — a run of a
/// link's free slots, or a vector's spare room — as one block copy, and returns how many it moved, counting each one
/// missing as a failed allocation. Their headers are stale: the caller makes each a fresh packet
/// with [`Packet::reset`] (capacity [`small_capacity`]) before anything reads it, so that a
/// buffer's header is written once, beside its frame.
pub(crate) fn take_owned(into: &mut [std::mem::MaybeUninit<NonNull<PacketBuf>>]) -> usize {
    let class = &get().classes[SMALL];
    let n = into.len();
    let copy = |bufs: &mut Vec<NonNull<PacketBuf>>, into: &mut [std::mem::MaybeUninit<_>]| {
        let k = n.min(bufs.len());
        let at = bufs.len() - k;
        for (slot, &b) in into.iter_mut().zip(&bufs[at..]) {
            slot.write(b);
        }
        bufs.truncate(at);
        k
    };
    let cached = CACHE.try_with(|c| match c.try_borrow_mut() {
        Ok(mut c) => {
            refill(&mut c, class, SMALL, n);
            let k = copy(&mut c.bufs[SMALL], into);
            c.published[SMALL].store(c.bufs[SMALL].len(), Relaxed);
            Some(k)
        }
        Err(_) => None,
    });
    let got = match cached {
        Ok(Some(k)) => k,
        _ => {
            let mut bufs = Vec::with_capacity(n);
            class.take(&mut bufs, n);
            copy(&mut bufs, into)
        }
    };
    if got < n {
        class.exhausted.fetch_add((n - got) as u64, Relaxed);
    }
    got
}

/// Data-area bytes of an ordinary buffer, for [`Packet::reset`] of buffers from [`take_owned`].
#[inline]
pub(crate) fn small_capacity() -> usize {
    get().classes[SMALL].capacity
}

/// Takes a fresh large packet, big enough for a 64 KiB GSO super-frame.
#[inline]
pub fn alloc_large() -> Option<Packet> {
    alloc_class(LARGE)
}

/// Returns buffers to the global list when the thread's cache is gone or busy.
#[cold]
fn give_uncached(class: &Class, buf: NonNull<PacketBuf>) {
    class.give(&mut vec![buf], 1);
}

/// Puts `buf` in the cache and moves a batch to the global list when the cache is over its
/// bound.
#[inline]
fn cache_put(cache: &mut Cache, pool: &Pool, buf: NonNull<PacketBuf>) {
    let k = pool.class_of(buf);
    cache.bufs[k].push(buf);
    let class = &pool.classes[k];
    if cache.bufs[k].len() > class.cache_max {
        class.give(&mut cache.bufs[k], class.cache_batch);
    }
}

#[inline]
pub(crate) fn free_raw(buf: NonNull<PacketBuf>) {
    let pool = get();
    let cached = CACHE.try_with(|c| match c.try_borrow_mut() {
        Ok(mut c) => {
            cache_put(&mut c, pool, buf);
            c.publish();
            true
        }
        Err(_) => false,
    });
    if cached != Ok(true) {
        give_uncached(&pool.classes[pool.class_of(buf)], buf);
    }
}

/// Returns `bufs` — buffers of packets their holder gives up, such as a link's slots — to the
/// thread's cache with one visit: copied as one block when all are ordinary buffers (the usual
/// case), one by one otherwise.
///
/// # Safety
/// The caller owns every buffer of `bufs` and never uses any of them again.
pub(crate) unsafe fn free_owned(bufs: &[NonNull<PacketBuf>]) {
    let pool = get();
    let large = &pool.classes[LARGE];
    let cached = CACHE.try_with(|c| match c.try_borrow_mut() {
        Ok(mut c) => {
            if bufs.iter().any(|b| large.contains(b.as_ptr() as *const u8)) {
                bufs.iter().for_each(|&b| cache_put(&mut c, pool, b));
            } else {
                c.bufs[SMALL].extend_from_slice(bufs);
                let small = &pool.classes[SMALL];
                if c.bufs[SMALL].len() > small.cache_max {
                    let over = c.bufs[SMALL].len() - small.cache_max + small.cache_batch;
                    small.give(&mut c.bufs[SMALL], over);
                }
            }
            c.publish();
            true
        }
        Err(_) => false,
    });
    if cached != Ok(true) {
        for &b in bufs {
            give_uncached(&pool.classes[pool.class_of(b)], b);
        }
    }
}

/// Frees every packet of `packets` with one visit to the thread's cache (a sink's batch).
pub fn free_batch(packets: impl IntoIterator<Item = Packet>) {
    let pool = get();
    let mut packets = packets.into_iter();
    let _ = CACHE.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            // The iterator runs while the cache is held: a packet it drops by itself goes the
            // uncached way in `free_raw` and is not lost.
            for p in packets.by_ref() {
                cache_put(&mut c, pool, p.into_raw());
            }
            c.publish();
        }
    });
    // Whatever is left (no cache on this thread) is dropped one by one.
    packets.for_each(drop);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_round_trip_and_fresh_header() {
        let mut p = alloc().unwrap();
        assert_eq!(p.len(), 0);
        assert_eq!(p.headroom(), crate::packet::HEADROOM);
        assert_eq!(p.capacity(), DATA_AREA);
        p.set_data(&[1; 100]).unwrap();
        p.set_timestamp_ns(7);
        drop(p);
        let q = alloc().unwrap();
        assert_eq!(q.len(), 0);
        assert_eq!(q.timestamp_ns(), 0);
        let idx = get().index_of(&q);
        assert!(idx < get().packets());
    }

    #[test]
    fn large_buffers_come_back_to_their_class() {
        let p = alloc_large().unwrap();
        assert_eq!(p.capacity(), LARGE_DATA_AREA);
        assert_eq!(
            get().class_of(NonNull::new(p.as_ptr() as *mut PacketBuf).unwrap()),
            LARGE
        );
        drop(p);
        let q = alloc().unwrap();
        assert_eq!(q.capacity(), DATA_AREA);
    }

    #[test]
    fn a_thread_keeps_at_most_a_fair_share_of_a_small_class() {
        let large = &get().classes[LARGE];
        assert!(
            large.cache_max * 16 <= large.count,
            "a share is a sixteenth at most"
        );
        let kept = std::thread::spawn(|| {
            let held: Vec<Packet> = std::iter::from_fn(alloc_large).take(40).collect();
            assert!(!held.is_empty(), "the large class has free buffers");
            drop(held);
            CACHE.with(|c| c.borrow().bufs[LARGE].len())
        })
        .join()
        .unwrap();
        assert!(
            kept <= large.cache_max,
            "a thread kept {kept} large buffers, more than its share {}",
            large.cache_max
        );
    }

    #[test]
    fn packets_cross_threads() {
        let ps: Vec<Packet> = (0..1000).map(|_| alloc().unwrap()).collect();
        std::thread::spawn(move || drop(ps)).join().unwrap();
        let stats = get().stats();
        assert!(stats.in_use <= stats.packets);
    }
}
