//! Meters (OpenFlow 1.3 §5.7): per-flow rate limits in kbit/s or packets/s with drop and
//! DSCP-remark bands, each band a token bucket. The buckets live in the meter itself, written
//! only by the switch's data path thread (relaxed atomics: no lock per packet).

use crate::ofp::{self, OfError};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use stitch_wire::be::Put;

pub const FLAG_KBPS: u16 = 1;
pub const FLAG_PKTPS: u16 = 2;
pub const FLAG_BURST: u16 = 4;
pub const FLAG_STATS: u16 = 8;

pub const BAND_DROP: u16 = 1;
pub const BAND_DSCP_REMARK: u16 = 2;

pub const MAX_METERS: u32 = 65536;
pub const MAX_BANDS: usize = 8;

pub struct Band {
    pub kind: u16,
    pub rate: u32,
    pub burst: u32,
    pub prec_level: u8,
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    /// Tokens in millibits (kbit/s meters) or millipackets (packet/s meters).
    tokens: AtomicU64,
}

pub struct Meter {
    pub id: u32,
    pub flags: u16,
    pub bands: Vec<Band>,
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    pub created_ns: u64,
    last_ns: AtomicU64,
}

/// What a meter does to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    /// Raise the drop precedence of the DSCP by this many levels.
    Remark(u8),
}

impl Band {
    /// Bucket depth: the burst given (with OFPMF_BURST), else 100 ms of the rate and at least
    /// one full-size frame.
    fn depth(&self, flags: u16) -> u64 {
        let pktps = flags & FLAG_PKTPS != 0;
        // Millipackets per packet, millibits per kilobit.
        let per_unit = if pktps { 1000 } else { 1_000_000 };
        let given = if flags & FLAG_BURST != 0 && self.burst > 0 {
            self.burst as u64 * per_unit
        } else {
            self.rate as u64 * per_unit / 10
        };
        let one_frame = if pktps { 1000 } else { 1514 * 8 * 1000 };
        given.max(one_frame)
    }
}

impl Meter {
    /// Measures one packet of `len` bytes at `now_ns` (data path thread only).
    pub fn measure(&self, len: usize, now_ns: u64) -> Verdict {
        self.packets.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(len as u64, Ordering::Relaxed);
        let last = self.last_ns.swap(now_ns, Ordering::Relaxed);
        let elapsed = now_ns.saturating_sub(last).min(1_000_000_000);
        let pktps = self.flags & FLAG_PKTPS != 0;
        // Cost in the bucket's unit: millipackets or millibits.
        let cost = if pktps { 1000 } else { len as u64 * 8 * 1000 };
        let mut exceeded: Option<&Band> = None;
        for b in &self.bands {
            // rate (per second) × 1000 milli-units × elapsed ns / 1e9.
            let add = if pktps {
                b.rate as u64 * elapsed / 1_000_000
            } else {
                b.rate as u64 * 1000 * elapsed / 1_000_000
            };
            let t = (b.tokens.load(Ordering::Relaxed) + add).min(b.depth(self.flags));
            if t >= cost {
                b.tokens.store(t - cost, Ordering::Relaxed);
            } else {
                b.tokens.store(t, Ordering::Relaxed);
                if exceeded.is_none_or(|e| b.rate > e.rate) {
                    exceeded = Some(b);
                }
            }
        }
        match exceeded {
            None => Verdict::Pass,
            Some(b) => {
                b.packets.fetch_add(1, Ordering::Relaxed);
                b.bytes.fetch_add(len as u64, Ordering::Relaxed);
                match b.kind {
                    BAND_DSCP_REMARK => Verdict::Remark(b.prec_level),
                    _ => Verdict::Drop,
                }
            }
        }
    }
}

