//! A router whose control plane is Linux's (linux-cp): the router's interfaces have host sides
//! (TAPs with their MACs and addresses) in a namespace where FRR runs, FRR peers by BGP with
//! BIRD in another namespace over Stitch's ports, installs what it learns in that namespace's
//! kernel table (through nexthop objects, as zebra does), and the router forwards by it.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// Namespaces: a client behind the router's `lan`, BGP peers behind its `wan0`, `wan1`, …,
/// and the router's control plane (its interfaces' host sides, FRR); removed with what runs in
/// them. Peer `k` is 192.0.(2+k).9 in AS 65009+k, the router 192.0.(2+k).2 in AS 65001.
struct Topology {
    client: String,
    peers: Vec<String>,
    cp: String,
    /// The root namespace's ends: the client's, then each peer's.
    links: Vec<String>,
    frr: tempfile::TempDir,
}

fn peer_ip(k: usize, host: u8) -> String {
    format!("192.0.{}.{host}", 2 + k)
}

/// Peer `k`'s IPv6 subnet's address `host` (the router is ::2, the peer ::9).
fn peer_ip6(k: usize, host: u8) -> String {
    format!("2001:db8:{}::{host}", 2 + k)
}

/// What a BIRD announces in one address family.
struct Family<'a> {
    name: &'static str,
    /// The BIRD's name (its files' and control socket's).
    bird: &'static str,
    local: String,
    neighbor: String,
    /// Prefix `i`, `ADDRESS/LENGTH`.
    prefix: &'a dyn Fn(u32) -> String,
    /// An address inside prefix `i` as `ip addr add` takes it.
    sample: &'a dyn Fn(u32) -> String,
}

