//! The flow table: entries by priority, matched against the header fields of a packet, with
//! per-flow counters that the data path bumps and OpenFlow statistics read.

use crate::ofp::{Action, FlowMod, Match, OfError, FLOW_MOD_BAD_COMMAND, PORT_ANY};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub struct FlowEntry {
    pub priority: u16,
    pub cookie: u64,
    pub matching: Match,
    pub actions: Vec<Action>,
    pub idle_timeout: u16,
    pub hard_timeout: u16,
    pub flags: u16,
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    pub created: Instant,
}

/// The header fields of one packet, read once.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    pub in_port: u32,
    pub eth_dst: [u8; 6],
    pub eth_src: [u8; 6],
    pub eth_type: u16,
    /// VLAN id | 0x1000 when tagged, 0 when not (OpenFlow's OFPVID_PRESENT convention).
    pub vlan_vid: u16,
    pub ip_proto: Option<u8>,
    pub ipv4_src: u32,
    pub ipv4_dst: u32,
    pub ipv6_src: u128,
    pub ipv6_dst: u128,
    pub tp_src: Option<u16>,
    pub tp_dst: Option<u16>,
}

impl Key {
    /// Reads the fields of `frame` (anything shorter than a field leaves it unset).
    pub fn of(frame: &[u8], in_port: u32) -> Key {
        let mut k = Key {
            in_port,
            ..Key::default()
        };
        if frame.len() < 14 {
            return k;
        }
        k.eth_dst = frame[0..6].try_into().unwrap();
        k.eth_src = frame[6..12].try_into().unwrap();
        let mut et = u16::from_be_bytes([frame[12], frame[13]]);
        let mut at = 14;
        if (et == 0x8100 || et == 0x88a8) && frame.len() >= 18 {
            k.vlan_vid = 0x1000 | (u16::from_be_bytes([frame[14], frame[15]]) & 0x0fff);
            et = u16::from_be_bytes([frame[16], frame[17]]);
            at = 18;
        }
        k.eth_type = et;
        let l3 = &frame[at..];
        let l4 = match et {
            0x0800 if l3.len() >= 20 => {
                k.ip_proto = Some(l3[9]);
                k.ipv4_src = u32::from_be_bytes(l3[12..16].try_into().unwrap());
                k.ipv4_dst = u32::from_be_bytes(l3[16..20].try_into().unwrap());
                let ihl = (l3[0] & 0x0f) as usize * 4;
                let first = u16::from_be_bytes([l3[6], l3[7]]) & 0x1fff == 0;
                first.then(|| l3.get(ihl..)).flatten()
            }
            0x86dd if l3.len() >= 40 => {
                k.ip_proto = Some(l3[6]);
                k.ipv6_src = u128::from_be_bytes(l3[8..24].try_into().unwrap());
                k.ipv6_dst = u128::from_be_bytes(l3[24..40].try_into().unwrap());
                l3.get(40..)
            }
            _ => None,
        };
        if let (Some(6 | 17 | 132), Some(l4)) = (k.ip_proto, l4) {
            if l4.len() >= 4 {
                k.tp_src = Some(u16::from_be_bytes([l4[0], l4[1]]));
                k.tp_dst = Some(u16::from_be_bytes([l4[2], l4[3]]));
            }
        }
        k
    }
}

fn mac_eq(v: &[u8; 6], (want, mask): &([u8; 6], [u8; 6])) -> bool {
    (0..6).all(|i| v[i] & mask[i] == want[i] & mask[i])
}

/// Whether the packet with fields `k` matches `m`.
#[inline]
pub fn matches(m: &Match, k: &Key) -> bool {
    m.in_port.is_none_or(|p| p == k.in_port)
        && m.eth_dst.as_ref().is_none_or(|e| mac_eq(&k.eth_dst, e))
        && m.eth_src.as_ref().is_none_or(|e| mac_eq(&k.eth_src, e))
        && m.eth_type.is_none_or(|t| t == k.eth_type)
        && m.vlan_vid
            .is_none_or(|(v, mask)| k.vlan_vid & mask == v & mask)
        && m.ip_proto.is_none_or(|p| Some(p) == k.ip_proto)
        && m.ipv4_src
            .is_none_or(|(v, mask)| k.ipv4_src & mask == v & mask)
        && m.ipv4_dst
            .is_none_or(|(v, mask)| k.ipv4_dst & mask == v & mask)
        && m.ipv6_src
            .is_none_or(|(v, mask)| k.ipv6_src & mask == v & mask)
        && m.ipv6_dst
            .is_none_or(|(v, mask)| k.ipv6_dst & mask == v & mask)
        && m.tp_src.is_none_or(|p| Some(p) == k.tp_src)
        && m.tp_dst.is_none_or(|p| Some(p) == k.tp_dst)
}

