//! `stitch bench nf NAME`: the cost of one network function per packet, with realistic tables,
//! against a raw-ring baseline measured in the same run.
//!
//! Both loops refill a batch of 64-byte frames from templates (so that TTLs and addresses start
//! fresh every time), written straight into the function's input link as a source does
//! (`transmit_fresh`), and free its outputs a block at a time (`free_available`), as a sink
//! does; the function loop calls its `push`, the baseline moves the batch across with
//! `forward_to`. The function's cost is the difference, in CPU time of the measuring thread.

use anyhow::Result;
use serde_json::json;
use std::time::{Duration, Instant};
use stitch_apps::{
    bridge::Bridge, firewall::Firewall, load_balancer::LoadBalancer, nat::Nat, policer::Policer,
    router::Router, vlan::Vlan, vxlan::Vxlan,
};
use stitch_core::app::DynApp;
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pool, App, AppContext, Io};
use stitch_wire::checksum;
use stitch_wire::ethertype;

const BATCH: usize = 256;

fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: [u8; 4],
    sport: u16,
    dst: [u8; 4],
    dport: u16,
) -> Vec<u8> {
    let mut f = vec![0u8; 60];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
    f[14] = 0x45;
    f[16..18].copy_from_slice(&46u16.to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&src);
    f[30..34].copy_from_slice(&dst);
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&26u16.to_be_bytes());
    let cs = checksum::checksum(&f[14..34]);
    f[24..26].copy_from_slice(&cs.to_be_bytes());
    let ps = checksum::sum(&f[26..34], 0) + 17 + 26;
    let cs = checksum::finish(checksum::sum(&f[34..60], ps));
    f[40..42].copy_from_slice(&cs.to_be_bytes());
    f
}

/// A function under test: the app, its ports, and the frames to feed its first input.
struct Subject {
    app: Box<dyn DynApp>,
    inputs: Vec<String>,
    outputs: Vec<String>,
    templates: Vec<Vec<u8>>,
    /// Frames to feed once before measuring (ARP answers, learning).
    warmup: Vec<(usize, Vec<u8>)>,
    table: String,
}

fn ctx() -> AppContext {
    AppContext::new("bench", std::path::Path::new("."), Default::default())
}

fn build<A: App>(cfg: serde_json::Value) -> Result<Box<dyn DynApp>> {
    let c: A::Config = serde_json::from_value(cfg)?;
    A::declare(&c).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Box::new(
        A::new(c, &mut ctx()).map_err(|e| anyhow::anyhow!("{e}"))?,
    ))
}

const LAN_MAC: [u8; 6] = [2, 0, 0, 0, 1, 1];
const WAN_MAC: [u8; 6] = [2, 0, 0, 0, 2, 1];
const HOST: [u8; 6] = [2, 0, 0, 0, 1, 2];
/// Next hops of the routers' tables: 192.0.2.10.. and 2001:db8:2::a.., each its own MAC. Each
/// route takes one at random (the worst case for merging neighbouring ranges).
const GATEWAYS: u64 = 16;

/// The functions `stitch bench nf` measures.
pub const NAMES: &[&str] = &[
    "router",
    "router6",
    "firewall",
    "firewall-stateless",
    "nat",
    "bridge",
    "vxlan",
    "vxlan6",
    "vlan",
    "policer",
    "load_balancer",
];

/// `n` UDP frames of distinct flows between two hosts.
fn flows(n: u32) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            udp_frame(
                LAN_MAC,
                HOST,
                [10, 0, (i >> 8) as u8, i as u8],
                1000 + i as u16,
                [10, 9, 0, 1],
                53,
            )
        })
        .collect()
}

