//! `placement: kernel` in a mixed graph: the kernel apps become a kernel data plane of the
//! instance's own (`stitch-kernel`), and every link between a kernel app and an engine app goes
//! through a veth pair Stitch creates: its kernel end is a workload interface of the data plane
//! (hooked at tc ingress, where the kernel functions send to it), its engine end an `af_packet`
//! app of the engine. One pair per kernel port that has links to the engine, named after the
//! instance and the port, so a changed graph keeps the pairs it still uses.
//!
//! Toward the kernel, the engine's `af_packet` app writes into its TPACKET ring and the
//! frames enter the data plane at tc ingress of the kernel end. Toward the engine, the data
//! plane does not send back through the pair: the kernel end is an *engine port*
//! (`to_engine`), whose packets the data plane copies into a BPF ring buffer pinned for the
//! instance (`stitch_kernel::engine_ring_path`), and the same `af_packet` app reads that ring
//! (`kernel_ring`) with no system call. A redirect back through the pair cost a second pass
//! through the host's stack — veth transmit, backlog, receive, the packet socket's copy —,
//! which made a crossing cost about two `af_packet` hops (docs/benchmarks.md: `stitch bench
//! placement`). `af_xdp` on the engine end would need an XDP program on the peer, binds to a
//! veth in copy mode only, and sees nothing of a tc redirect.

use crate::placed::{AppPlacement, Placement};
use indexmap::IndexMap;
use std::collections::BTreeSet;
use stitch_core::graph::{AppDecl, Endpoint, Graph, GraphError, LinkDecl};
use stitch_core::Registry;
use stitch_nf::paths::name_hash as hash;

/// What the kernel runs for one graph, and the veth pairs joining it to the engine.
#[derive(Debug, Clone)]
pub struct KernelPart {
    /// The kernel apps, with an `af_packet` app on the kernel end of each pair.
    pub graph: Graph,
    pub plan: stitch_kernel::Plan,
    /// (kernel end, engine end) of each pair.
    pub veths: BTreeSet<(String, String)>,
}

/// The names an instance's kernel side goes by: its data plane, and the prefix of its veths.
#[derive(Debug, Clone)]
pub struct KernelNames {
    pub plane: String,
    pub veth_prefix: String,
}

impl KernelNames {
    pub fn of(instance: &str) -> KernelNames {
        let h = hash(instance);
        KernelNames {
            // A data plane's name holds up to 10 characters, an interface's 15.
            plane: format!("p{:08x}", h as u32),
            // sx + 6 + 5 (the port) + k/e = 14 of an interface name's 15.
            veth_prefix: format!("sx{:06x}", h >> 40),
        }
    }
}

/// A problem at `line` (column 0: the line is known, not where on it).
fn error(line: usize, message: String) -> GraphError {
    GraphError {
        line,
        column: 0,
        message,
    }
}

/// One app entry parsed as a graph file would give it (so its ports are declared by its type).
fn app_entry(
    name: &str,
    entry: &str,
    base: &Graph,
    registry: &Registry,
) -> Result<AppDecl, Vec<GraphError>> {
    let text = format!("apps:\n  {name}: {entry}\n");
    let g = Graph::parse(&text, "<placement>", &base.base_dir, registry)
        .map_err(|e| e.errors.clone())?;
    Ok(g.apps[name].clone())
}

