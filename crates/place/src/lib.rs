//! Placements beside the engine: one graph file whose apps say where they run
//! (`placement: engine | process | kernel | vm`), split into what the engine runs and what is
//! started around it. The engine sees only engine apps and ports; it hears of the rest through
//! the graph it is given, as it hears of any change.
//!
//! - `process`: a `function` app. The engine runs its port (an `nf_port` named after the app);
//!   the [`supervisor`] starts its `command` with the port's socket and name in the
//!   environment, restarts it when it dies and holds it to its `cpu` and `memory_mb` limits
//!   ([`cgroup`]).
//! - `vm`: a `vm` app. The engine runs its `vhost_user` port; the supervisor runs QEMU ([`vm`])
//!   and powers it down through QMP.
//! - `kernel`: the kernel apps become a kernel data plane of the instance's own, joined to the
//!   engine by veth pairs ([`kernel`]).
//!
//! [`Placements::apply`] checks everything it can first (each error names the app's line),
//! then sets up the kernel's part, applies the engine's part by diff, then starts and stops
//! processes and VMs: an app that did not change keeps its process, its port and its packets.
//! Everything it creates is named after the instance and removed on stop, when unused, and —
//! after a crash — by the next start of the same instance.
//!
//! # Map
//!
//! The modules, in short: placements beside the engine: `Placements` splits a graph by `placement:`
//! (a pure `plan`: the engine's part — a process app becomes its `nf_port`, a VM its `vhost_user`
//! port with a socket named after the instance — and the processes and VMs to run), applies the
//! engine's part by diff, then the processes; `supervisor` (a thread per process or VM: start,
//! restart with backoff, stderr tail, stop by SIGTERM or QMP power-down, then kill; a function
//! process or VM lent by a predecessor, or left running by a crashed one, adopted and watched
//! through its pidfd), `handover` (what an upgrade lends — engine apps' descriptors, function
//! processes and VMs — and the two-step take-over of the placements; the kernel data plane taken as
//! it runs, its programs loaded again by the successor), `cgroup` (cpu and memory limits, v2 or
//! v1), `confine` (what a function process may do: its user, no capabilities, `no_new_privs`, a
//! clean environment, only its descriptors), `leftovers` (the lock a running instance holds beside
//! its socket; what a dead instance left removed by `stitch cleanup` and by the next start of any
//! instance), `vm` (QEMU's command line: a vhost-user NIC, or with `rings: ivshmem` a virtio-serial
//! port to the VM's function socket), `qmp` (the QMP client: power-down, status), `hotplug` (the
//! `GuestBus` of a VM: ivshmem devices plugged and unplugged over QMP), `kernel` (kernel apps split
//! into a data plane of the instance's own, joined to the engine by veth pairs with an `af_packet`
//! app on the engine end, which reads what the kernel sends it from a BPF ring buffer).

pub mod cgroup;
pub mod confine;
pub mod handover;
pub mod hotplug;
pub mod kernel;
pub mod leftovers;
pub mod pidfd;
pub mod placed;
pub mod qmp;
pub mod supervisor;
pub mod survivors;
pub mod vm;

pub use placed::{AppPlacement, PlacedGraph, Placement};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use stitch_core::engine::{ApplyReport, EngineError};
use stitch_core::graph::{AppDecl, GraphError};
use stitch_core::{Engine, Graph, Registry, Stats};
use stitch_nf::function::{FunctionConfig, ENV_PORT, ENV_REATTACH, ENV_SOCKET, REATTACH_SECONDS};
use supervisor::{ProcessSpec, Supervisor};

/// Why a graph was not applied.
#[derive(Debug)]
pub enum PlaceError {
    /// Problems of the graph's entries, each at its line; nothing was changed.
    Graph(Vec<GraphError>),
    /// The engine refused its part; nothing was changed.
    Engine(EngineError),
    /// An app refused its entry (building it, or its new config), `at` its place in the file;
    /// nothing was changed.
    App { error: EngineError, at: GraphError },
    /// The kernel data plane or its links could not be set up; the engine's part is unchanged.
    Kernel(String),
}

impl std::fmt::Display for PlaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlaceError::Graph(errors) => {
                let lines: Vec<String> = errors
                    .iter()
                    .map(|e| format!("line {}: {}", e.line, e.message))
                    .collect();
                f.write_str(&lines.join("\n"))
            }
            PlaceError::Engine(e) => write!(f, "{e}"),
            PlaceError::App { error, at } => write!(f, "line {}: {error}", at.line),
            PlaceError::Kernel(e) => write!(f, "kernel placement: {e}"),
        }
    }
}

impl std::error::Error for PlaceError {}

