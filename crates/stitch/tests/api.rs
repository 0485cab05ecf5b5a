//! The HTTP API of a running instance: every route with good and bad input, bearer token and
//! TLS on TCP, live changes under load without loss, SIGHUP reload, `/metrics` read by the
//! Prometheus client's own parser, the served OpenAPI document checked by schemathesis (the
//! route list is checked against it in `stitch-api`'s own tests), and `stitch top`.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const GRAPH: &str = "apps:
  gen: { type: generator, size: 64, rate: 2000 }
  fw: { type: forwarder }
  out: { type: sink }
  br: { type: bridge, ports: { p1: {}, p2: {} } }
links:
  - \"gen.output -> fw.input\"
  - \"fw.output -> out.input\"
";

fn names(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect()
}

#[test]
fn reads_graph_counters_and_app_state() {
    let s = Stitch::run(GRAPH);
    let (st, doc) = s.call("GET", "/api/v1/graph", None);
    assert_eq!(st, 200);
    assert_eq!(
        doc["apps"]["gen"],
        json!({"type": "generator", "size": 64, "rate": 2000})
    );
    assert_eq!(
        doc["links"],
        json!(["gen.output -> fw.input", "fw.output -> out.input"])
    );
    let keys: Vec<&String> = doc["apps"].as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["gen", "fw", "out", "br"],
        "apps keep the file's order"
    );

    let (st, dot) = stitch_api::client::call(
        &s.socket,
        stitch_api::client::Method::GET,
        "/api/v1/graph?format=dot",
        None,
    )
    .unwrap();
    assert_eq!(st, 200);
    assert!(String::from_utf8(dot)
        .unwrap()
        .starts_with("digraph stitch"));
    let (st, e) = s.call("GET", "/api/v1/graph?format=svg", None);
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("`format`"), "{e}");

    // Rates appear once the sampler has two snapshots.
    wait_until("a link rate", 10, || {
        let (_, links) = s.call("GET", "/api/v1/links", None);
        links[0]["rate_pps"].as_f64().unwrap() > 1000.0
    });
    let (st, stats) = s.call("GET", "/api/v1/stats", None);
    assert_eq!(st, 200);
    assert!(stats["uptime_s"].as_f64().unwrap() > 0.0);
    assert_eq!(stats["workers"][0]["name"], "main");
    let (_, apps) = s.call("GET", "/api/v1/apps", None);
    assert_eq!(apps.as_array().unwrap().len(), 4);
    let (st, fw) = s.call("GET", "/api/v1/apps/fw", None);
    assert_eq!(st, 200);
    assert_eq!(fw["entry"]["type"], "forwarder");
    assert!(fw["stats"]["rx_packets"].as_u64().unwrap() > 0);
    assert!(fw["stats"]["rx_rate_pps"].as_f64().unwrap() > 0.0);
    let (st, e) = s.call("GET", "/api/v1/apps/nobody", None);
    assert_eq!(
        (st, e["error"].as_str().unwrap()),
        (404, "no app named `nobody`")
    );

    // App state: the bridge answers with its table, a sink has none, an unknown app is 404.
    let (st, table) = s.call("POST", "/api/v1/apps/br/query", Some("{\"limit\": 10}"));
    assert_eq!(st, 200);
    assert_eq!(table["count"], 0);
    // Commands: the bridge forgets its table; an unknown command is refused with the reason.
    let (st, r) = s.call(
        "POST",
        "/api/v1/apps/br/query",
        Some(r#"{"command": "flush"}"#),
    );
    assert_eq!((st, &r["flushed"]), (200, &json!(0)));
    let (st, e) = s.call(
        "POST",
        "/api/v1/apps/br/query",
        Some(r#"{"command": "explode"}"#),
    );
    assert_eq!(st, 400);
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .contains("unknown command `explode`"),
        "{e}"
    );
    let (st, e) = s.call("POST", "/api/v1/apps/out/query", None);
    assert_eq!(st, 409);
    assert!(e["error"].as_str().unwrap().contains("(sink)"), "{e}");
    let (st, _) = s.call("POST", "/api/v1/apps/nobody/query", None);
    assert_eq!(st, 404);
    let (st, e) = s.call("POST", "/api/v1/apps/br/query", Some("{limit"));
    assert_eq!(st, 400);
    assert!(
        e["error"].as_str().unwrap().contains("not valid JSON"),
        "{e}"
    );

    let (st, types) = s.call("GET", "/api/v1/types", None);
    assert_eq!(st, 200);
    assert!(types
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "router"));

    // Unknown routes and methods answer JSON reasons.
    let (st, e) = s.call("GET", "/api/v2/nothing", None);
    assert_eq!(st, 404);
    assert!(e["error"].as_str().unwrap().contains("openapi"), "{e}");
    let (st, e) = s.call("DELETE", "/api/v1/stats", None);
    assert_eq!(st, 405);
    assert!(e["error"].is_string());
    s.stop();
}

