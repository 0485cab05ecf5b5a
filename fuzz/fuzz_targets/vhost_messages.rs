#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| stitch_fuzz::vhost_messages::run(data));
