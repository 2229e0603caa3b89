//! The router checks itself: each answered request's predicted cached tokens (what the index
//! said the chosen worker holds) against the engine's own `cached_tokens`, per worker.
//!
//! - **Drift**: a worker whose predictions run over what it serves has an index that no longer
//!   matches its cache (events lost, another hash seed or template, a restart missed). Over the
//!   last [`WINDOW`] answered requests routed to it, [`DRIFT_OVER`] or more over-predictions
//!   mark it drifted. Why these: an over-prediction also happens legitimately when a block is
//!   evicted between the decision and the request's arrival; under the default bench's eviction
//!   pressure that is 3% of requests (22 of 672 in the multi-turn run), so half of a window of
//!   20 is a signal no healthy worker gives, and a worker whose every prediction is wrong is
//!   caught within 10-20 of its requests (well inside the 50 asked for).
//!   A drifted worker is **resynchronised**: its blocks are cleared and its subscription asked
//!   to replay what its engine still buffers; until [`RECOVER`] answers in a row are not over,
//!   its overlaps count half in routing.
//! - **Silence**: a worker that answered [`SILENT_AFTER`] requests that each made its engine
//!   compute a full block it did not hold (prompt tokens beyond its cached ones by two blocks
//!   or more: one of them full and new) while its event stream delivered nothing (an engine
//!   started without KV events, a publisher on another port) is flagged. Answers served from
//!   cache store nothing new and say nothing: a fleet that replays known conversations is
//!   quiet, not silent (`kvroute bench` run twice against one `kvroute serve` flagged every
//!   worker before this rule).

use std::collections::VecDeque;
use std::time::Instant;

use kvroute_core::WorkerId;
use serde::Serialize;

/// Answered requests per worker the drift check looks at.
pub const WINDOW: usize = 20;
/// Over-predictions within [`WINDOW`] that mark a worker drifted.
pub const DRIFT_OVER: usize = 10;
/// Answers in a row without over-prediction that end a drift.
pub const RECOVER: usize = 8;
/// Requests answered without a single event before a worker is flagged silent.
pub const SILENT_AFTER: u64 = 20;

/// How one prediction compared with what the engine served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Exact,
    /// The router expected more cached tokens than the engine had.
    Over,
    Under,
}

impl Outcome {
    pub fn of(predicted: u64, actual: u64) -> Self {
        match predicted.cmp(&actual) {
            std::cmp::Ordering::Equal => Self::Exact,
            std::cmp::Ordering::Greater => Self::Over,
            std::cmp::Ordering::Less => Self::Under,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Over => "over",
            Self::Under => "under",
        }
    }
}

/// One worker's record, as `/workers` shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CheckStatus {
    pub drifted: bool,
    /// Times it was found drifted (and resynchronised).
    pub drifts: u64,
    /// Answered requests, and how their predictions went.
    pub answered: u64,
    pub exact: u64,
    pub over: u64,
    pub under: u64,
    /// Serving without publishing events.
    pub silent: bool,
    /// Answers predicted to load from a tier below the GPU, per tier.
    pub tiers: TierChecks,
    #[serde(skip)]
    window: VecDeque<Outcome>,
    #[serde(skip)]
    answered_since_event: u64,
    #[serde(skip)]
    last_event: Option<Instant>,
}

/// Answers whose prediction counted tokens from one lower tier: how many, how many of them
/// the engine served exactly as predicted, and the tokens predicted from the tier. Engines
/// report their cached tokens whole, so an answer is exact or not as a whole: a tier whose
/// answers are rarely exact while the others' are has a price or an index that is off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierCheck {
    pub answered: u64,
    pub exact: u64,
    pub predicted_tokens: u64,
}

/// [`TierCheck`] of host memory, disk and the shared store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierChecks {
    pub host: TierCheck,
    pub disk: TierCheck,
    pub external: TierCheck,
}

impl TierChecks {
    /// The tiers' names, as metrics label them, in the order of the router's tier runs.
    pub const NAMES: [&'static str; 3] = ["host", "disk", "external"];

    /// Counts an answer predicted with `tokens` from each tier that came out as `outcome`.
    pub fn record(&mut self, tokens: [u64; 3], outcome: Outcome) {
        for (tier, n) in
            [&mut self.host, &mut self.disk, &mut self.external].into_iter().zip(tokens)
        {
            if n > 0 {
                tier.answered += 1;
                tier.exact += u64::from(outcome == Outcome::Exact);
                tier.predicted_tokens += n;
            }
        }
    }
}

/// What a recorded answer changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    None,
    /// Now drifted: resynchronise it.
    Drifted,
    /// Its predictions agree again.
    Recovered,
    /// Now flagged silent.
    Silent,
}

