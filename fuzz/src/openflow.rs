//! OpenFlow 1.3 messages from a controller: any bytes are answered (replies or ERROR
//! messages), never a panic, and every reply is itself a well-formed message. Besides the raw
//! stream, the input's first byte picks one of the messages that change or read the pipeline
//! (FLOW_MOD, GROUP_MOD, METER_MOD, PACKET_OUT, ROLE_REQUEST, SET_ASYNC, a MULTIPART request)
//! and the rest becomes its correctly framed body, so the fuzzer reaches the match, instruction,
//! action, bucket and band parsers instead of stopping at the header.
use stitch_switch::{endpoint, ofp, Shared};

fn framed(data: &[u8]) -> Vec<u8> {
    let Some((&pick, body)) = data.split_first() else {
        return Vec::new();
    };
    let kinds = ofp::PIPELINE_MESSAGES;
    let mut m = ofp::start(kinds[pick as usize % kinds.len()], 1);
    m.extend_from_slice(&body[..body.len().min(65000)]);
    ofp::finish(m)
}

fn check(replies: Vec<Vec<u8>>) {
    for r in replies {
        assert!(r.len() >= 8 && r[0] == ofp::VERSION);
        assert_eq!(u16::from_be_bytes([r[2], r[3]]) as usize, r.len());
    }
}

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let shared = Shared::new("fuzz", &["a".into(), "b".into(), "c".into()], 1);
    check(endpoint::respond(&shared, data));
    // The same switch, now with whatever the raw stream installed, takes a framed message.
    check(endpoint::respond(&shared, &framed(data)));
}
