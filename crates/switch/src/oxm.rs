//! OpenFlow 1.3 match fields (OXM, §7.2.3): the field table, matches read from the wire with
//! every rule of the specification checked (lengths, masks, values, duplicates, prerequisites),
//! and the packet key they are matched against.
//!
//! Every field has a fixed place in a 160-byte key (network byte order). A match keeps the
//! controller's own TLVs (flow statistics give them back as they were sent) and, for the data
//! path, only the 64-bit words it constrains: a lookup is a few masked word compares.

use crate::ofp::{self, OfError};
use stitch_wire::be::{self, Put};
use stitch_wire::header::{arp, ipv4, ipv6, nd};
use stitch_wire::{ethertype, icmpv6, ip_proto};

/// One OXM field of the basic class.
#[derive(Debug, Clone, Copy)]
pub struct FieldDef {
    pub id: u8,
    pub name: &'static str,
    /// Value length in bytes.
    pub len: u8,
    pub maskable: bool,
    /// Where the value sits in the key.
    pub offset: usize,
    /// Highest value allowed (fields narrower than their bytes).
    pub max: u64,
}

pub const IN_PORT: u8 = 0;
pub const IN_PHY_PORT: u8 = 1;
pub const METADATA: u8 = 2;
pub const ETH_DST: u8 = 3;
pub const ETH_SRC: u8 = 4;
pub const ETH_TYPE: u8 = 5;
pub const VLAN_VID: u8 = 6;
pub const VLAN_PCP: u8 = 7;
pub const IP_DSCP: u8 = 8;
pub const IP_ECN: u8 = 9;
pub const IP_PROTO: u8 = 10;
pub const IPV4_SRC: u8 = 11;
pub const IPV4_DST: u8 = 12;
pub const TCP_SRC: u8 = 13;
pub const TCP_DST: u8 = 14;
pub const UDP_SRC: u8 = 15;
pub const UDP_DST: u8 = 16;
pub const SCTP_SRC: u8 = 17;
pub const SCTP_DST: u8 = 18;
pub const ICMPV4_TYPE: u8 = 19;
pub const ICMPV4_CODE: u8 = 20;
pub const ARP_OP: u8 = 21;
pub const ARP_SPA: u8 = 22;
pub const ARP_TPA: u8 = 23;
pub const ARP_SHA: u8 = 24;
pub const ARP_THA: u8 = 25;
pub const IPV6_SRC: u8 = 26;
pub const IPV6_DST: u8 = 27;
pub const IPV6_FLABEL: u8 = 28;
pub const ICMPV6_TYPE: u8 = 29;
pub const ICMPV6_CODE: u8 = 30;
pub const IPV6_ND_TARGET: u8 = 31;
pub const IPV6_ND_SLL: u8 = 32;
pub const IPV6_ND_TLL: u8 = 33;
pub const MPLS_LABEL: u8 = 34;
pub const MPLS_TC: u8 = 35;
pub const MPLS_BOS: u8 = 36;
pub const PBB_ISID: u8 = 37;
pub const TUNNEL_ID: u8 = 38;
pub const IPV6_EXTHDR: u8 = 39;

const fn f(
    id: u8,
    name: &'static str,
    len: u8,
    maskable: bool,
    offset: usize,
    max: u64,
) -> FieldDef {
    FieldDef {
        id,
        name,
        len,
        maskable,
        offset,
        max,
    }
}

const ANY: u64 = u64::MAX;

/// The fields this switch matches and sets, by OXM id: all of OpenFlow 1.3's basic class.
pub const FIELDS: [Option<FieldDef>; 40] = {
    let mut t = [None; 40];
    t[0] = Some(f(IN_PORT, "in_port", 4, false, 0, ANY));
    t[1] = Some(f(IN_PHY_PORT, "in_phy_port", 4, false, 4, ANY));
    t[2] = Some(f(METADATA, "metadata", 8, true, 8, ANY));
    t[3] = Some(f(ETH_DST, "eth_dst", 6, true, 16, ANY));
    t[4] = Some(f(ETH_SRC, "eth_src", 6, true, 22, ANY));
    t[5] = Some(f(ETH_TYPE, "eth_type", 2, false, 28, ANY));
    t[6] = Some(f(VLAN_VID, "vlan_vid", 2, true, 30, 0x1fff));
    t[7] = Some(f(VLAN_PCP, "vlan_pcp", 1, false, 32, 7));
    t[8] = Some(f(IP_DSCP, "ip_dscp", 1, false, 33, 63));
    t[9] = Some(f(IP_ECN, "ip_ecn", 1, false, 34, 3));
    t[10] = Some(f(IP_PROTO, "ip_proto", 1, false, 35, ANY));
    t[11] = Some(f(IPV4_SRC, "ipv4_src", 4, true, 36, ANY));
    t[12] = Some(f(IPV4_DST, "ipv4_dst", 4, true, 40, ANY));
    t[13] = Some(f(TCP_SRC, "tcp_src", 2, false, 44, ANY));
    t[14] = Some(f(TCP_DST, "tcp_dst", 2, false, 46, ANY));
    t[15] = Some(f(UDP_SRC, "udp_src", 2, false, 48, ANY));
    t[16] = Some(f(UDP_DST, "udp_dst", 2, false, 50, ANY));
    t[17] = Some(f(SCTP_SRC, "sctp_src", 2, false, 52, ANY));
    t[18] = Some(f(SCTP_DST, "sctp_dst", 2, false, 54, ANY));
    t[19] = Some(f(ICMPV4_TYPE, "icmpv4_type", 1, false, 56, ANY));
    t[20] = Some(f(ICMPV4_CODE, "icmpv4_code", 1, false, 57, ANY));
    t[21] = Some(f(ARP_OP, "arp_op", 2, false, 58, ANY));
    t[22] = Some(f(ARP_SPA, "arp_spa", 4, true, 60, ANY));
    t[23] = Some(f(ARP_TPA, "arp_tpa", 4, true, 64, ANY));
    t[24] = Some(f(ARP_SHA, "arp_sha", 6, true, 68, ANY));
    t[25] = Some(f(ARP_THA, "arp_tha", 6, true, 74, ANY));
    t[26] = Some(f(IPV6_SRC, "ipv6_src", 16, true, 80, ANY));
    t[27] = Some(f(IPV6_DST, "ipv6_dst", 16, true, 96, ANY));
    t[28] = Some(f(IPV6_FLABEL, "ipv6_flabel", 4, true, 112, 0xfffff));
    t[29] = Some(f(ICMPV6_TYPE, "icmpv6_type", 1, false, 116, ANY));
    t[30] = Some(f(ICMPV6_CODE, "icmpv6_code", 1, false, 117, ANY));
    t[31] = Some(f(IPV6_ND_TARGET, "ipv6_nd_target", 16, false, 118, ANY));
    t[32] = Some(f(IPV6_ND_SLL, "ipv6_nd_sll", 6, false, 134, ANY));
    t[33] = Some(f(IPV6_ND_TLL, "ipv6_nd_tll", 6, false, 140, ANY));
    t[34] = Some(f(MPLS_LABEL, "mpls_label", 4, false, 146, 0xfffff));
    t[35] = Some(f(MPLS_TC, "mpls_tc", 1, false, 150, 7));
    t[36] = Some(f(MPLS_BOS, "mpls_bos", 1, false, 151, 1));
    t[37] = Some(f(PBB_ISID, "pbb_isid", 3, true, 160, ANY));
    t[38] = Some(f(TUNNEL_ID, "tunnel_id", 8, true, 152, ANY));
    t[39] = Some(f(IPV6_EXTHDR, "ipv6_exthdr", 2, true, 164, 0x1ff));
    t
};