impl Topology {
    fn new(peers: usize) -> Topology {
        let tag = format!("{}{}", std::process::id() % 100000, rand_tag());
        let t = Topology {
            client: format!("lxc{tag}"),
            peers: (0..peers).map(|k| format!("lxp{k}{tag}")).collect(),
            cp: format!("lxr{tag}"),
            links: std::iter::once(format!("lxl{tag}"))
                .chain((0..peers).map(|k| format!("lxw{k}{tag}")))
                .collect(),
            frr: tempfile::tempdir().unwrap(),
        };
        for ns in t.namespaces() {
            must(&format!("ip netns add {ns}"));
            must(&format!("ip -n {ns} link set lo up"));
        }
        let inside = std::iter::once((&t.client, "c0")).chain(t.peers.iter().map(|p| (p, "p0")));
        for (outer, (ns, inner)) in t.links.iter().zip(inside) {
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
        must(&format!(
            "ip -n {} addr add 2001:db8:1::2/64 dev c0 nodad",
            t.client
        ));
        must(&format!(
            "ip -n {} route add default via 2001:db8:1::1",
            t.client
        ));
        for (k, p) in t.peers.iter().enumerate() {
            must(&format!("ip -n {p} addr add {}/24 dev p0", peer_ip(k, 9)));
            must(&format!(
                "ip -n {p} addr add {}/64 dev p0 nodad",
                peer_ip6(k, 9)
            ));
            must(&format!(
                "ip -n {p} route add 2001:db8:1::/64 via {}",
                peer_ip6(k, 2)
            ));
            must(&format!(
                "ip -n {p} route add 10.0.1.0/24 via {}",
                peer_ip(k, 2)
            ));
            std::fs::create_dir(t.frr.path().join(format!("peer{k}"))).unwrap();
        }
        must(&format!("chown frr:frr {}", t.frr.path().display()));
        t
    }

    fn namespaces(&self) -> Vec<&String> {
        std::iter::once(&self.client)
            .chain(&self.peers)
            .chain(std::iter::once(&self.cp))
            .collect()
    }

    fn graph(&self) -> String {
        let cp = &self.cp;
        let mut apps = format!(
            "  lan: {{ type: af_packet, interface: {} }}\n  lan_host: {{ type: tap, name: lan, namespace: {cp}, mac: \"02:00:00:00:01:01\", addresses: [10.0.1.1/24, \"2001:db8:1::1/64\"] }}\n",
            self.links[0]
        );
        let mut interfaces = String::from(
            "lan: { mac: \"02:00:00:00:01:01\", address: 10.0.1.1/24, address6: \"2001:db8:1::1/64\" }",
        );
        let mut links = String::new();
        for (k, link) in self.links[1..].iter().enumerate() {
            let mac = format!("02:00:00:00:{:02x}:01", 2 + k);
            let addr = format!("{}/24", peer_ip(k, 2));
            let addr6 = format!("{}/64", peer_ip6(k, 2));
            apps += &format!(
                "  wan{k}: {{ type: af_packet, interface: {link} }}\n  wan{k}_host: {{ type: tap, name: wan{k}, namespace: {cp}, mac: \"{mac}\", addresses: [{addr}, \"{addr6}\"] }}\n"
            );
            interfaces +=
                &format!(", wan{k}: {{ mac: \"{mac}\", address: {addr}, address6: \"{addr6}\" }}");
        }
        for port in std::iter::once("lan".to_string())
            .chain((0..self.peers.len()).map(|k| format!("wan{k}")))
        {
            links += &format!(
                "  - \"{port}.output -> r.{port}\"\n  - \"r.{port} -> {port}.input\"\n  - \"r.host_{port} -> {port}_host.input\"\n  - \"{port}_host.output -> r.host_{port}\"\n"
            );
        }
        format!(
            "apps:\n{apps}  r: {{ type: router, host_ports: true, kernel_table: 254, arp_timeout: 300,\n       interfaces: {{ {interfaces} }} }}\n  routes: {{ type: kernel_routes, namespace: {cp} }}\nlinks:\n{links}  - \"routes.output -> r.kernel\"\n"
        )
    }

    fn peer_dir(&self, k: usize) -> std::path::PathBuf {
        self.frr.path().join(format!("peer{k}"))
    }

    /// BIRD in peer `k`'s namespace announcing `prefixes` /24s from 11.0.0.0 by BGP, holding
    /// the first address of `samples` of them (spread over the range) on its loopback.
    fn start_bird(&self, k: usize, prefixes: u32, samples: u32) -> Vec<String> {
        let prefix = |i: u32| format!("{}.{}.{}.", 11 + i / 65536, (i / 256) % 256, i % 256);
        let family = Family {
            name: "ipv4",
            bird: "bird",
            local: peer_ip(k, 9),
            neighbor: peer_ip(k, 2),
            prefix: &|i| format!("{}0/24", prefix(i)),
            sample: &|i| format!("{}1/32", prefix(i)),
        };
        self.start_bird_for(k, &family, prefixes, samples)
    }

    /// A second BIRD in peer `k`'s namespace announcing `prefixes` IPv6 /48s from
    /// 2001:db8:100::/48 over an IPv6 session (the next hop the peer's link-local address, as on
    /// any direct session), holding `samples` of their first addresses on its loopback.
    fn start_bird6(&self, k: usize, prefixes: u32, samples: u32) -> Vec<String> {
        let family = Family {
            name: "ipv6",
            bird: "bird6",
            local: peer_ip6(k, 9),
            neighbor: peer_ip6(k, 2),
            prefix: &|i| format!("2001:db8:{:x}::/48", 0x100 + i),
            sample: &|i| format!("2001:db8:{:x}::1/128 nodad", 0x100 + i),
        };
        self.start_bird_for(k, &family, prefixes, samples)
    }

    /// BIRD `family.bird` in peer `k`'s namespace announcing `prefixes` prefixes by BGP and
    /// holding `samples` addresses inside them (spread over the range) on its loopback; the
    /// samples' addresses.
    fn start_bird_for(
        &self,
        k: usize,
        family: &Family,
        prefixes: u32,
        samples: u32,
    ) -> Vec<String> {
        let dir = self.peer_dir(k);
        let mut conf = format!(
            "router id {};\nprotocol device {{}}\nprotocol static announced {{ {};\n",
            peer_ip(k, 9),
            family.name
        );
        for i in 0..prefixes {
            conf += &format!("route {} blackhole;\n", (family.prefix)(i));
        }
        conf += &format!(
            "}}\nprotocol bgp up {{ local {} as {}; neighbor {} as 65001;\n\
             hold time 9; connect retry time 1; error wait time 1, 5;\n\
             {} {{ import none; export all; next hop self; }}; }}\n",
            family.local,
            65009 + k,
            family.neighbor,
            family.name
        );
        let bird = family.bird;
        std::fs::write(dir.join(format!("{bird}.conf")), conf).unwrap();
        let addresses: Vec<String> = (0..samples)
            .map(|j| j * (prefixes - 1) / (samples - 1).max(1))
            .map(|i| (family.sample)(i))
            .collect();
        for a in &addresses {
            must(&format!("ip -n {} addr add {a} dev lo", self.peers[k]));
        }
        must(&format!(
            "ip netns exec {} bird -c {d}/{bird}.conf -s {d}/{bird}.ctl -P {d}/{bird}.pid",
            self.peers[k],
            d = dir.display()
        ));
        // The addresses alone, to ping.
        (addresses.iter())
            .map(|a| a.split('/').next().unwrap().to_string())
            .collect()
    }

    fn birdc(&self, k: usize, cmd: &str) -> String {
        self.birdc_of(k, "bird", cmd)
    }

    /// `birdc` to peer `k`'s BIRD `bird` (IPv4) or `bird6`.
    fn birdc_of(&self, k: usize, bird: &str, cmd: &str) -> String {
        must(&format!(
            "birdc -s {}/{bird}.ctl {cmd}",
            self.peer_dir(k).display()
        ))
    }

    /// FRR's zebra and bgpd in the control-plane namespace, peering with every peer (over
    /// IPv4, and over IPv6 too with `v6`), with equal paths through several of them kept
    /// together (ECMP).
    fn start_frr(&self, v6: bool) {
        let d = self.frr.path().display();
        std::fs::write(self.frr.path().join("zebra.conf"), "hostname stitch-cp\n").unwrap();
        let mut bgpd = String::from(
            "router bgp 65001\n bgp router-id 10.0.1.1\n no bgp ebgp-requires-policy\n \
             bgp bestpath as-path multipath-relax\n",
        );
        for k in 0..self.peers.len() {
            let ip = peer_ip(k, 9);
            bgpd += &format!(
                " neighbor {ip} remote-as {}\n neighbor {ip} timers 1 3\n neighbor {ip} timers connect 1\n",
                65009 + k
            );
        }
        if v6 {
            for k in 0..self.peers.len() {
                let ip = peer_ip6(k, 9);
                bgpd += &format!(
                    " neighbor {ip} remote-as {}\n neighbor {ip} timers 1 3\n neighbor {ip} timers connect 1\n",
                    65009 + k
                );
            }
        }
        bgpd += " address-family ipv4 unicast\n  maximum-paths 8\n exit-address-family\n";
        if v6 {
            bgpd += " address-family ipv6 unicast\n  maximum-paths 8\n";
            for k in 0..self.peers.len() {
                bgpd += &format!("  neighbor {} activate\n", peer_ip6(k, 9));
            }
            bgpd += " exit-address-family\n";
        }
        std::fs::write(self.frr.path().join("bgpd.conf"), bgpd).unwrap();
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

    /// FRR's count of the BGP connections to peer `k` it established and dropped.
    fn frr_connections(&self, k: usize) -> (u64, u64) {
        let ip = peer_ip(k, 9);
        let out = must(&format!(
            "ip netns exec {} vtysh --vty_socket {} -c 'show bgp neighbors {ip} json'",
            self.cp,
            self.frr.path().display()
        ));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let n = &v[&ip];
        (
            n["connectionsEstablished"].as_u64().unwrap(),
            n["connectionsDropped"].as_u64().unwrap(),
        )
    }

    fn established(&self, k: usize) -> bool {
        self.birdc(k, "show protocols up").contains("Established")
    }

    fn ping(&self, to: &str) -> bool {
        sh(&format!(
            "ip netns exec {} ping -n -c 1 -W 1 {to}",
            self.client
        ))
        .status
        .success()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in self.namespaces() {
            let _ = sh(&format!(
                "ip netns pids {ns} 2>/dev/null | xargs -r kill -9"
            ));
        }
        for l in &self.links {
            let _ = sh(&format!("ip link del {l} 2>/dev/null"));
        }
        for ns in self.namespaces() {
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
            // A multipath route's ways out follow it on lines of their own, indented.
            .filter(|l| !l.starts_with(char::is_whitespace))
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
    let t = Topology::new(1);
    let s = Stitch::run(&t.graph());
    const PREFIXES: u32 = 100_000;
    let samples = t.start_bird(0, PREFIXES, 3);
    t.start_frr(false);
    wait_until("the BGP session through Stitch's ports", 60, || {
        t.established(0)
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
    assert_eq!(t.frr_connections(0), (1, 0));
    s.apply(&t.graph().replace("arp_timeout: 300", "arp_timeout: 200"));
    assert!(t.ping(&samples[1]));
    assert_eq!(kernel_routes(&s), learnt);
    std::thread::sleep(Duration::from_secs(4)); // past FRR's keepalive interval
    assert_eq!(t.frr_connections(0), (1, 0), "the session flapped");

    // An upgrade: the TAPs are handed over with their addresses (the daemon's TCP session
    // stays), the router's kernel table too — the successor forwards by the learnt routes
    // from its first breath, while its own dump of the kernel's table comes.
    let no_route = s.counter("r", "no_route_drops").unwrap();
    let (successor, _) = common::upgrade::upgrade(&s);
    let upgraded = Instant::now();
    assert!(
        t.ping(&samples[2]),
        "a learnt route is not forwarded right after the upgrade"
    );
    assert_eq!(
        s.counter("r", "no_route_drops"),
        Some(no_route),
        "the successor dropped packets for want of a learnt route: {}",
        kernel_view(&s)
    );
    wait_until("the successor following the table", 60, || {
        let v = kernel_view(&s);
        v["routes"] == learnt && v["pending"] == false && v["synced"] == true
    });
    eprintln!(
        "after the upgrade: the successor's own dump compiled {:.2} s after the hand-over",
        upgraded.elapsed().as_secs_f64()
    );
    assert!(t.ping(&samples[1]));
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        t.frr_connections(0),
        (1, 0),
        "the session flapped across the upgrade"
    );

    // Withdrawn: BIRD stops announcing; FRR takes them out of the kernel, Stitch follows.
    t.birdc(0, "disable announced");
    wait_until("Stitch forgetting withdrawn routes", 60, || {
        kernel_routes(&s) == learnt - PREFIXES as u64
    });
    assert_eq!(kernel_routes(&s), table_size(&t.cp));
    let no_route = s.counter("r", "no_route_drops").unwrap();
    assert!(!t.ping(&samples[0]));
    assert!(s.counter("r", "no_route_drops").unwrap() > no_route);
    let st = successor.stop(s);
    assert_eq!(app(&st, "routes")["counters"]["malformed_drops"], 0);
}

#[test]
fn ipv6_routes_frr_learns_by_bgp_with_link_local_next_hops_are_forwarded_by_stitch() {
    require_root_and_tools(&["bird", "birdc", "/usr/lib/frr/zebra", "/usr/lib/frr/bgpd"]);
    let t = Topology::new(1);
    let s = Stitch::run(&t.graph());
    const PREFIXES: u32 = 1000;
    let samples = t.start_bird6(0, PREFIXES, 3);
    t.start_frr(true);
    wait_until("the IPv6 BGP session through Stitch's ports", 60, || {
        t.birdc_of(0, "bird6", "show protocols up")
            .contains("Established")
    });
    let up = Instant::now();
    wait_until("Stitch following FRR's IPv6 routes", 120, || {
        let v = kernel_view(&s);
        let n = v["routes"].as_u64().unwrap_or(0);
        n >= PREFIXES as u64 && n == table_size(&t.cp) && v["unusable"] == 0
    });
    eprintln!(
        "{PREFIXES} IPv6 prefixes: in Stitch's table {:.2} s after the session came up",
        up.elapsed().as_secs_f64()
    );
    let view = kernel_view(&s);
    assert_eq!(view["unusable"], 0, "{view}");
    // FRR installed them by the peer's link-local address, as on any direct IPv6 session.
    let installed = must(&format!("ip -6 -n {} route show 2001:db8:100::/48", t.cp));
    let nexthops = must(&format!("ip -6 -n {} nexthop show", t.cp));
    assert!(
        installed.contains("fe80::") || nexthops.contains("fe80::"),
        "{installed}{nexthops}"
    );
    let forwarded = s.counter("r", "forwarded").unwrap();
    for a in &samples {
        assert!(
            t.ping(a),
            "{a}, announced by BGP, is not reached through Stitch"
        );
    }
    assert!(s.counter("r", "forwarded").unwrap() >= forwarded + 2 * samples.len() as u64);
    assert_eq!(
        must(&format!(
            "ip netns exec {} sysctl -n net.ipv6.conf.all.forwarding",
            t.cp
        ))
        .trim(),
        "0"
    );
    let learnt = kernel_routes(&s);
    t.birdc_of(0, "bird6", "disable announced");
    wait_until("Stitch forgetting withdrawn routes", 60, || {
        kernel_routes(&s) == learnt - PREFIXES as u64
    });
    assert_eq!(kernel_routes(&s), table_size(&t.cp));
    assert!(!t.ping(&samples[0]));
}

/// Packets the router's ECMP groups sent out of `port` so far (0 when no group leads there).
fn ecmp_sent(s: &Stitch, port: &str) -> u64 {
    let o = sh(&format!(
        "{} show r --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    let v = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap();
    (v["ecmp_paths"].as_array().into_iter().flatten())
        .filter(|p| p["port"] == port)
        .filter_map(|p| p["packets"].as_u64())
        .sum()
}

/// Frames the router sent out of `port` so far.
fn sent_out(s: &Stitch, port: &str) -> u64 {
    app(&s.stats().unwrap(), port)["rx_packets"]
        .as_u64()
        .unwrap()
}

#[test]
fn two_peers_announcing_the_same_prefixes_share_the_flows_and_one_going_away_moves_its_share() {
    require_root_and_tools(&["bird", "birdc", "/usr/lib/frr/zebra", "/usr/lib/frr/bgpd"]);
    let t = Topology::new(2);
    let s = Stitch::run(&t.graph());
    const PREFIXES: u32 = 200;
    let samples = t.start_bird(0, PREFIXES, 32);
    assert_eq!(t.start_bird(1, PREFIXES, 32), samples);
    t.start_frr(false);
    wait_until("both BGP sessions", 60, || {
        t.established(0) && t.established(1)
    });
    wait_until("FRR's equal paths in Stitch's table", 60, || {
        let groups = must(&format!("ip -n {} nexthop show", t.cp));
        kernel_view(&s)["pending"] == false
            && groups.contains("group")
            && must(&format!("ip -n {} route show 11.0.0.0/24", t.cp)).contains("nhid")
            && kernel_routes(&s) == table_size(&t.cp)
            && kernel_routes(&s) >= PREFIXES as u64
    });
    let before = (sent_out(&s, "wan0"), sent_out(&s, "wan1"));
    for a in &samples {
        assert!(t.ping(a), "{a} not reached");
    }
    let after = (sent_out(&s, "wan0"), sent_out(&s, "wan1"));
    let shares = (after.0 - before.0, after.1 - before.1);
    eprintln!(
        "32 destinations: {} pings by peer 0, {} by peer 1",
        shares.0, shares.1
    );
    assert!(shares.0 >= 4 && shares.1 >= 4, "not spread: {shares:?}");
    let o = sh(&format!(
        "{} show r --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    let paths =
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["ecmp_paths"].clone();
    let ports: Vec<&str> = paths
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["port"].as_str())
        .collect();
    assert!(
        ports.contains(&"wan0") && ports.contains(&"wan1"),
        "{paths}"
    );

    // Peer 1's link goes dark (no RST, no notification): FRR's hold timer (3 s) takes its
    // paths away and every destination is reached through peer 0.
    let died = Instant::now();
    must(&format!("ip -n {} link set p0 down", t.peers[1]));
    wait_until("every destination through the remaining peer", 30, || {
        samples.iter().all(|a| t.ping(a))
    });
    eprintln!(
        "peer 1's link down: every destination reached again after {:.1} s (hold time 3 s)",
        died.elapsed().as_secs_f64()
    );
    // Forwarded by the router's groups, that is (the host side still speaks on wan1: FRR
    // trying to reconnect, ARP, IPv6's neighbour and listener messages).
    let (before, by_0) = (ecmp_sent(&s, "wan1"), sent_out(&s, "wan0"));
    for a in &samples {
        assert!(t.ping(a));
    }
    assert!(sent_out(&s, "wan0") >= by_0 + samples.len() as u64);
    assert_eq!(
        ecmp_sent(&s, "wan1"),
        before,
        "traffic still sent to the dead peer"
    );
}

/// Namespaces removed, with what runs in them and the root ends of their links, at the end.
struct Namespaces {
    names: Vec<String>,
    links: Vec<String>,
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = sh(&format!(
                "ip netns pids {ns} 2>/dev/null | xargs -r kill -9"
            ));
        }
        for l in &self.links {
            let _ = sh(&format!("ip link del {l} 2>/dev/null"));
        }
        for ns in &self.names {
            let _ = sh(&format!("ip netns del {ns} 2>/dev/null"));
        }
    }
}

/// The namespaces of [`two_vrfs_follow_their_own_kernel_tables_with_the_same_prefixes_and_stay_apart`]
/// — the control namespace, then each VRF's client and peer, with the same addresses — and the
/// graph of its two routers.
fn two_vrfs() -> (Namespaces, String) {
    let tag = format!("{}{}", std::process::id() % 100000, rand_tag());
    let vrfs = ["red", "blue"];
    let ns = Namespaces {
        names: std::iter::once(format!("lvx{tag}"))
            .chain(vrfs.iter().flat_map(|v| {
                [
                    format!("lv{}c{tag}", &v[..1]),
                    format!("lv{}p{tag}", &v[..1]),
                ]
            }))
            .collect(),
        links: vrfs
            .iter()
            .flat_map(|v| {
                [
                    format!("lv{}l{tag}", &v[..1]),
                    format!("lv{}w{tag}", &v[..1]),
                ]
            })
            .collect(),
    };
    let cp = &ns.names[0];
    for n in &ns.names {
        must(&format!("ip netns add {n}"));
        must(&format!("ip -n {n} link set lo up"));
    }
    let mut apps = format!(
        "  routes: {{ type: kernel_routes, namespace: {cp} }}\n  tables: {{ type: tee }}\n"
    );
    let mut links = String::from("  - \"routes.output -> tables.input\"\n");
    for (i, v) in vrfs.iter().enumerate() {
        let (client, peer) = (&ns.names[1 + 2 * i], &ns.names[2 + 2 * i]);
        let (lan, wan) = (&ns.links[2 * i], &ns.links[2 * i + 1]);
        for (outer, n, inner, addr, via) in [
            (lan, client, "c0", "10.0.1.2/24", "default via 10.0.1.1"),
            (wan, peer, "p0", "192.0.2.9/24", "10.0.1.0/24 via 192.0.2.2"),
        ] {
            must(&format!(
                "ip link add {outer} type veth peer name {inner} netns {n}"
            ));
            must(&format!("ip link set {outer} up"));
            must(&format!("sysctl -qw net.ipv6.conf.{outer}.disable_ipv6=1"));
            must(&format!("ip -n {n} addr add {addr} dev {inner}"));
            must(&format!("ip -n {n} link set {inner} up"));
            must(&format!("ip -n {n} route add {via}"));
        }
        // Both VRFs' peers hold the same address.
        must(&format!("ip -n {peer} addr add 11.0.0.1/32 dev lo"));
        must(&format!("ip -n {peer} addr add 12.0.0.1/32 dev lo"));
        apps += &format!(
            "  {v}_lan: {{ type: af_packet, interface: {lan} }}\n  {v}_wan: {{ type: af_packet, interface: {wan} }}\n  \
             {v}: {{ type: router, kernel_table: {table},\n    interfaces: {{ lan: {{ mac: \"02:00:00:0{i}:01:01\", address: 10.0.1.1/24 }}, wan: {{ mac: \"02:00:00:0{i}:02:01\", address: 192.0.2.2/24 }} }} }}\n",
            table = 100 * (i + 1)
        );
        links += &format!(
            "  - \"{v}_lan.output -> {v}.lan\"\n  - \"{v}.lan -> {v}_lan.input\"\n  - \"{v}_wan.output -> {v}.wan\"\n  - \"{v}.wan -> {v}_wan.input\"\n  - \"tables.{v} -> {v}.kernel\"\n"
        );
    }
    (ns, format!("apps:\n{apps}links:\n{links}"))
}

/// Two VRFs as two routers, each following its own routing table (100 and 200) of one control
/// namespace through one `kernel_routes` app and a `tee`: the same addresses on both sides
/// and the same prefix in both tables, and each VRF's traffic goes only where its table says.
#[test]
fn two_vrfs_follow_their_own_kernel_tables_with_the_same_prefixes_and_stay_apart() {
    require_root_and_tools(&[]);
    let (ns, graph) = two_vrfs();
    let cp = &ns.names[0];
    // The control namespace's routes (a daemon's, in its VRFs' tables): its gateway is on a
    // link of its own there, and on each router's `wan` subnet.
    must(&format!("ip -n {cp} link add d0 type veth peer name d1"));
    must(&format!("ip -n {cp} link set d0 up"));
    must(&format!("ip -n {cp} link set d1 up"));
    let s = Stitch::run(&graph);
    for table in [100, 200] {
        must(&format!(
            "ip -n {cp} route add 11.0.0.0/24 via 192.0.2.9 dev d0 onlink table {table}"
        ));
    }
    must(&format!(
        "ip -n {cp} route add 12.0.0.0/24 via 192.0.2.9 dev d0 onlink table 200"
    ));
    let routes = |r: &str| {
        let o = sh(&format!(
            "{} show {r} --control {}",
            env!("CARGO_BIN_EXE_stitch"),
            s.socket.display()
        ));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["kernel"].clone()
    };
    wait_until("each router with its table's routes", 20, || {
        routes("red")["routes"] == 1
            && routes("blue")["routes"] == 2
            && routes("red")["pending"] == false
            && routes("blue")["pending"] == false
    });
    let ping = |client: &str, to: &str| {
        sh(&format!("ip netns exec {client} ping -c 1 -W 1 {to}"))
            .status
            .success()
    };
    let (red_client, blue_client) = (&ns.names[1], &ns.names[3]);
    let sent = |port: &str| {
        app(&s.stats().unwrap(), port)["rx_packets"]
            .as_u64()
            .unwrap()
    };
    let before = (sent("red_wan"), sent("blue_wan"));
    assert!(ping(red_client, "11.0.0.1"));
    let after = (sent("red_wan"), sent("blue_wan"));
    assert!(
        after.0 > before.0 && after.1 == before.1,
        "red's ping left by {after:?}"
    );
    assert!(ping(blue_client, "11.0.0.1"));
    assert!(ping(blue_client, "12.0.0.1"));
    // 12.0.0.0/24 is in blue's table only: red has no route to it.
    let no_route = s.counter("red", "no_route_drops").unwrap();
    assert!(!ping(red_client, "12.0.0.1"));
    assert!(s.counter("red", "no_route_drops").unwrap() > no_route);
    assert!(sent("blue_wan") >= after.1 + 2);
}

/// BIRD's OSPF on the given interfaces (hello 1 s, dead 4 s), its routes into the kernel's
/// main table; `stubs` announced without a neighbour.
fn ospf_conf(router_id: &str, interfaces: &[&str], stubs: &[&str]) -> String {
    let quoted = |v: &[&str]| {
        v.iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut areas = format!(
        "    interface {} {{ hello 1; dead 4; type pointopoint; }};\n",
        quoted(interfaces)
    );
    if !stubs.is_empty() {
        areas += &format!("    interface {} {{ stub; }};\n", quoted(stubs));
    }
    format!(
        "router id {router_id};\nprotocol device {{ scan time 1; }}\n\
         protocol kernel {{ ipv4 {{ export all; }}; }}\n\
         protocol ospf v2 {{ ipv4 {{ import all; export none; }};\n  area 0 {{\n{areas}  }};\n}}\n"
    )
}

fn start_bird_in(ns: &str, dir: &std::path::Path, conf: &str) {
    std::fs::write(dir.join("bird.conf"), conf).unwrap();
    must(&format!(
        "ip netns exec {ns} bird -c {d}/bird.conf -s {d}/bird.ctl -P {d}/bird.pid",
        d = dir.display()
    ));
}

/// The ring of [`ospf_with_bird_on_a_ring_of_three_routers_reroutes_round_a_cut_link`]: the
/// namespaces (Stitch's control plane, the client, R2, R3) and Stitch's graph — `lan` to the
/// client (10.0.1.0/24), `a` to R2 (10.12.0.0/24), `b` to R3 (10.13.0.0/24); R2 and R3 joined
/// by 10.23.0.0/24 and holding 10.2.2.2 and 10.3.3.3.
fn ospf_ring() -> (Namespaces, String) {
    let tag = format!("{}{}", std::process::id() % 100000, rand_tag());
    let ns = Namespaces {
        names: ["x", "c", "2", "3"]
            .iter()
            .map(|k| format!("lo{k}{tag}"))
            .collect(),
        links: ["l", "a", "b"]
            .iter()
            .map(|k| format!("lo{k}{tag}"))
            .collect(),
    };
    let (cp, client, r2, r3) = (&ns.names[0], &ns.names[1], &ns.names[2], &ns.names[3]);
    for n in &ns.names {
        must(&format!("ip netns add {n}"));
        must(&format!("ip -n {n} link set lo up"));
    }
    // Stitch's links: lan to the client, a to R2, b to R3; R2 and R3 joined directly.
    for (outer, n, inner, addr) in [
        (&ns.links[0], client, "c0", "10.0.1.2/24"),
        (&ns.links[1], r2, "r1", "10.12.0.2/24"),
        (&ns.links[2], r3, "r1", "10.13.0.3/24"),
    ] {
        must(&format!(
            "ip link add {outer} type veth peer name {inner} netns {n}"
        ));
        must(&format!("ip link set {outer} up"));
        must(&format!("sysctl -qw net.ipv6.conf.{outer}.disable_ipv6=1"));
        must(&format!("ip -n {n} addr add {addr} dev {inner}"));
        must(&format!("ip -n {n} link set {inner} up"));
    }
    must(&format!("ip -n {client} route add default via 10.0.1.1"));
    must(&format!(
        "ip -n {r2} link add r3 type veth peer name r2 netns {r3}"
    ));
    must(&format!("ip -n {r2} addr add 10.23.0.2/24 dev r3"));
    must(&format!("ip -n {r3} addr add 10.23.0.3/24 dev r2"));
    must(&format!("ip -n {r2} link set r3 up"));
    must(&format!("ip -n {r3} link set r2 up"));
    must(&format!("ip -n {r2} addr add 10.2.2.2/32 dev lo"));
    must(&format!("ip -n {r3} addr add 10.3.3.3/32 dev lo"));
    for n in [r2, r3] {
        must(&format!(
            "ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"
        ));
    }
    let mut apps = format!("  routes: {{ type: kernel_routes, namespace: {cp} }}\n");
    let mut links = String::from("  - \"routes.output -> r.kernel\"\n");
    let mut interfaces = Vec::new();
    for (k, (port, addr)) in [
        ("lan", "10.0.1.1/24"),
        ("a", "10.12.0.1/24"),
        ("b", "10.13.0.1/24"),
    ]
    .iter()
    .enumerate()
    {
        let mac = format!("02:00:00:00:{:02x}:01", k + 1);
        apps += &format!(
            "  {port}: {{ type: af_packet, interface: {} }}\n  {port}_host: {{ type: tap, name: {port}, namespace: {cp}, mac: \"{mac}\", addresses: [{addr}] }}\n",
            ns.links[k]
        );
        interfaces.push(format!("{port}: {{ mac: \"{mac}\", address: {addr} }}"));
        links += &format!(
            "  - \"{port}.output -> r.{port}\"\n  - \"r.{port} -> {port}.input\"\n  - \"r.host_{port} -> {port}_host.input\"\n  - \"{port}_host.output -> r.host_{port}\"\n"
        );
    }
    let graph = format!(
        "apps:\n{apps}  r: {{ type: router, host_ports: true, kernel_table: 254, interfaces: {{ {} }} }}\nlinks:\n{links}",
        interfaces.join(", ")
    );
    (ns, graph)
}

/// OSPF on a ring of three routers — Stitch's (BIRD on its interfaces' host sides) and two
/// Linux namespaces running BIRD: adjacencies come up over Stitch's ports, the routes BIRD
/// learns become the router's, and when Stitch's link to one neighbour goes dark the traffic
/// to it goes round the ring through the other.
#[test]
fn ospf_with_bird_on_a_ring_of_three_routers_reroutes_round_a_cut_link() {
    require_root_and_tools(&["bird", "birdc"]);
    let (ns, graph) = ospf_ring();
    let (cp, client, r2, r3) = (&ns.names[0], &ns.names[1], &ns.names[2], &ns.names[3]);
    let s = Stitch::run(&graph);
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    start_bird_in(
        cp,
        dirs[0].path(),
        &ospf_conf("10.0.1.1", &["a", "b"], &["lan"]),
    );
    start_bird_in(
        r2,
        dirs[1].path(),
        &ospf_conf("10.2.2.2", &["r1", "r3"], &["lo"]),
    );
    start_bird_in(
        r3,
        dirs[2].path(),
        &ospf_conf("10.3.3.3", &["r1", "r2"], &["lo"]),
    );
    let birdc = |i: usize, cmd: &str| {
        must(&format!(
            "birdc -s {}/bird.ctl {cmd}",
            dirs[i].path().display()
        ))
    };
    wait_until("OSPF adjacencies over Stitch's ports", 60, || {
        birdc(0, "show ospf neighbors").matches("Full").count() == 2
    });
    let ping = |to: &str| {
        sh(&format!("ip netns exec {client} ping -c 1 -W 1 {to}"))
            .status
            .success()
    };
    wait_until(
        "both neighbours' loopbacks reached through Stitch",
        60,
        || ping("10.3.3.3") && ping("10.2.2.2"),
    );
    let sent = |port: &str| {
        app(&s.stats().unwrap(), port)["rx_packets"]
            .as_u64()
            .unwrap()
    };
    let by_b = sent("b");
    assert!(ping("10.3.3.3"));
    assert!(sent("b") > by_b, "R3 is reached straight over b");

    // Stitch's link to R3 goes dark: after OSPF's dead interval, round the ring through R2.
    let cut = Instant::now();
    must(&format!("ip -n {r3} link set r1 down"));
    wait_until("R3 reached round the ring", 60, || ping("10.3.3.3"));
    eprintln!(
        "link to R3 cut: R3 reached through R2 after {:.1} s (OSPF dead interval 4 s)",
        cut.elapsed().as_secs_f64()
    );
    let by_a = sent("a");
    assert!(ping("10.3.3.3"));
    assert!(sent("a") > by_a, "R3 is now reached over a, through R2");
    let view = kernel_view_of(&s, "r");
    assert_eq!(view["unusable"], 0, "{view}");
}

fn kernel_view_of(s: &Stitch, app_name: &str) -> serde_json::Value {
    let o = sh(&format!(
        "{} show {app_name} --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["kernel"].clone()
}

/// Runs linux_cp/attack.py in namespace `ns`, as root or as the unprivileged uid `user`
/// (from a directory of its own that user can read: the checkout may be under /root).
fn attack(ns: &str, user: Option<u32>, args: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("attack.py");
    std::fs::write(&script, include_str!("linux_cp/attack.py")).unwrap();
    must(&format!("chmod 755 {}", dir.path().display()));
    must(&format!("chmod 644 {}", script.display()));
    let drop_to = user.map_or(String::new(), |uid| {
        format!("setpriv --reuid={uid} --regid={uid} --clear-groups ")
    });
    must(&format!(
        "ip netns exec {ns} {drop_to}/usr/bin/python3 {} {args}",
        script.display()
    ))
    .trim()
    .to_string()
}

#[test]
fn an_unprivileged_user_cannot_take_the_routers_taps_nor_speak_for_the_kernels_table() {
    require_root_and_tools(&["python3", "setpriv"]);
    const NOBODY: Option<u32> = Some(65534);
    let t = Topology::new(1);
    // The operator made `lan` persistent, with no owner: Stitch takes it over.
    must(&format!("ip -n {} tuntap add mode tap name lan", t.cp));
    let s = Stitch::run(&t.graph());
    wait_until("the router following the kernel table", 30, || {
        kernel_view(&s)["synced"] == true
    });
    let routes = kernel_routes(&s);

    // The TAPs are the router's interfaces: another user cannot attach to one (to read what is
    // punted to the daemon or to send as the router).
    assert_eq!(attack(&t.cp, NOBODY, "tap lan"), "EPERM");
    // Nor can it send a route message to the socket the router follows the table by: only a
    // process with CAP_NET_ADMIN may send to a netlink port.
    let port = attack(&t.cp, None, &format!("port {}", s.process.0.id()));
    let lan = must(&format!("ip -n {} -o link show lan", t.cp));
    let ifindex = lan.split(':').next().unwrap().trim().to_string();
    assert_eq!(
        attack(&t.cp, NOBODY, &format!("send {port} {ifindex}")),
        "EPERM"
    );
    // Root can send one, but only the kernel speaks for its table: dropped and counted.
    assert_eq!(
        attack(&t.cp, None, &format!("send {port} {ifindex}")),
        "sent"
    );
    wait_until("the forged message counted", 10, || {
        s.counter("routes", "not_from_kernel_drops") == Some(1)
    });
    assert_eq!(kernel_routes(&s), routes, "a forged route was taken");

    // The legitimate path still works: the same route written to the kernel is followed.
    must(&format!("ip -n {} route add 198.51.100.0/24 dev lan", t.cp));
    wait_until("the kernel's route followed", 10, || {
        kernel_routes(&s) == routes + 1
    });
    assert_eq!(s.counter("routes", "not_from_kernel_drops"), Some(1));

    // Stitch gone, the persistent device stays, free to attach to — by its owner only.
    s.stop();
    assert_eq!(attack(&t.cp, NOBODY, "tap lan"), "EPERM");
    assert_eq!(attack(&t.cp, None, "tap lan"), "attached");
}

/// What the operator sets on an interface's host side is the interface's: its TAP set down,
/// nothing crosses it (counted); a smaller MTU, larger packets get "fragmentation needed".
#[test]
fn the_state_and_mtu_set_on_an_interfaces_host_side_are_the_interfaces() {
    require_root_and_tools(&["ping"]);
    let t = Topology::new(1);
    let s = Stitch::run(&t.graph());
    let peer = peer_ip(0, 9);
    let ping = |size: usize| {
        sh(&format!(
            "ip netns exec {} ping -n -c 1 -W 1 -M do -s {size} {peer}",
            t.client
        ))
        .status
        .success()
    };
    wait_until("the peer reached through the router", 10, || ping(56));
    assert!(ping(1450));

    must(&format!("ip -n {} link set wan0 down", t.cp));
    let dropped = s.counter("r", "link_down_drops").unwrap();
    wait_until("the interface down with its host side", 10, || !ping(56));
    assert!(s.counter("r", "link_down_drops").unwrap() > dropped);
    must(&format!("ip -n {} link set wan0 up", t.cp));
    wait_until("the interface up again", 10, || ping(56));

    must(&format!("ip -n {} link set wan0 mtu 1400", t.cp));
    let too_big = s.counter("r", "too_big_drops").unwrap();
    wait_until("the host side's MTU taken", 10, || !ping(1450));
    assert!(s.counter("r", "too_big_drops").unwrap() > too_big);
    assert!(ping(1372), "a packet of the new MTU still crosses");
}
