//! `moelink bench --plot FILE.png`: what a run measured, as a picture.
//!
//! A header says what ran: the backend and device (on the host backend, that the times are CPU threads and
//! not GPU figures), the commit, the date and what the y axis measures. Below it, one panel per regime (HT,
//! LL) and swept quantity — tokens per rank, SMs, or ranks (across `--plot-with` runs) — with time (µs, or ms
//! from 10 ms up; the median of the slowest rank) or logical GB/s on the y axis. A measurement belongs to a
//! sweep when its line (system, operation, payload type, routing) was measured at other values of that
//! quantity with the other two held, so `--suite` draws an HT token sweep, an HT SM sweep and an LL token
//! sweep; one that is part of no sweep (e.g. skewed routing at one size) is drawn as its own marker in the
//! first panel of its regime whose held values it shares. A panel's subtitle says what it holds fixed;
//! what differs between its lines is in their labels, each variant with its own marker shape. Each (operation,
//! payload type) has one colour in every panel; moelink's lines are solid, a baseline's (records of another
//! `system`, e.g. NCCL from `python -m moelink.bench --json`, added with `--plot-with`) dashed in the same
//! colour. The legend sits in room kept free above the data.
//!
//! Drawn with plotters' bitmap backend (lines, grid, markers). The text is rasterised here with `ab_glyph`
//! from DejaVu Sans compiled into the binary (the `dejavu` crate), so a machine without fontconfig or any
//! installed font draws the same picture; plotters 0.3.7's own `ab_glyph` text drops each glyph's left side
//! bearing, which spaces letters unevenly ("combin e b f1 6").

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use ab_glyph::{Font as _, FontRef, PxScale, ScaleFont as _};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::record::{Record, Status};

/// Width and height of the picture in pixels with one row of panels (up to two regimes or sweeps); with more
/// rows of two panels it is the header's 64 pixels and 560 per row high.
pub const SIZE: (u32, u32) = (1280, 720);
/// The header's height: two lines saying what ran.
const HEADER: u32 = 64;
/// The height of a row of panels in a picture of several rows.
const ROW_HEIGHT: u32 = 560;
/// Panels side by side.
const COLUMNS: usize = 2;

fn picture_size(panels: usize) -> (u32, u32) {
    match panels.div_ceil(COLUMNS) as u32 {
        0 | 1 => SIZE,
        rows => (SIZE.0, HEADER + rows * ROW_HEIGHT),
    }
}

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
    /// The y axis' label; `ms`: the values are shown in milliseconds.
    fn label(self, ms: bool) -> &'static str {
        match (self, ms) {
            (Metric::Time, false) => "time per call (µs)",
            (Metric::Time, true) => "time per call (ms)",
            (Metric::Gbps, _) => "logical GB/s per rank",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Metric::Time => "time",
            Metric::Gbps => "GB/s",
        }
    }
    fn explain(self) -> &'static str {
        match self {
            Metric::Time => "time per call: the slowest rank per repetition, median over repetitions",
            Metric::Gbps => "logical GB/s per rank (DeepEP's accounting) over the time of the slowest rank",
        }
    }
}

/// A swept quantity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Axis {
    Tokens = 0,
    Sms = 1,
    Ranks = 2,
}

const AXES: [Axis; 3] = [Axis::Tokens, Axis::Sms, Axis::Ranks];

impl Axis {
    fn of(self, r: &Record) -> Option<usize> {
        match self {
            Axis::Tokens => r.tokens,
            Axis::Sms => r.num_sms,
            Axis::Ranks => Some(r.ranks),
        }
    }
    fn label(self) -> &'static str {
        match self {
            Axis::Tokens => "tokens per rank",
            Axis::Sms => "SMs (config.num_sms)",
            Axis::Ranks => "ranks",
        }
    }
    /// One held value, as a panel's subtitle or a line's label says it.
    fn held(self, v: usize) -> String {
        match self {
            Axis::Tokens => format!("{v} tokens per rank"),
            Axis::Sms => format!("{v} SMs"),
            Axis::Ranks => format!("{v} ranks"),
        }
    }
    /// The two other quantities, in [`AXES`] order.
    fn others(self) -> [Axis; 2] {
        match self {
            Axis::Tokens => [Axis::Sms, Axis::Ranks],
            Axis::Sms => [Axis::Tokens, Axis::Ranks],
            Axis::Ranks => [Axis::Tokens, Axis::Sms],
        }
    }
}

/// What makes a line, apart from the quantities: a baseline's lines are dashed; `source` is the
/// `--plot-with` file of a line drawn apart ("" for this run's).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Line {
    baseline: bool,
    source: String,
    system: String,
    op: String,
    dtype: String,
    routing: String,
    backend: String,
}

