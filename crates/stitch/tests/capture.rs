//! Capture to disk: the `capture` app on a graph link and `stitch capture` on an interface,
//! checked with tshark and capinfos; rotation; clean stop; a full disk.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;

fn stitch() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stitch"))
}

fn tshark_frames(file: &Path) -> Vec<String> {
    tshark_fields(
        file,
        &["frame.time_epoch", "frame.len", "frame.cap_len", "ip.src"],
    )
}

fn capinfos(file: &Path) -> String {
    must(&format!("capinfos -M {}", file.display()))
}

#[test]
fn capture_of_a_link_equals_what_the_next_app_received() {
    let dir = tempfile::tempdir().unwrap();
    let stats = run_graph(
        dir.path(),
        "apps:\n  gen: { type: generator, count: 20000, size: imix, flows: 50 }\n  tap: { type: capture, file: link.pcapng, snaplen: 9216 }\n  next: { type: pcap_sink, file: next.pcapng }\nlinks:\n  - \"gen.output -> tap.input\"\n  - \"tap.output -> next.input\"\n",
        &[],
    );
    assert_eq!(app(&stats, "tap")["counters"]["captured"], 20000);
    assert_eq!(app(&stats, "next")["counters"]["written"], 20000);
    let (a, b) = (
        dir.path().join("link.pcapng"),
        dir.path().join("next.pcapng"),
    );
    assert_eq!(capinfos_count(&a), 20000);
    assert_eq!(
        tshark_frames(&a),
        tshark_frames(&b),
        "the tap recorded exactly what passed"
    );
    let info = capinfos(&a);
    assert!(
        info.contains("nanoseconds")
            && info.contains("Ethernet")
            && info.contains("Number of stat entries = 1"),
        "{info}"
    );
}

#[test]
fn rotation_by_size_and_by_time_gives_complete_files() {
    let dir = tempfile::tempdir().unwrap();
    // -C 2 -W 3 equivalent: 12 MB of frames through a ring of three 2 MB files.
    run_graph(
        dir.path(),
        "apps:\n  gen: { type: generator, count: 12000, size: 1000 }\n  tap: { type: capture, file: ring.pcap, rotate_mb: 2, files: 3, buffer_mb: 8 }\nlinks:\n  - \"gen.output -> tap.input\"\n",
        &[],
    );
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("ring.pcap"))
        .collect();
    names.sort();
    assert_eq!(names, vec!["ring.pcap0", "ring.pcap1", "ring.pcap2"]);
    for n in &names {
        let p = dir.path().join(n);
        assert!(
            std::fs::metadata(&p).unwrap().len() <= 2_000_000,
            "{n} over 2 MB"
        );
        assert!(capinfos_count(&p) > 0, "{n} readable and not empty");
    }
    // -G 1 with a strftime name: a new file every second.
    let d2 = tempfile::tempdir().unwrap();
    run_graph(
        d2.path(),
        "apps:\n  gen: { type: generator, rate: 2000 }\n  tap: { type: capture, file: t-%H%M%S.pcap, rotate_seconds: 1 }\nlinks:\n  - \"gen.output -> tap.input\"\n",
        &["--duration", "3.5"],
    );
    let files: Vec<_> = std::fs::read_dir(d2.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pcap"))
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let total: u64 = files.iter().map(|f| capinfos_count(f)).sum();
    assert!(total > 5000, "about 3.5 s at 2000 pps, got {total}");
}

