//! The switch's tables carried across a restart or an upgrade as the OpenFlow 1.3 messages that
//! would make them again — METER_MODs, GROUP_MODs and FLOW_MODs, each an ADD — with the counters
//! and age each entry had, and the port and table counters (a controller's rates of them never
//! see a drop). The wire format is the one a controller speaks, read back by the same
//! parsers and checks as a controller's messages, so a saved table is never misread.

use crate::ofp;
use crate::{group, meter, oxm, Shared, State};
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;
use stitch_wire::be::Put;

/// The state format (the messages inside are OpenFlow 1.3's).
pub const STATE_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
pub struct SavedTables {
    meters: Vec<SavedEntry>,
    groups: Vec<SavedEntry>,
    flows: Vec<SavedEntry>,
    /// By port name (a port the new graph no longer has is left out).
    #[serde(default)]
    ports: Vec<SavedPort>,
    /// Lookups and matches of each table, by table number.
    #[serde(default)]
    tables: Vec<(u64, u64)>,
}

/// One port's PORT statistics.
#[derive(Debug, Serialize, Deserialize)]
struct SavedPort {
    name: String,
    rx_packets: u64,
    rx_bytes: u64,
    tx_packets: u64,
    tx_bytes: u64,
    tx_dropped: u64,
}

/// One entry: the message that makes it (hex) and its counters.
#[derive(Debug, Serialize, Deserialize)]
struct SavedEntry {
    message: String,
    packets: u64,
    bytes: u64,
}

/// Every meter, group and flow of the switch, and its port and table counters.
pub fn save(shared: &Shared) -> SavedTables {
    let s = shared.state.lock().unwrap();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let ports = (shared.ports.iter().zip(&shared.port_counters))
        .map(|(name, c)| SavedPort {
            name: name.clone(),
            rx_packets: load(&c.rx_packets),
            rx_bytes: load(&c.rx_bytes),
            tx_packets: load(&c.tx_packets),
            tx_bytes: load(&c.tx_bytes),
            tx_dropped: load(&c.tx_dropped),
        })
        .collect();
    let tables = (shared.table_counters.iter())
        .map(|t| (load(&t.lookups), load(&t.matched)))
        .collect();
    save_entries(&s, ports, tables)
}

fn save_entries(s: &State, ports: Vec<SavedPort>, tables: Vec<(u64, u64)>) -> SavedTables {
    let meters = (s.meters.meters.values())
        .map(|m| SavedEntry {
            message: crate::hex(&meter_add(m)),
            packets: m.packets.load(Ordering::Relaxed),
            bytes: m.bytes.load(Ordering::Relaxed),
        })
        .collect();
    let groups = (s.groups.groups.values())
        .map(|g| SavedEntry {
            message: crate::hex(&group_add(g)),
            packets: g.packets.load(Ordering::Relaxed),
            bytes: g.bytes.load(Ordering::Relaxed),
        })
        .collect();
    let flows = (s.flows.tables.iter().flatten())
        .map(|e| SavedEntry {
            message: crate::hex(&flow_add(e)),
            packets: e.packets.load(Ordering::Relaxed),
            bytes: e.bytes.load(Ordering::Relaxed),
        })
        .collect();
    SavedTables {
        meters,
        groups,
        flows,
        ports,
        tables,
    }
}

/// Applies `saved` to the switch as a controller's messages (meters, then groups — a group
/// naming another waits for it —, then flows), and gives each entry its counters back.
/// Returns how many entries were made; an entry refused is reported with OpenFlow's error.
pub fn restore(shared: &Shared, saved: SavedTables) -> Result<usize, String> {
    let mut made = 0;
    for e in &saved.meters {
        crate::endpoint::meter_mod(&unhex(&e.message)?, shared)
            .map_err(|err| format!("a saved meter was refused: {err:?}"))?;
        made += 1;
    }
    let mut waiting: Vec<&SavedEntry> = saved.groups.iter().collect();
    while !waiting.is_empty() {
        let before = waiting.len();
        let mut refused = None;
        waiting.retain(|e| match unhex(&e.message) {
            Ok(m) => match crate::endpoint::group_mod(&m, shared) {
                Ok(()) => false,
                Err(err) => {
                    refused = Some(format!("{err:?}"));
                    true
                }
            },
            Err(_) => true,
        });
        made += before - waiting.len();
        if waiting.len() == before {
            return Err(format!(
                "{} saved groups were refused: {}",
                waiting.len(),
                refused.unwrap_or_else(|| "not hex".into())
            ));
        }
    }
    for e in &saved.flows {
        crate::endpoint::flow_mod(&unhex(&e.message)?, shared)
            .map_err(|err| format!("a saved flow was refused: {err:?}"))?;
        made += 1;
    }
    give_counters_back(shared, &saved);
    Ok(made)
}

