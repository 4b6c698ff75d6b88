//! SVG plots shared by the simulator and end-to-end runs: grouped bars, lines, a Gantt
//! timeline and empirical CDFs.
//!
//! Each function takes plain data (no simulator types) and writes one SVG file, so any part of
//! the harness can reuse them. Errors name the file and what was wrong with the data.
use std::path::Path;

use anyhow::{Context, ensure};
use plotters::coord::Shift;
use plotters::prelude::*;

/// A categorical palette (Tableau 10): distinguishable and readable in print.
pub const PALETTE: [RGBColor; 10] = [
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

/// The palette's `i`-th color (wrapping).
pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// One named series of values.
#[derive(Debug, Clone, PartialEq)]
pub struct Series<T> {
    /// Legend label.
    pub name: String,
    /// The data.
    pub values: Vec<T>,
}

impl<T> Series<T> {
    /// A series from a name and values.
    pub fn new(name: impl Into<String>, values: Vec<T>) -> Self {
        Self {
            name: name.into(),
            values,
        }
    }
}

fn err<E: std::fmt::Debug>(path: &Path) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("drawing {}: {e:?}", path.display())
}

fn finite_max(values: impl Iterator<Item = f64>) -> f64 {
    values.filter(|v| v.is_finite()).fold(0.0_f64, f64::max)
}

fn finite_min(values: impl Iterator<Item = f64>) -> f64 {
    values.filter(|v| v.is_finite()).fold(0.0_f64, f64::min)
}

fn root(path: &Path, size: (u32, u32)) -> anyhow::Result<DrawingArea<SVGBackend<'_>, Shift>> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(err(path))?;
    Ok(root)
}

/// Grouped bar chart: one group of bars per category, one bar per series.
/// `series[j].values[i]` is series j at category i; non-finite values are skipped.
pub fn bars(
    path: &Path,
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[Series<f64>],
) -> anyhow::Result<()> {
    check_bars(path, categories, series)?;
    let all = || series.iter().flat_map(|s| s.values.iter().copied());
    let (lo, hi) = (finite_min(all()), finite_max(all()));
    let pad = (hi - lo).max(1e-9) * 0.08;
    let y_range = (if lo < 0.0 { lo - pad } else { 0.0 })..(hi + pad);
    let width = (160 + 90 * categories.len() as u32).max(640);
    let root = root(path, (width, 480))?;
    let (plot_area, label_area) = root.split_vertically(440);
    let n = categories.len() as f64;
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(8)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..n, y_range)
        .map_err(err(path))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(y_label)
        .draw()
        .map_err(err(path))?;
    let slot = 0.8 / series.len().max(1) as f64;
    for (j, s) in series.iter().enumerate() {
        let c = color(j);
        chart
            .draw_series(
                s.values
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.is_finite())
                    .map(|(i, &v)| {
                        let x0 = i as f64 + 0.1 + slot * j as f64;
                        Rectangle::new([(x0, 0.0), (x0 + slot * 0.92, v)], c.filled())
                    }),
            )
            .map_err(err(path))?
            .label(s.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err(path))?;
    // Category names under each group, placed in pixel space (plotters' numeric axis cannot put
    // text labels at group centres).
    for (i, name) in categories.iter().enumerate() {
        let (px, _) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        label_area
            .draw(&Text::new(
                name.clone(),
                // About 7 px per character at 13 px: centre the name under its group.
                (px - name.len() as i32 * 7 / 2, 4),
                ("sans-serif", 13).into_font(),
            ))
            .map_err(err(path))?;
    }
    root.present().map_err(err(path))?;
    Ok(())
}

/// Every series of a bar chart has one value per category.
fn check_bars(path: &Path, categories: &[String], series: &[Series<f64>]) -> anyhow::Result<()> {
    ensure!(
        !categories.is_empty(),
        "bars {}: no categories",
        path.display()
    );
    for s in series {
        ensure!(
            s.values.len() == categories.len(),
            "bars {}: series `{}` has {} values for {} categories",
            path.display(),
            s.name,
            s.values.len(),
            categories.len()
        );
    }
    Ok(())
}

