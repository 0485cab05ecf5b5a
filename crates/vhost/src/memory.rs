//! The front-end's memory (a VM's RAM, or testpmd's hugepages), mapped from the file
//! descriptors of SET_MEM_TABLE. Every access goes through [`GuestMemory::gpa`] or
//! [`GuestMemory::user`], which hand out a pointer only when the whole range lies inside one
//! region: a guest cannot make Stitch read or write outside what it shared.

use crate::message::Region;
use std::os::fd::{AsRawFd, OwnedFd};

struct Mapped {
    region: Region,
    /// Kept to be lent to a Stitch process taking over (`stitch upgrade`).
    fd: OwnedFd,
    /// Where the region starts in our address space.
    ptr: *mut u8,
    map_base: *mut libc::c_void,
    map_len: usize,
}

pub struct GuestMemory {
    regions: Vec<Mapped>,
}

// SAFETY: the mappings are plain shared memory; the port serialises its own accesses.
unsafe impl Send for GuestMemory {}
// SAFETY: as for Send: every access is bounds-checked and copies bytes in or out.
unsafe impl Sync for GuestMemory {}

/// `size` bytes of a file the front-end shared, from `offset` (of any alignment), mapped
/// read-write: a pointer to them, and the whole page-aligned mapping (start, length) to unmap.
fn map_shared(
    fd: &OwnedFd,
    offset: u64,
    size: u64,
) -> std::io::Result<(*mut u8, *mut libc::c_void, usize)> {
    let delta = offset % 4096;
    let map_len = (size + delta) as usize;
    // SAFETY: mapping a file the front-end shared; failure is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            (offset - delta) as libc::off_t,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `delta` is inside the mapping just made.
    Ok((
        unsafe { (base as *mut u8).add(delta as usize) },
        base,
        map_len,
    ))
}

impl GuestMemory {
    pub fn map(regions: &[Region], fds: Vec<OwnedFd>) -> Result<GuestMemory, String> {
        let mut out = Vec::new();
        for (r, fd) in regions.iter().zip(fds) {
            if r.size == 0 || r.size > (1 << 40) {
                return Err(format!("memory region of {} bytes", r.size));
            }
            r.guest_phys_addr
                .checked_add(r.size)
                .and(r.user_addr.checked_add(r.size))
                .ok_or("memory region wraps around the address space")?;
            let (ptr, map_base, map_len) = map_shared(&fd, r.mmap_offset, r.size)
                .map_err(|e| format!("cannot map a memory region of {} bytes: {e}", r.size))?;
            out.push(Mapped {
                region: *r,
                fd,
                ptr,
                map_base,
                map_len,
            });
        }
        Ok(GuestMemory { regions: out })
    }

    fn find(&self, addr: u64, len: u64, key: impl Fn(&Region) -> u64) -> Option<*mut u8> {
        let end = addr.checked_add(len)?;
        self.regions.iter().find_map(|m| {
            let start = key(&m.region);
            (addr >= start && end <= start + m.region.size)
                // SAFETY: the offset is inside the region's mapping.
                .then(|| unsafe { m.ptr.add((addr - start) as usize) })
        })
    }

    /// `len` bytes at guest physical address `addr` (descriptor buffers).
    pub fn gpa(&self, addr: u64, len: u64) -> Option<*mut u8> {
        self.find(addr, len, |r| r.guest_phys_addr)
    }

    /// `len` bytes at the front-end's own address `addr` (ring addresses).
    pub fn user(&self, addr: u64, len: u64) -> Option<*mut u8> {
        self.find(addr, len, |r| r.user_addr)
    }

    /// The memory table and duplicates of its files, from which another process maps the
    /// same memory ([`GuestMemory::map`]).
    pub fn lend(&self) -> std::io::Result<(Vec<Region>, Vec<OwnedFd>)> {
        let fds = (self.regions.iter().map(|m| m.fd.try_clone())).collect::<Result<_, _>>()?;
        Ok((self.regions.iter().map(|m| m.region).collect(), fds))
    }

