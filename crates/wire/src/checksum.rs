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

/// RFC 1624 incremental update: the checksum after one 16-bit word of the covered data changed
/// from `old` to `new` (HC' = ~(~HC + ~m + m')).
#[inline]
pub fn update(cs: u16, old: u16, new: u16) -> u16 {
    let sum = (!cs as u32) + (!old as u32) + new as u32;
    let sum = (sum & 0xffff) + (sum >> 16);
    !(((sum & 0xffff) + (sum >> 16)) as u16)
}

/// Incremental update for a 32-bit field (an IPv4 address, a TCP sequence number).
#[inline]
pub fn update32(cs: u16, old: u32, new: u32) -> u16 {
    update(
        update(cs, (old >> 16) as u16, (new >> 16) as u16),
        old as u16,
        new as u16,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_update_matches_recomputation() {
        let mut hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        let cs = u16::from_be_bytes([hdr[10], hdr[11]]);
        // Decrement TTL: word 8..10 changes from 0x4011 to 0x3f11.
        let new = update(cs, 0x4011, 0x3f11);
        hdr[8] = 0x3f;
        hdr[10..12].copy_from_slice(&new.to_be_bytes());
        assert_eq!(checksum(&hdr), 0);
        // Rewrite the source address.
        let cs = u16::from_be_bytes([hdr[10], hdr[11]]);
        let new = update32(cs, 0xc0a8_0001, 0x0a00_0005);
        hdr[12..16].copy_from_slice(&0x0a00_0005u32.to_be_bytes());
        hdr[10..12].copy_from_slice(&new.to_be_bytes());
        assert_eq!(checksum(&hdr), 0);
    }

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
