//! Installing, changing, reading and removing a kernel graph.
//!
//! Everything lives under a bpffs folder per data plane (`/sys/fs/bpf/stitch/NAME/`): the
//! maps, pinned by name, and the TCX links that hold the programs on each interface's ingress
//! hook (`links/IFNAME`). The slots of `functions` hold the function programs. Nothing needs a
//! running process: the kernel keeps what is pinned. A small record of what was installed
//! (which app has which slot, VIDs and state id) is kept in `/run/stitch/kernel/NAME.json`.
//!
//! Every apply loads the programs afresh with the pinned maps reused, so that new code and new
//! settings go in the same way: new or changed apps are written into free slots first, then
//! VIs, links and hooks are pointed at them entry by entry (each a single atomic map update),
//! then what is no longer used is cleared. Unchanged apps keep their slot, their state and
//! their counters.

use crate::maps::*;
use crate::netdev;
use crate::plan::{Function, Plan, PlannedApp};
use indexmap::IndexMap;
use libbpf_rs::{MapCore, MapFlags, MapHandle, ObjectBuilder};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/stitch.bpf.o"));

const BPFFS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

pub use crate::error::Error;

fn fail<T>(m: impl Into<String>) -> Result<T, Error> {
    Err(Error(m.into()))
}

/// What an earlier apply installed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Installed {
    pub graph_file: String,
    pub loop_device: String,
    /// The VXLAN device of the transport manager, while a `vxlan` app is installed.
    #[serde(default)]
    pub tunnel_device: Option<String>,
    pub apps: IndexMap<String, InstalledApp>,
    pub links: Vec<InstalledLink>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstalledApp {
    pub kind: String,
    pub kind_code: u32,
    /// The planned function, printed: equal fingerprints mean nothing to change.
    pub fingerprint: String,
    pub ports: Vec<String>,
    pub base_vid: u32,
    /// Slot of its settings and program (0 for interfaces).
    pub slot: u32,
    /// Key of its learned state and counters, kept across changes (0 for interfaces).
    pub state_id: u32,
    pub interface: Option<String>,
    pub ifindex: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct InstalledLink {
    pub from: String,
    pub to: String,
    pub from_vid: u32,
    pub to_vid: u32,
}

/// What an apply changed.
#[derive(Debug, Default, Serialize)]
pub struct ApplyReport {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub kept: Vec<String>,
    pub removed: Vec<String>,
}

/// One named kernel data plane.
pub struct DataPlane {
    pub name: String,
    pin_dir: PathBuf,
    record: PathBuf,
}

static LIBBPF_LOG: Mutex<String> = Mutex::new(String::new());

fn capture_libbpf_log() {
    fn keep(_: libbpf_rs::PrintLevel, msg: String) {
        let mut log = LIBBPF_LOG.lock().unwrap();
        if log.len() < (1 << 20) {
            log.push_str(&msg);
        }
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, keep)));
}

/// The end of the verifier's log of the last failed load, for error messages.
fn verifier_excerpt() -> String {
    let log = std::mem::take(&mut *LIBBPF_LOG.lock().unwrap());
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.starts_with("libbpf: elf:")
                && !l.contains("pinned map")
                && !l.contains("reusing pinned")
        })
        .collect();
    let tail = &lines[lines.len().saturating_sub(12)..];
    if tail.is_empty() {
        String::new()
    } else {
        format!("\nkernel/libbpf said:\n  {}", tail.join("\n  "))
    }
}