/// The two quantities a sweep holds, in [`Axis::others`] order (`None`: not recorded, e.g. a baseline's SMs).
type Held = [Option<usize>; 2];

/// One measurement: its line, tokens / SMs / ranks ([`Axis`] order) and y value.
struct Point<'a> {
    line: Line,
    at: [Option<usize>; 3],
    y: f64,
    record: &'a Record,
}

impl Point<'_> {
    fn held(&self, axis: Axis) -> Held {
        axis.others().map(|a| self.at[a as usize])
    }
}

/// Held values that can be the same measurement setting: equal where both are known (a baseline has no SMs).
fn compatible(a: Held, b: Held) -> bool {
    a.iter().zip(&b).all(|(x, y)| x.is_none() || y.is_none() || x == y)
}

/// One line of a panel: its label, whether it is a baseline, its colour and marker indices and its points
/// sorted by x (the median where several measurements share an x).
struct Series {
    label: String,
    baseline: bool,
    colour: usize,
    marker: usize,
    points: Vec<(f64, f64)>,
}

/// One panel: a regime and a swept quantity.
struct Panel {
    title: String,
    subtitle: String,
    axis: Axis,
    series: Vec<Series>,
}

/// The colour of each (operation, payload type) in every panel: dispatch bf16, dispatch fp8, combine bf16
/// first, then any other in sorted order.
fn colours(records: &[&Record]) -> BTreeMap<(String, String), usize> {
    let known = [("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16")];
    let mut out: BTreeMap<(String, String), usize> =
        known.iter().enumerate().map(|(i, (op, dtype))| ((op.to_string(), dtype.to_string()), i)).collect();
    let others: BTreeSet<(String, String)> =
        records.iter().map(|r| (r.op.clone(), r.dtype.clone().unwrap_or_default())).filter(|k| !out.contains_key(k)).collect();
    for k in others {
        let n = out.len();
        out.insert(k, n);
    }
    out
}

/// The panels of `records`: measured ones (`ok`), by regime, then by swept quantity (module docs).
fn panels(records: &[Record], metric: Metric) -> Vec<Panel> {
    let ok: Vec<&Record> = records.iter().filter(|r| r.status == Status::Ok && metric.value(r).is_some()).collect();
    let colour = colours(&ok);
    // This run's backend: the most frequent among its own records (else among all).
    let mine: Vec<&Record> = ok.iter().copied().filter(|r| r.system == "moelink" && source(r).is_empty()).collect();
    let mut backends: BTreeMap<&str, usize> = BTreeMap::new();
    for r in if mine.is_empty() { &ok } else { &mine } {
        *backends.entry(r.backend.as_str()).or_default() += 1;
    }
    let main_backend = backends.iter().max_by_key(|(_, n)| **n).map(|(b, _)| b.to_string()).unwrap_or_default();
    let mut out = Vec::new();
    for mode in ["ht", "ll"] {
        let points: Vec<Point<'_>> = ok
            .iter()
            .filter(|r| r.mode == mode)
            .map(|r| {
                let src = source(r);
                let line = Line {
                    baseline: r.system != "moelink" || !src.is_empty(),
                    source: src,
                    system: r.system.clone(),
                    op: r.op.clone(),
                    dtype: r.dtype.clone().unwrap_or_default(),
                    routing: r.routing.clone().unwrap_or_default(),
                    backend: r.backend.clone(),
                };
                Point { line, at: AXES.map(|a| a.of(r)), y: metric.value(r).unwrap_or_default(), record: r }
            })
            .collect();
        if points.is_empty() {
            continue;
        }
        // Per quantity, the measurements of lines measured at more than one of its values, the others held.
        let mut members: Vec<(Axis, Vec<usize>)> = Vec::new();
        let mut swept = vec![false; points.len()];
        for axis in AXES {
            // (line, held values) -> (the values of `axis` it was measured at, its measurements)
            let mut groups: BTreeMap<(Line, Held), (BTreeSet<usize>, Vec<usize>)> = BTreeMap::new();
            for (i, p) in points.iter().enumerate() {
                if let Some(x) = p.at[axis as usize] {
                    let g = groups.entry((p.line.clone(), p.held(axis))).or_default();
                    g.0.insert(x);
                    g.1.push(i);
                }
            }
            let idx: Vec<usize> = groups.into_values().filter(|(xs, _)| xs.len() > 1).flat_map(|(_, idx)| idx).collect();
            if !idx.is_empty() {
                idx.iter().for_each(|&i| swept[i] = true);
                members.push((axis, idx));
            }
        }
        let has = |i: usize, axis: Axis| points[i].at[axis as usize].is_some();
        if members.is_empty() {
            // Nothing swept: every measurement as a marker against the first quantity they all have.
            let axis = AXES.into_iter().find(|&a| (0..points.len()).all(|i| has(i, a))).unwrap_or(Axis::Ranks);
            members.push((axis, (0..points.len()).filter(|&i| has(i, axis)).collect()));
        } else {
            // A measurement of no sweep joins the first panel whose held values it shares, else the first
            // panel it has an x for.
            for i in (0..points.len()).filter(|&i| !swept[i]) {
                let fits = |(axis, idx): &(Axis, Vec<usize>)| {
                    has(i, *axis) && idx.iter().any(|&j| compatible(points[i].held(*axis), points[j].held(*axis)))
                };
                let home = members.iter().position(fits).or_else(|| members.iter().position(|(a, _)| has(i, *a)));
                if let Some(k) = home {
                    members[k].1.push(i);
                }
            }
        }
        for (axis, idx) in members {
            out.push(panel((mode, axis, metric), &idx.iter().map(|&i| &points[i]).collect::<Vec<_>>(), &colour, &main_backend));
        }
    }
    out
}

