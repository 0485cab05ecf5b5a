//! Per-second rates from two counter snapshots.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use stitch_core::Stats;

/// Packet and bit rates of links and apps between the last two snapshots.
#[derive(Default, Clone)]
pub struct Rates {
    /// Link name → (packets/s, bits/s).
    pub links: HashMap<String, (f64, f64)>,
    /// App name → (received packets/s, sent packets/s).
    pub apps: HashMap<String, (f64, f64)>,
    last: Option<(Instant, Stats)>,
}

impl Rates {
    /// Takes a snapshot and updates the rates if at least `min` passed since the last one.
    pub fn sample(&mut self, stats: Stats, min: Duration) {
        let now = Instant::now();
        if let Some((t, prev)) = &self.last {
            let dt = now.duration_since(*t);
            if dt < min {
                return;
            }
            let dt = dt.as_secs_f64();
            self.links.clear();
            for l in &stats.links {
                if let Some(p) = prev.links.iter().find(|p| p.link == l.link) {
                    let pps = l.stats.tx_packets.saturating_sub(p.stats.tx_packets) as f64 / dt;
                    let bps = l.stats.tx_bytes.saturating_sub(p.stats.tx_bytes) as f64 * 8.0 / dt;
                    self.links.insert(l.link.clone(), (pps, bps));
                }
            }
            self.apps.clear();
            for a in &stats.apps {
                if let Some(p) = prev.apps.iter().find(|p| p.name == a.name) {
                    let rx = a.rx_packets.saturating_sub(p.rx_packets) as f64 / dt;
                    let tx = a.tx_packets.saturating_sub(p.tx_packets) as f64 / dt;
                    self.apps.insert(a.name.clone(), (rx, tx));
                }
            }
        }
        self.last = Some((now, stats));
    }
}

/// Counters plus rates: `rate_pps`/`rate_bps` on links, `rx_rate_pps`/`tx_rate_pps` on apps.
pub fn stats_json(stats: &Stats, rates: &Rates) -> Value {
    let mut v = serde_json::to_value(stats).expect("stats serialize");
    if let Some(links) = v["links"].as_array_mut() {
        for l in links {
            let name = l["link"].as_str().unwrap_or_default().to_string();
            let (pps, bps) = rates.links.get(&name).copied().unwrap_or_default();
            l["rate_pps"] = json!(pps);
            l["rate_bps"] = json!(bps);
        }
    }
    if let Some(apps) = v["apps"].as_array_mut() {
        for a in apps {
            let name = a["name"].as_str().unwrap_or_default().to_string();
            let (rx, tx) = rates.apps.get(&name).copied().unwrap_or_default();
            a["rx_rate_pps"] = json!(rx);
            a["tx_rate_pps"] = json!(tx);
        }
    }
    v
}
