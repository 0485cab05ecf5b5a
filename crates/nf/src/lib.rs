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