/// The engine's refusal, at the entry of the app it names when there is one (a shard's at
/// its app's).
fn at_its_app(graph: &Graph, error: EngineError) -> PlaceError {
    let mut inner = &error;
    while let EngineError::RolledBack(e) = inner {
        inner = e;
    }
    let app = match inner {
        EngineError::Build { app, .. } | EngineError::Config { app, .. } => app,
        _ => return PlaceError::Engine(error),
    };
    let decl = graph.apps.get(app).or_else(|| {
        let (base, _) = app.rsplit_once(':')?;
        graph.apps.get(base)
    });
    let Some(decl) = decl else {
        return PlaceError::Engine(error);
    };
    let (line, column) = match inner {
        EngineError::Build { source, .. } => decl.locate(&source.to_string()),
        EngineError::Config { message, .. } => decl.locate(message),
        _ => (decl.line, 0),
    };
    PlaceError::App {
        at: GraphError {
            line,
            column,
            message: error.to_string(),
        },
        error,
    }
}

/// An app that changed placement in an apply.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Moved {
    pub app: String,
    pub from: Placement,
    pub to: Placement,
    /// How long the app's own traffic had no function to go through, ms: the engine's switch
    /// (the new placement was ready before it, the old one ran until it).
    pub pause_ms: f64,
    /// The state the app had that its new placement starts without, if any.
    pub state_left_behind: Option<String>,
}

/// What [`Placements::apply`] did: the engine's part and the apps that changed placement.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PlaceReport {
    #[serde(flatten)]
    pub engine: ApplyReport,
    pub moved: Vec<Moved>,
}

/// What a graph becomes: the engine's graph and the processes (function processes and VMs) to
/// keep running.
#[derive(Debug)]
pub struct Plan {
    pub engine: Graph,
    pub processes: Vec<ProcessSpec>,
    /// The kernel apps and the veth pairs joining them to the engine.
    pub kernel: Option<kernel::KernelPart>,
    /// VMs whose functions' rings are hot-plugged into them (`rings: ivshmem`).
    pub guest_buses: Vec<vm::GuestBusAt>,
}

