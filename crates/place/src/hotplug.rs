//! Shared memory hot-plugged into a guest over QMP, for a function in a VM
//! (`rings: ivshmem`, [`stitch_nf::guest`]): a memfd of this process, passed to QEMU over the
//! QMP socket (`add-fd`: QEMU runs as another user, and may not open this process's
//! descriptors), becomes a `memory-backend-file` (`share=on`, opened by QEMU through its own
//! `/proc/self/fd/N`; the passed copy is dropped once the backend holds one) under an
//! `ivshmem-plain` device on the guest's root PCI bus; unplugging asks the guest to let the
//! device go (ACPI), waits until it has, then drops the memory.

use crate::qmp::{Qmp, QmpError};
use serde_json::{json, Value};
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stitch_nf::guest::{swept, GuestBus};

/// How long a QMP command may take.
const PATIENCE: Duration = Duration::from_secs(5);
/// How long a guest has to let a device go.
const UNPLUG_WAIT: Duration = Duration::from_secs(10);

/// The QMP socket of one VM, and the root ports a PCI Express machine got for Stitch's devices
/// (empty: its root bus takes them).
pub struct QmpBus {
    pub qmp: PathBuf,
    pub root_ports: Vec<String>,
}

fn memdev(id: &str) -> String {
    format!("{id}-mem")
}

fn said(e: QmpError) -> String {
    e.to_string()
}

impl QmpBus {
    fn connect(&self) -> Result<Qmp, String> {
        Qmp::connect(&self.qmp, PATIENCE).map_err(said)
    }

    /// `device_add`s `device` on the root bus, or in the first free root port: at its one
    /// slot (a guest looks for nothing else behind a PCI Express port; QEMU would put a second
    /// device at slot 1, where the guest never sees it, so the slot is named and an occupied
    /// port refuses).
    fn add_device(&self, q: &mut Qmp, device: Value) -> Result<Value, QmpError> {
        let mut refused = None;
        for port in &self.root_ports {
            let mut on_port = device.clone();
            on_port["bus"] = port.as_str().into();
            on_port["addr"] = "0".into();
            match q.execute("device_add", Some(on_port)) {
                Ok(v) => return Ok(v),
                Err(e) => refused = Some(e),
            }
        }
        match refused {
            Some(e) => Err(e),
            None => q.execute("device_add", Some(device)),
        }
    }
}

impl GuestBus for QmpBus {
    fn plug(&self, id: &str, memory: BorrowedFd<'_>, bytes: usize) -> Result<String, String> {
        let mut q = self.connect()?;
        let passed =
            (q.execute_passing("add-fd", Some(json!({ "opaque": id })), memory)).map_err(said)?;
        let (Some(fd), Some(set)) = (passed["fd"].as_i64(), passed["fdset-id"].as_i64()) else {
            return Err(format!(
                "QEMU took the memory of {id} and said nothing of it: {passed}"
            ));
        };
        let path = format!("/proc/self/fd/{fd}");
        let added = q.execute(
            "object-add",
            Some(json!({
                "qom-type": "memory-backend-file",
                "id": memdev(id),
                "mem-path": path,
                "size": bytes,
                "share": true,
            })),
        );
        // The backend opened its own descriptor (or failed): the passed one goes either way.
        let _ = q.execute("remove-fd", Some(json!({ "fdset-id": set })));
        added.map_err(said)?;
        let device = json!({ "driver": "ivshmem-plain", "id": id, "memdev": memdev(id) });
        let added = self.add_device(&mut q, device);
        if let Err(e) = added {
            let _ = q.execute("object-del", Some(json!({ "id": memdev(id) })));
            return Err(said(e));
        }
        let pci = q.execute("query-pci", None).map_err(said)?;
        pci_address(&pci, id).ok_or_else(|| format!("QEMU plugged {id} and does not list it"))
    }

    fn unplug(&self, id: &str) -> Result<(), String> {
        let mut q = match Qmp::connect(&self.qmp, PATIENCE) {
            Ok(q) => q,
            // The VM stopped: its devices went with it.
            Err(QmpError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                return Ok(())
            }
            Err(e) => return Err(said(e)),
        };
        unplug_on(&mut q, id)
    }