/// A DSCP with its drop precedence raised by `levels` (RFC 2597's AF classes: AFx1 → AFx2 →
/// AFx3); other code points are left as they are.
pub fn remark_dscp(dscp: u8, levels: u8) -> u8 {
    let (class, precedence) = (dscp >> 3, (dscp >> 1) & 3);
    if !(1..=4).contains(&class) || dscp & 1 != 0 || precedence == 0 {
        return dscp;
    }
    let p = (precedence + levels).min(3);
    class << 3 | p << 1
}

pub const MC_ADD: u16 = 0;
pub const MC_MODIFY: u16 = 1;
pub const MC_DELETE: u16 = 2;

pub struct MeterMod {
    pub command: u16,
    pub flags: u16,
    pub id: u32,
    pub bands: Vec<Band>,
}

pub fn parse_meter_mod(b: &[u8]) -> Result<MeterMod, OfError> {
    let command = ofp::u16_field(b, 8)?;
    let flags = ofp::u16_field(b, 10)?;
    let id = ofp::u32_field(b, 12)?;
    if command > MC_DELETE {
        return Err(ofp::METER_MOD_BAD_COMMAND);
    }
    let mut bands = Vec::new();
    let mut i = 16;
    while i < b.len() {
        let kind = ofp::u16_field(b, i)?;
        let len = ofp::u16_field(b, i + 2)? as usize;
        if len != 16 || i + len > b.len() {
            return Err(ofp::METER_MOD_BAD_BAND);
        }
        if kind != BAND_DROP && kind != BAND_DSCP_REMARK {
            return Err(ofp::METER_MOD_BAD_BAND);
        }
        bands.push(Band {
            kind,
            rate: ofp::u32_field(b, i + 4)?,
            burst: ofp::u32_field(b, i + 8)?,
            prec_level: if kind == BAND_DSCP_REMARK {
                b[i + 12]
            } else {
                0
            },
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
        });
        i += len;
    }
    Ok(MeterMod {
        command,
        flags,
        id,
        bands,
    })
}

#[derive(Default, Clone)]
pub struct MeterTable {
    pub meters: BTreeMap<u32, Arc<Meter>>,
}

impl MeterTable {
    /// Applies a METER_MOD (§6.6); returns the ids of the meters it deleted (flows that use
    /// them go too).
    pub fn apply(&mut self, mm: MeterMod, now_ns: u64) -> Result<Vec<u32>, OfError> {
        if mm.command == MC_DELETE {
            return Ok(if mm.id == ofp::METER_ALL {
                std::mem::take(&mut self.meters).into_keys().collect()
            } else {
                self.meters
                    .remove(&mm.id)
                    .map(|m| m.id)
                    .into_iter()
                    .collect()
            });
        }
        if mm.id == 0 || mm.id > ofp::METER_MAX {
            return Err(ofp::METER_MOD_INVALID_METER);
        }
        match mm.command {
            MC_ADD if self.meters.contains_key(&mm.id) => return Err(ofp::METER_MOD_EXISTS),
            MC_MODIFY if !self.meters.contains_key(&mm.id) => {
                return Err(ofp::METER_MOD_UNKNOWN_METER)
            }
            _ => {}
        }
        if mm.command == MC_ADD && self.meters.len() as u32 >= MAX_METERS {
            return Err(ofp::METER_MOD_OUT_OF_METERS);
        }
        let unit = mm.flags & (FLAG_KBPS | FLAG_PKTPS);
        if unit == (FLAG_KBPS | FLAG_PKTPS)
            || mm.flags & !(FLAG_KBPS | FLAG_PKTPS | FLAG_BURST | FLAG_STATS) != 0
        {
            return Err(ofp::METER_MOD_BAD_FLAGS);
        }
        if mm.bands.is_empty() || mm.bands.len() > MAX_BANDS {
            return Err(ofp::METER_MOD_OUT_OF_BANDS);
        }
        if mm.bands.iter().any(|b| b.rate == 0) {
            return Err(ofp::METER_MOD_BAD_RATE);
        }
        let meter = Meter {
            id: mm.id,
            flags: mm.flags,
            bands: mm.bands,
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            created_ns: now_ns,
            last_ns: AtomicU64::new(now_ns),
        };
        // A new meter starts with full buckets.
        for b in &meter.bands {
            b.tokens.store(b.depth(meter.flags), Ordering::Relaxed);
        }
        self.meters.insert(mm.id, Arc::new(meter));
        Ok(Vec::new())
    }
}

