//! The attach socket on Stitch's side. One listener thread per socket path serves every
//! `nf_port` app that names that path: a function connects, sends one JSON line
//! `{"version":1,"port":"NAME"}`, and gets back a JSON line with the region's layout plus, by
//! SCM_RIGHTS, the region's memfd, the doorbell eventfd and (zero-copy) the packet pool's memfd.
//! The connection then stays open and says nothing more: when it closes — the function exited,
//! crashed or was killed — the port is detached and its buffers reclaimed by the app.

pub use crate::attachment::{Attachment, PortSettings};
pub use crate::direct::PortShared;
use crate::shm::{Layout, Mapping, RegionHeader, MAGIC, VERSION};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
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

/// Binds `path`, replacing a socket file no process serves any more.
fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
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
    UnixListener::bind(path)
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
    /// process: when it closes, the port detaches it as if it had attached here.
    pub fn adopt(&self, conn: UnixStream, port: &Arc<PortShared>, generation: u64) {
        self.adopted.lock().unwrap().push(Connection {
            stream: conn,
            port: Arc::downgrade(port),
            generation,
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
}

fn serve(sock: UnixListener, listener: Weak<Listener>) {
    let mut conns: Vec<Connection> = Vec::new();
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
        drop(l);
        let mut fds: Vec<libc::pollfd> = std::iter::once(sock.as_raw_fd())
            .chain(conns.iter().map(|c| c.stream.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a live array of fds.len() pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
        if n <= 0 {
            continue;
        }
        // A readable or hung-up connection means the function went away (it never sends
        // anything after its hello).
        let mut gone = Vec::new();
        for (i, p) in fds.iter().enumerate().skip(1) {
            if p.revents != 0 {
                gone.push(i - 1);
            }
        }
        for i in gone.into_iter().rev() {
            let c = conns.swap_remove(i);
            if let Some(port) = c.port.upgrade() {
                port.closed.fetch_max(c.generation, Ordering::AcqRel);
                port.changed.store(true, Ordering::Release);
            }
        }
        if fds[0].revents != 0 {
            while let Ok((stream, _)) = sock.accept() {
                let Some(l) = listener.upgrade() else { return };
                match attach(&l, &stream) {
                    Ok((port, generation)) => conns.push(Connection {
                        stream,
                        port: Arc::downgrade(&port),
                        generation,
                    }),
                    Err(e) => {
                        log::info!("function attach refused: {e}");
                        let reply = json!({ "ok": false, "error": e }).to_string() + "\n";
                        let _ = fdpass::send(stream.as_raw_fd(), reply.as_bytes(), &[]);
                    }
                }
            }
        }
    }
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

fn peer_pid(stream: &UnixStream) -> i32 {
    // SAFETY: ucred is three integers; zero is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes (ucred's size) into `cred`.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r == 0 {
        cred.pid
    } else {
        0
    }
}

/// The function's first line: the protocol version and the port it asks for.
fn read_hello(stream: &UnixStream) -> Result<Value, String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(stream.take_ref(4096))
        .read_line(&mut line)
        .map_err(|e| format!("no hello from the function: {e}"))?;
    let hello: Value =
        serde_json::from_str(&line).map_err(|e| format!("hello is not JSON: {e}"))?;
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
        };
    }
    Ok(())
}

/// Reads the hello, builds the port's region and answers with it.
fn attach(l: &Listener, stream: &UnixStream) -> Result<(Arc<PortShared>, u64), String> {
    let hello = read_hello(stream)?;
    let name = hello["port"]
        .as_str()
        .ok_or("hello names no `port`")?
        .to_string();
    let port = l
        .ports
        .lock()
        .unwrap()
        .get(&name)
        .cloned()
        .ok_or_else(|| format!("no function port `{name}` on {}", l.path.display()))?;
    let pid = peer_pid(stream);
    if port.busy.load(Ordering::Acquire) || port.incoming.lock().unwrap().is_some() {
        return Err(format!(
            "function port `{name}` is in use by another function; detach it first"
        ));
    }
    let s = port.settings;
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
        return Err(format!("eventfd: {}", io::Error::last_os_error()));
    }
    // SAFETY: eventfd returned a new descriptor that nothing else owns.
    let doorbell = Arc::new(unsafe { OwnedFd::from_raw_fd(doorbell) });
    let conn = stream
        .try_clone()
        .map_err(|e| format!("cannot keep the connection: {e}"))?
        .into();
    let generation = next_generation();
    // A function whose Stitch process ended asks again: what it lost, and its new output.
    let lost_before = hello["resumed"]["lost"].as_u64();
    let output = lost_before
        .and_then(|_| (offered_outputs().lock().unwrap()).remove(&(l.path.clone(), name.clone())));
    let reply = json!({
        "ok": true,
        "port": name,
        "mode": if s.zero_copy { "zero_copy" } else { "isolated" },
        "wake": if s.blocking { "blocking" } else { "polling" },
        "region_size": layout.size,
        "pool_bytes": if s.zero_copy { pool_bytes } else { 0 },
        "output": output.is_some(),
    })
    .to_string()
        + "\n";
    let mut fds = vec![memfd.as_raw_fd(), doorbell.as_raw_fd()];
    if s.zero_copy {
        fds.push(pool.memfd());
    }
    fds.extend(output.iter().flatten().map(|fd| fd.as_raw_fd()));
    fdpass::send(stream.as_raw_fd(), reply.as_bytes(), &fds)
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
    });
    port.changed.store(true, Ordering::Release);
    match lost_before {
        Some(lost) => log::info!(
            "function (pid {pid}) attached to port `{name}` again after Stitch's process \
             ended; {lost} packets were left with that process"
        ),
        None => log::info!("function (pid {pid}) attached to port `{name}`"),
    }
    Ok((port, generation))
}

trait TakeRef {
    fn take_ref(&self, limit: u64) -> io::Take<&UnixStream>;
}

impl TakeRef for UnixStream {
    fn take_ref(&self, limit: u64) -> io::Take<&UnixStream> {
        io::Read::take(self, limit)
    }
}
