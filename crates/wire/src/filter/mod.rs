//! libpcap filter expressions (pflang, tcpdump's language) compiled once to classic BPF and run
//! on Ethernet frames in user space: the per-side filters of the lwAFTR, the per-port policy of
//! VM ports and the filters of link captures. libpcap compiles the expression, so it means what
//! it means in tcpdump; [`native`] turns the program into x86-64 machine code that runs a whole
//! batch of frames per call ([`PacketFilter::select_packets`]), several times faster than
//! libpcap's interpreter per frame (`cargo bench -p stitch-wire --bench filter`).

pub mod cbpf;
pub mod ebpf;
#[cfg(target_arch = "x86_64")]
pub mod native;

use std::marker::PhantomData;
use stitch_core::packet::Packet;

/// A frame handed to [`PacketFilter::select_frames`]: its address and length, laid out as the
/// machine code reads them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FrameRef<'a> {
    ptr: *const u8,
    len: usize,
    _frame: PhantomData<&'a [u8]>,
}

impl<'a> FrameRef<'a> {
    #[inline(always)]
    pub fn new(frame: &'a [u8]) -> FrameRef<'a> {
        FrameRef {
            ptr: frame.as_ptr(),
            len: frame.len(),
            _frame: PhantomData,
        }
    }

    #[inline]
    pub fn as_slice(&self) -> &'a [u8] {
        // SAFETY: `ptr` and `len` came from a `&'a [u8]` in `new`, and `'a` still holds.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A compiled filter. Matching reads the frame only; the program never changes after
/// compilation.
pub struct PacketFilter {
    program: pcap::BpfProgram,
    /// The program as machine code; `None` off x86-64 or where the host refuses executable
    /// memory, and then libpcap's interpreter runs `program`.
    #[cfg(target_arch = "x86_64")]
    native: Option<native::NativeFilter>,
    expression: String,
}

// SAFETY: the compiled program is plain memory owned by this value (libpcap's `bpf_program`,
// freed on drop) and is only read after compilation, so moving it to another thread is sound;
// the machine code is likewise only executed, never written, after generation.
unsafe impl Send for PacketFilter {}

impl PacketFilter {
    /// Compiles `expression` for Ethernet frames; the error says what libpcap objected to.
    pub fn compile(expression: &str) -> Result<PacketFilter, String> {
        let dead =
            pcap::Capture::dead(pcap::Linktype::ETHERNET).map_err(|e| format!("libpcap: {e}"))?;
        let program = dead
            .compile(expression, true)
            .map_err(|e| format!("filter `{expression}`: {e}"))?;
        Ok(PacketFilter {
            #[cfg(target_arch = "x86_64")]
            native: machine_code(&program),
            program,
            expression: expression.to_string(),
        })
    }

    /// Whether the Ethernet frame `frame` matches.
    #[inline]
    pub fn matches(&self, frame: &[u8]) -> bool {
        self.select_frames(&[FrameRef::new(frame)], &mut [0]) == 1
    }

    /// Writes the indices of the `frames` that match to the front of `matched` (at least as
    /// long as `frames`) and returns how many match: one call into the machine code for all.
    #[inline]
    pub fn select_frames(&self, frames: &[FrameRef<'_>], matched: &mut [u32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if let Some(native) = &self.native {
            return native.select_frames(frames, matched);
        }
        self.select_interpreted(frames.iter().map(FrameRef::as_slice), matched)
    }

    /// [`PacketFilter::select_frames`] over the frames of `packets`, found by the machine code
    /// itself: a link's batch is judged without a pass over it first.
    #[inline]
    pub fn select_packets(&self, packets: &[Packet], matched: &mut [u32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if let Some(native) = &self.native {
            return native.select_packets(packets, matched);
        }
        self.select_interpreted(packets.iter().map(Packet::data), matched)
    }

    fn select_interpreted<'f>(
        &self,
        frames: impl ExactSizeIterator<Item = &'f [u8]>,
        matched: &mut [u32],
    ) -> usize {
        assert!(matched.len() >= frames.len(), "room for every index");
        let mut n = 0;
        for (i, frame) in frames.enumerate() {
            if self.matches_interpreted(frame) {
                matched[n] = i as u32;
                n += 1;
            }
        }
        n
    }

    /// Whether `frame` matches, by libpcap's own interpreter: the reference the machine code is
    /// checked against.
    pub fn matches_interpreted(&self, frame: &[u8]) -> bool {
        self.program.filter(frame)
    }

    /// Whether the filter runs as machine code (else by libpcap's interpreter).
    pub fn is_compiled(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.native.is_some();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The classic BPF program libpcap compiled the expression to (for the eBPF back end).
    pub fn instructions(&self) -> Vec<cbpf::Insn> {
        instructions(&self.program).expect("libpcap prints its instructions as four numbers")
    }
}

/// libpcap's program as instructions. They cross as the "code jt jf k" text the pcap crate
/// prints (it does not expose an instruction's fields).
fn instructions(program: &pcap::BpfProgram) -> Option<Vec<cbpf::Insn>> {
    (program.get_instructions().iter())
        .map(|i| cbpf::Insn::parse(&i.to_string()))
        .collect()
}

/// libpcap's program as machine code.
#[cfg(target_arch = "x86_64")]
fn machine_code(program: &pcap::BpfProgram) -> Option<native::NativeFilter> {
    let insns = instructions(program)?;
    match native::NativeFilter::compile(&insns) {
        Ok(code) => Some(code),
        Err(e) => {
            log::warn!("filter runs interpreted: {e}");
            None
        }
    }
}

impl std::fmt::Debug for PacketFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PacketFilter({:?})", self.expression)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ethertype;

    fn frame(ethertype: u16) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        f[12..14].copy_from_slice(&ethertype.to_be_bytes());
        f[14] = 0x45;
        f
    }

    #[test]
    fn matches_by_expression_and_refuses_bad_ones() {
        let ip = PacketFilter::compile("ip").unwrap();
        assert!(ip.matches(&frame(ethertype::IPV4)));
        assert!(!ip.matches(&frame(ethertype::IPV6)));
        let ip6 = PacketFilter::compile("ip6").unwrap();
        assert!(ip6.matches(&frame(ethertype::IPV6)));
        let e = PacketFilter::compile("ip and and").unwrap_err();
        assert!(e.contains("ip and and"), "{e}");
    }

    /// A frame of a random kind (IPv4 or IPv6 with TCP, UDP or ICMP, VLAN-tagged or not, ARP,
    /// or random bytes), with random addresses, ports and flags, sometimes cut short.
    fn random_frame(rng: &mut fastrand::Rng) -> Vec<u8> {
        let mut f = Vec::with_capacity(128);
        let macs = [[2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], [0xff; 6]];
        f.extend_from_slice(&macs[rng.usize(..3)]);
        f.extend_from_slice(&macs[rng.usize(..2)]);
        if rng.u8(..4) == 0 {
            f.extend_from_slice(&ethertype::VLAN.to_be_bytes());
            f.extend_from_slice(&[100u16, 200][rng.usize(..2)].to_be_bytes());
        }
        let l4 = [6u8, 17, 1, 58, 47][rng.usize(..5)];
        let port = |rng: &mut fastrand::Rng| [22u16, 53, 80, 1500, rng.u16(..)][rng.usize(..5)];
        match rng.u8(..8) {
            0..=3 => {
                f.extend_from_slice(&ethertype::IPV4.to_be_bytes());
                let ihl = if rng.u8(..8) == 0 { 6 } else { 5 };
                f.push(0x40 | ihl);
                f.push(rng.u8(..));
                f.extend_from_slice(&rng.u16(20..1500).to_be_bytes());
                f.extend_from_slice(&rng.u16(..).to_be_bytes());
                f.extend_from_slice(&[[0x40, 0], [0x20, 0], [0, 8]][rng.usize(..3)]);
                f.push(rng.u8(..));
                f.push(if l4 == 58 { 1 } else { l4 });
                f.extend_from_slice(&[0, 0]);
                for _ in 0..2 {
                    let net = [[10, 0, 0], [10, 1, 2], [192, 0, 2], [224, 0, 0]][rng.usize(..4)];
                    f.extend_from_slice(&net);
                    f.push(rng.u8(..4));
                }
                if ihl == 6 {
                    f.extend_from_slice(&[1, 1, 1, 1]);
                }
            }
            4..=5 => {
                f.extend_from_slice(&ethertype::IPV6.to_be_bytes());
                f.extend_from_slice(&[0x60, 0, 0, 0]);
                f.extend_from_slice(&40u16.to_be_bytes());
                f.push(l4);
                f.push(64);
                for _ in 0..2 {
                    let net = [[0x20, 1, 0xd, 0xb8], [0xfe, 0x80, 0, 0]][rng.usize(..2)];
                    f.extend_from_slice(&net);
                    f.extend_from_slice(&[0; 11]);
                    f.push(rng.u8(..4));
                }
            }
            6 => {
                f.extend_from_slice(&ethertype::ARP.to_be_bytes());
                f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, rng.u8(1..3)]);
                f.extend_from_slice(&[2, 0, 0, 0, 0, 1, 10, 0, 0, 1]);
                f.extend_from_slice(&[0, 0, 0, 0, 0, 0, 10, 0, 0, rng.u8(..4)]);
            }
            _ => {
                let n = rng.usize(..80);
                f.extend((0..n).map(|_| rng.u8(..)));
            }
        }
        f.extend_from_slice(&port(rng).to_be_bytes());
        f.extend_from_slice(&port(rng).to_be_bytes());
        f.extend((0..rng.usize(4..60)).map(|_| rng.u8(..)));
        if rng.u8(..6) == 0 {
            f.truncate(rng.usize(..f.len()));
        }
        f
    }

    #[test]
    fn machine_code_matches_what_libpcap_interprets() {
        let expressions = [
            "tcp",
            "udp port 53",
            "host 10.0.0.1",
            "net 10.0.0.0/8 and not port 22",
            "(ip6 and ip6[6] = 6) or tcp[tcpflags] & tcp-syn != 0",
            "vlan 100 and udp",
            "vlan and ip6",
            "arp and arp[7] = 2",
            "icmp[icmptype] == icmp-echo or icmp6",
            "ip[2:2] > 100",
            "ether src 02:00:00:00:00:01 and ether broadcast",
            "len > 100 or less 40",
            "ip proto 47 or ip6 proto 17",
            "portrange 1000-2000",
            "ip6 net 2001:db8::/32",
            "ip and ip[6:2] & 0x1fff != 0",
            "ip multicast",
            "udp[8:4] = 0x12345678 or tcp[20] > 0x80",
        ];
        let mut rng = fastrand::Rng::with_seed(7);
        let frames: Vec<Vec<u8>> = (0..4000).map(|_| random_frame(&mut rng)).collect();
        let mut telling = 0;
        for expression in expressions {
            let filter = PacketFilter::compile(expression).unwrap();
            assert!(filter.is_compiled(), "`{expression}` was not compiled");
            let mut matched = 0;
            for frame in &frames {
                let want = filter.matches_interpreted(frame);
                assert_eq!(
                    filter.matches(frame),
                    want,
                    "`{expression}` on {frame:02x?}"
                );
                matched += usize::from(want);
            }
            if matched > 0 && matched < frames.len() {
                telling += 1;
            }
        }
        // The frames tell the filters' answers apart: most filters take some and leave some.
        assert!(
            telling >= expressions.len() - 2,
            "{telling} of {}",
            expressions.len()
        );
    }
}
