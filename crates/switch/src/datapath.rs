//! The switch's data path: each packet walks the flow tables from table 0 (§5.1), running its
//! entries' instructions, then its action set (§5.10); groups and meters on the way. Counters
//! are kept locally and added to the shared ones once per push, not once per packet.

use crate::action::{self, Action, Rewrite};
use crate::cache::{ExactMatchCache, FrameSlot, Slot, Step, TraceCache, CACHE_FROM_FLOWS};
use crate::group::{self, Group};
use crate::meter::{self, Verdict};
use crate::net::{self, Probe};
use crate::ofp;
use crate::oxm::{self, Key};
use crate::pipeline::{self, FlowEntry, TABLES};
use crate::{Async, Shared, Snapshot};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_core::app::Io;
use stitch_core::Packet;
use stitch_wire::be::{self, Put};
use stitch_wire::ethertype;

/// How often the entries' counts are added to the shared ones (statistics lag by at most this).
const ENTRY_FLUSH_NS: u64 = 10_000_000;
/// How many packets ahead of the one in hand the data path prefetches the frame.
const PREFETCH: usize = 8;
/// How many packets ahead of the one in hand the data path reads the frame key or the key.
const LOOKAHEAD: usize = 3;
/// How many packets ahead it fetches the walk cache's lines for a key: later than the key is
/// read, so the key's bytes are no longer in flight to the cache (reading a word just written
/// as several narrower stores stalls until they land).
const FETCH_AHEAD: usize = 2;
/// Keys kept: the one in hand and those read ahead.
const AHEAD: usize = LOOKAHEAD + 1;
/// Groups may chain; a chain this deep is a loop that slipped through.
const MAX_GROUP_DEPTH: usize = 8;

/// What a flush hands to the app's counters.
#[derive(Default)]
pub struct Tally {
    pub misses: u64,
    pub cache_hits: u64,
    pub packet_ins: u64,
    pub packet_in_drops: u64,
    pub meter_drops: u64,
    pub ttl_drops: u64,
}

/// The action set (§5.10): at most one action of each kind (one set-field per field), run
/// in the specification's order. Slots are ranks in that order.
#[derive(Clone, Copy)]
struct ActionSet<'a> {
    slots: [Option<&'a Action>; SLOTS],
}

const SET_FIELD_SLOT: usize = 12;
const SLOTS: usize = SET_FIELD_SLOT + 40 + 3;

impl<'a> ActionSet<'a> {
    fn new() -> Self {
        ActionSet {
            slots: [None; SLOTS],
        }
    }

    fn slot(a: &Action) -> usize {
        match a {
            Action::CopyTtlIn => 0,
            Action::PopVlan => 1,
            Action::PopMpls(_) => 2,
            Action::PopPbb => 3,
            Action::PushMpls(_) => 4,
            Action::PushPbb(_) => 5,
            Action::PushVlan(_) => 6,
            Action::CopyTtlOut => 7,
            Action::DecMplsTtl => 8,
            Action::DecNwTtl => 9,
            Action::SetMplsTtl(_) => 10,
            Action::SetNwTtl(_) => 11,
            Action::SetField { id, .. } => SET_FIELD_SLOT + (*id as usize).min(39),
            Action::SetQueue(_) => SET_FIELD_SLOT + 40,
            Action::Group(_) => SET_FIELD_SLOT + 41,
            Action::Output { .. } => SET_FIELD_SLOT + 42,
        }
    }

    fn write(&mut self, actions: &'a [Action]) {
        for a in actions {
            self.slots[Self::slot(a)] = Some(a);
        }
    }

    /// The set's actions in the order they run; a group takes the place of the output.
    fn ordered(&self) -> impl Iterator<Item = &'a Action> + '_ {
        let has_group = self.slots[SET_FIELD_SLOT + 41].is_some();
        self.slots
            .iter()
            .enumerate()
            .filter(move |(i, _)| !(has_group && *i == SET_FIELD_SLOT + 42))
            .filter_map(|(_, a)| *a)
    }
}

/// Where a packet came from in the pipeline, for its packet-in.
#[derive(Clone, Copy)]
struct Origin {
    table: u8,
    cookie: u64,
    table_miss: bool,
}

impl Origin {
    /// Before the first entry.
    const NONE: Origin = Origin {
        table: 0,
        cookie: u64::MAX,
        table_miss: false,
    };
}

/// What an entry's instructions left of the walk.
enum Walked {
    /// On to this table.
    Goto(usize, Packet),
    /// No goto: the action set, if any, runs now.
    End(Packet),
    /// The packet was sent, dropped or handed on.
    Gone,
}

/// A packet read ahead of its turn: the slot of its frame key when the walk cache reads one
/// for it, else its key and the key's slot.
#[derive(Clone, Copy, Default)]
struct Ahead {
    frame: Option<FrameSlot>,
    key: Key,
    slot: Option<Slot>,
}

pub struct DataPath {
    caches: Vec<Option<ExactMatchCache>>,
    traces: Option<TraceCache>,
    /// A walk being replayed or recorded (kept to reuse its allocation).
    steps: Vec<Step>,
    /// The walk being recorded ended for a reason of the packet's own (meter, TTL, room).
    walk_cut: bool,
    /// The walk being recorded looked up a table after a header came back from the bytes.
    walk_from_bytes: bool,
    /// The frame changed since the key was read from it: the key's packet fields are read
    /// again only when something looks at them (a lookup, a group's bucket choice, a meter's
    /// DSCP), so a remembered walk's rewrites do not parse the frame after each one.
    key_stale: bool,
    /// The packet in hand and the next ones as read ahead.
    ahead: Vec<Ahead>,
    /// Watches a walk being recorded for its net effect.
    probe: Probe,
    counts: EntryCounts,
    entries_flushed_ns: u64,
    outbox: Outbox,
    tally: Tally,
    batch: Vec<Packet>,
    now_ns: u64,
}

