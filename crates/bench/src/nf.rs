//! `stitch bench nf NAME`: the cost of one network function per packet, with realistic tables,
//! against a raw-ring baseline measured in the same run.
//!
//! Both loops refill a batch of 64-byte frames from templates (so that TTLs and addresses start
//! fresh every time), written straight into the function's input link as a source does
//! (`transmit_fresh`), and free its outputs a block at a time (`free_available`), as a sink
//! does; the function loop calls its `push`, the baseline moves the batch across with
//! `forward_to`. The function's cost is the difference, in CPU time of the measuring thread.
//!
//! The stateful functions (`nat`, `firewall`) take `--sessions N` (the flows they hold; made
//! before measuring, in another order than they are then sent, so that neither the table nor
//! its records are read in the order they were written), `--new-sessions` (the setup rate:
//! every packet a new flow into an empty table) and, for the NAT, `--flood` (every port of its
//! address taken, new flows refused while established ones go on).

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

pub(crate) fn udp_frame(
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

/// The options of the stateful functions' benchmarks.
#[derive(clap::Args, Default, Clone)]
pub struct StatefulArgs {
    /// Sessions held (NAT mappings, firewall connections): 100 000 for the NAT and 4 096 for
    /// the firewall unless given.
    #[arg(long)]
    pub sessions: Option<usize>,
    /// Measure the setup rate instead: each packet a new session (as many as `--sessions`,
    /// default 1 000 000) into an empty table.
    #[arg(long)]
    pub new_sessions: bool,
    /// NAT: every port taken, an equal flood of new flows beside the established ones.
    #[arg(long)]
    pub flood: bool,
}

/// A function under test: the app, its ports, and the frames to feed its first input.
struct Subject {
    app: Box<dyn DynApp>,
    inputs: Vec<String>,
    outputs: Vec<String>,
    templates: Vec<Vec<u8>>,
    /// Frames to feed once before measuring (ARP answers, learning).
    warmup: Vec<(usize, Vec<u8>)>,
    /// Whether every template is fed once before measuring (sessions made), in another order.
    warm_templates: bool,
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

fn subject(name: &str, args: &StatefulArgs) -> Result<Subject> {
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    let stateful = matches!(name, "nat" | "firewall");
    anyhow::ensure!(
        stateful || (args.sessions.is_none() && !args.new_sessions && !args.flood),
        "--sessions, --new-sessions and --flood are for nat and firewall"
    );
    anyhow::ensure!(!args.flood || name == "nat", "--flood is for nat");
    match name {
        "router" => router_subject(&mut rng),
        "router6" => router6_subject(&mut rng),
        "firewall" | "firewall-stateless" => {
            firewall_subject(name == "firewall", args.sessions.unwrap_or(4096))
        }
        "nat" => nat_subject(args.sessions.unwrap_or(100_000)),
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
        warm_templates: false,
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
        warm_templates: false,
        templates,
        table: "200k IPv6 routes (/20–/48 in 2000::/3) over 16 next hops, random destinations"
            .into(),
    })
}

/// `n` UDP frames of distinct flows from as many inside hosts (10.0.0.0/8) to one server.
fn inside_flows(n: usize, dst_mac: [u8; 6]) -> Vec<Vec<u8>> {
    (0..n as u32)
        .map(|i| {
            udp_frame(
                dst_mac,
                HOST,
                [10, (i >> 16) as u8, (i >> 8) as u8, i as u8],
                10000 + (i % 50000) as u16,
                [198, 51, 100, 1],
                53,
            )
        })
        .collect()
}

fn firewall_subject(stateful: bool, sessions: usize) -> Result<Subject> {
    anyhow::ensure!(sessions <= 1 << 24, "--sessions: at most 16 777 216");
    // 999 rules that do not match, then accept.
    let mut rules: Vec<serde_json::Value> = (0..999)
        .map(|i| json!({ "action": "drop", "proto": "udp", "dst": format!("172.16.{}.{}/32", i / 256, i % 256), "dst_port": "1-10" }))
        .collect();
    rules.push(json!({ "action": "accept" }));
    let app = build::<Firewall>(
        json!({ "rules": rules, "stateful": stateful, "max_connections": sessions.max(1 << 20) }),
    )?;
    let (inputs, outputs) = lan_wan();
    let table = if stateful {
        format!("1000 rules, {sessions} tracked UDP flows")
    } else {
        "1000 rules, classified: first match for every packet".into()
    };
    Ok(Subject {
        app,
        inputs,
        outputs,
        warmup: vec![],
        warm_templates: stateful,
        templates: inside_flows(sessions, WAN_MAC),
        table,
    })
}

/// External addresses for `sessions` mappings, one flow per inside host: six (a /29, as
/// before there was a choice) up to 100 000, else one per 40 000 (paired pooling puts each
/// host on one address, by a hash: the busiest address must stay under its 64 512 ports).
fn nat_externals(sessions: usize) -> serde_json::Value {
    if sessions <= 100_000 {
        return json!("192.0.2.8/29");
    }
    let n = sessions.div_ceil(40_000) as u32;
    let all: Vec<String> = (0..n)
        .map(|i| std::net::Ipv4Addr::from(0xc612_0001 + i).to_string())
        .collect();
    json!(all)
}

fn nat_subject(sessions: usize) -> Result<Subject> {
    anyhow::ensure!(sessions <= 1 << 24, "--sessions: at most 16 777 216");
    let externals = nat_externals(sessions);
    let count = externals.as_array().map_or(6, Vec::len);
    let app = build::<Nat>(json!({ "external": externals, "ports": "1024-65535",
        "max_mappings": sessions.max(1 << 20) }))?;
    let (inputs, outputs) = lan_wan();
    Ok(Subject {
        app,
        inputs,
        outputs,
        warmup: vec![],
        warm_templates: true,
        templates: inside_flows(sessions, WAN_MAC),
        table: format!("{sessions} mapped UDP flows, {count} external addresses"),
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
        warm_templates: false,
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
        warm_templates: false,
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
        warm_templates: false,
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
        warm_templates: false,
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
        warm_templates: false,
        templates: flows(4096),
        table: "4096 flows over 4 outputs, symmetric hash".into(),
    })
}

/// Feeds each template once, in the order of `order`, to the function (or, without
/// `with_app`, across the raw-ring baseline): output packets and CPU seconds.
fn feed_once(s: &mut Subject, order: &[u32], with_app: bool) -> (u64, f64) {
    let (mut feeds, mut drains, mut io) = ports(s);
    let mut packets = 0;
    let c0 = crate::thread_cpu_seconds();
    for chunk in order.chunks(BATCH) {
        let mut k = 0;
        let templates = &s.templates;
        feeds[0].transmit_fresh(chunk.len(), 64, |p| {
            // SAFETY: `transmit_fresh` hands fresh packets; templates are 64-byte frames.
            unsafe { p.set_fresh_data(&templates[chunk[k] as usize]) };
            k += 1;
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
    (packets, crate::thread_cpu_seconds() - c0)
}

/// The templates' numbers in a strided order: each once, neighbours far apart.
fn strided(n: usize) -> Vec<u32> {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut stride = 7919 % n.max(2);
    while gcd(stride, n) != 1 {
        stride += 1;
    }
    (0..n).map(|k| ((k * stride) % n) as u32).collect()
}

/// The subject's input and output links and its `Io`.
fn ports(s: &Subject) -> (Vec<Producer>, Vec<Consumer>, Io) {
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
    (feeds, drains, Io::new(ins, outs))
}

/// Packets and CPU seconds of one measurement; `app` None measures the raw-ring baseline.
fn measure(s: &mut Subject, with_app: bool, secs: f64) -> (u64, f64) {
    let (mut feeds, mut drains, mut io) = ports(s);
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

/// Runs of the function against the baseline: (function alone, raw) ns per output packet.
fn runs_of(s: &mut Subject, seconds: f64, runs: usize, show: bool) -> Result<Vec<(f64, f64)>> {
    if show {
        println!(
            "{:>3}  {:>14} {:>14} {:>12} {:>14}",
            "run", "nf ns/packet", "raw ns/packet", "nf alone ns", "Mpps per core"
        );
    }
    let mut results = Vec::new();
    for run in 1..=runs {
        let (bp, bc) = measure(s, false, seconds);
        let (np, nc) = measure(s, true, seconds);
        anyhow::ensure!(
            np > 0,
            "the function let no packet through (check its table)"
        );
        let (base, total) = (bc * 1e9 / bp.max(1) as f64, nc * 1e9 / np as f64);
        let alone = (total - base).max(0.01);
        if show {
            println!(
                "{run:>3}  {total:>14.1} {base:>14.1} {alone:>12.1} {:>14.2}",
                1e3 / alone
            );
        }
        results.push((total, base));
    }
    Ok(results)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The session count and table memory a stateful function reports.
fn table_facts(s: &mut Subject) -> String {
    let facts = s.app.query(&json!({ "limit": 0 }));
    match (facts["count"].as_u64(), facts["memory_bytes"].as_u64()) {
        (Some(n), Some(bytes)) => format!(
            "{n} sessions held; table {:.0} MiB for {} at most ({:.0} bytes each)",
            bytes as f64 / (1 << 20) as f64,
            facts["capacity"],
            bytes as f64 / facts["capacity"].as_f64().unwrap_or(1.0)
        ),
        _ => String::new(),
    }
}

pub fn run(name: &str, seconds: f64, runs: usize, args: &StatefulArgs) -> Result<()> {
    if args.new_sessions {
        return run_new_sessions(name, runs, args);
    }
    if args.flood {
        return run_flood(seconds, runs);
    }
    let built = Instant::now();
    let mut s = subject(name, args)?;
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
    if s.warm_templates {
        let order = strided(s.templates.len());
        feed_once(&mut s, &order, true);
        println!("{}", table_facts(&mut s));
    }
    let results = runs_of(&mut s, seconds, runs, true)?;
    let m = median(results.iter().map(|(t, b)| (t - b).max(0.01)).collect());
    println!(
        "median: {m:.1} ns per packet in the function alone = {:.2} Mpps per core",
        1e3 / m
    );
    Ok(())
}

/// `--new-sessions`: each run a fresh function given as many new flows as `--sessions`, each
/// packet one flow's first; the setup rate is flows per CPU second of the function alone.
fn run_new_sessions(name: &str, runs: usize, args: &StatefulArgs) -> Result<()> {
    let n = args.sessions.unwrap_or(1_000_000);
    let args = StatefulArgs {
        sessions: Some(n),
        ..args.clone()
    };
    println!("nf {name} --new-sessions: {n} new UDP flows into an empty table, {runs} runs");
    println!(
        "{:>3}  {:>12} {:>12} {:>14} {:>18}",
        "run", "nf ns/flow", "raw ns/flow", "nf alone ns", "M new flows/s/core"
    );
    let order: Vec<u32> = (0..n as u32).collect();
    let mut rates = Vec::new();
    for run in 1..=runs {
        let mut s = subject(name, &args)?;
        let (bp, bc) = feed_once(&mut s, &order, false);
        let (np, nc) = feed_once(&mut s, &order, true);
        let made = s.app.query(&json!({ "limit": 0 }))["count"]
            .as_u64()
            .unwrap_or(0);
        anyhow::ensure!(
            made as usize == n && np as usize == n,
            "{made} sessions made and {np} packets passed of {n}"
        );
        let (base, total) = (bc * 1e9 / bp.max(1) as f64, nc * 1e9 / n as f64);
        let alone = (total - base).max(0.01);
        println!(
            "{run:>3}  {total:>12.1} {base:>12.1} {alone:>14.1} {:>18.2}",
            1e3 / alone
        );
        rates.push(1e3 / alone);
    }
    println!(
        "median: {:.2} M new sessions per second per core",
        median(rates)
    );
    Ok(())
}

/// `--flood` (NAT): one external address with every port taken (1 000 established flows,
/// the rest held by others), then the established flows alone, and with as many packets of
/// new flows between theirs — all refused. The NAT keeps its established flows' rate when a
/// refused packet costs no more than a translated one.
fn run_flood(seconds: f64, runs: usize) -> Result<()> {
    const ESTABLISHED: usize = 1000;
    let ports = 65535 - 1024 + 1;
    let app = build::<Nat>(json!({ "external": "192.0.2.10", "ports": "1024-65535" }))?;
    let all = inside_flows(ports, WAN_MAC);
    let established: Vec<Vec<u8>> = all[..ESTABLISHED].to_vec();
    let new_flows: Vec<Vec<u8>> = (0..65536u32)
        .map(|i| {
            udp_frame(
                WAN_MAC,
                HOST,
                [10, 200, (i >> 8) as u8, i as u8],
                20000 + (i % 40000) as u16,
                [198, 51, 100, 1],
                53,
            )
        })
        .collect();
    let (inputs, outputs) = lan_wan();
    let mut s = Subject {
        app,
        inputs,
        outputs,
        warmup: vec![],
        warm_templates: true,
        templates: all,
        table: String::new(),
    };
    let order = strided(ports);
    feed_once(&mut s, &order, true);
    let facts = s.app.query(&json!({ "limit": 0 }));
    anyhow::ensure!(
        facts["count"].as_u64() == Some(ports as u64),
        "{} of {ports} ports mapped",
        facts["count"]
    );
    println!(
        "nf nat --flood: one external address, all {ports} ports mapped; {ESTABLISHED} established flows, {seconds} s per loop, {runs} runs"
    );
    s.templates = established.clone();
    let plain = runs_of(&mut s, seconds, runs, false)?;
    s.templates = established
        .iter()
        .zip(new_flows.iter().cycle())
        .flat_map(|(e, n)| [e.clone(), n.clone()])
        .collect();
    let mixed = runs_of(&mut s, seconds, runs, false)?;
    println!(
        "{:>3}  {:>22} {:>22} {:>18}",
        "run", "established ns/packet", "refused ns/packet", "established keep"
    );
    let mut keeps = Vec::new();
    for (run, ((pt, pb), (mt, mb))) in plain.iter().zip(&mixed).enumerate() {
        // Per established packet delivered: alone its own cost; mixed, its own and one
        // refused packet's (the baseline moved two packets per delivered one).
        let est = (pt - pb).max(0.01);
        let refused = (mt - 2.0 * mb - est).max(0.0);
        let keep = 2.0 * est / (est + refused);
        println!(
            "{:>3}  {est:>22.1} {refused:>22.1} {:>17.0} %",
            run + 1,
            keep.min(1.0) * 100.0
        );
        keeps.push(keep.min(1.0));
    }
    println!(
        "median: established flows keep {:.0} % of their rate under an equal flood of new flows",
        median(keeps) * 100.0
    );
    Ok(())
}
