//! The `stitch` command end to end: real files checked with tshark/capinfos, the control
//! socket, live apply and clean shutdown on SIGINT.

mod common;
use common::capinfos_count;
use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::{DataLink, TsResolution};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn stitch() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stitch"))
}

fn tool(name: &str) -> Command {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .unwrap();
    assert!(
        found.status.success(),
        "{name} is needed by this test: apt-get install tshark (.ci/run does)"
    );
    Command::new(name)
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "command failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Timestamps and lengths of every frame, as tshark reads them.
fn tshark_frames(file: &Path) -> String {
    ok(tool("tshark")
        .args(["-r"])
        .arg(file)
        .args([
            "-T",
            "fields",
            "-e",
            "frame.time_epoch",
            "-e",
            "frame.len",
            "-e",
            "frame.cap_len",
            "-e",
            "eth.src",
            "-e",
            "ip.src",
        ])
        .output()
        .unwrap())
}

/// A frame of `len` bytes: Ethernet + IPv4 + UDP headers with a recognisable payload.
fn frame(i: usize, len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, (i >> 8) as u8, i as u8]);
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    f[14] = 0x45;
    f[16..18].copy_from_slice(&((len - 14) as u16).to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&[10, 0, (i >> 8) as u8, i as u8]);
    f[30..34].copy_from_slice(&[10, 1, 0, 1]);
    for (k, b) in f[42..].iter_mut().enumerate() {
        *b = (k + i) as u8;
    }
    f
}

const SIZES: [usize; 8] = [60, 64, 128, 576, 1500, 1514, 4000, 9216];

/// A PCAP file as libpcap writes it: in the host's byte order, as Stitch writes its own.
fn write_pcap(path: &Path, resolution: TsResolution, count: usize) {
    let header = PcapHeader {
        snaplen: 262144,
        datalink: DataLink::ETHERNET,
        ts_resolution: resolution,
        endianness: pcap_file::Endianness::native(),
        ..Default::default()
    };
    let mut w = PcapWriter::with_header(std::fs::File::create(path).unwrap(), header).unwrap();
    for i in 0..count {
        let data = frame(i, SIZES[i % SIZES.len()]);
        // Irregular timestamps with all nanosecond digits used (whole µs for µs files).
        let mut ns = 1_700_000_000_000_000_000u64 + i as u64 * 1_234_567 + (i as u64 % 7) * 111;
        if resolution == TsResolution::MicroSecond {
            ns -= ns % 1000;
        }
        w.write_packet(&PcapPacket::new(
            Duration::from_nanos(ns),
            data.len() as u32,
            &data,
        ))
        .unwrap();
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn copy_graph(dir: &Path, input: &str, output: &str) -> PathBuf {
    write(
        dir,
        "copy.yaml",
        &format!(
            "apps:\n  src: {{ type: pcap_source, file: {input} }}\n  fwd: {{ type: forwarder }}\n  dst: {{ type: pcap_sink, file: {output} }}\nlinks:\n  - \"src.output -> fwd.input\"\n  - \"fwd.output -> dst.input\"\n"
        ),
    )
}

fn run_to_end(graph: &Path, dir: &Path) -> serde_json::Value {
    let out = ok(stitch()
        .args(["run", "--json", "--control"])
        .arg(dir.join("ctl.sock"))
        .arg(graph)
        .output()
        .unwrap());
    serde_json::from_str(&out).unwrap()
}

#[test]
fn pcap_through_a_graph_is_byte_for_byte_faithful() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.pcap");
    write_pcap(&input, TsResolution::NanoSecond, 2000);
    let graph = copy_graph(dir.path(), "in.pcap", "out.pcap");
    let stats = run_to_end(&graph, dir.path());
    assert_eq!(stats["apps"][2]["counters"]["written"], 2000, "{stats}");
    let (a, b) = (
        std::fs::read(&input).unwrap(),
        std::fs::read(dir.path().join("out.pcap")).unwrap(),
    );
    assert!(
        a == b,
        "output differs from input ({} vs {} bytes)",
        a.len(),
        b.len()
    );
    assert_eq!(capinfos_count(&dir.path().join("out.pcap")), 2000);
    assert_eq!(
        tshark_frames(&input),
        tshark_frames(&dir.path().join("out.pcap"))
    );
}

#[test]
fn microsecond_pcap_becomes_nanosecond_with_same_frames() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.pcap");
    write_pcap(&input, TsResolution::MicroSecond, 500);
    let graph = copy_graph(dir.path(), "in.pcap", "out.pcap");
    run_to_end(&graph, dir.path());
    let out = dir.path().join("out.pcap");
    assert_eq!(tshark_frames(&input), tshark_frames(&out));
    let info = ok(tool("capinfos").arg("-M").arg(&out).output().unwrap());
    assert!(info.contains("nanoseconds"), "{info}");
}

