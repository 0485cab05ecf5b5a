//! The OpenFlow side of a switch: a passive TCP endpoint (each controller connection on its own
//! thread) and/or an active connection to a controller, speaking OpenFlow 1.3 over the shared
//! flow table. Flow changes take effect in the data path before a BARRIER is answered.

use crate::ofp::{self, Msg, OfError};
use crate::{PacketIn, Shared};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Endpoint {
    stop: Arc<AtomicBool>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Endpoint {
    pub fn start(
        shared: Arc<Shared>,
        listen: Option<&str>,
        controller: Option<&str>,
    ) -> Result<Option<Endpoint>, String> {
        if listen.is_none() && controller.is_none() {
            return Ok(None);
        }
        let stop = Arc::new(AtomicBool::new(false));
        if let Some(addr) = listen {
            let l = TcpListener::bind(addr)
                .map_err(|e| format!("cannot listen for OpenFlow on {addr}: {e}"))?;
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("stitch-openflow".into())
                .spawn(move || loop {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    match l.accept() {
                        Ok((s, _)) => {
                            let (shared, stop) = (shared.clone(), stop.clone());
                            std::thread::spawn(move || serve(s, &shared, &stop));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        if let Some(addr) = controller {
            let (shared, stop, addr) = (shared.clone(), stop.clone(), addr.to_string());
            std::thread::Builder::new()
                .name("stitch-openflow-client".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        if let Ok(s) = TcpStream::connect(&addr) {
                            log::info!("switch `{}`: connected to controller {addr}", shared.name);
                            serve(s, &shared, &stop);
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                })
                .map_err(|e| e.to_string())?;
        }
        Ok(Some(Endpoint { stop }))
    }
}

/// One controller connection until it closes or the switch stops.
fn serve(mut s: TcpStream, shared: &Shared, stop: &AtomicBool) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(Duration::from_millis(10)));
    if s.write_all(&ofp::hello()).is_err() {
        return;
    }
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
    let mut chunk = vec![0u8; 1 << 16];
    let mut greeted = false;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        // Frames for the controller (only once the connection speaks 1.3).
        if greeted {
            let ins: Vec<PacketIn> = shared.packet_ins.lock().unwrap().drain(..).collect();
            for pi in ins {
                if s.write_all(&packet_in(&pi)).is_err() {
                    return;
                }
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
                    Vec::new()
                } else {
                    let _ = s.write_all(&ofp::error(ofp::BAD_REQUEST_VERSION, m.bytes));
                    return;
                }
            } else {
                match handle(&m, shared) {
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
    }
}

/// Answers every complete message in `buf` as a greeted connection would (for fuzzing and
/// tests; the data path is not involved, so a BARRIER does not wait).
pub fn respond(shared: &Shared, mut buf: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    shared.applied.store(u64::MAX, Ordering::Release);
    loop {
        match ofp::next_message(buf) {
            Ok(Some((m, used))) => {
                match handle(&m, shared) {
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

fn packet_in(pi: &PacketIn) -> Vec<u8> {
    let mut m = ofp::start(ofp::PACKET_IN, 0);
    m.extend_from_slice(&ofp::NO_BUFFER.to_be_bytes());
    m.extend_from_slice(&(pi.data.len() as u16).to_be_bytes());
    m.push(pi.reason);
    m.push(0);
    m.extend_from_slice(&pi.cookie.to_be_bytes());
    ofp::write_match(
        &mut m,
        &ofp::Match {
            in_port: Some(pi.in_port),
            ..ofp::Match::default()
        },
    );
    m.extend_from_slice(&[0, 0]);
    m.extend_from_slice(&pi.data);
    ofp::finish(m)
}

/// Waits until the data path runs the current table (so that a BARRIER means "in effect").
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

fn handle(m: &Msg, shared: &Shared) -> Result<Vec<Vec<u8>>, OfError> {
    if m.version != ofp::VERSION {
        return Err(ofp::BAD_REQUEST_VERSION);
    }
    let b = m.bytes;
    Ok(match m.kind {
        ofp::HELLO => vec![],
        ofp::ECHO_REQUEST => {
            let mut r = ofp::start(ofp::ECHO_REPLY, m.xid);
            r.extend_from_slice(&b[8..]);
            vec![ofp::finish(r)]
        }
        ofp::ECHO_REPLY => vec![],
        ofp::FEATURES_REQUEST => {
            let mut r = ofp::start(ofp::FEATURES_REPLY, m.xid);
            r.extend_from_slice(&shared.datapath_id.to_be_bytes());
            r.extend_from_slice(&0u32.to_be_bytes()); // no buffers
            r.extend_from_slice(&[1, 0, 0, 0]); // one table, main connection
                                                // Capabilities: flow, table and port statistics.
            r.extend_from_slice(&(1u32 | 2 | 4).to_be_bytes());
            r.extend_from_slice(&0u32.to_be_bytes());
            vec![ofp::finish(r)]
        }
        ofp::GET_CONFIG_REQUEST => {
            let mut r = ofp::start(ofp::GET_CONFIG_REPLY, m.xid);
            r.extend_from_slice(&[0, 0, 0xff, 0xff]);
            vec![ofp::finish(r)]
        }
        ofp::SET_CONFIG => vec![],
        ofp::FLOW_MOD => {
            let fm = ofp::parse_flow_mod(b)?;
            let mut t = shared.table.lock().unwrap();
            t.apply(&fm)?;
            shared.publish(&t);
            vec![]
        }
        ofp::PACKET_OUT => {
            let (in_port, actions, data) = ofp::parse_packet_out(b)?;
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
        ofp::MULTIPART_REQUEST => multipart(m, shared)?,
        _ => return Err(ofp::BAD_REQUEST_TYPE),
    })
}

/// The one table's features: the instructions, actions and match fields this switch has.
fn table_features(r: &mut Vec<u8>) {
    fn prop(out: &mut Vec<u8>, kind: u16, body: &[u8]) {
        let start = out.len();
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&((4 + body.len()) as u16).to_be_bytes());
        out.extend_from_slice(body);
        while !(out.len() - start).is_multiple_of(8) {
            out.push(0);
        }
    }
    let ids = |types: &[u16]| -> Vec<u8> {
        types
            .iter()
            .flat_map(|t| [t.to_be_bytes(), 4u16.to_be_bytes()].concat())
            .collect()
    };
    let oxms = |fields: &[(u8, u8, bool)]| -> Vec<u8> {
        fields
            .iter()
            // Plain headers: Open vSwitch refuses masked ones in table features.
            .flat_map(|&(f, len, _maskable)| [0x80, 0x00, f << 1, len])
            .collect()
    };
    let matchable = [
        (0, 4, false),
        (3, 6, true),
        (4, 6, true),
        (5, 2, false),
        (6, 2, true),
        (10, 1, false),
        (11, 4, true),
        (12, 4, true),
        (13, 2, false),
        (14, 2, false),
        (15, 2, false),
        (16, 2, false),
        (26, 16, true),
        (27, 16, true),
    ];
    let settable = [(3, 6, false), (4, 6, false), (6, 2, false)];
    let start = r.len();
    r.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]); // length, table 0, pad
    r.extend(name_bytes("main", 32));
    r.extend_from_slice(&0u64.to_be_bytes());
    r.extend_from_slice(&0u64.to_be_bytes());
    r.extend_from_slice(&0u32.to_be_bytes());
    r.extend_from_slice(&1_000_000u32.to_be_bytes());
    prop(r, 0, &ids(&[3, 4, 5]));
    prop(r, 2, &[]);
    prop(r, 4, &ids(&[0, 17, 18, 25]));
    prop(r, 6, &ids(&[0, 17, 18, 25]));
    prop(r, 8, &oxms(&matchable));
    prop(r, 10, &oxms(&matchable));
    prop(r, 12, &oxms(&settable));
    prop(r, 14, &oxms(&settable));
    let len = (r.len() - start) as u16;
    r[start..start + 2].copy_from_slice(&len.to_be_bytes());
}

fn multipart(m: &Msg, shared: &Shared) -> Result<Vec<Vec<u8>>, OfError> {
    let b = m.bytes;
    let kind = ofp::u16_field(b, 8)?;
    let mut r = ofp::start(ofp::MULTIPART_REPLY, m.xid);
    r.extend_from_slice(&kind.to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    let body = b.get(16..).ok_or(ofp::BAD_REQUEST_LEN)?;
    let uptime = shared.started.elapsed();
    match kind {
        ofp::MP_DESC => {
            r.extend(name_bytes("Stitch", 256));
            r.extend(name_bytes("software switch", 256));
            r.extend(name_bytes(env!("CARGO_PKG_VERSION"), 256));
            r.extend(name_bytes("none", 32));
            r.extend(name_bytes(&shared.name, 256));
        }
        ofp::MP_FLOW | ofp::MP_AGGREGATE => {
            let table_id = *body.first().ok_or(ofp::BAD_REQUEST_LEN)?;
            let out_port = ofp::u32_field(body, 4)?;
            let (cookie, cookie_mask) = (ofp::u64_field(body, 16)?, ofp::u64_field(body, 24)?);
            let (matching, _) = ofp::parse_match(body, 32)?;
            let t = shared.table.lock().unwrap();
            let chosen = t.select(&matching, out_port).filter(|e| {
                (table_id == 0 || table_id == 0xff)
                    && (cookie_mask == 0 || e.cookie & cookie_mask == cookie & cookie_mask)
            });
            if kind == ofp::MP_AGGREGATE {
                let (mut packets, mut bytes, mut n) = (0u64, 0u64, 0u32);
                for e in chosen {
                    packets += e.packets.load(Ordering::Relaxed);
                    bytes += e.bytes.load(Ordering::Relaxed);
                    n += 1;
                }
                r.extend_from_slice(&packets.to_be_bytes());
                r.extend_from_slice(&bytes.to_be_bytes());
                r.extend_from_slice(&n.to_be_bytes());
                r.extend_from_slice(&[0; 4]);
            } else {
                for e in chosen {
                    let start = r.len();
                    let age = e.created.elapsed();
                    r.extend_from_slice(&[0, 0, 0, 0]); // length, table 0, pad
                    r.extend_from_slice(&(age.as_secs() as u32).to_be_bytes());
                    r.extend_from_slice(&age.subsec_nanos().to_be_bytes());
                    r.extend_from_slice(&e.priority.to_be_bytes());
                    r.extend_from_slice(&e.idle_timeout.to_be_bytes());
                    r.extend_from_slice(&e.hard_timeout.to_be_bytes());
                    r.extend_from_slice(&e.flags.to_be_bytes());
                    r.extend_from_slice(&[0; 4]);
                    r.extend_from_slice(&e.cookie.to_be_bytes());
                    r.extend_from_slice(&e.packets.load(Ordering::Relaxed).to_be_bytes());
                    r.extend_from_slice(&e.bytes.load(Ordering::Relaxed).to_be_bytes());
                    ofp::write_match(&mut r, &e.matching);
                    ofp::write_instructions(&mut r, &e.actions);
                    let len = (r.len() - start) as u16;
                    r[start..start + 2].copy_from_slice(&len.to_be_bytes());
                }
            }
        }
        ofp::MP_TABLE => {
            let active = shared.table.lock().unwrap().entries.len() as u32;
            r.extend_from_slice(&[0, 0, 0, 0]);
            r.extend_from_slice(&active.to_be_bytes());
            r.extend_from_slice(&shared.lookups.load(Ordering::Relaxed).to_be_bytes());
            r.extend_from_slice(&shared.matched.load(Ordering::Relaxed).to_be_bytes());
        }
        ofp::MP_PORT_STATS => {
            let want = ofp::u32_field(body, 0)?;
            for (i, c) in shared.port_counters.iter().enumerate() {
                let no = i as u32 + 1;
                if want != ofp::PORT_ANY && want != no {
                    continue;
                }
                r.extend_from_slice(&no.to_be_bytes());
                r.extend_from_slice(&[0; 4]);
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
                    r.extend_from_slice(&v.to_be_bytes());
                }
                r.extend_from_slice(&(uptime.as_secs() as u32).to_be_bytes());
                r.extend_from_slice(&uptime.subsec_nanos().to_be_bytes());
            }
        }
        ofp::MP_PORT_DESC => {
            for (i, name) in shared.ports.iter().enumerate() {
                let no = i as u32 + 1;
                r.extend_from_slice(&no.to_be_bytes());
                r.extend_from_slice(&[0; 4]);
                r.extend_from_slice(&[0x02, 0, 0, 0, 0, i as u8 + 1]);
                r.extend_from_slice(&[0; 2]);
                r.extend(name_bytes(name, 16));
                r.extend_from_slice(&0u32.to_be_bytes()); // config
                r.extend_from_slice(&4u32.to_be_bytes()); // state: live
                for _ in 0..4 {
                    r.extend_from_slice(&0u32.to_be_bytes()); // curr, advertised, supported, peer
                }
                r.extend_from_slice(&10_000_000u32.to_be_bytes()); // curr_speed, kbit/s
                r.extend_from_slice(&10_000_000u32.to_be_bytes()); // max_speed
            }
        }
        ofp::MP_TABLE_FEATURES => table_features(&mut r),
        _ => return Err(ofp::BAD_REQUEST_MULTIPART),
    }
    Ok(vec![ofp::finish(r)])
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
}