/// Line chart of (x, y) series; each series is drawn with markers at its points.
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series<(f64, f64)>],
) -> anyhow::Result<()> {
    let xs = || series.iter().flat_map(|s| s.values.iter().map(|p| p.0));
    let ys = || series.iter().flat_map(|s| s.values.iter().map(|p| p.1));
    ensure!(
        xs().any(f64::is_finite),
        "lines {}: no finite points",
        path.display()
    );
    let (x_lo, x_hi) = (
        xs().filter(|x| x.is_finite()).fold(f64::INFINITY, f64::min),
        finite_max(xs()),
    );
    let (y_lo, y_hi) = (finite_min(ys()), finite_max(ys()));
    let x_pad = (x_hi - x_lo).max(1e-9) * 0.04;
    let y_pad = (y_hi - y_lo).max(1e-9) * 0.08;
    let root = root(path, (800, 480))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x_lo - x_pad)..(x_hi + x_pad),
            (y_lo - y_pad)..(y_hi + y_pad),
        )
        .map_err(err(path))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(err(path))?;
    for (j, s) in series.iter().enumerate() {
        let c = color(j);
        let pts: Vec<(f64, f64)> = s
            .values
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err(path))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))
            .map_err(err(path))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err(path))?;
    root.present().map_err(err(path))?;
    Ok(())
}

/// One span of a Gantt row.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Start (x units, e.g. seconds).
    pub start: f64,
    /// End.
    pub end: f64,
    /// Palette index.
    pub color: usize,
}

/// One row of a Gantt chart.
#[derive(Debug, Clone, PartialEq)]
pub struct GanttRow {
    /// Row label (left axis).
    pub label: String,
    /// Spans; they may overlap (drawn in order, translucent).
    pub spans: Vec<Span>,
}

/// Gantt timeline: one row per resource, spans colored by palette index; `legend` names the
/// palette indices used.
pub fn gantt(
    path: &Path,
    title: &str,
    x_label: &str,
    rows: &[GanttRow],
    legend: &[(usize, String)],
) -> anyhow::Result<()> {
    ensure!(!rows.is_empty(), "gantt {}: no rows", path.display());
    let (x_lo, x_hi) = gantt_range(rows, !legend.is_empty());
    let n = rows.len();
    let height = (120 + 28 * n as u32).max(300);
    let root = root(path, (1000, height))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(110)
        .build_cartesian_2d(x_lo..x_hi, 0.0..n as f64)
        .map_err(err(path))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc(x_label)
        .draw()
        .map_err(err(path))?;
    // Row labels in pixel space, right-aligned against the plot (plotters' numeric axis cannot
    // put text at row centres).
    for (i, row) in rows.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(x_lo, (n - 1 - i) as f64 + 0.5));
        let x = px - 8 - row.label.len() as i32 * 7;
        root.draw(&Text::new(
            row.label.clone(),
            (x, py - 7),
            ("sans-serif", 13).into_font(),
        ))
        .map_err(err(path))?;
    }
    for (i, row) in rows.iter().enumerate() {
        let y0 = (n - 1 - i) as f64 + 0.12;
        let y1 = y0 + 0.76;
        chart
            .draw_series(
                row.spans
                    .iter()
                    .filter(|s| s.start.is_finite() && s.end.is_finite())
                    .map(|s| {
                        Rectangle::new(
                            [(s.start, y0), (s.end.max(s.start), y1)],
                            color(s.color).mix(0.8).filled(),
                        )
                    }),
            )
            .map_err(err(path))?;
    }
    for (idx, name) in legend {
        let c = color(*idx);
        chart
            .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
            .map_err(err(path))?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
    }
    if !legend.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err(path))?;
    }
    root.present().map_err(err(path))?;
    Ok(())
}

