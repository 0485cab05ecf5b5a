//! The OpenFlow side of a switch: a passive TCP endpoint (each controller connection on its own
//! thread) and/or an active connection to a controller, either over TLS with certificates both
//! ways ([`crate::tls`]), speaking OpenFlow 1.3 over the shared
//! pipeline. Changes take effect in the data path before a BARRIER is answered. A timer thread
//! expires flows (FLOW_REMOVED) and reports port changes (PORT_STATUS).

use crate::group::{self, GroupTable};
use crate::meter::{self, MeterTable};
use crate::ofp::{self, Msg, OfError};
use crate::pipeline::{self, FlowEntry, TABLES};
use crate::tls::{self, Tls};
use crate::{oxm, Async, Connection, Shared, State};
use crate::{ROLE_MASTER, ROLE_NOCHANGE, ROLE_SLAVE};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use stitch_wire::be::{self, Put};

pub struct Endpoint {
    stop: Arc<AtomicBool>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Endpoint {
    /// Serves controllers that connect to `listener` (bound by [`listen`] or handed over by
    /// the process an upgrade replaced) and/or connects to `controller`.
    pub fn start(
        shared: Arc<Shared>,
        listener: Option<(TcpListener, Option<Arc<Tls>>)>,
        controller: Option<(String, Option<Arc<Tls>>)>,
    ) -> Result<Option<Endpoint>, String> {
        if listener.is_none() && controller.is_none() {
            return Ok(None);
        }
        let stop = Arc::new(AtomicBool::new(false));
        if let Some((l, tls)) = listener {
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("stitch-openflow".into())
                .spawn(move || loop {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    match l.accept() {
                        Ok((s, peer)) => {
                            let (shared, stop, tls) = (shared.clone(), stop.clone(), tls.clone());
                            std::thread::spawn(move || match tls {
                                None => serve(prepared(s), &shared, &stop),
                                Some(tls) => match tls::accept(&tls, s) {
                                    Ok(s) => serve(prepared_tls(s), &shared, &stop),
                                    Err(e) => log::warn!(
                                        "switch `{}`: controller {peer} refused: {e}",
                                        shared.name
                                    ),
                                },
                            });
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        if let Some((addr, tls)) = controller {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("stitch-openflow-client".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        if let Ok(s) = TcpStream::connect(&addr) {
                            dialled(s, &addr, tls.as_deref(), &shared, &stop);
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        let (shared, stop2) = (shared.clone(), stop.clone());
        std::thread::Builder::new()
            .name("stitch-openflow-timer".into())
            .spawn(move || timer(&shared, &stop2))
            .map_err(|e| e.to_string())?;
        Ok(Some(Endpoint { stop }))
    }
}

/// Refuses a plain passive endpoint that other hosts reach: OpenFlow gives whoever connects the
/// whole switch, and a plain endpoint authenticates nobody.
pub fn check_listen_address(addr: &str) -> Result<(), String> {
    use std::net::ToSocketAddrs;
    let resolved: Vec<std::net::SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("`listen: {addr}`: {e} (give HOST:PORT)"))?
        .collect();
    match resolved.iter().find(|a| !a.ip().is_loopback()) {
        None => Ok(()),
        Some(a) => Err(format!(
            "`listen: {addr}`: {} is reachable from other hosts, and whoever connects reprograms the switch (no TLS or authentication on this endpoint): listen on 127.0.0.1, or add `insecure: true` if that network is trusted",
            a.ip()
        )),
    }
}

/// The passive OpenFlow endpoint's socket on `addr`.
pub fn listen(addr: &str) -> Result<TcpListener, String> {
    TcpListener::bind(addr).map_err(|e| format!("cannot listen for OpenFlow on {addr}: {e}"))
}

/// Every 100 ms: flows past their timeouts leave (FLOW_REMOVED), ports whose link came or went
/// are reported (PORT_STATUS).
fn timer(shared: &Shared, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(100));
        let expired = {
            let mut s = shared.state.lock().unwrap();
            let gone = s.flows.expire(shared.now_ns());
            if !gone.is_empty() {
                shared.publish(&s);
            }
            gone
        };
        for (e, reason) in expired {
            flow_removed(shared, &e, reason);
        }
        if shared.ports_known.load(Ordering::Acquire) {
            report_port_changes(shared);
        }
    }
}

/// Tells each controller of every port whose link differs from what it was last told
/// (PORT_STATUS, reason MODIFY), within its asynchronous-message filter.
fn report_port_changes(shared: &Shared) {
    let now: Vec<bool> = shared
        .port_live
        .iter()
        .map(|l| l.load(Ordering::Relaxed))
        .collect();
    for c in shared.connections.lock().unwrap().iter() {
        let mut told = c.ports_told.lock().unwrap();
        // A controller that never asked learns nothing from a change it never saw.
        let before = told.get_or_insert_with(|| now.clone());
        for (i, &live) in now.iter().enumerate() {
            if live == before[i] {
                continue;
            }
            before[i] = live;
            if c.wants(Async::PortStatus, 2) {
                let mut m = ofp::start(ofp::PORT_STATUS, 0);
                m.push(2); // OFPPR_MODIFY
                m.extend_from_slice(&[0; 7]);
                port_desc(&mut m, shared, i, live);
                c.post(ofp::finish(m));
            }
        }
    }
}

/// Sends FLOW_REMOVED for an entry that asked for it (OFPFF_SEND_FLOW_REM).
fn flow_removed(shared: &Shared, e: &FlowEntry, reason: u8) {
    if e.flags & pipeline::FF_SEND_FLOW_REM == 0 {
        return;
    }
    let age = shared.now_ns().saturating_sub(e.created_ns);
    let mut m = ofp::start(ofp::FLOW_REMOVED, 0);
    m.put(e.cookie);
    m.put(e.priority);
    m.push(reason);
    m.push(e.table);
    m.put((age / 1_000_000_000) as u32);
    m.put((age % 1_000_000_000) as u32);
    m.put(e.idle_timeout);
    m.put(e.hard_timeout);
    m.put(e.packets.load(Ordering::Relaxed));
    m.put(e.bytes.load(Ordering::Relaxed));
    oxm::write_match(&mut m, &e.matching);
    shared.send_async(Async::FlowRemoved, reason, &ofp::finish(m));
}

/// One controller connection until it closes or the switch stops.
/// A controller's connection made ready to serve: no delay, reads that wait 5 ms at most
/// (so that asynchronous messages go out between them).
fn prepared(s: TcpStream) -> TcpStream {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(Duration::from_millis(5)));
    s
}

/// The same for a connection over TLS (its handshake done).
fn prepared_tls<C>(s: rustls::StreamOwned<C, TcpStream>) -> rustls::StreamOwned<C, TcpStream> {
    let _ = s.sock.set_nodelay(true);
    let _ = s.sock.set_read_timeout(Some(Duration::from_millis(5)));
    s
}

/// Serves the controller at `addr` this switch dialled, over TLS when `tls` is given.
fn dialled(s: TcpStream, addr: &str, tls: Option<&Tls>, shared: &Shared, stop: &AtomicBool) {
    let Some(tls) = tls else {
        log::info!("switch `{}`: connected to controller {addr}", shared.name);
        return serve(prepared(s), shared, stop);
    };
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match tls::connect(tls, host, s) {
        Ok(s) => {
            log::info!(
                "switch `{}`: connected to controller ssl:{addr}",
                shared.name
            );
            serve(prepared_tls(s), shared, stop)
        }
        Err(e) => log::warn!("switch `{}`: controller ssl:{addr}: {e}", shared.name),
    }
}

fn serve(mut s: impl Read + Write, shared: &Shared, stop: &AtomicBool) {
    if s.write_all(&ofp::hello()).is_err() {
        return;
    }
    let conn = Arc::new(Connection::default());
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
    let mut chunk = vec![0u8; 1 << 16];
    let mut greeted = false;
    (|| loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        // Asynchronous messages (only once the connection speaks 1.3).
        let out: Vec<Vec<u8>> = conn.outbox.lock().unwrap().drain(..).collect();
        for m in out {
            if s.write_all(&m).is_err() {
                return;
            }
        }
        match s.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        }
        loop {
            let (m, used) = match ofp::next_message(&buf) {
                Ok(Some(x)) => x,
                Ok(None) => break,
                Err(e) => {
                    // The stream cannot be resynchronised: say why and close.
                    let _ = s.write_all(&ofp::error(e, &buf[..buf.len().min(64)]));
                    return;
                }
            };
            let replies = if !greeted {
                if m.kind == ofp::HELLO && ofp::hello_accepts_13(&m) {
                    greeted = true;
                    shared.connections.lock().unwrap().push(conn.clone());
                    Vec::new()
                } else {
                    let _ = s.write_all(&ofp::error(ofp::BAD_REQUEST_VERSION, m.bytes));
                    return;
                }
            } else {
                match handle(&m, shared, &conn) {
                    Ok(r) => r,
                    Err(e) => vec![ofp::error(e, m.bytes)],
                }
            };
            for r in replies {
                if s.write_all(&r).is_err() {
                    return;
                }
            }
            buf.drain(..used);
        }
    })();
    shared
        .connections
        .lock()
        .unwrap()
        .retain(|c| !Arc::ptr_eq(c, &conn));
}

/// Answers every complete message in `buf` as a greeted connection would (for fuzzing and
/// tests; the data path is not involved, so a BARRIER does not wait).
pub fn respond(shared: &Shared, mut buf: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let conn = Connection::default();
    shared.applied.store(u64::MAX, Ordering::Release);
    shared.ports_known.store(true, Ordering::Release);
    loop {
        match ofp::next_message(buf) {
            Ok(Some((m, used))) => {
                match handle(&m, shared, &conn) {
                    Ok(r) => out.extend(r),
                    Err(e) => out.push(ofp::error(e, m.bytes)),
                }
                buf = &buf[used..];
            }
            Ok(None) => return out,
            Err(e) => {
                out.push(ofp::error(e, &buf[..buf.len().min(64)]));
                return out;
            }
        }
    }
}

/// Waits until the data path runs the current pipeline (so that a BARRIER means "in effect").
fn wait_applied(shared: &Shared) {
    let want = shared.version.load(Ordering::Acquire);
    let t = Instant::now();
    while shared.applied.load(Ordering::Acquire) < want && t.elapsed() < Duration::from_millis(500)
    {
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn name_bytes(s: &str, n: usize) -> Vec<u8> {
    let mut b = s.as_bytes().to_vec();
    b.truncate(n - 1);
    b.resize(n, 0);
    b
}

/// Messages that change the switch, which a slave controller may not send (§6.3.6).
fn modifies(kind: u8) -> bool {
    matches!(
        kind,
        ofp::PACKET_OUT
            | ofp::FLOW_MOD
            | ofp::GROUP_MOD
            | ofp::PORT_MOD
            | ofp::TABLE_MOD
            | ofp::METER_MOD
    )
}

fn handle(m: &Msg, shared: &Shared, conn: &Connection) -> Result<Vec<Vec<u8>>, OfError> {
    if m.version != ofp::VERSION {
        return Err(ofp::BAD_REQUEST_VERSION);
    }
    if modifies(m.kind) && conn.role.load(Ordering::Relaxed) == ROLE_SLAVE {
        return Err(ofp::BAD_REQUEST_IS_SLAVE);
    }
    let b = m.bytes;
    Ok(match m.kind {
        ofp::HELLO | ofp::ECHO_REPLY => vec![],
        ofp::ECHO_REQUEST => {
            let mut r = ofp::start(ofp::ECHO_REPLY, m.xid);
            r.extend_from_slice(&b[8..]);
            vec![ofp::finish(r)]
        }
        ofp::EXPERIMENTER => return Err(ofp::BAD_REQUEST_EXPERIMENTER),
        ofp::FEATURES_REQUEST => vec![features_reply(m, shared)],
        ofp::GET_CONFIG_REQUEST => {
            let mut r = ofp::start(ofp::GET_CONFIG_REPLY, m.xid);
            r.extend_from_slice(&[0, 0, 0xff, 0xff]);
            vec![ofp::finish(r)]
        }
        ofp::SET_CONFIG => vec![],
        ofp::FLOW_MOD => {
            flow_mod(b, shared)?;
            vec![]
        }
        ofp::GROUP_MOD => {
            group_mod(b, shared)?;
            vec![]
        }
        ofp::METER_MOD => {
            meter_mod(b, shared)?;
            vec![]
        }
        ofp::PORT_MOD => {
            let port = ofp::u32_field(b, 8)?;
            if port == 0 || port as usize > shared.ports.len() {
                return Err(ofp::PORT_MOD_BAD_PORT);
            }
            vec![]
        }
        ofp::TABLE_MOD => {
            let t = *b.get(8).ok_or(ofp::BAD_REQUEST_LEN)?;
            if t as usize >= TABLES && t != ofp::TABLE_ALL {
                return Err(ofp::TABLE_MOD_BAD_TABLE);
            }
            vec![]
        }
        ofp::PACKET_OUT => {
            let (in_port, actions, data) = crate::action::parse_packet_out(b)?;
            shared
                .packet_outs
                .lock()
                .unwrap()
                .push((in_port, actions, data.to_vec()));
            shared.has_packet_outs.store(true, Ordering::Release);
            vec![]
        }
        ofp::BARRIER_REQUEST => {
            wait_applied(shared);
            vec![ofp::finish(ofp::start(ofp::BARRIER_REPLY, m.xid))]
        }
        ofp::ROLE_REQUEST => vec![role_request(m, shared, conn)?],
        ofp::GET_ASYNC_REQUEST => vec![get_async(m, conn)],
        ofp::SET_ASYNC => {
            set_async(b, conn)?;
            vec![]
        }
        ofp::QUEUE_GET_CONFIG_REQUEST => {
            let port = ofp::u32_field(b, 8)?;
            let mut r = ofp::start(ofp::QUEUE_GET_CONFIG_REPLY, m.xid);
            r.put(port);
            r.extend_from_slice(&[0; 4]);
            vec![ofp::finish(r)]
        }
        ofp::MULTIPART_REQUEST => multipart(m, shared, conn)?,
        _ => return Err(ofp::BAD_REQUEST_TYPE),
    })
}

/// The switch's features: datapath id, no buffers, its tables, flow/table/port/group statistics.
fn features_reply(m: &Msg, shared: &Shared) -> Vec<u8> {
    let mut r = ofp::start(ofp::FEATURES_REPLY, m.xid);
    r.put(shared.datapath_id);
    r.put(0u32); // no buffers
    r.extend_from_slice(&[TABLES as u8, 0, 0, 0]); // tables, main connection
    r.put(1u32 | 2 | 4 | 8);
    r.put(0u32);
    ofp::finish(r)
}

/// A GROUP_MOD applied; flows that used a deleted group are removed (and said so).
pub(crate) fn group_mod(b: &[u8], shared: &Shared) -> Result<(), OfError> {
    let gm = group::parse_group_mod(b)?;
    let mut s = shared.state.lock().unwrap();
    let mut groups: GroupTable = s.groups.clone();
    let deleted = groups.apply(gm, shared.now_ns())?;
    s.groups = groups;
    let removed = s.flows.remove_where(|e| {
        e.instructions
            .actions()
            .any(|a| matches!(a, crate::action::Action::Group(g) if deleted.contains(g)))
    });
    shared.publish(&s);
    drop(s);
    for e in removed {
        flow_removed(shared, &e, pipeline::REMOVED_GROUP_DELETE);
    }
    Ok(())
}

/// A METER_MOD applied; flows that used a deleted meter are removed (and said so).
pub(crate) fn meter_mod(b: &[u8], shared: &Shared) -> Result<(), OfError> {
    let mm = meter::parse_meter_mod(b)?;
    let mut s = shared.state.lock().unwrap();
    let mut meters: MeterTable = s.meters.clone();
    let deleted = meters.apply(mm, shared.now_ns())?;
    s.meters = meters;
    let removed = s
        .flows
        .remove_where(|e| e.instructions.meter.is_some_and(|m| deleted.contains(&m)));
    shared.publish(&s);
    drop(s);
    for e in removed {
        flow_removed(shared, &e, pipeline::REMOVED_METER_DELETE);
    }
    Ok(())
}

/// The connection's asynchronous message filters.
fn get_async(m: &Msg, conn: &Connection) -> Vec<u8> {
    let mut r = ofp::start(ofp::GET_ASYNC_REPLY, m.xid);
    for pair in conn.async_masks.lock().unwrap().iter() {
        for mask in pair {
            r.put(*mask);
        }
    }
    ofp::finish(r)
}

fn set_async(b: &[u8], conn: &Connection) -> Result<(), OfError> {
    let mut masks = [[0u32; 2]; 3];
    for (i, pair) in masks.iter_mut().enumerate() {
        for (j, mask) in pair.iter_mut().enumerate() {
            *mask = ofp::u32_field(b, 8 + (i * 2 + j) * 4)?;
        }
    }
    *conn.async_masks.lock().unwrap() = masks;
    Ok(())
}

pub(crate) fn flow_mod(b: &[u8], shared: &Shared) -> Result<(), OfError> {
    let fm = pipeline::parse_flow_mod(b)?;
    if fm.buffer_id != ofp::NO_BUFFER && fm.command < pipeline::FC_DELETE {
        return Err(ofp::BAD_REQUEST_BUFFER_UNKNOWN);
    }
    let mut s = shared.state.lock().unwrap();
    check_references(&fm, &s)?;
    let removed = s.flows.apply(&fm, shared.now_ns())?;
    shared.publish(&s);
    drop(s);
    for e in removed {
        flow_removed(shared, &e, pipeline::REMOVED_DELETE);
    }
    Ok(())
}

/// Groups and meters a new entry names must exist.
fn check_references(fm: &pipeline::FlowMod, s: &State) -> Result<(), OfError> {
    for a in fm.instructions.actions() {
        if let crate::action::Action::Group(g) = a {
            if !s.groups.groups.contains_key(g) {
                return Err(ofp::BAD_ACTION_OUT_GROUP);
            }
        }
    }
    if let Some(m) = fm.instructions.meter {
        if !s.meters.meters.contains_key(&m) {
            return Err(ofp::METER_MOD_UNKNOWN_METER);
        }
    }
    Ok(())
}

/// ROLE_REQUEST (§6.3.6): a new master makes the others slaves; stale generation ids are
/// refused.
fn role_request(m: &Msg, shared: &Shared, conn: &Connection) -> Result<Vec<u8>, OfError> {
    let role = ofp::u32_field(m.bytes, 8)?;
    let generation = ofp::u64_field(m.bytes, 16)?;
    if role > ROLE_SLAVE {
        return Err(ofp::ROLE_REQUEST_BAD_ROLE);
    }
    if role == ROLE_MASTER || role == ROLE_SLAVE {
        let mut g = shared.generation_id.lock().unwrap();
        if let Some(cur) = *g {
            if (generation.wrapping_sub(cur) as i64) < 0 {
                return Err(ofp::ROLE_REQUEST_STALE);
            }
        }
        *g = Some(generation);
    }
    if role == ROLE_MASTER {
        for c in shared.connections.lock().unwrap().iter() {
            if !std::ptr::eq(&**c, conn) && c.role.load(Ordering::Relaxed) == ROLE_MASTER {
                c.role.store(ROLE_SLAVE, Ordering::Relaxed);
            }
        }
    }
    if role != ROLE_NOCHANGE {
        conn.role.store(role, Ordering::Relaxed);
    }
    let mut r = ofp::start(ofp::ROLE_REPLY, m.xid);
    r.put(conn.role.load(Ordering::Relaxed));
    r.extend_from_slice(&[0; 4]);
    r.extend_from_slice(
        &shared
            .generation_id
            .lock()
            .unwrap()
            .unwrap_or(generation)
            .to_be_bytes(),
    );
    Ok(ofp::finish(r))
}

/// A multipart reply cut into messages of at most 64 KiB, every one but the last flagged
/// OFPMPF_REPLY_MORE.
struct Replies {
    kind: u16,
    xid: u32,
    done: Vec<Vec<u8>>,
    current: Vec<u8>,
}

const REPLY_LIMIT: usize = 65000;

impl Replies {
    fn new(kind: u16, xid: u32) -> Replies {
        Replies {
            kind,
            xid,
            done: Vec::new(),
            current: Replies::header(kind, xid),
        }
    }

    fn header(kind: u16, xid: u32) -> Vec<u8> {
        let mut r = ofp::start(ofp::MULTIPART_REPLY, xid);
        r.put(kind);
        r.extend_from_slice(&[0; 6]);
        r
    }

    /// Adds one body element.
    fn push(&mut self, element: &[u8]) {
        if self.current.len() + element.len() > REPLY_LIMIT && self.current.len() > 16 {
            let full = std::mem::replace(&mut self.current, Replies::header(self.kind, self.xid));
            self.done.push(full);
        }
        self.current.extend_from_slice(element);
    }

    fn finish(mut self) -> Vec<Vec<u8>> {
        self.done.push(self.current);
        let n = self.done.len();
        self.done
            .into_iter()
            .enumerate()
            .map(|(i, mut m)| {
                if i + 1 < n {
                    be::set(&mut m, 10, 1u16);
                }
                ofp::finish(m)
            })
            .collect()
    }
}

fn duration(out: &mut Vec<u8>, ns: u64) {
    out.put((ns / 1_000_000_000) as u32);
    out.put((ns % 1_000_000_000) as u32);
}

fn set_len(e: &mut [u8]) {
    let n = e.len() as u16;
    be::set(e, 0, n);
}

fn multipart(m: &Msg, shared: &Shared, conn: &Connection) -> Result<Vec<Vec<u8>>, OfError> {
    let b = m.bytes;
    let kind = ofp::u16_field(b, 8)?;
    let body = b.get(16..).ok_or(ofp::BAD_REQUEST_LEN)?;
    let mut r = Replies::new(kind, m.xid);
    let now = shared.now_ns();
    match kind {
        ofp::MP_DESC => mp_desc(&mut r, shared),
        ofp::MP_FLOW | ofp::MP_AGGREGATE => mp_flows(&mut r, kind, body, shared, now)?,
        ofp::MP_TABLE => mp_table_stats(&mut r, shared),
        ofp::MP_PORT_STATS => mp_port_stats(&mut r, body, shared, now)?,
        ofp::MP_PORT_DESC => mp_port_descs(&mut r, shared, conn),
        ofp::MP_QUEUE => {}
        ofp::MP_GROUP | ofp::MP_GROUP_DESC => mp_groups(&mut r, kind, body, shared, now)?,
        ofp::MP_GROUP_FEATURES => mp_group_features(&mut r),
        ofp::MP_METER | ofp::MP_METER_CONFIG => mp_meters(&mut r, kind, body, shared, now)?,
        ofp::MP_METER_FEATURES => mp_meter_features(&mut r),
        ofp::MP_TABLE_FEATURES => mp_table_features(&mut r, body)?,
        _ => return Err(ofp::BAD_REQUEST_MULTIPART),
    }
    Ok(r.finish())
}

/// OFPMP_DESC: who made the switch and what it is.
fn mp_desc(r: &mut Replies, shared: &Shared) {
    let mut e = name_bytes("Stitch", 256);
    e.extend(name_bytes("software switch", 256));
    e.extend(name_bytes(env!("CARGO_PKG_VERSION"), 256));
    e.extend(name_bytes("none", 32));
    e.extend(name_bytes(&shared.name, 256));
    r.push(&e);
}

/// OFPMP_FLOW and OFPMP_AGGREGATE: the flows a request selects, one by one or summed.
fn mp_flows(
    r: &mut Replies,
    kind: u16,
    body: &[u8],
    shared: &Shared,
    now: u64,
) -> Result<(), OfError> {
    let table_id = *body.first().ok_or(ofp::BAD_REQUEST_LEN)?;
    if table_id as usize >= TABLES && table_id != ofp::TABLE_ALL {
        return Err(ofp::BAD_REQUEST_TABLE_ID);
    }
    let out_port = ofp::u32_field(body, 4)?;
    let out_group = ofp::u32_field(body, 8)?;
    let (cookie, cookie_mask) = (ofp::u64_field(body, 16)?, ofp::u64_field(body, 24)?);
    let (matching, _) = oxm::parse_match(body, 32)?;
    let s = shared.state.lock().unwrap();
    let chosen = s.flows.select(
        table_id,
        &matching,
        out_port,
        out_group,
        cookie,
        cookie_mask,
    );
    if kind == ofp::MP_AGGREGATE {
        let (mut packets, mut bytes, mut n) = (0u64, 0u64, 0u32);
        for e in chosen {
            packets += e.packets.load(Ordering::Relaxed);
            bytes += e.bytes.load(Ordering::Relaxed);
            n += 1;
        }
        let mut e = be::bytes(packets);
        e.put(bytes);
        e.put(n);
        e.extend_from_slice(&[0; 4]);
        r.push(&e);
    } else {
        for f in chosen {
            r.push(&flow_stats(f, now));
        }
    }
    Ok(())
}

/// OFPMP_TABLE: each table's flows, lookups and matches.
fn mp_table_stats(r: &mut Replies, shared: &Shared) {
    let s = shared.state.lock().unwrap();
    for (t, c) in shared.table_counters.iter().enumerate() {
        let mut e = vec![t as u8, 0, 0, 0];
        e.put(s.flows.tables[t].len() as u32);
        e.put(c.lookups.load(Ordering::Relaxed));
        e.put(c.matched.load(Ordering::Relaxed));
        r.push(&e);
    }
}

/// OFPMP_PORT_STATS: one port's counters, or every port's.
fn mp_port_stats(r: &mut Replies, body: &[u8], shared: &Shared, now: u64) -> Result<(), OfError> {
    let want = ofp::u32_field(body, 0)?;
    for (i, c) in shared.port_counters.iter().enumerate() {
        let no = i as u32 + 1;
        if want != ofp::PORT_ANY && want != no {
            continue;
        }
        let mut e = be::bytes(no);
        e.extend_from_slice(&[0; 4]);
        for v in [
            c.rx_packets.load(Ordering::Relaxed),
            c.tx_packets.load(Ordering::Relaxed),
            c.rx_bytes.load(Ordering::Relaxed),
            c.tx_bytes.load(Ordering::Relaxed),
            0,
            c.tx_dropped.load(Ordering::Relaxed),
            0,
            0,
            0,
            0,
            0,
            0,
        ] {
            e.put(v);
        }
        duration(&mut e, now);
        r.push(&e);
    }
    Ok(())
}

/// OFPMP_PORT_DESC: every port, whose liveness as told is remembered for PORT_STATUS.
fn mp_port_descs(r: &mut Replies, shared: &Shared, conn: &Connection) {
    // A controller's handshake may come before the data path first looked at the
    // links: give it a moment, so the first answer is the truth.
    let t = Instant::now();
    while !shared.ports_known.load(Ordering::Acquire) && t.elapsed() < Duration::from_millis(200) {
        std::thread::sleep(Duration::from_millis(2));
    }
    let told: Vec<bool> = shared
        .port_live
        .iter()
        .map(|l| l.load(Ordering::Relaxed))
        .collect();
    for (i, &live) in told.iter().enumerate() {
        let mut e = Vec::new();
        port_desc(&mut e, shared, i, live);
        r.push(&e);
    }
    *conn.ports_told.lock().unwrap() = Some(told);
}

/// OFPMP_GROUP (one group's counters, or every group's) and OFPMP_GROUP_DESC (every group).
fn mp_groups(
    r: &mut Replies,
    kind: u16,
    body: &[u8],
    shared: &Shared,
    now: u64,
) -> Result<(), OfError> {
    // GROUP_DESC has no body: every group.
    let want = if kind == ofp::MP_GROUP {
        ofp::u32_field(body, 0)?
    } else {
        ofp::GROUP_ALL
    };
    let s = shared.state.lock().unwrap();
    for g in s.groups.groups.values() {
        if kind == ofp::MP_GROUP && want != ofp::GROUP_ALL && want != g.id {
            continue;
        }
        r.push(&if kind == ofp::MP_GROUP {
            group_stats(g, &s, now)
        } else {
            group_desc(g)
        });
    }
    Ok(())
}

/// OFPMP_GROUP_FEATURES: the group types, capabilities, limits and actions supported.
fn mp_group_features(r: &mut Replies) {
    let mut e = Vec::new();
    e.put(0b1111u32); // all, select, indirect, ff
    e.put(1u32 | 2 | 4 | 8); // weight, liveness, chaining, checks
    for _ in 0..4 {
        e.put(group::MAX_GROUPS as u32);
    }
    for _ in 0..4 {
        e.put(supported_actions());
    }
    r.push(&e);
}

/// OFPMP_METER (counters) and OFPMP_METER_CONFIG (bands) of one meter or every meter.
fn mp_meters(
    r: &mut Replies,
    kind: u16,
    body: &[u8],
    shared: &Shared,
    now: u64,
) -> Result<(), OfError> {
    let want = ofp::u32_field(body, 0)?;
    let s = shared.state.lock().unwrap();
    for mt in s.meters.meters.values() {
        if want != ofp::METER_ALL && want != mt.id {
            continue;
        }
        let mut e = Vec::new();
        if kind == ofp::MP_METER {
            let flows = s
                .flows
                .tables
                .iter()
                .flatten()
                .filter(|f| f.instructions.meter == Some(mt.id))
                .count() as u32;
            e.put(mt.id);
            e.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
            e.put(flows);
            e.put(mt.packets.load(Ordering::Relaxed));
            e.put(mt.bytes.load(Ordering::Relaxed));
            duration(&mut e, now.saturating_sub(mt.created_ns));
            for band in &mt.bands {
                e.put(band.packets.load(Ordering::Relaxed));
                e.put(band.bytes.load(Ordering::Relaxed));
            }
            let n = e.len() as u16;
            be::set(&mut e, 4, n);
        } else {
            e.extend_from_slice(&[0, 0]);
            e.put(mt.flags);
            e.put(mt.id);
            meter::write_bands(&mut e, mt);
            set_len(&mut e);
        }
        r.push(&e);
    }
    Ok(())
}

/// OFPMP_METER_FEATURES: limits, band types and capabilities.
fn mp_meter_features(r: &mut Replies) {
    let mut e = be::bytes(meter::MAX_METERS);
    e.put(1u32 << meter::BAND_DROP | 1 << meter::BAND_DSCP_REMARK);
    e.put(0b1111u32); // kbps, pktps, burst, stats
    e.extend_from_slice(&[meter::MAX_BANDS as u8, 0, 0, 0]);
    r.push(&e);
}

/// OFPMP_TABLE_FEATURES: the fixed pipeline's description; setting it is refused.
fn mp_table_features(r: &mut Replies, body: &[u8]) -> Result<(), OfError> {
    if !body.is_empty() {
        // Setting the pipeline's shape is not supported: it is fixed (§7.3.5.5.1).
        return Err(OfError(13, 5));
    }
    for t in 0..TABLES {
        r.push(&table_features(t as u8));
    }
    Ok(())
}

fn flow_stats(e: &FlowEntry, now: u64) -> Vec<u8> {
    let mut r = vec![0, 0, e.table, 0];
    duration(&mut r, now.saturating_sub(e.created_ns));
    r.put(e.priority);
    r.put(e.idle_timeout);
    r.put(e.hard_timeout);
    r.put(e.flags);
    r.extend_from_slice(&[0; 4]);
    r.put(e.cookie);
    r.put(e.packets.load(Ordering::Relaxed));
    r.put(e.bytes.load(Ordering::Relaxed));
    oxm::write_match(&mut r, &e.matching);
    r.extend_from_slice(&e.instructions.raw);
    set_len(&mut r);
    r
}

fn group_desc(g: &group::Group) -> Vec<u8> {
    let mut e = vec![0, 0, g.kind, 0];
    e.put(g.id);
    group::write_buckets(&mut e, g);
    set_len(&mut e);
    e
}

fn group_stats(g: &group::Group, s: &State, now: u64) -> Vec<u8> {
    let refs = s
        .flows
        .tables
        .iter()
        .flatten()
        .filter(|f| {
            f.instructions
                .actions()
                .any(|a| *a == crate::action::Action::Group(g.id))
        })
        .count() as u32;
    let mut e = vec![0, 0, 0, 0];
    e.put(g.id);
    e.put(refs);
    e.extend_from_slice(&[0; 4]);
    e.put(g.packets.load(Ordering::Relaxed));
    e.put(g.bytes.load(Ordering::Relaxed));
    duration(&mut e, now.saturating_sub(g.created_ns));
    for b in &g.buckets {
        e.put(b.packets.load(Ordering::Relaxed));
        e.put(b.bytes.load(Ordering::Relaxed));
    }
    set_len(&mut e);
    e
}

/// `ofp_port` of port index `i`, its link up (`live`: its output link exists) or down.
fn port_desc(r: &mut Vec<u8>, shared: &Shared, i: usize, live: bool) {
    let no = i as u32 + 1;
    r.put(no);
    r.extend_from_slice(&[0; 4]);
    r.extend_from_slice(&[0x02, 0, 0, 0, (no >> 8) as u8, no as u8]);
    r.extend_from_slice(&[0; 2]);
    r.extend(name_bytes(&shared.ports[i], 16));
    r.put(0u32); // config
                 // state: OFPPS_LIVE, or OFPPS_LINK_DOWN.
    r.put(if live { 4u32 } else { 1 });
    // curr, advertised, supported, peer: 10 Gb full duplex, copper.
    for v in [0x1040u32, 0, 0, 0] {
        r.put(v);
    }
    r.put(10_000_000u32); // curr_speed, kbit/s
    r.put(10_000_000u32); // max_speed
}

/// Bitmap of the action types this switch runs (group features).
fn supported_actions() -> u32 {
    [
        0u32, 11, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
    ]
    .iter()
    .fold(0, |m, t| m | 1 << t)
}

/// One table's features: the instructions, tables, actions and fields this pipeline has.
fn table_features(table: u8) -> Vec<u8> {
    fn prop(out: &mut Vec<u8>, kind: u16, body: &[u8]) {
        let start = out.len();
        out.put(kind);
        out.put((4 + body.len()) as u16);
        out.extend_from_slice(body);
        while !(out.len() - start).is_multiple_of(8) {
            out.push(0);
        }
    }
    let ids = |types: &[u16]| -> Vec<u8> {
        types
            .iter()
            .flat_map(|t| [be::net(*t), be::net(4u16)].concat())
            .collect()
    };
    let actions = ids(&[
        0, 11, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
    ]);
    let fields = |set: bool| -> Vec<u8> {
        oxm::FIELDS
            .iter()
            .flatten()
            .filter(|d| {
                !set || !matches!(
                    d.id,
                    oxm::IN_PORT | oxm::IN_PHY_PORT | oxm::METADATA | oxm::IPV6_EXTHDR
                )
            })
            // Plain headers: Open vSwitch refuses masked ones in table features.
            .flat_map(|d| [0x80, 0x00, d.id << 1, d.len])
            .collect()
    };
    let wildcards: Vec<u8> = oxm::FIELDS
        .iter()
        .flatten()
        .flat_map(|d| [0x80, 0x00, d.id << 1, d.len])
        .collect();
    let mut r = vec![0, 0, table, 0, 0, 0, 0, 0];
    r.extend(name_bytes(&format!("table{table}"), 32));
    r.put(u64::MAX); // metadata_match
    r.put(u64::MAX); // metadata_write
    r.put(0u32); // config
    r.put(1_000_000u32); // max_entries
    let last = table as usize + 1 == TABLES;
    let instructions: &[u16] = if last {
        &[2, 3, 4, 5, 6]
    } else {
        &[1, 2, 3, 4, 5, 6]
    };
    let next: Vec<u8> = (table + 1..TABLES as u8).collect();
    for kind in [0u16, 1] {
        prop(&mut r, kind, &ids(instructions));
    }
    for kind in [2u16, 3] {
        prop(&mut r, kind, &next);
    }
    for kind in [4u16, 5, 6, 7] {
        prop(&mut r, kind, &actions);
    }
    prop(&mut r, 8, &fields(false));
    prop(&mut r, 10, &wildcards);
    for kind in [12u16, 13, 14, 15] {
        prop(&mut r, kind, &fields(true));
    }
    set_len(&mut r);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_and_unknown_requests_get_errors() {
        let shared = Shared::new("t", &["a".into()], 1);
        // A MULTIPART_REQUEST cut short (found by the fuzzer).
        let r = respond(&shared, &[4, 18, 0, 11, 0, 0, 0, 9, 0, 1, 0]);
        assert_eq!((r[0][1], &r[0][8..12]), (ofp::ERROR, &[0, 1, 0, 6][..]));
        // An unknown message type.
        let r = respond(&shared, &[4, 99, 0, 8, 0, 0, 0, 1]);
        assert_eq!(&r[0][8..12], &[0, 1, 0, 1]);
        // Echo is answered with its payload.
        let r = respond(&shared, &[4, 2, 0, 10, 0, 0, 0, 7, 0xab, 0xcd]);
        assert_eq!(r[0], [4, 3, 0, 10, 0, 0, 0, 7, 0xab, 0xcd]);
    }

    #[test]
    fn table_features_of_64_tables_come_in_several_replies() {
        let shared = Shared::new("t", &["a".into()], 1);
        let mut req = ofp::start(ofp::MULTIPART_REQUEST, 5);
        req.put(ofp::MP_TABLE_FEATURES);
        req.extend_from_slice(&[0; 6]);
        let r = respond(&shared, &ofp::finish(req));
        assert!(r.len() >= 2, "{} replies", r.len());
        for (i, m) in r.iter().enumerate() {
            assert_eq!(be::get::<u16>(m, 2) as usize, m.len());
            let more = be::get::<u16>(m, 10) & 1 == 1;
            assert_eq!(more, i + 1 < r.len());
        }
    }

    /// Random and damaged bodies for every message that changes or reads the pipeline: always
    /// an answer, never a panic (the `openflow` fuzz target does the same, guided).
    #[test]
    fn random_messages_are_answered_without_panics() {
        let shared = Shared::new("t", &["a".into(), "b".into(), "c".into()], 1);
        let mut rng = fastrand::Rng::with_seed(11);
        // A valid FLOW_MOD with goto-table, write-actions and set-field, to damage byte by byte.
        let mut fm = ofp::start(ofp::FLOW_MOD, 9);
        fm.resize(48, 0);
        be::set(&mut fm, 32, ofp::NO_BUFFER);
        be::set(&mut fm, 36, ofp::PORT_ANY);
        be::set(&mut fm, 40, ofp::GROUP_ANY);
        let m = oxm::Match::from_fields(&[
            (oxm::ETH_TYPE, &[8, 0], None),
            (oxm::IP_PROTO, &[17], None),
        ]);
        oxm::write_match(&mut fm, &m);
        fm.extend_from_slice(&[0, 1, 0, 8, 3, 0, 0, 0]);
        let mut acts = Vec::new();
        crate::action::write_actions(
            &mut acts,
            &[
                crate::action::Action::SetField {
                    id: oxm::UDP_DST,
                    value: vec![0, 53],
                },
                crate::action::Action::output(2),
            ],
        );
        fm.extend_from_slice(&[0, 3]);
        fm.put((8 + acts.len()) as u16);
        fm.extend_from_slice(&[0; 4]);
        fm.extend(acts);
        let fm = ofp::finish(fm);
        assert!(
            respond(&shared, &fm).is_empty(),
            "the valid FLOW_MOD is taken"
        );
        let kinds: Vec<u8> = ofp::PIPELINE_MESSAGES
            .into_iter()
            .chain([ofp::PORT_MOD, ofp::TABLE_MOD])
            .collect();
        for round in 0..20_000 {
            let msg = if round % 2 == 0 {
                let mut m = ofp::start(kinds[round % kinds.len()], 1);
                let n = rng.usize(..200);
                m.extend((0..n).map(|_| rng.u8(..)));
                ofp::finish(m)
            } else {
                let mut m = fm.clone();
                for _ in 0..rng.usize(1..4) {
                    let at = rng.usize(8..m.len());
                    m[at] = rng.u8(..);
                }
                m
            };
            for r in respond(&shared, &msg) {
                assert_eq!(be::get::<u16>(&r, 2) as usize, r.len());
            }
        }
    }

    /// A controller told a port was down at its handshake hears when the link comes up, even
    /// if the data path first looked after that handshake; one that connects later is not told
    /// of changes from before it came.
    #[test]
    fn each_controller_hears_the_link_changes_it_did_not_see() {
        let shared = Shared::new("t", &["a".into(), "b".into()], 1);
        shared.ports_known.store(true, Ordering::Release);
        let asked = Arc::new(Connection::default());
        let silent = Arc::new(Connection::default());
        shared
            .connections
            .lock()
            .unwrap()
            .extend([asked.clone(), silent.clone()]);
        let mut req = ofp::start(ofp::MULTIPART_REQUEST, 3);
        req.put(ofp::MP_PORT_DESC);
        req.extend_from_slice(&[0; 6]);
        let req = ofp::finish(req);
        let (m, _) = ofp::next_message(&req).unwrap().unwrap();
        handle(&m, &shared, &asked).unwrap();
        report_port_changes(&shared);
        assert!(asked.outbox.lock().unwrap().is_empty());
        // The data path now sees port 2's link.
        shared.port_live[1].store(true, Ordering::Relaxed);
        report_port_changes(&shared);
        let out: Vec<Vec<u8>> = asked.outbox.lock().unwrap().drain(..).collect();
        assert_eq!(out.len(), 1);
        assert_eq!((out[0][1], out[0][8]), (ofp::PORT_STATUS, 2));
        assert_eq!(&out[0][16..20], &be::net(2u32));
        // Its state word says live (OFPPS_LIVE).
        assert_eq!(&out[0][16 + 36..16 + 40], &be::net(4u32));
        let late = Arc::new(Connection::default());
        shared.connections.lock().unwrap().push(late.clone());
        report_port_changes(&shared);
        assert!(late.outbox.lock().unwrap().is_empty());
        assert!(asked.outbox.lock().unwrap().is_empty());
    }

    #[test]
    fn a_slave_may_not_change_the_switch() {
        let shared = Shared::new("t", &["a".into(), "b".into()], 1);
        let conn = Connection::default();
        let mut role = ofp::start(ofp::ROLE_REQUEST, 1);
        role.put(ROLE_SLAVE);
        role.extend_from_slice(&[0; 4]);
        role.put(7u64);
        let role = ofp::finish(role);
        let (m, _) = ofp::next_message(&role).unwrap().unwrap();
        let r = handle(&m, &shared, &conn).unwrap();
        assert_eq!(&r[0][8..12], &be::net(ROLE_SLAVE));
        let flow_mod = ofp::finish({
            let mut f = ofp::start(ofp::FLOW_MOD, 2);
            f.resize(48, 0);
            f.extend_from_slice(&[0, 1, 0, 4, 0, 0, 0, 0]);
            f
        });
        let (m, _) = ofp::next_message(&flow_mod).unwrap().unwrap();
        assert_eq!(
            handle(&m, &shared, &conn).err(),
            Some(ofp::BAD_REQUEST_IS_SLAVE)
        );
        // A stale generation id is refused.
        let mut stale = role.clone();
        be::set(&mut stale, 16, 3u64);
        let (m, _) = ofp::next_message(&stale).unwrap().unwrap();
        assert_eq!(
            handle(&m, &shared, &conn).err(),
            Some(ofp::ROLE_REQUEST_STALE)
        );
    }
}
