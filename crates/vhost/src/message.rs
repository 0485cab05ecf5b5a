//! vhost-user messages (the front-end's requests and the back-end's replies), read from bytes
//! that come from another process: every size is checked, nothing is trusted. Only the
//! requests a virtio-net back-end needs are understood; any other is `Unsupported`, answered
//! with a failure when the front-end asks for a reply.
//!
//! Layout (vhost-user specification): a 12-byte header — request, flags, payload size, all u32
//! little-endian — then the payload; file descriptors travel as SCM_RIGHTS with the header.

pub const HEADER_LEN: usize = 12;
/// The largest payload we accept (a memory table of 8 regions is 8 + 8·32 = 264 bytes).
pub const MAX_PAYLOAD: usize = 4096;
pub const MAX_REGIONS: usize = 8;

pub const VERSION: u32 = 0x1;
pub const FLAG_REPLY: u32 = 0x4;
pub const FLAG_NEED_REPLY: u32 = 0x8;

pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_LOG_FD: u32 = 7;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SEND_RARP: u32 = 19;
    pub const NET_SET_MTU: u32 = 20;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub request: u32,
    pub flags: u32,
    pub size: u32,
}

impl Header {
    pub fn parse(b: &[u8]) -> Result<Header, String> {
        if b.len() < HEADER_LEN {
            return Err(format!("short header ({} bytes)", b.len()));
        }
        let h = Header {
            request: u32_at(b, 0),
            flags: u32_at(b, 4),
            size: u32_at(b, 8),
        };
        if h.flags & 0x3 != VERSION {
            return Err(format!(
                "protocol version {} (only 1 exists)",
                h.flags & 0x3
            ));
        }
        if h.size as usize > MAX_PAYLOAD {
            return Err(format!("payload of {} bytes is too large", h.size));
        }
        Ok(h)
    }

    pub fn need_reply(&self) -> bool {
        self.flags & FLAG_NEED_REPLY != 0
    }

    /// The header of our reply to this request, with `size` bytes of payload.
    pub fn reply(&self, size: usize) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&self.request.to_le_bytes());
        b[4..8].copy_from_slice(&(VERSION | FLAG_REPLY).to_le_bytes());
        b[8..12].copy_from_slice(&(size as u32).to_le_bytes());
        b
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// One region of the front-end's memory table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Region {
    pub guest_phys_addr: u64,
    pub size: u64,
    /// The region's address in the front-end's own address space (ring addresses use it).
    pub user_addr: u64,
    pub mmap_offset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VringAddr {
    pub index: u32,
    pub flags: u32,
    pub desc: u64,
    pub used: u64,
    pub avail: u64,
    pub log: u64,
}

/// A request with its payload decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    GetFeatures,
    SetFeatures(u64),
    SetOwner,
    ResetOwner,
    SetMemTable(Vec<Region>),
    SetLogBase {
        size: u64,
        offset: u64,
    },
    SetLogFd,
    SetVringNum {
        index: u32,
        num: u32,
    },
    SetVringAddr(VringAddr),
    SetVringBase {
        index: u32,
        base: u32,
    },
    GetVringBase {
        index: u32,
    },
    /// Kick, call or error eventfd of a ring; `no_fd` when the front-end polls instead.
    SetVringFd {
        which: u32,
        index: u32,
        no_fd: bool,
    },
    GetProtocolFeatures,
    SetProtocolFeatures(u64),
    GetQueueNum,
    SetVringEnable {
        index: u32,
        enable: bool,
    },
    /// After a migration: announce this MAC address on the guest's behalf.
    SendRarp([u8; 6]),
    SetMtu(u64),
    GetMaxMemSlots,
    Unsupported(u32),
}

fn need(payload: &[u8], n: usize, what: &str) -> Result<(), String> {
    if payload.len() < n {
        Err(format!(
            "{what}: payload of {} bytes, {n} needed",
            payload.len()
        ))
    } else {
        Ok(())
    }
}

/// Decodes a request; `fds` is how many descriptors came with it.
/// SET_MEM_TABLE's regions, one file descriptor each.
fn mem_table(payload: &[u8], fds: usize) -> Result<Vec<Region>, String> {
    need(payload, 8, "SET_MEM_TABLE")?;
    let n = u32_at(payload, 0) as usize;
    if n == 0 || n > MAX_REGIONS {
        return Err(format!("SET_MEM_TABLE with {n} regions (1..=8)"));
    }
    need(payload, 8 + n * 32, "SET_MEM_TABLE")?;
    if fds != n {
        return Err(format!(
            "SET_MEM_TABLE: {n} regions but {fds} file descriptors"
        ));
    }
    Ok((0..n)
        .map(|i| {
            let at = 8 + i * 32;
            Region {
                guest_phys_addr: u64_at(payload, at),
                size: u64_at(payload, at + 8),
                user_addr: u64_at(payload, at + 16),
                mmap_offset: u64_at(payload, at + 24),
            }
        })
        .collect())
}

