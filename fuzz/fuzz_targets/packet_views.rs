//! Packet bytes from the wire: flow extraction, VLAN tags, offload fix-ups and GSO segmentation
//! must count and refuse bad frames, never panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use stitch_wire::offload::{self, VnetHdr};

fuzz_target!(|data: &[u8]| {
    let _ = stitch_wire::flow::flow(data);
    let _ = stitch_wire::vlan::outer_tag(data);
    let mut copy = data.to_vec();
    let _ = offload::complete_if_partial(&mut copy);
    if data.len() > 12 {
        let hdr = VnetHdr::parse(&data[..10]).unwrap_or_default();
        let _ = offload::segment(&data[10..], &hdr, 0, |_| {});
    }
});
