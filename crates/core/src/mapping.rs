//! Shared memory mappings: the packet pool's memfd, rings shared with the kernel (AF_PACKET,
//! AF_XDP) and with function processes. Offsets into a ring often come from the other side,
//! so every access through a [`Mapping`] is checked against its length (and alignment, for
//! atomics) and yields `None` when it falls outside; the one unchecked step is `mmap` itself.
//!
//! Views of bytes are plain `&[u8]`: any bit pattern is a valid `u8`, and the ring protocols
//! built on a mapping hand each frame or buffer to one side at a time, so the other side does
//! not write what this side is reading. A peer that breaks its protocol can only change the
//! bytes seen, which every reader of untrusted packets has to expect anyway.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

/// Types whose all-zero bytes are a valid value (what [`ZeroedSlice`] holds).
pub use bytemuck::Zeroable;

/// A shared read-write mapping of a file or socket, unmapped on drop.
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping owns its address range (unmapped once, on drop) and hands out only checked
// views of it; sharing those between threads is what the rings built on it are for, and their
// index words are atomics.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: `&Mapping` gives bounds-checked byte views and atomics, nothing that
// assumes a single thread.
unsafe impl Sync for Mapping {}

/// How to map.
#[derive(Debug, Clone, Copy, Default)]
pub struct MapOptions {
    /// Offset in the file (AF_XDP selects a ring by offset).
    pub offset: i64,
    /// Fault every page in now.
    pub populate: bool,
    /// Lock the pages in memory if the memlock limit allows (a ring the kernel writes into).
    pub lock: bool,
}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, read-write.
    pub fn shared(fd: BorrowedFd<'_>, len: usize, opts: MapOptions) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot map zero bytes",
            ));
        }
        let flags = libc::MAP_SHARED | if opts.populate { libc::MAP_POPULATE } else { 0 };
        let map = |flags| {
            // SAFETY: a fresh mapping at an address the kernel chooses (null hint) cannot
            // overlap memory Rust already uses; the fd is open for the whole call.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    fd.as_raw_fd(),
                    opts.offset,
                )
            }
        };
        let mut p = libc::MAP_FAILED;
        if opts.lock {
            // MAP_LOCKED fails under a low RLIMIT_MEMLOCK; an unlocked mapping still works.
            p = map(flags | libc::MAP_LOCKED);
        }
        if p == libc::MAP_FAILED {
            p = map(flags);
        }
        match NonNull::new(p as *mut u8) {
            Some(base) if p != libc::MAP_FAILED => Ok(Mapping { base, len }),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// `len` bytes of fresh shared memory: a memfd named `name` (seen in /proc/PID/maps) and
    /// its mapping, every page faulted in.
    pub fn create(name: &str, len: usize) -> io::Result<(OwnedFd, Mapping)> {
        let fd = memfd(name, len, false)?;
        let opts = MapOptions {
            populate: true,
            ..MapOptions::default()
        };
        let m = Mapping::shared(fd.as_fd(), len, opts)?;
        Ok((fd, m))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for what needs the address itself: registering the area with the
    /// kernel, or carving it into packet buffers.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Whether `[off, off + size)` lies inside the mapping.
    #[inline]
    fn fits(&self, off: usize, size: usize) -> bool {
        off.checked_add(size).is_some_and(|end| end <= self.len)
    }

    /// `len` bytes at `off`.
    #[inline]
    pub fn bytes(&self, off: usize, len: usize) -> Option<&[u8]> {
        if !self.fits(off, len) {
            return None;
        }
        // SAFETY: the range is inside the mapping (checked above), which lives as long as
        // `self`; every bit pattern is a valid u8 (module comment: who writes when).
        Some(unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(off), len) })
    }

    /// `len` bytes at `off`, writable.
    #[inline]
    pub fn bytes_mut(&mut self, off: usize, len: usize) -> Option<&mut [u8]> {
        if !self.fits(off, len) {
            return None;
        }
        // SAFETY: as for `bytes`; `&mut self` keeps every other view of this mapping out.
        Some(unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(off), len) })
    }

    /// Copies `src` to `off`; false (nothing written) if it does not fit.
    #[inline]
    #[must_use]
    pub fn write(&self, off: usize, src: &[u8]) -> bool {
        if !self.fits(off, src.len()) {
            return false;
        }
        // SAFETY: the destination is inside the mapping (checked above) and cannot overlap
        // `src`, a Rust slice that is not a view of this mapping when it is being written
        // (the ring protocols give this side the region it writes).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.as_ptr().add(off), src.len())
        };
        true
    }

    /// The 32-bit word at `off`, read with one load.
    #[inline]
    pub fn read_u32(&self, off: usize) -> Option<u32> {
        Some(u32::from_ne_bytes(self.bytes(off, 4)?.try_into().ok()?))
    }

    #[inline]
    pub fn read_u64(&self, off: usize) -> Option<u64> {
        Some(u64::from_ne_bytes(self.bytes(off, 8)?.try_into().ok()?))
    }

    /// The atomic word at `off` (index and status words shared with the other side).
    #[inline]
    pub fn atomic_u32(&self, off: usize) -> Option<&AtomicU32> {
        if !self.fits(off, 4) || !(self.base.as_ptr() as usize + off).is_multiple_of(4) {
            return None;
        }
        // SAFETY: in bounds and 4-aligned (checked above); AtomicU32 has u32's layout and any
        // bit pattern is valid; the mapping outlives the reference.
        Some(unsafe { &*(self.base.as_ptr().add(off) as *const AtomicU32) })
    }

    /// A `T` at `off`, borrowed from the mapping.
    ///
    /// # Safety
    /// Every bit pattern must be a valid `T` (`#[repr(C)]` of integers and atomics), and
    /// fields the other side writes concurrently must be atomics.
    pub unsafe fn view<T>(&self, off: usize) -> Option<&T> {
        let aligned = (self.base.as_ptr() as usize + off).is_multiple_of(std::mem::align_of::<T>());
        if !self.fits(off, std::mem::size_of::<T>()) || !aligned {
            return None;
        }
        // SAFETY: in bounds and aligned (checked above); valid for any bit pattern (the
        // caller's contract); the mapping outlives the reference.
        Some(unsafe { &*(self.base.as_ptr().add(off) as *const T) })
    }

    /// A `T` at `off`, to write (a header set up before the other side sees the mapping).
    ///
    /// # Safety
    /// As for [`Mapping::view`].
    pub unsafe fn view_mut<T>(&mut self, off: usize) -> Option<&mut T> {
        let aligned = (self.base.as_ptr() as usize + off).is_multiple_of(std::mem::align_of::<T>());
        if !self.fits(off, std::mem::size_of::<T>()) || !aligned {
            return None;
        }
        // SAFETY: as for `view`; `&mut self` keeps every other view of this mapping out.
        Some(unsafe { &mut *(self.base.as_ptr().add(off) as *mut T) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `shared` and nothing borrows from it any more (views
        // borrow `self`).
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// A new anonymous shared-memory file of `len` bytes (`huge`: backed by 2 MiB hugepages).
pub fn memfd(name: &str, len: usize, huge: bool) -> io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a memfd name"))?;
    let flags = libc::MFD_CLOEXEC | if huge { libc::MFD_HUGETLB } else { 0 };
    // SAFETY: `cname` is a NUL-terminated string alive for the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let size = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "memfd too large"))?;
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Bytes of an x86-64 huge page, as the packet pool's hugetlbfs memory and transparent huge
/// pages use them.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the 2 MiB pages inside `items` with huge pages, now: for a large
/// table read at random (a binding table, a route table), whose every lookup would otherwise
/// miss the TLB and walk the page tables — twice over under a hypervisor. A hint: with
/// transparent huge pages off, or no huge page free, nothing changes and `false` comes back.
pub fn back_with_huge_pages<T>(items: &[T]) -> bool {
    // Linux 6.1's MADV_COLLAPSE: collapse what is already populated, synchronously.
    const MADV_COLLAPSE: libc::c_int = 25;
    let start = (items.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (items.as_ptr() as usize + std::mem::size_of_val(items)) & !(HUGE_PAGE - 1);
    if end <= start {
        return false;
    }
    let (at, len) = (start as *mut libc::c_void, end - start);
    // SAFETY: the range lies inside `items`' allocation and is 2 MiB aligned; MADV_HUGEPAGE and
    // MADV_COLLAPSE change how its pages are backed, never their contents.
    unsafe {
        libc::madvise(at, len, libc::MADV_HUGEPAGE);
        libc::madvise(at, len, MADV_COLLAPSE) == 0
    }
}

/// A slice of `T` in private anonymous memory, zero until written: its pages are faulted in as
/// the slice is used, so a table sized for a million sessions costs memory only for the part
/// in use, and 2 MiB huge pages back it where the kernel gives them (a large table's lookups
/// then seldom miss the TLB). For tables whose size is fixed when they are made.
pub struct ZeroedSlice<T> {
    base: NonNull<T>,
    len: usize,
    bytes: usize,
}

// SAFETY: a ZeroedSlice owns its mapping as a Box owns its allocation; it is shared or sent as
// its elements are.
unsafe impl<T: Send> Send for ZeroedSlice<T> {}
// SAFETY: as for Send.
unsafe impl<T: Sync> Sync for ZeroedSlice<T> {}

impl<T: Zeroable + Copy> ZeroedSlice<T> {
    /// `len` elements, all zero. Fails only when the address space is exhausted.
    pub fn new(len: usize) -> io::Result<Self> {
        let page = 4096;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| io::Error::other("table too large"))?
            .max(1)
            .next_multiple_of(page);
        assert!(std::mem::align_of::<T>() <= page);
        // SAFETY: a fresh private anonymous mapping: no file, no other owner; NORESERVE since
        // most of a large table's pages may never be touched.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if bytes >= HUGE_PAGE {
            // SAFETY: the range is the mapping just made; the advice changes how its pages are
            // backed, never their contents.
            unsafe { libc::madvise(at, bytes, libc::MADV_HUGEPAGE) };
        }
        let base = NonNull::new(at.cast::<T>()).ok_or_else(|| io::Error::other("mmap gave 0"))?;
        Ok(ZeroedSlice { base, len, bytes })
    }
}

impl<T> std::ops::Deref for ZeroedSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the mapping holds `len` elements, page aligned (so aligned for `T`), zero-
        // filled by the kernel — a valid `T` (`Zeroable`) — or written through `&mut` since.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for ZeroedSlice<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`; `&mut self` makes this view the only one.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.len) }
    }
}

impl<T> Drop for ZeroedSlice<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping is this slice's alone, made in `new` with this length; the
        // elements need no drop of their own (`new` takes only `Copy` types).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn accesses_outside_the_mapping_are_refused() {
        let (_fd, m) = Mapping::create("stitch-mapping-test", 4096).unwrap();
        assert!(m.write(4092, &[1, 2, 3, 4]));
        assert_eq!(m.bytes(4092, 4), Some(&[1u8, 2, 3, 4][..]));
        assert!(m.bytes(4093, 4).is_none());
        assert!(m.bytes(usize::MAX, 2).is_none());
        assert!(!m.write(4095, &[0, 0]));
        assert!(m.atomic_u32(4094).is_none(), "misaligned");
        assert!(m.atomic_u32(4096).is_none(), "outside");
        m.atomic_u32(8).unwrap().store(7, Ordering::Relaxed);
        assert_eq!(m.read_u32(8), Some(7));
        assert!(m.read_u64(4090).is_none());
    }

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let (fd, a) = Mapping::create("stitch-mapping-test", 8192).unwrap();
        let b = Mapping::shared(fd.as_fd(), 8192, MapOptions::default()).unwrap();
        assert!(a.write(5000, b"stitch"));
        assert_eq!(b.bytes(5000, 6), Some(&b"stitch"[..]));
    }

    #[test]
    fn a_large_table_is_collapsed_into_huge_pages_when_the_kernel_can() {
        let table: Vec<u64> = (0..(8 << 20) / 8).collect();
        let collapsed = back_with_huge_pages(&table);
        let (start, end) = (table.as_ptr() as usize, table.as_ptr_range().end as usize);
        // madvise splits the mapping: every part of it that overlaps the table counts.
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut huge_kb = 0;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
            if let Some((a, b)) = range.and_then(|(a, b)| {
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            }) {
                inside = a < end && start < b;
            } else if let Some(kb) = line.strip_prefix("AnonHugePages:").filter(|_| inside) {
                huge_kb += kb.trim().trim_end_matches(" kB").parse::<usize>().unwrap();
            }
        }
        eprintln!("collapsed {collapsed}, {huge_kb} kB in huge pages");
        assert_eq!(collapsed, huge_kb >= 2048, "{huge_kb} kB");
        assert_eq!(table[12345], 12345, "contents survive");
    }
}
