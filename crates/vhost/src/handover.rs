//! A `vhost_user` port handed to a Stitch process taking over (`stitch upgrade`): the guest
//! never sees its connection go. This process lends the listening socket, the front-end's
//! connection, the guest memory's files and the rings' interrupt eventfds, with the device's
//! set-up; the successor maps the same memory and carries each ring on where this process
//! stopped. For the final word this process's connection thread is held between two messages
//! (a message that arrives meanwhile waits in the socket for the successor), and the
//! successor's starts reading only once it runs the graph.

use crate::device::handover::DeviceState;
use crate::device::{Device, Shared, Sockets};
use crate::VhostUser;
use serde::{Deserialize, Serialize};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::time::Duration;
use stitch_core::Descriptors;

/// How long the final hand-over waits for the connection thread to finish a message.
pub(crate) const HOLD_PATIENCE: Duration = Duration::from_millis(100);

/// Where a port stands when it is lent, and again when its workers are parked.
#[derive(Debug, Serialize, Deserialize)]
struct Position {
    /// Messages handled and connections begun or ended by the lending process's thread.
    changes: u64,
    /// The thread is held between two messages (the final word only).
    held: bool,
    /// A listening socket is the first descriptor.
    listener: bool,
    /// The connected front-end's device: its descriptors follow the listener's.
    device: Option<DeviceState>,
    /// Why the port cannot be handed over now.
    refused: Option<String>,
}

impl VhostUser {
    /// The listening socket, the connection, the memory and the eventfds, with the set-up.
    pub(crate) fn lend(&mut self) -> Descriptors {
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut position = Position {
            changes: 0,
            held: self.held,
            listener: false,
            device: None,
            refused: None,
        };
        let dev = self.shared.device.lock().unwrap();
        position.changes = self.shared.changes.load(Ordering::SeqCst);
        let lent = (self.listener.as_ref())
            .map(|l| {
                l.try_clone()
                    .map_err(|e| format!("the listening socket: {e}"))
            })
            .transpose()
            .and_then(|listener| Ok((listener, dev.lend()?)));
        match lent {
            Ok((listener, device)) => {
                position.listener = listener.is_some();
                fds.extend(listener);
                if let Some((state, device_fds)) = device {
                    position.device = Some(state);
                    fds.extend(device_fds);
                }
            }
            Err(why) => {
                fds.clear();
                position.refused = Some(why);
            }
        }
        Descriptors {
            fds,
            position: serde_json::to_value(position).unwrap_or_default(),
        }
    }

    /// Carries the port on at the predecessor's final position: the device must be the one
    /// lent (no message handled since) and its thread held; then this process's thread starts
    /// reading the connection.
    pub(crate) fn resume(&mut self, position: serde_json::Value) -> Result<(), String> {
        let last: Position = serde_json::from_value(position).map_err(|e| e.to_string())?;
        if let Some(why) = last.refused {
            return Err(why);
        }
        if !last.held {
            return Err(format!(
                "its front-end was in the middle of a message for {} ms; upgrade again",
                HOLD_PATIENCE.as_millis()
            ));
        }
        if Some(last.changes) != self.lent_changes {
            return Err(
                "its front-end connected, left or sent a message while the upgrade was \
                        prepared; upgrade again"
                    .into(),
            );
        }
        if let Some(state) = &last.device {
            self.shared.device.lock().unwrap().resume_at(state)?;
        }
        self.shared.owns_path.store(true, Ordering::Relaxed);
        self.shared.paused.store(false, Ordering::SeqCst);
        Ok(())
    }
}

/// The sockets and device a predecessor lent for this port (its thread waits, paused, until
/// [`VhostUser::resume`]), and the predecessor's changes when it lent them.
pub(crate) fn adopt(
    shared: &Shared,
    queue_pairs: usize,
    lent: Descriptors,
) -> Result<(Sockets, u64), String> {
    let at: Position =
        serde_json::from_value(lent.position).map_err(|e| format!("lent position: {e}"))?;
    if let Some(why) = at.refused {
        return Err(why);
    }
    let mut fds = lent.fds.into_iter();
    let listener = match at.listener {
        true => Some(UnixListener::from(
            fds.next().ok_or("no listening socket lent")?,
        )),
        false => None,
    };
    let connection = match at.device {
        Some(state) => {
            let (device, connection) = Device::rebuild(state, fds.collect(), queue_pairs)
                .map_err(|e| format!("the lent device: {e}"))?;
            *shared.device.lock().unwrap() = device;
            Some(UnixStream::from(connection))
        }
        None => None,
    };
    shared.paused.store(true, Ordering::SeqCst);
    Ok((
        Sockets {
            listener,
            connection,
        },
        at.changes,
    ))
}
