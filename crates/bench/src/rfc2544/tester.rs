//! One trial's traffic: numbered, stamped frames sent at a fixed rate into one vhost-user port
//! of the device under test and taken from another, on one thread (the tester's core).
//!
//! Each frame is Ethernet/IPv4/UDP from RFC 2544's benchmarking addresses (198.18.0.1 →
//! 198.19.0.1) and ends with an 18-byte trailer: the trial's tag (u16), the frame's number
//! (u64) and the time it was sent (u64, ns, one reading per batch). The trailer is at the end
//! so that a device that adds or removes headers in front keeps it; a 64-byte frame (60 bytes
//! without its FCS) is exactly headers and trailer. Frames of an earlier trial are recognised
//! by their tag and not counted.

use std::time::{Duration, Instant};
use stitch_core::latency::{LatencyCounts, LatencyHistogram};
use stitch_core::packet::now_ns;
use stitch_vhost::frontend::Frontend;
use stitch_wire::ethertype;

const TRAILER: usize = 18;
/// Frames sent per batch at most (one clock reading, one publication, one kick).
const BURST: usize = 32;
/// Frames the tester may be behind its schedule; beyond, its own core was taken from it (it
/// is not a line-rate generator) and the frames it missed are not offered at all, rather than
/// sent as a burst the device's input was never meant to take.
const MOST_BEHIND: u64 = 4 * BURST as u64;
/// After the last frame is sent, how long the receiver waits for stragglers once none came.
const QUIET: Duration = Duration::from_millis(100);
/// The longest wait for stragglers (RFC 2544 §23 waits 2 s).
const MOST_DRAIN: Duration = Duration::from_secs(2);

/// A frame size of RFC 2544's list (bytes on the wire with the FCS), or the simple IMIX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum FrameSize {
    Fixed(usize),
    /// 64, 570 and 1518 bytes in the proportion 7 : 4 : 1.
    Imix,
}

impl std::str::FromStr for FrameSize {
    type Err = String;
    fn from_str(s: &str) -> Result<FrameSize, String> {
        if s.eq_ignore_ascii_case("imix") {
            return Ok(FrameSize::Imix);
        }
        match s.parse::<usize>() {
            Ok(n) if (64..=1518).contains(&n) => Ok(FrameSize::Fixed(n)),
            _ => Err(format!("frame size `{s}`: 64..=1518 bytes or `imix`")),
        }
    }
}

impl std::fmt::Display for FrameSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameSize::Fixed(n) => write!(f, "{n}"),
            FrameSize::Imix => write!(f, "imix"),
        }
    }
}

impl FrameSize {
    /// The sizes frames take in turn (with FCS).
    fn cycle(self) -> Vec<usize> {
        match self {
            FrameSize::Fixed(n) => vec![n],
            FrameSize::Imix => [[64; 7].as_slice(), &[570; 4], &[1518]].concat(),
        }
    }

    /// Mean bytes per frame with FCS, for bit rates.
    pub fn mean_bytes(self) -> f64 {
        let c = self.cycle();
        c.iter().sum::<usize>() as f64 / c.len() as f64
    }
}

/// The frames of a trial, one template per size of the cycle (without FCS).
pub struct Frames {
    templates: Vec<Vec<u8>>,
}

fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet/IPv4/UDP frame of `len` bytes (without FCS), its payload zero.
fn template(len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x01]);
    f[12..14].copy_from_slice(&ethertype::IPV4.to_be_bytes());
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((len - 14) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&[198, 18, 0, 1]);
    ip[16..20].copy_from_slice(&[198, 19, 0, 1]);
    let sum = checksum(ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let udp = &mut f[34..42];
    udp[0..2].copy_from_slice(&1024u16.to_be_bytes());
    udp[2..4].copy_from_slice(&1024u16.to_be_bytes());
    udp[4..6].copy_from_slice(&((len - 34) as u16).to_be_bytes());
    f
}

impl Frames {
    pub fn new(size: FrameSize) -> Frames {
        Frames {
            templates: size.cycle().into_iter().map(|n| template(n - 4)).collect(),
        }
    }
}

