//! The rings an AF_XDP socket shares with the kernel (`Documentation/networking/af_xdp.rst`):
//! single-producer single-consumer rings of free-running `u32` indices, a producer word and a
//! consumer word, and a power-of-two array of entries — `u64` frame addresses in the fill and
//! completion rings, 16-byte descriptors in the receive and transmit rings.
//!
//! This side produces into the fill and transmit rings and consumes the receive and completion
//! rings. Its own index is private: entries are written or read relative to it
//! ([`Ring::set_addr`], [`Ring::desc`] …) and it moves only by [`Ring::submit`] (producer),
//! [`Ring::consume`] (consumer) — each publishing the new index with release order after the
//! entries — or [`Ring::read_past`], for a reader of a lent ring whose owner publishes.
//! Every word and entry is read through [`Mapping`]'s bounds checks; the kernel's offsets are
//! checked once, when mapped.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use stitch_core::mapping::{MapOptions, Mapping};

/// A descriptor of the receive or transmit ring: address (8), length (4), options (4).
pub const DESC_SIZE: usize = 16;
/// `XDP_RING_NEED_WAKEUP`: the kernel sleeps until woken by a syscall on the socket.
const NEED_WAKEUP: u32 = 1;

/// Which of a socket's four rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingKind {
    /// Frames given to the kernel to receive into (this side produces).
    Fill,
    /// Frames the kernel has sent (this side consumes).
    Completion,
    /// Frames received (this side consumes).
    Rx,
    /// Frames to send (this side produces).
    Tx,
}

impl RingKind {
    /// Where the ring lies in the socket's file (`mmap` offset).
    pub fn pgoff(self) -> i64 {
        match self {
            RingKind::Fill => libc::XDP_UMEM_PGOFF_FILL_RING as i64,
            RingKind::Completion => libc::XDP_UMEM_PGOFF_COMPLETION_RING as i64,
            RingKind::Rx => libc::XDP_PGOFF_RX_RING,
            RingKind::Tx => libc::XDP_PGOFF_TX_RING,
        }
    }

    /// The size of one entry.
    pub fn entry_size(self) -> usize {
        match self {
            RingKind::Fill | RingKind::Completion => 8,
            RingKind::Rx | RingKind::Tx => DESC_SIZE,
        }
    }

    /// Whether this side produces into the ring (fill, transmit).
    pub fn produced_here(self) -> bool {
        matches!(self, RingKind::Fill | RingKind::Tx)
    }

    /// The `SOL_XDP` option that sizes the ring.
    pub fn size_option(self) -> i32 {
        match self {
            RingKind::Fill => libc::XDP_UMEM_FILL_RING,
            RingKind::Completion => libc::XDP_UMEM_COMPLETION_RING,
            RingKind::Rx => libc::XDP_RX_RING,
            RingKind::Tx => libc::XDP_TX_RING,
        }
    }
}

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

/// One of the four rings shared with the kernel.
pub struct Ring {
    map: Mapping,
    producer: usize,
    consumer: usize,
    flags: usize,
    desc: usize,
    kind: RingKind,
    mask: u32,
    /// This side's index: the producer's for fill/tx, the consumer's for rx/completion.
    position: u32,
}

impl Ring {
    /// Maps ring `kind` of socket `fd`, of `entries` entries, at the offsets the kernel gave.
    pub fn map(
        fd: BorrowedFd<'_>,
        off: &libc::xdp_ring_offset,
        entries: u32,
        kind: RingKind,
    ) -> Result<Ring, String> {
        let opts = MapOptions {
            offset: kind.pgoff(),
            populate: true,
            ..MapOptions::default()
        };
        let map = Mapping::shared(fd, ring_bytes(off, entries, kind)?, opts)
            .map_err(|e| format!("cannot map an AF_XDP ring: {e}"))?;
        Ring::over(map, off, entries, kind)
    }

    /// The receive ring of socket `fd`, of `entries` descriptors.
    pub fn map_rx(fd: BorrowedFd<'_>, entries: u32) -> Result<Ring, String> {
        Ring::map(fd, &offsets(fd)?.rx, entries, RingKind::Rx)
    }

