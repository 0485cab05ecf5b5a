//! `vhost_user` against DPDK's virtio-user front-end (`dpdk-testpmd --vdev
//! net_virtio_user0,path=SOCK`): the guest's side is a real virtio driver, no VM needed.

mod common;
use common::testpmd::Testpmd;
use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

/// testpmd polls a core flat out: one test with it at a time on a 2-core machine.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Stitch running `vm`, a vhost_user port on a socket in a fresh folder (with `settings`
/// added to its entry), into a sink `out`.
fn port_into_sink(settings: &str) -> (tempfile::TempDir, std::path::PathBuf, Stitch) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let s = Stitch::run(&format!(
        "apps:\n  vm: {{ type: vhost_user, socket: {}{settings} }}\n  out: {{ type: sink }}\nlinks:\n  - \"vm.output -> out.input\"\n",
        sock.display()
    ));
    (dir, sock, s)
}

fn counter(stats: &serde_json::Value, app_name: &str, c: &str) -> u64 {
    app(stats, app_name)["counters"][c].as_u64().unwrap_or(0)
}

fn wait_connected(s: &Stitch) {
    wait_until("the virtio-user front-end sets up its rings", 20, || {
        let (_, v) = s.call("POST", "/api/v1/apps/vm/query", Some("{}"));
        v["queues"]
            .as_array()
            .map(|q| q.iter().all(|q| q["ready"] == true))
            .unwrap_or(false)
    });
    // testpmd sets its port up more than once while starting (stop, start); what reaches a
    // ring it then resets is gone. Let it settle before counting.
    std::thread::sleep(Duration::from_millis(1500));
}

