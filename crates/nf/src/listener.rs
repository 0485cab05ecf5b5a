//! The attach socket on Stitch's side. One listener thread per socket path serves every
//! `nf_port` app that names that path: a function connects, sends one JSON line
//! `{"version":1,"port":"NAME"}`, and gets back a JSON line with the region's layout plus, by
//! SCM_RIGHTS, the region's memfd, the doorbell eventfd and (zero-copy) the packet pool's memfd.
//! The connection then stays open and says nothing more: when it closes — the function exited,
//! crashed or was killed — the port is detached and its buffers reclaimed by the app.

pub use crate::attachment::{Attachment, PortSettings};
pub use crate::direct::PortShared;
use crate::guest::{self, GuestBus};
use crate::shm::{Layout, Mapping, RegionHeader, MAGIC, VERSION};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use stitch_core::fdpass;

static GENERATION: AtomicU64 = AtomicU64::new(1);

/// The listener of one socket path.
pub struct Listener {
    path: PathBuf,
    ports: Mutex<HashMap<String, Arc<PortShared>>>,
    /// A duplicate of the listening socket, lent to a process taking over (`stitch upgrade`).
    socket: OwnedFd,
    /// Connections of functions attached under a predecessor process, for the listener thread
    /// to watch from its next round.
    adopted: Mutex<Vec<Connection>>,
    /// Served on a predecessor's socket: the path is not removed when the listener stops (a
    /// take-over that fails leaves the predecessor serving it).
    inherited: bool,
}

/// Listening sockets a predecessor process lent (`stitch upgrade`), by path: the listener of
/// that path serves on it instead of binding the path again.
fn inherited_sockets() -> &'static Mutex<HashMap<PathBuf, OwnedFd>> {
    static S: OnceLock<Mutex<HashMap<PathBuf, OwnedFd>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// Offers `socket`, the listening socket a predecessor process served `path` on, to the
/// listener of `path` when it starts; ignored when this process already serves that path.
pub fn inherit_socket(path: &Path, socket: OwnedFd) {
    inherited_sockets()
        .lock()
        .unwrap()
        .entry(path.to_path_buf())
        .or_insert(socket);
}

/// A function's standard output and error: the write ends of two pipes.
type Output = [OwnedFd; 2];

/// Standard output and error (pipe write ends) for functions that attach again after the
/// Stitch process before this one ended, by socket path and port: the supervisor that adopted
/// the process reads the other ends.
fn offered_outputs() -> &'static Mutex<HashMap<(PathBuf, String), Output>> {
    static O: OnceLock<Mutex<HashMap<(PathBuf, String), Output>>> = OnceLock::new();
    O.get_or_init(Default::default)
}

/// Gives the function that asks for `port` on `path` again after a restart of Stitch (its
/// hello says `resumed`) `output` as its standard output and error, when it attaches.
pub fn offer_output(path: &Path, port: &str, output: [OwnedFd; 2]) {
    offered_outputs()
        .lock()
        .unwrap()
        .insert((path.to_path_buf(), port.to_string()), output);
}

/// A generation number for an attachment made here (or adopted from a predecessor).
pub fn next_generation() -> u64 {
    GENERATION.fetch_add(1, Ordering::Relaxed)
}

fn listeners() -> &'static Mutex<HashMap<PathBuf, Weak<Listener>>> {
    static L: OnceLock<Mutex<HashMap<PathBuf, Weak<Listener>>>> = OnceLock::new();
    L.get_or_init(Default::default)
}

/// The listener on `path`, started on first use; it stops (and removes the socket) when the
/// last port using it is gone.
pub fn listener(path: &Path) -> io::Result<Arc<Listener>> {
    let mut all = listeners().lock().unwrap();
    if let Some(l) = all.get(path).and_then(Weak::upgrade) {
        return Ok(l);
    }
    raise_fd_limit();
    let inherited = inherited_sockets().lock().unwrap().remove(path);
    let (sock, inherited) = match inherited {
        Some(fd) => (UnixListener::from(fd), true),
        None => (bind(path)?, false),
    };
    sock.set_nonblocking(true)?;
    let l = Arc::new(Listener {
        path: path.to_path_buf(),
        ports: Mutex::new(HashMap::new()),
        socket: sock.as_fd().try_clone_to_owned()?,
        adopted: Mutex::new(Vec::new()),
        inherited,
    });
    let weak = Arc::downgrade(&l);
    std::thread::Builder::new()
        .name("stitch-nf-attach".into())
        .spawn(move || serve(sock, weak))?;
    all.insert(path.to_path_buf(), Arc::downgrade(&l));
    Ok(l)
}

