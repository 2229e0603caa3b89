//! What a churn run shows: failures, each change's newcomers and leavers, the hit rate through
//! it, and whether a removed worker left anything behind; the report and its plot.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvroute_core::WorkerId;
use kvroute_router::RouterState;
use plotters::prelude::*;
use serde::Serialize;

use super::fleet::Engines;
use super::plan::{ChurnPlan, ChurnSource, ChurnVia, Plan};
use crate::plot::{color, err};
use crate::run::{RequestRecord, RunData};

/// Seconds of each hit-rate window (windows start every second).
const WINDOW: f64 = 10.0;
/// How close to the steady state the hit rate must come back.
const WITHIN: f64 = 0.02;

/// When each worker was first ready, seen draining and gone (seconds from the run's start).
#[derive(Debug, Default)]
pub(super) struct Timeline {
    pub(super) t0: Option<tokio::time::Instant>,
    pub(super) ready: BTreeMap<WorkerId, f64>,
    pub(super) draining: BTreeMap<WorkerId, f64>,
    pub(super) gone: BTreeMap<WorkerId, f64>,
}

/// A worker that joined.
#[derive(Clone, Debug, Serialize)]
pub struct JoinFigures {
    pub worker: u64,
    /// From the change to ready (events caught up, load report, parity probe).
    pub ready_after_s: Option<f64>,
    /// From ready to the first request placed on it.
    pub first_decision_after_ready_s: Option<f64>,
}

/// A worker that left.
#[derive(Clone, Debug, Serialize)]
pub struct LeaveFigures {
    pub worker: u64,
    /// From the change to the router marking it draining.
    pub draining_after_s: Option<f64>,
    /// Requests sent after it was marked draining that were placed on it (must be 0).
    pub decisions_while_draining: usize,
    /// Its requests that failed.
    pub failed: usize,
    /// From the change to its removal (its requests done).
    pub removed_after_s: Option<f64>,
    /// Nothing of it in `/workers`, the index or `/metrics` at the end.
    pub nothing_left: bool,
}

/// One change.
#[derive(Clone, Debug, Serialize)]
pub struct ChangeFigures {
    pub at: f64,
    pub joined: Vec<JoinFigures>,
    pub left: Vec<LeaveFigures>,
    /// The hit rate of the 15 s before the change.
    pub hit_before: Option<f64>,
    /// The lowest 10 s window in the 30 s after it.
    pub hit_lowest_after: Option<f64>,
    /// The steady state it settles in: the hit rate from 30 s after it to the next change
    /// (or the end).
    pub hit_settled: Option<f64>,
    /// Seconds from the change until the 10 s windows stay within 0.02 of `hit_settled`
    /// (from then to 30 s after the change).
    pub back_within_s: Option<f64>,
}

/// One run.
#[derive(Clone, Debug, Serialize)]
pub struct ChurnRun {
    pub plan: ChurnPlan,
    pub source: ChurnSource,
    pub via: ChurnVia,
    pub requests: usize,
    pub failed: usize,
    pub hit_rate: Option<f64>,
    pub changes: Vec<ChangeFigures>,
    /// (window start, hit rate) every second.
    pub windows: Vec<(f64, f64)>,
}

fn hit(records: &[&RequestRecord]) -> Option<f64> {
    let prompt: u64 = records.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached: u64 = records.iter().filter_map(|r| r.cached_tokens).sum();
    (prompt > 0).then(|| cached as f64 / prompt as f64)
}

fn between(data: &RunData, from: f64, to: f64) -> Vec<&RequestRecord> {
    data.records
        .iter()
        .filter(|r| r.error.is_none() && r.sent_at >= from && r.sent_at < to)
        .collect()
}

fn on(r: &RequestRecord, w: WorkerId) -> bool {
    r.worker.as_deref() == Some(w.0.to_string().as_str())
}