/// `ofp_meter_band_header`s as METER_CONFIG gives them back.
pub fn write_bands(out: &mut Vec<u8>, m: &Meter) {
    for b in &m.bands {
        out.put(b.kind);
        out.put(16u16);
        out.put(b.rate);
        out.put(b.burst);
        out.extend_from_slice(&[b.prec_level, 0, 0, 0]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn band(kind: u16, rate: u32) -> Band {
        Band {
            kind,
            rate,
            burst: 0,
            prec_level: 1,
            packets: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
        }
    }

    fn add(t: &mut MeterTable, id: u32, flags: u16, bands: Vec<Band>) -> Result<Vec<u32>, OfError> {
        t.apply(
            MeterMod {
                command: MC_ADD,
                flags,
                id,
                bands,
            },
            0,
        )
    }

    #[test]
    fn a_packet_rate_meter_passes_its_rate_and_drops_the_rest() {
        let mut t = MeterTable::default();
        add(&mut t, 1, FLAG_PKTPS, vec![band(BAND_DROP, 100)]).unwrap();
        let m = &t.meters[&1];
        // 200 packets per second offered for 10 s.
        let passed = (0..2000u64)
            .filter(|i| m.measure(1500, i * 5_000_000) == Verdict::Pass)
            .count();
        assert!((990..=1020).contains(&passed), "{passed}");
    }

    #[test]
    fn a_kbps_meter_remarks_above_its_rate() {
        let mut t = MeterTable::default();
        add(&mut t, 2, FLAG_KBPS, vec![band(BAND_DSCP_REMARK, 1000)]).unwrap();
        let m = &t.meters[&2];
        // 2 Mbit/s offered: 1500-byte frames every 6 ms for 10 s.
        let remarked = (0..1667u64)
            .filter(|i| m.measure(1500, i * 6_000_000) == Verdict::Remark(1))
            .count();
        assert!((780..=880).contains(&remarked), "{remarked}");
        assert_eq!(remark_dscp(18, 1), 20);
        assert_eq!(remark_dscp(22, 1), 22);
        assert_eq!(remark_dscp(46, 1), 46);
    }

    #[test]
    fn meter_mods_follow_the_spec() {
        let mut t = MeterTable::default();
        assert_eq!(
            add(&mut t, 0, FLAG_KBPS, vec![band(BAND_DROP, 1)]).err(),
            Some(ofp::METER_MOD_INVALID_METER)
        );
        assert_eq!(
            add(&mut t, 1, FLAG_KBPS | FLAG_PKTPS, vec![band(BAND_DROP, 1)]).err(),
            Some(ofp::METER_MOD_BAD_FLAGS)
        );
        assert_eq!(
            add(&mut t, 1, FLAG_KBPS, vec![band(BAND_DROP, 0)]).err(),
            Some(ofp::METER_MOD_BAD_RATE)
        );
        add(&mut t, 1, FLAG_KBPS, vec![band(BAND_DROP, 1)]).unwrap();
        assert_eq!(
            add(&mut t, 1, FLAG_KBPS, vec![band(BAND_DROP, 1)]).err(),
            Some(ofp::METER_MOD_EXISTS)
        );
        let gone = t
            .apply(
                MeterMod {
                    command: MC_DELETE,
                    flags: 0,
                    id: ofp::METER_ALL,
                    bands: vec![],
                },
                0,
            )
            .unwrap();
        assert_eq!(gone, [1]);
    }
}
