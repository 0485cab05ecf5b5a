//! `switch`: an OpenFlow 1.3 switch between numbered ports (seed 001). Each name in `ports` is
//! an input and an output of the app and OpenFlow port 1, 2, … in that order. A controller —
//! `ovs-ofctl`, os-ken, any OpenFlow 1.3 controller — programs one flow table over TCP
//! (`listen` for a passive endpoint, `controller` to dial one); packets take the actions of the
//! highest-priority matching flow (output, flood, in-port, controller, drop, set-field,
//! push/pop VLAN); a packet no flow matches is dropped (OpenFlow 1.3's default table miss) and
//! counted. Flow and port counters are kept for the controller's statistics requests.
//!
//! ```yaml
//! apps:
//!   sw: { type: switch, ports: [a, b, c], listen: "127.0.0.1:6653" }
//! links:
//!   - "host_a.output -> sw.a"
//!   - "sw.a -> host_a.input"
//! ```
//!
//! When the rules send all of a port's traffic to one other port (point to point), that port's
//! packets move ring to ring in whole batches without a lookup each, and still count in the
//! flow's and the ports' statistics; the switch-over happens between two batches, so nothing is
//! lost or reordered.
//!
//! When both ends of such a pair are zero-copy function ports (`nf_port`), the switch steps out
//! of the path altogether (seed 001's bypass): it gives the two functions a direct channel
//! ([`stitch_nf::direct`]) — the first writes its packets straight to the second's — and
//! takes it back when the rules change or a function leaves. Both hand-overs are ordered and
//! lossless; the functions keep their ports; what crosses a channel is still counted in the
//! flow's and the ports' OpenFlow statistics (counter `direct_channels`: channels in use).
//! Not yet: flow timeouts, groups, meters, several tables.

pub mod endpoint;
pub mod ofp;
pub mod table;

use ofp::{Action, PORT_ALL, PORT_CONTROLLER, PORT_FLOOD, PORT_IN_PORT};
use serde::Deserialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use stitch_core::app::{AppContext, AppError, Counter, Io, PortNames, PortSpec};
use stitch_core::{App, AppType, Packet, Registry};
use stitch_nf::direct::{Direct, Phase};
use stitch_nf::listener::PortShared;
use table::{FlowEntry, Key};

/// A direct channel the switch gave two function ports: traffic from input `from` that its
/// flow `entry` sends to output `to`.
struct Channel {
    direct: Arc<Direct>,
    from: usize,
    to: usize,
    entry: Arc<FlowEntry>,
    handover_reported: bool,
    /// The channel's packets and bytes already added to the statistics.
    counted: (u64, u64),
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SwitchConfig {
    /// Port names: OpenFlow ports 1, 2, … in this order.
    pub ports: Vec<String>,
    /// Passive OpenFlow endpoint, `HOST:PORT`.
    #[serde(default)]
    pub listen: Option<String>,
    /// Active connection to a controller, `HOST:PORT` (retried every second).
    #[serde(default)]
    pub controller: Option<String>,
    /// Datapath id (default: derived from the app's name).
    #[serde(default)]
    pub datapath_id: Option<u64>,
    /// Keys remembered by the exact-match cache in front of the flow table's priority scan
    /// (used once the table holds more than a few flows); 0 turns it off.
    #[serde(default = "default_cache")]
    pub exact_match_cache: usize,
}

fn default_cache() -> usize {
    8192
}

/// Below this many flows a scan is as cheap as hashing the key.
const CACHE_FROM_FLOWS: usize = 8;

/// Per-port counters, as OpenFlow port statistics report them.
#[derive(Default)]
pub struct PortCounters {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub tx_dropped: AtomicU64,
}

/// A frame for the controller.
pub struct PacketIn {
    pub in_port: u32,
    pub reason: u8,
    pub cookie: u64,
    pub data: Vec<u8>,
}

/// A frame from the controller: in-port, actions, bytes.
pub type PacketOut = (u32, Vec<Action>, Vec<u8>);

/// What the data path and the OpenFlow side share.
pub struct Shared {
    pub name: String,
    pub ports: Vec<String>,
    pub datapath_id: u64,
    pub table: Mutex<table::FlowTable>,
    /// Snapshot of the table's entries for the data path, and its version.
    pub snapshot: Mutex<Arc<Vec<Arc<FlowEntry>>>>,
    pub version: AtomicU64,
    pub applied: AtomicU64,
    /// When the newest table was published (ns since `started`), for the switch-over time.
    pub published_ns: AtomicU64,
    pub port_counters: Vec<PortCounters>,
    pub lookups: AtomicU64,
    pub matched: AtomicU64,
    pub packet_ins: Mutex<VecDeque<PacketIn>>,
    pub packet_outs: Mutex<Vec<PacketOut>>,
    pub has_packet_outs: AtomicBool,
    pub started: std::time::Instant,
}

impl Shared {
    pub fn new(name: &str, ports: &[String], datapath_id: u64) -> Shared {
        Shared {
            name: name.to_string(),
            ports: ports.to_vec(),
            datapath_id,
            table: Mutex::new(table::FlowTable::default()),
            snapshot: Mutex::new(Arc::new(Vec::new())),
            version: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            published_ns: AtomicU64::new(0),
            port_counters: ports.iter().map(|_| PortCounters::default()).collect(),
            lookups: AtomicU64::new(0),
            matched: AtomicU64::new(0),
            packet_ins: Mutex::new(VecDeque::new()),
            packet_outs: Mutex::new(Vec::new()),
            has_packet_outs: AtomicBool::new(false),
            started: std::time::Instant::now(),
        }
    }

