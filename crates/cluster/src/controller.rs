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
use stitch_core::{Graph, Registry};

/// etcd refuses transactions of more than 128 operations (`--max-txn-ops`) or 1.5 MiB
/// (`--max-request-bytes`) by default.
const OPS_PER_TXN: usize = 100;
const BYTES_PER_TXN: usize = 1 << 20;

/// Leads until leadership or the connection is lost (an error either way).
pub async fn lead(client: &mut Client, leader: &LeaderKey, registry: &Arc<Registry>) -> Result<()> {
    let mut decided = decide(client, leader, registry).await?;
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
        while let Some(r) = stream.message().await.context("the watch ended")? {
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
                decided = decide(client, leader, registry).await?;
            }
        }
        // The watch was cancelled (compaction): decide on a fresh read and watch again.
        decided = decide(client, leader, registry).await?;
    }
}

/// The graphs that parse, and a placement with the reason for each that does not.
fn parse_graphs(
    state: &ClusterState,
    registry: &Registry,
) -> (Vec<ClusterGraph>, BTreeMap<String, PlacementRecord>) {
    let mut graphs = Vec::new();
    let mut broken = BTreeMap::new();
    for (name, (record, revision)) in &state.graphs {
        match Graph::parse(&record.text, &record.file, Path::new(&record.dir), registry) {
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
fn plan_writes(state: &ClusterState, registry: &Registry) -> Result<(Vec<(TxnOp, usize)>, String)> {
    for m in &state.malformed {
        log::warn!("ignoring a malformed record: {m}");
    }
    let (graphs, broken) = parse_graphs(state, registry);
    let hosts = Hosts {
        registered: state.hosts.clone(),
        live: state.live.clone(),
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
        "{} graphs on {} live of {} hosts",
        graphs.len(),
        hosts.live.len(),
        hosts.registered.len()
    );
    Ok((ops, summary))
}

/// Reads the state, computes the schedule and writes what differs; returns the revision the
/// decision was made at. The computation runs off the agent's event loop, which must keep
/// the lease alive meanwhile.
async fn decide(client: &mut Client, leader: &LeaderKey, registry: &Arc<Registry>) -> Result<i64> {
    let started = std::time::Instant::now();
    let (revision, kvs) = read_prefix(client, keys::PREFIX).await?;
    let registry = registry.clone();
    let (ops, summary) = tokio::task::spawn_blocking(move || {
        plan_writes(&ClusterState::decode(revision, &kvs), &registry)
    })
    .await
    .context("the placement computation panicked")??;
    if ops.is_empty() {
        return Ok(revision);
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
    Ok(last)
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
