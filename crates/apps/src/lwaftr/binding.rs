//! The binding table: which B4 owns (IPv4 address, port). Each shared IPv4 address has its
//! port-set parameters (PSID length k, reserved bits a); a port maps to its PSID as
//! `(port >> (16 − k − a)) & (2^k − 1)`, ports below 2^a belong to nobody, and (address, PSID)
//! names the softwire. Two lookups per packet in open-addressing tables whose slot is known
//! before it is read (so it can be fetched ahead), no allocation; sized for millions.

use super::config::SoftwireSpec;
use std::net::{Ipv4Addr, Ipv6Addr};

/// An address's port-set parameters (RFC 7597 §5.1): PSID length k, the offset's shift, and
/// reserved bits a (ports below 2^a belong to nobody).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
struct PortSet {
    psid_length: u8,
    shift: u8,
    reserved_bits: u8,
}

impl PortSet {
    #[inline]
    fn psid(&self, port: u16) -> Option<u16> {
        // 2^a, or 0 when a = 0 (then port 0 is an ordinary port).
        let first_port = (1u32 << self.reserved_bits) & !1;
        if (port as u32) < first_port {
            return None;
        }
        let mask = (1u32 << self.psid_length) - 1;
        Some((((port as u32) >> self.shift) & mask) as u16)
    }
}

/// The two ends of a softwire's tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Softwire {
    pub b4: [u8; 16],
    pub br: [u8; 16],
}

/// A dense slot: 32 bytes, aligned so that none straddles two cache lines; empty while its B4
/// address is `::` (never a B4's address).
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Slot(Softwire);

impl Slot {
    const EMPTY: Slot = Slot(Softwire {
        b4: [0; 16],
        br: [0; 16],
    });

    #[inline]
    fn get(&self) -> Option<&Softwire> {
        (self.0.b4 != [0; 16]).then_some(&self.0)
    }

    fn replace(&mut self, s: Softwire) -> Option<Softwire> {
        let old = self.get().copied();
        self.0 = s;
        old
    }

    fn take(&mut self) -> Option<Softwire> {
        let old = self.get().copied();
        *self = Slot::EMPTY;
        old
    }
}

/// The smallest table whose lookups are fetched ahead: well inside a core's second-level cache
/// on current servers, so a smaller table stays there while it is in use.
const PREFETCHED_TABLE_BYTES: usize = 256 << 10;

/// PSID lengths up to this keep an address's softwires in a dense array slice (one array
/// read per lookup, prefetchable); longer ones, where most PSIDs are usually unbound, one slot
/// each, found through the sparse index.
const DENSE_MAX_PSID_LENGTH: u8 = 8;

/// An address: its port set and, when dense, where its 2^k slots start.
#[derive(Debug, Clone, Copy)]
struct Address {
    set: PortSet,
    dense: Option<u32>,
    users: u32,
}

impl Address {
    const EMPTY: Address = Address {
        set: PortSet {
            psid_length: 0,
            shift: 0,
            reserved_bits: 0,
        },
        dense: None,
        users: 0,
    };
}

/// A slot of an [`OpenTable`]: its key and its mark of use live in the slot itself, so that a
/// lookup reads one cache line.
trait OpenSlot: Copy {
    const EMPTY: Self;
    fn key(&self) -> u64;
    fn used(&self) -> bool;
}

/// One slot of the address table: 16 bytes, four to a cache line and none across two.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct AddressSlot {
    key: u32,
    /// Where the address's dense slots start; `SPARSE` for an address in the sparse index.
    dense_base: u32,
    users: u32,
    set: PortSet,
    used: bool,
}

const SPARSE: u32 = u32::MAX;

const _: () = assert!(std::mem::size_of::<AddressSlot>() == 16);

impl AddressSlot {
    const fn new(key: u32, a: Address) -> AddressSlot {
        AddressSlot {
            key,
            dense_base: match a.dense {
                Some(base) => base,
                None => SPARSE,
            },
            users: a.users,
            set: a.set,
            used: true,
        }
    }

