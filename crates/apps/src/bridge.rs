//! `bridge`: a VLAN-aware learning Ethernet switch. Each port in `ports` is both an input and an
//! output of the same name. Source addresses are learned per VLAN with aging; frames to a known
//! address go to its port, broadcast, multicast and unknown destinations are flooded to every
//! other port of the VLAN.
//!
//! Ports are `access` (untagged frames, all in `vlan`) or `trunk` (tagged frames of `vlans` —
//! all VLANs when the list is empty — plus untagged frames in the native `vlan`). Tags are
//! pushed and popped as frames cross between the two. Frames with a VLAN a port does not
//! carry are dropped and counted; so are frames too short to be Ethernet.
//!
//! ```yaml
//! apps:
//!   br: { type: bridge, aging_seconds: 300, ports: { p1: { vlan: 10 }, p2: { vlan: 20 },
//!         up: { mode: trunk, vlans: [10, 20] } } }
//! links:
//!   - "host1.output -> br.p1"
//!   - "br.p1 -> host1.input"
//! ```

use indexmap::IndexMap;
use serde::Deserialize;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use stitch_core::{
    App, AppContext, AppError, AppSnapshot, AppState, Counter, Io, Packet, PortNames, PortSpec,
};
use stitch_wire::vlan;

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum PortMode {
    #[default]
    Access,
    Trunk,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortConfig {
    /// `access`: untagged frames, all in `vlan`; `trunk`: tagged frames of `vlans`, plus untagged
    /// ones in the native `vlan`.
    #[serde(default)]
    pub mode: PortMode,
    /// Access VLAN, or a trunk's native (untagged) VLAN.
    #[serde(default = "one")]
    pub vlan: u16,
    /// VLANs a trunk carries tagged (empty: all).
    #[serde(default)]
    pub vlans: Vec<u16>,
}

fn one() -> u16 {
    1
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeConfig {
    /// The ports by name: each is an input and an output of that name.
    pub ports: IndexMap<String, PortConfig>,
    /// A learned address is forgotten after this many seconds without a frame from it.
    #[serde(default = "default_aging")]
    pub aging_seconds: u64,
    /// Learned addresses held at most; when full, new ones are not learned (their frames are
    /// flooded) and counted.
    #[serde(default = "default_max")]
    pub max_entries: usize,
}

fn default_aging() -> u64 {
    300
}
fn default_max() -> usize {
    65536
}

struct Entry {
    port: usize,
    seen: Instant,
}

pub struct Bridge {
    ports: Vec<PortConfig>,
    port_names: Vec<String>,
    aging: Duration,
    max_entries: usize,
    table: HashMap<(u16, [u8; 6]), Entry, foldhash::fast::RandomState>,
    last_sweep: Instant,
    rx: Vec<Counter>,
    tx: Vec<Counter>,
    learned: Counter,
    flooded: Counter,
    vlan_drops: Counter,
    malformed: Counter,
    table_full: Counter,
    copy_drops: Counter,
}

impl PortConfig {
    fn carries(&self, v: u16) -> bool {
        match self.mode {
            PortMode::Access => v == self.vlan,
            PortMode::Trunk => v == self.vlan || self.vlans.is_empty() || self.vlans.contains(&v),
        }
    }

    /// The VLAN of a frame arriving on this port, with its tag removed; `None` if not allowed.
    fn ingress(&self, p: &mut Packet) -> Option<u16> {
        match (self.mode, vlan::outer_tag(p.data())) {
            (_, None) => Some(self.vlan),
            (PortMode::Access, Some(_)) => None,
            (PortMode::Trunk, Some((_, tci))) => {
                let v = vlan::vid(tci);
                if v != 0 && self.carries(v) {
                    vlan::pop(p);
                    Some(v)
                } else {
                    None
                }
            }
        }
    }

    /// Puts the frame (untagged inside the bridge) in this port's form for VLAN `v`.
    fn egress(&self, p: &mut Packet, v: u16) -> bool {
        if self.mode == PortMode::Trunk && v != self.vlan {
            return vlan::push(p, vlan::TPID_8021Q, v).is_ok();
        }
        true
    }
}

impl Bridge {
    fn sweep(&mut self, now: Instant) {
        let aging = self.aging;
        self.table.retain(|_, e| now.duration_since(e.seen) < aging);
    }
}

/// A learned address as the bridge carries it across a restart (format [`STATE_VERSION`]): the
/// port by name (indices change with the configuration) and its age.
#[derive(serde::Serialize, Deserialize)]
struct LearnedState {
    vlan: u16,
    mac: [u8; 6],
    port: String,
    age_ms: u64,
}

const STATE_VERSION: u32 = 1;

impl Bridge {
    /// Learns an address from a snapshot when its port still exists, carries its VLAN and the
    /// entry has not aged out.
    fn take_back(&mut self, e: LearnedState, now: Instant) -> bool {
        let age = Duration::from_millis(e.age_ms);
        let port = self.port_names.iter().position(|n| *n == e.port);
        match (port, now.checked_sub(age)) {
            (Some(port), Some(seen))
                if age < self.aging
                    && self.ports[port].carries(e.vlan)
                    && self.table.len() < self.max_entries =>
            {
                self.table.insert((e.vlan, e.mac), Entry { port, seen });
                true
            }
            _ => false,
        }
    }
}

impl App for Bridge {
    type Config = BridgeConfig;
    const EXAMPLE: &'static str = "aging_seconds: 300
ports:
  p1: { vlan: 10 }
  p2: { vlan: 20 }
  up: { mode: trunk, vlans: [10, 20] }
";

    fn declare(c: &BridgeConfig) -> Result<PortSpec, AppError> {
        if c.ports.len() < 2 {
            return Err("a bridge needs at least two ports".into());
        }
        for (name, p) in &c.ports {
            if !(1..=4094).contains(&p.vlan) || p.vlans.iter().any(|v| !(1..=4094).contains(v)) {
                return Err(format!("port `{name}`: VLAN ids are 1..=4094").into());
            }
            if p.mode == PortMode::Access && !p.vlans.is_empty() {
                return Err(
                    format!("port `{name}`: `vlans` is for trunk ports (use `vlan`)").into(),
                );
            }
        }
        if c.aging_seconds == 0 {
            return Err("aging_seconds must be at least 1".into());
        }
        let names: Vec<String> = c.ports.keys().cloned().collect();
        Ok(PortSpec {
            inputs: PortNames::Fixed(names.clone()),
            outputs: PortNames::Fixed(names),
        })
    }

    fn new(c: BridgeConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let names: Vec<&String> = c.ports.keys().collect();
        Ok(Bridge {
            rx: names
                .iter()
                .map(|n| ctx.counter(&format!("rx_{n}")))
                .collect(),
            tx: names
                .iter()
                .map(|n| ctx.counter(&format!("tx_{n}")))
                .collect(),
            port_names: c.ports.keys().cloned().collect(),
            ports: c.ports.values().cloned().collect(),
            aging: Duration::from_secs(c.aging_seconds),
            max_entries: c.max_entries,
            table: HashMap::default(),
            last_sweep: Instant::now(),
            learned: ctx.counter("learned"),
            flooded: ctx.counter("flooded"),
            vlan_drops: ctx.counter("vlan_drops"),
            malformed: ctx.counter("malformed_drops"),
            table_full: ctx.counter("table_full"),
            copy_drops: ctx.counter("pool_exhausted_drops"),
        })
    }

    /// The learned table: `{"entries": [{vlan, mac, port, age_s}], "count"}`.
    /// `{"limit": N}` reads the learned table; `{"command": "flush"}` forgets it (e.g. after a
    /// topology change), so that frames flood until addresses are learned again.
    fn snapshot(&self) -> Option<AppSnapshot> {
        let now = Instant::now();
        let learned: Vec<LearnedState> = self
            .table
            .iter()
            .map(|(&(vlan, mac), e)| LearnedState {
                vlan,
                mac,
                port: self.port_names[e.port].clone(),
                age_ms: now.duration_since(e.seen).as_millis() as u64,
            })
            .collect();
        Some(AppSnapshot::new(STATE_VERSION, learned))
    }

    fn restore(&mut self, state: AppState) -> Result<(), String> {
        let learned: Vec<LearnedState> = serde_json::from_value(state.of_version(STATE_VERSION)?)
            .map_err(|e| format!("bridge state: {e}"))?;
        let (now, total) = (Instant::now(), learned.len());
        let kept = learned
            .into_iter()
            .map(|e| self.take_back(e, now))
            .filter(|&k| k)
            .count();
        log::info!("bridge: {kept} of {total} learned addresses taken back from the snapshot");
        Ok(())
    }

    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        match request["command"].as_str() {
            Some("flush") => {
                let n = self.table.len();
                self.table.clear();
                return serde_json::json!({ "flushed": n });
            }
            Some(other) => {
                return serde_json::json!({ "error": format!("unknown command `{other}` (flush)") })
            }
            None => {}
        }
        let limit = request["limit"].as_u64().unwrap_or(1000) as usize;
        let now = Instant::now();
        let mut entries: Vec<_> = self
            .table
            .iter()
            .filter(|(_, e)| now.duration_since(e.seen) < self.aging)
            .map(|((vlan, mac), e)| {
                let mac = mac
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(":");
                serde_json::json!({ "vlan": vlan, "mac": mac, "port": self.port_names[e.port],
                                    "age_s": now.duration_since(e.seen).as_secs() })
            })
            .collect();
        let count = entries.len();
        entries.sort_by_key(|e| e.to_string());
        entries.truncate(limit);
        serde_json::json!({ "count": count, "entries": entries })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        let now = Instant::now();
        for (i, input) in inputs.iter_mut().enumerate() {
            let Some(input) = input.as_mut() else {
                continue;
            };
            let mut received = 0;
            for mut p in input.drain() {
                received += 1;
                if p.len() < 14 {
                    self.malformed.add(1);
                    continue;
                }
                let Some(v) = self.ports[i].ingress(&mut p) else {
                    self.vlan_drops.add(1);
                    continue;
                };
                let d = p.data();
                let dst: [u8; 6] = d[0..6].try_into().unwrap();
                let src: [u8; 6] = d[6..12].try_into().unwrap();
                if src[0] & 1 == 0 {
                    let len = self.table.len();
                    match self.table.entry((v, src)) {
                        std::collections::hash_map::Entry::Occupied(mut e) => {
                            let e = e.get_mut();
                            e.port = i;
                            e.seen = now;
                        }
                        std::collections::hash_map::Entry::Vacant(e) if len < self.max_entries => {
                            e.insert(Entry { port: i, seen: now });
                            self.learned.add(1);
                        }
                        std::collections::hash_map::Entry::Vacant(_) => self.table_full.add(1),
                    }
                }
                let known = (dst[0] & 1 == 0)
                    .then(|| self.table.get(&(v, dst)))
                    .flatten()
                    .filter(|e| now.duration_since(e.seen) < self.aging)
                    .map(|e| e.port);
                match known {
                    Some(o) if o == i => {} // already on its segment
                    Some(o) => {
                        if self.ports[o].egress(&mut p, v) {
                            if let Some(out) = outputs[o].as_mut() {
                                out.transmit(p);
                                self.tx[o].add(1);
                            }
                        }
                    }
                    None => {
                        self.flooded.add(1);
                        let member = |outputs: &[Option<stitch_core::Producer>], o: usize| {
                            o != i && self.ports[o].carries(v) && outputs[o].is_some()
                        };
                        let mut left = (0..self.ports.len())
                            .filter(|&o| member(outputs, o))
                            .count();
                        let mut orig = Some(p);
                        for o in 0..self.ports.len() {
                            if !member(outputs, o) {
                                continue;
                            }
                            left -= 1;
                            // The last port gets the original, the others copies.
                            let copy = if left == 0 {
                                orig.take()
                            } else {
                                orig.as_ref().and_then(Packet::try_clone)
                            };
                            let Some(mut copy) = copy else {
                                self.copy_drops.add(1);
                                continue;
                            };
                            if self.ports[o].egress(&mut copy, v) {
                                outputs[o]
                                    .as_mut()
                                    .expect("member ports are linked")
                                    .transmit(copy);
                                self.tx[o].add(1);
                            }
                        }
                    }
                }
            }
            self.rx[i].add(received);
        }
        if now.duration_since(self.last_sweep) >= Duration::from_secs(1) {
            self.last_sweep = now;
            self.sweep(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::{link, Consumer};
    use stitch_core::pool;
    use stitch_wire::ethertype;

    fn frame(dst: [u8; 6], src: [u8; 6], tag: Option<u16>) -> Packet {
        let mut p = pool::alloc().unwrap();
        let mut f = vec![0u8; 60];
        f[0..6].copy_from_slice(&dst);
        f[6..12].copy_from_slice(&src);
        f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
        p.set_data(&f).unwrap();
        if let Some(v) = tag {
            vlan::push(&mut p, vlan::TPID_8021Q, v).unwrap();
        }
        p
    }

    const A: [u8; 6] = [2, 0, 0, 0, 0, 0xa];
    const B: [u8; 6] = [2, 0, 0, 0, 0, 0xb];
    const BCAST: [u8; 6] = [0xff; 6];

    /// A bridge with ports a (access 1), b (access 1), c (access 10), t (trunk 10, native 1).
    fn setup(aging: u64) -> (Bridge, Io, Vec<stitch_core::Producer>, Vec<Consumer>) {
        let yaml = serde_json::json!({
            "aging_seconds": aging,
            "ports": { "a": {}, "b": {}, "c": { "vlan": 10 }, "t": { "mode": "trunk", "vlans": [10] } }
        });
        let c: BridgeConfig = serde_json::from_value(yaml).unwrap();
        Bridge::declare(&c).unwrap();
        let mut ctx = AppContext::new("br", std::path::Path::new("."), Default::default());
        let br = Bridge::new(c, &mut ctx).unwrap();
        let (mut ins, mut outs, mut feed, mut seen) = (vec![], vec![], vec![], vec![]);
        for n in ["a", "b", "c", "t"] {
            let (tx, rx) = link(64);
            feed.push(tx);
            ins.push((n.to_string(), rx));
            let (tx, rx) = link(64);
            outs.push((n.to_string(), tx));
            seen.push(rx);
        }
        (br, Io::new(ins, outs), feed, seen)
    }

    fn got(seen: &mut [Consumer]) -> Vec<Vec<Option<u16>>> {
        seen.iter_mut()
            .map(|c| {
                c.drain()
                    .map(|p| vlan::outer_tag(p.data()).map(|(_, t)| vlan::vid(t)))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn floods_then_learns_and_keeps_vlans_apart() {
        let (mut br, mut io, mut feed, mut seen) = setup(300);
        // Broadcast from A on port a (VLAN 1): b and the trunk (native, untagged), not c (VLAN 10).
        feed[0].transmit(frame(BCAST, A, None));
        br.push(&mut io);
        assert_eq!(got(&mut seen), vec![vec![], vec![None], vec![], vec![None]]);
        // B answers A: A is known on port a, so only a gets it.
        feed[1].transmit(frame(A, B, None));
        br.push(&mut io);
        assert_eq!(got(&mut seen), vec![vec![None], vec![], vec![], vec![]]);
        // A frame from c (VLAN 10) to unknown B: flooded in VLAN 10 only, tagged on the trunk.
        feed[2].transmit(frame(B, A, None));
        br.push(&mut io);
        assert_eq!(got(&mut seen), vec![vec![], vec![], vec![], vec![Some(10)]]);
        // Tagged VLAN 10 from the trunk to A (learned on c in VLAN 10): untagged out of c.
        feed[3].transmit(frame(A, B, Some(10)));
        br.push(&mut io);
        assert_eq!(got(&mut seen), vec![vec![], vec![], vec![None], vec![]]);
        // A VLAN the trunk does not carry, and a tag on an access port: dropped and counted.
        feed[3].transmit(frame(A, B, Some(30)));
        feed[0].transmit(frame(B, A, Some(1)));
        br.push(&mut io);
        assert_eq!(got(&mut seen), vec![vec![], vec![], vec![], vec![]]);
        assert_eq!(br.vlan_drops.get(), 2);
        assert_eq!(br.rx[3].get(), 2);
        // Too short to be Ethernet.
        let mut short = pool::alloc().unwrap();
        short.set_data(&[0u8; 10]).unwrap();
        feed[0].transmit(short);
        br.push(&mut io);
        assert_eq!(br.malformed.get(), 1);
    }

    /// A restarted bridge given the old one's snapshot forwards to a learned address at once,
    /// without flooding; another version is refused.
    #[test]
    fn learned_addresses_survive_a_restart_through_a_snapshot() {
        let (mut old, mut io, mut feed, mut seen) = setup(300);
        feed[0].transmit(frame(BCAST, A, None));
        old.push(&mut io);
        got(&mut seen);
        let state = old.snapshot().unwrap().into_state().unwrap();
        let (mut new, mut io, mut feed, mut seen) = setup(300);
        let other = AppState {
            version: 2,
            state: state.state.clone(),
        };
        assert!(new.restore(other).unwrap_err().contains("version 2"));
        new.restore(state).unwrap();
        feed[1].transmit(frame(A, B, None));
        new.push(&mut io);
        assert_eq!(got(&mut seen), vec![vec![None], vec![], vec![], vec![]]);
        assert_eq!(new.flooded.get(), 0);
    }

    #[test]
    fn entries_age_out() {
        let (mut br, mut io, mut feed, mut seen) = setup(1);
        feed[1].transmit(frame(BCAST, B, None));
        br.push(&mut io);
        got(&mut seen);
        feed[0].transmit(frame(B, A, None));
        br.push(&mut io);
        assert_eq!(
            got(&mut seen),
            vec![vec![], vec![None], vec![], vec![]],
            "B is known"
        );
        std::thread::sleep(Duration::from_millis(1100));
        feed[0].transmit(frame(B, A, None));
        br.push(&mut io);
        assert_eq!(
            got(&mut seen),
            vec![vec![], vec![None], vec![], vec![None]],
            "B aged out: flooded"
        );
    }
}
