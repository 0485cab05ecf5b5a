//! Stitch core: packets, the packet pool, links, the app interface, the graph file and the
//! engine that runs it. Nothing here knows a protocol or a device; network functions and drivers
//! live in other crates and reach the engine through [`app::Registry`].
//!
//! A packet's path: a source app `pull`s it from outside (or builds it) into a [`packet::Packet`]
//! taken from the [`pool`], transmits it on a [`link::Producer`]; the engine `push`es the next
//! app, which receives it from its [`link::Consumer`], and so on until an app frees it or sends it
//! out of the graph.

pub mod app;

pub mod engine;
/// File descriptors over Unix sockets: OS plumbing shared by the function-process ports
/// (stitch-nf) and the vhost-user ports (stitch-vhost).
pub mod fdpass;
pub mod files;
pub mod graph;
pub mod latency;
pub mod link;
pub mod mapping;
pub mod packet;
pub use packet::pool;

pub use app::{
    App, AppContext, AppError, AppSnapshot, AppState, AppType, Counter, Descriptors, Io, PortNames,
    PortSpec, Reconfigured, Registry, PULL_BURST,
};
pub use engine::{pin_to_core, Engine, Stats};
pub use graph::Graph;
pub use link::{Consumer, Producer};
pub use packet::Packet;

/// Asks the CPU to bring in the cache line at `p`, for a use a few packets on (a hint: it never
/// faults, reads nothing and changes nothing, so any address will do).
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and reads or writes nothing visible.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Copies `n` bytes. Short copies (most frames) move 16 bytes at a time inline, the last move
/// overlapping the one before, instead of calling into `memcpy`, whose entry and size dispatch
/// cost more than such a move.
///
/// # Safety
/// `src` must be readable and `dst` writable for `n` bytes, and the two must not overlap.
#[inline(always)]
pub unsafe fn copy_bytes(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: every access below lies in [0, n) of `src` or `dst` (each branch keeps to its
    // bounds: above 256, from 16, from 8, below 8), which the caller's contract makes valid
    // and apart; the moves are unaligned.
    unsafe {
        type Chunk = [u8; 16];
        if n > 256 {
            std::ptr::copy_nonoverlapping(src, dst, n);
        } else if n >= 16 {
            let mut i = 0;
            while i + 16 < n {
                let v = std::ptr::read_unaligned(src.add(i) as *const Chunk);
                std::ptr::write_unaligned(dst.add(i) as *mut Chunk, v);
                i += 16;
            }
            let v = std::ptr::read_unaligned(src.add(n - 16) as *const Chunk);
            std::ptr::write_unaligned(dst.add(n - 16) as *mut Chunk, v);
        } else if n >= 8 {
            let a = std::ptr::read_unaligned(src as *const u64);
            let b = std::ptr::read_unaligned(src.add(n - 8) as *const u64);
            std::ptr::write_unaligned(dst as *mut u64, a);
            std::ptr::write_unaligned(dst.add(n - 8) as *mut u64, b);
        } else {
            for i in 0..n {
                *dst.add(i) = *src.add(i);
            }
        }
    }
}

/// Copies `src` into `dst`, of the same length, as [`copy_bytes`] does.
#[inline(always)]
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_slice between slices of different lengths"
    );
    // SAFETY: both slices are valid for their length, the same; a `&mut` slice overlaps nothing.
    unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// The folder of a running instance's sockets: `/run/stitch` for root, else
/// `$XDG_RUNTIME_DIR/stitch`, else `stitch-UID` in the temporary folder.
pub fn runtime_dir() -> std::path::PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        std::path::PathBuf::from("/run/stitch")
    } else if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        std::path::Path::new(&d).join("stitch")
    } else {
        std::env::temp_dir().join(format!("stitch-{uid}"))
    }
}

#[cfg(test)]
mod tests {
    use super::copy_bytes;

    #[test]
    fn copies_every_length_exactly() {
        let src: Vec<u8> = (0..600u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in 0..600 {
            let mut dst = vec![0xeeu8; 604];
            // SAFETY: both buffers are larger than the copy, and distinct.
            unsafe { copy_bytes(src.as_ptr(), dst.as_mut_ptr().add(2), n) };
            assert_eq!(&dst[2..2 + n], &src[..n], "length {n}");
            assert!(
                dst[..2].iter().chain(&dst[2 + n..]).all(|b| *b == 0xee),
                "length {n}: outside touched"
            );
        }
    }
}
