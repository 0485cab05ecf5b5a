//! Netlink bytes on a router's `kernel` input (a `kernel_routes` app's, or anything a graph
//! links there): every message is read whole or refused, never read past.
use stitch_wire::netlink::{self, Change};

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    for m in netlink::messages(data) {
        let Ok(m) = m else { break };
        assert!(m.bytes.len() >= 16 && m.bytes.len() <= data.len());
        if let Ok(Change::Route(r) | Change::RouteGone(r)) = netlink::read(&m) {
            assert!(r.prefix_len <= if r.dst.is_ipv4() { 32 } else { 128 });
            // What is read is written back as the same route.
            let again = netlink::route_message(netlink::kind::NEWROUTE, 0, &r);
            let m2 = netlink::messages(&again).next().unwrap().unwrap();
            if r.table <= 255 || r.nexthop.is_some() || r.paths.len() != 1 {
                let _ = netlink::read(&m2);
            }
        }
    }
}