/// Splits `graph` by placement and checks what the engine cannot: that each process's
/// program, user and files exist, that each kernel app has a kernel version. What is created
/// on the host is named after `instance`. A pure plan: nothing on the system changes.
pub fn plan(
    graph: &PlacedGraph,
    registry: &Registry,
    instance: &str,
) -> Result<Plan, Vec<GraphError>> {
    let vm_dir = vm::dir_of(instance);
    let mut errors = Vec::new();
    let mut engine = graph.graph.clone();
    let mut processes = Vec::new();
    let mut guest_buses = Vec::new();
    let instance_socket = stitch_nf::paths::socket_of(instance);
    for app in engine.apps.values_mut() {
        let place = &graph.apps[&app.name];
        if let Some(e) = cluster_keys(app, place) {
            errors.push(e);
            continue;
        }
        // A function port that names no socket is served on its instance's, so that two
        // instances with functions run side by side.
        if (app.kind == "nf_port" || app.kind == "function")
            && app.config.get("socket").is_none_or(|s| s.is_null())
        {
            app.config["socket"] = serde_json::json!(instance_socket);
        }
        match place_app(app, place.placement, &graph.graph.base_dir, &vm_dir) {
            Ok(Some(placed)) => {
                processes.push(placed.spec);
                if let Some(config) = placed.engine_config {
                    app.config = config;
                }
                if let Some(kind) = placed.engine_kind {
                    app.kind = kind.to_string();
                }
                guest_buses.extend(placed.guest_bus);
            }
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let kernel = kernel::split(
        &mut engine,
        &graph.apps,
        registry,
        &kernel::KernelNames::of(instance),
    )?;
    Ok(Plan {
        engine,
        processes,
        kernel,
        guest_buses,
    })
}

/// Whether the kernel's part gains something from `old` to `new` (a function that is new or
/// whose settings changed, a link it did not have), rather than only losing some.
fn kernel_gains(old: Option<&kernel::KernelPart>, new: Option<&kernel::KernelPart>) -> bool {
    let Some(new) = new else {
        return false;
    };
    let Some(old) = old else {
        return true;
    };
    new.graph.apps.values().any(|a| {
        old.graph
            .apps
            .get(&a.name)
            .is_none_or(|o| o.kind != a.kind || o.config != a.config)
    }) || new.graph.links.iter().any(|l| !old.graph.links.contains(l))
}

/// Apps of `new` whose placement differs from `old`'s, with the pause of their traffic (the
/// engine's switch: the new placement was ready before it, the old one ran until it) and the
/// state that did not follow them.
fn moves(old: Option<&PlacedGraph>, new: &PlacedGraph, pause_ms: f64) -> Vec<Moved> {
    let Some(old) = old else {
        return Vec::new();
    };
    new.graph
        .apps
        .values()
        .filter_map(|a| {
            let (from, to) = (old.apps.get(&a.name)?.placement, new.placement(&a.name));
            (from != to).then(|| Moved {
                app: a.name.clone(),
                from,
                to,
                pause_ms,
                state_left_behind: state_of(&a.kind).map(|s| {
                    format!("its {s} did not move: it starts empty in the {to} placement")
                }),
            })
        })
        .collect()
}

/// The state an app of `kind` learns while it runs, which no placement hands to another.
fn state_of(kind: &str) -> Option<&'static str> {
    Some(match kind {
        "firewall" => "connection table",
        "nat" => "address and port mappings",
        "bridge" => "learned MAC table",
        "router" => "ARP and neighbour caches",
        "vxlan" => "learned remote MAC addresses",
        "load_balancer" => "flow-to-backend table",
        "switch" => "flow table and counters",
        "policer" | "rate_meter" => "token buckets and rates",
        "delay" => "packets it holds",
        _ => return None,
    })
}

/// An app that names hosts belongs to a cluster graph: one instance cannot honour it.
fn cluster_keys(app: &AppDecl, place: &AppPlacement) -> Option<GraphError> {
    let (key, line, column) = place.cluster_key_at?;
    Some(GraphError {
        line,
        column,
        message: format!(
            "app `{}`: `{key}:` places apps on the hosts of a cluster; give this graph to \
             `stitch cluster apply` (one instance runs every app itself), or check it with \
             `stitch check --cluster`",
            app.name
        ),
    })
}

/// What `stitch check` adds to the graph parser's checks: every function process and VM can
/// start (programs, users and files exist), every kernel app has a kernel version, and
/// `function`/`vm` apps have their placement.
pub fn check(graph: &PlacedGraph, registry: &Registry) -> Result<(), Vec<GraphError>> {
    plan(graph, registry, "check").map(|_| ())
}

/// A process that an app placed beside the engine needs, and the app's entry as the engine
/// takes it (when the placement fills something in, as a VM's socket).
struct Placed {
    spec: ProcessSpec,
    engine_config: Option<serde_json::Value>,
    /// The engine's app type, when not the app's own (a VM with ivshmem rings: `nf_port`).
    engine_kind: Option<&'static str>,
    /// A VM whose function's memory is hot-plugged into it.
    guest_bus: Option<vm::GuestBusAt>,
}

/// What `app` needs placed beside the engine, if anything, or why it cannot run where it asks.
fn place_app(
    app: &AppDecl,
    placement: Placement,
    base_dir: &Path,
    vm_dir: &Path,
) -> Result<Option<Placed>, GraphError> {
    match placement {
        Placement::Process => process_spec(app, base_dir).map(|spec| {
            Some(Placed {
                spec,
                engine_config: None,
                engine_kind: None,
                guest_bus: None,
            })
        }),
        Placement::Vm => vm::spec(app, base_dir, vm_dir).map(Some),
        _ if app.kind == "function" || app.kind == "vm" => {
            let placement = if app.kind == "vm" { "vm" } else { "process" };
            Err(at(
                app,
                "type",
                format!(
                    "app `{}`: a `{}` runs beside the engine: give it `placement: {placement}`",
                    app.name, app.kind
                ),
            ))
        }
        _ => Ok(None),
    }
}

fn at(app: &AppDecl, key: &str, message: String) -> GraphError {
    let (line, column) = app.key_lines.get(key).copied().unwrap_or((app.line, 1));
    GraphError {
        line,
        column,
        message,
    }
}

/// The process of a `placement: process` app, its program found and its user known.
fn process_spec(app: &AppDecl, base_dir: &Path) -> Result<ProcessSpec, GraphError> {
    if app.kind != "function" {
        return Err(at(
            app,
            "type",
            format!(
                "app `{}`: type `{}` has no process version; a function process is \
                 `placement: process` with a `command` (and no type, or `type: function`)",
                app.name, app.kind
            ),
        ));
    }
    let c: FunctionConfig = serde_json::from_value(app.config.clone())
        .map_err(|e| at(app, "command", format!("app `{}`: {e}", app.name)))?;
    let program = find_program(&c.command[0], base_dir)
        .map_err(|m| at(app, "command", format!("app `{}`: command: {m}", app.name)))?;
    let user = confine::user_for(c.user.as_deref())
        .map_err(|m| at(app, "user", format!("app `{}`: user: {m}", app.name)))?;
    let socket = c
        .socket
        .as_ref()
        .map(|s| {
            if s.is_absolute() {
                s.clone()
            } else {
                base_dir.join(s)
            }
        })
        .unwrap_or_else(stitch_nf::port::default_socket);
    if let (Some(u), false) = (&user, c.privileged) {
        let key = if app.key_lines.contains_key("socket") {
            "socket"
        } else {
            "user"
        };
        confine::check_reachable(u, &socket)
            .map_err(|m| at(app, key, format!("app `{}`: {m}", app.name)))?;
    }
    let mut env: Vec<(String, String)> = c.env.into_iter().collect();
    env.push((ENV_SOCKET.into(), socket.display().to_string()));
    env.push((ENV_PORT.into(), app.name.clone()));
    env.push((ENV_REATTACH.into(), REATTACH_SECONDS.to_string()));
    Ok(ProcessSpec {
        app: app.name.clone(),
        program,
        args: c.command[1..].to_vec(),
        env,
        user,
        privileged: c.privileged,
        seccomp: c.seccomp.is_some(),
        attaches: Some((socket, app.name.clone())),
        cpu: c.cpu,
        memory_mb: c.memory_mb,
        stop: supervisor::StopBy::Term,
        stop_grace: std::time::Duration::from_secs(3),
        kind: "process",
        console: None,
    })
}

/// `name` with a `/` is a path (relative to the graph's folder); without, it is looked for
/// beside the running `stitch` (its own functions), then on `PATH`.
pub fn find_program(name: &str, base_dir: &Path) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = if name.contains('/') {
        vec![base_dir.join(name)]
    } else {
        let beside = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join(name)));
        let path = std::env::var_os("PATH").unwrap_or_default();
        beside
            .into_iter()
            .chain(std::env::split_paths(&path).map(|d| d.join(name)))
            .collect()
    };
    candidates
        .into_iter()
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            if name.contains('/') {
                format!("`{name}` is not an executable file")
            } else {
                format!("no program `{name}` beside stitch or on PATH")
            }
        })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The placements this host can run: the engine and processes always, the kernel where BPF's
