//! A router whose control plane is Linux's (linux-cp): the router's interfaces have host sides
//! (TAPs with their MACs and addresses) in a namespace where FRR runs, FRR peers by BGP with
//! BIRD in another namespace over Stitch's ports, installs what it learns in that namespace's
//! kernel table (through nexthop objects, as zebra does), and the router forwards by it.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// Namespaces: a client behind the router's `lan`, a BGP peer behind its `wan`, and the
/// router's control plane (its interfaces' host sides, FRR); removed with what runs in them.
struct Topology {
    client: String,
    peer: String,
    cp: String,
    links: [String; 2],
    frr: tempfile::TempDir,
}

impl Topology {
    fn new() -> Topology {
        let tag = format!("{}{}", std::process::id() % 100000, rand_tag());
        let t = Topology {
            client: format!("lxc{tag}"),
            peer: format!("lxp{tag}"),
            cp: format!("lxr{tag}"),
            links: [format!("lxl{tag}"), format!("lxw{tag}")],
            frr: tempfile::tempdir().unwrap(),
        };
        for ns in [&t.client, &t.peer, &t.cp] {
            must(&format!("ip netns add {ns}"));
            must(&format!("ip -n {ns} link set lo up"));
        }
        for (outer, (ns, inner)) in t.links.iter().zip([(&t.client, "c0"), (&t.peer, "p0")]) {
            must(&format!(
                "ip link add {outer} type veth peer name {inner} netns {ns}"
            ));
            must(&format!("ip link set {outer} up"));
            must(&format!("sysctl -qw net.ipv6.conf.{outer}.disable_ipv6=1"));
            must(&format!("ip -n {ns} link set {inner} up"));
        }
        must(&format!("ip -n {} addr add 10.0.1.2/24 dev c0", t.client));
        must(&format!(
            "ip -n {} route add default via 10.0.1.1",
            t.client
        ));
        must(&format!("ip -n {} addr add 192.0.2.9/24 dev p0", t.peer));
        must(&format!(
            "ip -n {} route add 10.0.1.0/24 via 192.0.2.2",
            t.peer
        ));
        must(&format!("chown frr:frr {}", t.frr.path().display()));
        t
    }

    fn graph(&self) -> String {
        format!(
            r#"apps:
  lan: {{ type: af_packet, interface: {lan} }}
  wan: {{ type: af_packet, interface: {wan} }}
  r: {{ type: router, host_ports: true, kernel_table: 254, arp_timeout: 300,
       interfaces: {{ lan: {{ mac: "02:00:00:00:01:01", address: 10.0.1.1/24 }},
                     wan: {{ mac: "02:00:00:00:02:01", address: 192.0.2.2/24 }} }} }}
  lan_host: {{ type: tap, name: lan, namespace: {cp}, mac: "02:00:00:00:01:01", addresses: [10.0.1.1/24] }}
  wan_host: {{ type: tap, name: wan, namespace: {cp}, mac: "02:00:00:00:02:01", addresses: [192.0.2.2/24] }}
  routes: {{ type: kernel_routes, namespace: {cp} }}
links:
  - "lan.output -> r.lan"
  - "r.lan -> lan.input"
  - "wan.output -> r.wan"
  - "r.wan -> wan.input"
  - "r.host_lan -> lan_host.input"
  - "lan_host.output -> r.host_lan"
  - "r.host_wan -> wan_host.input"
  - "wan_host.output -> r.host_wan"
  - "routes.output -> r.kernel"
"#,
            lan = self.links[0],
            wan = self.links[1],
            cp = self.cp
        )
    }

