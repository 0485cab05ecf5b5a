//! What an upgrade hands the successor: the XDP program, every socket with its UMEM's file
//! and steering sockets, and where each stands ([`Position`]); the successor maps the same
//! rings and frames and carries on at the indices the rings hold.

use super::socket::{map_rings, Steered, Xsk, FRAME_SIZE};
use super::steering::steer_ports;
use super::{AfXdp, AfXdpConfig, SteerRule};
use crate::netdev::explain;
use crate::xdp::XdpRedirect;
use serde::{Deserialize, Serialize};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;
use stitch_core::mapping::{MapOptions, Mapping};
use stitch_core::Descriptors;

/// Where one socket stands at an upgrade: its set-up and the transmit frames this side holds
/// (the others are in the kernel's rings).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct XskPosition {
    queue: u32,
    frames: u32,
    ring_size: u32,
    zero_copy: bool,
    tx_free: Vec<u64>,
    /// The outputs of its steering sockets, in order.
    #[serde(default)]
    steered: Vec<usize>,
}

/// Where an `af_xdp` port stands at an upgrade. Its descriptors: the XDP map, program and
/// link (and the steering map, with rules), then each socket, its UMEM's file and its
/// steering sockets.
#[derive(Debug, Serialize, Deserialize)]
struct Position {
    native: bool,
    socks: Vec<XskPosition>,
    /// The steering rules the program runs.
    #[serde(default)]
    steer: Vec<SteerRule>,
    /// Steering ports whose rings a function reads itself: its port in the successor takes
    /// the function on, and this app's successor leaves those rings to it.
    #[serde(default)]
    read_by_functions: Vec<String>,
}

/// The program and sockets a predecessor lent, for the same queues.
pub(super) fn adopt(c: &AfXdpConfig, lent: Descriptors) -> Result<(XdpRedirect, Vec<Xsk>), String> {
    let at: Position =
        serde_json::from_value(lent.position).map_err(|e| format!("lent position: {e}"))?;
    let lent_queues: Vec<u32> = at.socks.iter().map(|s| s.queue).collect();
    if lent_queues != c.queues {
        return Err(format!(
            "the predecessor served queues {lent_queues:?}, this graph asks for {:?}",
            c.queues
        ));
    }
    if at.steer != c.steer {
        return Err("the predecessor's steering rules differ from this graph's".into());
    }
    let max_queue = c.queue_bound();
    let mut fds = lent.fds.into_iter();
    let xdp = XdpRedirect::adopt(&mut fds, at.native, max_queue, !at.steer.is_empty())?;
    let mut socks = Vec::new();
    for s in &at.socks {
        let (Some(fd), Some(umem_fd)) = (fds.next(), fds.next()) else {
            return Err(format!("queue {}: its socket was not lent", s.queue));
        };
        socks.push(Xsk::adopt(fd, umem_fd, s, &mut fds)?);
    }
    Ok((xdp, socks))
}

impl Xsk {
    /// The socket and its UMEM's file, and where it stands, for a process taking over.
    pub(super) fn lend(&self) -> std::io::Result<(Vec<OwnedFd>, XskPosition)> {
        let position = XskPosition {
            queue: self.queue,
            frames: self.frames,
            ring_size: self.ring_size,
            zero_copy: self.zero_copy,
            tx_free: self.tx_free.clone(),
            steered: self.steered.iter().map(|s| s.output).collect(),
        };
        let mut fds = vec![self.fd.try_clone()?, self.umem_fd.try_clone()?];
        for s in &self.steered {
            fds.push(s.fd.try_clone()?);
        }
        Ok((fds, position))
    }

    /// The socket a predecessor lent, on its UMEM and rings (the XSKMAP already points at it),
    /// and its steering sockets from `more`.
    pub(super) fn adopt(
        fd: OwnedFd,
        umem_fd: OwnedFd,
        at: &XskPosition,
        more: &mut impl Iterator<Item = OwnedFd>,
    ) -> Result<Xsk, String> {
        let len = (at.frames * FRAME_SIZE) as usize;
        let opts = MapOptions {
            populate: true,
            ..MapOptions::default()
        };
        let umem = Mapping::shared(umem_fd.as_fd(), len, opts)
            .map_err(|e| explain("cannot map the lent UMEM", e))?;
        let [fill, comp, rx, tx] = map_rings(fd.as_fd(), at.ring_size)?;
        let mut steered = Vec::new();
        for &output in &at.steered {
            let fd = more
                .next()
                .ok_or_else(|| format!("queue {}: a steering socket was not lent", at.queue))?;
            steered.push(Steered::map(fd, at.ring_size, output)?);
        }
        Ok(Xsk {
            fd,
            queue: at.queue,
            umem,
            umem_fd,
            frames: at.frames,
            ring_size: at.ring_size,
            fill,
            comp,
            rx,
            tx,
            tx_free: at.tx_free.clone(),
            zero_copy: at.zero_copy,
            steered,
        })
    }

    /// Carries on where the predecessor stopped: its free transmit frames, and each ring's
    /// index on this side as the shared ring words hold it (each was published before the
    /// final word).
    pub(super) fn resume_at(&mut self, at: &XskPosition) {
        self.tx_free = at.tx_free.clone();
        for r in [&mut self.fill, &mut self.tx, &mut self.rx, &mut self.comp] {
            r.resume();
        }
        for s in &mut self.steered {
            s.rx.resume();
        }
    }
}

impl AfXdp {
    /// The program, the sockets and their UMEMs: the successor maps the same rings and
    /// frames and carries on at the indices the rings hold, the XSKMAP pointing at the same
    /// sockets throughout.
    pub(super) fn lend_all(&mut self) -> Option<Descriptors> {
        if !self.retiring.is_empty() || self.lending.iter().any(|l| l.awaiting) {
            return None; // Sockets of removed rules still hold frames for a moment.
        }
        // What the functions gave back goes to the fill ring first: the rings' consumer
        // indices, which the successor starts from, are then where their ports stand.
        self.take_back_from_functions(None);
        let ports = steer_ports(&self.config.steer);
        let read_by_functions = (ports.iter().zip(&self.lending))
            .filter(|(_, l)| {
                (l.offer.as_ref()).is_some_and(|o| o.offer.phase() == stitch_xsk::lend::FUNCTION)
            })
            .map(|(p, _)| p.clone())
            .collect();
        let mut fds = self.xdp.lend().ok()?;
        let mut socks = Vec::new();
        for x in &self.socks {
            let (lent, position) = x.lend().ok()?;
            fds.extend(lent);
            socks.push(position);
        }
        let position = Position {
            native: self.xdp.native,
            socks,
            steer: self.config.steer.clone(),
            read_by_functions,
        };
        Some(Descriptors {
            fds,
            position: serde_json::to_value(position).ok()?,
        })
    }

    pub(super) fn resume_from(&mut self, position: serde_json::Value) -> Result<(), String> {
        let at: Position = serde_json::from_value(position).map_err(|e| e.to_string())?;
        if at.socks.len() != self.socks.len() {
            return Err(format!(
                "af_xdp {}: the predecessor's sockets changed",
                self.interface
            ));
        }
        for (x, s) in self.socks.iter_mut().zip(&at.socks) {
            x.resume_at(s);
        }
        let ports = steer_ports(&self.config.steer);
        for (l, name) in self.lending.iter_mut().zip(&ports) {
            l.awaiting = at.read_by_functions.contains(name);
        }
        self.taken_over_at = Instant::now();
        self.owns = true;
        Ok(())
    }
}
