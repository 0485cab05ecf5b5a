//! `stitch upgrade` as an operator runs it, mid-traffic: a TCP connection through a firewall
//! and a NAT carries on, a UDP stream loses nothing, counters go on from where they were, and
//! a new process that cannot take over leaves the running one as it was.

mod common;
use common::testpmd::Testpmd;
use common::upgrade::*;
use common::*;
use std::path::Path;
use std::process::Command;

/// The process that took `s` over last, once its predecessor is gone: one a signal started,
/// whose pid no report gave (the instance's status names it). It runs under the command the
/// operator started.
fn newest_take_over(s: &Stitch) -> Successor {
    let since = std::time::Instant::now();
    loop {
        if let Some(pid) = serving(&s.socket).filter(|&p| alive(p as i32)) {
            let line = command_line(pid);
            assert!(
                line.iter().any(|a| a == "run") && !line.iter().any(|a| a == "take-over"),
                "the successor runs as {line:?}"
            );
            return Successor(pid as i32);
        }
        assert!(
            since.elapsed().as_secs() < 10,
            "no process answers on {} after the hand-over",
            s.socket.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// iperf3 through a firewall and a NAT: without their connections and mappings the new process
/// would drop the stream (a fresh NAT has no mapping, a fresh firewall no connection).
#[test]
fn tcp_through_a_firewall_and_a_nat_carries_on_across_an_upgrade_without_a_stall() {
    require_root_and_tools(&["ip", "iperf3"]);
    let h = TwoHosts::new();
    let external = format!("{}52", &h.ip[0][..h.ip[0].len() - 1]);
    let graph = format!(
        "apps:\n  lan: {{ type: af_packet, interface: {} }}\n  wan: {{ type: af_packet, interface: {} }}\n  fw: {{ type: firewall, default: drop, rules: [ {{ action: accept, from: lan }} ] }}\n  nat: {{ type: nat, external: \"{external}\", ports: \"20000-29999\" }}\nlinks:\n  - \"lan.output -> fw.lan\"\n  - \"fw.lan -> lan.input\"\n  - \"fw.wan -> nat.lan\"\n  - \"nat.lan -> fw.wan\"\n  - \"wan.output -> nat.wan\"\n  - \"nat.wan -> wan.input\"\n",
        h.outer[0], h.outer[1]
    );
    let first = Stitch::run(&graph);
    let server = h.spawn(1, "timeout 60 iperf3 -s -1 -p 5298");
    h.wait_listening(1, 5298);
    let client = h.spawn(
        0,
        &format!(
            "timeout 40 iperf3 -c {} -p 5298 -t 4 -i 0.5 --connect-timeout 5000 -J",
            h.ip[1]
        ),
    );
    wait_until("the stream to cross", 20, || {
        first
            .stats()
            .and_then(|s| app(&s, "nat")["counters"]["translated_out"].as_u64())
            > Some(1000)
    });
    let before = first.stats().unwrap();
    let (successor, report) = upgrade(&first);
    let o = client.finish();
    let _ = server.finish();
    let bits = iperf_bits(&o, &h.ip[1]);
    let run: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let intervals: Vec<u64> = (run["intervals"].as_array().unwrap().iter())
        .map(|i| i["sum"]["bytes"].as_u64().unwrap())
        .collect();
    let retransmits = &run["end"]["sum_sent"]["retransmits"];
    eprintln!(
        "{bits:.0} bit/s; bytes per 0.5 s {intervals:?}; {retransmits} retransmits; {report}"
    );
    assert!(
        intervals.iter().all(|&b| b > 0),
        "the stream stalled for half a second: {intervals:?}"
    );
    let restored: Vec<&str> = (report["state_restored"].as_array().unwrap().iter())
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(restored, ["fw", "nat"], "{report}");
    // The API socket answered all along; counters go on from where they were.
    let after = first.stats().unwrap();
    for (a, counter) in [("nat", "translated_out"), ("fw", "accepted")] {
        let was = app(&before, a)["counters"][counter].as_u64();
        let is = app(&after, a)["counters"][counter].as_u64();
        assert!(
            was.is_some() && is >= was,
            "{a} {counter}: {was:?} → {is:?}"
        );
    }
    let spec = "lan.output -> fw.lan";
    assert!(
        link(&after, spec)["tx_packets"].as_u64() >= link(&before, spec)["tx_packets"].as_u64(),
        "{after}"
    );
    let last = successor.stop(first);
    assert_eq!(
        app(&last, "nat")["counters"]["no_mapping_drops"],
        0,
        "{last}"
    );
}

/// Sends `count` numbered datagrams, one every `gap` seconds (to port 7008, or the fourth
/// argument).
const NUMBERED_SENDER: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
count, gap = int(sys.argv[2]), float(sys.argv[3])
port = int(sys.argv[4]) if len(sys.argv) > 4 else 7008
start = time.monotonic()
for i in range(count):
    s.sendto(i.to_bytes(4, "big"), (sys.argv[1], port))
    delay = start + (i + 1) * gap - time.monotonic()
    if delay > 0:
        time.sleep(delay)
"#;

/// Counts the distinct numbers it receives (on port 7008, or the first argument) until none
/// comes for 2 s, or for the second argument's seconds at first.
const NUMBER_COUNTER: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
# Room for a burst: what waited during a pause arrives at once, while this process may not
# be scheduled (SO_RCVBUFFORCE, as root).
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1]) if len(sys.argv) > 1 else 7008))
print("ready", flush=True)
seen = set()
s.settimeout(float(sys.argv[2]) if len(sys.argv) > 2 else 30)
while True:
    try:
        seen.add(int.from_bytes(s.recv(64), "big"))
    except socket.timeout:
        break
    s.settimeout(2)
print(len(seen), flush=True)
"#;

