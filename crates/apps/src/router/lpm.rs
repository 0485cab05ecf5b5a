//! Longest-prefix match for forwarding: a direct table indexed by the top bits of the address,
//! and behind each of its buckets either one next hop or a short sorted run of address ranges
//! searched by bisection (DXR: Zec, Rizzo, Mikuc, "DXR: towards a billion routing lookups per
//! second in software", CCR 2012).
//!
//! The prefixes are flattened once, at build, into the disjoint ranges of the address space that
//! share one longest match. A lookup is one load from the direct table and, when its bucket
//! holds several ranges, a bisection over a few neighbouring entries: two memory accesses,
//! whatever the number of routes or the prefix lengths. The same code serves IPv4 (`u32` keys)
//! and IPv6 (`u128` keys, or `u64` — the addresses' top half — when no prefix is longer than
//! /64, as in most IPv6 tables: half the bytes to compare and to bring in per range). Tables
//! are rebuilt from the route list, never updated in place: the router's routes come from its
//! configuration.

/// An address as an unsigned integer of its width.
pub trait Key: Copy + Ord + Default + std::fmt::Debug {
    const BITS: u32;
    fn to_u128(self) -> u128;
    /// Truncates: only called with values of the key's width.
    fn from_u128(v: u128) -> Self;
    /// The top bits of the key above `shift`, as a direct-table index.
    fn top(self, shift: u32) -> usize;
}

/// Addresses of each width as the unsigned integer of that width.
macro_rules! unsigned_key {
    ($($t:ty),*) => {$(
        impl Key for $t {
            const BITS: u32 = <$t>::BITS;
            #[inline]
            fn to_u128(self) -> u128 {
                self as u128
            }
            #[inline]
            fn from_u128(v: u128) -> Self {
                v as $t
            }
            #[inline]
            fn top(self, shift: u32) -> usize {
                (self >> shift) as usize
            }
        }
    )*};
}

unsigned_key!(u32, u64, u128);

/// The value of an address no prefix covers.
const NO_ROUTE: u32 = u32::MAX;

/// A range's first address and next hop side by side, so that the hop a search finds is on a
/// line it read. Aligned to 4 bytes, so that no entry is padded: 8, 12 or 20 bytes.
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
struct Range<K> {
    start: K,
    hop: u32,
}

/// One direct-table entry: `len` ranges from `base` in `Lpm::ranges`, or, when `len` is 0,
/// the next hop of the whole bucket in `base`.
#[derive(Clone, Copy, Default)]
#[repr(C, align(8))]
struct Bucket {
    base: u32,
    len: u32,
}

/// Errors of [`Lpm::build`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LpmError {
    /// A prefix length above the address width.
    PrefixLength(u8),
    /// More ranges than 32-bit indices reach (billions of routes).
    TooManyRanges,
    /// The hop value reserved for "no route".
    ReservedHop,
}

impl std::fmt::Display for LpmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LpmError::PrefixLength(l) => write!(f, "prefix length {l} is longer than the address"),
            LpmError::TooManyRanges => write!(f, "too many routes for the lookup table"),
            LpmError::ReservedHop => write!(f, "next hop {NO_ROUTE} is reserved"),
        }
    }
}

/// A compiled forwarding table mapping addresses to the next hop (a `u32` the caller assigns)
/// of their longest matching prefix.
pub struct Lpm<K: Key> {
    shift: u32,
    direct: Vec<Bucket>,
    /// The ranges of every bucket with several, bucket by bucket; a bucket's run starts with
    /// the bucket's first address.
    ranges: Vec<Range<K>>,
}

/// The highest address of a `bits`-wide key.
fn max_of(bits: u32) -> u128 {
    if bits == 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    }
}

/// The disjoint ranges `(first address, hop)` covering the whole space, each with the hop of its
/// longest matching prefix, neighbours merged when their hop is the same. `prefixes` are
/// `(first, last, hop)`, sorted by first address then by length (shortest first), unique.
fn flatten(prefixes: &[(u128, u128, u32)], max: u128) -> Vec<(u128, u32)> {
    let mut out: Vec<(u128, u32)> = Vec::with_capacity(prefixes.len() * 2 + 1);
    let mut emit = |at: u128, hop: u32| {
        if let Some(last) = out.last_mut() {
            if last.0 == at {
                // An empty range before this one: the later hop wins.
                last.1 = hop;
                let n = out.len();
                if n >= 2 && out[n - 2].1 == hop {
                    out.pop();
                }
                return;
            }
            if last.1 == hop {
                return;
            }
        }
        out.push((at, hop));
    };
    // Covering prefixes, innermost on top, as (last address, hop).
    let mut stack: Vec<(u128, u32)> = vec![(max, NO_ROUTE)];
    // The first address not yet given to a range.
    let mut pos = 0u128;
    for &(first, last, hop) in prefixes {
        while stack.last().is_some_and(|t| t.0 < first) {
            let (end, h) = stack.pop().expect("checked non-empty");
            emit(pos, h);
            pos = end + 1; // end < first ≤ max: no overflow
        }
        let covering = stack.last().expect("the whole space stays at the bottom").1;
        if pos < first {
            emit(pos, covering);
        }
        pos = first;
        stack.push((last, hop));
    }
    while let Some((end, h)) = stack.pop() {
        emit(pos, h);
        if end == max {
            break;
        }
        pos = end + 1;
    }
    out
}