impl DataPath {
    pub fn new(ports: usize, cache: usize) -> DataPath {
        DataPath {
            caches: (0..TABLES)
                .map(|_| (cache > 0).then(|| ExactMatchCache::new(cache)))
                .collect(),
            traces: (cache > 0).then(|| TraceCache::new(cache)),
            steps: Vec::with_capacity(TABLES),
            walk_cut: false,
            walk_from_bytes: false,
            key_stale: false,
            ahead: vec![Ahead::default(); AHEAD],
            probe: Probe::default(),
            counts: EntryCounts::default(),
            entries_flushed_ns: 0,
            outbox: Outbox::new(ports),
            tally: Tally::default(),
            batch: Vec::with_capacity(256),
            now_ns: 0,
        }
    }

    /// Empties the caches for the pipeline `snap` (the one the data path now runs).
    pub fn clear_caches(&mut self, snap: &Snapshot) {
        for (c, entries) in self.caches.iter_mut().zip(&snap.tables) {
            if let Some(c) = c {
                c.reset(entries);
            }
        }
        if let Some(t) = &mut self.traces {
            t.reset(&snap.tables);
        }
        // The counts were of the old snapshot's entries: flushed to it before (flush_entries).
        self.counts.resize(snap);
    }

    /// Takes port `i`'s input and sends every packet through the pipeline.
    pub fn receive(&mut self, i: usize, snap: &Snapshot, shared: &Shared, io: &mut Io) {
        let Some(input) = io.input(i) else { return };
        let mut batch = std::mem::take(&mut self.batch);
        let (n, bytes) = input.receive_all(&mut batch);
        if n == 0 {
            self.batch = batch;
            return;
        }
        self.now_ns = shared.now_ns();
        let pc = &shared.port_counters[i];
        pc.rx_packets.fetch_add(n as u64, Ordering::Relaxed);
        pc.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
        let port = i as u32 + 1;
        // Frame keys (or keys) are read a few packets ahead of their use, and the walk cache's
        // lines for them fetched then; frames further ahead, so their lines are in when read.
        let mut ahead = std::mem::take(&mut self.ahead);
        for p in batch.iter().take(PREFETCH) {
            p.prefetch_data();
        }
        for (j, p) in batch.iter().take(LOOKAHEAD).enumerate() {
            self.read_ahead(&mut ahead[j], p.data(), port);
        }
        for a in ahead.iter_mut().take(FETCH_AHEAD.min(batch.len())) {
            self.fetch_walk(a);
        }
        let mut rest = batch.drain(..);
        let mut n = 0;
        while let Some(p) = rest.next() {
            if let Some(far) = rest.as_slice().get(PREFETCH - 1) {
                far.prefetch_data();
            }
            if let Some(next) = rest.as_slice().get(LOOKAHEAD - 1) {
                self.read_ahead(&mut ahead[(n + LOOKAHEAD) % AHEAD], next.data(), port);
            }
            if rest.as_slice().len() >= FETCH_AHEAD {
                self.fetch_walk(&mut ahead[(n + FETCH_AHEAD) % AHEAD]);
            }
            self.key_stale = false;
            self.receive_one(p, &mut ahead[n % AHEAD], port, snap, shared);
            n += 1;
        }
        drop(rest);
        self.ahead = ahead;
        self.batch = batch;
        self.outbox.send(io);
    }

    /// When the walk cache is in use and `frame` is of a shape it reads: the frame key's slot,
    /// its lines fetched; else the key.
    #[inline]
    fn read_ahead(&self, a: &mut Ahead, frame: &[u8], port: u32) {
        let traces = self.traces.as_ref().filter(|t| t.worth_it());
        a.frame = traces.and_then(|t| {
            let s = t.frame_slot(frame, port)?;
            t.prefetch_frame(&s);
            Some(s)
        });
        if a.frame.is_none() {
            a.key.reset(frame, port);
        }
    }

    /// When the walk cache is in use and the key was read: the key's slot there, and its lines
    /// fetched.
    #[inline]
    fn fetch_walk(&self, a: &mut Ahead) {
        if a.frame.is_some() {
            return;
        }
        a.slot = self.traces.as_ref().filter(|t| t.worth_it()).map(|t| {
            let s = t.slot(&a.key);
            t.prefetch(&s);
            s
        });
    }

    /// A PACKET_OUT: its actions on the frame (output to OFPP_TABLE runs the pipeline).
    pub fn packet_out(
        &mut self,
        p: Packet,
        in_port: u32,
        actions: &[Action],
        snap: &Snapshot,
        shared: &Shared,
        io: &mut Io,
    ) {
        self.run_packet_out(p, in_port, actions, snap, shared);
        self.outbox.send(io);
    }

    fn run_packet_out(
        &mut self,
        mut p: Packet,
        in_port: u32,
        actions: &[Action],
        snap: &Snapshot,
        shared: &Shared,
    ) {
        self.now_ns = shared.now_ns();
        let mut key = Key::extract(p.data(), in_port);
        self.key_stale = false;
        let origin = Origin {
            table: 0xff,
            cookie: u64::MAX,
            table_miss: false,
        };
        for (n, a) in actions.iter().enumerate() {
            let last = n + 1 == actions.len();
            if matches!(a, Action::Output { port, .. } if *port == action::PORT_TABLE) {
                if last {
                    let mut k = Key::extract(p.data(), in_port);
                    return self.pipeline(p, &mut k, 0, snap, shared);
                }
                if let Some(c) = p.try_clone() {
                    let mut k = Key::extract(c.data(), in_port);
                    self.pipeline(c, &mut k, 0, snap, shared);
                }
                continue;
            }
            match self.act(p, &mut key, a, last, origin, snap, shared, 0) {
                Some(next) => p = next,
                None => return,
            }
        }
    }

