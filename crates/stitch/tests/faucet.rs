//! Faucet, a production OpenFlow controller, runs a Stitch switch whose ports are veth pairs to
//! four network namespaces: two VLANs, hosts learning and pinging within each, Faucet's
//! inter-VLAN routing carrying ping and iperf3 TCP between them, and an ACL blocking one TCP
//! port; and two VMs' vhost-user ports that Faucet patches to each other and back, which get
//! a direct path guest to guest while patched. Faucet (pinned, in its own virtualenv:
//! scripts/requirements-faucet.txt) programs its whole multi-table pipeline; the tests fail if
//! it logs an error about the datapath.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn faucet_venv() -> PathBuf {
    PathBuf::from(
        std::env::var("STITCH_FAUCET_VENV").unwrap_or_else(|_| "/opt/stitch/faucet-venv".into()),
    )
}

/// Four namespaces, each with a veth to the root namespace; removed on drop.
struct Hosts {
    tag: String,
}

impl Hosts {
    fn new(addresses: &[(&str, &str)]) -> Hosts {
        let tag = format!("fc{}", std::process::id() % 100_000);
        let hosts = Hosts { tag };
        for (i, (addr, gw)) in addresses.iter().enumerate() {
            let (ns, outer) = (hosts.ns(i), hosts.outer(i));
            must(&format!("ip netns add {ns}"));
            must(&format!(
                "ip link add {outer} type veth peer name eth0 netns {ns}"
            ));
            must(&format!("ip link set {outer} up"));
            // Faucet's routing carries TCP: no offloads, so every frame is whole.
            sh(&format!("ethtool -K {outer} tx off tso off gso off"));
            must(&format!("ip netns exec {ns} ip link set lo up"));
            must(&format!("ip netns exec {ns} ip link set eth0 up"));
            sh(&format!(
                "ip netns exec {ns} ethtool -K eth0 tx off tso off gso off"
            ));
            must(&format!("ip netns exec {ns} ip addr add {addr} dev eth0"));
            must(&format!("ip netns exec {ns} ip route add default via {gw}"));
        }
        hosts
    }

    fn ns(&self, i: usize) -> String {
        format!("{}h{}", self.tag, i + 1)
    }

    fn outer(&self, i: usize) -> String {
        format!("{}s{}", self.tag, i + 1)
    }

    fn exec(&self, i: usize, cmd: &str) -> std::process::Output {
        sh(&format!("ip netns exec {} {cmd}", self.ns(i)))
    }

    fn ping(&self, i: usize, to: &str) -> bool {
        self.exec(i, &format!("ping -c 1 -W 1 {to}"))
            .status
            .success()
    }

    /// Pings until one answer comes (learning, ARP and route resolution take a moment).
    fn reach(&self, i: usize, to: &str, secs: u64) {
        let t = Instant::now();
        while !self.ping(i, to) {
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "host {} cannot reach {to} through Faucet's pipeline on Stitch",
                i + 1
            );
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..4 {
            // Servers started in a namespace outlive it unless stopped.
            sh(&format!("ip netns pids {} | xargs -r kill", self.ns(i)));
            sh(&format!("ip netns del {}", self.ns(i)));
            sh(&format!("ip link del {}", self.outer(i)));
        }
    }
}