/// file system is mounted, VMs where QEMU is installed.
pub fn available() -> Vec<String> {
    let mut out = vec!["engine".to_string(), "process".to_string()];
    if Path::new("/sys/fs/bpf").is_dir() {
        out.push("kernel".into());
    }
    if find_program("qemu-system-x86_64", Path::new("/")).is_ok() {
        out.push("vm".into());
    }
    out
}

/// The engine and everything placed beside it, for one instance.
pub struct Placements {
    engine: Arc<Engine>,
    /// What this instance's processes, VMs, kernel data plane and veths are named after.
    instance: String,
    /// Where this instance's VMs' sockets and consoles go.
    vm_dir: PathBuf,
    /// The graph as given (placements and all); the engine holds its own part.
    graph: Mutex<Option<PlacedGraph>>,
    supervisor: Mutex<Supervisor>,
    /// The installed kernel part, if the graph has kernel apps.
    kernel: Mutex<Option<kernel::KernelPart>>,
    /// The veth pairs of a kernel data plane a crashed run of this instance left installed,
    /// kept for the first graph to take over by diff (an adopting restart).
    kernel_left: Mutex<Option<std::collections::BTreeSet<(String, String)>>>,
    /// The VMs whose guests' memory is hot-plugged, as last offered to the function library.
    guest_buses: Mutex<Vec<vm::GuestBusAt>>,
}

impl Placements {
    pub fn new(engine: Arc<Engine>, instance: &str) -> Placements {
        Placements {
            engine,
            instance: instance.to_string(),
            vm_dir: vm::dir_of(instance),
            graph: Mutex::new(None),
            supervisor: Mutex::new(Supervisor::new(instance)),
            kernel: Mutex::new(None),
            kernel_left: Mutex::new(None),
            guest_buses: Mutex::new(Vec::new()),
        }
    }

    /// The running graph as it was given, with every app's placement.
    pub fn graph(&self) -> Option<PlacedGraph> {
        self.graph.lock().unwrap().clone()
    }

    fn kernel_names(&self) -> kernel::KernelNames {
        kernel::KernelNames::of(&self.instance)
    }

    fn data_plane(&self) -> Result<stitch_kernel::DataPlane, PlaceError> {
        stitch_kernel::DataPlane::new(&self.kernel_names().plane)
            .map_err(|e| PlaceError::Kernel(e.0))
    }