impl<K: Key> Lpm<K> {
    /// Compiles `routes` — `(address, prefix length, hop)` — with a direct table of
    /// 2^`direct_bits` buckets. Host bits of the addresses are ignored; when a prefix appears
    /// more than once, its last hop wins.
    pub fn build(
        direct_bits: u32,
        routes: impl IntoIterator<Item = (K, u8, u32)>,
    ) -> Result<Lpm<K>, LpmError> {
        assert!(direct_bits >= 1 && direct_bits <= K::BITS.min(24));
        let max = max_of(K::BITS);
        let mut prefixes = Vec::new();
        for (order, (addr, len, hop)) in routes.into_iter().enumerate() {
            if len as u32 > K::BITS {
                return Err(LpmError::PrefixLength(len));
            }
            if hop == NO_ROUTE {
                return Err(LpmError::ReservedHop);
            }
            let host = max.checked_shr(len as u32).unwrap_or(0);
            let first = addr.to_u128() & !host & max;
            prefixes.push((first, len, order, hop, first | host));
        }
        // By first address, shortest first; of the same prefix, the last given last.
        prefixes.sort_unstable_by_key(|&(first, len, order, _, _)| (first, len, order));
        let mut unique: Vec<(u128, u128, u32)> = Vec::with_capacity(prefixes.len());
        let mut prev: Option<(u128, u8)> = None;
        for &(first, len, _, hop, last) in &prefixes {
            if prev == Some((first, len)) {
                unique.last_mut().expect("a previous prefix").2 = hop;
            } else {
                unique.push((first, last, hop));
            }
            prev = Some((first, len));
        }
        drop(prefixes);
        let ranges = flatten(&unique, max);
        drop(unique);
        Self::bucketize(direct_bits, &ranges)
    }

    /// Cuts the ranges along the direct table's buckets.
    fn bucketize(direct_bits: u32, ranges: &[(u128, u32)]) -> Result<Lpm<K>, LpmError> {
        let shift = K::BITS - direct_bits;
        let buckets = 1usize << direct_bits;
        let mut direct = Vec::with_capacity(buckets);
        let mut runs = Vec::new();
        // Index of the range that holds the current bucket's first address.
        let mut at = 0usize;
        for b in 0..buckets {
            let lo = (b as u128) << shift;
            let hi = lo | max_of(shift);
            while at + 1 < ranges.len() && ranges[at + 1].0 <= lo {
                at += 1;
            }
            let inside = ranges[at + 1..].partition_point(|r| r.0 <= hi);
            if inside == 0 {
                direct.push(Bucket {
                    base: ranges[at].1,
                    len: 0,
                });
                continue;
            }
            let base = u32::try_from(runs.len()).map_err(|_| LpmError::TooManyRanges)?;
            let bucket_ranges = std::iter::once((lo, ranges[at].1))
                .chain(ranges[at + 1..at + 1 + inside].iter().copied());
            runs.extend(bucket_ranges.map(|(start, hop)| Range {
                start: K::from_u128(start),
                hop,
            }));
            direct.push(Bucket {
                base,
                len: inside as u32 + 1,
            });
            at += inside;
        }
        u32::try_from(runs.len()).map_err(|_| LpmError::TooManyRanges)?;
        runs.shrink_to_fit();
        Ok(Lpm {
            shift,
            direct,
            ranges: runs,
        })
    }

    /// The hop of the longest prefix that covers `addr`.
    #[inline]
    pub fn lookup(&self, addr: K) -> Option<u32> {
        let b = self.direct[addr.top(self.shift)];
        let hop = if b.len == 0 {
            b.base
        } else {
            let (base, len) = (b.base as usize, b.len as usize);
            let run = &self.ranges[base..base + len];
            // run[0] starts at the bucket's first address, never above `addr`. The braces copy
            // the packed field out instead of taking a reference to it.
            let i = run.partition_point(|r| { r.start } <= addr) - 1;
            run[i].hop
        };
        (hop != NO_ROUTE).then_some(hop)
    }

    /// Brings the direct-table entry of `addr` toward the cache ahead of its lookup.
    #[inline]
    pub fn prefetch(&self, addr: K) {
        let entry = &self.direct[addr.top(self.shift)];
        stitch_core::prefetch(entry);
    }

    /// Brings the ranges of `addr`'s bucket — its first and last, between them the lines a
    /// short binary search reads, hops included — toward the cache (after [`Lpm::prefetch`]
    /// has had time to bring the bucket): reads of a lookup that would otherwise each wait
    /// for memory.
    #[inline]
    pub fn prefetch_ranges(&self, addr: K) {
        let b = self.direct[addr.top(self.shift)];
        if b.len != 0 {
            let (first, last) = (b.base as usize, (b.base + b.len) as usize - 1);
            stitch_core::prefetch(&self.ranges[first]);
            stitch_core::prefetch(&self.ranges[last]);
        }
    }

