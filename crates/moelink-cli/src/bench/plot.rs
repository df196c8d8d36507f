//! `moelink bench --plot FILE.png`: what a run measured, as a picture. One panel per regime (HT, LL); in each,
//! time (µs, the median of the slowest rank) or logical GB/s against what was swept — tokens per rank, SMs or
//! ranks, the first of these that takes more than one value — with one line per (system, operation, payload
//! type). moelink's lines are solid; a baseline's (records of another `system`, e.g. NCCL from
//! `python -m moelink.bench --json`, added with `--plot-with`) are dashed in the same colour.
//!
//! Drawn with plotters' bitmap backend; the text uses DejaVu Sans compiled into the binary (the `dejavu`
//! crate through plotters' `ab_glyph` feature), so a machine without fontconfig or any installed font draws
//! the same picture.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::record::{Record, Status};

/// Width and height of the picture in pixels.
pub const SIZE: (u32, u32) = (1280, 720);

/// The record field that names the file a `--plot-with` record came from, when it is drawn apart.
const SOURCE: &str = "plot_source";

/// Records of another run (`--plot-with path`): `moelink bench` records of moelink (they carry
/// `time_us_min`) join this run's lines — other rank counts make a ranks sweep; any other harness's records
/// (a baseline, or the Python package's moelink timings) are drawn as their own dashed lines, labelled with
/// the file's name.
pub fn other_run(path: &Path, mut records: Vec<Record>) -> Vec<Record> {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    for r in &mut records {
        if !(r.system == "moelink" && r.extra.contains_key("time_us_min")) {
            r.extra.insert(SOURCE.into(), serde_json::json!(stem));
        }
    }
    records
}

fn source(r: &Record) -> String {
    r.extra.get(SOURCE).and_then(|v| v.as_str()).unwrap_or_default().to_string()
}

/// What the y axis shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Metric {
    /// Microseconds per call (the median of the slowest rank).
    Time,
    /// Logical GB/s (DeepEP's accounting).
    Gbps,
}

impl Metric {
    fn value(self, r: &Record) -> Option<f64> {
        match self {
            Metric::Time => r.time_us,
            Metric::Gbps => r.logical_gbps,
        }
        .filter(|v| v.is_finite() && *v > 0.0)
    }
    fn label(self) -> &'static str {
        match self {
            Metric::Time => "time (µs, median of the slowest rank)",
            Metric::Gbps => "logical GB/s per rank",
        }
    }
}

/// The swept quantity of one panel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Axis {
    Tokens,
    Sms,
    Ranks,
}

impl Axis {
    fn of(self, r: &Record) -> Option<f64> {
        match self {
            Axis::Tokens => r.tokens,
            Axis::Sms => r.num_sms,
            Axis::Ranks => Some(r.ranks),
        }
        .map(|v| v as f64)
    }
    fn label(self) -> &'static str {
        match self {
            Axis::Tokens => "tokens per rank",
            Axis::Sms => "SMs (config.num_sms)",
            Axis::Ranks => "ranks",
        }
    }
}

/// One line: its label, whether it is a baseline, its colour index and its points sorted by x.
struct Series {
    label: String,
    baseline: bool,
    colour: usize,
    points: Vec<(f64, f64)>,
}

/// A line: (is a baseline, its source file or "" for this run, system, operation, payload type); this
/// run's moelink lines sort first.
type LineKey = (bool, String, String, String, String);

fn line_key(r: &Record) -> LineKey {
    let src = source(r);
    (r.system != "moelink" || !src.is_empty(), src, r.system.clone(), r.op.clone(), r.dtype.clone().unwrap_or_default())
}

/// One panel: a regime and its lines.
struct Panel {
    title: String,
    axis: Axis,
    series: Vec<Series>,
}

/// The first of tokens, SMs and ranks that takes more than one value along some line of `records` (tokens
/// when none does).
fn swept_axis(records: &[&Record]) -> Axis {
    for axis in [Axis::Tokens, Axis::Sms, Axis::Ranks] {
        let mut values: Vec<(LineKey, u64)> = records.iter().filter_map(|r| Some((line_key(r), axis.of(r)?.to_bits()))).collect();
        values.sort();
        values.dedup();
        if values.windows(2).any(|w| w[0].0 == w[1].0) {
            return axis;
        }
    }
    Axis::Tokens
}

