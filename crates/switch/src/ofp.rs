//! OpenFlow 1.3 (wire version 0x04): the messages a switch receives, read from the bytes with
//! every length checked, and the replies it writes. A malformed message is an [`OfError`]
//! (OpenFlow error type and code), answered with an ERROR message — never a panic.

pub const VERSION: u8 = 0x04;

pub const HELLO: u8 = 0;
pub const ERROR: u8 = 1;
pub const ECHO_REQUEST: u8 = 2;
pub const ECHO_REPLY: u8 = 3;
pub const FEATURES_REQUEST: u8 = 5;
pub const FEATURES_REPLY: u8 = 6;
pub const GET_CONFIG_REQUEST: u8 = 7;
pub const GET_CONFIG_REPLY: u8 = 8;
pub const SET_CONFIG: u8 = 9;
pub const PACKET_IN: u8 = 10;
pub const PACKET_OUT: u8 = 13;
pub const FLOW_MOD: u8 = 14;
pub const MULTIPART_REQUEST: u8 = 18;
pub const MULTIPART_REPLY: u8 = 19;
pub const BARRIER_REQUEST: u8 = 20;
pub const BARRIER_REPLY: u8 = 21;

pub const MP_DESC: u16 = 0;
pub const MP_FLOW: u16 = 1;
pub const MP_AGGREGATE: u16 = 2;
pub const MP_TABLE: u16 = 3;
pub const MP_PORT_STATS: u16 = 4;
pub const MP_TABLE_FEATURES: u16 = 12;
pub const MP_PORT_DESC: u16 = 13;

pub const PORT_IN_PORT: u32 = 0xffff_fff8;
pub const PORT_FLOOD: u32 = 0xffff_fffb;
pub const PORT_ALL: u32 = 0xffff_fffc;
pub const PORT_CONTROLLER: u32 = 0xffff_fffd;
pub const PORT_ANY: u32 = 0xffff_ffff;
pub const NO_BUFFER: u32 = 0xffff_ffff;

/// An OpenFlow error: type and code (OpenFlow 1.3 §A.4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OfError(pub u16, pub u16);

pub const BAD_REQUEST_VERSION: OfError = OfError(1, 0);
pub const BAD_REQUEST_TYPE: OfError = OfError(1, 1);
pub const BAD_REQUEST_MULTIPART: OfError = OfError(1, 2);
pub const BAD_REQUEST_LEN: OfError = OfError(1, 6);
pub const BAD_REQUEST_BUFFER_UNKNOWN: OfError = OfError(1, 8);
pub const BAD_ACTION_TYPE: OfError = OfError(2, 0);
pub const BAD_ACTION_LEN: OfError = OfError(2, 1);
pub const BAD_ACTION_OUT_PORT: OfError = OfError(2, 4);
pub const BAD_ACTION_ARGUMENT: OfError = OfError(2, 5);
pub const BAD_INSTRUCTION_UNSUPPORTED: OfError = OfError(3, 1);
pub const BAD_INSTRUCTION_LEN: OfError = OfError(3, 6);
pub const BAD_MATCH_TYPE: OfError = OfError(4, 0);
pub const BAD_MATCH_LEN: OfError = OfError(4, 1);
pub const BAD_MATCH_FIELD: OfError = OfError(4, 6);
pub const FLOW_MOD_BAD_TABLE: OfError = OfError(5, 2);
pub const FLOW_MOD_BAD_COMMAND: OfError = OfError(5, 6);

type R<T> = Result<T, OfError>;

