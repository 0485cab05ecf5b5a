//! `sink`: frees every packet it receives, counting `packets` and `bytes` (the counters survive
//! live reconfiguration). Any number of inputs.
//!
//! ```yaml
//! apps:
//!   out: { type: sink }
//! ```

use serde::Deserialize;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortNames, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {}

pub struct Sink {
    packets: Counter,
    bytes: Counter,
}

impl App for Sink {
    type Config = SinkConfig;
    const EXAMPLE: &'static str = "{}";

    fn declare(_: &SinkConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::Any,
            outputs: PortNames::none(),
        })
    }

    fn new(_: SinkConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Sink {
            packets: ctx.counter("packets"),
            bytes: ctx.counter("bytes"),
        })
    }

    #[inline]
    fn push(&mut self, io: &mut Io) {
        let (inputs, _) = io.split();
        let (mut n, mut bytes) = (0u64, 0u64);
        for input in inputs.iter_mut().flatten() {
            let (packets, size) = input.free_available();
            n += packets;
            bytes += size;
        }
        self.packets.add(n);
        self.bytes.add(bytes);
    }
}
