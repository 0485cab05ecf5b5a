//! `/metrics`: the counters of one snapshot in the OpenMetrics text format Prometheus scrapes.
//!
//! Metric names are stable (documented in `docs/api.md`); labels name the link, app, worker or
//! buffer class. Apps' own counters share one family, `stitch_app_counter_total{app,counter}`,
//! so that a new counter in an app never needs a new metric name.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use stitch_core::engine::{AppStats, LinkInfo, WorkerStats};
use stitch_core::latency::LatencyReport;
use stitch_core::Stats;

/// A function process or VM as `/metrics` shows it.
#[derive(Debug, Clone)]
pub struct ProcessGauge {
    pub app: String,
    pub running: bool,
    pub restarts: u64,
}

/// What one scrape shows: the engine's snapshot (kernel apps among its apps, on worker
/// `kernel`), the supervised processes, and the gauges of what feeds the instance
/// (`(name, help, value)`).
#[derive(Debug)]
pub struct Snapshot {
    pub stats: Stats,
    pub processes: Vec<ProcessGauge>,
    pub extra: Vec<(&'static str, &'static str, i64)>,
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

fn counters<'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl Iterator<Item = (Labels<'a>, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
    for (labels, v) in samples {
        ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

fn gauges<'a>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl Iterator<Item = (Labels<'a>, i64)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, ConstGauge::new(0i64).metric_type())?;
    for (labels, v) in samples {
        ConstGauge::new(v).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A histogram read from elsewhere: `(upper bound, count)` of each bucket, not cumulative
/// (the encoder adds them up), the last one `+Inf`.
struct ConstHistogram {
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl EncodeMetric for ConstHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The bounds of the latency histograms' buckets: every power of two of nanoseconds from
/// 1.024 µs to 17.2 s. Each is a boundary of the instance's own buckets (16 per power of two),
/// so every count is exact.
const LATENCY_BOUNDS_LOG2_NS: std::ops::RangeInclusive<u32> = 10..=34;

fn latency_histogram(r: &LatencyReport) -> ConstHistogram {
    let mut below_so_far = 0;
    let mut buckets = Vec::new();
    for k in LATENCY_BOUNDS_LOG2_NS {
        let below = r.below(1 << k);
        buckets.push(((1u64 << k) as f64 * 1e-9, below - below_so_far));
        below_so_far = below;
    }
    buckets.push((f64::INFINITY, r.summary.count - below_so_far));
    ConstHistogram {
        sum: r.sum_ns as f64 * 1e-9,
        count: r.summary.count,
        buckets,
    }
}

fn link(l: &LinkInfo) -> Labels<'_> {
    vec![("link", l.link.as_str())]
}

fn app(a: &AppStats) -> Labels<'_> {
    vec![
        ("app", a.name.as_str()),
        ("type", a.kind.as_str()),
        ("worker", a.worker.as_str()),
    ]
}

fn worker(w: &WorkerStats) -> Labels<'_> {
    vec![("worker", w.name.as_str())]
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.stats;
        encode_links(&mut enc, s)?;
        encode_apps(&mut enc, s)?;
        encode_workers(&mut enc, s)?;
        encode_pool(&mut enc, s)?;
        encode_processes(&mut enc, self)
    }
}

/// Each link's counters and fill.
fn encode_links(enc: &mut DescriptorEncoder, s: &Stats) -> Result<(), std::fmt::Error> {
    counters(
        enc,
        "stitch_link_packets",
        "Packets transmitted on the link",
        s.links.iter().map(|l| (link(l), l.stats.tx_packets)),
    )?;
    counters(
        enc,
        "stitch_link_bytes",
        "Bytes transmitted on the link",
        s.links.iter().map(|l| (link(l), l.stats.tx_bytes)),
    )?;
    counters(
        enc,
        "stitch_link_drops",
        "Packets dropped because the link was full",
        s.links.iter().map(|l| (link(l), l.stats.tx_drops)),
    )?;
    gauges(
        enc,
        "stitch_link_queued_packets",
        "Packets queued on the link now",
        s.links.iter().map(|l| (link(l), l.stats.queued as i64)),
    )?;
    gauges(
        enc,
        "stitch_link_capacity_packets",
        "Size of the link in packets",
        s.links.iter().map(|l| (link(l), l.size as i64)),
    )?;
    let mut m = enc.encode_descriptor(
        "stitch_link_latency_seconds",
        "Time from a packet's receive timestamp to its link's consumer taking it (links with latency: true)",
        None,
        MetricType::Histogram,
    )?;
    for l in &s.links {
        if let Some(r) = &l.latency {
            latency_histogram(r).encode(m.encode_family(&link(l))?)?;
        }
    }
    counters(
        enc,
        "stitch_removed_link_drops",
        "Packets freed unsent in links a live change removed with both their apps",
        std::iter::once((Vec::new(), s.removed_link_drops)),
    )?;
    Ok(())
}

