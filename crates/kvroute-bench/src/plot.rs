//! SVG plots (plotters' SVG backend, no font files needed): TTFT CDF per policy, hit rate per
//! policy against the best achievable, and each worker's requests and KV usage over time.

use std::path::Path;

use plotters::coord::combinators::IntoLogRange;
use plotters::coord::ranged1d::{IntoSegmentedCoord, SegmentValue};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::WorkloadResult;
use crate::run::Sample;
use crate::stats::cdf_points;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

pub(crate) fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// plotters' errors are not `Send`; keep their message.
pub(crate) fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("plotting: {e}")
}

/// Draws the plots of one workload into `out`; returns (title, file name) pairs.
pub fn workload_plots(
    out: &Path,
    slug: &str,
    result: &WorkloadResult,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut files = Vec::new();
    let ttft: Vec<(String, Vec<f64>)> = result
        .runs
        .iter()
        .map(|(data, s)| {
            let v = data
                .records
                .iter()
                .filter(|r| !r.warmup && r.error.is_none())
                .filter_map(|r| r.ttft_ms)
                .collect();
            (s.label.clone(), v)
        })
        .collect();
    let name = format!("{slug}-ttft-cdf.svg");
    ttft_cdf(&out.join(&name), &format!("{slug}: time to first token"), &ttft)?;
    files.push(("TTFT CDF".to_owned(), name));

    let bars: Vec<(String, f64)> =
        result.runs.iter().map(|(_, s)| (s.label.clone(), s.hit_rate.unwrap_or(0.0))).collect();
    let best = result.runs.first().map(|(_, s)| s.best_capacity.unwrap_or(s.best_unbounded));
    let name = format!("{slug}-hit-rate.svg");
    hit_rates(&out.join(&name), &format!("{slug}: fleet cache hit rate"), &bars, best)?;
    files.push(("hit rate per policy".to_owned(), name));

    let runs: Vec<(&str, &[Sample])> =
        result.runs.iter().map(|(d, s)| (s.label.as_str(), d.samples.as_slice())).collect();
    if runs.iter().any(|(_, s)| s.iter().any(|x| !x.workers.is_empty())) {
        let name = format!("{slug}-workers.svg");
        workers_over_time(&out.join(&name), slug, &runs)?;
        files.push(("per-worker requests and KV usage over time".to_owned(), name));
    }
    Ok(files)
}