#[test]
fn a_full_disk_is_reported_and_files_stay_valid() {
    require_root_and_tools(&["mount", "capinfos"]);
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small");
    std::fs::create_dir(&small).unwrap();
    must(&format!(
        "mount -t tmpfs -o size=6m tmpfs {}",
        small.display()
    ));
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = sh(&format!("umount {}", self.0.display()));
        }
    }
    let _guard = Unmount(small.clone());
    let g = dir.path().join("g.yaml");
    std::fs::write(&g, "apps:\n  gen: { type: generator, count: 20000, size: 1000 }\n  tap: { type: capture, file: small/full.pcap, buffer_mb: 8 }\n  out: { type: sink }\nlinks:\n  - \"gen.output -> tap.input\"\n  - \"tap.output -> out.input\"\n").unwrap();
    let out = stitch()
        .args(["run", "--json", "--control"])
        .arg(dir.path().join("s.sock"))
        .arg(&g)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the run goes on: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the disk is full"), "{err}");
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        app(&stats, "out")["rx_packets"],
        20000,
        "traffic is not disturbed"
    );
    let c = &app(&stats, "tap")["counters"];
    assert!(
        c["write_errors"].as_u64().unwrap() >= 1 && c["writer_drops"].as_u64().unwrap() > 0,
        "{c}"
    );
    let kept = capinfos_count(&small.join("full.pcap"));
    assert_eq!(
        kept + c["writer_drops"].as_u64().unwrap(),
        20000,
        "every packet is either in the file or counted"
    );
}

#[test]
fn stitch_capture_on_an_interface_with_a_filter_count_and_sigint() {
    require_root_and_tools(&["ip", "ping", "tshark"]);
    let h = TwoHosts::new();
    // Give the outer end of host 0 an address so that host 0 can ping it.
    must(&format!(
        "ip addr add {}9/24 dev {}",
        &h.ip[0][..h.ip[0].len() - 1],
        h.outer[0]
    ));
    let target = format!("{}9", &h.ip[0][..h.ip[0].len() - 1]);
    let dir = tempfile::tempdir().unwrap();
    let pinger = h.spawn(0, &format!("ping -c 500 -i 0.01 {target}"));
    let file = dir.path().join("icmp.pcapng");
    let out = stitch()
        .args([
            "capture",
            "--name",
            &h.ns[0],
            "-i",
            &h.outer[0],
            "-c",
            "20",
            "-w",
        ])
        .arg(&file)
        .args(["icmp"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("20 packets captured"), "{err}");
    assert_eq!(capinfos_count(&file), 20);
    let protos = must(&format!(
        "tshark -r {} -T fields -e frame.protocols",
        file.display()
    ));
    assert!(
        protos.lines().all(|l| l.contains("icmp")),
        "only what the filter lets through: {protos}"
    );
    let both = must(&format!(
        "tshark -r {} -T fields -e icmp.type",
        file.display()
    ));
    assert!(
        both.lines().any(|l| l == "8") && both.lines().any(|l| l == "0"),
        "both directions: {both}"
    );

    // SIGINT: the file is complete and holds what the summary says.
    let file2 = dir.path().join("int.pcap");
    let child = Command::new(env!("CARGO_BIN_EXE_stitch"))
        .args(["capture", "--name", &h.ns[1], "-i", &h.outer[0], "-w"])
        .arg(&file2)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut run = Background(child);
    // Interrupted a while after it says it captures (a fixed wait from its start could come
    // before its signal handler on a loaded machine).
    let mut said = std::io::BufReader::new(run.0.stderr.take().unwrap());
    let mut err = String::new();
    while !err.contains("capturing on") {
        let n = std::io::BufRead::read_line(&mut said, &mut err).unwrap();
        assert!(n > 0, "the capture ended before capturing: {err}");
    }
    std::thread::sleep(std::time::Duration::from_millis(1000));
    run.signal(libc::SIGINT);
    std::io::Read::read_to_string(&mut said, &mut err).unwrap();
    let out = run.finish();
    let _ = pinger.finish();
    assert!(out.status.success(), "{err}");
    let n: u64 = err
        .lines()
        .find(|l| l.ends_with("packets captured"))
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n > 10, "{err}");
    assert_eq!(capinfos_count(&file2), n, "{err}");
    assert!(tshark_frames(&file2).len() as u64 == n);
}
