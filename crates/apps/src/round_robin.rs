//! `round_robin`: spreads packets from `input` over the linked outputs (any port names) in
//! turn, for load sharing across workers or function instances. A full output drops and counts
//! on that link.
//!
//! ```yaml
//! apps:
//!   rr: { type: round_robin }
//! links:
//!   - "rr.w0 -> fwd0.input"
//!   - "rr.w1 -> fwd1.input"
//! ```

use serde::Deserialize;
use stitch_core::{App, AppContext, AppError, Io, PortNames, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RoundRobinConfig {}

pub struct RoundRobin {
    next: usize,
}

impl App for RoundRobin {
    type Config = RoundRobinConfig;
    const EXAMPLE: &'static str = "{}";

    fn declare(_: &RoundRobinConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::one("input"),
            outputs: PortNames::Any,
        })
    }

    fn new(_: RoundRobinConfig, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(RoundRobin { next: 0 })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        let Some(input) = inputs.first_mut().and_then(Option::as_mut) else {
            return;
        };
        if outputs.is_empty() {
            return;
        }
        for p in input.drain() {
            self.next = (self.next + 1) % outputs.len();
            if let Some(out) = outputs[self.next].as_mut() {
                out.transmit(p);
            }
        }
    }
}
