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
use std::time::Duration;
use stitch_core::{Graph, Registry};

/// etcd refuses transactions of more than 128 operations by default (`--max-txn-ops`).
const OPS_PER_TXN: usize = 100;

/// Leads until leadership or the connection is lost (an error either way).
pub async fn lead(client: &mut Client, leader: &LeaderKey, registry: &Registry) -> Result<()> {
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

/// Reads the state, computes the schedule and writes what differs; returns the revision the
/// decision was made at.
async fn decide(client: &mut Client, leader: &LeaderKey, registry: &Registry) -> Result<i64> {
    let (revision, kvs) = read_prefix(client, keys::PREFIX).await?;
    let state = ClusterState::decode(revision, &kvs);
    for m in &state.malformed {
        log::warn!("ignoring a malformed record: {m}");
    }
    let (graphs, broken) = parse_graphs(&state, registry);
    let hosts = Hosts {
        registered: state.hosts.clone(),
        live: state.live.clone(),
    };
    let mut decision = schedule::schedule(&graphs, &hosts, &state.placements);
    decision.placements.extend(broken);
    let mut ops = Vec::new();
    for (name, p) in &decision.placements {
        if state.placements.get(name) != Some(p) {
            ops.push(TxnOp::put(
                keys::placement(name),
                serde_json::to_vec(p)?,
                None,
            ));
        }
    }
    for name in state.placements.keys() {
        if !decision.placements.contains_key(name) {
            ops.push(TxnOp::delete(keys::placement(name), None));
        }
    }
    for (host, a) in &decision.assignments {
        if state.assignments.get(host).map(|(a, _)| a) != Some(a) {
            ops.push(TxnOp::put(keys::assign(host), serde_json::to_vec(a)?, None));
        }
    }
    if ops.is_empty() {
        return Ok(revision);
    }
    log::info!(
        "controller: {} graphs on {} live of {} hosts; writing {} changes",
        graphs.len(),
        hosts.live.len(),
        hosts.registered.len(),
        ops.len()
    );
    let mut last = revision;
    for chunk in ops.chunks(OPS_PER_TXN) {
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                leader.key(),
                CompareOp::Equal,
                leader.rev(),
            )])
            .and_then(chunk.to_vec());
        let r = client.txn(txn).await.context("cannot write the schedule")?;
        if !r.succeeded() {
            bail!("no longer the leader: another agent's controller decides now");
        }
        last = r.header().map(|h| h.revision()).unwrap_or(last);
    }
    Ok(last)
}
