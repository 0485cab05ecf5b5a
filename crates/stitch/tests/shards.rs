//! Sharded functions between namespaces: an `af_packet` interface in shards joins a fanout
//! group, the NAT and the firewall run one shard per worker, and each packet finds the shard
//! that holds its flow's state — whichever shard the kernel gave it to — across live changes
//! of the number of shards.

mod common;
use common::*;
use std::time::Duration;

/// TCP echo on port 7000 and UDP echo on 7001, for as many clients as come.
const SERVER: &str = r#"
import resource, selectors, socket
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
sel = selectors.DefaultSelector()
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("0.0.0.0", 7000))
t.listen(4096)
t.setblocking(False)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("0.0.0.0", 7001))
u.setblocking(False)
sel.register(t, selectors.EVENT_READ, "accept")
sel.register(u, selectors.EVENT_READ, "udp")
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        if key.data == "accept":
            try:
                c, _ = t.accept()
            except BlockingIOError:
                continue
            c.setblocking(False)
            sel.register(c, selectors.EVENT_READ, "tcp")
        elif key.data == "udp":
            while True:
                try:
                    d, peer = u.recvfrom(2048)
                except BlockingIOError:
                    break
                u.sendto(d, peer)
        else:
            try:
                d = key.fileobj.recv(4096)
            except (BlockingIOError, ConnectionError):
                d = None
            if d:
                key.fileobj.sendall(d)
            elif d == b"":
                sel.unregister(key.fileobj)
                key.fileobj.close()
"#;

/// `client.py SERVER CONNS ROUNDS FLOWS DIR`: opens CONNS TCP connections and keeps them; for
/// each round k, once file DIR/go<k> exists, each connection echoes a message ("round k ok
/// N"); meanwhile FLOWS UDP flows echo numbered datagrams (500 a second) until DIR/stop
/// exists ("udp sent S received R").
const CLIENT: &str = r#"
import os, resource, selectors, socket, struct, sys, threading, time
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
server, conns, rounds, flows, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
socks = []
for i in range(conns):
    s = socket.create_connection((server, 7000), timeout=10)
    s.setblocking(False)
    socks.append(s)
udp = []
for i in range(flows):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("0.0.0.0", 0))
    u.setblocking(False)
    udp.append(u)
got = set()
sent = [0]
def stream():
    sel = selectors.DefaultSelector()
    for u in udp:
        sel.register(u, selectors.EVENT_READ)
    seq, start, stop_at = 0, time.time(), None
    while True:
        if stop_at is None and os.path.exists(os.path.join(d, "stop")):
            stop_at = time.time() + 2
        if stop_at is None and flows and seq < (time.time() - start) * 500:
            udp[seq % flows].sendto(struct.pack("!I", seq), (server, 7001))
            seq += 1
            sent[0] = seq
        for key, _ in sel.select(0.001):
            try:
                got.add(struct.unpack("!I", key.fileobj.recv(64)[:4])[0])
            except BlockingIOError:
                pass
        if stop_at is not None and time.time() > stop_at:
            return
t = threading.Thread(target=stream)
t.start()
print("ready", flush=True)
for k in range(1, rounds + 1):
    while not os.path.exists(os.path.join(d, "go%d" % k)):
        time.sleep(0.02)
    # Every connection sends, then the echoes are read for at most 10 s.
    want, back = {}, {}
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        want[s] = b"r%d c%d." % (k, i)
        back[s] = b""
        try:
            s.send(want[s])
            sel.register(s, selectors.EVENT_READ)
        except OSError:
            pass
    deadline, ok = time.time() + 10, 0
    while sel.get_map() and time.time() < deadline:
        for key, _ in sel.select(0.1):
            s = key.fileobj
            try:
                part = s.recv(64)
            except OSError:
                part = b""
            back[s] += part
            if not part or len(back[s]) >= len(want[s]):
                sel.unregister(s)
                ok += back[s] == want[s]
    sel.close()
    print("round %d ok %d" % (k, ok), flush=True)
