//! Captures of the links of a running graph (`stitch capture --link`, the API's capture
//! stream, the Wireshark extcap), checked with tshark, capinfos and curl: what the tap wrote is
//! what the next app received, the graph is the same before and after, and a reader that goes
//! away takes its taps with it.

mod common;
use common::*;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

fn stitch() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stitch"))
}

/// gen (paced, mixed sizes and flows) → fw → out (every packet out received, in a file).
const CHAIN: &str = "apps:\n  gen: { type: generator, rate: 50000, size: imix, flows: 50 }\n  fw: { type: forwarder }\n  out: { type: pcap_sink, file: next.pcapng }\nlinks:\n  - \"gen.output -> fw.input\"\n  - \"fw.output -> out.input\"\n";

fn link_capture(s: &Stitch, args: &[&str]) -> std::process::Output {
    stitch()
        .args(["capture", "--control"])
        .arg(&s.socket)
        .args(args)
        .output()
        .unwrap()
}

fn taps(s: &Stitch) -> Vec<u64> {
    let (status, links) = s.call("GET", "/api/v1/links", None);
    assert_eq!(status, 200);
    links
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["taps"].as_u64().unwrap())
        .collect()
}

/// One line per frame: its MD5, its interface and its direction flags, as tshark reads them.
fn frames(file: &Path) -> Vec<String> {
    let out = must(&format!(
        "tshark -r {} -o frame.generate_md5_hash:TRUE -T fields -e frame.md5_hash -e frame.interface_name -e frame.packet_flags_direction 2>/dev/null",
        file.display()
    ));
    out.lines().map(str::to_string).collect()
}

fn hashes(file: &Path) -> Vec<String> {
    frames(file)
        .iter()
        .map(|l| l.split('\t').next().unwrap().to_string())
        .collect()
}

