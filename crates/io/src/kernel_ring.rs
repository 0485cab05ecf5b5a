//! The reading end of a BPF ring buffer (`BPF_MAP_TYPE_RINGBUF`) into which Stitch's kernel data
//! plane writes the packets it sends to the engine (`stitch-kernel`'s `engine_send`: one ring
//! per kernel ↔ engine boundary, pinned in bpffs). Read in place, with no system call: the
//! consumer position is the one page this side writes; the producer position and the records
//! are mapped read-only, the data area twice in a row, so that a record that wraps around the
//! end is still one slice.
//!
//! Each record is the kernel's 8-byte header (length with its busy and discard bits, then a
//! page offset), then Stitch's `struct engine_record` (`crates/kernel/bpf/common.h`): the
//! frame's length, its partial checksum's place, segment size, a VLAN tag the kernel lifted
//! out of it, and flags; then the frame. Every length read from the ring is checked against the
//! mapping; a record that does not parse is reported as `None` and skipped.

use crate::xdp::Attr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use stitch_wire::ethertype;
use stitch_wire::offload::{self, VnetHdr};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_MAP_TYPE_RINGBUF: u32 = 27;
const BUSY: u32 = 1 << 31;
const DISCARD: u32 = 1 << 30;
const RECORD_HEADER: usize = 8;
/// `struct engine_record` before its data.
const ENGINE_HEADER: usize = 16;
const CSUM_PARTIAL: u8 = 1;
const CSUM_VALID: u8 = 2;
const VLAN: u8 = 4;
/// Records taken per call before the consumer position is published.
const MAX_BATCH: usize = 256;

/// One packet from the kernel: its virtio-net header equivalent, a lifted VLAN tag, the frame.
pub struct KernelRecord<'a> {
    pub vnet: VnetHdr,
    pub vlan: Option<[u8; 4]>,
    pub frame: &'a [u8],
}

/// A mapping this side only reads, unmapped on drop.
struct ReadOnly {
    base: NonNull<u8>,
    len: usize,
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly what mmap returned; nothing borrows the mapping past
        // its owner's life (every view is tied to `&self`).
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
    }
}

pub struct KernelRing {
    _fd: OwnedFd,
    /// The consumer page: its first 8 bytes are the consumer position.
    consumer: stitch_core::mapping::Mapping,
    /// The producer page (position in its first 8 bytes), then the data area twice.
    data: ReadOnly,
    page: usize,
    /// The data area's size (a power of two).
    size: usize,
}

// SAFETY: the ring's mappings are owned by it and only read through bounds-checked views and
// atomics; moving it to the worker thread that reads it is what an app does.
unsafe impl Send for KernelRing {}

/// The map's type and `max_entries` (`struct bpf_map_info`'s first and fifth words).
fn map_type_and_size(fd: &OwnedFd) -> io::Result<(u32, u32)> {
    let mut info = [0u8; 88];
    let attr = Attr::new()
        .u32(0, fd.as_raw_fd() as u32)
        .u32(4, info.len() as u32)
        .u64(8, info.as_mut_ptr() as u64);
    // SAFETY: the attribute points at `info`, live and writable for its length during the call.
    unsafe { attr.call(BPF_OBJ_GET_INFO_BY_FD) }?;
    let word = |i: usize| u32::from_ne_bytes(info[i * 4..i * 4 + 4].try_into().unwrap());
    Ok((word(0), word(4)))
}

