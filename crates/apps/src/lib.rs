//! Stitch network functions. Each app is one module: its config, its documentation with a graph
//! snippet, and its tests. [`register`] adds them all to a registry.
//!
//! # Map
//!
//! The modules, in short: network functions, one module each: `generator`, `forwarder`, `tee`,
//! `sink`, `round_robin`, `join`, `rate_meter`, `bridge`, `sessions` (the NAT's and firewall's
//! session tables: a slab of fixed records, an open-addressing index fetched ahead, expiry lists
//! read from their heads, free ports in bitmaps), `router` (+ `router/lpm`: the forwarding
//! table, prefixes flattened into address ranges under a direct table, looked up 16 frames at a
//! time with prefetch), `nat`, `vlan`, `vxlan`, `policer`, `delay`, `load_balancer`, `lwaftr` (+
//! `lwaftr/config`: Snabb's configuration text, `lwaftr/binding`: the binding table — addresses and
//! long-PSID softwires in open-addressing tables of 16-byte slots, softwires in one array of
//! 32-byte slots, so a lookup reads a line or two and can be fetched ahead —, `lwaftr/frag`:
//! reassembly and fragment sizes, `lwaftr/offline`: the function driven without an engine, for
//! `lwaftr check` and its benchmark; in `push` each side's frames go through Snabb's pipeline in
//! one app — untag, reassemble, ingress filter, ARP/NDP, ping, translate — and leave through egress
//! filter, fragmentation to the side's MTU and tagging).

pub mod bridge;
pub mod classify;
pub mod delay;
pub mod firewall;
pub mod forwarder;
pub mod generator;
pub mod join;
pub mod load_balancer;
pub mod lwaftr;
pub mod nat;
pub mod policer;
pub mod rate_meter;
pub mod round_robin;
pub mod router;
pub mod sessions;
pub mod sink;
pub mod tee;
pub mod vlan;
pub mod vxlan;

use stitch_core::{AppType, Registry};

/// Adds every app of this crate to `r`.
pub fn register(r: &mut Registry) {
    r.register(AppType::of::<lwaftr::Lwaftr>(
        "lwaftr",
        "lightweight 4over6 AFTR (RFC 7596) configured with Snabb's lwAFTR file",
    ));
    r.register(AppType::of::<generator::Generator>(
        "generator",
        "builds Ethernet/IPv4/IPv6/UDP/TCP packets: fixed size or mix, flows, rate limit",
    ))
    .register(AppType::of::<forwarder::Forwarder>(
        "forwarder",
        "moves packets from input to output",
    ))
    .register(AppType::of::<tee::Tee>(
        "tee",
        "copies each packet to every output",
    ))
    .register(AppType::of::<sink::Sink>(
        "sink",
        "frees and counts packets",
    ))
    .register(AppType::of::<round_robin::RoundRobin>(
        "round_robin",
        "spreads packets over outputs in turn",
    ))
    .register(AppType::of::<join::Join>(
        "join",
        "merges inputs into one output",
    ))
    .register(AppType::of::<rate_meter::RateMeter>(
        "rate_meter",
        "passes packets and measures their rate",
    ))
    .register(AppType::of::<bridge::Bridge>(
        "bridge",
        "VLAN-aware learning switch: aging, flooding, access/trunk ports",
    ))
    .register(AppType::of::<vlan::Vlan>(
        "vlan",
        "pushes, pops or translates 802.1Q tags",
    ))
    .register(AppType::of::<router::Router>(
        "router",
        "IPv4/IPv6 router: longest-prefix match, ARP and NDP, router advertisements, ICMP errors",
    ))
    .register(AppType::of::<vxlan::Vxlan>(
        "vxlan",
        "VXLAN (RFC 7348) tunnel endpoint: segments by VNI over IPv4 or IPv6, head-end replication, learning",
    ))
    .register(AppType::of::<nat::Nat>(
        "nat",
        "IPv4 NAPT: masquerade with endpoint-independent mappings, address pools, port forwards, hairpinning",
    ))
    .register(AppType::of::<firewall::Firewall>(
        "firewall",
        "stateful filter between lan and wan: ordered rules, TCP/UDP/ICMP connection tracking",
    ))
    .register(AppType::of::<policer::Policer>(
        "policer",
        "token bucket in pps or bit/s; excess dropped",
    ))
    .register(AppType::of::<delay::Delay>(
        "delay",
        "holds each packet a fixed time, in order: a link of known latency",
    ))
    .register(AppType::of::<load_balancer::LoadBalancer>(
        "load_balancer",
        "spreads flows over outputs by 5-tuple hash (symmetric option)",
    ));
}

