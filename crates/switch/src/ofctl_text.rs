//! Flows written as `ovs-ofctl --no-stats dump-flows` writes them (`cookie=0x5, table=1,
//! priority=100,tcp,in_port=1,tp_dst=80 actions=output:2`): what an operator of Open vSwitch
//! reads, and can paste back into `ovs-ofctl add-flow`. Fields come in Open vSwitch's order,
//! under its names, with its protocol shorthands (`ip`, `tcp6`, `arp` …); a field it has no
//! name for is written under its OXM name.

use crate::action::Action;
use crate::oxm::{self, Tlv};
use crate::pipeline::Instructions;
use crate::{ofp, oxm::FieldDef};
use std::fmt::Write;
use stitch_wire::{ethertype, ip_proto};

/// One flow entry's line (without statistics).
pub fn flow_line(
    cookie: u64,
    table: u8,
    priority: u16,
    matching: &[Tlv],
    instructions: &Instructions,
) -> String {
    let mut out = String::new();
    if cookie != 0 {
        let _ = write!(out, "cookie={cookie:#x}, ");
    }
    if table != 0 {
        let _ = write!(out, "table={table}, ");
    }
    let mut fields = Vec::new();
    if priority != DEFAULT_PRIORITY {
        fields.push(format!("priority={priority}"));
    }
    fields.extend(match_fields(matching));
    out.push_str(&fields.join(","));
    if !fields.is_empty() {
        out.push(' ');
    }
    out.push_str("actions=");
    out.push_str(&instructions_text(instructions));
    out
}

/// OpenFlow's default priority, which Open vSwitch leaves unwritten.
const DEFAULT_PRIORITY: u16 = 0x8000;

/// The value of field `id` in the match, and its mask.
fn find(m: &[Tlv], id: u8) -> Option<&Tlv> {
    m.iter().find(|t| t.id == id)
}

fn exact(m: &[Tlv], id: u8) -> Option<u64> {
    find(m, id)
        .filter(|t| t.mask.is_none())
        .map(|t| oxm::be_value(&t.value))
}

/// The protocol shorthand Open vSwitch writes for an EtherType (and IP protocol), and whether
/// it stands for the protocol too.
fn shorthand(m: &[Tlv]) -> Option<(&'static str, bool)> {
    let eth_type = u16::try_from(exact(m, oxm::ETH_TYPE)?).ok()?;
    let proto = exact(m, oxm::IP_PROTO).and_then(|p| u8::try_from(p).ok());
    let with_proto = |name: &'static str| Some((name, true));
    match (eth_type, proto) {
        (ethertype::IPV4, Some(ip_proto::ICMP)) => with_proto("icmp"),
        (ethertype::IPV4, Some(ip_proto::TCP)) => with_proto("tcp"),
        (ethertype::IPV4, Some(ip_proto::UDP)) => with_proto("udp"),
        (ethertype::IPV4, Some(ip_proto::SCTP)) => with_proto("sctp"),
        (ethertype::IPV4, _) => Some(("ip", false)),
        (ethertype::IPV6, Some(ip_proto::ICMPV6)) => with_proto("icmp6"),
        (ethertype::IPV6, Some(ip_proto::TCP)) => with_proto("tcp6"),
        (ethertype::IPV6, Some(ip_proto::UDP)) => with_proto("udp6"),
        (ethertype::IPV6, Some(ip_proto::SCTP)) => with_proto("sctp6"),
        (ethertype::IPV6, _) => Some(("ipv6", false)),
        (ethertype::ARP, _) => Some(("arp", false)),
        (ethertype::MPLS, _) => Some(("mpls", false)),
        (ethertype::MPLS_MULTICAST, _) => Some(("mplsm", false)),
        _ => None,
    }
}

/// Field `id` of the match, if it has it, as `name=value`.
fn put(out: &mut Vec<String>, m: &[Tlv], id: u8, name: &str) {
    if let Some(t) = find(m, id) {
        out.push(format!(
            "{name}={}",
            value_text(id, &t.value, t.mask.as_deref())
        ));
    }
}