pub fn field(id: u8) -> Option<&'static FieldDef> {
    FIELDS.get(id as usize).and_then(Option::as_ref)
}

pub const KEY_BYTES: usize = 168;

// `fill` writes each transport protocol's two ports with one copy.
const _: () = assert!(
    at(TCP_DST) == at(TCP_SRC) + 2
        && at(UDP_DST) == at(UDP_SRC) + 2
        && at(SCTP_DST) == at(SCTP_SRC) + 2
);

/// Where field `id` sits in the key (a constant: the data path writes fields at fixed places).
const fn at(id: u8) -> usize {
    match FIELDS[id as usize] {
        Some(f) => f.offset,
        None => panic!("field without a place"),
    }
}
pub const KEY_WORDS: usize = KEY_BYTES / 8;

/// A packet's fields, each in its place (absent fields are zero; prerequisites keep a match
/// on an absent field from meeting a packet that lacks it).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(C, align(8))]
pub struct Key(pub [u8; KEY_BYTES]);

impl Default for Key {
    fn default() -> Self {
        Key([0; KEY_BYTES])
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_map();
        for def in FIELDS.iter().flatten() {
            let v = self.get(def.id);
            if v.iter().any(|b| *b != 0) {
                d.entry(&def.name, &v);
            }
        }
        d.finish()
    }
}

impl Key {
    #[inline]
    pub fn word(&self, i: usize) -> u64 {
        u64::from_ne_bytes(self.0[i * 8..i * 8 + 8].try_into().unwrap())
    }

    /// The bytes of field `id` (empty for a field without a place).
    pub fn get(&self, id: u8) -> &[u8] {
        match field(id) {
            Some(d) => &self.0[d.offset..d.offset + d.len as usize],
            None => &[],
        }
    }

    #[inline]
    pub fn set(&mut self, id: u8, v: &[u8]) {
        if let Some(d) = field(id) {
            let n = (d.len as usize).min(v.len());
            self.0[d.offset..d.offset + n].copy_from_slice(&v[..n]);
        }
    }

    /// Writes `N` bytes at a constant place (the compiler makes it a few stores).
    #[inline(always)]
    fn put<const N: usize>(&mut self, offset: usize, v: &[u8]) {
        self.0[offset..offset + N].copy_from_slice(&v[..N]);
    }

    pub fn in_port(&self) -> u32 {
        be::get::<u32>(self.get(IN_PORT), 0)
    }

    pub fn metadata(&self) -> u64 {
        be::get::<u64>(self.get(METADATA), 0)
    }

    pub fn set_metadata(&mut self, v: u64) {
        self.set(METADATA, &be::net(v));
    }

    pub fn u16(&self, id: u8) -> u16 {
        let b = self.get(id);
        be::get::<u16>(b, 0)
    }

    pub fn u8(&self, id: u8) -> u8 {
        self.get(id)[0]
    }
}

/// One 64-bit word of the key a match constrains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Word {
    pub index: u8,
    pub mask: u64,
    /// Already masked.
    pub value: u64,
}

/// One field of a match as the controller sent it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tlv {
    pub id: u8,
    pub value: Vec<u8>,
    pub mask: Option<Vec<u8>>,
}

/// One field for [`Match::from_fields`]: id, value, optional mask.
pub type Field<'a> = (u8, &'a [u8], Option<&'a [u8]>);

/// A flow's match: the TLVs in the order they came, and the words the data path compares.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Match {
    pub tlvs: Vec<Tlv>,
    /// Sorted by index; only words with a non-zero mask.
    pub words: Vec<Word>,
}

impl Match {
    /// Builds a match from fields (value, optional mask); checks nothing (callers pass
    /// well-formed fields; the wire goes through [`parse_match`]).
    pub fn from_fields(fields: &[Field]) -> Match {
        let tlvs = fields
            .iter()
            .map(|(id, v, m)| Tlv {
                id: *id,
                value: v.to_vec(),
                mask: m.map(<[u8]>::to_vec),
            })
            .collect();
        Match::of_tlvs(tlvs)
    }

