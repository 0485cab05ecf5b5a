//! OpenFlow 1.3 actions (§5.12, §7.2.5): read from the wire with the specification's error
//! codes, and the frame rewrites they make. Header checksums follow every rewrite (IPv4 header,
//! TCP/UDP/ICMP incrementally, SCTP's CRC32c recomputed), so a frame leaves as valid as it came.

use crate::ofp::{self, OfError};
use crate::oxm::{self, layout, Key, Layout};
use stitch_core::Packet;
use stitch_wire::be::{self, Put};
use stitch_wire::checksum;
use stitch_wire::header::{self, arp, ethernet, icmp, ipv4, ipv6, nd, tcp, udp};
use stitch_wire::{ethertype, ip_proto};

pub const OUTPUT: u16 = 0;
pub const COPY_TTL_OUT: u16 = 11;
pub const COPY_TTL_IN: u16 = 12;
pub const SET_MPLS_TTL: u16 = 15;
pub const DEC_MPLS_TTL: u16 = 16;
pub const PUSH_VLAN: u16 = 17;
pub const POP_VLAN: u16 = 18;
pub const PUSH_MPLS: u16 = 19;
pub const POP_MPLS: u16 = 20;
pub const SET_QUEUE: u16 = 21;
pub const GROUP: u16 = 22;
pub const SET_NW_TTL: u16 = 23;
pub const DEC_NW_TTL: u16 = 24;
pub const SET_FIELD: u16 = 25;
pub const PUSH_PBB: u16 = 26;
pub const POP_PBB: u16 = 27;

/// What a flow or a bucket does with a packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Output {
        port: u32,
        max_len: u16,
    },
    Group(u32),
    /// Accepted and ignored: ports have a single queue.
    SetQueue(u32),
    SetField {
        id: u8,
        value: Vec<u8>,
    },
    PushVlan(u16),
    PopVlan,
    PushMpls(u16),
    PopMpls(u16),
    PushPbb(u16),
    PopPbb,
    SetMplsTtl(u8),
    DecMplsTtl,
    SetNwTtl(u8),
    DecNwTtl,
    CopyTtlOut,
    CopyTtlIn,
}

impl Action {
    /// Whether the action brings a header back from the packet's bytes (what was inside the
    /// tag or shim it pops), so that the key's fields after it are not a function of the key
    /// before it.
    pub fn exposes_inner_header(&self) -> bool {
        matches!(self, Action::PopVlan | Action::PopMpls(_) | Action::PopPbb)
    }

    pub fn output(port: u32) -> Action {
        Action::Output {
            port,
            max_len: 0xffe5,
        }
    }

    /// The action's type number (§7.2.5).
    pub fn kind(&self) -> u16 {
        match self {
            Action::Output { .. } => OUTPUT,
            Action::Group(_) => GROUP,
            Action::SetQueue(_) => SET_QUEUE,
            Action::SetField { .. } => SET_FIELD,
            Action::PushVlan(_) => PUSH_VLAN,
            Action::PopVlan => POP_VLAN,
            Action::PushMpls(_) => PUSH_MPLS,
            Action::PopMpls(_) => POP_MPLS,
            Action::PushPbb(_) => PUSH_PBB,
            Action::PopPbb => POP_PBB,
            Action::SetMplsTtl(_) => SET_MPLS_TTL,
            Action::DecMplsTtl => DEC_MPLS_TTL,
            Action::SetNwTtl(_) => SET_NW_TTL,
            Action::DecNwTtl => DEC_NW_TTL,
            Action::CopyTtlOut => COPY_TTL_OUT,
            Action::CopyTtlIn => COPY_TTL_IN,
        }
    }
}

/// Ports an output action may name besides 1..=0xffffff00.
const RESERVED_OUTPUTS: [u32; 4] = [
    ofp::PORT_IN_PORT,
    ofp::PORT_FLOOD,
    ofp::PORT_ALL,
    ofp::PORT_CONTROLLER,
];

/// OFPP_TABLE: only in PACKET_OUT, runs the frame through the pipeline.
pub const PORT_TABLE: u32 = 0xffff_fff9;

/// Reads an action list.
pub fn parse_actions(b: &[u8]) -> Result<Vec<Action>, OfError> {
    parse_action_list(b, false)
}

/// Reads a PACKET_OUT's action list (where output to OFPP_TABLE is allowed).
pub fn parse_packet_out_actions(b: &[u8]) -> Result<Vec<Action>, OfError> {
    parse_action_list(b, true)
}

/// A PACKET_OUT, read: the in-port, the actions and the frame.
pub fn parse_packet_out(b: &[u8]) -> Result<(u32, Vec<Action>, &[u8]), OfError> {
    let buffer = ofp::u32_field(b, 8)?;
    if buffer != ofp::NO_BUFFER {
        return Err(ofp::BAD_REQUEST_BUFFER_UNKNOWN);
    }
    let in_port = ofp::u32_field(b, 12)?;
    if in_port == 0
        || (in_port > ofp::PORT_MAX && in_port != ofp::PORT_CONTROLLER && in_port != ofp::PORT_ANY)
    {
        return Err(ofp::BAD_REQUEST_BAD_PORT);
    }
    let alen = ofp::u16_field(b, 16)? as usize;
    let actions = parse_packet_out_actions(b.get(24..24 + alen).ok_or(ofp::BAD_REQUEST_LEN)?)?;
    Ok((in_port, actions, &b[24 + alen..]))
}