/// The empirical CDF of each series, log-scaled x.
pub fn ttft_cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> anyhow::Result<()> {
    let all = series.iter().flat_map(|(_, v)| v.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let (lo, hi) =
        if lo.is_finite() { (lo.max(0.1) * 0.8, hi.max(1.0) * 1.25) } else { (1.0, 10.0) };
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT, ms (log scale)")
        .y_desc("share of requests")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    for (i, (label, values)) in series.iter().enumerate() {
        let c = color(i);
        let pts = cdf_points(values, 400);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// One policy's runs of a rate sweep: (rate, hit rate, TTFT p99 ms) per run.
#[derive(Debug)]
pub struct SweepSeries {
    pub label: String,
    pub points: Vec<(f64, Option<f64>, Option<f64>)>,
}

/// The median of each rate's values: `(rate, median)`, by rate.
fn medians(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut points = points.to_vec();
    points.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    points
        .chunk_by(|a, b| a.0 == b.0)
        .map(|same| {
            let n = same.len();
            let mid = match n % 2 {
                1 => same[n / 2].1,
                _ => (same[n / 2 - 1].1 + same[n / 2].1) / 2.0,
            };
            (same[0].0, mid)
        })
        .collect()
}

/// Hit rate (top) and TTFT p99 (ms, log scale, bottom) against the arrival rate: a dot per
/// run, a line through each policy's medians.
pub fn rate_sweep(path: &Path, title: &str, series: &[SweepSeries]) -> anyhow::Result<()> {
    let pick = |panel: usize| -> Vec<Vec<(f64, f64)>> {
        let value = |p: &(f64, Option<f64>, Option<f64>)| match panel {
            0 => p.1,
            _ => p.2,
        };
        series
            .iter()
            .map(|s| s.points.iter().filter_map(|p| Some((p.0, value(p)?))).collect())
            .collect()
    };
    let x_hi = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).fold(1.0f64, f64::max);
    let root = SVGBackend::new(path, (900, 840)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let panels = root.split_evenly((2, 1));
    for (panel, area) in panels.iter().enumerate() {
        let data = pick(panel);
        let all = || data.iter().flatten().map(|p| p.1);
        let (lo, hi) = all().fold((f64::INFINITY, 0.0f64), |(l, h), v| (l.min(v), h.max(v)));
        let mut builder = ChartBuilder::on(area);
        builder.margin(16).x_label_area_size(44).y_label_area_size(56);
        let x = 0f64..x_hi * 1.05;
        if panel == 0 {
            let lo = if lo.is_finite() { (lo - 0.05).clamp(0.0, 0.9) } else { 0.0 };
            let mut chart = builder.build_cartesian_2d(x, lo..1.0).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("arrival rate, requests/s")
                .y_desc("fleet cache hit rate")
                .draw()
                .map_err(err)?;
            draw_sweep(&mut chart, series, &data)?;
        } else {
            let (lo, hi) =
                if lo.is_finite() { (lo.max(0.1) * 0.8, hi.max(1.0) * 1.25) } else { (1.0, 10.0) };
            let mut chart = builder.build_cartesian_2d(x, (lo..hi).log_scale()).map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("arrival rate, requests/s")
                .y_desc("TTFT p99, ms (log scale)")
                .y_label_formatter(&|y| format!("{y:.0}"))
                .draw()
                .map_err(err)?;
            draw_sweep(&mut chart, series, &data)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// A sweep panel's lines (through the medians) and dots (every run).
fn draw_sweep<'a, Y>(
    chart: &mut ChartContext<
        'a,
        SVGBackend<'a>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
    >,
    series: &[SweepSeries],
    data: &[Vec<(f64, f64)>],
) -> anyhow::Result<()>
where
    Y: Ranged<ValueType = f64>,
{
    for (i, (label, pts)) in series.iter().map(|s| &s.label).zip(data).enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(medians(pts), c.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled()))).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// One bar per policy, the best achievable as a dashed line.
pub fn hit_rates(
    path: &Path,
    title: &str,
    bars: &[(String, f64)],
    best: Option<f64>,
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let n = bars.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        // A segmented 0..k has k + 1 slots (one per value, k included): one per bar.
        .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..1.05)
        .map_err(err)?;
    let labels: Vec<String> = bars.iter().map(|(l, _)| l.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc("cached prompt tokens / prompt tokens")
        .x_labels(n)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()
        .map_err(err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let mut bar = Rectangle::new(
                [(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), *v)],
                color(i).filled(),
            );
            bar.set_margin(0, 0, 12, 12);
            bar
        }))
        .map_err(err)?;
    let label_style =
        TextStyle::from(("sans-serif", 15).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            Text::new(
                format!("{v:.3}"),
                (SegmentValue::CenterOf(i), (v + 0.01).min(1.04)),
                label_style.clone(),
            )
        }))
        .map_err(err)?;
    if let Some(best) = best {
        chart
            .draw_series(DashedLineSeries::new(
                [(SegmentValue::Exact(0), best), (SegmentValue::Last, best)],
                6,
                4,
                BLACK.stroke_width(1),
            ))
            .map_err(err)?
            .label(format!("best achievable {best:.3}"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// A column per policy: requests each worker finished (top) and its KV usage (bottom).
pub fn workers_over_time(
    path: &Path,
    title: &str,
    runs: &[(&str, &[Sample])],
) -> anyhow::Result<()> {
    let cols = runs.len().max(1);
    let root = SVGBackend::new(path, (300 * cols as u32 + 40, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root =
        root.titled(&format!("{title}: per worker, over time"), ("sans-serif", 22)).map_err(err)?;
    let areas = root.split_evenly((2, cols));
    let t_max = runs.iter().flat_map(|(_, s)| s.iter().map(|x| x.t)).fold(1.0f64, f64::max);
    let first = |s: &[Sample], w: usize| {
        s.first().and_then(|x| x.workers.get(w)).map_or(0, |x| x.requests_finished)
    };
    let req_max = runs
        .iter()
        .flat_map(|(_, s)| {
            s.iter().flat_map(move |x| {
                x.workers
                    .iter()
                    .enumerate()
                    .map(move |(w, st)| st.requests_finished.saturating_sub(first(s, w)))
            })
        })
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    for (col, (label, samples)) in runs.iter().enumerate() {
        let workers = samples.iter().map(|s| s.workers.len()).max().unwrap_or(0);
        for row in 0..2 {
            let area = &areas[row * cols + col];
            let (caption, y_max, y_desc) = if row == 0 {
                (format!("{label}: requests served"), req_max * 1.05, "requests")
            } else {
                (format!("{label}: KV usage, {SMOOTH}-sample mean"), 1.0, "share of blocks")
            };
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 15))
                .margin(8)
                .x_label_area_size(30)
                .y_label_area_size(44)
                .build_cartesian_2d(0f64..t_max, 0f64..y_max)
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("s")
                .y_desc(y_desc)
                .x_labels(5)
                .y_labels(5)
                .draw()
                .map_err(err)?;
            for w in 0..workers {
                let c = color(w);
                let base = first(samples, w);
                let pts: Vec<(f64, f64)> = if row == 0 {
                    samples
                        .iter()
                        .filter_map(|s| {
                            let st = s.workers.get(w)?;
                            Some((s.t, st.requests_finished.saturating_sub(base) as f64))
                        })
                        .collect()
                } else {
                    let usage: Vec<(f64, f64)> = samples
                        .iter()
                        .filter_map(|s| Some((s.t, s.workers.get(w)?.kv_cache_usage)))
                        .collect();
                    rolling_mean(&usage, SMOOTH)
                };
                let series =
                    chart.draw_series(LineSeries::new(pts, c.stroke_width(2))).map_err(err)?;
                if row == 0 && col == 0 {
                    series.label(format!("worker {w}")).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                    });
                }
            }
            if row == 0 && col == 0 && workers > 0 {
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 12))
                    .draw()
                    .map_err(err)?;
            }
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Samples averaged in the KV usage panels (instantaneous usage swings with every request).
const SMOOTH: usize = 8;

/// Each point's value replaced by the mean of the last `n` values (fewer at the start).
fn rolling_mean(points: &[(f64, f64)], n: usize) -> Vec<(f64, f64)> {
    let n = n.max(1);
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(t, v))| {
            sum += v;
            if i >= n {
                sum -= points[i - n].1;
            }
            (t, sum / (i + 1).min(n) as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::WorkerStats;

    #[test]
    fn rolling_mean_of_the_last_values() {
        let pts = [(0.0, 1.0), (1.0, 3.0), (2.0, 5.0), (3.0, 7.0)];
        assert_eq!(rolling_mean(&pts, 2), vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]);
        assert_eq!(rolling_mean(&pts, 1), pts.to_vec());
        assert!(rolling_mean(&[], 3).is_empty());
    }

    #[test]
    fn plots_are_svg() {
        let dir = std::env::temp_dir().join(format!("kvroute-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let series = vec![("kv".to_owned(), vec![10.0, 20.0, 30.0]), ("rr".to_owned(), vec![40.0])];
        ttft_cdf(&dir.join("a.svg"), "t", &series).unwrap();
        let points = vec![
            (6.0, Some(0.95), Some(90.0)),
            (12.0, Some(0.96), Some(110.0)),
            (12.0, Some(0.60), Some(2_700.0)),
            (12.0, Some(0.97), None),
        ];
        let sweep = [SweepSeries { label: "kv".to_owned(), points }];
        rate_sweep(&dir.join("sweep.svg"), "t", &sweep).unwrap();
        let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
        assert!(svg.contains("TTFT p99") && svg.contains("hit rate"), "{svg}");
        assert_eq!(
            medians(&[(12.0, 3.0), (6.0, 1.0), (12.0, 1.0), (12.0, 2.0)]),
            [(6.0, 1.0), (12.0, 2.0)]
        );
        assert_eq!(medians(&[(6.0, 1.0), (6.0, 2.0)]), [(6.0, 1.5)]);
        hit_rates(&dir.join("b.svg"), "t", &[("kv".into(), 0.9), ("rr".into(), 0.3)], Some(0.95))
            .unwrap();
        hit_rates(&dir.join("one.svg"), "t", &[("kv".into(), 0.9)], None).unwrap();
        let samples: Vec<Sample> = (0..4)
            .map(|i| Sample {
                t: f64::from(i),
                workers: vec![
                    WorkerStats {
                        requests_finished: i as u64,
                        kv_cache_usage: 0.1,
                        ..Default::default()
                    };
                    2
                ],
            })
            .collect();
        workers_over_time(&dir.join("c.svg"), "t", &[("kv", &samples), ("rr", &samples)]).unwrap();
        for f in ["a.svg", "b.svg", "c.svg"] {
            let text = std::fs::read_to_string(dir.join(f)).unwrap();
            assert!(text.starts_with("<svg") && text.contains("</svg>"), "{f}");
        }
        let b = std::fs::read_to_string(dir.join("b.svg")).unwrap();
        assert!(b.contains("0.900") && b.contains("best achievable 0.950"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
