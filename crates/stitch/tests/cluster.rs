//! Graphs across hosts: three hosts made of network namespaces, each with an etcd member (one
//! 3-member cluster) and a `stitch agent`; a chain placed across them by `stitch cluster apply`
//! carries ping and TCP between two workload namespaces (attached by `stitch-cni`, driven by
//! `cnitool`) through VXLAN tunnels, and keeps doing
//! so when an agent dies, when etcd's leader is cut off, and when a host loses etcd.
//!
//! Each host has two links to the fabric (a namespace with two bridges): `mgmt`
//! (198.51.100.0/24, etcd's traffic) and `ul0` (192.0.2.0/24, the underlay the tunnels use), as
//! deployments keep their control and data networks apart. "Cutting a host off" takes its
//! management link down: its data plane must keep forwarding.

mod common;
use common::*;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Each test runs three etcd members and three agents: on two cores, one test at a time (in
/// parallel, a loaded machine starved etcd's own heartbeats and it lost its leader).
static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_cluster() -> std::sync::MutexGuard<'static, ()> {
    ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner())
}
/// cnitool and host-local (scripts/install-deps --test builds them).
const CNI_BIN: &str = "/opt/cni/bin";

/// The stitch-cni binary, built beside stitch.
fn cni_plugin() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_stitch")).with_file_name("stitch-cni")
}
const HOSTS: usize = 3;

struct Cluster {
    tag: String,
    dir: tempfile::TempDir,
    etcd: Vec<Option<Background>>,
    agents: Vec<Option<Background>>,
}

impl Cluster {
    fn ns(&self, i: usize) -> String {
        format!("{}h{}", self.tag, i + 1)
    }
    fn fabric(&self) -> String {
        format!("{}f", self.tag)
    }
    fn workload(&self, side: char) -> String {
        format!("{}w{side}", self.tag)
    }
    fn endpoints(&self) -> String {
        (1..=HOSTS)
            .map(|i| format!("http://198.51.100.{i}:2379"))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn new() -> Cluster {
        let tag = format!(
            "sc{}x{}",
            std::process::id() % 10000,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let c = Cluster {
            tag,
            dir: tempfile::tempdir().unwrap(),
            etcd: Vec::new(),
            agents: Vec::new(),
        };
        let f = c.fabric();
        must(&format!("ip netns add {f}"));
        for br in ["mg", "ul"] {
            must(&format!("ip -n {f} link add {br} type bridge"));
            must(&format!("ip -n {f} link set {br} up"));
        }
        for i in 0..HOSTS {
            let ns = c.ns(i);
            must(&format!("ip netns add {ns}"));
            must(&format!("ip -n {ns} link set lo up"));
            for (br, inner, net) in [("mg", "mgmt", "198.51.100"), ("ul", "ul0", "192.0.2")] {
                let outer = format!("{br}{}", i + 1);
                must(&format!(
                    "ip -n {ns} link add {inner} type veth peer name {outer} netns {f}"
                ));
                must(&format!("ip -n {f} link set {outer} master {br} up"));
                must(&format!(
                    "ip -n {ns} addr add {net}.{}/24 dev {inner}",
                    i + 1
                ));
                must(&format!("ip -n {ns} link set {inner} up"));
            }
        }
        // Workloads: namespaces a (on host 1) and b (on host 3); stitch-cni attaches them.
        for side in ['a', 'b'] {
            must(&format!("ip netns add {}", c.workload(side)));
            must(&format!("ip -n {} link set lo up", c.workload(side)));
        }
        let cni = c.dir.path().join("cni");
        std::fs::create_dir_all(&cni).unwrap();
        std::os::unix::fs::symlink(cni_plugin(), cni.join("stitch-cni")).unwrap();
        c
    }

    /// `cnitool COMMAND` on host `host` for workload `side`, attached as graph port `side` with
    /// an address from host-local (`.2` of `subnet`, the gateway `.1`).
    fn cnitool(
        &self,
        host: usize,
        command: &str,
        side: char,
        subnet: &str,
    ) -> std::process::Output {
        let conf = self.dir.path().join(format!("net-{side}"));
        std::fs::create_dir_all(&conf).unwrap();
        let net = format!("chain-{side}");
        let config = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": net,
            "type": "stitch-cni",
            "control": self.socket(host),
            "port": side.to_string(),
            "ipam": {
                "type": "host-local",
                "ranges": [[{ "subnet": format!("{subnet}.0/24"), "rangeStart": format!("{subnet}.2"),
                              "rangeEnd": format!("{subnet}.2"), "gateway": format!("{subnet}.1") }]],
                "routes": [{ "dst": "0.0.0.0/0" }],
                "dataDir": self.dir.path().join("ipam").display().to_string(),
            },
        });
        std::fs::write(conf.join(format!("{net}.conf")), config.to_string()).unwrap();
        self.exec(
            &self.ns(host),
            &format!(
                "env NETCONFPATH={} CNI_PATH={}:{CNI_BIN} {CNI_BIN}/cnitool {command} {net} /var/run/netns/{}",
                conf.display(),
                self.dir.path().join("cni").display(),
                self.workload(side)
            ),
        )
    }

    fn exec(&self, ns: &str, cmd: &str) -> std::process::Output {
        sh(&format!("ip netns exec {ns} {cmd}"))
    }

    fn spawn_logged(&self, ns: &str, args: &[&str], log: &str) -> Background {
        let out = File::create(self.dir.path().join(log)).unwrap();
        let err = out.try_clone().unwrap();
        Background(
            Command::new("ip")
                .args(["netns", "exec", ns])
                .args(args)
                .stdout(Stdio::from(out))
                .stderr(Stdio::from(err))
                .spawn()
                .unwrap(),
        )
    }

