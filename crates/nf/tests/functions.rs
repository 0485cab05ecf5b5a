//! Function processes attached to a running engine: attach and detach under traffic without
//! loss elsewhere, kill -9 with every buffer reclaimed, garbage from an isolated function
//! contained, 200 functions at once.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Registry};
use stitch_nf::client::{Function, Verdict};
use stitch_nf::shm::Desc;

/// These tests measure loss, and the machine has two cores: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn registry() -> Arc<Registry> {
    let mut r = Registry::new();
    stitch_apps::register(&mut r);
    stitch_nf::register(&mut r);
    Arc::new(r)
}

fn apply(e: &Engine, text: &str) {
    let g = Graph::parse(text, "test.yaml", Path::new("."), e.registry())
        .unwrap_or_else(|err| panic!("{err}"));
    e.apply(g).unwrap();
}

fn counter(e: &Engine, app: &str, name: &str) -> u64 {
    e.stats()
        .apps
        .iter()
        .find(|a| a.name == app)
        .and_then(|a| a.counters.get(name).copied())
        .unwrap_or(0)
}

fn wait(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `app`'s counter `name` reaches `value`; on timeout shows all its counters.
fn wait_count(e: &Engine, app: &str, name: &str, value: u64, secs: u64) {
    let t = Instant::now();
    while counter(e, app, name) < value {
        if t.elapsed() > Duration::from_secs(secs) {
            let stats = e.stats();
            let all: Vec<_> = stats.apps.iter().map(|a| (&a.name, &a.counters)).collect();
            panic!("timed out waiting for {app}.{name} = {value}: {all:#?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A function process, killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signature(socket: &Path, ports: &[&str]) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_stitch-nf-signature"))
            .arg("--socket")
            .arg(socket)
            .args(ports)
            .spawn()
            .unwrap(),
    )
}

fn socket(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("nf.sock")
}

/// Waits (at most `secs`) until a function is attached to each of `ports`.
fn wait_attached(e: &Engine, ports: &[&str], secs: u64) {
    wait("functions attached", secs, || {
        ports.iter().all(|p| counter(e, p, "attached") == 1)
    });
}

/// An engine running function port `c` (with `settings`) into sink `out`, and the YAML of
/// those two apps (to build on).
fn port_into_sink(sock: &Path, settings: &str) -> (Engine, String) {
    let e = Engine::new(registry());
    let apps = format!(
        "  c: {{ type: nf_port, socket: {}, {settings} }}\n  out: {{ type: sink }}\n",
        sock.display()
    );
    apply(
        &e,
        &format!("apps:\n{apps}links: [\"c.output -> out.input\"]\n"),
    );
    (e, apps)
}

#[test]
fn attach_and_kill_under_traffic_lose_nothing_on_other_ports() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let e = Engine::new(registry());
    let ports = format!(
        "  a: {{ type: nf_port, socket: {s}, ring_size: 2048 }}
  b: {{ type: nf_port, socket: {s}, ring_size: 32768, wake: blocking }}
  out_a: {{ type: sink }}
  out_b: {{ type: sink }}
",
        s = sock.display()
    );
    apply(
        &e,
        &format!(
            "apps:\n{ports}links: [\"a.output -> out_a.input\", \"b.output -> out_b.input\"]\n"
        ),
    );
    let _fb = signature(&sock, &["b"]);
    let mut fa = Some(signature(&sock, &["a"]));
    wait_attached(&e, &["a", "b"], 10);

    // Traffic on both; b's must all arrive while a's function is killed and comes back. (b's
    // ring holds a second of traffic: two cores are shared by the engine, both functions and
    // the other tests, so a function may wait a while for a core.)
    let total = 60_000u64;
    apply(
        &e,
        &format!(
            "apps:
  gen_a: {{ type: generator, size: 700, rate: 30000, src_mac: \"02:00:00:00:00:0a\" }}
  gen_b: {{ type: generator, size: 700, rate: 30000, count: {total}, src_mac: \"02:00:00:00:00:0b\" }}
{ports}links:
  - \"gen_a.output -> a.input\"
  - \"gen_b.output -> b.input\"
  - \"a.output -> out_a.input\"
  - \"b.output -> out_b.input\"
"
        ),
    );
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        let mut p = fa.take().unwrap();
        // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
        unsafe { libc::kill(p.0.id() as i32, libc::SIGKILL) };
        let _ = p.0.wait();
        drop(p);
        std::thread::sleep(Duration::from_millis(100));
        fa = Some(signature(&sock, &["a"]));
    }
    wait_count(&e, "out_b", "packets", total, 20);
    for c in [
        "down_drops",
        "ring_full_drops",
        "bad_descriptors",
        "detaches",
    ] {
        assert_eq!(counter(&e, "b", c), 0, "b {c}");
    }
    assert_eq!(counter(&e, "b", "to_function"), total);
    assert!(counter(&e, "a", "attaches") >= 3, "a came back");
    assert!(counter(&e, "a", "detaches") >= 3, "a's kills were noticed");

    // Stop the traffic: once a's function is killed too, every buffer is back in the pool.
    apply(&e, &format!("apps:\n{ports}links: []\n"));
    drop(fa);
    wait("a detached", 10, || counter(&e, "a", "attached") == 0);
    wait("no buffer held", 10, || e.stats().pool.in_use == 0);
    let a_in = counter(&e, "a", "to_function");
    let a_back = counter(&e, "a", "from_function") + counter(&e, "a", "reclaimed_drops");
    assert_eq!(
        a_in, a_back,
        "each buffer handed to a came back or was reclaimed"
    );
    e.stop();
}

#[test]
fn an_isolated_function_writing_garbage_is_contained() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let e = Engine::new(registry());
    let ports = format!(
        "  a: {{ type: nf_port, socket: {s}, mode: isolated }}
  b: {{ type: nf_port, socket: {s}, mode: isolated, ring_size: 16384, wake: blocking }}
  out_a: {{ type: sink }}
  out_b: {{ type: sink }}
",
        s = sock.display()
    );
    apply(
        &e,
        &format!(
            "apps:\n{ports}links: [\"a.output -> out_a.input\", \"b.output -> out_b.input\"]\n"
        ),
    );
    let _fb = signature(&sock, &["b"]);
    // The test is function `a`: it sees only its own packets, then turns hostile.
    let mut a = Function::attach(&sock, "a").unwrap();
    wait_count(&e, "b", "attached", 1, 10);
    wait_count(&e, "a", "attached", 1, 10);
    apply(
        &e,
        &format!(
            "apps:
  gen_a: {{ type: generator, size: 300, rate: 20000, src_mac: \"02:00:00:00:00:0a\" }}
  gen_b: {{ type: generator, size: 300, rate: 20000, count: 20000, src_mac: \"02:00:00:00:00:0b\" }}
{ports}links:
  - \"gen_a.output -> a.input\"
  - \"gen_b.output -> b.input\"
  - \"a.output -> out_a.input\"
  - \"b.output -> out_b.input\"
"
        ),
    );
    assert!(!a.is_zero_copy());
    let mut seen = 0;
    let t = Instant::now();
    while seen < 1000 && t.elapsed() < Duration::from_secs(10) {
        seen += a
            .poll(64, |frame| {
                assert_eq!(&frame[6..12], &[2, 0, 0, 0, 0, 0x0a], "only a's packets");
                Verdict::Forward
            })
            .unwrap();
    }
    assert!(seen >= 1000);
    // Random descriptors: out-of-range slots, slots it does not hold, lengths beyond the slot.
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let t = Instant::now();
    while counter(&e, "a", "bad_descriptors") < 5000 {
        assert!(t.elapsed() < Duration::from_secs(10), "garbage not counted");
        let r = rnd();
        let injected = a.inject(Desc {
            buffer: (r % 5000) as u32,
            offset: (r >> 16) as u16,
            flags: (r >> 32) as u16 & 1,
            len: (r >> 40) as u32,
            stamp_lo: 0,
        });
        if !injected {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Then the whole region, indices included.
    for b in a.region_bytes().iter_mut().skip(4096) {
        *b = rnd() as u8;
    }
    // Detached, it is told: Stitch hangs up (a function not driven by a test attaches again).
    wait("a hung up on", 10, || !a.connected());
    drop(a);
    wait_count(&e, "out_b", "packets", 20_000, 20);
    let stats = e.stats();
    assert!(stats.apps.iter().all(|x| !x.failed), "no app failed");
    assert_eq!(counter(&e, "b", "bad_descriptors"), 0);
    // The hostile function is gone and the port takes a new one.
    wait("a detached", 10, || counter(&e, "a", "attached") == 0);
    let _fa = signature(&sock, &["a"]);
    let before = counter(&e, "out_a", "packets");
    wait("a serves again", 10, || {
        counter(&e, "out_a", "packets") > before + 1000
    });
    e.stop();
}

#[test]
fn two_hundred_functions_attach_and_carry_traffic() {
    let _one_at_a_time = serial();
    const N: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let e = Engine::new(registry());
    let mut apps = String::from(
        "  gen: { type: generator, size: 700, rate: 40000 }\n  rr: { type: round_robin }\n  j: { type: join }\n  out: { type: sink }\n",
    );
    let mut links = String::from("  - \"gen.output -> rr.input\"\n  - \"j.output -> out.input\"\n");
    for i in 0..N {
        apps += &format!(
            "  nf{i}: {{ type: nf_port, socket: {}, wake: blocking, batch: 8, max_delay_us: 100, ring_size: 256 }}\n",
            sock.display()
        );
        links += &format!("  - \"rr.o{i} -> nf{i}.input\"\n  - \"nf{i}.output -> j.i{i}\"\n");
    }
    apply(&e, &format!("apps:\n{apps}links:\n{links}"));
    // Ten processes serving twenty ports each (one thread, woken by any of the twenty
    // doorbells): 200 functions.
    let names: Vec<String> = (0..N).map(|i| format!("nf{i}")).collect();
    let _procs: Vec<Proc> = names
        .chunks(20)
        .map(|c| signature(&sock, &c.iter().map(String::as_str).collect::<Vec<_>>()))
        .collect();
    wait_attached(
        &e,
        &names.iter().map(String::as_str).collect::<Vec<_>>(),
        30,
    );
    let before: Vec<u64> = (0..N)
        .map(|i| counter(&e, &format!("nf{i}"), "from_function"))
        .collect();
    wait("every function carries traffic", 30, || {
        (0..N).all(|i| counter(&e, &format!("nf{i}"), "from_function") > before[i] + 10)
    });
    let lost: u64 = (0..N)
        .map(|i| {
            counter(&e, &format!("nf{i}"), "ring_full_drops")
                + counter(&e, &format!("nf{i}"), "bad_descriptors")
        })
        .sum();
    assert_eq!(
        lost, 0,
        "no ring overflowed at 40 kpps over 200 blocking functions"
    );
    e.stop();
}

/// A sleeping function is woken once `batch` packets wait, or once the oldest waited
/// `max_delay_us` — not before, and with one doorbell for the lot.
#[test]
fn a_blocking_function_wakes_on_a_full_batch_or_an_old_packet() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let (e, port) = port_into_sink(&sock, "wake: blocking, batch: 8, max_delay_us: 4000000");
    let _f = signature(&sock, &["c"]);
    wait_attached(&e, &["c"], 10);
    // Idle, it goes to sleep on its doorbell at once.
    std::thread::sleep(Duration::from_millis(300));
    let send = |name: &str, count: u64| {
        apply(
            &e,
            &format!(
                "apps:\n  {name}: {{ type: generator, size: 100, count: {count} }}\n{port}links: [\"{name}.output -> c.input\", \"c.output -> out.input\"]\n"
            ),
        )
    };

    // Seven packets: fewer than a batch and young — the function sleeps on.
    let t = Instant::now();
    send("seven", 7);
    wait_count(&e, "c", "to_function", 7, 10);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        counter(&e, "out", "packets"),
        0,
        "woken before its batch or age"
    );
    assert_eq!(counter(&e, "c", "wakeups"), 0);
    // The oldest reaches 4 s: one doorbell for all seven.
    wait_count(&e, "out", "packets", 7, 20);
    assert!(
        t.elapsed() >= Duration::from_millis(3900),
        "woken after {:?}, before the 4 s aging timeout",
        t.elapsed()
    );
    assert_eq!(counter(&e, "c", "wakeups"), 1);

    // Eight at once: a full batch wakes it without waiting for their age.
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    send("eight", 8);
    wait_count(&e, "out", "packets", 15, 10);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "a full batch waited {:?}",
        t.elapsed()
    );
    assert_eq!(counter(&e, "c", "wakeups"), 2);
    e.stop();
}

/// A function written in C against `include/stitch_nf.h`, linked with `libstitch_nf.so`.
#[test]
fn a_function_in_c_attaches_through_the_c_abi() {
    let _one_at_a_time = serial();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The cdylib sits next to the test binary's `deps` folder.
    let exe = std::env::current_exe().unwrap();
    let libdir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(
        libdir.join("libstitch_nf.so").exists(),
        "libstitch_nf.so not built in {} (scripts/test runs `cargo build --workspace` first)",
        libdir.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("counter");
    let cc = Command::new("cc")
        .arg("-O2")
        .arg("-Wall")
        .arg("-Werror")
        .arg(manifest.join("examples/c/counter.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .arg("-L")
        .arg(&libdir)
        .arg("-lstitch_nf")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap();
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );

    let sock = socket(&dir);
    let (e, ports) = port_into_sink(&sock, "wake: blocking, batch: 1");
    let child = Command::new(&bin)
        .arg(&sock)
        .arg("c")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut p = Proc(child);
    wait_count(&e, "c", "attached", 1, 10);
    // 1000 frames of 64 bytes (dropped by the function) and 1000 of 200 (forwarded).
    apply(
        &e,
        &format!(
            "apps:\n  small: {{ type: generator, size: 64, count: 1000, rate: 20000 }}\n  big: {{ type: generator, size: 200, count: 1000, rate: 20000 }}\n  j: {{ type: join }}\n{ports}links:\n  - \"small.output -> j.a\"\n  - \"big.output -> j.b\"\n  - \"j.output -> c.input\"\n  - \"c.output -> out.input\"\n"
        ),
    );
    wait_count(&e, "out", "packets", 1000, 20);
    wait_count(&e, "c", "from_function", 1000, 10);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(counter(&e, "out", "packets"), 1000);
    assert_eq!(counter(&e, "out", "bytes"), 1000 * 200);
    // Stitch closes the port: the C function's run returns and it reports what it saw.
    e.stop();
    let out = std::mem::replace(&mut p.0, Command::new("true").spawn().unwrap())
        .wait_with_output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "seen 2000 dropped 1000"
    );
}

/// One process serving two ports from one thread: both carry traffic, and when Stitch closes
/// one of them (the port leaves the graph) the process goes on serving the other.
#[test]
fn one_thread_serves_two_ports_and_outlives_one_of_them() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let e = Engine::new(registry());
    let port = |name: &str| {
        format!(
            "  {name}: {{ type: nf_port, socket: {}, wake: blocking }}\n  gen_{name}: {{ type: generator, size: 200, rate: 20000 }}\n  out_{name}: {{ type: sink }}\n",
            sock.display()
        )
    };
    let links = |name: &str| {
        format!("  - \"gen_{name}.output -> {name}.input\"\n  - \"{name}.output -> out_{name}.input\"\n")
    };
    apply(
        &e,
        &format!(
            "apps:\n{}{}links:\n{}{}",
            port("a"),
            port("b"),
            links("a"),
            links("b")
        ),
    );
    let mut f = signature(&sock, &["a", "b"]);
    wait_attached(&e, &["a", "b"], 10);
    wait("traffic on both", 10, || {
        counter(&e, "out_a", "packets") > 1000 && counter(&e, "out_b", "packets") > 1000
    });
    // (Packets that came before the function attached were counted as `down_drops`.)
    let down = counter(&e, "b", "down_drops");
    apply(&e, &format!("apps:\n{}links:\n{}", port("b"), links("b")));
    let before = counter(&e, "out_b", "packets");
    wait("b still served", 10, || {
        counter(&e, "out_b", "packets") > before + 2000
    });
    assert!(
        f.0.try_wait().unwrap().is_none(),
        "the function still runs for its other port"
    );
    assert_eq!(counter(&e, "b", "down_drops"), down, "b never went down");
    e.stop();
}

/// Packets of a PCAPNG stream written by `LinkCapture`: (interface, frame) in order.
fn pcapng_frames(stream: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let word = |at: usize| u32::from_ne_bytes(stream[at..at + 4].try_into().unwrap());
    let mut frames = Vec::new();
    let mut at = 0;
    while at + 12 <= stream.len() {
        let (kind, len) = (word(at), word(at + 4) as usize);
        assert!(
            len >= 12 && at + len <= stream.len(),
            "a whole block at {at}"
        );
        if kind == 6 {
            let caplen = word(at + 20) as usize;
            frames.push((word(at + 8), stream[at + 28..at + 28 + caplen].to_vec()));
        }
        at += len;
    }
    frames
}

#[test]
fn links_to_a_function_process_are_captured_like_any_link() {
    use stitch_io::link_capture::{select_links, CaptureOptions, LinkCapture};
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let (e, apps) = port_into_sink(&sock, "ring_size: 1024");
    let _f = signature(&sock, &["c"]);
    wait_attached(&e, &["c"], 10);
    let total = 500u64;
    apply(
        &e,
        &format!(
            "apps:\n  gen: {{ type: generator, size: 200, rate: 5000, flows: {total}, count: {total} }}\n{apps}links: [\"gen.output -> c.input\", \"c.output -> out.input\"]\n"
        ),
    );
    // Both links of the function's port: into the process and back out of it.
    let links = select_links(&e.link_rings(), "c").unwrap();
    let names: Vec<&str> = links.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["gen.output -> c.input", "c.output -> out.input"]);
    // The generator started with the links, so the capture may miss its first packets.
    let mut capture = LinkCapture::start(links, CaptureOptions::default()).unwrap();
    let mut stream = capture.header("test");
    let t = Instant::now();
    while counter(&e, "out", "packets") < total || t.elapsed() < Duration::from_millis(200) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{:?}",
            capture.stats()
        );
        assert_eq!(capture.poll(&mut stream, 1 << 20), None);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(capture.poll(&mut stream, 1 << 20), None);
    stream.extend(capture.finish());
    let frames = pcapng_frames(&stream);
    let (into, back): (Vec<_>, Vec<_>) = frames.into_iter().partition(|(i, _)| *i == 0);
    assert!(into.len() as u64 > total / 2, "{:?}", capture.stats());
    // Each frame is of its own flow: what came back from the function is what went in, in
    // order. The taps go on one link after the other, so either link may have seen a few
    // frames before the other's tap was on: the link back ones sent before the first tap, the
    // link in ones that crossed the function before the second.
    let back: Vec<Vec<u8>> = back.into_iter().map(|(_, f)| f).collect();
    let into: Vec<Vec<u8>> = into.into_iter().map(|(_, f)| f).collect();
    let before_second_tap = into.iter().take_while(|f| !back.contains(f)).count();
    assert!(
        before_second_tap <= 16 && back.ends_with(&into[before_second_tap..]),
        "{} in, {} back, {before_second_tap} in before the second tap",
        into.len(),
        back.len()
    );
    assert_eq!(back.len() as u64, capture.stats()[1].seen);
    assert!(capture.stats().iter().all(|s| s.dropped == 0));
    drop(capture);
    e.stop();
}

/// A function that is not scheduled for 10 ms while 150 kpps reach it — an ordinary delay on a
/// loaded host — loses nothing: the 1 500 packets of the stall wait in its ring (2048 by
/// default) and the link in front of it (1024), and it catches up once it runs again.
#[test]
fn a_function_stalled_for_10_ms_at_150_kpps_loses_nothing() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = socket(&dir);
    let e = Engine::new(registry());
    apply(
        &e,
        &format!(
            "apps:\n  gen: {{ type: generator, size: 64, rate: 150000 }}\n  f: {{ type: nf_port, socket: {}, wake: blocking }}\n  out: {{ type: sink }}\nlinks:\n  - \"gen.output -> f.input\"\n  - \"f.output -> out.input\"\n",
            sock.display()
        ),
    );
    let f = signature(&sock, &["f"]);
    wait_attached(&e, &["f"], 20);
    std::thread::sleep(Duration::from_millis(500));
    let lost = |e: &Engine| {
        let s = e.stats();
        let of = |name: &str| s.apps.iter().find(|a| a.name == name).unwrap().drops;
        of("gen") + of("f") + counter(e, "gen", "rate_shortfall")
    };
    let generated = |e: &Engine| {
        let s = e.stats();
        s.apps.iter().find(|a| a.name == "gen").unwrap().tx_packets
    };
    let (lost_before, sent_before, gen_before) =
        (lost(&e), counter(&e, "f", "to_function"), generated(&e));
    let started = Instant::now();
    let pid = f.0.id() as i32;
    // SAFETY: kill takes no pointers; the pid is our own child's, not yet waited for.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(10));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(500));
    let (lost_after, sent_after) = (lost(&e), counter(&e, "f", "to_function"));
    let rate = (generated(&e) - gen_before) as f64 / started.elapsed().as_secs_f64();
    eprintln!(
        "a function stopped 10 ms at {:.0} kpps: {} packets handed to it in the second around, {} lost",
        rate / 1e3,
        sent_after - sent_before,
        lost_after - lost_before
    );
    assert!(rate > 140e3, "the generator keeps its rate ({rate:.0} pps)");
    assert!(sent_after - sent_before > 10_000, "traffic went on");
    assert_eq!(lost_after, lost_before, "nothing lost to the stall");
    e.stop();
}