#[inline]
fn u16_at(b: &[u8], at: usize) -> R<u16> {
    b.get(at..at + 2)
        .map(|x| u16::from_be_bytes([x[0], x[1]]))
        .ok_or(BAD_REQUEST_LEN)
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> R<u32> {
    b.get(at..at + 4)
        .map(|x| u32::from_be_bytes(x.try_into().unwrap()))
        .ok_or(BAD_REQUEST_LEN)
}

#[inline]
fn u64_at(b: &[u8], at: usize) -> R<u64> {
    b.get(at..at + 8)
        .map(|x| u64::from_be_bytes(x.try_into().unwrap()))
        .ok_or(BAD_REQUEST_LEN)
}

/// One message's header, checked: the bytes hold the whole message.
pub struct Msg<'a> {
    pub version: u8,
    pub kind: u8,
    pub xid: u32,
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

/// Splits the next message off `buf`: `Ok(None)` when more bytes are needed.
pub fn next_message(buf: &[u8]) -> R<Option<(Msg<'_>, usize)>> {
    if buf.len() < 8 {
        return Ok(None);
    }
    let len = u16::from_be_bytes([buf[2], buf[3]]) as usize;
    if len < 8 {
        return Err(BAD_REQUEST_LEN);
    }
    if buf.len() < len {
        return Ok(None);
    }
    Ok(Some((
        Msg {
            version: buf[0],
            kind: buf[1],
            xid: u32::from_be_bytes(buf[4..8].try_into().unwrap()),
            bytes: &buf[..len],
        },
        len,
    )))
}

/// Starts a message: header with the length fixed up by [`finish`].
pub fn start(kind: u8, xid: u32) -> Vec<u8> {
    let mut m = vec![VERSION, kind, 0, 0];
    m.extend_from_slice(&xid.to_be_bytes());
    m
}

pub fn finish(mut m: Vec<u8>) -> Vec<u8> {
    let n = m.len() as u16;
    m[2..4].copy_from_slice(&n.to_be_bytes());
    m
}

pub fn error(e: OfError, offending: &[u8]) -> Vec<u8> {
    let xid = offending
        .get(4..8)
        .map(|x| u32::from_be_bytes(x.try_into().unwrap()))
        .unwrap_or(0);
    let mut m = start(ERROR, xid);
    m.extend_from_slice(&e.0.to_be_bytes());
    m.extend_from_slice(&e.1.to_be_bytes());
    m.extend_from_slice(&offending[..offending.len().min(64)]);
    finish(m)
}

pub fn hello() -> Vec<u8> {
    let mut m = start(HELLO, 0);
    // Version bitmap element: OpenFlow 1.3 only.
    m.extend_from_slice(&[0, 1, 0, 8, 0, 0, 0, 1 << VERSION]);
    finish(m)
}

/// Whether a HELLO accepts OpenFlow 1.3 (its version, or its version bitmap).
pub fn hello_accepts_13(m: &Msg) -> bool {
    let mut at = 8;
    while at + 4 <= m.bytes.len() {
        let (t, len) = (
            u16::from_be_bytes([m.bytes[at], m.bytes[at + 1]]),
            u16::from_be_bytes([m.bytes[at + 2], m.bytes[at + 3]]) as usize,
        );
        if len < 4 {
            break;
        }
        if t == 1 && at + 8 <= m.bytes.len() {
            let bitmap = u32::from_be_bytes(m.bytes[at + 4..at + 8].try_into().unwrap());
            return bitmap & (1 << VERSION) != 0;
        }
        at += len.div_ceil(8) * 8;
    }
    m.version >= VERSION
}

/// What a flow matches: `None` fields are wildcards; masked fields keep their mask.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    pub in_port: Option<u32>,
    pub eth_dst: Option<([u8; 6], [u8; 6])>,
    pub eth_src: Option<([u8; 6], [u8; 6])>,
    pub eth_type: Option<u16>,
    /// VLAN id with the OFPVID_PRESENT bit (0x1000), and its mask.
    pub vlan_vid: Option<(u16, u16)>,
    pub ip_proto: Option<u8>,
    pub ipv4_src: Option<(u32, u32)>,
    pub ipv4_dst: Option<(u32, u32)>,
    pub tp_src: Option<u16>,
    pub tp_dst: Option<u16>,
    pub ipv6_src: Option<(u128, u128)>,
    pub ipv6_dst: Option<(u128, u128)>,
}

const OXM_BASIC: u16 = 0x8000;

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    b[..N].try_into().unwrap()
}

