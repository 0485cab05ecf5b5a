//! `generator`: builds Ethernet + IPv4/IPv6 + UDP/TCP packets with correct lengths and
//! checksums, of a fixed size or a size mix, over a number of flows, optionally rate limited.
//!
//! `size` is the frame length as a PCAP file holds it (no FCS): a number, `imix` (64, 576 and
//! 1500 bytes in the proportion 7:4:1; 64 grows to 74 for IPv6/TCP headers) or a list that is cycled through. `rate` is packets per
//! second (a number, or `"2.5 Mpps"`) or bits per second of frames (`"10 Gbit/s"`, `"100 Mbps"`);
//! what the rate calls for while the output link is full is not sent later but counted in
//! `rate_shortfall` (what a wire at that rate would have lost).
//! Flow `i` has source address `src_ip + i`. With `count`, the generator stops after that many
//! packets (and `stitch run` ends once they are through the graph).
//!
//! ```yaml
//! apps:
//!   gen: { type: generator, size: imix, flows: 100, rate: "1 Gbit/s", ip: ipv6, protocol: tcp }
//! ```

use serde::Deserialize;
use std::net::IpAddr;
use std::time::Instant;
use stitch_core::link::Producer;
use stitch_core::packet::now_ns;
use stitch_core::packet::MAX_FRAME;
use stitch_core::{App, AppContext, AppError, Counter, Io, PortSpec, PULL_BURST};
use stitch_wire::build::{Frame, Transport};
use stitch_wire::parse_mac;

/// Frame sizes of the simple IMIX.
pub const IMIX: [usize; 12] = [64, 576, 64, 64, 1500, 64, 576, 64, 64, 576, 64, 576];

/// A frame size, `imix`, or a list of sizes.
#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum SizeSpec {
    Fixed(usize),
    Named(String),
    Mix(Vec<usize>),
}

/// A rate: packets per second as a number, or a number and a unit: `1000 pps`, `2.5 Mpps`,
/// `64kbit/s`, `100 Mbit/s`, `10 Gbit/s` (`Mbps` and `Gbps` too).
#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum RateSpec {
    PacketsPerSecond(f64),
    Text(String),
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum IpVersion {
    #[default]
    Ipv4,
    Ipv6,
}

#[derive(
    schemars::JsonSchema, serde::Serialize, Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum L4 {
    #[default]
    Udp,
    Tcp,
}

#[derive(schemars::JsonSchema, serde::Serialize, Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GeneratorConfig {
    /// Frame size in bytes (without the FCS): a number, `imix` (the simple IMIX: 64, 576 and 1500
    /// bytes, 7:4:1), or a list taken in turn.
    pub size: SizeSpec,
    /// Rate limit (unlimited when unset): what the rate calls for while the output is full is not
    /// sent later but counted in `rate_shortfall`.
    pub rate: Option<RateSpec>,
    /// Flows taken in turn, 1 to 1 048 576: flow `i` has source address `src_ip + i`.
    pub flows: u32,
    /// The IP version of the packets.
    pub ip: IpVersion,
    /// The transport protocol of the packets.
    pub protocol: L4,
    /// Source MAC address.
    pub src_mac: String,
    /// Destination MAC address.
    pub dst_mac: String,
    /// Source address of flow 0 (default `10.0.0.1`, or `fd00::1` for IPv6).
    pub src_ip: Option<IpAddr>,
    /// Destination address (default `10.1.0.1`, or `fd00:1::1` for IPv6).
    pub dst_ip: Option<IpAddr>,
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Stop after this many packets (endless when unset).
    pub count: Option<u64>,
    /// Stamp packets with the time they were made (one clock read per batch).
    pub timestamps: bool,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        GeneratorConfig {
            size: SizeSpec::Fixed(64),
            rate: None,
            flows: 1,
            ip: IpVersion::Ipv4,
            protocol: L4::Udp,
            src_mac: "02:00:00:00:00:01".into(),
            dst_mac: "02:00:00:00:00:02".into(),
            src_ip: None,
            dst_ip: None,
            src_port: 1024,
            dst_port: 1234,
            count: None,
            timestamps: true,
        }
    }
}

/// A rate limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rate {
    Pps(f64),
    Bps(f64),
}