/// A 64-byte IPv6/UDP frame.
fn udp6_frame(dst_mac: [u8; 6], src_mac: [u8; 6], src: [u8; 16], dst: [u8; 16]) -> Vec<u8> {
    let mut f = vec![0u8; 64];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    f[12..14].copy_from_slice(&ethertype::IPV6.to_be_bytes());
    f[14] = 0x60;
    f[18..20].copy_from_slice(&10u16.to_be_bytes());
    f[20] = 17;
    f[21] = 64;
    f[22..38].copy_from_slice(&src);
    f[38..54].copy_from_slice(&dst);
    f[54..56].copy_from_slice(&1000u16.to_be_bytes());
    f[56..58].copy_from_slice(&53u16.to_be_bytes());
    f[58..60].copy_from_slice(&10u16.to_be_bytes());
    let ps = checksum::sum(&f[22..54], 0) + 17 + 10;
    let cs = checksum::finish(checksum::sum(&f[54..64], ps));
    f[60..62].copy_from_slice(&cs.to_be_bytes());
    f
}

/// A neighbor advertisement from `mac`/`from` to the router's `to`, with its link-layer address.
fn neighbor_advertisement(to_mac: [u8; 6], mac: [u8; 6], from: [u8; 16], to: [u8; 16]) -> Vec<u8> {
    let mut f = vec![0u8; 14 + 40 + 32];
    f[0..6].copy_from_slice(&to_mac);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ethertype::IPV6.to_be_bytes());
    f[14] = 0x60;
    f[18..20].copy_from_slice(&32u16.to_be_bytes());
    f[20] = 58;
    f[21] = 255;
    f[22..38].copy_from_slice(&from);
    f[38..54].copy_from_slice(&to);
    let body = &mut f[54..];
    body[0] = 136;
    body[4] = 0x60; // solicited + override
    body[8..24].copy_from_slice(&from);
    body[24..26].copy_from_slice(&[2, 1]);
    body[26..32].copy_from_slice(&mac);
    let cs = stitch_wire::ndp::icmp6_checksum(&from, &to, &f[54..]);
    f[56..58].copy_from_slice(&cs.to_be_bytes());
    f
}

fn subject(name: &str) -> Result<Subject> {
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    match name {
        "router" => router_subject(&mut rng),
        "router6" => router6_subject(&mut rng),
        "firewall" | "firewall-stateless" => firewall_subject(name == "firewall"),
        "nat" => nat_subject(),
        "bridge" => bridge_subject(),
        "vxlan" | "vxlan6" => vxlan_subject(name == "vxlan6"),
        "vlan" => vlan_subject(),
        "policer" => policer_subject(),
        "load_balancer" => load_balancer_subject(),
        other => anyhow::bail!("no benchmark for `{other}` ({})", NAMES.join(", ")),
    }
}

/// Ports `lan` and `wan`, each both an input and an output.
fn lan_wan() -> (Vec<String>, Vec<String>) {
    let ports = vec!["lan".to_string(), "wan".to_string()];
    (ports.clone(), ports)
}

fn router_subject(rng: &mut fastrand::Rng) -> Result<Subject> {
    // A full table: 1M random prefixes /16../28 via one gateway; lookups hit them.
    let mut routes = Vec::with_capacity(1 << 20);
    let mut dsts = Vec::with_capacity(4096);
    for i in 0..(1 << 20) {
        let addr = (rng.u64(..) as u32) | 0x0100_0000;
        let len = 16 + (rng.u64(..) % 13) as u32;
        let net = addr & (u32::MAX << (32 - len));
        let gw = 10 + rng.u64(..) % GATEWAYS;
        routes.push(json!({ "prefix": format!("{}/{len}", std::net::Ipv4Addr::from(net)), "via": format!("192.0.2.{gw}") }));
        if i % 256 == 0 {
            dsts.push(net | (rng.u64(..) as u32 & !(u32::MAX << (32 - len))));
        }
    }
    let app = build::<Router>(json!({
        "interfaces": { "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24" },
                        "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24" } },
        "routes": routes,
    }))?;
    let mut warmup: Vec<(usize, Vec<u8>)> = (10..10 + GATEWAYS as u8)
        .map(|gw| {
            let mac = [2, 0, 0, 0, 2, gw];
            let mut arp = vec![0u8; 60];
            arp[0..6].copy_from_slice(&WAN_MAC);
            arp[6..12].copy_from_slice(&mac);
            arp[12..22].copy_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 2]);
            arp[22..28].copy_from_slice(&mac);
            arp[28..32].copy_from_slice(&[192, 0, 2, gw]);
            arp[32..38].copy_from_slice(&WAN_MAC);
            arp[38..42].copy_from_slice(&[192, 0, 2, 2]);
            (1, arp)
        })
        .collect();
    warmup.push((
        0,
        udp_frame(LAN_MAC, HOST, [10, 0, 1, 2], 1000, [1, 2, 3, 4], 53),
    ));
    let templates = dsts
        .iter()
        .map(|d| udp_frame(LAN_MAC, HOST, [10, 0, 1, 2], 1000, d.to_be_bytes(), 53))
        .collect();
    let (inputs, outputs) = lan_wan();
    Ok(Subject {
        app,
        inputs,
        outputs,
        warmup,
        templates,
        table: "1M IPv4 routes (/16–/28) over 16 next hops, random destinations".into(),
    })
}