/// Reads an `ofp_match` at `b[at..]`; returns it and the padded length it takes.
pub fn parse_match(b: &[u8], at: usize) -> R<(Match, usize)> {
    let t = u16_at(b, at)?;
    let len = u16_at(b, at + 2)? as usize;
    if t != 1 {
        return Err(BAD_MATCH_TYPE);
    }
    if len < 4 || at + len > b.len() {
        return Err(BAD_MATCH_LEN);
    }
    let mut m = Match::default();
    let mut i = at + 4;
    while i + 4 <= at + len {
        let class = u16_at(b, i)?;
        let (field, has_mask, l) = (b[i + 2] >> 1, b[i + 2] & 1 == 1, b[i + 3] as usize);
        let v = b.get(i + 4..i + 4 + l).ok_or(BAD_MATCH_LEN)?;
        if i + 4 + l > at + len {
            return Err(BAD_MATCH_LEN);
        }
        if class != OXM_BASIC {
            return Err(BAD_MATCH_FIELD);
        }
        let half = |n: usize| -> R<(&[u8], Option<&[u8]>)> {
            match (has_mask, l) {
                (false, x) if x == n => Ok((v, None)),
                (true, x) if x == 2 * n => Ok((&v[..n], Some(&v[n..]))),
                _ => Err(BAD_MATCH_LEN),
            }
        };
        match field {
            0 => m.in_port = Some(u32_at(half(4)?.0, 0)?),
            3 | 4 => {
                let (val, mask) = half(6)?;
                let e = Some((arr::<6>(val), mask.map(arr::<6>).unwrap_or([0xff; 6])));
                if field == 3 {
                    m.eth_dst = e
                } else {
                    m.eth_src = e
                }
            }
            5 => m.eth_type = Some(u16_at(half(2)?.0, 0)?),
            6 => {
                let (val, mask) = half(2)?;
                m.vlan_vid = Some((
                    u16_at(val, 0)?,
                    mask.map(|x| u16_at(x, 0)).transpose()?.unwrap_or(0x1fff),
                ));
            }
            10 => m.ip_proto = Some(half(1)?.0[0]),
            11 | 12 => {
                let (val, mask) = half(4)?;
                let e = Some((
                    u32_at(val, 0)?,
                    mask.map(|x| u32_at(x, 0)).transpose()?.unwrap_or(u32::MAX),
                ));
                if field == 11 {
                    m.ipv4_src = e
                } else {
                    m.ipv4_dst = e
                }
            }
            13 | 15 => m.tp_src = Some(u16_at(half(2)?.0, 0)?),
            14 | 16 => m.tp_dst = Some(u16_at(half(2)?.0, 0)?),
            26 | 27 => {
                let (val, mask) = half(16)?;
                let e = Some((
                    u128::from_be_bytes(arr::<16>(val)),
                    mask.map(|x| u128::from_be_bytes(arr::<16>(x)))
                        .unwrap_or(u128::MAX),
                ));
                if field == 26 {
                    m.ipv6_src = e
                } else {
                    m.ipv6_dst = e
                }
            }
            _ => return Err(BAD_MATCH_FIELD),
        }
        i += 4 + l;
    }
    Ok((m, len.div_ceil(8) * 8))
}

fn oxm(out: &mut Vec<u8>, field: u8, value: &[u8], mask: Option<&[u8]>) {
    out.extend_from_slice(&OXM_BASIC.to_be_bytes());
    out.push(field << 1 | mask.is_some() as u8);
    out.push((value.len() + mask.map_or(0, <[u8]>::len)) as u8);
    out.extend_from_slice(value);
    if let Some(m) = mask {
        out.extend_from_slice(m);
    }
}

/// Writes an `ofp_match` (padded to 8 bytes).
pub fn write_match(out: &mut Vec<u8>, m: &Match) {
    let start = out.len();
    out.extend_from_slice(&[0, 1, 0, 0]);
    if let Some(p) = m.in_port {
        oxm(out, 0, &p.to_be_bytes(), None);
    }
    for (field, e) in [(3u8, &m.eth_dst), (4, &m.eth_src)] {
        if let Some((v, mask)) = e {
            oxm(out, field, v, (*mask != [0xff; 6]).then_some(&mask[..]));
        }
    }
    if let Some(t) = m.eth_type {
        oxm(out, 5, &t.to_be_bytes(), None);
    }
    if let Some((v, mask)) = m.vlan_vid {
        oxm(
            out,
            6,
            &v.to_be_bytes(),
            (mask != 0x1fff).then_some(&mask.to_be_bytes()[..]),
        );
    }
    if let Some(p) = m.ip_proto {
        oxm(out, 10, &[p], None);
    }
    for (field, e) in [(11u8, &m.ipv4_src), (12, &m.ipv4_dst)] {
        if let Some((v, mask)) = e {
            oxm(
                out,
                field,
                &v.to_be_bytes(),
                (*mask != u32::MAX).then_some(&mask.to_be_bytes()[..]),
            );
        }
    }
    // Transport ports are written as the field of the matched protocol.
    let (src, dst) = if m.ip_proto == Some(17) {
        (15, 16)
    } else {
        (13, 14)
    };
    if let Some(p) = m.tp_src {
        oxm(out, src, &p.to_be_bytes(), None);
    }
    if let Some(p) = m.tp_dst {
        oxm(out, dst, &p.to_be_bytes(), None);
    }
    for (field, e) in [(26u8, &m.ipv6_src), (27, &m.ipv6_dst)] {
        if let Some((v, mask)) = e {
            oxm(
                out,
                field,
                &v.to_be_bytes(),
                (*mask != u128::MAX).then_some(&mask.to_be_bytes()[..]),
            );
        }
    }
    let len = (out.len() - start) as u16;
    out[start + 2..start + 4].copy_from_slice(&len.to_be_bytes());
    while !(out.len() - start).is_multiple_of(8) {
        out.push(0);
    }
}