/// Parses `"2.5 Mpps"`, `"10 Gbit/s"`, `"100 Mbps"`, `"64kbit/s"`, `"1000 pps"`.
pub fn parse_rate(s: &str) -> Result<Rate, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("rate `{s}`: expected a number and a unit"))?;
    let unit = unit.trim();
    let (mult, pps) = match unit {
        "pps" | "" => (1.0, true),
        "kpps" | "Kpps" => (1e3, true),
        "Mpps" | "mpps" => (1e6, true),
        "Gpps" => (1e9, true),
        "bps" | "bit/s" => (1.0, false),
        "kbps" | "Kbps" | "kbit/s" | "Kbit/s" => (1e3, false),
        "Mbps" | "Mbit/s" => (1e6, false),
        "Gbps" | "Gbit/s" => (1e9, false),
        _ => {
            return Err(format!(
                "rate `{s}`: unknown unit `{unit}` (pps, kpps, Mpps, bit/s, kbit/s, Mbit/s, Gbit/s)"
            ))
        }
    };
    let v = v * mult;
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("rate `{s}` must be positive"));
    }
    Ok(if pps { Rate::Pps(v) } else { Rate::Bps(v) })
}

struct Plan {
    sizes: Vec<usize>,
    rate: Option<Rate>,
    header_len: usize,
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src_ip: IpAddr,
    dst_ip: IpAddr,
}

const TEMPLATE_LIMIT: usize = 64 << 20;

fn plan(c: &GeneratorConfig) -> Result<Plan, String> {
    let l3 = if c.ip == IpVersion::Ipv4 { 20 } else { 40 };
    let l4 = if c.protocol == L4::Udp { 8 } else { 20 };
    let header_len = 14 + l3 + l4;
    let sizes = match &c.size {
        SizeSpec::Fixed(n) => vec![*n],
        // IPv6/TCP headers alone take 74 bytes: IMIX's small frames grow to fit them.
        SizeSpec::Named(n) if n.eq_ignore_ascii_case("imix") => {
            IMIX.iter().map(|&s| s.max(header_len)).collect()
        }
        SizeSpec::Named(n) => return Err(format!("size `{n}`: give a number, `imix` or a list")),
        SizeSpec::Mix(v) if v.is_empty() => return Err("size: the list is empty".into()),
        SizeSpec::Mix(v) => v.clone(),
    };
    for &s in &sizes {
        if s < header_len || s > MAX_FRAME {
            return Err(format!(
                "size {s}: must be {header_len}..={MAX_FRAME} bytes for {:?}/{:?}",
                c.ip, c.protocol
            ));
        }
    }
    if c.flows == 0 || c.flows > 1 << 20 {
        return Err(format!("flows must be 1..=1048576, got {}", c.flows));
    }
    let mut distinct = sizes.clone();
    distinct.sort();
    distinct.dedup();
    if c.flows as usize * distinct.len() * header_len > TEMPLATE_LIMIT {
        return Err("flows × distinct sizes is too large (templates over 64 MiB)".into());
    }
    let rate = match &c.rate {
        None => None,
        Some(RateSpec::PacketsPerSecond(v)) if *v > 0.0 => Some(Rate::Pps(*v)),
        Some(RateSpec::PacketsPerSecond(v)) => return Err(format!("rate {v} must be positive")),
        Some(RateSpec::Text(s)) => Some(parse_rate(s)?),
    };
    let (src_ip, dst_ip) = match c.ip {
        IpVersion::Ipv4 => (
            c.src_ip.unwrap_or("10.0.0.1".parse().unwrap()),
            c.dst_ip.unwrap_or("10.1.0.1".parse().unwrap()),
        ),
        IpVersion::Ipv6 => (
            c.src_ip.unwrap_or("fd00::1".parse().unwrap()),
            c.dst_ip.unwrap_or("fd00:1::1".parse().unwrap()),
        ),
    };
    if src_ip.is_ipv4() != (c.ip == IpVersion::Ipv4) || dst_ip.is_ipv4() != src_ip.is_ipv4() {
        return Err(format!("src_ip/dst_ip must be {:?} addresses", c.ip));
    }
    Ok(Plan {
        sizes,
        rate,
        header_len,
        src_mac: parse_mac(&c.src_mac)?,
        dst_mac: parse_mac(&c.dst_mac)?,
        src_ip,
        dst_ip,
    })
}