    /// Walks the tables from `table` (§5.1), looking each one up.
    fn pipeline(
        &mut self,
        p: Packet,
        key: &mut Key,
        table: usize,
        snap: &Snapshot,
        shared: &Shared,
    ) {
        self.walk(p, key, table, snap, shared, None);
    }

    /// A packet as read ahead: the walk known for its frame bits, else for its key bits, is
    /// taken; else the tables are looked up and the walk remembered when it may be.
    fn receive_one(
        &mut self,
        p: Packet,
        a: &mut Ahead,
        in_port: u32,
        snap: &Snapshot,
        shared: &Shared,
    ) {
        let Some(frame) = a.frame else {
            self.receive_by_key(p, &mut a.key, a.slot, snap, shared);
            return;
        };
        let known = self.traces.as_ref().and_then(|t| t.find_frame(&frame));
        if let Some(w) = known {
            self.tally.cache_hits += 1;
            if let Err(p) = self.take_net(p, w, in_port) {
                a.key.reset(p.data(), in_port);
                self.replay_walk(p, &mut a.key, w, snap, shared);
            }
            return;
        }
        a.key.reset(p.data(), in_port);
        let slot = self.traces.as_ref().map(|t| t.slot(&a.key));
        if let Some(w) = self.receive_by_key(p, &mut a.key, slot, snap, shared) {
            if let Some(t) = &mut self.traces {
                t.remember_frame(&frame, w);
            }
        }
    }

    /// A packet whose key is `key`: the walk remembered for its key bits is taken; else the
    /// tables are looked up and the walk remembered when it may be. Returns the walk's number
    /// in the walk cache when it is there.
    fn receive_by_key(
        &mut self,
        p: Packet,
        key: &mut Key,
        slot: Option<Slot>,
        snap: &Snapshot,
        shared: &Shared,
    ) -> Option<u32> {
        let (Some(traces), Some(slot)) = (self.traces.as_mut(), slot) else {
            self.pipeline(p, key, 0, snap, shared);
            return None;
        };
        if let Some(w) = traces.find(&slot, key) {
            self.tally.cache_hits += 1;
            if let Err(p) = self.take_net(p, w, key.in_port()) {
                self.replay_walk(p, key, w, snap, shared);
            }
            return Some(w);
        }
        let first = *key;
        let mut steps = std::mem::take(&mut self.steps);
        steps.clear();
        self.walk_cut = false;
        self.walk_from_bytes = false;
        self.probe.start(p.data(), key.in_port());
        self.walk(p, key, 0, snap, shared, Some(&mut steps));
        let net = self.probe.finish();
        let mut recorded = None;
        if !self.walk_cut && !self.walk_from_bytes {
            if let Some(traces) = &mut self.traces {
                let counts = &mut self.counts;
                recorded = traces.record(slot, &first, &steps, net, |s, n, b| counts.walk(s, n, b));
            }
        }
        self.steps = steps;
        recorded
    }

    /// Sends `p` by walk `w`'s net effect when the walk has one that holds for `p`; else
    /// hands `p` back.
    #[inline]
    fn take_net(&mut self, p: Packet, w: u32, in_port: u32) -> Result<(), Packet> {
        let Some(traces) = &mut self.traces else {
            return Err(p);
        };
        match traces.net(w).filter(|(n, _)| n.holds(&p, in_port)) {
            Some((_, outputs)) => {
                let len = p.len();
                send_net(p, outputs, &mut self.outbox);
                traces.count(w, len);
                Ok(())
            }
            None => Err(p),
        }
    }

    /// Replays walk `w` of the walk cache on `p`, whose key is `key`.
    fn replay_walk(&mut self, p: Packet, key: &mut Key, w: u32, snap: &Snapshot, shared: &Shared) {
        let mut steps = std::mem::take(&mut self.steps);
        steps.clear();
        if let Some(traces) = &self.traces {
            steps.extend_from_slice(traces.steps(w));
        }
        self.replay(p, key, &steps, snap, shared);
        self.steps = steps;
    }

    /// Looks up each table from `table` and runs the entry found; with `record`, notes each
    /// table's entry there.
    fn walk(
        &mut self,
        mut p: Packet,
        key: &mut Key,
        mut table: usize,
        snap: &Snapshot,
        shared: &Shared,
        mut record: Option<&mut Vec<Step>>,
    ) {
        let mut set: Option<ActionSet> = None;
        let mut origin = Origin::NONE;
        let came_in = p.len() as isize;
        loop {
            self.fresh(key, &p);
            let entries = &snap.tables[table];
            self.counts.lookups[table] += 1;
            let found = match &mut self.caches[table] {
                Some(c) if entries.len() > CACHE_FROM_FLOWS => {
                    let (f, hit) = c.lookup(entries, key);
                    self.tally.cache_hits += hit as u64;
                    f
                }
                _ => pipeline::position(entries, key),
            };
            if let Some(r) = record.as_deref_mut() {
                r.push(Step {
                    table: table as u8,
                    grown: (p.len() as isize - came_in) as i16,
                    at: found.map_or(Step::MISS, |at| at as u32),
                });
            }
            let Some(at) = found else {
                self.counts.misses += 1;
                return;
            };
            match self.run_entry(p, key, table, at, &mut set, &mut origin, snap, shared) {
                Walked::Goto(next, q) => (table, p) = (next, q),
                Walked::End(q) => return self.end_walk(q, key, set, origin, snap, shared),
                Walked::Gone => return,
            }
        }
    }