#[test]
fn pcapng_in_and_out() {
    let dir = tempfile::tempdir().unwrap();
    let pcap = dir.path().join("in.pcap");
    write_pcap(&pcap, TsResolution::NanoSecond, 1000);
    let ng = dir.path().join("in.pcapng");
    ok(tool("editcap")
        .args(["-F", "pcapng"])
        .arg(&pcap)
        .arg(&ng)
        .output()
        .unwrap());
    let graph = copy_graph(dir.path(), "in.pcapng", "out.pcapng");
    run_to_end(&graph, dir.path());
    let out = dir.path().join("out.pcapng");
    let info = ok(tool("capinfos").arg("-M").arg(&out).output().unwrap());
    assert!(info.contains("pcapng"), "{info}");
    assert!(
        info.contains("Number of stat entries = 1"),
        "interface statistics at close: {info}"
    );
    assert_eq!(capinfos_count(&out), 1000);
    assert_eq!(tshark_frames(&pcap), tshark_frames(&out));
    // PCAPNG in -> PCAP out, too.
    let graph = copy_graph(dir.path(), "out.pcapng", "back.pcap");
    run_to_end(&graph, dir.path());
    assert!(std::fs::read(&pcap).unwrap() == std::fs::read(dir.path().join("back.pcap")).unwrap());
}

#[test]
fn check_reports_file_line_and_problem() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "bad.yaml",
        "apps:\n  gen: { type: generator, size: 64 }\n  out:\n    type: sink\n    colour: blue\n  fwd: { type: forwarder }\nlinks:\n  - \"gen.output -> fwd.in\"\n",
    );
    let out = stitch().arg("check").arg(&bad).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yaml:5:5: app `out` (sink) key `colour`: unknown key `colour`"),
        "{err}"
    );
    assert!(err.contains("bad.yaml:8:5: link `gen.output -> fwd.in`: app `fwd` (forwarder) has no input port `in`"), "{err}");
    let good = write(
        dir.path(),
        "good.yaml",
        "apps:\n  a: { type: generator }\n  b: { type: sink }\nlinks: [\"a.output -> b.input\"]\n",
    );
    assert!(ok(stitch().arg("check").arg(&good).output().unwrap())
        .contains("ok (2 apps; 1 link, 1 worker)"));
    let dot = ok(stitch().arg("graph").arg(&good).output().unwrap());
    assert!(
        dot.starts_with("digraph stitch {") && dot.contains("\"a\" -> \"b\""),
        "{dot}"
    );
    let missing = stitch()
        .args(["check", "/nonexistent.yaml"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&missing.stderr)
        .contains("/nonexistent.yaml: cannot read graph file"));
}

