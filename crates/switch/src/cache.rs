//! The data path's caches, as Open vSwitch keeps them in front of its classifier: what a
//! lookup found is remembered under the key bits the lookup looked at, so the next packet
//! with the same bits skips the lookup.
//!
//! - [`ExactMatchCache`]: per table, key bits → the first matching entry.
//! - [`TraceCache`]: per pipeline, key bits → the whole walk (each table's entry), so a packet
//!   of a known flow skips every lookup and only runs its entries' instructions.
//!
//! Both are keyed on the union of the match masks concerned — in a [`CompactKey`] when it
//! fits, which keeps the caches small enough for the core's own caches and lets packets that
//! differ only in fields nobody looks at share an entry — and emptied whenever the pipeline
//! changes.

use crate::oxm::{Key, KEY_WORDS};
use crate::pipeline::{self, FlowEntry};
use std::collections::HashMap;
use std::sync::Arc;

/// Below this many flows a scan is as cheap as hashing the key.
pub const CACHE_FROM_FLOWS: usize = 8;

/// Most key words a compact cache key holds.
const COMPACT_WORDS: usize = 8;

/// The bits of a key a cache looks at. Hashed and compared word by word: the derived
/// versions go through the byte-slice paths (a call to `memcmp`, the long-input hash).
#[derive(Clone, Copy, Eq)]
pub struct CompactKey([u64; COMPACT_WORDS]);

impl PartialEq for CompactKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .fold(0, |differ, (a, b)| differ | (a ^ b))
            == 0
    }
}

impl std::hash::Hash for CompactKey {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        for w in self.0 {
            state.write_u64(w);
        }
    }
}

/// Which key bits a cache is keyed on: the union of some entries' match masks, word by word,
/// when the words fit a [`CompactKey`]; else the whole key.
#[derive(Clone, Copy)]
enum KeyBits {
    Compact {
        index: [u8; COMPACT_WORDS],
        mask: [u64; COMPACT_WORDS],
    },
    Whole,
}

impl KeyBits {
    fn of<'a>(entries: impl Iterator<Item = &'a FlowEntry>) -> KeyBits {
        let mut union = [0u64; KEY_WORDS];
        for e in entries {
            for w in &e.matching.words {
                union[w.index as usize] |= w.mask;
            }
        }
        if union.iter().filter(|m| **m != 0).count() > COMPACT_WORDS {
            return KeyBits::Whole;
        }
        let (mut index, mut mask) = ([0u8; COMPACT_WORDS], [0u64; COMPACT_WORDS]);
        for (slot, (i, m)) in union
            .iter()
            .enumerate()
            .filter(|(_, m)| **m != 0)
            .enumerate()
        {
            index[slot] = i as u8;
            mask[slot] = *m;
        }
        KeyBits::Compact { index, mask }
    }
}

/// A bounded map from key bits to `V`, emptied when full.
struct BitsMap<V> {
    bits: KeyBits,
    compact: HashMap<CompactKey, V, foldhash::fast::RandomState>,
    whole: HashMap<Key, V, foldhash::fast::RandomState>,
    capacity: usize,
}

/// Where a key's value is, or goes: the key's bits taken once for the lookup and the insert.
#[derive(Clone, Copy)]
pub enum Slot {
    Compact(CompactKey),
    Whole,
}

impl<V: Copy> BitsMap<V> {
    fn new(capacity: usize) -> Self {
        BitsMap {
            bits: KeyBits::Whole,
            compact: HashMap::with_capacity_and_hasher(capacity.min(1024), Default::default()),
            whole: HashMap::with_capacity_and_hasher(capacity.min(1024), Default::default()),
            capacity,
        }
    }

    fn reset(&mut self, bits: KeyBits) {
        self.bits = bits;
        self.compact.clear();
        self.whole.clear();
    }

    fn clear(&mut self) {
        self.compact.clear();
        self.whole.clear();
    }

    #[inline]
    fn slot(&self, k: &Key) -> Slot {
        match &self.bits {
            // Unused slots have a zero mask: they hold zero whatever the key.
            KeyBits::Compact { index, mask } => {
                Slot::Compact(CompactKey(std::array::from_fn(|j| {
                    k.word(index[j] as usize) & mask[j]
                })))
            }
            KeyBits::Whole => Slot::Whole,
        }
    }

    #[inline]
    fn get(&self, slot: &Slot, k: &Key) -> Option<V> {
        match slot {
            Slot::Compact(c) => self.compact.get(c).copied(),
            Slot::Whole => self.whole.get(k).copied(),
        }
    }

    fn is_full(&self) -> bool {
        self.compact.len() + self.whole.len() >= self.capacity
    }

    /// Inserts, emptying the map first when it is full.
    fn insert(&mut self, slot: Slot, k: &Key, v: V) {
        if self.is_full() {
            self.clear();
        }
        match slot {
            Slot::Compact(c) => self.compact.insert(c, v),
            Slot::Whole => self.whole.insert(*k, v),
        };
    }
}

