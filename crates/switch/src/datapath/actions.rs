//! What the actions of an entry, a bucket or the action set do to a packet: rewrites, groups
//! (all, select, indirect, fast failover), meters, outputs and packet-ins.

use super::{ActionSet, DataPath, Origin, MAX_GROUP_DEPTH};
use crate::action::{self, Action, Rewrite};
use crate::group::{self, Group};
use crate::meter::{self, Verdict};
use crate::ofp;
use crate::oxm::{self, Key};
use crate::{Async, Shared, Snapshot};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_core::Packet;
use stitch_wire::be::{self, Put};
use stitch_wire::ethertype;

impl DataPath {
    /// One action on `p`; `last` lets an output take the packet instead of a copy. Returns the
    /// packet when there is more to do with it.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn act(
        &mut self,
        mut p: Packet,
        key: &mut Key,
        a: &Action,
        last: bool,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) -> Option<Packet> {
        match a {
            Action::Output { port, max_len } => {
                if last {
                    self.output(p, key, *port, *max_len, origin, shared);
                    return None;
                }
                if let Some(c) = p.try_clone() {
                    self.output(c, key, *port, *max_len, origin, shared);
                }
                Some(p)
            }
            Action::Group(g) => {
                self.probe.spoil();
                self.fresh(key, &p);
                if last {
                    self.group(p, key, *g, origin, snap, shared, depth);
                    return None;
                }
                if let Some(c) = p.try_clone() {
                    self.group(c, key, *g, origin, snap, shared, depth);
                }
                Some(p)
            }
            Action::SetQueue(_) => Some(p),
            _ => match self.rewrite(&mut p, key, a) {
                Rewrite::Changed => {
                    self.key_stale = true;
                    Some(p)
                }
                Rewrite::Unchanged => Some(p),
                Rewrite::TtlExpired => {
                    self.tally.ttl_drops += 1;
                    self.walk_cut = true;
                    None
                }
                Rewrite::NoRoom => {
                    self.walk_cut = true;
                    None
                }
            },
        }
    }

    /// A rewrite of the frame, watched when a walk's net effect is being worked out.
    #[inline]
    pub(super) fn rewrite(&mut self, p: &mut Packet, key: &mut Key, a: &Action) -> Rewrite {
        if !self.probe.watching() {
            return action::rewrite(p, key, a);
        }
        let before = p.len();
        let change = self.probe.before(a, p.data());
        let r = action::rewrite(p, key, a);
        if let Some(change) = change {
            self.probe.after(change, before, p.len());
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn group(
        &mut self,
        p: Packet,
        key: &Key,
        id: u32,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) {
        let Some(g) = snap.groups.get(&id) else {
            return;
        };
        if depth >= MAX_GROUP_DEPTH {
            return;
        }
        g.packets.fetch_add(1, Ordering::Relaxed);
        g.bytes.fetch_add(p.len() as u64, Ordering::Relaxed);
        let live = |b: &group::Bucket| bucket_live(b, snap, shared, 0);
        match g.kind {
            group::ALL => {
                let n = g.buckets.len();
                let mut p = Some(p);
                for (i, _) in g.buckets.iter().enumerate() {
                    let copy = if i + 1 == n {
                        p.take()
                    } else {
                        p.as_ref().and_then(Packet::try_clone)
                    };
                    if let Some(c) = copy {
                        self.bucket(c, key, g, i, origin, snap, shared, depth);
                    }
                }
            }
            group::SELECT => {
                if let Some(i) = g.select(key, live) {
                    self.bucket(p, key, g, i, origin, snap, shared, depth);
                }
            }
            group::INDIRECT => {
                if !g.buckets.is_empty() {
                    self.bucket(p, key, g, 0, origin, snap, shared, depth);
                }
            }
            _ => {
                if let Some(i) = g.buckets.iter().position(live) {
                    self.bucket(p, key, g, i, origin, snap, shared, depth);
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn bucket(
        &mut self,
        p: Packet,
        key: &Key,
        g: &Arc<Group>,
        i: usize,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) {
        let b = &g.buckets[i];
        b.packets.fetch_add(1, Ordering::Relaxed);
        b.bytes.fetch_add(p.len() as u64, Ordering::Relaxed);
        let mut set = ActionSet::new();
        set.write(&b.actions);
        self.run_set(p, *key, &set, origin, snap, shared, depth + 1);
    }

    #[inline]
    pub(super) fn meter(
        &mut self,
        p: &mut Packet,
        key: &mut Key,
        id: u32,
        snap: &Snapshot,
    ) -> Verdict {
        let Some(m) = snap.meters.get(&id) else {
            return Verdict::Drop;
        };
        let v = m.measure(p.len(), self.now_ns);
        if let Verdict::Remark(levels) = v {
            let dscp = key.u8(oxm::IP_DSCP);
            let et = key.u16(oxm::ETH_TYPE);
            if et == ethertype::IPV4 || et == ethertype::IPV6 {
                let new = meter::remark_dscp(dscp, levels);
                if new != dscp {
                    action::set_field(p, oxm::IP_DSCP, &[new]);
                    key.refresh(p.data());
                }
            }
        }
        v
    }

    #[inline]
    pub(super) fn output(
        &mut self,
        p: Packet,
        key: &Key,
        port: u32,
        max_len: u16,
        origin: Origin,
        shared: &Shared,
    ) {
        let in_port = key.in_port();
        if matches!(port, ofp::PORT_CONTROLLER | ofp::PORT_FLOOD | ofp::PORT_ALL) {
            // The controller must see each packet; a flood depends on the ports of the moment.
            self.probe.spoil();
        }
        match port {
            ofp::PORT_CONTROLLER => self.packet_in(p, key, max_len, origin, shared),
            ofp::PORT_FLOOD | ofp::PORT_ALL => {
                let n = shared.ports.len() as u32;
                let last = if n == in_port { n - 1 } else { n };
                let mut p = Some(p);
                for o in (1..=last).filter(|o| *o != in_port) {
                    let copy = if o == last {
                        p.take()
                    } else {
                        p.as_ref().and_then(Packet::try_clone)
                    };
                    if let Some(c) = copy {
                        self.send(c, o);
                    }
                }
            }
            ofp::PORT_IN_PORT => self.send(p, in_port),
            // §4.5: a packet leaves by its ingress port only through OFPP_IN_PORT.
            n if n == in_port => {}
            n => self.send(p, n),
        }
    }

    #[inline]
    pub(super) fn send(&mut self, p: Packet, port: u32) {
        if self.probe.watching() && self.outbox.slot(port).is_some() {
            self.probe.output(port, p.data());
        }
        self.outbox.put(p, port);
    }

    pub(super) fn packet_in(
        &mut self,
        p: Packet,
        key: &Key,
        max_len: u16,
        origin: Origin,
        shared: &Shared,
    ) {
        // §7.4.1: a table-miss entry's packets come in as "no match", others as "action".
        let reason = if origin.table_miss { 0 } else { 1 };
        let data = p.data();
        let n = if max_len == 0xffff {
            data.len()
        } else {
            data.len().min(max_len as usize)
        };
        let mut m = ofp::start(ofp::PACKET_IN, 0);
        m.put(ofp::NO_BUFFER);
        m.put(data.len() as u16);
        m.push(reason);
        m.push(origin.table);
        m.put(origin.cookie);
        let in_port = be::net(key.in_port());
        let metadata = key.get(oxm::METADATA);
        let tunnel = key.get(oxm::TUNNEL_ID);
        let mut fields: Vec<oxm::Field> = vec![(oxm::IN_PORT, &in_port, None)];
        if metadata.iter().any(|b| *b != 0) {
            fields.push((oxm::METADATA, metadata, None));
        }
        if tunnel.iter().any(|b| *b != 0) {
            fields.push((oxm::TUNNEL_ID, tunnel, None));
        }
        oxm::write_match(&mut m, &oxm::Match::from_fields(&fields));
        m.extend_from_slice(&[0, 0]);
        m.extend_from_slice(&data[..n]);
        if shared.send_async(Async::PacketIn, reason, &ofp::finish(m)) {
            self.tally.packet_ins += 1;
        } else {
            self.tally.packet_in_drops += 1;
        }
    }
}

/// A fast-failover bucket is live when the port it watches is up and the group it watches
/// has a live bucket (§5.6.1).
pub(super) fn bucket_live(
    b: &group::Bucket,
    snap: &Snapshot,
    shared: &Shared,
    depth: usize,
) -> bool {
    let port_ok = b.watch_port == ofp::PORT_ANY
        || (b.watch_port as usize)
            .checked_sub(1)
            .and_then(|i| shared.port_live.get(i))
            .is_some_and(|l| l.load(Ordering::Relaxed));
    let group_ok = b.watch_group == ofp::GROUP_ANY
        || (depth < MAX_GROUP_DEPTH
            && snap.groups.get(&b.watch_group).is_some_and(|g| {
                g.buckets
                    .iter()
                    .any(|x| bucket_live(x, snap, shared, depth + 1))
            }));
    port_ok && group_ok
}