/// What `check` can see of this host without running — an interface or a file that is not
/// there — is a warning at the setting's line and column (the file may be meant for another
/// host); `run` refuses the same file with the same place, and `apply` to a running instance
/// too, leaving it as it was.
#[test]
fn check_warns_of_what_this_host_lacks_and_run_and_apply_refuse_it_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let ifname = format!("nbx{}", std::process::id() % 100_000);
    let text = format!(
        "apps:\n  s: {{ type: sink }}\n  a:\n    type: af_packet\n    interface: {ifname}\n  src: {{ type: pcap_source, file: nosuch.pcap }}\n  lw: {{ type: lwaftr, conf: lw.conf }}\nlinks: [\"a.output -> s.input\", \"src.output -> a.input\"]\n"
    );
    // A configuration the lwAFTR refuses when it reads it.
    write(dir.path(), "lw.conf", "softwire-config { nonsense; }\n");
    let file = write(dir.path(), "host.yaml", &text);
    let out = stitch().arg("check").arg(&file).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("ok (4 apps; 2 links, 1 worker); 3 warnings about this host"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!(
            "host.yaml:5:5: warning: app `a`: no interface named `{ifname}`"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("host.yaml:6:29: warning: app `src`: file: cannot read `nosuch.pcap`"),
        "{stderr}"
    );
    assert!(
        stderr.contains("host.yaml:7:23: warning: app `lw`: conf `lw.conf`:"),
        "{stderr}"
    );
    // The file is complete on a host that has what it names.
    let fine = write(
        dir.path(),
        "fine.yaml",
        "apps:\n  a: { type: af_packet, interface: lo }\n  s: { type: sink }\nlinks: [\"a.output -> s.input\"]\n",
    );
    let out = stitch().arg("check").arg(&fine).output().unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");

    let run = stitch()
        .args(["run", "--name", &format!("t-host-{}", std::process::id())])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        err.contains(&format!(
            "host.yaml:5:5: app `a`: no interface named `{ifname}`"
        )) && err.contains(&format!("    5 |     interface: {ifname}")),
        "{err}"
    );

    let sock = dir.path().join("ctl.sock");
    let good = write(
        dir.path(),
        "good.yaml",
        "apps:\n  g: { type: generator, rate: 1000 }\n  s: { type: sink }\nlinks: [\"g.output -> s.input\"]\n",
    );
    let _running = Running(
        stitch()
            .args(["run", "--control"])
            .arg(&sock)
            .arg(&good)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the instance to answer", || stats(&sock).is_some());
    let bad = write(
        dir.path(),
        "bad-apply.yaml",
        &format!("apps:\n  g: {{ type: generator, rate: 1000 }}\n  s: {{ type: sink }}\n  a: {{ type: af_packet, interface: {ifname} }}\n  s2: {{ type: sink }}\nlinks: [\"g.output -> s.input\", \"a.output -> s2.input\"]\n"),
    );
    let applied = stitch()
        .args(["apply", "--control"])
        .arg(&sock)
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&applied.stderr);
    assert!(!applied.status.success());
    assert!(
        err.contains(&format!(
            "bad-apply.yaml:4:25: app `a`: no interface named `{ifname}`"
        )),
        "{err}"
    );
    let s = stats(&sock).unwrap();
    assert!(
        app(&s, "a").is_none(),
        "the refused apply changed the graph"
    );
    assert!(app(&s, "g").is_some());
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stats(sock: &Path) -> Option<serde_json::Value> {
    let out = stitch()
        .args(["stats", "--json", "--control"])
        .arg(sock)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

fn app<'a>(s: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    s["apps"].as_array()?.iter().find(|a| a["name"] == name)
}