/// Whether `entry` falls under the (possibly wider) description `m` of a non-strict modify or
/// delete: every field `m` sets, the entry sets to the same value.
fn covered(m: &Match, entry: &Match) -> bool {
    fn f<T: PartialEq>(want: &Option<T>, have: &Option<T>) -> bool {
        want.is_none() || want == have
    }
    f(&m.in_port, &entry.in_port)
        && f(&m.eth_dst, &entry.eth_dst)
        && f(&m.eth_src, &entry.eth_src)
        && f(&m.eth_type, &entry.eth_type)
        && f(&m.vlan_vid, &entry.vlan_vid)
        && f(&m.ip_proto, &entry.ip_proto)
        && f(&m.ipv4_src, &entry.ipv4_src)
        && f(&m.ipv4_dst, &entry.ipv4_dst)
        && f(&m.ipv6_src, &entry.ipv6_src)
        && f(&m.ipv6_dst, &entry.ipv6_dst)
        && f(&m.tp_src, &entry.tp_src)
        && f(&m.tp_dst, &entry.tp_dst)
}

fn outputs_to(e: &FlowEntry, port: u32) -> bool {
    port == PORT_ANY || e.actions.contains(&Action::Output(port))
}

/// The master table, owned by the OpenFlow side; the data path reads snapshots of it.
#[derive(Default)]
pub struct FlowTable {
    /// Highest priority first; equal priorities in insertion order.
    pub entries: Vec<Arc<FlowEntry>>,
}

impl FlowTable {
    /// Applies a FLOW_MOD (OpenFlow 1.3 §6.4).
    pub fn apply(&mut self, fm: &FlowMod) -> Result<(), OfError> {
        let cookie_ok = |e: &FlowEntry| {
            fm.cookie_mask == 0 || e.cookie & fm.cookie_mask == fm.cookie & fm.cookie_mask
        };
        let strict = |e: &FlowEntry| e.priority == fm.priority && e.matching == fm.matching;
        match fm.command {
            0 => {
                self.entries.retain(|e| !strict(e));
                let entry = Arc::new(FlowEntry {
                    priority: fm.priority,
                    cookie: fm.cookie,
                    matching: fm.matching.clone(),
                    actions: fm.actions.clone(),
                    idle_timeout: fm.idle_timeout,
                    hard_timeout: fm.hard_timeout,
                    flags: fm.flags,
                    packets: AtomicU64::new(0),
                    bytes: AtomicU64::new(0),
                    created: Instant::now(),
                });
                let at = self
                    .entries
                    .iter()
                    .position(|e| e.priority < fm.priority)
                    .unwrap_or(self.entries.len());
                self.entries.insert(at, entry);
            }
            1 | 2 => {
                for e in self.entries.iter_mut() {
                    let hit = if fm.command == 2 {
                        strict(e)
                    } else {
                        covered(&fm.matching, &e.matching)
                    };
                    if hit && cookie_ok(e) {
                        // New actions, same counters (§6.4: modify keeps the counters).
                        *e = Arc::new(FlowEntry {
                            priority: e.priority,
                            cookie: e.cookie,
                            matching: e.matching.clone(),
                            actions: fm.actions.clone(),
                            idle_timeout: e.idle_timeout,
                            hard_timeout: e.hard_timeout,
                            flags: e.flags,
                            packets: AtomicU64::new(e.packets.load(Ordering::Relaxed)),
                            bytes: AtomicU64::new(e.bytes.load(Ordering::Relaxed)),
                            created: e.created,
                        });
                    }
                }
            }
            3 | 4 => self.entries.retain(|e| {
                let hit = if fm.command == 4 {
                    strict(e)
                } else {
                    covered(&fm.matching, &e.matching)
                };
                !(hit && cookie_ok(e) && outputs_to(e, fm.out_port))
            }),
            _ => return Err(FLOW_MOD_BAD_COMMAND),
        }
        Ok(())
    }