/// The frame of flow 0 and `size` bytes, its payload all zeroes (flows differ in their source
/// address, [`Frame::src`]).
fn frame_of(c: &GeneratorConfig, p: &Plan, size: usize) -> Frame {
    let transport = match c.protocol {
        L4::Udp => Transport::udp(c.src_port, c.dst_port),
        L4::Tcp => Transport::tcp(c.src_port, c.dst_port),
    };
    let mut f = match (p.src_ip, p.dst_ip) {
        (IpAddr::V4(s), IpAddr::V4(d)) => Frame::ipv4(s, d, transport).dont_fragment(true),
        (IpAddr::V6(s), IpAddr::V6(d)) => Frame::ipv6(s, d, transport),
        _ => unreachable!("checked by plan"),
    };
    f = f
        .macs(p.src_mac, p.dst_mac)
        .payload_len(size - p.header_len);
    f
}

/// Flow `flow`'s source address: the configured one plus `flow`.
fn flow_source(src: IpAddr, flow: u32) -> IpAddr {
    match src {
        IpAddr::V4(s) => IpAddr::V4(u32::from(s).wrapping_add(flow).into()),
        IpAddr::V6(s) => IpAddr::V6(u128::from(s).wrapping_add(flow as u128).into()),
    }
}

/// Writes the headers of flow `flow`'s frame (`frame`, of flow 0) into `out`; `scratch` holds
/// the whole frame meanwhile.
fn write_headers(frame: &mut Frame, p: &Plan, flow: u32, scratch: &mut Vec<u8>, out: &mut [u8]) {
    frame.src = flow_source(p.src_ip, flow);
    scratch.resize(frame.frame_len(), 0);
    frame.write(scratch);
    out.copy_from_slice(&scratch[..out.len()]);
}

pub struct Generator {
    /// The size list in its order, one entry per size: its length and its template's place
    /// among a flow's templates.
    steps: Vec<Step>,
    /// Whether templates hold whole frames (when they all fit in `TEMPLATE_LIMIT`: a packet is
    /// one copy, as Snabb's Source clones its template) or headers only (the payload of zeroes
    /// is written per packet).
    whole_frames: bool,
    /// The mean frame length of the size cycle, for the prefetch of the lines frames fill.
    mean_len: usize,
    /// Templates by (flow, distinct size). Whole frames are stored as whole 64-byte blocks,
    /// zero-padded, so that a frame is copied in fixed-size blocks without a call to memcpy.
    templates: Vec<u8>,
    /// Bytes of one flow's templates, and of all of them.
    flow_stride: usize,
    flows_end: usize,
    /// Where the next frame's flow's templates start, and its entry in `steps`.
    next_flow_at: usize,
    next_size: usize,
    rate: Option<Rate>,
    tokens: f64,
    /// When the budget was last worked out; none before the first breath.
    last: Option<Instant>,
    remaining: Option<u64>,
    timestamps: bool,
    exhausted: Counter,
    /// Packets the rate called for that the output link had no room for: what a wire at that
    /// rate would have lost (not drops of the graph: they were never made).
    shortfall: Counter,
}

/// A frame size of the cycle, worked out once: the template's place within its flow's
/// templates, the frame's length, and the bytes copied from the template (whole 64-byte
/// blocks of a whole frame, or the headers).
#[derive(Clone, Copy)]
struct Step {
    template_at: usize,
    len: usize,
    copied: usize,
}

impl Generator {
    /// Packets (or bytes) the rate allows now.
    fn budget(&mut self) -> f64 {
        let Some(rate) = self.rate else {
            return f64::INFINITY;
        };
        let now = Instant::now();
        let dt = now
            .duration_since(*self.last.get_or_insert(now))
            .as_secs_f64();
        self.last = Some(now);
        // Tokens accrue for the time since the last breath; what the output could not take is
        // kept only up to one breath's worth (at least 1 ms, at least one batch), so a full link
        // does not build up a burst while a long breath (thousands of apps) keeps the rate.
        let window = dt.max(1e-3);
        let (per_s, cap) = match rate {
            Rate::Pps(r) => (r, (r * window).max(64.0)),
            Rate::Bps(r) => (r / 8.0, (r / 8.0 * window).max(64.0 * 1514.0)),
        };
        let owed = self.tokens + dt * per_s;
        if owed > cap {
            let per_packet = match rate {
                Rate::Pps(_) => 1.0,
                Rate::Bps(_) => self.mean_len.max(1) as f64,
            };
            self.shortfall.add(((owed - cap) / per_packet) as u64);
        }
        self.tokens = owed.min(cap);
        self.tokens
    }
}