fn ensure_bpffs() -> Result<(), Error> {
    // SAFETY: statfs is a C struct of integers; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let path = std::ffi::CString::new(BPFFS).unwrap();
    // SAFETY: valid path and out pointer.
    let r = unsafe { libc::statfs(path.as_ptr(), &mut st) };
    if r == 0 && st.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    let fstype = std::ffi::CString::new("bpf").unwrap();
    // SAFETY: valid strings; mounting needs CAP_SYS_ADMIN.
    let r = unsafe {
        libc::mount(
            fstype.as_ptr(),
            path.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return fail(format!(
            "{BPFFS} is not a BPF filesystem and mounting one failed ({}): run as root, or \
             `mount -t bpf bpf {BPFFS}`",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn kind_program(kind: u32) -> &'static str {
    match kind {
        FN_FORWARDER => "fn_forwarder",
        FN_BRIDGE => "fn_bridge",
        FN_ROUTER => "fn_router",
        FN_VXLAN => "fn_vxlan",
        _ => "fn_firewall",
    }
}

fn zeroes(n: usize) -> Vec<u8> {
    vec![0; n]
}

/// The maps, opened from their pins.
struct Maps {
    m: HashMap<String, MapHandle>,
}

impl Maps {
    fn open(dir: &Path) -> Result<Maps, Error> {
        let mut m = HashMap::new();
        let expected: &[(&str, usize, usize)] = &[
            ("functions", 4, 4),
            ("graph", 4, 4),
            ("vids", 4, size_of::<ViInfo>()),
            ("ifaces", 4, 4),
            ("slots", 4, size_of::<FnInfo>()),
            ("config", 4, size_of::<Globals>()),
            ("vi_counters", 4, size_of::<ViStats>()),
            ("fn_counters", 4, size_of::<FnStats>()),
            ("bridge_ports", 4, size_of::<BridgePort>()),
            ("fdb", size_of::<FdbKey>(), 16),
            ("router_ports", 4, size_of::<RouterPort>()),
            ("routes", size_of::<RouteKey>(), size_of::<Route>()),
            ("neighbours", size_of::<NeighKey>(), size_of::<Neigh>()),
            ("fw_rules", 4, size_of::<FwRule>()),
            ("fw_rule_hits", 4, 8),
            ("conntrack", size_of::<CtKey>(), 16),
            ("icmp_budget", 4, 16),
            ("vxlan_segments", 4, size_of::<VxlanSegment>()),
            ("vxlan_vnis", 4, size_of::<VniTarget>()),
            ("dp_counters", 4, 8),
            ("taps", 4, size_of::<TapPoint>()),
            ("tap_drops", 4, 8),
            ("tap_rings", 4, 4),
            ("engine_rings", 4, 4),
        ];
        for (name, k, v) in expected {
            let path = dir.join(name);
            let h = MapHandle::from_pinned_path(&path).map_err(|e| {
                Error(format!(
                    "cannot open {}: {e} (is the data plane installed? `stitch kernel apply`)",
                    path.display()
                ))
            })?;
            if h.key_size() as usize != *k || h.value_size() as usize != *v {
                return fail(format!(
                    "map {name} has key/value sizes {}/{}, this build expects {k}/{v}: it was \
                     installed by another version; `stitch kernel teardown` and apply again",
                    h.key_size(),
                    h.value_size()
                ));
            }
            m.insert(name.to_string(), h);
        }
        Ok(Maps { m })
    }

    fn get(&self, name: &str) -> &MapHandle {
        &self.m[name]
    }

    fn put<K: Pod, V: Pod>(&self, map: &str, k: &K, v: &V) -> Result<(), Error> {
        self.get(map)
            .update(k.bytes(), v.bytes(), MapFlags::ANY)
            .map_err(|e| Error(format!("writing map {map}: {e}")))
    }

    fn remove<K: Pod>(&self, map: &str, k: &K) {
        let _ = self.get(map).delete(k.bytes());
    }

    fn zero_percpu(&self, map: &str, key: u32) -> Result<(), Error> {
        let h = self.get(map);
        let n = libbpf_rs::num_possible_cpus().map_err(|e| Error(e.to_string()))?;
        let vals = vec![zeroes(h.value_size() as usize); n];
        h.update_percpu(&key.to_ne_bytes(), &vals, MapFlags::ANY)
            .map_err(|e| Error(format!("clearing map {map}: {e}")))
    }

    fn sum_percpu<V: Pod>(&self, map: &str, key: u32, add: impl Fn(&mut V, &V)) -> V {
        let mut total = V::default();
        if let Ok(Some(per_cpu)) = self
            .get(map)
            .lookup_percpu(&key.to_ne_bytes(), MapFlags::ANY)
        {
            for b in per_cpu {
                add(&mut total, &V::from_bytes(&b));
            }
        }
        total
    }

    /// How many capture sessions tap what leaves `vid`.
    fn tap_sessions(&self, vid: u32) -> u32 {
        match self.get("taps").lookup(&vid.to_ne_bytes(), MapFlags::ANY) {
            Ok(Some(b)) => TapPoint::from_bytes(&b).sessions.count_ones(),
            _ => 0,
        }
    }

    /// Deletes every entry of a hash map whose key starts with `state_id`.
    fn forget_state(&self, map: &str, state_id: u32) {
        let h = self.get(map);
        let keys: Vec<Vec<u8>> = h
            .keys()
            .filter(|k| k.len() >= 4 && k[..4] == state_id.to_ne_bytes())
            .collect();
        for k in keys {
            let _ = h.delete(&k);
        }
    }
}

impl DataPlane {
    pub fn new(name: &str) -> Result<DataPlane, Error> {
        if name.is_empty()
            || name.len() > 10
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return fail(format!(
                "data plane name `{name}`: use up to 10 letters, digits, `-` or `_`"
            ));
        }
        Ok(DataPlane {
            name: name.to_string(),
            pin_dir: Path::new(BPFFS).join("stitch").join(name),
            record: stitch_core::runtime_dir()
                .join("kernel")
                .join(format!("{name}.json")),
        })
    }

    /// The names of the kernel data planes installed on this host.
    pub fn installed_names() -> Vec<String> {
        let dir = stitch_core::runtime_dir().join("kernel");
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let n = e.file_name();
                n.to_str()?.strip_suffix(".json").map(str::to_string)
            })
            .collect();
        names.sort();
        names
    }

    /// The loop device: one end of a veth pair that packets re-enter the graph through.
    fn loop_device(&self) -> (String, String) {
        (format!("stl-{}", self.name), format!("stp-{}", self.name))
    }

    fn tunnel_device(&self) -> String {
        format!("stv-{}", self.name)
    }

    pub(crate) fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Where this data plane's record and its capture sessions' claims are kept.
    pub(crate) fn runtime_dir(&self) -> PathBuf {
        self.record
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    /// The installed links as graph links, each with the VID its packets leave (what a tap
    /// watches).
    pub fn tappable_links(&self) -> Result<Vec<(stitch_core::graph::LinkDecl, u32)>, Error> {
        let Some(inst) = self.installed()? else {
            return fail(format!(
                "no kernel data plane `{}` is installed (`stitch kernel apply FILE`)",
                self.name
            ));
        };
        let endpoint = |s: &str| {
            let (app, port) = s.split_once('.').unwrap_or((s, ""));
            stitch_core::graph::Endpoint {
                app: app.to_string(),
                port: port.to_string(),
            }
        };
        Ok(inst
            .links
            .iter()
            .map(|l| {
                let decl = stitch_core::graph::LinkDecl {
                    from: endpoint(&l.from),
                    to: endpoint(&l.to),
                    size: 0,
                    latency: false,
                    line: 0,
                };
                (decl, l.from_vid)
            })
            .collect())
    }

    fn links_dir(&self) -> PathBuf {
        self.pin_dir.join("links")
    }

    /// What is installed, if anything.
    pub fn installed(&self) -> Result<Option<Installed>, Error> {
        match std::fs::read_to_string(&self.record) {
            Ok(s) => serde_json::from_str(&s)
                .map(Some)
                .map_err(|e| Error(format!("{} is damaged: {e}", self.record.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => fail(format!("cannot read {}: {e}", self.record.display())),
        }
    }

    fn save(&self, inst: &Installed) -> Result<(), Error> {
        if let Some(d) = self.record.parent() {
            std::fs::create_dir_all(d)
                .map_err(|e| Error(format!("cannot create {}: {e}", d.display())))?;
        }
        let text = serde_json::to_string_pretty(inst).unwrap();
        stitch_core::files::write_atomically(&self.record, text.as_bytes(), 0o600)
            .map_err(|e| Error(format!("cannot write {}: {e}", self.record.display())))
    }

    /// Installs `plan`, or changes the installed graph into it: every check and allocation
    /// first, then new settings into free slots, then VIs, links and hooks pointed at them,
    /// then what is no longer used cleared.
    pub fn apply(&self, plan: &Plan, graph_file: &str) -> Result<ApplyReport, Error> {
        let old = self.installed()?.unwrap_or_default();
        let ifindexes = self.check_interfaces(plan, graph_file)?;
        let alloc = allocate(&old, plan, &ifindexes)?;
        ensure_bpffs()?;
        let (loop_dev, loop_peer) = self.loop_device();
        let loop_ifindex = netdev::ensure_veth(&loop_dev, &loop_peer).map_err(Error)?;
        std::fs::create_dir_all(self.links_dir())
            .map_err(|e| Error(format!("cannot create {}: {e}", self.links_dir().display())))?;
        let obj = self.load_object()?;
        let maps = Maps::open(&self.pin_dir)?;
        self.install_functions(&maps, &obj, plan, &alloc)?;
        let tunnel = self.install_devices(&maps, &obj, plan, loop_ifindex)?;
        self.install_engine_rings(&maps, plan, &alloc.apps)?;
        let links = install_vids_and_links(&maps, plan, &alloc.apps)?;
        install_vnis(&maps, plan, &alloc.apps)?;
        for a in alloc.apps.values() {
            if let Some(ifname) = &a.interface {
                maps.put("ifaces", &a.ifindex, &a.base_vid)?;
                self.hook(&program(&obj, "stitch_port"), a.ifindex, ifname)?;
            }
        }
        self.clear_unused(&maps, &old, &alloc.apps)?;
        self.clear_engine_rings(&maps, plan, &old, &alloc.apps);
        if tunnel.is_none() {
            self.unhook("tunnel");
            netdev::delete(&self.tunnel_device()).map_err(Error)?;
        }
        self.save(&Installed {
            graph_file: graph_file.to_string(),
            loop_device: loop_dev,
            tunnel_device: tunnel,
            apps: alloc.apps,
            links,
        })?;
        Ok(alloc.report)
    }

    /// The ifindex of every interface app; an interface that does not exist, or whose hook
    /// holds someone else's program, is refused before anything is changed.
    fn check_interfaces(&self, plan: &Plan, file: &str) -> Result<HashMap<String, u32>, Error> {
        let mut ifindexes = HashMap::new();
        for a in plan.apps.values() {
            let Function::Interface { ifname, .. } = &a.function else {
                continue;
            };
            let Some(i) = netdev::ifindex(ifname) else {
                return fail(format!(
                    "{file}:{}: app `{}`: interface `{ifname}` does not exist (create it \
                     first, for example a veth pair, or fix the name)",
                    a.line, a.name
                ));
            };
            if !self.links_dir().join(ifname).exists() {
                let others = tcx_programs(i);
                if others > 0 {
                    return fail(format!(
                        "{file}:{}: app `{}`: interface `{ifname}` already has {others} \
                         program(s) on its tc ingress hook (see `bpftool net show dev \
                         {ifname}`); Stitch would take their traffic: remove them first",
                        a.line, a.name
                    ));
                }
            }
            ifindexes.insert(a.name.clone(), i);
        }
        Ok(ifindexes)
    }

    /// Loads the programs afresh, with the maps pinned under this data plane's folder
    /// (created and pinned on first use, reused after).
    fn load_object(&self) -> Result<libbpf_rs::Object, Error> {
        capture_libbpf_log();
        let mut open = ObjectBuilder::default()
            .open_memory(OBJECT)
            .map_err(|e| Error(format!("cannot open the BPF object: {e}")))?;
        for mut m in open.maps_mut() {
            let name = m.name().to_string_lossy().to_string();
            if name.starts_with('.') {
                continue;
            }
            m.set_pin_path(self.pin_dir.join(&name))
                .map_err(|e| Error(format!("map {name}: {e}")))?;
        }
        open.load().map_err(|e| {
            let hint = if e.to_string().contains("Operation not permitted") {
                "\nloading BPF programs needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)"
            } else if e.to_string().contains("Invalid argument") {
                "\nif a map's definition changed since it was pinned, `stitch kernel teardown` \
                 first"
            } else {
                ""
            };
            Error(format!(
                "the kernel refused the data plane: {e}{hint}{}",
                verifier_excerpt()
            ))
        })
    }

    /// New apps start with clean state; new and changed functions' settings go into their
    /// fresh slots; then every slot gets the freshly loaded program of its kind.
    fn install_functions(
        &self,
        maps: &Maps,
        obj: &libbpf_rs::Object,
        plan: &Plan,
        alloc: &Allocation,
    ) -> Result<(), Error> {
        for &state_id in &alloc.fresh_states {
            // A state id used before by a removed app.
            self.clear_state(maps, state_id)?;
        }
        for name in &alloc.fresh_slots {
            write_function(maps, &plan.apps[name], &alloc.apps[name])?;
        }
        for a in alloc.apps.values().filter(|a| a.slot != 0) {
            let fd = program(obj, kind_program(a.kind_code)).as_fd().as_raw_fd() as u32;
            maps.put("functions", &a.slot, &fd)?;
        }
        Ok(())
    }

    /// The loop device (for copies and long chains) and, while a tunnel app is installed, the
    /// VXLAN device, with their hooks and the globals that name them. Returns the VXLAN
    /// device's name, if any.
    fn install_devices(
        &self,
        maps: &Maps,
        obj: &libbpf_rs::Object,
        plan: &Plan,
        loop_ifindex: u32,
    ) -> Result<Option<String>, Error> {
        let udp_port = plan.apps.values().find_map(|a| match a.function {
            Function::Vxlan { udp_port, .. } => Some(udp_port),
            _ => None,
        });
        let tunnel = match udp_port {
            Some(port) => {
                let dev = self.tunnel_device();
                let i = netdev::ensure_vxlan(&dev, port).map_err(Error)?;
                self.hook(&program(obj, "stitch_tunnel"), i, "tunnel")?;
                Some((dev, i))
            }
            None => None,
        };
        let globals = Globals {
            loop_ifindex,
            vxlan_ifindex: tunnel.as_ref().map(|t| t.1).unwrap_or(0),
        };
        maps.put("config", &0u32, &globals)?;
        self.hook(&program(obj, "stitch_loop"), loop_ifindex, "loop")?;
        Ok(tunnel.map(|t| t.0))
    }

    /// Each engine port's ring buffer: made and pinned where the engine's end opens it
    /// ([`engine_ring_path`]) the first time, the same ring after (the engine keeps reading
    /// it across changes), and put in `engine_rings` at the port's VID.
    fn install_engine_rings(
        &self,
        maps: &Maps,
        plan: &Plan,
        apps: &IndexMap<String, InstalledApp>,
    ) -> Result<(), Error> {
        for (ifname, vid) in engine_ports(plan, apps) {
            let path = engine_ring_path(&self.name, ifname);
            let ring = match MapHandle::from_pinned_path(&path) {
                Ok(ring) => ring,
                Err(_) => {
                    let mut ring = ring_buffer("stitch_engine", ENGINE_RING_BYTES)
                        .map_err(|e| Error(format!("cannot create the ring of `{ifname}`: {e}")))?;
                    ring.pin(&path)
                        .map_err(|e| Error(format!("cannot pin {}: {e}", path.display())))?;
                    ring
                }
            };
            let fd = ring.as_fd().as_raw_fd() as u32;
            maps.put("engine_rings", &vid, &fd)?;
        }
        Ok(())
    }

    /// Engine rings the new graph no longer sends to: out of `engine_rings`, and unpinned (the
    /// engine's end, if still running, keeps its mapping until it stops).
    fn clear_engine_rings(
        &self,
        maps: &Maps,
        plan: &Plan,
        old: &Installed,
        apps: &IndexMap<String, InstalledApp>,
    ) {
        let live: Vec<(&str, u32)> = engine_ports(plan, apps).collect();
        for a in old.apps.values() {
            let Some(ifname) = &a.interface else { continue };
            if !live.iter().any(|(_, vid)| *vid == a.base_vid) {
                maps.remove("engine_rings", &a.base_vid);
            }
            if !live.iter().any(|(name, _)| name == ifname) {
                let _ = std::fs::remove_file(engine_ring_path(&self.name, ifname));
            }
        }
    }

    /// Clears what the old graph used and the new one does not: interface hooks, VIs, slots
    /// and state.
    fn clear_unused(
        &self,
        maps: &Maps,
        old: &Installed,
        apps: &IndexMap<String, InstalledApp>,
    ) -> Result<(), Error> {
        let live_ifaces: BTreeSet<&str> = apps
            .values()
            .filter_map(|a| a.interface.as_deref())
            .collect();
        for a in old.apps.values() {
            if let Some(ifname) = &a.interface {
                if !apps.values().any(|n| n.ifindex == a.ifindex) {
                    maps.remove("ifaces", &a.ifindex);
                }
                if !live_ifaces.contains(ifname.as_str()) {
                    self.unhook(ifname);
                }
            }
        }
        let live_vids: BTreeSet<u32> = apps
            .values()
            .flat_map(|a| a.base_vid..a.base_vid + a.ports.len() as u32)
            .collect();
        let live_slots: BTreeSet<u32> = apps.values().map(|a| a.slot).collect();
        let live_states: BTreeSet<u32> = apps.values().map(|a| a.state_id).collect();
        for a in old.apps.values() {
            for v in a.base_vid..a.base_vid + a.ports.len() as u32 {
                if !live_vids.contains(&v) {
                    maps.put("graph", &v, &0u32)?;
                    maps.put("vids", &v, &ViInfo::default())?;
                    maps.zero_percpu("vi_counters", v)?;
                }
            }
            if a.slot != 0 && !live_slots.contains(&a.slot) {
                maps.remove("functions", &a.slot);
                clear_slot(maps, a.slot)?;
            }
            if a.state_id != 0 && !live_states.contains(&a.state_id) {
                self.clear_state(maps, a.state_id)?;
            }
        }
        Ok(())
    }

    /// Attaches `prog` to the ingress hook of `ifindex` (TCX link pinned as `links/PIN`), or
    /// points the existing link at it. Other programs on a workload's hook were refused
    /// before anything was changed (`apply`).
    fn hook(&self, prog: &libbpf_rs::Program<'_>, ifindex: u32, pin: &str) -> Result<(), Error> {
        let path = self.links_dir().join(pin);
        if path.exists() {
            if let Ok(mut link) = libbpf_rs::Link::open(&path) {
                if link.update_prog(prog).is_ok() {
                    return Ok(());
                }
            }
            // The interface went away and came back: the old link is defunct.
            let _ = std::fs::remove_file(&path);
        }
        let opts = libbpf_rs::libbpf_sys::bpf_tcx_opts {
            sz: size_of::<libbpf_rs::libbpf_sys::bpf_tcx_opts>() as _,
            ..Default::default()
        };
        use libbpf_rs::AsRawLibbpf;
        // SAFETY: a loaded program and valid options; the returned link is owned below.
        let ptr = unsafe {
            libbpf_rs::libbpf_sys::bpf_program__attach_tcx(
                prog.as_libbpf_object().as_ptr(),
                ifindex as i32,
                &opts,
            )
        };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            return fail(format!(
                "cannot attach to the tc ingress hook of `{pin}`: {} (TCX needs Linux 6.6 or \
                 newer){}",
                std::io::Error::last_os_error(),
                verifier_excerpt()
            ));
        };
        // SAFETY: a link just created by libbpf.
        let mut link = unsafe { libbpf_rs::Link::from_ptr(ptr) };
        link.pin(&path)
            .map_err(|e| Error(format!("cannot pin {}: {e}", path.display())))?;
        Ok(())
    }

    fn unhook(&self, pin: &str) {
        let _ = std::fs::remove_file(self.links_dir().join(pin));
    }

    fn clear_state(&self, maps: &Maps, state_id: u32) -> Result<(), Error> {
        maps.zero_percpu("fn_counters", state_id)?;
        for m in ["fdb", "neighbours", "conntrack"] {
            maps.forget_state(m, state_id);
        }
        Ok(())
    }

    /// Counters of the installed graph.
    pub fn status(&self) -> Result<Option<Status>, Error> {
        let Some(inst) = self.installed()? else {
            return Ok(None);
        };
        let maps = Maps::open(&self.pin_dir)?;
        // Taps of readers that were killed are not shown (nor kept).
        crate::tap_claims::clear_dead(&self.runtime_dir(), &self.name, self.pin_dir())?;
        let sum = |v: u32| {
            maps.sum_percpu::<ViStats>("vi_counters", v, |t, x| {
                t.tx_packets += x.tx_packets;
                t.tx_bytes += x.tx_bytes;
                t.drops += x.drops;
            })
        };
        // Links are one-to-one, so the data plane counts a packet once, where it leaves; what
        // entered a port is what left the port linked to it.
        let vi = |v: u32| {
            let mut s = sum(v);
            if let Some(l) = inst.links.iter().find(|l| l.to_vid == v) {
                let from = sum(l.from_vid);
                s.rx_packets = from.tx_packets;
                s.rx_bytes = from.tx_bytes;
            }
            s
        };
        let mut apps = Vec::new();
        for (name, a) in &inst.apps {
            let mut counters = IndexMap::new();
            if a.slot != 0 {
                let total = maps.sum_percpu::<FnStats>("fn_counters", a.state_id, |t, x| {
                    for (a, b) in t.c.iter_mut().zip(x.c) {
                        *a += b;
                    }
                });
                for (i, c) in counter_names(a.kind_code).iter().enumerate() {
                    counters.insert(c.to_string(), total.c[i]);
                }
            }
            let ports = a
                .ports
                .iter()
                .enumerate()
                .map(|(i, p)| PortStatus {
                    port: p.clone(),
                    vid: a.base_vid + i as u32,
                    stats: vi(a.base_vid + i as u32),
                    taps: maps.tap_sessions(a.base_vid + i as u32),
                })
                .collect();
            let attached = a
                .interface
                .as_ref()
                .map(|i| self.links_dir().join(i).exists());
            apps.push(AppStatus {
                name: name.clone(),
                kind: a.kind.clone(),
                slot: a.slot,
                interface: a.interface.clone(),
                attached,
                counters,
                ports,
            });
        }
        let mut data_plane = IndexMap::new();
        for (i, c) in DP_COUNTER_NAMES.iter().enumerate() {
            let v = maps.sum_percpu::<u64>("dp_counters", i as u32, |t, x| *t += x);
            data_plane.insert(c.to_string(), v);
        }
        Ok(Some(Status {
            name: self.name.clone(),
            data_plane,
            tunnel_device: inst.tunnel_device.clone(),
            graph_file: inst.graph_file.clone(),
            apps,
            links: inst.links.clone(),
        }))
    }

    /// Removes everything this data plane attached or created, and nothing else.
    pub fn teardown(&self) -> Result<bool, Error> {
        let inst = self.installed()?;
        let had = inst.is_some() || self.pin_dir.exists();
        // Deleting one end of the veth pair deletes both.
        let loop_dev = inst.as_ref().map(|i| i.loop_device.clone());
        netdev::delete(&loop_dev.unwrap_or_else(|| self.loop_device().0)).map_err(Error)?;
        netdev::delete(&self.tunnel_device()).map_err(Error)?;
        if self.pin_dir.exists() {
            // Unpinning the links detaches the programs; unpinning the maps frees them once
            // no program holds them.
            std::fs::remove_dir_all(&self.pin_dir)
                .map_err(|e| Error(format!("cannot remove {}: {e}", self.pin_dir.display())))?;
        }
        let _ = std::fs::remove_file(&self.record);
        crate::tap_claims::forget_claims(&self.runtime_dir(), &self.name);
        Ok(had)
    }
}

/// The program named `name` of the loaded object.
fn program<'o>(obj: &'o libbpf_rs::Object, name: &str) -> libbpf_rs::Program<'o> {
    obj.progs()
        .find(|p| p.name() == name)
        .expect("program in the object")
}

/// Where each app of a new plan lives in the maps, worked out from the record of what is
/// installed before anything is touched.
struct Allocation {
    apps: IndexMap<String, InstalledApp>,
    report: ApplyReport,
    /// Function apps whose settings go into a fresh slot (new or changed).
    fresh_slots: Vec<String>,
    /// State ids that new functions take: a removed app may have left state under them.
    fresh_states: Vec<u32>,
}

/// Kept apps (same function, ports and interface) keep their slot, state id and VIDs; changed
/// ones get a fresh slot and keep their state (and VIDs, when their ports are the same); new
/// ones get everything fresh. Pure: fails (out of slots or VIDs) before anything is changed.
fn allocate(
    old: &Installed,
    plan: &Plan,
    ifindexes: &HashMap<String, u32>,
) -> Result<Allocation, Error> {
    let mut used_slots: BTreeSet<u32> = old.apps.values().map(|a| a.slot).collect();
    let mut used_states: BTreeSet<u32> = old.apps.values().map(|a| a.state_id).collect();
    let mut used_vids: BTreeSet<u32> = BTreeSet::new();
    for a in old.apps.values() {
        used_vids.extend(a.base_vid..a.base_vid + a.ports.len() as u32);
    }
    let mut alloc = Allocation {
        apps: IndexMap::new(),
        report: ApplyReport::default(),
        fresh_slots: Vec::new(),
        fresh_states: Vec::new(),
    };
    for a in plan.apps.values() {
        let fingerprint = format!("{:?}", a.function);
        let prev = old
            .apps
            .get(&a.name)
            .filter(|p| p.kind_code == a.function.kind_code() && p.kind == a.function.kind_name());
        let interface = match &a.function {
            Function::Interface { ifname, .. } => Some(ifname.clone()),
            _ => None,
        };
        let ifindex = ifindexes.get(&a.name).copied().unwrap_or(0);
        let is_fn = interface.is_none();
        let mut fresh_slot = || -> Result<u32, Error> {
            match is_fn {
                true => take(&mut used_slots, 1, MAX_SLOTS, "function slots"),
                false => Ok(0),
            }
        };
        let kept = prev.is_some_and(|p| {
            p.fingerprint == fingerprint && p.ports == a.ports && p.ifindex == ifindex
        });
        let (slot, state_id, base_vid) = match prev {
            Some(p) if kept => {
                alloc.report.kept.push(a.name.clone());
                (p.slot, p.state_id, p.base_vid)
            }
            Some(p) => {
                alloc.report.changed.push(a.name.clone());
                let slot = fresh_slot()?;
                let base = if p.ports == a.ports {
                    p.base_vid
                } else {
                    take_range(&mut used_vids, a.ports.len() as u32)?
                };
                (slot, p.state_id, base)
            }
            None => {
                alloc.report.added.push(a.name.clone());
                let slot = fresh_slot()?;
                let state = if is_fn {
                    let s = take(&mut used_states, 1, MAX_SLOTS, "functions")?;
                    alloc.fresh_states.push(s);
                    s
                } else {
                    0
                };
                (
                    slot,
                    state,
                    take_range(&mut used_vids, a.ports.len() as u32)?,
                )
            }
        };
        if is_fn && !kept {
            alloc.fresh_slots.push(a.name.clone());
        }
        alloc.apps.insert(
            a.name.clone(),
            InstalledApp {
                kind: a.function.kind_name().into(),
                kind_code: a.function.kind_code(),
                fingerprint,
                ports: a.ports.clone(),
                base_vid,
                slot,
                state_id,
                interface,
                ifindex,
            },
        );
    }
    alloc.report.removed = (old.apps.keys())
        .filter(|name| !plan.apps.contains_key(*name))
        .cloned()
        .collect();
    Ok(alloc)
}

/// A fresh BPF ring buffer of `bytes` (a power of two), named `name` in `bpftool map`.
pub(crate) fn ring_buffer(name: &str, bytes: u32) -> Result<MapHandle, libbpf_rs::Error> {
    let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
        sz: size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
        ..Default::default()
    };
    MapHandle::create(libbpf_rs::MapType::RingBuf, Some(name), 0, 0, bytes, &opts)
}

/// The engine ports of `plan`: each interface whose other end is the engine, with its VID.
fn engine_ports<'a>(
    plan: &'a Plan,
    apps: &'a IndexMap<String, InstalledApp>,
) -> impl Iterator<Item = (&'a str, u32)> + 'a {
    plan.apps.values().filter_map(|a| match &a.function {
        Function::Interface {
            ifname,
            to_engine: true,
        } => Some((ifname.as_str(), apps[&a.name].base_vid)),
        _ => None,
    })
}

/// Where the ring buffer of the engine port on interface `ifname` of data plane `plane` is
/// pinned: the engine's `af_packet` app on the boundary's other end opens it (`kernel_ring`).
pub fn engine_ring_path(plane: &str, ifname: &str) -> PathBuf {
    Path::new(BPFFS)
        .join("stitch")
        .join(plane)
        .join(format!("engine-ring-{ifname}"))
}

/// Each port's VI (an interface, or a function's port), then the patch panel: each linked
/// VID to its peer, every other VID of the graph to nothing.
fn install_vids_and_links(
    maps: &Maps,
    plan: &Plan,
    apps: &IndexMap<String, InstalledApp>,
) -> Result<Vec<InstalledLink>, Error> {
    for (name, a) in apps {
        let to_engine = matches!(
            plan.apps[name].function,
            Function::Interface {
                to_engine: true,
                ..
            }
        );
        for p in 0..a.ports.len() as u32 {
            let vi = if a.slot == 0 && to_engine {
                ViInfo {
                    kind: VI_ENGINE,
                    target: a.base_vid,
                    port: 0,
                    pad: 0,
                }
            } else if a.slot == 0 {
                ViInfo {
                    kind: VI_INTERFACE,
                    target: a.ifindex,
                    port: 0,
                    pad: 0,
                }
            } else {
                ViInfo {
                    kind: VI_FUNCTION,
                    target: a.slot,
                    port: p,
                    pad: 0,
                }
            };
            maps.put("vids", &(a.base_vid + p), &vi)?;
        }
    }
    let vid = |(app, port): &(String, u32)| apps[app].base_vid + port;
    let mut links = Vec::new();
    let mut linked = BTreeSet::new();
    for l in &plan.links {
        let (from, to) = (vid(&l.from), vid(&l.to));
        maps.put("graph", &from, &to)?;
        linked.insert(from);
        links.push(InstalledLink {
            from: port_name(&plan.apps[&l.from.0], l.from.1, true),
            to: port_name(&plan.apps[&l.to.0], l.to.1, false),
            from_vid: from,
            to_vid: to,
        });
    }
    for a in apps.values() {
        for v in a.base_vid..a.base_vid + a.ports.len() as u32 {
            if !linked.contains(&v) {
                maps.put("graph", &v, &0u32)?;
            }
        }
    }
    Ok(links)
}

/// Tunnel frames by VNI to their segment port; VNIs no app declares any more are removed.
fn install_vnis(
    maps: &Maps,
    plan: &Plan,
    apps: &IndexMap<String, InstalledApp>,
) -> Result<(), Error> {
    let mut live_vnis = BTreeSet::new();
    for (name, a) in &plan.apps {
        if let Function::Vxlan { segments, .. } = &a.function {
            for (p, (vni, remote)) in segments.iter().enumerate() {
                let t = VniTarget {
                    vid: apps[name].base_vid + p as u32,
                    remote: remote.octets(),
                };
                maps.put("vxlan_vnis", vni, &t)?;
                live_vnis.insert(*vni);
            }
        }
    }
    let stale: Vec<Vec<u8>> = maps
        .get("vxlan_vnis")
        .keys()
        .filter(|k| !live_vnis.contains(&u32::from_ne_bytes([k[0], k[1], k[2], k[3]])))
        .collect();
    for k in stale {
        let _ = maps.get("vxlan_vnis").delete(&k);
    }
    Ok(())
}

fn port_name(a: &PlannedApp, port: u32, output: bool) -> String {
    match a.function {
        Function::Interface { .. } => {
            format!("{}.{}", a.name, if output { "output" } else { "input" })
        }
        _ => format!("{}.{}", a.name, a.ports[port as usize]),
    }
}

fn take(used: &mut BTreeSet<u32>, from: u32, max: u32, what: &str) -> Result<u32, Error> {
    let Some(n) = (from..max).find(|n| !used.contains(n)) else {
        return fail(format!("out of {what}: the kernel data plane holds {max}"));
    };
    used.insert(n);
    Ok(n)
}

fn take_range(used: &mut BTreeSet<u32>, len: u32) -> Result<u32, Error> {
    let mut base = 1;
    while base + len <= MAX_VIDS {
        if (base..base + len).all(|v| !used.contains(&v)) {
            used.extend(base..base + len);
            return Ok(base);
        }
        base += 1;
    }
    fail(format!(
        "out of ports: the kernel data plane holds {MAX_VIDS}"
    ))
}

/// Programs attached to an interface's TCX ingress hook.
fn tcx_programs(ifindex: u32) -> u32 {
    let mut opts = libbpf_rs::libbpf_sys::bpf_prog_query_opts {
        sz: size_of::<libbpf_rs::libbpf_sys::bpf_prog_query_opts>() as _,
        ..Default::default()
    };
    // SAFETY: valid options; no id arrays requested, only the count.
    let r = unsafe {
        libbpf_rs::libbpf_sys::bpf_prog_query_opts(
            ifindex as i32,
            libbpf_rs::libbpf_sys::BPF_TCX_INGRESS,
            &mut opts,
        )
    };
    if r == 0 {
        // SAFETY: both members of the union are the same u32.
        unsafe { opts.__bindgen_anon_1.count }
    } else {
        0
    }
}

fn write_function(maps: &Maps, a: &PlannedApp, inst: &InstalledApp) -> Result<(), Error> {
    let slot = inst.slot;
    clear_slot(maps, slot)?;
    let mut info = FnInfo {
        kind: inst.kind_code,
        base_vid: inst.base_vid,
        nports: a.ports.len() as u32,
        state_id: inst.state_id,
        ..FnInfo::default()
    };
    match &a.function {
        Function::Interface { .. } => unreachable!("interfaces have no slot"),
        Function::Forwarder => {}
        Function::Bridge {
            vlans,
            aging_seconds,
        } => {
            info.aging_ns = aging_seconds.saturating_mul(1_000_000_000);
            for (p, vlan) in vlans.iter().enumerate() {
                let bp = BridgePort {
                    vlan: *vlan,
                    pad: 0,
                };
                maps.put("bridge_ports", &(slot * MAX_PORTS + p as u32), &bp)?;
            }
        }
        Function::Router {
            ports,
            routes,
            icmp_rate,
        } => {
            info.icmp_rate = *icmp_rate;
            for (p, rp) in ports.iter().enumerate() {
                let v = RouterPort {
                    mac: rp.mac,
                    mtu: rp.mtu,
                    addr: rp.address.addr().octets(),
                    prefix_len: rp.address.prefix_len() as u32,
                };
                maps.put("router_ports", &(slot * MAX_PORTS + p as u32), &v)?;
                let key = RouteKey {
                    prefix_len: 32 + rp.address.prefix_len() as u32,
                    slot: slot.to_be_bytes(),
                    addr: rp.address.trunc().addr().octets(),
                };
                maps.put(
                    "routes",
                    &key,
                    &Route {
                        gateway: [0; 4],
                        port: p as u32,
                    },
                )?;
            }
            for r in routes {
                let key = RouteKey {
                    prefix_len: 32 + r.prefix.prefix_len() as u32,
                    slot: slot.to_be_bytes(),
                    addr: r.prefix.addr().octets(),
                };
                maps.put(
                    "routes",
                    &key,
                    &Route {
                        gateway: r.via.octets(),
                        port: r.port,
                    },
                )?;
            }
        }
        Function::Vxlan { segments, .. } => {
            for (p, (vni, remote)) in segments.iter().enumerate() {
                let seg = VxlanSegment {
                    vni: *vni,
                    remote: remote.octets(),
                };
                maps.put("vxlan_segments", &(slot * MAX_PORTS + p as u32), &seg)?;
            }
        }
        Function::Firewall {
            rules,
            default,
            stateful,
            timeouts,
        } => {
            info.nrules = rules.len() as u32;
            info.icmp_rate = 100;
            info.flags = (*default as u32) << 8 | if *stateful { FW_STATEFUL } else { 0 };
            for (i, t) in timeouts.iter().enumerate() {
                info.timeout_ns[i] = t.saturating_mul(1_000_000_000);
            }
            for (i, r) in rules.iter().enumerate() {
                maps.put("fw_rules", &(slot * MAX_RULES + i as u32), r)?;
            }
        }
    }
    maps.put("slots", &slot, &info)
}

/// Clears a slot's settings (a slot is reused only after this).
fn clear_slot(maps: &Maps, slot: u32) -> Result<(), Error> {
    maps.put("slots", &slot, &FnInfo::default())?;
    for p in 0..MAX_PORTS {
        maps.put(
            "bridge_ports",
            &(slot * MAX_PORTS + p),
            &BridgePort::default(),
        )?;
        maps.put(
            "router_ports",
            &(slot * MAX_PORTS + p),
            &RouterPort::default(),
        )?;
        maps.put(
            "vxlan_segments",
            &(slot * MAX_PORTS + p),
            &VxlanSegment::default(),
        )?;
    }
    for i in 0..MAX_RULES {
        maps.put("fw_rules", &(slot * MAX_RULES + i), &FwRule::default())?;
        maps.zero_percpu("fw_rule_hits", slot * MAX_RULES + i)?;
    }
    let routes = maps.get("routes");
    let stale: Vec<Vec<u8>> = routes
        .keys()
        .filter(|k| k.len() == size_of::<RouteKey>() && k[4..8] == slot.to_be_bytes())
        .collect();
    for k in stale {
        let _ = routes.delete(&k);
    }
    Ok(())
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub name: String,
    /// Counters of the data plane as a whole (tunnel frames nobody takes).
    pub data_plane: IndexMap<String, u64>,
    pub tunnel_device: Option<String>,
    pub graph_file: String,
    pub apps: Vec<AppStatus>,
    pub links: Vec<InstalledLink>,
}

#[derive(Debug, Serialize)]
pub struct AppStatus {
    pub name: String,
    pub kind: String,
    pub slot: u32,
    pub interface: Option<String>,
    pub attached: Option<bool>,
    pub counters: IndexMap<String, u64>,
    pub ports: Vec<PortStatus>,
}

#[derive(Debug, Serialize)]
pub struct PortStatus {
    pub port: String,
    pub vid: u32,
    #[serde(serialize_with = "stats")]
    pub stats: ViStats,
    /// Captures copying what leaves this port (`stitch capture --link --kernel`).
    pub taps: u32,
}

fn stats<S: serde::Serializer>(v: &ViStats, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(5))?;
    m.serialize_entry("rx_packets", &v.rx_packets)?;
    m.serialize_entry("rx_bytes", &v.rx_bytes)?;
    m.serialize_entry("tx_packets", &v.tx_packets)?;
    m.serialize_entry("tx_bytes", &v.tx_bytes)?;
    m.serialize_entry("drops", &v.drops)?;
    m.end()
}
