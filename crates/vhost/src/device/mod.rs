//! The vhost-user back-end of one port: the connection to the front-end (QEMU or DPDK's
//! virtio-user), its messages, and the device state they build — features, the memory table,
//! the rings. The connection runs on its own thread; the port's data path takes the state
//! with `try_lock` once per breath, so a message being handled never blocks the engine.
//!
//! Message handling is our own (not vhost-user-backend's): QEMU 7.2 sends SET_VRING_ENABLE
//! before SET_FEATURES, which that crate refuses; here the order of those two does not matter.

use crate::memory::{DirtyLog, GuestMemory};
use crate::message::{self, req, Header, Request, VringAddr, HEADER_LEN};
use crate::virtq::Vring;

pub mod handover;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub mod feature {
    pub const NET_CSUM: u64 = 1 << 0;
    pub const NET_GUEST_CSUM: u64 = 1 << 1;
    pub const NET_GUEST_TSO4: u64 = 1 << 7;
    pub const NET_GUEST_TSO6: u64 = 1 << 8;
    pub const NET_HOST_TSO4: u64 = 1 << 11;
    pub const NET_HOST_TSO6: u64 = 1 << 12;
    pub const NET_MRG_RXBUF: u64 = 1 << 15;
    pub const NET_MQ: u64 = 1 << 22;
    pub const LOG_ALL: u64 = 1 << 26;
    pub const RING_INDIRECT_DESC: u64 = 1 << 28;
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;
    pub const VERSION_1: u64 = 1 << 32;
    pub const IN_ORDER: u64 = 1 << 35;

    pub const PROTOCOL_MQ: u64 = 1 << 0;
    pub const PROTOCOL_LOG_SHMFD: u64 = 1 << 1;
    pub const PROTOCOL_RARP: u64 = 1 << 2;
    pub const PROTOCOL_REPLY_ACK: u64 = 1 << 3;
}

/// Everything about one ring.
#[derive(Default)]
pub struct Queue {
    num: u16,
    addr: Option<VringAddr>,
    base: u16,
    /// SET_VRING_KICK seen: the ring is started (until GET_VRING_BASE stops it).
    started: bool,
    /// SET_VRING_ENABLE; only counts once PROTOCOL_FEATURES is negotiated.
    enabled: bool,
    pub call: Option<OwnedFd>,
    pub ring: Option<Vring>,
    /// Why the ring was stopped (a guest fault); cleared when the front-end sets it up again.
    pub fault: Option<String>,
}

impl Queue {
    /// A front-end that starts a ring again after a reconnect without its old index (DPDK's
    /// virtio-user in server mode gives base 0) leaves its used ring where the last back-end
    /// stopped: carry on from there, as DPDK's own vhost library does. Chains the last
    /// back-end took and never used are taken again (a frame from the guest may be sent twice;
    /// one toward it is lost).
    fn resync(&mut self, i: usize) {
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        let used = ring.used_in_memory();
        if used != self.base {
            log::info!(
                "vhost_user ring {i}: started at {} but its used ring stands at {used} (the \
                 front-end came back without its old index): carrying on from {used}",
                self.base
            );
            ring.resume_at((used, used));
        }
    }

    fn build(&mut self, mem: Option<&Arc<GuestMemory>>) {
        self.ring = None;
        let (Some(mem), Some(a)) = (mem, self.addr) else {
            return;
        };
        // VHOST_VRING_F_LOG: the used ring's guest address is given for logging its writes.
        let used_gpa = (a.flags & 1 != 0).then_some(a.log);
        match Vring::new(mem, self.num, a.desc, a.avail, a.used, self.base, used_gpa) {
            Ok(r) => self.ring = Some(r),
            Err(f) => self.fault = Some(f.to_string()),
        }
    }
}

pub struct Device {
    pub features: u64,
    protocol: u64,
    /// Shared with every ring made in it, which keeps it mapped while the ring exists.
    pub mem: Option<Arc<GuestMemory>>,
    /// The dirty log, once the front-end gave one (live migration).
    log: Option<DirtyLog>,
    /// A MAC address to announce (RARP) for a guest that just migrated here.
    pub announce: Option<[u8; 6]>,
    pub queues: Vec<Queue>,
    pub connected: bool,
    /// A duplicate of the front-end's connection, to lend to a process taking over.
    connection: Option<OwnedFd>,
}

impl Device {
    pub fn new(queue_pairs: usize) -> Device {
        Device {
            features: 0,
            protocol: 0,
            mem: None,
            log: None,
            announce: None,
            queues: (0..2 * queue_pairs).map(|_| Queue::default()).collect(),
            connected: false,
            connection: None,
        }
    }