    /// BIRD in the peer's namespace announcing `prefixes` /24s from 11.0.0.0 by BGP, holding
    /// the first address of the first, middle and last of them on its loopback.
    fn start_bird(&self, prefixes: u32) -> Vec<String> {
        let dir = self.frr.path();
        let mut conf = String::from(
            "router id 192.0.2.9;\nprotocol device {}\nprotocol static announced { ipv4;\n",
        );
        let prefix = |i: u32| format!("{}.{}.{}.0", 11 + i / 65536, (i / 256) % 256, i % 256);
        for i in 0..prefixes {
            conf += &format!("route {}/24 blackhole;\n", prefix(i));
        }
        conf += "}\nprotocol bgp up { local 192.0.2.9 as 65009; neighbor 192.0.2.2 as 65001;\n\
                 hold time 9; connect retry time 1;\n\
                 ipv4 { import none; export all; next hop self; }; }\n";
        std::fs::write(dir.join("bird.conf"), conf).unwrap();
        let samples: Vec<String> = [0, prefixes / 2, prefixes - 1]
            .iter()
            .map(|&i| format!("{}.{}.{}.1", 11 + i / 65536, (i / 256) % 256, i % 256))
            .collect();
        for s in &samples {
            must(&format!("ip -n {} addr add {s}/32 dev lo", self.peer));
        }
        must(&format!(
            "ip netns exec {} bird -c {d}/bird.conf -s {d}/bird.ctl -P {d}/bird.pid",
            self.peer,
            d = dir.display()
        ));
        samples
    }

    fn birdc(&self, cmd: &str) -> String {
        must(&format!(
            "birdc -s {}/bird.ctl {cmd}",
            self.frr.path().display()
        ))
    }

    /// FRR's zebra and bgpd in the control-plane namespace, peering with the BIRD peer.
    fn start_frr(&self) {
        let d = self.frr.path().display();
        std::fs::write(self.frr.path().join("zebra.conf"), "hostname stitch-cp\n").unwrap();
        std::fs::write(
            self.frr.path().join("bgpd.conf"),
            "router bgp 65001\n bgp router-id 192.0.2.2\n no bgp ebgp-requires-policy\n \
             neighbor 192.0.2.9 remote-as 65009\n neighbor 192.0.2.9 timers 3 9\n \
             neighbor 192.0.2.9 timers connect 1\n",
        )
        .unwrap();
        must(&format!("chown frr:frr {d}/zebra.conf {d}/bgpd.conf"));
        for daemon in ["zebra", "bgpd"] {
            must(&format!(
                "ip netns exec {ns} /usr/lib/frr/{daemon} -d -f {d}/{daemon}.conf -i {d}/{daemon}.pid \
                 -z {d}/zserv.api --vty_socket {d}",
                ns = self.cp
            ));
            if daemon == "zebra" {
                wait_until("zebra's socket", 20, || {
                    self.frr.path().join("zserv.api").exists()
                });
            }
        }
    }

    /// FRR's count of the BGP connections to the peer it established and dropped.
    fn frr_connections(&self) -> (u64, u64) {
        let out = must(&format!(
            "ip netns exec {} vtysh --vty_socket {} -c 'show bgp neighbors 192.0.2.9 json'",
            self.cp,
            self.frr.path().display()
        ));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let n = &v["192.0.2.9"];
        (
            n["connectionsEstablished"].as_u64().unwrap(),
            n["connectionsDropped"].as_u64().unwrap(),
        )
    }

    fn established(&self) -> bool {
        self.birdc("show protocols up").contains("Established")
    }

    fn ping(&self, to: &str) -> bool {
        sh(&format!(
            "ip netns exec {} ping -c 1 -W 1 {to}",
            self.client
        ))
        .status
        .success()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in [&self.client, &self.peer, &self.cp] {
            let _ = sh(&format!(
                "ip netns pids {ns} 2>/dev/null | xargs -r kill -9"
            ));
        }
        for l in &self.links {
            let _ = sh(&format!("ip link del {l} 2>/dev/null"));
        }
        for ns in [&self.client, &self.peer, &self.cp] {
            let _ = sh(&format!("ip netns del {ns} 2>/dev/null"));
        }
    }
}

fn rand_tag() -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{}", n % 1000)
}

