//! `join`: merges any number of inputs (any port names) into `output`, taking from each input in
//! turn. Packets that do not fit wait in their input link.
//!
//! ```yaml
//! apps:
//!   j: { type: join }
//! links:
//!   - "a.output -> j.a"
//!   - "b.output -> j.b"
//!   - "j.output -> out.input"
//! ```

use serde::Deserialize;
use stitch_core::{App, AppContext, AppError, Io, PortNames, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct JoinConfig {}

pub struct Join {
    first: usize,
}

impl App for Join {
    type Config = JoinConfig;
    const EXAMPLE: &'static str = "{}";

    fn declare(_: &JoinConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::Any,
            outputs: PortNames::one("output"),
        })
    }

    fn new(_: JoinConfig, _: &mut AppContext) -> Result<Self, AppError> {
        Ok(Join { first: 0 })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        let Some(output) = outputs.first_mut().and_then(Option::as_mut) else {
            return;
        };
        let n = inputs.len();
        // Start from a different input each breath so that none is starved when output is full.
        for k in 0..n {
            if let Some(input) = inputs[(self.first + k) % n].as_mut() {
                input.forward_to(output);
            }
        }
        self.first = if n == 0 { 0 } else { (self.first + 1) % n };
    }
}
