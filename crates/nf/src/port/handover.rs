//! A function port handed to a Stitch process taking over (`stitch upgrade`): the function
//! stays attached and never sees its connection close. This process lends the attach
//! socket, the function's connection, its region and its doorbell; the successor maps the
//! same region and carries on at the ring indices where this process stopped. The engine
//! pulls the port until the function has given every packet back
//! ([`stitch_core::App::outstanding`]), so nothing of this process's packet memory is left
//! with it; a zero-copy function then gets the successor's packet memory (a `pool` control
//! message) before its first packet.

use super::{rings, Active, NfPort};
use crate::attachment::Attachment;
use crate::direct::{self, Current};
use crate::listener;
use crate::shm::{Consumer, Layout, Producer};
use serde::{Deserialize, Serialize};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_core::Descriptors;

/// Where a port stands when it is lent, and again when its workers are parked.
#[derive(Debug, Serialize, Deserialize)]
struct Position {
    attached: Option<Attached>,
}

/// The function attached to the port, and where the two rings stand.
#[derive(Debug, Serialize, Deserialize)]
struct Attached {
    /// This attachment's number in the lending process: a function that left and attached
    /// again between the loan and the final word is another attachment.
    generation: u64,
    pid: i32,
    to_nf_head: u32,
    from_nf_tail: u32,
    control_sent: u32,
    /// Packets the function had not given back.
    held: u64,
    /// A direct channel (switch bypass) was up.
    direct: bool,
    /// The function reads an interface's rings (steered input): where it stands.
    #[serde(default)]
    steering: Option<crate::steer::SteeringAt>,
    /// The function runs in a VM: its connection is its QEMU's, its region plugged there.
    #[serde(default)]
    in_guest: bool,
}

/// Offers the attach socket a predecessor lent (the first descriptor) to the listener of
/// `path`; the rest of `lent` is the attached function's, if any.
pub(super) fn lend_socket(path: &Path, mut lent: Descriptors) -> Descriptors {
    if !lent.fds.is_empty() {
        listener::inherit_socket(path, lent.fds.remove(0));
    }
    lent
}

impl NfPort {
    /// The attach socket and, with a function attached, its connection, region and doorbell.
    pub(super) fn lend(&mut self) -> Option<Descriptors> {
        let mut fds = vec![self.listener.socket().ok()?];
        let attached = match &self.active {
            None => None,
            // A zero-copy guest's function is not lent: the successor's packet memory would
            // have to be plugged into its guest before the first packet. Its QEMU connects to
            // the next process, and the function says its hello there again.
            Some(a) if a.att.guest.is_some() && self.shared.settings.zero_copy => None,
            Some(a) => {
                fds.push(a.att.conn.try_clone().ok()?);
                fds.push(a.att.memfd.try_clone().ok()?);
                fds.push(a.att.doorbell.try_clone().ok()?);
                if let Some(st) = &a.steering {
                    fds.extend(st.lend().ok()?);
                }
                Some(Attached {
                    generation: a.att.generation,
                    pid: a.att.pid,
                    to_nf_head: a.to_nf.position(),
                    from_nf_tail: a.from_nf.position(),
                    control_sent: a.control_sent,
                    held: a.held.lock().count(),
                    direct: a.outgoing.is_some() || a.incoming.is_some(),
                    steering: a.steering.as_ref().map(|st| st.position()),
                    in_guest: a.att.guest.is_some(),
                })
            }
        };
        let direct = !self.leaving.is_empty();
        let attached = attached.map(|a| Attached {
            direct: a.direct || direct,
            ..a
        });
        Some(Descriptors {
            fds,
            position: serde_json::to_value(Position { attached }).ok()?,
        })
    }