/// The values `f` takes over `points` (`None`s left out).
fn distinct<T: Ord>(points: &[&Point<'_>], f: impl Fn(&Point<'_>) -> Option<T>) -> BTreeSet<T> {
    points.iter().filter_map(|p| f(p)).collect()
}

/// What tells lines apart within a panel: (which: 0 and 1 the held quantities, 2 the routing; the value;
/// how a label says it).
type Variant = Vec<(usize, usize, String)>;

/// One panel of `points`; `main_backend`: this run's (lines of another are labelled with theirs).
fn panel(
    (mode, axis, metric): (&str, Axis, Metric),
    points: &[&Point<'_>],
    colour: &BTreeMap<(String, String), usize>,
    main_backend: &str,
) -> Panel {
    let held = axis.others();
    let held_values = held.map(|a| distinct(points, |p| p.at[a as usize]));
    let routings = distinct(points, |p| Some(p.line.routing.clone()).filter(|r| !r.is_empty()));
    // What tells a panel's lines of one (system, operation, type) apart: the held values or the routing where
    // they differ within the panel (numbers in numeric order); each variant gets a marker shape.
    let variant = |p: &Point<'_>| -> Variant {
        let mut v = Vec::new();
        for (k, a) in held.iter().enumerate() {
            if let (true, Some(x)) = (held_values[k].len() > 1, p.at[*a as usize]) {
                v.push((k, x, a.held(x)));
            }
        }
        if routings.len() > 1 && !p.line.routing.is_empty() {
            v.push((2, 0, format!("{} routing", p.line.routing)));
        }
        v
    };
    // Markers: a circle for the variant with the most measurements (the sweep), then the others.
    let mut counts: BTreeMap<Variant, usize> = BTreeMap::new();
    for p in points {
        *counts.entry(variant(p)).or_default() += 1;
    }
    let mut variants: Vec<(usize, Variant)> = counts.into_iter().map(|(v, n)| (n, v)).collect();
    variants.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let mut lines: BTreeMap<(Line, Variant), BTreeMap<usize, Vec<f64>>> = BTreeMap::new();
    for p in points {
        if let Some(x) = p.at[axis as usize] {
            lines.entry((p.line.clone(), variant(p))).or_default().entry(x).or_default().push(p.y);
        }
    }
    let mut series: Vec<(usize, Series)> = lines
        .into_iter()
        .map(|((line, var), by_x)| {
            let points = by_x
                .into_iter()
                .map(|(x, mut ys)| {
                    ys.sort_by(f64::total_cmp);
                    let n = ys.len();
                    (x as f64, if n % 2 == 1 { ys[n / 2] } else { (ys[n / 2 - 1] + ys[n / 2]) / 2.0 })
                })
                .collect();
            let c = colour.get(&(line.op.clone(), line.dtype.clone())).copied().unwrap_or(0);
            let mut notes: Vec<String> = Vec::new();
            if !line.source.is_empty() && line.source != line.system {
                notes.push(line.source.clone());
            }
            notes.extend(var.iter().map(|(_, _, text)| text.clone()));
            if line.backend != main_backend {
                notes.push(format!("{} backend", line.backend));
            }
            if line.baseline {
                notes.push("dashed".into());
            }
            let name =
                if line.baseline { format!("{} {} {}", line.system, line.op, line.dtype) } else { format!("{} {}", line.op, line.dtype) };
            let label = if notes.is_empty() { name } else { format!("{name} ({})", notes.join(", ")) };
            let marker = variants.iter().position(|(_, v)| *v == var).unwrap_or(0);
            let order = usize::from(line.baseline);
            (order, Series { label, baseline: line.baseline, colour: c, marker, points })
        })
        .collect();
    // This run's lines first, then by colour (dispatch bf16, dispatch fp8, combine bf16) and variant.
    series.sort_by_key(|(order, s)| (*order, s.colour, s.marker));
    // The subtitle: what every measurement of the panel shares.
    let mut fixed: Vec<String> = Vec::new();
    for (k, a) in held.iter().enumerate() {
        if held_values[k].len() == 1 {
            fixed.extend(held_values[k].iter().map(|&v| a.held(v)));
        }
    }
    if routings.len() == 1 {
        fixed.extend(routings.iter().map(|r| format!("{r} routing")));
    }
    let hidden = distinct(points, |p| p.record.hidden);
    if hidden.len() == 1 {
        fixed.extend(hidden.iter().map(|h| format!("hidden {h}")));
    }
    let selection = distinct(points, |p| Some((p.record.topk?, p.record.experts?)));
    if selection.len() == 1 {
        fixed.extend(selection.iter().map(|(k, e)| format!("top-{k} of {e} experts")));
    }
    let regime = if mode == "ht" { "high-throughput" } else { "low-latency" };
    Panel {
        title: format!("{regime}: {} vs {}", metric.name(), axis.label()),
        subtitle: fixed.join(", "),
        axis,
        series: series.into_iter().map(|(_, s)| s).collect(),
    }
}