t.join()
print("udp sent %d received %d" % (sent[0], len(got)), flush=True)
"#;

/// A graph of `lan` and `wan` interfaces around `function`, each as `shards` shards.
/// Datagrams host `i`'s sockets dropped because their receive buffer was full (its
/// namespace's `RcvbufErrors`).
fn udp_buffer_drops(h: &TwoHosts, i: usize) -> u64 {
    let snmp = String::from_utf8(h.exec(i, "cat /proc/net/snmp").stdout).unwrap();
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp:"));
    let (Some(names), Some(values)) = (udp.next(), udp.next()) else {
        return 0;
    };
    (names.split_whitespace().zip(values.split_whitespace()))
        .find(|(n, _)| *n == "RcvbufErrors")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

fn region(h: &TwoHosts, shards: usize, function: &str) -> String {
    format!(
        "apps:\n  lan: {{ type: af_packet, interface: {}, shards: {shards} }}\n  wan: {{ type: af_packet, interface: {}, shards: {shards} }}\n  f: {{ shards: {shards}, {function} }}\nlinks:\n  - \"lan.output -> f.lan\"\n  - \"f.lan -> lan.input\"\n  - \"wan.output -> f.wan\"\n  - \"f.wan -> wan.input\"\n",
        h.outer[0], h.outer[1]
    )
}

/// The counters of each shard of app `name` in `stats`.
fn shards<'a>(stats: &'a serde_json::Value, name: &str, n: usize) -> Vec<&'a serde_json::Value> {
    (0..n)
        .map(|i| &app(stats, &format!("{name}:{i}"))["counters"])
        .collect()
}

fn sum(counters: &[&serde_json::Value], key: &str) -> u64 {
    counters.iter().map(|c| c[key].as_u64().unwrap_or(0)).sum()
}

/// Waits for the client's line that starts with `prefix`.
fn line(client: &mut Listening, prefix: &str) -> String {
    loop {
        let l = client
            .next_line()
            .unwrap_or_else(|| panic!("the client ended before `{prefix}`"));
        if l.starts_with(prefix) {
            return l;
        }
    }
}

fn start_client(h: &TwoHosts, s: &Stitch, conns: usize, rounds: usize, flows: usize) -> Listening {
    std::fs::write(s.path().join("client.py"), CLIENT).unwrap();
    h.spawn_ready(
        0,
        &format!(
            "python3 {} {} {conns} {rounds} {flows} {}",
            s.path().join("client.py").display(),
            h.ip[1],
            s.path().display()
        ),
    )
}

fn start_server(h: &TwoHosts, s: &Stitch) -> Listening {
    std::fs::write(s.path().join("server.py"), SERVER).unwrap();
    h.spawn_ready(
        1,
        &format!("python3 {}", s.path().join("server.py").display()),
    )
}

fn go(s: &Stitch, what: &str) {
    std::fs::write(s.path().join(what), "").unwrap();
}