#[test]
fn stats_apply_live_and_clean_shutdown_on_sigint() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("ctl.sock");
    let v1 = write(
        dir.path(),
        "v1.yaml",
        "apps:\n  gen: { type: generator, rate: 20000 }\n  t: { type: tee }\n  out: { type: sink }\n  cap: { type: pcap_sink, file: cap.pcap }\nlinks:\n  - \"gen.output -> t.input\"\n  - \"t.a -> out.input\"\n  - \"t.b -> cap.input\"\n",
    );
    let child = stitch()
        .args(["run", "--json", "--control"])
        .arg(&sock)
        .arg(&v1)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    wait_for("the instance to count packets", || {
        stats(&sock)
            .and_then(|s| app(&s, "out").map(|a| a["rx_packets"].as_u64().unwrap() > 1000))
            .unwrap_or(false)
    });
    // Human-readable stats too.
    let table = ok(stitch()
        .args(["stats", "--control"])
        .arg(&sock)
        .output()
        .unwrap());
    assert!(
        table.contains("gen.output -> t.input") && table.contains("APP"),
        "{table}"
    );

    // Add a rate meter between tee and sink, live.
    let v2 = write(
        dir.path(),
        "v2.yaml",
        "apps:\n  gen: { type: generator, rate: 20000 }\n  t: { type: tee }\n  m: { type: rate_meter, interval: 0.1 }\n  out: { type: sink }\n  cap: { type: pcap_sink, file: cap.pcap }\nlinks:\n  - \"gen.output -> t.input\"\n  - \"t.a -> m.input\"\n  - \"m.output -> out.input\"\n  - \"t.b -> cap.input\"\n",
    );
    let before = app(&stats(&sock).unwrap(), "out").unwrap()["counters"]["packets"]
        .as_u64()
        .unwrap();
    let applied = ok(stitch()
        .args(["apply", "--control"])
        .arg(&sock)
        .arg(&v2)
        .output()
        .unwrap());
    assert!(applied.contains("started: m"), "{applied}");
    assert!(applied.contains("unchanged: 4 apps, 2 links"), "{applied}");
    wait_for("the meter to measure", || {
        stats(&sock)
            .and_then(|s| app(&s, "m").map(|a| a["counters"]["rate_pps"].as_u64().unwrap() > 10000))
            .unwrap_or(false)
    });
    let after = app(&stats(&sock).unwrap(), "out").unwrap()["counters"]["packets"]
        .as_u64()
        .unwrap();
    assert!(after > before, "the sink kept its count across apply");

    // A bad graph is refused with its line; the instance keeps running.
    let bad = write(dir.path(), "bad.yaml", "apps:\n  x: { type: nope }\n");
    let out = stitch()
        .args(["apply", "--control"])
        .arg(&sock)
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.yaml:2:"));
    assert!(stats(&sock).is_some());

    // SIGINT: the instance stops, flushes the capture and prints its final counters.
    // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
    unsafe { libc::kill(running.0.id() as i32, libc::SIGINT) };
    let child = std::mem::replace(&mut running.0, Command::new("true").spawn().unwrap());
    let out = child.wait_with_output().unwrap();
    let final_stats: serde_json::Value = serde_json::from_str(&ok(out)).unwrap();
    let written = app(&final_stats, "cap").unwrap()["counters"]["written"]
        .as_u64()
        .unwrap();
    assert!(written > 1000);
    assert_eq!(capinfos_count(&dir.path().join("cap.pcap")), written);
    assert!(!sock.exists(), "control socket removed at exit");
}

#[test]
fn default_example_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hello.yaml");
    let dir = tempfile::tempdir().unwrap();
    let out = ok(stitch()
        .args(["run", "--duration", "1", "--json", "--control"])
        .arg(dir.path().join("s"))
        .arg(root)
        .output()
        .unwrap());
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let sink = app(&v, "out").unwrap();
    assert!(sink["rx_packets"].as_u64().unwrap() > 100_000, "{v}");
}

