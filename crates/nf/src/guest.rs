//! Functions in virtual machines (the inter-VNF bypass over ivshmem, docs/references.md): a
//! function built on this library runs in a guest unchanged. It reaches Stitch's attach socket
//! through a virtio-serial port of its VM (QEMU's chardev connects to the socket), says the same
//! hello with `"transport": "ivshmem"`, and gets no descriptors: the memory they would carry is
//! hot-plugged into the guest as `ivshmem-plain` PCI devices ([`GuestBus`]), and the answer names
//! their PCI addresses. The function maps each device's BAR 2
//! (`/sys/bus/pci/devices/ADDR/resource2`) where a process on the host maps the memfd, and polls
//! its rings (a guest has no eventfd of Stitch's).

use crate::shm::Mapping;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The virtio-serial port of a guest whose function is served by Stitch is named this, then
/// the port's name (QEMU's `virtserialport,name=…`; the guest sees it under
/// `/sys/class/virtio-ports/*/name`).
pub const SERIAL_PREFIX: &str = "org.stitch.nf.";

/// The hello's `transport` of a function in a guest.
pub const TRANSPORT: &str = "ivshmem";

/// What puts shared memory into one guest and takes it out again: its QEMU, over QMP
/// (`stitch-place` provides it for each VM it runs).
pub trait GuestBus: Send + Sync {
    /// Hot-plugs the first `bytes` (a power of two, as a PCI BAR must be) of `memory` into
    /// the guest as an `ivshmem-plain` device named `id`; its PCI address as the guest's sysfs
    /// names it (`0000:00:05.0`), or why QEMU refused.
    fn plug(&self, id: &str, memory: BorrowedFd<'_>, bytes: usize) -> Result<String, String>;

    /// Removes device `id` and its memory (the guest acknowledges the removal; this waits
    /// for it, a few seconds at most).
    fn unplug(&self, id: &str) -> Result<(), String>;

    /// Removes every device and memory of Stitch's ([`DEVICE_PREFIX`]) whose name does not
    /// start with `keep`; the ids removed. One that will not go is left (and said in the
    /// error) while the rest go on.
    fn sweep(&self, keep: &str) -> Result<Vec<String>, String>;
}

/// Every device and memory Stitch plugs into a guest is named with this first.
pub const DEVICE_PREFIX: &str = "stitch-ivshmem-";

/// What the names of the devices of one attachment (`generation`) of `port` start with: the
/// process id in them, so that no process reuses a name a predecessor left.
pub fn attachment_prefix(port: &str, generation: u64) -> String {
    format!("{DEVICE_PREFIX}{}-{port}-{generation}-", std::process::id())
}

/// The name of the device holding `what` (`region`, `pool`) of attachment `generation` of
/// `port`, plugged by this process.
pub fn device_id(port: &str, generation: u64, what: &str) -> String {
    format!("{}{what}", attachment_prefix(port, generation))
}

/// Whether `id` is a device or memory Stitch plugged whose name does not start with `keep`.
pub fn swept(id: &str, keep: &str) -> bool {
    id.starts_with(DEVICE_PREFIX) && !id.starts_with(keep)
}

/// Sweeps the guest on `bus` of Stitch's devices but those named with `keep` first, on a
/// thread of its own. Called at a guest's hello: whatever an earlier attachment — of this
/// process or of one that ended (killed, upgraded, or the port left the graph while the VM ran)
/// — left there is no longer used by anyone, as the function that used it is gone.
pub(crate) fn sweep(bus: &Arc<dyn GuestBus>, keep: String) {
    let bus = bus.clone();
    let spawned = std::thread::Builder::new()
        .name("stitch-nf-sweep".into())
        .spawn(move || match bus.sweep(&keep) {
            Ok(gone) if gone.is_empty() => {}
            Ok(gone) => log::info!(
                "removed from a guest what its function's last attachment left: {gone:?}"
            ),
            Err(e) => log::warn!(
                "cannot remove from a guest what its function's last attachment left: {e}"
            ),
        });
    if let Err(e) = spawned {
        log::warn!("cannot sweep a guest: {e}");
    }
}

fn buses() -> &'static Mutex<HashMap<PathBuf, Arc<dyn GuestBus>>> {
    static B: OnceLock<Mutex<HashMap<PathBuf, Arc<dyn GuestBus>>>> = OnceLock::new();
    B.get_or_init(Default::default)
}

/// Makes `bus` the way into the guest whose function attaches on `socket` (one socket per VM,
/// so a guest can only ask for its own port).
pub fn offer_bus(socket: &Path, bus: Arc<dyn GuestBus>) {
    buses().lock().unwrap().insert(socket.to_path_buf(), bus);
}

/// Forgets the guest of `socket` (its VM left the graph).
pub fn withdraw_bus(socket: &Path) {
    buses().lock().unwrap().remove(socket);
}

pub(crate) fn bus(socket: &Path) -> Option<Arc<dyn GuestBus>> {
    buses().lock().unwrap().get(socket).cloned()
}

/// A device plugged into a guest, unplugged only when asked: a device is never taken from
/// under a function that may still touch it (its pages would fault, SIGBUS) — one left when
/// its process ends or its function goes is swept at the guest's next hello.
pub(crate) struct Plugged {
    pub bus: Arc<dyn GuestBus>,
    pub id: String,
    /// Where the guest finds it.
    pub pci: String,
}

