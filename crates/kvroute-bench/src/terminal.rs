//! What `kvroute bench` prints when it ends: per workload, a table of the policies (hit rate,
//! TTFT p50 and p99, goodput) and a line on what the worst TTFT tail was made of, computed
//! from the run's own records: how much of the slowest requests' prompts was cached, and how
//! many requests their worker was already serving while another worker served none.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::WorkloadResult;
use crate::run::{RequestRecord, RunData};
use crate::summary::Summary;

/// What the slowest requests of a run had in common.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tail {
    /// How many requests: the slowest 5% of the measured ones, at least 3.
    pub requests: usize,
    /// Their mean share of the prompt the worker had cached.
    pub cached_share: f64,
    /// Their mean count of other requests in flight on their worker when they were sent.
    pub busy_own: f64,
    /// The share of them sent while some other worker had nothing in flight.
    pub idle_elsewhere: f64,
}

impl Tail {
    /// The slowest requests of `data` by TTFT, outside the warm-up (`None`: too few).
    pub fn of(data: &RunData) -> Option<Self> {
        let workers: BTreeSet<&str> =
            data.records.iter().filter_map(|r| r.worker.as_deref()).collect();
        let mut measured: Vec<&RequestRecord> =
            data.records.iter().filter(|r| !r.warmup && r.ttft_ms.is_some()).collect();
        if measured.len() < 3 || workers.len() < 2 {
            return None;
        }
        measured
            .sort_by(|a, b| b.ttft_ms.partial_cmp(&a.ttft_ms).unwrap_or(std::cmp::Ordering::Equal));
        let n = (measured.len() / 20).max(3);
        let slowest = &measured[..n];
        let in_flight = |at: f64, worker: &str, except: usize| {
            data.records
                .iter()
                .filter(|o| o.index != except && o.worker.as_deref() == Some(worker))
                .filter(|o| o.sent_at <= at && at < o.sent_at + o.e2e_ms.unwrap_or(0.0) / 1000.0)
                .count()
        };
        let (mut cached, mut busy, mut idle) = (0.0, 0.0, 0usize);
        for r in slowest {
            let share = match (r.cached_tokens, r.prompt_tokens) {
                (Some(c), Some(p)) if p > 0 => c as f64 / p as f64,
                _ => 0.0,
            };
            cached += share;
            let own = r.worker.as_deref().unwrap_or_default();
            busy += in_flight(r.sent_at, own, r.index) as f64;
            idle += usize::from(
                workers.iter().any(|w| *w != own && in_flight(r.sent_at, w, r.index) == 0),
            );
        }
        let n_f = n as f64;
        Some(Self {
            requests: n,
            cached_share: cached / n_f,
            busy_own: busy / n_f,
            idle_elsewhere: idle as f64 / n_f,
        })
    }
}

/// Where a run's requests went against where their prompt was cached: a request *moved*
/// when another worker had computed more of its prompt's blocks before it was sent (by every
/// earlier request's blocks, none evicted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moves {
    /// Requests outside the warm-up whose prompt some worker had computed a block of.
    pub cached_somewhere: usize,
    /// Of those, the ones sent to a worker holding less of it than another.
    pub moved: usize,
}

impl Moves {
    pub fn of(data: &RunData) -> Self {
        let mut sent: Vec<&RequestRecord> = data.records.iter().collect();
        sent.sort_by_key(|r| r.sent_order);
        let mut held: std::collections::BTreeMap<&str, std::collections::HashSet<u64>> =
            std::collections::BTreeMap::new();
        let mut moves = Self { cached_somewhere: 0, moved: 0 };
        for r in sent {
            let Some(worker) = r.worker.as_deref() else { continue };
            let prefix = |blocks: &std::collections::HashSet<u64>| {
                r.prompt_blocks.iter().take_while(|b| blocks.contains(b)).count()
            };
            let best = held.values().map(prefix).max().unwrap_or(0);
            let own = held.get(worker).map_or(0, prefix);
            if !r.warmup && best > 0 {
                moves.cached_somewhere += 1;
                moves.moved += usize::from(own < best);
            }
            held.entry(worker).or_default().extend(r.computed_blocks.iter().copied());
        }
        moves
    }