/// The match's fields in Open vSwitch's order (its `match_format`).
fn match_fields(m: &[Tlv]) -> Vec<String> {
    let mut out = Vec::new();
    let short = shorthand(m);
    if let Some((name, _)) = short {
        out.push(name.to_string());
    }
    for (id, name) in [
        (oxm::TUNNEL_ID, "tun_id"),
        (oxm::METADATA, "metadata"),
        (oxm::IN_PORT, "in_port"),
        (oxm::IN_PHY_PORT, "in_phy_port"),
    ] {
        put(&mut out, m, id, name);
    }
    out.extend(vlan_fields(m));
    put(&mut out, m, oxm::ETH_SRC, "dl_src");
    put(&mut out, m, oxm::ETH_DST, "dl_dst");
    if short.is_none() {
        put(&mut out, m, oxm::ETH_TYPE, "dl_type");
    }
    let addresses: &[(u8, &str)] = match exact(m, oxm::ETH_TYPE).map(|t| t as u16) {
        Some(ethertype::IPV6) => &[
            (oxm::IPV6_SRC, "ipv6_src"),
            (oxm::IPV6_DST, "ipv6_dst"),
            (oxm::IPV6_FLABEL, "ipv6_label"),
        ],
        Some(ethertype::ARP) => &[
            (oxm::ARP_SPA, "arp_spa"),
            (oxm::ARP_TPA, "arp_tpa"),
            (oxm::ARP_OP, "arp_op"),
            (oxm::ARP_SHA, "arp_sha"),
            (oxm::ARP_THA, "arp_tha"),
        ],
        _ => &[(oxm::IPV4_SRC, "nw_src"), (oxm::IPV4_DST, "nw_dst")],
    };
    for &(id, name) in addresses {
        put(&mut out, m, id, name);
    }
    if !short.is_some_and(|(_, proto)| proto) {
        put(&mut out, m, oxm::IP_PROTO, "nw_proto");
    }
    // Open vSwitch writes the DSCP as the TOS byte's upper six bits.
    if let Some(dscp) = exact(m, oxm::IP_DSCP) {
        out.push(format!("nw_tos={}", dscp << 2));
    }
    for (id, name) in [
        (oxm::IP_ECN, "nw_ecn"),
        (oxm::MPLS_LABEL, "mpls_label"),
        (oxm::MPLS_TC, "mpls_tc"),
        (oxm::MPLS_BOS, "mpls_bos"),
        (oxm::ICMPV4_TYPE, "icmp_type"),
        (oxm::ICMPV4_CODE, "icmp_code"),
        (oxm::ICMPV6_TYPE, "icmp_type"),
        (oxm::ICMPV6_CODE, "icmp_code"),
        (oxm::IPV6_ND_TARGET, "nd_target"),
        (oxm::IPV6_ND_SLL, "nd_sll"),
        (oxm::IPV6_ND_TLL, "nd_tll"),
        (oxm::TCP_SRC, "tp_src"),
        (oxm::TCP_DST, "tp_dst"),
        (oxm::UDP_SRC, "tp_src"),
        (oxm::UDP_DST, "tp_dst"),
        (oxm::SCTP_SRC, "tp_src"),
        (oxm::SCTP_DST, "tp_dst"),
        (oxm::PBB_ISID, "pbb_isid"),
        (oxm::IPV6_EXTHDR, "ipv6_exthdr"),
    ] {
        put(&mut out, m, id, name);
    }
    out
}

/// `dl_vlan`/`dl_vlan_pcp` for a tag's id and priority, `vlan_tci` for what they cannot say.
fn vlan_fields(m: &[Tlv]) -> Vec<String> {
    const PRESENT: u64 = 0x1000;
    let mut out = Vec::new();
    if let Some(t) = find(m, oxm::VLAN_VID) {
        let vid = oxm::be_value(&t.value);
        match t.mask.as_deref().map(oxm::be_value) {
            None if vid & PRESENT != 0 => out.push(format!("dl_vlan={}", vid & 0xfff)),
            None => out.push(format!("vlan_tci={:#06x}/0x1fff", vid)),
            Some(mask) => out.push(format!("vlan_tci={:#06x}/{:#06x}", vid, mask)),
        }
    }
    if let Some(pcp) = exact(m, oxm::VLAN_PCP) {
        out.push(format!("dl_vlan_pcp={pcp}"));
    }
    out
}