    fn of_tlvs(tlvs: Vec<Tlv>) -> Match {
        let mut value = Key::default();
        let mut mask = Key::default();
        for t in &tlvs {
            let Some(d) = field(t.id) else { continue };
            let full = vec![0xff; d.len as usize];
            let m = t.mask.as_deref().unwrap_or(&full);
            for (i, (v, m)) in t.value.iter().zip(m).enumerate() {
                mask.0[d.offset + i] = *m;
                value.0[d.offset + i] = v & m;
            }
        }
        let words = (0..KEY_WORDS)
            .filter(|&i| mask.word(i) != 0)
            .map(|i| Word {
                index: i as u8,
                mask: mask.word(i),
                value: value.word(i),
            })
            .collect();
        Match { tlvs, words }
    }

    #[inline]
    pub fn matches(&self, k: &Key) -> bool {
        self.words
            .iter()
            .all(|w| k.word(w.index as usize) & w.mask == w.value)
    }

    fn mask_of(&self, index: u8) -> (u64, u64) {
        self.words
            .iter()
            .find(|w| w.index == index)
            .map_or((0, 0), |w| (w.mask, w.value))
    }

    /// Whether `self` (a non-strict modify/delete/statistics description) covers `entry`:
    /// every bit `self` constrains, `entry` constrains to the same value.
    pub fn covers(&self, entry: &Match) -> bool {
        self.words.iter().all(|w| {
            let (em, ev) = entry.mask_of(w.index);
            w.mask & !em == 0 && ev & w.mask == w.value
        })
    }

    /// Whether some packet could match both (OFPFF_CHECK_OVERLAP).
    pub fn overlaps(&self, other: &Match) -> bool {
        self.words.iter().all(|w| {
            let (om, ov) = other.mask_of(w.index);
            (w.value ^ ov) & w.mask & om == 0
        })
    }

    /// Same packets matched (strict modify and delete).
    pub fn same(&self, other: &Match) -> bool {
        self.words == other.words
    }

    /// The value of an exactly matched field, if the match has it unmasked.
    pub fn exact(&self, id: u8) -> Option<&[u8]> {
        self.tlvs
            .iter()
            .find(|t| t.id == id && t.mask.as_ref().is_none_or(|m| m.iter().all(|b| *b == 0xff)))
            .map(|t| t.value.as_slice())
    }

    pub fn has(&self, id: u8) -> bool {
        self.tlvs.iter().any(|t| t.id == id)
    }

    /// Only `in_port` (or nothing).
    pub fn is_in_port_only(&self) -> bool {
        self.tlvs
            .iter()
            .all(|t| t.id == IN_PORT && t.mask.is_none())
    }
}

const OXM_BASIC: u16 = 0x8000;

/// Reads an `ofp_match` at `b[at..]`; returns it and the padded length it takes.
pub fn parse_match(b: &[u8], at: usize) -> Result<(Match, usize), OfError> {
    let t = ofp::u16_field(b, at)?;
    let len = ofp::u16_field(b, at + 2)? as usize;
    if t != 1 {
        return Err(ofp::BAD_MATCH_TYPE);
    }
    if len < 4 || at + len > b.len() {
        return Err(ofp::BAD_MATCH_LEN);
    }
    let mut tlvs: Vec<Tlv> = Vec::new();
    let mut i = at + 4;
    while i < at + len {
        let (tlv, used) = parse_tlv(&b[i..at + len])?;
        if tlvs.iter().any(|t| t.id == tlv.id) {
            return Err(ofp::BAD_MATCH_DUP_FIELD);
        }
        tlvs.push(tlv);
        i += used;
    }
    check_prerequisites(&tlvs)?;
    Ok((Match::of_tlvs(tlvs), len.div_ceil(8) * 8))
}

/// One OXM TLV of the basic class with its value checked; the bytes it took.
pub fn parse_tlv(b: &[u8]) -> Result<(Tlv, usize), OfError> {
    if b.len() < 4 {
        return Err(ofp::BAD_MATCH_LEN);
    }
    let class = be::get::<u16>(b, 0);
    let (id, has_mask, l) = (b[2] >> 1, b[2] & 1 == 1, b[3] as usize);
    let body = b.get(4..4 + l).ok_or(ofp::BAD_MATCH_LEN)?;
    if class != OXM_BASIC {
        return Err(ofp::BAD_MATCH_FIELD);
    }
    let d = field(id).ok_or(ofp::BAD_MATCH_FIELD)?;
    let n = d.len as usize;
    if l != if has_mask { 2 * n } else { n } {
        return Err(ofp::BAD_MATCH_LEN);
    }
    if has_mask && !d.maskable {
        return Err(ofp::BAD_MATCH_MASK);
    }
    let value = body[..n].to_vec();
    let mask = has_mask.then(|| body[n..].to_vec());
    if let Some(m) = &mask {
        // Value bits outside the mask (§7.2.3.5).
        if value.iter().zip(m).any(|(v, m)| v & !m != 0) {
            return Err(ofp::BAD_MATCH_WILDCARDS);
        }
    }
    if d.max != ANY && be_value(&value) > d.max {
        return Err(ofp::BAD_MATCH_VALUE);
    }
    Ok((Tlv { id, value, mask }, 4 + l))
}

/// A field's big-endian bytes as a number.
pub(crate) fn be_value(v: &[u8]) -> u64 {
    v.iter().fold(0u64, |a, b| a << 8 | *b as u64)
}

/// Whether IPv6 next header `next` is one of the extension headers the key's walk reads.
#[inline]
fn is_extension_header(next: u8) -> bool {
    matches!(
        next,
        ip_proto::HOP_BY_HOP
            | ip_proto::ROUTING
            | ip_proto::FRAGMENT
            | ip_proto::ESP
            | ip_proto::AH
            | ip_proto::NO_NEXT_HEADER
            | ip_proto::DESTINATION_OPTIONS
    )
}