impl KernelRing {
    /// Opens the ring pinned at `path` and maps it.
    pub fn open(path: &Path) -> io::Result<KernelRing> {
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
        let attr = Attr::new().u64(0, c_path.as_ptr() as u64);
        // SAFETY: the attribute points at `c_path`, a NUL-terminated string alive for the call.
        let fd = unsafe { attr.call(BPF_OBJ_GET) }?;
        // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let (kind, size) = map_type_and_size(&fd)?;
        if kind != BPF_MAP_TYPE_RINGBUF || !size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("not a BPF ring buffer (map type {kind}, {size} bytes)"),
            ));
        }
        // SAFETY: sysconf takes no pointers.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let size = size as usize;
        let consumer = stitch_core::mapping::Mapping::shared(
            std::os::fd::AsFd::as_fd(&fd),
            page,
            Default::default(),
        )?;
        let len = page + 2 * size;
        // SAFETY: a fresh read-only mapping at an address the kernel chooses cannot overlap
        // memory Rust uses; the kernel lays out the producer page and the data area twice at
        // this offset of a ring buffer's descriptor.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                page as i64,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p as *mut u8).ok_or_else(io::Error::last_os_error)?;
        Ok(KernelRing {
            _fd: fd,
            consumer,
            data: ReadOnly { base, len },
            page,
            size,
        })
    }

    fn data_u64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= self.data.len && off.is_multiple_of(8));
        // SAFETY: in bounds and 8-aligned (asserted; the mapping is page-aligned); any bit
        // pattern is a valid u64; the mapping lives as long as `self`.
        unsafe { &*(self.data.base.as_ptr().add(off) as *const AtomicU64) }
    }

    fn data_u32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= self.data.len && off.is_multiple_of(4));
        // SAFETY: as for `data_u64`, 4-aligned.
        unsafe { &*(self.data.base.as_ptr().add(off) as *const AtomicU32) }
    }

    fn data_bytes(&self, off: usize, len: usize) -> Option<&[u8]> {
        if off.checked_add(len)? > self.data.len {
            return None;
        }
        // SAFETY: in bounds (checked above) of a mapping that lives as long as `self`; the
        // kernel does not write a record between its submission and our consumer position
        // passing it.
        Some(unsafe { std::slice::from_raw_parts(self.data.base.as_ptr().add(off), len) })
    }

    fn consumer_pos(&self) -> &AtomicU64 {
        // SAFETY: an AtomicU64 is valid for any bit pattern, and only this side writes the
        // consumer position (the kernel reads it).
        unsafe { self.consumer.view::<AtomicU64>(0) }.expect("the consumer page holds its position")
    }

    /// Whether a record waits.
    pub fn has_data(&self) -> bool {
        self.data_u64(0).load(Ordering::Acquire) > self.consumer_pos().load(Ordering::Relaxed)
    }

    /// Hands each submitted record to `f` (`None`: it did not parse), at most a batch, and
    /// gives their room back to the kernel. `f` returns false to leave the record (and the
    /// rest) for later.
    pub fn consume(&mut self, mut f: impl FnMut(Option<KernelRecord<'_>>) -> bool) -> usize {
        let producer = self.data_u64(0).load(Ordering::Acquire);
        let start = self.consumer_pos().load(Ordering::Relaxed);
        let mut pos = start;
        let mut taken = 0;
        while pos < producer && taken < MAX_BATCH {
            let at = self.page + (pos as usize & (self.size - 1));
            let header = self.data_u32(at).load(Ordering::Acquire);
            if header & BUSY != 0 {
                break;
            }
            let len = (header & !(BUSY | DISCARD)) as usize;
            if header & DISCARD == 0 {
                let record = self
                    .data_bytes(at + RECORD_HEADER, len)
                    .and_then(parse_record);
                if !f(record) {
                    break;
                }
                taken += 1;
            }
            pos += (RECORD_HEADER + len).next_multiple_of(8) as u64;
        }
        if pos != start {
            self.consumer_pos().store(pos, Ordering::Release);
        }
        taken
    }
}

