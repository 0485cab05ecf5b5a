//! Taps on the links of a kernel graph. A capture session claims one of [`TAP_SESSIONS`]
//! places, makes a BPF ring buffer of its own, puts it in `tap_rings` at its place and sets its
//! bit in `taps` for each VID it watches; the patch panel then copies what leaves those VIDs
//! into the ring (`tap_copy` in `bpf/common.h`), and the session reads it here.
//!
//! A claim is a file `/run/stitch/kernel/NAME.tap.N` holding the owner's pid, snap length and
//! VIDs, created exclusively: `taps` is always recomputed from all claims (under a lock file),
//! and a claim whose process is gone — a reader killed before it could clean up — is cleared by
//! the next session that starts.

use crate::datapath::{DataPlane, Error};
use crate::maps::{Pod, ViStats, MAX_VIDS, TAP_RECORD_HEADER, TAP_SESSIONS};
use crate::tap_claims::{
    claim_path, clear_dead_sessions, open_pinned, write_points, Claim, FileLock,
};
use libbpf_rs::{MapCore, MapFlags, MapHandle, RingBuffer, RingBufferBuilder};
use std::cell::RefCell;
use std::os::fd::{AsFd, AsRawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

/// Bytes of a session's ring between the kernel and its reader.
const RING_BYTES: u32 = 8 << 20;

/// One packet a tap saw.
pub struct TapRecord<'a> {
    /// The VID it left (a link's source).
    pub vid: u32,
    /// When, in ns since the Unix epoch.
    pub time_ns: u64,
    /// Its length on the link.
    pub len: u32,
    /// Its first bytes (up to the largest snap length of the sessions tapping the VID).
    pub data: &'a [u8],
}

/// A capture session on some VIDs of a kernel data plane; dropping it removes its taps.
pub struct KernelTap {
    session: u32,
    claim: PathBuf,
    lock: PathBuf,
    claims_dir: PathBuf,
    plane: String,
    taps: MapHandle,
    tap_rings: MapHandle,
    tap_drops: MapHandle,
    vi_counters: MapHandle,
    vids: Vec<u32>,
    start_tx: Vec<u64>,
    reader: RingBuffer<'static>,
    pending: Rc<RefCell<Vec<u8>>>,
    /// CLOCK_REALTIME minus CLOCK_MONOTONIC (the kernel stamps records with the latter).
    clock_offset_ns: i64,
    // Dropped after the reader, which maps it.
    _ring: MapHandle,
}