/// Whether ICMPv6 type `t` carries a Neighbor Discovery target (solicitation, advertisement).
#[inline]
fn carries_nd_target(t: u8) -> bool {
    t == icmpv6::NEIGHBOR_SOLICITATION || t == icmpv6::NEIGHBOR_ADVERTISEMENT
}

/// OpenFlow 1.3 §7.2.3.8: a field is allowed only with its prerequisite matched exactly.
fn check_prerequisites(tlvs: &[Tlv]) -> Result<(), OfError> {
    let exact = |id: u8| -> Option<u64> {
        tlvs.iter()
            .find(|t| t.id == id && t.mask.is_none())
            .map(|t| be_value(&t.value))
    };
    let is =
        |id: u8, want: &[u8]| exact(id).is_some_and(|v| want.iter().any(|w| u64::from(*w) == v));
    let eth_type =
        |want: &[u16]| exact(ETH_TYPE).is_some_and(|v| want.iter().any(|w| u64::from(*w) == v));
    let ip = || eth_type(&[ethertype::IPV4, ethertype::IPV6]);
    for t in tlvs {
        let ok = match t.id {
            IN_PHY_PORT => exact(IN_PORT).is_some(),
            VLAN_PCP => tlvs
                .iter()
                .any(|v| v.id == VLAN_VID && be_value(&v.value) & 0x1000 != 0),
            IP_DSCP | IP_ECN | IP_PROTO => ip(),
            IPV4_SRC | IPV4_DST => eth_type(&[ethertype::IPV4]),
            TCP_SRC | TCP_DST => ip() && is(IP_PROTO, &[ip_proto::TCP]),
            UDP_SRC | UDP_DST => ip() && is(IP_PROTO, &[ip_proto::UDP]),
            SCTP_SRC | SCTP_DST => ip() && is(IP_PROTO, &[ip_proto::SCTP]),
            ICMPV4_TYPE | ICMPV4_CODE => {
                eth_type(&[ethertype::IPV4]) && is(IP_PROTO, &[ip_proto::ICMP])
            }
            ARP_OP | ARP_SPA | ARP_TPA | ARP_SHA | ARP_THA => eth_type(&[ethertype::ARP]),
            IPV6_SRC | IPV6_DST | IPV6_FLABEL => eth_type(&[ethertype::IPV6]),
            ICMPV6_TYPE | ICMPV6_CODE => {
                eth_type(&[ethertype::IPV6]) && is(IP_PROTO, &[ip_proto::ICMPV6])
            }
            IPV6_ND_TARGET => {
                is(IP_PROTO, &[ip_proto::ICMPV6])
                    && is(
                        ICMPV6_TYPE,
                        &[
                            icmpv6::NEIGHBOR_SOLICITATION,
                            icmpv6::NEIGHBOR_ADVERTISEMENT,
                        ],
                    )
            }
            IPV6_ND_SLL => {
                is(IP_PROTO, &[ip_proto::ICMPV6])
                    && is(ICMPV6_TYPE, &[icmpv6::NEIGHBOR_SOLICITATION])
            }
            IPV6_ND_TLL => {
                is(IP_PROTO, &[ip_proto::ICMPV6])
                    && is(ICMPV6_TYPE, &[icmpv6::NEIGHBOR_ADVERTISEMENT])
            }
            MPLS_LABEL | MPLS_TC | MPLS_BOS => {
                eth_type(&[ethertype::MPLS, ethertype::MPLS_MULTICAST])
            }
            PBB_ISID => eth_type(&[ethertype::PBB]),
            IPV6_EXTHDR => eth_type(&[ethertype::IPV6]),
            _ => true,
        };
        if !ok {
            return Err(ofp::BAD_MATCH_PREREQ);
        }
    }
    Ok(())
}

pub fn write_tlv(out: &mut Vec<u8>, id: u8, value: &[u8], mask: Option<&[u8]>) {
    out.put(OXM_BASIC);
    out.push(id << 1 | mask.is_some() as u8);
    out.push((value.len() + mask.map_or(0, <[u8]>::len)) as u8);
    out.extend_from_slice(value);
    if let Some(m) = mask {
        out.extend_from_slice(m);
    }
}

/// Writes an `ofp_match` (padded to 8 bytes) with the TLVs as the controller sent them.
pub fn write_match(out: &mut Vec<u8>, m: &Match) {
    let start = out.len();
    out.extend_from_slice(&[0, 1, 0, 0]);
    for t in &m.tlvs {
        write_tlv(out, t.id, &t.value, t.mask.as_deref());
    }
    let len = (out.len() - start) as u16;
    be::set(out, start + 2, len);
    while !(out.len() - start).is_multiple_of(8) {
        out.push(0);
    }
}

/// Where a frame's headers start, as [`Key::extract`] found them: what set-field and the
/// TTL, VLAN and MPLS actions rewrite.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Offset of the outer VLAN tag's TPID (12) when tagged.
    pub vlan: Option<usize>,
    /// Offset of the ethertype that names the payload after all tags.
    pub ethertype_at: usize,
    /// Offset of the outer MPLS shim.
    pub mpls: Option<usize>,
    /// Network header (after tags and MPLS shims when the payload is IP/ARP).
    pub l3: Option<usize>,
    /// Transport header (first fragment only).
    pub l4: Option<usize>,
    pub ethertype: u16,
    pub ip_proto: u8,
    /// Offset of the I-TAG of a PBB frame (ethertype 0x88e7).
    pub itag: Option<usize>,
    /// OpenFlow's IPv6 extension-header pseudo-field (§7.2.3.7).
    pub ipv6_exthdr: u16,
}