fn router6_subject(rng: &mut fastrand::Rng) -> Result<Subject> {
    // 200 000 random prefixes /20../48 inside 2000::/3 (the lengths of the IPv6
    // internet table) via one gateway; lookups hit them.
    let mut routes = Vec::with_capacity(200_000);
    let mut dsts = Vec::with_capacity(4096);
    for i in 0..200_000 {
        let addr = ((rng.u64(..) as u128) << 64 | rng.u64(..) as u128) >> 3 | 1 << 125;
        let len = 20 + (rng.u64(..) % 29) as u32;
        let net = addr & (u128::MAX << (128 - len));
        let gw = 10 + rng.u64(..) % GATEWAYS;
        routes.push(json!({ "prefix": format!("{}/{len}", std::net::Ipv6Addr::from(net)), "via": format!("2001:db8:2::{gw:x}") }));
        if i % 48 == 0 {
            dsts.push(net | (rng.u64(..) as u128 & !(u128::MAX << (128 - len))));
        }
    }
    let app = build::<Router>(json!({
        "interfaces": { "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24", "address6": "2001:db8:1::1/64" },
                        "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24", "address6": "2001:db8:2::2/64" } },
        "routes": routes,
    }))?;
    let host: [u8; 16] = "2001:db8:1::2".parse::<std::net::Ipv6Addr>()?.octets();
    let me: [u8; 16] = "2001:db8:2::2".parse::<std::net::Ipv6Addr>()?.octets();
    let templates = dsts
        .iter()
        .map(|d| udp6_frame(LAN_MAC, HOST, host, d.to_be_bytes()))
        .collect();
    let (inputs, outputs) = lan_wan();
    Ok(Subject {
        app,
        inputs,
        outputs,
        warmup: (10..10 + GATEWAYS as u8)
            .map(|gw| {
                let mut addr = me;
                addr[15] = gw;
                (
                    1,
                    neighbor_advertisement(WAN_MAC, [2, 0, 0, 0, 2, gw], addr, me),
                )
            })
            .collect(),
        templates,
        table: "200k IPv6 routes (/20–/48 in 2000::/3) over 16 next hops, random destinations"
            .into(),
    })
}

fn firewall_subject(stateful: bool) -> Result<Subject> {
    // 999 rules that do not match, then accept.
    let mut rules: Vec<serde_json::Value> = (0..999)
        .map(|i| json!({ "action": "drop", "proto": "udp", "dst": format!("172.16.{}.{}/32", i / 256, i % 256), "dst_port": "1-10" }))
        .collect();
    rules.push(json!({ "action": "accept" }));
    let app = build::<Firewall>(json!({ "rules": rules, "stateful": stateful }))?;
    let templates = (0..4096u32)
        .map(|i| {
            udp_frame(
                WAN_MAC,
                HOST,
                [10, 0, (i >> 8) as u8, i as u8],
                1000 + i as u16,
                [198, 51, 100, 1],
                53,
            )
        })
        .collect();
    let (inputs, outputs) = lan_wan();
    let table = if stateful {
        "1000 rules, 4096 tracked UDP flows"
    } else {
        "1000 rules, classified: first match for every packet"
    };
    Ok(Subject {
        app,
        inputs,
        outputs,
        warmup: vec![],
        templates,
        table: table.into(),
    })
}