    /// Entries under `m` (flow statistics requests), optionally only those outputting to `port`.
    pub fn select<'a>(
        &'a self,
        m: &'a Match,
        out_port: u32,
    ) -> impl Iterator<Item = &'a Arc<FlowEntry>> {
        self.entries
            .iter()
            .filter(move |e| covered(m, &e.matching) && outputs_to(e, out_port))
    }
}

/// For each input port 1..=`ports`, the flow and output port when the rules send *all* of
/// that port's traffic to one other port: the first flow (by priority) that could match any
/// packet from the port matches on `in_port` alone (or on nothing) and its only action is
/// `output` to another numbered port. Conservative: any other shape is not point-to-point.
pub fn point_to_point(
    entries: &[Arc<FlowEntry>],
    ports: usize,
) -> Vec<Option<(Arc<FlowEntry>, u32)>> {
    (1..=ports as u32)
        .map(|port| {
            let e = entries
                .iter()
                .find(|e| e.matching.in_port.is_none_or(|p| p == port))?;
            let only_in_port = Match {
                in_port: e.matching.in_port,
                ..Match::default()
            };
            match e.actions.as_slice() {
                [Action::Output(out)]
                    if e.matching == only_in_port
                        && *out != port
                        && (1..=ports as u32).contains(out) =>
                {
                    Some((e.clone(), *out))
                }
                _ => None,
            }
        })
        .collect()
}

/// The first (highest-priority) entry that matches.
#[inline]
pub fn lookup<'a>(entries: &'a [Arc<FlowEntry>], k: &Key) -> Option<&'a FlowEntry> {
    position(entries, k).map(|i| &*entries[i])
}

/// The index of the first (highest-priority) entry that matches.
#[inline]
pub fn position(entries: &[Arc<FlowEntry>], k: &Key) -> Option<usize> {
    entries.iter().position(|e| matches(&e.matching, k))
}

/// An exact-match cache in front of the priority scan, as Open vSwitch keeps one in front of
/// its classifier: every field a match can look at is in the key, so a packet with the same key
/// always meets the same first entry, and the answer (an entry's index, or a miss) can be
/// remembered. Emptied whenever the table changes; bounded, emptied when full (a flood of new
/// keys then costs one scan each, as without a cache).
pub struct ExactMatchCache {
    map: std::collections::HashMap<Key, Option<u32>, foldhash::fast::RandomState>,
    capacity: usize,
}

