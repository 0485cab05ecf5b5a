//! Stitch's side of a function in a VM, without the VM: a hello saying `"transport":
//! "ivshmem"` on a socket whose guest bus is a recording stand-in for QEMU's QMP (the real QEMU
//! runs in the `stitch` crate's placement and switch tests). What is plugged, what the answer
//! names, what a second hello on the same connection replaces, and what a refusal leaves.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stitch_core::{Engine, Graph, Registry};
use stitch_nf::guest::{self, GuestBus};

/// What a guest bus was asked: plugs (id, the memory's file size, the BAR size) and what
/// went (unplugged or swept); what the guest has now.
#[derive(Default)]
struct Recorded {
    plugged: Vec<(String, u64, usize)>,
    unplugged: Vec<String>,
    present: Vec<String>,
}

/// A stand-in for QEMU: plugs at slots 4, 5, … — or refuses every plug with `refusal`.
struct FakeBus {
    seen: Mutex<Recorded>,
    refusal: Option<String>,
}

impl FakeBus {
    fn new(refusal: Option<&str>) -> Arc<FakeBus> {
        Arc::new(FakeBus {
            seen: Mutex::default(),
            refusal: refusal.map(str::to_string),
        })
    }
}

impl GuestBus for FakeBus {
    fn plug(&self, id: &str, memory: BorrowedFd<'_>, bytes: usize) -> Result<String, String> {
        if let Some(r) = &self.refusal {
            return Err(r.clone());
        }
        let size = std::fs::metadata(format!("/proc/self/fd/{}", memory.as_raw_fd()))
            .unwrap()
            .len();
        let mut seen = self.seen.lock().unwrap();
        seen.plugged.push((id.to_string(), size, bytes));
        seen.present.push(id.to_string());
        Ok(format!("0000:00:{:02x}.0", 3 + seen.plugged.len()))
    }

    fn unplug(&self, id: &str) -> Result<(), String> {
        let mut seen = self.seen.lock().unwrap();
        seen.present.retain(|p| p != id);
        seen.unplugged.push(id.to_string());
        Ok(())
    }

    fn sweep(&self, keep: &str) -> Result<Vec<String>, String> {
        let mut seen = self.seen.lock().unwrap();
        let (gone, kept) = (seen.present.iter().cloned()).partition(|id| guest::swept(id, keep));
        seen.present = kept;
        seen.unplugged.extend_from_slice(&gone);
        Ok(gone)
    }
}

fn engine_with_port(socket: &Path, settings: &str) -> Engine {
    let mut r = Registry::new();
    stitch_apps::register(&mut r);
    stitch_nf::register(&mut r);
    let e = Engine::new(Arc::new(r));
    let text = format!(
        "apps:\n  vm1: {{ type: nf_port, socket: {}, {settings} }}\n  out: {{ type: sink }}\nlinks: [\"vm1.output -> out.input\"]\n",
        socket.display()
    );
    let g = Graph::parse(&text, "test.yaml", Path::new("."), e.registry()).unwrap();
    e.apply(g).unwrap();
    e
}

