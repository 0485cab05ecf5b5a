//! `load_balancer`: spreads packets from `input` over its outputs (any port names) by a hash of
//! the flow (addresses, protocol, ports, VLAN), so a flow always takes the same output; with
//! `symmetric: true` both directions of a connection take the same output. Non-IP frames hash
//! their MAC addresses. Malformed IP packets are dropped and counted by reason.
//!
//! ```yaml
//! apps:
//!   lb: { type: load_balancer, symmetric: true }
//! links:
//!   - "lb.fw1 -> fw1.input"
//!   - "lb.fw2 -> fw2.input"
//! ```

use serde::Deserialize;
use std::hash::{Hash, Hasher};
use stitch_core::{App, AppContext, AppError, Counter, Io, PortNames, PortSpec};
use stitch_wire::flow::{self, Malformed};

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LoadBalancerConfig {
    /// Both directions of a connection take the same output (the hash orders the endpoints first).
    #[serde(default)]
    pub symmetric: bool,
}

pub struct LoadBalancer {
    symmetric: bool,
    malformed: [Counter; 4],
}

fn reason_index(m: Malformed) -> usize {
    match m {
        Malformed::Ethernet => 0,
        Malformed::Ipv4 => 1,
        Malformed::Ipv6 => 2,
        Malformed::L4 => 3,
    }
}

impl App for LoadBalancer {
    type Config = LoadBalancerConfig;
    const EXAMPLE: &'static str = "symmetric: true";

    fn declare(_: &LoadBalancerConfig) -> Result<PortSpec, AppError> {
        Ok(PortSpec {
            inputs: PortNames::one("input"),
            outputs: PortNames::Any,
        })
    }

    fn new(c: LoadBalancerConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let m = [
            Malformed::Ethernet,
            Malformed::Ipv4,
            Malformed::Ipv6,
            Malformed::L4,
        ];
        Ok(LoadBalancer {
            symmetric: c.symmetric,
            malformed: m.map(|r| ctx.counter(r.counter())),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        let Some(input) = inputs.first_mut().and_then(Option::as_mut) else {
            return;
        };
        let n = outputs.len();
        if n == 0 {
            return;
        }
        for p in input.drain() {
            let h = match flow::flow(p.data()) {
                Ok(Some(f)) => f.hash(self.symmetric),
                Ok(None) => {
                    let d = p.data();
                    let (mut a, mut b) = (&d[0..6], &d[6..12]);
                    if self.symmetric && b < a {
                        std::mem::swap(&mut a, &mut b);
                    }
                    let mut s = std::collections::hash_map::DefaultHasher::new();
                    (a, b).hash(&mut s);
                    s.finish()
                }
                Err(m) => {
                    self.malformed[reason_index(m)].add(1);
                    continue;
                }
            };
            if let Some(out) = outputs[(h % n as u64) as usize].as_mut() {
                out.transmit(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::link;
    use stitch_core::pool;
    use stitch_wire::build::{Frame, Transport};
    use stitch_wire::header::l4;

    fn udp(src: u8, dst: u8, sp: u16, dp: u16) -> stitch_core::Packet {
        let f = Frame::ipv4([10, 0, 0, src], [10, 0, 0, dst], Transport::udp(sp, dp))
            .payload_len(18)
            .bytes();
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        p
    }

    #[test]
    fn flows_stick_to_one_output_and_directions_meet_when_symmetric() {
        let mut ctx = AppContext::new("lb", std::path::Path::new("."), Default::default());
        let mut lb = LoadBalancer::new(LoadBalancerConfig { symmetric: true }, &mut ctx).unwrap();
        let (mut tx, rx) = link(4096);
        let mut outs = vec![];
        let mut rxs = vec![];
        for i in 0..4 {
            let (t, r) = link(4096);
            outs.push((format!("o{i}"), t));
            rxs.push(r);
        }
        let mut io = Io::new(vec![("input".into(), rx)], outs);
        for flow in 0..200u16 {
            tx.transmit(udp(1, 2, 1000 + flow, 80));
            tx.transmit(udp(2, 1, 80, 1000 + flow));
        }
        let mut bad = pool::alloc().unwrap();
        // IPv4 by its EtherType, cut inside the IP header.
        let mut cut = vec![0u8; 24];
        cut[12..15].copy_from_slice(&[0x08, 0x00, 0x45]);
        bad.set_data(&cut).unwrap();
        tx.transmit(bad);
        lb.push(&mut io);
        let mut owner = std::collections::HashMap::new();
        let mut per_output = [0; 4];
        for (i, r) in rxs.iter_mut().enumerate() {
            for p in r.drain() {
                let d = p.data();
                let client_port = if d[29] == 1 {
                    l4::SRC_PORT.get(&d[34..])
                } else {
                    l4::DST_PORT.get(&d[34..])
                };
                assert_eq!(
                    *owner.entry(client_port).or_insert(i),
                    i,
                    "both directions of a flow on one output"
                );
                per_output[i] += 1;
            }
        }
        assert_eq!(owner.len(), 200);
        assert!(per_output.iter().all(|&n| n > 40), "spread: {per_output:?}");
        assert_eq!(lb.malformed.iter().map(|c| c.get()).sum::<u64>(), 1);
    }
}