/// What one trial counted.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TrialResult {
    pub seconds: f64,
    /// Frames offered: those sent, and those due while the device's input ring was full.
    pub sent: u64,
    /// Frames due while the device's input ring was full (the device took nothing more): lost
    /// at its input, as a NIC's full receive ring loses them.
    pub input_overflow: u64,
    /// Frames the tester missed its schedule by (its core was busy elsewhere): not offered.
    pub tester_behind: u64,
    pub received: u64,
    /// Frames that arrived with a number below one already received.
    pub reordered: u64,
    /// Frames of an earlier trial that arrived during this one (not counted as received).
    pub stale: u64,
    /// The latency of every frame received, with `latency`.
    pub latency: Option<LatencyCounts>,
    /// Mean difference between the latencies of consecutive frames (RFC 3393's delay
    /// variation; VSPERF's jitter), ns.
    pub jitter_ns: f64,
}

impl TrialResult {
    pub fn offered_pps(&self) -> f64 {
        self.sent as f64 / self.seconds
    }
    pub fn loss_ratio(&self) -> f64 {
        match self.sent {
            0 => 0.0,
            n => n.saturating_sub(self.received) as f64 / n as f64,
        }
    }
}

/// The receiver's side of a trial.
struct Receiver {
    tag: u16,
    result: TrialResult,
    next: u64,
    histogram: Option<LatencyHistogram>,
    last_latency: Option<u64>,
    jitter_sum: f64,
    jitter_n: u64,
}

impl Receiver {
    fn take(&mut self, frame: &[u8], now: u64) {
        let Some(t) = frame.len().checked_sub(TRAILER).map(|at| &frame[at..]) else {
            return;
        };
        if u16::from_le_bytes([t[0], t[1]]) != self.tag {
            self.result.stale += 1;
            return;
        }
        let seq = u64::from_le_bytes(t[2..10].try_into().expect("8 bytes"));
        let sent = u64::from_le_bytes(t[10..18].try_into().expect("8 bytes"));
        self.result.received += 1;
        if seq < self.next {
            self.result.reordered += 1;
        } else {
            self.next = seq + 1;
        }
        if let Some(h) = &self.histogram {
            let latency = now.saturating_sub(sent);
            h.record(latency);
            if let Some(last) = self.last_latency {
                self.jitter_sum += latency.abs_diff(last) as f64;
                self.jitter_n += 1;
            }
            self.last_latency = Some(latency);
        }
    }
}

