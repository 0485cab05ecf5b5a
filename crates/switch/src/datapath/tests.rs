//! The data path against a pipeline of a few tables, with and without the walk cache.

use super::*;
use crate::oxm::{Match, ETH_DST, ETH_SRC, ETH_TYPE, IN_PORT, IP_PROTO, UDP_DST, VLAN_VID};
use crate::pipeline::{FlowMod, Instructions, FC_ADD};
use crate::State;
use std::sync::Arc;
use stitch_core::link::link;
use stitch_core::pool;
use stitch_wire::be::{self, Put};
use stitch_wire::ethertype;

fn add(s: &mut State, table: u8, priority: u16, fields: &[crate::oxm::Field], ins: Instructions) {
    let fm = FlowMod::plain(FC_ADD, table, priority, Match::from_fields(fields), ins);
    s.flows.apply(&fm, 0).unwrap();
}

fn then(apply: Vec<Action>, goto: Option<u8>) -> Instructions {
    Instructions {
        goto,
        ..Instructions::apply_actions(apply)
    }
}

fn mac(i: u8) -> [u8; 6] {
    [0x0e, 0, 0, 0, 0, i]
}

/// Faucet's shape: port 1 is tagged on the way in (VLAN 100), port 2 is a trunk whose
/// outer tag is popped before the lookup (its inner tag decides); table 1 sends by VLAN and
/// destination, popping the tag.
fn pipeline() -> Snapshot {
    let shared = Shared::new(
        "sw",
        &["p1".into(), "p2".into(), "p3".into(), "p4".into()],
        1,
    );
    let mut s = State::default();
    let vid = |v: u16| (0x1000 | v).to_be_bytes();
    add(
        &mut s,
        0,
        10,
        &[(IN_PORT, &be::net(1u32), None)],
        then(
            vec![
                Action::PushVlan(ethertype::VLAN),
                Action::SetField {
                    id: VLAN_VID,
                    value: vid(100).to_vec(),
                },
            ],
            Some(1),
        ),
    );
    add(
        &mut s,
        0,
        10,
        &[(IN_PORT, &be::net(2u32), None)],
        then(vec![Action::PopVlan], Some(1)),
    );
    // UDP to port 53 in VLAN 100 leaves by port 4 whatever its destination: for frames
    // found from their bytes, the UDP port is in their frame key.
    add(
        &mut s,
        1,
        20,
        &[
            (VLAN_VID, &vid(100), None),
            (ETH_TYPE, &[8, 0], None),
            (IP_PROTO, &[17], None),
            (UDP_DST, &be::net(53u16), None),
        ],
        then(vec![Action::PopVlan, Action::output(4)], None),
    );
    for i in 0..20u8 {
        for (v, port) in [(100, 3), (200, 4)] {
            // Some frames leave as they came, some tagged with a new source address or
            // VLAN, some to two ports with different heads.
            let actions = match i % 4 {
                0 | 1 => vec![Action::PopVlan, Action::output(port)],
                2 => vec![
                    Action::SetField {
                        id: ETH_SRC,
                        value: mac(0xee).to_vec(),
                    },
                    Action::output(port),
                ],
                _ => vec![
                    Action::output(port),
                    Action::SetField {
                        id: VLAN_VID,
                        value: vid(300).to_vec(),
                    },
                    Action::output(2),
                ],
            };
            add(
                &mut s,
                1,
                10,
                &[(VLAN_VID, &vid(v), None), (ETH_DST, &mac(i), None)],
                then(actions, None),
            );
        }
    }
    shared.publish(&s);
    let snap = std::mem::take(&mut *shared.snapshot.lock().unwrap());
    Arc::into_inner(snap).unwrap()
}

/// A frame numbered `n`: with `udp_dst`, UDP over IPv4 from a source that changes with
/// `n`; else of a local ethertype.
fn frame(dst: u8, tags: &[u16], n: u16, udp_dst: Option<u16>) -> Vec<u8> {
    let mut f = mac(dst).to_vec();
    f.extend_from_slice(&[0x0e, 0, 0, 1, 0, 1]);
    for t in tags {
        f.extend_from_slice(&ethertype::VLAN.to_be_bytes());
        f.put(*t);
    }
    match udp_dst {
        Some(port) => {
            let [hi, lo] = be::net(n);
            f.extend_from_slice(&[8, 0, 0x45, 0, 0, 46, hi, lo, 0, 0, 64, 17, 0, 0]);
            f.extend_from_slice(&[10, 0, hi, lo, 10, 1, 0, 1]);
            f.put(1000 + n);
            f.put(port);
        }
        None => {
            f.extend_from_slice(&[0x88, 0xb5]);
            f.put(n);
        }
    }
    f.resize(64, 0);
    f
}

