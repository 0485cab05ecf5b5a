//! Groups (OpenFlow 1.3 §5.6): all, select (weighted, by a hash of the flow), indirect and
//! fast-failover (the first bucket whose watched port or group is live), changed by GROUP_MOD.

use crate::action::{self, Action};
use crate::ofp::{self, OfError};
use crate::oxm::{self, Key};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use stitch_wire::be::{self, Put};

pub const ALL: u8 = 0;
pub const SELECT: u8 = 1;
pub const INDIRECT: u8 = 2;
pub const FAST_FAILOVER: u8 = 3;

pub struct Bucket {
    pub weight: u16,
    pub watch_port: u32,
    pub watch_group: u32,
    pub actions: Vec<Action>,
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
}

pub struct Group {
    pub id: u32,
    pub kind: u8,
    pub buckets: Vec<Bucket>,
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    pub created_ns: u64,
}

impl Group {
    /// The bucket a select group gives the flow of `key` (weighted; only live buckets).
    pub fn select(&self, key: &Key, live: impl Fn(&Bucket) -> bool) -> Option<usize> {
        let total: u64 = self
            .buckets
            .iter()
            .filter(|b| live(b))
            .map(|b| b.weight as u64)
            .sum();
        if total == 0 {
            return None;
        }
        let mut at = flow_hash(key) % total;
        for (i, b) in self.buckets.iter().enumerate() {
            if !live(b) {
                continue;
            }
            if at < b.weight as u64 {
                return Some(i);
            }
            at -= b.weight as u64;
        }
        None
    }
}

