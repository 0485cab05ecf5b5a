//! Latency histograms: how long packets took from their receive timestamp (set once per batch
//! by the port or generator that made them, [`crate::Packet::timestamp_ns`]) to the moment a
//! link's consumer took them. A link with `latency: true` in the graph carries one; put it on
//! the link into an output port and it measures receive → transmit.
//!
//! The buckets are log-linear, as HDR histograms make them: 16 per power of two, so a bucket
//! spans at most 1/16 (6.25 %) of the values it holds, from 1 ns to 2^40 ns (18 minutes; longer
//! values share the last bucket, the maximum is kept exactly). The memory is fixed: 592
//! counters, 4.7 KiB. One thread writes a histogram (the link's consumer: plain loads and
//! stores, no read-modify-write); anyone may read it.
//!
//! The clock is the packets' own: wall-clock nanoseconds ([`crate::packet::now_ns`]), read
//! once per batch. Where the kernel's clock source is the TSC (`tsc` in
//! `/sys/devices/system/clocksource/clocksource0/current_clocksource`) that is a calibrated TSC
//! read through the vDSO, without a system call, and it is the clock the kernel stamps
//! received frames with, which `af_packet` ports pass on.

use crate::packet::Packet;
use std::sync::atomic::{AtomicU64, Ordering};

/// Buckets per power of two, as a power of two.
const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
/// Values from 2^`TOP_BITS` ns on share the last bucket.
const TOP_BITS: u32 = 40;
/// Counters of one histogram.
pub const BUCKETS: usize = (TOP_BITS - SUB_BITS + 1) as usize * SUB;

/// The bucket that counts a latency of `ns`.
#[inline(always)]
pub fn bucket_of(ns: u64) -> usize {
    if ns < (2 * SUB) as u64 {
        return ns as usize;
    }
    let shift = (63 - ns.leading_zeros()) - SUB_BITS;
    let index = (shift as usize + 1) * SUB + ((ns >> shift) as usize - SUB);
    index.min(BUCKETS - 1)
}

/// The values bucket `index` counts: `lowest..next`, the next bucket's lowest
/// (`u64::MAX` for the last, which takes everything above).
pub fn bucket_bounds(index: usize) -> (u64, u64) {
    let lowest = |i: usize| -> u64 {
        if i < SUB {
            i as u64
        } else {
            ((SUB + i % SUB) as u64) << (i / SUB - 1)
        }
    };
    let next = if index + 1 >= BUCKETS {
        u64::MAX
    } else {
        lowest(index + 1)
    };
    (lowest(index), next)
}

#[inline(always)]
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// A histogram one thread writes ([`LatencyHistogram::observe`]) and any thread reads
/// ([`LatencyHistogram::counts`]).
pub struct LatencyHistogram {
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_ns: AtomicU64,
    min_ns: AtomicU64,
    max_ns: AtomicU64,
    /// Packets without a timestamp (0): not measured.
    unstamped: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            min_ns: AtomicU64::new(u64::MAX),
            max_ns: AtomicU64::new(0),
            unstamped: AtomicU64::new(0),
        }
    }
}

impl LatencyHistogram {
    pub fn new() -> LatencyHistogram {
        LatencyHistogram::default()
    }

    /// Counts how long ago (from `now_ns`) each of `packets` was stamped. Called by the one
    /// thread that writes this histogram.
    #[inline]
    pub fn observe(&self, packets: &[Packet], now_ns: u64) {
        let (mut n, mut sum, mut unstamped) = (0u64, 0u64, 0u64);
        let mut min = self.min_ns.load(Ordering::Relaxed);
        let mut max = self.max_ns.load(Ordering::Relaxed);
        for p in packets {
            let stamp = p.timestamp_ns();
            if stamp == 0 {
                unstamped += 1;
                continue;
            }
            // A stamp ahead of `now` (the wall clock stepped back) counts as no time at all.
            let ns = now_ns.saturating_sub(stamp);
            bump(&self.buckets[bucket_of(ns)], 1);
            n += 1;
            sum = sum.wrapping_add(ns);
            min = min.min(ns);
            max = max.max(ns);
        }
        if n > 0 {
            bump(&self.count, n);
            bump(&self.sum_ns, sum);
            self.min_ns.store(min, Ordering::Relaxed);
            self.max_ns.store(max, Ordering::Relaxed);
        }
        if unstamped > 0 {
            bump(&self.unstamped, unstamped);
        }
    }