/// Binds `path`, replacing a socket file no process serves any more. The socket is 0666 and
/// a folder made for it 0711 (entered, not listed), whatever the umask: functions of other
/// users must reach it, and who may attach which port is decided per connection (`peers`).
fn bind(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if *dir == *crate::paths::default_socket_folder() || !dir.exists() {
            stitch_core::files::private_dir(dir, 0o711, None)
                .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
        }
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!(
                    "another process serves function ports on {}; give this instance another `socket`",
                    path.display()
                ),
            ));
        }
        let _ = std::fs::remove_file(path);
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

impl Listener {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A duplicate of the listening socket, for a process taking over.
    pub fn socket(&self) -> io::Result<OwnedFd> {
        self.socket.try_clone()
    }

    /// Watches `conn`, the connection of a function attached to `port` under a predecessor
    /// process (`in_guest`: its VM's QEMU's): when it closes — or a guest's function says its
    /// hello again — the port detaches it as if it had attached here.
    pub fn adopt(&self, conn: UnixStream, port: &Arc<PortShared>, generation: u64, in_guest: bool) {
        self.adopted.lock().unwrap().push(Connection {
            stream: conn,
            port: Arc::downgrade(port),
            generation,
            guest: in_guest.then(|| GuestLink { line: Vec::new() }),
        });
    }

    pub fn register(&self, port: Arc<PortShared>) -> Result<(), String> {
        let mut ports = self.ports.lock().unwrap();
        if ports.contains_key(&port.name) {
            return Err(format!(
                "function port `{}` is already served on {}",
                port.name,
                self.path.display()
            ));
        }
        ports.insert(port.name.clone(), port);
        Ok(())
    }

