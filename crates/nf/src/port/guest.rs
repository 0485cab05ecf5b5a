//! Direct channels of a function in a VM: the channel's memory is hot-plugged into the guest
//! ([`crate::guest`]) on a thread of its own — QEMU and the guest take milliseconds, which a
//! worker does not wait — and the message naming the device is sent once it is there. The
//! port counts that message in the region's `control` word at its next breath, or ends the
//! channel if QEMU refused; dropping the channel unplugs its device.

use crate::direct::{send_control, Direct, PortShared};
use crate::guest::{self, GuestBus, Plugged};
use serde_json::json;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

static NEXT: AtomicU64 = AtomicU64::new(1);

enum Outcome {
    Plugging,
    /// Plugged, and the message sent; not yet counted by the port.
    Sent(Plugged),
    /// Counted; the device stays until the channel is dropped.
    Counted {
        _device: Plugged,
    },
    Refused(String),
    Told,
}

/// One direct channel on its way into (or in) a port's guest.
pub(super) struct GuestChannel {
    outcome: Arc<Mutex<Outcome>>,
}

impl GuestChannel {
    /// Plugs `d` into the guest on `bus` and then tells the function on `conn` (the sending
    /// end when `outgoing`); `port` hears when it is done.
    pub fn start(
        bus: &Arc<dyn GuestBus>,
        conn: &OwnedFd,
        d: &Direct,
        outgoing: bool,
        port: &Arc<PortShared>,
    ) -> std::io::Result<GuestChannel> {
        let (memory, conn) = (d.memfd.try_clone()?, conn.try_clone()?);
        let bytes = d.bytes();
        let (bus, port) = (bus.clone(), port.clone());
        let id = format!(
            "stitch-{}-ch{}-{}",
            port.name,
            NEXT.fetch_add(1, Ordering::Relaxed),
            if outgoing { "tx" } else { "rx" }
        );
        let outcome = Arc::new(Mutex::new(Outcome::Plugging));
        let result = outcome.clone();
        std::thread::Builder::new()
            .name("stitch-nf-plug".into())
            .spawn(move || {
                let told = plug_and_tell(&bus, &id, &memory, bytes, &conn, outgoing);
                *result.lock().unwrap() = match told {
                    Ok(()) => Outcome::Sent(Plugged { bus, ids: vec![id] }),
                    Err(e) => {
                        port.guest_plug_refusals.fetch_add(1, Ordering::Relaxed);
                        Outcome::Refused(e)
                    }
                };
                port.changed.store(true, Ordering::Release);
            })?;
        Ok(GuestChannel { outcome })
    }

    /// What became of it since last asked: `Some(Ok)` once the function was told (one more
    /// control message), `Some(Err)` once when QEMU refused.
    pub fn settle(&mut self) -> Option<Result<(), String>> {
        let mut o = self.outcome.lock().unwrap();
        match std::mem::replace(&mut *o, Outcome::Told) {
            Outcome::Sent(p) => {
                *o = Outcome::Counted { _device: p };
                Some(Ok(()))
            }
            Outcome::Refused(e) => Some(Err(e)),
            other => {
                *o = other;
                None
            }
        }
    }
}

fn plug_and_tell(
    bus: &Arc<dyn GuestBus>,
    id: &str,
    memory: &OwnedFd,
    bytes: usize,
    conn: &OwnedFd,
    outgoing: bool,
) -> Result<(), String> {
    let bar = guest::bar_size(bytes);
    guest::grow_to(memory.as_fd(), bar)?;
    let pci = bus.plug(id, memory.as_fd(), bar)?;
    let message = json!({
        "direct": if outgoing { "send" } else { "receive" },
        "pci": pci,
        "bytes": bytes,
    });
    if let Err(e) = send_control(conn, &message, &[]) {
        // Plugged but never told: the device goes again.
        let _ = bus.unplug(id);
        return Err(format!("cannot tell the function: {e}"));
    }
    Ok(())
}
