//! The function driven directly, without an engine or threads: frames in on either side, a
//! `push`, frames out. `stitch lwaftr check` (byte-for-byte comparisons with Snabb's expected
//! packets) and `stitch bench lwaftr` (the function's own cost) both drive it this way.

use super::{Compat, Lwaftr, LwaftrAppConfig};
use std::path::Path;
use std::time::Instant;
use stitch_core::app::{Counters, Io};
use stitch_core::link::{link, Consumer, Producer};
use stitch_core::{pool, App, AppContext, Packet};

/// Port `v4` (the internet side) is side 0, `v6` (the B4s) side 1.
pub const SIDES: [&str; 2] = ["v4", "v6"];

pub struct Offline {
    app: Lwaftr,
    io: Io,
    inputs: [Producer; 2],
    outputs: [Consumer; 2],
    counters: Counters,
}

impl Offline {
    /// The function of configuration file `conf` (Snabb's text), writing `compat`'s bytes.
    pub fn new(conf: &Path, compat: Compat) -> Result<Offline, String> {
        let config = LwaftrAppConfig {
            conf: conf.to_path_buf(),
            device: None,
            queue: None,
            on_a_stick: false,
            compat,
        };
        let counters = Counters::default();
        let mut ctx = AppContext::new("lwaftr", Path::new("."), counters.clone());
        let app = Lwaftr::new(config, &mut ctx).map_err(|e| e.to_string())?;
        let (p4, c4) = link(4096);
        let (p6, c6) = link(4096);
        let (o4, r4) = link(8192);
        let (o6, r6) = link(8192);
        let io = Io::new(
            vec![(SIDES[0].into(), c4), (SIDES[1].into(), c6)],
            vec![(SIDES[0].into(), o4), (SIDES[1].into(), o6)],
        );
        Ok(Offline {
            app,
            io,
            inputs: [p4, p6],
            outputs: [r4, r6],
            counters,
        })
    }

    /// Queues a copy of `bytes` on `side`'s input.
    pub fn feed(&mut self, side: usize, bytes: &[u8]) -> Result<(), String> {
        let mut p = pool::alloc().ok_or("packet pool exhausted")?;
        p.set_data(bytes)
            .map_err(|_| format!("a {} byte packet does not fit a buffer", bytes.len()))?;
        self.inputs[side].transmit(p);
        Ok(())
    }

    /// Queues up to `n` fresh packets on `side`'s input, each written by `write` and about
    /// `frame_bytes` long, the way a source feeds a link (`Producer::transmit_fresh`). Returns
    /// how many: fewer when the input is full or the pool runs out.
    pub fn feed_fresh(
        &mut self,
        side: usize,
        n: usize,
        frame_bytes: usize,
        write: impl FnMut(&mut Packet),
    ) -> usize {
        self.inputs[side].transmit_fresh(n, frame_bytes, write)
    }

    /// Runs the function over everything queued.
    pub fn push(&mut self) {
        self.app.push(&mut self.io);
    }

    /// The function's timers (its start sends ARP requests and neighbor solicitations for next
    /// hops given by IP).
    pub fn tick(&mut self, now: Instant) {
        self.app.tick(&mut self.io, now);
    }

    /// What the function sent on `side` since the last call.
    pub fn drain(&mut self, side: usize) -> impl Iterator<Item = Packet> + '_ {
        self.outputs[side].drain()
    }

    /// Frees what the function sent on `side` since the last call, as a sink does; returns
    /// how many packets.
    pub fn discard(&mut self, side: usize) -> u64 {
        self.outputs[side].free_available().0
    }

    pub fn stop(&mut self) {
        self.app.stop();
    }

    pub fn function(&self) -> &Lwaftr {
        &self.app
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}