fn parse_action_list(b: &[u8], packet_out: bool) -> Result<Vec<Action>, OfError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let t = ofp::u16_field(b, i).map_err(|_| ofp::BAD_ACTION_LEN)?;
        let len = ofp::u16_field(b, i + 2).map_err(|_| ofp::BAD_ACTION_LEN)? as usize;
        if len < 8 || !len.is_multiple_of(8) || i + len > b.len() {
            return Err(ofp::BAD_ACTION_LEN);
        }
        let action = parse_action(t, &b[i..i + len], packet_out)?;
        out.push(action);
        i += len;
    }
    Ok(out)
}

fn parse_action(t: u16, a: &[u8], packet_out: bool) -> Result<Action, OfError> {
    let fixed = |n: usize| {
        if a.len() == n {
            Ok(())
        } else {
            Err(ofp::BAD_ACTION_LEN)
        }
    };
    let u16_at = |at| ofp::u16_field(a, at);
    let u32_at = |at| ofp::u32_field(a, at);
    Ok(match t {
        OUTPUT => {
            fixed(16)?;
            let port = u32_at(4)?;
            let reserved = RESERVED_OUTPUTS.contains(&port) || (packet_out && port == PORT_TABLE);
            if port == 0 || (port > ofp::PORT_MAX && !reserved) {
                return Err(ofp::BAD_ACTION_OUT_PORT);
            }
            Action::Output {
                port,
                max_len: u16_at(8)?,
            }
        }
        GROUP => {
            fixed(8)?;
            let g = u32_at(4)?;
            if g > ofp::GROUP_MAX {
                return Err(ofp::BAD_ACTION_OUT_GROUP);
            }
            Action::Group(g)
        }
        SET_QUEUE => {
            fixed(8)?;
            Action::SetQueue(u32_at(4)?)
        }
        PUSH_VLAN => {
            fixed(8)?;
            let et = u16_at(4)?;
            if et != ethertype::VLAN && et != ethertype::QINQ {
                return Err(ofp::BAD_ACTION_ARGUMENT);
            }
            Action::PushVlan(et)
        }
        POP_VLAN => {
            fixed(8)?;
            Action::PopVlan
        }
        PUSH_MPLS => {
            fixed(8)?;
            let et = u16_at(4)?;
            if et != ethertype::MPLS && et != ethertype::MPLS_MULTICAST {
                return Err(ofp::BAD_ACTION_ARGUMENT);
            }
            Action::PushMpls(et)
        }
        POP_MPLS => {
            fixed(8)?;
            Action::PopMpls(u16_at(4)?)
        }
        PUSH_PBB => {
            fixed(8)?;
            let et = u16_at(4)?;
            if et != ethertype::PBB {
                return Err(ofp::BAD_ACTION_ARGUMENT);
            }
            Action::PushPbb(et)
        }
        POP_PBB => {
            fixed(8)?;
            Action::PopPbb
        }
        SET_MPLS_TTL => {
            fixed(8)?;
            Action::SetMplsTtl(a[4])
        }
        DEC_MPLS_TTL => {
            fixed(8)?;
            Action::DecMplsTtl
        }
        SET_NW_TTL => {
            fixed(8)?;
            Action::SetNwTtl(a[4])
        }
        DEC_NW_TTL => {
            fixed(8)?;
            Action::DecNwTtl
        }
        COPY_TTL_OUT => {
            fixed(8)?;
            Action::CopyTtlOut
        }
        COPY_TTL_IN => {
            fixed(8)?;
            Action::CopyTtlIn
        }
        SET_FIELD => parse_set_field(a)?,
        _ => return Err(ofp::BAD_ACTION_TYPE),
    })
}

fn parse_set_field(a: &[u8]) -> Result<Action, OfError> {
    let tlv = a.get(4..).ok_or(ofp::BAD_ACTION_LEN)?;
    if tlv.len() < 4 {
        return Err(ofp::BAD_ACTION_LEN);
    }
    let (class, id, has_mask, l) = (
        be::get::<u16>(tlv, 0),
        tlv[2] >> 1,
        tlv[2] & 1 == 1,
        tlv[3] as usize,
    );
    if class != 0x8000 {
        return Err(ofp::BAD_SET_TYPE);
    }
    let def = oxm::field(id).ok_or(ofp::BAD_SET_TYPE)?;
    // Pipeline fields are not packet fields: write-metadata sets metadata.
    if matches!(
        id,
        oxm::IN_PORT | oxm::IN_PHY_PORT | oxm::METADATA | oxm::IPV6_EXTHDR
    ) {
        return Err(ofp::BAD_SET_TYPE);
    }
    if has_mask || l != def.len as usize || 4 + 4 + l > a.len() {
        return Err(ofp::BAD_SET_LEN);
    }
    let value = tlv[4..4 + l].to_vec();
    let v = value.iter().fold(0u64, |acc, b| acc << 8 | *b as u64);
    // VLAN_VID is set without OFPVID_PRESENT by most controllers; both forms are taken.
    if def.max != u64::MAX && v > def.max {
        return Err(ofp::BAD_SET_ARGUMENT);
    }
    Ok(Action::SetField { id, value })
}

