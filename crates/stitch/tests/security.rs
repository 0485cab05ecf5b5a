//! Attacks on Stitch's doors, made for real (`docs/security.md`, "Who may do what"): as an
//! unprivileged local user each test creates, as a page of another site, with files planted
//! before Stitch reads or writes them — each refused — and the legitimate way in (the
//! operator's token, the socket's group, a file of one's own), which must still work.

mod common;

use common::*;
use serde_json::json;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const GRAPH: &str = "apps:
  gen: { type: generator, size: 64, rate: 2000 }
  fw: { type: forwarder }
  out: { type: sink }
links: [\"gen.output -> fw.input\", \"fw.output -> out.input\"]
";

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A name no other test (or run) uses.
fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}x{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A local user made for one test (with a group of its own that it belongs to, when asked),
/// removed when dropped.
struct LocalUser {
    name: String,
    group: Option<String>,
}

/// useradd and groupadd lock /etc/passwd and /etc/group: one at a time.
static ACCOUNTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl LocalUser {
    fn new(with_group: bool) -> LocalUser {
        require_root_and_tools(&["useradd", "groupadd", "runuser", "curl"]);
        let _one = ACCOUNTS.lock().unwrap_or_else(|p| p.into_inner());
        let name = unique("stsec");
        let group = with_group.then(|| format!("{name}g"));
        if let Some(g) = &group {
            must(&format!("groupadd {g}"));
        }
        let groups = group
            .as_ref()
            .map(|g| format!("-G {g} "))
            .unwrap_or_default();
        must(&format!(
            "useradd -M -N -s /usr/sbin/nologin {groups}{name}"
        ));
        LocalUser { name, group }
    }

    fn uid(&self) -> u32 {
        must(&format!("id -u {}", self.name))
            .trim()
            .parse()
            .unwrap()
    }

    /// `cmd` run by sh as this user.
    fn sh(&self, cmd: &str) -> Output {
        Command::new("runuser")
            .args(["-u", &self.name, "--", "sh", "-c", cmd])
            .env_remove("XDG_RUNTIME_DIR")
            .current_dir("/")
            .output()
            .unwrap()
    }

    /// The HTTP status `curl ARGS` gets as this user.
    fn curl(&self, args: &str) -> String {
        let o = self.sh(&format!("curl -s -o /dev/null -w '%{{http_code}}' {args}"));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

impl Drop for LocalUser {
    fn drop(&mut self) {
        let _one = ACCOUNTS.lock().unwrap_or_else(|p| p.into_inner());
        let _ = sh(&format!(
            "pkill -KILL -u {} ; userdel {}",
            self.name, self.name
        ));
        if let Some(g) = &self.group {
            let _ = sh(&format!("groupdel {g}"));
        }
    }
}

/// The HTTP status and body of `curl ARGS` as root.
fn curl(args: &str) -> (String, String) {
    let body = tempfile::NamedTempFile::new().unwrap();
    let code = must(&format!(
        "curl -s -o {} -w '%{{http_code}}' {args}",
        body.path().display()
    ));
    let body = std::fs::read(body.path()).unwrap_or_default();
    (code, String::from_utf8_lossy(&body).into_owned())
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
        & 0o7777
}

/// `stitch` started through `sh` with umask 0, as a careless service manager might.
fn under_umask_zero() -> Command {
    let mut c = Command::new("sh");
    c.args([
        "-c",
        "umask 0; exec \"$0\" \"$@\"",
        env!("CARGO_BIN_EXE_stitch"),
    ]);
    c
}

/// A copy of Stitch's binary `name` (`stitch`, `stitch-nf-firewall`) in a folder every user may
/// enter, for a test's other users to run (the checkout may lie in a folder only root enters).
fn runnable_by_all(dir: &Path, name: &str) -> std::path::PathBuf {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let to = dir.join(name);
    std::fs::copy(
        Path::new(env!("CARGO_BIN_EXE_stitch")).with_file_name(name),
        &to,
    )
    .unwrap();
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
    to
}

/// `stitch run ARGS` under umask 0, its output dropped.
fn run_under_umask_zero(args: &[&str]) -> Background {
    Background(
        under_umask_zero()
            .arg("run")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A file root writes if an attack works; removed when dropped.
struct Marker(std::path::PathBuf);

impl Drop for Marker {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_local_user_gets_nothing_from_the_api_on_loopback_and_each_role_gets_its_part() {
    let user = LocalUser::new(false);
    let port = free_port();
    let s = Stitch::run_with(GRAPH, &["--listen", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{port}");
    let pwned = Marker(std::env::temp_dir().join(unique("stsec-pwned-")));
    let attack = json!({
        "placement": "process",
        "command": ["/bin/sh", "-c", format!("id > {}", pwned.0.display())],
    });
    let put =
        format!("-X PUT -H 'Content-Type: application/json' {url}/api/v1/apps/pw -d '{attack}'");
    // The attack of the issue, without a token and with a guessed one.
    assert_eq!(user.curl(&put), "401");
    let guessed = format!("-H 'Authorization: Bearer {}' {put}", "0".repeat(64));
    assert_eq!(user.curl(&guessed), "401");
    // Nor does it read counters, the graph or the metrics, or capture traffic.
    for path in [
        "/api/v1/stats",
        "/api/v1/graph",
        "/api/v1/status",
        "/metrics",
        "/api/v1/links/fw.output/capture?count=3",
    ] {
        assert_eq!(user.curl(&format!("{url}{path}")), "401", "{path}");
    }
    // The tokens are root's alone.
    for role in ["read", "capture", "admin"] {
        let file = s.socket.with_extension("tokens").join(role);
        let m = std::fs::metadata(&file).unwrap();
        assert_eq!((m.mode() & 0o777, m.uid()), (0o600, 0), "{role}");
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(!pwned.0.exists(), "the attack ran a command");
    let (_, doc) = s.call("GET", "/api/v1/graph", None);
    assert!(doc["apps"].get("pw").is_none(), "{doc}");

    // Each role its part.
    let bearer = |role: &str| format!("-H 'Authorization: Bearer {}'", s.token(role));
    let sink = "-X PUT -H 'Content-Type: application/json' -d '{\"type\":\"sink\"}'";
    assert_eq!(
        curl(&format!("{} {url}/api/v1/stats", bearer("read"))).0,
        "200"
    );
    assert_eq!(curl(&format!("{} {url}/metrics", bearer("read"))).0, "200");
    let (code, why) = curl(&format!(
        "{} {sink} {url}/api/v1/apps/extra",
        bearer("read")
    ));
    assert_eq!(code, "403", "{why}");
    assert!(why.contains("needs the admin token"), "{why}");
    let capture = format!("{url}/api/v1/links/fw.output/capture?count=2");
    assert_eq!(curl(&format!("{} {capture}", bearer("read"))).0, "403");
    let (code, pcapng) = curl(&format!("{} {capture}", bearer("capture")));
    assert_eq!(code, "200");
    assert!(pcapng.len() > 100, "two frames in a PCAPNG stream");
    assert_eq!(
        curl(&format!(
            "{} {sink} {url}/api/v1/apps/extra",
            bearer("capture")
        ))
        .0,
        "403"
    );
    assert_eq!(
        curl(&format!(
            "{} {sink} {url}/api/v1/apps/extra",
            bearer("admin")
        ))
        .0,
        "201"
    );

    // A new admin token: the old one is refused at once, the new one works.
    let old = bearer("admin");
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["token", "new", "--role", "admin", "--control"])
        .arg(&s.socket)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(curl(&format!("{old} {url}/api/v1/stats")).0, "401");
    assert_eq!(
        curl(&format!("{} {url}/api/v1/stats", bearer("admin"))).0,
        "200"
    );

    // `stitch show` says who may do what.
    let (_, status) = s.call("GET", "/api/v1/status", None);
    let access = &status["access"];
    assert_eq!(access["unix_socket"]["role"], "admin", "{access}");
    assert_eq!(
        access["tcp"]["listen"],
        format!("127.0.0.1:{port}"),
        "{access}"
    );
    assert!(
        access["tcp"]["roles"]["read"]
            .as_str()
            .unwrap()
            .contains("/metrics"),
        "{access}"
    );
    s.stop();
}

#[test]
fn a_page_of_another_site_cannot_reach_the_api_even_holding_a_token() {
    require_root_and_tools(&["curl"]);
    let port = free_port();
    let s = Stitch::run_with(
        GRAPH,
        &[
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--api-host",
            "stitch.example",
        ],
    );
    let url = format!("http://127.0.0.1:{port}");
    let admin = format!("-H 'Authorization: Bearer {}'", s.token("admin"));
    let add = |name: &str, headers: &str| {
        curl(&format!(
            "{admin} {headers} -X PUT {url}/api/v1/apps/{name} -d '{{\"type\":\"sink\"}}'"
        ))
    };
    // DNS rebinding: the browser sends the attacker's name as the Host.
    let (code, why) = add(
        "a",
        &format!("-H 'Host: evil.example:{port}' -H 'Content-Type: application/json'"),
    );
    assert_eq!(code, "403", "{why}");
    assert!(why.contains("--api-host"), "{why}");
    // Cross-site requests carry their page's Origin.
    let (code, why) = add(
        "b",
        "-H 'Origin: http://evil.example' -H 'Content-Type: application/json'",
    );
    assert_eq!(code, "403", "{why}");
    assert_eq!(
        add("c", "-H 'Origin: null' -H 'Content-Type: application/json'").0,
        "403"
    );
    // What an HTML form or a simple fetch can send.
    for kind in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let (code, why) = add("d", &format!("-H 'Content-Type: {kind}'"));
        assert_eq!(code, "415", "{kind}: {why}");
    }
    let (code, _) = curl(&format!(
        "{admin} -X POST -H 'Content-Type: text/plain' {url}/api/v1/links -d 'gen.output -> out.input'"
    ));
    assert_eq!(code, "415");
    let (_, doc) = s.call("GET", "/api/v1/graph", None);
    for name in ["a", "b", "c", "d"] {
        assert!(doc["apps"].get(name).is_none(), "{name}: {doc}");
    }
    assert_eq!(doc["links"].as_array().unwrap().len(), 2, "{doc}");

    // The API's own page (same origin), a name the operator gave, and YAML for a graph.
    let (code, why) = add(
        "e",
        &format!("-H 'Origin: {url}' -H 'Content-Type: application/json'"),
    );
    assert_eq!(code, "201", "{why}");
    let named = format!("-H 'Host: stitch.example:{port}' {admin}");
    assert_eq!(curl(&format!("{named} {url}/api/v1/stats")).0, "200");
    let yaml = GRAPH.replace('\n', "\\n");
    let (code, why) = curl(&format!(
        "{admin} -X PUT -H 'Content-Type: application/yaml' --data-binary \"$(printf '{yaml}')\" {url}/api/v1/graph"
    ));
    assert_eq!(code, "200", "{why}");
    s.stop();
}

/// Waits for the instance on `socket` to answer `stitch stats`.
fn wait_answering(socket: &Path, process: &mut Background) {
    let t = Instant::now();
    loop {
        let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
            .args(["stats", "--control"])
            .arg(socket)
            .output()
            .unwrap();
        if o.status.success() {
            return;
        }
        if let Ok(Some(status)) = process.0.try_wait() {
            panic!("stitch exited with {status}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "stitch did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_api_socket_is_root_and_its_groups_whatever_the_umask() {
    let member = LocalUser::new(true);
    let other = LocalUser::new(false);
    let group = member.group.clone().unwrap();
    let top = tempfile::tempdir().unwrap();
    std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let graph = top.path().join("g.yaml");
    std::fs::write(&graph, GRAPH).unwrap();
    let folder = top.path().join("run");
    let socket = folder.join("ctl.sock");
    // Before the process: dropped after it, to clean what a failed test's instance left.
    let _leftovers = Leftovers(socket.clone());
    let socket_arg = socket.display().to_string();
    let graph_arg = graph.display().to_string();
    let mut process =
        run_under_umask_zero(&["--group", &group, "--control", &socket_arg, &graph_arg]);
    wait_answering(&socket, &mut process);
    let gid = |p: &Path| std::fs::metadata(p).unwrap().gid();
    let group_id: u32 = must(&format!("getent group {group} | cut -d: -f3"))
        .trim()
        .parse()
        .unwrap();
    assert_eq!((mode_of(&folder), gid(&folder)), (0o750, group_id));
    assert_eq!((mode_of(&socket), gid(&socket)), (0o660, group_id));
    // Everything else in the folder is root's alone.
    for f in std::fs::read_dir(&folder).unwrap().flatten() {
        if f.path() != socket {
            assert_eq!(mode_of(&f.path()) & 0o077, 0, "{}", f.path().display());
        }
    }
    let bin = tempfile::tempdir().unwrap();
    let stitch = runnable_by_all(bin.path(), "stitch");
    let stats = format!("{} stats --control {}", stitch.display(), socket.display());
    let o = member.sh(&stats);
    assert!(
        o.status.success(),
        "the group's member: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("fw"));
    let o = other.sh(&stats);
    assert!(
        !o.status.success(),
        "a user outside the group reached the socket"
    );
    let put = format!(
        "curl -s --unix-socket {} -X PUT -H 'Content-Type: application/json' http://x/api/v1/apps/pw -d '{{\"type\":\"sink\"}}'",
        socket.display()
    );
    assert!(
        !other.sh(&put).status.success(),
        "a user outside the group changed the graph"
    );
    assert!(
        member.sh(&put).status.success(),
        "the group's member could not change the graph"
    );
    process.signal(libc::SIGINT);
    assert!(process.finish().status.success());

    // The default runtime folder, under umask 0 too: nothing in it for other users.
    let name = unique("stsec-");
    let socket = Path::new("/run/stitch").join(format!("{name}.sock"));
    let _leftovers_too = Leftovers(socket.clone());
    let mut process = run_under_umask_zero(&["--name", &name, &graph_arg]);
    wait_answering(&socket, &mut process);
    assert_eq!(mode_of(Path::new("/run/stitch")) & 0o007, 0);
    assert_eq!(mode_of(&socket) & 0o007, 0);
    let o = other.sh(&format!("{} stats --name {name}", stitch.display()));
    assert!(
        !o.status.success(),
        "another user reached /run/stitch/{name}.sock"
    );
    process.signal(libc::SIGINT);
    assert!(process.finish().status.success());
}

#[test]
fn state_and_graph_files_others_can_write_are_refused_and_links_are_not_followed() {
    let user = LocalUser::new(false);
    let firewall = "apps:
  gen: { type: generator, size: 64, rate: 2000, count: 200 }
  fw: { type: firewall, default: drop, rules: [{ action: accept, from: lan }] }
  out: { type: sink }
links: [\"gen.output -> fw.lan\", \"fw.wan -> out.input\"]
";
    // In a folder every user may write (even sticky, as /tmp): refused before anything runs.
    let in_tmp = Marker(std::env::temp_dir().join(unique("stsec-state-")));
    let err = run_must_fail_with(
        firewall,
        &["--state", in_tmp.0.to_str().unwrap(), "--duration", "1"],
    );
    assert!(err.contains("writable by other users (mode 1777)"), "{err}");

    // A state file of one's own: written 0600, read back.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("fw.state");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "root's own").unwrap();
    // A link planted where an older Stitch wrote its temporary file.
    std::os::unix::fs::symlink(&victim, dir.path().join("fw.state.tmp")).unwrap();
    let run = |extra: &[&str]| run_graph(dir.path(), firewall, extra);
    run(&["--state", state.to_str().unwrap()]);
    assert_eq!(mode_of(&state), 0o600);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's own");
    assert!(std::fs::read_to_string(&state)
        .unwrap()
        .contains("stitch_state_format"));

    // The same file, now another user's: refused with the reason.
    must(&format!("chown {} {}", user.name, state.display()));
    let err = run_must_fail_with(
        firewall,
        &["--state", state.to_str().unwrap(), "--duration", "1"],
    );
    assert!(
        err.contains(&format!("belongs to uid {}", user.uid())),
        "{err}"
    );
    // Root's again but writable by the group.
    must(&format!("chown root {}", state.display()));
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o620)).unwrap();
    let err = run_must_fail_with(
        firewall,
        &["--state", state.to_str().unwrap(), "--duration", "1"],
    );
    assert!(err.contains("writable by other users (mode 620)"), "{err}");

    // A graph file another user owns (and so decides what root runs).
    let graph = dir.path().join("theirs.yaml");
    std::fs::write(&graph, GRAPH).unwrap();
    must(&format!("chown {} {}", user.name, graph.display()));
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["run", "--duration", "1", "--control"])
        .arg(dir.path().join("s.sock"))
        .arg(&graph)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("graph file") && err.contains("belongs to uid"),
        "{err}"
    );
}

#[test]
fn what_stitch_writes_is_private_whatever_the_umask_and_never_through_a_planted_link() {
    require_root_and_tools(&["tshark"]);
    let graph = "apps:
  gen: { type: generator, size: 64, rate: 2000 }
  fw: { type: forwarder }
  out: { type: pcap_sink, file: out.pcapng }
links: [\"gen.output -> fw.input\", \"fw.output -> out.input\"]
";
    // The state file relative to the instance's working folder.
    let work = tempfile::tempdir().unwrap();
    let mut command = under_umask_zero();
    command.current_dir(work.path());
    let s = Stitch::run_as(command, graph, &["--state", "fw.state"]);
    let state = work.path().join("fw.state");
    wait_until("the state file", 10, || state.exists());
    let captured = work.path().join("link.pcapng");
    let o = Command::new("sh")
        .args([
            "-c",
            "umask 0; exec \"$0\" \"$@\"",
            env!("CARGO_BIN_EXE_stitch"),
        ])
        .args(["capture", "--link", "fw", "-c", "5", "-w"])
        .arg(&captured)
        .arg("--control")
        .arg(&s.socket)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A capture to a name another user planted as a link to root's file.
    let victim = s.path().join("victim");
    std::fs::write(&victim, "root's own").unwrap();
    let planted = s.path().join("planted.pcapng");
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["capture", "--link", "fw", "-c", "5", "-w"])
        .arg(&planted)
        .arg("--control")
        .arg(&s.socket)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("symbolic link"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "root's own");
    assert_eq!(mode_of(&s.path().join("out.pcapng")), 0o600);
    s.stop();
    for f in [&state, &captured] {
        assert_eq!(mode_of(f), 0o600, "{}", f.display());
    }
    assert_eq!(tshark_checked(&captured, &["frame.len"]).len(), 5);
}

#[test]
fn a_non_root_instance_refuses_a_runtime_folder_another_user_made() {
    let owner = LocalUser::new(false);
    let attacker = LocalUser::new(false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let graph = dir.path().join("g.yaml");
    std::fs::write(&graph, GRAPH).unwrap();
    std::fs::set_permissions(&graph, std::fs::Permissions::from_mode(0o644)).unwrap();
    let folder = std::env::temp_dir().join(format!("stitch-{}", owner.uid()));
    let _gone = Marker(folder.clone());
    let _ = std::fs::remove_dir_all(&folder);
    let bin = tempfile::tempdir().unwrap();
    let run = format!(
        "{} run {} --duration 0.5",
        runnable_by_all(bin.path(), "stitch").display(),
        graph.display()
    );
    // The attacker makes the folder first, open to all, to receive the owner's requests.
    let o = attacker.sh(&format!("mkdir -m 777 {}", folder.display()));
    assert!(o.status.success());
    let o = owner.sh(&run);
    assert!(
        !o.status.success(),
        "the instance used another user's folder"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("belongs to uid {}", attacker.uid())),
        "{err}"
    );
    // Without the planted folder the owner's instance makes its own, 0700.
    std::fs::remove_dir_all(&folder).unwrap();
    let o = owner.sh(&run);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = std::fs::metadata(&folder).unwrap();
    assert_eq!((m.mode() & 0o777, m.uid()), (0o700, owner.uid()));
    std::fs::remove_dir_all(&folder).unwrap();
}

/// `stitch check` of graph `text`, written into `dir`.
fn stitch_check(dir: &Path, text: &str) -> Output {
    let file = dir.join("check.yaml");
    std::fs::write(&file, text).unwrap();
    Command::new(env!("CARGO_BIN_EXE_stitch"))
        .arg("check")
        .arg(&file)
        .output()
        .unwrap()
}

#[test]
fn an_openflow_endpoint_other_hosts_reach_is_refused_unless_called_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let check = |text: &str| stitch_check(dir.path(), text);
    let open = "apps:\n  sw: { type: switch, ports: [a, b], listen: \"0.0.0.0:6653\" }\n";
    let o = check(open);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("reachable from other hosts") && err.contains("insecure: true"),
        "{err}"
    );
    assert!(err.contains(":2:"), "the error names the line: {err}");
    let o = check(&open.replace("listen:", "insecure: true, listen:"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = check(&open.replace("0.0.0.0", "127.0.0.1"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The status fields of process `pid` that say who it runs as and what it may do.
fn process_status(pid: i32) -> std::collections::HashMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

#[test]
fn a_function_runs_unprivileged_and_only_its_own_process_or_a_named_user_attaches_a_port() {
    let other = LocalUser::new(false);
    // A folder the functions and the other user may enter (not list).
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let socket = dir.path().join("nf.sock");
    // Its program in a folder only root may enter (a checkout in a home folder of 0700): Stitch
    // opens it and runs it from the descriptor.
    let closed = tempfile::tempdir().unwrap();
    std::fs::set_permissions(closed.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let program = closed.path().join("stitch-nf-firewall");
    std::fs::copy(
        Path::new(env!("CARGO_BIN_EXE_stitch")).with_file_name("stitch-nf-firewall"),
        &program,
    )
    .unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let graph = format!(
        "apps:
  gen: {{ type: generator, size: 64, rate: 2000 }}
  fw: {{ placement: process, command: [{p}], socket: {s} }}
  out: {{ type: sink }}
  g2: {{ type: generator, size: 64, rate: 100 }}
  byhand: {{ type: nf_port, socket: {s} }}
  s2: {{ type: sink }}
  g3: {{ type: generator, size: 64, rate: 100 }}
  theirs: {{ type: nf_port, socket: {s}, allow_users: [{u}] }}
  s3: {{ type: sink }}
links: [\"gen.output -> fw.input\", \"fw.output -> out.input\", \"g2.output -> byhand.input\",
  \"byhand.output -> s2.input\", \"g3.output -> theirs.input\", \"theirs.output -> s3.input\"]
",
        s = socket.display(),
        u = other.name,
        p = program.display()
    );
    let mut command = Command::new(env!("CARGO_BIN_EXE_stitch"));
    command.env("STITCH_TEST_SECRET", "root's environment");
    let s = Stitch::run_as(command, &graph, &[]);
    wait_until("the function to attach", 20, || {
        show(&s, "fw")["attached"] == true
    });
    let pid = pid_of(&s, "fw").unwrap();
    let st = process_status(pid);
    let fn_uid = must("id -u stitch-fn").trim().to_string();
    assert!(st["Uid"].split_whitespace().all(|u| u == fn_uid), "{st:?}");
    for caps in ["CapBnd", "CapEff", "CapPrm", "CapAmb"] {
        assert_eq!(st[caps], "0000000000000000", "{caps}: {st:?}");
    }
    assert_eq!(st["NoNewPrivs"], "1");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(!environ.contains("STITCH_TEST_SECRET"), "{environ}");
    assert!(environ.contains("STITCH_NF_PORT=fw"), "{environ}");
    // Its descriptors: the standard three and what it opened itself.
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let to = std::fs::read_link(fd.path()).unwrap_or_default();
        let to = to.display().to_string();
        assert!(
            !to.starts_with(s.path().to_str().unwrap())
                && !to.contains("pidfd")
                && !to.contains("bpf"),
            "the function holds {to}"
        );
    }
    wait_until("traffic through the function", 10, || {
        s.counter("out", "packets").unwrap_or(0) > 100
    });
    assert_eq!(mode_of(&socket), 0o666);

    // Another user, posing as a function: refused for the function's port and one waiting
    // for a function started by hand; let in where the port names it.
    let bin = tempfile::tempdir().unwrap();
    let firewall = runnable_by_all(bin.path(), "stitch-nf-firewall");
    let pose = |port: &str| {
        other.sh(&format!(
            "STITCH_NF_SOCKET={} STITCH_NF_PORT={port} timeout 3 {} 2>&1",
            socket.display(),
            firewall.display()
        ))
    };
    for port in ["fw", "byhand"] {
        let o = pose(port);
        let said = String::from_utf8_lossy(&o.stdout);
        assert!(
            said.contains(&format!("uid {} ", other.uid())) && said.contains("may not attach"),
            "{port}: {said}"
        );
    }
    assert_ne!(show(&s, "byhand")["attached"], true);
    let theirs = std::thread::scope(|scope| {
        let running = scope.spawn(|| pose("theirs"));
        wait_until("the named user's function to attach", 10, || {
            show(&s, "theirs")["attached"] == true
        });
        let v = show(&s, "theirs");
        let _ = running.join();
        v
    });
    assert_eq!(theirs["attached"], true, "{theirs}");
    // The function's process is still the one attached to its port.
    assert_eq!(pid_of(&s, "fw"), Some(pid));
    s.stop();
}

#[test]
fn a_vm_port_socket_is_its_owners_and_no_other_user_drives_the_guest() {
    require_root_and_tools(&["python3"]);
    let owner = LocalUser::new(false);
    let stranger = LocalUser::new(false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let (root_only, owned) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let graph = format!(
        "apps:
  a: {{ type: vhost_user, socket: {a} }}
  b: {{ type: vhost_user, socket: {b}, owner: {o} }}
links: [\"a.output -> b.input\", \"b.output -> a.input\"]
",
        a = root_only.display(),
        b = owned.display(),
        o = owner.name
    );
    // Under umask 0 too: the modes are Stitch's.
    let s = Stitch::run_as(under_umask_zero(), &graph, &[]);
    wait_until("both sockets", 10, || root_only.exists() && owned.exists());
    assert_eq!(mode_of(&root_only), 0o600);
    assert_eq!(mode_of(&owned), 0o600);
    assert_eq!(std::fs::metadata(&owned).unwrap().uid(), owner.uid());
    let connect = |u: &LocalUser, p: &Path| {
        let o = u.sh(&format!(
            "python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect(\"{}\"); print(\"connected\")' 2>&1",
            p.display()
        ));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // Nobody but root reaches a port without an owner; only its owner one with.
    for (u, p) in [
        (&owner, &root_only),
        (&stranger, &root_only),
        (&stranger, &owned),
    ] {
        let said = connect(u, p);
        assert!(
            said.contains("Permission denied"),
            "{} → {}: {said}",
            u.name,
            p.display()
        );
    }
    assert!(connect(&owner, &owned).contains("connected"));
    let connections = |app: &str| s.counter(app, "connections").unwrap_or(0);
    wait_until("the owner's connection counted", 10, || {
        connections("b") >= 1
    });
    assert_eq!(connections("a"), 0);
    assert_eq!(show(&s, "b")["owner"], owner.name.as_str());
    s.stop();
}

#[test]
fn openflow_over_tls_lets_in_only_controllers_whose_certificate_its_ca_signed() {
    require_root_and_tools(&["ovs-ofctl", "openssl"]);
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path(), "ca", &["sw", "ctl"]);
    pki(dir.path(), "rogue-ca", &["rogue"]);
    let port = free_port();
    let p = |f: &str| dir.path().join(f).display().to_string();
    let s = Stitch::run(&format!(
        "apps:
  sw: {{ type: switch, ports: [a, b], listen: \"ssl:127.0.0.1:{port}\", cert: {}, key: {}, ca: {} }}
  a: {{ type: sink }}
  b: {{ type: sink }}
",
        p("sw.crt"),
        p("sw.key"),
        p("ca.crt")
    ));
    let ofctl = |who: &str, args: &str| {
        sh(&format!(
            "ovs-ofctl -O OpenFlow13 -p {} -c {} -C {} {args}",
            p(&format!("{who}.key")),
            p(&format!("{who}.crt")),
            p("ca.crt")
        ))
    };
    // The controller with a certificate from the switch's CA programs it.
    let o = ofctl(
        "ctl",
        &format!("add-flow ssl:127.0.0.1:{port} in_port=1,actions=output:2"),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = ofctl("ctl", &format!("dump-flows ssl:127.0.0.1:{port}"));
    let flows = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        flows.contains("in_port=1") && flows.contains("output:2"),
        "{flows}"
    );
    // One signed by another CA, and plain TCP, get nothing.
    let o = ofctl(
        "rogue",
        &format!("add-flow ssl:127.0.0.1:{port} in_port=2,actions=output:1"),
    );
    assert!(
        !o.status.success(),
        "a rogue controller programmed the switch"
    );
    let o = sh(&format!(
        "timeout 5 ovs-ofctl -O OpenFlow13 add-flow tcp:127.0.0.1:{port} in_port=2,actions=output:1"
    ));
    assert!(!o.status.success(), "plain OpenFlow on the TLS port");
    let o = ofctl("ctl", &format!("dump-flows ssl:127.0.0.1:{port}"));
    let after = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(!after.contains("in_port=2"), "{after}");
    s.stop();

    // On an address other hosts reach, TLS needs no `insecure`; a key others may read is
    // refused.
    let check = |text: &str| stitch_check(dir.path(), text);
    let open = format!(
        "apps:\n  sw: {{ type: switch, ports: [a], listen: \"ssl:0.0.0.0:6653\", cert: {}, key: {}, ca: {} }}\n",
        p("sw.crt"),
        p("sw.key"),
        p("ca.crt")
    );
    let o = check(&open);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = check("apps:\n  sw: { type: switch, ports: [a], listen: \"ssl:127.0.0.1:6653\" }\n");
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs `cert`, `key` and `ca`"));
    std::fs::set_permissions(
        dir.path().join("sw.key"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let err = run_must_fail_with(
        &format!(
            "apps:\n  sw: {{ type: switch, ports: [a], listen: \"ssl:127.0.0.1:{}\", cert: {}, key: {}, ca: {} }}\n  a: {{ type: sink }}\n",
            free_port(),
            p("sw.crt"),
            p("sw.key"),
            p("ca.crt")
        ),
        &["--duration", "1"],
    );
    assert!(err.contains("may be read by other users"), "{err}");
}

/// A Python program that tries to open an Internet socket and says on standard error what it
/// got, then waits (a function that never attaches).
const TRIES_A_SOCKET: &str = "import socket, sys, time
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    print('inet socket made', file=sys.stderr, flush=True)
except OSError as e:
    print('inet socket refused', e.errno, file=sys.stderr, flush=True)
time.sleep(60)
";

#[test]
fn a_function_asking_for_the_default_seccomp_filter_runs_and_gets_nothing_else() {
    require_root_and_tools(&["/usr/bin/python3"]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let socket = dir.path().join("nf.sock");
    let probe = |name: &str, seccomp: &str| {
        format!(
            "  {name}: {{ placement: process, command: [/usr/bin/python3, -c, {:?}], socket: {}{seccomp} }}\n",
            TRIES_A_SOCKET,
            socket.display()
        )
    };
    let graph = format!(
        "apps:
  gen: {{ type: generator, size: 64, rate: 2000 }}
  fw: {{ placement: process, command: [stitch-nf-firewall], socket: {s}, seccomp: default }}
  out: {{ type: sink }}
{}{}links: [\"gen.output -> fw.input\", \"fw.output -> out.input\"]
",
        probe("filtered", ", seccomp: default"),
        probe("open", ""),
        s = socket.display()
    );
    let s = Stitch::run(&graph);
    // Stitch's own function lives with the filter: attached, forwarding.
    wait_until("the filtered function to attach", 20, || {
        show(&s, "fw")["attached"] == true
    });
    wait_until("traffic through it", 10, || {
        s.counter("out", "packets").unwrap_or(0) > 100
    });
    let st = process_status(pid_of(&s, "fw").unwrap());
    assert_eq!(st["Seccomp"], "2", "{st:?}");
    // What the filter keeps out: an Internet socket (EPERM), which the same program without
    // the filter gets.
    let said = |app: &str| show(&s, app)["process"]["stderr"].to_string();
    wait_until("the probes to report", 20, || {
        said("filtered").contains("inet socket") && said("open").contains("inet socket")
    });
    assert!(
        said("filtered").contains("inet socket refused 1"),
        "{}",
        said("filtered")
    );
    assert!(
        said("open").contains("inet socket made"),
        "{}",
        said("open")
    );
    s.stop();
}
