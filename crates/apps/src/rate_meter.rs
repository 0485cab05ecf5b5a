//! `rate_meter`: passes packets from `input` to `output` and measures their rate over each
//! `interval` seconds, as counters `rate_pps` and `rate_bps` (bits of frames, without preamble
//! and FCS); with `log: true` it also logs one line per interval.
//!
//! ```yaml
//! apps:
//!   meter: { type: rate_meter, interval: 1.0, log: true }
//! ```

use serde::Deserialize;
use std::time::{Duration, Instant};
use stitch_core::{App, AppContext, AppError, Counter, Io, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateMeterConfig {
    /// Measurement interval in seconds.
    pub interval: f64,
    /// Log the rate at every interval.
    pub log: bool,
}

impl Default for RateMeterConfig {
    fn default() -> Self {
        RateMeterConfig {
            interval: 1.0,
            log: false,
        }
    }
}

pub struct RateMeter {
    name: String,
    interval: Duration,
    log: bool,
    since: Instant,
    packets: u64,
    bytes: u64,
    rate_pps: Counter,
    rate_bps: Counter,
}

impl App for RateMeter {
    type Config = RateMeterConfig;
    const EXAMPLE: &'static str = "interval: 1.0
log: true
";

    fn declare(c: &RateMeterConfig) -> Result<PortSpec, AppError> {
        if !(c.interval >= 0.001 && c.interval <= 3600.0) {
            return Err(
                format!("interval must be 0.001..=3600 seconds, got {}", c.interval).into(),
            );
        }
        Ok(PortSpec::filter())
    }

    fn new(c: RateMeterConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(RateMeter {
            name: ctx.name().to_string(),
            interval: Duration::from_secs_f64(c.interval),
            log: c.log,
            since: Instant::now(),
            packets: 0,
            bytes: 0,
            rate_pps: ctx.counter("rate_pps"),
            rate_bps: ctx.counter("rate_bps"),
        })
    }

    fn reconfigure(
        &mut self,
        c: RateMeterConfig,
        _: &mut AppContext,
    ) -> Result<stitch_core::Reconfigured, AppError> {
        Self::declare(&c)?;
        self.interval = Duration::from_secs_f64(c.interval);
        self.log = c.log;
        Ok(stitch_core::Reconfigured::Done)
    }

    #[inline]
    fn push(&mut self, io: &mut Io) {
        if let (Some(input), Some(output)) = io.pair(0, 0) {
            input.forward_to(output);
        }
    }

    fn tick(&mut self, io: &mut Io, now: Instant) {
        let elapsed = now.duration_since(self.since);
        if elapsed < self.interval {
            return;
        }
        // The input link's counters already hold packets and bytes: no per-packet work here.
        let Some(input) = io.input(0) else { return };
        let s = input.ring().stats();
        let (dp, db) = (s.rx_packets - self.packets, s.tx_bytes - self.bytes);
        self.packets = s.rx_packets;
        self.bytes = s.tx_bytes;
        self.since = now;
        let secs = elapsed.as_secs_f64();
        let pps = dp as f64 / secs;
        let bps = db as f64 * 8.0 / secs;
        self.rate_pps.set(pps as u64);
        self.rate_bps.set(bps as u64);
        if self.log {
            log::info!(
                "{}: {:.3} Mpps, {:.3} Gbit/s",
                self.name,
                pps / 1e6,
                bps / 1e9
            );
        }
    }
}
