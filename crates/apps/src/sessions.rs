//! Session tables of the stateful functions (the NAT's mappings, the firewall's connections),
//! built for millions of sessions on one core:
//!
//! - [`Sessions`]: fixed-size records in a slab made once for the configured maximum (zero
//!   pages until used, huge pages where the kernel gives them), so a session keeps its number
//!   for life and nothing is allocated or moved per packet.
//! - [`Index`]: an open-addressing index (linear probing, 8-byte slots, at most half full) from
//!   a key's hash to a session; the slot a lookup reads first is known from the hash alone, so
//!   a batch of lookups fetches its slots ahead ([`Index::prefetch`]), then the records.
//! - Expiry without a scan: each session sits in the list of its timeout class (a protocol, a
//!   TCP state), in the order it was last moved there; traffic only sets a session's expiry
//!   time and moves it to its list's tail at most once a [`MOVE_EVERY`]. Reclaiming looks at
//!   the lists' heads only, so it finds what has expired within a second of its time, at a cost
//!   per expired session, never per session held.
//!
//! Times are milliseconds on a [`Clock`], in a wrapping `u32` compared by difference: a
//! timeout must stay under [`MAX_TIMEOUT_SECS`].

use std::time::{Duration, Instant};
use stitch_core::mapping::{Zeroable, ZeroedSlice};

/// Milliseconds on a [`Clock`], wrapping every 49 days.
pub type Millis = u32;

/// The longest timeout a session table takes (12 days): times wrap every 49 days and are
/// compared by their signed difference.
pub const MAX_TIMEOUT_SECS: u64 = 1 << 20;

/// How often at most traffic moves a session to the tail of its list.
pub const MOVE_EVERY: Millis = 1000;

/// Whether time `t` is still ahead of `now`.
#[inline(always)]
pub fn ahead(t: Millis, now: Millis) -> bool {
    (t.wrapping_sub(now) as i32) > 0
}

/// A table's clock: milliseconds since it was made.
#[derive(Clone, Copy)]
pub struct Clock {
    base: Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock {
            base: Instant::now(),
        }
    }
}

impl Clock {
    #[inline]
    pub fn at(&self, t: Instant) -> Millis {
        // Wraps by design (`as` keeps the low bits).
        t.saturating_duration_since(self.base).as_millis() as Millis
    }
}

/// A timeout in seconds as [`Millis`]: refused past [`MAX_TIMEOUT_SECS`] or under a second.
pub fn timeout_millis(what: &str, secs: u64) -> Result<Millis, String> {
    if !(1..=MAX_TIMEOUT_SECS).contains(&secs) {
        return Err(format!(
            "{what}: {secs} s; a timeout is from 1 s to {MAX_TIMEOUT_SECS} s"
        ));
    }
    Ok(Duration::from_secs(secs).as_millis() as Millis)
}

const NONE: u32 = u32::MAX;

/// A session: what its function keeps, and its place in the expiry lists.
#[derive(Clone, Copy)]
#[repr(C)]
struct Entry<T> {
    data: T,
    expires: Millis,
    /// When the session was last put at its list's tail.
    moved: Millis,
    prev: u32,
    next: u32,
    class: u8,
    used: bool,
}

// SAFETY: every field is an integer, a bool (zero is `false`) or a `T` that is `Zeroable`.
unsafe impl<T: Zeroable> Zeroable for Entry<T> {}

#[derive(Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    timeout: Millis,
}

/// The sessions of one function: at most `capacity`, in timeout classes.
pub struct Sessions<T> {
    entries: ZeroedSlice<Entry<T>>,
    /// Entries from here on have never been used.
    fresh: u32,
    /// Entries given back, linked through `next`.
    free: u32,
    len: usize,
    lists: Vec<List>,
}

impl<T> Sessions<T> {
    /// Bytes each session takes in the slab.
    pub const RECORD_BYTES: usize = std::mem::size_of::<Entry<T>>();
}

