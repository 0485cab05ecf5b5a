//! The packet pool: one preallocated region of fixed-size buffers for the whole process.
//!
//! The region is a memfd (2 MiB hugepages when the system has them reserved, ordinary pages
//! otherwise) so that later it can be handed to other processes (shared-memory ports) or to the
//! kernel (AF_XDP UMEM) as-is. Buffers circulate through a per-thread cache; the cache trades
//! with the global free list in batches, so allocating or freeing a packet takes no lock and no
//! syscall. When the pool is empty, `alloc` returns `None` and counts it: nothing ever waits.

use crate::packet::{Packet, PacketBuf, BUFFER_STRIDE};
use crossbeam_utils::CachePadded;
use std::cell::RefCell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

/// Packets in the pool when nothing else is configured (640 MiB of address space; only touched
/// pages cost memory with ordinary pages).
pub const DEFAULT_PACKETS: usize = 65536;
const HUGEPAGE: usize = 2 << 20;
/// Most buffers a thread keeps to itself.
const CACHE_MAX: usize = 512;
/// Buffers moved between a thread cache and the global list at once.
const CACHE_BATCH: usize = 256;

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
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct PoolStats {
    pub packets: usize,
    pub in_use: usize,
    pub exhausted: u64,
    pub hugepages: bool,
}

pub struct Pool {
    base: *mut u8,
    bytes: usize,
    packets: usize,
    memfd: OwnedFd,
    hugepages: bool,
    free: Mutex<Vec<NonNull<PacketBuf>>>,
    global_free: AtomicUsize,
    exhausted: AtomicU64,
    caches: Mutex<Vec<Arc<CachePadded<AtomicUsize>>>>,
}

// The raw pointers refer to the pool's own mapping, which lives for the whole process.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

static POOL: OnceLock<Pool> = OnceLock::new();

/// Creates the process pool with `packets` buffers. Only the first call creates it; later calls
/// (and the lazy default of [`get`]) return the existing pool.
pub fn init(packets: usize) -> Result<&'static Pool, PoolError> {
    if let Some(p) = POOL.get() {
        if p.packets != packets {
            log::warn!(
                "packet pool already holds {} packets; keeping it (asked for {packets})",
                p.packets
            );
        }
        return Ok(p);
    }
    let pool = Pool::map(packets)?;
    Ok(POOL.get_or_init(|| pool))
}

/// The process pool, created with [`DEFAULT_PACKETS`] on first use if `init` was not called.
#[inline]
pub fn get() -> &'static Pool {
    match POOL.get() {
        Some(p) => p,
        None => init(DEFAULT_PACKETS).expect("cannot create the default packet pool"),
    }
}

impl Pool {
    fn map(packets: usize) -> Result<Pool, PoolError> {
        if packets < 2 * CACHE_BATCH {
            return Err(PoolError::TooSmall {
                min: 2 * CACHE_BATCH,
                got: packets,
            });
        }
        let bytes = (packets * BUFFER_STRIDE).div_ceil(HUGEPAGE) * HUGEPAGE;
        let (memfd, base, hugepages) = match map_memfd(bytes, true) {
            Ok((fd, base)) => (fd, base, true),
            Err(e) => {
                log::info!(
                    "no 2 MiB hugepages for the {} MiB packet pool ({e}); using ordinary pages \
                     (reserve with: echo {} > /proc/sys/vm/nr_hugepages)",
                    bytes >> 20,
                    bytes / HUGEPAGE
                );
                let (fd, base) =
                    map_memfd(bytes, false).map_err(|source| PoolError::Map { bytes, source })?;
                (fd, base, false)
            }
        };
        let packets = bytes / BUFFER_STRIDE;
        // Reverse order so that the first allocations take the lowest addresses.
        let free: Vec<NonNull<PacketBuf>> = (0..packets)
            .rev()
            .map(|i| unsafe {
                NonNull::new_unchecked(base.add(i * BUFFER_STRIDE) as *mut PacketBuf)
            })
            .collect();
        Ok(Pool {
            base,
            bytes,
            packets,
            memfd,
            hugepages,
            global_free: AtomicUsize::new(free.len()),
            free: Mutex::new(free),
            exhausted: AtomicU64::new(0),
            caches: Mutex::new(Vec::new()),
        })
    }

