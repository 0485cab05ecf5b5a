//! The in-kernel data plane (`stitch kernel apply|status|teardown`) with real namespaces,
//! veth pairs, ping and iperf3.

mod common;
use common::*;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A kernel data plane with a unique name, torn down when dropped (also on failure).
struct Plane {
    name: String,
    dir: tempfile::TempDir,
    /// The network namespace the data plane lives in (a "host"); the root one if None.
    netns: Option<String>,
}

impl Plane {
    fn new() -> Plane {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Plane {
            name: format!("k{}{n}", std::process::id() % 100000),
            dir: tempfile::tempdir().unwrap(),
            netns: None,
        }
    }

    /// A data plane inside network namespace `ns` (its bpffs pins stay in the root mount
    /// namespace: nsenter changes only the network namespace).
    fn in_netns(ns: &str) -> Plane {
        let mut p = Plane::new();
        p.netns = Some(ns.to_string());
        p
    }

    fn stitch(&self, args: &[&str]) -> Output {
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}"))
                    .arg(env!("CARGO_BIN_EXE_stitch"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_stitch")),
        };
        cmd.arg("kernel")
            .args(args)
            .args(["--name", &self.name])
            .output()
            .unwrap()
    }

    fn apply_output(&self, graph: &str) -> Output {
        let file = self.dir.path().join("graph.yaml");
        std::fs::write(&file, graph).unwrap();
        self.stitch(&["apply", file.to_str().unwrap()])
    }

