//! The binding table: which B4 owns (IPv4 address, port). Each shared IPv4 address has its
//! port-set parameters (PSID length k, reserved bits a); a port maps to its PSID as
//! `(port >> (16 − k − a)) & (2^k − 1)`, ports below 2^a belong to nobody, and (address, PSID)
//! names the softwire. Two hash lookups per packet, no allocation; sized for millions.

use super::config::SoftwireSpec;
use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};

type Fast = foldhash::fast::RandomState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PortSet {
    psid_length: u8,
    shift: u8,
    first_port: u32,
}

impl PortSet {
    #[inline]
    fn psid(&self, port: u16) -> Option<u16> {
        if (port as u32) < self.first_port {
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

#[derive(Default)]
pub struct BindingTable {
    port_sets: HashMap<u32, PortSet, Fast>,
    softwires: HashMap<u64, Softwire, Fast>,
    /// How many softwires use each port set (to drop it with the last one).
    users: HashMap<u32, u32, Fast>,
    br_addresses: Vec<[u8; 16]>,
}

fn key(ipv4: u32, psid: u16) -> u64 {
    (ipv4 as u64) << 16 | psid as u64
}

impl BindingTable {
    pub fn new(specs: &[SoftwireSpec]) -> Result<BindingTable, String> {
        let mut t = BindingTable::default();
        t.softwires.reserve(specs.len());
        for s in specs {
            t.add(s).map_err(|e| format!("line {}: {e}", s.line))?;
        }
        Ok(t)
    }

    /// Adds a softwire (or replaces the one with the same address and PSID).
    pub fn add(&mut self, s: &SoftwireSpec) -> Result<(), String> {
        let a = u32::from(s.ipv4);
        let set = PortSet {
            psid_length: s.psid_length,
            shift: 16 - s.psid_length - s.reserved_bits,
            first_port: if s.reserved_bits > 0 {
                1 << s.reserved_bits
            } else {
                0
            },
        };
        match self.port_sets.get(&a) {
            Some(old) if *old != set => {
                return Err(format!(
                    "{}: its port set (psid-length {}, reserved bits {}) differs from that of the other softwires of this address",
                    s.ipv4, s.psid_length, s.reserved_bits
                ))
            }
            _ => {}
        }
        self.port_sets.insert(a, set);
        let new = self
            .softwires
            .insert(
                key(a, s.psid),
                Softwire {
                    b4: s.b4.octets(),
                    br: s.br.octets(),
                },
            )
            .is_none();
        if new {
            *self.users.entry(a).or_default() += 1;
        }
        let br = s.br.octets();
        if !self.br_addresses.contains(&br) {
            self.br_addresses.push(br);
        }
        Ok(())
    }

    /// Removes the softwire of (address, PSID); false when there is none.
    pub fn remove(&mut self, ipv4: Ipv4Addr, psid: u16) -> bool {
        let a = u32::from(ipv4);
        if self.softwires.remove(&key(a, psid)).is_none() {
            return false;
        }
        let n = self.users.entry(a).or_default();
        *n -= 1;
        if *n == 0 {
            self.users.remove(&a);
            self.port_sets.remove(&a);
        }
        true
    }

    /// The softwire that owns `port` of `ipv4`.
    #[inline]
    pub fn lookup(&self, ipv4: u32, port: u16) -> Option<&Softwire> {
        let psid = self.port_sets.get(&ipv4)?.psid(port)?;
        self.softwires.get(&key(ipv4, psid))
    }

    /// Whether `a` is one of the BR addresses of the table.
    #[inline]
    pub fn is_br_address(&self, a: &[u8]) -> bool {
        self.br_addresses.iter().any(|b| b == a)
    }

    pub fn len(&self) -> usize {
        self.softwires.len()
    }

    pub fn is_empty(&self) -> bool {
        self.softwires.is_empty()
    }

    /// Every softwire, for the control socket (address, PSID, B4, BR).
    pub fn dump(&self, limit: usize) -> Vec<(Ipv4Addr, u16, Ipv6Addr, Ipv6Addr)> {
        self.softwires
            .iter()
            .take(limit)
            .map(|(k, s)| {
                (
                    Ipv4Addr::from((k >> 16) as u32),
                    *k as u16,
                    Ipv6Addr::from(s.b4),
                    Ipv6Addr::from(s.br),
                )
            })
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
    fn conflicting_port_sets_are_refused_and_removal_works() {
        let e = BindingTable::new(&[spec("10.0.0.1", 0, 4, 0), spec("10.0.0.1", 1, 6, 0)])
            .err()
            .unwrap();
        assert!(e.contains("port set"), "{e}");
        let mut t = BindingTable::new(&[spec("10.0.0.1", 0, 4, 0)]).unwrap();
        assert!(t.remove("10.0.0.1".parse().unwrap(), 0));
        assert!(!t.remove("10.0.0.1".parse().unwrap(), 0));
        assert!(t.is_empty());
    }
}
