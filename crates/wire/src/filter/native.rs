//! Classic BPF compiled to x86-64 machine code that runs over a whole batch of frames in one
//! call: the program's body sits inside a loop over the frames, so a frame costs the program's
//! own loads and compares (and an index store when it matches), with no call, register save or
//! argument block per frame (what a per-frame JIT such as NetBSD's bpfjit pays; `cargo bench
//! -p stitch-wire --bench filter`).
//!
//! The semantics are libpcap's interpreter's (`bpf_filter`): A and X start at 0, a load outside
//! the frame or a division by zero rejects the frame, a shift by 32 or more gives 0, a `ret`
//! with a non-zero value accepts. The program is checked before a byte is emitted: known
//! opcodes only, every jump forward and inside the program, the last instruction a `ret`,
//! scratch words below 16, no constant division by 0 nor shift by 32 or more. So no frame can
//! take the code outside
//! the program or make it read outside the frame.

use super::cbpf::*;
use super::FrameRef;
use dynasmrt::{
    dynasm, x64::Assembler, x64::Rq, DynamicLabel, DynasmApi, DynasmLabelApi, ExecutableBuffer,
};
use stitch_core::packet::{Packet, FRAME_LEN_AT, FRAME_OFFSET_AT, HEADER_SIZE};

/// The program's entry: `count` items from `items` in (frames or packets, as compiled), the
/// indices of those that match out, in order; returns how many matched.
type BatchFn =
    unsafe extern "sysv64" fn(items: *const u8, count: usize, matched: *mut u32) -> usize;

/// A program as machine code, in two forms that differ only in how a frame is found.
pub struct NativeFilter {
    /// Owns the executable pages the entries point into.
    _code: ExecutableBuffer,
    over_frames: BatchFn,
    over_packets: BatchFn,
}

/// How the loop finds each frame.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Items {
    /// A [`FrameRef`] per item.
    Frames,
    /// A [`Packet`] per item: the buffer's address, its frame found through the buffer's header.
    Packets,
}

impl NativeFilter {
    /// Checks `program` and compiles it; the error says which instruction was refused.
    pub fn compile(program: &[Insn]) -> Result<NativeFilter, String> {
        check(program)?;
        let mut ops = Assembler::new().map_err(|e| format!("executable memory: {e}"))?;
        let over_frames = ops.offset();
        emit_batch_loop(&mut ops, program, Items::Frames);
        let over_packets = ops.offset();
        emit_batch_loop(&mut ops, program, Items::Packets);
        let code = ops
            .finalize()
            .map_err(|_| "executable memory: the assembler could not finalise".to_string())?;
        // SAFETY: each offset is the start of a function `emit_batch_loop` wrote, which follows
        // the System V ABI (it touches only caller-saved registers and gives back the stack as
        // it found it) and has `BatchFn`'s signature; `code` owns the pages and lives as long
        // as the value.
        let (over_frames, over_packets): (BatchFn, BatchFn) = unsafe {
            (
                std::mem::transmute::<*const u8, BatchFn>(code.ptr(over_frames)),
                std::mem::transmute::<*const u8, BatchFn>(code.ptr(over_packets)),
            )
        };
        Ok(NativeFilter {
            _code: code,
            over_frames,
            over_packets,
        })
    }