    /// Publishes the master table to the data path.
    pub fn publish(&self, t: &table::FlowTable) {
        *self.snapshot.lock().unwrap() = Arc::new(t.entries.clone());
        self.published_ns
            .store(self.started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.version.fetch_add(1, Ordering::Release);
    }
}

pub struct Switch {
    shared: Arc<Shared>,
    entries: Arc<Vec<Arc<FlowEntry>>>,
    /// Per input port: the flow and output when its traffic all goes to one other port.
    direct: Vec<Option<(Arc<FlowEntry>, u32)>>,
    seen: u64,
    /// A table the data path runs, not yet announced as applied.
    pending_version: Option<u64>,
    /// Per port: packets, bytes and drops sent since the last flush into the shared counters
    /// (one locked add per port and push, not per packet).
    tx_pending: Vec<[u64; 3]>,
    cache: Option<table::ExactMatchCache>,
    batch: Vec<Packet>,
    _endpoint: Option<endpoint::Endpoint>,
    misses: Counter,
    cache_hits: Counter,
    /// From a table's publication to the data path running it (the last change), and the
    /// longest so far.
    switch_over_ns: Counter,
    switch_over_max_ns: Counter,
    direct_packets: Counter,
    channels: Vec<Channel>,
    channels_in_use: Counter,
    channel_packets: Counter,
    /// The last channel's hand-over (offer → the receiving function reads it) and hand-back
    /// (end asked → retired).
    handover_ns: Counter,
    handback_ns: Counter,
    to_controller: Counter,
    controller_drops: Counter,
}

const MAX_PACKET_INS: usize = 1024;

impl App for Switch {
    type Config = SwitchConfig;

    fn declare(c: &SwitchConfig) -> Result<PortSpec, AppError> {
        if c.ports.is_empty() {
            return Err("`ports` needs at least one port name".into());
        }
        let mut seen = std::collections::HashSet::new();
        for p in &c.ports {
            if !seen.insert(p) {
                return Err(format!("port `{p}` is named twice").into());
            }
        }
        Ok(PortSpec {
            inputs: PortNames::Fixed(c.ports.clone()),
            outputs: PortNames::Fixed(c.ports.clone()),
        })
    }

    fn new(c: SwitchConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let dpid = c.datapath_id.unwrap_or_else(|| {
            ctx.name().bytes().fold(0xcbf29ce484222325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100000001b3)
            }) & 0x0000_ffff_ffff_ffff
        });
        let shared = Arc::new(Shared::new(ctx.name(), &c.ports, dpid));
        let endpoint = endpoint::Endpoint::start(
            shared.clone(),
            c.listen.as_deref(),
            c.controller.as_deref(),
        )?;
        Ok(Switch {
            shared,
            entries: Arc::new(Vec::new()),
            direct: vec![None; c.ports.len()],
            seen: 0,
            pending_version: None,
            tx_pending: vec![[0; 3]; c.ports.len()],
            cache: (c.exact_match_cache > 0)
                .then(|| table::ExactMatchCache::new(c.exact_match_cache)),
            batch: Vec::with_capacity(256),
            _endpoint: endpoint,
            misses: ctx.counter("table_miss_drops"),
            cache_hits: ctx.counter("exact_match_cache_hits"),
            switch_over_ns: ctx.counter("switch_over_ns"),
            switch_over_max_ns: ctx.counter("switch_over_max_ns"),
            direct_packets: ctx.counter("point_to_point_packets"),
            channels: Vec::new(),
            channels_in_use: ctx.counter("direct_channels"),
            channel_packets: ctx.counter("direct_channel_packets"),
            handover_ns: ctx.counter("direct_handover_ns"),
            handback_ns: ctx.counter("direct_handback_ns"),
            to_controller: ctx.counter("packet_ins"),
            controller_drops: ctx.counter("packet_in_drops"),
        })
    }

