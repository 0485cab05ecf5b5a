//! `stitch kernel apply|status|teardown`: the in-kernel data plane (crate `stitch-kernel`)
//! driven by the same graph files as the userspace engine, for apps with `placement: kernel`.

use anyhow::{anyhow, Result};
use std::path::{Path, PathBuf};
use stitch_core::graph::GraphErrors;
use stitch_kernel::{DataPlane, Plan};

#[derive(clap::Subcommand)]
pub enum KernelCmd {
    /// Validate a graph whose apps have `placement: kernel` and install it in the kernel, or
    /// change the installed graph into it (unchanged functions keep their state).
    Apply {
        file: PathBuf,
        #[command(flatten)]
        plane: Plane,
    },
    /// The installed graph with per-function and per-port counters.
    Status {
        #[command(flatten)]
        plane: Plane,
        /// JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Remove everything the data plane attached or created (hooks, programs, maps, its loop
    /// device), and nothing else.
    Teardown {
        #[command(flatten)]
        plane: Plane,
    },
}

#[derive(clap::Args)]
pub struct Plane {
    /// Name of the kernel data plane (several can coexist on different interfaces).
    #[arg(long, default_value = "stitch")]
    name: String,
}

/// Reads the graph and turns it into a kernel plan; errors are `FILE:LINE:COL` with the line.
pub fn plan(file: &Path) -> Result<Plan> {
    let graph = super::load(file, &super::registry())?;
    stitch_place::kernel::kernel_only(&graph)
        .map_err(|errors| anyhow!("{}", GraphErrors::in_file(file, errors)))
}

pub fn run(cmd: KernelCmd) -> Result<()> {
    match cmd {
        KernelCmd::Apply { file, plane } => {
            let plan = plan(&file)?;
            let dp = DataPlane::new(&plane.name)?;
            let report = dp.apply(&plan, &file.display().to_string())?;
            let list = |v: &[String]| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    v.join(", ")
                }
            };
            println!(
                "kernel data plane `{}`: {} apps, {} links installed from {}",
                plane.name,
                plan.apps.len(),
                plan.links.len(),
                file.display()
            );
            println!(
                "  added: {}\n  changed: {}\n  kept: {}\n  removed: {}",
                list(&report.added),
                list(&report.changed),
                list(&report.kept),
                list(&report.removed)
            );
        }
        KernelCmd::Status { plane, json } => {
            let dp = DataPlane::new(&plane.name)?;
            let Some(status) = dp.status()? else {
                if json {
                    println!("null");
                } else {
                    println!(
                        "no kernel data plane `{}` is installed (`stitch kernel apply FILE`)",
                        plane.name
                    );
                }
                return Ok(());
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", render(&status));
            }
        }
        KernelCmd::Teardown { plane } => {
            let dp = DataPlane::new(&plane.name)?;
            if dp.teardown()? {
                println!("kernel data plane `{}` removed", plane.name);
            } else {
                println!("no kernel data plane `{}` was installed", plane.name);
            }
        }
    }
    Ok(())
}

fn render(s: &stitch_kernel::Status) -> String {
    let mut out = format!("kernel data plane `{}` from {}\n", s.name, s.graph_file);
    out += &format!(
        "{:<14} {:<10} {:<14} {:>12} {:>12} {:>12} {:>10} {:>5}\n",
        "app", "kind", "port", "in pkts", "out pkts", "out bytes", "drops", "taps"
    );
    for a in &s.apps {
        for p in &a.ports {
            let port = match (&a.interface, a.attached) {
                (Some(i), Some(true)) => i.clone(),
                (Some(i), _) => format!("{i} (detached)"),
                _ => p.port.clone(),
            };
            out += &format!(
                "{:<14} {:<10} {:<14} {:>12} {:>12} {:>12} {:>10} {:>5}\n",
                a.name,
                a.kind,
                port,
                p.stats.rx_packets,
                p.stats.tx_packets,
                p.stats.tx_bytes,
                p.stats.drops,
                p.taps
            );
        }
        let own: Vec<String> = a
            .counters
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        if !own.is_empty() {
            out += &format!("{:<14} {}\n", "", own.join(", "));
        }
    }
    out
}