#[test]
fn a_udp_stream_loses_nothing_across_an_upgrade() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let graph = format!(
        "apps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\nlinks:\n  - \"a.output -> b.input\"\n  - \"b.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    );
    // As systemd runs it: the instance names its successor the service's main process.
    let notify_dir = tempfile::tempdir().unwrap();
    let notify_path = notify_dir.path().join("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    let first = Stitch::run_with_env(&graph, &[], &[("NOTIFY_SOCKET", &notify_path)]);
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let (successor, _) = numbered_stream_across_an_upgrade(&h, &first);
    notify
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut message = [0u8; 256];
    let n = notify
        .recv(&mut message)
        .expect("a word to the service manager");
    let message = String::from_utf8_lossy(&message[..n]);
    assert!(
        message.starts_with(&format!("MAINPID={}\n", successor.0)),
        "{message}"
    );
    let last = successor.stop(first);
    assert_eq!(app(&last, "a")["counters"]["kernel_drops"], 0, "{last}");
}

/// 2 000 numbered UDP datagrams a second for 2 s from host 0 to host 1 through `s`, with
/// `action` 0.7 s in; how many of the 4 000 arrived, and what `action` returned.
fn numbered_stream_around<T>(h: &TwoHosts, s: &Stitch, action: impl FnOnce() -> T) -> (u64, T) {
    let dir = s.path().to_path_buf();
    std::fs::write(dir.join("send.py"), NUMBERED_SENDER).unwrap();
    std::fs::write(dir.join("count.py"), NUMBER_COUNTER).unwrap();
    let counter = h.spawn_ready(1, &format!("python3 {}", dir.join("count.py").display()));
    let (count, gap) = (4000, 0.0005);
    let sender = h.spawn(
        0,
        &format!(
            "python3 {} {} {count} {gap}",
            dir.join("send.py").display(),
            h.ip[1]
        ),
    );
    std::thread::sleep(std::time::Duration::from_millis(700));
    let done = action();
    assert!(sender.finish().status.success());
    (counter.finish().trim().parse().unwrap(), done)
}

/// The numbered stream through `first`, upgraded in the middle; fails if more than 1 ms of
/// the stream (2 datagrams) is lost.
fn numbered_stream_across_an_upgrade(
    h: &TwoHosts,
    first: &Stitch,
) -> (Successor, serde_json::Value) {
    let (received, (successor, report)) = numbered_stream_around(h, first, || upgrade(first));
    eprintln!("{received} of 4000 datagrams received; the upgrade: {report}");
    let lost = 4000 - received;
    assert!(
        lost <= 2,
        "{lost} of 4000 datagrams lost across the upgrade ({report}); where they went: {}",
        first.stats().unwrap_or_default()
    );
    (successor, report)
}

/// A function process (the firewall, dropping UDP to port 7009) in `mode` between two
/// interfaces.
fn function_graph(h: &TwoHosts, nf: &std::path::Path, mode: &str) -> String {
    format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  fw:
    placement: process
    command: [stitch-nf-firewall, --drop-proto, udp, --drop-dport, \"7009\"]
    mode: {mode}
    socket: {nf}
links:
  - \"a.output -> fw.input\"
  - \"fw.output -> b.input\"
  - \"b.output -> a.input\"
",
        a = h.outer[0],
        b = h.outer[1],
        nf = nf.display()
    )
}

/// The function process keeps running, attached, through the upgrade: same pid, no second
/// attach, the numbered stream through it loses nothing; the successor supervises it (a kill
/// restarts it) and stops it when it stops.
fn a_function_process_carries_on_across_an_upgrade(mode: &str) {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let first = Stitch::run(&function_graph(&h, &nf, mode));
    wait_until("the firewall process to attach", 20, || {
        show(&first, "fw")["attached"] == true
    });
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let pid = pid_of(&first, "fw").unwrap();
    let (successor, report) = numbered_stream_across_an_upgrade(&h, &first);
    assert_eq!(report["packets_left_queued"], 0, "{report}");
    let fw = show(&first, "fw");
    assert_eq!(fw["process"]["pid"].as_i64(), Some(pid as i64), "{fw}");
    assert_eq!(fw["process"]["starts"], 1, "{fw}");
    assert_eq!(fw["attached"], true, "{fw}");
    let stats = first.stats().unwrap();
    let counters = &app(&stats, "fw")["counters"];
    assert_eq!(counters["attaches"], 1, "attached again: {counters}");
    assert_eq!(counters["reclaimed_drops"], 0, "{counters}");
    assert_eq!(counters["bad_descriptors"], 0, "{counters}");
    assert!(
        counters["from_function"].as_u64() > Some(4000),
        "{counters}"
    );
    // The function reads the packets this process hands it (zero-copy: in this process's
    // memory, which it was given): its rule still drops what it should, and only that.
    let dir = first.path().to_path_buf();
    let counter = h.spawn_ready(
        1,
        &format!("python3 {} 7009 3", dir.join("count.py").display()),
    );
    let sent = h.exec(
        0,
        &format!(
            "python3 {} {} 50 0.001 7009",
            dir.join("send.py").display(),
            h.ip[1]
        ),
    );
    assert!(sent.status.success());
    assert_eq!(
        counter.finish().trim(),
        "0",
        "the rule dropping port 7009 lapsed"
    );
    // A function stopped with packets in its ring cannot give them back: the upgrade is
    // abandoned, says why, and the instance carries on; continued, the function catches up.
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let counter = h.spawn_ready(
        1,
        &format!("python3 {} 7008 5", dir.join("count.py").display()),
    );
    h.exec(
        0,
        &format!(
            "python3 {} {} 20 0.001",
            dir.join("send.py").display(),
            h.ip[1]
        ),
    );
    let o = upgrade_with(&first, env!("CARGO_BIN_EXE_stitch"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&format!("its function (pid {pid}) kept")) && err.contains("carries on"),
        "{err}"
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(counter.finish().trim(), "20", "held packets lost");
    // The successor supervises the function it took over: killed, it is started again.
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the firewall to be started again and attach", 20, || {
        let fw = show(&first, "fw");
        fw["attached"] == true
            && fw["process"]["pid"]
                .as_i64()
                .is_some_and(|p| p != pid as i64)
    });
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the restart");
    let again = pid_of(&first, "fw").unwrap();
    successor.stop(first);
    wait_until("the function to stop with the successor", 10, || {
        !alive(again)
    });
}

#[test]
fn a_zero_copy_function_process_carries_on_across_an_upgrade() {
    a_function_process_carries_on_across_an_upgrade("zero_copy");
}

#[test]
fn an_isolated_function_process_carries_on_across_an_upgrade() {
    a_function_process_carries_on_across_an_upgrade("isolated");
}

