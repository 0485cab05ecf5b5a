//! The bytes a function sends Stitch's attach socket before it is served — from a guest, through
//! its virtio-serial port, anything at all — in chunks of any size: the listener assembles
//! lines, parses each as a hello, and closes a connection whose line grows too long. Never a
//! panic; a hello taken names the protocol's version and comes from a complete line.

use stitch_nf::listener::hellos_in;

/// One input: its first byte sizes the chunks (1 to 256 bytes), the rest is what is sent.
pub fn run(data: &[u8]) {
    let Some((&size, sent)) = data.split_first() else {
        return;
    };
    let chunks = sent.chunks(usize::from(size) + 1);
    let (hellos, closed) = hellos_in(chunks);
    let lines = sent.iter().filter(|b| **b == b'\n').count();
    assert!(hellos.len() <= lines);
    assert!(!closed || sent.len() > 64 << 10);
    for hello in hellos.iter().flatten() {
        assert_eq!(hello["version"], stitch_nf::shm::VERSION);
    }
}