/// What a flow does with a packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Output(u32),
    PushVlan(u16),
    PopVlan,
    SetEthDst([u8; 6]),
    SetEthSrc([u8; 6]),
    /// VLAN id with OFPVID_PRESENT.
    SetVlanVid(u16),
}

/// Reads an action list.
pub fn parse_actions(b: &[u8]) -> R<Vec<Action>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let t = u16_at(b, i)?;
        let len = u16_at(b, i + 2)? as usize;
        if len < 8 || !len.is_multiple_of(8) || i + len > b.len() {
            return Err(BAD_ACTION_LEN);
        }
        let a = &b[i..i + len];
        out.push(match t {
            0 => {
                let port = u32_at(a, 4)?;
                if port == 0
                    || (port > 0xffff_ff00
                        && ![PORT_IN_PORT, PORT_FLOOD, PORT_ALL, PORT_CONTROLLER].contains(&port))
                {
                    return Err(BAD_ACTION_OUT_PORT);
                }
                Action::Output(port)
            }
            17 => {
                let et = u16_at(a, 4)?;
                if et != 0x8100 && et != 0x88a8 {
                    return Err(BAD_ACTION_ARGUMENT);
                }
                Action::PushVlan(et)
            }
            18 => Action::PopVlan,
            25 => {
                let (field, l) = (
                    a.get(6).ok_or(BAD_ACTION_LEN)? >> 1,
                    *a.get(7).ok_or(BAD_ACTION_LEN)? as usize,
                );
                let v = a.get(8..8 + l).ok_or(BAD_ACTION_LEN)?;
                match (field, l) {
                    (3, 6) => Action::SetEthDst(arr(v)),
                    (4, 6) => Action::SetEthSrc(arr(v)),
                    (6, 2) => Action::SetVlanVid(u16::from_be_bytes([v[0], v[1]])),
                    _ => return Err(BAD_ACTION_ARGUMENT),
                }
            }
            _ => return Err(BAD_ACTION_TYPE),
        });
        i += len;
    }
    Ok(out)
}

pub fn write_actions(out: &mut Vec<u8>, actions: &[Action]) {
    for a in actions {
        match a {
            Action::Output(p) => {
                out.extend_from_slice(&[0, 0, 0, 16]);
                out.extend_from_slice(&p.to_be_bytes());
                out.extend_from_slice(&0xffffu16.to_be_bytes());
                out.extend_from_slice(&[0; 6]);
            }
            Action::PushVlan(et) => {
                out.extend_from_slice(&[0, 17, 0, 8]);
                out.extend_from_slice(&et.to_be_bytes());
                out.extend_from_slice(&[0, 0]);
            }
            Action::PopVlan => out.extend_from_slice(&[0, 18, 0, 8, 0, 0, 0, 0]),
            Action::SetEthDst(m) | Action::SetEthSrc(m) => {
                let field = if matches!(a, Action::SetEthDst(_)) {
                    3
                } else {
                    4
                };
                out.extend_from_slice(&[0, 25, 0, 16]);
                oxm(out, field, m, None);
                out.extend_from_slice(&[0; 2]);
            }
            Action::SetVlanVid(v) => {
                out.extend_from_slice(&[0, 25, 0, 16]);
                oxm(out, 6, &v.to_be_bytes(), None);
                out.extend_from_slice(&[0; 6]);
            }
        }
    }
}

/// Reads instructions: apply-actions and write-actions (both applied at once: one table, no
/// action set to carry) and clear-actions; goto-table, meters and metadata are refused.
pub fn parse_instructions(b: &[u8]) -> R<Vec<Action>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let t = u16_at(b, i)?;
        let len = u16_at(b, i + 2)? as usize;
        if len < 8 || i + len > b.len() {
            return Err(BAD_INSTRUCTION_LEN);
        }
        match t {
            3 | 4 => out.extend(parse_actions(&b[i + 8..i + len])?),
            5 => out.clear(),
            _ => return Err(BAD_INSTRUCTION_UNSUPPORTED),
        }
        i += len;
    }
    Ok(out)
}

