//! A packet: a handle to one fixed-size buffer of the packet pool.
//!
//! Every buffer is `BUFFER_STRIDE` bytes: a 64-byte header (length, data offset, timestamp, metadata)
//! followed by the data area. Data starts `HEADROOM` bytes into the data area so that encapsulations
//! can prepend headers without copying. A `Packet` is owned: moving it moves the handle (8 bytes),
//! dropping it returns the buffer to the pool.

use std::fmt;
use std::ptr::NonNull;

/// Bytes of one pool buffer, header included.
pub const BUFFER_STRIDE: usize = 10240;
/// Size of the per-buffer header that precedes the data area.
pub const HEADER_SIZE: usize = 64;
/// Bytes available for headroom + frame.
pub const DATA_AREA: usize = BUFFER_STRIDE - HEADER_SIZE;
/// Free bytes kept in front of freshly allocated packets for pushing headers.
pub const HEADROOM: usize = 256;
/// Largest frame (without FCS) Stitch accepts: a 9216-byte jumbo frame.
pub const MAX_FRAME: usize = 9216;

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
    pub(crate) len: u16,
    pub(crate) offset: u16,
    /// Input port number (driver-defined) or 0.
    pub port: u16,
    pub(crate) csum_state: u8,
    /// GSO type of a super-frame (virtio-net `gso_type` values), 0 for none.
    pub gso_type: u8,
    /// For `ChecksumState::Partial`: where checksumming starts, from the frame start.
    pub csum_start: u16,
    /// For `ChecksumState::Partial`: where the checksum is stored, relative to `csum_start`.
    pub csum_offset: u16,
    /// GSO segment size for super-frames from offloading interfaces, else 0.
    pub gso_size: u16,
    _pad: u16,
    /// Receive or capture time, nanoseconds since the Unix epoch (0 = unknown).
    pub timestamp_ns: u64,
    /// Free for apps to carry per-packet state (e.g. a flow hash); zeroed on allocation.
    pub user: [u64; 4],
}

const _: () = assert!(std::mem::size_of::<PacketHeader>() == HEADER_SIZE);
const _: () = assert!(HEADROOM + MAX_FRAME <= DATA_AREA);

/// One pool buffer as laid out in memory.
#[repr(C, align(64))]
pub struct PacketBuf {
    pub header: PacketHeader,
    pub area: [u8; DATA_AREA],
}

const _: () = assert!(std::mem::size_of::<PacketBuf>() == BUFFER_STRIDE);

/// Errors of packet editing; the packet is left unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("packet would exceed the {DATA_AREA}-byte buffer")]
    TooLong,
    #[error("packet is shorter than the {0} bytes to remove")]
    TooShort(usize),
}

/// An owned packet. Not `Clone`: use [`Packet::try_clone`], which takes a new buffer.
pub struct Packet(NonNull<PacketBuf>);

// A packet is owned by exactly one holder at a time; handing it to another thread is a move.
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
        unsafe { &(*self.0.as_ptr()).header }
    }

    #[inline]
    pub fn header(&self) -> &PacketHeader {
        self.hdr()
    }

    #[inline]
    pub fn header_mut(&mut self) -> &mut PacketHeader {
        unsafe { &mut (*self.0.as_ptr()).header }
    }

    /// Frame length in bytes.
    #[inline]
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.hdr().len as usize
    }

    #[inline]
    pub fn data(&self) -> &[u8] {
        let h = self.hdr();
        unsafe {
            let area = (*self.0.as_ptr()).area.as_ptr();
            std::slice::from_raw_parts(area.add(h.offset as usize), h.len as usize)
        }
    }

    #[inline]
    pub fn data_mut(&mut self) -> &mut [u8] {
        let (off, len) = (self.hdr().offset as usize, self.hdr().len as usize);
        unsafe {
            let area = (*self.0.as_ptr()).area.as_mut_ptr();
            std::slice::from_raw_parts_mut(area.add(off), len)
        }
    }

    /// Bytes free in front of the data.
    #[inline]
    pub fn headroom(&self) -> usize {
        self.hdr().offset as usize
    }

    /// Bytes the frame can still grow at its end.
    #[inline]
    pub fn tailroom(&self) -> usize {
        DATA_AREA - self.hdr().offset as usize - self.hdr().len as usize
    }

    /// Sets the length; new bytes (when growing) hold whatever the buffer held.
    #[inline]
    pub fn set_len(&mut self, len: usize) -> Result<(), PacketError> {
        if self.hdr().offset as usize + len > DATA_AREA {
            return Err(PacketError::TooLong);
        }
        self.header_mut().len = len as u16;
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
            h.offset = (off - n) as u16;
            h.len = (len + n) as u16;
        } else {
            if len + n > DATA_AREA {
                return Err(PacketError::TooLong);
            }
            // Re-centre: put the data after HEADROOM (or as far as it fits) behind the new header.
            let new_off = HEADROOM.min(DATA_AREA - len - n);
            unsafe {
                let area = (*self.0.as_ptr()).area.as_mut_ptr();
                std::ptr::copy(area.add(off), area.add(new_off + n), len);
            }
            let h = self.header_mut();
            h.offset = new_off as u16;
            h.len = (len + n) as u16;
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
        h.offset += n as u16;
        h.len -= n as u16;
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
        let mut p = crate::pool::alloc()?;
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

    /// Resets the header to a fresh packet's.
    #[inline]
    pub(crate) fn reset(&mut self) {
        let h = self.header_mut();
        h.len = 0;
        h.offset = HEADROOM as u16;
        h.port = 0;
        h.csum_state = 0;
        h.csum_start = 0;
        h.csum_offset = 0;
        h.gso_size = 0;
        h.gso_type = 0;
        h.timestamp_ns = 0;
        h.user = [0; 4];
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
    fn jumbo_frames_fit_and_oversize_is_refused() {
        let mut p = pool::alloc().unwrap();
        p.set_data(&vec![0xab; MAX_FRAME]).unwrap();
        assert_eq!(p.len(), MAX_FRAME);
        assert_eq!(p.set_len(DATA_AREA), Err(PacketError::TooLong));
        assert_eq!(p.len(), MAX_FRAME);
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
