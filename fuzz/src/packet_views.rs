//! Packet bytes from the wire: flow extraction, VLAN tags, offload fix-ups, GSO segmentation
//! and the ICMP "too big" answer to a frame must count and refuse bad frames, never panic.
use stitch_wire::offload::{self, VnetHdr};

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let _ = stitch_wire::flow::flow(data);
    let _ = stitch_wire::vlan::outer_tag(data);
    let _ = stitch_wire::icmp::too_big_reply(data, 1400);
    let mut copy = data.to_vec();
    let _ = offload::complete_if_partial(&mut copy);
    if data.len() > 12 {
        let hdr = VnetHdr::parse(&data[..10]).unwrap_or_default();
        let _ = offload::segment(&data[10..], &hdr, 0, |_| {});
    }
}
