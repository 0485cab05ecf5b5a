//! The data path: a burst from a receive ring into packets of the pool, and a burst of packets
//! into the transmit ring, each frame copied between the UMEM and the pool once. Pure functions
//! of the rings, the UMEM and a link, so that they are tested against rings in plain memory.

use super::socket::FRAME_SIZE;
use crate::netdev;
use stitch_core::mapping::Mapping;
use stitch_core::{Consumer, Producer};
use stitch_wire::offload;
use stitch_xsk::Ring;

/// The most frames one call takes or sends.
pub(super) const BURST: usize = 256;

/// The shortest frame taken: an Ethernet header.
const MIN_FRAME: usize = 14;

/// What one [`receive`] did, for the app's counters.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Received {
    /// Frames taken from the receive ring (all given back to the fill ring).
    pub frames: u64,
    /// Packets queued on the link.
    pub made: usize,
    /// Frames outside the UMEM or shorter than an Ethernet header.
    pub malformed: u64,
    /// Frames dropped because the pool had no packet for them.
    pub exhausted: u64,
    /// Frames dropped because there was no link to queue them on.
    pub unlinked: u64,
    pub checksums_completed: u64,
}

/// Takes up to `budget` frames from receive ring `rx` into packets queued on `out` (dropped
/// and counted without `out`), giving every frame's chunk back to fill ring `fill` once its
/// data are copied. `budget` is at most `out`'s room.
pub(super) fn receive(
    umem: &Mapping,
    fill: &mut Ring,
    rx: &mut Ring,
    out: Option<&mut Producer>,
    budget: usize,
    complete_checksums: bool,
) -> Received {
    let n = rx.ready().min(fill.free()).min(budget as u32);
    if n == 0 {
        return Received::default();
    }
    let mut r = Received {
        frames: u64::from(n),
        ..Received::default()
    };
    // The kernel wrote the descriptors; a frame outside the UMEM is a broken ring.
    let frame = |(addr, len): (u64, u32)| {
        usize::try_from(addr)
            .ok()
            .and_then(|at| umem.bytes(at, len as usize))
            .filter(|b| b.len() >= MIN_FRAME)
    };
    // One pass over the descriptors: every chunk back to the fill ring (published below, once
    // the data are copied), and the frames a packet will be made of counted.
    let mut good = 0;
    for k in 0..n {
        let d = rx.desc(k);
        fill.set_addr(k, d.0 & !(u64::from(FRAME_SIZE) - 1));
        good += usize::from(frame(d).is_some());
    }
    match out {
        None => r.unlinked = u64::from(n),
        Some(out) => {
            r.malformed = u64::from(n) - good as u64;
            let ts = stitch_core::packet::now_ns();
            let usual_len = rx.desc(0).1 as usize;
            let mut next = 0u32;
            let mut completed = 0;
            r.made = out.transmit_fresh(good, usual_len, |p| {
                let bytes = loop {
                    let f = frame(rx.desc(next));
                    next += 1;
                    if let Some(b) = f {
                        break b;
                    }
                };
                // A UMEM chunk (FRAME_SIZE) fits any pool buffer, which holds jumbo frames.
                let _ = p.set_data(bytes);
                p.set_timestamp_ns(ts);
                if complete_checksums && offload::complete_if_partial(p.data_mut()) {
                    completed += 1;
                }
            });
            r.checksums_completed = completed;
            r.exhausted = (good - r.made) as u64;
        }
    }
    rx.consume(n);
    fill.submit(n);
    r
}

/// What one [`transmit`] did, for the app's counters.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Sent {
    /// Frames put in the transmit ring.
    pub frames: u32,
    /// Packets whose checksum could not be completed, or that do not fit a frame.
    pub malformed: u64,
    /// Frames longer than the interface takes.
    pub too_big: u64,
    /// Packets were left on the link for want of room in the ring or of free frames.
    pub full: bool,
}

