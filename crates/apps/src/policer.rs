//! `policer`: a token bucket that passes at most `rate` (packets per second, or bits per
//! second of frames as `"100 Mbit/s"`) with bursts of up to `burst` packets or bytes; the excess
//! is dropped and counted in `policed_drops`.
//!
//! ```yaml
//! apps:
//!   limit: { type: policer, rate: "100 Mbit/s", burst: 150000 }
//! ```

use crate::generator::{parse_rate, Rate, RateSpec};
use serde::Deserialize;
use std::time::Instant;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortSpec, Reconfigured};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicerConfig {
    /// The rate let through; excess packets are dropped and counted.
    pub rate: RateSpec,
    /// Bucket depth: packets (pps rates) or bytes (bit rates). Default: 10 ms worth, at least
    /// one 1514-byte frame or 32 packets.
    pub burst: Option<f64>,
}

/// A token bucket of `rate` (packets or bits per second) and `depth` (packets or bytes).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: Rate,
    depth: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket; `burst` defaults to 10 ms worth (at least 32 packets or one 1514-byte
    /// frame).
    pub fn new(rate: Rate, burst: Option<f64>) -> Result<TokenBucket, String> {
        match rate {
            Rate::Pps(r) | Rate::Bps(r) if r <= 0.0 => {
                return Err(format!("rate {r} must be positive"))
            }
            _ => {}
        }
        let depth = match (burst, rate) {
            (Some(b), _) if b > 0.0 => b,
            (Some(b), _) => return Err(format!("burst {b} must be positive")),
            (None, Rate::Pps(r)) => (r * 0.01).max(32.0),
            (None, Rate::Bps(r)) => (r / 8.0 * 0.01).max(1514.0),
        };
        Ok(TokenBucket {
            rate,
            depth,
            tokens: depth,
            last: Instant::now(),
        })
    }

    /// Adds the tokens earned since the last refill (once per batch).
    pub fn refill(&mut self, now: Instant) {
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        let per_s = match self.rate {
            Rate::Pps(r) => r,
            Rate::Bps(r) => r / 8.0,
        };
        self.tokens = (self.tokens + dt * per_s).min(self.depth);
    }

    /// Takes what a frame of `len` bytes costs; false when the bucket cannot pay.
    pub fn take(&mut self, len: usize) -> bool {
        let cost = match self.rate {
            Rate::Pps(_) => 1.0,
            Rate::Bps(_) => len as f64,
        };
        if self.tokens >= cost {
            self.tokens -= cost;
            true
        } else {
            false
        }
    }
}

/// A rate as the graph file gives it: a number (packets per second) or text with a unit.
pub fn rate_of(spec: &RateSpec) -> Result<Rate, String> {
    match spec {
        RateSpec::PacketsPerSecond(v) => Ok(Rate::Pps(*v)),
        RateSpec::Text(s) => parse_rate(s),
    }
}

pub struct Policer {
    bucket: TokenBucket,
    policed: Counter,
}

fn settings(c: &PolicerConfig) -> Result<TokenBucket, AppError> {
    Ok(TokenBucket::new(rate_of(&c.rate)?, c.burst)?)
}

impl App for Policer {
    type Config = PolicerConfig;
    const EXAMPLE: &'static str = r#"rate: "100 Mbit/s"
burst: 125000
"#;

    fn declare(c: &PolicerConfig) -> Result<PortSpec, AppError> {
        settings(c)?;
        Ok(PortSpec::filter())
    }

    fn new(c: PolicerConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Policer {
            bucket: settings(&c)?,
            policed: ctx.counter("policed_drops"),
        })
    }

    fn reconfigure(
        &mut self,
        c: PolicerConfig,
        _: &mut AppContext,
    ) -> Result<Reconfigured, AppError> {
        let mut bucket = settings(&c)?;
        bucket.tokens = self.bucket.tokens.min(bucket.depth);
        self.bucket = bucket;
        Ok(Reconfigured::Done)
    }

    fn push(&mut self, io: &mut Io) {
        let (Some(input), Some(output)) = io.pair(0, 0) else {
            return;
        };
        self.bucket.refill(Instant::now());
        let mut policed = 0;
        for p in input.drain() {
            if self.bucket.take(p.len()) {
                output.transmit(p);
            } else {
                policed += 1;
            }
        }
        self.policed.add(policed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::link;
    use stitch_core::pool;

    fn run(cfg: serde_json::Value, packets: usize, size: usize) -> (usize, u64) {
        let c: PolicerConfig = serde_json::from_value(cfg).unwrap();
        let mut ctx = AppContext::new("p", std::path::Path::new("."), Default::default());
        let mut pol = Policer::new(c, &mut ctx).unwrap();
        let (mut tx, rx) = link(4096);
        let (otx, mut orx) = link(4096);
        let mut io = Io::new(vec![("input".into(), rx)], vec![("output".into(), otx)]);
        for _ in 0..packets {
            let mut p = pool::alloc().unwrap();
            p.set_len(size).unwrap();
            tx.transmit(p);
        }
        pol.push(&mut io);
        (orx.drain().count(), pol.policed.get())
    }

    #[test]
    fn a_burst_passes_up_to_the_bucket_depth() {
        // Practically no time passes: the full bucket is all that goes through.
        assert_eq!(
            run(serde_json::json!({"rate": 10, "burst": 100}), 1000, 64),
            (100, 900)
        );
        // Bit rates count bytes: 10 frames of 1000 bytes fit a 10000-byte bucket.
        assert_eq!(
            run(
                serde_json::json!({"rate": "8 kbit/s", "burst": 10000}),
                50,
                1000
            ),
            (10, 40)
        );
        assert!(Policer::declare(
            &serde_json::from_value(serde_json::json!({"rate": "fast"})).unwrap()
        )
        .is_err());
    }
}