/// The panels of `records`: measured ones (`ok`), grouped by regime, then by (operation, payload type,
/// system); points of the same x are the median of their values (e.g. several routings).
fn panels(records: &[Record], metric: Metric) -> Vec<Panel> {
    let ok: Vec<&Record> = records.iter().filter(|r| r.status == Status::Ok && metric.value(r).is_some()).collect();
    let mut out = Vec::new();
    for mode in ["ht", "ll"] {
        let mine: Vec<&Record> = ok.iter().copied().filter(|r| r.mode == mode).collect();
        if mine.is_empty() {
            continue;
        }
        let axis = swept_axis(&mine);
        // Colour by (op, dtype) so that a baseline shares its moelink line's colour.
        let mut colours: BTreeMap<(String, String), usize> = BTreeMap::new();
        let mut lines: BTreeMap<LineKey, Vec<(f64, f64)>> = BTreeMap::new();
        for r in &mine {
            let (Some(x), Some(y)) = (axis.of(r), metric.value(r)) else { continue };
            let dtype = r.dtype.clone().unwrap_or_default();
            let n = colours.len();
            colours.entry((r.op.clone(), dtype.clone())).or_insert(n);
            lines.entry(line_key(r)).or_default().push((x, y));
        }
        let series = lines
            .into_iter()
            .map(|((baseline, src, system, op, dtype), mut pts)| {
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let mut merged: Vec<(f64, f64)> = Vec::new();
                let mut i = 0;
                while i < pts.len() {
                    let mut ys: Vec<f64> = pts[i..].iter().take_while(|p| p.0 == pts[i].0).map(|p| p.1).collect();
                    ys.sort_by(f64::total_cmp);
                    merged.push((pts[i].0, ys[ys.len() / 2]));
                    i += ys.len();
                }
                let colour = colours[&(op.clone(), dtype.clone())];
                let label = match (baseline, src.is_empty()) {
                    (false, _) => format!("{op} {dtype}"),
                    (true, true) => format!("{system} {op} {dtype} (dashed)"),
                    (true, false) => format!("{system} {op} {dtype} ({src}, dashed)"),
                };
                Series { label, baseline, colour, points: merged }
            })
            .collect();
        let r0 = mine[0];
        let shape = match axis {
            Axis::Tokens => format!("{} ranks, hidden {}", r0.ranks, r0.hidden.unwrap_or(0)),
            _ => format!("{} tokens/rank, hidden {}", r0.tokens.unwrap_or(0), r0.hidden.unwrap_or(0)),
        };
        let regime = if mode == "ht" { "high-throughput" } else { "low-latency" };
        out.push(Panel { title: format!("{regime} ({}, {shape})", r0.backend), axis, series });
    }
    out
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn plot_err(e: impl std::fmt::Display) -> String {
    format!("plot: {e}")
}

/// Draws `records` into the PNG file `path` ([`SIZE`] pixels). `Err` when nothing was measured or the file
/// cannot be written.
pub fn draw(path: &Path, records: &[Record], metric: Metric) -> Result<(), String> {
    let panels = panels(records, metric);
    if panels.is_empty() {
        return Err("plot: no measurement to draw (every case failed or was unavailable)".into());
    }
    // The one font, from the binary: no system font lookup.
    register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "plot: the embedded font does not load".to_string())?;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let areas = root.split_evenly((1, panels.len()));
    for (panel, area) in panels.iter().zip(&areas) {
        draw_panel(area, panel, metric).map_err(plot_err)?;
    }
    root.present().map_err(|e| format!("plot: cannot write {}: {e}", path.display()))
}

