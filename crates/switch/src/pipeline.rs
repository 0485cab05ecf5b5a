//! The flow tables (OpenFlow 1.3 §5): 64 tables of entries by priority, each with its
//! instructions, and the FLOW_MOD rules (§6.4) — add with overlap check and counter carry-over,
//! strict and loose modify and delete filtered by cookie, out_port and out_group, timeouts.

use crate::action::{self, Action};
use crate::ofp::{self, OfError};
use crate::oxm::{self, Key, Match};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use stitch_wire::be::{self};

pub const TABLES: usize = 64;

pub const INSTR_GOTO_TABLE: u16 = 1;
pub const INSTR_WRITE_METADATA: u16 = 2;
pub const INSTR_WRITE_ACTIONS: u16 = 3;
pub const INSTR_APPLY_ACTIONS: u16 = 4;
pub const INSTR_CLEAR_ACTIONS: u16 = 5;
pub const INSTR_METER: u16 = 6;

pub const FF_SEND_FLOW_REM: u16 = 1;
pub const FF_CHECK_OVERLAP: u16 = 2;
pub const FF_RESET_COUNTS: u16 = 4;

/// What a flow entry's instructions say (§5.9), in the order they run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Instructions {
    pub meter: Option<u32>,
    pub apply: Vec<Action>,
    pub clear: bool,
    pub write: Option<Vec<Action>>,
    /// (value, mask)
    pub metadata: Option<(u64, u64)>,
    pub goto: Option<u8>,
    /// The instructions as the controller sent them (flow statistics give them back).
    pub raw: Vec<u8>,
}

impl Instructions {
    pub fn apply_actions(actions: Vec<Action>) -> Instructions {
        let mut raw = vec![0, INSTR_APPLY_ACTIONS as u8, 0, 0, 0, 0, 0, 0];
        action::write_actions(&mut raw, &actions);
        let len = raw.len() as u16;
        be::set(&mut raw, 2, len);
        Instructions {
            apply: actions,
            raw,
            ..Instructions::default()
        }
    }

    /// Every action the entry can run (apply-actions, then write-actions).
    pub fn actions(&self) -> impl Iterator<Item = &Action> {
        self.apply.iter().chain(self.write.iter().flatten())
    }
}

/// Reads the instructions of a FLOW_MOD for table `table`.
pub fn parse_instructions(b: &[u8], table: u8) -> Result<Instructions, OfError> {
    let mut ins = Instructions {
        raw: b.to_vec(),
        ..Instructions::default()
    };
    let mut seen = 0u64;
    let mut i = 0;
    while i < b.len() {
        let t = ofp::u16_field(b, i).map_err(|_| ofp::BAD_INSTRUCTION_LEN)?;
        let len = ofp::u16_field(b, i + 2).map_err(|_| ofp::BAD_INSTRUCTION_LEN)? as usize;
        if len < 8 || !len.is_multiple_of(8) || i + len > b.len() {
            return Err(ofp::BAD_INSTRUCTION_LEN);
        }
        let body = &b[i..i + len];
        if t < 64 {
            if seen & (1 << t) != 0 {
                return Err(ofp::BAD_INSTRUCTION_UNSUPPORTED);
            }
            seen |= 1 << t;
        }
        match t {
            INSTR_GOTO_TABLE => {
                if len != 8 {
                    return Err(ofp::BAD_INSTRUCTION_LEN);
                }
                let to = body[4];
                if to as usize >= TABLES || to <= table {
                    return Err(ofp::BAD_INSTRUCTION_TABLE_ID);
                }
                ins.goto = Some(to);
            }
            INSTR_WRITE_METADATA => {
                if len != 24 {
                    return Err(ofp::BAD_INSTRUCTION_LEN);
                }
                ins.metadata = Some((ofp::u64_field(body, 8)?, ofp::u64_field(body, 16)?));
            }
            INSTR_WRITE_ACTIONS | INSTR_APPLY_ACTIONS => {
                let actions = action::parse_actions(&body[8..])?;
                if t == INSTR_APPLY_ACTIONS {
                    ins.apply = actions;
                } else {
                    ins.write = Some(actions);
                }
            }
            INSTR_CLEAR_ACTIONS => {
                if len != 8 {
                    return Err(ofp::BAD_INSTRUCTION_LEN);
                }
                ins.clear = true;
            }
            INSTR_METER => {
                if len != 8 {
                    return Err(ofp::BAD_INSTRUCTION_LEN);
                }
                ins.meter = Some(ofp::u32_field(body, 4)?);
            }
            0xffff => return Err(ofp::BAD_INSTRUCTION_EXPERIMENTER),
            _ => return Err(ofp::BAD_INSTRUCTION_UNKNOWN),
        }
        i += len;
    }
    Ok(ins)
}