    pub fn total_size(&self) -> u64 {
        self.regions.iter().map(|m| m.region.size).sum()
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        for m in &self.regions {
            // SAFETY: unmapping our own mapping once.
            unsafe { libc::munmap(m.map_base, m.map_len) };
        }
    }
}

/// The dirty log of live migration (SET_LOG_BASE): one bit per 4 KiB page of guest physical
/// memory, set for every page the back-end writes while the front-end asks for logging
/// (VHOST_F_LOG_ALL), so that QEMU copies those pages again.
pub struct DirtyLog {
    ptr: *mut u8,
    len: usize,
    map_base: *mut libc::c_void,
    map_len: usize,
}

// SAFETY: shared memory updated with atomic byte operations only.
unsafe impl Send for DirtyLog {}
// SAFETY: as for Send: concurrent marks are atomic ORs.
unsafe impl Sync for DirtyLog {}

impl DirtyLog {
    pub fn map(fd: &OwnedFd, size: u64, offset: u64) -> Result<DirtyLog, String> {
        if size == 0 || size > (1 << 32) {
            return Err(format!("dirty log of {size} bytes"));
        }
        let (ptr, map_base, map_len) =
            map_shared(fd, offset, size).map_err(|e| format!("cannot map the dirty log: {e}"))?;
        Ok(DirtyLog {
            ptr,
            len: size as usize,
            map_base,
            map_len,
        })
    }

    /// Marks the pages of `len` bytes written at guest physical address `gpa`.
    pub fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (first, last) = (gpa / 4096, (gpa + len - 1) / 4096);
        for page in first..=last {
            let byte = (page / 8) as usize;
            if byte >= self.len {
                return;
            }
            // SAFETY: inside the mapping; the front-end reads and clears bits concurrently,
            // hence the atomic OR.
            let b = unsafe { std::sync::atomic::AtomicU8::from_ptr(self.ptr.add(byte)) };
            b.fetch_or(1 << (page % 8), std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.map_base, self.map_len) };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    pub fn memfd(size: usize) -> OwnedFd {
        let name = std::ffi::CString::new("guest").unwrap();
        // SAFETY: plain syscalls on a fresh descriptor.
        unsafe {
            let fd = libc::memfd_create(name.as_ptr(), 0);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, size as libc::off_t), 0);
            OwnedFd::from_raw_fd(fd)
        }
    }

    #[test]
    fn ranges_outside_a_region_are_refused() {
        let r = Region {
            guest_phys_addr: 0x1000_0000,
            size: 1 << 20,
            user_addr: 0x7f00_0000_0000,
            mmap_offset: 0,
        };
        let m = GuestMemory::map(&[r], vec![memfd(1 << 20)]).unwrap();
        assert!(m.gpa(0x1000_0000, 64).is_some());
        assert!(m.gpa(0x1000_0000 + (1 << 20) - 64, 64).is_some());
        assert!(
            m.gpa(0x1000_0000 + (1 << 20) - 63, 64).is_none(),
            "crosses the end"
        );
        assert!(m.gpa(0x0fff_ffff, 2).is_none(), "starts before");
        assert!(m.gpa(u64::MAX - 4, 64).is_none(), "wraps");
        assert!(m.user(0x7f00_0000_0010, 16).is_some());
        assert!(m.user(0x1000_0000, 16).is_none());
    }

    #[test]
    fn written_pages_are_marked_in_the_dirty_log() {
        let fd = memfd(4096);
        let log = DirtyLog::map(&fd, 16, 0).unwrap();
        log.mark(0x1000, 1); // page 1
        log.mark(0x7ff0, 0x20); // pages 7 and 8
        log.mark(1 << 40, 64); // beyond the log: ignored
        let mut b = [0u8; 2];
        // SAFETY: reading the memfd back.
        unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr() as *mut libc::c_void, 2, 0) };
        assert_eq!(b, [0b1000_0010, 0b0000_0001]);
    }
}
