//! SVG plots: line plots of named series and heatmaps of a labelled matrix.

use plotters::prelude::*;
use std::path::Path;

pub type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    Line,
    /// A marker at each point (single measurements: a policy, a baseline).
    Points,
    LineAndPoints,
}

/// A named series of (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
}

/// An SVG line plot of named (x, y) series.
pub fn line_plot(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> PlotResult {
    let series: Vec<Series> = series
        .iter()
        .map(|(name, points)| Series {
            name: name.clone(),
            points: points.clone(),
            style: Style::Line,
        })
        .collect();
    xy_plot(path, title, x_desc, y_desc, &series)
}

/// An SVG plot of named series, each drawn in its [`Style`], with a legend.
pub fn xy_plot(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> PlotResult {
    let points = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        return Ok(());
    }
    let pad = ((y1 - y0) * 0.05).max(1e-6);
    // Points all at one x span 1, as line plots always have; else 3% of the range each side.
    let (x1, xpad) = if x1 > x0 {
        (x1, (x1 - x0) * 0.03)
    } else {
        (x0 + 1.0, 0.0)
    };
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0 - xpad)..(x1 + xpad), (y0 - pad)..(y1 + pad))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts = s.points.iter().copied();
        let line = s.style != Style::Points;
        let drawn = if line {
            chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
        } else {
            chart.draw_series(pts.clone().map(|p| Circle::new(p, 5, color.filled())))?
        };
        drawn.label(&s.name).legend(move |(x, y)| {
            if line {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)).into_dyn()
            } else {
                Circle::new((x + 9, y), 5, color.filled()).into_dyn()
            }
        });
        if s.style == Style::LineAndPoints {
            chart.draw_series(pts.map(|p| Circle::new(p, 3, color.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// An SVG heatmap of `values` (`[rows.len(), cols]` row-major), white at 0 to dark blue at the
/// largest value, one labelled row per entry of `rows`, columns numbered from 0.
pub fn heatmap(
    path: &Path,
    title: &str,
    x_desc: &str,
    rows: &[String],
    cols: usize,
    values: &[f64],
) -> PlotResult {
    assert_eq!(values.len(), rows.len() * cols, "a value per cell");
    if rows.is_empty() || cols == 0 {
        return Ok(());
    }
    let max = values
        .iter()
        .copied()
        .fold(0f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let width = (160 + 14 * cols).clamp(480, 1600) as u32;
    let height = (110 + 22 * rows.len()).clamp(200, 1200) as u32;
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let label_width = 12 + 7 * rows.iter().map(|r| r.chars().count()).max().unwrap_or(1) as u32;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{title} (darkest = {max:.3})"), ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(label_width.min(260))
        .build_cartesian_2d(0f64..cols as f64, (0..rows.len() as i32).into_segmented())?;
    let n = rows.len();
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(x_desc)
        .x_labels(cols.min(16))
        .x_label_formatter(&|x| format!("{}", x.floor() as i64))
        .y_labels(n)
        .y_label_formatter(&|y| match y {
            // Row 0 at the top.
            SegmentValue::CenterOf(i) if (*i as usize) < n => rows[n - 1 - *i as usize].clone(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(values.iter().enumerate().map(|(i, &v)| {
        let (r, c) = (i / cols, i % cols);
        let t = (v / max).clamp(0.0, 1.0);
        let shade = |full: f64| (255.0 - t * (255.0 - full)) as u8;
        let y = (n - 1 - r) as i32;
        Rectangle::new(
            [
                (c as f64, SegmentValue::Exact(y)),
                (c as f64 + 1.0, SegmentValue::Exact(y + 1)),
            ],
            RGBColor(shade(8.0), shade(48.0), shade(107.0)).filled(),
        )
    }))?;
    root.present()?;
    Ok(())
}
