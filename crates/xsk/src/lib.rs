//! AF_XDP sockets as both their users see them: the `af_xdp` interface (`stitch-io`), which owns
//! the sockets, and a function process (`stitch-nf`), which may read a socket's receive ring
//! itself when the interface lends it.
//!
//! - [`ring`]: the four rings a socket shares with the kernel, read and written through a
//!   bounds-checked mapping, with this side's index private behind
//!   [`consume`](ring::Ring::consume) and [`submit`](ring::Ring::submit).
//! - [`lend`]: what the interface hands a reader of its receive rings, and the trait a reader
//!   offers at its end of a link.
//!
//! Neither the interface nor the function knows the other's crate: they meet here.

pub mod lend;
pub mod ring;

pub use ring::{Ring, RingKind};