impl CheckStatus {
    /// Records one answer of a request predicted at `predicted` cached tokens that the engine
    /// served `actual` of; `stores` tells whether the engine must have stored a new block for
    /// it (only those count towards silence).
    pub fn record(&mut self, predicted: u64, actual: u64, stores: bool) -> (Outcome, Change) {
        let outcome = Outcome::of(predicted, actual);
        self.answered += 1;
        match outcome {
            Outcome::Exact => self.exact += 1,
            Outcome::Over => self.over += 1,
            Outcome::Under => self.under += 1,
        }
        self.window.push_back(outcome);
        if self.window.len() > WINDOW {
            self.window.pop_front();
        }
        if stores {
            self.answered_since_event += 1;
        }
        let change = if self.drifted {
            let recent = self.window.iter().rev().take(RECOVER);
            if self.window.len() >= RECOVER && recent.clone().all(|o| *o != Outcome::Over) {
                self.drifted = false;
                Change::Recovered
            } else {
                Change::None
            }
        } else if self.window.iter().filter(|o| **o == Outcome::Over).count() >= DRIFT_OVER {
            self.drifted = true;
            self.drifts += 1;
            // Judge the resynchronised index on its own answers.
            self.window.clear();
            Change::Drifted
        } else {
            Change::None
        };
        if change == Change::None && !self.silent && self.answered_since_event >= SILENT_AFTER {
            self.silent = true;
            return (outcome, Change::Silent);
        }
        (outcome, change)
    }

    /// The worker's event stream delivered something.
    pub fn event_seen(&mut self, now: Instant) {
        self.last_event = Some(now);
        self.answered_since_event = 0;
        self.silent = false;
    }
}

/// Every worker's record.
#[derive(Debug, Default)]
pub struct Checks {
    pub workers: std::collections::BTreeMap<WorkerId, CheckStatus>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_over_predicts_drifts_and_recovers() {
        let mut c = CheckStatus::default();
        // Healthy: exact answers with the odd race-with-eviction over-prediction.
        for k in 0..200 {
            let (_, change) = c.record(32, if k % 25 == 0 { 16 } else { 32 }, true);
            assert_eq!(change, Change::None, "request {k}");
            if k % 5 == 0 {
                c.event_seen(Instant::now());
            }
        }
        // Its index goes stale: every prediction over.
        // (Its events keep flowing: it is not silent.)
        let drifted_at = (1..=50).find(|_| {
            c.event_seen(Instant::now());
            c.record(64, 16, true).1 == Change::Drifted
        });
        assert!(drifted_at.is_some_and(|n| n <= 20), "{drifted_at:?}");
        assert!(c.drifted);
        for _ in 0..RECOVER - 1 {
            c.event_seen(Instant::now());
            assert_eq!(c.record(16, 16, true).1, Change::None);
        }
        assert_eq!(c.record(0, 16, true).1, Change::Recovered, "under is not drift");
        assert_eq!((c.drifts, c.drifted), (1, false));
    }

    #[test]
    fn tiers_count_the_answers_predicted_from_them() {
        let mut t = TierChecks::default();
        t.record([32, 0, 0], Outcome::Exact);
        t.record([16, 0, 48], Outcome::Over);
        t.record([0, 0, 0], Outcome::Exact);
        assert_eq!(t.host, TierCheck { answered: 2, exact: 1, predicted_tokens: 48 });
        assert_eq!(t.disk, TierCheck::default());
        assert_eq!(t.external, TierCheck { answered: 1, exact: 0, predicted_tokens: 48 });
    }

    #[test]
    fn serving_without_events_is_silence() {
        let mut c = CheckStatus::default();
        for _ in 0..SILENT_AFTER - 1 {
            assert_eq!(c.record(0, 0, true).1, Change::None);
        }
        assert_eq!(
            c.record(0, 0, false).1,
            Change::None,
            "an answer that stores nothing says nothing"
        );
        assert_eq!(c.record(0, 0, true).1, Change::Silent);
        assert!(c.silent);
        c.event_seen(Instant::now());
        assert!(!c.silent);
    }
}