    /// A ring laid out in `map` as `off` says (a socket's mapping, or memory standing in for
    /// the kernel's in a test), starting where its words are.
    pub fn over(
        map: Mapping,
        off: &libc::xdp_ring_offset,
        entries: u32,
        kind: RingKind,
    ) -> Result<Ring, String> {
        if map.len() < ring_bytes(off, entries, kind)? {
            return Err("the AF_XDP ring's mapping is shorter than its entries".into());
        }
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
            kind,
            mask: entries - 1,
            position: 0,
        };
        r.resume();
        Ok(r)
    }

    pub fn kind(&self) -> RingKind {
        self.kind
    }

    /// This side's index.
    pub fn position(&self) -> u32 {
        self.position
    }

    /// Takes this side's index from the ring's word (a fresh socket: zero; a socket taken
    /// over: where the predecessor published it last).
    pub fn resume(&mut self) {
        let own = match self.kind.produced_here() {
            true => self.producer,
            false => self.consumer,
        };
        self.position = self.word(own).load(Ordering::Acquire);
    }

    /// Reads a lent ring from `index` on (its owner publishes the consumer index).
    pub fn seek(&mut self, index: u32) {
        self.position = index;
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        self.map.atomic_u32(at).expect("checked when mapped")
    }

    /// The producer's index as the ring holds it.
    pub fn produced(&self) -> u32 {
        self.word(self.producer).load(Ordering::Acquire)
    }

    /// The consumer's index as the ring holds it.
    pub fn consumed(&self) -> u32 {
        self.word(self.consumer).load(Ordering::Acquire)
    }

    pub fn needs_wakeup(&self) -> bool {
        self.word(self.flags).load(Ordering::Relaxed) & NEED_WAKEUP != 0
    }

    pub fn size(&self) -> u32 {
        self.mask + 1
    }

    /// Producer: free slots.
    pub fn free(&self) -> u32 {
        self.size() - self.in_flight()
    }

    /// Producer: entries submitted that the other side has not taken yet.
    pub fn in_flight(&self) -> u32 {
        self.position.wrapping_sub(self.consumed())
    }

    /// Consumer: entries ready past this side's index.
    pub fn ready(&self) -> u32 {
        self.produced().wrapping_sub(self.position)
    }

    /// Where entry `k` past this side's index lies in the mapping (inside it: the index is
    /// masked).
    fn slot(&self, k: u32) -> usize {
        self.desc + (self.position.wrapping_add(k) & self.mask) as usize * self.kind.entry_size()
    }

    /// The address in entry `k` past this side's index (fill, completion).
    pub fn addr(&self, k: u32) -> u64 {
        debug_assert_eq!(self.kind.entry_size(), 8);
        (self.map.read_u64(self.slot(k))).expect("entries lie inside the ring")
    }

    /// Writes the address of entry `k` past this side's index (fill).
    pub fn set_addr(&self, k: u32, addr: u64) {
        debug_assert_eq!(self.kind.entry_size(), 8);
        let written = self.map.write(self.slot(k), &addr.to_ne_bytes());
        debug_assert!(written, "entries lie inside the ring");
    }

    /// (address, length) of descriptor `k` past this side's index (rx, tx).
    pub fn desc(&self, k: u32) -> (u64, u32) {
        debug_assert_eq!(self.kind.entry_size(), DESC_SIZE);
        let at = self.slot(k);
        let addr = self.map.read_u64(at).expect("entries lie inside the ring");
        let len = (self.map.read_u32(at + 8)).expect("entries lie inside the ring");
        (addr, len)
    }

    /// Writes descriptor `k` past this side's index (tx).
    pub fn set_desc(&self, k: u32, addr: u64, len: u32) {
        debug_assert_eq!(self.kind.entry_size(), DESC_SIZE);
        let mut d = [0u8; DESC_SIZE];
        d[..8].copy_from_slice(&addr.to_ne_bytes());
        d[8..12].copy_from_slice(&len.to_ne_bytes());
        let written = self.map.write(self.slot(k), &d);
        debug_assert!(written, "entries lie inside the ring");
    }

    /// Producer: publishes the `n` entries written past this side's index.
    pub fn submit(&mut self, n: u32) {
        debug_assert!(self.kind.produced_here() && n <= self.free());
        self.position = self.position.wrapping_add(n);
        self.word(self.producer)
            .store(self.position, Ordering::Release);
    }

    /// Consumer: gives the other side back the `n` entries read past this side's index.
    pub fn consume(&mut self, n: u32) {
        debug_assert!(!self.kind.produced_here() && n <= self.ready());
        self.position = self.position.wrapping_add(n);
        self.word(self.consumer)
            .store(self.position, Ordering::Release);
    }

    /// A reader of a lent ring: moves past `n` entries without publishing (the ring's owner
    /// moves the consumer index once the frames came back).
    pub fn read_past(&mut self, n: u32) {
        self.position = self.position.wrapping_add(n);
    }
}