/// What a rewrite left to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rewrite {
    /// The frame's fields may have changed: the key is read again.
    Changed,
    Unchanged,
    /// A TTL ran out (§5.12.1: dropped; Stitch does not send these to the controller).
    TtlExpired,
    /// The frame could not grow.
    NoRoom,
}

/// Applies one header-changing action to `p` (outputs, groups and queues are the pipeline's).
pub fn rewrite(p: &mut Packet, key: &mut Key, a: &Action) -> Rewrite {
    let l = layout(p.data());
    match a {
        Action::SetField { id, value } => {
            if *id == oxm::TUNNEL_ID {
                key.set(oxm::TUNNEL_ID, value);
                return Rewrite::Unchanged;
            }
            write_field(p.data_mut(), &l, *id, value);
            Rewrite::Changed
        }
        Action::PushVlan(tpid) => {
            let tci = l.vlan.map(|v| be::get::<u16>(p.data(), v + 2)).unwrap_or(0);
            match stitch_wire::vlan::push(p, *tpid, tci) {
                Ok(()) => Rewrite::Changed,
                Err(_) => Rewrite::NoRoom,
            }
        }
        Action::PopVlan => {
            stitch_wire::vlan::pop(p);
            pad_to_minimum(p);
            Rewrite::Changed
        }
        Action::PushMpls(et) => push_mpls(p, &l, *et),
        Action::PushPbb(et) => push_pbb(p, &l, *et),
        Action::PopPbb => {
            // The backbone addresses, tags and I-TAG go; the customer frame stays.
            if let Some(t) = l.itag {
                if p.shift_front(t + 4).is_ok() {
                    pad_to_minimum(p);
                    return Rewrite::Changed;
                }
            }
            Rewrite::Unchanged
        }
        Action::PopMpls(et) => pop_mpls(p, &l, *et),
        Action::SetMplsTtl(ttl) => {
            if let Some(m) = l.mpls {
                p.data_mut()[m + 3] = *ttl;
            }
            Rewrite::Unchanged
        }
        Action::DecMplsTtl => match l.mpls {
            Some(m) => match p.data()[m + 3] {
                0 | 1 => Rewrite::TtlExpired,
                t => {
                    p.data_mut()[m + 3] = t - 1;
                    Rewrite::Unchanged
                }
            },
            None => Rewrite::Unchanged,
        },
        Action::SetNwTtl(ttl) => {
            set_ip_ttl(p.data_mut(), &l, |_| Some(*ttl));
            Rewrite::Unchanged
        }
        Action::DecNwTtl => {
            if set_ip_ttl(p.data_mut(), &l, |t| t.checked_sub(1).filter(|t| *t > 0)) {
                Rewrite::Unchanged
            } else {
                Rewrite::TtlExpired
            }
        }
        Action::CopyTtlOut => {
            if let Some((outer, inner, _)) = ttl_pair(p.data(), &l) {
                let v = p.data()[inner];
                p.data_mut()[outer] = v;
            }
            Rewrite::Unchanged
        }
        Action::CopyTtlIn => {
            if let Some((outer, inner, under)) = ttl_pair(p.data(), &l) {
                let v = p.data()[outer];
                let d = p.data_mut();
                match under {
                    Under::Ipv4 => patch(d, inner, &[v], &[Some(Sum::at(inner + 2))]),
                    Under::Mpls | Under::Ipv6 => d[inner] = v,
                }
            }
            Rewrite::Unchanged
        }
        Action::Output { .. } | Action::Group(_) | Action::SetQueue(_) => Rewrite::Unchanged,
    }
}

/// Sets one field of the frame in place (the meter's DSCP remark uses it).
pub fn set_field(p: &mut Packet, id: u8, value: &[u8]) {
    let l = layout(p.data());
    write_field(p.data_mut(), &l, id, value);
}

/// What lies under the outer MPLS shim.
#[derive(Clone, Copy)]
enum Under {
    Mpls,
    Ipv4,
    Ipv6,
}

/// The TTL bytes of the outer MPLS shim and of what follows it (the next shim, or the IP
/// header under the bottom of the stack).
fn ttl_pair(d: &[u8], l: &Layout) -> Option<(usize, usize, Under)> {
    let m = l.mpls?;
    let outer = m + 3;
    if d[m + 2] & 1 == 0 {
        return (d.len() >= m + 8).then_some((outer, m + 7, Under::Mpls));
    }
    let ip = m + 4;
    match d.get(ip)? >> 4 {
        4 if d.len() >= ip + ipv4::MIN_LEN => Some((outer, ip + ipv4::TTL.0, Under::Ipv4)),
        6 if d.len() >= ip + ipv6::LEN => Some((outer, ip + ipv6::HOP_LIMIT.0, Under::Ipv6)),
        _ => None,
    }
}