impl ExactMatchCache {
    pub fn new(capacity: usize) -> Self {
        ExactMatchCache {
            map: std::collections::HashMap::with_capacity_and_hasher(capacity, Default::default()),
            capacity,
        }
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// The first matching entry's index, from the cache (`true`) or by a scan that then
    /// fills it (`false`).
    #[inline]
    pub fn lookup(&mut self, entries: &[Arc<FlowEntry>], k: &Key) -> (Option<usize>, bool) {
        if let Some(hit) = self.map.get(k) {
            return (hit.map(|i| i as usize), true);
        }
        let found = position(entries, k);
        if self.map.len() >= self.capacity {
            self.map.clear();
        }
        self.map.insert(*k, found.map(|i| i as u32));
        (found, false)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fm(command: u8, priority: u16, m: Match, actions: Vec<Action>) -> FlowMod {
        FlowMod {
            cookie: 0,
            cookie_mask: 0,
            table_id: 0,
            command,
            idle_timeout: 0,
            hard_timeout: 0,
            priority,
            out_port: PORT_ANY,
            flags: 0,
            matching: m,
            actions,
        }
    }

    #[test]
    fn priorities_modify_and_delete() {
        let mut t = FlowTable::default();
        let p1 = Match {
            in_port: Some(1),
            ..Match::default()
        };
        let udp = Match {
            in_port: Some(1),
            eth_type: Some(0x0800),
            ip_proto: Some(17),
            ..Match::default()
        };
        t.apply(&fm(0, 10, p1.clone(), vec![Action::Output(2)]))
            .unwrap();
        t.apply(&fm(0, 20, udp.clone(), vec![Action::Output(3)]))
            .unwrap();
        let mut frame = vec![0u8; 42];
        frame[12..14].copy_from_slice(&[8, 0]);
        frame[14] = 0x45;
        frame[23] = 17;
        let k = Key::of(&frame, 1);
        assert_eq!(lookup(&t.entries, &k).unwrap().actions, [Action::Output(3)]);
        frame[23] = 6;
        assert_eq!(
            lookup(&t.entries, &Key::of(&frame, 1)).unwrap().actions,
            [Action::Output(2)]
        );
        assert!(lookup(&t.entries, &Key::of(&frame, 2)).is_none());
        // Non-strict modify of in_port=1 reaches both; strict delete only the exact one.
        t.apply(&fm(1, 0, p1.clone(), vec![Action::Output(4)]))
            .unwrap();
        assert!(t.entries.iter().all(|e| e.actions == [Action::Output(4)]));
        t.apply(&fm(4, 20, udp, vec![])).unwrap();
        assert_eq!(t.entries.len(), 1);
        t.apply(&fm(3, 0, Match::default(), vec![])).unwrap();
        assert!(t.entries.is_empty());
    }

    #[test]
    fn point_to_point_is_found_conservatively() {
        let mut t = FlowTable::default();
        let p = |n| Match {
            in_port: Some(n),
            ..Match::default()
        };
        t.apply(&fm(0, 10, p(1), vec![Action::Output(2)])).unwrap();
        t.apply(&fm(0, 10, p(2), vec![Action::Output(1), Action::Output(3)]))
            .unwrap();
        let found = point_to_point(&t.entries, 3);
        assert_eq!(
            found
                .iter()
                .map(|x| x.as_ref().map(|(_, o)| *o))
                .collect::<Vec<_>>(),
            [Some(2), None, None]
        );
        // A more specific flow above breaks it.
        let udp = Match {
            in_port: Some(1),
            eth_type: Some(0x0800),
            ip_proto: Some(17),
            ..Match::default()
        };
        t.apply(&fm(0, 20, udp, vec![Action::Output(2)])).unwrap();
        assert!(point_to_point(&t.entries, 3)[0].is_none());
    }

    #[test]
    fn the_exact_match_cache_answers_as_the_scan_does() {
        let mut t = FlowTable::default();
        // 200 flows on UDP destination ports, at falling priorities, and one catch-all.
        for i in 0..200u16 {
            let m = Match {
                in_port: Some(1),
                eth_type: Some(0x0800),
                ip_proto: Some(17),
                tp_dst: Some(1000 + i % 50),
                ipv4_src: Some((0x0a00_0000 | i as u32, 0xffff_ff00 | (i as u32 % 4))),
                ..Match::default()
            };
            t.apply(&fm(0, 1000 - i, m, vec![Action::Output(2 + i as u32 % 3)]))
                .unwrap();
        }
        let any = Match {
            in_port: Some(2),
            ..Match::default()
        };
        t.apply(&fm(0, 1, any, vec![Action::Output(1)])).unwrap();
        let mut cache = ExactMatchCache::new(64);
        let mut x = 0x1234_5678u64;
        for round in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = Key {
                in_port: 1 + (x % 3) as u32,
                eth_type: 0x0800,
                ip_proto: Some(17),
                ipv4_src: 0x0a00_0000 | ((x >> 8) as u32 % 300),
                tp_dst: Some(990 + (x >> 20) as u16 % 70),
                ..Key::default()
            };
            let (cached, _) = cache.lookup(&t.entries, &k);
            assert_eq!(cached, position(&t.entries, &k), "round {round}: {k:?}");
            assert!(cache.len() <= 64, "bounded");
        }
        // Repeated keys are answered from the cache.
        let k = Key {
            in_port: 2,
            ..Key::default()
        };
        cache.lookup(&t.entries, &k);
        assert_eq!(cache.lookup(&t.entries, &k), (Some(200), true));
    }
}
