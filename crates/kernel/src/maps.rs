//! The keys and values of the data plane's maps, laid out as in `bpf/*.h`. Every struct is
//! `repr(C)` with explicit padding; [`crate::datapath`] checks each size against the kernel's
//! key and value sizes when it opens the maps, so a drift between C and Rust is an error at
//! load time, not corrupt entries.

pub const MAX_SLOTS: u32 = 256;
pub const MAX_VIDS: u32 = 4096;
pub const MAX_PORTS: u32 = 16;
pub const MAX_RULES: u32 = 64;
pub const FN_COUNTERS: u32 = 16;

pub const VI_FUNCTION: u32 = 1;
pub const VI_INTERFACE: u32 = 2;
/// An engine port: packets for it go into its ring buffer in `engine_rings` (at its VID).
pub const VI_ENGINE: u32 = 3;
/// Bytes of each engine port's ring buffer (`ENGINE_RING_BYTES` in `bpf/common.h`).
pub const ENGINE_RING_BYTES: u32 = 8 << 20;

pub const FN_FORWARDER: u32 = 1;
pub const FN_BRIDGE: u32 = 2;
pub const FN_ROUTER: u32 = 3;
pub const FN_FIREWALL: u32 = 4;
pub const FN_VXLAN: u32 = 5;

pub const FW_STATEFUL: u32 = 1;

/// Plain-old-data that can be written into a map as bytes.
///
/// # Safety
/// Implementors are `repr(C)` without implicit padding and valid for any bit pattern.
pub unsafe trait Pod: Copy + Default {
    fn bytes(&self) -> &[u8] {
        // SAFETY: Pod types have no padding and no invalid bit patterns.
        unsafe {
            std::slice::from_raw_parts(
                self as *const Self as *const u8,
                std::mem::size_of::<Self>(),
            )
        }
    }
    fn from_bytes(b: &[u8]) -> Self {
        let mut v = Self::default();
        let n = std::mem::size_of::<Self>().min(b.len());
        // SAFETY: as above; at most size_of::<Self>() bytes are copied.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), &mut v as *mut Self as *mut u8, n) };
        v
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ViInfo {
    pub kind: u32,
    pub target: u32,
    pub port: u32,
    pub pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FnInfo {
    pub kind: u32,
    pub base_vid: u32,
    pub nports: u32,
    pub nrules: u32,
    pub state_id: u32,
    pub icmp_rate: u32,
    pub flags: u32,
    pub pad: u32,
    pub aging_ns: u64,
    pub timeout_ns: [u64; 4],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ViStats {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub drops: u64,
}

/// A function's counters (`fn_counters`, per CPU, keyed by state id).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FnStats {
    pub c: [u64; FN_COUNTERS as usize],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Globals {
    pub loop_ifindex: u32,
    pub vxlan_ifindex: u32,
}

/// The data plane's own counters (`dp_counters`), in the order of `enum dp_counter`.
pub const DP_COUNTER_NAMES: [&str; 3] = ["unknown_vni", "foreign_vtep", "no_tunnel_key"];

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VxlanSegment {
    pub vni: u32,
    pub remote: [u8; 4],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VniTarget {
    pub vid: u32,
    pub remote: [u8; 4],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BridgePort {
    pub vlan: u16,
    pub pad: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FdbKey {
    pub state_id: u32,
    pub vlan: u16,
    pub mac: [u8; 6],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouterPort {
    pub mac: [u8; 6],
    pub mtu: u16,
    /// Network byte order.
    pub addr: [u8; 4],
    pub prefix_len: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteKey {
    /// 32 bits of slot + the route's prefix length.
    pub prefix_len: u32,
    /// Big-endian so that the trie matches the slot's bytes first.
    pub slot: [u8; 4],
    pub addr: [u8; 4],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Route {
    /// Network byte order; zero for connected routes.
    pub gateway: [u8; 4],
    pub port: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NeighKey {
    pub state_id: u32,
    pub addr: [u8; 4],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Neigh {
    pub mac: [u8; 6],
    pub pad: u16,
    pub updated_ns: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FwRule {
    pub action: u8,
    pub from: u8,
    pub proto: u8,
    pub has_vlan: u8,
    pub src: [u8; 4],
    pub src_mask: [u8; 4],
    pub dst: [u8; 4],
    pub dst_mask: [u8; 4],
    pub sport_lo: u16,
    pub sport_hi: u16,
    pub dport_lo: u16,
    pub dport_hi: u16,
    pub vlan: u16,
    pub pad: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtKey {
    pub state_id: u32,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub pad: [u8; 3],
}

/// Marks map keys and values as plain bytes.
macro_rules! pod {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: repr(C), padded by hand, integers and byte arrays only: every byte
            // pattern is a value and no byte is padding.
            unsafe impl Pod for $t {}
        )*
    };
}

pod!(
    u32,
    u64,
    ViInfo,
    FnInfo,
    ViStats,
    FnStats,
    Globals,
    BridgePort,
    FdbKey,
    RouterPort,
    RouteKey,
    Route,
    NeighKey,
    Neigh,
    FwRule,
    CtKey,
    VxlanSegment,
    VniTarget,
);

/// The names of each function kind's own counters, in the order of its C enum (from
/// `FC_OWN`); the first four are every function's.
pub fn counter_names(kind: u32) -> &'static [&'static str] {
    match kind {
        FN_BRIDGE => &[
            "rx",
            "tx",
            "drops",
            "malformed",
            "flooded",
            "filtered",
            "learned",
            "tagged",
        ],
        FN_ROUTER => &[
            "rx",
            "tx",
            "drops",
            "malformed",
            "forwarded",
            "arp_replies",
            "arp_requests",
            "arp_learned",
            "echo_replies",
            "ttl_exceeded",
            "no_route",
            "too_big",
            "icmp_limited",
            "not_for_us",
            "local",
            "not_ipv4",
        ],
        FN_FIREWALL => &[
            "rx",
            "tx",
            "drops",
            "malformed",
            "accepted",
            "dropped",
            "rejected",
            "established",
            "invalid",
            "new_connections",
            "default",
        ],
        FN_VXLAN => &[
            "rx",
            "tx",
            "drops",
            "malformed",
            "encapsulated",
            "decapsulated",
        ],
        _ => &["rx", "tx", "drops", "malformed"],
    }
}

pub const TAP_SESSIONS: u32 = 8;
pub const TAP_SNAP_MAX: u32 = 9216;

/// Which capture sessions copy what leaves a VID (`taps`, by VID).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TapPoint {
    /// Bit i: session i.
    pub sessions: u32,
    /// The largest snap length of those sessions.
    pub snaplen: u32,
}

pod!(TapPoint);

/// Bytes in front of the packet in a tap record (`struct tap_record`): time, VID, length,
/// bytes kept, padding.
pub const TAP_RECORD_HEADER: usize = 24;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    #[test]
    fn layouts_have_the_c_sizes() {
        assert_eq!(size_of::<ViInfo>(), 16);
        assert_eq!(size_of::<FnInfo>(), 72);
        assert_eq!(size_of::<ViStats>(), 40);
        assert_eq!(size_of::<FdbKey>(), 12);
        assert_eq!(size_of::<RouterPort>(), 16);
        assert_eq!(size_of::<RouteKey>(), 12);
        assert_eq!(size_of::<Route>(), 8);
        assert_eq!(size_of::<Neigh>(), 16);
        assert_eq!(size_of::<FwRule>(), 32);
        assert_eq!(size_of::<CtKey>(), 20);
        assert_eq!(size_of::<TapPoint>(), 8);
    }
}