/// Sets the IPv4 TTL or IPv6 hop limit to `f(old)`; false when `f` refuses (TTL ran out).
fn set_ip_ttl(d: &mut [u8], l: &Layout, f: impl Fn(u8) -> Option<u8>) -> bool {
    let Some(at) = l.l3 else { return true };
    match l.ethertype {
        ethertype::IPV4 => match f(ipv4::TTL.get(&d[at..])) {
            Some(t) => {
                let sum = Sum::at(at + ipv4::CHECKSUM.0);
                patch(d, at + ipv4::TTL.0, &[t], &[Some(sum)]);
                true
            }
            None => false,
        },
        ethertype::IPV6 => match f(ipv6::HOP_LIMIT.get(&d[at..])) {
            Some(t) => {
                ipv6::HOP_LIMIT.set(&mut d[at..], t);
                true
            }
            None => false,
        },
        _ => true,
    }
}

fn push_mpls(p: &mut Packet, l: &Layout, et: u16) -> Rewrite {
    let d = p.data();
    let shim = match l.mpls {
        Some(m) => be::get::<u32>(d, m) & !0x100,
        None => {
            let ttl = match (l.ethertype, l.l3) {
                (ethertype::IPV4, Some(at)) => ipv4::TTL.get(&d[at..]),
                (ethertype::IPV6, Some(at)) => ipv6::HOP_LIMIT.get(&d[at..]),
                _ => 0,
            };
            0x100 | ttl as u32
        }
    };
    // The shim goes after the Ethernet header and its tags (§5.12.1).
    let at = l.ethertype_at + 2;
    if p.len() < at || p.prepend(4).is_err() {
        return Rewrite::NoRoom;
    }
    let d = p.data_mut();
    d.copy_within(4..4 + at, 0);
    be::set(d, at - 2, et);
    be::set(d, at, shim);
    Rewrite::Changed
}

/// IEEE 802.1ah: the frame becomes the customer frame behind new backbone addresses (copies of
/// the customer's), ethertype 0x88e7 and an I-TAG (the I-SID of an outer I-TAG, else 0).
fn push_pbb(p: &mut Packet, l: &Layout, et: u16) -> Rewrite {
    if p.len() < 14 {
        return Rewrite::Unchanged;
    }
    let itag = l
        .itag
        .map(|t| be::get::<u32>(p.data(), t) & 0x00ff_ffff)
        .unwrap_or(0);
    let mut addresses = [0u8; 12];
    addresses.copy_from_slice(&p.data()[..12]);
    let Ok(front) = p.prepend(18) else {
        return Rewrite::NoRoom;
    };
    front[..12].copy_from_slice(&addresses);
    be::set(front, 12, et);
    be::set(front, 14, itag);
    Rewrite::Changed
}

fn pop_mpls(p: &mut Packet, l: &Layout, et: u16) -> Rewrite {
    let Some(m) = l.mpls else {
        return Rewrite::Unchanged;
    };
    let d = p.data_mut();
    be::set(d, l.ethertype_at, et);
    d.copy_within(0..m, 4);
    let _ = p.shift_front(4);
    trim_padding(p, m);
    pad_to_minimum(p);
    Rewrite::Changed
}

/// Ethernet's shortest frame without its FCS.
const MIN_FRAME: usize = 60;

/// A frame that lost a tag or a label below Ethernet's minimum is padded back with zeros, as
/// IEEE 802.1Q asks of a bridge that untags a frame.
fn pad_to_minimum(p: &mut Packet) {
    let n = p.len();
    if n < MIN_FRAME && p.set_len(MIN_FRAME).is_ok() {
        p.data_mut()[n..].fill(0);
    }
}

/// Drops Ethernet padding past the end of the IP packet at `l3` that a label stack carried:
/// once the stack is gone the frame ends where its IP packet says.
fn trim_padding(p: &mut Packet, l3: usize) {
    let d = p.data();
    let Some(v) = d.get(l3).map(|b| b >> 4) else {
        return;
    };
    let ip_len = match v {
        4 => ipv4::TOTAL_LEN.try_get(&d[l3..]).map(usize::from),
        6 => ipv6::PAYLOAD_LEN
            .try_get(&d[l3..])
            .map(|n| ipv6::LEN + n as usize),
        _ => None,
    };
    let Some(ip_len) = ip_len else { return };
    if d[l3 - 2..l3] == ethertype::IPV4.to_be_bytes()
        || d[l3 - 2..l3] == ethertype::IPV6.to_be_bytes()
    {
        let end = l3 + ip_len;
        if ip_len >= 20 && end < d.len() {
            let _ = p.set_len(end);
        }
    }
}

/// A checksum field a rewrite keeps right.
#[derive(Clone, Copy)]
struct Sum {
    at: usize,
    /// UDP over IPv4: 0 means "no checksum" and stays 0.
    zero_is_none: bool,
}

impl Sum {
    fn at(at: usize) -> Sum {
        Sum {
            at,
            zero_is_none: false,
        }
    }
}

