//! The inter-VNF bypass (docs/references.md): when the pipeline sends all of a port's traffic to
//! one other port, the packets move ring to ring in whole batches; when both ends are zero-copy
//! function ports, the two functions get a direct channel ([`stitch_nf::direct`]) — the first
//! writes its packets straight to the second's — taken back when the rules change or a function
//! leaves. Both hand-overs are ordered and lossless; what crosses a channel is still counted in the
//! entries', tables' and ports' OpenFlow statistics (counter `direct_channels`: channels in use).

use crate::pipeline::P2p;
use crate::Switch;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_core::app::Io;
use stitch_nf::direct::{Direct, Phase};
use stitch_nf::listener::PortShared;

/// A direct channel the switch gave two function ports: traffic from input `from` that the
/// pipeline sends to output `to`.
pub(crate) struct Channel {
    pub direct: Arc<Direct>,
    pub from: usize,
    pub to: usize,
    pub p2p: P2p,
    pub handover_reported: bool,
    /// The channel's packets and bytes already added to the statistics.
    pub counted: (u64, u64),
}

/// The function port at a link end, if it is one.
fn function_port(tag: Option<&stitch_core::link::EndTag>) -> Option<Arc<PortShared>> {
    tag.and_then(|t| t.get::<PortShared>())
}

/// The two function ports a pair joins, as the links say now: the one feeding input `from` and
/// the one fed by output `to`.
fn channel_ends(io: &mut Io, from: usize, to: usize) -> Option<(Arc<PortShared>, Arc<PortShared>)> {
    let a = function_port(io.input(from)?.ring().producer_end())?;
    let b = function_port(io.output(to)?.ring().consumer_end())?;
    (!Arc::ptr_eq(&a, &b)).then_some((a, b))
}

impl Switch {
    /// A point-to-point port: whole batches move ring to ring without a lookup per packet,
    /// in order, with back-pressure instead of drops; flow and port counters count them all.
    pub(crate) fn forward_direct(&mut self, io: &mut Io, from: usize, p2p: &P2p) {
        let to = p2p.out as usize - 1;
        let (input, output) = io.pair(from, to);
        let (Some(input), Some(output)) = (input, output) else {
            return;
        };
        let before = output.ring().stats().tx_bytes;
        let n = input.forward_to(output) as u64;
        if n == 0 {
            return;
        }
        let bytes = output.ring().stats().tx_bytes - before;
        self.count_passing(p2p, n, bytes);
        let (rx, tx) = (
            &self.shared.port_counters[from],
            &self.shared.port_counters[to],
        );
        rx.rx_packets.fetch_add(n, Ordering::Relaxed);
        rx.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
        tx.tx_packets.fetch_add(n, Ordering::Relaxed);
        tx.tx_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.counters.direct_packets.add(n);
    }