/// The router's view of the kernel table it follows.
fn kernel_view(s: &Stitch) -> serde_json::Value {
    let o = sh(&format!(
        "{} show r --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["kernel"].clone()
}

fn kernel_routes(s: &Stitch) -> u64 {
    kernel_view(s)["routes"].as_u64().unwrap_or(0)
}

/// The prefixes of namespace `ns`'s main routing table, IPv4 and IPv6, as `ip route` lists them.
fn table_size(ns: &str) -> u64 {
    const TYPES: [&str; 6] = [
        "unreachable",
        "blackhole",
        "prohibit",
        "throw",
        "unicast",
        "anycast",
    ];
    let mut n = 0;
    for family in ["-4", "-6"] {
        let out = must(&format!("ip {family} -n {ns} route show table main"));
        let prefixes: std::collections::HashSet<&str> = out
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                let first = words.next()?;
                if TYPES.contains(&first) {
                    words.next()
                } else {
                    Some(first)
                }
            })
            .collect();
        n += prefixes.len() as u64;
    }
    n
}

#[test]
fn routes_frr_learns_by_bgp_over_stitch_ports_are_forwarded_by_stitch_and_withdrawn() {
    require_root_and_tools(&["bird", "birdc", "/usr/lib/frr/zebra", "/usr/lib/frr/bgpd"]);
    let t = Topology::new();
    let s = Stitch::run(&t.graph());
    const PREFIXES: u32 = 5000;
    let samples = t.start_bird(PREFIXES);
    t.start_frr();
    wait_until("the BGP session through Stitch's ports", 60, || {
        t.established()
    });
    let up = Instant::now();
    // The connected routes of the two interfaces, and every prefix BIRD announced.
    wait_until("Stitch following FRR's routes", 120, || {
        let n = kernel_routes(&s);
        n >= PREFIXES as u64 && n == table_size(&t.cp)
    });
    let learnt = kernel_routes(&s);
    eprintln!(
        "{PREFIXES} prefixes: in Stitch's table {:.2} s after the session came up",
        up.elapsed().as_secs_f64()
    );
    let view = kernel_view(&s);
    assert_eq!(view["unusable"], 0, "{view}");
    assert_eq!(view["malformed"], 0, "{view}");
    // FRR installed them through a nexthop object, as zebra does by default.
    let installed = must(&format!("ip -n {} route show 11.0.0.0/24", t.cp));
    assert!(installed.contains("nhid"), "{installed}");
    let forwarded = s.counter("r", "forwarded").unwrap();
    for a in &samples {
        assert!(
            t.ping(a),
            "{a}, announced by BGP, is not reached through Stitch"
        );
    }
    assert!(s.counter("r", "forwarded").unwrap() >= forwarded + 2 * samples.len() as u64);
    // The control plane's kernel never forwards: the router does.
    assert_eq!(
        must(&format!(
            "ip netns exec {} sysctl -n net.ipv4.ip_forward",
            t.cp
        ))
        .trim(),
        "0"
    );

    // A live change of the router (its ARP timeout): taken in place, the session stays up and
    // the learnt routes stay.
    assert_eq!(t.frr_connections(), (1, 0));
    s.apply(&t.graph().replace("arp_timeout: 300", "arp_timeout: 200"));
    assert!(t.ping(&samples[1]));
    assert_eq!(kernel_routes(&s), learnt);
    std::thread::sleep(Duration::from_secs(4)); // past FRR's keepalive interval
    assert_eq!(t.frr_connections(), (1, 0), "the session flapped");

    // Withdrawn: BIRD stops announcing; FRR takes them out of the kernel, Stitch follows.
    t.birdc("disable announced");
    wait_until("Stitch forgetting withdrawn routes", 60, || {
        kernel_routes(&s) == learnt - PREFIXES as u64
    });
    assert_eq!(kernel_routes(&s), table_size(&t.cp));
    let no_route = s.counter("r", "no_route_drops").unwrap();
    assert!(!t.ping(&samples[0]));
    assert!(s.counter("r", "no_route_drops").unwrap() > no_route);
    let st = s.stop();
    assert_eq!(app(&st, "routes")["counters"]["malformed_drops"], 0);
}