const FAUCET_YAML: &str = "
vlans:
  office:
    vid: 100
    faucet_vips: [\"10.0.100.254/24\"]
  guest:
    vid: 200
    faucet_vips: [\"10.0.200.254/24\"]
routers:
  router-1:
    vlans: [office, guest]
acls:
  no-5001:
    - rule: {dl_type: 0x800, nw_proto: 6, tcp_dst: 5001, actions: {allow: 0}}
    - rule: {actions: {allow: 1}}
dps:
  sw1:
    dp_id: 0x1
    hardware: \"Open vSwitch\"
    interfaces:
      1: {native_vlan: office, acl_in: no-5001}
      2: {native_vlan: office}
      3: {native_vlan: guest}
      4: {native_vlan: guest}
";

fn start_faucet(dir: &Path, of_port: u16) -> Background {
    start_faucet_with(dir, of_port, FAUCET_YAML)
}

/// Faucet with `config`, checked first, listening for switches on `of_port`.
fn start_faucet_with(dir: &Path, of_port: u16, config: &str) -> Background {
    start_faucet_with_args(dir, of_port, config, &[])
}

/// The same with more of os-ken's options (`--ryu-…`).
fn start_faucet_with_args(dir: &Path, of_port: u16, config: &str, more: &[String]) -> Background {
    let venv = faucet_venv();
    assert!(
        venv.join("bin/faucet").exists(),
        "Faucet is needed in {}: scripts/install-deps installs it",
        venv.display()
    );
    std::fs::write(dir.join("faucet.yaml"), config).unwrap();
    let check = Command::new(venv.join("bin/check_faucet_config"))
        .arg(dir.join("faucet.yaml"))
        .output()
        .unwrap();
    assert!(check.status.success(), "{check:?}");
    let path = format!(
        "{}:{}",
        venv.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Background(
        Command::new(venv.join("bin/faucet"))
            .args(["--ryu-ofp-listen-host", "127.0.0.1"])
            .args(["--ryu-ofp-tcp-listen-port", &of_port.to_string()])
            .args(more)
            // faucet starts os-ken's manager from PATH.
            .env("PATH", path)
            .env("FAUCET_CONFIG", dir.join("faucet.yaml"))
            .env("FAUCET_LOG", dir.join("faucet.log"))
            .env("FAUCET_EXCEPTION_LOG", dir.join("faucet_exception.log"))
            .env("FAUCET_PROMETHEUS_ADDR", "127.0.0.1")
            .env("FAUCET_PROMETHEUS_PORT", free_port().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Faucet's errors about the datapath. Faucet answers the handshake's port description by
/// fabricating port-up events before os-ken has registered the datapath, and logs
/// "send_flow_msgs: DP not up" for them — with any switch whose ports are up at connection,
/// Open vSwitch included (docs/openflow.md); the cold start that follows installs everything.
/// (A reload that changes Faucet's tables drops the connection on purpose — "forcing DP
/// reconnection" — so each such reload has one too.) That line before a cold start is not an
/// error of the switch; anything else is.
fn datapath_errors(log: &str) -> Vec<&str> {
    let last_cold_start = log.rfind("Cold start configuring DP").unwrap_or(0);
    let mut at = 0;
    log.lines()
        .filter(|l| {
            let start = at;
            at += l.len() + 1;
            (l.contains(" ERROR ") || l.contains(" CRITICAL "))
                && !(start < last_cold_start && l.contains("send_flow_msgs: DP not up"))
        })
        .collect()
}

#[test]
fn faucet_routes_between_vlans_and_enforces_an_acl_on_a_stitch_switch() {
    require_root_and_tools(&["ping", "iperf3", "ethtool"]);
    let hosts = Hosts::new(&[
        ("10.0.100.1/24", "10.0.100.254"),
        ("10.0.100.2/24", "10.0.100.254"),
        ("10.0.200.3/24", "10.0.200.254"),
        ("10.0.200.4/24", "10.0.200.254"),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let of_port = free_port();
    let faucet = start_faucet(dir.path(), of_port);
    wait_until("Faucet listens", 30, || {
        std::net::TcpStream::connect(("127.0.0.1", of_port)).is_ok()
    });
    let apps: String = (0..4)
        .map(|i| {
            format!(
                "  p{}: {{ type: af_packet, interface: {} }}\n",
                i + 1,
                hosts.outer(i)
            )
        })
        .collect();
    let links: String = (1..=4)
        .map(|i| format!("  - \"p{i}.output -> sw.port{i}\"\n  - \"sw.port{i} -> p{i}.input\"\n"))
        .collect();
    let s = Stitch::run(&format!(
        "apps:\n{apps}  sw: {{ type: switch, ports: [port1, port2, port3, port4], \
         controller: \"127.0.0.1:{of_port}\", datapath_id: 1 }}\nlinks:\n{links}"
    ));

    // Within a VLAN: learning.
    hosts.reach(0, "10.0.100.2", 30);
    hosts.reach(2, "10.0.200.4", 30);
    // Faucet's router address, then across VLANs: routing in the switch's pipeline.
    hosts.reach(0, "10.0.100.254", 30);
    hosts.reach(0, "10.0.200.3", 30);
    hosts.reach(3, "10.0.100.2", 30);
    let o = hosts.exec(1, "ping -c 5 -i 0.2 -W 1 10.0.200.4");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));

    // TCP across VLANs with iperf3: the routed flow carries data both ways.
    let _server = hosts.exec(2, "iperf3 -s -D -p 5201");
    let _blocked_server = hosts.exec(2, "iperf3 -s -D -p 5001");
    wait_until("iperf3 listens", 10, || {
        hosts
            .exec(2, "ss -ltn")
            .stdout
            .windows(5)
            .any(|w| w == b":5001")
    });
    let o = hosts.exec(0, "iperf3 -c 10.0.200.3 -p 5201 -t 2 -J");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let received = report["end"]["sum_received"]["bytes"].as_u64().unwrap();
    assert!(received > 1_000_000, "{received} bytes routed");

    // The ACL on port 1 drops TCP to port 5001; host 2 (no ACL) gets through.
    let o = hosts.exec(
        0,
        "timeout 10 iperf3 -c 10.0.200.3 -p 5001 -t 1 --connect-timeout 2000",
    );
    assert!(!o.status.success(), "the ACL let TCP 5001 through");
    let o = hosts.exec(1, "iperf3 -c 10.0.200.3 -p 5001 -t 1 -J");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));

    // The pipeline is Faucet's: several tables in use, counted.
    let (_, q) = s.call("POST", "/api/v1/apps/sw/query", None);
    let tables: std::collections::BTreeSet<u64> = q["flows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["table"].as_u64().unwrap())
        .collect();
    assert!(tables.len() >= 5, "tables in use: {tables:?}");
    s.stop();
    faucet.signal(libc::SIGTERM);
    let log = std::fs::read_to_string(dir.path().join("faucet.log")).unwrap_or_default();
    assert!(log.contains("Cold start configuring DP"), "{log}");
    let errors = datapath_errors(&log);
    assert!(errors.is_empty(), "Faucet logged errors: {errors:#?}");
    let exceptions =
        std::fs::read_to_string(dir.path().join("faucet_exception.log")).unwrap_or_default();
    assert!(exceptions.trim().is_empty(), "{exceptions}");
}

/// Faucet's configuration for two VM ports on one VLAN, port 1 patched straight to port 2 by
/// an ACL when `patched` (Faucet's way of wiring two ports point to point).
fn two_vm_ports(patched: bool) -> String {
    let acl = if patched { ", acl_in: patch" } else { "" };
    format!(
        "vlans:
  vms: {{ vid: 100 }}
acls:
  patch:
    - rule: {{ actions: {{ output: {{ port: 2 }} }} }}
dps:
  sw1:
    dp_id: 0x1
    hardware: \"Open vSwitch\"
    interfaces:
      1: {{ native_vlan: vms{acl} }}
      2: {{ native_vlan: vms }}
"
    )
}

/// Two VMs behind a Stitch switch run by Faucet: while Faucet patches port 1 to port 2 with an
/// ACL and unpatches it (its configuration changed and reloaded, three times each way), a
/// numbered stream from guest A reaches guest B in order, never twice — over a direct path
/// guest to guest when patched, through Faucet's learning pipeline when not. Each reload
/// changes Faucet's tables, so Faucet cold-starts: it drops the connection and deletes every
/// flow before writing the new ones; frames sent in between meet an empty table and are
/// counted as table misses. Nothing else is lost but frames B's ring had no room for (its reader
/// behind on a busy machine: counted too), and the OpenFlow port statistics count what A sent
/// and what B received.
#[test]
fn faucet_patching_two_vm_ports_gives_them_a_direct_path_and_takes_it_back() {
    require_root_and_tools(&["ovs-ofctl"]);
    let dir = tempfile::tempdir().unwrap();
    let (of_port, listen) = (free_port(), free_port());
    let faucet = start_faucet_with(dir.path(), of_port, &two_vm_ports(true));
    wait_until("Faucet listens", 30, || {
        std::net::TcpStream::connect(("127.0.0.1", of_port)).is_ok()
    });
    let s = Stitch::run(&switch_between_two_vm_ports(dir.path(), listen).replace(
        "listen:",
        &format!("controller: \"127.0.0.1:{of_port}\", datapath_id: 1, listen:"),
    ));
    let (mut a, mut b, warm) =
        guests_on_a_direct_path(&s, dir.path(), |buf| numbered_frame(buf, u32::MAX));
    let counter = |name: &str| s.counter("sw", name).unwrap();
    let full_ring = || s.counter("b", "to_guest_no_buffer_drops").unwrap();
    let (misses, direct, refused) = (
        counter("table_miss_drops"),
        counter("direct_channel_packets"),
        full_ring(),
    );
    let config = dir.path().join("faucet.yaml");
    let toggled = std::sync::atomic::AtomicBool::new(false);
    let (sent, got) = std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..3 {
                for patched in [false, true] {
                    std::thread::sleep(Duration::from_millis(300));
                    std::fs::write(&config, two_vm_ports(patched)).unwrap();
                    faucet.signal(libc::SIGHUP);
                    wait_until("Faucet's change reaches the path", 20, || {
                        (vm_path_phase(&s) == "Direct") == patched
                    });
                }
            }
            std::thread::sleep(Duration::from_millis(300));
            toggled.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        // No window: what Faucet's emptied tables drop never arrives, and B's full ring is
        // counted below.
        stream_numbered_while(&mut a, &mut b, u32::MAX, |_| {
            !toggled.load(std::sync::atomic::Ordering::Relaxed)
        })
    });
    let mut last = None;
    for (i, &seq) in got.iter().enumerate() {
        assert!(
            last < Some(seq),
            "frame {seq} arrived after {last:?} (the {i}th)"
        );
        last = Some(seq);
    }
    // The data path adds what it counted to the switch's counters between breaths: on a busy
    // machine that may come a while after the last frame.
    let lost = sent as u64 - got.len() as u64;
    let counted = || counter("table_miss_drops") - misses + full_ring() - refused;
    let since = std::time::Instant::now();
    while counted() < lost && since.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (counted, direct, refused) = (
        counted(),
        counter("direct_channel_packets") - direct,
        full_ring() - refused,
    );
    assert_eq!(
        lost,
        counted,
        "what did not arrive met Faucet's emptied tables or B's full ring: {}",
        s.stats().unwrap()
    );
    assert!(
        direct > 0 && direct < got.len() as u64,
        "both the direct path and Faucet's pipeline carried frames ({direct} of {})",
        got.len()
    );
    let rx = ofctl(listen, &["--no-names", "dump-ports", "1"]);
    assert!(rx.contains(&format!("rx pkts={},", sent + warm)), "{rx}");
    // Sent out of port 2: what B took and what its full ring refused.
    let tx = ofctl(listen, &["--no-names", "dump-ports", "2"]);
    assert!(
        tx.contains(&format!(
            "tx pkts={},",
            got.len() as u32 + refused as u32 + warm
        )),
        "{tx}"
    );
    eprintln!(
        "{} of {sent} frames arrived, {direct} guest to guest, {misses} met emptied tables",
        got.len()
    );
    s.stop();
    faucet.signal(libc::SIGTERM);
    let log = std::fs::read_to_string(dir.path().join("faucet.log")).unwrap_or_default();
    assert_eq!(log.matches("Cold start configuring DP").count(), 7, "{log}");
    let errors = datapath_errors(&log);
    assert!(errors.is_empty(), "Faucet logged errors: {errors:#?}");
    let exceptions =
        std::fs::read_to_string(dir.path().join("faucet_exception.log")).unwrap_or_default();
    assert!(exceptions.trim().is_empty(), "{exceptions}");
}

/// Faucet as a TLS controller (os-ken's `--ctl-privkey`, `--ctl-cert`, `--ca-certs`: switches
/// must show a certificate its CA signed): a switch dialling it over `ssl:` with a certificate
/// of that CA is programmed; one with a certificate of another CA is not.
#[test]
fn faucet_over_tls_programs_a_switch_whose_certificate_its_ca_signed() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path(), "ca", &["faucet", "sw"]);
    pki(dir.path(), "rogue-ca", &["rogue"]);
    let p = |f: &str| dir.path().join(f).display().to_string();
    let (tcp_port, ssl_port) = (free_port(), free_port());
    let config = "
vlans:
  office: { vid: 100 }
dps:
  sw1:
    dp_id: 0x1
    hardware: \"Open vSwitch\"
    interfaces:
      1: {native_vlan: office}
      2: {native_vlan: office}
  sw2:
    dp_id: 0x2
    hardware: \"Open vSwitch\"
    interfaces:
      1: {native_vlan: office}
      2: {native_vlan: office}
";
    let tls_args = [
        "--ryu-ofp-ssl-listen-port".to_string(),
        ssl_port.to_string(),
        "--ryu-ctl-privkey".to_string(),
        p("faucet.key"),
        "--ryu-ctl-cert".to_string(),
        p("faucet.crt"),
        "--ryu-ca-certs".to_string(),
        p("ca.crt"),
    ];
    let _faucet = start_faucet_with_args(dir.path(), tcp_port, config, &tls_args);
    wait_until("Faucet listens for TLS", 30, || {
        std::net::TcpStream::connect(("127.0.0.1", ssl_port)).is_ok()
    });
    let switch = |name: &str, dpid: u32, who: &str| {
        format!(
            "  {name}: {{ type: switch, ports: [a, b], datapath_id: {dpid}, controller: \"ssl:127.0.0.1:{ssl_port}\", cert: {}, key: {}, ca: {} }}\n",
            p(&format!("{who}.crt")),
            p(&format!("{who}.key")),
            p("ca.crt")
        )
    };
    let s = Stitch::run(&format!(
        "apps:\n{}{}  x: {{ type: sink }}\n",
        switch("sw1", 1, "sw"),
        switch("sw2", 2, "rogue")
    ));
    let flows = |name: &str| {
        show(&s, name)["flows"]
            .as_array()
            .map(Vec::len)
            .unwrap_or(0)
    };
    wait_until("Faucet to program the switch over TLS", 30, || {
        flows("sw1") > 0
    });
    // The rogue switch had as long, and more.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(flows("sw2"), 0, "{}", show(&s, "sw2"));
    assert_eq!(show(&s, "sw2")["controllers"], 0);
    s.stop();
}