/// `stitch run --supervise` whose instance is killed -9 mid-stream: the parent starts it
/// again, and the new process adopts the function process the old one left running (same
/// pid, attached again; what was in the old rings is counted in `restart_lost`); the stream
/// flows again. After an upgrade, SIGUSR2 to the parent upgrades the successor, and SIGTERM
/// to the parent stops the last process and the function.
#[test]
fn a_supervised_instance_killed_9_comes_back_and_adopts_its_function_process() {
    require_root_and_tools(&["ip", "python3", "pgrep"]);
    let h = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let graph = function_graph(&h, &nf, "zero_copy");
    let s = Stitch::run_with(&graph, &["--supervise", "--keep-running"]);
    wait_until("the firewall process to attach", 20, || {
        show(&s, "fw")["attached"] == true
    });
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the crash");
    let fw_pid = pid_of(&s, "fw").unwrap();
    let parent = s.process.0.id();
    let instance = || {
        must(&format!("pgrep -P {parent}"))
            .trim()
            .parse::<i32>()
            .unwrap()
    };
    let first = instance();
    let (received, ()) = numbered_stream_around(&h, &s, || {
        // SAFETY: kill takes no pointers.
        unsafe { libc::kill(first, libc::SIGKILL) };
    });
    eprintln!("{received} of 4000 datagrams received across kill -9 and a supervised restart");
    // However long the restart took on a busy machine, the instance comes back in another
    // process, with the same function attached again.
    wait_until("the instance to come back with its function", 30, || {
        let fw = s.stats().map(|_| show(&s, "fw"));
        fw.is_some_and(|fw| fw["attached"] == true)
    });
    let second = instance();
    assert_ne!(second, first);
    let fw = show(&s, "fw");
    assert_eq!(fw["process"]["pid"].as_i64(), Some(fw_pid as i64), "{fw}");
    assert!(
        (fw["process"]["carried_over"].as_str()).is_some_and(|c| c.contains("kept running")),
        "{fw}"
    );
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the restart");
    let stats = s.stats().unwrap();
    let counters = &app(&stats, "fw")["counters"];
    assert!(counters["restart_lost"].as_u64().is_some(), "{counters}");
    assert!(counters["from_function"].as_u64() > Some(0), "{counters}");
    eprintln!("the function's port: {counters}");
    // Upgraded, the instance runs in a process that is not the parent's child: the parent
    // follows it, and SIGTERM to the parent still stops it, and the function with it.
    let (successor, _) = upgrade(&s);
    wait_until("the old process to leave", 10, || !alive(second));
    assert!(alive(successor.0) && alive(parent as i32));
    // SIGUSR2 to the parent reaches the process it follows, which upgrades in turn.
    // SAFETY: as above.
    unsafe { libc::kill(parent as i32, libc::SIGUSR2) };
    wait_until("the successor to hand over on SIGUSR2", 30, || {
        !alive(successor.0)
    });
    let third = newest_take_over(&s);
    assert_ne!(third.0, successor.0);
    wait_until("the instance to answer after SIGUSR2", 10, || {
        s.stats().is_some()
    });
    assert_eq!(pid_of(&s, "fw"), Some(fw_pid), "the function was restarted");
    assert!(h.reaches(0, &h.ip[1], 10), "no path after SIGUSR2");
    // SAFETY: as above.
    unsafe { libc::kill(parent as i32, libc::SIGTERM) };
    let out = s.process.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !alive(third.0),
        "the successor outlived the parent's SIGTERM"
    );
    wait_until("the function to stop with the instance", 10, || {
        !alive(fw_pid)
    });
}

#[test]
fn a_new_process_that_cannot_take_over_leaves_the_instance_running() {
    require_root_and_tools(&["ip"]);
    let h = TwoHosts::new();
    let graph = format!(
        "apps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\nlinks:\n  - \"a.output -> b.input\"\n  - \"b.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    );
    let first = Stitch::run(&graph);
    assert!(h.reaches(0, &h.ip[1], 10));
    // A binary that does not start at all.
    let o = upgrade_with(&first, "/bin/false");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("without taking over") && err.contains("carries on"),
        "{err}"
    );
    // One that starts, is given the instance and fails while the workers are parked: too few
    // descriptors allowed to receive them.
    let o = upgrade_with(&first, &cramped_stitch(&first));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("ulimit -n") && err.contains("carries on"),
        "{err}"
    );
    // The old process runs on: it forwards, and its API answers.
    assert!(
        h.reaches(0, &h.ip[1], 10),
        "no path after the failed upgrade"
    );
    // An older Stitch, which reads only hand-over format 3 (it would open vhost-user ports,
    // VMs, kernel apps and capture files afresh under this process): refused with the reason
    // before anything pauses.
    let older = {
        use std::io::{Read, Write};
        let path = stitch_api::handover::socket_path(&first.socket);
        let mut conn = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let request = br#"{"take_over":3,"pid":1}"#;
        conn.write_all(&(request.len() as u32).to_le_bytes())
            .unwrap();
        conn.write_all(request).unwrap();
        let mut len = [0u8; 4];
        conn.read_exact(&mut len).unwrap();
        let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
        conn.read_exact(&mut reply).unwrap();
        String::from_utf8(reply).unwrap()
    };
    assert!(
        older.contains("refused") && older.contains("is the new binary older?"),
        "{older}"
    );
    assert!(
        h.reaches(0, &h.ip[1], 10),
        "no path after the refused upgrade"
    );
    let stats = first.stop();
    assert!(app(&stats, "a")["rx_packets"].as_u64() > Some(0), "{stats}");
}

/// This build of Stitch, started with too few descriptors allowed to receive what an instance
/// lends it: it fails once lent everything, while the old process's workers are parked.
fn cramped_stitch(s: &Stitch) -> String {
    let wrapper = s.path().join("cramped-stitch");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nulimit -n 9\nexec {} \"$@\"\n",
            env!("CARGO_BIN_EXE_stitch")
        ),
    )
    .unwrap();
    must(&format!("chmod +x {}", wrapper.display()));
    wrapper.display().to_string()
}

/// The flows, group and meter `ovs-ofctl` gave the switch, with their counters, in the table
/// after an upgrade; the controller's socket is the same; packets go on flowing.
#[test]
fn an_openflow_switch_keeps_its_tables_and_its_controller_socket_across_an_upgrade() {
    require_root_and_tools(&["ip", "ovs-ofctl"]);
    let h = TwoHosts::new();
    let port = free_port();
    let graph = format!(
        "apps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\n  sw: {{ type: switch, ports: [a, b], listen: \"127.0.0.1:{port}\" }}\nlinks:\n  - \"a.output -> sw.a\"\n  - \"sw.a -> a.input\"\n  - \"b.output -> sw.b\"\n  - \"sw.b -> b.input\"\n",
        h.outer[0], h.outer[1]
    );
    let first = Stitch::run(&graph);
    ofctl(
        port,
        &["add-meter", "meter=7,kbps,band=type=drop,rate=100000"],
    );
    ofctl(port, &["add-group", "group_id=3,type=all,bucket=output:2"]);
    ofctl(
        port,
        &["add-flow", "priority=10,in_port=1,actions=meter:7,group:3"],
    );
    ofctl(
        port,
        &["add-flow", "priority=10,in_port=2,actions=output:1"],
    );
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let flows = |dump: &str| -> Vec<String> {
        let mut f: Vec<String> = (dump.lines())
            .filter(|l| l.contains("priority="))
            .map(|l| {
                // Without what changes by itself: the duration and the counters.
                (l.split(", ")
                    .filter(|f| !f.contains("duration=") && !f.contains("n_")))
                .collect::<Vec<_>>()
                .join(", ")
            })
            .collect();
        f.sort();
        f
    };
    let packets = |dump: &str| -> u64 {
        (dump.split([',', ' ']))
            .filter_map(|f| f.strip_prefix("n_packets="))
            .filter_map(|n| n.parse::<u64>().ok())
            .sum()
    };
    let before = ofctl(port, &["dump-flows"]);
    let rx_packets = |port_stats: &str| -> u64 {
        (port_stats.split([',', ' ']))
            .filter_map(|f| f.strip_prefix("pkts="))
            .filter_map(|n| n.parse::<u64>().ok())
            .sum()
    };
    let ports_before = ofctl(port, &["dump-ports"]);
    let (successor, report) = upgrade(&first);
    assert!(
        report["state_restored"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "sw"),
        "{report}"
    );
    let after = ofctl(port, &["dump-flows"]);
    assert_eq!(flows(&after), flows(&before), "{after}");
    // Port counters go on from where they were (a controller's rates of them never drop).
    let ports_after = ofctl(port, &["dump-ports"]);
    assert!(
        rx_packets(&ports_after) >= rx_packets(&ports_before) && rx_packets(&ports_before) > 0,
        "{ports_before}\n{ports_after}"
    );
    assert!(
        packets(&after) >= packets(&before) && packets(&before) > 0,
        "{before}\n{after}"
    );
    assert!(ofctl(port, &["dump-groups"]).contains("group_id=3,type=all,bucket=actions=output:2"));
    assert!(ofctl(port, &["dump-meters"]).contains("meter=7"));
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the upgrade");
    successor.stop(first);
}

