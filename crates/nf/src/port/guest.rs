//! Direct channels of a function in a VM: the channel's memory is hot-plugged into the guest
//! ([`crate::guest`]) on a thread of its own — QEMU and the guest take milliseconds, which a
//! worker does not wait — and the message naming the device is sent once it is there. The
//! port counts that message in the region's `control` word at its next tick, or ends the
//! channel if QEMU refused. A retired channel's device is unplugged once the function has said
//! it let the channel go (its flag at 2): a device taken from under a function that still maps
//! it would fault (SIGBUS). One whose function left first is swept at the guest's next hello.

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
    /// Counted: the function reads the message.
    Counted(Plugged),
    Refused(String),
    /// Refused, and said so to the port.
    Gone,
}

/// One direct channel on its way into (or in, or out of) a port's guest.
struct GuestChannel {
    direct: Arc<Direct>,
    outgoing: bool,
    outcome: Arc<Mutex<Outcome>>,
    /// The channel retired: its device goes once the function let it go.
    retired: bool,
}

/// The direct channels plugged into one attachment's guest.
#[derive(Default)]
pub(super) struct GuestChannels(Vec<GuestChannel>);

/// What [`GuestChannels::tend`] found.
#[derive(Default)]
pub(super) struct Tended {
    /// Messages sent to the function since the last call: the `control` word moves this much.
    pub told: u32,
    /// Channels QEMU refused, with why: to be ended.
    pub refused: Vec<(Arc<Direct>, String)>,
}

impl GuestChannels {
    /// Plugs `d` into the guest on `bus` and then tells the function of attachment
    /// `generation` on `conn` (the sending end when `outgoing`); `port` hears when it is done.
    pub fn start(
        &mut self,
        bus: &Arc<dyn GuestBus>,
        (conn, generation): (&OwnedFd, u64),
        d: &Arc<Direct>,
        outgoing: bool,
        port: &Arc<PortShared>,
    ) -> std::io::Result<()> {
        let (memory, conn) = (d.memfd.try_clone()?, conn.try_clone()?);
        let bytes = d.bytes();
        let (bus, port) = (bus.clone(), port.clone());
        let id = format!(
            "{}ch{}-{}",
            guest::attachment_prefix(&port.name, generation),
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
                    Ok(()) => Outcome::Sent(Plugged { bus, id }),
                    Err(e) => {
                        port.guest_plug_refusals.fetch_add(1, Ordering::Relaxed);
                        Outcome::Refused(e)
                    }
                };
                port.changed.store(true, Ordering::Release);
            })?;
        self.0.push(GuestChannel {
            direct: d.clone(),
            outgoing,
            outcome,
            retired: false,
        });
        Ok(())
    }

    /// Channel `d` retired: its device goes once the function let it go.
    pub fn retire(&mut self, d: &Arc<Direct>) {
        for c in self.0.iter_mut().filter(|c| Arc::ptr_eq(&c.direct, d)) {
            c.retired = true;
        }
    }

    /// Counts the messages sent, takes the refusals, and unplugs the devices of retired
    /// channels the function let go.
    pub fn tend(&mut self) -> Tended {
        let mut t = Tended::default();
        self.0.retain_mut(|c| {
            let mut o = c.outcome.lock().unwrap();
            match std::mem::replace(&mut *o, Outcome::Gone) {
                Outcome::Sent(device) => {
                    t.told += 1;
                    *o = Outcome::Counted(device);
                }
                Outcome::Refused(e) => {
                    if !c.retired {
                        t.refused.push((c.direct.clone(), e));
                    }
                    return false;
                }
                other => *o = other,
            }
            let h = c.direct.header();
            let flag = if c.outgoing { &h.sender } else { &h.receiver };
            let let_go = flag.0.load(Ordering::Acquire) >= 2;
            if !(c.retired && let_go) {
                return true;
            }
            match std::mem::replace(&mut *o, Outcome::Gone) {
                Outcome::Counted(device) => {
                    device.unplug();
                    false
                }
                // Still being plugged: its message comes, the function lets it go again.
                other => {
                    *o = other;
                    true
                }
            }
        });
        t
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
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
