//! The switch's data path: each packet walks the flow tables from table 0 (§5.1), running its
//! entries' instructions, then its action set (§5.10); groups and meters on the way. Counters
//! are kept locally and added to the shared ones once per push, not once per packet.
//!
//! Its parts: `action_set` (the set's order), the walk here, `actions` (what an action does:
//! rewrites, groups, meters, outputs, packet-ins), `outbox` (packets queued per port, sent a
//! batch at a time) and `counts` (per-entry and per-table counts kept locally).

mod action_set;
mod actions;
mod counts;
mod outbox;
#[cfg(test)]
mod tests;

use action_set::ActionSet;
use counts::{add, EntryCounts};
use outbox::Outbox;

use crate::action::{self, Action};
use crate::cache::{ExactMatchCache, FrameSlot, Slot, Step, TraceCache, CACHE_FROM_FLOWS};
use crate::meter::Verdict;
use crate::net::{self, Probe};
use crate::oxm::Key;
use crate::pipeline::{self, TABLES};
use crate::{Shared, Snapshot};
use std::sync::atomic::Ordering;
use stitch_core::app::Io;
use stitch_core::Packet;

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
