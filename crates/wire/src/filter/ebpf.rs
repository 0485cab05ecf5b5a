//! Classic BPF translated to eBPF, for filters the kernel runs at an interface's XDP hook (the
//! steering rules of `af_xdp` interfaces: which frames go straight to which function). libpcap
//! compiles the expression, so it means what it means in tcpdump; the translation keeps
//! libpcap's interpreter's semantics ([`cbpf`](super::cbpf)): A and X start at 0, a load outside
//! the frame or a division by zero rejects the frame, a shift by 32 or more gives 0, a `ret`
//! with a non-zero value accepts.
//!
//! Every load from the frame is preceded by a comparison against the frame's end that the
//! kernel's verifier follows, so the verifier proves what the x86-64 back end's `check` argues:
//! no read outside the frame. XDP sees a frame's linear part only (all of it below the page
//! size, so all of an MTU-1500 frame); a load beyond 32 KiB rejects, as no linear part is that
//! long.
//!
//! Registers: r6 the frame's start, r7 its end, r8 A, r9 X, r1–r2 scratch; the 16 scratch words
//! sit at the top of the stack ([`SCRATCH_TOP`]), the queue the frame came in on below them
//! ([`QUEUE_SLOT`]).

use super::cbpf::*;

/// A place in the program a jump can name before it is placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Label(usize);

/// One instruction, its jump target still a label.
#[derive(Clone, Copy, Debug)]
struct Op {
    code: u8,
    dst: u8,
    src: u8,
    off: i16,
    imm: i32,
    target: Option<Label>,
}

/// An eBPF program under construction.
#[derive(Default)]
pub struct Asm {
    ops: Vec<Op>,
    labels: Vec<Option<usize>>,
}

// eBPF opcodes (`linux/bpf.h`, `bpf_common.h`).
const LDX_W: u8 = 0x61;
const LDX_H: u8 = 0x69;
const LDX_B: u8 = 0x71;
const ST_W: u8 = 0x62;
const STX_W: u8 = 0x63;
const ALU32: u8 = 0x04;
const ALU64: u8 = 0x07;
const JMP64: u8 = 0x05;
const JMP32: u8 = 0x06;
const SRC_REG: u8 = 0x08;
const MOV: u8 = 0xb0;
const END_TO_BE: u8 = 0xdc;
const EXIT: u8 = 0x95;
const CALL: u8 = 0x85;
const LD_IMM64: u8 = 0x18;
const JNE: u8 = 0x50;
const PSEUDO_MAP_FD: u8 = 1;

pub const R0: u8 = 0;
pub const R1: u8 = 1;
pub const R2: u8 = 2;
pub const R3: u8 = 3;
const DATA: u8 = 6;
const DATA_END: u8 = 7;
const A: u8 = 8;
const X: u8 = 9;
const FP: u8 = 10;

/// The stack offset just below the scratch words (`fp - 64 .. fp`).
pub const SCRATCH_TOP: i16 = -64;
/// Where the prologue keeps `rx_queue_index` (a u32).
pub const QUEUE_SLOT: i16 = SCRATCH_TOP - 8;
/// The farthest a load may reach into the frame: XDP's linear part is below a page, and a
/// packet offset must stay well inside what the verifier takes.
const MAX_REACH: u32 = 0x7fff;

/// `struct xdp_md`'s fields.
const XDP_DATA: i16 = 0;
const XDP_DATA_END: i16 = 4;
const XDP_RX_QUEUE_INDEX: i16 = 16;

impl Asm {
    pub fn new() -> Asm {
        Asm::default()
    }

