//! The placement controller: runs in the agent that etcd's election made leader. It reads the
//! cluster's state, computes the schedule ([`crate::schedule`]) and writes what changed —
//! placements and host graphs — in transactions that hold only while it still leads; then it
//! watches the hosts, their liveness and the graphs, and decides again on each change.

use crate::etcd::read_prefix;
use crate::keys::{self, ClusterState, PlacementRecord};
use crate::schedule::{self, ClusterGraph, Hosts};
use anyhow::{bail, Context, Result};
use etcd_client::{Client, Compare, CompareOp, LeaderKey, Txn, TxnOp, WatchOptions};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use stitch_core::Registry;
use stitch_place::PlacedGraph;

/// etcd refuses transactions of more than 128 operations (`--max-txn-ops`) or 1.5 MiB
/// (`--max-request-bytes`) by default.
const OPS_PER_TXN: usize = 100;
const BYTES_PER_TXN: usize = 1 << 20;
/// How often hosts kept by their probe alone are probed again.
const RECHECK: Duration = Duration::from_secs(1);
/// How long a probe of a host's agent waits for its connection.
const PROBE_TIMEOUT: Duration = Duration::from_millis(200);

/// Registered hosts without their lease whose agent still accepts a connection on the
/// underlay: cut off from etcd, but their process — engine and all — runs. Their apps stay
/// (moving them would break the links through them: a host that cannot read etcd cannot
/// learn new tunnels). A killed agent refuses the connection at once.
fn probed_alive(state: &ClusterState) -> Vec<String> {
    state
        .hosts
        .iter()
        .filter(|(name, h)| !state.live.contains(*name) && h.probe_port != 0)
        .filter(|(_, h)| {
            let addr = std::net::SocketAddr::new(h.underlay, h.probe_port);
            std::net::TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).is_ok()
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// Leads until leadership or the connection is lost (an error either way).
pub async fn lead(client: &mut Client, leader: &LeaderKey, registry: &Arc<Registry>) -> Result<()> {
    let (mut decided, mut probed) = decide(client, leader, registry).await?;
    loop {
        let mut stream = client
            .watch(
                keys::PREFIX,
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(decided + 1),
                ),
            )
            .await
            .context("cannot watch the cluster's state")?;
        loop {
            // While a host without its lease still answered the probe, look again now and then:
            // if its process dies, its apps must move without waiting for an etcd event.
            let recheck = tokio::time::sleep(if probed { RECHECK } else { Duration::MAX / 4 });
            let r = tokio::select! {
                r = stream.message() => r.context("the watch ended")?,
                _ = recheck => {
                    (decided, probed) = decide(client, leader, registry).await?;
                    continue;
                }
            };
            let Some(r) = r else { break };
            if r.canceled() {
                break;
            }
            let seen = r.header().map(|h| h.revision()).unwrap_or(0);
            let input_changed = r.events().iter().any(|e| {
                e.kv().is_some_and(|kv| {
                    let k = kv.key();
                    [keys::HOSTS, keys::ALIVE, keys::GRAPHS]
                        .iter()
                        .any(|p| keys::name_in(k, p).is_some())
                })
            });
            if input_changed && seen > decided {
                // A burst (a host's registration, then its liveness) makes one decision.
                tokio::time::sleep(Duration::from_millis(20)).await;
                (decided, probed) = decide(client, leader, registry).await?;
            }
        }
        // The watch was cancelled (compaction): decide on a fresh read and watch again.
        (decided, probed) = decide(client, leader, registry).await?;
    }
}

/// The graphs that parse, and a placement with the reason for each that does not.
pub(crate) fn parse_graphs(
    state: &ClusterState,
    registry: &Registry,
) -> (Vec<ClusterGraph>, BTreeMap<String, PlacementRecord>) {
    let mut graphs = Vec::new();
    let mut broken = BTreeMap::new();
    for (name, (record, revision)) in &state.graphs {
        match PlacedGraph::parse(&record.text, &record.file, Path::new(&record.dir), registry) {
            Ok(graph) => graphs.push(ClusterGraph {
                name: name.clone(),
                revision: *revision,
                graph,
            }),
            Err(e) => {
                log::error!("cluster graph `{name}` does not parse here: {e}");
                broken.insert(
                    name.clone(),
                    PlacementRecord {
                        graph_revision: *revision,
                        error: Some(e.to_string()),
                        ..Default::default()
                    },
                );
            }
        }
    }
    (graphs, broken)
}

/// What differs between the state read and the decision: the writes (with their sizes), and
/// a line for the log.
fn plan_writes(
    state: &ClusterState,
    registry: &Registry,
    probed: &[String],
) -> Result<(Vec<(TxnOp, usize)>, String)> {
    for m in &state.malformed {
        log::warn!("ignoring a malformed record: {m}");
    }
    let (graphs, broken) = parse_graphs(state, registry);
    let mut live = state.live.clone();
    live.extend(probed.iter().cloned());
    let hosts = Hosts {
        registered: state.hosts.clone(),
        live,
    };
    let assigned = state
        .assignments
        .iter()
        .map(|(h, (a, _))| (h.clone(), a.clone()))
        .collect();
    let mut decision = schedule::schedule(&graphs, &hosts, &state.placements, &assigned);
    decision.placements.extend(broken);
    let mut ops: Vec<(TxnOp, usize)> = Vec::new();
    let mut put = |key: String, v: Vec<u8>| {
        let size = v.len();
        ops.push((TxnOp::put(key, v, None), size));
    };
    for (name, p) in &decision.placements {
        if state.placements.get(name) != Some(p) {
            put(keys::placement(name), serde_json::to_vec(p)?);
        }
    }
    for (host, a) in &decision.assignments {
        if state.assignments.get(host).map(|(a, _)| a) != Some(a) {
            put(keys::assign(host), serde_json::to_vec(a)?);
        }
    }
    for name in state.placements.keys() {
        if !decision.placements.contains_key(name) {
            ops.push((TxnOp::delete(keys::placement(name), None), 0));
        }
    }
    let summary = format!(
        "{} graphs on {} live of {} hosts ({} of them cut off from etcd but answering on the underlay)",
        graphs.len(),
        hosts.live.len(),
        hosts.registered.len(),
        probed.len()
    );
    Ok((ops, summary))
}

/// Reads the state, computes the schedule and writes what differs; returns the revision the
/// decision was made at, and whether a host was kept by its probe alone. The computation (and
/// the probes) run off the agent's event loop, which must keep the lease alive meanwhile.
async fn decide(
    client: &mut Client,
    leader: &LeaderKey,
    registry: &Arc<Registry>,
) -> Result<(i64, bool)> {
    let started = std::time::Instant::now();
    let (revision, kvs) = read_prefix(client, keys::PREFIX).await?;
    let registry = registry.clone();
    let (ops, summary, probed) = tokio::task::spawn_blocking(move || {
        let state = ClusterState::decode(revision, &kvs);
        let probed = probed_alive(&state);
        plan_writes(&state, &registry, &probed)
            .map(|(ops, summary)| (ops, summary, !probed.is_empty()))
    })
    .await
    .context("the placement computation panicked")??;
    if ops.is_empty() {
        return Ok((revision, probed));
    }
    log::info!(
        "controller: {summary}; writing {} changes (decided in {} ms)",
        ops.len(),
        started.elapsed().as_millis()
    );
    let mut last = revision;
    for chunk in batches(ops) {
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                leader.key(),
                CompareOp::Equal,
                leader.rev(),
            )])
            .and_then(chunk);
        let r = client.txn(txn).await.context("cannot write the schedule")?;
        if !r.succeeded() {
            bail!("no longer the leader: another agent's controller decides now");
        }
        last = r.header().map(|h| h.revision()).unwrap_or(last);
    }
    Ok((last, probed))
}

/// Operations cut into transactions etcd takes: at most [`OPS_PER_TXN`] and about
/// [`BYTES_PER_TXN`] each (one larger value goes alone).
fn batches(ops: Vec<(TxnOp, usize)>) -> Vec<Vec<TxnOp>> {
    let mut out: Vec<Vec<TxnOp>> = Vec::new();
    let mut bytes = 0;
    for (op, size) in ops {
        let full = out
            .last()
            .is_none_or(|b| b.len() >= OPS_PER_TXN || bytes + size > BYTES_PER_TXN);
        if full {
            out.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        out.last_mut().expect("a batch").push(op);
    }
    out
}