impl Generator {
    /// How many of the next `n` packets the budget pays for: one token each, or their sizes in
    /// bytes.
    fn affordable(&self, n: usize, budget: f64) -> usize {
        match self.rate {
            Some(Rate::Bps(_)) => {
                let mut left = budget;
                let mut at = self.next_size;
                let mut k = 0;
                while k < n && left >= self.steps[at].len as f64 {
                    left -= self.steps[at].len as f64;
                    at = if at + 1 == self.steps.len() {
                        0
                    } else {
                        at + 1
                    };
                    k += 1;
                }
                k
            }
            _ => n.min(budget.min(usize::MAX as f64) as usize),
        }
    }

    /// Writes the next `n` frames (flows and sizes in turn) straight into the output's slots;
    /// returns the packets and bytes made. The walk lives in a local and each template layout
    /// has its own loop, so a packet costs one table entry, one copy and two wrapping counters.
    fn write_burst(&mut self, out: &mut Producer, n: usize, ts: u64) -> (usize, usize) {
        let templates = &self.templates[..];
        let mut walk = Walk {
            steps: &self.steps,
            flow_stride: self.flow_stride,
            flows_end: self.flows_end,
            flow_at: self.next_flow_at,
            size_at: self.next_size,
            bytes: 0,
        };
        // Sizes (and their 64-byte round-up) were checked against MAX_FRAME by `plan`. A fresh
        // packet's timestamp is 0, so writing `ts` = 0 changes nothing.
        let sent = if self.whole_frames {
            out.transmit_fresh(n, self.mean_len, |p| {
                let (at, step) = walk.next();
                // SAFETY: `transmit_fresh` hands fresh packets, and step.len ≤ step.copied ≤
                // MAX_FRAME (checked by `plan`).
                let frame = unsafe { p.fresh_frame_mut(step.len, step.copied) };
                let (to, _) = frame.as_chunks_mut::<64>();
                let (from, _) = templates[at..at + step.copied].as_chunks::<64>();
                match (to, from) {
                    // A minimum-size frame: one line, copied without a loop.
                    ([to], [from]) => *to = *from,
                    (to, from) => to.iter_mut().zip(from).for_each(|(t, f)| *t = *f),
                }
                p.set_timestamp_ns(ts);
            })
        } else {
            out.transmit_fresh(n, self.mean_len, |p| {
                let (at, step) = walk.next();
                // SAFETY: as above; step.copied (the header) ≤ step.len ≤ MAX_FRAME.
                let frame = unsafe { p.fresh_frame_mut(step.len, step.len) };
                let (headers, payload) = frame.split_at_mut(step.copied);
                headers.copy_from_slice(&templates[at..at + step.copied]);
                payload.fill(0);
                p.set_timestamp_ns(ts);
            })
        };
        self.next_flow_at = walk.flow_at;
        self.next_size = walk.size_at;
        (sent, walk.bytes)
    }
}

/// The generator's place in its cycle of flows and sizes during one burst.
struct Walk<'a> {
    steps: &'a [Step],
    flow_stride: usize,
    flows_end: usize,
    flow_at: usize,
    size_at: usize,
    bytes: usize,
}

impl Walk<'_> {
    /// The next frame's template offset and size; moves on to the frame after it.
    #[inline(always)]
    fn next(&mut self) -> (usize, Step) {
        let step = self.steps[self.size_at];
        let at = self.flow_at + step.template_at;
        self.bytes += step.len;
        self.size_at += 1;
        if self.size_at == self.steps.len() {
            self.size_at = 0;
        }
        self.flow_at += self.flow_stride;
        if self.flow_at == self.flows_end {
            self.flow_at = 0;
        }
        (at, step)
    }
}

impl App for Generator {
    type Config = GeneratorConfig;
    const EXAMPLE: &'static str = r#"size: imix
flows: 100
rate: "1 Gbit/s"
ip: ipv6
protocol: tcp
"#;

    fn declare(c: &GeneratorConfig) -> Result<PortSpec, AppError> {
        plan(c)?;
        Ok(PortSpec::source())
    }

