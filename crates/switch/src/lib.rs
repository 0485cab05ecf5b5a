//! `switch`: an OpenFlow 1.3 switch between numbered ports (with the inter-VNF bypass of
//! docs/references.md). Each name in `ports` is an input and an output of the app and OpenFlow port
//! 1, 2, … in that order. Controllers — `ovs-ofctl`, os-ken, Faucet, any OpenFlow 1.3 controller,
//! several at once with roles — program its pipeline over TCP (`listen` for a passive endpoint,
//! `controller` to dial one).
//!
//! ```yaml
//! apps:
//!   sw: { type: switch, ports: [a, b, c], listen: "127.0.0.1:6653" }
//! links:
//!   - "host_a.output -> sw.a"
//!   - "sw.a -> host_a.input"
//! ```
//!
//! The pipeline is the specification's (§5): 64 flow tables walked from table 0 by goto-table,
//! instructions meter / apply-actions / clear-actions / write-actions / write-metadata, the
//! action set run at the end in the specification's order, groups (all, select, indirect,
//! fast-failover), meters (drop and DSCP-remark bands), idle and hard timeouts with
//! FLOW_REMOVED, PORT_STATUS, roles and asynchronous-message filters per controller
//! ([`pipeline`], [`oxm`], [`action`], [`group`], [`meter`], [`endpoint`]). A packet no entry
//! matches is dropped and counted (1.3's table miss without a table-miss entry).
//!
//! When the pipeline sends all of a port's traffic to one other port (point to point, through
//! goto-table too), that port's packets move ring to ring in whole batches without a lookup
//! each, and still count in every entry's, table's and port's statistics; the switch-over
//! happens between two batches, so nothing is lost or reordered. When both ends of such a pair
//! are zero-copy function ports (`nf_port`), the switch steps out of the path altogether
//! (the inter-VNF bypass, [`bypass`]).
//!
//! # Map
//!
//! The modules, in short: the `switch` app (OpenFlow 1.3, `docs/openflow.md`): `ofp` (message
//! framing, error codes), `oxm` (match fields, prerequisites, the 168-byte packet key and
//! masked-word matching), `action` (actions and the frame rewrites they make, checksums kept; a
//! PACKET_OUT read), `pipeline` (64 tables, instructions, FLOW_MOD rules, timeouts, point-to-point
//! detection through goto-table; each snapshot's instructions packed for the data path), `group`
//! and `meter` (GROUP_MOD/METER_MOD, select hashing, token buckets), `datapath` (a packet's walk
//! through the tables, action set, groups, meters, packet-ins; port and table counters flushed per
//! push, flow counters every 10 ms), `cache` (per-table exact-match caches and the pipeline's walk
//! cache, keyed on the bits the tables look at, in fixed two-place arrays fetched ahead);
//! `frame_key`: an IPv4 frame's walk found from its first bytes under a mask per pipeline, before
//! its key is read), `net` (a remembered walk's net effect: each output's port and new first bytes,
//! when its actions touch only the addresses and the outer tag), `endpoint` (controller connections
//! — TCP, or TLS with certificates both ways through `tls` — with roles and async filters,
//! statistics, a timer for timeouts and PORT_STATUS; snapshots published to the data path, a
//! BARRIER answered once the data path runs them), `bypass` (point-to-point batches and direct
//! channels between function ports), `vm_paths` (direct paths between VM ports).

pub mod action;
mod bypass;
mod cache;
mod datapath;
pub mod endpoint;
pub mod frame_key;
pub mod group;
pub mod meter;
mod net;
mod ofctl_text;
pub mod ofp;
pub mod oxm;
pub mod pipeline;
mod saved;
pub mod tls;
mod vm_paths;