impl Plugged {
    /// Unplugs it on a thread of its own: the guest takes its time to acknowledge, and nothing
    /// waits for it.
    pub fn unplug(self) {
        let spawned = std::thread::Builder::new()
            .name("stitch-nf-unplug".into())
            .spawn(move || match self.bus.unplug(&self.id) {
                Ok(()) => log::info!("unplugged {} from its guest", self.id),
                Err(e) => log::warn!("cannot unplug {} from its guest: {e}", self.id),
            });
        if let Err(e) = spawned {
            log::warn!("cannot unplug a guest's device: {e}");
        }
    }
}

/// The size of a BAR holding `bytes`: the next power of two, a page at least.
pub fn bar_size(bytes: usize) -> usize {
    bytes.max(4096).next_power_of_two()
}

/// Plugs the first `bytes` of `memory` into the guest on `bus` as device `id`, its file grown
/// to a BAR's size first; the device's PCI address.
pub(crate) fn plug_memory(
    bus: &dyn GuestBus,
    id: &str,
    memory: BorrowedFd<'_>,
    bytes: usize,
) -> Result<String, String> {
    let bar = bar_size(bytes);
    grow_to(memory, bar)?;
    bus.plug(id, memory, bar)
}

/// This process's packet memory and its size, to plug into a guest.
pub(crate) fn pool_memory() -> (BorrowedFd<'static>, usize) {
    let pool = stitch_core::pool::get();
    let (_, bytes) = pool.region();
    // SAFETY: the pool's memfd lives as long as the process (the pool is never freed).
    (unsafe { BorrowedFd::borrow_raw(pool.memfd()) }, bytes)
}

/// Makes the file behind `fd` at least `bytes` long (a BAR's power of two; the pages past
/// what Stitch uses are never touched, so cost nothing).
fn grow_to(fd: BorrowedFd<'_>, bytes: usize) -> Result<(), String> {
    let grow = || -> io::Result<()> {
        let file = std::fs::File::from(fd.try_clone_to_owned()?);
        if (file.metadata()?.len() as usize) < bytes {
            file.set_len(bytes as u64)?;
        }
        Ok(())
    };
    grow().map_err(|e| format!("cannot grow the memory to {bytes} bytes: {e}"))
}

/// Where a guest maps the device at PCI address `addr`.
pub fn bar_path(addr: &str) -> PathBuf {
    Path::new("/sys/bus/pci/devices")
        .join(addr)
        .join("resource2")
}

/// Whether `addr` is a PCI address as sysfs names one (`DDDD:BB:SS.F`, hexadecimal): what a
/// guest maps must not be a path Stitch's answer made up.
pub fn is_pci_address(addr: &str) -> bool {
    let b = addr.as_bytes();
    b.len() == 12
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b':',
            10 => *c == b'.',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Maps the first `bytes` of BAR 2 of the ivshmem device at `addr`, in a guest: waits up to
/// `within` for the guest's kernel to show the device Stitch just had plugged, and turns its
/// memory decoding on (sysfs `enable`: no driver claims an ivshmem device).
pub fn map_bar(addr: &str, bytes: usize, within: Duration) -> io::Result<Mapping> {
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    if !is_pci_address(addr) {
        return Err(invalid(format!("Stitch named `{addr}`, not a PCI address")));
    }
    let bar = bar_path(addr);
    let deadline = Instant::now() + within;
    while !bar.exists() {
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the device Stitch plugged at {addr} did not appear in {} s: does this \
                     kernel do ACPI PCI hot-plug (CONFIG_HOTPLUG_PCI_ACPI)?",
                    within.as_secs()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let dir = bar.parent().expect("a device folder");
    std::fs::write(dir.join("enable"), "1")
        .map_err(|e| io::Error::new(e.kind(), format!("cannot enable {addr}: {e}")))?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&bar)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", bar.display())))?;
    let len = file.metadata()?.len() as usize;
    if len < bytes {
        return Err(invalid(format!(
            "the device at {addr} holds {len} bytes, Stitch said {bytes}"
        )));
    }
    crate::shm::map(file.as_fd(), bytes, false)
}

/// The virtio-serial device of this guest's function port and the port's name, if the VM has
/// one (`/sys/class/virtio-ports/vportNpM/name` = `org.stitch.nf.PORT`).
pub fn serial_port() -> Option<(PathBuf, String)> {
    for e in std::fs::read_dir("/sys/class/virtio-ports").ok()?.flatten() {
        let name = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if let Some(port) = name.trim().strip_prefix(SERIAL_PREFIX) {
            return Some((Path::new("/dev").join(e.file_name()), port.to_string()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_is_a_power_of_two_a_page_at_least() {
        assert_eq!(bar_size(1), 4096);
        assert_eq!(bar_size(4096), 4096);
        assert_eq!(bar_size(4097), 8192);
        assert_eq!(bar_size(675 << 20), 1 << 30);
    }

    #[test]
    fn a_sweep_takes_what_earlier_attachments_plugged_and_nothing_else() {
        let keep = attachment_prefix("vm1", 12);
        let mine = format!("{keep}region");
        assert!(!swept(&mine, &keep) && !swept(&format!("{mine}-mem"), &keep));
        assert!(!swept(&format!("{keep}ch3-tx"), &keep));
        assert!(swept(
            &format!("{}region", attachment_prefix("vm1", 11)),
            &keep
        ));
        assert!(swept("stitch-ivshmem-1-vm1-12-region", &keep));
        // The VM's own devices, named by the placement.
        assert!(!swept("stitch-serial", &keep) && !swept("mem", &keep));
    }

    #[test]
    fn only_a_pci_address_names_a_device() {
        assert!(is_pci_address("0000:00:05.0"));
        assert!(is_pci_address("0000:00:1f.7"));
        assert!(!is_pci_address("../../../../etc"));
        assert!(!is_pci_address("0000:00:05.0/x"));
        assert!(!is_pci_address("0000-00:05.0"));
    }
}