    /// Writes the indices of the `frames` that match to the front of `matched` (at least as
    /// long as `frames`) and returns how many there are.
    #[inline]
    pub fn select_frames(&self, frames: &[FrameRef<'_>], matched: &mut [u32]) -> usize {
        assert!(matched.len() >= frames.len(), "room for every index");
        // SAFETY: the code reads `frames.len()` frame references and writes at most that many
        // indices to `matched`; `check` proved that every load it makes from a frame is
        // bounds-checked against that frame's length and that it cannot jump out of itself.
        unsafe { (self.over_frames)(frames.as_ptr().cast(), frames.len(), matched.as_mut_ptr()) }
    }

    /// [`NativeFilter::select_frames`] over the frames of `packets`.
    #[inline]
    pub fn select_packets(&self, packets: &[Packet], matched: &mut [u32]) -> usize {
        assert!(matched.len() >= packets.len(), "room for every index");
        // SAFETY: as in `select_frames`; a `Packet` is a pointer to a buffer (transparent) whose
        // header holds the frame's length and offset at `FRAME_LEN_AT` / `FRAME_OFFSET_AT`, the
        // frame lying inside the buffer's data area (`Packet`'s invariant), and the packets are
        // borrowed, so no one changes them while the code reads.
        unsafe { (self.over_packets)(packets.as_ptr().cast(), packets.len(), matched.as_mut_ptr()) }
    }
}

/// The function: for each item, its frame, A = X = 0, the program, the item's index when it
/// matches; then the next item.
///
/// Only caller-saved registers, so a call costs no saves: A is eax, X r10d, the frame's address
/// r8 and length r9, the item rdi and the end of the items rsi, the next index slot rdx (kept
/// on the stack around a division, which needs it); r11 and rcx are scratch. The stack holds
/// the 16 scratch words, then the first item and the first index slot.
fn emit_batch_loop(ops: &mut Assembler, program: &[Insn], items: Items) {
    let labels: Vec<DynamicLabel> = program.iter().map(|_| ops.new_dynamic_label()).collect();
    let next_item = ops.new_dynamic_label();
    let accept = ops.new_dynamic_label();
    let advance = ops.new_dynamic_label();
    let done = ops.new_dynamic_label();
    let stride = match items {
        Items::Frames => std::mem::size_of::<FrameRef>(),
        Items::Packets => std::mem::size_of::<Packet>(),
    };
    assert!(
        stride.is_power_of_two(),
        "an item's index is its offset shifted"
    );
    let stride_shift = stride.trailing_zeros() as i8;
    dynasm!(ops
        ; .arch x64
        ; sub rsp, FRAME_BYTES
        ; mov QWORD [rsp + FIRST_ITEM_AT], rdi
        ; mov QWORD [rsp + FIRST_SLOT_AT], rdx
        ; shl rsi, stride_shift
        ; add rsi, rdi
        ; cmp rdi, rsi
        ; jae =>done
        ; =>next_item
    );
    match items {
        Items::Frames => dynasm!(ops
            ; .arch x64
            ; mov r8, QWORD [rdi]
            ; mov r9, QWORD [rdi + 8]
        ),
        Items::Packets => dynasm!(ops
            ; .arch x64
            ; mov r11, QWORD [rdi]
            ; mov r9d, DWORD [r11 + FRAME_LEN_AT as i32]
            ; mov ecx, DWORD [r11 + FRAME_OFFSET_AT as i32]
            ; lea r8, [r11 + rcx + HEADER_SIZE as i32]
        ),
    }
    dynasm!(ops
        ; .arch x64
        ; xor eax, eax
        ; xor r10d, r10d
    );
    for (pc, insn) in program.iter().enumerate() {
        dynasm!(ops ; =>labels[pc]);
        emit_insn(
            ops,
            *insn,
            &|offset| labels[pc + 1 + offset],
            accept,
            advance,
        );
    }
    dynasm!(ops
        ; .arch x64
        ; =>accept
        ; mov rax, rdi
        ; sub rax, QWORD [rsp + FIRST_ITEM_AT]
        ; shr rax, stride_shift
        ; mov DWORD [rdx], eax
        ; add rdx, 4
        ; =>advance
        ; add rdi, stride as i32
        ; cmp rdi, rsi
        ; jb =>next_item
        ; =>done
        ; mov rax, rdx
        ; sub rax, QWORD [rsp + FIRST_SLOT_AT]
        ; shr rax, 2
        ; add rsp, FRAME_BYTES
        ; ret
    );
}

/// The stack frame: the scratch words from 0, then the two saved pointers, then padding that
/// keeps the stack 16-byte aligned below the return address.
const FIRST_ITEM_AT: i32 = (MEMWORDS * 4) as i32;
const FIRST_SLOT_AT: i32 = FIRST_ITEM_AT + 8;
const FRAME_BYTES: i32 = FIRST_SLOT_AT + 8 + 8;

/// One instruction; `target(n)` is the label of the instruction `n` after the next.
///
/// A frame that matches goes to `accept`; one that does not — a load outside it or a division
/// by zero included — to `reject` (the loop's next item).
fn emit_insn(
    ops: &mut Assembler,
    i: Insn,
    target: &dyn Fn(usize) -> DynamicLabel,
    accept: DynamicLabel,
    reject: DynamicLabel,
) {
    let k = i.k as i32;
    let slot = i.k.wrapping_mul(4) as i32; // used only for scratch words, which `check` bounds
    match i.code & CLASS {
        LD => match i.code & MODE {
            ABS => emit_load_abs(ops, i.code & SIZE, i.k, reject),
            IND => emit_load_ind(ops, i.code & SIZE, i.k, reject),
            IMM => dynasm!(ops ; .arch x64 ; mov eax, k),
            LEN => dynasm!(ops ; .arch x64 ; mov eax, r9d),
            _ => dynasm!(ops ; .arch x64 ; mov eax, DWORD [rsp + slot]),
        },
        LDX => match i.code & MODE {
            IMM => dynasm!(ops ; .arch x64 ; mov r10d, k),
            LEN => dynasm!(ops ; .arch x64 ; mov r10d, r9d),
            MEM => dynasm!(ops ; .arch x64 ; mov r10d, DWORD [rsp + slot]),
            _ => {
                // X = 4 × the low nibble of frame[k] (an IPv4 header's length).
                if emit_bounds_check(ops, i.k, 1, reject) {
                    dynasm!(ops
                        ; .arch x64
                        ; movzx r10d, BYTE [r8 + k]
                        ; and r10d, 0x0f
                        ; shl r10d, 2
                    );
                }
            }
        },
        ST => dynasm!(ops ; .arch x64 ; mov DWORD [rsp + slot], eax),
        STX => dynasm!(ops ; .arch x64 ; mov DWORD [rsp + slot], r10d),
        ALU => emit_alu(ops, i, reject),
        JMP => emit_jump(ops, i, target),
        RET => {
            if i.code & RVAL == RET_A {
                dynasm!(ops
                    ; .arch x64
                    ; test eax, eax
                    ; jnz =>accept
                    ; jmp =>reject
                );
            } else if i.k != 0 {
                dynasm!(ops ; .arch x64 ; jmp =>accept);
            } else {
                dynasm!(ops ; .arch x64 ; jmp =>reject);
            }
        }
        _ => {
            if i.code == MISC {
                dynasm!(ops ; .arch x64 ; mov r10d, eax);
            } else {
                dynasm!(ops ; .arch x64 ; mov eax, r10d);
            }
        }
    }
}

/// Rejects a frame shorter than `offset + size`; returns false when no frame is that long (or
/// the offset is beyond a displacement's reach): the code rejects every frame there, and the
/// load that would follow is not emitted.
fn emit_bounds_check(ops: &mut Assembler, offset: u32, size: u32, reject: DynamicLabel) -> bool {
    match i32::try_from(offset as u64 + size as u64) {
        Ok(end) => {
            dynasm!(ops
                ; .arch x64
                ; cmp r9, end
                ; jb =>reject
            );
            true
        }
        Err(_) => {
            dynasm!(ops ; .arch x64 ; jmp =>reject);
            false
        }
    }
}

/// A = the big-endian value of `size` bytes at `offset`, or reject when the frame is shorter.
fn emit_load_abs(ops: &mut Assembler, size: u16, offset: u32, reject: DynamicLabel) {
    if emit_bounds_check(ops, offset, bytes_loaded(size), reject) {
        emit_load(ops, size, FRAME_REG, offset as i32);
    }
}

/// A = the big-endian value of `size` bytes at X + `offset` (no wrap: both are 32-bit and the
/// sum is taken in 64 bits), or reject when the frame is shorter.
fn emit_load_ind(ops: &mut Assembler, size: u16, offset: u32, reject: DynamicLabel) {
    let width = bytes_loaded(size) as i32;
    dynasm!(ops
        ; .arch x64
        ; mov r11d, r10d
        ; mov ecx, offset as i32
        ; add r11, rcx
        ; lea rcx, [r11 + width]
        ; cmp rcx, r9
        ; ja =>reject
        ; add r11, r8
    );
    emit_load(ops, size, SCRATCH_REG, 0);
}

/// Where `emit_load` finds its base: the frame's address, or the scratch register.
const FRAME_REG: Rq = Rq::R8;
const SCRATCH_REG: Rq = Rq::R11;

/// A = the big-endian value of `size` bytes at `base` + `displacement` (already checked).
fn emit_load(ops: &mut Assembler, size: u16, base: Rq, displacement: i32) {
    match size {
        W => dynasm!(ops ; .arch x64 ; mov eax, DWORD [Rq(base) + displacement] ; bswap eax),
        H => dynasm!(ops ; .arch x64 ; movzx eax, WORD [Rq(base) + displacement] ; rol ax, 8),
        _ => dynasm!(ops ; .arch x64 ; movzx eax, BYTE [Rq(base) + displacement]),
    }
}

/// A = A op K or A op X, in 32 bits; division or remainder by X = 0 rejects, a shift by 32 or
/// more gives 0 (libpcap's interpreter).
fn emit_alu(ops: &mut Assembler, i: Insn, reject: DynamicLabel) {
    let k = i.k as i32;
    let by_x = i.code & SRC_X != 0;
    match (i.code & OP, by_x) {
        (ADD, false) => dynasm!(ops ; .arch x64 ; add eax, k),
        (ADD, true) => dynasm!(ops ; .arch x64 ; add eax, r10d),
        (SUB, false) => dynasm!(ops ; .arch x64 ; sub eax, k),
        (SUB, true) => dynasm!(ops ; .arch x64 ; sub eax, r10d),
        (MUL, false) => dynasm!(ops ; .arch x64 ; imul eax, eax, k),
        (MUL, true) => dynasm!(ops ; .arch x64 ; imul eax, r10d),
        (OR, false) => dynasm!(ops ; .arch x64 ; or eax, k),
        (OR, true) => dynasm!(ops ; .arch x64 ; or eax, r10d),
        (AND, false) => dynasm!(ops ; .arch x64 ; and eax, k),
        (AND, true) => dynasm!(ops ; .arch x64 ; and eax, r10d),
        (XOR, false) => dynasm!(ops ; .arch x64 ; xor eax, k),
        (XOR, true) => dynasm!(ops ; .arch x64 ; xor eax, r10d),
        (LSH, false) => dynasm!(ops ; .arch x64 ; shl eax, i.k as i8),
        (RSH, false) => dynasm!(ops ; .arch x64 ; shr eax, i.k as i8),
        (LSH | RSH, true) => {
            let in_range = ops.new_dynamic_label();
            let shifted = ops.new_dynamic_label();
            dynasm!(ops
                ; .arch x64
                ; mov ecx, r10d
                ; cmp ecx, 32
                ; jb =>in_range
                ; xor eax, eax
                ; jmp =>shifted
                ; =>in_range
            );
            if i.code & OP == LSH {
                dynasm!(ops ; .arch x64 ; shl eax, cl);
            } else {
                dynasm!(ops ; .arch x64 ; shr eax, cl);
            }
            dynasm!(ops ; .arch x64 ; =>shifted);
        }
        (op @ (DIV | MOD), _) => {
            if by_x {
                dynasm!(ops
                    ; .arch x64
                    ; test r10d, r10d
                    ; jz =>reject
                    ; mov ecx, r10d
                );
            } else {
                dynasm!(ops ; .arch x64 ; mov ecx, k);
            }
            // The division takes rdx, the next index slot: pushed for it and popped after (no
            // scratch word, which `rsp` locates, is touched in between).
            dynasm!(ops
                ; .arch x64
                ; push rdx
                ; xor edx, edx
                ; div ecx
            );
            if op == MOD {
                dynasm!(ops ; .arch x64 ; mov eax, edx);
            }
            dynasm!(ops ; .arch x64 ; pop rdx);
        }
        _ => dynasm!(ops ; .arch x64 ; neg eax),
    }
}

/// `ja`, or a comparison of A with K or X and a jump to the true or false instruction (an
/// offset of 0 falls through).
fn emit_jump(ops: &mut Assembler, i: Insn, target: &dyn Fn(usize) -> DynamicLabel) {
    let op = i.code & OP;
    if op == JA {
        dynasm!(ops ; .arch x64 ; jmp =>target(i.k as usize));
        return;
    }
    let k = i.k as i32;
    match (op, i.code & SRC_X != 0) {
        (JSET, false) => dynasm!(ops ; .arch x64 ; test eax, k),
        (JSET, true) => dynasm!(ops ; .arch x64 ; test eax, r10d),
        (_, false) => dynasm!(ops ; .arch x64 ; cmp eax, k),
        (_, true) => dynasm!(ops ; .arch x64 ; cmp eax, r10d),
    }
    let (jt, jf) = (i.jt as usize, i.jf as usize);
    if jt == jf {
        if jt != 0 {
            dynasm!(ops ; .arch x64 ; jmp =>target(jt));
        }
        return;
    }
    // Jump when the condition holds to `jt`, else fall through to (or jump to) `jf`.
    let when_true = target(jt);
    let when_false = target(jf);
    if jt != 0 {
        match op {
            JEQ => dynasm!(ops ; .arch x64 ; je =>when_true),
            JGT => dynasm!(ops ; .arch x64 ; ja =>when_true),
            JGE => dynasm!(ops ; .arch x64 ; jae =>when_true),
            _ => dynasm!(ops ; .arch x64 ; jnz =>when_true),
        }
        if jf != 0 {
            dynasm!(ops ; .arch x64 ; jmp =>when_false);
        }
    } else {
        match op {
            JEQ => dynasm!(ops ; .arch x64 ; jne =>when_false),
            JGT => dynasm!(ops ; .arch x64 ; jbe =>when_false),
            JGE => dynasm!(ops ; .arch x64 ; jb =>when_false),
            _ => dynasm!(ops ; .arch x64 ; jz =>when_false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::cbpf::testing::{random_frame, random_program};

    fn insn(code: u16, jt: u8, jf: u8, k: u32) -> Insn {
        Insn { code, jt, jf, k }
    }

    #[test]
    fn random_programs_answer_what_libpcap_interprets_over_frames_and_packets() {
        let mut rng = fastrand::Rng::with_seed(11);
        let frames: Vec<Vec<u8>> = (0..64).map(|_| random_frame(&mut rng)).collect();
        let refs: Vec<FrameRef> = frames.iter().map(|f| FrameRef::new(f)).collect();
        let packets: Vec<Packet> = frames
            .iter()
            .map(|f| {
                let mut p = stitch_core::pool::alloc().expect("a buffer");
                p.set_data(f).expect("fits");
                p
            })
            .collect();
        let (mut programs, mut accepting) = (0, 0);
        let mut matched = [0u32; 64];
        while programs < 3000 {
            let program = random_program(&mut rng);
            assert!(reference::valid(&program), "{program:?}");
            let native = NativeFilter::compile(&program).expect("compiles");
            programs += 1;
            let want: Vec<u32> = (0..frames.len() as u32)
                .filter(|&i| reference::interpret(&program, &frames[i as usize]))
                .collect();
            let n = native.select_frames(&refs, &mut matched);
            assert_eq!(&matched[..n], &want[..], "{program:?} over frames");
            let n = native.select_packets(&packets, &mut matched);
            assert_eq!(&matched[..n], &want[..], "{program:?} over packets");
            for (i, frame) in refs.iter().enumerate().take(4) {
                let n = native.select_frames(std::slice::from_ref(frame), &mut matched);
                assert_eq!(n == 1, want.contains(&(i as u32)), "{program:?} alone");
            }
            accepting += want.len();
        }
        let all = programs * frames.len();
        assert!(
            accepting > all / 10 && accepting < all * 9 / 10,
            "{accepting} of {all}: the programs tell frames apart"
        );
        let accept_all = NativeFilter::compile(&[insn(RET, 0, 0, 1)]).unwrap();
        assert_eq!(accept_all.select_frames(&[], &mut []), 0);
        assert_eq!(accept_all.select_packets(&packets, &mut matched), 64);
    }

    #[test]
    fn programs_that_could_leave_the_code_or_the_frame_are_refused() {
        let ret = insn(RET | RET_A, 0, 0, 0);
        let refused = [
            vec![],
            vec![insn(LD | IMM, 0, 0, 1)],
            vec![insn(JMP, 0, 0, 1), ret],
            vec![insn(JMP | JEQ, 0, 1, 0), ret],
            vec![insn(LD | MEM, 0, 0, 16), ret],
            vec![insn(ST, 0, 0, 99), ret],
            vec![insn(ALU | DIV, 0, 0, 0), ret],
            vec![insn(ALU | LSH, 0, 0, 32), ret],
            vec![insn(LD | W | 0xc0, 0, 0, 0), ret],
            vec![insn(LDX | W | ABS, 0, 0, 0), ret],
            vec![insn(RET | 0x08, 0, 0, 0)],
            vec![insn(MISC | 0x20, 0, 0, 0), ret],
            vec![insn(0x100 | LD, 0, 0, 0), ret],
        ];
        for program in refused {
            let e = NativeFilter::compile(&program)
                .err()
                .unwrap_or_else(|| panic!("{program:?} was taken"));
            assert!(e.contains("instruction") || e.contains("return"), "{e}");
        }
    }

    #[test]
    fn parses_the_text_libpcap_prints() {
        assert_eq!(Insn::parse("40 0 0 12"), Some(insn(0x28, 0, 0, 12)));
        assert_eq!(Insn::parse("21 0 3 2048"), Some(insn(0x15, 0, 3, 2048)));
        assert_eq!(Insn::parse("6 0 0 262144 7"), None);
        assert_eq!(Insn::parse("6 0 0"), None);
    }
}