fn clock_ns(clock: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and out pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

impl KernelTap {
    /// Starts a session that copies the first `snaplen` bytes of what leaves each of `vids`.
    pub fn start(dp: &DataPlane, vids: &[u32], snaplen: u32) -> Result<KernelTap, Error> {
        if vids.is_empty() || vids.iter().any(|&v| v == 0 || v >= MAX_VIDS) {
            return Err(Error(format!("no valid VIDs to tap: {vids:?}")));
        }
        let pins = dp.pin_dir();
        let taps = open_pinned(pins, "taps")?;
        let tap_rings = open_pinned(pins, "tap_rings")?;
        let tap_drops = open_pinned(pins, "tap_drops")?;
        let vi_counters = open_pinned(pins, "vi_counters")?;
        let claims_dir = dp.runtime_dir();
        std::fs::create_dir_all(&claims_dir)
            .map_err(|e| Error(format!("cannot create {}: {e}", claims_dir.display())))?;
        let lock = claims_dir.join(format!("{}.taps.lock", dp.name));
        let _held = FileLock::take(&lock)?;
        clear_dead_sessions(&claims_dir, &dp.name, &taps, &tap_rings)?;

        let claimed = (0..TAP_SESSIONS).find_map(|n| {
            let path = claim_path(&claims_dir, &dp.name, n);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .ok()
                .map(|f| (n, path, f))
        });
        let Some((session, claim, file)) = claimed else {
            return Err(Error(format!(
                "{TAP_SESSIONS} captures of kernel data plane `{}` are running already; end \
                 one first",
                dp.name
            )));
        };
        let record = Claim {
            pid: std::process::id(),
            snaplen,
            vids: vids.to_vec(),
        };
        let made = serde_json::to_writer(file, &record)
            .map_err(|e| Error(format!("cannot write {}: {e}", claim.display())))
            .and_then(|_| make_ring(&tap_rings, session));
        let ring = match made {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_file(&claim);
                return Err(e);
            }
        };
        let pending = Rc::new(RefCell::new(Vec::new()));
        let sink = pending.clone();
        let mut builder = RingBufferBuilder::new();
        builder
            .add(&ring, move |r: &[u8]| {
                sink.borrow_mut().extend_from_slice(r);
                0
            })
            .map_err(|e| Error(format!("cannot read the tap's ring: {e}")))?;
        let reader = builder
            .build()
            .map_err(|e| Error(format!("cannot read the tap's ring: {e}")))?;
        let mut tap = KernelTap {
            session,
            claim,
            lock,
            claims_dir,
            plane: dp.name.clone(),
            taps,
            tap_rings,
            tap_drops,
            vi_counters,
            vids: vids.to_vec(),
            start_tx: Vec::new(),
            reader,
            pending,
            clock_offset_ns: clock_ns(libc::CLOCK_REALTIME) - clock_ns(libc::CLOCK_MONOTONIC),
            _ring: ring,
        };
        for &v in vids {
            tap.zero_drops(v)?;
        }
        tap.start_tx = vids.iter().map(|&v| tap.tx_packets(v)).collect();
        write_points(&tap.taps, &tap.claims_dir, &tap.plane, vids)?;
        Ok(tap)
    }

    /// Waits up to `timeout` for records and hands each to `each`; returns how many.
    pub fn poll(
        &mut self,
        timeout: Duration,
        mut each: impl FnMut(TapRecord<'_>),
    ) -> Result<usize, Error> {
        // The kernel wakes the reader only when the ring fills up (`tap_copy`): wait, then
        // take whatever is there.
        let mut r = self.reader.poll_raw(timeout);
        if r >= 0 {
            r = self.reader.consume_raw();
        }
        if r < 0 && r != -libc::EINTR {
            return Err(Error(format!(
                "reading the tap's ring: {}",
                std::io::Error::from_raw_os_error(-r)
            )));
        }
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        let mut at = 0;
        let mut n = 0;
        while pending.len() - at >= TAP_RECORD_HEADER {
            let word =
                |o: usize| u32::from_ne_bytes(pending[at + o..at + o + 4].try_into().unwrap());
            let time = u64::from_ne_bytes(pending[at..at + 8].try_into().unwrap());
            let caplen = word(16) as usize;
            let start = at + TAP_RECORD_HEADER;
            if pending.len() - start < caplen {
                break;
            }
            each(TapRecord {
                vid: word(8),
                time_ns: (time as i64 + self.clock_offset_ns) as u64,
                len: word(12),
                data: &pending[start..start + caplen],
            });
            at = start + caplen;
            n += 1;
        }
        // The buffer goes back for the next poll, keeping its allocation.
        let mut kept = pending;
        kept.clear();
        let mut slot = self.pending.borrow_mut();
        if slot.is_empty() {
            *slot = kept;
        }
        Ok(n)
    }

    /// The VIDs tapped, in the order they were given.
    pub fn vids(&self) -> &[u32] {
        &self.vids
    }

    /// Packets that left each VID since the session started.
    pub fn carried(&self) -> Vec<u64> {
        self.vids
            .iter()
            .zip(&self.start_tx)
            .map(|(&v, &s)| self.tx_packets(v).saturating_sub(s))
            .collect()
    }

    /// Packets of each VID the session's ring had no room for.
    pub fn dropped(&self) -> Vec<u64> {
        self.vids
            .iter()
            .map(|&v| {
                let key = self.session * MAX_VIDS + v;
                match self
                    .tap_drops
                    .lookup_percpu(&key.to_ne_bytes(), MapFlags::ANY)
                {
                    Ok(Some(per_cpu)) => per_cpu.iter().map(|b| u64::from_bytes(b)).sum(),
                    _ => 0,
                }
            })
            .collect()
    }

    fn tx_packets(&self, vid: u32) -> u64 {
        match self
            .vi_counters
            .lookup_percpu(&vid.to_ne_bytes(), MapFlags::ANY)
        {
            Ok(Some(per_cpu)) => per_cpu
                .iter()
                .map(|b| ViStats::from_bytes(b).tx_packets)
                .sum(),
            _ => 0,
        }
    }

    fn zero_drops(&self, vid: u32) -> Result<(), Error> {
        let n = libbpf_rs::num_possible_cpus().map_err(|e| Error(e.to_string()))?;
        let key = self.session * MAX_VIDS + vid;
        self.tap_drops
            .update_percpu(&key.to_ne_bytes(), &vec![vec![0u8; 8]; n], MapFlags::ANY)
            .map_err(|e| Error(format!("clearing the tap's drop counters: {e}")))
    }
}

impl Drop for KernelTap {
    fn drop(&mut self) {
        let Ok(_held) = FileLock::take(&self.lock) else {
            return;
        };
        let _ = std::fs::remove_file(&self.claim);
        let _ = write_points(&self.taps, &self.claims_dir, &self.plane, &self.vids);
        let _ = self.tap_rings.delete(&self.session.to_ne_bytes());
    }
}

/// A ring buffer for session `session`, put in `tap_rings` at its place.
fn make_ring(tap_rings: &MapHandle, session: u32) -> Result<MapHandle, Error> {
    let ring = crate::datapath::ring_buffer("stitch_tap", RING_BYTES)
        .map_err(|e| Error(format!("cannot create a ring buffer for the tap: {e}")))?;
    let fd = ring.as_fd().as_raw_fd() as u32;
    tap_rings
        .update(&session.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
        .map_err(|e| Error(format!("cannot register the tap's ring: {e}")))?;
    Ok(ring)
}
