//! Counters as text tables for people.

use serde_json::Value;
use std::fmt::Write;

/// A counter of the stats JSON (0 when absent).
pub fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// A rate with its SI prefix: `1.25M`, `830.2k`, `12`.
pub fn rate(v: &Value) -> String {
    let r = v.as_f64().unwrap_or(0.0);
    if r >= 1e9 {
        format!("{:.2}G", r / 1e9)
    } else if r >= 1e6 {
        format!("{:.2}M", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1}k", r / 1e3)
    } else {
        format!("{r:.0}")
    }
}

/// Width of a text column: the longest `key` of `items`, at least `min`.
pub fn column_width(items: &[&Value], key: &str, min: usize) -> usize {
    items
        .iter()
        .map(|x| x[key].as_str().unwrap_or("").len())
        .max()
        .unwrap_or(min)
        .max(min)
}

/// A latency in the unit that suits it: `850ns`, `12.4µs`, `3.07ms`, `1.20s`.
fn duration_ns(v: &Value) -> String {
    let ns = v.as_u64().unwrap_or(0) as f64;
    if ns >= 1e9 {
        format!("{:.2}s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2}ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1}µs", ns / 1e3)
    } else {
        format!("{ns:.0}ns")
    }
}

/// The latency of the links that measure it (`latency: true`), one line each.
fn render_latency(s: &mut String, links: &[Value], width: usize) {
    let measured: Vec<&Value> = links.iter().filter(|l| l["latency"].is_object()).collect();
    if measured.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\n{:<width$}  {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "LATENCY", "PACKETS", "MIN", "P50", "P99", "P99.9", "MAX", "MEAN"
    );
    for l in measured {
        let h = &l["latency"];
        let _ = writeln!(
            s,
            "{:<width$}  {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            l["link"].as_str().unwrap_or(""),
            n(&h["count"]),
            duration_ns(&h["min_ns"]),
            duration_ns(&h["p50_ns"]),
            duration_ns(&h["p99_ns"]),
            duration_ns(&h["p999_ns"]),
            duration_ns(&h["max_ns"]),
            duration_ns(&h["mean_ns"]),
        );
    }
}

/// Renders the `stats` JSON of an instance (links, apps, workers, pool).
pub fn render(stats: &Value) -> String {
    let mut s = String::new();
    let links = stats["links"].as_array().cloned().unwrap_or_default();
    let width = column_width(&links.iter().collect::<Vec<_>>(), "link", 4);
    let _ = writeln!(
        s,
        "{:<width$}  {:>12} {:>14} {:>10} {:>12} {:>7} {:>9}",
        "LINK", "TX PACKETS", "TX BYTES", "TX DROPS", "RX PACKETS", "QUEUED", "PPS"
    );
    for l in &links {
        let _ = writeln!(
            s,
            "{:<width$}  {:>12} {:>14} {:>10} {:>12} {:>7} {:>9}",
            l["link"].as_str().unwrap_or(""),
            n(&l["tx_packets"]),
            n(&l["tx_bytes"]),
            n(&l["tx_drops"]),
            n(&l["rx_packets"]),
            n(&l["queued"]),
            rate(&l["rate_pps"]),
        );
    }
    render_latency(&mut s, &links, width);
    let apps = stats["apps"].as_array().cloned().unwrap_or_default();
    let width = column_width(&apps.iter().collect::<Vec<_>>(), "name", 3) + 2;
    let _ = writeln!(
        s,
        "\n{:<width$}  {:<12} {:<9} {:<8} {:>12} {:>12} {:>10} {:>9} {:>9}  COUNTERS",
        "APP",
        "TYPE",
        "PLACEMENT",
        "WORKER",
        "RX PACKETS",
        "TX PACKETS",
        "DROPS",
        "RX PPS",
        "TX PPS"
    );
    for a in &apps {
        let counters: Vec<String> = a["counters"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| format!("{k}={v}")).collect())
            .unwrap_or_default();
        let failed = if a["failed"] == Value::Bool(true) {
            " FAILED"
        } else {
            ""
        };
        // A sharded app's row holds its totals; its shards follow, indented.
        let name = match a["shard_of"].as_str() {
            Some(_) => format!("  {}", a["name"].as_str().unwrap_or("")),
            None => a["name"].as_str().unwrap_or("").to_string(),
        };
        let _ = writeln!(
            s,
            "{:<width$}  {:<12} {:<9} {:<8} {:>12} {:>12} {:>10} {:>9} {:>9}  {}{failed}",
            name,
            a["type"].as_str().unwrap_or(""),
            a["placement"].as_str().unwrap_or("engine"),
            a["worker"].as_str().unwrap_or(""),
            n(&a["rx_packets"]),
            n(&a["tx_packets"]),
            n(&a["drops"]),
            rate(&a["rx_rate_pps"]),
            rate(&a["tx_rate_pps"]),
            counters.join(" "),
        );
    }
    let p = &stats["pool"];
    let _ = write!(
        s,
        "\npool: {} of {} packets in use, {} allocation failures, {}",
        n(&p["in_use"]),
        n(&p["packets"]),
        n(&p["exhausted"]),
        if p["hugepages"] == Value::Bool(true) {
            "2 MiB hugepages"
        } else {
            "4 KiB pages"
        }
    );
    for w in stats["workers"].as_array().cloned().unwrap_or_default() {
        let core = w["core"]
            .as_u64()
            .map(|c| format!("core {c}"))
            .unwrap_or("any core".into());
        let _ = write!(
            s,
            "\nworker {} ({core}): {} breaths, {} idle sleeps",
            w["name"].as_str().unwrap_or(""),
            n(&w["breaths"]),
            n(&w["idle_sleeps"])
        );
    }
    s.push('\n');
    s
}