/// Bits of the IPV6_EXTHDR pseudo-field (OFPIEH_*).
pub mod exthdr {
    pub const NONEXT: u16 = 1 << 0;
    pub const ESP: u16 = 1 << 1;
    pub const AUTH: u16 = 1 << 2;
    pub const DEST: u16 = 1 << 3;
    pub const FRAG: u16 = 1 << 4;
    pub const ROUTER: u16 = 1 << 5;
    pub const HOP: u16 = 1 << 6;
    pub const UNREP: u16 = 1 << 7;
    pub const UNSEQ: u16 = 1 << 8;
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

/// Finds the headers of an Ethernet frame (tags, MPLS, IPv4/IPv6/ARP, transport).
pub fn layout(frame: &[u8]) -> Layout {
    let mut l = Layout::default();
    let Some(mut et) = be16(frame, 12) else {
        return l;
    };
    let mut at = 14;
    let mut et_at = 12;
    let mut tagged = false;
    while (et == ethertype::VLAN || et == ethertype::QINQ) && frame.len() >= at + 4 {
        if !tagged {
            l.vlan = Some(at - 2);
            tagged = true;
        }
        et_at = at + 2;
        et = be16(frame, at + 2).unwrap_or(0);
        at += 4;
    }
    l.ethertype = et;
    l.ethertype_at = et_at;
    if et == ethertype::PBB {
        if frame.len() >= at + 4 {
            l.itag = Some(at);
        }
        return l;
    }
    if et == ethertype::MPLS || et == ethertype::MPLS_MULTICAST {
        if frame.len() >= at + 4 {
            l.mpls = Some(at);
        }
        return l;
    }
    l.l3 = Some(at);
    let l3 = &frame[at.min(frame.len())..];
    match et {
        ethertype::IPV4 if l3.len() >= 20 && l3[0] >> 4 == 4 => {
            l.ip_proto = l3[9];
            let ihl = (l3[0] & 0x0f) as usize * 4;
            let first = ipv4::FLAGS_FRAG.get(l3) & ipv4::OFFSET == 0;
            if first && ihl >= 20 && l3.len() >= ihl {
                l.l4 = Some(at + ihl);
            }
        }
        ethertype::IPV6 if l3.len() >= 40 => {
            let (next, off, bits, later_fragment) = walk_ipv6_extensions(l3);
            l.ip_proto = next;
            l.ipv6_exthdr = bits;
            if !later_fragment && l3.len() >= off {
                l.l4 = Some(at + off);
            }
        }
        ethertype::IPV4 | ethertype::IPV6 => l.l3 = None,
        _ => {}
    }
    l
}

/// Walks an IPv6 packet's extension headers (RFC 8200 §4): the upper-layer protocol, where it
/// starts, OpenFlow's IPV6_EXTHDR bits, and whether this is a later fragment (no transport
/// header).
fn walk_ipv6_extensions(l3: &[u8]) -> (u8, usize, u16, bool) {
    use exthdr::*;
    let mut next = l3[6];
    let mut off = 40;
    let mut bits = 0u16;
    // RFC 8200's recommended order; a header out of it is "unexpected sequencing".
    let mut rank = 0;
    let mut dest_seen = 0;
    loop {
        let (bit, this_rank) = match next {
            ip_proto::HOP_BY_HOP => (HOP, 0),
            ip_proto::DESTINATION_OPTIONS => {
                dest_seen += 1;
                (DEST, if dest_seen == 1 { 1 } else { 6 })
            }
            ip_proto::ROUTING => (ROUTER, 2),
            ip_proto::FRAGMENT => (FRAG, 3),
            ip_proto::AH => (AUTH, 4),
            ip_proto::ESP => (ESP, 5),
            ip_proto::NO_NEXT_HEADER => (NONEXT, 7),
            _ => break,
        };
        if bits & bit != 0 && !(bit == DEST && dest_seen == 2) {
            bits |= UNREP;
        }
        if (bit == HOP && off != 40) || this_rank < rank {
            bits |= UNSEQ;
        }
        rank = rank.max(this_rank);
        bits |= bit;
        if matches!(next, ip_proto::ESP | ip_proto::NO_NEXT_HEADER) || l3.len() < off + 8 {
            break;
        }
        let here = next;
        next = l3[off];
        match here {
            ip_proto::FRAGMENT => {
                let later = be16(l3, off + 2).unwrap_or(0) & 0xfff8 != 0;
                off += 8;
                if later {
                    return (next, off, bits, true);
                }
            }
            ip_proto::AH => off += (l3[off + 1] as usize + 2) * 4,
            _ => off += (l3[off + 1] as usize + 1) * 8,
        }
    }
    (next, off, bits, false)
}

impl Key {
    /// Reads the fields of `frame` arriving on `in_port` (anything shorter than a field leaves
    /// it unset).
    #[inline]
    pub fn extract(frame: &[u8], in_port: u32) -> Key {
        let mut k = Key::default();
        k.reset(frame, in_port);
        k
    }

    /// Makes this the key of `frame` arriving on `in_port`, in place.
    #[inline]
    pub fn reset(&mut self, frame: &[u8], in_port: u32) {
        self.clear_for(in_port);
        if !self.fill_ip(frame) {
            self.fill(frame, &layout(frame));
        }
    }

    /// No fields but the input port.
    #[inline]
    fn clear_for(&mut self, in_port: u32) {
        self.0 = [0; KEY_BYTES];
        be::set(&mut self.0, at(IN_PORT), in_port);
        be::set(&mut self.0, at(IN_PHY_PORT), in_port);
    }

