//! `kvbench sweep`: the workload run over a grid of page sizes, concurrencies and prompt lengths,
//! on every backend asked for, written as `sweep.json` and drawn as `sweep.svg` (GB/s and p99
//! request latency against page size, one line per backend, concurrency and prompt length).

use crate::bench::{Report, Workload, run_workload};
use plotters::prelude::*;
use std::path::Path;
use transfer_engine::transport::BackendKind;

/// The grid.
#[derive(Debug, Clone)]
pub struct Grid {
    /// Tokens per page.
    pub page_tokens: Vec<u32>,
    /// Requests in flight at once.
    pub concurrency: Vec<u32>,
    /// Prompt lengths in tokens.
    pub prompt_tokens: Vec<u32>,
    /// Backends, each run on every point.
    pub backends: Vec<BackendKind>,
}

/// One point of the grid on one backend.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Point {
    /// Tokens per page.
    pub page_tokens: u32,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// The run's report (`backend`, `gbps`, `latency_p99_us`, ...).
    #[serde(flatten)]
    pub report: Report,
}

impl Grid {
    /// Points in the grid, backends included.
    pub fn len(&self) -> usize {
        self.page_tokens.len()
            * self.concurrency.len()
            * self.prompt_tokens.len()
            * self.backends.len()
    }

    /// Whether the grid has no point.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Runs `base` at every point of `grid`, calling `each` with every point as it ends.
///
/// # Errors
/// A run that could not be made (an engine that did not start); failed or unverified requests
/// are in the points' reports.
pub async fn run(
    base: &Workload,
    grid: &Grid,
    mut each: impl FnMut(&Point),
) -> Result<Vec<Point>, String> {
    let mut points = Vec::with_capacity(grid.len());
    for &prompt_tokens in &grid.prompt_tokens {
        for &concurrency in &grid.concurrency {
            for &page_tokens in &grid.page_tokens {
                let mut w = base.clone();
                w.prompt_tokens = prompt_tokens;
                w.concurrency = concurrency.max(1);
                w.shape.page_tokens = page_tokens;
                for &backend in &grid.backends {
                    let report = run_workload(&w, backend, None).await.map_err(|e| {
                        format!(
                            "{backend}, {page_tokens}-token pages, concurrency {concurrency}, \
                             {prompt_tokens}-token prompts: {e}"
                        )
                    })?;
                    let p = Point {
                        page_tokens,
                        concurrency,
                        prompt_tokens,
                        report,
                    };
                    each(&p);
                    points.push(p);
                }
            }
        }
    }
    Ok(points)
}

/// The series of a plot: one per (backend, concurrency, prompt length), its points by page size.
fn series(points: &[Point], y: impl Fn(&Report) -> f64) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for p in points {
        let name = format!(
            "{} c={} prompt={}",
            p.report.backend, p.concurrency, p.prompt_tokens
        );
        let at = (f64::from(p.page_tokens).log2(), y(&p.report));
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => v.push(at),
            None => out.push((name, vec![at])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Draws `points` into an SVG file at `path`: GB/s on the left, p99 of decode's expect to
/// Complete (ms) on the right, both against tokens per page (log scale).
///
/// # Errors
/// When the file cannot be drawn or written.
pub fn plot(points: &[Point], path: &Path) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(600);
    // The x axis is log2 of the page size, labelled with the sizes themselves.
    let pages: Vec<f64> = points
        .iter()
        .map(|p| f64::from(p.page_tokens).log2())
        .collect();
    let lo = pages.iter().copied().fold(f64::INFINITY, f64::min).max(0.0) - 0.25;
    let hi = pages.iter().copied().fold(0.0, f64::max).max(lo + 0.5) + 0.25;
    let ticks = (hi - lo).floor() as usize + 1;
    // A panel's title, y-axis label and value.
    type Panel = (&'static str, &'static str, fn(&Report) -> f64);
    let panels: [Panel; 2] = [
        ("Transfer bandwidth", "GB/s", |r| r.gbps),
        ("Request latency p99", "ms (expect to Complete)", |r| {
            r.latency_p99_us / 1000.0
        }),
    ];
    for (area, (title, label, y)) in [&left, &right].into_iter().zip(panels) {
        let lines = series(points, y);
        let top = lines
            .iter()
            .flat_map(|(_, v)| v.iter().map(|p| p.1))
            .fold(0.0, f64::max)
            .max(1e-3)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(lo..hi, 0.0..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_labels(ticks)
            .x_label_formatter(&|x| format!("{}", 2f64.powf(*x).round()))
            .x_desc("tokens per page")
            .y_desc(label)
            .draw()
            .map_err(|e| err(&e))?;
        for (i, (name, v)) in lines.into_iter().enumerate() {
            let color = Palette99::pick(i).stroke_width(2);
            chart
                .draw_series(LineSeries::new(v.clone(), color))
                .map_err(|e| err(&e))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], Palette99::pick(i))
                });
            chart
                .draw_series(
                    v.into_iter()
                        .map(|p| Circle::new(p, 3, Palette99::pick(i).filled())),
                )
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes `sweep.json` and `sweep.svg` into `dir` (made if missing).
///
/// # Errors
/// When the folder or a file cannot be written.
pub fn write(points: &[Point], dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let json = serde_json::to_string_pretty(points).map_err(|e| e.to_string())?;
    let path = dir.join("sweep.json");
    std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    plot(points, &dir.join("sweep.svg"))
}