/// A field's value (and mask) as Open vSwitch writes it: addresses in their own notation
/// (IP masks of one run of ones as a prefix length), port numbers and small fields in
/// decimal, the rest in hex.
fn value_text(id: u8, value: &[u8], mask: Option<&[u8]>) -> String {
    let v = one_value(id, value);
    match mask {
        None => v,
        Some(mask) => match prefix_len(mask) {
            Some(n) if is_ip(id) => format!("{v}/{n}"),
            _ => format!("{v}/{}", one_value(id, mask)),
        },
    }
}

fn is_ip(id: u8) -> bool {
    matches!(
        id,
        oxm::IPV4_SRC | oxm::IPV4_DST | oxm::ARP_SPA | oxm::ARP_TPA | oxm::IPV6_SRC | oxm::IPV6_DST
    )
}

/// The length of a mask that is one run of ones from its first bit.
fn prefix_len(mask: &[u8]) -> Option<u32> {
    let ones: u32 = mask.iter().map(|b| b.count_ones()).sum();
    let full = ones / 8;
    let is_prefix = mask
        .iter()
        .enumerate()
        .all(|(i, &b)| match (i as u32).cmp(&full) {
            std::cmp::Ordering::Less => b == 0xff,
            std::cmp::Ordering::Equal => b == (0xff00u16 >> (ones % 8)) as u8,
            std::cmp::Ordering::Greater => b == 0,
        });
    is_prefix.then_some(ones)
}

fn one_value(id: u8, b: &[u8]) -> String {
    match (id, b.len()) {
        (_, 6) => b
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<Vec<_>>()
            .join(":"),
        (oxm::IPV4_SRC | oxm::IPV4_DST | oxm::ARP_SPA | oxm::ARP_TPA, 4) => {
            std::net::Ipv4Addr::new(b[0], b[1], b[2], b[3]).to_string()
        }
        (_, 16) => {
            let a: [u8; 16] = b.try_into().unwrap_or([0; 16]);
            std::net::Ipv6Addr::from(a).to_string()
        }
        (oxm::METADATA | oxm::TUNNEL_ID | oxm::IPV6_FLABEL | oxm::PBB_ISID, _) => {
            format!("{:#x}", oxm::be_value(b))
        }
        (oxm::ETH_TYPE | oxm::IPV6_EXTHDR, _) => format!("{:#06x}", oxm::be_value(b)),
        _ => oxm::be_value(b).to_string(),
    }
}

/// The name Open vSwitch gives a field in `set_field:VALUE->NAME`.
fn set_field_name(d: &FieldDef) -> &'static str {
    match d.id {
        oxm::IPV4_SRC => "ip_src",
        oxm::IPV4_DST => "ip_dst",
        oxm::IP_ECN => "nw_ecn",
        oxm::IP_PROTO => "nw_proto",
        oxm::ICMPV4_TYPE => "icmp_type",
        oxm::ICMPV4_CODE => "icmp_code",
        oxm::IPV6_FLABEL => "ipv6_label",
        oxm::IPV6_ND_TARGET => "nd_target",
        oxm::IPV6_ND_SLL => "nd_sll",
        oxm::IPV6_ND_TLL => "nd_tll",
        oxm::TUNNEL_ID => "tun_id",
        _ => d.name,
    }
}

fn port_text(port: u32) -> String {
    match port {
        ofp::PORT_IN_PORT => "IN_PORT".into(),
        ofp::PORT_FLOOD => "FLOOD".into(),
        ofp::PORT_ALL => "ALL".into(),
        p => format!("output:{p}"),
    }
}