#[test]
fn changes_one_app_or_link_at_a_time() {
    let s = Stitch::run(GRAPH);
    apps_are_added_changed_and_refused(&s);
    links_are_added_refused_and_removed(&s);
    removing_an_app_removes_its_links(&s);
    a_whole_graph_is_refused_with_its_line_or_applied_by_diff(&s);
    s.stop();
}

/// Add an app (201), change it (200, reconfigured or restarted), refuse bad entries.
fn apps_are_added_changed_and_refused(s: &Stitch) {
    let (st, r) = s.call("PUT", "/api/v1/apps/tap0", Some(r#"{"type": "sink"}"#));
    assert_eq!(st, 201, "{r}");
    assert_eq!(names(&r["started"]), ["tap0"]);
    assert_eq!(r["kept"].as_array().unwrap().len(), 4, "{r}");
    let (st, r) = s.call(
        "PUT",
        "/api/v1/apps/gen",
        Some(r#"{"type": "generator", "size": 128, "rate": 2000}"#),
    );
    assert_eq!(st, 200, "{r}");
    assert!(
        names(&r["reconfigured"]) == ["gen"] || names(&r["restarted"]) == ["gen"],
        "{r}"
    );
    assert_eq!(names(&r["links_kept"]).len(), 2, "{r}");
    let (st, e) = s.call(
        "PUT",
        "/api/v1/apps/x",
        Some(r#"{"type": "sink", "colour": "blue"}"#),
    );
    assert_eq!(st, 400);
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .contains("unknown key `colour`"),
        "{e}"
    );
    let (st, e) = s.call("PUT", "/api/v1/apps/x", Some(r#"{"type": "teleporter"}"#));
    assert_eq!(st, 400);
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .contains("unknown app type `teleporter`"),
        "{e}"
    );
    let (st, e) = s.call("PUT", "/api/v1/apps/x", Some(r#"{"size": 1}"#));
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("`type`"), "{e}");
    // An app placed in a process goes without `type` here as in a graph file: what is wrong
    // with this one is its program, not its type.
    let (st, e) = s.call(
        "PUT",
        "/api/v1/apps/x",
        Some(r#"{"placement": "process", "command": ["no-such-function-program"]}"#),
    );
    assert_eq!(st, 400);
    let said = e.to_string();
    assert!(
        said.contains("no program `no-such-function-program`") && !said.contains("`type`"),
        "{e}"
    );
    let (st, e) = s.call("PUT", "/api/v1/apps/x", Some("[1, 2]"));
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("object"), "{e}");
    let (st, e) = s.call(
        "PUT",
        "/api/v1/apps/bad%20name",
        Some(r#"{"type": "sink"}"#),
    );
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("app name"), "{e}");
}

/// Links: add (201), duplicate (409), bad ports (400, naming the port), remove (200), 404.
fn links_are_added_refused_and_removed(s: &Stitch) {
    let (st, r) = s.call(
        "POST",
        "/api/v1/links",
        Some(r#"{"link": "br.p1 -> tap0.input", "size": 64}"#),
    );
    assert_eq!(st, 201, "{r}");
    assert_eq!(names(&r["links_added"]), ["br.p1 -> tap0.input"]);
    let (st, e) = s.call("POST", "/api/v1/links", Some(r#""br.p1->tap0.input""#));
    assert_eq!(st, 409, "{e}");
    let (st, e) = s.call("POST", "/api/v1/links", Some(r#""br.p9 -> out.nothing""#));
    assert_eq!(st, 400);
    assert!(
        e["error"].as_str().unwrap().contains("no output port `p9`"),
        "{e}"
    );
    assert!(
        !e["error"].as_str().unwrap().contains("line"),
        "no line numbers of an internal document: {e}"
    );
    let (st, e) = s.call("POST", "/api/v1/links", Some(r#"{"size": 4}"#));
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("`link`"), "{e}");
    let (_, links) = s.call("GET", "/api/v1/links", None);
    let added = links
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["link"] == "br.p1 -> tap0.input")
        .unwrap();
    assert_eq!(added["size"], 64);
    let (st, r) = s.call(
        "DELETE",
        "/api/v1/links?link=br.p1%20-%3E%20tap0.input",
        None,
    );
    assert_eq!(st, 200, "{r}");
    assert_eq!(names(&r["links_removed"]), ["br.p1 -> tap0.input"]);
    let (st, _) = s.call(
        "DELETE",
        "/api/v1/links?link=br.p1%20-%3E%20tap0.input",
        None,
    );
    assert_eq!(st, 404);
    let (st, e) = s.call("DELETE", "/api/v1/links", None);
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().contains("`link`"), "{e}");
}

fn removing_an_app_removes_its_links(s: &Stitch) {
    let (st, r) = s.call("DELETE", "/api/v1/apps/fw", None);
    assert_eq!(st, 200, "{r}");
    assert_eq!(names(&r["stopped"]), ["fw"]);
    assert_eq!(r["links_removed"].as_array().unwrap().len(), 2, "{r}");
    let (st, _) = s.call("DELETE", "/api/v1/apps/fw", None);
    assert_eq!(st, 404);
}

fn a_whole_graph_is_refused_with_its_line_or_applied_by_diff(s: &Stitch) {
    let (st, e) = s.call(
        "PUT",
        "/api/v1/graph?file=new.yaml",
        Some("apps:\n  a: { type: sink\n"),
    );
    assert_eq!(st, 400);
    assert!(e["error"].as_str().unwrap().starts_with("new.yaml:"), "{e}");
    assert!(e["errors"][0]["line"].as_u64().unwrap() >= 2, "{e}");
    let (st, r) = s.call("PUT", "/api/v1/graph", Some(GRAPH));
    assert_eq!(st, 200, "{r}");
    assert_eq!(names(&r["started"]), ["fw"]);
    assert_eq!(names(&r["stopped"]), ["tap0"]);
}

/// Applying changes through the API while traffic flows loses nothing on the links that did
/// not change.
#[test]
fn changes_under_load_lose_nothing_on_unchanged_links() {
    let total = 300_000u64;
    let s = Stitch::run(&format!(
        "apps:
  gen: {{ type: generator, size: 64, rate: 150000, count: {total} }}
  fw: {{ type: forwarder }}
  out: {{ type: sink }}
links:
  - {{ link: \"gen.output -> fw.input\", size: 8192 }}
  - {{ link: \"fw.output -> out.input\", size: 8192 }}
"
    ));
    let mut changes = 0;
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1500) {
        let (st, r) = s.call(
            "PUT",
            "/api/v1/apps/side",
            Some(&format!(
                r#"{{"type": "generator", "size": {}, "rate": 10}}"#,
                60 + changes % 20
            )),
        );
        assert!(st == 200 || st == 201, "{r}");
        let (st, r) = s.call("PUT", "/api/v1/apps/sink2", Some(r#"{"type": "sink"}"#));
        assert!(st == 200 || st == 201, "{r}");
        let (st, r) = s.call(
            "POST",
            "/api/v1/links",
            Some(r#""side.output -> sink2.input""#),
        );
        assert_eq!(st, 201, "{r}");
        assert_eq!(r["links_kept"].as_array().unwrap().len(), 2, "{r}");
        let (st, r) = s.call("DELETE", "/api/v1/apps/sink2", None);
        assert_eq!(st, 200, "{r}");
        changes += 4;
    }
    // The generator is finite: the instance ends by itself once everything has arrived.
    let out = s.process.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(app(&stats, "out")["counters"]["packets"], total);
    for l in stats["links"].as_array().unwrap() {
        if l["link"].as_str().unwrap().starts_with("side") {
            continue;
        }
        assert_eq!(l["tx_packets"], total, "{l}");
        assert_eq!(l["tx_drops"], 0, "{l}");
    }
    eprintln!("{changes} changes applied while {total} packets flowed");
    assert!(changes >= 8);
}

#[test]
fn sighup_reloads_the_graph_file_and_keeps_it_on_errors() {
    let s = Stitch::run(GRAPH);
    let file = s.graph_file();
    std::fs::write(
        &file,
        GRAPH.replace(
            "  br: { type: bridge, ports: { p1: {}, p2: {} } }\n",
            "  extra: { type: sink }\n",
        ),
    )
    .unwrap();
    s.process.signal(libc::SIGHUP);
    wait_until("the reloaded graph", 10, || {
        let (_, doc) = s.call("GET", "/api/v1/graph", None);
        doc["apps"].get("extra").is_some() && doc["apps"].get("br").is_none()
    });
    // A broken file is refused; the graph runs on unchanged, and so does the API's reload.
    std::fs::write(&file, "apps:\n  a: { type: nothing }\n").unwrap();
    s.process.signal(libc::SIGHUP);
    let (st, e) = s.call("POST", "/api/v1/graph/reload", None);
    assert_eq!(st, 400);
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .contains("unknown app type `nothing`"),
        "{e}"
    );
    std::thread::sleep(Duration::from_millis(300));
    let (_, doc) = s.call("GET", "/api/v1/graph", None);
    assert!(doc["apps"].get("extra").is_some());
    let stats = s.stop();
    assert_eq!(app(&stats, "extra")["type"], "sink");
}

#[test]
fn tcp_listener_needs_the_token_and_serves_tls() {
    require_root_and_tools(&["curl", "openssl"]);
    let dir = tempfile::tempdir().unwrap();
    // The operator makes the admin token before the start; the instance makes the others.
    let tokens = dir.path().join("tokens");
    let made = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["token", "new", "--role", "admin", "--token-dir"])
        .arg(&tokens)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let admin_file = tokens.join("admin");
    assert_eq!(
        String::from_utf8_lossy(&made.stdout).trim(),
        admin_file.to_str().unwrap()
    );
    let admin = std::fs::read_to_string(&admin_file)
        .unwrap()
        .trim()
        .to_string();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    must(&format!(
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost \
         -addext subjectAltName=DNS:localhost -keyout {} -out {} 2>&1",
        key.display(),
        cert.display()
    ));
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let s = Stitch::run_with(
        GRAPH,
        &[
            "--listen",
            &addr,
            "--token-dir",
            tokens.to_str().unwrap(),
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let url = format!("https://localhost:{port}");
    let curl = |args: &str| {
        must(&format!(
            "curl -s -o /dev/null -w '%{{http_code}}' --cacert {} --resolve localhost:{port}:127.0.0.1 {args}",
            cert.display()
        ))
    };
    assert_eq!(curl(&format!("{url}/api/v1/stats")), "401");
    assert_eq!(
        curl(&format!(
            "-H 'Authorization: Bearer wrong' {url}/api/v1/stats"
        )),
        "401"
    );
    assert_eq!(
        curl(&format!(
            "-H 'Authorization: Bearer {admin}' {url}/api/v1/stats"
        )),
        "200"
    );
    let read = std::fs::read_to_string(tokens.join("read")).unwrap();
    assert_eq!(
        curl(&format!(
            "-H 'Authorization: Bearer {}' {url}/metrics",
            read.trim()
        )),
        "200"
    );
    // The page holds no data and loads without the token (it sends the token it is given).
    assert_eq!(curl(&format!("{url}/")), "200");
    // Plain HTTP on the TLS port gets nothing.
    let plain = sh(&format!(
        "curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/api/v1/stats"
    ));
    assert_ne!(String::from_utf8_lossy(&plain.stdout), "200");
    s.stop();

    // Beyond localhost without TLS: refused before anything runs.
    let err = run_must_fail_with(GRAPH, &["--listen", "0.0.0.0:1"]);
    assert!(err.contains("--tls-cert"), "{err}");
}

#[test]
fn metrics_parse_with_the_prometheus_client_parser() {
    require_root_and_tools(&["curl", "python3"]);
    let port = free_port();
    let s = Stitch::run_with(GRAPH, &["--listen", &format!("127.0.0.1:{port}")]);
    wait_until("traffic", 10, || {
        s.stats().is_some_and(|st| {
            link(&st, "fw.output -> out.input")["tx_packets"].as_u64() > Some(100)
        })
    });
    let script = r#"
import sys, urllib.request
from prometheus_client.openmetrics.parser import text_string_to_metric_families
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
resp = urllib.request.urlopen(req)
assert resp.headers["Content-Type"].startswith("application/openmetrics-text"), resp.headers["Content-Type"]
families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
def sample(family, **labels):
    for s in families[family].samples:
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise SystemExit(f"no sample {family} {labels}")
assert families["stitch_link_packets"].type == "counter"
assert sample("stitch_link_packets", link="fw.output -> out.input") > 100
assert sample("stitch_app_rx_packets", app="out", type="sink", worker="main") > 100
assert sample("stitch_app_counter", app="out", counter="packets") > 100
assert sample("stitch_link_drops", link="gen.output -> fw.input") == 0
assert sample("stitch_worker_breaths", worker="main") > 0
assert sample("stitch_pool_buffers", **{"class": "ordinary"}) > 0
assert families["stitch_uptime_seconds"].type == "gauge"
print(len(families), "families")
"#;
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            script,
            &format!("http://127.0.0.1:{port}/metrics"),
            &s.token("read"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    s.stop();
}

#[test]
fn schemathesis_finds_no_server_error() {
    require_root_and_tools(&["schemathesis"]);
    let port = free_port();
    let s = Stitch::run_with(GRAPH, &["--listen", &format!("127.0.0.1:{port}")]);
    let out = std::process::Command::new("schemathesis")
        .args([
            "run",
            &format!("http://127.0.0.1:{port}/api/v1/openapi.json"),
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
            "--max-examples",
            "25",
            "--workers",
            "1",
            "--no-color",
            "--seed",
            "20261122",
            // Every route with the admin's token: the roles are `security.rs`'s.
            "-H",
            &format!("Authorization: Bearer {}", s.token("admin")),
            // A capture without count or duration streams until the client leaves, which the
            // fuzzer reads as a timeout; `link_capture.rs` tests the operation.
            "--exclude-operation-id",
            "captureLink",
        ])
        .env("SCHEMATHESIS_HOOKS", "")
        // Its cache and reports go to a folder of the test's own.
        .current_dir(s.dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found problems:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The instance is still alive and answering.
    assert!(s.stats().is_some());
    s.stop();
}

#[test]
fn top_shows_the_busiest_link_first() {
    let s = Stitch::run(
        "apps:
  fast: { type: generator, size: 64, rate: 20000 }
  slow: { type: generator, size: 64, rate: 100 }
  a: { type: sink }
  b: { type: sink }
links: [\"fast.output -> a.input\", \"slow.output -> b.input\"]
",
    );
    wait_until("rates", 10, || {
        let (_, l) = s.call("GET", "/api/v1/links", None);
        l[0]["rate_pps"].as_f64().unwrap() > 0.0
    });
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["top", "--once", "--control"])
        .arg(&s.socket)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let first_link = lines.iter().position(|l| l.starts_with("LINK")).unwrap() + 1;
    assert!(
        lines[first_link].starts_with("fast.output -> a.input"),
        "{text}"
    );
    assert!(text.contains("generator"), "{text}");
    s.stop();
}

/// The graph view in headless Chromium: the page draws the graph, a link's rate changes once
/// traffic starts, a click shows an app's counters. The screenshot is kept in
/// `target/test-artifacts/graph-view.png`.
#[test]
fn graph_view_in_headless_chromium() {
    require_root_and_tools(&["node", "chromium", "tshark"]);
    let web_test = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../api/web-test");
    assert!(
        web_test.join("node_modules/playwright-core").exists(),
        "playwright-core is missing: scripts/install-deps runs `npm ci` in {}",
        web_test.display()
    );
    let artifacts =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("graph-view.png");
    let _ = std::fs::remove_file(&shot);
    let port = free_port();
    let s = Stitch::run_with(
        "apps:\n  fw: { type: forwarder }\n  out: { type: sink }\nlinks: [\"fw.output -> out.input\"]\n",
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    let capture = s.path().join("from-the-page.pcapng");
    let out = std::process::Command::new("node")
        .arg(web_test.join("view-test.mjs"))
        .arg(format!("http://127.0.0.1:{port}"))
        .arg(s.token("capture"))
        .arg(s.token("admin"))
        .arg(&shot)
        .arg(&capture)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        seen["before"].as_str().unwrap().starts_with("0 pps"),
        "{seen}"
    );
    assert!(
        !seen["after"].as_str().unwrap().starts_with("0 pps"),
        "{seen}"
    );
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "a real screenshot"
    );
    // The link's capture button: one second of the link as a PCAPNG file named after it.
    assert_eq!(seen["button"], "capture 1 s", "{seen}");
    assert!(
        seen["saved"] == "stitch-fw.output--out.input.pcapng",
        "{seen}"
    );
    let frames = must(&format!(
        "tshark -r {} -T fields -e frame.interface_name 2>/dev/null",
        capture.display()
    ));
    assert!(
        frames.lines().count() > 1000 && frames.lines().all(|l| l == "fw.output -> out.input"),
        "about 5000 packets in one second: {}",
        frames.lines().count()
    );
    assert!(
        seen["refused"].as_str().unwrap().contains("udp and and"),
        "{seen}"
    );
    // The generator the page's script added through the API is in the graph.
    let (_, doc) = s.call("GET", "/api/v1/graph", None);
    assert_eq!(doc["apps"]["gen"]["type"], "generator");
    s.stop();
}

/// The instance's `/metrics`, read over its API socket.
fn metrics_text(s: &Stitch) -> String {
    let (status, body) =
        stitch_api::client::call(&s.socket, stitch_api::client::Method::GET, "/metrics", None)
            .unwrap();
    assert_eq!(status, 200);
    String::from_utf8(body).unwrap()
}

/// An app's totals in `/metrics`, by family (`stitch_app_tx_packets_total` …).
fn metric_of_app(s: &Stitch, family: &str, app_name: &str) -> u64 {
    let text = metrics_text(s);
    let label = format!("app=\"{app_name}\"");
    text.lines()
        .find(|l| l.starts_with(family) && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {family} for {app_name} in /metrics"))
}

#[test]
fn app_totals_never_go_back_and_every_packet_is_accounted_for_across_applies() {
    const SENT: u64 = 60_000;
    let graph = |mid: &str, size: usize| {
        format!(
            "apps:\n  gen: {{ type: generator, size: 64, rate: 20000, count: {SENT} }}\n  {mid}: {{ type: forwarder }}\n  out: {{ type: sink }}\nlinks:\n  - {{ link: \"gen.output -> {mid}.input\", size: {size} }}\n  - \"{mid}.output -> out.input\"\n"
        )
    };
    let s = Stitch::run_with(&graph("f0", 1024), &["--keep-running"]);
    let mut last = [0u64; 4];
    for i in 1..=50 {
        // Every other change replaces the middle app (and so both links); the others resize
        // its input link.
        s.apply(&graph(&format!("f{}", i / 2 % 2), [512, 1024][i % 2]));
        let st = s.stats().unwrap();
        let now = [
            app(&st, "gen")["tx_packets"].as_u64().unwrap(),
            app(&st, "out")["rx_packets"].as_u64().unwrap(),
            metric_of_app(&s, "stitch_app_tx_packets_total", "gen"),
            metric_of_app(&s, "stitch_app_rx_packets_total", "out"),
        ];
        for (k, what) in [
            "gen tx",
            "out rx",
            "gen tx in /metrics",
            "out rx in /metrics",
        ]
        .iter()
        .enumerate()
        {
            assert!(
                now[k] >= last[k],
                "apply {i}: {what} went back from {} to {}",
                last[k],
                now[k]
            );
        }
        last = now;
    }
    wait_until(
        "the generator sent everything and the links are empty",
        30,
        || {
            let st = s.stats().unwrap();
            let generator = app(&st, "gen");
            generator["tx_packets"].as_u64().unwrap() + generator["drops"].as_u64().unwrap() >= SENT
                && st["links"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|l| l["queued"] == 0)
        },
    );
    let st = s.stop();
    let drops: u64 = st["apps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["drops"].as_u64().unwrap())
        .sum();
    let delivered = app(&st, "out")["rx_packets"].as_u64().unwrap();
    let orphaned = st["removed_link_drops"].as_u64().unwrap();
    eprintln!("sent {SENT}: delivered {delivered}, dropped {drops} (named in apps), {orphaned} with removed links and apps");
    assert_eq!(
        delivered + drops + orphaned,
        SENT,
        "every packet is delivered or dropped under a name"
    );
}

/// The `stitch_link_latency_seconds` buckets of `link` in `/metrics`: (upper bound, cumulative
/// count), and the family's `_count`.
fn latency_buckets(s: &Stitch, link: &str) -> (Vec<(f64, u64)>, u64) {
    let text = metrics_text(s);
    let label = format!("link=\"{link}\"");
    let ours = |l: &&str| l.starts_with("stitch_link_latency_seconds") && l.contains(&label);
    let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap();
    let mut buckets = Vec::new();
    let mut count = None;
    for l in text.lines().filter(ours) {
        if l.starts_with("stitch_link_latency_seconds_count") {
            count = Some(value(l));
        } else if let Some(le) = l.split("le=\"").nth(1) {
            let le = le.split('"').next().unwrap();
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            buckets.push((bound, value(l)));
        }
    }
    (
        buckets,
        count.unwrap_or_else(|| panic!("no latency of {link} in\n{text}")),
    )
}

#[test]
fn a_links_latency_is_measured_against_a_known_delay() {
    const DELAY_NS: u64 = 5_000_000;
    let s = Stitch::run(&format!(
        "apps:
  gen: {{ type: generator, size: 64, rate: 2000 }}
  wait: {{ type: delay, delay_us: {} }}
  out: {{ type: sink }}
links:
  - \"gen.output -> wait.input\"
  - {{ link: \"wait.output -> out.input\", latency: true }}
",
        DELAY_NS / 1000
    ));
    let measured = |s: &Stitch| {
        let st = s.stats()?;
        let l = link(&st, "wait.output -> out.input")["latency"].clone();
        (l["count"].as_u64()? >= 1000).then_some(l)
    };
    wait_until("1000 packets measured", 20, || measured(&s).is_some());
    let l = measured(&s).unwrap();
    eprintln!("latency through a 5 ms delay: {l}");
    let ns = |k: &str| l[k].as_u64().unwrap();
    // Nothing leaves the delay early; the stamps are the generator's, once per batch.
    assert!(ns("min_ns") >= DELAY_NS, "{l}");
    assert_eq!(ns("unstamped"), 0, "{l}");
    // The median in the delay's bucket, or the next one on a busy machine: a bucket is 1/16
    // of its values wide (5 ms is in 4.98–5.24 ms).
    let bucket = |v: u64| stitch_core::latency::bucket_of(v);
    let off = bucket(ns("p50_ns")) - bucket(DELAY_NS);
    assert!(
        off <= 1,
        "p50 {} is {off} buckets above 5 ms: {l}",
        ns("p50_ns")
    );
    let buckets = l["buckets"].as_array().unwrap();
    let in_buckets: u64 = buckets.iter().map(|b| b["packets"].as_u64().unwrap()).sum();
    assert_eq!(in_buckets, ns("count"));

    // `/metrics`: a Prometheus histogram in seconds, nothing below 4.19 ms (2^22 ns), all
    // of it by 17.2 s.
    let (buckets, count) = latency_buckets(&s, "wait.output -> out.input");
    assert!(count >= 1000);
    assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, count));
    let at = |bound: f64| {
        buckets
            .iter()
            .find(|b| (b.0 - bound).abs() < 1e-12)
            .unwrap()
            .1
    };
    assert_eq!(at((1u64 << 22) as f64 * 1e-9), 0);
    assert!(buckets
        .windows(2)
        .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));

    // The table of `stitch stats` has a line for it.
    let table = must(&format!(
        "{} stats --control {}",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("wait.output -> out.input") && l.contains("ms")),
        "{table}"
    );
    s.stop();
}
