//! `vlan`: pushes, pops or translates 802.1Q tags.
//!
//! - `push`: adds a tag with `vid` (and `pcp`) to every frame (on top of any existing tag).
//! - `pop`: removes the outer tag; untagged frames pass unchanged (counted in `untagged`).
//! - `translate`: rewrites the outer VLAN id by `map` (from → to); frames whose id is not in
//!   the map, or untagged, pass or are dropped as `unmatched` says.
//!
//! ```yaml
//! apps:
//!   tag10: { type: vlan, mode: push, vid: 10 }
//!   untag: { type: vlan, mode: pop }
//!   xlate: { type: vlan, mode: translate, map: { 10: 110, 20: 120 }, unmatched: drop }
//! ```

use serde::Deserialize;
use std::collections::HashMap;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortSpec};
use stitch_wire::vlan;

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Push,
    Pop,
    Translate,
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    #[default]
    Pass,
    Drop,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VlanConfig {
    /// `push` adds a tag with `vid` (and `pcp`) to every frame; `pop` removes the outer tag;
    /// `translate` rewrites the outer VLAN id by `map`.
    pub mode: Mode,
    /// VLAN id to push.
    pub vid: Option<u16>,
    /// Priority code point of pushed tags.
    #[serde(default)]
    pub pcp: u8,
    /// Use the 802.1ad TPID (0x88a8) for pushed tags.
    #[serde(default)]
    pub qinq: bool,
    /// Translation table (from → to).
    #[serde(default)]
    pub map: HashMap<u16, u16>,
    /// `translate`: what happens to frames whose id is not in `map`, or untagged ones.
    #[serde(default)]
    pub unmatched: Unmatched,
}

pub struct Vlan {
    c: VlanConfig,
    untagged: Counter,
    unmatched_drops: Counter,
    drops: Counter,
}

fn valid_vid(v: u16) -> bool {
    (1..=4094).contains(&v)
}

impl App for Vlan {
    type Config = VlanConfig;
    const EXAMPLE: &'static str = "mode: translate
map: { 10: 110, 20: 120 }
unmatched: drop
";

    fn declare(c: &VlanConfig) -> Result<PortSpec, AppError> {
        match c.mode {
            Mode::Push if !c.vid.is_some_and(valid_vid) => {
                return Err("push needs `vid` 1..=4094".into())
            }
            Mode::Translate if c.map.is_empty() => {
                return Err("translate needs a `map` of VLAN ids".into())
            }
            _ => {}
        }
        if c.pcp > 7 {
            return Err(format!("pcp must be 0..=7, got {}", c.pcp).into());
        }
        if let Some((a, b)) = c
            .map
            .iter()
            .find(|(a, b)| !valid_vid(**a) || !valid_vid(**b))
        {
            return Err(format!("map {a} → {b}: VLAN ids are 1..=4094").into());
        }
        Ok(PortSpec::filter())
    }

    fn new(c: VlanConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        Ok(Vlan {
            c,
            untagged: ctx.counter("untagged"),
            unmatched_drops: ctx.counter("unmatched_drops"),
            drops: ctx.counter("too_long_drops"),
        })
    }

    fn reconfigure(
        &mut self,
        c: VlanConfig,
        _: &mut AppContext,
    ) -> Result<stitch_core::Reconfigured, AppError> {
        Self::declare(&c)?;
        self.c = c;
        Ok(stitch_core::Reconfigured::Done)
    }

    fn push(&mut self, io: &mut Io) {
        let (Some(input), Some(output)) = io.pair(0, 0) else {
            return;
        };
        let n = output.room();
        let (mut untagged, mut unmatched, mut drops) = (0, 0, 0);
        for mut p in input.drain().take(n) {
            match self.c.mode {
                Mode::Push => {
                    let tpid = if self.c.qinq {
                        vlan::TPID_8021AD
                    } else {
                        vlan::TPID_8021Q
                    };
                    let tci = ((self.c.pcp as u16) << 13) | self.c.vid.unwrap_or(1);
                    if vlan::push(&mut p, tpid, tci).is_err() {
                        drops += 1;
                        continue;
                    }
                }
                Mode::Pop => {
                    if vlan::pop(&mut p).is_none() {
                        untagged += 1;
                    }
                }
                Mode::Translate => {
                    let to = vlan::outer_tag(p.data())
                        .and_then(|(_, tci)| self.c.map.get(&vlan::vid(tci)).copied());
                    match to {
                        Some(v) => {
                            vlan::set_vid(p.data_mut(), v);
                        }
                        None if self.c.unmatched == Unmatched::Drop => {
                            unmatched += 1;
                            continue;
                        }
                        None => {}
                    }
                }
            }
            output.transmit(p);
        }
        self.untagged.add(untagged);
        self.unmatched_drops.add(unmatched);
        self.drops.add(drops);
    }
}
