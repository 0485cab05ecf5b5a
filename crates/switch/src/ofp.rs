//! OpenFlow 1.3 (wire version 0x04): the messages a switch receives, read from the bytes with
//! every length checked, and the replies it writes. A malformed message is an [`OfError`]
//! (OpenFlow error type and code), answered with an ERROR message — never a panic.

use stitch_wire::be::{self, Put};

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
pub const FEATURES_REPLY_CAPABILITIES: u32 = 1 | 2 | 4 | 8 | 0x20;
pub const EXPERIMENTER: u8 = 4;
pub const FLOW_REMOVED: u8 = 11;
pub const PORT_STATUS: u8 = 12;
pub const PORT_MOD: u8 = 16;
pub const TABLE_MOD: u8 = 17;
pub const GROUP_MOD: u8 = 15;
pub const QUEUE_GET_CONFIG_REQUEST: u8 = 22;
pub const QUEUE_GET_CONFIG_REPLY: u8 = 23;
pub const ROLE_REQUEST: u8 = 24;
pub const ROLE_REPLY: u8 = 25;
pub const GET_ASYNC_REQUEST: u8 = 26;
pub const GET_ASYNC_REPLY: u8 = 27;
pub const SET_ASYNC: u8 = 28;
pub const METER_MOD: u8 = 29;

/// The controller messages that change or read the pipeline, with bodies worth fuzzing.
pub const PIPELINE_MESSAGES: [u8; 7] = [
    FLOW_MOD,
    GROUP_MOD,
    METER_MOD,
    PACKET_OUT,
    ROLE_REQUEST,
    SET_ASYNC,
    MULTIPART_REQUEST,
];

pub const MP_DESC: u16 = 0;
pub const MP_FLOW: u16 = 1;
pub const MP_AGGREGATE: u16 = 2;
pub const MP_TABLE: u16 = 3;
pub const MP_PORT_STATS: u16 = 4;
pub const MP_QUEUE: u16 = 5;
pub const MP_GROUP: u16 = 6;
pub const MP_GROUP_DESC: u16 = 7;
pub const MP_GROUP_FEATURES: u16 = 8;
pub const MP_METER: u16 = 9;
pub const MP_METER_CONFIG: u16 = 10;
pub const MP_METER_FEATURES: u16 = 11;
pub const MP_TABLE_FEATURES: u16 = 12;
pub const MP_PORT_DESC: u16 = 13;

pub const PORT_MAX: u32 = 0xffff_ff00;
pub const PORT_IN_PORT: u32 = 0xffff_fff8;
pub const PORT_FLOOD: u32 = 0xffff_fffb;
pub const PORT_ALL: u32 = 0xffff_fffc;
pub const PORT_CONTROLLER: u32 = 0xffff_fffd;
pub const PORT_ANY: u32 = 0xffff_ffff;
pub const NO_BUFFER: u32 = 0xffff_ffff;
pub const TABLE_ALL: u8 = 0xff;
pub const GROUP_MAX: u32 = 0xffff_ff00;
pub const GROUP_ALL: u32 = 0xffff_fffc;
pub const GROUP_ANY: u32 = 0xffff_ffff;
pub const METER_MAX: u32 = 0xffff_0000;
pub const METER_ALL: u32 = 0xffff_ffff;

/// An OpenFlow error: type and code (OpenFlow 1.3 §A.4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OfError(pub u16, pub u16);