/// The two header lines: what ran (backend, device; on the host backend that these are CPU threads, not GPU
/// figures), then commit, date and what the y axis measures.
fn header(records: &[Record], metric: Metric) -> (String, String) {
    let ok: Vec<&Record> = records.iter().filter(|r| r.status == Status::Ok).collect();
    let mine: Vec<&Record> = ok.iter().copied().filter(|r| r.system == "moelink" && source(r).is_empty()).collect();
    let mine = if mine.is_empty() { ok } else { mine };
    let join = |v: BTreeSet<String>| v.into_iter().collect::<Vec<_>>().join(", ");
    let backends: BTreeSet<&str> = mine.iter().map(|r| r.backend.as_str()).collect();
    let devices = join(mine.iter().map(|r| r.device.clone()).collect());
    let what = match backends.iter().copied().collect::<Vec<_>>().as_slice() {
        ["host"] => format!(
            "moelink bench, host backend (ranks are CPU threads on {devices}): times of the CPU reference \
             implementation, not GPU performance"
        ),
        ["cuda"] => {
            let gpus = mine.iter().map(|r| r.gpus).max().unwrap_or(0);
            format!("moelink bench, CUDA backend: {gpus} x {devices}")
        }
        all => format!("moelink bench, backends {} on {devices} (host: CPU threads, not GPU performance)", all.join(", ")),
    };
    let commits = join(mine.iter().map(|r| r.commit.clone()).collect());
    let dates = join(mine.iter().map(|r| r.date.chars().take(10).collect::<String>()).collect());
    let mut about = format!("commit {commits}, {dates}; {}", metric.explain());
    if records.iter().any(|r| r.status == Status::Ok && (r.system != "moelink" || !source(r).is_empty())) {
        about.push_str("; dashed: records from --plot-with");
    }
    (what, about)
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
const GREY: RGBColor = RGBColor(90, 90, 90);
const GRID: RGBColor = RGBColor(222, 222, 222);

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;
type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// The plotting backend's errors print as Rust debug text (`ImageError(Unsupported(...))`,
/// `IOError(Os { .., message: "..." })`): the operating system's message when there is one, else the text
/// without its type names.
fn readable(text: &str) -> String {
    if let Some(at) = text.find("message: \"") {
        let rest = &text[at + 10..];
        return rest.split('"').next().unwrap_or(rest).to_string();
    }
    text.replace(['(', ')', '{', '}'], " ").split_whitespace().collect::<Vec<_>>().join(" ")
}

fn plot_err(e: impl std::fmt::Display) -> String {
    format!("plot: {e}")
}

/// Draws `records` into the PNG file `path` ([`SIZE`] pixels for up to two panels). `Err` when nothing was
/// measured or the file cannot be written.
pub fn draw(path: &Path, records: &[Record], metric: Metric) -> Result<(), String> {
    let panels = panels(records, metric);
    if panels.is_empty() {
        return Err("plot: no measurement to draw (every case failed or was unavailable)".into());
    }
    let pen = Pen::new()?;
    // plotters measures its (empty) tick labels with a registered font: the same one, from the binary.
    register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "plot: the embedded font does not load".to_string())?;
    let root = BitMapBackend::new(path, picture_size(panels.len())).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (what, about) = header(records, metric);
    let width = root.dim_in_pixel().0 as f32 - 32.0;
    pen.text(&root, &what, pen.fit(&what, 20.0, width), (16, 10), (Align::Start, Align::Start), BLACK, false)?;
    pen.text(&root, &about, pen.fit(&about, 15.0, width), (16, 38), (Align::Start, Align::Start), GREY, false)?;
    let (_, body) = root.split_vertically(HEADER);
    let columns = panels.len().min(COLUMNS);
    let areas = body.split_evenly((panels.len().div_ceil(columns), columns));
    for (panel, area) in panels.iter().zip(&areas) {
        draw_panel(&root, area, &pen, panel, metric).map_err(plot_err)?;
    }
    root.present().map_err(|e| format!("--plot {}: cannot write it: {}", path.display(), readable(&e.to_string())))
}