fn action_text(a: &Action) -> String {
    match a {
        Action::Output {
            port: ofp::PORT_CONTROLLER,
            max_len,
        } => format!("CONTROLLER:{max_len}"),
        Action::Output { port, .. } => port_text(*port),
        Action::Group(g) => format!("group:{g}"),
        Action::SetQueue(q) => format!("set_queue:{q}"),
        Action::SetField { id, value } => match oxm::field(*id) {
            Some(d) => format!("set_field:{}->{}", one_value(*id, value), set_field_name(d)),
            None => format!("set_field:{}->oxm{id}", oxm::be_value(value)),
        },
        Action::PushVlan(t) => format!("push_vlan:{t:#06x}"),
        Action::PopVlan => "pop_vlan".into(),
        Action::PushMpls(t) => format!("push_mpls:{t:#06x}"),
        Action::PopMpls(t) => format!("pop_mpls:{t:#06x}"),
        Action::PushPbb(t) => format!("push_pbb:{t:#06x}"),
        Action::PopPbb => "pop_pbb".into(),
        Action::SetMplsTtl(t) => format!("set_mpls_ttl({t})"),
        Action::DecMplsTtl => "dec_mpls_ttl".into(),
        Action::SetNwTtl(t) => format!("mod_nw_ttl:{t}"),
        Action::DecNwTtl => "dec_ttl".into(),
        Action::CopyTtlOut => "copy_ttl_out".into(),
        Action::CopyTtlIn => "copy_ttl_in".into(),
    }
}

fn actions_text(actions: &[Action]) -> Vec<String> {
    actions.iter().map(action_text).collect()
}

/// The instructions in Open vSwitch's order; none at all is `drop`.
fn instructions_text(i: &Instructions) -> String {
    let mut parts = Vec::new();
    if let Some(m) = i.meter {
        parts.push(format!("meter:{m}"));
    }
    parts.extend(actions_text(&i.apply));
    if i.clear {
        parts.push("clear_actions".into());
    }
    if let Some(w) = &i.write {
        parts.push(format!("write_actions({})", actions_text(w).join(",")));
    }
    if let Some((value, mask)) = i.metadata {
        if mask == u64::MAX {
            parts.push(format!("write_metadata:{value:#x}"));
        } else {
            parts.push(format!("write_metadata:{value:#x}/{mask:#x}"));
        }
    }
    if let Some(t) = i.goto {
        parts.push(format!("goto_table:{t}"));
    }
    if parts.is_empty() {
        "drop".into()
    } else {
        parts.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tlv(id: u8, value: &[u8], mask: Option<&[u8]>) -> Tlv {
        Tlv {
            id,
            value: value.to_vec(),
            mask: mask.map(<[u8]>::to_vec),
        }
    }

    #[test]
    fn masks_of_one_run_are_prefix_lengths_others_are_written_out() {
        assert_eq!(prefix_len(&[255, 0, 0, 0]), Some(8));
        assert_eq!(prefix_len(&[255, 255, 240, 0]), Some(20));
        assert_eq!(prefix_len(&[255, 0, 255, 0]), None);
        assert_eq!(
            value_text(oxm::IPV4_DST, &[10, 0, 0, 0], Some(&[255, 0, 255, 0])),
            "10.0.0.0/255.0.255.0"
        );
    }

    #[test]
    fn a_flow_reads_as_ovs_ofctl_writes_it() {
        let m = [
            tlv(oxm::IN_PORT, &[0, 0, 0, 1], None),
            tlv(oxm::ETH_TYPE, &ethertype::IPV4.to_be_bytes(), None),
            tlv(oxm::IP_PROTO, &[ip_proto::UDP], None),
            tlv(oxm::UDP_DST, &53u16.to_be_bytes(), None),
        ];
        let i = Instructions {
            apply: vec![Action::output(3)],
            ..Default::default()
        };
        assert_eq!(
            flow_line(0, 0, 40000, &m, &i),
            "priority=40000,udp,in_port=1,tp_dst=53 actions=output:3"
        );
        assert_eq!(
            flow_line(0x12, 1, DEFAULT_PRIORITY, &[], &Instructions::default()),
            "cookie=0x12, table=1, actions=drop"
        );
    }
}
