//! `stitch top`: the busiest links and apps of a running instance, refreshed live.

use crate::table::{column_width, n, rate};
use crate::Instance;
use anyhow::Result;
use serde_json::Value;
use std::fmt::Write;
use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;
use stitch_api::client::{self, Method};

#[derive(clap::Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub instance: Instance,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Rows per table.
    #[arg(long, default_value_t = 15)]
    pub rows: usize,
    /// Print one frame and exit (for scripts).
    #[arg(long)]
    pub once: bool,
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// `items` ordered by `key` (rate, then total), largest first.
fn busiest_first(items: &[Value], key: impl Fn(&Value) -> (f64, f64)) -> Vec<&Value> {
    let mut v: Vec<&Value> = items.iter().collect();
    v.sort_by(|a, b| {
        key(b)
            .partial_cmp(&key(a))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    v
}

/// One frame: links by packet rate (then by total), apps by packets in and out per second.
pub fn frame(stats: &Value, rows: usize) -> String {
    let mut s = String::new();
    let pool = &stats["pool"];
    let empty = Vec::new();
    let links = stats["links"].as_array().unwrap_or(&empty);
    let apps = stats["apps"].as_array().unwrap_or(&empty);
    let _ = writeln!(
        s,
        "stitch top — up {:.0} s, {} apps, {} links, pool {}/{} buffers in use, {} allocations refused",
        f(&stats["uptime_s"]),
        apps.len(),
        links.len(),
        pool["in_use"],
        pool["packets"],
        pool["exhausted"]
    );
    let links = busiest_first(links, |l| (f(&l["rate_pps"]), f(&l["tx_packets"])));
    let width = column_width(&links, "link", 4);
    let _ = writeln!(
        s,
        "\n{:<width$}  {:>9} {:>9} {:>12} {:>10} {:>7}",
        "LINK", "PPS", "BIT/S", "PACKETS", "DROPS", "QUEUED"
    );
    for l in links.iter().take(rows) {
        let _ = writeln!(
            s,
            "{:<width$}  {:>9} {:>9} {:>12} {:>10} {:>7}",
            l["link"].as_str().unwrap_or(""),
            rate(&l["rate_pps"]),
            rate(&l["rate_bps"]),
            n(&l["tx_packets"]),
            n(&l["tx_drops"]),
            n(&l["queued"])
        );
    }
    let apps = busiest_first(apps, |a| {
        (
            f(&a["rx_rate_pps"]) + f(&a["tx_rate_pps"]),
            f(&a["rx_packets"]) + f(&a["tx_packets"]),
        )
    });
    let width = column_width(&apps, "name", 3);
    let _ = writeln!(
        s,
        "\n{:<width$}  {:<14} {:<9} {:>9} {:>9} {:>10}  STATE",
        "APP", "TYPE", "PLACEMENT", "IN PPS", "OUT PPS", "DROPS"
    );
    for a in apps.iter().take(rows) {
        // A function process or VM: its supervision state and restarts.
        let state = match (&a["process"]["state"], a["failed"] == true) {
            (_, true) => "FAILED".to_string(),
            (Value::String(st), _) => match a["process"]["restarts"].as_u64() {
                Some(r) if r > 0 => format!("{st} ({r} restarts)"),
                _ => st.clone(),
            },
            _ => "ok".to_string(),
        };
        let _ = writeln!(
            s,
            "{:<width$}  {:<14} {:<9} {:>9} {:>9} {:>10}  {}",
            a["name"].as_str().unwrap_or(""),
            a["type"].as_str().unwrap_or(""),
            a["placement"].as_str().unwrap_or("engine"),
            rate(&a["rx_rate_pps"]),
            rate(&a["tx_rate_pps"]),
            n(&a["drops"]),
            state
        );
    }
    s
}

pub fn run(socket: &Path, args: &TopArgs) -> Result<()> {
    let tty = std::io::stdout().is_terminal();
    loop {
        let stats = client::json(socket, Method::GET, "/api/v1/stats", None)?;
        if tty && !args.once {
            print!("\x1b[H\x1b[2J");
        }
        print!("{}", frame(&stats, args.rows));
        if args.once {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs_f64(args.interval.max(0.1)));
    }
}