    pub fn packets(&self) -> usize {
        self.packets
    }

    /// Start and length of the pool mapping, e.g. to register it as AF_XDP UMEM.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.base, self.bytes)
    }

    /// The memfd behind the pool, for sharing it with another process.
    pub fn memfd(&self) -> RawFd {
        self.memfd.as_raw_fd()
    }

    pub fn uses_hugepages(&self) -> bool {
        self.hugepages
    }

    /// Index of a buffer in the region (stable across processes that map the same memfd).
    #[inline]
    pub fn index_of(&self, p: &Packet) -> usize {
        (p.as_ptr() as usize - self.base as usize) / BUFFER_STRIDE
    }

    pub fn stats(&self) -> PoolStats {
        let cached: usize = self
            .caches
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.load(Relaxed))
            .sum();
        let free = self.global_free.load(Relaxed) + cached;
        PoolStats {
            packets: self.packets,
            in_use: self.packets.saturating_sub(free),
            exhausted: self.exhausted.load(Relaxed),
            hugepages: self.hugepages,
        }
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
}

fn map_memfd(bytes: usize, huge: bool) -> std::io::Result<(OwnedFd, *mut u8)> {
    let flags = libc::MFD_CLOEXEC | if huge { libc::MFD_HUGETLB } else { 0 };
    let fd = unsafe { libc::memfd_create(c"stitch-packets".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let populate = if huge { libc::MAP_POPULATE } else { 0 };
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | populate,
            fd.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok((fd, base as *mut u8))
}

struct Cache {
    bufs: Vec<NonNull<PacketBuf>>,
    /// Length of `bufs`, published for pool occupancy statistics.
    published: Arc<CachePadded<AtomicUsize>>,
}

impl Cache {
    fn new() -> Cache {
        let published = Arc::new(CachePadded::new(AtomicUsize::new(0)));
        get().caches.lock().unwrap().push(published.clone());
        Cache {
            bufs: Vec::with_capacity(CACHE_MAX + CACHE_BATCH),
            published,
        }
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        let pool = get();
        let n = self.bufs.len();
        pool.give(&mut self.bufs, n);
        self.published.store(0, Relaxed);
        pool.caches
            .lock()
            .unwrap()
            .retain(|c| !Arc::ptr_eq(c, &self.published));
    }
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::new());
}

/// Takes a fresh packet (length 0, `HEADROOM` bytes of headroom). `None` when the pool is
/// exhausted; the pool counts every such failure.
#[inline]
pub fn alloc() -> Option<Packet> {
    let buf = CACHE
        .try_with(|c| {
            let mut c = c.borrow_mut();
            if c.bufs.is_empty() {
                get().take(&mut c.bufs, CACHE_BATCH);
            }
            let b = c.bufs.pop();
            c.published.store(c.bufs.len(), Relaxed);
            b
        })
        .unwrap_or_else(|_| {
            let mut one = Vec::with_capacity(1);
            get().take(&mut one, 1);
            one.pop()
        });
    match buf {
        Some(b) => {
            let mut p = unsafe { Packet::from_raw(b) };
            p.reset();
            Some(p)
        }
        None => {
            get().exhausted.fetch_add(1, Relaxed);
            None
        }
    }
}

#[inline]
pub(crate) fn free_raw(buf: NonNull<PacketBuf>) {
    let cached = CACHE.try_with(|c| {
        let mut c = c.borrow_mut();
        c.bufs.push(buf);
        if c.bufs.len() > CACHE_MAX {
            get().give(&mut c.bufs, CACHE_BATCH);
        }
        c.published.store(c.bufs.len(), Relaxed);
    });
    if cached.is_err() {
        // Thread is exiting and its cache is gone.
        get().give(&mut vec![buf], 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_round_trip_and_fresh_header() {
        let mut p = alloc().unwrap();
        assert_eq!(p.len(), 0);
        assert_eq!(p.headroom(), crate::packet::HEADROOM);
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
    fn packets_cross_threads() {
        let ps: Vec<Packet> = (0..1000).map(|_| alloc().unwrap()).collect();
        std::thread::spawn(move || drop(ps)).join().unwrap();
        let stats = get().stats();
        assert!(stats.in_use <= stats.packets);
    }
}
