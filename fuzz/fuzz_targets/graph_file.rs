#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| stitch_fuzz::graph_file::run(data));