#[test]
fn a_nat_in_two_shards_carries_a_thousand_connections_and_each_reply_finds_its_shard() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let external = format!("{}50", &h.ip[0][..h.ip[0].len() - 1]);
    let s = Stitch::run(&region(
        &h,
        2,
        &format!("type: nat, external: \"{external}\", ports: \"20000-39999\""),
    ));
    let _server = start_server(&h, &s);
    let mut client = start_client(&h, &s, 1000, 1, 200);
    go(&s, "go1");
    assert_eq!(line(&mut client, "round 1"), "round 1 ok 1000");
    std::thread::sleep(Duration::from_secs(1));
    go(&s, "stop");
    let udp = line(&mut client, "udp");
    let counts: Vec<u64> = udp.split(' ').filter_map(|w| w.parse().ok()).collect();
    // The burst of a thousand echoes may overflow an interface's ring (512 frames): a
    // datagram lost there is counted, never lost silently.
    let now = s.stats().unwrap();
    let ring_drops: u64 = ["lan", "wan"]
        .iter()
        .map(|a| app(&now, a)["counters"]["kernel_drops"].as_u64().unwrap())
        .sum();
    assert!(
        counts[0] > 0 && counts[0] - counts[1] <= ring_drops,
        "{udp}, {ring_drops} dropped by the interfaces' rings"
    );
    // `stitch stats`: the app once with its totals, then its shards.
    let table = must(&format!(
        "{} stats --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    let rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with("APP"))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| w.starts_with('f'))
        .collect();
    assert_eq!(rows, ["f", "f:0", "f:1"], "{table}");
    // `stitch show`: the app's tables, shard by shard, under the app's own name.
    let shown = show(&s, "f");
    let tables: Vec<&str> = (shown["shards"].as_array().unwrap().iter())
        .map(|t| t["shard"].as_str().unwrap())
        .collect();
    assert_eq!(tables, ["f:0", "f:1"], "{shown}");
    assert!(
        (shown["shards"].as_array().unwrap().iter())
            .all(|t| t["count"].as_u64().unwrap_or(0) >= 200),
        "each shard's mappings: {shown}"
    );
    let stats = s.stop();
    let total = app(&stats, "f");
    assert_eq!(total["shards"], serde_json::json!(["f:0", "f:1"]));
    let nat = shards(&stats, "f", 2);
    assert_eq!(
        total["counters"]["mappings"].as_u64(),
        Some(sum(&nat, "mappings")),
        "totals of the shards"
    );
    assert_eq!(
        sum(&nat, "no_mapping_drops"),
        0,
        "every reply found its mapping: {nat:?}"
    );
    assert!(
        nat.iter().all(|c| c["mappings"].as_u64().unwrap() >= 200),
        "both shards hold mappings: {nat:?}"
    );
    assert!(sum(&nat, "mappings") >= 1200, "{nat:?}");
    // The kernel's fanout hash is not the NAT's: replies reach the other shard and are
    // handed over.
    assert!(sum(&nat, "handed_off") > 0, "{nat:?}");
    for i in 0..2 {
        let spec = format!("lan:{i}.output -> f:{i}.lan");
        assert!(
            link(&stats, &spec)["tx_packets"].as_u64().unwrap() > 0,
            "the fanout gave shard {i} traffic"
        );
    }
}

#[test]
fn a_nat_changes_from_one_shard_to_two_is_upgraded_and_back_live_and_keeps_every_connection() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let external = format!("{}50", &h.ip[0][..h.ip[0].len() - 1]);
    let nat = format!("type: nat, external: \"{external}\", ports: \"20000-39999\"");
    let s = Stitch::run(&region(&h, 1, &nat));
    let _server = start_server(&h, &s);
    let mut client = start_client(&h, &s, 200, 4, 20);
    go(&s, "go1");
    assert_eq!(line(&mut client, "round 1"), "round 1 ok 200");
    let printed = s.apply(&region(&h, 2, &nat));
    assert!(printed.contains("f:1"), "{printed}");
    go(&s, "go2");
    assert_eq!(
        line(&mut client, "round 2"),
        "round 2 ok 200",
        "after 1 → 2 shards"
    );
    let two = s.stats().unwrap();
    let nat2 = shards(&two, "f", 2);
    assert_eq!(sum(&nat2, "no_mapping_drops"), 0, "{nat2:?}");
    // Upgraded in two shards: each shard's mappings, and its pointers to the mappings of its
    // inside endpoints that the other shard holds, go to the new process — no flow is mapped
    // anew (another external port) after it.
    let (successor, report) = common::upgrade::upgrade(&s);
    let restored = report["state_restored"].as_array().unwrap();
    assert!(
        ["f:0", "f:1"]
            .iter()
            .all(|n| restored.iter().any(|r| r == n)),
        "{report}"
    );
    go(&s, "go3");
    assert_eq!(
        line(&mut client, "round 3"),
        "round 3 ok 200",
        "after the upgrade"
    );
    let after = s.stats().unwrap();
    let upgraded = shards(&after, "f", 2);
    assert_eq!(
        sum(&upgraded, "mappings"),
        sum(&nat2, "mappings"),
        "mapped anew after the upgrade: {nat2:?} before, {upgraded:?} after"
    );
    s.apply(&region(&h, 1, &nat));
    go(&s, "go4");
    assert_eq!(
        line(&mut client, "round 4"),
        "round 4 ok 200",
        "after 2 → 1"
    );
    go(&s, "stop");
    let udp = line(&mut client, "udp");
    let counts: Vec<u64> = udp.split(' ').filter_map(|w| w.parse().ok()).collect();
    // Sent from before the first change until after the last (how many depends on how fast
    // the machine runs the rounds, not on Stitch).
    assert!(counts[0] > 0, "{udp}");
    let stats = successor.stop(s);
    // The upgrade pauses traffic for a moment: on a busy machine an interface's ring (512
    // frames) may overflow meanwhile — counted by the kernel, never lost silently.
    // So may the echo server's or the client's socket buffer while Python waits for the CPU
    // (the namespaces' own UDP counters say so).
    let ring_drops: u64 = ["lan", "wan"]
        .iter()
        .map(|a| app(&stats, a)["counters"]["kernel_drops"].as_u64().unwrap())
        .sum();
    let socket_drops: u64 = (0..2).map(|i| udp_buffer_drops(&h, i)).sum();
    // And what the old process could not push out before it handed over (reported).
    let left = report["packets_left_queued"].as_u64().unwrap_or(0);
    eprintln!("{udp}: {ring_drops} ring drops, {socket_drops} socket drops, {left} left queued");
    assert!(
        counts[0] - counts[1] <= ring_drops + socket_drops + left,
        "datagrams lost across the changes and the upgrade beyond the {ring_drops} the \
         interfaces' rings and the {socket_drops} the hosts' sockets dropped and the {left} \
         the upgrade left queued: {udp}"
    );
    let c = &app(&stats, "f")["counters"];
    assert_eq!(c["no_mapping_drops"], 0, "{c}");
    // The connections kept their mappings: 200 TCP and 20 UDP, none made anew.
    assert_eq!(c["mappings"], 220, "{c}");
}

