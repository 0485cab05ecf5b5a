//! Lending an interface's receive rings to another reader: the interface stops reading a
//! socket and offers it ([`SteerOffer`]) to the reader at the other end of the link its frames
//! would take; the reader reads the rings itself and says how far it gave the frames back
//! (`returned`), and the interface refills and consumes up to there. `stitch-nf`'s `steer`
//! module holds the function port's side of the protocol and its steps.
//!
//! A reader says it can borrow by tagging its end of the link with an
//! `Arc<dyn RingBorrower>` (`stitch_core::link::EndTag`).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The interface stopped reading; the reader has not taken the sockets yet.
pub const OFFERED: u32 = 0;
/// The reader reads the rings.
pub const FUNCTION: u32 = 1;
/// The reader gave everything back (or declined): the interface reads its sockets again.
pub const DONE: u32 = 2;

/// One queue's steering socket, lent.
pub struct SteerQueue {
    pub socket: OwnedFd,
    /// The UMEM the socket receives into (the queue's socket's, shared).
    pub umem: OwnedFd,
    pub umem_len: usize,
    pub ring_size: u32,
    /// The receive ring's index the reader starts at.
    pub start: u32,
    /// The ring index up to which frames were given back: the interface refills and moves
    /// the consumer up to it.
    pub returned: AtomicU32,
}

/// What an interface offers a reader: its sockets for one steering port.
pub struct SteerOffer {
    /// For logs: the interface and the port of it that steers here.
    pub from: String,
    pub queues: Vec<SteerQueue>,
    /// [`OFFERED`], [`FUNCTION`] or [`DONE`]; the reader moves it.
    pub phase: AtomicU32,
    /// Complete a TCP/UDP checksum that holds only the pseudo-header sum (a local sender's
    /// offload, which XDP does not see), as the interface does for what it receives.
    pub complete_checksums: bool,
    /// The interface wants its sockets back (its graph changed, it is stopping).
    pub end: AtomicBool,
}

impl SteerOffer {
    pub fn phase(&self) -> u32 {
        self.phase.load(Ordering::Acquire)
    }

    /// The reader is done with it: the interface may read again from each `returned`.
    pub fn finish(&self) {
        self.phase.store(DONE, Ordering::Release);
    }
}

/// A reader that can borrow an interface's receive rings, as the interface sees it at the
/// other end of a link.
pub trait RingBorrower: Send + Sync {
    /// Who reads, for `stitch show`.
    fn name(&self) -> &str;
    /// The attachment that would read now (a generation that changes with each), or none.
    fn reader(&self) -> Option<u64>;
    /// Where the interface leaves its offer and finds it again at a take-over; the reader
    /// clears it once it is done.
    fn offer_slot(&self) -> &Mutex<Option<Arc<SteerOffer>>>;
    /// Tells the reader an offer waits in its slot.
    fn notify(&self);
}
