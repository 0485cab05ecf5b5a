//! Untrusted frames through compiled filters: the machine code must answer what libpcap's
//! interpreter answers, for any bytes and any length, one frame at a time or a batch at once,
//! and never read outside a frame.
use stitch_wire::filter::{FrameRef, PacketFilter};

const EXPRESSIONS: [&str; 6] = [
    "tcp and port 80",
    "vlan 100 and udp[8:4] = 0x12345678",
    "ip[2:2] > 100 or ip6 net 2001:db8::/32",
    "icmp[icmptype] == icmp-echo or arp",
    "ip and ip[6:2] & 0x1fff != 0",
    "len > 100 and ether broadcast",
];

thread_local! {
    static FILTERS: Vec<PacketFilter> = EXPRESSIONS
        .iter()
        .map(|e| PacketFilter::compile(e).expect("filter"))
        .collect();
}

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    // The whole input as one frame, and cut into frames whose lengths its first bytes give.
    let (cuts, rest) = data.split_at(data.len().min(4));
    let mut frames = Vec::new();
    let mut left = rest;
    for &cut in cuts {
        let (frame, after) = left.split_at((cut as usize).min(left.len()));
        frames.push(frame);
        left = after;
    }
    frames.push(left);
    let refs: Vec<FrameRef> = frames.iter().map(|f| FrameRef::new(f)).collect();
    let mut matched = vec![0u32; refs.len()];
    FILTERS.with(|filters| {
        for f in filters {
            assert_eq!(f.matches(data), f.matches_interpreted(data), "{f:?}");
            let n = f.select_frames(&refs, &mut matched);
            let want: Vec<u32> = (0..frames.len() as u32)
                .filter(|&i| f.matches_interpreted(frames[i as usize]))
                .collect();
            assert_eq!(
                &matched[..n],
                &want[..],
                "{f:?} over {} frames",
                frames.len()
            );
        }
    });
}