    fn pull(&mut self, io: &mut Io) {
        let v = self.shared.version.load(Ordering::Acquire);
        if v != self.seen {
            self.entries = self.shared.snapshot.lock().unwrap().clone();
            self.direct = table::point_to_point(&self.entries, self.shared.ports.len());
            if let Some(c) = &mut self.cache {
                c.clear();
            }
            self.seen = v;
            self.manage_channels(io);
            self.pending_version = Some(v);
        }
        if let Some(v) = self.pending_version {
            // A table is in effect once no channel the old one allowed still carries packets:
            // a BARRIER is answered only then.
            if self.channels.iter().all(|c| !c.direct.is_draining()) {
                let took = (self.shared.started.elapsed().as_nanos() as u64)
                    .saturating_sub(self.shared.published_ns.load(Ordering::Relaxed));
                self.switch_over_ns.set(took);
                if took > self.switch_over_max_ns.get() {
                    self.switch_over_max_ns.set(took);
                }
                self.shared.applied.store(v, Ordering::Release);
                self.pending_version = None;
            }
        }
        if self.shared.has_packet_outs.swap(false, Ordering::AcqRel) {
            let outs = std::mem::take(&mut *self.shared.packet_outs.lock().unwrap());
            for (in_port, actions, data) in outs {
                let Some(mut p) = stitch_core::pool::alloc() else {
                    continue;
                };
                if p.set_data(&data).is_err() {
                    continue;
                }
                let key = Key::of(p.data(), in_port);
                self.execute(p, &key, &actions, 0, io);
            }
            self.flush_tx_counters();
        }
    }

    fn push(&mut self, io: &mut Io) {
        let entries = self.entries.clone();
        for i in 0..self.shared.ports.len() {
            if let Some((entry, out)) = self.direct[i].clone() {
                self.forward_direct(io, i, &entry, out as usize - 1);
                continue;
            }
            let Some(input) = io.input(i) else { continue };
            let mut batch = std::mem::take(&mut self.batch);
            batch.extend(input.drain());
            if batch.is_empty() {
                self.batch = batch;
                continue;
            }
            let port = i as u32 + 1;
            let pc = &self.shared.port_counters[i];
            pc.rx_packets
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            pc.rx_bytes.fetch_add(
                batch.iter().map(|p| p.len() as u64).sum(),
                Ordering::Relaxed,
            );
            self.shared
                .lookups
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            let cached = entries.len() > CACHE_FROM_FLOWS;
            // Flow counters are added once per run of packets that met the same entry, not
            // once per packet: no locked add per packet on lines the OpenFlow side reads.
            let mut run: Option<(usize, u64, u64)> = None;
            let (mut matched, mut hits) = (0u64, 0u64);
            for p in batch.drain(..) {
                let key = Key::of(p.data(), port);
                let found = match (&mut self.cache, cached) {
                    (Some(c), true) => {
                        let (f, hit) = c.lookup(&entries, &key);
                        hits += hit as u64;
                        f
                    }
                    _ => table::position(&entries, &key),
                };
                let Some(i) = found else {
                    self.misses.add(1);
                    continue;
                };
                matched += 1;
                match &mut run {
                    Some((at, n, b)) if *at == i => {
                        *n += 1;
                        *b += p.len() as u64;
                    }
                    _ => {
                        if let Some((at, n, b)) = run.take() {
                            entries[at].packets.fetch_add(n, Ordering::Relaxed);
                            entries[at].bytes.fetch_add(b, Ordering::Relaxed);
                        }
                        run = Some((i, 1, p.len() as u64));
                    }
                }
                let e = &entries[i];
                self.execute(p, &key, &e.actions, e.cookie, io);
            }
            if let Some((at, n, b)) = run {
                entries[at].packets.fetch_add(n, Ordering::Relaxed);
                entries[at].bytes.fetch_add(b, Ordering::Relaxed);
            }
            self.shared.matched.fetch_add(matched, Ordering::Relaxed);
            self.cache_hits.add(hits);
            self.batch = batch;
        }
        self.flush_tx_counters();
        for c in &self.channels {
            let consumed = io.input(c.from).map(|i| i.ring().rx_packets());
            let sent = io.output(c.to).map(|o| o.ring().tx_packets());
            if let (Some(consumed), Some(sent)) = (consumed, sent) {
                c.direct.switch_progress(consumed, sent);
            }
        }
    }

