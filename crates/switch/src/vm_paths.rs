//! The inter-VNF bypass (docs/references.md) for VMs on the switch's side: when the rules make VM
//! port A → VM port B point to point, the switch offers A a direct path into B's receive ring
//! ([`stitch_vhost::direct`]), follows its switch-over, counts what crosses it in the flow's,
//! tables' and ports' OpenFlow statistics, and ends it when the rules, the ports or the guests no
//! longer allow it. Both directions are independent.

use crate::pipeline::P2p;
use crate::Switch;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_core::app::Io;
use stitch_core::link::Ring;
use stitch_vhost::direct::{self, VmDirect, VmPort};

/// A direct path the switch gave VM port A (feeding input `from`) into VM port B (fed by
/// output `to`).
pub(crate) struct VmPath {
    pub direct: Arc<VmDirect>,
    pub from: usize,
    pub to: usize,
    pub p2p: P2p,
    /// Packets and bytes of the path already added to the statistics.
    pub counted: (u64, u64),
    pub handover_reported: bool,
}

fn vm_port(tag: Option<&stitch_core::link::EndTag>) -> Option<Arc<VmPort>> {
    tag.and_then(|t| t.get::<VmPort>())
}

/// The two VM ports a pair joins, as the links say now, and the link toward B.
fn vm_ends(io: &mut Io, from: usize, to: usize) -> Option<(Arc<VmPort>, Arc<VmPort>, Arc<Ring>)> {
    let a = vm_port(io.input(from)?.ring().producer_end())?;
    let out = io.output(to)?;
    let b = vm_port(out.ring().consumer_end())?;
    (!Arc::ptr_eq(&a, &b)).then(|| (a, b, out.ring().clone()))
}

/// Whether A's guest may send straight into B's: both ports without policies of their own,
/// both guests there, and whatever A's guest may send acceptable to B's as it is. `None`
/// while a port's device is busy (asked again later).
fn joinable(a: &VmPort, b: &VmPort) -> Option<bool> {
    let ((fa, live_a), (fb, live_b)) = (a.guest()?, b.guest()?);
    Some(a.plain && b.plain && live_a && live_b && direct::offloads_fit(fa, fb))
}

impl Switch {
    /// Counts what crossed each path, retires those done and ends those the rules or the
    /// ports no longer allow; returns how many carry traffic.
    pub(crate) fn review_vm_paths(&mut self, io: &mut Io) -> u64 {
        let mut in_use = 0;
        let mut i = 0;
        while i < self.vm_paths.len() {
            let path = &mut self.vm_paths[i];
            let d = path.direct.clone();
            let now = (
                d.packets.load(Ordering::Relaxed),
                d.bytes.load(Ordering::Relaxed),
            );
            let (p, b) = (now.0 - path.counted.0, now.1 - path.counted.1);
            path.counted = now;
            let (from, to, p2p) = (path.from, path.to, path.p2p.clone());
            if p > 0 {
                self.count_crossing(&p2p, from, to, p, b);
            }
            let path = &mut self.vm_paths[i];
            let took = d.handover_ns.load(Ordering::Relaxed);
            if !path.handover_reported && took > 0 {
                path.handover_reported = true;
                self.counters.handover_ns.set(took);
            }
            if d.phase() == direct::RETIRED {
                (self.counters.handback_ns).set(d.handback_ns.load(Ordering::Relaxed));
                self.vm_paths.swap_remove(i);
                continue;
            }
            let still = match &self.direct[from] {
                Some(now) if now.out as usize - 1 == to => {
                    self.vm_paths[i].p2p = now.clone();
                    vm_ends(io, from, to).is_some_and(|(a, b, _)| {
                        Arc::ptr_eq(&a, &d.from)
                            && Arc::ptr_eq(&b, &d.to)
                            && joinable(&a, &b) != Some(false)
                    })
                }
                _ => false,
            };
            if !still {
                d.end();
            } else if d.phase() == direct::DIRECT {
                in_use += 1;
            }
            i += 1;
        }
        in_use
    }

    /// A path for each point-to-point pair of VM ports that has none.
    pub(crate) fn offer_vm_paths(&mut self, io: &mut Io) {
        for from in 0..self.direct.len() {
            let Some(p2p) = self.direct[from].clone() else {
                continue;
            };
            let to = p2p.out as usize - 1;
            if self.vm_paths.iter().any(|v| v.from == from) {
                continue; // One at a time: an ending path retires first.
            }
            let Some((a, b, to_link)) = vm_ends(io, from, to) else {
                continue;
            };
            if joinable(&a, &b) != Some(true) || a.slot.lock().unwrap().is_some() {
                continue;
            }
            let d = VmDirect::new(a.clone(), b.clone(), to_link);
            a.offer(d.clone());
            log::info!(
                "switch `{}`: direct path {} -> {} (ports {} -> {})",
                self.shared.name,
                a.shared.name,
                b.shared.name,
                from + 1,
                p2p.out
            );
            self.vm_paths.push(VmPath {
                direct: d,
                from,
                to,
                p2p,
                counted: (0, 0),
                handover_reported: false,
            });
        }
    }

    /// After a push: each path waiting for the switch learns what it consumed of A's link
    /// and sent toward B.
    pub(crate) fn vm_paths_progress(&self, io: &mut Io) {
        for v in &self.vm_paths {
            let consumed = io.input(v.from).map(|i| i.ring().rx_packets());
            let sent = io.output(v.to).map(|o| o.ring().tx_packets());
            if let (Some(consumed), Some(sent)) = (consumed, sent) {
                v.direct.switch_progress(consumed, sent);
            }
        }
    }

    pub(crate) fn vm_paths_json(&self) -> Vec<serde_json::Value> {
        (self.vm_paths.iter())
            .map(|v| {
                let d = &v.direct;
                let phase = [
                    "Offered",
                    "DrainingA",
                    "DrainingSwitch",
                    "Direct",
                    "Retired",
                ]
                .get(d.phase() as usize);
                serde_json::json!({
                    "from": d.from.shared.name, "to": d.to.shared.name,
                    "ports": [v.from + 1, v.to + 1],
                    "phase": phase,
                    "packets": d.packets.load(Ordering::Relaxed),
                    "too_big_drops": d.too_big.load(Ordering::Relaxed),
                })
            })
            .collect()
    }
}
