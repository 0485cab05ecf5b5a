//! Frames into the network functions (first byte: which function and which input; the rest:
//! the frame). Each is configured with the features that read the most of a packet: the
//! router with IPv6 and advertisements, the firewall with rules and tracking, NAT with an
//! address pool and a forward, VXLAN over IPv4 and IPv6 with several remotes, a trunked bridge.
//! Every bad frame must be counted and dropped, never a panic.
use std::cell::RefCell;
use std::path::Path;
use stitch_core::app::{Counters, DynApp};
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pool, AppContext, Io, PortNames, Registry};

struct Rig {
    app: Box<dyn DynApp>,
    io: Io,
    inputs: Vec<Producer>,
    outputs: Vec<Consumer>,
}

fn configs() -> Vec<(&'static str, serde_json::Value)> {
    use serde_json::json;
    vec![
        (
            "router",
            json!({ "interfaces": {
            "lan": { "mac": "02:00:00:00:01:01", "address": "10.0.1.1/24", "address6": "2001:db8:1::1/64", "advertise": true },
            "wan": { "mac": "02:00:00:00:02:01", "address": "192.0.2.2/24", "address6": "2001:db8:2::1/64" } },
            "routes": [ { "prefix": "0.0.0.0/0", "via": "192.0.2.9" }, { "prefix": "::/0", "via": "2001:db8:2::9" } ] }),
        ),
        (
            "firewall",
            json!({ "rules": [
            { "action": "accept", "from": "lan" },
            { "action": "reject", "proto": "tcp", "dst_port": "1-1024" },
            { "action": "accept", "proto": "icmp" } ] }),
        ),
        (
            "nat",
            json!({ "external": ["192.0.2.10", "198.51.100.0/30"], "ports": "5000-5003",
            "forwards": [ { "proto": "tcp", "port": 80, "to_address": "10.0.0.5", "to_port": 8080 } ] }),
        ),
        (
            "vxlan",
            json!({ "local": "192.0.2.1", "local_mac": "02:00:00:00:00:01", "next_hop_mac": "02:00:00:00:00:02",
            "segments": { "a": { "vni": 7, "remote": ["192.0.2.2", "192.0.2.3"] } } }),
        ),
        (
            "vxlan",
            json!({ "local": "2001:db8::1", "local_mac": "02:00:00:00:00:01", "next_hop_mac": "02:00:00:00:00:02",
            "segments": { "a": { "vni": 7, "remote": ["2001:db8::2", "2001:db8::3"] } } }),
        ),
        (
            "bridge",
            json!({ "ports": { "a": { "vlan": 10 }, "b": { "mode": "trunk", "vlans": [10, 20] }, "c": {} } }),
        ),
        ("vlan", json!({ "mode": "translate", "map": { "10": 20 } })),
        ("load_balancer", json!({ "symmetric": true })),
    ]
}

thread_local! {
    static RIGS: RefCell<Vec<Rig>> = RefCell::new({
        let mut r = Registry::new();
        stitch_apps::register(&mut r);
        configs().into_iter().map(|(kind, config)| {
            let t = r.get(kind).unwrap();
            let parsed = t.parse(&config).map_err(|e| e.message).unwrap();
            let spec = t.declare(&parsed).unwrap();
            let names = |p: &PortNames, n: usize| match p {
                PortNames::Fixed(v) => v.clone(),
                PortNames::Any => (0..n).map(|i| format!("p{i}")).collect(),
            };
            let (ins, outs) = (names(&spec.inputs, 1), names(&spec.outputs, 3));
            let mut ctx = AppContext::new(kind, Path::new("."), Counters::default());
            let app = t.build(parsed, &mut ctx).unwrap();
            let (mut inputs, mut io_in) = (Vec::new(), Vec::new());
            for n in &ins {
                let (p, c) = link(64);
                inputs.push(p);
                io_in.push((n.clone(), c));
            }
            let (mut outputs, mut io_out) = (Vec::new(), Vec::new());
            for n in &outs {
                let (p, c) = link(256);
                outputs.push(c);
                io_out.push((n.clone(), p));
            }
            Rig { app, io: Io::new(io_in, io_out), inputs, outputs }
        }).collect()
    });
}

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let Some((&select, frame)) = data.split_first() else {
        return;
    };
    RIGS.with(|rigs| {
        let mut rigs = rigs.borrow_mut();
        let n = rigs.len();
        let rig = &mut rigs[(select as usize) % n];
        let Some(mut p) = pool::alloc() else { return };
        if p.set_data(frame).is_err() {
            return;
        }
        let input = (select as usize / n) % rig.inputs.len();
        rig.inputs[input].transmit(p);
        let Rig {
            app, io, outputs, ..
        } = rig;
        app.push(io);
        app.tick(io, std::time::Instant::now());
        for o in outputs.iter_mut() {
            o.drain().for_each(drop);
        }
    });
}
