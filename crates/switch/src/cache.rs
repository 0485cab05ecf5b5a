//! The data path's caches, as Open vSwitch keeps them in front of its classifier: what a
//! lookup found is remembered under the key bits the lookup looked at, so the next packet
//! with the same bits skips the lookup.
//!
//! - [`ExactMatchCache`]: per table, key bits → the first matching entry.
//! - [`TraceCache`]: per pipeline, key bits → the whole walk (each table's entry), so a packet
//!   of a known flow skips every lookup and only runs its entries' instructions — or, when the
//!   walk has a [`Net`] effect, only that.
//!
//! Both are keyed on the union of the match masks concerned — in a [`CompactKey`] when it
//! fits, which keeps the caches small enough for the core's own caches and lets packets that
//! differ only in fields nobody looks at share an entry — and emptied whenever the pipeline
//! changes.

use crate::frame_key::{self, FrameBits};
use crate::net::{self, Net};
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
#[derive(Clone, Copy, Default, Eq)]
pub struct CompactKey([u64; COMPACT_WORDS]);

impl CompactKey {
    /// The hash that places the key in a [`CompactMap`] (fixed seeds: the maps are per
    /// data path, and a key's place only needs to be the same within one).
    /// Independent folded multiplies of the first `pairs` word pairs (the others are zero for
    /// every key of a map), summed and folded once more (the scheme of foldhash's long
    /// inputs): a few cycles, where hashing word by word through `Hasher` chains eight
    /// dependent multiplies.
    #[inline]
    fn hash(&self, pairs: usize) -> u64 {
        // Digits of pi, as foldhash's fixed seeds.
        const SEEDS: [u64; 10] = [
            0x243f_6a88_85a3_08d3,
            0x1319_8a2e_0370_7344,
            0xa409_3822_299f_31d0,
            0x082e_fa98_ec4e_6c89,
            0x4528_21e6_38d0_1377,
            0xbe54_66cf_34e9_0c6c,
            0xc0ac_29b7_c97c_50dd,
            0x3f84_d5b5_b547_0917,
            0x9216_d5d9_8979_fb1b,
            0xd131_0ba6_98df_b5ac,
        ];
        let fold = |a: u64, b: u64| {
            let m = a as u128 * b as u128;
            m as u64 ^ (m >> 64) as u64
        };
        let w = &self.0;
        let sum = (0..pairs.min(COMPACT_WORDS / 2)).fold(0u64, |h, i| {
            h.wrapping_add(fold(
                w[2 * i] ^ SEEDS[2 * i],
                w[2 * i + 1] ^ SEEDS[2 * i + 1],
            ))
        });
        fold(sum ^ SEEDS[8], SEEDS[9])
    }
}

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
        /// Word pairs in use (the words past them have a zero mask).
        pairs: u8,
    },
    Whole,
}

/// The key bits some of `entries` look at: the union of their match masks, word by word.
fn mask_union<'a>(entries: impl Iterator<Item = &'a FlowEntry>) -> [u64; KEY_WORDS] {
    let mut union = [0u64; KEY_WORDS];
    for e in entries {
        for w in &e.matching.words {
            union[w.index as usize] |= w.mask;
        }
    }
    union
}

impl KeyBits {
    /// Keyed on the key bits `union` (see [`mask_union`]).
    fn of(union: &[u64; KEY_WORDS]) -> KeyBits {
        let used = union.iter().filter(|m| **m != 0).count();
        if used > COMPACT_WORDS {
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
        KeyBits::Compact {
            index,
            mask,
            pairs: used.div_ceil(2) as u8,
        }
    }
}

/// A bounded map from key bits to `V`.
struct BitsMap<V> {
    bits: KeyBits,
    compact: CompactMap<V>,
    whole: HashMap<Key, V, foldhash::fast::RandomState>,
    capacity: usize,
}

/// Where a key's value is, or goes: the key's bits and their hash, taken once for the lookup
/// and the insert.
#[derive(Clone, Copy)]
pub enum Slot {
    Compact(CompactKey, u64),
    Whole,
}

impl<V: Copy + Default> BitsMap<V> {
    fn new(capacity: usize) -> Self {
        BitsMap {
            bits: KeyBits::Whole,
            compact: CompactMap::new(capacity),
            whole: HashMap::with_capacity_and_hasher(capacity.min(1024), Default::default()),
            capacity,
        }
    }

