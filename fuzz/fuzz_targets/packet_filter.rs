//! Untrusted frames through compiled filters: the JIT's machine code must answer what libpcap's
//! interpreter answers, for any bytes and any length, and never read outside the frame.
#![no_main]
use libfuzzer_sys::fuzz_target;
use stitch_wire::filter::PacketFilter;

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

fuzz_target!(|data: &[u8]| {
    FILTERS.with(|filters| {
        for f in filters {
            assert_eq!(f.matches(data), f.matches_interpreted(data), "{f:?}");
        }
    });
});
