//! Split virtqueues (virtio 1.x §2.7) read and written in the front-end's shared memory.
//! Everything the guest wrote is read once into a local copy before use, checked against
//! guest memory and the ring size; a chain longer than the ring (a loop), an index past the
//! ring, a buffer outside guest memory or an indirect table inside an indirect table is a
//! [`Fault`], and the port stops that queue instead of trusting it.
//!
//! One rule for the ring's own memory: its three parts are checked against guest memory once,
//! when the ring is made, and the ring holds that memory (an `Arc`) so that they stay mapped
//! while it exists; every later access is an index masked to the ring's size, through the
//! `unsafe fn`s below whose `# Safety` sections say what the caller checks.

use crate::memory::{DirtyLog, GuestMemory};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

pub const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;
pub const DESC_F_INDIRECT: u16 = 4;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
const USED_F_NO_NOTIFY: u16 = 1;
/// Most buffers one chain may have (QEMU's limit is 1024 for indirect tables).
pub const MAX_SEGMENTS: usize = 1024;

/// How a guest broke its ring: the port stops the queue instead of trusting it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Fault {
    #[error("ring size {0} is not a power of two")]
    RingSize(u16),
    #[error("{part} ring at {addr:#x} is not {align}-aligned")]
    Misaligned {
        part: &'static str,
        addr: u64,
        align: u64,
    },
    #[error("{part} ring at {addr:#x} ({len} bytes) is outside guest memory")]
    RingOutside {
        part: &'static str,
        addr: u64,
        len: u64,
    },
    /// Every entry would be one already taken (QEMU's virtio treats it as an error too).
    #[error("the driver made {ahead} entries available in a ring of {num}")]
    TooManyAvailable { ahead: u16, num: u16 },
    #[error("available entry names descriptor {head} of {num}")]
    HeadOutOfRange { head: u16, num: u16 },
    #[error("descriptor chain from {head} loops or exceeds {MAX_SEGMENTS} buffers")]
    ChainTooLong { head: u16 },
    #[error("indirect table inside an indirect table")]
    NestedIndirect,
    #[error("indirect table of {len} bytes at {addr:#x}")]
    BadIndirect { len: u32, addr: u64 },
    #[error("indirect table at {addr:#x} is outside guest memory")]
    IndirectOutside { addr: u64 },
    #[error("buffer at {addr:#x} ({len} bytes) is outside guest memory")]
    BufferOutside { addr: u64, len: u32 },
    #[error("descriptor {at} continues at {next} of {size}")]
    NextOutOfRange { at: u16, next: u16, size: u16 },
    #[error("receive chain {head} has a device-readable buffer")]
    ReadOnlyReceiveBuffer { head: u16 },
}

/// Asks for the first two cache lines at `p`; when `write`, for ownership (`prefetchw`), so
/// that the stores which follow do not each wait for a second trip to the core that wrote
/// the lines last (a plain prefetch brings them in shared). `_mm_prefetch` with
/// `_MM_HINT_ET0` emits a plain prefetch unless the whole build targets `prfchw`, hence the
/// instruction itself, used where the CPU has it.
#[inline(always)]
pub fn prefetch(p: *const u8, write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching never faults, and `prefetchw` runs only where CPUID reports it.
    unsafe {
        if write && has_prefetchw() {
            std::arch::asm!(
                "prefetchw byte ptr [{p}]",
                "prefetchw byte ptr [{p} + 64]",
                p = in(reg) p,
                options(nostack, preserves_flags, readonly)
            );
        } else {
            stitch_core::prefetch(p);
            stitch_core::prefetch(p.wrapping_add(64));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, write);
}

/// Whether the CPU has `prefetchw` (CPUID 8000_0001h ECX bit 8, "3dnowprefetch" in
/// /proc/cpuinfo): every AMD64 CPU, Intel since Broadwell.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_prefetchw() -> bool {
    use std::arch::x86_64::__cpuid;
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
    })
}

/// One buffer of a descriptor chain, mapped.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub ptr: *mut u8,
    /// Guest physical address (for the dirty log).
    pub gpa: u64,
    pub len: u32,
    pub writable: bool,
}

// SAFETY: a pointer into the shared mapping, held only by the port that took the chain.
unsafe impl Send for Segment {}