    /// Counts packets that crossed a point-to-point pair in every entry and table they passed.
    fn count_passing(&self, p2p: &P2p, n: u64, bytes: u64) {
        let now = self.shared.now_ns();
        for e in p2p.via.iter().chain(std::iter::once(&p2p.entry)) {
            e.packets.fetch_add(n, Ordering::Relaxed);
            e.bytes.fetch_add(bytes, Ordering::Relaxed);
            e.last_used_ns.store(now, Ordering::Relaxed);
            let t = &self.shared.table_counters[e.table as usize];
            t.lookups.fetch_add(n, Ordering::Relaxed);
            t.matched.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Counts `p` packets and `b` bytes that crossed from input `from` to output `to` by a
    /// direct channel or path: in the entries and tables they passed, the ports, and
    /// `direct_channel_packets`.
    pub(crate) fn count_crossing(&mut self, p2p: &P2p, from: usize, to: usize, p: u64, b: u64) {
        self.count_passing(p2p, p, b);
        let pc = &self.shared.port_counters;
        pc[from].rx_packets.fetch_add(p, Ordering::Relaxed);
        pc[from].rx_bytes.fetch_add(b, Ordering::Relaxed);
        pc[to].tx_packets.fetch_add(p, Ordering::Relaxed);
        pc[to].tx_bytes.fetch_add(b, Ordering::Relaxed);
        self.counters.channel_packets.add(p);
    }

    /// Gives point-to-point pairs of function ports a direct channel, takes back those the
    /// rules or the functions no longer allow, counts what crossed them.
    pub(crate) fn manage_channels(&mut self, io: &mut Io) {
        let in_use = self.review_channels(io) + self.review_vm_paths(io);
        self.counters.channels_in_use.set(in_use);
        if self.offers_direct {
            // A VM path is handed over at an upgrade, a functions' channel is not.
            if !self.handing_over {
                self.offer_channels(io);
            }
            self.offer_vm_paths(io);
        }
    }

    /// Counts what crossed each channel, retires those done and ends those the rules or the
    /// functions no longer allow; returns how many carry traffic.
    fn review_channels(&mut self, io: &mut Io) -> u64 {
        let mut in_use = 0;
        let mut i = 0;
        while i < self.channels.len() {
            let c = &mut self.channels[i];
            let now = c.direct.counts();
            let (p, b) = (now.0 - c.counted.0, now.1 - c.counted.1);
            c.counted = now;
            if p > 0 {
                let (p2p, from, to) = (c.p2p.clone(), c.from, c.to);
                self.count_crossing(&p2p, from, to, p, b);
            }
            let c = &mut self.channels[i];
            let phase = c.direct.phase();
            if !c.handover_reported && c.direct.handover_ns.load(Ordering::Relaxed) > 0 {
                c.handover_reported = true;
                self.counters
                    .handover_ns
                    .set(c.direct.handover_ns.load(Ordering::Relaxed));
            }
            if phase == Phase::Retired {
                self.counters
                    .handback_ns
                    .set(c.direct.handback_ns.load(Ordering::Relaxed));
                self.channels.swap_remove(i);
                continue;
            }
            let still = match &self.direct[c.from] {
                Some(p2p) if p2p.out as usize - 1 == c.to => {
                    c.p2p = p2p.clone();
                    let current =
                        |p: &PortShared| p.current.lock().unwrap().as_ref().map(|c| c.generation);
                    let (from, to) = (c.from, c.to);
                    let d = c.direct.clone();
                    channel_ends(io, from, to).is_some_and(|(a, b)| {
                        Arc::ptr_eq(&a, &d.from)
                            && Arc::ptr_eq(&b, &d.to)
                            && current(&a) == Some(d.sender.generation)
                            && current(&b) == Some(d.receiver.generation)
                    })
                }
                _ => false,
            };
            if !still || self.handing_over {
                c.direct.end();
            } else if phase == Phase::ReceiverReads {
                in_use += 1;
            }
            i += 1;
        }
        in_use
    }

    /// A channel for each point-to-point pair of function ports that has none.
    fn offer_channels(&mut self, io: &mut Io) {
        for from in 0..self.direct.len() {
            let Some(p2p) = self.direct[from].clone() else {
                continue;
            };
            let (out, to) = (p2p.out, p2p.out as usize - 1);
            if self.channels.iter().any(|c| c.from == from || c.to == to) {
                continue; // One at a time per port: an ending channel retires first.
            }
            let Some((a, b)) = channel_ends(io, from, to) else {
                continue;
            };
            let (mut sa, mut sb) = (a.direct.lock().unwrap(), b.direct.lock().unwrap());
            if sa.outgoing.is_some() || sb.incoming.is_some() {
                continue;
            }
            // Room for a few milliseconds of traffic: the sender gets slots back only once
            // Stitch accounted them, and on a loaded machine its thread may wait that long.
            let size = (a.settings.ring_size * 4).clamp(4096, 65536);
            match Direct::new(&a, &b, size) {
                Ok(d) => {
                    sa.outgoing = Some(d.clone());
                    sb.incoming = Some(d.clone());
                    drop((sa, sb));
                    a.changed.store(true, Ordering::Release);
                    b.changed.store(true, Ordering::Release);
                    log::info!(
                        "switch `{}`: direct channel {} -> {} (ports {} -> {})",
                        self.shared.name,
                        a.name,
                        b.name,
                        from + 1,
                        out
                    );
                    self.channels.push(Channel {
                        direct: d,
                        from,
                        to,
                        p2p,
                        handover_reported: false,
                        counted: (0, 0),
                    });
                }
                Err(e) => log::debug!("switch `{}`: no direct channel: {e}", self.shared.name),
            }
        }
    }

    pub(crate) fn channels_json(&self) -> Vec<serde_json::Value> {
        self.channels
            .iter()
            .map(|c| {
                serde_json::json!({
                    "from": c.direct.from.name, "to": c.direct.to.name,
                    "ports": [c.from + 1, c.to + 1],
                    "phase": format!("{:?}", c.direct.phase()),
                    // Descriptors the receiving function read that named a buffer the sender
                    // did not hold (ignored, counted).
                    "bad_descriptors": c.direct.bad.load(Ordering::Relaxed),
                })
            })
            .collect()
    }
}