    /// Serves the function attached in the predecessor (what `lend` gave, the attach socket
    /// already taken) on its region, at the lent position until [`NfPort::resume`].
    pub(super) fn adopt(&mut self, lent: Descriptors) -> Result<(), String> {
        let name = self.shared.name.clone();
        let position: Position = serde_json::from_value(lent.position)
            .map_err(|e| format!("function port `{name}`: lent position: {e}"))?;
        let Some(at) = position.attached else {
            return Ok(());
        };
        let mut fds = lent.fds.into_iter();
        let (Some(conn), Some(memfd), Some(doorbell)) = (fds.next(), fds.next(), fds.next()) else {
            return Err(format!(
                "function port `{name}`: the function's descriptors were not lent"
            ));
        };
        let s = self.shared.settings;
        let layout = Layout::new(
            s.ring_size,
            if s.zero_copy { 0 } else { s.buffers },
            s.buffer_size,
        );
        let region = crate::shm::map(
            memfd.as_fd(),
            layout.size,
            layout.size <= crate::shm::POPULATE_MAX,
        )
        .map_err(|e| format!("function port `{name}`: cannot map its region: {e}"))?;
        {
            use crate::shm::Region;
            let header = region.header().ok_or("region smaller than its header")?;
            let theirs = Layout::read(header, layout.size).map_err(|e| {
                format!("function port `{name}`: the attached function's region: {e}")
            })?;
            if theirs != layout {
                return Err(format!(
                    "function port `{name}`: the attached function's region is laid out for \
                     other settings ({theirs:?}, here {layout:?})"
                ));
            }
        }
        let watched = UnixStream::from(
            conn.try_clone()
                .map_err(|e| format!("function port `{name}`: {e}"))?,
        );
        // A guest's region stays plugged where it is; this process plugs its channels.
        let guest = match at.in_guest {
            false => None,
            true => Some(crate::guest::bus(self.listener.path()).ok_or_else(|| {
                format!(
                    "function port `{name}`: its function runs in a VM this process does not run"
                )
            })?),
        };
        let generation = listener::next_generation();
        let att = Attachment {
            region,
            memfd,
            layout,
            doorbell: Arc::new(doorbell),
            conn,
            generation,
            pid: at.pid,
            lost_before: None,
            guest,
        };
        let mut a = Active::new(att, s.zero_copy);
        a.resume_at(&at);
        // The steered input's descriptors, for `resume` (where it stands is in the final word).
        self.lent_steering = fds.collect();
        *self.shared.current.lock().unwrap() = Some(Current {
            generation,
            held: a.held.clone(),
            doorbell: a.att.doorbell.clone(),
            blocking: s.blocking,
            in_guest: at.in_guest,
        });
        self.shared.busy.store(true, Ordering::Release);
        self.listener
            .adopt(watched, &self.shared, generation, at.in_guest);
        self.active = Some(a);
        self.lent_generation = Some(at.generation);
        self.attached.set(1);
        Ok(())
    }

    /// The predecessor's final position: the function must be the one lent, with every
    /// packet given back and no direct channel up; else the take-over fails and the
    /// predecessor carries on.
    pub(super) fn resume(&mut self, position: serde_json::Value) -> Result<(), String> {
        let name = self.shared.name.clone();
        let position: Position = serde_json::from_value(position)
            .map_err(|e| format!("function port `{name}`: position: {e}"))?;
        let again = || {
            format!(
                "function port `{name}`: a function attached while the upgrade was prepared; \
                 upgrade again"
            )
        };
        let Some(at) = position.attached else {
            // It left meanwhile: its connection closed, which this process sees too.
            return Ok(());
        };
        if self.lent_generation != Some(at.generation) {
            return Err(again());
        }
        if at.direct {
            return Err(format!(
                "function port `{name}`: a direct channel (switch bypass) is up, which cannot \
                 be handed over yet"
            ));
        }
        if at.held > 0 {
            return Err(format!(
                "function port `{name}`: its function (pid {}) kept {} packets past the \
                 hand-over's patience (is it stopped?)",
                at.pid, at.held
            ));
        }
        let steering = match &at.steering {
            None => None,
            Some(st) => {
                let fds = std::mem::take(&mut self.lent_steering);
                if fds.is_empty() {
                    return Err(again());
                }
                let steering = crate::steer::Steering::adopt(st, fds)
                    .map_err(|e| format!("function port `{name}`: steered input: {e}"))?;
                Some(steering)
            }
        };
        let a = self.active.as_mut().ok_or_else(again)?;
        a.resume_at(&at);
        a.pool_unsent = self.shared.settings.zero_copy;
        if let Some(st) = steering {
            // The interface takes its rings on from the offer it finds here.
            *self.shared.steer.lock().unwrap() = Some(st.offer.clone());
            a.steering = Some(st);
        }
        // The first breath sends the packet memory (`send_pool`), once this process runs.
        self.shared.changed.store(true, Ordering::Release);
        Ok(())
    }

    /// Gives a zero-copy function taken over from a predecessor this process's packet
    /// memory, before the first descriptor that names it; a function that cannot take it is
    /// detached.
    pub(super) fn send_pool(&mut self) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        a.pool_unsent = false;
        let pool = stitch_core::pool::get();
        let (_, bytes) = pool.region();
        let message = serde_json::json!({ "pool": {
            "bytes": bytes,
            "stride": pool.stride(),
            "header": stitch_core::packet::HEADER_SIZE,
        }});
        if let Err(e) = direct::send_control(&a.att.conn, &message, &[pool.memfd()]) {
            log::warn!(
                "function port `{}`: the function (pid {}) could not be given this process's \
                 packet memory: {e}; detaching it",
                self.shared.name,
                a.att.pid
            );
            self.detach();
            return;
        }
        a.control_sent += 1;
        a.att
            .header()
            .control
            .0
            .store(a.control_sent, Ordering::Release);
        log::info!(
            "function port `{}`: the function (pid {}) carries on in this process",
            self.shared.name,
            a.att.pid
        );
    }
}

impl Active {
    /// Carries on at `at`'s ring indices, with nothing held.
    fn resume_at(&mut self, at: &Attached) {
        let (to_nf, from_nf) = rings(&self.att);
        self.to_nf = Producer::at(to_nf, at.to_nf_head);
        self.from_nf = Consumer::at(from_nf, at.from_nf_tail);
        self.control_sent = at.control_sent;
    }
}
