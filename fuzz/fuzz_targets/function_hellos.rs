#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| stitch_fuzz::function_hellos::run(data));