    fn start_etcd(&mut self) {
        for i in 1..=HOSTS {
            let member = self.start_member(i);
            self.etcd.push(Some(member));
        }
        wait_until("a healthy etcd cluster", 30, || {
            self.etcdctl(0, "endpoint health --cluster")
                .status
                .success()
        });
    }

    /// etcd member `i` (1-based), started anew or again on its data.
    fn start_member(&self, i: usize) -> Background {
        let cluster: Vec<String> = (1..=HOSTS)
            .map(|i| format!("e{i}=http://198.51.100.{i}:2380"))
            .collect();
        {
            let data = self.dir.path().join(format!("e{i}"));
            let args = [
                "etcd".to_string(),
                format!("--name=e{i}"),
                format!("--data-dir={}", data.display()),
                format!("--listen-client-urls=http://198.51.100.{i}:2379"),
                format!("--advertise-client-urls=http://198.51.100.{i}:2379"),
                format!("--listen-peer-urls=http://198.51.100.{i}:2380"),
                format!("--initial-advertise-peer-urls=http://198.51.100.{i}:2380"),
                format!("--initial-cluster={}", cluster.join(",")),
                format!("--initial-cluster-token={}", self.tag),
                "--heartbeat-interval=100".into(),
                "--election-timeout=1000".into(),
            ];
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.spawn_logged(&self.ns(i - 1), &args, &format!("etcd{i}.log"))
        }
    }

    fn etcdctl(&self, host: usize, args: &str) -> std::process::Output {
        self.exec(
            &self.ns(host),
            &format!(
                "env ETCDCTL_API=3 etcdctl --endpoints={} --command-timeout=2s {args}",
                self.endpoints()
            ),
        )
    }

    fn socket(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("h{}.sock", i + 1))
    }

    fn start_agent(&mut self, i: usize) {
        let host = format!("h{}", i + 1);
        let underlay = format!("192.0.2.{}", i + 1);
        let socket = self.socket(i).display().to_string();
        let endpoints = self.endpoints();
        let labels = if i == 0 { "zone=a" } else { "zone=b" };
        let args = [
            env!("CARGO_BIN_EXE_stitch"),
            "agent",
            "--etcd",
            &endpoints,
            // This test is about failures, on a plain etcd of its own; the walkthrough and
            // `etcd_lets_each_identity_write_only_its_keys` run the secure set-up.
            "--etcd-insecure",
            "--host",
            &host,
            "--underlay",
            &underlay,
            "--labels",
            labels,
            "--control",
            &socket,
        ];
        let b = self.spawn_logged(&self.ns(i), &args, &format!("agent{}.log", i + 1));
        if self.agents.len() <= i {
            self.agents.resize_with(i + 1, || None);
        }
        self.agents[i] = Some(b);
        wait_until("the agent's API", 20, || self.status(i).is_some());
    }

    /// `GET path` on host `i`'s agent; none while it does not answer.
    fn get(&self, i: usize, path: &str) -> Option<serde_json::Value> {
        stitch_api::client::json(&self.socket(i), stitch_api::client::Method::GET, path, None).ok()
    }

    fn status(&self, i: usize) -> Option<serde_json::Value> {
        self.get(i, "/api/v1/status")
    }

    fn stats(&self, i: usize) -> serde_json::Value {
        self.get(i, "/api/v1/stats").unwrap()
    }

    /// `stitch cluster ARGS` on host `host`; output and success.
    fn cli(&self, host: usize, args: &str) -> (bool, String) {
        let o = self.exec(
            &self.ns(host),
            &format!(
                "{} cluster {args} --etcd-insecure --etcd {}",
                env!("CARGO_BIN_EXE_stitch"),
                self.endpoints()
            ),
        );
        (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    }

    fn cluster_status(&self, host: usize) -> serde_json::Value {
        let (ok, out) = self.cli(host, "status --json");
        assert!(ok, "{out}");
        serde_json::from_str(&out).unwrap()
    }

    /// The status, or null while etcd does not answer (for conditions waited on).
    fn status_now(&self, host: usize) -> serde_json::Value {
        let (ok, out) = self.cli(host, "status --json");
        if ok {
            serde_json::from_str(&out).unwrap_or_default()
        } else {
            serde_json::Value::Null
        }
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// Where app `app` of graph `chain` runs.
    fn host_of(&self, app: &str) -> Option<String> {
        let s = self.status_now(0);
        s["graphs"][0]["apps"][app]["host"]
            .as_str()
            .map(String::from)
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(self.dir.path()).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "log")
                && p.display().to_string().contains("agent")
            {
                out += &format!(
                    "--- {}\n{}\n",
                    p.display(),
                    std::fs::read_to_string(&p).unwrap_or_default()
                );
            }
        }
        out
    }

    /// A paced ping from workload a to b (every 10 ms), with receive times.
    fn paced_ping(&self) -> Background {
        let out = File::create(self.dir.path().join("ping.txt")).unwrap();
        Background(
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &self.workload('a'),
                    "ping",
                    "-D",
                    "-n",
                    "-i",
                    "0.01",
                    "10.20.2.2",
                ])
                .stdout(Stdio::from(out))
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    /// Replies received and the longest time between two in a row, of the ping's log between
    /// `from` and `to` seconds (UNIX time).
    fn ping_gaps(&self, from: f64, to: f64) -> (usize, f64) {
        let text = std::fs::read_to_string(self.dir.path().join("ping.txt")).unwrap();
        ping_replies_and_gap(&text, from, to)
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        self.agents.clear();
        self.etcd.clear();
        let mut all: Vec<String> = (0..HOSTS).map(|i| self.ns(i)).collect();
        all.push(self.fabric());
        all.push(self.workload('a'));
        all.push(self.workload('b'));
        for ns in all {
            let _ = sh(&format!(
                "ip netns pids {ns} 2>/dev/null | xargs -r kill -9"
            ));
            let _ = sh(&format!("ip netns del {ns} 2>/dev/null"));
        }
    }
}

