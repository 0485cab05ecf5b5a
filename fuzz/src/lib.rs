//! The fuzz targets' bodies, one module each: `fuzz_targets/` runs them under libFuzzer
//! (`cargo +nightly fuzz run T`), and `tests/corpora.rs` replays every input kept in
//! `corpus/T/` through them on stable Rust, as the test suite does on every change.

pub mod filter_programs;
pub mod function_channels;
pub mod function_hellos;
pub mod graph_file;
pub mod lwaftr_packets;
pub mod network_functions;
pub mod openflow;
pub mod packet_filter;
pub mod packet_views;
pub mod pcap_reader;
pub mod route_messages;
pub mod switch_frames;
pub mod vhost_messages;

/// Every target, by the name of its `fuzz_targets/` file and `corpus/` folder.
pub const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("filter_programs", filter_programs::run),
    ("function_channels", function_channels::run),
    ("function_hellos", function_hellos::run),
    ("graph_file", graph_file::run),
    ("lwaftr_packets", lwaftr_packets::run),
    ("network_functions", network_functions::run),
    ("openflow", openflow::run),
    ("packet_filter", packet_filter::run),
    ("packet_views", packet_views::run),
    ("pcap_reader", pcap_reader::run),
    ("route_messages", route_messages::run),
    ("switch_frames", switch_frames::run),
    ("vhost_messages", vhost_messages::run),
];
