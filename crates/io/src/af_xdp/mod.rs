//! `af_xdp`: kernel-bypass interface port. An XDP program redirects the packets of each chosen
//! queue to an AF_XDP socket whose rings and frame memory (UMEM) are shared with Stitch; sending
//! goes through the socket's TX ring. Zero-copy where the driver supports it, copy mode otherwise
//! (veth supports only copy); native (driver) XDP, or generic XDP where the driver has none.
//!
//! Frames are copied between the UMEM and the packet pool at the edge: UMEM chunks are at most a
//! page, pool buffers hold jumbo frames, and the copy of one frame costs less than the kernel's
//! own copy into the UMEM in copy mode. Packets the program does not redirect (queues without a
//! socket) go on to the kernel stack.
//!
//! Offloads: XDP sees packets after the sender's checksum offload and without its state, so a
//! TCP/UDP packet from a local sender (veth, TAP) may carry only the pseudo-header sum in its
//! checksum field. `complete_checksums` (default on) recognises exactly that value and completes
//! the checksum — this is why TCP works here where Open vSwitch's afxdp ports need `ethtool -K
//! … tx off`. The veth driver itself stops its peer's TSO while an XDP program is attached.
//!
//! Steering: `steer` rules (tcpdump filter expressions, tried in order) send the frames they
//! match out another port of this app, classified in the kernel by the XDP program (the
//! expressions are translated to eBPF, `stitch_wire::filter::ebpf`) before Stitch sees them:
//! each rule's frames arrive on an AF_XDP socket of their own that shares the queue's UMEM.
//! When a rule's port is linked to a zero-copy function port, the function reads that socket's
//! receive ring itself (`stitch_xsk::lend`, `stitch_nf::steer`): the engine neither receives nor counts those
//! frames (`steered_function_packets` counts them as they come back); when the function
//! leaves, this app reads the socket again from where its frames came back.
//!
//! ```yaml
//! apps:
//!   nic: { type: af_xdp, interface: eth0, queues: [0, 1], xdp_mode: native, zero_copy: auto }
//!   edge:
//!     type: af_xdp
//!     interface: eth1
//!     steer: [{ match: "udp and dst port 4789", to: vxlan }]   # port `vxlan` besides `output`
//! ```
//!
//! The module's parts, one job each: `socket` (the sockets, their UMEM and rings, set up or
//! taken over), `datapath` (receiving and sending a burst through the rings), `steering` (the
//! rules, their sockets and lending them to a function), `handover` (what an upgrade hands the
//! successor). The ring protocol itself is `stitch_xsk::ring`'s.

mod datapath;
mod handover;
mod socket;
mod steering;

