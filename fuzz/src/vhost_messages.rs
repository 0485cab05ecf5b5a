//! vhost-user messages and the descriptor rings a guest controls: any header and payload
//! decode or are refused, never a panic; any descriptor table is walked within guest memory
//! or refused as a fault.
use std::os::fd::{FromRawFd, OwnedFd};
use stitch_vhost::memory::GuestMemory;
use stitch_vhost::message::{self, Header, Region};
use stitch_vhost::virtq::Vring;

const GPA: u64 = 0x10000;
const SIZE: usize = 16384;

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    if data.len() < 13 {
        return;
    }
    if let Ok(h) = Header::parse(&data[1..13]) {
        let _ = message::parse(&h, &data[13..], (data[0] % 10) as usize);
    }
    // The same bytes as guest memory: a ring of 8 at the start, buffers anywhere.
    let name = std::ffi::CString::new("fuzz").unwrap();
    let fd = unsafe {
        let fd = libc::memfd_create(name.as_ptr(), 0);
        libc::ftruncate(fd, SIZE as libc::off_t);
        OwnedFd::from_raw_fd(fd)
    };
    let region = Region {
        guest_phys_addr: GPA,
        size: SIZE as u64,
        user_addr: GPA,
        mmap_offset: 0,
    };
    let Ok(mem) = GuestMemory::map(&[region], vec![fd]) else {
        return;
    };
    let mem = std::sync::Arc::new(mem);
    let base = mem.gpa(GPA, SIZE as u64).unwrap();
    let n = data.len().min(SIZE);
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base, n) };
    let Ok(mut ring) = Vring::new(&mem, 8, GPA, GPA + 0x1000, GPA + 0x2000, 0, None) else {
        return;
    };
    let mut segs = Vec::new();
    for _ in 0..ring.pending().min(16) {
        let Ok(head) = ring.next_head() else { break };
        if ring.chain(head, &mut segs).is_ok() {
            for s in &segs {
                let start = s.ptr as usize - base as usize;
                assert!(start + s.len as usize <= SIZE);
            }
        }
        ring.add_used(head, 0, None);
    }
    ring.publish(None);
}
