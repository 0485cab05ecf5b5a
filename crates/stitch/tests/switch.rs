//! The OpenFlow switch driven by a real OpenFlow client: `ovs-ofctl -O OpenFlow13` adds, dumps
//! and deletes flows and reads port and table statistics while generated traffic crosses it.

mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn count(s: &Stitch, app_name: &str) -> u64 {
    s.stats()
        .map(|st| {
            app(&st, app_name)["counters"]["packets"]
                .as_u64()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

/// Flows of every kind of match and instruction, as an operator types them into `ovs-ofctl`.
const OFCTL_FLOWS: &[&str] = &[
    "in_port=1,actions=output:2",
    "priority=40000,in_port=1,udp,tp_dst=53,actions=output:3",
    "table=1,priority=10,dl_vlan=10,actions=pop_vlan,output:2",
    "priority=5,ip,nw_src=10.0.0.0/8,nw_dst=192.0.2.1,actions=set_field:00:11:22:33:44:55->eth_dst,dec_ttl,output:3",
    "priority=6,dl_src=02:00:00:00:00:01,dl_type=0x0806,actions=CONTROLLER:128",
    "priority=7,tcp6,ipv6_dst=2001:db8::/32,tp_src=80,actions=write_actions(output:2),goto_table:2",
    "priority=8,in_port=2,actions=push_vlan:0x8100,set_field:4106->vlan_vid,output:1",
    "priority=9,metadata=0x5/0xff,actions=drop",
    "cookie=0x1234,priority=11,icmp,icmp_type=8,actions=meter:1,output:IN_PORT",
    "priority=12,arp,arp_tpa=10.0.0.1,arp_op=1,actions=output:ALL,group:1,FLOOD",
    "priority=13,mpls,mpls_label=100,actions=pop_mpls:0x0800,output:2",
    "priority=14,ip,nw_tos=32,nw_ecn=1,actions=set_field:10->ip_dscp,output:2",
    "priority=15,actions=CONTROLLER:65535,set_queue:3,clear_actions,write_metadata:0x1/0xff",
    "priority=17,vlan_tci=0x0000/0x1fff,actions=drop",
    "priority=18,tun_id=0x5,ipv6,ipv6_label=0x12345,actions=drop",
    "priority=19,icmp6,icmp_type=135,nd_target=fe80::1,actions=drop",
    "priority=20,dl_dst=01:00:00:00:00:00/01:00:00:00:00:00,actions=drop",
    "priority=21,sctp,tp_src=1,actions=set_field:10.0.0.1->ip_src,set_field:99->sctp_dst",
    "priority=24,ip,nw_dst=10.0.0.0/255.0.255.0,actions=drop",
    "priority=25,udp6,ipv6_src=2001:db8::1,tp_dst=53,actions=set_field:2001:db8::2->ipv6_dst,output:2",
    "priority=26,icmp,icmp_type=3,icmp_code=4,actions=drop",
    "priority=27,dl_type=0x88cc,actions=drop",
    "priority=28,ip,nw_proto=47,actions=drop",
    "priority=30,vlan_tci=0x1000/0x1000,actions=pop_vlan",
    "priority=31,arp,arp_sha=02:00:00:00:00:09,arp_spa=10.1.0.0/16,actions=drop",
    "table=3,priority=0,actions=drop",
    "priority=32,tcp,tp_dst=443,nw_src=192.0.2.0/24,actions=set_field:8080->tcp_dst,output:2",
    "priority=33,in_port=3,dl_type=0x0800,nw_proto=6,actions=drop",
];

/// `stitch show` writes each flow as `ovs-ofctl --no-stats dump-flows` writes it (read from
/// the same switch over OpenFlow): the same text, field for field, in the same order.
#[test]
fn stitch_show_writes_each_flow_as_ovs_ofctl_dumps_it() {
    require_root_and_tools(&["ovs-ofctl"]);
    let port = free_port();
    let s = Stitch::run(&format!(
        "apps:
  sw: {{ type: switch, ports: [p1, p2, p3], listen: \"127.0.0.1:{port}\" }}
"
    ));
    ofctl(
        port,
        &["add-meter", "meter=1,kbps,band=type=drop,rate=1000"],
    );
    ofctl(port, &["add-group", "group_id=1,type=all,bucket=output:2"]);
    for f in OFCTL_FLOWS {
        ofctl(port, &["add-flow", f]);
    }
    let mut theirs: Vec<String> = ofctl(port, &["--no-names", "--no-stats", "dump-flows"])
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| l.contains("actions="))
        .collect();
    let shown = show(&s, "sw");
    let mut ours: Vec<String> = shown["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["flow"].as_str().unwrap().to_string())
        .collect();
    theirs.sort();
    ours.sort();
    assert_eq!(theirs.len(), OFCTL_FLOWS.len(), "{theirs:#?}");
    assert_eq!(ours, theirs);
}

#[test]
fn ovs_ofctl_programs_the_switch_and_reads_its_statistics() {
    require_root_and_tools(&["ovs-ofctl"]);
    let port = free_port();
    let s = Stitch::run(&format!(
        "apps:
  gen: {{ type: generator, size: 100, rate: 2000, flows: 1 }}
  sw: {{ type: switch, ports: [p1, p2, p3], listen: \"127.0.0.1:{port}\" }}
  out2: {{ type: sink }}
  out3: {{ type: sink }}
links:
  - \"gen.output -> sw.p1\"
  - \"sw.p2 -> out2.input\"
  - \"sw.p3 -> out3.input\"
"
    ));
    // No flow: the table miss drops.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(count(&s, "out2") + count(&s, "out3"), 0);

    // Both with names (ovs-ofctl first asks for table features and port descriptions) and
    // without.
    let show = ofctl(port, &["show"]);
    assert!(show.contains("OFPT_FEATURES_REPLY"), "{show}");
    assert!(show.contains("p1") && show.contains("p3"), "{show}");
    ofctl(port, &["add-flow", "in_port=1,actions=output:2"]);
    wait_until("packets on port 2", 15, || count(&s, "out2") > 200);
    let flows = ofctl(port, &["--no-names", "dump-flows"]);
    assert!(flows.contains("in_port=1 actions=output:2"), "{flows}");
    let n: u64 = flows
        .split("n_packets=")
        .nth(1)
        .and_then(|x| x.split(',').next())
        .and_then(|x| x.parse().ok())
        .unwrap();
    assert!(n > 200, "{flows}");

    // A more specific flow above the default priority (32768) takes UDP to port 3.
    ofctl(
        port,
        &["add-flow", "priority=40000,in_port=1,udp,actions=output:3"],
    );
    let before = count(&s, "out2");
    wait_until("packets on port 3", 15, || count(&s, "out3") > 200);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        count(&s, "out2") - before < 50,
        "port 2 got little after the change"
    );

    let ports = ofctl(port, &["--no-names", "dump-ports"]);
    assert!(ports.contains("port  1: rx pkts="), "{ports}");
    let tables = ofctl(port, &["dump-tables"]);
    assert!(tables.contains("active=2"), "{tables}");

    // Delete the UDP flow (strict): traffic goes back to port 2; then delete everything.
    ofctl(
        port,
        &["--strict", "del-flows", "priority=40000,in_port=1,udp"],
    );
    let b2 = count(&s, "out2");
    wait_until("port 2 again", 15, || count(&s, "out2") > b2 + 200);
    ofctl(port, &["del-flows"]);
    let flows = ofctl(port, &["dump-flows"]);
    assert!(!flows.contains("actions"), "{flows}");

    // Bad requests get OpenFlow errors, the switch runs on.
    let bad = Command::new("ovs-ofctl")
        .args(["-O", "OpenFlow13", "add-flow"])
        .arg(format!("tcp:127.0.0.1:{port}"))
        .arg("table=100,actions=drop")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("OFPFMFC_BAD_TABLE_ID"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(s.stats().is_some());
    let stats = s.stop();
    assert!(
        app(&stats, "sw")["counters"]["table_miss_drops"]
            .as_u64()
            .unwrap()
            > 0
    );
}

/// An os-ken application (a learning switch: table miss to the controller, flood, learn,
/// install `in_port,eth_dst -> output`) programs the switch, which dials it; two network
/// namespaces then ping each other through Stitch.
#[test]
fn an_os_ken_learning_switch_connects_two_namespaces() {
    require_root_and_tools(&["python3", "ping"]);
    assert!(
        sh("python3 -c 'import os_ken'").status.success(),
        "os-ken is needed: scripts/install-deps installs it"
    );
    let hosts = TwoHosts::new();
    let port = free_port();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../switch/tests-controller/learning_switch.py");
    let controller = Background(
        Command::new("python3")
            .arg(&script)
            .arg(port.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_until("the controller listens", 15, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let s = Stitch::run(&format!(
        "apps:
  a: {{ type: af_packet, interface: {} }}
  b: {{ type: af_packet, interface: {} }}
  sw: {{ type: switch, ports: [p1, p2], controller: \"127.0.0.1:{port}\" }}
links:
  - \"a.output -> sw.p1\"
  - \"sw.p1 -> a.input\"
  - \"b.output -> sw.p2\"
  - \"sw.p2 -> b.input\"
",
        hosts.outer[0], hosts.outer[1]
    ));
    let t = Instant::now();
    loop {
        let o = hosts.exec(0, &format!("ping -c 1 -W 1 {}", hosts.ip[1]));
        if o.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no ping through the switch"
        );
    }
    let o = hosts.exec(0, &format!("ping -c 5 -i 0.2 -W 1 {}", hosts.ip[1]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    // The learned flows carry the pings now, without the controller.
    let (_, flows) = s.call("POST", "/api/v1/apps/sw/query", None);
    let learned: Vec<&serde_json::Value> = flows["flows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["priority"] == 1)
        .collect();
    assert!(learned.len() >= 2, "{flows}");
    assert!(
        learned.iter().any(|f| f["packets"].as_u64().unwrap() >= 4),
        "{flows}"
    );
    let stats = s.stop();
    assert!(
        app(&stats, "sw")["counters"]["packet_ins"]
            .as_u64()
            .unwrap()
            >= 2
    );
    controller.signal(libc::SIGTERM);
    let out = controller.finish();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("switch connected"), "{text}");
}

/// Sequence-numbered packets cross the switch while its rules flip, ten times, between point to
/// point (whole batches ring to ring) and per-packet lookups: every packet arrives, in order,
/// and the OpenFlow port counters count exactly the packets sent.
#[test]
fn switch_overs_lose_and_reorder_nothing() {
    require_root_and_tools(&["ovs-ofctl"]);
    const N: u32 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    write_sequence(&dir.path().join("seq.pcap"), N);
    let port = free_port();
    let s = Stitch::run_with(
        &format!(
            "apps:
  sw: {{ type: switch, ports: [p1, p2, p3], listen: \"127.0.0.1:{port}\" }}
  out: {{ type: pcap_sink, file: {}/out.pcap }}
links:
  - \"sw.p2 -> out.input\"
",
            dir.path().display()
        ),
        &["--keep-running"],
    );
    // The first rule is in place before the traffic starts (added through the API).
    ofctl(
        port,
        &["add-flow", "priority=100,in_port=1,actions=output:2"],
    );
    replay_while_flipping(&s, port, dir.path(), "p1", 1, 2);
    wait_for_sink(&s, N as u64, 15);
    assert_port_counts(port, 1, 2, N);
    let stats = s.stop();
    let c = &app(&stats, "sw")["counters"];
    let direct = c["point_to_point_packets"].as_u64().unwrap();
    assert!(
        direct > 0 && direct < N as u64,
        "both paths were taken: {c}"
    );
    assert_in_order(&dir.path().join("out.pcap"), N);
}

/// src → switch → f0 → switch → f1 → switch → out, with the point-to-point flows: `source`
/// is the YAML of app `src` (none: added later), `f0` and `f1` the modes of the two function
/// ports, `sink` the YAML of app `out`. Returns Stitch and the OpenFlow port.
fn chain_of_two_functions(
    nf: &std::path::Path,
    source: Option<&str>,
    f0: &str,
    f1: &str,
    sink: &str,
) -> (Stitch, u16) {
    let port = free_port();
    let (src_app, src_link) = match source {
        Some(spec) => (format!("  src: {spec}\n"), "  - \"src.output -> sw.src\"\n"),
        None => (String::new(), ""),
    };
    let s = Stitch::run_with(
        &format!(
            "apps:
{src_app}  sw: {{ type: switch, ports: [src, f0, f1, out], listen: \"127.0.0.1:{port}\" }}
  f0: {{ type: nf_port, socket: {nf}, mode: {f0} }}
  f1: {{ type: nf_port, socket: {nf}, mode: {f1} }}
  out: {sink}
links:
{src_link}  - \"sw.f0 -> f0.input\"
  - \"f0.output -> sw.f0\"
  - \"sw.f1 -> f1.input\"
  - \"f1.output -> sw.f1\"
  - \"sw.out -> out.input\"
",
            nf = nf.display(),
        ),
        &["--keep-running"],
    );
    chain_flows(port);
    (s, port)
}

/// The rules of a chain src → f0 → f1 → out on switch ports 1 to 4: each port to the next.
fn chain_flows(port: u16) {
    for flow in [
        "priority=100,in_port=1,actions=output:2",
        "priority=100,in_port=2,actions=output:3",
        "priority=100,in_port=3,actions=output:4",
    ] {
        ofctl(port, &["add-flow", flow]);
    }
}

/// A `stitch-nf-signature` process serving function port `port` on socket `nf`.
fn signature_function(nf: &std::path::Path, port: &str) -> Background {
    let sig =
        std::path::Path::new(env!("CARGO_BIN_EXE_stitch")).with_file_name("stitch-nf-signature");
    Background(
        Command::new(sig)
            .arg("--socket")
            .arg(nf)
            .arg(port)
            .spawn()
            .unwrap(),
    )
}

/// `n` UDP frames carrying their sequence number, 100 µs apart (paced replay: `n` / 10 ms).
fn write_sequence(path: &std::path::Path, n: u32) {
    write_sequence_apart(path, n, 100);
}

/// `n` UDP frames carrying their sequence number, `gap_us` apart.
fn write_sequence_apart(path: &std::path::Path, n: u32, gap_us: u64) {
    let f = std::fs::File::create(path).unwrap();
    let mut w = pcap_file::pcap::PcapWriter::new(f).unwrap();
    for i in 0..n {
        let mut frame = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 8, 0];
        let mut ip = vec![
            0x45, 0, 0, 32, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        let c = stitch_wire::checksum::checksum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        frame.extend_from_slice(&ip);
        frame.extend_from_slice(&[0x30, 0x39, 0x30, 0x39, 0, 12, 0, 0]);
        frame.extend_from_slice(&i.to_be_bytes());
        frame.resize(60, 0);
        let t = Duration::from_micros(gap_us * i as u64);
        w.write_packet(&pcap_file::pcap::PcapPacket::new(
            t,
            frame.len() as u32,
            &frame,
        ))
        .unwrap();
    }
}

/// The switch's OpenFlow counters (as `ovs-ofctl dump-ports` reads them): `n` packets
/// received on port `rx`, `n` sent on port `tx`.
fn assert_port_counts(port: u16, rx: u32, tx: u32, n: u32) {
    let ports = ofctl(port, &["--no-names", "dump-ports", &rx.to_string()]);
    assert!(ports.contains(&format!("rx pkts={n},")), "{ports}");
    let ports = ofctl(port, &["--no-names", "dump-ports", &tx.to_string()]);
    assert!(ports.contains(&format!("tx pkts={n},")), "{ports}");
}

/// Every sequence number from 0 to `n` - 1, in order.
fn assert_in_order(path: &std::path::Path, n: u32) {
    let mut r = pcap_file::pcap::PcapReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let mut next = 0u32;
    while let Some(p) = r.next_packet() {
        let p = p.unwrap();
        let seq = u32::from_be_bytes(p.data[42..46].try_into().unwrap());
        assert_eq!(seq, next, "packet {next} missing or out of order");
        next += 1;
    }
    assert_eq!(next, n);
}

/// Of `n` frames from f0 to f1 some took the direct channel and some the switch, and f1's port
/// counted as read from the channel what the switch counted as crossing it.
fn assert_both_paths_carried(stats: &serde_json::Value, n: u32) {
    let c = &app(stats, "sw")["counters"];
    let direct = c["direct_channel_packets"].as_u64().unwrap();
    assert!(
        direct > 0 && direct < n as u64,
        "both the channel and the switch carried frames: {c}"
    );
    assert_eq!(
        app(stats, "f1")["counters"]["direct_channel_packets"].as_u64(),
        Some(direct)
    );
}

/// Replays `dir`/seq.pcap into switch port `into` (a paced `pcap_source` added through the
/// API) while a more specific rule `in_port=IN,udp → output:OUT` is added and removed five
/// times, 150 ms apart: ten switch-overs under traffic.
fn replay_while_flipping(
    s: &Stitch,
    port: u16,
    dir: &std::path::Path,
    into: &str,
    in_port: u32,
    out: u32,
) {
    let src = format!(
        r#"{{"type": "pcap_source", "file": "{}/seq.pcap", "pace": true}}"#,
        dir.display()
    );
    assert_eq!(s.call("PUT", "/api/v1/apps/src", Some(&src)).0, 201);
    let link = format!(r#""src.output -> sw.{into}""#);
    assert_eq!(s.call("POST", "/api/v1/links", Some(&link)).0, 201);
    let rule = format!("priority=200,in_port={in_port},udp");
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(150));
        ofctl(port, &["add-flow", &format!("{rule},actions=output:{out}")]);
        std::thread::sleep(Duration::from_millis(150));
        ofctl(port, &["--strict", "del-flows", &rule]);
    }
}

/// Waits until the `out` sink has `n` packets.
fn wait_for_sink(s: &Stitch, n: u64, secs: u64) {
    let t = Instant::now();
    loop {
        let st = s.stats().unwrap();
        if app(&st, "out")["rx_packets"].as_u64() == Some(n) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "not every packet arrived: {}",
            serde_json::to_string_pretty(&st).unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Two function processes chained through the switch: while the rules make f0 -> f1 point to
/// point, the switch hands the pair a direct channel (f0 writes straight to f1); a rule that
/// breaks it takes the channel back. Ten switch-overs under a paced stream: every packet
/// arrives in order, both paths were taken, and the OpenFlow counters count every packet.
#[test]
fn function_processes_get_a_direct_channel_and_give_it_back_losing_nothing() {
    require_root_and_tools(&["ovs-ofctl"]);
    const N: u32 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    write_sequence(&dir.path().join("seq.pcap"), N);
    let nf = dir.path().join("nf.sock");
    let sink = format!(
        "{{ type: pcap_sink, file: {}/out.pcap }}",
        dir.path().display()
    );
    let (s, port) = chain_of_two_functions(
        &nf,
        None,
        "zero_copy, wake: polling",
        "zero_copy, wake: blocking",
        &sink,
    );
    let _functions = [signature_function(&nf, "f0"), signature_function(&nf, "f1")];
    let t = Instant::now();
    while ["f0", "f1"].iter().any(|f| {
        s.stats()
            .is_none_or(|st| app(&st, f)["counters"]["attached"].as_u64() != Some(1))
    }) {
        assert!(t.elapsed() < Duration::from_secs(10), "functions attach");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = Instant::now();
    while s
        .stats()
        .is_none_or(|st| app(&st, "sw")["counters"]["direct_channels"].as_u64() != Some(1))
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the switch gives f0 -> f1 a channel: {}",
            serde_json::to_string_pretty(&s.stats()).unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // `stitch show sw` lists it.
    let (code, shown) = s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
    assert_eq!(code, 200, "{shown}");
    let ch = &shown["direct_channels"][0];
    assert_eq!(
        (ch["from"].as_str(), ch["to"].as_str(), ch["phase"].as_str()),
        (Some("f0"), Some("f1"), Some("ReceiverReads")),
        "{shown}"
    );
    replay_while_flipping(&s, port, dir.path(), "src", 2, 3);
    wait_for_sink(&s, N as u64, 20);
    // Counts of a channel reach the switch within a tick.
    std::thread::sleep(Duration::from_millis(50));
    assert_port_counts(port, 2, 3, N);
    let stats = s.stop();
    assert_both_paths_carried(&stats, N);
    assert_in_order(&dir.path().join("out.pcap"), N);
}

/// Two VMs behind the switch (Stitch's virtio-net driver as each guest), `flows` added, once
/// the pair has its direct path: the folder, the switch's OpenFlow port, Stitch, guests A and
/// B, and how many frames A sent before the path.
struct VmPair {
    dir: tempfile::TempDir,
    port: u16,
    s: Stitch,
    a: stitch_vhost::frontend::Frontend,
    b: stitch_vhost::frontend::Frontend,
    warm: u32,
}

fn vm_pair(flows: &[&str]) -> VmPair {
    require_root_and_tools(&["ovs-ofctl"]);
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let s = Stitch::run(&switch_between_two_vm_ports(dir.path(), port));
    for flow in flows {
        ofctl(port, &["add-flow", flow]);
    }
    let (a, b, warm) = guests_on_a_direct_path(&s, dir.path(), |buf| numbered_frame(buf, u32::MAX));
    VmPair {
        dir,
        port,
        s,
        a,
        b,
        warm,
    }
}

/// Two VMs behind the switch (Stitch's own virtio-net driver on each vhost-user port, as a
/// guest's would be): with `in_port=1,actions=output:2` the switch gives A's port a direct
/// path into B's receive ring — A's worker copies each frame guest to guest. A more specific
/// rule added and removed five times under a stream takes the path back and gives it again.
/// Every frame arrives, once, in order; both ways carried frames; and the OpenFlow port
/// counters count every frame either way.
#[test]
fn vm_ports_get_a_direct_path_and_give_it_back_losing_nothing() {
    const N: u32 = 24_000;
    let VmPair {
        port,
        s,
        mut a,
        mut b,
        warm,
        ..
    } = vm_pair(&["priority=100,in_port=1,actions=output:2"]);
    let before = s.counter("sw", "direct_channel_packets").unwrap();
    let flips = std::thread::spawn(move || {
        let rule = "priority=200,in_port=1,udp";
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(150));
            ofctl(port, &["add-flow", &format!("{rule},actions=output:2")]);
            std::thread::sleep(Duration::from_millis(150));
            ofctl(port, &["--strict", "del-flows", rule]);
        }
    });
    let got = stream_numbered(&mut a, &mut b, N);
    flips.join().unwrap();
    if got.len() != N as usize {
        let st = s.stats().unwrap();
        let counters = |n: &str| app(&st, n)["counters"].to_string();
        let seen: std::collections::HashSet<u32> = got.iter().copied().collect();
        let missing: Vec<u32> = (0..N).filter(|i| !seen.contains(i)).take(40).collect();
        panic!(
            "every frame arrived: {} of {N}; missing {missing:?}\nsw {}\na {}\nb {}\nlinks {}",
            got.len(),
            counters("sw"),
            counters("a"),
            counters("b"),
            st["links"]
        );
    }
    assert!(
        got.iter().enumerate().all(|(i, &seq)| seq == i as u32),
        "once each, in order"
    );
    // Counts of the path reach the switch within a tick.
    std::thread::sleep(Duration::from_millis(50));
    assert_port_counts(port, 1, 2, N + warm);
    let stats = s.stop();
    let c = &app(&stats, "sw")["counters"];
    let direct = c["direct_channel_packets"].as_u64().unwrap() - before;
    assert!(
        direct > 0 && direct < N as u64,
        "both the direct path and the switch carried frames: {c}"
    );
    eprintln!("{direct} of {N} frames went guest to guest: {c}");
}

/// A receiving guest that goes away while a direct path copies into it, the two ports on
/// workers of their own: the path is taken back (its frames go through the switch, which drops
/// and counts what the absent guest cannot take), and once the guest is back the pair gets a
/// path again; what is sent after that arrives, once each, in order.
#[test]
fn a_vm_path_is_taken_back_when_the_receiving_guest_leaves_and_given_again() {
    require_root_and_tools(&["ovs-ofctl"]);
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let graph = switch_between_two_vm_ports(dir.path(), port)
        .replace(
            "a: { type: vhost_user,",
            "a: { worker: wa, type: vhost_user,",
        )
        .replace(
            "b: { type: vhost_user,",
            "b: { worker: wb, type: vhost_user,",
        );
    assert!(graph.contains("worker: wb"), "{graph}");
    let s = Stitch::run(&graph);
    ofctl(
        port,
        &["add-flow", "priority=100,in_port=1,actions=output:2"],
    );
    let (mut a, b, _) =
        guests_on_a_direct_path(&s, dir.path(), |buf| numbered_frame(buf, u32::MAX));
    drop(b);
    send_until_handed_back(&s, &mut a, "the path outlived its guest");
    // Sent while the guest is away: through the switch, dropped and counted.
    let mut away = 0;
    while away < 10 {
        away += a.send(1, |buf| numbered_frame(buf, u32::MAX));
    }
    let t = Instant::now();
    while s
        .stats()
        .is_none_or(|st| app(&st, "b")["counters"]["to_guest_no_buffer_drops"].as_u64() < Some(10))
    {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the guest's absence is counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Back: a new connection on the same port.
    let mut b = vm_guest(dir.path(), "b.sock");
    send_until_direct(&s, &mut a, &mut b, |buf| numbered_frame(buf, u32::MAX));
    const N: u32 = 2000;
    let got = stream_numbered(&mut a, &mut b, N);
    assert_eq!(got, (0..N).collect::<Vec<_>>(), "once each, in order");
}

/// The two VM ports of a direct path moved between workers by live applies while frames flow
/// — the sending port to a third worker, then the receiving one, then both back: the path
/// carries on (the sending port's state moves with it), what was sent arrives once each, in
/// order, and frames still go guest to guest after the last move.
#[test]
fn a_vm_path_carries_on_while_its_ports_move_between_workers() {
    require_root_and_tools(&["ovs-ofctl"]);
    const N: u32 = 24_000;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let on_workers = |wa: &str, wb: &str| {
        switch_between_two_vm_ports(dir.path(), port)
            .replace(
                "a: { type: vhost_user,",
                &format!("a: {{ worker: {wa}, type: vhost_user,"),
            )
            .replace(
                "b: { type: vhost_user,",
                &format!("b: {{ worker: {wb}, type: vhost_user,"),
            )
    };
    let s = Stitch::run(&on_workers("wa", "wb"));
    ofctl(
        port,
        &["add-flow", "priority=100,in_port=1,actions=output:2"],
    );
    let (mut a, mut b, warm) =
        guests_on_a_direct_path(&s, dir.path(), |buf| numbered_frame(buf, u32::MAX));
    let direct_packets = |s: &Stitch| s.counter("sw", "direct_channel_packets").unwrap();
    let got = std::thread::scope(|scope| {
        scope.spawn(|| {
            for (wa, wb) in [("wc", "wb"), ("wc", "wa"), ("wa", "wb")] {
                std::thread::sleep(Duration::from_millis(200));
                let said = s.apply(&on_workers(wa, wb));
                assert!(said.contains("moved: "), "{said}");
            }
        });
        stream_numbered(&mut a, &mut b, N)
    });
    assert_eq!(got.len(), N as usize, "every frame arrived");
    assert!(
        got.iter().enumerate().all(|(i, &seq)| seq == i as u32),
        "once each, in order"
    );
    // After the moves the path is still direct: every frame of a second stream takes it.
    let (_, q) = s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
    assert_eq!(q["direct_vm_paths"][0]["phase"], "Direct", "{q}");
    const M: u32 = 500;
    std::thread::sleep(Duration::from_millis(50));
    let before = direct_packets(&s);
    assert_eq!(
        stream_numbered(&mut a, &mut b, M),
        (0..M).collect::<Vec<_>>()
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(direct_packets(&s) - before, M as u64);
    // The OpenFlow statistics count every frame, whichever way it went.
    let all = N + M + warm;
    assert_port_counts(port, 1, 2, all);
    let flows = ofctl(port, &["--no-names", "dump-flows"]);
    assert!(flows.contains(&format!("n_packets={all},")), "{flows}");
    let tables = ofctl(port, &["dump-tables"]);
    assert!(
        tables.contains(&format!("lookup={all}, matched={all}")),
        "{tables}"
    );
}

/// Guests that break their rings while a direct path joins them. The receiving guest
/// scribbles on its receive descriptors: the sending port's copy finds it, stops that queue
/// (counted in the receiving port's `guest_faults`) and hands the path back — what A sends
/// then goes through the switch, which drops and counts what B's stopped queue cannot take —
/// while A's port carries on. Once B's guest sets its queues up again (a new connection) the
/// path comes back and a stream arrives whole, in order. Then the sending guest sends a frame
/// from beyond its memory: its own queue stops and is counted, B's port is untouched.
#[test]
fn guests_breaking_their_rings_on_a_direct_path_are_contained() {
    let VmPair {
        dir,
        s,
        mut a,
        mut b,
        ..
    } = vm_pair(&["priority=100,in_port=1,actions=output:2"]);
    let counter = |app_name: &str, c: &str| s.counter(app_name, c).unwrap_or(0);
    b.scribble_on_receive_descriptors();
    send_until_handed_back(&s, &mut a, "the path outlived the scribble");
    wait_until("B's fault is counted", 10, || {
        counter("b", "guest_faults") == 1
    });
    let dropped = counter("b", "to_guest_no_buffer_drops");
    for _ in 0..10 {
        assert_eq!(a.send(1, |buf| numbered_frame(buf, u32::MAX)), 1);
        std::thread::sleep(Duration::from_millis(5));
    }
    wait_until("what B cannot take is dropped and counted", 10, || {
        counter("b", "to_guest_no_buffer_drops") == dropped + 10
    });
    assert_eq!(counter("a", "guest_faults"), 0, "A's port is untouched");
    // B's guest sets its queues up again: the path comes back.
    drop(b);
    let mut b = vm_guest(dir.path(), "b.sock");
    send_until_direct(&s, &mut a, &mut b, |buf| numbered_frame(buf, u32::MAX));
    const N: u32 = 2000;
    assert_eq!(
        stream_numbered(&mut a, &mut b, N),
        (0..N).collect::<Vec<_>>()
    );
    // Now A's guest sends from beyond its memory: its own queue stops.
    assert!(a.send_wild_descriptor());
    wait_until("A's fault is counted", 10, || {
        counter("a", "guest_faults") == 1
    });
    assert_eq!(counter("b", "guest_faults"), 1, "B's port is untouched");
    assert_eq!(a.send(1, |buf| numbered_frame(buf, 0)), 1);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(b.receive(|_| {}), 0, "A's stopped queue is not read");
    s.stop();
}

/// A guest that goes away around a switch-over — 0 to 1.8 ms after the rule that makes the
/// pair point to point, the receiving guest and the sending one in turn, ten times; the offer
/// comes at the switch's next tick and the switch-over then takes tens of µs, so rounds fall
/// before, within and after it — wedges nothing: each time the guest is back the path is
/// given again, and a stream arrives whole and in order.
#[test]
fn a_guest_gone_mid_switch_over_wedges_nothing() {
    let rule = "priority=100,in_port=1";
    let VmPair {
        dir,
        port,
        s,
        mut a,
        mut b,
        ..
    } = vm_pair(&[&format!("{rule},actions=output:2")]);
    for k in 0..10u64 {
        ofctl(port, &["--strict", "del-flows", rule]);
        wait_until("the path is handed back", 10, || {
            vm_path_phase(&s) == "none"
        });
        ofctl(port, &["add-flow", &format!("{rule},actions=output:2")]);
        a.send(4, |buf| numbered_frame(buf, u32::MAX));
        std::thread::sleep(Duration::from_micros(k * 200));
        if k % 2 == 0 {
            drop(b);
            b = vm_guest(dir.path(), "b.sock");
        } else {
            drop(a);
            a = vm_guest(dir.path(), "a.sock");
        }
        send_until_direct(&s, &mut a, &mut b, |buf| numbered_frame(buf, u32::MAX));
        const N: u32 = 300;
        let got = stream_numbered(&mut a, &mut b, N);
        assert_eq!(got, (0..N).collect::<Vec<_>>(), "round {k}");
    }
    s.stop();
}

/// The two directions between two VMs are independent: A → B is point to point and gets a
/// direct path, B → A is not (a UDP flow above its port's flow) and goes through the switch;
/// each way's stream arrives whole and in order, and only A's took the path.
#[test]
fn a_vm_path_takes_one_direction_and_leaves_the_other_to_the_switch() {
    let VmPair {
        s, mut a, mut b, ..
    } = vm_pair(&[
        "priority=100,in_port=1,actions=output:2",
        "priority=100,in_port=2,actions=output:1",
        "priority=200,in_port=2,udp,actions=output:1",
    ]);
    let direct_packets = || s.counter("sw", "direct_channel_packets").unwrap();
    let before = direct_packets();
    const N: u32 = 1000;
    assert_eq!(
        stream_numbered(&mut a, &mut b, N),
        (0..N).collect::<Vec<_>>()
    );
    assert_eq!(
        stream_numbered(&mut b, &mut a, N),
        (0..N).collect::<Vec<_>>()
    );
    let (_, q) = s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
    let paths = q["direct_vm_paths"].as_array().unwrap();
    assert_eq!(paths.len(), 1, "{q}");
    assert_eq!(paths[0]["ports"], serde_json::json!([1, 2]), "{q}");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        direct_packets() - before,
        N as u64,
        "only A's frames took the path"
    );
}

/// A function killed (-9) while its direct channel carries traffic — the receiving one, then
/// the sending one: Stitch carries on, the channel is taken back and given again once a new
/// function attaches; then the sending port is removed from the graph. Once traffic stops no
/// pool buffer is left held.
#[test]
fn killing_a_function_on_a_direct_channel_leaks_nothing() {
    require_root_and_tools(&["ovs-ofctl"]);
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let (s, _) = chain_of_two_functions(
        &nf,
        Some("{ type: generator, size: 64, rate: 200000 }"),
        "zero_copy, wake: blocking",
        "zero_copy, wake: polling",
        "{ type: sink }",
    );
    let start = |p: &str| signature_function(&nf, p);
    let counter = |app_name: &str, c: &str| {
        s.stats()
            .and_then(|st| app(&st, app_name)["counters"][c].as_u64())
            .unwrap_or(0)
    };
    let wait_until = |what: &str, f: &dyn Fn() -> bool| {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{what}: {}",
                serde_json::to_string_pretty(&s.stats()).unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut f0 = start("f0");
    let mut f1 = start("f1");
    for victim in ["f1", "f0"] {
        let before = counter("f1", "direct_channel_packets");
        wait_until("traffic crosses the channel", &|| {
            counter("sw", "direct_channels") == 1
                && counter("f1", "direct_channel_packets") > before + 10_000
        });
        let detaches = counter(victim, "detaches");
        let f = if victim == "f1" { &mut f1 } else { &mut f0 };
        // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
        unsafe { libc::kill(f.0.id() as i32, libc::SIGKILL) };
        let _ = f.0.wait();
        wait_until("the port sees its function gone", &|| {
            counter(victim, "detaches") == detaches + 1
        });
        *f = start(victim);
    }
    wait_until("the channel is given again", &|| {
        counter("sw", "direct_channels") == 1
    });
    // The sending port itself removed from the graph while its packets are on the channel.
    let before = counter("f1", "direct_channel_packets");
    wait_until("traffic crosses the channel", &|| {
        counter("f1", "direct_channel_packets") > before + 10_000
    });
    // Stopped, the function holds what Stitch keeps handing it: its ring fills up, and what
    // does not fit waits in the link in front of it.
    // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
    unsafe { libc::kill(f0.0.id() as i32, libc::SIGSTOP) };
    let handed = std::cell::Cell::new(counter("f0", "to_function"));
    wait_until("the stopped function's ring fills", &|| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let now = counter("f0", "to_function");
        now == handed.replace(now)
    });
    assert_eq!(s.call("DELETE", "/api/v1/apps/f0", None).0, 200);
    wait_until("the channel is taken back", &|| {
        counter("sw", "direct_channels") == 0
    });
    // Traffic stops: every buffer comes back.
    assert_eq!(s.call("DELETE", "/api/v1/apps/src", None).0, 200);
    wait_until("no buffer held", &|| {
        s.stats()
            .is_some_and(|st| st["pool"]["in_use"].as_u64() == Some(0))
    });
    let stats = s.stop();
    assert_eq!(
        app(&stats, "f1")["counters"]["bad_descriptors"].as_u64(),
        Some(0)
    );
    // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
    unsafe { libc::kill(f0.0.id() as i32, libc::SIGKILL) };
}

/// An isolated (untrusted) function never shares memory with another: point-to-point rules
/// toward it keep its traffic in the switch, with no direct channel.
#[test]
fn an_isolated_function_gets_no_direct_channel() {
    require_root_and_tools(&["ovs-ofctl"]);
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let (s, _) = chain_of_two_functions(
        &nf,
        Some("{ type: generator, size: 64, rate: 50000 }"),
        "zero_copy, wake: blocking",
        "isolated, wake: blocking",
        "{ type: sink }",
    );
    let _functions = [signature_function(&nf, "f0"), signature_function(&nf, "f1")];
    let t = Instant::now();
    while s.stats().is_none_or(|st| {
        app(&st, "f1")["counters"]["from_function"]
            .as_u64()
            .unwrap_or(0)
            < 5000
    }) {
        assert!(t.elapsed() < Duration::from_secs(10), "traffic through f1");
        std::thread::sleep(Duration::from_millis(20));
    }
    let stats = s.stop();
    let c = &app(&stats, "sw")["counters"];
    assert_eq!(c["direct_channel_packets"].as_u64(), Some(0), "{c}");
    assert_eq!(c["direct_channels"].as_u64(), Some(0), "{c}");
    assert!(c["point_to_point_packets"].as_u64().unwrap() > 5000, "{c}");
}

/// `stitch bench chain-switch` end to end on the smallest chain: a function process attached,
/// flows programmed by ovs-ofctl, packets through, a switch-over measured.
#[test]
fn chain_switch_bench_carries_packets_through_a_function() {
    require_root_and_tools(&["ovs-ofctl"]);
    let sig =
        std::path::Path::new(env!("CARGO_BIN_EXE_stitch")).with_file_name("stitch-nf-signature");
    assert!(
        sig.exists(),
        "build the workspace first (scripts/test does): {}",
        sig.display()
    );
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args([
            "bench",
            "chain-switch",
            "--nfs",
            "1",
            "--bypass",
            "on",
            "--seconds",
            "0.5",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_else(|| panic!("no result row: {text}"));
    let mpps: f64 = row.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(mpps > 0.0, "{row}");
    assert!(row.contains("µs"), "switch-over measured: {row}");
}

/// src → f0 → f1 → out through the switch (OpenFlow ports 1 to 4, a rule from each to the
/// next), f0 and f1 guests running `stitch-nf-firewall` (forwarding all) on zero-copy ivshmem
/// rings and saying on their consoles how many ivshmem devices they see; `dir` holds seq.pcap
/// (numbered frames 500 µs apart: 2 kpps, what two TCG guests forward beside each other on two
/// shared cores) and out.pcap. One test of guests at a time.
struct TwoGuests {
    s: Stitch,
    port: u16,
    dir: tempfile::TempDir,
    _one: std::sync::MutexGuard<'static, ()>,
}

impl TwoGuests {
    /// `n` frames to replay; `f1_more`: more of f1's entry.
    fn start(n: u32, f1_more: &str) -> TwoGuests {
        TwoGuests::start_with(n, |image, run, _| {
            ivshmem_vm_app("f1", image, run, "zero_copy") + f1_more
        })
    }

    /// The same with `f1(image, run, dir)` the entry of f1.
    fn start_with(
        n: u32,
        f1: impl FnOnce(&std::path::Path, &str, &std::path::Path) -> String,
    ) -> TwoGuests {
        require_root_and_tools(&[
            "ovs-ofctl",
            "qemu-system-x86_64",
            "busybox",
            "cpio",
            "lspci",
        ]);
        let one = one_guest_test_at_a_time();
        let image = vm_image_with("vm-image-nf", &["stitch-nf-firewall"]);
        let dir = tempfile::tempdir().unwrap();
        write_sequence_apart(&dir.path().join("seq.pcap"), n, 500);
        let run = guest_watching_ivshmem("stitch-nf-firewall");
        let port = free_port();
        let s = Stitch::run_with(
            &format!(
                "apps:
  sw: {{ type: switch, ports: [src, f0, f1, out], listen: \"127.0.0.1:{port}\" }}
{f0}{f1}  out: {{ type: pcap_sink, file: {dir}/out.pcap }}
links:
  - \"sw.f0 -> f0.input\"
  - \"f0.output -> sw.f0\"
  - \"sw.f1 -> f1.input\"
  - \"f1.output -> sw.f1\"
  - \"sw.out -> out.input\"
",
                f0 = ivshmem_vm_app("f0", &image, &run, "zero_copy"),
                f1 = f1(&image, &run, dir.path()),
                dir = dir.path().display(),
            ),
            &["--keep-running"],
        );
        chain_flows(port);
        TwoGuests {
            s,
            port,
            dir,
            _one: one,
        }
    }

    /// Waits for the `n` frames at the sink and checks the OpenFlow port counters; stops the
    /// instance (`successor`, when one took it over); checks that both the channel and the
    /// switch carried frames and that every frame came once, in order. The final counters.
    fn finish(self, n: u32, successor: Option<common::upgrade::Successor>) -> serde_json::Value {
        wait_for_sink(&self.s, n as u64, 60);
        std::thread::sleep(Duration::from_millis(50));
        assert_port_counts(self.port, 2, 3, n);
        let TwoGuests { s, dir, .. } = self;
        let stats = match successor {
            Some(successor) => successor.stop(s),
            None => s.stop(),
        };
        assert_both_paths_carried(&stats, n);
        assert_in_order(&dir.path().join("out.pcap"), n);
        stats
    }

    /// Both guests' lspci lists the region, the packet memory and `channel` devices more (a
    /// guest looks every 200 ms; one look during a change may fail: each stage is waited for).
    fn guests_see(&self, channel: u32) -> bool {
        ["f0", "f1"]
            .iter()
            .all(|vm| ivshmem_devices_now(&self.s, vm) == Some(2 + channel))
    }

    /// Waits (`what`) until f0 → f1 is a direct channel that f1's function reads, plugged into
    /// both guests.
    fn channel_up(&self, what: &str, secs: u64) {
        let t = Instant::now();
        loop {
            let (_, shown) = self.s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
            let phase = &shown["direct_channels"][0]["phase"];
            if phase == "ReceiverReads" && self.guests_see(1) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "{what}: no direct channel between the guests ({phase}): {}\nf0's console:\n{}\nf1's:\n{}",
                serde_json::to_string_pretty(&self.s.stats()).unwrap(),
                console_of(&self.s, "f0"),
                console_of(&self.s, "f1")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Replays seq.pcap into switch port 1 (a paced `pcap_source` added through the API).
    fn replay(&self) {
        let src = format!(
            r#"{{"type": "pcap_source", "file": "{}/seq.pcap", "pace": true}}"#,
            self.dir.path().display()
        );
        assert_eq!(self.s.call("PUT", "/api/v1/apps/src", Some(&src)).0, 201);
        let link = r#""src.output -> sw.src""#;
        assert_eq!(self.s.call("POST", "/api/v1/links", Some(link)).0, 201);
    }
}

/// The pair's rule that makes f0 → f1 no longer point to point (a UDP rule above it).
const BREAKING_RULE: &str = "priority=200,in_port=2,udp";

/// Two guests' functions chained through the switch ([`TwoGuests`]). While the rules make
/// f0 → f1 point to point, the switch gives the pair a direct channel, hot-plugged into both
/// guests; a rule that breaks it takes the channel back, and its devices stay plugged for the
/// pair's next channel, which reuses them. Three times under a paced stream; then the channel
/// is taken back for good and its devices leave both guests. Every frame arrives once, in
/// order; both guests' `lspci` saw the channel's device come and go; the OpenFlow counters
/// count every frame.
#[test]
fn functions_in_two_guests_get_a_hot_plugged_direct_channel_and_give_it_back() {
    const N: u32 = 24_000;
    let g = TwoGuests::start(N, "");
    let (s, port) = (&g.s, g.port);
    g.channel_up("before the stream", 60);
    let handed_over = |round: &str| {
        // From the offer to the receiving guest reading, and from the end asked to the
        // channel retired.
        eprintln!(
            "{round}: channel handed over in {:?} µs, handed back in {:?} µs",
            s.counter("sw", "direct_handover_ns").map(|n| n / 1000),
            s.counter("sw", "direct_handback_ns").map(|n| n / 1000)
        );
    };
    handed_over("first (both devices hot-plugged)");
    g.replay();
    let break_pair = || {
        ofctl(
            port,
            &["add-flow", &format!("{BREAKING_RULE},actions=output:3")],
        );
        wait_until("the channel to be handed back", 20, || {
            s.counter("sw", "direct_channels") == Some(0)
        });
    };
    for round in 1..=3 {
        std::thread::sleep(Duration::from_millis(500));
        break_pair();
        ofctl(port, &["--strict", "del-flows", BREAKING_RULE]);
        g.channel_up(&format!("round {round}"), 60);
        for f in ["f0", "f1"] {
            assert_eq!(
                s.counter(f, "guest_channels_reused"),
                Some(round),
                "{f}'s guest got the pair's last channel's device again"
            );
        }
        handed_over(&format!("round {round} (devices reused)"));
    }
    std::thread::sleep(Duration::from_millis(500));
    break_pair();
    wait_until("the channel's devices to leave both guests", 40, || {
        g.guests_see(0)
    });
    let stats = g.finish(N, None);
    assert_eq!(
        app(&stats, "f0")["counters"]["guest_plug_refusals"].as_u64(),
        Some(0)
    );
}

/// The two guests' channel through an upgrade, under the paced stream: the channel goes back
/// to the switch first (no successor can take one over), the successor takes both guests'
/// functions over — each given the successor's packet memory, hot-plugged — removes what the
/// predecessor left in the guests (its packet memory, the channel's devices) and gives the pair
/// a channel of its own. Every frame arrives once, in order; neither function attaches again.
#[test]
fn functions_in_two_guests_get_a_channel_again_across_an_upgrade() {
    const N: u32 = 16_000;
    let g = TwoGuests::start(N, "");
    let s = &g.s;
    g.channel_up("before the stream", 60);
    g.replay();
    std::thread::sleep(Duration::from_secs(1));
    let (successor, report) = common::upgrade::upgrade(s);
    eprintln!("the upgrade: {report}");
    // Region, the successor's packet memory and its channel: 3 devices in each guest.
    g.channel_up("the successor's channel", 60);
    for f in ["f0", "f1"] {
        assert_eq!(s.counter(f, "attaches"), Some(1), "{f} attached again");
        assert_eq!(s.counter(f, "guest_plug_refusals"), Some(0));
    }
    g.finish(N, Some(successor));
}

/// f0 in a guest, f1 a function process on the host: the channel between them is plugged into
/// f0's guest only and sent to the process as a memfd; taken back and given again twice, it
/// reuses f0's device (and the same memory, sent to the process again). Every frame arrives
/// once, in order.
#[test]
fn a_guest_and_a_function_process_reuse_their_channel() {
    const N: u32 = 12_000;
    // Polling: nothing rings a doorbell from a guest.
    let g = TwoGuests::start_with(N, |_, _, dir| {
        format!(
            "  f1: {{ placement: process, command: [stitch-nf-firewall], mode: zero_copy, \
             wake: polling, socket: {}/nf.sock }}\n",
            dir.display()
        )
    });
    let (s, port) = (&g.s, g.port);
    let up = |what: &str| {
        let t = Instant::now();
        loop {
            let (_, shown) = s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
            if shown["direct_channels"][0]["phase"] == "ReceiverReads" {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{what}: {}\n{}\n{}",
                shown["direct_channels"],
                show(s, "f0"),
                show(s, "f1")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    up("a channel from the guest to the process");
    g.replay();
    for round in 1..=2 {
        std::thread::sleep(Duration::from_millis(500));
        ofctl(
            port,
            &["add-flow", &format!("{BREAKING_RULE},actions=output:3")],
        );
        wait_until("the channel to be handed back", 20, || {
            s.counter("sw", "direct_channels") == Some(0)
        });
        ofctl(port, &["--strict", "del-flows", BREAKING_RULE]);
        up(&format!("the channel again, round {round}"));
        assert_eq!(s.counter("f0", "guest_channels_reused"), Some(round));
        eprintln!(
            "round {round}: handed over in {:?} µs",
            s.counter("sw", "direct_handover_ns").map(|n| n / 1000)
        );
    }
    assert_eq!(
        ivshmem_devices_now(s, "f0"),
        Some(3),
        "{}",
        console_of(s, "f0")
    );
    g.finish(N, None);
}

/// The same two guests, f1's with every PCI slot but two taken (27 more devices on the
/// command line): QEMU plugs its region and packet memory, then refuses the direct channel.
/// The refusal is counted on f1's port, f0's half of the channel is unplugged again, no
/// channel is offered again for a while, and the stream goes whole and in order through the
/// switch, both guests' functions forwarding it.
#[test]
fn a_guest_out_of_pci_slots_keeps_its_traffic_on_the_switch() {
    const N: u32 = 6_000;
    let fillers = vec!["-device, virtio-rng-pci"; 27].join(", ");
    let g = TwoGuests::start(N, &format!("    qemu_args: [{fillers}]\n"));
    let (s, port) = (&g.s, g.port);
    wait_until("f1's guest to refuse the channel", 60, || {
        s.counter("f1", "guest_plug_refusals") >= Some(1)
    });
    let refused = Instant::now();
    assert_eq!(
        s.counter("f1", "attached"),
        Some(1),
        "f1's function runs on"
    );
    wait_until("f0's half of the channel to be unplugged", 20, || {
        ivshmem_devices_now(s, "f0") == Some(2)
    });
    g.replay();
    wait_for_sink(s, N as u64, 60);
    assert_port_counts(port, 2, 3, N);
    // Offered again every 10 s at most, not at every breath.
    let offers = 1 + refused.elapsed().as_secs() / 10;
    assert!(
        s.counter("f1", "guest_plug_refusals") <= Some(offers),
        "{:?} refusals in {:?}",
        s.counter("f1", "guest_plug_refusals"),
        refused.elapsed()
    );
    let TwoGuests { s, dir, .. } = g;
    let (stats, log) = s.stop_with_log();
    assert_eq!(
        app(&stats, "sw")["counters"]["direct_channel_packets"].as_u64(),
        Some(0)
    );
    assert!(
        log.contains("no direct channel into its guest") && log.contains("all in use"),
        "{log}"
    );
    assert_in_order(&dir.path().join("out.pcap"), N);
}

/// The same two guests; three times, the pair's rule is given back (a channel is offered and
/// plugged into both guests) and f1's QEMU is killed -9 from 0 to 200 ms later — before,
/// during or after the plugging. Each time f0's function stays attached, f1's VM is started
/// again and its function attaches, a new channel comes up between them; f0's guest ends with
/// only the devices it uses (the dead channels' went); then a stream crosses both, whole and in
/// order.
#[test]
fn a_guest_killed_mid_switch_over_wedges_nothing() {
    const N: u32 = 4_000;
    let g = TwoGuests::start(N, "");
    let (s, port) = (&g.s, g.port);
    g.channel_up("a channel between the guests", 90);
    for (round, delay_ms) in [0u64, 60, 200].into_iter().enumerate() {
        ofctl(
            port,
            &["add-flow", &format!("{BREAKING_RULE},actions=output:3")],
        );
        wait_until("the channel to be handed back", 20, || {
            s.counter("sw", "direct_channels") == Some(0)
        });
        let qemu = pid_of(s, "f1").unwrap();
        ofctl(port, &["--strict", "del-flows", BREAKING_RULE]);
        std::thread::sleep(Duration::from_millis(delay_ms));
        sh(&format!("kill -9 {qemu}"));
        wait_until("f1's VM to be started again", 30, || {
            pid_of(s, "f1").is_some_and(|p| p != qemu)
        });
        g.channel_up(&format!("a channel again after round {round}"), 90);
    }
    assert_eq!(
        s.counter("f0", "attaches"),
        Some(1),
        "f0's function never left"
    );
    assert_eq!(s.counter("f1", "attaches"), Some(4));
    g.replay();
    wait_for_sink(s, N as u64, 60);
    assert_eq!(
        ivshmem_devices_now(s, "f0"),
        Some(3),
        "{}",
        console_of(s, "f0")
    );
    let TwoGuests { s, dir, .. } = g;
    s.stop();
    assert_in_order(&dir.path().join("out.pcap"), N);
}