    fn reset(&mut self, bits: KeyBits) {
        self.bits = bits;
        self.clear();
    }

    fn clear(&mut self) {
        self.compact.clear();
        self.whole.clear();
    }

    #[inline]
    fn slot(&self, k: &Key) -> Slot {
        match &self.bits {
            // Unused slots have a zero mask: they hold zero whatever the key.
            KeyBits::Compact { index, mask, pairs } => {
                let c = CompactKey(std::array::from_fn(|j| k.word(index[j] as usize) & mask[j]));
                Slot::Compact(c, c.hash(*pairs as usize))
            }
            KeyBits::Whole => Slot::Whole,
        }
    }

    /// Brings in the cache lines where the slot's value would be.
    #[inline]
    fn prefetch(&self, slot: &Slot) {
        if let Slot::Compact(_, hash) = slot {
            self.compact.prefetch(*hash);
        }
    }

    #[inline]
    fn get(&self, slot: &Slot, k: &Key) -> Option<V> {
        match slot {
            Slot::Compact(c, hash) => self.compact.get(*hash, c),
            Slot::Whole => self.whole.get(k).copied(),
        }
    }

    /// Inserts (in place of an older key when the places for it are taken).
    fn insert(&mut self, slot: Slot, k: &Key, v: V) {
        match slot {
            Slot::Compact(c, hash) => self.compact.insert(hash, c, v),
            Slot::Whole => {
                if self.whole.len() >= self.capacity {
                    self.whole.clear();
                }
                self.whole.insert(*k, v);
            }
        }
    }
}

/// Compact keys → `V` in a fixed array where each key has two places, found from its hash, as
/// in Open vSwitch's exact-match cache: a new key whose places are both taken replaces the
/// second one's. Unlike a general hash map it never grows, empties in constant time (entries
/// of an older generation are empty) and can be fetched ahead of its use ([`Self::prefetch`]).
struct CompactMap<V> {
    entries: Vec<CompactEntry<V>>,
    size: usize,
    generation: u32,
}

#[derive(Clone, Copy, Default)]
struct CompactEntry<V> {
    key: CompactKey,
    generation: u32,
    value: V,
}

impl<V: Copy + Default> CompactMap<V> {
    fn new(capacity: usize) -> Self {
        CompactMap {
            // Allocated at the first insert: most tables never need one.
            entries: Vec::new(),
            size: capacity.max(2).next_power_of_two(),
            generation: 1,
        }
    }

    #[inline]
    fn places(&self, hash: u64) -> [usize; 2] {
        let mask = self.size - 1;
        [hash as usize & mask, (hash >> 32) as usize & mask]
    }

    fn clear(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            // Every 2^32 clears: old generations would come back.
            self.entries.fill(CompactEntry::default());
            self.generation = 1;
        }
    }

    /// Brings in the lines of the key's first place: a key takes its second place only when
    /// another holds the first, so most keys are found in the first (fetching both places too
    /// measured 4-18 % slower on Faucet's pipeline, `docs/benchmarks.md`).
    #[inline]
    fn prefetch(&self, hash: u64) {
        if let Some(e) = self.entries.get(self.places(hash)[0]) {
            let at = e as *const CompactEntry<V> as *const u8;
            stitch_core::prefetch(at);
            stitch_core::prefetch(at.wrapping_add(std::mem::size_of::<CompactEntry<V>>() - 1));
        }
    }

    #[inline]
    fn get(&self, hash: u64, key: &CompactKey) -> Option<V> {
        self.places(hash).into_iter().find_map(|i| {
            let e = self.entries.get(i)?;
            (e.generation == self.generation && e.key == *key).then_some(e.value)
        })
    }