    /// Where the address's dense slots start; `None` for an address in the sparse index.
    #[inline(always)]
    fn dense(&self) -> Option<u32> {
        (self.dense_base != SPARSE).then_some(self.dense_base)
    }

    #[inline]
    fn address(&self) -> Address {
        Address {
            set: self.set,
            dense: self.dense(),
            users: self.users,
        }
    }
}

impl OpenSlot for AddressSlot {
    const EMPTY: AddressSlot = AddressSlot {
        used: false,
        ..AddressSlot::new(0, Address::EMPTY)
    };

    #[inline]
    fn key(&self) -> u64 {
        self.key as u64
    }

    #[inline]
    fn used(&self) -> bool {
        self.used
    }
}

/// One slot of the sparse index, for addresses whose PSIDs are too many to give each a slot
/// (PSID length above `DENSE_MAX_PSID_LENGTH`): (address, PSID) and where its softwire is.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct SparseSlot {
    key: u64,
    softwire: u32,
    used: bool,
}

const _: () = assert!(std::mem::size_of::<SparseSlot>() == 16);

impl OpenSlot for SparseSlot {
    const EMPTY: SparseSlot = SparseSlot {
        key: 0,
        softwire: 0,
        used: false,
    };

    #[inline]
    fn key(&self) -> u64 {
        self.key
    }

    #[inline]
    fn used(&self) -> bool {
        self.used
    }
}

/// An open-addressing table (linear probing, Fibonacci hashing, at most half full): unlike a
/// library map, the slot a lookup will read is known up front and can be prefetched, and a
/// lookup is a multiply, a load and a compare.
struct OpenTable<S> {
    slots: Vec<S>,
    len: usize,
}

impl<S> Default for OpenTable<S> {
    fn default() -> Self {
        OpenTable {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<S: OpenSlot> OpenTable<S> {
    #[inline]
    fn home(&self, key: u64) -> usize {
        let bits = self.slots.len().trailing_zeros();
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - bits)) as usize
    }

    #[inline(always)]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        while self.slots[i].used() {
            if self.slots[i].key() == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
        None
    }

    #[inline(always)]
    fn get(&self, key: u64) -> Option<&S> {
        self.find(key).map(|i| &self.slots[i])
    }

    #[inline]
    fn prefetch(&self, key: u64) {
        if !self.slots.is_empty() {
            stitch_core::prefetch(&self.slots[self.home(key)]);
        }
    }

    /// Puts `slot` under its key, in place of the slot there before if any.
    fn insert(&mut self, slot: S) {
        if let Some(i) = self.find(slot.key()) {
            self.slots[i] = slot;
            return;
        }
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(slot.key());
        while self.slots[i].used() {
            i = (i + 1) & mask;
        }
        self.slots[i] = slot;
        self.len += 1;
    }

    fn grow(&mut self) {
        let n = (self.slots.len() * 2).max(16);
        let old = std::mem::replace(&mut self.slots, vec![S::EMPTY; n]);
        self.len = 0;
        for slot in old.into_iter().filter(S::used) {
            self.insert(slot);
        }
    }

    /// Removes `key`, shifting later entries of its run back (no tombstones).
    fn remove(&mut self, key: u64) {
        let Some(mut hole) = self.find(key) else {
            return;
        };
        let mask = self.slots.len() - 1;
        self.slots[hole] = S::EMPTY;
        self.len -= 1;
        let mut i = (hole + 1) & mask;
        while self.slots[i].used() {
            let home = self.home(self.slots[i].key());
            // Move the entry into the hole when the hole lies on its probe path.
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[i];
                self.slots[i] = S::EMPTY;
                hole = i;
            }
            i = (i + 1) & mask;
        }
    }

    fn iter(&self) -> impl Iterator<Item = &S> + '_ {
        self.slots.iter().filter(|s| s.used())
    }

    fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<S>()
    }
}