    /// Runs a remembered walk: each table's entry as a lookup would have found it.
    fn replay(
        &mut self,
        mut p: Packet,
        key: &mut Key,
        steps: &[Step],
        snap: &Snapshot,
        shared: &Shared,
    ) {
        let mut set: Option<ActionSet> = None;
        let mut origin = Origin::NONE;
        for s in steps {
            let table = s.table as usize;
            self.counts.lookups[table] += 1;
            if s.at == Step::MISS {
                self.counts.misses += 1;
                return;
            }
            let at = s.at as usize;
            match self.run_entry(p, key, table, at, &mut set, &mut origin, snap, shared) {
                Walked::Goto(_, q) => p = q,
                Walked::End(q) => return self.end_walk(q, key, set, origin, snap, shared),
                Walked::Gone => return,
            }
        }
    }

    /// The end of the tables: the action set, if the walk wrote one (§5.10).
    fn end_walk(
        &mut self,
        p: Packet,
        key: &mut Key,
        set: Option<ActionSet>,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
    ) {
        if let Some(set) = set {
            self.fresh(key, &p);
            self.run_set(p, *key, &set, origin, snap, shared, 0);
        }
    }

    /// Runs the instructions of entry `at` of `table` on the packet (§5.9): meter, apply
    /// actions, clear and write the action set, metadata, goto.
    #[allow(clippy::too_many_arguments)]
    fn run_entry<'s>(
        &mut self,
        mut p: Packet,
        key: &mut Key,
        table: usize,
        at: usize,
        set: &mut Option<ActionSet<'s>>,
        origin: &mut Origin,
        snap: &'s Snapshot,
        shared: &Shared,
    ) -> Walked {
        self.counts.matched[table] += 1;
        if !self.counts.entry(table, at, 1, p.len() as u64) {
            // A snapshot the counts were not sized for (none is): counted directly.
            add(&snap.tables[table][at], 1, p.len() as u64, self.now_ns);
        }
        let e = &snap.program.tables[table][at];
        if let Some(id) = e.meter {
            self.probe.spoil();
            self.fresh(key, &p);
            match self.meter(&mut p, key, id, snap) {
                Verdict::Drop => {
                    self.tally.meter_drops += 1;
                    self.walk_cut = true;
                    return Walked::Gone;
                }
                Verdict::Pass | Verdict::Remark(_) => {}
            }
        }
        *origin = Origin {
            table: table as u8,
            cookie: e.cookie,
            table_miss: e.table_miss,
        };
        let apply = snap.program.actions(e.apply);
        let ends_here = e.goto.is_none() && e.write.is_none() && set.is_none();
        for (n, a) in apply.iter().enumerate() {
            let last = ends_here && n + 1 == apply.len();
            match self.act(p, key, a, last, *origin, snap, shared, 0) {
                Some(next) => p = next,
                None => return Walked::Gone,
            }
        }
        if e.clear {
            *set = None;
        }
        if let Some(w) = e.write {
            set.get_or_insert_with(ActionSet::new)
                .write(snap.program.actions(w));
        }
        if let Some((v, m)) = e.metadata {
            key.set_metadata(key.metadata() & !m | v & m);
        }
        match e.goto {
            // Tables after 0 are at most 63, checked when the entry was added.
            Some(t) => {
                if e.exposes_inner_header {
                    self.walk_from_bytes = true;
                }
                Walked::Goto(t as usize, p)
            }
            None => Walked::End(p),
        }
    }

    /// Runs an action set (end of the pipeline, or a group's bucket).
    #[allow(clippy::too_many_arguments)]
    fn run_set(
        &mut self,
        mut p: Packet,
        mut key: Key,
        set: &ActionSet,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) {
        let mut actions = set.ordered().peekable();
        while let Some(a) = actions.next() {
            let last = actions.peek().is_none();
            match self.act(p, &mut key, a, last, origin, snap, shared, depth) {
                Some(next) => p = next,
                None => return,
            }
        }
    }

    /// Reads the key's packet fields from `p` again if the frame changed since.
    #[inline]
    fn fresh(&mut self, key: &mut Key, p: &Packet) {
        if self.key_stale {
            key.refresh(p.data());
            self.key_stale = false;
        }
    }

    /// One action on `p`; `last` lets an output take the packet instead of a copy. Returns the
    /// packet when there is more to do with it.
    #[allow(clippy::too_many_arguments)]
    fn act(
        &mut self,
        mut p: Packet,
        key: &mut Key,
        a: &Action,
        last: bool,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) -> Option<Packet> {
        match a {
            Action::Output { port, max_len } => {
                if last {
                    self.output(p, key, *port, *max_len, origin, shared);
                    return None;
                }
                if let Some(c) = p.try_clone() {
                    self.output(c, key, *port, *max_len, origin, shared);
                }
                Some(p)
            }
            Action::Group(g) => {
                self.probe.spoil();
                self.fresh(key, &p);
                if last {
                    self.group(p, key, *g, origin, snap, shared, depth);
                    return None;
                }
                if let Some(c) = p.try_clone() {
                    self.group(c, key, *g, origin, snap, shared, depth);
                }
                Some(p)
            }
            Action::SetQueue(_) => Some(p),
            _ => match self.rewrite(&mut p, key, a) {
                Rewrite::Changed => {
                    self.key_stale = true;
                    Some(p)
                }
                Rewrite::Unchanged => Some(p),
                Rewrite::TtlExpired => {
                    self.tally.ttl_drops += 1;
                    self.walk_cut = true;
                    None
                }
                Rewrite::NoRoom => {
                    self.walk_cut = true;
                    None
                }
            },
        }
    }

    /// A rewrite of the frame, watched when a walk's net effect is being worked out.
    #[inline]
    fn rewrite(&mut self, p: &mut Packet, key: &mut Key, a: &Action) -> Rewrite {
        if !self.probe.watching() {
            return action::rewrite(p, key, a);
        }
        let before = p.len();
        let change = self.probe.before(a, p.data());
        let r = action::rewrite(p, key, a);
        if let Some(change) = change {
            self.probe.after(change, before, p.len());
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn group(
        &mut self,
        p: Packet,
        key: &Key,
        id: u32,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) {
        let Some(g) = snap.groups.get(&id) else {
            return;
        };
        if depth >= MAX_GROUP_DEPTH {
            return;
        }
        g.packets.fetch_add(1, Ordering::Relaxed);
        g.bytes.fetch_add(p.len() as u64, Ordering::Relaxed);
        let live = |b: &group::Bucket| bucket_live(b, snap, shared, 0);
        match g.kind {
            group::ALL => {
                let n = g.buckets.len();
                let mut p = Some(p);
                for (i, _) in g.buckets.iter().enumerate() {
                    let copy = if i + 1 == n {
                        p.take()
                    } else {
                        p.as_ref().and_then(Packet::try_clone)
                    };
                    if let Some(c) = copy {
                        self.bucket(c, key, g, i, origin, snap, shared, depth);
                    }
                }
            }
            group::SELECT => {
                if let Some(i) = g.select(key, live) {
                    self.bucket(p, key, g, i, origin, snap, shared, depth);
                }
            }
            group::INDIRECT => {
                if !g.buckets.is_empty() {
                    self.bucket(p, key, g, 0, origin, snap, shared, depth);
                }
            }
            _ => {
                if let Some(i) = g.buckets.iter().position(live) {
                    self.bucket(p, key, g, i, origin, snap, shared, depth);
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn bucket(
        &mut self,
        p: Packet,
        key: &Key,
        g: &Arc<Group>,
        i: usize,
        origin: Origin,
        snap: &Snapshot,
        shared: &Shared,
        depth: usize,
    ) {
        let b = &g.buckets[i];
        b.packets.fetch_add(1, Ordering::Relaxed);
        b.bytes.fetch_add(p.len() as u64, Ordering::Relaxed);
        let mut set = ActionSet::new();
        set.write(&b.actions);
        self.run_set(p, *key, &set, origin, snap, shared, depth + 1);
    }

    fn meter(&mut self, p: &mut Packet, key: &mut Key, id: u32, snap: &Snapshot) -> Verdict {
        let Some(m) = snap.meters.get(&id) else {
            return Verdict::Drop;
        };
        let v = m.measure(p.len(), self.now_ns);
        if let Verdict::Remark(levels) = v {
            let dscp = key.u8(oxm::IP_DSCP);
            let et = key.u16(oxm::ETH_TYPE);
            if et == ethertype::IPV4 || et == ethertype::IPV6 {
                let new = meter::remark_dscp(dscp, levels);
                if new != dscp {
                    action::set_field(p, oxm::IP_DSCP, &[new]);
                    key.refresh(p.data());
                }
            }
        }
        v
    }

    fn output(
        &mut self,
        p: Packet,
        key: &Key,
        port: u32,
        max_len: u16,
        origin: Origin,
        shared: &Shared,
    ) {
        let in_port = key.in_port();
        if matches!(port, ofp::PORT_CONTROLLER | ofp::PORT_FLOOD | ofp::PORT_ALL) {
            // The controller must see each packet; a flood depends on the ports of the moment.
            self.probe.spoil();
        }
        match port {
            ofp::PORT_CONTROLLER => self.packet_in(p, key, max_len, origin, shared),
            ofp::PORT_FLOOD | ofp::PORT_ALL => {
                let n = shared.ports.len() as u32;
                let last = if n == in_port { n - 1 } else { n };
                let mut p = Some(p);
                for o in (1..=last).filter(|o| *o != in_port) {
                    let copy = if o == last {
                        p.take()
                    } else {
                        p.as_ref().and_then(Packet::try_clone)
                    };
                    if let Some(c) = copy {
                        self.send(c, o);
                    }
                }
            }
            ofp::PORT_IN_PORT => self.send(p, in_port),
            // §4.5: a packet leaves by its ingress port only through OFPP_IN_PORT.
            n if n == in_port => {}
            n => self.send(p, n),
        }
    }

    fn send(&mut self, p: Packet, port: u32) {
        if self.probe.watching() && self.outbox.slot(port).is_some() {
            self.probe.output(port, p.data());
        }
        self.outbox.put(p, port);
    }

    fn packet_in(&mut self, p: Packet, key: &Key, max_len: u16, origin: Origin, shared: &Shared) {
        // §7.4.1: a table-miss entry's packets come in as "no match", others as "action".
        let reason = if origin.table_miss { 0 } else { 1 };
        let data = p.data();
        let n = if max_len == 0xffff {
            data.len()
        } else {
            data.len().min(max_len as usize)
        };
        let mut m = ofp::start(ofp::PACKET_IN, 0);
        m.put(ofp::NO_BUFFER);
        m.put(data.len() as u16);
        m.push(reason);
        m.push(origin.table);
        m.put(origin.cookie);
        let in_port = be::net(key.in_port());
        let metadata = key.get(oxm::METADATA);
        let tunnel = key.get(oxm::TUNNEL_ID);
        let mut fields: Vec<oxm::Field> = vec![(oxm::IN_PORT, &in_port, None)];
        if metadata.iter().any(|b| *b != 0) {
            fields.push((oxm::METADATA, metadata, None));
        }
        if tunnel.iter().any(|b| *b != 0) {
            fields.push((oxm::TUNNEL_ID, tunnel, None));
        }
        oxm::write_match(&mut m, &oxm::Match::from_fields(&fields));
        m.extend_from_slice(&[0, 0]);
        m.extend_from_slice(&data[..n]);
        if shared.send_async(Async::PacketIn, reason, &ofp::finish(m)) {
            self.tally.packet_ins += 1;
        } else {
            self.tally.packet_in_drops += 1;
        }
    }

    /// Adds the entries' local counts, and those of the walks' net effects, to `snap`'s
    /// entries (which they are of).
    pub fn flush_entries(&mut self, snap: &Snapshot, now_ns: u64) {
        if let Some(traces) = &mut self.traces {
            let counts = &mut self.counts;
            traces.spend_counts(|s, n, b| counts.walk(s, n, b));
        }
        self.counts.flush_entries(snap, now_ns);
        self.entries_flushed_ns = now_ns;
    }

    /// Adds the local counters to the shared ones; returns the app counters' share. The
    /// entries' counts go every [`ENTRY_FLUSH_NS`]: with many flows a batch meets each
    /// entry about once, and adding per batch cost a locked add and a cache miss per packet
    /// and table.
    pub fn flush(&mut self, snap: &Snapshot, shared: &Shared, now_ns: u64) -> Tally {
        if now_ns.saturating_sub(self.entries_flushed_ns) >= ENTRY_FLUSH_NS {
            self.flush_entries(snap, now_ns);
        }
        self.counts.flush_tables(shared);
        self.tally.misses += std::mem::take(&mut self.counts.misses);
        for (t, pc) in self.outbox.counts.iter_mut().zip(&shared.port_counters) {
            if *t != [0; 3] {
                pc.tx_packets.fetch_add(t[0], Ordering::Relaxed);
                pc.tx_bytes.fetch_add(t[1], Ordering::Relaxed);
                pc.tx_dropped.fetch_add(t[2], Ordering::Relaxed);
                *t = [0; 3];
            }
        }
        std::mem::take(&mut self.tally)
    }
}

/// Sends the copies a walk's net effect makes of `p`.
fn send_net(p: Packet, outputs: &[net::Output], outbox: &mut Outbox) {
    let Some((last, copies)) = outputs.split_last() else {
        return;
    };
    for o in copies {
        if let Some(mut c) = p.try_clone() {
            if o.apply(&mut c) {
                outbox.put(c, o.port);
            }
        }
    }
    let mut p = p;
    if last.apply(&mut p) {
        outbox.put(p, last.port);
    }
}

/// The packets going out by each port, queued on its link a batch at a time (one index update
/// per batch, not per packet), and per port the packets, bytes and drops sent since the last
/// flush.
struct Outbox {
    staged: Vec<Vec<Packet>>,
    counts: Vec<[u64; 3]>,
}

impl Outbox {
    fn new(ports: usize) -> Self {
        Outbox {
            staged: (0..ports).map(|_| Vec::with_capacity(256)).collect(),
            counts: vec![[0; 3]; ports],
        }
    }

    /// Where OpenFlow port `port`'s packets are queued (ports are numbered from 1).
    #[inline]
    fn slot(&self, port: u32) -> Option<usize> {
        (port as usize)
            .checked_sub(1)
            .filter(|i| *i < self.staged.len())
    }

    /// Queues `p` for OpenFlow port `port` (another number drops it).
    #[inline]
    fn put(&mut self, p: Packet, port: u32) {
        if let Some(i) = self.slot(port) {
            self.staged[i].push(p);
        }
    }

    /// Hands the queued packets to the ports' links; those that do not fit are dropped.
    fn send(&mut self, io: &mut Io) {
        for (i, (staged, t)) in self.staged.iter_mut().zip(&mut self.counts).enumerate() {
            if staged.is_empty() {
                continue;
            }
            let n = staged.len() as u64;
            match io.output(i) {
                Some(o) => {
                    let (sent, bytes) = o.transmit_batch_counted(staged);
                    t[0] += sent as u64;
                    t[1] += bytes;
                    t[2] += n - sent as u64;
                }
                None => {
                    t[2] += n;
                    stitch_core::pool::free_batch(staged.drain(..));
                }
            }
        }
    }
}

/// Packets and bytes per entry of each table since the last flush, and the entries whose
/// counts are not zero: dense, so counting touches no entry of the shared pipeline (whose
/// atomics would cost a cache miss and a locked add per packet). Lookups, matches and misses
/// per table likewise.
struct EntryCounts {
    per_entry: Vec<Vec<(u64, u64)>>,
    counted: Vec<(u8, u32)>,
    lookups: [u64; TABLES],
    matched: [u64; TABLES],
    misses: u64,
}

impl Default for EntryCounts {
    fn default() -> Self {
        EntryCounts {
            per_entry: vec![Vec::new(); TABLES],
            counted: Vec::new(),
            lookups: [0; TABLES],
            matched: [0; TABLES],
            misses: 0,
        }
    }
}

impl EntryCounts {
    /// Sizes the counts for `snap`'s tables (all zero: spent on the old ones before).
    fn resize(&mut self, snap: &Snapshot) {
        self.counted.clear();
        for (counts, entries) in self.per_entry.iter_mut().zip(&snap.tables) {
            counts.clear();
            counts.resize(entries.len(), (0, 0));
        }
    }

    /// Counts `n` packets of `bytes` in all against entry `at` of `table`; `false` when there
    /// is no such count.
    #[inline]
    fn entry(&mut self, table: usize, at: usize, n: u64, bytes: u64) -> bool {
        let Some(c) = self.per_entry.get_mut(table).and_then(|t| t.get_mut(at)) else {
            return false;
        };
        if c.0 == 0 {
            self.counted.push((table as u8, at as u32));
        }
        c.0 += n;
        c.1 = c.1.wrapping_add(bytes);
        true
    }

    /// `n` packets of `b` bytes in all took the walk `steps`.
    fn walk(&mut self, steps: &[Step], n: u64, b: u64) {
        for s in steps {
            let table = s.table as usize;
            self.lookups[table] += n;
            if s.at == Step::MISS {
                self.misses += n;
                continue;
            }
            self.matched[table] += n;
            // Each entry saw the frame as long as it was at that table.
            let bytes = b.wrapping_add_signed(n as i64 * s.grown as i64);
            self.entry(table, s.at as usize, n, bytes);
        }
    }

    fn flush_entries(&mut self, snap: &Snapshot, now_ns: u64) {
        for (t, at) in self.counted.drain(..) {
            let (t, at) = (t as usize, at as usize);
            let (n, b) = std::mem::take(&mut self.per_entry[t][at]);
            if let Some(entry) = snap.tables[t].get(at) {
                add(entry, n, b, now_ns);
            }
        }
    }

    fn flush_tables(&mut self, shared: &Shared) {
        for t in 0..TABLES {
            if self.lookups[t] > 0 {
                let c = &shared.table_counters[t];
                c.lookups.fetch_add(self.lookups[t], Ordering::Relaxed);
                c.matched.fetch_add(self.matched[t], Ordering::Relaxed);
                self.lookups[t] = 0;
                self.matched[t] = 0;
            }
        }
    }
}

fn add(e: &FlowEntry, n: u64, b: u64, now_ns: u64) {
    e.packets.fetch_add(n, Ordering::Relaxed);
    e.bytes.fetch_add(b, Ordering::Relaxed);
    e.last_used_ns.store(now_ns, Ordering::Relaxed);
}

/// A fast-failover bucket is live when the port it watches is up and the group it watches
/// has a live bucket (§5.6.1).
fn bucket_live(b: &group::Bucket, snap: &Snapshot, shared: &Shared, depth: usize) -> bool {
    let port_ok = b.watch_port == ofp::PORT_ANY
        || (b.watch_port as usize)
            .checked_sub(1)
            .and_then(|i| shared.port_live.get(i))
            .is_some_and(|l| l.load(Ordering::Relaxed));
    let group_ok = b.watch_group == ofp::GROUP_ANY
        || (depth < MAX_GROUP_DEPTH
            && snap.groups.get(&b.watch_group).is_some_and(|g| {
                g.buckets
                    .iter()
                    .any(|x| bucket_live(x, snap, shared, depth + 1))
            }));
    port_ok && group_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oxm::{Match, ETH_DST, ETH_SRC, ETH_TYPE, IN_PORT, IP_PROTO, UDP_DST, VLAN_VID};
    use crate::pipeline::{FlowMod, Instructions, FC_ADD};
    use crate::State;
    use stitch_core::link::link;
    use stitch_core::pool;

    fn add(
        s: &mut State,
        table: u8,
        priority: u16,
        fields: &[crate::oxm::Field],
        ins: Instructions,
    ) {
        let fm = FlowMod::plain(FC_ADD, table, priority, Match::from_fields(fields), ins);
        s.flows.apply(&fm, 0).unwrap();
    }

    fn then(apply: Vec<Action>, goto: Option<u8>) -> Instructions {
        Instructions {
            goto,
            ..Instructions::apply_actions(apply)
        }
    }

    fn mac(i: u8) -> [u8; 6] {
        [0x0e, 0, 0, 0, 0, i]
    }

    /// Faucet's shape: port 1 is tagged on the way in (VLAN 100), port 2 is a trunk whose
    /// outer tag is popped before the lookup (its inner tag decides); table 1 sends by VLAN and
    /// destination, popping the tag.
    fn pipeline() -> Snapshot {
        let shared = Shared::new(
            "sw",
            &["p1".into(), "p2".into(), "p3".into(), "p4".into()],
            1,
        );
        let mut s = State::default();
        let vid = |v: u16| (0x1000 | v).to_be_bytes();
        add(
            &mut s,
            0,
            10,
            &[(IN_PORT, &be::net(1u32), None)],
            then(
                vec![
                    Action::PushVlan(ethertype::VLAN),
                    Action::SetField {
                        id: VLAN_VID,
                        value: vid(100).to_vec(),
                    },
                ],
                Some(1),
            ),
        );
        add(
            &mut s,
            0,
            10,
            &[(IN_PORT, &be::net(2u32), None)],
            then(vec![Action::PopVlan], Some(1)),
        );
        // UDP to port 53 in VLAN 100 leaves by port 4 whatever its destination: for frames
        // found from their bytes, the UDP port is in their frame key.
        add(
            &mut s,
            1,
            20,
            &[
                (VLAN_VID, &vid(100), None),
                (ETH_TYPE, &[8, 0], None),
                (IP_PROTO, &[17], None),
                (UDP_DST, &be::net(53u16), None),
            ],
            then(vec![Action::PopVlan, Action::output(4)], None),
        );
        for i in 0..20u8 {
            for (v, port) in [(100, 3), (200, 4)] {
                // Some frames leave as they came, some tagged with a new source address or
                // VLAN, some to two ports with different heads.
                let actions = match i % 4 {
                    0 | 1 => vec![Action::PopVlan, Action::output(port)],
                    2 => vec![
                        Action::SetField {
                            id: ETH_SRC,
                            value: mac(0xee).to_vec(),
                        },
                        Action::output(port),
                    ],
                    _ => vec![
                        Action::output(port),
                        Action::SetField {
                            id: VLAN_VID,
                            value: vid(300).to_vec(),
                        },
                        Action::output(2),
                    ],
                };
                add(
                    &mut s,
                    1,
                    10,
                    &[(VLAN_VID, &vid(v), None), (ETH_DST, &mac(i), None)],
                    then(actions, None),
                );
            }
        }
        shared.publish(&s);
        let snap = std::mem::take(&mut *shared.snapshot.lock().unwrap());
        Arc::into_inner(snap).unwrap()
    }

    /// A frame numbered `n`: with `udp_dst`, UDP over IPv4 from a source that changes with
    /// `n`; else of a local ethertype.
    fn frame(dst: u8, tags: &[u16], n: u16, udp_dst: Option<u16>) -> Vec<u8> {
        let mut f = mac(dst).to_vec();
        f.extend_from_slice(&[0x0e, 0, 0, 1, 0, 1]);
        for t in tags {
            f.extend_from_slice(&ethertype::VLAN.to_be_bytes());
            f.put(*t);
        }
        match udp_dst {
            Some(port) => {
                let [hi, lo] = be::net(n);
                f.extend_from_slice(&[8, 0, 0x45, 0, 0, 46, hi, lo, 0, 0, 64, 17, 0, 0]);
                f.extend_from_slice(&[10, 0, hi, lo, 10, 1, 0, 1]);
                f.put(1000 + n);
                f.put(port);
            }
            None => {
                f.extend_from_slice(&[0x88, 0xb5]);
                f.put(n);
            }
        }
        f.resize(64, 0);
        f
    }

    /// What the data path did with the same packets, with the caches (`cache` > 0) or without.
    struct Run {
        /// What each port sent.
        sent: Vec<Vec<Vec<u8>>>,
        /// Each table's entries' packet and byte counts.
        entries: Vec<Vec<(u64, u64)>>,
        /// Packets that took a walk's net effect.
        by_net: u64,
        /// Frame keys the walk cache knows.
        by_frame: usize,
    }

    fn run(cache: usize) -> Run {
        let _ = pool::init(4096, 0);
        let snap = pipeline();
        let shared = Shared::new(
            "sw",
            &["p1".into(), "p2".into(), "p3".into(), "p4".into()],
            1,
        );
        let mut dp = DataPath::new(4, cache);
        dp.clear_caches(&snap);
        let (mut ins, mut outs, mut io_in, mut io_out) = (vec![], vec![], vec![], vec![]);
        for i in 0..4 {
            let (tx, rx) = link(1024);
            ins.push(tx);
            io_in.push((format!("p{i}"), rx));
            let (tx, rx) = link(1024);
            io_out.push((format!("p{i}"), tx));
            outs.push(rx);
        }
        let mut io = Io::new(io_in, io_out);
        let mut sent: Vec<Vec<Vec<u8>>> = vec![Vec::new(); 4];
        for round in 0..4u16 {
            for n in 0..100u16 {
                let dst = (n % 25) as u8; // some destinations are unknown: a miss
                let (port, tags): (usize, Vec<u16>) = match n % 3 {
                    0 if n % 4 == 0 => (0, vec![7]),
                    0 => (0, vec![]),
                    // The same outer tag, different inner tags: the same key bits at table 0.
                    1 => (1, vec![5, 100]),
                    _ => (1, vec![5, 200]),
                };
                let mut p = pool::alloc().unwrap();
                let udp_dst = (n % 2 == 0).then_some(53 + round % 2);
                p.set_data(&frame(dst, &tags, round * 100 + n, udp_dst))
                    .unwrap();
                assert!(ins[port].transmit(p));
            }
            for i in 0..4 {
                dp.receive(i, &snap, &shared, &mut io);
            }
            for (i, rx) in outs.iter_mut().enumerate() {
                sent[i].extend(rx.drain().map(|p| p.data().to_vec()));
            }
        }
        let by_net = dp.traces.as_ref().map_or(0, TraceCache::packets);
        let by_frame = dp.traces.as_ref().map_or(0, TraceCache::frames_known);
        dp.flush_entries(&snap, 0);
        let entries = snap
            .tables
            .iter()
            .map(|t| {
                t.iter()
                    .map(|e| {
                        (
                            e.packets.load(Ordering::Relaxed),
                            e.bytes.load(Ordering::Relaxed),
                        )
                    })
                    .collect()
            })
            .collect();
        Run {
            sent,
            entries,
            by_net,
            by_frame,
        }
    }

    #[test]
    fn remembered_walks_send_and_count_what_lookups_do() {
        let looked_up = run(0);
        let cached = run(8192);
        let counts = |r: &Run| r.sent.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(counts(&looked_up), [0, 22, 164, 170]);
        assert!(
            cached.sent == looked_up.sent,
            "with the caches, the ports sent {:?} (without: {:?}) or other frames",
            counts(&cached),
            counts(&looked_up)
        );
        assert_eq!(cached.entries, looked_up.entries);
        // Single-tagged and untagged IPv4 frames were found by their bytes.
        assert!(cached.by_frame > 10, "{} frame keys known", cached.by_frame);
        // Port 1's frames of a known flow took its net effect (136 frames, of which those of
        // the first two rounds mostly new flows); the trunk's are replayed (a pop before a
        // lookup brings back the inner tag).
        assert!(
            cached.by_net > 80,
            "{} packets took a net effect",
            cached.by_net
        );
    }
}