/// The chain: workload a — firewall (h1) — NAT (any zone-b host) — router (h3) — workload b.
fn chain(extra: &str) -> String {
    format!(
        "apps:
  a: {{ type: attachment, host: h1 }}
  fw:
    type: firewall
    host: h1
    default: drop
    rules:
      - {{ action: accept, from: lan }}
  nat: {{ type: nat, external: 10.20.1.100, hosts: {{ zone: b }} }}
  r:
    type: router
    host: h3
    interfaces:
      left: {{ mac: \"02:00:00:00:01:01\", address: \"10.20.1.1/24\" }}
      right: {{ mac: \"02:00:00:00:02:01\", address: \"10.20.2.1/24\" }}
  b: {{ type: attachment, host: h3 }}
{extra}links:
  - \"a.output -> fw.lan\"
  - \"fw.lan -> a.input\"
  - \"fw.wan -> nat.lan\"
  - \"nat.lan -> fw.wan\"
  - \"nat.wan -> r.left\"
  - \"r.left -> nat.wan\"
  - \"b.output -> r.right\"
  - \"r.right -> b.input\"
"
    )
}

#[test]
fn a_chain_across_three_hosts_survives_a_dead_agent_a_lost_etcd_leader_and_a_cut_off_host() {
    let _one = one_cluster();
    require_root_and_tools(&["etcd", "etcdctl", "ping", "iperf3", "nsenter"]);
    for tool in ["cnitool", "host-local"] {
        assert!(
            Path::new(CNI_BIN).join(tool).exists(),
            "{CNI_BIN}/{tool} is needed: scripts/install-deps --test builds it"
        );
    }
    assert!(
        cni_plugin().exists(),
        "build the workspace first (cargo build --workspace)"
    );
    let mut c = Cluster::new();
    c.start_etcd();
    for i in 0..HOSTS {
        c.start_agent(i);
    }
    wait_until("three live hosts", 20, || {
        c.status_now(0)["hosts"]
            .as_array()
            .is_some_and(|h| h.iter().filter(|h| h["live"] == true).count() == HOSTS)
    });

    refuses_bad_input(&c);
    let host_end = carries_the_chain(&c);
    learns_the_path_mtu(&c, &host_end);
    is_not_upgraded_in_place(&c);
    plans_a_change_without_writing(&c);
    let ping = c.paced_ping();
    std::thread::sleep(Duration::from_secs(1));
    moves_the_nat_when_its_agent_dies(&mut c);
    keeps_containers_across_an_agent_restart(&mut c);
    outlives_a_cut_off_etcd_leader(&mut c);
    let (file, graph_rev) = keeps_a_cut_off_host_forwarding(&c);
    refuses_a_stale_write(&c, &file, graph_rev);
    drop(ping);
    reaches_a_readded_container_at_once(&c);
    detaches_and_deletes(&c);
}

/// Bad input: nothing is written.
fn refuses_bad_input(c: &Cluster) {
    let bad = c.write(
        "bad.yaml",
        "apps:\n  x: { type: sink, host: h9 }\n  y: { type: sink, hosts: { rack: r1 } }\n  cluster-z: { type: sink, host: h1 }\n",
    );
    let (ok, out) = c.cli(0, &format!("apply {}", bad.display()));
    assert!(!ok);
    assert!(
        out.contains("bad.yaml:2:") && out.contains("host `h9` is not in the cluster"),
        "{out}"
    );
    assert!(
        out.contains("bad.yaml:3:") && out.contains("no host has the label `rack`"),
        "{out}"
    );
    assert!(
        out.contains("bad.yaml:4:") && out.contains("the cluster's own"),
        "{out}"
    );
    assert!(out.contains("nothing was written"), "{out}");
    assert_eq!(c.cluster_status(0)["graphs"], serde_json::json!([]));
}

/// The chain: placed, tunnelled, and carrying ping and TCP.
fn carries_the_chain(c: &Cluster) -> Vec<String> {
    let file = c.write("chain.yaml", &chain(""));
    let (ok, out) = c.cli(0, &format!("apply {} --wait 20", file.display()));
    assert!(ok, "{out}\n{}", c.logs());
    assert_eq!(
        c.host_of("nat").as_deref(),
        Some("h2"),
        "NAT goes to the emptiest zone-b host"
    );
    let status = c.cluster_status(0);
    assert_eq!(status["graphs"][0]["tunnels"].as_array().unwrap().len(), 4);
    let wa = c.workload('a');
    let wb = c.workload('b');
    // The workloads attach through CNI, as a container runtime would attach them.
    let mut host_end = Vec::new();
    for (host, side, subnet) in [(0, 'a', "10.20.1"), (2, 'b', "10.20.2")] {
        let o = c.cnitool(host, "add", side, subnet);
        assert!(
            o.status.success(),
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let result: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(
            result["ips"][0]["address"],
            format!("{subnet}.2/24"),
            "{result}"
        );
        assert_eq!(result["interfaces"][1]["name"], "eth0", "{result}");
        host_end.push(
            result["interfaces"][0]["name"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        let o = c.cnitool(host, "check", side, subnet);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
        // The underlay's 1500 less VXLAN's 50: what crosses every tunnel.
        let link = must(&format!("ip -n {} link show eth0", c.workload(side)));
        assert!(link.contains("mtu 1450 "), "{link}");
    }
    assert_eq!(c.cluster_status(0)["workload_mtu"], 1450);
    // ADD again for the same container and interface is refused (the spec: it exists).
    let again = c.cnitool(0, "add", 'a', "10.20.1");
    assert!(!again.status.success());
    wait_until("ping through the chain", 20, || {
        c.exec(&wa, "ping -c1 -W1 10.20.2.2").status.success()
    });
    let _server = Background(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &wb,
                "iperf3",
                "-s",
                "-1",
                "-B",
                "10.20.2.2",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("iperf3 to listen", 10, || {
        !c.exec(&wb, "ss -Hltn 'sport = :5201'").stdout.is_empty()
    });
    let gbps = iperf_bits(&c.exec(&wa, "iperf3 -c 10.20.2.2 -t 2 -J"), "10.20.2.2") / 1e9;
    eprintln!("iperf3 TCP through three hosts and four VXLAN tunnels: {gbps:.2} Gbit/s");
    assert!(gbps > 0.0);
    let h2 = c.stats(1);
    let nat = h2["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "nat")
        .unwrap();
    assert!(
        nat["rx_packets"].as_u64().unwrap() > 1000,
        "TCP crossed the NAT on h2"
    );
    assert!(
        nat["counters"]["arp_answered"].as_u64().unwrap() >= 1,
        "{nat}"
    );
    host_end
}

/// A workload whose MTU is larger than the tunnels carry learns the path MTU: the first
/// tunnel answers a DF packet too big for it with "fragmentation needed", which reaches
/// the workload through the firewall (related to its connection).
fn learns_the_path_mtu(c: &Cluster, host_end: &[String]) {
    let wa = c.workload('a');
    let set_mtu = |mtu: u32| {
        must(&format!("ip -n {wa} link set eth0 mtu {mtu}"));
        must(&format!(
            "ip -n {} link set {} mtu {mtu}",
            c.ns(0),
            host_end[0]
        ));
    };
    set_mtu(1500);
    let over = c.exec(&wa, "ping -c 2 -i 0.3 -W 1 -M do -s 1472 10.20.2.2");
    let said =
        String::from_utf8_lossy(&over.stdout).to_string() + &String::from_utf8_lossy(&over.stderr);
    assert!(
        said.contains("mtu = 1450") || said.contains("mtu=1450"),
        "{said}\n{}",
        c.stats(0)
    );
    let fits = c.exec(&wa, "ping -c 2 -i 0.2 -W 2 -M do -s 1422 10.20.2.2");
    assert!(
        fits.status.success(),
        "{}",
        String::from_utf8_lossy(&fits.stdout)
    );
    set_mtu(1450);
}

/// `cluster apply --dry-run` of a change on host 1 says host 1's part gains the app and the
/// other hosts' parts stay as they are, and writes nothing.
fn plans_a_change_without_writing(c: &Cluster) {
    let before = c.cluster_status(0)["graphs"].clone();
    let file = c.write(
        "chain-extra.yaml",
        &chain("  extra: { type: sink, host: h1 }\n"),
    );
    let (ok, out) = c.cli(
        0,
        &format!("apply --graph chain --dry-run {}", file.display()),
    );
    assert!(ok, "{out}");
    assert!(out.contains("a dry run, nothing was written"), "{out}");
    assert!(out.contains("host h1: apps added: extra;"), "{out}");
    for h in ["h2", "h3"] {
        assert!(out.contains(&format!("host {h}: unchanged")), "{out}");
    }
    assert_eq!(c.cluster_status(0)["graphs"], before, "the dry run wrote");
}

/// An agent offers no hand-over: `stitch upgrade` says so once and what to do instead, and
/// SIGUSR2 (an instance's upgrade signal) leaves it running, with a line in its log, instead
/// of ending it and its host's traffic.
fn is_not_upgraded_in_place(c: &Cluster) {
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["upgrade", "--control"])
        .arg(c.socket(2))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert_eq!(
        err.matches("is a cluster agent's instance").count(),
        1,
        "{err}"
    );
    let agent = c.agents[2].as_ref().unwrap().0.id() as i32;
    // SAFETY: kill takes no pointers.
    unsafe { libc::kill(agent, libc::SIGUSR2) };
    std::thread::sleep(Duration::from_secs(1));
    assert!(alive(agent), "SIGUSR2 ended the agent");
    assert!(c.status(2).is_some(), "the agent's instance answers");
    let wa = c.workload('a');
    assert!(c.exec(&wa, "ping -c1 -W2 10.20.2.2").status.success());
}

/// Kill host 2's agent (and its engine, NAT and all): the NAT moves, traffic resumes.
fn moves_the_nat_when_its_agent_dies(c: &mut Cluster) {
    let wa = c.workload('a');
    let killed_at = now();
    c.agents[1].as_ref().unwrap().signal(libc::SIGKILL);
    wait_until("the NAT placed on another host", 15, || {
        c.host_of("nat").is_some_and(|h| h != "h2")
    });
    std::thread::sleep(Duration::from_secs(2));
    let (replies, outage) = c.ping_gaps(killed_at - 0.5, now());
    eprintln!(
        "NAT re-placed on {}: outage {:.0} ms (lease 2 s), {replies} replies after",
        c.host_of("nat").unwrap(),
        outage * 1e3
    );
    assert!(replies > 20, "traffic resumed after the NAT moved");
    assert!(c.exec(&wa, "ping -c1 -W1 10.20.2.2").status.success());
}

/// Host 1's agent (its engine with it) killed and started again: workload a is attached
/// again from the host's record, with its address, and its traffic resumes.
fn keeps_containers_across_an_agent_restart(c: &mut Cluster) {
    let wa = c.workload('a');
    let killed_at = now();
    c.agents[0].as_ref().unwrap().signal(libc::SIGKILL);
    c.agents[0] = None;
    c.start_agent(0);
    wait_until("ping through the restarted host 1", 20, || {
        c.exec(&wa, "ping -c1 -W1 10.20.2.2").status.success()
    });
    std::thread::sleep(Duration::from_secs(1));
    let (replies, gap) = c.ping_gaps(killed_at - 0.5, now());
    eprintln!(
        "host 1's agent killed and restarted: longest gap {:.0} ms, {replies} replies after",
        gap * 1e3
    );
    assert!(gap < 10.0, "traffic resumed ({gap:.3} s)");
    let o = c.cnitool(0, "check", 'a', "10.20.1");
    assert!(
        o.status.success(),
        "the container is attached as CNI left it: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// Host 2's agent returns (the NAT stays where it went), then etcd's leader moves to host 2's
/// member and host 2's management link goes down: etcd elects another leader; traffic never
/// stops.
fn outlives_a_cut_off_etcd_leader(c: &mut Cluster) {
    c.start_agent(1);
    let nat_host = c.host_of("nat").unwrap();
    let members = String::from_utf8(c.etcdctl(0, "member list -w json").stdout).unwrap();
    let members: serde_json::Value = serde_json::from_str(&members).unwrap();
    let e2 = members["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "e2")
        .unwrap()["ID"]
        .as_u64()
        .unwrap();
    let moved = c.etcdctl(0, &format!("move-leader {e2:x}"));
    assert!(
        moved.status.success(),
        "{}",
        String::from_utf8_lossy(&moved.stderr)
    );
    let cut_at = now();
    must(&format!("ip -n {} link set mg2 down", c.fabric()));
    wait_until("a new etcd leader", 20, || {
        let o = c.exec(
            &c.ns(0),
            "env ETCDCTL_API=3 etcdctl --endpoints=http://198.51.100.1:2379,http://198.51.100.3:2379 --command-timeout=1s endpoint status -w json",
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        v.as_array().is_some_and(|a| {
            a.iter().any(|s| {
                let st = &s["Status"];
                st["leader"].as_u64().is_some_and(|l| l != 0 && l != e2)
            })
        })
    });
    std::thread::sleep(Duration::from_secs(3));
    let (replies, gap) = c.ping_gaps(cut_at, now());
    eprintln!(
        "etcd leader cut off: longest gap between replies {:.0} ms",
        gap * 1e3
    );
    assert!(
        replies > 100 && gap < 0.5,
        "traffic went on ({replies} replies, gap {gap:.3} s)"
    );
    assert_eq!(c.host_of("nat"), Some(nat_host), "nothing moved");
    must(&format!("ip -n {} link set mg2 up", c.fabric()));
    wait_until("host 2's agent back on etcd", 30, || {
        c.status(1)
            .is_some_and(|s| s["agent"]["etcd"] == "connected")
    });
}

/// Host 3 loses etcd: its data plane keeps running, and since its agent still answers the
/// controller's probe on the underlay, nothing of it moves (its lease expires all the
/// same); a graph change made meanwhile reaches it when it returns.
fn keeps_a_cut_off_host_forwarding(c: &Cluster) -> (PathBuf, i64) {
    let wa = c.workload('a');
    let nat_before = c.host_of("nat");
    let cut_at = now();
    must(&format!("ip -n {} link set mg3 down", c.fabric()));
    wait_until("host 3's agent to notice", 20, || {
        c.status(2)
            .is_some_and(|s| s["agent"]["etcd"] == "unreachable")
    });
    let show = must(&format!(
        "{} show --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        c.socket(2).display()
    ));
    assert!(show.contains("\"kept as last applied\""), "{show}");
    let (_, metrics) = stitch_api::client::call(
        &c.socket(2),
        stitch_api::client::Method::GET,
        "/metrics",
        None,
    )
    .unwrap();
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    assert!(
        metrics.contains("stitch_agent_etcd_connected{} 0"),
        "{metrics}"
    );
    let file = c.write("chain.yaml", &chain("  extra: { type: sink, host: h3 }\n"));
    let (ok, out) = c.cli(0, &format!("apply {}", file.display()));
    assert!(ok, "{out}");
    // Past the lease: the controller has decided without host 3.
    std::thread::sleep(Duration::from_secs(4));
    let (replies, gap) = c.ping_gaps(cut_at, now());
    eprintln!("host 3 cut off from etcd: longest gap {:.0} ms", gap * 1e3);
    assert_eq!(
        c.host_of("nat"),
        nat_before,
        "an app of a host cut off from etcd moved"
    );
    assert!(
        replies > 100 && gap < 0.5,
        "host 3 kept forwarding ({replies} replies, gap {gap:.3} s)"
    );
    let has_extra = |c: &Cluster| {
        c.stats(2)["apps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["name"] == "extra")
    };
    assert!(!has_extra(c), "a cut-off host cannot have the change yet");
    must(&format!("ip -n {} link set mg3 up", c.fabric()));
    wait_until("host 3 resynced to the new revision", 30, || has_extra(c));
    // Host 3 writes its status once it runs the change, a moment after: the record follows.
    let ran_at = now();
    let reports_it = |s: &serde_json::Value| {
        let graph_rev = s["graphs"][0]["revision"].as_i64();
        s["hosts"].as_array().is_some_and(|hosts| {
            hosts
                .iter()
                .any(|h| h["name"] == "h3" && h["graphs"]["chain"].as_i64() == graph_rev)
        })
    };
    wait_until(
        "host 3's status record to show the revision it runs",
        15,
        || reports_it(&c.status_now(0)),
    );
    eprintln!(
        "host 3's status caught up {:.0} ms after it ran the change",
        (now() - ran_at) * 1e3
    );
    let s = c.cluster_status(0);
    let graph_rev = s["graphs"][0]["revision"].as_i64().unwrap();
    let reached = c.exec(&wa, "ping -c1 -W1 10.20.2.2").status.success();
    assert!(
        reached,
        "{s}\n{}\n{}\n{}",
        c.stats(0),
        c.stats(1),
        c.stats(2)
    );
    (file, graph_rev)
}

/// A stale write loses: compare-and-swap on the graph's revision.
fn refuses_a_stale_write(c: &Cluster, file: &Path, graph_rev: i64) {
    let (ok, out) = c.cli(0, &format!("apply {} --if-revision 1", file.display()));
    assert!(!ok && out.contains("no longer at revision 1"), "{out}");
    assert_eq!(
        c.cluster_status(0)["graphs"][0]["revision"].as_i64(),
        Some(graph_rev)
    );
}

/// A container re-added under the same address (a new MAC) is reachable at once: its
/// announcement updates the router's neighbour entry.
fn reaches_a_readded_container_at_once(c: &Cluster) {
    let wa = c.workload('a');
    let o = c.cnitool(2, "del", 'b', "10.20.2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let o = c.cnitool(2, "add", 'b', "10.20.2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let readded = Instant::now();
    let first = c.exec(&wa, "ping -c 1 -W 1 10.20.2.2");
    eprintln!(
        "a re-added workload (new MAC, same address) answered after {:.0} ms",
        readded.elapsed().as_secs_f64() * 1e3
    );
    assert!(
        first.status.success(),
        "the first ping after re-ADD: {}",
        String::from_utf8_lossy(&first.stdout)
    );
}

/// CNI DEL: the port is an attachment again, the host end and the address are gone.
fn detaches_and_deletes(c: &Cluster) {
    let wb = c.workload('b');
    let o = c.cnitool(2, "del", 'b', "10.20.2");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let b = c.stats(2)["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "b")
        .cloned()
        .unwrap();
    assert_eq!(b["type"], "attachment");
    assert!(
        !c.exec(&wb, "ip link show eth0").status.success(),
        "the container's end is gone"
    );
    let o = c.cnitool(2, "del", 'b', "10.20.2");
    assert!(o.status.success(), "DEL twice is not an error");

    // Delete: every host stops the chain's apps.
    let (ok, out) = c.cli(0, "delete chain");
    assert!(ok, "{out}");
    wait_until("every host empty", 20, || {
        (0..HOSTS).all(|i| c.stats(i)["apps"].as_array().is_some_and(|a| a.is_empty()))
    });
}

/// With one of three etcd members killed (the first of every `--etcd` list, so each new
/// connection meets it first), applies succeed every time, every agent stays live, and agents
/// are not told "too many pings" by etcd's default keep-alive policy.
#[test]
fn a_dead_etcd_member_is_invisible_to_applies_and_agents() {
    let _one = one_cluster();
    require_root_and_tools(&["etcd", "etcdctl"]);
    let mut c = Cluster::new();
    c.start_etcd();
    for i in 0..HOSTS {
        c.start_agent(i);
    }
    let all_live = |c: &Cluster| {
        c.status_now(1)["hosts"]
            .as_array()
            .is_some_and(|h| h.iter().filter(|h| h["live"] == true).count() == HOSTS)
    };
    wait_until("three live hosts", 20, || all_live(&c));
    // Quiet for longer than the 8.5 s in which etcd used to refuse the agents' 2 s pings.
    std::thread::sleep(Duration::from_secs(12));
    let quiet = c.logs();
    let broken = quiet.matches("campaigning again").count() + quiet.matches("lost etcd").count();
    assert_eq!(
        broken, 0,
        "connections to etcd broke while nothing failed:\n{quiet}"
    );
    c.etcd[0].as_ref().unwrap().signal(libc::SIGKILL);
    let killed = Instant::now();
    let mut slowest: f64 = 0.0;
    for i in 0..10 {
        let graph = format!(
            "apps:\n  gen: {{ type: generator, host: h2, size: 64, rate: {} }}\n  out: {{ type: sink, host: h3 }}\nlinks:\n  - \"gen.output -> out.input\"\n",
            100 + i
        );
        let file = c.write("member-down.yaml", &graph);
        let t = Instant::now();
        let (ok, out) = c.cli(1, &format!("apply {} --wait 15", file.display()));
        slowest = slowest.max(t.elapsed().as_secs_f64());
        assert!(ok, "apply {i} with a member down: {out}\n{}", c.logs());
        assert!(
            all_live(&c),
            "apply {i}: a host shows not live\n{}",
            c.logs()
        );
    }
    eprintln!(
        "10 applies with one of three etcd members dead: all succeeded, slowest {slowest:.2} s, {:.1} s in all",
        killed.elapsed().as_secs_f64()
    );

    // An outage right after a change (a second member dies: no quorum), then recovery: every
    // host's status record comes to say what the host runs, including a write that failed.
    let graph = "apps:\n  gen: { type: generator, host: h2, size: 64, rate: 50 }\n  out: { type: sink, host: h3 }\n  idle: { type: sink, host: h1 }\nlinks:\n  - \"gen.output -> out.input\"\n";
    let file = c.write("member-down.yaml", graph);
    let (ok, out) = c.cli(1, &format!("apply {}", file.display()));
    assert!(ok, "{out}");
    c.etcd[1].as_ref().unwrap().signal(libc::SIGKILL);
    let (ok, out) = c.cli(1, &format!("apply {}", file.display()));
    assert!(!ok, "an apply without quorum: {out}");
    std::thread::sleep(Duration::from_secs(3));
    c.etcd[0] = Some(c.start_member(1));
    c.etcd[1] = Some(c.start_member(2));
    let back = Instant::now();
    let settled = |c: &Cluster| {
        let (ok, out) = c.cli(2, "status --json");
        let s: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let hosts = s["hosts"].as_array().cloned().unwrap_or_default();
        ok && hosts.len() == HOSTS
            && hosts.iter().enumerate().all(|(i, h)| {
                let runs = c
                    .status(i)
                    .map(|s| s["agent"]["assignment_revision"].clone());
                h["live"] == true
                    && h["applied_revision"] == h["assignment_revision"]
                    && runs.as_ref() == Some(&h["applied_revision"])
            })
    };
    wait_until("every host's status saying what it runs", 60, || {
        settled(&c)
    });
    eprintln!(
        "etcd quorum lost right after a change, then back: every host's status true {:.1} s later",
        back.elapsed().as_secs_f64()
    );

    removes_a_host_gone_for_good(&mut c);
}

/// A host gone for good is removed by hand; a live one or an unknown one is refused.
fn removes_a_host_gone_for_good(c: &mut Cluster) {
    // After the quorum loss before this step, a busy machine may still be renewing h3's lease.
    wait_until("h3 live", 20, || {
        c.status_now(0)["hosts"]
            .as_array()
            .is_some_and(|h| h.iter().any(|h| h["name"] == "h3" && h["live"] == true))
    });
    let (ok, out) = c.cli(0, "host remove h3");
    assert!(
        !ok && out.contains("is live") && out.contains("nothing was removed"),
        "{out}"
    );
    let (ok, out) = c.cli(0, "host remove h9");
    assert!(!ok && out.contains("there is no host `h9`"), "{out}");
    c.agents[2] = None;
    wait_until("h3 not live", 20, || {
        c.status_now(0)["hosts"]
            .as_array()
            .is_some_and(|h| h.iter().any(|h| h["name"] == "h3" && h["live"] == false))
    });
    let (ok, out) = c.cli(0, "host remove h3");
    assert!(ok, "{out}");
    wait_until("h3 forgotten and `out` unplaced", 20, || {
        let s = c.status_now(0);
        let hosts: Vec<&str> = s["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|h| h["name"].as_str())
            .collect();
        hosts == ["h1", "h2"] && s["graphs"][0]["apps"]["out"]["state"] == "unplaced"
    });
}

/// The shell blocks of `docs/cluster.md`'s walkthrough section, in order.
/// Runs `commands` as a shell script (`set -eu`, `fabric.sh down` at its end) from the
/// repository's folder, with Stitch's binaries on PATH, in a mount namespace of its own whose
/// /run/netns, /run/stitch, /run/stitch-fn and /var/lib/cni are empty (the fabric's namespaces and the
/// instances' sockets are its own); its files under `dir`.
fn run_isolated(dir: &Path, commands: &str) -> std::process::Output {
    let script = dir.join("script.sh");
    std::fs::write(
        &script,
        format!("set -eu\ntrap 'examples/cluster/fabric.sh down' EXIT\n{commands}"),
    )
    .unwrap();
    let isolate = "mkdir -p /run/netns /run/stitch /run/stitch-fn /var/lib/cni \
         && mount -t tmpfs walkthrough /run/netns \
         && mount -t tmpfs walkthrough /run/stitch \
         && mount -t tmpfs walkthrough /run/stitch-fn \
         && mount -t tmpfs walkthrough /var/lib/cni \
         && exec sh -x \"$0\"";
    let bin = Path::new(env!("CARGO_BIN_EXE_stitch")).parent().unwrap();
    Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", isolate])
        .arg(&script)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .env("STITCH_CLUSTER_DIR", dir)
        .env_remove("STITCH_ETCD")
        .env_remove("STITCH_ETCD_CA")
        .env_remove("STITCH_ETCD_CERT")
        .env_remove("STITCH_ETCD_KEY")
        .output()
        .unwrap()
}

/// etcd as `fabric.sh` secures it (docs/cluster.md, "Who may write what"), attacked: a client
/// without a certificate, one with a certificate of another CA, host 2's certificate writing
/// host 1's graph, its own graph, a cluster graph and host 1's liveness, the operator writing a
/// host's graph, `stitch cluster apply` with a host's certificate — each refused; each identity
/// still writes what it owns.
#[test]
fn etcd_lets_each_identity_write_only_its_keys() {
    let _one = one_cluster();
    require_root_and_tools(&["etcd", "etcdctl", "openssl", "unshare"]);
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
examples/cluster/fabric.sh up
pki=$STITCH_CLUSTER_DIR/pki
ep=https://198.51.100.1:2379
e() { ip netns exec h1 etcdctl --endpoints=$ep --cacert=$pki/ca.crt --command-timeout=3s "$@"; }
as() { who=$1; shift; e --cert=$pki/$who.crt --key=$pki/$who.key "$@"; }
if e put /stitch/assign/h1 '{}'; then echo "ATTACK: no certificate wrote"; fi
if e get /stitch/ --prefix; then echo "ATTACK: no certificate read"; fi
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=h1 -keyout $pki/x.key -out $pki/x.crt 2>/dev/null
if e --cert=$pki/x.crt --key=$pki/x.key put /stitch/assign/h1 '{}'; then echo "ATTACK: another CA's h1 wrote"; fi
for k in /stitch/assign/h1 /stitch/assign/h2 /stitch/graphs/evil /stitch/alive/h1 /stitch/hosts/h1 /stitch/status/h1 /stitch/placements/chain; do
  if as h2 put $k '{}'; then echo "ATTACK: h2 wrote $k"; fi
done
if as h2 get /stitch/assign/h1; then echo "ATTACK: h2 read h1's graph"; fi
for k in /stitch/assign/h1 /stitch/placements/chain /stitch/alive/h1; do
  if as operator put $k '{}'; then echo "ATTACK: the operator wrote $k"; fi
done
if STITCH_ETCD=$ep STITCH_ETCD_CA=$pki/ca.crt STITCH_ETCD_CERT=$pki/h2.crt STITCH_ETCD_KEY=$pki/h2.key    ip netns exec h1 stitch cluster apply examples/cluster/chain.yaml; then echo "ATTACK: h2 applied a graph"; fi
as h2 put /stitch/status/h2 '{}' && echo "LEGIT: h2 wrote its status"
as h2 get /stitch/assign/h2 && echo "LEGIT: h2 read its graph"
as operator put /stitch/graphs/probe '{}' && echo "LEGIT: the operator wrote a graph"
as h1 put /stitch/assign/h3 '{}' && echo "LEGIT: the controller wrote a host's graph"
as root del /stitch/graphs/probe; as root del /stitch/assign/h3
# What a host runs: only what its allow file names, whoever writes its graph.
d=$STITCH_CLUSTER_DIR
command -v stitch-nf-firewall > $d/allow
export STITCH_ETCD=https://198.51.100.1:2379,https://198.51.100.2:2379 STITCH_ETCD_CA=$pki/ca.crt
for i in 1 2; do
  ip netns exec h$i stitch agent --host h$i --underlay 192.0.2.$i --allow-commands $d/allow \
    --etcd-cert $pki/h$i.crt --etcd-key $pki/h$i.key >$d/agent-h$i.log 2>&1 &
done
export STITCH_ETCD_CERT=$pki/operator.crt STITCH_ETCD_KEY=$pki/operator.key
ip netns exec h1 stitch cluster status --wait-live 2 >/dev/null
# A host graph forged past the controller (etcd's root): the agent refuses it, runs nothing.
as root put /stitch/assign/h2 "{\"graphs\":{},\"document\":{\"apps\":{\"pw\":{\"placement\":\"process\",\"command\":[\"/bin/sh\",\"-c\",\"id > $d/pwned\"]}},\"links\":[]}}"
timeout 20 sh -c "until ip netns exec h1 etcdctl --endpoints=$ep --cacert=$pki/ca.crt --cert=$pki/root.crt --key=$pki/root.key get /stitch/status/h2 | grep -q 'does not allow'; do sleep 0.2; done" \
  && echo "LEGIT: h2 refused the forged graph"
sleep 1
if [ -e $d/pwned ]; then echo "ATTACK: the forged graph ran"; fi
# A cluster graph: the allowed function runs on h2; a shell is unplaced, with the reason.
printf 'apps:\n  fw: { placement: process, command: [stitch-nf-firewall], host: h2 }\n  sh: { placement: process, command: [/bin/sh, -c, "id > %s/pwned2"] }\n' "$d" > $d/fn.yaml
ip netns exec h1 stitch cluster apply $d/fn.yaml
timeout 20 sh -c "until ip netns exec h1 stitch cluster status --json | grep -q 'no live host allows it'; do sleep 0.2; done" \
  && echo "LEGIT: the shell is unplaced"
timeout 20 sh -c "until ip netns exec h2 stitch show fw --name h2 2>/dev/null | grep -q running; do sleep 0.2; done" \
  && echo "LEGIT: the allowed function runs"
if [ -e $d/pwned2 ]; then echo "ATTACK: the shell ran"; fi
"#;
    let out = run_isolated(dir.path(), script);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stdout.contains("ATTACK"), "{stdout}\n{stderr}");
    for legit in [
        "h2 wrote its status",
        "h2 read its graph",
        "the operator wrote a graph",
        "the controller wrote a host's graph",
        "h2 refused the forged graph",
        "the shell is unplaced",
        "the allowed function runs",
    ] {
        assert!(stdout.contains(legit), "{legit}: {stdout}\n{stderr}");
    }
    assert!(stderr.contains("permission denied"), "{stderr}");
}

#[test]
fn a_plain_etcd_needs_the_word_insecure() {
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["cluster", "status", "--etcd", "http://127.0.0.1:1"])
        .env_remove("STITCH_ETCD")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("plain HTTP") && err.contains("--etcd-insecure"),
        "{err}"
    );
}

fn walkthrough_commands() -> String {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cluster.md"),
    )
    .unwrap();
    let start = doc.find("\n## Walkthrough").expect("a walkthrough section");
    let section = &doc[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |e| e + 1)];
    let mut out = String::new();
    let mut inside = false;
    for line in section.lines() {
        match (inside, line.trim_start().starts_with("```")) {
            (false, true) if line.trim() == "```sh" => inside = true,
            (true, true) => inside = false,
            (true, false) => {
                out += line;
                out += "\n";
            }
            _ => {}
        }
    }
    out
}

/// `docs/cluster.md`'s walkthrough, its commands as the doc writes them (read from the doc),
/// in a mount namespace of its own whose `/run/netns`, `/run/stitch` and `/var/lib/cni` are
/// empty, so that its fixed names (h1, wa, …) meet nothing of the machine's or of other tests.
#[test]
fn the_cluster_walkthrough_runs_as_written() {
    let _one = one_cluster();
    require_root_and_tools(&["etcd", "etcdctl", "iperf3", "unshare", "nsenter"]);
    assert!(
        Path::new(CNI_BIN).join("cnitool").exists(),
        "{CNI_BIN}/cnitool is needed: scripts/install-deps --test builds it"
    );
    let commands = walkthrough_commands();
    assert!(commands.contains("cluster apply"), "{commands}");
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    // Twice on the same machine, as an operator would run it again: the second run finds
    // what the first left (its CNI leases were once kept, and gave other addresses).
    let out = run_isolated(dir.path(), &format!("{commands}\n{commands}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let logs: String = ["agent-h1.log", "agent-h2.log", "agent-h3.log"]
        .iter()
        .map(|f| {
            format!(
                "--- {f}\n{}\n",
                std::fs::read_to_string(dir.path().join(f)).unwrap_or_default()
            )
        })
        .collect();
    assert!(
        out.status.success(),
        "the walkthrough failed:\n{stdout}\n{stderr}\n{logs}"
    );
    eprintln!(
        "the walkthrough ran in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(stdout.contains("mtu 1450 "), "{stdout}");
    assert_eq!(
        stdout.matches("3 packets transmitted, 3 received").count(),
        2,
        "{stdout}"
    );
    assert!(stdout.contains("receiver"), "iperf3's summary: {stdout}");
    assert!(stdout.contains("every live host runs it"), "{stdout}");
    assert!(stdout.contains("chain.yaml: ok"), "{stdout}");
    // Hosts 2 and 3 have no controller role: etcd refused their campaigns.
    assert!(
        logs.matches("follows its graph only").count() >= 2,
        "{logs}"
    );
}