/// Each app's link totals, failure and own counters.
fn encode_apps(enc: &mut DescriptorEncoder, s: &Stats) -> Result<(), std::fmt::Error> {
    for (name, help, f) in [
        (
            "stitch_app_rx_packets",
            "Packets the app received from its input links",
            (|a: &AppStats| a.rx_packets) as fn(&_) -> u64,
        ),
        (
            "stitch_app_rx_bytes",
            "Bytes the app received from its input links",
            |a| a.rx_bytes,
        ),
        (
            "stitch_app_tx_packets",
            "Packets the app sent on its output links",
            |a| a.tx_packets,
        ),
        (
            "stitch_app_tx_bytes",
            "Bytes the app sent on its output links",
            |a| a.tx_bytes,
        ),
        (
            "stitch_app_drops",
            "Packets the app dropped, plus drops of its full output links",
            |a| a.drops,
        ),
    ] {
        counters(enc, name, help, s.apps.iter().map(|a| (app(a), f(a))))?;
    }
    gauges(
        enc,
        "stitch_app_failed",
        "1 when the app panicked and was stopped",
        s.apps.iter().map(|a| (app(a), a.failed as i64)),
    )?;
    counters(
        enc,
        "stitch_app_counter",
        "An app's own counters, by name",
        s.apps.iter().flat_map(|a| {
            a.counters
                .iter()
                .map(move |(c, v)| (vec![("app", a.name.as_str()), ("counter", c.as_str())], *v))
        }),
    )?;
    Ok(())
}

/// Each worker's breaths and sleeps.
fn encode_workers(enc: &mut DescriptorEncoder, s: &Stats) -> Result<(), std::fmt::Error> {
    counters(
        enc,
        "stitch_worker_breaths",
        "Breaths (pull, push, tick rounds) of the worker",
        s.workers.iter().map(|w| (worker(w), w.breaths)),
    )?;
    counters(
        enc,
        "stitch_worker_idle_sleeps",
        "Times the worker slept because nothing moved",
        s.workers.iter().map(|w| (worker(w), w.idle_sleeps)),
    )?;
    Ok(())
}

/// The packet pool's size, use and refusals, and the uptime.
fn encode_pool(enc: &mut DescriptorEncoder, s: &Stats) -> Result<(), std::fmt::Error> {
    let p = &s.pool;
    gauges(
        enc,
        "stitch_pool_buffers",
        "Packet buffers in the pool",
        [
            (vec![("class", "ordinary")], p.packets as i64),
            (vec![("class", "large")], p.large_packets as i64),
        ]
        .into_iter(),
    )?;
    gauges(
        enc,
        "stitch_pool_buffers_in_use",
        "Packet buffers taken from the pool now",
        [
            (vec![("class", "ordinary")], p.in_use as i64),
            (vec![("class", "large")], p.large_in_use as i64),
        ]
        .into_iter(),
    )?;
    counters(
        enc,
        "stitch_pool_exhausted",
        "Allocations refused because the pool was empty",
        [
            (vec![("class", "ordinary")], p.exhausted),
            (vec![("class", "large")], p.large_exhausted),
        ]
        .into_iter(),
    )?;
    let mut m = enc.encode_descriptor(
        "stitch_uptime_seconds",
        "Seconds since the instance started",
        None,
        ConstGauge::new(0f64).metric_type(),
    )?;
    ConstGauge::new(s.uptime_s).encode(m.encode_family(&Vec::<(&str, &str)>::new())?)?;
    Ok(())
}

/// Function processes and VMs, and the placements' own gauges.
fn encode_processes(enc: &mut DescriptorEncoder, snap: &Snapshot) -> Result<(), std::fmt::Error> {
    gauges(
        enc,
        "stitch_process_up",
        "1 while the app's function process or VM runs, 0 while it waits to restart",
        snap.processes
            .iter()
            .map(|p| (vec![("app", p.app.as_str())], p.running as i64)),
    )?;
    counters(
        enc,
        "stitch_process_restarts",
        "Times the app's function process or VM was restarted after it ended",
        snap.processes
            .iter()
            .map(|p| (vec![("app", p.app.as_str())], p.restarts)),
    )?;
    for (name, help, value) in &snap.extra {
        gauges(enc, name, help, std::iter::once((Vec::new(), *value)))?;
    }
    Ok(())
}

/// The OpenMetrics text of one scrape.
pub fn render(snapshot: Snapshot) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}
