//! Packets leaving by each port: queued during a push, handed to the links a batch at a time.

use stitch_core::app::Io;
use stitch_core::Packet;

/// The packets going out by each port, queued on its link a batch at a time (one index update
/// per batch, not per packet), and per port the packets, bytes and drops sent since the last
/// flush.
pub(super) struct Outbox {
    pub(super) staged: Vec<Vec<Packet>>,
    pub(super) counts: Vec<[u64; 3]>,
}

impl Outbox {
    pub(super) fn new(ports: usize) -> Self {
        Outbox {
            staged: (0..ports).map(|_| Vec::with_capacity(256)).collect(),
            counts: vec![[0; 3]; ports],
        }
    }

    /// Where OpenFlow port `port`'s packets are queued (ports are numbered from 1).
    #[inline]
    pub(super) fn slot(&self, port: u32) -> Option<usize> {
        (port as usize)
            .checked_sub(1)
            .filter(|i| *i < self.staged.len())
    }

    /// Queues `p` for OpenFlow port `port` (another number drops it).
    #[inline]
    pub(super) fn put(&mut self, p: Packet, port: u32) {
        if let Some(i) = self.slot(port) {
            self.staged[i].push(p);
        }
    }

    /// Hands the queued packets to the ports' links; those that do not fit are dropped.
    pub(super) fn send(&mut self, io: &mut Io) {
        for (i, (staged, t)) in self.staged.iter_mut().zip(&mut self.counts).enumerate() {
            if staged.is_empty() {
                continue;
            }
            let n = staged.len() as u64;
            match io.output(i) {
                Some(o) => {
                    let (sent, bytes) = o.transmit_batch_counted(staged);
                    t[0] += sent as u64;
                    t[1] += bytes;
                    t[2] += n - sent as u64;
                }
                None => {
                    t[2] += n;
                    stitch_core::pool::free_batch(staged.drain(..));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::link;

    fn packet(len: usize) -> Packet {
        let mut p = stitch_core::pool::alloc().unwrap();
        p.set_data(&vec![1; len]).unwrap();
        p
    }

    #[test]
    fn queued_packets_leave_by_their_ports_and_what_does_not_fit_is_counted_as_dropped() {
        let (small, mut to_small) = link(4);
        let (big, mut to_big) = link(16);
        let mut io = Io::new(vec![], vec![("a".into(), small), ("b".into(), big)]);
        // Three ports, two of them linked.
        let mut out = Outbox::new(3);
        for _ in 0..6 {
            out.put(packet(100), 1);
        }
        out.put(packet(60), 2);
        out.put(packet(60), 3);
        // No such OpenFlow ports: dropped at once.
        out.put(packet(60), 0);
        out.put(packet(60), 4);
        out.send(&mut io);
        assert_eq!(out.counts, [[4, 400, 2], [1, 60, 0], [0, 0, 1]]);
        assert_eq!((to_small.available(), to_big.available()), (4, 1));
        assert!(out.staged.iter().all(Vec::is_empty), "nothing left queued");
        // Counts add up over sends until the app takes them.
        out.put(packet(10), 2);
        out.send(&mut io);
        assert_eq!(out.counts[1], [2, 70, 0]);
    }
}