pub struct FlowEntry {
    pub table: u8,
    pub priority: u16,
    pub cookie: u64,
    pub matching: Match,
    pub instructions: Instructions,
    pub idle_timeout: u16,
    pub hard_timeout: u16,
    pub flags: u16,
    pub packets: AtomicU64,
    pub bytes: AtomicU64,
    /// Nanoseconds on the switch's clock.
    pub created_ns: u64,
    pub last_used_ns: AtomicU64,
}

impl FlowEntry {
    /// Priority 0 with an empty match: the table-miss entry (§5.4).
    pub fn is_table_miss(&self) -> bool {
        self.priority == 0 && self.matching.words.is_empty()
    }

    fn outputs_to(&self, port: u32, group: u32) -> bool {
        (port == ofp::PORT_ANY
            || self
                .instructions
                .actions()
                .any(|a| matches!(a, Action::Output { port: p, .. } if *p == port)))
            && (group == ofp::GROUP_ANY
                || self
                    .instructions
                    .actions()
                    .any(|a| *a == Action::Group(group)))
    }
}

/// A FLOW_MOD, read.
#[derive(Debug, Clone)]
pub struct FlowMod {
    pub cookie: u64,
    pub cookie_mask: u64,
    pub table_id: u8,
    pub command: u8,
    pub idle_timeout: u16,
    pub hard_timeout: u16,
    pub priority: u16,
    pub buffer_id: u32,
    pub out_port: u32,
    pub out_group: u32,
    pub flags: u16,
    pub matching: Match,
    pub instructions: Instructions,
}

#[cfg(test)]
impl FlowMod {
    /// A FLOW_MOD with no cookie, timeout, flag or filter (for tests).
    pub(crate) fn plain(
        command: u8,
        table: u8,
        priority: u16,
        m: Match,
        ins: Instructions,
    ) -> Self {
        FlowMod {
            cookie: 0,
            cookie_mask: 0,
            table_id: table,
            command,
            idle_timeout: 0,
            hard_timeout: 0,
            priority,
            buffer_id: ofp::NO_BUFFER,
            out_port: ofp::PORT_ANY,
            out_group: ofp::GROUP_ANY,
            flags: 0,
            matching: m,
            instructions: ins,
        }
    }
}

pub const FC_ADD: u8 = 0;
pub const FC_MODIFY: u8 = 1;
pub const FC_MODIFY_STRICT: u8 = 2;
pub const FC_DELETE: u8 = 3;
pub const FC_DELETE_STRICT: u8 = 4;

