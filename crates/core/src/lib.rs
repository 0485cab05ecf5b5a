//! Stitch core: packets, the packet pool, links, the app interface, the graph file and the
//! engine that runs it. Nothing here knows a protocol or a device; network functions and drivers
//! live in other crates and reach the engine through [`app::Registry`].
//!
//! A packet's path: a source app `pull`s it from outside (or builds it) into a [`packet::Packet`]
//! taken from the [`pool`], transmits it on a [`link::Producer`]; the engine `push`es the next
//! app, which receives it from its [`link::Consumer`], and so on until an app frees it or sends it
//! out of the graph.

pub mod app;
pub mod diff;
pub mod engine;
/// File descriptors over Unix sockets: OS plumbing shared by the function-process ports
/// (stitch-nf) and the vhost-user ports (stitch-vhost).
pub mod fdpass;
pub mod graph;
pub mod link;
pub mod mapping;
pub mod packet;
pub mod pool;

pub use app::{
    App, AppContext, AppError, AppType, Counter, Io, PortNames, PortSpec, Reconfigured, Registry,
    PULL_BURST,
};
pub use engine::{Engine, Stats};
pub use graph::{Graph, Placement};
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
