//! `vm`: a VM Stitch launches (QEMU) and supervises, joined to the graph by a `vhost_user` port
//! (`placement: vm`).
//!
//! On the engine's side it is a [`VhostUser`] server port whose socket the placement chooses
//! (named after the instance and the app); what to boot, and how QEMU is started, stopped and
//! restarted, is read by whatever places VMs beside the engine (`stitch-place`). `input` goes
//! to the guest, what the guest sends comes out of `output`.
//!
//! ```yaml
//! apps:
//!   vm1:
//!     placement: vm
//!     kernel: vm/vmlinux            # and/or a disk image
//!     initrd: vm/initrd.gz
//!     append: "console=ttyS0 stitch.ip=10.0.0.11/24"
//!     memory_mb: 512
//!     vcpus: 1
//!     mac: "52:54:00:00:00:11"
//!     accel: tcg                    # or kvm
//!     shutdown_timeout_s: 30        # ACPI power-down first, then killed
//! ```
//!
//! With `rings: ivshmem` the guest has no NIC: a function built on Stitch's function library
//! runs in it, on an `nf_port`'s rings that the placement hot-plugs into the guest as
//! ivshmem devices (`stitch_nf::guest`); `mode: zero_copy` plugs Stitch's packet memory too.

use crate::{VhostUser, VhostUserConfig};
use serde::Deserialize;
use std::path::PathBuf;
use stitch_core::app::{AppContext, AppError, Io, PortSpec};
use stitch_core::App;

/// How the guest meets the engine.
#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum GuestRings {
    /// A virtio-net NIC on a `vhost_user` port.
    #[default]
    Virtio,
    /// A function in the guest on an `nf_port`'s rings, hot-plugged as ivshmem devices.
    Ivshmem,
}

/// `rings: ivshmem`: what the guest's function gets, as an `nf_port`'s `mode`.
#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "snake_case")]
pub enum GuestRingMode {
    /// The port's own buffer slots: frames are copied in and out.
    #[default]
    Isolated,
    /// Stitch's packet memory as a second device: no copy.
    ZeroCopy,
}

impl GuestRingMode {
    pub fn name(self) -> &'static str {
        match self {
            GuestRingMode::Isolated => "isolated",
            GuestRingMode::ZeroCopy => "zero_copy",
        }
    }
}

/// How the guest's CPU runs.
#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// QEMU's own emulation: works everywhere, slowly.
    #[default]
    Tcg,
    /// Hardware virtualisation through /dev/kvm.
    Kvm,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// A kernel to boot directly (`-kernel`).
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    /// An initial RAM disk for `kernel` (`-initrd`).
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// The kernel's command line.
    #[serde(default)]
    pub append: Option<String>,
    /// A disk image, as a virtio disk.
    #[serde(default)]
    pub disk: Option<PathBuf>,
    /// Guest memory in MiB (shared with Stitch, so the vhost-user port reaches it).
    #[serde(default = "default_memory")]
    pub memory_mb: u64,
    /// Virtual CPUs.
    #[serde(default = "one")]
    pub vcpus: u32,
    /// The guest NIC's MAC address (QEMU's default otherwise).
    #[serde(default)]
    pub mac: Option<String>,
    #[serde(default)]
    pub accel: Accel,
    /// The QEMU program (default `qemu-system-x86_64`, on PATH).
    #[serde(default)]
    pub qemu: Option<String>,
    /// More QEMU arguments, appended.
    #[serde(default)]
    pub qemu_args: Vec<String>,
    /// Where the guest's serial console is written (default: beside the port's socket).
    #[serde(default)]
    pub console: Option<PathBuf>,
    /// Seconds between the ACPI power-down and a kill when Stitch stops the VM.
    #[serde(default = "default_shutdown")]
    pub shutdown_timeout_s: f64,
    /// The vhost-user socket; chosen by the placement when not given.
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// Offer checksum and TSO offloads to the guest.
    #[serde(default = "yes")]
    pub offloads: bool,
    #[serde(default)]
    pub rings: GuestRings,
    /// `rings: ivshmem` only.
    #[serde(default)]
    pub mode: Option<GuestRingMode>,
    /// The user QEMU runs as (without capabilities, `no_new_privs`, a clean environment):
    /// by default, for a Stitch running as root, the functions' system user `stitch-fn`. The
    /// port's socket and the VM's folder are given to it.
    #[serde(default)]
    pub user: Option<String>,
    /// QEMU as root with root's capabilities and environment: the explicit word for it.
    #[serde(default)]
    pub privileged: bool,
}