/// Per table: the key bits its entries look at → the first matching entry (or none).
pub struct ExactMatchCache {
    map: BitsMap<Option<u32>>,
}

impl ExactMatchCache {
    pub fn new(capacity: usize) -> Self {
        ExactMatchCache {
            map: BitsMap::new(capacity),
        }
    }

    /// Forgets every answer and takes the bits to key on from the table's `entries`.
    pub fn reset(&mut self, entries: &[Arc<FlowEntry>]) {
        self.map.reset(KeyBits::of(entries.iter().map(|e| &**e)));
    }

    /// The first matching entry's index, from the cache (`true`) or by a scan that then
    /// fills it (`false`).
    #[inline]
    pub fn lookup(&mut self, entries: &[Arc<FlowEntry>], k: &Key) -> (Option<usize>, bool) {
        let slot = self.map.slot(k);
        if let Some(hit) = self.map.get(&slot, k) {
            return (hit.map(|i| i as usize), true);
        }
        let found = pipeline::position(entries, k);
        self.map.insert(slot, k, found.map(|i| i as u32));
        (found, false)
    }
}

/// One table of a walk: the entry the packet met there, or [`Step::MISS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub table: u8,
    pub at: u32,
}

impl Step {
    /// No entry matched: the packet is dropped (§5.4, no table-miss entry).
    pub const MISS: u32 = u32::MAX;
}

/// Per pipeline: the key bits any table looks at → the walk a packet with those bits takes.
/// Replaying a walk is exact when every table's choice depends only on those bits, which holds
/// unless an instruction before a later lookup brings back fields from the packet's bytes
/// (a pop of VLAN, MPLS or PBB exposes an inner header); such walks, and walks a packet's own
/// state cut short (a meter, an expired TTL), are not remembered: see [`TraceCache::record`].
pub struct TraceCache {
    map: BitsMap<(u32, u8)>,
    steps: Vec<Step>,
    /// Whether some table is big enough for a lookup to cost more than the cache's own probe
    /// (with only small tables, scanning them is cheaper than hashing the key bits).
    worth_it: bool,
}

impl TraceCache {
    pub fn new(capacity: usize) -> Self {
        TraceCache {
            map: BitsMap::new(capacity),
            steps: Vec::new(),
            worth_it: false,
        }
    }

    /// Forgets every walk and takes the bits to key on from all of the pipeline's tables.
    pub fn reset(&mut self, tables: &[Vec<Arc<FlowEntry>>]) {
        self.map
            .reset(KeyBits::of(tables.iter().flatten().map(|e| &**e)));
        self.steps.clear();
        self.worth_it = tables.iter().any(|t| t.len() > CACHE_FROM_FLOWS);
    }

    /// Whether packets should go through this cache at all.
    #[inline]
    pub fn worth_it(&self) -> bool {
        self.worth_it
    }

    #[inline]
    pub fn slot(&self, k: &Key) -> Slot {
        self.map.slot(k)
    }

    /// The walk remembered for these key bits, copied into `out`; `false` when there is none.
    #[inline]
    pub fn walk(&self, slot: &Slot, k: &Key, out: &mut Vec<Step>) -> bool {
        let Some((start, len)) = self.map.get(slot, k) else {
            return false;
        };
        out.clear();
        out.extend_from_slice(&self.steps[start as usize..start as usize + len as usize]);
        true
    }

    /// Remembers the walk of a packet with these key bits.
    pub fn record(&mut self, slot: Slot, k: &Key, walk: &[Step]) {
        if walk.is_empty() || walk.len() > u8::MAX as usize {
            return;
        }
        if self.map.is_full() {
            // The walks go with the map that names them.
            self.map.clear();
            self.steps.clear();
        }
        let start = self.steps.len() as u32;
        self.steps.extend_from_slice(walk);
        self.map.insert(slot, k, (start, walk.len() as u8));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> Key {
        let mut k = Key::default();
        k.0[0] = n;
        k
    }

    #[test]
    fn a_full_walk_cache_starts_over_with_its_steps() {
        let mut cache = TraceCache::new(2);
        let walk = |t: u8| [Step { table: 0, at: 1 }, Step { table: t, at: 2 }];
        let mut out = Vec::new();
        for n in 1..=3u8 {
            let k = key(n);
            cache.record(cache.slot(&k), &k, &walk(n));
        }
        // The third walk found the map full: only it remains, and only its steps.
        assert!(!cache.walk(&cache.slot(&key(1)), &key(1), &mut out));
        assert!(cache.walk(&cache.slot(&key(3)), &key(3), &mut out));
        assert_eq!(out, walk(3));
        assert_eq!(cache.steps.len(), 2);
    }
}
