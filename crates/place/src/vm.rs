//! `placement: vm`: QEMU started with a vhost-user netdev on the app's port, supervised like a
//! function process, powered down through QMP (ACPI) when it leaves, then killed after its
//! `shutdown_timeout_s`.

use crate::confine::{self, RunAs};
use crate::supervisor::{ProcessSpec, StopBy};
use crate::{at, find_program, Placed};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use stitch_core::graph::AppDecl;
use stitch_core::graph::GraphError;
use stitch_vhost::vm::{Accel, GuestRings, VmConfig};

/// The longest path a Unix socket address holds.
const SUN_PATH_MAX: usize = 107;

/// The folder of one instance's VMs, named after its key: beside the function socket's
/// (`/run/stitch-fn` for root, 0711: entered, not listed), not in the runtime folder, which
/// QEMU's user may not enter. Each VM has a folder of its own in it ([`vm_folder`]).
pub fn dir_of(instance: &str) -> PathBuf {
    // Short, stable names whatever the key's length (socket paths are limited).
    stitch_nf::paths::default_socket_folder()
        .join(format!("vm-{:016x}", stitch_nf::paths::name_hash(instance)))
}

/// The folder of VM `name`'s sockets and console: its user's (0700), so that its QEMU makes
/// its QMP socket and console there and nobody else reaches them.
pub fn vm_folder(vm_dir: &Path, name: &str) -> PathBuf {
    vm_dir.join(name)
}

/// Makes the instance's VM folder (0711, root's) and VM `name`'s in it, given to `user`
/// (0700), whatever was there: the instance's folder is Stitch's, so nobody else made it.
pub fn make_folders(vm_dir: &Path, name: &str, user: Option<&RunAs>) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    use std::os::unix::io::AsFd;
    if let Some(parent) = vm_dir.parent() {
        if *parent == *stitch_nf::paths::default_socket_folder() {
            stitch_core::files::private_dir(parent, 0o711, None)?;
        }
    }
    stitch_core::files::private_dir(vm_dir, 0o711, None)?;
    let dir = vm_folder(vm_dir, name);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let d = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&dir)
        .map_err(|e| format!("{} is not a folder Stitch can use ({e})", dir.display()))?;
    if let Some(u) = user {
        std::os::unix::fs::fchown(d.as_fd(), Some(u.uid), Some(u.gid))
            .map_err(|e| format!("cannot give {} to `{}`: {e}", dir.display(), u.name))?;
    }
    d.set_permissions(std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))
}

fn resolve(base_dir: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base_dir.join(p)
    }
}

/// The guest's kernel, initrd and disk that the config names, each an existing file.
fn guest_files(
    app: &AppDecl,
    c: &VmConfig,
    base_dir: &Path,
) -> Result<Vec<(&'static str, PathBuf)>, GraphError> {
    let mut files = Vec::new();
    for (key, f) in [
        ("kernel", &c.kernel),
        ("initrd", &c.initrd),
        ("disk", &c.disk),
    ] {
        if let Some(f) = f {
            let path = resolve(base_dir, f);
            if !path.is_file() {
                return Err(at(
                    app,
                    key,
                    format!(
                        "app `{}`: {key}: no file {}{}",
                        app.name,
                        path.display(),
                        if f.is_relative() {
                            " (a relative path is taken from the graph file's folder)"
                        } else {
                            ""
                        }
                    ),
                ));
            }
            files.push((key, path));
        }
    }
    Ok(files)
}