#[test]
fn a_firewall_in_two_shards_passes_replies_whichever_shard_they_reach() {
    require_root_and_tools(&["ip", "python3"]);
    let h = TwoHosts::new();
    let s = Stitch::run(&region(
        &h,
        2,
        "type: firewall, default: drop, rules: [ { action: accept, from: lan } ]",
    ));
    let _server = start_server(&h, &s);
    let mut client = start_client(&h, &s, 300, 1, 50);
    go(&s, "go1");
    assert_eq!(line(&mut client, "round 1"), "round 1 ok 300");
    go(&s, "stop");
    let udp = line(&mut client, "udp");
    let counts: Vec<u64> = udp.split(' ').filter_map(|w| w.parse().ok()).collect();
    assert!(counts[0] > 0 && counts[1] == counts[0], "{udp}");
    // From the wan side nothing gets in.
    let o = h.exec(1, &format!("ping -c 2 -i 0.2 -W 1 {}", h.ip[0]));
    assert!(!o.status.success(), "wan → lan ping must not pass");
    let stats = s.stop();
    let fw = shards(&stats, "f", 2);
    assert_eq!(sum(&fw, "invalid_drops"), 0, "{fw:?}");
    assert!(
        fw.iter().all(|c| c["connections"].as_u64().unwrap() > 0),
        "both shards track connections: {fw:?}"
    );
    assert!(sum(&fw, "handed_off") > 0, "{fw:?}");
    assert!(sum(&fw, "rule_drops") >= 2, "the pings: {fw:?}");
}
