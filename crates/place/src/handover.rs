//! An instance's placements handed to a Stitch process taking over (`stitch upgrade`): the
//! engine's apps lend their descriptors ([`stitch_core::Engine::lend_descriptors`]), function
//! processes keep running and are adopted by the successor's supervisor
//! ([`Supervisor::adopt`]), their ports staying attached (`nf_port` hands over its
//! function's connection and rings); so are VMs (QEMU adopted, its `vhost_user` port handing
//! over its guest's connection and rings). The kernel data plane stays where it is (pinned, it
//! needs no process): the successor's boundary ports read the same BPF ring buffers on from
//! where the predecessor stopped, and once it runs the graph it loads its own programs into
//! the data plane with the pinned maps — state and counters — kept, as any apply does.

use crate::kernel::KernelPart;
use crate::placed::PlacedGraph;
use crate::supervisor::ProcessSpec;
use crate::{plan, PlaceError, PlaceReport, Placements};
use std::collections::BTreeMap;
use stitch_core::engine::{HandedApp, HandedLink, Prepared, RestoreReport};
use stitch_core::Descriptors;

/// What a running instance lends its successor: each engine app's descriptors (by app, with
/// its type) and each running function process's ([`Supervisor::lend`]).
pub struct Lent {
    pub apps: BTreeMap<String, (String, Descriptors)>,
    pub processes: BTreeMap<String, Descriptors>,
}

/// A graph built on lent descriptors, waiting for the predecessor's final word.
pub struct Inheriting {
    graph: PlacedGraph,
    engine: Prepared,
    processes: Vec<ProcessSpec>,
    lent_processes: BTreeMap<String, Descriptors>,
    kernel: Option<KernelPart>,
}

impl Placements {
    /// Duplicates of what carries the instance's traffic, for a successor that builds on them
    /// while this process runs on.
    pub fn lend(&self) -> Result<Lent, PlaceError> {
        let apps = self.engine.lend_descriptors().map_err(PlaceError::Engine)?;
        let processes = self.supervisor.lock().unwrap().lend();
        Ok(Lent { apps, processes })
    }

    /// [`Placements::apply`] for a process taking over from another (`stitch upgrade`), first
    /// half: the engine's apps are built on the descriptors the predecessor lent
    /// ([`stitch_core::Engine::prepare_inheriting`]); function processes and VMs are adopted at
    /// the commit, and the kernel data plane taken as it runs.
    pub fn prepare_inheriting(
        &self,
        graph: PlacedGraph,
        lent: Lent,
    ) -> Result<Inheriting, PlaceError> {
        let plan =
            plan(&graph, self.engine.registry(), &self.instance).map_err(PlaceError::Graph)?;
        // Before the engine's apps: a function port lent with a guest's function maps nothing
        // new, but plugs that guest's channels through here.
        self.offer_guest_buses(&plan.guest_buses);
        let engine = (self.engine)
            .prepare_inheriting(plan.engine, lent.apps)
            .map_err(PlaceError::Engine)?;
        Ok(Inheriting {
            graph,
            engine,
            processes: plan.processes,
            lent_processes: lent.processes,
            kernel: plan.kernel,
        })
    }

    /// Second half: the prepared graph starts with the predecessor's final positions,
    /// counters and state ([`stitch_core::Engine::commit_inheriting`]), then the function
    /// processes it ran are adopted (those that ended meanwhile are started again) and the
    /// kernel data plane is taken as it runs ([`Placements::reload_kernel`] gives it this
    /// binary's programs).
    pub fn commit_inheriting(
        &self,
        inheriting: Inheriting,
        finals: BTreeMap<String, HandedApp>,
        links: &BTreeMap<String, HandedLink>,
    ) -> Result<(PlaceReport, RestoreReport), PlaceError> {
        let mut current = self.graph.lock().unwrap();
        let (engine, restored) = (self.engine)
            .commit_inheriting(inheriting.engine, finals, links)
            .map_err(PlaceError::Engine)?;
        let (started, _) = (self.supervisor.lock().unwrap())
            .adopt(inheriting.processes, inheriting.lent_processes);
        if !started.is_empty() {
            log::info!(
                "processes started again (they were not running to be taken over): {started:?}"
            );
        }
        *self.kernel.lock().unwrap() = inheriting.kernel;
        *current = Some(inheriting.graph);
        Ok((
            PlaceReport {
                engine,
                moved: Vec::new(),
            },
            restored,
        ))
    }

    /// After a take-over, once the predecessor has left: the kernel data plane gets this
    /// binary's programs, its pinned maps (state, counters) kept, as any apply does; it
    /// forwards throughout. Returns how long the load took, if the graph has kernel apps. A
    /// failure leaves the predecessor's programs running (the next apply replaces them).
    pub fn reload_kernel(&self) -> Option<std::time::Duration> {
        let installed = self.kernel.lock().unwrap();
        let part = installed.as_ref()?;
        let t = std::time::Instant::now();
        if let Err(e) = self.apply_kernel(Some(part), true, &part.veths) {
            log::error!("the kernel data plane keeps the previous process's programs: {e}");
        }
        Some(t.elapsed())
    }
}