    fn new(c: GeneratorConfig, ctx: &mut AppContext) -> Result<Self, AppError> {
        let p = plan(&c)?;
        let mut distinct = p.sizes.clone();
        distinct.sort();
        distinct.dedup();
        let largest = *distinct.last().expect("plan gives at least one size");
        let whole_frames =
            c.flows as usize * distinct.len() * largest.next_multiple_of(64) <= TEMPLATE_LIMIT;
        let template_stride = if whole_frames {
            largest.next_multiple_of(64)
        } else {
            p.header_len
        };
        let flow_stride = distinct.len() * template_stride;
        let mut templates = vec![0u8; c.flows as usize * flow_stride];
        let mut frames: Vec<Frame> = distinct.iter().map(|&s| frame_of(&c, &p, s)).collect();
        let mut scratch = Vec::new();
        for flow in 0..c.flows as usize {
            for (slot, frame) in frames.iter_mut().enumerate() {
                let at = flow * flow_stride + slot * template_stride;
                let out = &mut templates[at..at + p.header_len];
                write_headers(frame, &p, flow as u32, &mut scratch, out);
            }
        }
        let mean_len = p.sizes.iter().sum::<usize>() / p.sizes.len();
        let steps = p
            .sizes
            .iter()
            .map(|&len| Step {
                template_at: distinct.binary_search(&len).unwrap() * template_stride,
                len,
                copied: if whole_frames {
                    len.next_multiple_of(64)
                } else {
                    p.header_len
                },
            })
            .collect();
        Ok(Generator {
            steps,
            whole_frames,
            mean_len,
            templates,
            flow_stride,
            flows_end: c.flows as usize * flow_stride,
            next_flow_at: 0,
            next_size: 0,
            rate: p.rate,
            tokens: 0.0,
            last: None,
            remaining: c.count,
            timestamps: c.timestamps,
            exhausted: ctx.counter("pool_exhausted_drops"),
            shortfall: ctx.counter("rate_shortfall"),
        })
    }

    fn pull(&mut self, io: &mut Io) {
        let Some(out) = io.output(0) else { return };
        // Unpaced, a burst per breath (the next breath comes soon); paced, whatever the budget
        // pays for, so that long breaths (thousands of apps) do not lower the rate.
        let mut n = match self.rate {
            None => out.room().min(PULL_BURST),
            Some(_) => out.room(),
        };
        if let Some(r) = self.remaining {
            n = n.min(r.min(usize::MAX as u64) as usize);
        }
        if n == 0 {
            return;
        }
        let budget = self.budget();
        let n = self.affordable(n, budget);
        if n == 0 {
            return;
        }
        let ts = if self.timestamps { now_ns() } else { 0 };
        let (sent, bytes) = self.write_burst(out, n, ts);
        // The link had room for n: the rest is what the pool could not give.
        if sent < n {
            self.exhausted.add((n - sent) as u64);
        }
        match self.rate {
            Some(Rate::Bps(_)) => self.tokens = budget - bytes as f64,
            Some(Rate::Pps(_)) => self.tokens = budget - sent as f64,
            None => {}
        }
        if let Some(r) = self.remaining.as_mut() {
            *r -= sent as u64;
        }
    }