#[derive(Default)]
pub struct BindingTable {
    addresses: OpenTable<AddressSlot>,
    /// The softwires: a dense address's at `slots[base + psid]`, a sparse one's wherever its
    /// entry of `sparse` says.
    slots: Vec<Slot>,
    /// Free ranges of `slots` by PSID length (0 for one slot), for reuse after an address or
    /// a sparse softwire leaves.
    free: Vec<(u8, u32)>,
    sparse: OpenTable<SparseSlot>,
    count: usize,
    br_addresses: Vec<[u8; 16]>,
    /// Whether the kernel backed the softwires' slots with huge pages when the table was built.
    in_huge_pages: bool,
}

fn key(ipv4: u32, psid: u16) -> u64 {
    (ipv4 as u64) << 16 | psid as u64
}

impl BindingTable {
    pub fn new(specs: &[SoftwireSpec]) -> Result<BindingTable, String> {
        let mut t = BindingTable::default();
        for s in specs {
            t.add(s).map_err(|e| format!("line {}: {e}", s.line))?;
        }
        // Lookups land anywhere in these: in 4 KiB pages a large table misses the TLB on
        // nearly every one.
        t.in_huge_pages = stitch_core::mapping::back_with_huge_pages(&t.slots);
        stitch_core::mapping::back_with_huge_pages(&t.addresses.slots);
        stitch_core::mapping::back_with_huge_pages(&t.sparse.slots);
        Ok(t)
    }

    /// Adds a softwire (or replaces the one with the same address and PSID).
    pub fn add(&mut self, s: &SoftwireSpec) -> Result<(), String> {
        if s.b4.is_unspecified() {
            return Err(format!(
                "{} psid {}: b4-ipv6 :: is not a B4 address",
                s.ipv4, s.psid
            ));
        }
        let a = u32::from(s.ipv4);
        let set = PortSet {
            psid_length: s.psid_length,
            shift: 16 - s.psid_length - s.reserved_bits,
            reserved_bits: s.reserved_bits,
        };
        let entry = match self.address(a) {
            Some(old) if old.set != set => {
                return Err(format!(
                    "{}: its port set (psid-length {}, reserved bits {}) differs from that of the other softwires of this address",
                    s.ipv4, s.psid_length, s.reserved_bits
                ))
            }
            Some(old) => old,
            None => {
                let dense = (s.psid_length <= DENSE_MAX_PSID_LENGTH).then(|| self.dense_range(s.psid_length));
                Address { set, dense, users: 0 }
            }
        };
        let sw = Softwire {
            b4: s.b4.octets(),
            br: s.br.octets(),
        };
        let new = match entry.dense {
            Some(base) => self.slots[base as usize + s.psid as usize]
                .replace(sw)
                .is_none(),
            None => self.add_sparse(key(a, s.psid), sw),
        };
        let mut entry = entry;
        if new {
            entry.users += 1;
            self.count += 1;
        }
        self.addresses.insert(AddressSlot::new(a, entry));
        let br = s.br.octets();
        if !self.br_addresses.contains(&br) {
            self.br_addresses.push(br);
        }
        Ok(())
    }

    /// Puts `sw` under `key` in the sparse index; true when the key is new.
    fn add_sparse(&mut self, key: u64, sw: Softwire) -> bool {
        if let Some(e) = self.sparse.get(key) {
            self.slots[e.softwire as usize].replace(sw);
            return false;
        }
        let softwire = self.dense_range(0);
        self.slots[softwire as usize].replace(sw);
        self.sparse.insert(SparseSlot {
            key,
            softwire,
            used: true,
        });
        true
    }

    /// Takes `key` out of the sparse index; false when it is not there.
    fn remove_sparse(&mut self, key: u64) -> bool {
        let Some(softwire) = self.sparse.get(key).map(|e| e.softwire) else {
            return false;
        };
        self.slots[softwire as usize].take();
        self.free.push((0, softwire));
        self.sparse.remove(key);
        true
    }