    /// The most common frames read in one pass, without [`layout`]: IPv4 (options allowed)
    /// and IPv6 without extension headers, after at most one tag. Writes what [`Key::fill`]
    /// would and returns `true`; for any other frame, and for Neighbor Discovery (whose
    /// options `fill` reads), writes nothing and returns `false`.
    #[inline]
    fn fill_ip(&mut self, frame: &[u8]) -> bool {
        let Some(eth) = frame.get(..18) else {
            return false;
        };
        let outer = be::get::<u16>(eth, 12);
        let tagged = outer == ethertype::VLAN || outer == ethertype::QINQ;
        let (ethertype, l3_at) = if tagged {
            (be::get::<u16>(eth, 16), 18)
        } else {
            (outer, 14)
        };
        let l3 = &frame[l3_at..];
        let (proto, l4) = match ethertype {
            ethertype::IPV4 if l3.len() >= 20 && l3[0] >> 4 == 4 => {
                let ihl = (l3[0] & 0x0f) as usize * 4;
                let first = ipv4::FLAGS_FRAG.get(l3) & ipv4::OFFSET == 0;
                (
                    l3[9],
                    if first && ihl >= 20 {
                        l3.get(ihl..)
                    } else {
                        None
                    },
                )
            }
            // The extension headers walk_ipv6_extensions reads.
            ethertype::IPV6 if l3.len() >= 40 && !is_extension_header(l3[6]) => {
                let l4 = &l3[40..];
                if l3[6] == ip_proto::ICMPV6 && l4.len() >= 24 && carries_nd_target(l4[0]) {
                    return false;
                }
                (l3[6], Some(l4))
            }
            _ => return false,
        };
        let tci = tagged.then(|| be::get::<u16>(eth, 14));
        self.put_ethernet(eth, ethertype, tci);
        if ethertype == ethertype::IPV4 {
            self.put_ipv4(l3, proto);
        } else {
            // No extension headers: none of the pseudo-field's bits.
            self.put_ipv6(l3, proto, 0);
        }
        if let Some(l4) = l4 {
            self.put_transport(ethertype, proto, l4);
        }
        true
    }

    /// The Ethernet fields: addresses, the ethertype after the tags, the outer tag's TCI.
    #[inline(always)]
    fn put_ethernet(&mut self, frame: &[u8], ethertype: u16, tci: Option<u16>) {
        self.put::<6>(at(ETH_DST), &frame[0..6]);
        self.put::<6>(at(ETH_SRC), &frame[6..12]);
        be::set(&mut self.0, at(ETH_TYPE), ethertype);
        if let Some(tci) = tci {
            be::set(&mut self.0, at(VLAN_VID), 0x1000 | (tci & 0x0fff));
            self.0[at(VLAN_PCP)] = (tci >> 13) as u8;
        }
    }

    /// The fields of IPv4 header `l3` (at least 20 bytes), `proto` the payload's protocol.
    #[inline(always)]
    fn put_ipv4(&mut self, l3: &[u8], proto: u8) {
        let tos = ipv4::TOS.get(l3);
        self.0[at(IP_DSCP)] = tos >> 2;
        self.0[at(IP_ECN)] = tos & 3;
        self.0[at(IP_PROTO)] = proto;
        self.put::<4>(at(IPV4_SRC), &l3[ipv4::SRC_BYTES]);
        self.put::<4>(at(IPV4_DST), &l3[ipv4::DST_BYTES]);
    }

    /// The fields of IPv6 header `l3` (at least 40 bytes): `proto` the upper layer's protocol
    /// and `exthdr` the extension headers' bits, both found past the extension headers.
    #[inline(always)]
    fn put_ipv6(&mut self, l3: &[u8], proto: u8, exthdr: u16) {
        let first = ipv6::VERSION_CLASS_FLOW.get(l3);
        let tc = (first >> 20) as u8;
        self.0[at(IP_DSCP)] = tc >> 2;
        self.0[at(IP_ECN)] = tc & 3;
        self.0[at(IP_PROTO)] = proto;
        be::set(&mut self.0, at(IPV6_FLABEL), first & 0xfffff);
        self.put::<16>(at(IPV6_SRC), &l3[ipv6::SRC]);
        self.put::<16>(at(IPV6_DST), &l3[ipv6::DST]);
        be::set(&mut self.0, at(IPV6_EXTHDR), exthdr);
    }

    /// The transport fields of upper layer `l4`: ports, ICMP type and code (Neighbor
    /// Discovery's target and options are [`Key::fill`]'s).
    #[inline(always)]
    fn put_transport(&mut self, ethertype: u16, proto: u8, l4: &[u8]) {
        match (ethertype, proto) {
            (_, ip_proto::TCP | ip_proto::UDP | ip_proto::SCTP) if l4.len() >= 4 => {
                let src = match proto {
                    ip_proto::TCP => at(TCP_SRC),
                    ip_proto::UDP => at(UDP_SRC),
                    _ => at(SCTP_SRC),
                };
                // Each protocol's source and destination ports are side by side in the key.
                self.put::<4>(src, &l4[0..4]);
            }
            (ethertype::IPV4, ip_proto::ICMP) if l4.len() >= 2 => {
                self.0[at(ICMPV4_TYPE)] = l4[0];
                self.0[at(ICMPV4_CODE)] = l4[1];
            }
            (ethertype::IPV6, ip_proto::ICMPV6) if l4.len() >= 4 => {
                self.0[at(ICMPV6_TYPE)] = l4[0];
                self.0[at(ICMPV6_CODE)] = l4[1];
            }
            _ => {}
        }
    }

    /// Re-reads the packet fields after an action changed the frame (`in_port`, `metadata`
    /// and `tunnel_id` are kept).
    pub fn refresh(&mut self, frame: &[u8]) {
        let keep = *self;
        *self = Key::default();
        for id in [IN_PORT, IN_PHY_PORT, METADATA, TUNNEL_ID] {
            self.set(id, keep.get(id));
        }
        self.fill(frame, &layout(frame));
    }

