//! `delay`: holds each packet for a fixed time before passing it on, in order — a link of known
//! latency, as `netem delay` makes one in the kernel (without jitter or loss). It holds at most
//! `limit` packets (default 16 384); what arrives beyond that is dropped and counted in
//! `limit_drops`. A full output keeps packets held (no drop). Packets it holds when it is
//! removed by a live change are freed with it; an upgrade waits for them, as for a function
//! process's (up to the hand-over's patience, 100 ms).
//!
//! ```yaml
//! apps:
//!   wan: { type: delay, delay_us: 5000 }
//! ```

use serde::Deserialize;
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use stitch_core::{App, AppContext, AppError, Counter, Io, Packet, PortSpec, Reconfigured};

/// Most packets a delay may hold: its queue is allocated up front, from the pool's packets.
const MOST_HELD: usize = 1 << 20;

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelayConfig {
    /// How long each packet is held, in microseconds.
    pub delay_us: u64,
    /// Most packets held at once.
    #[serde(default = "default_limit")]
    pub limit: usize,
}

fn default_limit() -> usize {
    16384
}

pub struct Delay {
    delay: Duration,
    /// Packets with the time each may leave, oldest first.
    held: VecDeque<(Instant, Packet)>,
    limit: usize,
    limit_drops: Counter,
}

fn check(c: &DelayConfig) -> Result<(), AppError> {
    if c.delay_us > 60_000_000 {
        return Err(format!("delay_us {} is more than a minute", c.delay_us).into());
    }
    if !(1..=MOST_HELD).contains(&c.limit) {
        return Err(format!("limit {} must be 1..={MOST_HELD} packets", c.limit).into());
    }
    Ok(())
}

impl App for Delay {
    type Config = DelayConfig;
    const EXAMPLE: &'static str = "delay_us: 5000
limit: 100000
";

    fn declare(c: &DelayConfig) -> Result<PortSpec, AppError> {
        check(c)?;
        Ok(PortSpec::filter())
    }

    fn new(c: DelayConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Delay {
            delay: Duration::from_micros(c.delay_us),
            held: VecDeque::with_capacity(c.limit),
            limit: c.limit,
            limit_drops: ctx.counter("limit_drops"),
        })
    }

    /// A new delay applies to packets arriving from now on; the held ones leave when they
    /// were due. A smaller limit keeps what is held and takes no more until it is under it.
    fn reconfigure(
        &mut self,
        c: DelayConfig,
        _: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        check(&c)?;
        self.delay = Duration::from_micros(c.delay_us);
        self.limit = c.limit;
        self.held.reserve(c.limit.saturating_sub(self.held.len()));
        Ok(Reconfigured::Done)
    }

    /// Sends what is due.
    fn pull(&mut self, io: &mut Io) {
        let Some(output) = io.output(0) else { return };
        let now = Instant::now();
        let mut room = output.room();
        while room > 0 && self.held.front().is_some_and(|(due, _)| *due <= now) {
            let (_, p) = self.held.pop_front().expect("a packet is held");
            output.transmit(p);
            room -= 1;
        }
    }

    /// Takes what arrived and notes when it is due.
    fn push(&mut self, io: &mut Io) {
        let Some(input) = io.input(0) else { return };
        let due = Instant::now() + self.delay;
        let mut dropped = 0;
        for p in input.drain() {
            if self.held.len() < self.limit {
                self.held.push_back((due, p));
            } else {
                dropped += 1;
            }
        }
        self.limit_drops.add(dropped);
    }

    fn outstanding(&self) -> u64 {
        self.held.len() as u64
    }

    fn query(&mut self, _: &serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "held": self.held.len(),
            "delay_us": self.delay.as_micros() as u64,
            "limit": self.limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{build, ports};
    use stitch_core::pool;

    fn packet(tag: u8) -> Packet {
        let mut p = pool::alloc().unwrap();
        p.set_data(&[tag; 60]).unwrap();
        p
    }

    #[test]
    fn packets_leave_in_order_once_their_time_has_come() {
        let mut d: Delay = build(serde_json::json!({ "delay_us": 20_000 }));
        let (mut io, [mut feed], [mut seen]) = ports(["x"]);
        let start = Instant::now();
        for tag in 0..5 {
            feed.transmit(packet(tag));
        }
        d.push(&mut io);
        d.pull(&mut io);
        if start.elapsed() < Duration::from_millis(20) {
            assert_eq!(d.outstanding(), 5, "nothing leaves before its time");
        }
        while d.outstanding() > 0 {
            std::thread::sleep(Duration::from_millis(1));
            d.pull(&mut io);
        }
        assert!(start.elapsed() >= Duration::from_millis(20));
        let tags: Vec<u8> = seen.drain().map(|p| p.data()[0]).collect();
        assert_eq!(tags, [0, 1, 2, 3, 4]);
    }

    #[test]
    fn what_arrives_beyond_the_limit_is_dropped_and_counted() {
        let mut d: Delay = build(serde_json::json!({ "delay_us": 1_000_000, "limit": 3 }));
        let (mut io, [mut feed], _) = ports(["x"]);
        for tag in 0..5 {
            feed.transmit(packet(tag));
        }
        d.push(&mut io);
        assert_eq!(d.outstanding(), 3);
        assert_eq!(d.limit_drops.get(), 2);
    }

    #[test]
    fn a_limit_out_of_range_is_refused() {
        let c: DelayConfig =
            serde_json::from_value(serde_json::json!({ "delay_us": 1, "limit": 0 })).unwrap();
        assert!(Delay::declare(&c)
            .unwrap_err()
            .to_string()
            .contains("limit 0"));
    }
}