    /// Makes `graph` the running graph: checks everything (nothing changes when a check
    /// fails), then the kernel's part with the veth pairs it needs, the engine's part by diff,
    /// the processes (started once their ports exist, stopped once their ports are gone), and
    /// last removes the veth pairs no longer used.
    pub fn apply(&self, graph: PlacedGraph) -> Result<PlaceReport, PlaceError> {
        let mut current = self.graph.lock().unwrap();
        let plan =
            plan(&graph, self.engine.registry(), &self.instance).map_err(PlaceError::Graph)?;
        for p in plan.processes.iter().filter(|p| p.kind == "vm") {
            vm::make_folders(&self.vm_dir, &p.app, p.user.as_ref()).map_err(PlaceError::Kernel)?;
        }
        let mut installed = self.kernel.lock().unwrap();
        let left = self.kernel_left.lock().unwrap().take();
        // Whatever a packet will be sent to must exist before the engine switches to it: kernel
        // functions that arrive are installed first; when the kernel's part only loses
        // functions (an app moving back to the engine), the engine switches first and the
        // kernel then drops what nothing sends to any more. A data plane a crashed run left
        // forwards already: the engine opens its ports first when their veths are all there,
        // so that the interfaces are served while the programs load.
        let kernel_first = match (&left, plan.kernel.as_ref()) {
            (Some(kept), Some(part)) => !part.veths.is_subset(kept),
            _ => kernel_gains(installed.as_ref(), plan.kernel.as_ref()),
        };
        let was_installed = installed.is_some() || left.is_some();
        let old_veths = (installed.as_ref().map(|k| k.veths.clone()))
            .or(left)
            .unwrap_or_default();
        if kernel_first {
            self.apply_kernel(plan.kernel.as_ref(), was_installed, &old_veths)?;
        }
        let engine = (self.engine.apply(plan.engine)).map_err(|e| at_its_app(&graph.graph, e))?;
        self.offer_guest_buses(&plan.guest_buses);
        let moved = moves(current.as_ref(), &graph, engine.paused_ms);
        let report = PlaceReport { engine, moved };
        if !kernel_first {
            if let Err(e) = self.apply_kernel(plan.kernel.as_ref(), was_installed, &old_veths) {
                log::error!(
                    "the kernel's part could not follow the engine's: {e}; it keeps what it \
                     ran (removed when the instance stops)"
                );
            }
        }
        for m in &report.moved {
            log::info!(
                "moved `{}` from {} to {}: its traffic paused {:.1} ms{}",
                m.app,
                m.from,
                m.to,
                m.pause_ms,
                m.state_left_behind
                    .as_ref()
                    .map(|s| format!("; {s}"))
                    .unwrap_or_default()
            );
        }
        let (started, stopped) = self.supervisor.lock().unwrap().apply(plan.processes);
        if !started.is_empty() || !stopped.is_empty() {
            log::info!("processes and VMs: started {started:?}, stopped {stopped:?}");
        }
        let new_veths = plan
            .kernel
            .as_ref()
            .map(|k| k.veths.clone())
            .unwrap_or_default();
        for (k_end, _) in old_veths.difference(&new_veths) {
            if let Err(e) = stitch_kernel::netdev::delete(k_end) {
                log::warn!("kernel placement: {e}");
            }
        }
        *installed = plan.kernel;
        *current = Some(graph);
        Ok(report)
    }

    /// Makes each ivshmem VM's QMP socket the way into its guest for the function that
    /// attaches on its socket; forgets VMs that left.
    fn offer_guest_buses(&self, buses: &[vm::GuestBusAt]) {
        let mut offered = self.guest_buses.lock().unwrap();
        for gone in offered.iter().filter(|b| !buses.contains(b)) {
            stitch_nf::guest::withdraw_bus(&gone.socket);
        }
        for b in buses.iter().filter(|b| !offered.contains(b)) {
            let bus = Arc::new(hotplug::QmpBus {
                qmp: b.qmp.clone(),
                root_ports: b.root_ports.clone(),
            });
            stitch_nf::guest::offer_bus(&b.socket, bus);
        }
        *offered = buses.to_vec();
    }

    /// Installs (or changes by diff, or removes) the kernel data plane, creating the veth pairs
    /// it needs first; on failure removes the pairs this call created.
    fn apply_kernel(
        &self,
        part: Option<&kernel::KernelPart>,
        was_installed: bool,
        old_veths: &std::collections::BTreeSet<(String, String)>,
    ) -> Result<(), PlaceError> {
        let Some(part) = part else {
            if was_installed {
                self.data_plane()?
                    .teardown()
                    .map_err(|e| PlaceError::Kernel(e.0))?;
            }
            return Ok(());
        };
        let created: Vec<&(String, String)> = part.veths.difference(old_veths).collect();
        let undo = |why: String| {
            for (k_end, _) in &created {
                let _ = stitch_kernel::netdev::delete(k_end);
            }
            PlaceError::Kernel(why)
        };
        for (k_end, e_end) in &created {
            stitch_kernel::netdev::ensure_boundary_veth(k_end, e_end).map_err(&undo)?;
        }
        let plane = self.data_plane()?;
        plane
            .apply(&part.plan, &format!("<instance {}>", self.instance))
            .map_err(|e| undo(e.0))?;
        Ok(())
    }

    /// The kernel data plane's counters, if the graph has kernel apps.
    pub fn kernel_status(&self) -> Option<stitch_kernel::Status> {
        if self.kernel.lock().unwrap().is_none() {
            return None;
        }
        self.data_plane().ok()?.status().ok().flatten()
    }