    fn reset(&mut self) {
        let n = self.queues.len();
        *self = Device::new(n / 2);
    }

    /// A ring the data path may use now, with what writing into it needs.
    pub fn live(&mut self, i: usize) -> Option<Live<'_>> {
        let protocol = self.features & feature::PROTOCOL_FEATURES != 0;
        let logging = self.features & feature::LOG_ALL != 0;
        let q = self.queues.get_mut(i)?;
        if !q.started || (protocol && !q.enabled) || q.fault.is_some() {
            return None;
        }
        Some(Live {
            ring: q.ring.as_mut()?,
            call: q.call.as_ref(),
            log: if logging { self.log.as_ref() } else { None },
        })
    }

    pub fn stop_queue(&mut self, i: usize, why: String) {
        if let Some(q) = self.queues.get_mut(i) {
            q.ring = None;
            q.fault = Some(why);
        }
    }
}

/// A ring in use: the ring (which holds its guest memory), its interrupt eventfd and, while
/// the front-end migrates the guest, the dirty log.
pub struct Live<'a> {
    pub ring: &'a mut Vring,
    pub call: Option<&'a OwnedFd>,
    pub log: Option<&'a DirtyLog>,
}

/// What the connection thread and the port share.
pub struct Shared {
    pub name: String,
    pub device: Mutex<Device>,
    pub stop: AtomicBool,
    pub offered: u64,
    pub connections: AtomicU64,
    pub protocol_errors: AtomicU64,
    /// Front-ends refused at accept: not root and not the socket's owner.
    pub refused_connections: AtomicU64,
    /// Faults of this port's guest found by another port writing into its rings (a direct
    /// path): counted in this port's `guest_faults` at its tick.
    pub faults_found_by_peers: AtomicU64,
    /// The thread neither accepts, connects nor reads a message while set: another process
    /// is taking the port over (`stitch upgrade`), or this one has not taken it yet.
    pub paused: AtomicBool,
    /// Held by the thread while it checks `paused` and then accepts or handles one message:
    /// whoever sets `paused` and then takes this lock knows the thread is between messages
    /// and stays there.
    pub serving: Mutex<()>,
    /// Messages handled and connections begun or ended: what a described device state is
    /// current with.
    pub changes: AtomicU64,
    /// The server socket's path is this process's to remove when the port stops (not while
    /// it serves a listener another process lent it and still owns).
    pub owns_path: AtomicBool,
}

impl Shared {
    pub fn new(name: &str, queue_pairs: usize, offered: u64) -> Shared {
        Shared {
            name: name.to_string(),
            device: Mutex::new(Device::new(queue_pairs)),
            stop: AtomicBool::new(false),
            offered,
            connections: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            faults_found_by_peers: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            serving: Mutex::new(()),
            changes: AtomicU64::new(0),
            owns_path: AtomicBool::new(false),
        }
    }