    pub fn unregister(&self, port: &Arc<PortShared>) {
        let mut ports = self.ports.lock().unwrap();
        if ports.get(&port.name).is_some_and(|p| Arc::ptr_eq(p, port)) {
            ports.remove(&port.name);
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if self.inherited {
            return;
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

struct Connection {
    stream: UnixStream,
    port: Weak<PortShared>,
    generation: u64,
    /// The connection of a guest's QEMU: it outlives the function, and carries the next
    /// hello when the function starts again.
    guest: Option<GuestLink>,
}

/// What the connection of a guest's QEMU holds beside it.
struct GuestLink {
    /// Bytes of a line not yet complete.
    line: Vec<u8>,
}

/// A connection whose hello is not complete yet — or is, for a port still held by the
/// attachment it replaces.
struct Pending {
    stream: UnixStream,
    line: Vec<u8>,
    hello: Option<Value>,
    /// When the hello came: a port not free within [`FREE_WAIT`] of it is refused.
    since: Instant,
}

/// How long a hello waits for its port to be let go by the attachment it replaces.
const FREE_WAIT: Duration = Duration::from_secs(5);
/// Connections that have said nothing yet, at most (a guest's QEMU connects long before its
/// function speaks): the oldest are closed first.
const SILENT_MAX: usize = 256;

/// What became of reading a connection.
enum Heard {
    Nothing,
    Closed,
    Line(Vec<u8>),
}

/// The longest line a connection may send: a longer one closes it.
const LINE_MAX: usize = 64 << 10;

/// Reads what `stream` has (it does not block) into `line`; a complete line is taken out.
fn hear(stream: &UnixStream, line: &mut Vec<u8>) -> Heard {
    let mut buf = [0u8; 4096];
    loop {
        match io::Read::read(&mut &*stream, &mut buf) {
            Ok(0) => return Heard::Closed,
            Ok(n) => line.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Heard::Closed,
        }
        if line.len() > LINE_MAX {
            return Heard::Closed;
        }
    }
    take_line(line).map_or(Heard::Nothing, Heard::Line)
}

/// Takes the first complete line (with its newline) out of `line`, if one is there.
fn take_line(line: &mut Vec<u8>) -> Option<Vec<u8>> {
    let at = line.iter().position(|b| *b == b'\n')?;
    let rest = line.split_off(at + 1);
    Some(std::mem::replace(line, rest))
}

/// What the listener makes of the bytes a function — or a guest, through its serial port —
/// sends, arriving in `chunks`: each complete line's hello, or why it is refused; and whether
/// the connection was closed for a line longer than it takes. For the fuzzer.
#[doc(hidden)]
pub fn hellos_in<'a>(
    chunks: impl IntoIterator<Item = &'a [u8]>,
) -> (Vec<Result<Value, String>>, bool) {
    let (mut line, mut hellos) = (Vec::new(), Vec::new());
    for chunk in chunks {
        line.extend_from_slice(chunk);
        while let Some(l) = take_line(&mut line) {
            hellos.push(parse_hello(&l));
        }
        if line.len() > LINE_MAX {
            return (hellos, true);
        }
    }
    (hellos, false)
}

fn serve(sock: UnixListener, listener: Weak<Listener>) {
    let mut conns: Vec<Connection> = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        let Some(l) = listener.upgrade() else {
            // The last port is gone: close every connection so that functions see it.
            return;
        };
        conns.append(&mut l.adopted.lock().unwrap());
        // Connections of ports that were removed are closed.
        let ports = l.ports.lock().unwrap();
        conns.retain(|c| {
            c.port
                .upgrade()
                .is_some_and(|p| ports.get(&p.name).is_some_and(|q| Arc::ptr_eq(q, &p)))
        });
        drop(ports);
        let waiting = pending.iter().any(|p| p.hello.is_some());
        let mut fds: Vec<libc::pollfd> = std::iter::once(sock.as_raw_fd())
            .chain(conns.iter().map(|c| c.stream.as_raw_fd()))
            .chain(pending.iter().map(|p| p.stream.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let timeout = if waiting { 20 } else { 200 };
        // Not held while waiting: when the last port goes, the listener (and its socket
        // file) goes with it at once, not after this thread wakes — the process may have
        // exited by then, leaving the socket behind.
        drop(l);
        // SAFETY: `fds` is a live array of fds.len() pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        let Some(l) = listener.upgrade() else {
            return;
        };
        if n > 0 {
            let readable = |i: usize| fds[i].revents != 0;
            let (first_conn, first_pending) = (1, 1 + conns.len());
            for i in (0..pending.len()).rev() {
                if readable(first_pending + i) && pending[i].hello.is_none() {
                    let p = &mut pending[i];
                    match hear(&p.stream, &mut p.line) {
                        Heard::Nothing => {}
                        Heard::Closed => drop(pending.swap_remove(i)),
                        Heard::Line(line) => match parse_hello(&line) {
                            Ok(hello) => {
                                p.hello = Some(hello);
                                p.since = Instant::now();
                            }
                            Err(e) => refuse(&pending.swap_remove(i).stream, &e),
                        },
                    }
                }
            }
            for i in (0..conns.len()).rev() {
                if readable(first_conn + i) {
                    if let Some(again) = hear_attached(&mut conns, i) {
                        pending.push(again);
                    }
                }
            }
            if readable(0) {
                while let Ok((stream, _)) = sock.accept() {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    pending.push(Pending {
                        stream,
                        line: Vec::new(),
                        hello: None,
                        since: Instant::now(),
                    });
                }
            }
        }
        answer_hellos(&l, &mut pending, &mut conns);
        let silent = pending.iter().filter(|p| p.hello.is_none()).count();
        if silent > SILENT_MAX {
            let mut extra = silent - SILENT_MAX;
            pending.retain(|p| {
                let keep = p.hello.is_some() || extra == 0;
                extra -= usize::from(!keep);
                keep
            });
        }
    }
}

/// Reads attached connection `i`: a function on the host says nothing after its hello, so
/// anything readable means it went away; a guest's connection stays with QEMU and brings the
/// hello of the function started again in the guest, returned to be answered once the port
/// is free (the attachment ends). A line from a guest that is no hello is answered with why,
/// and changes nothing.
fn hear_attached(conns: &mut Vec<Connection>, i: usize) -> Option<Pending> {
    let c = &mut conns[i];
    let again = match c.guest.as_mut() {
        None => None,
        Some(g) => match hear(&c.stream, &mut g.line) {
            Heard::Nothing => return None,
            Heard::Closed => None,
            Heard::Line(line) => match parse_hello(&line) {
                Err(e) => {
                    refuse(&c.stream, &format!("{e} (the function stays attached)"));
                    return None;
                }
                Ok(hello) => Some(Pending {
                    stream: c.stream.try_clone().ok()?,
                    line: std::mem::take(&mut g.line),
                    hello: Some(hello),
                    since: Instant::now(),
                }),
            },
        },
    };
    let c = conns.swap_remove(i);
    if let Some(port) = c.port.upgrade() {
        port.closed.fetch_max(c.generation, Ordering::AcqRel);
        port.changed.store(true, Ordering::Release);
    }
    again
}

/// Attaches the functions whose hello came, or refuses them; a port still held by the
/// attachment a new hello replaces is tried again at the next round.
fn answer_hellos(l: &Listener, pending: &mut Vec<Pending>, conns: &mut Vec<Connection>) {
    let mut i = 0;
    while i < pending.len() {
        let Some(hello) = &pending[i].hello else {
            i += 1;
            continue;
        };
        match attach(l, &pending[i].stream, hello) {
            Ok(a) => {
                let p = pending.swap_remove(i);
                conns.push(Connection {
                    stream: p.stream,
                    port: Arc::downgrade(&a.port),
                    generation: a.generation,
                    guest: a.in_guest.then_some(GuestLink { line: p.line }),
                });
            }
            Err(Refusal::Busy(_)) if pending[i].since.elapsed() < FREE_WAIT => i += 1,
            Err(Refusal::Busy(e) | Refusal::Other(e)) => {
                log::info!("function attach refused: {e}");
                refuse(&pending.swap_remove(i).stream, &e);
            }
        }
    }
}

fn refuse(stream: &UnixStream, why: &str) {
    let reply = json!({ "ok": false, "error": why }).to_string() + "\n";
    let _ = fdpass::send(stream.as_raw_fd(), reply.as_bytes(), &[]);
}

/// Each attached function costs two descriptors (its connection and doorbell): thousands of
/// functions need more than the usual soft limit of 1024, so take the hard limit.
fn raise_fd_limit() {
    // SAFETY: rlimit is two integers; zero is a valid value.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: both calls read or write only `r`, a live rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// The function's first line: the protocol version and the port it asks for.
fn parse_hello(line: &[u8]) -> Result<Value, String> {
    let hello: Value =
        serde_json::from_slice(line).map_err(|e| format!("hello is not JSON: {e}"))?;
    if hello["version"] != json!(VERSION) {
        return Err(format!(
            "protocol version {} is not {VERSION}: rebuild the function with this Stitch's library",
            hello["version"]
        ));
    }
    Ok(hello)
}

/// The region's header, as the function reads it: layout, mode, wake and the pool it maps.
fn write_header(region: &mut Mapping, layout: &Layout, s: PortSettings) -> Result<(), String> {
    let pool = stitch_core::pool::get();
    let (_, pool_bytes) = pool.region();
    // SAFETY: RegionHeader is repr(C) of integers and atomics; the function has not got the
    // memfd yet.
    let header = unsafe { region.view_mut::<RegionHeader>(0) }.ok_or("region too small")?;
    {
        *header = RegionHeader {
            magic: MAGIC,
            version: VERSION,
            mode: if s.zero_copy { 0 } else { 1 },
            wake: if s.blocking { 1 } else { 0 },
            ring_size: layout.ring_size,
            buffers: layout.buffers,
            buffer_size: layout.buffer_size,
            to_nf: layout.to_nf as u32,
            from_nf: layout.from_nf as u32,
            bufs: layout.bufs as u32,
            region_size: layout.size as u32,
            pool_stride: pool.stride() as u32,
            pool_header: stitch_core::packet::HEADER_SIZE as u32,
            pool_bytes: if s.zero_copy { pool_bytes as u64 } else { 0 },
            sleeping: crate::shm::Index(Default::default()),
            control: crate::shm::Index(Default::default()),
            control_taken: crate::shm::Index(Default::default()),
        };
    }
    Ok(())
}

/// Why a hello was not answered with a port.
enum Refusal {
    /// The port is held by an attachment (perhaps the one this hello replaces, not let go
    /// yet).
    Busy(String),
    Other(String),
}

impl From<String> for Refusal {
    fn from(e: String) -> Refusal {
        Refusal::Other(e)
    }
}

impl From<&str> for Refusal {
    fn from(e: &str) -> Refusal {
        Refusal::Other(e.to_string())
    }
}

/// A function attached: its port, the attachment's generation, whether it runs in a guest.
struct Attached {
    port: Arc<PortShared>,
    generation: u64,
    in_guest: bool,
}

/// The port a hello asks for, if it is here, the peer may attach it (`peers`) and it is free.
fn requested_port(
    l: &Listener,
    hello: &Value,
    cred: Option<crate::peers::Cred>,
) -> Result<Arc<PortShared>, Refusal> {
    let name = hello["port"].as_str().ok_or("hello names no `port`")?;
    let port = (l.ports.lock().unwrap().get(name).cloned())
        .ok_or_else(|| format!("no function port `{name}` on {}", l.path.display()))?;
    let peers = port.peers.lock().unwrap().clone();
    crate::peers::check(&l.path, name, &peers, cred)?;
    if port.busy.load(Ordering::Acquire) || port.incoming.lock().unwrap().is_some() {
        return Err(Refusal::Busy(format!(
            "function port `{name}` is in use by another function; detach it first"
        )));
    }
    Ok(port)
}

/// The guest a hello comes from, for a function in a VM (`"transport": "ivshmem"`).
fn guest_of(
    l: &Listener,
    hello: &Value,
    s: PortSettings,
) -> Result<Option<Arc<dyn GuestBus>>, String> {
    match hello["transport"].as_str() {
        None => Ok(None),
        Some(guest::TRANSPORT) => {
            let bus = guest::bus(&l.path).ok_or_else(|| {
                format!(
                    "{} serves no VM: a function in a guest attaches through a `vm` app with \
                     `rings: ivshmem`",
                    l.path.display()
                )
            })?;
            if s.blocking {
                return Err(
                    "a function in a guest polls its rings: give its port `wake: polling`".into(),
                );
            }
            Ok(Some(bus))
        }
        Some(other) => Err(format!(
            "unknown transport `{other}` (this Stitch knows `{}`)",
            guest::TRANSPORT
        )),
    }
}

/// Plugs the port's region (and in zero-copy mode the packet memory) into the guest, after
/// sweeping it of what earlier attachments left; the devices' PCI addresses for the answer. A
/// refusal is counted on the port (a device plugged before it stays until the next sweep).
fn plug_into_guest(
    bus: &Arc<dyn GuestBus>,
    port: &PortShared,
    generation: u64,
    region: (&OwnedFd, usize),
) -> Result<Value, String> {
    let prefix = guest::attachment_prefix(&port.name, generation);
    guest::sweep(bus, prefix.clone());
    let mut devices = serde_json::Map::new();
    let pool_memory = port.settings.zero_copy.then(guest::pool_memory);
    let memories = std::iter::once(("region", region.0.as_fd(), region.1))
        .chain(pool_memory.map(|(fd, bytes)| ("pool", fd, bytes)));
    for (what, fd, bytes) in memories {
        let id = guest::device_id(&port.name, generation, what);
        match guest::plug_memory(bus.as_ref(), &id, fd, bytes) {
            Ok(addr) => {
                devices.insert(
                    what.into(),
                    json!({ "id": id, "pci": addr, "bytes": bytes }),
                );
            }
            Err(e) => {
                port.guest_plug_refusals.fetch_add(1, Ordering::Relaxed);
                port.changed.store(true, Ordering::Release);
                return Err(format!(
                    "QEMU did not plug the port's {what} into the guest: {e}"
                ));
            }
        }
    }
    Ok(Value::Object(devices))
}

/// Builds the port's region for the hello's function and answers with it.
fn attach(l: &Listener, stream: &UnixStream, hello: &Value) -> Result<Attached, Refusal> {
    let cred = crate::peers::peer_cred(stream);
    let port = requested_port(l, hello, cred)?;
    let name = port.name.clone();
    let pid = cred.map_or(0, |c| c.pid);
    let s = port.settings;
    let guest = guest_of(l, hello, s)?;
    let layout = Layout::new(
        s.ring_size,
        if s.zero_copy { 0 } else { s.buffers },
        s.buffer_size,
    );
    let memfd = crate::shm::memfd(&format!("stitch-nf-{name}"), layout.size)
        .map_err(|e| format!("cannot create the port's memory: {e}"))?;
    let mut region = crate::shm::map(
        memfd.as_fd(),
        layout.size,
        layout.size <= crate::shm::POPULATE_MAX,
    )
    .map_err(|e| format!("cannot map: {e}"))?;
    let pool = stitch_core::pool::get();
    let (_, pool_bytes) = pool.region();
    write_header(&mut region, &layout, s)?;
    // SAFETY: eventfd takes no pointers.
    let doorbell = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if doorbell < 0 {
        return Err(format!("eventfd: {}", io::Error::last_os_error()).into());
    }
    // SAFETY: eventfd returned a new descriptor that nothing else owns.
    let doorbell = Arc::new(unsafe { OwnedFd::from_raw_fd(doorbell) });
    let conn = stream
        .try_clone()
        .map_err(|e| format!("cannot keep the connection: {e}"))?
        .into();
    let generation = next_generation();
    let devices = match &guest {
        Some(bus) => Some(plug_into_guest(
            bus,
            &port,
            generation,
            (&memfd, layout.size),
        )?),
        None => None,
    };
    // A function whose Stitch process ended asks again: what it lost, and its new output.
    let lost_before = hello["resumed"]["lost"].as_u64();
    let output = lost_before
        .and_then(|_| (offered_outputs().lock().unwrap()).remove(&(l.path.clone(), name.clone())));
    let mut reply = json!({
        "ok": true,
        "port": name,
        "mode": if s.zero_copy { "zero_copy" } else { "isolated" },
        "wake": if s.blocking { "blocking" } else { "polling" },
        "region_size": layout.size,
        "pool_bytes": if s.zero_copy { pool_bytes } else { 0 },
        "output": output.is_some(),
    });
    let mut fds = Vec::new();
    if let Some(devices) = &devices {
        reply["devices"] = devices.clone();
    } else {
        fds = vec![memfd.as_raw_fd(), doorbell.as_raw_fd()];
        if s.zero_copy {
            fds.push(pool.memfd());
        }
        fds.extend(output.iter().flatten().map(|fd| fd.as_raw_fd()));
    }
    fdpass::send(stream.as_raw_fd(), format!("{reply}\n").as_bytes(), &fds)
        .map_err(|e| format!("cannot answer the function: {e}"))?;
    *port.incoming.lock().unwrap() = Some(Attachment {
        region,
        memfd,
        layout,
        doorbell,
        conn,
        generation,
        pid,
        lost_before,
        guest,
        guest_devices: devices.clone().unwrap_or_default(),
    });
    port.changed.store(true, Ordering::Release);
    match (lost_before, &devices) {
        (_, Some(devices)) => log::info!(
            "function in the guest of {} attached to port `{name}` on ivshmem devices {devices}",
            l.path.display()
        ),
        (Some(lost), None) => log::info!(
            "function (pid {pid}) attached to port `{name}` again after Stitch's process \
             ended; {lost} packets were left with that process"
        ),
        (None, None) => log::info!("function (pid {pid}) attached to port `{name}`"),
    }
    Ok(Attached {
        port,
        generation,
        in_guest: devices.is_some(),
    })
}