fn default_memory() -> u64 {
    512
}
fn default_shutdown() -> f64 {
    30.0
}
fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}

impl VmConfig {
    /// What the entry asks of QEMU, checked without touching the system.
    pub fn check(&self) -> Result<(), String> {
        if self.kernel.is_none() && self.disk.is_none() {
            return Err("give the VM a `kernel` to boot, a `disk`, or both".into());
        }
        if self.privileged && self.user.is_some() {
            return Err("`privileged: true` runs QEMU as root: leave out `user`".into());
        }
        if self.kernel.is_none() && (self.initrd.is_some() || self.append.is_some()) {
            return Err("`initrd` and `append` go with a `kernel`".into());
        }
        if self.rings == GuestRings::Virtio && self.mode.is_some() {
            return Err("`mode` is the ivshmem rings': give `rings: ivshmem` too".into());
        }
        if !(64..=1 << 20).contains(&self.memory_mb) {
            return Err(format!(
                "memory_mb {}: give the guest 64 MiB or more",
                self.memory_mb
            ));
        }
        if !(1..=256).contains(&self.vcpus) {
            return Err(format!("vcpus {}: 1 to 256", self.vcpus));
        }
        if !(self.shutdown_timeout_s >= 0.0 && self.shutdown_timeout_s <= 3600.0) {
            return Err(format!(
                "shutdown_timeout_s {}: 0 to 3600 seconds",
                self.shutdown_timeout_s
            ));
        }
        if let Some(mac) = &self.mac {
            let ok = mac.split(':').count() == 6
                && mac
                    .split(':')
                    .all(|b| b.len() == 2 && u8::from_str_radix(b, 16).is_ok());
            if !ok {
                return Err(format!("mac `{mac}`: six hex bytes like 52:54:00:12:34:56"));
            }
        }
        Ok(())
    }

    /// The vhost-user server port on `socket`.
    fn port_config(&self, socket: PathBuf) -> Result<VhostUserConfig, AppError> {
        serde_json::from_value(serde_json::json!({
            "socket": socket,
            "mode": "server",
            "offloads": self.offloads,
            // The placement names the user its QEMU runs as: that QEMU connects.
            "owner": if self.privileged { None } else { self.user.clone() },
        }))
        .map_err(|e| AppError::from(e.to_string()))
    }
}

/// The engine's side of a VM Stitch launches: its vhost-user port.
pub struct VmPort(VhostUser);

impl App for VmPort {
    type Config = VmConfig;
    const EXAMPLE: &'static str = r#"kernel: /var/lib/stitch/vmlinux
initrd: /var/lib/stitch/initrd.img
append: "console=ttyS0"
memory_mb: 512
vcpus: 2
"#;

    fn declare(c: &VmConfig) -> Result<PortSpec, AppError> {
        c.check()?;
        VhostUser::declare(&c.port_config(PathBuf::from("vm.sock"))?)
    }

    fn new(c: VmConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let socket = c.socket.clone().ok_or_else(|| {
            AppError::from(
                "no vhost-user socket: a `vm` app is started by `stitch run` with `placement: vm`",
            )
        })?;
        VhostUser::new(c.port_config(socket)?, ctx).map(VmPort)
    }

    fn pull(&mut self, io: &mut Io) {
        self.0.pull(io)
    }

    fn push(&mut self, io: &mut Io) {
        self.0.push(io)
    }

    fn tick(&mut self, io: &mut Io, now: std::time::Instant) {
        self.0.tick(io, now)
    }

    fn stop(&mut self) {
        self.0.stop()
    }

    fn hold_for_hand_over(&mut self) {
        self.0.hold_for_hand_over()
    }

    fn carry_on(&mut self) {
        self.0.carry_on()
    }

    fn hand_over(&mut self) -> Option<stitch_core::Descriptors> {
        self.0.hand_over()
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        self.0.take_position(position)
    }

    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        self.0.query(request)
    }
}