impl<T: Zeroable + Copy> Sessions<T> {
    /// A table for `capacity` sessions; class `c` times out after `timeouts[c]`.
    pub fn new(capacity: usize, timeouts: &[Millis]) -> Result<Self, String> {
        if capacity == 0 || capacity >= NONE as usize {
            return Err(format!(
                "a session table holds from 1 to {} sessions",
                NONE - 1
            ));
        }
        let entries = ZeroedSlice::new(capacity)
            .map_err(|e| format!("a table of {capacity} sessions: {e}"))?;
        Ok(Sessions {
            entries,
            fresh: 0,
            free: NONE,
            len: 0,
            lists: timeouts
                .iter()
                .map(|&timeout| List {
                    head: NONE,
                    tail: NONE,
                    timeout,
                })
                .collect(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// New timeouts, one per class; sessions keep their expiry times until their next packet.
    pub fn set_timeouts(&mut self, timeouts: &[Millis]) {
        for (l, &t) in self.lists.iter_mut().zip(timeouts) {
            l.timeout = t;
        }
    }

    pub fn timeout(&self, class: u8) -> Millis {
        self.lists[class as usize].timeout
    }

    #[inline(always)]
    pub fn get(&self, id: u32) -> &T {
        &self.entries[id as usize].data
    }

    #[inline(always)]
    pub fn get_mut(&mut self, id: u32) -> &mut T {
        &mut self.entries[id as usize].data
    }

    #[inline(always)]
    pub fn class(&self, id: u32) -> u8 {
        self.entries[id as usize].class
    }

    #[inline(always)]
    pub fn expires(&self, id: u32) -> Millis {
        self.entries[id as usize].expires
    }

    #[inline(always)]
    pub fn is_alive(&self, id: u32, now: Millis) -> bool {
        ahead(self.entries[id as usize].expires, now)
    }

    #[inline(always)]
    pub fn prefetch(&self, id: u32) {
        if let Some(e) = self.entries.get(id as usize) {
            stitch_core::prefetch(e);
        }
    }

    /// A new session of `class`, alive for its class's timeout; `None` when the table is full.
    pub fn insert(&mut self, data: T, class: u8, now: Millis) -> Option<u32> {
        let expires = now.wrapping_add(self.timeout(class));
        self.insert_until(data, class, expires, now)
    }

    /// A new session alive until `expires` (a session taken back from a snapshot).
    pub fn insert_until(
        &mut self,
        data: T,
        class: u8,
        expires: Millis,
        now: Millis,
    ) -> Option<u32> {
        let id = if self.free != NONE {
            let id = self.free;
            self.free = self.entries[id as usize].next;
            id
        } else if (self.fresh as usize) < self.entries.len() {
            self.fresh += 1;
            self.fresh - 1
        } else {
            return None;
        };
        // Queued as moved when its time is up, so the lists stay in order of time.
        let moved = expires.wrapping_sub(self.timeout(class));
        let moved = if ahead(moved, now) { now } else { moved };
        self.entries[id as usize] = Entry {
            data,
            expires,
            moved,
            prev: NONE,
            next: NONE,
            class,
            used: true,
        };
        self.push_tail(id);
        self.len += 1;
        Some(id)
    }

    /// Traffic of a session: alive for its class's timeout from `now`.
    #[inline(always)]
    pub fn refresh(&mut self, id: u32, now: Millis) {
        let e = &mut self.entries[id as usize];
        let timeout = self.lists[e.class as usize].timeout;
        e.expires = now.wrapping_add(timeout);
        if now.wrapping_sub(e.moved) >= MOVE_EVERY {
            self.unlink(id);
            self.entries[id as usize].moved = now;
            self.push_tail(id);
        }
    }

    /// A session moves to another class (a TCP connection established) and is refreshed.
    pub fn set_class(&mut self, id: u32, class: u8, now: Millis) {
        if self.entries[id as usize].class == class {
            return self.refresh(id, now);
        }
        self.unlink(id);
        let timeout = self.timeout(class);
        let e = &mut self.entries[id as usize];
        e.class = class;
        e.moved = now;
        e.expires = now.wrapping_add(timeout);
        self.push_tail(id);
    }

    /// Removes a session; its number may be given to the next one.
    pub fn remove(&mut self, id: u32) -> T {
        debug_assert!(self.entries[id as usize].used);
        self.unlink(id);
        let e = &mut self.entries[id as usize];
        e.used = false;
        e.next = self.free;
        self.free = id;
        self.len -= 1;
        e.data
    }

    /// The oldest session that has expired, if any: the head of a class's list whose time is
    /// up. A head refreshed since it was queued holds its list back until it expires or its
    /// next packet moves it (at most [`MOVE_EVERY`] later).
    pub fn oldest_expired(&self, now: Millis) -> Option<u32> {
        self.lists.iter().find_map(|l| {
            let h = l.head;
            if h == NONE {
                return None;
            }
            let e = &self.entries[h as usize];
            let queued_until = e.moved.wrapping_add(l.timeout);
            (!ahead(queued_until, now) && !ahead(e.expires, now)).then_some(h)
        })
    }

    /// Sessions alive at `now`, with their numbers: for snapshots and queries (a walk of
    /// every list, not a hot path).
    pub fn iter_alive(&self, now: Millis) -> impl Iterator<Item = (u32, &T)> + '_ {
        self.lists.iter().flat_map(move |l| {
            let mut at = l.head;
            std::iter::from_fn(move || {
                while at != NONE {
                    let id = at;
                    let e = &self.entries[id as usize];
                    at = e.next;
                    if ahead(e.expires, now) {
                        return Some((id, &e.data));
                    }
                }
                None
            })
        })
    }

    /// Bytes the slab takes when full.
    pub fn memory_bytes(&self) -> usize {
        self.entries.len() * Self::RECORD_BYTES
    }

    fn push_tail(&mut self, id: u32) {
        let class = self.entries[id as usize].class as usize;
        let tail = self.lists[class].tail;
        {
            let e = &mut self.entries[id as usize];
            e.prev = tail;
            e.next = NONE;
        }
        if tail == NONE {
            self.lists[class].head = id;
        } else {
            self.entries[tail as usize].next = id;
        }
        self.lists[class].tail = id;
    }

    fn unlink(&mut self, id: u32) {
        let Entry {
            prev, next, class, ..
        } = self.entries[id as usize];
        let list = &mut self.lists[class as usize];
        if prev == NONE {
            list.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NONE {
            list.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
    }
}

/// A slot of an [`Index`]: the upper half of a key's hash and the session plus one (0: empty,
/// so a fresh zero page is an empty index).
#[derive(Clone, Copy)]
#[repr(C)]
struct Slot {
    hash: u32,
    session: u32,
}

// SAFETY: two integers.
unsafe impl Zeroable for Slot {}

/// An index from keys to sessions, by the keys' hashes: sized for a table's capacity once
/// (never more than half full, never rebuilt), the key itself compared in the session.
pub struct Index {
    slots: ZeroedSlice<Slot>,
    mask: usize,
    len: usize,
}

/// The half of a 64-bit hash an [`Index`] keeps: its upper bits, the best mixed.
#[inline(always)]
pub fn short_hash(h: u64) -> u32 {
    (h >> 32) as u32
}

impl Index {
    /// An index for up to `sessions` keys.
    pub fn new(sessions: usize) -> Result<Index, String> {
        let n = (sessions * 2).next_power_of_two().max(16);
        let slots =
            ZeroedSlice::new(n).map_err(|e| format!("an index of {sessions} sessions: {e}"))?;
        Ok(Index {
            slots,
            mask: n - 1,
            len: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    #[inline(always)]
    fn home(&self, hash: u32) -> usize {
        hash as usize & self.mask
    }

    /// Brings in the slot a lookup of `hash` reads first.
    #[inline(always)]
    pub fn prefetch(&self, hash: u32) {
        stitch_core::prefetch(&self.slots[self.home(hash)]);
    }

    /// The first session under `hash` for which `is` holds (it compares the key).
    #[inline(always)]
    pub fn find(&self, hash: u32, mut is: impl FnMut(u32) -> bool) -> Option<u32> {
        let mut i = self.home(hash);
        loop {
            let s = self.slots[i];
            if s.session == 0 {
                return None;
            }
            if s.hash == hash && is(s.session - 1) {
                return Some(s.session - 1);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The session of the first entry under `hash`, whatever its key (a hint to prefetch).
    #[inline(always)]
    pub fn first(&self, hash: u32) -> Option<u32> {
        let mut i = self.home(hash);
        loop {
            let s = self.slots[i];
            if s.session == 0 {
                return None;
            }
            if s.hash == hash {
                return Some(s.session - 1);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Adds `session` under `hash`. The caller keeps at most the capacity it gave.
    pub fn insert(&mut self, hash: u32, session: u32) {
        assert!(self.len < self.slots.len() / 2, "index over capacity");
        let mut i = self.home(hash);
        while self.slots[i].session != 0 {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = Slot {
            hash,
            session: session + 1,
        };
        self.len += 1;
    }

    /// Removes `session` from under `hash`, shifting later entries of its run back (no
    /// tombstones, so lookups never slow down with churn).
    pub fn remove(&mut self, hash: u32, session: u32) -> bool {
        let mut hole = self.home(hash);
        loop {
            let s = self.slots[hole];
            if s.session == 0 {
                return false;
            }
            if s.hash == hash && s.session == session + 1 {
                break;
            }
            hole = (hole + 1) & self.mask;
        }
        self.slots[hole] = Slot {
            hash: 0,
            session: 0,
        };
        self.len -= 1;
        let mut i = (hole + 1) & self.mask;
        while self.slots[i].session != 0 {
            let home = self.home(self.slots[i].hash);
            // Move the entry into the hole when the hole lies on its probe path.
            if (i.wrapping_sub(home) & self.mask) >= (i.wrapping_sub(hole) & self.mask) {
                self.slots[hole] = self.slots[i];
                self.slots[i] = Slot {
                    hash: 0,
                    session: 0,
                };
                hole = i;
            }
            i = (i + 1) & self.mask;
        }
        true
    }
}

/// Free ports of one external address and protocol, in a two-level bitmap: whether a given
/// port is free, taking it, and the next free port after any other are each a few word
/// operations, whatever how many are taken — an exhausted range answers at once.
pub struct FreePorts {
    /// Bit `p % 64` of word `p / 64`: port `p` is free.
    words: Box<[u64; 1024]>,
    /// Bit `w % 64` of word `w / 64`: word `w` has a free port.
    summary: [u64; 16],
    free: u32,
}

impl FreePorts {
    /// Every port of `lo..=hi` free, but those `taken` says.
    pub fn new(lo: u16, hi: u16, taken: impl Fn(u16) -> bool) -> FreePorts {
        let mut f = FreePorts {
            words: Box::new([0; 1024]),
            summary: [0; 16],
            free: 0,
        };
        for p in lo..=hi {
            if !taken(p) {
                f.put(p);
            }
        }
        f
    }

    pub fn free(&self) -> u32 {
        self.free
    }

    #[inline]
    pub fn is_free(&self, p: u16) -> bool {
        self.words[p as usize / 64] & (1 << (p % 64)) != 0
    }

    /// Takes port `p` if it is free.
    #[inline]
    pub fn take(&mut self, p: u16) -> bool {
        let w = p as usize / 64;
        let bit = 1u64 << (p % 64);
        if self.words[w] & bit == 0 {
            return false;
        }
        self.words[w] &= !bit;
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
        self.free -= 1;
        true
    }

    /// Gives port `p` back.
    pub fn put(&mut self, p: u16) {
        let w = p as usize / 64;
        let bit = 1u64 << (p % 64);
        if self.words[w] & bit != 0 {
            return;
        }
        self.words[w] |= bit;
        self.summary[w / 64] |= 1 << (w % 64);
        self.free += 1;
    }

    /// Takes the first free port at or after `from` (wrapping past 65535), if any.
    pub fn take_next(&mut self, from: u16) -> Option<u16> {
        let p = self.next_free(from)?;
        self.take(p);
        Some(p)
    }

    fn next_free(&self, from: u16) -> Option<u16> {
        if self.free == 0 {
            return None;
        }
        let w = from as usize / 64;
        let here = self.words[w] & (u64::MAX << (from % 64));
        if here != 0 {
            return Some((w * 64 + here.trailing_zeros() as usize) as u16);
        }
        // The next word with a free port, from the summary: after `w`, then from the start.
        let after = |start: usize| -> Option<usize> {
            let (s, bit) = (start / 64, start % 64);
            if s >= 16 {
                return None;
            }
            let first = self.summary[s] & (u64::MAX << bit);
            if first != 0 {
                return Some(s * 64 + first.trailing_zeros() as usize);
            }
            (s + 1..16)
                .find(|&k| self.summary[k] != 0)
                .map(|k| k * 64 + self.summary[k].trailing_zeros() as usize)
        };
        let word = after(w + 1).or_else(|| after(0))?;
        Some((word * 64 + self.words[word].trailing_zeros() as usize) as u16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    #[repr(C)]
    struct Rec(u64);
    // SAFETY: an integer.
    unsafe impl Zeroable for Rec {}

    #[test]
    fn sessions_expire_in_order_from_the_heads_only() {
        let mut s = Sessions::<Rec>::new(8, &[10_000, 2_000]).unwrap();
        let a = s.insert(Rec(1), 0, 0).unwrap();
        let b = s.insert(Rec(2), 1, 100).unwrap();
        let c = s.insert(Rec(3), 1, 200).unwrap();
        assert_eq!(s.oldest_expired(2_050), None);
        assert_eq!(s.oldest_expired(2_100), Some(b));
        s.remove(b);
        assert_eq!(s.oldest_expired(2_150), None);
        // Traffic within a second sets the time but does not move the session: it holds its
        // list back until its new time, then goes.
        s.refresh(c, 1_000);
        assert_eq!(s.oldest_expired(2_200), None);
        assert_eq!(s.oldest_expired(3_000), Some(c));
        s.remove(c);
        // A session moved by traffic a second later goes to its list's tail.
        s.refresh(a, 1_500);
        assert_eq!(s.oldest_expired(10_500), None);
        assert_eq!(s.oldest_expired(11_500), Some(a));
        assert_eq!(s.len(), 1);
        // Numbers are reused, the table refuses more than its capacity.
        s.remove(a);
        let ids: Vec<u32> = (0..8).map(|i| s.insert(Rec(i), 0, 0).unwrap()).collect();
        assert!(s.insert(Rec(9), 0, 0).is_none());
        assert_eq!(ids.len(), 8);
        assert_eq!(s.iter_alive(1).count(), 8);
        assert_eq!(s.iter_alive(10_001).count(), 0);
    }

    #[test]
    fn times_compare_across_the_wrap() {
        let mut s = Sessions::<Rec>::new(2, &[5_000]).unwrap();
        let now = u32::MAX - 1_000;
        let a = s.insert(Rec(1), 0, now).unwrap();
        assert!(s.is_alive(a, now.wrapping_add(4_999)));
        assert!(!s.is_alive(a, now.wrapping_add(5_000)));
        assert_eq!(s.oldest_expired(now.wrapping_add(5_000)), Some(a));
    }

    #[test]
    fn the_index_agrees_with_a_map_through_insertions_and_removals() {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut index = Index::new(4096).unwrap();
        let mut map = std::collections::HashMap::new();
        for round in 0..100_000u32 {
            // Few distinct hashes: long runs and collisions, where removal shifts entries.
            let hash = rng.u32(..64) * 0x0101_0101;
            let key = rng.u32(..3000);
            match map.get(&key) {
                Some(&(h, _)) if round % 3 == 0 => {
                    assert!(index.remove(h, key));
                    map.remove(&key);
                }
                Some(_) => {}
                None if map.len() < 4096 => {
                    index.insert(hash, key);
                    map.insert(key, (hash, ()));
                }
                None => {}
            }
            let probe = rng.u32(..3000);
            let found = map
                .get(&probe)
                .and_then(|&(h, _)| index.find(h, |s| s == probe));
            assert_eq!(found, map.get(&probe).map(|_| probe));
        }
        assert_eq!(index.len(), map.len());
    }

    #[test]
    fn free_ports_are_found_at_once_and_never_twice() {
        let mut f = FreePorts::new(1024, 65535, |p| p == 2000);
        assert_eq!(f.free(), 64511);
        assert!(!f.is_free(2000) && !f.is_free(80) && f.is_free(1024));
        assert_eq!(f.take_next(1999), Some(1999));
        assert_eq!(f.take_next(1999), Some(2001));
        assert_eq!(f.take_next(65535), Some(65535));
        assert_eq!(f.take_next(65535), Some(1024), "wraps to the start");
        let mut seen = std::collections::HashSet::new();
        while let Some(p) = f.take_next(30000) {
            assert!(seen.insert(p) && (1024..=65535).contains(&p) && p != 2000);
        }
        assert_eq!(f.free(), 0);
        assert_eq!(f.take_next(1), None);
        f.put(40000);
        assert_eq!(f.take_next(1), Some(40000));
    }
}