    /// Counts one latency of `ns` (for tests and for histograms filled from elsewhere).
    pub fn record(&self, ns: u64) {
        bump(&self.buckets[bucket_of(ns)], 1);
        bump(&self.count, 1);
        bump(&self.sum_ns, ns);
        self.min_ns.store(
            self.min_ns.load(Ordering::Relaxed).min(ns),
            Ordering::Relaxed,
        );
        self.max_ns.store(
            self.max_ns.load(Ordering::Relaxed).max(ns),
            Ordering::Relaxed,
        );
    }

    /// What the histogram counted so far. The count is the buckets' sum as read: the writer
    /// may add to them while they are read, and a reader must never see the total and the
    /// buckets disagree.
    pub fn counts(&self) -> LatencyCounts {
        let buckets: Vec<(u32, u64)> = (self.buckets.iter().enumerate())
            .map(|(i, c)| (i as u32, c.load(Ordering::Relaxed)))
            .filter(|(_, c)| *c > 0)
            .collect();
        let count = buckets.iter().map(|&(_, c)| c).sum();
        LatencyCounts {
            count,
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            min_ns: if count == 0 {
                0
            } else {
                self.min_ns.load(Ordering::Relaxed)
            },
            max_ns: self.max_ns.load(Ordering::Relaxed),
            unstamped: self.unstamped.load(Ordering::Relaxed),
            buckets,
        }
    }

    /// Adds what a predecessor counted (the same link before an upgrade), so that the counts
    /// never go back. Only while no thread writes this histogram.
    pub fn continue_from(&self, before: &LatencyCounts) {
        for &(i, c) in &before.buckets {
            if let Some(b) = self.buckets.get(i as usize) {
                bump(b, c);
            }
        }
        bump(&self.count, before.count);
        bump(&self.sum_ns, before.sum_ns);
        bump(&self.unstamped, before.unstamped);
        if before.count > 0 {
            self.min_ns.store(
                self.min_ns.load(Ordering::Relaxed).min(before.min_ns),
                Ordering::Relaxed,
            );
            self.max_ns.store(
                self.max_ns.load(Ordering::Relaxed).max(before.max_ns),
                Ordering::Relaxed,
            );
        }
    }
}

/// A histogram's counts at one moment: what the API shows, `/metrics` turns into a Prometheus
/// histogram, and an upgrade hands on.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatencyCounts {
    /// Packets measured.
    pub count: u64,
    pub sum_ns: u64,
    /// Least and greatest latency measured (0 when none was).
    pub min_ns: u64,
    pub max_ns: u64,
    /// Packets without a timestamp, not measured.
    pub unstamped: u64,
    /// `(bucket, packets)` of each bucket that counted any, in order ([`bucket_bounds`]).
    pub buckets: Vec<(u32, u64)>,
}

impl LatencyCounts {
    /// The latency that fraction `q` (0..=1) of the packets did not exceed, to a bucket's
    /// resolution: the highest value of the bucket the `q`-th packet fell in, never above
    /// the greatest latency measured (HDR histograms report it the same way).
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        if q <= 0.0 {
            return self.min_ns;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for &(i, c) in &self.buckets {
            seen += c;
            if seen >= rank {
                let (_, next) = bucket_bounds(i as usize);
                return (next - 1).min(self.max_ns).max(self.min_ns);
            }
        }
        self.max_ns
    }

    /// The figures a reader looks at.
    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            unstamped: self.unstamped,
            min_ns: self.min_ns,
            mean_ns: self.sum_ns.checked_div(self.count).unwrap_or(0),
            p50_ns: self.quantile(0.5),
            p90_ns: self.quantile(0.9),
            p99_ns: self.quantile(0.99),
            p999_ns: self.quantile(0.999),
            max_ns: self.max_ns,
        }
    }
}

impl LatencyCounts {
    /// The summary with every bucket that counted any, in nanoseconds: what the API shows.
    pub fn report(&self) -> LatencyReport {
        LatencyReport {
            summary: self.summary(),
            sum_ns: self.sum_ns,
            buckets: (self.buckets.iter())
                .map(|&(i, packets)| {
                    let (from_ns, to_ns) = bucket_bounds(i as usize);
                    LatencyBucket {
                        from_ns,
                        to_ns,
                        packets,
                    }
                })
                .collect(),
        }
    }
}