    fn sweep(&self, keep: &str) -> Result<Vec<String>, String> {
        let mut q = self.connect()?;
        let pci = q.execute("query-pci", None).map_err(said)?;
        let (mut gone, mut failed) = (Vec::new(), Vec::new());
        for id in device_ids(&pci).into_iter().filter(|id| swept(id, keep)) {
            match unplug_on(&mut q, &id) {
                Ok(()) => gone.push(id),
                Err(e) => failed.push(format!("{id}: {e}")),
            }
        }
        // Memory whose device went (or never came): a plug or an unplug cut short.
        let objects = q
            .execute("qom-list", Some(json!({ "path": "/objects" })))
            .map_err(said)?;
        let names = objects.as_array().into_iter().flatten();
        for name in names.filter_map(|o| o["name"].as_str()) {
            if swept(name, keep) && name.ends_with("-mem") {
                match q.execute("object-del", Some(json!({ "id": name }))) {
                    Ok(_) => gone.push(name.to_string()),
                    Err(e) => failed.push(format!("{name}: {e}")),
                }
            }
        }
        if failed.is_empty() {
            Ok(gone)
        } else {
            Err(format!("removed {gone:?}, not {failed:?}"))
        }
    }
}

/// Unplugs device `id` and then its memory, on `q`.
fn unplug_on(q: &mut Qmp, id: &str) -> Result<(), String> {
    q.execute("device_del", Some(json!({ "id": id })))
        .map_err(said)?;
    let deadline = Instant::now() + UNPLUG_WAIT;
    loop {
        let pci = q.execute("query-pci", None).map_err(said)?;
        if pci_address(&pci, id).is_none() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the guest did not let {id} go in {} s (it stays until the VM stops)",
                UNPLUG_WAIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    q.execute("object-del", Some(json!({ "id": memdev(id) })))
        .map_err(said)?;
    Ok(())
}

/// Every device id in QEMU's `query-pci` answer, behind bridges too.
fn device_ids(query: &Value) -> Vec<String> {
    fn collect(devices: &Value, out: &mut Vec<String>) {
        for d in devices.as_array().into_iter().flatten() {
            if let Some(id) = d["qdev_id"].as_str().filter(|id| !id.is_empty()) {
                out.push(id.to_string());
            }
            collect(&d["pci_bridge"]["devices"], out);
        }
    }
    let mut out = Vec::new();
    for bus in query.as_array().into_iter().flatten() {
        collect(&bus["devices"], &mut out);
    }
    out
}

/// The sysfs address (`0000:BB:SS.F`) of device `id` in QEMU's `query-pci` answer: buses and
/// the buses behind bridges.
fn pci_address(query: &Value, id: &str) -> Option<String> {
    fn find(devices: &Value, id: &str) -> Option<String> {
        for d in devices.as_array()? {
            if d["qdev_id"] == id {
                let n = |k: &str| d[k].as_u64();
                return Some(format!(
                    "0000:{:02x}:{:02x}.{:x}",
                    n("bus")?,
                    n("slot")?,
                    n("function")?
                ));
            }
            if let Some(found) = find(&d["pci_bridge"]["devices"], id) {
                return Some(found);
            }
        }
        None
    }
    query
        .as_array()?
        .iter()
        .find_map(|bus| find(&bus["devices"], id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_found_on_its_bus_or_behind_a_bridge() {
        let q = json!([{ "bus": 0, "devices": [
            { "bus": 0, "slot": 1, "function": 1, "qdev_id": "" },
            { "bus": 0, "slot": 4, "function": 0, "qdev_id": "stitch-vm1-7-region" },
            { "bus": 0, "slot": 5, "function": 0, "qdev_id": "bridge",
              "pci_bridge": { "devices": [
                { "bus": 1, "slot": 31, "function": 0, "qdev_id": "deep" } ] } }
        ] }]);
        assert_eq!(
            pci_address(&q, "stitch-vm1-7-region").as_deref(),
            Some("0000:00:04.0")
        );
        assert_eq!(pci_address(&q, "deep").as_deref(), Some("0000:01:1f.0"));
        assert_eq!(pci_address(&q, "gone"), None);
        assert_eq!(device_ids(&q), ["stitch-vm1-7-region", "bridge", "deep"]);
    }
}
