//! Direct channels of a function in a VM: the channel's memory is hot-plugged into the guest
//! ([`crate::guest`]) on a thread of its own — QEMU and the guest take milliseconds, which a
//! worker does not wait — and the message naming the device is sent once it is there. The
//! port counts that message in the region's `control` word at its next breath, or ends the
//! channel if QEMU refused. A retired channel's device is given up once the function has said
//! it let the channel go (its flag at 2): a device taken from under a function that still maps
//! it would fault (SIGBUS). One whose function left first is swept at the guest's next hello.
//! A channel that was handed over leaves its device plugged a while
//! ([`crate::direct::SPARE_KEPT`]): the pair's next channel reuses it, told at once.

use crate::direct::{send_control, Direct, PortShared, Spare};
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
    /// Its device's name in the guest.
    id: String,
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
        if let Some(device) = d.take_guest_device(outgoing) {
            self.reuse(device, conn, d, outgoing, port);
            return Ok(());
        }
        let (memory, conn) = (d.memfd().try_clone()?, conn.try_clone()?);
        let bytes = d.bytes();
        let (bus, port) = (bus.clone(), port.clone());
        let id = format!(
            "{}ch{}-{}",
            guest::attachment_prefix(&port.name, generation),
            NEXT.fetch_add(1, Ordering::Relaxed),
            if outgoing { "tx" } else { "rx" }
        );
        let id_kept = id.clone();
        let outcome = Arc::new(Mutex::new(Outcome::Plugging));
        let result = outcome.clone();
        std::thread::Builder::new()
            .name("stitch-nf-plug".into())
            .spawn(move || {
                let told = plug_and_tell(&bus, &id, &memory, bytes, &conn, outgoing);
                *result.lock().unwrap() = match told {
                    Ok(pci) => Outcome::Sent(Plugged { bus, id, pci }),
                    Err(e) => {
                        port.guest_plug_refusals.fetch_add(1, Ordering::Relaxed);
                        Outcome::Refused(e)
                    }
                };
                port.changed.store(true, Ordering::Release);
            })?;
        self.0.push(GuestChannel {
            direct: d.clone(),
            id: id_kept,
            outgoing,
            outcome,
            retired: false,
        });
        Ok(())
    }

    /// Tells the function of channel `d` on the device of the pair's last channel, still
    /// plugged (no thread: nothing waits for QEMU).
    fn reuse(
        &mut self,
        device: Plugged,
        conn: &OwnedFd,
        d: &Arc<Direct>,
        outgoing: bool,
        port: &PortShared,
    ) {
        let id = device.id.clone();
        let outcome = match tell(conn, &device.pci, d.bytes(), outgoing) {
            Ok(()) => Outcome::Sent(device),
            Err(e) => {
                device.unplug();
                Outcome::Refused(e)
            }
        };
        port.changed.store(true, Ordering::Release);
        self.0.push(GuestChannel {
            direct: d.clone(),
            id,
            outgoing,
            outcome: Arc::new(Mutex::new(outcome)),
            retired: false,
        });
    }

    /// Channel `d` retired: its device goes once the function let it go.
    pub fn retire(&mut self, d: &Arc<Direct>) {
        for c in self.0.iter_mut().filter(|c| Arc::ptr_eq(&c.direct, d)) {
            c.retired = true;
        }
    }

    /// Counts the messages sent, takes the refusals, and gives up the devices of retired
    /// channels the function let go: kept as `port`'s spares when the channel ran between two
    /// guests, unplugged otherwise.
    pub fn tend(&mut self, port: &PortShared) -> Tended {
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
                    let d = &c.direct;
                    if d.was_handed_over() {
                        port.keep_spare(Spare::kept(d.clone(), device), c.outgoing);
                    } else {
                        device.unplug();
                    }
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

    /// Whether a message is on its way, or sent and not yet counted in `control`.
    pub fn unsettled(&self) -> bool {
        self.0.iter().any(|c| {
            let o = c.outcome.lock().unwrap();
            matches!(*o, Outcome::Plugging | Outcome::Sent(_))
        })
    }

    /// The names of its channels' devices (plugged, or being plugged).
    pub fn devices(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|c| c.id.as_str())
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
) -> Result<String, String> {
    let pci = guest::plug_memory(bus.as_ref(), id, memory.as_fd(), bytes)?;
    if let Err(e) = tell(conn, &pci, bytes, outgoing) {
        // Plugged but never told: the device goes again.
        let _ = bus.unplug(id);
        return Err(e);
    }
    Ok(pci)
}

/// Sends the function the message naming its channel's device.
fn tell(conn: &OwnedFd, pci: &str, bytes: usize, outgoing: bool) -> Result<(), String> {
    let message = json!({
        "direct": if outgoing { "send" } else { "receive" },
        "pci": pci,
        "bytes": bytes,
    });
    send_control(conn, &message, &[]).map_err(|e| format!("cannot tell the function: {e}"))
}