/// A ring's place in memory and our position in it.
pub struct Vring {
    pub num: u16,
    /// The guest memory the three parts below lie in (checked for `num` entries each when
    /// the ring was made), kept mapped while the ring exists.
    memory: Arc<GuestMemory>,
    desc: *mut u8,
    avail: *mut u8,
    used: *mut u8,
    /// Guest physical address of the used ring, when the front-end wants its writes logged.
    used_gpa: Option<u64>,
    /// Next available entry to take.
    last_avail: u16,
    /// The driver's available index as last read: re-read only when we catch up with it, so
    /// that the cache line the driver writes is not pulled over once per packet.
    avail_seen: u16,
    /// Next used entry to fill (published by [`Vring::publish`]).
    used_idx: u16,
    published: u16,
    /// The descriptor the next chain probably starts at: the one after the last chain's
    /// head (one-buffer chains, used in order).
    desc_guess: u16,
}

// SAFETY: pointers into the shared mapping (which the ring keeps alive), used by one thread
// at a time (the port).
unsafe impl Send for Vring {}

/// The guest's 16-bit word at `p`.
///
/// # Safety
/// `p` must be 2-aligned and lie, with the byte after it, in guest memory that stays mapped
/// for the call (a ring part checked when the ring was made, at an index inside it).
unsafe fn rd16(p: *const u8) -> u16 {
    // SAFETY: the caller's contract; the guest may write the word at any time, hence the
    // volatile read of one copy.
    unsafe { std::ptr::read_volatile(p as *const u16) }
}

/// Descriptor `i` of `table`: (address, length, flags, next), each read once.
///
/// # Safety
/// `table` must be 16-aligned and hold at least `i + 1` descriptors of 16 bytes in guest
/// memory that stays mapped for the call.
unsafe fn read_desc(table: *const u8, i: u16) -> (u64, u32, u16, u16) {
    // SAFETY: entry `i` lies inside the table (the caller's contract), 16-aligned.
    unsafe {
        let p = table.add(16 * i as usize);
        (
            std::ptr::read_volatile(p as *const u64),
            std::ptr::read_volatile(p.add(8) as *const u32),
            std::ptr::read_volatile(p.add(12) as *const u16),
            std::ptr::read_volatile(p.add(14) as *const u16),
        )
    }
}

