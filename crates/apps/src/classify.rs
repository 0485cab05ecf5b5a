//! First-match classification of packets against an ordered rule list, without walking the
//! rules: each field (side, protocol, addresses, ports, VLAN) is cut into the intervals its rules'
//! bounds create, each interval holding the bit set of the rules that accept it; a lookup finds
//! the packet's interval in every field (binary search), ANDs the bit sets and takes the lowest
//! rule number. The cost grows with log(rules) per field and rules/64 words per AND, not with the
//! number of rules walked.

/// A set of rule numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Bits {
        Bits(vec![0; n.div_ceil(64)])
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
}

/// One field: interval starts (sorted) and the rules each interval satisfies.
#[derive(Debug, Default)]
pub struct Field {
    starts: Vec<u128>,
    sets: Vec<Bits>,
}

impl Field {
    /// `ranges[r]`: the inclusive range rule `r` accepts, `None` for any value.
    pub fn build(ranges: &[Option<(u128, u128)>]) -> Field {
        let mut starts = vec![0u128];
        for (lo, hi) in ranges.iter().flatten() {
            starts.push(*lo);
            if *hi < u128::MAX {
                starts.push(hi + 1);
            }
        }
        starts.sort_unstable();
        starts.dedup();
        let sets = starts
            .iter()
            .map(|&v| {
                let mut b = Bits::new(ranges.len());
                for (r, range) in ranges.iter().enumerate() {
                    if range.is_none_or(|(lo, hi)| lo <= v && v <= hi) {
                        b.set(r);
                    }
                }
                b
            })
            .collect();
        Field { starts, sets }
    }

    #[inline]
    pub fn lookup(&self, v: u128) -> &Bits {
        let i = self.starts.partition_point(|s| *s <= v) - 1;
        &self.sets[i]
    }
}

/// The lowest rule number in the intersection of `sets`.
#[inline]
pub fn first(sets: &[&Bits]) -> Option<usize> {
    let words = sets.first()?.0.len();
    for w in 0..words {
        let mut x = u64::MAX;
        for s in sets {
            x &= s.0[w];
            if x == 0 {
                break;
            }
        }
        if x != 0 {
            return Some(w * 64 + x.trailing_zeros() as usize);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_and_first_match() {
        let ports = Field::build(&[Some((80, 80)), None, Some((1000, 2000)), Some((1500, 1500))]);
        let addrs = Field::build(&[None, Some((10, 20)), None, Some((0, 5))]);
        let at = |p, a| first(&[ports.lookup(p), addrs.lookup(a)]);
        assert_eq!(at(80, 30), Some(0));
        assert_eq!(at(81, 15), Some(1));
        assert_eq!(at(1500, 3), Some(2));
        assert_eq!(at(1500, 30), Some(2));
        assert_eq!(at(2001, 30), None);
        assert_eq!(at(u16::MAX as u128, 15), Some(1));
    }
}