    /// Stops the thread between two messages for good (until `paused` is cleared): false if
    /// it stayed inside one for `patience`.
    pub fn hold(&self, patience: Duration) -> bool {
        self.paused.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + patience;
        loop {
            if self.serving.try_lock().is_ok() {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[derive(Debug, Clone)]
pub struct Endpoint {
    pub path: PathBuf,
    /// Listen (QEMU with `server=off`, virtio-user) or connect (QEMU with `server=on`).
    pub server: bool,
    /// The user (uid, gid) whose front-end connects to a listening port: the socket is its
    /// (0600), and a connection from anyone else but root is refused. Without one the socket
    /// is Stitch's alone.
    pub owner: Option<(u32, u32)>,
}

/// What a port taken over from another process starts on instead of opening its own: the
/// listening socket and the front-end's connection.
#[derive(Default)]
pub struct Sockets {
    pub listener: Option<UnixListener>,
    pub connection: Option<UnixStream>,
}

pub fn offered_features(offloads: bool, queue_pairs: usize) -> u64 {
    use feature::*;
    // IN_ORDER: both directions already use chains in the order they were made available, and
    // a driver that knows it (DPDK's virtio PMD) takes its faster in-order paths.
    let mut f =
        VERSION_1 | PROTOCOL_FEATURES | NET_MRG_RXBUF | RING_INDIRECT_DESC | LOG_ALL | IN_ORDER;
    if queue_pairs > 1 {
        f |= NET_MQ;
    }
    if offloads {
        f |= NET_CSUM
            | NET_GUEST_CSUM
            | NET_HOST_TSO4
            | NET_HOST_TSO6
            | NET_GUEST_TSO4
            | NET_GUEST_TSO6;
    }
    f
}

/// The listening socket of a server port: `lent`, or bound on the path (a socket file left
/// there is replaced).
fn listen(
    endpoint: &Endpoint,
    lent: Option<UnixListener>,
    shared: &Shared,
) -> std::io::Result<UnixListener> {
    let l = match lent {
        Some(l) => l,
        None => {
            if let Ok(meta) = std::fs::symlink_metadata(&endpoint.path) {
                use std::os::unix::fs::FileTypeExt;
                if meta.file_type().is_socket() {
                    let _ = std::fs::remove_file(&endpoint.path);
                }
            }
            if let Some(d) = endpoint.path.parent() {
                std::fs::create_dir_all(d)?;
            }
            let l = UnixListener::bind(&endpoint.path)?;
            shared.owns_path.store(true, Ordering::Relaxed);
            give_socket(&endpoint.path, endpoint.owner)?;
            l
        }
    };
    l.set_nonblocking(true)?;
    Ok(l)
}

/// The next front-end connection: accepted, or connected to (client mode); `None` when there
/// is none yet or the thread is paused.
fn next_connection(
    listener: Option<&UnixListener>,
    endpoint: &Endpoint,
    shared: &Shared,
) -> Option<UnixStream> {
    let _serving = shared.serving.lock().unwrap();
    if shared.paused.load(Ordering::SeqCst) {
        return None;
    }
    let stream = match listener {
        Some(l) => {
            let stream = l.accept().ok()?.0;
            if let Err(why) = may_connect(&stream, endpoint.owner) {
                shared.refused_connections.fetch_add(1, Ordering::Relaxed);
                log::warn!("vhost_user {}: {why}", shared.name);
                return None;
            }
            stream
        }
        None => UnixStream::connect(&endpoint.path).ok()?,
    };
    shared.connections.fetch_add(1, Ordering::Relaxed);
    shared.changes.fetch_add(1, Ordering::SeqCst);
    log::info!("vhost_user {}: front-end connected", shared.name);
    let mut dev = shared.device.lock().unwrap();
    dev.connected = true;
    dev.connection = stream.try_clone().ok().map(OwnedFd::from);
    Some(stream)
}

/// Makes the socket at `path` its owner's, or Stitch's alone: mode 0600 whatever the umask.
fn give_socket(path: &std::path::Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// Whether the front-end at the other end of `stream` may drive the port: root, or the
/// socket's owner when it has one (the socket's mode keeps others out; this holds if a
/// descriptor of it is passed on).
fn may_connect(stream: &UnixStream, owner: Option<(u32, u32)>) -> Result<(), String> {
    let uid = (stitch_core::fdpass::peer_cred(stream))
        .ok_or("cannot tell who connected")?
        .uid;
    if uid == 0 || owner.is_some_and(|(o, _)| o == uid) {
        return Ok(());
    }
    Err(format!(
        "refused a front-end of uid {uid}: the port's socket is for {}",
        match owner {
            Some((o, _)) => format!("uid {o} (its `owner`) and root"),
            None => "root alone (give the port an `owner` for another user's QEMU)".into(),
        }
    ))
}

/// A port's connection thread, and a duplicate of its listening socket (server mode) to lend.
pub struct Connection {
    pub thread: std::thread::JoinHandle<()>,
    pub listener: Option<OwnedFd>,
}

/// Starts the connection thread of a port, on `sockets` a predecessor lent or on its own.
pub fn spawn(
    endpoint: Endpoint,
    shared: Arc<Shared>,
    sockets: Sockets,
) -> std::io::Result<Connection> {
    let listener = match endpoint.server {
        true => Some(listen(&endpoint, sockets.listener, &shared)?),
        false => None,
    };
    let listener_dup = match &listener {
        Some(l) => Some(OwnedFd::from(l.try_clone()?)),
        None => None,
    };
    let mut lent_connection = sockets.connection;
    let thread = std::thread::Builder::new()
        .name(format!("vhost-{}", shared.name))
        .spawn(move || {
            while !shared.stop.load(Ordering::Relaxed) {
                if shared.paused.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                let stream = match lent_connection.take() {
                    Some(s) => s,
                    None => match next_connection(listener.as_ref(), &endpoint, &shared) {
                        Some(s) => s,
                        None => {
                            let wait = if endpoint.server { 50 } else { 200 };
                            std::thread::sleep(Duration::from_millis(wait));
                            continue;
                        }
                    },
                };
                if let Err(e) = serve(&stream, &shared) {
                    shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!(
                        "vhost_user {}: {e}; dropping the connection (the front-end may connect again)",
                        shared.name
                    );
                }
                shared.device.lock().unwrap().reset();
                shared.changes.fetch_add(1, Ordering::SeqCst);
                log::info!("vhost_user {}: front-end gone", shared.name);
            }
            if endpoint.server && shared.owns_path.load(Ordering::Relaxed) {
                let _ = std::fs::remove_file(&endpoint.path);
            }
        })?;
    Ok(Connection {
        thread,
        listener: listener_dup,
    })
}

/// Waits up to `timeout` for `fd` to have something to read (or to be closed).
fn readable(fd: i32, timeout: Duration) -> std::io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
    match n {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

fn read_full(mut s: &UnixStream, buf: &mut [u8], stop: &AtomicBool) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if stop.load(Ordering::Relaxed) {
                    return Err(e);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Handles the messages of one connection until it ends (or the port stops).
fn serve(stream: &UnixStream, shared: &Shared) -> Result<(), String> {
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .map_err(|e| e.to_string())?;
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        if !readable(stream.as_raw_fd(), Duration::from_millis(200))
            .map_err(|e| format!("waiting for a message: {e}"))?
        {
            continue;
        }
        let serving = shared.serving.lock().unwrap();
        if shared.paused.load(Ordering::SeqCst) {
            drop(serving);
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        if !serve_one(stream, shared)? {
            return Ok(());
        }
        shared.changes.fetch_add(1, Ordering::SeqCst);
    }
}

/// Reads, handles and answers one message; false when the front-end closed the connection.
fn serve_one(stream: &UnixStream, shared: &Shared) -> Result<bool, String> {
    let (mut head, fds) = match stitch_core::fdpass::recv(stream.as_raw_fd(), HEADER_LEN) {
        Ok((b, _)) if b.is_empty() => return Ok(false),
        Ok(x) => x,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::Interrupted
            ) =>
        {
            return Ok(true)
        }
        Err(e) => return Err(format!("reading a message: {e}")),
    };
    if head.len() < HEADER_LEN {
        let have = head.len();
        head.resize(HEADER_LEN, 0);
        read_full(stream, &mut head[have..], &shared.stop).map_err(|e| e.to_string())?;
    }
    let h = Header::parse(&head)?;
    let mut payload = vec![0u8; h.size as usize];
    read_full(stream, &mut payload, &shared.stop).map_err(|e| format!("reading a payload: {e}"))?;
    let request = message::parse(&h, &payload, fds.len())?;
    let reply = handle(shared, request, fds)?;
    let mut out = Vec::new();
    match reply {
        Reply::Value(v) => {
            out.extend_from_slice(&h.reply(8));
            out.extend_from_slice(&v.to_le_bytes());
        }
        Reply::State(index, num) => {
            out.extend_from_slice(&h.reply(8));
            out.extend_from_slice(&index.to_le_bytes());
            out.extend_from_slice(&num.to_le_bytes());
        }
        Reply::Empty => out.extend_from_slice(&h.reply(0)),
        Reply::Ack(ok) => {
            let acks = shared.device.lock().unwrap().protocol & feature::PROTOCOL_REPLY_ACK != 0;
            if h.need_reply() && acks {
                out.extend_from_slice(&h.reply(8));
                out.extend_from_slice(&(if ok { 0u64 } else { 1 }).to_le_bytes());
            }
        }
    }
    if !out.is_empty() {
        let mut w = stream;
        w.write_all(&out).map_err(|e| format!("replying: {e}"))?;
    }
    Ok(true)
}

enum Reply {
    Value(u64),
    /// A reply without payload (SET_LOG_BASE).
    Empty,
    State(u32, u32),
    Ack(bool),
}

const PROTOCOLS: u64 = feature::PROTOCOL_MQ
    | feature::PROTOCOL_REPLY_ACK
    | feature::PROTOCOL_LOG_SHMFD
    | feature::PROTOCOL_RARP;

impl Device {
    /// New guest memory: the rings point into the old mapping, so they are mapped again in
    /// the new one.
    fn remap(&mut self, mem: GuestMemory) {
        for q in self.queues.iter_mut() {
            q.ring = None;
        }
        self.mem = Some(Arc::new(mem));
        let Device { mem, queues, .. } = self;
        for q in queues.iter_mut() {
            if q.started {
                q.build(mem.as_ref());
            }
        }
    }

    /// Stops ring `i` (GET_VRING_BASE) and returns where the front-end resumes it.
    fn stop_ring(&mut self, i: usize) -> u16 {
        let q = &mut self.queues[i];
        let base = q.ring.as_ref().map(|r| r.position().0).unwrap_or(q.base);
        q.started = false;
        q.ring = None;
        q.base = base;
        q.call = None;
        base
    }

    /// A ring's kick (starts it; rings are polled, so the eventfd itself is not kept) or call
    /// eventfd.
    fn set_ring_fd(&mut self, i: usize, which: u32, fd: Option<OwnedFd>) {
        match which {
            req::SET_VRING_KICK => {
                drop(fd);
                let Device { mem, queues, .. } = self;
                let q = &mut queues[i];
                q.started = true;
                q.fault = None;
                q.build(mem.as_ref());
                q.resync(i);
            }
            req::SET_VRING_CALL => self.queues[i].call = fd,
            _ => drop(fd),
        }
    }
}

fn handle(shared: &Shared, request: Request, mut fds: Vec<OwnedFd>) -> Result<Reply, String> {
    let mut dev = shared.device.lock().unwrap();
    let nq = dev.queues.len();
    let queue = |index: u32| -> Result<usize, String> {
        if (index as usize) < nq {
            Ok(index as usize)
        } else {
            Err(format!(
                "ring {index} does not exist (the port has {nq} rings)"
            ))
        }
    };
    Ok(match request {
        Request::GetFeatures => Reply::Value(shared.offered),
        Request::SetFeatures(f) => match f & !shared.offered {
            0 => {
                dev.features = f;
                Reply::Ack(true)
            }
            extra => return Err(format!("features {extra:#x} were not offered")),
        },
        Request::SendRarp(mac) => {
            dev.announce = Some(mac);
            Reply::Ack(true)
        }
        Request::SetOwner | Request::ResetOwner | Request::SetMtu(_) => Reply::Ack(true),
        Request::GetProtocolFeatures => Reply::Value(PROTOCOLS),
        Request::SetProtocolFeatures(f) => {
            dev.protocol = f & PROTOCOLS;
            Reply::Ack(true)
        }
        Request::GetQueueNum => Reply::Value((nq / 2) as u64),
        Request::GetMaxMemSlots => Reply::Value(message::MAX_REGIONS as u64),
        Request::SetMemTable(regions) => {
            let mem = GuestMemory::map(&regions, std::mem::take(&mut fds))?;
            log::debug!(
                "vhost_user {}: {} MiB of guest memory",
                shared.name,
                mem.total_size() >> 20
            );
            dev.remap(mem);
            Reply::Ack(true)
        }
        Request::SetLogBase { size, offset } => {
            let fd = fds
                .pop()
                .ok_or("SET_LOG_BASE without a file descriptor (LOG_SHMFD is required)")?;
            dev.log = Some(DirtyLog::map(&fd, size, offset)?);
            log::info!(
                "vhost_user {}: dirty log of {size} bytes (live migration)",
                shared.name
            );
            Reply::Empty
        }
        Request::SetLogFd => Reply::Ack(true),
        Request::SetVringNum { index, num } => {
            let i = queue(index)?;
            if num == 0 || num > 32768 || !num.is_power_of_two() {
                return Err(format!("ring {index}: size {num}"));
            }
            dev.queues[i].num = num as u16;
            Reply::Ack(true)
        }
        Request::SetVringAddr(a) => {
            let i = queue(a.index)?;
            dev.queues[i].addr = Some(a);
            Reply::Ack(true)
        }
        Request::SetVringBase { index, base } => {
            let i = queue(index)?;
            dev.queues[i].base = base as u16;
            Reply::Ack(true)
        }
        Request::GetVringBase { index } => {
            let base = dev.stop_ring(queue(index)?);
            Reply::State(index, base as u32)
        }
        Request::SetVringFd {
            which,
            index,
            no_fd,
        } => {
            let i = queue(index)?;
            let fd = if no_fd { None } else { fds.pop() };
            dev.set_ring_fd(i, which, fd);
            Reply::Ack(true)
        }
        Request::SetVringEnable { index, enable } => {
            let i = queue(index)?;
            dev.queues[i].enabled = enable;
            Reply::Ack(true)
        }
        Request::Unsupported(r) => {
            log::debug!("vhost_user {}: request {r} is not supported", shared.name);
            Reply::Ack(false)
        }
    })
}
