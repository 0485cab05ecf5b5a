//! Network functions, PCAP out, decoded by tshark: fields checked, not only bytes.

mod common;
use common::*;

#[test]
fn vlan_push_translate_pop_as_tshark_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let stats = run_graph(dir.path(),
        "apps:\n  gen: { type: generator, count: 100, flows: 5 }\n  plain: { type: capture, file: plain.pcap }\n  push: { type: vlan, mode: push, vid: 10, pcp: 5 }\n  a: { type: capture, file: a.pcap }\n  xlate: { type: vlan, mode: translate, map: { 10: 20 } }\n  b: { type: capture, file: b.pcap }\n  pop: { type: vlan, mode: pop }\n  c: { type: pcap_sink, file: c.pcap }\nlinks:\n  - \"gen.output -> plain.input\"\n  - \"plain.output -> push.input\"\n  - \"push.output -> a.input\"\n  - \"a.output -> xlate.input\"\n  - \"xlate.output -> b.input\"\n  - \"b.output -> pop.input\"\n  - \"pop.output -> c.input\"\n", &[]);
    assert_eq!(app(&stats, "c")["counters"]["written"], 100);
    let a = tshark_fields(
        &dir.path().join("a.pcap"),
        &["vlan.id", "vlan.priority", "ip.src", "udp.dstport"],
    );
    assert_eq!(a.len(), 100);
    assert!(
        a.iter()
            .all(|l| l.starts_with("10\t5\t10.0.0.") && l.ends_with("\t1234")),
        "{:?}",
        &a[..3]
    );
    let b = tshark_fields(&dir.path().join("b.pcap"), &["vlan.id", "vlan.priority"]);
    assert!(b.iter().all(|l| l == "20\t5"), "{:?}", &b[..3]);
    let c = tshark_fields(
        &dir.path().join("c.pcap"),
        &["vlan.id", "ip.src", "udp.srcport", "udp.checksum.status"],
    );
    let plain = tshark_fields(
        &dir.path().join("plain.pcap"),
        &["vlan.id", "ip.src", "udp.srcport", "udp.checksum.status"],
    );
    assert_eq!(c, plain, "pop restores the frames as generated");
}

#[test]
fn load_balancer_keeps_each_flow_on_one_output() {
    let dir = tempfile::tempdir().unwrap();
    run_graph(dir.path(),
        "apps:\n  gen: { type: generator, count: 4000, flows: 40 }\n  lb: { type: load_balancer }\n  o0: { type: pcap_sink, file: o0.pcap }\n  o1: { type: pcap_sink, file: o1.pcap }\n  o2: { type: pcap_sink, file: o2.pcap }\nlinks:\n  - \"gen.output -> lb.input\"\n  - \"lb.x -> o0.input\"\n  - \"lb.y -> o1.input\"\n  - \"lb.z -> o2.input\"\n", &[]);
    let mut seen = std::collections::HashMap::new();
    let mut total = 0;
    for i in 0..3 {
        let srcs = tshark_fields(&dir.path().join(format!("o{i}.pcap")), &["ip.src"]);
        assert!(!srcs.is_empty(), "output {i} got traffic");
        total += srcs.len();
        for s in srcs {
            assert_eq!(
                *seen.entry(s.clone()).or_insert(i),
                i,
                "flow {s} on two outputs"
            );
        }
    }
    assert_eq!((total, seen.len()), (4000, 40));
}

#[test]
fn bridge_tags_frames_toward_a_trunk() {
    let dir = tempfile::tempdir().unwrap();
    // Broadcasts from an access port of VLAN 10 reach the trunk tagged, the VLAN-1 port not at all.
    let stats = run_graph(dir.path(),
        "apps:\n  gen: { type: generator, count: 50, dst_mac: \"ff:ff:ff:ff:ff:ff\" }\n  br: { type: bridge, ports: { a: { vlan: 10 }, b: {}, t: { mode: trunk, vlans: [10] } } }\n  tb: { type: pcap_sink, file: b.pcap }\n  tt: { type: pcap_sink, file: t.pcap }\nlinks:\n  - \"gen.output -> br.a\"\n  - \"br.b -> tb.input\"\n  - \"br.t -> tt.input\"\n", &[]);
    assert_eq!(app(&stats, "tb")["counters"]["written"], 0);
    let t = tshark_fields(
        &dir.path().join("t.pcap"),
        &["vlan.id", "eth.dst", "ip.dst"],
    );
    assert_eq!(t.len(), 50);
    assert!(
        t.iter().all(|l| l == "10\tff:ff:ff:ff:ff:ff\t10.1.0.1"),
        "{:?}",
        &t[..2]
    );
    assert_eq!(app(&stats, "br")["counters"]["learned"], 1);
}

const CONNECT: &str = r#"
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except ConnectionRefusedError:
    print("refused")
except socket.timeout:
    print("timeout")
"#;

