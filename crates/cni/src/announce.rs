//! Telling a container's neighbours its addresses at once: an ARP announcement (RFC 5227 §3,
//! a gratuitous ARP) per IPv4 address and an unsolicited Neighbor Advertisement with the
//! Override flag (RFC 4861 §7.2.6) per IPv6 address, sent from the container's interface once
//! Stitch carries its port. A router or NAT that knew the address at an earlier container's MAC
//! (a container re-added under the same address) updates its entry now instead of sending to
//! the old MAC until the entry expires.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use stitch_wire::ndp::{icmp6_checksum, ICMPV6};

/// The frames announcing `addresses` from `mac`.
pub fn frames(mac: [u8; 6], addresses: &[IpAddr]) -> Vec<Vec<u8>> {
    addresses
        .iter()
        .map(|a| match a {
            IpAddr::V4(ip) => {
                stitch_wire::arp::frame([0xff; 6], mac, 1, (mac, *ip), ([0; 6], *ip)).to_vec()
            }
            IpAddr::V6(ip) => {
                let all_nodes: std::net::Ipv6Addr = "ff02::1".parse().expect("an address");
                let mut icmp = vec![136, 0, 0, 0, 0x20, 0, 0, 0]; // NA, Override
                icmp.extend_from_slice(&ip.octets());
                icmp.extend_from_slice(&[2, 1]); // target link-layer address
                icmp.extend_from_slice(&mac);
                let cs = icmp6_checksum(&ip.octets(), &all_nodes.octets(), &icmp);
                icmp[2..4].copy_from_slice(&cs.to_be_bytes());
                let mut f = vec![0x33, 0x33, 0, 0, 0, 1];
                f.extend_from_slice(&mac);
                f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
                f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
                f.extend_from_slice(&[ICMPV6, 255]);
                f.extend_from_slice(&ip.octets());
                f.extend_from_slice(&all_nodes.octets());
                f.extend_from_slice(&icmp);
                f
            }
        })
        .collect()
}

/// Sends `frames` out of `ifname` in the network namespace at `netns`, from a thread that
/// enters that namespace (the process stays where it is).
pub fn send(netns: &str, ifname: &str, frames: Vec<Vec<u8>>) -> Result<(), String> {
    let (netns, ifname) = (netns.to_string(), ifname.to_string());
    std::thread::spawn(move || send_here(&netns, &ifname, &frames))
        .join()
        .map_err(|_| "the announcing thread panicked".to_string())?
}

fn send_here(netns: &str, ifname: &str, frames: &[Vec<u8>]) -> Result<(), String> {
    let ns = std::fs::File::open(netns).map_err(|e| format!("cannot open {netns}: {e}"))?;
    // SAFETY: a namespace file descriptor; setns changes only this thread's namespace.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "setns {netns}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let name = std::ffi::CString::new(ifname).map_err(|_| "a bad interface name")?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(format!("{ifname} is not in {netns}"));
    }
    // SAFETY: plain socket creation; the descriptor is owned below. Protocol 0: send only.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!(
            "packet socket: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain data; all zero is a valid value.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_ifindex = ifindex as i32;
    for f in frames {
        // SAFETY: `f` and `to` are valid for the lengths given.
        let sent = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                f.as_ptr().cast(),
                f.len(),
                0,
                (&to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if sent < 0 {
            return Err(format!(
                "send on {ifname}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_wire::views::{
        ArpOperation, ArpPacket, EthernetFrame, Icmpv6Packet, Icmpv6Repr, Ipv6Packet, NdiscRepr,
    };

    #[test]
    fn announcements_are_what_rfc_5227_and_rfc_4861_describe() {
        let mac = [2, 0, 0, 0, 0, 0x42];
        let f = frames(
            mac,
            &["10.20.1.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        );
        let eth = EthernetFrame::new_checked(&f[0][..]).unwrap();
        let arp = ArpPacket::new_checked(eth.payload()).unwrap();
        assert_eq!(arp.operation(), ArpOperation::Request);
        assert_eq!(arp.source_protocol_addr(), arp.target_protocol_addr());
        assert_eq!(arp.source_hardware_addr(), &mac);
        let eth = EthernetFrame::new_checked(&f[1][..]).unwrap();
        let ip = Ipv6Packet::new_checked(eth.payload()).unwrap();
        assert_eq!(ip.hop_limit(), 255);
        let icmp = Icmpv6Packet::new_checked(ip.payload()).unwrap();
        let repr = Icmpv6Repr::parse(
            &ip.src_addr(),
            &ip.dst_addr(),
            &icmp,
            &smoltcp::phy::ChecksumCapabilities::default(),
        )
        .unwrap();
        match repr {
            Icmpv6Repr::Ndisc(NdiscRepr::NeighborAdvert {
                flags,
                target_addr,
                lladdr,
            }) => {
                assert!(flags.contains(smoltcp::wire::NdiscNeighborFlags::OVERRIDE));
                assert_eq!(
                    target_addr,
                    "fd00::2".parse::<std::net::Ipv6Addr>().unwrap()
                );
                assert!(lladdr.is_some());
            }
            other => panic!("{other:?}"),
        }
    }
}