    pub fn label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }

    /// Places `label` at the next instruction.
    pub fn bind(&mut self, label: Label) {
        self.labels[label.0] = Some(self.ops.len());
    }

    /// One instruction as the kernel defines it.
    pub fn raw(&mut self, code: u8, dst: u8, src: u8, off: i16, imm: i32) {
        self.ops.push(Op {
            code,
            dst,
            src,
            off,
            imm,
            target: None,
        });
    }

    /// A jump instruction (`code` of class JMP or JMP32) to `target`.
    pub fn jump(&mut self, code: u8, dst: u8, src: u8, imm: i32, target: Label) {
        self.ops.push(Op {
            code,
            dst,
            src,
            off: 0,
            imm,
            target: Some(target),
        });
    }

    /// `goto target`.
    pub fn goto(&mut self, target: Label) {
        self.jump(JMP64, 0, 0, 0, target);
    }

    /// `dst = map` for the map with descriptor `fd` (a two-slot `ld_imm64`).
    pub fn load_map(&mut self, dst: u8, fd: i32) {
        self.raw(LD_IMM64, dst, PSEUDO_MAP_FD, 0, fd);
        self.raw(0, 0, 0, 0, 0);
    }

    /// `r0 = helper(r1 … r5)`; r1–r5 are clobbered.
    pub fn call(&mut self, helper: i32) {
        self.raw(CALL, 0, 0, 0, helper);
    }

    /// `dst += imm` (64 bits).
    pub fn add_imm(&mut self, dst: u8, imm: i32) {
        self.raw(ALU64 | ADD as u8, dst, 0, 0, imm);
    }

    /// `if dst >= imm goto target` (unsigned, 64 bits).
    pub fn jump_if_at_least(&mut self, dst: u8, imm: i32, target: Label) {
        self.jump(JMP64 | JGE as u8, dst, 0, imm, target);
    }

    /// `if dst != imm goto target` (64 bits).
    pub fn jump_if_not(&mut self, dst: u8, imm: i32, target: Label) {
        self.jump(JMP64 | JNE, dst, 0, imm, target);
    }

    /// `dst = imm` (64 bits, sign-extended).
    pub fn mov_imm(&mut self, dst: u8, imm: i32) {
        self.raw(ALU64 | MOV, dst, 0, 0, imm);
    }

    /// `dst = *(u32 *)(fp + off)`.
    pub fn load_stack(&mut self, dst: u8, off: i16) {
        self.raw(LDX_W, dst, FP, off, 0);
    }

    /// `return value`.
    pub fn ret(&mut self, value: i32) {
        self.mov_imm(R0, value);
        self.raw(EXIT, 0, 0, 0, 0);
    }

    /// `return r0`.
    pub fn exit(&mut self) {
        self.raw(EXIT, 0, 0, 0, 0);
    }

    /// The start of an XDP program: the frame's bounds in r6/r7, the queue it came in on at
    /// [`QUEUE_SLOT`].
    pub fn xdp_prologue(&mut self) {
        self.raw(LDX_W, R2, R1, XDP_RX_QUEUE_INDEX, 0);
        self.raw(STX_W, FP, R2, QUEUE_SLOT, 0);
        self.raw(LDX_W, DATA, R1, XDP_DATA, 0);
        self.raw(LDX_W, DATA_END, R1, XDP_DATA_END, 0);
    }

    /// The classic BPF `program`: falls through when it accepts the frame, jumps to `miss`
    /// when it rejects it. Needs [`Asm::xdp_prologue`] before it; A and X start at 0.
    pub fn filter(&mut self, program: &[Insn], miss: Label) -> Result<(), String> {
        check(program)?;
        self.raw(ALU32 | MOV, A, 0, 0, 0);
        self.raw(ALU32 | MOV, X, 0, 0, 0);
        // The scratch words the program reads start at 0: the verifier refuses a read of a
        // stack slot never written, which libpcap's programs never make but cannot show.
        let mut read = [false; MEMWORDS as usize];
        for i in program {
            if i.code == LD | MEM || i.code == LDX | MEM {
                read[i.k as usize] = true;
            }
        }
        for (k, _) in read.iter().enumerate().filter(|(_, r)| **r) {
            self.raw(ST_W, FP, 0, scratch(k as u32), 0);
        }
        let at: Vec<Label> = program.iter().map(|_| self.label()).collect();
        let accept = self.label();
        let after = |pc: usize, offset: u32| at[pc + 1 + offset as usize];
        for (pc, i) in program.iter().enumerate() {
            self.bind(at[pc]);
            let k = i.k;
            match i.code & CLASS {
                LD => match i.code & MODE {
                    ABS => self.load_absolute(A, k, bytes_loaded(i.code), miss),
                    IND => self.load_indirect(k, bytes_loaded(i.code), miss),
                    IMM => self.raw(ALU32 | MOV, A, 0, 0, k as i32),
                    LEN => self.frame_length(A),
                    _ => self.raw(LDX_W, A, FP, scratch(k), 0),
                },
                LDX => match i.code & MODE {
                    IMM => self.raw(ALU32 | MOV, X, 0, 0, k as i32),
                    LEN => self.frame_length(X),
                    MEM => self.raw(LDX_W, X, FP, scratch(k), 0),
                    _ => {
                        // MSH: X = 4 * (frame[k] & 0xf), an IPv4 header's length.
                        self.load_absolute(X, k, 1, miss);
                        self.raw(ALU32 | AND as u8, X, 0, 0, 0xf);
                        self.raw(ALU32 | LSH as u8, X, 0, 0, 2);
                    }
                },
                ST => self.raw(STX_W, FP, A, scratch(k), 0),
                STX => self.raw(STX_W, FP, X, scratch(k), 0),
                ALU => self.alu(i, miss),
                JMP => match i.code & OP {
                    JA => self.goto(after(pc, k)),
                    op => {
                        let (taken, not_taken) = (after(pc, i.jt as u32), after(pc, i.jf as u32));
                        if i.code & SRC_X != 0 {
                            self.jump(JMP32 | op as u8 | SRC_REG, A, X, 0, taken);
                        } else {
                            self.jump(JMP32 | op as u8, A, 0, k as i32, taken);
                        }
                        if i.jf != 0 {
                            self.goto(not_taken);
                        }
                    }
                },
                RET => match (i.code & RVAL, k) {
                    (RET_K, 0) => self.goto(miss),
                    (RET_K, _) => self.goto(accept),
                    _ => {
                        self.jump(JMP32 | JEQ as u8, A, 0, 0, miss);
                        self.goto(accept);
                    }
                },
                _ => match i.code {
                    c if c == MISC | MISC_TXA => self.raw(ALU32 | MOV | SRC_REG, A, X, 0, 0),
                    _ => self.raw(ALU32 | MOV | SRC_REG, X, A, 0, 0),
                },
            }
        }
        self.bind(accept);
        Ok(())
    }

    /// `dst = frame[k .. k + size]` in network byte order; to `miss` beyond the frame.
    fn load_absolute(&mut self, dst: u8, k: u32, size: u32, miss: Label) {
        if k > MAX_REACH - size {
            self.goto(miss);
            return;
        }
        self.raw(ALU64 | MOV | SRC_REG, R2, DATA, 0, 0);
        self.add_imm(R2, (k + size) as i32);
        self.jump(JMP64 | JGT as u8 | SRC_REG, R2, DATA_END, 0, miss);
        self.raw(load_op(size), dst, DATA, k as i16, 0);
        self.swap_to_network_order(dst, size);
    }

    /// `A = frame[X + k .. X + k + size]`; to `miss` beyond the frame. X is bounded first so
    /// that the verifier knows the pointer's range.
    fn load_indirect(&mut self, k: u32, size: u32, miss: Label) {
        if k > MAX_REACH - size {
            self.goto(miss);
            return;
        }
        self.raw(ALU64 | MOV | SRC_REG, R1, X, 0, 0);
        self.jump(JMP64 | JGT as u8, R1, 0, MAX_REACH as i32, miss);
        self.raw(ALU64 | ADD as u8 | SRC_REG, R1, DATA, 0, 0);
        self.raw(ALU64 | MOV | SRC_REG, R2, R1, 0, 0);
        self.add_imm(R2, (k + size) as i32);
        self.jump(JMP64 | JGT as u8 | SRC_REG, R2, DATA_END, 0, miss);
        self.raw(load_op(size), A, R1, k as i16, 0);
        self.swap_to_network_order(A, size);
    }

    fn swap_to_network_order(&mut self, dst: u8, size: u32) {
        if size > 1 {
            self.raw(END_TO_BE, dst, 0, 0, (size * 8) as i32);
        }
    }

    /// `dst = data_end - data` (a pointer difference: the verifier takes it from a privileged
    /// loader, which attaching XDP needs anyway).
    fn frame_length(&mut self, dst: u8) {
        self.raw(ALU64 | MOV | SRC_REG, dst, DATA_END, 0, 0);
        self.raw(ALU64 | SUB as u8 | SRC_REG, dst, DATA, 0, 0);
    }

    fn alu(&mut self, i: &Insn, miss: Label) {
        let op = (i.code & OP) as u8;
        let by_x = i.code & SRC_X != 0;
        match (i.code & OP, by_x) {
            (NEG, _) => self.raw(ALU32 | op, A, 0, 0, 0),
            (DIV | MOD, true) => {
                self.jump(JMP64 | JEQ as u8, X, 0, 0, miss);
                self.raw(ALU32 | op | SRC_REG, A, X, 0, 0);
            }
            (LSH | RSH, true) => {
                // eBPF masks the shift count; libpcap gives 0 for 32 and more.
                let (zero, done) = (self.label(), self.label());
                self.jump_if_at_least(X, 32, zero);
                self.raw(ALU32 | op | SRC_REG, A, X, 0, 0);
                self.goto(done);
                self.bind(zero);
                self.raw(ALU32 | MOV, A, 0, 0, 0);
                self.bind(done);
            }
            (_, true) => self.raw(ALU32 | op | SRC_REG, A, X, 0, 0),
            (_, false) => self.raw(ALU32 | op, A, 0, 0, i.k as i32),
        }
    }

    /// The program in the kernel's encoding, each jump's offset resolved. Instructions no
    /// path reaches are left out (the verifier refuses a program that has any): a classic
    /// program's dead code, a filter that never rejects (what follows its `miss` label) or
    /// never accepts (what follows it).
    pub fn finish(self) -> Result<Vec<[u8; 8]>, String> {
        let target = |op: &Op| -> Result<Option<usize>, String> {
            op.target
                .map(|l| {
                    self.labels[l.0].ok_or_else(|| "a jump to a label never placed".to_string())
                })
                .transpose()
        };
        let reached = self.reached(target)?;
        // Where each instruction lands once the unreached ones are gone.
        let mut new_at = Vec::with_capacity(self.ops.len() + 1);
        let mut kept = 0usize;
        for &r in &reached {
            new_at.push(kept);
            kept += usize::from(r);
        }
        new_at.push(kept);
        let mut out = Vec::with_capacity(kept);
        for (at, op) in self.ops.iter().enumerate().filter(|(at, _)| reached[*at]) {
            let off = match target(op)? {
                None => op.off,
                Some(to) => {
                    i16::try_from(new_at[to] as i64 - new_at[at] as i64 - 1).map_err(|_| {
                        format!("the program is too long for a jump ({kept} instructions)")
                    })?
                }
            };
            let mut b = [0u8; 8];
            b[0] = op.code;
            b[1] = (op.src << 4) | (op.dst & 0x0f);
            b[2..4].copy_from_slice(&off.to_le_bytes());
            b[4..8].copy_from_slice(&op.imm.to_le_bytes());
            out.push(b);
        }
        Ok(out)
    }

    /// Which instructions a path from the first reaches (every jump goes forward, so one pass
    /// in order sees each instruction after everything that can lead to it).
    fn reached(
        &self,
        target: impl Fn(&Op) -> Result<Option<usize>, String>,
    ) -> Result<Vec<bool>, String> {
        let n = self.ops.len();
        let mut reached = vec![false; n];
        if n > 0 {
            reached[0] = true;
        }
        let mark = |reached: &mut Vec<bool>, at: usize| -> Result<(), String> {
            let r =
                (reached.get_mut(at)).ok_or("a path runs past the program's last instruction")?;
            *r = true;
            Ok(())
        };
        for at in 0..n {
            if !reached[at] {
                continue;
            }
            let op = &self.ops[at];
            let class = op.code & 0x07;
            let is_jump = class == JMP64 || class == JMP32;
            if let Some(to) = target(op)? {
                if to <= at {
                    return Err("a jump backwards".into());
                }
                mark(&mut reached, to)?;
            }
            match op.code {
                EXIT => {}
                LD_IMM64 => {
                    mark(&mut reached, at + 1)?;
                    mark(&mut reached, at + 2)?;
                }
                c if is_jump && c == JMP64 => {}
                _ => mark(&mut reached, at + 1)?,
            }
        }
        Ok(reached)
    }
}

