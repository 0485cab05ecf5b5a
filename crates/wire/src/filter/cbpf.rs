//! Classic BPF (`struct bpf_insn`) as libpcap compiles filter expressions to it: the
//! instruction, the checks that make a program safe to translate (shared by the x86-64 and the
//! eBPF back ends), and libpcap's own interpreter as the reference they are tested against.

/// One classic BPF instruction (`struct bpf_insn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

impl Insn {
    /// The "code jt jf k" form libpcap prints an instruction in (`bpf_dump -dd` without commas).
    pub fn parse(text: &str) -> Option<Insn> {
        let mut fields = text.split_ascii_whitespace();
        let insn = Insn {
            code: fields.next()?.parse().ok()?,
            jt: fields.next()?.parse().ok()?,
            jf: fields.next()?.parse().ok()?,
            k: fields.next()?.parse().ok()?,
        };
        fields.next().is_none().then_some(insn)
    }
}

// Fields of an opcode (`bpf.h`).
pub(crate) const CLASS: u16 = 0x07;
pub(crate) const LD: u16 = 0x00;
pub(crate) const LDX: u16 = 0x01;
pub(crate) const ST: u16 = 0x02;
pub(crate) const STX: u16 = 0x03;
pub(crate) const ALU: u16 = 0x04;
pub(crate) const JMP: u16 = 0x05;
pub(crate) const RET: u16 = 0x06;
pub(crate) const MISC: u16 = 0x07;
pub(crate) const SIZE: u16 = 0x18;
pub(crate) const W: u16 = 0x00;
pub(crate) const H: u16 = 0x08;
pub(crate) const B: u16 = 0x10;
pub(crate) const MODE: u16 = 0xe0;
pub(crate) const IMM: u16 = 0x00;
pub(crate) const ABS: u16 = 0x20;
pub(crate) const IND: u16 = 0x40;
pub(crate) const MEM: u16 = 0x60;
pub(crate) const LEN: u16 = 0x80;
pub(crate) const MSH: u16 = 0xa0;
pub(crate) const OP: u16 = 0xf0;
pub(crate) const SRC_X: u16 = 0x08;
// ALU operations.
pub(crate) const ADD: u16 = 0x00;
pub(crate) const SUB: u16 = 0x10;
pub(crate) const MUL: u16 = 0x20;
pub(crate) const DIV: u16 = 0x30;
pub(crate) const OR: u16 = 0x40;
pub(crate) const AND: u16 = 0x50;
pub(crate) const LSH: u16 = 0x60;
pub(crate) const RSH: u16 = 0x70;
pub(crate) const NEG: u16 = 0x80;
pub(crate) const MOD: u16 = 0x90;
pub(crate) const XOR: u16 = 0xa0;
// Jumps.
pub(crate) const JA: u16 = 0x00;
pub(crate) const JEQ: u16 = 0x10;
pub(crate) const JGT: u16 = 0x20;
pub(crate) const JGE: u16 = 0x30;
pub(crate) const JSET: u16 = 0x40;
pub(crate) const RVAL: u16 = 0x18;
pub(crate) const RET_K: u16 = 0x00;
pub(crate) const RET_A: u16 = 0x10;
pub(crate) const MISC_TXA: u16 = 0x80;
/// Scratch words (`BPF_MEMWORDS`).
pub(crate) const MEMWORDS: u32 = 16;
/// libpcap's limit on a program's length (`BPF_MAXINSNS`).
pub(crate) const MAX_INSNS: usize = 4096;

/// The bytes a load reads, from its opcode (or its size field alone).
pub(crate) fn bytes_loaded(code: u16) -> u32 {
    match code & SIZE {
        W => 4,
        H => 2,
        _ => 1,
    }
}