/// Stitch's record: `struct engine_record`, then the frame.
fn parse_record(b: &[u8]) -> Option<KernelRecord<'_>> {
    let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    if b.len() < ENGINE_HEADER {
        return None;
    }
    let len = u32::from_ne_bytes(b[0..4].try_into().ok()?) as usize;
    let frame = b.get(ENGINE_HEADER..ENGINE_HEADER.checked_add(len)?)?;
    let flags = b[14];
    let mut vnet = VnetHdr::default();
    if flags & CSUM_PARTIAL != 0 {
        vnet.flags = offload::F_NEEDS_CSUM;
        vnet.csum_start = u16_at(4);
        vnet.csum_offset = u16_at(6);
    } else if flags & CSUM_VALID != 0 {
        vnet.flags = offload::F_DATA_VALID;
    }
    let gso_size = u16_at(8);
    if gso_size != 0 {
        vnet.gso_type = gso_type_of(frame)?;
        vnet.gso_size = gso_size;
    }
    let vlan = (flags & VLAN != 0).then(|| {
        let mut tag = [0u8; 4];
        // The TPID as the kernel keeps it (network byte order), then the TCI.
        tag[..2].copy_from_slice(&b[12..14]);
        tag[2..].copy_from_slice(&u16_at(10).to_be_bytes());
        tag
    });
    Some(KernelRecord { vnet, vlan, frame })
}

/// A super-frame's GSO type, from its headers (the kernel's `gso_type` is not in the record):
/// TCP or UDP over IPv4 or IPv6, as the virtio-net header names them.
fn gso_type_of(frame: &[u8]) -> Option<u8> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let (v6, proto) = match ethertype {
        ethertype::IPV4 => (false, *frame.get(14 + 9)?),
        ethertype::IPV6 => (true, *frame.get(14 + 6)?),
        _ => return None,
    };
    match (proto, v6) {
        (6, false) => Some(offload::GSO_TCPV4),
        (6, true) => Some(offload::GSO_TCPV6),
        (17, _) => Some(offload::GSO_UDP_L4),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        flags: u8,
        frame: &[u8],
        csum: (u16, u16),
        gso: u16,
        vlan: (u16, [u8; 2]),
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(frame.len() as u32).to_ne_bytes());
        b.extend_from_slice(&csum.0.to_ne_bytes());
        b.extend_from_slice(&csum.1.to_ne_bytes());
        b.extend_from_slice(&gso.to_ne_bytes());
        b.extend_from_slice(&vlan.0.to_ne_bytes());
        b.extend_from_slice(&vlan.1);
        b.push(flags);
        b.push(0);
        b.extend_from_slice(frame);
        b
    }

    fn tcp4_frame(len: usize) -> Vec<u8> {
        let mut f = vec![0u8; len];
        f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
        f[14] = 0x45;
        f[14 + 9] = 6;
        f
    }

    #[test]
    fn a_record_gives_the_offloads_the_kernel_knew() {
        let frame = tcp4_frame(3000);
        let b = record(
            CSUM_PARTIAL | VLAN,
            &frame,
            (34, 16),
            1448,
            (0x0123, ethertype::VLAN.to_be_bytes()),
        );
        let r = parse_record(&b).expect("parses");
        assert_eq!(r.frame, &frame[..]);
        assert_eq!(r.vnet.flags, offload::F_NEEDS_CSUM);
        assert_eq!((r.vnet.csum_start, r.vnet.csum_offset), (34, 16));
        assert_eq!(
            (r.vnet.gso_type, r.vnet.gso_size),
            (offload::GSO_TCPV4, 1448)
        );
        assert_eq!(r.vlan, Some([0x81, 0x00, 0x01, 0x23]));
        let plain = record(CSUM_VALID, &frame[..60], (0, 0), 0, (0, [0, 0]));
        let r = parse_record(&plain).expect("parses");
        assert_eq!(r.vnet.flags, offload::F_DATA_VALID);
        assert_eq!((r.vnet.gso_type, r.vlan), (offload::GSO_NONE, None));
    }

    #[test]
    fn a_record_that_claims_more_than_it_holds_is_refused() {
        let mut b = record(0, &tcp4_frame(60), (0, 0), 0, (0, [0, 0]));
        b[0..4].copy_from_slice(&61u32.to_ne_bytes());
        assert!(parse_record(&b).is_none());
        assert!(parse_record(&b[..10]).is_none());
        // A super-frame of something that cannot be segmented.
        let mut arp = vec![0u8; 2000];
        arp[12..14].copy_from_slice(&ethertype::ARP.to_be_bytes());
        assert!(parse_record(&record(0, &arp, (0, 0), 1000, (0, [0, 0]))).is_none());
    }
}
