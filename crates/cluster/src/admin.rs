//! `stitch cluster apply|status|delete`: the operator's side. A graph is checked here against
//! the parser and the hosts etcd knows before anything is written; writes are compare-and-swap
//! on the graph's revision, so two operators never overwrite each other silently.

use crate::etcd::{self, read_prefix};
use crate::keys::{self, AppPlace, ClusterState, GraphRecord, PlacementRecord};
use crate::schedule::RESERVED_PREFIX;
use anyhow::{anyhow, bail, Context, Result};
use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};
use stitch_core::graph::{GraphError, GraphErrors};
use stitch_core::Registry;
use stitch_place::PlacedGraph;

/// What `cluster apply` did.
#[derive(Debug)]
pub struct Applied {
    pub name: String,
    /// The graph's revision before (0: it is new) and now.
    pub previous: i64,
    pub revision: i64,
    /// Pinned hosts whose agent is not live now: their apps start when they return.
    pub waiting_for: Vec<String>,
}

/// The graph name of `file`: its stem.
pub fn graph_name(file: &Path) -> Result<String> {
    let stem = file
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| anyhow!("{}: give the graph a name with --graph", file.display()))?;
    check_name(stem)?;
    Ok(stem.to_string())
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
    {
        bail!("graph name `{name}`: use letters, digits, `_`, `-` and `.`");
    }
    Ok(())
}

/// What can be checked of a cluster graph without the cluster (`stitch check --cluster`), on
/// top of the graph parser's checks: no app takes a name the cluster keeps for itself.
pub fn check_offline(graph: &stitch_core::Graph) -> Vec<GraphError> {
    graph
        .apps
        .values()
        .filter(|app| app.name.starts_with(RESERVED_PREFIX))
        .map(|app| GraphError {
            line: app.line,
            column: 0,
            message: format!(
                "app `{}`: names starting with `{RESERVED_PREFIX}` are the cluster's own (its \
                 tunnels)",
                app.name
            ),
        })
        .collect()
}

/// Checks `graph` against the cluster: app names free (not reserved, not in another graph),
/// pins naming registered hosts, labels that some registered host has. Errors name lines.
fn check_against(
    graph: &PlacedGraph,
    name: &str,
    state: &ClusterState,
    registry: &Registry,
) -> Vec<GraphError> {
    let mut errors = check_offline(&graph.graph);
    let at = |app: &stitch_core::graph::AppDecl, key: &str| {
        app.key_lines.get(key).copied().unwrap_or((app.line, 0))
    };
    let mut push = |(line, column): (usize, usize), message: String| {
        errors.push(GraphError {
            line,
            column,
            message,
        })
    };
    let others: Vec<(String, PlacedGraph)> = state
        .graphs
        .iter()
        .filter(|(n, _)| n.as_str() != name)
        .filter_map(|(n, (r, _))| {
            PlacedGraph::parse(&r.text, &r.file, Path::new(&r.dir), registry)
                .ok()
                .map(|g| (n.clone(), g))
        })
        .collect();
    for app in graph.graph.apps.values() {
        let place = &graph.apps[&app.name];
        if let Some((other, _)) = others.iter().find(|(_, g)| g.apps.contains_key(&app.name)) {
            push(
                (app.line, 0),
                format!(
                    "app `{}` is already in cluster graph `{other}`: app names are one namespace on every host",
                    app.name
                ),
            );
        }
        if let Some(pin) = &place.host {
            if !state.hosts.contains_key(pin) {
                let known: Vec<&str> = state.hosts.keys().map(String::as_str).collect();
                push(
                    at(app, "host"),
                    format!(
                        "app `{}`: host `{pin}` is not in the cluster (hosts: {})",
                        app.name,
                        if known.is_empty() {
                            "none yet".into()
                        } else {
                            known.join(", ")
                        }
                    ),
                );
            }
        }
        for (label, value) in &place.hosts {
            let values: Vec<&str> = state
                .hosts
                .values()
                .filter_map(|h| h.labels.get(label).map(String::as_str))
                .collect();
            if values.is_empty() {
                push(
                    at(app, "hosts"),
                    format!("app `{}`: no host has the label `{label}`", app.name),
                );
            } else if !values.contains(&value.as_str()) {
                push(
                    at(app, "hosts"),
                    format!(
                        "app `{}`: no host has {label}={value} (its values: {})",
                        app.name,
                        values.join(", ")
                    ),
                );
            }
        }
    }
    errors
}

