#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| stitch_fuzz::switch_frames::run(data));