/// Sends `frames` into `tx` for `seconds` at `rate_pps` (as fast as `tx` takes them when
/// `None`) and counts what comes out of `rx`, waiting for stragglers after the last.
pub fn trial(
    tx: &mut Frontend,
    rx: &mut Frontend,
    frames: &Frames,
    rate_pps: Option<f64>,
    seconds: f64,
    tag: u16,
    latency: bool,
) -> TrialResult {
    let mut r = Receiver {
        tag,
        result: TrialResult::default(),
        next: 0,
        histogram: latency.then(LatencyHistogram::new),
        last_latency: None,
        jitter_sum: 0.0,
        jitter_n: 0,
    };
    let cycle = frames.templates.len() as u64;
    let start = Instant::now();
    let length = Duration::from_secs_f64(seconds);
    // Frames offered (sent or lost at the input) and frames sent, which are numbered.
    let (mut offered, mut sent) = (0u64, 0u64);
    loop {
        let elapsed = start.elapsed();
        if elapsed >= length {
            break;
        }
        let due = rate_pps.map_or(u64::MAX, |r| (elapsed.as_secs_f64() * r) as u64);
        let mut due_now = due.saturating_sub(offered + r.result.tester_behind);
        if rate_pps.is_some() && due_now > MOST_BEHIND {
            r.result.tester_behind += due_now - BURST as u64;
            due_now = BURST as u64;
        }
        let want = due_now.min(BURST as u64) as usize;
        if want > 0 {
            let stamp = now_ns().to_le_bytes();
            let mut seq = sent;
            let n = tx.send(want, |buf| {
                let t = &frames.templates[(seq % cycle) as usize];
                let len = t.len();
                buf[..len].copy_from_slice(t);
                let trailer = &mut buf[len - TRAILER..len];
                trailer[0..2].copy_from_slice(&tag.to_le_bytes());
                trailer[2..10].copy_from_slice(&seq.to_le_bytes());
                trailer[10..18].copy_from_slice(&stamp);
                seq += 1;
                len
            }) as u64;
            sent += n;
            offered += n;
            // At a paced rate, what the full ring did not take is lost at the input; as fast
            // as possible, the ring's room is the pace.
            if n < want as u64 && rate_pps.is_some() {
                r.result.input_overflow += want as u64 - n;
                offered += want as u64 - n;
            }
        }
        let now = now_ns();
        rx.receive(|f| r.take(f, now));
    }
    r.result.seconds = start.elapsed().as_secs_f64();
    r.result.sent = offered;
    if r.result.tester_behind > 0 {
        log::debug!(
            "the tester fell {} frames behind its schedule",
            r.result.tester_behind
        );
    }
    let (ended, mut last_frame) = (Instant::now(), Instant::now());
    while r.result.received < sent && last_frame.elapsed() < QUIET && ended.elapsed() < MOST_DRAIN {
        let now = now_ns();
        if rx.receive(|f| r.take(f, now)) > 0 {
            last_frame = Instant::now();
        }
        tx.reclaim();
    }
    r.result.latency = r.histogram.as_ref().map(LatencyHistogram::counts);
    r.result.jitter_ns = r.jitter_sum / r.jitter_n.max(1) as f64;
    r.result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_have_the_sizes_of_rfc_2544_and_valid_headers() {
        for (size, first) in [(FrameSize::Fixed(64), 60), (FrameSize::Imix, 60)] {
            let f = Frames::new(size);
            assert_eq!(f.templates[0].len(), first);
            let ip = &f.templates[0][14..34];
            assert_eq!(
                checksum(ip),
                0,
                "an IPv4 header with its checksum sums to 0"
            );
        }
        let imix = Frames::new(FrameSize::Imix);
        let lens: Vec<usize> = imix.templates.iter().map(Vec::len).collect();
        assert_eq!(lens.iter().filter(|&&l| l == 60).count(), 7);
        assert_eq!(lens.iter().filter(|&&l| l == 566).count(), 4);
        assert_eq!(lens.iter().filter(|&&l| l == 1514).count(), 1);
        assert!((FrameSize::Imix.mean_bytes() - 353.83).abs() < 0.01);
        assert!("63".parse::<FrameSize>().is_err());
        assert_eq!("1518".parse::<FrameSize>(), Ok(FrameSize::Fixed(1518)));
    }

    #[test]
    fn the_receiver_counts_reordering_and_ignores_other_trials() {
        let mut r = Receiver {
            tag: 7,
            result: TrialResult::default(),
            next: 0,
            histogram: Some(LatencyHistogram::new()),
            last_latency: None,
            jitter_sum: 0.0,
            jitter_n: 0,
        };
        let frame = |tag: u16, seq: u64, sent: u64| {
            let mut f = template(60);
            f[42..44].copy_from_slice(&tag.to_le_bytes());
            f[44..52].copy_from_slice(&seq.to_le_bytes());
            f[52..60].copy_from_slice(&sent.to_le_bytes());
            f
        };
        r.take(&frame(7, 0, 1000), 1500);
        r.take(&frame(7, 2, 1000), 1700);
        r.take(&frame(7, 1, 1000), 1600);
        r.take(&frame(6, 3, 1000), 1600);
        assert_eq!(
            (r.result.received, r.result.reordered, r.result.stale),
            (3, 1, 1)
        );
        let l = r.histogram.unwrap().counts();
        assert_eq!((l.min_ns, l.max_ns), (500, 700));
        assert_eq!(r.jitter_sum / r.jitter_n as f64, 150.0);
    }
}