    #[inline]
    fn fill(&mut self, frame: &[u8], l: &Layout) {
        if frame.len() < 14 {
            return;
        }
        let tci = l.vlan.map(|v| be16(frame, v + 2).unwrap_or(0));
        self.put_ethernet(frame, l.ethertype, tci);
        if let Some(t) = l.itag {
            self.put::<3>(at(PBB_ISID), &frame[t + 1..t + 4]);
            return;
        }
        if let Some(m) = l.mpls {
            let s = be::get::<u32>(frame, m);
            be::set(&mut self.0, at(MPLS_LABEL), s >> 12);
            self.0[at(MPLS_TC)] = ((s >> 9) & 7) as u8;
            self.0[at(MPLS_BOS)] = ((s >> 8) & 1) as u8;
            return;
        }
        let Some(l3at) = l.l3 else { return };
        let l3 = &frame[l3at..];
        match l.ethertype {
            ethertype::IPV4 => self.put_ipv4(l3, l.ip_proto),
            ethertype::IPV6 => self.put_ipv6(l3, l.ip_proto, l.ipv6_exthdr),
            ethertype::ARP
                if l3.len() >= arp::LEN
                    && arp::HARDWARE.get(l3) == 1
                    && arp::PROTOCOL.get(l3) == ethertype::IPV4 =>
            {
                be::set(&mut self.0, at(ARP_OP), arp::OPERATION.get(l3));
                self.put::<6>(at(ARP_SHA), &l3[arp::SENDER_MAC]);
                self.put::<4>(at(ARP_SPA), &l3[arp::SENDER_IP]);
                self.put::<6>(at(ARP_THA), &l3[arp::TARGET_MAC]);
                self.put::<4>(at(ARP_TPA), &l3[arp::TARGET_IP]);
                return;
            }
            _ => return,
        }
        let Some(l4at) = l.l4 else { return };
        let l4 = &frame[l4at..];
        self.put_transport(l.ethertype, l.ip_proto, l4);
        let neighbor_discovery = (l.ethertype, l.ip_proto) == (ethertype::IPV6, ip_proto::ICMPV6)
            && l4.len() >= nd::OPTIONS
            && carries_nd_target(l4[0]);
        if neighbor_discovery {
            self.put::<16>(at(IPV6_ND_TARGET), &l4[nd::TARGET]);
            let mut o = nd::OPTIONS;
            while o + 8 <= l4.len() {
                let (kind, len) = (l4[o], l4[o + 1] as usize * 8);
                if len == 0 {
                    break;
                }
                if len == 8 && kind == 1 && l4[0] == 135 {
                    self.put::<6>(at(IPV6_ND_SLL), &l4[o + 2..o + 8]);
                }
                if len == 8 && kind == 2 && l4[0] == 136 {
                    self.put::<6>(at(IPV6_ND_TLL), &l4[o + 2..o + 8]);
                }
                o += len;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames of every shape the one-pass IP reading takes or declines, cut at every length.
    fn frames_for_fill() -> Vec<Vec<u8>> {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut out = Vec::new();
        for _ in 0..3000 {
            let mut f: Vec<u8> = (0..12).map(|_| rng.u8(..)).collect();
            for _ in 0..rng.usize(0..3) {
                let tpid: u16 = *rng
                    .choice(&[ethertype::VLAN, ethertype::QINQ, ethertype::IPV4])
                    .unwrap();
                f.put(tpid);
                f.put(rng.u16(..));
            }
            let ethertype: u16 = *rng
                .choice(&[
                    ethertype::IPV4,
                    ethertype::IPV4,
                    ethertype::IPV6,
                    ethertype::ARP,
                    ethertype::MPLS,
                ])
                .unwrap();
            f.put(ethertype);
            if ethertype == ethertype::IPV6 && rng.bool() {
                // An IPv6 header: random but for the next header, then an upper layer whose
                // first byte is an ICMPv6 type.
                f.extend((0..6).map(|_| rng.u8(..)));
                f.push(*rng.choice(&[6u8, 17, 132, 58, 58, 0, 44, 59, 60]).unwrap());
                f.extend((0..33).map(|_| rng.u8(..)));
                f.push(*rng.choice(&[128u8, 135, 136, 1]).unwrap());
                f.extend((0..40).map(|_| rng.u8(..)));
                let cut = rng.usize(..=f.len());
                f.truncate(cut);
                out.push(f);
                continue;
            }
            let ihl = *rng.choice(&[5u8, 5, 6, 4, 15]).unwrap();
            let version = *rng.choice(&[4u8, 4, 6]).unwrap();
            f.push(version << 4 | ihl);
            f.push(rng.u8(..));
            f.extend_from_slice(&[0, 60]);
            f.extend_from_slice(&[0, 0]);
            let fragment: u16 = *rng.choice(&[0, 0, 0x2000, 0x0010]).unwrap();
            f.put(fragment);
            f.push(64);
            f.push(*rng.choice(&[6u8, 17, 132, 1, 47]).unwrap());
            f.extend((0..70).map(|_| rng.u8(..)));
            let cut = rng.usize(..=f.len());
            f.truncate(cut);
            out.push(f);
        }
        out
    }

    #[test]
    fn the_one_pass_ip_reading_gives_the_key_the_layout_gives() {
        let (mut taken, mut ipv6) = (0, 0);
        for f in frames_for_fill() {
            let mut fast = Key::default();
            fast.reset(&f, 3);
            let mut general = Key::default();
            general.clear_for(3);
            general.fill(&f, &layout(&f));
            assert_eq!(fast, general, "frame {f:02x?}");
            let mut one_pass = Key::default();
            if one_pass.fill_ip(&f) {
                taken += 1;
                ipv6 += (one_pass.get(ETH_TYPE) == ethertype::IPV6.to_be_bytes()) as usize;
            }
        }
        // Both ways were taken, often.
        assert!(
            (200..2800).contains(&taken),
            "{taken} of 3000 frames read in one pass"
        );
        assert!(ipv6 >= 25, "{ipv6} IPv6 frames read in one pass");
    }

    fn tlv(id: u8, v: &[u8], m: Option<&[u8]>) -> Vec<u8> {
        let mut b = Vec::new();
        write_tlv(&mut b, id, v, m);
        b
    }

    fn ofp_match(tlvs: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = tlvs.concat();
        let mut b = vec![0, 1];
        b.put((4 + body.len()) as u16);
        b.extend(body);
        while b.len() % 8 != 0 {
            b.push(0);
        }
        b
    }

    #[test]
    fn the_specs_rules_are_checked() {
        let parse = |t: &[Vec<u8>]| parse_match(&ofp_match(t), 0).map(|x| x.0);
        // A transport port without its protocol, an IPv4 address without its ethertype.
        assert_eq!(
            parse(&[tlv(TCP_DST, &[0, 80], None)]).err(),
            Some(ofp::BAD_MATCH_PREREQ)
        );
        assert_eq!(
            parse(&[
                tlv(ETH_TYPE, &ethertype::IPV6.to_be_bytes(), None),
                tlv(IPV4_SRC, &[1, 2, 3, 4], None)
            ])
            .err(),
            Some(ofp::BAD_MATCH_PREREQ)
        );
        assert_eq!(
            parse(&[
                tlv(IN_PORT, &[0, 0, 0, 1], None),
                tlv(IN_PORT, &[0, 0, 0, 2], None)
            ])
            .err(),
            Some(ofp::BAD_MATCH_DUP_FIELD)
        );
        assert_eq!(
            parse(&[tlv(ETH_TYPE, &[8, 0], Some(&[0xff, 0]))]).err(),
            Some(ofp::BAD_MATCH_MASK)
        );
        assert_eq!(
            parse(&[tlv(PBB_ISID, &[0, 0, 1], None)]).err(),
            Some(ofp::BAD_MATCH_PREREQ)
        );
        assert_eq!(
            parse(&[tlv(45, &[0, 0, 1], None)]).err(),
            Some(ofp::BAD_MATCH_FIELD)
        );
        assert_eq!(
            parse(&[tlv(
                ETH_DST,
                &[1, 2, 3, 4, 5, 6],
                Some(&[0xff, 0xff, 0xff, 0xff, 0xff, 0])
            )])
            .err(),
            Some(ofp::BAD_MATCH_WILDCARDS)
        );
        assert_eq!(
            parse(&[tlv(VLAN_VID, &[0x20, 0], None)]).err(),
            Some(ofp::BAD_MATCH_VALUE)
        );
        let ok = parse(&[
            tlv(ETH_TYPE, &[8, 0], None),
            tlv(IP_PROTO, &[6], None),
            tlv(TCP_DST, &[0, 80], None),
        ])
        .unwrap();
        assert_eq!(ok.tlvs.len(), 3);
    }

    fn tcp4() -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20];
        f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[12..14].copy_from_slice(&[8, 0]);
        f[14] = 0x45;
        f[15] = 32 << 2 | 1;
        f[23] = 6;
        f[26..30].copy_from_slice(&[10, 0, 0, 1]);
        f[30..34].copy_from_slice(&[10, 0, 0, 2]);
        be::set(&mut f, 34, 1234u16);
        be::set(&mut f, 36, 80u16);
        f
    }

    #[test]
    fn keys_meet_masked_matches() {
        let k = Key::extract(&tcp4(), 3);
        assert_eq!(k.in_port(), 3);
        assert_eq!(k.u16(TCP_DST), 80);
        assert_eq!(k.u8(IP_DSCP), 32);
        assert_eq!(k.u8(IP_ECN), 1);
        let m = Match::from_fields(&[
            (ETH_TYPE, &[8, 0], None),
            (IPV4_DST, &[10, 0, 0, 0], Some(&[255, 0, 0, 0])),
            (IP_PROTO, &[6], None),
            (TCP_DST, &[0, 80], None),
        ]);
        assert!(m.matches(&k));
        let udp = Match::from_fields(&[(ETH_TYPE, &[8, 0], None), (IP_PROTO, &[17], None)]);
        assert!(!udp.matches(&k));
        // Coverage and overlap, as modify/delete and CHECK_OVERLAP use them.
        let wide = Match::from_fields(&[(ETH_TYPE, &[8, 0], None)]);
        assert!(wide.covers(&m) && !m.covers(&wide));
        assert!(wide.overlaps(&udp) && !m.overlaps(&udp));
        // A tagged frame: the VID carries OFPVID_PRESENT.
        let mut tagged = tcp4();
        tagged.splice(12..12, [0x81, 0, 0x60, 10]);
        let k = Key::extract(&tagged, 1);
        assert_eq!(k.u16(VLAN_VID), 0x1000 | 10);
        assert_eq!(k.u8(VLAN_PCP), 3);
        assert_eq!(k.u16(TCP_DST), 80);
    }

    #[test]
    fn ipv6_extension_headers_make_the_pseudo_field() {
        // IPv6, hop-by-hop options, then an authentication header, then TCP.
        let mut f = vec![0u8; 14];
        f[12..14].copy_from_slice(&ethertype::IPV6.to_be_bytes());
        let mut ip = vec![0u8; 40];
        ip[0] = 0x60;
        ip[6] = 0; // hop-by-hop
        let hop = [51u8, 0, 0, 0, 0, 0, 0, 0];
        let auth = [6u8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let tcp = [
            0u8, 1, 0, 80, 0, 0, 0, 0, 0, 0, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0,
        ];
        f.extend(ip);
        f.extend(hop);
        f.extend(auth);
        f.extend(tcp);
        let k = Key::extract(&f, 1);
        assert_eq!(k.u16(IPV6_EXTHDR), exthdr::HOP | exthdr::AUTH);
        assert_eq!(k.u8(IP_PROTO), 6);
        assert_eq!(k.u16(TCP_DST), 80);
    }
}
