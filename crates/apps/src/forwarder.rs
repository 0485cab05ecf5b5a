//! `forwarder`: moves every packet from `input` to `output` unchanged (the unit of the chain
//! benchmark). Packets that do not fit in `output` wait in `input`; with no `output` linked,
//! packets are dropped and counted in `drops`.
//!
//! ```yaml
//! apps:
//!   fwd: { type: forwarder }
//! ```

use serde::Deserialize;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ForwarderConfig {}

pub struct Forwarder {
    drops: Counter,
}

impl App for Forwarder {
    type Config = ForwarderConfig;
    const EXAMPLE: &'static str = "{}";

    fn declare(_: &ForwarderConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec::filter())
    }

    fn new(_: ForwarderConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Forwarder {
            drops: ctx.counter("drops"),
        })
    }

    #[inline]
    fn push(&mut self, io: &mut Io) {
        match io.pair(0, 0) {
            (Some(input), Some(output)) => {
                input.forward_to(output);
            }
            (Some(input), None) => self.drops.add(input.drain().count() as u64),
            _ => {}
        }
    }
}
