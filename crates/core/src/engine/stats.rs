//! What the engine reports: counters of apps, links and workers, and what a live change did.

use crate::latency::LatencyReport;
use crate::link::LinkStats;
use crate::pool;
use std::collections::BTreeMap;

/// Counters of one app: its own named counters plus totals of its links.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AppStats {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub worker: String,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Packets this app's output links dropped because they were full, plus the app's own drops.
    pub drops: u64,
    pub failed: bool,
    pub counters: BTreeMap<String, u64>,
    /// For a shard of a sharded app: the app.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard_of: Option<String>,
    /// For a sharded app (its totals, listed before its shards): the shards. Packets handed
    /// between its shards are not in its totals.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<String>,
}

impl AppStats {
    /// The totals of a sharded app `name` from its shards' counters, less what `handed` (its
    /// hand-off links' packets and bytes) moved between them.
    pub fn of_shards(name: &str, shards: &[&AppStats], handed: (u64, u64)) -> AppStats {
        let mut t = AppStats {
            name: name.to_string(),
            kind: shards[0].kind.clone(),
            worker: (shards.iter().map(|s| s.worker.as_str()))
                .collect::<Vec<_>>()
                .join(","),
            rx_packets: 0,
            rx_bytes: 0,
            tx_packets: 0,
            tx_bytes: 0,
            drops: 0,
            failed: shards.iter().any(|s| s.failed),
            counters: BTreeMap::new(),
            shard_of: None,
            shards: shards.iter().map(|s| s.name.clone()).collect(),
        };
        for s in shards {
            t.rx_packets += s.rx_packets;
            t.rx_bytes += s.rx_bytes;
            t.tx_packets += s.tx_packets;
            t.tx_bytes += s.tx_bytes;
            t.drops += s.drops;
            for (k, v) in &s.counters {
                *t.counters.entry(k.clone()).or_default() += v;
            }
        }
        t.rx_packets = t.rx_packets.saturating_sub(handed.0);
        t.rx_bytes = t.rx_bytes.saturating_sub(handed.1);
        t.tx_packets = t.tx_packets.saturating_sub(handed.0);
        t.tx_bytes = t.tx_bytes.saturating_sub(handed.1);
        t
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct LinkInfo {
    pub link: String,
    pub size: usize,
    /// Captures watching the link now.
    pub taps: usize,
    #[serde(flatten)]
    pub stats: LinkStats,
    /// The latency of the packets the link delivered, for a link with `latency: true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency: Option<LatencyReport>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkerStats {
    pub name: String,
    pub core: Option<usize>,
    pub breaths: u64,
    pub idle_sleeps: u64,
}

/// A snapshot of all counters.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stats {
    pub uptime_s: f64,
    pub apps: Vec<AppStats>,
    pub links: Vec<LinkInfo>,
    pub workers: Vec<WorkerStats>,
    pub pool: pool::PoolStats,
    /// Packets freed unsent in links that a live change removed together with both their apps
    /// (with an app staying, they are in its `drops`).
    pub removed_link_drops: u64,
}

/// What `apply` did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ApplyReport {
    pub started: Vec<String>,
    pub stopped: Vec<String>,
    pub reconfigured: Vec<String>,
    pub restarted: Vec<String>,
    pub kept: Vec<String>,
    pub links_added: Vec<String>,
    pub links_removed: Vec<String>,
    pub links_kept: Vec<String>,
    /// Apps that now run on another worker (with their state and queued packets).
    pub worker_moves: Vec<super::plan::WorkerMove>,
    /// How long the workers were parked (no packet moved anywhere in the engine), ms.
    pub paused_ms: f64,
}
