//! libpcap filter expressions (pflang, tcpdump's language) compiled once to classic BPF and run
//! on Ethernet frames in user space: the per-side filters of the lwAFTR and the per-port
//! policy of VM ports.

/// A compiled filter. Matching reads the frame only; the program never changes after
/// compilation.
pub struct PacketFilter {
    program: pcap::BpfProgram,
    expression: String,
}

// SAFETY: the compiled program is plain memory owned by this value (libpcap's `bpf_program`,
// freed on drop) and is only read after compilation, so moving it to another thread is sound.
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
            program,
            expression: expression.to_string(),
        })
    }

    /// Whether the Ethernet frame `frame` matches.
    #[inline]
    pub fn matches(&self, frame: &[u8]) -> bool {
        self.program.filter(frame)
    }

    pub fn expression(&self) -> &str {
        &self.expression
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

    fn frame(ethertype: u16) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        f[12..14].copy_from_slice(&ethertype.to_be_bytes());
        f[14] = 0x45;
        f
    }

    #[test]
    fn matches_by_expression_and_refuses_bad_ones() {
        let ip = PacketFilter::compile("ip").unwrap();
        assert!(ip.matches(&frame(0x0800)));
        assert!(!ip.matches(&frame(0x86dd)));
        let ip6 = PacketFilter::compile("ip6").unwrap();
        assert!(ip6.matches(&frame(0x86dd)));
        let e = PacketFilter::compile("ip and and").unwrap_err();
        assert!(e.contains("ip and and"), "{e}");
    }
}
