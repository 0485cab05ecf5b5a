//! Steered input — the "double buffer + FDIR" of fine-grained NFs (docs/references.md): an `af_xdp`
//! interface whose steering rules send frames to a port whose consumer is a zero-copy function port
//! hands that function the port's AF_XDP sockets, so the function reads those frames straight from
//! the kernel's receive rings, without the engine touching them on the way in.
//!
//! The hand-over is ordered and lossless, one step per actor:
//!
//! 1. **Offered**: the interface stops reading the port's sockets (noting each ring's index,
//!    `start`) and puts a [`SteerOffer`] in the function port's slot
//!    ([`crate::listener::PortShared`]).
//! 2. The port waits until its input link is empty (every frame the interface read before is
//!    in the function's ring), then sends the function the sockets, their UMEM and a
//!    [`SteerHeader`] page (**Function**). The function reads its own ring empty first, then
//!    the receive rings from `start`.
//! 3. Each frame comes back on `from_nf` in ring order, flagged [`FLAG_STEERED`](crate::shm::FLAG_STEERED); the port
//!    checks it is the next one, copies it from the UMEM into a packet of the pool (forwarded)
//!    or not (dropped), and publishes `returned`. The interface puts the frames up to
//!    `returned` back in the fill ring and moves the ring's consumer index: the kernel never
//!    overwrites a frame the function still has.
//! 4. **Done**: the function left (or was killed), or stopped after the interface asked for
//!    its rings back (`end`) and everything it read was accounted. The interface reads its
//!    sockets again from `returned`: frames the function had read without giving back are read
//!    again (through the engine), so no frame leaks and nothing it gave back is lost.

use crate::shm::{self, Desc, Mapping, Region, SteerHeader, FLAG_DROP};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use stitch_core::{pool, Packet};
use stitch_xsk::Ring;

pub use stitch_xsk::lend::{SteerOffer, SteerQueue, DONE, FUNCTION, OFFERED};

impl stitch_xsk::lend::RingBorrower for crate::listener::PortShared {
    fn name(&self) -> &str {
        &self.name
    }

    fn reader(&self) -> Option<u64> {
        self.current.lock().unwrap().as_ref().map(|c| c.generation)
    }

    fn offer_slot(&self) -> &std::sync::Mutex<Option<std::sync::Arc<SteerOffer>>> {
        &self.steer
    }

    fn notify(&self) {
        self.changed.store(true, Ordering::Release);
    }
}

/// One queue as the port reads it: the ring's descriptors and the frames they name.
struct PortQueue {
    /// Read from the ring index of the next frame the function must give back.
    rx: Ring,
    umem: Mapping,
    /// The kernel's producer index as last read: read again only when the next frame
    /// reaches it.
    received: u32,
}

/// What one batch of steered descriptors gave.
#[derive(Default)]
pub struct Taken {
    pub forwarded: u64,
    /// Of those forwarded, frames from steered rings.
    pub steered: u64,
    pub bad: u64,
    pub exhausted: u64,
}

/// Where a port's steered input stands, for a Stitch process taking the port over: the
/// function goes on reading the rings, and the successor goes on taking its frames back.
#[derive(Debug, Serialize, Deserialize)]
pub struct SteeringAt {
    pub from: String,
    #[serde(default)]
    pub complete_checksums: bool,
    pub queues: Vec<QueueAt>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct QueueAt {
    pub ring_size: u32,
    pub umem_len: usize,
    /// The ring index of the next frame the function gives back.
    pub next: u32,
}

/// A port's side of an offer it took.
pub struct Steering {
    pub offer: std::sync::Arc<SteerOffer>,
    queues: Vec<PortQueue>,
    /// The page shared with the function, once sent.
    header: Option<(OwnedFd, Mapping)>,
    /// The function stopped: the `from_nf` position up to which its frames may still come.
    stopped_at: Option<u32>,
}

impl Steering {
    /// Maps the offer's rings and frames in this process, to check and copy what the
    /// function gives back.
    pub fn new(offer: std::sync::Arc<SteerOffer>) -> Result<Steering, String> {
        let mut queues = Vec::new();
        for q in &offer.queues {
            let mut rx = Ring::map_rx(q.socket.as_fd(), q.ring_size)?;
            rx.seek(q.start);
            let umem = shm::map(q.umem.as_fd(), q.umem_len, false)
                .map_err(|e| format!("cannot map the interface's UMEM: {e}"))?;
            queues.push(PortQueue {
                rx,
                umem,
                received: q.start,
            });
        }
        Ok(Steering {
            offer,
            queues,
            header: None,
            stopped_at: None,
        })
    }

