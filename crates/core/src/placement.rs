//! Where an app runs, as a graph file says it (`placement:`).

use serde::Deserialize;
use std::fmt;

/// Where an app runs: in Stitch's engine, as an eBPF program in the kernel's data plane, as a
/// function process Stitch starts and supervises, or in a VM. Set per app with `placement:`,
/// or for the whole file with a top-level `placement:`. The engine runs only `engine` apps;
/// what places the others sits beside it (`stitch-place`, `stitch kernel apply`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    #[default]
    #[serde(alias = "userspace")]
    Engine,
    Kernel,
    Process,
    Vm,
}

impl Placement {
    pub const ALL: [Placement; 4] = [
        Placement::Engine,
        Placement::Kernel,
        Placement::Process,
        Placement::Vm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Engine => "engine",
            Placement::Kernel => "kernel",
            Placement::Process => "process",
            Placement::Vm => "vm",
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