    fn insert(&mut self, hash: u64, key: CompactKey, value: V) {
        if self.entries.is_empty() {
            self.entries = vec![CompactEntry::default(); self.size];
        }
        let [first, second] = self.places(hash);
        let free_or_same = |e: &CompactEntry<V>| e.generation != self.generation || e.key == key;
        let at = if free_or_same(&self.entries[first]) {
            first
        } else {
            second
        };
        self.entries[at] = CompactEntry {
            key,
            generation: self.generation,
            value,
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
        self.map
            .reset(KeyBits::of(&mask_union(entries.iter().map(|e| &**e))));
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

/// One table of a walk: the entry the packet met there, or [`Step::MISS`], and how much longer
/// than it came in the frame was there (an entry counts the bytes it saw).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub table: u8,
    pub grown: i16,
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
/// A walk may also have a [`Net`] effect, which packets it holds for take instead of the
/// walk; they are counted on the walk and the counts spent on its entries later
/// ([`TraceCache::spend_counts`]).
pub struct TraceCache {
    map: BitsMap<u32>,
    /// The same walks found from an IPv4 frame's bytes, before its key is read.
    frame_bits: Option<FrameBits>,
    by_frame: CompactMap<u32>,
    walks: Vec<Walk>,
    steps: Vec<Step>,
    outputs: Vec<net::Output>,
    /// Walks whose counts are not zero.
    counted: Vec<u32>,
    /// Most walks remembered before the cache starts over.
    capacity: usize,
    /// Whether some table is big enough for a lookup to cost more than the cache's own probe
    /// (with only small tables, scanning them is cheaper than hashing the key bits).
    worth_it: bool,
}

/// A remembered walk: its steps, its net effect, and the packets that took the net effect
/// since the counts were last spent.
struct Walk {
    steps_at: u32,
    steps: u8,
    net: Option<Net>,
    packets: u64,
    bytes: u64,
}

impl TraceCache {
    pub fn new(capacity: usize) -> Self {
        TraceCache {
            map: BitsMap::new(capacity),
            frame_bits: None,
            by_frame: CompactMap::new(capacity),
            walks: Vec::new(),
            steps: Vec::new(),
            outputs: Vec::new(),
            counted: Vec::new(),
            capacity,
            worth_it: false,
        }
    }

    /// Forgets every walk and takes the bits to key on from all of the pipeline's tables. The
    /// counts are of the old pipeline's entries: [`TraceCache::spend_counts`] on it first.
    pub fn reset(&mut self, tables: &[Vec<Arc<FlowEntry>>]) {
        self.clear(|_, _, _| {});
        let union = mask_union(tables.iter().flatten().map(|e| &**e));
        self.map.reset(KeyBits::of(&union));
        let key_mask = std::array::from_fn(|i| union[i / 8].to_ne_bytes()[i % 8]);
        self.frame_bits = Some(FrameBits::of(&key_mask));
        self.worth_it = tables.iter().any(|t| t.len() > CACHE_FROM_FLOWS);
    }

    fn clear(&mut self, spend: impl FnMut(&[Step], u64, u64)) {
        self.spend_counts(spend);
        self.map.clear();
        self.by_frame.clear();
        self.walks.clear();
        self.steps.clear();
        self.outputs.clear();
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

    /// Brings in the cache lines where the walk for `slot` would be, for a packet a few on.
    #[inline]
    pub fn prefetch(&self, slot: &Slot) {
        self.map.prefetch(slot);
    }

    /// The walk remembered for these key bits.
    #[inline]
    pub fn find(&self, slot: &Slot, k: &Key) -> Option<u32> {
        self.map.get(slot, k)
    }

    /// Where the walk for a frame of one of [`FrameBits`]' shapes entering by `in_port` is
    /// found from its bytes (`None` for other frames: their walks are found from their keys).
    #[inline]
    pub fn frame_slot(&self, frame: &[u8], in_port: u32) -> Option<FrameSlot> {
        let words = self.frame_bits.as_ref()?.key(frame, in_port)?;
        let key = CompactKey(std::array::from_fn(|i| words.get(i).copied().unwrap_or(0)));
        Some(FrameSlot(key, key.hash(frame_key::WORDS.div_ceil(2))))
    }

    /// Brings in the cache lines where the walk for `slot` would be.
    #[inline]
    pub fn prefetch_frame(&self, slot: &FrameSlot) {
        self.by_frame.prefetch(slot.1);
    }

    /// The walk known for the frame bits of `slot`.
    #[inline]
    pub fn find_frame(&self, slot: &FrameSlot) -> Option<u32> {
        self.by_frame.get(slot.1, &slot.0)
    }

    /// Frames with the bits of `slot` take walk `w` (found or recorded from the key bits of
    /// one of them).
    pub fn remember_frame(&mut self, slot: &FrameSlot, w: u32) {
        self.by_frame.insert(slot.1, slot.0, w);
    }

    /// The steps of walk `w`.
    #[inline]
    pub fn steps(&self, w: u32) -> &[Step] {
        let w = &self.walks[w as usize];
        &self.steps[w.steps_at as usize..w.steps_at as usize + w.steps as usize]
    }

    /// The net effect of walk `w` and its outputs, when it has one.
    #[inline]
    pub fn net(&self, w: u32) -> Option<(&Net, &[net::Output])> {
        let net = self.walks[w as usize].net.as_ref()?;
        let at = net.outputs_at as usize;
        Some((net, &self.outputs[at..at + net.outputs as usize]))
    }

    /// A packet of `len` bytes took walk `w`'s net effect.
    #[inline]
    pub fn count(&mut self, w: u32, len: usize) {
        let walk = &mut self.walks[w as usize];
        if walk.packets == 0 {
            self.counted.push(w);
        }
        walk.packets += 1;
        walk.bytes += len as u64;
    }

    /// Packets that took a net effect since the counts were last spent.
    #[cfg(test)]
    pub fn packets(&self) -> u64 {
        self.counted
            .iter()
            .map(|w| self.walks[*w as usize].packets)
            .sum()
    }

    /// Frame keys whose walk is known.
    #[cfg(test)]
    pub fn frames_known(&self) -> usize {
        let live = |e: &&CompactEntry<u32>| e.generation == self.by_frame.generation;
        self.by_frame.entries.iter().filter(live).count()
    }

    /// Hands each walk's counts to `spend` with its steps, and zeroes them.
    pub fn spend_counts(&mut self, mut spend: impl FnMut(&[Step], u64, u64)) {
        let mut counted = std::mem::take(&mut self.counted);
        for w in counted.drain(..) {
            let walk = &mut self.walks[w as usize];
            let (n, b) = (
                std::mem::take(&mut walk.packets),
                std::mem::take(&mut walk.bytes),
            );
            spend(self.steps(w), n, b);
        }
        self.counted = counted;
    }

    /// Remembers the walk of a packet with these key bits, and its net effect if it has one;
    /// returns its number. A full cache starts over, its counts going to `spend` first.
    pub fn record(
        &mut self,
        slot: Slot,
        k: &Key,
        walk: &[Step],
        net: Option<(Net, &[net::Output])>,
        spend: impl FnMut(&[Step], u64, u64),
    ) -> Option<u32> {
        if walk.is_empty() || walk.len() > u8::MAX as usize {
            return None;
        }
        if self.walks.len() >= self.capacity {
            // Walks replaced in the map still take room here: all go, with the map naming them.
            self.clear(spend);
        }
        let net = net.map(|(mut net, outputs)| {
            net.outputs_at = self.outputs.len() as u32;
            self.outputs.extend_from_slice(outputs);
            net
        });
        let w = self.walks.len() as u32;
        self.map.insert(slot, k, w);
        self.walks.push(Walk {
            steps_at: self.steps.len() as u32,
            steps: walk.len() as u8,
            net,
            packets: 0,
            bytes: 0,
        });
        self.steps.extend_from_slice(walk);
        Some(w)
    }
}

/// Where a frame's walk is in [`TraceCache`]'s map by frame bits: the frame key and its hash.
#[derive(Clone, Copy)]
pub struct FrameSlot(CompactKey, u64);

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
        let step = |table, at| Step {
            table,
            grown: 0,
            at,
        };
        let walk = |t: u8| [step(0, 1), step(t, 2)];
        let mut spent = Vec::new();
        for n in 1..=3u8 {
            let k = key(n);
            cache.record(cache.slot(&k), &k, &walk(n), None, |s, n, _| {
                spent.push((s.to_vec(), n))
            });
            let w = cache.find(&cache.slot(&k), &k).unwrap();
            cache.count(w, 60);
        }
        // The third walk found the map full: only it remains, and only its steps.
        assert!(cache.find(&cache.slot(&key(1)), &key(1)).is_none());
        let w = cache.find(&cache.slot(&key(3)), &key(3)).unwrap();
        assert_eq!(cache.steps(w), walk(3));
        assert_eq!(cache.steps.len(), 2);
        // The counts of the walks it forgot were spent on their steps, none lost.
        assert_eq!(spent, [(walk(1).to_vec(), 1), (walk(2).to_vec(), 1)]);
        cache.spend_counts(|s, n, _| spent.push((s.to_vec(), n)));
        assert_eq!(spent.last(), Some(&(walk(3).to_vec(), 1)));
    }
}