pub fn write_instructions(out: &mut Vec<u8>, actions: &[Action]) {
    if actions.is_empty() {
        return;
    }
    let start = out.len();
    out.extend_from_slice(&[0, 4, 0, 0, 0, 0, 0, 0]);
    write_actions(out, actions);
    let len = (out.len() - start) as u16;
    out[start + 2..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// A FLOW_MOD, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowMod {
    pub cookie: u64,
    pub cookie_mask: u64,
    pub table_id: u8,
    pub command: u8,
    pub idle_timeout: u16,
    pub hard_timeout: u16,
    pub priority: u16,
    pub out_port: u32,
    pub flags: u16,
    pub matching: Match,
    pub actions: Vec<Action>,
}

pub fn parse_flow_mod(b: &[u8]) -> R<FlowMod> {
    let (matching, mlen) = parse_match(b, 48)?;
    let command = *b.get(25).ok_or(BAD_REQUEST_LEN)?;
    if command > 4 {
        return Err(FLOW_MOD_BAD_COMMAND);
    }
    let table_id = b[24];
    if table_id != 0 && !(command >= 3 && table_id == 0xff) {
        return Err(FLOW_MOD_BAD_TABLE);
    }
    Ok(FlowMod {
        cookie: u64_at(b, 8)?,
        cookie_mask: u64_at(b, 16)?,
        table_id,
        command,
        idle_timeout: u16_at(b, 26)?,
        hard_timeout: u16_at(b, 28)?,
        priority: u16_at(b, 30)?,
        out_port: u32_at(b, 36)?,
        flags: u16_at(b, 44)?,
        matching,
        actions: parse_instructions(b.get(48 + mlen..).ok_or(BAD_REQUEST_LEN)?)?,
    })
}

/// A PACKET_OUT, read: the in-port, the actions and the frame.
pub fn parse_packet_out(b: &[u8]) -> R<(u32, Vec<Action>, &[u8])> {
    let buffer = u32_at(b, 8)?;
    if buffer != NO_BUFFER {
        return Err(BAD_REQUEST_BUFFER_UNKNOWN);
    }
    let in_port = u32_at(b, 12)?;
    let alen = u16_at(b, 16)? as usize;
    let actions = parse_actions(b.get(24..24 + alen).ok_or(BAD_REQUEST_LEN)?)?;
    Ok((in_port, actions, &b[24 + alen..]))
}

pub fn u16_field(b: &[u8], at: usize) -> R<u16> {
    u16_at(b, at)
}

pub fn u32_field(b: &[u8], at: usize) -> R<u32> {
    u32_at(b, at)
}

pub fn u64_field(b: &[u8], at: usize) -> R<u64> {
    u64_at(b, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_and_actions_round_trip() {
        let m = Match {
            in_port: Some(3),
            eth_dst: Some(([2, 0, 0, 0, 0, 1], [0xff; 6])),
            eth_type: Some(0x0800),
            ip_proto: Some(17),
            ipv4_dst: Some((0x0a00_0000, 0xff00_0000)),
            tp_dst: Some(53),
            vlan_vid: Some((0x1000 | 10, 0x1fff)),
            ..Match::default()
        };
        let mut b = vec![0; 48];
        write_match(&mut b, &m);
        let (back, len) = parse_match(&b, 48).unwrap();
        assert_eq!(back, m);
        assert_eq!(len % 8, 0);
        let acts = vec![
            Action::PushVlan(0x8100),
            Action::SetVlanVid(0x1000 | 20),
            Action::SetEthDst([2, 0, 0, 0, 0, 9]),
            Action::Output(2),
            Action::PopVlan,
            Action::Output(PORT_CONTROLLER),
        ];
        let mut a = Vec::new();
        write_actions(&mut a, &acts);
        assert_eq!(parse_actions(&a).unwrap(), acts);
    }

    #[test]
    fn damaged_messages_are_errors() {
        assert_eq!(
            next_message(&[4, 0, 0, 3, 0, 0, 0, 0]).err(),
            Some(BAD_REQUEST_LEN)
        );
        assert!(next_message(&[4, 0, 0, 16, 0, 0, 0, 0]).unwrap().is_none());
        assert_eq!(parse_match(&[0, 1, 0, 200], 0).err(), Some(BAD_MATCH_LEN));
        assert_eq!(parse_actions(&[0, 0, 0, 3]).err(), Some(BAD_ACTION_LEN));
        assert_eq!(
            parse_actions(&[0, 99, 0, 8, 0, 0, 0, 0]).err(),
            Some(BAD_ACTION_TYPE)
        );
        assert_eq!(
            parse_instructions(&[0, 1, 0, 8, 1, 0, 0, 0]).err(),
            Some(BAD_INSTRUCTION_UNSUPPORTED)
        );
    }
}