/// What the data path did with the same packets, with the caches (`cache` > 0) or without.
struct Run {
    /// What each port sent.
    sent: Vec<Vec<Vec<u8>>>,
    /// Each table's entries' packet and byte counts.
    entries: Vec<Vec<(u64, u64)>>,
    /// Packets that took a walk's net effect.
    by_net: u64,
    /// Frame keys the walk cache knows.
    by_frame: usize,
}

fn run(cache: usize) -> Run {
    let _ = pool::init(4096, 0);
    let snap = pipeline();
    let shared = Shared::new(
        "sw",
        &["p1".into(), "p2".into(), "p3".into(), "p4".into()],
        1,
    );
    let mut dp = DataPath::new(4, cache);
    dp.clear_caches(&snap);
    let (mut ins, mut outs, mut io_in, mut io_out) = (vec![], vec![], vec![], vec![]);
    for i in 0..4 {
        let (tx, rx) = link(1024);
        ins.push(tx);
        io_in.push((format!("p{i}"), rx));
        let (tx, rx) = link(1024);
        io_out.push((format!("p{i}"), tx));
        outs.push(rx);
    }
    let mut io = Io::new(io_in, io_out);
    let mut sent: Vec<Vec<Vec<u8>>> = vec![Vec::new(); 4];
    for round in 0..4u16 {
        for n in 0..100u16 {
            let dst = (n % 25) as u8; // some destinations are unknown: a miss
            let (port, tags): (usize, Vec<u16>) = match n % 3 {
                0 if n % 4 == 0 => (0, vec![7]),
                0 => (0, vec![]),
                // The same outer tag, different inner tags: the same key bits at table 0.
                1 => (1, vec![5, 100]),
                _ => (1, vec![5, 200]),
            };
            let mut p = pool::alloc().unwrap();
            let udp_dst = (n % 2 == 0).then_some(53 + round % 2);
            p.set_data(&frame(dst, &tags, round * 100 + n, udp_dst))
                .unwrap();
            assert!(ins[port].transmit(p));
        }
        for i in 0..4 {
            dp.receive(i, &snap, &shared, &mut io);
        }
        for (i, rx) in outs.iter_mut().enumerate() {
            sent[i].extend(rx.drain().map(|p| p.data().to_vec()));
        }
    }
    let by_net = dp.traces.as_ref().map_or(0, TraceCache::packets);
    let by_frame = dp.traces.as_ref().map_or(0, TraceCache::frames_known);
    dp.flush_entries(&snap, 0);
    let entries = snap
        .tables
        .iter()
        .map(|t| {
            t.iter()
                .map(|e| {
                    (
                        e.packets.load(Ordering::Relaxed),
                        e.bytes.load(Ordering::Relaxed),
                    )
                })
                .collect()
        })
        .collect();
    Run {
        sent,
        entries,
        by_net,
        by_frame,
    }
}

#[test]
fn remembered_walks_send_and_count_what_lookups_do() {
    let looked_up = run(0);
    let cached = run(8192);
    let counts = |r: &Run| r.sent.iter().map(Vec::len).collect::<Vec<_>>();
    assert_eq!(counts(&looked_up), [0, 22, 164, 170]);
    assert!(
        cached.sent == looked_up.sent,
        "with the caches, the ports sent {:?} (without: {:?}) or other frames",
        counts(&cached),
        counts(&looked_up)
    );
    assert_eq!(cached.entries, looked_up.entries);
    // Single-tagged and untagged IPv4 frames were found by their bytes.
    assert!(cached.by_frame > 10, "{} frame keys known", cached.by_frame);
    // Port 1's frames of a known flow took its net effect (136 frames, of which those of
    // the first two rounds mostly new flows); the trunk's are replayed (a pop before a
    // lookup brings back the inner tag).
    assert!(
        cached.by_net > 80,
        "{} packets took a net effect",
        cached.by_net
    );
}
