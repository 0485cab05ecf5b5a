//! `vxlan`: VXLAN (RFC 7348) tunnel endpoint. Each segment in `segments` is a port (an input
//! and an output of that name) carrying the inner Ethernet frames of one VNI; `underlay` carries
//! the encapsulated packets: outer Ethernet + IPv4 + UDP (`port`, 4789 by default) + VXLAN.
//!
//! Frames entering a segment port are encapsulated toward that segment's `remote` VTEP; the UDP
//! source port is a hash of the inner flow, so the underlay can spread tunnels over paths (RFC
//! 7348 §5). Packets entering `underlay` addressed to `local` on the VXLAN port with a known VNI
//! are decapsulated to their segment; others are counted by reason and dropped (no VNI flag,
//! unknown VNI, not for us, malformed). Outer MAC addresses are configured (`local_mac`,
//! `next_hop_mac`): put a router in front for resolution.
//!
//! ```yaml
//! apps:
//!   vtep: { type: vxlan, local: 192.0.2.1, local_mac: "02:00:00:00:00:01",
//!           next_hop_mac: "02:00:00:00:00:02",
//!           segments: { tenant1: { vni: 1001, remote: 192.0.2.2 }, tenant2: { vni: 1002, remote: 192.0.2.3 } } }
//! links:
//!   - "vtep.underlay -> nic.input"
//!   - "nic.output -> vtep.underlay"
//! ```

use indexmap::IndexMap;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::Ipv4Addr;
use stitch_core::{App, AppContext, AppError, Counter, Io, Packet, PortNames, PortSpec};
use stitch_wire::{flow, ipv4_header, parse_mac};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    pub vni: u32,
    pub remote: Ipv4Addr,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VxlanConfig {
    pub local: Ipv4Addr,
    pub local_mac: String,
    pub next_hop_mac: String,
    #[serde(default = "default_port")]
    pub port: u16,
    pub segments: IndexMap<String, Segment>,
}

fn default_port() -> u16 {
    4789
}

/// Outer headers: Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8.
const OUTER: usize = 50;

pub struct Vxlan {
    local: Ipv4Addr,
    local_mac: [u8; 6],
    next_hop_mac: [u8; 6],
    port: u16,
    segments: Vec<Segment>,
    by_vni: HashMap<u32, usize, foldhash::fast::RandomState>,
    underlay: usize,
    encapsulated: Counter,
    decapsulated: Counter,
    not_for_us: Counter,
    unknown_vni: Counter,
    malformed: Counter,
    too_big: Counter,
}

impl Vxlan {
    fn encapsulate(&self, seg: usize, mut p: Packet) -> Option<Packet> {
        let s = &self.segments[seg];
        let inner_len = p.len();
        let sport = 49152
            + (flow::flow(p.data())
                .ok()
                .flatten()
                .map(|f| f.hash(true))
                .unwrap_or(0)
                % 16384) as u16;
        let h = p.prepend(OUTER).ok()?;
        h[0..6].copy_from_slice(&self.next_hop_mac);
        h[6..12].copy_from_slice(&self.local_mac);
        h[12..14].copy_from_slice(&[0x08, 0x00]);
        // DF: the underlay must carry the whole frame (RFC 7348 §4.3).
        h[14..34].copy_from_slice(&ipv4_header(
            self.local,
            s.remote,
            17,
            8 + 8 + inner_len,
            true,
        ));
        let udp = &mut h[34..42];
        udp[0..2].copy_from_slice(&sport.to_be_bytes());
        udp[2..4].copy_from_slice(&self.port.to_be_bytes());
        udp[4..6].copy_from_slice(&((8 + 8 + inner_len) as u16).to_be_bytes());
        udp[6..8].copy_from_slice(&[0, 0]); // zero UDP checksum over IPv4 (RFC 7348 §5)
        let vx = &mut h[42..50];
        vx.fill(0);
        vx[0] = 0x08; // I flag: VNI valid
        vx[4..7].copy_from_slice(&s.vni.to_be_bytes()[1..4]);
        Some(p)
    }

    /// The segment of an encapsulated packet, with the outer headers removed.
    fn decapsulate(&self, mut p: Packet) -> Result<(usize, Packet), &Counter> {
        let d = p.data();
        if d.len() < OUTER + 14 || d[12..14] != [0x08, 0x00] || d[14] >> 4 != 4 {
            return Err(&self.not_for_us);
        }
        let ihl = (d[14] & 0x0f) as usize * 4;
        let udp = 14 + ihl;
        if ihl < 20 || d.len() < udp + 16 + 14 {
            return Err(&self.malformed);
        }
        let dst = Ipv4Addr::new(d[30], d[31], d[32], d[33]);
        if d[23] != 17
            || dst != self.local
            || u16::from_be_bytes([d[udp + 2], d[udp + 3]]) != self.port
        {
            return Err(&self.not_for_us);
        }
        let vx = &d[udp + 8..udp + 16];
        if vx[0] & 0x08 == 0 {
            return Err(&self.malformed);
        }
        let vni = u32::from_be_bytes([0, vx[4], vx[5], vx[6]]);
        let Some(&seg) = self.by_vni.get(&vni) else {
            return Err(&self.unknown_vni);
        };
        p.shift_front(udp + 16).map_err(|_| &self.malformed)?;
        Ok((seg, p))
    }
}

