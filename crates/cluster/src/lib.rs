//! Graphs that span hosts (`docs/cluster.md`). The desired state lives in an etcd v3 cluster:
//! `stitch cluster apply` stores graph files whose apps may name a host (`host:`) or the
//! labels of the hosts they may run on (`hosts:`); every host runs `stitch agent`, which
//! registers the host under a lease, campaigns in etcd's election, and — while it leads —
//! runs the placement controller ([`schedule`]): it decides where each app runs, turns every
//! link between two hosts into a VXLAN tunnel, and writes each host's graph. Each agent watches
//! its own host's graph and applies it to its engine by the same live diff as `stitch apply`.
//!
//! Nothing here is a protocol of Stitch's own: liveness is etcd's leases, leadership its
//! election API, consistency its transactions and revisions.
//!
//! # Map
//!
//! The modules, in short: graphs across hosts on etcd (`docs/cluster.md`): `keys` (the key layout
//! and its records), `allow` (what a cluster graph may run on a host: `--allow-commands`, checked
//! by the controller and again by the agent), `etcd` (connections, TLS and credentials), `schedule`
//! (the placement decision, pure: pins, labels, stable placements, links between hosts as VXLAN
//! tunnels, each host's graph document), `controller` (runs in the elected agent: read, decide,
//! write in leader-guarded transactions, watch), `agent` (lease, election, the host's graph
//! followed and applied through the instance's API, status), `admin` (`stitch cluster
//! apply/status/delete/host remove`: checks, compare-and-swap; `check --cluster` offline).

pub mod admin;
pub mod agent;
pub mod allow;
pub mod controller;
pub mod etcd;
pub mod keys;
pub mod schedule;
