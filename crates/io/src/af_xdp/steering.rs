//! Steering: the rules (tcpdump expressions the XDP program runs), a socket per rule's port on
//! each queue sharing the queue's UMEM, changing the rules in place, and lending a port's
//! sockets to the zero-copy function port its link leads to (`stitch_xsk::lend`).

use super::socket::{Steered, FRAME_SIZE};
use super::{AfXdp, AfXdpConfig};
use serde::{Deserialize, Serialize};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::Io;
use stitch_xsk::lend::{self, RingBorrower, SteerOffer, SteerQueue};
use stitch_xsk::ring::refill_from;

/// A frame's chunk of the UMEM, as the rings' addresses are rounded to.
const FRAME: u64 = FRAME_SIZE as u64;

/// Frames `filter` matches leave by port `to` instead of `output`.
#[derive(schemars::JsonSchema, Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SteerRule {
    /// A filter expression, as tcpdump takes it.
    #[serde(rename = "match")]
    pub filter: String,
    /// The port of this app the matched frames leave by (a port besides `output`).
    pub to: String,
}

/// The steering rules of an `af_xdp` app's config as a graph holds it (none when it has
/// none, or when they do not parse: the app's own check says why).
pub fn steering_rules(config: &serde_json::Value) -> Vec<SteerRule> {
    config
        .get("steer")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// The ports `rules` send to, in the order they first appear (outputs 1, 2, …).
pub(super) fn steer_ports(rules: &[SteerRule]) -> Vec<String> {
    let mut ports: Vec<String> = Vec::new();
    for r in rules {
        if !ports.contains(&r.to) {
            ports.push(r.to.clone());
        }
    }
    ports
}

/// The most steering rules an interface takes (each one runs on every frame that the earlier
/// ones did not match).
pub(super) const MAX_RULES: usize = 32;

/// A steering port the rules no longer have: its socket on each queue (by queue index).
pub(super) struct Retiring {
    pub(super) sockets: Vec<(usize, Steered)>,
    pub(super) offer: Option<Offered>,
    /// When the program that sent it frames was replaced: a frame that program was
    /// redirecting then may land a moment later.
    pub(super) since: Instant,
}

/// Sockets of one steering port lent to a reader at the other end of its link (a function port).
pub(super) struct Offered {
    pub(super) offer: Arc<SteerOffer>,
    pub(super) to: Arc<dyn RingBorrower>,
}

/// One steering port's sockets and the function port its link leads to.
#[derive(Default)]
pub(super) struct Lending {
    /// Lent to that function port's function, until it is done with them.
    pub(super) offer: Option<Offered>,
    /// The function's attachment they were last offered to (not offered twice).
    pub(super) offered_to: Option<u64>,
    /// Taken over: a function read them in the predecessor; left alone until its port
    /// offers them back (or turns out not to have carried the function on).
    pub(super) awaiting: bool,
}

impl Lending {
    /// Whether a function reads the sockets, or may: this app leaves them alone.
    pub(super) fn away(&self) -> bool {
        self.awaiting || self.offer.is_some()
    }
}

impl AfXdp {
    /// Puts the frames functions gave back (up to each queue's `returned`) in the fill rings
    /// and moves the lent sockets' rings on past them — of every lent port, or of `only`.
    pub(super) fn take_back_from_functions(&mut self, only: Option<usize>) {
        for (s, x) in self.socks.iter_mut().enumerate() {
            let mut given_back = 0;
            for st in &mut x.steered {
                let port = st.output - 1;
                let Some(o) = &self.lending[port].offer else {
                    continue;
                };
                if only.is_none_or(|p| p == port) {
                    let upto = o.offer.queues[s].returned.load(Ordering::Acquire);
                    given_back += refill_from(&mut x.fill, &mut st.rx, upto, FRAME);
                }
            }
            if given_back > 0 {
                self.function_steered.add(u64::from(given_back));
                if x.fill.needs_wakeup() {
                    x.kick_rx();
                }
            }
        }
    }

    /// Offers steering port `port`'s sockets to the zero-copy function port its link leads
    /// to, once per attachment of a function there; asks for them back when the link no
    /// longer leads there; forgets an offer the port is done with (this app reads the
    /// sockets again from where the function's frames came back).
    pub(super) fn follow_offer(&mut self, port: usize, io: &mut Io) {
        let linked = io
            .output(port + 1)
            .and_then(|o| o.ring().consumer_end()?.get::<Arc<dyn RingBorrower>>())
            .map(|b| Arc::clone(&*b));
        if let Some(o) = &self.lending[port].offer {
            if o.offer.phase() == lend::DONE {
                // Its last frames first, then the sockets are this app's again.
                self.take_back_from_functions(Some(port));
                self.lending[port].offer = None;
            } else if linked.is_none_or(|to| !Arc::ptr_eq(&to, &o.to)) {
                o.offer.end.store(true, Ordering::Release);
            }
            return;
        }
        if self.lending[port].awaiting {
            self.take_on_offer(port, linked);
            return;
        }
        let Some(to) = linked else { return };
        let generation = to.reader();
        if generation.is_none() || generation == self.lending[port].offered_to {
            return;
        }
        let mut slot = to.offer_slot().lock().unwrap();
        if slot.is_some() {
            return; // A predecessor's offer is still being handed back.
        }
        let Some(offer) = self.offer(port) else {
            return;
        };
        *slot = Some(offer.clone());
        drop(slot);
        to.notify();
        self.lending[port].offered_to = generation;
        self.lending[port].offer = Some(Offered { offer, to });
    }

    /// Taken over: the function port that read steering port `port`'s rings in the
    /// predecessor offers them again from its slot (its successor carried the function on);
    /// if its slot holds nothing, or the port no longer leads to one, this app reads them.
    fn take_on_offer(&mut self, port: usize, linked: Option<Arc<dyn RingBorrower>>) {
        let Some(to) = linked else {
            // Its port tags the link on its first breath; a link to anything else (or none)
            // gets its frames from this app after a moment.
            if self.taken_over_at.elapsed() >= Duration::from_secs(1) {
                self.lending[port].awaiting = false;
            }
            return;
        };
        let l = &mut self.lending[port];
        l.awaiting = false;
        let offer = to.offer_slot().lock().unwrap().clone();
        let Some(offer) = offer.filter(|o| o.phase() == lend::FUNCTION) else {
            return;
        };
        l.offered_to = to.reader();
        l.offer = Some(Offered { offer, to });
    }

    /// Changes the steering rules in place: steering sockets of ports that stay are kept
    /// (with their rings and any function reading them), ports that are new get sockets, and
    /// the new program replaces the old one in one step once its maps are filled. Sockets of
    /// ports that go retire ([`Retiring`]). On an error nothing has changed.
    pub(super) fn change_rules(&mut self, c: &AfXdpConfig) -> Result<(), String> {
        let rules = c.steer_programs()?;
        let old_ports = steer_ports(&self.config.steer);
        let new_ports = steer_ports(&c.steer);
        // Sockets for the new ports first: a failure here leaves the running program alone.
        let mut opened: Vec<Vec<Option<Steered>>> = Vec::new();
        for x in &self.socks {
            let mut mine = Vec::new();
            for (p, name) in new_ports.iter().enumerate() {
                mine.push(match old_ports.contains(name) {
                    true => None,
                    false => Some(Steered::open(x, self.ifindex, p + 1)?),
                });
            }
            opened.push(mine);
        }
        let socket_of = |s: usize, port: &str| -> RawFd {
            let p = new_ports
                .iter()
                .position(|n| n == port)
                .expect("a rule's port");
            match &opened[s][p] {
                Some(st) => st.fd.as_raw_fd(),
                None => {
                    let old = old_ports.iter().position(|n| n == port).expect("kept");
                    let x = &self.socks[s];
                    let st = x
                        .steered
                        .iter()
                        .find(|t| t.output == old + 1)
                        .expect("kept");
                    st.fd.as_raw_fd()
                }
            }
        };
        let socks = &self.socks;
        self.xdp.replace_rules(&rules, |staged| {
            for (s, x) in socks.iter().enumerate() {
                staged.bind_queue(x.queue, x.fd.as_raw_fd())?;
                for (rule, r) in c.steer.iter().enumerate() {
                    staged.bind_steered(rule, x.queue, socket_of(s, &r.to))?;
                }
            }
            Ok(())
        })?;
        // The new program runs: each queue's sockets in the new ports' order.
        let mut lending: Vec<Lending> = new_ports.iter().map(|_| Lending::default()).collect();
        let mut retiring: Vec<Retiring> = Vec::new();
        for (old, name) in old_ports.iter().enumerate() {
            let l = std::mem::take(&mut self.lending[old]);
            match new_ports.iter().position(|n| n == name) {
                Some(p) => lending[p] = l,
                None => {
                    let offer = l.offer;
                    if let Some(o) = &offer {
                        o.offer.end.store(true, Ordering::Release);
                    }
                    retiring.push(Retiring {
                        sockets: Vec::new(),
                        offer,
                        since: Instant::now(),
                    });
                }
            }
        }
        for (s, (x, mut fresh)) in self.socks.iter_mut().zip(opened).enumerate() {
            let mut kept: Vec<Steered> = Vec::new();
            for mut st in std::mem::take(&mut x.steered) {
                let name = &old_ports[st.output - 1];
                match new_ports.iter().position(|n| n == name) {
                    Some(p) => {
                        st.output = p + 1;
                        kept.push(st);
                    }
                    None => {
                        let gone = old_ports.iter().filter(|n| !new_ports.contains(n));
                        let r = gone.clone().position(|n| n == name).expect("gone");
                        retiring[r].sockets.push((s, st));
                    }
                }
            }
            kept.extend(fresh.iter_mut().filter_map(Option::take));
            kept.sort_by_key(|st| st.output);
            x.steered = kept;
        }
        self.retiring.extend(retiring);
        self.lending = lending;
        log::info!(
            "af_xdp {}: {} steering rules to {:?} now",
            self.interface,
            c.steer.len(),
            new_ports
        );
        Ok(())
    }

    /// Retiring sockets: what a function gives back goes to the fill ring; once it is done
    /// (or none had them), the frames left in their rings too, counted, and they close.
    pub(super) fn retire(&mut self) {
        let mut i = 0;
        while i < self.retiring.len() {
            let r = &mut self.retiring[i];
            let done = r
                .offer
                .as_ref()
                .is_none_or(|o| o.offer.phase() == lend::DONE)
                && r.since.elapsed() >= Duration::from_millis(10);
            for (s, st) in &mut r.sockets {
                let x = &mut self.socks[*s];
                if let Some(o) = &r.offer {
                    let upto = o.offer.queues[*s].returned.load(Ordering::Acquire);
                    let n = refill_from(&mut x.fill, &mut st.rx, upto, FRAME);
                    self.function_steered.add(u64::from(n));
                }
                if done {
                    let upto = st.rx.produced();
                    let n = refill_from(&mut x.fill, &mut st.rx, upto, FRAME);
                    self.removed_drops.add(u64::from(n));
                }
            }
            if done {
                self.retiring.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Port `port`'s sockets on every queue, from where this app stopped reading them.
    fn offer(&self, port: usize) -> Option<Arc<SteerOffer>> {
        let mut queues = Vec::new();
        for x in &self.socks {
            let s = x.steered.iter().find(|s| s.output == port + 1)?;
            queues.push(SteerQueue {
                socket: s.fd.try_clone().ok()?,
                umem: x.umem_fd.try_clone().ok()?,
                umem_len: (x.frames * FRAME_SIZE) as usize,
                ring_size: x.ring_size,
                start: s.rx.position(),
                returned: s.rx.position().into(),
            });
        }
        let ports = steer_ports(&self.config.steer);
        Some(Arc::new(SteerOffer {
            from: format!("af_xdp `{}` port `{}`", self.interface, ports[port]),
            queues,
            phase: lend::OFFERED.into(),
            end: false.into(),
            complete_checksums: self.complete_checksums,
        }))
    }
}
