#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| stitch_fuzz::route_messages::run(data));