    /// Where app `name` runs and, for a process, how it is doing.
    pub fn status(&self, name: &str) -> Value {
        let placement = (self.graph.lock().unwrap().as_ref())
            .map(|g| g.placement(name))
            .unwrap_or_default();
        let mut process = self.supervisor.lock().unwrap().status(name);
        if let (Some(p), Some(guest)) = (process.as_mut(), self.guest_status(name)) {
            p["guest"] = guest;
        }
        json!({ "placement": placement.name(), "process": process })
    }

    /// What this instance made on the host for its placements, as `stitch show` lists it:
    /// the kernel data plane (its pin folder), the veth pairs, the processes and VMs.
    pub fn created(&self) -> Value {
        let kernel = self.kernel.lock().unwrap();
        let veths: Vec<Value> = kernel
            .iter()
            .flat_map(|k| &k.veths)
            .map(|(k_end, e_end)| json!({ "kernel_end": k_end, "engine_end": e_end }))
            .collect();
        json!({
            "kernel_data_plane": kernel.as_ref().map(|_| self.kernel_names().plane),
            "veth_pairs": veths,
            "processes": self.supervisor.lock().unwrap().created(),
            "vm_dir": self.vm_dir.exists().then(|| self.vm_dir.clone()),
        })
    }

    /// App `name`'s guest as its QEMU sees it (`query-status` on its QMP socket: running,
    /// paused, shut down, stopped on an error), if it is a VM whose QEMU runs. Asked outside
    /// the supervisor's lock: QEMU may take its time.
    fn guest_status(&self, name: &str) -> Option<Value> {
        let qmp = self.supervisor.lock().unwrap().qmp_of(name)?;
        Some(qmp::guest_status(&qmp))
    }

    /// The supervision state of app `name`'s process, if it is one.
    pub fn process(&self, name: &str) -> Option<Value> {
        self.supervisor.lock().unwrap().status(name)
    }

    /// Removes what a crashed earlier run of this instance left: processes and cgroups, its
    /// kernel data plane (hooks, programs, pinned maps), veth pairs and VM sockets; returns
    /// what it removed, in words. Call once the instance owns its name
    /// ([`leftovers::Owner`]).
    pub fn clean_after_crash(&self) -> Vec<String> {
        self.clean_after(false)
    }

    /// [`Placements::clean_after_crash`] for the instance starting again, but what the crashed
    /// run left running is kept for the first graph to adopt: function processes and VMs
    /// (with their sockets' folder), and the kernel data plane with its veth pairs, which the
    /// first apply takes by diff (state and counters in its pinned maps kept).
    pub fn clean_after_crash_adopting(&self) -> Vec<String> {
        self.clean_after(true)
    }

    fn clean_after(&self, adopting: bool) -> Vec<String> {
        let mut removed = Vec::new();
        if self.instance.is_empty() {
            return removed;
        }
        let cgroups = self.supervisor.lock().unwrap().clean_after_crash(adopting);
        if cgroups > 0 {
            removed.push(format!("{cgroups} function cgroups (and their processes)"));
        }
        let names = self.kernel_names();
        if adopting && self.keep_kernel_left(&names) {
            return removed;
        }
        if let Ok(plane) = stitch_kernel::DataPlane::new(&names.plane) {
            match plane.teardown() {
                Ok(true) => removed.push("the kernel data plane".into()),
                Ok(false) => {}
                Err(e) => log::warn!("kernel data plane a previous run left: {}", e.0),
            }
        }
        let veths: Vec<String> = stitch_kernel::netdev::named_with(&names.veth_prefix)
            .into_iter()
            .filter(|n| n.ends_with('k'))
            .filter(|n| stitch_kernel::netdev::delete(n).is_ok())
            .collect();
        if !veths.is_empty() {
            removed.push(format!("veth pairs {}", veths.join(", ")));
        }
        if !adopting && std::fs::remove_dir_all(&self.vm_dir).is_ok() {
            removed.push(format!("VM sockets in {}", self.vm_dir.display()));
        }
        removed
    }

    /// Keeps the kernel data plane a crashed run installed, and its veth pairs, for the first
    /// apply; false when there is none.
    fn keep_kernel_left(&self, names: &kernel::KernelNames) -> bool {
        let installed = stitch_kernel::DataPlane::new(&names.plane).and_then(|p| p.installed());
        if !matches!(installed, Ok(Some(_))) {
            return false;
        }
        let pairs: std::collections::BTreeSet<(String, String)> =
            (stitch_kernel::netdev::named_with(&names.veth_prefix).into_iter())
                .filter_map(|k| Some((k.clone(), format!("{}e", k.strip_suffix('k')?))))
                .collect();
        log::info!(
            "the kernel data plane {} a crashed run of this instance left is kept for the graph \
             to take over ({} veth pairs)",
            names.plane,
            pairs.len()
        );
        *self.kernel_left.lock().unwrap() = Some(pairs);
        true
    }

