//! A packet: a handle to one buffer of the packet pool.
//!
//! A buffer is a 64-byte header (length, data offset, capacity, timestamp, offload metadata)
//! followed by its data area. Data starts `HEADROOM` bytes into the data area so that
//! encapsulations can prepend headers without copying. Ordinary buffers (`BUFFER_STRIDE`) hold a
//! jumbo frame; a smaller number of large buffers (`LARGE_STRIDE`) hold whole 64 KiB GSO
//! super-frames, so that offloaded TCP can cross the graph without being cut up. A `Packet` is
//! owned: moving it moves the handle (8 bytes), dropping it returns the buffer to the pool.
//! The pool is this module's part that owns the buffers ([`pool`], also `stitch_core::pool`):
//! a packet and the pool it returns to are one thing.

use std::fmt;
use std::ptr::NonNull;

pub mod pool;

/// Bytes of one pool buffer, header included: an odd number of cache lines (161), so that
/// consecutive buffers start in different cache sets. At 10 KiB (160 lines) every buffer's
/// header fell into the same 1/32 of a cache's sets and a few hundred packets in flight
/// evicted each other (DPDK pads its mempool objects for the same reason).
pub const BUFFER_STRIDE: usize = 10240 + 64;
/// Size of the per-buffer header that precedes the data area.
pub const HEADER_SIZE: usize = 64;
/// Bytes available for headroom + frame in an ordinary buffer.
pub const DATA_AREA: usize = BUFFER_STRIDE - HEADER_SIZE;
/// Bytes of one large buffer, header included.
pub const LARGE_STRIDE: usize = 72 << 10;
/// Bytes available for headroom + frame in a large buffer.
pub const LARGE_DATA_AREA: usize = LARGE_STRIDE - HEADER_SIZE;
/// Largest GSO super-frame: a 64 KiB IP packet behind Ethernet and two VLAN tags.
pub const MAX_GSO_FRAME: usize = 65535 + 14 + 8;
/// Free bytes kept in front of freshly allocated packets for pushing headers.
pub const HEADROOM: usize = 256;
/// Most frame bytes [`Packet::prefetch_fresh`] brings in: a longer frame's writes run on
/// through the page, where the CPU's own prefetcher follows them, and eight jumbo frames ahead
/// would fill the first-level cache.
pub const FRESH_PREFETCH_LIMIT: usize = 1024;
/// Largest frame (without FCS) Stitch accepts: a 9216-byte jumbo frame.
pub const MAX_FRAME: usize = 9216;

/// Wall-clock time in nanoseconds since the Unix epoch, the unit of packet timestamps.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Checksum state of a packet that came from an interface with offloads (veth, TAP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum ChecksumState {
    /// Nothing known: checksums are what the bytes say.
    #[default]
    Unknown = 0,
    /// The L4 checksum field holds only the pseudo-header sum; it must be completed from
    /// `csum_start`/`csum_offset` before the packet leaves to a consumer that expects full checksums.
    Partial = 1,
    /// The sender or the NIC verified the checksums.
    Verified = 2,
}

/// In-buffer header. `repr(C)` because later parts (shared-memory ports, AF_XDP) read it across
/// process boundaries.
#[repr(C, align(64))]
pub struct PacketHeader {
    pub(crate) len: u32,
    pub(crate) offset: u32,
    /// Bytes of the data area (headroom + frame + tailroom); fixed per buffer class.
    pub(crate) capacity: u32,
    /// Input port number (driver-defined) or 0.
    pub port: u16,
    pub(crate) csum_state: u8,
    /// GSO type of a super-frame (virtio-net `gso_type` values), 0 for none.
    pub gso_type: u8,
    /// For `ChecksumState::Partial`: where checksumming starts, from the frame start.
    pub csum_start: u16,
    /// For `ChecksumState::Partial`: where the checksum is stored, relative to `csum_start`.
    pub csum_offset: u16,
    /// GSO segment size of a super-frame, else 0.
    pub gso_size: u16,
    _pad: u16,
    /// Receive or capture time, nanoseconds since the Unix epoch (0 = unknown).
    pub timestamp_ns: u64,
    /// Free for apps to carry per-packet state (e.g. a flow hash); zeroed on allocation.
    pub user: [u64; 4],
}

