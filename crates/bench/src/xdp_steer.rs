//! `stitch bench xdp-steer`: what `af_xdp` steering rules cost a frame in the interface's XDP
//! program. The kernel runs the program on one frame many times and times the loop
//! (`BPF_PROG_TEST_RUN`); programs with 1, 4, … rules take turns with the program without
//! rules, and each figure is the difference from that baseline in the same round. The rules
//! are `udp and dst port N` for different N, and the frame matches none of them, so that every
//! rule runs (the worst case), or matches the last.

use anyhow::{Context, Result};
use stitch_io::xdp::{test_runs, Unattached};
use stitch_wire::build::{Frame, Transport};
use stitch_wire::filter::PacketFilter;

#[derive(clap::Args)]
pub struct XdpSteerArgs {
    /// Rule counts to measure, each against the program without rules.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    rules: Vec<usize>,
    /// Runs of a program per measurement.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Rounds in which every program runs once, in turn; medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// A UDP frame to port `port`.
fn frame(port: u16) -> Vec<u8> {
    Frame::ipv4([10, 0, 0, 1], [10, 0, 0, 2], Transport::udp(40000, port))
        .payload_len(18)
        .bytes()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: XdpSteerArgs) -> Result<()> {
    let most = args.rules.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(most <= 32, "at most 32 rules (the af_xdp app's limit)");
    let rules: Vec<_> = (0..most)
        .map(|i| {
            PacketFilter::compile(&format!("udp and dst port {}", 4000 + i))
                .map(|f| f.instructions())
                .map_err(anyhow::Error::msg)
        })
        .collect::<Result<_>>()?;
    let load = |n: usize| {
        Unattached::load(&rules[..n], 1)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("the program with {n} rules"))
    };
    let base = load(0)?;
    let programs: Vec<(usize, Unattached)> = args
        .rules
        .iter()
        .map(|&n| Ok((n, load(n)?)))
        .collect::<Result<_>>()?;
    let miss = frame(5000);
    // (rules, frame) → extra ns per frame over the baseline, one per round.
    let mut extra: Vec<(usize, &str, Vec<f64>)> = Vec::new();
    let mut base_ns = Vec::new();
    for round in 0..args.rounds {
        let (_, b) = test_runs(&base.prog, &miss, args.repeat).context("BPF_PROG_TEST_RUN")?;
        base_ns.push(b as f64);
        for k in 0..programs.len() {
            // A different program first each round.
            let (n, p) = &programs[(k + round) % programs.len()];
            let hit = frame(4000 + *n as u16 - 1);
            for (what, f) in [("no rule matches", &miss), ("the last rule matches", &hit)] {
                let (_, ns) = test_runs(&p.prog, f, args.repeat)?;
                let (_, b) = test_runs(&base.prog, f, args.repeat)?;
                let row = match extra.iter_mut().find(|r| r.0 == *n && r.1 == what) {
                    Some(r) => r,
                    None => {
                        extra.push((*n, what, Vec::new()));
                        extra.last_mut().expect("pushed")
                    }
                };
                row.2.push(ns as f64 - b as f64);
            }
        }
    }
    extra.sort_by_key(|r| r.0);
    let base_median = median(base_ns);
    let rows: Vec<serde_json::Value> = extra
        .into_iter()
        .map(|(n, what, v)| {
            let ns = median(v);
            serde_json::json!({ "rules": n, "frame": what, "extra_ns": ns,
                "extra_ns_per_rule": ns / n as f64 })
        })
        .collect();
    if args.json {
        let doc = serde_json::json!({ "baseline_ns": base_median, "repeat": args.repeat,
            "rounds": args.rounds, "results": rows });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!(
        "bench xdp-steer: the program without rules takes {base_median:.0} ns a frame (the kernel's timing of {} runs, median of {} rounds); rules `udp and dst port N`:",
        args.repeat, args.rounds
    );
    println!(
        "{:>6}  {:<22} {:>10} {:>12}",
        "RULES", "FRAME", "EXTRA NS", "NS PER RULE"
    );
    for r in &rows {
        println!(
            "{:>6}  {:<22} {:>10.1} {:>12.2}",
            r["rules"].as_u64().unwrap_or_default(),
            r["frame"].as_str().unwrap_or_default(),
            r["extra_ns"].as_f64().unwrap_or_default(),
            r["extra_ns_per_rule"].as_f64().unwrap_or_default()
        );
    }
    Ok(())
}