    #[inline]
    fn address(&self, ipv4: u32) -> Option<Address> {
        self.addresses.get(ipv4 as u64).map(AddressSlot::address)
    }

    fn dense_range(&mut self, k: u8) -> u32 {
        if let Some(i) = self.free.iter().position(|(len, _)| *len == k) {
            return self.free.swap_remove(i).1;
        }
        let base = self.slots.len() as u32;
        self.slots.resize(self.slots.len() + (1 << k), Slot::EMPTY);
        base
    }

    /// Removes the softwire of (address, PSID); false when there is none.
    pub fn remove(&mut self, ipv4: Ipv4Addr, psid: u16) -> bool {
        let a = u32::from(ipv4);
        let Some(mut entry) = self.address(a) else {
            return false;
        };
        let removed = match entry.dense {
            Some(base) => {
                (psid as u32) < (1u32 << entry.set.psid_length)
                    && self.slots[(base + psid as u32) as usize].take().is_some()
            }
            None => self.remove_sparse(key(a, psid)),
        };
        if !removed {
            return false;
        }
        self.count -= 1;
        entry.users -= 1;
        if entry.users == 0 {
            self.addresses.remove(a as u64);
            if let Some(base) = entry.dense {
                self.free.push((entry.set.psid_length, base));
            }
        } else {
            self.addresses.insert(AddressSlot::new(a, entry));
        }
        true
    }

    /// The softwire that owns `port` of `ipv4`.
    #[inline(always)]
    pub fn lookup(&self, ipv4: u32, port: u16) -> Option<&Softwire> {
        let e = self.addresses.get(ipv4 as u64)?;
        let psid = e.set.psid(port)?;
        let i = match e.dense() {
            Some(base) => base as usize + psid as usize,
            None => self.sparse.get(key(ipv4, psid))?.softwire as usize,
        };
        self.slots[i].get()
    }

    /// Second stage: where the softwire of (`ipv4`, `port`) is (a dense address's slot, or a
    /// sparse one's index entry), once the address entry is in the cache.
    #[inline]
    pub fn prefetch(&self, ipv4: u32, port: u16) {
        let Some(e) = self.addresses.get(ipv4 as u64) else {
            return;
        };
        let Some(psid) = e.set.psid(port) else {
            return;
        };
        match e.dense() {
            Some(base) => {
                if let Some(slot) = self.slots.get(base as usize + psid as usize) {
                    stitch_core::prefetch(slot);
                }
            }
            None => self.sparse.prefetch(key(ipv4, psid)),
        }
    }

    /// First stage of a two-stage prefetch: the address's entry.
    #[inline]
    pub fn prefetch_address(&self, ipv4: u32) {
        self.addresses.prefetch(ipv4 as u64);
    }

    /// Whether some softwire of the table holds ports of `ipv4`.
    #[inline]
    pub fn is_managed_address(&self, ipv4: u32) -> bool {
        self.addresses.find(ipv4 as u64).is_some()
    }