/// The checks that make the emitted code safe to run on any frame.
pub(crate) fn check(program: &[Insn]) -> Result<(), String> {
    if program.is_empty() || program.len() > MAX_INSNS {
        return Err(format!(
            "a program has 1 to {MAX_INSNS} instructions, not {}",
            program.len()
        ));
    }
    if program[program.len() - 1].code & CLASS != RET {
        return Err("the program's last instruction is not a return".into());
    }
    for (pc, i) in program.iter().enumerate() {
        let refuse = |why: &str| Err(format!("instruction {pc} (code {:#06x}): {why}", i.code));
        let after = |offset: u64| pc as u64 + 1 + offset < program.len() as u64;
        let ok = match i.code & CLASS {
            LD => match (i.code & MODE, i.code & SIZE) {
                (ABS | IND, W | H | B) => i.code & !(MODE | SIZE | CLASS) == 0,
                (IMM | LEN, W) => i.code == LD | IMM || i.code == LD | LEN,
                (MEM, W) => i.code == LD | MEM && i.k < MEMWORDS,
                _ => false,
            },
            LDX => match i.code {
                c if c == LDX | IMM || c == LDX | LEN => true,
                c if c == LDX | MEM => i.k < MEMWORDS,
                c if c == LDX | B | MSH => true,
                _ => false,
            },
            ST | STX => i.code & !CLASS == 0 && i.k < MEMWORDS,
            ALU => {
                let op = i.code & OP;
                let by_k = i.code & SRC_X == 0;
                let known = i.code & !(OP | SRC_X | CLASS) == 0
                    && matches!(
                        op,
                        ADD | SUB | MUL | DIV | OR | AND | LSH | RSH | NEG | MOD | XOR
                    );
                let operand_fits = match op {
                    NEG => by_k,
                    DIV | MOD => !by_k || i.k != 0,
                    LSH | RSH => !by_k || i.k < 32,
                    _ => true,
                };
                known && operand_fits
            }
            JMP => match i.code & OP {
                JA => i.code == JMP && after(i.k as u64),
                JEQ | JGT | JGE | JSET => {
                    i.code & !(OP | SRC_X | CLASS) == 0 && after(i.jt as u64) && after(i.jf as u64)
                }
                _ => false,
            },
            RET => i.code & !(RVAL | CLASS) == 0 && matches!(i.code & RVAL, RET_K | RET_A),
            MISC => i.code == MISC || i.code == MISC | MISC_TXA,
            _ => unreachable!("the class is three bits"),
        };
        if !ok {
            return refuse("not an instruction this compiler takes, or out of range");
        }
    }
    Ok(())
}

/// libpcap's interpreter and validator over raw instructions: the reference for tests and fuzz
/// targets (libpcap exports both).
#[doc(hidden)]
pub mod reference {
    use super::Insn;

    #[repr(C)]
    struct BpfInsn {
        code: u16,
        jt: u8,
        jf: u8,
        k: u32,
    }

    #[link(name = "pcap")]
    extern "C" {
        fn bpf_filter(pc: *const BpfInsn, pkt: *const u8, wirelen: u32, buflen: u32) -> u32;
        fn bpf_validate(pc: *const BpfInsn, len: i32) -> i32;
    }

    fn raw(program: &[Insn]) -> Vec<BpfInsn> {
        program
            .iter()
            .map(|i| BpfInsn {
                code: i.code,
                jt: i.jt,
                jf: i.jf,
                k: i.k,
            })
            .collect()
    }

    /// Whether libpcap's validator takes `program`.
    pub fn valid(program: &[Insn]) -> bool {
        let raw = raw(program);
        // SAFETY: `raw` holds `program.len()` instructions in libpcap's layout; the validator
        // only reads them.
        unsafe { bpf_validate(raw.as_ptr(), raw.len() as i32) != 0 }
    }

    /// libpcap's interpreter's answer for `frame`; only for programs `valid` takes.
    pub fn interpret(program: &[Insn], frame: &[u8]) -> bool {
        assert!(
            valid(program),
            "libpcap's interpreter runs validated programs only"
        );
        let raw = raw(program);
        let len = frame.len() as u32;
        // SAFETY: a validated program only jumps within itself, and the interpreter checks every
        // load against `buflen`, the length of `frame`.
        unsafe { bpf_filter(raw.as_ptr(), frame.as_ptr(), len, len) != 0 }
    }
}