/// Writes `new` at `at` and updates each checksum by the change of the 16-bit words it touched
/// (RFC 1624). Every checksummed header here starts at an even offset of the frame, so words
/// are aligned on the frame.
fn patch(d: &mut [u8], at: usize, new: &[u8], sums: &[Option<Sum>]) {
    let (lo, hi) = (at & !1, (at + new.len() + 1) & !1);
    if hi > d.len() {
        return;
    }
    let mut old = [0u8; 40];
    old[..hi - lo].copy_from_slice(&d[lo..hi]);
    d[at..at + new.len()].copy_from_slice(new);
    for s in sums.iter().flatten() {
        let Some(c) = d.get(s.at..s.at + 2) else {
            continue;
        };
        let mut cs = be::get::<u16>(c, 0);
        if s.zero_is_none && cs == 0 {
            continue;
        }
        for w in (0..hi - lo).step_by(2) {
            let o = be::get::<u16>(&old, w);
            let n = be::get::<u16>(d, lo + w);
            cs = checksum::update(cs, o, n);
        }
        if s.zero_is_none && cs == 0 {
            cs = 0xffff;
        }
        be::set(d, s.at, cs);
    }
}

/// The transport checksum of the frame (TCP, UDP, ICMP, ICMPv6), if it has one.
fn l4_sum(l: &Layout, pseudo: bool) -> Option<Sum> {
    let at = l.l4?;
    match l.ip_proto {
        ip_proto::TCP => Some(Sum::at(at + tcp::CHECKSUM.0)),
        ip_proto::UDP => Some(Sum {
            at: at + udp::CHECKSUM.0,
            zero_is_none: l.ethertype == ethertype::IPV4,
        }),
        ip_proto::ICMP if !pseudo && l.ethertype == ethertype::IPV4 => {
            Some(Sum::at(at + icmp::CHECKSUM.0))
        }
        ip_proto::ICMPV6 => Some(Sum::at(at + icmp::CHECKSUM.0)),
        _ => None,
    }
}

/// SCTP's CRC32c (RFC 4960 appendix B) over the packet with its checksum field taken as
/// zero, as the packet stores it (little-endian words of the reflected CRC).
fn sctp_crc(s: &[u8]) -> [u8; 4] {
    let crc = crc32c::crc32c(&s[..8]);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, &s[12..]).to_le_bytes()
}

/// Rewrites SCTP bytes and keeps the checksum as right — or as wrong — as it was: the stored
/// value changes by what the correct one changes (Open vSwitch does the same), so a switch
/// never makes a damaged packet look valid.
fn sctp_patch(d: &mut [u8], base: usize, at: usize, v: &[u8]) {
    if d.len() < base + 12 {
        d[at..at + v.len()].copy_from_slice(v);
        return;
    }
    let before = sctp_crc(&d[base..]);
    d[at..at + v.len()].copy_from_slice(v);
    let after = sctp_crc(&d[base..]);
    for i in 0..4 {
        d[base + 8 + i] ^= before[i] ^ after[i];
    }
}

fn write_field(d: &mut [u8], l: &Layout, id: u8, v: &[u8]) {
    use oxm::*;
    match id {
        ETH_DST | ETH_SRC | ETH_TYPE | VLAN_VID | VLAN_PCP | MPLS_LABEL | MPLS_TC | MPLS_BOS
        | PBB_ISID => write_l2_field(d, l, id, v),
        IP_DSCP | IP_ECN | IP_PROTO | IPV4_SRC | IPV4_DST | IPV6_SRC | IPV6_DST | IPV6_FLABEL => {
            write_l3_field(d, l, id, v)
        }
        ARP_OP | ARP_SPA | ARP_TPA | ARP_SHA | ARP_THA => write_arp_field(d, l, id, v),
        _ => write_l4_field(d, l, id, v),
    }
}

/// Sets an Ethernet, VLAN, MPLS or PBB field.
fn write_l2_field(d: &mut [u8], l: &Layout, id: u8, v: &[u8]) {
    use oxm::*;
    match id {
        ETH_DST if d.len() >= ethernet::DST.end => d[ethernet::DST].copy_from_slice(v),
        ETH_SRC if d.len() >= ethernet::SRC.end => d[ethernet::SRC].copy_from_slice(v),
        ETH_TYPE => d[l.ethertype_at..l.ethertype_at + 2].copy_from_slice(v),
        VLAN_VID => {
            if let Some(t) = l.vlan {
                let vid = be::get::<u16>(v, 0) & 0x0fff;
                let tci = be::get::<u16>(d, t + 2) & 0xf000 | vid;
                be::set(d, t + 2, tci);
            }
        }
        VLAN_PCP => {
            if let Some(t) = l.vlan {
                d[t + 2] = (d[t + 2] & 0x1f) | (v[0] << 5);
            }
        }
        MPLS_LABEL | MPLS_TC | MPLS_BOS => {
            if let Some(m) = l.mpls {
                let mut s = be::get::<u32>(d, m);
                let x = u32::from_be_bytes(v.try_into().unwrap_or([0, 0, 0, v[0]]));
                s = match id {
                    MPLS_LABEL => (s & 0xfff) | (x & 0xfffff) << 12,
                    MPLS_TC => (s & !0xe00) | (x & 7) << 9,
                    _ => (s & !0x100) | (x & 1) << 8,
                };
                be::set(d, m, s);
            }
        }
        PBB_ISID => {
            if let Some(t) = l.itag {
                d[t + 1..t + 4].copy_from_slice(v);
            }
        }
        _ => {}
    }
}