/// How many bytes the ring's mapping takes: its words, then its entries.
fn ring_bytes(off: &libc::xdp_ring_offset, entries: u32, kind: RingKind) -> Result<usize, String> {
    if !entries.is_power_of_two() {
        return Err(format!("an AF_XDP ring of {entries} entries"));
    }
    (off.desc as usize)
        .checked_add(entries as usize * kind.entry_size())
        .ok_or_else(|| "the kernel's AF_XDP ring offsets are impossible".into())
}

/// Puts the frames of receive ring `rx` up to ring index `upto` back in fill ring `fill`
/// (each address rounded down to its `frame_size` chunk) and consumes them; how many, never
/// past what the kernel put in `rx` (nothing when `upto` lies beyond it).
pub fn refill_from(fill: &mut Ring, rx: &mut Ring, upto: u32, frame_size: u64) -> u32 {
    let n = upto.wrapping_sub(rx.position());
    if n == 0 || n > rx.ready() || n > fill.free() {
        return 0;
    }
    for k in 0..n {
        let (addr, _) = rx.desc(k);
        fill.set_addr(k, addr & !(frame_size - 1));
    }
    rx.consume(n);
    fill.submit(n);
    n
}

/// Rings over plain memory, and the kernel's side of them, for tests of the ring protocol.
pub mod testing {
    use super::*;
    use std::os::fd::{AsFd, OwnedFd};

    /// Where the words and entries lie: as the kernel lays them out (producer, consumer and
    /// entries on lines of their own; flags after the consumer).
    pub const OFFSETS: libc::xdp_ring_offset = libc::xdp_ring_offset {
        producer: 0,
        consumer: 64,
        desc: 128,
        flags: 68,
    };

    /// A ring of `entries` entries in fresh shared memory: this side's view, and the memory's
    /// file to map the kernel's view from ([`kernel_view`]).
    pub fn ring(entries: u32, kind: RingKind) -> (Ring, OwnedFd) {
        let len = ring_bytes(&OFFSETS, entries, kind).expect("a power of two");
        let (fd, map) = Mapping::create("stitch-xsk-test", len).expect("memfd");
        (
            Ring::over(map, &OFFSETS, entries, kind).expect("laid out"),
            fd,
        )
    }

    /// The same ring as the kernel sees it: the other end (a fill ring's consumer, a receive
    /// ring's producer).
    pub fn kernel_view(fd: &OwnedFd, entries: u32, kind: RingKind) -> Ring {
        let len = ring_bytes(&OFFSETS, entries, kind).expect("a power of two");
        let map = Mapping::shared(fd.as_fd(), len, MapOptions::default()).expect("mapped");
        let other = match kind {
            RingKind::Fill => RingKind::Completion,
            RingKind::Completion => RingKind::Fill,
            RingKind::Rx => RingKind::Tx,
            RingKind::Tx => RingKind::Rx,
        };
        Ring::over(map, &OFFSETS, entries, other).expect("laid out")
    }

