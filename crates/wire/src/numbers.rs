//! The numbers protocols are told apart by, named once: EtherTypes (IEEE 802 registry), IP
//! protocol numbers and ICMP types and codes (IANA registries). Functions match on these names,
//! never on the literals.

/// EtherTypes.
pub mod ethertype {
    pub const IPV4: u16 = 0x0800;
    pub const ARP: u16 = 0x0806;
    /// IEEE 802.1Q VLAN tag (C-tag).
    pub const VLAN: u16 = 0x8100;
    /// IEEE 802.1ad service tag (S-tag, "Q-in-Q").
    pub const QINQ: u16 = 0x88a8;
    pub const IPV6: u16 = 0x86dd;
    pub const MPLS: u16 = 0x8847;
    pub const MPLS_MULTICAST: u16 = 0x8848;
    /// IEEE 802.1ah provider backbone bridging (its I-tag).
    pub const PBB: u16 = 0x88e7;

    /// Whether `ethertype` is a VLAN tag's (802.1Q or 802.1ad).
    pub const fn is_vlan(ethertype: u16) -> bool {
        ethertype == VLAN || ethertype == QINQ
    }
}

/// IP protocol numbers: IPv4's `protocol`, IPv6's `next header`.
pub mod ip_proto {
    /// IPv6 hop-by-hop options.
    pub const HOP_BY_HOP: u8 = 0;
    pub const ICMP: u8 = 1;
    /// IPv4 in IP (RFC 2003; IPv4 in IPv6 for RFC 2473's tunnels, the lwAFTR's softwires).
    pub const IPIP: u8 = 4;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    /// IPv6 routing header.
    pub const ROUTING: u8 = 43;
    /// IPv6 fragment header.
    pub const FRAGMENT: u8 = 44;
    pub const ESP: u8 = 50;
    pub const AH: u8 = 51;
    pub const ICMPV6: u8 = 58;
    /// IPv6: nothing follows.
    pub const NO_NEXT_HEADER: u8 = 59;
    /// IPv6 destination options.
    pub const DESTINATION_OPTIONS: u8 = 60;
    pub const SCTP: u8 = 132;
}

/// ICMP (for IPv4) types and codes, RFC 792.
pub mod icmpv4 {
    pub const ECHO_REPLY: u8 = 0;
    pub const DESTINATION_UNREACHABLE: u8 = 3;
    pub const SOURCE_QUENCH: u8 = 4;
    pub const REDIRECT: u8 = 5;
    pub const ECHO_REQUEST: u8 = 8;
    pub const TIME_EXCEEDED: u8 = 11;
    pub const PARAMETER_PROBLEM: u8 = 12;
    /// Destination unreachable: network unreachable.
    pub const CODE_NET_UNREACHABLE: u8 = 0;
    /// Destination unreachable: host unreachable.
    pub const CODE_HOST_UNREACHABLE: u8 = 1;
    /// Destination unreachable: fragmentation needed and DF set (RFC 1191).
    pub const CODE_FRAGMENTATION_NEEDED: u8 = 4;
    /// Time exceeded: TTL exceeded in transit.
    pub const CODE_TTL_EXCEEDED: u8 = 0;
    /// Destination unreachable: communication administratively prohibited (RFC 1812).
    pub const CODE_ADMIN_PROHIBITED: u8 = 13;

    /// Whether an ICMP message of type `t` is an error, which quotes the packet it is about.
    pub const fn is_error(t: u8) -> bool {
        matches!(
            t,
            DESTINATION_UNREACHABLE | SOURCE_QUENCH | REDIRECT | TIME_EXCEEDED | PARAMETER_PROBLEM
        )
    }
}

/// ICMPv6 types, RFC 4443, and those of neighbour discovery (RFC 4861) and MLD (RFC 2710,
/// RFC 3810).
pub mod icmpv6 {
    pub const DESTINATION_UNREACHABLE: u8 = 1;
    pub const PACKET_TOO_BIG: u8 = 2;
    pub const TIME_EXCEEDED: u8 = 3;
    pub const PARAMETER_PROBLEM: u8 = 4;
    pub const ECHO_REQUEST: u8 = 128;
    pub const ECHO_REPLY: u8 = 129;
    pub const MLD_QUERY: u8 = 130;
    pub const MLD_REPORT: u8 = 131;
    pub const MLD_DONE: u8 = 132;
    pub const ROUTER_SOLICITATION: u8 = 133;
    pub const ROUTER_ADVERTISEMENT: u8 = 134;
    pub const NEIGHBOR_SOLICITATION: u8 = 135;
    pub const NEIGHBOR_ADVERTISEMENT: u8 = 136;
    pub const REDIRECT: u8 = 137;
    pub const MLDV2_REPORT: u8 = 143;
    /// Destination unreachable: communication with the destination administratively prohibited.
    pub const CODE_ADMIN_PROHIBITED: u8 = 1;
    /// Destination unreachable: the source address failed the ingress/egress policy.
    pub const CODE_SOURCE_POLICY_FAILED: u8 = 5;

    /// Whether an ICMPv6 message of type `t` is one of Neighbor Discovery's (RFC 4861: router
    /// and neighbour solicitation and advertisement, redirect).
    pub const fn is_neighbor_discovery(t: u8) -> bool {
        t >= ROUTER_SOLICITATION && t <= REDIRECT
    }

    /// Whether an ICMPv6 message of type `t` is one of the errors RFC 4443 defines, which
    /// quote the packet they are about.
    pub const fn is_error(t: u8) -> bool {
        matches!(
            t,
            DESTINATION_UNREACHABLE | PACKET_TOO_BIG | TIME_EXCEEDED | PARAMETER_PROBLEM
        )
    }
}