use pipeline::{FlowEntry, P2p, TABLES};
use serde::Deserialize;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use stitch_core::app::{AppContext, AppError, Counter, Io, PortNames, PortSpec};
use stitch_core::{App, AppSnapshot, AppState, AppType, Descriptors, Registry};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
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
    /// Keys remembered per table by the exact-match cache in front of its priority scan
    /// (used once a table holds more than a few flows); 0 turns it off.
    #[serde(default = "default_cache")]
    pub exact_match_cache: usize,
    /// Point-to-point pairs of zero-copy function ports or of VM ports get a direct channel
    /// or path (the switch out of their way, its counters kept); false: the switch carries
    /// every packet itself.
    #[serde(default = "yes")]
    pub direct_paths: bool,
    /// A plain `listen` on an address other hosts reach (anyone who reaches it reprograms the
    /// switch): refused unless this says so.
    #[serde(default)]
    pub insecure: bool,
    /// `ssl:` endpoints (`listen`, `controller`): the switch's certificate chain (PEM).
    #[serde(default)]
    pub cert: Option<std::path::PathBuf>,
    /// `ssl:` endpoints: the switch's private key (PEM; mode 0600, Stitch's or root's).
    #[serde(default)]
    pub key: Option<std::path::PathBuf>,
    /// `ssl:` endpoints: the CA that signed the controllers' certificates (PEM); a controller
    /// without a certificate it signed is refused.
    #[serde(default)]
    pub ca: Option<std::path::PathBuf>,
}

impl SwitchConfig {
    /// Whether an endpoint speaks TLS.
    fn uses_tls(&self) -> bool {
        [&self.listen, &self.controller]
            .into_iter()
            .flatten()
            .any(|a| tls::split(a).0 == tls::Transport::Tls)
    }
}

fn default_cache() -> usize {
    8192
}

fn yes() -> bool {
    true
}

/// Per-port counters, as OpenFlow port statistics report them.
#[derive(Default)]
pub struct PortCounters {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub tx_dropped: AtomicU64,
}

/// Per-table lookup and match counters (TABLE statistics).
#[derive(Default)]
pub struct TableCounters {
    pub lookups: AtomicU64,
    pub matched: AtomicU64,
}

/// A frame from the controller: in-port, actions, bytes.
pub type PacketOut = (u32, Vec<action::Action>, Vec<u8>);

/// What the controllers own: flow tables, groups and meters.
#[derive(Default)]
pub struct State {
    pub flows: pipeline::FlowTables,
    pub groups: group::GroupTable,
    pub meters: meter::MeterTable,
}

/// What the data path runs: a copy of the pipeline taken when it last changed.
#[derive(Default)]
pub struct Snapshot {
    pub tables: Vec<Vec<Arc<FlowEntry>>>,
    /// The entries' instructions packed table by table, as the data path reads them.
    pub program: pipeline::Program,
    pub groups: BTreeMap<u32, Arc<group::Group>>,
    pub meters: BTreeMap<u32, Arc<meter::Meter>>,
}

/// The kinds of asynchronous messages a controller can filter (SET_ASYNC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Async {
    PacketIn = 0,
    PortStatus = 1,
    FlowRemoved = 2,
}

pub const ROLE_NOCHANGE: u32 = 0;
pub const ROLE_EQUAL: u32 = 1;
pub const ROLE_MASTER: u32 = 2;
pub const ROLE_SLAVE: u32 = 3;

/// One controller connection as the switch side sees it.
pub struct Connection {
    pub outbox: Mutex<VecDeque<Vec<u8>>>,
    pub role: AtomicU32,
    /// SET_ASYNC masks: [packet-in, port-status, flow-removed] × [master/equal, slave].
    pub async_masks: Mutex<[[u32; 2]; 3]>,
    pub dropped: AtomicU64,
    /// Each port's link as this controller was last told (PORT_DESC, PORT_STATUS); `None`
    /// until it asked or the data path first looked.
    pub ports_told: Mutex<Option<Vec<bool>>>,
}

/// Messages waiting for a controller that does not read them are dropped past this.
const OUTBOX_LIMIT: usize = 4096;

impl Default for Connection {
    fn default() -> Self {
        Connection {
            outbox: Mutex::new(VecDeque::new()),
            role: AtomicU32::new(ROLE_EQUAL),
            // §6.1.1: by default a slave gets only port status.
            async_masks: Mutex::new([[0b11, 0], [0b111, 0b111], [0b1111, 0]]),
            dropped: AtomicU64::new(0),
            ports_told: Mutex::new(None),
        }
    }
}

impl Connection {
    pub fn wants(&self, kind: Async, reason: u8) -> bool {
        let slave = self.role.load(Ordering::Relaxed) == ROLE_SLAVE;
        let masks = self.async_masks.lock().unwrap();
        masks[kind as usize][slave as usize] & (1 << reason) != 0
    }