    /// The header page, then each queue's socket and UMEM, for a process taking over.
    pub fn lend(&self) -> std::io::Result<Vec<OwnedFd>> {
        let (page, _) = self.header.as_ref().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "not sent to the function")
        })?;
        let mut fds = vec![page.try_clone()?];
        for q in &self.offer.queues {
            fds.push(q.socket.try_clone()?);
            fds.push(q.umem.try_clone()?);
        }
        Ok(fds)
    }

    pub fn position(&self) -> SteeringAt {
        SteeringAt {
            from: self.offer.from.clone(),
            complete_checksums: self.offer.complete_checksums,
            queues: (self.offer.queues.iter().zip(&self.queues))
                .map(|(o, q)| QueueAt {
                    ring_size: o.ring_size,
                    umem_len: o.umem_len,
                    next: q.rx.position(),
                })
                .collect(),
        }
    }

    /// The steered input a predecessor's port served (`lend`'s descriptors, `at` its final
    /// position), served on here: an offer already with the function, which the interface
    /// finds in the port's slot.
    pub fn adopt(at: &SteeringAt, fds: Vec<OwnedFd>) -> Result<Steering, String> {
        let mut fds = fds.into_iter();
        let page = fds.next().ok_or("the steered input's page was not lent")?;
        let mut queues = Vec::new();
        for q in &at.queues {
            let (Some(socket), Some(umem)) = (fds.next(), fds.next()) else {
                return Err("the steered input's sockets were not lent".into());
            };
            queues.push(SteerQueue {
                socket,
                umem,
                umem_len: q.umem_len,
                ring_size: q.ring_size,
                start: q.next,
                returned: q.next.into(),
            });
        }
        let offer = std::sync::Arc::new(SteerOffer {
            from: at.from.clone(),
            queues,
            phase: FUNCTION.into(),
            end: false.into(),
            complete_checksums: at.complete_checksums,
        });
        let mut steering = Steering::new(offer)?;
        let map = shm::map_steer_page(page.as_fd())
            .map_err(|e| format!("the lent steered input's page: {e}"))?;
        steering.header = Some((page, map));
        Ok(steering)
    }

    pub fn sent(&self) -> bool {
        self.header.is_some()
    }

    /// The message and descriptors that hand the sockets to the function: the header page,
    /// then each queue's socket and UMEM.
    pub fn message(&mut self) -> std::io::Result<(serde_json::Value, Vec<RawFd>)> {
        let (fd, map) = shm::new_steer_page()?;
        let queues: Vec<serde_json::Value> = (self.offer.queues.iter())
            .map(|q| {
                serde_json::json!({
                    "ring_size": q.ring_size,
                    "start": q.start,
                    "umem_len": q.umem_len,
                })
            })
            .collect();
        let mut fds = vec![fd.as_raw_fd()];
        for q in &self.offer.queues {
            fds.extend([q.socket.as_raw_fd(), q.umem.as_raw_fd()]);
        }
        let message = serde_json::json!({ "steer": { "queues": queues } });
        self.header = Some((fd, map));
        Ok((message, fds))
    }

    /// Takes steered descriptor `d` back: it must name the next frame of its queue. A
    /// forwarded frame is copied into a packet of the pool for `out`.
    #[inline]
    pub fn take(
        &mut self,
        d: &Desc,
        out: &mut Option<&mut stitch_core::link::Producer>,
        taken: &mut Taken,
    ) {
        let Some(q) = self.queues.get_mut(d.offset as usize) else {
            taken.bad += 1;
            return;
        };
        // The next frame, and one the kernel has put in the ring: what the interface puts
        // back in its fill ring never goes past what it received.
        let next = q.rx.position();
        if q.received.wrapping_sub(next) as i32 <= 0 {
            q.received = q.rx.produced();
        }
        if d.buffer != next || q.received.wrapping_sub(next) as i32 <= 0 {
            taken.bad += 1;
            return;
        }
        let (addr, len) = q.rx.desc(0);
        q.rx.read_past(1);
        if d.flags & FLAG_DROP != 0 {
            return;
        }
        let frame = usize::try_from(addr)
            .ok()
            .and_then(|at| q.umem.bytes(at, len as usize));
        let Some(frame) = frame.filter(|f| f.len() >= 14) else {
            taken.bad += 1;
            return;
        };
        let Some(mut p): Option<Packet> = pool::alloc() else {
            taken.exhausted += 1;
            return;
        };
        if p.set_data(frame).is_err() {
            taken.bad += 1;
            return;
        }
        if self.offer.complete_checksums {
            stitch_wire::offload::complete_if_partial(p.data_mut());
        }
        taken.forwarded += 1;
        taken.steered += 1;
        if let Some(o) = out.as_mut() {
            o.transmit(p);
        }
    }

    /// Tells the interface how far the function's frames came back.
    pub fn publish(&self) {
        for (q, o) in self.queues.iter().zip(&self.offer.queues) {
            o.returned.store(q.rx.position(), Ordering::Release);
        }
    }

    fn header(&self) -> Option<&SteerHeader> {
        self.header.as_ref().and_then(|(_, m)| m.steer_header())
    }

    /// Follows the hand-back once the interface asked for its rings: passes `end` on, then
    /// waits for the function to stop and for its last frames (published on `from_nf` before
    /// it said so) to be taken; calls `ring` once (the function's doorbell), so that a
    /// sleeping function hears it.
    /// True once done.
    pub fn hand_back(&mut self, from_nf: &crate::shm::Consumer, ring: impl FnOnce()) -> bool {
        let Some(h) = self.header() else {
            return true;
        };
        if h.end.0.load(Ordering::Relaxed) == 0 {
            h.end.0.store(1, Ordering::Release);
            // A blocking function asleep would not see it before its next packet.
            ring();
        }
        if self.stopped_at.is_none() && h.reader.0.load(Ordering::Acquire) == 2 {
            // The head read after the function said it stopped covers all it gave back.
            let Some(n) = from_nf.available() else {
                return true;
            };
            self.stopped_at = Some(from_nf.position().wrapping_add(n));
        }
        self.stopped_at
            .is_some_and(|at| (from_nf.position().wrapping_sub(at) as i32) >= 0)
    }
}