/// Axis ticks from 0: a step of 1, 2, 2.5 or 5 times a power of ten giving the number of intervals nearest
/// five up to at least `top`; returns the ticks (the last one at or above `top`).
fn ticks(top: f64) -> Vec<f64> {
    let top = if top > 0.0 && top.is_finite() { top } else { 1.0 };
    let magnitude = 10f64.powf((top / 5.0).log10().floor());
    let intervals = |step: f64| (top / step - 1e-9).ceil().max(1.0);
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .min_by(|a, b| (intervals(*a) - 5.0).abs().total_cmp(&(intervals(*b) - 5.0).abs()))
        .unwrap_or(magnitude);
    let n = intervals(step) as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

/// A tick value with as many decimals as the step needs.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = (0..4).find(|&d| ((step * 10f64.powi(d)).round() - step * 10f64.powi(d)).abs() < 1e-6).unwrap_or(4) as usize;
    format!("{v:.decimals$}")
}

const TITLE_HEIGHT: u32 = 52;
const X_LABEL_AREA: u32 = 50;
const CHART_MARGIN: u32 = 10;
const LEGEND_ROW: i32 = 20;
const TICK_FONT: f32 = 14.0;

fn draw_panel(root: &Area<'_>, area: &Area<'_>, pen: &Pen, p: &Panel, metric: Metric) -> DrawResult {
    let (base_x, base_y) = area.get_base_pixel();
    let (width, height) = area.dim_in_pixel();
    let text_width = width as f32 - 32.0;
    pen.text(root, &p.title, pen.fit(&p.title, 19.0, text_width), (base_x + 16, base_y + 6), (Align::Start, Align::Start), BLACK, false)?;
    pen.text(
        root,
        &p.subtitle,
        pen.fit(&p.subtitle, 14.0, text_width),
        (base_x + 16, base_y + 30),
        (Align::Start, Align::Start),
        GREY,
        false,
    )?;

    let mut xs: Vec<f64> = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0)).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let (x_lo, x_hi) = (xs[0], xs[xs.len() - 1]);
    // Sweeps over powers of two read best on a log axis; a single value gets room either side.
    let (x_lo, x_hi) = if x_hi > x_lo { (x_lo / 1.12, x_hi * 1.12) } else { (x_lo * 0.5, x_hi * 1.5) };
    let y_max = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1)).fold(0.0, f64::max);
    let ms = metric == Metric::Time && y_max >= 10_000.0;
    let scale = if ms { 1e-3 } else { 1.0 };
    // The legend takes the top of the plot: the y range leaves it that much room above the data.
    let plot_height = height.saturating_sub(TITLE_HEIGHT + 2 * CHART_MARGIN + X_LABEL_AREA).max(100) as f64;
    let legend_height = (LEGEND_ROW * p.series.len() as i32 + 16) as f64;
    let free = (1.0 - legend_height / plot_height).max(0.35);
    let y_ticks = ticks(y_max * scale / free);
    let y_step = y_ticks[1] - y_ticks[0];
    let y_top = y_ticks[y_ticks.len() - 1];
    let y_labels: Vec<String> = y_ticks.iter().map(|&v| tick_label(v, y_step)).collect();
    let y_label_width = y_labels.iter().map(|l| pen.width(l, TICK_FONT)).fold(0.0, f32::max) as u32 + 40;

    let (_, chart_area) = area.split_vertically(TITLE_HEIGHT);
    let mut chart = ChartBuilder::on(&chart_area)
        .margin(CHART_MARGIN)
        .margin_right(24)
        .x_label_area_size(X_LABEL_AREA)
        .y_label_area_size(y_label_width)
        // Grid lines at the swept values themselves (64, 128, 256 rather than a log axis's 100, 200).
        .build_cartesian_2d((x_lo..x_hi).log_scale().with_key_points(xs.clone()), 0.0..y_top)?;
    // The y grid at the ticks chosen here (the labels, both axes', are drawn below with the pen).
    for &v in &y_ticks[1..] {
        chart.draw_series(LineSeries::new([(x_lo, v), (x_hi, v)], GRID.stroke_width(1)))?;
    }
    chart
        .configure_mesh()
        .disable_y_mesh()
        .set_tick_mark_size(LabelAreaPosition::Left, 0)
        .x_label_formatter(&|_| String::new())
        .y_label_formatter(&|_| String::new())
        .bold_line_style(GRID)
        .axis_style(BLACK)
        .draw()?;
    let (plot_x, plot_y) = chart.plotting_area().get_pixel_range();

    // Tick labels and axis names.
    let mut last_right = i32::MIN;
    for &x in &xs {
        let (px, py) = chart.backend_coord(&(x, 0.0));
        let label = format!("{x:.0}");
        let half = (pen.width(&label, TICK_FONT) / 2.0) as i32;
        if px - half > last_right + 4 {
            pen.text(root, &label, TICK_FONT, (px, py + 8), (Align::Middle, Align::Start), BLACK, false)?;
            last_right = px + half;
        }
    }
    for (v, label) in y_ticks.iter().zip(&y_labels) {
        let (_, py) = chart.backend_coord(&(x_lo, *v));
        root.draw(&PathElement::new(vec![(plot_x.start - 5, py), (plot_x.start, py)], BLACK.stroke_width(1)))?;
        pen.text(root, label, TICK_FONT, (plot_x.start - 8, py), (Align::End, Align::Middle), BLACK, false)?;
    }
    let x_name = p.axis.label();
    pen.text(root, x_name, 16.0, ((plot_x.start + plot_x.end) / 2, plot_y.end + 28), (Align::Middle, Align::Start), BLACK, false)?;
    let y_name = metric.label(ms);
    let y_size = pen.fit(y_name, 16.0, (plot_y.end - plot_y.start) as f32);
    pen.text(root, y_name, y_size, (base_x + 12, (plot_y.start + plot_y.end) / 2), (Align::Middle, Align::Start), BLACK, true)?;

    // The lines, then their markers.
    for s in &p.series {
        let colour = PALETTE[s.colour % PALETTE.len()];
        let pts = s.points.iter().map(|&(x, y)| (x, y * scale));
        if s.baseline {
            chart.draw_series(DashedLineSeries::new(pts, 8, 6, colour.stroke_width(2)))?;
        } else {
            chart.draw_series(LineSeries::new(pts, colour.stroke_width(3)))?;
        }
        for &(x, y) in &s.points {
            marker(root, chart.backend_coord(&(x, y * scale)), s.marker, colour)?;
        }
    }

    // The legend, top left, in the room kept above the data.
    let label_width = p.series.iter().map(|s| pen.width(&s.label, 14.0)).fold(0.0, f32::max) as i32;
    let (lx, ly) = (plot_x.start + 10, plot_y.start + 6);
    let box_bottom = ly + LEGEND_ROW * p.series.len() as i32 + 8;
    root.draw(&Rectangle::new([(lx, ly), (lx + 62 + label_width, box_bottom)], WHITE.mix(0.9).filled()))?;
    root.draw(&Rectangle::new([(lx, ly), (lx + 62 + label_width, box_bottom)], GREY.stroke_width(1)))?;
    for (i, s) in p.series.iter().enumerate() {
        let colour = PALETTE[s.colour % PALETTE.len()];
        let y = ly + 14 + LEGEND_ROW * i as i32;
        if s.baseline {
            for x in [lx + 8, lx + 24, lx + 40] {
                root.draw(&PathElement::new(vec![(x, y), (x + 9, y)], colour.stroke_width(2)))?;
            }
        } else {
            root.draw(&PathElement::new(vec![(lx + 8, y), (lx + 50, y)], colour.stroke_width(3)))?;
        }
        marker(root, (lx + 29, y), s.marker, colour)?;
        pen.text(root, &s.label, 14.0, (lx + 58, y), (Align::Start, Align::Middle), BLACK, false)?;
    }
    Ok(())
}

