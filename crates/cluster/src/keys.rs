//! The key layout in etcd and the records stored under each key (JSON values). One page of
//! `docs/cluster.md` says the same for operators.
//!
//! | key | value | written by | lease |
//! |---|---|---|---|
//! | `/stitch/hosts/NAME` | [`HostRecord`]: underlay address and MAC, labels, placements it can run | its agent, at start | none: kept while the host is down, so its tunnels can stay |
//! | `/stitch/alive/NAME` | the agent's process id | its agent | the agent's (liveness) |
//! | `/stitch/graphs/NAME` | [`GraphRecord`]: the cluster graph file's text | `stitch cluster apply` (compare-and-swap on its revision) | none |
//! | `/stitch/placements/NAME` | [`PlacementRecord`]: where each app of graph NAME runs, its tunnels and their VNIs | the elected controller | none |
//! | `/stitch/assign/HOST` | [`Assignment`]: the graph document HOST runs | the elected controller | none |
//! | `/stitch/status/HOST` | [`StatusRecord`]: what HOST applied, or why it could not | its agent | none |
//! | `/stitch/election` | etcd's election API (v3election) | every agent campaigns | the agent's |

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

pub const PREFIX: &str = "/stitch/";
pub const HOSTS: &str = "/stitch/hosts/";
pub const ALIVE: &str = "/stitch/alive/";
pub const GRAPHS: &str = "/stitch/graphs/";
pub const PLACEMENTS: &str = "/stitch/placements/";
pub const ASSIGN: &str = "/stitch/assign/";
pub const STATUS: &str = "/stitch/status/";
/// The election every agent campaigns in; its leader runs the placement controller.
pub const ELECTION: &str = "/stitch/election";

pub fn host(name: &str) -> String {
    format!("{HOSTS}{name}")
}
pub fn alive(name: &str) -> String {
    format!("{ALIVE}{name}")
}
pub fn graph(name: &str) -> String {
    format!("{GRAPHS}{name}")
}
pub fn placement(name: &str) -> String {
    format!("{PLACEMENTS}{name}")
}
pub fn assign(host: &str) -> String {
    format!("{ASSIGN}{host}")
}
pub fn status(host: &str) -> String {
    format!("{STATUS}{host}")
}

/// The last part of `key` after `prefix`, when it starts with it.
pub fn name_in<'a>(key: &'a [u8], prefix: &str) -> Option<&'a str> {
    std::str::from_utf8(key).ok()?.strip_prefix(prefix)
}

/// A host of the cluster as its agent registers it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostRecord {
    /// The address VXLAN tunnels to this host are sent to.
    pub underlay: IpAddr,
    /// The interface holding that address, and its MAC (the outer destination of tunnelled
    /// frames: the underlay is one Ethernet segment).
    pub interface: String,
    pub mac: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The placements this host can run (`engine`, `process`, `kernel`, `vm`).
    #[serde(default)]
    pub placements: Vec<String>,
    /// A TCP port on the underlay address where the agent accepts connections while its
    /// process runs (0: none): the controller's way to tell a host cut off from etcd from a
    /// dead one.
    #[serde(default)]
    pub probe_port: u16,
    /// The MTU of `interface`: the largest packet the underlay carries from this host.
    #[serde(default = "ethernet_mtu")]
    pub mtu: u32,
    /// The programs and files cluster graphs may run here (`--allow-commands`; none: no
    /// process and no VM).
    #[serde(default)]
    pub allowed: crate::allow::Allowed,
}

fn ethernet_mtu() -> u32 {
    1500
}

impl HostRecord {
    /// Bytes VXLAN adds to a tunnelled frame's IP packet from this host: IPv4 or IPv6, UDP,
    /// VXLAN and the inner Ethernet header (RFC 7348 §5).
    pub fn tunnel_overhead(&self) -> u32 {
        if self.underlay.is_ipv4() {
            50
        } else {
            70
        }
    }
}

/// A cluster graph as `stitch cluster apply` stored it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GraphRecord {
    /// The graph file's text, as given (errors found later still name its lines).
    pub text: String,
    /// The file it came from (for error messages).
    pub file: String,
    /// Its folder, which relative paths in app settings are resolved from on every host.
    #[serde(default)]
    pub dir: String,
}

/// Where one app of a graph runs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AppPlace {
    /// The host, or none when no live host may run it.
    pub host: Option<String>,
    /// `running`, `host-down` (pinned to a host whose agent is gone: its tunnels stay, the host
    /// may still forward) or `unplaced` (with the reason).
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A link whose two ends run on different hosts, carried by VXLAN.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tunnel {
    /// The link as the graph file writes it (`a.out -> b.in`).
    pub link: String,
    pub vni: u32,
    pub from_host: String,
    pub to_host: String,
}

