//! `vgpu-smi plot`: memory used and SM utilisation over time, one row of two charts per device of
//! every region in a `--watch --record` file, drawn with `plotters` into a PNG or an SVG. The
//! utilisation chart also shows the share of time the compute limiter held the container's
//! launches, between samples, where the region has the limiter's counters.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::Report;

const ROW_HEIGHT: u32 = 340;
const WIDTH: u32 = 1280;
const MIB: f64 = (1u64 << 20) as f64;
const GIB: f64 = (1u64 << 30) as f64;
const FONT: &str = "sans-serif";
const USED_COLOUR: RGBColor = RGBColor(31, 90, 200);
const MEASURED_COLOUR: RGBColor = RGBColor(20, 140, 60);
const LIMIT_COLOUR: RGBColor = RGBColor(210, 40, 40);
const HELD_COLOUR: RGBColor = RGBColor(230, 150, 20);

/// One sample of a device.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Sample {
    /// Seconds since the first sample.
    seconds: f64,
    used_bytes: u64,
    /// Of the used bytes, those in host memory (`CUDA_OVERSUBSCRIBE`).
    host_backed_bytes: u64,
    sm_util_percent: u64,
    /// The limiter's held time so far (`limiter.held_ns`); `None` for a HAMi-core region.
    held_ns: Option<u64>,
}

/// One device of one region over time.
#[derive(Debug, Default)]
struct DeviceSeries {
    title: String,
    samples: Vec<Sample>,
    memory_limit: Option<u64>,
    sm_limit: Option<u64>,
}

/// What was drawn.
#[derive(Debug, PartialEq, Eq)]
pub struct PlotSummary {
    pub samples: usize,
    pub devices: usize,
    pub skipped_lines: usize,
}

/// Reads a record file: one JSON report per line; lines that are not reports (a line cut short
/// by an interrupted recorder) are counted and skipped.
pub fn read_record(text: &str) -> (Vec<Report>, usize) {
    let mut reports = Vec::new();
    let mut skipped = 0;
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        match serde_json::from_str::<Report>(line) {
            Ok(report) => reports.push(report),
            Err(_) => skipped += 1,
        }
    }
    (reports, skipped)
}

fn collect_series(reports: &[Report]) -> Vec<DeviceSeries> {
    let Some(start) = reports.iter().map(|report| report.time_unix_ms).min() else {
        return Vec::new();
    };
    let several_regions = reports
        .iter()
        .flat_map(|report| report.regions.iter().map(|region| region.path.as_str()))
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        > 1;
    let mut series: BTreeMap<(String, usize, String), DeviceSeries> = BTreeMap::new();
    for report in reports {
        let seconds = report.time_unix_ms.saturating_sub(start) as f64 / 1000.0;
        for region in report.regions.iter().filter(|region| region.error.is_none()) {
            for device in &region.devices {
                let key = (region.path.clone(), device.index, device.uuid.clone());
                let entry = series.entry(key).or_default();
                if entry.title.is_empty() {
                    let region_name = Path::new(&region.path)
                        .file_name()
                        .map_or_else(|| region.path.clone(), |name| name.to_string_lossy().into_owned());
                    entry.title = if several_regions {
                        format!("{region_name}: GPU {} ({})", device.index, device.uuid)
                    } else {
                        format!("GPU {} ({})", device.index, device.uuid)
                    };
                }
                entry.samples.push(Sample {
                    seconds,
                    used_bytes: device.memory_used_bytes,
                    host_backed_bytes: device.memory_host_backed_bytes,
                    sm_util_percent: device.sm_util_percent,
                    held_ns: device.limiter.map(|limiter| limiter.held_ns),
                });
                entry.memory_limit = device.memory_limit_bytes;
                entry.sm_limit = device.sm_limit_percent;
            }
        }
    }
    series.into_values().collect()
}

/// Draws a record file's text into `output` (`.png` or `.svg`).
pub fn plot_record(text: &str, output: &Path) -> Result<PlotSummary, String> {
    let (reports, skipped_lines) = read_record(text);
    let summary = plot(&reports, output)?;
    Ok(PlotSummary {
        skipped_lines,
        ..summary
    })
}