pub fn parse_flow_mod(b: &[u8]) -> Result<FlowMod, OfError> {
    let command = *b.get(25).ok_or(ofp::BAD_REQUEST_LEN)?;
    if command > FC_DELETE_STRICT {
        return Err(ofp::FLOW_MOD_BAD_COMMAND);
    }
    let table_id = b[24];
    let deleting = command >= FC_DELETE;
    if table_id as usize >= TABLES && !(deleting && table_id == ofp::TABLE_ALL) {
        return Err(ofp::FLOW_MOD_BAD_TABLE);
    }
    let (matching, mlen) = oxm::parse_match(b, 48)?;
    let flags = ofp::u16_field(b, 44)?;
    if flags & !(FF_SEND_FLOW_REM | FF_CHECK_OVERLAP | FF_RESET_COUNTS | 8 | 16) != 0 {
        return Err(ofp::FLOW_MOD_BAD_FLAGS);
    }
    let instructions = if deleting {
        Instructions::default()
    } else {
        parse_instructions(b.get(48 + mlen..).ok_or(ofp::BAD_REQUEST_LEN)?, table_id)?
    };
    Ok(FlowMod {
        cookie: ofp::u64_field(b, 8)?,
        cookie_mask: ofp::u64_field(b, 16)?,
        table_id,
        command,
        idle_timeout: ofp::u16_field(b, 26)?,
        hard_timeout: ofp::u16_field(b, 28)?,
        priority: ofp::u16_field(b, 30)?,
        buffer_id: ofp::u32_field(b, 32)?,
        out_port: ofp::u32_field(b, 36)?,
        out_group: ofp::u32_field(b, 40)?,
        flags,
        matching,
        instructions,
    })
}

/// Why an entry left its table (FLOW_REMOVED reasons).
pub const REMOVED_IDLE: u8 = 0;
pub const REMOVED_HARD: u8 = 1;
pub const REMOVED_DELETE: u8 = 2;
pub const REMOVED_GROUP_DELETE: u8 = 3;
pub const REMOVED_METER_DELETE: u8 = 4;

/// The master tables, owned by the OpenFlow side; the data path reads snapshots of them.
pub struct FlowTables {
    /// Per table: highest priority first; equal priorities in insertion order.
    pub tables: Vec<Vec<Arc<FlowEntry>>>,
}

impl Default for FlowTables {
    fn default() -> Self {
        FlowTables {
            tables: vec![Vec::new(); TABLES],
        }
    }
}

/// Whether a modify or delete request reaches an entry.
struct Selector<'a> {
    fm: &'a FlowMod,
    strict: bool,
}

impl Selector<'_> {
    fn hits(&self, e: &FlowEntry) -> bool {
        let fm = self.fm;
        let shape = if self.strict {
            e.priority == fm.priority && e.matching.same(&fm.matching)
        } else {
            fm.matching.covers(&e.matching)
        };
        shape && (fm.cookie_mask == 0 || e.cookie & fm.cookie_mask == fm.cookie & fm.cookie_mask)
    }
}