/// A point's marker: a filled circle, triangle, square or a cross (one per variant of a panel's lines).
fn marker(root: &Area<'_>, at: (i32, i32), kind: usize, colour: RGBColor) -> DrawResult {
    let (x, y) = at;
    match kind % 4 {
        0 => root.draw(&Circle::new(at, 4, colour.filled()))?,
        1 => root.draw(&TriangleMarker::new(at, 6, colour.filled()))?,
        2 => root.draw(&Rectangle::new([(x - 4, y - 4), (x + 4, y + 4)], colour.filled()))?,
        _ => root.draw(&Cross::new(at, 5, colour.stroke_width(2)))?,
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Align {
    Start,
    Middle,
    End,
}

/// Text from the embedded DejaVu Sans, each glyph where its outline says (side bearings and kerning
/// included).
struct Pen {
    font: FontRef<'static>,
}

impl Pen {
    fn new() -> Result<Pen, String> {
        FontRef::try_from_slice(dejavu::sans::regular())
            .map(|font| Pen { font })
            .map_err(|_| "plot: the embedded font does not load".into())
    }

    /// The advance width of `text` at `size` pixels.
    fn width(&self, text: &str, size: f32) -> f32 {
        let f = self.font.as_scaled(PxScale::from(size));
        let mut prev = None;
        let mut w = 0.0;
        for c in text.chars() {
            let id = f.glyph_id(c);
            if let Some(p) = prev {
                w += f.kern(p, id);
            }
            w += f.h_advance(id);
            prev = Some(id);
        }
        w
    }

    /// `size`, or the smaller size at which `text` fits in `max_width` pixels (not below 9).
    fn fit(&self, text: &str, size: f32, max_width: f32) -> f32 {
        let w = self.width(text, size);
        if w <= max_width {
            size
        } else {
            (size * max_width / w).max(9.0)
        }
    }

    /// Draws `text` at `size` pixels anchored at `at` by `align` (along the text, then across it);
    /// `vertical`: turned a quarter anticlockwise, reading upwards (a y axis' name).
    #[allow(clippy::too_many_arguments)]
    fn text(
        &self,
        root: &Area<'_>,
        text: &str,
        size: f32,
        at: (i32, i32),
        align: (Align, Align),
        colour: RGBColor,
        vertical: bool,
    ) -> Result<(), String> {
        let scale = PxScale::from(size);
        let f = self.font.as_scaled(scale);
        let (w, h) = (self.width(text, size), f.ascent() - f.descent());
        let shift = |a: Align, len: f32| match a {
            Align::Start => 0.0,
            Align::Middle => -len / 2.0,
            Align::End => -len,
        };
        // Laid out along a local x axis, the line's top at local y 0.
        let (mut x, top) = (shift(align.0, w), shift(align.1, h));
        let mut prev = None;
        let mut result = Ok(());
        for c in text.chars() {
            let id = f.glyph_id(c);
            if let Some(p) = prev {
                x += f.kern(p, id);
            }
            prev = Some(id);
            let glyph = id.with_scale_and_position(scale, ab_glyph::point(x, top + f.ascent()));
            x += f.h_advance(id);
            let Some(outline) = self.font.outline_glyph(glyph) else { continue };
            let bounds = outline.px_bounds();
            outline.draw(|gx, gy, coverage| {
                if coverage <= 0.0 || result.is_err() {
                    return;
                }
                let (lx, ly) = (bounds.min.x as i32 + gx as i32, bounds.min.y as i32 + gy as i32);
                let pixel = if vertical { (at.0 + ly, at.1 - lx) } else { (at.0 + lx, at.1 + ly) };
                result = root.draw_pixel(pixel, &colour.mix(f64::from(coverage.min(1.0)))).map_err(plot_err);
            });
            result.clone()?;
        }
        result
    }
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

    fn labels(p: &Panel) -> Vec<(&str, bool)> {
        p.series.iter().map(|s| (s.label.as_str(), s.baseline)).collect()
    }

    #[test]
    fn panels_follow_what_was_swept() {
        let records = vec![
            rec("moelink", "ht", "dispatch", "bf16", 128, Some(20), 10.0),
            rec("moelink", "ht", "dispatch", "bf16", 256, Some(20), 20.0),
            rec("moelink", "ht", "combine", "bf16", 128, Some(20), 12.0),
            rec("moelink", "ht", "combine", "bf16", 256, Some(20), 22.0),
            rec("nccl", "ht", "dispatch", "bf16", 128, None, 30.0),
            rec("moelink", "ll", "combine", "bf16", 32, None, 6.0),
            rec("moelink", "ll", "dispatch", "fp8", 32, None, 5.0),
        ];
        let p = panels(&records, Metric::Time);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].axis, Axis::Tokens);
        assert_eq!(labels(&p[0]), [("dispatch bf16", false), ("combine bf16", false), ("nccl dispatch bf16 (dashed)", true)]);
        assert_eq!(p[0].series[0].points, [(128.0, 10.0), (256.0, 20.0)]);
        assert_eq!(p[0].subtitle, "20 SMs, 4 ranks, uniform routing, hidden 1024, top-8 of 64 experts");
        // The baseline shares the colour of moelink's line of the same operation and type.
        assert_eq!(p[0].series[2].colour, p[0].series[0].colour);
        // An operation and type has one colour in every panel.
        assert_eq!(labels(&p[1]), [("dispatch fp8", false), ("combine bf16", false)]);
        assert_eq!(p[1].series[1].colour, p[0].series[1].colour);
        assert_ne!(p[1].series[0].colour, p[0].series[0].colour);
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
        assert_eq!(labels(&p[0]), [("dispatch bf16 (20 SMs)", false), ("moelink dispatch bf16 (py, 24 SMs, dashed)", true)]);
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

    /// `--suite`: a token sweep at 24 SMs, an SM sweep at 256 tokens and skewed routing at (256, 24) are three
    /// things; none is folded into another's point at 256 tokens.
    #[test]
    fn a_suite_draws_each_sweep_and_keeps_routings_apart() {
        let mut records = Vec::new();
        for (tokens, us) in [(64, 1.0), (128, 2.0), (256, 4.0), (512, 8.0)] {
            records.push(rec("moelink", "ht", "dispatch", "bf16", tokens, Some(24), us));
        }
        for (sms, us) in [(8, 40.0), (16, 30.0), (32, 20.0)] {
            records.push(rec("moelink", "ht", "dispatch", "bf16", 256, Some(sms), us));
        }
        let mut skewed = rec("moelink", "ht", "dispatch", "bf16", 256, Some(24), 99.0);
        skewed.routing = Some("skewed".into());
        records.push(skewed);
        let p = panels(&records, Metric::Time);
        assert_eq!(p.iter().map(|p| p.axis).collect::<Vec<_>>(), [Axis::Tokens, Axis::Sms]);
        assert_eq!(labels(&p[0]), [("dispatch bf16 (uniform routing)", false), ("dispatch bf16 (skewed routing)", false)]);
        assert_eq!(p[0].series[0].points, [(64.0, 1.0), (128.0, 2.0), (256.0, 4.0), (512.0, 8.0)]);
        assert_eq!(p[0].series[1].points, [(256.0, 99.0)]);
        assert_ne!(p[0].series[0].marker, p[0].series[1].marker);
        assert_eq!(p[0].subtitle, "24 SMs, 4 ranks, hidden 1024, top-8 of 64 experts");
        assert_eq!(p[1].series[0].points, [(8.0, 40.0), (16.0, 30.0), (24.0, 4.0), (32.0, 20.0)]);
        assert_eq!(p[1].subtitle, "256 tokens per rank, 4 ranks, uniform routing, hidden 1024, top-8 of 64 experts");
        assert_eq!(picture_size(p.len()), SIZE);
        // A grid of tokens x SMs: lines per held value, in numeric order; a baseline from another backend says so.
        let mut grid = Vec::new();
        for sms in [16, 8] {
            for tokens in [64, 128] {
                grid.push(rec("moelink", "ht", "combine", "bf16", tokens, Some(sms), 1.0));
            }
        }
        let mut nccl = rec("nccl", "ht", "combine", "bf16", 64, None, 2.0);
        nccl.backend = "cuda".into();
        grid.push(nccl);
        let p = panels(&grid, Metric::Time);
        assert_eq!(
            labels(&p[0]),
            [("combine bf16 (8 SMs)", false), ("combine bf16 (16 SMs)", false), ("nccl combine bf16 (cuda backend, dashed)", true)]
        );
        assert_eq!(labels(&p[1]), [("combine bf16 (64 tokens per rank)", false), ("combine bf16 (128 tokens per rank)", false)]);
        assert_eq!(picture_size(3), (1280, HEADER + 2 * ROW_HEIGHT));
    }

    #[test]
    fn the_header_says_what_ran() {
        let (what, about) = header(&[rec("moelink", "ht", "dispatch", "bf16", 128, Some(20), 10.0)], Metric::Time);
        assert!(what.contains("host backend") && what.contains("CPU threads") && what.contains("not GPU performance"), "{what}");
        assert!(about.contains("slowest rank"), "{about}");
        let mut gpu = rec("moelink", "ht", "dispatch", "bf16", 128, Some(20), 10.0);
        (gpu.backend, gpu.device, gpu.gpus) = ("cuda".into(), "NVIDIA H200".into(), 4);
        assert_eq!(header(&[gpu], Metric::Gbps).0, "moelink bench, CUDA backend: 4 x NVIDIA H200");
    }

    #[test]
    fn ticks_are_round_and_cover_the_top() {
        assert_eq!(ticks(9.0), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(1200.0), [0.0, 250.0, 500.0, 750.0, 1000.0, 1250.0]);
        assert_eq!(ticks(0.3).len(), 7);
        assert_eq!(tick_label(0.25, 0.25), "0.25");
        assert_eq!(tick_label(500.0, 250.0), "500");
    }
}