fn load_op(size: u32) -> u8 {
    match size {
        4 => LDX_W,
        2 => LDX_H,
        _ => LDX_B,
    }
}

/// Scratch word `k`'s stack offset (`check` bounds `k` below 16).
fn scratch(k: u32) -> i16 {
    SCRATCH_TOP + 4 * k as i16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_resolve_and_unplaced_labels_are_errors() {
        let mut asm = Asm::new();
        let end = asm.label();
        asm.goto(end);
        asm.ret(1);
        asm.bind(end);
        asm.ret(2);
        let code = asm.finish().unwrap();
        assert_eq!(code.len(), 3, "`return 1` is never reached: left out");
        assert_eq!(i16::from_le_bytes([code[0][2], code[0][3]]), 0);
        assert_eq!(i32::from_le_bytes(code[1][4..8].try_into().unwrap()), 2);

        let mut asm = Asm::new();
        asm.mov_imm(R0, 1);
        assert!(asm.finish().is_err(), "a path that runs off the end");

        let mut asm = Asm::new();
        let nowhere = asm.label();
        asm.goto(nowhere);
        assert!(asm.finish().is_err());
    }

    #[test]
    fn programs_the_checks_refuse_are_not_translated() {
        let mut asm = Asm::new();
        let miss = asm.label();
        let no_return = [Insn {
            code: LD | IMM,
            jt: 0,
            jf: 0,
            k: 1,
        }];
        assert!(asm.filter(&no_return, miss).is_err());
    }
}
