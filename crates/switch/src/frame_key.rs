//! The walk cache's key read straight from an IPv4 frame's first bytes, without the packet's
//! key.
//!
//! For IPv4 with a 20-byte header after at most one VLAN tag — most of what a switch carries —
//! every field of the key sits at a fixed place in the frame's first 42 bytes. So the bits the
//! walk cache keys on (the union of the pipeline's match masks) can be read from those bytes
//! under a mask worked out once per pipeline, one mask per shape (untagged, tagged), and the
//! 168-byte key is read only when the walk cache does not know the frame's bits: Open
//! vSwitch's exact-match cache keys on the parsed flow instead, and that parse is the step
//! this skips.
//!
//! Two frames of the same shape whose masked bytes are equal and that enter by the same port
//! have the same key bits, so the same walk (the property `equal_frame_bits_mean_equal_key_bits`
//! checks against [`oxm::Key::extract`] on random frames and masks).

use crate::oxm::{self, KEY_BYTES};
use stitch_wire::ethertype;

/// The frame bytes looked at: an IPv4 header after one tag ends at byte 38, its first four
/// transport bytes at 42.
const FRAME_BYTES: usize = 48;
const FRAME_WORDS: usize = FRAME_BYTES / 8;
/// The words of a frame key: the masked frame words, then the input port.
pub const WORDS: usize = FRAME_WORDS + 1;

/// Which bits of an IPv4 frame's first bytes the key bits come from, per shape.
#[derive(Clone, Copy)]
pub struct FrameBits {
    untagged: [u64; FRAME_WORDS],
    tagged: [u64; FRAME_WORDS],
}

impl FrameBits {
    /// The frame bits the key bits `key_mask` (per key byte, the bits some entry looks at)
    /// come from.
    pub fn of(key_mask: &[u8; KEY_BYTES]) -> FrameBits {
        FrameBits {
            untagged: words(&frame_mask(key_mask, 14)),
            tagged: words(&frame_mask(key_mask, 18)),
        }
    }

    /// The frame's key for a frame of one of the shapes entering by `in_port`; `None` for
    /// any other frame (its key bits are read from its key).
    #[inline]
    pub fn key(&self, frame: &[u8], in_port: u32) -> Option<[u64; WORDS]> {
        let (head, mask, _) = self.shape(frame)?;
        let mut key = [0u64; WORDS];
        for (i, (k, m)) in key.iter_mut().zip(mask).enumerate() {
            *k = u64::from_ne_bytes(head[i * 8..i * 8 + 8].try_into().unwrap()) & m;
        }
        key[FRAME_WORDS] = in_port as u64;
        Some(key)
    }

    /// The frame's first bytes, the mask of its shape and where its IPv4 header starts, for a
    /// frame of one of the shapes.
    #[inline]
    fn shape<'a>(
        &self,
        frame: &'a [u8],
    ) -> Option<(&'a [u8; FRAME_BYTES], &[u64; FRAME_WORDS], usize)> {
        let head: &[u8; FRAME_BYTES] = frame.get(..FRAME_BYTES)?.try_into().ok()?;
        let outer = u16::from_be_bytes([head[12], head[13]]);
        let (mask, l3) = match outer {
            ethertype::IPV4 => (&self.untagged, 14),
            ethertype::VLAN | ethertype::QINQ
                if u16::from_be_bytes([head[16], head[17]]) == ethertype::IPV4 =>
            {
                (&self.tagged, 18)
            }
            _ => return None,
        };
        // Version 4, a 20-byte header: the transport header at a fixed place.
        (head[l3] == 0x45).then_some((head, mask, l3))
    }

    /// For a frame of one of the shapes: per byte of its first bytes, the bits its frame key
    /// holds or its shape depends on.
    fn bits_read(&self, frame: &[u8]) -> Option<[u8; FRAME_BYTES]> {
        let (_, mask, l3) = self.shape(frame)?;
        let mut bytes: [u8; FRAME_BYTES] =
            std::array::from_fn(|i| mask[i / 8].to_ne_bytes()[i % 8]);
        for i in [12, 13, l3 - 2, l3 - 1, l3] {
            bytes[i] = 0xff;
        }
        Some(bytes)
    }
}

/// Checks what the frame key rests on, for frame `a` entering by `in_port` under key bits
/// `key_mask`: a frame that differs from `a` only outside the bits its frame key reads (those
/// bits taken from `noise`) has the same frame key and the same key bits as `a`. Panics when
/// it has not; returns `false` when `a` is of no shape the frame key reads (for tests and
/// fuzzing).
pub fn check_frame_key(
    key_mask: &[u8; KEY_BYTES],
    a: &[u8],
    in_port: u32,
    mut noise: impl FnMut() -> u8,
) -> bool {
    let bits = FrameBits::of(key_mask);
    let (Some(key), Some(read)) = (bits.key(a, in_port), bits.bits_read(a)) else {
        return false;
    };
    let b: Vec<u8> = a
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let keep = read.get(i).copied().unwrap_or(0);
            (x & keep) | (noise() & !keep)
        })
        .collect();
    assert_eq!(
        bits.key(&b, in_port),
        Some(key),
        "the frame key sees only its bits"
    );
    let key_bits = |f: &[u8]| -> Vec<u8> {
        let k = oxm::Key::extract(f, in_port);
        k.0.iter().zip(key_mask).map(|(b, m)| b & m).collect()
    };
    assert_eq!(
        key_bits(a),
        key_bits(&b),
        "frames {a:02x?} and {b:02x?} differ in key bits the frame key does not read"
    );
    true
}

fn words(bytes: &[u8; FRAME_BYTES]) -> [u64; FRAME_WORDS] {
    std::array::from_fn(|i| u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap()))
}