/// A histogram as the API shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatencyReport {
    #[serde(flatten)]
    pub summary: LatencySummary,
    pub sum_ns: u64,
    /// Each bucket that counted any, in order.
    pub buckets: Vec<LatencyBucket>,
}

impl LatencyReport {
    /// Packets whose latency was below `bound_ns` (exact at a bucket boundary: every power
    /// of two from 16 ns on is one).
    pub fn below(&self, bound_ns: u64) -> u64 {
        (self.buckets.iter())
            .filter(|b| b.to_ns <= bound_ns)
            .map(|b| b.packets)
            .sum()
    }
}

/// Packets whose latency was at least `from_ns` and below `to_ns`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatencyBucket {
    pub from_ns: u64,
    pub to_ns: u64,
    pub packets: u64,
}

/// A latency histogram in figures: percentiles to a bucket's resolution (6.25 %).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub unstamped: u64,
    pub min_ns: u64,
    pub mean_ns: u64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_once_and_are_at_most_a_sixteenth_wide() {
        assert_eq!(bucket_bounds(0), (0, 1));
        let mut expected_low = 0;
        for i in 0..BUCKETS {
            let (low, next) = bucket_bounds(i);
            assert_eq!(low, expected_low, "bucket {i} starts where {} ends", i - 1);
            assert_eq!(bucket_of(low), i);
            if next != u64::MAX {
                assert_eq!(bucket_of(next - 1), i);
                assert!((next - low) * 16 <= low.max(16), "bucket {i} too wide");
            }
            expected_low = next;
        }
        assert_eq!(expected_low, u64::MAX);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        for k in 4..40 {
            assert_eq!(
                bucket_bounds(bucket_of(1 << k)).0,
                1 << k,
                "2^{k} is a boundary"
            );
        }
    }

    #[test]
    fn quantiles_of_known_values_fall_in_their_bucket() {
        let h = LatencyHistogram::new();
        // 1 000 values of 10 µs, 10 of 1 ms, 1 of 50 ms.
        for _ in 0..1000 {
            h.record(10_000);
        }
        for _ in 0..10 {
            h.record(1_000_000);
        }
        h.record(50_000_000);
        let c = h.counts();
        assert_eq!((c.count, c.min_ns, c.max_ns), (1011, 10_000, 50_000_000));
        let within = |v: u64, of: u64| bucket_of(v) == bucket_of(of);
        assert!(within(c.quantile(0.5), 10_000), "{}", c.quantile(0.5));
        assert!(within(c.quantile(0.99), 1_000_000), "{}", c.quantile(0.99));
        assert_eq!(c.quantile(1.0), 50_000_000);
        assert_eq!(c.quantile(0.0), 10_000);
        let s = c.summary();
        assert_eq!(
            s.mean_ns,
            (1000 * 10_000 + 10 * 1_000_000 + 50_000_000) / 1011
        );
        let r = c.report();
        assert_eq!(r.below(1 << 14), 1000);
        assert_eq!(r.below(1 << 20), 1010);
        assert_eq!(r.below(u64::MAX), 1011);
        assert_eq!(r.buckets.len(), 3);
    }

    #[test]
    fn packets_are_measured_from_their_stamp_and_unstamped_ones_counted_apart() {
        let mut stamped = crate::pool::alloc().unwrap();
        stamped.set_data(&[0; 60]).unwrap();
        stamped.set_timestamp_ns(1_000_000);
        let mut unstamped = crate::pool::alloc().unwrap();
        unstamped.set_data(&[0; 60]).unwrap();
        let mut ahead = crate::pool::alloc().unwrap();
        ahead.set_data(&[0; 60]).unwrap();
        ahead.set_timestamp_ns(9_000_000);
        let h = LatencyHistogram::new();
        h.observe(&[stamped, unstamped, ahead], 3_000_000);
        let c = h.counts();
        assert_eq!((c.count, c.unstamped), (2, 1));
        assert_eq!((c.min_ns, c.max_ns), (0, 2_000_000));
    }

    #[test]
    fn a_successor_continues_the_counts() {
        let old = LatencyHistogram::new();
        old.record(500);
        old.record(70_000);
        let new = LatencyHistogram::new();
        new.record(300);
        new.continue_from(&old.counts());
        let c = new.counts();
        assert_eq!(
            (c.count, c.min_ns, c.max_ns, c.sum_ns),
            (3, 300, 70_000, 70_800)
        );
        assert_eq!(c.buckets.len(), 3);
    }
}