    /// Stops the processes, then the engine, then the kernel data plane and its veth pairs;
    /// returns the engine's last counters.
    pub fn stop(&self) -> Stats {
        self.supervisor.lock().unwrap().stop_all();
        let stats = self.engine.stop();
        if let Some(part) = self.kernel.lock().unwrap().take() {
            if let Ok(plane) = self.data_plane() {
                if let Err(e) = plane.teardown() {
                    log::warn!("kernel data plane: {}", e.0);
                }
            }
            for (k_end, _) in &part.veths {
                let _ = stitch_kernel::netdev::delete(k_end);
            }
        }
        let _ = std::fs::remove_dir_all(&self.vm_dir);
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;
    use stitch_core::Registry;

    fn reg() -> Registry {
        let mut r = Registry::default();
        stitch_nf::register(&mut r);
        stitch_vhost::register(&mut r);
        r
    }

    fn parse(text: &str) -> PlacedGraph {
        PlacedGraph::parse(text, "g.yaml", Path::new("/"), &reg()).unwrap()
    }

    #[test]
    fn a_host_pin_is_refused_at_its_line_outside_a_cluster() {
        let g = parse("apps:\n  fw:\n    placement: process\n    command: [sh]\n    host: h1\n");
        let errors = plan(&g, &reg(), "t").unwrap_err();
        assert_eq!(errors[0].line, 5);
        assert!(
            errors[0].message.contains("stitch cluster apply"),
            "{errors:?}"
        );
    }

    #[test]
    fn a_process_app_is_an_engine_port_and_a_process_to_run() {
        let g = parse(
            "apps:\n  fw:\n    placement: process\n    command: [sh, -c, 'exit 0']\n    env: { A: b }\n    memory_mb: 8\n",
        );
        let p = plan(&g, &reg(), "t").unwrap();
        let fw = &p.engine.apps["fw"];
        assert_eq!(fw.kind, "function");
        assert_eq!(
            g.placement("fw"),
            Placement::Process,
            "the given graph keeps it"
        );
        let [spec] = &p.processes[..] else {
            panic!("{:?}", p.processes)
        };
        assert!(spec.program.ends_with("sh"), "{spec:?}");
        assert_eq!(spec.args, ["-c", "exit 0"]);
        assert_eq!(spec.memory_mb, Some(8));
        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        assert_eq!(env["A"], "b");
        assert_eq!(env[ENV_PORT], "fw");
        assert!(env.contains_key(ENV_SOCKET));
    }

    #[test]
    fn what_is_not_placed_here_is_refused_at_its_line() {
        let g = parse("apps:\n  q:\n    type: nf_port\n    placement: vm\n");
        let errors = plan(&g, &reg(), "t").unwrap_err();
        assert_eq!(errors[0].line, 3, "{errors:?}");
        assert!(errors[0].message.contains("no VM version"), "{errors:?}");
        let g = parse("apps:\n  p:\n    type: nf_port\n    placement: kernel\n");
        let errors = plan(&g, &reg(), "t").unwrap_err();
        assert_eq!(errors[0].line, 2, "{errors:?}");
        assert!(
            errors[0].message.contains("has no kernel version"),
            "{errors:?}"
        );
        let g = parse("apps:\n  p:\n    placement: process\n    command: [/no/such/program]\n");
        let errors = plan(&g, &reg(), "t").unwrap_err();
        assert_eq!(errors[0].line, 4, "{errors:?}");
        assert!(
            errors[0].message.contains("not an executable file"),
            "{errors:?}"
        );
    }

    #[test]
    fn a_vm_is_qemu_on_a_vhost_user_port_named_after_the_instance() {
        let dir = tempfile::tempdir().unwrap();
        // QEMU runs as `stitch-fn`: it must reach the guest's files.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"").unwrap();
        let mut r = Registry::default();
        stitch_vhost::register(&mut r);
        let g = PlacedGraph::parse(
            "apps:\n  vm1:\n    placement: vm\n    kernel: vmlinux\n    append: \"console=ttyS0\"\n    mac: \"52:54:00:00:00:11\"\n    qemu: /bin/true\n",
            "g.yaml",
            dir.path(),
            &r,
        )
        .unwrap();
        let vm_dir = vm::dir_of("some-instance");
        let p = plan(&g, &r, "some-instance").unwrap();
        let sock = vm_dir.join("vm1").join("vm1.sock");
        assert_eq!(
            p.engine.apps["vm1"].config["socket"],
            sock.display().to_string()
        );
        let [spec] = &p.processes[..] else {
            panic!("{:?}", p.processes)
        };
        // Confined, as its user; the port's socket is that user's.
        assert!(!spec.privileged);
        let user = spec.user.as_ref().map(|u| u.name.clone());
        assert_eq!(p.engine.apps["vm1"].config["user"], json!(user));
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(user.as_deref(), Some(confine::FUNCTION_USER));
        }
        let args = spec.args.join(" ");
        assert!(
            args.contains(&format!("-kernel {}", kernel.display())),
            "{args}"
        );
        assert!(
            args.contains(&format!("socket,id=port0,path={}", sock.display())),
            "{args}"
        );
        assert!(
            args.contains("virtio-net-pci,netdev=net0,vectors=0,mac=52:54:00:00:00:11"),
            "{args}"
        );
        assert!(args.contains("share=on"), "{args}");
        assert!(
            args.contains("-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny"),
            "{args}"
        );
        assert_eq!(
            spec.stop,
            supervisor::StopBy::Qmp(vm_dir.join("vm1").join("vm1.qmp"))
        );
        // A missing image is refused at its line.
        let g = PlacedGraph::parse(
            "apps:\n  vm1:\n    placement: vm\n    qemu: /bin/true\n    kernel: nowhere\n",
            "g.yaml",
            dir.path(),
            &r,
        )
        .unwrap();
        let errors = plan(&g, &r, "some-instance").unwrap_err();
        assert_eq!(errors[0].line, 5, "{errors:?}");
        assert!(errors[0].message.contains("kernel: no file"), "{errors:?}");
    }

