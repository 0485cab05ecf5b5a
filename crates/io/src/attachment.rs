//! `attachment`: a port of the graph that a workload attaches to later — `stitch-cni` puts an
//! `af_packet` app of the same name on the container's veth in its place, with the same
//! links, and puts the `attachment` back when the container goes. Until then it drops what it
//! is sent, counted as `unattached_drops`; it sends nothing.
//!
//! ```yaml
//! apps:
//!   web: { type: attachment }          # stitch-cni attaches a container as `web`
//! links:
//!   - "web.output -> fw.lan"
//!   - "fw.lan -> web.input"
//! ```

use serde::Deserialize;
use stitch_core::{pool, App, AppContext, AppError, Counter, Io, PortNames, PortSpec};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AttachmentConfig {}

pub struct Attachment {
    unattached_drops: Counter,
}

impl App for Attachment {
    type Config = AttachmentConfig;
    const EXAMPLE: &'static str = "{}";

    fn declare(_: &AttachmentConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::Fixed(vec!["input".into()]),
            outputs: PortNames::Fixed(vec!["output".into()]),
        })
    }

    fn new(_: AttachmentConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Attachment {
            unattached_drops: ctx.counter("unattached_drops"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, _) = io.split();
        let mut n = 0u64;
        for input in inputs.iter_mut().flatten() {
            pool::free_batch(input.drain().inspect(|_| n += 1));
        }
        self.unattached_drops.add(n);
    }
}