/// A TAP device is handed over open: it never goes away, so it keeps its index and the
/// address the host gave it, across two upgrades in a row.
/// Two `af_packet` ports on the hosts' veths with `apps` between them: host 0's frames go
/// `a → hops… → b`, host 1's straight back to `a`.
fn ports_around(h: &TwoHosts, apps: &str, hops: &[&str]) -> String {
    let mut path = vec!["a.output".to_string()];
    for hop in hops {
        path.push(format!("{hop}.input"));
        path.push(format!("{hop}.output"));
    }
    path.push("b.input".into());
    let links: String = (path.chunks(2))
        .map(|w| format!("  - \"{} -> {}\"\n", w[0], w[1]))
        .collect();
    format!(
        "apps:\n  a: {{ type: af_packet, interface: {} }}\n  b: {{ type: af_packet, interface: {} }}\n{apps}links:\n{links}  - \"b.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    )
}

/// Upgrades `s` while host 0 pings `to` every 10 ms (`what`: where the pings go, for the
/// messages): all 300 answered. The new process.
fn upgrade_under_pings(h: &TwoHosts, s: &Stitch, to: &str, what: &str) -> Successor {
    let mut upgraded = None;
    let paced = paced_ping_while(h, 0, to, || upgraded = Some(upgrade(s)));
    let (successor, report) = upgraded.unwrap();
    let summary: Vec<&str> = paced.lines().rev().take(2).collect();
    eprintln!("pings {what} across the upgrade: {summary:?}");
    assert!(
        ping_lost_nothing(&paced, 300),
        "pings {what} lost across the upgrade ({report}): {paced}"
    );
    successor
}

/// Kills (-9) the process a `--supervise` parent runs the instance in, and waits for the
/// parent to run it again with app `name` placed as `placement`.
fn crash_supervised(s: &Stitch, name: &str, placement: &str) {
    let parent = s.process.0.id();
    let first: i32 = must(&format!("pgrep -P {parent}")).trim().parse().unwrap();
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(first, libc::SIGKILL) };
    wait_until("the instance to come back with its graph", 30, || {
        s.stats().is_some()
            && must(&format!("pgrep -P {parent}")).trim() != first.to_string()
            && try_show(s, name).is_ok_and(|v| v["placement"] == placement)
    });
}

/// Stops a `--supervise` instance upgraded to `successor` by SIGTERM to its parent, which
/// must end well.
fn stop_supervised(s: Stitch, successor: Successor) {
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(s.process.0.id() as i32, libc::SIGTERM) };
    let out = s.process.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(successor);
}

/// `af_xdp` ports through an upgrade: the new process maps the same sockets' rings and UMEM,
/// the XDP program stays attached and its maps point at the same sockets throughout, and the
/// numbered stream loses nothing; the successor removes the program when it stops. Port `a`
/// steers UDP (the stream) out of a port of its own, so its steering socket crosses too.
#[test]
fn af_xdp_ports_carry_on_across_an_upgrade() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let first = Stitch::run(&format!(
        "apps:\n  a: {{ type: af_xdp, interface: {}, steer: [{{ match: udp, to: udp }}] }}\n  b: {{ type: af_xdp, interface: {} }}\n  j: {{ type: join }}\nlinks:\n  - \"a.output -> j.other\"\n  - \"a.udp -> j.udp\"\n  - \"j.output -> b.input\"\n  - \"b.output -> a.input\"\n",
        h.outer[0], h.outer[1]
    ));
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let (successor, report) = numbered_stream_across_an_upgrade(&h, &first);
    assert_eq!(report["packets_left_queued"], 0, "{report}");
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the upgrade");
    let xdp_attached = || must(&format!("ip link show {}", h.outer[0])).contains("xdp");
    assert!(xdp_attached(), "the XDP program left with the old process");
    let last = successor.stop(first);
    let a = &app(&last, "a")["counters"];
    assert_eq!(a["rx_malformed_drops"], 0, "{last}");
    assert!(
        a["steered_packets"].as_u64() > Some(0),
        "the successor received the stream on the steering socket: {a}"
    );
    assert!(!xdp_attached(), "the XDP program outlived the instance");
}

/// Host 0's UDP steered by `a` to function `fw`, whose output goes on to host 1; the rest
/// of host 0's frames straight there, and host 1's back.
fn steered_function_graph(h: &TwoHosts, dir: &std::path::Path) -> String {
    format!(
        "apps:
  a: {{ type: af_xdp, interface: {a}, steer: [{{ match: udp, to: udp }}] }}
  b: {{ type: af_xdp, interface: {b} }}
  fw: {{ placement: process, command: [stitch-nf-firewall], socket: {nf} }}
  j: {{ type: join }}
links:
  - \"a.udp -> fw.input\"
  - \"fw.output -> j.udp\"
  - \"a.output -> j.other\"
  - \"j.output -> b.input\"
  - \"b.output -> a.input\"
",
        a = h.outer[0],
        b = h.outer[1],
        nf = dir.join("nf.sock").display()
    )
}

/// The function that reads `a`'s steered rings, if one does.
fn read_by(s: &Stitch) -> serde_json::Value {
    let (_, v) = s.call("POST", "/api/v1/apps/a/query", Some("{}"));
    v["read_by"]["udp"].clone()
}