/// Sets an IPv4 or IPv6 header field, with the checksums that cover it.
fn write_l3_field(d: &mut [u8], l: &Layout, id: u8, v: &[u8]) {
    use oxm::*;
    let l3 = l.l3;
    let v4 = l.ethertype == ethertype::IPV4;
    let v6 = l.ethertype == ethertype::IPV6;
    match id {
        IP_DSCP | IP_ECN if l3.is_some() && (v4 || v6) => {
            let at = l3.unwrap();
            let (dscp_ecn_at, old) = if v4 {
                (at + ipv4::TOS.0, ipv4::TOS.get(&d[at..]))
            } else {
                (at, ((be::get::<u16>(d, at) >> 4) & 0xff) as u8)
            };
            let tc = if id == IP_DSCP {
                (v[0] << 2) | (old & 3)
            } else {
                (old & 0xfc) | (v[0] & 3)
            };
            if v4 {
                let sum = Sum::at(at + ipv4::CHECKSUM.0);
                patch(d, dscp_ecn_at, &[tc], &[Some(sum)]);
            } else {
                d[at] = (d[at] & 0xf0) | (tc >> 4);
                d[at + 1] = (d[at + 1] & 0x0f) | (tc << 4);
            }
        }
        // The protocol is in the transport checksum's pseudo-header too.
        IP_PROTO if l3.is_some() => {
            let at = l3.unwrap();
            if v4 {
                // (TTL, protocol) changes by the same amount as the pseudo-header's (0, protocol).
                let sums = [Some(Sum::at(at + ipv4::CHECKSUM.0)), l4_sum(l, true)];
                patch(d, at + ipv4::PROTOCOL.0, v, &sums);
            } else if v6 {
                let old = ipv6::NEXT_HEADER.replace(&mut d[at..], v[0]);
                if let Some(s) = l4_sum(l, true) {
                    let cs = be::get::<u16>(d, s.at);
                    let cs = checksum::update(cs, old as u16, v[0] as u16);
                    be::set(d, s.at, cs);
                }
            }
        }
        IPV4_SRC | IPV4_DST if v4 && l3.is_some() => {
            let l3 = l3.unwrap();
            let field = if id == IPV4_SRC { ipv4::SRC } else { ipv4::DST };
            let sums = [Some(Sum::at(l3 + ipv4::CHECKSUM.0)), l4_sum(l, true)];
            patch(d, l3 + field.0, v, &sums);
        }
        IPV6_SRC | IPV6_DST if v6 && l3.is_some() => {
            let field = if id == IPV6_SRC { ipv6::SRC } else { ipv6::DST };
            patch(d, l3.unwrap() + field.start, v, &[l4_sum(l, true)]);
        }
        IPV6_FLABEL if v6 && l3.is_some() => {
            let ip = &mut d[l3.unwrap()..];
            let w = ipv6::VERSION_CLASS_FLOW.get(ip) & !0xfffff | be::get::<u32>(v, 0) & 0xfffff;
            ipv6::VERSION_CLASS_FLOW.set(ip, w);
        }
        _ => {}
    }
}

/// Sets a TCP, UDP, SCTP, ICMP or neighbour-discovery field, with its checksum.
fn write_l4_field(d: &mut [u8], l: &Layout, id: u8, v: &[u8]) {
    use oxm::*;
    let v4 = l.ethertype == ethertype::IPV4;
    let v6 = l.ethertype == ethertype::IPV6;
    match id {
        TCP_SRC | TCP_DST | UDP_SRC | UDP_DST if l.l4.is_some() => {
            let want = if matches!(id, TCP_SRC | TCP_DST) {
                6
            } else {
                17
            };
            if l.ip_proto == want {
                let port = if matches!(id, TCP_SRC | UDP_SRC) {
                    header::l4::SRC_PORT
                } else {
                    header::l4::DST_PORT
                };
                patch(d, l.l4.unwrap() + port.0, v, &[l4_sum(l, false)]);
            }
        }
        SCTP_SRC | SCTP_DST if l.l4.is_some() && l.ip_proto == ip_proto::SCTP => {
            let base = l.l4.unwrap();
            let port = if id == SCTP_SRC {
                header::l4::SRC_PORT
            } else {
                header::l4::DST_PORT
            };
            let at = base + port.0;
            sctp_patch(d, base, at, v);
        }
        ICMPV4_TYPE | ICMPV4_CODE if v4 && l.ip_proto == ip_proto::ICMP && l.l4.is_some() => {
            let at = l.l4.unwrap();
            let o = if id == ICMPV4_TYPE { 0 } else { 1 };
            patch(d, at + o, v, &[Some(Sum::at(at + icmp::CHECKSUM.0))]);
        }
        ICMPV6_TYPE | ICMPV6_CODE if v6 && l.ip_proto == ip_proto::ICMPV6 && l.l4.is_some() => {
            let at = l.l4.unwrap();
            let o = if id == ICMPV6_TYPE { 0 } else { 1 };
            patch(d, at + o, v, &[Some(Sum::at(at + icmp::CHECKSUM.0))]);
        }
        IPV6_ND_TARGET if v6 && l.ip_proto == ip_proto::ICMPV6 && l.l4.is_some() => {
            let at = l.l4.unwrap();
            if d.len() >= at + nd::TARGET.end {
                let sum = Sum::at(at + icmp::CHECKSUM.0);
                patch(d, at + nd::TARGET.start, v, &[Some(sum)]);
            }
        }
        IPV6_ND_SLL | IPV6_ND_TLL if v6 && l.ip_proto == ip_proto::ICMPV6 && l.l4.is_some() => {
            let at = l.l4.unwrap();
            let kind = if id == IPV6_ND_SLL { 1 } else { 2 };
            let mut o = at + nd::OPTIONS;
            while o + 8 <= d.len() {
                let len = d[o + 1] as usize * 8;
                if len == 0 {
                    break;
                }
                if d[o] == kind && len == 8 {
                    patch(d, o + 2, v, &[Some(Sum::at(at + icmp::CHECKSUM.0))]);
                    break;
                }
                o += len;
            }
        }
        _ => {}
    }
}

