//! Classic BPF programs of any shape through the filter compiler: any program the compiler
//! takes runs on every frame without leaving its code or the frame — each frame ends where an
//! unreadable page begins, so a read past it faults — and a program libpcap's validator also
//! takes answers what libpcap's interpreter answers, a frame at a time and a batch at once.
use stitch_wire::filter::cbpf::{reference, Insn};
use stitch_wire::filter::native::NativeFilter;
use stitch_wire::filter::FrameRef;

const PAGE: usize = 4096;

/// A readable page followed by an unreadable one.
struct GuardedPage(*mut u8);

impl GuardedPage {
    fn new() -> GuardedPage {
        // SAFETY: an anonymous private mapping of two pages, then the second made unreadable;
        // both calls are checked.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                2 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let guard = (p as *mut u8).add(PAGE);
            assert_eq!(libc::mprotect(guard.cast(), PAGE, libc::PROT_NONE), 0);
            GuardedPage(p.cast())
        }
    }

    /// `frame` copied so that its last byte is the readable page's last.
    fn place(&self, frame: &[u8]) -> &[u8] {
        assert!(frame.len() <= PAGE);
        // SAFETY: the first page is ours, readable and writable, and `frame` fits in it.
        unsafe {
            let at = self.0.add(PAGE - frame.len());
            std::ptr::copy_nonoverlapping(frame.as_ptr(), at, frame.len());
            std::slice::from_raw_parts(at, frame.len())
        }
    }
}

thread_local! {
    static GUARDED: GuardedPage = GuardedPage::new();
}

/// `ld #0` and a store to every scratch word: libpcap's interpreter leaves them uninitialised,
/// and a program that reads one before storing it would answer differently by chance.
fn prologue() -> Vec<Insn> {
    let insn = |code, k| Insn {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    std::iter::once(insn(0x00, 0))
        .chain((0..16).map(|w| insn(0x02, w)))
        .collect()
}

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
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
    let Ok(native) = NativeFilter::compile(&program) else {
        return;
    };
    let valid = reference::valid(&program);
    let frames: Vec<&[u8]> = (0..=frame_bytes.len())
        .step_by(17)
        .map(|n| &frame_bytes[..n])
        .collect();
    let mut want = Vec::new();
    GUARDED.with(|page| {
        for (i, frame) in frames.iter().enumerate() {
            let guarded = page.place(frame);
            let alone = native.select_frames(&[FrameRef::new(guarded)], &mut [0]) == 1;
            if valid {
                assert_eq!(alone, reference::interpret(&program, frame), "{program:?}");
            }
            if alone {
                want.push(i as u32);
            }
        }
    });
    let refs: Vec<FrameRef> = frames.iter().map(|f| FrameRef::new(f)).collect();
    let mut matched = vec![0u32; refs.len()];
    let n = native.select_frames(&refs, &mut matched);
    assert_eq!(&matched[..n], &want[..], "{program:?} in a batch");
}