/// The x range of a Gantt chart's spans, with empty room on the right for a legend (it keeps
/// the legend off the spans).
fn gantt_range(rows: &[GanttRow], legend: bool) -> (f64, f64) {
    let x_hi = finite_max(rows.iter().flat_map(|r| r.spans.iter().map(|s| s.end))).max(1e-9);
    let x_lo = rows
        .iter()
        .flat_map(|r| r.spans.iter().map(|s| s.start))
        .filter(|v| v.is_finite())
        .fold(f64::INFINITY, f64::min)
        .min(x_hi);
    let x_lo = if x_lo.is_finite() { x_lo } else { 0.0 };
    let x_hi = if legend {
        x_hi + (x_hi - x_lo) * 0.3
    } else {
        x_hi
    };
    (x_lo, x_hi)
}

/// Empirical CDFs of each series' values (a step line from 0 to 1).
pub fn cdf(path: &Path, title: &str, x_label: &str, series: &[Series<f64>]) -> anyhow::Result<()> {
    let curves: Vec<Series<(f64, f64)>> = series
        .iter()
        .map(|s| {
            let mut v: Vec<f64> = s.values.iter().copied().filter(|x| x.is_finite()).collect();
            v.sort_by(f64::total_cmp);
            let n = v.len() as f64;
            let mut pts = Vec::with_capacity(2 * v.len());
            for (i, &x) in v.iter().enumerate() {
                pts.push((x, i as f64 / n));
                pts.push((x, (i + 1) as f64 / n));
            }
            Series::new(s.name.clone(), pts)
        })
        .collect();
    ensure!(
        curves.iter().any(|c| !c.values.is_empty()),
        "cdf {}: no finite values",
        path.display()
    );
    let x_hi = finite_max(curves.iter().flat_map(|c| c.values.iter().map(|p| p.0))).max(1e-9);
    let root = root(path, (800, 480))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_hi * 1.02, 0.0..1.0)
        .map_err(err(path))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("fraction")
        .draw()
        .map_err(err(path))?;
    for (j, s) in curves.iter().enumerate() {
        let c = color(j);
        chart
            .draw_series(LineSeries::new(s.values.clone(), c.stroke_width(2)))
            .map_err(err(path))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err(path))?;
    root.present().map_err(err(path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("rolloutpipe-plot-{}", std::process::id()));
        dir.join(name)
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn bars_writes_an_svg_with_labels() {
        let p = tmp("bars.svg");
        let cats = vec!["a/R1".to_string(), "b/R2".to_string()];
        bars(
            &p,
            "t",
            "s",
            &cats,
            &[
                Series::new("sync", vec![3.0, 4.0]),
                Series::new("cgp", vec![2.0, f64::NAN]),
            ],
        )
        .unwrap();
        let svg = read(&p);
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("a/R1") && svg.contains("cgp"));
        // Three finite bars plus two legend swatches, each a <rect>; plus the background.
        assert!(svg.matches("<rect").count() >= 5);
    }

    #[test]
    fn bars_rejects_ragged_series() {
        let err = bars(
            &tmp("bad.svg"),
            "t",
            "s",
            &["x".into()],
            &[Series::new("s", vec![1.0, 2.0])],
        )
        .unwrap_err();
        assert!(err.to_string().contains("2 values for 1 categories"));
    }

    #[test]
    fn lines_gantt_and_cdf_write_svgs() {
        let p = tmp("lines.svg");
        lines(
            &p,
            "t",
            "x",
            "y",
            &[Series::new("s", vec![(0.0, 1.0), (1.0, 2.0)])],
        )
        .unwrap();
        assert!(read(&p).contains("<polyline") || read(&p).contains("<path"));
        let p = tmp("gantt.svg");
        let rows = vec![GanttRow {
            label: "engine 0".into(),
            spans: vec![Span {
                start: 0.0,
                end: 2.0,
                color: 1,
            }],
        }];
        gantt(&p, "t", "s", &rows, &[(1, "decode".into())]).unwrap();
        assert!(read(&p).contains("engine 0"));
        let p = tmp("cdf.svg");
        cdf(&p, "t", "s", &[Series::new("sync", vec![3.0, 1.0, 2.0])]).unwrap();
        assert!(read(&p).contains("sync"));
        assert!(cdf(&tmp("empty.svg"), "t", "s", &[Series::new("x", vec![])]).is_err());
    }
}
