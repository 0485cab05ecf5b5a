//! The switch's data path: each packet walks the flow tables from table 0 (§5.1), running its
//! entries' instructions, then its action set (§5.10); groups and meters on the way. Counters
//! are kept locally and added to the shared ones once per push, not once per packet.

use crate::action::{self, Action, Rewrite};
use crate::group::{self, Group};
use crate::meter::{self, Verdict};
use crate::ofp;
use crate::oxm::{self, Key};
use crate::pipeline::{self, FlowEntry, TABLES};
use crate::{Async, Shared, Snapshot};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use stitch_core::app::Io;
use stitch_core::Packet;

/// Below this many flows a scan is as cheap as hashing the key.
const CACHE_FROM_FLOWS: usize = 8;
/// How many packets ahead of the one in hand the data path prefetches.
const PREFETCH: usize = 4;
/// Groups may chain; a chain this deep is a loop that slipped through.
const MAX_GROUP_DEPTH: usize = 8;

/// An exact-match cache in front of a table's priority scan, as Open vSwitch keeps one in
/// front of its classifier: every field a match can look at is in the key, so a packet with
/// the same key always meets the same first entry, and the answer (an entry's index, or a
/// miss) can be remembered. Emptied whenever the pipeline changes; bounded, emptied when full.
pub struct ExactMatchCache {
    map: HashMap<Key, Option<u32>, foldhash::fast::RandomState>,
    capacity: usize,
}

impl ExactMatchCache {
    pub fn new(capacity: usize) -> Self {
        ExactMatchCache {
            map: HashMap::with_capacity_and_hasher(capacity.min(1024), Default::default()),
            capacity,
        }
    }

    /// The first matching entry's index, from the cache (`true`) or by a scan that then
    /// fills it (`false`).
    #[inline]
    pub fn lookup(&mut self, entries: &[Arc<FlowEntry>], k: &Key) -> (Option<usize>, bool) {
        if let Some(hit) = self.map.get(k) {
            return (hit.map(|i| i as usize), true);
        }
        let found = pipeline::position(entries, k);
        if self.map.len() >= self.capacity {
            self.map.clear();
        }
        self.map.insert(*k, found.map(|i| i as u32));
        (found, false)
    }
}

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