#[test]
fn generated_packets_pass_tshark_checksum_validation() {
    let dir = tempfile::tempdir().unwrap();
    for (ip, proto, size) in [
        ("ipv4", "udp", "64"),
        ("ipv4", "tcp", "imix"),
        ("ipv6", "udp", "imix"),
        ("ipv6", "tcp", "[74, 1500, 9216]"),
    ] {
        let g = write(
            dir.path(),
            "gen.yaml",
            &format!("apps:\n  gen: {{ type: generator, count: 120, flows: 7, ip: {ip}, protocol: {proto}, size: {size} }}\n  out: {{ type: pcap_sink, file: gen.pcap }}\nlinks: [\"gen.output -> out.input\"]\n"),
        );
        run_to_end(&g, dir.path());
        let file = dir.path().join("gen.pcap");
        let all = ok(tool("tshark")
            .arg("-r")
            .arg(&file)
            .args(["-T", "fields", "-e", "frame.number"])
            .output()
            .unwrap());
        assert_eq!(all.lines().count(), 120, "{ip}/{proto}");
        let bad = ok(tool("tshark")
            .arg("-r")
            .arg(&file)
            .args(["-o", "ip.check_checksum:TRUE", "-o", "udp.check_checksum:TRUE", "-o", "tcp.check_checksum:TRUE"])
            .args(["-Y", "ip.checksum.status != 1 && ip || udp.checksum.status != 1 && udp || tcp.checksum.status != 1 && tcp || _ws.malformed || _ws.expert.severity >= error"])
            .output()
            .unwrap());
        assert_eq!(bad, "", "{ip}/{proto}: packets tshark finds bad");
        let good = ok(tool("tshark")
            .arg("-r")
            .arg(&file)
            .args([
                "-o",
                "udp.check_checksum:TRUE",
                "-o",
                "tcp.check_checksum:TRUE",
            ])
            .args(["-Y", &format!("{proto}.checksum.status == 1")])
            .output()
            .unwrap());
        assert_eq!(
            good.lines().count(),
            120,
            "{ip}/{proto}: every L4 checksum verified good"
        );
    }
}

#[test]
fn the_chain_benchmark_runs_its_contenders_side_by_side() {
    // Root only for the hugepages the benchmark reserves; without them the pool falls back.
    let out = ok(stitch()
        .args([
            "bench",
            "chain",
            "--hops",
            "2",
            "--seconds",
            "0.2",
            "--runs",
            "2",
            "--json",
            "--latency",
        ])
        .output()
        .unwrap());
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let samples = r["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 2, "{out}");
    for s in samples {
        for contender in ["raw", "chain", "direct", "measured"] {
            // Each contender had turns in every run: packets moved, CPU time of its own (the
            // chain and source → sink on one worker, the forwarders spliced in and out).
            assert!(s[contender]["packets"].as_u64().unwrap() > 0, "{out}");
            assert!(s[contender]["cpu"].as_f64().unwrap() > 0.0, "{out}");
        }
    }
    assert_eq!(r["hops"], 2);
    assert!(r["chain_ns_per_packet"].as_f64().unwrap() > 0.0, "{out}");
    assert!(r["latency_ns_per_packet"].is_f64(), "{out}");
}

/// A start that is refused — by the API's own check (a listener reachable from other hosts
/// without TLS) or by the graph (an interface that does not exist) — says why and leaves no
/// socket or lock of the instance, so that `stitch stats --name` does not find a dead one.
#[test]
fn a_refused_start_leaves_nothing_of_its_instance() {
    common::require_root_and_tools(&[]);
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("hello.yaml");
    std::fs::write(
        &good,
        "apps:\n  gen: { type: generator, count: 10 }\n  out: { type: sink }\nlinks: [\"gen.output -> out.input\"]\n",
    )
    .unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apps:\n  a: { type: af_packet, interface: nb-nosuch-if }\n  s: { type: sink }\nlinks: [\"a.output -> s.input\"]\n",
    )
    .unwrap();
    let cases: [(&Path, &[&str], &str); 2] = [
        (
            &good,
            &["--listen", "0.0.0.0:9"],
            "reachable from other hosts",
        ),
        (&bad, &[], "no interface named `nb-nosuch-if`"),
    ];
    for (i, (file, extra, why)) in cases.into_iter().enumerate() {
        let name = format!("t-refused-{}-{i}", std::process::id());
        let out = stitch()
            .args(["run", "--name", &name])
            .arg(file)
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{err}");
        let left: Vec<String> = std::fs::read_dir("/run/stitch")
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|f| f.starts_with(&format!("{name}.")))
            .collect();
        assert!(left.is_empty(), "a refused start left {left:?}: {err}");
    }
}