    /// Bytes the table takes.
    pub fn bytes(&self) -> usize {
        self.direct.capacity() * std::mem::size_of::<Bucket>()
            + self.ranges.capacity() * std::mem::size_of::<Range<K>>()
    }

    /// Address ranges the prefixes were flattened into (those sharing a bucket's hop included).
    pub fn ranges(&self) -> usize {
        self.ranges.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: the longest of all prefixes that cover `addr`, the last given on a tie.
    fn linear<K: Key>(routes: &[(K, u8, u32)], addr: K) -> Option<u32> {
        let max = max_of(K::BITS);
        let mut best: Option<(u8, u32)> = None;
        for &(a, len, hop) in routes {
            let host = max.checked_shr(len as u32).unwrap_or(0);
            if (a.to_u128() & !host) == (addr.to_u128() & !host)
                && best.is_none_or(|(l, _)| len >= l)
            {
                best = Some((len, hop));
            }
        }
        best.map(|b| b.1)
    }

    /// Random prefixes of lengths in `lens`, some of them nested in others and some repeated,
    /// and addresses that fall in and around them.
    fn check<K: Key>(seed: u64, n: usize, lens: std::ops::RangeInclusive<u8>, bits: u32) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let max = max_of(K::BITS);
        let mut routes: Vec<(K, u8, u32)> = Vec::new();
        let span = (*lens.end() - *lens.start()) as u64 + 1;
        for i in 0..n {
            let len = lens.start() + (rng.u64(..) % span) as u8;
            let addr = if i > 0 && rng.u64(..).is_multiple_of(3) {
                // Nested in (or equal to) an earlier prefix.
                let (a, _, _) = routes[rng.u64(..) as usize % routes.len()];
                a.to_u128() ^ ((rng.u64(..) as u128) & (max >> 8))
            } else {
                ((rng.u64(..) as u128) << 64 | rng.u64(..) as u128) & max
            };
            routes.push((K::from_u128(addr), len, (rng.u64(..) % 50) as u32));
        }
        let lpm = Lpm::build(bits, routes.iter().copied()).unwrap();
        for k in 0..4000 {
            let addr = if k % 2 == 0 {
                let (a, len, _) = routes[rng.u64(..) as usize % routes.len()];
                let host = max.checked_shr(len as u32).unwrap_or(0);
                K::from_u128((a.to_u128() & !host) | (rng.u64(..) as u128 & host))
            } else {
                K::from_u128(((rng.u64(..) as u128) << 64 | rng.u64(..) as u128) & max)
            };
            assert_eq!(
                lpm.lookup(addr),
                linear(&routes, addr),
                "address {addr:?} with {n} routes"
            );
        }
    }

    #[test]
    fn ipv4_matches_a_linear_scan_on_random_tables() {
        for seed in 1..=20u64 {
            check::<u32>(seed * 7919, 1 + (seed as usize * 37) % 400, 0..=32, 8);
            check::<u32>(seed * 104729, 300, 16..=28, 16);
        }
    }

    #[test]
    fn ipv6_matches_a_linear_scan_on_random_tables() {
        for seed in 1..=20u64 {
            check::<u128>(seed * 7919, 1 + (seed as usize * 37) % 400, 0..=128, 12);
            check::<u128>(seed * 104729, 300, 19..=64, 20);
            check::<u64>(seed * 15485863, 300, 0..=64, 16);
        }
    }

    #[test]
    fn edges_of_the_space_and_of_buckets() {
        let t = Lpm::<u32>::build(
            4,
            [
                (0, 0, 7),
                (0xffff_ffff, 32, 1),
                (0, 32, 2),
                (0x1000_0000, 4, 3),
                (0x1fff_ffff, 32, 4),
                (0x2000_0000, 3, 5),
                (0x2000_0000, 3, 6), // the same prefix again: the last wins
            ],
        )
        .unwrap();
        assert_eq!(t.lookup(0), Some(2));
        assert_eq!(t.lookup(1), Some(7));
        assert_eq!(t.lookup(u32::MAX), Some(1));
        assert_eq!(t.lookup(u32::MAX - 1), Some(7));
        assert_eq!(t.lookup(0x1000_0000), Some(3));
        assert_eq!(t.lookup(0x1fff_fffe), Some(3));
        assert_eq!(t.lookup(0x1fff_ffff), Some(4));
        assert_eq!(t.lookup(0x3fff_ffff), Some(6));
        let empty = Lpm::<u128>::build(8, []).unwrap();
        assert_eq!(empty.lookup(12345), None);
        assert_eq!(empty.ranges(), 0);
        let one = Lpm::<u128>::build(8, [(0x2001_0db8 << 96, 32, 9)]).unwrap();
        assert_eq!(one.lookup(0x2001_0db8_0000_0001 << 64), Some(9));
        assert_eq!(one.lookup(0x2001_0db9 << 96), None);
        assert_eq!(
            Lpm::<u32>::build(8, [(0, 33, 1)]).err(),
            Some(LpmError::PrefixLength(33))
        );
    }
}