const _: () = assert!(std::mem::size_of::<PacketHeader>() == HEADER_SIZE);
const _: () = assert!(HEADROOM + MAX_FRAME <= DATA_AREA);
const _: () = assert!(HEADROOM + MAX_GSO_FRAME <= LARGE_DATA_AREA);

/// Where a buffer keeps its frame, for code that finds it without [`Packet`]'s methods (a
/// filter's machine code): the frame's length and its offset into the data area are `u32`s at
/// these byte offsets of the buffer, and the data area starts [`HEADER_SIZE`] bytes in.
pub const FRAME_LEN_AT: usize = std::mem::offset_of!(PacketHeader, len);
pub const FRAME_OFFSET_AT: usize = std::mem::offset_of!(PacketHeader, offset);

/// The start of a pool buffer: its header, followed in memory by `capacity` bytes of data area.
pub type PacketBuf = PacketHeader;

/// Errors of packet editing; the packet is left unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("packet would exceed its buffer")]
    TooLong,
    #[error("packet is shorter than the {0} bytes to remove")]
    TooShort(usize),
}

/// An owned packet. Not `Clone`: use [`Packet::try_clone`], which takes a new buffer.
/// Transparent: a run of packets (a link's slots) is a run of buffer pointers.
#[repr(transparent)]
pub struct Packet(NonNull<PacketBuf>);

// SAFETY: a packet is owned by exactly one holder at a time (not Clone, not Sync); handing it
// to another thread is a move, and the pool it returns to on drop is thread-safe.
unsafe impl Send for Packet {}

impl Packet {
    /// # Safety
    /// `buf` must be a pool buffer no one else holds.
    #[inline]
    pub(crate) unsafe fn from_raw(buf: NonNull<PacketBuf>) -> Packet {
        Packet(buf)
    }

    /// Gives up ownership without returning the buffer to the pool.
    #[inline]
    pub fn into_raw(self) -> NonNull<PacketBuf> {
        let p = self.0;
        std::mem::forget(self);
        p
    }

    /// Takes ownership of a buffer previously given up with [`Packet::into_raw`].
    ///
    /// # Safety
    /// `buf` must come from `into_raw` and not be owned by anything else.
    #[inline]
    pub unsafe fn from_raw_owned(buf: NonNull<PacketBuf>) -> Packet {
        Packet(buf)
    }

    #[inline]
    fn hdr(&self) -> &PacketHeader {
        // SAFETY: the pointer is a pool buffer (header first) owned by this packet alone.
        unsafe { self.0.as_ref() }
    }

    #[inline]
    pub fn header(&self) -> &PacketHeader {
        self.hdr()
    }

    #[inline]
    pub fn header_mut(&mut self) -> &mut PacketHeader {
        // SAFETY: as for `hdr`; `&mut self` makes the borrow exclusive.
        unsafe { self.0.as_mut() }
    }

    /// The data area, which follows the header.
    #[inline]
    fn area(&self) -> *mut u8 {
        // SAFETY: the data area follows the header in the same buffer (HEADER_SIZE bytes on).
        unsafe { (self.0.as_ptr() as *mut u8).add(HEADER_SIZE) }
    }

