//! `function`: a function process Stitch starts, attaches and supervises (`placement: process`).
//!
//! On the engine's side it is an [`NfPort`] named after the app; the command, its environment
//! and its limits are read by whatever supervises processes beside the engine (`stitch-place`),
//! which starts the command with [`ENV_SOCKET`] and [`ENV_PORT`] set, so a function built on
//! [`crate::client::Function::attach_from_env`] needs no arguments.
//!
//! ```yaml
//! apps:
//!   fw:
//!     placement: process
//!     command: [stitch-nf-firewall, --drop-proto, udp]
//!     env: { RUST_LOG: info }
//!     memory_mb: 64       # cgroup memory limit
//!     cpu: 0.5            # cgroup CPU quota, in CPUs
//!     mode: isolated      # the nf_port settings: mode, wake (default blocking), batch, max_delay_us, ring_size, buffer_size
//! ```

use crate::port::{Mode, NfPort, NfPortConfig, Wake};
use indexmap::IndexMap;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Instant;
use stitch_core::app::{AppContext, AppError, Io, PortSpec, Reconfigured};
use stitch_core::App;

/// The attach socket a supervised function connects to.
pub const ENV_SOCKET: &str = "STITCH_NF_SOCKET";
/// The port a supervised function asks for.
pub const ENV_PORT: &str = "STITCH_NF_PORT";
/// Seconds a supervised function waits for its port to be served again when the Stitch
/// process serving it ends (`client::Function::reattach`): the Stitch started in its place
/// adopts the function instead of starting another.
pub const ENV_REATTACH: &str = "STITCH_NF_REATTACH_SECONDS";
/// What Stitch sets [`ENV_REATTACH`] to: long enough for systemd or `stitch run --supervise`
/// to start Stitch again, short enough that a function does not outlive its instance by much.
pub const REATTACH_SECONDS: u32 = 10;

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FunctionConfig {
    /// The program and its arguments. A program without a `/` is looked for beside the
    /// `stitch` binary first (Stitch's own functions), then on `PATH`.
    pub command: Vec<String>,
    /// Variables added to the function's environment.
    #[serde(default)]
    pub env: IndexMap<String, String>,
    /// The user the function runs as (default for a Stitch running as root: the system user
    /// `stitch-fn`), without capabilities, with `no_new_privs`, a clean environment and no
    /// descriptor of Stitch's (`docs/security.md`).
    #[serde(default)]
    pub user: Option<String>,
    /// Keep root's capabilities and Stitch's environment (a function that must have them);
    /// the explicit word for an unconfined process.
    #[serde(default)]
    pub privileged: bool,
    /// A system-call filter: `default` lets through what a function on Stitch's rings needs
    /// (memory, files, threads, waiting, Unix sockets) and answers anything else EPERM.
    #[serde(default)]
    pub seccomp: Option<Seccomp>,
    /// CPU quota, in CPUs (0.5: half of one), enforced by a cgroup.
    #[serde(default)]
    pub cpu: Option<f64>,
    /// Memory limit in MiB, enforced by a cgroup.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Attach socket (default: the instance's, `/run/stitch-fn/INSTANCE.sock` for root).
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// The rings' kind, as the `nf_port`'s.
    #[serde(default)]
    pub mode: Mode,
    /// `blocking` by default: a supervised function sleeps on its doorbell when idle instead
    /// of spinning on a core it shares (`polling` for the lowest latency on a core of its own).
    #[serde(default = "blocking")]
    pub wake: Wake,
    /// Blocking: wake the function when this many packets wait (the `nf_port`'s default when
    /// unset).
    #[serde(default)]
    pub batch: Option<u32>,
    /// Blocking: wake it anyway when the oldest packet has waited this many microseconds.
    #[serde(default)]
    pub max_delay_us: Option<u64>,
    /// Descriptors per ring (a power of two).
    #[serde(default)]
    pub ring_size: Option<u32>,
    /// Isolated: bytes per buffer slot (longer packets are dropped and counted).
    #[serde(default)]
    pub buffer_size: Option<u32>,
}

/// The system-call filters a function may ask for.
#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq,
)]
#[serde(rename_all = "snake_case")]
pub enum Seccomp {
    Default,
}

fn blocking() -> Wake {
    Wake::Blocking
}

impl FunctionConfig {
    /// The port's settings, the `nf_port` defaults where the entry gives none.
    pub fn port_config(&self) -> NfPortConfig {
        let mut c: NfPortConfig =
            serde_json::from_value(serde_json::json!({})).expect("nf_port has defaults");
        c.socket = self.socket.clone();
        c.mode = self.mode;
        c.wake = self.wake;
        c.batch = self.batch.unwrap_or(c.batch);
        c.max_delay_us = self.max_delay_us.unwrap_or(c.max_delay_us);
        c.ring_size = self.ring_size.unwrap_or(c.ring_size);
        c.buffer_size = self.buffer_size.unwrap_or(c.buffer_size);
        c
    }

    /// What the entry asks of the process, checked without touching the system.
    fn check(&self) -> Result<(), String> {
        match self.command.first() {
            None => return Err("`command` names no program".into()),
            Some(p) if p.is_empty() => return Err("`command`'s program is empty".into()),
            _ => {}
        }
        if let Some(cpu) = self.cpu {
            if !(cpu > 0.0 && cpu <= 1024.0) {
                return Err(format!("cpu {cpu}: give a share of CPUs above 0, like 0.5"));
            }
        }
        if self.memory_mb == Some(0) {
            return Err("memory_mb 0: give a limit in MiB, like 64".into());
        }
        if let Some(k) = self.env.keys().find(|k| k.is_empty() || k.contains('=')) {
            return Err(format!("env: `{k}` is not a variable name"));
        }
        Ok(())
    }
}

/// The engine's side of a supervised function: its port.
pub struct FunctionPort(NfPort);

impl App for FunctionPort {
    type Config = FunctionConfig;
    const EXAMPLE: &'static str = "command: [stitch-nf-firewall]
cpu: 0.5
memory_mb: 64
seccomp: default
";

    fn declare(c: &FunctionConfig) -> Result<PortSpec, AppError> {
        c.check()?;
        NfPort::declare(&c.port_config())
    }

    fn new(c: FunctionConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        NfPort::new(c.port_config(), ctx).map(FunctionPort)
    }

    fn reconfigure(
        &mut self,
        c: FunctionConfig,
        ctx: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        self.0.reconfigure(c.port_config(), ctx)
    }

    fn pull(&mut self, io: &mut Io) {
        self.0.pull(io)
    }

    fn push(&mut self, io: &mut Io) {
        self.0.push(io)
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        self.0.tick(io, now)
    }

    fn stop(&mut self) {
        self.0.stop()
    }

    fn query(&mut self, request: &serde_json::Value) -> serde_json::Value {
        self.0.query(request)
    }

    fn hand_over(&mut self) -> Option<stitch_core::Descriptors> {
        self.0.hand_over()
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        self.0.take_position(position)
    }

    fn outstanding(&self) -> u64 {
        self.0.outstanding()
    }
}
