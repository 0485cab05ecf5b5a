//! Classic BPF programs of any shape through the filter compiler: a program libpcap's validator
//! takes either compiles or is refused with a reason, and compiled it answers what libpcap's
//! interpreter answers on every frame; a program the compiler takes must never leave its code
//! or its frame (libFuzzer's sanitizers and a crash would say).
#![no_main]
use libfuzzer_sys::fuzz_target;
use stitch_wire::filter::native::{reference, Insn, NativeFilter};
use stitch_wire::filter::FrameRef;

/// `ld #0` and a store to every scratch word: libpcap's interpreter leaves them uninitialised,
/// and a program that reads one before storing it would answer differently by chance.
fn prologue() -> Vec<Insn> {
    let insn = |code, k| Insn { code, jt: 0, jf: 0, k };
    std::iter::once(insn(0x00, 0)).chain((0..16).map(|w| insn(0x02, w))).collect()
}

fuzz_target!(|data: &[u8]| {
    let (frame_bytes, code) = data.split_at(data.len().min(96));
    let body: Vec<Insn> = code
        .chunks_exact(8)
        .map(|c| Insn {
            code: u16::from_le_bytes([c[0], c[1]]),
            jt: c[2],
            jf: c[3],
            k: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect();
    let program: Vec<Insn> = prologue().into_iter().chain(body).collect();
    let native = NativeFilter::compile(&program);
    if !reference::valid(&program) {
        return;
    }
    let Ok(native) = native else { return };
    let frames: Vec<&[u8]> = (0..=frame_bytes.len()).step_by(17).map(|n| &frame_bytes[..n]).collect();
    let refs: Vec<FrameRef> = frames.iter().map(|f| FrameRef::new(f)).collect();
    let mut matched = vec![0u32; refs.len()];
    let n = native.select_frames(&refs, &mut matched);
    let want: Vec<u32> = (0..frames.len() as u32)
        .filter(|&i| reference::interpret(&program, frames[i as usize]))
        .collect();
    assert_eq!(&matched[..n], &want[..], "{program:?}");
});