pub fn parse(h: &Header, payload: &[u8], fds: usize) -> Result<Request, String> {
    let u64_of = |what: &str| -> Result<u64, String> {
        need(payload, 8, what)?;
        Ok(u64_at(payload, 0))
    };
    let state = |what: &str| -> Result<(u32, u32), String> {
        need(payload, 8, what)?;
        Ok((u32_at(payload, 0), u32_at(payload, 4)))
    };
    Ok(match h.request {
        req::GET_FEATURES => Request::GetFeatures,
        req::SET_FEATURES => Request::SetFeatures(u64_of("SET_FEATURES")?),
        req::SET_OWNER => Request::SetOwner,
        req::RESET_OWNER => Request::ResetOwner,
        req::SET_MEM_TABLE => Request::SetMemTable(mem_table(payload, fds)?),
        req::SET_LOG_BASE => {
            need(payload, 16, "SET_LOG_BASE")?;
            Request::SetLogBase {
                size: u64_at(payload, 0),
                offset: u64_at(payload, 8),
            }
        }
        req::SET_LOG_FD => Request::SetLogFd,
        req::SET_VRING_NUM => {
            let (index, num) = state("SET_VRING_NUM")?;
            Request::SetVringNum { index, num }
        }
        req::SET_VRING_ADDR => {
            need(payload, 40, "SET_VRING_ADDR")?;
            Request::SetVringAddr(VringAddr {
                index: u32_at(payload, 0),
                flags: u32_at(payload, 4),
                desc: u64_at(payload, 8),
                used: u64_at(payload, 16),
                avail: u64_at(payload, 24),
                log: u64_at(payload, 32),
            })
        }
        req::SET_VRING_BASE => {
            let (index, base) = state("SET_VRING_BASE")?;
            Request::SetVringBase { index, base }
        }
        req::GET_VRING_BASE => {
            let (index, _) = state("GET_VRING_BASE")?;
            Request::GetVringBase { index }
        }
        req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => {
            let v = u64_of("SET_VRING_KICK/CALL/ERR")?;
            let no_fd = v & 0x100 != 0;
            if !no_fd && fds != 1 {
                return Err(format!("ring eventfd message with {fds} descriptors"));
            }
            Request::SetVringFd {
                which: h.request,
                index: (v & 0xff) as u32,
                no_fd,
            }
        }
        req::GET_PROTOCOL_FEATURES => Request::GetProtocolFeatures,
        req::SET_PROTOCOL_FEATURES => {
            Request::SetProtocolFeatures(u64_of("SET_PROTOCOL_FEATURES")?)
        }
        req::GET_QUEUE_NUM => Request::GetQueueNum,
        req::SET_VRING_ENABLE => {
            let (index, num) = state("SET_VRING_ENABLE")?;
            if num > 1 {
                return Err(format!("SET_VRING_ENABLE with {num} (0 or 1)"));
            }
            Request::SetVringEnable {
                index,
                enable: num == 1,
            }
        }
        req::SEND_RARP => {
            need(payload, 8, "SEND_RARP")?;
            let mut mac = [0u8; 6];
            mac.copy_from_slice(&payload[..6]);
            Request::SendRarp(mac)
        }
        req::NET_SET_MTU => Request::SetMtu(u64_of("NET_SET_MTU")?),
        req::GET_MAX_MEM_SLOTS => Request::GetMaxMemSlots,
        other => Request::Unsupported(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(request: u32, size: u32) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&request.to_le_bytes());
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
        b
    }

    #[test]
    fn headers_and_payloads_are_checked() {
        let h = Header::parse(&hdr(req::SET_FEATURES, 8)).unwrap();
        assert_eq!(
            parse(&h, &7u64.to_le_bytes(), 0).unwrap(),
            Request::SetFeatures(7)
        );
        assert!(parse(&h, &[1, 2, 3], 0).is_err(), "short payload");
        let mut bad = hdr(1, 0);
        bad[4] = 2;
        assert!(Header::parse(&bad).is_err(), "version 2");
        assert!(Header::parse(&hdr(1, 1 << 20)).is_err(), "huge size");
        assert!(Header::parse(&[0; 5]).is_err());
    }

    #[test]
    fn memory_tables_need_one_fd_per_region() {
        let h = Header::parse(&hdr(req::SET_MEM_TABLE, 40)).unwrap();
        let mut p = vec![0u8; 40];
        p[0] = 1;
        p[16..24].copy_from_slice(&4096u64.to_le_bytes());
        assert!(parse(&h, &p, 0).is_err());
        let Request::SetMemTable(r) = parse(&h, &p, 1).unwrap() else {
            panic!()
        };
        assert_eq!(r[0].size, 4096);
        p[0] = 9;
        assert!(parse(&h, &p, 9).is_err(), "more than 8 regions");
    }

    #[test]
    fn vring_fds_may_be_absent_only_when_flagged() {
        let h = Header::parse(&hdr(req::SET_VRING_KICK, 8)).unwrap();
        assert!(parse(&h, &1u64.to_le_bytes(), 0).is_err());
        assert_eq!(
            parse(&h, &0x101u64.to_le_bytes(), 0).unwrap(),
            Request::SetVringFd {
                which: req::SET_VRING_KICK,
                index: 1,
                no_fd: true
            }
        );
    }
}