#[test]
fn testpmd_txonly_every_packet_it_sends_arrives() {
    require_root_and_tools(&["dpdk-testpmd"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, sock, s) = port_into_sink("");
    let t = Testpmd::start(&sock, "txonly", "tx");
    wait_connected(&s);
    std::thread::sleep(Duration::from_secs(2));
    let (_, sent) = t.stop();
    std::thread::sleep(Duration::from_millis(300));
    let stats = s.stop();
    assert!(sent > 10_000, "testpmd sent {sent}");
    assert_eq!(
        link(&stats, "vm.output -> out.input")["tx_packets"]
            .as_u64()
            .unwrap(),
        sent,
        "every packet testpmd counted as sent came out of the port"
    );
    assert_eq!(counter(&stats, "vm", "guest_faults"), 0);
    assert_eq!(counter(&stats, "vm", "from_guest_malformed_drops"), 0);
}

#[test]
fn testpmd_rxonly_counts_what_the_port_delivers() {
    require_root_and_tools(&["dpdk-testpmd"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let base = format!(
        "apps:\n  vm: {{ type: vhost_user, socket: {} }}\n  out: {{ type: sink }}\n",
        sock.display()
    );
    // Kept running: the graph would end when the generator is done.
    let s = Stitch::run_with(
        &format!("{base}links:\n  - \"vm.output -> out.input\"\n"),
        &["--keep-running"],
    );
    let t = Testpmd::start(&sock, "rxonly", "rx");
    wait_connected(&s);
    // The generator joins once the guest is there.
    let n = 200_000;
    let g = dir.path().join("g2.yaml");
    std::fs::write(
        &g,
        format!("{base}  gen: {{ type: generator, size: 128, rate: 200000, count: {n} }}\nlinks:\n  - \"vm.output -> out.input\"\n  - \"gen.output -> vm.input\"\n"),
    )
    .unwrap();
    must(&format!(
        "{} apply --control {} {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display(),
        g.display()
    ));
    wait_until("the generator is done", 20, || {
        let stats = s.stats().unwrap();
        counter(&stats, "vm", "to_guest_packets")
            + counter(&stats, "vm", "to_guest_no_buffer_drops")
            >= n
    });
    std::thread::sleep(Duration::from_millis(300));
    let (received, _) = t.stop();
    let stats = s.stop();
    let delivered = counter(&stats, "vm", "to_guest_packets");
    let dropped = counter(&stats, "vm", "to_guest_no_buffer_drops");
    assert_eq!(
        delivered + dropped,
        n,
        "every packet is delivered or counted"
    );
    assert_eq!(
        received, delivered,
        "testpmd received what the port delivered"
    );
    assert!(
        delivered > n / 2,
        "most packets found a buffer: {delivered}"
    );
}

#[test]
fn testpmd_io_forwarding_loops_through_stitch() {
    require_root_and_tools(&["dpdk-testpmd"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    // Whatever the guest sends comes back to it: testpmd's io mode sends a first burst and
    // then forwards what it receives, so packets circle until testpmd stops.
    let s = Stitch::run(&format!(
        "apps:\n  vm: {{ type: vhost_user, socket: {} }}\n  back: {{ type: forwarder }}\nlinks:\n  - \"vm.output -> back.input\"\n  - \"back.output -> vm.input\"\n",
        sock.display()
    ));
    let t = Testpmd::start_io(&sock);
    wait_connected(&s);
    std::thread::sleep(Duration::from_secs(2));
    // With IN_ORDER negotiated DPDK's driver takes its in-order paths, which rely on the
    // device using chains in the order they were made available.
    let (status, port) = s.call("POST", "/api/v1/apps/vm/query", None);
    assert_eq!(status, 200, "{port}");
    let features = u64::from_str_radix(
        port["features"].as_str().unwrap().trim_start_matches("0x"),
        16,
    )
    .unwrap();
    assert_ne!(
        features & stitch_vhost::device::feature::IN_ORDER,
        0,
        "VIRTIO_F_IN_ORDER negotiated: {port}"
    );
    let (rx, tx) = t.stop();
    std::thread::sleep(Duration::from_millis(300));
    let stats = s.stop();
    let from_guest = link(&stats, "vm.output -> back.input")["tx_packets"]
        .as_u64()
        .unwrap();
    let to_guest = counter(&stats, "vm", "to_guest_packets");
    let dropped = counter(&stats, "vm", "to_guest_no_buffer_drops");
    assert!(rx > 1000, "packets went round: {rx}");
    // When testpmd stops, up to a ring's worth may still be on the way in each direction.
    assert!(
        tx >= from_guest && tx - from_guest <= 256,
        "sent {tx}, taken {from_guest}"
    );
    assert!(
        to_guest >= rx && to_guest - rx <= 256,
        "delivered {to_guest}, received {rx}"
    );
    assert_eq!(
        from_guest,
        to_guest + dropped + counter(&stats, "vm", "to_guest_too_big_drops")
    );
}

/// The guest kernel and initramfs (`scripts/vm-image`), built once into target/.
/// A QEMU TCG guest on vhost-user socket `sock`; its console goes to `log`.
fn guest(
    image: &std::path::Path,
    sock: &std::path::Path,
    mac: &str,
    ip: &str,
    run: &str,
    log: &std::path::Path,
) -> Background {
    Background(
        guest_command(image, sock, mac, ip, run, log)
            .spawn()
            .expect("qemu-system-x86_64 (package qemu-system-x86) is needed"),
    )
}

fn guest_command(
    image: &std::path::Path,
    sock: &std::path::Path,
    mac: &str,
    ip: &str,
    run: &str,
    log: &std::path::Path,
) -> Command {
    let append = format!("console=ttyS0 quiet stitch.ip={ip} stitch.run=\"{run}\"");
    let mut c = Command::new("qemu-system-x86_64");
    c.args([
        "-accel",
        "tcg",
        "-m",
        "512",
        "-smp",
        "1",
        "-no-reboot",
        "-display",
        "none",
    ])
    // vhost-user needs the guest's memory shareable (memfd).
    .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
    .args(["-numa", "node,memdev=mem"])
    .arg("-kernel")
    .arg(image.join("vmlinux"))
    .arg("-initrd")
    .arg(image.join("initrd.gz"))
    .args(["-append", &append])
    .arg("-chardev")
    .arg(format!("socket,id=c0,path={}", sock.display()))
    .args(["-netdev", "vhost-user,id=n0,chardev=c0"])
    // QEMU 7.2 under TCG crashes with MSI-X and vhost-user: legacy interrupts.
    .arg("-device")
    .arg(format!("virtio-net-pci,netdev=n0,vectors=0,mac={mac}"))
    .arg("-serial")
    .arg(format!("file:{}", log.display()))
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    c
}

/// What the guest's commands printed.
fn guest_output(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let start = text
        .find("STITCH-BEGIN")
        .map(|i| i + 12)
        .unwrap_or(text.len());
    let end = text[start..]
        .find("STITCH-END")
        .map(|i| start + i)
        .unwrap_or(text.len());
    text[start..end].to_string()
}

/// Guest 1 at `ips.0` (an iperf3 server) on `vm1.sock` of `dir` and guest 2 at `ips.1` on
/// `vm2.sock`, which runs `client` once it reaches guest 1; what guest 2 printed.
fn two_guests(
    image: &std::path::Path,
    dir: &std::path::Path,
    ips: (&str, &str),
    client: &str,
) -> String {
    let (log1, log2) = (dir.join("vm1.log"), dir.join("vm2.log"));
    let g1 = guest(
        image,
        &dir.join("vm1.sock"),
        "52:54:00:00:00:11",
        &format!("{}/24", ips.0),
        "iperf3 -s -1",
        &log1,
    );
    let g2 = guest(
        image,
        &dir.join("vm2.sock"),
        "52:54:00:00:00:12",
        &format!("{}/24", ips.1),
        &format!(
            "for i in $(seq 1 60); do ping -c 1 -W 1 {} >/dev/null && break; done; {client}",
            ips.0
        ),
        &log2,
    );
    let out2 = g2.finish();
    assert!(
        out2.status.success(),
        "guest 2: {}",
        String::from_utf8_lossy(&out2.stderr)
    );
    let _ = g1.finish();
    let text = guest_output(&log2);
    eprintln!("guest 2 said:\n{text}");
    text
}

fn iperf_mbits(out: &str, server: &str) -> f64 {
    // iperf3's receiver summary: "[  5]   0.00-3.00  sec  X MBytes  Y Mbits/sec   receiver"
    let section = out
        .split(&format!("Connecting to host {server}, port"))
        .nth(1)
        .unwrap_or("");
    section
        .lines()
        .find(|l| l.contains("receiver"))
        .and_then(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let i = words.iter().position(|w| w.ends_with("bits/sec"))?;
            let v: f64 = words[i - 1].parse().ok()?;
            Some(match words[i] {
                "Gbits/sec" => v * 1000.0,
                "Kbits/sec" => v / 1000.0,
                _ => v,
            })
        })
        .unwrap_or(0.0)
}

#[test]
fn two_qemu_guests_ping_and_run_iperf3_through_stitch() {
    require_root_and_tools(&["qemu-system-x86_64", "busybox", "iperf3", "ip", "cpio"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let image = vm_image();
    let h = TwoHosts::new();
    // The namespace of host 0 is the third party, on a veth: 10.X.Y.1 like TwoHosts gives it.
    let prefix = h.ip[0].rsplit_once('.').unwrap().0.to_string();
    let ns_ip = h.ip[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let (s1, s2) = (dir.path().join("vm1.sock"), dir.path().join("vm2.sock"));
    let s = Stitch::run(&format!(
        "apps:\n  vm1: {{ type: vhost_user, socket: {} }}\n  vm2: {{ type: vhost_user, socket: {} }}\n  ns: {{ type: af_packet, interface: {} }}\n  br: {{ type: bridge, ports: {{ vm1: {{}}, vm2: {{}}, ns: {{}} }} }}\nlinks:\n  - \"vm1.output -> br.vm1\"\n  - \"br.vm1 -> vm1.input\"\n  - \"vm2.output -> br.vm2\"\n  - \"br.vm2 -> vm2.input\"\n  - \"ns.output -> br.ns\"\n  - \"br.ns -> ns.input\"\n",
        s1.display(),
        s2.display(),
        h.outer[0]
    ));
    let ns_server = h.spawn(0, "iperf3 -s -1 -p 5201");
    let vm1_ip = format!("{prefix}.11");
    let vm2_ip = format!("{prefix}.12");
    let text = two_guests(
        &image,
        dir.path(),
        (&vm1_ip, &vm2_ip),
        &format!(
            "ping -c 3 {vm1_ip}; ping -c 3 {ns_ip}; iperf3 -c {vm1_ip} -t 3; iperf3 -c {ns_ip} -t 3"
        ),
    );
    let _ = ns_server.finish();
    assert!(
        text.matches("3 packets transmitted, 3 packets received")
            .count()
            == 2,
        "the guests ping each other and the namespace"
    );
    let to_vm = iperf_mbits(&text, &vm1_ip);
    let to_ns = iperf_mbits(&text, &ns_ip);
    eprintln!("iperf3 guest→guest {to_vm:.0} Mbit/s, guest→namespace {to_ns:.0} Mbit/s (QEMU TCG)");
    assert!(to_vm > 0.0 && to_ns > 0.0, "iperf3 ran both ways: {text}");
    let stats = s.stop();
    assert_eq!(counter(&stats, "vm1", "guest_faults"), 0);
    assert_eq!(counter(&stats, "vm2", "guest_faults"), 0);
}

/// Stitch's OpenFlow switch between VM ports `vm1` and `vm2` (their sockets in `dir`), the
/// flows 1 → 2 and 2 → 1 added with `ovs-ofctl`, for two QEMU guests with iperf3; the instance
/// and the switch's OpenFlow port.
fn switch_between_guests(dir: &std::path::Path) -> (Stitch, u16) {
    require_root_and_tools(&[
        "qemu-system-x86_64",
        "busybox",
        "iperf3",
        "cpio",
        "ovs-ofctl",
    ]);
    let port = free_port();
    let s = Stitch::run(&format!(
        "apps:
  vm1: {{ type: vhost_user, socket: {d}/vm1.sock }}
  vm2: {{ type: vhost_user, socket: {d}/vm2.sock }}
  sw: {{ type: switch, ports: [vm1, vm2], listen: \"127.0.0.1:{port}\" }}
links:
  - \"vm1.output -> sw.vm1\"
  - \"sw.vm1 -> vm1.input\"
  - \"vm2.output -> sw.vm2\"
  - \"sw.vm2 -> vm2.input\"
",
        d = dir.display()
    ));
    for flow in [
        "priority=100,in_port=1,actions=output:2",
        "priority=100,in_port=2,actions=output:1",
    ] {
        ofctl(port, &["add-flow", flow]);
    }
    (s, port)
}

/// Two Linux guests (unmodified virtio-net, offloads and mergeable buffers on) behind the
/// OpenFlow switch with `in_port=1,actions=output:2` and `in_port=2,actions=output:1`: each
/// port gets a direct path into the other's receive ring, ping and iperf3 (TSO super-frames,
/// partial checksums) cross guest to guest, and the switch's port counters count what the
/// paths carried as if it had walked the tables.
#[test]
fn two_linux_guests_behind_the_switch_talk_over_direct_paths() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (s, port) = switch_between_guests(dir.path());
    let image = vm_image();
    let (vm1_ip, vm2_ip) = ("10.77.0.11", "10.77.0.12");
    let text = two_guests(
        &image,
        dir.path(),
        (vm1_ip, vm2_ip),
        &format!("ping -c 3 {vm1_ip}; iperf3 -c {vm1_ip} -t 3"),
    );
    assert!(
        text.contains("3 packets transmitted, 3 packets received"),
        "the guests ping each other"
    );
    let mbits = iperf_mbits(&text, vm1_ip);
    eprintln!("iperf3 guest→guest over direct paths: {mbits:.0} Mbit/s (QEMU TCG)");
    assert!(mbits > 0.0, "iperf3 ran: {text}");
    let stats = s.stats().unwrap();
    let sent = |vm: &str| {
        let a = app(&stats, vm);
        a["tx_packets"].as_u64().unwrap() + a["counters"]["direct_vm_packets"].as_u64().unwrap()
    };
    for (vm, n) in [("vm1", 1), ("vm2", 2)] {
        let direct = counter(&stats, vm, "direct_vm_packets");
        assert!(
            direct > 0,
            "{vm} sent straight into the other guest: {stats}"
        );
        let ports = ofctl(port, &["--no-names", "dump-ports", &n.to_string()]);
        assert!(
            ports.contains(&format!("rx pkts={},", sent(vm))),
            "port {n} counts what {vm} sent either way: {ports}"
        );
    }
    let stats = s.stop();
    assert_eq!(counter(&stats, "vm1", "guest_faults"), 0);
    assert_eq!(counter(&stats, "vm2", "guest_faults"), 0);
}

/// Two Linux guests (QEMU, virtio-net) behind the switch: while iperf3 sends a numbered UDP
/// stream from guest 2 to guest 1, the controller (`ovs-ofctl`) makes the flow not point to
/// point and point to point again three times (a UDP flow above it, then removed): the path is
/// handed back and given again each time, and iperf3's receiver counts no datagram lost and
/// none out of order.
#[test]
fn a_udp_stream_between_linux_guests_survives_three_hand_backs() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (s, port) = switch_between_guests(dir.path());
    let image = vm_image();
    let direct_from_vm2 = |s: &Stitch| s.counter("vm2", "direct_vm_packets").unwrap_or(0);
    let flips = std::thread::scope(|scope| {
        let flips = scope.spawn(|| {
            // Once the stream runs (ping alone sends a few frames), three flips a second apart.
            wait_until("iperf3's stream", 120, || direct_from_vm2(&s) > 1000);
            let rule = "priority=200,in_port=2,udp";
            let mut paths = Vec::new();
            for _ in 0..3 {
                ofctl(port, &["add-flow", &format!("{rule},actions=output:1")]);
                // The hand-back takes a tick; then nothing goes guest to guest.
                std::thread::sleep(Duration::from_millis(100));
                let handed_back = direct_from_vm2(&s);
                std::thread::sleep(Duration::from_millis(400));
                paths.push((handed_back, direct_from_vm2(&s)));
                ofctl(port, &["--strict", "del-flows", rule]);
                std::thread::sleep(Duration::from_millis(500));
            }
            paths
        });
        let text = two_guests(
            &image,
            dir.path(),
            ("10.77.1.11", "10.77.1.12"),
            "iperf3 -c 10.77.1.11 -u -b 2M -l 200 -t 10 -J",
        );
        (flips.join().unwrap(), text)
    });
    let (paths, text) = flips;
    let json = &text[text.find("\n{").expect("iperf3's report") + 1..];
    let json = &json[..json.rfind("\n}").expect("iperf3's report") + 2];
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    let udp = &report["end"]["streams"][0]["udp"];
    eprintln!("iperf3 UDP through three hand-backs: {udp}; the path's count at each one's start and end: {paths:?}");
    assert!(udp["packets"].as_u64().unwrap() > 5000, "{udp}");
    assert_eq!(udp["lost_packets"], 0, "{udp}");
    assert_eq!(udp["out_of_order"], 0, "{udp}");
    for (k, &(from, to)) in paths.iter().enumerate() {
        assert_eq!(
            from, to,
            "nothing took the path while it was handed back: {paths:?}"
        );
        if k > 0 {
            assert!(
                from > paths[k - 1].1,
                "the path came back between: {paths:?}"
            );
        }
    }
    let (_, log) = s.stop_with_log();
    let offers = log.matches("direct path vm2 -> vm1").count();
    assert!(offers >= 4, "the path was given four times:\n{log}");
}

#[test]
fn port_policy_filters_and_rate_limits_what_the_guest_sends() {
    require_root_and_tools(&["dpdk-testpmd"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // testpmd's txonly frames are UDP over IPv4.
    for (policy, filtered_all) in [
        ("egress_filter: udp, tx_rate: 20000", false),
        ("egress_filter: \"not udp\"", true),
    ] {
        let (_dir, sock, s) = port_into_sink(&format!(", port_id: \"A-1\", {policy}"));
        let t = Testpmd::start(&sock, "txonly", "pol");
        wait_connected(&s);
        let (_, v) = s.call("POST", "/api/v1/apps/vm/query", Some("{}"));
        assert_eq!(v["port_id"], "A-1");
        std::thread::sleep(Duration::from_secs(2));
        let (_, sent) = t.stop();
        std::thread::sleep(Duration::from_millis(300));
        let stats = s.stop();
        let passed = link(&stats, "vm.output -> out.input")["tx_packets"]
            .as_u64()
            .unwrap();
        let filtered = counter(&stats, "vm", "egress_filtered_drops");
        let policed = counter(&stats, "vm", "egress_policed_drops");
        assert_eq!(
            passed + filtered + policed,
            sent,
            "{policy}: every packet accounted for"
        );
        if filtered_all {
            assert_eq!(filtered, sent, "{policy}");
        } else {
            assert_eq!(filtered, 0, "{policy}");
            assert!(
                policed > passed,
                "{policy}: the limit held ({passed} passed, {policed} policed)"
            );
            assert!(passed > 1000, "{policy}: {passed}");
        }
    }
}

/// A hand-written vhost-user front-end that shares 1 MiB and sets up the guest's transmit ring
/// (ring 1) with descriptors the test writes itself.
struct EvilGuest {
    stream: std::os::unix::net::UnixStream,
    mem: *mut u8,
}

const GUEST_GPA: u64 = 0x10_0000;
const GUEST_VA: u64 = 0x7000_0000_0000;
const GUEST_SIZE: usize = 1 << 20;

fn vhost_msg(request: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&request.to_le_bytes());
    m.extend_from_slice(&1u32.to_le_bytes());
    m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    m.extend_from_slice(payload);
    m
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl EvilGuest {
    fn connect(sock: &std::path::Path) -> EvilGuest {
        use std::os::fd::AsRawFd;
        let stream = std::os::unix::net::UnixStream::connect(sock).unwrap();
        let name = std::ffi::CString::new("evil-guest").unwrap();
        // SAFETY: a fresh memfd, mapped shared for the test to write rings into.
        let (fd, mem) = unsafe {
            let fd = libc::memfd_create(name.as_ptr(), 0);
            assert_eq!(libc::ftruncate(fd, GUEST_SIZE as libc::off_t), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                GUEST_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            (fd, p as *mut u8)
        };
        let g = EvilGuest { stream, mem };
        let s = g.stream.as_raw_fd();
        let send = |m: Vec<u8>, fds: &[i32]| stitch_core::fdpass::send(s, &m, fds).unwrap();
        send(vhost_msg(3, &[]), &[]); // SET_OWNER
        send(vhost_msg(2, &(1u64 << 32).to_le_bytes()), &[]); // SET_FEATURES: VERSION_1
        let mut table = u32s(&[1, 0]);
        for v in [GUEST_GPA, GUEST_SIZE as u64, GUEST_VA, 0] {
            table.extend_from_slice(&v.to_le_bytes());
        }
        send(vhost_msg(5, &table), &[fd]); // SET_MEM_TABLE
        send(vhost_msg(8, &u32s(&[1, 8])), &[]); // SET_VRING_NUM 8
        let mut addr = u32s(&[1, 0]);
        for v in [GUEST_VA, GUEST_VA + 0x2000, GUEST_VA + 0x1000, 0] {
            addr.extend_from_slice(&v.to_le_bytes()); // desc, used, avail, log
        }
        send(vhost_msg(9, &addr), &[]); // SET_VRING_ADDR
        send(vhost_msg(10, &u32s(&[1, 0])), &[]); // SET_VRING_BASE 0
        g
    }

    /// Starts (or restarts) ring 1: SET_VRING_KICK without an eventfd (we do not kick).
    fn kick(&self) {
        use std::os::fd::AsRawFd;
        let m = vhost_msg(12, &(1u64 | 0x100).to_le_bytes());
        stitch_core::fdpass::send(self.stream.as_raw_fd(), &m, &[]).unwrap();
    }

    fn desc(&self, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        // SAFETY: inside the test's own mapping.
        unsafe {
            let p = self.mem.add(16 * i);
            (p as *mut u64).write_volatile(addr);
            (p.add(8) as *mut u32).write_volatile(len);
            (p.add(12) as *mut u16).write_volatile(flags);
            (p.add(14) as *mut u16).write_volatile(next);
        }
    }

    /// Offers descriptor `head` as the `n`-th available entry.
    fn offer(&self, n: u16, head: u16) {
        // SAFETY: inside the test's own mapping (avail ring at +0x1000).
        unsafe {
            let avail = self.mem.add(0x1000);
            (avail.add(4 + 2 * (n as usize % 8)) as *mut u16).write_volatile(head);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            (avail.add(2) as *mut u16).write_volatile(n + 1);
        }
    }
}

#[test]
fn a_guest_with_bad_descriptors_only_stops_its_own_queue() {
    let (_dir, sock, s) = port_into_sink("");
    wait_until("the port listens", 10, || sock.exists());
    let g = EvilGuest::connect(&sock);
    let faults = |s: &Stitch| counter(&s.stats().unwrap(), "vm", "guest_faults");
    let query = |s: &Stitch| s.call("POST", "/api/v1/apps/vm/query", Some("{}")).1;

    // A buffer outside the memory the guest shared.
    g.desc(0, 0xdead_0000, 100, 0, 0);
    g.offer(0, 0);
    g.kick();
    wait_until("the fault is seen", 10, || faults(&s) == 1);
    let fault = query(&s)["queues"][1]["fault"].to_string();
    assert!(fault.contains("outside guest memory"), "{fault}");

    // A chain that loops (0 → 1 → 0): refused as well, once the guest restarts the ring.
    g.desc(0, GUEST_GPA + 0x10000, 64, 1, 1);
    g.desc(1, GUEST_GPA + 0x20000, 64, 1, 0);
    g.kick();
    wait_until("the loop is seen", 10, || faults(&s) == 2);
    assert!(query(&s)["queues"][1]["fault"]
        .to_string()
        .contains("loops"));

    // Fixed: one good frame (12-byte virtio-net header + 60 bytes) goes through.
    g.desc(0, GUEST_GPA + 0x10000, 72, 0, 0);
    // SAFETY: inside the guest's mapping: an Ethernet frame after a zero header.
    unsafe {
        let b = g.mem.add(0x10000);
        std::ptr::write_bytes(b, 0, 72);
        std::ptr::copy_nonoverlapping([0xffu8; 6].as_ptr(), b.add(12), 6);
    }
    g.kick();
    wait_until("the good frame arrives", 10, || {
        link(&s.stats().unwrap(), "vm.output -> out.input")["tx_packets"] == 1
    });
    assert_eq!(query(&s)["queues"][1]["fault"], serde_json::Value::Null);
    drop(g);
    let stats = s.stop();
    assert_eq!(counter(&stats, "vm", "guest_faults"), 2);
}

#[test]
fn client_mode_reconnects_when_the_front_end_restarts() {
    require_root_and_tools(&["dpdk-testpmd"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Here testpmd is the server (as QEMU with `server=on`) and Stitch connects.
    let (_dir, sock, s) = port_into_sink(", mode: client");
    let mut total = 0;
    for round in 0..2 {
        let t = Testpmd::start_with(&sock, "txonly", &format!("rc{round}"), ",server=1");
        wait_connected(&s);
        std::thread::sleep(Duration::from_secs(1));
        let (_, sent) = t.stop();
        assert!(sent > 1000, "round {round}: {sent}");
        total += sent;
        wait_until("the port sees the front-end gone", 10, || {
            s.call("POST", "/api/v1/apps/vm/query", Some("{}")).1["connected"] == false
        });
    }
    let stats = s.stop();
    assert_eq!(counter(&stats, "vm", "connections"), 2);
    assert_eq!(
        link(&stats, "vm.output -> out.input")["tx_packets"]
            .as_u64()
            .unwrap(),
        total,
        "both sessions' packets arrived"
    );
}

#[test]
fn two_queue_pairs_carry_what_testpmd_sends_on_both() {
    require_root_and_tools(&["dpdk-testpmd"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (_dir, sock, s) = port_into_sink(", queues: 2");
    let t = Testpmd::spawn(
        &format!("net_virtio_user0,path={},queues=2", sock.display()),
        &[
            "--rxq=2",
            "--txq=2",
            "--forward-mode=txonly",
            "--txonly-multi-flow",
        ],
        "mq",
        "start",
    );
    wait_connected(&s);
    let (_, q) = s.call("POST", "/api/v1/apps/vm/query", Some("{}"));
    assert_eq!(q["queues"].as_array().unwrap().len(), 4, "{q}");
    std::thread::sleep(Duration::from_secs(2));
    let (_, sent) = t.stop();
    std::thread::sleep(Duration::from_millis(300));
    let stats = s.stop();
    assert!(sent > 10_000);
    let received = link(&stats, "vm.output -> out.input")["tx_packets"]
        .as_u64()
        .unwrap();
    assert_eq!(received, sent, "what testpmd sent on both queues arrived");
}

/// One HMP command on a QEMU monitor socket; returns what QEMU printed.
fn monitor(sock: &std::path::Path, command: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = vec![0u8; 65536];
    let _ = s.read(&mut buf); // the banner
    s.write_all(format!("{command}\n").as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let n = s.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn a_qemu_guest_migrates_live_from_one_port_to_another_and_keeps_its_pings() {
    require_root_and_tools(&["qemu-system-x86_64", "busybox", "ip", "cpio"]);
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let image = vm_image();
    let h = TwoHosts::new();
    let prefix = h.ip[0].rsplit_once('.').unwrap().0.to_string();
    let ns_ip = h.ip[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.sock"), dir.path().join("dst.sock"));
    let s = Stitch::run(&format!(
        "apps:\n  src: {{ type: vhost_user, socket: {} }}\n  dst: {{ type: vhost_user, socket: {} }}\n  ns: {{ type: af_packet, interface: {} }}\n  br: {{ type: bridge, ports: {{ src: {{}}, dst: {{}}, ns: {{}} }} }}\nlinks:\n  - \"src.output -> br.src\"\n  - \"br.src -> src.input\"\n  - \"dst.output -> br.dst\"\n  - \"br.dst -> dst.input\"\n  - \"ns.output -> br.ns\"\n  - \"br.ns -> ns.input\"\n",
        src.display(),
        dst.display(),
        h.outer[0]
    ));
    let mon = dir.path().join("mon.sock");
    let port = free_port();
    let (src_log, dst_log) = (dir.path().join("src.log"), dir.path().join("dst.log"));
    let run = format!(
        "for i in $(seq 1 100); do ping -c 1 -W 1 {ns_ip} >/dev/null && echo PING-OK $i || echo PING-LOST $i; sleep 0.2; done"
    );
    let vm_ip = format!("{prefix}.21/24");
    let mac = "52:54:00:00:00:21";
    // The destination waits for the incoming migration on loopback; the source has a monitor.
    let g_dst = Background(
        guest_command(&image, &dst, mac, &vm_ip, &run, &dst_log)
            .args(["-incoming", &format!("tcp:127.0.0.1:{port}")])
            .spawn()
            .unwrap(),
    );
    let g_src = Background(
        guest_command(&image, &src, mac, &vm_ip, &run, &src_log)
            .arg("-monitor")
            .arg(format!("unix:{},server=on,wait=off", mon.display()))
            .spawn()
            .unwrap(),
    );
    wait_until("the guest pings from the source", 60, || {
        std::fs::read_to_string(&src_log)
            .unwrap_or_default()
            .matches("PING-OK")
            .count()
            >= 5
    });
    monitor(&mon, &format!("migrate -d tcp:127.0.0.1:{port}"));
    wait_until("the migration completes", 60, || {
        monitor(&mon, "info migrate").contains("Migration status: completed")
    });
    // The source stays paused after a migration: tell it to go.
    monitor(&mon, "quit");
    let _ = g_src.finish();
    let out = g_dst.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The destination's console starts mid-way: the guest said STITCH-BEGIN at the source.
    let a = guest_output(&src_log);
    let b = std::fs::read_to_string(&dst_log).unwrap_or_default();
    let ok = a.matches("PING-OK").count() + b.matches("PING-OK").count();
    let lost = a.matches("PING-LOST").count() + b.matches("PING-LOST").count();
    eprintln!(
        "migration: {ok} pings answered, {lost} lost, {} of them after it",
        b.matches("PING-OK").count()
    );
    assert!(
        b.contains("PING-OK"),
        "the guest carried on at the destination: {b}"
    );
    assert!(ok >= 95 && lost <= 5, "{ok} answered, {lost} lost");
    let stats = s.stop();
    assert!(
        counter(&stats, "dst", "announcements") >= 1,
        "the destination announced the guest (QEMU asks for a RARP after the migration)"
    );
}

/// `stitch bench rfc2544` on a device that drops above a known rate: a policer of X frames/s
/// and depth B frames between two vhost_user ports. A trial of T seconds at rate r loses
/// nothing while r·T ≤ X·T + B, so the no-drop rate is X + B/T, which the search must find
/// to within its resolution; the partial-drop rate is at least that, and the latency trials
/// at fractions of it measure every frame they send.
#[test]
fn the_rfc2544_search_finds_the_rate_of_a_policer() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const X: f64 = 20_000.0;
    const B: f64 = 1_000.0;
    const T: f64 = 1.0;
    const MAX: f64 = 40_000.0;
    const RESOLUTION_PERCENT: f64 = 2.0;
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("policer.yaml");
    std::fs::write(
        &graph,
        format!(
            "engine: {{ busy_poll: true }}\napps:\n  a: {{ type: vhost_user, socket: set-by-the-bench }}\n  p: {{ type: policer, rate: {X}, burst: {B} }}\n  b: {{ type: vhost_user, socket: set-by-the-bench }}\nlinks:\n  - \"a.output -> p.input\"\n  - \"p.output -> b.input\"\n"
        ),
    )
    .unwrap();
    let out = dir.path().join("results");
    run_bench(&[
        "rfc2544",
        "--duts",
        "graph",
        "--graph",
        graph.to_str().unwrap(),
        "--sizes",
        "64",
        "--trial-seconds",
        &T.to_string(),
        "--max-rate",
        &MAX.to_string(),
        "--resolution",
        &RESOLUTION_PERCENT.to_string(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rfc2544.json")).unwrap()).unwrap();
    let r = &doc["results"][0];
    let ndr = r["ndr"]["rate_pps"].as_f64().unwrap();
    let pdr = r["pdr"]["rate_pps"].as_f64().unwrap();
    let threshold = X + B / T;
    let resolution = MAX * RESOLUTION_PERCENT / 100.0;
    assert!(
        ndr <= threshold && ndr >= threshold - resolution,
        "NDR {ndr} not within {resolution} below {threshold}: {r}"
    );
    assert!(pdr >= ndr, "{r}");
    let latency = r["latency"].as_array().unwrap();
    assert_eq!(latency.len(), 3, "{r}");
    for l in latency {
        // Below the policer's rate nothing is policed: a loss would be a stall of the device
        // longer than the tester's ring holds (50 ms at these rates).
        assert!(l["loss_ratio"].as_f64().unwrap() < 0.01, "{l}");
        assert!(l["count"].as_u64().unwrap() > 1000, "{l}");
        assert!(l["p50_ns"].as_u64().unwrap() >= l["min_ns"].as_u64().unwrap());
    }
    assert!(out.join("rfc2544.png").exists(), "the run's plot");
}

/// `stitch bench vm2vm` on one VM (a testpmd guest) three ways — Stitch's switch carrying
/// every frame, direct paths, Open vSwitch's DPDK datapath on the same guest and flows — at a
/// rate the chain carries: each way delivers, the direct way has a path for both hops, and the
/// flow changed and back under traffic reorders nothing.
#[test]
fn the_vm2vm_bench_chains_a_guest_three_ways() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    require_root_and_tools(&["dpdk-testpmd", "ovs-ofctl", "ovs-vsctl"]);
    let text = run_bench(&[
        "vm2vm",
        "--vms",
        "1",
        "--sizes",
        "64",
        "--seconds",
        "0.5",
        "--rate-mpps",
        "0.02",
    ]);
    for way in ["switched", "direct", "ovs-dpdk"] {
        let row: Vec<&str> = text
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(way))
            .unwrap_or_else(|| panic!("no {way} row: {text}"))
            .split_whitespace()
            .collect();
        let mpps: f64 = row[3].parse().unwrap();
        assert!(mpps > 0.01, "{way} delivered {mpps} Mpps of 0.02: {text}");
        assert_eq!(row[6], "0", "{way} reordered: {text}");
        let paths = if way == "direct" { "2" } else { "0" };
        assert_eq!(row[7], paths, "{way}'s direct paths: {text}");
        let flip = text
            .lines()
            .find(|l| l.contains(&format!("{way}: the first hop's flow changed")))
            .unwrap_or_else(|| panic!("no {way} flip: {text}"));
        assert!(flip.contains(" 0 reordered"), "{flip}");
    }
}
