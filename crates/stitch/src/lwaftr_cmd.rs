//! `stitch lwaftr check|run`: the lwAFTR offline on PCAP files (for byte-for-byte comparisons
//! with Snabb's expected packets) and on interfaces. Its benchmark is in `stitch-bench`.

use anyhow::Result;
use pcap_file::pcap::PcapPacket;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use stitch_apps::lwaftr::offline::Offline;
use stitch_apps::lwaftr::Compat;
use stitch_io::pcap_sink::ethernet_pcap_writer;
use stitch_io::pcap_source::PcapFile;

#[derive(clap::Subcommand)]
pub enum LwaftrCmd {
    /// Runs the function on PCAP inputs and writes its outputs (timestamps zero, snaplen 65535,
    /// Ethernet), as Snabb's `lwaftr check` does, so that results compare byte for byte.
    Check {
        conf: PathBuf,
        in_v4: PathBuf,
        in_v6: PathBuf,
        out_v4: PathBuf,
        out_v6: PathBuf,
        /// Print the counters as JSON.
        #[arg(long)]
        counters: bool,
        /// `snabb` reproduces Snabb's bytes where Snabb departs from the RFCs (the lwaftr
        /// app's `compat` setting; docs/lwaftr-snabb-differences.md).
        #[arg(long, default_value = "rfc")]
        compat: String,
    },
    /// Runs the function between two interfaces (AF_PACKET).
    Run {
        conf: PathBuf,
        /// Interface toward the IPv4 internet.
        #[arg(long)]
        v4: String,
        /// Interface toward the B4s (IPv6).
        #[arg(long)]
        v6: String,
        #[arg(long)]
        duration: Option<f64>,
        #[arg(long, default_value = "lwaftr")]
        name: String,
    },
}

pub fn run(cmd: LwaftrCmd) -> Result<()> {
    match cmd {
        LwaftrCmd::Check {
            conf,
            in_v4,
            in_v6,
            out_v4,
            out_v6,
            counters,
            compat,
        } => check(
            &conf,
            [&in_v4, &in_v6],
            [&out_v4, &out_v6],
            counters,
            &compat,
        ),
        LwaftrCmd::Run { .. } => unreachable!("run by main with the graph of `run_graph`"),
    }
}

fn check(
    conf: &Path,
    inputs: [&Path; 2],
    outputs: [&Path; 2],
    print_counters: bool,
    compat: &str,
) -> Result<()> {
    let compat: Compat = compat.parse().map_err(anyhow::Error::msg)?;
    let mut aftr = Offline::new(&std::path::absolute(conf)?, compat).map_err(anyhow::Error::msg)?;
    let [v4, v6] = inputs.map(PcapFile::read_all);
    let (v4, v6) = (
        v4.map_err(anyhow::Error::msg)?,
        v6.map_err(anyhow::Error::msg)?,
    );
    let mut w = [
        ethernet_pcap_writer(outputs[0]).map_err(anyhow::Error::msg)?,
        ethernet_pcap_writer(outputs[1]).map_err(anyhow::Error::msg)?,
    ];
    let mut written = [0u64; 2];
    let mut write = |aftr: &mut Offline| -> Result<()> {
        for (side, w) in w.iter_mut().enumerate() {
            for p in aftr.drain(side) {
                w.write_packet(&PcapPacket::new(Duration::ZERO, p.len() as u32, p.data()))?;
                written[side] += 1;
            }
        }
        Ok(())
    };
    // The function's start: what it sends before any input (ARP requests and neighbor
    // solicitations for next hops given by IP).
    aftr.tick(Instant::now());
    write(&mut aftr)?;
    // In batches, IPv4 input first, as the function would see them in one breath.
    let rounds = v4.len().max(v6.len()).div_ceil(1024);
    for round in 0..rounds {
        for (side, packets) in [&v4, &v6].into_iter().enumerate() {
            for p in packets.iter().skip(round * 1024).take(1024) {
                aftr.feed(side, p).map_err(anyhow::Error::msg)?;
            }
        }
        aftr.push();
        write(&mut aftr)?;
    }
    aftr.stop();
    eprintln!(
        "lwaftr check: {} IPv4 + {} IPv6 packets in, {} out on v4 ({}), {} out on v6 ({})",
        v4.len(),
        v6.len(),
        written[0],
        outputs[0].display(),
        written[1],
        outputs[1].display()
    );
    let snapshot = aftr.counters().snapshot();
    if print_counters {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        for (k, v) in snapshot.iter().filter(|(_, v)| **v > 0) {
            eprintln!("  {k:<28} {v}");
        }
    }
    Ok(())
}

/// The graph of `stitch lwaftr run`: AF_PACKET on both interfaces around the function, in a
/// temporary folder that lives as long as the returned handle.
pub fn run_graph(conf: &Path, v4: &str, v6: &str) -> Result<(tempfile::TempDir, PathBuf)> {
    let conf = std::path::absolute(conf)?;
    let dir = tempfile::tempdir()?;
    let graph = dir.path().join("lwaftr.yaml");
    let text = serde_json::to_string_pretty(&json!({
        "apps": {
            "v4": { "type": "af_packet", "interface": v4 },
            "v6": { "type": "af_packet", "interface": v6 },
            "aftr": { "type": "lwaftr", "conf": conf },
        },
        "links": ["v4.output -> aftr.v4", "aftr.v4 -> v4.input",
                  "v6.output -> aftr.v6", "aftr.v6 -> v6.input"],
    }))?;
    std::fs::write(&graph, text)?;
    Ok((dir, graph))
}