fn draw_panel(area: &DrawingArea<BitMapBackend<'_>, Shift>, p: &Panel, metric: Metric) -> Result<(), Box<dyn std::error::Error>> {
    let mut xs: Vec<f64> = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0)).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let ys: Vec<f64> = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1)).collect();
    let (x_lo, x_hi) = (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max));
    let y_hi = ys.iter().copied().fold(0.0, f64::max) * 1.15;
    // Sweeps over powers of two read best on a log axis; a single value gets a little room either side.
    let (x_lo, x_hi) = if x_hi > x_lo { (x_lo, x_hi) } else { (x_lo * 0.5, x_hi * 1.5) };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        // Ticks at the swept values themselves (64, 128, 256 rather than a log axis's 100, 200).
        .build_cartesian_2d((x_lo * 0.9..x_hi * 1.1).log_scale().with_key_points(xs), 0.0..y_hi)?;
    chart
        .configure_mesh()
        .x_desc(p.axis.label())
        .y_desc(metric.label())
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| if y_hi >= 20.0 { format!("{v:.0}") } else { format!("{v:.2}") })
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()?;
    for s in &p.series {
        let colour = PALETTE[s.colour % PALETTE.len()];
        let style = ShapeStyle { color: colour.to_rgba(), filled: false, stroke_width: if s.baseline { 2 } else { 3 } };
        let anno = if s.baseline {
            chart.draw_series(DashedLineSeries::new(s.points.iter().copied(), 8, 6, style))?
        } else {
            chart.draw_series(LineSeries::new(s.points.iter().copied(), style))?
        };
        anno.label(&s.label).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        chart.draw_series(s.points.iter().map(|&q| Circle::new(q, 4, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(system: &str, mode: &str, op: &str, dtype: &str, tokens: usize, sms: Option<usize>, us: f64) -> Record {
        let mut r: Record = serde_json::from_value(serde_json::json!({
            "system": system, "backend": "host", "device": "cpu", "gpus": 0, "date": "", "commit": "",
            "mode": mode, "op": op, "dtype": dtype, "ranks": 4, "tokens": tokens, "hidden": 1024, "topk": 8,
            "experts": 64, "routing": "uniform", "num_sms": sms, "time_us": us, "logical_gbps": 1.0,
            "wire_gbps": 1.0, "correct": true, "status": "ok"
        }))
        .expect("a record");
        r.time_us = Some(us);
        r
    }

    #[test]
    fn panels_follow_what_was_swept() {
        let records = vec![
            rec("moelink", "ht", "dispatch", "bf16", 128, Some(20), 10.0),
            rec("moelink", "ht", "dispatch", "bf16", 256, Some(20), 20.0),
            rec("moelink", "ht", "combine", "bf16", 128, Some(20), 12.0),
            rec("moelink", "ht", "combine", "bf16", 256, Some(20), 22.0),
            rec("nccl", "ht", "dispatch", "bf16", 128, None, 30.0),
            rec("moelink", "ll", "dispatch", "fp8", 32, None, 5.0),
        ];
        let p = panels(&records, Metric::Time);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].axis, Axis::Tokens);
        let labels: Vec<(&str, bool)> = p[0].series.iter().map(|s| (s.label.as_str(), s.baseline)).collect();
        assert_eq!(labels, [("combine bf16", false), ("dispatch bf16", false), ("nccl dispatch bf16 (dashed)", true)]);
        assert_eq!(p[0].series[1].points, [(128.0, 10.0), (256.0, 20.0)]);
        // The baseline shares the colour of moelink's line of the same operation and type.
        assert_eq!(p[0].series[2].colour, p[0].series[1].colour);
        // An SM sweep at one token count is plotted against SMs.
        let sms =
            vec![rec("moelink", "ht", "dispatch", "bf16", 128, Some(8), 9.0), rec("moelink", "ht", "dispatch", "bf16", 128, Some(16), 7.0)];
        assert_eq!(panels(&sms, Metric::Time)[0].axis, Axis::Sms);
        // Another harness's moelink records at another SM count do not make an SM sweep of this run's line.
        let mut python = rec("moelink", "ht", "dispatch", "bf16", 128, Some(24), 9.0);
        python.extra.clear();
        let mut mixed = vec![rec("moelink", "ht", "dispatch", "bf16", 128, Some(20), 7.0)];
        mixed[0].extra.insert("time_us_min".into(), serde_json::json!(6.0));
        mixed.extend(other_run(Path::new("/tmp/py.json"), vec![python]));
        let p = panels(&mixed, Metric::Time);
        assert_eq!(p[0].axis, Axis::Tokens);
        assert_eq!(p[0].series[1].label, "moelink dispatch bf16 (py, dashed)");
        // Other rank counts of `moelink bench` join this run's line: a ranks sweep.
        let mut two = rec("moelink", "ht", "dispatch", "bf16", 128, Some(20), 5.0);
        two.ranks = 2;
        two.extra.insert("time_us_min".into(), serde_json::json!(4.0));
        mixed.truncate(1);
        mixed.extend(other_run(Path::new("r2.json"), vec![two]));
        let p = panels(&mixed, Metric::Time);
        assert_eq!((p[0].axis, p[0].series.len()), (Axis::Ranks, 1));
        assert_eq!(p[0].series[0].points, [(2.0, 5.0), (4.0, 7.0)]);
    }
}