/// Draws the reports into `output` (`.png` or `.svg`).
pub fn plot(reports: &[Report], output: &Path) -> Result<PlotSummary, String> {
    let series = collect_series(reports);
    if series.is_empty() {
        return Err("the record holds no device samples (was the region readable while recording?)".into());
    }
    let size = (WIDTH, ROW_HEIGHT * series.len() as u32);
    let extension = output
        .extension()
        .map(|extension| extension.to_string_lossy().to_ascii_lowercase());
    // Both backends lay text out with the font's metrics.
    register_font()?;
    match extension.as_deref() {
        Some("png") => draw(BitMapBackend::new(output, size).into_drawing_area(), &series)?,
        Some("svg") => draw(SVGBackend::new(output, size).into_drawing_area(), &series)?,
        _ => return Err(format!("{}: the output must end in .png or .svg", output.display())),
    }
    Ok(PlotSummary {
        samples: reports.len(),
        devices: series.len(),
        skipped_lines: 0,
    })
}

/// Text needs a font: DejaVu Sans, embedded, so no system font is needed.
fn register_font() -> Result<(), String> {
    static REGISTER: Once = Once::new();
    let mut result = Ok(());
    REGISTER.call_once(|| {
        result = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| "the embedded font could not be loaded".to_string());
    });
    result
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, series: &[DeviceSeries]) -> Result<(), String> {
    let error = |error: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing failed: {error}");
    root.fill(&WHITE).map_err(error)?;
    let cells = root.split_evenly((series.len(), 2));
    for (device, areas) in series.iter().zip(cells.chunks(2)) {
        let [memory_area, utilisation_area] = areas else {
            continue;
        };
        draw_memory(memory_area, device).map_err(error)?;
        draw_utilisation(utilisation_area, device).map_err(error)?;
    }
    root.present().map_err(error)
}

fn time_range(device: &DeviceSeries) -> f64 {
    device
        .samples
        .iter()
        .map(|sample| sample.seconds)
        .fold(0.0, f64::max)
        .max(1.0)
}

/// One panel: a measured series against time, and its limit as a flat line.
struct Panel {
    caption: String,
    y_desc: String,
    y_label_width: u32,
    top: f64,
    series_label: &'static str,
    colour: RGBColor,
    points: Vec<(f64, f64)>,
    /// A second series on the same axes.
    second: Option<Line>,
    limit: Option<f64>,
}

/// A series drawn as a line.
struct Line {
    label: &'static str,
    colour: RGBColor,
    points: Vec<(f64, f64)>,
}

/// The share of time (percent, summed over threads) the limiter held launches between each
/// sample and the one before it, at the later sample's time; empty when the limiter never held
/// any (or the region has no counters). A counter that went back (a region made anew under the
/// same path) starts again from there.
fn held_share_points(samples: &[Sample]) -> Vec<(f64, f64)> {
    let points: Vec<(f64, f64)> = samples
        .windows(2)
        .filter_map(|pair| {
            let (before, after) = (pair[0].held_ns?, pair[1].held_ns?);
            let span = pair[1].seconds - pair[0].seconds;
            (span > 0.0).then(|| {
                (
                    pair[1].seconds,
                    after.saturating_sub(before) as f64 / 1e9 / span * 100.0,
                )
            })
        })
        .collect();
    if points.iter().all(|&(_, share)| share == 0.0) {
        return Vec::new();
    }
    points
}