    fn tick(&mut self, io: &mut Io, _now: std::time::Instant) {
        if !self.channels.is_empty() || self.direct.iter().any(Option::is_some) {
            self.manage_channels(io);
        }
    }

    fn stop(&mut self) {
        for c in &self.channels {
            c.direct.end();
        }
    }

    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        let t = self.shared.table.lock().unwrap();
        let flows: Vec<_> = t
            .entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "priority": e.priority, "cookie": e.cookie, "match": format!("{:?}", e.matching),
                    "actions": format!("{:?}", e.actions),
                    "packets": e.packets.load(Ordering::Relaxed), "bytes": e.bytes.load(Ordering::Relaxed),
                })
            })
            .collect();
        let channels: Vec<_> = self
            .channels
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
            .collect();
        serde_json::json!({
            "datapath_id": format!("{:016x}", self.shared.datapath_id),
            "flows": flows,
            "direct_channels": channels,
        })
    }
}

impl Switch {
    /// Applies `actions` to `p` in order; every output sends the packet as it is at that point.
    fn execute(&mut self, mut p: Packet, key: &Key, actions: &[Action], cookie: u64, io: &mut Io) {
        let outputs = actions
            .iter()
            .filter(|a| matches!(a, Action::Output(_)))
            .count();
        let mut sent = 0;
        for a in actions {
            match a {
                Action::Output(port) => {
                    sent += 1;
                    let last = sent == outputs;
                    match *port {
                        PORT_CONTROLLER => {
                            let mut q = self.shared.packet_ins.lock().unwrap();
                            if q.len() < MAX_PACKET_INS {
                                q.push_back(PacketIn {
                                    in_port: key.in_port,
                                    reason: 1,
                                    cookie,
                                    data: p.data().to_vec(),
                                });
                                self.to_controller.add(1);
                            } else {
                                self.controller_drops.add(1);
                            }
                        }
                        PORT_FLOOD | PORT_ALL => {
                            for i in 0..self.shared.ports.len() as u32 {
                                if i + 1 != key.in_port {
                                    if let Some(c) = p.try_clone() {
                                        self.send(c, i + 1, io);
                                    }
                                }
                            }
                        }
                        n => {
                            let n = if n == PORT_IN_PORT { key.in_port } else { n };
                            if last {
                                return self.send(p, n, io);
                            }
                            if let Some(c) = p.try_clone() {
                                self.send(c, n, io);
                            }
                        }
                    }
                }
                Action::PushVlan(tpid) => {
                    let _ = stitch_wire::vlan::push(&mut p, *tpid, 0);
                }
                Action::PopVlan => {
                    stitch_wire::vlan::pop(&mut p);
                }
                Action::SetEthDst(m) => {
                    if let Some(d) = p.data_mut().get_mut(0..6) {
                        d.copy_from_slice(m);
                    }
                }
                Action::SetEthSrc(m) => {
                    if let Some(d) = p.data_mut().get_mut(6..12) {
                        d.copy_from_slice(m);
                    }
                }
                Action::SetVlanVid(v) => {
                    stitch_wire::vlan::set_vid(p.data_mut(), v & 0x0fff);
                }
            }
        }
    }

    /// A point-to-point port: whole batches move ring to ring without a lookup per packet,
    /// in order, with back-pressure instead of drops; flow and port counters count them all.
    fn forward_direct(&mut self, io: &mut Io, from: usize, entry: &FlowEntry, to: usize) {
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
        entry.packets.fetch_add(n, Ordering::Relaxed);
        entry.bytes.fetch_add(bytes, Ordering::Relaxed);
        let (rx, tx) = (
            &self.shared.port_counters[from],
            &self.shared.port_counters[to],
        );
        rx.rx_packets.fetch_add(n, Ordering::Relaxed);
        rx.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
        tx.tx_packets.fetch_add(n, Ordering::Relaxed);
        tx.tx_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.shared.lookups.fetch_add(n, Ordering::Relaxed);
        self.shared.matched.fetch_add(n, Ordering::Relaxed);
        self.direct_packets.add(n);
    }