pub const BAD_REQUEST_VERSION: OfError = OfError(1, 0);
pub const BAD_REQUEST_TYPE: OfError = OfError(1, 1);
pub const BAD_REQUEST_MULTIPART: OfError = OfError(1, 2);
pub const BAD_REQUEST_EXPERIMENTER: OfError = OfError(1, 3);
pub const BAD_REQUEST_LEN: OfError = OfError(1, 6);
pub const BAD_REQUEST_BUFFER_UNKNOWN: OfError = OfError(1, 8);
pub const BAD_REQUEST_TABLE_ID: OfError = OfError(1, 9);
pub const BAD_REQUEST_IS_SLAVE: OfError = OfError(1, 10);
pub const BAD_REQUEST_BAD_PORT: OfError = OfError(1, 11);
pub const BAD_ACTION_TYPE: OfError = OfError(2, 0);
pub const BAD_ACTION_LEN: OfError = OfError(2, 1);
pub const BAD_ACTION_OUT_PORT: OfError = OfError(2, 4);
pub const BAD_ACTION_ARGUMENT: OfError = OfError(2, 5);
pub const BAD_ACTION_OUT_GROUP: OfError = OfError(2, 9);
pub const BAD_SET_TYPE: OfError = OfError(2, 13);
pub const BAD_SET_LEN: OfError = OfError(2, 14);
pub const BAD_SET_ARGUMENT: OfError = OfError(2, 15);
pub const BAD_INSTRUCTION_UNKNOWN: OfError = OfError(3, 0);
pub const BAD_INSTRUCTION_UNSUPPORTED: OfError = OfError(3, 1);
pub const BAD_INSTRUCTION_TABLE_ID: OfError = OfError(3, 2);
pub const BAD_INSTRUCTION_EXPERIMENTER: OfError = OfError(3, 5);
pub const BAD_INSTRUCTION_LEN: OfError = OfError(3, 7);
pub const BAD_MATCH_TYPE: OfError = OfError(4, 0);
pub const BAD_MATCH_LEN: OfError = OfError(4, 1);
pub const BAD_MATCH_WILDCARDS: OfError = OfError(4, 5);
pub const BAD_MATCH_FIELD: OfError = OfError(4, 6);
pub const BAD_MATCH_VALUE: OfError = OfError(4, 7);
pub const BAD_MATCH_MASK: OfError = OfError(4, 8);
pub const BAD_MATCH_PREREQ: OfError = OfError(4, 9);
pub const BAD_MATCH_DUP_FIELD: OfError = OfError(4, 10);
pub const FLOW_MOD_BAD_TABLE: OfError = OfError(5, 2);
pub const FLOW_MOD_OVERLAP: OfError = OfError(5, 3);
pub const FLOW_MOD_BAD_COMMAND: OfError = OfError(5, 6);
pub const FLOW_MOD_BAD_FLAGS: OfError = OfError(5, 7);
pub const GROUP_MOD_EXISTS: OfError = OfError(6, 0);
pub const GROUP_MOD_INVALID_GROUP: OfError = OfError(6, 1);
pub const GROUP_MOD_WEIGHT_UNSUPPORTED: OfError = OfError(6, 2);
pub const GROUP_MOD_OUT_OF_GROUPS: OfError = OfError(6, 3);
pub const GROUP_MOD_OUT_OF_BUCKETS: OfError = OfError(6, 4);
pub const GROUP_MOD_LOOP: OfError = OfError(6, 7);
pub const GROUP_MOD_UNKNOWN: OfError = OfError(6, 8);
pub const GROUP_MOD_CHAINED_UNKNOWN: OfError = OfError(6, 8);
pub const GROUP_MOD_BAD_TYPE: OfError = OfError(6, 10);
pub const GROUP_MOD_BAD_COMMAND: OfError = OfError(6, 11);
pub const GROUP_MOD_BAD_BUCKET: OfError = OfError(6, 12);
pub const GROUP_MOD_BAD_WATCH: OfError = OfError(6, 13);
pub const PORT_MOD_BAD_PORT: OfError = OfError(7, 0);
pub const TABLE_MOD_BAD_TABLE: OfError = OfError(8, 0);
pub const ROLE_REQUEST_STALE: OfError = OfError(11, 0);
pub const ROLE_REQUEST_BAD_ROLE: OfError = OfError(11, 2);
pub const METER_MOD_EXISTS: OfError = OfError(12, 1);
pub const METER_MOD_INVALID_METER: OfError = OfError(12, 2);
pub const METER_MOD_UNKNOWN_METER: OfError = OfError(12, 3);
pub const METER_MOD_BAD_COMMAND: OfError = OfError(12, 4);
pub const METER_MOD_BAD_FLAGS: OfError = OfError(12, 5);
pub const METER_MOD_BAD_RATE: OfError = OfError(12, 6);
pub const METER_MOD_BAD_BAND: OfError = OfError(12, 8);
pub const METER_MOD_OUT_OF_METERS: OfError = OfError(12, 10);
pub const METER_MOD_OUT_OF_BANDS: OfError = OfError(12, 11);

type R<T> = Result<T, OfError>;

#[inline]
fn u16_at(b: &[u8], at: usize) -> R<u16> {
    b.get(at..at + 2)
        .map(|x| be::get::<u16>(x, 0))
        .ok_or(BAD_REQUEST_LEN)
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> R<u32> {
    b.get(at..at + 4)
        .map(|x| be::get::<u32>(x, 0))
        .ok_or(BAD_REQUEST_LEN)
}

#[inline]
fn u64_at(b: &[u8], at: usize) -> R<u64> {
    b.get(at..at + 8)
        .map(|x| be::get::<u64>(x, 0))
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
    let len = be::get::<u16>(buf, 2) as usize;
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
            xid: be::get::<u32>(buf, 4),
            bytes: &buf[..len],
        },
        len,
    )))
}

/// Starts a message: header with the length fixed up by [`finish`].
pub fn start(kind: u8, xid: u32) -> Vec<u8> {
    let mut m = vec![VERSION, kind, 0, 0];
    m.put(xid);
    m
}

pub fn finish(mut m: Vec<u8>) -> Vec<u8> {
    let n = m.len() as u16;
    be::set(&mut m, 2, n);
    m
}

pub fn error(e: OfError, offending: &[u8]) -> Vec<u8> {
    let xid = offending
        .get(4..8)
        .map(|x| be::get::<u32>(x, 0))
        .unwrap_or(0);
    let mut m = start(ERROR, xid);
    m.put(e.0);
    m.put(e.1);
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
            be::get::<u16>(m.bytes, at),
            be::get::<u16>(m.bytes, at + 2) as usize,
        );
        if len < 4 {
            break;
        }
        if t == 1 && at + 8 <= m.bytes.len() {
            let bitmap = be::get::<u32>(m.bytes, at + 4);
            return bitmap & (1 << VERSION) != 0;
        }
        at += len.div_ceil(8) * 8;
    }
    m.version >= VERSION
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
    fn damaged_messages_are_errors() {
        assert_eq!(
            next_message(&[4, 0, 0, 3, 0, 0, 0, 0]).err(),
            Some(BAD_REQUEST_LEN)
        );
        assert!(next_message(&[4, 0, 0, 16, 0, 0, 0, 0]).unwrap().is_none());
        assert!(hello_accepts_13(&Msg {
            version: 4,
            kind: HELLO,
            xid: 0,
            bytes: &hello(),
        }));
    }
}