/// Random programs and frames for the back ends' tests against [`reference`].
#[doc(hidden)]
pub mod testing {
    use super::*;

    fn insn(code: u16, jt: u8, jf: u8, k: u32) -> Insn {
        Insn { code, jt, jf, k }
    }

    /// A random program libpcap's validator takes: loads of every kind, arithmetic, forward
    /// jumps and returns; scratch words are stored at the start (before any path reads them, as
    /// libpcap's compiler guarantees).
    pub fn random_program(rng: &mut fastrand::Rng) -> Vec<Insn> {
        let mut p = vec![insn(LD | IMM, 0, 0, rng.u32(..))];
        for word in 0..4 {
            p.push(insn(ST, 0, 0, word));
        }
        let body = rng.usize(1..24);
        let offset = |rng: &mut fastrand::Rng| match rng.u8(..8) {
            0 => rng.u32(..),
            1 => rng.u32(60..200),
            _ => rng.u32(..64),
        };
        for i in 0..body {
            let left = (body - i) as u8; // instructions after this one, the final return included
            let alu = |rng: &mut fastrand::Rng| {
                let op = [ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR][rng.usize(..11)];
                let by_x = op != NEG && rng.bool();
                let k = match op {
                    LSH | RSH => rng.u32(..32),
                    DIV | MOD => rng.u32(1..20),
                    _ => rng.u32(..),
                };
                insn(ALU | op | if by_x { SRC_X } else { 0 }, 0, 0, k)
            };
            let next = match rng.u8(..16) {
                0..=2 => insn(LD | ABS | [W, H, B][rng.usize(..3)], 0, 0, offset(rng)),
                3..=4 => insn(LD | IND | [W, H, B][rng.usize(..3)], 0, 0, offset(rng)),
                5 => insn(LDX | B | MSH, 0, 0, offset(rng)),
                6 => [
                    insn(LD | LEN, 0, 0, 0),
                    insn(LDX | LEN, 0, 0, 0),
                    insn(LDX | IMM, 0, 0, rng.u32(..40)),
                    insn(LD | IMM, 0, 0, rng.u32(..)),
                ][rng.usize(..4)],
                7 => [
                    insn(LD | MEM, 0, 0, rng.u32(..4)),
                    insn(LDX | MEM, 0, 0, rng.u32(..4)),
                    insn(ST, 0, 0, rng.u32(..4)),
                    insn(STX, 0, 0, rng.u32(..4)),
                ][rng.usize(..4)],
                8 => insn(MISC | [0, MISC_TXA][rng.usize(..2)], 0, 0, 0),
                9..=11 => alu(rng),
                12 => insn(JMP, 0, 0, rng.u32(..left as u32)),
                13 => insn(RET | [RET_K, RET_A][rng.usize(..2)], 0, 0, rng.u32(..3)),
                _ => {
                    let op = [JEQ, JGT, JGE, JSET][rng.usize(..4)];
                    let k = match rng.u8(..3) {
                        0 => rng.u32(..),
                        _ => rng.u32(..256),
                    };
                    let src = if rng.bool() { SRC_X } else { 0 };
                    insn(JMP | op | src, rng.u8(..left), rng.u8(..left), k)
                }
            };
            p.push(next);
        }
        p.push(insn(RET | RET_A, 0, 0, 0));
        p
    }

    pub fn random_frame(rng: &mut fastrand::Rng) -> Vec<u8> {
        let len = match rng.u8(..4) {
            0 => rng.usize(..16),
            _ => rng.usize(14..160),
        };
        (0..len)
            .map(|_| match rng.u8(..4) {
                0 => 0,
                1 => rng.u8(..8),
                _ => rng.u8(..),
            })
            .collect()
    }
}