fn nat_subject() -> Result<Subject> {
    // 100 000 flows from as many hosts over six external addresses (64 512 ports each).
    let app = build::<Nat>(json!({ "external": "192.0.2.8/29", "ports": "1024-65535" }))?;
    let templates = (0..100_000u32)
        .map(|i| {
            udp_frame(
                WAN_MAC,
                HOST,
                [10, 1 + (i >> 16) as u8, (i >> 8) as u8, i as u8],
                10000 + (i % 50000) as u16,
                [198, 51, 100, 1],
                53,
            )
        })
        .collect();
    let (inputs, outputs) = lan_wan();
    Ok(Subject {
        app,
        inputs,
        outputs,
        warmup: vec![],
        templates,
        table: "100 000 mapped UDP flows, 6 external addresses".into(),
    })
}

fn bridge_subject() -> Result<Subject> {
    // 4096 learned addresses behind port b; frames from a go to them.
    let app = build::<Bridge>(json!({ "ports": { "a": {}, "b": {}, "c": {}, "d": {} } }))?;
    let macs: Vec<[u8; 6]> = (0..4096u32)
        .map(|i| [2, 0xb, 0, 0, (i >> 8) as u8, i as u8])
        .collect();
    let warmup = macs
        .iter()
        .map(|m| {
            (
                1,
                udp_frame([0xff; 6], *m, [10, 0, 0, 2], 1, [10, 0, 0, 1], 1),
            )
        })
        .collect();
    let templates = macs
        .iter()
        .map(|m| udp_frame(*m, HOST, [10, 0, 0, 1], 1, [10, 0, 0, 2], 1))
        .collect();
    let ports = vec!["a".to_string(), "b".into(), "c".into(), "d".into()];
    Ok(Subject {
        app,
        inputs: ports.clone(),
        outputs: ports,
        warmup,
        templates,
        table: "4096 learned MAC addresses".into(),
    })
}

fn vxlan_subject(v6: bool) -> Result<Subject> {
    // Encapsulation toward one remote; over IPv6 with the UDP checksum over each frame.
    let (local, remote) = if !v6 {
        ("192.0.2.1", "192.0.2.2")
    } else {
        ("2001:db8::1", "2001:db8::2")
    };
    let app = build::<Vxlan>(json!({ "local": local, "local_mac": "02:00:00:00:00:01",
        "next_hop_mac": "02:00:00:00:00:02",
        "segments": { "t": { "vni": 5001, "remote": remote } } }))?;
    Ok(Subject {
        app,
        inputs: vec!["t".into(), "underlay".into()],
        outputs: vec!["t".into(), "underlay".into()],
        warmup: vec![],
        templates: flows(4096),
        table: format!(
            "one segment over IPv{}, 4096 inner flows",
            if v6 { 6 } else { 4 }
        ),
    })
}

fn vlan_subject() -> Result<Subject> {
    // Translation through a 100-entry map; frames carry the 100 VLANs in turn.
    let map: serde_json::Map<String, serde_json::Value> = (1..=100u16)
        .map(|v| (v.to_string(), json!(v + 1000)))
        .collect();
    let app = build::<Vlan>(json!({ "mode": "translate", "map": map }))?;
    let templates = (0..4096u16)
        .map(|i| {
            let mut f = udp_frame(LAN_MAC, HOST, [10, 0, 0, 1], i, [10, 0, 0, 2], 53);
            let tag = [0x81, 0x00, 0, (1 + i % 100) as u8];
            f.splice(12..12, tag);
            f.truncate(64);
            f
        })
        .collect();
    Ok(Subject {
        app,
        inputs: vec!["input".into()],
        outputs: vec!["output".into()],
        warmup: vec![],
        templates,
        table: "translate, 100-entry map".into(),
    })
}

fn policer_subject() -> Result<Subject> {
    // A bucket that never runs dry: the cost of metering, not of dropping.
    let app = build::<Policer>(json!({ "rate": "100 Gbit/s" }))?;
    Ok(Subject {
        app,
        inputs: vec!["input".into()],
        outputs: vec!["output".into()],
        warmup: vec![],
        templates: flows(4096),
        table: "bit-rate token bucket (100 Gbit/s)".into(),
    })
}