/// A graph file read and checked against the cluster as it is: what `apply` writes and what
/// `--dry-run` plans with.
struct Checked {
    graph: PlacedGraph,
    record: GraphRecord,
    state: ClusterState,
    client: etcd_client::Client,
}

async fn read_and_check(
    endpoints: &[String],
    file: &Path,
    name: &str,
    registry: &Registry,
) -> Result<Checked> {
    check_name(name)?;
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let dir = std::path::absolute(file)?
        .parent()
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    let shown = file.display().to_string();
    let graph = PlacedGraph::parse(&text, &shown, Path::new(&dir), registry)
        .map_err(|e| anyhow!("{e}\nnothing was written"))?;
    let mut client = etcd::connect(endpoints).await?;
    let (revision, kvs) = read_prefix(&mut client, keys::PREFIX).await?;
    let state = ClusterState::decode(revision, &kvs);
    let errors = check_against(&graph, name, &state, registry);
    if !errors.is_empty() {
        bail!(
            "{}\nnothing was written",
            GraphErrors {
                file: shown,
                text,
                errors
            }
        );
    }
    Ok(Checked {
        graph,
        record: GraphRecord {
            text,
            file: shown,
            dir,
        },
        state,
        client,
    })
}

/// What applying `file` as graph `name` would change, host by host, as the controller would
/// decide it on the cluster as it is now (its live hosts): nothing is written. One line per
/// host.
pub async fn dry_run(
    endpoints: &[String],
    file: &Path,
    name: &str,
    registry: &Registry,
) -> Result<Vec<String>> {
    let Checked { graph, state, .. } = read_and_check(endpoints, file, name, registry).await?;
    let (mut graphs, _) = crate::controller::parse_graphs(&state, registry);
    graphs.retain(|g| g.name != name);
    graphs.push(crate::schedule::ClusterGraph {
        name: name.to_string(),
        revision: state.revision + 1,
        graph,
    });
    let hosts = crate::schedule::Hosts {
        registered: state.hosts.clone(),
        live: state.live.clone(),
    };
    let assigned: BTreeMap<String, keys::Assignment> = (state.assignments.iter())
        .map(|(h, (a, _))| (h.clone(), a.clone()))
        .collect();
    let decision = crate::schedule::schedule(&graphs, &hosts, &state.placements, &assigned);
    let mut lines = Vec::new();
    let all: std::collections::BTreeSet<&String> =
        assigned.keys().chain(decision.assignments.keys()).collect();
    for host in all {
        let (before, after) = (assigned.get(host), decision.assignments.get(host));
        let line = match (before, after) {
            (Some(b), Some(a)) if b.same_part(a) => "unchanged (not written)".to_string(),
            (b, a) => host_changes(b, a),
        };
        let live = if state.live.contains(host) {
            ""
        } else {
            " (not live)"
        };
        lines.push(format!("host {host}{live}: {line}"));
    }
    Ok(lines)
}

