//! A function port handed to a Stitch process taking over (`stitch upgrade`): the function
//! stays attached and never sees its connection close. This process lends the attach
//! socket, the function's connection, its region and its doorbell; the successor maps the
//! same region and carries on at the ring indices where this process stopped. The engine
//! pulls the port until the function has given every packet back
//! ([`stitch_core::App::outstanding`]), so nothing of this process's packet memory is left
//! with it; a zero-copy function then gets the successor's packet memory (a `pool` control
//! message) before its first packet. In a guest that memory is hot-plugged while the take-over
//! is prepared (QEMU refusing it fails the take-over, and the predecessor carries on), named to
//! the function at the final word, and the predecessor's goes once the function has taken the
//! message.

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
    /// In a guest: the devices this process leaves there that the function does not use
    /// (direct channels'), and those it does as it was told of them (with their names).
    #[serde(default)]
    guest_unused: Vec<String>,
    #[serde(default)]
    guest_devices: serde_json::Value,
    /// A message was still on its way to a function in a guest (this process's packet
    /// memory, a direct channel being plugged): the successor could not count it.
    #[serde(default)]
    settling: bool,
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
                    guest_devices: a.att.guest_devices.clone(),
                    guest_unused: self.unused_in_guest(a),
                    settling: a.pool_unsent
                        || a.left_in_guest.is_some()
                        || a.guest_channels.unsettled(),
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
            guest_devices: at.guest_devices.clone(),
        };
        let mut a = Active::new(att, s.zero_copy);
        a.resume_at(&at);
        if let Some(bus) = a.att.guest.as_ref().filter(|_| s.zero_copy) {
            let pool = UntoldPool::plug(bus, &name, generation).map_err(|e| {
                format!(
                    "function port `{name}`: this process's packet memory cannot be plugged \
                     into the function's guest: {e}"
                )
            })?;
            a.pool_untold = Some(pool);
        }
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
        if at.settling {
            return Err(format!(
                "function port `{name}`: a message was still on its way to its function in a \
                 guest (packet memory or a direct channel being plugged); upgrade again"
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
        if let Some(bus) = &a.att.guest {
            // In zero-copy mode the predecessor's packet memory goes too.
            let pool = at.guest_devices["pool"]["id"]
                .as_str()
                .filter(|_| a.pool_unsent);
            let left = (at.guest_unused.iter().map(String::as_str))
                .chain(pool)
                .map(|id| crate::guest::Plugged {
                    bus: bus.clone(),
                    id: id.to_string(),
                    pci: String::new(),
                })
                .collect();
            // Going once the function maps this process's packet memory, its next message
            // (isolated: at the next tick, nothing it maps is among them).
            a.left_in_guest = Some((left, at.control_sent.wrapping_add(1)));
        }
        if let Some(st) = steering {
            // The interface takes its rings on from the offer it finds here.
            *self.shared.steer.lock().unwrap() = Some(st.offer.clone());
            a.steering = Some(st);
        }
        // The first breath sends the packet memory (`send_pool`), once this process runs.
        self.shared.changed.store(true, Ordering::Release);
        Ok(())
    }

    /// What this process leaves in the guest of `a` that the successor knows nothing of: its
    /// direct channels' devices, spare or still plugged (the channels themselves retired
    /// before a take-over, or it fails).
    fn unused_in_guest(&self, a: &Active) -> Vec<String> {
        if a.att.guest.is_none() {
            return Vec::new();
        }
        let spares = self.shared.spares.lock().unwrap();
        let kept = [&spares.outgoing, &spares.incoming];
        (kept.into_iter().flatten().map(|s| s.device.id.as_str()))
            .chain(a.guest_channels.devices())
            .map(str::to_string)
            .collect()
    }

    /// Gives a zero-copy function taken over from a predecessor this process's packet
    /// memory, before the first descriptor that names it (in a guest: the device plugged while
    /// the take-over was prepared); a function that cannot take it is detached.
    pub(super) fn send_pool(&mut self) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        a.pool_unsent = false;
        match a.pool_untold.take() {
            Some(untold) => {
                let (id, pci) = untold.told();
                let pool = &mut a.att.guest_devices["pool"];
                pool["id"] = id.into();
                pool["pci"] = pci.as_str().into();
                self.tell_pool(Some(pci), &[]);
            }
            None => {
                let pool = stitch_core::pool::get();
                self.tell_pool(None, &[pool.memfd()]);
            }
        }
    }

    /// Unplugs what a predecessor left in the guest once the function has taken the message
    /// that replaced it.
    pub(super) fn unplug_left_in_guest(&mut self) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        let Some((_, after)) = &a.left_in_guest else {
            return;
        };
        let taken = a.att.header().control_taken.0.load(Ordering::Acquire);
        // Wrapping counts: taken is at or past `after` when less than half the space behind.
        let replaced = self.shared.settings.zero_copy;
        if replaced && (taken.wrapping_sub(*after) >= u32::MAX / 2 || a.pool_unsent) {
            return;
        }
        let (left, _) = a.left_in_guest.take().expect("checked");
        left.into_iter().for_each(crate::guest::Plugged::unplug);
    }

    /// Sends the `pool` message: the memfd in `fds` to a process, or `pci` to a guest.
    fn tell_pool(&mut self, pci: Option<String>, fds: &[std::os::fd::RawFd]) {
        let Some(a) = self.active.as_mut() else {
            return;
        };
        let pool = stitch_core::pool::get();
        let (_, bytes) = pool.region();
        let mut message = serde_json::json!({ "pool": {
            "bytes": bytes,
            "stride": pool.stride(),
            "header": stitch_core::packet::HEADER_SIZE,
        }});
        if let Some(pci) = pci {
            message["pool"]["pci"] = pci.into();
        }
        if let Err(e) = direct::send_control(&a.att.conn, &message, fds) {
            log::warn!(
                "function port `{}`: the function (pid {}) could not be given this process's \
                 packet memory: {e}; detaching it",
                self.shared.name,
                a.att.pid
            );
            self.cut_off();
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

/// This process's packet memory, plugged into the guest of a function taken over while the
/// take-over is prepared, not yet named to the function: unplugged again if it never is (the
/// take-over failed, and this process is ending: at once, not on a thread).
pub(super) struct UntoldPool(Option<crate::guest::Plugged>);

impl UntoldPool {
    /// Plugs this process's packet memory into the guest on `bus` for attachment `generation`
    /// of `port`.
    fn plug(
        bus: &Arc<dyn crate::guest::GuestBus>,
        port: &str,
        generation: u64,
    ) -> Result<UntoldPool, String> {
        let (memory, bytes) = crate::guest::pool_memory();
        let id = crate::guest::device_id(port, generation, "pool");
        let pci = crate::guest::plug_memory(bus.as_ref(), &id, memory, bytes)?;
        let bus = bus.clone();
        Ok(UntoldPool(Some(crate::guest::Plugged { bus, id, pci })))
    }

    /// Named to the function: its name and PCI address.
    fn told(mut self) -> (String, String) {
        let p = self.0.take().expect("plugged");
        (p.id, p.pci)
    }
}

impl Drop for UntoldPool {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            if let Err(e) = p.bus.unplug(&p.id) {
                log::warn!("cannot unplug {} from its guest: {e}", p.id);
            }
        }
    }
}