/// Copies up to a burst of packets from `input` into free frames `tx_free` of the UMEM and
/// submits them to transmit ring `tx`; a super-frame is cut into segments here, taken only
/// when they all fit.
pub(super) fn transmit(
    umem: &Mapping,
    tx: &mut Ring,
    tx_free: &mut Vec<u64>,
    input: &mut Consumer,
    max_frame: usize,
) -> Sent {
    let room = (tx.free() as usize).min(tx_free.len()).min(BURST);
    let mut s = Sent::default();
    let mut n = 0u32;
    loop {
        let need = match input.peek() {
            None => break,
            Some(p) if p.header().gso_size > 0 => p.len() / p.header().gso_size as usize + 1,
            Some(_) => 1,
        };
        if n as usize + need > room {
            break;
        }
        let p = input.receive().expect("peeked");
        let r = offload::resolve_gso(p, |mut seg| {
            if offload::complete_checksum(&mut seg).is_err() || seg.len() > FRAME_SIZE as usize {
                s.malformed += 1;
                return;
            }
            if netdev::frame_too_big(seg.data(), max_frame) {
                s.too_big += 1;
                return;
            }
            let addr = tx_free.pop().expect("room counted above");
            // Free frames are whole FRAME_SIZE chunks of the UMEM and the segment fits one.
            let written = umem.write(addr as usize, seg.data());
            debug_assert!(written, "transmit frames lie inside the UMEM");
            tx.set_desc(n, addr, seg.len() as u32);
            n += 1;
        });
        if r.is_err() {
            s.malformed += 1;
        }
    }
    if n > 0 {
        tx.submit(n);
    }
    s.frames = n;
    s.full = !input.is_empty() && room == 0;
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::link;
    use stitch_core::Packet;
    use stitch_xsk::ring::testing::{kernel_view, ring, start_at};
    use stitch_xsk::RingKind;

    const FRAMES: u32 = 16;

    /// A socket's receive side in plain memory: the UMEM, the fill and receive rings, and the
    /// kernel's view of both.
    struct Rx {
        umem: Mapping,
        fill: Ring,
        rx: Ring,
        kernel_fill: Ring,
        nic: Ring,
    }

    fn rx_side(start: u32) -> Rx {
        let (_, umem) =
            Mapping::create("af-xdp-test-umem", (FRAMES * FRAME_SIZE) as usize).unwrap();
        let (mut fill, fill_fd) = ring(8, RingKind::Fill);
        let mut kernel_fill = kernel_view(&fill_fd, 8, RingKind::Fill);
        let (mut rx, rx_fd) = ring(8, RingKind::Rx);
        let mut nic = kernel_view(&rx_fd, 8, RingKind::Rx);
        start_at(&mut fill, &mut kernel_fill, start);
        start_at(&mut rx, &mut nic, start);
        Rx {
            umem,
            fill,
            rx,
            kernel_fill,
            nic,
        }
    }

    impl Rx {
        /// The kernel receives `frames` (address, bytes) into the UMEM.
        fn arrive(&mut self, frames: &[(u64, Vec<u8>)]) {
            let mut descs = Vec::new();
            for (addr, bytes) in frames {
                let _ = self.umem.write(*addr as usize, bytes);
                descs.push((*addr, bytes.len() as u32));
            }
            self.describe(&descs);
        }

        /// The kernel puts descriptors (address, length) in the receive ring.
        fn describe(&mut self, descs: &[(u64, u32)]) {
            for (k, &(addr, len)) in descs.iter().enumerate() {
                self.nic.set_desc(k as u32, addr, len);
            }
            self.nic.submit(descs.len() as u32);
        }
    }

    fn frame(tag: u8, len: usize) -> Vec<u8> {
        let mut f = vec![tag; len];
        f[12..14].copy_from_slice(&[0x88, 0xb5]); // IEEE local experimental: no checksum
        f
    }

    #[test]
    fn a_burst_becomes_packets_in_order_and_every_chunk_goes_back_to_the_fill_ring() {
        for start in [0, u32::MAX - 3] {
            let mut s = rx_side(start);
            s.arrive(&[
                (0, frame(1, 60)),
                (FRAME_SIZE as u64 + 256, frame(2, 1514)),
                (2 * FRAME_SIZE as u64, frame(3, 64)),
            ]);
            let (mut tx, mut out) = link(16);
            let r = receive(&s.umem, &mut s.fill, &mut s.rx, Some(&mut tx), 16, true);
            assert_eq!((r.frames, r.made, r.malformed), (3, 3, 0));
            let got: Vec<(u8, usize)> = std::iter::from_fn(|| out.receive())
                .map(|p: Packet| (p.data()[0], p.len()))
                .collect();
            assert_eq!(got, [(1, 60), (2, 1514), (3, 64)]);
            assert_eq!(s.nic.free(), 8, "the receive ring is consumed");
            let back: Vec<u64> = (0..s.kernel_fill.ready())
                .map(|k| s.kernel_fill.addr(k))
                .collect();
            // Chunks, not the frame's own address inside its chunk.
            assert_eq!(back, [0, FRAME_SIZE as u64, 2 * FRAME_SIZE as u64]);
        }
    }

    #[test]
    fn frames_outside_the_umem_or_too_short_are_counted_and_their_chunks_still_go_back() {
        let mut s = rx_side(0);
        let _ = s.umem.write(0, &frame(1, 60));
        let _ = s.umem.write(3 * FRAME_SIZE as usize, &frame(4, 60));
        // A frame too short for an Ethernet header, and one running 50 bytes past the UMEM.
        let beyond = u64::from(FRAMES * FRAME_SIZE) - 10;
        s.describe(&[
            (0, 60),
            (FRAME_SIZE as u64, 10),
            (beyond, 60),
            (3 * FRAME_SIZE as u64, 60),
        ]);
        let (mut tx, mut out) = link(16);
        let r = receive(&s.umem, &mut s.fill, &mut s.rx, Some(&mut tx), 16, false);
        assert_eq!((r.frames, r.made, r.malformed), (4, 2, 2));
        let tags: Vec<u8> = std::iter::from_fn(|| out.receive())
            .map(|p| p.data()[0])
            .collect();
        assert_eq!(tags, [1, 4]);
        assert_eq!(s.kernel_fill.ready(), 4, "no chunk leaks");
    }

    #[test]
    fn without_a_link_frames_are_dropped_and_counted_and_the_budget_is_kept() {
        let mut s = rx_side(7);
        let frames: Vec<(u64, Vec<u8>)> = (0..6)
            .map(|i| (u64::from(i * FRAME_SIZE), frame(i as u8, 60)))
            .collect();
        s.arrive(&frames);
        let r = receive(&s.umem, &mut s.fill, &mut s.rx, None, 4, false);
        assert_eq!((r.frames, r.unlinked, r.made), (4, 4, 0));
        assert_eq!(s.rx.ready(), 2, "the rest waits for the next breath");
        let (mut tx, _out) = link(16);
        let r = receive(&s.umem, &mut s.fill, &mut s.rx, Some(&mut tx), 16, false);
        assert_eq!((r.frames, r.made), (2, 2));
        assert_eq!(s.kernel_fill.ready(), 6);
    }

    #[test]
    fn a_transmit_burst_fills_free_frames_and_stops_when_the_ring_is_full() {
        let (_, umem) =
            Mapping::create("af-xdp-test-umem", (FRAMES * FRAME_SIZE) as usize).unwrap();
        let (mut tx, tx_fd) = ring(4, RingKind::Tx);
        let mut kernel = kernel_view(&tx_fd, 4, RingKind::Tx);
        start_at(&mut tx, &mut kernel, u32::MAX);
        let mut tx_free: Vec<u64> = (8..FRAMES).map(|i| u64::from(i * FRAME_SIZE)).collect();
        let (mut feed, mut input) = link(16);
        for i in 0..6u8 {
            let mut p = stitch_core::pool::alloc().unwrap();
            p.set_data(&frame(i, 100 + usize::from(i))).unwrap();
            feed.transmit(p);
        }
        let s = transmit(&umem, &mut tx, &mut tx_free, &mut input, 1518);
        assert_eq!((s.frames, s.malformed, s.full), (4, 0, false));
        assert_eq!(kernel.ready(), 4);
        for k in 0..4 {
            let (addr, len) = kernel.desc(k);
            assert_eq!(len, 100 + k);
            assert_eq!(umem.bytes(addr as usize, 1).unwrap()[0], k as u8);
        }
        // The ring is full: nothing moves, and the app hears so.
        let s = transmit(&umem, &mut tx, &mut tx_free, &mut input, 1518);
        assert_eq!((s.frames, s.full), (0, true));
        assert_eq!(input.available(), 2);
        kernel.consume(4);
        let s = transmit(&umem, &mut tx, &mut tx_free, &mut input, 1518);
        assert_eq!((s.frames, s.full), (2, false));
        assert_eq!(tx_free.len(), 2);
    }

    #[test]
    fn a_frame_longer_than_the_interface_takes_is_dropped_and_counted() {
        let (_, umem) =
            Mapping::create("af-xdp-test-umem", (FRAMES * FRAME_SIZE) as usize).unwrap();
        let (mut tx, _tx_fd) = ring(4, RingKind::Tx);
        let mut tx_free: Vec<u64> = (8..FRAMES).map(|i| u64::from(i * FRAME_SIZE)).collect();
        let (mut feed, mut input) = link(16);
        for len in [1600, 60] {
            let mut p = stitch_core::pool::alloc().unwrap();
            p.set_data(&frame(1, len)).unwrap();
            feed.transmit(p);
        }
        let s = transmit(&umem, &mut tx, &mut tx_free, &mut input, 1518);
        assert_eq!((s.frames, s.too_big), (1, 1));
        assert_eq!(tx_free.len(), 7, "the dropped frame took no UMEM frame");
    }
}