/// A function reading an interface's frames straight from its rings (steering) through an
/// upgrade: the successor's port takes on the function where it stands, the successor's
/// `af_xdp` leaves the rings to it, and the numbered stream (UDP, all steered) loses nothing.
#[test]
fn a_steered_function_carries_on_across_an_upgrade() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let first = Stitch::run(&steered_function_graph(&h, dir.path()));
    wait_until("the function to read the interface's rings", 20, || {
        read_by(&first) == "fw"
    });
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let (successor, report) = numbered_stream_across_an_upgrade(&h, &first);
    assert_eq!(
        read_by(&first),
        "fw",
        "the successor left the rings to the function"
    );
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the upgrade");
    let last = successor.stop(first);
    let fw = &app(&last, "fw")["counters"];
    assert_eq!(fw["bad_descriptors"], 0, "{fw}");
    assert!(fw["steered_packets"].as_u64() > Some(0), "{fw}");
    assert_eq!(
        fw["to_function"], 0,
        "nothing went through the engine: {fw}"
    );
    eprintln!("{report}\n{fw}");
}

/// A supervised instance killed -9 while a function reads an interface's rings: the function
/// lets go of the dead instance's sockets, the restarted instance binds the queue afresh,
/// adopts the function and steers to it again; the stream flows on.
#[test]
fn a_steered_function_is_steered_to_again_after_its_instance_is_killed() {
    require_root_and_tools(&["ip", "python3", "pgrep"]);
    let h = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let s = Stitch::run_with(
        &steered_function_graph(&h, dir.path()),
        &["--supervise", "--keep-running"],
    );
    wait_until("the function to read the interface's rings", 20, || {
        read_by(&s) == "fw"
    });
    let fw_pid = pid_of(&s, "fw").unwrap();
    let (received, ()) = numbered_stream_around(&h, &s, || crash_supervised(&s, "fw", "process"));
    eprintln!("{received} of 4000 datagrams received across kill -9 and a supervised restart");
    wait_until("the adopted function to be steered to again", 30, || {
        s.stats().is_some() && read_by(&s) == "fw"
    });
    assert_eq!(pid_of(&s, "fw"), Some(fw_pid), "the function was adopted");
    let (after, ()) = numbered_stream_around(&h, &s, || ());
    assert_eq!(after, 4000, "the stream through the adopted function");
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(s.process.0.id() as i32, libc::SIGTERM) };
    let out = s.process.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two guests (Stitch's virtio-net driver on each port) joined by the switch's direct path
/// through an upgrade: the old process's worker stops copying between two breaths, the
/// successor carries both vhost-user connections and the switch's flows on, and gives the
/// pair a direct path again; every numbered frame arrives once, in order.
#[test]
fn a_direct_path_between_vms_carries_on_across_an_upgrade() {
    require_root_and_tools(&["ovs-ofctl"]);
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let first = Stitch::run(&switch_between_two_vm_ports(dir.path(), port));
    ofctl(
        port,
        &["add-flow", "priority=100,in_port=1,actions=output:2"],
    );
    let frame = |buf: &mut [u8], seq: u32| {
        buf[..14].copy_from_slice(&[2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x88, 0xb5]);
        buf[14..18].copy_from_slice(&seq.to_be_bytes());
        buf[18..60].fill(0);
        60
    };
    let direct = |s: &Stitch| {
        let (_, v) = s.call("POST", "/api/v1/apps/sw/query", Some("{}"));
        v["direct_vm_paths"][0]["phase"] == "Direct"
    };
    let (mut a, mut b, warm) =
        guests_on_a_direct_path(&first, dir.path(), |buf| frame(buf, u32::MAX));
    const N: u32 = 6000;
    let (mut next, mut got) = (0u32, Vec::new());
    let mut successor = None;
    let t = std::time::Instant::now();
    while got.len() < N as usize && t.elapsed() < std::time::Duration::from_secs(30) {
        for _ in 0..8 {
            let seq = next;
            if next < N && a.send(1, |buf| frame(buf, seq)) == 1 {
                next += 1;
            }
        }
        b.receive(|f| {
            let seq = u32::from_be_bytes(f[14..18].try_into().unwrap());
            if seq != u32::MAX {
                got.push(seq);
            }
        });
        if next >= N / 3 && successor.is_none() {
            successor = Some(upgrade(&first).0);
        }
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
    let successor = successor.expect("upgraded mid-stream");
    assert_eq!(got.len(), N as usize, "every frame arrived ({warm} before)");
    assert!(
        got.iter().enumerate().all(|(i, &seq)| seq == i as u32),
        "once each, in order"
    );
    wait_until("the successor's direct path", 10, || direct(&first));
    let last = successor.stop(first);
    let sw = &app(&last, "sw")["counters"];
    assert!(sw["direct_channel_packets"].as_u64() > Some(0), "{sw}");
}

/// Two function processes (zero-copy firewalls) chained through the switch between the two
/// hosts, their rules point to point, a direct channel from the first to the second: an
/// upgrade hands the channel back to the switch first (no successor could take a channel
/// over), then the functions carry on in the successor, which gives the pair a channel again.
/// The numbered stream loses nothing across it; neither function attaches again.
#[test]
fn a_direct_channel_between_functions_is_given_back_and_offered_again_across_an_upgrade() {
    require_root_and_tools(&["ip", "python3", "ovs-ofctl"]);
    let h = TwoHosts::new();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let function = |name: &str| {
        format!(
            "  {name}: {{ placement: process, command: [stitch-nf-firewall], mode: zero_copy, \
             socket: {}/nf.sock }}\n",
            dir.path().display()
        )
    };
    let first = Stitch::run(&format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  sw: {{ type: switch, ports: [a, f0, f1, b], listen: \"127.0.0.1:{port}\" }}
{f0}{f1}links:
  - \"a.output -> sw.a\"
  - \"sw.f0 -> f0.input\"
  - \"f0.output -> sw.f0\"
  - \"sw.f1 -> f1.input\"
  - \"f1.output -> sw.f1\"
  - \"sw.b -> b.input\"
  - \"b.output -> a.input\"
",
        a = h.outer[0],
        b = h.outer[1],
        f0 = function("f0"),
        f1 = function("f1"),
    ));
    for flow in [
        "priority=100,in_port=1,actions=output:2",
        "priority=100,in_port=2,actions=output:3",
        "priority=100,in_port=3,actions=output:4",
    ] {
        ofctl(port, &["add-flow", flow]);
    }
    let channel_up = |what: &str| {
        wait_until(what, 20, || {
            let (_, shown) = first.call("POST", "/api/v1/apps/sw/query", Some("{}"));
            shown["direct_channels"][0]["phase"] == "ReceiverReads"
        })
    };
    channel_up("a direct channel f0 -> f1");
    // An upgrade abandoned after the channel was given back (the new process cannot receive
    // what it is lent): the switch offers the pair a channel again.
    let o = upgrade_with(&first, &cramped_stitch(&first));
    assert!(
        !o.status.success(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let handed_back = first.counter("sw", "direct_handback_ns");
    assert!(handed_back > Some(0), "the channel was given back");
    channel_up("a direct channel again after the abandoned upgrade");
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let (successor, report) = numbered_stream_across_an_upgrade(&h, &first);
    assert_eq!(report["packets_left_queued"], 0, "{report}");
    channel_up("the successor's direct channel f0 -> f1");
    for f in ["f0", "f1"] {
        assert_eq!(first.counter(f, "attaches"), Some(1), "{f} attached again");
    }
    let before = first.counter("sw", "direct_channel_packets").unwrap();
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the upgrade");
    let after = first.counter("sw", "direct_channel_packets").unwrap();
    assert!(
        after > before,
        "the new channel carries: {before} then {after}"
    );
    successor.stop(first);
}

/// A guest's virtio driver (testpmd's virtio-user, forwarding what it receives back) never
/// sees its vhost-user connection go: the successor carries the port on in the same rings, on
/// the same connection, and the numbered stream through the guest loses nothing.
#[test]
fn a_vhost_user_guest_keeps_its_connection_across_an_upgrade() {
    require_root_and_tools(&["ip", "python3", "dpdk-testpmd"]);
    // testpmd polls a core: beside a TCG guest the instance starved and its socket dropped.
    let _one = one_guest_test_at_a_time();
    let h = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vm.sock");
    let first = Stitch::run(&ports_around(
        &h,
        &format!("  vm: {{ type: vhost_user, socket: {} }}\n", sock.display()),
        &["vm"],
    ));
    let guest = Testpmd::start_io(&sock);
    let ready = |s: &Stitch| {
        let (_, v) = s.call("POST", "/api/v1/apps/vm/query", Some("{}"));
        (v["queues"].as_array()).is_some_and(|q| q.iter().all(|q| q["ready"] == true))
    };
    wait_until("testpmd to set its rings up", 20, || ready(&first));
    // testpmd sets its port up more than once while starting.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(h.reaches(0, &h.ip[1], 10), "no path through the guest");
    let (successor, report) = numbered_stream_across_an_upgrade(&h, &first);
    assert_eq!(report["packets_left_queued"], 0, "{report}");
    assert!(ready(&first), "the rings are not running after the upgrade");
    let counters = app(&first.stats().unwrap(), "vm")["counters"].clone();
    assert_eq!(
        counters["connections"], 1,
        "the guest connected again: {counters}"
    );
    assert_eq!(counters["guest_faults"], 0, "{counters}");
    // Traffic through the guest after the upgrade too (the successor's rings, its interrupts).
    assert!(
        h.reaches(0, &h.ip[1], 10),
        "no path through the guest after the upgrade"
    );
    let (received, sent) = guest.stop();
    assert!(
        received >= 4000 && sent >= 4000,
        "testpmd: {received} in, {sent} out"
    );
    let last = successor.stop(first);
    let to_guest = app(&last, "vm")["counters"]["to_guest_packets"]
        .as_u64()
        .unwrap();
    assert!(
        to_guest >= received,
        "{to_guest} given to the guest, {received} received"
    );
}

/// A VM Stitch runs (`placement: vm`) outlives Stitch. Killed -9 under `--supervise`: the
/// restarted instance adopts the same QEMU, which connects to its port again, and the guest
/// answers again. Upgraded: the same QEMU on the same vhost-user connection (the guest never
/// sees its link go), and every paced ping to the guest answered across the hand-over. The
/// instance stopped: the VM goes with it.
#[test]
fn a_vm_is_adopted_after_a_crash_and_carries_on_across_an_upgrade() {
    require_root_and_tools(&[
        "ip",
        "qemu-system-x86_64",
        "busybox",
        "cpio",
        "ping",
        "pgrep",
    ]);
    let _one = one_guest_test_at_a_time();
    let image = vm_image();
    let h = TwoHosts::new();
    let guest = format!("{}.11", h.ip[0].rsplit_once('.').unwrap().0);
    let graph = format!(
        "apps:\n  ns: {{ type: af_packet, interface: {} }}\n{}links:\n  - \"ns.output -> vm1.input\"\n  - \"vm1.output -> ns.input\"\n",
        h.outer[0],
        vm_app(&image, &format!("{guest}/24"), "sleep 3600", "52:54:00:00:00:11")
    );
    let s = Stitch::run_with(&graph, &["--supervise", "--keep-running"]);
    assert!(h.reaches(0, &guest, 120), "the guest: {}", show(&s, "vm1"));
    let qemu = pid_of(&s, "vm1").unwrap();
    crash_supervised(&s, "vm1", "vm");
    let vm = show(&s, "vm1");
    assert_eq!(
        vm["process"]["pid"].as_i64(),
        Some(qemu as i64),
        "QEMU was restarted: {vm}"
    );
    assert!(
        (vm["process"]["carried_over"].as_str()).is_some_and(|c| c.contains("kept running")),
        "{vm}"
    );
    assert!(
        h.reaches(0, &guest, 30),
        "the adopted guest does not answer: {vm}"
    );

    let successor = upgrade_under_pings(&h, &s, &guest, "to the guest");
    assert_eq!(pid_of(&s, "vm1"), Some(qemu), "QEMU was restarted");
    let stats = s.stats().unwrap();
    let counters = &app(&stats, "vm1")["counters"];
    assert_eq!(
        counters["connections"], 1,
        "the guest connected again: {counters}"
    );
    stop_supervised(s, successor);
    wait_until("the VM to stop with the instance", 10, || !alive(qemu));
}

/// A function in a guest (`rings: ivshmem`, isolated, `stitch-nf-firewall` between the two
/// hosts) across a crash of its instance and an upgrade; QEMU is adopted each time. Killed -9:
/// the guest's connection to the dead process ends, its function says its hello to the new one
/// and is served on new devices, and what the dead process plugged is swept from the guest.
/// Upgraded: the attachment is lent like a function process's — QEMU's connection, the region
/// still plugged in the guest, the rings' positions — and pings through the guest's function
/// lose nothing.
#[test]
fn a_function_in_a_guest_comes_back_after_a_crash_and_an_upgrade() {
    guest_function_across_a_crash_and_an_upgrade("isolated", 1);
}

/// The same in zero-copy mode: the guest maps Stitch's packet memory too. Upgraded, the
/// successor plugs its own packet memory into the guest and tells the function before the
/// first packet (the port holds its traffic meanwhile); the predecessor's goes once the
/// function took it: the guest ends with two devices again, and no ping is lost.
#[test]
fn a_zero_copy_function_in_a_guest_comes_back_after_a_crash_and_an_upgrade() {
    guest_function_across_a_crash_and_an_upgrade("zero_copy", 2);
}

/// A zero-copy function in a guest with no PCI slot to spare (27 more devices on its command
/// line: its region and packet memory take the last two): the successor cannot plug its packet
/// memory beside the predecessor's, so the take-over fails with QEMU's reason while it is
/// prepared, and the instance carries on — pings cross the guest's function, which never
/// attached again, and the guest lists its two devices, nothing of the successor's.
#[test]
fn a_guest_with_no_slot_for_the_successors_packet_memory_keeps_its_instance() {
    require_root_and_tools(&["qemu-system-x86_64", "busybox", "cpio", "ping", "lspci"]);
    let _one = one_guest_test_at_a_time();
    let image = vm_image_with("vm-image-nf", &["stitch-nf-firewall"]);
    let h = TwoHosts::new();
    let run = guest_watching_ivshmem("stitch-nf-firewall");
    let fillers = vec!["-device, virtio-rng-pci"; 27].join(", ");
    let vm =
        ivshmem_vm_app("vm1", &image, &run, "zero_copy") + &format!("    qemu_args: [{fillers}]\n");
    let s = Stitch::run(&ports_around(&h, &vm, &["vm1"]));
    wait_until("the guest's function to be served", 90, || {
        try_show(&s, "vm1").is_ok_and(|v| v["attached"] == true)
            && ivshmem_devices_now(&s, "vm1") == Some(2)
    });
    assert!(h.reaches(0, &h.ip[1], 30), "pings cross the guest");
    let devices = settled_ivshmem_addresses(&s, "vm1");
    let o = upgrade_with(&s, env!("CARGO_BIN_EXE_stitch"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("packet memory cannot be plugged") && err.contains("carries on"),
        "{err}"
    );
    assert!(
        h.reaches(0, &h.ip[1], 10),
        "pings cross after the failed upgrade"
    );
    assert_eq!(s.counter("vm1", "attaches"), Some(1));
    assert_eq!(settled_ivshmem_addresses(&s, "vm1"), devices);
    s.stop();
}

/// The ivshmem devices guest `vm` lists once its listing stayed the same for 2 s.
fn settled_ivshmem_addresses(s: &Stitch, vm: &str) -> Vec<String> {
    let changes = || console_of(s, vm).matches("IVSHMEM-AT=").count();
    let mut seen = (changes(), std::time::Instant::now());
    wait_until("the guest's devices to settle", 60, || {
        let now = changes();
        if now != seen.0 {
            seen = (now, std::time::Instant::now());
        }
        seen.1.elapsed() >= std::time::Duration::from_secs(2)
    });
    ivshmem_addresses_now(s, vm).unwrap()
}

/// `devices`: the ivshmem devices the guest sees while its function is served (the region,
/// and the packet memory in zero-copy mode).
fn guest_function_across_a_crash_and_an_upgrade(mode: &str, devices: u32) {
    require_root_and_tools(&[
        "qemu-system-x86_64",
        "busybox",
        "cpio",
        "ping",
        "pgrep",
        "lspci",
    ]);
    let _one = one_guest_test_at_a_time();
    let image = vm_image_with("vm-image-nf", &["stitch-nf-firewall"]);
    let h = TwoHosts::new();
    let run = guest_watching_ivshmem("stitch-nf-firewall");
    let vm = ivshmem_vm_app("vm1", &image, &run, mode);
    let s = Stitch::run_with(
        &ports_around(&h, &vm, &["vm1"]),
        &["--supervise", "--keep-running"],
    );
    let served = |s: &Stitch, what: &str| {
        let t = std::time::Instant::now();
        while !(try_show(s, "vm1").is_ok_and(|v| v["attached"] == true)
            && ivshmem_devices_now(s, "vm1") == Some(devices))
        {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(60),
                "the guest's function is not served {what} on {devices} devices: {:?}\nits console:\n{}",
                try_show(s, "vm1"),
                console_of(s, "vm1")
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert!(
            h.reaches(0, &h.ip[1], 30),
            "pings cross the guest {what}: {}\nits console:\n{}",
            serde_json::to_string_pretty(&s.stats()).unwrap(),
            console_of(s, "vm1")
        );
    };
    served(&s, "at first");
    let qemu = pid_of(&s, "vm1").unwrap();
    crash_supervised(&s, "vm1", "vm");
    served(&s, "after the crash");
    assert_eq!(
        pid_of(&s, "vm1"),
        Some(qemu),
        "QEMU was adopted, not restarted"
    );

    let attaches = s.counter("vm1", "attaches");
    // The dead process's devices swept, the new ones plugged: nothing changes for 2 s.
    let before = settled_ivshmem_addresses(&s, "vm1");
    assert_eq!(before.len(), devices as usize, "{before:?}");
    let successor = upgrade_under_pings(&h, &s, &h.ip[1], "through the guest's function");
    served(&s, "after the upgrade");
    // The region stays where it is; a zero-copy guest's packet memory is the successor's, a
    // device plugged before the predecessor's went (lspci lists them by address).
    let t = std::time::Instant::now();
    loop {
        let now = ivshmem_addresses_now(&s, "vm1").unwrap();
        let kept = now.iter().filter(|a| before.contains(a)).count();
        if now.len() == before.len() && kept == 1 {
            break;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "the predecessor's packet memory did not leave the guest: {before:?} before, \
             {now:?} now; its console:\n{}",
            console_of(&s, "vm1")
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // `stitch show` names the devices the guest lists.
    let shown = show(&s, "vm1");
    let mut named: Vec<String> = ["region", "pool"]
        .iter()
        .filter_map(|d| shown["guest_devices"][d]["pci"].as_str())
        .map(|pci| pci.trim_start_matches("0000:").to_string())
        .collect();
    named.sort();
    assert_eq!(Some(named), ivshmem_addresses_now(&s, "vm1"), "{shown}");
    assert_eq!(
        s.counter("vm1", "attaches"),
        attaches,
        "the guest's function was taken over, not attached again"
    );
    assert_eq!(pid_of(&s, "vm1"), Some(qemu), "QEMU was restarted");
    assert_eq!(s.counter("vm1", "guest_plug_refusals"), Some(0));
    stop_supervised(s, successor);
    wait_until("the VM to stop with the instance", 10, || !alive(qemu));
}

/// A kernel app (`placement: kernel`) between two engine ports. Killed -9 under `--supervise`:
/// the restarted instance takes the data plane the crashed one left as it runs (its pinned
/// counters go on, nothing is installed afresh). Upgraded: the data plane forwards throughout,
/// the successor's boundary ports read its BPF ring buffer on from where the predecessor
/// stopped, the numbered stream through it loses nothing, and the successor loads its own
/// programs into it. The instance stopped: the data plane goes with it.
#[test]
fn a_kernel_app_carries_on_across_a_crash_and_an_upgrade() {
    require_root_and_tools(&["ip", "python3", "pgrep"]);
    let h = TwoHosts::new();
    let planes = || {
        std::fs::read_dir("/sys/fs/bpf/stitch")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .collect::<std::collections::BTreeSet<_>>()
    };
    let before = planes();
    let graph = ports_around(&h, "  k: { type: forwarder, placement: kernel }\n", &["k"]);
    let s = Stitch::run_with(&graph, &["--supervise", "--keep-running"]);
    let made: Vec<_> = planes().difference(&before).cloned().collect();
    assert_eq!(made.len(), 1, "one data plane: {made:?}");
    assert!(h.reaches(0, &h.ip[1], 10), "no path through the kernel");
    let kernel_rx = |s: &Stitch| {
        let stats = s.stats().unwrap();
        assert_eq!(app(&stats, "k")["placement"], "kernel", "{stats}");
        app(&stats, "k")["rx_packets"].as_u64().unwrap()
    };
    let before_crash = kernel_rx(&s);
    crash_supervised(&s, "k", "kernel");
    assert!(
        kernel_rx(&s) >= before_crash,
        "the data plane was installed afresh after the crash"
    );
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the crash");

    let (successor, report) = numbered_stream_across_an_upgrade(&h, &s);
    assert_eq!(report["packets_left_queued"], 0, "{report}");
    assert!(
        report["kernel_programs_loaded_ms"].as_f64().is_some(),
        "{report}"
    );
    let after = kernel_rx(&s);
    assert!(
        after > before_crash + 4000,
        "the kernel's counters went on: {after}"
    );
    assert!(h.reaches(0, &h.ip[1], 10), "no path after the upgrade");
    assert!(
        kernel_rx(&s) > after,
        "the kernel forwards after the upgrade"
    );
    stop_supervised(s, successor);
    assert!(
        !Path::new("/sys/fs/bpf/stitch").join(&made[0]).exists(),
        "the data plane outlived the instance"
    );
}

/// A `capture` tap on the stream and a `pcap_sink` behind a tee, through an upgrade: each
/// file is one file written on by the new process after the old one's last record — every
/// numbered datagram in it once, in order — and tshark reads both to the end (the new process
/// writes the closing statistics blocks).
#[test]
fn capture_files_are_written_on_across_an_upgrade() {
    require_root_and_tools(&["ip", "python3", "tshark"]);
    let h = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let (sink_file, tap_file) = (dir.path().join("sink.pcapng"), dir.path().join("tap.pcap"));
    let first = Stitch::run(&format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  tap: {{ type: capture, file: {tap} }}
  t: {{ type: tee }}
  cap: {{ type: pcap_sink, file: {sink} }}
links:
  - \"a.output -> tap.input\"
  - \"tap.output -> t.input\"
  - \"t.a -> b.input\"
  - \"t.b -> cap.input\"
  - \"b.output -> a.input\"
",
        a = h.outer[0],
        b = h.outer[1],
        tap = tap_file.display(),
        sink = sink_file.display()
    ));
    assert!(h.reaches(0, &h.ip[1], 10), "no path before the upgrade");
    let (successor, _) = numbered_stream_across_an_upgrade(&h, &first);
    let last = successor.stop(first);
    for (file, app_name, counter) in [
        (&sink_file, "cap", "written"),
        (&tap_file, "tap", "captured"),
    ] {
        let numbers: Vec<u32> = tshark_checked_where(file, "udp.dstport == 7008", &["data.data"])
            .iter()
            .map(|hex| u32::from_str_radix(hex, 16).unwrap())
            .collect();
        assert_eq!(
            numbers.len(),
            4000,
            "{}: {} datagrams",
            file.display(),
            numbers.len()
        );
        assert!(
            numbers.windows(2).all(|w| w[1] == w[0] + 1),
            "{}: out of order or twice",
            file.display()
        );
        let recorded = app(&last, app_name)["counters"][counter].as_u64().unwrap();
        assert_eq!(capinfos_count(file), recorded, "{app_name}: {last}");
    }
}

#[test]
fn a_tap_device_stays_across_an_upgrade() {
    require_root_and_tools(&["ip", "pgrep"]);
    let name = format!("stup{}", std::process::id() % 100_000);
    let graph = format!(
        "apps:\n  t: {{ type: tap, name: {name} }}\n  s: {{ type: sink }}\nlinks:\n  - \"t.output -> s.input\"\n"
    );
    let first = Stitch::run(&graph);
    must(&format!("ip addr add 192.0.2.77/32 dev {name}"));
    let index = || must(&format!("cat /sys/class/net/{name}/ifindex"));
    let before = index();
    let (successor, _) = upgrade(&first);
    assert_eq!(index(), before, "the device was made again");
    assert!(must(&format!("ip -o addr show dev {name}")).contains("192.0.2.77/32"));
    // A process that took over can be upgraded in turn: it offers the `stitch run` command
    // line, not its own.
    let (third, report) = upgrade(&first);
    assert_eq!(
        report["from"].as_i64(),
        Some(successor.0 as i64),
        "{report}"
    );
    assert_eq!(index(), before, "the device was made again");
    drop(successor);
    // SIGUSR2 does the same, with the binary the process was started from.
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(third.0, libc::SIGUSR2) };
    wait_until("the process to hand over on SIGUSR2", 20, || {
        !alive(third.0)
    });
    let fourth = newest_take_over(&first);
    drop(third);
    assert_eq!(index(), before, "the device was made again");
    assert!(
        first.stats().is_some(),
        "the API does not answer after SIGUSR2"
    );
    fourth.stop(first);
    wait_until("the device to go with the instance", 10, || {
        !std::path::Path::new(&format!("/sys/class/net/{name}")).exists()
    });
}

/// `stitch bench upgrade` runs all four actions and counts frames, through the engine alone
/// and through a function process: none lost by an upgrade or a live apply; the restart after
/// kill -9 loses what came meanwhile (counted).
#[test]
fn the_upgrade_bench_counts_what_each_way_of_replacing_an_instance_loses() {
    require_root_and_tools(&["ip", "pgrep"]);
    for through in [&[][..], &["--function-process"][..]] {
        let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args([
                "bench", "upgrade", "--rounds", "1", "--rate", "2000", "--json",
            ])
            .args(through)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let lost = |action: &str| {
            rows.as_array()
                .unwrap()
                .iter()
                .find(|r| r["action"] == action)
                .unwrap()["lost"]
                .as_f64()
                .unwrap()
        };
        assert_eq!(lost("quiet"), 0.0, "{through:?}: {rows}");
        assert_eq!(lost("live apply"), 0.0, "{through:?}: {rows}");
        assert_eq!(lost("stitch upgrade"), 0.0, "{through:?}: {rows}");
        assert!(
            lost("kill -9 + restart") > 0.0,
            "{through:?}: a restart cannot keep the ring: {rows}"
        );
    }
}
