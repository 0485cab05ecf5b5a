//! Stitch between two network namespaces: ns1 ⇄ veth ⇄ [interface app ⇄ interface app] ⇄ veth ⇄ ns2.
//! Real ping, iperf3 TCP with the interfaces' default offloads, and exact UDP bursts.

mod common;
use common::*;

fn cross_connect(kind: &str, h: &TwoHosts, extra: &str) -> Stitch {
    Stitch::run(&format!(
        "apps:\n  a: {{ type: {kind}, interface: {}{extra} }}\n  b: {{ type: {kind}, interface: {}{extra} }}\n  fa: {{ type: forwarder }}\n  fb: {{ type: forwarder }}\nlinks:\n  - \"a.output -> fa.input\"\n  - \"fa.output -> b.input\"\n  - \"b.output -> fb.input\"\n  - \"fb.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    ))
}

fn ping_works(h: &TwoHosts) {
    let o = h.exec(0, &format!("ping -c 5 -i 0.1 -W 2 {}", h.ip[1]));
    assert!(
        o.status.success(),
        "ping failed: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = h.exec(1, &format!("ping -6 -c 3 -i 0.1 -W 2 {}", h.ip6[0]));
    assert!(
        o.status.success(),
        "ping -6 failed: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}

const RECEIVER: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", 5300))
print("ready", flush=True)
# The first datagram may be a while coming (the sender starts when this is ready); after it,
# 3 s of quiet ends the burst.
s.settimeout(20.0)
n = 0
try:
    while True:
        s.recv(2048); n += 1
        s.settimeout(3.0)
except socket.timeout:
    pass
print(n)
"#;

const SENDER: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dst, n = sys.argv[1], int(sys.argv[2])
payload = bytes(200)
for i in range(n):
    s.sendto(payload, (dst, 5300))
    if i % 200 == 199:
        time.sleep(0.002)
"#;

/// Runs Python sender `script` (arguments: host 1's address and `n`) on host 0, from a file in
/// `dir`, to its end.
fn send_from_host0(h: &TwoHosts, dir: &std::path::Path, script: &str, n: u64) {
    let file = dir.join("tx.py");
    std::fs::write(&file, script).unwrap();
    let o = h.exec(0, &format!("python3 {} {} {n}", file.display(), h.ip[1]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Sends `n` UDP datagrams from ns1 to ns2 and returns how many arrived.
fn udp_burst(h: &TwoHosts, dir: &std::path::Path, n: usize) -> usize {
    std::fs::write(dir.join("rx.py"), RECEIVER).unwrap();
    let rx = h.spawn_ready(1, &format!("python3 {}", dir.join("rx.py").display()));
    send_from_host0(h, dir, SENDER, n as u64);
    rx.finish().trim().parse().unwrap()
}

fn exercise(kind: &str, extra: &str) {
    require_root_and_tools(&["ip", "ping", "iperf3", "python3"]);
    let h = TwoHosts::new();
    let s = cross_connect(kind, &h, extra);
    ping_works(&h);
    let bps = h.iperf_tcp(&h.ip[1], 2);
    eprintln!("{kind}: iperf3 TCP through Stitch: {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 10e6, "TCP throughput {bps} bit/s is far too low");
    let n = 3000;
    let before = s.stats().unwrap();
    let got = udp_burst(&h, s.path(), n);
    let stats = s.stop();
    assert_eq!(got, n, "every UDP datagram must arrive");
    let fwd = |st: &serde_json::Value| {
        link(st, "a.output -> fa.input")["tx_packets"]
            .as_u64()
            .unwrap()
    };
    assert!(
        fwd(&stats) - fwd(&before) >= n as u64,
        "Stitch's counters saw the burst"
    );
    for l in stats["links"].as_array().unwrap() {
        assert_eq!(l["tx_drops"], 0, "{l}");
    }
    let a = app(&stats, "a");
    eprintln!("{kind}: counters of a: {}", a["counters"]);
    if kind == "af_packet" {
        assert!(
            a["counters"]["gso_frames"].as_u64().unwrap() > 0,
            "TCP super-frames crossed whole"
        );
    }
}

#[test]
fn af_packet_can_segment_super_frames_on_entry() {
    require_root_and_tools(&["ip", "ping", "iperf3"]);
    let h = TwoHosts::new();
    let s = cross_connect("af_packet", &h, ", gso: segment");
    ping_works(&h);
    let bps = h.iperf_tcp(&h.ip[1], 2);
    eprintln!("af_packet gso: segment: iperf3 TCP {:.2} Gbit/s", bps / 1e9);
    let stats = s.stop();
    let a = &app(&stats, "a")["counters"];
    assert!(
        a["gso_segments"].as_u64().unwrap() > 0 && a["gso_frames"] == 0,
        "{a}"
    );
    for l in stats["links"].as_array().unwrap() {
        assert_eq!(
            l["tx_drops"], 0,
            "segment bursts never overflow a link: {l}"
        );
    }
}

#[test]
fn af_packet_carries_ping_tcp_and_exact_udp_bursts() {
    exercise("af_packet", "");
}

#[test]
fn af_packet_with_a_block_ring_carries_the_same() {
    exercise("af_packet", ", ring: v3");
}

#[test]
fn af_packet_block_ring_segments_super_frames_too() {
    require_root_and_tools(&["ip", "ping", "iperf3"]);
    let h = TwoHosts::new();
    let s = cross_connect("af_packet", &h, ", ring: v3, gso: segment");
    ping_works(&h);
    let bps = h.iperf_tcp(&h.ip[1], 2);
    eprintln!(
        "af_packet v3 gso: segment: iperf3 TCP {:.2} Gbit/s",
        bps / 1e9
    );
    let stats = s.stop();
    assert!(
        app(&stats, "a")["counters"]["gso_segments"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn missing_interface_is_a_clear_error_and_nothing_starts() {
    require_root_and_tools(&["ip"]);
    let err = run_must_fail(
        "apps:\n  a: { type: af_packet, interface: nosuchif0 }\n  s: { type: sink }\nlinks: [\"a.output -> s.input\"]\n",
    );
    assert!(
        err.contains("app `a`: no interface named `nosuchif0` (see `ip link show`)"),
        "{err}"
    );
}

/// Replaces host 0's veth by a TAP device Stitch creates (joined to host 1's veth by an
/// `af_packet` app), of MTU `mtu` if given, moved into host 0 with its addresses.
fn tap_in_host_0(h: &TwoHosts, mtu: Option<u32>) -> Stitch {
    must(&format!("ip -n {} link del {}", h.ns[0], h.inner[0]));
    let tap = h.outer[0].clone();
    let s = Stitch::run(&format!(
        "apps:\n  t: {{ type: tap, name: {tap} }}\n  b: {{ type: af_packet, interface: {} }}\nlinks:\n  - \"t.output -> b.input\"\n  - \"b.output -> t.input\"\n",
        h.outer[1]
    ));
    if let Some(mtu) = mtu {
        must(&format!("ip link set {tap} mtu {mtu}"));
        // The port reads its device's MTU once a second, and keeps it once the device moved.
        std::thread::sleep(std::time::Duration::from_millis(1500));
    }
    must(&format!("ip link set {tap} netns {}", h.ns[0]));
    let ns = &h.ns[0];
    must(&format!("ip -n {ns} addr add {}/24 dev {tap}", h.ip[0]));
    must(&format!(
        "ip -n {ns} addr add {}/64 dev {tap} nodad",
        h.ip6[0]
    ));
    must(&format!("ip -n {ns} link set {tap} up"));
    s
}

#[test]
fn tap_hands_packets_to_a_host_stack() {
    require_root_and_tools(&["ip", "ping", "iperf3"]);
    let h = TwoHosts::new();
    let s = tap_in_host_0(&h, None);
    ping_works(&h);
    let bps = h.iperf_tcp(&h.ip[1], 2);
    eprintln!("tap ⇄ af_packet: iperf3 TCP {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 10e6, "TCP throughput {bps} bit/s is far too low");
    let stats = s.stop();
    assert!(
        app(&stats, "t")["counters"]["gso_frames"].as_u64().unwrap() > 0,
        "TSO frames from the host crossed whole"
    );
}

#[test]
fn af_xdp_carries_ping_tcp_and_exact_udp_bursts() {
    exercise("af_xdp", "");
}

#[test]
fn af_xdp_refuses_an_interface_that_already_has_xdp() {
    require_root_and_tools(&["ip"]);
    let h = TwoHosts::new();
    let graph = |name: &str| {
        format!("apps:\n  {name}: {{ type: af_xdp, interface: {} }}\n  s: {{ type: sink }}\nlinks: [\"{name}.output -> s.input\"]\n", h.outer[0])
    };
    let first = Stitch::run(&graph("a"));
    let err = run_must_fail(&graph("b"));
    assert!(err.contains("an XDP program is already attached"), "{err}");
    first.stop();
    // The program goes away with the instance that attached it.
    let shown = must(&format!("ip link show {}", h.outer[0]));
    assert!(!shown.contains("xdp"), "{shown}");
}

#[test]
fn af_packet_fanout_shares_an_interface_between_apps() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    // Two sockets on ns1's side share its traffic round robin, then merge toward ns2.
    let s = Stitch::run(&format!(
        "apps:\n  a0: {{ type: af_packet, interface: {a}, fanout: {{ group: 77, mode: lb }} }}\n  a1: {{ type: af_packet, interface: {a}, fanout: {{ group: 77, mode: lb }}, worker: second }}\n  j: {{ type: join }}\n  b: {{ type: af_packet, interface: {b} }}\nlinks:\n  - \"a0.output -> j.a0\"\n  - \"a1.output -> j.a1\"\n  - \"j.output -> b.input\"\n  - \"b.output -> a0.input\"\n",
        a = h.outer[0],
        b = h.outer[1]
    ));
    // Resolve neighbours first: a cold burst overflows the kernel's queue of packets waiting for
    // ARP (unres_qlen) before Stitch sees them.
    ping_works(&h);
    let n = 2000;
    let got = udp_burst(&h, s.path(), n);
    let stats = s.stop();
    assert_eq!(got, n, "every datagram arrives once: {stats}");
    let a0 = link(&stats, "a0.output -> j.a0")["tx_packets"]
        .as_u64()
        .unwrap();
    let a1 = link(&stats, "a1.output -> j.a1")["tx_packets"]
        .as_u64()
        .unwrap();
    assert!(
        a0 > n as u64 / 4 && a1 > n as u64 / 4,
        "both fanout members got traffic: {a0} and {a1}"
    );
}

const VLAN_SENDER: &str = r#"
import socket, struct
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
for i in range(20):
    frame = bytes.fromhex("0200000000b2" "0200000000a1") + struct.pack("!HHH", 0x8100, 10, 0x88b5) + bytes([i]) * 46
    s.send(frame)
"#;

#[test]
fn af_packet_puts_back_the_vlan_tags_the_kernel_lifts_out() {
    require_root_and_tools(&["ip", "python3", "tcpdump"]);
    let h = TwoHosts::new();
    let s = cross_connect("af_packet", &h, "");
    std::fs::write(s.path().join("vlan.py"), VLAN_SENDER).unwrap();
    let capture = h.spawn(
        1,
        "timeout 10 tcpdump -i eth0 -n -e -c 20 'ether dst 02:00:00:00:00:b2'",
    );
    std::thread::sleep(std::time::Duration::from_millis(700));
    let o = h.exec(
        0,
        &format!("python3 {}", s.path().join("vlan.py").display()),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = capture.finish();
    let text = String::from_utf8_lossy(&out.stdout);
    let tagged = text
        .lines()
        .filter(|l| l.contains("vlan 10") && l.contains("0x88b5"))
        .count();
    assert_eq!(tagged, 20, "every frame arrives with its VLAN tag:\n{text}");
    s.stop();
}

const MANY_FLOWS: &str = r#"
import socket, sys, time
dst, n = sys.argv[1], int(sys.argv[2])
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(16)]
payload = bytes(200)
for i in range(n):
    socks[i % 16].sendto(payload, (dst, 5300))
    if i % 200 == 199:
        time.sleep(0.002)
"#;

/// Two-queue veths, one AF_XDP socket per queue: sixteen flows spread over both queues and
/// every datagram arrives.
#[test]
fn af_xdp_serves_several_queues() {
    require_root_and_tools(&["ip", "ping", "python3"]);
    let h = TwoHosts::with_queues(2);
    let s = cross_connect("af_xdp", &h, ", queues: [0, 1]");
    ping_works(&h);
    std::fs::write(s.path().join("rx.py"), RECEIVER).unwrap();
    let rx = h.spawn_ready(1, &format!("python3 {}", s.path().join("rx.py").display()));
    let n = 4000;
    send_from_host0(&h, s.path(), MANY_FLOWS, n);
    let got: u64 = rx.finish().trim().parse().unwrap();
    let stats = s.stop();
    assert_eq!(got, n, "every UDP datagram must arrive");
    let c = &app(&stats, "a")["counters"];
    let (q0, q1) = (
        c["queue0_rx_packets"].as_u64().unwrap(),
        c["queue1_rx_packets"].as_u64().unwrap(),
    );
    eprintln!("af_xdp two queues: {q0} + {q1} packets received");
    assert!(q0 > 0 && q1 > 0, "both queues carried traffic: {c}");
    assert!(q0 + q1 >= n, "{c}");
}

/// An `af_packet` app carries only its own interface's frames, from its first breath: frames
/// of other interfaces that pass while its rings are set up (here a ping flood on a third
/// veth pair) never enter the graph. Before the socket was given its protocol only with the
/// interface, such frames leaked in, and one the kernel refused to send stopped the port.
#[test]
fn af_packet_takes_no_frames_of_other_interfaces_while_it_starts() {
    require_root_and_tools(&["ping"]);
    let h = TwoHosts::new();
    let noise = TwoHosts::new();
    must(&format!(
        "ip addr add {}/24 dev {}",
        noise.ip[1], noise.outer[0]
    ));
    let flood = Background(
        std::process::Command::new("ping")
            .args(["-f", "-q", "-s", "1200", &noise.ip[0]])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    for _ in 0..3 {
        let s = cross_connect("af_packet", &h, "");
        std::thread::sleep(std::time::Duration::from_millis(300));
        let stats = s.stop();
        // Nothing crossed: the two hosts are quiet (IPv6 autoconfiguration at most).
        for (app, host) in [("a", 0), ("b", 1)] {
            let a = common::app(&stats, app);
            assert!(
                a["tx_bytes"].as_u64().unwrap() < 2000,
                "{app} took frames that {} did not send: {a}",
                h.ns[host]
            );
        }
    }
    let s = cross_connect("af_packet", &h, "");
    ping_works(&h);
    drop(flood);
    s.stop();
}

/// Pings `to` from host `i` with `count` packets of `size` bytes of payload, DF set; returns
/// how many were answered.
fn ping_df(h: &TwoHosts, i: usize, to: &str, size: usize, count: usize) -> usize {
    let o = h.exec(
        i,
        &format!("ping -c {count} -i 0.05 -W 1 -s {size} -M do {to}"),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    out.lines()
        .find_map(|l| {
            let (_, rest) = l.split_once(" transmitted, ")?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no ping summary in: {out}"))
}

fn counter(stats: &serde_json::Value, app_name: &str, name: &str) -> u64 {
    app(stats, app_name)["counters"][name].as_u64().unwrap_or(0)
}

/// A frame longer than the next hop takes — Stitch's own interface (MTU 1400 on the port) or
/// the veth peer behind it (1400 in the namespace, 1500 on Stitch's side, so only the kernel
/// can tell) — is dropped and counted, and every small frame after it still goes: a port
/// never stops sending.
fn oversized_frames_leave_the_port_sending(kind: &str) {
    require_root_and_tools(&["ip", "ping"]);
    let h = TwoHosts::new();
    let s = cross_connect(kind, &h, "");
    assert!(
        h.reaches(0, &h.ip[1], 10),
        "{kind}: no ping before the test"
    );
    let set_mtu = |ours: u32, theirs: u32| {
        must(&format!("ip link set {} mtu {ours}", h.outer[1]));
        must(&format!(
            "ip -n {} link set {} mtu {theirs}",
            h.ns[1], h.inner[1]
        ));
        // The port reads its interface's MTU once a second.
        std::thread::sleep(std::time::Duration::from_millis(1500));
    };
    for (ours, theirs, counted) in [
        (1400, 1400, "too_big_drops"),
        (1500, 1400, "tx_refused_drops"),
    ] {
        set_mtu(ours, theirs);
        let before = s.stats().unwrap();
        assert_eq!(
            ping_df(&h, 0, &h.ip[1], 1450, 20),
            0,
            "{kind}: 1478-byte packets cannot cross MTU {theirs}"
        );
        let small = ping_df(&h, 0, &h.ip[1], 56, 10);
        let after = s.stats().unwrap();
        let dropped = counter(&after, "b", counted) - counter(&before, "b", counted);
        eprintln!("{kind}: MTU {ours} on Stitch's side, {theirs} behind it: {small}/10 small pings after 20 oversized, {dropped} counted as {counted}");
        assert!(
            small >= 9,
            "{kind}: the port stopped sending after oversized frames ({small}/10 small pings)"
        );
        if kind == "af_packet" || counted == "too_big_drops" {
            assert_eq!(
                dropped, 20,
                "{kind}: every oversized frame is counted as {counted}"
            );
        }
    }
    s.stop();
}

#[test]
fn af_packet_drops_and_counts_oversized_frames_and_keeps_sending() {
    oversized_frames_leave_the_port_sending("af_packet");
}

#[test]
fn af_xdp_drops_and_counts_oversized_frames_and_keeps_sending() {
    oversized_frames_leave_the_port_sending("af_xdp");
}

#[test]
fn tap_survives_frames_longer_than_its_device_takes() {
    require_root_and_tools(&["ip", "ping"]);
    let h = TwoHosts::new();
    let s = tap_in_host_0(&h, Some(1400));
    assert!(h.reaches(1, &h.ip[0], 10), "no ping before the test");
    let before = s.stats().unwrap();
    let big = ping_df(&h, 1, &h.ip[0], 1450, 20);
    let small = ping_df(&h, 1, &h.ip[0], 56, 10);
    let after = s.stop();
    let dropped = |c| counter(&after, "t", c) - counter(&before, "t", c);
    eprintln!(
        "tap at MTU 1400: {big}/20 oversized answered, {small}/10 small after; too_big_drops {}, tx_error_drops {}",
        dropped("too_big_drops"),
        dropped("tx_error_drops")
    );
    assert!(small >= 9, "the tap stopped sending ({small}/10)");
    assert_eq!(
        big, 0,
        "a 1478-byte packet cannot enter a device of MTU 1400"
    );
    assert_eq!(
        dropped("too_big_drops") + dropped("tx_error_drops"),
        20,
        "every oversized frame is counted"
    );
}

/// Datagrams from host 0 to host 1: `n` to each of ports 4789, 4790 and 5000, numbered in
/// their payload, paced.
const THREE_PORTS: &str = r#"
import socket, sys, time
dst, n = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(n):
    for port in (4789, 4790, 5000):
        s.sendto(b"%08d" % i + bytes(40), (dst, port))
    if i % 100 == 99:
        time.sleep(0.005)
"#;

/// Two hosts of which only host 0's veth is attached (to Stitch): host 1's address resolves
/// to a made-up MAC, so that host 0 sends to it.
fn host0_sending_into_stitch() -> TwoHosts {
    require_root_and_tools(&["ip", "python3", "tshark"]);
    let h = TwoHosts::new();
    must(&format!(
        "ip -n {} neigh replace {} lladdr 02:00:00:00:00:02 dev {}",
        h.ns[0], h.ip[1], h.inner[0]
    ));
    h
}

/// [`THREE_PORTS`] sending `n` rounds from host 0, in the background.
fn three_ports_from_host0(h: &TwoHosts, dir: &std::path::Path, n: u64) -> Background {
    let file = dir.join("tx.py");
    std::fs::write(&file, THREE_PORTS).unwrap();
    h.spawn(0, &format!("python3 {} {} {n}", file.display(), h.ip[1]))
}

/// (UDP destination port, number) of each datagram of `file` sent by [`THREE_PORTS`].
fn numbered_datagrams(file: &std::path::Path) -> Vec<(u16, u64)> {
    let lines = tshark_checked_where(file, "udp", &["udp.dstport", "udp.payload"]);
    lines
        .iter()
        .map(|l| {
            let (port, data) = l.split_once('\t').unwrap();
            let digits: String = (0..8)
                .map(|i| u8::from_str_radix(&data[2 * i..2 * i + 2], 16).unwrap() as char)
                .collect();
            (port.parse().unwrap(), digits.parse().unwrap())
        })
        .collect()
}

/// Where the UMEM frames of `af_xdp` app `app`'s first queue are (`stitch show APP`).
fn umem_frames(s: &Stitch, app: &str) -> serde_json::Value {
    let (status, v) = s.call("POST", &format!("/api/v1/apps/{app}/query"), Some("{}"));
    assert_eq!(status, 200, "{v}");
    v["queues"][0].clone()
}

/// Steering rules: the XDP program sends what a rule matches out of the rule's port,
/// classified in the kernel before Stitch sees a frame; the rest leaves by `output`. Both
/// captures are read back by tshark: each datagram once, on the right side, in order.
#[test]
fn af_xdp_steers_what_its_rules_match_out_of_their_port() {
    let h = host0_sending_into_stitch();
    let dir = tempfile::tempdir().unwrap();
    let (tunnel, rest) = (dir.path().join("tunnel.pcap"), dir.path().join("rest.pcap"));
    let s = Stitch::run(&format!(
        "apps:
  nic:
    type: af_xdp
    interface: {}
    steer:
      - {{ match: \"udp and dst port 4789\", to: tunnel }}
      - {{ match: \"udp dst port 4790\", to: tunnel }}
  t: {{ type: pcap_sink, file: {} }}
  r: {{ type: pcap_sink, file: {} }}
links:
  - \"nic.tunnel -> t.input\"
  - \"nic.output -> r.input\"
",
        h.outer[0],
        tunnel.display(),
        rest.display()
    ));
    // Where the UMEM's frames are, idle: all in the fill ring (for the kernel to receive
    // into) or free for sending, none anywhere else.
    let idle = umem_frames(&s, "nic");
    let owners = &idle["by_owner"];
    assert_eq!(owners["kernel"], 0, "{idle}");
    assert_eq!(
        owners["fill_ring"].as_u64().unwrap() + owners["tx_free"].as_u64().unwrap(),
        idle["frames"].as_u64().unwrap(),
        "{idle}"
    );
    assert_eq!(owners["steered_rx_rings"]["tunnel"], 0, "{idle}");
    let n = 1000;
    send_from_host0(&h, dir.path(), THREE_PORTS, n);
    wait_until("every datagram to reach a capture", 20, || {
        let stats = s.stats().unwrap();
        app(&stats, "t")["rx_packets"].as_u64() >= Some(2 * n)
            && app(&stats, "r")["rx_packets"].as_u64() >= Some(n)
    });
    assert_eq!(
        umem_frames(&s, "nic")["by_owner"],
        idle["by_owner"],
        "no frame was lost on the way"
    );
    let stats = s.stop();
    let nic = &app(&stats, "nic")["counters"];
    assert_eq!(nic["steered_packets"], 2 * n, "{nic}");
    assert_eq!(nic["steered_unlinked_drops"], 0, "{nic}");

    let steered = numbered_datagrams(&tunnel);
    let others = numbered_datagrams(&rest);
    for (port, side) in [(4789, &steered), (4790, &steered), (5000, &others)] {
        let seq: Vec<u64> = side
            .iter()
            .filter(|(p, _)| *p == port)
            .map(|x| x.1)
            .collect();
        assert_eq!(
            seq,
            (0..n).collect::<Vec<_>>(),
            "port {port}: each datagram once, in order"
        );
    }
    assert_eq!(
        steered.len() as u64,
        2 * n,
        "only the rules' datagrams were steered"
    );
    assert_eq!(
        others.len() as u64,
        n,
        "no steered datagram left by `output`"
    );
}

/// The `steered_from` of function `name` (`stitch show`): the interface port it reads
/// straight from, once it does.
fn steered_from(s: &Stitch, name: &str) -> serde_json::Value {
    let (status, v) = s.call("POST", &format!("/api/v1/apps/{name}/query"), Some("{}"));
    assert_eq!(status, 200, "{v}");
    v["steered_from"].clone()
}

/// `nic` on host 0's side steers UDP to ports 4789 and 4790 to functions `nf1` and `nf2`,
/// whose outputs are captured in `c1.pcap` and `c2.pcap` of `dir`; the rest goes to `r.pcap`.
fn steered_graph(h: &TwoHosts, dir: &std::path::Path) -> String {
    let file = |name: &str| dir.join(name);
    format!(
        "apps:
  nic:
    type: af_xdp
    interface: {nic}
    steer:
      - {{ match: \"udp and dst port 4789\", to: to_nf1 }}
      - {{ match: \"udp dst port 4790\", to: to_nf2 }}
  nf1: {{ placement: process, command: [stitch-nf-firewall], socket: {nf} }}
  nf2: {{ placement: process, command: [stitch-nf-firewall], socket: {nf} }}
  c1: {{ type: pcap_sink, file: {c1} }}
  c2: {{ type: pcap_sink, file: {c2} }}
  r: {{ type: pcap_sink, file: {r} }}
links:
  - \"nic.to_nf1 -> nf1.input\"
  - \"nic.to_nf2 -> nf2.input\"
  - \"nf1.output -> c1.input\"
  - \"nf2.output -> c2.input\"
  - \"nic.output -> r.input\"
",
        nic = h.outer[0],
        nf = file("nf.sock").display(),
        c1 = file("c1.pcap").display(),
        c2 = file("c2.pcap").display(),
        r = file("r.pcap").display(),
    )
}

/// Two rules steer to two function processes: each function reads its frames straight from
/// the interface's rings — counted by its port, not by the interface's receive counters —
/// and its output leaves through the chain; tshark reads each capture back: every datagram
/// once, on its side, in order. The UMEM's frames are all back where they were, idle.
#[test]
fn steered_frames_reach_two_functions_without_the_engine_reading_them() {
    let h = host0_sending_into_stitch();
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name);
    let s = Stitch::run(&steered_graph(&h, dir.path()));
    wait_until("both functions to read the interface's rings", 20, || {
        steered_from(&s, "nf1").is_string() && steered_from(&s, "nf2").is_string()
    });
    let (_, nic) = s.call("POST", "/api/v1/apps/nic/query", Some("{}"));
    assert_eq!(
        nic["read_by"],
        serde_json::json!({ "to_nf1": "nf1", "to_nf2": "nf2" })
    );
    let idle = umem_frames(&s, "nic");
    let n = 1000;
    send_from_host0(&h, dir.path(), THREE_PORTS, n);
    wait_until("every datagram to reach a capture", 20, || {
        let stats = s.stats().unwrap();
        ["c1", "c2", "r"]
            .iter()
            .all(|c| app(&stats, c)["rx_packets"].as_u64() >= Some(n))
    });
    assert_eq!(
        umem_frames(&s, "nic")["by_owner"],
        idle["by_owner"],
        "every frame the functions read came back"
    );
    let stats = s.stop();
    let nic = &app(&stats, "nic")["counters"];
    assert_eq!(
        nic["queue0_rx_packets"],
        app(&stats, "r")["rx_packets"],
        "only `output`'s frames: {nic}"
    );
    assert_eq!(nic["steered_packets"], 0, "{nic}");
    assert_eq!(nic["steered_function_packets"], 2 * n, "{nic}");
    for f in ["nf1", "nf2"] {
        let c = &app(&stats, f)["counters"];
        assert_eq!(c["steered_packets"], n, "{f}: {c}");
        assert_eq!(
            c["to_function"], 0,
            "{f}: nothing came through the engine: {c}"
        );
        assert_eq!(c["bad_descriptors"], 0, "{f}: {c}");
    }
    for (capture, port) in [("c1.pcap", 4789), ("c2.pcap", 4790), ("r.pcap", 5000)] {
        let seq: Vec<(u16, u64)> = numbered_datagrams(&file(capture));
        let want: Vec<(u16, u64)> = (0..n).map(|i| (port, i)).collect();
        assert_eq!(seq, want, "{capture}: each datagram once, in order");
    }
}

/// A steered function killed -9 under traffic: its port detaches, the interface reads its
/// sockets again from where the function's frames came back (so the frames it held are read
/// again, not leaked), and the restarted function is given them once more. Nothing vanishes
/// uncounted, nothing arrives twice or out of order, and the UMEM's frames are all back.
#[test]
fn a_steered_function_killed_falls_back_and_leaks_no_frame() {
    let h = host0_sending_into_stitch();
    let dir = tempfile::tempdir().unwrap();
    let s = Stitch::run(&steered_graph(&h, dir.path()));
    let steering =
        |s: &Stitch| steered_from(s, "nf1").is_string() && steered_from(s, "nf2").is_string();
    wait_until("both functions to read the interface's rings", 20, || {
        steering(&s)
    });
    let idle = umem_frames(&s, "nic");
    let first = pid_of(&s, "nf1").unwrap();
    let n = 20_000;
    let sender = three_ports_from_host0(&h, dir.path(), n);
    wait_until("nf1 to be well into the stream", 20, || {
        let stats = s.stats().unwrap();
        app(&stats, "nf1")["counters"]["steered_packets"].as_u64() > Some(n / 10)
    });
    // SAFETY: kill takes no pointers; `first` is the function process Stitch started.
    unsafe { libc::kill(first, libc::SIGKILL) };
    wait_until("nf1 to be restarted and steered to again", 20, || {
        pid_of(&s, "nf1").is_some_and(|p| p != first) && steering(&s)
    });
    let _ = sender.finish();
    wait_until("the stream to settle", 20, || {
        let stats = s.stats().unwrap();
        let settled = umem_frames(&s, "nic")["by_owner"] == idle["by_owner"];
        settled && app(&stats, "c2")["rx_packets"].as_u64() >= Some(n)
    });
    let stats = s.stop();
    let nic = &app(&stats, "nic")["counters"];
    let nf1 = &app(&stats, "nf1")["counters"];
    let counted = |c: &serde_json::Value, k: &str| c[k].as_u64().unwrap_or(0);
    assert_eq!(counted(nf1, "bad_descriptors"), 0, "{nf1}");
    assert_eq!(counted(nf1, "attaches"), 2, "{nf1}");
    let lost = counted(nic, "kernel_drops")
        + ["down_drops", "reclaimed_drops", "ring_full_drops"]
            .iter()
            .map(|k| counted(nf1, k))
            .sum::<u64>();
    let seq: Vec<u64> = numbered_datagrams(&dir.path().join("c1.pcap"))
        .iter()
        .map(|&(port, i)| {
            assert_eq!(port, 4789);
            i
        })
        .collect();
    assert!(
        seq.windows(2).all(|w| w[0] < w[1]),
        "each datagram at most once, in order"
    );
    assert!(
        seq.len() as u64 + lost >= n,
        "{} of {n} arrived, {lost} counted lost: none vanished uncounted ({nic}, {nf1})",
        seq.len()
    );
    eprintln!(
        "kill -9 of a steered function: {} of {n} arrived, {lost} counted lost, {} read again through the engine",
        seq.len(),
        counted(nic, "steered_packets")
    );
}

/// Rules added and removed under traffic (`stitch apply`) change in place: the new program
/// replaces the old one once its maps are filled, a port that stays keeps its socket and the
/// function reading it, a removed port's function gives back what it read before it lets go.
/// Everything a function gave back reaches its capture, nothing twice or out of order, and
/// the UMEM's frames are all back where they were.
#[test]
fn steering_rules_added_and_removed_under_traffic_lose_nothing_delivered() {
    let h = host0_sending_into_stitch();
    let dir = tempfile::tempdir().unwrap();
    let both = steered_graph(&h, dir.path());
    let one = both
        .replace("      - { match: \"udp dst port 4790\", to: to_nf2 }\n", "")
        .replace("  - \"nic.to_nf2 -> nf2.input\"\n", "");
    assert_ne!(one, both);
    let s = Stitch::run(&one);
    wait_until("nf1 to read the interface's rings", 20, || {
        steered_from(&s, "nf1").is_string()
    });
    let idle = umem_frames(&s, "nic");
    let n = 20_000;
    let sender = three_ports_from_host0(&h, dir.path(), n);
    for (graph, steered) in [(&both, true), (&one, false)] {
        std::thread::sleep(std::time::Duration::from_millis(300));
        s.apply(graph);
        wait_until("the new rules to steer", 20, || {
            steered_from(&s, "nf1").is_string() && steered_from(&s, "nf2").is_string() == steered
        });
    }
    let _ = sender.finish();
    wait_until("every frame back in place", 20, || {
        umem_frames(&s, "nic")["by_owner"] == idle["by_owner"]
    });
    let stats = s.stop();
    let nic = &app(&stats, "nic")["counters"];
    for (f, capture, port) in [("nf1", "c1.pcap", 4789), ("nf2", "c2.pcap", 4790)] {
        let c = &app(&stats, f)["counters"];
        assert_eq!(c["bad_descriptors"], 0, "{f}: {c}");
        let seq: Vec<u64> = numbered_datagrams(&dir.path().join(capture))
            .iter()
            .map(|&(p, i)| {
                assert_eq!(p, port, "{capture}");
                i
            })
            .collect();
        assert!(
            seq.windows(2).all(|w| w[0] < w[1]),
            "{capture}: once each, in order"
        );
        assert_eq!(
            c["from_function"].as_u64(),
            Some(seq.len() as u64),
            "{f}: everything its function gave back was delivered: {c}"
        );
        eprintln!("{f}: {} datagrams; {c}", seq.len());
    }
    // nf1's rule stayed: its stream went on through both changes.
    let nf1 = numbered_datagrams(&dir.path().join("c1.pcap")).len() as u64;
    let lost = nic["kernel_drops"].as_u64().unwrap() + nic["steer_removed_drops"].as_u64().unwrap();
    assert!(
        nf1 + lost >= n,
        "nf1: {nf1} of {n}, {lost} counted lost: {nic}"
    );
    assert!(app(&stats, "nf2")["counters"]["steered_packets"].as_u64() > Some(0));
    eprintln!("{nic}");
}

/// A steering rule that cannot work is refused at its line, with the reason: a filter that
/// does not compile, a port that is not its own, a key it does not take, a port no link
/// leaves from, a function that cannot read the interface's rings.
#[test]
fn bad_steering_rules_are_refused_at_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let isolated = "  f: { type: nf_port, mode: isolated }\n";
    for (rule, more_apps, more_links, reason) in [
        (
            "{ match: \"udp and dst port\", to: tunnel }",
            "",
            "",
            "g.yaml:5:5: app `nic` (af_xdp): steer rule 1",
        ),
        (
            "{ match: \"udp\", to: output }",
            "",
            "",
            "must name a port of its own",
        ),
        (
            "{ match: \"udp\", to: tunnel, queue: 3 }",
            "",
            "",
            "unknown key `queue`",
        ),
        (
            "{ match: \"udp\", to: tunnel }",
            "",
            "",
            "g.yaml:5:5: app `nic`: steer rule 1 sends to port `tunnel`, which no link leaves from",
        ),
        (
            "{ match: \"tcp\", to: t }, { match: \"udp\", to: tunnel }",
            isolated,
            ", \"nic.tunnel -> f.input\", \"nic.t -> f2.input\"",
            "g.yaml:5:5: app `nic`: steer rule 2 leads to function `f`, which is isolated",
        ),
    ] {
        let graph = dir.path().join("g.yaml");
        std::fs::write(
            &graph,
            format!("apps:\n  nic:\n    type: af_xdp\n    interface: lo\n    steer: [{rule}]\n  s: {{ type: sink }}\n  f2: {{ type: nf_port }}\n{more_apps}links: [\"nic.output -> s.input\"{more_links}]\n"),
        )
        .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
            .arg("check")
            .arg(&graph)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{rule} was taken");
        assert!(
            err.contains(reason) && err.contains("g.yaml:"),
            "{rule}: {err}"
        );
    }
}