fn load_balancer_subject() -> Result<Subject> {
    let app = build::<LoadBalancer>(json!({ "symmetric": true }))?;
    let outputs: Vec<String> = (0..4).map(|i| format!("o{i}")).collect();
    Ok(Subject {
        app,
        inputs: vec!["input".into()],
        outputs,
        warmup: vec![],
        templates: flows(4096),
        table: "4096 flows over 4 outputs, symmetric hash".into(),
    })
}

/// Packets and CPU seconds of one measurement; `app` None measures the raw-ring baseline.
fn measure(s: &mut Subject, with_app: bool, secs: f64) -> (u64, f64) {
    let mut feeds: Vec<Producer> = Vec::new();
    let mut ins = Vec::new();
    for n in &s.inputs {
        let (tx, rx) = link(4096);
        feeds.push(tx);
        ins.push((n.clone(), rx));
    }
    let mut drains: Vec<Consumer> = Vec::new();
    let mut outs = Vec::new();
    for n in &s.outputs {
        let (tx, rx) = link(4096);
        drains.push(rx);
        outs.push((n.clone(), tx));
    }
    let mut io = Io::new(ins, outs);
    if with_app {
        for (port, f) in &s.warmup {
            let mut p = pool::alloc().expect("pool");
            let _ = p.set_data(f);
            feeds[*port].transmit(p);
            s.app.push(&mut io);
        }
    }
    for d in drains.iter_mut() {
        d.drain().for_each(drop);
    }
    let (mut next, mut packets) = (0usize, 0u64);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let c0 = crate::thread_cpu_seconds();
    while Instant::now() < deadline {
        for _ in 0..64 {
            let templates = &s.templates;
            feeds[0].transmit_fresh(BATCH, 64, |p| {
                // SAFETY: `transmit_fresh` hands fresh packets; templates are 64-byte frames.
                unsafe { p.set_fresh_data(&templates[next]) };
                next = (next + 1) % templates.len();
            });
            if with_app {
                s.app.push(&mut io);
            } else {
                let (i, o) = io.pair(0, 1.min(s.outputs.len() - 1));
                i.unwrap().forward_to(o.unwrap());
            }
            for d in drains.iter_mut() {
                packets += d.free_available().0;
            }
        }
    }
    (packets, crate::thread_cpu_seconds() - c0)
}

pub fn run(name: &str, seconds: f64, runs: usize) -> Result<()> {
    let built = Instant::now();
    let mut s = subject(name)?;
    println!(
        "nf {name}: {}; 64-byte frames, {seconds} s per loop, {runs} runs",
        s.table
    );
    let facts = s.app.query(&json!({ "limit": 0 }));
    if let Some(bytes) = facts["lookup_bytes"].as_u64() {
        println!(
            "lookup table: {:.1} MiB for {} IPv4 and {} IPv6 routes ({:.1} s to parse and build)",
            bytes as f64 / (1 << 20) as f64,
            facts["route_count"],
            facts["route6_count"],
            built.elapsed().as_secs_f64()
        );
    }
    println!(
        "{:>3}  {:>14} {:>14} {:>12} {:>14}",
        "run", "nf ns/packet", "raw ns/packet", "nf alone ns", "Mpps per core"
    );
    let mut results = Vec::new();
    for run in 1..=runs {
        let (bp, bc) = measure(&mut s, false, seconds);
        let (np, nc) = measure(&mut s, true, seconds);
        anyhow::ensure!(
            np > 0,
            "the function let no packet through (check its table)"
        );
        let (base, total) = (bc * 1e9 / bp.max(1) as f64, nc * 1e9 / np as f64);
        let alone = (total - base).max(0.01);
        println!(
            "{run:>3}  {total:>14.1} {base:>14.1} {alone:>12.1} {:>14.2}",
            1e3 / alone
        );
        results.push(alone);
    }
    results.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let m = results[results.len() / 2];
    println!(
        "median: {m:.1} ns per packet in the function alone = {:.2} Mpps per core",
        1e3 / m
    );
    Ok(())
}