/// Each made entry's counters, from the entry saved in the same order.
fn give_counters_back(shared: &Shared, saved: &SavedTables) {
    let s = shared.state.lock().unwrap();
    for (m, e) in s.meters.meters.values().zip(&saved.meters) {
        m.packets.store(e.packets, Ordering::Relaxed);
        m.bytes.store(e.bytes, Ordering::Relaxed);
    }
    for (g, e) in s.groups.groups.values().zip(&saved.groups) {
        g.packets.store(e.packets, Ordering::Relaxed);
        g.bytes.store(e.bytes, Ordering::Relaxed);
    }
    for (f, e) in s.flows.tables.iter().flatten().zip(&saved.flows) {
        f.packets.store(e.packets, Ordering::Relaxed);
        f.bytes.store(e.bytes, Ordering::Relaxed);
    }
    for p in &saved.ports {
        let Some(i) = shared.ports.iter().position(|n| *n == p.name) else {
            continue;
        };
        let c = &shared.port_counters[i];
        c.rx_packets.fetch_add(p.rx_packets, Ordering::Relaxed);
        c.rx_bytes.fetch_add(p.rx_bytes, Ordering::Relaxed);
        c.tx_packets.fetch_add(p.tx_packets, Ordering::Relaxed);
        c.tx_bytes.fetch_add(p.tx_bytes, Ordering::Relaxed);
        c.tx_dropped.fetch_add(p.tx_dropped, Ordering::Relaxed);
    }
    for (t, &(lookups, matched)) in shared.table_counters.iter().zip(&saved.tables) {
        t.lookups.fetch_add(lookups, Ordering::Relaxed);
        t.matched.fetch_add(matched, Ordering::Relaxed);
    }
}

/// OFPT_METER_MOD adding `m` (§7.3.4.5).
fn meter_add(m: &meter::Meter) -> Vec<u8> {
    let mut r = ofp::start(ofp::METER_MOD, 0);
    r.put(0u16); // OFPMC_ADD
    r.put(m.flags);
    r.put(m.id);
    meter::write_bands(&mut r, m);
    ofp::finish(r)
}

/// OFPT_GROUP_MOD adding `g` (§7.3.4.2).
fn group_add(g: &group::Group) -> Vec<u8> {
    let mut r = ofp::start(ofp::GROUP_MOD, 0);
    r.put(0u16); // OFPGC_ADD
    r.extend_from_slice(&[g.kind, 0]);
    r.put(g.id);
    group::write_buckets(&mut r, g);
    ofp::finish(r)
}

/// OFPT_FLOW_MOD adding `e` (§7.3.4.1).
fn flow_add(e: &crate::pipeline::FlowEntry) -> Vec<u8> {
    let mut r = ofp::start(ofp::FLOW_MOD, 0);
    r.put(e.cookie);
    r.put(0u64); // cookie mask
    r.extend_from_slice(&[e.table, 0]); // OFPFC_ADD
    r.put(e.idle_timeout);
    r.put(e.hard_timeout);
    r.put(e.priority);
    r.put(ofp::NO_BUFFER);
    r.put(ofp::PORT_ANY);
    r.put(ofp::GROUP_ANY);
    r.put(e.flags);
    r.extend_from_slice(&[0, 0]);
    oxm::write_match(&mut r, &e.matching);
    r.extend_from_slice(&e.instructions.raw);
    ofp::finish(r)
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("a saved message of odd length".into());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(s.get(i..i + 2).ok_or("not hex")?, 16)
                .map_err(|e| format!("a saved message: {e}"))
        })
        .collect()
}