    /// Sets the ring's words as if both sides had got to `index` (to test the wrap of the
    /// free-running indices).
    pub fn start_at(ring: &mut Ring, kernel: &mut Ring, index: u32) {
        ring.word(ring.producer).store(index, Ordering::Release);
        ring.word(ring.consumer).store(index, Ordering::Release);
        ring.resume();
        kernel.resume();
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn entries_are_read_in_the_order_they_were_submitted_across_the_wrap() {
        let (mut tx, fd) = ring(8, RingKind::Tx);
        let mut kernel = kernel_view(&fd, 8, RingKind::Tx);
        start_at(&mut tx, &mut kernel, u32::MAX - 2);
        let mut next = 0u64;
        for round in 0..5u32 {
            let n = 3 + round % 4;
            assert!(tx.free() >= n, "round {round}: {} free", tx.free());
            for k in 0..n {
                tx.set_desc(k, (next + u64::from(k)) * 4096, 60 + k);
            }
            // Written, not yet submitted: the kernel sees nothing.
            assert_eq!(kernel.ready(), 0);
            tx.submit(n);
            assert_eq!((kernel.ready(), tx.in_flight()), (n, n));
            for k in 0..n {
                assert_eq!(kernel.desc(k), ((next + u64::from(k)) * 4096, 60 + k));
            }
            kernel.consume(n);
            assert_eq!((tx.in_flight(), tx.free()), (0, 8));
            next += u64::from(n);
        }
        assert!(tx.position() < 100, "the index wrapped: {}", tx.position());
    }

    #[test]
    fn a_full_ring_has_no_room_until_the_other_side_consumes() {
        let (mut fill, fd) = ring(4, RingKind::Fill);
        let mut kernel = kernel_view(&fd, 4, RingKind::Fill);
        for k in 0..4 {
            fill.set_addr(k, u64::from(k) * 4096);
        }
        fill.submit(4);
        assert_eq!(fill.free(), 0);
        assert_eq!(kernel.addr(0), 0);
        kernel.consume(1);
        assert_eq!(fill.free(), 1);
        // The slot freed is the one the next entry goes in: entry 4 lands on entry 0's slot,
        // not over entry 1, which the kernel has not read.
        fill.set_addr(0, 0x9000);
        fill.submit(1);
        assert_eq!(kernel.addr(0), 4096);
        assert_eq!(kernel.addr(3), 0x9000);
    }

    #[test]
    fn refill_gives_back_received_frames_up_to_the_index_and_never_past_the_producer() {
        let (mut rx, rx_fd) = ring(8, RingKind::Rx);
        let mut nic = kernel_view(&rx_fd, 8, RingKind::Rx);
        let (mut fill, fill_fd) = ring(8, RingKind::Fill);
        let mut kernel_fill = kernel_view(&fill_fd, 8, RingKind::Fill);
        start_at(&mut rx, &mut nic, u32::MAX - 1);
        // The kernel received 3 frames, at offsets inside their chunks.
        for k in 0..3 {
            nic.set_desc(k, u64::from(k) * 4096 + 256, 64);
        }
        nic.submit(3);
        let at = rx.position();
        // Past what was received: nothing moves.
        assert_eq!(refill_from(&mut fill, &mut rx, at.wrapping_add(4), 4096), 0);
        assert_eq!(rx.ready(), 3);
        assert_eq!(refill_from(&mut fill, &mut rx, at.wrapping_add(2), 4096), 2);
        assert_eq!((rx.ready(), nic.free()), (1, 7));
        assert_eq!(kernel_fill.ready(), 2);
        assert_eq!((kernel_fill.addr(0), kernel_fill.addr(1)), (0, 4096));
        kernel_fill.consume(2);
        assert_eq!(refill_from(&mut fill, &mut rx, at.wrapping_add(2), 4096), 0);
        assert_eq!(refill_from(&mut fill, &mut rx, at.wrapping_add(3), 4096), 1);
        assert_eq!(kernel_fill.addr(0), 8192);
    }

    #[test]
    fn a_lent_ring_is_read_from_its_start_without_moving_the_owners_index() {
        let (mut rx, fd) = ring(8, RingKind::Rx);
        let mut nic = kernel_view(&fd, 8, RingKind::Rx);
        for k in 0..5 {
            nic.set_desc(k, u64::from(k) * 4096, 100 + k);
        }
        nic.submit(5);
        rx.consume(2);
        let map = Mapping::shared(
            std::os::fd::AsFd::as_fd(&fd),
            ring_bytes(&OFFSETS, 8, RingKind::Rx).unwrap(),
            MapOptions::default(),
        )
        .unwrap();
        let mut reader = Ring::over(map, &OFFSETS, 8, RingKind::Rx).unwrap();
        assert_eq!(reader.position(), 2, "starts where the owner consumed");
        reader.seek(3);
        assert_eq!((reader.ready(), reader.desc(0)), (2, (3 * 4096, 103)));
        reader.read_past(2);
        assert_eq!(reader.ready(), 0);
        assert_eq!(
            rx.consumed(),
            2,
            "the owner's index stays where it published it"
        );
    }

    #[test]
    fn offsets_outside_the_mapping_are_refused() {
        let (_, fd) = ring(8, RingKind::Rx);
        let map = || {
            Mapping::shared(
                std::os::fd::AsFd::as_fd(&fd),
                ring_bytes(&OFFSETS, 8, RingKind::Rx).unwrap(),
                MapOptions::default(),
            )
            .unwrap()
        };
        let far = libc::xdp_ring_offset {
            producer: 1 << 20,
            ..OFFSETS
        };
        assert!(Ring::over(map(), &far, 8, RingKind::Rx).is_err());
        let long = libc::xdp_ring_offset {
            desc: 4096,
            ..OFFSETS
        };
        assert!(Ring::over(map(), &long, 8, RingKind::Rx).is_err());
        assert!(Ring::over(map(), &OFFSETS, 6, RingKind::Rx).is_err());
    }
}