impl FlowTables {
    pub fn len(&self) -> usize {
        self.tables.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies a FLOW_MOD (§6.4) at time `now_ns`; returns the entries it removed.
    pub fn apply(&mut self, fm: &FlowMod, now_ns: u64) -> Result<Vec<Arc<FlowEntry>>, OfError> {
        match fm.command {
            FC_ADD => self.add(fm, now_ns).map(|_| Vec::new()),
            FC_MODIFY | FC_MODIFY_STRICT => {
                self.modify(fm, fm.command == FC_MODIFY_STRICT);
                Ok(Vec::new())
            }
            FC_DELETE | FC_DELETE_STRICT => Ok(self.delete(fm, fm.command == FC_DELETE_STRICT)),
            _ => Err(ofp::FLOW_MOD_BAD_COMMAND),
        }
    }

    fn add(&mut self, fm: &FlowMod, now_ns: u64) -> Result<(), OfError> {
        let table = &mut self.tables[fm.table_id as usize];
        if fm.flags & FF_CHECK_OVERLAP != 0
            && table
                .iter()
                .any(|e| e.priority == fm.priority && e.matching.overlaps(&fm.matching))
        {
            return Err(ofp::FLOW_MOD_OVERLAP);
        }
        let old = table
            .iter()
            .position(|e| e.priority == fm.priority && e.matching.same(&fm.matching));
        let (packets, bytes) = match old {
            Some(i) if fm.flags & FF_RESET_COUNTS == 0 => (
                table[i].packets.load(Ordering::Relaxed),
                table[i].bytes.load(Ordering::Relaxed),
            ),
            _ => (0, 0),
        };
        if let Some(i) = old {
            table.remove(i);
        }
        let entry = Arc::new(FlowEntry {
            table: fm.table_id,
            priority: fm.priority,
            cookie: fm.cookie,
            matching: fm.matching.clone(),
            instructions: fm.instructions.clone(),
            idle_timeout: fm.idle_timeout,
            hard_timeout: fm.hard_timeout,
            flags: fm.flags,
            packets: AtomicU64::new(packets),
            bytes: AtomicU64::new(bytes),
            created_ns: now_ns,
            last_used_ns: AtomicU64::new(now_ns),
        });
        let at = table
            .iter()
            .position(|e| e.priority < fm.priority)
            .unwrap_or(table.len());
        table.insert(at, entry);
        Ok(())
    }

    /// New instructions, same counters unless OFPFF_RESET_COUNTS (§6.4); no match, no change.
    fn modify(&mut self, fm: &FlowMod, strict: bool) {
        let sel = Selector { fm, strict };
        for e in self.tables[fm.table_id as usize].iter_mut() {
            if !sel.hits(e) {
                continue;
            }
            let keep = fm.flags & FF_RESET_COUNTS == 0;
            let count =
                |c: &AtomicU64| AtomicU64::new(if keep { c.load(Ordering::Relaxed) } else { 0 });
            *e = Arc::new(FlowEntry {
                table: e.table,
                priority: e.priority,
                cookie: e.cookie,
                matching: e.matching.clone(),
                instructions: fm.instructions.clone(),
                idle_timeout: e.idle_timeout,
                hard_timeout: e.hard_timeout,
                flags: e.flags,
                packets: count(&e.packets),
                bytes: count(&e.bytes),
                created_ns: e.created_ns,
                last_used_ns: AtomicU64::new(e.last_used_ns.load(Ordering::Relaxed)),
            });
        }
    }

    fn delete(&mut self, fm: &FlowMod, strict: bool) -> Vec<Arc<FlowEntry>> {
        let sel = Selector { fm, strict };
        let mut removed = Vec::new();
        for (t, table) in self.tables.iter_mut().enumerate() {
            if fm.table_id != ofp::TABLE_ALL && t != fm.table_id as usize {
                continue;
            }
            table.retain(|e| {
                let hit = sel.hits(e) && e.outputs_to(fm.out_port, fm.out_group);
                if hit {
                    removed.push(e.clone());
                }
                !hit
            });
        }
        removed
    }

    /// Removes the entries `gone` says, returning them.
    pub fn remove_where(&mut self, gone: impl Fn(&FlowEntry) -> bool) -> Vec<Arc<FlowEntry>> {
        let mut removed = Vec::new();
        for table in self.tables.iter_mut() {
            table.retain(|e| {
                let hit = gone(e);
                if hit {
                    removed.push(e.clone());
                }
                !hit
            });
        }
        removed
    }

    /// Entries whose idle or hard timeout has passed at `now_ns`, removed, with the reason.
    pub fn expire(&mut self, now_ns: u64) -> Vec<(Arc<FlowEntry>, u8)> {
        let mut out = Vec::new();
        for table in self.tables.iter_mut() {
            table.retain(|e| {
                let s = 1_000_000_000u64;
                let reason = if e.hard_timeout > 0
                    && now_ns >= e.created_ns + e.hard_timeout as u64 * s
                {
                    Some(REMOVED_HARD)
                } else if e.idle_timeout > 0
                    && now_ns >= e.last_used_ns.load(Ordering::Relaxed) + e.idle_timeout as u64 * s
                {
                    Some(REMOVED_IDLE)
                } else {
                    None
                };
                if let Some(r) = reason {
                    out.push((e.clone(), r));
                }
                reason.is_none()
            });
        }
        out
    }

    /// Entries a statistics request describes (§7.3.5.2).
    #[allow(clippy::too_many_arguments)]
    pub fn select<'a>(
        &'a self,
        table_id: u8,
        m: &'a Match,
        out_port: u32,
        out_group: u32,
        cookie: u64,
        cookie_mask: u64,
    ) -> impl Iterator<Item = &'a Arc<FlowEntry>> {
        self.tables
            .iter()
            .enumerate()
            .filter(move |(t, _)| table_id == ofp::TABLE_ALL || *t == table_id as usize)
            .flat_map(|(_, es)| es.iter())
            .filter(move |e| {
                m.covers(&e.matching)
                    && e.outputs_to(out_port, out_group)
                    && (cookie_mask == 0 || e.cookie & cookie_mask == cookie & cookie_mask)
            })
    }
}