#[test]
fn firewall_between_namespaces_lets_lan_out_and_keeps_wan_out() {
    require_root_and_tools(&["ip", "ping", "iperf3", "python3"]);
    let h = TwoHosts::new();
    let s = Stitch::run(&format!(
        "apps:\n  lan: {{ type: af_packet, interface: {} }}\n  wan: {{ type: af_packet, interface: {} }}\n  fw: {{ type: firewall, default: drop, rules: [ {{ action: accept, from: lan }}, {{ action: reject, from: wan, proto: tcp, dst_port: 5201 }} ] }}\nlinks:\n  - \"lan.output -> fw.lan\"\n  - \"fw.lan -> lan.input\"\n  - \"wan.output -> fw.wan\"\n  - \"fw.wan -> wan.input\"\n",
        h.outer[0], h.outer[1]
    ));
    std::fs::write(s.path().join("connect.py"), CONNECT).unwrap();
    let connect = |from: usize, ip: &str, port: u16| {
        let o = h.exec(
            from,
            &format!(
                "python3 {} {ip} {port} 1.5",
                s.path().join("connect.py").display()
            ),
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    // Out from the lan side: ping and TCP work, replies come back by connection state.
    let o = h.exec(0, &format!("ping -c 3 -i 0.1 -W 2 {}", h.ip[1]));
    assert!(
        o.status.success(),
        "lan → wan ping: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    h.iperf_tcp(&h.ip[1], 1);
    // IPv6 too: Neighbor Discovery passes, echo state works the same way.
    let o = h.exec(0, &format!("ping -6 -c 3 -i 0.1 -W 2 {}", h.ip6[1]));
    assert!(
        o.status.success(),
        "lan → wan ping -6: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(1, &format!("ping -6 -c 2 -i 0.2 -W 1 {}", h.ip6[0]));
    assert!(!o.status.success(), "wan → lan ping -6 must not pass");
    // In from the wan side: ping dropped, TCP 5201 rejected at once, TCP 22 silently dropped.
    let o = h.exec(1, &format!("ping -c 2 -i 0.2 -W 1 {}", h.ip[0]));
    assert!(!o.status.success(), "wan → lan ping must not pass");
    assert_eq!(
        connect(1, &h.ip[0], 5201),
        "refused",
        "reject rule answers with a RST"
    );
    assert_eq!(
        connect(1, &h.ip[0], 22),
        "timeout",
        "default drop answers nothing"
    );
    let stats = s.stop();
    let c = &app(&stats, "fw")["counters"];
    assert!(
        c["rejected"].as_u64().unwrap() >= 1 && c["rule_drops"].as_u64().unwrap() >= 2,
        "{c}"
    );
    assert!(c["established_passed"].as_u64().unwrap() > 100, "{c}");
    assert_eq!(c["rule2_hits"], c["rejected"]);
}

#[test]
fn bridge_router_bridge_joins_two_subnets() {
    require_root_and_tools(&["ip", "ping", "iperf3"]);
    let h = TwoHosts::new();
    // Two subnets: host A 10.N.1.2/24 and host B 10.N.2.2/24, the router .1 on each.
    let n = 200 + (std::process::id() % 50);
    h.two_subnets(n);
    for (i, net) in [(0, 1), (1, 2)] {
        must(&format!(
            "ip -n {} addr add fd{n:x}:{net}::2/64 dev {} nodad",
            h.ns[i], h.inner[i]
        ));
        must(&format!(
            "ip -n {} -6 route add default via fd{n:x}:{net}::1",
            h.ns[i]
        ));
    }
    let s = Stitch::run(&format!(
        "apps:\n  a: {{ type: af_packet, interface: {a} }}\n  b: {{ type: af_packet, interface: {b} }}\n  bra: {{ type: bridge, ports: {{ host: {{}}, rtr: {{}} }} }}\n  brb: {{ type: bridge, ports: {{ host: {{}}, rtr: {{}} }} }}\n  r: {{ type: router, interfaces: {{ left: {{ mac: \"02:00:00:00:01:01\", address: \"10.{n}.1.1/24\", address6: \"fd{n:x}:1::1/64\" }}, right: {{ mac: \"02:00:00:00:02:01\", address: \"10.{n}.2.1/24\", address6: \"fd{n:x}:2::1/64\" }} }} }}\nlinks:\n  - \"a.output -> bra.host\"\n  - \"bra.host -> a.input\"\n  - \"bra.rtr -> r.left\"\n  - \"r.left -> bra.rtr\"\n  - \"r.right -> brb.rtr\"\n  - \"brb.rtr -> r.right\"\n  - \"brb.host -> b.input\"\n  - \"b.output -> brb.host\"\n",
        a = h.outer[0],
        b = h.outer[1]
    ));
    let o = h.exec(0, &format!("ping -c 3 -i 0.1 -W 2 10.{n}.1.1"));
    assert!(
        o.status.success(),
        "the router answers for itself: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(0, &format!("ping -c 3 -i 0.1 -W 2 10.{n}.2.2"));
    assert!(
        o.status.success(),
        "A reaches B across the router: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(0, &format!("ping -6 -c 3 -i 0.1 -W 2 fd{n:x}:1::1"));
    assert!(
        o.status.success(),
        "the router answers for itself over IPv6: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(0, &format!("ping -6 -c 3 -i 0.1 -W 2 fd{n:x}:2::2"));
    assert!(
        o.status.success(),
        "A reaches B over IPv6 (NDP both sides): {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(0, &format!("ping -6 -c 1 -t 1 -W 2 fd{n:x}:2::2"));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("Time exceeded") && text.contains(&format!("fd{n:x}:1::1")),
        "hop limit 1 is answered: {text}"
    );
    let o = h.exec(0, &format!("ping -c 1 -t 1 -W 2 10.{n}.2.2"));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("Time to live exceeded") && text.contains(&format!("10.{n}.1.1")),
        "TTL 1 is answered: {text}"
    );
    let o = h.exec(0, &format!("ping -c 1 -W 2 10.{}.9.9", n + 1));
    assert!(!o.status.success());
    let bps = h.iperf_tcp(&format!("10.{n}.2.2"), 2);
    eprintln!("bridge-router-bridge: iperf3 TCP {:.2} Gbit/s", bps / 1e9);
    let shown = must(&format!(
        "{} show r --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["route_count"], 2, "{shown}");
    let resolved = shown["neighbors"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["ip"] == format!("10.{n}.2.2") && x["mac"].is_string());
    assert!(resolved, "B is a resolved neighbour: {shown}");
    let stats = s.stop();
    let c = &app(&stats, "r")["counters"];
    assert!(
        c["forwarded"].as_u64().unwrap() > 100
            && c["arp_replies"].as_u64().unwrap() >= 1
            && c["arp_requests"].as_u64().unwrap() >= 1,
        "{c}"
    );
    assert!(
        c["icmp_errors_sent"].as_u64().unwrap() >= 2
            && c["ttl_exceeded_drops"].as_u64().unwrap() >= 1,
        "{c}"
    );
}

const ECHO_PEER: &str = r#"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 5353))
print("ready", flush=True)
s.settimeout(20)
data, peer = s.recvfrom(2048)
s.sendto(data, peer)
print(peer[0])
"#;

const ASK: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
s.sendto(b"hello", (sys.argv[1], 5353))
print(s.recvfrom(2048)[0].decode())
"#;

/// An outside peer that answers later: it writes who wrote to it, then waits for `go` (a
/// file) and sends to that endpoint.
const LATE_PEER: &str = r#"
import os, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 5354))
print("ready", flush=True)
s.settimeout(20)
data, peer = s.recvfrom(2048)
open(sys.argv[1] + ".tmp", "w").write("%s:%d" % peer)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
s.sendto(b"after the restart", peer)
"#;

/// An inside client that writes once, then waits for an answer.
const WAITING_CLIENT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 40000))
s.sendto(b"hello", (sys.argv[1], 5354))
s.settimeout(30)
print(s.recvfrom(2048)[0].decode(), flush=True)
"#;

/// `stitch run --state`: Stitch killed -9 mid-session and started again with its state file
/// delivers an outside peer's packet on the mapping the old process made — a fresh NAT drops it
/// (no mapping: endpoint-independent filtering allows only mapped ports in). A state file of
/// another format is refused with the reason.
#[test]
fn nat_mappings_survive_a_kill_9_through_the_state_file() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let external = format!("{}51", &h.ip[0][..h.ip[0].len() - 1]);
    let graph = format!(
        "apps:\n  lan: {{ type: af_packet, interface: {} }}\n  wan: {{ type: af_packet, interface: {} }}\n  nat: {{ type: nat, external: \"{external}\", ports: \"20000-29999\" }}\nlinks:\n  - \"lan.output -> nat.lan\"\n  - \"nat.lan -> lan.input\"\n  - \"wan.output -> nat.wan\"\n  - \"nat.wan -> wan.input\"\n",
        h.outer[0], h.outer[1]
    );
    let dir = tempfile::tempdir().unwrap();
    let (state, seen, go) = (
        dir.path().join("stitch.state"),
        dir.path().join("seen"),
        dir.path().join("go"),
    );
    let state_args = [
        "--state",
        state.to_str().unwrap(),
        "--state-interval",
        "0.2",
    ];
    let first = Stitch::run_with(&graph, &state_args);
    std::fs::write(dir.path().join("peer.py"), LATE_PEER).unwrap();
    std::fs::write(dir.path().join("client.py"), WAITING_CLIENT).unwrap();
    let py = |f: &str| dir.path().join(f).display().to_string();
    let peer = h.spawn_ready(
        1,
        &format!(
            "python3 {} {} {}",
            py("peer.py"),
            seen.display(),
            go.display()
        ),
    );
    let client = h.spawn(0, &format!("python3 {} {}", py("client.py"), h.ip[1]));
    wait_until("the peer to hear from the client", 10, || seen.exists());
    let outside = std::fs::read_to_string(&seen).unwrap();
    assert!(outside.starts_with(&external), "{outside}");
    // A snapshot taken after the mapping was made, then the kill.
    std::thread::sleep(std::time::Duration::from_millis(600));
    first.process.signal(libc::SIGKILL);
    drop(first);
    let second = Stitch::run_with(&graph, &state_args);
    std::fs::write(&go, "").unwrap();
    let _ = peer.finish();
    let got = client.finish();
    assert_eq!(
        String::from_utf8_lossy(&got.stdout).trim(),
        "after the restart",
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    // The instance says what came back from the file.
    let (_, status) = second.call("GET", "/api/v1/status", None);
    assert_eq!(
        status["state"]["restored"],
        serde_json::json!(["nat"]),
        "{status}"
    );
    wait_until("a snapshot by the new instance", 5, || {
        second.call("GET", "/api/v1/status", None).1["state"]["saves"].as_u64() >= Some(1)
    });
    let stats = second.stop();
    let c = &app(&stats, "nat")["counters"];
    assert_eq!(c["no_mapping_drops"], 0, "{c}");
    assert!(c["translated_in"].as_u64().unwrap() >= 1, "{c}");
    // Another format: refused whole, with the reason, and nothing starts.
    std::fs::write(&state, r#"{"stitch_state_format": 99, "apps": {}}"#).unwrap();
    let err = run_must_fail_with(&graph, &state_args);
    assert!(
        err.contains("format 99") && err.contains("reads format 1"),
        "{err}"
    );
}

#[test]
fn nat_masquerades_lan_hosts_behind_the_external_address() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    // One segment, NAT in the middle: host B asks for the external address in ARP and the
    // NAT answers.
    let external = format!("{}50", &h.ip[0][..h.ip[0].len() - 1]);
    let s = Stitch::run(&format!(
        "apps:\n  lan: {{ type: af_packet, interface: {} }}\n  wan: {{ type: af_packet, interface: {} }}\n  nat: {{ type: nat, external: \"{external}\", ports: \"20000-29999\" }}\nlinks:\n  - \"lan.output -> nat.lan\"\n  - \"nat.lan -> lan.input\"\n  - \"wan.output -> nat.wan\"\n  - \"nat.wan -> wan.input\"\n",
        h.outer[0], h.outer[1]
    ));
    std::fs::write(s.path().join("peer.py"), ECHO_PEER).unwrap();
    std::fs::write(s.path().join("ask.py"), ASK).unwrap();
    let peer = h.spawn_ready(
        1,
        &format!("python3 {}", s.path().join("peer.py").display()),
    );
    let o = h.exec(
        0,
        &format!("python3 {} {}", s.path().join("ask.py").display(), h.ip[1]),
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "hello",
        "the answer comes back through the NAT: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let seen = peer.finish();
    assert_eq!(seen.trim(), external, "B saw the external address, not A's");
    let shown = must(&format!(
        "{} show nat --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    assert!(
        shown["mappings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["inside"].as_str().unwrap().starts_with(&h.ip[0])),
        "{shown}"
    );
    let stats = s.stop();
    let c = &app(&stats, "nat")["counters"];
    assert!(
        c["translated_out"].as_u64().unwrap() >= 1
            && c["translated_in"].as_u64().unwrap() >= 1
            && c["arp_answered"].as_u64().unwrap() >= 1,
        "{c}"
    );
}

#[test]
fn vxlan_encapsulates_as_tshark_decodes_it_and_decapsulates_back() {
    let dir = tempfile::tempdir().unwrap();
    // gen → vtep1 segment t1 → underlay (captured) → vtep2 underlay → segment t1 → sink
    let stats = run_graph(dir.path(),
        "apps:\n  gen: { type: generator, count: 200, flows: 8 }\n  before: { type: capture, file: before.pcap }\n  v1: { type: vxlan, local: 192.0.2.1, local_mac: \"02:00:00:00:00:01\", next_hop_mac: \"02:00:00:00:00:02\", segments: { t1: { vni: 5001, remote: 192.0.2.2 } } }\n  wire: { type: capture, file: underlay.pcap }\n  v2: { type: vxlan, local: 192.0.2.2, local_mac: \"02:00:00:00:00:02\", next_hop_mac: \"02:00:00:00:00:01\", segments: { t1: { vni: 5001, remote: 192.0.2.1 } } }\n  after: { type: pcap_sink, file: after.pcap }\nlinks:\n  - \"gen.output -> before.input\"\n  - \"before.output -> v1.t1\"\n  - \"v1.underlay -> wire.input\"\n  - \"wire.output -> v2.underlay\"\n  - \"v2.t1 -> after.input\"\n", &[]);
    assert_eq!(app(&stats, "v2")["counters"]["decapsulated"], 200);
    let outer = tshark_fields(
        &dir.path().join("underlay.pcap"),
        &["udp.dstport", "vxlan.vni"],
    );
    assert_eq!(outer.len(), 200);
    assert!(
        outer
            .iter()
            .all(|l| l.starts_with("4789") && l.ends_with("\t5001")),
        "{:?}",
        &outer[..2]
    );
    // tshark decodes the inner frame too: ip.src lists the outer, then the inner address.
    let ips = tshark_fields(&dir.path().join("underlay.pcap"), &["ip.src", "ip.dst"]);
    assert!(
        ips.iter()
            .all(|l| l.starts_with("192.0.2.1,10.0.0.") && l.contains("192.0.2.2,10.1.0.1")),
        "{:?}",
        &ips[..2]
    );
    let (a, b) = (
        dir.path().join("before.pcap"),
        dir.path().join("after.pcap"),
    );
    assert_eq!(
        tshark_fields(&a, &["eth.src", "ip.src", "udp.srcport", "frame.len"]),
        tshark_fields(&b, &["eth.src", "ip.src", "udp.srcport", "frame.len"])
    );
}

#[test]
fn show_dumps_an_apps_tables_from_a_running_instance() {
    let s = Stitch::run(
        "apps:\n  gen: { type: generator, rate: 1000, src_mac: \"02:00:00:00:00:0a\", dst_mac: \"ff:ff:ff:ff:ff:ff\" }\n  br: { type: bridge, ports: { a: {}, b: { vlan: 1 } } }\n  out: { type: sink }\nlinks:\n  - \"gen.output -> br.a\"\n  - \"br.b -> out.input\"\n",
    );
    let show = |app: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["show", app, "--control"])
            .arg(&s.socket)
            .output()
            .unwrap()
    };
    let mut answer = serde_json::Value::Null;
    for _ in 0..50 {
        let o = show("br");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        answer = serde_json::from_slice(&o.stdout).unwrap();
        if answer["count"] == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(answer["entries"][0]["mac"], "02:00:00:00:00:0a", "{answer}");
    assert_eq!(answer["entries"][0]["port"], "a");
    assert_eq!(answer["entries"][0]["vlan"], 1);
    let o = show("nosuch");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no app named `nosuch`"));
    // An app without tables says so.
    let o = show("out");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("app `out` (sink) has no tables"));
    s.stop();
}

/// Stitch's `vxlan` and a Linux VXLAN device, one on each end of a veth underlay: host A's frames
/// cross Stitch's VTEP to the Linux VTEP in host B and back. The segment has a second remote that
/// does not exist, so Stitch floods until it has learned where B's device sits.
fn vxlan_talks_to_linux_over(family: u8) {
    require_root_and_tools(&["ip", "ping", "iperf3"]);
    let h = TwoHosts::new();
    let (local, remote, absent) = if family == 4 {
        ("192.0.2.1", "192.0.2.2", "192.0.2.9")
    } else {
        ("2001:db8:77::1", "2001:db8:77::2", "2001:db8:77::9")
    };
    let stitch_mac = "02:00:00:00:77:01";
    let (inner_mtu, mac_b) = linux_vtep_in_host_b(&h, family, (local, remote), stitch_mac);
    let tenant_b = h.ip[1].clone();
    let s = Stitch::run(&format!(
        "apps:\n  tenant: {{ type: af_packet, interface: {} }}\n  wire: {{ type: af_packet, interface: {} }}\n  vtep: {{ type: vxlan, local: \"{local}\", local_mac: \"{stitch_mac}\", next_hop_mac: \"{mac_b}\", segments: {{ t: {{ vni: 4242, remote: [\"{remote}\", \"{absent}\"] }} }} }}\nlinks:\n  - \"tenant.output -> vtep.t\"\n  - \"vtep.t -> tenant.input\"\n  - \"wire.output -> vtep.underlay\"\n  - \"vtep.underlay -> wire.input\"\n",
        h.outer[0], h.outer[1]
    ));
    let ping = h.exec(0, &format!("ping -c 3 -i 0.2 -W 2 {tenant_b}"));
    assert!(
        ping.status.success(),
        "ping across the tunnel: {}",
        String::from_utf8_lossy(&ping.stdout)
    );
    path_mtu_is_learnt_through_the_tunnel(&h, &s, inner_mtu);
    stitch_learns_where_linux_vtep_is(&h, &s, remote);
    tcp_crosses_the_tunnel_both_ways(&h, family);
    let stats = s.stop();
    let c = &app(&stats, "vtep")["counters"];
    assert_eq!(c["bad_checksum_drops"], 0, "{c}");
    assert_eq!(c["foreign_vtep_drops"], 0, "{c}");
    assert!(c["decapsulated"].as_u64().unwrap() > 100, "{c}");
}

fn vtep_counter(s: &Stitch, name: &str) -> u64 {
    app(&s.stats().unwrap(), "vtep")["counters"][name]
        .as_u64()
        .unwrap()
}

/// Host B: its eth0 becomes the underlay (`remote`, with Stitch's MAC for `local`) and its
/// tenant address moves to a Linux VXLAN device; returns the device's MTU and eth0's MAC.
fn linux_vtep_in_host_b(
    h: &TwoHosts,
    family: u8,
    (local, remote): (&str, &str),
    stitch_mac: &str,
) -> (usize, String) {
    let prefix = if family == 4 { 24 } else { 64 };
    let (b, eth) = (&h.ns[1], &h.inner[1]);
    let tenant_b = &h.ip[1];
    must(&format!("ip -n {b} addr flush dev {eth}"));
    must(&format!(
        "ip -n {b} addr add {remote}/{prefix} dev {eth} nodad"
    ));
    must(&format!(
        "ip -n {b} neigh add {local} lladdr {stitch_mac} dev {eth}"
    ));
    must(&format!(
        "ip -n {b} link add vx0 type vxlan id 4242 local {remote} remote {local} dstport 4789 dev {eth}"
    ));
    // Linux's tunnel MTU on host B (its own overhead, 50 or 70 bytes); host A keeps 1500
    // and learns the tunnel's MTU from Stitch's "fragmentation needed".
    let inner_mtu = if family == 4 { 1450 } else { 1430 };
    must(&format!("ip -n {b} link set vx0 mtu {inner_mtu}"));
    must(&format!("ip -n {b} addr add {tenant_b}/24 dev vx0"));
    must(&format!("ip -n {b} link set vx0 up"));
    let mac_b = must(&format!("ip -n {b} -br link show {eth}"));
    (
        inner_mtu,
        mac_b.split_whitespace().nth(2).unwrap().to_string(),
    )
}

/// Path MTU discovery through the tunnel: a DF ping one byte over is answered with the
/// tunnel's MTU, and host A's stack takes it.
fn path_mtu_is_learnt_through_the_tunnel(h: &TwoHosts, s: &Stitch, inner_mtu: usize) {
    let tenant_b = &h.ip[1];
    let over = h.exec(
        0,
        &format!(
            "ping -c 2 -i 0.3 -W 1 -M do -s {} {tenant_b}",
            inner_mtu - 27
        ),
    );
    let said =
        String::from_utf8_lossy(&over.stdout).to_string() + &String::from_utf8_lossy(&over.stderr);
    assert!(!over.status.success(), "{said}");
    assert!(
        said.contains(&format!("mtu = {inner_mtu}")) || said.contains(&format!("mtu={inner_mtu}")),
        "{said}"
    );
    let cached = must(&format!("ip -n {} route get {tenant_b}", h.ns[0]));
    assert!(cached.contains(&format!("mtu {inner_mtu}")), "{cached}");
    let fits = h.exec(
        0,
        &format!(
            "ping -c 2 -i 0.2 -W 2 -M do -s {} {tenant_b}",
            inner_mtu - 28
        ),
    );
    assert!(
        fits.status.success(),
        "{}",
        String::from_utf8_lossy(&fits.stdout)
    );
    assert!(vtep_counter(s, "icmp_sent") >= 1 && vtep_counter(s, "too_big_drops") >= 1);
}

/// Stitch learned where host B's VXLAN device is, and sends to it alone.
fn stitch_learns_where_linux_vtep_is(h: &TwoHosts, s: &Stitch, remote: &str) {
    let (b, tenant_b) = (&h.ns[1], &h.ip[1]);
    let shown: serde_json::Value = serde_json::from_str(&must(&format!(
        "{} show vtep --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    )))
    .unwrap();
    let vx_mac = must(&format!("ip -n {b} -br link show vx0"));
    let vx_mac = vx_mac.split_whitespace().nth(2).unwrap().to_string();
    assert!(
        shown["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["mac"] == vx_mac.as_str() && e["remote"] == remote),
        "{shown}"
    );
    let flooded = |s: &Stitch| vtep_counter(s, "unknown_unicast_flooded");
    let before = flooded(s);
    let ping = h.exec(0, &format!("ping -c 5 -i 0.1 -W 2 {tenant_b}"));
    assert!(ping.status.success());
    assert_eq!(
        flooded(s),
        before,
        "unicast went to the learned remote only"
    );
}

/// TCP with the default offloads: super-frames from host A are cut and checksummed before
/// encapsulation; Linux checks every checksum on the way in. And back: Linux sends UDP-tunnel
/// super-frames over the veth, which the af_packet port takes apart on the way in.
fn tcp_crosses_the_tunnel_both_ways(h: &TwoHosts, family: u8) {
    let tenant_b = &h.ip[1];
    let bps = h.iperf_tcp(tenant_b, 2);
    eprintln!(
        "iperf3 over Stitch's VXLAN (IPv{family} underlay) to Linux: {:.2} Gbit/s",
        bps / 1e9
    );
    assert!(bps > 1e6, "{bps}");
    let server = h.spawn(1, "iperf3 -s -1 -p 5298");
    h.wait_listening(1, 5298);
    let back = h.exec(0, &format!("iperf3 -c {tenant_b} -p 5298 -t 2 -R -J"));
    let _ = server.finish();
    assert!(
        back.status.success(),
        "{}",
        String::from_utf8_lossy(&back.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&back.stdout).unwrap();
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    eprintln!(
        "iperf3 from Linux's VXLAN device over Stitch (IPv{family}): {:.2} Gbit/s",
        bps / 1e9
    );
    assert!(bps > 1e6, "{bps}");
}

#[test]
fn vxlan_talks_to_linux_over_an_ipv4_underlay() {
    vxlan_talks_to_linux_over(4);
}

#[test]
fn vxlan_talks_to_linux_over_an_ipv6_underlay() {
    vxlan_talks_to_linux_over(6);
}

/// Host A has no IPv6 configuration of its own: the router's advertisements give it an
/// address (SLAAC) and a default route via the router's link-local address.
#[test]
fn router_advertisements_configure_a_host() {
    require_root_and_tools(&["ip", "ping"]);
    let h = TwoHosts::new();
    let n = 150 + (std::process::id() % 50);
    let (a, b) = (&h.ns[0], &h.ns[1]);
    must(&format!(
        "ip -n {a} -6 addr flush dev {} scope global",
        h.inner[0]
    ));
    must(&format!(
        "ip -n {b} -6 addr flush dev {} scope global",
        h.inner[1]
    ));
    must(&format!(
        "ip -n {b} addr add fd{n:x}:2::2/64 dev {} nodad",
        h.inner[1]
    ));
    must(&format!("ip -n {b} -6 route add default via fd{n:x}:2::1"));
    let s = Stitch::run(&format!(
        "apps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\n  r: {{ type: router, interfaces: {{ left: {{ mac: \"02:00:00:00:01:01\", address: \"10.{n}.1.1/24\", address6: \"fd{n:x}:1::1/64\", advertise: true }}, right: {{ mac: \"02:00:00:00:02:01\", address: \"10.{n}.2.1/24\", address6: \"fd{n:x}:2::1/64\" }} }} }}\nlinks:\n  - \"a.output -> r.left\"\n  - \"r.left -> a.input\"\n  - \"b.output -> r.right\"\n  - \"r.right -> b.input\"\n",
        h.outer[0], h.outer[1]
    ));
    let prefix = format!("fd{n:x}:1:");
    wait_until(
        "host A configures an address from the advertised prefix",
        15,
        || {
            let o = h.exec(
                0,
                &format!("ip -6 addr show dev {} scope global", h.inner[0]),
            );
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            text.contains(&prefix) && !text.contains("tentative")
        },
    );
    let route = String::from_utf8_lossy(&h.exec(0, "ip -6 route show default").stdout).to_string();
    assert!(
        route.contains("via fe80::ff:fe00:101") && route.contains("proto ra"),
        "default route from the advertisement: {route}"
    );
    let o = h.exec(0, &format!("ping -6 -c 3 -i 0.2 -W 2 fd{n:x}:2::2"));
    assert!(
        o.status.success(),
        "A reaches B through its learned default route: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(
        0,
        &format!("ping -6 -c 2 -i 0.2 -W 2 fe80::ff:fe00:101%{}", h.inner[0]),
    );
    assert!(
        o.status.success(),
        "the router answers on its link-local address: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let stats = s.stop();
    let c = &app(&stats, "r")["counters"];
    assert!(c["router_advertisements"].as_u64().unwrap() >= 1, "{c}");
}

// PCAP in → PCAP out: crafted frames on each side (the wan side's 300 ms after the lan side's,
// so that state made by one side is there for the other), every output decoded by tshark with
// checksum checking on.

const HOST_MAC: [u8; 6] = [2, 0, 0, 0, 1, 2];
const LAN_MAC: [u8; 6] = [2, 0, 0, 0, 1, 1];
const WAN_MAC: [u8; 6] = [2, 0, 0, 0, 2, 1];
const GW_MAC: [u8; 6] = [2, 0, 0, 0, 2, 9];

fn two_sided(
    dir: &std::path::Path,
    app: &str,
    lan: &[Vec<u8>],
    wan: &[Vec<u8>],
) -> serde_json::Value {
    let at = |ms: u64, frames: &[Vec<u8>]| -> Vec<(std::time::Duration, Vec<u8>)> {
        frames
            .iter()
            .enumerate()
            .map(|(i, f)| (std::time::Duration::from_millis(ms + i as u64), f.clone()))
            .collect()
    };
    frames::write_timed(&dir.join("lan_in.pcap"), &at(0, lan));
    frames::write_timed(&dir.join("wan_in.pcap"), &at(0, wan));
    run_graph(dir, &format!(
        "apps:\n  lan_in: {{ type: pcap_source, file: lan_in.pcap, pace: true }}\n  wan_in: {{ type: pcap_source, file: wan_in.pcap, pace: true, start_after: 0.3 }}\n  f: {app}\n  lan_out: {{ type: pcap_sink, file: lan_out.pcap }}\n  wan_out: {{ type: pcap_sink, file: wan_out.pcap }}\nlinks:\n  - \"lan_in.output -> f.{lan}\"\n  - \"wan_in.output -> f.{wan}\"\n  - \"f.{lan} -> lan_out.input\"\n  - \"f.{wan} -> wan_out.input\"\n",
        lan = "lan", wan = "wan"
    ), &[])
}

fn from_host(ip: Vec<u8>) -> Vec<u8> {
    frames::eth(LAN_MAC, HOST_MAC, 0x0800, None, &ip)
}

fn from_gateway(ip: Vec<u8>) -> Vec<u8> {
    frames::eth(WAN_MAC, GW_MAC, 0x0800, None, &ip)
}

#[test]
fn router_pcap_in_pcap_out() {
    use frames::*;
    let dir = tempfile::tempdir().unwrap();
    let ttl = |t: u8| Ip4 {
        ttl: t,
        ..plain("10.0.1.2", "198.51.100.7", 17)
    };
    let mut bad = from_host(ip4_checksummed(ttl(64), &udp(1000, 2000, 10)));
    bad[24] ^= 0xff; // IPv4 header checksum
    let big = Ip4 {
        flags_frag: 0x4000,
        ..ttl(64)
    };
    let echo = icmp(8, 0, [0x12, 0x34, 0, 1], b"ping");
    let echo6 = icmp6(
        "2001:db8:1::2",
        "2001:db8:1::1",
        &[128, 0, 0, 0, 0x56, 0x78, 0, 1, b'h', b'i'],
    );
    let lan = vec![
        from_host(ip4_checksummed(ttl(64), &udp(1000, 2000, 10))),
        from_host(ip4_checksummed(ttl(64), &udp(1001, 2000, 10))),
        from_host(ip4_checksummed(ttl(1), &udp(1002, 2000, 10))),
        from_host(ip4_checksummed(
            plain("10.0.1.2", "203.0.113.1", 17),
            &udp(1003, 2000, 10),
        )),
        from_host(ip4_checksummed(big, &udp(1004, 2000, 1372))),
        bad,
        from_host(ip4(plain("10.0.1.2", "10.0.1.1", 1), &echo)),
        eth(LAN_MAC, HOST_MAC, 0x86dd, None, &echo6),
    ];
    // The gateway answers the router's ARP request (the two packets for it wait meanwhile).
    let mut arp = vec![0, 1, 8, 0, 6, 4, 0, 2];
    arp.extend_from_slice(&GW_MAC);
    arp.extend_from_slice(&[192, 0, 2, 9]);
    arp.extend_from_slice(&WAN_MAC);
    arp.extend_from_slice(&[192, 0, 2, 2]);
    let wan = vec![eth(WAN_MAC, GW_MAC, 0x0806, None, &arp)];
    let stats = two_sided(dir.path(), "{ type: router, interfaces: { lan: { mac: \"02:00:00:00:01:01\", address: \"10.0.1.1/24\", address6: \"2001:db8:1::1/64\" }, wan: { mac: \"02:00:00:00:02:01\", address: \"192.0.2.2/24\", mtu: 1280 } }, routes: [ { prefix: \"198.51.100.0/24\", via: \"192.0.2.9\" } ] }", &lan, &wan);
    let w = tshark_checked(
        &dir.path().join("wan_out.pcap"),
        &[
            "arp.opcode",
            "eth.src",
            "eth.dst",
            "ip.ttl",
            "ip.checksum.status",
            "udp.srcport",
        ],
    );
    assert_eq!(
        w,
        vec![
            "1\t02:00:00:00:02:01\tff:ff:ff:ff:ff:ff\t\t\t",
            "\t02:00:00:00:02:01\t02:00:00:00:02:09\t63\t1\t1000",
            "\t02:00:00:00:02:01\t02:00:00:00:02:09\t63\t1\t1001",
        ],
        "ARP request, then both packets with TTL 63 and a good checksum once resolved"
    );
    let l = tshark_checked(
        &dir.path().join("lan_out.pcap"),
        &[
            "ip.src",
            "ip.dst",
            "icmp.type",
            "icmp.code",
            "icmp.mtu",
            "icmp.checksum.status",
            "icmpv6.type",
            "icmpv6.checksum.status",
        ],
    );
    assert_eq!(
        l,
        vec![
            "10.0.1.1,10.0.1.2\t10.0.1.2,198.51.100.7\t11\t0\t\t1\t\t",
            "10.0.1.1,10.0.1.2\t10.0.1.2,203.0.113.1\t3\t0\t\t1\t\t",
            "10.0.1.1,10.0.1.2\t10.0.1.2,198.51.100.7\t3\t4\t1280\t1\t\t",
            "10.0.1.1\t10.0.1.2\t0\t0\t\t1\t\t",
            "\t\t\t\t\t\t129\t1",
        ],
        "time exceeded, net unreachable, fragmentation needed (MTU 1280), echo replies"
    );
    let c = &app(&stats, "f")["counters"];
    assert_eq!(
        (c["forwarded"].as_u64(), c["bad_ipv4_header_drops"].as_u64()),
        (Some(2), Some(1)),
        "{c}"
    );
}

#[test]
fn firewall_pcap_in_pcap_out() {
    use frames::*;
    let dir = tempfile::tempdir().unwrap();
    let out_udp = ip4_checksummed(plain("10.0.0.5", "198.51.100.1", 17), &udp(5000, 53, 12));
    let lan = vec![
        from_host(out_udp.clone()),
        from_host(ip4_checksummed(
            plain("10.0.0.5", "198.51.100.1", 6),
            &tcp(40000, 443),
        )),
    ];
    // A port unreachable about the lan's datagram: related to its connection.
    let mut quote = out_udp[..28].to_vec();
    quote[8] = 60;
    let wan = vec![
        from_gateway(ip4_checksummed(
            plain("198.51.100.1", "10.0.0.5", 17),
            &udp(53, 5000, 12),
        )),
        from_gateway(ip4_checksummed(
            plain("198.51.100.1", "10.0.0.5", 17),
            &udp(53, 6000, 12),
        )),
        from_gateway(ip4_checksummed(
            plain("198.51.100.66", "10.0.0.5", 6),
            &tcp(1234, 23),
        )),
        from_gateway(ip4_checksummed(
            plain("198.51.100.66", "10.0.0.5", 17),
            &udp(1234, 7, 4),
        )),
        from_gateway(ip4(
            plain("198.51.100.1", "10.0.0.5", 1),
            &icmp(3, 3, [0; 4], &quote),
        )),
        from_gateway(ip4(
            plain("198.51.100.66", "10.0.0.5", 1),
            &icmp(3, 3, [0; 4], &out_udp[..20]),
        )),
    ];
    let stats = two_sided(dir.path(), "{ type: firewall, rules: [ { action: accept, from: lan }, { action: reject, from: wan, proto: tcp, dst_port: 23 }, { action: reject, from: wan, proto: udp, dst_port: 7 } ] }", &lan, &wan);
    let w = tshark_checked(
        &dir.path().join("wan_out.pcap"),
        &[
            "ip.src",
            "ip.dst",
            "udp.dstport",
            "tcp.dstport",
            "tcp.flags.reset",
            "tcp.checksum.status",
            "icmp.type",
            "icmp.code",
        ],
    );
    assert_eq!(
        w,
        vec![
            "10.0.0.5\t198.51.100.1\t53\t\t\t\t\t",
            "10.0.0.5\t198.51.100.1\t\t443\t0\t1\t\t",
            "10.0.0.5\t198.51.100.66\t\t1234\t1\t1\t\t",
            "10.0.0.5,198.51.100.66\t198.51.100.66,10.0.0.5\t7\t\t\t\t3\t13",
        ],
        "lan traffic out; a TCP RST and an ICMP administratively prohibited for the rejects"
    );
    let l = tshark_checked(
        &dir.path().join("lan_out.pcap"),
        &["ip.src", "udp.srcport", "udp.dstport", "icmp.type"],
    );
    assert_eq!(
        l,
        vec![
            "198.51.100.1\t53\t5000\t",
            "198.51.100.1,10.0.0.5\t5000\t53\t3"
        ],
        "the reply and the related error pass; the stray datagram and the unrelated error do not"
    );
    let c = &app(&stats, "f")["counters"];
    assert_eq!(c["rejected"], 2, "{c}");
    assert_eq!(c["related_passed"], 1, "{c}");
}

#[test]
fn nat_pcap_in_pcap_out() {
    let dir = tempfile::tempdir().unwrap();
    let (lan, wan) = nat_lan_and_wan_frames();
    let stats = two_sided(dir.path(), "{ type: nat, external: 192.0.2.10, ports: \"5000-5999\", forwards: [ { proto: tcp, port: 8080, to_address: 10.0.0.7, to_port: 80 } ] }", &lan, &wan);
    // The NAT announces its external address on the wan side, and asks on the lan side for
    // the forward's server, which it has not seen.
    let arp = |file: &str| {
        tshark_checked_where(
            &dir.path().join(file),
            "arp",
            &[
                "arp.src.proto_ipv4",
                "arp.dst.proto_ipv4",
                "arp.isgratuitous",
                "arp.isprobe",
            ],
        )
    };
    assert_eq!(arp("wan_out.pcap"), vec!["192.0.2.10\t192.0.2.10\t1\t"]);
    assert_eq!(arp("lan_out.pcap"), vec!["0.0.0.0\t10.0.0.7\t\t1"]);
    nat_wan_side_is_translated(&dir.path().join("wan_out.pcap"));
    nat_lan_side_is_translated_back(&dir.path().join("lan_out.pcap"));
    let c = &app(&stats, "f")["counters"];
    assert_eq!(c["no_mapping_drops"], 1, "{c}");
}

/// Frames from the NAT's inside hosts, and from the gateway toward its external address.
fn nat_lan_and_wan_frames() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    use frames::*;
    let lan = vec![
        from_host(ip4_checksummed(
            plain("10.0.0.5", "198.51.100.1", 17),
            &udp(5000, 53, 12),
        )),
        from_host(ip4_checksummed(
            plain("10.0.0.6", "198.51.100.1", 17),
            &udp(5000, 53, 12),
        )),
        from_host(ip4_checksummed(
            plain("10.0.0.6", "198.51.100.1", 6),
            &tcp(5600, 443),
        )),
        // Echo identifier 5500 (0x157c): inside the port range, so kept like a port.
        from_host(ip4(
            plain("10.0.0.5", "198.51.100.1", 1),
            &icmp(8, 0, [0x15, 0x7c, 0, 1], b"ping"),
        )),
    ];
    // The translated first datagram as the far end quotes it in a port unreachable.
    let sent = ip4_checksummed(plain("192.0.2.10", "198.51.100.1", 17), &udp(5000, 53, 12));
    let wan = vec![
        from_gateway(ip4_checksummed(
            plain("198.51.100.1", "192.0.2.10", 17),
            &udp(53, 5000, 12),
        )),
        from_gateway(ip4(
            plain("198.51.100.1", "192.0.2.10", 1),
            &icmp(0, 0, [0x15, 0x7c, 0, 1], b"ping"),
        )),
        from_gateway(ip4_checksummed(
            plain("203.0.113.8", "192.0.2.10", 6),
            &tcp(33333, 8080),
        )),
        from_gateway(ip4_checksummed(
            plain("203.0.113.8", "192.0.2.10", 17),
            &udp(33333, 9999, 4),
        )),
        from_gateway(ip4(
            plain("198.51.100.1", "192.0.2.10", 1),
            &icmp(3, 3, [0; 4], &sent[..28]),
        )),
    ];
    (lan, wan)
}

fn nat_wan_side_is_translated(pcap: &std::path::Path) {
    let w = tshark_checked_where(
        pcap,
        "ip",
        &[
            "ip.src",
            "udp.srcport",
            "tcp.srcport",
            "icmp.ident",
            "ip.checksum.status",
            "udp.checksum.status",
            "tcp.checksum.status",
            "icmp.checksum.status",
        ],
    );
    assert_eq!(w.len(), 4, "{w:?}");
    assert_eq!(w[0], "192.0.2.10\t5000\t\t\t1\t1\t\t", "inside port kept");
    let second: Vec<&str> = w[1].split('\t').collect();
    assert!(
        second[0] == "192.0.2.10" && second[1] != "5000" && second[4..6] == ["1", "1"],
        "the second host's port 5000 is taken: another one ({w:?})"
    );
    assert_eq!(w[2], "192.0.2.10\t\t5600\t\t1\t\t1\t");
    assert_eq!(w[3], "192.0.2.10\t\t\t5500\t1\t\t\t1");
}

fn nat_lan_side_is_translated_back(pcap: &std::path::Path) {
    let l = tshark_checked_where(
        pcap,
        "ip",
        &[
            "ip.dst",
            "ip.src",
            "udp.dstport",
            "udp.srcport",
            "tcp.dstport",
            "icmp.type",
            "udp.checksum.status",
            "tcp.checksum.status",
            "icmp.checksum.status",
        ],
    );
    assert_eq!(
        l,
        vec![
            "10.0.0.5\t198.51.100.1\t5000\t53\t\t\t1\t\t",
            "10.0.0.5\t198.51.100.1\t\t\t\t0\t\t\t1",
            "10.0.0.7\t203.0.113.8\t\t\t80\t\t\t1\t",
            // Outer destination and quoted source back to the inside host; a quote holds no
            // whole datagram, so its checksum stays unverified (2).
            "10.0.0.5,198.51.100.1\t198.51.100.1,10.0.0.5\t53\t5000\t\t3\t2\t\t1",
        ],
        "reply, echo reply, port forward, and the error translated back (outer and quoted)"
    );
}

#[test]
fn policer_pcap_in_pcap_out() {
    use frames::*;
    let dir = tempfile::tempdir().unwrap();
    // 60 frames of 1000 bytes, one every 25 ms (320 kbit/s), through 80 kbit/s with a
    // 3000-byte bucket: about 3000 + 10 000 bytes per second pass.
    let frames: Vec<(std::time::Duration, Vec<u8>)> = (0..60u16)
        .map(|i| {
            let ip = ip4_checksummed(
                plain("10.0.0.5", "198.51.100.1", 17),
                &udp(i, 9, 1000 - 42 - 8),
            );
            (
                std::time::Duration::from_millis(25 * i as u64),
                from_host(ip),
            )
        })
        .collect();
    write_timed(&dir.path().join("in.pcap"), &frames);
    let stats = run_graph(dir.path(), "apps:\n  src: { type: pcap_source, file: in.pcap, pace: true }\n  p: { type: policer, rate: \"80 kbit/s\", burst: 3000 }\n  out: { type: pcap_sink, file: out.pcap }\nlinks:\n  - \"src.output -> p.input\"\n  - \"p.output -> out.input\"\n", &[]);
    let ports: Vec<u16> = tshark_fields(&dir.path().join("out.pcap"), &["udp.srcport"])
        .iter()
        .map(|l| l.parse().unwrap())
        .collect();
    let dropped = app(&stats, "p")["counters"]["policed_drops"]
        .as_u64()
        .unwrap() as usize;
    assert_eq!(ports.len() + dropped, 60, "every frame passed or counted");
    // About 18 pass at the recorded pace; a stalled replay lets a few more through (the bucket
    // never holds more than its depth), and none of this comes near all 60.
    assert!(
        (12..=40).contains(&ports.len()),
        "{} passed: {ports:?}",
        ports.len()
    );
    assert_eq!(
        &ports[..3],
        &[0, 1, 2],
        "the bucket's depth passes the first three"
    );
    assert!(ports.windows(2).all(|w| w[0] < w[1]), "in order");
}
