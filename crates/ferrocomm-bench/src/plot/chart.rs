//! Drawing the panels on any plotters backend: per op, latency (top, log-log) and bus
//! bandwidth (bottom, log x) against message size, the size axis in powers of two.

use super::font::FAMILY;
use super::series::{Panel, Point, Series};
use crate::size::human;
use plotters::coord::Shift;
use plotters::prelude::*;

/// Pixels of one panel; the image is a column of two per op.
const PANEL: (u32, u32) = (520, 400);

/// matplotlib's default cycle (tab10): distinct, and readable on white.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The image size for `panels`.
pub fn size(panels: &[Panel]) -> (u32, u32) {
    (PANEL.0 * panels.len().max(1) as u32, PANEL.1 * 2)
}

/// What one panel plots against size.
#[derive(Clone, Copy)]
enum Metric {
    Latency,
    BusBandwidth,
}

impl Metric {
    fn value(self, p: &Point) -> f64 {
        match self {
            Metric::Latency => p.time_us,
            Metric::BusBandwidth => p.busbw,
        }
    }

    fn caption(self, op: &str) -> String {
        match self {
            Metric::Latency => format!("{op}: latency"),
            Metric::BusBandwidth => format!("{op}: bus bandwidth"),
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Metric::Latency => "time (us)",
            Metric::BusBandwidth => "busbw (GB/s)",
        }
    }
}

/// Draws every panel onto `root`, which must be `size(panels)` large.
pub fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, panels: &[Panel]) -> Result<(), String> {
    let failed = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {e}");
    root.fill(&WHITE).map_err(failed)?;
    let cells = root.split_evenly((2, panels.len().max(1)));
    let columns = panels.len();
    for (col, panel) in panels.iter().enumerate() {
        // The legend goes on the first column's bandwidth panel, where the lines rise to the
        // right and leave the upper left free.
        draw_panel(&cells[col], panel, Metric::Latency, false).map_err(failed)?;
        draw_panel(&cells[columns + col], panel, Metric::BusBandwidth, col == 0).map_err(failed)?;
    }
    Ok(())
}

/// The range of `values`, padded by `factor` on a logarithmic axis; never empty.
fn log_range(values: impl Iterator<Item = f64>, factor: f64) -> std::ops::Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo.is_finite() && lo > 0.0 {
        lo / factor..hi * factor
    } else {
        1.0..2.0
    }
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    metric: Metric,
    legend: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let all = || panel.series.iter().flat_map(|s| s.points.iter());
    let x = log_range(all().map(|p| p.bytes), 1.4);
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(metric.caption(&panel.op), (FAMILY, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64);
    let x_fmt = |v: &f64| human(*v);
    match metric {
        Metric::Latency => {
            let y = log_range(all().map(|p| p.time_us), 1.5);
            let mut chart = builder.build_cartesian_2d(x.log_scale().base(2.0), y.log_scale())?;
            chart
                .configure_mesh()
                .x_desc("message size (bytes)")
                .y_desc(metric.unit())
                .x_label_formatter(&x_fmt)
                .y_label_formatter(&|v| format!("{v}"))
                .label_style((FAMILY, 12))
                .axis_desc_style((FAMILY, 14))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            for (i, s) in panel.series.iter().enumerate() {
                draw_series(&mut chart, s, i, metric)?;
            }
            finish(&mut chart, legend)
        }
        Metric::BusBandwidth => {
            let top = all().map(|p| p.busbw).fold(0f64, f64::max);
            let y = 0.0..if top > 0.0 { top * 1.1 } else { 1.0 };
            let mut chart = builder.build_cartesian_2d(x.log_scale().base(2.0), y)?;
            chart
                .configure_mesh()
                .x_desc("message size (bytes)")
                .y_desc(metric.unit())
                .x_label_formatter(&x_fmt)
                .label_style((FAMILY, 12))
                .axis_desc_style((FAMILY, 14))
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            for (i, s) in panel.series.iter().enumerate() {
                draw_series(&mut chart, s, i, metric)?;
            }
            finish(&mut chart, legend)
        }
    }
}

/// One line with a marker per size: a circle for ferrocomm, a triangle for the peers, so the
/// tools stay apart where colours do not.
fn draw_series<'a, DB, X, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    s: &Series,
    index: usize,
    metric: Metric,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let color = COLORS[index % COLORS.len()];
    let points: Vec<(f64, f64)> = s.points.iter().map(|p| (p.bytes, metric.value(p))).collect();
    chart
        .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
        .label(s.label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    if s.tool == "ferrocomm" {
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    } else {
        chart.draw_series(points.iter().map(|&p| TriangleMarker::new(p, 4, color.filled())))?;
    }
    Ok(())
}

fn finish<'a, DB, X, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    legend: bool,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FAMILY, 12))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .draw()?;
    }
    Ok(())
}
