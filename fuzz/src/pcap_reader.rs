//! PCAP/PCAPNG bytes from an untrusted file: the reader must end in packets, an end or an error.
use stitch_io::pcap_source::PcapFile;

/// One input: a panic, a hang or a fault is a finding.
pub fn run(data: &[u8]) {
    let Ok(mut f) = PcapFile::from_reader(Box::new(std::io::Cursor::new(data.to_vec()))) else {
        return;
    };
    let mut n = 0;
    while let Some(Ok((_, bytes))) = f.next_packet() {
        assert!(bytes.len() <= stitch_core::packet::MAX_FRAME);
        n += 1;
        if n > 100_000 {
            break;
        }
    }
}
