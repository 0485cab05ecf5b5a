//! The Internet checksum (RFC 1071), used where apps build or edit headers.

/// Adds `data` as big-endian 16-bit words to a running 32-bit sum (an odd last byte is padded).
#[inline]
pub fn sum(data: &[u8], mut acc: u64) -> u64 {
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_be_bytes(c.try_into().unwrap());
        acc += (w >> 48) + ((w >> 32) & 0xffff) + ((w >> 16) & 0xffff) + (w & 0xffff);
    }
    let mut rest = chunks.remainder().chunks_exact(2);
    for c in &mut rest {
        acc += u16::from_be_bytes([c[0], c[1]]) as u64;
    }
    if let [b] = rest.remainder() {
        acc += (*b as u64) << 8;
    }
    acc
}

/// Folds a running sum into the one's-complement checksum field value.
#[inline]
pub fn finish(mut acc: u64) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// The checksum of `data`.
pub fn checksum(data: &[u8]) -> u16 {
    finish(sum(data, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc1071_example_and_odd_length() {
        // RFC 1071 §3: 00 01 f2 03 f4 f5 f6 f7 sums to 0xddf2.
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
        assert_eq!(checksum(&[0xff]), !0xff00);
        // A correct IPv4 header sums to 0xffff, i.e. checksum 0.
        let hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&hdr), 0);
    }
}
