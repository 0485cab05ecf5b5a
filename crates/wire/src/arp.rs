//! ARP for Ethernet and IPv4 (RFC 826), read and written through smoltcp's `ArpPacket` view:
//! the one place the functions that answer or ask (NAT, router, lwAFTR, the CNI plugin's
//! announcements) meet the message's layout.

use crate::views::{
    ArpHardware, ArpOperation, ArpPacket, EthernetAddress, EthernetFrame, EthernetProtocol,
};
use std::net::Ipv4Addr;

/// An Ethernet/IPv4 ARP message's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    pub operation: ArpOperation,
    pub sender_mac: [u8; 6],
    pub sender_ip: Ipv4Addr,
    pub target_mac: [u8; 6],
    pub target_ip: Ipv4Addr,
}

impl Message {
    /// The ARP message an untagged Ethernet frame carries, or `None` when it carries none or
    /// one for other hardware or protocol addresses.
    pub fn read(frame: &[u8]) -> Option<Message> {
        let eth = EthernetFrame::new_checked(frame).ok()?;
        if eth.ethertype() != EthernetProtocol::Arp {
            return None;
        }
        let arp = ArpPacket::new_checked(eth.payload()).ok()?;
        if arp.hardware_type() != ArpHardware::Ethernet
            || arp.protocol_type() != EthernetProtocol::Ipv4
            || (arp.hardware_len(), arp.protocol_len()) != (6, 4)
        {
            return None;
        }
        let ipv4 = |b: &[u8]| Some(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?));
        Some(Message {
            operation: arp.operation(),
            sender_mac: arp.source_hardware_addr().try_into().ok()?,
            sender_ip: ipv4(arp.source_protocol_addr())?,
            target_mac: arp.target_hardware_addr().try_into().ok()?,
            target_ip: ipv4(arp.target_protocol_addr())?,
        })
    }

    pub fn is_request(&self) -> bool {
        self.operation == ArpOperation::Request
    }
}

/// The 28 bytes of an ARP message (`op` 1 request, 2 reply) from `sender` about `target`
/// (MAC and address each).
pub fn payload(op: u16, sender: ([u8; 6], Ipv4Addr), target: ([u8; 6], Ipv4Addr)) -> [u8; 28] {
    let mut a = [0u8; 28];
    let mut arp = ArpPacket::new_unchecked(&mut a[..]);
    arp.set_hardware_type(ArpHardware::Ethernet);
    arp.set_protocol_type(EthernetProtocol::Ipv4);
    arp.set_hardware_len(6);
    arp.set_protocol_len(4);
    arp.set_operation(ArpOperation::from(op));
    arp.set_source_hardware_addr(&sender.0);
    arp.set_source_protocol_addr(&sender.1.octets());
    arp.set_target_hardware_addr(&target.0);
    arp.set_target_protocol_addr(&target.1.octets());
    a
}

/// An Ethernet frame from `eth_src` to `eth_dst` carrying an ARP message (`op` 1 request, 2
/// reply) from `sender` about `target`, padded to the Ethernet minimum.
pub fn frame(
    eth_dst: [u8; 6],
    eth_src: [u8; 6],
    op: u16,
    sender: ([u8; 6], Ipv4Addr),
    target: ([u8; 6], Ipv4Addr),
) -> [u8; 60] {
    let mut f = [0u8; 60];
    let mut eth = EthernetFrame::new_unchecked(&mut f[..]);
    eth.set_dst_addr(EthernetAddress(eth_dst));
    eth.set_src_addr(EthernetAddress(eth_src));
    eth.set_ethertype(EthernetProtocol::Arp);
    f[14..42].copy_from_slice(&payload(op, sender, target));
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_message_reads_back() {
        let (a, b) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        let (ia, ib) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let f = frame(b, a, 2, (a, ia), (b, ib));
        assert_eq!(&f[12..22], &[8, 6, 0, 1, 8, 0, 6, 4, 0, 2]);
        let m = Message::read(&f).unwrap();
        assert_eq!(m.operation, ArpOperation::Reply);
        assert_eq!((m.sender_mac, m.sender_ip), (a, ia));
        assert_eq!((m.target_mac, m.target_ip), (b, ib));
        assert!(Message::read(&f[..41]).is_none());
        let mut other = f;
        other[19] = 16;
        assert!(
            Message::read(&other).is_none(),
            "not 6-byte hardware addresses"
        );
    }
}