/// A hash of what names a flow (Ethernet, IP and ARP addresses, protocol, ports), the same for
/// every packet of it.
fn flow_hash(k: &Key) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for id in [
        oxm::ETH_SRC,
        oxm::ETH_DST,
        oxm::ETH_TYPE,
        oxm::IP_PROTO,
        oxm::IPV4_SRC,
        oxm::IPV4_DST,
        oxm::IPV6_SRC,
        oxm::IPV6_DST,
        oxm::TCP_SRC,
        oxm::TCP_DST,
        oxm::UDP_SRC,
        oxm::UDP_DST,
        oxm::SCTP_SRC,
        oxm::SCTP_DST,
        oxm::ARP_SPA,
        oxm::ARP_TPA,
    ] {
        for b in k.get(id) {
            h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h ^ (h >> 29)
}

pub const GC_ADD: u16 = 0;
pub const GC_MODIFY: u16 = 1;
pub const GC_DELETE: u16 = 2;

/// A GROUP_MOD, read.
pub struct GroupMod {
    pub command: u16,
    pub kind: u8,
    pub id: u32,
    pub buckets: Vec<Bucket>,
}

pub fn parse_group_mod(b: &[u8]) -> Result<GroupMod, OfError> {
    let command = ofp::u16_field(b, 8)?;
    let kind = *b.get(10).ok_or(ofp::BAD_REQUEST_LEN)?;
    let id = ofp::u32_field(b, 12)?;
    if command > GC_DELETE {
        return Err(ofp::GROUP_MOD_BAD_COMMAND);
    }
    let mut buckets = Vec::new();
    let mut i = 16;
    while i < b.len() {
        let len = ofp::u16_field(b, i)? as usize;
        if len < 16 || !len.is_multiple_of(8) || i + len > b.len() {
            return Err(ofp::GROUP_MOD_BAD_BUCKET);
        }
        buckets.push(Bucket {
            weight: ofp::u16_field(b, i + 2)?,
            watch_port: ofp::u32_field(b, i + 4)?,
            watch_group: ofp::u32_field(b, i + 8)?,
            actions: action::parse_actions(&b[i + 16..i + len])?,
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        i += len;
    }
    Ok(GroupMod {
        command,
        kind,
        id,
        buckets,
    })
}

/// The groups, owned by the OpenFlow side; the data path reads snapshots.
#[derive(Default, Clone)]
pub struct GroupTable {
    pub groups: BTreeMap<u32, Arc<Group>>,
}

pub const MAX_GROUPS: usize = 65536;
pub const MAX_BUCKETS: usize = 256;

impl GroupTable {
    /// Applies a GROUP_MOD (§6.7); returns the ids of the groups it deleted (flows that
    /// forward to them go too).
    pub fn apply(&mut self, gm: GroupMod, now_ns: u64) -> Result<Vec<u32>, OfError> {
        if gm.command == GC_DELETE {
            return Ok(if gm.id == ofp::GROUP_ALL {
                std::mem::take(&mut self.groups).into_keys().collect()
            } else {
                self.groups
                    .remove(&gm.id)
                    .map(|g| g.id)
                    .into_iter()
                    .collect()
            });
        }
        if gm.id > ofp::GROUP_MAX {
            return Err(ofp::GROUP_MOD_INVALID_GROUP);
        }
        match gm.command {
            GC_ADD if self.groups.contains_key(&gm.id) => return Err(ofp::GROUP_MOD_EXISTS),
            GC_MODIFY if !self.groups.contains_key(&gm.id) => return Err(ofp::GROUP_MOD_UNKNOWN),
            _ => {}
        }
        if gm.command == GC_ADD && self.groups.len() >= MAX_GROUPS {
            return Err(ofp::GROUP_MOD_OUT_OF_GROUPS);
        }
        self.check(&gm)?;
        let group = Group {
            id: gm.id,
            kind: gm.kind,
            buckets: gm.buckets,
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            created_ns: now_ns,
        };
        if let Some(old) = self.groups.get(&gm.id) {
            group
                .packets
                .store(old.packets.load(Ordering::Relaxed), Ordering::Relaxed);
            group
                .bytes
                .store(old.bytes.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.groups.insert(gm.id, Arc::new(group));
        Ok(Vec::new())
    }

    fn check(&self, gm: &GroupMod) -> Result<(), OfError> {
        if gm.kind > FAST_FAILOVER {
            return Err(ofp::GROUP_MOD_BAD_TYPE);
        }
        if gm.buckets.len() > MAX_BUCKETS {
            return Err(ofp::GROUP_MOD_OUT_OF_BUCKETS);
        }
        if gm.kind == INDIRECT && gm.buckets.len() != 1 {
            return Err(ofp::GROUP_MOD_INVALID_GROUP);
        }
        for b in &gm.buckets {
            if gm.kind != SELECT && b.weight != 0 {
                return Err(ofp::GROUP_MOD_WEIGHT_UNSUPPORTED);
            }
            if gm.kind == FAST_FAILOVER
                && b.watch_port == ofp::PORT_ANY
                && b.watch_group == ofp::GROUP_ANY
            {
                return Err(ofp::GROUP_MOD_BAD_WATCH);
            }
            for a in &b.actions {
                if let Action::Group(next) = a {
                    if *next == gm.id || self.reaches(*next, gm.id) {
                        return Err(ofp::GROUP_MOD_LOOP);
                    }
                    if !self.groups.contains_key(next) {
                        return Err(ofp::GROUP_MOD_CHAINED_UNKNOWN);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether group `from` forwards, directly or through others, to group `to`.
    fn reaches(&self, from: u32, to: u32) -> bool {
        let mut stack = vec![from];
        let mut seen = std::collections::HashSet::new();
        while let Some(g) = stack.pop() {
            if g == to {
                return true;
            }
            if !seen.insert(g) {
                continue;
            }
            if let Some(group) = self.groups.get(&g) {
                for b in &group.buckets {
                    for a in &b.actions {
                        if let Action::Group(n) = a {
                            stack.push(*n);
                        }
                    }
                }
            }
        }
        false
    }
}

/// `ofp_bucket`s as a GROUP_DESC reply gives them.
pub fn write_buckets(out: &mut Vec<u8>, g: &Group) {
    for b in &g.buckets {
        let start = out.len();
        out.extend_from_slice(&[0, 0]);
        out.put(b.weight);
        out.put(b.watch_port);
        out.put(b.watch_group);
        out.extend_from_slice(&[0; 4]);
        action::write_actions(out, &b.actions);
        let len = (out.len() - start) as u16;
        be::set(out, start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gm(command: u16, kind: u8, id: u32, buckets: Vec<(u16, Vec<Action>)>) -> GroupMod {
        GroupMod {
            command,
            kind,
            id,
            buckets: buckets
                .into_iter()
                .map(|(weight, actions)| Bucket {
                    weight,
                    watch_port: ofp::PORT_ANY,
                    watch_group: ofp::GROUP_ANY,
                    actions,
                    packets: AtomicU64::new(0),
                    bytes: AtomicU64::new(0),
                })
                .collect(),
        }
    }

    #[test]
    fn group_mods_follow_the_spec() {
        let mut t = GroupTable::default();
        t.apply(gm(GC_ADD, ALL, 1, vec![(0, vec![Action::output(2)])]), 0)
            .unwrap();
        assert_eq!(
            t.apply(gm(GC_ADD, ALL, 1, vec![]), 0).err(),
            Some(ofp::GROUP_MOD_EXISTS)
        );
        assert_eq!(
            t.apply(gm(GC_MODIFY, ALL, 9, vec![]), 0).err(),
            Some(ofp::GROUP_MOD_UNKNOWN)
        );
        // Chaining to an unknown group, and a loop.
        assert_eq!(
            t.apply(
                gm(GC_ADD, INDIRECT, 2, vec![(0, vec![Action::Group(7)])]),
                0
            )
            .err(),
            Some(ofp::GROUP_MOD_CHAINED_UNKNOWN)
        );
        t.apply(
            gm(GC_ADD, INDIRECT, 2, vec![(0, vec![Action::Group(1)])]),
            0,
        )
        .unwrap();
        assert_eq!(
            t.apply(gm(GC_MODIFY, ALL, 1, vec![(0, vec![Action::Group(2)])]), 0)
                .err(),
            Some(ofp::GROUP_MOD_LOOP)
        );
        let gone = t
            .apply(gm(GC_DELETE, ALL, ofp::GROUP_ALL, vec![]), 0)
            .unwrap();
        assert_eq!(gone, [1, 2]);
    }

    #[test]
    fn select_spreads_flows_by_weight_and_keeps_each_flow_on_one_bucket() {
        let mut t = GroupTable::default();
        t.apply(
            gm(
                GC_ADD,
                SELECT,
                1,
                vec![(1, vec![Action::output(2)]), (3, vec![Action::output(3)])],
            ),
            0,
        )
        .unwrap();
        let g = &t.groups[&1];
        let mut counts = [0u32; 2];
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..8000 {
            let mut k = Key::default();
            k.set(oxm::IPV4_SRC, &be::net(rng.u32(..)));
            k.set(oxm::TCP_SRC, &be::net(rng.u16(..)));
            let b = g.select(&k, |_| true).unwrap();
            assert_eq!(g.select(&k, |_| true), Some(b));
            counts[b] += 1;
        }
        let share = counts[1] as f64 / 8000.0;
        assert!((0.70..0.80).contains(&share), "{counts:?}");
        // ARP flows spread too.
        let arp = (0..2000)
            .filter(|_| {
                let mut k = Key::default();
                k.set(oxm::ARP_SPA, &be::net(rng.u32(..)));
                g.select(&k, |_| true) == Some(1)
            })
            .count();
        assert!((1300..1700).contains(&arp), "{arp}");
        // With the heavy bucket down, everything takes the other.
        let mut k = Key::default();
        k.set(oxm::TCP_SRC, &[0, 1]);
        assert_eq!(g.select(&k, |b| b.weight == 1), Some(0));
    }
}