#[test]
fn a_link_capture_is_what_the_next_app_received_and_leaves_the_graph_as_it_was() {
    require_root_and_tools(&["tshark", "capinfos"]);
    let mut s = Stitch::run(CHAIN);
    let (_, before) = s.call("GET", "/api/v1/graph", None);
    let file = s.path().join("fw-out.pcapng");
    let out = link_capture(
        &s,
        &[
            "--link",
            "fw.output",
            "-c",
            "2000",
            "-w",
            file.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("2000 packets captured"), "{err}");
    let (_, after) = s.call("GET", "/api/v1/graph", None);
    assert_eq!(before, after, "the graph document did not change");
    wait_until("the tap to come off", 5, || taps(&s) == vec![0, 0]);
    let next = s.path().join("next.pcapng");
    let _dir_stays = std::mem::replace(&mut s.dir, tempfile::tempdir().unwrap());
    s.stop();

    let captured = frames(&file);
    assert_eq!(captured.len(), 2000);
    assert!(
        captured
            .iter()
            .all(|l| l.ends_with("\tfw.output -> out.input\t0x00000002")),
        "one interface named after the link, packets outbound from fw: {:?}",
        &captured[..2]
    );
    let tapped = hashes(&file);
    let received = hashes(&next);
    let at = (0..received.len().saturating_sub(tapped.len()))
        .find(|&i| received[i..i + tapped.len()] == tapped[..]);
    assert!(
        at.is_some(),
        "the 2000 captured frames are a run of the {} frames `out` received, frame by frame",
        received.len()
    );
    let info = must(&format!("capinfos -M {}", file.display()));
    assert!(
        info.contains("nanoseconds") && info.contains("Number of stat entries = 1"),
        "{info}"
    );
}

#[test]
fn standard_output_pipes_into_tshark_and_several_captures_share_a_link() {
    require_root_and_tools(&["tshark"]);
    let s = Stitch::run(CHAIN);
    let both = |n: u32| {
        format!(
            "{} capture --control {} --link fw -c {n} -w - 2>/dev/null | tshark -r - -T fields -e frame.interface_name -e frame.packet_flags_direction 2>/dev/null",
            env!("CARGO_BIN_EXE_stitch"),
            s.socket.display()
        )
    };
    // Two captures of the same links at once, each with its own count.
    let (a, b) = std::thread::scope(|t| {
        let a = t.spawn(|| must(&both(3000)));
        let b = t.spawn(|| must(&both(500)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a.lines().count(), 3000);
    assert_eq!(b.lines().count(), 500);
    for l in [
        "gen.output -> fw.input\t0x00000001",
        "fw.output -> out.input\t0x00000002",
    ] {
        assert!(a.lines().any(|x| x == l), "{l} in {:?}", a.lines().next());
    }
    wait_until("the taps to come off", 5, || taps(&s) == vec![0, 0]);
}

#[test]
fn the_api_streams_pcapng_to_tshark_and_refuses_bad_requests_with_reasons() {
    require_root_and_tools(&["tshark", "curl"]);
    let s = Stitch::run(CHAIN);
    let url = |q: &str| format!("http://stitch/api/v1/links/{q}");
    let sock = s.socket.display().to_string();
    let headers = s.path().join("headers");
    let n = must(&format!(
        "curl -sS -D {} --unix-socket {sock} '{}' | tshark -r - -T fields -e udp.length 2>/dev/null",
        headers.display(),
        url("gen.output%20-%3E%20fw.input/capture?count=300&filter=udp%20and%20greater%20500&snaplen=128")
    ));
    assert_eq!(n.lines().count(), 300);
    assert!(
        n.lines().all(|l| l.parse::<u32>().unwrap() > 400),
        "the filter ran at the tap"
    );
    let h = std::fs::read_to_string(&headers).unwrap().to_lowercase();
    assert!(
        h.contains("content-type: application/x-pcapng") && h.contains("stitch-capture-id:"),
        "{h}"
    );

    for (path, status, reason) in [
        (
            "nat.input/capture",
            404,
            "no link of the running graph matches `nat.input`",
        ),
        ("fw/capture?filter=udp%20and%20and", 400, "udp and and"),
        ("fw/capture?count=ten", 400, "`count` must be a number"),
        ("fw/capture?snaplen=0", 400, "snaplen"),
        ("fw/capture?colour=red", 400, "unknown parameter `colour`"),
    ] {
        let (got, body) = s.call("GET", &format!("/api/v1/links/{path}"), None);
        assert_eq!(got, status, "{path}: {body}");
        let e = body["error"].as_str().unwrap();
        assert!(e.contains(reason), "{path}: {e}");
    }
    let (got, body) = s.call("DELETE", "/api/v1/captures/99", None);
    assert_eq!(got, 404, "{body}");
    assert_eq!(taps(&s), vec![0, 0], "refused captures tapped nothing");

    let out = link_capture(&s, &["--link", "nope", "-w", "-"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("its links: gen.output -> fw.input"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn ctrl_c_ends_with_statistics_and_a_vanished_reader_takes_its_taps_along() {
    require_root_and_tools(&["tshark", "capinfos"]);
    let s = Stitch::run(CHAIN);
    let (_, before) = s.call("GET", "/api/v1/graph", None);

    // Ctrl-C: the stream ends cleanly, with one statistics block per link.
    let file = s.path().join("int.pcapng");
    let child = stitch()
        .args(["capture", "--control"])
        .arg(&s.socket)
        .args(["--link", "fw", "-w"])
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let capture = Background(child);
    wait_until("the capture to start", 10, || taps(&s) == vec![1, 1]);
    std::thread::sleep(std::time::Duration::from_millis(300));
    capture.signal(libc::SIGINT);
    let out = capture.finish();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info = must(&format!("capinfos -M {}", file.display()));
    assert_eq!(
        info.matches("Number of stat entries = 1").count(),
        2,
        "one statistics block per link: {info}"
    );
    assert!(!frames(&file).is_empty());

    // The capture client killed outright: the instance notices and removes the taps.
    let child = stitch()
        .args(["capture", "--control"])
        .arg(&s.socket)
        .args(["--link", "fw.input", "-w", "-"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut killed = Background(child);
    let mut first = [0u8; 64];
    killed
        .0
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    assert_eq!(taps(&s), vec![1, 0]);
    killed.signal(libc::SIGKILL);
    drop(killed);
    wait_until("the taps of a killed client to come off", 5, || {
        taps(&s) == vec![0, 0]
    });

    // The reader of the pipe goes away first (`| head`): the capture ends, the taps go.
    let o = sh(&format!(
        "{} capture --control {} --link fw -w - 2>/dev/null | head -c 20000 | wc -c",
        env!("CARGO_BIN_EXE_stitch"),
        s.socket.display()
    ));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "20000");
    wait_until("the taps of a closed pipe to come off", 5, || {
        taps(&s) == vec![0, 0]
    });

    let (_, after) = s.call("GET", "/api/v1/graph", None);
    assert_eq!(before, after);
    let a = link(&s.stats().unwrap(), "fw.output -> out.input")["tx_packets"]
        .as_u64()
        .unwrap();
    wait_until("traffic to go on", 5, || {
        link(&s.stats().unwrap(), "fw.output -> out.input")["tx_packets"]
            .as_u64()
            .unwrap()
            > a
    });
}

#[test]
fn wireshark_lists_the_links_through_the_extcap_and_captures_them() {
    require_root_and_tools(&["tshark"]);
    let _installed = install_extcap();

    // An instance under its own name, where the extcap looks for instances.
    let name = format!("lc-ext-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("graph.yaml");
    std::fs::write(&graph, CHAIN).unwrap();
    let run = Background(
        stitch()
            .args(["run", "--name", &name])
            .arg(&graph)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let interface = format!("stitch:{name}:fw.output>out.input");
    let mut listed = String::new();
    wait_until("tshark -D to list the links", 20, || {
        listed = must("tshark -D 2>/dev/null");
        listed.contains(&interface)
    });
    assert!(listed.contains(&format!("stitch:{name}:gen.output>fw.input")));

    let file = dir.path().join("ext.pcapng");
    let o = sh(&format!(
        "timeout 30 tshark -i '{interface}' -c 100 -w {} 2>&1",
        file.display()
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    assert_eq!(frames(&file).len(), 100);
    let o = sh(&format!(
        "timeout 30 tshark -i '{interface}' -c 5 -f 'udp and and' 2>&1"
    ));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("can't parse filter expression"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // A clean stop removes the instance's socket: it is listed no more.
    run.signal(libc::SIGINT);
    assert!(run.finish().status.success());
    assert!(!must("tshark -D 2>/dev/null").contains(&interface));
}