/// The controller's decision for one graph.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PlacementRecord {
    /// The revision of the graph record this placement was computed from.
    pub graph_revision: i64,
    /// Why the graph could not be placed at all (it no longer parses), if so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub apps: BTreeMap<String, AppPlace>,
    pub tunnels: Vec<Tunnel>,
    /// Each host with a part of the graph → the graph revision its host graph realises (a
    /// host whose part did not change keeps an older one and is not written again): the graph
    /// runs everywhere once each host reports at least its revision here.
    #[serde(default)]
    pub hosts: BTreeMap<String, i64>,
}

/// What one host runs: a graph document in the graph file's shape, and which graph revisions
/// it realises.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Assignment {
    /// Graph name → revision of its record.
    pub graphs: BTreeMap<String, i64>,
    pub document: serde_json::Value,
    /// The largest IP packet a workload can send across any tunnel of the cluster (the
    /// smallest underlay MTU less the encapsulation): `stitch-cni` gives containers this MTU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_mtu: Option<u32>,
}

impl Assignment {
    /// Whether `other` gives the host what this one does (its document and workload MTU, from
    /// the same graphs), whatever revisions of those graphs each was made from.
    pub fn same_part(&self, other: &Assignment) -> bool {
        self.document == other.document
            && self.workload_mtu == other.workload_mtu
            && self.graphs.keys().eq(other.graphs.keys())
    }
}

/// What an agent reports after each apply.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusRecord {
    /// The etcd revision of the assignment it applied last (0: none yet).
    pub assignment_revision: i64,
    /// Graph name → the graph revision now running on this host.
    pub graphs: BTreeMap<String, i64>,
    /// Why the last assignment could not be applied (the host runs the one before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Apps running on this host.
    pub apps: usize,
    /// Seconds since the epoch.
    pub at: u64,
}

/// Everything under [`PREFIX`] at one revision, decoded. A value that does not decode is left
/// out and named in `malformed` (nothing here trusts another writer of the same etcd).
#[derive(Debug, Default)]
pub struct ClusterState {
    pub revision: i64,
    pub hosts: BTreeMap<String, HostRecord>,
    /// Hosts whose agent holds its liveness lease.
    pub live: std::collections::BTreeSet<String>,
    /// Graph name → its record and the revision it was written at.
    pub graphs: BTreeMap<String, (GraphRecord, i64)>,
    pub placements: BTreeMap<String, PlacementRecord>,
    /// Host → its assignment and the revision it was written at.
    pub assignments: BTreeMap<String, (Assignment, i64)>,
    pub statuses: BTreeMap<String, StatusRecord>,
    /// The host whose agent leads (runs the controller), if any.
    pub leader: Option<String>,
    pub malformed: Vec<String>,
}

impl ClusterState {
    pub fn decode(revision: i64, kvs: &[etcd_client::KeyValue]) -> ClusterState {
        fn take<T: serde::de::DeserializeOwned>(
            kv: &etcd_client::KeyValue,
            name: &str,
            malformed: &mut Vec<String>,
        ) -> Option<(String, T)> {
            match serde_json::from_slice(kv.value()) {
                Ok(v) => Some((name.to_string(), v)),
                Err(e) => {
                    malformed.push(format!("{}: {e}", String::from_utf8_lossy(kv.key())));
                    None
                }
            }
        }
        let mut s = ClusterState {
            revision,
            ..Default::default()
        };
        let mut leader: Option<(i64, String)> = None;
        for kv in kvs {
            let key = kv.key();
            let m = &mut s.malformed;
            if let Some(n) = name_in(key, HOSTS) {
                s.hosts.extend(take(kv, n, m));
            } else if let Some(n) = name_in(key, ALIVE) {
                s.live.insert(n.to_string());
            } else if let Some(n) = name_in(key, GRAPHS) {
                if let Some((n, g)) = take(kv, n, m) {
                    s.graphs.insert(n, (g, kv.mod_revision()));
                }
            } else if let Some(n) = name_in(key, PLACEMENTS) {
                s.placements.extend(take(kv, n, m));
            } else if let Some(n) = name_in(key, ASSIGN) {
                if let Some((n, a)) = take(kv, n, m) {
                    s.assignments.insert(n, (a, kv.mod_revision()));
                }
            } else if let Some(n) = name_in(key, STATUS) {
                s.statuses.extend(take(kv, n, m));
            } else if name_in(key, ELECTION).is_some_and(|rest| rest.starts_with('/')) {
                // etcd's election: the candidate whose key is oldest leads.
                let host = String::from_utf8_lossy(kv.value()).into_owned();
                if leader
                    .as_ref()
                    .is_none_or(|(rev, _)| kv.create_revision() < *rev)
                {
                    leader = Some((kv.create_revision(), host));
                }
            }
        }
        s.leader = leader.map(|(_, h)| h);
        s
    }
}
