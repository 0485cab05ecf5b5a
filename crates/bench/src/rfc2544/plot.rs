//! The picture of a run: each device's no-drop rate by frame size (bars), and the latency of
//! each device and size at half its no-drop rate as a distribution (the share of frames at or
//! under a latency, on a log scale). Drawn with plotters into a PNG; text in DejaVu Sans,
//! read at run time (Debian's `fonts-dejavu-core`).

use super::SizeResult;
use anyhow::{Context, Result};
use plotters::prelude::*;
use std::path::Path;

const FONT_FILE: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const FONT: &str = "sans-serif";

/// Registers the font plotters draws text with (once per process).
fn register_font() -> Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = std::fs::read(FONT_FILE)
            .map_err(|e| format!("{FONT_FILE}: {e} (apt install fonts-dejavu-core)"))?;
        plotters::style::register_font(FONT, FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| format!("{FONT_FILE} is not a TrueType font"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// Draws `results` into `file` (PNG).
pub fn draw(results: &[SizeResult], file: &Path) -> Result<()> {
    register_font()?;
    let root = BitMapBackend::new(file, (1500, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(700);
    ndr_bars(results, &left)?;
    latency_distributions(results, &right)?;
    root.present()
        .with_context(|| format!("writing {}", file.display()))?;
    Ok(())
}

fn names<'a>(results: &'a [SizeResult], of: impl Fn(&'a SizeResult) -> &'a str) -> Vec<&'a str> {
    let mut v: Vec<&str> = Vec::new();
    for r in results {
        if !v.contains(&of(r)) {
            v.push(of(r));
        }
    }
    v
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn ndr_bars(results: &[SizeResult], area: &Area) -> Result<()> {
    let duts = names(results, |r| &r.dut);
    let sizes = names(results, |r| &r.size);
    let top = (results.iter().map(|r| r.ndr.rate_pps / 1e6)).fold(0.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption("No-drop rate (loss ≤ 0.001 %)", (FONT, 22))
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..sizes.len() as f64, 0.0..top.max(1e-3))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("Mpps")
        .label_style((FONT, 15))
        .draw()?;
    let width = 0.8 / duts.len() as f64;
    for (d, dut) in duts.iter().enumerate() {
        let color = Palette99::pick(d).to_rgba();
        let bars = (results.iter().filter(|r| r.dut == *dut)).filter_map(|r| {
            let g = sizes.iter().position(|s| *s == r.size)? as f64;
            let x = g + 0.1 + d as f64 * width;
            Some(Rectangle::new(
                [(x, 0.0), (x + width * 0.92, r.ndr.rate_pps / 1e6)],
                color.filled(),
            ))
        });
        chart
            .draw_series(bars)?
            .label(*dut)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 16))
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    for (g, size) in sizes.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let label = match size.parse::<u32>() {
            Ok(_) => format!("{size} B"),
            Err(_) => size.to_string(),
        };
        area.draw(&Text::new(label, (x - 20, y + 10), (FONT, 16)))?;
    }
    Ok(())
}

fn latency_distributions(results: &[SizeResult], area: &Area) -> Result<()> {
    // (label, [(µs, share at or under)]) of each device and size at half its no-drop rate.
    let lines: Vec<(String, Vec<(f64, f64)>)> = (results.iter())
        .filter_map(|r| {
            let l = r.latency.iter().find(|l| l.fraction_of_ndr == 0.5)?;
            let total = l.latency.summary.count.max(1) as f64;
            let mut seen = 0;
            let points = (l.latency.buckets.iter())
                .map(|b| {
                    seen += b.packets;
                    (
                        b.to_ns.min(l.latency.summary.max_ns.max(1)) as f64 / 1e3,
                        seen as f64 / total,
                    )
                })
                .collect();
            Some((format!("{} {}", r.dut, r.size), points))
        })
        .collect();
    let all = lines.iter().flat_map(|(_, p)| p.iter().map(|(us, _)| *us));
    let (low, high) = all.fold((f64::MAX, 0.0f64), |(lo, hi), us| (lo.min(us), hi.max(us)));
    let (low, high) = if low < high {
        (low * 0.8, high * 1.25)
    } else {
        (1.0, 1000.0)
    };
    let mut chart = ChartBuilder::on(area)
        .caption("Latency at 50 % of the no-drop rate", (FONT, 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((low..high).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("µs (log scale)")
        .y_desc("share of frames at or under")
        .label_style((FONT, 15))
        .draw()?;
    for (i, (label, points)) in lines.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 15))
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}
