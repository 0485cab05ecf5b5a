//! AF_XDP rings as both sides map them: the `af_xdp` interface (its four rings) and a function
//! that reads the receive ring of a socket the interface steers to it ([`crate::steer`]).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use stitch_core::mapping::{MapOptions, Mapping};

/// Where each ring lies in the socket's file (`mmap` offset).
pub const PGOFF_RX: i64 = libc::XDP_PGOFF_RX_RING;
pub const PGOFF_TX: i64 = libc::XDP_PGOFF_TX_RING;
pub const PGOFF_FILL: i64 = libc::XDP_UMEM_PGOFF_FILL_RING as i64;
pub const PGOFF_COMPLETION: i64 = libc::XDP_UMEM_PGOFF_COMPLETION_RING as i64;
/// A descriptor of the receive or transmit ring: address (8), length (4), options (4).
pub const DESC_SIZE: usize = 16;
const XDP_RING_NEED_WAKEUP: u32 = 1;

/// An `SOL_XDP` socket option; `T` is a repr(C) struct of integers (`libc::xdp_*`).
pub fn getsockopt<T>(fd: RawFd, opt: i32) -> io::Result<T> {
    // SAFETY: every T asked for is a repr(C) struct of integers, for which all zeroes is valid.
    let mut v: T = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<T>() as u32;
    // SAFETY: the kernel writes at most `len` bytes, size_of::<T>(), into `v`, valid for any
    // bytes (above).
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            &mut v as *mut T as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(v)
    }
}

/// Where the kernel put each ring's words in socket `fd`'s mappings.
pub fn offsets(fd: BorrowedFd<'_>) -> Result<libc::xdp_mmap_offsets, String> {
    getsockopt(fd.as_raw_fd(), libc::XDP_MMAP_OFFSETS).map_err(|e| format!("XDP_MMAP_OFFSETS: {e}"))
}

/// One of the four rings shared with the kernel. Entries are u64 addresses (fill, completion)
/// or 16-byte descriptors (rx, tx). The offsets of its words come from the kernel and are
/// checked once, when mapped.
pub struct Ring {
    map: Mapping,
    producer: usize,
    consumer: usize,
    flags: usize,
    desc: usize,
    entry_size: usize,
    mask: u32,
    /// This side's index (producer for fill/tx, consumer for rx/completion).
    pub local: u32,
}

impl Ring {
    /// Maps the ring of socket `fd` at `pgoff` with `entries` entries of `entry_size` bytes.
    pub fn map(
        fd: BorrowedFd<'_>,
        off: &libc::xdp_ring_offset,
        entries: u32,
        entry_size: usize,
        pgoff: i64,
    ) -> Result<Ring, String> {
        if !entries.is_power_of_two() {
            return Err(format!("an AF_XDP ring of {entries} entries"));
        }
        let map_len = (off.desc as usize)
            .checked_add(entries as usize * entry_size)
            .ok_or("the kernel's AF_XDP ring offsets are impossible")?;
        let opts = MapOptions {
            offset: pgoff,
            populate: true,
            ..MapOptions::default()
        };
        let map = Mapping::shared(fd, map_len, opts)
            .map_err(|e| format!("cannot map an AF_XDP ring: {e}"))?;
        let words = [off.producer, off.consumer, off.flags];
        if words.iter().any(|&w| map.atomic_u32(w as usize).is_none())
            || !(off.desc as usize).is_multiple_of(8)
        {
            return Err("the kernel's AF_XDP ring offsets fall outside the ring".into());
        }
        let mut r = Ring {
            map,
            producer: off.producer as usize,
            consumer: off.consumer as usize,
            flags: off.flags as usize,
            desc: off.desc as usize,
            entry_size,
            mask: entries - 1,
            local: 0,
        };
        // Start where the kernel's indices are (both zero on a fresh socket).
        r.local = if pgoff == PGOFF_RX || pgoff == PGOFF_COMPLETION {
            r.cons().load(Ordering::Relaxed)
        } else {
            r.prod().load(Ordering::Relaxed)
        };
        Ok(r)
    }

    /// The receive ring of socket `fd`, of `entries` descriptors.
    pub fn map_rx(fd: BorrowedFd<'_>, entries: u32) -> Result<Ring, String> {
        Ring::map(fd, &offsets(fd)?.rx, entries, DESC_SIZE, PGOFF_RX)
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        self.map.atomic_u32(at).expect("checked when mapped")
    }
    pub fn prod(&self) -> &AtomicU32 {
        self.word(self.producer)
    }
    pub fn cons(&self) -> &AtomicU32 {
        self.word(self.consumer)
    }
    pub fn needs_wakeup(&self) -> bool {
        self.word(self.flags).load(Ordering::Relaxed) & XDP_RING_NEED_WAKEUP != 0
    }
    pub fn size(&self) -> u32 {
        self.mask + 1
    }
    /// Free slots for a producer ring.
    pub fn free(&self) -> u32 {
        self.mask + 1 - self.local.wrapping_sub(self.cons().load(Ordering::Acquire))
    }
    /// Entries ready for a consumer ring.
    pub fn ready(&self) -> u32 {
        self.prod().load(Ordering::Acquire).wrapping_sub(self.local)
    }
    /// Where entry `i` lies in the mapping (inside it: the index is masked).
    fn slot(&self, i: u32) -> usize {
        self.desc + (i & self.mask) as usize * self.entry_size
    }
    /// The address in entry `i` of a fill or completion ring.
    pub fn addr(&self, i: u32) -> u64 {
        self.map
            .read_u64(self.slot(i))
            .expect("entries lie inside the ring")
    }
    pub fn set_addr(&self, i: u32, addr: u64) {
        let written = self.map.write(self.slot(i), &addr.to_ne_bytes());
        debug_assert!(written, "entries lie inside the ring");
    }
    /// (addr, len) of descriptor `i` of an rx or tx ring.
    pub fn desc(&self, i: u32) -> (u64, u32) {
        let at = self.slot(i);
        let addr = self.map.read_u64(at).expect("entries lie inside the ring");
        let len = self
            .map
            .read_u32(at + 8)
            .expect("entries lie inside the ring");
        (addr, len)
    }
    pub fn set_desc(&self, i: u32, addr: u64, len: u32) {
        let mut d = [0u8; DESC_SIZE];
        d[..8].copy_from_slice(&addr.to_ne_bytes());
        d[8..12].copy_from_slice(&len.to_ne_bytes());
        let written = self.map.write(self.slot(i), &d);
        debug_assert!(written, "entries lie inside the ring");
    }
}