    /// The sentence on it for a newcomer, of the policy `label`.
    pub fn sentence(self, label: &str) -> Option<String> {
        if self.cached_somewhere > 0 && self.moved == 0 {
            return Some(format!(
                "{label} sent each of the {} requests whose prompt a worker had cached to the worker holding the most of it: no other was predicted to answer sooner once its copy's evictions were priced.",
                self.cached_somewhere
            ));
        }
        (self.cached_somewhere > 0).then(|| {
            format!(
                "{label} sent {} of the {} requests whose prompt a worker had cached to a worker holding less of it: there, by its engine model, they would start sooner than queued behind the holder, with what the copy evicts priced; the other {} stayed with their cached prefix.",
                self.moved,
                self.cached_somewhere,
                self.cached_somewhere - self.moved,
            )
        })
    }
}

/// Answered requests per second outside the warm-up whose TTFT met `slo_ms`.
pub fn goodput(data: &RunData, slo_ms: f64) -> f64 {
    let measured: Vec<&RequestRecord> = data.records.iter().filter(|r| !r.warmup).collect();
    let span = match (
        measured.iter().map(|r| r.sent_at).reduce(f64::min),
        measured.iter().map(|r| r.sent_at + r.e2e_ms.unwrap_or(0.0) / 1000.0).reduce(f64::max),
    ) {
        (Some(a), Some(b)) if b > a => b - a,
        _ => return 0.0,
    };
    let met = measured
        .iter()
        .filter(|r| r.error.is_none() && r.ttft_ms.is_some_and(|t| t <= slo_ms))
        .count();
    met as f64 / span
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

/// The summary printed at the end of a bench: one table per workload and rate, each followed
/// by what its worst TTFT tail was made of.
pub fn render(results: &[WorkloadResult], slo_ms: f64) -> String {
    let mut out = String::new();
    for result in results {
        let mut rate = result.rate.map(|r| format!(" at {r} req/s")).unwrap_or_default();
        if result.run > 0 {
            rate += &format!(", run {}", result.run + 1);
        }
        let _ = writeln!(out, "\n{}{rate}:", result.workload.kind);
        let _ = writeln!(
            out,
            "  {:<20} {:>8} {:>10} {:>10} {:>14}",
            "policy", "hit rate", "TTFT p50", "TTFT p99", "goodput"
        );
        for (data, s) in &result.runs {
            let _ = writeln!(
                out,
                "  {:<20} {:>8} {:>7} ms {:>7} ms {:>8.1} req/s",
                s.label,
                s.hit_rate.map_or_else(|| "-".to_owned(), |h| format!("{h:.3}")),
                ms(s.ttft_ms.p50),
                ms(s.ttft_ms.p99),
                goodput(data, slo_ms),
            );
        }
        let _ = writeln!(out, "  (goodput: answered requests per second with TTFT <= {slo_ms} ms)");
        if let Some(line) = explain(&result.runs) {
            let _ = writeln!(out, "  {line}");
        }
        let kv = result.runs.iter().find(|(_, s)| s.label == "kv");
        if let Some(line) = kv.and_then(|(data, s)| Moves::of(data).sentence(&s.label)) {
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}

/// What the worst TTFT p99 was made of, against the best one's, when they differ by more than
/// a tenth.
fn explain(runs: &[(RunData, Summary)]) -> Option<String> {
    let p99 = |s: &Summary| s.ttft_ms.p99.unwrap_or(f64::NAN);
    let by_p99 = |a: &&(RunData, Summary), b: &&(RunData, Summary)| {
        p99(&a.1).partial_cmp(&p99(&b.1)).unwrap_or(std::cmp::Ordering::Equal)
    };
    let best = runs.iter().filter(|(_, s)| p99(s).is_finite()).min_by(by_p99)?;
    let worst = runs.iter().filter(|(_, s)| p99(s).is_finite()).max_by(by_p99)?;
    let ratio = p99(&worst.1) / p99(&best.1);
    if ratio < 1.1 {
        return None;
    }
    let (w, b) = (Tail::of(&worst.0)?, Tail::of(&best.0)?);
    let mut line = format!(
        "{}'s TTFT p99 is {ratio:.2}x {}'s. Its {} slowest requests had {:.0}% of their prompt cached and found {:.1} requests in flight on their worker; {:.0}% of them were sent while another worker had none. {}'s slowest had {:.0}% cached and {:.1} in flight.",
        worst.1.label,
        best.1.label,
        w.requests,
        w.cached_share * 100.0,
        w.busy_own,
        w.idle_elsewhere * 100.0,
        best.1.label,
        b.cached_share * 100.0,
        b.busy_own,
    );
    if w.cached_share > b.cached_share + 0.25 && w.busy_own > b.busy_own && w.idle_elsewhere >= 0.5
    {
        line.push_str(&format!(
            " {} kept them with their cached prefix, queued, rather than prefill them whole on an idle worker: on this load a full prefill is cheaper than the wait, which its cost priced the other way.",
            worst.1.label
        ));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        index: usize,
        worker: &str,
        sent_at: f64,
        ttft: f64,
        e2e: f64,
        cached: u64,
    ) -> RequestRecord {
        RequestRecord {
            index,
            sent_order: index,
            warmup: false,
            sent_at,
            ttft_ms: Some(ttft),
            e2e_ms: Some(e2e),
            output_tokens: 8,
            prompt_tokens: Some(100),
            cached_tokens: Some(cached),
            worker: Some(worker.to_owned()),
            ..RequestRecord::default()
        }
    }

    fn data(records: Vec<RequestRecord>) -> RunData {
        RunData {
            label: "x".to_owned(),
            records,
            samples: Vec::new(),
            stats_start: Vec::new(),
            stats_end: Vec::new(),
            wall_secs: 1.0,
            drifts: None,
            ttft_error: None,
            flow: Default::default(),
        }
    }

    #[test]
    fn the_tail_counts_what_its_slowest_requests_waited_behind() {
        // Worker a serves four overlapping requests; b serves one, early, and is idle after.
        let run = data(vec![
            record(0, "b", 0.0, 5.0, 10.0, 0),
            record(1, "a", 0.100, 5.0, 100.0, 90),
            record(2, "a", 0.110, 30.0, 100.0, 90),
            record(3, "a", 0.120, 40.0, 100.0, 90),
            record(4, "a", 0.130, 50.0, 100.0, 90),
        ]);
        let tail = Tail::of(&run).unwrap();
        assert_eq!(tail.requests, 3);
        assert!((tail.cached_share - 0.9).abs() < 1e-9);
        // Sent at 0.110, 0.120, 0.130: 1, 2 and 3 others in flight on a.
        assert!((tail.busy_own - 2.0).abs() < 1e-9, "{tail:?}");
        assert!((tail.idle_elsewhere - 1.0).abs() < 1e-9);
        // Goodput at 35 ms: requests 0-2 met it, over the 0.0..0.230 s the run spanned.
        assert!((goodput(&run, 35.0) - 3.0 / 0.23).abs() < 1e-6);
    }

    #[test]
    fn a_request_moved_when_another_worker_held_more_of_its_prompt() {
        let blocks = |i: usize, prompt: &[u64], computed: &[u64], worker: &str| RequestRecord {
            sent_order: i,
            prompt_blocks: prompt.to_vec(),
            computed_blocks: computed.to_vec(),
            ..record(i, worker, i as f64, 1.0, 1.0, 0)
        };
        let run = data(vec![
            // Nothing cached anywhere yet: not counted.
            blocks(0, &[1, 2], &[1, 2, 3], "a"),
            // With its cached prefix on a; then moved to b, which held less; then on b with
            // what it computed there.
            blocks(1, &[1, 2, 4], &[1, 2, 4], "a"),
            blocks(2, &[1, 2, 5], &[1, 2, 5], "b"),
            blocks(3, &[1, 2, 5, 6], &[], "b"),
        ]);
        let moves = Moves::of(&run);
        assert_eq!(moves, Moves { cached_somewhere: 3, moved: 1 });
        let line = moves.sentence("kv").unwrap();
        assert!(line.starts_with("kv sent 1 of the 3 requests") && line.contains("other 2"));
        assert_eq!(Moves::of(&data(Vec::new())).sentence("kv"), None);
    }

    #[test]
    fn a_tail_needs_two_workers_and_three_requests() {
        assert_eq!(Tail::of(&data(vec![record(0, "a", 0.0, 1.0, 1.0, 0)])), None);
        let one_worker = (0..5).map(|i| record(i, "a", i as f64, 1.0, 1.0, 0)).collect();
        assert_eq!(Tail::of(&data(one_worker)), None);
    }
}
