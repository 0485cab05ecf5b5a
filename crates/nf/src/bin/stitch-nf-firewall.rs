//! A small stateless firewall as a separate process: drops packets matching any rule, forwards
//! the rest, drops what does not parse.
//!
//! `stitch-nf-firewall [--instance NAME | --socket PATH] PORT [--drop-proto udp|tcp|icmp] [--drop-dport N]…`
//! Rules combine: `--drop-proto udp --drop-dport 53` drops UDP to port 53 only. Started by
//! Stitch (`placement: process`), it takes its socket and port from the environment.

use stitch_nf::client::{Function, Verdict};
use stitch_wire::flow;

struct Rule {
    proto: Option<u8>,
    dport: Option<u16>,
}

fn main() {
    let mut args = std::env::args().skip(1);
    let from_env = stitch_nf::client::env_port();
    let mut socket = from_env
        .as_ref()
        .map_or_else(stitch_nf::port::default_socket, |(s, _)| s.clone());
    let mut port = from_env.map(|(_, p)| p);
    let mut proto = None;
    let mut dports = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--socket" => socket = args.next().expect("--socket PATH").into(),
            // The ports of the instance started with `stitch run --name NAME`.
            "--instance" => {
                socket = stitch_nf::paths::socket_of(&args.next().expect("--instance NAME"))
            }
            "--drop-proto" => {
                proto = Some(match args.next().as_deref() {
                    Some("tcp") => 6,
                    Some("udp") => 17,
                    Some("icmp") => 1,
                    other => {
                        eprintln!("stitch-nf-firewall: --drop-proto tcp|udp|icmp, not {other:?}");
                        std::process::exit(2);
                    }
                })
            }
            "--drop-dport" => dports.push(
                args.next()
                    .and_then(|v| v.parse::<u16>().ok())
                    .expect("--drop-dport PORT"),
            ),
            _ => port = Some(a),
        }
    }
    let Some(port) = port else {
        eprintln!(
            "usage: stitch-nf-firewall [--socket PATH] PORT [--drop-proto P] [--drop-dport N]..."
        );
        std::process::exit(2);
    };
    let rules: Vec<Rule> = if dports.is_empty() {
        vec![Rule { proto, dport: None }]
    } else {
        dports
            .into_iter()
            .map(|d| Rule {
                proto,
                dport: Some(d),
            })
            .collect()
    };
    let mut f = Function::attach(&socket, &port).unwrap_or_else(|e| {
        eprintln!("stitch-nf-firewall: {e}");
        std::process::exit(1);
    });
    let r = f.run(|frame| match flow::flow(frame) {
        Ok(Some(fl)) => {
            let hit = rules.iter().any(|r| {
                (r.proto.is_none() || r.proto == Some(fl.protocol))
                    && (r.dport.is_none() || r.dport == Some(fl.dst_port))
                    && (r.proto.is_some() || r.dport.is_some())
            });
            if hit {
                Verdict::Drop
            } else {
                Verdict::Forward
            }
        }
        Ok(None) => Verdict::Forward,
        Err(_) => Verdict::Drop,
    });
    if let Err(e) = r {
        eprintln!("stitch-nf-firewall: {e}");
        std::process::exit(1);
    }
}