/// The user QEMU runs as (none: Stitch's own, or root's with `privileged: true`), refused
/// when it could not open the guest's files or, with `accel: kvm`, /dev/kvm.
fn qemu_user(
    app: &AppDecl,
    c: &VmConfig,
    files: &[(&'static str, PathBuf)],
) -> Result<Option<RunAs>, GraphError> {
    if c.accel == Accel::Kvm {
        if let Err(e) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
        {
            return Err(at(
                app,
                "accel",
                format!(
                    "app `{}`: accel: kvm, but /dev/kvm cannot be opened ({e}): use `accel: tcg`",
                    app.name
                ),
            ));
        }
    }
    let user = match c.privileged {
        true => None,
        false => confine::user_for(c.user.as_deref())
            .map_err(|e| at(app, "user", format!("app `{}`: {e}", app.name)))?,
    };
    let Some(u) = &user else { return Ok(None) };
    for (key, path) in files {
        confine::check_file(u, path, *key == "disk")
            .map_err(|e| at(app, key, format!("app `{}`: QEMU {e}", app.name)))?;
    }
    if c.accel == Accel::Kvm {
        confine::check_file(u, Path::new("/dev/kvm"), true).map_err(|e| {
            at(
                app,
                "accel",
                format!(
                    "app `{}`: QEMU {e} (`usermod -aG kvm {}`)",
                    app.name, u.name
                ),
            )
        })?;
    }
    Ok(user)
}

/// QEMU's command line for `app`, and the port's entry with its socket.
pub(crate) fn spec(app: &AppDecl, base_dir: &Path, vm_dir: &Path) -> Result<Placed, GraphError> {
    if app.kind != "vm" {
        return Err(at(
            app,
            "type",
            format!(
                "app `{}`: type `{}` has no VM version; a VM is `placement: vm` with a `kernel` \
                 or `disk` (and no type, or `type: vm`); to join a VM you start yourself, use a \
                 `vhost_user` app",
                app.name, app.kind
            ),
        ));
    }
    let c: VmConfig = serde_json::from_value(app.config.clone())
        .map_err(|e| at(app, "kernel", format!("app `{}`: {e}", app.name)))?;
    let qemu_name = c.qemu.as_deref().unwrap_or("qemu-system-x86_64");
    let program = find_program(qemu_name, base_dir).map_err(|m| {
        at(
            app,
            if c.qemu.is_some() {
                "qemu"
            } else {
                "placement"
            },
            format!(
                "app `{}`: QEMU: {m} (Debian: apt install qemu-system-x86)",
                app.name
            ),
        )
    })?;
    let files = guest_files(app, &c, base_dir)?;
    let user = qemu_user(app, &c, &files)?;
    // One function socket per VM: its guest can ask for no port but its own.
    let folder = vm_folder(vm_dir, &app.name);
    let socket = match (&c.socket, c.rings) {
        (Some(s), _) => resolve(base_dir, s),
        (None, GuestRings::Virtio) => folder.join(format!("{}.sock", app.name)),
        (None, GuestRings::Ivshmem) => folder.join(format!("{}.nf", app.name)),
    };
    let qmp = folder.join(format!("{}.qmp", app.name));
    for p in [&socket, &qmp] {
        if p.as_os_str().len() > SUN_PATH_MAX {
            return Err(at(
                app,
                "socket",
                format!(
                    "app `{}`: socket path {} is longer than a Unix socket address holds ({SUN_PATH_MAX} bytes): give a shorter `socket` or a shorter app name",
                    app.name,
                    p.display()
                ),
            ));
        }
    }
    let console = c
        .console
        .as_ref()
        .map(|p| resolve(base_dir, p))
        .unwrap_or_else(|| folder.join(format!("{}.console", app.name)));
    if let Some(u) = &user {
        // The VM's own folder is made for it; a socket or console named elsewhere must be
        // reachable by its user.
        for p in [&socket, &console]
            .into_iter()
            .filter(|p| !p.starts_with(&folder))
        {
            confine::check_reachable(u, p)
                .map_err(|e| at(app, "socket", format!("app `{}`: QEMU {e}", app.name)))?;
        }
    }
    let args = qemu_args(&app.name, &c, &files, &socket, &qmp, &console);
    let runs_as = user.as_ref().map(|u| u.name.as_str());
    let (engine_kind, engine_config, guest_bus) = engine_side(app, &c, &socket, &qmp, runs_as);
    Ok(Placed {
        spec: ProcessSpec {
            app: app.name.clone(),
            program,
            args,
            env: Vec::new(),
            user,
            // Confined as a function is (no capabilities, `no_new_privs`, a clean
            // environment), unless the app says `privileged: true`; QEMU's own seccomp filter
            // (`-sandbox on`) instead of a function's, which QEMU's system calls exceed.
            privileged: c.privileged,
            seccomp: false,
            attaches: None,
            cpu: None,
            memory_mb: None,
            stop: StopBy::Qmp(qmp),
            stop_grace: Duration::from_secs_f64(c.shutdown_timeout_s),
            kind: "vm",
            console: Some(console),
        },
        engine_config: Some(engine_config),
        engine_kind,
        guest_bus,
    })
}

/// The app the engine runs for the VM — its type when not `vm`, its config — and, with
/// `rings: ivshmem`, the way into the guest for the port's function.
fn engine_side(
    app: &AppDecl,
    c: &VmConfig,
    socket: &Path,
    qmp: &Path,
    runs_as: Option<&str>,
) -> (Option<&'static str>, serde_json::Value, Option<GuestBusAt>) {
    match c.rings {
        GuestRings::Virtio => {
            let mut config = app.config.clone();
            config["socket"] = serde_json::json!(socket);
            // The port's socket goes to QEMU's user (`vm` gives it to the port as `owner`).
            config["user"] = serde_json::json!(runs_as);
            (None, config, None)
        }
        GuestRings::Ivshmem => (
            Some("nf_port"),
            serde_json::json!({
                "socket": socket,
                "mode": c.mode.unwrap_or_default().name(),
                "wake": "polling",
                // The function in the guest reaches the port through its QEMU.
                "allow_users": runs_as.into_iter().collect::<Vec<_>>(),
            }),
            Some(GuestBusAt {
                socket: socket.to_path_buf(),
                qmp: qmp.to_path_buf(),
                root_ports: root_ports(c),
            }),
        ),
    }
}

/// A VM whose function attaches on `socket` and whose memory is plugged over `qmp` — on a
/// PCI Express machine into one of `root_ports` (its root bus takes no hot-plug).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestBusAt {
    pub socket: PathBuf,
    pub qmp: PathBuf,
    pub root_ports: Vec<String>,
}

/// Root ports a PCI Express machine gets for the devices Stitch plugs: the region, the packet
/// memory and another during an upgrade, two direct channels and their two spares, one more.
const ROOT_PORTS: usize = 8;

/// The BAR of the packet memory (the default pool's 644 MiB, to a power of two): what each
/// root port reserves room for, in the guest's 64-bit address space (nothing of its memory).
const POOL_BAR: &str = "1G";

/// Whether `qemu_args` make the machine a PCI Express one (`-machine q35…`, `-M pc-q35-…`).
fn pcie_machine(c: &VmConfig) -> bool {
    c.qemu_args.windows(2).any(|w| {
        let machine = w[1]
            .split(',')
            .find(|f| !f.contains('=') || f.starts_with("type="));
        matches!(w[0].as_str(), "-machine" | "-M")
            && machine.is_some_and(|m| m.trim_start_matches("type=").contains("q35"))
    })
}

/// The ids of the root ports an ivshmem VM on a PCI Express machine gets (none otherwise).
fn root_ports(c: &VmConfig) -> Vec<String> {
    if !pcie_machine(c) {
        return Vec::new();
    }
    (0..ROOT_PORTS).map(|i| format!("stitch-rp{i}")).collect()
}

fn qemu_args(
    name: &str,
    c: &VmConfig,
    files: &[(&str, PathBuf)],
    socket: &Path,
    qmp: &Path,
    console: &Path,
) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut arg = |words: &[&str]| a.extend(words.iter().map(|w| w.to_string()));
    arg(&["-name", &format!("stitch-{name}")]);
    arg(&["-accel", c.accel.name()]);
    arg(&["-m", &c.memory_mb.to_string(), "-smp", &c.vcpus.to_string()]);
    arg(&["-nodefaults", "-no-reboot", "-display", "none"]);
    // QEMU's own seccomp filter: no obsolete system calls, no privileges gained, no process
    // started, no scheduling or memory policy changed (a guest that escapes QEMU's device
    // emulation finds that much less).
    arg(&[
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]);
    // vhost-user reads the guest's memory: it must be a shareable file.
    arg(&[
        "-object",
        &format!("memory-backend-memfd,id=mem,size={}M,share=on", c.memory_mb),
        "-numa",
        "node,memdev=mem",
    ]);
    for (key, path) in files {
        let path = path.display().to_string();
        match *key {
            "kernel" => arg(&["-kernel", &path]),
            "initrd" => arg(&["-initrd", &path]),
            _ => arg(&["-drive", &format!("file={path},if=virtio")]),
        }
    }
    if let Some(append) = &c.append {
        arg(&["-append", append]);
    }
    // reconnect: a Stitch restarted after a crash adopts the VM, which connects again.
    arg(&[
        "-chardev",
        &format!("socket,id=port0,path={},reconnect=1", socket.display()),
    ]);
    match c.rings {
        GuestRings::Virtio => {
            arg(&["-netdev", "vhost-user,id=net0,chardev=port0"]);
            // QEMU 7.2 under TCG crashes with vhost-user and MSI-X: legacy interrupts there.
            let mut device = String::from("virtio-net-pci,netdev=net0");
            if c.accel == Accel::Tcg {
                device.push_str(",vectors=0");
            }
            if let Some(mac) = &c.mac {
                device.push_str(&format!(",mac={mac}"));
            }
            arg(&["-device", &device]);
        }
        GuestRings::Ivshmem => {
            arg(&[
                "-device",
                "virtio-serial-pci,id=stitch-serial",
                "-device",
                &format!(
                    "virtserialport,bus=stitch-serial.0,chardev=port0,name={}{name}",
                    stitch_nf::guest::SERIAL_PREFIX
                ),
            ]);
            // Chassis numbers from 200: clear of those a user's own root ports take. Each
            // port's window is reserved at boot for the largest BAR it may get, the packet
            // memory's (a hot-plugged BAR larger than the window is never assigned).
            for (i, port) in root_ports(c).iter().enumerate() {
                let chassis = 200 + i;
                arg(&[
                    "-device",
                    &format!(
                        "pcie-root-port,id={port},chassis={chassis},bus=pcie.0,\
                         pref64-reserve={POOL_BAR}"
                    ),
                ]);
            }
        }
    }
    arg(&["-serial", &format!("file:{}", console.display())]);
    arg(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", qmp.display()),
    ]);
    a.extend(c.qemu_args.iter().cloned());
    a
}