/// An entry's instructions as the data path reads them: packed next to the other entries of
/// its table, the actions in one array for the whole pipeline. A flow entry itself is spread
/// over several allocations (its match, its instructions' lists, the raw bytes statistics
/// give back); with a thousand learned hosts per table, reading those per packet missed the
/// core's caches several times per table.
#[derive(Debug, Clone, Copy)]
pub struct Packed {
    pub cookie: u64,
    pub metadata: Option<(u64, u64)>,
    pub meter: Option<u32>,
    /// Where the apply-actions and write-actions are in [`Program::actions`].
    pub apply: (u32, u32),
    pub write: Option<(u32, u32)>,
    pub goto: Option<u8>,
    pub clear: bool,
    pub table_miss: bool,
    /// Whether an apply-action brings a header back from the bytes (see
    /// [`Action::exposes_inner_header`]).
    pub exposes_inner_header: bool,
}

/// Every table's entries, [`Packed`], in the same order as the tables.
#[derive(Debug, Default)]
pub struct Program {
    pub tables: Vec<Vec<Packed>>,
    pub actions: Vec<Action>,
}

impl Program {
    pub fn of(tables: &[Vec<Arc<FlowEntry>>]) -> Program {
        let mut actions = Vec::new();
        let mut place = |list: &[Action]| {
            let start = actions.len() as u32;
            actions.extend_from_slice(list);
            (start, actions.len() as u32)
        };
        let tables = tables
            .iter()
            .map(|entries| {
                entries
                    .iter()
                    .map(|e| {
                        let ins = &e.instructions;
                        Packed {
                            cookie: e.cookie,
                            metadata: ins.metadata,
                            meter: ins.meter,
                            apply: place(&ins.apply),
                            write: ins.write.as_deref().map(&mut place),
                            goto: ins.goto,
                            clear: ins.clear,
                            table_miss: e.is_table_miss(),
                            exposes_inner_header: ins
                                .apply
                                .iter()
                                .any(Action::exposes_inner_header),
                        }
                    })
                    .collect()
            })
            .collect();
        Program { tables, actions }
    }

    #[inline]
    pub fn actions(&self, (start, end): (u32, u32)) -> &[Action] {
        &self.actions[start as usize..end as usize]
    }
}

/// The index of the first (highest-priority) entry of `entries` that matches.
#[inline]
pub fn position(entries: &[Arc<FlowEntry>], k: &Key) -> Option<usize> {
    entries.iter().position(|e| e.matching.matches(k))
}

/// For each input port 1..=`ports`, the first entry and output port when the pipeline sends
/// *all* of that port's traffic to one other port: from table 0, the first entry (by priority)
/// that could meet any packet of the port matches on `in_port` alone (or nothing), has no meter
/// and no metadata write, and either goes to a later table with no actions (the walk goes on
/// there) or ends with one output to another numbered port. Conservative: any other shape is
/// not point to point. The entry returned is the one that outputs (it counts the packets; the
/// entries passed on the way are counted too).
pub fn point_to_point(tables: &[Vec<Arc<FlowEntry>>], ports: usize) -> Vec<Option<P2p>> {
    (1..=ports as u32)
        .map(|port| {
            let mut via = Vec::new();
            let mut t = 0usize;
            loop {
                let e = tables.get(t)?.iter().find(|e| {
                    e.matching
                        .exact(oxm::IN_PORT)
                        .is_none_or(|p| p == be::net(port))
                })?;
                let ins = &e.instructions;
                if !e.matching.is_in_port_only() || ins.meter.is_some() || ins.metadata.is_some() {
                    return None;
                }
                let out = match (&ins.apply[..], ins.write.as_deref(), ins.goto) {
                    ([], None | Some([]), Some(next)) => {
                        via.push(e.clone());
                        t = next as usize;
                        continue;
                    }
                    ([Action::Output { port: out, .. }], None | Some([]), None) => *out,
                    ([], Some([Action::Output { port: out, .. }]), None) => *out,
                    _ => return None,
                };
                return (out != port && (1..=ports as u32).contains(&out)).then(|| P2p {
                    entry: e.clone(),
                    via,
                    out,
                });
            }
        })
        .collect()
}

