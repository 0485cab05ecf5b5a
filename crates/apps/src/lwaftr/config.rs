//! Snabb's lwAFTR configuration, read as Snabb writes it: the YANG data text format of
//! `snabb-softwire-v2` (`keyword value;` leaves, `keyword { … }` containers, `//` and `/* */`
//! comments, quoted strings). Every error names its line.

use std::net::{Ipv4Addr, Ipv6Addr};

#[derive(Debug, Clone)]
pub struct Node {
    pub key: String,
    pub value: Option<String>,
    pub children: Vec<Node>,
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err<T>(line: usize, message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError {
        line,
        message: message.into(),
    })
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Word(String),
    Open,
    Close,
    Semi,
}

fn tokenize(text: &str) -> Result<Vec<(Token, usize)>, ConfigError> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let (mut i, mut line) = (0, 1);
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line += 1;
                i += 1;
            }
            c if c.is_ascii_whitespace() => i += 1,
            b'{' => {
                out.push((Token::Open, line));
                i += 1;
            }
            b'}' => {
                out.push((Token::Close, line));
                i += 1;
            }
            b';' => {
                out.push((Token::Semi, line));
                i += 1;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let start = line;
                i += 2;
                loop {
                    if i + 1 >= b.len() {
                        return err(start, "comment `/*` is never closed");
                    }
                    if b[i] == b'\n' {
                        line += 1;
                    }
                    if b[i] == b'*' && b[i + 1] == b'/' {
                        i += 2;
                        break;
                    }
                    i += 1;
                }
            }
            b'"' | b'\'' => {
                let (quote, start) = (c, line);
                let mut s = String::new();
                i += 1;
                loop {
                    match b.get(i) {
                        None => return err(start, "string is never closed"),
                        Some(&q) if q == quote => {
                            i += 1;
                            break;
                        }
                        Some(b'\\') if b.get(i + 1).is_some() => {
                            s.push(b[i + 1] as char);
                            i += 2;
                        }
                        Some(&ch) => {
                            if ch == b'\n' {
                                line += 1;
                            }
                            s.push(ch as char);
                            i += 1;
                        }
                    }
                }
                out.push((Token::Word(s), start));
            }
            _ => {
                let start = i;
                while i < b.len() && !b[i].is_ascii_whitespace() && !b"{};".contains(&b[i]) {
                    i += 1;
                }
                out.push((Token::Word(text[start..i].to_string()), line));
            }
        }
    }
    Ok(out)
}

/// Parses the text into a tree of statements.
pub fn parse_tree(text: &str) -> Result<Vec<Node>, ConfigError> {
    let tokens = tokenize(text)?;
    let mut pos = 0;
    let nodes = statements(&tokens, &mut pos, 0)?;
    if let Some((_, line)) = tokens.get(pos) {
        return err(*line, "`}` without a matching `{`");
    }
    Ok(nodes)
}

fn statements(
    t: &[(Token, usize)],
    pos: &mut usize,
    depth: usize,
) -> Result<Vec<Node>, ConfigError> {
    let mut out = Vec::new();
    while let Some((tok, line)) = t.get(*pos) {
        let line = *line;
        match tok {
            Token::Close if depth > 0 => return Ok(out),
            Token::Close => return err(line, "`}` without a matching `{`"),
            Token::Open | Token::Semi => return err(line, "expected a keyword"),
            Token::Word(key) => {
                *pos += 1;
                let value = match t.get(*pos) {
                    Some((Token::Word(v), _)) => {
                        *pos += 1;
                        Some(v.clone())
                    }
                    _ => None,
                };
                match t.get(*pos) {
                    Some((Token::Semi, _)) => {
                        *pos += 1;
                        out.push(Node {
                            key: key.clone(),
                            value,
                            children: vec![],
                            line,
                        });
                    }
                    Some((Token::Open, open_line)) => {
                        let open_line = *open_line;
                        *pos += 1;
                        let children = statements(t, pos, depth + 1)?;
                        match t.get(*pos) {
                            Some((Token::Close, _)) => *pos += 1,
                            _ => return err(open_line, format!("`{key} {{` is never closed")),
                        }
                        out.push(Node {
                            key: key.clone(),
                            value,
                            children,
                            line,
                        });
                    }
                    Some((_, l)) => return err(*l, format!("`{key}`: expected `;` or `{{`")),
                    None => return err(line, format!("`{key}`: expected `;` or `{{` at the end")),
                }
            }
        }
    }
    if depth > 0 {
        return err(
            t.last().map(|x| x.1).unwrap_or(0),
            "unexpected end: a `}` is missing",
        );
    }
    Ok(out)
}

