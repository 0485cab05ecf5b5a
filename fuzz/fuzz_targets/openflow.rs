//! OpenFlow 1.3 messages from a controller: any bytes are answered (replies or ERROR
//! messages), never a panic, and every reply is itself a well-formed message.
#![no_main]
use libfuzzer_sys::fuzz_target;
use stitch_switch::{endpoint, ofp, Shared};

fuzz_target!(|data: &[u8]| {
    let shared = Shared::new("fuzz", &["a".into(), "b".into(), "c".into()], 1);
    for r in endpoint::respond(&shared, data) {
        assert!(r.len() >= 8 && r[0] == ofp::VERSION);
        assert_eq!(u16::from_be_bytes([r[2], r[3]]) as usize, r.len());
    }
});
