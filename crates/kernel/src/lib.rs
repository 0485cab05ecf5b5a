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
//!
//! # Map
//!
//! The modules, in short: the in-kernel data plane: `bpf/` (C programs: `common.h` maps and patch
//! panel, one header per function kind, `stitch.bpf.c` entry points, compiled by `build.rs`),
//! `plan` (graph file → kernel functions and links), `datapath` (load with pinned maps,
//! install/change by diff — a pure `allocate` of slots, state ids and VIDs from the record of what
//! is installed, then named install steps —, status, teardown), `maps` (the maps' layouts), `tap`
//! (capture sessions and the BPF ring buffer of each), `tap_claims` (which sessions tap which VIDs,
//! in claim files; what dead readers left, cleared by the data plane), `error`, `capture` (a tap's
//! records as the PCAPNG stream of `stitch capture --link --kernel` and the extcap), `netdev` (veth
//! pairs and the interfaces a placement creates).

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
