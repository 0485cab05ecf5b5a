//! `tee`: copies every packet from `input` to every linked output (any port names). The last
//! output gets the original, the others copies; a copy the pool cannot supply is counted in
//! `drops`.
//!
//! ```yaml
//! apps:
//!   t: { type: tee }
//! links:
//!   - "src.output -> t.input"
//!   - "t.a -> capture.input"
//!   - "t.b -> router.input"
//! ```

use serde::Deserialize;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortNames, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TeeConfig {}

pub struct Tee {
    drops: Counter,
}

impl App for Tee {
    type Config = TeeConfig;
    const EXAMPLE: &'static str = "{}";

    fn declare(_: &TeeConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::one("input"),
            outputs: PortNames::Any,
        })
    }

    fn new(_: TeeConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Tee {
            drops: ctx.counter("drops"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        let Some(input) = inputs.first_mut().and_then(Option::as_mut) else {
            return;
        };
        let mut drops = 0;
        for p in input.drain() {
            let n = outputs.len();
            if n == 0 {
                drops += 1;
                continue;
            }
            for out in outputs[..n - 1].iter_mut().flatten() {
                match p.try_clone() {
                    Some(c) => {
                        out.transmit(c);
                    }
                    None => drops += 1,
                }
            }
            if let Some(last) = outputs[n - 1].as_mut() {
                last.transmit(p);
            }
        }
        self.drops.add(drops);
    }
}