/// Whether the router holds nothing of `w`: no status, no blocks, no label set.
fn nothing_left(router: &RouterState, w: WorkerId) -> bool {
    let label = format!("worker_id=\"{}\"", w.0);
    !router.view().knows_worker(w)
        && router.view().indexed().iter().all(|r| r.worker_id != w)
        && !router.view().render_metrics().contains(&label)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn figures(
    plan_kind: ChurnPlan,
    source: ChurnSource,
    via: ChurnVia,
    plan: &Plan,
    engines: &Engines,
    data: &RunData,
    t: &Timeline,
    router: &RouterState,
) -> ChurnRun {
    let end = data.records.iter().map(|r| r.sent_at).fold(0.0, f64::max);
    let windows: Vec<(f64, f64)> = (0..(end - WINDOW).max(0.0) as usize + 1)
        .filter_map(|s| Some((s as f64, hit(&between(data, s as f64, s as f64 + WINDOW))?)))
        .collect();
    let changes = plan
        .changes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let next = plan.changes.get(i + 1).map_or(end, |n| n.at);
            let joined = c
                .join
                .iter()
                .map(|&k| {
                    let w = engines.id(k);
                    let ready = t.ready.get(&w).copied();
                    let first = data
                        .records
                        .iter()
                        .filter(|r| on(r, w))
                        .map(|r| r.sent_at)
                        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))));
                    JoinFigures {
                        worker: w.0,
                        ready_after_s: ready.map(|r| r - c.at),
                        first_decision_after_ready_s: ready
                            .zip(first)
                            .map(|(r, f)| (f - r).max(0.0)),
                    }
                })
                .collect();
            let left = c
                .leave
                .iter()
                .map(|&k| {
                    let w = engines.id(k);
                    let draining = t.draining.get(&w).copied();
                    LeaveFigures {
                        worker: w.0,
                        draining_after_s: draining.map(|d| d - c.at),
                        decisions_while_draining: data
                            .records
                            .iter()
                            .filter(|r| on(r, w) && draining.is_some_and(|d| r.sent_at > d))
                            .count(),
                        failed: data
                            .records
                            .iter()
                            .filter(|r| on(r, w) && r.error.is_some())
                            .count(),
                        removed_after_s: t.gone.get(&w).map(|g| g - c.at),
                        nothing_left: nothing_left(router, w),
                    }
                })
                .collect();
            let before = hit(&between(data, c.at - 15.0, c.at));
            let settled = hit(&between(data, c.at + 30.0, next));
            // The windows that start in the 30 s after the change (they end within 40 s).
            let after: Vec<(f64, f64)> =
                windows.iter().copied().filter(|(s, _)| *s >= c.at && *s < c.at + 30.0).collect();
            let lowest = after.iter().map(|(_, h)| *h).reduce(f64::min);
            // The first window from which every later one (to 30 s) stays within 0.02.
            let back = settled.and_then(|s| {
                let last_off = after.iter().rposition(|(_, h)| (h - s).abs() > WITHIN);
                match last_off {
                    None => Some(0.0),
                    Some(k) => after.get(k + 1).map(|(t, _)| t - c.at),
                }
            });
            ChangeFigures {
                at: c.at,
                joined,
                left,
                hit_before: before,
                hit_lowest_after: lowest,
                hit_settled: settled,
                back_within_s: back,
            }
        })
        .collect();
    let ok: Vec<&RequestRecord> = data.records.iter().filter(|r| r.error.is_none()).collect();
    ChurnRun {
        plan: plan_kind,
        source,
        via,
        requests: data.records.len(),
        failed: data.records.len() - ok.len(),
        hit_rate: hit(&ok),
        changes,
        windows,
    }
}

fn name(run: &ChurnRun) -> String {
    let s = serde_json::to_value((run.plan, run.source, run.via)).unwrap_or_default();
    let part = |i: usize| s[i].as_str().unwrap_or_default().to_owned();
    format!("{} / {} / {}", part(0), part(1), part(2))
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// `membership.md`, `membership.json` and `membership.svg` in `out`; the report's path.
pub(super) fn write_report(out: &Path, runs: &[ChurnRun]) -> anyhow::Result<PathBuf> {
    std::fs::write(out.join("membership.json"), serde_json::to_vec_pretty(runs)?)?;
    let mut md = String::from("# The fleet changing under load (`kvroute bench --churn`)\n\n");
    md.push_str("| plan / source / via | requests | failed | hit rate | change at | joined: ready after, first decision after ready (s) | left: draining after, decisions while draining, removed after (s), nothing left | hit before | lowest 10 s window in 30 s after | settled (30 s after to next change) | within 0.02 of settled from (s after) |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for run in runs {
        for (i, c) in run.changes.iter().enumerate() {
            let joined: Vec<String> = c
                .joined
                .iter()
                .map(|j| {
                    format!(
                        "{} ({}, {})",
                        j.worker,
                        opt(j.ready_after_s, 2),
                        opt(j.first_decision_after_ready_s, 2)
                    )
                })
                .collect();
            let left: Vec<String> = c
                .left
                .iter()
                .map(|l| {
                    format!(
                        "{} ({}, {}, {}, {})",
                        l.worker,
                        opt(l.draining_after_s, 2),
                        l.decisions_while_draining,
                        opt(l.removed_after_s, 1),
                        if l.nothing_left { "yes" } else { "NO" }
                    )
                })
                .collect();
            let head = match i {
                0 => format!(
                    "{} | {} | {} | {}",
                    name(run),
                    run.requests,
                    run.failed,
                    opt(run.hit_rate, 3)
                ),
                _ => " | | | ".to_owned(),
            };
            let _ = writeln!(
                md,
                "| {head} | {:.0} | {} | {} | {} | {} | {} | {} |",
                c.at,
                joined.join("; "),
                left.join("; "),
                opt(c.hit_before, 3),
                opt(c.hit_lowest_after, 3),
                opt(c.hit_settled, 3),
                opt(c.back_within_s, 0)
            );
        }
    }
    md.push_str("\n![hit rate over time](membership.svg)\n");
    let path = out.join("membership.md");
    std::fs::write(&path, md)?;
    plot(&out.join("membership.svg"), runs)?;
    Ok(path)
}

/// The hit rate of each run's 10 s windows over time, its changes marked.
fn plot(path: &Path, runs: &[ChurnRun]) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (960, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let t_max = runs.iter().flat_map(|r| r.windows.iter().map(|w| w.0)).fold(10.0, f64::max);
    let lo = runs.iter().flat_map(|r| r.windows.iter().map(|w| w.1)).fold(1.0, f64::min);
    let mut chart = ChartBuilder::on(&root)
        .caption("cache hit rate through membership changes (10 s windows)", ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..t_max + WINDOW, (lo - 0.05).clamp(0.0, 0.95)..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("window start, s")
        .y_desc("cached / prompt tokens")
        .draw()
        .map_err(err)?;
    for (i, run) in runs.iter().enumerate() {
        chart
            .draw_series(LineSeries::new(run.windows.iter().copied(), color(i).stroke_width(2)))
            .map_err(err)?
            .label(name(run))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color(i)));
        for c in &run.changes {
            let mark = [(c.at, 0.0), (c.at, 1.0)];
            chart
                .draw_series(DashedLineSeries::new(mark, 4, 4, color(i).stroke_width(1)))
                .map_err(err)?;
        }
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