// A config value given once or as a list (`remote: 192.0.2.2` or `remote: [192.0.2.2, …]`);
// not a doc comment, which the apps' reference would repeat at every setting of this type.
#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// Scaffolding shared by the functions' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use stitch_core::link::{link, Consumer, Producer};
    use stitch_core::{App, AppContext, Io};

    /// An app built from a JSON config as a graph builds it: checked by `declare`, then `new`.
    pub(crate) fn build<A: App>(config: serde_json::Value) -> A {
        let c: A::Config = serde_json::from_value(config).unwrap();
        A::declare(&c).unwrap();
        let mut ctx = AppContext::new("test", std::path::Path::new("."), Default::default());
        A::new(c, &mut ctx).unwrap()
    }

    /// Shard `index` of `count` of an app, as a sharded graph builds it.
    pub(crate) fn build_shard<A: App>(config: serde_json::Value, index: usize, count: usize) -> A {
        let c: A::Config = serde_json::from_value(config).unwrap();
        A::declare(&c).unwrap();
        let mut ctx = AppContext::new("test", std::path::Path::new("."), Default::default());
        ctx.set_shard(Some(stitch_core::graph::Shard {
            of: "test".into(),
            index,
            count,
        }));
        A::new(c, &mut ctx).unwrap()
    }

    /// The frames a shard sent out of (lan, wan).
    pub(crate) type Sent = (Vec<Vec<u8>>, Vec<Vec<u8>>);

    /// Two shards of a `lan`/`wan` app and their hand-off links, run until nothing moves
    /// between them; what each sent out of lan and wan.
    pub(crate) struct TwoShards<A> {
        pub apps: [A; 2],
        pub io: [Io; 2],
        /// Per shard: feeds of lan, wan, shard0, shard1.
        pub feeds: [[Producer; 4]; 2],
        pub seen: [[Consumer; 4]; 2],
    }

    impl<A: App> TwoShards<A> {
        pub(crate) fn new(config: serde_json::Value) -> Self {
            let names = ["lan", "wan", "shard0", "shard1"];
            let (io0, f0, s0) = ports(names);
            let (io1, f1, s1) = ports(names);
            TwoShards {
                apps: [build_shard(config.clone(), 0, 2), build_shard(config, 1, 2)],
                io: [io0, io1],
                feeds: [f0, f1],
                seen: [s0, s1],
            }
        }

        /// Runs both shards, moving what each handed to the other, until neither hands any;
        /// returns the frames out of (lan, wan) of each shard.
        pub(crate) fn run(&mut self) -> [Sent; 2] {
            let mut out: [Sent; 2] = Default::default();
            loop {
                for k in 0..2 {
                    self.apps[k].push(&mut self.io[k]);
                }
                let mut moved = false;
                for (k, out) in out.iter_mut().enumerate() {
                    let other = 1 - k;
                    // Shard k's output `shard{other}` feeds the other's input `shard{k}`.
                    for p in self.seen[k][2 + other].drain().collect::<Vec<_>>() {
                        self.feeds[other][2 + k].transmit(p);
                        moved = true;
                    }
                    out.0
                        .extend(self.seen[k][0].drain().map(|p| p.data().to_vec()));
                    out.1
                        .extend(self.seen[k][1].drain().map(|p| p.data().to_vec()));
                }
                if !moved {
                    return out;
                }
            }
        }
    }

    /// An `Io` with an input and an output of each name: what is transmitted on `feeds[i]`
    /// arrives on input `i`, `seen[i]` reads output `i`.
    pub(crate) fn ports<const N: usize>(names: [&str; N]) -> (Io, [Producer; N], [Consumer; N]) {
        let (mut feeds, mut inputs, mut outputs, mut seen) = (vec![], vec![], vec![], vec![]);
        for n in names {
            let (feed, input) = link(64);
            let (output, out) = link(64);
            feeds.push(feed);
            inputs.push((n.to_string(), input));
            outputs.push((n.to_string(), output));
            seen.push(out);
        }
        (Io::new(inputs, outputs), array(feeds), array(seen))
    }

    fn array<T, const N: usize>(v: Vec<T>) -> [T; N] {
        v.try_into()
            .unwrap_or_else(|_| unreachable!("one per name"))
    }
}