/// For an IPv4 frame whose header starts at `l3` (20 bytes, after `l3 - 14` bytes of tag):
/// the frame bits the key bits `key_mask` are read from. Fields copied from the frame keep
/// their bit masks; a field worked out from a byte (DSCP, a VLAN id) takes the whole byte. The
/// ethertype is always in (it tells the shapes apart), and so are the protocol and the
/// fragment offset when a transport field is (they decide whether the transport bytes are
/// read at all). Any other key field is the same for every frame of the shape (zero, or the
/// input port, which the frame key holds beside the bytes).
fn frame_mask(key_mask: &[u8; KEY_BYTES], l3: usize) -> [u8; FRAME_BYTES] {
    let bits = |id: u8| {
        let f = oxm::field(id).expect("a basic-class field");
        &key_mask[f.offset..f.offset + f.len as usize]
    };
    let used = |id: u8| bits(id).iter().any(|b| *b != 0);
    let mut m = [0u8; FRAME_BYTES];
    let mut copy = |id: u8, from: usize| {
        for (i, b) in bits(id).iter().enumerate() {
            m[from + i] |= b;
        }
    };
    let l4 = l3 + 20;
    copy(oxm::ETH_DST, 0);
    copy(oxm::ETH_SRC, 6);
    copy(oxm::IPV4_SRC, l3 + 12);
    copy(oxm::IPV4_DST, l3 + 16);
    let transport = [
        (oxm::TCP_SRC, oxm::TCP_DST),
        (oxm::UDP_SRC, oxm::UDP_DST),
        (oxm::SCTP_SRC, oxm::SCTP_DST),
        (oxm::ICMPV4_TYPE, oxm::ICMPV4_CODE),
    ];
    for (first, second) in transport {
        copy(first, l4);
        copy(second, l4 + bits(first).len());
    }
    let whole = |m: &mut [u8; FRAME_BYTES], at: std::ops::Range<usize>| m[at].fill(0xff);
    whole(&mut m, 12..14);
    if used(oxm::ETH_TYPE) {
        whole(&mut m, l3 - 2..l3);
    }
    if l3 > 14 && (used(oxm::VLAN_VID) || used(oxm::VLAN_PCP)) {
        whole(&mut m, 14..16);
    }
    if used(oxm::IP_DSCP) || used(oxm::IP_ECN) {
        whole(&mut m, l3 + 1..l3 + 2);
    }
    if used(oxm::IP_PROTO) {
        whole(&mut m, l3 + 9..l3 + 10);
    }
    if transport.iter().any(|(a, b)| used(*a) || used(*b)) {
        whole(&mut m, l3 + 6..l3 + 8);
        whole(&mut m, l3 + 9..l3 + 10);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random IPv4 frame of one of the shapes, or now and then of another.
    fn frame(rng: &mut fastrand::Rng) -> Vec<u8> {
        let mut f: Vec<u8> = (0..rng.usize(40..80)).map(|_| rng.u8(..)).collect();
        let tagged = rng.bool();
        let l3 = if tagged { 18 } else { 14 };
        if tagged {
            let tag = if rng.bool() {
                ethertype::VLAN
            } else {
                ethertype::QINQ
            };
            f[12..14].copy_from_slice(&tag.to_be_bytes());
        }
        if f.len() > l3 {
            f[l3 - 2..l3].copy_from_slice(&[8, 0]);
            f[l3] = if rng.u8(..10) > 0 { 0x45 } else { rng.u8(..) };
        }
        if f.len() > l3 + 9 {
            f[l3 + 9] = [1, 6, 17, 132, rng.u8(..)][rng.usize(..5)];
            if rng.u8(..10) < 7 {
                f[l3 + 6] &= 0xe0;
                f[l3 + 7] = 0;
            }
        }
        f
    }

    /// Key bits some entries might look at: a few fields, each whole or under a random mask.
    fn key_mask(rng: &mut fastrand::Rng) -> [u8; KEY_BYTES] {
        let mut m = [0u8; KEY_BYTES];
        for _ in 0..rng.usize(1..6) {
            let f = oxm::FIELDS.iter().flatten().nth(rng.usize(..40)).unwrap();
            for b in &mut m[f.offset..f.offset + f.len as usize] {
                *b |= if rng.bool() { 0xff } else { rng.u8(..) };
            }
        }
        m
    }

    #[test]
    fn equal_frame_bits_mean_equal_key_bits() {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut compared = 0;
        for _ in 0..20_000 {
            let mask = key_mask(&mut rng);
            let a = frame(&mut rng);
            let port = rng.u32(1..4);
            compared += check_frame_key(&mask, &a, port, || rng.u8(..)) as usize;
        }
        assert!(compared > 10_000, "only {compared} frames of the shapes");
    }

    #[test]
    fn frames_of_other_shapes_have_no_frame_key() {
        let bits = FrameBits::of(&[0xff; KEY_BYTES]);
        let mut ipv4 = vec![0u8; 60];
        ipv4[12..15].copy_from_slice(&[8, 0, 0x45]);
        assert!(bits.key(&ipv4, 1).is_some());
        let with_options = {
            let mut f = ipv4.clone();
            f[14] = 0x46;
            f
        };
        let arp = {
            let mut f = ipv4.clone();
            f[12..14].copy_from_slice(&[8, 6]);
            f
        };
        let two_tags = {
            let mut f = vec![0u8; 64];
            f[12..20].copy_from_slice(&[0x88, 0xa8, 0, 1, 0x81, 0, 0, 2]);
            f[20..23].copy_from_slice(&[8, 0, 0x45]);
            f
        };
        for f in [&with_options, &arp, &two_tags, &ipv4[..47].to_vec()] {
            assert_eq!(bits.key(f, 1), None, "{f:02x?}");
        }
    }
}