    /// Applies `graph`; returns what `apply` printed.
    fn apply(&self, graph: &str) -> String {
        let o = self.apply_output(graph);
        assert!(
            o.status.success(),
            "apply failed: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn status(&self) -> serde_json::Value {
        let o = self.stitch(&["status", "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    }

    fn counter(&self, app: &str, counter: &str) -> u64 {
        let s = self.status();
        let a = s["apps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["name"] == app)
            .unwrap_or_else(|| panic!("no app {app} in {s}"));
        a["counters"][counter].as_u64().unwrap_or(0)
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        let _ = self.stitch(&["teardown"]);
    }
}

fn ok(o: &Output) -> bool {
    o.status.success()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn brb_graph(h: &TwoHosts, n: u32, firewall: &str) -> String {
    // With a firewall, it sits between the left bridge and the router.
    let (left, fw_links) = if firewall.is_empty() {
        ("r.left", String::new())
    } else {
        (
            "fw.lan",
            "  - \"fw.wan -> r.left\"\n  - \"r.left -> fw.wan\"\n".to_string(),
        )
    };
    format!(
        "placement: kernel\napps:\n  a: {{ type: af_packet, interface: {a} }}\n  b: {{ type: af_packet, interface: {b} }}\n  bra: {{ type: bridge, ports: {{ host: {{}}, rtr: {{}} }} }}\n  brb: {{ type: bridge, ports: {{ host: {{}}, rtr: {{}} }} }}\n  r: {{ type: router, interfaces: {{ left: {{ mac: \"02:00:00:00:01:01\", address: \"10.{n}.1.1/24\" }}, right: {{ mac: \"02:00:00:00:02:01\", address: \"10.{n}.2.1/24\" }} }} }}\n{firewall}links:\n  - \"a.output -> bra.host\"\n  - \"bra.host -> a.input\"\n  - \"bra.rtr -> {left}\"\n  - \"{left} -> bra.rtr\"\n{fw_links}  - \"r.right -> brb.rtr\"\n  - \"brb.rtr -> r.right\"\n  - \"brb.host -> b.input\"\n  - \"b.output -> brb.host\"\n",
        a = h.outer[0],
        b = h.outer[1]
    )
}

/// What `ip`/`tc` say about an interface, to compare before and after.
fn interface_state(dev: &str) -> String {
    must(&format!(
        "ip -d link show dev {dev} | sed 's/state [A-Z]*//'; tc qdisc show dev {dev}; tc filter show dev {dev} ingress"
    ))
}

#[test]
fn bridge_router_bridge_in_the_kernel_then_a_firewall_then_teardown() {
    require_root_and_tools(&["ip", "tc", "ping", "iperf3", "python3"]);
    let h = TwoHosts::new();
    let n = 150 + (std::process::id() % 50);
    h.two_subnets(n);
    let before = [interface_state(&h.outer[0]), interface_state(&h.outer[1])];
    let p = Plane::new();
    let out = p.apply(&brb_graph(&h, n, ""));
    assert!(out.contains("added: a, b, bra, brb, r"), "{out}");

    let o = h.exec(0, &format!("ping -c 3 -i 0.1 -W 2 10.{n}.1.1"));
    assert!(ok(&o), "the kernel router answers for itself: {}", text(&o));
    // The first packet to B may be spent on ARP.
    let o = h.exec(0, &format!("ping -c 4 -i 0.2 -W 2 10.{n}.2.2"));
    let t = text(&o);
    assert!(
        t.contains(" 3 received") || t.contains(" 4 received"),
        "A reaches B across the kernel router: {t}"
    );
    let o = h.exec(0, &format!("ping -c 1 -t 1 -W 2 10.{n}.2.2"));
    let t = text(&o);
    assert!(
        t.contains("Time to live exceeded") && t.contains(&format!("10.{n}.1.1")),
        "TTL 1 is answered by the router: {t}"
    );
    let o = h.exec(0, &format!("ping -c 1 -W 2 10.{}.9.9", n + 1));
    assert!(
        text(&o).contains("Destination Net Unreachable"),
        "no route: {}",
        text(&o)
    );
    let bps = h.iperf_tcp(&format!("10.{n}.2.2"), 2);
    eprintln!(
        "kernel bridge-router-bridge: iperf3 TCP {:.2} Gbit/s",
        bps / 1e9
    );
    assert!(bps > 0.0);
    assert!(p.counter("r", "forwarded") > 1000);
    assert!(p.counter("r", "echo_replies") >= 3);
    assert!(p.counter("r", "ttl_exceeded") >= 1);
    assert!(p.counter("bra", "learned") >= 2);
    let learned_before = p.counter("bra", "learned");

    // Live change: a firewall between the left bridge and the router. The others keep
    // their state (the bridge does not learn again; the router's ARP cache is kept).
    let fw = "  fw: { type: firewall, default: accept, rules: [ { action: drop, from: lan, proto: tcp, dst_port: 5302 }, { action: reject, from: lan, proto: udp, dst_port: 9 } ] }\n";
    let out = p.apply(&brb_graph(&h, n, fw));
    assert!(out.contains("added: fw"), "{out}");
    assert!(out.contains("kept: a, b, bra, brb, r"), "{out}");
    assert_eq!(p.counter("bra", "learned"), learned_before);
    let arp_before = p.counter("r", "arp_requests");
    let o = h.exec(0, &format!("ping -c 2 -i 0.1 -W 2 10.{n}.2.2"));
    assert!(ok(&o), "the firewall passes ping: {}", text(&o));
    assert_eq!(p.counter("r", "arp_requests"), arp_before, "ARP cache kept");

    let server = h.spawn_ready(
        1,
        "python3 -c \"import socket\nfor port in (5301, 5302):\n  s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', port)); s.listen(); globals()['s%d' % port]=s\nprint('ready', flush=True)\nimport time; time.sleep(20)\"",
    );
    let connect = |port: u16| {
        h.exec(
            0,
            &format!("python3 -c \"import socket; socket.create_connection(('10.{n}.2.2', {port}), timeout=2)\""),
        )
    };
    assert!(ok(&connect(5301)), "TCP to an allowed port connects");
    let o = connect(5302);
    assert!(!ok(&o), "TCP to 5302 is dropped by the kernel firewall");
    assert!(text(&o).contains("timed out"), "{}", text(&o));
    let o = h.exec(
        0,
        &format!("python3 -c \"import socket, time\ns=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('10.{n}.2.2', 9))\nfor i in range(3):\n  try:\n    s.send(b'x'); time.sleep(0.3)\n  except OSError as e:\n    print('refused:', e); break\""),
    );
    assert!(
        text(&o).contains("refused"),
        "UDP to port 9 is rejected with ICMP: {}",
        text(&o)
    );
    drop(server);
    assert!(p.counter("fw", "dropped") >= 1);
    assert!(p.counter("fw", "rejected") >= 1);
    assert!(p.counter("fw", "established") >= 2);

    // Teardown leaves the interfaces as they were and removes its own device and pins.
    let o = p.stitch(&["teardown"]);
    assert!(ok(&o), "{}", text(&o));
    let after = [interface_state(&h.outer[0]), interface_state(&h.outer[1])];
    assert_eq!(before, after);
    assert!(!sh(&format!("ip link show stl-{}", p.name)).status.success());
    assert!(!std::path::Path::new(&format!("/sys/fs/bpf/stitch/{}", p.name)).exists());
    let o = h.exec(0, &format!("ping -c 1 -W 1 10.{n}.1.1"));
    assert!(!ok(&o), "nothing answers once the data plane is gone");
    let s = p.stitch(&["status"]);
    assert!(text(&s).contains("no kernel data plane"), "{}", text(&s));
}

#[test]
fn chains_deeper_than_the_tail_call_limit_still_deliver() {
    require_root_and_tools(&["ip", "ping"]);
    let h = TwoHosts::new();
    let p = Plane::new();
    // 40 forwarders from A to B: more than the 33 tail calls the kernel allows in one go.
    let mut g = format!(
        "placement: kernel\napps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\n",
        h.outer[0], h.outer[1]
    );
    let hops = 40;
    for i in 0..hops {
        g += &format!("  f{i}: {{ type: forwarder }}\n");
    }
    g += "links:\n  - \"a.output -> f0.input\"\n";
    for i in 1..hops {
        g += &format!("  - \"f{}.output -> f{i}.input\"\n", i - 1);
    }
    g += &format!(
        "  - \"f{}.output -> b.input\"\n  - \"b.output -> a.input\"\n",
        hops - 1
    );
    p.apply(&g);
    let o = h.exec(0, &format!("ping -c 5 -i 0.1 -W 2 {}", h.ip[1]));
    assert!(ok(&o), "ping across {hops} chained functions: {}", text(&o));
    let s = p.status();
    let apps = s["apps"].as_array().unwrap();
    for i in 0..hops {
        let f = apps.iter().find(|a| a["name"] == format!("f{i}")).unwrap();
        let rx = f["counters"]["rx"].as_u64().unwrap();
        assert!(rx >= 5, "f{i} saw every ping: {f}");
        assert_eq!(f["counters"]["drops"], 0, "{f}");
    }
}

#[test]
fn kernel_graph_errors_name_the_line_and_change_nothing() {
    let p = Plane::new();
    let o = p.apply_output(
        "placement: kernel\napps:\n  g: { type: generator, size: 64 }\n  s: { type: sink }\nlinks:\n  - \"g.output -> s.input\"\n",
    );
    assert!(!ok(&o));
    let t = text(&o);
    assert!(
        t.contains(":3:") && t.contains("has no kernel version"),
        "{t}"
    );

    let o = p.apply_output(
        "apps:\n  f: { type: forwarder, placement: kernel }\n  x: { type: forwarder }\nlinks:\n  - \"f.output -> x.input\"\n",
    );
    let t = text(&o);
    assert!(
        !ok(&o) && t.contains(":3:") && t.contains("placed in user space"),
        "{t}"
    );

    let o = p.apply_output(
        "placement: kernel\napps:\n  br: { type: bridge, ports: { a: { mode: trunk, vlans: [10] }, b: {} } }\n",
    );
    let t = text(&o);
    assert!(!ok(&o) && t.contains("trunk"), "{t}");

    let o = p.apply_output(
        "placement: kernel\napps:\n  a: { type: af_packet, interface: no-such-if0 }\n  f: { type: forwarder }\nlinks:\n  - \"a.output -> f.input\"\n",
    );
    let t = text(&o);
    assert!(
        !ok(&o) && t.contains("no-such-if0") && t.contains("does not exist"),
        "{t}"
    );
    let o = p.apply_output("placement: orbit\napps: {}\n");
    let t = text(&o);
    assert!(!ok(&o) && t.contains(":1:") && t.contains("orbit"), "{t}");
    // Nothing was installed by any of these.
    let s = p.stitch(&["status"]);
    assert!(text(&s).contains("no kernel data plane"), "{}", text(&s));

    // `stitch run` places kernel apps too (tests/placement.rs); one without a kernel version
    // is refused at its line before anything starts.
    let e = run_must_fail("apps:\n  g: { type: generator, placement: kernel }\n");
    assert!(
        e.contains("g.yaml:2") && e.contains("has no kernel version"),
        "{e}"
    );
}

/// Network namespaces made for a test, removed when dropped.
struct Namespaces(Vec<String>);

impl Namespaces {
    fn add(&mut self, name: String) -> String {
        must(&format!("ip netns add {name}"));
        self.0.push(name.clone());
        name
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in self.0.iter().rev() {
            let _ = sh(&format!(
                "ip netns pids {ns} 2>/dev/null | xargs -r kill -9"
            ));
            let _ = sh(&format!("ip netns del {ns} 2>/dev/null"));
        }
    }
}

fn port_in_packets(status: &serde_json::Value, app: &str) -> u64 {
    let a = status["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == app)
        .unwrap();
    a["ports"][0]["stats"]["rx_packets"].as_u64().unwrap()
}

#[test]
fn vxlan_transport_keeps_tenants_with_the_same_addresses_apart() {
    require_root_and_tools(&["ip", "ping", "nsenter"]);
    let tag = format!("{}", std::process::id() % 10000);
    let mut ns = Namespaces(Vec::new());
    // Two hosts joined by an underlay veth; on each, tenant 1 and tenant 2 have a workload
    // with the same address (10.77.0.1 on host A, 10.77.0.2 on host B), told apart by MAC.
    let hosts = [ns.add(format!("vx{tag}A")), ns.add(format!("vx{tag}B"))];
    let underlay = ["192.168.77.1", "192.168.77.2"];
    must(&format!(
        "ip link add u{tag}A netns {} type veth peer name u{tag}B netns {}",
        hosts[0], hosts[1]
    ));
    for (i, h) in hosts.iter().enumerate() {
        let side = ["A", "B"][i];
        must(&format!(
            "ip -n {h} addr add {}/24 dev u{tag}{side}",
            underlay[i]
        ));
        // Room for the 50 bytes of VXLAN around a full-size frame.
        must(&format!("ip -n {h} link set u{tag}{side} mtu 1600 up"));
        must(&format!("ip -n {h} link set lo up"));
        for t in 1..=2 {
            let w = ns.add(format!("vx{tag}{side}{t}"));
            let hostside = format!("w{tag}{side}{t}");
            must(&format!(
                "ip link add {hostside} type veth peer name eth0 netns {w}"
            ));
            must(&format!("ip link set {hostside} netns {h}"));
            must(&format!("ip -n {h} link set {hostside} up"));
            must(&format!(
                "ip -n {w} link set eth0 address 02:00:00:00:0{t}:0{i}"
            ));
            // No IPv6 chatter: every frame a workload gets comes from the test's pings.
            must(&format!(
                "ip netns exec {w} sysctl -qw net.ipv6.conf.eth0.disable_ipv6=1"
            ));
            must(&format!("ip -n {w} addr add 10.77.0.{}/24 dev eth0", i + 1));
            must(&format!("ip -n {w} link set eth0 up"));
        }
    }
    let graph = |side: &str, local: &str, remote: &str, tenants: &[u32]| {
        let mut g = format!(
            "placement: kernel\napps:\n  w1: {{ type: af_packet, interface: w{tag}{side}1 }}\n  w2: {{ type: af_packet, interface: w{tag}{side}2 }}\n  vtep: {{ type: vxlan, local: {local}, local_mac: \"02:00:00:00:00:01\", next_hop_mac: \"02:00:00:00:00:02\", segments: {{ "
        );
        let segs: Vec<String> = tenants
            .iter()
            .map(|t| format!("t{t}: {{ vni: {}, remote: {remote} }}", 5000 + t))
            .collect();
        g += &segs.join(", ");
        g += " } }\nlinks:\n";
        for t in tenants {
            g += &format!("  - \"w{t}.output -> vtep.t{t}\"\n  - \"vtep.t{t} -> w{t}.input\"\n");
        }
        g
    };
    let a = Plane::in_netns(&hosts[0]);
    let b = Plane::in_netns(&hosts[1]);
    a.apply(&graph("A", underlay[0], underlay[1], &[1, 2]));
    b.apply(&graph("B", underlay[1], underlay[0], &[1, 2]));

    let tenant2_before = port_in_packets(&b.status(), "w2");
    let ping = |t: u32| {
        sh(&format!(
            "ip netns exec vx{tag}A{t} ping -c 3 -i 0.2 -W 2 10.77.0.2"
        ))
    };
    let o = ping(1);
    assert!(ok(&o), "tenant 1 crosses the tunnel: {}", text(&o));
    let neigh = must(&format!("ip -n vx{tag}A1 neigh show 10.77.0.2"));
    assert!(
        neigh.contains("02:00:00:00:01:01"),
        "tenant 1's B answered: {neigh}"
    );
    let s = b.status();
    assert!(port_in_packets(&s, "w1") >= 3, "{s}");
    assert_eq!(
        port_in_packets(&s, "w2"),
        tenant2_before,
        "nothing of tenant 1 reached tenant 2: {s}"
    );

    let o = ping(2);
    assert!(ok(&o), "tenant 2 crosses the tunnel: {}", text(&o));
    let neigh = must(&format!("ip -n vx{tag}A2 neigh show 10.77.0.2"));
    assert!(
        neigh.contains("02:00:00:00:02:01"),
        "tenant 2's B answered: {neigh}"
    );

    // Host B drops tenant 2's segment, live: its frames are refused by VNI, tenant 1 goes on.
    b.apply(&graph("B", underlay[1], underlay[0], &[1]));
    let o = sh(&format!(
        "ip netns exec vx{tag}A2 ping -c 2 -i 0.2 -W 1 10.77.0.2"
    ));
    assert!(!ok(&o), "tenant 2 has no segment on B any more");
    let s = b.status();
    assert!(s["data_plane"]["unknown_vni"].as_u64().unwrap() >= 1, "{s}");
    assert!(ok(&ping(1)), "tenant 1 unaffected");
}

#[test]
fn an_interface_hooked_by_another_program_is_refused() {
    require_root_and_tools(&["ip"]);
    let h = TwoHosts::new();
    let graph = format!(
        "placement: kernel\napps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\nlinks:\n  - \"a.output -> b.input\"\n  - \"b.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    );
    let first = Plane::new();
    first.apply(&graph);
    // Another data plane (any other TCX program would do) may not take the same hook.
    let second = Plane::new();
    let o = second.apply_output(&graph);
    let t = text(&o);
    assert!(!ok(&o), "{t}");
    assert!(
        t.contains(&h.outer[0]) && t.contains("already has 1 program"),
        "{t}"
    );
    // The first one still forwards.
    let o = h.exec(0, &format!("ping -c 2 -i 0.1 -W 2 {}", h.ip[1]));
    assert!(ok(&o), "{}", text(&o));
}

/// Captures running against the kernel data plane `p`: taps per port as `status` shows them.
fn kernel_taps(p: &Plane) -> u64 {
    p.status()["apps"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|a| a["ports"].as_array().unwrap().clone())
        .map(|port| port["taps"].as_u64().unwrap())
        .sum()
}

fn kernel_capture(p: &Plane, args: &[&str]) -> std::process::Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_stitch"));
    c.args(["capture", "--kernel", &p.name]).args(args);
    c
}

#[test]
fn links_between_kernel_functions_are_captured_in_the_kernel() {
    require_root_and_tools(&["ip", "ping", "tshark", "capinfos"]);
    use std::process::Stdio;
    let h = TwoHosts::new();
    let p = Plane::new();
    let graph = |back: &str| {
        format!(
            "placement: kernel\napps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\n  f: {{ type: forwarder }}\n{}links:\n  - \"a.output -> f.input\"\n  - \"f.output -> b.input\"\n{back}",
            h.outer[0],
            h.outer[1],
            if back.contains("g.") { "  g: { type: forwarder }\n" } else { "" },
        )
    };
    let with_g = graph("  - \"b.output -> g.input\"\n  - \"g.output -> a.input\"\n");
    p.apply(&with_g);
    bad_kernel_captures_name_what_to_fix(&p);
    two_kernel_captures_at_once(&h, &p);
    a_killed_readers_tap_is_cleared(&p);
    // The tapped link leaves the installed graph: the capture ends by itself.
    let gone = Background(
        kernel_capture(&p, &["--link", "g", "--duration", "20", "-w"])
            .arg(p.dir.path().join("gone.pcapng"))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_until("the capture to tap", 10, || kernel_taps(&p) == 2);
    p.apply(&graph("  - \"b.output -> a.input\"\n"));
    let t = std::time::Instant::now();
    let out = gone.finish();
    assert!(t.elapsed().as_secs() < 10, "ended well before its duration");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("left the installed graph"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let o = h.exec(0, &format!("ping -c 1 -W 2 {}", h.ip[1]));
    assert!(ok(&o), "{}", text(&o));
}

/// Errors name what to fix and tap nothing.
fn bad_kernel_captures_name_what_to_fix(p: &Plane) {
    for (args, says) in [
        (
            vec!["--link", "nope", "-w", "-"],
            "its links: a.output -> f.input",
        ),
        (vec!["--link", "f", "-w", "-", "tcp port"], "filter"),
    ] {
        let o = kernel_capture(p, &args).output().unwrap();
        assert!(!o.status.success());
        assert!(text(&o).contains(says), "{args:?}: {}", text(&o));
    }
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["capture", "--kernel", "nosuchdp", "--link", "f", "-w", "-"])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("stitch kernel apply"),
        "{}",
        text(&o)
    );
    assert_eq!(kernel_taps(p), 0);
}

/// Two captures at once: both directions of f to a file, and one link, filtered, to a pipe.
fn two_kernel_captures_at_once(h: &TwoHosts, p: &Plane) {
    use std::process::Stdio;
    let file = p.dir.path().join("f.pcapng");
    let both = Background(
        kernel_capture(p, &["--link", "f", "--duration", "30", "-w"])
            .arg(&file)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let piped = Background(
        kernel_capture(
            p,
            &[
                "--link",
                "g.output -> a.input",
                "-c",
                "3",
                "--duration",
                "20",
                "-w",
                "-",
            ],
        )
        .arg("icmp[icmptype] == icmp-echoreply")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    wait_until("both captures to tap", 10, || kernel_taps(p) == 3);
    let o = h.exec(0, &format!("ping -c 4 -i 0.2 -W 2 {}", h.ip[1]));
    assert!(ok(&o), "{}", text(&o));
    // Ctrl-C ends the unbounded one cleanly.
    std::thread::sleep(std::time::Duration::from_millis(100));
    both.signal(libc::SIGINT);
    let out = both.finish();
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{said}");
    both_directions_of_f_are_in_one_file(&file, &said);
    let out = piped.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let piped_file = p.dir.path().join("g.pcapng");
    std::fs::write(&piped_file, &out.stdout).unwrap();
    let frames = tshark_fields(&piped_file, &["frame.interface_name", "icmp.type"]);
    assert_eq!(
        frames,
        vec!["g.output -> a.input\t0".to_string(); 3],
        "only echo replies, only that link"
    );
    assert_eq!(kernel_taps(p), 0, "the captures took their taps along");
}

/// Every echo request on both of f's links, each with its direction, and the count the
/// capture said it took.
fn both_directions_of_f_are_in_one_file(file: &std::path::Path, said: &str) {
    let frames = tshark_fields(
        file,
        &[
            "frame.interface_name",
            "frame.packet_flags_direction",
            "icmp.type",
        ],
    );
    assert!(
        said.contains(&format!("{} packets captured", frames.len())),
        "{said}"
    );
    for f in &frames {
        let cols: Vec<&str> = f.split('\t').collect();
        match cols[0] {
            "a.output -> f.input" => assert_eq!(cols[1], "0x00000001", "{f}"),
            "f.output -> b.input" => assert_eq!(cols[1], "0x00000002", "{f}"),
            other => panic!("a link of f was expected, not {other}"),
        }
    }
    for link in ["a.output -> f.input", "f.output -> b.input"] {
        let requests = frames
            .iter()
            .filter(|f| f.starts_with(link) && f.ends_with("\t8"))
            .count();
        assert_eq!(requests, 4, "every echo request on {link}: {frames:?}");
    }
    let info = must(&format!("capinfos -M {}", file.display()));
    assert_eq!(
        info.matches("Number of stat entries = 1").count(),
        2,
        "{info}"
    );
}

/// A reader killed outright: the next look at the data plane clears what it left.
fn a_killed_readers_tap_is_cleared(p: &Plane) {
    use std::process::Stdio;
    let mut killed = Background(
        kernel_capture(p, &["--link", "f.output", "-w", "-"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("the capture to tap", 10, || kernel_taps(p) == 1);
    killed.signal(libc::SIGKILL);
    let _ = killed.0.wait();
    assert_eq!(kernel_taps(p), 0, "a dead reader's tap is cleared");
}

#[test]
fn wireshark_lists_kernel_links_through_the_extcap_and_captures_them() {
    require_root_and_tools(&["ip", "ping", "tshark"]);
    let _installed = install_extcap();
    let h = TwoHosts::new();
    let p = Plane::new();
    p.apply(&format!(
        "placement: kernel\napps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\n  f: {{ type: forwarder }}\nlinks:\n  - \"a.output -> f.input\"\n  - \"f.output -> b.input\"\n  - \"b.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    ));
    let interface = format!("stitch-kernel:{}:f.output>b.input", p.name);
    let listed = must("tshark -D 2>/dev/null");
    assert!(listed.contains(&interface), "{listed}");
    assert!(listed.contains(&format!("stitch-kernel:{}:b.output>a.input", p.name)));

    let _pings = h.spawn(0, &format!("ping -i 0.1 -c 100 {}", h.ip[1]));
    let file = p.dir.path().join("ext.pcapng");
    let o = sh(&format!(
        "timeout 30 tshark -i '{interface}' -f icmp -c 5 -w {} 2>&1",
        file.display()
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let frames = tshark_fields(&file, &["frame.interface_name", "icmp.type"]);
    assert_eq!(frames, vec![format!("{}\t8", "f.output -> b.input"); 5]);
    let o = sh(&format!(
        "timeout 30 tshark -i '{interface}' -c 5 -f 'udp and and' 2>&1"
    ));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("can't parse filter expression"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}