    /// Bytes of headroom + frame + tailroom of this packet's buffer.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.hdr().capacity as usize
    }

    /// Whether this is a large (GSO super-frame) buffer.
    #[inline]
    pub fn is_large(&self) -> bool {
        self.capacity() > DATA_AREA
    }

    /// Frame length in bytes.
    #[inline]
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.hdr().len as usize
    }

    /// Asks the CPU to bring in the lines a fresh packet's header and its first `frame_bytes`
    /// frame bytes (at most [`FRESH_PREFETCH_LIMIT`]) are written to, for a writer a few
    /// packets on (without reading the header, which is not written yet).
    #[inline(always)]
    pub fn prefetch_fresh(&self, frame_bytes: usize) {
        crate::prefetch(self.0.as_ptr());
        let frame = self.area().wrapping_add(HEADROOM);
        let lines = frame_bytes.clamp(1, FRESH_PREFETCH_LIMIT).div_ceil(64);
        for line in 0..lines {
            crate::prefetch(frame.wrapping_add(64 * line));
        }
    }

    /// Asks the CPU to bring in the line `bytes` before the frame's start, where a header
    /// pushed in front of the frame a few packets on will be written (a hint, as
    /// [`Packet::prefetch_data`]).
    #[inline(always)]
    pub fn prefetch_front(&self, bytes: usize) {
        let start = self.area().wrapping_add(self.hdr().offset as usize);
        crate::prefetch(start.wrapping_sub(bytes));
    }

    /// Asks the CPU to bring the frame's first cache line in, for a reader a few packets on
    /// (a hint: it never faults and changes nothing).
    #[inline(always)]
    pub fn prefetch_data(&self) {
        crate::prefetch(self.area().wrapping_add(self.hdr().offset as usize));
    }

    #[inline]
    pub fn data(&self) -> &[u8] {
        let h = self.hdr();
        // SAFETY: offset + len ≤ capacity, the data area's size: every writer of offset and
        // len (this module, `reclaim_header` for buffers back from another process) keeps it.
        unsafe { std::slice::from_raw_parts(self.area().add(h.offset as usize), h.len as usize) }
    }

    #[inline]
    pub fn data_mut(&mut self) -> &mut [u8] {
        let (off, len) = (self.hdr().offset as usize, self.hdr().len as usize);
        // SAFETY: as for `data`; `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.area().add(off), len) }
    }

    /// Bytes free in front of the data.
    #[inline]
    pub fn headroom(&self) -> usize {
        self.hdr().offset as usize
    }

    /// Bytes the frame can still grow at its end.
    #[inline]
    pub fn tailroom(&self) -> usize {
        self.capacity() - self.hdr().offset as usize - self.hdr().len as usize
    }

    /// Sets the length; new bytes (when growing) hold whatever the buffer held.
    #[inline]
    pub fn set_len(&mut self, len: usize) -> Result<(), PacketError> {
        if self.hdr().offset as usize + len > self.capacity() {
            return Err(PacketError::TooLong);
        }
        self.header_mut().len = len as u32;
        Ok(())
    }

    /// Sets the length of a fresh packet to `len` and returns the first `room` (≥ `len`) bytes of
    /// its frame, without reading back the header that was just written: for sources that copy
    /// whole lines into packets `Producer::transmit_fresh` hands them.
    ///
    /// # Safety
    /// The packet is fresh — reset by the pool or by `Producer::transmit_fresh`, its header
    /// unchanged since, so its frame starts `HEADROOM` bytes into its data area — and
    /// `len ≤ room ≤ MAX_FRAME`.
    #[inline(always)]
    pub unsafe fn fresh_frame_mut(&mut self, len: usize, room: usize) -> &mut [u8] {
        debug_assert!(self.headroom() == HEADROOM && len <= room && room <= MAX_FRAME);
        self.header_mut().len = len as u32;
        // SAFETY: by the caller's promise the frame starts HEADROOM bytes in, and
        // HEADROOM + room ≤ HEADROOM + MAX_FRAME ≤ DATA_AREA, the smallest data area; the
        // packet is this holder's alone (`&mut self`).
        unsafe { std::slice::from_raw_parts_mut(self.area().add(HEADROOM), room) }
    }

    /// Replaces the content of a fresh packet with `bytes`, as [`Packet::set_data`] does but
    /// without reading back the header just written. Panics when `bytes` is over `MAX_FRAME`.
    ///
    /// # Safety
    /// The packet is fresh, as for [`Packet::fresh_frame_mut`].
    #[inline(always)]
    pub unsafe fn set_fresh_data(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= MAX_FRAME);
        // SAFETY: fresh by the caller's promise; the length is checked just above.
        crate::copy_slice(
            unsafe { self.fresh_frame_mut(bytes.len(), bytes.len()) },
            bytes,
        );
    }

    /// Places the frame at `offset` bytes into the data area with `len` bytes, as another
    /// process sharing the buffer (a function port) left it.
    #[inline]
    pub fn set_bounds(&mut self, offset: usize, len: usize) -> Result<(), PacketError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.capacity())
        {
            return Err(PacketError::TooLong);
        }
        let h = self.header_mut();
        h.offset = offset as u32;
        h.len = len as u32;
        Ok(())
    }

    /// Replaces the content with `bytes`.
    pub fn set_data(&mut self, bytes: &[u8]) -> Result<(), PacketError> {
        self.set_len(bytes.len())?;
        self.data_mut().copy_from_slice(bytes);
        Ok(())
    }

    /// Appends bytes at the end.
    pub fn append(&mut self, bytes: &[u8]) -> Result<(), PacketError> {
        let old = self.len();
        self.set_len(old + bytes.len())?;
        self.data_mut()[old..].copy_from_slice(bytes);
        Ok(())
    }

    /// Grows the frame by `n` bytes at the front and returns the new front bytes (uninitialised
    /// content). Uses headroom; only when headroom is exhausted is the data moved.
    pub fn prepend(&mut self, n: usize) -> Result<&mut [u8], PacketError> {
        let (off, len) = (self.headroom(), self.len());
        if off >= n {
            let h = self.header_mut();
            h.offset = (off - n) as u32;
            h.len = (len + n) as u32;
        } else {
            let cap = self.capacity();
            if len + n > cap {
                return Err(PacketError::TooLong);
            }
            // Re-centre: put the data after HEADROOM (or as far as it fits) behind the new header.
            let new_off = HEADROOM.min(cap - len - n);
            // SAFETY: both ranges lie in the data area: off + len ≤ cap (invariant) and
            // new_off + n + len ≤ cap (new_off ≤ cap - len - n); `copy` allows overlap.
            unsafe {
                let area = self.area();
                std::ptr::copy(area.add(off), area.add(new_off + n), len);
            }
            let h = self.header_mut();
            h.offset = new_off as u32;
            h.len = (len + n) as u32;
        }
        Ok(&mut self.data_mut()[..n])
    }

    /// Removes `n` bytes from the front (decapsulation) without copying.
    #[inline]
    pub fn shift_front(&mut self, n: usize) -> Result<(), PacketError> {
        if n > self.len() {
            return Err(PacketError::TooShort(n));
        }
        let h = self.header_mut();
        h.offset += n as u32;
        h.len -= n as u32;
        Ok(())
    }

    #[inline]
    pub fn timestamp_ns(&self) -> u64 {
        self.hdr().timestamp_ns
    }

    #[inline]
    pub fn set_timestamp_ns(&mut self, ns: u64) {
        self.header_mut().timestamp_ns = ns;
    }

    #[inline]
    pub fn checksum_state(&self) -> ChecksumState {
        match self.hdr().csum_state {
            1 => ChecksumState::Partial,
            2 => ChecksumState::Verified,
            _ => ChecksumState::Unknown,
        }
    }

    #[inline]
    pub fn set_checksum_state(&mut self, s: ChecksumState) {
        self.header_mut().csum_state = s as u8;
    }

    /// Copies this packet (data, timestamp and metadata) into a new buffer; `None` when the
    /// pool is exhausted (counted by the pool).
    pub fn try_clone(&self) -> Option<Packet> {
        let mut p = if self.len() > MAX_FRAME {
            crate::pool::alloc_large()?
        } else {
            crate::pool::alloc()?
        };
        {
            let src = self.hdr();
            let dst = p.header_mut();
            dst.port = src.port;
            dst.csum_state = src.csum_state;
            dst.csum_start = src.csum_start;
            dst.csum_offset = src.csum_offset;
            dst.gso_size = src.gso_size;
            dst.gso_type = src.gso_type;
            dst.timestamp_ns = src.timestamp_ns;
            dst.user = src.user;
        }
        p.set_data(self.data()).ok()?;
        Some(p)
    }

    /// Raw pointer to the buffer, e.g. to compute its index in shared memory.
    #[inline]
    pub fn as_ptr(&self) -> *const PacketBuf {
        self.0.as_ptr()
    }

    /// Makes the header of a buffer that another process held safe to use again: the bounds
    /// and offload fields are reset (the frame is empty until `set_bounds`), the timestamp,
    /// port and user words are kept.
    #[inline]
    pub(crate) fn reclaim_header(&mut self, capacity: usize) {
        let h = self.header_mut();
        h.len = 0;
        h.offset = HEADROOM.min(capacity) as u32;
        h.capacity = capacity as u32;
        h.csum_state = 0;
        h.gso_type = 0;
        h.gso_size = 0;
        h.csum_start = 0;
        h.csum_offset = 0;
    }

    /// Resets the header to a fresh packet's, in a buffer of `capacity` data bytes.
    #[inline]
    pub(crate) fn reset(&mut self, capacity: usize) {
        // One whole-header store (two vector stores) rather than a store per field.
        *self.header_mut() = PacketHeader {
            len: 0,
            offset: HEADROOM as u32,
            capacity: capacity as u32,
            port: 0,
            csum_state: 0,
            gso_type: 0,
            csum_start: 0,
            csum_offset: 0,
            gso_size: 0,
            _pad: 0,
            timestamp_ns: 0,
            user: [0; 4],
        };
    }
}