    #[test]
    fn a_vm_with_ivshmem_rings_is_a_polling_function_port_on_a_socket_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.path().join("vmlinux"), b"").unwrap();
        let mut r = Registry::default();
        stitch_vhost::register(&mut r);
        stitch_nf::register(&mut r);
        let parse = |text: &str| PlacedGraph::parse(text, "g.yaml", dir.path(), &r);
        let g = parse(
            "apps:\n  vm1:\n    placement: vm\n    kernel: vmlinux\n    qemu: /bin/true\n    rings: ivshmem\n    mode: zero_copy\n",
        )
        .unwrap();
        let vm_dir = vm::dir_of("some-instance");
        let p = plan(&g, &r, "some-instance").unwrap();
        let port = &p.engine.apps["vm1"];
        let sock = vm_dir.join("vm1").join("vm1.nf");
        assert_eq!(port.kind, "nf_port");
        let runs_as: Vec<String> = p.processes[0].user.iter().map(|u| u.name.clone()).collect();
        assert_eq!(
            port.config,
            json!({ "socket": sock, "mode": "zero_copy", "wake": "polling", "allow_users": runs_as })
        );
        let args = p.processes[0].args.join(" ");
        assert!(
            args.contains(&format!("socket,id=port0,path={}", sock.display()))
                && args.contains(
                    "virtserialport,bus=stitch-serial.0,chardev=port0,name=org.stitch.nf.vm1"
                )
                && !args.contains("vhost-user"),
            "{args}"
        );
        assert_eq!(
            p.guest_buses,
            [vm::GuestBusAt {
                socket: sock,
                qmp: vm_dir.join("vm1").join("vm1.qmp"),
                root_ports: Vec::new(),
            }]
        );
        // A PCI Express machine, whose root bus takes no hot-plug: root ports for the devices,
        // each with room for the packet memory's BAR.
        for (machine, ports) in [
            ("[-machine, q35]", 8),
            ("[-M, 'pc-q35-7.2,accel=tcg']", 8),
            ("[-machine, 'type=q35']", 8),
            ("[-machine, pc]", 0),
            ("[-name, q35]", 0),
        ] {
            let g = parse(&format!(
                "apps:\n  vm1:\n    placement: vm\n    kernel: vmlinux\n    qemu: /bin/true\n    rings: ivshmem\n    qemu_args: {machine}\n",
            ))
            .unwrap();
            let p = plan(&g, &r, "some-instance").unwrap();
            let args = p.processes[0].args.join(" ");
            assert_eq!(p.guest_buses[0].root_ports.len(), ports, "{machine}");
            assert_eq!(args.matches("pcie-root-port").count(), ports, "{args}");
            if ports > 0 {
                assert!(
                    args.contains(
                        "pcie-root-port,id=stitch-rp7,chassis=207,bus=pcie.0,pref64-reserve=1G"
                    ),
                    "{args}"
                );
            }
        }
        // `mode` belongs to the ivshmem rings: refused at its app without them.
        let e = match parse(
            "apps:\n  vm1:\n    placement: vm\n    kernel: vmlinux\n    qemu: /bin/true\n    mode: zero_copy\n",
        ) {
            Err(e) => e.to_string(),
            Ok(g) => format!("{:?}", plan(&g, &r, "some-instance").unwrap_err()),
        };
        assert!(e.contains("rings: ivshmem"), "{e}");
    }
}
