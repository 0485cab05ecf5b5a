//! IEEE 802.1Q / 802.1ad tags: reading, pushing and popping them in place (the 12 address bytes
//! move by 4; the payload stays where it is).

use crate::ethertype;
use stitch_core::packet::{Packet, PacketError};

pub const TPID_8021Q: u16 = ethertype::VLAN;
pub const TPID_8021AD: u16 = ethertype::QINQ;

/// The outer tag of a frame: (TPID, TCI), if it has one.
pub fn outer_tag(frame: &[u8]) -> Option<(u16, u16)> {
    let tpid = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    if tpid != TPID_8021Q && tpid != TPID_8021AD {
        return None;
    }
    Some((tpid, u16::from_be_bytes([*frame.get(14)?, *frame.get(15)?])))
}

/// VLAN id (low 12 bits of a TCI).
pub fn vid(tci: u16) -> u16 {
    tci & 0x0fff
}

/// Inserts a tag after the addresses.
pub fn push(p: &mut Packet, tpid: u16, tci: u16) -> Result<(), PacketError> {
    if p.len() < 14 {
        return Err(PacketError::TooShort(14));
    }
    p.prepend(4)?;
    let d = p.data_mut();
    d.copy_within(4..16, 0);
    d[12..14].copy_from_slice(&tpid.to_be_bytes());
    d[14..16].copy_from_slice(&tci.to_be_bytes());
    fix_offsets(p, 4);
    Ok(())
}

/// Removes the outer tag and returns its TCI; `None` (frame unchanged) if untagged.
pub fn pop(p: &mut Packet) -> Option<u16> {
    let (_, tci) = outer_tag(p.data())?;
    if p.len() < 18 {
        return None;
    }
    p.data_mut().copy_within(0..12, 4);
    p.shift_front(4).ok()?;
    fix_offsets(p, -4);
    Some(tci)
}

/// Rewrites the VLAN id of the outer tag, keeping priority bits.
pub fn set_vid(frame: &mut [u8], vid: u16) -> bool {
    let Some((_, tci)) = outer_tag(frame) else {
        return false;
    };
    let tci = (tci & 0xf000) | (vid & 0x0fff);
    frame[14..16].copy_from_slice(&tci.to_be_bytes());
    true
}

/// Replaces the frame's first `cut` bytes by `head`: the net effect of tags pushed and popped
/// and addresses rewritten, made in one copy. The rest of the frame does not move.
pub fn replace_head(p: &mut Packet, cut: usize, head: &[u8]) -> Result<(), PacketError> {
    let n = head.len();
    if cut > p.len() {
        return Err(PacketError::TooShort(cut));
    }
    if n > cut {
        p.prepend(n - cut)?;
    } else {
        p.shift_front(cut - n)?;
    }
    p.data_mut()[..n].copy_from_slice(head);
    fix_offsets(p, n as i32 - cut as i32);
    Ok(())
}

/// Keeps a partial checksum's start pointing at the same header after the frame grew or shrank.
fn fix_offsets(p: &mut Packet, delta: i32) {
    if p.checksum_state() == stitch_core::packet::ChecksumState::Partial {
        let h = p.header_mut();
        h.csum_start = (h.csum_start as i32 + delta).max(0) as u16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::pool;

    #[test]
    fn push_pop_and_rewrite() {
        let mut p = pool::alloc().unwrap();
        let frame: Vec<u8> = (0..64u8).collect();
        p.set_data(&frame).unwrap();
        push(&mut p, TPID_8021Q, 0x2000 | 10).unwrap();
        assert_eq!(p.len(), 68);
        assert_eq!(&p.data()[..12], &frame[..12]);
        assert_eq!(outer_tag(p.data()), Some((TPID_8021Q, 0x200a)));
        assert_eq!(&p.data()[16..], &frame[12..]);
        assert!(set_vid(p.data_mut(), 20));
        assert_eq!(outer_tag(p.data()), Some((TPID_8021Q, 0x2014)));
        assert_eq!(pop(&mut p), Some(0x2014));
        assert_eq!(p.data(), &frame[..]);
        assert_eq!(pop(&mut p), None);
    }

    #[test]
    fn a_replaced_head_is_what_a_push_and_a_rewrite_make() {
        let frame: Vec<u8> = (0..64u8).collect();
        let mut pushed = pool::alloc().unwrap();
        pushed.set_data(&frame).unwrap();
        push(&mut pushed, TPID_8021Q, 7).unwrap();
        pushed.data_mut()[0] = 0xff;
        let mut replaced = pool::alloc().unwrap();
        replaced.set_data(&frame).unwrap();
        replace_head(&mut replaced, 14, &pushed.data()[..18]).unwrap();
        assert_eq!(replaced.data(), pushed.data());
        // And back: the tag goes, the addresses come back.
        replace_head(&mut replaced, 18, &frame[..14]).unwrap();
        assert_eq!(replaced.data(), &frame[..]);
        assert!(replace_head(&mut replaced, 65, &[]).is_err());
    }
}