/// The apps a host's assignment gains, loses and changes, and its links before and after.
fn host_changes(before: Option<&keys::Assignment>, after: Option<&keys::Assignment>) -> String {
    let apps = |a: Option<&keys::Assignment>| -> BTreeMap<String, Value> {
        a.and_then(|a| a.document["apps"].as_object())
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    };
    let links = |a: Option<&keys::Assignment>| {
        a.and_then(|a| a.document["links"].as_array())
            .map_or(0, Vec::len)
    };
    let (b, a) = (apps(before), apps(after));
    let list = |names: Vec<&String>| {
        if names.is_empty() {
            "-".to_string()
        } else {
            names
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let added = list(a.keys().filter(|k| !b.contains_key(*k)).collect());
    let removed = list(b.keys().filter(|k| !a.contains_key(*k)).collect());
    let changed = list(
        a.iter()
            .filter(|(k, v)| b.get(*k).is_some_and(|old| old != *v))
            .map(|(k, _)| k)
            .collect(),
    );
    format!(
        "apps added: {added}; changed: {changed}; removed: {removed}; links {} -> {}",
        links(before),
        links(after)
    )
}

/// Stores the graph of `file` as cluster graph `name`, if its revision is still `expected`
/// (by default the one read here). Nothing is written when a check fails.
pub async fn apply(
    endpoints: &[String],
    file: &Path,
    name: &str,
    expected: Option<i64>,
    registry: &Registry,
) -> Result<Applied> {
    let Checked {
        graph,
        record,
        state,
        mut client,
    } = read_and_check(endpoints, file, name, registry).await?;
    let previous = state.graphs.get(name).map(|(_, r)| *r).unwrap_or(0);
    let expected = expected.unwrap_or(previous);
    let r = client
        .txn(
            Txn::new()
                .when(vec![Compare::mod_revision(
                    keys::graph(name),
                    CompareOp::Equal,
                    expected,
                )])
                .and_then(vec![TxnOp::put(
                    keys::graph(name),
                    serde_json::to_vec(&record)?,
                    None,
                )]),
        )
        .await
        .context("cannot write the graph")?;
    if !r.succeeded() {
        bail!(
            "{}; nothing was written",
            revision_conflict(name, expected, previous)
        );
    }
    let mut waiting_for: Vec<String> = graph
        .apps
        .values()
        .filter_map(|a| a.host.clone())
        .filter(|h| !state.live.contains(h))
        .collect();
    waiting_for.sort();
    waiting_for.dedup();
    Ok(Applied {
        name: name.to_string(),
        previous,
        revision: r.header().map(|h| h.revision()).unwrap_or(0),
        waiting_for,
    })
}

/// Why a write expecting graph `name` at revision `expected` failed, the graph having been at
/// revision `read` (0: absent) when this command read it.
fn revision_conflict(name: &str, expected: i64, read: i64) -> String {
    match (expected, read) {
        (0, 0) => format!("graph `{name}` was created by another apply meanwhile"),
        (0, r) => format!(
            "graph `{name}` exists already (revision {r}); --if-revision 0 writes only a new graph"
        ),
        (e, r) if e != r => format!(
            "graph `{name}` is no longer at revision {e} (it is at {}): read it with \
             `stitch cluster status`, then apply again",
            if r == 0 {
                "none: deleted".to_string()
            } else {
                r.to_string()
            }
        ),
        (e, _) => format!(
            "graph `{name}` was changed by another apply meanwhile (it was at revision {e}): \
             apply again"
        ),
    }
}

/// Removes host `name` from the cluster — its record, host graph and status — when its agent
/// is not live (a live agent would register it again): apps pinned to it become `unplaced`,
/// and the tunnels toward it go. Returns the etcd revision of the removal.
pub async fn remove_host(endpoints: &[String], name: &str) -> Result<i64> {
    let mut client = etcd::connect(endpoints).await?;
    let (_, record) = etcd::read_key(&mut client, &keys::host(name)).await?;
    if record.is_none() {
        bail!("there is no host `{name}` in the cluster (`stitch cluster status` lists them)");
    }
    let r = client
        .txn(
            Txn::new()
                .when(vec![Compare::version(
                    keys::alive(name),
                    CompareOp::Equal,
                    0,
                )])
                .and_then(vec![
                    TxnOp::delete(keys::host(name), None),
                    TxnOp::delete(keys::assign(name), None),
                    TxnOp::delete(keys::status(name), None),
                ]),
        )
        .await
        .context("cannot remove the host")?;
    if !r.succeeded() {
        bail!(
            "host `{name}` is live (its agent holds its lease): stop its agent first (a live \
             agent registers its host again); nothing was removed"
        );
    }
    Ok(r.header().map(|h| h.revision()).unwrap_or(0))
}

/// Removes cluster graph `name` (if still at `expected`, when given).
pub async fn delete(endpoints: &[String], name: &str, expected: Option<i64>) -> Result<i64> {
    let mut client = etcd::connect(endpoints).await?;
    let key = keys::graph(name);
    let (_, current) = etcd::read_key(&mut client, &key).await?;
    let Some(kv) = current else {
        bail!("there is no cluster graph `{name}`");
    };
    let expected = expected.unwrap_or(kv.mod_revision());
    let r = client
        .txn(
            Txn::new()
                .when(vec![Compare::mod_revision(
                    key.as_str(),
                    CompareOp::Equal,
                    expected,
                )])
                .and_then(vec![TxnOp::delete(key.as_str(), None)]),
        )
        .await?;
    if !r.succeeded() {
        bail!(
            "{}; nothing was deleted",
            revision_conflict(name, expected, kv.mod_revision())
        );
    }
    Ok(r.header().map(|h| h.revision()).unwrap_or(0))
}

/// The cluster as JSON: hosts (live, underlay, labels, what they applied), the leader, and
/// each graph with where its apps run and its tunnels.
pub async fn status(endpoints: &[String]) -> Result<Value> {
    let mut client = etcd::connect(endpoints).await?;
    let (revision, kvs) = read_prefix(&mut client, keys::PREFIX).await?;
    Ok(status_json(&ClusterState::decode(revision, &kvs)))
}

fn status_json(s: &ClusterState) -> Value {
    let hosts: Vec<Value> = s
        .hosts
        .iter()
        .map(|(name, h)| {
            let st = s.statuses.get(name);
            json!({
                "name": name,
                "live": s.live.contains(name),
                "underlay": h.underlay,
                "mtu": h.mtu,
                "labels": h.labels,
                "placements": h.placements,
                "assignment_revision": s.assignments.get(name).map(|(_, r)| *r),
                "applied_revision": st.map(|x| x.assignment_revision),
                "graphs": st.map(|x| &x.graphs),
                "apps": st.map(|x| x.apps),
                "error": st.and_then(|x| x.error.clone()),
            })
        })
        .collect();
    let graphs: Vec<Value> = s
        .graphs
        .iter()
        .map(|(name, (_, revision))| {
            let p = s.placements.get(name);
            json!({
                "name": name,
                "revision": revision,
                "placed_revision": p.map(|p| p.graph_revision),
                "error": p.and_then(|p| p.error.clone()),
                "apps": p.map(|p| applied_places(s, name, p)),
                "tunnels": p.map(|p| &p.tunnels),
            })
        })
        .collect();
    let workload_mtu = crate::schedule::workload_mtu(s.hosts.values());
    json!({
        "revision": s.revision,
        "leader": s.leader,
        "workload_mtu": workload_mtu,
        "hosts": hosts,
        "graphs": graphs,
        "malformed": s.malformed,
    })
}

/// Where graph `name`'s apps are, as its placement says, with `running` kept for apps whose
/// host reports running the graph revision the placement needs there: an app assigned but not
/// applied yet is `starting`, one its host refused is `refused` (with the host's reason).
fn applied_places(s: &ClusterState, name: &str, p: &PlacementRecord) -> BTreeMap<String, AppPlace> {
    let mut apps = p.apps.clone();
    for place in apps.values_mut() {
        let Some(host) = place.host.as_deref().filter(|_| place.state == "running") else {
            continue;
        };
        let needed = p.hosts.get(host).copied().unwrap_or(p.graph_revision);
        let status = s.statuses.get(host);
        let runs = status.and_then(|st| st.graphs.get(name)).copied();
        if runs.is_some_and(|r| r >= needed) {
            continue;
        }
        match status.and_then(|st| st.error.clone()) {
            Some(why) => {
                place.state = "refused".into();
                place.reason = Some(why);
            }
            None => {
                place.state = "starting".into();
                place.reason = Some(format!("{host} has not applied it yet"));
            }
        }
    }
    apps
}

/// What shows how far graph `name` got: its placement, liveness and statuses (not every
/// host's graph).
async fn read_progress(
    client: &mut etcd_client::Client,
    name: &str,
) -> Result<Vec<etcd_client::KeyValue>> {
    let mut kvs = Vec::new();
    for prefix in [
        keys::placement(name),
        keys::ALIVE.into(),
        keys::STATUS.into(),
    ] {
        kvs.extend(read_prefix(client, &prefix).await?.1);
    }
    Ok(kvs)
}

/// Waits until every live host that runs apps of graph `name` reports running revision
/// `revision` of it (or newer); returns how long that took.
pub async fn wait_applied(
    endpoints: &[String],
    name: &str,
    revision: i64,
    limit: Duration,
) -> Result<Duration> {
    let start = Instant::now();
    let mut client = etcd::connect(endpoints).await?;
    loop {
        // A read that fails (etcd slow or electing a leader) is tried again on a fresh
        // connection until the limit: the write is done, only its effect is awaited.
        let kvs = match read_progress(&mut client, name).await {
            Ok(kvs) => kvs,
            Err(e) if start.elapsed() > limit => {
                return Err(e.context(format!(
                    "the graph was written, but whether every host runs revision {revision} \
                     could not be read within {} s",
                    limit.as_secs_f64()
                )))
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if let Ok(c) = etcd::connect(endpoints).await {
                    client = c;
                }
                continue;
            }
        };
        let s = ClusterState::decode(0, &kvs);
        let placed = s
            .placements
            .get(name)
            .filter(|p| p.graph_revision >= revision);
        if let Some(p) = placed {
            let behind: Vec<&str> = p
                .hosts
                .iter()
                .filter(|(h, _)| s.live.contains(*h))
                .filter(|(h, needed)| {
                    s.statuses
                        .get(*h)
                        .and_then(|st| st.graphs.get(name))
                        .is_none_or(|r| r < needed)
                })
                .map(|(h, _)| h.as_str())
                .collect();
            if behind.is_empty() {
                return Ok(start.elapsed());
            }
            if start.elapsed() > limit {
                bail!(
                    "hosts {} have not applied revision {revision} of `{name}`",
                    behind.join(", ")
                );
            }
        } else if start.elapsed() > limit {
            bail!("no controller placed revision {revision} of `{name}` (is any agent live?)");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `stitch cluster status` as text.
pub fn render_status(v: &Value) -> String {
    let mut out = format!(
        "etcd revision {}; controller on {}; workloads' MTU across tunnels {}\n\nHOST         LIVE  UNDERLAY         MTU    APPLIED  APPS  LABELS / ERROR\n",
        v["revision"],
        v["leader"].as_str().unwrap_or("no host (no agent is live)"),
        v["workload_mtu"]
            .as_u64()
            .map_or("- (no host)".to_string(), |m| m.to_string())
    );
    for h in v["hosts"].as_array().into_iter().flatten() {
        let labels: Vec<String> = h["labels"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
            .collect();
        let note = match h["error"].as_str() {
            Some(e) => format!("ERROR: {e}"),
            None => labels.join(","),
        };
        out += &format!(
            "{:<12} {:<5} {:<16} {:<6} {:<8} {:<5} {}\n",
            h["name"].as_str().unwrap_or_default(),
            if h["live"].as_bool() == Some(true) {
                "yes"
            } else {
                "NO"
            },
            h["underlay"].as_str().unwrap_or_default(),
            h["mtu"].as_u64().map_or("-".into(), |m| m.to_string()),
            h["applied_revision"]
                .as_i64()
                .map(|r| r.to_string())
                .unwrap_or("-".into()),
            h["apps"]
                .as_u64()
                .map(|r| r.to_string())
                .unwrap_or("-".into()),
            note
        );
    }
    for g in v["graphs"].as_array().into_iter().flatten() {
        out += &format!(
            "\ngraph {} (revision {}, placed {})\n",
            g["name"].as_str().unwrap_or_default(),
            g["revision"],
            g["placed_revision"]
        );
        if let Some(e) = g["error"].as_str() {
            out += &format!("  ERROR: {e}\n");
        }
        for (app, p) in g["apps"].as_object().into_iter().flatten() {
            out += &format!(
                "  {:<16} {:<12} {}{}\n",
                app,
                p["host"].as_str().unwrap_or("-"),
                p["state"].as_str().unwrap_or_default(),
                p["reason"]
                    .as_str()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            );
        }
        for t in g["tunnels"].as_array().into_iter().flatten() {
            out += &format!(
                "  tunnel VNI {:<8} {} -> {}: {}\n",
                t["vni"],
                t["from_host"].as_str().unwrap_or_default(),
                t["to_host"].as_str().unwrap_or_default(),
                t["link"].as_str().unwrap_or_default()
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_app_is_running_once_its_host_runs_the_revision_it_needs() {
        let running = |host: &str| AppPlace {
            host: Some(host.into()),
            state: "running".into(),
            reason: None,
        };
        let placement = PlacementRecord {
            graph_revision: 9,
            error: None,
            apps: [
                ("a".to_string(), running("h1")),
                ("b".to_string(), running("h2")),
            ]
            .into(),
            tunnels: Vec::new(),
            hosts: [("h1".to_string(), 7), ("h2".to_string(), 9)].into(),
        };
        let mut s = ClusterState::default();
        let status = |graph_revision: i64, error: Option<&str>| keys::StatusRecord {
            graphs: [("chain".to_string(), graph_revision)].into(),
            error: error.map(String::from),
            ..Default::default()
        };
        s.statuses.insert("h1".into(), status(7, None));
        s.statuses.insert("h2".into(), status(7, None));
        let apps = applied_places(&s, "chain", &placement);
        assert_eq!(
            apps["a"].state, "running",
            "h1's part did not change after 7"
        );
        assert_eq!(apps["b"].state, "starting");
        s.statuses
            .insert("h2".into(), status(7, Some("app `b`: bad setting")));
        let apps = applied_places(&s, "chain", &placement);
        assert_eq!(
            (apps["b"].state.as_str(), apps["b"].reason.as_deref()),
            ("refused", Some("app `b`: bad setting"))
        );
    }

    #[test]
    fn a_refused_compare_and_swap_says_what_the_graph_is_at() {
        assert!(revision_conflict("chain", 0, 12).contains("exists already (revision 12)"));
        assert!(revision_conflict("chain", 1, 12).contains("no longer at revision 1 (it is at 12)"));
        assert!(revision_conflict("chain", 5, 0).contains("none: deleted"));
        assert!(revision_conflict("chain", 12, 12).contains("changed by another apply meanwhile"));
    }

    #[test]
    fn the_status_table_keeps_its_columns_and_says_the_workload_mtu() {
        let v = json!({
            "revision": 17, "leader": "h3", "workload_mtu": 1450,
            "hosts": [ { "name": "h1", "live": true, "underlay": "192.0.2.1", "mtu": 1500,
                         "applied_revision": 12, "apps": 3, "labels": { "zone": "a" } } ],
            "graphs": []
        });
        let text = render_status(&v);
        assert!(
            text.contains("workloads' MTU across tunnels 1450"),
            "{text}"
        );
        let header = text.lines().find(|l| l.starts_with("HOST")).unwrap();
        let row = text.lines().find(|l| l.starts_with("h1")).unwrap();
        for column in ["MTU", "APPLIED", "APPS"] {
            let at = header.find(column).unwrap();
            assert_ne!(&row[at..at + 1], " ", "{column} lines up:\n{text}");
            assert_eq!(&row[at - 1..at], " ", "{column} lines up:\n{text}");
        }
    }
}