use crate::netdev;
use crate::xdp::XdpRedirect;
use datapath::BURST;
use handover::adopt;
use serde::Deserialize;
use socket::{Steered, XdpStatistics, Xsk, XDP_STATISTICS};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use steering::{steer_ports, Lending, Retiring, MAX_RULES};
pub use steering::{steering_rules, SteerRule};
use stitch_core::{App, AppContext, AppError, Counter, Descriptors, Io, PortSpec};
use stitch_xsk::ring::getsockopt;

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native if the driver has it, generic otherwise.
    #[default]
    Auto,
    Native,
    Generic,
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum ZeroCopy {
    /// Zero-copy if the driver supports it, copy mode otherwise.
    #[default]
    Auto,
    On,
    Off,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AfXdpConfig {
    /// The Linux interface; it must exist when the app starts.
    pub interface: String,
    /// The interface's receive queues to serve, one AF_XDP socket each; the others go on to the
    /// kernel stack.
    #[serde(default = "queue0")]
    pub queues: Vec<u32>,
    /// How the XDP program is attached.
    #[serde(default)]
    pub xdp_mode: XdpMode,
    /// Whether the UMEM is shared with the driver (no copy) or frames are copied by the kernel.
    #[serde(default)]
    pub zero_copy: ZeroCopy,
    /// Frames of UMEM per queue (half for receiving, half for sending).
    #[serde(default = "default_frames")]
    pub frames: u32,
    /// Complete TCP/UDP checksums that a local sender left partial (only the pseudo-header sum), so
    /// that TCP works without turning offloads off.
    #[serde(default = "yes")]
    pub complete_checksums: bool,
    /// Rules tried in order by the XDP program: the frames a rule matches leave by its port.
    #[serde(default)]
    pub steer: Vec<SteerRule>,
}

impl AfXdpConfig {
    /// Whether `other` differs from this config in its steering rules only.
    fn same_but_rules(&self, other: &AfXdpConfig) -> bool {
        let bare = |c: &AfXdpConfig| AfXdpConfig {
            steer: Vec::new(),
            ..c.clone()
        };
        bare(self) == bare(other)
    }

    /// One more than the highest queue id: the size of the XDP maps' per-queue ranges.
    fn queue_bound(&self) -> u32 {
        self.queues.iter().max().copied().unwrap_or(0) + 1
    }

    /// Each rule's program, or the reason a rule is refused.
    fn steer_programs(&self) -> Result<Vec<Vec<stitch_wire::filter::cbpf::Insn>>, String> {
        if self.steer.len() > MAX_RULES {
            return Err(format!(
                "steer: at most {MAX_RULES} rules, got {}",
                self.steer.len()
            ));
        }
        (self.steer.iter().enumerate())
            .map(|(i, r)| {
                let valid = !r.to.is_empty()
                    && r.to != "output"
                    && r.to.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if !valid {
                    return Err(format!(
                        "steer rule {}: `to: {}` must name a port of its own (letters, digits, _ and -; not `output`)",
                        i + 1,
                        r.to
                    ));
                }
                stitch_wire::filter::PacketFilter::compile(&r.filter)
                    .map(|f| f.instructions())
                    .map_err(|e| format!("steer rule {}: {e}", i + 1))
            })
            .collect()
    }
}

fn queue0() -> Vec<u32> {
    vec![0]
}
fn default_frames() -> u32 {
    4096
}
fn yes() -> bool {
    true
}

/// The XDP program attached to the interface and a socket per queue, bound and mapped.
fn open(c: &AfXdpConfig, ifindex: u32) -> Result<(XdpRedirect, Vec<Xsk>), String> {
    let name = &c.interface;
    let max_queue = c.queue_bound();
    let rules = c.steer_programs()?;
    let attach = |native| XdpRedirect::attach(name, ifindex, native, max_queue, &rules);
    let xdp = match c.xdp_mode {
        XdpMode::Native => attach(true)?,
        XdpMode::Generic => attach(false)?,
        XdpMode::Auto => match attach(true) {
            Ok(x) => x,
            Err(e) if e.contains("no native XDP") => {
                log::warn!("{e}; using generic XDP");
                attach(false)?
            }
            Err(e) => return Err(e),
        },
    };
    let ports = steer_ports(&c.steer);
    let mut socks = Vec::new();
    for &q in &c.queues {
        let mut x = Xsk::open(name, ifindex, q, c.frames, c.zero_copy)?;
        for (p, port) in ports.iter().enumerate() {
            let steered = Steered::open(&x, ifindex, p + 1)?;
            for (rule, _) in c.steer.iter().enumerate().filter(|(_, r)| &r.to == port) {
                xdp.bind_steered(rule, q, steered.fd.as_raw_fd())?;
            }
            x.steered.push(steered);
        }
        xdp.bind_queue(q, x.fd.as_raw_fd())?;
        socks.push(x);
    }
    Ok((xdp, socks))
}

pub struct AfXdp {
    socks: Vec<Xsk>,
    xdp: XdpRedirect,
    /// The XSKMAP entries are this process's to remove when the port goes (not while a
    /// predecessor still serves the sockets it lent).
    owns: bool,
    complete_checksums: bool,
    next_rx: usize,
    next_tx: usize,
    last_stats: Instant,
    kernel_drops: Counter,
    checksums_completed: Counter,
    rx_malformed: Counter,
    pool_exhausted: Counter,
    tx_full: Counter,
    interface: String,
    /// The longest frame the interface takes, read again each second.
    max_frame: usize,
    too_big: Counter,
    /// Packets received per queue (`queueN_rx_packets`), to see how traffic spreads.
    queue_rx: Vec<Counter>,
    /// Frames the steering rules sent to their ports.
    steered: Counter,
    /// Steered frames dropped because their port has no link.
    unlinked: Counter,
    /// Per steering port: its sockets lent to a function, or waiting to be.
    lending: Vec<Lending>,
    /// Steered frames a function read straight from the rings and gave back.
    function_steered: Counter,
    /// When this app took its sockets over from a predecessor.
    taken_over_at: Instant,
    /// Steering sockets of ports the rules no longer have, kept until a function they were
    /// lent to has given back what it read; then the frames left in their rings go back to
    /// the fill ring (counted) and the sockets close.
    retiring: Vec<Retiring>,
    removed_drops: Counter,
    config: AfXdpConfig,
    ifindex: u32,
}

impl Drop for AfXdp {
    fn drop(&mut self) {
        for o in self.lending.iter().filter_map(|l| l.offer.as_ref()) {
            o.offer.end.store(true, Ordering::Release);
        }
        if !self.owns {
            return;
        }
        for s in &self.socks {
            self.xdp.unbind_queue(s.queue);
        }
    }
}

impl AfXdp {
    /// Takes up to `budget` frames from queue socket `s`'s receive ring (or, with `steered`,
    /// from that steering socket's) into `out`; without `out` they are dropped and counted.
    fn receive(
        &mut self,
        s: usize,
        steered: Option<usize>,
        out: Option<&mut stitch_core::Producer>,
        budget: usize,
    ) -> usize {
        let x = &mut self.socks[s];
        let rx = match steered {
            None => &mut x.rx,
            Some(j) => &mut x.steered[j].rx,
        };
        let r = datapath::receive(
            &x.umem,
            &mut x.fill,
            rx,
            out,
            budget,
            self.complete_checksums,
        );
        if r.frames == 0 {
            if x.fill.needs_wakeup() {
                x.kick_rx();
            }
            return 0;
        }
        self.queue_rx[s].add(r.frames);
        if steered.is_some() {
            self.steered.add(r.frames);
        }
        self.unlinked.add(r.unlinked);
        self.rx_malformed.add(r.malformed);
        self.pool_exhausted.add(r.exhausted);
        self.checksums_completed.add(r.checksums_completed);
        r.made
    }

    fn read_kernel_stats(&mut self) {
        let mut drops = 0;
        for s in &self.socks {
            if let Ok(st) = getsockopt::<XdpStatistics>(s.fd.as_raw_fd(), XDP_STATISTICS) {
                drops += st.rx_dropped + st.rx_ring_full;
            }
        }
        // These kernel counters are cumulative.
        self.kernel_drops.set(drops);
    }
}

impl App for AfXdp {
    type Config = AfXdpConfig;
    const EXAMPLE: &'static str = r#"interface: eth1
queues: [0, 1]
xdp_mode: native
zero_copy: auto
steer:
  - { match: "udp and dst port 4789", to: vxlan }
"#;

    fn check_host(c: &AfXdpConfig, _base_dir: &std::path::Path) -> Vec<String> {
        netdev::ifindex(&c.interface).err().into_iter().collect()
    }

    fn declare(c: &AfXdpConfig) -> Result<PortSpec, AppError> {
        if c.queues.is_empty() {
            return Err("queues: give at least one queue id".into());
        }
        if c.frames < 64 || !c.frames.is_power_of_two() || c.frames > 1 << 18 {
            return Err(format!(
                "frames must be a power of two in 64..=262144, got {}",
                c.frames
            )
            .into());
        }
        c.steer_programs()?;
        let mut spec = PortSpec::filter();
        if !c.steer.is_empty() {
            let outputs = std::iter::once("output".to_string()).chain(steer_ports(&c.steer));
            spec.outputs = stitch_core::app::PortNames::Fixed(outputs.collect());
        }
        Ok(spec)
    }

    fn new(c: AfXdpConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let name = &c.interface;
        let ifindex = netdev::ifindex(name)?;
        if netdev::flags(name).map_err(|e| format!("interface `{name}`: {e}"))? & libc::IFF_UP == 0
        {
            return Err(format!("interface `{name}` is down (ip link set {name} up)").into());
        }
        let (xdp, socks, owns) = match ctx.take_inherited() {
            Some(lent) => {
                let (xdp, socks) = adopt(&c, lent)?;
                (xdp, socks, false)
            }
            None => {
                let (xdp, socks) = open(&c, ifindex)?;
                (xdp, socks, true)
            }
        };
        log::info!(
            "af_xdp {name}: queues {:?}, {} XDP, {}{}{}",
            c.queues,
            if xdp.native { "native" } else { "generic" },
            if socks.iter().all(|s| s.zero_copy) {
                "zero-copy"
            } else {
                "copy mode"
            },
            if owns { "" } else { ", taken over" },
            match c.steer.len() {
                0 => String::new(),
                n => format!(", {n} steering rules to {:?}", steer_ports(&c.steer)),
            }
        );
        Ok(AfXdp {
            socks,
            xdp,
            owns,
            complete_checksums: c.complete_checksums,
            next_rx: 0,
            next_tx: 0,
            last_stats: Instant::now(),
            kernel_drops: ctx.counter("kernel_drops"),
            checksums_completed: ctx.counter("checksums_completed"),
            rx_malformed: ctx.counter("rx_malformed_drops"),
            pool_exhausted: ctx.counter("pool_exhausted_drops"),
            tx_full: ctx.counter("tx_ring_full"),
            max_frame: netdev::max_frame(name),
            interface: c.interface.clone(),
            too_big: ctx.counter("too_big_drops"),
            queue_rx: c
                .queues
                .iter()
                .map(|q| ctx.counter(&format!("queue{q}_rx_packets")))
                .collect(),
            steered: ctx.counter("steered_packets"),
            unlinked: ctx.counter("steered_unlinked_drops"),
            lending: steer_ports(&c.steer)
                .iter()
                .map(|_| Lending::default())
                .collect(),
            function_steered: ctx.counter("steered_function_packets"),
            retiring: Vec::new(),
            taken_over_at: Instant::now(),
            removed_drops: ctx.counter("steer_removed_drops"),
            config: c.clone(),
            ifindex,
        })
    }

    /// Steering rules change in place; anything else needs a new port.
    fn reconfigure(
        &mut self,
        c: AfXdpConfig,
        _: &mut AppContext,
    ) -> Result<stitch_core::app::Reconfigured, AppError> {
        use stitch_core::app::Reconfigured;
        if !c.same_but_rules(&self.config) {
            return Ok(Reconfigured::Restart);
        }
        if c.steer != self.config.steer {
            if !self.owns {
                return Err(
                    "the steering rules cannot change while an upgrade hands this \
                            interface over; apply them again once it is done"
                        .into(),
                );
            }
            self.change_rules(&c)?;
        }
        self.config = c;
        Ok(Reconfigured::Done)
    }

    fn pull(&mut self, io: &mut Io) {
        if !self.retiring.is_empty() {
            self.retire();
        }
        for x in &mut self.socks {
            if x.tx_pending() > 0 {
                x.flush_tx();
            }
        }
        if let Some(out) = io.output(0) {
            let mut budget = out.room().min(BURST);
            for k in 0..self.socks.len() {
                let s = (self.next_rx + k) % self.socks.len();
                budget -= self.receive(s, None, Some(&mut *out), budget).min(budget);
            }
        }
        if self.lending.iter().any(|l| l.offer.is_some()) {
            self.take_back_from_functions(None);
        }
        for s in 0..self.socks.len() {
            for j in 0..self.socks[s].steered.len() {
                let output = self.socks[s].steered[j].output;
                if self.lending[output - 1].away() {
                    continue;
                }
                let mut out = io.output(output);
                let budget = out.as_mut().map_or(BURST, |o| o.room().min(BURST));
                self.receive(s, Some(j), out, budget);
            }
        }
        self.next_rx = (self.next_rx + 1) % self.socks.len();
    }

    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        if input.is_empty() {
            return;
        }
        let s = self.next_tx;
        self.next_tx = (self.next_tx + 1) % self.socks.len();
        let x = &mut self.socks[s];
        x.reclaim();
        let sent = datapath::transmit(&x.umem, &mut x.tx, &mut x.tx_free, input, self.max_frame);
        self.rx_malformed.add(sent.malformed);
        self.too_big.add(sent.too_big);
        x.flush_tx();
        x.reclaim();
        if sent.full {
            self.tx_full.add(1);
        }
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        for x in &mut self.socks {
            x.reclaim();
        }
        for port in 0..self.lending.len() {
            self.follow_offer(port, io);
        }
        if now.duration_since(self.last_stats) >= Duration::from_secs(1) {
            self.last_stats = now;
            self.read_kernel_stats();
            self.max_frame = netdev::max_frame_or(&self.interface, self.max_frame);
        }
    }

    fn stop(&mut self) {
        self.read_kernel_stats();
    }

    /// The interface, its steering rules and where each queue's frames are.
    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        let ports = steer_ports(&self.config.steer);
        serde_json::json!({
            "interface": self.interface,
            "xdp": if self.xdp.native { "native" } else { "generic" },
            "steer": self.config.steer,
            // Per steering port, the function port reading its rings itself, if one does.
            "read_by": (ports.iter().zip(&self.lending))
                .map(|(p, l)| (p.clone(), l.offer.as_ref().map(|o| o.to.name().to_string()).into()))
                .collect::<serde_json::Map<String, serde_json::Value>>(),
            "queues": self.socks.iter().map(|x| x.frames_by_owner(&ports)).collect::<Vec<_>>(),
        })
    }

    /// The program, the sockets and their UMEMs: the successor maps the same rings and
    /// frames and carries on at the indices the rings hold, the XSKMAP pointing at the same
    /// sockets throughout.
    fn hand_over(&mut self) -> Option<Descriptors> {
        self.lend_all()
    }

    fn take_position(&mut self, position: serde_json::Value) -> Result<(), String> {
        self.resume_from(position)
    }
}