/// Sets an ARP field.
fn write_arp_field(d: &mut [u8], l: &Layout, id: u8, v: &[u8]) {
    use oxm::*;
    let l3 = l.l3;
    match id {
        ARP_OP | ARP_SPA | ARP_TPA | ARP_SHA | ARP_THA
            if l.ethertype == ethertype::ARP && l3.is_some_and(|a| d.len() >= a + arp::LEN) =>
        {
            let at = l3.unwrap()
                + match id {
                    ARP_OP => arp::OPERATION.0,
                    ARP_SHA => arp::SENDER_MAC.start,
                    ARP_SPA => arp::SENDER_IP.start,
                    ARP_THA => arp::TARGET_MAC.start,
                    _ => arp::TARGET_IP.start,
                };
            d[at..at + v.len()].copy_from_slice(v);
        }
        _ => {}
    }
}

/// Writes an action list (statistics and descriptions give back what was installed).
pub fn write_actions(out: &mut Vec<u8>, actions: &[Action]) {
    for a in actions {
        let start = out.len();
        out.put(a.kind());
        out.extend_from_slice(&[0, 0]);
        match a {
            Action::Output { port, max_len } => {
                out.put(*port);
                out.put(*max_len);
                out.extend_from_slice(&[0; 6]);
            }
            Action::Group(x) | Action::SetQueue(x) => out.put(*x),
            Action::SetField { id, value } => oxm::write_tlv(out, *id, value, None),
            Action::PushVlan(e) | Action::PushMpls(e) | Action::PopMpls(e) | Action::PushPbb(e) => {
                out.put(*e);
                out.extend_from_slice(&[0, 0]);
            }
            Action::SetMplsTtl(t) | Action::SetNwTtl(t) => out.extend_from_slice(&[*t, 0, 0, 0]),
            _ => out.extend_from_slice(&[0; 4]),
        }
        while !(out.len() - start).is_multiple_of(8) {
            out.push(0);
        }
        let len = (out.len() - start) as u16;
        be::set(out, start + 2, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::pool;

    fn udp4() -> Vec<u8> {
        let payload = b"hello, openflow";
        let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 8, 0];
        let ip = stitch_wire::ipv4_header(
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            17,
            8 + payload.len(),
            false,
        );
        f.extend_from_slice(&ip);
        let mut udp = vec![0x04, 0xd2, 0, 53];
        udp.put((8 + payload.len()) as u16);
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(payload);
        let mut acc = checksum::sum(&ip[12..20], 0);
        acc += 17 + udp.len() as u64;
        let cs = checksum::finish(checksum::sum(&udp, acc));
        be::set(&mut udp, 6, cs);
        f.extend(udp);
        f
    }

    fn valid_udp4(f: &[u8]) -> bool {
        let ip = &f[14..34];
        let udp = &f[34..];
        let mut acc = checksum::sum(&ip[12..20], 0);
        acc += 17 + udp.len() as u64;
        checksum::checksum(ip) == 0 && checksum::finish(checksum::sum(udp, acc)) == 0
    }

    #[test]
    fn rewrites_keep_checksums_right() {
        let mut p = pool::alloc().unwrap();
        p.set_data(&udp4()).unwrap();
        let mut key = Key::extract(p.data(), 1);
        assert!(valid_udp4(p.data()));
        for a in [
            Action::SetField {
                id: oxm::IPV4_SRC,
                value: vec![192, 168, 1, 7],
            },
            Action::SetField {
                id: oxm::UDP_DST,
                value: vec![0x13, 0x88],
            },
            Action::SetField {
                id: oxm::IP_DSCP,
                value: vec![46],
            },
            Action::DecNwTtl,
        ] {
            rewrite(&mut p, &mut key, &a);
            assert!(valid_udp4(p.data()), "{a:?}");
        }
        let k = Key::extract(p.data(), 1);
        assert_eq!(k.get(oxm::IPV4_SRC), [192, 168, 1, 7]);
        assert_eq!(k.u16(oxm::UDP_DST), 5000);
        assert_eq!(k.u8(oxm::IP_DSCP), 46);
        assert_eq!(p.data()[14 + 8], 63);
    }

    #[test]
    fn vlan_and_mpls_push_and_pop() {
        let mut p = pool::alloc().unwrap();
        let frame = udp4();
        p.set_data(&frame).unwrap();
        let mut key = Key::extract(p.data(), 1);
        rewrite(&mut p, &mut key, &Action::PushVlan(ethertype::VLAN));
        rewrite(
            &mut p,
            &mut key,
            &Action::SetField {
                id: oxm::VLAN_VID,
                value: vec![0x10, 10],
            },
        );
        rewrite(&mut p, &mut key, &Action::PushMpls(ethertype::MPLS));
        let k = Key::extract(p.data(), 1);
        assert_eq!(k.u16(oxm::VLAN_VID), 0x1000 | 10);
        assert_eq!(k.u16(oxm::ETH_TYPE), ethertype::MPLS);
        assert_eq!(k.u8(oxm::MPLS_BOS), 1);
        // The shim takes the IP TTL.
        assert_eq!(p.data()[18 + 3], 64);
        rewrite(&mut p, &mut key, &Action::PopMpls(ethertype::IPV4));
        rewrite(&mut p, &mut key, &Action::PopVlan);
        // The 57-byte frame comes back padded to Ethernet's 60.
        assert_eq!(&p.data()[..frame.len()], &frame[..]);
        assert_eq!(&p.data()[frame.len()..], &[0, 0, 0]);
        // PBB: backbone addresses copied from the customer's, I-TAG, then the frame.
        rewrite(&mut p, &mut key, &Action::PushPbb(ethertype::PBB));
        rewrite(
            &mut p,
            &mut key,
            &Action::SetField {
                id: oxm::PBB_ISID,
                value: vec![0, 0, 100],
            },
        );
        let k = Key::extract(p.data(), 1);
        assert_eq!(
            (k.u16(oxm::ETH_TYPE), k.get(oxm::PBB_ISID)),
            (ethertype::PBB, &[0, 0, 100][..])
        );
        assert_eq!(&p.data()[..12], &frame[..12]);
        rewrite(&mut p, &mut key, &Action::PopPbb);
        assert_eq!(&p.data()[..frame.len()], &frame[..]);
    }

    #[test]
    fn sctp_checksums_stay_as_right_or_as_wrong_as_they_were() {
        let mut f = udp4();
        f[23] = 132;
        let sctp_at = 34;
        let good = sctp_crc(&f[sctp_at..]);
        f[sctp_at + 8..sctp_at + 12].copy_from_slice(&good);
        let mut p = pool::alloc().unwrap();
        p.set_data(&f).unwrap();
        let mut key = Key::extract(p.data(), 1);
        let set = |id, v: u16| Action::SetField {
            id,
            value: be::net(v).to_vec(),
        };
        rewrite(&mut p, &mut key, &set(oxm::SCTP_SRC, 7));
        let d = p.data();
        assert_eq!(d[sctp_at + 8..sctp_at + 12], sctp_crc(&d[sctp_at..]));
        // A damaged checksum stays damaged by the same bits.
        let mut bad = f.clone();
        bad[sctp_at + 8] ^= 0x5a;
        p.set_data(&bad).unwrap();
        rewrite(&mut p, &mut key, &set(oxm::SCTP_DST, 9));
        let d = p.data();
        assert_eq!(d[sctp_at + 8] ^ sctp_crc(&d[sctp_at..])[0], 0x5a);
    }

    #[test]
    fn a_new_ip_protocol_is_in_the_transport_checksum() {
        let mut p = pool::alloc().unwrap();
        p.set_data(&udp4()).unwrap();
        let mut key = Key::extract(p.data(), 1);
        rewrite(
            &mut p,
            &mut key,
            &Action::SetField {
                id: oxm::IP_PROTO,
                value: vec![6],
            },
        );
        let d = p.data();
        let mut acc = checksum::sum(&d[26..34], 0);
        acc += 6 + (d.len() - 34) as u64;
        assert_eq!(checksum::checksum(&d[14..34]), 0);
        assert_eq!(checksum::finish(checksum::sum(&d[34..], acc)), 0);
    }

    #[test]
    fn bad_actions_get_the_specs_errors() {
        assert_eq!(
            parse_actions(&[0, 0, 0, 3]).err(),
            Some(ofp::BAD_ACTION_LEN)
        );
        assert_eq!(
            parse_actions(&[0, 99, 0, 8, 0, 0, 0, 0]).err(),
            Some(ofp::BAD_ACTION_TYPE)
        );
        let mut out = vec![];
        write_actions(&mut out, &[Action::output(0)]);
        assert_eq!(parse_actions(&out).err(), Some(ofp::BAD_ACTION_OUT_PORT));
        // set-field on in_port is not allowed.
        let mut sf = vec![0, 25, 0, 16];
        oxm::write_tlv(&mut sf, oxm::IN_PORT, &[0, 0, 0, 1], None);
        sf.resize(16, 0);
        assert_eq!(parse_actions(&sf).err(), Some(ofp::BAD_SET_TYPE));
        let all = vec![
            Action::output(2),
            Action::Group(7),
            Action::SetField {
                id: oxm::ETH_DST,
                value: vec![2, 0, 0, 0, 0, 9],
            },
            Action::PushVlan(ethertype::VLAN),
            Action::PopMpls(ethertype::IPV4),
            Action::SetNwTtl(9),
            Action::DecNwTtl,
            Action::CopyTtlIn,
        ];
        let mut out = vec![];
        write_actions(&mut out, &all);
        assert_eq!(parse_actions(&out).unwrap(), all);
    }
}
