//! Frames as the OpenFlow switch's data path reads them: any bytes give a key
//! (`Key::extract`), never a panic; and for the frames whose walk is found from their first
//! bytes (`frame_key`), a frame differing from one only outside the bits its frame key reads
//! has the same frame key and the same key bits, whatever fields the pipeline looks at. The
//! input's first four bytes pick those fields (and their masks), the rest is the frame.
use stitch_switch::frame_key::check_frame_key;
use stitch_switch::oxm::{Key, FIELDS, KEY_BYTES};

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let Some((picks, frame)) = data.split_first_chunk::<4>() else {
        return;
    };
    let _ = Key::extract(frame, 1);
    let mut mask = [0u8; KEY_BYTES];
    let fields: Vec<_> = FIELDS.iter().flatten().collect();
    for pick in picks {
        let f = fields[*pick as usize % fields.len()];
        // The top bit: the whole field, or under a mask of every other bit.
        let bits = if pick & 0x80 != 0 { 0xff } else { 0x55 };
        mask[f.offset..f.offset + f.len as usize].fill(bits);
    }
    // The bits outside those read are each frame's own bytes inverted.
    let mut i = 0;
    check_frame_key(&mask, frame, 2, || {
        i += 1;
        !frame[i - 1]
    });
}