    /// Queues `msg` for this controller; false (and counted) when its outbox is full.
    pub fn post(&self, msg: Vec<u8>) -> bool {
        let mut q = self.outbox.lock().unwrap();
        if q.len() < OUTBOX_LIMIT {
            q.push_back(msg);
            true
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// What the data path and the OpenFlow side share.
pub struct Shared {
    pub name: String,
    pub ports: Vec<String>,
    pub datapath_id: u64,
    pub state: Mutex<State>,
    pub snapshot: Mutex<Arc<Snapshot>>,
    pub version: AtomicU64,
    pub applied: AtomicU64,
    /// When the newest pipeline was published (ns since `started`), for the switch-over time.
    pub published_ns: AtomicU64,
    pub port_counters: Vec<PortCounters>,
    /// Whether each port's output is connected (its link is up), as the data path last saw.
    pub port_live: Vec<AtomicBool>,
    /// Set once the data path has filled `port_live` (before that nothing has changed).
    pub ports_known: AtomicBool,
    pub table_counters: Vec<TableCounters>,
    pub connections: Mutex<Vec<Arc<Connection>>>,
    /// The highest generation id a master or slave role request carried (§6.3.6).
    pub generation_id: Mutex<Option<u64>>,
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
            state: Mutex::new(State::default()),
            snapshot: Mutex::new(Arc::new(Snapshot {
                tables: vec![Vec::new(); TABLES],
                program: pipeline::Program::of(&vec![Vec::new(); TABLES]),
                ..Snapshot::default()
            })),
            version: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            published_ns: AtomicU64::new(0),
            port_counters: ports.iter().map(|_| PortCounters::default()).collect(),
            port_live: ports.iter().map(|_| AtomicBool::new(false)).collect(),
            ports_known: AtomicBool::new(false),
            table_counters: (0..TABLES).map(|_| TableCounters::default()).collect(),
            connections: Mutex::new(Vec::new()),
            generation_id: Mutex::new(None),
            packet_outs: Mutex::new(Vec::new()),
            has_packet_outs: AtomicBool::new(false),
            started: std::time::Instant::now(),
        }
    }

    pub fn now_ns(&self) -> u64 {
        self.started.elapsed().as_nanos() as u64
    }

    /// Publishes the controllers' pipeline to the data path.
    pub fn publish(&self, s: &State) {
        let snap = Snapshot {
            tables: s.flows.tables.clone(),
            program: pipeline::Program::of(&s.flows.tables),
            groups: s.groups.groups.clone(),
            meters: s.meters.meters.clone(),
        };
        *self.snapshot.lock().unwrap() = Arc::new(snap);
        self.published_ns.store(self.now_ns(), Ordering::Relaxed);
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Sends an asynchronous message to every controller whose role and filters take it;
    /// whether at least one queued it.
    pub fn send_async(&self, kind: Async, reason: u8, msg: &[u8]) -> bool {
        let mut delivered = false;
        for c in self.connections.lock().unwrap().iter() {
            if c.wants(kind, reason) {
                delivered |= c.post(msg.to_vec());
            }
        }
        delivered
    }
}

pub struct Switch {
    shared: Arc<Shared>,
    snap: Arc<Snapshot>,
    /// Per input port: where its traffic all goes, when it all goes to one other port.
    direct: Vec<Option<P2p>>,
    seen: u64,
    /// A pipeline the data path runs, not yet announced as applied.
    pending_version: Option<u64>,
    dp: datapath::DataPath,
    _endpoint: Option<endpoint::Endpoint>,
    /// The passive endpoint's socket, to hand over at an upgrade.
    listener: Option<std::net::TcpListener>,
    channels: Vec<bypass::Channel>,
    /// Direct paths between VM ports ([`vm_paths`]).
    vm_paths: Vec<vm_paths::VmPath>,
    /// `direct_paths` of the config.
    offers_direct: bool,
    /// An upgrade began: the functions' direct channels go back through the switch (no
    /// successor can take one over) and none is offered until it is abandoned.
    handing_over: bool,
    counters: Counters,
}

/// The app's own counters (`stitch stats`).
struct Counters {
    misses: Counter,
    cache_hits: Counter,
    /// From a pipeline's publication to the data path running it (the last change), and the
    /// longest so far.
    switch_over_ns: Counter,
    switch_over_max_ns: Counter,
    direct_packets: Counter,
    channels_in_use: Counter,
    channel_packets: Counter,
    /// The last channel's hand-over (offer → the receiving function reads it) and hand-back
    /// (end asked → retired).
    handover_ns: Counter,
    handback_ns: Counter,
    to_controller: Counter,
    controller_drops: Counter,
    meter_drops: Counter,
    ttl_drops: Counter,
}

impl App for Switch {
    type Config = SwitchConfig;
    const EXAMPLE: &'static str = r#"ports: [p1, p2, p3]
listen: "127.0.0.1:6653"
"#;

    fn check_host(c: &SwitchConfig, base_dir: &std::path::Path) -> Vec<String> {
        [("cert", &c.cert), ("key", &c.key), ("ca", &c.ca)]
            .into_iter()
            .filter_map(|(key, f)| stitch_core::files::missing(key, f.as_ref()?, base_dir))
            .collect()
    }

    fn declare(c: &SwitchConfig) -> Result<PortSpec, AppError> {
        if c.ports.is_empty() {
            return Err("`ports` needs at least one port name".into());
        }
        let plain_listen = (c.listen.as_deref())
            .map(tls::split)
            .filter(|(t, _)| *t == tls::Transport::Tcp);
        if let Some((_, listen)) = plain_listen.filter(|_| !c.insecure) {
            endpoint::check_listen_address(listen)?;
        }
        if c.uses_tls() && (c.cert.is_none() || c.key.is_none() || c.ca.is_none()) {
            return Err("an `ssl:` endpoint needs `cert`, `key` and `ca` (PEM files: the switch's certificate and key, and the CA of its controllers)".into());
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
        let listen = c.listen.as_deref().map(tls::split);
        let tls = match (c.uses_tls(), &c.cert, &c.key, &c.ca) {
            (true, Some(cert), Some(key), Some(ca)) => Some(Arc::new(tls::Tls::load(
                &ctx.path(cert.clone()),
                &ctx.path(key.clone()),
                &ctx.path(ca.clone()),
            )?)),
            _ => None,
        };
        let listener = match ctx.take_inherited() {
            Some(handed) => Some(adopt_listener(handed, listen.map(|(_, a)| a))?),
            None => listen.map(|(_, a)| endpoint::listen(a)).transpose()?,
        };
        let listen_tls = listen
            .filter(|(t, _)| *t == tls::Transport::Tls)
            .and(tls.clone());
        if let Some(addr) = listener.as_ref().and_then(|l| l.local_addr().ok()) {
            log::info!(
                "switch `{}`: OpenFlow controllers can connect on {}:{addr}",
                ctx.name(),
                if listen_tls.is_some() { "ssl" } else { "tcp" }
            );
        }
        let kept = (listener.as_ref())
            .map(|l| l.try_clone())
            .transpose()
            .map_err(|e| e.to_string())?;
        let controller = c.controller.as_deref().map(|a| {
            let (transport, addr) = tls::split(a);
            let tls = tls.clone().filter(|_| transport == tls::Transport::Tls);
            (addr.to_string(), tls)
        });
        let endpoint = endpoint::Endpoint::start(
            shared.clone(),
            listener.map(|l| (l, listen_tls)),
            controller,
        )?;
        let counters = Counters {
            misses: ctx.counter("table_miss_drops"),
            cache_hits: ctx.counter("exact_match_cache_hits"),
            switch_over_ns: ctx.counter("switch_over_ns"),
            switch_over_max_ns: ctx.counter("switch_over_max_ns"),
            direct_packets: ctx.counter("point_to_point_packets"),
            channels_in_use: ctx.counter("direct_channels"),
            channel_packets: ctx.counter("direct_channel_packets"),
            handover_ns: ctx.counter("direct_handover_ns"),
            handback_ns: ctx.counter("direct_handback_ns"),
            to_controller: ctx.counter("packet_ins"),
            controller_drops: ctx.counter("packet_in_drops"),
            meter_drops: ctx.counter("meter_drops"),
            ttl_drops: ctx.counter("ttl_expired_drops"),
        };
        let snap = shared.snapshot.lock().unwrap().clone();
        Ok(Switch {
            snap,
            dp: datapath::DataPath::new(c.ports.len(), c.exact_match_cache),
            shared,
            direct: vec![None; c.ports.len()],
            seen: 0,
            pending_version: None,
            _endpoint: endpoint,
            listener: kept,
            channels: Vec::new(),
            vm_paths: Vec::new(),
            offers_direct: c.direct_paths,
            handing_over: false,
            counters,
        })
    }

    fn pull(&mut self, io: &mut Io) {
        let v = self.shared.version.load(Ordering::Acquire);
        if v != self.seen {
            self.dp.flush_entries(&self.snap, self.shared.now_ns());
            self.snap = self.shared.snapshot.lock().unwrap().clone();
            self.direct = pipeline::point_to_point(&self.snap.tables, self.shared.ports.len());
            self.dp.clear_caches(&self.snap);
            self.seen = v;
            self.manage_channels(io);
            self.pending_version = Some(v);
        }
        if let Some(v) = self.pending_version {
            // A pipeline is in effect once no channel the old one allowed still carries
            // packets: a BARRIER is answered only then.
            if self.channels.iter().all(|c| !c.direct.is_draining())
                && self.vm_paths.iter().all(|v| !v.direct.is_draining())
            {
                let took = self
                    .shared
                    .now_ns()
                    .saturating_sub(self.shared.published_ns.load(Ordering::Relaxed));
                self.counters.switch_over_ns.set(took);
                if took > self.counters.switch_over_max_ns.get() {
                    self.counters.switch_over_max_ns.set(took);
                }
                self.shared.applied.store(v, Ordering::Release);
                self.pending_version = None;
            }
        }
        for (i, live) in self.shared.port_live.iter().enumerate() {
            live.store(io.output(i).is_some(), Ordering::Relaxed);
        }
        self.shared.ports_known.store(true, Ordering::Release);
        if self.shared.has_packet_outs.swap(false, Ordering::AcqRel) {
            let outs = std::mem::take(&mut *self.shared.packet_outs.lock().unwrap());
            let snap = self.snap.clone();
            for (in_port, actions, data) in outs {
                let Some(mut p) = stitch_core::pool::alloc() else {
                    continue;
                };
                if p.set_data(&data).is_err() {
                    continue;
                }
                self.dp
                    .packet_out(p, in_port, &actions, &snap, &self.shared, io);
            }
            self.flush(io);
        }
    }

    fn push(&mut self, io: &mut Io) {
        let snap = self.snap.clone();
        for i in 0..self.shared.ports.len() {
            if let Some(p2p) = self.direct[i].clone() {
                self.forward_direct(io, i, &p2p);
                continue;
            }
            self.dp.receive(i, &snap, &self.shared, io);
        }
        self.flush(io);
        for c in &self.channels {
            let consumed = io.input(c.from).map(|i| i.ring().rx_packets());
            let sent = io.output(c.to).map(|o| o.ring().tx_packets());
            if let (Some(consumed), Some(sent)) = (consumed, sent) {
                c.direct.switch_progress(consumed, sent);
            }
        }
        self.vm_paths_progress(io);
    }

    fn tick(&mut self, io: &mut Io, _now: std::time::Instant) {
        if !self.channels.is_empty()
            || !self.vm_paths.is_empty()
            || self.direct.iter().any(Option::is_some)
        {
            self.manage_channels(io);
        }
    }

    fn prepare_for_hand_over(&mut self) {
        self.handing_over = true;
        for c in &self.channels {
            c.direct.end();
        }
    }

    fn carry_on(&mut self) {
        self.handing_over = false;
    }

    fn stop(&mut self) {
        self.dp.flush_entries(&self.snap, self.shared.now_ns());
        for c in &self.channels {
            c.direct.end();
        }
        for v in &self.vm_paths {
            v.direct.end();
        }
    }

    /// Its meters, groups and flows as the OpenFlow messages that make them, with their
    /// counters (`saved`): a restarted switch forwards before its controller is back.
    fn snapshot(&self) -> Option<AppSnapshot> {
        let tables = saved::save(&self.shared);
        Some(AppSnapshot::new(saved::STATE_VERSION, tables))
    }

    fn restore(&mut self, state: AppState) -> Result<(), String> {
        let tables: saved::SavedTables =
            serde_json::from_value(state.of_version(saved::STATE_VERSION)?)
                .map_err(|e| format!("switch state: {e}"))?;
        let made = saved::restore(&self.shared, tables)?;
        log::info!(
            "switch `{}`: {made} meters, groups and flows taken back",
            self.shared.name
        );
        Ok(())
    }

    /// The passive OpenFlow endpoint's listening socket: controllers connect to the same
    /// socket throughout an upgrade.
    fn hand_over(&mut self) -> Option<Descriptors> {
        let l = self.listener.as_ref()?.try_clone().ok()?;
        Some(Descriptors {
            fds: vec![l.into()],
            position: serde_json::Value::Null,
        })
    }

    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        let s = self.shared.state.lock().unwrap();
        let flows: Vec<_> = s
            .flows
            .tables
            .iter()
            .flatten()
            .map(|e| {
                // `flow`: the line `ovs-ofctl --no-stats dump-flows` writes for it.
                serde_json::json!({
                    "flow": ofctl_text::flow_line(e.cookie, e.table, e.priority,
                        &e.matching.tlvs, &e.instructions),
                    "table": e.table, "priority": e.priority, "cookie": format!("{:#x}", e.cookie),
                    "packets": e.packets.load(Ordering::Relaxed), "bytes": e.bytes.load(Ordering::Relaxed),
                })
            })
            .collect();
        let groups: Vec<_> = s
            .groups
            .groups
            .values()
            .map(|g| {
                serde_json::json!({"group_id": g.id, "type": g.kind, "buckets": g.buckets.len(),
                "packets": g.packets.load(Ordering::Relaxed)})
            })
            .collect();
        let meters: Vec<_> = s
            .meters
            .meters
            .values()
            .map(|m| {
                serde_json::json!({"meter_id": m.id, "flags": m.flags, "bands": m.bands.len(),
                "packets": m.packets.load(Ordering::Relaxed)})
            })
            .collect();
        serde_json::json!({
            "datapath_id": format!("{:016x}", self.shared.datapath_id),
            "flows": flows,
            "groups": groups,
            "meters": meters,
            "controllers": self.shared.connections.lock().unwrap().len(),
            "direct_channels": self.channels_json(),
            "direct_vm_paths": self.vm_paths_json(),
        })
    }
}

/// The OpenFlow listener a predecessor process handed over, checked to be a TCP socket on the
/// address the config names.
fn adopt_listener(
    handed: Descriptors,
    listen: Option<&str>,
) -> Result<std::net::TcpListener, String> {
    let [fd]: [std::os::fd::OwnedFd; 1] = (handed.fds.try_into())
        .map_err(|fds: Vec<_>| format!("{} descriptors handed over, not 1", fds.len()))?;
    let l = std::net::TcpListener::from(fd);
    let at = l
        .local_addr()
        .map_err(|e| format!("the OpenFlow socket handed over: {e}"))?;
    let wanted: Option<std::net::SocketAddr> = listen.and_then(|a| a.parse().ok());
    if wanted.is_some_and(|w| w != at) {
        return Err(format!(
            "the OpenFlow socket handed over listens on {at}, the config on {}",
            listen.unwrap_or_default()
        ));
    }
    Ok(l)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Switch {
    /// Adds what the data path counted since the last flush to the shared counters.
    fn flush(&mut self, _io: &mut Io) {
        let now = self.shared.now_ns();
        let tally = self.dp.flush(&self.snap, &self.shared, now);
        self.counters.misses.add(tally.misses);
        self.counters.cache_hits.add(tally.cache_hits);
        self.counters.to_controller.add(tally.packet_ins);
        self.counters.controller_drops.add(tally.packet_in_drops);
        self.counters.meter_drops.add(tally.meter_drops);
        self.counters.ttl_drops.add(tally.ttl_drops);
    }
}

pub fn register(r: &mut Registry) {
    r.register(AppType::of::<Switch>(
        "switch",
        "OpenFlow 1.3 switch between numbered ports: 64-table pipeline, groups, meters, programmed by controllers (Faucet, os-ken, ovs-ofctl)",
    ));
}