/// Moves the kernel apps of `engine` into a graph of their own and joins them to the engine's
/// apps through veth pairs (an `af_packet` app on each end). `None`: no kernel apps.
pub fn split(
    engine: &mut Graph,
    places: &IndexMap<String, AppPlacement>,
    registry: &Registry,
    names: &KernelNames,
) -> Result<Option<KernelPart>, Vec<GraphError>> {
    let kernel_apps: Vec<String> = engine
        .apps
        .values()
        .filter(|a| {
            places
                .get(&a.name)
                .is_some_and(|p| p.placement == Placement::Kernel)
        })
        .map(|a| a.name.clone())
        .collect();
    if kernel_apps.is_empty() {
        return Ok(None);
    }
    let mut kernel = Graph {
        engine: engine.engine.clone(),
        workers: Default::default(),
        apps: Default::default(),
        links: Vec::new(),
        base_dir: engine.base_dir.clone(),
    };
    for name in &kernel_apps {
        if let Some(app) = engine.apps.shift_remove(name) {
            kernel.apps.insert(name.clone(), app);
        }
    }
    let mut errors = Vec::new();
    let mut veths = BTreeSet::new();
    let mut engine_links = Vec::new();
    for link in std::mem::take(&mut engine.links) {
        let from_kernel = kernel.apps.contains_key(&link.from.app);
        let to_kernel = kernel.apps.contains_key(&link.to.app);
        match (from_kernel, to_kernel) {
            (true, true) if link.latency => errors.push(error(
                link.line,
                format!(
                    "link `{}`: latency is measured by the engine, and both apps of this link \
                     are placed in the kernel: measure it on a link into or out of the engine",
                    link.spec()
                ),
            )),
            (true, true) => kernel.links.push(link),
            (false, false) => engine_links.push(link),
            _ => {
                let end = if from_kernel { &link.from } else { &link.to };
                let boundary = format!("kernel-{}-{}", end.app, end.port);
                if !kernel.apps.contains_key(&boundary) {
                    match add_boundary(&boundary, end, &link, names, engine, &mut kernel, registry)
                    {
                        Ok(pair) => {
                            veths.insert(pair);
                        }
                        Err(mut e) => {
                            errors.append(&mut e);
                            continue;
                        }
                    }
                }
                let (kernel_link, engine_link) = cut_link(&link, &boundary, from_kernel);
                kernel.links.push(kernel_link);
                engine_links.push(engine_link);
            }
        }
    }
    engine.links = engine_links;
    let mut plan = stitch_kernel::Plan::from_graph(&kernel).map_err(|mut e| {
        errors.append(&mut e);
        std::mem::take(&mut errors)
    })?;
    for app in plan.apps.values_mut() {
        if let stitch_kernel::plan::Function::Interface { ifname, to_engine } = &mut app.function {
            *to_engine = veths.iter().any(|(k_end, _)| k_end == ifname);
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(Some(KernelPart {
        graph: kernel,
        plan,
        veths,
    }))
}

/// The two `af_packet` apps named `boundary` where a link crosses between the kernel and the
/// engine at `end` — one in each graph, on the two ends of a veth pair named after the end —
/// and the pair's names.
fn add_boundary(
    boundary: &str,
    end: &Endpoint,
    link: &LinkDecl,
    names: &KernelNames,
    engine: &mut Graph,
    kernel: &mut Graph,
    registry: &Registry,
) -> Result<(String, String), Vec<GraphError>> {
    if engine.apps.contains_key(boundary) {
        return Err(vec![error(
            link.line,
            format!(
                "link `{}`: Stitch names the kernel ↔ engine boundary of `{end}` \
                 `{boundary}`, and an app of the graph has that name: rename it",
                link.spec()
            ),
        )]);
    }
    let tag = hash(&format!("{}.{}", end.app, end.port)) & 0xf_ffff;
    let k_end = format!("{}{tag:05x}k", names.veth_prefix);
    let e_end = format!("{}{tag:05x}e", names.veth_prefix);
    let k = app_entry(
        boundary,
        &format!("{{ type: af_packet, interface: {k_end} }}"),
        engine,
        registry,
    );
    let ring = stitch_kernel::engine_ring_path(&names.plane, &k_end);
    let e = app_entry(
        boundary,
        &format!(
            "{{ type: af_packet, interface: {e_end}, kernel_ring: \"{}\" }}",
            ring.display()
        ),
        engine,
        registry,
    );
    match (k, e) {
        (Ok(k), Ok(e)) => {
            kernel.apps.insert(boundary.to_string(), k);
            engine.apps.insert(boundary.to_string(), e);
            Ok((k_end, e_end))
        }
        (k, e) => Err(k.err().into_iter().chain(e.err()).flatten().collect()),
    }
}

/// A link that crosses at `boundary`, cut in two: the kernel graph's half and the engine's.
fn cut_link(link: &LinkDecl, boundary: &str, from_kernel: bool) -> (LinkDecl, LinkDecl) {
    let input = Endpoint {
        app: boundary.to_string(),
        port: "input".into(),
    };
    let output = Endpoint {
        app: boundary.to_string(),
        port: "output".into(),
    };
    let ((kf, kt), (ef, et)) = if from_kernel {
        ((link.from.clone(), input), (output, link.to.clone()))
    } else {
        ((output, link.to.clone()), (link.from.clone(), input))
    };
    let half = |from, to, latency| LinkDecl {
        from,
        to,
        size: link.size,
        latency,
        line: link.line,
    };
    // The engine's half measures: the kernel's cannot.
    (half(kf, kt, false), half(ef, et, link.latency))
}

/// The kernel data plane of a graph whose apps are all placed in the kernel (`stitch kernel
/// apply`); an app placed elsewhere is an error at its line.
pub fn kernel_only(graph: &crate::PlacedGraph) -> Result<stitch_kernel::Plan, Vec<GraphError>> {
    let elsewhere: Vec<GraphError> = (graph.graph.apps.values())
        .filter(|a| graph.placement(&a.name) != Placement::Kernel)
        .map(|a| {
            error(
                a.line,
                format!(
                    "app `{}` is placed in user space: the kernel data plane takes graphs \
                     whose apps all have `placement: kernel` (per app, or once at the top of \
                     the file)",
                    a.name
                ),
            )
        })
        .collect();
    if !elsewhere.is_empty() {
        return Err(elsewhere);
    }
    stitch_kernel::Plan::from_graph(&graph.graph)
}
