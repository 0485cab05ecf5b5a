//! Network functions as separate processes (fine-grained NFs, docs/references.md), attached to a
//! running graph through shared memory — VPP's memif is the model for the attach protocol.
//!
//! - [`port`]: the `nf_port` app on Stitch's side.
//! - [`function`]: the `function` app, a port whose process Stitch starts and supervises
//!   (`placement: process`).
//! - [`client`]: the library a function links (Rust); the binaries `stitch-nf-signature` and
//!   `stitch-nf-firewall` are examples built on it.
//! - [`shm`]: the shared region and its rings, the one layout both sides read.
//! - [`direct`]: direct channels from one function to another (the inter-VNF bypass), Stitch's
//!   side.
//! - [`steer`]: an interface's frames read by a function straight from the interface's AF_XDP
//!   sockets (the NIC's flow director steering each function's flows, as in fine-grained NFs), on
//!   `stitch-xsk`'s rings.
//! - [`listener`]: the attach socket (one JSON line each way plus SCM_RIGHTS).
//! - [`ffi`]: the same library for C (`include/stitch_nf.h`, `libstitch_nf.so`).
//!
//! # Map
//!
//! The modules, in short: functions in other processes: `nf_port` (the app; `port/handover`: a port
//! lent to a process taking over, its function staying attached — connection, region, doorbell,
//! ring indices, then the new packet memory, plugged into a guest while the take-over is prepared),
//! `shm` (the shared region and its rings — the one layout both sides read), `listener` (the attach
//! socket, SCM_RIGHTS; hellos heard without blocking, a guest's next hello on its QEMU's
//! connection), `paths` (the default attach sockets, `/run/stitch-fn/INSTANCE.sock` for root), `peers`
//! (who may attach a port: `SO_PEERCRED` against root, the process Stitch started for it, the users
//! and groups it names), `guest` (functions in VMs: the `GuestBus` that hot-plugs memory into a
//! guest, the guest's side of finding and mapping its devices), `port/guest` (a direct channel
//! plugged into a port's guest off the worker), `connection` (a function's connection: the socket,
//! or a guest's virtio-serial port), `attachment` (what the listener hands a port: region, layout,
//! doorbell), `client` (the library a function links), `direct` (channels from one function
//! straight to another, Stitch's side, and `PortShared`, the state a port shares with the listener
//! and the switch that offers it channels, `steer` (an interface's AF_XDP sockets lent to a
//! function: the offer, the port's checks and copies) on `stitch-xsk`'s rings, example functions in
//! `src/bin/`.

pub mod attachment;
pub mod client;
mod connection;
pub mod direct;
pub mod ffi;
pub mod function;
pub mod guest;
pub mod listener;
pub mod paths;
pub mod peers;
pub mod port;
pub mod shm;
pub mod steer;

use stitch_core::{AppType, Registry};

pub fn register(r: &mut Registry) {
    r.register(AppType::of::<port::NfPort>(
        "nf_port",
        "a network function in another process, over shared-memory rings (zero-copy or isolated, polling or blocking)",
    ));
    r.register(AppType::of::<function::FunctionPort>(
        "function",
        "a function process Stitch starts from `command`, attaches through an nf_port, restarts when it dies and limits (placement: process)",
    ));
}
