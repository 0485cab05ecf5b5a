//! Counts kept by the data path itself and added to the shared pipeline's atomics on a flush.

use crate::cache::Step;
use crate::pipeline::{FlowEntry, TABLES};
use crate::{Shared, Snapshot};
use std::sync::atomic::Ordering;

/// Packets and bytes per entry of each table since the last flush, and the entries whose
/// counts are not zero: dense, so counting touches no entry of the shared pipeline (whose
/// atomics would cost a cache miss and a locked add per packet). Lookups, matches and misses
/// per table likewise.
pub(super) struct EntryCounts {
    pub(super) per_entry: Vec<Vec<(u64, u64)>>,
    pub(super) counted: Vec<(u8, u32)>,
    pub(super) lookups: [u64; TABLES],
    pub(super) matched: [u64; TABLES],
    pub(super) misses: u64,
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
    pub(super) fn resize(&mut self, snap: &Snapshot) {
        self.counted.clear();
        for (counts, entries) in self.per_entry.iter_mut().zip(&snap.tables) {
            counts.clear();
            counts.resize(entries.len(), (0, 0));
        }
    }

    /// Counts `n` packets of `bytes` in all against entry `at` of `table`; `false` when there
    /// is no such count.
    #[inline]
    pub(super) fn entry(&mut self, table: usize, at: usize, n: u64, bytes: u64) -> bool {
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
    #[inline]
    pub(super) fn walk(&mut self, steps: &[Step], n: u64, b: u64) {
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

    pub(super) fn flush_entries(&mut self, snap: &Snapshot, now_ns: u64) {
        for (t, at) in self.counted.drain(..) {
            let (t, at) = (t as usize, at as usize);
            let (n, b) = std::mem::take(&mut self.per_entry[t][at]);
            if let Some(entry) = snap.tables[t].get(at) {
                add(entry, n, b, now_ns);
            }
        }
    }

    pub(super) fn flush_tables(&mut self, shared: &Shared) {
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

pub(super) fn add(e: &FlowEntry, n: u64, b: u64, now_ns: u64) {
    e.packets.fetch_add(n, Ordering::Relaxed);
    e.bytes.fetch_add(b, Ordering::Relaxed);
    e.last_used_ns.store(now_ns, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(entries: &[usize]) -> EntryCounts {
        let mut c = EntryCounts::default();
        for (t, &n) in entries.iter().enumerate() {
            c.per_entry[t] = vec![(0, 0); n];
        }
        c
    }

    #[test]
    fn a_walk_counts_lookups_matches_misses_and_each_entry_once_in_the_list() {
        let mut c = counts(&[2, 1]);
        let walk = [
            Step {
                table: 0,
                grown: 0,
                at: 1,
            },
            Step {
                table: 1,
                grown: 0,
                at: Step::MISS,
            },
        ];
        c.walk(&walk, 3, 300);
        c.walk(&walk, 1, 100);
        assert_eq!(
            (c.lookups[0], c.matched[0], c.lookups[1], c.matched[1]),
            (4, 4, 4, 0)
        );
        assert_eq!(c.misses, 4);
        assert_eq!(c.per_entry[0][1], (4, 400));
        assert_eq!(c.counted, [(0, 1)], "listed once, however often counted");
    }

    #[test]
    fn an_entry_counts_the_frame_as_long_as_it_was_at_its_table() {
        let mut c = counts(&[1, 1]);
        // A VLAN tag pushed before table 1: the frame is 4 bytes longer there.
        let walk = [
            Step {
                table: 0,
                grown: 0,
                at: 0,
            },
            Step {
                table: 1,
                grown: 4,
                at: 0,
            },
        ];
        c.walk(&walk, 10, 600);
        assert_eq!(
            (c.per_entry[0][0], c.per_entry[1][0]),
            ((10, 600), (10, 640))
        );
    }

    #[test]
    fn an_entry_the_tables_no_longer_have_is_not_counted() {
        let mut c = counts(&[1]);
        assert!(!c.entry(0, 5, 1, 60));
        assert!(!c.entry(TABLES, 0, 1, 60));
        assert!(c.counted.is_empty());
    }
}