impl Vring {
    /// Maps the three parts of a ring of `num` entries given by front-end addresses.
    pub fn new(
        mem: &Arc<GuestMemory>,
        num: u16,
        desc: u64,
        avail: u64,
        used: u64,
        base: u16,
        used_gpa: Option<u64>,
    ) -> Result<Vring, Fault> {
        if num == 0 || !num.is_power_of_two() {
            return Err(Fault::RingSize(num));
        }
        let n = num as u64;
        let part = |addr: u64, len: u64, align: u64, part: &'static str| {
            if !addr.is_multiple_of(align) {
                return Err(Fault::Misaligned { part, addr, align });
            }
            (mem.user(addr, len)).ok_or(Fault::RingOutside { part, addr, len })
        };
        let v = Vring {
            num,
            memory: mem.clone(),
            desc: part(desc, 16 * n, 16, "descriptor")?,
            avail: part(avail, 6 + 2 * n, 2, "available")?,
            used: part(used, 6 + 8 * n, 4, "used")?,
            used_gpa,
            last_avail: base,
            avail_seen: base,
            used_idx: base,
            published: base,
            desc_guess: 0,
        };
        // We poll: ask the driver not to kick us.
        // SAFETY: the used ring's flags word, checked above (6 + 8n bytes, 4-aligned).
        unsafe { std::ptr::write_volatile(v.used as *mut u16, USED_F_NO_NOTIFY) };
        Ok(v)
    }

    /// The ring entry of a free-running index (`num` is a power of two: a mask, not a
    /// division, which cost more than the rest of taking a chain).
    fn slot(&self, index: u16) -> usize {
        (index & (self.num - 1)) as usize
    }

    /// Entries the driver has made available and we have not taken.
    pub fn pending(&mut self) -> u16 {
        let cached = self.avail_seen.wrapping_sub(self.last_avail);
        if cached != 0 && cached <= self.num {
            return cached;
        }
        // SAFETY: the available ring's index word (checked for 6 + 2n bytes when made).
        self.avail_seen = unsafe { rd16(self.avail.wrapping_add(2)) };
        fence(Ordering::Acquire);
        self.avail_seen.wrapping_sub(self.last_avail)
    }

    /// The descriptor the `k`-th available entry after the next one to take names
    /// (unchecked).
    fn avail_entry(&self, k: u16) -> u16 {
        let slot = self.slot(self.last_avail.wrapping_add(k));
        // SAFETY: entry `slot` < num of the available ring (masked), checked when made.
        unsafe { rd16(self.avail.wrapping_add(4 + 2 * slot)) }
    }

    /// Takes the next available chain head.
    pub fn next_head(&mut self) -> Result<u16, Fault> {
        let ahead = self.avail_seen.wrapping_sub(self.last_avail);
        if ahead > self.num {
            let num = self.num;
            return Err(Fault::TooManyAvailable { ahead, num });
        }
        let head = self.avail_entry(0);
        if head >= self.num {
            let num = self.num;
            return Err(Fault::HeadOutOfRange { head, num });
        }
        self.last_avail = self.last_avail.wrapping_add(1);
        self.desc_guess = head.wrapping_add(1);
        Ok(head)
    }

    /// The buffers of the chain starting at `head`, in `out` (cleared first).
    pub fn chain(&self, head: u16, out: &mut Vec<Segment>) -> Result<(), Fault> {
        out.clear();
        self.chain_onto(head, out)
    }

    /// The buffers of the chain starting at `head`, appended to `out` — so that a burst of
    /// chains gathers into one list without copying each chain's segments again. On a fault
    /// `out` is left as it was.
    pub fn chain_onto(&self, head: u16, out: &mut Vec<Segment>) -> Result<(), Fault> {
        let start = out.len();
        let r = self.walk(head, start, out);
        if r.is_err() {
            out.truncate(start);
        }
        r
    }

    fn walk(&self, head: u16, start: usize, out: &mut Vec<Segment>) -> Result<(), Fault> {
        let mem = &*self.memory;
        let mut table = self.desc as *const u8;
        let mut size = self.num;
        let mut i = head;
        let mut indirect = false;
        loop {
            if out.len() - start >= MAX_SEGMENTS {
                return Err(Fault::ChainTooLong { head });
            }
            // SAFETY: `i` < `size` descriptors of `table`: the ring's own table (checked for
            // `num` when made; `head` < num and every `next` < size checked below) or an
            // indirect table checked in guest memory for `size` entries, 16-aligned, here.
            // The ring holds `mem`.
            let (addr, len, flags, next) = unsafe { read_desc(table, i) };
            if flags & DESC_F_INDIRECT != 0 {
                if indirect {
                    return Err(Fault::NestedIndirect);
                }
                if len == 0
                    || !len.is_multiple_of(16)
                    || len / 16 > MAX_SEGMENTS as u32
                    || !addr.is_multiple_of(16)
                {
                    return Err(Fault::BadIndirect { len, addr });
                }
                table = (mem.gpa(addr, len as u64)).ok_or(Fault::IndirectOutside { addr })?;
                size = (len / 16) as u16;
                i = 0;
                indirect = true;
                continue;
            }
            let ptr = (mem.gpa(addr, len as u64)).ok_or(Fault::BufferOutside { addr, len })?;
            out.push(Segment {
                ptr,
                gpa: addr,
                len,
                writable: flags & DESC_F_WRITE != 0,
            });
            if flags & DESC_F_NEXT == 0 {
                return Ok(());
            }
            if next >= size {
                return Err(Fault::NextOutOfRange { at: i, next, size });
            }
            i = next;
        }
    }

    /// Asks for the descriptors of the next `n` available chains (as far as the driver has
    /// made them available), so that the walks which follow find them instead of each
    /// waiting for its own line from the driver's core. Reads only available entries;
    /// anything out of range is simply not prefetched.
    pub fn prefetch_descriptors(&mut self, n: u16) {
        let n = n.min(self.pending()).min(self.num);
        // Drivers that use descriptors in ring order (VIRTIO_F_IN_ORDER; DPDK's and Linux's
        // usually do) put the next chains right after the last one: those lines are asked
        // for before the available entries that name them arrive, one miss fewer in a row.
        for k in (0..n).step_by(4) {
            let i = self.desc_guess.wrapping_add(k) & (self.num - 1);
            stitch_core::prefetch(self.desc.wrapping_add(16 * i as usize));
        }
        for k in 0..n {
            let head = self.avail_entry(k);
            if head < self.num {
                stitch_core::prefetch(self.desc.wrapping_add(16 * head as usize));
            }
        }
        // And the used entries these chains will take, for writing: the driver reads them,
        // and a store to a line it holds would stall the stores behind it until it is ours.
        for k in (0..n).step_by(8) {
            let slot = self.slot(self.used_idx.wrapping_add(k));
            prefetch(self.used.wrapping_add(4 + 8 * slot), true);
        }
    }

    /// Takes ownership of the first two cache lines of the next `n` available chains' first
    /// buffers: for a receive ring, whose buffers the driver made available long before we
    /// fill them, this moves their lines to our core between bursts instead of when packets
    /// arrive. It writes zeros where any frame's header will go (the first 8 bytes, and 8
    /// bytes at 64 when the buffer is that long): a device may write any buffer it was
    /// given, and stores take the lines reliably, where `prefetchw` measured no better than
    /// leaving them (the fill still waited on them when the cores were far apart). While
    /// the front-end logs dirty pages (`logging`), it only prefetches. Reads only available
    /// entries and their first descriptors; anything out of range or read-only is skipped.
    pub fn warm(&mut self, n: u16, logging: bool) {
        let n = n.min(self.pending()).min(self.num);
        for k in 0..n {
            let head = self.avail_entry(k);
            if head >= self.num {
                continue;
            }
            // SAFETY: `head` < num descriptors of the ring's table, checked when made.
            let (addr, len, flags, _) = unsafe { read_desc(self.desc, head) };
            if flags & (DESC_F_INDIRECT | DESC_F_WRITE) != DESC_F_WRITE || len < 8 {
                continue;
            }
            let Some(p) = self.memory.gpa(addr, (len as u64).min(72)) else {
                continue;
            };
            if logging {
                prefetch(p, true);
                continue;
            }
            // SAFETY: `p` lies in guest memory for min(len, 72) bytes (checked just above),
            // in a buffer the driver gave the device to write.
            unsafe {
                std::ptr::write_unaligned(p as *mut u64, 0);
                if len >= 72 {
                    std::ptr::write_unaligned(p.add(64) as *mut u64, 0);
                }
            }
        }
    }

    /// Records that the chain at `head` was used, `len` bytes written into it.
    pub fn add_used(&mut self, head: u16, len: u32, log: Option<&DirtyLog>) {
        let slot = self.slot(self.used_idx);
        if let (Some(log), Some(g)) = (log, self.used_gpa) {
            log.mark(g + 4 + 8 * slot as u64, 8);
        }
        // SAFETY: entry `slot` < num (masked) of the used ring, checked for `num` entries
        // when made, 4-aligned.
        unsafe {
            let p = self.used.add(4 + 8 * slot);
            std::ptr::write_volatile(p as *mut u32, head as u32);
            std::ptr::write_volatile(p.add(4) as *mut u32, len);
        }
        self.used_idx = self.used_idx.wrapping_add(1);
    }

    /// Where the ring stands: the next available entry to take and the next used entry to
    /// fill (all published once a batch is done).
    pub fn position(&self) -> (u16, u16) {
        (self.last_avail, self.used_idx)
    }

    /// The used index the driver sees (in its memory).
    pub fn used_in_memory(&self) -> u16 {
        // SAFETY: the used ring's index word, checked when made.
        unsafe { rd16(self.used.wrapping_add(2)) }
    }

    /// Carries on where another process left the ring ([`Vring::position`]).
    pub fn resume_at(&mut self, (last_avail, used_idx): (u16, u16)) {
        self.last_avail = last_avail;
        self.avail_seen = last_avail;
        self.used_idx = used_idx;
        self.published = used_idx;
        self.desc_guess = 0;
    }

    /// Makes the used entries visible to the driver; true if it wants an interrupt.
    pub fn publish(&mut self, log: Option<&DirtyLog>) -> bool {
        if self.used_idx == self.published {
            return false;
        }
        if let (Some(log), Some(g)) = (log, self.used_gpa) {
            log.mark(g + 2, 2);
        }
        fence(Ordering::Release);
        // SAFETY: the used ring's index word, checked when made.
        unsafe { std::ptr::write_volatile(self.used.add(2) as *mut u16, self.used_idx) };
        self.published = self.used_idx;
        fence(Ordering::SeqCst);
        // SAFETY: the available ring's flags word, checked when made.
        unsafe { rd16(self.avail) & AVAIL_F_NO_INTERRUPT == 0 }
    }

    /// Takes up to `max` of the available chains, walked onto `segs` (each chain's head and
    /// place among them in `chains`; both cleared first), asking for their buffers' lines as it
    /// goes: the cross-core misses of a burst overlap instead of coming one after the other. A
    /// fault stops the walk after the chains before it, the faulty chain left in the ring (so
    /// that giving back the chains after any of them gives back the right heads).
    pub fn take_burst(
        &mut self,
        max: usize,
        segs: &mut Vec<Segment>,
        chains: &mut Vec<(u16, usize, usize)>,
    ) -> Result<(), Fault> {
        segs.clear();
        chains.clear();
        let n = (self.pending() as usize).min(max);
        self.prefetch_descriptors(n as u16);
        for _ in 0..n {
            let head = self.next_head()?;
            let first = segs.len();
            if let Err(f) = self.chain_onto(head, segs) {
                self.unget(1);
                return Err(f);
            }
            for s in &segs[first..] {
                prefetch(s.ptr, false);
            }
            chains.push((head, first, segs.len() - first));
        }
        Ok(())
    }

    /// Gives back `n` taken heads that were not used (no buffer space for the whole packet).
    pub fn unget(&mut self, n: u16) {
        self.last_avail = self.last_avail.wrapping_sub(n);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::message::Region;
    use std::os::fd::{FromRawFd, OwnedFd};

    pub const GPA: u64 = 0x4000_0000;
    pub const SIZE: usize = 1 << 20;

    /// A guest memory of 1 MiB whose user addresses equal its physical ones.
    pub fn guest() -> (Arc<GuestMemory>, *mut u8) {
        let name = std::ffi::CString::new("g").unwrap();
        // SAFETY: plain syscalls on a fresh descriptor.
        let fd = unsafe {
            let fd = libc::memfd_create(name.as_ptr(), 0);
            assert_eq!(libc::ftruncate(fd, SIZE as libc::off_t), 0);
            OwnedFd::from_raw_fd(fd)
        };
        let r = Region {
            guest_phys_addr: GPA,
            size: SIZE as u64,
            user_addr: GPA,
            mmap_offset: 0,
        };
        let m = Arc::new(GuestMemory::map(&[r], vec![fd]).unwrap());
        let base = m.gpa(GPA, 1).unwrap();
        (m, base)
    }

    pub fn put_desc(base: *mut u8, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        // SAFETY: inside the test's guest memory.
        unsafe {
            let p = base.add(16 * i);
            (p as *mut u64).write(addr);
            (p.add(8) as *mut u32).write(len);
            (p.add(12) as *mut u16).write(flags);
            (p.add(14) as *mut u16).write(next);
        }
    }

    /// Makes `heads` available in the ring whose available part is at +0x1000.
    fn make_available(base: *mut u8, heads: &[u16]) {
        // SAFETY: inside the test's guest memory.
        unsafe {
            let avail = base.add(0x1000);
            for (i, h) in heads.iter().enumerate() {
                (avail.add(4 + 2 * i) as *mut u16).write(*h);
            }
            (avail.add(2) as *mut u16).write(heads.len() as u16);
        }
    }

    #[test]
    fn a_driver_that_makes_more_available_than_the_ring_holds_is_a_fault() {
        let (m, base) = guest();
        let mut v = Vring::new(&m, 8, GPA, GPA + 0x1000, GPA + 0x2000, 0, None).unwrap();
        put_desc(base, 0, GPA + 0x10000, 64, 0, 0);
        make_available(base, &[0; 9]);
        assert_eq!(v.pending(), 9);
        let fault = v.next_head().unwrap_err();
        assert_eq!(fault, Fault::TooManyAvailable { ahead: 9, num: 8 });
        assert_eq!(
            fault.to_string(),
            "the driver made 9 entries available in a ring of 8"
        );
        make_available(base, &[0; 8]);
        assert_eq!(v.pending(), 8);
        assert_eq!(v.next_head().unwrap(), 0);
    }

    #[test]
    fn warming_writes_only_where_a_frame_will_go() {
        let (m, base) = guest();
        let mut v = Vring::new(&m, 8, GPA, GPA + 0x1000, GPA + 0x2000, 0, None).unwrap();
        // SAFETY: inside the test's guest memory.
        let at = |off: usize| unsafe { base.add(off) };
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(at(0x10000), 0xee, 0x10000) };
        put_desc(base, 0, GPA + 0x10000, 2048, DESC_F_WRITE, 0); // a receive buffer
        put_desc(base, 1, GPA + 0x11000, 2048, 0, 0); // read-only: never written
        put_desc(base, 2, GPA + 0x12000, 40, DESC_F_WRITE, 0); // short: first 8 bytes only
        put_desc(base, 3, GPA + 0x13000, 2048, DESC_F_WRITE, 0); // past `n`
        make_available(base, &[0, 1, 2, 3]);
        v.warm(3, false);
        // SAFETY: reading the test's guest memory.
        let bytes = |off: usize, n: usize| unsafe { std::slice::from_raw_parts(at(off), n) };
        assert_eq!(bytes(0x10000, 8), &[0; 8]);
        assert_eq!(bytes(0x10040, 8), &[0; 8]);
        assert!(bytes(0x10008, 0x38).iter().all(|b| *b == 0xee));
        assert!(bytes(0x11000, 128).iter().all(|b| *b == 0xee));
        assert_eq!(bytes(0x12000, 8), &[0; 8]);
        assert!(bytes(0x12008, 120).iter().all(|b| *b == 0xee));
        assert!(bytes(0x13000, 128).iter().all(|b| *b == 0xee));
        // Nothing was taken, and while logging nothing is written.
        assert_eq!(v.pending(), 4);
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(at(0x10000), 0xee, 128) };
        v.warm(3, true);
        assert!(bytes(0x10000, 128).iter().all(|b| *b == 0xee));
    }

    #[test]
    fn chains_loops_and_bad_addresses() {
        let (m, base) = guest();
        // Descriptor table at +0, avail at +0x1000, used at +0x2000, buffers from +0x10000.
        let v = Vring::new(&m, 8, GPA, GPA + 0x1000, GPA + 0x2000, 0, None).unwrap();
        put_desc(base, 0, GPA + 0x10000, 100, DESC_F_NEXT, 1);
        put_desc(base, 1, GPA + 0x20000, 200, DESC_F_WRITE, 0);
        let mut segs = Vec::new();
        v.chain(0, &mut segs).unwrap();
        assert_eq!(segs.len(), 2);
        assert!(!segs[0].writable && segs[1].writable);
        // A loop: 1 → 0 → 1 …
        put_desc(base, 1, GPA + 0x20000, 200, DESC_F_NEXT, 0);
        assert!(v
            .chain(0, &mut segs)
            .unwrap_err()
            .to_string()
            .contains("loops"));
        // Outside memory, and a next index past the ring.
        put_desc(base, 0, GPA + SIZE as u64 - 10, 100, 0, 0);
        assert!(v
            .chain(0, &mut segs)
            .unwrap_err()
            .to_string()
            .contains("outside"));
        put_desc(base, 0, GPA + 0x10000, 100, DESC_F_NEXT, 9);
        assert!(v.chain(0, &mut segs).is_err());
        // Indirect table with two entries at +0x30000; nested indirect refused.
        put_desc(base, 2, GPA + 0x30000, 32, DESC_F_INDIRECT, 0);
        // SAFETY: inside the test's guest memory.
        let table = unsafe { base.add(0x30000) };
        put_desc(table, 0, GPA + 0x40000, 10, DESC_F_NEXT, 1);
        put_desc(table, 1, GPA + 0x50000, 20, 0, 0);
        v.chain(2, &mut segs).unwrap();
        assert_eq!(segs.iter().map(|s| s.len).sum::<u32>(), 30);
        put_desc(table, 1, GPA + 0x30000, 32, DESC_F_INDIRECT, 0);
        assert!(v
            .chain(2, &mut segs)
            .unwrap_err()
            .to_string()
            .contains("indirect"));
        assert!(Vring::new(&m, 6, GPA, GPA + 0x1000, GPA + 0x2000, 0, None).is_err());
        assert!(Vring::new(&m, 8, GPA + 8, GPA + 0x1000, GPA + 0x2000, 0, None).is_err());
        assert!(Vring::new(
            &m,
            8,
            GPA + SIZE as u64,
            GPA + 0x1000,
            GPA + 0x2000,
            0,
            None
        )
        .is_err());
    }
}
