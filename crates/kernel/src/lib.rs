//! Stitch's in-kernel data plane (after InKeV, docs/references.md): network functions as eBPF
//! programs in the kernel, stitched into a graph by a patch panel of tail calls, attached to
//! workloads by programs on their interfaces' tc ingress hooks. The same graph file as the
//! userspace engine: apps with `placement: kernel`.
//!
//! - `bpf/` — the C programs: `common.h` (maps, per-packet metadata, the patch panel),
//!   one header per function kind (`forwarder.h`, `bridge.h`, `router.h`, `firewall.h`) and
//!   `stitch.bpf.c` with the entry points, compiled by `build.rs`.
//! - [`plan`] — graph file → kernel functions, ports and links, with errors by line.
//! - [`datapath`] — load, pin, install and change by diff, status, teardown.
//! - [`maps`] — the maps' key and value layouts, shared with the C side.
//! - [`tap`] — capture sessions on links: the patch panel copies what leaves a tapped VID
//!   into the session's BPF ring buffer.
//! - [`capture`] — a tap's records as a PCAPNG or PCAP stream, filtered, one interface per
//!   link.

pub mod capture;
pub mod datapath;
mod error;
pub mod maps;
pub mod netdev;
pub mod plan;
pub mod tap;
mod tap_claims;

pub use datapath::{engine_ring_path, ApplyReport, DataPlane, Error, Status};
pub use plan::Plan;
