//! One graph, several placements: `placement: process` apps are function processes that
//! `stitch run` starts with their port in the environment, restarts when they die, holds to
//! their limits and stops when they leave the graph; what cannot be placed is a line-numbered
//! error before anything starts.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Host 0 → `fw` (a `stitch-nf-firewall` process dropping UDP) → host 1; host 1 → host 0 direct.
fn firewall_graph(hosts: &TwoHosts, nf_socket: &Path, with_fw: bool) -> String {
    let (a, b) = (&hosts.outer[0], &hosts.outer[1]);
    if with_fw {
        format!(
            "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  fw:
    placement: process
    command: [stitch-nf-firewall, --drop-proto, udp]
    env: {{ RUST_LOG: info }}
    memory_mb: 64
    cpu: 0.5
    socket: {nf}
links:
  - \"a.output -> fw.input\"
  - \"fw.output -> b.input\"
  - \"b.output -> a.input\"
",
            nf = nf_socket.display()
        )
    } else {
        format!(
            "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
links:
  - \"a.output -> b.input\"
  - \"b.output -> a.input\"
"
        )
    }
}

/// `stitch show` of the whole instance (what it placed where, what it made), as text.
fn instance_status(s: &Stitch) -> String {
    must(&format!(
        "{} show --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ))
}

/// Pings host 1 from host 0 until one answer comes (ARP first; the machine may be busy), for
/// at most 15 s.
fn ping(hosts: &TwoHosts) -> bool {
    hosts.reaches(0, &hosts.ip[1], 15)
}

/// The cgroup folders a function's limits live in, as `stitch show` reports them.
fn cgroups(v: &serde_json::Value) -> Vec<String> {
    v["process"]["limits"]["cgroups"]
        .as_array()
        .map(|a| a.iter().map(|c| c.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

#[test]
fn a_process_function_is_started_restarted_limited_and_stopped() {
    require_root_and_tools(&["ping"]);
    let hosts = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let s = Stitch::run_with(&firewall_graph(&hosts, &nf, true), &["--keep-running"]);

    // Started with its socket and port from the environment (the command names neither).
    wait_until("the firewall process to attach", 20, || {
        show(&s, "fw")["attached"] == true
    });
    let v = show(&s, "fw");
    assert_eq!(v["placement"], "process", "{v}");
    assert_eq!(v["process"]["state"], "running", "{v}");
    let first = v["process"]["pid"].as_i64().unwrap() as i32;
    let environ = std::fs::read(format!("/proc/{first}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(environ.contains("STITCH_NF_PORT=fw"), "{environ}");
    assert!(environ.contains("RUST_LOG=info"), "{environ}");
    assert!(
        ping(&hosts),
        "ping through the function process: {}\n{}",
        s.stats().unwrap(),
        show(&s, "fw")
    );

    // Its limits are the kernel's: the process sits in its cgroups with the limits written.
    let groups = cgroups(&v);
    assert!(!groups.is_empty(), "no cgroup: {v}");
    for g in &groups {
        let procs = std::fs::read_to_string(format!("{g}/cgroup.procs")).unwrap();
        assert!(
            procs.split_whitespace().any(|p| p == first.to_string()),
            "pid {first} not in {g}: {procs}"
        );
    }
    let limits = &v["process"]["limits"];
    let memory = limits["memory.max"]
        .as_str()
        .or(limits["memory.limit_in_bytes"].as_str())
        .unwrap();
    assert_eq!(memory, (64u64 << 20).to_string(), "{limits}");
    let cpu = limits["cpu.max"]
        .as_str()
        .or(limits["cpu.cfs_quota_us"].as_str())
        .unwrap();
    assert!(cpu.starts_with("50000"), "{limits}");

    // Killed, it comes back (counted, with how it ended), and traffic flows again.
    sh(&format!("kill -9 {first}"));
    wait_until("the firewall to be restarted", 20, || {
        let v = show(&s, "fw");
        v["process"]["restarts"].as_u64() >= Some(1)
            && v["process"]["pid"]
                .as_i64()
                .is_some_and(|p| p as i32 != first)
            && v["attached"] == true
    });
    let v = show(&s, "fw");
    assert_eq!(v["process"]["last_exit"], "killed by signal 9", "{v}");
    assert!(ping(&hosts), "ping after the restart");
    let stats = s.stats().unwrap();
    assert_eq!(app(&stats, "fw")["placement"], "process", "{stats}");
    assert_eq!(app(&stats, "a")["placement"], "engine", "{stats}");

    // Out of the graph, the process stops and its cgroups go; the rest keeps forwarding.
    let second = pid_of(&s, "fw").unwrap();
    s.apply(&firewall_graph(&hosts, &nf, false));
    wait_until("the process to stop", 10, || !alive(second));
    for g in &groups {
        assert!(!Path::new(g).exists(), "{g} left behind");
    }
    assert!(ping(&hosts), "ping without the function");

    // Back in, then Stitch stops: the process goes with it.
    s.apply(&firewall_graph(&hosts, &nf, true));
    wait_until("the firewall to attach again", 20, || {
        show(&s, "fw")["attached"] == true
    });
    let third = pid_of(&s, "fw").unwrap();
    s.stop();
    wait_until("the process to stop with stitch", 10, || !alive(third));
}

/// Stitch running the firewall graph with its function process attached.
fn firewall_running() -> (TwoHosts, tempfile::TempDir, std::path::PathBuf, Stitch) {
    let hosts = TwoHosts::new();
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let s = Stitch::run_with(&firewall_graph(&hosts, &nf, true), &["--keep-running"]);
    wait_until("the firewall process to attach", 20, || {
        show(&s, "fw")["attached"] == true
    });
    (hosts, dir, nf, s)
}

#[test]
fn a_crashed_instance_leaves_nothing_behind_after_the_next_start() {
    require_root_and_tools(&[]);
    let (hosts, dir, nf, s) = firewall_running();
    let v = show(&s, "fw");
    let pid = v["process"]["pid"].as_i64().unwrap() as i32;
    let groups = cgroups(&v);
    let socket = s.socket.clone();
    s.process.signal(libc::SIGKILL);
    let _ = s.process.finish();
    // The function outlives Stitch, asking for its port again (a Stitch started again would
    // adopt it) ...
    assert!(alive(pid), "the function died with stitch");
    // ... but the next start of the same instance has no firewall in its graph: it stops the
    // function and removes the cgroups the dead one left.
    let file = dir.path().join("graph.yaml");
    std::fs::write(&file, firewall_graph(&hosts, &nf, false)).unwrap();
    run_again(&socket, &file);
    wait_until("the function left running to be stopped", 5, || !alive(pid));
    for g in &groups {
        assert!(!Path::new(g).exists(), "{g} left behind by the crash");
    }
    drop(s.dir);
}

#[test]
fn what_cannot_be_placed_is_a_line_numbered_error_before_anything_starts() {
    let cases = [
        (
            "apps:\n  fw:\n    placement: process\n    command: [no-such-function-program]\n",
            "g.yaml:4",
            "no program `no-such-function-program`",
        ),
        (
            "apps:\n  f:\n    type: forwarder\n    placement: process\n",
            "g.yaml:3",
            "type `forwarder` has no process version",
        ),
        (
            "apps:\n  fw:\n    type: function\n    command: [stitch-nf-firewall]\n",
            "g.yaml:3",
            "give it `placement: process`",
        ),
        (
            "apps:\n  fw:\n    placement: process\n    command: [stitch-nf-firewall]\n    user: no-such-user-here\n",
            "g.yaml:5",
            "no user `no-such-user-here`",
        ),
        (
            "apps:\n  fw:\n    placement: process\n    command: [stitch-nf-firewall]\n    memory_mb: 0\n",
            "g.yaml:",
            "memory_mb 0",
        ),
        (
            "apps:\n  vm:\n    placement: vm\n    kernel: /no/such/vmlinux\n",
            "g.yaml:4",
            "kernel: no file /no/such/vmlinux",
        ),
        (
            "apps:\n  vm:\n    placement: vm\n    disk: /dev/null\n    qemu: no-such-qemu-here\n",
            "g.yaml:5",
            "no program `no-such-qemu-here`",
        ),
        (
            "apps:\n  vm:\n    type: vm\n    disk: /dev/null\n",
            "g.yaml:3",
            "give it `placement: vm`",
        ),
        (
            "apps:\n  vm:\n    placement: vm\n    memory_mb: 512\n",
            "g.yaml:",
            "give the VM a `kernel` to boot, a `disk`, or both",
        ),
        (
            "apps:\n  fw:\n    placement: satellite\n    command: [x]\n",
            "g.yaml:3",
            "none of `engine`, `kernel`, `process`, `vm`",
        ),
    ];
    for (graph, at, why) in cases {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("g.yaml");
        std::fs::write(&file, graph).unwrap();
        let check = Command::new(env!("CARGO_BIN_EXE_stitch"))
            .arg("check")
            .arg(&file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&check.stderr);
        assert!(!check.status.success(), "stitch check took:\n{graph}");
        assert!(err.contains(at) && err.contains(why), "{graph}\n{err}");
        let err = run_must_fail(graph);
        assert!(err.contains(why), "stitch run of\n{graph}\n{err}");
        assert!(!err.contains("started (pid"), "something started:\n{err}");
    }
}

/// Host 0 ⇄ `vm1`, a QEMU guest Stitch launches (`placement: vm`) from `scripts/vm-image`.
fn vm_graph(hosts: &TwoHosts, image: &Path, guest_ip: &str, with_vm: bool) -> String {
    let ns = &hosts.outer[0];
    if !with_vm {
        return format!("apps:\n  ns: {{ type: af_packet, interface: {ns} }}\n");
    }
    format!(
        "apps:
  ns: {{ type: af_packet, interface: {ns} }}
{vm}links:
  - \"ns.output -> vm1.input\"
  - \"vm1.output -> ns.input\"
",
        vm = vm_app(
            image,
            &format!("{guest_ip}/24"),
            "sleep 3600",
            "52:54:00:00:00:11"
        )
    )
}

#[test]
fn a_vm_is_launched_on_its_port_restarted_and_shut_down() {
    require_root_and_tools(&["qemu-system-x86_64", "busybox", "cpio", "ping"]);
    let image = vm_image();
    let hosts = TwoHosts::new();
    let prefix = hosts.ip[0].rsplit_once('.').unwrap().0.to_string();
    let guest_ip = format!("{prefix}.11");
    let s = Stitch::run_with(
        &vm_graph(&hosts, &image, &guest_ip, true),
        &["--keep-running"],
    );
    let v = show(&s, "vm1");
    assert_eq!(v["placement"], "vm", "{v}");
    let console = v["process"]["command"].to_string();
    assert!(console.contains("-serial"), "{v}");
    assert_eq!(v["process"]["kind"], "vm", "{v}");
    let first = v["process"]["pid"].as_i64().unwrap() as i32;
    let guest_answers = || hosts.reaches(0, &guest_ip, 90);
    assert!(
        guest_answers(),
        "the guest answers ping: {}",
        show(&s, "vm1")
    );
    // QEMU runs under its own seccomp filter (`-sandbox on`, docs/security.md).
    let status = std::fs::read_to_string(format!("/proc/{first}/status")).unwrap();
    assert!(status.lines().any(|l| l == "Seccomp:\t2"), "{status}");
    // And as the functions' user, without capabilities or a way to gain any
    // (docs/security.md); its port's socket is that user's alone.
    let field = |k: &str| {
        let line = status.lines().find(|l| l.starts_with(&format!("{k}:")));
        line.unwrap_or_default()
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string()
    };
    let fn_uid = sh("id -u stitch-fn");
    let fn_uid = String::from_utf8_lossy(&fn_uid.stdout).trim().to_string();
    assert_eq!(field("Uid"), fn_uid, "{status}");
    assert_eq!(field("CapEff"), "0000000000000000", "{status}");
    assert_eq!(field("CapBnd"), "0000000000000000", "{status}");
    assert_eq!(field("NoNewPrivs"), "1", "{status}");
    let port_socket = console
        .split("path=")
        .nth(1)
        .and_then(|rest| rest.split([',', '"']).next())
        .map(std::path::PathBuf::from)
        .expect("the port's socket in QEMU's command");
    let meta = std::fs::metadata(&port_socket).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.uid().to_string(), fn_uid);
    assert_eq!(meta.mode() & 0o777, 0o600);
    let socket = s.stats().unwrap();
    assert_eq!(app(&socket, "vm1")["placement"], "vm", "{socket}");
    // QEMU's own view of the guest: running; paused by an operator's `stop` on its QMP
    // socket, `stitch show` says so.
    let guest = |s: &Stitch| show(s, "vm1")["process"]["guest"]["status"].clone();
    assert_eq!(guest(&s), "running", "{}", show(&s, "vm1"));
    let command = show(&s, "vm1")["process"]["command"].to_string();
    let qmp = command
        .split("unix:")
        .find_map(|rest| rest.split(',').next().filter(|p| p.ends_with(".qmp")))
        .expect("the VM's QMP socket in its command");
    let mut q = stitch_place::qmp::Qmp::connect(Path::new(qmp), Duration::from_secs(5)).unwrap();
    q.execute("stop", None).unwrap();
    drop(q);
    assert_eq!(guest(&s), "paused", "{}", show(&s, "vm1"));
    let mut q = stitch_place::qmp::Qmp::connect(Path::new(qmp), Duration::from_secs(5)).unwrap();
    q.execute("cont", None).unwrap();
    drop(q);
    assert_eq!(guest(&s), "running", "{}", show(&s, "vm1"));

    // QEMU killed: started again, and the new guest answers.
    sh(&format!("kill -9 {first}"));
    wait_until("QEMU to be restarted", 20, || {
        let v = show(&s, "vm1");
        v["process"]["restarts"].as_u64() >= Some(1)
            && v["process"]["pid"]
                .as_i64()
                .is_some_and(|p| p as i32 != first)
    });
    assert!(guest_answers(), "the restarted guest answers ping");
    let second = pid_of(&s, "vm1").unwrap();

    // Out of the graph: powered down by its guest on the ACPI power button (the default
    // `shutdown_timeout_s`, 30 s, is not waited), its socket gone; the rest of the graph runs on.
    let console = show(&s, "vm1")["process"]["console"]
        .as_str()
        .expect("`stitch show` names the VM's console file")
        .to_string();
    s.apply(&vm_graph(&hosts, &image, &guest_ip, false));
    assert!(
        !alive(second),
        "QEMU still runs after the VM left the graph"
    );
    let said = std::fs::read_to_string(&console).unwrap();
    assert!(
        said.contains("STITCH-POWER-BUTTON"),
        "the guest powered itself off on the power button; its console:\n{said}"
    );
    let (_, log) = s.stop_with_log();
    assert!(
        log.contains("VM `vm1`: asked to power down") && log.contains("VM `vm1` stopped"),
        "the wait and its end are logged under the VM's name:\n{log}"
    );
    assert!(!log.contains("did not stop within"), "{log}");
}

/// Host 0 → `fw` (function process) → `r` (router in the kernel) → host 1, and back through
/// the kernel router to host 0, in one graph file.
fn mixed_graph(hosts: &TwoHosts, nf_socket: &Path, n: u32) -> String {
    format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  fw: {{ placement: process, command: [stitch-nf-firewall, --drop-proto, udp], socket: {nf} }}
  r:
    type: router
    placement: kernel
    interfaces:
      left: {{ mac: \"02:00:00:00:01:01\", address: \"10.{n}.1.1/24\" }}
      right: {{ mac: \"02:00:00:00:02:01\", address: \"10.{n}.2.1/24\" }}
links:
  - \"a.output -> fw.input\"
  - \"fw.output -> r.left\"
  - \"r.left -> a.input\"
  - \"b.output -> r.right\"
  - \"r.right -> b.input\"
",
        a = hosts.outer[0],
        b = hosts.outer[1],
        nf = nf_socket.display()
    )
}

fn listing(dir: &str) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

#[test]
fn kernel_engine_and_process_apps_run_as_one_graph_and_a_crash_leaves_nothing() {
    require_root_and_tools(&["ping", "iperf3", "tc"]);
    let hosts = TwoHosts::new();
    let n = 150 + std::process::id() % 50;
    hosts.two_subnets(n);
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let links_before = listing("/sys/class/net");
    let planes_before = listing("/sys/fs/bpf/stitch");
    let s = Stitch::run_with(&mixed_graph(&hosts, &nf, n), &["--keep-running"]);
    wait_until("the firewall process to attach", 20, || {
        show(&s, "fw")["attached"] == true
    });
    let (made, plane) = what_the_placements_made(&s, &links_before, &planes_before);
    traffic_crosses_the_kernel_router_and_is_counted(&hosts, &s, n);
    // Stitch killed: the next start of the same instance, without the function in its graph,
    // stops the function left running and removes the data plane (hooks, programs, pinned
    // maps) and the veth pairs it left.
    let fw_pid = pid_of(&s, "fw").unwrap();
    let socket = s.socket.clone();
    s.process.signal(libc::SIGKILL);
    let _ = s.process.finish();
    assert!(
        made.iter()
            .all(|l| Path::new(&format!("/sys/class/net/{l}")).exists()),
        "a crash leaves the veths (the next start removes them)"
    );
    let file = dir.path().join("graph.yaml");
    std::fs::write(&file, "apps:\n  g: { type: generator, count: 1 }\n  s: { type: sink }\nlinks: [\"g.output -> s.input\"]\n").unwrap();
    run_again(&socket, &file);
    wait_until("the function left running to be stopped", 5, || {
        !alive(fw_pid)
    });
    for l in &made {
        assert!(
            !Path::new(&format!("/sys/class/net/{l}")).exists(),
            "{l} left behind"
        );
    }
    assert!(
        !Path::new(&format!("/sys/fs/bpf/stitch/{plane}")).exists(),
        "data plane {plane} left behind"
    );
    drop(s.dir);
}

/// What this instance made (other tests make interfaces and data planes at the same time), as
/// `stitch show` lists it, all of it new: the interfaces and the data plane's name.
fn what_the_placements_made(
    s: &Stitch,
    links_before: &std::collections::BTreeSet<String>,
    planes_before: &std::collections::BTreeSet<String>,
) -> (Vec<String>, String) {
    let status = instance_status(s);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let plane = status["placements"]["kernel_data_plane"]
        .as_str()
        .unwrap_or_else(|| panic!("{status}"))
        .to_string();
    let mut made: Vec<String> = vec![format!("stl-{plane}"), format!("stp-{plane}")];
    for pair in status["placements"]["veth_pairs"].as_array().unwrap() {
        for end in ["kernel_end", "engine_end"] {
            made.push(pair[end].as_str().unwrap().to_string());
        }
    }
    // Two veth pairs join r.left and r.right to the engine; the data plane has its loop pair.
    assert_eq!(made.len(), 6, "{status}");
    for l in &made {
        assert!(
            !links_before.contains(l) && Path::new(&format!("/sys/class/net/{l}")).exists(),
            "{l}: {status}"
        );
    }
    assert!(!planes_before.contains(&plane));
    assert_eq!(
        status["placements"]["processes"][0]["app"], "fw",
        "{status}"
    );
    (made, plane)
}

/// Ping and TCP across the kernel router; its counters and the process's state in the
/// stats, /metrics and `stitch show`.
fn traffic_crosses_the_kernel_router_and_is_counted(hosts: &TwoHosts, s: &Stitch, n: u32) {
    let far = format!("10.{n}.2.2");
    let t = std::time::Instant::now();
    while !hosts
        .exec(0, &format!("ping -c 1 -W 1 {far}"))
        .status
        .success()
    {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(15),
            "ping across the kernel router: {}",
            s.stats().unwrap()
        );
    }
    let bits = hosts.iperf_tcp(&far, 2);
    assert!(bits > 1e6, "iperf3 TCP across the graph: {bits} bit/s");
    let stats = s.stats().unwrap();
    let r = app(&stats, "r");
    assert_eq!(r["placement"], "kernel", "{stats}");
    assert!(r["rx_packets"].as_u64().unwrap() > 100, "{r}");

    assert_eq!(app(&stats, "a")["placement"], "engine", "{stats}");
    // /metrics has the kernel router's counters and the function process's state too.
    let (_, metrics) =
        stitch_api::client::call(&s.socket, stitch_api::client::Method::GET, "/metrics", None)
            .unwrap();
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    assert!(
        metrics
            .contains("stitch_app_rx_packets_total{app=\"r\",type=\"router\",worker=\"kernel\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("stitch_process_up{app=\"fw\"} 1"),
        "{metrics}"
    );
    // `stitch show` without an app lists what the placements made: two veth pairs, the data
    // plane, the process.
    let status = instance_status(s);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["placements"]["veth_pairs"].as_array().unwrap().len(),
        2,
        "{status}"
    );
    assert!(
        status["placements"]["kernel_data_plane"].is_string(),
        "{status}"
    );
    assert_eq!(
        status["placements"]["processes"][0]["app"], "fw",
        "{status}"
    );
}

/// A firewall between the two hosts of `fw`, placed as `placement`, and beside it a path
/// between the two hosts of `other` that no change touches.
/// Host 0's interface is the kernel's (`placement: kernel`), so its TCP enters the data plane as
/// the sending stack made it — super-frames with checksums left to complete — and crosses to
/// the engine through the boundary's ring buffer; host 1 sends back through the engine and the
/// boundary's veth.
#[test]
fn tcp_from_a_kernel_interface_reaches_the_engine_whole_through_the_boundary_ring() {
    require_root_and_tools(&["ping", "iperf3", "tc"]);
    let hosts = TwoHosts::new();
    let (a, b) = (&hosts.outer[0], &hosts.outer[1]);
    let graph = format!(
        "apps:
  a: {{ type: af_packet, interface: {a}, placement: kernel }}
  k: {{ type: forwarder, placement: kernel }}
  e: {{ type: forwarder }}
  b: {{ type: af_packet, interface: {b} }}
links:
  - \"a.output -> k.input\"
  - \"k.output -> e.input\"
  - \"e.output -> b.input\"
  - \"b.output -> a.input\"
"
    );
    let s = Stitch::run_with(&graph, &["--keep-running"]);
    assert!(
        ping(&hosts),
        "ping across the boundary: {}",
        s.stats().unwrap()
    );
    let bits = hosts.iperf_tcp(&hosts.ip[1], 2);
    assert!(bits > 1e6, "iperf3 TCP across the boundary: {bits} bit/s");
    let stats = s.stats().unwrap();
    let boundary = app(&stats, "kernel-k-output");
    // The stack's super-frames arrived whole (a frame above the MTU with a partial checksum
    // would have been refused or sent on broken: TCP would not have run).
    let counters = &boundary["counters"];
    assert!(counters["gso_frames"].as_u64().unwrap() > 0, "{boundary}");
    assert_eq!(counters["rx_malformed_drops"], 0, "{boundary}");
    assert_eq!(counters["gso_refused_drops"], 0, "{boundary}");
    assert_eq!(app(&stats, "e")["drops"], 0, "{stats}");
    // None of it came through a veth: the engine ends of the pairs received nothing.
    let status = instance_status(&s);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let pairs = status["placements"]["veth_pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 2, "{status}");
    for pair in pairs {
        let end = pair["engine_end"].as_str().unwrap();
        let rx: u64 =
            std::fs::read_to_string(format!("/sys/class/net/{end}/statistics/rx_packets"))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
        assert!(rx < 10, "{end} received {rx} packets: {boundary}");
    }
    assert!(
        boundary["tx_packets"].as_u64().unwrap() > 1000,
        "{boundary}"
    );
}

fn move_graph(fw: &TwoHosts, other: &TwoHosts, placement: &str) -> String {
    format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  fw: {{ type: firewall, placement: {placement}, default: drop, rules: [ {{ action: accept, from: lan }} ] }}
  c: {{ type: af_packet, interface: {c} }}
  d: {{ type: af_packet, interface: {d} }}
links:
  - \"a.output -> fw.lan\"
  - \"fw.lan -> a.input\"
  - \"fw.wan -> b.input\"
  - \"b.output -> fw.wan\"
  - \"c.output -> d.input\"
  - \"d.output -> c.input\"
",
        a = fw.outer[0],
        b = fw.outer[1],
        c = other.outer[0],
        d = other.outer[1],
    )
}

#[test]
fn moving_the_firewall_engine_kernel_engine_pauses_only_its_own_traffic() {
    require_root_and_tools(&["ping", "tc"]);
    let (fw, other) = (TwoHosts::new(), TwoHosts::new());
    let s = Stitch::run_with(&move_graph(&fw, &other, "engine"), &["--keep-running"]);
    assert!(ping(&fw) && ping(&other), "{}", s.stats().unwrap());
    // 10 ms paced streams for 6 s: one through the firewall, one on the untouched path.
    // `-w`: the last replies are waited for (see `paced_ping_while`).
    let untouched = other.spawn(0, &format!("ping -n -i 0.01 -c 600 -w 15 {}", other.ip[1]));
    let through = fw.spawn(0, &format!("ping -D -n -i 0.01 -c 600 -w 15 {}", fw.ip[1]));
    std::thread::sleep(std::time::Duration::from_secs(1));
    for (to, from) in [("kernel", "engine"), ("engine", "kernel")] {
        let out = s.apply(&move_graph(&fw, &other, to));
        assert!(
            out.contains(&format!("moved: fw from {from} to {to}")),
            "{out}"
        );
        assert!(out.contains("connection table did not move"), "{out}");
        let stats = s.stats().unwrap();
        assert_eq!(app(&stats, "fw")["placement"], to, "{stats}");
        eprintln!("{}", out.lines().find(|l| l.starts_with("moved")).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(2000));
    }
    let untouched = String::from_utf8_lossy(&untouched.finish().stdout).into_owned();
    assert!(
        ping_lost_nothing(&untouched, 600),
        "the path beside the firewall lost packets while it moved: {untouched}"
    );
    let through = String::from_utf8_lossy(&through.finish().stdout).into_owned();
    let (replies, gap) = ping_replies_and_gap(&through, 0.0, f64::MAX);
    eprintln!(
        "through the moving firewall: {replies} of 600 replies, longest gap {:.0} ms",
        gap * 1e3
    );
    assert!(
        replies > 400,
        "traffic through the firewall resumed after each move: {through}"
    );
}

/// The whole platform in one graph: host A — firewall and NAT (engine) — a function process —
/// a router (kernel) — a bridge (engine) — host B and a QEMU guest (VM placement).
fn everything_graph(hosts: &TwoHosts, image: &Path, n: u32, nf_socket: &Path) -> String {
    format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
  fw: {{ type: firewall, default: drop, rules: [ {{ action: accept, from: lan }} ] }}
  nat: {{ type: nat, external: 10.{n}.1.100 }}
  nf: {{ placement: process, command: [stitch-nf-firewall, --drop-proto, udp], socket: {nf} }}
  r:
    type: router
    placement: kernel
    interfaces:
      left: {{ mac: \"02:00:00:00:01:01\", address: \"10.{n}.1.1/24\" }}
      right: {{ mac: \"02:00:00:00:02:01\", address: \"10.{n}.2.1/24\" }}
  br: {{ type: bridge, ports: {{ r: {{}}, b: {{}}, vm: {{}} }} }}
{vm}links:
  - \"a.output -> fw.lan\"
  - \"fw.lan -> a.input\"
  - \"fw.wan -> nat.lan\"
  - \"nat.lan -> fw.wan\"
  - \"nat.wan -> nf.input\"
  - \"nf.output -> r.left\"
  - \"r.left -> nat.wan\"
  - \"r.right -> br.r\"
  - \"br.r -> r.right\"
  - \"b.output -> br.b\"
  - \"br.b -> b.input\"
  - \"vm1.output -> br.vm\"
  - \"br.vm -> vm1.input\"
",
        a = hosts.outer[0],
        b = hosts.outer[1],
        vm = vm_app(
            image,
            &format!("10.{n}.2.11/24"),
            &format!("ip route add default via 10.{n}.2.1; iperf3 -s"),
            "52:54:00:00:00:12"
        ),
        nf = nf_socket.display()
    )
}

#[test]
fn every_placement_in_one_graph_carries_traffic_and_restarts_lose_nothing_elsewhere() {
    require_root_and_tools(&[
        "qemu-system-x86_64",
        "busybox",
        "cpio",
        "ping",
        "iperf3",
        "tc",
    ]);
    let image = vm_image();
    let hosts = TwoHosts::new();
    let n = 100 + std::process::id() % 50;
    hosts.two_subnets(n);
    // The router asks for the NAT's outside address; the NAT answers it.
    let dir = tempfile::tempdir().unwrap();
    let nf = dir.path().join("nf.sock");
    let s = Stitch::run_with(
        &everything_graph(&hosts, &image, n, &nf),
        &["--keep-running"],
    );
    let (host_b, guest) = (format!("10.{n}.2.2"), format!("10.{n}.2.11"));
    let answers = |to: &str, secs: u64| hosts.reaches(0, to, secs);
    assert!(
        answers(&host_b, 20),
        "host B through every placement: {}",
        s.stats().unwrap()
    );
    assert!(answers(&guest, 120), "the guest: {}", show(&s, "vm1"));
    let stats = s.stats().unwrap();
    for (name, placement) in [
        ("fw", "engine"),
        ("nat", "engine"),
        ("nf", "process"),
        ("r", "kernel"),
        ("vm1", "vm"),
        ("br", "engine"),
    ] {
        assert_eq!(app(&stats, name)["placement"], placement, "{name}: {stats}");
    }
    // TCP to host B and to the guest, both through the NAT, the process and the kernel router.
    let bits = hosts.iperf_tcp(&host_b, 2);
    assert!(bits > 1e6, "iperf3 to host B: {bits} bit/s");
    let guest_bits = iperf_bits(
        &hosts.exec(0, &format!("iperf3 -c {guest} -t 2 -J")),
        &guest,
    );
    eprintln!(
        "iperf3 TCP through every placement: host B {:.0} Mbit/s, the guest {:.0} Mbit/s",
        bits / 1e6,
        guest_bits / 1e6
    );

    // Killing the function process stops only the path through it: host B ↔ the guest
    // (through the bridge) loses nothing meanwhile; killing QEMU stops only the guest: host A ↔
    // host B (through everything else) loses nothing meanwhile.
    let nf_pid = pid_of(&s, "nf").unwrap();
    let paced = paced_ping_while(&hosts, 1, &guest, || {
        sh(&format!("kill -9 {nf_pid}"));
    });
    assert!(
        ping_lost_nothing(&paced, 300),
        "host B ↔ the guest lost packets while the function process was killed: {paced}"
    );
    wait_until("the function process to be restarted", 20, || {
        pid_of(&s, "nf").is_some_and(|p| p != nf_pid) && show(&s, "nf")["attached"] == true
    });
    assert!(
        answers(&host_b, 10),
        "host A reaches host B again after the process restarted"
    );
    let vm_pid = pid_of(&s, "vm1").unwrap();
    let paced = paced_ping_while(&hosts, 0, &host_b, || {
        sh(&format!("kill -9 {vm_pid}"));
    });
    assert!(
        ping_lost_nothing(&paced, 300),
        "host A ↔ host B lost packets while QEMU was killed: {paced}"
    );
    wait_until("QEMU to be restarted", 30, || {
        pid_of(&s, "vm1").is_some_and(|p| p != vm_pid)
    });
    assert!(answers(&guest, 120), "the restarted guest answers");
    // The last counters name every app where it ran, the kernel's router with what it
    // forwarded, the processes with their supervision.
    let last = s.stop();
    let placed = |name: &str| {
        let a = app(&last, name);
        (
            a["placement"].as_str().unwrap_or("?").to_string(),
            a.clone(),
        )
    };
    let (at, r) = placed("r");
    assert_eq!(at, "kernel", "{last}");
    assert!(r["rx_packets"].as_u64().unwrap_or(0) > 0, "{r}");
    let (at, nf) = placed("nf");
    assert_eq!(at, "process", "{last}");
    assert!(nf["process"]["starts"].as_u64().unwrap_or(0) >= 2, "{nf}");
    assert_eq!(placed("vm1").0, "vm", "{last}");
}

#[test]
fn stitch_cleanup_removes_what_a_crashed_instance_left_and_never_touches_a_live_one() {
    require_root_and_tools(&[]);
    let (_hosts, _dir, _nf, s) = firewall_running();
    let cleanup = |socket: &Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["cleanup", "--control"])
            .arg(socket)
            .output()
            .unwrap();
        (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    };
    let (ok, said) = cleanup(&s.socket);
    assert!(
        !ok && said.contains("it is running, nothing was removed"),
        "{said}"
    );
    let groups = cgroups(&show(&s, "fw"));
    assert!(!groups.is_empty());
    s.process.signal(libc::SIGKILL);
    let _ = s.process.finish();
    assert!(s.socket.exists(), "a process killed -9 leaves its socket");
    let (ok, said) = cleanup(&s.socket);
    assert!(ok, "{said}");
    assert!(
        said.contains("function cgroups") && said.contains("the API socket"),
        "{said}"
    );
    for g in &groups {
        assert!(!Path::new(g).exists(), "{g} left behind");
    }
    assert!(!s.socket.exists());
    let (ok, said) = cleanup(&s.socket);
    assert!(
        ok && said.contains("nothing left by a dead instance"),
        "{said}"
    );
    drop(s.dir);
}

/// Host 0 → `vm1`, a guest whose `stitch-nf-firewall` (dropping UDP) runs on the port's rings
/// hot-plugged as ivshmem devices (`rings: ivshmem`, `mode`) → host 1; host 1 → host 0 direct.
/// The guest runs `run`.
/// `more`: more of the VM's entry.
fn ivshmem_graph(hosts: &TwoHosts, image: &Path, run: &str, mode: &str, more: &str) -> String {
    let (a, b) = (&hosts.outer[0], &hosts.outer[1]);
    format!(
        "apps:
  a: {{ type: af_packet, interface: {a} }}
  b: {{ type: af_packet, interface: {b} }}
{vm}{more}links:
  - \"a.output -> vm1.input\"
  - \"vm1.output -> b.input\"
  - \"b.output -> a.input\"
",
        vm = ivshmem_vm_app("vm1", image, run, mode)
    )
}

/// Waits for `marker` on the VM's console; what the console said.
fn console_until(s: &Stitch, vm: &str, marker: &str, seconds: u64) -> String {
    let mut said = String::new();
    wait_until(&format!("`{marker}` on {vm}'s console"), seconds, || {
        said = console_of(s, vm);
        said.contains(marker)
    });
    said
}

/// The ivshmem devices (`1af4:1110`) in the `lspci -n` the guest printed before `marker`
/// (after the one before it).
fn ivshmem_devices(console: &str, marker: &str) -> Vec<String> {
    let upto = &console[..console.find(marker).expect("the marker")];
    let from = upto.rfind("-UP").map_or(0, |i| i + 3);
    (upto[from..].lines())
        .filter(|l| l.contains("1af4:1110"))
        .map(|l| l.split_whitespace().next().unwrap_or("").to_string())
        .collect()
}

/// The test of `rings: ivshmem` in `mode` (`more`: more of the VM's entry): the guest's
/// function forwards pings on hot-plugged rings; killed and started again in the guest, its
/// first devices are unplugged and new ones plugged (the guest's `lspci` shows it).
fn a_function_in_a_guest_forwards_on_ivshmem(mode: &str, devices: usize, more: &str) {
    require_root_and_tools(&["qemu-system-x86_64", "busybox", "cpio", "ping", "lspci"]);
    let _one = one_guest_test_at_a_time();
    let image = vm_image_with("vm-image-nf", &["stitch-nf-firewall"]);
    let hosts = TwoHosts::new();
    let lspci = "lspci -n | grep 1af4";
    let nf = "stitch-nf-firewall --drop-proto udp";
    let run = format!(
        "{lspci}; echo NONE-UP; {nf} & F=$!; \
         while ! lspci -n | grep -q 1af4:1110; do sleep 0.2; done; sleep 1; {lspci}; echo FIRST-UP; \
         sleep 8; kill $F; sleep 1; {nf} & sleep 6; {lspci}; echo SECOND-UP; sleep 3600"
    );
    let s = Stitch::run_with(
        &ivshmem_graph(&hosts, &image, &run, mode, more),
        &["--keep-running"],
    );
    // Attach number `n`; the guest's console and the port when it does not come.
    let attached = |n: u64| {
        let t = std::time::Instant::now();
        while s.counter("vm1", "attaches") != Some(n) || show(&s, "vm1")["attached"] != true {
            if t.elapsed() > Duration::from_secs(90) {
                let (v, said) = (show(&s, "vm1"), console_of(&s, "vm1"));
                panic!("no attach number {n} from the guest: {v}\nits console:\n{said}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    attached(1);
    let v = show(&s, "vm1");
    assert_eq!(v["in_guest"], true, "{v}");
    assert_eq!(v["pid"], v["process"]["pid"], "its QEMU: {v}");
    let said = console_until(&s, "vm1", "FIRST-UP", 30);
    assert!(
        ivshmem_devices(&said, "NONE-UP").is_empty(),
        "no ivshmem device before the function attached:\n{said}"
    );
    let first = ivshmem_devices(&said, "FIRST-UP");
    assert_eq!(first.len(), devices, "{said}");
    assert!(
        ping(&hosts),
        "pings cross the guest's function: {}",
        show(&s, "vm1")
    );
    let forwarded = s.counter("vm1", "from_function").unwrap();
    assert!(forwarded > 0, "{}", show(&s, "vm1"));
    // The function in the guest killed and started again: its hello comes on the same QEMU
    // connection; the first devices are unplugged, new ones plugged.
    attached(2);
    let said = console_until(&s, "vm1", "SECOND-UP", 60);
    let second = ivshmem_devices(&said, "SECOND-UP");
    assert_eq!(
        second.len(),
        devices,
        "the first devices were unplugged:\n{said}"
    );
    assert!(
        ping(&hosts),
        "pings cross the restarted function: {}",
        show(&s, "vm1")
    );
    assert_eq!(s.counter("vm1", "guest_plug_refusals"), Some(0));
    let (_, log) = s.stop_with_log();
    assert!(
        log.contains("removed from a guest what its function's last attachment left"),
        "{log}"
    );
    assert!(!log.contains("cannot remove"), "{log}");
}

#[test]
fn a_function_in_a_guest_forwards_on_ivshmem_rings() {
    a_function_in_a_guest_forwards_on_ivshmem("isolated", 1, "");
}

#[test]
fn a_function_in_a_guest_forwards_in_stitchs_packet_memory() {
    a_function_in_a_guest_forwards_on_ivshmem("zero_copy", 2, "");
}

/// The same on a PCI Express machine (q35), whose root bus takes no hot-plug: the devices go
/// into root ports the VM got for them.
#[test]
fn a_function_in_a_guest_of_a_pcie_machine_forwards_in_stitchs_packet_memory() {
    a_function_in_a_guest_forwards_on_ivshmem("zero_copy", 2, "    qemu_args: [-machine, q35]\n");
}

/// A function port served by hand (`t1`) and a supervised function (`fw`), neither naming a socket.
const TWO_FUNCTIONS: &str = "apps:
  gen: { type: generator, size: 64, rate: 2000 }
  t1: { type: nf_port, wake: blocking }
  out: { type: sink }
  gen2: { type: generator, size: 64, rate: 2000 }
  fw: { placement: process, command: [stitch-nf-firewall] }
  out2: { type: sink }
links:
  - \"gen.output -> t1.input\"
  - \"t1.output -> out.input\"
  - \"gen2.output -> fw.input\"
  - \"fw.output -> out2.input\"
";

/// Two instances named apart, each with function ports that name no socket: each serves a
/// socket of its own (`/run/stitch-fn/NAME.sock`), a function started by hand reaches the
/// instance it names (`--instance`), a supervised one is given its instance's, both carry
/// traffic at once, and a clean stop removes every file an instance made.
#[test]
fn two_instances_with_function_ports_run_side_by_side_and_leave_nothing() {
    require_root_and_tools(&[]);
    let stitch = env!("CARGO_BIN_EXE_stitch");
    let signature = Path::new(stitch).with_file_name("stitch-nf-signature");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("g.yaml");
    std::fs::write(&file, TWO_FUNCTIONS).unwrap();
    let names: Vec<String> = ["a", "b"]
        .iter()
        .map(|x| format!("t-fn-{}-{x}", std::process::id()))
        .collect();
    let files_of = |name: &str| {
        [
            format!("/run/stitch-fn/{name}.sock"),
            format!("/run/stitch/{name}.sock"),
            format!("/run/stitch/{name}.lock"),
        ]
    };
    let mut runs = Vec::new();
    let mut functions = Vec::new();
    for name in &names {
        let child = Command::new(stitch)
            .args(["run", "--name", name])
            .arg(&file)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        runs.push(Background(child));
        wait_until("the instance to answer", 20, || {
            sh(&format!("{stitch} stats --json --name {name}"))
                .status
                .success()
        });
        // The API answers before the graph is applied: its function ports come a moment later.
        let socket = format!("/run/stitch-fn/{name}.sock");
        wait_until(&format!("{socket} to be served"), 20, || {
            Path::new(&socket).exists()
        });
        functions.push(Background(
            Command::new(&signature)
                .args(["--instance", name, "t1"])
                .spawn()
                .unwrap(),
        ));
    }
    let sunk = |name: &str, app_name: &str| {
        let out = must(&format!("{stitch} stats --json --name {name}"));
        let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
        app(&stats, app_name)["counters"]["packets"]
            .as_u64()
            .unwrap_or(0)
    };
    for name in &names {
        wait_until(
            "both functions of each instance to carry packets",
            20,
            || sunk(name, "out") > 0 && sunk(name, "out2") > 0,
        );
        let show = must(&format!("{stitch} show fw --name {name}"));
        let v: serde_json::Value = serde_json::from_str(&show).unwrap();
        let pid = v["process"]["pid"].as_i64().unwrap();
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let want = format!("STITCH_NF_SOCKET=/run/stitch-fn/{name}.sock");
        assert!(
            String::from_utf8_lossy(&environ).contains(&want),
            "the supervised function was not given its instance's socket ({want})"
        );
    }
    for run in &runs {
        run.signal(libc::SIGTERM);
    }
    for run in runs {
        let out = run.finish();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(functions);
    let left: Vec<String> = names
        .iter()
        .flat_map(|n| files_of(n))
        .filter(|f| Path::new(f).exists())
        .collect();
    for f in &left {
        let _ = std::fs::remove_file(f);
    }
    assert!(left.is_empty(), "left after a clean stop: {left:?}");
}