fn draw_memory<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    device: &DeviceSeries,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let highest = device
        .samples
        .iter()
        .map(|sample| sample.used_bytes)
        .chain(device.memory_limit)
        .max()
        .unwrap_or(0) as f64;
    let (unit, unit_name) = if highest >= 4.0 * GIB {
        (GIB, "GiB")
    } else {
        (MIB, "MiB")
    };
    draw_panel(
        area,
        time_range(device),
        Panel {
            caption: format!("{}: memory", device.title),
            y_desc: format!("used ({unit_name})"),
            y_label_width: 64,
            top: (highest / unit * 1.1).max(1.0),
            series_label: "used",
            colour: USED_COLOUR,
            points: device
                .samples
                .iter()
                .map(|sample| (sample.seconds, sample.used_bytes as f64 / unit))
                .collect(),
            // Drawn only when some memory was in host memory.
            second: device
                .samples
                .iter()
                .any(|sample| sample.host_backed_bytes > 0)
                .then(|| Line {
                    label: "in host memory",
                    colour: HELD_COLOUR,
                    points: device
                        .samples
                        .iter()
                        .map(|sample| (sample.seconds, sample.host_backed_bytes as f64 / unit))
                        .collect(),
                }),
            limit: device.memory_limit.map(|limit| limit as f64 / unit),
        },
    )
}

fn draw_utilisation<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    device: &DeviceSeries,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let held = held_share_points(&device.samples);
    let highest = device
        .samples
        .iter()
        .map(|sample| sample.sm_util_percent as f64)
        .chain(device.sm_limit.map(|limit| limit as f64))
        .chain(held.iter().map(|&(_, share)| share))
        .fold(100.0, f64::max);
    draw_panel(
        area,
        time_range(device),
        Panel {
            caption: format!("{}: SM utilisation", device.title),
            y_desc: "percent".to_string(),
            y_label_width: 48,
            top: highest * 1.05,
            series_label: "measured",
            colour: MEASURED_COLOUR,
            points: device
                .samples
                .iter()
                .map(|sample| (sample.seconds, sample.sm_util_percent as f64))
                .collect(),
            second: (!held.is_empty()).then_some(Line {
                label: "held by the limiter",
                colour: HELD_COLOUR,
                points: held,
            }),
            limit: device.sm_limit.map(|limit| limit as f64),
        },
    )
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    end: f64,
    panel: Panel,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mut chart = ChartBuilder::on(area)
        .caption(panel.caption, (FONT, 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(panel.y_label_width)
        .build_cartesian_2d(0.0..end, 0.0..panel.top)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc(panel.y_desc)
        .label_style((FONT, 12))
        .draw()?;
    let colour = panel.colour;
    chart
        .draw_series(LineSeries::new(panel.points, colour.stroke_width(2)))?
        .label(panel.series_label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
    if let Some(Line { label, colour, points }) = panel.second {
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    if let Some(limit) = panel.limit {
        chart
            .draw_series(LineSeries::new(
                [(0.0, limit), (end, limit)],
                LIMIT_COLOUR.stroke_width(1),
            ))?
            .label("limit")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], LIMIT_COLOUR));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
}

#[cfg(test)]
mod tests {
    use super::{Sample, held_share_points};

    fn sample(seconds: f64, held_ns: Option<u64>) -> Sample {
        Sample {
            seconds,
            used_bytes: 0,
            host_backed_bytes: 0,
            sm_util_percent: 0,
            held_ns,
        }
    }

    #[test]
    fn the_held_share_is_the_counter_gained_over_each_interval() {
        let samples = [
            sample(0.0, Some(0)),
            sample(1.0, Some(500_000_000)),
            sample(1.5, Some(1_000_000_000)),
            sample(2.5, Some(1_000_000_000)),
        ];
        assert_eq!(held_share_points(&samples), [(1.0, 50.0), (1.5, 100.0), (2.5, 0.0)]);
    }

    #[test]
    fn no_held_series_without_counters_or_holds() {
        assert!(held_share_points(&[sample(0.0, None), sample(1.0, None)]).is_empty());
        assert!(held_share_points(&[sample(0.0, Some(7)), sample(1.0, Some(7))]).is_empty());
        // A region made anew under the same path: its counter starts again, never negative.
        assert_eq!(
            held_share_points(&[
                sample(0.0, Some(900)),
                sample(1.0, Some(0)),
                sample(2.0, Some(250_000_000))
            ]),
            [(1.0, 0.0), (2.0, 25.0)]
        );
    }
}