impl App for Vxlan {
    type Config = VxlanConfig;

    fn declare(c: &VxlanConfig) -> Result<PortSpec, AppError> {
        parse_mac(&c.local_mac)?;
        parse_mac(&c.next_hop_mac)?;
        if c.segments.is_empty() {
            return Err("give at least one segment".into());
        }
        let mut seen = std::collections::HashSet::new();
        for (name, s) in &c.segments {
            if name == "underlay" {
                return Err(
                    "`underlay` is the name of the tunnel port; name the segment otherwise".into(),
                );
            }
            if s.vni >= 1 << 24 || !seen.insert(s.vni) {
                return Err(format!(
                    "segment `{name}`: VNI {} must be below 2^24 and unique",
                    s.vni
                )
                .into());
            }
        }
        let mut names: Vec<String> = c.segments.keys().cloned().collect();
        names.push("underlay".into());
        Ok(PortSpec {
            inputs: PortNames::Fixed(names.clone()),
            outputs: PortNames::Fixed(names),
        })
    }

    fn new(c: VxlanConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let segments: Vec<Segment> = c.segments.values().cloned().collect();
        let by_vni = segments
            .iter()
            .enumerate()
            .map(|(i, s)| (s.vni, i))
            .collect();
        Ok(Vxlan {
            local: c.local,
            local_mac: parse_mac(&c.local_mac)?,
            next_hop_mac: parse_mac(&c.next_hop_mac)?,
            port: c.port,
            underlay: segments.len(),
            segments,
            by_vni,
            encapsulated: ctx.counter("encapsulated"),
            decapsulated: ctx.counter("decapsulated"),
            not_for_us: ctx.counter("not_for_us_drops"),
            unknown_vni: ctx.counter("unknown_vni_drops"),
            malformed: ctx.counter("malformed_drops"),
            too_big: ctx.counter("too_big_drops"),
        })
    }

    fn push(&mut self, io: &mut Io) {
        let (inputs, outputs) = io.split();
        for (port, input) in inputs.iter_mut().enumerate() {
            let Some(input) = input.as_mut() else {
                continue;
            };
            for p in input.drain() {
                if port == self.underlay {
                    match self.decapsulate(p) {
                        Ok((seg, inner)) => {
                            if let Some(o) = outputs[seg].as_mut() {
                                o.transmit(inner);
                                self.decapsulated.add(1);
                            }
                        }
                        Err(counter) => counter.add(1),
                    }
                } else if p.len() < 14 {
                    self.malformed.add(1);
                } else {
                    match self.encapsulate(port, p) {
                        Some(outer) => {
                            if let Some(o) = outputs[self.underlay].as_mut() {
                                o.transmit(outer);
                                self.encapsulated.add(1);
                            }
                        }
                        None => self.too_big.add(1),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::pool;
    use stitch_wire::checksum;

    #[test]
    fn round_trip_and_refusals_are_counted() {
        let cfg = |local: &str, remote: &str| -> VxlanConfig {
            serde_json::from_value(serde_json::json!({
                "local": local, "local_mac": "02:00:00:00:00:01", "next_hop_mac": "02:00:00:00:00:02",
                "segments": { "a": { "vni": 7, "remote": remote } }
            }))
            .unwrap()
        };
        let mut ctx = AppContext::new("v", std::path::Path::new("."), Default::default());
        let v1 = Vxlan::new(cfg("192.0.2.1", "192.0.2.2"), &mut ctx).unwrap();
        let v2 = Vxlan::new(cfg("192.0.2.2", "192.0.2.1"), &mut ctx).unwrap();
        let inner: Vec<u8> = (0..60u8).collect();
        let mut p = pool::alloc().unwrap();
        p.set_data(&inner).unwrap();
        let outer = v1.encapsulate(0, p).unwrap();
        assert_eq!(outer.len(), 60 + OUTER);
        assert_eq!(checksum::checksum(&outer.data()[14..34]), 0);
        let copy = outer.try_clone().unwrap();
        let (seg, back) = v2.decapsulate(outer).unwrap();
        assert_eq!((seg, back.data()), (0, &inner[..]));
        // Not addressed to v1's own local address: refused and counted there.
        assert!(v1.decapsulate(copy).is_err());
        // Unknown VNI.
        let mut p = pool::alloc().unwrap();
        p.set_data(&inner).unwrap();
        let mut o = v1.encapsulate(0, p).unwrap();
        o.data_mut()[48] = 9;
        assert!(std::ptr::eq(
            v2.decapsulate(o).unwrap_err(),
            &v2.unknown_vni
        ));
        // The port layout: segments, then underlay.
        let spec = Vxlan::declare(&cfg("192.0.2.1", "192.0.2.2")).unwrap();
        assert_eq!(
            spec.inputs,
            PortNames::Fixed(vec!["a".into(), "underlay".into()])
        );
    }
}
