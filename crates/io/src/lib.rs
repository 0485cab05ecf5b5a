//! Stitch I/O apps: the edges of a graph, where packets enter from and leave to the outside
//! world. [`register`] adds them all to a registry.
//!
//! # Map
//!
//! The modules, in short: apps at the edge of a graph: `af_packet` (+ `kernel_ring`: the reading
//! end of a kernel data plane's BPF ring buffer for an engine port), `af_xdp` (+ `xdp`: the
//! redirect program over `bpf(2)`, with the steering rules' filters in front: what a rule matches
//! goes to a socket of its own on the queue's UMEM and leaves by the rule's port — or, when that
//! port's link leads to a reader of rings such as a zero-copy function port, is read by that reader
//! itself: `stitch_xsk::lend`; the app in `af_xdp/`: `socket`, `datapath`, `steering`, `handover`),
//! `tap`, `pcap_source`, `pcap_sink`, `capture` (+ `capture_file`: writer thread, rotation;
//! `capture_format`: PCAP/PCAPNG records in the host's byte order); `link_capture`: live captures
//! of running links (the taps, their byte rings, the PCAPNG stream); `netdev` helpers.

pub mod af_packet;
pub mod af_xdp;
pub mod attachment;
pub mod capture;
pub mod capture_file;
pub mod capture_format;
pub mod kernel_ring;
pub mod kernel_routes;
pub mod link_capture;
pub mod netdev;
pub mod pcap_sink;
pub mod pcap_source;
pub mod tap;
pub mod xdp;

use stitch_core::{AppType, Registry};

/// Adds every app of this crate to `r`.
pub fn register(r: &mut Registry) {
    r.register(AppType::of::<pcap_source::PcapSource>(
        "pcap_source",
        "sends the packets of a PCAP/PCAPNG file (loop, recorded pace)",
    ))
    .register(AppType::of::<af_packet::AfPacket>(
        "af_packet",
        "any Linux interface: TPACKET_V2 (or V3) rx/tx rings, fanout, kernel filters, offloads",
    ))
    .register(AppType::of::<af_xdp::AfXdp>(
        "af_xdp",
        "kernel-bypass interface port: XDP redirect to AF_XDP sockets, zero-copy or copy",
    ))
    .register(AppType::of::<tap::Tap>(
        "tap",
        "a TAP device: hands packets to the host stack and takes them from it",
    ))
    .register(AppType::of::<kernel_routes::KernelRoutes>(
        "kernel_routes",
        "the kernel's links, nexthops and routes as netlink messages, for a router to follow",
    ))
    .register(AppType::of::<capture::Capture>(
        "capture",
        "records packets passing through to PCAP/PCAPNG files (rotation, ring), passes them on",
    ))
    .register(AppType::of::<pcap_sink::PcapSink>(
        "pcap_sink",
        "writes packets to a PCAP/PCAPNG file with nanosecond timestamps",
    ))
    .register(AppType::of::<attachment::Attachment>(
        "attachment",
        "a port a workload attaches to later (stitch-cni); drops what it is sent until then",
    ));
}