fn counter(e: &Engine, name: &str) -> u64 {
    let stats = e.stats();
    let app = stats.apps.iter().find(|a| a.name == "vm1").unwrap();
    app.counters.get(name).copied().unwrap_or(0)
}

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The hello of a function in a guest, and Stitch's answer (one line, no descriptors).
fn hello(conn: &mut UnixStream, reader: &mut BufReader<UnixStream>) -> Value {
    let hello =
        json!({ "version": stitch_nf::shm::VERSION, "port": "vm1", "transport": "ivshmem" });
    conn.write_all(format!("{hello}\n").as_bytes()).unwrap();
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

fn connect(socket: &Path) -> (UnixStream, BufReader<UnixStream>) {
    let conn = UnixStream::connect(socket).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let reader = BufReader::new(conn.try_clone().unwrap());
    (conn, reader)
}

#[test]
fn a_guest_gets_its_region_and_packet_memory_as_devices_and_a_new_hello_replaces_them() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vm1.nf");
    let bus = FakeBus::new(None);
    guest::offer_bus(&socket, bus.clone());
    let e = engine_with_port(&socket, "mode: zero_copy, wake: polling");
    // A QEMU connects long before its guest's function speaks: the listener does not wait
    // for it (a function on the host attaches meanwhile).
    let (mut conn, mut reader) = connect(&socket);
    std::thread::sleep(Duration::from_millis(1500));
    let reply = hello(&mut conn, &mut reader);
    assert_eq!(reply["ok"], true, "{reply}");
    let devices = &reply["devices"];
    assert_eq!(devices["region"]["pci"], "0000:00:04.0", "{reply}");
    assert_eq!(devices["pool"]["pci"], "0000:00:05.0", "{reply}");
    assert_eq!(devices["region"]["bytes"], reply["region_size"], "{reply}");
    assert_eq!(devices["pool"]["bytes"], reply["pool_bytes"], "{reply}");
    {
        let seen = bus.seen.lock().unwrap();
        for (id, file, bar) in &seen.plugged {
            assert!(bar.is_power_of_two(), "{id}: a BAR of {bar} bytes");
            assert!(
                *file >= *bar as u64,
                "{id}: {file} bytes behind a BAR of {bar}"
            );
        }
    }
    wait("the port to take the guest's function", || {
        counter(&e, "attached") == 1
    });

    // A line that is no hello: told why, and nothing changes.
    conn.write_all(b"{\"version\": 4, \"port\n").unwrap();
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let reply: Value = serde_json::from_str(&line).unwrap();
    assert!(
        reply["error"].as_str().unwrap().contains("stays attached"),
        "{reply}"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((counter(&e, "attached"), counter(&e, "attaches")), (1, 1));

    // The function started again in the guest: its hello on the same connection ends the
    // first attachment, whose devices are swept from the guest, and plugs new ones.
    let reply = hello(&mut conn, &mut reader);
    assert_eq!(reply["ok"], true, "{reply}");
    wait("the second attachment", || {
        counter(&e, "attaches") == 2 && counter(&e, "attached") == 1
    });
    wait("the first devices unplugged", || {
        bus.seen.lock().unwrap().unplugged.len() == 2
    });
    let seen = bus.seen.lock().unwrap();
    assert_eq!(seen.plugged.len(), 4);
    let first: Vec<&String> = seen.plugged[..2].iter().map(|p| &p.0).collect();
    assert!(
        seen.unplugged.iter().all(|u| first.contains(&u)),
        "{:?}",
        seen.unplugged
    );

    assert_eq!(seen.present.len(), 2, "{:?}", seen.present);
    drop(seen);

    // QEMU gone (the VM stopped): detached; its devices went with it.
    drop((conn, reader));
    wait("the port to see its guest gone", || {
        counter(&e, "attached") == 0
    });
    assert_eq!(counter(&e, "guest_plug_refusals"), 0);
    guest::withdraw_bus(&socket);
}

#[test]
fn a_refused_plug_is_counted_and_told_and_attaches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vm1.nf");
    let reason = "Bus 'pcie.0' does not support hotplugging";
    guest::offer_bus(&socket, FakeBus::new(Some(reason)));
    let e = engine_with_port(&socket, "mode: isolated, wake: polling");
    let (mut conn, mut reader) = connect(&socket);
    let reply = hello(&mut conn, &mut reader);
    assert_eq!(reply["ok"], false, "{reply}");
    let error = reply["error"].as_str().unwrap();
    assert!(
        error.contains(reason) && error.contains("region"),
        "{error}"
    );
    wait("the refusal counted", || {
        counter(&e, "guest_plug_refusals") == 1
    });
    assert_eq!(counter(&e, "attached"), 0);
    guest::withdraw_bus(&socket);
}

#[test]
fn a_guest_hello_where_no_vm_is_served_or_to_a_blocking_port_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vm1.nf");
    let e = engine_with_port(&socket, "mode: isolated, wake: blocking");
    let (mut conn, mut reader) = connect(&socket);
    let reply = hello(&mut conn, &mut reader);
    assert!(
        reply["error"].as_str().unwrap().contains("rings: ivshmem"),
        "{reply}"
    );
    guest::offer_bus(&socket, FakeBus::new(None));
    let (mut conn, mut reader) = connect(&socket);
    let reply = hello(&mut conn, &mut reader);
    assert!(
        reply["error"].as_str().unwrap().contains("wake: polling"),
        "{reply}"
    );
    assert_eq!(counter(&e, "attaches"), 0);
    guest::withdraw_bus(&socket);
}