    /// Gives point-to-point pairs of function ports a direct channel, takes back those the
    /// rules or the functions no longer allow, counts what crossed them.
    fn manage_channels(&mut self, io: &mut Io) {
        let function_port = |tag: Option<&stitch_core::link::EndTag>| {
            tag.and_then(|t| t.clone().downcast::<PortShared>().ok())
        };
        // Ends of the pair as the links say now.
        let ends = |io: &mut Io, from: usize, to: usize| {
            let a = function_port(io.input(from)?.ring().producer_end())?;
            let b = function_port(io.output(to)?.ring().consumer_end())?;
            (!Arc::ptr_eq(&a, &b)).then_some((a, b))
        };
        let mut in_use = 0;
        let mut i = 0;
        while i < self.channels.len() {
            let c = &mut self.channels[i];
            let now = c.direct.counts();
            let (p, b) = (now.0 - c.counted.0, now.1 - c.counted.1);
            c.counted = now;
            if p > 0 {
                c.entry.packets.fetch_add(p, Ordering::Relaxed);
                c.entry.bytes.fetch_add(b, Ordering::Relaxed);
                let pc = &self.shared.port_counters;
                pc[c.from].rx_packets.fetch_add(p, Ordering::Relaxed);
                pc[c.from].rx_bytes.fetch_add(b, Ordering::Relaxed);
                pc[c.to].tx_packets.fetch_add(p, Ordering::Relaxed);
                pc[c.to].tx_bytes.fetch_add(b, Ordering::Relaxed);
                self.shared.lookups.fetch_add(p, Ordering::Relaxed);
                self.shared.matched.fetch_add(p, Ordering::Relaxed);
                self.channel_packets.add(p);
            }
            let phase = c.direct.phase();
            if !c.handover_reported && c.direct.handover_ns.load(Ordering::Relaxed) > 0 {
                c.handover_reported = true;
                self.handover_ns
                    .set(c.direct.handover_ns.load(Ordering::Relaxed));
            }
            if phase == Phase::Retired {
                self.handback_ns
                    .set(c.direct.handback_ns.load(Ordering::Relaxed));
                self.channels.swap_remove(i);
                continue;
            }
            let still = match &self.direct[c.from] {
                Some((entry, out)) if *out as usize - 1 == c.to => {
                    c.entry = entry.clone();
                    let current =
                        |p: &PortShared| p.current.lock().unwrap().as_ref().map(|c| c.generation);
                    let (from, to) = (c.from, c.to);
                    let d = c.direct.clone();
                    ends(io, from, to).is_some_and(|(a, b)| {
                        Arc::ptr_eq(&a, &d.from)
                            && Arc::ptr_eq(&b, &d.to)
                            && current(&a) == Some(d.sender.generation)
                            && current(&b) == Some(d.receiver.generation)
                    })
                }
                _ => false,
            };
            if !still {
                c.direct.end();
            } else if phase == Phase::ReceiverReads {
                in_use += 1;
            }
            i += 1;
        }
        self.channels_in_use.set(in_use);
        for from in 0..self.direct.len() {
            let Some((entry, out)) = self.direct[from].clone() else {
                continue;
            };
            let to = out as usize - 1;
            if self.channels.iter().any(|c| c.from == from || c.to == to) {
                continue; // One at a time per port: an ending channel retires first.
            }
            let Some((a, b)) = ends(io, from, to) else {
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
                        entry,
                        handover_reported: false,
                        counted: (0, 0),
                    });
                }
                Err(e) => log::debug!("switch `{}`: no direct channel: {e}", self.shared.name),
            }
        }
    }

    fn send(&mut self, p: Packet, port: u32, io: &mut Io) {
        let Some(i) = (port as usize)
            .checked_sub(1)
            .filter(|i| *i < self.shared.ports.len())
        else {
            return;
        };
        let len = p.len() as u64;
        let sent = io.output(i).is_some_and(|o| o.transmit(p));
        let t = &mut self.tx_pending[i];
        if sent {
            t[0] += 1;
            t[1] += len;
        } else {
            t[2] += 1;
        }
    }

    /// Adds what `send` counted to the shared port counters.
    fn flush_tx_counters(&mut self) {
        for (t, pc) in self.tx_pending.iter_mut().zip(&self.shared.port_counters) {
            if *t != [0; 3] {
                pc.tx_packets.fetch_add(t[0], Ordering::Relaxed);
                pc.tx_bytes.fetch_add(t[1], Ordering::Relaxed);
                pc.tx_dropped.fetch_add(t[2], Ordering::Relaxed);
                *t = [0; 3];
            }
        }
    }
}

pub fn register(r: &mut Registry) {
    r.register(AppType::of::<Switch>(
        "switch",
        "OpenFlow 1.3 switch between numbered ports, programmed by a controller (ovs-ofctl, os-ken)",
    ));
}