/// How the next hop of an interface is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextHop {
    Mac([u8; 6]),
    Ipv4(Ipv4Addr),
    Ipv6(Ipv6Addr),
}

/// One side's addresses (from `instance { queue { … } }`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface<A> {
    pub ip: A,
    pub mac: [u8; 6],
    pub vlan: Option<u16>,
    pub next_hop: NextHop,
}

/// One side's policy (`external-interface { … }` / `internal-interface { … }`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub allow_incoming_icmp: bool,
    pub generate_icmp_errors: bool,
    pub error_rate_packets: u32,
    pub error_rate_period_s: u32,
    pub mtu: u16,
    pub max_fragments_per_packet: u32,
    pub max_reassembly_packets: u32,
    /// Internal side only.
    pub hairpinning: bool,
    /// Internal side only.
    pub flow_label: u32,
    /// pflang filter for frames arriving on this side (after reassembly, VLAN tag removed).
    pub ingress_filter: Option<String>,
    /// pflang filter for frames leaving on this side (before fragmentation and tagging).
    pub egress_filter: Option<String>,
}

impl Policy {
    /// The defaults of Snabb's `snabb-softwire-v3` schema for one side: the MTU is 1460 on the
    /// external side and 1500 on the internal one.
    pub fn defaults(internal: bool) -> Policy {
        Policy {
            allow_incoming_icmp: true,
            generate_icmp_errors: true,
            error_rate_packets: 200,
            error_rate_period_s: 2,
            mtu: if internal { 1500 } else { 1460 },
            max_fragments_per_packet: 20,
            max_reassembly_packets: 20_000,
            hairpinning: true,
            flow_label: 0,
            ingress_filter: None,
            egress_filter: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoftwireSpec {
    pub ipv4: Ipv4Addr,
    pub psid: u16,
    pub b4: Ipv6Addr,
    pub br: Ipv6Addr,
    pub psid_length: u8,
    pub reserved_bits: u8,
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queue {
    pub device: String,
    pub id: u32,
    pub external: Interface<Ipv4Addr>,
    pub internal: Interface<Ipv6Addr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LwaftrConfig {
    pub softwires: Vec<SoftwireSpec>,
    pub external: Policy,
    pub internal: Policy,
    pub queues: Vec<Queue>,
}

fn value(n: &Node) -> Result<&str, ConfigError> {
    n.value.as_deref().ok_or_else(|| ConfigError {
        line: n.line,
        message: format!("`{}` needs a value", n.key),
    })
}

fn num<T: std::str::FromStr>(n: &Node, what: &str) -> Result<T, ConfigError> {
    value(n)?.parse().or_else(|_| {
        err(
            n.line,
            format!(
                "`{}`: `{}` is not {what}",
                n.key,
                n.value.as_deref().unwrap_or("")
            ),
        )
    })
}

/// A pflang filter, compiled here once so that an expression libpcap refuses is an error
/// naming its line.
fn filter(n: &Node) -> Result<String, ConfigError> {
    let text = value(n)?;
    stitch_wire::filter::PacketFilter::compile(text).map_err(|e| ConfigError {
        line: n.line,
        message: format!("`{}`: {e}", n.key),
    })?;
    Ok(text.to_string())
}

fn boolean(n: &Node) -> Result<bool, ConfigError> {
    match value(n)? {
        "true" => Ok(true),
        "false" => Ok(false),
        v => err(
            n.line,
            format!("`{}`: `{v}` is neither true nor false", n.key),
        ),
    }
}

fn leaf_only(n: &Node) -> Result<(), ConfigError> {
    if !n.children.is_empty() {
        return err(n.line, format!("`{}` takes a value, not a block", n.key));
    }
    Ok(())
}

fn unknown<T>(n: &Node, inside: &str, known: &str) -> Result<T, ConfigError> {
    err(
        n.line,
        format!("unknown `{}` in {inside} (known: {known})", n.key),
    )
}

fn ip4(n: &Node) -> Result<Ipv4Addr, ConfigError> {
    num(n, "an IPv4 address")
}

fn ip6(n: &Node) -> Result<Ipv6Addr, ConfigError> {
    num(n, "an IPv6 address")
}

fn mac(n: &Node) -> Result<[u8; 6], ConfigError> {
    stitch_wire::parse_mac(value(n)?).or_else(|e| err(n.line, format!("`{}`: {e}", n.key)))
}

fn softwire(n: &Node) -> Result<SoftwireSpec, ConfigError> {
    let (mut ipv4, mut psid, mut b4, mut br) = (None, None, None, None);
    let (mut k, mut a) = (0u8, 0u8);
    for c in &n.children {
        match c.key.as_str() {
            "ipv4" => ipv4 = Some(ip4(c)?),
            "psid" => psid = Some(num::<u16>(c, "a PSID (0..65535)")?),
            "b4-ipv6" => b4 = Some(ip6(c)?),
            "br-address" => br = Some(ip6(c)?),
            "padding" => {}
            "port-set" => {
                for p in &c.children {
                    match p.key.as_str() {
                        "psid-length" => k = num(p, "a PSID length (0..16)")?,
                        "reserved-ports-bit-count" => a = num(p, "a bit count (0..16)")?,
                        _ => {
                            return unknown(p, "port-set", "psid-length, reserved-ports-bit-count")
                        }
                    }
                }
            }
            _ => return unknown(c, "softwire", "ipv4, psid, b4-ipv6, br-address, port-set"),
        }
    }
    let missing = |what: &str| err(n.line, format!("softwire: `{what}` is missing"));
    let Some(ipv4) = ipv4 else {
        return missing("ipv4");
    };
    let Some(b4) = b4 else {
        return missing("b4-ipv6");
    };
    let Some(br) = br else {
        return missing("br-address");
    };
    let psid = psid.unwrap_or(0);
    if k as u32 + a as u32 > 16 {
        return err(
            n.line,
            format!("softwire: psid-length {k} + reserved-ports-bit-count {a} exceeds 16"),
        );
    }
    if (psid as u32) >= 1u32 << k {
        return err(
            n.line,
            format!("softwire: psid {psid} does not fit in psid-length {k}"),
        );
    }
    Ok(SoftwireSpec {
        ipv4,
        psid,
        b4,
        br,
        psid_length: k,
        reserved_bits: a,
        line: n.line,
    })
}

fn policy(n: &Node, internal: bool) -> Result<Policy, ConfigError> {
    let mut p = Policy::defaults(internal);
    let side = if internal {
        "internal-interface"
    } else {
        "external-interface"
    };
    for c in &n.children {
        match c.key.as_str() {
            "allow-incoming-icmp" => p.allow_incoming_icmp = boolean(c)?,
            "generate-icmp-errors" => p.generate_icmp_errors = boolean(c)?,
            "mtu" => p.mtu = num(c, "an MTU")?,
            "hairpinning" if internal => p.hairpinning = boolean(c)?,
            "flow-label" if internal => p.flow_label = num(c, "a flow label")?,
            "ingress-filter" => p.ingress_filter = Some(filter(c)?),
            "egress-filter" => p.egress_filter = Some(filter(c)?),
            "error-rate-limiting" => {
                for e in &c.children {
                    match e.key.as_str() {
                        "packets" => p.error_rate_packets = num(e, "a packet count")?,
                        "period" => p.error_rate_period_s = num(e, "seconds")?,
                        _ => return unknown(e, "error-rate-limiting", "packets, period"),
                    }
                }
            }
            "reassembly" => {
                for e in &c.children {
                    match e.key.as_str() {
                        "max-fragments-per-packet" => p.max_fragments_per_packet = num(e, "a count")?,
                        "max-packets" => p.max_reassembly_packets = num(e, "a count")?,
                        _ => return unknown(e, "reassembly", "max-fragments-per-packet, max-packets"),
                    }
                }
            }
            // Snabb's per-side ip/mac/vlan/next-hop (older layout) are read from `instance`.
            _ => {
                return unknown(
                    c,
                    side,
                    "allow-incoming-icmp, generate-icmp-errors, mtu, error-rate-limiting, reassembly, hairpinning, flow-label, ingress-filter, egress-filter",
                )
            }
        }
    }
    if p.mtu < 576 {
        return err(n.line, format!("{side}: mtu {} is below 576", p.mtu));
    }
    Ok(p)
}

fn interface<A: Copy>(
    n: &Node,
    addr: fn(&Node) -> Result<A, ConfigError>,
) -> Result<Interface<A>, ConfigError> {
    let (mut ip, mut m, mut vlan, mut hop) = (None, None, None, None);
    for c in &n.children {
        match c.key.as_str() {
            "ip" => ip = Some(addr(c)?),
            "mac" => m = Some(mac(c)?),
            "vlan-tag" => {
                let v: u16 = num(c, "a VLAN id")?;
                if !(1..=4094).contains(&v) {
                    return err(c.line, format!("vlan-tag {v} is not 1..4094"));
                }
                vlan = Some(v);
            }
            "next-hop" => {
                for h in &c.children {
                    hop = Some(match h.key.as_str() {
                        "mac" => NextHop::Mac(mac(h)?),
                        "ip" => match value(h)?.parse::<Ipv4Addr>() {
                            Ok(a) => NextHop::Ipv4(a),
                            Err(_) => NextHop::Ipv6(ip6(h)?),
                        },
                        _ => return unknown(h, "next-hop", "mac, ip"),
                    });
                }
            }
            _ => return unknown(c, &n.key, "ip, mac, vlan-tag, next-hop"),
        }
    }
    let missing = |what: &str| err(n.line, format!("{}: `{what}` is missing", n.key));
    let Some(ip) = ip else { return missing("ip") };
    let Some(mac) = m else { return missing("mac") };
    let Some(next_hop) = hop else {
        return missing("next-hop");
    };
    Ok(Interface {
        ip,
        mac,
        vlan,
        next_hop,
    })
}

/// Reads a configuration text.
pub fn parse(text: &str) -> Result<LwaftrConfig, ConfigError> {
    let tree = parse_tree(text)?;
    let root = match tree.as_slice() {
        [n] if n.key == "softwire-config" => n,
        [n, ..] => {
            return err(
                n.line,
                format!("expected `softwire-config {{ … }}`, found `{}`", n.key),
            )
        }
        [] => return err(1, "the file is empty: expected `softwire-config { … }`"),
    };
    let mut cfg = LwaftrConfig {
        softwires: vec![],
        external: Policy::defaults(false),
        internal: Policy::defaults(true),
        queues: vec![],
    };
    for n in &root.children {
        match n.key.as_str() {
            "binding-table" => {
                for s in &n.children {
                    match s.key.as_str() {
                        "softwire" => cfg.softwires.push(softwire(s)?),
                        _ => return unknown(s, "binding-table", "softwire"),
                    }
                }
            }
            "external-interface" => cfg.external = policy(n, false)?,
            "internal-interface" => cfg.internal = policy(n, true)?,
            "instance" => {
                let mut device = String::new();
                for c in &n.children {
                    match c.key.as_str() {
                        "device" => {
                            leaf_only(c)?;
                            device = value(c)?.to_string();
                        }
                        "queue" => {
                            let (mut id, mut ext, mut int) = (0u32, None, None);
                            for q in &c.children {
                                match q.key.as_str() {
                                    "id" => id = num(q, "a queue id")?,
                                    "external-interface" => ext = Some(interface(q, ip4)?),
                                    "internal-interface" => int = Some(interface(q, ip6)?),
                                    _ => {
                                        return unknown(
                                            q,
                                            "queue",
                                            "id, external-interface, internal-interface",
                                        )
                                    }
                                }
                            }
                            let (Some(external), Some(internal)) = (ext, int) else {
                                return err(c.line, "queue: both external-interface and internal-interface are needed");
                            };
                            if matches!(external.next_hop, NextHop::Ipv6(_))
                                || matches!(internal.next_hop, NextHop::Ipv4(_))
                            {
                                return err(
                                    c.line,
                                    "queue: the external next hop is IPv4, the internal one IPv6",
                                );
                            }
                            cfg.queues.push(Queue {
                                device: device.clone(),
                                id,
                                external,
                                internal,
                            });
                        }
                        _ => return unknown(c, "instance", "device, queue"),
                    }
                }
            }
            _ => {
                return unknown(
                    n,
                    "softwire-config",
                    "binding-table, external-interface, internal-interface, instance",
                )
            }
        }
    }
    if cfg.queues.is_empty() {
        return err(
            root.line,
            "no `instance { queue { … } }`: the interfaces' addresses are missing",
        );
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_shared_snabb_configurations() {
        for f in ["icmp_on_fail.conf", "tunnel_icmp_withoutmac.conf"] {
            let path = format!("{}/../../../shared/lwaftr/{f}", env!("CARGO_MANIFEST_DIR"));
            let Ok(text) = std::fs::read_to_string(&path) else {
                // The shared folder is beside the repository on development machines only;
                // tests/data holds a copy for CI.
                continue;
            };
            let c = parse(&text).unwrap();
            assert_eq!(c.softwires.len(), 12);
            assert_eq!(
                c.external.allow_incoming_icmp,
                f == "tunnel_icmp_withoutmac.conf"
            );
            assert_eq!(c.queues[0].external.ip, Ipv4Addr::new(10, 10, 10, 10));
        }
        let c = parse(include_str!("../../tests/data/icmp_on_fail.conf")).unwrap();
        assert_eq!(c.softwires.len(), 12);
        assert_eq!(c.softwires[0].psid_length, 6);
        assert_eq!(c.external.error_rate_packets, 600_000);
        assert_eq!(c.internal.max_fragments_per_packet, 40);
        assert_eq!(c.queues[0].internal.next_hop, NextHop::Mac([0x44; 6]));
        let c = parse(include_str!("../../tests/data/tunnel_icmp_withoutmac.conf")).unwrap();
        assert_eq!(
            c.queues[0].internal.next_hop,
            NextHop::Ipv6("8:9:a:b:4:3:2:1".parse().unwrap())
        );
        assert!(c.external.allow_incoming_icmp);
    }

    #[test]
    fn errors_name_the_line() {
        let e = |t: &str| parse(t).unwrap_err();
        assert_eq!(e("softwire-config {\n  binding-table {\n").line, 2);
        let x = e("softwire-config {\n  binding-table {\n    softwire { ipv4 1.2.3; }\n  }\n}\n");
        assert_eq!(x.line, 3);
        assert!(x.message.contains("not an IPv4 address"), "{x}");
        let x = e("softwire-config {\n  colour blue;\n}\n");
        assert_eq!((x.line, x.message.contains("unknown `colour`")), (2, true));
        let x = e("softwire-config {\n binding-table { softwire { ipv4 1.2.3.4; psid 70; b4-ipv6 ::1; br-address ::2; port-set { psid-length 6; } } }\n}\n");
        assert!(x.message.contains("does not fit"), "{x}");
        let x = e("/* unterminated\nsoftwire-config {}");
        assert_eq!(x.line, 1);
    }
}