    /// Whether `a` is one of the BR addresses of the table.
    #[inline]
    pub fn is_br_address(&self, a: &[u8]) -> bool {
        self.br_addresses.iter().any(|b| b == a)
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether the table is large enough for its lookups to gain from being fetched a few
    /// frames ahead. A smaller one stays in the caches, where reading the keys first and
    /// fetching ahead cost more than they save (Snabb's 12 softwires: 1.03-1.34x without them,
    /// in eight rounds).
    #[inline]
    pub fn prefetch_pays(&self) -> bool {
        self.memory_bytes() >= PREFETCHED_TABLE_BYTES
    }

    /// Whether the softwires' slots sit in huge pages (a large table's lookups then seldom
    /// miss the TLB); false for a table under 2 MiB or a kernel with transparent huge pages off.
    pub fn in_huge_pages(&self) -> bool {
        self.in_huge_pages
    }

    /// Bytes the table holds in memory (what its vectors and map have allocated).
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        size_of::<BindingTable>()
            + self.addresses.memory_bytes()
            + self.slots.capacity() * size_of::<Slot>()
            + self.free.capacity() * size_of::<(u8, u32)>()
            + self.sparse.memory_bytes()
            + self.br_addresses.capacity() * 16
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Softwires for the control socket (address, PSID, B4, BR), at most `limit`.
    pub fn dump(&self, limit: usize) -> Vec<(Ipv4Addr, u16, Ipv6Addr, Ipv6Addr)> {
        let dense = self
            .addresses
            .iter()
            .filter_map(|e| Some((e, e.dense()?)))
            .flat_map(|(e, base)| {
                (0..1u32 << e.set.psid_length).map(move |psid| (e.key, psid, base + psid))
            });
        let sparse = self
            .sparse
            .iter()
            .map(|e| ((e.key >> 16) as u32, e.key as u32 & 0xffff, e.softwire));
        dense
            .chain(sparse)
            .filter_map(|(ipv4, psid, i)| {
                let s = self.slots[i as usize].get()?;
                Some((
                    Ipv4Addr::from(ipv4),
                    psid as u16,
                    Ipv6Addr::from(s.b4),
                    Ipv6Addr::from(s.br),
                ))
            })
            .take(limit)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ip: &str, psid: u16, k: u8, a: u8) -> SoftwireSpec {
        SoftwireSpec {
            ipv4: ip.parse().unwrap(),
            psid,
            b4: "2001:db8::1".parse().unwrap(),
            br: "2001:db8::ff".parse().unwrap(),
            psid_length: k,
            reserved_bits: a,
            line: 1,
        }
    }

    #[test]
    fn psid_follows_rfc_7597() {
        // k = 6, a = 0: 64 PSIDs of 1024 ports; port 4096..5119 is PSID 4.
        let t = BindingTable::new(&[spec("178.79.150.3", 4, 6, 0)]).unwrap();
        let a = u32::from(Ipv4Addr::new(178, 79, 150, 3));
        assert!(t.lookup(a, 4096).is_some());
        assert!(t.lookup(a, 5119).is_some());
        assert!(t.lookup(a, 5120).is_none());
        assert!(t.lookup(a, 4095).is_none());
        // k = 4, a = 6: shift 6; ports below 64 belong to nobody.
        let t = BindingTable::new(&[spec("10.0.0.1", 0, 4, 6), spec("10.0.0.1", 1, 4, 6)]).unwrap();
        let a = u32::from(Ipv4Addr::new(10, 0, 0, 1));
        assert!(t.lookup(a, 63).is_none(), "reserved ports");
        assert!(t.lookup(a, 64).is_some(), "(64 >> 6) & 15 = 1");
        assert!(t.lookup(a, 1024).is_some(), "(1024 >> 6) & 15 = 0");
        assert!(t.lookup(a, 128).is_none(), "PSID 2 is not bound");
        // k = 0: the whole address.
        let t = BindingTable::new(&[spec("10.0.0.2", 0, 0, 0)]).unwrap();
        assert!(t.lookup(u32::from(Ipv4Addr::new(10, 0, 0, 2)), 1).is_some());
    }

    #[test]
    fn only_a_table_too_large_for_the_caches_is_fetched_ahead() {
        let small: Vec<_> = (0..12).map(|i| spec("10.0.0.1", i, 4, 0)).collect();
        assert!(!BindingTable::new(&small).unwrap().prefetch_pays());
        let large: Vec<_> = (0..20_000u32)
            .map(|i| {
                let ip = Ipv4Addr::from(0x0a00_0000 + i / 16).to_string();
                spec(&ip, (i % 16) as u16, 4, 0)
            })
            .collect();
        assert!(BindingTable::new(&large).unwrap().prefetch_pays());
    }

    #[test]
    fn the_address_table_survives_growth_and_removals() {
        let mut t = OpenTable::<AddressSlot>::default();
        for k in 0..5000u32 {
            let a = Address {
                users: k,
                ..Address::EMPTY
            };
            t.insert(AddressSlot::new(k * 7919, a));
        }
        for k in (0..5000u32).step_by(3) {
            t.remove((k * 7919) as u64);
        }
        for k in 0..5000u32 {
            let got = t.get((k * 7919) as u64).map(|a| a.users);
            assert_eq!(got, (k % 3 != 0).then_some(k), "key {k}");
        }
        assert_eq!(t.iter().count(), t.len);
    }

    /// Random additions, replacements and removals over dense and sparse addresses, each
    /// lookup compared with a plain map of (address, PSID) to the softwire.
    #[test]
    fn lookups_agree_with_a_map_through_additions_and_removals() {
        let mut rng = fastrand::Rng::with_seed(7);
        // Each address keeps one port set: (PSID length, reserved bits).
        let sets = [
            (0u8, 0u8),
            (4, 0),
            (6, 2),
            (8, 0),
            (12, 0),
            (16, 0),
            (10, 6),
        ];
        let set_of = |a: u32| sets[a as usize % sets.len()];
        let mut t = BindingTable::default();
        let mut reference = std::collections::HashMap::new();
        for step in 0..20_000u32 {
            let a = 0x0a00_0000 + rng.u32(0..200);
            let (k, r) = set_of(a);
            let psid = rng.u16(..) & ((1u32 << k) - 1) as u16;
            if rng.u8(0..3) == 0 {
                let removed = t.remove(Ipv4Addr::from(a), psid);
                assert_eq!(
                    removed,
                    reference.remove(&(a, psid)).is_some(),
                    "step {step}"
                );
            } else {
                let mut s = spec(&Ipv4Addr::from(a).to_string(), psid, k, r);
                s.b4 = Ipv6Addr::from(step as u128 + 1);
                t.add(&s).unwrap();
                reference.insert((a, psid), s.b4.octets());
            }
        }
        assert_eq!(t.len(), reference.len());
        for _ in 0..100_000 {
            let a = 0x0a00_0000 + rng.u32(0..200);
            let port = rng.u16(..);
            let (k, r) = set_of(a);
            let shift = 16 - k - r;
            let bound = port >= ((1u32 << r) & !1) as u16;
            let psid = ((port as u32 >> shift) & ((1u32 << k) - 1)) as u16;
            let want = reference.get(&(a, psid)).filter(|_| bound);
            assert_eq!(t.lookup(a, port).map(|s| &s.b4), want, "{a:x} port {port}");
        }
        let dumped = t.dump(usize::MAX);
        assert_eq!(dumped.len(), reference.len());
        for (ipv4, psid, b4, _) in dumped {
            assert_eq!(reference.get(&(u32::from(ipv4), psid)), Some(&b4.octets()));
        }
        assert_eq!(t.dump(5).len(), 5);
    }

    #[test]
    fn conflicting_port_sets_are_refused_and_removal_works() {
        let e = BindingTable::new(&[spec("10.0.0.1", 0, 4, 0), spec("10.0.0.1", 1, 6, 0)])
            .err()
            .unwrap();
        assert!(e.contains("port set"), "{e}");
        let mut t =
            BindingTable::new(&[spec("10.0.0.1", 0, 4, 0), spec("10.0.0.9", 5, 12, 0)]).unwrap();
        assert!(t.remove("10.0.0.1".parse().unwrap(), 0));
        assert!(!t.remove("10.0.0.1".parse().unwrap(), 0));
        assert!(
            t.remove("10.0.0.9".parse().unwrap(), 5),
            "sparse (psid-length 12)"
        );
        assert!(t.is_empty());
        // A freed dense range is reused, and so is a sparse softwire's slot.
        t.add(&spec("10.0.0.2", 3, 4, 0)).unwrap();
        assert_eq!(t.slots.len(), 17);
        t.add(&spec("10.0.0.9", 6, 12, 0)).unwrap();
        assert_eq!(t.slots.len(), 17);
        assert!(t
            .lookup(u32::from(Ipv4Addr::new(10, 0, 0, 2)), 3 << 12)
            .is_some());
    }
}