    fn finished(&self) -> Option<bool> {
        self.remaining.map(|r| r == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stitch_core::link::link;
    use stitch_wire::checksum;
    use stitch_wire::ethertype;

    fn run(c: GeneratorConfig, pulls: usize) -> Vec<Vec<u8>> {
        let mut ctx = AppContext::new("g", std::path::Path::new("."), Default::default());
        let mut g = Generator::new(c, &mut ctx).unwrap();
        let (tx, mut rx) = link(4096);
        let mut io = Io::new(vec![], vec![("output".into(), tx)]);
        for _ in 0..pulls {
            g.pull(&mut io);
        }
        rx.drain().map(|p| p.data().to_vec()).collect()
    }

    fn verify_l4(frame: &[u8]) {
        let v4 = frame[12..14] == ethertype::IPV4.to_be_bytes();
        let (l3, proto) = if v4 { (20, frame[23]) } else { (40, frame[20]) };
        let l4 = &frame[14 + l3..];
        let mut pseudo = 0u64;
        if v4 {
            assert_eq!(
                checksum::checksum(&frame[14..34]),
                0,
                "IPv4 header checksum"
            );
            pseudo = checksum::sum(&frame[26..34], pseudo);
        } else {
            pseudo = checksum::sum(&frame[22..54], pseudo);
        }
        pseudo += proto as u64 + l4.len() as u64;
        assert_eq!(
            checksum::finish(checksum::sum(l4, pseudo)),
            0,
            "L4 checksum"
        );
    }

    #[test]
    fn fixed_size_udp_ipv4_is_valid() {
        let frames = run(
            GeneratorConfig {
                count: Some(10),
                flows: 3,
                ..Default::default()
            },
            5,
        );
        assert_eq!(frames.len(), 10);
        for f in &frames {
            assert_eq!(f.len(), 64);
            verify_l4(f);
        }
        // Flows differ by source address.
        assert_ne!(frames[0][26..30], frames[1][26..30]);
        assert_eq!(frames[0][26..30], frames[3][26..30]);
    }

    #[test]
    fn imix_tcp_ipv6_is_valid() {
        let c = GeneratorConfig {
            size: SizeSpec::Named("imix".into()),
            ip: IpVersion::Ipv6,
            protocol: L4::Tcp,
            count: Some(24),
            ..Default::default()
        };
        let frames = run(c, 1);
        let sizes: Vec<usize> = frames.iter().map(|f| f.len()).collect();
        let expect: Vec<usize> = IMIX.iter().map(|&s| s.max(74)).collect();
        assert_eq!(&sizes[..12], &expect[..]);
        frames.iter().for_each(|f| verify_l4(f));
    }

    /// The frame the generator must send as packet `i`: flow `i mod flows`, size `i mod sizes`.
    fn expected(c: &GeneratorConfig, i: usize) -> Vec<u8> {
        let p = plan(c).unwrap();
        let size = p.sizes[i % p.sizes.len()];
        let mut frame = frame_of(c, &p, size);
        frame.src = flow_source(p.src_ip, (i % c.flows as usize) as u32);
        frame.bytes()
    }

    #[test]
    fn flows_and_sizes_take_turns_across_bursts() {
        // 3 flows × a 2-size list: a cycle of 6 frames, cut by bursts of 256 that do not divide
        // it; then the same with templates of headers only (65 536 flows of 1500 bytes would
        // take 100 MB of whole frames).
        for (flows, sizes, count) in [(3, vec![64, 128], 1000), (65_536, vec![1500, 64], 600)] {
            let c = GeneratorConfig {
                flows,
                size: SizeSpec::Mix(sizes),
                count: Some(count),
                ..Default::default()
            };
            let frames = run(c.clone(), 5);
            assert_eq!(frames.len(), count as usize);
            for (i, f) in frames.iter().enumerate() {
                assert_eq!(f, &expected(&c, i), "frame {i} of {flows} flows");
                verify_l4(f);
            }
        }
    }

    #[test]
    fn rate_limit_holds_back() {
        let c = GeneratorConfig {
            rate: Some(RateSpec::PacketsPerSecond(1000.0)),
            ..Default::default()
        };
        // Immediately after creation hardly any time passed: only a few packets may leave.
        let frames = run(c, 3);
        assert!(frames.len() < 64, "rate limit ignored: {}", frames.len());
    }

    #[test]
    fn a_long_breath_keeps_the_rate() {
        // 100 000 packets per second and one pull 30 ms after the first: about 3000 packets,
        // not the 100 of a 1 ms burst cap (thousands of apps make breaths that long).
        let c = GeneratorConfig {
            rate: Some(RateSpec::PacketsPerSecond(100_000.0)),
            ..Default::default()
        };
        let mut ctx = AppContext::new("g", std::path::Path::new("."), Default::default());
        let mut g = Generator::new(c, &mut ctx).unwrap();
        let (tx, mut rx) = link(8192);
        let mut io = Io::new(vec![], vec![("output".into(), tx)]);
        g.pull(&mut io);
        let first = rx.drain().count();
        std::thread::sleep(std::time::Duration::from_millis(30));
        g.pull(&mut io);
        let sent = rx.drain().count();
        assert!(first < 200, "{first} packets right after creation");
        assert!(sent >= 2900, "{sent} packets for 30 ms at 100 kpps");
    }

    #[test]
    fn rates_parse_and_bad_config_is_refused() {
        assert_eq!(parse_rate("2.5 Mpps"), Ok(Rate::Pps(2.5e6)));
        assert_eq!(parse_rate("10Gbit/s"), Ok(Rate::Bps(1e10)));
        assert!(parse_rate("10 furlongs").is_err());
        let bad = GeneratorConfig {
            size: SizeSpec::Fixed(20),
            ..Default::default()
        };
        assert!(Generator::declare(&bad)
            .unwrap_err()
            .to_string()
            .contains("size 20"));
        let bad = GeneratorConfig {
            src_mac: "xx".into(),
            ..Default::default()
        };
        assert!(Generator::declare(&bad).is_err());
    }
}
