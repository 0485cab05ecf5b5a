//! A connected device described for a Stitch process taking the port over (`stitch
//! upgrade`), and built again from that description in the new process: the negotiated
//! features, the memory table (its files lent beside it), each ring's set-up, its interrupt
//! eventfd and where it stands. The front-end never sees a message about it.

use super::{Device, Queue};
use crate::memory::GuestMemory;
use crate::message::{Region, VringAddr};
use serde::{Deserialize, Serialize};
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// A connected device, its descriptors aside: in [`Device::lend`]'s order, the connection,
/// the memory regions' files, then the call eventfd of each ring that has one.
#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceState {
    features: u64,
    protocol: u64,
    regions: Vec<Region>,
    queues: Vec<QueueState>,
    announce: Option<[u8; 6]>,
}

#[derive(Debug, Serialize, Deserialize)]
struct QueueState {
    num: u16,
    addr: Option<VringAddr>,
    base: u16,
    started: bool,
    enabled: bool,
    call: bool,
    fault: Option<String>,
    /// The next available entry to take and the next used entry to fill.
    ring: Option<(u16, u16)>,
}

impl Device {
    /// The device's state and duplicates of its descriptors; `None` without a front-end.
    /// Refused while the front-end logs the pages the port writes (a live migration runs).
    pub fn lend(&self) -> Result<Option<(DeviceState, Vec<OwnedFd>)>, String> {
        let Some(connection) = &self.connection else {
            return Ok(None);
        };
        if self.features & super::feature::LOG_ALL != 0 {
            return Err(
                "the guest is migrating (dirty logging is on): upgrade once it is done".into(),
            );
        }
        let dup = |fd: &OwnedFd| {
            fd.try_clone()
                .map_err(|e| format!("duplicating a descriptor: {e}"))
        };
        let mut fds = vec![dup(connection)?];
        let regions = match &self.mem {
            Some(mem) => {
                let (regions, files) = mem.lend().map_err(|e| format!("guest memory: {e}"))?;
                fds.extend(files);
                regions
            }
            None => Vec::new(),
        };
        let mut queues = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            if let Some(call) = &q.call {
                fds.push(dup(call)?);
            }
            queues.push(QueueState {
                num: q.num,
                addr: q.addr,
                base: q.base,
                started: q.started,
                enabled: q.enabled,
                call: q.call.is_some(),
                fault: q.fault.clone(),
                ring: q.ring.as_ref().map(|r| r.position()),
            });
        }
        let state = DeviceState {
            features: self.features,
            protocol: self.protocol,
            regions,
            queues,
            announce: self.announce,
        };
        Ok(Some((state, fds)))
    }

    /// The device a predecessor described, on the descriptors it lent (the connection
    /// first); the rings start where the description says.
    pub fn rebuild(
        state: DeviceState,
        fds: Vec<OwnedFd>,
        queue_pairs: usize,
    ) -> Result<(Device, OwnedFd), String> {
        if state.queues.len() != 2 * queue_pairs {
            return Err(format!(
                "the predecessor's port has {} rings, this one {}",
                state.queues.len(),
                2 * queue_pairs
            ));
        }
        let wanted = 1 + state.regions.len() + state.queues.iter().filter(|q| q.call).count();
        if fds.len() != wanted {
            return Err(format!(
                "{} descriptors lent, {wanted} described",
                fds.len()
            ));
        }
        let mut fds = fds.into_iter();
        let connection = fds.next().ok_or("no connection lent")?;
        let files: Vec<OwnedFd> = fds.by_ref().take(state.regions.len()).collect();
        let mem = match state.regions.is_empty() {
            true => None,
            false => Some(Arc::new(GuestMemory::map(&state.regions, files)?)),
        };
        let mut dev = Device::new(queue_pairs);
        dev.features = state.features;
        dev.protocol = state.protocol;
        dev.announce = state.announce;
        dev.connected = true;
        dev.connection = Some(connection.try_clone().map_err(|e| e.to_string())?);
        dev.mem = mem;
        for (q, s) in dev.queues.iter_mut().zip(state.queues) {
            *q = Queue {
                num: s.num,
                addr: s.addr,
                base: s.base,
                started: s.started,
                enabled: s.enabled,
                call: if s.call { fds.next() } else { None },
                ring: None,
                fault: s.fault,
            };
            if let Some(position) = s.ring {
                q.build(dev.mem.as_ref());
                let ring = q.ring.as_mut().ok_or_else(|| {
                    format!(
                        "a ring could not be mapped again: {}",
                        q.fault.as_deref().unwrap_or("?")
                    )
                })?;
                ring.resume_at(position);
            }
        }
        Ok((dev, connection))
    }

    /// The rings carry on at the predecessor's final positions (described in the same set-up).
    pub fn resume_at(&mut self, last: &DeviceState) -> Result<(), String> {
        for (i, (q, s)) in self.queues.iter_mut().zip(&last.queues).enumerate() {
            match (q.ring.as_mut(), s.ring) {
                (Some(ring), Some(position)) => ring.resume_at(position),
                (None, None) => {}
                _ => return Err(format!("ring {i} was started or stopped meanwhile")),
            }
            q.base = s.base;
        }
        self.announce = last.announce;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{feature, Shared};
    use crate::virtq::tests::{guest, GPA};
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    /// A connected device with one queue pair set up in 1 MiB of guest memory, its rings
    /// moved on to `at`.
    fn device(at: (u16, u16)) -> Device {
        let (mem, _) = guest();
        let mut dev = Device::new(1);
        dev.features = feature::VERSION_1 | feature::NET_MRG_RXBUF;
        dev.mem = Some(mem);
        let (ours, _theirs) = UnixStream::pair().unwrap();
        dev.connection = Some(ours.into());
        dev.connected = true;
        for (i, q) in dev.queues.iter_mut().enumerate() {
            let base = GPA + 0x10000 * (i as u64 + 1);
            q.num = 256;
            q.addr = Some(VringAddr {
                index: i as u32,
                flags: 0,
                desc: base,
                avail: base + 0x1000,
                used: base + 0x2000,
                log: 0,
            });
            q.started = true;
            q.enabled = true;
            q.call = Some(crate::memory::tests::memfd(8));
        }
        let Device { mem, queues, .. } = &mut dev;
        for q in queues.iter_mut() {
            q.build(mem.as_ref());
            q.ring.as_mut().unwrap().resume_at(at);
        }
        dev
    }

    #[test]
    fn a_lent_device_is_built_again_on_the_same_memory_and_ring_positions() {
        let dev = device((7, 5));
        let (state, fds) = dev.lend().unwrap().expect("connected");
        assert_eq!(
            fds.len(),
            1 + 1 + 2,
            "connection, one region, two call eventfds"
        );
        let json = serde_json::to_value(&state).unwrap();
        let state: DeviceState = serde_json::from_value(json).unwrap();
        let (mut again, _connection) = Device::rebuild(state, fds, 1).unwrap();
        assert_eq!(again.features, dev.features);
        for q in &mut again.queues {
            assert_eq!(q.ring.as_ref().unwrap().position(), (7, 5));
            assert!(q.call.is_some());
        }
        // The same memory, mapped twice.
        let ours = dev.mem.as_ref().unwrap().gpa(GPA + 64, 1).unwrap();
        let theirs = again.mem.as_ref().unwrap().gpa(GPA + 64, 1).unwrap();
        // SAFETY: one byte inside both mappings of the test's guest memory.
        unsafe {
            *ours = 0x5a;
            assert_eq!(*theirs, 0x5a);
        }
        // The final word moves the rings on.
        let (last, _) = device((9, 9)).lend().unwrap().unwrap();
        again.resume_at(&last).unwrap();
        assert!(again
            .queues
            .iter()
            .all(|q| q.ring.as_ref().unwrap().position() == (9, 9)));
        // A set-up that does not match is refused, never misread.
        let (state, fds) = dev.lend().unwrap().unwrap();
        let e = Device::rebuild(state, fds, 2).map(|_| ()).unwrap_err();
        assert!(e.contains("2 rings"), "{e}");
    }

    #[test]
    fn a_front_end_back_without_its_index_carries_on_where_its_used_ring_stands() {
        let mut dev = device((0, 0));
        let used = dev.queues[1].addr.unwrap().used;
        let at = dev.mem.as_ref().unwrap().user(used + 2, 2).unwrap();
        // SAFETY: two bytes inside the test's guest memory.
        unsafe { std::ptr::write_volatile(at as *mut u16, 40) };
        // DPDK's virtio-user after a reconnect: base 0, then the kick.
        dev.queues[1].base = 0;
        dev.set_ring_fd(1, crate::message::req::SET_VRING_KICK, None);
        assert_eq!(dev.queues[1].ring.as_ref().unwrap().position(), (40, 40));
        // A ring whose used index is where the front-end says starts there.
        dev.set_ring_fd(0, crate::message::req::SET_VRING_KICK, None);
        assert_eq!(dev.queues[0].ring.as_ref().unwrap().position(), (0, 0));
    }

    #[test]
    fn a_migrating_guest_is_not_lent() {
        let mut dev = device((0, 0));
        dev.features |= feature::LOG_ALL;
        let e = dev.lend().map(|_| ()).unwrap_err();
        assert!(e.contains("migrating"), "{e}");
        assert!(
            Device::new(1).lend().unwrap().is_none(),
            "nothing connected"
        );
    }

    #[test]
    fn hold_waits_for_the_message_being_handled_and_no_longer_than_its_patience() {
        let shared = std::sync::Arc::new(Shared::new("p", 1, 0));
        assert!(shared.hold(Duration::from_millis(100)), "idle");
        shared
            .paused
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let (held, release) = std::sync::mpsc::channel();
        let busy = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let _serving = shared.serving.lock().unwrap();
                held.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(400));
            })
        };
        release.recv().unwrap();
        assert!(
            !shared.hold(Duration::from_millis(50)),
            "in the middle of a message"
        );
        busy.join().unwrap();
        assert!(shared.hold(Duration::from_millis(50)));
    }
}