pub struct DataPath {
    caches: Vec<Option<ExactMatchCache>>,
    /// Per table: the entry (index in the snapshot's table) packets met last, and how many
    /// packets and bytes since it was last counted.
    runs: Vec<Option<(usize, u64, u64)>>,
    lookups: [u64; TABLES],
    matched: [u64; TABLES],
    /// Per port: packets, bytes and drops sent since the last flush.
    tx: Vec<[u64; 3]>,
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
            runs: vec![None; TABLES],
            lookups: [0; TABLES],
            matched: [0; TABLES],
            tx: vec![[0; 3]; ports],
            tally: Tally::default(),
            batch: Vec::with_capacity(256),
            now_ns: 0,
        }
    }

    pub fn clear_caches(&mut self) {
        for c in self.caches.iter_mut().flatten() {
            c.map.clear();
        }
        // Runs name entries of the old snapshot; they were flushed with it.
        self.runs.iter_mut().for_each(|r| *r = None);
    }

    /// Takes port `i`'s input and sends every packet through the pipeline.
    pub fn receive(&mut self, i: usize, snap: &Snapshot, shared: &Shared, io: &mut Io) {
        let Some(input) = io.input(i) else { return };
        let mut batch = std::mem::take(&mut self.batch);
        batch.extend(input.drain());
        if batch.is_empty() {
            self.batch = batch;
            return;
        }
        self.now_ns = shared.now_ns();
        let pc = &shared.port_counters[i];
        pc.rx_packets
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        pc.rx_bytes.fetch_add(
            batch.iter().map(|p| p.len() as u64).sum(),
            Ordering::Relaxed,
        );
        let port = i as u32 + 1;
        // One key, refilled in place for each packet (it is too big to move around).
        let mut key = Key::default();
        // Headers are read a few packets ahead, so their lines are in cache when parsed.
        for p in batch.iter().take(PREFETCH) {
            p.prefetch_data();
        }
        let mut rest = batch.drain(..);
        while let Some(p) = rest.next() {
            if let Some(ahead) = rest.as_slice().get(PREFETCH - 1) {
                ahead.prefetch_data();
            }
            key.reset(p.data(), port);
            self.pipeline(p, &mut key, 0, snap, shared, io);
        }
        drop(rest);
        self.batch = batch;
    }

    /// A PACKET_OUT: its actions on the frame (output to OFPP_TABLE runs the pipeline).
    pub fn packet_out(
        &mut self,
        mut p: Packet,
        in_port: u32,
        actions: &[Action],
        snap: &Snapshot,
        shared: &Shared,
        io: &mut Io,
    ) {
        self.now_ns = shared.now_ns();
        let mut key = Key::extract(p.data(), in_port);
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
                    return self.pipeline(p, &mut k, 0, snap, shared, io);
                }
                if let Some(c) = p.try_clone() {
                    let mut k = Key::extract(c.data(), in_port);
                    self.pipeline(c, &mut k, 0, snap, shared, io);
                }
                continue;
            }
            match self.act(p, &mut key, a, last, origin, snap, shared, io, 0) {
                Some(next) => p = next,
                None => return,
            }
        }
    }

    /// Walks the tables from `table` (§5.1).
    fn pipeline(
        &mut self,
        mut p: Packet,
        key: &mut Key,
        mut table: usize,
        snap: &Snapshot,
        shared: &Shared,
        io: &mut Io,
    ) {
        let mut set: Option<ActionSet> = None;
        // The entry the packet last met: a packet-in names its table and cookie.
        let mut origin: Origin;
        loop {
            let entries = &snap.tables[table];
            self.lookups[table] += 1;
            let found = match &mut self.caches[table] {
                Some(c) if entries.len() > CACHE_FROM_FLOWS => {
                    let (f, hit) = c.lookup(entries, key);
                    self.tally.cache_hits += hit as u64;
                    f
                }
                _ => pipeline::position(entries, key),
            };
            let Some(at) = found else {
                self.tally.misses += 1;
                return;
            };
            self.matched[table] += 1;
            self.count(table, at, p.len(), snap);
            let e = &entries[at];
            let ins = &e.instructions;
            if let Some(id) = ins.meter {
                match self.meter(&mut p, key, id, snap) {
                    Verdict::Drop => {
                        self.tally.meter_drops += 1;
                        return;
                    }
                    Verdict::Pass | Verdict::Remark(_) => {}
                }
            }
            origin = Origin {
                table: table as u8,
                cookie: e.cookie,
                table_miss: e.is_table_miss(),
            };
            let ends_here = ins.goto.is_none() && ins.write.is_none() && set.is_none();
            for (n, a) in ins.apply.iter().enumerate() {
                let last = ends_here && n + 1 == ins.apply.len();
                match self.act(p, key, a, last, origin, snap, shared, io, 0) {
                    Some(next) => p = next,
                    None => return,
                }
            }
            if ins.clear {
                set = None;
            }
            if let Some(w) = &ins.write {
                set.get_or_insert_with(ActionSet::new).write(w);
            }
            if let Some((v, m)) = ins.metadata {
                key.set_metadata(key.metadata() & !m | v & m);
            }
            match ins.goto {
                Some(t) => table = t as usize,
                None => break,
            }
            // Tables after 0 are at most 63, checked when the entry was added.
        }
        if let Some(set) = set {
            self.run_set(p, *key, &set, origin, snap, shared, io, 0);
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
        io: &mut Io,
        depth: usize,
    ) {
        let mut actions = set.ordered().peekable();
        while let Some(a) = actions.next() {
            let last = actions.peek().is_none();
            match self.act(p, &mut key, a, last, origin, snap, shared, io, depth) {
                Some(next) => p = next,
                None => return,
            }
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
        io: &mut Io,
        depth: usize,
    ) -> Option<Packet> {
        match a {
            Action::Output { port, max_len } => {
                if last {
                    self.output(p, key, *port, *max_len, origin, shared, io);
                    return None;
                }
                if let Some(c) = p.try_clone() {
                    self.output(c, key, *port, *max_len, origin, shared, io);
                }
                Some(p)
            }
            Action::Group(g) => {
                if last {
                    self.group(p, key, *g, origin, snap, shared, io, depth);
                    return None;
                }
                if let Some(c) = p.try_clone() {
                    self.group(c, key, *g, origin, snap, shared, io, depth);
                }
                Some(p)
            }
            Action::SetQueue(_) => Some(p),
            _ => match action::rewrite(&mut p, key, a) {
                Rewrite::Changed => {
                    key.refresh(p.data());
                    Some(p)
                }
                Rewrite::Unchanged => Some(p),
                Rewrite::TtlExpired => {
                    self.tally.ttl_drops += 1;
                    None
                }
                Rewrite::NoRoom => None,
            },
        }
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
        io: &mut Io,
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
                        self.bucket(c, key, g, i, origin, snap, shared, io, depth);
                    }
                }
            }
            group::SELECT => {
                if let Some(i) = g.select(key, live) {
                    self.bucket(p, key, g, i, origin, snap, shared, io, depth);
                }
            }
            group::INDIRECT => {
                if !g.buckets.is_empty() {
                    self.bucket(p, key, g, 0, origin, snap, shared, io, depth);
                }
            }
            _ => {
                if let Some(i) = g.buckets.iter().position(live) {
                    self.bucket(p, key, g, i, origin, snap, shared, io, depth);
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
        io: &mut Io,
        depth: usize,
    ) {
        let b = &g.buckets[i];
        b.packets.fetch_add(1, Ordering::Relaxed);
        b.bytes.fetch_add(p.len() as u64, Ordering::Relaxed);
        let mut set = ActionSet::new();
        set.write(&b.actions);
        self.run_set(p, *key, &set, origin, snap, shared, io, depth + 1);
    }

    fn meter(&mut self, p: &mut Packet, key: &mut Key, id: u32, snap: &Snapshot) -> Verdict {
        let Some(m) = snap.meters.get(&id) else {
            return Verdict::Drop;
        };
        let v = m.measure(p.len(), self.now_ns);
        if let Verdict::Remark(levels) = v {
            let dscp = key.u8(oxm::IP_DSCP);
            let et = key.u16(oxm::ETH_TYPE);
            if et == 0x0800 || et == 0x86dd {
                let new = meter::remark_dscp(dscp, levels);
                if new != dscp {
                    action::set_field(p, oxm::IP_DSCP, &[new]);
                    key.refresh(p.data());
                }
            }
        }
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn output(
        &mut self,
        p: Packet,
        key: &Key,
        port: u32,
        max_len: u16,
        origin: Origin,
        shared: &Shared,
        io: &mut Io,
    ) {
        let in_port = key.in_port();
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
                        self.send(c, o, io);
                    }
                }
            }
            ofp::PORT_IN_PORT => self.send(p, in_port, io),
            // §4.5: a packet leaves by its ingress port only through OFPP_IN_PORT.
            n if n == in_port => {}
            n => self.send(p, n, io),
        }
    }

    fn send(&mut self, p: Packet, port: u32, io: &mut Io) {
        let Some(i) = (port as usize)
            .checked_sub(1)
            .filter(|i| *i < self.tx.len())
        else {
            return;
        };
        let len = p.len() as u64;
        let t = &mut self.tx[i];
        if io.output(i).is_some_and(|o| o.transmit(p)) {
            t[0] += 1;
            t[1] += len;
        } else {
            t[2] += 1;
        }
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
        m.extend_from_slice(&ofp::NO_BUFFER.to_be_bytes());
        m.extend_from_slice(&(data.len() as u16).to_be_bytes());
        m.push(reason);
        m.push(origin.table);
        m.extend_from_slice(&origin.cookie.to_be_bytes());
        let in_port = key.in_port().to_be_bytes();
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

    /// Counts a packet of `len` bytes against entry `at` of `table`: runs of packets that meet
    /// the same entry are added in one go.
    #[inline]
    fn count(&mut self, table: usize, at: usize, len: usize, snap: &Snapshot) {
        match &mut self.runs[table] {
            Some((e, n, b)) if *e == at => {
                *n += 1;
                *b += len as u64;
            }
            run => {
                if let Some((e, n, b)) = run.take() {
                    add(&snap.tables[table][e], n, b, self.now_ns);
                }
                *run = Some((at, 1, len as u64));
            }
        }
    }

    /// Adds the local counters to the shared ones; returns the app counters' share.
    pub fn flush(&mut self, snap: &Snapshot, shared: &Shared, now_ns: u64) -> Tally {
        for (t, run) in self.runs.iter_mut().enumerate() {
            if let Some((e, n, b)) = run.take() {
                if let Some(entry) = snap.tables[t].get(e) {
                    add(entry, n, b, now_ns);
                }
            }
        }
        for t in 0..TABLES {
            if self.lookups[t] > 0 {
                let c = &shared.table_counters[t];
                c.lookups.fetch_add(self.lookups[t], Ordering::Relaxed);
                c.matched.fetch_add(self.matched[t], Ordering::Relaxed);
                self.lookups[t] = 0;
                self.matched[t] = 0;
            }
        }
        for (t, pc) in self.tx.iter_mut().zip(&shared.port_counters) {
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