impl Drop for Packet {
    #[inline]
    fn drop(&mut self) {
        crate::pool::free_raw(self.0);
    }
}

impl fmt::Debug for Packet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Packet")
            .field("len", &self.len())
            .field("headroom", &self.headroom())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool;

    #[test]
    fn prepend_uses_headroom_then_moves() {
        let mut p = pool::alloc().unwrap();
        p.set_data(&[1, 2, 3]).unwrap();
        p.prepend(14).unwrap().fill(9);
        assert_eq!(p.len(), 17);
        assert_eq!(p.headroom(), HEADROOM - 14);
        assert_eq!(&p.data()[14..], &[1, 2, 3]);
        // exhaust headroom: data must move, content must survive
        p.prepend(HEADROOM).unwrap().fill(7);
        assert_eq!(p.len(), 17 + HEADROOM);
        assert_eq!(&p.data()[HEADROOM..HEADROOM + 14], &[9; 14]);
        assert_eq!(&p.data()[HEADROOM + 14..], &[1, 2, 3]);
        p.shift_front(HEADROOM + 14).unwrap();
        assert_eq!(p.data(), &[1, 2, 3]);
        assert_eq!(p.shift_front(4), Err(PacketError::TooShort(4)));
    }

    #[test]
    fn a_fresh_frame_is_written_in_place_of_set_data() {
        let mut p = pool::alloc().unwrap();
        // SAFETY: the packet is fresh from the pool and 5 ≤ 64 ≤ MAX_FRAME.
        let room = unsafe { p.fresh_frame_mut(5, 64) };
        assert_eq!(room.len(), 64);
        room.fill(7);
        assert_eq!((p.len(), p.headroom()), (5, HEADROOM));
        assert_eq!(p.data(), &[7; 5]);
        let mut q = pool::alloc().unwrap();
        q.set_data(&[7; 5]).unwrap();
        assert_eq!(
            (q.len(), q.headroom(), q.data()),
            (p.len(), p.headroom(), p.data())
        );
    }

    #[test]
    fn jumbo_frames_fit_and_oversize_is_refused() {
        let mut p = pool::alloc().unwrap();
        p.set_data(&vec![0xab; MAX_FRAME]).unwrap();
        assert_eq!(p.len(), MAX_FRAME);
        assert!(!p.is_large());
        assert_eq!(p.set_len(DATA_AREA), Err(PacketError::TooLong));
        assert_eq!(p.len(), MAX_FRAME);
    }

    #[test]
    fn large_buffers_hold_gso_frames_and_clone_as_large() {
        let mut p = pool::alloc_large().unwrap();
        assert!(p.is_large());
        let frame: Vec<u8> = (0..MAX_GSO_FRAME).map(|i| i as u8).collect();
        p.set_data(&frame).unwrap();
        p.prepend(4).unwrap().fill(1);
        assert_eq!(p.len(), MAX_GSO_FRAME + 4);
        let q = p.try_clone().unwrap();
        assert!(q.is_large());
        assert_eq!(&q.data()[4..], &frame[..]);
        assert_eq!(p.set_len(LARGE_DATA_AREA), Err(PacketError::TooLong));
    }

    #[test]
    fn clone_copies_data_and_metadata() {
        let mut p = pool::alloc().unwrap();
        p.set_data(b"hello").unwrap();
        p.set_timestamp_ns(42);
        let q = p.try_clone().unwrap();
        assert_eq!(q.data(), b"hello");
        assert_eq!(q.timestamp_ns(), 42);
        assert_ne!(p.as_ptr(), q.as_ptr());
    }
}