/// A port whose traffic all goes to one other port.
#[derive(Clone)]
pub struct P2p {
    /// The entry that outputs.
    pub entry: Arc<FlowEntry>,
    /// Entries of earlier tables the traffic passes (goto only).
    pub via: Vec<Arc<FlowEntry>>,
    pub out: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fm(command: u8, table: u8, priority: u16, m: Match, ins: Instructions) -> FlowMod {
        FlowMod::plain(command, table, priority, m, ins)
    }

    fn in_port(n: u32) -> Match {
        Match::from_fields(&[(oxm::IN_PORT, &be::net(n), None)])
    }

    fn out(n: u32) -> Instructions {
        Instructions::apply_actions(vec![Action::output(n)])
    }

    fn goto(t: u8) -> Instructions {
        Instructions {
            goto: Some(t),
            ..Instructions::default()
        }
    }

    #[test]
    fn priorities_modify_delete_and_overlap() {
        let mut t = FlowTables::default();
        let udp = Match::from_fields(&[
            (oxm::IN_PORT, &be::net(1u32), None),
            (oxm::ETH_TYPE, &[8, 0], None),
            (oxm::IP_PROTO, &[17], None),
        ]);
        t.apply(&fm(FC_ADD, 0, 10, in_port(1), out(2)), 0).unwrap();
        t.apply(&fm(FC_ADD, 0, 20, udp.clone(), out(3)), 0).unwrap();
        let mut frame = vec![0u8; 42];
        frame[12..14].copy_from_slice(&[8, 0]);
        frame[14] = 0x45;
        frame[23] = 17;
        let k = Key::extract(&frame, 1);
        assert_eq!(position(&t.tables[0], &k), Some(0));
        frame[23] = 6;
        assert_eq!(position(&t.tables[0], &Key::extract(&frame, 1)), Some(1));
        assert_eq!(position(&t.tables[0], &Key::extract(&frame, 2)), None);
        // CHECK_OVERLAP: same priority, a packet could meet both.
        let mut o = fm(FC_ADD, 0, 10, Match::default(), out(3));
        o.flags = FF_CHECK_OVERLAP;
        assert_eq!(t.apply(&o, 0).err(), Some(ofp::FLOW_MOD_OVERLAP));
        // Loose modify of in_port=1 reaches both; strict delete only the exact one.
        t.apply(&fm(FC_MODIFY, 0, 0, in_port(1), out(4)), 0)
            .unwrap();
        assert!(t.tables[0]
            .iter()
            .all(|e| e.instructions.apply == [Action::output(4)]));
        let gone = t
            .apply(
                &fm(FC_DELETE_STRICT, 0, 20, udp, Instructions::default()),
                0,
            )
            .unwrap();
        assert_eq!(gone.len(), 1);
        // Delete in every table, filtered by out_port.
        t.apply(&fm(FC_ADD, 3, 5, Match::default(), out(7)), 0)
            .unwrap();
        let mut d = fm(
            FC_DELETE,
            ofp::TABLE_ALL,
            0,
            Match::default(),
            Instructions::default(),
        );
        d.out_port = 7;
        assert_eq!(t.apply(&d, 0).unwrap().len(), 1);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn timeouts_expire_entries() {
        let mut t = FlowTables::default();
        let mut a = fm(FC_ADD, 0, 1, in_port(1), out(2));
        a.hard_timeout = 2;
        t.apply(&a, 0).unwrap();
        let mut b = fm(FC_ADD, 1, 1, in_port(1), out(2));
        b.idle_timeout = 1;
        t.apply(&b, 0).unwrap();
        t.tables[1][0]
            .last_used_ns
            .store(1_500_000_000, Ordering::Relaxed);
        assert!(t.expire(1_900_000_000).is_empty());
        let gone = t.expire(2_600_000_000);
        let reasons: Vec<u8> = gone.iter().map(|(_, r)| *r).collect();
        assert_eq!(reasons, [REMOVED_HARD, REMOVED_IDLE]);
    }

    #[test]
    fn point_to_point_follows_goto_table() {
        let mut t = FlowTables::default();
        t.apply(&fm(FC_ADD, 0, 10, in_port(1), goto(1)), 0).unwrap();
        t.apply(&fm(FC_ADD, 1, 10, Match::default(), out(2)), 0)
            .unwrap();
        t.apply(&fm(FC_ADD, 0, 10, in_port(2), out(1)), 0).unwrap();
        t.apply(&fm(FC_ADD, 0, 10, in_port(3), out(1)), 0).unwrap();
        t.apply(&fm(FC_ADD, 0, 20, in_port(3), out(2)), 0).unwrap();
        let p = point_to_point(&t.tables, 3);
        let outs: Vec<_> = p
            .iter()
            .map(|x| x.as_ref().map(|p| (p.out, p.via.len())))
            .collect();
        assert_eq!(outs, [Some((2, 1)), Some((1, 0)), Some((2, 0))]);
        // A more specific flow in table 1 breaks port 1's pair.
        let udp =
            Match::from_fields(&[(oxm::ETH_TYPE, &[8, 0], None), (oxm::IP_PROTO, &[17], None)]);
        t.apply(&fm(FC_ADD, 1, 20, udp, out(3)), 0).unwrap();
        assert!(point_to_point(&t.tables, 3)[0].is_none());
    }

    #[test]
    fn a_meter_a_packet_in_or_two_outputs_make_no_pair() {
        let mut t = FlowTables::default();
        let metered = Instructions {
            meter: Some(1),
            ..out(2)
        };
        t.apply(&fm(FC_ADD, 0, 10, in_port(1), metered), 0).unwrap();
        let to_controller = Instructions::apply_actions(vec![Action::output(ofp::PORT_CONTROLLER)]);
        t.apply(&fm(FC_ADD, 0, 10, in_port(2), to_controller), 0)
            .unwrap();
        let twice = Instructions::apply_actions(vec![Action::output(1), Action::output(2)]);
        t.apply(&fm(FC_ADD, 0, 10, in_port(3), twice), 0).unwrap();
        let tagged = Instructions {
            metadata: Some((1, 1)),
            ..goto(1)
        };
        t.apply(&fm(FC_ADD, 0, 10, in_port(4), tagged), 0).unwrap();
        t.apply(&fm(FC_ADD, 1, 10, Match::default(), out(1)), 0)
            .unwrap();
        assert!(point_to_point(&t.tables, 4).iter().all(Option::is_none));
    }

    #[test]
    fn instructions_are_checked() {
        let goto_back = [0, 1, 0, 8, 0, 0, 0, 0];
        assert_eq!(
            parse_instructions(&goto_back, 0).err(),
            Some(ofp::BAD_INSTRUCTION_TABLE_ID)
        );
        assert_eq!(
            parse_instructions(&[0, 9, 0, 8, 0, 0, 0, 0], 0).err(),
            Some(ofp::BAD_INSTRUCTION_UNKNOWN)
        );
        let ins = parse_instructions(&[0, 1, 0, 8, 5, 0, 0, 0, 0, 5, 0, 8, 0, 0, 0, 0], 2).unwrap();
        assert_eq!((ins.goto, ins.clear), (Some(5), true));
    }
}
