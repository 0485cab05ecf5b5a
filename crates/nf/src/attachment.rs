//! What the listener hands a port's app when a function attaches: the shared region, its
//! layout, the doorbell and the connection — and the settings that shaped the region.

use crate::shm::{Layout, Mapping, RegionHeader};
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// How a port hands packets over, fixed by its config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortSettings {
    pub zero_copy: bool,
    pub blocking: bool,
    pub ring_size: u32,
    pub buffers: u32,
    pub buffer_size: u32,
}

/// A function's live attachment, built by the listener and taken over by the port's app.
pub struct Attachment {
    pub region: Mapping,
    /// The region's memory, for a process taking over (`stitch upgrade`).
    pub memfd: OwnedFd,
    pub layout: Layout,
    pub doorbell: Arc<OwnedFd>,
    /// The function's connection (a copy), for control messages: direct channels to map.
    pub conn: OwnedFd,
    pub generation: u64,
    pub pid: i32,
    /// The function attached before, to a Stitch process that ended, and lost this many
    /// packets with it.
    pub lost_before: Option<u64>,
    /// The function runs in a VM ([`crate::guest`]), whose memory this bus plugs: it polls,
    /// and takes no descriptors — a direct channel is plugged into its guest instead.
    pub guest: Option<Arc<dyn crate::guest::GuestBus>>,
    /// In a guest: its devices as the function was told of them (`region`, `pool`: their PCI
    /// addresses and sizes) with their names in QEMU, for `stitch show` and a successor
    /// process; null for a process.
    pub guest_devices: serde_json::Value,
}

impl Attachment {
    /// The region's header (the listener made the region at least that large).
    pub fn header(&self) -> &RegionHeader {
        use crate::shm::Region;
        self.region
            .header()
            .expect("the listener writes the header first")
    }
}
